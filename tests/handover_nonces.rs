//! Never two writers on one key (issue 29): every record the gateways put
//! on a session's wire, across hand-overs, client KeyUpdates, and a
//! successor killed in the middle, was sealed under a (key, nonce) pair
//! used for no other record. Checked on a capture of the wire with the
//! client's secrets (tests/common/tls_capture.rs: each record opens only
//! under its one expected sequence number), not by trusting the client
//! library's error paths. Real qemu-nbd upstream, rustls client.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::handover::{generation, private_dir, successor_killed_holding_the_state};
use common::process::NbdgwProcess;
use common::raw::{RawClient, Stream};
use common::tls_capture::{check_tls13, records, tls12_explicit_nonces, Capture, Secrets};
use common::{Env, QemuNbd};
use nbdgw::proto::consts::*;
use nbdgw::proto::transmission::ReplyMode;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

const IMAGE_LEN: usize = 8 << 20;
/// The greeting (18 bytes) and STARTTLS's reply (20): then TLS.
const PLAINTEXT_PREFIX: usize = 38;

/// A client identity of the test CA, offering only `suite` in `version`,
/// logging its secrets into `secrets`.
fn client_config(
    env: &Env,
    version: &'static rustls::SupportedProtocolVersion,
    suite: rustls::CipherSuite,
    secrets: Arc<Secrets>,
) -> Arc<rustls::ClientConfig> {
    let certs = env.certs();
    let mut provider = (*nbdgw::tls::provider()).clone();
    provider.cipher_suites.retain(|s| s.suite() == suite);
    assert_eq!(provider.cipher_suites.len(), 1, "{suite:?}");
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(certs.join("ca-cert.pem")).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let chain = CertificateDer::pem_file_iter(certs.join("client-cert.pem"))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(certs.join("client-key.pem")).unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(&[version])
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    config.key_log = secrets;
    Arc::new(config)
}

/// A session through `capture` in `version` and `suite`, structured
/// replies, one write read back.
fn session(
    env: &Env,
    capture: &Capture,
    version: &'static rustls::SupportedProtocolVersion,
    suite: rustls::CipherSuite,
    secrets: &Arc<Secrets>,
) -> RawClient {
    let mut c = RawClient::handshake(capture.addr);
    c.try_starttls(client_config(env, version, suite, secrets.clone()))
        .expect("TLS handshake");
    c.go(ReplyMode::Structured);
    round_trip(&mut c, 0);
    c
}

/// A write of a block numbered `n`, read back, and the first block's
/// contents checked too: several replies (records) each.
fn round_trip(c: &mut RawClient, n: u8) {
    let block = vec![n; 65536];
    let offset = u64::from(n) * 65536;
    c.write(100 + u64::from(n), offset, &block);
    assert_eq!(c.read_reply(0).last().unwrap().error_code(), 0, "write {n}");
    assert_eq!(c.read(200 + u64::from(n), offset, 65536), block, "read {n}");
}

/// The client's own KeyUpdate (TLS 1.3), asking the server to update its
/// sending key too.
fn key_update(c: &mut RawClient) {
    let Stream::Tls(s) = &mut c.stream else {
        panic!("TLS is not up")
    };
    s.conn.refresh_traffic_keys().expect("a KeyUpdate");
    std::io::Write::flush(s).unwrap();
}

/// Replaces `old` by a new generation taking over its sessions; the new one.
fn replace(
    env: &Env,
    upstream: &QemuNbd,
    port: u16,
    handover: &std::path::Path,
    mut old: NbdgwProcess,
) -> NbdgwProcess {
    let new = generation(env, &upstream.socket, port, handover, true, &[]);
    let status = old
        .wait_exit(Duration::from_secs(60))
        .expect("the old gateway exits");
    let log = old.log();
    assert!(status.success(), "{log}");
    assert!(
        log.contains("hand-over: the successor serves the session"),
        "{log}"
    );
    new
}

/// TLS 1.3 in `suite`: a session through three replacements, each
/// starting with a KeyUpdate of the client's and a write in flight (the
/// server answers with its own KeyUpdate: a new sending key, carried to
/// the next process) and traffic between; then the client closes. Every record the two-and-more
/// processes sealed opens under its own key and sequence number.
fn tls13_session_keeps_every_nonce_unique(suite: rustls::CipherSuite) {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 13);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut gateway = generation(&env, &upstream.socket, port, &handover, false, &[]);
    let capture = Capture::start(addr);
    let secrets = Arc::new(Secrets::default());
    let mut c = session(&env, &capture, &rustls::version::TLS13, suite, &secrets);
    for round in 1..=3u8 {
        round_trip(&mut c, round);
        // A KeyUpdate and a write sent as the replacement starts, neither
        // waited for: read ahead by the old process or the new, and the
        // server's own KeyUpdate and the reply sealed by whichever has
        // the session then.
        key_update(&mut c);
        let block = vec![round + 20; 65536];
        c.write(300 + u64::from(round), 65536 * 40, &block);
        gateway = replace(&env, &upstream, port, &handover, gateway);
        assert_eq!(c.read_reply(0).last().unwrap().error_code(), 0);
        assert_eq!(c.read(400 + u64::from(round), 65536 * 40, 65536), block);
        round_trip(&mut c, round + 10);
    }
    c.disconnect();
    let wire = capture.wire();
    assert_eq!(wire[PLAINTEXT_PREFIX], 22, "TLS starts after the greeting");
    let seen = check_tls13(&wire[PLAINTEXT_PREFIX..], suite, &secrets)
        .unwrap_or_else(|e| panic!("{suite:?}: {e}\ngateway:\n{}", gateway.log()));
    eprintln!("{suite:?}: {seen:?}");
    // The handshake key, then application keys 0..=3: the server followed
    // each of the client's three KeyUpdates, across processes.
    assert_eq!(seen.records_per_key.len(), 5, "{seen:?}");
    assert!(seen.records_per_key[1..].iter().all(|&n| n > 0), "{seen:?}");
    // 1 + 3 x 3 round trips: a write reply and read chunks each.
    assert!(seen.application_records >= 20, "{seen:?}");
    let (status, log) = gateway.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn tls13_aes128_every_record_across_replacements_has_its_own_nonce() {
    tls13_session_keeps_every_nonce_unique(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
}

#[test]
fn tls13_aes256_every_record_across_replacements_has_its_own_nonce() {
    tls13_session_keeps_every_nonce_unique(rustls::CipherSuite::TLS13_AES_256_GCM_SHA384);
}

#[test]
fn tls13_chacha20_every_record_across_replacements_has_its_own_nonce() {
    tls13_session_keeps_every_nonce_unique(rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256);
}

/// TLS 1.2 with AES-GCM carries each record's nonce on the wire (its
/// explicit part; the salt is fixed for the session's one key). rustls
/// sends 8 bytes of the key block XOR the record's sequence number (seen
/// here: the first is not 0), and so must a resumed session: through
/// three replacements the nonces XOR the first run 0, 1, 2... with none
/// repeated or skipped.
#[test]
fn tls12_gcm_explicit_nonces_run_on_across_replacements() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 14);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut gateway = generation(&env, &upstream.socket, port, &handover, false, &[]);
    let capture = Capture::start(addr);
    let secrets = Arc::new(Secrets::default());
    let suite = rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384;
    let mut c = session(&env, &capture, &rustls::version::TLS12, suite, &secrets);
    for round in 1..=3u8 {
        gateway = replace(&env, &upstream, port, &handover, gateway);
        round_trip(&mut c, round);
    }
    c.disconnect();
    let wire = capture.wire();
    let nonces = tls12_explicit_nonces(&wire[PLAINTEXT_PREFIX..]).unwrap();
    let sequence: Vec<u64> = nonces.iter().map(|n| n ^ nonces[0]).collect();
    let expected: Vec<u64> = (0..nonces.len() as u64).collect();
    assert_eq!(
        sequence, expected,
        "the server's explicit nonces: {nonces:?}"
    );
    // The Finished, four round trips' replies, close_notify at least.
    assert!(nonces.len() >= 10, "{nonces:?}");
    let (status, log) = gateway.stop();
    assert!(status.success(), "{log}");
}

/// The successor is killed after it has the session's keys and before it
/// says it took the session: the old gateway, whose keys left with the
/// state, must seal nothing more (no reply, not even a close_notify,
/// which would take the sequence number the successor may already have
/// used). The wire ends with the last reply sealed before the hand-over.
#[test]
fn a_killed_successor_leaves_no_record_sealed_after_the_keys_left() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 15);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let handover = private_dir(&env).join("handover.sock");
    let port = common::free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut old = generation(&env, &upstream.socket, port, &handover, false, &[]);
    let capture = Capture::start(addr);
    let secrets = Arc::new(Secrets::default());
    let suite = rustls::CipherSuite::TLS13_AES_128_GCM_SHA256;
    let mut c = session(&env, &capture, &rustls::version::TLS13, suite, &secrets);
    key_update(&mut c);
    round_trip(&mut c, 1);
    let before = records_now(&capture);
    successor_killed_holding_the_state(&env, &upstream.socket, port, &handover);
    let status = old
        .wait_exit(Duration::from_secs(60))
        .expect("the old gateway exits");
    let log = old.log();
    assert!(status.success(), "{log}");
    assert!(log.contains("the session hand-over ended early"), "{log}");
    // A request after it finds nobody holding the session.
    c.send(&c.request_bytes(0, CMD_READ, 3, 0, 4096));
    c.expect_closed();
    let wire = capture.wire();
    let seen = check_tls13(&wire[PLAINTEXT_PREFIX..], suite, &secrets)
        .unwrap_or_else(|e| panic!("{e}\nold gateway:\n{log}"));
    assert_eq!(seen.alerts, Vec::<u8>::new(), "{seen:?}");
    assert_eq!(
        records(&wire[PLAINTEXT_PREFIX..]).unwrap().len(),
        before,
        "records sealed after the state was sent: {seen:?}\nold gateway:\n{log}"
    );
}

/// How many records the gateway has sent so far (its side still open).
fn records_now(capture: &Capture) -> usize {
    let wire = capture.wire_so_far();
    records(&wire[PLAINTEXT_PREFIX..]).unwrap().len()
}

/// The decoder can fail: a capture with one application record repeated
/// (what a predecessor and a successor sealing the same sequence number
/// would put on the wire) or two swapped is refused at that record.
#[test]
fn the_decoder_refuses_a_record_sealed_twice_or_out_of_order() {
    let env = Env::new();
    let image = env.random_image("disk.img", IMAGE_LEN, 16);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let port = common::free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let handover = private_dir(&env).join("handover.sock");
    let gateway = generation(&env, &upstream.socket, port, &handover, false, &[]);
    let capture = Capture::start(addr);
    let secrets = Arc::new(Secrets::default());
    let suite = rustls::CipherSuite::TLS13_AES_128_GCM_SHA256;
    let mut c = session(&env, &capture, &rustls::version::TLS13, suite, &secrets);
    round_trip(&mut c, 1);
    c.disconnect();
    let wire = capture.wire();
    let tls = &wire[PLAINTEXT_PREFIX..];
    check_tls13(tls, suite, &secrets).expect("the real capture opens");
    let all = records(tls).unwrap();
    let k = all.len() - 3;
    let raw = |r: &common::tls_capture::Record| [r.header, r.body].concat();
    let mut repeated = Vec::new();
    let mut swapped = Vec::new();
    for (i, r) in all.iter().enumerate() {
        repeated.extend(raw(r));
        if i == k {
            repeated.extend(raw(r));
        }
        let j = if i == k {
            k + 1
        } else if i == k + 1 {
            k
        } else {
            i
        };
        swapped.extend(raw(&all[j]));
    }
    for (what, doctored) in [("repeated", repeated), ("swapped", swapped)] {
        let err = check_tls13(&doctored, suite, &secrets).expect_err(what);
        // The first copy opens; its repeat is the record refused.
        let at = if what == "repeated" { k + 1 } else { k };
        assert!(err.starts_with(&format!("record {at} ")), "{what}: {err}");
        assert!(err.contains("does not open"), "{what}: {err}");
    }
    let (status, log) = gateway.stop();
    assert!(status.success(), "{log}");
}
