//! Handing the gateway over to a successor process without refusing a
//! connection (docs/design/handover.md).
//!
//! A gateway started with `--handover-socket` listens there; a new one
//! started with `--take-over` on that path receives its listening
//! sockets (SCM_RIGHTS) and serves them, while the old one stops
//! accepting, drains its sessions as on SIGTERM and exits. The sessions
//! themselves are not handed over yet: that is the next step, on the
//! same channel.
//!
//! - `flags`: the flag group.
//! - `channel`: frames and descriptors over the Unix socket, bounded.
//! - `socket`: the hand-over socket made safely.
//! - `alive`: whether the process at the other end is gone.
//! - `describe`: what a descriptor is, sent with it and checked on arrival.
//! - `gate`: pausing and ending the accept loops.
//! - `predecessor`, `successor`: the two ends.
//! - `fdstore`: the same for `systemctl restart`, through systemd's
//!   file-descriptor store.

pub mod alive;
pub mod channel;
pub mod describe;
pub mod fdstore;
pub mod flags;
pub mod gate;
pub mod predecessor;
pub mod sessions;
pub mod socket;
pub mod successor;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};

pub use flags::HandoverArgs;
pub use gate::Gate;

use crate::listeners::Listeners;
use crate::metrics::Metrics;
use crate::proto::handover::Role;

/// The listeners, where they came from, and the hand-over's two ends if
/// asked for.
pub struct Opened {
    pub listeners: Listeners,
    /// `--handover-socket`: to be served (`Predecessor::serve`).
    pub predecessor: Option<predecessor::Predecessor>,
    /// `--take-over`: to commit and then say it serves.
    pub successor: Option<successor::Successor>,
    /// What the accept loops follow.
    pub gate: Gate,
    /// Sessions systemd passed back from its file-descriptor store.
    pub stored: fdstore::restore::Found,
    /// `--handover-fdstore`: what pauses accepting at SIGTERM.
    pub fdstore: Option<gate::GateControl>,
}

/// What a server-mode successor asks its predecessor for.
fn server_wants(
    args: &HandoverArgs,
    listen: SocketAddr,
    admin: Option<SocketAddr>,
) -> successor::Wanted<'_> {
    successor::Wanted {
        listen: Some(listen),
        listen_unix: None,
        admin,
        handover: args.handover_socket.as_deref(),
        speaks: crate::proto::handover::SERVER_MODE,
    }
}

/// The server's listening sockets: taken over from a running gateway
/// (`--take-over`), else as `Listeners::open` makes them; and the
/// hand-over socket, taken over or made.
pub fn open(
    args: &HandoverArgs,
    listen: SocketAddr,
    admin: Option<SocketAddr>,
    metrics: &Arc<Metrics>,
    sessions: Option<Arc<sessions::Registry>>,
) -> Result<Opened> {
    refuse_under_systemd(args)?;
    fdstore::check(args.handover_fdstore)?;
    // Before the listeners: they skip these names, and LISTEN_FDS is
    // read once.
    let stored = fdstore::restore::collect();
    let timeout = Duration::from_secs(args.handover_timeout);
    let predecessor_at = match &args.take_over {
        None => None,
        Some(path) => {
            let queue = Duration::from_secs(args.handover_queue_timeout);
            successor::connect(path, args.take_over_missing, queue)?.map(|s| (path, s))
        }
    };
    let (successor, listeners, handover) = match predecessor_at {
        None => (None, Listeners::open(listen, admin)?, None),
        Some((path, stream)) => {
            let wanted = server_wants(args, listen, admin);
            let queue = Duration::from_secs(args.handover_queue_timeout);
            let bounds = (queue, timeout);
            let (successor, taken) = successor::take_over(path, stream, &wanted, bounds)?;
            let listeners = Listeners::with(taken.nbd, taken.admin, listen, admin)?;
            (Some(successor), listeners, taken.handover)
        }
    };
    let handover = match (handover, &args.handover_socket) {
        (Some(taken), _) => Some(taken),
        (None, Some(path)) => Some(socket::create(path)?),
        (None, None) => None,
    };
    let (control, gate) = Gate::controlled();
    let fdstore = args.handover_fdstore.then(|| control.clone());
    let Some(handover) = handover else {
        return Ok(Opened {
            listeners,
            predecessor: None,
            successor,
            gate,
            stored,
            fdstore,
        });
    };
    let predecessor = predecessor(handover, &listeners, timeout, control, (metrics, sessions))?;
    Ok(Opened {
        listeners,
        predecessor: Some(predecessor),
        successor,
        gate,
        stored,
        fdstore,
    })
}

/// The hand-over socket's end, with copies of the listeners to give.
fn predecessor(
    handover: std::os::unix::net::UnixListener,
    listeners: &Listeners,
    timeout: Duration,
    control: gate::GateControl,
    (metrics, sessions): (&Arc<Metrics>, Option<Arc<sessions::Registry>>),
) -> Result<predecessor::Predecessor> {
    let mut predecessor = predecessor::Predecessor::new(
        handover.try_clone()?,
        timeout,
        control,
        metrics.clone(),
        sessions,
    );
    predecessor
        .offer(Role::Nbd, &listeners.nbd)
        .and_then(|()| match &listeners.admin {
            Some(admin) => predecessor.offer(Role::Admin, admin),
            None => Ok(()),
        })
        .and_then(|()| predecessor.offer(Role::Handover, &handover))
        .context("keeping copies of the listening sockets for a successor")?;
    Ok(predecessor)
}

/// `--take-over` from inside a systemd unit would be killed with the
/// unit's cgroup when the old gateway, its main PID, exits (MAINPID=
/// before READY does not help: the stop that follows kills the new main
/// PID too); from outside it runs unsupervised. Under systemd the
/// file-descriptor store does it (`--handover-fdstore`, `fdstore`).
pub fn refuse_under_systemd(args: &HandoverArgs) -> Result<()> {
    if args.take_over.is_some() && std::env::var_os("NOTIFY_SOCKET").is_some() {
        bail!("--take-over under systemd (NOTIFY_SOCKET is set) is not supported: a successor started in the unit dies with it when the old gateway exits; use --handover-fdstore and systemctl restart (systemd's file-descriptor store keeps the sessions), or run the successor outside systemd's supervision");
    }
    Ok(())
}
