//! Replacing a running nbdgw with `--take-over` (issue 29, first step):
//! the listening sockets move, no client is refused at connect, the old
//! process drains and exits 0; and the refusals: another uid, an unknown
//! state version, a successor that stalls, one that dies in the middle.
//! Real qemu-nbd upstream, python3-libnbd clients over TLS; the fake
//! successors are named so.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use common::clients::{nbdinfo_size, text};
use common::handover::{generation, private_dir};
use common::process::{nbdgw_binary, NbdgwProcess};
use common::{Env, QemuNbd};
use nbdgw::proto::handover::{decode_frame, Message, HEADER_LEN};

const IMAGE_LEN: usize = 1 << 20;

/// python3-libnbd opening connections back to back, each reading and
/// checking 64 KiB, until its stdin closes; prints a line per 10
/// connections and a summary. A failure is classified by where it came:
/// `connect` (connect_uri: refused, reset, TLS or negotiation) or `io`.
const LOOP_CLIENT: &str = r#"
import nbd, sys
port, certs, image = sys.argv[1], sys.argv[2], sys.argv[3]
data = open(image, "rb").read()
import threading
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
ok, connect_errors, io_errors, mismatches, i = 0, [], [], 0, 0
while not stop.is_set():
    i += 1
    off = (i * 65536) % len(data)
    h = nbd.NBD()
    h.set_tls(nbd.TLS_REQUIRE)
    h.set_tls_certificates(certs)
    try:
        h.connect_uri(f"nbds://localhost:{port}/")
    except nbd.Error as e:
        connect_errors.append(str(e))
        continue
    try:
        if h.pread(65536, off) != data[off:off + 65536]:
            mismatches += 1
        ok += 1
        h.shutdown()
    except nbd.Error as e:
        io_errors.append(str(e))
    if (ok + len(connect_errors) + len(io_errors)) % 10 == 0:
        print("progress", ok, flush=True)
print("done", ok, len(connect_errors), len(io_errors), mismatches, flush=True)
for e in connect_errors:
    print("connect_error", e, flush=True)
for e in io_errors:
    print("io_error", e, flush=True)
"#;

struct LoopClient {
    child: Child,
    out: BufReader<ChildStdout>,
    ok: usize,
}

impl LoopClient {
    fn start(port: u16, env: &Env, image: &Path) -> Self {
        let mut child = Command::new("/usr/bin/python3")
            .arg("-c")
            .arg(LOOP_CLIENT)
            .arg(port.to_string())
            .arg(env.certs())
            .arg(image)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3-libnbd");
        let out = BufReader::new(child.stdout.take().unwrap());
        LoopClient { child, out, ok: 0 }
    }

    /// Waits until `more` connections beyond those seen have succeeded.
    fn wait_for(&mut self, more: usize) {
        let want = self.ok + more;
        let mut line = String::new();
        while self.ok < want {
            line.clear();
            assert!(
                self.out.read_line(&mut line).unwrap() > 0,
                "the loop client ended"
            );
            if let Some(n) = line.strip_prefix("progress ") {
                self.ok = n.trim().parse().unwrap();
            }
        }
    }

    /// Stops it: (successes, connect errors, io errors, mismatches) and
    /// each error's text.
    fn finish(mut self) -> ((usize, usize, usize, usize), Vec<String>) {
        drop(self.child.stdin.take());
        let mut rest = String::new();
        self.out.read_to_string(&mut rest).unwrap();
        assert!(self.child.wait().unwrap().success(), "{rest}");
        let done = rest
            .lines()
            .find_map(|l| l.strip_prefix("done "))
            .expect(&rest);
        let n: Vec<usize> = done.split(' ').map(|x| x.parse().unwrap()).collect();
        let errors = rest
            .lines()
            .filter(|l| l.contains("_error "))
            .map(String::from)
            .collect();
        ((n[0], n[1], n[2], n[3]), errors)
    }
}

/// Five replacements in a row under two clients opening connections
/// back to back: the port never refuses, each old process exits 0 after
/// its drain, and every byte read is right.
#[test]
fn replacements_in_a_row_refuse_no_connection() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 29);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let mut old = generation(&env, &upstream.socket, port, &handover, false, &[]);
    let mut clients = [
        LoopClient::start(port, &env, &image),
        LoopClient::start(port, &env, &image),
    ];
    clients.iter_mut().for_each(|c| c.wait_for(20));
    for round in 1..=5 {
        let new = generation(&env, &upstream.socket, port, &handover, true, &[]);
        new.wait_for_log("take-over: serving", 1);
        let status = old
            .wait_exit(Duration::from_secs(60))
            .expect("the old gateway exits");
        let log = old.log();
        assert!(
            status.success(),
            "round {round}: old gateway {status}:\n{log}"
        );
        assert!(
            log.contains("hand-over: the successor serves the listeners"),
            "{log}"
        );
        assert!(log.contains("stopped"), "{log}");
        old = new;
        clients.iter_mut().for_each(|c| c.wait_for(20));
    }
    let mut total = 0;
    for client in clients {
        let ((ok, connect, io, mismatches), errors) = client.finish();
        eprintln!("loop client: {ok} connections served, {connect} connect errors, {io} io errors: {errors:?}");
        assert_eq!(mismatches, 0);
        // Refused at connect (TCP, TLS or negotiation): never. A
        // connection the old process accepted before it handed over
        // finishes negotiating there, and its session drains as at
        // SIGTERM: a request it sends after the drain began is not
        // answered and the connection closes (per-session hand-over,
        // the next step, moves it instead).
        assert_eq!(connect, 0, "{errors:?}");
        for e in &errors {
            assert!(e.contains("ENOTCONN"), "{e}");
        }
        total += ok;
    }
    assert!(total >= 240, "{total}");
    assert!(nbdinfo_size(port, &env.certs()).status.success());
    let (status, _) = old.stop();
    assert!(status.success());
}

/// A fake successor: connects to the hand-over socket and sends `frame`.
fn fake_successor(path: &Path, frame: &[u8]) -> UnixStream {
    let mut stream = UnixStream::connect(path).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream.write_all(frame).unwrap();
    stream
}

/// The predecessor's answer to a fake successor.
fn answer(stream: &mut UnixStream) -> Message {
    let mut head = [0u8; HEADER_LEN];
    stream.read_exact(&mut head).unwrap();
    let length = u32::from_be_bytes(head[12..16].try_into().unwrap()) as usize;
    let mut frame = head.to_vec();
    frame.resize(HEADER_LEN + length, 0);
    stream.read_exact(&mut frame[HEADER_LEN..]).unwrap();
    decode_frame(&frame, 0).unwrap().0
}

struct Served {
    env: Env,
    _upstream: QemuNbd,
    handover: PathBuf,
    port: u16,
    admin: u16,
    gateway: NbdgwProcess,
}

fn served(timeout: &str) -> Served {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 7);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let mut cmd = Command::new(nbdgw_binary());
    cmd.arg("--tls-dir")
        .arg(env.certs())
        .arg("--upstream")
        .arg(&upstream.socket);
    cmd.arg("--listen").arg(format!("127.0.0.1:{port}"));
    let admin = common::free_port();
    cmd.arg("--admin-listen").arg(format!("127.0.0.1:{admin}"));
    cmd.arg("--handover-socket")
        .arg(&handover)
        .args(["--handover-timeout", timeout]);
    let gateway = NbdgwProcess::spawn(cmd, port);
    gateway.wait_for_log("nbdgw listening", 1);
    Served {
        env,
        _upstream: upstream,
        handover,
        port,
        admin,
        gateway,
    }
}

fn assert_serves(s: &Served) {
    let out = nbdinfo_size(s.port, &s.env.certs());
    assert!(out.status.success(), "{}\n{}", text(&out), s.gateway.log());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        IMAGE_LEN.to_string()
    );
}

/// A successor that knows only a state version this build does not is
/// refused, and the gateway serves on untouched; a real successor then
/// still takes over.
#[test]
fn a_fake_successor_of_an_unknown_version_is_refused_and_the_gateway_serves_on() {
    let mut s = served("20");
    let hello = Message::Hello {
        versions: vec![99],
        pid: std::process::id(),
    };
    let mut fake = fake_successor(&s.handover, &hello.encode());
    match answer(&mut fake) {
        Message::Refuse { reason } => {
            assert!(reason.contains("no state version in common"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    s.gateway.wait_for_log("outcome=\"refused_version\"", 1);
    assert!(s.gateway.log().contains("[99]"), "{}", s.gateway.log());
    assert_serves(&s);
    let (status, metrics) = common::clients::http_get(s.admin, "/metrics");
    assert_eq!(status, 200);
    assert!(
        metrics.contains("nbdgw_handovers_total{outcome=\"refused_version\"} 1"),
        "{metrics}"
    );
    assert!(s.gateway.is_running());
    let new = generation(
        &s.env,
        &s.env.path("nbd.sock"),
        s.port,
        &s.handover,
        true,
        &[],
    );
    assert!(s
        .gateway
        .wait_exit(Duration::from_secs(30))
        .expect("exits")
        .success());
    // The successor has no --admin-listen: the old admin socket was not
    // taken, and closed with the old process.
    let log = new.log();
    assert!(
        log.contains("role=\"admin\"") && log.contains("does not match this one's flags"),
        "{log}"
    );
    assert!(std::net::TcpStream::connect(("127.0.0.1", s.admin)).is_err());
    s.gateway = new;
    assert_serves(&s);
}

/// A fake successor that connects and says nothing holds the gateway for
/// --handover-timeout only; it never stops accepting meanwhile (the
/// listeners are given only after Hello).
#[test]
fn a_fake_successor_that_stalls_is_given_up_at_the_timeout() {
    let s = served("3");
    let mut fake = fake_successor(&s.handover, b"");
    assert_serves(&s);
    s.gateway.wait_for_log("outcome=\"timeout\"", 1);
    let mut rest = Vec::new();
    // The predecessor closed its end.
    let _ = fake.read_to_end(&mut rest);
    assert_serves(&s);
}

/// A real successor killed after it took the listeners, before it said
/// it serves: the predecessor takes them back, and the connections that
/// waited in the backlog meanwhile are served.
#[test]
fn a_successor_killed_in_the_middle_leaves_the_gateway_serving() {
    let s = served("60");
    let mut cmd = Command::new(nbdgw_binary());
    cmd.arg("--tls-dir")
        .arg(s.env.certs())
        .arg("--upstream")
        .arg(s.env.path("nbd.sock"));
    cmd.arg("--listen").arg(format!("127.0.0.1:{}", s.port));
    cmd.arg("--take-over")
        .arg(&s.handover)
        .env("NBDGW_DEBUG_HANDOVER_STALL", "1");
    let successor = NbdgwProcess::spawn(cmd, s.port);
    successor.wait_for_log("debug: stalling the take-over", 1);
    s.gateway
        .wait_for_log("hand-over: giving a listening socket", 1);
    // A client connecting now waits in the backlog: neither accepts.
    let (port, certs) = (s.port, s.env.certs());
    let waiting = std::thread::spawn(move || nbdinfo_size(port, &certs));
    let deadline = Instant::now() + Duration::from_secs(30);
    while backlog(s.port) == 0 {
        assert!(
            Instant::now() < deadline,
            "the client never reached the backlog"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(successor); // SIGKILL
    s.gateway.wait_for_log("outcome=\"successor_gone\"", 1);
    let out = waiting.join().unwrap();
    assert!(out.status.success(), "{}\n{}", text(&out), s.gateway.log());
    assert_serves(&s);
}

/// A successor of another uid: the socket is 0600, so it cannot even
/// connect; widened by hand, SO_PEERCRED refuses it with a log line.
#[test]
fn a_successor_of_another_uid_is_refused() {
    if uid() != 0 {
        eprintln!("skipped: needs root to run the successor as nobody");
        return;
    }
    let s = served("20");
    let mode = std::fs::metadata(&s.handover).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // The successor reads the same TLS files: let nobody read them.
    for path in [s.env.dir.path().to_path_buf(), s.env.certs()] {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    for entry in std::fs::read_dir(s.env.certs()).unwrap() {
        std::fs::set_permissions(
            entry.unwrap().path(),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
    }
    let run_dir = s.handover.parent().unwrap();
    std::fs::set_permissions(run_dir, std::fs::Permissions::from_mode(0o711)).unwrap();
    let as_nobody = || {
        let mut cmd = Command::new("setpriv");
        cmd.args([
            "--reuid",
            "nobody",
            "--regid",
            "nogroup",
            "--clear-groups",
            &nbdgw_binary(),
        ]);
        cmd.arg("--tls-dir")
            .arg(s.env.certs())
            .arg("--upstream")
            .arg(s.env.path("nbd.sock"));
        cmd.arg("--listen")
            .arg(format!("127.0.0.1:{}", s.port))
            .arg("--landlock")
            .arg("false");
        cmd.arg("--take-over").arg(&s.handover);
        cmd.output().unwrap()
    };
    let denied = as_nobody();
    assert!(!denied.status.success());
    assert!(
        text(&denied).contains("Permission denied"),
        "{}",
        text(&denied)
    );
    std::fs::set_permissions(&s.handover, std::fs::Permissions::from_mode(0o666)).unwrap();
    let refused = as_nobody();
    assert!(!refused.status.success());
    // Each end checks the other: the successor refuses a predecessor of
    // another uid too, and the predecessor refuses it with a log line.
    assert!(
        text(&refused).contains("the gateway there runs as uid 0, this one as 65534"),
        "{}",
        text(&refused)
    );
    s.gateway.wait_for_log("outcome=\"refused_uid\"", 1);
    assert_serves(&s);
}

/// The test's uid, from /proc (the tests use no unsafe code).
fn uid() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Connections waiting in the accept queue of the listener on `port`
/// (ss's Recv-Q for a listening socket).
fn backlog(port: u16) -> usize {
    let out = Command::new("ss")
        .args(["-Hltn", &format!("sport = :{port}")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<usize>().ok())
        .sum()
}

/// python3-libnbd: one session, a 1 MiB read when told (a line on
/// stdin), its bytes checked, then another read, which the drain ends.
const ONE_SESSION: &str = r#"
import nbd, sys
port, certs, image = sys.argv[1], sys.argv[2], sys.argv[3]
data = open(image, "rb").read()
h = nbd.NBD()
h.set_tls(nbd.TLS_REQUIRE)
h.set_tls_certificates(certs)
h.connect_uri(f"nbds://localhost:{port}/")
print("connected", flush=True)
sys.stdin.readline()
print("first read", "right" if h.pread(1 << 20, 0) == data[:1 << 20] else "WRONG", flush=True)
try:
    h.pread(4096, 0)
    print("second read answered", flush=True)
except nbd.Error as e:
    print("second read failed:", e, flush=True)
"#;

/// A session open on the old gateway with a read in flight at the
/// hand-over (its reply held by a relay in front of the real qemu-nbd):
/// the read is answered with the right bytes after the successor serves,
/// the session then ends as at SIGTERM, and the old process exits 0.
#[test]
fn a_read_in_flight_on_the_old_gateway_finishes_after_the_hand_over() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 3);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let relay = common::process::UpstreamCounter::start(&upstream.socket, &env.path("relay.sock"));
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let mut old = generation(&env, &relay.socket, port, &handover, false, &[]);
    let mut client = Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(ONE_SESSION)
        .arg(port.to_string())
        .arg(env.certs())
        .arg(&image)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(client.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "connected");
    relay.hold_replies(true);
    writeln!(client.stdin.as_mut().unwrap(), "go").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while relay.reads() == 0 {
        assert!(
            Instant::now() < deadline,
            "the read never reached the upstream"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let new = generation(&env, &relay.socket, port, &handover, true, &[]);
    new.wait_for_log("take-over: serving", 1);
    old.wait_for_log("shutting down: no longer accepting", 1);
    assert!(old.is_running(), "the old gateway waits for its read");
    relay.hold_replies(false);
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("first read right"), "{rest}");
    assert!(rest.contains("second read failed"), "{rest}");
    let status = old.wait_exit(Duration::from_secs(30)).expect("exits");
    assert!(status.success(), "{}", old.log());
    let _ = client.wait();
    assert!(nbdinfo_size(port, &env.certs()).status.success());
}

/// One successor at a time: a real one that arrives while a fake one
/// stalls waits its turn, and takes over once the fake is given up;
/// both with the same --handover-timeout, as operators run them: the
/// successor's starts at Chosen, not at its connect (review round 2, S1).
#[test]
fn a_successor_waits_while_another_is_served_then_takes_over() {
    let mut s = served("3");
    let _fake = fake_successor(&s.handover, b"");
    let mut cmd = Command::new(nbdgw_binary());
    cmd.arg("--tls-dir")
        .arg(s.env.certs())
        .arg("--upstream")
        .arg(s.env.path("nbd.sock"))
        .arg("--listen")
        .arg(format!("127.0.0.1:{}", s.port))
        .arg("--handover-socket")
        .arg(&s.handover)
        .arg("--take-over")
        .arg(&s.handover)
        .args(["--handover-timeout", "3"]);
    let new = NbdgwProcess::spawn(cmd, s.port);
    new.wait_for_log("nbdgw listening", 1);
    s.gateway
        .wait_for_log("the successor serves the listeners", 1);
    let log = s.gateway.log();
    let (timeout, handed) = (
        log.find("outcome=\"timeout\"").expect(&log),
        log.find("the successor serves the listeners").expect(&log),
    );
    assert!(timeout < handed, "{log}");
    assert!(s
        .gateway
        .wait_exit(Duration::from_secs(30))
        .expect("exits")
        .success());
    s.gateway = new;
    assert_serves(&s);
}

/// Review round 2, R4: three connections that say nothing queued ahead
/// of a real successor, all with the predecessor's --handover-timeout:
/// the predecessor gives each up at its timeout, and the successor,
/// whose wait to be served is --handover-queue-timeout (default 60 s),
/// takes over after them instead of failing its start.
#[test]
fn a_successor_queued_behind_three_silent_connections_takes_over() {
    let mut s = served("2");
    let _silent: Vec<_> = (0..3).map(|_| fake_successor(&s.handover, b"")).collect();
    let new = successor_of(&s, &["--handover-timeout", "2"]);
    new.wait_for_log("nbdgw listening", 1);
    s.gateway
        .wait_for_log("the successor serves the listeners", 1);
    let log = s.gateway.log();
    let handed = log.find("the successor serves the listeners").expect(&log);
    assert_eq!(
        log[..handed].matches("outcome=\"timeout\"").count(),
        3,
        "{log}"
    );
    assert!(s
        .gateway
        .wait_exit(Duration::from_secs(30))
        .expect("exits")
        .success());
    s.gateway = new;
    assert_serves(&s);
}

/// Review round 2, R4: a successor not served within its
/// --handover-queue-timeout fails its start saying so, not that the
/// hand-over took longer than its timeout; the gateway serves on.
#[test]
fn a_successor_not_served_in_its_queue_timeout_says_so() {
    let s = served("30");
    let _silent = fake_successor(&s.handover, b"");
    let mut new = successor_of(
        &s,
        &["--handover-timeout", "30", "--handover-queue-timeout", "1"],
    );
    let status = new.wait_exit(Duration::from_secs(60)).expect("exits");
    let log = new.log();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("not served within --handover-queue-timeout (1 s)"),
        "{log}"
    );
    assert!(!log.contains("took longer than its timeout"), "{log}");
    assert_serves(&s);
}

/// A real successor of `s`'s gateway, with `extra` flags.
fn successor_of(s: &Served, extra: &[&str]) -> NbdgwProcess {
    let mut cmd = Command::new(nbdgw_binary());
    cmd.arg("--tls-dir")
        .arg(s.env.certs())
        .arg("--upstream")
        .arg(s.env.path("nbd.sock"))
        .arg("--listen")
        .arg(format!("127.0.0.1:{}", s.port))
        .arg("--handover-socket")
        .arg(&s.handover)
        .arg("--take-over")
        .arg(&s.handover)
        .args(extra);
    NbdgwProcess::spawn(cmd, s.port)
}

/// A fake predecessor (a real one cannot be made to die at this point):
/// it gives a real listening socket, says Go, and is gone before the
/// successor can say it serves (its read side shut, so that the send
/// fails every time). The successor must serve on: after Go nothing
/// else accepts (review M1).
#[test]
fn a_successor_serves_on_when_the_predecessor_is_gone_after_go() {
    use nbdgw::handover::channel::Channel;
    use nbdgw::handover::describe::describe;
    use nbdgw::proto::handover::Role;
    use std::os::fd::AsFd;

    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 7);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let nbd = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let socket = std::os::unix::net::UnixListener::bind(&handover).unwrap();
    let fake = std::thread::spawn(move || {
        let (stream, _) = socket.accept().unwrap();
        let mut channel = Channel::new(stream, Instant::now() + Duration::from_secs(60)).unwrap();
        assert!(matches!(channel.recv().unwrap().0, Message::Hello { .. }));
        let chosen = Message::Chosen {
            version: 1,
            pid: std::process::id(),
            pidfd: false,
        };
        channel.send(&chosen, &[]).unwrap();
        let sockets = vec![describe(&nbd, Role::Nbd).unwrap()];
        let listeners = Message::Listeners { sockets };
        channel.send(&listeners, &[nbd.as_fd()]).unwrap();
        assert_eq!(channel.recv().unwrap().0, Message::Ready);
        channel.stream().shutdown(std::net::Shutdown::Read).unwrap();
        channel.send(&Message::Go, &[]).unwrap();
    });
    let mut cmd = Command::new(nbdgw_binary());
    cmd.arg("--tls-dir")
        .arg(env.certs())
        .arg("--upstream")
        .arg(&upstream.socket)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--take-over")
        .arg(&handover);
    let mut successor = NbdgwProcess::spawn(cmd, port);
    fake.join().unwrap();
    successor.wait_for_log("nbdgw listening", 1);
    successor.wait_for_log("did not hear that this one serves", 1);
    let out = nbdinfo_size(port, &env.certs());
    assert!(out.status.success(), "{}\n{}", text(&out), successor.log());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        IMAGE_LEN.to_string()
    );
    assert!(successor.is_running(), "{}", successor.log());
}

/// With --handover-socket, a stop signal still closes the NBD port at
/// once while a session drains: the copies kept for a successor close
/// too, so a new client is refused (and retries elsewhere) instead of
/// waiting in a backlog nobody accepts from (review M2).
#[test]
fn a_stopping_gateway_closes_its_port_while_it_drains() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 7);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let mut cmd = Command::new(nbdgw_binary());
    cmd.arg("--tls-dir")
        .arg(env.certs())
        .arg("--upstream")
        .arg(&upstream.socket)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--handover-socket")
        .arg(&handover)
        .args(["--shutdown-grace", "60", "--handshake-timeout", "60"]);
    let mut gateway = NbdgwProcess::spawn(cmd, port);
    gateway.wait_for_log("nbdgw listening", 1);
    // A connection still negotiating keeps the drain going.
    let mut held = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut greeting = [0u8; 18];
    held.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting[..8], b"NBDMAGIC");
    gateway.signal("TERM");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
            other => assert!(
                Instant::now() < deadline,
                "10 s after SIGTERM the port still queues clients ({other:?}):\n{}",
                gateway.log()
            ),
        }
        // Few enough tries that the old backlog (128) never fills.
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        gateway.is_running(),
        "the drain ended early:\n{}",
        gateway.log()
    );
    assert!(!handover.exists() || UnixStream::connect(&handover).is_err());
    drop(held);
}

/// A fake predecessor (python3): it gives a real listening socket, says
/// its pid in Chosen (pid 1 in mode `die-pid1`, as the entrypoint of a
/// container would), sends no pidfd, and, before Go, either exits as a
/// crash would (no Refuse; modes `die`, `die-pid1`) or refuses, closes the channel and stays alive
/// until its stdin closes (mode `refuse`).
const FAKE_PREDECESSOR: &str = r#"
import socket, struct, sys, os
path, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def frame(kind, body=b"", nfds=0):
    return struct.pack(">4sHHHHI", b"NBGH", 1, kind, nfds, 0, len(body)) + body
def read(c, n):
    b = b""
    while len(b) < n:
        d = c.recv(n - len(b))
        if not d: sys.exit("the successor closed")
        b += d
    return b
tcp = socket.socket()
tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
tcp.bind(("127.0.0.1", port)); tcp.listen(128)
os.umask(0o177)
u = socket.socket(socket.AF_UNIX); u.bind(path); u.listen(4)
print("listening", flush=True)
c, _ = u.accept()
head = read(c, 16)
read(c, struct.unpack(">I", head[12:16])[0])    # Hello
c.sendall(frame(3, struct.pack(">II", 1, 1 if mode == "die-pid1" else os.getpid())))
desc = struct.pack(">BBBB", 1, 1, 1, 2) + socket.inet_aton("127.0.0.1") + struct.pack(">H", port)
c.sendmsg([frame(4, struct.pack(">H", 1) + desc, 1)],
          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", tcp.fileno()))])
if mode.startswith("die"):
    os._exit(0)
reason = b"the running gateway gives up: test"
c.sendall(frame(2, struct.pack(">H", len(reason)) + reason))
c.close(); tcp.close(); u.close()
sys.stdin.read()
"#;

/// Starts the fake predecessor in `mode` and waits until it listens.
fn fake_predecessor(handover: &Path, port: u16, mode: &str) -> Child {
    let mut fake = Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(FAKE_PREDECESSOR)
        .arg(handover)
        .arg(port.to_string())
        .arg(mode)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(fake.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "listening");
    fake
}

/// A successor of the fake predecessor on `handover`, for `port`.
fn successor_of_fake(env: &Env, upstream: &Path, port: u16, handover: &Path) -> NbdgwProcess {
    let mut cmd = Command::new(nbdgw_binary());
    cmd.arg("--tls-dir")
        .arg(env.certs())
        .arg("--upstream")
        .arg(upstream)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--take-over")
        .arg(handover)
        .args(["--handover-timeout", "60"]);
    NbdgwProcess::spawn(cmd, port)
}

/// The predecessor dies after giving the listeners, before Go (a fake
/// one, which exits there): the successor tells the death from a
/// give-up (no Refuse, and the pid from Chosen is gone) and serves the
/// listening socket it holds, the only one left (review M1(a)).
#[test]
fn a_successor_serves_when_a_fake_predecessor_dies_before_go() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 7);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let mut fake = fake_predecessor(&handover, port, "die");
    let mut successor = successor_of_fake(&env, &upstream.socket, port, &handover);
    assert!(fake.wait().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !successor.log().contains("nbdgw listening") {
        let log = successor.log();
        assert!(successor.is_running(), "the successor quit:\n{log}");
        assert!(Instant::now() < deadline, "not serving:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        successor.log().contains("the old gateway died before Go"),
        "{}",
        successor.log()
    );
    let out = nbdinfo_size(port, &env.certs());
    assert!(out.status.success(), "{}\n{}", text(&out), successor.log());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        IMAGE_LEN.to_string()
    );
}

/// Review round 2, R1: a fake predecessor that says Chosen{pid: 1} (the
/// entrypoint of a container), sends no pidfd, gives the listener and
/// exits before Go. The successor must not watch pid 1 (its own init,
/// never gone) but count the predecessor as gone and serve.
#[test]
fn a_successor_serves_when_a_fake_predecessor_saying_pid_1_dies_before_go() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 7);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let mut fake = fake_predecessor(&handover, port, "die-pid1");
    let mut successor = successor_of_fake(&env, &upstream.socket, port, &handover);
    assert!(fake.wait().unwrap().success());
    wait_serving_orphaned(&mut successor);
    let out = nbdinfo_size(port, &env.certs());
    assert!(out.status.success(), "{}\n{}", text(&out), successor.log());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        IMAGE_LEN.to_string()
    );
}

/// Waits until a successor serves the sockets of a predecessor that died
/// before Go, as it says.
fn wait_serving_orphaned(successor: &mut NbdgwProcess) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !successor.log().contains("nbdgw listening") {
        let log = successor.log();
        assert!(successor.is_running(), "the successor quit:\n{log}");
        assert!(Instant::now() < deadline, "not serving:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        successor.log().contains("the old gateway died before Go"),
        "{}",
        successor.log()
    );
}

/// Review round 2, R1, as the review ran it (root only): a real
/// predecessor that is pid 1 of its own pid namespace (`unshare -p -f`),
/// held after giving the listeners and SIGKILLed there; the successor in
/// this namespace serves the port.
#[test]
fn a_successor_serves_when_a_predecessor_that_is_pid_1_of_its_namespace_dies_before_go() {
    let unshare = ["unshare", "-p", "-f", "--mount-proc", "--kill-child"];
    let probe = Command::new(unshare[0])
        .args(&unshare[1..])
        .arg("true")
        .status();
    if uid() != 0 || !probe.is_ok_and(|status| status.success()) {
        eprintln!("skipped: unshare -p needs root and a kernel that lets it");
        return;
    }
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 7);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let gateway_args = |cmd: &mut Command| {
        cmd.arg("--tls-dir")
            .arg(env.certs())
            .arg("--upstream")
            .arg(&upstream.socket)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--handover-socket")
            .arg(&handover)
            .args(["--handover-timeout", "60"]);
    };
    let mut cmd = Command::new(unshare[0]);
    cmd.args(&unshare[1..]).arg(nbdgw_binary());
    gateway_args(&mut cmd);
    cmd.env("NBDGW_DEBUG_HANDOVER_GIVER_STALL", "1");
    let predecessor = NbdgwProcess::spawn(cmd, port);
    predecessor.wait_for_log("nbdgw listening", 1);
    let mut cmd = Command::new(nbdgw_binary());
    gateway_args(&mut cmd);
    cmd.arg("--take-over").arg(&handover);
    let mut successor = NbdgwProcess::spawn(cmd, port);
    predecessor.wait_for_log("debug: stalling the hand-over with the listeners given", 1);
    // unshare --kill-child: its child, pid 1 of the namespace, dies too.
    predecessor.signal("KILL");
    wait_serving_orphaned(&mut successor);
    let out = nbdinfo_size(port, &env.certs());
    assert!(out.status.success(), "{}\n{}", text(&out), successor.log());
}

/// A fake predecessor that refuses before Go, closes the channel and
/// stays alive: a give-up, not a death. The successor fails its start
/// at once with the reason (read behind the broken pipe of its Ready,
/// if the channel closed before it sent Ready), never serves, and does
/// not wait out its timeout.
#[test]
fn a_successor_fails_its_start_when_a_fake_predecessor_refuses_before_go() {
    let env = Env::new();
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let mut fake = fake_predecessor(&handover, port, "refuse");
    let mut successor = successor_of_fake(&env, &env.path("nbd.sock"), port, &handover);
    let status = successor.wait_exit(Duration::from_secs(30));
    let log = successor.log();
    assert!(!status.expect(&log).success(), "{log}");
    assert!(log.contains("the running gateway gives up: test"), "{log}");
    assert!(!log.contains("nbdgw listening"), "{log}");
    drop(fake.stdin.take());
    assert!(fake.wait().unwrap().success());
}

/// A real predecessor SIGKILLed after it gave the listeners, before Go
/// (held there by its debug hook): the successor serves them, a client
/// that waited in the backlog meanwhile is served, and the take-over is
/// counted on the admin port it took (review M1(a), S1).
#[test]
fn a_successor_serves_when_the_real_predecessor_is_killed_before_go() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 7);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let (port, admin) = (common::free_port(), common::free_port());
    let gateway_cmd = |take_over: bool| {
        let mut cmd = Command::new(nbdgw_binary());
        cmd.arg("--tls-dir")
            .arg(env.certs())
            .arg("--upstream")
            .arg(&upstream.socket)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--admin-listen")
            .arg(format!("127.0.0.1:{admin}"))
            .args(["--handover-timeout", "60"]);
        if take_over {
            cmd.arg("--take-over").arg(&handover);
        } else {
            cmd.arg("--handover-socket").arg(&handover);
            cmd.env("NBDGW_DEBUG_HANDOVER_GIVER_STALL", "1");
        }
        cmd
    };
    let old = NbdgwProcess::spawn(gateway_cmd(false), port);
    old.wait_for_log("nbdgw listening", 1);
    let mut new = NbdgwProcess::spawn(gateway_cmd(true), port);
    old.wait_for_log("debug: stalling the hand-over", 1);
    let (certs, waiting_port) = (env.certs(), port);
    let waiting = std::thread::spawn(move || nbdinfo_size(waiting_port, &certs));
    let deadline = Instant::now() + Duration::from_secs(30);
    while backlog(port) == 0 {
        assert!(Instant::now() < deadline, "no client in the backlog");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(old); // SIGKILL
    new.wait_for_log("the old gateway died before Go", 1);
    new.wait_for_log("nbdgw listening", 1);
    let out = waiting.join().unwrap();
    assert!(out.status.success(), "{}\n{}", text(&out), new.log());
    assert!(new.is_running());
    let (status, metrics) = common::clients::http_get(admin, "/metrics");
    assert_eq!(status, 200);
    assert!(
        metrics.contains("nbdgw_takeovers_total{outcome=\"predecessor_gone\"} 1"),
        "{metrics}"
    );
}

/// Go is the commit point: a fake successor that is told Go and never
/// says it serves (alive, its channel open) is not undone at the
/// timeout; the predecessor never accepts again, and drains and exits 0
/// (review S2).
#[test]
fn after_go_a_fake_successor_that_never_says_serving_still_gets_the_port() {
    use nbdgw::handover::channel::Channel;

    let mut s = served("3");
    let stream = UnixStream::connect(&s.handover).unwrap();
    let mut channel = Channel::new(stream, Instant::now() + Duration::from_secs(60)).unwrap();
    let hello = Message::Hello {
        versions: vec![1],
        pid: std::process::id(),
    };
    channel.send(&hello, &[]).unwrap();
    assert!(matches!(channel.recv().unwrap().0, Message::Chosen { .. }));
    let (listeners, fds) = channel.recv().unwrap();
    assert!(
        matches!(listeners, Message::Listeners { .. }),
        "{listeners:?}"
    );
    channel.send(&Message::Ready, &[]).unwrap();
    assert_eq!(channel.recv().unwrap().0, Message::Go);
    let status = s.gateway.wait_exit(Duration::from_secs(60));
    let log = s.gateway.log();
    assert!(status.expect(&log).success(), "{log}");
    assert!(log.contains("did not say it serves"), "{log}");
    assert!(!log.contains("goes on serving"), "{log}");
    drop((channel, fds));
}

/// The successor counts its take-over where it can be read, on the
/// admin port it took over, and logs the pause the listeners saw
/// (review S1).
#[test]
fn a_take_over_is_counted_on_the_successors_admin_port() {
    let mut s = served("20");
    let mut cmd = Command::new(nbdgw_binary());
    cmd.arg("--tls-dir")
        .arg(s.env.certs())
        .arg("--upstream")
        .arg(s.env.path("nbd.sock"))
        .arg("--listen")
        .arg(format!("127.0.0.1:{}", s.port))
        .arg("--admin-listen")
        .arg(format!("127.0.0.1:{}", s.admin))
        .arg("--take-over")
        .arg(&s.handover);
    let new = NbdgwProcess::spawn(cmd, s.port);
    new.wait_for_log("take-over: serving", 1);
    assert!(s
        .gateway
        .wait_exit(Duration::from_secs(30))
        .expect("exits")
        .success());
    let (status, metrics) = common::clients::http_get(s.admin, "/metrics");
    assert_eq!(status, 200);
    assert!(
        metrics.contains("nbdgw_takeovers_total{outcome=\"taken_over\"} 1"),
        "{metrics}"
    );
    assert!(new.log().contains("pause_ms="), "{}", new.log());
    s.gateway = new;
    assert_serves(&s);
}

/// Under systemd (NOTIFY_SOCKET set) --take-over is refused at start:
/// the unit would kill the successor with the old gateway, and the
/// file-descriptor store path is not built (review S3). The running
/// gateway is not touched.
#[test]
fn take_over_under_systemd_is_refused_at_start() {
    let s = served("20");
    let mut cmd = Command::new(nbdgw_binary());
    cmd.arg("--tls-dir")
        .arg(s.env.certs())
        .arg("--upstream")
        .arg(s.env.path("nbd.sock"))
        .arg("--listen")
        .arg(format!("127.0.0.1:{}", s.port))
        .arg("--take-over")
        .arg(&s.handover)
        .env("NOTIFY_SOCKET", s.env.path("notify.sock"));
    let mut new = NbdgwProcess::spawn(cmd, s.port);
    let status = new.wait_exit(Duration::from_secs(30));
    let log = new.log();
    assert!(!status.expect(&log).success(), "{log}");
    assert!(log.contains("file-descriptor store"), "{log}");
    assert!(!s.gateway.log().contains("a successor connected"));
    assert_serves(&s);
}

/// A fake successor (python3) that goes as far as Go and dies there, as
/// a successor killed between Go and Serving; argv: socket, the pid its
/// Hello says (its own if absent).
const FAKE_SUCCESSOR_DIES_AFTER_GO: &str = r#"
import socket, struct, sys, os
path = sys.argv[1]
pid = os.getpid() if len(sys.argv) < 3 else int(sys.argv[2])
def frame(kind, body=b""):
    return struct.pack(">4sHHHHI", b"NBGH", 1, kind, 0, 0, len(body)) + body
def read(c, n):
    # Frames may come together in one read, or in parts: exactly n
    # bytes (the descriptors that ride along are dropped).
    b = b""
    while len(b) < n:
        d, _, _, _ = c.recvmsg(n - len(b), socket.CMSG_SPACE(8 * 4))
        if not d: sys.exit("the predecessor closed")
        b += d
    return b
def recvframe(c):
    head = read(c, 16)
    read(c, struct.unpack(">I", head[12:16])[0])
    return struct.unpack(">H", head[6:8])[0]
c = socket.socket(socket.AF_UNIX); c.connect(path)
c.sendall(frame(1, struct.pack(">HI", 1, 1) + struct.pack(">I", pid)))
assert recvframe(c) == 3, "chosen"
assert recvframe(c) == 4, "listeners"
c.sendall(frame(5))
assert recvframe(c) == 6, "go"
print("died after go", flush=True)
os._exit(0)
"#;

/// Runs the fake successor that dies after Go, through `wrapper` (e.g.
/// `unshare`) if given, and checks that it got as far as Go.
fn fake_successor_dies_after_go(handover: &Path, said_pid: Option<&str>, wrapper: &[&str]) {
    let mut cmd = match wrapper.split_first() {
        Some((program, args)) => {
            let mut cmd = Command::new(program);
            cmd.args(args).arg("/usr/bin/python3");
            cmd
        }
        None => Command::new("/usr/bin/python3"),
    };
    cmd.arg("-c")
        .arg(FAKE_SUCCESSOR_DIES_AFTER_GO)
        .arg(handover)
        .args(said_pid);
    let out = cmd.output().unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("died after go"),
        "{}",
        text(&out)
    );
}

/// The gateway took its listeners back from a successor that died after
/// Go: it serves a real NBD client on its port and runs on.
fn assert_taken_back(s: &mut Served) {
    s.gateway.wait_for_log("outcome=\"successor_gone\"", 1);
    assert_serves(s);
    assert!(s.gateway.is_running(), "{}", s.gateway.log());
    assert!(
        !s.gateway.log().contains("no longer accepting"),
        "{}",
        s.gateway.log()
    );
}

/// Review round 2, M2: a fake successor whose Hello names pid 1 (a lie
/// here; the truth for a successor in its own pid namespace) dies after
/// Go. The predecessor watches the process the kernel says connected,
/// sees it gone, and takes the listeners back.
#[test]
fn a_fake_successor_saying_pid_1_that_dies_after_go_leaves_the_gateway_serving() {
    let mut s = served("20");
    fake_successor_dies_after_go(&s.handover, Some("1"), &[]);
    assert_taken_back(&mut s);
}

/// Review round 2, M2, as the review ran it: the fake successor in its
/// own pid namespace (`unshare -p -f`, root only), where its honest pid
/// is 1, dies after Go.
#[test]
fn a_fake_successor_in_another_pid_namespace_that_dies_after_go_leaves_the_gateway_serving() {
    let unshare = ["unshare", "-p", "-f", "--mount-proc"];
    let probe = Command::new(unshare[0])
        .args(&unshare[1..])
        .arg("true")
        .status();
    if uid() != 0 || !probe.is_ok_and(|status| status.success()) {
        eprintln!("skipped: unshare -p needs root and a kernel that lets it");
        return;
    }
    let mut s = served("20");
    fake_successor_dies_after_go(&s.handover, None, &unshare);
    assert_taken_back(&mut s);
}

/// A real successor SIGKILLed after Go, before it serves (held there by
/// its debug hook): the predecessor sees its process gone and takes the
/// listeners back; a real client is served on the port.
#[test]
fn a_real_successor_killed_after_go_leaves_the_gateway_serving() {
    let mut s = served("60");
    let mut cmd = Command::new(nbdgw_binary());
    cmd.arg("--tls-dir")
        .arg(s.env.certs())
        .arg("--upstream")
        .arg(s.env.path("nbd.sock"));
    cmd.arg("--listen").arg(format!("127.0.0.1:{}", s.port));
    cmd.arg("--take-over")
        .arg(&s.handover)
        .env("NBDGW_DEBUG_HANDOVER_AFTER_GO_STALL", "1");
    let successor = NbdgwProcess::spawn(cmd, s.port);
    successor.wait_for_log("debug: stalling the take-over after Go", 1);
    drop(successor); // SIGKILL
    assert_taken_back(&mut s);
}

/// Review round 2, S6: a successor that gives up after Go and says so
/// (a fake one, here) does not accept: the predecessor takes the
/// listeners back instead of draining.
#[test]
fn a_fake_successor_that_refuses_after_go_leaves_the_gateway_serving() {
    use nbdgw::handover::channel::Channel;

    let mut s = served("20");
    let stream = UnixStream::connect(&s.handover).unwrap();
    let mut channel = Channel::new(stream, Instant::now() + Duration::from_secs(60)).unwrap();
    let hello = Message::Hello {
        versions: vec![1],
        pid: std::process::id(),
    };
    channel.send(&hello, &[]).unwrap();
    assert!(matches!(channel.recv().unwrap().0, Message::Chosen { .. }));
    let (listeners, fds) = channel.recv().unwrap();
    assert!(matches!(listeners, Message::Listeners { .. }));
    drop(fds);
    channel.send(&Message::Ready, &[]).unwrap();
    assert_eq!(channel.recv().unwrap().0, Message::Go);
    channel.refuse("test: the successor gives up");
    s.gateway.wait_for_log("the successor gave up after Go", 1);
    assert!(s.gateway.log().contains("test: the successor gives up"));
    assert_taken_back(&mut s);
    drop(channel);
}

/// A fake predecessor (python3) that says Chosen and then nothing, and
/// prints the kind and text of what the successor sends next ("closed"
/// for a bare end).
const FAKE_SILENT_PREDECESSOR: &str = r#"
import socket, struct, sys, os
path = sys.argv[1]
os.umask(0o177)
u = socket.socket(socket.AF_UNIX); u.bind(path); u.listen(4)
print("listening", flush=True)
c, _ = u.accept()
def read(n):
    b = b""
    while len(b) < n:
        d = c.recv(n - len(b))
        if not d:
            print("closed", flush=True); sys.exit(0)
        b += d
    return b
head = read(16)
read(struct.unpack(">I", head[12:16])[0])    # Hello
c.sendall(struct.pack(">4sHHHHI", b"NBGH", 1, 3, 0, 0, 8) + struct.pack(">II", 1, os.getpid()))
head = read(16)
body = read(struct.unpack(">I", head[12:16])[0])
print("kind", struct.unpack(">H", head[6:8])[0], body[2:].decode(errors="replace"), flush=True)
"#;

/// Review round 2, S6: a successor that gives up on its own (here its
/// timeout, waiting for the listeners) says Refuse, with its reason,
/// before it closes: a predecessor never has to guess from a bare end.
#[test]
fn a_successor_that_times_out_says_so_before_it_closes() {
    let env = Env::new();
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let mut fake = Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(FAKE_SILENT_PREDECESSOR)
        .arg(&handover)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(fake.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "listening");
    let mut cmd = Command::new(nbdgw_binary());
    cmd.arg("--tls-dir")
        .arg(env.certs())
        .arg("--upstream")
        .arg(env.path("nbd.sock"))
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--take-over")
        .arg(&handover)
        .args(["--handover-timeout", "2"]);
    let mut successor = NbdgwProcess::spawn(cmd, port);
    let said = lines.next().unwrap().unwrap();
    assert!(said.starts_with("kind 2 "), "{said}");
    assert!(said.contains("took longer than its timeout"), "{said}");
    let status = successor.wait_exit(Duration::from_secs(30));
    assert!(!status.expect("exits").success());
    assert!(fake.wait().unwrap().success());
}
