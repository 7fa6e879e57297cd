//! The systemd units in deploy/systemd as systemd would run them: the
//! service's own ExecStart and Environment, the socket unit's descriptor
//! name, a listening socket passed in by systemd-socket-activate, and the
//! READY=1 / STOPPING=1 notifications on NOTIFY_SOCKET.

mod common;

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::clients::qemu_img_info;
use common::process::NbdgwProcess;
use common::{free_port, run, Env, QemuNbd};

const UNIT_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/systemd");

/// The values of `key=` in a unit file, in order.
fn unit_values(unit: &str, key: &str) -> Vec<String> {
    let text = std::fs::read_to_string(Path::new(UNIT_DIR).join(unit)).unwrap();
    text.lines()
        .filter_map(|line| line.strip_prefix(key)?.strip_prefix('='))
        .map(str::to_string)
        .collect()
}

/// The service's ExecStart with its host paths swapped for the test's.
fn exec_start(certs: &Path, upstream: &Path) -> Vec<String> {
    let line = unit_values("nbdgw.service", "ExecStart").pop().unwrap();
    line.split_whitespace()
        .map(|word| match word {
            "/usr/local/bin/nbdgw" => common::process::nbdgw_binary(),
            "/etc/nbdgw/tls" => certs.display().to_string(),
            "/run/nbd/disk.sock" => upstream.display().to_string(),
            other => other.to_string(),
        })
        .collect()
}

fn receive(notify: &UnixDatagram) -> String {
    let mut buf = [0u8; 512];
    let n = notify.recv(&mut buf).expect("a notification within 10 s");
    String::from_utf8_lossy(&buf[..n]).trim_end().to_string()
}

#[test]
fn the_service_serves_qemu_img_through_a_socket_passed_by_systemd_and_notifies_it() {
    let env = Env::new();
    let image = env.random_image("disk.img", 3 << 20, 4);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let notify_path = env.path("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();

    let port = free_port();
    let fd_name = unit_values("nbdgw.socket", "FileDescriptorName")
        .pop()
        .unwrap();
    let mut cmd = Command::new("systemd-socket-activate");
    cmd.arg(format!("--listen=127.0.0.1:{port}"))
        .arg(format!("--fdname={fd_name}"))
        .arg(format!("--setenv=NOTIFY_SOCKET={}", notify_path.display()));
    for variable in unit_values("nbdgw.service", "Environment") {
        cmd.arg(format!("--setenv={variable}"));
    }
    // The unit passes no --listen; an address nbdgw could not bind shows
    // that it serves on the passed socket rather than binding its own.
    cmd.args(exec_start(&env.certs(), &upstream.socket))
        .args(["--listen", "192.0.2.1:10809"]);
    let gateway = NbdgwProcess::spawn(cmd, port);
    // systemd-socket-activate starts nbdgw on the first connection, which
    // must wait until it has bound the socket (qemu-img once raced it).
    gateway.wait_for_log("Listening on", 1);

    let info = qemu_img_info(port, &env.certs());
    let stdout = String::from_utf8_lossy(&info.stdout);
    assert!(
        info.status.success() && stdout.contains("virtual size: 3 MiB (3145728 bytes)"),
        "qemu-img info through the passed socket: {stdout}\n{}\n{}",
        common::clients::text(&info),
        gateway.log()
    );
    assert_eq!(receive(&notify), "READY=1");
    gateway.wait_for_log("from_systemd=true", 1);

    let (status, log) = gateway.stop();
    assert_eq!(receive(&notify), "STOPPING=1");
    assert!(status.success(), "exit {status}:\n{log}");
}

/// The shipped units and the drop-in, copied where `systemd-analyze
/// verify` finds them by name (`SYSTEMD_UNIT_PATH`, so the drop-in
/// directory is read too), with `extra` as one more drop-in of nbdgw's.
fn verify_units(extra: Option<&str>) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    for unit in [
        "nbdgw.service",
        "nbdgw.socket",
        "nbd-upstream.service",
        "nbdgw.service.d/upstream.conf",
    ] {
        let text = std::fs::read_to_string(Path::new(UNIT_DIR).join(unit)).unwrap();
        // verify checks that ExecStart's binary exists.
        let text = text.replace("/usr/local/bin/nbdgw", &common::process::nbdgw_binary());
        let path = dir.path().join(unit);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    if let Some(extra) = extra {
        std::fs::write(dir.path().join("nbdgw.service.d/zz-test.conf"), extra).unwrap();
    }
    let units: Vec<PathBuf> = ["nbdgw.socket", "nbdgw.service", "nbd-upstream.service"]
        .iter()
        .map(|unit| dir.path().join(unit))
        .collect();
    // The trailing colon keeps systemd's own directories on the path.
    let out = run(Command::new("systemd-analyze")
        .env("SYSTEMD_UNIT_PATH", format!("{}:", dir.path().display()))
        .args(["verify", "--man=no"])
        .args(&units));
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    (out.status.success(), stderr)
}

#[test]
fn the_units_pass_systemd_analyze_verify() {
    let (ok, stderr) = verify_units(None);
    assert!(ok && stderr.is_empty(), "systemd-analyze verify: {stderr}");
}

/// Stop order: systemd stops units in the reverse of their start order,
/// so nbdgw ordered after its NBD server stops (drains) before it. That
/// systemd reads the drop-in's order, and which way, shows in a cycle
/// when the opposite order is added.
#[test]
fn the_drop_in_starts_nbdgw_after_its_upstream_so_it_stops_first() {
    let dropin = |key| {
        let text =
            std::fs::read_to_string(Path::new(UNIT_DIR).join("nbdgw.service.d/upstream.conf"))
                .unwrap();
        text.lines()
            .filter_map(|line| line.strip_prefix(key)?.strip_prefix('='))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(dropin("After"), ["nbd-upstream.service"]);
    // Requisite=, not Requires=: a start of nbdgw (socket activation)
    // must not start a server stopped for maintenance.
    assert_eq!(dropin("Requisite"), ["nbd-upstream.service"]);
    assert!(dropin("Requires").is_empty());
    assert!(dropin("BindsTo").is_empty());
    let (ok, stderr) = verify_units(Some("[Unit]\nBefore=nbd-upstream.service\n"));
    assert!(!ok && stderr.contains("ordering cycle"), "{stderr}");

    // The server serves the socket nbdgw's ExecStart names, as its
    // comments ask, in a directory kept across its restarts.
    let exec = unit_values("nbd-upstream.service", "ExecStart")
        .pop()
        .unwrap();
    assert!(exec.contains("--socket=/run/nbd/disk.sock"), "{exec}");
    assert!(exec.contains("--persistent"), "{exec}");
    let nbdgw_exec = unit_values("nbdgw.service", "ExecStart").pop().unwrap();
    assert!(nbdgw_exec.contains("--upstream /run/nbd/disk.sock"));
    for (key, value) in [
        ("Group", "nbdgw-upstream"),
        ("UMask", "0007"),
        ("RuntimeDirectory", "nbd"),
        ("RuntimeDirectoryPreserve", "restart"),
        // --shared=1024 needs more descriptors than the default soft 1024.
        ("LimitNOFILE", "4096"),
    ] {
        assert_eq!(unit_values("nbd-upstream.service", key), [value], "{key}");
    }
    assert!(unit_values("nbd-upstream.service", "PrivateNetwork").is_empty());
}

#[test]
fn the_service_is_notify_typed_reloads_with_sighup_and_is_hardened() {
    let want = [
        ("Type", "notify"),
        ("ExecReload", "kill -HUP $MAINPID"),
        ("DynamicUser", "yes"),
        ("ProtectSystem", "strict"),
        ("PrivateTmp", "yes"),
        ("NoNewPrivileges", "yes"),
        ("CapabilityBoundingSet", ""),
        (
            "RestrictAddressFamilies",
            "AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        ),
        ("SystemCallFilter", "@system-service"),
        (
            "SystemCallFilter",
            "landlock_create_ruleset landlock_add_rule landlock_restrict_self",
        ),
    ];
    for (key, value) in want {
        let values = unit_values("nbdgw.service", key);
        assert!(
            values.iter().any(|v| v == value),
            "{key}={value} missing: {values:?}"
        );
    }
    let nofile: u64 = unit_values("nbdgw.service", "LimitNOFILE")[0]
        .parse()
        .unwrap();
    assert!(nofile >= 3 * nbdgw::config::DEFAULT_MAX_CONNECTIONS as u64);
}

/// `systemctl restart` keeps the sessions: the unit asks for it, and its
/// store has room for three descriptors per session at the default
/// --max-connections (tests/fdstore_restart.py runs it under systemd).
#[test]
fn the_service_stores_its_sessions_at_a_restart_with_room_for_every_connection() {
    let exec = unit_values("nbdgw.service", "ExecStart").pop().unwrap();
    assert!(
        exec.split_whitespace().any(|w| w == "--handover-fdstore"),
        "{exec}"
    );
    let max: usize = unit_values("nbdgw.service", "FileDescriptorStoreMax")
        .pop()
        .expect("FileDescriptorStoreMax=")
        .parse()
        .unwrap();
    assert!(
        max >= 3 * nbdgw::config::DEFAULT_MAX_CONNECTIONS,
        "FileDescriptorStoreMax={max}"
    );
}
