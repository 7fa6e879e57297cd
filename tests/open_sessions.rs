//! What a tenant can do with sessions it already holds (issue 18, items 4
//! and 5): a policy reload that narrows an open session's access ends that
//! session before its next write reaches the disk, and one identity cannot
//! hold every session slot. The nbdgw binary, real qemu-nbd upstreams and
//! the raw client; the image files are read directly to see what reached
//! the disk.

mod common;

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use common::clients::{connect_as, try_connect_as};
use common::process::NbdgwProcess;
use common::raw::RawClient;
use common::site::PolicySite;
use common::{free_port, QemuNbd};
use nbdgw::proto::consts::*;
use nbdgw::proto::transmission::ReplyMode;

/// Alice and bob may both write every export.
const BOTH_WRITE: &str = r#"
[[rule]]
exports = ["*"]
allow = { cn = ["alice", "bob"] }
access = "read-write"
"#;

/// Bob reduced to read-only; alice keeps read-write.
const BOB_READ_ONLY: &str = r#"
[[rule]]
exports = ["*"]
allow = { cn = ["alice"] }
access = "read-write"

[[rule]]
exports = ["*"]
allow = { cn = ["bob"] }
access = "read-only"
"#;

/// Alice's access withdrawn; bob still reads.
const ALICE_WITHDRAWN: &str = r#"
[[rule]]
exports = ["*"]
allow = { cn = ["bob"] }
access = "read-only"
"#;

struct Site(PolicySite);

impl std::ops::Deref for Site {
    type Target = PolicySite;
    fn deref(&self) -> &PolicySite {
        &self.0
    }
}

impl Site {
    fn new(policy: &str) -> Self {
        Site(PolicySite::new("open sessions CA", policy))
    }
}

/// A session on the default export, in transmission with simple replies.
fn session(gateway: &NbdgwProcess, client: &Path) -> RawClient {
    let mut c = connect_as(gateway.addr(), client);
    c.go(ReplyMode::Simple);
    c
}

/// Sends a write and waits for its reply: `Ok` if it succeeded, `Err`
/// saying what came instead (an NBD error, or the connection's end).
fn try_write(c: &mut RawClient, cookie: u64, offset: u64, data: &[u8]) -> Result<(), String> {
    let mut request = c.request_bytes(0, CMD_WRITE, cookie, offset, data.len() as u64);
    request.extend_from_slice(data);
    // A closed session may refuse the bytes or take them into a dead
    // socket; either way the reply below tells.
    let _ = c.stream.write_all(&request).and_then(|()| c.stream.flush());
    let mut reply = [0u8; 16];
    match c.stream.read_exact(&mut reply) {
        Ok(()) => match u32::from_be_bytes(reply[4..8].try_into().unwrap()) {
            0 => Ok(()),
            error => Err(format!("NBD error {error}")),
        },
        Err(e) => Err(format!("closed: {e}")),
    }
}

/// Waits for the reload of the policy file now holding `policy` to be
/// logged for the `count`th time, then a little longer, so that whatever
/// the reload does to open sessions is done.
fn reload(site: &Site, gateway: &NbdgwProcess, policy: &str, count: usize) {
    std::fs::write(&site.policy, policy).unwrap();
    gateway.wait_for_log("access policy reloaded", count);
    std::thread::sleep(Duration::from_millis(300));
}

#[test]
fn a_narrowing_reload_ends_the_sessions_it_narrows_before_their_next_write() {
    let site = Site::new(BOTH_WRITE);
    let (alice, bob) = (site.client("alice", 2), site.client("bob", 3));
    let disk = site.env.filled_image("disk.img", 0, 1 << 20);
    let upstream = QemuNbd::start(&site.env, &disk, &[]);
    let gateway = site.gateway(
        &[
            OsStr::new("--upstream"),
            upstream.socket.as_os_str(),
            OsStr::new("--tls-reload-interval"),
            OsStr::new("1"),
        ],
        &[],
    );
    let mut a = session(&gateway, &alice);
    let mut b = session(&gateway, &bob);
    try_write(&mut a, 1, 0, b"alice-1").unwrap();
    try_write(&mut b, 2, 4096, b"bob-1").unwrap();

    // A reload that narrows neither (the same rules, reworded) keeps both.
    reload(&site, &gateway, &format!("# reworded\n{BOTH_WRITE}"), 1);
    try_write(&mut a, 3, 0, b"alice-2").unwrap();
    try_write(&mut b, 4, 4096, b"bob-2").unwrap();

    // Bob reduced to read-only: his session ends, alice's stays.
    reload(&site, &gateway, BOB_READ_ONLY, 2);
    let refused = try_write(&mut b, 5, 4096, b"bob-3");
    assert!(
        refused.as_ref().is_err_and(|e| e.starts_with("closed")),
        "bob's write after the narrowing reload: {refused:?}"
    );
    try_write(&mut a, 6, 0, b"alice-3").unwrap();

    // Alice withdrawn: her session ends too.
    reload(&site, &gateway, ALICE_WITHDRAWN, 3);
    let refused = try_write(&mut a, 7, 0, b"alice-4");
    assert!(
        refused.as_ref().is_err_and(|e| e.starts_with("closed")),
        "alice's write after the withdrawing reload: {refused:?}"
    );

    std::thread::sleep(Duration::from_millis(300));
    let bytes = std::fs::read(&disk).unwrap();
    assert_eq!(
        &bytes[..7],
        b"alice-3",
        "alice's last write reached the disk"
    );
    assert_eq!(
        &bytes[4096..4101],
        b"bob-2",
        "bob's last write reached the disk"
    );

    let log = gateway.log();
    for (who, was, now) in [
        ("bob", "read-write", "read-only"),
        ("alice", "read-write", "none"),
    ] {
        let line = log
            .lines()
            .find(|l| l.contains("narrowed this session") && l.contains(&format!("CN={who}")))
            .unwrap_or_else(|| panic!("no narrowing line for {who}:\n{log}"));
        assert!(
            line.contains(&format!("was={was}")) && line.contains(&format!("now={now}")),
            "{line}"
        );
    }
    assert!(
        log.contains("access policy narrowed by a reload (--policy-revoke-closes)"),
        "{log}"
    );
}

#[test]
fn with_policy_revoke_closes_off_open_sessions_keep_their_access() {
    let site = Site::new(BOTH_WRITE);
    let bob = site.client("bob", 3);
    let disk = site.env.filled_image("disk.img", 0, 1 << 20);
    let upstream = QemuNbd::start(&site.env, &disk, &[]);
    let gateway = site.gateway(
        &[
            OsStr::new("--upstream"),
            upstream.socket.as_os_str(),
            OsStr::new("--tls-reload-interval"),
            OsStr::new("1"),
            OsStr::new("--policy-revoke-closes"),
            OsStr::new("false"),
        ],
        &[],
    );
    let mut b = session(&gateway, &bob);
    reload(&site, &gateway, BOB_READ_ONLY, 1);
    try_write(&mut b, 1, 0, b"bob-kept").unwrap();
    // New sessions get the narrower policy all the same.
    let mut fresh = session(&gateway, &bob);
    assert_eq!(
        try_write(&mut fresh, 2, 0, b"x"),
        Err(format!("NBD error {EPERM}"))
    );
}

#[test]
fn one_identity_holds_at_most_its_cap_and_another_still_connects() {
    let site = Site::new(BOTH_WRITE);
    let (alice, bob) = (site.client("alice", 2), site.client("bob", 3));
    let disk = site.env.filled_image("disk.img", 0, 1 << 20);
    std::fs::write(&disk, vec![b'D'; 1 << 20]).unwrap();
    let upstream = QemuNbd::start(&site.env, &disk, &[]);
    let admin = free_port();
    let admin_addr = format!("127.0.0.1:{admin}");
    // The cap through its variable, so that the same test runs against a
    // gateway without the flag (which ignores the variable).
    let gateway = site.gateway(
        &[
            OsStr::new("--upstream"),
            upstream.socket.as_os_str(),
            OsStr::new("--max-connections"),
            OsStr::new("4"),
            OsStr::new("--admin-listen"),
            OsStr::new(&admin_addr),
        ],
        &[("NBDGW_MAX_SESSIONS_PER_IDENTITY", OsStr::new("2"))],
    );

    // Alice tries to take every slot with idle sessions: two are hers.
    let mut held = Vec::new();
    let mut refusals = Vec::new();
    for _ in 0..4 {
        let mut c = try_connect_as(gateway.addr(), &alice).expect("TLS handshake");
        let replies = c.option(OPT_GO, &common::raw::go_data("", &[]));
        let last = replies.last().unwrap();
        if last.reply_type == REP_ACK {
            held.push(c);
        } else {
            refusals.push((last.reply_type, last.message()));
        }
    }
    assert_eq!(held.len(), 2, "alice's sessions; refused: {refusals:?}");
    for (reply_type, message) in &refusals {
        assert_eq!(*reply_type, REP_ERR_SHUTDOWN, "{message}");
        assert!(
            message.contains("--max-sessions-per-identity (2) reached"),
            "{message}"
        );
    }

    // Bob still connects and reads, twice over.
    let mut b1 = session(&gateway, &bob);
    let mut b2 = session(&gateway, &bob);
    assert_eq!(b1.read(1, 0, 4), b"DDDD");
    assert_eq!(b2.read(1, 0, 4), b"DDDD");

    // Alice's slots come back when her sessions end.
    for mut c in held.drain(..1) {
        c.disconnect();
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut again = session(&gateway, &alice);
    assert_eq!(again.read(1, 0, 4), b"DDDD");

    let log = gateway.log();
    assert!(
        log.contains("session refused")
            && log.contains("--max-sessions-per-identity (2) reached")
            && log.contains("CN=alice"),
        "{log}"
    );
    let metrics = common::metrics::scrape(admin);
    assert!(
        metrics.contains("nbdgw_sessions_refused_total{reason=\"per_identity\"} 2"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("alice"),
        "an identity in a label: {metrics}"
    );
}
