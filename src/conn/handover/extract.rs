//! Taking a quiet session's TLS state out of the stream that carries it:
//! rustls (a session that started here, read through `RecordTail`, or
//! through `RecordAligned` where kernel TLS is on and the session stayed
//! in rustls), `ResumedTls` (one handed over to this process before), or
//! `KernelTls` (the kernel's record layer, whose socket carries its keys
//! and sequence numbers). Everything that can refuse is checked before
//! anything is consumed, so that a refusal gives the stream back whole
//! and the session goes on here (review M3); only rustls's own key
//! extraction can fail after that, and then the session is lost (closed).

use std::future::Future;
use std::io::{self, Read, Write};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::either::Either;

use crate::conn::kernel_tls::{KernelTls, TlsIo};
use crate::conn::prefixed::Prefixed;
use crate::conn::session::{ClientStream, ClientTls};
use crate::tls::handover::state::{
    partial_is_one_record, suite_params, Side, TlsState, Version, MAX_PENDING_PLAINTEXT,
};
use crate::tls::handover::{ResumedTls, SessionTls};

/// A session handed to this process, served on.
pub type Resumable = ResumedTls<Prefixed<TcpStream>>;

/// What a take gives: the client socket, the state, and ciphertext read
/// from the socket that the TLS layer has not processed (it goes before
/// whatever the socket still holds).
pub struct Taken {
    pub tcp: TcpStream,
    pub state: SessionTls,
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
    let (secrets, partial_ok) = match io {
        Either::Left(tail) if !tail.is_on() => return Err("the record tail is not kept"),
        Either::Left(tail) => (
            tail.secrets().is_some(),
            partial_is_one_record(tail.partial()),
        ),
        Either::Right(aligned) if !aligned.is_handable() => {
            return Err("read for the kernel's record layer, and not kept for a hand-over")
        }
        Either::Right(aligned) => (true, aligned.at_boundary()),
    };
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
    if version == Version::Tls13 && !secrets {
        return Err("no key log: the TLS 1.3 secrets are unknown");
    }
    if !partial_ok {
        return Err("rustls holds a record in part");
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

/// The socket, the ciphertext read ahead of rustls, the record rustls
/// holds in part (none read record by record), and the key log.
type Io = (
    TcpStream,
    Vec<u8>,
    Vec<u8>,
    Option<std::sync::Arc<crate::tls::key_update::SecretLog>>,
);

fn into_io(io: TlsIo) -> Io {
    match io {
        Either::Left(tail) => {
            let secrets = tail.secrets();
            let (buffered, partial) = tail.into_parts();
            let ahead = buffered.buffer().to_vec();
            (buffered.into_inner(), ahead, partial, secrets)
        }
        Either::Right(aligned) => {
            let secrets = aligned.secrets().clone();
            let (tcp, ahead) = aligned.into_parts();
            (tcp, ahead, Vec::new(), Some(secrets))
        }
    }
}

/// The keys out of rustls: past this point the connection is gone.
fn consume(tls: ClientTls, plaintext: Vec<u8>, generations: usize) -> Result<Taken, String> {
    let (io, conn) = tls.into_inner();
    let (tcp, ahead, partial, secrets) = into_io(io);
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
    Ok(Taken {
        tcp,
        state: SessionTls::Rustls(state),
        ahead,
    })
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
                Ok(Taken {
                    tcp,
                    state: SessionTls::Rustls(state),
                    ahead,
                })
            }
        }
    }
}

/// Under kernel TLS the socket carries the record layer: the state is
/// the secrets and counters `KernelTls` keeps, and no ciphertext is
/// ahead of it (the kernel holds what it has not given out).
impl Handable for KernelTls {
    async fn send_owed(&mut self) -> io::Result<()> {
        KernelTls::send_owed(self).await
    }

    /// No walk: `KernelTls` follows each key update as it comes and
    /// keeps the current secrets.
    fn take(self, _generations: usize) -> Result<Taken, TakeError<Self>> {
        if let Some(why) = self.refusal() {
            return Err(TakeError::Back(self, Vec::new(), why.to_string()));
        }
        let (tcp, state) = self.into_state();
        Ok(Taken {
            tcp,
            state: SessionTls::Kernel(state),
            ahead: Vec::new(),
        })
    }
}

/// A session as the handshake left it: in rustls, or in the kernel.
impl Handable for ClientStream {
    async fn send_owed(&mut self) -> io::Result<()> {
        match self {
            Either::Left(tls) => tls.send_owed().await,
            Either::Right(kernel) => KernelTls::send_owed(kernel).await,
        }
    }

    fn take(self, generations: usize) -> Result<Taken, TakeError<Self>> {
        match self {
            Either::Left(tls) => tls.take(generations).map_err(|e| wrap(e, Either::Left)),
            Either::Right(kernel) => {
                Handable::take(kernel, generations).map_err(|e| wrap(e, Either::Right))
            }
        }
    }
}

fn wrap<S, T>(e: TakeError<S>, into: impl FnOnce(S) -> T) -> TakeError<T> {
    match e {
        TakeError::Back(s, plaintext, why) => TakeError::Back(into(s), plaintext, why),
        TakeError::Lost(why) => TakeError::Lost(why),
    }
}
