//! The predecessor's two steps on a tokio-rustls stream read through
//! `RecordTail`: send what rustls owes, then take the state. Between
//! them nothing may write on the session.

use std::io::{self, Write};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::state::{StateError, TlsState};
use super::tail::RecordTail;
use crate::tls::key_update::SecretLog;

/// Queues a KeyUpdate rustls owes the peer (it answers one asking for
/// it only on a write: a write of nothing) and sends every record it
/// holds. `AsyncWriteExt::write_all(&[])` would not do: it never writes.
pub async fn send_owed_server<IO>(tls: &mut tokio_rustls::server::TlsStream<IO>) -> io::Result<()>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let _nothing: usize = tls.get_mut().1.writer().write(&[])?;
    tls.flush().await
}

/// `send_owed_server` for client mode's sessions.
pub async fn send_owed_client<IO>(tls: &mut tokio_rustls::client::TlsStream<IO>) -> io::Result<()>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let _nothing: usize = tls.get_mut().1.writer().write(&[])?;
    tls.flush().await
}

/// The socket and the session's state, after `send_owed_server`.
pub fn take_server<IO>(
    tls: tokio_rustls::server::TlsStream<RecordTail<IO>>,
    secrets: Option<&SecretLog>,
) -> Result<(IO, TlsState), StateError> {
    let (io, conn) = tls.into_inner();
    let (io, partial) = io.into_parts();
    Ok((io, TlsState::take(conn, partial, secrets)?))
}

/// The socket and the session's state, after `send_owed_client`.
pub fn take_client<IO>(
    tls: tokio_rustls::client::TlsStream<RecordTail<IO>>,
    secrets: Option<&SecretLog>,
) -> Result<(IO, TlsState), StateError> {
    let generations = crate::tls::key_update::DEFAULT_MAX_GENERATIONS_AT_HAND_OVER;
    take_client_bounded(tls, (secrets, generations))
}

/// `take_client`, a TLS 1.3 session's keys followed through at most
/// `generations` key updates (client mode's
/// `--handover-max-key-generations`).
pub fn take_client_bounded<IO>(
    tls: tokio_rustls::client::TlsStream<RecordTail<IO>>,
    (secrets, generations): (Option<&SecretLog>, usize),
) -> Result<(IO, TlsState), StateError> {
    let (io, conn) = tls.into_inner();
    let (io, partial) = io.into_parts();
    Ok((
        io,
        TlsState::take_bounded(conn, partial, (secrets, generations))?,
    ))
}
