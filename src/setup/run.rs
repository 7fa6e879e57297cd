//! The server mode run: configured (`super::configure`), sandboxed, then
//! served on the runtime until a stop signal.

use std::sync::Arc;

use anyhow::{Context, Result};
use sd_notify::NotifyState;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tracing::info;

use super::process::{
    async_listener, display_addr, init_logging, notify, runtime, stopping_from_now,
};
use super::{sandbox, Setup};
use crate::admin::AdminLimits;
use crate::cli::ServeArgs;
use crate::config::Config;
use crate::confinement::LandlockMode;
use crate::handover;
use crate::handover::predecessor::serve_successors;

/// `nbdgw` without a subcommand.
pub fn serve(args: ServeArgs) -> Result<()> {
    init_logging(args.process.log_format);
    let Setup {
        reloader,
        policy,
        config,
        admin_limits,
    } = super::configure(&args)?;
    let opened = handover::open(
        &args.handover,
        args.listen,
        args.admin.listen.admin_listen,
        &config.metrics,
        config.handover.clone(),
    )?;
    // Counted before the sandbox hides /sys and /proc from the runtime.
    let threads = args.process.worker_threads();
    confine(&args, &reloader, policy.as_ref(), &config)?;

    let runtime = runtime(threads)?;
    let (reload_interval, after_handover) = (
        args.tls.protocol.reload_interval(),
        args.handover.after_handover,
    );
    runtime.block_on(async move {
        let handover::Opened { listeners, predecessor, mut successor, gate, stored, fdstore } = opened;
        // Before anything can hand over: a signal from then on is seen.
        let idle = AfterHandover::watch(after_handover, &gate)?;
        // A successor accepts only once the running gateway has stopped.
        if let Some(successor) = &mut successor {
            tokio::task::block_in_place(|| successor.commit())?;
        }
        watch_files(reloader, policy, reload_interval);
        sandbox::debug_probe::after_start();
        if let Some(admin) = listeners.admin {
            start_admin(async_listener(admin)?, &config, admin_limits, gate.clone());
        }
        let listener = async_listener(listeners.nbd)?;
        let shown = display_addr(&listener);
        let (upstream, exports, cork) = (config.upstream.display().to_string(), config.exports.is_some(), config.cork);
        // The accept loop runs on a worker, not on this thread (which
        // only waits): each accepted connection's task then starts on the
        // worker that accepted it, instead of one thread waking another
        // for every connection (bench/RESULTS.md, handshake CPU).
        let (stop, on_stop) = stop_signal(fdstore.zip(config.handover.clone()));
        let metrics = config.metrics.clone();
        let config = Arc::new(config);
        let (serving, taken) = serve_with_successor(listener, config, (stop, gate), (successor, stored), &metrics);
        if let Some(predecessor) = predecessor {
            tokio::spawn(serve_successors(predecessor, (taken, on_stop)));
        }
        info!(target: "nbdgw", listen = %shown, from_systemd = listeners.from_systemd, %upstream, exports, ?cork, "nbdgw listening");
        notify(&[NotifyState::Ready]);
        serving.await.context("the accept loop")??;
        idle.wait().await;
        Ok(())
    })
}

/// The sandbox (--landlock), before the runtime starts.
fn confine(
    args: &ServeArgs,
    reloader: &crate::tls::Reloader,
    policy: Option<&crate::policy::PolicyReloader>,
    config: &Config,
) -> Result<()> {
    match args.sandbox.landlock {
        LandlockMode::Off => {
            info!(target: "nbdgw", "--landlock false: the process is not sandboxed");
            Ok(())
        }
        mode => sandbox::apply(mode, reloader, policy, config, args),
    }
}

/// The TLS files and the policy, re-read every `interval`.
fn watch_files(
    reloader: crate::tls::Reloader,
    policy: Option<crate::policy::PolicyReloader>,
    interval: Option<std::time::Duration>,
) {
    tokio::spawn(reloader.watch(interval));
    if let Some(policy) = policy {
        tokio::spawn(policy.watch(interval));
    }
}

/// `--after-handover wait`: once a successor serves the listeners and
/// the sessions left here have drained, this process stays, idle and
/// listening on nothing, until a signal (Kubernetes' kubelet would start
/// an exited container again, and that one would fight the successor).
/// The signal streams are made at start: one delivered during the drain
/// (the accept loop's own signal watch is gone by then) is kept and
/// ends the wait at once.
struct AfterHandover {
    watch: Option<(handover::Gate, [tokio::signal::unix::Signal; 2])>,
}

impl AfterHandover {
    fn watch(after: handover::flags::AfterHandover, gate: &handover::Gate) -> Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        if after == handover::flags::AfterHandover::Exit {
            return Ok(AfterHandover { watch: None });
        }
        let signals = [
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
        ];
        Ok(AfterHandover {
            watch: Some((gate.clone(), signals)),
        })
    }

    /// Returns at once unless this process handed over (a stop by a
    /// signal exits as always).
    async fn wait(self) {
        let Some((gate, [mut term, mut int])) = self.watch else {
            return;
        };
        if gate.now() != handover::gate::Accepting::HandedOver {
            return;
        }
        info!(target: "nbdgw", "handed over: idle, listening on nothing, until SIGTERM (--after-handover wait)");
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        info!(target: "nbdgw", "{name} received after the hand-over: exiting 0");
    }
}

/// The accept loop, and a successor's end of the hand-over: Serving,
/// then the sessions the old gateway hands over (state version 2),
/// served by the accept loop's task set. The receiver ends once those
/// sessions are all taken (at once when there is no old gateway).
fn serve_with_successor(
    listener: TcpListener,
    config: Arc<Config>,
    (stop, gate): (
        impl std::future::Future<Output = ()> + Send + 'static,
        handover::Gate,
    ),
    (successor, stored): (
        Option<handover::successor::Successor>,
        handover::fdstore::restore::Found,
    ),
    metrics: &crate::metrics::Metrics,
) -> (
    tokio::task::JoinHandle<std::io::Result<()>>,
    oneshot::Receiver<()>,
) {
    let (took, taken) = oneshot::channel();
    let admission = crate::admission::Admission::new(&config);
    let restored = restore(stored, (&config, &admission));
    let (resumed, resumed_rx) = tokio::sync::mpsc::channel(restored.len().max(64));
    for session in restored {
        let _ = resumed.try_send(session);
    }
    let serving = tokio::spawn(crate::server::run_resuming(
        listener,
        (config.clone(), admission.clone()),
        stop,
        gate,
        resumed_rx,
    ));
    let sessions = successor.and_then(|s| tokio::task::block_in_place(|| s.serving(metrics)));
    if let Some(sessions) = sessions {
        tokio::task::spawn_blocking(move || {
            sessions.take((&config, &admission), |r| resumed.blocking_send(r).is_ok());
            let _ = took.send(());
        });
    }
    (serving, taken)
}

/// Every session systemd kept in its store claimed, judged (its session
/// slot reserved) and ready, before the accept loop starts and before
/// READY=1: clients queued in the socket's backlog meanwhile cannot take
/// the stored sessions' slots, and a restart right after READY=1 finds
/// them all running, not half restored (a SIGTERM meanwhile is acted on
/// once they are: the stop stores them again). Local work: memfd reads
/// and one datagram each.
fn restore(
    stored: handover::fdstore::restore::Found,
    (config, admission): (&Config, &crate::admission::Admission),
) -> Vec<handover::sessions::take::Resumed> {
    if stored.by_name.is_empty() {
        return Vec::new();
    }
    let restored = std::cell::RefCell::new(Vec::new());
    tokio::task::block_in_place(|| {
        let notifier = handover::fdstore::notify::Notifier::from_env();
        handover::fdstore::restore::take(stored, (config, admission), &notifier, |r| {
            restored.borrow_mut().push(r);
            true
        })
    });
    restored.into_inner()
}

/// The stop signal for the accept loop, also told to the hand-over
/// socket's task. With `--handover-fdstore` (`give`), accepting pauses
/// at the signal (connections wait in the backlog, which systemd keeps
/// for the next instance) and the sessions go to systemd's
/// file-descriptor store before the drain of the rest begins.
fn stop_signal(
    give: Option<(handover::gate::GateControl, Arc<crate::handing::Registry>)>,
) -> (impl std::future::Future<Output = ()>, oneshot::Receiver<()>) {
    let (stopped, on_stop) = oneshot::channel();
    // Watched from now, not from the accept loop's start: a SIGTERM
    // during the restore is then acted on after it, not fatal.
    let signal = stopping_from_now();
    let stop = async move {
        signal.await;
        if let Some((control, registry)) = give {
            control.set(handover::gate::Accepting::Paused);
            let notifier = handover::fdstore::notify::Notifier::from_env();
            let gave = tokio::task::spawn_blocking(move || {
                handover::fdstore::stash::give(&registry, &notifier)
            });
            let _ = gave.await;
        }
        let _ = stopped.send(());
    };
    (stop, on_stop)
}

fn start_admin(listener: TcpListener, config: &Config, limits: AdminLimits, gate: handover::Gate) {
    info!(target: "nbdgw", admin = %display_addr(&listener), "admin endpoints: /healthz /readyz /metrics");
    let (metrics, health) = (config.metrics.clone(), config.health.clone());
    // With named exports each has its own server; one being down does
    // not make the gateway unready.
    if config.exports.is_none() {
        let upstream = config.upstream.clone();
        tokio::spawn(crate::admin::watch_upstream(upstream, health.clone()));
    }
    tokio::spawn(crate::admin::serve_gated(
        listener, metrics, health, limits, gate,
    ));
}
