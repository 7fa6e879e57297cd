//! The sessions this process may hand to a successor, each with its
//! offer and its relay's quiesce hook (`hook`): shared by the sessions
//! (which register and report) and the hand-over
//! (`crate::handover::sessions`, which offers them and collects their
//! states). Depends on neither, so that the configuration can hold it.

mod hook;
mod patience;

pub use hook::Quiesce;
pub use patience::{not_quiet, Patience};

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::metrics::Metrics;

/// Every session a successor may take, by connection id.
pub struct Registry {
    open: Mutex<HashMap<u64, Entry>>,
    /// Sessions restored from systemd's store whose task has not
    /// registered yet (`Arriving`): a stop waits for them before it lists
    /// the sessions, or it would drain the ones still starting.
    arriving: Mutex<std::collections::HashSet<u64>>,
    arrived: std::sync::Condvar,
    /// Sessions went to systemd's store (`set_stored`): they wait there
    /// until this process exits, so the drain is bounded (`drain_bound`).
    stored: std::sync::atomic::AtomicBool,
    /// `--handover-quiesce-timeout`.
    pub quiesce_timeout: Duration,
    /// `--handover-timeout`: each message's bound.
    pub timeout: Duration,
    /// `--handover-max-key-generations`.
    pub max_key_generations: usize,
    /// Taking a session's state (its TLS 1.3 key walk) runs on the
    /// blocking pool one session at a time: a client that ran its keys
    /// on costs the sessions queued behind it, never the relays (review
    /// round 2, R2). A process hands over once, so this is per hand-over.
    pub takes: tokio::sync::Semaphore,
    pub metrics: Arc<Metrics>,
}

struct Entry {
    offer: Arc<Vec<u8>>,
    hook: Arc<Quiesce>,
    slot: Arc<Slot>,
}

/// Where a session reports how its hand-over went, while someone waits.
pub struct Slot {
    id: u64,
    state: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    tx: Option<mpsc::Sender<(u64, Outcome)>>,
    /// The session is gone: a slot opened after this reports Ended at
    /// once (it may end between being listed and being asked).
    ended: bool,
}

/// A session's answer to being asked to go quiet.
pub enum Outcome {
    /// Quiet, and its state taken: the predecessor no longer has it.
    Ready(Box<Ready>),
    /// It stays here (not quiet in time, or its state could not be
    /// taken): why.
    Withdrawn(String),
    /// It ended (the client left, a reload ended it) before it was quiet:
    /// nothing to hand over, nothing to drain.
    Ended,
}

/// A session's state and sockets, to be sent as one State.
pub struct Ready {
    /// `TlsState::encode`.
    pub tls: zeroize::Zeroizing<Vec<u8>>,
    pub ahead: Vec<u8>,
    pub counts: [u64; 4],
    pub tcp: OwnedFd,
    pub upstream: OwnedFd,
    /// When it stopped reading requests (not when it was asked to: a
    /// session finishing a request was served meanwhile); its pause runs
    /// from here to the successor's Taken.
    pub stopped_at: Instant,
    /// Told whether the successor serves it (Taken), or why not: the
    /// session's own audit line says which, not just that its state left.
    pub delivered: tokio::sync::oneshot::Sender<Result<(), String>>,
}

/// One session's place in the registry; removed when dropped.
pub struct Registered {
    registry: Arc<Registry>,
    id: u64,
    hook: Arc<Quiesce>,
    slot: Arc<Slot>,
}

/// A restored session not yet registered (`Registry::arriving`).
pub struct Arriving {
    registry: Arc<Registry>,
    id: u64,
}

impl Drop for Arriving {
    fn drop(&mut self) {
        self.registry.arrive(self.id);
    }
}

/// A session as the hand-over sees it.
pub struct Listed {
    pub id: u64,
    pub offer: Arc<Vec<u8>>,
    pub hook: Arc<Quiesce>,
    pub slot: Arc<Slot>,
}

impl Registry {
    pub fn new(
        quiesce_timeout: Duration,
        timeout: Duration,
        max_key_generations: usize,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        Arc::new(Registry {
            open: Mutex::default(),
            arriving: Mutex::default(),
            arrived: std::sync::Condvar::new(),
            stored: std::sync::atomic::AtomicBool::new(false),
            quiesce_timeout,
            timeout,
            max_key_generations,
            takes: tokio::sync::Semaphore::new(1),
            metrics,
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Entry>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Session `id` may be handed over, as `offer` (encoded) says.
    pub fn register(self: &Arc<Self>, id: u64, offer: Vec<u8>) -> Registered {
        let hook = Arc::new(Quiesce::new(self.quiesce_timeout));
        let slot = Arc::new(Slot {
            id,
            state: Mutex::default(),
        });
        let entry = Entry {
            offer: Arc::new(offer),
            hook: hook.clone(),
            slot: slot.clone(),
        };
        self.lock().insert(id, entry);
        self.arrive(id);
        Registered {
            registry: self.clone(),
            id,
            hook,
            slot,
        }
    }

    /// Session `id` is on its way to `register` (or to its end); until
    /// then, and while the guard lives, `wait_arrivals` waits for it.
    pub fn arriving(self: &Arc<Self>, id: u64) -> Arriving {
        self.arriving
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id);
        Arriving {
            registry: self.clone(),
            id,
        }
    }

    fn arrive(&self, id: u64) {
        let mut arriving = self.arriving.lock().unwrap_or_else(PoisonError::into_inner);
        if arriving.remove(&id) && arriving.is_empty() {
            self.arrived.notify_all();
        }
    }

    /// Blocks until every `arriving` session registered or ended, or
    /// `bound` passed; how many are still on their way.
    pub fn wait_arrivals(&self, bound: Duration) -> usize {
        let arriving = self.arriving.lock().unwrap_or_else(PoisonError::into_inner);
        let (arriving, _) = self
            .arrived
            .wait_timeout_while(arriving, bound, |a| !a.is_empty())
            .unwrap_or_else(PoisonError::into_inner);
        arriving.len()
    }

    /// Sessions were left in systemd's store: see `drain_bound`.
    pub fn set_stored(&self) {
        self.stored.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// How long the drain after SIGTERM may last: `grace`, or, once
    /// sessions are in systemd's store, at most the quiesce timeout.
    /// systemd starts the next instance only when this one has exited, so
    /// every stored session waits for this drain: one session that was not
    /// quiet in time (any client can leave a write half sent) must not
    /// hold them all for --shutdown-grace. What is cut had its
    /// unanswered requests never acknowledged.
    pub fn drain_bound(&self, grace: Duration) -> Duration {
        match self.stored.load(std::sync::atomic::Ordering::SeqCst) {
            true => grace.min(self.quiesce_timeout),
            false => grace,
        }
    }

    pub fn list(&self) -> Vec<Listed> {
        self.lock()
            .iter()
            .map(|(id, e)| Listed {
                id: *id,
                offer: e.offer.clone(),
                hook: e.hook.clone(),
                slot: e.slot.clone(),
            })
            .collect()
    }
}

impl Registered {
    pub fn hook(&self) -> &Quiesce {
        &self.hook
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Whether someone waits for this session's outcome.
    pub fn awaited(&self) -> bool {
        self.slot.lock().tx.is_some()
    }

    /// Reports the outcome, once per ask (the slot closes); given back
    /// if nobody waits any more.
    pub fn report(&self, outcome: Outcome) -> Result<(), Outcome> {
        match self.slot.lock().tx.take() {
            Some(tx) => tx.send((self.id, outcome)).map_err(|e| e.0 .1),
            None => Err(outcome),
        }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.id);
        // A session that ends while a hand-over waits for it (the client
        // left, a reload ended it) is not waited for until the timeout;
        // nor one that ends before the hand-over asks it (`Slot::open`).
        self.slot.lock().ended = true;
        let _ = self.report(Outcome::Ended);
    }
}

impl Slot {
    fn lock(&self) -> MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// From now on the session's outcome goes to `tx`; Ended at once if
    /// the session is already gone (it ended after it was listed: before,
    /// the hand-over waited the whole quiesce timeout for it).
    pub fn open(&self, tx: mpsc::Sender<(u64, Outcome)>) {
        let mut state = self.lock();
        match state.ended {
            true => drop(tx.send((self.id, Outcome::Ended))),
            false => state.tx = Some(tx),
        }
    }

    /// Nobody waits any more: a report after this is refused, and the
    /// session keeps what it has.
    pub fn close(&self) {
        self.lock().tx = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry() -> Arc<Registry> {
        let metrics = Arc::new(Metrics::client_mode());
        Registry::new(Duration::from_secs(5), Duration::from_secs(5), 8, metrics)
    }

    /// A session that ends after the hand-over listed it and before it
    /// was asked (its slot opened once the successor accepted it)
    /// reports Ended as the slot opens. Before, nothing came, and the
    /// hand-over waited the whole quiesce timeout for it.
    #[test]
    fn a_session_gone_before_its_slot_opens_reports_ended_at_once() {
        let registry = registry();
        let session = registry.register(7, vec![1]);
        let listed = registry.list();
        drop(session);
        assert!(registry.list().is_empty());
        let (tx, rx) = mpsc::channel();
        listed[0].slot.open(tx);
        let (id, outcome) = rx.try_recv().expect("Ended at once");
        assert_eq!(id, 7);
        assert!(matches!(outcome, Outcome::Ended));
    }

    /// One that ends while its slot is open reports Ended once, as
    /// before.
    #[test]
    fn a_session_ending_while_asked_reports_ended_once() {
        let registry = registry();
        let session = registry.register(3, vec![1]);
        let (tx, rx) = mpsc::channel();
        registry.list()[0].slot.open(tx);
        drop(session);
        assert!(matches!(rx.try_recv(), Ok((3, Outcome::Ended))));
        assert!(rx.try_recv().is_err());
    }
}
