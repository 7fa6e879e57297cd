//! Client mode's listeners and hand-over ends at start: with `--take-over`
//! the local listener (and the admin one, and the hand-over socket) come
//! from the running `nbdgw client`, else they are bound here; with
//! `--handover-socket` a `Predecessor` speaking client mode's state
//! version gives copies of them to a successor. The channel, its checks
//! and its commit points are the server mode's (`crate::handover`).

use std::net::SocketAddr;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::cli::LocalAddr;
use crate::handover::gate::{Gate, GateControl};
use crate::handover::predecessor::Predecessor;
use crate::handover::successor::{self, Successor, Wanted};
use crate::handover::HandoverArgs;
use crate::metrics::Metrics;
use crate::proto::handover::{Role, CLIENT_MODE};

/// What `--take-over` gave (blocking: before the runtime).
pub struct Inherited {
    pub successor: Successor,
    pub taken: successor::Taken,
}

/// `--take-over PATH`: the running client's listeners that match this
/// one's flags. A failure fails the start; the old process serves on.
pub fn take_over(
    args: &HandoverArgs,
    listen: &LocalAddr,
    admin: Option<SocketAddr>,
) -> Result<Option<Inherited>> {
    let Some(path) = &args.take_over else {
        return Ok(None);
    };
    crate::handover::refuse_under_systemd(args)?;
    let (tcp, unix) = match listen {
        LocalAddr::Tcp(addr) => (Some(*addr), None),
        LocalAddr::Unix(path) => (None, Some(path.as_path())),
    };
    let wanted = Wanted {
        listen: tcp,
        listen_unix: unix,
        admin,
        handover: args.handover_socket.as_deref(),
        speaks: CLIENT_MODE,
    };
    let timeout = Duration::from_secs(args.handover_timeout);
    // As in server mode: with `--take-over-missing start`, nobody there
    // (no socket, or one nobody listens on) starts fresh.
    let queue = Duration::from_secs(args.handover_queue_timeout);
    let Some(stream) = successor::connect(path, args.take_over_missing, queue)? else {
        return Ok(None);
    };
    let (successor, taken) = successor::take_over(path, stream, &wanted, (queue, timeout))?;
    Ok(Some(Inherited { successor, taken }))
}

/// The local listener: taken over, or bound here (inside the runtime).
pub fn local_listener(
    listen: &LocalAddr,
    taken: Option<&mut successor::Taken>,
) -> Result<super::super::LocalListener> {
    use super::super::LocalListener;
    let inherited = taken.and_then(|t| match listen {
        LocalAddr::Unix(path) => t.nbd_unix.take().map(|l| Unix(l, path.clone())),
        LocalAddr::Tcp(_) => t.nbd.take().map(Tcp),
    });
    enum Inherit {
        Unix(UnixListener, std::path::PathBuf),
        Tcp(std::net::TcpListener),
    }
    use Inherit::{Tcp, Unix};
    Ok(match inherited {
        None => LocalListener::bind(listen)?,
        Some(Unix(listener, path)) => {
            listener.set_nonblocking(true)?;
            LocalListener::Unix(tokio::net::UnixListener::from_std(listener)?, path)
        }
        Some(Tcp(listener)) => {
            listener.set_nonblocking(true)?;
            LocalListener::Tcp(tokio::net::TcpListener::from_std(listener)?)
        }
    })
}

/// `--handover-socket`: the socket (taken over, or made here) and the
/// predecessor that gives copies of the listeners; and the gate the
/// accept loop follows.
pub fn predecessor(
    (args, handover): (&HandoverArgs, Option<UnixListener>),
    listeners: (&super::super::LocalListener, Option<&std::net::TcpListener>),
    metrics: &Arc<Metrics>,
    sessions: Option<Arc<crate::handing::Registry>>,
) -> Result<(Option<Predecessor>, Gate)> {
    let Some(path) = &args.handover_socket else {
        return Ok((None, Gate::always()));
    };
    let handover = match handover {
        Some(taken) => taken,
        None => crate::handover::socket::create(path)?,
    };
    let (control, gate) = Gate::controlled();
    let timeout = Duration::from_secs(args.handover_timeout);
    let predecessor = give(handover, listeners, (timeout, control), metrics, sessions)
        .with_context(|| format!("--handover-socket {}", show(path)))?;
    Ok((Some(predecessor), gate))
}

fn give(
    handover: UnixListener,
    (local, admin): (&super::super::LocalListener, Option<&std::net::TcpListener>),
    (timeout, control): (Duration, GateControl),
    metrics: &Arc<Metrics>,
    sessions: Option<Arc<crate::handing::Registry>>,
) -> std::io::Result<Predecessor> {
    let predecessor = Predecessor::new(
        handover.try_clone()?,
        timeout,
        control,
        metrics.clone(),
        sessions,
    );
    let mut predecessor = predecessor.speaking(CLIENT_MODE);
    match local {
        super::super::LocalListener::Unix(l, _) => predecessor.offer(Role::Nbd, l)?,
        super::super::LocalListener::Tcp(l) => predecessor.offer(Role::Nbd, l)?,
    }
    if let Some(admin) = admin {
        predecessor.offer(Role::Admin, admin)?;
    }
    predecessor.offer(Role::Handover, &handover)?;
    Ok(predecessor)
}

fn show(path: &Path) -> String {
    path.display().to_string()
}
