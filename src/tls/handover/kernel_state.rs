//! `KernelState`: what a kernel TLS session is, as data, at a quiet
//! point, and `SessionTls`, the TLS part of a session's hand-over state:
//! a rustls session (`TlsState`) or a kernel TLS one (this).
//!
//! Under kernel TLS the socket itself carries the keys, the record
//! sequence numbers, a record the kernel has decrypted and nbdgw has read
//! in part, and whatever ciphertext it has not yet decrypted: all of it
//! moves with the descriptor. What the kernel does not keep, and a
//! successor needs to go on as `KernelTls` does, is nbdgw's:
//! - both directions' current TLS 1.3 traffic secrets, to follow the
//!   next key update (the kernel is given keys, never secrets);
//! - the upper bound of records sent under the current sending key, to
//!   update it at the key limit as the predecessor would have;
//! - the counters rustls-like limits are kept with (KeyUpdates without
//!   data, warning alerts) and the key updates followed (for the log);
//! - whether the client's close_notify was read, and plaintext read out
//!   of the socket (or out of rustls, before the kernel took over) that
//!   nothing processed yet.
//!
//! Record sequence numbers are not carried: the kernel seals and opens
//! with its own, which the successor never sets (it installs keys only at
//! a key update, where RFC 8446 restarts the count at 0, as the
//! predecessor would have).
//!
//! Layout (integers big-endian): `"NBDGWKTL"` · format u16 (1) · suite
//! u16 · read_closed u8 · client secret (u8 length, bytes) · server
//! secret (u8 length, bytes) · tx_records u64 · rx updates u64 · tx
//! updates u64 · updates without data u32 · warning alerts u32 ·
//! plaintext (u32 length, bytes).

use super::encoding::{DecodeError, Encoded, Reader};
use super::state::{suite13, suite_params, StateError, TlsState, Version, MAX_PENDING_PLAINTEXT};
use crate::tls::key_update::{Secret, MAX_KEY_UPDATES_WITHOUT_DATA, MAX_WARNING_ALERTS};

const MAGIC: &[u8; 8] = b"NBDGWKTL";
/// The only format this build writes and reads.
pub const FORMAT: u16 = 1;

/// A kernel TLS session (always TLS 1.3: only those go to the kernel)
/// at a quiet point. Secrets are wiped when dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelState {
    /// The negotiated TLS 1.3 suite's IANA number.
    pub suite: u16,
    /// The current generation's traffic secret the client sends with.
    pub client: Secret,
    /// The current generation's traffic secret nbdgw sends with.
    pub server: Secret,
    /// An upper bound of the records sent under the current sending key.
    pub tx_records: u64,
    /// Key updates followed so far: the client's, nbdgw's own.
    pub updates: [u64; 2],
    /// The client's KeyUpdates since its last application data.
    pub updates_without_data: u32,
    /// The client's warning alerts so far.
    pub warning_alerts: u32,
    /// The client's close_notify was read: nothing more is to be read.
    pub read_closed: bool,
    /// Plaintext read and not yet processed; it goes before anything
    /// read from the socket.
    pub plaintext: Vec<u8>,
}

impl KernelState {
    /// A known TLS 1.3 suite, secrets of its hash length, counters within
    /// the limits the session would have been ended at, bounded plaintext.
    pub fn check(&self) -> Result<(), StateError> {
        match suite_params(self.suite) {
            Some((Version::Tls13, aead)) => {
                let hash = suite13(aead).hash_len();
                if self.client.as_bytes().len() != hash || self.server.as_bytes().len() != hash {
                    return Err(StateError::SecretPresence);
                }
            }
            _ => return Err(StateError::Suite(self.suite)),
        }
        if self.updates_without_data > MAX_KEY_UPDATES_WITHOUT_DATA
            || self.warning_alerts > MAX_WARNING_ALERTS
        {
            return Err(StateError::Limits);
        }
        if self.plaintext.len() > MAX_PENDING_PLAINTEXT {
            return Err(StateError::TooMuchPlaintext(self.plaintext.len()));
        }
        Ok(())
    }

    pub fn encode(&self) -> Encoded {
        // Sized above the most it holds (two 48-byte secrets and the
        // counters take under 160 bytes): it never grows, so no copy of
        // the secrets is left behind by a reallocation, and it is wiped
        // when dropped.
        let mut out =
            zeroize::Zeroizing::new(Vec::with_capacity(MAGIC.len() + 160 + self.plaintext.len()));
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT.to_be_bytes());
        out.extend_from_slice(&self.suite.to_be_bytes());
        out.push(u8::from(self.read_closed));
        for secret in [&self.client, &self.server] {
            // At most 48 bytes: `check` runs before a state is taken.
            let bytes = secret.as_bytes();
            out.push(u8::try_from(bytes.len()).unwrap_or(u8::MAX));
            out.extend_from_slice(&bytes[..bytes.len().min(255)]);
        }
        for count in [self.tx_records, self.updates[0], self.updates[1]] {
            out.extend_from_slice(&count.to_be_bytes());
        }
        out.extend_from_slice(&self.updates_without_data.to_be_bytes());
        out.extend_from_slice(&self.warning_alerts.to_be_bytes());
        let len = u32::try_from(self.plaintext.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&self.plaintext);
        Encoded(out)
    }

    pub fn decode(bytes: &[u8]) -> Result<KernelState, DecodeError> {
        let mut r = Reader(bytes);
        if r.take(MAGIC.len())? != MAGIC {
            return Err(DecodeError::Magic);
        }
        let format = r.u16()?;
        if format != FORMAT {
            return Err(DecodeError::Format(format));
        }
        let suite = r.u16()?;
        let read_closed = match r.u8()? {
            0 => false,
            1 => true,
            _ => return Err(DecodeError::Field("read_closed")),
        };
        let mut secret = || -> Result<Secret, DecodeError> {
            let len = usize::from(r.u8()?);
            Ok(Secret::new(r.take(len)?))
        };
        let (client, server) = (secret()?, secret()?);
        let (tx_records, rx_updates, tx_updates) = (r.u64()?, r.u64()?, r.u64()?);
        let state = KernelState {
            suite,
            client,
            server,
            tx_records,
            updates: [rx_updates, tx_updates],
            updates_without_data: r.u32()?,
            warning_alerts: r.u32()?,
            read_closed,
            plaintext: r.long()?.to_vec(),
        };
        if !r.0.is_empty() {
            return Err(DecodeError::Trailing(r.0.len()));
        }
        state.check()?;
        Ok(state)
    }
}

/// The TLS part of a session's hand-over state, told apart by its magic:
/// a build that knows only rustls states refuses a kernel one (`Magic`),
/// and its offer before it (the offer's format, `Offer::kernel_tls`), so
/// such a session drains in the old gateway instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionTls {
    Rustls(TlsState),
    Kernel(KernelState),
}

impl SessionTls {
    pub fn decode(bytes: &[u8]) -> Result<SessionTls, DecodeError> {
        if bytes.starts_with(MAGIC) {
            KernelState::decode(bytes).map(SessionTls::Kernel)
        } else {
            TlsState::decode(bytes).map(SessionTls::Rustls)
        }
    }

    pub fn encode(&self) -> Encoded {
        match self {
            SessionTls::Rustls(state) => state.encode(),
            SessionTls::Kernel(state) => state.encode(),
        }
    }

    pub fn check(&self) -> Result<(), StateError> {
        match self {
            SessionTls::Rustls(state) => state.check().map(drop),
            SessionTls::Kernel(state) => state.check(),
        }
    }

    pub fn suite(&self) -> u16 {
        match self {
            SessionTls::Rustls(state) => state.suite,
            SessionTls::Kernel(state) => state.suite,
        }
    }

    pub fn is_kernel(&self) -> bool {
        matches!(self, SessionTls::Kernel(_))
    }

    /// Plaintext read and not processed: `before` goes first.
    pub fn put_before_plaintext(&mut self, before: Vec<u8>) {
        if before.is_empty() {
            return;
        }
        let plaintext = match self {
            SessionTls::Rustls(state) => &mut state.plaintext,
            SessionTls::Kernel(state) => &mut state.plaintext,
        };
        let mut all = before;
        all.extend_from_slice(plaintext);
        *plaintext = all;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> KernelState {
        KernelState {
            suite: 0x1302,
            client: Secret::new(&[1; 48]),
            server: Secret::new(&[2; 48]),
            tx_records: 12_345,
            updates: [3, 4],
            updates_without_data: 2,
            warning_alerts: 1,
            read_closed: false,
            plaintext: b"a request header in part".to_vec(),
        }
    }

    #[test]
    fn a_kernel_state_round_trips_and_is_told_from_a_rustls_one() {
        let encoded = state().encode();
        assert_eq!(KernelState::decode(&encoded).unwrap(), state());
        assert_eq!(
            SessionTls::decode(&encoded).unwrap(),
            SessionTls::Kernel(state())
        );
        // A build that knows only rustls states refuses it whole.
        assert!(matches!(
            TlsState::decode(&encoded),
            Err(DecodeError::Magic)
        ));
    }

    #[test]
    fn every_cut_and_every_trailing_byte_is_refused() {
        let encoded = state().encode().to_vec();
        for cut in 0..encoded.len() {
            assert!(KernelState::decode(&encoded[..cut]).is_err(), "cut {cut}");
        }
        let mut longer = encoded.clone();
        longer.push(0);
        assert!(matches!(
            KernelState::decode(&longer),
            Err(DecodeError::Trailing(1))
        ));
    }

    #[test]
    fn states_a_session_could_not_be_in_are_refused() {
        let refused = |s: KernelState| KernelState::decode(&s.encode()).is_err();
        // TLS 1.2 never goes to the kernel; a secret of another length.
        assert!(refused(KernelState {
            suite: 0xc02f,
            ..state()
        }));
        assert!(refused(KernelState {
            client: Secret::new(&[1; 32]),
            ..state()
        }));
        assert!(refused(KernelState {
            updates_without_data: MAX_KEY_UPDATES_WITHOUT_DATA + 1,
            ..state()
        }));
        assert!(refused(KernelState {
            plaintext: vec![0; MAX_PENDING_PLAINTEXT + 1],
            ..state()
        }));
        let mut bad_format = state().encode().to_vec();
        bad_format[9] = 2;
        assert!(matches!(
            KernelState::decode(&bad_format),
            Err(DecodeError::Format(2))
        ));
    }
}
