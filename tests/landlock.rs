//! The sandbox nbdgw puts itself in after start-up (Landlock): a file
//! outside the TLS directory cannot be opened, the TLS files still can,
//! a Kubernetes-style Secret rotation (a new directory swapped in by
//! renaming the `..data` link) still reloads, and the upstream socket is
//! still reached. The probe is a hook in debug builds (NBDGW_DEBUG_OPEN)
//! that opens a path from a runtime thread after start.

mod common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use common::clients::{qemu_img_info, text};
use common::pki::{Ca, ClientDir};
use common::process::NbdgwProcess;
use common::{Env, QemuNbd};

/// A Secret volume as the kubelet writes it: the files live in a dated
/// directory, `..data` links to it, and each name links through `..data`.
fn write_secret_version(dir: &Path, version: &str, server: &common::pki::Leaf, ca: &Ca) {
    let data = dir.join(version);
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("tls.crt"), &server.cert).unwrap();
    std::fs::write(data.join("tls.key"), &server.key).unwrap();
    std::fs::write(data.join("ca.crt"), &ca.pem).unwrap();
    let staged = dir.join("..data_tmp");
    std::os::unix::fs::symlink(version, &staged).unwrap();
    std::fs::rename(&staged, dir.join("..data")).unwrap();
    for name in ["tls.crt", "tls.key", "ca.crt"] {
        let link = dir.join(name);
        if link.symlink_metadata().is_err() {
            std::os::unix::fs::symlink(Path::new("..data").join(name), link).unwrap();
        }
    }
}

fn gateway(secret: &Path, upstream: &Path, probe: &Path, extra: &[&str]) -> NbdgwProcess {
    let mut args = vec![
        OsStr::new("--tls-dir"),
        secret.as_os_str(),
        OsStr::new("--upstream"),
        upstream.as_os_str(),
        OsStr::new("--tls-reload-interval"),
        OsStr::new("0"),
    ];
    args.extend(extra.iter().map(OsStr::new));
    NbdgwProcess::start_with(args, &[("NBDGW_DEBUG_OPEN", probe.as_os_str())])
}

struct Setup {
    env: Env,
    ca: Ca,
    secret: PathBuf,
    client: PathBuf,
    outside: PathBuf,
    upstream: QemuNbd,
}

fn setup() -> Setup {
    let env = Env::new();
    let ca = Ca::new("sandbox test CA");
    let secret = env.path("secret");
    write_secret_version(&secret, "..2026_12_01_first", &ca.server("first"), &ca);
    let client = ca
        .client("vm-host", &[], &[], 10)
        .client_dir(&env.path("client"), &ca);
    let outside = env.path("not-a-tls-file.txt");
    std::fs::write(&outside, "host secrets").unwrap();
    let image = env.random_image("disk.img", 1 << 20, 8);
    let upstream = QemuNbd::start(&env, &image, &[]);
    Setup {
        env,
        ca,
        secret,
        client,
        outside,
        upstream,
    }
}

#[test]
fn after_start_a_file_outside_the_tls_directory_cannot_be_opened() {
    let s = setup();
    let gw = gateway(&s.secret, &s.upstream.socket, &s.outside, &[]);
    gw.wait_for_log("debug probe", 1);
    let log = gw.log();
    assert!(
        log.contains("landlock: the process may read only beneath these directories"),
        "{log}"
    );
    assert!(
        log.contains("debug probe: cannot open") && log.contains("Permission denied"),
        "{log}"
    );
    let info = qemu_img_info(gw.port, &s.client);
    assert!(info.status.success(), "{}\n{}", text(&info), gw.log());
    drop(s.env);
}

#[test]
fn without_the_sandbox_the_same_file_opens() {
    let s = setup();
    let gw = gateway(
        &s.secret,
        &s.upstream.socket,
        &s.outside,
        &["--landlock", "false"],
    );
    gw.wait_for_log("debug probe", 1);
    let log = gw.log();
    assert!(log.contains("debug probe: opened"), "{log}");
    assert!(log.contains("the process is not sandboxed"), "{log}");
}

#[test]
fn the_tls_files_stay_readable_and_a_secret_rotation_reloads_under_the_sandbox() {
    let s = setup();
    let gw = gateway(
        &s.secret,
        &s.upstream.socket,
        &s.secret.join("tls.crt"),
        &[],
    );
    gw.wait_for_log("debug probe", 1);
    assert!(gw.log().contains("debug probe: opened"), "{}", gw.log());

    write_secret_version(
        &s.secret,
        "..2026_12_02_second",
        &s.ca.server("second"),
        &s.ca,
    );
    gw.signal("HUP");
    gw.wait_for_log("TLS certificate reloaded", 1);
    let log = gw.log();
    assert!(log.contains("subject=CN=second"), "{log}");
    assert!(!log.contains("TLS reload failed"), "{log}");
    let info = qemu_img_info(gw.port, &s.client);
    assert!(info.status.success(), "{}\n{}", text(&info), gw.log());
}

/// The kernel's Landlock ABI version, asked directly (not through nbdgw,
/// whose answer is what is being tested): 0 without Landlock.
fn kernel_landlock_abi() -> i64 {
    // landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
    let version = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            1u32,
        )
    };
    version.max(0)
}

/// Landlock ABI 6 (Linux 6.12) scopes abstract Unix sockets and signals.
const ABI_SCOPES: i64 = 6;
/// Landlock ABI 9 (Linux 7.1) controls connecting to pathname Unix sockets.
const ABI_RESOLVE_UNIX: i64 = 9;

/// A listening socket in the abstract namespace, made by the test (outside
/// nbdgw's Landlock domain); the name is unique to this test process.
fn connect_abstract(address: &str) -> std::io::Result<std::os::unix::net::UnixStream> {
    use std::os::linux::net::SocketAddrExt;
    let name = address.strip_prefix('@').expect("an abstract address");
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
    std::os::unix::net::UnixStream::connect_addr(&addr)
}

fn abstract_listener(tag: &str) -> (std::os::unix::net::UnixListener, String) {
    use std::os::linux::net::SocketAddrExt;
    let name = format!("nbdgw-test-{}-{tag}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(&name).unwrap();
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
    (listener, format!("@{name}"))
}

#[test]
fn an_abstract_socket_made_outside_the_sandbox_cannot_be_reached() {
    let s = setup();
    let (_listener, address) = abstract_listener("abstract");
    let abi = kernel_landlock_abi();
    // The same connect from the test itself works: only the sandbox stops it.
    assert!(connect_abstract(&address).is_ok());
    let gw = NbdgwProcess::start_with(
        [
            OsStr::new("--tls-dir"),
            s.secret.as_os_str(),
            OsStr::new("--upstream"),
            s.upstream.socket.as_os_str(),
        ],
        &[("NBDGW_DEBUG_CONNECT", OsStr::new(&address))],
    );
    gw.wait_for_log("debug probe", 1);
    let log = gw.log();
    if abi < ABI_SCOPES {
        println!("SKIPPED: this kernel's Landlock ABI is {abi}; abstract sockets are scoped from ABI {ABI_SCOPES} (Linux 6.12) on");
        assert!(abi < ABI_SCOPES);
        return;
    }
    assert!(
        log.contains("debug probe: cannot connect") && log.contains("Operation not permitted"),
        "{log}"
    );
}

#[test]
fn a_process_outside_the_sandbox_cannot_be_signalled() {
    let s = setup();
    let abi = kernel_landlock_abi();
    // The test process itself: nbdgw may not even ask whether it could
    // signal it (signal 0) once sandboxed.
    let pid = std::process::id().to_string();
    let gw = NbdgwProcess::start_with(
        [
            OsStr::new("--tls-dir"),
            s.secret.as_os_str(),
            OsStr::new("--upstream"),
            s.upstream.socket.as_os_str(),
        ],
        &[("NBDGW_DEBUG_SIGNAL", OsStr::new(&pid))],
    );
    gw.wait_for_log("debug probe", 1);
    let log = gw.log();
    if abi < ABI_SCOPES {
        println!("SKIPPED: this kernel's Landlock ABI is {abi}; signals are scoped from ABI {ABI_SCOPES} (Linux 6.12) on");
        assert!(abi < ABI_SCOPES);
        return;
    }
    assert!(
        log.contains("debug probe: cannot signal") && log.contains("Operation not permitted"),
        "{log}"
    );
}

#[test]
fn a_sibling_socket_beside_the_upstream_is_not_connectable() {
    let s = setup();
    // The upstream socket in a directory of its own, as the shipped files
    // lay it out; beside that directory, in the test's scratch directory,
    // other files and a second listening socket nbdgw has no business
    // with.
    let own = s.env.path("upstream");
    std::fs::create_dir(&own).unwrap();
    let socket = own.join("nbd.sock");
    std::fs::rename(&s.upstream.socket, &socket).unwrap();
    let sibling = s.env.path("sibling.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&sibling).unwrap();
    let gw = NbdgwProcess::start_with(
        [
            OsStr::new("--tls-dir"),
            s.secret.as_os_str(),
            OsStr::new("--upstream"),
            socket.as_os_str(),
        ],
        &[("NBDGW_DEBUG_CONNECT", sibling.as_os_str())],
    );
    gw.wait_for_log("debug probe", 1);
    let log = gw.log();
    // The rule names the socket's own directory, not the one above it.
    let rule_line = log
        .lines()
        .find(|l| l.contains("unix_connect"))
        .unwrap_or_else(|| panic!("no unix_connect in the log: {log}"));
    let own = std::fs::canonicalize(&own).unwrap().display().to_string();
    let dir = std::fs::canonicalize(s.env.dir.path())
        .unwrap()
        .display()
        .to_string();
    assert!(rule_line.contains(&format!("\"{own}\"")), "{rule_line}");
    assert!(!rule_line.contains(&format!("\"{dir}\"")), "{rule_line}");
    assert!(!log.contains("holds more than it"), "{log}");
    // The upstream itself is still reached.
    let info = qemu_img_info(gw.port, &s.client);
    assert!(info.status.success(), "{}\n{}", text(&info), gw.log());
    let abi = kernel_landlock_abi();
    if abi < ABI_RESOLVE_UNIX {
        println!("SKIPPED (the connect itself): this kernel's Landlock ABI is {abi}; connecting to pathname Unix sockets is a Landlock right from ABI {ABI_RESOLVE_UNIX} (Linux 7.1) on");
        assert!(abi < ABI_RESOLVE_UNIX);
        return;
    }
    assert!(
        log.contains("debug probe: cannot connect") && log.contains("Permission denied"),
        "{log}"
    );
}

/// A socket among other files: the rule must still be its directory (a
/// rule on the socket file would not survive the upstream's restart),
/// and the log says so, with the advice.
#[test]
fn an_upstream_in_a_shared_directory_is_said_and_survives_its_restart() {
    let mut s = setup();
    let gw = NbdgwProcess::in_front_of_certs(&s.secret, &s.upstream.socket, &[]);
    assert!(gw.log().contains("holds more than it"), "{}", gw.log());
    assert!(qemu_img_info(gw.port, &s.client).status.success());
    s.upstream.restart();
    let info = qemu_img_info(gw.port, &s.client);
    assert!(info.status.success(), "{}\n{}", text(&info), gw.log());
}

#[test]
fn landlock_required_starts_only_with_full_enforcement() {
    let s = setup();
    let abi = kernel_landlock_abi();
    let args = [
        OsStr::new("--tls-dir"),
        s.secret.as_os_str(),
        OsStr::new("--upstream"),
        s.upstream.socket.as_os_str(),
        OsStr::new("--landlock"),
        OsStr::new("required"),
    ];
    if abi < ABI_RESOLVE_UNIX {
        println!("this kernel's Landlock ABI is {abi} (< {ABI_RESOLVE_UNIX}): --landlock required must refuse to start");
        let said = common::process::start_must_fail(args);
        assert!(said.contains("--landlock required"), "{said}");
        assert!(said.contains(&format!("ABI {abi}")), "{said}");
        assert!(!said.contains("serving"), "{said}");
    } else {
        let gw = NbdgwProcess::start(args);
        let info = qemu_img_info(gw.port, &s.client);
        assert!(info.status.success(), "{}\n{}", text(&info), gw.log());
        assert!(
            gw.log().contains("enforcement=\"full\"") || gw.log().contains("enforcement=full"),
            "{}",
            gw.log()
        );
    }
}
