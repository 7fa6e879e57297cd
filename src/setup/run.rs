//! The server mode run: configured (`super::configure`), sandboxed, then
//! served on the runtime until a stop signal.

use std::sync::Arc;

use anyhow::{Context, Result};
use sd_notify::NotifyState;
use tokio::net::TcpListener;
use tracing::info;

use super::process::{async_listener, display_addr, init_logging, notify, runtime, stopping};
use super::{sandbox, Setup};
use crate::admin::AdminLimits;
use crate::cli::ServeArgs;
use crate::config::Config;
use crate::confinement::LandlockMode;
use crate::listeners::Listeners;

/// `nbdgw` without a subcommand.
pub fn serve(args: ServeArgs) -> Result<()> {
    init_logging(args.process.log_format);
    let Setup {
        reloader,
        policy,
        config,
        admin_limits,
    } = super::configure(&args)?;
    let reload_interval = args.tls.protocol.reload_interval();
    let listeners = Listeners::open(args.listen, args.admin.listen.admin_listen)?;
    // Counted before the sandbox hides /sys and /proc from the runtime.
    let threads = args.process.worker_threads();
    match args.sandbox.landlock {
        LandlockMode::Off => {
            info!(target: "nbdgw", "--landlock false: the process is not sandboxed")
        }
        mode => sandbox::apply(mode, &reloader, policy.as_ref(), &config, &args)?,
    }

    let runtime = runtime(threads)?;
    runtime.block_on(async move {
        tokio::spawn(reloader.watch(reload_interval));
        if let Some(policy) = policy {
            tokio::spawn(policy.watch(reload_interval));
        }
        sandbox::debug_probe::after_start();
        if let Some(admin) = listeners.admin {
            start_admin(async_listener(admin)?, &config, admin_limits);
        }
        let listener = async_listener(listeners.nbd)?;
        // Target "nbdgw", as when main.rs logged these: operators filter on it.
        info!(
            target: "nbdgw",
            listen = %display_addr(&listener),
            from_systemd = listeners.from_systemd,
            upstream = %config.upstream.display(),
            exports = config.exports.is_some(),
            cork = ?config.cork,
            "nbdgw listening"
        );
        notify(&[NotifyState::Ready]);
        // The accept loop runs on a worker, not on this thread (which
        // only waits): each accepted connection's task then starts on the
        // worker that accepted it, instead of one thread waking another
        // for every connection (bench/RESULTS.md, handshake CPU).
        tokio::spawn(crate::run(listener, Arc::new(config), stopping()))
            .await
            .context("the accept loop")??;
        Ok(())
    })
}

fn start_admin(listener: TcpListener, config: &Config, limits: AdminLimits) {
    info!(target: "nbdgw", admin = %display_addr(&listener), "admin endpoints: /healthz /readyz /metrics");
    let (metrics, health) = (config.metrics.clone(), config.health.clone());
    // With named exports each has its own server; one being down does
    // not make the gateway unready.
    if config.exports.is_none() {
        let upstream = config.upstream.clone();
        tokio::spawn(crate::admin::watch_upstream(upstream, health.clone()));
    }
    tokio::spawn(crate::admin::serve(listener, metrics, health, limits));
}
