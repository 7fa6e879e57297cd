//! A session's quiesce hook, shared by its relay (which obeys it,
//! `crate::conn::relay::go_quiet`) and the hand-over (which asks).

use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// One session's hook, shared by the relay and whoever asks.
pub struct Quiesce {
    asked: AtomicBool,
    stopped: AtomicBool,
    changed: Notify,
    timeout: Duration,
    asked_at: Mutex<Option<Instant>>,
    /// When the request side stopped, once asked: where the pause its
    /// client sees begins (a session finishing a request began later
    /// than it was asked).
    stopped_at: Mutex<Option<Instant>>,
}

impl Quiesce {
    pub fn new(timeout: Duration) -> Self {
        Quiesce {
            asked: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            changed: Notify::new(),
            timeout,
            asked_at: Mutex::new(None),
            stopped_at: Mutex::new(None),
        }
    }

    /// Stop reading requests, finish what is in flight.
    pub fn ask(&self) {
        *self.asked_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        self.asked.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// When the request side was asked to stop (the start of the pause
    /// the client sees).
    pub fn asked_at(&self) -> Option<Instant> {
        *self.asked_at.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_asked(&self) -> bool {
        self.asked.load(Ordering::SeqCst)
    }

    /// The hand-over of this session is off: the relay goes on.
    pub fn cancel(&self) {
        self.asked.store(false, Ordering::SeqCst);
        self.stopped.store(false, Ordering::SeqCst);
    }

    pub fn set_stopped(&self) {
        *self.stopped_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        self.stopped.store(true, Ordering::SeqCst);
    }

    /// When the request side last stopped for a hand-over.
    pub fn stopped_at(&self) -> Option<Instant> {
        *self.stopped_at.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// Resolves once asked (at once if already).
    pub async fn asked(&self) {
        loop {
            let mut changed = pin!(self.changed.notified());
            changed.as_mut().enable();
            if self.is_asked() {
                return;
            }
            changed.await;
        }
    }
}

impl Quiesce {
    /// How long the relay may take to go quiet once asked.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}
