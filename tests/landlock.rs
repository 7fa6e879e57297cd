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
