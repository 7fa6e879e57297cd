//! The accept loop: admission, one task per connection, graceful
//! shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tracing::{error, info, warn};

use crate::admission::Admission;
use crate::config::Config;
use crate::shutdown::{Phase, ShutdownControl};

/// How long connections get to log their end and leave once the grace
/// period is over and they have been told to stop.
const CUT_WAIT: Duration = Duration::from_secs(1);

/// Serves clients on an already-bound listener until `shutdown` resolves,
/// then stops accepting, lets connections finish what is in flight, and
/// after `shutdown_grace` cuts the ones still open.
pub async fn run(
    listener: TcpListener,
    config: Arc<Config>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let admission = Admission::new(&config);
    let mut connections = JoinSet::new();
    let mut next_id: u64 = 0;
    let (control, phase) = ShutdownControl::answering(config.drain_answer);
    let mut shutdown = std::pin::pin!(shutdown);
    // From SIGTERM until then nbdgw is not ready but still accepts, so
    // load balancers can stop sending clients first (--drain-delay).
    let mut stop_accepting_at: Option<tokio::time::Instant> = None;
    config.health.set_accepting(true);
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
                        accept_failed(e).await;
                        continue;
                    }
                };
                let place = match admission.arrive(peer) {
                    Ok(place) => place,
                    Err(refusal) => {
                        config.metrics.connection("refused");
                        admission.log_refusal(peer, refusal);
                        continue;
                    }
                };
                next_id += 1;
                let conn = crate::conn::Accepted { tcp, peer, id: next_id, place };
                let (config, admission, phase) = (config.clone(), admission.clone(), phase.clone());
                connections.spawn(async move {
                    crate::conn::serve(conn, &config, &admission, phase).await;
                });
            }
        }
    }
    drop(listener);
    config.health.set_accepting(false);
    admission.close_waiters();
    shut_down(connections, &control, config.shutdown_grace).await;
    tell_cut_by_upstream(&config.health);
    info!("stopped");
    Ok(())
}

/// Out of descriptors or similar, in either mode's accept loop: keep
/// serving the connections there are, and try again shortly.
pub(crate) async fn accept_failed(e: std::io::Error) {
    error!(error = %e, "accept failed");
    tokio::time::sleep(Duration::from_millis(100)).await;
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

/// Draining, then after the grace period the cut, each announced to the
/// connections, which end themselves and log it.
pub(crate) async fn shut_down(
    mut connections: JoinSet<()>,
    control: &ShutdownControl,
    grace: Duration,
) {
    control.enter(Phase::Draining);
    info!(
        open = connections.len(),
        grace_secs = grace.as_secs(),
        "shutting down: no longer accepting; idle connections close now, requests in flight finish"
    );
    if tokio::time::timeout(grace, drain(&mut connections))
        .await
        .is_err()
    {
        warn!(
            open = connections.len(),
            "grace period over: cutting the remaining connections"
        );
        control.enter(Phase::Cut);
        if tokio::time::timeout(CUT_WAIT, drain(&mut connections))
            .await
            .is_err()
        {
            connections.shutdown().await;
        }
    }
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

async fn drain(connections: &mut JoinSet<()>) {
    while connections.join_next().await.is_some() {}
}
