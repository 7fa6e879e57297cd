//! The old instance's side (`--handover-fdstore`, at SIGTERM): every
//! session registered for hand-over is asked to go quiet, all together,
//! through the same hook and state extraction as the channel's
//! (`crate::handing`, `crate::conn::handover`); each one quiet and taken
//! is stored as one message of three descriptors. Then a barrier, so that
//! systemd has every message before this process exits.
//!
//! The commit rule is the channel's: until a session's state is taken it
//! is this process's, and one not quiet in time stays and drains; once
//! taken, its rustls connection is consumed and its sockets leave, so
//! this process never writes on it again, stored or not.

use std::collections::HashSet;
use std::os::fd::AsFd;
use std::sync::mpsc;
use std::time::Duration;

use tracing::{info, warn};

use super::blob::Stored;
use super::notify::Notifier;
use super::session_name;
use crate::handing::{not_quiet, Listed, Outcome, Patience, Ready, Registry};
use crate::proto::handover_session::State;

/// Beyond the quiesce timeout: taking a quiet session's state.
const TAKE_MARGIN: Duration = Duration::from_secs(2);
/// How long systemd may take to read the messages before this exits.
const BARRIER_TIMEOUT: Duration = Duration::from_secs(10);

/// Stores every session that goes quiet in time; the others go on and
/// drain. Blocking; bounded by the quiesce timeout and the barrier's.
pub fn give(registry: &Registry, notifier: &Notifier) {
    // Kernel TLS sessions too: the socket keeps the kernel's record
    // layer (keys, sequence numbers) in the store as it does on the
    // channel, and the memfd carries the current secrets for the next
    // key update (`KernelState`).
    // Restored sessions still starting (a stop right after READY=1) are
    // waited for, so that they are stored again rather than drained.
    let late = registry.wait_arrivals(registry.quiesce_timeout);
    if late > 0 {
        warn!(
            sessions = late,
            "restart: restored sessions not running in time are not stored; they drain"
        );
    }
    let mut listed: Vec<Listed> = registry.list();
    if listed.is_empty() {
        return;
    }
    let left_out = within_room(&mut listed);
    info!(
        sessions = listed.len(),
        "restart: storing the sessions in systemd's file-descriptor store (--handover-fdstore)"
    );
    let handover = random_id();
    let (tx, rx) = mpsc::channel();
    for session in &listed {
        session.slot.open(tx.clone());
        session.hook.ask();
    }
    drop(tx);
    let mut stored = collect(registry, notifier, (handover, &listed), &rx);
    // Late ones are not waited for: they read on and drain. One that
    // reported in between still goes.
    for session in &listed {
        session.slot.close();
    }
    for (id, outcome) in rx.try_iter() {
        stored += usize::from(store(registry, notifier, (id, handover), outcome, &listed));
    }
    for session in &listed {
        session.hook.cancel();
    }
    if stored > 0 {
        registry.set_stored();
        if let Err(e) = notifier.barrier(BARRIER_TIMEOUT) {
            warn!(error = %e, "restart: systemd did not confirm it read the stored sessions; some may be lost");
        }
    }
    info!(
        stored,
        drained = listed.len() + left_out - stored,
        "restart: sessions stored for the next instance; the others drain"
    );
}

/// No more sessions than systemd's store takes (`sessions_room`): the
/// rest are not asked, and drain. How many were left out.
fn within_room(listed: &mut Vec<Listed>) -> usize {
    let open = listed.len();
    if let Some(room) = super::sessions_room().filter(|room| *room < listed.len()) {
        warn!(
            sessions = listed.len(),
            room,
            "restart: systemd's store (FDSTORE=, FileDescriptorStoreMax= / 3) has room for fewer sessions than are open; the rest are not asked and drain"
        );
        listed.truncate(room);
    }
    open - listed.len()
}

/// Stores each session as it reports, for as long as `Patience` says:
/// one not quiet when the quiesce timeout has passed is left to drain
/// (nobody waits for it any more), one quiet by then is waited for
/// while reports keep coming. The number stored.
fn collect(
    registry: &Registry,
    notifier: &Notifier,
    (handover, listed): ([u8; 16], &[Listed]),
    rx: &mpsc::Receiver<(u64, Outcome)>,
) -> usize {
    let mut waiting: HashSet<u64> = listed.iter().map(|l| l.id).collect();
    let mut patience = Patience::new(registry, TAKE_MARGIN);
    let mut stored = 0;
    while !waiting.is_empty() {
        if patience.quiesce_over() {
            for id in not_quiet(listed, &waiting) {
                waiting.remove(&id);
                if let Some(session) = listed.iter().find(|l| l.id == id) {
                    session.slot.close();
                }
            }
        }
        let left = patience.left();
        if left.is_zero() || waiting.is_empty() {
            break;
        }
        let (id, outcome) = match rx.recv_timeout(left.min(WATCH)) {
            Ok(report) => report,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        patience.reported();
        waiting.remove(&id);
        stored += usize::from(store(registry, notifier, (id, handover), outcome, listed));
    }
    stored
}

/// How often the wait looks again which sessions are not quiet.
const WATCH: Duration = Duration::from_millis(100);

/// One session's outcome: stored (true), or left here to drain.
fn store(
    registry: &Registry,
    notifier: &Notifier,
    (id, handover): (u64, [u8; 16]),
    outcome: Outcome,
    listed: &[Listed],
) -> bool {
    let ready: Box<Ready> = match outcome {
        Outcome::Withdrawn(why) => {
            registry.metrics.session_handover("withdrawn");
            info!(conn = id, reason = %why, "restart: the session's state could not be taken; it stays here and drains");
            return false;
        }
        Outcome::Ended => {
            registry.metrics.session_handover("ended");
            return false;
        }
        Outcome::Ready(ready) => ready,
    };
    let Some(offer) = listed.iter().find(|l| l.id == id).map(|l| l.offer.to_vec()) else {
        return false;
    };
    let state = State {
        handover,
        tls: ready.tls,
        ahead: ready.ahead,
        counts: ready.counts,
    };
    let stored = Stored {
        handover,
        was: id,
        offer,
        state: state.encode(),
    };
    let name = session_name(std::process::id(), id);
    let sent = stored.write().and_then(|memfd| {
        notifier.store(
            &name,
            &[ready.tcp.as_fd(), ready.upstream.as_fd(), memfd.as_fd()],
        )
    });
    match sent {
        Ok(()) => {
            registry.metrics.session_handover("stored");
            let pause = ready.stopped_at.elapsed();
            info!(conn = id, fdname = %name, quiet_ms = pause.as_millis() as u64, "restart: the session is in systemd's file-descriptor store");
            let _ = ready.delivered.send(Ok(()));
            true
        }
        Err(e) => {
            // Taken and not stored: closed, never resumed here.
            registry.metrics.session_handover("lost");
            warn!(conn = id, error = %e, "restart: the session could not be stored; it is closed");
            let _ = ready.delivered.send(Err(format!("not stored: {e}")));
            false
        }
    }
}

fn random_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    aws_lc_rs::rand::fill(&mut id).expect("the system's random source");
    id
}
