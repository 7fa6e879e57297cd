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
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::record::{Opened, RecordError, RecordLayer};
use super::state::{StateError, TlsState};

/// Plaintext taken per write: as rustls's default buffer limit.
const MAX_WRITE: usize = 64 * 1024;
/// Socket reads: a few records at a time.
const READ_CHUNK: usize = 64 * 1024;

pub struct ResumedTls<IO> {
    io: IO,
    layer: RecordLayer,
    /// Decrypted and not yet read; `plain_at` is how far it was read.
    plain: Vec<u8>,
    plain_at: usize,
    /// Ciphertext read and not yet opened.
    cipher_in: Vec<u8>,
    /// Sealed and not yet sent; `out_at` is how far it was sent.
    out: Vec<u8>,
    out_at: usize,
    read_closed: bool,
    /// The error that ended the session, reported again to each call.
    failed: Option<(io::ErrorKind, String)>,
    /// The suite's IANA number, to hand the session on again.
    suite: u16,
}

impl<IO> ResumedTls<IO> {
    /// The session of `state` over `io` (the same socket, passed on).
    /// `key_limit` as for kernel TLS: `--ktls-key-limit` if given.
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
            plain: plaintext,
            plain_at: 0,
            cipher_in: partial,
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
            plaintext: self.plain[self.plain_at..].to_vec(),
            read_closed: false,
            partial: Vec::new(),
        };
        Ok((self.io, state, self.cipher_in))
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

    /// Opens the records buffered, until one gives plaintext or the end.
    fn open_buffered(&mut self) -> Result<bool, RecordError> {
        let mut at = 0;
        let mut got = false;
        while !got && !self.read_closed {
            let Some(len) = RecordLayer::whole_record(&self.cipher_in[at..])? else {
                break;
            };
            let record = &mut self.cipher_in[at..at + len];
            match self.layer.open(record)? {
                Opened::Data(range) if !range.is_empty() => {
                    self.plain.clear();
                    self.plain.extend_from_slice(&record[range]);
                    self.plain_at = 0;
                    got = true;
                }
                Opened::Data(_) | Opened::Control => {}
                Opened::Closed => self.read_closed = true,
            }
            at += len;
        }
        self.cipher_in.drain(..at);
        Ok(got)
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
            if this.plain_at < this.plain.len() {
                let n = buf.remaining().min(this.plain.len() - this.plain_at);
                buf.put_slice(&this.plain[this.plain_at..this.plain_at + n]);
                this.plain_at += n;
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
    /// Reads more ciphertext; the end of the socket before close_notify
    /// is an error (a truncation attack looks the same).
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let have = self.cipher_in.len();
        self.cipher_in.resize(have + READ_CHUNK, 0);
        let mut rb = ReadBuf::new(&mut self.cipher_in[have..]);
        let polled = Pin::new(&mut self.io).poll_read(cx, &mut rb);
        let n = rb.filled().len();
        self.cipher_in.truncate(have + n);
        ready!(polled)?;
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
