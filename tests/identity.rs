//! Client certificates, allow-lists, certificate directories and live
//! rotation, with the nbdgw binary, a real qemu-nbd upstream, and real
//! clients (qemu-img, nbdinfo, nbdcopy) presenting client certificates.

mod common;

use std::ffi::OsStr;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::clients::{
    connect_as, nbdinfo_size, nbds_uri, qemu_img_info, text, write_server_files,
};
use common::pki::{anonymous_client_dir, Ca, ClientDir, Leaf};
use common::process::{NbdgwProcess, UpstreamCounter};
use common::raw::{client_tls, RawClient};
use common::{run, run_ok, Env, QemuNbd};
use nbdgw::proto::transmission::ReplyMode;

const IMAGE_LEN: usize = 1 << 20;

/// A gateway requiring client certificates of one CA, with a CRL and
/// all three allow-lists, in front of a connection-counting relay.
struct Policy {
    env: Env,
    image: PathBuf,
    _upstream: QemuNbd,
    counter: UpstreamCounter,
    ca: Ca,
    other_ca: Ca,
    gw: NbdgwProcess,
}

impl Policy {
    fn new() -> Self {
        let env = Env::new();
        let image = env.random_image("disk.img", IMAGE_LEN, 3);
        let upstream = QemuNbd::start(&env, &image, &[]);
        let counter = UpstreamCounter::start(&upstream.socket, &env.path("counted.sock"));
        let ca = Ca::new("nbdgw test CA");
        let (cert, key, client_ca) =
            write_server_files(&env.path("server"), &ca.server("localhost"), &ca);
        let crl = env.path("server/crl.pem");
        std::fs::write(&crl, ca.crl(&[66])).unwrap();
        let args: Vec<&OsStr> = vec![
            "--upstream".as_ref(),
            counter.socket.as_os_str(),
            "--tls-cert".as_ref(),
            cert.as_os_str(),
            "--tls-key".as_ref(),
            key.as_os_str(),
            "--tls-client-ca".as_ref(),
            client_ca.as_os_str(),
            "--tls-crl".as_ref(),
            crl.as_os_str(),
            "--allow-cn".as_ref(),
            "backup-agent".as_ref(),
            "--allow-dns".as_ref(),
            "*.clients.example".as_ref(),
            "--allow-uri".as_ref(),
            "spiffe://example.org/ns/*/sa/backup".as_ref(),
        ];
        let gw = NbdgwProcess::start(args);
        let log = gw.log();
        assert!(
            log.contains("client_auth=required (1 CA certificate(s)") && log.contains("1 CRL(s)"),
            "{log}"
        );
        Policy {
            env,
            image,
            _upstream: upstream,
            counter,
            ca,
            other_ca: Ca::new("some other CA"),
            gw,
        }
    }
}

#[test]
fn clients_named_by_the_allow_lists_read_with_qemu_img_and_nbdcopy() {
    let p = Policy::new();
    let accepted = [
        ("cn", p.ca.client("backup-agent", &[], &[], 10)),
        (
            "dns",
            p.ca.client("node", &["node1.clients.example"], &[], 11),
        ),
        (
            "uri",
            p.ca.client("svc", &[], &["spiffe://example.org/ns/prod/sa/backup"], 12),
        ),
    ];
    for (name, leaf) in &accepted {
        let dir = leaf.client_dir(&p.env.path(&format!("client-{name}")), &p.ca);
        let info = qemu_img_info(p.gw.port, &dir);
        assert!(info.status.success(), "{name}: {}", text(&info));
        assert!(
            String::from_utf8_lossy(&info.stdout).contains("virtual size: 1 MiB"),
            "{name}"
        );
        let copy = p.env.path(&format!("copy-{name}.img"));
        run_ok(
            Command::new("nbdcopy")
                .arg(nbds_uri(p.gw.port, &dir))
                .arg(&copy),
        );
        assert_eq!(
            std::fs::read(&copy).unwrap(),
            std::fs::read(&p.image).unwrap(),
            "{name}"
        );
    }
    let upstream_connections = p.counter.connections();
    assert!(upstream_connections >= 6, "{upstream_connections}");
}

#[test]
fn refused_clients_get_an_alert_in_qemu_img_and_nbdinfo_and_never_reach_the_upstream() {
    let p = Policy::new();
    let upstream_connections = p.counter.connections();

    let refused: Vec<(&str, PathBuf, &str)> = vec![
        (
            "no certificate",
            anonymous_client_dir(&p.env.path("client-none"), &p.ca),
            "peer sent no certificates",
        ),
        (
            "another CA",
            p.other_ca
                .client("backup-agent", &[], &[], 10)
                .client_dir_trusting(&p.env.path("client-other-ca"), &[&p.ca, &p.other_ca]),
            // GnuTLS offers only a certificate from a CA the server's
            // request names, so these clients send none at all.
            "peer sent no certificates",
        ),
        (
            "revoked",
            p.ca.client("backup-agent", &[], &[], 66)
                .client_dir(&p.env.path("client-revoked"), &p.ca),
            "Revoked",
        ),
        (
            "wrong CN",
            p.ca.client("intruder", &[], &[], 21)
                .client_dir(&p.env.path("client-cn"), &p.ca),
            "no name matches",
        ),
        (
            "wrong DNS",
            p.ca.client("intruder", &["node1.other.example"], &[], 22)
                .client_dir(&p.env.path("client-dns"), &p.ca),
            "no name matches",
        ),
        (
            "wrong URI",
            p.ca.client(
                "intruder",
                &[],
                &["spiffe://example.org/ns/prod/sa/other"],
                23,
            )
            .client_dir(&p.env.path("client-uri"), &p.ca),
            "no name matches",
        ),
    ];
    for (case, dir, reason) in &refused {
        let before = p.gw.count_in_log(reason);
        let qemu = qemu_img_info(p.gw.port, dir);
        assert!(!qemu.status.success(), "{case}: qemu-img was let in");
        let libnbd = nbdinfo_size(p.gw.port, dir);
        assert!(!libnbd.status.success(), "{case}: nbdinfo was let in");
        // What users see, for the record (the closing note quotes it).
        eprintln!(
            "{case}:\n  qemu-img: {}\n  nbdinfo: {}",
            text(&qemu),
            text(&libnbd)
        );
        for (client, out) in [("qemu-img", &qemu), ("nbdinfo", &libnbd)] {
            assert!(
                text(out).contains("A TLS fatal alert has been received"),
                "{case}, {client}: {}",
                text(out)
            );
        }
        p.gw.wait_for_log(reason, before + 2);
    }
    assert_eq!(
        p.counter.connections(),
        upstream_connections,
        "a refused client reached the upstream"
    );
    let log = p.gw.log();
    assert!(
        log.contains("client certificate refused")
            && log.contains(
                "subject \"CN=intruder\", URI [\"spiffe://example.org/ns/prod/sa/other\"]"
            ),
        "{log}"
    );
    assert!(
        log.contains("subject \"CN=backup-agent\", serial 42"),
        "the revoked client (serial 0x42 = 66) is named: {log}"
    );
}

#[test]
fn refusals_send_the_alert_that_says_why() {
    let p = Policy::new();
    // The alerts, seen with a client that sends its certificate whatever
    // the server asks for (in TLS 1.3 on the first read after the handshake).
    let raw_cases = [
        (
            p.ca.client("intruder", &[], &[], 30),
            "AccessDenied",
            "no name matches",
        ),
        (
            p.other_ca.client("backup-agent", &[], &[], 31),
            "UnknownCA",
            "UnknownIssuer",
        ),
    ];
    for (leaf, alert, logged) in raw_cases {
        let dir = leaf.client_dir(&p.env.path("raw-client"), &p.ca);
        let before = p.gw.count_in_log(logged);
        let mut raw = RawClient::handshake(p.gw.addr());
        let refusal = raw
            .try_starttls(client_tls(
                &dir.join("ca-cert.pem"),
                Some((&dir.join("client-cert.pem"), &dir.join("client-key.pem"))),
                &[],
            ))
            .and_then(|()| {
                raw.send_option(nbdgw::proto::consts::OPT_LIST, &[]);
                raw.try_read_option_reply().map(|_| ())
            })
            .unwrap_err()
            .to_string();
        assert!(refusal.contains(alert), "{refusal}");
        p.gw.wait_for_log(logged, before + 1);
    }
    assert!(
        p.gw.log()
            .contains("subject \"CN=backup-agent\", serial 1F"),
        "the other CA's client is named: {}",
        p.gw.log()
    );
    assert_eq!(
        p.counter.connections(),
        0,
        "a refused client reached the upstream"
    );
}

/// The Kubernetes Secret volume layout: files are symlinks into `..data`,
/// itself a symlink to a timestamped directory, swapped atomically.
struct SecretVolume {
    dir: PathBuf,
    version: usize,
}

impl SecretVolume {
    fn new(dir: &Path, files: &[(&str, &str)]) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let mut volume = SecretVolume {
            dir: dir.to_owned(),
            version: 0,
        };
        volume.publish(files);
        for (name, _) in files {
            symlink(format!("..data/{name}"), dir.join(name)).unwrap();
        }
        volume
    }

    /// Writes a new version and swaps `..data` to it by rename, as the
    /// kubelet does, then removes the old version.
    fn publish(&mut self, files: &[(&str, &str)]) {
        self.version += 1;
        let version = format!("..2026_11_30_00_00_{:02}.{}", self.version, self.version);
        let new = self.dir.join(&version);
        std::fs::create_dir(&new).unwrap();
        for (name, contents) in files {
            std::fs::write(new.join(name), contents).unwrap();
        }
        let tmp = self.dir.join("..data_tmp");
        symlink(&version, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
        if self.version > 1 {
            let old = format!(
                "..2026_11_30_00_00_{:02}.{}",
                self.version - 1,
                self.version - 1
            );
            std::fs::remove_dir_all(self.dir.join(old)).unwrap();
        }
    }
}

fn secret_files<'a>(server: &'a Leaf, ca: &'a Ca) -> [(&'static str, &'a str); 3] {
    [
        ("tls.crt", server.cert.as_str()),
        ("tls.key", server.key.as_str()),
        ("ca.crt", ca.pem.as_str()),
    ]
}

#[test]
fn tls_dir_reads_the_qemu_and_the_kubernetes_layouts() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 4);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let ca = Ca::new("dir CA");
    let good = ca
        .client("agent", &[], &[], 10)
        .client_dir(&env.path("good"), &ca);
    let revoked = ca
        .client("agent", &[], &[], 66)
        .client_dir(&env.path("revoked"), &ca);
    let anonymous = anonymous_client_dir(&env.path("anonymous"), &ca);

    // qemu/nbdkit layout, with a CRL.
    let qemu_dir = env.path("qemu-layout");
    let server = ca.server("localhost");
    std::fs::create_dir_all(&qemu_dir).unwrap();
    for (name, contents) in [
        ("server-cert.pem", server.cert.clone()),
        ("server-key.pem", server.key.clone()),
        ("ca-cert.pem", ca.pem.clone()),
        ("ca-crl.pem", ca.crl(&[66])),
    ] {
        std::fs::write(qemu_dir.join(name), contents).unwrap();
    }
    let gw = NbdgwProcess::start([
        OsStr::new("--upstream"),
        upstream.socket.as_os_str(),
        OsStr::new("--tls-dir"),
        qemu_dir.as_os_str(),
        OsStr::new("--tls-reload-interval"),
        OsStr::new("1"),
    ]);
    assert!(nbdinfo_size(gw.port, &good).status.success());
    assert!(qemu_img_info(gw.port, &good).status.success());
    assert!(!nbdinfo_size(gw.port, &revoked).status.success());
    assert!(!qemu_img_info(gw.port, &anonymous).status.success());
    let log = gw.log();
    assert!(log.contains("qemu-layout/ca-cert.pem, 1 CRL(s))"), "{log}");
    assert!(log.contains("Revoked"), "{log}");

    // A new CRL that also revokes the good client: reloaded with the rest,
    // it refuses that client from then on.
    std::fs::write(qemu_dir.join("ca-crl.pem"), ca.crl(&[10, 66])).unwrap();
    gw.wait_for_log("TLS certificate reloaded", 1);
    let refused = nbdinfo_size(gw.port, &good);
    assert!(!refused.status.success(), "a revoked client was let in");
    gw.wait_for_log("serial 0A reason=invalid peer certificate: Revoked", 1);
    assert!(qemu_img_info(gw.port, &anonymous).status.code() != Some(0));

    // Kubernetes Secret layout, through the ..data symlinks.
    let server = ca.server("k8s-server");
    let secret = SecretVolume::new(&env.path("secret"), &secret_files(&server, &ca));
    let gw = NbdgwProcess::start([
        OsStr::new("--upstream"),
        upstream.socket.as_os_str(),
        OsStr::new("--tls-dir"),
        secret.dir.as_os_str(),
    ]);
    let info = qemu_img_info(gw.port, &good);
    assert!(info.status.success(), "{}", text(&info));
    assert!(nbdinfo_size(gw.port, &good).status.success());
    assert!(!nbdinfo_size(gw.port, &anonymous).status.success());
    assert_eq!(served_cert(&gw, &good), server.der());
    let log = gw.log();
    assert!(log.contains("subject=CN=k8s-server"), "{log}");
    assert!(log.contains("secret/ca.crt, 0 CRL(s))"), "{log}");
}

/// The server certificate a new connection is shown, fetched with a client
/// certificate from `client_dir`.
fn served_cert(gw: &NbdgwProcess, client_dir: &Path) -> Vec<u8> {
    connect(gw, client_dir).server_cert()
}

fn connect(gw: &NbdgwProcess, client_dir: &Path) -> RawClient {
    connect_as(gw.addr(), client_dir)
}

fn wait_until_served(gw: &NbdgwProcess, client_dir: &Path, expected: &Leaf) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while served_cert(gw, client_dir) != expected.der() {
        assert!(
            Instant::now() < deadline,
            "new certificate never served:\n{}",
            gw.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A connection in transmission, checked against the image as it reads.
struct Reader {
    client: RawClient,
    image: Vec<u8>,
    cookie: u64,
}

impl Reader {
    fn open(gw: &NbdgwProcess, client_dir: &Path, image: &Path) -> Self {
        let mut client = connect(gw, client_dir);
        client.go(ReplyMode::Structured);
        Reader {
            client,
            image: std::fs::read(image).unwrap(),
            cookie: 0,
        }
    }

    fn check(&mut self, offset: usize) {
        self.cookie += 1;
        let got = self.client.read(self.cookie, offset as u64, 65536);
        assert!(
            got == self.image[offset..offset + 65536],
            "wrong data at {offset}"
        );
    }
}

/// An upstream, a CA, a client of it, and two server certificates to
/// rotate between.
struct Rotation {
    env: Env,
    image: PathBuf,
    upstream: QemuNbd,
    ca: Ca,
    client: PathBuf,
    first: Leaf,
    second: Leaf,
}

impl Rotation {
    fn new() -> Self {
        let env = Env::new();
        let image = env.random_image("disk.img", IMAGE_LEN, 5);
        let upstream = QemuNbd::start(&env, &image, &[]);
        let ca = Ca::new("rotation CA");
        let client = ca
            .client("agent", &[], &[], 10)
            .client_dir(&env.path("client"), &ca);
        Rotation {
            first: ca.server("first"),
            second: ca.server("second"),
            env,
            image,
            upstream,
            ca,
            client,
        }
    }

    fn gateway(&self, tls: &[&OsStr]) -> NbdgwProcess {
        NbdgwProcess::start(
            [OsStr::new("--upstream"), self.upstream.socket.as_os_str()]
                .into_iter()
                .chain(tls.iter().copied()),
        )
    }

    /// Certificate, key and client CA as single files, replaced by rename.
    fn files(&self) -> PathBuf {
        let files = self.env.path("files");
        std::fs::create_dir_all(&files).unwrap();
        std::fs::write(files.join("ca.pem"), &self.ca.pem).unwrap();
        install(&files, &self.first);
        files
    }

    fn gateway_on_files(&self, files: &Path, interval: &str) -> NbdgwProcess {
        let (cert, key, ca) = (
            files.join("cert.pem"),
            files.join("key.pem"),
            files.join("ca.pem"),
        );
        self.gateway(&[
            "--tls-cert".as_ref(),
            cert.as_os_str(),
            "--tls-key".as_ref(),
            key.as_os_str(),
            "--tls-client-ca".as_ref(),
            ca.as_os_str(),
            "--tls-reload-interval".as_ref(),
            interval.as_ref(),
        ])
    }
}

/// Writes the leaf's certificate and key beside, then renames them over.
fn install(files: &Path, leaf: &Leaf) {
    for (name, contents) in [("cert.pem", &leaf.cert), ("key.pem", &leaf.key)] {
        let tmp = files.join(format!("{name}.tmp"));
        std::fs::write(&tmp, contents).unwrap();
        std::fs::rename(&tmp, files.join(name)).unwrap();
    }
}

#[test]
fn rotation_by_kubernetes_symlink_swap_and_a_broken_version_kept_out() {
    let r = Rotation::new();
    let mut secret = SecretVolume::new(&r.env.path("secret"), &secret_files(&r.first, &r.ca));
    let gw = r.gateway(&[
        "--tls-dir".as_ref(),
        secret.dir.as_os_str(),
        "--tls-reload-interval".as_ref(),
        "1".as_ref(),
    ]);
    assert_eq!(served_cert(&gw, &r.client), r.first.der());
    let mut before = Reader::open(&gw, &r.client, &r.image);
    before.check(0);
    secret.publish(&secret_files(&r.second, &r.ca));
    wait_until_served(&gw, &r.client, &r.second);
    before.check(512 * 1024);
    assert!(nbdinfo_size(gw.port, &r.client).status.success());
    assert_eq!(gw.count_in_log("TLS certificate reloaded"), 1);

    // A broken version (a key that is not PEM): the old certificate stays.
    let broken = [
        ("tls.crt", r.ca.server("broken").cert),
        ("tls.key", "not a key".to_string()),
        ("ca.crt", r.ca.pem.clone()),
    ];
    secret.publish(
        &broken
            .iter()
            .map(|(n, c)| (*n, c.as_str()))
            .collect::<Vec<_>>(),
    );
    gw.wait_for_log("TLS reload failed", 1);
    assert_eq!(served_cert(&gw, &r.client), r.second.der());
    before.check(IMAGE_LEN - 65536);
    assert!(qemu_img_info(gw.port, &r.client).status.success());
    let log = gw.log();
    assert!(log.contains("tls.key holds no private key"), "{log}");
}

#[test]
fn rotation_by_files_renamed_over() {
    let r = Rotation::new();
    let files = r.files();
    let gw = r.gateway_on_files(&files, "1");
    let mut before = Reader::open(&gw, &r.client, &r.image);
    install(&files, &r.second);
    wait_until_served(&gw, &r.client, &r.second);
    before.check(65536);
}

#[test]
fn rotation_by_sighup_alone_and_a_mismatched_key_kept_out() {
    let r = Rotation::new();
    let files = r.files();
    let gw = r.gateway_on_files(&files, "0");
    let mut before = Reader::open(&gw, &r.client, &r.image);
    install(&files, &r.second);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        served_cert(&gw, &r.client),
        r.first.der(),
        "reloaded without SIGHUP"
    );
    gw.signal("HUP");
    gw.wait_for_log("TLS certificate reloaded", 1);
    assert_eq!(served_cert(&gw, &r.client), r.second.der());
    before.check(128 * 1024);

    // A key that does not belong to the certificate, then SIGHUP.
    let third = r.ca.server("third");
    std::fs::write(files.join("cert.pem"), &third.cert).unwrap();
    gw.signal("HUP");
    gw.wait_for_log("TLS reload failed", 1);
    assert!(gw.log().contains("cannot be used together"), "{}", gw.log());
    assert_eq!(served_cert(&gw, &r.client), r.second.der());
    before.check(256 * 1024);
    assert!(nbdinfo_size(gw.port, &r.client).status.success());
    drop(before);
    let (status, _) = gw.stop();
    assert!(status.success());
}

#[test]
fn certs_command_output_works_with_qemu_nbd_qemu_img_and_libnbd() {
    let env = Env::new();
    let bin = common::process::nbdgw_binary();
    let dir = env.path("generated");
    let spiffe = "spiffe://example.org/ns/backup/sa/agent";
    run_ok(
        Command::new(&bin)
            .args(["certs", "--client-uri", spiffe, "--out"])
            .arg(&dir),
    );
    let client = nbdgw::tls::CertInfo::from_der(
        &rustls::pki_types::pem::PemObject::from_pem_file(dir.join("client-cert.pem"))
            .map(|c: rustls::pki_types::CertificateDer| c.to_vec())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(client.uris, vec![spiffe.to_string()]);
    assert_eq!(client.common_names, vec!["nbdgw-client".to_string()]);

    // qemu-nbd serves TLS from the same directory (it requires client
    // certificates by default: verify-peer is on for servers).
    let image = env.random_image("disk.img", IMAGE_LEN, 6);
    let port = common::free_port();
    let mut qemu_nbd = Command::new("qemu-nbd")
        .arg("--object")
        .arg(format!(
            "tls-creds-x509,id=tls0,dir={},endpoint=server",
            dir.display()
        ))
        .args([
            "--tls-creds",
            "tls0",
            "-f",
            "raw",
            "--persistent",
            "-b",
            "127.0.0.1",
            "-p",
        ])
        .arg(port.to_string())
        .arg(&image)
        .spawn()
        .unwrap();
    common::wait_until_listening(port, "qemu-nbd", || {
        qemu_nbd.try_wait().unwrap().map(|s| s.to_string())
    })
    .unwrap();
    let info = qemu_img_info(port, &dir);
    let libnbd = nbdinfo_size(port, &dir);
    let _ = qemu_nbd.kill();
    let _ = qemu_nbd.wait();
    assert!(info.status.success(), "{}", text(&info));
    assert_eq!(
        String::from_utf8_lossy(&libnbd.stdout).trim(),
        IMAGE_LEN.to_string()
    );

    // And nbdgw from the same directory, admitting the SPIFFE ID, set up
    // through the environment as in a Kubernetes manifest (a list in one
    // variable).
    let upstream = QemuNbd::start(&env, &image, &[]);
    let gw = NbdgwProcess::start_with(
        [OsStr::new("--upstream"), upstream.socket.as_os_str()],
        &[
            ("NBDGW_TLS_DIR", dir.as_os_str()),
            (
                "NBDGW_ALLOW_URI",
                OsStr::new("spiffe://example.org/ns/other/sa/x,spiffe://example.org/ns/*/sa/agent"),
            ),
        ],
    );
    let info = qemu_img_info(gw.port, &dir);
    assert!(info.status.success(), "{}", text(&info));
    let size = nbdinfo_size(gw.port, &dir);
    assert_eq!(
        String::from_utf8_lossy(&size.stdout).trim(),
        IMAGE_LEN.to_string()
    );
}

#[test]
fn tls_min_version_13_refuses_tls_12_clients_and_expiry_is_warned() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 7);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let certs = env.certs();
    let args = |version: &'static str| {
        [
            OsStr::new("--upstream"),
            upstream.socket.as_os_str(),
            OsStr::new("--tls-cert"),
        ]
        .into_iter()
        .map(OsStr::to_os_string)
        .chain([
            certs.join("server-cert.pem").into_os_string(),
            "--tls-key".into(),
            certs.join("server-key.pem").into_os_string(),
            "--tls-min-version".into(),
            version.into(),
        ])
        .collect::<Vec<_>>()
    };
    let tls12_only = || client_tls(&certs.join("ca-cert.pem"), None, &[&rustls::version::TLS12]);

    let gw = NbdgwProcess::start(args("1.3"));
    // Env's certificates are valid for two days.
    assert!(
        gw.log()
            .contains("the served certificate expires within 7 days"),
        "{}",
        gw.log()
    );
    let mut c = RawClient::handshake(gw.addr());
    let err = c.try_starttls(tls12_only()).unwrap_err().to_string();
    assert!(err.contains("ProtocolVersion"), "{err}");
    let mut c = RawClient::handshake(gw.addr());
    c.starttls(&certs);
    c.go(ReplyMode::Structured);

    let gw = NbdgwProcess::start(args("1.2"));
    let mut c = RawClient::handshake(gw.addr());
    c.try_starttls(tls12_only())
        .expect("TLS 1.2 accepted by default");
    c.go(ReplyMode::Structured);
    let bad = run(Command::new(common::process::nbdgw_binary()).args(["--tls-min-version", "1.1"]));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("possible values: 1.2, 1.3"));
}
