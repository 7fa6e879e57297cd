//! The plaintext part of a connection: greeting, client flags, and the
//! options before STARTTLS. nbdgw is a "forced TLS" server: nothing but
//! STARTTLS (and ABORT) is served here, and nothing here is remembered
//! once TLS is up.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tracing::debug;

use super::{ClientIo, ClientTls, ConnError};
use crate::config::Config;
use crate::proto::consts::*;
use crate::proto::handshake::{
    encode_option_reply, parse_client_flags, server_greeting, ClientFlags, OptionHeader,
};
use crate::proto::ProtoError;
use crate::shutdown::Shutdown;

pub enum Outcome {
    /// STARTTLS acknowledged: the stream (with whatever the client already
    /// sent behind it, which belongs to TLS) goes to the TLS handshake.
    StartTls(ClientIo, ClientFlags),
    Closed(&'static str),
}

const TLS_REQUIRED: &str = "TLS is required: send NBD_OPT_STARTTLS first";

pub async fn negotiate(
    mut io: ClientIo,
    config: &Config,
    shutdown: &Shutdown,
) -> Result<Outcome, ConnError> {
    io.get_mut()
        .write_all(&server_greeting())
        .await
        .map_err(|e| ConnError::client_left_early(e, "before the greeting"))?;
    let mut flags = [0u8; 4];
    io.read_exact(&mut flags)
        .await
        .map_err(|e| ConnError::client_left_early(e, "before sending its flags"))?;
    let client = parse_client_flags(u32::from_be_bytes(flags)).map_err(ConnError::ClientProto)?;

    let mut data = Vec::new();
    loop {
        let option = read_option(&mut io, config, &mut data).await?;
        match refused_for_shutdown(io.get_mut(), &option, shutdown).await? {
            ShutdownAnswer::Serve => {}
            ShutdownAnswer::Refused => continue,
            ShutdownAnswer::End(reason) => return Ok(Outcome::Closed(reason)),
        }
        let (reply, message) = match option.option {
            OPT_STARTTLS if option.length == 0 => {
                send_reply(io.get_mut(), OPT_STARTTLS, REP_ACK, "").await?;
                return Ok(Outcome::StartTls(io, client));
            }
            OPT_STARTTLS => (REP_ERR_INVALID, "NBD_OPT_STARTTLS carries no data"),
            // EXPORT_NAME cannot be answered with an error: the spec
            // makes the server end the session.
            OPT_EXPORT_NAME => {
                return Ok(Outcome::Closed(
                    "client sent NBD_OPT_EXPORT_NAME before TLS, which is required",
                ))
            }
            OPT_ABORT => {
                send_reply(io.get_mut(), OPT_ABORT, REP_ACK, "").await?;
                return Ok(Outcome::Closed("client sent NBD_OPT_ABORT before TLS"));
            }
            _ => (REP_ERR_TLS_REQD, TLS_REQUIRED),
        };
        debug!(
            option = option_name(option.option),
            code = option.option,
            "refused before TLS"
        );
        send_reply(io.get_mut(), option.option, reply, message).await?;
    }
}

pub async fn accept_tls(io: ClientIo, config: &Config) -> Result<ClientTls, ConnError> {
    let accepted = tokio_rustls::TlsAcceptor::from(config.tls.current())
        .accept_with(io, |conn| {
            conn.set_buffer_limit(Some(super::relay::TLS_BUFFER_LIMIT))
        })
        .into_fallible()
        .await;
    match accepted {
        Ok(tls) => Ok(tls),
        Err((error, mut io)) => {
            close_after_alert(&mut io).await;
            Err(ConnError::Tls(error))
        }
    }
}

/// How long a refused client has to read the alert that says why.
const ALERT_LINGER: Duration = Duration::from_secs(1);

/// Closing a socket with the client's last handshake bytes still unread
/// sends a reset, which can destroy the alert before the client reads it
/// (qemu then reports "Broken pipe" instead of the refusal). So: send FIN
/// behind the alert, and drain what the client still sends, briefly.
async fn close_after_alert(io: &mut ClientIo) {
    let _ = io.get_mut().shutdown().await;
    let mut scratch = [0u8; 4096];
    let _ = tokio::time::timeout(ALERT_LINGER, async {
        while let Ok(1..) = io.read(&mut scratch).await {}
    })
    .await;
}

/// Reads one option: header and all its data (at most `max_option_len`
/// bytes, so a refused option's data is consumed too).
pub(super) async fn read_option<R: AsyncRead + Unpin>(
    reader: &mut R,
    config: &Config,
    data: &mut Vec<u8>,
) -> Result<OptionHeader, ConnError> {
    let mut header = [0u8; OPTION_HEADER_LEN];
    reader
        .read_exact(&mut header)
        .await
        .map_err(|e| ConnError::client_read(e, "during option haggling"))?;
    let option = OptionHeader::parse(&header).map_err(ConnError::ClientProto)?;
    ProtoError::check_limit(
        "option data",
        option.length.into(),
        config.max_option_len.into(),
    )
    .map_err(ConnError::ClientProto)?;
    data.clear();
    let read = reader
        .take(option.length.into())
        .read_to_end(data)
        .await
        .map_err(ConnError::Client)?;
    if read < option.length as usize {
        return Err(ConnError::ClientClosed("in the middle of an option"));
    }
    Ok(option)
}

pub(super) enum ShutdownAnswer {
    /// Not shutting down, or an option served even then (ABORT).
    Serve,
    /// Answered with `NBD_REP_ERR_SHUTDOWN`.
    Refused,
    /// No reply is possible: the connection ends.
    End(&'static str),
}

/// While nbdgw shuts down, options other than ABORT get
/// `NBD_REP_ERR_SHUTDOWN`, which makes the client disconnect softly;
/// EXPORT_NAME has no error reply in the spec, so it ends the connection.
pub(super) async fn refused_for_shutdown<W: AsyncWrite + Unpin>(
    writer: &mut W,
    option: &OptionHeader,
    shutdown: &Shutdown,
) -> Result<ShutdownAnswer, ConnError> {
    if option.option == OPT_ABORT || !shutdown.is_draining() {
        return Ok(ShutdownAnswer::Serve);
    }
    if option.option == OPT_EXPORT_NAME {
        return Ok(ShutdownAnswer::End(
            "NBD_OPT_EXPORT_NAME while shutting down: closed without a reply",
        ));
    }
    send_reply(
        writer,
        option.option,
        REP_ERR_SHUTDOWN,
        "nbdgw is shutting down",
    )
    .await?;
    Ok(ShutdownAnswer::Refused)
}

/// Writes one option reply (with an optional message) and flushes it.
pub(super) async fn send_reply<W: AsyncWrite + Unpin>(
    writer: &mut W,
    option: u32,
    reply_type: u32,
    message: &str,
) -> Result<(), ConnError> {
    let bytes = encode_option_reply(option, reply_type, message.as_bytes());
    writer.write_all(&bytes).await.map_err(ConnError::Client)?;
    writer.flush().await.map_err(ConnError::Client)
}
