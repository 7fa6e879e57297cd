//! Tenants stay apart (issue 18): export names a policy cannot judge are
//! refused before it judges them, in every routing mode; an upstream
//! cannot mint metric series with the error values it sends; and clients
//! are never told the gateway's socket paths. The nbdgw binary, real
//! qemu-nbd upstreams and the raw client throughout; a fake upstream only
//! where qemu-nbd cannot be made to answer reads with a thousand different
//! error values.

mod common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use common::clients::{connect_as, http_get};
use common::pki::ClientDir;
use common::process::NbdgwProcess;
use common::raw::{OptReply, RawClient};
use common::site::PolicySite;
use common::{fake_upstream, free_port, Env, QemuNbd};
use nbdgw::proto::consts::*;
use nbdgw::proto::transmission::ReplyMode;

/// Alice may open exports whose names end in `-public`, and nothing else.
const POLICY: &str = r#"
[[rule]]
exports = ["*-public"]
allow = { cn = ["alice"] }
access = "read-write"
"#;

/// The gateway's files, the policy, and alice's certificate.
struct Site {
    base: PolicySite,
    alice: PathBuf,
}

impl std::ops::Deref for Site {
    type Target = PolicySite;
    fn deref(&self) -> &PolicySite {
        &self.base
    }
}

impl Site {
    fn new() -> Self {
        let base = PolicySite::new("tenants CA", POLICY);
        let alice = base.client("alice", 2);
        Site { base, alice }
    }

    /// The gateway with the policy and `routing` (`--upstream …`,
    /// `--export …` or `--export-dir …`).
    fn gateway(&self, routing: &[&OsStr]) -> NbdgwProcess {
        self.base.gateway(routing, &[])
    }
}

/// Names the policy's `*-public` would admit if judged on a lossy
/// conversion, or on the text before a NUL, each with the refusal text.
const BAD_NAMES: &[(&[u8], &str)] = &[
    (b"\0-public", "export names may not hold a NUL byte"),
    (b"\0\xff-public", "export names may not hold a NUL byte"),
    (b"x-public\0", "export names may not hold a NUL byte"),
    (b"\xff-public", "export names must be UTF-8"),
    (
        b"a\x1b[2J-public",
        "export names may not hold control characters",
    ),
    (
        b"a\n-public",
        "export names may not hold control characters",
    ),
    (
        "a\u{85}-public".as_bytes(),
        "export names may not hold control characters",
    ),
];

/// INFO/GO option data naming `name` as raw bytes, with no info requests.
fn raw_go_data(name: &[u8]) -> Vec<u8> {
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name);
    data.extend_from_slice(&0u16.to_be_bytes());
    data
}

/// Every bad name, by every option naming an export, refused as the
/// option can be: EXPORT_NAME by closing, INFO and GO with ERR_INVALID
/// and the reason; `good` still opens afterwards on the same connection.
fn assert_bad_names_refused(gateway: &NbdgwProcess, alice: &Path, good: &str) {
    for (name, _) in BAD_NAMES {
        let mut c = connect_as(gateway.addr(), alice);
        c.send_option(OPT_EXPORT_NAME, name);
        c.expect_closed();
    }
    let mut c = connect_as(gateway.addr(), alice);
    for (name, why) in BAD_NAMES {
        for option in [OPT_INFO, OPT_GO] {
            let replies = c.option(option, &raw_go_data(name));
            assert_eq!(
                replies,
                [OptReply {
                    option,
                    reply_type: REP_ERR_INVALID,
                    data: why.as_bytes().to_vec(),
                }],
                "{name:?}: {}",
                replies[0].message()
            );
        }
    }
    let replies = c.option(OPT_GO, &raw_go_data(good.as_bytes()));
    let last = replies.last().unwrap();
    assert_eq!(last.reply_type, REP_ACK, "{good}: {}", last.message());
    assert_eq!(c.read(1, 0, 4), b"PPPP");
    c.disconnect();
}

#[test]
fn names_with_nul_control_characters_or_invalid_utf8_are_refused_in_every_routing_mode() {
    let site = Site::new();
    let dir = site.env.path("exports");
    std::fs::create_dir(&dir).unwrap();
    let image = site.env.path("public.img");
    std::fs::write(&image, vec![b'P'; 1 << 20]).unwrap();
    // qemu-nbd serving "" (which alice may not open by name), also found
    // in the directory as "dir-public".
    let upstream = QemuNbd::start_at(dir.join("dir-public.sock"), &image, &[]);

    // One upstream for every name: "" is refused her by name, and a name
    // that the policy admits must not reach qemu-nbd as "" (or as
    // whatever precedes a NUL).
    let single = site.gateway(&[OsStr::new("--upstream"), upstream.socket.as_os_str()]);
    let mut c = connect_as(single.addr(), &site.alice);
    let refused = c.option(OPT_GO, &raw_go_data(b""));
    assert_eq!(refused[0].reply_type, REP_ERR_UNKNOWN);
    // qemu-nbd serves only "", so no good name opens here: the policy's
    // admission of a well-formed name reaches it and it says unknown.
    let relayed = c.option(OPT_INFO, &raw_go_data(b"x-public"));
    assert_eq!(relayed.last().unwrap().reply_type, REP_ERR_UNKNOWN);
    for (name, _) in BAD_NAMES {
        let mut c = connect_as(single.addr(), &site.alice);
        c.send_option(OPT_EXPORT_NAME, name);
        c.expect_closed();
    }
    let mut c = connect_as(single.addr(), &site.alice);
    for (name, why) in BAD_NAMES {
        let replies = c.option(OPT_GO, &raw_go_data(name));
        assert_eq!(
            (replies[0].reply_type, replies[0].message().as_str()),
            (REP_ERR_INVALID, *why),
            "{name:?}"
        );
    }
    drop(single);

    let fixed = format!("fixed-public={}", upstream.socket.display());
    let named = site.gateway(&[OsStr::new("--export"), OsStr::new(&fixed)]);
    assert_bad_names_refused(&named, &site.alice, "fixed-public");
    drop(named);

    let from_dir = site.gateway(&[OsStr::new("--export-dir"), dir.as_os_str()]);
    assert_bad_names_refused(&from_dir, &site.alice, "dir-public");
}

/// The gateway's TLS files from `env`, with `--admin-listen` on `admin`.
fn plain_gateway(env: &Env, admin: u16, routing: &[&OsStr]) -> NbdgwProcess {
    let certs = env.certs();
    let admin = format!("127.0.0.1:{admin}");
    let mut args = vec![
        OsStr::new("--tls-dir"),
        certs.as_os_str(),
        OsStr::new("--admin-listen"),
        OsStr::new(&admin),
    ];
    args.extend_from_slice(routing);
    NbdgwProcess::start(args)
}

/// The fake upstream's answer to every read: an error chunk whose error
/// value is the read's cookie, whatever that is.
fn error_as_cookie(_: usize, read: fake_upstream::Asked) -> fake_upstream::Answer {
    let mut reply = fake_upstream::chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, read.cookie, 6);
    reply.extend_from_slice(&(read.cookie as u32).to_be_bytes());
    reply.extend_from_slice(&0u16.to_be_bytes());
    reply.into()
}

#[test]
fn upstream_error_values_are_counted_by_name_or_as_other() {
    let env = Env::new();
    // A fake: qemu-nbd only ever answers with the few errors it knows.
    let fake = fake_upstream::scripted(&env.path("fake.sock"), 1 << 20, error_as_cookie);
    let admin = free_port();
    let gw = plain_gateway(
        &env,
        admin,
        &[OsStr::new("--upstream"), fake.socket.as_os_str()],
    );
    let mut c = connect_as(gw.addr(), &env.certs());
    c.go(ReplyMode::Structured);
    // A thousand values no NBD error has, then EIO, ENOSPC and EPERM.
    let cookies: Vec<u64> = (1000..2000)
        .chain([EIO, ENOSPC, EPERM].map(u64::from))
        .collect();
    for &cookie in &cookies {
        c.send_request(0, CMD_READ, cookie, 0, 512, &[]);
    }
    for _ in &cookies {
        let reply = c.read_reply(512);
        // The client still gets the upstream's value unchanged.
        assert_eq!(u64::from(reply[0].error_code()), reply[0].cookie);
    }
    c.disconnect();

    let (code, metrics) = http_get(admin, "/metrics");
    assert_eq!(code, 200);
    let series: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("nbdgw_request_errors_total{"))
        .collect();
    let mut expected = vec![
        "nbdgw_request_errors_total{error=\"EIO\"} 1",
        "nbdgw_request_errors_total{error=\"ENOSPC\"} 1",
        "nbdgw_request_errors_total{error=\"EPERM\"} 1",
        "nbdgw_request_errors_total{error=\"other\"} 1000",
    ];
    assert!(
        series.len() == expected.len(),
        "{} series, {} bytes of /metrics",
        series.len(),
        metrics.len()
    );
    let mut series = series.clone();
    series.sort();
    expected.sort();
    assert_eq!(series, expected);
}

/// The message of the one reply to GO for `export`.
fn go_refusal(c: &mut RawClient, export: &str) -> (u32, String) {
    let replies = c.option(OPT_GO, &raw_go_data(export.as_bytes()));
    assert_eq!(replies.len(), 1, "{replies:?}");
    (replies[0].reply_type, replies[0].message())
}

#[test]
fn clients_are_not_told_socket_paths_and_the_log_is() {
    let env = Env::new();
    std::fs::create_dir(env.path("secret-dir")).unwrap();
    let missing = env.path("secret-dir/upstream.sock");
    let admin = free_port();
    let single = plain_gateway(
        &env,
        admin,
        &[OsStr::new("--upstream"), missing.as_os_str()],
    );
    let mut c = connect_as(single.addr(), &env.certs());
    assert_eq!(
        go_refusal(&mut c, ""),
        (
            REP_ERR_SHUTDOWN,
            "nbdgw: upstream NBD server unavailable".to_string()
        )
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let not_ready = loop {
        let (code, body) = http_get(admin, "/readyz");
        if code == 503 && body.contains("upstream") {
            break body;
        }
        assert!(std::time::Instant::now() < deadline, "{code}: {body}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert_eq!(not_ready, "upstream unavailable\n");
    single.wait_for_log("upstream socket unavailable", 1);
    let log = single.log();
    assert!(log.contains(&missing.display().to_string()), "{log}");
    drop(single);

    // A named export whose server is gone: the same for its clients.
    let gone = env.path("secret-dir/vm.sock");
    let export = format!("vm={}", gone.display());
    let named = plain_gateway(
        &env,
        free_port(),
        &[OsStr::new("--export"), OsStr::new(&export)],
    );
    let mut c = connect_as(named.addr(), &env.certs());
    assert_eq!(
        go_refusal(&mut c, "vm"),
        (REP_ERR_SHUTDOWN, "nbdgw: export unavailable".to_string())
    );
    named.wait_for_log("upstream unavailable", 1);
    let log = named.log();
    assert!(log.contains(&gone.display().to_string()), "{log}");
}

/// Review finding: every refused name logs a line of up to 4 KiB, and a
/// connection could go on naming exports for the whole handshake
/// timeout. Past `--max-refused-options` it is closed.
#[test]
fn a_connection_naming_too_many_refused_exports_is_closed() {
    let site = Site::new();
    let image = site.env.path("public.img");
    std::fs::write(&image, vec![b'P'; 1 << 20]).unwrap();
    let upstream = QemuNbd::start_at(site.env.path("nbd.sock"), &image, &[]);
    let gw = site.gateway(&[OsStr::new("--upstream"), upstream.socket.as_os_str()]);
    let mut c = connect_as(gw.addr(), &site.alice);
    let long = "x".repeat(4000);
    for _ in 0..32 {
        let refused = c.option(OPT_INFO, &raw_go_data(long.as_bytes()));
        assert_eq!(refused[0].reply_type, REP_ERR_UNKNOWN);
    }
    c.send_option(OPT_INFO, &raw_go_data(long.as_bytes()));
    c.expect_closed();
    gw.wait_for_log("more export names refused than --max-refused-options", 1);
    let log = gw.log();
    assert_eq!(
        log.matches("refused: the policy does not open").count(),
        33,
        "{log}"
    );
}

/// Issue 27 item 5: two templated rules granting `{ns}/*`, one by URI
/// SAN and one by DNS SAN. A certificate whose URI SAN names namespace
/// `a` and whose DNS SAN names `b` opened both tenants' disks read-write
/// (each rule judged it alone). One certificate is one tenant across all
/// rules now: nbdinfo with that certificate opens neither, while one
/// whose names all say `a` opens `a/db` and not `b/db`.
#[test]
fn a_certificate_naming_two_tenants_in_two_rules_opens_neither() {
    let policy = r#"
[[rule]]
exports = ["{ns}/*"]
allow = { uri = ["spiffe://cluster.local/ns/{ns}/sa/*"] }
access = "read-write"

[[rule]]
exports = ["{ns}/*"]
allow = { dns = ["*.{ns}.svc"] }
access = "read-write"
"#;
    let site = PolicySite::new("two rules CA", policy);
    let dir = site.env.path("exports");
    let mut upstreams = Vec::new();
    for tenant in ["a", "b"] {
        std::fs::create_dir_all(dir.join(tenant)).unwrap();
        let image = site.env.random_image(&format!("{tenant}.img"), 1 << 20, 5);
        upstreams.push(QemuNbd::start_at(
            dir.join(format!("{tenant}/db.sock")),
            &image,
            &[],
        ));
    }
    let client = |name: &str, dns: &str, serial| {
        site.ca
            .client(name, &[dns], &["spiffe://cluster.local/ns/a/sa/x"], serial)
            .client_dir(&site.env.path(name), &site.ca)
    };
    let both = client("both", "vm.b.svc", 11);
    let only_a = client("only-a", "vm.a.svc", 12);
    let gw = site.gateway(&[OsStr::new("--export-dir"), dir.as_os_str()], &[]);
    let size = |who: &Path, export: &str| {
        let uri = format!(
            "nbds://localhost:{}/{export}?tls-certificates={}",
            gw.port,
            who.display()
        );
        common::run(std::process::Command::new("nbdinfo").arg("--size").arg(uri))
    };
    for export in ["a/db", "b/db"] {
        let out = size(&both, export);
        assert!(
            !out.status.success(),
            "the two-tenant certificate opened {export}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    // The refusal says why (hostile review: it did not).
    let log = gw.log();
    assert!(
        log.contains(
            "templated rules grant it nothing: its names bind two tenants across templated rules"
        ),
        "{log}"
    );
    let out = size(&only_a, "a/db");
    assert!(out.status.success(), "{}", common::clients::text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1048576");
    assert!(!size(&only_a, "b/db").status.success());
}

const APART_URI: &str = r#"
[[rule]]
exports = ["{ns}/*", "scratch/{sa}"]
allow = { uri = ["spiffe://cluster.local/ns/{ns}/sa/{sa}"] }
access = "read-write"
"#;

const APART_DNS: &str = r#"
[[rule]]
exports = ["{tenant}/*", "scratch/{sa}"]
allow = { dns = ["{sa}.{tenant}.svc"] }
access = "read-write"
"#;

/// Hostile review of issue 27 items 5 and 7: rules naming the tenant
/// `{ns}` and `{tenant}` but sharing `{sa}` gave a certificate with URI
/// SAN `.../ns/a/sa/x` and DNS SAN `x.b.svc` both `a/db` and `b/db`
/// (nbdinfo opened both). Now neither; the gateway warns of the two rules
/// at start and says why it refuses. A reload dropping the DNS rule was
/// refused as dropping a templated rule; now it is accepted, and the
/// dropped rule still counts: the certificate still opens neither, while
/// one binding only the URI rule opens `a/db`.
#[test]
fn rules_naming_the_tenant_apart_open_nothing_and_may_be_dropped_live() {
    let site = PolicySite::new("apart CA", &format!("{APART_URI}{APART_DNS}"));
    let dir = site.env.path("exports");
    let mut upstreams = Vec::new();
    for tenant in ["a", "b"] {
        std::fs::create_dir_all(dir.join(tenant)).unwrap();
        let image = site.env.random_image(&format!("{tenant}.img"), 1 << 20, 6);
        upstreams.push(QemuNbd::start_at(
            dir.join(format!("{tenant}/db.sock")),
            &image,
            &[],
        ));
    }
    let both = site
        .ca
        .client(
            "both",
            &["x.b.svc"],
            &["spiffe://cluster.local/ns/a/sa/x"],
            11,
        )
        .client_dir(&site.env.path("both"), &site.ca);
    let uri_only = site
        .ca
        .client("uri", &[], &["spiffe://cluster.local/ns/a/sa/x"], 12)
        .client_dir(&site.env.path("uri"), &site.ca);
    let gw = site.gateway(
        &[
            OsStr::new("--export-dir"),
            dir.as_os_str(),
            OsStr::new("--tls-reload-interval"),
            OsStr::new("0"),
        ],
        &[],
    );
    let size = |who: &Path, export: &str| {
        let uri = format!(
            "nbds://localhost:{}/{export}?tls-certificates={}",
            gw.port,
            who.display()
        );
        common::run(std::process::Command::new("nbdinfo").arg("--size").arg(uri))
    };
    let refused_both = || {
        for export in ["a/db", "b/db"] {
            let out = size(&both, export);
            assert!(
                !out.status.success(),
                "the certificate binding a and b opened {export}: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
    };
    refused_both();
    let log = gw.log();
    assert!(
        log.contains("rules 1 (line 2) and 2 (line 7) use placeholder sets in their exports neither of which contains the other"),
        "{log}"
    );
    assert!(
        log.contains("templated rules grant it nothing: its names are bound by templated rules that name the tenant apart"),
        "{log}"
    );

    // Dropping the DNS rule live (during an incident, say).
    std::fs::write(&site.policy, APART_URI).unwrap();
    gw.signal("HUP");
    gw.wait_for_log("access policy reloaded", 1);
    refused_both();
    let out = size(&uri_only, "a/db");
    assert!(out.status.success(), "{}", common::clients::text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1048576");
    assert!(!size(&uri_only, "b/db").status.success());
}

/// Hostile review of issue 27 item 7(b): a reload dropping a templated
/// rule was refused (it could have let in a certificate the one-tenant
/// check kept out), so an operator could not tighten during an incident.
/// Now it is accepted and the dropped rule keeps counting in the check:
/// the certificate naming `a` by URI and `b` by DNS still opens nothing.
#[test]
fn a_reload_dropping_a_templated_rule_is_accepted_and_it_still_counts() {
    let uri_rule = r#"
[[rule]]
exports = ["{ns}/*"]
allow = { uri = ["spiffe://cluster.local/ns/{ns}/sa/*"] }
access = "read-write"
"#;
    let dns_rule = r#"
[[rule]]
exports = ["{ns}/*"]
allow = { dns = ["*.{ns}.svc"] }
access = "read-write"
"#;
    let site = PolicySite::new("drop CA", &format!("{uri_rule}{dns_rule}"));
    let dir = site.env.path("exports");
    std::fs::create_dir_all(dir.join("a")).unwrap();
    let image = site.env.random_image("a.img", 1 << 20, 4);
    let _a = QemuNbd::start_at(dir.join("a/db.sock"), &image, &[]);
    let client = |name: &str, dns: &[&str], serial| {
        site.ca
            .client(name, dns, &["spiffe://cluster.local/ns/a/sa/x"], serial)
            .client_dir(&site.env.path(name), &site.ca)
    };
    let both = client("both", &["vm.b.svc"], 21);
    let only_a = client("only-a", &[], 22);
    let gw = site.gateway(
        &[
            OsStr::new("--export-dir"),
            dir.as_os_str(),
            OsStr::new("--tls-reload-interval"),
            OsStr::new("0"),
        ],
        &[],
    );
    let opens = |who: &Path| {
        let uri = format!(
            "nbds://localhost:{}/a/db?tls-certificates={}",
            gw.port,
            who.display()
        );
        common::run(std::process::Command::new("nbdinfo").arg("--size").arg(uri))
            .status
            .success()
    };
    assert!(!opens(&both));
    assert!(opens(&only_a));

    std::fs::write(&site.policy, uri_rule).unwrap();
    gw.signal("HUP");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let log = loop {
        let log = gw.log();
        if log.contains("access policy reload") {
            break log;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no reload logged: {log}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(log.contains("access policy reloaded"), "{log}");
    assert!(!opens(&both), "the dropped rule stopped counting");
    assert!(opens(&only_a));
}
