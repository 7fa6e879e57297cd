//! `nbdgw client` to Debian's nbd-server 3.24 with its own TLS (GnuTLS),
//! client certificates checked against the test CA: bytes written
//! through client mode reach the served file, and read back equal.
//!
//! Two priorities: nbd-server's documented default,
//! `NORMAL:-VERS-TLS-ALL:+VERS-TLS1.2:%SERVER_PRECEDENCE` (TLS 1.2
//! only), set explicitly; and no `tlsprio` at all, which in 3.24 is plain
//! GnuTLS NORMAL with TLS 1.3 (its `parse_cfile` sets the default, then
//! copies the caller's zeroed `generic_conf` over it, so GnuTLS gets a
//! NULL priority; nbd 3.27 enables TLS 1.3 on purpose). Seen by
//! experiment, and read in nbd-server.c at the nbd-3.24 tag.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::process::NbdgwProcess;
use common::{pattern, run_ok, Env};

const SIZE: usize = 4 << 20;

/// nbd-server as packaged (`apt-get install nbd-server`), forking a child
/// per client. It daemonizes when it forks, so it is found again by its
/// pid file; SIGTERM to it ends its children too (`killchild`).
struct NbdServer {
    pid_file: PathBuf,
    port: u16,
}

impl NbdServer {
    fn start(env: &Env, image: &Path, tlsprio: Option<&str>) -> Self {
        let certs = env.certs();
        let port = common::free_port();
        let prio = tlsprio.map_or(String::new(), |p| format!("    tlsprio = {p}\n"));
        let config = format!(
            "[generic]\n    listenaddr = 127.0.0.1\n    port = {port}\n    force_tls = true\n\
             \x20   certfile = {c}/server-cert.pem\n    keyfile = {c}/server-key.pem\n\
             \x20   cacertfile = {c}/ca-cert.pem\n{prio}\
             [disk]\n    exportname = {image}\n",
            c = certs.display(),
            image = image.display(),
        );
        let config_file = env.path("nbd-server.conf");
        std::fs::write(&config_file, config).unwrap();
        let pid_file = env.path("nbd-server.pid");
        let status = Command::new("nbd-server")
            .arg("-C")
            .arg(&config_file)
            .arg("-p")
            .arg(&pid_file)
            .stdin(Stdio::null())
            .status()
            .expect("nbd-server must be installed (scripts/setup.sh)");
        assert!(status.success(), "nbd-server: {status}");
        let server = NbdServer { pid_file, port };
        common::wait_until_listening(port, "nbd-server", || None).unwrap();
        server
    }

    fn pid(&self) -> Option<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pid = std::fs::read_to_string(&self.pid_file).unwrap_or_default();
            if !pid.trim().is_empty() {
                return Some(pid.trim().to_string());
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for NbdServer {
    /// SIGTERM, then waits (bounded) until the daemon is gone, so that
    /// the next test's server does not meet this one's port or image.
    fn drop(&mut self) {
        let Some(pid) = self.pid() else {
            return;
        };
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let proc_dir = PathBuf::from(format!("/proc/{pid}"));
        let deadline = Instant::now() + Duration::from_secs(30);
        while proc_dir.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn client_mode(env: &Env, server: &NbdServer) -> (NbdgwProcess, String) {
    let socket = env.path("client.sock");
    let certs = env.certs();
    let server = format!("localhost:{}", server.port);
    let client = NbdgwProcess::client_of(socket.as_os_str(), &server, &certs, &[]);
    let uri = format!("nbd+unix:///disk?socket={}", socket.display());
    (client, uri)
}

/// Writes a new pattern through `uri` with qemu-img, reads it back with
/// nbdcopy, and checks the served file holds it.
fn write_and_read_back(env: &Env, uri: &str, image: &Path, client: &NbdgwProcess) {
    let source = env.random_image("new.img", SIZE, 42);
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&source)
            .arg(uri),
    );
    let copy = env.path("copy.img");
    run_ok(Command::new("nbdcopy").arg(uri).arg(&copy));
    let expected = pattern(SIZE, 42);
    assert!(
        std::fs::read(&copy).unwrap() == expected,
        "read back differs:\n{}",
        client.log()
    );
    assert!(
        std::fs::read(image).unwrap() == expected,
        "the served file differs"
    );
}

#[test]
fn client_mode_to_nbd_server_tls12_only() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 41);
    let server = NbdServer::start(
        &env,
        &image,
        Some("NORMAL:-VERS-TLS-ALL:+VERS-TLS1.2:%SERVER_PRECEDENCE"),
    );
    let (client, uri) = client_mode(&env, &server);
    write_and_read_back(&env, &uri, &image, &client);
    let log = client.log();
    let tls: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("TLS established"))
        .collect();
    assert!(tls.len() >= 2, "{log}");
    for line in tls {
        assert!(line.contains("tls_version=Some(TLSv1_2)"), "{line}");
        assert!(line.contains("server=subject \"CN=localhost\""), "{line}");
    }
    assert!(!log.contains("WARN"), "{log}");
}

#[test]
fn client_mode_to_nbd_server_without_tlsprio() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 41);
    let server = NbdServer::start(&env, &image, None);
    let (client, uri) = client_mode(&env, &server);
    write_and_read_back(&env, &uri, &image, &client);
    let log = client.log();
    assert!(
        log.contains("TLS established tls_version=Some(TLSv1_3)"),
        "{log}"
    );
    assert!(!log.contains("WARN"), "{log}");
}
