//! A stream whose first bytes were already read by someone else: they
//! are served before anything more is read from it. A session handed
//! over carries such bytes (a request header read in part, plaintext
//! rustls had decrypted, ciphertext read ahead of the TLS layer), and a
//! session whose hand-over was withdrawn gets them back the same way.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

pub struct Prefixed<IO> {
    io: IO,
    prefix: Vec<u8>,
    at: usize,
}

impl<IO> Prefixed<IO> {
    pub fn new(io: IO, prefix: Vec<u8>) -> Self {
        Prefixed { io, prefix, at: 0 }
    }

    /// The stream, and the prefix bytes not yet read.
    pub fn into_parts(mut self) -> (IO, Vec<u8>) {
        self.prefix.drain(..self.at);
        (self.io, self.prefix)
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Prefixed<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.at < this.prefix.len() {
            let n = buf.remaining().min(this.prefix.len() - this.at);
            buf.put_slice(&this.prefix[this.at..this.at + n]);
            this.at += n;
            if this.at == this.prefix.len() {
                // Served: free it, so an idle session keeps nothing.
                this.prefix = Vec::new();
                this.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

crate::write_through::write_through!([IO: AsyncWrite + Unpin] Prefixed<IO>, io);

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn the_prefix_comes_first_then_the_stream() {
        let mut p = Prefixed::new(&b"world"[..], b"hello ".to_vec());
        let mut all = String::new();
        p.read_to_string(&mut all).await.unwrap();
        assert_eq!(all, "hello world");
    }
}
