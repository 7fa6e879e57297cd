//! The accept loop: connection limit, one task per connection, graceful
//! shutdown.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::{error, info, warn};

use crate::config::Config;

/// Serves clients on an already-bound listener until `shutdown` resolves,
/// then stops accepting and gives open connections `shutdown_grace` to
/// finish before they are cut.
pub async fn run(
    listener: TcpListener,
    config: Arc<Config>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(config.max_connections));
    let mut connections = JoinSet::new();
    let mut next_id: u64 = 0;
    let shutting_down = Arc::new(AtomicBool::new(false));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            // Reap finished connections so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => {
                let (tcp, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors or similar: keep serving the
                        // connections we have and try again shortly.
                        error!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    warn!(%peer, limit = config.max_connections, "refused: --max-connections reached");
                    drop(tcp);
                    continue;
                };
                next_id += 1;
                let id = next_id;
                let config = config.clone();
                let shutting_down = shutting_down.clone();
                connections.spawn(async move {
                    crate::conn::serve(tcp, peer, id, &config, &shutting_down).await;
                    drop(slot);
                });
            }
        }
    }
    drop(listener);
    // Connections still negotiating are told so; those in transmission
    // finish their work.
    shutting_down.store(true, Ordering::Relaxed);
    let open = connections.len();
    info!(
        open,
        grace_secs = config.shutdown_grace.as_secs(),
        "shutting down: no longer accepting"
    );
    let drained = tokio::time::timeout(config.shutdown_grace, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        warn!(
            open = connections.len(),
            "grace period over: closing the remaining connections"
        );
        connections.shutdown().await;
    }
    info!("stopped");
    Ok(())
}
