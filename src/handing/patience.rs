//! How long a hand-over waits for the sessions it asked to go quiet (on
//! the channel, `crate::handover::sessions::give`, and into systemd's
//! store, `crate::handover::fdstore::stash`).
//!
//! Going quiet is bounded by `--handover-quiesce-timeout`: a session not
//! quiet by then (and a margin) is withdrawn and drains here. Taking the
//! states of those that are quiet is not a fixed window: they are taken
//! one at a time (`Registry::takes`), each followed by its own exchange,
//! so hundreds of sessions on a loaded machine can take longer than any
//! window, and cutting them off there would drain sessions that did
//! everything in time. They are waited for as long as reports keep
//! coming, each within `--handover-timeout` of the one before: a stuck
//! session bounds the wait, it does not stretch it.

use std::time::{Duration, Instant};

use super::{Listed, Registry};

/// The hand-over's wait for reports.
pub struct Patience {
    quiet_by: Instant,
    /// `--handover-timeout`: the longest wait between two reports, once
    /// the quiesce is over.
    between: Duration,
    last: Instant,
}

impl Patience {
    /// Begins as the sessions are asked; `margin`: beyond the quiesce
    /// timeout, for a quiet session's state to be taken.
    pub fn new(registry: &Registry, margin: Duration) -> Self {
        let quiet_by = Instant::now() + registry.quiesce_timeout + margin;
        Patience {
            quiet_by,
            between: registry.timeout,
            last: quiet_by,
        }
    }

    /// Past the quiesce timeout (and margin): a session not quiet now
    /// is withdrawn (`not_quiet`).
    pub fn quiesce_over(&self) -> bool {
        Instant::now() >= self.quiet_by
    }

    /// A session reported.
    pub fn reported(&mut self) {
        self.last = self.last.max(Instant::now());
    }

    /// How long to wait for the next report (zero: the rest are late).
    pub fn left(&self) -> Duration {
        let until = match self.quiesce_over() {
            true => self.last + self.between,
            false => self.quiet_by,
        };
        until.saturating_duration_since(Instant::now())
    }
}

/// Of the sessions in `waiting`, those not quiet: their request side is
/// not stopped for the hand-over (a relay that was not quiet in time
/// cancels its stop and reads on). A session stopped and quiet waits for
/// its state to be taken, and keeps its stop until it reports.
pub fn not_quiet(listed: &[Listed], waiting: &std::collections::HashSet<u64>) -> Vec<u64> {
    listed
        .iter()
        .filter(|l| waiting.contains(&l.id) && !l.hook.is_stopped())
        .map(|l| l.id)
        .collect()
}
