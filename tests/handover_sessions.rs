//! Handing established sessions to a successor (issue 29, per-session
//! step): a client keeps one connection open across replacements and
//! sees every byte right, no error, no reconnect, no new TLS handshake.
//! Real qemu-nbd upstream; python3-libnbd clients over TLS.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use common::clients::http_get;
use common::handover::{
    generation, private_dir, spawn_generation, successor_killed_holding_the_state,
};
use common::raw::{client_tls, RawClient, Stream};
use common::{Env, QemuNbd};
use nbdgw::proto::consts::*;
use nbdgw::proto::transmission::ReplyMode;

const IMAGE_LEN: usize = 8 << 20;

/// python3-libnbd: ONE connection for its whole life, writing a pattern
/// (numbered by its round) then reading it back and comparing, over and
/// over, with several requests in flight each round, until its stdin
/// closes; prints "progress N" after every round, then one "done" line.
/// Any error ends it with "error ...". libnbd never reconnects a handle.
const ONE_SESSION: &str = r#"
import nbd, sys, threading
port, certs = sys.argv[1], sys.argv[2]
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
h = nbd.NBD()
h.set_tls(nbd.TLS_REQUIRE)
h.set_tls_certificates(certs)
h.connect_uri(f"nbds://localhost:{port}/")
print("connected", h.get_protocol(), h.get_structured_replies_negotiated(),
      h.get_extended_headers_negotiated() if hasattr(h, "get_extended_headers_negotiated") else "n/a",
      flush=True)
size = h.get_size()
chunk = 65536
rounds = 0
try:
    while not stop.is_set():
        rounds += 1
        base = (rounds * 8 * chunk) % (size - 8 * chunk)
        bufs = []
        for k in range(8):
            pat = bytes([(rounds * 8 + k) % 251]) * (chunk - 8) + rounds.to_bytes(8, "big")
            bufs.append(pat)
            h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(pat)), base + k * chunk)
        while h.aio_in_flight() > 0:
            h.poll(-1)
        reads = [nbd.Buffer(chunk) for k in range(8)]
        for k in range(8):
            h.aio_pread(reads[k], base + k * chunk)
        while h.aio_in_flight() > 0:
            h.poll(-1)
        for k in range(8):
            got = bytes(reads[k].to_bytearray())
            if got != bufs[k]:
                print("error mismatch at round", rounds, "block", k, flush=True)
                sys.exit(1)
        print("progress", rounds, flush=True)
    h.flush()
    h.shutdown()
    print("done", rounds, flush=True)
except nbd.Error as e:
    print("error", rounds, e, flush=True)
    sys.exit(1)
"#;

struct OneSession {
    child: Child,
    out: BufReader<ChildStdout>,
    rounds: usize,
    pub connected: String,
}

impl OneSession {
    fn start(port: u16, env: &Env) -> Self {
        let mut child = Command::new("/usr/bin/python3")
            .arg("-c")
            .arg(ONE_SESSION)
            .arg(port.to_string())
            .arg(env.certs())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3-libnbd");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut connected = String::new();
        out.read_line(&mut connected).unwrap();
        assert!(connected.starts_with("connected"), "{connected}");
        OneSession {
            child,
            out,
            rounds: 0,
            connected,
        }
    }

    /// Waits until `more` rounds beyond those seen have passed.
    fn wait_for(&mut self, more: usize) {
        let want = self.rounds + more;
        let mut line = String::new();
        while self.rounds < want {
            line.clear();
            let n = self.out.read_line(&mut line).unwrap();
            assert!(
                n > 0 && !line.starts_with("error"),
                "the client failed: {line}"
            );
            if let Some(n) = line.strip_prefix("progress ") {
                self.rounds = n.trim().parse().unwrap();
            }
        }
    }

    /// Stops it; the number of rounds, every one checked.
    fn finish(mut self) -> usize {
        drop(self.child.stdin.take());
        let mut rest = String::new();
        self.out.read_to_string(&mut rest).unwrap();
        assert!(self.child.wait().unwrap().success(), "{rest}");
        let done = rest
            .lines()
            .find_map(|l| l.strip_prefix("done "))
            .expect(&rest);
        done.trim().parse().unwrap()
    }
}

/// One libnbd connection open across five replacements: every round's
/// writes read back right, no error, the same connection throughout (a
/// libnbd handle never reconnects), and no TLS handshake in any
/// successor: each serves the session it was handed.
#[test]
fn one_connection_rides_through_five_replacements() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 29);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let admin = common::free_port();
    let admin_flag = format!("127.0.0.1:{admin}");
    let flags = ["--admin-listen", admin_flag.as_str()];
    let mut old = generation(&env, &upstream.socket, port, &handover, false, &flags);
    let mut client = OneSession::start(port, &env);
    eprintln!("client: {}", client.connected.trim());
    client.wait_for(5);
    for round in 1..=5 {
        let new = generation(&env, &upstream.socket, port, &handover, true, &flags);
        new.wait_for_log("hand-over: serving a session handed over", 1);
        let status = old
            .wait_exit(Duration::from_secs(60))
            .expect("the old gateway exits");
        let log = old.log();
        assert!(
            status.success(),
            "round {round}: old gateway {status}:\n{log}"
        );
        assert!(
            log.contains("hand-over: the successor serves the session"),
            "{log}"
        );
        if round == 1 {
            eprintln!(
                "{}",
                log.lines()
                    .filter(|l| l.contains("hand-over") || l.contains("closed"))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
        client.wait_for(5);
        let newlog = new.log();
        assert!(
            !newlog.contains("TLS established"),
            "round {round}: a new handshake:\n{newlog}"
        );
        // Counted where the admin port now is: the successor's.
        let (code, metrics) = http_get(admin, "/metrics");
        assert_eq!(code, 200);
        assert!(
            metrics.contains("nbdgw_session_handovers_total{outcome=\"resumed\"} 1"),
            "{metrics}"
        );
        old = new;
    }
    let rounds = client.finish();
    assert!(rounds >= 30, "{rounds}");
    let (status, log) = old.stop();
    assert!(status.success(), "{log}");
}

/// A raw client (rustls, real TLS) in `version` and `mode`, through a
/// hand-over with a request header half sent when it happens (and, in
/// TLS 1.3, a KeyUpdate of its own sent with it); then a second one.
/// Every write is read back right; the request cut by the hand-over is
/// served by the successor.
fn half_sent_request_rides_through(
    version: &'static rustls::SupportedProtocolVersion,
    mode: ReplyMode,
    check: &dyn Fn(&str, &str),
) {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 7);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut old = generation(&env, &upstream.socket, port, &handover, false, &[]);
    let certs = env.certs();
    let config = client_tls(
        &certs.join("ca-cert.pem"),
        Some((
            &certs.join("client-cert.pem"),
            &certs.join("client-key.pem"),
        )),
        &[version],
    );
    let mut c = RawClient::handshake(addr);
    c.try_starttls(config).expect("TLS handshake");
    c.go(mode);
    let block = |n: u8| vec![n; 65536];
    c.write(1, 0, &block(1));
    assert_eq!(c.read_reply(0).last().unwrap().error_code(), 0);
    assert_eq!(c.read(2, 0, 65536), block(1));
    for round in 1..=2u8 {
        let request = {
            let mut r = c.request_bytes(
                write_flags(mode),
                CMD_WRITE,
                10 + u64::from(round),
                65536,
                65536,
            );
            r.extend_from_slice(&block(round + 1));
            r
        };
        // Half the header now: the hand-over comes in the middle of it.
        c.send(&request[..10]);
        if version == &rustls::version::TLS13 {
            key_update(&mut c);
        }
        let new = generation(&env, &upstream.socket, port, &handover, true, &[]);
        let status = old
            .wait_exit(Duration::from_secs(60))
            .expect("the old gateway exits");
        let log = old.log();
        assert!(status.success(), "{log}");
        assert!(
            log.contains("hand-over: the successor serves the session"),
            "{log}"
        );
        new.wait_for_log("hand-over: serving a session handed over", 1);
        check(&log, &new.log());
        c.send(&request[10..]);
        // A failure says what both gateways logged.
        let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let reply = c.read_reply(0);
            assert_eq!(reply.last().unwrap().error_code(), 0, "round {round}");
            assert_eq!(
                c.read(20 + u64::from(round), 65536, 65536),
                block(round + 1),
                "round {round}"
            );
            assert_eq!(
                c.read(30 + u64::from(round), 0, 65536),
                block(1),
                "round {round}"
            );
        }));
        if let Err(panic) = served {
            eprintln!(
                "round {round}: old gateway:\n{log}\nnew gateway:\n{}",
                new.log()
            );
            std::panic::resume_unwind(panic);
        }
        assert!(!new.log().contains("TLS established"), "{}", new.log());
        old = new;
    }
    c.disconnect();
    let (status, log) = old.stop();
    assert!(status.success(), "{log}");
}

fn write_flags(mode: ReplyMode) -> u16 {
    match mode {
        ReplyMode::Extended => CMD_FLAG_PAYLOAD_LEN,
        _ => 0,
    }
}

/// The client's own KeyUpdate (TLS 1.3), sent at once.
fn key_update(c: &mut RawClient) {
    let Stream::Tls(s) = &mut c.stream else {
        panic!("TLS is not up")
    };
    s.conn.refresh_traffic_keys().expect("a KeyUpdate");
    s.flush().unwrap();
}

#[test]
fn tls13_extended_headers_a_half_sent_request_and_a_key_update_ride_through() {
    half_sent_request_rides_through(&rustls::version::TLS13, ReplyMode::Extended, &|_, _| {});
}

#[test]
fn tls12_structured_replies_a_half_sent_request_rides_through() {
    half_sent_request_rides_through(&rustls::version::TLS12, ReplyMode::Structured, &|_, _| {});
}

// Kernel TLS (issue 29 item 5). This machine's kernel has no `tls` ULP;
// the test VM's kernels do (`scripts/ktls-vm.sh handover_sessions`), and
// only the new one re-keys (`KTLS_VM_KERNEL=new`), which nbdgw's probe
// requires before any session goes to the kernel. Elsewhere these tests
// say why they are skipped and pass.

/// True where sessions go to the kernel here; otherwise says why not.
fn kernel_tls_here(test: &str) -> bool {
    match nbdgw::tls::kernel::probe() {
        Ok(_) => true,
        Err(why) => {
            eprintln!(
                "{test}: SKIPPED: no kernel TLS with key updates here ({why}); run \
                 `KTLS_VM_KERNEL=new scripts/ktls-vm.sh handover_sessions`"
            );
            false
        }
    }
}

/// The session went to the kernel in the first gateway, each successor
/// served it in the kernel too, and none made a TLS handshake.
fn served_in_the_kernel(old: &str, new: &str) {
    let line = new
        .lines()
        .find(|l| l.contains("hand-over: serving a session handed over"))
        .expect(new);
    assert!(line.contains("kernel"), "not served in the kernel: {line}");
    assert!(
        old.contains("TLS handed to the kernel (kTLS)") || old.contains("kernel"),
        "{old}"
    );
    assert!(!new.contains("TLS established"), "a new handshake:\n{new}");
}

/// libnbd (GnuTLS, TLS 1.3) on ONE connection in the kernel's record
/// layer through three replacements, with a key limit so low that every
/// generation updates its own sending key many times: a successor that
/// carried a wrong traffic secret, or a wrong count, would send records
/// the client cannot open, and the client would fail.
#[test]
fn ktls_one_connection_with_key_updates_rides_through_replacements() {
    if !kernel_tls_here("ktls_one_connection_with_key_updates_rides_through_replacements") {
        return;
    }
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 31);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let limit = ["--ktls-key-limit", "200"];
    let mut old = generation(&env, &upstream.socket, port, &handover, false, &limit);
    let mut client = OneSession::start(port, &env);
    client.wait_for(3);
    assert!(
        old.log().contains("TLS handed to the kernel (kTLS)"),
        "{}",
        old.log()
    );
    for round in 1..=3 {
        let new = generation(&env, &upstream.socket, port, &handover, true, &limit);
        new.wait_for_log("hand-over: serving a session handed over", 1);
        let status = old
            .wait_exit(Duration::from_secs(120))
            .expect("the old gateway exits");
        let log = old.log();
        assert!(status.success(), "round {round}: {status}:\n{log}");
        assert!(
            log.contains("hand-over: the successor serves the session"),
            "{log}"
        );
        client.wait_for(3);
        served_in_the_kernel(&log, &new.log());
        old = new;
    }
    let rounds = client.finish();
    assert!(rounds >= 12, "{rounds}");
    let (status, log) = old.stop();
    assert!(status.success(), "{log}");
    // The last gateway logs the session's key updates, counted from the
    // first gateway on: nbdgw's own, many per generation.
    let updates = log
        .lines()
        .find(|l| l.contains("kernel TLS session ends after key updates"))
        .expect(&log);
    eprintln!("{updates}");
    assert!(!updates.contains("tx_key_updates=0"), "{updates}");
}

/// A raw rustls client in TLS 1.3 in the kernel's record layer, through
/// two hand-overs, each with a request header half sent and the client's
/// own KeyUpdate (update_requested) right behind it: whichever process
/// holds the session when the kernel gives the KeyUpdate out follows it
/// and answers with its own, and every byte reads back right.
#[test]
fn ktls_tls13_a_half_sent_request_and_a_client_key_update_ride_through() {
    if !kernel_tls_here("ktls_tls13_a_half_sent_request_and_a_client_key_update_ride_through") {
        return;
    }
    half_sent_request_rides_through(
        &rustls::version::TLS13,
        ReplyMode::Extended,
        &served_in_the_kernel,
    );
}

/// TLS 1.2 never goes to the kernel (nbdgw's kernel TLS is TLS 1.3
/// only), but under `--ktls auto` it is read record by record: such a
/// session is handed over too, in rustls.
#[test]
fn ktls_on_a_tls12_session_stays_in_rustls_and_rides_through() {
    if !kernel_tls_here("ktls_on_a_tls12_session_stays_in_rustls_and_rides_through") {
        return;
    }
    half_sent_request_rides_through(
        &rustls::version::TLS12,
        ReplyMode::Structured,
        &|old, new| {
            assert!(!old.contains("handed to the kernel"), "{old}");
            let line = new
                .lines()
                .find(|l| l.contains("hand-over: serving a session handed over"))
                .expect(new);
            assert!(line.contains("Tls12"), "{line}");
        },
    );
}

/// A raw client in transmission on `old`, its first block written and
/// read back.
fn raw_session(env: &Env, port: u16) -> RawClient {
    raw_session_with(env, port, &[])
}

/// `raw_session` limited to `versions` (empty: rustls's defaults).
fn raw_session_with(
    env: &Env,
    port: u16,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> RawClient {
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let certs = env.certs();
    let config = client_tls(
        &certs.join("ca-cert.pem"),
        Some((
            &certs.join("client-cert.pem"),
            &certs.join("client-key.pem"),
        )),
        versions,
    );
    let mut c = RawClient::handshake(addr);
    c.try_starttls(config).expect("TLS handshake");
    c.go(ReplyMode::Structured);
    c.write(1, 0, &[5; 4096]);
    assert_eq!(c.read_reply(0).last().unwrap().error_code(), 0);
    assert_eq!(c.read(2, 0, 4096), vec![5; 4096]);
    c
}

/// A successor whose configuration would not admit the session as it is
/// (`extra`: its flags) declines it: the session is never moved with
/// more than the successor grants; it stays with the old gateway, which
/// drains it as at SIGTERM: nothing was in flight, so it closes, and the
/// successor admits the client's next connection only as it allows.
fn narrower_successor_declines(extra: &[&str], class: &str) {
    narrower_successor_declines_with(extra, class, &[]);
}

/// `narrower_successor_declines` with the client limited to `versions`.
fn narrower_successor_declines_with(
    extra: &[&str],
    class: &str,
    versions: &[&'static rustls::SupportedProtocolVersion],
) {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 3);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let mut old = generation(&env, &upstream.socket, port, &handover, false, &[]);
    let mut c = raw_session_with(&env, port, versions);
    let new = generation(&env, &upstream.socket, port, &handover, true, extra);
    let status = old
        .wait_exit(Duration::from_secs(60))
        .expect("the old gateway exits");
    let log = old.log();
    assert!(status.success(), "{log}");
    assert!(log.contains("the successor declined the session"), "{log}");
    assert!(
        log.contains(&format!("reason=\"{class}:")) || log.contains(&format!("reason={class}:")),
        "{log}"
    );
    assert!(!log.contains("the successor serves the session"), "{log}");
    assert!(new.log().contains("declining a session"), "{}", new.log());
    assert!(
        !new.log().contains("serving a session handed over"),
        "{}",
        new.log()
    );
    c.expect_closed();
    let (status, log) = new.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn a_successor_whose_allow_list_refuses_the_client_declines_its_session() {
    narrower_successor_declines(&["--allow-cn", "someone-else"], "certificate");
}

#[test]
fn a_successor_whose_policy_grants_less_declines_the_session() {
    let env_dir = tempfile_policy();
    let policy = env_dir.join("policy.toml");
    narrower_successor_declines(&["--policy", policy.to_str().unwrap()], "policy");
    std::fs::remove_dir_all(env_dir).unwrap();
}

/// A TLS 1.2 session to a successor that admits only TLS 1.3: declined,
/// never served there with less than its configuration asks.
#[test]
fn a_successor_with_a_higher_tls_min_version_declines_a_tls12_session() {
    narrower_successor_declines_with(
        &["--tls-min-version", "1.3"],
        "tls",
        &[&rustls::version::TLS12],
    );
}

/// A session that negotiated X25519 (the test client offers no hybrid)
/// to a successor accepting only P-256: declined.
#[test]
fn a_successor_that_no_longer_accepts_the_sessions_key_exchange_group_declines_it() {
    narrower_successor_declines(&["--tls-groups", "secp256r1"], "tls");
}

/// A successor with a lower --max-payload than the old gateway's (the
/// default 32 MiB): declined, so a write the client may still send is
/// never cut in the middle of the session.
#[test]
fn a_successor_with_a_lower_max_payload_declines_the_session() {
    narrower_successor_declines(&["--max-payload", "1048576"], "limits");
}

/// Two sessions of one client to a successor allowing it one session
/// (--max-sessions-per-identity 1): the slot is reserved when the first
/// offer is accepted, so the second is declined (class limits) and
/// drains in the old gateway, never taken and then closed; the first
/// rides through.
#[test]
fn a_session_over_the_successors_session_limits_is_declined_not_closed_after_it_moved() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 4);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let mut old = generation(&env, &upstream.socket, port, &handover, false, &[]);
    let a = raw_session(&env, port);
    let b = raw_session(&env, port);
    let limit = ["--max-sessions-per-identity", "1"];
    let new = generation(&env, &upstream.socket, port, &handover, true, &limit);
    let status = old
        .wait_exit(Duration::from_secs(60))
        .expect("the old gateway exits");
    let log = old.log();
    assert!(status.success(), "{log}");
    assert_eq!(
        log.matches("the successor serves the session").count(),
        1,
        "{log}"
    );
    assert!(log.contains("the successor declined the session"), "{log}");
    assert!(log.contains("limits:"), "{log}");
    assert!(!log.contains("could not serve"), "{log}");
    // Which of the two moved is the order of the offers (a is conn 1):
    // the declined one was drained (closed, nothing in flight), the other
    // still answers, from the successor.
    let declined = log
        .lines()
        .find(|l| l.contains("the successor declined the session"))
        .unwrap();
    let (mut moved, mut drained) = if declined.contains("conn=1 ") {
        (b, a)
    } else {
        (a, b)
    };
    drained.expect_closed();
    assert_eq!(moved.read(4, 0, 4096), vec![5; 4096]);
    moved.disconnect();
    let (status, log) = new.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("serving a session handed over"), "{log}");
}

/// A policy that grants the test client read-only access to every export.
fn tempfile_policy() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nbdgw-i29-policy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rule =
        "[[rule]]\nexports = [\"*\"]\nallow = { cn = [\"test-client\"] }\naccess = \"read-only\"\n";
    std::fs::write(dir.join("policy.toml"), rule).unwrap();
    dir
}

/// A successor killed once a session's State has reached it: the session
/// is closed (its sockets are gone with both processes' copies), and the
/// old gateway never serves it again: after the State left, it has no
/// keys for it (the commit rule, docs/design/handover.md).
#[test]
fn a_successor_killed_after_the_state_closes_the_session_and_the_old_gateway_does_not_resume_it() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 4);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let mut old = generation(&env, &upstream.socket, port, &handover, false, &[]);
    let mut c = raw_session(&env, port);
    successor_killed_holding_the_state(&env, &upstream.socket, port, &handover);
    let status = old
        .wait_exit(Duration::from_secs(60))
        .expect("the old gateway exits");
    let log = old.log();
    assert!(status.success(), "{log}");
    // Its audit line says the hand-over failed, not that it moved.
    assert!(!log.contains("handed over to the successor"), "{log}");
    assert!(log.contains("hand-over failed"), "{log}");
    assert!(log.contains("the session hand-over ended early"), "{log}");
    assert!(!log.contains("the successor serves the session"), "{log}");
    // Nobody holds the session any more: the client's next request finds
    // the connection closed, never an answer from the old keys.
    c.send(&c.request_bytes(0, CMD_READ, 3, 0, 4096));
    c.expect_closed();
}

/// A session that cannot go quiet in time (a write's payload half sent:
/// no request boundary comes) is withdrawn at --handover-quiesce-timeout:
/// it stays with the old gateway, which serves the write once the rest
/// arrives, then drains it as at SIGTERM.
#[test]
fn a_session_not_quiet_in_time_is_withdrawn_and_its_request_served_by_the_old_gateway() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 5);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let quiesce = ["--handover-quiesce-timeout", "0.5"];
    let mut old = generation(&env, &upstream.socket, port, &handover, false, &quiesce);
    let mut c = raw_session(&env, port);
    let mut request = c.request_bytes(0, CMD_WRITE, 7, 8192, 65536);
    request.extend_from_slice(&[9; 65536]);
    c.send(&request[..1000]);
    let new = generation(&env, &upstream.socket, port, &handover, true, &[]);
    old.wait_for_log("not quiet in time", 1);
    c.send(&request[1000..]);
    assert_eq!(c.read_reply(0).last().unwrap().error_code(), 0);
    let status = old
        .wait_exit(Duration::from_secs(60))
        .expect("the old gateway exits");
    let log = old.log();
    assert!(status.success(), "{log}");
    assert!(!log.contains("the successor serves the session"), "{log}");
    c.expect_closed();
    let mut check = raw_session(&env, port);
    assert_eq!(check.read(8, 8192, 65536), vec![9; 65536]);
    check.disconnect();
    let (status, log) = new.stop();
    assert!(status.success(), "{log}");
}

/// A session that finishes negotiating after the old gateway listed its
/// sessions (its TLS up before, its OPT_GO sent once the offers began):
/// offered in a further round and handed over, not drained just after
/// its connect succeeded. A second session, a write's payload half sent,
/// keeps the first round open (withdrawn at the quiesce timeout).
#[test]
fn a_session_negotiated_while_the_sessions_are_offered_is_offered_in_a_further_round() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 6);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let quiesce = ["--handover-quiesce-timeout", "3"];
    let mut old = generation(&env, &upstream.socket, port, &handover, false, &quiesce);
    let mut slow = raw_session(&env, port);
    let mut request = slow.request_bytes(0, CMD_WRITE, 7, 8192, 65536);
    request.extend_from_slice(&[9; 65536]);
    slow.send(&request[..1000]);
    let certs = env.certs();
    let config = client_tls(
        &certs.join("ca-cert.pem"),
        Some((
            &certs.join("client-cert.pem"),
            &certs.join("client-key.pem"),
        )),
        &[],
    );
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut late = RawClient::handshake(addr);
    late.try_starttls(config).expect("TLS handshake");
    let new = generation(&env, &upstream.socket, port, &handover, true, &[]);
    old.wait_for_log("offering the sessions", 1);
    late.go(ReplyMode::Structured);
    late.write(1, 0, &[6; 4096]);
    assert_eq!(late.read_reply(0).last().unwrap().error_code(), 0);
    old.wait_for_log("not quiet in time", 1);
    slow.send(&request[1000..]);
    assert_eq!(slow.read_reply(0).last().unwrap().error_code(), 0);
    let status = old
        .wait_exit(Duration::from_secs(60))
        .expect("the old gateway exits");
    let log = old.log();
    assert!(status.success(), "{log}");
    assert!(log.contains("the successor serves the session"), "{log}");
    assert_eq!(late.read(2, 0, 4096), vec![6; 4096], "{log}");
    assert_eq!(late.read(3, 8192, 65536), vec![9; 65536]);
    late.disconnect();
    slow.expect_closed();
    let (status, log) = new.stop();
    assert!(status.success(), "{log}");
}

/// A gateway still taking sessions from its own old gateway is not taken
/// over until it has them all: a third generation started meanwhile
/// waits. Before, it took the middle one over at once, and a session
/// going quiet late in the first (its write's payload half sent) had its
/// state refused there ("this gateway is stopping") and was closed.
/// Here the late session is withdrawn at the quiesce timeout and its
/// write answered by the first gateway.
#[test]
fn a_gateway_still_taking_sessions_is_not_taken_over_until_it_has_them() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 8);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let quiesce = ["--handover-quiesce-timeout", "4"];
    let mut a = generation(&env, &upstream.socket, port, &handover, false, &quiesce);
    let mut slow = raw_session(&env, port);
    let mut request = slow.request_bytes(0, CMD_WRITE, 7, 8192, 65536);
    request.extend_from_slice(&[9; 65536]);
    slow.send(&request[..1000]);
    let mut b = generation(&env, &upstream.socket, port, &handover, true, &[]);
    let c = spawn_generation(&env, &upstream.socket, port, (&handover, true), &[]);
    // Whichever comes first: the third serving (it took the middle one
    // over) or the first withdrawing the late session.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while c.count_in_log("nbdgw listening") == 0 && a.count_in_log("not quiet in time") == 0 {
        assert!(std::time::Instant::now() < deadline, "{}", c.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    slow.send(&request[1000..]);
    let reply = slow.read_reply(0);
    assert_eq!(reply.last().unwrap().error_code(), 0);
    let status = a
        .wait_exit(Duration::from_secs(60))
        .expect("the first gateway exits");
    let log = a.log();
    assert!(status.success(), "{log}");
    assert!(!log.contains("could not serve the session"), "{log}");
    c.wait_for_log("nbdgw listening", 1);
    let status = b
        .wait_exit(Duration::from_secs(60))
        .expect("the middle gateway exits");
    assert!(status.success(), "{}", b.log());
    let mut check = raw_session(&env, port);
    assert_eq!(check.read(8, 8192, 65536), vec![9; 65536]);
    check.disconnect();
    let (status, log) = c.stop();
    assert!(status.success(), "{log}");
}

/// The pause recorded for a session runs from when its request side
/// stopped to the successor's Taken: a session that finished a write
/// first (its payload held 4 s after the hand-over began) was served
/// meanwhile, and its pause does not include those seconds. Before, it
/// was counted from when it was asked (pause_ms over 4000). The bound
/// asserted is generous (3 s): it separates the two, it times nothing.
#[test]
fn the_pause_recorded_runs_from_the_sessions_own_stop() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 9);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let quiesce = ["--handover-quiesce-timeout", "30"];
    let mut old = generation(&env, &upstream.socket, port, &handover, false, &quiesce);
    let mut c = raw_session(&env, port);
    let mut request = c.request_bytes(0, CMD_WRITE, 7, 8192, 65536);
    request.extend_from_slice(&[9; 65536]);
    c.send(&request[..1000]);
    let new = generation(&env, &upstream.socket, port, &handover, true, &[]);
    old.wait_for_log("offering the sessions", 1);
    std::thread::sleep(Duration::from_secs(4)); // the hold being measured, not a synchronization
    c.send(&request[1000..]);
    assert_eq!(c.read_reply(0).last().unwrap().error_code(), 0);
    let status = old
        .wait_exit(Duration::from_secs(60))
        .expect("the old gateway exits");
    let log = old.log();
    assert!(status.success(), "{log}");
    let pause: u64 = log
        .lines()
        .find(|l| l.contains("the successor serves the session"))
        .and_then(|l| l.split("pause_ms=").nth(1))
        .and_then(|v| v.split_whitespace().next())
        .expect("a pause_ms")
        .parse()
        .unwrap();
    assert!(pause < 3000, "pause_ms={pause}: {log}");
    assert_eq!(c.read(8, 8192, 65536), vec![9; 65536]);
    c.disconnect();
    let (status, log) = new.stop();
    assert!(status.success(), "{log}");
}

/// A session that ends while the hand-over waits for it to go quiet (its
/// client closes in the middle of a write's payload) is reported ended at
/// once, not "not quiet in time" after the whole quiesce timeout.
#[test]
fn a_session_ending_during_the_quiesce_is_reported_ended_at_once() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 10);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let quiesce = ["--handover-quiesce-timeout", "30"];
    let mut old = generation(&env, &upstream.socket, port, &handover, false, &quiesce);
    let mut c = raw_session(&env, port);
    let mut request = c.request_bytes(0, CMD_WRITE, 7, 8192, 65536);
    request.extend_from_slice(&[9; 65536]);
    c.send(&request[..1000]);
    let new = generation(&env, &upstream.socket, port, &handover, true, &[]);
    old.wait_for_log("offering the sessions", 1);
    drop(c);
    let status = old.wait_exit(Duration::from_secs(20)).unwrap_or_else(|| {
        panic!(
            "the old gateway did not exit well within the quiesce timeout:\n{}",
            old.log()
        )
    });
    let log = old.log();
    assert!(status.success(), "{log}");
    assert!(
        log.contains("the session ended before it was quiet"),
        "{log}"
    );
    assert!(!log.contains("not quiet in time"), "{log}");
    let (status, log) = new.stop();
    assert!(status.success(), "{log}");
}

/// A successor killed while a session is still going quiet (its write's
/// payload half sent): the old gateway sees the hang-up and tells the
/// session nobody waits, so it is served and drained there, not closed
/// for a State that could not be sent.
#[test]
fn a_successor_dying_before_a_late_session_is_taken_leaves_it_to_drain() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 11);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let quiesce = ["--handover-quiesce-timeout", "30"];
    let mut old = generation(&env, &upstream.socket, port, &handover, false, &quiesce);
    let mut c = raw_session(&env, port);
    let mut request = c.request_bytes(0, CMD_WRITE, 7, 8192, 65536);
    request.extend_from_slice(&[9; 65536]);
    c.send(&request[..1000]);
    let new = generation(&env, &upstream.socket, port, &handover, true, &[]);
    old.wait_for_log("offering the sessions", 1);
    new.signal("KILL");
    // Seen while the session goes quiet ("hung up"), or, on a slow
    // machine where the kill comes before the successor's Accept, as the
    // exchange failing: either way nothing was taken and the session
    // stays here.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while old.count_in_log("the successor hung up") == 0
        && old.count_in_log("the session hand-over ended early") == 0
    {
        assert!(std::time::Instant::now() < deadline, "{}", old.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    c.send(&request[1000..]);
    assert_eq!(c.read_reply(0).last().unwrap().error_code(), 0);
    let status = old
        .wait_exit(Duration::from_secs(60))
        .expect("the old gateway exits");
    let log = old.log();
    assert!(status.success(), "{log}");
    assert!(!log.contains("could not be sent"), "{log}");
    assert!(!log.contains("hand-over failed"), "{log}");
    c.expect_closed();
}

/// python3-libnbd: `n` idle connections, then (told on stdin) one read
/// on each; prints how many failed.
const MANY_IDLE: &str = r#"
import nbd, sys
port, certs, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
hs = []
for _ in range(n):
    h = nbd.NBD(); h.set_tls(nbd.TLS_REQUIRE); h.set_tls_certificates(certs)
    h.connect_uri(f"nbds://localhost:{port}/"); hs.append(h)
print("connected", flush=True)
sys.stdin.readline()
failed = 0
for k, h in enumerate(hs):
    try:
        h.pread(4096, k * 4096)
        h.shutdown()
    except nbd.Error:
        failed += 1
print("failed", failed, flush=True)
"#;

/// Enough sessions that their small frames, unread, would fill the
/// channel's socket buffer (with 1,064 they did; a few hundred are past it): all are handed over in one
/// replacement, and each answers afterwards.
#[test]
fn six_hundred_idle_sessions_are_handed_over_in_one_replacement() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 6);
    let upstream = QemuNbd::start(&env, &image, &["--shared=700"]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let limits = [
        "--max-connections",
        "1000",
        "--max-sessions-per-identity",
        "1000",
    ];
    let mut old = generation(&env, &upstream.socket, port, &handover, false, &limits);
    let mut client = Command::new("/usr/bin/python3")
        .args(["-c", MANY_IDLE, &port.to_string()])
        .arg(env.certs())
        .arg("600")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3-libnbd");
    let mut out = BufReader::new(client.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "connected");
    let new = generation(&env, &upstream.socket, port, &handover, true, &limits);
    let status = old
        .wait_exit(Duration::from_secs(120))
        .expect("the old gateway exits");
    let log = old.log();
    assert!(status.success(), "{log}");
    assert_eq!(
        log.matches("the successor serves the session").count(),
        600,
        "{log}"
    );
    writeln!(client.stdin.as_mut().unwrap()).unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "failed 0");
    assert!(client.wait().unwrap().success());
    let (status, log) = new.stop();
    assert!(status.success(), "{log}");
}

/// Review round 2, R2: a TLS 1.3 session whose client ran its keys on
/// past `--handover-max-key-generations` (here 3; 5 KeyUpdates, each
/// followed by a request) is not handed over: it is closed with a log
/// line that says why, while the other session of the same hand-over
/// rides through.
#[test]
fn a_session_past_the_key_generation_bound_is_closed_and_the_other_is_handed_over() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 5);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    // rustls only: the bound is on the key walk that rebuilds a rustls
    // session's keys from its handshake's secrets. A kernel TLS session
    // carries its current secrets (the kernel holds the keys), so it
    // walks nothing and is handed over whatever its generation; where the
    // kernel would take these sessions (the test VM), --ktls off keeps
    // them in rustls.
    let bound = ["--handover-max-key-generations", "3", "--ktls", "off"];
    let mut old = generation(&env, &upstream.socket, port, &handover, false, &bound);
    let mut hostile = raw_session(&env, port);
    for handle in 0..5u64 {
        key_update(&mut hostile);
        assert_eq!(hostile.read(10 + handle, 0, 4096), vec![5; 4096]);
    }
    let mut honest = raw_session(&env, port);
    let new = generation(&env, &upstream.socket, port, &handover, true, &[]);
    let status = old
        .wait_exit(Duration::from_secs(60))
        .expect("the old gateway exits");
    let log = old.log();
    assert!(status.success(), "{log}");
    assert!(
        log.contains("not within 3 key generations of its handshake"),
        "{log}"
    );
    assert_eq!(
        log.matches("hand-over: the successor serves the session")
            .count(),
        1,
        "{log}"
    );
    assert_eq!(honest.read(20, 0, 4096), vec![5; 4096]);
    hostile.send(&hostile.request_bytes(0, CMD_READ, 21, 0, 4096));
    hostile.expect_closed();
    honest.disconnect();
    let (status, log) = new.stop();
    assert!(status.success(), "{log}");
}
