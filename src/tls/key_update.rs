//! TLS 1.3 key updates (RFC 8446 §4.6.3, §7.2) for sessions whose record
//! layer is the kernel's: the traffic secrets, the next generation of
//! them, and the keys each generation gives. Pure: no socket here.
//!
//! rustls hands a buffered connection's *keys* to the kernel
//! (`dangerous_extract_secrets`), but a key update needs the *secret*
//! they came from, and rustls's kernel-connection API
//! (`dangerous_into_kernel_connection`) exists only for its unbuffered
//! connections, which tokio-rustls does not use. So the secrets come from
//! the one other place rustls gives them out, its `KeyLog`, installed per
//! connection ([`SecretLog`]); before they are used, the keys they derive
//! must equal the keys rustls extracted ([`TrafficSecrets::new`]), so a
//! logged secret that is not this session's is never used.

use std::sync::{Arc, Mutex};

use aws_lc_rs::hkdf;
use rustls::ConnectionTrafficSecrets;
use zeroize::Zeroize;

/// The record type of a TLS handshake message (RFC 8446 §5.1).
pub const HANDSHAKE_RECORD: u8 = 22;
/// A KeyUpdate handshake message, whole: type 24, a 3-byte length of 1,
/// and `request_update`.
pub const KEY_UPDATE_LEN: usize = 5;
const KEY_UPDATE_TYPE: u8 = 24;

/// What a peer's KeyUpdate asks of the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyUpdateRequest {
    /// `update_not_requested`: only the sender's keys change.
    NotRequested,
    /// `update_requested`: the receiver must update its own sending keys
    /// before its next application data record.
    Requested,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyUpdateError {
    /// A handshake record after the handshake that is not exactly one
    /// KeyUpdate: a server that asked for no post-handshake
    /// authentication and sends no tickets expects nothing else, and a
    /// KeyUpdate must end its record (RFC 8446 §5.1).
    #[error("client sent a post-handshake message other than one KeyUpdate ({len} bytes, type {kind:?})")]
    Unexpected { kind: Option<u8>, len: usize },
    #[error("client sent a KeyUpdate with request_update {0} (RFC 8446 allows 0 and 1)")]
    IllegalRequest(u8),
    #[error("the logged traffic secrets do not give the session's keys")]
    SecretMismatch,
    #[error("the session's TLS 1.3 keys are not within {0} key generations of its handshake (--handover-max-key-generations)")]
    NotWithin(usize),
    #[error("the traffic secrets were not logged for this session")]
    NotLogged,
    #[error("cipher suite not handled by kernel TLS key updates")]
    Suite,
}

/// Reads one post-handshake handshake record's plaintext.
pub fn parse_key_update(record: &[u8]) -> Result<KeyUpdateRequest, KeyUpdateError> {
    match *record {
        [KEY_UPDATE_TYPE, 0, 0, 1, 0] => Ok(KeyUpdateRequest::NotRequested),
        [KEY_UPDATE_TYPE, 0, 0, 1, 1] => Ok(KeyUpdateRequest::Requested),
        [KEY_UPDATE_TYPE, 0, 0, 1, other] => Err(KeyUpdateError::IllegalRequest(other)),
        _ => Err(KeyUpdateError::Unexpected {
            kind: record.first().copied(),
            len: record.len(),
        }),
    }
}

/// The KeyUpdate nbdgw sends: it never asks the client to update in turn
/// (the client's keys are the client's to refresh).
pub const KEY_UPDATE_NOT_REQUESTED: [u8; KEY_UPDATE_LEN] = [KEY_UPDATE_TYPE, 0, 0, 1, 0];

/// The AEAD and hash of a TLS 1.3 suite, as the key schedule needs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suite {
    Aes128GcmSha256,
    Aes256GcmSha384,
    Chacha20Poly1305Sha256,
}

impl Suite {
    pub fn of(suite: rustls::CipherSuite) -> Option<Suite> {
        use rustls::CipherSuite::*;
        match suite {
            TLS13_AES_128_GCM_SHA256 => Some(Suite::Aes128GcmSha256),
            TLS13_AES_256_GCM_SHA384 => Some(Suite::Aes256GcmSha384),
            TLS13_CHACHA20_POLY1305_SHA256 => Some(Suite::Chacha20Poly1305Sha256),
            _ => None,
        }
    }

    /// The suite's IANA number.
    pub fn iana(self) -> u16 {
        use rustls::CipherSuite::*;
        u16::from(match self {
            Suite::Aes128GcmSha256 => TLS13_AES_128_GCM_SHA256,
            Suite::Aes256GcmSha384 => TLS13_AES_256_GCM_SHA384,
            Suite::Chacha20Poly1305Sha256 => TLS13_CHACHA20_POLY1305_SHA256,
        })
    }

    fn hkdf(self) -> hkdf::Algorithm {
        match self {
            Suite::Aes256GcmSha384 => hkdf::HKDF_SHA384,
            _ => hkdf::HKDF_SHA256,
        }
    }

    pub fn key_len(self) -> usize {
        match self {
            Suite::Aes128GcmSha256 => 16,
            _ => 32,
        }
    }

    pub fn hash_len(self) -> usize {
        match self {
            Suite::Aes256GcmSha384 => 48,
            _ => 32,
        }
    }

    /// The keys one traffic secret gives (RFC 8446 §7.3).
    pub fn keys(self, secret: &Secret) -> Keys {
        let mut keys = Keys {
            suite: self,
            key: [0; 32],
            iv: [0; 12],
        };
        expand_label(self, &secret.0, b"key", &mut keys.key[..self.key_len()]);
        expand_label(self, &secret.0, b"iv", &mut keys.iv);
        keys
    }

    /// Whether a traffic secret gives `keys`: the key first, and the IV
    /// only if the key matches (a walk of many generations pays two
    /// HKDF-Expands a step, not three; review round 2, R2).
    fn gives(self, secret: &Secret, keys: &Keys) -> bool {
        let mut key = zeroize::Zeroizing::new([0u8; 32]);
        expand_label(self, &secret.0, b"key", &mut key[..self.key_len()]);
        *key == keys.key && self.keys(secret) == *keys
    }

    /// The next generation of a traffic secret (RFC 8446 §7.2).
    pub fn next(self, secret: &Secret) -> Secret {
        let mut next = vec![0u8; self.hash_len()];
        expand_label(self, &secret.0, b"traffic upd", &mut next);
        Secret(next)
    }
}

/// One direction's AEAD key and nonce base, at the AEAD's own lengths
/// (rustls's `AeadKey` cannot be built shorter than 32 bytes outside
/// rustls, so derived keys are not `ConnectionTrafficSecrets`).
#[derive(PartialEq, Eq)]
pub struct Keys {
    pub suite: Suite,
    key: [u8; 32],
    iv: [u8; 12],
}

impl Keys {
    /// The keys rustls extracted, if they are of a suite handled here.
    pub fn from_extracted(secrets: &ConnectionTrafficSecrets) -> Option<Keys> {
        let (suite, key, iv) = match secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (Suite::Aes128GcmSha256, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (Suite::Aes256GcmSha384, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => {
                (Suite::Chacha20Poly1305Sha256, key, iv)
            }
            _ => return None,
        };
        let mut keys = Keys {
            suite,
            key: [0; 32],
            iv: iv.as_ref().try_into().ok()?,
        };
        if key.as_ref().len() != suite.key_len() {
            return None;
        }
        keys.key[..suite.key_len()].copy_from_slice(key.as_ref());
        Some(keys)
    }

    /// Throw-away keys of one suite, for the start-up probe.
    pub(super) fn filled(suite: Suite, byte: u8) -> Keys {
        Keys {
            suite,
            key: [byte; 32],
            iv: [byte; 12],
        }
    }

    pub fn key(&self) -> &[u8] {
        &self.key[..self.suite.key_len()]
    }

    pub fn iv(&self) -> &[u8; 12] {
        &self.iv
    }
}

impl Drop for Keys {
    fn drop(&mut self) {
        self.key.zeroize();
        self.iv.zeroize();
    }
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Keys({:?}, ..)", self.suite)
    }
}

/// HKDF-Expand-Label(secret, label, "", out.len()).
fn expand_label(suite: Suite, secret: &[u8], label: &[u8], out: &mut [u8]) {
    struct Len(usize);
    impl hkdf::KeyType for Len {
        fn len(&self) -> usize {
            self.0
        }
    }
    const PREFIX: &[u8] = b"tls13 ";
    // struct { uint16 length; opaque label<7..255>; opaque context<0..255> }
    let length = (out.len() as u16).to_be_bytes();
    let label_len = [(PREFIX.len() + label.len()) as u8];
    let info: [&[u8]; 5] = [&length, &label_len, PREFIX, label, &[0]];
    let prk = hkdf::Prk::new_less_safe(suite.hkdf(), secret);
    // Lengths here are at most 48 bytes, far below HKDF's 255 blocks, so
    // neither call can fail.
    let filled = prk
        .expand(&info, Len(out.len()))
        .and_then(|okm| okm.fill(out));
    debug_assert!(filled.is_ok());
}

/// A traffic secret, wiped when dropped.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    pub fn new(bytes: &[u8]) -> Self {
        Secret(bytes.to_vec())
    }

    /// The secret itself, for a hand-over's encoding.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Key updates rustls may have followed before the hand-over: as many as
/// it takes without application data between them (rustls's own limit
/// is 32); a session that had more is refused, not guessed at.
const MAX_UPDATES_BEFORE_HAND_OVER: usize = 32;

/// Key generations a session may be at when a successor process takes
/// it over, days after its handshake (`TrafficSecrets::followed`), by
/// default (`--handover-max-key-generations`): rustls updates its own
/// keys every 2^24 records, so 1,024 generations are 2^34 records (~64
/// TiB of 4 KiB records) for an honest peer; a client may update its
/// keys before every request (rustls's cap of 32 restarts at each
/// application data record), which costs it 27 bytes a generation and
/// the hand-over two HKDF-Expands a generation walked (review round 2,
/// R2). A session past it is closed at its hand-over, not guessed at.
pub const DEFAULT_MAX_GENERATIONS_AT_HAND_OVER: usize = 1024;

/// Key updates a client may send without application data between them
/// (rustls's and BoringSSL's limit): each costs nbdgw a key derivation
/// and a system call for a record of a few bytes.
pub const MAX_KEY_UPDATES_WITHOUT_DATA: u32 = 32;

/// Warning alerts (user_canceled) a client may send in a session, as
/// rustls allows.
pub const MAX_WARNING_ALERTS: u32 = 4;

/// Both directions' current traffic secrets of a server-side session.
#[derive(Debug)]
pub struct TrafficSecrets {
    suite: Suite,
    /// What the client sends with: nbdgw's receive side.
    client: Secret,
    /// What nbdgw sends with.
    server: Secret,
}

impl TrafficSecrets {
    /// The logged secrets, accepted only if they give exactly the keys
    /// rustls extracted for this session.
    ///
    /// rustls may have followed key updates itself before the hand-over:
    /// it reads on past the client's Finished while records are there, so
    /// a client's KeyUpdate sent right behind it moves rustls's receive
    /// secret on (and, asked to, its sending one). So the logged secrets
    /// are taken at the generation that gives the extracted keys, a few
    /// generations on at most.
    pub fn new(logged: &SecretLog, rx: &Keys, tx: &Keys) -> Result<Self, KeyUpdateError> {
        Self::matched(logged, rx, tx, MAX_UPDATES_BEFORE_HAND_OVER)
    }

    /// As `new`, for a client-side session: what it receives is the
    /// server's, what it sends the client's.
    pub fn for_client(logged: &SecretLog, rx: &Keys, tx: &Keys) -> Result<Self, KeyUpdateError> {
        Self::matched(logged, tx, rx, MAX_UPDATES_BEFORE_HAND_OVER)
    }

    /// As `new` (with the client's keys and the server's, whichever side
    /// this is) for a session handed over at any time: the logged
    /// secrets are followed up to `generations` generations
    /// (`--handover-max-key-generations`). Only the generation that
    /// gives the keys is kept.
    pub fn followed(
        logged: &SecretLog,
        client_keys: &Keys,
        server_keys: &Keys,
        generations: usize,
    ) -> Result<Self, KeyUpdateError> {
        match Self::matched(logged, client_keys, server_keys, generations) {
            Err(KeyUpdateError::SecretMismatch) => Err(KeyUpdateError::NotWithin(generations)),
            other => other,
        }
    }

    /// The secrets of a session handed over (`KernelState`): the
    /// client's and the server's current generation.
    pub fn from_secrets(suite: Suite, client: Secret, server: Secret) -> Self {
        TrafficSecrets {
            suite,
            client,
            server,
        }
    }

    pub fn suite(&self) -> Suite {
        self.suite
    }

    /// The secrets of this generation, kept: the client's, the server's.
    pub fn secrets(&self) -> (&Secret, &Secret) {
        (&self.client, &self.server)
    }

    /// The secrets of this generation: the client's, the server's.
    pub fn into_secrets(self) -> (Secret, Secret) {
        (self.client, self.server)
    }

    fn matched(
        logged: &SecretLog,
        client_keys: &Keys,
        server_keys: &Keys,
        generations: usize,
    ) -> Result<Self, KeyUpdateError> {
        let (rx, tx) = (client_keys, server_keys);
        let suite = rx.suite;
        let (client, server) = logged.take().ok_or(KeyUpdateError::NotLogged)?;
        let matching = |mut secret: Secret, keys: &Keys, generations: usize| {
            for _ in 0..=generations {
                if suite.gives(&secret, keys) {
                    return Some(secret);
                }
                secret = suite.next(&secret);
            }
            None
        };
        let client = matching(client, rx, generations);
        let server = matching(server, tx, generations);
        match (client, server) {
            (Some(client), Some(server)) => Ok(TrafficSecrets {
                suite,
                client,
                server,
            }),
            _ => Err(KeyUpdateError::SecretMismatch),
        }
    }

    /// The client updated its keys: the keys to receive with from now on.
    pub fn next_rx(&mut self) -> Keys {
        self.client = self.suite.next(&self.client);
        self.suite.keys(&self.client)
    }

    /// nbdgw updates its keys: the keys to send with after its KeyUpdate.
    pub fn next_tx(&mut self) -> Keys {
        self.server = self.suite.next(&self.server);
        self.suite.keys(&self.server)
    }
}

/// One connection's rustls `KeyLog`: keeps the first application traffic
/// secrets of both directions, and nothing else, until taken.
#[derive(Default)]
pub struct SecretLog {
    logged: Mutex<(Option<Secret>, Option<Secret>)>,
}

impl SecretLog {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// The session stays in rustls: its secrets are not kept.
    pub fn discard(&self) {
        drop(self.take_any());
    }

    fn take_any(&self) -> (Option<Secret>, Option<Secret>) {
        let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut *logged)
    }

    fn take(&self) -> Option<(Secret, Secret)> {
        match self.take_any() {
            (Some(client), Some(server)) => Some((client, server)),
            _ => None,
        }
    }
}

const CLIENT_TRAFFIC_SECRET_0: &str = "CLIENT_TRAFFIC_SECRET_0";
const SERVER_TRAFFIC_SECRET_0: &str = "SERVER_TRAFFIC_SECRET_0";

impl rustls::KeyLog for SecretLog {
    fn will_log(&self, label: &str) -> bool {
        label == CLIENT_TRAFFIC_SECRET_0 || label == SERVER_TRAFFIC_SECRET_0
    }

    fn log(&self, label: &str, _client_random: &[u8], secret: &[u8]) {
        let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
        match label {
            CLIENT_TRAFFIC_SECRET_0 => logged.0 = Some(Secret::new(secret)),
            SERVER_TRAFFIC_SECRET_0 => logged.1 = Some(Secret::new(secret)),
            _ => {}
        }
    }
}

impl std::fmt::Debug for SecretLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretLog(..)")
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey};
    use proptest::prelude::*;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;

    use super::*;

    const APPLICATION_DATA: u8 = 23;

    fn aead(keys: &Keys) -> LessSafeKey {
        let alg = match keys.suite {
            Suite::Aes128GcmSha256 => &aws_lc_rs::aead::AES_128_GCM,
            Suite::Aes256GcmSha384 => &aws_lc_rs::aead::AES_256_GCM,
            Suite::Chacha20Poly1305Sha256 => &aws_lc_rs::aead::CHACHA20_POLY1305,
        };
        LessSafeKey::new(UnboundKey::new(alg, keys.key()).unwrap())
    }

    fn nonce(keys: &Keys, seq: u64) -> Nonce {
        let mut nonce = *keys.iv();
        for (n, s) in nonce[4..].iter_mut().zip(seq.to_be_bytes()) {
            *n ^= s;
        }
        Nonce::assume_unique_for_key(nonce)
    }

    /// A TLS 1.3 record as the peer (or the kernel) would seal it.
    fn seal(keys: &Keys, seq: u64, inner_type: u8, plain: &[u8]) -> Vec<u8> {
        let mut body = [plain, &[inner_type]].concat();
        let len = (body.len() + 16) as u16;
        let header = [APPLICATION_DATA, 3, 3, (len >> 8) as u8, len as u8];
        aead(keys)
            .seal_in_place_append_tag(nonce(keys, seq), Aad::from(header), &mut body)
            .unwrap();
        [&header[..], &body].concat()
    }

    /// Opens the record at the start of `wire`: its inner type, its
    /// plaintext, and what follows it.
    fn open<'a>(keys: &Keys, seq: u64, wire: &'a [u8]) -> (u8, Vec<u8>, &'a [u8]) {
        let header: [u8; 5] = wire[..5].try_into().unwrap();
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        let mut body = wire[5..5 + len].to_vec();
        let plain = aead(keys)
            .open_in_place(nonce(keys, seq), Aad::from(header), &mut body)
            .expect("the record opens with the derived keys");
        let end = plain.iter().rposition(|&b| b != 0).unwrap();
        (plain[end], plain[..end].to_vec(), &wire[5 + len..])
    }

    /// A client and a server rustls connection, handshaken in memory, the
    /// server's secrets logged as nbdgw logs them.
    fn handshaken(
        suite: rustls::SupportedCipherSuite,
    ) -> (
        rustls::ClientConnection,
        rustls::ServerConnection,
        Arc<SecretLog>,
    ) {
        let dir = tempfile::tempdir().unwrap();
        crate::certs::for_test(dir.path(), "localhost", 1);
        let mut server = crate::tls::load_server_config(
            &dir.path().join("server-cert.pem"),
            &dir.path().join("server-key.pem"),
        )
        .unwrap();
        server.enable_secret_extraction = true;
        let log = SecretLog::new();
        server.key_log = log.clone();
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_file(dir.path().join("ca-cert.pem")).unwrap())
            .unwrap();
        let mut provider = (*crate::tls::provider()).clone();
        provider.cipher_suites = vec![suite];
        let client = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut client =
            rustls::ClientConnection::new(Arc::new(client), "localhost".try_into().unwrap())
                .unwrap();
        let mut server = rustls::ServerConnection::new(Arc::new(server)).unwrap();
        while client.is_handshaking() || server.is_handshaking() || client.wants_write() {
            let mut wire = Vec::new();
            while client.wants_write() {
                client.write_tls(&mut wire).unwrap();
            }
            server.read_tls(&mut &wire[..]).unwrap();
            server.process_new_packets().unwrap();
            let mut wire = Vec::new();
            while server.wants_write() {
                server.write_tls(&mut wire).unwrap();
            }
            client.read_tls(&mut &wire[..]).unwrap();
            client.process_new_packets().unwrap();
        }
        (client, server, log)
    }

    fn suites() -> Vec<rustls::SupportedCipherSuite> {
        use rustls::crypto::aws_lc_rs::cipher_suite::*;
        vec![
            TLS13_AES_128_GCM_SHA256,
            TLS13_AES_256_GCM_SHA384,
            TLS13_CHACHA20_POLY1305_SHA256,
        ]
    }

    /// Both directions of a key update, for every suite, against rustls:
    /// the client's KeyUpdate and what it sends after it open with the
    /// keys `next_rx` derives, and a KeyUpdate and record sealed with the
    /// keys `next_tx` derives are read by the client.
    #[test]
    fn derived_keys_follow_rustls_through_key_updates() {
        for suite in suites() {
            let (mut client, server, log) = handshaken(suite);
            #[allow(deprecated)]
            let extracted = server.dangerous_extract_secrets().unwrap();
            let (tx_seq, tx) = extracted.tx;
            let (rx_seq, rx) = extracted.rx;
            let (tx, rx) = (
                Keys::from_extracted(&tx).unwrap(),
                Keys::from_extracted(&rx).unwrap(),
            );
            let mut secrets = TrafficSecrets::new(&log, &rx, &tx).unwrap();

            // The client updates its keys, twice, with data after each.
            let mut rx_keys = rx;
            let mut seq = rx_seq;
            for round in 0..2u8 {
                client.refresh_traffic_keys().unwrap();
                client.writer().write_all(&[b'a' + round; 100]).unwrap();
                let mut wire = Vec::new();
                while client.wants_write() {
                    client.write_tls(&mut wire).unwrap();
                }
                // rustls asks the peer to update too.
                let (kind, plain, rest) = open(&rx_keys, seq, &wire);
                assert_eq!(kind, HANDSHAKE_RECORD);
                assert_eq!(parse_key_update(&plain), Ok(KeyUpdateRequest::Requested));
                rx_keys = secrets.next_rx();
                let (kind, plain, rest) = open(&rx_keys, 0, rest);
                assert_eq!((kind, plain), (APPLICATION_DATA, vec![b'a' + round; 100]));
                assert!(rest.is_empty());
                seq = 1;
            }

            // nbdgw updates its own: KeyUpdate under the old key, data
            // under the new, and the client reads it.
            let mut wire = seal(&tx, tx_seq, HANDSHAKE_RECORD, &KEY_UPDATE_NOT_REQUESTED);
            let next = secrets.next_tx();
            wire.extend(seal(&next, 0, APPLICATION_DATA, b"after the update"));
            client.read_tls(&mut &wire[..]).unwrap();
            client.process_new_packets().unwrap();
            let mut got = vec![0u8; 16];
            client.reader().read_exact(&mut got).unwrap();
            assert_eq!(got, b"after the update", "{suite:?}");
        }
    }

    /// The client updates its keys (asking the server to update too)
    /// before the hand-over, so rustls follows: the secrets are found at
    /// the generations that give the extracted keys.
    #[test]
    fn updates_rustls_followed_before_the_hand_over_are_found() {
        let suite = rustls::crypto::aws_lc_rs::cipher_suite::TLS13_AES_128_GCM_SHA256;
        let (mut client, mut server, log) = handshaken(suite);
        for _ in 0..3 {
            client.refresh_traffic_keys().unwrap();
            client.writer().write_all(b"x").unwrap();
        }
        let mut wire = Vec::new();
        while client.wants_write() {
            client.write_tls(&mut wire).unwrap();
        }
        server.read_tls(&mut &wire[..]).unwrap();
        server.process_new_packets().unwrap();
        let mut got = [0u8; 3];
        server.reader().read_exact(&mut got).unwrap();
        // As the hand-over does: a write of nothing queues rustls's own
        // KeyUpdate, and it goes out before the keys are extracted.
        assert_eq!(server.writer().write(&[]).unwrap(), 0);
        let mut reply = Vec::new();
        while server.wants_write() {
            server.write_tls(&mut reply).unwrap();
        }
        #[allow(deprecated)]
        let extracted = server.dangerous_extract_secrets().unwrap();
        let rx = Keys::from_extracted(&extracted.rx.1).unwrap();
        let tx = Keys::from_extracted(&extracted.tx.1).unwrap();
        let mut secrets = TrafficSecrets::new(&log, &rx, &tx).unwrap();
        // The client reads rustls's KeyUpdate, then one of nbdgw's under
        // the key found, then what is sealed with the next one.
        let (seq, _) = extracted.tx;
        assert_eq!(seq, 0, "rustls's own KeyUpdate restarted its count");
        let mut wire = reply;
        wire.extend(seal(&tx, seq, HANDSHAKE_RECORD, &KEY_UPDATE_NOT_REQUESTED));
        wire.extend(seal(&secrets.next_tx(), 0, APPLICATION_DATA, b"on"));
        client.read_tls(&mut &wire[..]).unwrap();
        client.process_new_packets().unwrap();
        let mut got = [0u8; 2];
        client.reader().read_exact(&mut got).unwrap();
        assert_eq!(&got, b"on");
    }

    #[test]
    fn secrets_that_do_not_give_the_sessions_keys_are_refused() {
        let suite = rustls::crypto::aws_lc_rs::cipher_suite::TLS13_AES_128_GCM_SHA256;
        let (_, server, log) = handshaken(suite);
        let (_, _other, other_log) = handshaken(suite);
        #[allow(deprecated)]
        let extracted = server.dangerous_extract_secrets().unwrap();
        let rx = Keys::from_extracted(&extracted.rx.1).unwrap();
        let tx = Keys::from_extracted(&extracted.tx.1).unwrap();
        // Another session's secrets, as a key log shared by mistake, or a
        // client random chosen to collide, would give.
        assert_eq!(
            TrafficSecrets::new(&other_log, &rx, &tx).unwrap_err(),
            KeyUpdateError::SecretMismatch
        );
        assert!(TrafficSecrets::new(&log, &rx, &tx).is_ok());
        // Taken once: nothing is kept for a second hand-over.
        assert_eq!(
            TrafficSecrets::new(&log, &rx, &tx).unwrap_err(),
            KeyUpdateError::NotLogged
        );
    }

    #[test]
    fn key_update_messages_are_read_exactly() {
        assert_eq!(
            parse_key_update(&[24, 0, 0, 1, 1]),
            Ok(KeyUpdateRequest::Requested)
        );
        assert_eq!(
            parse_key_update(&[24, 0, 0, 1, 2]),
            Err(KeyUpdateError::IllegalRequest(2))
        );
        // Two KeyUpdates in one record: a key change inside a record.
        assert!(matches!(
            parse_key_update(&[24, 0, 0, 1, 0, 24, 0, 0, 1, 0]),
            Err(KeyUpdateError::Unexpected { len: 10, .. })
        ));
        // A NewSessionTicket or Certificate from a client.
        assert!(parse_key_update(&[4, 0, 0, 0]).is_err());
        assert!(parse_key_update(&[]).is_err());
    }

    proptest! {
        /// Only the two well-formed KeyUpdates are taken.
        #[test]
        fn anything_else_is_refused(record in proptest::collection::vec(any::<u8>(), 0..12)) {
            let valid = record == [24, 0, 0, 1, 0] || record == [24, 0, 0, 1, 1];
            prop_assert_eq!(parse_key_update(&record).is_ok(), valid);
        }
    }
}
