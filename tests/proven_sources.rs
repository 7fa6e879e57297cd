//! A proven source (one of its clients opened an export with a
//! certificate) may use the handshake reserve; issue 27 item 7: it stayed
//! proven after a policy or CRL reload, and past `--source-memory`, for
//! as long as it kept one handshake open or waiting. The nbdgw binary, a real
//! qemu-nbd upstream, nbdinfo to prove the source, and silent TCP
//! connections (from 127.0.0.1, the proven source, and 127.0.0.2) that
//! hold handshake slots.

mod common;

use std::ffi::OsStr;
use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::path::Path;
use std::time::Duration;

use common::await_that;
use common::clients::{nbdinfo_size, text};
use common::metrics::metric;
use common::peers::{connect_from, greeted};
use common::process::NbdgwProcess;
use common::site::PolicySite;
use common::{free_port, QemuNbd};

const POLICY: &str = r#"
[[rule]]
exports = ["*"]
allow = { cn = ["host"] }
access = "read-write"

[[rule]]
exports = ["*"]
allow = { cn = ["other"] }
access = "read-write"
"#;

/// The same, narrowed: `other` is gone.
const NARROWER: &str = r#"
[[rule]]
exports = ["*"]
allow = { cn = ["host"] }
access = "read-write"
"#;

const PROVEN: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1));
const UNPROVEN: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));

/// Three handshake slots, one of them for unproven sources (two in
/// reserve), silent handshakes allowed a minute.
fn gateway(site: &PolicySite, upstream: &Path, admin: u16, extra: &[&str]) -> NbdgwProcess {
    let admin_addr = format!("127.0.0.1:{admin}");
    let mut args: Vec<&OsStr> = [
        "--upstream",
        upstream.to_str().unwrap(),
        "--admin-listen",
        &admin_addr,
        "--max-handshakes",
        "3",
        "--handshake-reserve",
        "2",
        "--max-handshakes-per-source",
        "3",
        "--handshake-timeout",
        "60",
        "--tls-reload-interval",
        "0",
    ]
    .into_iter()
    .map(OsStr::new)
    .collect();
    args.extend(extra.iter().map(OsStr::new));
    site.gateway(&args, &[])
}

/// nbdinfo as `host` from 127.0.0.1 proves that source; then 127.0.0.2
/// holds the one unproven slot, and a silent connection from 127.0.0.1
/// takes a reserve slot, which only a proven source may. Returns the two
/// silent connections (they must stay open).
fn prove_and_hold(site: &PolicySite, gw: &NbdgwProcess, admin: u16) -> [TcpStream; 2] {
    let host = site.client("host", 1);
    let out = nbdinfo_size(gw.port, &host);
    assert!(out.status.success(), "nbdinfo: {}", text(&out));
    await_that("the source proven", || {
        metric(admin, "nbdgw_proven_sources") >= 1.0
    });
    let unproven = connect_from(UNPROVEN, gw.addr()).expect("connect from 127.0.0.2");
    await_that("127.0.0.2 greeted", || greeted(&unproven));
    let held = connect_from(PROVEN, gw.addr()).expect("connect from 127.0.0.1");
    await_that("127.0.0.1 greeted from the reserve", || greeted(&held));
    [unproven, held]
}

/// Another silent connection from 127.0.0.1, now no longer proven: it
/// must wait for the unproven share (held by 127.0.0.2), not take the
/// last reserve slot.
fn assert_served_as_unproven(gw: &NbdgwProcess, admin: u16) {
    let again = connect_from(PROVEN, gw.addr()).expect("connect from 127.0.0.1");
    await_that("the third connection accepted", || {
        metric(admin, "nbdgw_handshakes_in_progress") + metric(admin, "nbdgw_handshakes_waiting")
            >= 3.0
    });
    let (busy, waiting) = (
        metric(admin, "nbdgw_handshakes_in_progress"),
        metric(admin, "nbdgw_handshakes_waiting"),
    );
    assert_eq!(
        (busy, waiting),
        (2.0, 1.0),
        "127.0.0.1 was still served from the reserve (slots held, waiting)"
    );
    assert!(!greeted(&again), "greeted from the reserve");
}

#[test]
fn a_policy_reload_unproves_a_source_that_keeps_a_handshake_open() {
    let site = PolicySite::new("proven CA", POLICY);
    let image = site.env.random_image("disk.img", 1 << 20, 7);
    let upstream = QemuNbd::start(&site.env, &image, &[]);
    let admin = free_port();
    let gw = gateway(&site, &upstream.socket, admin, &[]);
    let _held = prove_and_hold(&site, &gw, admin);

    let before = metric(admin, "nbdgw_policy_reloads_total");
    std::fs::write(&site.policy, NARROWER).unwrap();
    gw.signal("HUP");
    await_that("the policy reloaded", || {
        metric(admin, "nbdgw_policy_reloads_total") > before
    });
    assert_served_as_unproven(&gw, admin);
}

#[test]
fn a_crl_reload_unproves_a_source_that_keeps_a_handshake_open() {
    let site = PolicySite::new("proven CA", POLICY);
    let image = site.env.random_image("disk.img", 1 << 20, 9);
    let upstream = QemuNbd::start(&site.env, &image, &[]);
    let admin = free_port();
    let crl = site.env.path("ca-crl.pem");
    std::fs::write(&crl, site.ca.crl(&[])).unwrap();
    let gw = gateway(
        &site,
        &upstream.socket,
        admin,
        &["--tls-crl", crl.to_str().unwrap()],
    );
    let _held = prove_and_hold(&site, &gw, admin);

    // A new CRL (revoking a certificate nobody here holds).
    let before = metric(admin, "nbdgw_tls_reloads_total");
    std::fs::write(&crl, site.ca.crl(&[99])).unwrap();
    gw.signal("HUP");
    await_that("the TLS files reloaded", || {
        metric(admin, "nbdgw_tls_reloads_total") > before
    });
    assert_served_as_unproven(&gw, admin);
}

#[test]
fn source_memory_bounds_a_source_that_keeps_a_handshake_open() {
    let site = PolicySite::new("proven CA", POLICY);
    let image = site.env.random_image("disk.img", 1 << 20, 8);
    let upstream = QemuNbd::start(&site.env, &image, &[]);
    let admin = free_port();
    let memory = Duration::from_secs(6);
    let gw = gateway(
        &site,
        &upstream.socket,
        admin,
        &["--source-memory", &memory.as_secs().to_string()],
    );
    let _held = prove_and_hold(&site, &gw, admin);
    // The source was last proven when nbdinfo's session ended, before it
    // was greeted from the reserve above: after this, its memory is over
    // (what is measured is the passing of time itself).
    std::thread::sleep(memory + Duration::from_secs(2));
    assert_served_as_unproven(&gw, admin);
}

/// A libnbd client (python3's nbd module) that opens `export` through the
/// gateway as the certificate in `cert_dir`, says "open", and holds the
/// session until its stdin closes.
fn hold_session(port: u16, cert_dir: &Path, export: &str) -> std::process::Child {
    use std::io::BufRead;
    let script = r#"
import sys
import nbd
h = nbd.NBD()
h.set_tls(nbd.TLS_REQUIRE)
h.set_tls_certificates(sys.argv[2])
h.set_export_name(sys.argv[3])
h.connect_tcp("127.0.0.1", sys.argv[1])
print("open", h.get_size(), flush=True)
sys.stdin.read()
"#;
    let mut child = std::process::Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(script)
        .arg(port.to_string())
        .arg(cert_dir)
        .arg(export)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(
        line.trim(),
        "open 1048576",
        "the libnbd session did not open"
    );
    child
}

/// Hostile review of issue 27 item 7: a session's end proved its source
/// again, under the generation in force then, even when the end was a
/// policy reload taking its access away. A libnbd session as `other`,
/// held open across a reload that drops `other`: the reload closes it,
/// and its source must not be proven after (metric, and a silent
/// connection from it is not greeted from the reserve).
#[test]
fn a_session_a_reload_closes_does_not_prove_its_source() {
    let site = PolicySite::new("proven CA", POLICY);
    let image = site.env.random_image("disk.img", 1 << 20, 11);
    let upstream = QemuNbd::start(&site.env, &image, &[]);
    let admin = free_port();
    let gw = gateway(&site, &upstream.socket, admin, &[]);
    let other = site.client("other", 2);
    let mut session = hold_session(gw.port, &other, "");
    await_that("the source proven", || {
        metric(admin, "nbdgw_proven_sources") >= 1.0
    });

    let before = metric(admin, "nbdgw_policy_reloads_total");
    std::fs::write(&site.policy, NARROWER).unwrap();
    gw.signal("HUP");
    await_that("the policy reloaded", || {
        metric(admin, "nbdgw_policy_reloads_total") > before
    });
    gw.wait_for_log("access policy narrowed by a reload", 1);
    // The session's close line comes after whatever its end does.
    await_that("the narrowed session's close line", || {
        gw.log()
            .lines()
            .any(|l| l.contains("nbdgw::audit") && l.contains(" closed") && l.contains("CN=other"))
    });

    // 127.0.0.2 takes the one unproven slot (and its arrival makes the
    // gateway look at the reload).
    let unproven = connect_from(UNPROVEN, gw.addr()).expect("connect from 127.0.0.2");
    await_that("127.0.0.2 greeted", || greeted(&unproven));
    let again = connect_from(PROVEN, gw.addr()).expect("connect from 127.0.0.1");
    await_that("the second silent connection accepted", || {
        metric(admin, "nbdgw_handshakes_in_progress") + metric(admin, "nbdgw_handshakes_waiting")
            >= 2.0
    });
    let (busy, waiting) = (
        metric(admin, "nbdgw_handshakes_in_progress"),
        metric(admin, "nbdgw_handshakes_waiting"),
    );
    assert_eq!(
        (busy, waiting),
        (1.0, 1.0),
        "127.0.0.1 was served from the reserve (slots held, waiting)"
    );
    assert!(!greeted(&again), "greeted from the reserve");
    assert_eq!(
        metric(admin, "nbdgw_proven_sources"),
        0.0,
        "the narrowed session's end proved its source"
    );
    drop(session.stdin.take());
    let _ = session.kill();
    let _ = session.wait();
}

/// Hostile review of issue 27 item 7: every successful reload unproved
/// every source, even a SIGHUP with every file unchanged (or a rotation
/// of the server's own certificate), which revokes nobody. Now only a
/// change to the client CA, the CRL or the policy does: after such a
/// SIGHUP the proven source still takes the last reserve slot.
#[test]
fn a_reload_changing_nothing_keeps_sources_proven() {
    let site = PolicySite::new("proven CA", POLICY);
    let image = site.env.random_image("disk.img", 1 << 20, 12);
    let upstream = QemuNbd::start(&site.env, &image, &[]);
    let admin = free_port();
    let crl = site.env.path("ca-crl.pem");
    std::fs::write(&crl, site.ca.crl(&[])).unwrap();
    let gw = gateway(
        &site,
        &upstream.socket,
        admin,
        &["--tls-crl", crl.to_str().unwrap()],
    );
    let _held = prove_and_hold(&site, &gw, admin);

    let tls_before = metric(admin, "nbdgw_tls_reloads_total");
    let policy_before = metric(admin, "nbdgw_policy_reloads_total");
    gw.signal("HUP");
    await_that("the TLS files and the policy reloaded", || {
        metric(admin, "nbdgw_tls_reloads_total") > tls_before
            && metric(admin, "nbdgw_policy_reloads_total") > policy_before
    });
    let again = connect_from(PROVEN, gw.addr()).expect("connect from 127.0.0.1");
    await_that("127.0.0.1 still greeted from the reserve", || {
        greeted(&again)
    });
    assert_eq!(metric(admin, "nbdgw_handshakes_waiting"), 0.0);
}
