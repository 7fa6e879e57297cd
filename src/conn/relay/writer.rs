//! The only writer to the client in transmission: replies are gathered
//! into one plaintext buffer and handed to rustls in pieces of
//! `REPLY_CHUNK` bytes, each flushed before the next, so every TLS record
//! is full except the last of a burst. The cork policy lives here too: a
//! burst larger than one write holds TCP_CORK and is uncorked only when
//! nothing more is waiting; a burst that fits one write needs no cork,
//! since with TCP_NODELAY its segments are full but the last.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::config::Cork;
use crate::conn::error::{ConnError, Side};
use crate::conn::session::{within_stall, Limits, Stats, GOODBYE_TIMEOUT, REPLY_CHUNK};

/// Bursts up to this size go out in one write without TCP_CORK.
const UNCORKED_BURST_MAX: usize = 64 * 1024;

pub struct ReplyWriter<'a, W> {
    client: W,
    out: Vec<u8>,
    /// A second handle on the client socket, for TCP_CORK (not used with
    /// `Cork::Off`) and for the drain's linger.
    socket: Option<socket2::Socket>,
    corked: bool,
    policy: Cork,
    stall_timeout: Option<Duration>,
    stats: &'a Stats,
}

impl<'a, W: AsyncWrite + Unpin> ReplyWriter<'a, W> {
    pub fn new(
        client: W,
        socket: Option<socket2::Socket>,
        limits: &Limits,
        stats: &'a Stats,
    ) -> Self {
        ReplyWriter {
            client,
            out: Vec::with_capacity(REPLY_CHUNK),
            socket,
            corked: false,
            policy: limits.cork,
            stall_timeout: limits.stall_timeout,
            stats,
        }
    }

    /// Appends bytes, sending full chunks as they fill.
    pub async fn append(&mut self, mut bytes: &[u8]) -> Result<(), ConnError> {
        while !bytes.is_empty() {
            self.make_room().await?;
            let n = self.room().min(bytes.len());
            self.out.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
        }
        Ok(())
    }

    /// Appends `len` bytes read from `reader` straight into the spare
    /// capacity of the buffer: no zeroing, no intermediate copy.
    pub async fn append_from<R: AsyncRead + Unpin>(
        &mut self,
        reader: &mut R,
        len: u64,
    ) -> Result<(), ConnError> {
        let mut remaining = len;
        while remaining > 0 {
            self.make_room().await?;
            let want = remaining.min(self.room() as u64);
            let n = reader
                .take(want)
                .read_buf(&mut self.out)
                .await
                .map_err(ConnError::io(
                    Side::Upstream,
                    "in the middle of a reply payload",
                ))?;
            if n == 0 {
                return Err(ConnError::closed(
                    Side::Upstream,
                    "in the middle of a reply payload",
                ));
            }
            remaining -= n as u64;
        }
        Ok(())
    }

    /// A whole reply has been appended.
    pub async fn end_of_reply(&mut self) -> Result<(), ConnError> {
        self.stats.reply();
        if self.policy == Cork::PerReply {
            self.end_burst().await?;
        }
        Ok(())
    }

    /// Nothing more is waiting: send what is held and let TCP go.
    pub async fn end_burst(&mut self) -> Result<(), ConnError> {
        self.send().await?;
        self.uncork();
        Ok(())
    }

    /// Every reply has been written: close_notify tells the client so.
    /// Hands back the socket handle, for the linger.
    pub async fn close(mut self) -> Result<Option<socket2::Socket>, ConnError> {
        self.end_burst().await?;
        let _ = tokio::time::timeout(GOODBYE_TIMEOUT, self.client.shutdown()).await;
        Ok(self.socket.take())
    }

    /// Quiet for a hand-over: every reply was written and flushed
    /// (`Flight::wait_quiet`); the client's write half and the socket
    /// handle back, corked no more.
    pub fn into_parts(mut self) -> (W, Option<socket2::Socket>) {
        debug_assert!(self.out.is_empty(), "quiet with replies unsent");
        self.uncork();
        (self.client, self.socket.take())
    }

    /// The relay failed: release the cork, and end TLS properly where it
    /// still can.
    pub async fn abandon(mut self) {
        self.uncork();
        let _ = tokio::time::timeout(GOODBYE_TIMEOUT, self.client.shutdown()).await;
    }

    fn room(&self) -> usize {
        REPLY_CHUNK - self.out.len()
    }

    /// The buffer is full and more of the burst follows: cork first, so
    /// the partial segment at its end waits for the rest.
    async fn make_room(&mut self) -> Result<(), ConnError> {
        if self.room() == 0 {
            self.set_cork(true);
            self.send().await?;
        }
        Ok(())
    }

    /// Hands the buffer to rustls and flushes it to the socket. A burst
    /// small enough to leave in one write goes out as whole segments with
    /// TCP_NODELAY alone, saving the two cork syscalls per reply that QD1
    /// traffic would otherwise pay.
    async fn send(&mut self) -> Result<(), ConnError> {
        if self.out.is_empty() {
            return Ok(());
        }
        if self.policy == Cork::PerReply || self.out.len() > UNCORKED_BURST_MAX {
            self.set_cork(true);
        }
        let (client, out) = (&mut self.client, &self.out);
        within_stall(self.stall_timeout, "reading replies", async {
            let write = ConnError::io(Side::Client, "while replies were sent");
            client.write_all(out).await.map_err(write)?;
            let flush = ConnError::io(Side::Client, "while replies were sent");
            client.flush().await.map_err(flush)
        })
        .await?;
        self.stats.sent(self.out.len() as u64);
        self.out.clear();
        Ok(())
    }

    fn uncork(&mut self) {
        self.set_cork(false);
    }

    fn set_cork(&mut self, on: bool) {
        if self.policy == Cork::Off {
            return;
        }
        if let (true, Some(socket)) = (self.corked != on, &self.socket) {
            let _ = socket.set_tcp_cork(on);
            self.corked = on;
        }
    }
}
