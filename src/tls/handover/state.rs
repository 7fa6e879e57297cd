//! `TlsState`: what a rustls session is, as data, at a quiet point: its
//! version and suite, each direction's key, IV, next record sequence
//! number and (TLS 1.3) traffic secret, the plaintext rustls had
//! decrypted and the application had not yet read, and the start of a
//! record read from the socket but not yet whole.

use std::io::{Read, Write};

use rustls::{CipherSuite, ConnectionTrafficSecrets, ProtocolVersion};
use zeroize::Zeroize;

use crate::tls::key_update::{
    KeyUpdateError, Keys, Secret, SecretLog, Suite, TrafficSecrets,
    DEFAULT_MAX_GENERATIONS_AT_HAND_OVER,
};

/// The largest record body a peer may send (RFC 8446 §5.2: 2^14 + 256),
/// and so the most of one record a state can hold unread.
pub const MAX_RECORD_BODY: usize = 16_384 + 256;
/// A record header: type, version, length.
pub const RECORD_HEADER: usize = 5;
/// Plaintext rustls may hold unread at a quiet point: its receive limit
/// is 16 KiB by default, and it may go over by one record; more than
/// this is refused, not carried.
pub const MAX_PENDING_PLAINTEXT: usize = 256 * 1024;

/// The AEAD of a record layer: in TLS 1.3 it names the suite, in TLS 1.2
/// it is all of the suite the record layer needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aead {
    Aes128Gcm,
    Aes256Gcm,
    Chacha20Poly1305,
}

impl Aead {
    pub fn key_len(self) -> usize {
        match self {
            Aead::Aes128Gcm => 16,
            _ => 32,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    Tls12,
    Tls13,
}

/// Which end of the TLS session this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Server,
    Client,
}

/// The suites nbdgw negotiates (`tls::provider`: rustls's aws-lc-rs
/// default suites), by IANA number, with their version and AEAD.
pub fn suite_params(suite: u16) -> Option<(Version, Aead)> {
    use CipherSuite::*;
    let params = match CipherSuite::from(suite) {
        TLS13_AES_128_GCM_SHA256 => (Version::Tls13, Aead::Aes128Gcm),
        TLS13_AES_256_GCM_SHA384 => (Version::Tls13, Aead::Aes256Gcm),
        TLS13_CHACHA20_POLY1305_SHA256 => (Version::Tls13, Aead::Chacha20Poly1305),
        TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256 | TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256 => {
            (Version::Tls12, Aead::Aes128Gcm)
        }
        TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384 | TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384 => {
            (Version::Tls12, Aead::Aes256Gcm)
        }
        TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256
        | TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256 => (Version::Tls12, Aead::Chacha20Poly1305),
        _ => return None,
    };
    Some(params)
}

/// One direction of a session: the key and IV the AEAD uses, the
/// sequence number of the next record, and in TLS 1.3 the traffic secret
/// they came from (a key update needs it). Key and secret are wiped when
/// dropped.
#[derive(Clone, PartialEq, Eq)]
pub struct DirectionState {
    pub key: KeyBytes,
    pub iv: [u8; 12],
    pub seq: u64,
    pub secret: Option<Secret>,
}

impl std::fmt::Debug for DirectionState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DirectionState {{ seq: {}, .. }}", self.seq)
    }
}

impl Drop for DirectionState {
    fn drop(&mut self) {
        self.iv.zeroize();
    }
}

/// An AEAD key, wiped when dropped.
#[derive(Clone, PartialEq, Eq)]
pub struct KeyBytes(pub Vec<u8>);

impl Drop for KeyBytes {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

/// A rustls session at a quiet point, as data (see the module doc of
/// `handover` for when it may be taken and why no nonce repeats).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsState {
    pub side: Side,
    /// The negotiated suite's IANA number; gives version and AEAD.
    pub suite: u16,
    pub tx: DirectionState,
    pub rx: DirectionState,
    /// Plaintext rustls decrypted that the application had not read.
    pub plaintext: Vec<u8>,
    /// The peer's close_notify was read: nothing more is to be read.
    pub read_closed: bool,
    /// Bytes of a record read from the socket but not yet whole.
    pub partial: Vec<u8>,
}

/// Why a session's state was not taken, or not accepted.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("the TLS handshake is not complete")]
    Handshaking,
    #[error("rustls still holds TLS records to send: flush before the hand-over")]
    Unsent,
    #[error("cipher suite {0:#06x} is not one a hand-over handles")]
    Suite(u16),
    #[error("the suite's protocol version is not the session's")]
    VersionMismatch,
    #[error("rustls would not give the session's keys: {0}")]
    Extract(rustls::Error),
    #[error("key of {got} bytes for an AEAD that takes {want}")]
    KeyLength { got: usize, want: usize },
    #[error("TLS 1.3 traffic secrets: {0}")]
    Secrets(#[from] KeyUpdateError),
    #[error("a TLS 1.3 traffic secret is missing, or a TLS 1.2 one present")]
    SecretPresence,
    #[error("a TLS 1.3 traffic secret does not give the direction's key and IV")]
    SecretKeys,
    #[error("the peer closed TCP without close_notify")]
    PeerEof,
    #[error("reading rustls's buffered plaintext: {0}")]
    Plaintext(std::io::Error),
    #[error("{0} bytes of unread plaintext, over the {MAX_PENDING_PLAINTEXT}-byte bound")]
    TooMuchPlaintext(usize),
    #[error("the partial record ({0} bytes) is not the start of one record")]
    Partial(usize),
    #[error("a counter is past the limit the session would have ended at")]
    Limits,
}

impl TlsState {
    /// The state of a rustls connection (either side) at a quiet point.
    ///
    /// Preconditions, each refused with its own error:
    /// - the handshake is complete, and the configuration had
    ///   `enable_secret_extraction` (and, for TLS 1.3, `key_log` set to
    ///   `secrets`, this connection's own log);
    /// - nothing is left to send: every record rustls made has been
    ///   written to the socket, including a KeyUpdate it owes the peer
    ///   (this writes nothing to queue it and refuses if that queued a
    ///   record: write `&[]` and flush before taking);
    /// - the application writes nothing more through rustls after this:
    ///   `conn` is consumed;
    /// - every byte rustls read was processed (`process_new_packets`
    ///   ran after the last `read_tls`, as tokio-rustls does), so that
    ///   what rustls holds undecrypted is the start of one record, which
    ///   the caller gives as `partial` (see `RecordTail`).
    pub fn take(
        conn: impl Into<rustls::Connection>,
        partial: Vec<u8>,
        secrets: Option<&SecretLog>,
    ) -> Result<TlsState, StateError> {
        Self::take_bounded(
            conn,
            partial,
            (secrets, DEFAULT_MAX_GENERATIONS_AT_HAND_OVER),
        )
    }

    /// `take`, following a TLS 1.3 session's keys through at most
    /// `generations` key updates (`--handover-max-key-generations`).
    pub fn take_bounded(
        conn: impl Into<rustls::Connection>,
        partial: Vec<u8>,
        (secrets, generations): (Option<&SecretLog>, usize),
    ) -> Result<TlsState, StateError> {
        let mut conn = conn.into();
        if conn.is_handshaking() {
            return Err(StateError::Handshaking);
        }
        // A KeyUpdate rustls owes goes into its send buffer only on a
        // write: found here, it means the caller did not send it.
        let _ = conn.writer().write(&[]);
        if conn.wants_write() {
            return Err(StateError::Unsent);
        }
        let side = match conn {
            rustls::Connection::Client(_) => Side::Client,
            rustls::Connection::Server(_) => Side::Server,
        };
        let suite = conn
            .negotiated_cipher_suite()
            .ok_or(StateError::Handshaking)?
            .suite();
        let tls13 = conn.protocol_version() == Some(ProtocolVersion::TLSv1_3);
        let (plaintext, read_closed) = unread_plaintext(&mut conn)?;
        let extracted = conn
            .dangerous_extract_secrets()
            .map_err(StateError::Extract)?;
        let version = if tls13 {
            Version::Tls13
        } else {
            Version::Tls12
        };
        let state = TlsState::from_extracted(
            side,
            (u16::from(suite), version),
            (extracted.tx.0, &extracted.tx.1),
            (extracted.rx.0, &extracted.rx.1),
            (secrets, generations),
        )?;
        let state = TlsState {
            plaintext,
            read_closed,
            partial,
            ..state
        };
        state.check()?;
        Ok(state)
    }

    /// The state from what rustls extracted, with nothing unread. For
    /// TLS 1.3 the traffic secrets come from `secrets`, and are used only
    /// if they give these very keys.
    pub fn from_extracted(
        side: Side,
        (suite, version): (u16, Version),
        (tx_seq, tx): (u64, &ConnectionTrafficSecrets),
        (rx_seq, rx): (u64, &ConnectionTrafficSecrets),
        (secrets, generations): (Option<&SecretLog>, usize),
    ) -> Result<TlsState, StateError> {
        let (want_version, _) = suite_params(suite).ok_or(StateError::Suite(suite))?;
        if want_version != version {
            return Err(StateError::VersionMismatch);
        }
        let tx_keys = Keys::from_extracted(tx).ok_or(StateError::Suite(suite))?;
        let rx_keys = Keys::from_extracted(rx).ok_or(StateError::Suite(suite))?;
        let (tx_secret, rx_secret) = match version {
            Version::Tls12 => (None, None),
            Version::Tls13 => {
                let log = secrets.ok_or(KeyUpdateError::NotLogged)?;
                // Any number of generations on (review S3): a session is
                // taken days after its handshake.
                let (client, server) = match side {
                    Side::Server => TrafficSecrets::followed(log, &rx_keys, &tx_keys, generations)?,
                    Side::Client => TrafficSecrets::followed(log, &tx_keys, &rx_keys, generations)?,
                }
                .into_secrets();
                match side {
                    Side::Server => (Some(server), Some(client)),
                    Side::Client => (Some(client), Some(server)),
                }
            }
        };
        let direction = |keys: &Keys, seq, secret| DirectionState {
            key: KeyBytes(keys.key().to_vec()),
            iv: *keys.iv(),
            seq,
            secret,
        };
        Ok(TlsState {
            side,
            suite,
            tx: direction(&tx_keys, tx_seq, tx_secret),
            rx: direction(&rx_keys, rx_seq, rx_secret),
            plaintext: Vec::new(),
            read_closed: false,
            partial: Vec::new(),
        })
    }

    pub fn version(&self) -> Version {
        suite_params(self.suite).map_or(Version::Tls12, |(v, _)| v)
    }

    /// Every invariant a state must hold, whether taken here or decoded
    /// from another process: a known suite, keys of its length, a secret
    /// exactly in TLS 1.3 that gives the keys, bounded unread bytes, and
    /// a partial record that can still become one record.
    pub fn check(&self) -> Result<(Version, Aead), StateError> {
        let (version, aead) = suite_params(self.suite).ok_or(StateError::Suite(self.suite))?;
        for direction in [&self.tx, &self.rx] {
            check_direction(direction, version, aead)?;
        }
        if self.plaintext.len() > MAX_PENDING_PLAINTEXT {
            return Err(StateError::TooMuchPlaintext(self.plaintext.len()));
        }
        if !partial_is_one_record(&self.partial) {
            return Err(StateError::Partial(self.partial.len()));
        }
        Ok((version, aead))
    }
}

fn check_direction(d: &DirectionState, version: Version, aead: Aead) -> Result<(), StateError> {
    if d.key.0.len() != aead.key_len() {
        return Err(StateError::KeyLength {
            got: d.key.0.len(),
            want: aead.key_len(),
        });
    }
    match (version, &d.secret) {
        (Version::Tls12, None) => Ok(()),
        (Version::Tls13, Some(secret)) => {
            let suite = suite13(aead);
            if secret.as_bytes().len() != suite.hash_len() {
                return Err(StateError::SecretPresence);
            }
            let keys = suite.keys(secret);
            if keys.key() != d.key.0.as_slice() || keys.iv() != &d.iv {
                return Err(StateError::SecretKeys);
            }
            Ok(())
        }
        _ => Err(StateError::SecretPresence),
    }
}

/// The TLS 1.3 suite of an AEAD (one each).
pub fn suite13(aead: Aead) -> Suite {
    match aead {
        Aead::Aes128Gcm => Suite::Aes128GcmSha256,
        Aead::Aes256Gcm => Suite::Aes256GcmSha384,
        Aead::Chacha20Poly1305 => Suite::Chacha20Poly1305Sha256,
    }
}

/// True if `partial` is shorter than the record it starts.
pub fn partial_is_one_record(partial: &[u8]) -> bool {
    if partial.len() < RECORD_HEADER {
        return true;
    }
    let body = usize::from(u16::from_be_bytes([partial[3], partial[4]]));
    body <= MAX_RECORD_BODY && partial.len() < RECORD_HEADER + body
}

/// Drains what rustls decrypted and the application did not read, and
/// whether the peer's close_notify came.
fn unread_plaintext(conn: &mut rustls::Connection) -> Result<(Vec<u8>, bool), StateError> {
    let mut plaintext = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match conn.reader().read(&mut chunk) {
            Ok(0) => return Ok((plaintext, true)),
            Ok(n) => {
                plaintext.extend_from_slice(&chunk[..n]);
                if plaintext.len() > MAX_PENDING_PLAINTEXT {
                    return Err(StateError::TooMuchPlaintext(plaintext.len()));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok((plaintext, false)),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(StateError::PeerEof)
            }
            Err(e) => return Err(StateError::Plaintext(e)),
        }
    }
}
