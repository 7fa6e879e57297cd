//! A rustls session handed to another process (issue 29, items 2 and 3):
//! taken out of rustls as data at a quiet point (`state::TlsState`),
//! carried (`encoding`), and rebuilt in the successor as a record layer
//! on aws-lc-rs, rustls's provider here (`record`, `stream`). `tail`
//! keeps the one thing rustls holds and will not give back: the start of
//! a record read but not yet whole.
//!
//! The predecessor, per session:
//! 1. reads the client socket through `RecordTail` from the handshake on
//!    (and, for TLS 1.3, has a `SecretLog` as the connection's key log
//!    and `enable_secret_extraction` set);
//! 2. at a quiet point, stops writing, and `send_owed_server` (or
//!    `_client`): a KeyUpdate rustls owes the peer is queued by a write
//!    of nothing, and every record rustls holds is sent;
//! 3. `take_server` (`TlsStream::into_inner`, `RecordTail::into_parts`,
//!    `TlsState::take(conn, partial, Some(&log))`), and `encode()`;
//! 4. passes the encoding with the socket, and never writes on it again.
//!
//! The successor: `TlsState::decode`, then `ResumedTls::new(socket,
//! state, key_limit)`, and relays over it.
//!
//! # Why no nonce is used twice across the hand-over
//!
//! An AEAD nonce here is a function of (key, IV, sequence number): IV XOR
//! seq in TLS 1.3 and for TLS 1.2 ChaCha20, and for TLS 1.2 AES-GCM the
//! same value, as rustls builds its explicit part (IV's last 8 bytes XOR
//! seq) and as `record` does. So a nonce repeats under a key exactly when
//! a sequence number is used twice under that key. That cannot happen:
//!
//! - **One writer at a time.** The predecessor takes the state only after
//!   its last record has left rustls (`take` refuses while rustls holds
//!   a record to send, and first makes rustls queue any KeyUpdate it
//!   owes, refusing if one appears), and it consumes the rustls
//!   connection, so nothing can be sealed with it afterwards. The
//!   successor seals nothing before it has decoded the state. Which
//!   process holds the session in between is the channel's business
//!   (issue 29 item 3); this module only guarantees that the state names
//!   the sequence number *after* every record the predecessor sealed.
//! - **The count is carried exactly.** `tx.seq` is rustls's own
//!   `write_seq` as `dangerous_extract_secrets` reports it: the number of
//!   the next record, one past the last one sealed. The successor starts
//!   there and `Direction::next_seq` hands each number out once and
//!   moves on; a number at `u64::MAX` is an error, never a wrap.
//! - **Keys only move forward.** A TLS 1.3 key update replaces key and IV
//!   with the next generation's (RFC 8446 §7.2) and restarts the count
//!   at 0, as the RFC requires; generations never repeat (HKDF of the
//!   previous secret), and the state carries the secret of the current
//!   generation, checked to give the carried key and IV, so the successor
//!   cannot go back to an older one. A TLS 1.3 key is replaced after
//!   `key_limit` records, a TLS 1.2 session is closed instead.
//! - **Nothing sealed is lost.** If the predecessor dies after sealing
//!   but before the state is taken, no state exists and the session is
//!   only closed; a state taken twice from one connection is impossible
//!   (`take` consumes it, and the key log gives its secrets once).
//!
//! A state whose send sequence number is lower than the truth (a bug, or
//! a replayed state) would reuse a nonce; the peer then sees a record
//! whose number it has passed, and its AEAD check fails (`bad_record_mac`):
//! a test lowers the number by one and checks that rustls refuses it.

pub mod encoding;
pub mod kernel_state;
pub mod quiesce;
pub mod record;
pub mod state;
pub mod stream;
pub mod tail;

#[cfg(test)]
mod refused_records;
#[cfg(test)]
mod tests;

pub use encoding::{DecodeError, Encoded};
pub use kernel_state::{KernelState, SessionTls};
pub use quiesce::{
    send_owed_client, send_owed_server, take_client, take_client_bounded, take_server,
};
pub use record::{RecordError, RecordLayer};
pub use state::{Side, StateError, TlsState, Version};
pub use stream::ResumedTls;
pub use tail::RecordTail;
