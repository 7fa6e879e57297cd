//! The budget before authentication: a handshake slot at once, or a
//! place in the source's line (`fair` decides whose turn comes), each
//! bounded in time from accept; the line closed at shutdown; and a slot
//! handed to the next waiter as it is given back. Every change to the
//! queue is made whole under its lock, so a poisoned lock is still
//! consistent and is taken over.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard, PoisonError};
use std::time::Instant;

use tokio::sync::oneshot;

use super::fair::{Arrival, FairQueue};
use super::{proven, Admission, Refusal};
use crate::source::Source;

/// A connection's place at accept: a handshake slot already, or a place
/// in its source's line.
pub struct Place {
    source: Source,
    state: PlaceState,
    /// By when the connection must have its session: accept plus
    /// `--handshake-timeout`, waiting in line included.
    deadline: tokio::time::Instant,
}

impl Place {
    /// By when the connection must have its session (negotiation done).
    pub fn deadline(&self) -> tokio::time::Instant {
        self.deadline
    }
}

enum PlaceState {
    Granted(HandshakePermit),
    Waiting {
        ticket: u64,
        granted: oneshot::Receiver<HandshakePermit>,
    },
}

/// Held from accept until the client has authenticated: one of its
/// source's handshake slots, given to the next waiter in turn on drop.
pub struct HandshakePermit {
    admission: Arc<Admission>,
    /// `None` once given back (a waiter gone before its slot came).
    source: Option<Source>,
    /// Whether the slot is one of the proven sources' (the reserve).
    pub(super) proven: bool,
}

impl Admission {
    pub(super) fn slots(
        &self,
    ) -> MutexGuard<'_, FairQueue<Source, oneshot::Sender<HandshakePermit>>> {
        self.slots_seen().0
    }

    /// The queue, and the generation it was brought up to date with.
    pub(super) fn slots_seen(
        &self,
    ) -> (
        MutexGuard<'_, FairQueue<Source, oneshot::Sender<HandshakePermit>>>,
        proven::Generation,
    ) {
        // A reload (TLS files or policy) since the last look: what was
        // proven before it is forgotten, in the queue's lines too, and
        // in the metric.
        let generation = self.generation();
        let reloaded = {
            let mut proven = self.proven();
            let reloaded = proven.reloaded(generation);
            if reloaded {
                self.metrics.proven_sources.set(proven.len() as i64);
            }
            reloaded
        };
        // Every change is made whole under the lock (no call in it can
        // panic half way), so a poisoned one is still consistent.
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        if reloaded {
            slots.demote_all();
        }
        (slots, generation)
    }

    pub(super) fn show(&self, queue: &FairQueue<Source, oneshot::Sender<HandshakePermit>>) {
        self.metrics
            .handshakes_in_progress
            .set(queue.in_use() as i64);
        self.metrics.handshakes_waiting.set(queue.waiting() as i64);
    }

    /// At accept, without waiting: a handshake slot, a place in line, or
    /// a refusal when the source's line is full. A waiter shed to make
    /// room is told so through its own task.
    #[cfg(test)]
    pub fn arrive(self: &Arc<Self>, peer: SocketAddr) -> Result<Place, Refusal> {
        self.arrive_since(peer, tokio::time::Instant::now())
    }

    /// As `arrive`, for a connection accepted at `accepted` whose source
    /// was known only later (from a PROXY protocol header): its time
    /// before a session still counts from accept.
    pub fn arrive_since(
        self: &Arc<Self>,
        peer: SocketAddr,
        accepted: tokio::time::Instant,
    ) -> Result<Place, Refusal> {
        // A PROXY header can complete after `close_waiters`: not queued.
        if self.closed.load(Ordering::Acquire) {
            return Err(Refusal::ShuttingDown);
        }
        let source = self.prefixes.source_of(peer.ip());
        let (tx, granted) = oneshot::channel();
        // Judged under the lock and the generation the queue was brought
        // up to date with: judged before, a reload in between would let
        // a source proven under the old files into the reserve of a queue
        // that has already demoted it.
        let (mut slots, generation) = self.slots_seen();
        let proven = self.proven().is_proven(source, generation);
        let arrival = slots.arrive(source, proven, tx);
        self.show(&slots);
        drop(slots);
        let state = match arrival {
            Arrival::Go { proven } => PlaceState::Granted(HandshakePermit {
                admission: self.clone(),
                source: Some(source),
                proven,
            }),
            // Dropping the shed waiter's sender wakes it with the news.
            Arrival::Wait { ticket, shed } => {
                drop(shed);
                PlaceState::Waiting { ticket, granted }
            }
            Arrival::SourceLineFull => {
                return Err(Refusal::SourceBusy {
                    limit: self.bounds.waiting_per_source,
                    prefix: source,
                })
            }
            Arrival::QueueFull => return Err(Refusal::QueueFull(self.bounds.waiting)),
        };
        let deadline = accepted + self.handshake_timeout;
        Ok(Place {
            source,
            state,
            deadline,
        })
    }

    /// By when a connection whose slot came just now must have its
    /// session: its place's deadline (accept plus `--handshake-timeout`),
    /// but never less than half of `--handshake-timeout` from now, so that
    /// a slot that came late in line is not handed over with no time to
    /// use it (a waiter granted 9.9 s into a 10 s bound had 0.1 s, and a
    /// real client failed). The wait in line is at most
    /// `--handshake-timeout`, so the whole time before a session is at
    /// most one and a half times it.
    pub fn session_deadline(&self, place_deadline: tokio::time::Instant) -> tokio::time::Instant {
        place_deadline.max(tokio::time::Instant::now() + self.handshake_timeout / 2)
    }

    /// The handshake slot: at once, or once this connection's turn comes
    /// (within `--handshake-queue-timeout` of accept, and before the
    /// place's deadline; see `session_deadline` for the time it then has).
    pub async fn handshake(self: &Arc<Self>, place: Place) -> Result<HandshakePermit, Refusal> {
        let Place {
            source,
            state,
            deadline,
        } = place;
        let (ticket, mut granted) = match state {
            PlaceState::Granted(permit) => return Ok(permit),
            PlaceState::Waiting { ticket, granted } => (ticket, granted),
        };
        self.metrics.handshake_waits.inc();
        let since = Instant::now();
        // The sender dropped unsent: shed, or every waiter told to go.
        let dropped = || match self.closed.load(Ordering::Acquire) {
            true => Refusal::ShuttingDown,
            false => Refusal::Shed(self.bounds.waiting),
        };
        // Counted from accept, as the deadline is: the task may start a
        // little after its connection was accepted.
        let wait = self.queue_timeout.min(self.handshake_timeout);
        let until = deadline - (self.handshake_timeout - wait);
        let result = match tokio::time::timeout_at(until, &mut granted).await {
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(_)) => Err(dropped()),
            Err(_) => {
                // In a block of its own: the guard must be gone before any
                // await, not just dropped.
                let gave_up = {
                    let mut slots = self.slots();
                    let gave_up = slots.cancel(source, ticket);
                    self.show(&slots);
                    gave_up
                };
                match gave_up {
                    true => Err(Refusal::QueueTimeout(wait)),
                    // Out of line already: its slot is being handed over
                    // (the sender is sent or dropped right after the lock
                    // is let go), or it was shed. Either comes at once.
                    false => granted.await.map_err(|_| dropped()),
                }
            }
        };
        if result.is_ok() {
            self.metrics
                .handshake_wait_seconds
                .observe(since.elapsed().as_secs_f64());
        }
        result
    }

    /// nbdgw stopped accepting: every connection still waiting for a
    /// handshake slot is closed now (it was sent nothing, so clients can
    /// go elsewhere at once), not given a slot and a handshake that would
    /// only end in NBD_REP_ERR_SHUTDOWN.
    pub fn close_waiters(&self) {
        self.closed.store(true, Ordering::Release);
        let mut slots = self.slots();
        let waiters = slots.take_waiters();
        self.show(&slots);
        drop(slots);
        // Each dropped sender wakes its waiter with the news.
        drop(waiters);
    }

    /// A slot of `source` is free: to the next waiter in turn, skipping
    /// any that went away before their turn came.
    pub(super) fn release(self: &Arc<Self>, source: Source, proven: bool) {
        let next = {
            let mut slots = self.slots();
            let next = slots.release(source, proven);
            self.show(&slots);
            next
        };
        self.hand_over(next);
    }

    /// Gives each granted waiter its permit; one that went away before its
    /// turn came gives the slot back, which may grant another.
    pub(super) fn hand_over(
        self: &Arc<Self>,
        mut grants: Vec<(Source, oneshot::Sender<HandshakePermit>, bool)>,
    ) {
        while let Some((to, waiter, proven)) = grants.pop() {
            let permit = HandshakePermit {
                admission: self.clone(),
                source: Some(to),
                proven,
            };
            if let Err(mut permit) = waiter.send(permit) {
                // Given back here, not in its drop, which would recurse.
                permit.source = None;
                let mut slots = self.slots();
                grants.extend(slots.release(to, proven));
                self.show(&slots);
            }
        }
    }
}

impl Drop for HandshakePermit {
    fn drop(&mut self) {
        if let Some(source) = self.source.take() {
            self.admission.release(source, self.proven);
        }
    }
}
