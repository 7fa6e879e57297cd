//! Issue 29, client mode: `nbdgw client` replaced under its local clients
//! without a reconnect (`--handover-socket` / `--take-over`). Real parts:
//! qemu-nbd behind a real server-mode nbdgw (the remote, with TLS and
//! client certificates), `nbdgw client` in front of it, and real local
//! clients: python3-libnbd over the client's Unix socket doing verified
//! writes and reads without pause, and the raw NBD client on a loopback
//! port for a request half sent at the moment of the quiesce.
//!
//! What has to hold: every local session moves (its local socket, its
//! remote TCP socket, the remote's client-side TLS state, the bytes read
//! ahead, the negotiated framing and export), so that the remote server
//! sees ONE TLS handshake in all and the local client ONE connection;
//! the successor judges each session against its own configuration (the
//! same --server, a CA that still verifies the server) and a session it
//! would not make stays with the old process and drains; a session under
//! --reconnect moves and reconnects from the successor after a later
//! drop, and one reconnecting at the hand-over stays and drains; a successor
//! killed with a State in hand leaves the session closed, never served
//! twice.
//!
//! Before this work `nbdgw client` had no --handover-socket: every test
//! here fails at the first start ("unexpected argument
//! '--handover-socket'").

mod common;

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::process::{nbdgw_binary, NbdgwProcess};
use common::raw::RawClient;
use common::{pattern, Env, QemuNbd};
use nbdgw::proto::transmission::ReplyMode;

const DISK_LEN: usize = 8 << 20;
const BLOCK: usize = 64 << 10;
/// Each client's progress on one process before it is replaced.
const PROGRESS_PER_ROUND: usize = 6;

/// The second build replacements alternate with (scripts/test.sh gives
/// CI a different build of the same source).
fn other_binary() -> String {
    std::env::var("NBDGW_HANDOVER_OTHER").unwrap_or_else(|_| nbdgw_binary())
}

fn replacements() -> usize {
    std::env::var("NBDGW_CLIENT_REPLACEMENTS")
        .ok()
        .map(|n| n.parse().expect("NBDGW_CLIENT_REPLACEMENTS: a number"))
        .unwrap_or(10)
}

/// qemu-nbd, the server-mode nbdgw in front of it (the remote), and the
/// paths `nbdgw client` generations share.
struct Rig {
    env: Env,
    upstream: QemuNbd,
    server: NbdgwProcess,
    run: PathBuf,
}

impl Rig {
    fn new() -> Self {
        let env = Env::new();
        let image = env.filled_image("disk.img", 0, DISK_LEN);
        let upstream = QemuNbd::start(&env, &image, &[]);
        let server = NbdgwProcess::in_front_of(&env, &upstream.socket, &["--landlock", "false"]);
        let run = env.path("run");
        std::fs::create_dir(&run).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)).unwrap();
        Rig {
            env,
            upstream,
            server,
            run,
        }
    }

    fn socket(&self) -> PathBuf {
        self.run.join("client.sock")
    }

    fn handover(&self) -> PathBuf {
        self.run.join("handover.sock")
    }

    /// One `nbdgw client` generation on `listen`, taking over from the
    /// running one if `take_over`; `extra` adds flags (a --server there
    /// replaces the rig's).
    fn client(&self, binary: &str, listen: &str, take_over: bool, extra: &[&str]) -> NbdgwProcess {
        self.client_env(binary, listen, take_over, extra, &[])
    }

    fn client_env(
        &self,
        binary: &str,
        listen: &str,
        take_over: bool,
        extra: &[&str],
        vars: &[(&str, &str)],
    ) -> NbdgwProcess {
        let mut cmd = Command::new(binary);
        cmd.arg("client").args(["--listen", listen]);
        if !extra.contains(&"--server") {
            cmd.args(["--server", &format!("localhost:{}", self.server.port)]);
        }
        cmd.arg("--tls-dir")
            .arg(self.env.certs())
            .arg("--handover-socket")
            .arg(self.handover())
            .args(["--shutdown-grace", "30", "--handover-timeout", "30"])
            .args(extra);
        if take_over {
            cmd.arg("--take-over").arg(self.handover());
        }
        cmd.envs(vars.iter().copied());
        let mut process = NbdgwProcess::spawn(cmd, 0);
        wait_listening(&mut process);
        process
    }

    fn unix_client(&self, binary: &str, take_over: bool) -> NbdgwProcess {
        let socket = self.socket();
        self.client(binary, socket.to_str().unwrap(), take_over, &[])
    }

    /// The remote server's TLS handshakes so far.
    fn server_handshakes(&self) -> usize {
        self.server.count_in_log("TLS established")
    }
}

fn wait_listening(process: &mut NbdgwProcess) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while process.count_in_log("nbdgw client listening") == 0 {
        if !process.is_running() {
            std::thread::sleep(Duration::from_millis(200));
            panic!("nbdgw client exited:\n{}", process.log());
        }
        assert!(
            Instant::now() < deadline,
            "nbdgw client did not start:\n{}",
            process.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The old generation exits 0 once its sessions are handed over.
fn wait_exit_ok(old: &mut NbdgwProcess, when: &str) {
    let status = old.wait_exit(Duration::from_secs(90));
    assert!(
        status.is_some_and(|s| s.success()),
        "{when}: the old nbdgw client did not exit 0 ({status:?}):\n{}",
        old.log()
    );
}

/// python3-libnbd on ONE handle over the local socket (plaintext): for
/// each block in turn, reads it and compares it with the generation it
/// last wrote there, writes the next generation, reads it back. Never
/// pauses; on any error it prints it and exits 1 (a libnbd handle never
/// reconnects). At the end it reads everything back.
const LIBNBD_CLIENT: &str = r#"
import nbd, struct, sys, threading
uri, length, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
h = nbd.NBD()
h.set_tls(nbd.TLS_DISABLE)
h.connect_uri(uri)
def pattern(off, gen):
    return struct.pack(">QQ", off, gen) * (block // 16) if gen else bytes(block)
gens = [0] * (length // block)
ops = 0
try:
    while not stop.is_set():
        b = ops % len(gens)
        off = b * block
        if h.pread(block, off) != pattern(off, gens[b]):
            print("error mismatch before write at", off, "generation", gens[b], flush=True)
            sys.exit(1)
        gens[b] += 1
        h.pwrite(pattern(off, gens[b]), off)
        if h.pread(block, off) != pattern(off, gens[b]):
            print("error mismatch after write at", off, "generation", gens[b], flush=True)
            sys.exit(1)
        ops += 1
        print("ok", ops, flush=True)
    h.flush()
    for b, gen in enumerate(gens):
        if h.pread(block, b * block) != pattern(b * block, gen):
            print("error mismatch at the end at", b * block, "generation", gen, flush=True)
            sys.exit(1)
    h.shutdown()
except nbd.Error as e:
    print("error after", ops, "operations:", e, flush=True)
    sys.exit(1)
print("done", ops, flush=True)
"#;

/// The libnbd client process, its output read as it comes.
struct Libnbd {
    child: Child,
    stdin: Option<ChildStdin>,
    progress: Arc<Mutex<(usize, Vec<String>, bool)>>,
}

impl Libnbd {
    fn start(socket: &Path) -> Self {
        let mut child = Command::new("/usr/bin/python3")
            .arg("-c")
            .arg(LIBNBD_CLIENT)
            .arg(common::unix_uri(socket))
            .arg((DISK_LEN / 2).to_string())
            .arg(BLOCK.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("python3");
        let progress = Arc::new(Mutex::new((0, Vec::new(), false)));
        for stream in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let progress = progress.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    let mut p = progress.lock().unwrap();
                    if line.starts_with("ok ") {
                        p.0 += 1;
                    } else if line.starts_with("done") {
                        p.2 = true;
                    } else {
                        p.1.push(line);
                    }
                }
            });
        }
        let stdin = child.stdin.take();
        Libnbd {
            child,
            stdin,
            progress,
        }
    }

    fn progress(&self) -> usize {
        self.progress.lock().unwrap().0
    }

    fn wait_progress(&self, from: usize, more: usize, when: &str) {
        let deadline = Instant::now() + Duration::from_secs(90);
        while self.progress() < from + more {
            let errors = self.progress.lock().unwrap().1.clone();
            assert!(
                errors.is_empty(),
                "{when}: python3-libnbd failed: {errors:?}"
            );
            assert!(Instant::now() < deadline, "{when}: no progress for 90 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Asks it to stop, read everything back and close: its errors.
    fn finish(mut self) -> (bool, Vec<String>) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(120);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "python3-libnbd did not end");
            std::thread::sleep(Duration::from_millis(50));
        };
        std::thread::sleep(Duration::from_millis(200));
        let p = self.progress.lock().unwrap();
        (status.success() && p.2, p.1.clone())
    }
}

impl Drop for Libnbd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The acceptance test: `nbdgw client` replaced N times in a row
/// (NBDGW_CLIENT_REPLACEMENTS, default 10), alternating two builds,
/// under a libnbd client that never pauses.
#[test]
fn client_mode_sessions_survive_replacements_alternating_builds() {
    let rig = Rig::new();
    let builds = [nbdgw_binary(), other_binary()];
    // The admin port moves too: the last process reports the session.
    let admin = common::free_port();
    let admin_flag = format!("127.0.0.1:{admin}");
    let socket = rig.socket();
    let generation = |binary: &str, take_over: bool| {
        let flags = ["--admin-listen", admin_flag.as_str()];
        rig.client(binary, socket.to_str().unwrap(), take_over, &flags)
    };
    let mut current = generation(&builds[0], false);
    let client = Libnbd::start(&rig.socket());
    client.wait_progress(0, PROGRESS_PER_ROUND, "before the first replacement");
    assert_eq!(current.count_in_log("accepted"), 1, "{}", current.log());
    for round in 1..=replacements() {
        let when = format!("replacement {round}");
        let before = client.progress();
        let next = generation(&builds[round % 2], true);
        wait_exit_ok(&mut current, &when);
        let log = current.log();
        assert!(
            log.contains("hand-over: the successor serves the session"),
            "{when}: the session was not handed over:\n{log}"
        );
        // For the record (cargo test -- --nocapture): the pause the
        // session saw, from its stop to the successor's Taken.
        let line = log
            .lines()
            .find(|l| l.contains("the successor serves the session"));
        if let Some(pause) = line.and_then(|l| l.split("pause_ms=").nth(1)) {
            let ms: String = pause.chars().take_while(char::is_ascii_digit).collect();
            eprintln!("{when}: pause {ms} ms");
        }
        next.wait_for_log("serving a session handed over by the old process", 1);
        client.wait_progress(before, PROGRESS_PER_ROUND, &when);
        let log = next.log();
        assert!(
            !log.contains("TLS established"),
            "{when}: a new handshake:\n{log}"
        );
        assert!(
            !log.contains("accepted"),
            "{when}: a new local connection:\n{log}"
        );
        current = next;
    }
    let metrics = common::metrics::scrape(admin);
    let resumed = r#"nbdgw_session_handovers_total{outcome="resumed"}"#;
    assert_eq!(common::metrics::sample(&metrics, resumed), 1.0, "{metrics}");
    let (ok, errors) = client.finish();
    assert!(ok && errors.is_empty(), "python3-libnbd: {errors:?}");
    // Every byte right: the client's last read-back passed; the image
    // holds what it wrote (each block a known generation, or zeros).
    let image = rig.upstream.read_direct();
    for block in image[..DISK_LEN / 2].chunks(BLOCK) {
        let off = u64::from_be_bytes(block[..8].try_into().unwrap());
        assert!(
            block.iter().all(|&b| b == 0) || block[..16] == block[16..32],
            "block at {off} is neither zeros nor a pattern"
        );
    }
    assert_eq!(
        rig.server_handshakes(),
        1,
        "the remote server saw more than one TLS handshake:\n{}",
        rig.server.log()
    );
    let (status, log) = current.stop();
    assert!(status.success(), "{log}");
}

/// A session the successor would not make itself is not moved: another
/// --server (the same server under another address), or a CA that does
/// not verify the server's certificate. It stays in the old process and
/// drains (the old process's metric and log say why); the successor
/// serves no session, and the remote saw one handshake.
#[test]
fn a_successor_with_another_server_or_ca_declines_the_session() {
    let rig = Rig::new();
    let other_ca = common::pki::Ca::new("another CA");
    let ca_file = rig.env.path("other-ca.pem");
    std::fs::write(&ca_file, &other_ca.pem).unwrap();
    let certs = rig.env.certs();
    let server = format!("127.0.0.1:{}", rig.server.port);
    let cases: [(&str, Vec<String>); 2] = [
        (
            "server:",
            vec![
                "--server".into(),
                server,
                "--server-name".into(),
                "localhost".into(),
            ],
        ),
        (
            "certificate:",
            vec![
                "--tls-ca".into(),
                ca_file.display().to_string(),
                "--tls-cert".into(),
                certs.join("client-cert.pem").display().to_string(),
                "--tls-key".into(),
                certs.join("client-key.pem").display().to_string(),
            ],
        ),
    ];
    for (class, flags) in cases {
        let mut old = rig.unix_client(&nbdgw_binary(), false);
        let mut raw = RawLocal::on_unix(&rig.socket());
        raw.write_and_check(1 << 20, 7);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let socket = rig.socket();
        let next = rig.client(&nbdgw_binary(), socket.to_str().unwrap(), true, &flags);
        old.wait_for_log("hand-over: the successor declined the session", 1);
        let log = old.log();
        assert!(log.contains(class), "{class}: the decline's reason:\n{log}");
        // The session drains in the old process once the exchange is
        // done (a request before that is still served there, as before a
        // SIGTERM): idle, it is closed; never served by the successor.
        old.wait_for_log("shutting down: no longer accepting", 1);
        raw.expect_shutdown_answer();
        wait_exit_ok(&mut old, class);
        let log = next.log();
        assert!(
            !log.contains("serving a session handed over"),
            "{class}: moved:\n{log}"
        );
        assert!(log.contains("declining a session"), "{class}:\n{log}");
        let _ = next.stop();
        let _ = std::fs::remove_file(rig.socket());
    }
    assert_eq!(rig.server_handshakes(), 2, "{}", rig.server.log());
}

/// Review C2: the session's key exchange group is judged against the
/// successor's own --tls-groups. A session made with the default groups
/// (the remote logs the hybrid) is declined by a successor offering only
/// secp384r1, and drains in the old process; one offering the hybrid
/// takes it over.
#[test]
fn a_successor_declines_a_session_whose_group_it_does_not_offer() {
    let rig = Rig::new();
    let socket = rig.socket();
    let listen = socket.to_str().unwrap();
    for (groups, moved) in [("secp384r1", false), ("secp384r1,X25519MLKEM768", true)] {
        let mut old = rig.unix_client(&nbdgw_binary(), false);
        let mut raw = RawLocal::on_unix(&socket);
        raw.write_and_check(1 << 20, 41);
        assert!(
            rig.server.log().contains("key_exchange=X25519MLKEM768"),
            "{}",
            rig.server.log()
        );
        let next = rig.client(&nbdgw_binary(), listen, true, &["--tls-groups", groups]);
        wait_exit_ok(&mut old, groups);
        let (old_log, next_log) = (old.log(), next.log());
        if moved {
            next.wait_for_log("serving a session handed over by the old process", 1);
            raw.write_and_check(2 << 20, 42);
        } else {
            assert!(
                old_log.contains("hand-over: the successor declined the session"),
                "{old_log}"
            );
            // The class "tls:" is what the old process counts as
            // declined_tls.
            assert!(
                old_log.contains(
                    "tls: the session's key exchange group X25519MLKEM768 (0x11ec) is not offered"
                ),
                "{old_log}"
            );
            raw.expect_shutdown_answer();
            assert!(
                !next_log.contains("serving a session handed over"),
                "{next_log}"
            );
        }
        let _ = next.stop();
        let _ = std::fs::remove_file(&socket);
    }
}

/// A successor's --max-connections holds for sessions handed to it: of
/// two, one moves and the other is declined (it stays and drains).
#[test]
fn a_successor_takes_no_more_sessions_than_its_max_connections() {
    let rig = Rig::new();
    let mut old = rig.unix_client(&nbdgw_binary(), false);
    let mut first = RawLocal::on_unix(&rig.socket());
    let mut second = RawLocal::on_unix(&rig.socket());
    first.write_and_check(1 << 20, 21);
    second.write_and_check(2 << 20, 22);
    let socket = rig.socket();
    let one = ["--max-connections", "1"];
    let next = rig.client(&nbdgw_binary(), socket.to_str().unwrap(), true, &one);
    old.wait_for_log("hand-over: the successor declined the session", 1);
    assert!(
        old.log().contains("--max-connections 1 is reached"),
        "{}",
        old.log()
    );
    wait_exit_ok(&mut old, "max connections");
    next.wait_for_log("serving a session handed over by the old process", 1);
    assert_eq!(
        next.count_in_log("serving a session handed over"),
        1,
        "{}",
        next.log()
    );
    let _ = next.stop();
}

/// A request half sent on the local side when the quiesce comes: the
/// bytes read are carried to the successor, which reads the rest there
/// and answers it; the write lands and reads back.
#[test]
fn a_request_half_sent_on_the_local_side_is_finished_in_the_successor() {
    let rig = Rig::new();
    let port = common::free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut old = rig.client(&nbdgw_binary(), &listen, false, &[]);
    let mut c = RawClient::handshake(([127, 0, 0, 1], port).into());
    c.go(ReplyMode::Structured);
    let data = pattern(BLOCK, 42);
    let write = nbdgw::proto::consts::CMD_WRITE;
    let request = c.request_bytes(0, write, 9, 2 << 20, data.len() as u64);
    c.send(&request[..13]);
    let next = rig.client(&other_binary(), &listen, true, &[]);
    wait_exit_ok(&mut old, "half a header");
    next.wait_for_log("serving a session handed over by the old process", 1);
    c.send(&request[13..]);
    c.send(&data);
    let reply = c.read_reply(0);
    assert_eq!(reply.last().map(|r| (r.cookie, r.error)), Some((9, 0)));
    assert_eq!(c.read(10, 2 << 20, BLOCK), data);
    c.disconnect();
    assert_eq!(rig.server_handshakes(), 1, "{}", rig.server.log());
    let _ = next.stop();
}

/// A successor killed once it holds a session's State: the session is
/// closed (its keys left the old process, which never writes on it
/// again), not served twice; the old process exits.
#[test]
fn a_successor_killed_with_the_state_leaves_the_session_closed() {
    let rig = Rig::new();
    let mut old = rig.unix_client(&nbdgw_binary(), false);
    let mut raw = RawLocal::on_unix(&rig.socket());
    raw.write_and_check(3 << 20, 11);
    let socket = rig.socket();
    let stall = [("NBDGW_DEBUG_HANDOVER_STATE_STALL", "1")];
    let next = rig.client_env(&nbdgw_binary(), socket.to_str().unwrap(), true, &[], &stall);
    next.wait_for_log("stalling the session take-over with a State received", 1);
    next.signal("KILL");
    let _ = next.stop();
    wait_exit_ok(&mut old, "successor killed");
    raw.expect_closed();
    let log = old.log();
    assert!(!log.contains("the successor serves the session"), "{log}");
    assert!(log.contains("hand-over failed"), "{log}");
}

/// A signal (SIGSTOP/SIGCONT) to a process of the test.
fn kill(signal: &str, pid: u32) {
    common::run_ok(
        Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string()),
    );
}

/// Review C1: SIGTERM to the old client while it is still in the session
/// exchange (a request held at a paused real qemu-nbd, so the session
/// does not go quiet) must leave the local socket file in place: the
/// successor was told Go and serves that listener, and a new local
/// client reaches it through the path.
#[test]
fn sigterm_to_the_old_client_mid_hand_over_leaves_the_socket_to_the_successor() {
    let rig = Rig::new();
    let socket = rig.socket();
    let quiesce = ["--handover-quiesce-timeout", "120"];
    let mut old = rig.client(&nbdgw_binary(), socket.to_str().unwrap(), false, &quiesce);
    let mut held = RawLocal::on_unix(&socket);
    held.write_and_check(1 << 20, 31);
    kill("STOP", rig.upstream.pid());
    // Resumed however the test ends.
    struct Cont(u32);
    impl Drop for Cont {
        fn drop(&mut self) {
            let _ = Command::new("kill")
                .arg("-CONT")
                .arg(self.0.to_string())
                .status();
        }
    }
    let cont = Cont(rig.upstream.pid());
    held.request(0, 5, 1 << 20, BLOCK as u32);
    let next = rig.client(&nbdgw_binary(), socket.to_str().unwrap(), true, &quiesce);
    old.wait_for_log("hand-over: offering the sessions to the successor", 1);
    old.signal("TERM");
    old.wait_for_log("shutting down: no longer accepting", 1);
    drop(cont);
    assert!(
        std::fs::symlink_metadata(&socket).is_ok(),
        "the old client removed the socket the successor serves:\n{}",
        old.log()
    );
    let mut fresh = RawLocal::on_unix(&socket);
    fresh.write_and_check(2 << 20, 32);
    assert!(
        next.count_in_log("serving a session handed over") == 0,
        "{}",
        next.log()
    );
    drop(held);
    wait_exit_ok(&mut old, "SIGTERM mid-hand-over");
    assert!(std::fs::symlink_metadata(&socket).is_ok());
    let _ = next.stop();
}

/// A server-mode successor and a client-mode one never take each other
/// over: they share no state version, so the running process refuses at
/// Hello, before any socket or session is offered, and serves on; the
/// successor's start fails saying why.
#[test]
fn server_mode_and_client_mode_refuse_each_other() {
    let rig = Rig::new();
    let old = rig.unix_client(&nbdgw_binary(), false);
    let mut raw = RawLocal::on_unix(&rig.socket());
    raw.write_and_check(1 << 20, 5);
    let certs = rig.env.certs();
    let args = common::process::front_args(&certs, &rig.upstream.socket, &["--landlock", "false"]);
    let handover = rig.handover();
    let said = common::process::start_must_fail(
        args.iter()
            .map(|a| a.as_os_str())
            .chain([OsStr::new("--take-over"), handover.as_os_str()]),
    );
    assert!(said.contains("no state version in common"), "{said}");
    old.wait_for_log("outcome=\"refused_version\"", 1);
    // The client-mode session is still served by the old process.
    raw.write_and_check(1 << 20, 6);

    // And back: a client-mode successor of a server-mode gateway.
    let gateway_handover = rig.run.join("gateway-handover.sock");
    let flag = gateway_handover.to_str().unwrap();
    let gateway = NbdgwProcess::in_front_of(
        &rig.env,
        &rig.upstream.socket,
        &["--landlock", "false", "--handover-socket", flag],
    );
    let out = Command::new(nbdgw_binary())
        .arg("client")
        .args(["--listen", rig.run.join("other.sock").to_str().unwrap()])
        .args(["--server", &format!("localhost:{}", gateway.port)])
        .arg("--tls-dir")
        .arg(&certs)
        .args(["--take-over", flag])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("no state version in common"), "{said}");
    gateway.wait_for_log("outcome=\"refused_version\"", 1);
}

/// A session under --reconnect moves too, with how its export was
/// opened: after two replacements the remote server is restarted, and
/// the successor's session reconnects, replays what was in flight and
/// goes on; then it is handed over once more (a connection this process
/// made after the drop). The libnbd client sees no error.
#[test]
fn a_reconnect_session_moves_and_still_reconnects_in_the_successor() {
    let mut rig = Rig::new();
    let builds = [nbdgw_binary(), other_binary()];
    let socket = rig.socket();
    let reconnect = ["--reconnect", "--reconnect-timeout", "60"];
    let mut current = rig.client(&builds[0], socket.to_str().unwrap(), false, &reconnect);
    let client = Libnbd::start(&socket);
    client.wait_progress(0, PROGRESS_PER_ROUND, "before the first replacement");
    for round in 1..=3 {
        let when = format!("replacement {round}");
        if round == 3 {
            // The remote goes away and comes back on the same port.
            let port = rig.server.port;
            rig.server.signal("KILL");
            let _ = rig.server.wait_exit(Duration::from_secs(10));
            rig.server = NbdgwProcess::in_front_of_at(
                &rig.env,
                &rig.upstream.socket,
                port,
                &["--landlock", "false"],
            );
            current.wait_for_log("reconnected to the server (--reconnect)", 1);
            let before = client.progress();
            client.wait_progress(before, PROGRESS_PER_ROUND, "after the reconnect");
        }
        let before = client.progress();
        let next = rig.client(
            &builds[round % 2],
            socket.to_str().unwrap(),
            true,
            &reconnect,
        );
        wait_exit_ok(&mut current, &when);
        assert!(
            current
                .log()
                .contains("hand-over: the successor serves the session"),
            "{when}:\n{}",
            current.log()
        );
        client.wait_progress(before, PROGRESS_PER_ROUND, &when);
        current = next;
    }
    let (ok, errors) = client.finish();
    assert!(ok && errors.is_empty(), "python3-libnbd: {errors:?}");
    // The restarted server saw one handshake: the reconnect's.
    assert_eq!(rig.server_handshakes(), 1, "{}", rig.server.log());
    let _ = current.stop();
}

/// A session that is reconnecting when the hand-over comes is not moved
/// (nothing of its reconnect is carried): it stays and drains.
#[test]
fn a_session_reconnecting_at_the_hand_over_stays_and_drains() {
    let rig = Rig::new();
    let socket = rig.socket();
    let reconnect = ["--reconnect", "--reconnect-timeout", "60"];
    let mut old = rig.client(&nbdgw_binary(), socket.to_str().unwrap(), false, &reconnect);
    let mut raw = RawLocal::on_unix(&socket);
    raw.write_and_check(1 << 20, 8);
    rig.server.signal("KILL");
    old.wait_for_log("connection to the server lost; reconnecting", 1);
    let next = rig.client(&nbdgw_binary(), socket.to_str().unwrap(), true, &reconnect);
    old.wait_for_log("it is reconnecting to the server", 1);
    old.wait_for_log("shutting down: no longer accepting", 1);
    raw.expect_shutdown_answer();
    wait_exit_ok(&mut old, "reconnecting");
    assert!(
        !next.log().contains("serving a session handed over"),
        "{}",
        next.log()
    );
    let _ = next.stop();
}

/// The raw NBD client on the local Unix socket (plaintext).
struct RawLocal(std::os::unix::net::UnixStream);

impl RawLocal {
    fn on_unix(socket: &Path) -> Self {
        let s = std::os::unix::net::UnixStream::connect(socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut raw = RawLocal(s);
        raw.negotiate();
        raw
    }

    fn read_exact(&mut self, n: usize) -> Vec<u8> {
        use std::io::Read;
        let mut buf = vec![0; n];
        self.0.read_exact(&mut buf).unwrap();
        buf
    }

    /// Fixed newstyle, NBD_OPT_EXPORT_NAME (simple replies).
    fn negotiate(&mut self) {
        let greeting = self.read_exact(18);
        assert_eq!(&greeting[..8], b"NBDMAGIC");
        self.0.write_all(&1u32.to_be_bytes()).unwrap();
        let mut option = b"IHAVEOPT".to_vec();
        option.extend_from_slice(&1u32.to_be_bytes());
        option.extend_from_slice(&0u32.to_be_bytes());
        self.0.write_all(&option).unwrap();
        let export = self.read_exact(10);
        assert_eq!(
            u64::from_be_bytes(export[..8].try_into().unwrap()),
            DISK_LEN as u64
        );
        self.read_exact(124);
    }

    fn request(&mut self, kind: u16, cookie: u64, offset: u64, len: u32) {
        self.try_request(kind, cookie, offset, len).unwrap();
    }

    fn try_request(
        &mut self,
        kind: u16,
        cookie: u64,
        offset: u64,
        len: u32,
    ) -> std::io::Result<()> {
        let mut r = 0x2560_9513u32.to_be_bytes().to_vec();
        r.extend_from_slice(&0u16.to_be_bytes());
        r.extend_from_slice(&kind.to_be_bytes());
        r.extend_from_slice(&cookie.to_be_bytes());
        r.extend_from_slice(&offset.to_be_bytes());
        r.extend_from_slice(&len.to_be_bytes());
        self.0.write_all(&r)
    }

    /// A simple reply's error for `cookie`.
    fn reply(&mut self, cookie: u64) -> u32 {
        let reply = self.read_exact(16);
        assert_eq!(&reply[..4], &0x6744_6698u32.to_be_bytes());
        assert_eq!(u64::from_be_bytes(reply[8..].try_into().unwrap()), cookie);
        u32::from_be_bytes(reply[4..8].try_into().unwrap())
    }

    fn write_and_check(&mut self, offset: u64, seed: u64) {
        let data = pattern(BLOCK, seed);
        self.request(1, 1, offset, BLOCK as u32);
        self.0.write_all(&data).unwrap();
        assert_eq!(self.reply(1), 0);
        self.request(0, 2, offset, BLOCK as u32);
        assert_eq!(self.reply(2), 0);
        assert_eq!(self.read_exact(BLOCK), data);
    }

    /// The next request is refused with ESHUTDOWN (108), or the
    /// connection is closed: the drain, never a served request.
    fn expect_shutdown_answer(&mut self) {
        // A write on a socket the drain closed fails: closed too.
        let _ = self.try_request(0, 3, 0, 512);
        use std::io::Read;
        let mut reply = [0u8; 16];
        match self.0.read_exact(&mut reply) {
            Err(_) => {}
            Ok(()) => assert_eq!(u32::from_be_bytes(reply[4..8].try_into().unwrap()), 108),
        }
    }

    fn expect_closed(&mut self) {
        use std::io::Read;
        if self.try_request(0, 4, 0, 512).is_err() {
            return;
        }
        let mut reply = [0u8; 16];
        assert!(
            self.0.read_exact(&mut reply).is_err(),
            "the session was served on"
        );
    }
}

/// `--after-handover wait` is the server's (a Kubernetes node gateway):
/// client mode refuses it at start rather than ignore it, and a client
/// with `--take-over-missing start` and nobody at the path starts fresh.
#[test]
fn client_mode_refuses_after_handover_wait_and_starts_fresh_when_nobody_is_there() {
    let rig = Rig::new();
    let socket = rig.socket();
    let out = Command::new(nbdgw_binary())
        .arg("client")
        .args(["--listen", socket.to_str().unwrap()])
        .args(["--server", &format!("localhost:{}", rig.server.port)])
        .arg("--tls-dir")
        .arg(rig.env.certs())
        .arg("--handover-socket")
        .arg(rig.handover())
        .args(["--after-handover", "wait"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--after-handover wait is not supported by nbdgw client"),
        "{stderr}"
    );
    let fresh = rig.client(
        &nbdgw_binary(),
        socket.to_str().unwrap(),
        true,
        &["--take-over-missing", "start"],
    );
    let mut local = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    local
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut greeting = [0u8; 18];
    std::io::Read::read_exact(&mut local, &mut greeting).unwrap();
    assert_eq!(
        &greeting[..16],
        b"NBDMAGICIHAVEOPT",
        "the fresh client greets"
    );
    drop(local);
    let (status, log) = fresh.stop();
    assert!(status.success(), "{log}");
}
