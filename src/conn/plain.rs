//! The plaintext part of a connection: greeting, client flags, and the
//! options before STARTTLS. nbdgw is a "forced TLS" server: nothing but
//! STARTTLS (and ABORT) is served here, and nothing here is remembered
//! once TLS is up.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tracing::debug;

use super::error::{ConnError, Side};
use super::options::{OptionChannel, ShutdownAnswer};
use super::session::{ClientIo, ClientTls, TLS_BUFFER_LIMIT};
use crate::config::Config;
use crate::proto::consts::*;
use crate::proto::handshake::{parse_client_flags, server_greeting, ClientFlags};
use crate::shutdown::Shutdown;

pub enum Outcome {
    /// STARTTLS acknowledged: the stream (with whatever the client already
    /// sent behind it, which belongs to TLS) goes to the TLS handshake.
    StartTls(ClientIo, ClientFlags),
    Closed(&'static str),
}

const TLS_REQUIRED: &str = "TLS is required: send NBD_OPT_STARTTLS first";

pub async fn negotiate(
    io: ClientIo,
    config: &Config,
    shutdown: &Shutdown,
) -> Result<Outcome, ConnError> {
    let mut client = OptionChannel::new(io, Side::Client, config.relay.max_option_len);
    let flags = greet(&mut client).await?;
    loop {
        let option = client.read_option().await?;
        match client.refuse_for_shutdown(&option, shutdown).await? {
            ShutdownAnswer::Serve => {}
            ShutdownAnswer::Refused => continue,
            ShutdownAnswer::End(reason) => return Ok(Outcome::Closed(reason)),
        }
        let (reply, message) = match option.option {
            OPT_STARTTLS if option.length == 0 => {
                client.send_reply(OPT_STARTTLS, REP_ACK, "").await?;
                return Ok(Outcome::StartTls(client.into_inner(), flags));
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
                client.send_reply(OPT_ABORT, REP_ACK, "").await?;
                return Ok(Outcome::Closed("client sent NBD_OPT_ABORT before TLS"));
            }
            _ => (REP_ERR_TLS_REQD, TLS_REQUIRED),
        };
        debug!(
            option = option_name(option.option),
            code = option.option,
            "refused before TLS"
        );
        client.send_reply(option.option, reply, message).await?;
    }
}

/// The server greeting, then the client's flags: the same towards a TLS
/// client before STARTTLS and towards a local client in client mode.
pub async fn greet<S: AsyncRead + AsyncWrite + Unpin>(
    client: &mut OptionChannel<S>,
) -> Result<ClientFlags, ConnError> {
    client
        .get_mut()
        .write_all(&server_greeting())
        .await
        .map_err(ConnError::client_left_early("before the greeting"))?;
    let mut flags = [0u8; 4];
    client
        .get_mut()
        .read_exact(&mut flags)
        .await
        .map_err(ConnError::client_left_early("before sending its flags"))?;
    parse_client_flags(u32::from_be_bytes(flags)).map_err(ConnError::proto(Side::Client))
}

pub async fn accept_tls(io: ClientIo, config: &Config) -> Result<ClientTls, ConnError> {
    let (io, tls_config) = super::kernel_tls::tls_io(io, config);
    let accepted = tokio_rustls::TlsAcceptor::from(tls_config)
        .accept_with(io, |conn| conn.set_buffer_limit(Some(TLS_BUFFER_LIMIT)))
        .into_fallible()
        .await;
    match accepted {
        Ok(tls) => Ok(tls),
        Err((error, mut io)) => {
            let (reason, certificate) = failure_reason(&error);
            config.metrics.handshake_failed(reason, certificate);
            close_after_alert(&mut io).await;
            Err(ConnError::Tls(error))
        }
    }
}

/// A short label for why a handshake failed (the alert nbdgw sent, in
/// effect), and whether it was the client's certificate.
pub fn failure_reason(error: &std::io::Error) -> (String, bool) {
    use rustls::{CertificateError, Error};
    let Some(tls) = error.get_ref().and_then(|e| e.downcast_ref::<Error>()) else {
        return ("io".into(), false);
    };
    let reason = match tls {
        Error::NoCertificatesPresented => "certificate_required",
        Error::InvalidCertificate(CertificateError::Revoked) => "certificate_revoked",
        Error::InvalidCertificate(CertificateError::UnknownIssuer) => "unknown_ca",
        Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure) => {
            "access_denied"
        }
        Error::InvalidCertificate(_) => "bad_certificate",
        Error::PeerIncompatible(_) => "incompatible",
        Error::InvalidMessage(_) => "decode_error",
        Error::AlertReceived(_) => "alert_received",
        _ => "other",
    };
    let certificate = matches!(
        tls,
        Error::NoCertificatesPresented | Error::InvalidCertificate(_)
    );
    (reason.into(), certificate)
}

/// How long a refused client has to read the alert that says why.
const ALERT_LINGER: Duration = Duration::from_secs(1);

/// Closing a socket with the client's last handshake bytes still unread
/// sends a reset, which can destroy the alert before the client reads it
/// (qemu then reports "Broken pipe" instead of the refusal). So: send FIN
/// behind the alert, and drain what the client still sends, briefly.
async fn close_after_alert(io: &mut (impl AsyncRead + AsyncWrite + Unpin)) {
    let _ = io.shutdown().await;
    let mut scratch = [0u8; 4096];
    let _ = tokio::time::timeout(ALERT_LINGER, async {
        while let Ok(1..) = io.read(&mut scratch).await {}
    })
    .await;
}
