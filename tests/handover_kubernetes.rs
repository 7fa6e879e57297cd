//! What a Kubernetes node gateway (a DaemonSet rolled with maxSurge)
//! needs of the hand-over (issue 29, docs/guides/restarts.md): a pod that
//! starts the same way whether or not an older one runs
//! (`--take-over-missing start`), an old gateway that stays, idle, after
//! handing over instead of exiting to be restarted by the kubelet
//! (`--after-handover wait`), and the two in separate pid namespaces.
//! Real qemu-nbd upstream and nbdinfo over TLS.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::clients::{nbdinfo_size, text};
use common::process::{nbdgw_binary, NbdgwProcess};
use common::{Env, QemuNbd};

const IMAGE_LEN: usize = 1 << 20;

struct Node {
    env: Env,
    _upstream: QemuNbd,
    upstream: PathBuf,
    handover: PathBuf,
    port: u16,
}

/// A qemu-nbd upstream and a private directory for the hand-over socket.
fn node() -> Node {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 3);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let dir = env.path("run");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    Node {
        upstream: upstream.socket.clone(),
        _upstream: upstream,
        handover: dir.join("handover.sock"),
        port: common::free_port(),
        env,
    }
}

/// The node gateway's command line: the same for every generation.
/// `wrap`: a command to run it under (unshare), if any.
fn gateway_cmd(n: &Node, wrap: &[&str], extra: &[&str]) -> Command {
    let mut cmd = match wrap.split_first() {
        Some((first, rest)) => {
            let mut cmd = Command::new(first);
            cmd.args(rest).arg(nbdgw_binary());
            cmd
        }
        None => Command::new(nbdgw_binary()),
    };
    cmd.arg("--tls-dir")
        .arg(n.env.certs())
        .arg("--upstream")
        .arg(&n.upstream)
        .arg("--listen")
        .arg(format!("127.0.0.1:{}", n.port))
        .arg("--handover-socket")
        .arg(&n.handover)
        .arg("--take-over")
        .arg(&n.handover)
        .args(["--take-over-missing", "start", "--after-handover", "wait"])
        .args(["--shutdown-grace", "20", "--handover-timeout", "20"])
        .args(extra);
    cmd
}

fn assert_serves(n: &Node, log: &dyn Fn() -> String) {
    let out = nbdinfo_size(n.port, &n.env.certs());
    assert!(out.status.success(), "{}\n{}", text(&out), log());
    let size = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(size, IMAGE_LEN.to_string());
}

/// Listening sockets (TCP and Unix) process `pid` holds, from ss.
fn listening_sockets_of(pid: u32) -> Vec<String> {
    let out = Command::new("ss").args(["-Hltxp"]).output().expect("ss");
    assert!(out.status.success());
    let needle = format!("pid={pid},");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|line| line.contains(&needle) && !line.contains("ESTAB"))
        .filter(|line| line.starts_with("tcp") || line.contains("LISTEN"))
        .map(str::to_string)
        .collect()
}

/// By default --take-over fails the start when no gateway is there; with
/// --take-over-missing start, nothing at the path and a stale socket
/// (nothing listens) start fresh, but a file that is not a socket still
/// fails the start.
#[test]
fn take_over_missing_start_starts_fresh_only_when_no_gateway_is_there() {
    let n = node();
    let strict = common::process::start_must_fail([
        "--tls-dir".as_ref(),
        n.env.certs().as_os_str(),
        "--upstream".as_ref(),
        n.upstream.as_os_str(),
        "--take-over".as_ref(),
        n.handover.as_os_str(),
    ]);
    assert!(strict.contains("--take-over"), "{strict}");
    assert!(strict.contains("No such file"), "{strict}");

    // Nothing there: a fresh start, which makes the hand-over socket.
    let first = NbdgwProcess::spawn(gateway_cmd(&n, &[], &[]), n.port);
    first.wait_for_log("nbdgw listening", 1);
    assert!(first.log().contains("starting fresh"), "{}", first.log());
    assert_serves(&n, &|| first.log());
    // SIGKILL leaves its socket file behind, with nothing listening.
    let mut first = first;
    first.signal("KILL");
    first.wait_exit(Duration::from_secs(30)).expect("killed");
    assert!(n.handover.exists());
    let second = NbdgwProcess::spawn(gateway_cmd(&n, &[], &[]), n.port);
    second.wait_for_log("nbdgw listening", 1);
    let log = second.log();
    assert!(log.contains("starting fresh"), "{log}");
    assert!(log.contains("replacing a stale socket of ours"), "{log}");
    assert_serves(&n, &|| second.log());
    drop(second);

    // A file that is not a socket: connect says ECONNREFUSED there too,
    // and it is not taken for a gateway that is gone.
    std::fs::remove_file(&n.handover).ok();
    std::fs::write(&n.handover, b"keep").unwrap();
    let mut third = NbdgwProcess::spawn(gateway_cmd(&n, &[], &[]), n.port);
    let status = third.wait_exit(Duration::from_secs(30));
    let log = third.log();
    assert!(!status.expect(&log).success(), "{log}");
    assert!(log.contains("Connection refused"), "{log}");
    assert!(!log.contains("starting fresh"), "{log}");
    assert_eq!(std::fs::read(&n.handover).unwrap(), b"keep");
}

/// With --take-over-missing start, a gateway that is there but whose
/// hand-over fails (here a fake predecessor that accepts the connection
/// and closes it at once, as one that dies mid-way) fails the start: no
/// fresh start beside a process that holds the hand-over socket.
#[test]
fn take_over_missing_start_never_starts_fresh_beside_a_gateway_that_is_there() {
    let n = node();
    let fake_predecessor = std::os::unix::net::UnixListener::bind(&n.handover).unwrap();
    let closer = std::thread::spawn(move || {
        let (stream, _) = fake_predecessor.accept().unwrap();
        drop(stream);
    });
    let mut new = NbdgwProcess::spawn(gateway_cmd(&n, &[], &[]), n.port);
    let status = new.wait_exit(Duration::from_secs(60));
    let log = new.log();
    assert!(!status.expect(&log).success(), "{log}");
    assert!(log.contains("--take-over"), "{log}");
    assert!(!log.contains("starting fresh"), "{log}");
    assert!(!log.contains("nbdgw listening"), "{log}");
    closer.join().unwrap();
}

/// A hand-over socket whose listen queue is full (a FAKE predecessor that
/// listens with a backlog of 0 and accepts nobody, its one slot taken):
/// Linux makes a blocking connect wait there for ever. The new gateway
/// waits at most --handover-queue-timeout, then fails its start saying
/// why; it never starts fresh beside the gateway that is there.
#[test]
fn a_full_hand_over_queue_fails_the_start_at_the_queue_timeout() {
    let n = node();
    let fake = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None).unwrap();
    fake.bind(&socket2::SockAddr::unix(&n.handover).unwrap())
        .unwrap();
    fake.listen(0).unwrap();
    // Backlog 0 holds one connection not accepted; the next one waits.
    let _first = std::os::unix::net::UnixStream::connect(&n.handover).unwrap();
    let cmd = gateway_cmd(&n, &[], &["--handover-queue-timeout", "2"]);
    let mut new = NbdgwProcess::spawn(cmd, n.port);
    let status = new.wait_exit(Duration::from_secs(30));
    let log = new.log();
    let Some(status) = status else {
        new.signal("KILL");
        panic!("still connecting after 30 s:\n{log}");
    };
    assert!(!status.success(), "{log}");
    assert!(log.contains("listen queue stayed full for 2 s"), "{log}");
    assert!(!log.contains("starting fresh"), "{log}");
    drop(fake);
}

/// --after-handover wait: the old gateway hands over, then stays alive,
/// holding no listening socket, until SIGTERM, at which it exits 0; the
/// successor serves on.
#[test]
fn after_handover_wait_stays_idle_until_sigterm_then_exits_0() {
    let n = node();
    let mut old = NbdgwProcess::spawn(gateway_cmd(&n, &[], &[]), n.port);
    old.wait_for_log("nbdgw listening", 1);
    let new = NbdgwProcess::spawn(gateway_cmd(&n, &[], &[]), n.port);
    new.wait_for_log("take-over: serving", 1);
    old.wait_for_log("idle, listening on nothing", 1);
    assert!(old.is_running(), "{}", old.log());
    assert_eq!(listening_sockets_of(old.pid()), Vec::<String>::new());
    assert!(!listening_sockets_of(new.pid()).is_empty());
    assert_serves(&n, &|| new.log());
    old.signal("TERM");
    let status = old.wait_exit(Duration::from_secs(10));
    let log = old.log();
    assert!(status.expect(&log).success(), "{log}");
    assert!(
        log.contains("SIGTERM received after the hand-over"),
        "{log}"
    );
    assert_serves(&n, &|| new.log());
}

/// The process a `unshare --pid --fork` runs: its only child.
fn child_of(wrapper: u32) -> u32 {
    let path = format!("/proc/{wrapper}/task/{wrapper}/children");
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let children = std::fs::read_to_string(&path).unwrap_or_default();
        if let Some(pid) = children.split_whitespace().next() {
            return pid.parse().unwrap();
        }
        assert!(std::time::Instant::now() < deadline, "no child in {path}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Two pods' containers: each gateway in its own pid namespace (pid 1
/// there), neither visible to the other by pid. Each watches the other
/// by a pidfd (SO_PEERPIDFD; the one sent with Chosen), so the hand-over
/// and its death checks work as on one host.
#[test]
fn a_take_over_across_pid_namespaces_watches_each_peer() {
    if !is_root() {
        eprintln!("skipped: unshare --pid needs root (CI runs as root)");
        return;
    }
    let n = node();
    let wrap = ["unshare", "--pid", "--fork", "--kill-child"];
    let mut old = NbdgwProcess::spawn(gateway_cmd(&n, &wrap, &[]), n.port);
    old.wait_for_log("nbdgw listening", 1);
    let new = NbdgwProcess::spawn(gateway_cmd(&n, &wrap, &[]), n.port);
    new.wait_for_log("take-over: serving", 1);
    let log = new.log();
    assert!(log.contains("watched=true"), "{log}");
    old.wait_for_log("idle, listening on nothing", 1);
    let log = old.log();
    assert!(
        log.contains("pid=1"),
        "the successor is pid 1 in its namespace: {log}"
    );
    assert!(!log.contains("cannot be watched"), "{log}");
    assert_serves(&n, &|| new.log());
    // SIGTERM to the gateway itself (pid 1 of its namespace, which
    // handles it), the wrapper exits with its status.
    let gateway = child_of(old.pid());
    let killed = Command::new("kill")
        .arg("-TERM")
        .arg(gateway.to_string())
        .status();
    assert!(killed.is_ok_and(|s| s.success()));
    let status = old.wait_exit(Duration::from_secs(10));
    let log = old.log();
    assert!(status.expect(&log).success(), "{log}");
    assert_serves(&n, &|| new.log());
}
