//! `nbdgw client`: unmodified plaintext clients (qemu-img, libnbd's
//! nbdinfo and nbdcopy, the raw client in every framing) on its Unix
//! socket or loopback port, relayed over STARTTLS and verified TLS to the
//! nbdgw server mode in front of qemu-nbd, and to qemu-nbd's own TLS.
//! Bytes are checked both ways against the image read directly; refusals
//! (a certificate for another name, an untrusted CA, an expired
//! certificate, a client certificate the server does not take, an
//! unknown export, a server without TLS) reach the local client as an
//! error and nbdgw client's log as a line that says why.

mod common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::metrics::sample;
use common::pki::{Ca, ClientDir};
use common::process::NbdgwProcess;
use common::raw::RawClient;
use common::{pattern, run, run_ok, unix_uri, Env, QemuNbd};
use nbdgw::proto::transmission::ReplyMode;

const SIZE: usize = 8 << 20;

/// `nbdgw client` on a Unix socket in front of `server`, with the test's
/// certificate directory (libnbd/qemu layout: ca-cert.pem,
/// client-cert.pem, client-key.pem).
fn client_on_socket(
    env: &Env,
    name: &str,
    server: &str,
    tls_dir: &Path,
) -> (NbdgwProcess, PathBuf) {
    let socket = env.path(name);
    let client = NbdgwProcess::client_of(socket.as_os_str(), server, tls_dir, &[]);
    (client, socket)
}

/// The nbdgw server mode in front of `upstream`, with the test's
/// certificates (which also make client certificates required).
fn gateway(env: &Env, upstream: &Path) -> NbdgwProcess {
    NbdgwProcess::in_front_of(env, upstream, &["--landlock", "false"])
}

/// qemu-img both ways through `uri`: the image read through it equals
/// the image read directly, and a new pattern written through it is what
/// the image then holds.
fn qemu_img_both_ways(env: &Env, upstream: &QemuNbd, uri: &str, seed: u64) {
    let copy = env.path("qemu-copy.img");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "raw", uri])
            .arg(&copy),
    );
    assert_eq!(std::fs::read(&copy).unwrap(), upstream.read_direct());
    let source = env.random_image("qemu-new.img", SIZE, seed);
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&source)
            .arg(uri),
    );
    assert_eq!(upstream.read_direct(), pattern(SIZE, seed));
}

/// nbdcopy (libnbd) both ways through `uri`.
fn nbdcopy_both_ways(env: &Env, upstream: &QemuNbd, uri: &str, seed: u64) {
    let source = env.random_image("nbdcopy-new.img", SIZE, seed);
    run_ok(Command::new("nbdcopy").arg(&source).arg(uri));
    assert_eq!(upstream.read_direct(), pattern(SIZE, seed));
    let copy = env.path("nbdcopy-copy.img");
    run_ok(Command::new("nbdcopy").arg(uri).arg(&copy));
    assert_eq!(std::fs::read(&copy).unwrap(), pattern(SIZE, seed));
}

#[test]
fn qemu_img_and_libnbd_through_client_mode_and_the_gateway() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 1);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let server = gateway(&env, &upstream.socket);
    let (client, socket) = client_on_socket(
        &env,
        "client.sock",
        &format!("localhost:{}", server.port),
        &env.certs(),
    );
    let uri = unix_uri(&socket);

    // qemu 10 negotiates extended headers, libnbd structured replies.
    qemu_img_both_ways(&env, &upstream, &uri, 2);
    client.wait_for_log("mode=Extended", 1);
    nbdcopy_both_ways(&env, &upstream, &uri, 3);
    client.wait_for_log("mode=Structured", 1);

    let out = run_ok(Command::new("nbdinfo").arg(&uri));
    let info = String::from_utf8_lossy(&out.stdout);
    assert!(
        info.contains("without TLS"),
        "local side is plaintext: {info}"
    );
    assert!(info.contains(&format!("export-size: {SIZE}")), "{info}");

    // The server saw TLS, and the client certificate from the directory.
    let log = server.log();
    assert!(log.contains("TLS established"), "{log}");
    assert!(log.contains("CN=test-client"), "{log}");
    let log = client.log();
    assert!(log.contains("TLS established"), "{log}");
    assert!(log.contains(r#"DNS ["localhost"]"#), "{log}");
    assert!(!log.contains("WARN"), "{log}");
}

#[test]
fn every_framing_through_client_mode_on_a_loopback_port() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 4);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let server = gateway(&env, &upstream.socket);
    let (client, port) = loopback_client(&env, &format!("127.0.0.1:{}", server.port), &[]);
    let addr = ([127, 0, 0, 1], port).into();
    for (n, mode) in [
        ReplyMode::Simple,
        ReplyMode::Structured,
        ReplyMode::Extended,
    ]
    .into_iter()
    .enumerate()
    {
        let mut c = RawClient::handshake(addr);
        c.go(mode);
        let offset = (n as u64 + 1) << 20;
        // Larger than one TLS record and than one relay chunk.
        let data = pattern(300 << 10, 10 + n as u64);
        c.write(1, offset, &data);
        let reply = c.read_reply(0);
        assert_eq!(
            reply.last().map(|r| (r.cookie, r.error)),
            Some((1, 0)),
            "{mode:?}"
        );
        assert_eq!(c.read(2, offset, data.len()), data, "{mode:?}");
        c.disconnect();
        let direct = upstream.read_direct();
        let at = offset as usize;
        assert_eq!(&direct[at..at + data.len()], &data[..], "{mode:?}");
    }
    for mode in ["Simple", "Structured", "Extended"] {
        client.wait_for_log(&format!("mode={mode}"), 1);
    }
    // --server 127.0.0.1:PORT: the certificate's IP SAN is what was checked.
    let log = client.log();
    assert!(log.contains("server_name=IpAddress"), "{log}");
    assert!(log.contains("TLS established"), "{log}");
}

/// qemu-nbd with its own TLS (GnuTLS) on a loopback port, requiring a
/// client certificate from the CA in `dir`.
struct QemuNbdTls {
    child: Child,
    port: u16,
}

impl QemuNbdTls {
    fn start(image: &Path, dir: &Path, extra: &[&str]) -> Self {
        let port = common::free_port();
        let mut child = Command::new("qemu-nbd")
            .args(["-f", "raw", "--persistent", "--shared=8", "-b", "127.0.0.1"])
            .arg("-p")
            .arg(port.to_string())
            .arg("--object")
            .arg(format!(
                "tls-creds-x509,id=tls0,dir={},endpoint=server,verify-peer=on",
                dir.display()
            ))
            .args(["--tls-creds", "tls0"])
            .args(extra)
            .arg(image)
            .stdin(Stdio::null())
            .spawn()
            .expect("qemu-nbd");
        if let Err(e) = common::wait_until_listening(port, "qemu-nbd", || {
            child.try_wait().ok().flatten().map(|s| s.to_string())
        }) {
            panic!("{e}");
        }
        QemuNbdTls { child, port }
    }
}

impl Drop for QemuNbdTls {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn client_mode_to_qemu_nbds_own_tls() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 5);
    // The same image behind a Unix socket too, to read it directly.
    let qemu = QemuNbdTls::start(&image, &env.certs(), &[]);
    let (client, socket) = client_on_socket(
        &env,
        "client.sock",
        &format!("localhost:{}", qemu.port),
        &env.certs(),
    );
    let uri = unix_uri(&socket);
    let copy = env.path("copy.img");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "raw", &uri])
            .arg(&copy),
    );
    assert_eq!(std::fs::read(&copy).unwrap(), pattern(SIZE, 5));
    let source = env.random_image("new.img", SIZE, 6);
    run_ok(Command::new("nbdcopy").arg(&source).arg(&uri));
    assert_eq!(std::fs::read(&image).unwrap(), pattern(SIZE, 6));
    run_ok(Command::new("nbdcopy").arg(&uri).arg(&copy));
    assert_eq!(std::fs::read(&copy).unwrap(), pattern(SIZE, 6));
    let log = client.log();
    assert!(log.contains("TLS established"), "{log}");
    assert!(!log.contains("WARN"), "{log}");
}

/// Starts nbdgw's server mode with `server` as its certificate, and
/// `nbdgw client` trusting `client_dir`; returns qemu-img's and nbdinfo's
/// stderr (both must fail) and the client's log.
fn refused(env: &Env, server: &common::pki::Leaf, client_dir: &Path) -> (String, String, String) {
    let image = env.random_image("disk.img", 1 << 20, 7);
    let upstream = QemuNbd::start(env, &image, &[]);
    let (cert, key) = (env.path("refused-cert.pem"), env.path("refused-key.pem"));
    std::fs::write(&cert, &server.cert).unwrap();
    std::fs::write(&key, &server.key).unwrap();
    let gateway = NbdgwProcess::start([
        OsStr::new("--tls-cert"),
        cert.as_os_str(),
        OsStr::new("--tls-key"),
        key.as_os_str(),
        OsStr::new("--upstream"),
        upstream.socket.as_os_str(),
        OsStr::new("--landlock"),
        OsStr::new("false"),
    ]);
    let (client, socket) = client_on_socket(
        env,
        "refused.sock",
        &format!("localhost:{}", gateway.port),
        client_dir,
    );
    let uri = unix_uri(&socket);
    let qemu = run(Command::new("qemu-img").args(["info", &uri]));
    assert!(!qemu.status.success(), "qemu-img info succeeded");
    let nbdinfo = run(Command::new("nbdinfo").arg(&uri));
    assert!(!nbdinfo.status.success(), "nbdinfo succeeded");
    client.wait_for_log("server unavailable", 2);
    (
        common::clients::text(&qemu),
        common::clients::text(&nbdinfo),
        client.log(),
    )
}

#[test]
fn a_server_certificate_for_another_name_is_refused() {
    let env = Env::new();
    let ca = Ca::new("name CA");
    let dir = ca
        .client("client", &[], &[], 2)
        .client_dir(&env.path("client-dir"), &ca);
    let other = ca.server_for("other.example", &["other.example"], 20);
    let (qemu, _nbdinfo, log) = refused(&env, &other, &dir);
    let why = r#"certificate not valid for name "localhost""#;
    assert!(
        qemu.contains("server reported: nbdgw client: TLS handshake with localhost:")
            && qemu.contains(why),
        "{qemu}"
    );
    assert!(log.contains("reason=\"tls\"") && log.contains(why), "{log}");
}

#[test]
fn a_server_certificate_from_an_untrusted_ca_is_refused() {
    let env = Env::new();
    let (trusted, untrusted) = (Ca::new("trusted CA"), Ca::new("untrusted CA"));
    let dir = trusted
        .client("client", &[], &[], 2)
        .client_dir(&env.path("client-dir"), &trusted);
    let server = untrusted.server("localhost");
    let (qemu, _nbdinfo, log) = refused(&env, &server, &dir);
    assert!(
        qemu.contains("server reported: nbdgw client: TLS handshake")
            && qemu.contains("UnknownIssuer"),
        "{qemu}"
    );
    assert!(log.contains("UnknownIssuer"), "{log}");
}

#[test]
fn an_expired_server_certificate_is_refused() {
    let env = Env::new();
    let ca = Ca::new("expiry CA");
    let dir = ca
        .client("client", &[], &[], 2)
        .client_dir(&env.path("client-dir"), &ca);
    // Valid until the moment it was made: expired a second later.
    let expired = ca.server_for("localhost", &["localhost"], 0);
    std::thread::sleep(Duration::from_millis(1100));
    let (qemu, _nbdinfo, log) = refused(&env, &expired, &dir);
    assert!(qemu.contains("certificate expired"), "{qemu}");
    assert!(log.contains("certificate expired"), "{log}");
}

#[test]
fn unknown_export_and_a_server_without_tls() {
    let env = Env::new();
    let image = env.random_image("disk.img", 1 << 20, 8);
    let upstream = QemuNbd::start(&env, &image, &["-x", "disk0"]);
    let server = gateway(&env, &upstream.socket);
    let (client, socket) = client_on_socket(
        &env,
        "client.sock",
        &format!("localhost:{}", server.port),
        &env.certs(),
    );
    let out = run(
        Command::new("nbdinfo").arg(format!("nbd+unix:///nope%0a?socket={}", socket.display()))
    );
    assert!(!out.status.success());
    client.wait_for_log("the server refused the export", 1);
    // The export name is escaped in the log: no raw newline.
    assert!(
        client.log().contains(r#"export=nope\n"#),
        "{}",
        client.log()
    );
    // The right name still works on the same client.
    let out = run_ok(
        Command::new("nbdinfo")
            .arg("--size")
            .arg(format!("nbd+unix:///disk0?socket={}", socket.display())),
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1048576");

    // A server with no TLS at all refuses STARTTLS: said to the local
    // client and in the log.
    let port = common::free_port();
    let mut plain = Command::new("qemu-nbd")
        .args(["-f", "raw", "--persistent", "-b", "127.0.0.1", "-p"])
        .arg(port.to_string())
        .arg(&image)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    common::wait_until_listening(port, "qemu-nbd", || None).unwrap();
    let (client, socket) = client_on_socket(
        &env,
        "plain.sock",
        &format!("localhost:{port}"),
        &env.certs(),
    );
    let out = run(Command::new("qemu-img").args(["info", &unix_uri(&socket)]));
    let _ = plain.kill();
    let _ = plain.wait();
    assert!(!out.status.success());
    let text = common::clients::text(&out);
    assert!(text.contains("refused NBD_OPT_STARTTLS"), "{text}");
    client.wait_for_log("refused NBD_OPT_STARTTLS", 1);
}

#[test]
fn a_client_certificate_the_server_refuses() {
    let env = Env::new();
    let image = env.random_image("disk.img", 1 << 20, 9);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let server = gateway(&env, &upstream.socket);
    // Trusts the server's CA, but presents a certificate of its own CA,
    // which the server does not take.
    let own = Ca::new("stranger CA");
    let server_ca = std::fs::read_to_string(env.certs().join("ca-cert.pem")).unwrap();
    let dir = env.path("stranger");
    own.client("stranger", &[], &[], 3).client_dir(&dir, &own);
    std::fs::write(dir.join("ca-cert.pem"), server_ca).unwrap();
    let (client, socket) = client_on_socket(
        &env,
        "client.sock",
        &format!("localhost:{}", server.port),
        &dir,
    );
    let out = run(Command::new("qemu-img").args(["info", &unix_uri(&socket)]));
    assert!(!out.status.success());
    let text = common::clients::text(&out);
    assert!(
        text.contains("server reported: nbdgw client: the server ended the TLS session with alert UnknownCA: it did not accept this client's certificate"),
        "{text}\n{}",
        client.log()
    );
    server.wait_for_log("TLS handshake failed", 1);
    client.wait_for_log("received fatal alert: UnknownCA", 1);
}

#[test]
fn block_status_and_list_through_client_mode_equal_the_server_direct() {
    let env = Env::new();
    let base = env.path("base.img");
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::File::create(&base).unwrap();
        f.set_len(SIZE as u64).unwrap();
        f.seek(SeekFrom::Start(1 << 20)).unwrap();
        f.write_all(&pattern(512 << 10, 11)).unwrap();
        f.seek(SeekFrom::Start(5 << 20)).unwrap();
        f.write_all(&pattern(256 << 10, 12)).unwrap();
    }
    let upstream = QemuNbd::start(&env, &base, &["-x", "disk0", "-A"]);
    let server = gateway(&env, &upstream.socket);
    let (_client, socket) = client_on_socket(
        &env,
        "client.sock",
        &format!("localhost:{}", server.port),
        &env.certs(),
    );
    let through = format!("nbd+unix:///disk0?socket={}", socket.display());
    let direct = format!("nbd+unix:///disk0?socket={}", upstream.socket.display());
    for context in ["base:allocation", "qemu:allocation-depth"] {
        let map = |uri: &str| {
            let out = run_ok(
                Command::new("nbdinfo")
                    .arg(format!("--map={context}"))
                    .arg(uri),
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        let (through, direct) = (map(&through), map(&direct));
        assert_eq!(through, direct, "{context}");
        assert!(!through.is_empty(), "{context}");
        if context == "base:allocation" {
            // Data, hole, data, hole: the two islands of the sparse file.
            assert!(through.lines().count() >= 3, "{context}: {through}");
        }
    }
    // LIST goes to the server and back.
    let out = run_ok(
        Command::new("nbdinfo")
            .arg("--list")
            .arg(format!("nbd+unix:///?socket={}", socket.display())),
    );
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(listed.contains("export=\"disk0\""), "{listed}");
}

#[test]
fn the_local_socket_is_replaced_when_stale_refused_when_live_and_removed_at_exit() {
    let env = Env::new();
    let image = env.random_image("disk.img", 1 << 20, 13);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let server = gateway(&env, &upstream.socket);
    let socket = env.path("client.sock");
    // A socket nobody listens on any more, as a killed process leaves it.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert!(socket.exists());
    let target = format!("localhost:{}", server.port);
    let (client, socket) = client_on_socket(&env, "client.sock", &target, &env.certs());
    let out = run_ok(Command::new("nbdinfo").arg("--size").arg(unix_uri(&socket)));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1048576");

    // A second client mode on the same, live, socket does not start.
    let out = run(Command::new(common::process::nbdgw_binary())
        .args(["client", "--listen"])
        .arg(&socket)
        .args(["--server", &target, "--tls-dir"])
        .arg(env.certs()));
    assert!(!out.status.success());
    let text = common::clients::text(&out);
    assert!(text.contains("another process is listening"), "{text}");

    let (status, log) = client.stop();
    assert!(status.success(), "{log}");
    assert!(!socket.exists(), "socket left behind");
    assert!(log.contains("stopped"), "{log}");
}

/// A socket of another user at --listen is that user's, live or not
/// (connect may say EACCES or EAGAIN for a live one): client mode
/// refuses to start and leaves it there, rather than unlink it and leave
/// its listener unreachable. Needs root, to make a socket of another uid.
#[test]
fn a_socket_of_another_user_at_the_listen_path_is_left_alone() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIPPED: needs root to make a socket of another uid");
        return;
    }
    let env = Env::new();
    let socket = env.path("theirs.sock");
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    std::os::unix::fs::chown(&socket, Some(65534), Some(65534)).unwrap();
    let mut child = Command::new(common::process::nbdgw_binary())
        .args(["client", "--listen"])
        .arg(&socket)
        .args(["--server", "localhost:10809", "--tls-dir"])
        .arg(env.certs())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Bounded: a build that takes the path serves on it until killed.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let text = common::clients::text(&out);
    assert!(out.status.code().is_some_and(|c| c != 0), "{text}");
    assert!(
        text.contains("a socket of uid 65534 is there, not ours"),
        "{text}"
    );
    assert!(socket.exists(), "another user's socket was removed");
}

#[test]
fn a_non_loopback_listen_address_and_a_missing_ca_refuse_to_start() {
    let env = Env::new();
    let out = run(Command::new(common::process::nbdgw_binary())
        .args([
            "client",
            "--listen",
            "0.0.0.0:10809",
            "--server",
            "localhost:10809",
            "--tls-dir",
        ])
        .arg(env.certs()));
    assert!(!out.status.success());
    let text = common::clients::text(&out);
    assert!(text.contains("loopback addresses only"), "{text}");

    let empty = env.path("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = run(Command::new(common::process::nbdgw_binary())
        .args(["client", "--listen"])
        .arg(env.path("x.sock"))
        .args(["--server", "localhost:10809", "--tls-dir"])
        .arg(&empty));
    assert!(!out.status.success());
    let text = common::clients::text(&out);
    assert!(
        text.contains("no CA to check the server's certificate"),
        "{text}"
    );
}

#[test]
fn client_mode_to_nbdkit_with_tls_required() {
    // nbdkit's memory plugin, TLS required (GnuTLS), client certificates
    // checked against the test CA.
    let env = Env::new();
    let port = common::free_port();
    let certs = env.certs();
    let mut nbdkit = Command::new("nbdkit")
        .args([
            "--foreground",
            "--exit-with-parent",
            "-i",
            "127.0.0.1",
            "-p",
        ])
        .arg(port.to_string())
        .args(["--tls=require", "--tls-verify-peer"])
        .arg(format!("--tls-certificates={}", certs.display()))
        .args(["memory", &format!("size={SIZE}")])
        .stdin(Stdio::null())
        .spawn()
        .expect("nbdkit must be installed (scripts/setup.sh)");
    common::wait_until_listening(port, "nbdkit", || {
        nbdkit.try_wait().ok().flatten().map(|s| s.to_string())
    })
    .unwrap();
    let (client, socket) =
        client_on_socket(&env, "client.sock", &format!("localhost:{port}"), &certs);
    let uri = unix_uri(&socket);
    let source = env.random_image("new.img", SIZE, 14);
    run_ok(Command::new("nbdcopy").arg(&source).arg(&uri));
    let copy = env.path("copy.img");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "raw", &uri])
            .arg(&copy),
    );
    let _ = nbdkit.kill();
    let _ = nbdkit.wait();
    assert_eq!(std::fs::read(&copy).unwrap(), pattern(SIZE, 14));
    let log = client.log();
    assert!(log.contains("TLS established"), "{log}");
    assert!(!log.contains("WARN"), "{log}");
}

#[test]
fn admin_endpoints_count_the_relayed_requests_and_readiness_follows_the_server() {
    use common::clients::http_get;
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 15);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let server = gateway(&env, &upstream.socket);
    let admin = common::free_port();
    let socket = env.path("client.sock");
    let certs = env.certs();
    let target = format!("localhost:{}", server.port);
    let admin_addr = format!("127.0.0.1:{admin}");
    let client = NbdgwProcess::client_of(
        socket.as_os_str(),
        &target,
        &certs,
        &["--admin-listen", &admin_addr],
    );
    assert_eq!(http_get(admin, "/readyz").0, 200);
    let copy = env.path("copy.img");
    run_ok(Command::new("nbdcopy").arg(unix_uri(&socket)).arg(&copy));
    assert_eq!(std::fs::read(&copy).unwrap(), pattern(SIZE, 15));
    let (code, metrics) = http_get(admin, "/metrics");
    assert_eq!(code, 200);
    assert!(sample(&metrics, "nbdgw_requests_total{command=\"READ\"}") >= 1.0);
    assert!(sample(&metrics, "nbdgw_sent_bytes_total") >= SIZE as f64);
    assert!(sample(&metrics, "nbdgw_connections_total{outcome=\"closed\"}") >= 1.0);
    assert!(!metrics.contains("certificate_not_after"), "{metrics}");

    // The server gone: the next local client is refused, and /readyz says so.
    drop(server);
    let out = run(Command::new("nbdinfo").arg(unix_uri(&socket)));
    assert!(!out.status.success());
    client.wait_for_log("server unavailable", 1);
    let (code, body) = http_get(admin, "/readyz");
    assert_eq!((code, body.trim()), (503, "upstream unavailable"));
    let (_, metrics) = http_get(admin, "/metrics");
    assert!(sample(&metrics, "nbdgw_upstream_connect_failures_total") >= 1.0);
}

#[test]
fn raw_negotiation_through_client_mode_export_name_starttls_abort_read_only() {
    use nbdgw::proto::consts::*;
    use std::io::Read;
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 16);
    let upstream = QemuNbd::start(&env, &image, &["-r"]);
    let server = gateway(&env, &upstream.socket);
    let (_client, port) = loopback_client(&env, &format!("localhost:{}", server.port), &[]);
    let addr = ([127, 0, 0, 1], port).into();

    // The old way in, with and without NO_ZEROES: the reply padded as
    // the local client asked, whatever the server chose.
    for (flags, reply_len) in [(FLAG_C_FIXED_NEWSTYLE, 134), (3, 10)] {
        let mut c = RawClient::connect(addr);
        assert_eq!(c.greeting(), FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        c.send(&flags.to_be_bytes());
        c.send_option(OPT_EXPORT_NAME, b"");
        let mut reply = vec![0u8; reply_len];
        c.stream.read_exact(&mut reply).unwrap();
        assert_eq!(
            u64::from_be_bytes(reply[..8].try_into().unwrap()),
            SIZE as u64
        );
        let tflags = u16::from_be_bytes([reply[8], reply[9]]);
        assert_ne!(tflags & TFLAG_READ_ONLY, 0, "qemu-nbd -r");
        assert!(reply[10..].iter().all(|&b| b == 0));
        assert_eq!(c.read(1, 4096, 8192), pattern(SIZE, 16)[4096..4096 + 8192]);
        // Read-only: the write is refused here, EPERM, and never sent.
        c.write(2, 0, &[1; 512]);
        let refused = c.read_reply(0);
        assert_eq!(refused[0].error, EPERM);
        c.disconnect();
    }
    assert_eq!(upstream.read_direct(), pattern(SIZE, 16));

    // STARTTLS on the plaintext side, and an unknown option: refused,
    // the connection goes on; ABORT is acknowledged and closes.
    let mut c = RawClient::handshake(addr);
    let r = c.option(OPT_STARTTLS, &[]);
    assert_eq!(r[0].reply_type, REP_ERR_UNSUP);
    assert!(r[0].message().contains("plaintext"), "{}", r[0].message());
    let r = c.option(200, &[]);
    assert_eq!(r[0].reply_type, REP_ERR_UNSUP);
    let r = c.option(OPT_ABORT, &[]);
    assert_eq!(r[0].reply_type, REP_ACK);
    c.expect_closed();
}

#[test]
fn a_server_that_never_greets_is_given_up_after_the_server_timeout() {
    let env = Env::new();
    // Accepts (the kernel does, into the backlog) and says nothing.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let socket = env.path("client.sock");
    let certs = env.certs();
    let client = NbdgwProcess::client_of(
        socket.as_os_str(),
        &format!("localhost:{port}"),
        &certs,
        &["--server-timeout", "1"],
    );
    let started = std::time::Instant::now();
    let out = run(Command::new("qemu-img").args(["info", &unix_uri(&socket)]));
    assert!(!out.status.success());
    assert!(started.elapsed() < Duration::from_secs(10));
    let text = common::clients::text(&out);
    assert!(
        text.contains("did not accept, greet and finish TLS within 1s (--server-timeout)"),
        "{text}"
    );
    client.wait_for_log("reason=\"timeout\"", 1);
    drop(silent);
}

#[test]
fn a_rotated_ca_bundle_is_used_by_new_connections() {
    let env = Env::new();
    let image = env.random_image("disk.img", 1 << 20, 17);
    let upstream = QemuNbd::start(&env, &image, &[]);
    // The server's certificate comes from a CA the client learns of only
    // in a rotation.
    let (old, new) = (Ca::new("old CA"), Ca::new("new CA"));
    let server = new.server("localhost");
    let (cert, key) = (env.path("server-cert.pem"), env.path("server-key.pem"));
    std::fs::write(&cert, &server.cert).unwrap();
    std::fs::write(&key, &server.key).unwrap();
    let gateway = NbdgwProcess::start([
        OsStr::new("--tls-cert"),
        cert.as_os_str(),
        OsStr::new("--tls-key"),
        key.as_os_str(),
        OsStr::new("--upstream"),
        upstream.socket.as_os_str(),
        OsStr::new("--landlock"),
        OsStr::new("false"),
    ]);
    let dir = old
        .client("client", &[], &[], 2)
        .client_dir(&env.path("client-dir"), &old);
    let socket = env.path("client.sock");
    let client = NbdgwProcess::client_of(
        socket.as_os_str(),
        &format!("localhost:{}", gateway.port),
        &dir,
        &["--tls-reload-interval", "1"],
    );
    let size = || run(Command::new("nbdinfo").arg("--size").arg(unix_uri(&socket)));
    assert!(!size().status.success(), "untrusted before the rotation");
    client.wait_for_log("UnknownIssuer", 1);

    // A broken bundle is refused and the previous one kept ...
    std::fs::write(dir.join("ca-cert.pem"), "-----BEGIN CERTIFICATE-----\n").unwrap();
    client.wait_for_log("client TLS reload failed", 1);
    // ... and the new bundle taken.
    std::fs::write(dir.join("ca-cert.pem"), format!("{}{}", old.pem, new.pem)).unwrap();
    client.wait_for_log("client TLS reloaded", 1);
    let out = size();
    assert!(out.status.success(), "{}", common::clients::text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1048576");
}

/// The server mode on a port of the test's choosing, so that a restart
/// comes back where `nbdgw client` reconnects to.
fn gateway_at(env: &Env, upstream: &Path, port: u16) -> NbdgwProcess {
    NbdgwProcess::in_front_of_at(env, upstream, port, &["--landlock", "false"])
}

/// `nbdgw client` on a loopback port, towards `server` (HOST:PORT), with
/// the test CA's client files; returns it and its port.
fn loopback_client(env: &Env, server: &str, extra: &[&str]) -> (NbdgwProcess, u16) {
    NbdgwProcess::client_on_loopback(server, &env.certs(), extra)
}

/// `nbdgw client --reconnect` on a loopback port, towards `server_port`.
fn reconnecting_client(env: &Env, server_port: u16, extra: &[&str]) -> (NbdgwProcess, u16) {
    let server = format!("localhost:{server_port}");
    let args: Vec<&str> = ["--reconnect"].iter().chain(extra).copied().collect();
    loopback_client(env, &server, &args)
}

#[test]
fn reconnect_sends_the_writes_in_flight_again_after_a_gateway_restart() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 18);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let counter =
        common::process::UpstreamCounter::start(&upstream.socket, &env.path("counted.sock"));
    let server_port = common::free_port();
    let mut gateway = Some(gateway_at(&env, &counter.socket, server_port));
    let (client, port) = reconnecting_client(&env, server_port, &["--reconnect-timeout", "20"]);

    // Without drops, the reconnecting stream is just a stream.
    let local_uri = format!("nbd://127.0.0.1:{port}/");
    qemu_img_both_ways(&env, &upstream, &local_uri, 19);
    nbdcopy_both_ways(&env, &upstream, &local_uri, 20);

    let modes = [
        ReplyMode::Simple,
        ReplyMode::Structured,
        ReplyMode::Extended,
    ];
    for (round, mode) in modes.into_iter().enumerate() {
        let mut c = RawClient::handshake(([127, 0, 0, 1], port).into());
        c.go(mode);
        // The server side executes the writes, but its replies are held:
        // the requests are in flight when the gateway dies.
        counter.hold_replies(true);
        let writes: Vec<(u64, Vec<u8>)> = (1..=4u64)
            .map(|k| (k << 20, pattern(256 << 10, 100 + k + 10 * round as u64)))
            .collect();
        for (cookie, (offset, data)) in writes.iter().enumerate() {
            c.write(cookie as u64 + 1, *offset, data);
        }
        std::thread::sleep(Duration::from_millis(500));
        drop(gateway.take());
        counter.hold_replies(false);
        gateway = Some(gateway_at(&env, &counter.socket, server_port));
        let mut answered: Vec<u64> = (0..4)
            .map(|_| {
                let reply = c.read_reply(0);
                let last = reply.last().unwrap();
                assert_eq!(last.error, 0, "{mode:?}: {}", client.log());
                last.cookie
            })
            .collect();
        answered.sort();
        assert_eq!(answered, [1, 2, 3, 4], "{mode:?}");
        client.wait_for_log("reconnected to the server", round + 1);
        for (cookie, (offset, data)) in writes.iter().enumerate() {
            assert_eq!(
                &c.read(10 + cookie as u64, *offset, data.len()),
                data,
                "{mode:?}"
            );
        }
        c.disconnect();
        let direct = upstream.read_direct();
        for (offset, data) in &writes {
            let at = *offset as usize;
            assert_eq!(&direct[at..at + data.len()], &data[..], "{mode:?}");
        }
    }
    let log = client.log();
    assert!(
        log.contains("connection to the server lost; reconnecting"),
        "{log}"
    );
    assert!(log.contains("requests_sent_again=4"), "{log}");
    assert!(!log.contains("giving up"), "{log}");
}

#[test]
fn reconnect_refuses_a_changed_export_and_fails_fast_past_the_timeout_until_the_server_is_back() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 21);
    let mut upstream = QemuNbd::start(&env, &image, &[]);
    let server_port = common::free_port();
    let gateway = gateway_at(&env, &upstream.socket, server_port);
    let (client, port) = reconnecting_client(&env, server_port, &["--reconnect-timeout", "3"]);
    let addr = ([127, 0, 0, 1], port).into();

    // The disk behind the server is replaced by one of another size: the
    // reconnect sees it and closes instead of serving it.
    let mut c = RawClient::handshake(addr);
    c.go(ReplyMode::Structured);
    assert_eq!(c.read(1, 0, 4096), pattern(SIZE, 21)[..4096]);
    upstream.kill();
    let other = env.random_image("other.img", SIZE / 2, 22);
    let _other = QemuNbd::start_at(upstream.socket.clone(), &other, &[]);
    client.wait_for_log("giving up on the server", 1);
    let log = client.log();
    assert!(
        log.contains(&format!("the export changed: size {} and flags", SIZE / 2)),
        "{log}"
    );
    c.expect_closed();

    // The server gone for longer than --reconnect-timeout: a request in
    // flight gets EIO, the next one EIO at once (the connection stays),
    // and once the server is back the same connection serves again.
    let mut c = RawClient::handshake(addr);
    c.go(ReplyMode::Structured);
    drop(gateway);
    let eio = |c: &mut RawClient, cookie: u64| {
        c.send_request(0, nbdgw::proto::consts::CMD_READ, cookie, 0, 4096, &[]);
        let started = std::time::Instant::now();
        let reply = c.read_reply(0);
        let last = reply.last().unwrap();
        assert_eq!(last.cookie, cookie);
        assert_eq!(last.error_code(), nbdgw::proto::consts::EIO);
        assert!(
            last.error_message()
                .contains("no connection within --reconnect-timeout"),
            "{}",
            last.error_message()
        );
        started.elapsed()
    };
    assert!(eio(&mut c, 7) < Duration::from_secs(10));
    assert!(eio(&mut c, 8) < Duration::from_secs(2));
    client.wait_for_log(
        "no server connection answered within --reconnect-timeout",
        1,
    );
    let _gateway = gateway_at(&env, &upstream.socket, server_port);
    client.wait_for_log("reconnected to the server", 1);
    assert_eq!(c.read(9, 0, 4096), pattern(SIZE / 2, 22)[..4096]);
    client.wait_for_log("the server answers again", 1);
    c.disconnect();
}

#[test]
fn reconnect_carries_a_copy_through_repeated_restarts_of_the_gateway_and_qemu_nbd() {
    const BIG: usize = 128 << 20;
    let env = Env::new();
    let image = env.random_image("disk.img", BIG, 23);
    let mut upstream = QemuNbd::start(&env, &image, &[]);
    let server_port = common::free_port();
    let mut gateway = Some(gateway_at(&env, &upstream.socket, server_port));
    let (client, port) = reconnecting_client(&env, server_port, &["--reconnect-timeout", "20"]);
    let uri = format!("nbd://127.0.0.1:{port}/");

    // One request at a time, so the copy lasts through the restarts.
    let source = env.random_image("source.img", BIG, 24);
    let copy = {
        let (source, uri) = (source.clone(), uri.clone());
        std::thread::spawn(move || {
            run(Command::new("nbdcopy")
                .args(["--connections=1", "--requests=1", "--request-size=16384"])
                .arg(&source)
                .arg(&uri))
        })
    };
    // The restarts begin once the copy has its export open: --reconnect
    // keeps an open export, and a first connection that meets a gateway
    // in the middle of a restart is refused (as CI saw, when making the
    // images delayed nbdcopy for 8 s).
    client.wait_for_log("negotiated", 1);
    for round in 0..4 {
        std::thread::sleep(Duration::from_millis(300));
        if copy.is_finished() {
            break;
        }
        if round % 2 == 0 {
            drop(gateway.take());
            std::thread::sleep(Duration::from_millis(200));
            gateway = Some(gateway_at(&env, &upstream.socket, server_port));
        } else {
            upstream.restart();
        }
    }
    let out = copy.join().unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        common::clients::text(&out),
        client.log()
    );
    assert_eq!(upstream.read_direct(), pattern(BIG, 24), "{}", client.log());
    let log = client.log();
    let reconnects = log.matches("reconnected to the server").count();
    // At least one gateway restart and one qemu-nbd restart (4 when the
    // copy lasts through all of them, as it usually does).
    assert!(reconnects >= 2, "the copy outran the restarts:\n{log}");
    assert!(!log.contains("giving up"), "{log}");
    // And reads back through the same client.
    let back = env.path("back.img");
    run_ok(Command::new("nbdcopy").arg(&uri).arg(&back));
    assert_eq!(std::fs::read(&back).unwrap(), pattern(BIG, 24));
}

/// A gateway in front of `script`'s fake server and `nbdgw client
/// --reconnect` (with `extra`) in front of that; a raw local client in
/// structured mode that has sent one 4 KiB read at 0 (cookie 0). The
/// fixture keeps the fake server and the gateway alive.
fn read_through_a_cut(
    env: &Env,
    script: common::fake_upstream::Script,
    extra: &[&str],
) -> (
    (common::fake_upstream::FakeUpstream, NbdgwProcess),
    NbdgwProcess,
    RawClient,
) {
    let upstream = common::fake_upstream::scripted(&env.path("fake.sock"), SIZE as u64, script);
    let server = gateway(env, &upstream.socket);
    let (client, port) = reconnecting_client(env, server.port, extra);
    let mut c = RawClient::handshake(([127, 0, 0, 1], port).into());
    c.go(ReplyMode::Structured);
    c.send_request(0, nbdgw::proto::consts::CMD_READ, 1, 0, 4096, &[]);
    ((upstream, server), client, c)
}

/// A fake server (a real one cannot be cut between two chunks on cue):
/// its first connection answers a read with half the data (bytes of 9)
/// in a chunk that is not the last, and dies; later connections answer
/// every read whole (bytes of 7).
fn cut_after_the_first_chunk(
    connection: usize,
    read: common::fake_upstream::Asked,
) -> common::fake_upstream::Answer {
    use common::fake_upstream::{chunk, good_read, Answer};
    use nbdgw::proto::consts::*;
    if connection > 0 {
        return good_read(read).into();
    }
    let half = read.length / 2;
    let mut bytes = chunk(0, REPLY_TYPE_OFFSET_DATA, read.cookie, 8 + half);
    bytes.extend_from_slice(&read.offset.to_be_bytes());
    bytes.extend(std::iter::repeat_n(9u8, half as usize));
    Answer { bytes, close: true }
}

#[test]
fn reconnect_asks_again_for_a_reply_cut_between_chunks() {
    let env = Env::new();
    let (_fixture, client, mut c) = read_through_a_cut(&env, cut_after_the_first_chunk, &[]);
    // The first chunk was held, and dropped with the connection: the
    // local client sees only the new server's whole answer.
    let reply = c.read_reply(0);
    assert_eq!(reply.len(), 1, "one whole answer, nothing of the cut one");
    assert!(reply[0].done());
    assert_eq!(reply[0].payload[..8], 0u64.to_be_bytes());
    assert_eq!(reply[0].payload[8..], vec![7u8; 4096]);
    client.wait_for_log("reconnected to the server", 1);
    client.wait_for_log("replies_held=1", 1);
    assert_eq!(c.read(2, 8192, 4096), vec![7u8; 4096]);
    c.disconnect();
}

/// A fake server (as above): its first connection answers a read with a
/// small chunk, then a larger one, neither the last, and dies.
fn cut_after_two_chunks(
    connection: usize,
    read: common::fake_upstream::Asked,
) -> common::fake_upstream::Answer {
    use common::fake_upstream::{chunk, good_read, Answer};
    use nbdgw::proto::consts::*;
    if connection > 0 {
        return good_read(read).into();
    }
    let mut bytes = Vec::new();
    for (at, len) in [(0u64, 1024u32), (1024, 2048)] {
        bytes.extend(chunk(0, REPLY_TYPE_OFFSET_DATA, read.cookie, 8 + len));
        bytes.extend_from_slice(&(read.offset + at).to_be_bytes());
        bytes.extend(std::iter::repeat_n(9u8, len as usize));
    }
    Answer { bytes, close: true }
}

#[test]
fn a_reply_that_outgrows_the_reply_buffer_goes_up_held_chunks_first_and_a_cut_ends_it_in_eio() {
    use nbdgw::proto::consts::*;
    let env = Env::new();
    // Room for the first chunk (1052 bytes and the entry), not for both.
    let (_fixture, client, mut c) =
        read_through_a_cut(&env, cut_after_two_chunks, &["--reply-buffer", "2000"]);
    let reply = c.read_reply(0);
    assert_eq!(reply.len(), 3, "both chunks in order, then the end");
    assert_eq!(reply[0].payload[..8], 0u64.to_be_bytes());
    assert_eq!(reply[0].payload[8..], vec![9u8; 1024]);
    assert_eq!(reply[1].payload[..8], 1024u64.to_be_bytes());
    assert_eq!(reply[1].payload[8..], vec![9u8; 2048]);
    assert_eq!(reply[2].error_code(), EIO);
    assert!(reply[2].done());
    client.wait_for_log("replies_cut=1", 1);
    assert_eq!(c.read(2, 8192, 4096), vec![7u8; 4096]);
    c.disconnect();
}

#[test]
fn reconnect_ends_a_cut_reply_larger_than_the_reply_buffer_with_eio_and_goes_on() {
    use nbdgw::proto::consts::*;
    let env = Env::new();
    // Room for less than the first chunk: it goes up as it comes.
    let (_fixture, client, mut c) =
        read_through_a_cut(&env, cut_after_the_first_chunk, &["--reply-buffer", "1024"]);
    let reply = c.read_reply(0);
    assert_eq!(reply.len(), 2, "half the data, then the end");
    assert_eq!(reply[0].payload.len(), 8 + 2048);
    assert_eq!(reply[0].payload[8..], vec![9u8; 2048]);
    assert!(!reply[0].done());
    assert_eq!(reply[1].error_code(), EIO);
    assert!(
        reply[1]
            .error_message()
            .contains("lost in the middle of this reply"),
        "{}",
        reply[1].error_message()
    );
    // The connection goes on, over the new server connection.
    assert_eq!(c.read(2, 8192, 4096), vec![7u8; 4096]);
    client.wait_for_log("reconnected to the server", 1);
    c.disconnect();
}

/// Client mode drains as the server mode does: by default a local request
/// read after the drain began is left unanswered and the connection
/// closes once the earlier read is answered (a0fc9df, and client mode
/// before `--drain-answer` was its flag too, answered it ESHUTDOWN, which
/// qemu hands to the guest). A read held at the upstream behind the
/// server gateway; SIGTERM to client mode; a second read; the first let
/// go: its data, then the close, with no answer to the second.
#[test]
fn client_mode_at_shutdown_leaves_a_new_request_unanswered_by_default() {
    use nbdgw::proto::consts::CMD_READ;
    let env = Env::new();
    let path = env.random_image("disk.img", SIZE, 3);
    let upstream = QemuNbd::start(&env, &path, &[]);
    let relay = common::process::UpstreamCounter::start(&upstream.socket, &env.path("held.sock"));
    let port = common::free_port();
    let _gw = gateway_at(&env, &relay.socket, port);
    let (mut client, local) = loopback_client(&env, &format!("localhost:{port}"), &[]);
    let mut c = RawClient::handshake(([127, 0, 0, 1], local).into());
    c.go(ReplyMode::Structured);
    relay.hold_replies(true);
    c.send_request(0, CMD_READ, 1, 0, 65536, &[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while relay.reads() < 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the read never reached the upstream"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    client.signal("TERM");
    client.wait_for_log("shutting down: no longer accepting", 1);
    c.send_request(0, CMD_READ, 2, 4096, 4096, &[]);
    relay.hold_replies(false);
    let image = std::fs::read(&path).unwrap();
    let reply = c.read_reply(65536);
    let (cookie, error) = (reply[0].cookie, reply[0].error_code());
    assert_eq!(
        cookie, 1,
        "the read sent during the drain answered, error {error}"
    );
    let data = common::raw::assemble(&reply, 1, 0, 65536);
    assert!(data == image[..65536], "the read in flight came back wrong");
    let mut rest = Vec::new();
    use std::io::Read;
    c.stream.read_to_end(&mut rest).expect("a clean close");
    assert!(
        rest.is_empty(),
        "after the last reply: {rest:02x?}, not the close"
    );
    let status = client.wait_exit(Duration::from_secs(10)).expect("exits");
    assert!(status.success(), "{}", client.log());
}
