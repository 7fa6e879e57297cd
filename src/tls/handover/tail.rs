//! `RecordTail`: the socket as rustls reads it while a hand-over may come,
//! keeping the bytes of the record not yet whole (rustls holds them
//! undecrypted and gives no way to get them back). Reads are as large as
//! rustls asks; only the trailing part of a record cut by a read is
//! copied, at most one record's worth.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::state::RECORD_HEADER;

pub struct RecordTail<IO> {
    io: IO,
    tail: Vec<u8>,
    /// Off: a plain pass-through (no hand-over configured), which costs
    /// a branch per read.
    on: bool,
    /// The connection's own key log (TLS 1.3 secrets), kept with the
    /// socket so that whoever takes the session finds it.
    secrets: Option<std::sync::Arc<crate::tls::key_update::SecretLog>>,
}

impl<IO> RecordTail<IO> {
    pub fn new(io: IO) -> Self {
        RecordTail {
            io,
            tail: Vec::new(),
            on: true,
            secrets: None,
        }
    }

    /// A pass-through: keeps nothing, for sessions never handed over.
    pub fn off(io: IO) -> Self {
        RecordTail {
            on: false,
            ..RecordTail::new(io)
        }
    }

    /// Keeps the connection's key log with the socket.
    pub fn with_secrets(
        mut self,
        secrets: std::sync::Arc<crate::tls::key_update::SecretLog>,
    ) -> Self {
        self.secrets = Some(secrets);
        self
    }

    /// Whether the tail is kept (a hand-over may take the session).
    pub fn is_on(&self) -> bool {
        self.on
    }

    pub fn secrets(&self) -> Option<std::sync::Arc<crate::tls::key_update::SecretLog>> {
        self.secrets.clone()
    }

    pub fn get_ref(&self) -> &IO {
        &self.io
    }

    pub fn get_mut(&mut self) -> &mut IO {
        &mut self.io
    }

    /// The bytes of the record read in part.
    pub fn partial(&self) -> &[u8] {
        &self.tail
    }

    /// The socket, and the bytes of the record read in part (for
    /// `TlsState::take`).
    pub fn into_parts(self) -> (IO, Vec<u8>) {
        (self.io, self.tail)
    }

    /// Accounts for bytes just read, keeping the start of a record they
    /// leave unfinished.
    fn account(&mut self, mut read: &[u8]) {
        while !self.tail.is_empty() && !read.is_empty() {
            let take = still_needed(&self.tail).min(read.len());
            self.tail.extend_from_slice(&read[..take]);
            read = &read[take..];
            if still_needed(&self.tail) == 0 {
                self.tail.clear();
            }
        }
        while !read.is_empty() {
            let whole = read.len() >= RECORD_HEADER && read.len() >= RECORD_HEADER + body_len(read);
            if !whole {
                self.tail.extend_from_slice(read);
                return;
            }
            read = &read[RECORD_HEADER + body_len(read)..];
        }
    }
}

fn body_len(header: &[u8]) -> usize {
    usize::from(u16::from_be_bytes([header[3], header[4]]))
}

/// Bytes still to come before `tail` is one whole record.
fn still_needed(tail: &[u8]) -> usize {
    if tail.len() < RECORD_HEADER {
        RECORD_HEADER - tail.len()
    } else {
        RECORD_HEADER + body_len(tail) - tail.len()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for RecordTail<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
        if this.on {
            this.account(&buf.filled()[before..]);
        }
        Poll::Ready(Ok(()))
    }
}

crate::write_through::write_through!([IO: AsyncWrite + Unpin] RecordTail<IO>, io);

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// However a run of records is cut into reads, the tail is the
        /// part of the last record after its last whole one.
        #[test]
        fn the_tail_is_the_unfinished_record(
            lens in proptest::collection::vec(0usize..300, 1..6),
            cuts in proptest::collection::vec(1usize..400, 1..20),
            drop_last in 0usize..300,
        ) {
            let mut wire = Vec::new();
            let mut last_start = 0;
            for (i, len) in lens.iter().enumerate() {
                last_start = wire.len();
                wire.extend_from_slice(&[23, 3, 3, (len >> 8) as u8, *len as u8]);
                wire.extend((0..*len).map(|b| (b + i) as u8));
            }
            let cut_at = wire.len() - drop_last.min(wire.len() - last_start);
            let wire = &wire[..cut_at];
            let mut tail = RecordTail::new(());
            let mut at = 0;
            for cut in cuts.iter().cycle() {
                if at == wire.len() { break; }
                let end = (at + cut).min(wire.len());
                tail.account(&wire[at..end]);
                at = end;
            }
            let expected = if cut_at == last_start + RECORD_HEADER + lens[lens.len() - 1] {
                &[][..]
            } else {
                &wire[last_start..]
            };
            prop_assert_eq!(tail.partial(), expected);
        }
    }
}
