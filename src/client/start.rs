//! `nbdgw client`'s run: the files read and the settings fixed before
//! any socket is touched (`super::settings`), the listeners taken over
//! from a running client (`--take-over`) or bound, then the local
//! listener served until a stop signal or a successor takes it
//! (`--handover-socket`, `super::handover`).

use std::sync::Arc;

use anyhow::{Context, Result};
use sd_notify::NotifyState;
use tokio::sync::{mpsc, oneshot};
use tracing::info;

use super::handover::open::{self, Inherited};
use super::handover::taker::{ClientTaker, ResumedClient};
use super::settings::Started;
use super::{ClientSettings, Handing};
use crate::cli::ClientArgs;
use crate::handover::predecessor::serve_successors;
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
    let admin_addr = args.admin.admin_listen;
    let mut inherited = open::take_over(&args.handover, &args.listen, admin_addr)?;
    let admin = match inherited.as_mut().and_then(|i| i.taken.admin.take()) {
        Some(admin) => Some(admin),
        None => admin_addr
            .map(|addr| {
                std::net::TcpListener::bind(addr).with_context(|| format!("--admin-listen {addr}"))
            })
            .transpose()?,
    };
    let runtime = runtime(args.process.worker_threads())?;
    runtime.block_on(async move {
        let listener = open::local_listener(&args.listen, inherited.as_mut().map(|i| &mut i.taken))?;
        let handover_socket = inherited.as_mut().and_then(|i| i.taken.handover.take());
        let (predecessor, gate) = open::predecessor(
            (&args.handover, handover_socket),
            (&listener, admin.as_ref()),
            &settings.metrics,
            settings.handover.clone(),
        )?;
        // A successor accepts only once the running client has stopped.
        if let Some(Inherited { successor, .. }) = &mut inherited {
            tokio::task::block_in_place(|| successor.commit())?;
        }
        tokio::spawn(reloader.watch(args.tls.protocol.reload_interval()));
        if let Some(admin) = admin {
            let admin = async_listener(admin)?;
            info!(target: "nbdgw", admin = %display_addr(&admin), "admin endpoints: /healthz /readyz /server /metrics");
            let limits = crate::admin::AdminLimits::default();
            let (metrics, health) = (settings.metrics.clone(), settings.health.clone());
            tokio::spawn(crate::admin::serve_gated(admin, metrics, health, limits, gate.clone()));
        }
        super::log_start(
            &listener,
            &settings,
            paths.layout.unwrap_or("files"),
            &args.tls.protocol.tls_groups,
        );
        let settings = Arc::new(settings);
        let (resumed, taken) = take_sessions(inherited, &settings);
        let (stop, on_stop) = stop_signal();
        if let Some(predecessor) = predecessor {
            tokio::spawn(serve_successors(predecessor, (taken, on_stop)));
        }
        notify(&[NotifyState::Ready]);
        let drain_answer = args.shutdown.drain_answer;
        let handing = Handing { gate, resumed };
        super::run(listener, settings, (stop, drain_answer), handing).await?;
        Ok(())
    })
}

/// Serving, then the sessions the old client hands over, judged and
/// passed to the accept loop; the receiver of `taken` ends once they are
/// all taken (at once when there is no old client).
fn take_sessions(
    inherited: Option<Inherited>,
    settings: &Arc<ClientSettings>,
) -> (mpsc::Receiver<ResumedClient>, oneshot::Receiver<()>) {
    let (tx, rx) = mpsc::channel(64);
    let (took, taken) = oneshot::channel();
    let sessions = inherited
        .and_then(|i| tokio::task::block_in_place(|| i.successor.serving(&settings.metrics)));
    match sessions {
        Some(sessions) => {
            let settings = settings.clone();
            tokio::task::spawn_blocking(move || {
                let taker = ClientTaker::new(&settings, |r| tx.blocking_send(r).is_ok());
                sessions.take_with(&taker);
                let _ = took.send(());
            });
        }
        None => {
            let _ = took.send(());
        }
    }
    (rx, taken)
}

/// The stop signal for the accept loop, also told to the hand-over
/// socket's task.
fn stop_signal() -> (impl std::future::Future<Output = ()>, oneshot::Receiver<()>) {
    let (stopped, on_stop) = oneshot::channel();
    let stop = async move {
        stopping().await;
        let _ = stopped.send(());
    };
    (stop, on_stop)
}
