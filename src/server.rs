//! The accept loop: admission, one task per connection, graceful
//! shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::admission::Admission;
use crate::config::Config;
use crate::logsafe::escape;
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
    let admission = Admission::new(&config);
    let pre_header = pre_header_bound(&config);
    let mut connections = JoinSet::new();
    let mut next_id: u64 = 0;
    let (control, phase) = ShutdownControl::answering(config.drain_answer);
    let mut shutdown = std::pin::pin!(shutdown);
    // From SIGTERM until then nbdgw is not ready but still accepts, so
    // load balancers can stop sending clients first (--drain-delay).
    let mut stop_accepting_at: Option<tokio::time::Instant> = None;
    config.health.set_accepting(true);
    announce_balancers(&config);
    loop {
        tokio::select! {
            _ = &mut shutdown, if stop_accepting_at.is_none() => match drain_deadline(&config) {
                Some(at) => stop_accepting_at = Some(at),
                None => break,
            },
            _ = tokio::time::sleep_until(stop_accepting_at.unwrap_or_else(tokio::time::Instant::now)),
                if stop_accepting_at.is_some() => break,
            // Reap finished connections so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => {
                let (tcp, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        crate::listeners::accept_failed(e).await;
                        continue;
                    }
                };
                next_id += 1;
                let arrived = Arrived { tcp, peer, id: next_id, at: tokio::time::Instant::now() };
                let shared = (config.clone(), admission.clone(), phase.clone());
                if config.proxy_protocol.trusts(peer.ip()) {
                    if let Some(task) = behind_balancer(arrived, shared, &pre_header) {
                        connections.spawn(task);
                    }
                } else if let Some(conn) = admit(arrived, None, &shared.1, &config) {
                    connections.spawn(serve(conn, shared));
                }
            }
        }
    }
    drop(listener);
    config.health.set_accepting(false);
    admission.close_waiters();
    crate::shutdown::shut_down(connections, &control, config.shutdown_grace).await;
    tell_cut_by_upstream(&config.health);
    info!("stopped");
    Ok(())
}

/// Connections from trusted balancers before their PROXY header: at most
/// what admission holds unauthenticated (see `crate::proxy`).
fn pre_header_bound(config: &Config) -> Arc<Semaphore> {
    Arc::new(Semaphore::new(
        config
            .max_handshakes
            .saturating_add(config.handshake_queue)
            .min(Semaphore::MAX_PERMITS),
    ))
}

/// The trusted balancers, once at start: who must send a header.
fn announce_balancers(config: &Config) {
    if !config.proxy_protocol.from.is_empty() {
        let from: Vec<String> = config
            .proxy_protocol
            .from
            .iter()
            .map(ToString::to_string)
            .collect();
        info!(from = %from.join(","), "a PROXY protocol header is required from these balancers, and read from no one else");
    }
}

/// A connection just accepted, before admission.
struct Arrived {
    tcp: TcpStream,
    peer: SocketAddr,
    id: u64,
    at: tokio::time::Instant,
}

type Shared = (Arc<Config>, Arc<Admission>, Shutdown);

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

async fn serve(conn: crate::conn::Accepted, (config, admission, phase): Shared) {
    crate::conn::serve(conn, &config, &admission, phase).await;
}

/// A connection from a trusted balancer: its PROXY header is read first
/// (within `--handshake-timeout` of accept, and while fewer than the
/// bound are at it), then it is admitted as the source the header names.
fn behind_balancer(
    arrived: Arrived,
    shared: Shared,
    pre_header: &Arc<Semaphore>,
) -> Option<impl Future<Output = ()>> {
    let metrics = &shared.0.metrics;
    let Ok(permit) = pre_header.clone().try_acquire_owned() else {
        metrics.proxy_header("busy");
        metrics.connection("refused");
        debug!(balancer = %arrived.peer, "closed before its PROXY header: --max-handshakes plus --handshake-queue connections from balancers are already waiting for theirs");
        return None;
    };
    Some(async move {
        let (config, admission, mut phase) = shared;
        let mut arrived = arrived;
        let balancer = arrived.peer;
        let deadline = arrived.at + config.handshake_timeout;
        let read =
            crate::proxy::read_header(&mut arrived.tcp, balancer, config.proxy_protocol.max_header);
        let outcome = tokio::select! {
            read = tokio::time::timeout_at(deadline, read) => read.map_err(|_| "timeout"),
            () = phase.draining() => Err("shutting_down"),
        };
        drop(permit);
        let carried = match outcome {
            Ok(Ok(carried)) => carried,
            Ok(Err(e)) => return header_refused(&config, balancer, e.metric_outcome(), &e),
            Err(why) => return header_refused(&config, balancer, why, &why),
        };
        config.metrics.proxy_header(carried.outcome);
        arrived.peer = carried.peer;
        if let Some(conn) = admit(arrived, Some(balancer), &admission, &config) {
            serve(conn, (config, admission, phase)).await;
        }
    })
}

/// A trusted balancer's connection closed for its header: counted, and
/// said in a line (only a trusted peer can cause it, so one per
/// connection is no flood).
fn header_refused(
    config: &Config,
    balancer: SocketAddr,
    outcome: &'static str,
    why: &dyn std::fmt::Display,
) {
    config.metrics.proxy_header(outcome);
    config.metrics.connection("refused");
    let reason = match outcome {
        "timeout" => format!(
            "no PROXY header within --handshake-timeout ({}s)",
            config.handshake_timeout.as_secs()
        ),
        _ => why.to_string(),
    };
    warn!(%balancer, outcome, reason = %escape(&reason), "connection from a --proxy-protocol-from balancer refused: it must start with a valid PROXY protocol header");
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

/// Once, however many sessions it cut: an upstream that went away during
/// the shutdown (a pod's or a unit's NBD server stopped before nbdgw
/// finished draining). Each session's close line is at info then.
fn tell_cut_by_upstream(health: &crate::metrics::Health) {
    for (upstream, sessions) in health.take_cut_by_upstream() {
        warn!(
            %upstream,
            sessions,
            "the upstream went away during the shutdown: {sessions} session(s) cut with it; stop the NBD server after nbdgw (see README, Stop order)"
        );
    }
}
