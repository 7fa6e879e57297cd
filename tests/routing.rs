//! One gateway, many disks: exports routed by name to four real qemu-nbd
//! upstreams (three as sockets in --export-dir, one of them in a tenant's
//! subdirectory, one appearing mid-test; one given with --export under
//! another upstream name), and a --policy file
//! deciding per client identity which exports each sees, opens, and may
//! write. Clients: libnbd's Python bindings (tests/libnbd_probe.py),
//! nbdinfo --list and qemu-img.

mod common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::clients::text;
use common::metrics::{sample, scrape};
use common::pki::{Ca, ClientDir};
use common::process::NbdgwProcess;
use common::{run, Env, QemuNbd};

const POLICY: &str = r#"
[[rule]]
exports = ["vm-*"]
allow = { uri = ["spiffe://example.org/ns/*/sa/vm-host"] }
access = "read-write"

[[rule]]
exports = ["*", "*/*"]
allow = { cn = ["backup"] }
access = "read-only"

[[rule]]
exports = ["{ns}/*"]
allow = { uri = ["spiffe://example.org/ns/{ns}/sa/app"] }
access = "read-write"
"#;

struct Host {
    env: Env,
    dir: PathBuf,
    policy: PathBuf,
    gateway: NbdgwProcess,
    admin_port: u16,
    vm_a: QemuNbd,
    db_c: QemuNbd,
    /// `db-prod/d`: namespace db-prod's, whose name starts with `db`.
    _db_prod_d: QemuNbd,
    clients: Clients,
}

struct Clients {
    vm_host: PathBuf,
    backup: PathBuf,
    db_app: PathBuf,
    intruder: PathBuf,
}

fn image(env: &Env, name: &str, fill: u8) -> PathBuf {
    env.filled_image(name, fill, 1 << 20)
}

fn host() -> Host {
    let env = Env::new();
    let ca = Ca::new("routing CA");
    let (cert, key, client_ca) =
        common::clients::write_server_files(&env.path("server"), &ca.server("gw"), &ca);
    let client = |name: &str, uris: &[&str], serial| {
        ca.client(name, &[], uris, serial)
            .client_dir(&env.path(name), &ca)
    };
    let clients = Clients {
        vm_host: client("vm-host", &["spiffe://example.org/ns/prod/sa/vm-host"], 11),
        backup: client("backup", &[], 12),
        db_app: client("db-app", &["spiffe://example.org/ns/db/sa/app"], 13),
        intruder: client("intruder", &["spiffe://example.org/ns/db/sa/other"], 14),
    };
    let dir = env.path("exports");
    std::fs::create_dir(&dir).unwrap();
    let vm_a = QemuNbd::start_at(dir.join("vm-a.sock"), &image(&env, "a.img", b'A'), &[]);
    std::fs::create_dir(dir.join("db-prod")).unwrap();
    let db_prod_d = QemuNbd::start_at(dir.join("db-prod/d.sock"), &image(&env, "d.img", b'D'), &[]);
    // Served as "db/c" by the gateway, known upstream as "disk0".
    let db_c = QemuNbd::start_at(
        env.path("c.sock"),
        &image(&env, "c.img", b'C'),
        &["-x", "disk0"],
    );
    let policy = env.path("policy.toml");
    std::fs::write(&policy, POLICY).unwrap();
    let export_c = format!("db/c={}:disk0", db_c.socket.display());
    let admin_port = common::free_port();
    let admin = format!("127.0.0.1:{admin_port}");
    let args: Vec<&OsStr> = vec![
        "--tls-cert".as_ref(),
        cert.as_os_str(),
        "--tls-key".as_ref(),
        key.as_os_str(),
        "--tls-client-ca".as_ref(),
        client_ca.as_os_str(),
        "--export-dir".as_ref(),
        dir.as_os_str(),
        "--export".as_ref(),
        export_c.as_ref(),
        "--policy".as_ref(),
        policy.as_os_str(),
        "--tls-reload-interval".as_ref(),
        "1".as_ref(),
        "--admin-listen".as_ref(),
        admin.as_ref(),
    ];
    let gateway = NbdgwProcess::start(args);
    Host {
        env,
        dir,
        policy,
        gateway,
        admin_port,
        vm_a,
        db_c,
        _db_prod_d: db_prod_d,
        clients,
    }
}

fn probe(port: u16, args: &[&str], cert_dir: &Path) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/libnbd_probe.py");
    let out = run(Command::new("/usr/bin/python3")
        .arg(script)
        .arg(args[0])
        .arg(port.to_string())
        .arg(cert_dir)
        .args(&args[1..]));
    assert!(
        out.status.success(),
        "libnbd_probe {args:?}: {}",
        text(&out)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// One sample of the gateway's /metrics.
fn metric(host: &Host, name: &str) -> f64 {
    sample(&scrape(host.admin_port), name)
}

fn list(host: &Host, cert_dir: &Path) -> String {
    probe(host.gateway.port, &["list"], cert_dir)
}

fn open(host: &Host, cert_dir: &Path, export: &str) -> String {
    probe(host.gateway.port, &["open", export], cert_dir)
}

#[test]
fn each_identity_sees_and_opens_exactly_its_exports_with_its_access() {
    let h = host();
    let c = &h.clients;
    assert_eq!(list(&h, &c.vm_host), r#"{"exports": ["vm-a"]}"#);
    assert_eq!(
        list(&h, &c.backup),
        r#"{"exports": ["db/c", "db-prod/d", "vm-a"]}"#
    );
    // Namespace db's own disk, and not db-prod's.
    assert_eq!(list(&h, &c.db_app), r#"{"exports": ["db/c"]}"#);
    assert_eq!(list(&h, &c.intruder), r#"{"exports": []}"#);

    // Read-write where allowed: the write reaches that export's upstream.
    assert_eq!(
        open(&h, &c.vm_host, "vm-a"),
        r#"{"opened": true, "read_only": false, "size": 1048576, "write": "ok", "read": "WWWWWWWW"}"#
    );
    assert_eq!(&h.vm_a.read_direct()[..4], b"WWWW");
    assert_eq!(
        open(&h, &c.db_app, "db/c"),
        r#"{"opened": true, "read_only": false, "size": 1048576, "write": "ok", "read": "WWWWWWWW"}"#
    );
    assert_eq!(&h.db_c.read_direct_named("disk0")[..4], b"WWWW");

    // Read-only: flagged so, the write refused with EPERM, and the session
    // goes on to read.
    let before = h.vm_a.read_direct();
    assert_eq!(
        open(&h, &c.backup, "vm-a"),
        r#"{"opened": true, "read_only": true, "size": 1048576, "write": "EPERM", "read": "WWWWWWWW"}"#
    );
    assert_eq!(h.vm_a.read_direct(), before);

    // Not allowed, or no such export: the same answer, so names do not leak.
    for (client, export) in [
        (&c.vm_host, "db/c"),
        (&c.db_app, "db-prod/d"),
        (&c.db_app, "vm-a"),
        (&c.intruder, "db/c"),
        (&c.backup, "no-such-disk"),
    ] {
        let said = open(&h, client, export);
        assert!(
            said.contains(r#""opened": false"#) && said.contains("No such file"),
            "{export}: {said}"
        );
    }
    // The five refusals above, each counted.
    assert_eq!(metric(&h, "nbdgw_exports_refused_total"), 5.0);
    // Not an export name at all (a `..` segment), whoever asks: invalid,
    // before the policy or the directory is asked.
    let said = open(&h, &c.backup, "../c");
    assert!(
        said.contains(r#""opened": false"#) && said.contains("invalid"),
        "../c: {said}"
    );
    // Ready without probing any one export's server.
    let ready = run(Command::new("curl")
        .args(["-s", "-m", "5", "-w", "%{http_code}"])
        .arg(format!("http://127.0.0.1:{}/readyz", h.admin_port)));
    assert_eq!(String::from_utf8_lossy(&ready.stdout), "ready\n200");
    let log = h.gateway.log();
    assert!(log.contains("access=read-only"), "{log}");
    assert!(
        log.contains("refused: the policy does not open this export to this client"),
        "{log}"
    );
}

#[test]
fn a_socket_appearing_in_the_directory_is_served_without_a_restart() {
    let h = host();
    let c = &h.clients;
    assert_eq!(list(&h, &c.vm_host), r#"{"exports": ["vm-a"]}"#);
    let vm_b = QemuNbd::start_at(h.dir.join("vm-b.sock"), &image(&h.env, "b.img", b'B'), &[]);
    assert_eq!(list(&h, &c.vm_host), r#"{"exports": ["vm-a", "vm-b"]}"#);
    assert_eq!(
        open(&h, &c.vm_host, "vm-b"),
        r#"{"opened": true, "read_only": false, "size": 1048576, "write": "ok", "read": "WWWWWWWW"}"#
    );
    // qemu-img, through qemu's own NBD client, by export name.
    let tls = common::clients::qemu_tls_args("localhost", h.gateway.port, &c.vm_host);
    let out = run(Command::new("qemu-img")
        .arg("info")
        .args(&tls[..2])
        .arg("--image-opts")
        .arg(format!(
            "driver=nbd,host=localhost,port={},export=vm-b,tls-creds=tls0",
            h.gateway.port
        )));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains("virtual size: 1 MiB"),
        "{said}{}",
        text(&out)
    );
    drop(vm_b);
    assert_eq!(list(&h, &c.vm_host), r#"{"exports": ["vm-a"]}"#);
    // nbdinfo --list agrees.
    let out = run(Command::new("nbdinfo").arg("--list").arg(format!(
        "nbds://localhost:{}/?tls-certificates={}",
        h.gateway.port,
        c.backup.display()
    )));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        said.contains("export=\"db/c\"") && said.contains("export=\"vm-a\""),
        "{said}"
    );
    assert!(!said.contains("vm-b"), "{said}");
}

#[test]
fn a_narrower_policy_applies_to_new_connections_and_a_wider_or_broken_one_is_refused() {
    let h = host();
    let c = &h.clients;
    // Narrower: the backup rule goes.
    let narrower = POLICY.replace(
        "[[rule]]\nexports = [\"*\", \"*/*\"]\nallow = { cn = [\"backup\"] }\naccess = \"read-only\"\n",
        "",
    );
    assert_ne!(narrower, POLICY);
    std::fs::write(&h.policy, &narrower).unwrap();
    h.gateway.wait_for_log("access policy reloaded", 1);
    assert_eq!(list(&h, &c.backup), r#"{"exports": []}"#);
    assert!(open(&h, &c.backup, "vm-a").contains(r#""opened": false"#));

    // Wider (the backup rule back), then broken: refused, the narrower
    // policy stays.
    std::fs::write(&h.policy, POLICY).unwrap();
    h.gateway.wait_for_log("access policy reload refused", 1);
    assert!(h
        .gateway
        .log()
        .contains("may grant what the running one does not"));
    std::fs::write(&h.policy, "[[rule]]\nexports = [").unwrap();
    h.gateway.wait_for_log("access policy reload refused", 2);
    assert_eq!(metric(&h, "nbdgw_policy_reloads_total"), 1.0);
    assert_eq!(metric(&h, "nbdgw_policy_reload_failures_total"), 2.0);
    assert_eq!(list(&h, &c.backup), r#"{"exports": []}"#);
    assert_eq!(list(&h, &c.vm_host), r#"{"exports": ["vm-a"]}"#);
}

/// The option-level rules, byte by byte with the raw client: reply codes
/// for unknown and denied exports, framing asked for before an export is
/// chosen, INFO on one export then GO on another (two upstreams in turn),
/// and EXPORT_NAME, which can only be refused by closing.
#[test]
fn option_replies_while_routing_are_exact() {
    use common::clients::connect_as;
    use common::raw::go_data;
    use nbdgw::proto::consts::*;
    let h = host();
    let c = &h.clients;
    let mut raw = connect_as(h.gateway.addr(), &c.backup);
    let replies = raw.option(OPT_EXTENDED_HEADERS, &[]);
    assert_eq!(
        replies[0].reply_type,
        REP_ERR_UNSUP,
        "{}",
        replies[0].message()
    );
    assert_eq!(raw.option(OPT_STRUCTURED_REPLY, &[])[0].reply_type, REP_ACK);
    assert_eq!(
        raw.option(OPT_STRUCTURED_REPLY, &[])[0].reply_type,
        REP_ERR_INVALID
    );
    assert_eq!(raw.option(OPT_LIST, b"x")[0].reply_type, REP_ERR_INVALID);
    let long = raw.option(OPT_INFO, &go_data(&"v".repeat(4097), &[]));
    assert_eq!(long[0].reply_type, REP_ERR_INVALID, "{}", long[0].message());
    let unknown = raw.option(OPT_INFO, &go_data("no-such-disk", &[]));
    assert_eq!(
        (unknown[0].reply_type, unknown[0].message().as_str()),
        (REP_ERR_UNKNOWN, "unknown export")
    );

    // INFO on vm-a (read-only for backup: the flag is set), then GO on
    // db/c, whose upstream knows it as "disk0" and whose INFO_NAME reply
    // must name it "db/c".
    let info = raw.option(OPT_INFO, &go_data("vm-a", &[INFO_NAME]));
    let export = info
        .iter()
        .find(|r| r.data.len() == 12 && r.data[..2] == [0, 0])
        .unwrap();
    assert_eq!(
        u16::from_be_bytes([export.data[10], export.data[11]]) & TFLAG_READ_ONLY,
        TFLAG_READ_ONLY
    );
    let go = raw.option(OPT_GO, &go_data("db/c", &[INFO_NAME]));
    assert_eq!(go.last().unwrap().reply_type, REP_ACK);
    let name = go
        .iter()
        .find(|r| r.data.starts_with(&[0, 1]))
        .expect("an INFO_NAME reply");
    assert_eq!(&name.data[2..], b"db/c");
    let data = raw.read(1, 0, 4);
    assert_eq!(data, b"CCCC");
    raw.disconnect();

    // A denied export by EXPORT_NAME: closed without a reply, as a server
    // refusing it would.
    let mut raw = connect_as(h.gateway.addr(), &c.vm_host);
    raw.send_option(OPT_EXPORT_NAME, b"db/c");
    raw.expect_closed();
    // An allowed one works the old way too.
    let mut raw = connect_as(h.gateway.addr(), &c.vm_host);
    raw.send_option(OPT_EXPORT_NAME, b"vm-a");
    let mut reply = [0u8; 10];
    std::io::Read::read_exact(&mut raw.stream, &mut reply).unwrap();
    assert_eq!(u64::from_be_bytes(reply[..8].try_into().unwrap()), 1 << 20);
}
