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

use std::os::fd::AsFd;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::blob::Stored;
use super::notify::Notifier;
use super::session_name;
use crate::handing::{Listed, Outcome, Ready, Registry};
use crate::proto::handover_session::{Offer, State};

/// Beyond the quiesce timeout: taking a quiet session's state.
const TAKE_MARGIN: Duration = Duration::from_secs(2);
/// How long systemd may take to read the messages before this exits.
const BARRIER_TIMEOUT: Duration = Duration::from_secs(10);

/// Stores every session that goes quiet in time; the others go on and
/// drain. Blocking; bounded by the quiesce timeout and the barrier's.
pub fn give(registry: &Registry, notifier: &Notifier) {
    // Kernel TLS sessions are handed over on the channel (--take-over),
    // tested in the VM with a kernel that re-keys; through the store they
    // are not tested yet, so they drain here as at any stop.
    let listed: Vec<Listed> = registry
        .list()
        .into_iter()
        .filter(|l| Offer::decode(&l.offer).is_ok_and(|offer| !offer.kernel_tls))
        .collect();
    if listed.is_empty() {
        return;
    }
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
    let until = Instant::now() + registry.quiesce_timeout + TAKE_MARGIN;
    let mut left = listed.len();
    let mut stored = 0;
    while left > 0 {
        let Ok((id, outcome)) = rx.recv_timeout(until.saturating_duration_since(Instant::now()))
        else {
            break;
        };
        left -= 1;
        stored += usize::from(store(registry, notifier, (id, handover), outcome, &listed));
    }
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
        if let Err(e) = notifier.barrier(BARRIER_TIMEOUT) {
            warn!(error = %e, "restart: systemd did not confirm it read the stored sessions; some may be lost");
        }
    }
    info!(
        stored,
        drained = listed.len() - stored,
        "restart: sessions stored for the next instance; the others drain"
    );
}

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
