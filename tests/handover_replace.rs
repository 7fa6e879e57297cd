//! Issue 29's acceptance test: nbdgw replaced N times in a row
//! (`NBDGW_REPLACEMENTS`, default 20) under clients that hold one
//! connection each across every replacement and never pause, alternating
//! two builds: the binary under test (`NBDGW_UNDER_TEST` or this build's)
//! and `NBDGW_HANDOVER_OTHER` (default: the same binary; scripts/test.sh
//! gives CI a genuinely different build of the same source, nbdgw
//! compiled at another opt-level). Real qemu-nbd upstreams on Unix
//! sockets; real clients: python3-libnbd doing verified writes and
//! reads, qemu-io with tls-creds-x509 and no reconnect-delay running
//! write -P / read -P triples, and nbdcopy from a file into an export and
//! from an export to a file, both compared with cmp. For TLS 1.3 and for
//! TLS 1.2 (the clients' GnuTLS limited to 1.2 by a system priority
//! file's `[overrides]`, as kernel_nbd.rs does; nbdgw has no maximum
//! version flag).
//!
//! What has to be true of the session hand-over for this to pass:
//! - every established session moves to the successor: the client's TCP
//!   descriptor, its TLS state (traffic secrets and record sequence
//!   numbers of both directions, for 1.3 and 1.2), the upstream
//!   descriptor and the negotiated NBD state, with no new handshake on
//!   either side (no "TLS established" line, no nbdgw_tls_sessions_total
//!   in any successor);
//! - a session is quiesced at a request boundary with its requests in
//!   flight answered (or carried over), so that none of a client's
//!   requests fails or goes unanswered, and bytes already read (a
//!   partial record, a partial request: these clients pipeline) are
//!   carried over;
//! - the predecessor exits 0 once its sessions are handed over, within
//!   --shutdown-grace, and both builds agree on the state format;
//! - no byte is lost, reordered or duplicated across a replacement (each
//!   read is compared with what was last acknowledged at that offset).
//!
//! On branch i29 before the session hand-over (listening sockets only)
//! these tests fail: the predecessor drains, so each client's first
//! request after the hand-over is not answered and its connection closes
//! (libnbd and nbdcopy: ENOTCONN; qemu-io: Input/output error, then it
//! reconnects on its own and its reads fail their patterns).
//! `NBDGW_REPLACEMENTS=0` runs the harness on one gateway.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::process::{nbdgw_binary, NbdgwProcess};
use common::{Env, QemuNbd};

/// The disk python3-libnbd (first half) and qemu-io (second half) write.
const DISK_LEN: usize = 16 << 20;
/// The file nbdcopy copies in, and the export it copies out.
const COPY_LEN: usize = 16 << 20;
/// What each nbdcopy may move per replacement (the rest after the last):
/// both are in flight from before the first replacement to after the last.
const COPY_STEP: usize = 512 << 10;
const BLOCK: usize = 64 << 10;
/// Each client's progress on a gateway before it is replaced, so every
/// hand-over finds them busy and each has gone on after the previous one.
const PROGRESS_PER_ROUND: usize = 8;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Tls {
    V13,
    V12,
}

impl Tls {
    /// What the gateway logs for a session of this version.
    fn logged(self) -> &'static str {
        match self {
            Tls::V13 => "tls_version=Some(TLSv1_3)",
            Tls::V12 => "tls_version=Some(TLSv1_2)",
        }
    }
}

#[test]
fn sessions_survive_replacements_alternating_builds_tls13() {
    replaced_in_a_row(Tls::V13);
}

#[test]
fn sessions_survive_replacements_alternating_builds_tls12() {
    replaced_in_a_row(Tls::V12);
}

fn replacements() -> usize {
    std::env::var("NBDGW_REPLACEMENTS")
        .ok()
        .map(|n| n.parse().expect("NBDGW_REPLACEMENTS: a number"))
        .unwrap_or(20)
}

/// The second build replacements alternate with.
fn other_binary() -> String {
    std::env::var("NBDGW_HANDOVER_OTHER").unwrap_or_else(|_| nbdgw_binary())
}

/// The test's processes: three upstreams (disk, the export nbdcopy
/// writes, the export it reads) and the gateway's shared addresses.
struct Rig {
    env: Env,
    disk: QemuNbd,
    copy_in: QemuNbd,
    _copy_out: QemuNbd,
    /// The file nbdcopy copies in, and the image it copies out.
    source: PathBuf,
    out_image: PathBuf,
    port: u16,
    admin: u16,
    handover: PathBuf,
    /// A GnuTLS system priority file for TLS 1.2, or none.
    priority: Option<PathBuf>,
}

impl Rig {
    fn new(tls: Tls) -> Self {
        let env = Env::new();
        let disk_img = env.filled_image("disk.img", 0, DISK_LEN);
        let in_img = env.filled_image("in.img", 0, COPY_LEN);
        let out_image = env.random_image("out.img", COPY_LEN, 29);
        let source = env.random_image("source.bin", COPY_LEN, 1029);
        let disk = QemuNbd::start_at(env.path("disk.sock"), &disk_img, &[]);
        let copy_in = QemuNbd::start_at(env.path("in.sock"), &in_img, &[]);
        let copy_out = QemuNbd::start_at(env.path("out.sock"), &out_image, &[]);
        let run = env.path("run");
        std::fs::create_dir(&run).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)).unwrap();
        let priority = (tls == Tls::V12).then(|| {
            let file = env.path("gnutls-tls12.conf");
            std::fs::write(&file, "[overrides]\ndisabled-version = tls1.3\n").unwrap();
            file
        });
        Rig {
            disk,
            copy_in,
            _copy_out: copy_out,
            source,
            out_image,
            port: common::free_port(),
            admin: common::free_port(),
            handover: run.join("handover.sock"),
            priority,
            env,
        }
    }

    /// One generation of the gateway: `binary` on the shared port, admin
    /// port and hand-over socket, taking over from the running one if
    /// `take_over`.
    fn generation(&self, binary: &str, take_over: bool) -> NbdgwProcess {
        let mut cmd = Command::new(binary);
        cmd.arg("--tls-dir").arg(self.env.certs());
        for (name, upstream) in [
            ("disk", "disk.sock"),
            ("in", "in.sock"),
            ("out", "out.sock"),
        ] {
            let path = self.env.path(upstream);
            cmd.arg("--export")
                .arg(format!("{name}={}", path.display()));
        }
        cmd.arg("--listen")
            .arg(format!("127.0.0.1:{}", self.port))
            .arg("--admin-listen")
            .arg(format!("127.0.0.1:{}", self.admin))
            .arg("--handover-socket")
            .arg(&self.handover)
            .args(["--shutdown-grace", "30", "--handover-timeout", "30"]);
        if take_over {
            cmd.arg("--take-over").arg(&self.handover);
        }
        let process = NbdgwProcess::spawn(cmd, self.port);
        process.wait_for_log("nbdgw listening", 1);
        process
    }

    fn uri(&self, export: &str) -> String {
        format!(
            "nbds://localhost:{}/{export}?tls-certificates={}",
            self.port,
            self.env.certs().display()
        )
    }

    /// A client command, with the TLS 1.2 priority file if any.
    fn client(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        if let Some(file) = &self.priority {
            cmd.env("GNUTLS_SYSTEM_PRIORITY_FILE", file);
        }
        cmd
    }
}

/// What a client printed so far: its progress count, and anything that
/// says it failed.
#[derive(Default)]
struct Seen {
    progress: usize,
    /// The first errors (enough to tell what failed), and how many.
    errors: Vec<String>,
    error_count: usize,
    outputs_closed: usize,
}

impl Seen {
    fn error(&mut self, line: String) {
        self.error_count += 1;
        if self.errors.len() < 6 {
            self.errors.push(line);
        }
    }
}

/// How a client's output line counts.
#[derive(Clone, Copy)]
enum Line {
    Progress,
    Error,
    Other,
}

/// A real client process whose stdout and stderr are read as they come.
struct Watched {
    name: &'static str,
    child: Child,
    seen: Arc<Mutex<Seen>>,
    streams: usize,
}

impl Watched {
    fn spawn(name: &'static str, cmd: &mut Command, classify: fn(&str, bool) -> Line) -> Self {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stdout: Box<dyn Read + Send> = Box::new(child.stdout.take().unwrap());
        let stderr: Box<dyn Read + Send> = Box::new(child.stderr.take().unwrap());
        for (stream, is_err) in [(stdout, false), (stderr, true)] {
            let seen = seen.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    let mut seen = seen.lock().unwrap();
                    match classify(&line, is_err) {
                        Line::Progress => seen.progress += 1,
                        Line::Error => seen.error(line),
                        Line::Other => {}
                    }
                }
                seen.lock().unwrap().outputs_closed += 1;
            });
        }
        Watched {
            name,
            child,
            seen,
            streams: 2,
        }
    }

    fn progress(&self) -> usize {
        self.seen.lock().unwrap().progress
    }

    /// Panics with what the client said if it reported an error or ended.
    fn assert_alive(&self, when: &str) {
        let seen = self.seen.lock().unwrap();
        assert!(
            seen.errors.is_empty() && seen.outputs_closed < self.streams,
            "{when}: {} failed or ended: {:?}",
            self.name,
            seen.errors
        );
    }

    /// Waits until the client has made `more` progress beyond `from`.
    fn wait_progress(&self, from: usize, more: usize, when: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.progress() < from + more {
            self.assert_alive(when);
            assert!(
                Instant::now() < deadline,
                "{when}: {} made no progress for 60 s",
                self.name
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the process to end (its stdin closed by the caller):
    /// its status and the errors it printed.
    fn finish(mut self) -> (std::process::ExitStatus, Vec<String>) {
        let deadline = Instant::now() + Duration::from_secs(120);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "{} did not end", self.name);
            std::thread::sleep(Duration::from_millis(50));
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.seen.lock().unwrap().outputs_closed < self.streams && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let errors = std::mem::take(&mut self.seen.lock().unwrap().errors);
        (status, errors)
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// python3-libnbd on ONE handle: for each 64 KiB block of its region in
/// turn, reads it and compares it with the generation it last wrote
/// there (zeros at first), writes the next generation's pattern (offset
/// and generation), reads it back and compares. Never pauses; on any
/// error it prints it and exits 1 (a libnbd handle never reconnects).
/// At the end it reads its whole region back.
const LIBNBD_CLIENT: &str = r#"
import nbd, struct, sys, threading
uri, start, length, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
h = nbd.NBD()
h.set_uri_allow_local_file(True)
h.set_tls(nbd.TLS_REQUIRE)
h.connect_uri(uri)
def pattern(off, gen):
    return struct.pack(">QQ", off, gen) * (block // 16) if gen else bytes(block)
gens = [0] * (length // block)
ops = 0
try:
    while not stop.is_set():
        b = ops % len(gens)
        off = start + b * block
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
        if h.pread(block, start + b * block) != pattern(start + b * block, gen):
            print("error mismatch at the end at", start + b * block, "generation", gen, flush=True)
            sys.exit(1)
    h.shutdown()
except nbd.Error as e:
    print("error after", ops, "operations:", e, flush=True)
    sys.exit(1)
print("done", ops, flush=True)
"#;

fn libnbd_line(line: &str, is_err: bool) -> Line {
    if is_err || line.starts_with("error") {
        Line::Error
    } else if line.starts_with("ok ") {
        Line::Progress
    } else {
        Line::Other
    }
}

fn start_libnbd(rig: &Rig) -> Watched {
    let mut cmd = rig.client("/usr/bin/python3");
    cmd.arg("-c")
        .arg(LIBNBD_CLIENT)
        .arg(rig.uri("disk"))
        .arg("0")
        .arg((DISK_LEN / 2).to_string())
        .arg(BLOCK.to_string());
    Watched::spawn("python3-libnbd", &mut cmd, libnbd_line)
}

/// qemu-io's byte pattern for `block` in `round` (0: the zeros the disk
/// starts with); consecutive rounds differ.
fn qemu_io_pattern(block: usize, round: Option<usize>) -> usize {
    round.map_or(0, |r| 1 + (block * 7 + r * 13) % 255)
}

/// The commands qemu-io runs for its `k`th block: read -P the previous
/// round's pattern, write -P this round's, read -P it back.
fn qemu_io_commands(k: usize) -> String {
    let blocks = DISK_LEN / 2 / BLOCK;
    let (block, round) = (k % blocks, k / blocks);
    let offset = DISK_LEN / 2 + block * BLOCK;
    let before = qemu_io_pattern(block, round.checked_sub(1));
    let now = qemu_io_pattern(block, Some(round));
    format!(
        "read -P {before} {offset} {BLOCK}\nwrite -P {now} {offset} {BLOCK}\nread -P {now} {offset} {BLOCK}\n"
    )
}

fn qemu_io_line(line: &str, is_err: bool) -> Line {
    let lower = line.to_ascii_lowercase();
    if is_err || lower.contains("fail") || lower.contains("error") {
        Line::Error
    } else if line.contains(&format!("read {BLOCK}/{BLOCK} bytes")) {
        Line::Progress
    } else {
        Line::Other
    }
}

/// qemu-io's script as fed: until `stop`, and how many blocks' commands
/// went in (it runs them all before it exits at the end of its input).
#[derive(Default)]
struct Feed {
    stop: AtomicBool,
    fed: AtomicUsize,
}

impl Feed {
    /// The second half of the disk as qemu-io's last write to each block
    /// left it.
    fn expected(&self) -> Vec<u8> {
        let (blocks, fed) = (DISK_LEN / 2 / BLOCK, self.fed.load(Ordering::SeqCst));
        let mut half = Vec::with_capacity(DISK_LEN / 2);
        for block in 0..blocks {
            let writes = fed / blocks + usize::from(block < fed % blocks);
            let byte = qemu_io_pattern(block, writes.checked_sub(1));
            half.resize(half.len() + BLOCK, byte as u8);
        }
        half
    }
}

/// Blocks' commands qemu-io may have queued beyond those seen run: more
/// than its stdout (a pipe, so buffered by 4 KiB, ~300 bytes a block)
/// holds back, or the feeder would wait for output qemu-io keeps.
const QEMU_IO_AHEAD: usize = 128;

/// qemu-io over TLS (tls-creds-x509, no reconnect-delay: its default,
/// 0, fails a request at once when the connection is lost), fed its
/// script on stdin as fast as it takes it until told to stop.
fn start_qemu_io(rig: &Rig, feed: Arc<Feed>) -> Watched {
    let [_, object, _, _] = common::clients::qemu_tls_args("localhost", rig.port, &rig.env.certs());
    let opts = format!(
        "driver=nbd,host=localhost,port={},export=disk,tls-creds=tls0",
        rig.port
    );
    let mut cmd = rig.client("qemu-io");
    cmd.args(["--object", &object, "--image-opts", &opts]);
    let mut watched = Watched::spawn("qemu-io", &mut cmd, qemu_io_line);
    let mut stdin = watched.child.stdin.take().unwrap();
    let seen = watched.seen.clone();
    std::thread::spawn(move || {
        let mut k = 0;
        while !feed.stop.load(Ordering::SeqCst) {
            // At most QEMU_IO_AHEAD blocks' commands ahead of what it
            // has done (two reads each): a full pipe of them would take
            // minutes to run at the end under TCG (the test VM).
            if k >= QEMU_IO_AHEAD + seen.lock().unwrap().progress / 2 {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            if stdin.write_all(qemu_io_commands(k).as_bytes()).is_err() {
                return;
            }
            k += 1;
            feed.fed.store(k, Ordering::SeqCst);
        }
        // qemu-io runs what it has and exits at the end of its input.
    });
    watched
}

fn nbdcopy_line(_: &str, is_err: bool) -> Line {
    if is_err {
        Line::Error
    } else {
        Line::Other
    }
}

/// nbdcopy from the source file (through a pipe) into the export "in",
/// `COPY_STEP` bytes per permit, the rest once the permits end.
fn start_copy_in(rig: &Rig, permits: Receiver<()>) -> Watched {
    let mut cmd = rig.client("nbdcopy");
    cmd.args(["--connections=1", "--", "-"]).arg(rig.uri("in"));
    let mut watched = Watched::spawn("nbdcopy (file to export)", &mut cmd, nbdcopy_line);
    let mut stdin = watched.child.stdin.take().unwrap();
    let data = std::fs::read(&rig.source).unwrap();
    std::thread::spawn(move || {
        let mut chunks = data.chunks(COPY_STEP);
        while permits.recv().is_ok() {
            if let Some(chunk) = chunks.next() {
                let _ = stdin.write_all(chunk);
            }
        }
        for chunk in chunks {
            let _ = stdin.write_all(chunk);
        }
    });
    watched
}

/// nbdcopy from the export "out" to its stdout, read `COPY_STEP` bytes
/// per permit (a pipe holds it back meanwhile) into `dest`.
fn start_copy_out(rig: &Rig, permits: Receiver<()>, dest: PathBuf) -> Watched {
    let mut cmd = rig.client("nbdcopy");
    cmd.args(["--connections=1", "--"])
        .arg(rig.uri("out"))
        .arg("-");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("nbdcopy");
    let mut stdout = child.stdout.take().unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let sink = seen.clone();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            sink.lock().unwrap().error(line);
        }
        sink.lock().unwrap().outputs_closed += 1;
    });
    let sink = seen.clone();
    std::thread::spawn(move || {
        let mut file = std::fs::File::create(dest).unwrap();
        let mut buf = vec![0u8; COPY_STEP];
        while permits.recv().is_ok() {
            if stdout.read_exact(&mut buf).is_ok() {
                file.write_all(&buf).unwrap();
            }
        }
        std::io::copy(&mut stdout, &mut file).unwrap();
        sink.lock().unwrap().outputs_closed += 1;
    });
    Watched {
        name: "nbdcopy (export to file)",
        child,
        seen,
        streams: 2,
    }
}

/// Panics with every client's errors if any reported one or ended.
fn assert_all_alive(clients: &[Watched], when: &str) {
    let failed: Vec<String> = clients
        .iter()
        .filter_map(|c| {
            let seen = c.seen.lock().unwrap();
            let ended = seen.outputs_closed >= c.streams;
            (ended || seen.error_count > 0).then(|| {
                let (n, first) = (seen.error_count, &seen.errors);
                format!(
                    "{} (ended: {ended}): {n} errors, the first {first:?}",
                    c.name
                )
            })
        })
        .collect();
    assert!(failed.is_empty(), "{when}: {failed:#?}");
}

/// Replaces `old` by a generation of `binary` and checks the old one
/// exits 0; the new one.
fn replace(rig: &Rig, old: &mut NbdgwProcess, binary: &str, round: usize) -> NbdgwProcess {
    let new = rig.generation(binary, true);
    new.wait_for_log("take-over: serving", 1);
    let status = old.wait_exit(Duration::from_secs(90));
    let log = old.log();
    let status =
        status.unwrap_or_else(|| panic!("round {round}: the old gateway still runs:\n{log}"));
    assert!(
        status.success(),
        "round {round}: old gateway {status}:\n{log}"
    );
    new
}

/// Where the kernel takes TLS 1.3 sessions (kernel TLS that re-keys, as
/// in `KTLS_VM_KERNEL=new scripts/ktls-vm.sh handover_replace`), the
/// first generation hands its `n` sessions to the kernel (each right
/// after its handshake), and every generation hands them over there:
/// true, once they are. TLS 1.2 stays in rustls anyway.
fn handed_to_the_kernel(tls: Tls, gateway: &NbdgwProcess, n: usize) -> bool {
    let here = tls == Tls::V13 && nbdgw::tls::kernel::probe().is_ok();
    eprintln!(
        "{tls:?}: the sessions are in {}",
        if here { "the kernel (kTLS)" } else { "rustls" }
    );
    if here {
        gateway.wait_for_log("TLS handed to the kernel (kTLS)", n);
    }
    here
}

/// Where the sessions are in the kernel (`in_kernel`), waits until
/// `gateway` (a successor, unless there were no replacements) serves
/// the `n` handed over, in the kernel.
fn served_in_the_kernel(gateway: &NbdgwProcess, n: usize, in_kernel: bool) {
    if !in_kernel || replacements() == 0 {
        return;
    }
    let served = |log: String| {
        let kernel = |l: &&str| l.contains("serving a session handed over") && l.contains("kernel");
        log.lines().filter(kernel).count()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while served(gateway.log()) < n {
        assert!(
            Instant::now() < deadline,
            "not in the kernel:\n{}",
            gateway.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// TLS sessions a generation established (its log's "TLS established").
fn handshakes(gateway: &NbdgwProcess) -> Vec<String> {
    gateway
        .log()
        .lines()
        .filter(|l| l.contains("TLS established"))
        .map(String::from)
        .collect()
}

fn replaced_in_a_row(tls: Tls) {
    let rig = Rig::new(tls);
    let (under_test, other) = (nbdgw_binary(), other_binary());
    eprintln!(
        "{tls:?}: {} replacements alternating {under_test} and {other}{}",
        replacements(),
        if under_test == other {
            " (the same binary: set NBDGW_HANDOVER_OTHER)"
        } else {
            ""
        }
    );
    let mut gateway = rig.generation(&under_test, false);
    let feed = Arc::new(Feed::default());
    let (in_tx, in_rx) = channel();
    let (out_tx, out_rx) = channel();
    let copied_out = rig.env.path("copied-out.bin");
    let clients = [
        start_libnbd(&rig),
        start_qemu_io(&rig, feed.clone()),
        start_copy_in(&rig, in_rx),
        start_copy_out(&rig, out_rx, copied_out.clone()),
    ];
    let permits: [&Sender<()>; 2] = [&in_tx, &out_tx];
    // Every client's session is established on the first gateway.
    let deadline = Instant::now() + Duration::from_secs(60);
    while handshakes(&gateway).len() < clients.len() {
        assert_all_alive(
            &clients,
            &format!("connecting (gateway log:\n{})", gateway.log()),
        );
        assert!(Instant::now() < deadline, "{}", gateway.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    for line in handshakes(&gateway) {
        assert!(line.contains(tls.logged()), "{line}");
    }
    let in_kernel = handed_to_the_kernel(tls, &gateway, clients.len());
    for round in 1..=replacements() {
        let when = format!("before round {round}");
        for c in &clients[..2] {
            c.wait_progress(c.progress(), PROGRESS_PER_ROUND, &when);
        }
        permits.iter().for_each(|p| p.send(()).unwrap());
        let binary = if round % 2 == 1 { &other } else { &under_test };
        let new = replace(&rig, &mut gateway, binary, round);
        // No client made a new connection: the first generation saw one
        // handshake per client, each successor none.
        let made = handshakes(&gateway);
        let expected = if round == 1 { clients.len() } else { 0 };
        assert_eq!(made.len(), expected, "generation {}: {made:?}", round - 1);
        gateway = new;
        assert_all_alive(&clients, &format!("after round {round}"));
    }
    served_in_the_kernel(&gateway, clients.len(), in_kernel);
    finish_clients(&rig, clients, &feed, [in_tx, out_tx], &copied_out);
    // NBDGW_REPLACEMENTS=0 checks the harness alone, on one gateway.
    let made = handshakes(&gateway);
    let expected = if replacements() == 0 { 4 } else { 0 };
    assert_eq!(made.len(), expected, "the last generation: {made:?}");
    finish_gateway(&rig, gateway, expected);
}

/// Ends the clients, which must have seen no error and exit 0, and
/// compares what nbdcopy moved both ways.
fn finish_clients(
    rig: &Rig,
    clients: [Watched; 4],
    feed: &Feed,
    permits: [Sender<()>; 2],
    copied_out: &Path,
) {
    for c in &clients[..2] {
        c.wait_progress(c.progress(), PROGRESS_PER_ROUND, "after the last round");
    }
    feed.stop.store(true, Ordering::SeqCst);
    drop(permits);
    for mut c in clients {
        drop(c.child.stdin.take());
        let name = c.name;
        let (status, errors) = c.finish();
        assert!(errors.is_empty(), "{name}: {errors:?}");
        assert!(status.success(), "{name} exited {status}");
    }
    common::run_ok(Command::new("cmp").arg(copied_out).arg(&rig.out_image));
    let copied_in = rig.env.path("copied-in.bin");
    std::fs::write(&copied_in, rig.copy_in.read_direct()).unwrap();
    common::run_ok(
        Command::new("cmp")
            .args(["-n", &COPY_LEN.to_string()])
            .arg(&rig.source)
            .arg(&copied_in),
    );
    // Every write qemu-io was acknowledged reached the upstream.
    let disk = rig.disk.read_direct();
    assert!(
        disk[DISK_LEN / 2..] == feed.expected(),
        "qemu-io's half differs"
    );
}

/// The last generation established no TLS session either (its counter,
/// on the admin port it took over), and stops cleanly.
fn finish_gateway(rig: &Rig, gateway: NbdgwProcess, expected: usize) {
    let (status, metrics) = common::clients::http_get(rig.admin, "/metrics");
    assert_eq!(status, 200);
    let sessions: usize = metrics
        .lines()
        .filter(|l| l.starts_with("nbdgw_tls_sessions_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<usize>().ok())
        .sum();
    assert_eq!(sessions, expected, "{metrics}");
    let (status, log) = gateway.stop();
    assert!(status.success(), "{log}");
}
