//! A read buffer in front of a socket, as tokio's `BufReader`, with two
//! differences measured in the handshake's profile:
//!
//! - it is never zeroed: reads go into the vector's spare capacity.
//!   `BufReader` zeroes its whole buffer when it is made, which for a
//!   256 KiB buffer is an `madvise` (with the TLB shootdown it brings in
//!   a threaded process) and page faults, on every connection, before a
//!   byte has arrived;
//! - it starts small and grows, doubling each time a read fills it, up
//!   to its maximum: a handshake, an idle connection or QD1 traffic never
//!   takes the bulk size, and a stream of large requests reaches it
//!   within a few reads. A peer that sends little (a handshake) costs
//!   the small size; one that sends a flood grows it to the maximum, as
//!   before.
//!
//! Writes pass through to the socket, vectored ones included.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::BufMut;
use tokio::io::{AsyncBufRead, AsyncRead, AsyncWrite, ReadBuf};

/// Where every connection's buffers start.
pub const INITIAL: usize = 16 * 1024;

pub struct Buffered<R> {
    inner: R,
    buf: Vec<u8>,
    pos: usize,
    /// How much one read may bring now.
    size: usize,
    max: usize,
}

impl<R> Buffered<R> {
    /// Starts at `INITIAL` (or `max`, if smaller) and grows to `max`.
    pub fn new(max: usize, inner: R) -> Self {
        Buffered {
            inner,
            buf: Vec::new(),
            pos: 0,
            size: INITIAL.min(max).max(1),
            max: max.max(1),
        }
    }

    /// What was read from the socket and not yet taken.
    pub fn buffer(&self) -> &[u8] {
        &self.buf[self.pos..]
    }

    /// The socket; bytes still buffered are dropped (see `buffer`).
    pub fn into_inner(self) -> R {
        self.inner
    }

    #[cfg(test)]
    fn read_size(&self) -> usize {
        self.size
    }
}

impl<R: AsyncRead + Unpin> AsyncBufRead for Buffered<R> {
    fn poll_fill_buf(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<&[u8]>> {
        let this = self.get_mut();
        if this.pos == this.buf.len() {
            this.buf.clear();
            this.pos = 0;
            this.buf.reserve(this.size);
            let mut room = (&mut this.buf).limit(this.size);
            let n = ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut this.inner),
                cx,
                &mut room
            ))?;
            // A read that filled it: more is coming than it holds.
            if n == this.size {
                this.size = (this.size * 2).min(this.max);
            }
        }
        Poll::Ready(Ok(&this.buf[this.pos..]))
    }

    fn consume(self: Pin<&mut Self>, amt: usize) {
        let this = self.get_mut();
        this.pos = (this.pos + amt).min(this.buf.len());
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Buffered<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        // Nothing buffered and a reader that takes as much as one read
        // would bring: straight into its buffer, without a copy.
        if self.pos == self.buf.len() && out.remaining() >= self.size {
            let this = self.get_mut();
            this.buf.clear();
            this.pos = 0;
            return Pin::new(&mut this.inner).poll_read(cx, out);
        }
        let available = ready!(self.as_mut().poll_fill_buf(cx))?;
        let n = available.len().min(out.remaining());
        out.put_slice(&available[..n]);
        self.consume(n);
        Poll::Ready(Ok(()))
    }
}

impl<R: AsyncWrite + Unpin> AsyncWrite for Buffered<R> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn reads_everything_in_order_and_grows_only_when_a_read_fills_it() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        tx.write_all(&data).await.unwrap();
        drop(tx);
        let mut r = Buffered::new(64 * 1024, rx);
        assert_eq!(r.read_size(), INITIAL);
        // Small reads, as rustls makes them: through the buffer.
        let mut got = vec![0u8; 100];
        r.read_exact(&mut got).await.unwrap();
        assert_eq!(got, data[..100]);
        assert_eq!(r.buffer(), &data[100..INITIAL], "one read filled it");
        let mut rest = data[..100].to_vec();
        let mut chunk = vec![0u8; 4096];
        loop {
            match r.read(&mut chunk).await.unwrap() {
                0 => break,
                n => rest.extend_from_slice(&chunk[..n]),
            }
        }
        assert_eq!(rest, data);
        assert_eq!(r.read_size(), 64 * 1024, "grown to its maximum, no further");
    }

    #[tokio::test]
    async fn a_trickle_keeps_it_small_and_fill_buf_sees_what_came() {
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        let mut r = Buffered::new(256 * 1024, rx);
        for round in 0..5u8 {
            tx.write_all(&[round; 300]).await.unwrap();
            let seen = r.fill_buf().await.unwrap().to_vec();
            assert_eq!(seen, vec![round; 300]);
            r.consume(300);
        }
        assert_eq!(r.read_size(), INITIAL);
        drop(tx);
        assert!(r.fill_buf().await.unwrap().is_empty(), "the end");
    }

    #[tokio::test]
    async fn writes_pass_through() {
        let (a, mut b) = tokio::io::duplex(1024);
        let mut r = Buffered::new(1024, a);
        r.write_all(b"abc").await.unwrap();
        let mut got = [0u8; 3];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"abc");
    }
}
