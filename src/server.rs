//! The accept loop: admission, one task per connection, graceful
//! shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tracing::{info, warn};

use crate::admission::Admission;
use crate::config::Config;
use crate::handover::gate::{Accepting, Gate};
use crate::shutdown::Shutdown;
use crate::shutdown::ShutdownControl;

/// Serves clients on an already-bound listener until `shutdown` resolves,
/// then stops accepting, lets connections finish what is in flight, and
/// after `shutdown_grace` cuts the ones still open.
pub async fn run(
    listener: TcpListener,
    config: Arc<Config>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    run_gated(listener, config, shutdown, Gate::always()).await
}

/// `run`, with accepting paused while a successor takes the listener
/// over, and ended, then the drain as at SIGTERM, once it serves
/// (`crate::handover`).
pub async fn run_gated(
    listener: TcpListener,
    config: Arc<Config>,
    shutdown: impl Future<Output = ()>,
    gate: Gate,
) -> std::io::Result<()> {
    let (_none, resumed) = mpsc::channel(1);
    let admission = Admission::new(&config);
    run_resuming(listener, (config, admission), shutdown, gate, resumed).await
}

/// `run_gated`, also serving the sessions a predecessor hands over
/// (`resumed`, `crate::handover`), as its own connections: drained and
/// cut alike. The admission is shared with the session take-over, which
/// reserves a handed-over session's slot when it accepts the offer.
pub async fn run_resuming(
    listener: TcpListener,
    (config, admission): (Arc<Config>, Arc<Admission>),
    shutdown: impl Future<Output = ()>,
    mut gate: Gate,
    mut resumed: mpsc::Receiver<crate::handover::sessions::take::Resumed>,
) -> std::io::Result<()> {
    let pre_header = crate::balancer::pending::Pending::new(config.proxy_protocol.pending);
    let (control, phase) = ShutdownControl::answering(config.drain_answer);
    let (mut connections, mut next_id) = restored(&mut resumed, (&config, &admission, &phase));
    let mut shutdown = std::pin::pin!(shutdown);
    // From SIGTERM until then nbdgw is not ready but still accepts, so
    // load balancers can stop sending clients first (--drain-delay).
    let mut stop_accepting_at: Option<tokio::time::Instant> = None;
    config.health.set_accepting(true);
    config.proxy_protocol.announce();
    loop {
        tokio::select! {
            _ = &mut shutdown, if stop_accepting_at.is_none() => match drain_deadline(&config) {
                Some(at) => stop_accepting_at = Some(at),
                None => break,
            },
            _ = tokio::time::sleep_until(stop_accepting_at.unwrap_or_else(tokio::time::Instant::now)),
                if stop_accepting_at.is_some() => break,
            // The successor accepts now: drain, with no delay to wait.
            state = gate.changed() => if state == Accepting::HandedOver { control.handed_over(); break },
            Some(session) = resumed.recv() => { next_id += 1; connections.spawn(serve_resumed(session, Shared { config: config.clone(), admission: admission.clone(), phase: phase.clone() }, next_id)); }
            // Reap finished connections so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept(), if gate.accepting() => {
                let (tcp, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        crate::listeners::accept_failed(e).await;
                        continue;
                    }
                };
                next_id += 1;
                let arrived = Arrived { tcp, peer, id: next_id, at: tokio::time::Instant::now() };
                let shared = Shared { config: config.clone(), admission: admission.clone(), phase: phase.clone() };
                if config.proxy_protocol.trusts(peer.ip()) {
                    if let Some(task) = behind_balancer(arrived, shared, &pre_header) {
                        connections.spawn(task);
                    }
                } else if let Some(conn) = admit(arrived, None, &shared.admission, &config) {
                    connections.spawn(serve(conn, shared));
                }
            }
        }
    }
    drop(listener);
    config.health.set_accepting(false);
    admission.close_waiters();
    crate::shutdown::shut_down(connections, &control, drain_grace(&config)).await;
    tell_cut_by_upstream(&config.health);
    info!("stopped");
    Ok(())
}

/// --shutdown-grace, shortened to the quiesce timeout once sessions wait
/// in systemd's store for this process to exit (`Registry::drain_bound`).
fn drain_grace(config: &Config) -> std::time::Duration {
    let grace = config.shutdown_grace;
    let bound = config
        .handover
        .as_ref()
        .map_or(grace, |r| r.drain_bound(grace));
    if bound < grace && !config.shutdown_grace.is_zero() {
        info!(
            bound_secs = bound.as_secs_f64(),
            "restart: sessions wait in systemd's store until this process exits: the rest drain for at most the quiesce timeout, then are closed (a request not answered by then was never acknowledged)"
        );
    }
    bound
}

/// A connection just accepted, before admission.
struct Arrived {
    tcp: TcpStream,
    peer: SocketAddr,
    id: u64,
    at: tokio::time::Instant,
}

/// What every connection's task holds.
struct Shared {
    config: Arc<Config>,
    admission: Arc<Admission>,
    phase: Shutdown,
}

/// Admission for a connection whose source is known: a place, or the
/// refusal counted and logged. `balancer`: the trusted balancer whose
/// header named `arrived.peer`.
fn admit(
    arrived: Arrived,
    balancer: Option<SocketAddr>,
    admission: &Arc<Admission>,
    config: &Config,
) -> Option<crate::conn::Accepted> {
    let Arrived { tcp, peer, id, at } = arrived;
    match admission.arrive_since(peer, at) {
        Ok(place) => Some(crate::conn::Accepted {
            tcp,
            peer,
            id,
            place,
            balancer,
        }),
        Err(refusal) => {
            config.metrics.connection("refused");
            admission.log_refusal(peer, refusal);
            None
        }
    }
}

/// Starts the sessions already waiting in `resumed` (restored from
/// systemd's store before the accept loop), before anything else: a stop
/// signal already received must find them registered
/// (`Registry::arriving`), not waiting in the channel. With the last id
/// used.
fn restored(
    resumed: &mut mpsc::Receiver<crate::handover::sessions::take::Resumed>,
    (config, admission, phase): (&Arc<Config>, &Arc<Admission>, &Shutdown),
) -> (JoinSet<()>, u64) {
    let (mut connections, mut id) = (JoinSet::new(), 0);
    while let Ok(session) = resumed.try_recv() {
        id += 1;
        let shared = Shared {
            config: config.clone(),
            admission: admission.clone(),
            phase: phase.clone(),
        };
        connections.spawn(serve_resumed(session, shared, id));
    }
    (connections, id)
}

/// A session handed over (the channel) or restored (systemd's store).
/// Marked arriving before the task starts (a stop waits for it to
/// register), until it registers or ends.
fn serve_resumed(
    session: crate::handover::sessions::take::Resumed,
    shared: Shared,
    id: u64,
) -> impl Future<Output = ()> {
    let arriving = shared.config.handover.as_ref().map(|r| r.arriving(id));
    async move {
        run_resumed(session, shared, id).await;
        drop(arriving);
    }
}

async fn run_resumed(session: crate::handover::sessions::take::Resumed, shared: Shared, id: u64) {
    let Shared {
        config,
        admission,
        phase,
    } = shared;
    crate::conn::handover::resume::serve(session, &config, &admission, phase, id).await;
}

async fn serve(conn: crate::conn::Accepted, shared: Shared) {
    crate::conn::serve(conn, &shared.config, &shared.admission, shared.phase).await;
}

/// A connection from a trusted balancer: its PROXY header is read first
/// (within `--handshake-timeout` of accept, and while it holds a place
/// of the bound, see `crate::balancer::pending`), then it is admitted as the
/// source the header names.
fn behind_balancer(
    arrived: Arrived,
    shared: Shared,
    pre_header: &Arc<crate::balancer::pending::Pending>,
) -> Option<impl Future<Output = ()>> {
    let Some(mut place) = pre_header.take(arrived.peer.ip()) else {
        pre_header.refused(&shared.config.metrics, arrived.peer.ip(), false);
        return None;
    };
    let pre_header = pre_header.clone();
    Some(async move {
        use crate::balancer::PreHeaderEnd;
        let Shared {
            config,
            admission,
            mut phase,
        } = shared;
        let mut arrived = arrived;
        let balancer = arrived.peer;
        let trusted = &config.proxy_protocol;
        let limit = trusted.header_timeout.min(config.handshake_timeout);
        let deadline = arrived.at + limit;
        let read = crate::balancer::read_header(&mut arrived.tcp, balancer, trusted.max_header);
        let outcome = tokio::select! {
            read = tokio::time::timeout_at(deadline, read) => match read {
                Ok(Ok(c)) if c.outcome == "local" && !trusted.serve_local => Err(PreHeaderEnd::Local),
                Ok(read) => read.map_err(PreHeaderEnd::Header),
                Err(_) => Err(PreHeaderEnd::Timeout(limit)),
            },
            () = phase.draining() => Err(PreHeaderEnd::ShuttingDown),
            () = place.shed() => return pre_header.refused(&config.metrics, balancer.ip(), true),
        };
        drop(place);
        let carried = match outcome {
            Ok(carried) => carried,
            Err(end) => return end.log(&config.metrics, balancer),
        };
        config.metrics.proxy_header(carried.outcome);
        arrived.peer = carried.peer;
        if let Some(conn) = admit(arrived, Some(balancer), &admission, &config) {
            serve(
                conn,
                Shared {
                    config,
                    admission,
                    phase,
                },
            )
            .await;
        }
    })
}

/// SIGTERM: not ready from now on; accepting goes on until the returned
/// time, if there is a drain delay.
fn drain_deadline(config: &Config) -> Option<tokio::time::Instant> {
    config.health.set_draining();
    if config.drain_delay.is_zero() {
        return None;
    }
    info!(
        drain_delay_secs = config.drain_delay.as_secs_f64(),
        "shutting down: not ready, still accepting for the drain delay"
    );
    Some(tokio::time::Instant::now() + config.drain_delay)
}

/// Once, however many sessions it cut or connections it refused: an
/// upstream that went away during the shutdown (a pod's or a unit's NBD
/// server stopped before nbdgw finished draining). Each of them is
/// logged at info, or marked in its audit close line.
fn tell_cut_by_upstream(health: &crate::metrics::Health) {
    for (upstream, gone) in health.take_cut_by_upstream() {
        let (sessions, refused) = (gone.cut, gone.refused);
        warn!(
            %upstream,
            sessions,
            refused,
            "the upstream went away during the shutdown: {sessions} session(s) cut with it, {refused} connection(s) refused; stop the NBD server after nbdgw (see docs/guides/systemd.md, Stop order)"
        );
    }
}
