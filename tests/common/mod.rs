//! Test harness: certificates, a real qemu-nbd upstream, the gateway run
//! in-process on a port-0 listener, and a raw NBD client.
#![allow(dead_code)]

pub mod clients;
pub mod fake_upstream;
pub mod gnutls_client;
pub mod handover;
pub mod metrics;
pub mod peers;
pub mod pki;
pub mod process;
pub mod raw;
pub mod site;
pub mod tls_capture;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nbdgw::Config;

pub fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_writer(std::io::stderr)
                .try_init();
        }
    });
}

/// A scratch directory with certificates made for this test.
pub struct Env {
    pub dir: tempfile::TempDir,
}

impl Env {
    pub fn new() -> Self {
        init_logging();
        let dir = tempfile::tempdir().expect("tempdir");
        let request = nbdgw::certs::CertsRequest {
            out: dir.path().join("certs"),
            server_names: vec!["localhost".into(), "127.0.0.1".into()],
            client_names: vec!["test-client".into()],
            client_uris: vec![],
            days: 2,
            force: false,
            ca: None,
            keep_ca_key: false,
        };
        nbdgw::certs::generate(&request).expect("generate certificates");
        Env { dir }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn certs(&self) -> PathBuf {
        self.path("certs")
    }

    /// An image of `len` bytes of non-zero pseudo-random data (so qemu-nbd
    /// cannot answer with holes).
    pub fn random_image(&self, name: &str, len: usize, seed: u64) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, pattern(len, seed)).expect("write image");
        path
    }

    /// An image of `len` bytes, every one `byte`.
    pub fn filled_image(&self, name: &str, byte: u8, len: usize) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, vec![byte; len]).expect("write image");
        path
    }

    pub fn config(&self, upstream: &Path) -> Config {
        let tls = nbdgw::tls::load_server_config(
            &self.certs().join("server-cert.pem"),
            &self.certs().join("server-key.pem"),
        )
        .expect("server config");
        let mut config = Config::new(upstream.to_owned(), nbdgw::tls::TlsStore::fixed(tls));
        config.shutdown_grace = Duration::from_secs(2);
        config
    }
}

/// A real qemu-nbd serving a random image, and the gateway run
/// in-process in front of it with the test's certificates. Fields drop
/// in order: the directory, qemu-nbd, then the gateway.
pub struct Served {
    pub env: Env,
    pub upstream: QemuNbd,
    pub gateway: Gateway,
    /// The image's bytes as served.
    pub image: Vec<u8>,
}

impl Served {
    /// qemu-nbd (with `qemu_args`) serving `size` bytes of
    /// `pattern(size, seed)`, and the gateway with its `Config` as
    /// `tune` leaves it.
    pub fn start(
        (size, seed): (usize, u64),
        qemu_args: &[&str],
        tune: impl FnOnce(&mut Config),
    ) -> Self {
        let env = Env::new();
        let path = env.random_image("disk.img", size, seed);
        let upstream = QemuNbd::start(&env, &path, qemu_args);
        let mut config = env.config(&upstream.socket);
        tune(&mut config);
        Served {
            gateway: Gateway::start(config),
            image: std::fs::read(&path).expect("read image"),
            env,
            upstream,
        }
    }

    /// A raw client through TLS, in transmission in `mode`.
    pub fn client(&self, mode: nbdgw::proto::transmission::ReplyMode) -> raw::RawClient {
        let mut c = raw::RawClient::tls(self.gateway.addr, &self.env.certs());
        c.go(mode);
        c
    }

    /// A good client still gets the image's bytes.
    pub fn assert_still_serving(&self) {
        let mut c = self.client(nbdgw::proto::transmission::ReplyMode::Structured);
        assert_eq!(c.read(77, 8192, 4096), self.image[8192..8192 + 4096]);
        c.disconnect();
    }
}

/// Waits until something listens on 127.0.0.1:`port`, or `gone` says the
/// process that should has died (its status, to report).
pub fn wait_until_listening(
    port: u16,
    what: &str,
    mut gone: impl FnMut() -> Option<String>,
) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(status) = gone() {
            return Err(format!("{what} exited with {status}"));
        }
        if Instant::now() >= deadline {
            return Err(format!("{what} did not start listening on port {port}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Polls `holds` until it is true; panics naming `what` after 30 s (the
/// machine is loaded: generous, and only the bound of a failure).
pub fn await_that(what: &str, mut holds: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !holds() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The NBD URI of the default export on the Unix socket `socket`.
pub fn unix_uri(socket: &Path) -> String {
    format!("nbd+unix:///?socket={}", socket.display())
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Deterministic bytes with no zero byte.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x as u8) | 1
        })
        .collect()
}

/// A real qemu-nbd serving an image on a Unix socket.
pub struct QemuNbd {
    child: Child,
    pub socket: PathBuf,
    pub image: PathBuf,
    args: Vec<String>,
}

impl QemuNbd {
    pub fn start(env: &Env, image: &Path, extra: &[&str]) -> Self {
        Self::start_at(env.path("nbd.sock"), image, extra)
    }

    /// As `start`, on a socket path of the caller's choosing.
    pub fn start_at(socket: PathBuf, image: &Path, extra: &[&str]) -> Self {
        let args: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let child = spawn_qemu_nbd(&socket, image, &args);
        QemuNbd {
            child,
            socket,
            image: image.to_owned(),
            args,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
    }

    pub fn restart(&mut self) {
        self.kill();
        self.child = spawn_qemu_nbd(&self.socket, &self.image, &self.args);
    }

    /// The upstream read directly, bypassing the gateway.
    pub fn read_direct(&self) -> Vec<u8> {
        self.read_direct_named("")
    }

    /// As `read_direct`, for a qemu-nbd started with `-x EXPORT`.
    pub fn read_direct_named(&self, export: &str) -> Vec<u8> {
        let out = self.socket.with_extension("direct.img");
        let _ = std::fs::remove_file(&out);
        let uri = format!("nbd+unix:///{export}?socket={}", self.socket.display());
        run_ok(
            Command::new("qemu-img")
                .args(["convert", "-f", "raw", "-O", "raw"])
                .arg(&uri)
                .arg(&out),
        );
        std::fs::read(&out).expect("read direct copy")
    }

    pub fn unix_uri(&self) -> String {
        unix_uri(&self.socket)
    }
}

fn spawn_qemu_nbd(socket: &Path, image: &Path, extra: &[String]) -> Child {
    let _ = std::fs::remove_file(socket);
    let child = Command::new("qemu-nbd")
        .args(["-f", "raw", "--persistent", "--shared=32", "-k"])
        .arg(socket)
        .args(extra)
        .arg(image)
        .stdin(Stdio::null())
        .spawn()
        .expect("qemu-nbd must be installed (apt-get install qemu-utils)");
    wait_until_unix_listening(socket, "qemu-nbd");
    child
}

/// Waits (10 s at most) until a connection to `socket` succeeds: its file
/// appears at bind, before listen, and a connect then is refused. The
/// probe connection is closed at once (a qemu-nbd given `--persistent`
/// goes on serving).
pub fn wait_until_unix_listening(socket: &Path, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(socket).is_err() {
        assert!(
            Instant::now() < deadline,
            "{what} did not start listening on {}",
            socket.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Drop for QemuNbd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The gateway, run in-process on its own runtime.
pub struct Gateway {
    pub addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl Gateway {
    pub fn start(config: Config) -> Self {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                addr_tx.send(listener.local_addr()?).ok();
                nbdgw::run(listener, Arc::new(config), async {
                    let _ = stop_rx.await;
                })
                .await
            })
        });
        let addr = addr_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("gateway did not start");
        Gateway {
            addr,
            shutdown: Some(stop_tx),
            thread: Some(thread),
        }
    }

    pub fn uri(&self, env: &Env) -> String {
        clients::nbds_uri(self.addr.port(), &env.certs())
    }

    /// qemu's `--object` and `--image-opts` arguments for this gateway.
    pub fn qemu_args(&self, env: &Env) -> (String, String) {
        let [_, object, _, image] =
            clients::qemu_tls_args("localhost", self.addr.port(), &env.certs());
        (object, image)
    }

    pub fn stop(&mut self) -> std::io::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match self.thread.take() {
            Some(t) => t.join().expect("gateway thread panicked"),
            None => Ok(()),
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// qemu-img copies the export out through a gateway (qemu's `--object`
/// and `--image-opts`) and a new image of the same size in; both must
/// match the upstream, read directly, byte for byte. Returns the image
/// copied in.
pub fn qemu_img_copy_both_ways(
    env: &Env,
    upstream: &QemuNbd,
    (object, opts): (&str, &str),
    size: usize,
    seed: u64,
) -> PathBuf {
    let copy = env.path("copy.img");
    run_ok(
        Command::new("qemu-img")
            .args([
                "convert",
                "--object",
                object,
                "--image-opts",
                opts,
                "-O",
                "raw",
            ])
            .arg(&copy),
    );
    assert_eq!(std::fs::read(&copy).unwrap(), upstream.read_direct());
    let source = env.random_image("new.img", size, seed);
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-n", "--object", object, "-f", "raw"])
            .arg(&source)
            .args(["--target-image-opts", opts]),
    );
    assert_eq!(upstream.read_direct(), std::fs::read(&source).unwrap());
    source
}

pub fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    out
}

pub fn run_ok(cmd: &mut Command) -> Output {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A TCP relay between a client and the gateway that counts the TLS
/// records the gateway sends, by parsing record headers on the wire.
pub struct RecordCounter {
    pub addr: SocketAddr,
    records: Arc<std::sync::Mutex<Vec<usize>>>,
}

impl RecordCounter {
    /// `plaintext_prefix`: bytes the gateway sends before TLS starts
    /// (greeting and option replies), which are passed through uncounted.
    pub fn start(target: SocketAddr, plaintext_prefix: usize) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let records = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = records.clone();
        std::thread::spawn(move || {
            let (client, _) = listener.accept().unwrap();
            let server = std::net::TcpStream::connect(target).unwrap();
            client.set_nodelay(true).unwrap();
            server.set_nodelay(true).unwrap();
            let (c_rd, s_wr) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                pipe(c_rd, &s_wr, |_| {});
                let _ = s_wr.shutdown(std::net::Shutdown::Write);
            });
            let mut records = TlsRecords {
                skip: plaintext_prefix,
                header: Vec::with_capacity(5),
                body_left: 0,
                seen,
            };
            // Counted before they are passed on, so a client that has its
            // reply knows the count includes it.
            pipe(server, &client, |bytes| records.scan(bytes));
            let _ = client.shutdown(std::net::Shutdown::Write);
        });
        RecordCounter { addr, records }
    }

    /// Application-data record lengths seen so far (ciphertext bytes).
    pub fn records(&self) -> Vec<usize> {
        self.records.lock().unwrap().clone()
    }
}

/// Copies `from` to `to` until either ends, showing each piece to `tap`
/// before passing it on (a tap may count it, or wait).
pub fn pipe(mut from: impl std::io::Read, mut to: impl std::io::Write, mut tap: impl FnMut(&[u8])) {
    let mut buf = vec![0u8; 1 << 16];
    while let Ok(n @ 1..) = from.read(&mut buf) {
        tap(&buf[..n]);
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
}

/// Finds TLS record boundaries in a byte stream, after a plaintext prefix.
struct TlsRecords {
    skip: usize,
    header: Vec<u8>,
    body_left: usize,
    seen: Arc<std::sync::Mutex<Vec<usize>>>,
}

impl TlsRecords {
    fn scan(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.skip > 0 {
                let k = self.skip.min(bytes.len());
                self.skip -= k;
                bytes = &bytes[k..];
            } else if self.body_left > 0 {
                let k = self.body_left.min(bytes.len());
                self.body_left -= k;
                bytes = &bytes[k..];
            } else {
                let k = (5 - self.header.len()).min(bytes.len());
                self.header.extend_from_slice(&bytes[..k]);
                bytes = &bytes[k..];
                if self.header.len() == 5 {
                    self.body_left = u16::from_be_bytes([self.header[3], self.header[4]]) as usize;
                    if self.header[0] == 23 {
                        self.seen.lock().unwrap().push(self.body_left);
                    }
                    self.header.clear();
                }
            }
        }
    }
}

/// Reads until the stream ends or fails; how many bytes came.
pub fn drain_stream(stream: &mut impl std::io::Read) -> usize {
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0;
    while let Ok(n @ 1..) = stream.read(&mut buf) {
        total += n;
    }
    total
}
