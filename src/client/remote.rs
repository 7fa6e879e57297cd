//! Client mode's side towards the remote server: TCP, the fixed-newstyle
//! greeting as a client, NBD_OPT_STARTTLS, and a verified TLS handshake
//! (the server's certificate against the CA, its name against the SANs).
//! What follows the handshake is the shared option relay (`relayed`).

use std::io;
use std::time::Duration;

use thiserror::Error;
use tokio::net::TcpStream;

use crate::client::ClientSettings;
use crate::conn::error::{ConnError, Side};
use crate::conn::options::OptionChannel;
use crate::conn::session::TLS_BUFFER_LIMIT;
use crate::logsafe::escape_bytes;
use crate::proto::consts::*;
use crate::tls::handover::RecordTail;
use crate::upstream::{newstyle_greeting, UpstreamError};

/// The remote server's connection once TLS is up, read through
/// `RecordTail` (a pass-through unless a hand-over may take the session:
/// then it keeps the record read in part, and the connection's own key
/// log, for `crate::client::handover`).
pub type RemoteTls = tokio_rustls::client::TlsStream<RecordTail<TcpStream>>;

/// Why the remote server could not be reached with TLS. Every variant
/// names the server; texts the server sent are escaped.
#[derive(Debug, Error)]
pub enum RemoteError {
    #[error("cannot connect to {server}: {error}")]
    Connect { server: String, error: io::Error },
    #[error("{server} did not accept, greet and finish TLS within {after:?} (--server-timeout)")]
    Timeout { server: String, after: Duration },
    #[error("{server}: {error}")]
    Greeting {
        server: String,
        error: UpstreamError,
    },
    #[error("{server} refused NBD_OPT_STARTTLS ({reply}): {message}")]
    StartTlsRefused {
        server: String,
        reply: &'static str,
        message: String,
    },
    #[error("{server}: NBD_OPT_STARTTLS: {error}")]
    StartTls { server: String, error: ConnError },
    #[error("TLS handshake with {server} failed: {error}")]
    Tls { server: String, error: io::Error },
}

impl RemoteError {
    /// A short label for the metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            RemoteError::Connect { .. } => "connect",
            RemoteError::Timeout { .. } => "timeout",
            RemoteError::Greeting { .. } => "greeting",
            RemoteError::StartTlsRefused { .. } | RemoteError::StartTls { .. } => "starttls",
            RemoteError::Tls { .. } => "tls",
        }
    }
}

/// The remote server, greeted and under TLS, ready for options.
pub struct Remote {
    pub channel: OptionChannel<RemoteTls>,
    /// Whether the server pads an EXPORT_NAME reply with zeroes.
    pub pads_export_name: bool,
}

/// Connects to the server and brings the connection to the options
/// after TLS, all within `--server-timeout`.
pub async fn connect(settings: &ClientSettings) -> Result<Remote, RemoteError> {
    let after = settings.server_timeout;
    tokio::time::timeout(after, connect_and_secure(settings))
        .await
        .map_err(|_| RemoteError::Timeout {
            server: settings.server.clone(),
            after,
        })?
}

async fn connect_and_secure(settings: &ClientSettings) -> Result<Remote, RemoteError> {
    let server = || settings.server.clone();
    let mut tcp = TcpStream::connect((settings.host.as_str(), settings.port))
        .await
        .map_err(|error| RemoteError::Connect {
            server: server(),
            error,
        })?;
    // As on the server side: TLS 1.3 lets the client speak last, and
    // Nagle would hold a request behind our unacknowledged data.
    let _ = tcp.set_nodelay(true);
    crate::conn::set_keepalive(&tcp, settings.relay.keepalive, settings.relay.stall_timeout);
    let pads_export_name =
        newstyle_greeting(&mut tcp)
            .await
            .map_err(|error| RemoteError::Greeting {
                server: server(),
                error,
            })?;
    let tcp = starttls(tcp, settings).await?;
    let (tcp, config) = tls_io(tcp, settings);
    let connector = tokio_rustls::TlsConnector::from(config);
    let tls = connector
        .connect_with(settings.server_name.clone(), tcp, |conn| {
            conn.set_buffer_limit(Some(TLS_BUFFER_LIMIT))
        })
        .await
        .map_err(|error| RemoteError::Tls {
            server: server(),
            error,
        })?;
    crate::conn::log_tls(tls.get_ref().1, Side::Upstream, &settings.metrics);
    let channel = OptionChannel::new(tls, Side::Upstream, settings.relay.max_option_len)
        .bounded(settings.server_timeout);
    Ok(Remote {
        channel,
        pads_export_name,
    })
}

/// The socket rustls should read the handshake through, and the
/// configuration to make it with: where this process may hand the
/// session over (`--handover-socket`), the current configuration with a
/// key log of this connection's own (the TLS 1.3 traffic secrets reach
/// the hand-over and no other connection) and secret extraction on, as
/// the server mode's `tls_io` does.
fn tls_io(
    tcp: TcpStream,
    settings: &ClientSettings,
) -> (RecordTail<TcpStream>, std::sync::Arc<rustls::ClientConfig>) {
    let current = settings.tls.current();
    if settings.handover.is_none() {
        return (RecordTail::off(tcp), current);
    }
    let secrets = crate::tls::key_update::SecretLog::new();
    let mut own = (*current).clone();
    own.key_log = secrets.clone();
    own.enable_secret_extraction = true;
    (
        RecordTail::new(tcp).with_secrets(secrets),
        std::sync::Arc::new(own),
    )
}

/// NBD_OPT_STARTTLS in plaintext; the server's ACK hands the socket to TLS.
async fn starttls(tcp: TcpStream, settings: &ClientSettings) -> Result<TcpStream, RemoteError> {
    let failed = |error| RemoteError::StartTls {
        server: settings.server.clone(),
        error,
    };
    let mut plain = OptionChannel::new(tcp, Side::Upstream, settings.relay.max_option_len);
    plain.send_option(OPT_STARTTLS, &[]).await.map_err(failed)?;
    let mut reply = Vec::new();
    let header = plain
        .read_reply(OPT_STARTTLS, &mut reply)
        .await
        .map_err(failed)?;
    if header.reply_type != REP_ACK {
        return Err(RemoteError::StartTlsRefused {
            server: settings.server.clone(),
            reply: reply_name(header.reply_type),
            message: escape_bytes(&reply[OPTION_REPLY_HEADER_LEN..]),
        });
    }
    Ok(plain.into_inner())
}

/// The name of an option reply type, for logs and messages.
pub fn reply_name(reply_type: u32) -> &'static str {
    match reply_type {
        REP_ACK => "NBD_REP_ACK",
        REP_ERR_UNSUP => "NBD_REP_ERR_UNSUP",
        REP_ERR_POLICY => "NBD_REP_ERR_POLICY",
        REP_ERR_INVALID => "NBD_REP_ERR_INVALID",
        REP_ERR_PLATFORM => "NBD_REP_ERR_PLATFORM",
        REP_ERR_TLS_REQD => "NBD_REP_ERR_TLS_REQD",
        REP_ERR_UNKNOWN => "NBD_REP_ERR_UNKNOWN",
        REP_ERR_SHUTDOWN => "NBD_REP_ERR_SHUTDOWN",
        REP_ERR_BLOCK_SIZE_REQD => "NBD_REP_ERR_BLOCK_SIZE_REQD",
        REP_ERR_TOO_BIG => "NBD_REP_ERR_TOO_BIG",
        REP_ERR_EXT_HEADER_REQD => "NBD_REP_ERR_EXT_HEADER_REQD",
        _ => "an unknown reply",
    }
}
