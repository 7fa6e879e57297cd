//! A client-mode session handed to this process, served: the local
//! socket as it came (with the bytes of a request header read before
//! the stop), the remote's TLS rebuilt from the carried state
//! (`ResumedTls`, no new handshake), registered for a further hand-over,
//! then the same relay.

use std::sync::Arc;
use std::time::Instant;

use tokio::net::{TcpStream, UnixStream};
use tracing::{info, Instrument};

use super::side::{RemoteSide, ResumedRemote};
use super::taker::{LocalSocket, ResumedClient};
use crate::client::reconnect::{Opened, Reconnecting};
use crate::client::ClientSettings;
use crate::conn::error::{ConnError, Side};
use crate::conn::prefixed::Prefixed;
use crate::conn::session::{Stats, Transmit};
use crate::logsafe::escape_bytes;
use crate::proto::consts::TFLAG_READ_ONLY;
use crate::shutdown::Shutdown;
use crate::tls::handover::ResumedTls;

/// Serves a session handed over, to its end, and logs how it ended.
pub async fn serve(
    resumed: ResumedClient,
    id: u64,
    shared: Arc<ClientSettings>,
    shutdown: Shutdown,
) {
    let span = tracing::info_span!("conn", id, was = resumed.was);
    async move {
        let metrics = &shared.metrics;
        metrics.connections_open.inc();
        let started = Instant::now();
        let stats = Stats::new(metrics.clone());
        stats.restore(resumed.counts);
        let mut cut = shutdown.clone();
        let result = tokio::select! {
            result = run(resumed, id, &shared, (shutdown, &stats)) => result,
            () = cut.cut() => Err(ConnError::GraceOver),
        };
        metrics.connections_open.dec();
        metrics.connection(match &result {
            Err(e) if !e.is_routine() => "error",
            _ => "closed",
        });
        crate::conn::log_close(result, &stats, started, false);
    }
    .instrument(span)
    .await
}

async fn run(
    resumed: ResumedClient,
    id: u64,
    shared: &Arc<ClientSettings>,
    (shutdown, stats): (Shutdown, &Stats),
) -> Result<&'static str, ConnError> {
    let settings = &**shared;
    let ResumedClient {
        offer,
        local,
        before,
        remote,
        tls,
        remote_ahead,
        ..
    } = resumed;
    let io = |side| move |e: std::io::Error| ConnError::io(side, "at a hand-over")(e);
    remote.set_nonblocking(true).map_err(io(Side::Upstream))?;
    let remote = TcpStream::from_std(remote).map_err(io(Side::Upstream))?;
    crate::conn::set_keepalive(
        &remote,
        settings.relay.keepalive,
        settings.relay.stall_timeout,
    );
    let remote: ResumedRemote = ResumedTls::new(Prefixed::new(remote, remote_ahead), tls, None)
        .map_err(|e| io(Side::Upstream)(std::io::Error::other(e.to_string())))?;
    info!(
        tls = ?remote.layer().version(),
        export = %escape_bytes(&offer.export),
        mode = ?offer.mode,
        "hand-over: serving a session handed over by the old process (no new TLS handshake)"
    );
    let transmit = Transmit {
        limits: crate::client::limits(settings),
        shutdown,
        stats,
    };
    let registered = super::register(settings.handover.as_ref(), id, &offer);
    let both = (offer.mode, offer.tflags & TFLAG_READ_ONLY != 0);
    let local = (local, before);
    match (offer.reconnect.clone(), settings.reconnect) {
        // Both under --reconnect: a later drop reconnects from here.
        (Some(reopening), Some(_)) => {
            let opened = Opened::from_wire(reopening, (offer.size, offer.tflags));
            let remote = Reconnecting::resumed(remote, shared.clone(), opened, offer.mode);
            relay(local, remote, both, registered, &transmit).await
        }
        _ => relay(local, remote, both, registered, &transmit).await,
    }
}

/// The relay over the local socket as it came (Unix or TCP).
async fn relay<R: RemoteSide>(
    (local, before): (LocalSocket, Vec<u8>),
    remote: R,
    both: (crate::proto::transmission::ReplyMode, bool),
    registered: Option<crate::handing::Registered>,
    transmit: &Transmit<'_>,
) -> Result<&'static str, ConnError> {
    let io = |e: std::io::Error| ConnError::io(Side::Client, "at a hand-over")(e);
    match local {
        LocalSocket::Unix(local) => {
            local.set_nonblocking(true).map_err(io)?;
            let local = UnixStream::from_std(local).map_err(io)?;
            super::transmit((local, before), remote, both, registered, transmit).await
        }
        LocalSocket::Tcp(local) => {
            local.set_nonblocking(true).map_err(io)?;
            let local = TcpStream::from_std(local).map_err(io)?;
            super::transmit((local, before), remote, both, registered, transmit).await
        }
    }
}
