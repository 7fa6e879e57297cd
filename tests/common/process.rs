//! The nbdgw binary as operators run it, with its log collected while it
//! runs; and a counting relay in front of the upstream socket.

use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Read};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub struct NbdgwProcess {
    child: Child,
    pub port: u16,
    log: Arc<Mutex<String>>,
}

impl NbdgwProcess {
    /// Starts `nbdgw ARGS --listen 127.0.0.1:PORT` and waits until it listens.
    pub fn start<I, S>(args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        Self::start_with(args, &[])
    }

    /// nbdgw with the test's certificates (`Env::certs`, whose CA makes
    /// client certificates required) in front of one upstream socket,
    /// and flags.
    #[allow(dead_code)]
    pub fn in_front_of(env: &super::Env, upstream: &Path, extra: &[&str]) -> Self {
        Self::in_front_of_certs(&env.certs(), upstream, extra)
    }

    /// As [`Self::in_front_of`], with the certificate directory `certs`.
    #[allow(dead_code)]
    pub fn in_front_of_certs(certs: &Path, upstream: &Path, extra: &[&str]) -> Self {
        Self::start(front_args(certs, upstream, extra))
    }

    /// As [`Self::in_front_of`], on a port of the test's choosing, so that
    /// a restart comes back where clients reconnect to (see
    /// [`Self::start_at`]).
    #[allow(dead_code)]
    pub fn in_front_of_at(env: &super::Env, upstream: &Path, port: u16, extra: &[&str]) -> Self {
        Self::start_at(front_args(&env.certs(), upstream, extra), port)
    }

    /// nbdgw with only the test's server certificate and key (no client
    /// CA: no client certificate asked for), and `args`.
    #[allow(dead_code)]
    pub fn with_server_cert<I, S>(env: &super::Env, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let certs = env.certs();
        let mut all: Vec<OsString> = vec![
            "--tls-cert".into(),
            certs.join("server-cert.pem").into(),
            "--tls-key".into(),
            certs.join("server-key.pem").into(),
        ];
        all.extend(args.into_iter().map(|a| a.as_ref().to_os_string()));
        Self::start(all)
    }

    /// Starts `nbdgw ARGS --listen 127.0.0.1:PORT` on a port of the
    /// test's choosing and waits for its log to say it listens. It never
    /// connects to see (as `start` does): on a port a restarted gateway
    /// comes back to, a probe would be one more connection in its counts.
    #[allow(dead_code)]
    pub fn start_at<I, S>(args: I, port: u16) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = Command::new(nbdgw_binary());
        cmd.args(args)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"));
        let process = Self::spawn(cmd, port);
        process.wait_for_log("nbdgw listening", 1);
        process
    }

    /// As [`Self::start_at`], under `prlimit --nofile=NOFILE:NOFILE`: a
    /// descriptor limit of the test's choosing.
    #[allow(dead_code)]
    pub fn start_at_with_nofile<I, S>(nofile: u32, args: I, port: u16) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = Command::new("prlimit");
        cmd.arg(format!("--nofile={nofile}:{nofile}"))
            .arg(nbdgw_binary())
            .args(args)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"));
        let process = Self::spawn(cmd, port);
        process.wait_for_log("nbdgw listening", 1);
        process
    }

    pub fn start_with<I, S>(args: I, env: &[(&str, &OsStr)]) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let port = super::free_port();
        let mut cmd = Command::new(nbdgw_binary());
        cmd.args(args)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut process = Self::spawn(cmd, port);
        let child = &mut process.child;
        let started = super::wait_until_listening(port, "nbdgw", || {
            child.try_wait().ok().flatten().map(|s| s.to_string())
        });
        if let Err(e) = started {
            panic!("{e}:\n{}", process.log());
        }
        // Everything logged at start-up is in the collected log before a
        // test looks at it.
        process.wait_for_log("nbdgw listening", 1);
        process
    }

    /// Starts `nbdgw client --listen LISTEN ARGS` and waits until it
    /// listens (its log says so); `port` is 0 for a Unix socket.
    #[allow(dead_code)]
    pub fn client<I, S>(listen: &OsStr, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = Command::new(nbdgw_binary());
        cmd.arg("client").arg("--listen").arg(listen).args(args);
        let port = listen
            .to_str()
            .and_then(|s| s.parse::<std::net::SocketAddr>().ok())
            .map_or(0, |a| a.port());
        let mut process = Self::spawn(cmd, port);
        let deadline = Instant::now() + Duration::from_secs(15);
        while process.count_in_log("nbdgw client listening") == 0 {
            if let Some(status) = process.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(100));
                panic!("nbdgw client exited ({status}):\n{}", process.log());
            }
            assert!(
                Instant::now() < deadline,
                "nbdgw client did not start:\n{}",
                process.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        process
    }

    /// `nbdgw client` on `listen` (a Unix socket's path, or HOST:PORT)
    /// towards `server` (HOST:PORT) with the certificate directory
    /// `tls_dir` (libnbd/qemu layout), and flags; waits until it listens.
    #[allow(dead_code)]
    pub fn client_of(listen: &OsStr, server: &str, tls_dir: &Path, extra: &[&str]) -> Self {
        let mut args = vec![
            OsStr::new("--server"),
            OsStr::new(server),
            OsStr::new("--tls-dir"),
            tls_dir.as_os_str(),
        ];
        args.extend(extra.iter().map(OsStr::new));
        Self::client(listen, args)
    }

    /// As [`Self::client_of`], on a free loopback port: it, and its port.
    #[allow(dead_code)]
    pub fn client_on_loopback(server: &str, tls_dir: &Path, extra: &[&str]) -> (Self, u16) {
        let port = super::free_port();
        let listen = format!("127.0.0.1:{port}");
        let client = Self::client_of(OsStr::new(&listen), server, tls_dir, extra);
        (client, port)
    }

    /// Runs `cmd` (nbdgw, or a wrapper such as `ip netns exec … nbdgw`)
    /// with its log collected; does not wait for it to listen.
    pub fn spawn(mut cmd: Command, port: u16) -> Self {
        cmd.env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn nbdgw");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        NbdgwProcess { child, port, log }
    }

    /// The process's id, for /proc and for signals of a test's own.
    #[allow(dead_code)]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Descriptors the process holds now.
    #[allow(dead_code)]
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .map(|dir| dir.count())
            .unwrap_or(0)
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        ([127, 0, 0, 1], self.port).into()
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    pub fn count_in_log(&self, needle: &str) -> usize {
        self.log().matches(needle).count()
    }

    /// Waits until `needle` has appeared `count` times in the log.
    pub fn wait_for_log(&self, needle: &str, count: usize) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.count_in_log(needle) < count {
            assert!(
                Instant::now() < deadline,
                "log never showed {needle:?} {count} times:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success());
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// The exit status, if the process ends within `within`.
    pub fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // The reader thread ends at EOF; give it a moment.
                std::thread::sleep(Duration::from_millis(100));
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then the exit status and the whole log.
    pub fn stop(mut self) -> (ExitStatus, String) {
        self.signal("TERM");
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "nbdgw did not exit after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        // The reader thread ends at EOF; give it a moment to take the rest.
        std::thread::sleep(Duration::from_millis(100));
        (status, self.log())
    }
}

/// The flags that put nbdgw with the certificate directory `certs` in
/// front of the upstream socket `upstream`, then `extra`.
pub fn front_args(certs: &Path, upstream: &Path, extra: &[&str]) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec![
        "--tls-dir".into(),
        certs.into(),
        "--upstream".into(),
        upstream.into(),
    ];
    args.extend(extra.iter().map(OsString::from));
    args
}

/// Runs `nbdgw ARGS`, which must fail to start; returns what it said.
pub fn start_must_fail<I, S>(args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut child = Command::new(nbdgw_binary())
        .args(args)
        .arg("--listen")
        .arg("127.0.0.1:0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn nbdgw");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("nbdgw started although it should have refused to");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(!status.success(), "nbdgw exited 0: {stderr}");
    stderr
}

impl Drop for NbdgwProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A Unix-socket relay in front of the real upstream that counts the
/// connections nbdgw opens to it, and can hold the upstream's replies
/// back (a slow disk, as far as nbdgw can tell).
pub struct UpstreamCounter {
    pub socket: PathBuf,
    accepted: Arc<AtomicUsize>,
    reads: Arc<AtomicUsize>,
    hold: Arc<(Mutex<bool>, Condvar)>,
}

/// Counts NBD_CMD_READ request headers in a byte stream towards the
/// upstream: a request magic (compact or extended) followed by flags and
/// the READ command. Option data in negotiation holds no such magic, and
/// the read-only streams the tests send hold only headers after it.
#[derive(Default)]
struct ReadScanner {
    tail: Vec<u8>,
}

impl ReadScanner {
    const MAGICS: [[u8; 4]; 2] = [[0x25, 0x60, 0x95, 0x13], [0x21, 0xe4, 0x1c, 0x71]];

    fn scan(&mut self, bytes: &[u8]) -> usize {
        let carried = self.tail.len();
        let mut all = std::mem::take(&mut self.tail);
        all.extend_from_slice(bytes);
        let mut found = 0;
        for at in 0..all.len().saturating_sub(7) {
            // A header that ends in the new bytes, so none is counted twice.
            if at + 8 > carried
                && Self::MAGICS.iter().any(|m| all[at..at + 4] == *m)
                && all[at + 6..at + 8] == [0, 0]
            {
                found += 1;
            }
        }
        let keep = all.len().min(7);
        self.tail = all[all.len() - keep..].to_vec();
        found
    }
}

impl UpstreamCounter {
    pub fn start(target: &Path, socket: &Path) -> Self {
        let listener = UnixListener::bind(socket).unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        let reads = Arc::new(AtomicUsize::new(0));
        let read_count = reads.clone();
        let hold = Arc::new((Mutex::new(false), Condvar::new()));
        let gate = hold.clone();
        let target = target.to_owned();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { break };
                count.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = UnixStream::connect(&target) else {
                    continue;
                };
                let (c_rd, s_wr) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let read_count = read_count.clone();
                std::thread::spawn(move || {
                    let mut scanner = ReadScanner::default();
                    super::pipe(c_rd, &s_wr, |bytes| {
                        read_count.fetch_add(scanner.scan(bytes), Ordering::SeqCst);
                    });
                    let _ = s_wr.shutdown(std::net::Shutdown::Write);
                });
                let gate = gate.clone();
                std::thread::spawn(move || {
                    super::pipe(server, &client, |_| {
                        let (held, resumed) = &*gate;
                        let _open = resumed
                            .wait_while(held.lock().unwrap(), |held| *held)
                            .unwrap();
                    });
                    let _ = client.shutdown(std::net::Shutdown::Write);
                });
            }
        });
        UpstreamCounter {
            socket: socket.to_owned(),
            accepted,
            reads,
            hold,
        }
    }

    /// Holds back (or lets go) every upstream reply not yet relayed.
    pub fn hold_replies(&self, held: bool) {
        let (flag, resumed) = &*self.hold;
        *flag.lock().unwrap() = held;
        resumed.notify_all();
    }

    pub fn connections(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// NBD_CMD_READ requests relayed to the upstream so far (see
    /// `ReadScanner`).
    #[allow(dead_code)]
    pub fn reads(&self) -> usize {
        self.reads.load(Ordering::SeqCst)
    }
}

/// The binary under test: this build's, or `NBDGW_UNDER_TEST` when set, so
/// that a security test can be shown to fail on the code before its fix
/// (build that commit, point the variable at its binary, run the test).
pub fn nbdgw_binary() -> String {
    std::env::var("NBDGW_UNDER_TEST").unwrap_or_else(|_| env!("CARGO_BIN_EXE_nbdgw").to_string())
}
