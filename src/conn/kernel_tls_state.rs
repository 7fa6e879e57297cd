//! A kernel TLS session handed to a successor process (issue 29): its
//! state taken at a quiet point (`KernelTls::into_state`), and the same
//! stream rebuilt over the received socket (`KernelTls::resumed`). The
//! socket keeps the kernel's record layer (keys, sequence numbers, what
//! it has read); what moves as data is `KernelState` (see there).

use std::future::poll_fn;
use std::io;
use std::sync::Arc;

use tokio::io::{AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use super::kernel_tls::{key_limit_of, Carried, Goodbye, KernelTls, TlsPeer, UpdateCount};
use crate::tls::handover::state::MAX_PENDING_PLAINTEXT;
use crate::tls::handover::KernelState;
use crate::tls::key_update::{Suite, TrafficSecrets};

impl KernelTls {
    /// Who the client is, if a hand-over may come (see `TlsPeer`).
    pub fn peer(&self) -> Option<&TlsPeer> {
        self.peer.as_ref()
    }

    /// Sends the KeyUpdate nbdgw owes the client, if any (asked for by
    /// the client's, or at the key limit), so that no successor inherits
    /// a half-done update.
    pub async fn send_owed(&mut self) -> io::Result<()> {
        poll_fn(|cx| self.poll_update_tx(cx)).await?;
        self.tcp.flush().await
    }

    /// Why a successor could not go on exactly as this process would,
    /// if so: an update still owed, the session ending (an error's alert
    /// owed, the client's close_notify read), or too much unread
    /// plaintext. Asked before `into_state`, so that a refusal leaves
    /// the stream whole.
    pub fn refusal(&self) -> Option<&'static str> {
        if self.update_tx {
            Some("nbdgw's own KeyUpdate is still owed")
        } else if self.goodbye != Goodbye::CloseNotify || self.said_goodbye {
            Some("the session is ending")
        } else if self.read_closed {
            Some("the client closed")
        } else if self.early.bytes.len() - self.early.at > MAX_PENDING_PLAINTEXT {
            Some("too much plaintext is unread")
        } else {
            None
        }
    }

    /// The state at a quiet point, and the socket (see `refusal`).
    pub fn into_state(self) -> (TcpStream, KernelState) {
        let mut this = self;
        let [rx, tx] = std::mem::take(&mut this.updates.0);
        let (client, server) = this.secrets.secrets();
        let state = KernelState {
            suite: this.secrets.suite().iana(),
            client: client.clone(),
            server: server.clone(),
            tx_records: this.tx_records,
            updates: [rx, tx],
            updates_without_data: this.updates_without_data,
            warning_alerts: this.warning_alerts,
            read_closed: this.read_closed,
            plaintext: std::mem::take(&mut this.early).into_rest(),
        };
        (this.tcp, state)
    }

    /// The stream over a socket handed over with its kernel TLS state:
    /// the ULP and both keys are already on it, so nothing is set here;
    /// `configured` is this process's `--ktls-key-limit`.
    pub fn resumed(
        tcp: TcpStream,
        state: KernelState,
        peer: TlsPeer,
        configured: Option<u64>,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> io::Result<Self> {
        let cipher = rustls::CipherSuite::from(state.suite);
        let suite = Suite::of(cipher)
            .ok_or_else(|| io::Error::other("not a TLS 1.3 suite kernel TLS takes"))?;
        let KernelState {
            client,
            server,
            tx_records,
            updates,
            updates_without_data,
            warning_alerts,
            read_closed,
            plaintext,
            ..
        } = state;
        let key_limit = key_limit_of(Some(cipher), configured);
        Ok(KernelTls {
            tcp,
            early: Carried::new(plaintext),
            read_closed,
            said_goodbye: false,
            secrets: TrafficSecrets::from_secrets(suite, client, server),
            tx_records,
            key_limit,
            // At the limit already (a lower limit here): update first.
            update_tx: tx_records >= key_limit,
            updates: UpdateCount(updates),
            updates_without_data,
            warning_alerts,
            goodbye: Goodbye::CloseNotify,
            metrics,
            peer: Some(peer),
            fresh: true,
        })
    }

    /// The first read of a socket handed over, straight to the socket.
    /// The old process's last read may have stopped right before a
    /// KeyUpdate the kernel had already taken in (behind the data that
    /// read returned). In the test VM (Linux 7.3) such a session then
    /// waited for ever in the successor, in 3 of 6 runs, with neither
    /// process having followed the KeyUpdate, even once the client sent
    /// more: the socket was never reported readable, and tokio waits for
    /// readiness before a new registration's first read. (Inferred from
    /// that, not read in the kernel's source.) One read without waiting
    /// meets the record (EIO: the caller follows it): 6 of 6 runs then
    /// passed. After it, reads go through tokio as after a handshake.
    pub(super) fn first_read(&mut self, buf: &mut ReadBuf<'_>) -> io::Result<()> {
        self.fresh = false;
        let fd = std::os::fd::AsRawFd::as_raw_fd(&self.tcp);
        match nix::unistd::read(fd, buf.initialize_unfilled()) {
            Ok(n) => {
                buf.advance(n);
                Ok(())
            }
            Err(nix::errno::Errno::EAGAIN) => Err(io::ErrorKind::WouldBlock.into()),
            Err(e) => Err(io::Error::from(e)),
        }
    }
}
