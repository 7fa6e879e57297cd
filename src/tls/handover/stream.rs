//! `ResumedTls`: a session rebuilt from a `TlsState`, as a tokio stream
//! (AsyncRead + AsyncWrite + Unpin + Send, what the relay's halves take
//! through `tokio::io::split`, as with tokio-rustls's stream).
//!
//! Reads serve the plaintext carried over first, then records: the
//! partial record carried over is completed from the socket. Writes are
//! sealed at once (one record per 16 KiB of a write) and sent before the
//! next write is taken; `poll_shutdown` sends close_notify. A peer's
//! protocol error gets a fatal alert (best effort) and ends the stream.

use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::BufMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::record::{Opened, RecordError, RecordLayer};
use super::state::{StateError, TlsState};

/// Plaintext taken per write: as rustls's default buffer limit.
const MAX_WRITE: usize = 64 * 1024;
/// Socket reads: a few records at a time.
const READ_CHUNK: usize = 64 * 1024;

/// Records are opened in place in the buffer they were read into, and
/// their plaintext is read from there: no buffer is zeroed before a read
/// fills it (reads go into spare capacity, as `conn::buffered` does), no
/// record is moved after it is opened, and only the start of a record
/// left at the end of a read is moved, once, before the next read.
pub struct ResumedTls<IO> {
    io: IO,
    layer: RecordLayer,
    /// The plaintext carried over in the state, served first;
    /// `carried_at` is how far it was read.
    carried: Vec<u8>,
    carried_at: usize,
    /// Ciphertext read; what is before `cipher_at` was opened in place.
    cipher_in: Vec<u8>,
    cipher_at: usize,
    /// Plaintext of the last record opened, not yet read: a range of
    /// `cipher_in` before `cipher_at`.
    plain: Range<usize>,
    /// Sealed and not yet sent; `out_at` is how far it was sent.
    out: Vec<u8>,
    out_at: usize,
    read_closed: bool,
    /// The error that ended the session, reported again to each call.
    failed: Option<(io::ErrorKind, String)>,
    /// The suite's IANA number, to hand the session on again.
    suite: u16,
}

/// The plaintext not yet read: what the state carried, then the rest of
/// the last record opened (one of the two is empty in practice).
fn unread_plaintext(carried: &[u8], opened: &[u8]) -> Vec<u8> {
    let mut plain = Vec::with_capacity(carried.len() + opened.len());
    plain.extend_from_slice(carried);
    plain.extend_from_slice(opened);
    plain
}

impl<IO> ResumedTls<IO> {
    /// The session of `state` over `io` (the same socket, passed on).
    /// `key_limit`: `--ktls-key-limit` if given (see `RecordLayer::new`).
    pub fn new(io: IO, state: TlsState, key_limit: Option<u64>) -> Result<Self, StateError> {
        let layer = RecordLayer::new(&state, key_limit)?;
        let suite = state.suite;
        let TlsState {
            plaintext,
            read_closed,
            partial,
            ..
        } = state;
        Ok(ResumedTls {
            io,
            layer,
            carried: plaintext,
            carried_at: 0,
            cipher_in: partial,
            cipher_at: 0,
            plain: 0..0,
            out: Vec::new(),
            out_at: 0,
            read_closed,
            failed: None,
            suite,
        })
    }

    /// Seals a KeyUpdate owed the peer now, to be sent with the next
    /// flush (before a hand-over).
    pub fn seal_owed(&mut self) -> io::Result<()> {
        if self.failed.is_none() {
            if let Err(e) = self.layer.seal_owed(&mut self.out) {
                return Err(self.fail(e));
            }
        }
        Ok(())
    }

    /// The session at a quiet point, to hand on to another process: the
    /// socket, the state (unread plaintext in it) and the ciphertext read
    /// and not yet opened (whole records and a partial one, which go
    /// before whatever the socket holds). Refused, with the stream given
    /// back, while anything is unsent, a KeyUpdate is owed, or the
    /// session failed or closed.
    // The stream is given back whole by value, once per hand-over.
    #[allow(clippy::result_large_err)]
    pub fn into_state(self) -> Result<(IO, TlsState, Vec<u8>), (Self, &'static str)> {
        if self.failed.is_some() || self.read_closed {
            return Err((self, "the TLS session has failed or closed"));
        }
        if self.out_at < self.out.len() {
            return Err((self, "TLS records are still to be sent"));
        }
        let Some((side, tx, rx)) = self.layer.again() else {
            return Err((self, "a KeyUpdate is owed, or the write side is closed"));
        };
        let state = TlsState {
            side,
            suite: self.suite,
            tx,
            rx,
            plaintext: unread_plaintext(
                &self.carried[self.carried_at..],
                &self.cipher_in[self.plain.clone()],
            ),
            read_closed: false,
            partial: Vec::new(),
        };
        let unopened = self.cipher_in[self.cipher_at..].to_vec();
        Ok((self.io, state, unopened))
    }

    pub fn get_ref(&self) -> &IO {
        &self.io
    }

    pub fn layer(&self) -> &RecordLayer {
        &self.layer
    }

    /// TLS 1.3: update this side's keys before the next record.
    pub fn request_key_update(&mut self) {
        self.layer.request_key_update();
    }

    fn fail(&mut self, e: RecordError) -> io::Error {
        if let Some(alert) = e.alert() {
            // Best effort: sent with whatever is next written or flushed.
            let _ = self.layer.seal_fatal(alert, &mut self.out);
        }
        let kind = match e {
            RecordError::PeerAlert { .. } => io::ErrorKind::ConnectionAborted,
            RecordError::KeyLimit | RecordError::WriteClosed => io::ErrorKind::BrokenPipe,
            _ => io::ErrorKind::InvalidData,
        };
        self.failed = Some((kind, e.to_string()));
        io::Error::new(kind, e.to_string())
    }

    fn failed(&self) -> Option<io::Error> {
        self.failed
            .as_ref()
            .map(|(kind, why)| io::Error::new(*kind, why.clone()))
    }

    /// Opens the records buffered, in place, until one gives plaintext
    /// (then in `plain`) or the end.
    fn open_buffered(&mut self) -> Result<bool, RecordError> {
        while !self.read_closed {
            let at = self.cipher_at;
            let Some(len) = RecordLayer::whole_record(&self.cipher_in[at..])? else {
                break;
            };
            self.cipher_at = at + len;
            match self.layer.open(&mut self.cipher_in[at..at + len])? {
                Opened::Data(range) if !range.is_empty() => {
                    self.plain = at + range.start..at + range.end;
                    return Ok(true);
                }
                Opened::Data(_) | Opened::Control => {}
                Opened::Closed => self.read_closed = true,
            }
        }
        Ok(false)
    }

    /// Gives `buf` what is decrypted and unread, if anything.
    fn serve(&mut self, buf: &mut ReadBuf<'_>) -> bool {
        if self.carried_at < self.carried.len() {
            let n = buf.remaining().min(self.carried.len() - self.carried_at);
            buf.put_slice(&self.carried[self.carried_at..self.carried_at + n]);
            self.carried_at += n;
            if self.carried_at == self.carried.len() {
                self.carried = Vec::new();
                self.carried_at = 0;
            }
            return true;
        }
        if self.plain.is_empty() {
            return false;
        }
        let n = buf.remaining().min(self.plain.len());
        buf.put_slice(&self.cipher_in[self.plain.start..self.plain.start + n]);
        self.plain.start += n;
        true
    }
}

impl<IO: AsyncWrite + Unpin> ResumedTls<IO> {
    /// Sends what is sealed.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.out_at < self.out.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.out[self.out_at..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.out_at += n;
        }
        self.out.clear();
        self.out_at = 0;
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncRead for ResumedTls<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.serve(buf) {
                return Poll::Ready(Ok(()));
            }
            if let Some(e) = this.failed() {
                return Poll::Ready(Err(e));
            }
            match this.open_buffered() {
                Ok(true) => continue,
                Ok(false) if this.read_closed => return Poll::Ready(Ok(())),
                Ok(false) => {}
                Err(e) => {
                    let e = this.fail(e);
                    let _ = this.poll_send(cx);
                    return Poll::Ready(Err(e));
                }
            }
            ready!(this.poll_fill(cx))?;
        }
    }
}

impl<IO: AsyncRead + Unpin> ResumedTls<IO> {
    /// Reads more ciphertext into the buffer's spare capacity, never
    /// zeroed; the end of the socket before close_notify is an error (a
    /// truncation attack looks the same). Called only with every opened
    /// record read: what is before `cipher_at` is dropped first, and the
    /// start of a record after it moved to the front (at most one
    /// record; usually nothing).
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        debug_assert!(self.plain.is_empty());
        if self.cipher_at > 0 {
            self.cipher_in.copy_within(self.cipher_at.., 0);
            self.cipher_in
                .truncate(self.cipher_in.len() - self.cipher_at);
            self.cipher_at = 0;
            self.plain = 0..0;
        }
        self.cipher_in.reserve(READ_CHUNK);
        let mut room = (&mut self.cipher_in).limit(READ_CHUNK);
        let n = ready!(tokio_util::io::poll_read_buf(
            Pin::new(&mut self.io),
            cx,
            &mut room
        ))?;
        if n == 0 {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed the connection without close_notify",
            )));
        }
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for ResumedTls<IO> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_send(cx))?;
        if let Some(e) = this.failed() {
            return Poll::Ready(Err(e));
        }
        let take = b.len().min(MAX_WRITE);
        match this.layer.seal_data(&b[..take], &mut this.out) {
            Ok(n) => {
                // Started now; what the socket does not take yet goes with
                // the next write or flush.
                let _ = this.poll_send(cx);
                Poll::Ready(Ok(n))
            }
            Err(e) => {
                let e = this.fail(e);
                // A worn TLS 1.2 key: close_notify is sealed, send it.
                let _ = this.poll_send(cx);
                Poll::Ready(Err(e))
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.failed.is_none() {
            if let Err(e) = this.layer.seal_close_notify(&mut this.out) {
                return Poll::Ready(Err(this.fail(e)));
            }
        }
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {

    use tokio::io::AsyncReadExt;

    use super::*;
    use crate::tls::handover::state::{DirectionState, KeyBytes, Side};

    /// A socket in memory: gives `wire` in reads of at most `chunk`
    /// bytes, Pending before every other one, and keeps how much of the
    /// buffer each read was offered already initialized (written).
    struct Socket {
        wire: Vec<u8>,
        at: usize,
        chunk: usize,
        pending: bool,
        offered_initialized: Vec<usize>,
    }

    impl AsyncRead for Socket {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let this = &mut *self;
            this.offered_initialized.push(buf.initialized().len());
            this.pending = !this.pending;
            if this.pending {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            let n = this
                .chunk
                .min(buf.remaining())
                .min(this.wire.len() - this.at);
            buf.put_slice(&this.wire[this.at..this.at + n]);
            this.at += n;
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncWrite for Socket {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            b: &[u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Ready(Ok(b.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    fn tls12_state(side: Side, ours: u8, theirs: u8) -> TlsState {
        let direction = |seed: u8| DirectionState {
            key: KeyBytes(vec![seed; 16]),
            iv: [seed; 12],
            seq: 7,
            secret: None,
        };
        TlsState {
            side,
            suite: 0xc02b,
            tx: direction(ours),
            rx: direction(theirs),
            plaintext: b"carried".to_vec(),
            read_closed: false,
            partial: Vec::new(),
        }
    }

    /// Review round 2, M1: a read is never offered a buffer that was
    /// zeroed (or otherwise written) for it, Pending reads included, and
    /// records cut across reads anywhere come out whole and in order.
    #[tokio::test]
    async fn reads_go_into_unwritten_capacity_and_records_come_out_in_order() {
        let mut peer = RecordLayer::new(&tls12_state(Side::Client, 2, 1), None).unwrap();
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut wire = Vec::new();
        for piece in data.chunks(50_000) {
            let mut done = 0;
            while done < piece.len() {
                done += peer.seal_data(&piece[done..], &mut wire).unwrap();
            }
        }
        peer.seal_close_notify(&mut wire).unwrap();
        for chunk in [7_000, 16_400, 70_000] {
            let socket = Socket {
                wire: wire.clone(),
                at: 0,
                chunk,
                pending: false,
                offered_initialized: Vec::new(),
            };
            let state = tls12_state(Side::Server, 1, 2);
            let mut resumed = ResumedTls::new(socket, state, None).unwrap();
            let mut got = Vec::new();
            resumed.read_to_end(&mut got).await.unwrap();
            assert_eq!(&got[..7], b"carried");
            assert!(got[7..] == data[..], "chunk {chunk}");
            let offered = &resumed.get_ref().offered_initialized;
            assert!(offered.len() > 4, "{offered:?}");
            assert!(
                offered.iter().all(|&n| n == 0),
                "chunk {chunk}: {offered:?}"
            );
        }
    }
}
