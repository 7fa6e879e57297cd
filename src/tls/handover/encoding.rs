//! The wire form of a `TlsState`, for the hand-over channel. Versioned:
//! a successor refuses a version it does not know (and the session drains
//! the old way). Every length is checked against the input and against
//! its own bound before anything is read; decoding never panics, and a
//! decoded state must pass `TlsState::check` (so a secret that does not
//! give its keys, or a partial record that cannot be one, is refused).
//!
//! Layout (integers big-endian):
//! `"NBDGWTLS"` · format u16 (1) · side u8 (0 server, 1 client) · suite
//! u16 · read_closed u8 (0/1) · tx · rx · plaintext (u32 length, bytes) ·
//! partial (u32 length, bytes); a direction is seq u64 · key (u8 length,
//! bytes) · iv (12 bytes) · secret (u8 length, bytes; 0 = none).

use zeroize::Zeroizing;

use super::state::{DirectionState, KeyBytes, Side, StateError, TlsState};
use crate::tls::key_update::Secret;

const MAGIC: &[u8; 8] = b"NBDGWTLS";
/// The only format this build writes and reads.
pub const FORMAT: u16 = 1;

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("not a TLS state (bad magic)")]
    Magic,
    #[error("TLS state format {0}, this build knows only {FORMAT}")]
    Format(u16),
    #[error("TLS state truncated")]
    Truncated,
    #[error("{0} bytes after the end of the TLS state")]
    Trailing(usize),
    #[error("TLS state field {0} has an invalid value")]
    Field(&'static str),
    #[error("TLS state refused: {0}")]
    State(#[from] StateError),
}

/// An encoded state: it holds the session's keys, so it is wiped when
/// dropped (`Zeroizing` wipes the whole allocation, and `encode` makes
/// exactly one: no copy is left behind by a reallocation); read it as
/// bytes.
pub struct Encoded(pub(super) Zeroizing<Vec<u8>>);

impl std::ops::Deref for Encoded {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl TlsState {
    pub fn encode(&self) -> Encoded {
        let len = self.encoded_len();
        let mut out = Zeroizing::new(Vec::with_capacity(len));
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT.to_be_bytes());
        out.push(match self.side {
            Side::Server => 0,
            Side::Client => 1,
        });
        out.extend_from_slice(&self.suite.to_be_bytes());
        out.push(u8::from(self.read_closed));
        for d in [&self.tx, &self.rx] {
            out.extend_from_slice(&d.seq.to_be_bytes());
            put_short(&mut out, &d.key.0);
            out.extend_from_slice(&d.iv);
            put_short(
                &mut out,
                d.secret.as_ref().map_or(&[][..], Secret::as_bytes),
            );
        }
        put_long(&mut out, &self.plaintext);
        put_long(&mut out, &self.partial);
        debug_assert_eq!(out.len(), len, "encoded_len is the layout's");
        Encoded(out)
    }

    /// The encoding's exact length (the layout in the module doc).
    fn encoded_len(&self) -> usize {
        let short = |bytes: &[u8]| 1 + bytes.len().min(255);
        let direction = |d: &DirectionState| {
            8 + short(&d.key.0) + 12 + short(d.secret.as_ref().map_or(&[][..], Secret::as_bytes))
        };
        MAGIC.len()
            + 2
            + 1
            + 2
            + 1
            + direction(&self.tx)
            + direction(&self.rx)
            + 4
            + self.plaintext.len()
            + 4
            + self.partial.len()
    }

    pub fn decode(bytes: &[u8]) -> Result<TlsState, DecodeError> {
        let mut r = Reader(bytes);
        if r.take(MAGIC.len())? != MAGIC {
            return Err(DecodeError::Magic);
        }
        let format = r.u16()?;
        if format != FORMAT {
            return Err(DecodeError::Format(format));
        }
        let side = match r.u8()? {
            0 => Side::Server,
            1 => Side::Client,
            _ => return Err(DecodeError::Field("side")),
        };
        let suite = r.u16()?;
        let read_closed = match r.u8()? {
            0 => false,
            1 => true,
            _ => return Err(DecodeError::Field("read_closed")),
        };
        let tx = r.direction()?;
        let rx = r.direction()?;
        let plaintext = r.long()?.to_vec();
        let partial = r.long()?.to_vec();
        if !r.0.is_empty() {
            return Err(DecodeError::Trailing(r.0.len()));
        }
        let state = TlsState {
            side,
            suite,
            tx,
            rx,
            plaintext,
            read_closed,
            partial,
        };
        state.check()?;
        Ok(state)
    }
}

fn put_short(out: &mut Vec<u8>, bytes: &[u8]) {
    // Keys and secrets are at most 48 bytes: checked before encoding.
    out.push(u8::try_from(bytes.len()).unwrap_or(u8::MAX));
    out.extend_from_slice(&bytes[..bytes.len().min(255)]);
}

fn put_long(out: &mut Vec<u8>, bytes: &[u8]) {
    // Bounded far below 4 GiB by `check` (plaintext, one record).
    out.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(bytes);
}

pub(super) struct Reader<'a>(pub(super) &'a [u8]);

impl<'a> Reader<'a> {
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError::Truncated);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    pub(super) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    pub(super) fn u16(&mut self) -> Result<u16, DecodeError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    pub(super) fn u32(&mut self) -> Result<u32, DecodeError> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_be_bytes(b))
    }

    pub(super) fn u64(&mut self) -> Result<u64, DecodeError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(b))
    }

    pub(super) fn long(&mut self) -> Result<&'a [u8], DecodeError> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        // Checked against what is there before anything is allocated.
        let len = usize::try_from(u32::from_be_bytes(b)).map_err(|_| DecodeError::Truncated)?;
        self.take(len)
    }

    fn direction(&mut self) -> Result<DirectionState, DecodeError> {
        let seq = self.u64()?;
        let key_len = usize::from(self.u8()?);
        let key = KeyBytes(self.take(key_len)?.to_vec());
        let mut iv = [0u8; 12];
        iv.copy_from_slice(self.take(12)?);
        let secret_len = usize::from(self.u8()?);
        let secret = match secret_len {
            0 => None,
            n => Some(Secret::new(self.take(n)?)),
        };
        Ok(DirectionState {
            key,
            iv,
            seq,
            secret,
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::tls::handover::state::{suite13, suite_params, Aead, Version};

    const SUITES: [u16; 6] = [0x1301, 0x1302, 0x1303, 0xc02b, 0xc02c, 0xcca9];

    fn direction(version: Version, aead: Aead, seed: u8, seq: u64) -> DirectionState {
        match version {
            Version::Tls12 => DirectionState {
                key: KeyBytes(vec![seed; aead.key_len()]),
                iv: [seed ^ 0x5a; 12],
                seq,
                secret: None,
            },
            Version::Tls13 => {
                let suite = suite13(aead);
                let secret = Secret::new(&vec![seed; suite.hash_len()]);
                let keys = suite.keys(&secret);
                DirectionState {
                    key: KeyBytes(keys.key().to_vec()),
                    iv: *keys.iv(),
                    seq,
                    secret: Some(secret),
                }
            }
        }
    }

    prop_compose! {
        fn states()(
            suite in proptest::sample::select(SUITES.to_vec()),
            client in any::<bool>(),
            seeds in any::<(u8, u8)>(),
            seqs in any::<(u64, u64)>(),
            plaintext in proptest::collection::vec(any::<u8>(), 0..300),
            partial_len in 0usize..40,
            read_closed in any::<bool>(),
        ) -> TlsState {
            let (version, aead) = suite_params(suite).unwrap();
            // A header announcing 100 bytes, cut short.
            let partial = [23u8, 3, 3, 0, 100].iter().copied().chain(0..)
                .take(partial_len).collect();
            TlsState {
                side: if client { Side::Client } else { Side::Server },
                suite,
                tx: direction(version, aead, seeds.0, seqs.0),
                rx: direction(version, aead, seeds.1, seqs.1),
                plaintext,
                read_closed,
                partial,
            }
        }
    }

    proptest! {
        #[test]
        fn states_round_trip(state in states()) {
            let bytes = state.encode();
            let back = TlsState::decode(&bytes).unwrap();
            prop_assert_eq!(back, state);
        }

        /// Every strict prefix and every extension is refused.
        /// One allocation of exactly the encoding's length: a
        /// reallocation would leave a copy of the keys behind, unwiped
        /// (review round 2, S4).
        #[test]
        fn an_encoding_is_one_exact_allocation(state in states()) {
            let encoded = state.encode();
            prop_assert_eq!(encoded.0.capacity(), encoded.len());
        }

        #[test]
        fn cut_or_extended_states_are_refused(state in states(), cut in any::<prop::sample::Index>()) {
            let bytes = state.encode();
            let at = cut.index(bytes.len());
            prop_assert!(TlsState::decode(&bytes[..at]).is_err());
            let mut longer = bytes.to_vec();
            longer.push(0);
            prop_assert!(matches!(TlsState::decode(&longer), Err(DecodeError::Trailing(1))));
        }

        /// Any single byte changed: refused, or a valid state (never a
        /// panic); a changed key or secret of TLS 1.3 is always refused.
        #[test]
        fn changed_bytes_never_panic(state in states(), at in any::<prop::sample::Index>(), x in 1u8..) {
            let mut bytes = state.encode().to_vec();
            let i = at.index(bytes.len());
            bytes[i] ^= x;
            let _ = TlsState::decode(&bytes);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = TlsState::decode(&bytes);
            let mut framed = b"NBDGWTLS\0\x01".to_vec();
            framed.extend(bytes);
            let _ = TlsState::decode(&framed);
        }
    }

    #[test]
    fn an_unknown_format_or_a_mismatched_secret_is_refused() {
        let state = TlsState {
            side: Side::Server,
            suite: 0x1301,
            tx: direction(Version::Tls13, Aead::Aes128Gcm, 1, 0),
            rx: direction(Version::Tls13, Aead::Aes128Gcm, 2, 0),
            plaintext: vec![],
            read_closed: false,
            partial: vec![],
        };
        let mut bytes = state.encode().to_vec();
        bytes[9] = 2;
        assert!(matches!(
            TlsState::decode(&bytes),
            Err(DecodeError::Format(2))
        ));
        let mut other = state.clone();
        other.tx.secret = other.rx.secret.clone();
        assert!(matches!(
            TlsState::decode(&other.encode()),
            Err(DecodeError::State(StateError::SecretKeys))
        ));
        let mut whole = state.clone();
        whole.partial = vec![23, 3, 3, 0, 1, 0];
        assert!(matches!(
            TlsState::decode(&whole.encode()),
            Err(DecodeError::State(StateError::Partial(6)))
        ));
        assert_eq!(TlsState::decode(&state.encode()).unwrap(), state);
    }
}
