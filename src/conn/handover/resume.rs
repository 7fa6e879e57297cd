//! The successor's end of a session handed over: the client's TCP socket
//! and the upstream's Unix socket as they came, TLS rebuilt from the
//! carried state (`ResumedTls`), or, for a kernel TLS session, the same
//! `KernelTls` a handshake here would have made, over the socket that
//! keeps the kernel's record layer; the session registered as a fresh one
//! (revocation, policy narrowing, metrics, audit, and a further
//! hand-over all apply), then the same relay. The read cache of an
//! immutable export starts cold here: a handed-over session is relayed
//! uncached (its reads go to the upstream), as the cache's generation
//! check would need the upstream's incarnation, which is not carried.

use std::sync::Arc;
use std::time::Instant;

use tokio::net::{TcpStream, UnixStream};
use tracing::{info, Instrument};

use super::extract::Resumable;
use super::{register, transmit, Relaying};
use crate::admission::Admission;
use crate::config::Config;
use crate::conn::error::{ConnError, Side};
use crate::conn::kernel_tls::{KernelTls, TlsPeer};
use crate::conn::prefixed::Prefixed;
use crate::conn::session::{Audit, Link, Stats};
use crate::handover::sessions::take::Resumed;
use crate::logsafe::escape;
use crate::proto::handover_session::Offer;
use crate::shutdown::Shutdown;
use crate::tls::handover::{KernelState, ResumedTls, SessionTls};
use crate::tls::Grant;

/// Serves a session handed over, to its end, and logs how it ended.
pub async fn serve(
    resumed: Resumed,
    config: &Config,
    admission: &Arc<Admission>,
    shutdown: Shutdown,
    id: u64,
) {
    let peer = resumed.tcp.peer_addr().ok();
    let span = tracing::info_span!("conn", id, peer = ?peer, was = resumed.was);
    async move {
        let metrics = &config.metrics;
        metrics.connections_open.inc();
        let started = Instant::now();
        let stats = Stats::new(metrics.clone());
        stats.restore(resumed.counts);
        stats.opened(audit(&resumed));
        let mut cut = shutdown.clone();
        let link = Link {
            id,
            config,
            admission,
            shutdown,
            stats: &stats,
        };
        let result = tokio::select! {
            result = run(resumed, &link) => result,
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

fn audit(resumed: &Resumed) -> Audit {
    let (offer, judged) = (&resumed.offer, &resumed.judged);
    Audit {
        client: judged.identity.to_string(),
        export: escape(&offer.export).into_owned(),
        upstream_export: escape(&offer.upstream_export).into_owned(),
        upstream: escape(&String::from_utf8_lossy(&offer.upstream)).into_owned(),
        access: judged.access,
        rule: judged.rule.0.clone(),
        rule_line: judged.rule.1,
    }
}

async fn run(resumed: Resumed, link: &Link<'_>) -> Result<&'static str, ConnError> {
    let config = link.config;
    let Resumed {
        offer,
        judged,
        state,
        ahead,
        tcp,
        upstream,
        ..
    } = resumed;
    let anonymous = offer.chain.is_empty();
    let registered = (!anonymous).then(|| register_grant(&offer, &judged, link));
    // Reserved when the offer was accepted (`judge`): held to the end.
    let _slot = judged.slot;
    let io = |e: std::io::Error| ConnError::io(Side::Client, "at a hand-over")(e);
    tcp.set_nonblocking(true).map_err(io)?;
    upstream.set_nonblocking(true).map_err(io)?;
    let tcp = TcpStream::from_std(tcp).map_err(io)?;
    crate::conn::set_keepalive(&tcp, config.relay.keepalive, config.relay.stall_timeout);
    let socket = socket2::SockRef::from(&tcp).try_clone().ok();
    let upstream = UnixStream::from_std(upstream).map_err(io)?;
    let relaying = Relaying {
        mode: offer.mode,
        read_only: offer.read_only,
        cache: None,
        socket,
        registered: registered.as_ref(),
    };
    let handover = register(link, &offer);
    match state {
        SessionTls::Rustls(state) => {
            let stream: Resumable =
                ResumedTls::new(Prefixed::new(tcp, ahead), state, config.ktls_key_limit)
                    .map_err(|e| io(std::io::Error::other(e.to_string())))?;
            info!(tls = ?stream.layer().version(), "hand-over: serving a session handed over by the old gateway (no new TLS handshake)");
            transmit((stream, Vec::new()), upstream, relaying, handover, link).await
        }
        SessionTls::Kernel(state) => {
            let stream = kernel(tcp, state, &offer, config).map_err(io)?;
            info!(tls = "kernel", "hand-over: serving a session handed over by the old gateway (no new TLS handshake)");
            transmit((stream, Vec::new()), upstream, relaying, handover, link).await
        }
    }
}

/// The session in the TLS store's registry, with what it was granted
/// here: a reload that revokes its certificate, or narrows its access,
/// ends it as it would a session begun here.
fn register_grant(
    offer: &Offer,
    judged: &crate::handover::sessions::judge::Judged,
    link: &Link<'_>,
) -> crate::tls::SessionGuard {
    let config = link.config;
    let chain: Vec<_> = offer
        .chain
        .iter()
        .map(|c| rustls::pki_types::CertificateDer::from(c.clone()))
        .collect();
    let guard = config.tls.sessions().register(link.id, &chain);
    let grant = Grant {
        identity: judged.identity.clone(),
        export: offer.export.clone(),
        access: judged.access,
    };
    guard.granted(
        grant,
        config.policy_revoke_closes.then_some(&*config.policy),
    );
    guard
}

/// A kernel TLS session over its socket, which must carry a ULP (the
/// kernel's record layer): one without would give ciphertext as
/// plaintext, so it is refused.
fn kernel(
    tcp: TcpStream,
    state: KernelState,
    offer: &Offer,
    config: &Config,
) -> std::io::Result<KernelTls> {
    if !crate::tls::kernel::has_ulp(&tcp) {
        return Err(std::io::Error::other(
            "a kernel TLS session's socket has no TLS ULP",
        ));
    }
    let peer = TlsPeer {
        chain: offer.chain.clone(),
        sni: offer.sni.clone(),
        suite: offer.suite,
        group: offer.group,
    };
    let metrics = config.metrics.clone();
    KernelTls::resumed(tcp, state, peer, config.ktls_key_limit, metrics)
}
