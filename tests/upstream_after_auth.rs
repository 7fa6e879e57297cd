//! Upstream resources only after authorization (issue 18, item 8): an
//! identity no rule admits never causes an upstream connection, in any
//! routing mode, whatever options it sends; and every upstream read in
//! negotiation is bounded, so a hung server gets the client a clear error
//! rather than a silent wait for the handshake timeout. The nbdgw binary,
//! a real qemu-nbd (`--shared=1`, behind a counting relay), and a fake
//! upstream that never speaks (a hung server, which qemu-nbd cannot be
//! made into).

mod common;

use std::ffi::OsStr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::clients::connect_as;
use common::process::{NbdgwProcess, UpstreamCounter};
use common::raw::{go_data, RawClient};
use common::site::PolicySite;
use common::{fake_upstream, Env, QemuNbd};
use nbdgw::proto::consts::*;

/// Alice may open `disk`, `vm` and `quiet`; mallory, whom the CA
/// certified too, nothing.
const POLICY: &str = r#"
[[rule]]
exports = ["disk", "vm", "quiet"]
allow = { cn = ["alice"] }
access = "read-write"
"#;

struct Site {
    base: PolicySite,
    alice: PathBuf,
    mallory: PathBuf,
}

impl std::ops::Deref for Site {
    type Target = PolicySite;
    fn deref(&self) -> &PolicySite {
        &self.base
    }
}

impl Site {
    fn new() -> Self {
        let base = PolicySite::new("upstream CA", POLICY);
        let (alice, mallory) = (base.client("alice", 2), base.client("mallory", 3));
        Site {
            base,
            alice,
            mallory,
        }
    }
}

/// Every option an unauthorized client might try, each answered; none
/// naming an export opens it.
fn try_everything(c: &mut RawClient) {
    // Framing may be agreed (by nbdgw itself), the list is empty.
    for option in [OPT_EXTENDED_HEADERS, OPT_STRUCTURED_REPLY] {
        assert!(!c.option(option, &[]).is_empty());
    }
    let list = c.option(OPT_LIST, &[]);
    assert_eq!(list.len(), 1, "{list:?}");
    for (option, data) in [
        (OPT_INFO, go_data("disk", &[])),
        (OPT_GO, go_data("", &[])),
        (OPT_LIST_META_CONTEXT, go_data("disk", &[])),
        (OPT_GO, go_data("disk", &[])),
    ] {
        let replies = c.option(option, &data);
        let last = replies.last().expect("a reply");
        assert_ne!(last.reply_type, REP_ACK, "option {option}: {replies:?}")
    }
}

#[test]
fn an_identity_with_no_rule_never_reaches_the_upstream() {
    let site = Site::new();
    let image = site.env.path("disk.img");
    std::fs::write(&image, vec![b'D'; 1 << 16]).unwrap();
    // One client at a time: a slot held for mallory would shut alice out.
    let qemu = QemuNbd::start_at(
        site.env.path("qemu.sock"),
        &image,
        &["-x", "disk", "--shared=1"],
    );
    let counter = UpstreamCounter::start(&qemu.socket, &site.env.path("counted.sock"));
    let export = format!("disk={}:disk", counter.socket.display());
    let modes: [&[&OsStr]; 2] = [
        &[OsStr::new("--upstream"), counter.socket.as_os_str()],
        &[OsStr::new("--export"), OsStr::new(&export)],
    ];
    for (mode, routing) in modes.into_iter().enumerate() {
        let gw = site.gateway(routing, &[]);
        let mut mallory = connect_as(gw.addr(), &site.mallory);
        try_everything(&mut mallory);
        let mut old_way = connect_as(gw.addr(), &site.mallory);
        old_way.send_option(OPT_EXPORT_NAME, b"disk");
        old_way.expect_closed();
        assert_eq!(
            counter.connections(),
            mode,
            "mode {mode}: mallory reached it"
        );

        // Mallory still connected, alice gets the one slot.
        let mut alice = connect_as(gw.addr(), &site.alice);
        let go = alice.option(OPT_GO, &go_data("disk", &[]));
        assert_eq!(go.last().unwrap().reply_type, REP_ACK, "{go:?}");
        assert_eq!(alice.read(1, 0, 4), b"DDDD");
        assert_eq!(counter.connections(), mode + 1);
        alice.disconnect();
        drop(mallory);
    }
}

/// The final reply to `option` on `name`, and how long it took.
fn answer(gw: &NbdgwProcess, site: &Site, option: u32, name: &str) -> (u32, String, Duration) {
    let mut c = connect_as(gw.addr(), &site.alice);
    let started = Instant::now();
    c.send_option(option, &go_data(name, &[]));
    let reply = c
        .try_read_option_reply()
        .unwrap_or_else(|e| panic!("no reply to option {option} on {name:?}: {e}"));
    (reply.reply_type, reply.message(), started.elapsed())
}

fn silent(env: &Env, name: &str, greets: bool) -> fake_upstream::FakeUpstream {
    fake_upstream::silent(&env.path(name), greets)
}

#[test]
fn a_hung_upstream_gets_the_client_a_clear_error_within_the_bound() {
    let site = Site::new();
    let mute = silent(&site.env, "mute.sock", false);
    let quiet = silent(&site.env, "quiet.sock", true);
    // Far beyond the bound: what the client sees within it is nbdgw's
    // upstream bound at work, not the handshake timeout.
    let long = OsStr::new("--handshake-timeout=60");
    let bound = [("NBDGW_UPSTREAM_TIMEOUT", OsStr::new("1"))];
    let within = Duration::from_secs(4);

    // One upstream that never greets.
    let gw = site.gateway(
        &[OsStr::new("--upstream"), mute.socket.as_os_str(), long],
        &bound,
    );
    let (code, message, took) = answer(&gw, &site, OPT_GO, "disk");
    assert_eq!(
        (code, message.as_str()),
        (REP_ERR_SHUTDOWN, "nbdgw: upstream NBD server unavailable")
    );
    assert!(took < within, "{took:?}");
    gw.wait_for_log("did not accept and greet within 1s (--upstream-timeout)", 1);
    drop(gw);

    // Named exports: one that never greets, one that greets and then
    // never answers an option.
    let vm = format!("vm={}", mute.socket.display());
    let q = format!("quiet={}", quiet.socket.display());
    let gw = site.gateway(
        &[
            OsStr::new("--export"),
            OsStr::new(&vm),
            OsStr::new("--export"),
            OsStr::new(&q),
            long,
        ],
        &bound,
    );
    let (code, message, took) = answer(&gw, &site, OPT_INFO, "vm");
    assert_eq!(
        (code, message.as_str()),
        (REP_ERR_SHUTDOWN, "nbdgw: export unavailable")
    );
    assert!(took < within, "{took:?}");
    let (code, message, took) = answer(&gw, &site, OPT_GO, "quiet");
    assert_eq!(
        (code, message.as_str()),
        (REP_ERR_SHUTDOWN, "nbdgw: upstream NBD server failed")
    );
    assert!(took < within, "{took:?}");
}
