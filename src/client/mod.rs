//! `nbdgw client`: TLS for NBD clients that have none. Local clients (the
//! kernel's nbd-client, libnbd or qemu without TLS) connect in plaintext
//! to a Unix socket or a loopback TCP port; each is relayed to one remote
//! NBD server over NBD_OPT_STARTTLS and a verified TLS session.
//!
//! All of client mode lives here: `credentials` (the CA and the client
//! certificate, reloaded), `remote` (dial, STARTTLS, verify), `serve` (one
//! local connection: greeting, options, transmission), `reconnect` (a
//! remote stream that survives server restarts, under the unchanged
//! relay) and `settings` (the flags made into `ClientSettings`). The
//! connection machinery it shares with the server mode (options channel,
//! relay, errors) is `crate::conn`'s; arrows point from here to there only.

pub mod credentials;
pub mod handover;
mod local_client;
pub(crate) mod reconnect;
mod remote;
pub mod settings;
mod start;

pub use local_client::serve as serve_local;
pub use start::start;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use thiserror::Error;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tracing::{info, warn};

use crate::cli::LocalAddr;
use crate::config::Cork;
use crate::handover::gate::{Accepting, Gate};
use crate::metrics::{Health, Metrics};
use crate::shutdown::ShutdownControl;

/// Everything one `nbdgw client` process needs, fixed at start.
pub struct ClientSettings {
    /// The server as the operator gave it, for logs and messages.
    pub server: String,
    pub host: String,
    pub port: u16,
    /// The name the server's certificate must carry (DNS or IP SAN).
    pub server_name: ServerName<'static>,
    /// Read afresh for each remote connection: a reload may replace it.
    pub tls: Arc<crate::reloadable::Swap<rustls::ClientConfig>>,
    /// Bounds reaching the server (connect, greeting, STARTTLS and TLS
    /// together), then each of its option replies.
    pub server_timeout: Duration,
    /// From a local client's connect until transmission starts.
    pub handshake_timeout: Duration,
    /// The same bounds as a server's connections have.
    pub relay: crate::config::RelayLimits,
    pub max_connections: usize,
    pub cork: Cork,
    pub shutdown_grace: Duration,
    /// `--reconnect`: keep local connections across a drop of the
    /// server's; `None` closes them with it.
    pub reconnect: Option<Reconnect>,
    pub metrics: Arc<Metrics>,
    /// What `/healthz` and `/readyz` report: accepting, draining, and
    /// whether the last try to reach the server failed.
    pub health: Arc<Health>,
    /// `--handover-socket`: the sessions a successor may take (sessions
    /// under `--reconnect` are not among them).
    pub handover: Option<Arc<crate::handing::Registry>>,
    /// Where the TLS files are: a successor judges a handed-over
    /// session's server chain with them as they are now.
    pub tls_paths: credentials::ClientTlsPaths,
    /// `--tls-min-version`, which a handed-over session must meet.
    pub min_version: crate::tls::MinVersion,
}

/// How `--reconnect` behaves.
#[derive(Debug, Clone, Copy)]
pub struct Reconnect {
    /// How long to keep trying after a drop (`--reconnect-timeout`).
    pub timeout: Duration,
    /// Bytes of requests kept for sending again (`--replay-buffer`).
    pub replay_buffer: usize,
    /// Bytes of unfinished structured replies held until whole
    /// (`--reply-buffer`).
    pub reply_buffer: usize,
}

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("--server {0}: expected HOST:PORT (an IPv6 address in brackets: [::1]:10809)")]
    BadServer(String),
    #[error("--server-name or --server host {0:?} is neither a DNS name nor an IP address")]
    BadServerName(String),
    #[error("--listen {0}: the local side is plaintext, so it listens on loopback addresses only (or a Unix socket)")]
    NotLoopback(SocketAddr),
    #[error("--listen {0}: another process is listening on this socket")]
    SocketInUse(PathBuf),
    #[error("--listen {what}: {error}")]
    Bind { what: String, error: std::io::Error },
}

impl std::fmt::Display for LocalAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LocalAddr::Unix(path) => write!(f, "{}", path.display()),
            LocalAddr::Tcp(addr) => write!(f, "{addr}"),
        }
    }
}

/// `HOST:PORT`, `[V6]:PORT`: the host (brackets removed) and the port.
pub fn parse_server(server: &str) -> Result<(String, u16), ClientError> {
    let bad = || ClientError::BadServer(server.to_string());
    let (host, port) = server.rsplit_once(':').ok_or_else(bad)?;
    let port = port.parse::<u16>().map_err(|_| bad())?;
    let host = match host.strip_prefix('[') {
        Some(inner) => inner.strip_suffix(']').ok_or_else(bad)?,
        None if host.contains(':') => return Err(bad()),
        None => host,
    };
    if host.is_empty() || port == 0 {
        return Err(bad());
    }
    Ok((host.to_string(), port))
}

/// The name to verify the server's certificate against.
pub fn server_name(name: &str) -> Result<ServerName<'static>, ClientError> {
    ServerName::try_from(name.to_string()).map_err(|_| ClientError::BadServerName(name.into()))
}

/// A bound local listener.
pub enum LocalListener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

impl LocalListener {
    /// Binds `addr` (inside the runtime). A Unix socket left behind by a
    /// process that is gone is replaced; one that still answers is not.
    pub fn bind(addr: &LocalAddr) -> Result<Self, ClientError> {
        let bind_err = |error| ClientError::Bind {
            what: addr.to_string(),
            error,
        };
        match addr {
            LocalAddr::Tcp(addr) => {
                if !addr.ip().is_loopback() {
                    return Err(ClientError::NotLoopback(*addr));
                }
                let listener = std::net::TcpListener::bind(addr).map_err(bind_err)?;
                listener.set_nonblocking(true).map_err(bind_err)?;
                Ok(LocalListener::Tcp(
                    TcpListener::from_std(listener).map_err(bind_err)?,
                ))
            }
            LocalAddr::Unix(path) => {
                remove_stale_socket(path)?;
                let listener = UnixListener::bind(path).map_err(bind_err)?;
                Ok(LocalListener::Unix(listener, path.clone()))
            }
        }
    }

    /// The listener now belongs to a successor too: its socket file is
    /// the successor's, and is left in place when this one closes.
    pub fn disown(&mut self) {
        if let LocalListener::Unix(_, path) = self {
            *path = PathBuf::new();
        }
    }

    pub fn describe(&self) -> String {
        match self {
            LocalListener::Unix(_, path) => path.display().to_string(),
            LocalListener::Tcp(listener) => listener
                .local_addr()
                .map_or_else(|_| "?".into(), |a| a.to_string()),
        }
    }
}

impl Drop for LocalListener {
    fn drop(&mut self) {
        if let LocalListener::Unix(_, path) = self {
            if !path.as_os_str().is_empty() {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

fn remove_stale_socket(path: &Path) -> Result<(), ClientError> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        // Not ours to remove: bind fails and says so.
        return Ok(());
    }
    let bind_error = |error| ClientError::Bind {
        what: path.display().to_string(),
        error,
    };
    // Only a socket of ours that nobody listens on is stale: another
    // user's socket in a shared directory (connect says EACCES), or one
    // busy for a moment (EAGAIN), is somebody's live listener.
    let uid = rustix::process::geteuid().as_raw();
    let owner = std::os::unix::fs::MetadataExt::uid(&meta);
    if owner != uid {
        let why = format!("a socket of uid {owner} is there, not ours ({uid})");
        return Err(bind_error(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            why,
        )));
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(ClientError::SocketInUse(path.to_owned())),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            std::fs::remove_file(path).map_err(bind_error)
        }
        Err(e) => Err(bind_error(e)),
    }
}

/// The hand-over's side of the accept loop: the gate a predecessor
/// closes once its successor serves, and the sessions a predecessor
/// handed to this process.
pub struct Handing {
    pub gate: Gate,
    pub resumed: mpsc::Receiver<handover::taker::ResumedClient>,
}

/// Serves local clients until `shutdown` resolves (or a successor serves
/// the listener), then lets the connections finish what is in flight
/// within the grace period; a request read after that gets
/// `drain_answer`.
pub async fn run(
    mut listener: LocalListener,
    settings: Arc<ClientSettings>,
    (shutdown, drain_answer): (impl Future<Output = ()>, crate::shutdown::DrainAnswer),
    Handing {
        mut gate,
        mut resumed,
    }: Handing,
) -> std::io::Result<()> {
    let mut connections = JoinSet::new();
    let mut next_id: u64 = 0;
    let (control, phase) = ShutdownControl::answering(drain_answer);
    let mut shutdown = std::pin::pin!(shutdown);
    settings.health.set_accepting(true);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => break,
            // The successor serves the listener now: drain.
            state = gate.changed() => match state {
                Accepting::HandedOver => { control.handed_over(); listener.disown(); break }
                _ => continue,
            },
            Some(session) = resumed.recv() => {
                next_id += 1;
                let task = handover::served::serve(session, next_id, settings.clone(), phase.clone());
                connections.spawn(task);
                continue;
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = accept(&listener), if gate.accepting() => accepted,
        };
        let Some((stream, peer)) = admitted(accepted, &connections, &settings).await else {
            continue;
        };
        next_id += 1;
        let (id, settings, phase) = (next_id, settings.clone(), phase.clone());
        connections.spawn(async move {
            match stream {
                Stream::Unix(s) => serve_local(s, id, peer, settings, phase).await,
                Stream::Tcp(s) => serve_local(s, id, peer, settings, phase).await,
            }
        });
    }
    // Whatever ended the loop (a stop signal mid-hand-over too): once a
    // successor was told Go the socket file is its (review C1).
    if !gate.release_paths() {
        listener.disown();
    }
    drop(listener);
    settings.health.set_draining();
    settings.health.set_accepting(false);
    crate::shutdown::shut_down(connections, &control, settings.shutdown_grace).await;
    info!("stopped");
    Ok(())
}

/// The accepted connection, unless the accept failed or
/// `--max-connections` is reached (counted and logged).
async fn admitted(
    accepted: std::io::Result<(Stream, String)>,
    connections: &JoinSet<()>,
    settings: &ClientSettings,
) -> Option<(Stream, String)> {
    let (stream, peer) = match accepted {
        Ok(accepted) => accepted,
        Err(e) => {
            crate::listeners::accept_failed(e).await;
            return None;
        }
    };
    if connections.len() >= settings.max_connections {
        settings.metrics.connection("refused");
        warn!(%peer, max_connections = settings.max_connections, "refused: --max-connections reached");
        return None;
    }
    Some((stream, peer))
}

enum Stream {
    Unix(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream),
}

async fn accept(listener: &LocalListener) -> std::io::Result<(Stream, String)> {
    match listener {
        LocalListener::Unix(listener, path) => {
            let (stream, _) = listener.accept().await?;
            // Unix peers have no address; their credentials say who.
            let peer = match stream.peer_cred() {
                Ok(cred) => match cred.pid() {
                    Some(pid) => format!("{} pid {pid} uid {}", path.display(), cred.uid()),
                    None => format!("{} uid {}", path.display(), cred.uid()),
                },
                Err(_) => path.display().to_string(),
            };
            Ok((Stream::Unix(stream), peer))
        }
        LocalListener::Tcp(listener) => {
            let (stream, peer) = listener.accept().await?;
            let _ = stream.set_nodelay(true);
            Ok((Stream::Tcp(stream), peer.to_string()))
        }
    }
}

/// The relay's bounds, as a server's connections have them.
pub(crate) fn limits(settings: &ClientSettings) -> crate::conn::session::Limits {
    crate::conn::session::Limits {
        max_payload: settings.relay.max_payload,
        idle_timeout: settings.relay.idle_timeout,
        stall_timeout: settings.relay.stall_timeout,
        cork: settings.cork,
    }
}

/// Logged once at start.
pub fn log_start(
    listener: &LocalListener,
    settings: &ClientSettings,
    tls: &str,
    groups: &crate::tls::KxGroups,
) {
    info!(
        listen = %listener.describe(),
        server = %settings.server,
        tls = %tls,
        %groups,
        "nbdgw client listening"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_addresses() {
        assert_eq!(
            parse_server("nbd.example:10809").unwrap(),
            ("nbd.example".into(), 10809)
        );
        assert_eq!(parse_server("[::1]:1").unwrap(), ("::1".into(), 1));
        assert_eq!(
            parse_server("192.0.2.1:10809").unwrap(),
            ("192.0.2.1".into(), 10809)
        );
        for bad in ["nbd.example", "::1:10809", ":10809", "h:0", "h:x", "[::1:1"] {
            assert!(parse_server(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn local_addresses_and_loopback_only() {
        assert_eq!(
            "127.0.0.1:10809".parse::<LocalAddr>().unwrap(),
            LocalAddr::Tcp(([127, 0, 0, 1], 10809).into())
        );
        assert_eq!(
            "/run/x.sock".parse::<LocalAddr>().unwrap(),
            LocalAddr::Unix("/run/x.sock".into())
        );
        assert_eq!(
            "localhost:10809".parse::<LocalAddr>().unwrap(),
            LocalAddr::Tcp(([127, 0, 0, 1], 10809).into())
        );
        // A name and a port is not a file name.
        assert!("disks.lan:10809".parse::<LocalAddr>().is_err());
        assert_eq!(
            "./disks.lan:10809".parse::<LocalAddr>().unwrap(),
            LocalAddr::Unix("./disks.lan:10809".into())
        );
        assert_eq!(
            "client.sock".parse::<LocalAddr>().unwrap(),
            LocalAddr::Unix("client.sock".into())
        );
        let err = LocalListener::bind(&LocalAddr::Tcp(([0, 0, 0, 0], 0).into()))
            .err()
            .unwrap();
        assert!(err.to_string().contains("loopback"), "{err}");
    }
}
