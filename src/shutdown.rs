//! The gateway's shutdown, as every connection sees it: running, then
//! draining (SIGTERM: finish what is in flight, refuse what is new), then
//! cut (the grace period is over).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{info, warn};

/// What a draining connection does with a request it reads after the
/// drain began (requests read before it are answered by the upstream).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DrainAnswer {
    /// Leave it unanswered and close the connection once every request
    /// forwarded before the drain is answered: a clean close at a request
    /// boundary. qemu with `reconnect-delay` reconnects and sends it
    /// again; an ESHUTDOWN answer it would hand to the guest.
    #[default]
    Close,
    /// Answer it ESHUTDOWN at once, and close once nothing is in flight.
    Eshutdown,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Running,
    Draining,
    Cut,
}

/// Owned by the accept loop, which moves the phase forward.
pub struct ShutdownControl(watch::Sender<Phase>, Arc<AtomicBool>);

/// Each connection's view of the phase, what it does with requests
/// read while draining, and whether the drain follows a hand-over.
#[derive(Clone)]
pub struct Shutdown(watch::Receiver<Phase>, DrainAnswer, Arc<AtomicBool>);

impl ShutdownControl {
    pub fn answering(answer: DrainAnswer) -> (Self, Shutdown) {
        let (tx, rx) = watch::channel(Phase::Running);
        let handed_over = Arc::new(AtomicBool::new(false));
        (
            ShutdownControl(tx, handed_over.clone()),
            Shutdown(rx, answer, handed_over),
        )
    }

    /// The drain to come follows a hand-over (`crate::handover`): a
    /// successor serves the listeners.
    pub fn handed_over(&self) {
        self.1.store(true, Ordering::Relaxed);
    }

    pub fn enter(&self, phase: Phase) {
        self.0.send_if_modified(|now| {
            let later = phase > *now;
            if later {
                *now = phase;
            }
            later
        });
    }
}

impl Shutdown {
    pub fn is_draining(&self) -> bool {
        *self.0.borrow() >= Phase::Draining
    }

    /// Whether negotiation refuses options now (NBD_REP_ERR_SHUTDOWN):
    /// while draining, but not after a hand-over. A connection still
    /// negotiating then was accepted just before the successor took the
    /// listeners; it is let finish negotiating, so that no client is
    /// refused at connect, and its session drains as any other.
    pub fn refuses_options(&self) -> bool {
        self.is_draining() && !self.2.load(Ordering::Relaxed)
    }

    /// What a request read now gets: `None` while running, else the drain's
    /// answer. Read once per request, so that one request never sees two
    /// phases (it would be counted left unanswered and answered ESHUTDOWN).
    pub fn answer_now(&self) -> Option<DrainAnswer> {
        self.is_draining().then_some(self.1)
    }

    pub fn answer(&self) -> DrainAnswer {
        self.1
    }

    /// Resolves once draining has begun.
    pub async fn draining(&mut self) {
        self.reached(Phase::Draining).await
    }

    /// Resolves once the grace period is over.
    pub async fn cut(&mut self) {
        self.reached(Phase::Cut).await
    }

    async fn reached(&mut self, phase: Phase) {
        // The control is dropped only when the accept loop is gone, and
        // with it every reason to go on.
        let _ = self.0.wait_for(|now| *now >= phase).await;
    }
}

/// How long connections get to log their end and leave once the grace
/// period is over and they have been told to stop.
const CUT_WAIT: Duration = Duration::from_secs(1);

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

async fn drain(connections: &mut JoinSet<()>) {
    while connections.join_next().await.is_some() {}
}

/// Resolves at the first SIGTERM or SIGINT, which starts a graceful
/// shutdown; a second one ends the process at once, as operators expect
/// of a daemon that is taking too long.
pub async fn signals() {
    watch_signals().await
}

/// `signals`, with the handlers installed now rather than at the first
/// poll: a SIGTERM from here on starts the graceful shutdown (once the
/// future is awaited) instead of ending the process, e.g. during the
/// restore of systemd's stored sessions before the accept loop.
pub fn watch_signals() -> impl std::future::Future<Output = ()> + Send + 'static {
    let watched = Signals::new();
    async move {
        let mut signals = match watched {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "cannot watch SIGTERM; only Ctrl-C stops nbdgw");
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        signals.next().await;
        tokio::spawn(async move {
            let name = signals.next().await;
            warn!("second {name}: exiting at once, open connections are cut");
            std::process::exit(1);
        });
    }
}

struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    async fn next(&mut self) -> &'static str {
        let name = tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        };
        info!("{name} received");
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One look per request: with `Close`, whatever the phase, a request
    /// is never to be answered ESHUTDOWN; with `Eshutdown`, only once
    /// draining.
    #[test]
    fn a_request_sees_one_answer_and_close_never_answers_eshutdown() {
        for answer in [DrainAnswer::Close, DrainAnswer::Eshutdown] {
            let (control, shutdown) = ShutdownControl::answering(answer);
            assert_eq!(shutdown.answer_now(), None);
            for phase in [Phase::Draining, Phase::Cut] {
                control.enter(phase);
                assert_eq!(shutdown.answer_now(), Some(answer));
            }
        }
    }

    /// After a hand-over a connection still negotiating is let finish;
    /// at SIGTERM it is refused.
    #[test]
    fn options_are_refused_while_draining_unless_handed_over() {
        let (control, shutdown) = ShutdownControl::answering(DrainAnswer::Close);
        assert!(!shutdown.refuses_options());
        control.enter(Phase::Draining);
        assert!(shutdown.refuses_options());
        control.handed_over();
        assert!(!shutdown.refuses_options());
        assert!(shutdown.is_draining());
    }
}
