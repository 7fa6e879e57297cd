//! The two sides of a client-mode session as a hand-over sees them: the
//! local socket (Unix or loopback TCP, plaintext: only its descriptor
//! moves), and the remote one under client-side TLS, whose state is
//! taken out of rustls (a session whose handshake was made here, read
//! through `RecordTail` with its own key log) or out of `ResumedTls` (one
//! handed over to this process before). Everything that can refuse is
//! checked before anything is consumed, so that a refusal gives the
//! stream back whole and the session goes on here; only rustls's own key
//! extraction can fail after that, and the session is then closed.

use std::future::Future;
use std::io::{self, Write};
use std::os::fd::OwnedFd;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::client::remote::RemoteTls;
use crate::conn::prefixed::Prefixed;
use crate::tls::handover::state::partial_is_one_record;
use crate::tls::handover::{take_client_bounded, ResumedTls, TlsState};

/// A remote connection handed to this process, served on: the socket
/// after the ciphertext that was read ahead of the old process's TLS.
pub type ResumedRemote = ResumedTls<Prefixed<TcpStream>>;

/// The local client's socket.
pub trait Local: AsyncRead + AsyncWrite + Unpin + Send + Sized + 'static {
    /// The descriptor, to pass on.
    fn into_fd(self) -> io::Result<OwnedFd>;
}

impl Local for tokio::net::UnixStream {
    fn into_fd(self) -> io::Result<OwnedFd> {
        Ok(self.into_std()?.into())
    }
}

impl Local for TcpStream {
    fn into_fd(self) -> io::Result<OwnedFd> {
        Ok(self.into_std()?.into())
    }
}

/// What a take gives: the remote socket, its TLS state, and ciphertext
/// read from it that the TLS layer has not processed.
pub struct Taken {
    pub tcp: TcpStream,
    pub state: TlsState,
    pub ahead: Vec<u8>,
}

pub enum TakeError<S> {
    /// Nothing consumed: the stream, and why.
    Back(S, String),
    /// The stream was consumed: the session is closed.
    Lost(String),
}

/// The remote connection a session can be handed over from.
pub trait RemoteSide: AsyncRead + AsyncWrite + Unpin + Send + Sized + 'static {
    /// Sends every record the TLS layer owes the server (a KeyUpdate it
    /// was asked for included).
    fn send_owed(&mut self) -> impl Future<Output = io::Result<()>> + Send;
    /// Blocking: the TLS state, a TLS 1.3 session's keys followed through
    /// up to `generations` key updates.
    fn take(self, generations: usize) -> Result<Taken, TakeError<Self>>;
}

impl RemoteSide for RemoteTls {
    async fn send_owed(&mut self) -> io::Result<()> {
        crate::tls::handover::send_owed_client(self).await
    }

    fn take(mut self, generations: usize) -> Result<Taken, TakeError<Self>> {
        if let Err(why) = can_take(&mut self) {
            return Err(TakeError::Back(self, why.to_string()));
        }
        let secrets = self.get_ref().0.secrets();
        match take_client_bounded(self, (secrets.as_deref(), generations)) {
            Ok((tcp, state)) => Ok(Taken {
                tcp,
                state,
                ahead: Vec::new(),
            }),
            Err(e) => Err(TakeError::Lost(e.to_string())),
        }
    }
}

/// Every refusal that can be told without consuming the connection.
fn can_take(tls: &mut RemoteTls) -> Result<(), &'static str> {
    let (tail, conn) = tls.get_mut();
    if !tail.is_on() {
        return Err("the record tail is not kept");
    }
    if conn.is_handshaking() {
        return Err("the TLS handshake is not complete");
    }
    // A KeyUpdate owed is queued by a write of nothing; `send_owed` sent it.
    let _ = conn.writer().write(&[]);
    if conn.wants_write() {
        return Err("rustls still holds records to send");
    }
    let tls13 = conn.protocol_version() == Some(rustls::ProtocolVersion::TLSv1_3);
    if tls13 && tail.secrets().is_none() {
        return Err("no key log: the TLS 1.3 secrets are unknown");
    }
    if !partial_is_one_record(tail.partial()) {
        return Err("rustls holds a record in part");
    }
    Ok(())
}

impl RemoteSide for ResumedRemote {
    async fn send_owed(&mut self) -> io::Result<()> {
        self.seal_owed()?;
        self.flush().await
    }

    /// Its secrets are current already: nothing to walk.
    fn take(self, _generations: usize) -> Result<Taken, TakeError<Self>> {
        match self.into_state() {
            Err((stream, why)) => Err(TakeError::Back(stream, why.to_string())),
            Ok((prefixed, state, mut ahead)) => {
                let (tcp, rest) = prefixed.into_parts();
                ahead.extend_from_slice(&rest);
                Ok(Taken { tcp, state, ahead })
            }
        }
    }
}
