//! Crowds, as a gateway meets them: every VM of one host reconnecting at
//! the same instant (libnbd clients behind one barrier, one attempt
//! each), while another source floods the gateway with silent
//! connections and crawling handshakes; and a descriptor limit too low
//! for the bounds, found at start rather than at accept under load.

mod common;

use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::metrics::metric;
use common::peers::{connect_from, slow_client_hello};
use common::process::{front_args, NbdgwProcess};
use common::{free_port, Env, QemuNbd};

/// What tests/herd.py saw.
struct Herd {
    ok: usize,
    errors: Vec<String>,
    /// Each client's time from the barrier to negotiated, sorted.
    connect_secs: Vec<f64>,
}

fn herd(port: u16, certs: &std::path::Path, image: &std::path::Path, n: usize) -> Herd {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/herd.py");
    let out = common::run(
        Command::new("/usr/bin/python3")
            .arg(script)
            .arg(port.to_string())
            .arg(certs)
            .arg(image)
            .arg(n.to_string()),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "herd.py: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_str(&text).expect("herd.py's JSON");
    Herd {
        ok: json["ok"].as_u64().unwrap_or(0) as usize,
        errors: json["errors"]
            .as_array()
            .map(|a| a.iter().map(|e| e.to_string()).collect())
            .unwrap_or_default(),
        connect_secs: json["connect_secs"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_f64()).collect())
            .unwrap_or_default(),
    }
}

/// Default flags. 64 then 256 clients from 127.0.0.1, all at once, while
/// 127.0.0.2 holds 300 silent connections and 127.0.0.3 crawls through
/// four ClientHellos: every client connects (no retries) and reads its
/// block. Before waiting replaced refusal, 8 of them got in and the rest
/// saw "server disconnected unexpectedly".
#[test]
fn a_hosts_vms_connecting_at_once_are_all_served_beside_a_flood() {
    let env = Env::new();
    let image = env.random_image("disk.img", 4 << 20, 20);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let certs = env.certs();
    let admin = free_port();
    let admin_addr = format!("127.0.0.1:{admin}");
    let gw = NbdgwProcess::in_front_of(&env, &upstream.socket, &["--admin-listen", &admin_addr]);
    let baseline = gw.open_fds();
    // The herd alone first, to compare with the herd beside the flood.
    let alone = herd(gw.port, &certs, &image, 64);
    assert!(alone.errors.is_empty(), "{:?}", alone.errors);
    let alone_last = alone.connect_secs.last().copied().unwrap_or_default();

    let silent: Vec<TcpStream> = (0..300)
        .filter_map(|_| connect_from([127, 0, 0, 2].into(), gw.addr()).ok())
        .collect();
    assert_eq!(silent.len(), 300);
    let slow: Vec<_> = (0..4)
        .map(|_| slow_client_hello([127, 0, 0, 3].into(), gw.addr()))
        .collect();
    std::thread::sleep(Duration::from_millis(300));

    for n in [64, 256] {
        let h = herd(gw.port, &certs, &image, n);
        assert!(h.errors.is_empty(), "{n} clients: {:?}", h.errors);
        assert_eq!(h.ok, n);
        let last = h.connect_secs.last().copied().unwrap_or_default();
        let median = h.connect_secs[h.connect_secs.len() / 2];
        // For the record (the closing note quotes it), and a bound far
        // above it: a refusal would have failed the client above.
        eprintln!("herd of {n}: median {median:.3} s, last {last:.3} s to connect (64 alone: last {alone_last:.3} s)");
        assert!(last < 10.0, "the last of {n} took {last:.1} s");
        // The flood holds its own source's slots, not the herd's: 64
        // beside it take about as long as 64 alone (2 s of slack for a
        // shared machine; a refused client fails above).
        if n == 64 {
            assert!(
                last < alone_last + 2.0,
                "{last:.2} s beside the flood, {alone_last:.2} s alone"
            );
        }
    }
    // The flood from 127.0.0.2 kept to its own line: 8 slots, 256
    // waiting, the rest closed at accept and counted.
    assert_eq!(
        metric(
            admin,
            "nbdgw_handshakes_refused_total{reason=\"source_queue_full\"}"
        ),
        36.0
    );
    assert!(metric(admin, "nbdgw_handshake_waits_total") >= 256.0);
    // Each waiter that got its slot is in the histogram.
    assert!(metric(admin, "nbdgw_handshake_wait_seconds_count") >= 200.0);
    gw.wait_for_log(
        "--handshake-queue-per-source (256) reached for 127.0.0.2/32",
        1,
    );

    drop(silent);
    for t in slow {
        t.join().expect("the slow handshaker");
    }
    // Every descriptor back once the flood is gone.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while gw.open_fds() > baseline && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        gw.open_fds() <= baseline,
        "{} descriptors, {baseline} at start",
        gw.open_fds()
    );
    assert_eq!(metric(admin, "nbdgw_handshakes_waiting"), 0.0);
    assert_eq!(metric(admin, "nbdgw_handshakes_in_progress"), 0.0);
}

/// RLIMIT_NOFILE 1024 (a common default hard limit in containers) cannot
/// hold the default bounds: they are lowered in proportion, with a
/// warning that names each, and the gateway serves. One too low for a
/// single connection stops start-up, saying so.
#[test]
fn bounds_beyond_the_descriptor_limit_are_lowered_or_refused_at_start() {
    let env = Env::new();
    let image = env.random_image("disk.img", 1 << 20, 21);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let certs = env.certs();
    let port = free_port();
    let args = front_args(&certs, &upstream.socket, &[]);
    let gw = NbdgwProcess::start_at_with_nofile(1024, args, port);
    let log = gw.log();
    assert!(
        log.contains("lowered them in proportion to fit (was --max-connections 1024, --max-handshakes 64, --handshake-queue 1024, --admin-max-connections 0)"),
        "{log}"
    );
    // 960 descriptors beyond the spare of 64, for 4288 asked (3 per
    // session and handshake, 1 per waiting place): 229, 14 and 229.
    assert!(
        log.contains("max_connections=229")
            && log.contains("max_handshakes=14")
            && log.contains("handshake_queue=229"),
        "{log}"
    );
    let out = common::run(
        Command::new("nbdinfo")
            .arg("--size")
            .arg(common::clients::nbds_uri(port, &certs)),
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1048576");

    let out = common::run(
        Command::new("prlimit")
            .arg("--nofile=40:40")
            .arg(common::process::nbdgw_binary())
            .arg("--tls-dir")
            .arg(&certs)
            .arg("--upstream")
            .arg(&upstream.socket)
            .arg("--listen")
            .arg("127.0.0.1:0"),
    );
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        said.contains(
            "the file descriptor limit (RLIMIT_NOFILE) is 40: too low for even one connection"
        ),
        "{said}"
    );
}

/// Issue 20's review: an attacker spread over 136 addresses, every one a
/// source of its own. 8 of them hold 8 silent handshakes each (the whole
/// budget, before the reserve), 128 more keep 8 connections each waiting
/// (every place in line). Then a host that has connected before (proven)
/// reconnects 48 VMs at once. Before the proven class and the reserve,
/// none of the 48 got in: they were the busiest source, shed at once, or
/// waited out their 10 s behind the attacker's turns.
#[test]
fn a_proven_host_reconnecting_beside_a_spread_flood_is_served() {
    let env = Env::new();
    let image = env.random_image("disk.img", 4 << 20, 22);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let certs = env.certs();
    // NBDGW_CROWDS_EXTRA="--source-memory 0 --handshake-reserve 0" turns
    // both defences off: then none of the 48 gets in (checked).
    let extra: Vec<String> = std::env::var("NBDGW_CROWDS_EXTRA")
        .map(|v| v.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let gw = NbdgwProcess::in_front_of(&env, &upstream.socket, &extra);
    // The host has connected before: its source is proven.
    let once = herd(gw.port, &certs, &image, 1);
    assert_eq!(once.ok, 1, "{:?}", once.errors);

    let attacker =
        |i: u32| std::net::IpAddr::from([127, 0, 1 + (i / 250) as u8, 1 + (i % 250) as u8]);
    let mut flood: Vec<TcpStream> = Vec::new();
    for i in 0..136u32 {
        for _ in 0..8 {
            flood.push(connect_from(attacker(i), gw.addr()).expect("an attacker's connect"));
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let h = herd(gw.port, &certs, &image, 48);
    assert!(
        h.errors.is_empty(),
        "{} of 48: {:?}",
        h.errors.len(),
        h.errors
    );
    let last = h.connect_secs.last().copied().unwrap_or_default();
    eprintln!("48 beside the spread flood: last {last:.3} s");
    assert!(last < 5.0, "the last of 48 took {last:.1} s");
    drop(flood);
}

/// Whether nbdgw closes `stream` by `deadline`: reads (its greeting, if
/// it got a handshake slot) until the end of the stream or the deadline.
fn closed_by(stream: &mut TcpStream, deadline: Instant) -> bool {
    use std::io::{ErrorKind, Read};
    let mut buf = [0u8; 256];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // A zero timeout is refused: past the deadline, only look.
        let looked = match left.is_zero() {
            true => stream.set_nonblocking(true),
            false => stream.set_read_timeout(Some(left)),
        };
        looked.expect("a socket option");
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false
            }
            // Reset: closed with the greeting unread.
            Err(_) => return true,
        }
    }
}

/// 200 silent connections from one address with `--handshake-timeout 3`:
/// 8 get handshake slots (--max-handshakes-per-source), 192 wait in line.
/// Every one is closed within the bound from its accept, its wait in line
/// included (3 s, plus 3 s of slack for a loaded host). Before, the
/// handshake's time began only when the slot came, so a connection that
/// got one after 9 s in line was open until 12 s.
#[test]
fn silent_connections_are_closed_within_the_handshake_timeout_waiting_included() {
    let env = Env::new();
    let image = env.random_image("disk.img", 1 << 20, 23);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let gw = NbdgwProcess::in_front_of(&env, &upstream.socket, &["--handshake-timeout", "3"]);
    let from = std::net::IpAddr::from([127, 0, 0, 1]);
    let mut silent: Vec<TcpStream> = (0..200)
        .map(|_| connect_from(from, gw.addr()).expect("a silent client's connect"))
        .collect();
    // The bound runs from each accept, the last of which is about now.
    let deadline = Instant::now() + Duration::from_secs(3 + 3);
    let open = silent
        .iter_mut()
        .filter_map(|s| (!closed_by(s, deadline)).then_some(()))
        .count();
    assert_eq!(
        open,
        0,
        "{open} of 200 silent connections still open 6 s after the last connect \
         (--handshake-timeout 3); nbdgw log:\n{}",
        tail(&gw.log(), 40)
    );
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A client whose turn in line comes late still has time for its
/// handshake: half of `--handshake-timeout` at least. A silent connection
/// holds the only handshake slot for the whole `--handshake-timeout 6`;
/// nbdinfo (libnbd), queued just behind it, gets the slot at about 6 s
/// from its accept. When the wait used up the bound, it had a few
/// milliseconds and failed ("handshake timed out"); now it reads the size.
#[test]
fn a_client_granted_its_slot_late_in_line_still_has_time_to_negotiate() {
    let env = Env::new();
    let image = env.random_image("disk.img", 1 << 20, 29);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let gw = NbdgwProcess::in_front_of(
        &env,
        &upstream.socket,
        &["--max-handshakes", "1", "--handshake-timeout", "6"],
    );
    let _silent = TcpStream::connect(gw.addr()).expect("the silent client's connect");
    // It has the slot once it is logged as accepted.
    gw.wait_for_log("accepted", 1);
    let started = Instant::now();
    let out = common::clients::nbdinfo_size(gw.port, &env.certs());
    assert!(
        out.status.success(),
        "nbdinfo after {:?}: {}; nbdgw log:\n{}",
        started.elapsed(),
        common::clients::text(&out),
        tail(&gw.log(), 20)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1048576");
}
