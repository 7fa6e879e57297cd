//! The NBD protocol without I/O: parsing and encoding of handshake and
//! transmission messages. Nothing here touches a socket, so it can be
//! unit-, property- and fuzz-tested on plain byte slices.

pub mod consts;
pub mod handover;
pub mod handover_client;
pub mod handover_session;
pub mod handshake;
pub mod name;
pub mod proxy;
pub mod transmission;

use thiserror::Error;

/// A message that breaks the protocol: what is wrong with the bytes, not
/// who sent them (the connection's error names the side). Each one ends
/// the connection it came from, and only that one.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ProtoError {
    #[error("bad {what} magic {found:#x}")]
    BadMagic { what: &'static str, found: u64 },
    #[error("client flags {0:#x} lack NBD_FLAG_C_FIXED_NEWSTYLE")]
    NotFixedNewstyle(u32),
    #[error("unknown or unoffered client flags {0:#x}")]
    UnknownClientFlags(u32),
    #[error("{what} length {length} exceeds the limit of {limit} bytes")]
    TooLong {
        what: &'static str,
        length: u64,
        limit: u64,
    },
    #[error("not fixed-newstyle NBD (handshake flags {0:#x})")]
    ServerNotFixedNewstyle(u16),
    #[error("a reply to option {got} while option {expected} was pending")]
    OptionMismatch { expected: u32, got: u32 },
    #[error("a reply to cookie {0:#x}, which has no request in flight")]
    UnknownCookie(u64),
    #[error("a {what} reply, which the negotiated {mode:?} mode does not allow")]
    UnexpectedReply {
        what: &'static str,
        mode: transmission::ReplyMode,
    },
    #[error("a chunk of type {kind:#x} and {length} bytes, which a {command} request cannot get")]
    BadChunk {
        kind: u16,
        length: u64,
        command: &'static str,
    },
    #[error("an error chunk whose message length {message} does not fit its {length} bytes")]
    BadErrorChunk { message: usize, length: usize },
    #[error("{0}")]
    Malformed(&'static str),
}

impl ProtoError {
    /// `TooLong` unless `length` is within `limit`.
    pub fn check_limit(what: &'static str, length: u64, limit: u64) -> Result<(), ProtoError> {
        if length > limit {
            return Err(ProtoError::TooLong {
                what,
                length,
                limit,
            });
        }
        Ok(())
    }
}

pub(crate) fn be_u16(buf: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([buf[at], buf[at + 1]])
}

pub(crate) fn be_u32(buf: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&buf[at..at + 4]);
    u32::from_be_bytes(b)
}

pub(crate) fn be_u64(buf: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[at..at + 8]);
    u64::from_be_bytes(b)
}
