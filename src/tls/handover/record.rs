//! The record layer a successor rebuilds from a `TlsState`, on aws-lc-rs
//! (rustls's provider here). Sans-IO: it seals plaintext into records and
//! opens whole records; `stream` moves the bytes.
//!
//! Protection, as rustls 0.23.46 does it (read in
//! `src/crypto/aws_lc_rs/tls13.rs` and `tls12.rs`):
//! - TLS 1.3 (RFC 8446 §5.2, §5.3): outer type 23, version 0x0303, AAD the
//!   5-byte header, nonce = IV XOR seq (left-padded), inner content type
//!   after the plaintext, no padding.
//! - TLS 1.2 AES-GCM (RFC 5288): nonce = 4-byte salt ‖ 8-byte explicit
//!   part; rustls makes the explicit part the key block's 8 extra bytes
//!   XOR seq (so the whole nonce is the extracted 12-byte IV XOR seq, as
//!   here), and sends it before the ciphertext; a received record's own
//!   explicit part is used to open it. AAD = seq ‖ type ‖ version ‖
//!   plaintext length.
//! - TLS 1.2 ChaCha20-Poly1305 (RFC 7905): nonce = IV XOR seq, nothing
//!   explicit, the same AAD.

use aws_lc_rs::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};

use super::state::{
    suite13, Aead, DirectionState, KeyBytes, Side, StateError, TlsState, Version, MAX_RECORD_BODY,
    RECORD_HEADER,
};
use crate::tls::key_update::{
    self, KeyUpdateRequest, Secret, KEY_UPDATE_LEN, MAX_KEY_UPDATES_WITHOUT_DATA,
    MAX_WARNING_ALERTS,
};

pub const CHANGE_CIPHER_SPEC: u8 = 20;
pub const ALERT: u8 = 21;
pub const HANDSHAKE: u8 = 22;
pub const APPLICATION_DATA: u8 = 23;
/// The largest plaintext of one record (RFC 8446 §5.1).
pub const MAX_PLAINTEXT: usize = 16_384;
const TAG: usize = 16;
const GCM_EXPLICIT: usize = 8;
const ALERT_CLOSE_NOTIFY: u8 = 0;
const ALERT_UNEXPECTED_MESSAGE: u8 = 10;
const ALERT_BAD_RECORD_MAC: u8 = 20;
const ALERT_RECORD_OVERFLOW: u8 = 22;
const ALERT_DECODE_ERROR: u8 = 50;
const ALERT_USER_CANCELED: u8 = 90;
const NEW_SESSION_TICKET: u8 = 4;
const KEY_UPDATE: u8 = 24;

/// Why the record layer stopped. `alert` is what to send the peer first
/// (a fatal alert), if anything.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("a record did not decrypt (a wrong key or sequence number, or tampering)")]
    BadRecordMac,
    #[error("a record of {0} bytes is over the limit")]
    Overflow(usize),
    #[error("peer sent a record of type {0} this record layer does not take")]
    UnexpectedType(u8),
    #[error("peer sent handshake message type {0} after the handshake (TLS 1.2 renegotiation and TLS 1.3 post-handshake authentication are refused)")]
    UnexpectedHandshake(u8),
    #[error("peer sent a malformed record: {0}")]
    Malformed(&'static str),
    #[error("key update: {0}")]
    KeyUpdate(#[from] key_update::KeyUpdateError),
    #[error("peer sent TLS alert {description} (level {level})")]
    PeerAlert { level: u8, description: u8 },
    #[error("peer sent more than {0} warning alerts or key updates without data")]
    TooMany(u32),
    #[error("the {0} sequence number would wrap")]
    SequenceWrap(&'static str),
    #[error("TLS 1.2 session reached its key's record limit: closed (TLS 1.2 cannot re-key)")]
    KeyLimit,
    #[error("the session is closed for writing")]
    WriteClosed,
    #[error("state refused: {0}")]
    State(#[from] StateError),
}

impl RecordError {
    /// The fatal alert the peer is told, if this is its error.
    pub fn alert(&self) -> Option<u8> {
        match self {
            RecordError::BadRecordMac => Some(ALERT_BAD_RECORD_MAC),
            RecordError::Overflow(_) => Some(ALERT_RECORD_OVERFLOW),
            RecordError::UnexpectedType(_)
            | RecordError::UnexpectedHandshake(_)
            | RecordError::TooMany(_) => Some(ALERT_UNEXPECTED_MESSAGE),
            RecordError::Malformed(_) | RecordError::KeyUpdate(_) => Some(ALERT_DECODE_ERROR),
            _ => None,
        }
    }
}

/// What one opened record was.
#[derive(Debug, PartialEq, Eq)]
pub enum Opened {
    /// Application data: this range of the record buffer.
    Data(std::ops::Range<usize>),
    /// A record for the layer itself (a KeyUpdate, a ticket, a warning).
    Control,
    /// The peer's close_notify.
    Closed,
}

/// One direction's protection: key, IV, sequence number, and in TLS 1.3
/// the secret for the next generation.
struct Direction {
    key: LessSafeKey,
    iv: [u8; 12],
    seq: u64,
    secret: Option<Secret>,
    /// Records under the current key (send side: for the key limit).
    records: u64,
    /// The key's bytes, to hand the session on again (`RecordLayer::again`).
    raw: KeyBytes,
}

impl Direction {
    fn new(aead: Aead, d: &DirectionState) -> Result<Self, StateError> {
        let key = unbound(aead, &d.key.0)?;
        Ok(Direction {
            key,
            iv: d.iv,
            seq: d.seq,
            secret: d.secret.clone(),
            // Records already sealed under this key: in TLS 1.3 the count
            // restarts with each key, and a TLS 1.2 session has one key.
            records: d.seq,
            raw: d.key.clone(),
        })
    }

    fn nonce(&self, seq: u64) -> [u8; 12] {
        let mut nonce = self.iv;
        for (n, s) in nonce[4..].iter_mut().zip(seq.to_be_bytes()) {
            *n ^= s;
        }
        nonce
    }

    /// The sequence number for the next record, and one past it: a
    /// number is used once and never again under this key.
    fn next_seq(&mut self, which: &'static str) -> Result<u64, RecordError> {
        let seq = self.seq;
        self.seq = seq.checked_add(1).ok_or(RecordError::SequenceWrap(which))?;
        self.records = self.records.saturating_add(1);
        Ok(seq)
    }

    /// TLS 1.3: the next generation's key, with its count from zero
    /// (RFC 8446 §5.3: the sequence number restarts with each key).
    fn update(&mut self, aead: Aead) -> Result<(), StateError> {
        let suite = suite13(aead);
        let secret = self.secret.as_ref().ok_or(StateError::SecretPresence)?;
        let next = suite.next(secret);
        let keys = suite.keys(&next);
        self.key = unbound(aead, keys.key())?;
        self.raw = KeyBytes(keys.key().to_vec());
        self.iv = *keys.iv();
        self.secret = Some(next);
        self.seq = 0;
        self.records = 0;
        Ok(())
    }
}

impl Drop for Direction {
    /// The key wipes itself (aws-lc cleanses its AEAD context); the IV
    /// is this struct's.
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.iv);
    }
}

fn unbound(aead: Aead, key: &[u8]) -> Result<LessSafeKey, StateError> {
    let alg = match aead {
        Aead::Aes128Gcm => &aead::AES_128_GCM,
        Aead::Aes256Gcm => &aead::AES_256_GCM,
        Aead::Chacha20Poly1305 => &aead::CHACHA20_POLY1305,
    };
    UnboundKey::new(alg, key)
        .map(LessSafeKey::new)
        .map_err(|_| StateError::KeyLength {
            got: key.len(),
            want: aead.key_len(),
        })
}

/// The records of one rebuilt session.
pub struct RecordLayer {
    version: Version,
    aead: Aead,
    side: Side,
    tx: Direction,
    rx: Direction,
    /// Records sent under one key before it is replaced (TLS 1.3) or the
    /// session closed (TLS 1.2).
    key_limit: u64,
    /// A KeyUpdate goes out before the next record: the peer asked, or
    /// this side chose to.
    update_tx: bool,
    updates_without_data: u32,
    warning_alerts: u32,
    /// Key updates followed: received, sent.
    pub updates: [u64; 2],
    /// A TLS 1.3 server's NewSessionTickets skipped in client mode.
    pub tickets_skipped: u64,
    write_closed: bool,
    /// A TLS 1.2 key reached its limit and the session was closed.
    worn_out: bool,
}

impl RecordLayer {
    /// The layer a state describes. `key_limit` is `--ktls-key-limit` if
    /// given; else the session goes on exactly as the predecessor's
    /// rustls would have taken it (`rustls_limit`), so that a session
    /// rustls would have served is never closed by the hand-over.
    pub fn new(state: &TlsState, key_limit: Option<u64>) -> Result<Self, StateError> {
        let (version, aead) = state.check()?;
        Ok(RecordLayer {
            version,
            aead,
            side: state.side,
            tx: Direction::new(aead, &state.tx)?,
            rx: Direction::new(aead, &state.rx)?,
            key_limit: key_limit
                .unwrap_or_else(|| rustls_limit(version, aead))
                .max(2),
            update_tx: false,
            updates_without_data: 0,
            warning_alerts: 0,
            updates: [0; 2],
            tickets_skipped: 0,
            write_closed: false,
            worn_out: false,
        })
    }

    pub fn version(&self) -> Version {
        self.version
    }

    /// Both directions as a state, to hand the session on to another
    /// process again: None while a KeyUpdate is owed (it must go out
    /// first) or once the write side is closed or worn out.
    pub fn again(&self) -> Option<(Side, DirectionState, DirectionState)> {
        if self.update_tx || self.write_closed || self.worn_out {
            return None;
        }
        let state = |d: &Direction| DirectionState {
            key: d.raw.clone(),
            iv: d.iv,
            seq: d.seq,
            secret: d.secret.clone(),
        };
        Some((self.side, state(&self.tx), state(&self.rx)))
    }

    /// The next sequence numbers: sending, receiving.
    pub fn sequence_numbers(&self) -> (u64, u64) {
        (self.tx.seq, self.rx.seq)
    }

    /// TLS 1.3: send a KeyUpdate before the next record.
    pub fn request_key_update(&mut self) {
        if self.version == Version::Tls13 {
            self.update_tx = true;
        }
    }

    /// Seals as much of `plain` as fits into records of at most 2^14
    /// bytes each, appended to `out`; returns how much. As rustls: one
    /// record per 16 KiB of a write, the last one shorter. A key update
    /// owed or due goes before. A TLS 1.2 session at its key limit gets
    /// close_notify and `KeyLimit` instead.
    pub fn seal_data(&mut self, plain: &[u8], out: &mut Vec<u8>) -> Result<usize, RecordError> {
        if self.worn_out {
            return Err(RecordError::KeyLimit);
        }
        if self.write_closed {
            return Err(RecordError::WriteClosed);
        }
        let mut done = 0;
        for chunk in plain.chunks(MAX_PLAINTEXT) {
            if let Err(e) = self.before_record(out) {
                if done > 0 {
                    return Ok(done);
                }
                return Err(e);
            }
            self.seal(APPLICATION_DATA, chunk, out)?;
            done += chunk.len();
        }
        Ok(done)
    }

    /// Seals the KeyUpdate owed (asked for by the peer or by
    /// `request_key_update`) now rather than before the next record.
    pub fn seal_owed_update(&mut self, out: &mut Vec<u8>) -> Result<(), RecordError> {
        if self.update_tx && !self.write_closed {
            self.before_record(out)?;
        }
        Ok(())
    }

    /// A KeyUpdate if one is owed or the key is worn; the 1.2 close.
    fn before_record(&mut self, out: &mut Vec<u8>) -> Result<(), RecordError> {
        // The KeyUpdate or close_notify is a record under the old key too.
        let worn = self.tx.records.saturating_add(1) >= self.key_limit;
        match self.version {
            Version::Tls12 if worn => {
                self.seal_alert(ALERT_CLOSE_NOTIFY, 1, out)?;
                self.worn_out = true;
                Err(RecordError::KeyLimit)
            }
            Version::Tls13 if worn || self.update_tx => {
                self.seal(HANDSHAKE, &key_update::KEY_UPDATE_NOT_REQUESTED, out)?;
                self.tx.update(self.aead)?;
                self.update_tx = false;
                self.updates[1] += 1;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// A KeyUpdate owed goes out now rather than before the next record
    /// (a hand-over must leave nothing owed: `again`).
    pub fn seal_owed(&mut self, out: &mut Vec<u8>) -> Result<(), RecordError> {
        if self.update_tx && !self.write_closed && !self.worn_out {
            self.before_record(out)?;
        }
        Ok(())
    }

    /// close_notify: nothing is sealed after it.
    pub fn seal_close_notify(&mut self, out: &mut Vec<u8>) -> Result<(), RecordError> {
        if self.write_closed {
            return Ok(());
        }
        self.seal_alert(ALERT_CLOSE_NOTIFY, 1, out)
    }

    /// A fatal alert for the peer's error: nothing is sealed after it.
    pub fn seal_fatal(&mut self, description: u8, out: &mut Vec<u8>) -> Result<(), RecordError> {
        if self.write_closed {
            return Ok(());
        }
        self.seal_alert(description, 2, out)
    }

    fn seal_alert(
        &mut self,
        description: u8,
        level: u8,
        out: &mut Vec<u8>,
    ) -> Result<(), RecordError> {
        let sealed = self.seal(ALERT, &[level, description], out);
        self.write_closed = true;
        sealed
    }

    /// A record of any type, as a misbehaving peer would send it: for
    /// tests and the fuzzer only (the session's own records go through
    /// `seal_data` and the alerts).
    #[doc(hidden)]
    pub fn seal_any_for_test(
        &mut self,
        kind: u8,
        plain: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), RecordError> {
        self.seal(kind, plain, out)
    }

    fn seal(&mut self, kind: u8, plain: &[u8], out: &mut Vec<u8>) -> Result<(), RecordError> {
        let seq = self.tx.next_seq("send")?;
        let nonce = Nonce::assume_unique_for_key(self.tx.nonce(seq));
        let start = out.len();
        match self.version {
            Version::Tls13 => {
                let len = plain.len() + 1 + TAG;
                let header = header(APPLICATION_DATA, len);
                out.extend_from_slice(&header);
                out.extend_from_slice(plain);
                out.push(kind);
                let body = &mut out[start + RECORD_HEADER..];
                let tag = self
                    .tx
                    .key
                    .seal_in_place_separate_tag(nonce, Aad::from(header), body);
                out.extend_from_slice(tag.map_err(|_| RecordError::BadRecordMac)?.as_ref());
            }
            Version::Tls12 => {
                let explicit = if self.aead == Aead::Chacha20Poly1305 {
                    0
                } else {
                    GCM_EXPLICIT
                };
                let header = header(kind, explicit + plain.len() + TAG);
                out.extend_from_slice(&header);
                out.extend_from_slice(&nonce.as_ref()[4..4 + explicit]);
                let body_at = out.len();
                out.extend_from_slice(plain);
                let aad = Aad::from(aad12(seq, kind, plain.len()));
                let tag = self
                    .tx
                    .key
                    .seal_in_place_separate_tag(nonce, aad, &mut out[body_at..]);
                out.extend_from_slice(tag.map_err(|_| RecordError::BadRecordMac)?.as_ref());
            }
        }
        Ok(())
    }
}

/// The receiving half: framing, opening, and the records that are not
/// application data.
impl RecordLayer {
    /// The length of the record at the start of `buf` if it is whole;
    /// `None` if more must be read; an error if its header is not one.
    pub fn whole_record(buf: &[u8]) -> Result<Option<usize>, RecordError> {
        if buf.len() < RECORD_HEADER {
            return Ok(None);
        }
        let body = usize::from(u16::from_be_bytes([buf[3], buf[4]]));
        if body > MAX_RECORD_BODY {
            return Err(RecordError::Overflow(body));
        }
        if buf[1] != 3 {
            return Err(RecordError::Malformed("record version"));
        }
        Ok((buf.len() >= RECORD_HEADER + body).then_some(RECORD_HEADER + body))
    }

    /// Opens one whole record (as `whole_record` framed it) in place.
    pub fn open(&mut self, record: &mut [u8]) -> Result<Opened, RecordError> {
        let (kind, range) = match self.version {
            Version::Tls13 => self.open13(record)?,
            Version::Tls12 => self.open12(record)?,
        };
        if range.len() > MAX_PLAINTEXT {
            return Err(RecordError::Overflow(range.len()));
        }
        match kind {
            APPLICATION_DATA => {
                self.updates_without_data = 0;
                Ok(Opened::Data(range))
            }
            ALERT => self.alert(&record[range]),
            HANDSHAKE => self.handshake(&record[range]),
            other => Err(RecordError::UnexpectedType(other)),
        }
    }

    fn open13(&mut self, record: &mut [u8]) -> Result<(u8, std::ops::Range<usize>), RecordError> {
        if record[0] != APPLICATION_DATA {
            return Err(RecordError::UnexpectedType(record[0]));
        }
        if record.len() < RECORD_HEADER + TAG {
            return Err(RecordError::BadRecordMac);
        }
        let seq = self.rx.next_seq("receive")?;
        let nonce = Nonce::assume_unique_for_key(self.rx.nonce(seq));
        let (header, body) = record.split_at_mut(RECORD_HEADER);
        let aad = Aad::from(<[u8; RECORD_HEADER]>::try_from(&*header).unwrap_or_default());
        let plain = self
            .rx
            .key
            .open_in_place(nonce, aad, body)
            .map_err(|_| RecordError::BadRecordMac)?;
        // The inner type is the last byte that is not padding.
        let end = plain
            .iter()
            .rposition(|&b| b != 0)
            .ok_or(RecordError::Malformed("a record of padding only"))?;
        Ok((plain[end], RECORD_HEADER..RECORD_HEADER + end))
    }

    fn open12(&mut self, record: &mut [u8]) -> Result<(u8, std::ops::Range<usize>), RecordError> {
        let kind = record[0];
        let explicit = if self.aead == Aead::Chacha20Poly1305 {
            0
        } else {
            GCM_EXPLICIT
        };
        if record.len() < RECORD_HEADER + explicit + TAG {
            return Err(RecordError::BadRecordMac);
        }
        let seq = self.rx.next_seq("receive")?;
        let mut nonce = self.rx.nonce(seq);
        nonce[4..4 + explicit].copy_from_slice(&record[RECORD_HEADER..RECORD_HEADER + explicit]);
        let start = RECORD_HEADER + explicit;
        let plain_len = record.len() - start - TAG;
        let aad = Aad::from(aad12(seq, kind, plain_len));
        self.rx
            .key
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                aad,
                &mut record[start..],
            )
            .map_err(|_| RecordError::BadRecordMac)?;
        Ok((kind, start..start + plain_len))
    }

    /// close_notify ends the peer's side; user_canceled (and in TLS 1.2
    /// any warning) is counted and capped, as rustls does; anything else
    /// ends the session.
    fn alert(&mut self, alert: &[u8]) -> Result<Opened, RecordError> {
        let [level, description] = *alert else {
            return Err(RecordError::Malformed("alert length"));
        };
        let warning =
            description == ALERT_USER_CANCELED || (self.version == Version::Tls12 && level == 1);
        match description {
            ALERT_CLOSE_NOTIFY => Ok(Opened::Closed),
            _ if warning && self.warning_alerts < MAX_WARNING_ALERTS => {
                self.warning_alerts += 1;
                Ok(Opened::Control)
            }
            _ if warning => Err(RecordError::TooMany(MAX_WARNING_ALERTS)),
            _ => Err(RecordError::PeerAlert { level, description }),
        }
    }

    /// TLS 1.3 KeyUpdate (both sides) and, in client mode, a server's
    /// NewSessionTicket (skipped: a successor does not resume); every
    /// message whole within its record. Nothing else, and nothing at all
    /// in TLS 1.2 (renegotiation).
    fn handshake(&mut self, mut messages: &[u8]) -> Result<Opened, RecordError> {
        if self.version == Version::Tls12 {
            return Err(RecordError::UnexpectedHandshake(
                messages.first().copied().unwrap_or(0),
            ));
        }
        while !messages.is_empty() {
            if messages.len() < 4 {
                return Err(RecordError::Malformed("handshake message header"));
            }
            let len = usize::from(messages[1]) << 16
                | usize::from(messages[2]) << 8
                | usize::from(messages[3]);
            let Some(message) = messages.get(..4 + len) else {
                return Err(RecordError::Malformed(
                    "handshake message split across records",
                ));
            };
            messages = &messages[4 + len..];
            match message[0] {
                NEW_SESSION_TICKET if self.side == Side::Client => self.tickets_skipped += 1,
                KEY_UPDATE if messages.is_empty() && message.len() == KEY_UPDATE_LEN => {
                    self.key_update(message)?;
                }
                other => return Err(RecordError::UnexpectedHandshake(other)),
            }
        }
        Ok(Opened::Control)
    }

    fn key_update(&mut self, message: &[u8]) -> Result<(), RecordError> {
        let request = key_update::parse_key_update(message)?;
        if self.updates_without_data >= MAX_KEY_UPDATES_WITHOUT_DATA {
            return Err(RecordError::TooMany(MAX_KEY_UPDATES_WITHOUT_DATA));
        }
        self.updates_without_data += 1;
        self.rx.update(self.aead)?;
        self.updates[0] += 1;
        if request == KeyUpdateRequest::Requested {
            self.update_tx = true;
        }
        Ok(())
    }
}

fn header(kind: u8, len: usize) -> [u8; RECORD_HEADER] {
    // Lengths here are at most 2^14 + 1 + 16 + 8.
    let len = len as u16;
    [kind, 3, 3, (len >> 8) as u8, len as u8]
}

/// TLS 1.2's additional data (RFC 5246 §6.2.3.3).
fn aad12(seq: u64, kind: u8, len: usize) -> [u8; 13] {
    let mut aad = [0u8; 13];
    aad[..8].copy_from_slice(&seq.to_be_bytes());
    aad[8] = kind;
    aad[9..11].copy_from_slice(&[3, 3]);
    aad[11..].copy_from_slice(&(len as u16).to_be_bytes());
    aad
}

/// `key_limit` as rustls 0.23 applies its suite's confidentiality limit
/// C (`record_layer.rs`, `common_state.rs`: `write_seq_max` = C). TLS
/// 1.3: the KeyUpdate takes the last number under the key, C - 1, as
/// here with `records + 1 >= key_limit` and key_limit = C. TLS 1.2:
/// rustls seals data up to number C - 1 and close_notify at C (an alert
/// is always sealed), which is key_limit = C + 1 here.
fn rustls_limit(version: Version, aead: Aead) -> u64 {
    let limit = confidentiality_limit(version, aead);
    match version {
        Version::Tls13 => limit,
        Version::Tls12 => limit.saturating_add(1),
    }
}

/// The records one key may protect, as rustls states it per suite
/// (RFC 8446 §5.5 for AES-GCM; ChaCha20-Poly1305 has no practical limit).
fn confidentiality_limit(version: Version, aead: Aead) -> u64 {
    use rustls::crypto::aws_lc_rs::cipher_suite as cs;
    let suite = match (version, aead) {
        (Version::Tls13, Aead::Aes128Gcm) => cs::TLS13_AES_128_GCM_SHA256,
        (Version::Tls13, Aead::Aes256Gcm) => cs::TLS13_AES_256_GCM_SHA384,
        (Version::Tls13, Aead::Chacha20Poly1305) => cs::TLS13_CHACHA20_POLY1305_SHA256,
        (Version::Tls12, Aead::Aes128Gcm) => cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        (Version::Tls12, Aead::Aes256Gcm) => cs::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
        (Version::Tls12, Aead::Chacha20Poly1305) => {
            cs::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256
        }
    };
    match suite {
        rustls::SupportedCipherSuite::Tls13(s) => s.common.confidentiality_limit,
        rustls::SupportedCipherSuite::Tls12(s) => s.common.confidentiality_limit,
    }
}
