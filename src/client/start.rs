//! `nbdgw client`'s run: the files read and the settings fixed before
//! any socket is touched (`super::settings`), then the local listener
//! served until a stop signal.

use std::sync::Arc;

use anyhow::{Context, Result};
use sd_notify::NotifyState;
use tracing::info;

use super::settings::Started;
use super::LocalListener;
use crate::cli::ClientArgs;
use crate::setup::process::{
    async_listener, display_addr, init_logging, notify, runtime, stopping,
};

/// `nbdgw client`: start, and serve until a stop signal.
pub fn start(args: ClientArgs) -> Result<()> {
    init_logging(args.process.log_format);
    let Started {
        settings,
        paths,
        reloader,
    } = super::settings::build(&args)?;
    let admin = args
        .admin
        .admin_listen
        .map(|addr| {
            std::net::TcpListener::bind(addr).with_context(|| format!("--admin-listen {addr}"))
        })
        .transpose()?;
    let runtime = runtime(args.process.worker_threads())?;
    runtime.block_on(async move {
        let listener = LocalListener::bind(&args.listen)?;
        tokio::spawn(reloader.watch(args.tls.protocol.reload_interval()));
        if let Some(admin) = admin {
            let admin = async_listener(admin)?;
            info!(target: "nbdgw", admin = %display_addr(&admin), "admin endpoints: /healthz /readyz /server /metrics");
            let limits = crate::admin::AdminLimits::default();
            let (metrics, health) = (settings.metrics.clone(), settings.health.clone());
            tokio::spawn(crate::admin::serve(admin, metrics, health, limits));
        }
        super::log_start(
            &listener,
            &settings,
            paths.layout.unwrap_or("files"),
            &args.tls.protocol.tls_groups,
        );
        notify(&[NotifyState::Ready]);
        let drain_answer = args.shutdown.drain_answer;
        super::run(listener, Arc::new(settings), (stopping(), drain_answer)).await?;
        Ok(())
    })
}
