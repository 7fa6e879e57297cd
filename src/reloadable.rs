//! What the live reloads (TLS files, the policy file) share: a value that
//! new connections read and a reload swaps, and the triggers that start a
//! reload (SIGHUP, or a poll of the files).

use std::sync::{Arc, RwLock};
use std::time::Duration;

use tracing::warn;

/// The value handed to each new connection; connections keep the `Arc`
/// they took, so a swap never changes one already running.
pub struct Swap<T> {
    current: RwLock<Arc<T>>,
}

impl<T> Swap<T> {
    pub fn new(value: Arc<T>) -> Self {
        Swap {
            current: RwLock::new(value),
        }
    }

    pub fn current(&self) -> Arc<T> {
        // A poisoned lock still holds a complete Arc: replacing it is a
        // single assignment, which cannot be left half done.
        match self.current.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub fn replace(&self, value: Arc<T>) {
        match self.current.write() {
            Ok(mut guard) => *guard = value,
            Err(poisoned) => *poisoned.into_inner() = value,
        }
    }
}

/// The files' contents as the last reload read them (or why they could
/// not be read), so that a poll acts only on a change.
pub struct LastSeen<M>(Result<M, String>);

impl<M: Clone + PartialEq> LastSeen<M> {
    pub fn new(material: M) -> Self {
        LastSeen(Ok(material))
    }

    /// `read` if the reload should go on: always for SIGHUP, for a poll
    /// only when it differs from what was seen last.
    pub fn changed(
        &mut self,
        trigger: Trigger,
        read: Result<M, String>,
    ) -> Option<Result<M, String>> {
        if trigger == Trigger::Poll && read == self.0 {
            return None;
        }
        self.0 = read.clone();
        Some(read)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// The periodic look at the files: acts only when their bytes changed.
    Poll,
    /// SIGHUP: reload even if nothing seems to have changed.
    Signal,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReloadOutcome {
    Unchanged,
    Reloaded,
    /// The previous configuration stays in use.
    Failed,
}

/// SIGHUP and, if `interval` is given, a timer.
pub struct Triggers {
    hangup: Option<tokio::signal::unix::Signal>,
    poll: Option<tokio::time::Interval>,
}

impl Triggers {
    /// `what` names the files in the warning when SIGHUP cannot be watched.
    pub fn new(interval: Option<Duration>, what: &str) -> Self {
        use tokio::signal::unix::{signal, SignalKind};
        let hangup = match signal(SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                warn!(error = %e, "cannot watch SIGHUP; {what} reload only when the files change");
                None
            }
        };
        let poll = interval.map(|every| {
            let mut timer = tokio::time::interval(every);
            timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            timer
        });
        Triggers { hangup, poll }
    }

    /// The next trigger; `None` when there can be none.
    pub async fn next(&mut self) -> Option<Trigger> {
        tokio::select! {
            Some(()) = async { self.hangup.as_mut()?.recv().await } => Some(Trigger::Signal),
            Some(_) = async { Some(self.poll.as_mut()?.tick().await) } => Some(Trigger::Poll),
            else => None,
        }
    }
}
