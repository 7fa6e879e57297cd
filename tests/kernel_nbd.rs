//! The kernel's own NBD driver over TLS through `nbdgw client`: nbd-client
//! hands `/dev/nbd0` a connection to client mode's Unix socket, client
//! mode speaks verified TLS to the nbdgw server in front of qemu-nbd, and
//! the kernel formats the disk, checks it, and writes and reads back a
//! pattern that must then be in qemu-nbd's image. The kernel here has no
//! `nbd` module, so this runs in the test VM (`scripts/ktls-vm.sh`, which
//! loads it); elsewhere it says SKIPPED and passes.
//!
//! And nbd-client's own TLS (`-certfile/-keyfile/-cacertfile`), straight
//! to the nbdgw server: nbd-client 3.24 does STARTTLS, then TLS 1.2 only
//! (`NORMAL:-VERS-TLS-ALL:+VERS-TLS1.2`, crypto-gnutls.c) in a forked
//! helper in front of the kernel's socket. Of the suites its ClientHello
//! offers (seen by experiment: ECDHE-ECDSA, ECDHE-RSA, RSA and DHE-RSA
//! with AES-GCM, ChaCha20-Poly1305, AES-CCM and AES-CBC), nbdgw (rustls:
//! ECDHE with AEAD only) can agree on six: ECDHE with ECDSA or RSA and
//! AES-128-GCM, AES-256-GCM or ChaCha20-Poly1305. Each is made the only
//! one in common by a GnuTLS system priority file's `[overrides]` (which
//! applies to nbd-client's fixed priority string too) and checked in the
//! server's log; the certificate refusals end nbd-client without a disk.

mod common;

use std::ffi::OsStr;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::pki::Ca;
use common::process::NbdgwProcess;
use common::{pattern, run, Env, QemuNbd};

const SIZE: usize = 64 << 20;
const TAIL: usize = 4 << 20;

/// nbd-client, when this kernel has the nbd module (loaded if need be).
fn kernel_nbd() -> Option<&'static str> {
    let device = Path::new("/dev/nbd0");
    if !device.exists() {
        // No modprobe, or no module: the check below says so.
        let _ = Command::new("modprobe").arg("nbd").output();
    }
    let nbd_client = ["/usr/sbin/nbd-client", "/sbin/nbd-client"]
        .into_iter()
        .find(|p| Path::new(p).exists());
    let (true, Some(nbd_client)) = (device.exists(), nbd_client) else {
        eprintln!("SKIPPED: no /dev/nbd0 (the nbd module) or no nbd-client here; scripts/ktls-vm.sh runs this");
        return None;
    };
    Some(nbd_client)
}

#[test]
fn the_kernel_nbd_driver_formats_and_reads_back_through_client_mode() {
    let Some(nbd_client) = kernel_nbd() else {
        return;
    };
    let device = Path::new("/dev/nbd0");
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 31);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let server = NbdgwProcess::in_front_of(&env, &upstream.socket, &["--landlock", "false"]);
    let socket = env.path("client.sock");
    let server_addr = format!("localhost:{}", server.port);
    let client = NbdgwProcess::client_of(socket.as_os_str(), &server_addr, &env.certs(), &[]);

    let attach = run(Command::new(nbd_client)
        .arg("-u")
        .arg(&socket)
        .arg(device)
        .args(["-b", "4096", "-N", ""]));
    assert!(
        attach.status.success(),
        "nbd-client: {}{}\nclient log:\n{}",
        String::from_utf8_lossy(&attach.stdout),
        String::from_utf8_lossy(&attach.stderr),
        client.log()
    );
    let detach = Detach(nbd_client, device);

    format_and_check(device);
    let data = pattern_through_the_kernel(device, 32);
    drop(detach);

    // It went through TLS to qemu-nbd's image.
    let disk = upstream.read_direct();
    assert!(
        disk[SIZE - TAIL..] == data[..],
        "the image does not hold the pattern"
    );
    assert!(server.log().contains("TLS established"), "{}", server.log());
    assert!(client.log().contains("TLS established"), "{}", client.log());
}

/// The kernel formats the disk and checks it.
fn format_and_check(device: &Path) {
    let mkfs = run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-E", "nodiscard"])
        .arg(device));
    assert!(
        mkfs.status.success(),
        "{}",
        String::from_utf8_lossy(&mkfs.stderr)
    );
    let fsck = run(Command::new("e2fsck").args(["-f", "-n"]).arg(device));
    assert!(
        fsck.status.success(),
        "e2fsck: {}{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
}

/// Writes a pattern over the last 4 MiB with O_DIRECT (past the page
/// cache both ways), reads it back equal, and returns it.
fn pattern_through_the_kernel(device: &Path, seed: u64) -> Vec<u8> {
    let data = pattern(TAIL, seed);
    let at = (SIZE - TAIL) as u64;
    let mut dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(device)
        .expect("open /dev/nbd0");
    let mut aligned = AlignedBuf::new(TAIL);
    aligned.as_mut().copy_from_slice(&data);
    dev.seek(SeekFrom::Start(at)).unwrap();
    dev.write_all(aligned.as_ref())
        .expect("write through the kernel");
    dev.sync_all().expect("flush through the kernel");
    let mut back = AlignedBuf::new(TAIL);
    dev.seek(SeekFrom::Start(at)).unwrap();
    dev.read_exact(back.as_mut())
        .expect("read through the kernel");
    assert!(
        back.as_ref() == &data[..],
        "the kernel read back other bytes"
    );
    data
}

/// `nbd-client -d` when the test ends, passed or not, so the device is
/// free for the next run.
struct Detach<'a>(&'static str, &'a Path);

impl Drop for Detach<'_> {
    fn drop(&mut self) {
        let _ = run(Command::new(self.0).arg("-d").arg(self.1));
    }
}

/// O_DIRECT wants buffers aligned to the logical block size: a slice of
/// a larger vector that starts on a 4 KiB boundary.
struct AlignedBuf {
    bytes: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let bytes = vec![0u8; len + 4096];
        let start = bytes.as_ptr().align_offset(4096);
        AlignedBuf { bytes, start, len }
    }

    fn as_ref(&self) -> &[u8] {
        &self.bytes[self.start..self.start + self.len]
    }

    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.bytes[self.start..self.start + self.len]
    }
}

/// A server certificate for localhost, its key, and the CA that
/// nbd-client checks it with; `kind` is its key's, as TLS 1.2 suites
/// name it.
struct ServerFiles {
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
    kind: &'static str,
}

/// The test's own certificates (`nbdgw certs`: ECDSA P-256).
fn ecdsa_files(env: &Env) -> ServerFiles {
    let certs = env.certs();
    ServerFiles {
        cert: certs.join("server-cert.pem"),
        key: certs.join("server-key.pem"),
        ca: certs.join("ca-cert.pem"),
        kind: "ECDSA",
    }
}

/// An RSA server certificate for localhost from a throw-away RSA CA
/// (`nbdgw certs` makes ECDSA keys only), made with rcgen on aws-lc-rs,
/// which can generate RSA keys: no openssl in the test VM, and no
/// seconds of prime search in a TCG guest's openssl.
fn rsa_files(env: &Env) -> ServerFiles {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, PKCS_RSA_SHA256,
    };
    let dir = env.path("rsa");
    std::fs::create_dir_all(&dir).unwrap();
    let rsa = || KeyPair::generate_for(&PKCS_RSA_SHA256).expect("an RSA-2048 key");
    let ca_key = rsa();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.distinguished_name
        .push(DnType::CommonName, "RSA test CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(ca, ca_key);
    let key = rsa();
    let mut leaf = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    leaf.distinguished_name
        .push(DnType::CommonName, "localhost");
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = leaf.signed_by(&key, &issuer).unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    ServerFiles {
        cert: write("server-cert.pem", &cert.pem()),
        key: write("server-key.pem", &key.serialize_pem()),
        ca: write("ca-cert.pem", &ca_pem),
        kind: "RSA",
    }
}

/// The nbdgw server in front of `upstream` with `files`' certificate,
/// requiring client certificates from `client_ca`.
fn tls_gateway(
    upstream: &QemuNbd,
    files: &ServerFiles,
    client_ca: &Path,
    extra: &[&str],
) -> NbdgwProcess {
    let mut args: Vec<&OsStr> = vec![
        OsStr::new("--upstream"),
        upstream.socket.as_os_str(),
        OsStr::new("--tls-cert"),
        files.cert.as_os_str(),
        OsStr::new("--tls-key"),
        files.key.as_os_str(),
        OsStr::new("--tls-client-ca"),
        client_ca.as_os_str(),
        OsStr::new("--landlock"),
        OsStr::new("false"),
    ];
    args.extend(extra.iter().map(OsStr::new));
    NbdgwProcess::start(args)
}

/// `nbd-client localhost PORT DEVICE` with its own TLS: `identity`'s
/// certificate and key, `ca` to check the server; `priority` a GnuTLS
/// system priority file. Bounded: a hang is a failure, not a stuck test.
fn attach_with_tls(
    nbd_client: &str,
    device: &Path,
    port: u16,
    ca: &Path,
    identity: (&Path, &Path),
    priority: Option<&Path>,
) -> Output {
    let mut cmd = Command::new("timeout");
    cmd.arg("120")
        .arg(nbd_client)
        .arg("localhost")
        .arg(port.to_string())
        .arg(device)
        .args(["-b", "4096", "-N", ""])
        .arg("-certfile")
        .arg(identity.0)
        .arg("-keyfile")
        .arg(identity.1)
        .arg("-cacertfile")
        .arg(ca);
    if let Some(file) = priority {
        cmd.env("GNUTLS_SYSTEM_PRIORITY_FILE", file);
    }
    run(&mut cmd)
}

fn output(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The server's last `TLS established` line.
fn last_tls_line(server: &NbdgwProcess) -> String {
    let log = server.log();
    log.lines()
        .rev()
        .find(|l| l.contains("TLS established"))
        .unwrap_or_else(|| panic!("no TLS session in:\n{log}"))
        .to_string()
}

/// A device's size in 512-byte sectors, as the kernel has it (0: not
/// connected).
fn sectors(device: &Path) -> u64 {
    let name = device.file_name().unwrap().to_str().unwrap();
    std::fs::read_to_string(format!("/sys/block/{name}/size"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// A GnuTLS system priority file that disables every AEAD cipher nbdgw
/// has but `keep`, for nbd-client's fixed priority string as for any.
fn only_cipher(env: &Env, keep: &str) -> PathBuf {
    let file = env.path(&format!("gnutls-only-{keep}.conf"));
    let mut text = String::from("[overrides]\n");
    for cipher in ["AES-128-GCM", "AES-256-GCM", "CHACHA20-POLY1305"] {
        if cipher != keep {
            text.push_str(&format!("tls-disabled-cipher = {cipher}\n"));
        }
    }
    std::fs::write(&file, text).unwrap();
    file
}

/// What every attach of the suite test shares: nbd-client, its
/// identity, the image's qemu-nbd, the test's files.
struct Rig<'a> {
    nbd_client: &'static str,
    identity: (&'a Path, &'a Path),
    upstream: &'a QemuNbd,
    env: &'a Env,
}

/// The suites both nbd-client and nbdgw have: GnuTLS's cipher name, the
/// TLS 1.2 suite's name after its key exchange and signature.
const SUITES: [(&str, &str); 3] = [
    ("AES-128-GCM", "AES_128_GCM_SHA256"),
    ("AES-256-GCM", "AES_256_GCM_SHA384"),
    ("CHACHA20-POLY1305", "CHACHA20_POLY1305_SHA256"),
];

/// The pattern written through `device` (formatted and checked first
/// if `format`) is in the image; the device is detached after.
fn pattern_reaches_the_image(rig: &Rig, device: &Path, seed: u64, what: &str, format: bool) {
    let detach = Detach(rig.nbd_client, device);
    if format {
        format_and_check(device);
    }
    let data = pattern_through_the_kernel(device, seed);
    drop(detach);
    assert!(
        rig.upstream.read_direct()[SIZE - TAIL..] == data[..],
        "{what}: the image does not hold the pattern"
    );
}

/// nbd-client as it comes, its own choice among nbdgw's: the whole disk
/// formatted and checked, a pattern written; secp256r1, the group
/// GnuTLS's NORMAL offers first (docs/design/security.md, key exchange).
fn as_it_comes(rig: &Rig, files: &ServerFiles, client_ca: &Path) {
    let server = tls_gateway(rig.upstream, files, client_ca, &[]);
    let device = Path::new("/dev/nbd1");
    let attach = attach_with_tls(
        rig.nbd_client,
        device,
        server.port,
        &files.ca,
        rig.identity,
        None,
    );
    assert!(
        attach.status.success(),
        "nbd-client: {}\nserver log:\n{}",
        output(&attach),
        server.log()
    );
    pattern_reaches_the_image(rig, device, 34, "as it comes", true);
    let line = last_tls_line(&server);
    assert!(
        line.contains(
            "tls_version=Some(TLSv1_2) cipher_suite=Some(TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256)"
        ) && line.contains("key_exchange=secp256r1 ")
            && line.contains("client=subject \"CN=test-client\""),
        "{line}"
    );
}

/// nbd-client with `cipher` the only one in common with nbdgw: the
/// server's log names `suite`, and a pattern reaches the image.
fn only_suite(
    rig: &Rig,
    server: &NbdgwProcess,
    files: &ServerFiles,
    device: &Path,
    (cipher, suite): (&str, &str),
    seed: u64,
) {
    let only = only_cipher(rig.env, cipher);
    let attach = attach_with_tls(
        rig.nbd_client,
        device,
        server.port,
        &files.ca,
        rig.identity,
        Some(&only),
    );
    assert!(
        attach.status.success(),
        "nbd-client with {} only, {} certificate: {}\nserver log:\n{}",
        cipher,
        files.kind,
        output(&attach),
        server.log()
    );
    let what = format!("{cipher}, {}", files.kind);
    pattern_reaches_the_image(rig, device, seed, &what, false);
    let expected = format!(
        "tls_version=Some(TLSv1_2) cipher_suite=Some(TLS_ECDHE_{}_WITH_{suite})",
        files.kind
    );
    let line = last_tls_line(server);
    assert!(line.contains(&expected), "expected {expected}: {line}");
}

#[test]
fn nbd_client_own_tls_attaches_through_the_gateway_with_every_suite() {
    let Some(nbd_client) = kernel_nbd() else {
        return;
    };
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 33);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let certs = env.certs();
    let (cert, key) = (certs.join("client-cert.pem"), certs.join("client-key.pem"));
    let rig = Rig {
        nbd_client,
        identity: (&cert, &key),
        upstream: &upstream,
        env: &env,
    };
    let client_ca = certs.join("ca-cert.pem");
    as_it_comes(&rig, &ecdsa_files(&env), &client_ca);

    // Each suite both sides have, the only one in common in turn.
    let mut seed = 40;
    for (n, files) in [ecdsa_files(&env), rsa_files(&env)].iter().enumerate() {
        let server = tls_gateway(&upstream, files, &client_ca, &[]);
        for (m, &suite) in SUITES.iter().enumerate() {
            seed += 1;
            // A device of its own each time: a detached one may be busy
            // for a moment while the kernel lets it go.
            let device = PathBuf::from(format!("/dev/nbd{}", 2 + n * SUITES.len() + m));
            only_suite(&rig, &server, files, &device, suite, seed);
        }
    }
}

/// A CA, the server's certificate from it, written in `dir`.
fn refusal_pki(dir: &Path) -> (Ca, ServerFiles) {
    std::fs::create_dir_all(dir).unwrap();
    let ca = Ca::new("kernel test CA");
    let leaf = ca.server("localhost");
    let files = ServerFiles {
        cert: write_in(dir, "server-cert.pem", &leaf.cert),
        key: write_in(dir, "server-key.pem", &leaf.key),
        ca: write_in(dir, "ca-cert.pem", &ca.pem),
        kind: "ECDSA",
    };
    (ca, files)
}

fn write_in(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// nbd-client, refused, failed on its own (not killed by its timeout)
/// and left the kernel no disk.
fn refused_without_a_disk(
    nbd_client: &'static str,
    device: &Path,
    attach: &Output,
    started: Instant,
    who: &str,
) {
    let _detach = Detach(nbd_client, device);
    assert!(
        !attach.status.success(),
        "{who}: attached\n{}",
        output(attach)
    );
    assert!(
        started.elapsed() < Duration::from_secs(110),
        "{who}: nbd-client hung until killed"
    );
    assert_eq!(sectors(device), 0, "{who}: the kernel has a disk");
}

#[test]
fn nbd_client_own_tls_with_a_refused_certificate_gets_no_disk() {
    let Some(nbd_client) = kernel_nbd() else {
        return;
    };
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 35);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let dir = env.path("pki");
    let (ca, files) = refusal_pki(&dir);
    let server = tls_gateway(&upstream, &files, &files.ca, &["--allow-cn", "kernel-host"]);
    let other_ca = Ca::new("another CA");
    let clients = [
        ("allowed", ca.client("kernel-host", &[], &[], 10)),
        (
            "not on the allow-list",
            ca.client("another-host", &[], &[], 11),
        ),
        (
            "from a CA nbdgw does not trust",
            other_ca.client("kernel-host", &[], &[], 12),
        ),
    ];
    // What the server says of each refusal: GnuTLS sends no certificate
    // whose issuer is not among the CAs the server's CertificateRequest
    // names, so the stranger is refused for having none.
    let refusals = [
        "client certificate refused",
        "TLS handshake failed: peer sent no certificates",
    ];
    for (n, (who, leaf)) in clients.iter().enumerate() {
        let cert = write_in(&dir, &format!("client-{n}-cert.pem"), &leaf.cert);
        let key = write_in(&dir, &format!("client-{n}-key.pem"), &leaf.key);
        let device = PathBuf::from(format!("/dev/nbd{}", 10 + n));
        let started = Instant::now();
        let attach = attach_with_tls(
            nbd_client,
            &device,
            server.port,
            &files.ca,
            (&cert, &key),
            None,
        );
        if n == 0 {
            assert!(
                attach.status.success(),
                "{who}: {}\n{}",
                output(&attach),
                server.log()
            );
            let rig = Rig {
                nbd_client,
                identity: (&cert, &key),
                upstream: &upstream,
                env: &env,
            };
            pattern_reaches_the_image(&rig, &device, 36, who, false);
            continue;
        }
        refused_without_a_disk(nbd_client, &device, &attach, started, who);
        server.wait_for_log(refusals[n - 1], 1);
    }
}
