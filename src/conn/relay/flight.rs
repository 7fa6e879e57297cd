//! Requests in flight, shared by the two directions of a relay: the
//! request side claims cookies, the reply side completes them, and both
//! wait on each other through here.

use std::collections::HashMap;
use std::pin::pin;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::proto::transmission::{InFlight, InFlightTable};

pub struct Flight {
    state: Mutex<State>,
    /// Signalled whenever a request completes.
    completed: Notify,
}

/// The table and since when it has been empty with every reply written:
/// the two change together, under one lock, so the idle timeout never
/// sees a request between them.
pub struct State {
    pub table: InFlightTable,
    idle_since: Option<Instant>,
    /// When each request in flight arrived, for the latency histogram.
    arrived: HashMap<u64, Instant>,
}

impl Flight {
    pub fn new() -> Self {
        Flight {
            state: Mutex::new(State {
                table: InFlightTable::default(),
                idle_since: Some(Instant::now()),
                arrived: HashMap::new(),
            }),
            completed: Notify::new(),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        // The table stays consistent even if a holder panicked.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The request's last reply has passed: returns its command and how
    /// long it was in flight.
    pub fn complete(&self, cookie: u64) -> Option<(u16, Duration)> {
        let finished = {
            let mut state = self.lock();
            let request = state.table.remove(cookie);
            let arrived = state.arrived.remove(&cookie);
            request
                .zip(arrived)
                .map(|(r, at)| (r.command, at.elapsed()))
        };
        self.completed.notify_waiters();
        finished
    }

    pub fn is_empty(&self) -> bool {
        self.lock().table.is_empty()
    }

    /// Since when nothing has been in flight and every reply has been
    /// written; `None` while busy.
    pub fn idle_since(&self) -> Option<Instant> {
        self.lock().idle_since
    }

    /// Every reply so far has been written to the client.
    pub fn replies_written(&self) {
        let mut state = self.lock();
        if state.table.is_empty() && state.idle_since.is_none() {
            state.idle_since = Some(Instant::now());
            drop(state);
            // A hand-over waits for this (`wait_quiet`).
            self.completed.notify_waiters();
        }
    }

    /// Waits until nothing is in flight and every reply has been written
    /// (and flushed) to the client.
    pub async fn wait_quiet(&self) {
        self.wait_for(|state| state.table.is_empty() && state.idle_since.is_some())
            .await;
    }

    /// Records the request as in flight. A client that reuses a cookie
    /// still in flight is served in order: the second request waits until
    /// the first one's last reply has passed, so replies stay unambiguous.
    pub async fn claim(&self, cookie: u64, request: InFlight) {
        self.wait_for(|state| {
            let claimed = state.table.insert(cookie, request);
            if claimed {
                state.idle_since = None;
                state.arrived.insert(cookie, Instant::now());
            }
            claimed
        })
        .await;
    }

    /// Records a request nbdgw makes itself (read-ahead) under `cookie`,
    /// unless that cookie is in flight: false then, and nothing changes.
    pub fn try_claim(&self, cookie: u64, request: InFlight) -> bool {
        let mut state = self.lock();
        let claimed = state.table.insert(cookie, request);
        if claimed {
            state.idle_since = None;
            state.arrived.insert(cookie, Instant::now());
        }
        claimed
    }

    pub async fn wait_until_empty(&self) {
        self.wait_for(|state| state.table.is_empty()).await;
    }

    /// Waits until `ready` holds, checking again after every completion.
    async fn wait_for(&self, mut ready: impl FnMut(&mut State) -> bool) {
        loop {
            let mut completed = pin!(self.completed.notified());
            // Registered before the check, so a completion in between is
            // not missed.
            completed.as_mut().enable();
            if ready(&mut self.lock()) {
                return;
            }
            completed.await;
        }
    }
}
