//! What the gateway put on the wire, checked for nonce reuse (issue 29,
//! "no nonce is ever used twice"): a TCP relay that keeps every byte the
//! gateway sends, the client's secrets from rustls's `KeyLog`, and a
//! decoder, independent of nbdgw's record layer (aws-lc-rs's HKDF and
//! AEAD, RFC 8446 section 7), that opens each record of a TLS 1.3 stream
//! under the one (key, sequence number) it must have been sealed with.
//!
//! An AEAD record opens only under the key and nonce it was sealed with,
//! and the decoder tries exactly one pair per record: sequence numbers
//! 0, 1, 2... under each key in turn, the next key only where a Finished
//! or KeyUpdate said so. A stream it accepts to the end therefore used
//! each (key, nonce) at most once; a record sealed again under a pair
//! already used (a predecessor and a successor both writing sequence
//! number N) fails to open at its place and is reported.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use aws_lc_rs::{aead, hkdf};

/// A relay between one client and the gateway keeping every byte the
/// gateway sends (plaintext greeting included).
pub struct Capture {
    pub addr: SocketAddr,
    wire: Arc<Mutex<Vec<u8>>>,
    done: Arc<Mutex<bool>>,
}

impl Capture {
    pub fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let wire = Arc::new(Mutex::new(Vec::new()));
        let done = Arc::new(Mutex::new(false));
        let (kept, finished) = (wire.clone(), done.clone());
        std::thread::spawn(move || {
            let (client, _) = listener.accept().unwrap();
            let server = TcpStream::connect(target).unwrap();
            client.set_nodelay(true).unwrap();
            server.set_nodelay(true).unwrap();
            let (c_rd, s_wr) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                super::pipe(c_rd, &s_wr, |_| {});
                let _ = s_wr.shutdown(std::net::Shutdown::Write);
            });
            super::pipe(server, &client, |bytes| {
                kept.lock().unwrap().extend_from_slice(bytes)
            });
            let _ = client.shutdown(std::net::Shutdown::Write);
            *finished.lock().unwrap() = true;
        });
        Capture { addr, wire, done }
    }

    /// What the gateway has sent so far.
    pub fn wire_so_far(&self) -> Vec<u8> {
        self.wire.lock().unwrap().clone()
    }

    /// Everything the gateway sent, once its side of the connection has
    /// ended (waits for that).
    pub fn wire(&self) -> Vec<u8> {
        super::await_that("the gateway's side of the connection ends", || {
            *self.done.lock().unwrap()
        });
        self.wire.lock().unwrap().clone()
    }
}

/// The client's secrets, by rustls's `KeyLog` label.
#[derive(Debug, Default)]
pub struct Secrets(Mutex<HashMap<String, Vec<u8>>>);

impl Secrets {
    pub fn get(&self, label: &str) -> Vec<u8> {
        self.0
            .lock()
            .unwrap()
            .get(label)
            .unwrap_or_else(|| panic!("no {label} was logged"))
            .clone()
    }
}

impl rustls::KeyLog for Secrets {
    fn log(&self, label: &str, _client_random: &[u8], secret: &[u8]) {
        self.0
            .lock()
            .unwrap()
            .insert(label.to_string(), secret.to_vec());
    }
}

/// One TLS record on the wire: content type, the 5-byte header, the body.
pub struct Record<'a> {
    pub kind: u8,
    pub header: &'a [u8],
    pub body: &'a [u8],
}

/// Splits `wire` into records; a record cut short at the end is an error
/// (its bytes were sealed, and would go unchecked).
pub fn records(mut wire: &[u8]) -> Result<Vec<Record<'_>>, String> {
    let mut out = Vec::new();
    while !wire.is_empty() {
        if wire.len() < 5 {
            return Err(format!(
                "{} bytes of a record header at the end",
                wire.len()
            ));
        }
        let len = usize::from(u16::from_be_bytes([wire[3], wire[4]]));
        if wire.len() < 5 + len {
            return Err(format!(
                "record {} cut short: {} of {len} bytes",
                out.len(),
                wire.len() - 5
            ));
        }
        out.push(Record {
            kind: wire[0],
            header: &wire[..5],
            body: &wire[5..5 + len],
        });
        wire = &wire[5 + len..];
    }
    Ok(out)
}

/// The TLS 1.3 suites nbdgw negotiates: (rustls's suite, HKDF, AEAD).
fn suite_algorithms(suite: rustls::CipherSuite) -> (hkdf::Algorithm, &'static aead::Algorithm) {
    match suite {
        rustls::CipherSuite::TLS13_AES_128_GCM_SHA256 => (hkdf::HKDF_SHA256, &aead::AES_128_GCM),
        rustls::CipherSuite::TLS13_AES_256_GCM_SHA384 => (hkdf::HKDF_SHA384, &aead::AES_256_GCM),
        rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256 => {
            (hkdf::HKDF_SHA256, &aead::CHACHA20_POLY1305)
        }
        other => panic!("not a TLS 1.3 suite the decoder knows: {other:?}"),
    }
}

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// HKDF-Expand-Label (RFC 8446 section 7.1), empty context.
fn expand_label(alg: hkdf::Algorithm, secret: &[u8], label: &str, len: usize) -> Vec<u8> {
    let full = format!("tls13 {label}");
    let info = [
        &(len as u16).to_be_bytes()[..],
        &[full.len() as u8],
        full.as_bytes(),
        &[0u8],
    ];
    let prk = hkdf::Prk::new_less_safe(alg, secret);
    let mut out = vec![0u8; len];
    prk.expand(&info, Len(len)).unwrap().fill(&mut out).unwrap();
    out
}

/// One sending key of the server's: its secret, and the records it sealed.
struct Epoch {
    name: String,
    secret: Vec<u8>,
    key: aead::LessSafeKey,
    iv: Vec<u8>,
    seq: u64,
}

impl Epoch {
    fn new(
        name: String,
        alg: (hkdf::Algorithm, &'static aead::Algorithm),
        secret: Vec<u8>,
    ) -> Self {
        let key = expand_label(alg.0, &secret, "key", alg.1.key_len());
        let iv = expand_label(alg.0, &secret, "iv", 12);
        Epoch {
            name,
            key: aead::LessSafeKey::new(aead::UnboundKey::new(alg.1, &key).unwrap()),
            secret,
            iv,
            seq: 0,
        }
    }

    /// Opens `record` as sequence number `self.seq` (the only one it may
    /// have): its inner plaintext, or None.
    fn open(&mut self, record: &Record) -> Option<Vec<u8>> {
        let mut nonce = [0u8; 12];
        nonce.copy_from_slice(&self.iv);
        for (n, s) in nonce[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *n ^= s;
        }
        let mut buf = record.body.to_vec();
        let plain = self
            .key
            .open_in_place(
                aead::Nonce::assume_unique_for_key(nonce),
                aead::Aad::from(record.header),
                &mut buf,
            )
            .ok()?
            .to_vec();
        self.seq += 1;
        Some(plain)
    }
}

/// What a TLS 1.3 stream held: records per key, and what came in them.
#[derive(Debug, Default)]
pub struct Tls13Wire {
    /// Records sealed under each server key in turn (handshake key first).
    pub records_per_key: Vec<u64>,
    /// Application-data records.
    pub application_records: u64,
    /// Alerts, by description (0: close_notify).
    pub alerts: Vec<u8>,
}

/// Opens every record the server sent in a TLS 1.3 stream, each under
/// the only (key, sequence number) it may have been sealed with.
/// `wire`: the server's bytes from its first TLS record on.
pub fn check_tls13(
    wire: &[u8],
    suite: rustls::CipherSuite,
    secrets: &Secrets,
) -> Result<Tls13Wire, String> {
    let alg = suite_algorithms(suite);
    let mut epoch = Epoch::new(
        "handshake".into(),
        alg,
        secrets.get("SERVER_HANDSHAKE_TRAFFIC_SECRET"),
    );
    let mut seen = Tls13Wire::default();
    let mut application = false;
    for (i, record) in records(wire)?.iter().enumerate() {
        // ServerHello and the compatibility ChangeCipherSpec: not sealed.
        if record.kind == 22 && epoch.seq == 0 && !application || record.kind == 20 {
            continue;
        }
        if record.kind != 23 {
            return Err(format!(
                "record {i}: plaintext type {} after the handshake",
                record.kind
            ));
        }
        let Some(mut inner) = epoch.open(record) else {
            return Err(format!(
                "record {i} ({} bytes) does not open under key '{}' as its sequence number {}: \
                 it was sealed under another (key, nonce), one used before or out of order",
                record.body.len(),
                epoch.name,
                epoch.seq
            ));
        };
        while inner.last() == Some(&0) {
            inner.pop();
        }
        let Some(kind) = inner.pop() else {
            return Err(format!("record {i}: no content type"));
        };
        let key_ends = match kind {
            23 if application => {
                seen.application_records += 1;
                false
            }
            21 => {
                seen.alerts.push(*inner.get(1).unwrap_or(&255));
                false
            }
            22 => ends_key(&inner, application),
            other => {
                return Err(format!(
                    "record {i}: inner type {other} under '{}'",
                    epoch.name
                ))
            }
        };
        if key_ends {
            seen.records_per_key.push(epoch.seq);
            epoch = if application {
                let secret = expand_label(
                    alg.0,
                    &epoch.secret,
                    "traffic upd",
                    alg.0.hmac_algorithm().digest_algorithm().output_len(),
                );
                Epoch::new(
                    format!("application {}", seen.records_per_key.len() - 1),
                    alg,
                    secret,
                )
            } else {
                application = true;
                Epoch::new(
                    "application 0".into(),
                    alg,
                    secrets.get("SERVER_TRAFFIC_SECRET_0"),
                )
            };
        }
    }
    seen.records_per_key.push(epoch.seq);
    Ok(seen)
}

/// Whether the handshake messages in `plain` end this key: a Finished in
/// the handshake epoch, a KeyUpdate after it.
fn ends_key(mut plain: &[u8], application: bool) -> bool {
    let mut ends = false;
    while plain.len() >= 4 {
        let len = u32::from_be_bytes([0, plain[1], plain[2], plain[3]]) as usize;
        ends |= matches!((plain[0], application), (20, false) | (24, true));
        plain = &plain[(4 + len).min(plain.len())..];
    }
    ends
}

/// The explicit nonces of a TLS 1.2 AES-GCM stream's sealed records (RFC
/// 5288: salt from the key block, then these 8 bytes, sent with each
/// record): the server's, in order, from its ChangeCipherSpec on.
pub fn tls12_explicit_nonces(wire: &[u8]) -> Result<Vec<u64>, String> {
    let mut sealed = false;
    let mut nonces = Vec::new();
    for (i, record) in records(wire)?.iter().enumerate() {
        if record.kind == 20 {
            sealed = true;
        } else if sealed {
            let Some(explicit) = record.body.get(..8) else {
                return Err(format!(
                    "record {i}: {} bytes, no explicit nonce",
                    record.body.len()
                ));
            };
            nonces.push(u64::from_be_bytes(explicit.try_into().unwrap()));
        }
    }
    Ok(nonces)
}
