//! The admin endpoints, scraped with curl while real clients (qemu-img,
//! nbdcopy) go through the gateway: metrics that move with traffic and
//! refusals, readiness that follows the upstream socket and SIGTERM.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::clients::{http_get, nbdinfo_size, nbds_uri, qemu_img_info, text};
use common::metrics::sample;
use common::process::NbdgwProcess;
use common::{free_port, run_ok, Env, QemuNbd};

/// nbdgw with the test's certificates in front of `upstream`, with an
/// admin listener on `admin`.
fn gateway(env: &Env, upstream: &std::path::Path, admin: u16, extra: &[&str]) -> NbdgwProcess {
    let admin = format!("127.0.0.1:{admin}");
    let args: Vec<&str> = ["--admin-listen", &admin]
        .into_iter()
        .chain(extra.iter().copied())
        .collect();
    NbdgwProcess::in_front_of(env, upstream, &args)
}

#[test]
fn metrics_move_with_traffic_and_refused_handshakes() {
    let env = Env::new();
    let image = env.random_image("disk.img", 2 << 20, 9);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let admin = free_port();
    let gw = gateway(&env, &upstream.socket, admin, &[]);

    let copy = env.path("copy.img");
    run_ok(
        Command::new("nbdcopy")
            .arg(nbds_uri(gw.port, &env.certs()))
            .arg(&copy),
    );
    assert_eq!(
        std::fs::read(&copy).unwrap(),
        std::fs::read(&image).unwrap()
    );
    // A client that trusts the gateway but presents no certificate.
    let anonymous = env.path("anonymous");
    std::fs::create_dir_all(&anonymous).unwrap();
    std::fs::copy(
        env.certs().join("ca-cert.pem"),
        anonymous.join("ca-cert.pem"),
    )
    .unwrap();
    assert!(!qemu_img_info(gw.port, &anonymous).status.success());
    gw.wait_for_log("TLS handshake failed", 1);

    let (code, metrics) = http_get(admin, "/metrics");
    assert_eq!(code, 200);
    assert!(sample(&metrics, "nbdgw_requests_total{command=\"READ\"}") >= 1.0);
    assert!(sample(&metrics, "nbdgw_sent_bytes_total") >= (2 << 20) as f64);
    assert!(
        sample(
            &metrics,
            "nbdgw_request_duration_seconds_count{command=\"READ\"}"
        ) >= 1.0
    );
    assert!(sample(&metrics, "nbdgw_connections_total{outcome=\"closed\"}") >= 1.0);
    assert_eq!(
        sample(
            &metrics,
            "nbdgw_handshake_failures_total{reason=\"certificate_required\"}"
        ),
        1.0
    );
    assert_eq!(sample(&metrics, "nbdgw_identities_refused_total"), 1.0);
    let now = time::OffsetDateTime::now_utc().unix_timestamp() as f64;
    assert!(sample(&metrics, "nbdgw_certificate_not_after_seconds") > now);
    assert!(sample(&metrics, "nbdgw_client_ca_not_after_seconds") > now);
    assert_eq!(sample(&metrics, "nbdgw_build_info{version=\"0.1.0\"}"), 1.0);
    assert!(metrics.contains("# TYPE nbdgw_request_duration_seconds histogram"));
}

fn wait_for(port: u16, path: &str, code: u16) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (got, body) = http_get(port, path);
        if got == code {
            return body;
        }
        assert!(Instant::now() < deadline, "{path} stayed {got}: {body}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn readiness_follows_the_upstream_socket_and_sigterm_with_a_drain_delay() {
    let env = Env::new();
    let image = env.random_image("disk.img", 1 << 20, 10);
    let socket = env.path("nbd.sock");
    let admin = free_port();
    // A sidecar may start before its NBD server: running, not ready.
    let mut gw = gateway(&env, &socket, admin, &["--drain-delay", "2"]);
    assert_eq!(http_get(admin, "/healthz").0, 200);
    let not_ready = wait_for(admin, "/readyz", 503);
    assert!(not_ready.contains("upstream unavailable"), "{not_ready}");

    let upstream = QemuNbd::start(&env, &image, &[]);
    assert_eq!(upstream.socket, socket);
    assert_eq!(wait_for(admin, "/readyz", 200).trim(), "ready");
    let info = qemu_img_info(gw.port, &env.certs());
    assert!(info.status.success(), "{}", text(&info));

    gw.signal("TERM");
    gw.wait_for_log("SIGTERM received", 1);
    let draining = wait_for(admin, "/readyz", 503);
    assert!(draining.contains("shutting down"), "{draining}");
    // Still accepting during the drain delay.
    let info = qemu_img_info(gw.port, &env.certs());
    assert!(info.status.success(), "{}", text(&info));
    let status = gw
        .wait_exit(Duration::from_secs(10))
        .expect("exits after the drain");
    assert!(status.success());
}

/// Slowloris on the admin port: 300 connections that send half a request
/// line and stop. With the default header timeout (5 s) they are closed
/// within it; meanwhile a fresh `/healthz` answers in under 2 s and an
/// NBD client copies the disk, and afterwards nbdgw's descriptors are
/// back where they were.
#[test]
fn half_requests_on_the_admin_port_are_closed_within_the_header_timeout() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    const HALF_OPEN: usize = 300;
    const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
    let env = Env::new();
    let image = env.random_image("disk.img", 1 << 20, 11);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let admin = free_port();
    let gw = gateway(&env, &upstream.socket, admin, &[]);
    assert_eq!(http_get(admin, "/healthz").0, 200);
    std::thread::sleep(Duration::from_millis(300));
    let baseline = gw.open_fds();

    let started = Instant::now();
    let mut half_open: Vec<TcpStream> = (0..HALF_OPEN)
        .map(|_| {
            let mut c = TcpStream::connect(("127.0.0.1", admin)).expect("admin connect");
            c.write_all(b"GET /healthz HT")
                .expect("half a request line");
            c
        })
        .collect();

    let done = Arc::new(AtomicBool::new(false));
    let probes = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut slowest = Duration::ZERO;
            while !done.load(Ordering::SeqCst) {
                let asked = Instant::now();
                let (code, body) = http_get(admin, "/healthz");
                assert_eq!(code, 200, "/healthz during the slowloris: {body}");
                slowest = slowest.max(asked.elapsed());
                std::thread::sleep(Duration::from_millis(100));
            }
            slowest
        })
    };
    let port = gw.port;
    let certs = env.certs();
    let copies = {
        let (done, image, copy) = (done.clone(), image.clone(), env.path("copy.img"));
        std::thread::spawn(move || {
            let mut copied = 0;
            while !done.load(Ordering::SeqCst) || copied == 0 {
                let _ = std::fs::remove_file(&copy);
                run_ok(
                    Command::new("nbdcopy")
                        .arg(nbds_uri(port, &certs))
                        .arg(&copy),
                );
                assert_eq!(
                    std::fs::read(&copy).unwrap(),
                    std::fs::read(&image).unwrap()
                );
                copied += 1;
            }
            copied
        })
    };

    // Each half-open connection must be closed by nbdgw (EOF or reset)
    // within the header timeout, with a little slack for scheduling.
    let deadline = started + HEADER_TIMEOUT + Duration::from_secs(2);
    for (i, c) in half_open.iter_mut().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now());
        c.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        let mut byte = [0u8; 512];
        let closed = loop {
            match c.read(&mut byte) {
                // hyper may answer the timeout with a 408 first.
                Ok(n) if n > 0 => continue,
                Ok(_) => break true,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => break false,
                Err(_) => break true,
            }
        };
        assert!(
            closed,
            "half-open admin connection {i} still open {:?} after it started (header timeout {HEADER_TIMEOUT:?})",
            started.elapsed()
        );
    }
    drop(half_open);
    done.store(true, Ordering::SeqCst);
    let slowest = probes.join().expect("/healthz answered throughout");
    assert!(
        slowest < Duration::from_secs(2),
        "slowest /healthz took {slowest:?}"
    );
    assert!(copies.join().expect("NBD copies throughout") >= 1);

    let settle = Instant::now() + Duration::from_secs(5);
    while gw.open_fds() > baseline && Instant::now() < settle {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        gw.open_fds() <= baseline,
        "descriptors {} after the slowloris, {baseline} before",
        gw.open_fds()
    );
    let (_, metrics) = http_get(admin, "/metrics");
    assert_eq!(
        sample(&metrics, "nbdgw_admin_connections_refused_total"),
        0.0
    );
}

/// Beyond `--admin-max-connections` a connection is closed at once and
/// counted; one that fits is served.
#[test]
fn admin_connections_beyond_the_cap_are_closed_at_once_and_counted() {
    use std::io::{Read, Write};
    use std::net::TcpStream;

    let env = Env::new();
    let image = env.random_image("disk.img", 1 << 20, 12);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let admin = free_port();
    let gw = gateway(
        &env,
        &upstream.socket,
        admin,
        &["--admin-max-connections", "4"],
    );
    assert_eq!(http_get(admin, "/healthz").0, 200);
    // A connection's slot comes back when its task ends, a moment after
    // curl has its answer: wait until only the asking one is open, or a
    // slot still held would refuse one of the four below instead.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while sample(
        &http_get(admin, "/metrics").1,
        "nbdgw_admin_connections_open",
    ) > 1.0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "admin slots never came back"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let held: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut c = TcpStream::connect(("127.0.0.1", admin)).unwrap();
            c.write_all(b"GET /").unwrap();
            c
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut extra = TcpStream::connect(("127.0.0.1", admin)).unwrap();
    extra
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let _ = extra.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut got = Vec::new();
    let ended = extra.read_to_end(&mut got);
    assert!(
        got.is_empty() && !matches!(&ended, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the fifth connection was served: {ended:?} {:?}",
        String::from_utf8_lossy(&got)
    );
    drop(held);
    std::thread::sleep(Duration::from_millis(300));
    let (code, metrics) = http_get(admin, "/metrics");
    assert_eq!(code, 200);
    assert!(sample(&metrics, "nbdgw_admin_connections_refused_total") >= 1.0);
    drop(gw);
}

/// An NBD server whose standard error is kept in a file, started without
/// a connection to it: connections are what the readiness tests count.
struct LoggedServer {
    child: std::process::Child,
    stderr: std::path::PathBuf,
}

impl LoggedServer {
    fn start(env: &Env, name: &str, command: &mut Command, socket: &std::path::Path) -> Self {
        let stderr = env.path(&format!("{name}.stderr"));
        let child = command
            .stdin(std::process::Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("{name} must be installed (scripts/setup.sh): {e}"));
        // Asked of the kernel (sock_diag), not by connecting.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !listens(socket) {
            assert!(Instant::now() < deadline, "{name} never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
        LoggedServer { child, stderr }
    }

    fn errors(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap()
    }

    fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for LoggedServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn listens(socket: &std::path::Path) -> bool {
    use nbdgw::listening::{listener_of, FileId, Listener};
    FileId::of(socket).is_ok_and(|file| listener_of(file).ok() == Some(Listener::Found))
}

fn nbdkit_memory(socket: &std::path::Path) -> Command {
    let mut command = Command::new("nbdkit");
    command
        .args(["-f", "-U"])
        .arg(socket)
        .args(["memory", "1M"]);
    command
}

/// Some check periods, for what must not happen over time.
fn several_checks() {
    std::thread::sleep(3 * nbdgw::admin::UPSTREAM_CHECK_EVERY + Duration::from_secs(1));
}

/// The readiness check must be no client to the NBD server: nbdkit 1.32
/// (and qemu-nbd 7.2) log an error for every connection that hangs up
/// before the handshake ends, and a qemu-nbd without --persistent is
/// meant for its first real client.
#[test]
fn the_readiness_check_is_silent_for_nbdkit_and_a_one_shot_qemu_nbd() {
    let env = Env::new();
    let image = env.random_image("disk.img", 1 << 20, 11);
    let kit_socket = env.path("kit.sock");
    let kit = LoggedServer::start(&env, "nbdkit", &mut nbdkit_memory(&kit_socket), &kit_socket);
    let qemu_socket = env.path("qemu.sock");
    let mut qemu = LoggedServer::start(
        &env,
        "qemu-nbd",
        Command::new("qemu-nbd")
            .args(["-f", "raw", "-k"])
            .arg(&qemu_socket)
            .arg(&image),
        &qemu_socket,
    );
    let (kit_admin, qemu_admin) = (free_port(), free_port());
    let kit_gw = gateway(&env, &kit_socket, kit_admin, &[]);
    let qemu_gw = gateway(&env, &qemu_socket, qemu_admin, &[]);
    assert_eq!(wait_for(kit_admin, "/readyz", 200).trim(), "ready");
    assert_eq!(wait_for(qemu_admin, "/readyz", 200).trim(), "ready");
    several_checks();
    assert_eq!(kit.errors(), "", "nbdkit logged the readiness checks");
    assert_eq!(qemu.errors(), "", "qemu-nbd logged the readiness checks");
    assert!(qemu.is_running(), "qemu-nbd ended before its first client");
    assert_eq!(http_get(qemu_admin, "/readyz").0, 200);

    let info = qemu_img_info(qemu_gw.port, &env.certs());
    assert!(info.status.success(), "{}", text(&info));
    assert!(
        String::from_utf8_lossy(&info.stdout).contains("virtual size: 1 MiB"),
        "{}",
        String::from_utf8_lossy(&info.stdout)
    );
    let size = nbdinfo_size(kit_gw.port, &env.certs());
    assert_eq!(String::from_utf8_lossy(&size.stdout).trim(), "1048576");
    // Without --persistent qemu-nbd ends after that first client: it was
    // the one-shot server the check must leave alone.
    let deadline = Instant::now() + Duration::from_secs(10);
    while qemu.is_running() {
        assert!(Instant::now() < deadline, "qemu-nbd outlived its client");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(qemu.errors(), "");
    assert_eq!(kit.errors(), "");
}

/// A server that dies leaves its socket file behind: no listener, not
/// ready; ready again once a server listens there, and the server never
/// sees a check.
#[test]
fn readiness_follows_a_stale_socket_file_and_its_new_server_silently() {
    let env = Env::new();
    let socket = env.path("kit.sock");
    let mut first = LoggedServer::start(&env, "nbdkit", &mut nbdkit_memory(&socket), &socket);
    let admin = free_port();
    let gw = gateway(&env, &socket, admin, &[]);
    assert_eq!(wait_for(admin, "/readyz", 200).trim(), "ready");

    first.child.kill().unwrap();
    first.child.wait().unwrap();
    assert!(socket.exists(), "SIGKILL leaves the socket file");
    assert_eq!(wait_for(admin, "/readyz", 503), "upstream unavailable\n");
    gw.wait_for_log("no listener", 1);

    std::fs::remove_file(&socket).unwrap();
    let second = LoggedServer::start(&env, "nbdkit-again", &mut nbdkit_memory(&socket), &socket);
    assert_eq!(wait_for(admin, "/readyz", 200).trim(), "ready");
    several_checks();
    assert_eq!(first.errors(), "", "the first nbdkit logged the checks");
    assert_eq!(second.errors(), "", "the second nbdkit logged the checks");
}

/// connect(2) to a Unix socket needs write permission on its file: a
/// listener nbdgw may not connect to is no readiness. qemu-nbd run as
/// root leaves `srwxr-xr-x root root`; nbdgw runs as nobody (`setpriv`).
#[test]
fn a_listener_nbdgw_may_not_connect_to_is_not_ready() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    let image = env.random_image("disk.img", 1 << 20, 12);
    let upstream = QemuNbd::start(&env, &image, &[]);
    common::wait_until_unix_listening(&upstream.socket, "qemu-nbd");
    let mode = |path: &std::path::Path, mode| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap()
    };
    mode(&upstream.socket, 0o755);
    // nobody reads the certificates and reaches the socket's directory.
    mode(&env.path(""), 0o755);
    run_ok(Command::new("chmod").args(["-R", "a+rX"]).arg(env.certs()));
    let (port, admin) = (free_port(), free_port());
    let mut as_nobody = Command::new("setpriv");
    as_nobody
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(common::process::nbdgw_binary())
        .arg("--upstream")
        .arg(&upstream.socket)
        .arg("--tls-dir")
        .arg(env.certs())
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .args(["--listen", &format!("127.0.0.1:{port}")]);
    let gw = NbdgwProcess::spawn(as_nobody, port);
    gw.wait_for_log("nbdgw listening", 1);
    assert_eq!(wait_for(admin, "/readyz", 503), "upstream unavailable\n");
    gw.wait_for_log("may not connect", 1);
    // The check followed the file's mode, not a fixed answer.
    mode(&upstream.socket, 0o777);
    assert_eq!(wait_for(admin, "/readyz", 200).trim(), "ready");
    let info = qemu_img_info(gw.port, &env.certs());
    assert!(info.status.success(), "{}", text(&info));
}

/// Where sock_diag cannot answer, the check visits the NBD server: a
/// whole handshake ended by NBD_OPT_ABORT, which nbdkit 1.32 and
/// qemu-nbd log nothing for (a bare connect-and-hang-up is an error
/// line in both), and which leaves a persistent qemu-nbd serving.
#[test]
fn the_fallback_visit_is_silent_for_nbdkit_and_qemu_nbd() {
    let env = Env::new();
    let image = env.random_image("disk.img", 1 << 20, 13);
    let kit_socket = env.path("kit.sock");
    let kit = LoggedServer::start(&env, "nbdkit", &mut nbdkit_memory(&kit_socket), &kit_socket);
    let qemu_socket = env.path("qemu.sock");
    let mut qemu = LoggedServer::start(
        &env,
        "qemu-nbd",
        Command::new("qemu-nbd")
            .args(["-f", "raw", "--persistent", "-k"])
            .arg(&qemu_socket)
            .arg(&image),
        &qemu_socket,
    );
    for _ in 0..3 {
        for socket in [&kit_socket, &qemu_socket] {
            nbdgw::listening::visit(socket, Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("visit {}: {e}", socket.display()));
        }
    }
    // Whatever the servers log, they log it by the time they answer the
    // next client.
    let listed = run_ok(
        Command::new("nbdinfo")
            .arg("--size")
            .arg(common::unix_uri(&qemu_socket)),
    );
    assert_eq!(String::from_utf8_lossy(&listed.stdout).trim(), "1048576");
    let listed = run_ok(
        Command::new("nbdinfo")
            .arg("--size")
            .arg(common::unix_uri(&kit_socket)),
    );
    assert_eq!(String::from_utf8_lossy(&listed.stdout).trim(), "1048576");
    assert_eq!(kit.errors(), "", "nbdkit logged the visits");
    assert_eq!(qemu.errors(), "", "qemu-nbd logged the visits");
    assert!(qemu.is_running());
}

/// An overlay mount (tmpfs upper layer over the disk's lower one),
/// unmounted at the end.
struct Overlay {
    merged: std::path::PathBuf,
    upper_fs: std::path::PathBuf,
}

impl Overlay {
    fn mount(env: &Env) -> Self {
        let (lower, upper_fs, merged) =
            (env.path("lower"), env.path("upperfs"), env.path("merged"));
        for dir in [&lower, &upper_fs, &merged] {
            std::fs::create_dir(dir).unwrap();
        }
        run_ok(
            Command::new("mount")
                .args(["-t", "tmpfs", "tmpfs"])
                .arg(&upper_fs),
        );
        let overlay = Overlay {
            merged: merged.clone(),
            upper_fs: upper_fs.clone(),
        };
        for dir in ["upper", "work"] {
            std::fs::create_dir(upper_fs.join(dir)).unwrap();
        }
        let options = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            upper_fs.join("upper").display(),
            upper_fs.join("work").display()
        );
        run_ok(
            Command::new("mount")
                .args(["-t", "overlay", "overlay", "-o", &options])
                .arg(&merged),
        );
        overlay
    }
}

impl Drop for Overlay {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.merged).status();
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.upper_fs)
            .status();
    }
}

/// On overlayfs with layers on different filesystems (as on btrfs
/// subvolumes) stat's device is not the one sock_diag reports: the
/// listener is found by the mount's device, without a fallback visit
/// or its warning.
#[test]
fn a_listener_on_overlayfs_is_found_without_a_visit() {
    use std::os::unix::fs::MetadataExt;
    let env = Env::new();
    let overlay = Overlay::mount(&env);
    let image = env.random_image("disk.img", 1 << 20, 14);
    let socket = overlay.merged.join("qemu.sock");
    let mut upstream = LoggedServer::start(
        &env,
        "qemu-nbd",
        Command::new("qemu-nbd")
            .args(["-f", "raw", "--persistent", "-k"])
            .arg(&socket)
            .arg(&image),
        &socket,
    );
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let stat_dev = std::fs::metadata(&socket).unwrap().dev();
    let merged = overlay.merged.display().to_string();
    let line = mountinfo.lines().find(|l| l.contains(&merged)).unwrap();
    assert_ne!(
        line.split(' ').nth(2).unwrap(),
        format!(
            "{}:{}",
            rustix::fs::major(stat_dev),
            rustix::fs::minor(stat_dev)
        ),
        "this overlay's stat device is its mount's: the test shows nothing"
    );
    let admin = free_port();
    let gw = gateway(&env, &socket, admin, &[]);
    assert_eq!(wait_for(admin, "/readyz", 200).trim(), "ready");
    several_checks();
    assert_eq!(gw.count_in_log("sock_diag did not find"), 0, "{}", gw.log());
    assert_eq!(gw.count_in_log("not in this network namespace"), 0);
    assert_eq!(upstream.errors(), "");
    assert!(upstream.is_running());
    drop(gw);
    drop(upstream);
}
