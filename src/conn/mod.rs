//! One client connection: plaintext greeting, STARTTLS, the relayed
//! option haggling, then transmission. This module owns all the I/O;
//! `crate::proto` only parses.
//!
//! The phases, each handing the next what `session` describes:
//! `plain` (before TLS) → `negotiate` (options after TLS, through
//! `options`) → `relay` (transmission). `kernel_tls` may hand the session
//! from rustls to the kernel between the handshake and the options.

mod buffered;
pub(crate) mod error;
pub(crate) mod handover;
mod kernel_tls;
mod kernel_tls_state;
mod negotiate;
pub(crate) mod options;
pub(crate) mod plain;
pub(crate) mod prefixed;
pub(crate) mod relay;
pub(crate) mod relayed;
pub(crate) mod session;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tokio::net::TcpStream;
use tracing::{info, warn, Instrument};

use crate::admission::{Admission, HandshakePermit, Place, SessionPermit};
use crate::config::Config;
use crate::logsafe::escape;
use crate::shutdown::Shutdown;
use crate::tls::{Grant, SessionGuard};
use error::ConnError;
use error::Side;
use session::{Link, Stats, AUDIT, CLIENT_READ_BUF};

/// A connection the accept loop took, with its place in the handshake
/// budget (a slot, or a place in its source's line).
pub struct Accepted {
    pub tcp: TcpStream,
    pub peer: SocketAddr,
    pub id: u64,
    pub place: Place,
    /// The trusted balancer whose PROXY header gave `peer`, if any.
    pub balancer: Option<SocketAddr>,
}

/// Serves one accepted connection to its end and logs how it ended.
pub async fn serve(
    conn: Accepted,
    config: &Config,
    admission: &Arc<Admission>,
    shutdown: Shutdown,
) {
    let Accepted {
        tcp,
        peer,
        id,
        place,
        balancer,
    } = conn;
    let span = tracing::info_span!("conn", id, %peer, balancer = tracing::field::Empty);
    if let Some(balancer) = balancer {
        span.record("balancer", tracing::field::display(balancer));
    }
    async move {
        let metrics = &config.metrics;
        // One bound from accept to the session: waiting for a handshake
        // slot uses up the time negotiation has, down to a minimum.
        let deadline = place.deadline();
        let handshake = match admission.handshake(place).await {
            Ok(permit) => permit,
            Err(refusal) => {
                metrics.connection("refused");
                return admission.log_refusal(peer, refusal);
            }
        };
        let deadline = admission.session_deadline(deadline);
        info!("accepted");
        metrics.connections_open.inc();
        let started = Instant::now();
        let stats = Stats::new(metrics.clone());
        let mut cut = shutdown.clone();
        let link = Link {
            id,
            config,
            admission,
            shutdown,
            stats: &stats,
        };
        let result = tokio::select! {
            result = run(tcp, peer, (handshake, deadline), &link) => result,
            () = cut.cut() => Err(ConnError::GraceOver),
        };
        metrics.connections_open.dec();
        metrics.connection(match &result {
            Err(e) if !e.is_routine() => "error",
            _ => "closed",
        });
        let cut_during_shutdown = count_if_cut_by_upstream(&result, &stats, config);
        log_close(result, &stats, started, cut_during_shutdown);
    }
    .instrument(span)
    .await
}

/// Counts a session cut by its upstream during the shutdown for the
/// drain's one line (`server::run`), and says whether it was one.
fn count_if_cut_by_upstream(
    result: &Result<&'static str, ConnError>,
    stats: &Stats,
    config: &Config,
) -> bool {
    match (result, stats.audit()) {
        (Err(e), Some(a)) if e.is_upstream_gone() && config.health.is_draining() => {
            config.health.cut_by_upstream(&a.upstream);
            true
        }
        _ => false,
    }
}

/// The close line: for a session that entered transmission, the audit
/// trail's second line (target `nbdgw::audit`, with the open line's
/// names); for any other connection, a plain one. Exactly one of
/// `reason` (a normal end) and `error` (anything else) is given. A
/// session the shutdown's summary tells of keeps its audit level (an
/// interrupted session is one for audit consumers) and is marked
/// `cut_by_upstream_during_shutdown=true`.
pub(crate) fn log_close(
    result: Result<&'static str, ConnError>,
    stats: &Stats,
    at: Instant,
    cut_during_shutdown: bool,
) {
    let session::Counts {
        requests,
        replies,
        bytes_in,
        bytes_out,
    } = stats.counts();
    let secs = at.elapsed().as_secs_f64();
    let routine = result.as_ref().map_or_else(ConnError::is_routine, |_| true);
    let cut_by_upstream_during_shutdown = cut_during_shutdown.then_some(true);
    let (reason, error) = match &result {
        Ok(reason) => (Some(*reason), None),
        Err(error) => (None, Some(escape(&error.to_string()).into_owned())),
    };
    let error = error.as_deref().map(tracing::field::display);
    let Some(a) = stats.audit() else {
        return plain_close(routine, reason, error, stats.counts(), secs);
    };
    macro_rules! audit_close {
        ($level:ident) => {
            $level!(
                target: AUDIT,
                reason,
                error,
                requests,
                replies,
                bytes_in,
                bytes_out,
                secs,
                client = %a.client,
                export = %a.export,
                upstream_export = %a.upstream_export,
                upstream = %a.upstream,
                access = %a.access,
                rule = %a.rule,
                rule_line = a.rule_line,
                cut_by_upstream_during_shutdown,
                "closed"
            )
        };
    }
    if routine {
        audit_close!(info);
    } else {
        audit_close!(warn);
    }
}

/// The close line of a connection that never opened an export.
fn plain_close(
    routine: bool,
    reason: Option<&str>,
    error: Option<tracing::field::DisplayValue<&str>>,
    counts: session::Counts,
    secs: f64,
) {
    let session::Counts {
        requests,
        replies,
        bytes_in,
        bytes_out,
    } = counts;
    if routine {
        info!(
            reason,
            error, requests, replies, bytes_in, bytes_out, secs, "closed"
        );
    } else {
        warn!(
            reason,
            error, requests, replies, bytes_in, bytes_out, secs, "closed"
        );
    }
}

/// How negotiation ended, with what an established session holds.
enum Negotiated {
    Closed(&'static str),
    Transmission {
        session: Box<session::Session>,
        slot: SessionPermit,
        registered: Option<SessionGuard>,
        /// The client certificate's names, which prove its source.
        who: crate::admission::Identity,
    },
}

/// Returns why the connection ended normally, or what went wrong.
async fn run(
    tcp: TcpStream,
    peer: SocketAddr,
    (handshake_permit, deadline): (HandshakePermit, tokio::time::Instant),
    link: &Link<'_>,
) -> Result<&'static str, ConnError> {
    let config = link.config;
    // The TLS files and policy this connection is judged under: its
    // source is proven only if no reload came since (see `prove`).
    let generation = link.admission.generation();
    // Before the TLS handshake: in TLS 1.3 the client speaks last, and
    // Nagle would hold its first request behind our unacknowledged data.
    tcp.set_nodelay(true)
        .map_err(ConnError::io(error::Side::Client, "at accept"))?;
    set_liveness_checks(&tcp, config);
    // A second handle on the same socket, once the TLS stream is split
    // into halves: for TCP_CORK, and to see a drained connection's last
    // replies acknowledged before it closes.
    let socket_handle = socket2::SockRef::from(&tcp).try_clone().ok();
    let io = buffered::Buffered::new(CLIENT_READ_BUF, tcp);
    let negotiated = tokio::time::timeout_at(deadline, negotiate(io, handshake_permit, link))
        .await
        .map_err(|_| ConnError::HandshakeTimeout(config.handshake_timeout))??;
    match negotiated {
        Negotiated::Closed(reason) => Ok(reason),
        Negotiated::Transmission {
            session,
            slot: _slot,
            registered,
            who,
        } => {
            // Its certificate was given a session and an export: the
            // source has proven itself; again when the session ends, so
            // a host whose VMs stay connected for days stays proven. Both
            // only under the TLS files and policy the connection started
            // under: a reload since may have revoked what let it in.
            link.admission.prove(peer, &who, generation);
            let ended = transmit(*session, socket_handle, registered.as_ref(), link).await;
            // Never after a reload ended it (its certificate revoked, its
            // access narrowed); `prove` also checks the generation.
            if !matches!(ended, Err(ConnError::Revoked | ConnError::PolicyNarrowed)) {
                link.admission.prove(peer, &who, generation);
            }
            ended
        }
    }
}

/// Transmission: the relay between the client's TLS stream and the
/// upstream, with the read cache's settings for a cached export.
async fn transmit(
    session: session::Session,
    socket_handle: Option<socket2::Socket>,
    registered: Option<&SessionGuard>,
    link: &Link<'_>,
) -> Result<&'static str, ConnError> {
    let config = link.config;
    let session = match handable(session, link) {
        Ok(h) => {
            let relaying = handover::Relaying {
                mode: h.mode,
                read_only: h.read_only,
                cache: cache_of(h.cache, config),
                socket: socket_handle,
                registered,
            };
            let registered = Some(h.registered);
            return handover::transmit((h.tls, Vec::new()), h.upstream, relaying, registered, link)
                .await;
        }
        Err(session) => session,
    };
    let session::Session {
        tls,
        upstream,
        mode,
        read_only,
        cache,
        ..
    } = *session;
    let ends = relay::Ends {
        client: tokio::io::split(tls),
        upstream: upstream.into_split(),
        mode,
        read_only,
        cache: cache_of(cache, config),
    };
    relay::run(ends, socket_handle, &link.transmit(), registered).await
}

fn cache_of(cache: Option<crate::cache::Handle>, config: &Config) -> Option<relay::Cached> {
    cache.map(|handle| relay::Cached {
        handle,
        read_ahead: config.read_cache.read_ahead,
        depth: config.read_cache.read_ahead_depth,
        fills: config.read_cache.cache_fill_depth,
    })
}

/// A session a successor may take, registered for it.
struct Handable {
    tls: session::ClientStream,
    upstream: tokio::net::UnixStream,
    mode: crate::proto::transmission::ReplyMode,
    read_only: bool,
    cache: Option<crate::cache::Handle>,
    registered: crate::handing::Registered,
}

/// A session a successor may take, with `--handover-socket`: in rustls
/// read through a record tail, or record by record where kernel TLS is
/// on (`RecordAligned`); or in the kernel's record layer.
fn handable(session: session::Session, link: &Link<'_>) -> Result<Handable, Box<session::Session>> {
    use tokio_util::either::Either;
    let may = match &session.tls {
        Either::Left(tls) => match tls.get_ref().0 {
            Either::Left(tail) => tail.is_on(),
            Either::Right(aligned) => aligned.is_handable(),
        },
        Either::Right(_) => true,
    };
    let offer = match may {
        true => handover::offer(&session.tls, &session, link.config.relay.max_payload),
        false => None,
    };
    let Some(registered) = offer.and_then(|offer| handover::register(link, &offer)) else {
        return Err(Box::new(session));
    };
    let session::Session {
        tls,
        upstream,
        mode,
        read_only,
        cache,
        ..
    } = session;
    Ok(Handable {
        tls,
        upstream,
        mode,
        read_only,
        cache,
        registered,
    })
}

/// Everything before transmission: plaintext, TLS, a session slot once
/// authenticated, then the options.
async fn negotiate(
    io: session::ClientIo,
    handshake_permit: HandshakePermit,
    link: &Link<'_>,
) -> Result<Negotiated, ConnError> {
    let config = link.config;
    let (io, client_flags) = match plain::negotiate(io, config, &link.shutdown).await? {
        plain::Outcome::StartTls(io, flags) => (io, flags),
        plain::Outcome::Closed(reason) => return Ok(Negotiated::Closed(reason)),
    };
    let tls = plain::accept_tls(io, config).await?;
    log_tls(tls.get_ref().1, error::Side::Client, &config.metrics);
    let chain = tls.get_ref().1.peer_certificates().unwrap_or_default();
    // Anonymous clients (no client CA) have no names: a policy with rules
    // opens nothing to them.
    let identity = chain
        .first()
        .and_then(|leaf| crate::tls::CertInfo::from_der(leaf).ok())
        .unwrap_or_default();
    let anonymous = chain.is_empty();
    let registered = (!anonymous).then(|| config.tls.sessions().register(link.id, chain));
    let tls = kernel_tls::hand_over(tls, config).await?;
    // Authenticated: from here on the connection holds a session slot,
    // not a handshake slot.
    let who = crate::admission::Identity::of((!anonymous).then_some(&identity));
    let slot = match link.admission.session(who.clone()) {
        Ok(slot) => slot,
        Err(refusal) => {
            let client = match anonymous {
                true => "no certificate".to_string(),
                false => identity.to_string(),
            };
            return refuse_session(tls, refusal, &client, config).await;
        }
    };
    drop(handshake_permit);
    let relayed =
        negotiate::relay_options(tls, client_flags, identity.clone(), config, &link.shutdown)
            .await?;
    Ok(match relayed {
        negotiate::Outcome::Closed(reason) => Negotiated::Closed(reason),
        negotiate::Outcome::Transmission(session, audit) => {
            link.stats.opened(*audit);
            if let Some(guard) = &registered {
                record_grant(guard, identity, &session, config);
            }
            Negotiated::Transmission {
                session,
                slot,
                registered,
                who,
            }
        }
    })
}

/// Tells the TLS store's registry what the session was granted, so that
/// a reload revoking the certificate, or a policy reload narrowing its
/// access (with `--policy-revoke-closes`), can end it.
fn record_grant(
    guard: &SessionGuard,
    identity: crate::tls::CertInfo,
    session: &session::Session,
    config: &Config,
) {
    let grant = Grant {
        identity,
        export: session.export.clone(),
        access: session.access,
    };
    guard.granted(
        grant,
        config.policy_revoke_closes.then_some(&*config.policy),
    );
}

/// An authenticated client refused a session (`--max-connections`,
/// `--max-sessions-per-identity`): every option it sends is answered with
/// why, so that it hears the reason rather than a bare close.
async fn refuse_session(
    tls: session::ClientStream,
    refusal: crate::admission::Refusal,
    client: &str,
    config: &Config,
) -> Result<Negotiated, ConnError> {
    config.metrics.session_refused(refusal.metric_reason());
    warn!(reason = %refusal, %client, "session refused");
    let message = format!("nbdgw: {refusal}; try again later");
    let client = options::OptionChannel::new(tls, error::Side::Client, config.relay.max_option_len);
    negotiate::refuse_all(client, &message)
        .await
        .map(Negotiated::Closed)
}

/// The line that says a TLS session is up, in either direction: its
/// parameters and the peer's certificate, `client=` for a client of the
/// server mode, `server=` for the server client mode reached; and the
/// key exchange group counted in the metrics.
pub(crate) fn log_tls(state: &rustls::CommonState, peer: Side, metrics: &crate::metrics::Metrics) {
    let group = state.negotiated_key_exchange_group().map(|g| g.name());
    metrics.tls_established(group);
    let certificate = match state.peer_certificates().and_then(|chain| chain.first()) {
        Some(cert) => crate::identity::describe(cert),
        None => "no certificate".to_string(),
    };
    let shown = Some(tracing::field::display(&certificate));
    let (client, server) = match peer {
        Side::Client => (shown, None),
        Side::Upstream => (None, shown),
    };
    info!(
        tls_version = ?state.protocol_version(),
        cipher_suite = ?state.negotiated_cipher_suite().map(|s| s.suite()),
        key_exchange = %crate::tls::groups::name(group),
        client,
        server,
        "TLS established"
    );
}

/// Keepalive notices a client that vanished without a FIN or RST while
/// idle; TCP_USER_TIMEOUT one that vanished with our data unacknowledged.
fn set_liveness_checks(tcp: &TcpStream, config: &Config) {
    set_keepalive(tcp, config.relay.keepalive, config.relay.stall_timeout);
}

/// The liveness checks of either direction's TCP peer: keepalive, and the
/// stall timeout as TCP_USER_TIMEOUT.
pub(crate) fn set_keepalive(
    tcp: &TcpStream,
    keepalive: Option<crate::config::Keepalive>,
    stall_timeout: Option<std::time::Duration>,
) {
    let socket = socket2::SockRef::from(tcp);
    if let Some(keepalive) = keepalive {
        let params = socket2::TcpKeepalive::new()
            .with_time(keepalive.idle)
            .with_interval(keepalive.interval)
            .with_retries(keepalive.count);
        if let Err(e) = socket.set_tcp_keepalive(&params) {
            warn!(error = %e, "cannot set TCP keepalive");
        }
    }
    if let Some(stall) = stall_timeout {
        if let Err(e) = socket.set_tcp_user_timeout(Some(stall)) {
            warn!(error = %e, "cannot set TCP_USER_TIMEOUT");
        }
    }
}
