//! Behind a load balancer (issue 30 item 4): a real HAProxy from Debian in
//! TCP mode, with `send-proxy-v2` (and `send-proxy` for v1), in front of
//! the nbdgw binary and a real qemu-nbd. HAProxy connects to nbdgw from
//! 127.0.0.9, the only trusted address (`--proxy-protocol-from`); its
//! clients come from 127.0.0.1 (nbdinfo, nbdcopy) and, bound, from
//! 127.0.0.2 and 127.0.0.3 (raw TCP). A "fake balancer" (raw bytes from
//! 127.0.0.9) plays the faults HAProxy cannot produce: a malformed header,
//! and none at all.

mod common;

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::await_that;
use common::clients::{http_get, nbds_uri, text};
use common::metrics::metric;
use common::peers::{connect_from, greeted};
use common::process::NbdgwProcess;
use common::site::PolicySite;
use common::{free_port, run, QemuNbd};

const POLICY: &str = r#"
[[rule]]
exports = ["*"]
allow = { cn = ["host"] }
access = "read-only"
"#;

const BALANCER: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 9));
const HERD: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
const OTHER: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3));

/// HAProxy in the foreground with a config written here; killed on drop.
struct Haproxy {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Haproxy {
    /// `send`: `send-proxy-v2` or `send-proxy`. `extra`: more words for
    /// the server line.
    fn start(gateway: u16, send: &str, extra: &str) -> Self {
        Self::start_bound(gateway, send, extra, false)
    }

    /// `unix`: the frontend listens on a unix socket (`unix_socket`), not
    /// on TCP.
    fn start_bound(gateway: u16, send: &str, extra: &str, unix: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let bind = match unix {
            true => format!("unix@{}", dir.path().join("fe.sock").display()),
            false => format!("127.0.0.1:{port}"),
        };
        let config = format!(
            "global\n    maxconn 1000\n\
             defaults\n    mode tcp\n    timeout connect 5s\n    timeout client 120s\n    timeout server 120s\n\
             frontend nbd\n    bind {bind}\n    default_backend gw\n\
             backend gw\n    server gw 127.0.0.1:{gateway} {send} source {BALANCER} {extra}\n"
        );
        let path = dir.path().join("haproxy.cfg");
        std::fs::write(&path, config).unwrap();
        let child = Command::new("haproxy")
            .arg("-db")
            .arg("-f")
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("haproxy (scripts/setup.sh installs it)");
        let mut haproxy = Haproxy {
            child,
            port,
            _dir: dir,
        };
        match unix {
            true => haproxy.wait_unix(),
            false => haproxy.wait_listening(),
        }
        haproxy
    }

    fn unix_socket(&self) -> PathBuf {
        self._dir.path().join("fe.sock")
    }

    /// Until HAProxy listens: seen in /proc/net/tcp, not by connecting
    /// (which would send nbdgw a connection of its own) nor by binding
    /// the port (which, at the wrong moment, would make HAProxy's own
    /// bind fail).
    fn wait_listening(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        // "0100007F:PORT" in hex, state 0A (LISTEN).
        let local = format!("0100007F:{:04X}", self.port);
        let listening = || {
            std::fs::read_to_string("/proc/net/tcp")
                .unwrap_or_default()
                .lines()
                .any(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    f.get(1) == Some(&local.as_str()) && f.get(3) == Some(&"0A")
                })
        };
        while !listening() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("haproxy exited with {status}");
            }
            assert!(Instant::now() < deadline, "haproxy did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Until the unix frontend listens: seen in /proc/net/unix (flags
    /// 00010000, accepting) and in place, not by connecting, which would send nbdgw a
    /// connection of its own.
    fn wait_unix(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let path = self.unix_socket().display().to_string();
        let listening = || {
            std::fs::read_to_string("/proc/net/unix")
                .unwrap_or_default()
                .lines()
                .any(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    // HAProxy binds a temporary name, then renames it.
                    f.get(3) == Some(&"00010000") && f.last().is_some_and(|p| p.starts_with(&path))
                })
                && std::path::Path::new(&path).exists()
        };
        while !listening() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("haproxy exited with {status}");
            }
            assert!(Instant::now() < deadline, "haproxy did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn headers(admin: u16, outcome: &str) -> f64 {
    metric(
        admin,
        &format!("nbdgw_proxy_headers_total{{outcome=\"{outcome}\"}}"),
    )
}

struct Setup {
    site: PolicySite,
    _upstream: QemuNbd,
    image: PathBuf,
    gw: NbdgwProcess,
    admin: u16,
}

/// The gateway trusting 127.0.0.9 only, before a qemu-nbd with a 1 MiB
/// random image.
fn setup(extra: &[&str]) -> Setup {
    let site = PolicySite::new("proxy CA", POLICY);
    let image = site.env.random_image("disk.img", 1 << 20, 30);
    let upstream = QemuNbd::start(&site.env, &image, &[]);
    let admin = free_port();
    let admin_addr = format!("127.0.0.1:{admin}");
    let mut args: Vec<&OsStr> = [
        "--upstream",
        upstream.socket.to_str().unwrap(),
        "--admin-listen",
        &admin_addr,
        "--proxy-protocol-from",
        "127.0.0.9",
    ]
    .into_iter()
    .map(OsStr::new)
    .collect();
    args.extend(extra.iter().map(OsStr::new));
    let gw = site.gateway(&args, &[]);
    Setup {
        site,
        _upstream: upstream,
        image,
        gw,
        admin,
    }
}

/// nbdcopy (libnbd, TLS with the `host` certificate) reads the whole
/// export through `port` and it must match the image.
fn read_through(s: &Setup, port: u16) {
    let host = s.site.client("host", 1);
    let out = s.site.env.path("copy.img");
    let _ = std::fs::remove_file(&out);
    let done = run(Command::new("nbdcopy").arg(nbds_uri(port, &host)).arg(&out));
    assert!(done.status.success(), "nbdcopy: {}", text(&done));
    assert!(
        std::fs::read(&out).unwrap() == std::fs::read(&s.image).unwrap(),
        "the bytes read through HAProxy differ from the image"
    );
}

/// The audit trail's open line (target nbdgw::audit), once it is there.
fn audit_open_line(gw: &NbdgwProcess) -> String {
    await_that("the audit line", || {
        gw.log()
            .lines()
            .any(|l| l.contains("nbdgw::audit") && l.contains("negotiated"))
    });
    gw.log()
        .lines()
        .find(|l| l.contains("nbdgw::audit") && l.contains("negotiated"))
        .unwrap()
        .to_string()
}

fn assert_shows_the_client_not_the_balancer(line: &str) {
    assert!(line.contains("peer=127.0.0.1:"), "{line}");
    assert!(line.contains("balancer=127.0.0.9:"), "{line}");
    assert!(!line.contains("peer=127.0.0.9"), "{line}");
}

#[test]
fn tls_and_nbd_through_haproxy_v2_are_served_and_audited_as_the_real_client() {
    let s = setup(&[]);
    // `check-send-proxy`: HAProxy's health checks carry a v2 LOCAL header.
    let lb = Haproxy::start(
        s.gw.port,
        "send-proxy-v2",
        "check check-send-proxy inter 500ms",
    );
    read_through(&s, lb.port);
    assert_shows_the_client_not_the_balancer(&audit_open_line(&s.gw));
    // The close line may come a little after nbdcopy has exited.
    let close_line = || {
        s.gw.log()
            .lines()
            .find(|l| l.contains("nbdgw::audit") && l.contains("closed"))
            .map(str::to_string)
    };
    await_that("the audit close line", || close_line().is_some());
    assert_shows_the_client_not_the_balancer(&close_line().unwrap());
    assert!(headers(s.admin, "v2") >= 1.0);
    // The health checks: the balancer's own connections, as itself.
    await_that("a LOCAL header from HAProxy's health check", || {
        headers(s.admin, "local") >= 1.0
    });
    assert_eq!(headers(s.admin, "invalid"), 0.0, "{}", s.gw.log());
}

#[test]
fn tls_and_nbd_through_haproxy_v1_are_served_as_the_real_client() {
    let s = setup(&[]);
    let lb = Haproxy::start(s.gw.port, "send-proxy", "");
    read_through(&s, lb.port);
    assert_shows_the_client_not_the_balancer(&audit_open_line(&s.gw));
    // nbdcopy may open more than one connection.
    assert!(headers(s.admin, "v1") >= 1.0);
    assert_eq!(headers(s.admin, "v2") + headers(s.admin, "invalid"), 0.0);
}

/// `--max-handshakes-per-source 2` and 2 waiting per source: a herd of 6
/// silent connections from 127.0.0.2 through HAProxy gets 2 slots, 2
/// places in line and 2 refusals, as one source; 127.0.0.3 is still
/// served at once. Judged by the balancer's address, the herd would
/// have taken the balancer's share and 127.0.0.3 would wait.
#[test]
fn a_herd_behind_haproxy_is_one_source_and_a_second_address_is_still_served() {
    let s = setup(&[
        "--max-handshakes",
        "6",
        "--handshake-reserve",
        "0",
        "--max-handshakes-per-source",
        "2",
        "--handshake-queue-per-source",
        "2",
        "--handshake-timeout",
        "120",
    ]);
    let lb = Haproxy::start(s.gw.port, "send-proxy-v2", "");
    let herd: Vec<TcpStream> = (0..6)
        .map(|_| connect_from(HERD, lb.addr()).expect("connect from 127.0.0.2"))
        .collect();
    await_that("the herd admitted or refused", || {
        headers(s.admin, "v2") >= 6.0
            && metric(s.admin, "nbdgw_handshakes_in_progress")
                + metric(s.admin, "nbdgw_handshakes_waiting")
                >= 4.0
    });
    let refused = "nbdgw_handshakes_refused_total{reason=\"source_queue_full\"}";
    await_that("two of the herd refused", || {
        metric(s.admin, refused) >= 2.0
    });
    assert_eq!(metric(s.admin, "nbdgw_handshakes_in_progress"), 2.0);
    assert_eq!(metric(s.admin, "nbdgw_handshakes_waiting"), 2.0);
    assert_eq!(metric(s.admin, refused), 2.0);
    // `greeted` reads the greeting: each connection is asked until it was.
    let mut was_greeted = vec![false; herd.len()];
    await_that("two of the herd greeted", || {
        for (seen, c) in was_greeted.iter_mut().zip(&herd) {
            *seen = *seen || greeted(c);
        }
        was_greeted.iter().filter(|g| **g).count() == 2
    });
    let other = connect_from(OTHER, lb.addr()).expect("connect from 127.0.0.3");
    await_that("127.0.0.3 greeted while the herd holds its share", || {
        greeted(&other)
    });
    assert_eq!(metric(s.admin, "nbdgw_handshakes_in_progress"), 3.0);
    await_that("the refusal line", || {
        s.gw.log().contains("last_peer=127.0.0.2:")
    });
    assert!(
        !s.gw.log().contains("last_peer=127.0.0.9"),
        "{}",
        s.gw.log()
    );
    drop(herd);
}

/// A v2 header sent straight to nbdgw from 127.0.0.2, which is not
/// trusted: it is the client's first NBD bytes, refused as such, and the
/// log names the real TCP peer, never the forged address.
#[test]
fn a_forged_header_from_an_untrusted_address_is_refused_as_garbage() {
    let s = setup(&[]);
    let mut forger = connect_from(HERD, s.gw.addr()).expect("connect from 127.0.0.2");
    let forged = nbdgw::proto::proxy::encode_v2(
        "10.66.66.66:4242".parse().unwrap(),
        "127.0.0.1:10809".parse().unwrap(),
        &[],
    );
    forger.write_all(&forged).unwrap();
    forger
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut greeting = [0u8; 18];
    forger.read_exact(&mut greeting).expect("the NBD greeting");
    assert_eq!(&greeting[..8], b"NBDMAGIC");
    let mut rest = Vec::new();
    let _ = forger.read_to_end(&mut rest);
    assert!(rest.is_empty(), "nbdgw answered the forged bytes: {rest:?}");
    await_that("the close logged", || {
        s.gw.log()
            .lines()
            .any(|l| l.contains("peer=127.0.0.2:") && l.contains("closed"))
    });
    let log = s.gw.log();
    assert!(!log.contains("10.66.66.66"), "{log}");
    assert_eq!(headers(s.admin, "v2"), 0.0);
    let line = log
        .lines()
        .find(|l| l.contains("peer=127.0.0.2:") && l.contains("closed"))
        .unwrap();
    assert!(line.contains("flags"), "{line}");
}

/// A fake balancer at the trusted address sends a malformed v1 line: it
/// is closed with nothing sent, said in a line, counted; a real client
/// through HAProxy is served meanwhile.
#[test]
fn a_malformed_header_from_the_trusted_address_is_refused_and_others_are_served() {
    let s = setup(&[]);
    let lb = Haproxy::start(s.gw.port, "send-proxy-v2", "");
    let mut fake = connect_from(BALANCER, s.gw.addr()).expect("connect from 127.0.0.9");
    fake.write_all(b"PROXY TCP4 10.1.1.1 10.0.0.1 0123 10809\r\n\x1b[31m")
        .unwrap();
    fake.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut got = Vec::new();
    let _ = fake.read_to_end(&mut got);
    assert!(
        got.is_empty(),
        "nbdgw sent {got:?} after a malformed header"
    );
    await_that("the refusal logged", || {
        s.gw.log().contains("outcome=\"invalid\"") || s.gw.log().contains("outcome=invalid")
    });
    let log = s.gw.log();
    let line = log.lines().find(|l| l.contains("a bad port")).unwrap();
    assert!(line.contains("balancer=127.0.0.9:"), "{line}");
    assert!(!log.contains('\x1b'), "{log}");
    assert_eq!(headers(s.admin, "invalid"), 1.0);
    read_through(&s, lb.port);
    assert_shows_the_client_not_the_balancer(&audit_open_line(&s.gw));
}

/// A fake balancer at the trusted address that sends nothing is closed at
/// `--handshake-timeout` (2 s here), never greeted.
#[test]
fn no_header_from_the_trusted_address_is_refused_at_the_handshake_timeout() {
    let s = setup(&["--handshake-timeout", "2"]);
    let mut fake = connect_from(BALANCER, s.gw.addr()).expect("connect from 127.0.0.9");
    let since = Instant::now();
    fake.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut got = Vec::new();
    let _ = fake.read_to_end(&mut got);
    let waited = since.elapsed();
    assert!(
        got.is_empty(),
        "nbdgw greeted a connection without a header: {got:?}"
    );
    assert!(
        waited >= Duration::from_millis(1500),
        "closed after {waited:?}"
    );
    assert!(waited < Duration::from_secs(30), "closed after {waited:?}");
    await_that("the timeout counted", || headers(s.admin, "timeout") == 1.0);
    assert!(
        s.gw.log()
            .contains("no PROXY header within 2s (--proxy-protocol-timeout, or --handshake-timeout if shorter)"),
        "{}",
        s.gw.log()
    );
}

/// A balancer sends its header with its connect: a trusted peer that
/// does not is let go at `--proxy-protocol-timeout` (2 s here), long
/// before `--handshake-timeout`, so it cannot hold a place of the bound.
#[test]
fn no_header_is_refused_at_the_shorter_proxy_protocol_timeout() {
    let s = setup(&[
        "--handshake-timeout",
        "120",
        "--proxy-protocol-timeout",
        "2",
    ]);
    let mut fake = connect_from(BALANCER, s.gw.addr()).expect("connect from 127.0.0.9");
    let since = Instant::now();
    fake.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut got = Vec::new();
    let _ = fake.read_to_end(&mut got);
    let waited = since.elapsed();
    assert!(got.is_empty(), "{got:?}");
    assert!(
        (Duration::from_millis(1500)..Duration::from_secs(30)).contains(&waited),
        "closed after {waited:?}"
    );
    await_that("the timeout counted", || headers(s.admin, "timeout") == 1.0);
}

/// Before their header, connections from balancers count against
/// `--max-handshakes` plus `--handshake-queue` (2 here), not against any
/// source's line: a third silent one from the fake balancer is closed at
/// once and counted `busy`, while the first two are still waiting.
#[test]
fn connections_waiting_for_their_header_are_bounded_and_the_rest_closed() {
    let s = setup(&[
        "--max-handshakes",
        "1",
        "--handshake-reserve",
        "0",
        "--handshake-queue",
        "1",
        "--handshake-timeout",
        "120",
        "--proxy-protocol-timeout",
        "120",
    ]);
    let held: Vec<TcpStream> = (0..2)
        .map(|_| connect_from(BALANCER, s.gw.addr()).expect("connect from 127.0.0.9"))
        .collect();
    let mut third = connect_from(BALANCER, s.gw.addr()).expect("connect from 127.0.0.9");
    third
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut got = Vec::new();
    let _ = third.read_to_end(&mut got);
    assert!(got.is_empty(), "{got:?}");
    assert_eq!(headers(s.admin, "busy"), 1.0);
    for c in &held {
        c.set_nonblocking(true).unwrap();
        let mut byte = [0u8; 1];
        let still_open =
            matches!((&*c).read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        assert!(
            still_open,
            "a connection within the bound was closed or greeted"
        );
    }
}

/// Review item 3: HAProxy sends a v2 LOCAL header not only for its health
/// checks but for every client it cannot name, e.g. one of a unix socket
/// frontend (make_proxy_line_v2 in HAProxy's connection.c). Served, they
/// would all be one source, the balancer. By default such a connection is
/// closed right after its header, never greeted.
#[test]
fn a_client_of_a_unix_socket_frontend_comes_as_local_and_is_closed() {
    let s = setup(&[]);
    let lb = Haproxy::start_bound(s.gw.port, "send-proxy-v2", "", true);
    let mut client = std::os::unix::net::UnixStream::connect(lb.unix_socket()).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut got = Vec::new();
    let _ = client.read_to_end(&mut got);
    assert!(
        got.is_empty(),
        "a client behind a LOCAL header was greeted: {:?}",
        String::from_utf8_lossy(&got[..got.len().min(8)])
    );
    await_that("the LOCAL header counted", || {
        headers(s.admin, "local") == 1.0
    });
    assert!(!s.gw.log().contains(" WARN "), "{}", s.gw.log());
}

/// `--proxy-protocol-serve-local true`: the operator's choice to serve
/// them, as the balancer.
#[test]
fn with_serve_local_a_client_of_a_unix_socket_frontend_is_greeted() {
    let s = setup(&["--proxy-protocol-serve-local", "true"]);
    let lb = Haproxy::start_bound(s.gw.port, "send-proxy-v2", "", true);
    let mut client = std::os::unix::net::UnixStream::connect(lb.unix_socket()).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut greeting = [0u8; 8];
    client.read_exact(&mut greeting).expect("the NBD greeting");
    assert_eq!(&greeting, b"NBDMAGIC");
}

/// Review item 2: a second trusted address (127.0.0.8) holds every place
/// before the header with half-sent headers; the real balancer's client
/// must still get in. Once the bound is full, a connection from an
/// address holding fewer sheds the busiest address's oldest; the refusals
/// are said at WARN (rate-limited), not only at debug.
#[test]
fn a_trusted_address_holding_every_place_does_not_lock_the_balancer_out() {
    let hog_ip = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 8));
    let s = setup(&[
        "--proxy-protocol-from",
        "127.0.0.8",
        "--max-handshakes",
        "2",
        "--handshake-reserve",
        "0",
        "--handshake-queue",
        "4",
        "--handshake-timeout",
        "120",
        "--proxy-protocol-timeout",
        "120",
    ]);
    let lb = Haproxy::start(s.gw.port, "send-proxy-v2", "");
    let mut hog: Vec<TcpStream> = (0..6)
        .map(|_| {
            let mut c = connect_from(hog_ip, s.gw.addr()).expect("connect from 127.0.0.8");
            c.write_all(b"PROXY TCP4 ").unwrap();
            c
        })
        .collect();
    // A seventh is over the bound, and .8 holds the most: refused. Once
    // it is, the six before it hold their places.
    hog.push(connect_from(hog_ip, s.gw.addr()).expect("connect from 127.0.0.8"));
    await_that("the seventh refused", || headers(s.admin, "busy") == 1.0);
    let client = connect_from(OTHER, lb.addr()).expect("connect from 127.0.0.3");
    await_that("the balancer's client greeted", || greeted(&client));
    assert_eq!(headers(s.admin, "busy"), 2.0, "one of .8's shed");
    assert!(
        s.gw.log().lines().any(|l| l.contains(" WARN ")
            && l.contains("closed before their PROXY header")
            && l.contains("last_balancer=127.0.0.8")),
        "{}",
        s.gw.log()
    );
    drop(hog);
}

/// Review item 1: the descriptor budget counts the connections waiting
/// for their PROXY header. Under RLIMIT_NOFILE 190, 102 silent
/// connections from a trusted address and 102 from an untrusted one:
/// without them in the budget, accept failed with EMFILE.
#[test]
fn connections_before_their_header_fit_under_the_descriptor_limit() {
    let env = common::Env::new();
    let image = env.random_image("disk.img", 1 << 20, 31);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let (port, admin) = (free_port(), free_port());
    let admin_addr = format!("127.0.0.1:{admin}");
    let flags = [
        ["--admin-listen", &admin_addr],
        ["--proxy-protocol-from", "127.0.0.8"],
        ["--max-connections", "4"],
        ["--admin-max-connections", "1"],
        ["--max-handshakes", "2"],
        ["--handshake-queue", "100"],
        ["--handshake-timeout", "120"],
    ]
    .concat();
    let args = common::process::front_args(&env.certs(), &upstream.socket, &flags);
    let gw = NbdgwProcess::start_at_with_nofile(190, args, port);
    let bound: f64 = gw
        .log()
        .split("proxy_header_waiting=")
        .nth(1)
        .and_then(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0.0);
    let open = |from: IpAddr| -> Vec<TcpStream> {
        (0..102)
            .map(|_| connect_from(from, gw.addr()).expect("connect"))
            .collect()
    };
    let trusted = open(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 8)));
    let untrusted = open(OTHER);
    let untrusted_seen = || {
        let (_, body) = http_get(admin, "/metrics");
        let refused: f64 = body
            .lines()
            .filter_map(|l| l.strip_prefix("nbdgw_handshakes_refused_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        refused
            + metric(admin, "nbdgw_handshakes_in_progress")
            + metric(admin, "nbdgw_handshakes_waiting")
    };
    await_that("all 204 accepted", || {
        assert!(!gw.log().contains("Too many open files"), "{}", gw.log());
        headers(admin, "busy") == 102.0 - bound && untrusted_seen() == 102.0
    });
    assert!(!gw.log().contains("Too many open files"), "{}", gw.log());
    drop((trusted, untrusted));
}

/// Review item 6: a connect-and-close from the balancer (an L4 check of
/// the NBD port) is counted `closed` but is no warning: one per check
/// interval would bury the real ones.
#[test]
fn a_connect_and_close_from_the_balancer_is_no_warning() {
    let s = setup(&[]);
    drop(connect_from(BALANCER, s.gw.addr()).expect("connect from 127.0.0.9"));
    await_that("the close counted", || headers(s.admin, "closed") == 1.0);
    let log = s.gw.log();
    assert!(
        !log.lines()
            .any(|l| l.contains(" WARN ") && l.contains("balancer=127.0.0.9")),
        "{log}"
    );
}

/// Review item 7: the variable's items are trimmed and empty ones
/// skipped; a prefix of length 0 is warned of at start.
#[test]
fn the_variable_takes_spaces_and_a_trailing_comma_and_a_zero_prefix_is_warned_of() {
    let site = PolicySite::new("proxy CA", POLICY);
    let image = site.env.random_image("disk.img", 1 << 20, 32);
    let upstream = QemuNbd::start(&site.env, &image, &[]);
    let gw = site.gateway(
        &[OsStr::new("--upstream"), upstream.socket.as_os_str()],
        &[(
            "NBDGW_PROXY_PROTOCOL_FROM",
            OsStr::new("127.0.0.9, 0.0.0.0/0,"),
        )],
    );
    // Said as the accept loop starts, which may be just after the port
    // listens.
    await_that("the warning", || gw.log().contains("trusts every address"));
    let log = gw.log();
    assert!(log.contains("from=127.0.0.9/32,0.0.0.0/0"), "{log}");
    assert!(
        log.lines()
            .any(|l| l.contains(" WARN ") && l.contains("trusts every address")),
        "{log}"
    );
}
