//! The running gateway's end: it waits on the hand-over socket for a
//! successor, one at a time, and gives it the listening sockets.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::process::{pidfd_open, PidfdFlags};

use tracing::{info, warn};

use super::alive::Peer;
use super::channel::{peer_uid, Channel, ChannelError, REFUSE_GRACE};
use super::describe::{describe, show};
use super::gate::{Accepting, GateControl};
use crate::metrics::Metrics;
use crate::proto::handover::{choose, Message, Role, Speaks, SERVER_MODE};

/// The hand-over socket and what it gives away.
pub struct Predecessor {
    listener: UnixListener,
    giver: Giver,
}

/// What one hand-over needs, shared with the blocking task that runs it.
struct Giver {
    /// Copies of the listening sockets, so that giving them does not
    /// stop this process from serving them if the successor fails.
    offered: Vec<(Role, OwnedFd)>,
    timeout: Duration,
    control: GateControl,
    metrics: Arc<Metrics>,
    /// The sessions a successor may take (state version 2).
    sessions: Option<Arc<super::sessions::Registry>>,
    /// The versions this mode speaks (server or client mode).
    speaks: Speaks,
}

/// How one successor's attempt ended (the metric's label, and a line).
struct Failure {
    outcome: &'static str,
    why: String,
}

impl Failure {
    fn new(outcome: &'static str, why: impl std::fmt::Display) -> Self {
        Failure {
            outcome,
            why: why.to_string(),
        }
    }

    fn channel(e: ChannelError) -> Self {
        let outcome = match e {
            ChannelError::Timeout => "timeout",
            ChannelError::Closed => "successor_gone",
            _ => "failed",
        };
        Failure::new(outcome, e)
    }
}

impl Predecessor {
    pub fn new(
        listener: UnixListener,
        timeout: Duration,
        control: GateControl,
        metrics: Arc<Metrics>,
        sessions: Option<Arc<super::sessions::Registry>>,
    ) -> Self {
        Predecessor {
            listener,
            giver: Giver {
                offered: Vec::new(),
                timeout,
                control,
                metrics,
                sessions,
                speaks: SERVER_MODE,
            },
        }
    }

    /// Speaks `speaks`'s versions instead of the server mode's (client
    /// mode: `nbdgw client`).
    pub fn speaking(mut self, speaks: Speaks) -> Self {
        self.giver.speaks = speaks;
        self
    }

    /// Offers a copy of `fd` to successors, in `role`.
    pub fn offer(&mut self, role: Role, fd: impl AsFd) -> std::io::Result<()> {
        let copy = fd.as_fd().try_clone_to_owned()?;
        self.giver.offered.push((role, copy));
        Ok(())
    }

    /// Serves successors, one at a time (the next waits in the socket's
    /// backlog), until one serves.
    pub async fn serve(self) {
        let listener = self
            .listener
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UnixListener::from_std(self.listener));
        let listener = match listener {
            Ok(listener) => listener,
            Err(e) => {
                return warn!(error = %e, "hand-over socket: cannot serve it; no successor can take over")
            }
        };
        let giver = Arc::new(self.giver);
        loop {
            let stream = match listener.accept().await.and_then(|(s, _)| s.into_std()) {
                Ok(stream) => stream,
                Err(e) => {
                    warn!(error = %e, "hand-over socket: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let one = giver.clone();
            // Blocking, and bounded by --handover-timeout (every read and
            // write is).
            let outcome = tokio::task::spawn_blocking(move || one.hand_over(stream)).await;
            let outcome = outcome.unwrap_or_else(|e| Err(Failure::new("failed", e)));
            if giver.finish(outcome) {
                return;
            }
        }
    }
}

impl Giver {
    /// Counts and logs the end of one attempt, and opens or ends the
    /// accept loops; true once handed over.
    fn finish(&self, outcome: Result<(), Failure>) -> bool {
        let label = match &outcome {
            Ok(()) => "handed_over",
            Err(failure) => failure.outcome,
        };
        self.metrics.handover(label);
        match outcome {
            Ok(()) => {
                info!("hand-over: the successor serves the listeners; no longer accepting, draining the sessions open here as on SIGTERM");
                self.control.set(Accepting::HandedOver);
                true
            }
            Err(failure) => {
                warn!(outcome = failure.outcome, reason = %failure.why, "hand-over: refused or failed; this gateway goes on serving (accepting again if it had paused)");
                self.control.take_paths_back();
                self.control.set(Accepting::Yes);
                false
            }
        }
    }

    /// One successor, from its connection to its first accept. Every
    /// give-up says Refuse, so that a successor reads a bare end of the
    /// channel as this process's death, never as a give-up.
    fn hand_over(&self, stream: UnixStream) -> Result<(), Failure> {
        let ours = rustix::process::getuid().as_raw();
        let theirs = peer_uid(&stream).map_err(|e| Failure::new("failed", e))?;
        let mut channel = Channel::new(stream, Instant::now() + self.timeout)
            .map_err(|e| Failure::new("failed", e))?;
        if theirs != ours {
            channel.refuse("another uid may not take this gateway over");
            return Err(Failure::new(
                "refused_uid",
                format!("a successor of uid {theirs} connected; only uid {ours} may take over"),
            ));
        }
        // The kernel's word for the successor's process, not its Hello's
        // (review round 2, M2).
        let successor = Peer::of_socket(channel.stream());
        if !successor.watchable() {
            warn!("hand-over: the successor's process cannot be watched (not visible from this pid namespace?); after Go, its channel ending without a word counts as its death");
        }
        let outcome = self.exchange(&mut channel, &successor);
        if let Err(failure) = &outcome {
            channel.refuse(&format!("the running gateway gives up: {}", failure.why));
        }
        outcome
    }

    fn exchange(&self, channel: &mut Channel, successor: &Peer) -> Result<(), Failure> {
        let (version, said_pid) = self.agree(channel)?;
        info!(
            version,
            pid = said_pid,
            "hand-over: a successor connected; giving it the listening sockets"
        );
        self.give_listeners(channel)?;
        debug_stall();
        if self.await_serving(channel, successor)? && version == self.speaks.sessions {
            self.give_sessions(channel);
        }
        Ok(())
    }

    /// After Serving: the sessions, each offered and, if the successor
    /// takes it, handed over; those it does not stay and drain. Never a
    /// failure of the hand-over itself: the successor serves already.
    fn give_sessions(&self, channel: &mut Channel) {
        let Some(registry) = &self.sessions else {
            return;
        };
        if let Err(e) = super::sessions::give::give(channel, registry) {
            warn!(error = %e, "hand-over: the session hand-over ended early; the sessions not handed over drain here");
        }
    }

    /// Hello, then Chosen or a refusal; the version and the pid the
    /// successor says (in its own pid namespace: for the log only).
    fn agree(&self, channel: &mut Channel) -> Result<(u32, u32), Failure> {
        let (versions, pid) = match channel.recv().map_err(Failure::channel)? {
            (Message::Hello { versions, pid }, _) => (versions, pid),
            (other, _) => return Err(unexpected(channel, "hello", &other)),
        };
        let known = self.speaks.known;
        let Some(version) = choose(&versions, known) else {
            channel.refuse(&format!(
                "no state version in common: this gateway knows {known:?} (a server-mode and a client-mode gateway never take each other over)"
            ));
            return Err(Failure::new(
                "refused_version",
                format!("the successor knows state versions {versions:?}, this gateway {known:?}"),
            ));
        };
        // The successor watches this process by this pidfd, never by the
        // pid, which is another process in its pid namespace (review
        // round 2, R1); without one it counts this process as gone.
        let me = rustix::process::Pid::from_raw(std::process::id() as i32)
            .and_then(|pid| pidfd_open(pid, PidfdFlags::empty()).ok());
        let chosen = Message::Chosen {
            version,
            pid: std::process::id(),
            pidfd: me.is_some(),
        };
        let fds: Vec<_> = me.iter().map(|fd| fd.as_fd()).collect();
        channel.send(&chosen, &fds).map_err(Failure::channel)?;
        Ok((version, pid))
    }

    /// The listeners, each described as the kernel sees it; the accept
    /// loops pause first, so that from here on only the backlog fills.
    fn give_listeners(&self, channel: &mut Channel) -> Result<(), Failure> {
        let sockets = self
            .offered
            .iter()
            .map(|(role, fd)| describe(fd, *role))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Failure::new("failed", e))?;
        for socket in &sockets {
            info!(role = socket.role.as_str(), socket = %show(socket), "hand-over: giving a listening socket");
        }
        let fds: Vec<_> = self.offered.iter().map(|(_, fd)| fd.as_fd()).collect();
        self.control.set(Accepting::Paused);
        channel
            .send(&Message::Listeners { sockets }, &fds)
            .map_err(Failure::channel)
    }

    /// Ready, Go, Serving. Until Go is sent the listeners are taken back
    /// at any failure (the successor, never told Go, does not accept).
    /// Go is the commit point: after it the successor may accept, so
    /// they are taken back only if it says it gave up (Refuse) or its
    /// process is gone (or cannot be watched: `alive`); a Serving that
    /// does not come in time from a live successor is logged and this
    /// process drains as on success, so that two gateways never both
    /// accept for good.
    fn await_serving(&self, channel: &mut Channel, successor: &Peer) -> Result<bool, Failure> {
        match channel.recv().map_err(Failure::channel)? {
            (Message::Ready, _) => {}
            (other, _) => return Err(unexpected(channel, "ready", &other)),
        }
        // The paths go with Go (review C1): a stop of this process from
        // here on must not unlink the socket file the successor serves;
        // and one that has already removed it tells no successor Go.
        if !self.control.give_paths() {
            return Err(Failure::new(
                "failed",
                "this gateway is stopping; its socket paths are gone",
            ));
        }
        channel.send(&Message::Go, &[]).map_err(Failure::channel)?;
        // Serving gets its own bound from Go (review round 2, N5): the
        // successor's timeout runs from Chosen, so with equal flags this
        // process outlives the successor's decision, and a Refuse it
        // sends at its timeout still arrives.
        channel.set_deadline(Instant::now() + self.timeout + REFUSE_GRACE);
        let why = match channel.recv() {
            Ok((Message::Serving, _)) => return Ok(true),
            Ok((other, _)) => format!("the successor sent {} where serving was due", other.name()),
            // It gave up after Go and says so (review round 2, S6): it
            // does not accept.
            Err(e @ ChannelError::Peer(_)) => {
                return Err(Failure::new(
                    "successor_gone",
                    format!("the successor gave up after Go: {e}"),
                ))
            }
            Err(e) if e.is_bare_end() && successor.gone_within(self.timeout) => {
                return Err(Failure::new(
                    "successor_gone",
                    format!("the successor died after Go: {e}"),
                ));
            }
            Err(e) => e.to_string(),
        };
        warn!(reason = %why, "hand-over: the successor was told Go but did not say it serves; it may accept, so this gateway does not take the listening sockets back");
        Ok(false)
    }
}

/// Debug builds: NBDGW_DEBUG_HANDOVER_GIVER_STALL=1 makes a predecessor
/// stop once it has given the listeners, before Go, so that a test can
/// kill it there.
fn debug_stall() {
    #[cfg(debug_assertions)]
    if std::env::var_os("NBDGW_DEBUG_HANDOVER_GIVER_STALL").is_some() {
        warn!("debug: stalling the hand-over with the listeners given, before Go (NBDGW_DEBUG_HANDOVER_GIVER_STALL)");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

fn unexpected(channel: &mut Channel, wanted: &str, got: &Message) -> Failure {
    channel.refuse(&format!("expected {wanted}, got {}", got.name()));
    Failure::new(
        "failed",
        format!("the successor sent {} where {wanted} was due", got.name()),
    )
}

/// Serves successors until a stop signal (`on_stop`), in both modes.
/// Then the copies of the listening sockets kept for one close with it,
/// so that the ports close when accepting stops, as without
/// --handover-socket, instead of queueing clients nobody will accept: a
/// stopping gateway is not taken over. Not before this process has taken
/// every session its own predecessor hands over (`taken`): taken over
/// meanwhile, it would refuse the late ones, whose state had already
/// left the old process, and so close them. A successor connecting
/// meanwhile waits in the socket's backlog (its --handover-timeout
/// bounds that).
pub async fn serve_successors(
    predecessor: Predecessor,
    (taken, mut on_stop): (
        tokio::sync::oneshot::Receiver<()>,
        tokio::sync::oneshot::Receiver<()>,
    ),
) {
    let closed = "stopping: the hand-over socket is closed, no successor can take over";
    tokio::select! {
        _ = taken => {}
        _ = &mut on_stop => return info!("{closed}"),
    }
    tokio::select! {
        () = predecessor.serve() => {}
        _ = on_stop => info!("{closed}"),
    }
}
