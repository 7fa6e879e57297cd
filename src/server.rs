//! The accept loop: admission, one task per connection, graceful
//! shutdown.

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tracing::{info, warn};

use crate::admission::Admission;
use crate::config::Config;
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
                        crate::listeners::accept_failed(e).await;
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
    crate::shutdown::shut_down(connections, &control, config.shutdown_grace).await;
    tell_cut_by_upstream(&config.health);
    info!("stopped");
    Ok(())
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
