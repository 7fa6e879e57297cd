//! Kernel TLS (--ktls): probed at start, used where the kernel has the
//! `tls` ULP, and otherwise a clean fall back to rustls. This machine's
//! kernel lacks CONFIG_TLS, so here the tests see the fall back; on a
//! kernel with it, the same tests see sessions handed over, and check
//! the same bytes.

mod common;

use std::process::Command;

use common::process::NbdgwProcess;
use common::{run_ok, Env, Gateway, QemuNbd};
use nbdgw::tls::kernel::{probe, KernelCiphers};

const SIZE: usize = 4 << 20;

fn kernel_has_tls() -> bool {
    probe().is_ok()
}

/// Every cipher, as a kernel with the ULP would say, where this kernel
/// has no ULP at all (so the hand-over is refused before the keys leave
/// rustls); what the kernel really takes where it has the ULP; `None`
/// where it has the ULP but takes no cipher (keys would leave rustls and
/// be refused: the start-up probe exists to prevent that).
fn ciphers_to_claim() -> Option<KernelCiphers> {
    match probe() {
        Ok(ciphers) => Some(ciphers),
        Err(nbdgw::tls::kernel::KernelTlsError::NoUlp(_)) => Some(KernelCiphers {
            aes_128_gcm: true,
            aes_256_gcm: true,
            chacha20_poly1305: true,
        }),
        Err(_) => None,
    }
}

/// nbdgw with the test's certificates in front of `upstream`, and flags.
fn gateway(env: &Env, upstream: &QemuNbd, extra: &[&str]) -> NbdgwProcess {
    NbdgwProcess::in_front_of(env, &upstream.socket, extra)
}

#[test]
fn the_start_up_probe_decides_and_says_so() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 11);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let gw = gateway(&env, &upstream, &[]);
    let [_, object, _, opts] = common::clients::qemu_tls_args("localhost", gw.port, &env.certs());
    common::qemu_img_copy_both_ways(&env, &upstream, (&object, &opts), SIZE, 12);
    let log = gw.log();
    if kernel_has_tls() {
        assert!(log.contains("kernel TLS available"), "{log}");
        assert!(log.contains("TLS handed to the kernel (kTLS)"), "{log}");
    } else {
        let reason = probe().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            log.contains("kernel TLS unavailable: TLS stays in rustls") && log.contains(&reason),
            "{log}"
        );
        assert!(!log.contains("handed to the kernel"), "{log}");
    }
    // Every connection ended cleanly.
    assert!(!log.contains("WARN conn"), "{log}");
}

#[test]
fn ktls_off_keeps_rustls_without_probing() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 13);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let gw = gateway(&env, &upstream, &["--ktls", "off"]);
    let uri = common::clients::nbds_uri(gw.port, &env.certs());
    let out = run_ok(Command::new("nbdinfo").arg("--size").arg(uri));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        SIZE.to_string()
    );
    let log = gw.log();
    assert!(log.contains("kernel TLS off (--ktls off)"), "{log}");
    assert!(
        !log.contains("kernel TLS unavailable") && !log.contains("handed to the kernel"),
        "{log}"
    );
}

/// Told the kernel takes ciphers (here: every one, though it has no
/// ULP), the gateway reads the handshake record by record and tries the
/// hand-over; where the kernel then refuses the ULP, the session must go
/// on in rustls, whole, for qemu's client and libnbd's. Where the kernel
/// has it, each session is handed over and must carry the same bytes.
#[test]
fn a_session_the_kernel_refuses_goes_on_in_rustls() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 14);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let mut tls = nbdgw::tls::load_server_config(
        &env.certs().join("server-cert.pem"),
        &env.certs().join("server-key.pem"),
    )
    .unwrap();
    tls.enable_secret_extraction = true;
    let mut config = env.config(&upstream.socket);
    config.tls = nbdgw::tls::TlsStore::fixed(tls);
    let Some(claimed) = ciphers_to_claim() else {
        eprintln!("the kernel has the tls ULP but takes no cipher: nothing to claim");
        return;
    };
    config.kernel_tls = Some(claimed);
    let metrics = config.metrics.clone();
    let gateway = Gateway::start(config);
    let (object, opts) = gateway.qemu_args(&env);
    common::qemu_img_copy_both_ways(&env, &upstream, (&object, &opts), SIZE, 12);
    let copy = env.path("nbdcopy.img");
    run_ok(Command::new("nbdcopy").arg(gateway.uri(&env)).arg(&copy));
    assert_eq!(std::fs::read(&copy).unwrap(), upstream.read_direct());

    let handed_over = metrics.kernel_tls_sessions.get();
    if kernel_has_tls() {
        assert!(handed_over >= 3, "{handed_over}");
    } else {
        assert_eq!(handed_over, 0);
    }
}
