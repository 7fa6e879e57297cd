//! Taking a quiet session's TLS state out of the stream that carries it:
//! rustls (a session that started here) or `ResumedTls` (one handed over
//! to this process before). Everything that can refuse is checked before
//! anything is consumed, so that a refusal gives the stream back whole
//! and the session goes on here (review M3); only rustls's own key
//! extraction can fail after that, and then the session is lost (closed).

use std::future::Future;
use std::io::{self, Read, Write};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::either::Either;

use crate::conn::prefixed::Prefixed;
use crate::conn::session::ClientTls;
use crate::tls::handover::state::{
    partial_is_one_record, suite_params, Side, TlsState, Version, MAX_PENDING_PLAINTEXT,
};
use crate::tls::handover::ResumedTls;

/// A session handed to this process, served on.
pub type Resumable = ResumedTls<Prefixed<TcpStream>>;

/// What a take gives: the client socket, the state, and ciphertext read
/// from the socket that the TLS layer has not processed (it goes before
/// whatever the socket still holds).
pub struct Taken {
    pub tcp: TcpStream,
    pub state: TlsState,
    pub ahead: Vec<u8>,
}

pub enum TakeError<S> {
    /// Nothing consumed: the stream, the plaintext read out of it (it
    /// goes before anything else read from it), and why.
    Back(S, Vec<u8>, String),
    /// The stream was consumed: the session is closed.
    Lost(String),
}

/// A client stream a session can be handed over from.
pub trait Handable: AsyncRead + AsyncWrite + Unpin + Send + Sized + 'static {
    /// Sends every record the TLS layer owes the peer (a KeyUpdate it
    /// was asked for included).
    fn send_owed(&mut self) -> impl Future<Output = io::Result<()>> + Send;
    /// Blocking: a TLS 1.3 session's keys are followed through up to
    /// `generations` key updates.
    fn take(self, generations: usize) -> Result<Taken, TakeError<Self>>;
}

impl Handable for ClientTls {
    async fn send_owed(&mut self) -> io::Result<()> {
        crate::tls::handover::send_owed_server(self).await
    }

    fn take(mut self, generations: usize) -> Result<Taken, TakeError<Self>> {
        if let Err(why) = can_take(&mut self) {
            return Err(TakeError::Back(self, Vec::new(), why.to_string()));
        }
        let (plaintext, closed) = match unread_plaintext(self.get_mut().1) {
            Ok(read) => read,
            Err(e) => return Err(TakeError::Back(self, Vec::new(), e.to_string())),
        };
        if closed || plaintext.len() > MAX_PENDING_PLAINTEXT {
            let why = "the client closed, or too much plaintext is unread".to_string();
            return Err(TakeError::Back(self, plaintext, why));
        }
        consume(self, plaintext, generations).map_err(TakeError::Lost)
    }
}

/// Every refusal that can be told without consuming anything.
fn can_take(tls: &mut ClientTls) -> Result<(), &'static str> {
    let (io, conn) = tls.get_mut();
    let Either::Left(tail) = io else {
        return Err("read through the kernel TLS path, which keeps no record tail");
    };
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
    let suite = conn.negotiated_cipher_suite().map(|s| u16::from(s.suite()));
    let Some((version, _)) = suite.and_then(suite_params) else {
        return Err("the cipher suite is not one a hand-over handles");
    };
    if version == Version::Tls13 && tail.secrets().is_none() {
        return Err("no key log: the TLS 1.3 secrets are unknown");
    }
    if !partial_is_one_record(tail.partial()) {
        return Err("the partial record is not the start of one record");
    }
    Ok(())
}

/// Reads out what rustls decrypted and nobody read; true if the peer's
/// close_notify came.
fn unread_plaintext(conn: &mut rustls::ServerConnection) -> io::Result<(Vec<u8>, bool)> {
    let mut plaintext = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match conn.reader().read(&mut chunk) {
            Ok(0) => return Ok((plaintext, true)),
            Ok(n) => plaintext.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok((plaintext, false)),
            Err(e) => return Err(e),
        }
        if plaintext.len() > MAX_PENDING_PLAINTEXT {
            return Ok((plaintext, false));
        }
    }
}

/// The keys out of rustls: past this point the connection is gone.
fn consume(tls: ClientTls, plaintext: Vec<u8>, generations: usize) -> Result<Taken, String> {
    let (io, conn) = tls.into_inner();
    let Either::Left(tail) = io else {
        unreachable!("checked by can_take")
    };
    let secrets = tail.secrets();
    let (buffered, partial) = tail.into_parts();
    let ahead = buffered.buffer().to_vec();
    let tcp = buffered.into_inner();
    let suite = conn
        .negotiated_cipher_suite()
        .map(|s| u16::from(s.suite()))
        .ok_or("no suite")?;
    let (version, _) = suite_params(suite).ok_or("unknown suite")?;
    let extracted = conn
        .dangerous_extract_secrets()
        .map_err(|e| format!("rustls would not give the keys: {e}"))?;
    let state = TlsState::from_extracted(
        Side::Server,
        (suite, version),
        (extracted.tx.0, &extracted.tx.1),
        (extracted.rx.0, &extracted.rx.1),
        (secrets.as_deref(), generations),
    )
    .map_err(|e| e.to_string())?;
    let state = TlsState {
        plaintext,
        partial,
        ..state
    };
    state.check().map_err(|e| e.to_string())?;
    Ok(Taken { tcp, state, ahead })
}

impl Handable for Resumable {
    async fn send_owed(&mut self) -> io::Result<()> {
        self.seal_owed()?;
        self.flush().await
    }

    /// Its secrets are current already: nothing to walk.
    fn take(self, _generations: usize) -> Result<Taken, TakeError<Self>> {
        match self.into_state() {
            Err((stream, why)) => Err(TakeError::Back(stream, Vec::new(), why.to_string())),
            Ok((prefixed, state, mut ahead)) => {
                let (tcp, rest) = prefixed.into_parts();
                ahead.extend_from_slice(&rest);
                Ok(Taken { tcp, state, ahead })
            }
        }
    }
}
