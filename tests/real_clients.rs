//! Unmodified clients — qemu-img with tls-creds-x509, and libnbd's nbdinfo
//! and nbdcopy — through the gateway to a real qemu-nbd, with data checked
//! byte for byte against the upstream read directly.

mod common;

use std::ffi::OsStr;
use std::process::Command;

use common::process::NbdgwProcess;
use common::{pattern, run, run_ok, Env, Gateway, QemuNbd};

const SIZE: usize = 8 << 20;

#[test]
fn qemu_img_reads_and_writes_through_the_gateway() {
    // qemu 10 negotiates extended headers.
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 3);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let gateway = Gateway::start(env.config(&upstream.socket));
    let (object, opts) = gateway.qemu_args(&env);

    let source = common::qemu_img_copy_both_ways(&env, &upstream, (&object, &opts), SIZE, 4);

    // And qemu-img's own comparison through the gateway.
    let out = run_ok(
        Command::new("qemu-img")
            .args(["compare", "--object", &object, "--image-opts"])
            .arg(format!("driver=raw,file.filename={}", source.display()))
            .arg(&opts),
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("Images are identical"));
}

#[test]
fn libnbd_nbdinfo_and_nbdcopy_through_the_gateway() {
    // libnbd 1.14 negotiates structured replies.
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 5);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let gateway = Gateway::start(env.config(&upstream.socket));
    let uri = gateway.uri(&env);

    let out = run_ok(Command::new("nbdinfo").arg("--size").arg(&uri));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        SIZE.to_string()
    );
    let out = run_ok(Command::new("nbdinfo").arg(&uri));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("with TLS"), "{text}");

    let copy = env.path("copy.img");
    run_ok(Command::new("nbdcopy").arg(&uri).arg(&copy));
    assert_eq!(std::fs::read(&copy).unwrap(), upstream.read_direct());

    let source = env.path("new.img");
    std::fs::write(&source, pattern(SIZE, 6)).unwrap();
    run_ok(Command::new("nbdcopy").arg(&source).arg(&uri));
    assert_eq!(upstream.read_direct(), pattern(SIZE, 6));

    // Several connections at once (nbdcopy uses multi-conn when offered).
    let copy2 = env.path("copy2.img");
    run_ok(
        Command::new("nbdcopy")
            .args(["--connections=4", "--requests=16"])
            .arg(&uri)
            .arg(&copy2),
    );
    assert_eq!(std::fs::read(&copy2).unwrap(), pattern(SIZE, 6));
}

#[test]
fn block_status_through_the_gateway_equals_the_upstream() {
    let env = Env::new();
    // A raw backing file with two data islands under a qcow2 overlay that
    // has one of its own, so allocation depth has 0, 1 and 2 in it.
    let base = env.path("base.img");
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::File::create(&base).unwrap();
        f.set_len(SIZE as u64).unwrap();
        f.seek(SeekFrom::Start(1 << 20)).unwrap();
        f.write_all(&pattern(512 << 10, 7)).unwrap();
        f.seek(SeekFrom::Start(5 << 20)).unwrap();
        f.write_all(&pattern(256 << 10, 8)).unwrap();
    }
    let overlay = env.path("overlay.qcow2");
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
            .arg(&base)
            .arg(&overlay),
    );
    run_ok(
        Command::new("qemu-io")
            .args(["-f", "qcow2", "-c", "write -P 0x5a 3M 192k"])
            .arg(&overlay),
    );
    let upstream = QemuNbd::start(&env, &overlay, &["-f", "qcow2", "-A"]);
    let gateway = Gateway::start(env.config(&upstream.socket));
    for context in ["base:allocation", "qemu:allocation-depth"] {
        let map = |uri: &str| {
            let out = run_ok(
                Command::new("nbdinfo")
                    .arg(format!("--map={context}"))
                    .arg(uri),
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        let through = map(&gateway.uri(&env));
        let direct = map(&upstream.unix_uri());
        assert_eq!(through, direct, "{context}");
        assert!(
            through.lines().count() >= 3,
            "{context} map too simple: {through}"
        );
    }
    // qemu-img map goes through qemu's client with extended headers.
    let (object, opts) = gateway.qemu_args(&env);
    let through = run_ok(Command::new("qemu-img").args([
        "map",
        "--output=json",
        "--object",
        &object,
        "--image-opts",
        &opts,
    ]));
    let direct = run_ok(
        Command::new("qemu-img")
            .args(["map", "--output=json", "-f", "raw"])
            .arg(upstream.unix_uri()),
    );
    assert_eq!(through.stdout, direct.stdout);
}

#[test]
fn upstream_missing_gives_clients_a_clear_error() {
    let env = Env::new();
    let gateway = Gateway::start(env.config(&env.path("no-such.sock")));
    // libnbd reports NBD_REP_ERR_SHUTDOWN as ESHUTDOWN and shows the
    // server's message in its debug output.
    let out = run(Command::new("nbdinfo")
        .env("LIBNBD_DEBUG", "1")
        .arg(gateway.uri(&env)));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Cannot send after transport endpoint shutdown"),
        "{err}"
    );
    assert!(
        err.contains("server error message: nbdgw: upstream NBD server unavailable"),
        "{err}"
    );
    // The socket's path is for the gateway's log, not its clients.
    assert!(!err.contains("no-such.sock"), "{err}");

    let (object, opts) = gateway.qemu_args(&env);
    let out =
        run(Command::new("qemu-img").args(["info", "--object", &object, "--image-opts", &opts]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("server reported: nbdgw: upstream NBD server unavailable"),
        "{err}"
    );
    assert!(!err.contains("no-such.sock"), "{err}");
}

#[test]
fn the_command_line_certs_serve_and_sigterm() {
    let env = Env::new();
    let bin = common::process::nbdgw_binary();
    let dir = env.path("generated");
    let out = run_ok(Command::new(&bin).args(["certs", "--out"]).arg(&dir));
    let listed = String::from_utf8_lossy(&out.stdout);
    for f in [
        "ca-cert.pem",
        "server-cert.pem",
        "server-key.pem",
        "client-cert.pem",
        "client-key.pem",
    ] {
        assert!(listed.contains(f), "{listed}");
    }
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.join("server-key.pem"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let again = run(Command::new(&bin).args(["certs", "--out"]).arg(&dir));
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
    run_ok(
        Command::new(&bin)
            .args(["certs", "--force", "--out"])
            .arg(&dir),
    );

    let image = env.random_image("disk.img", 1 << 20, 9);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let gateway = NbdgwProcess::start_with(
        [OsStr::new("--upstream"), upstream.socket.as_os_str()],
        &[
            ("NBDGW_TLS_CERT", dir.join("server-cert.pem").as_os_str()),
            ("NBDGW_TLS_KEY", dir.join("server-key.pem").as_os_str()),
        ],
    );
    let uri = common::clients::nbds_uri(gateway.port, &dir);
    let copy = env.path("copy.img");
    run_ok(Command::new("nbdcopy").arg(&uri).arg(&copy));
    assert_eq!(
        std::fs::read(&copy).unwrap(),
        std::fs::read(&image).unwrap()
    );

    // A health probe that connects and resets: routine, not a warning.
    let probe = std::net::TcpStream::connect(gateway.addr()).unwrap();
    socket2::SockRef::from(&probe)
        .set_linger(Some(std::time::Duration::ZERO))
        .unwrap();
    drop(probe);
    gateway.wait_for_log("error=client closed the connection before", 1);

    let (status, log) = gateway.stop();
    assert!(status.success(), "{status:?}");
    assert!(!log.contains(" WARN "), "{log}");
    assert!(log.contains("upstream SO_SNDBUF"), "{log}");
    assert!(log.contains("TLS certificate loaded"), "{log}");
    assert!(log.contains("negotiated"), "{log}");
    assert!(log.contains("SIGTERM received"), "{log}");

    // Missing required flags: a clear error, not a panic.
    let out = run(Command::new(&bin).env_remove("NBDGW_TLS_CERT"));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("--upstream, --export or --export-dir is required"));
    let out = run(Command::new(&bin).args(["--upstream", "/x"]));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tls-cert and --tls-key, or --tls-dir"));
    let out = run(Command::new(&bin).args([
        "--upstream",
        "/x",
        "--tls-dir",
        "/x",
        "--allow-uri",
        "spiffe://a/b*",
    ]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("must stand alone"), "{stderr}");
}
