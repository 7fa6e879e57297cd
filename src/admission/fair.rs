//! The handshake budget's bookkeeping, apart from sockets, tasks and time
//! so every decision can be tested step by step: who gets a slot now, who
//! waits, who is shed, and who is served when a slot frees.
//!
//! A source never holds more than its cap of slots. It does not borrow
//! idle slots beyond it: a borrowed slot could not be taken back from a
//! handshake under way when another source arrives, so one source's slow
//! or silent handshakes could then hold the budget for a whole
//! `--handshake-timeout`. Connections above the cap, or arriving when the
//! budget is spent, wait, first come first served within their source;
//! a freed slot goes to the next source in turn (round-robin) that has a
//! waiter and is below its cap, so a source with hundreds waiting delays
//! a source with one by at most one turn.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// What a connection arriving gets.
#[derive(Debug)]
pub enum Arrival<T> {
    /// A slot, now.
    Go,
    /// A place in its source's line, known by `ticket`. `shed` is the
    /// waiter that had to make room (the longest waiter of the source
    /// with the most waiting), when every place was taken.
    Wait { ticket: u64, shed: Option<T> },
    /// Its source already has `--max-waiting-per-source` waiting.
    SourceLineFull,
}

#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Slots in all (`--max-handshakes`).
    pub budget: usize,
    /// Slots one source may hold (`--max-handshakes-per-source`).
    pub cap: usize,
    /// Connections waiting, all sources together (`--max-waiting`).
    pub waiting: usize,
    /// Connections waiting from one source (`--max-waiting-per-source`).
    pub waiting_per_source: usize,
}

pub struct FairQueue<S, T> {
    bounds: Bounds,
    in_use: usize,
    waiting: usize,
    sources: HashMap<S, Line<T>>,
    /// The sources with someone waiting, in the order they are served.
    turns: VecDeque<S>,
    next_ticket: u64,
}

struct Line<T> {
    active: usize,
    waiters: VecDeque<(u64, T)>,
}

impl<T> Default for Line<T> {
    fn default() -> Self {
        Line {
            active: 0,
            waiters: VecDeque::new(),
        }
    }
}

impl<S: Copy + Eq + Hash, T> FairQueue<S, T> {
    pub fn new(bounds: Bounds) -> Self {
        FairQueue {
            bounds,
            in_use: 0,
            waiting: 0,
            sources: HashMap::new(),
            turns: VecDeque::new(),
            next_ticket: 0,
        }
    }

    pub fn waiting(&self) -> usize {
        self.waiting
    }

    pub fn in_use(&self) -> usize {
        self.in_use
    }

    /// A connection from `source`; `waiter` is what it is woken through.
    pub fn arrive(&mut self, source: S, waiter: T) -> Arrival<T> {
        let bounds = self.bounds;
        let line = self.sources.entry(source).or_default();
        // No one of this source waits ahead of it, and (the queue being
        // work-conserving) no other source waits while a slot is free.
        if line.waiters.is_empty() && line.active < bounds.cap && self.in_use < bounds.budget {
            line.active += 1;
            self.in_use += 1;
            return Arrival::Go;
        }
        if line.waiters.len() >= bounds.waiting_per_source || bounds.waiting == 0 {
            self.forget_if_idle(source);
            return Arrival::SourceLineFull;
        }
        let shed = if self.waiting >= bounds.waiting {
            self.shed_one()
        } else {
            None
        };
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let line = self.sources.entry(source).or_default();
        line.waiters.push_back((ticket, waiter));
        if line.waiters.len() == 1 {
            self.turns.push_back(source);
        }
        self.waiting += 1;
        Arrival::Wait { ticket, shed }
    }

    /// A slot `source` held is free: returns the waiter it goes to, if
    /// any, now counted as holding it.
    pub fn release(&mut self, source: S) -> Option<(S, T)> {
        if let Some(line) = self.sources.get_mut(&source) {
            line.active = line.active.saturating_sub(1);
            self.in_use = self.in_use.saturating_sub(1);
        }
        self.forget_if_idle(source);
        self.next_turn()
    }

    /// A waiter that gave up (timed out, or its task ended). False if it
    /// is no longer waiting: it was granted its slot, or shed.
    pub fn cancel(&mut self, source: S, ticket: u64) -> bool {
        let Some(line) = self.sources.get_mut(&source) else {
            return false;
        };
        let Some(at) = line.waiters.iter().position(|(t, _)| *t == ticket) else {
            return false;
        };
        line.waiters.remove(at);
        let empty = line.waiters.is_empty();
        self.waiting -= 1;
        if empty {
            self.turns.retain(|s| *s != source);
        }
        self.forget_if_idle(source);
        true
    }

    /// The next source in turn below its cap gives its longest waiter
    /// the free slot; sources at their cap keep their turn for later.
    fn next_turn(&mut self) -> Option<(S, T)> {
        if self.in_use >= self.bounds.budget {
            return None;
        }
        for _ in 0..self.turns.len() {
            let source = self.turns.pop_front()?;
            let Some(line) = self.sources.get_mut(&source) else {
                continue;
            };
            if line.active >= self.bounds.cap {
                self.turns.push_back(source);
                continue;
            }
            let Some((_, waiter)) = line.waiters.pop_front() else {
                continue;
            };
            line.active += 1;
            self.in_use += 1;
            self.waiting -= 1;
            if !line.waiters.is_empty() {
                self.turns.push_back(source);
            }
            return Some((source, waiter));
        }
        None
    }

    /// Every place is taken: the source with the most waiting gives up
    /// its longest waiter (the first such source in turn order).
    fn shed_one(&mut self) -> Option<T> {
        let mut busiest: Option<(S, usize)> = None;
        for source in &self.turns {
            let len = self.sources.get(source).map_or(0, |l| l.waiters.len());
            if busiest.is_none_or(|(_, most)| len > most) {
                busiest = Some((*source, len));
            }
        }
        let (busiest, _) = busiest?;
        let line = self.sources.get_mut(&busiest)?;
        let (_, waiter) = line.waiters.pop_front()?;
        let empty = line.waiters.is_empty();
        self.waiting -= 1;
        if empty {
            self.turns.retain(|s| *s != busiest);
        }
        self.forget_if_idle(busiest);
        Some(waiter)
    }

    /// A source with nothing held and no one waiting takes no memory.
    fn forget_if_idle(&mut self, source: S) {
        if self
            .sources
            .get(&source)
            .is_some_and(|line| line.active == 0 && line.waiters.is_empty())
        {
            self.sources.remove(&source);
        }
    }

    #[cfg(test)]
    fn check_invariants(&self) {
        let b = self.bounds;
        let active: usize = self.sources.values().map(|l| l.active).sum();
        let waiting: usize = self.sources.values().map(|l| l.waiters.len()).sum();
        assert_eq!(active, self.in_use);
        assert_eq!(waiting, self.waiting);
        assert!(self.in_use <= b.budget);
        assert!(self.waiting <= b.waiting);
        for (source, line) in &self.sources {
            assert!(line.active <= b.cap);
            assert!(line.waiters.len() <= b.waiting_per_source);
            assert!(line.active > 0 || !line.waiters.is_empty(), "idle kept");
            let in_turns = self.turns.iter().filter(|s| *s == source).count();
            assert_eq!(in_turns, usize::from(!line.waiters.is_empty()));
            // Work-conserving: no free slot while an eligible waiter waits.
            if !line.waiters.is_empty() && line.active < b.cap {
                assert_eq!(self.in_use, b.budget, "a slot idle while {in_turns} waits");
            }
        }
        assert!(self.turns.iter().all(|s| self.sources.contains_key(s)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bounds(budget: usize, cap: usize, waiting: usize, per_source: usize) -> Bounds {
        Bounds {
            budget,
            cap,
            waiting,
            waiting_per_source: per_source,
        }
    }

    #[test]
    fn a_burst_from_one_source_waits_in_order_beyond_its_cap() {
        let mut q = FairQueue::new(bounds(64, 2, 100, 100));
        assert!(matches!(q.arrive('a', 0), Arrival::Go));
        assert!(matches!(q.arrive('a', 1), Arrival::Go));
        for i in 2..10 {
            assert!(matches!(q.arrive('a', i), Arrival::Wait { shed: None, .. }));
        }
        // Each slot it frees goes to its next waiter, first come first.
        for i in 2..10 {
            assert_eq!(q.release('a'), Some(('a', i)));
            q.check_invariants();
        }
        assert_eq!(q.release('a'), None);
        assert_eq!(q.release('a'), None);
        assert!(q.sources.is_empty());
    }

    #[test]
    fn a_source_with_one_waiter_is_served_before_a_crowd_behind_it() {
        // Budget 2, both held by a; a has 5 more waiting; b arrives.
        let mut q = FairQueue::new(bounds(2, 2, 100, 100));
        q.arrive('a', 0);
        q.arrive('a', 1);
        for i in 2..7 {
            q.arrive('a', i);
        }
        assert!(matches!(q.arrive('b', 100), Arrival::Wait { .. }));
        // a's turn came first (it waited first), then b's.
        assert_eq!(q.release('a'), Some(('a', 2)));
        assert_eq!(q.release('a'), Some(('b', 100)));
        assert_eq!(q.release('a'), Some(('a', 3)));
        q.check_invariants();
    }

    #[test]
    fn the_longest_waiter_of_the_busiest_source_is_shed() {
        let mut q = FairQueue::new(bounds(1, 1, 4, 10));
        q.arrive('x', 0);
        q.arrive('b', 10);
        for i in 1..4 {
            q.arrive('a', i);
        }
        // Four waiting: a place for c costs a its longest waiter.
        let Arrival::Wait { shed, .. } = q.arrive('c', 20) else {
            panic!("c was not given a place");
        };
        assert_eq!(shed, Some(1));
        q.check_invariants();
        // A line of its own full: refused, nothing shed.
        let mut q = FairQueue::new(bounds(1, 1, 100, 2));
        q.arrive('a', 0);
        q.arrive('a', 1);
        q.arrive('a', 2);
        assert!(matches!(q.arrive('a', 3), Arrival::SourceLineFull));
        assert!(matches!(q.arrive('b', 4), Arrival::Wait { shed: None, .. }));
        q.check_invariants();
    }

    #[test]
    fn a_cancelled_waiter_leaves_nothing_behind() {
        let mut q = FairQueue::new(bounds(1, 1, 10, 10));
        q.arrive('a', 0);
        let Arrival::Wait { ticket, .. } = q.arrive('b', 1) else {
            panic!("no wait");
        };
        assert!(q.cancel('b', ticket));
        assert!(!q.cancel('b', ticket));
        q.check_invariants();
        assert_eq!(q.release('a'), None);
        assert!(q.sources.is_empty() && q.turns.is_empty());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Arrive(u8),
        Release(u8),
        Cancel(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..5).prop_map(Op::Arrive),
            (0u8..5).prop_map(Op::Release),
            (0u8..5).prop_map(Op::Cancel),
        ]
    }

    proptest! {
        /// Whatever the order of arrivals, ends and give-ups: no source
        /// above its cap, the bounds hold, no slot idle while a waiter
        /// could use it, and every waiter is accounted for exactly once
        /// (granted, shed, cancelled or still waiting).
        #[test]
        fn the_bounds_hold_and_no_slot_idles(
            budget in 1usize..6, cap in 1usize..4, waiting in 0usize..6,
            per_source in 1usize..4, ops in proptest::collection::vec(op(), 1..200)
        ) {
            let mut q = FairQueue::new(bounds(budget, cap, waiting, per_source));
            let mut holding: Vec<u8> = Vec::new();
            let mut waiting_tickets: Vec<(u8, u64, u32)> = Vec::new();
            let mut next = 0u32;
            let mut outcomes: HashMap<u32, &str> = HashMap::new();
            for op in ops {
                match op {
                    Op::Arrive(s) => {
                        let id = next;
                        next += 1;
                        match q.arrive(s, id) {
                            Arrival::Go => { holding.push(s); outcomes.insert(id, "go"); }
                            Arrival::Wait { ticket, shed } => {
                                waiting_tickets.push((s, ticket, id));
                                if let Some(victim) = shed {
                                    prop_assert_eq!(outcomes.insert(victim, "shed"), Some("wait"));
                                    waiting_tickets.retain(|w| w.2 != victim);
                                }
                                outcomes.insert(id, "wait");
                            }
                            Arrival::SourceLineFull => { outcomes.insert(id, "refused"); }
                        }
                    }
                    Op::Release(i) => {
                        if holding.is_empty() { continue; }
                        let s = holding.remove(i as usize % holding.len());
                        if let Some((to, id)) = q.release(s) {
                            prop_assert_eq!(outcomes.insert(id, "granted"), Some("wait"));
                            let at = waiting_tickets.iter().position(|w| w.2 == id).unwrap();
                            let (from, _, _) = waiting_tickets.remove(at);
                            prop_assert_eq!(from, to);
                            holding.push(to);
                        }
                    }
                    Op::Cancel(i) => {
                        if waiting_tickets.is_empty() { continue; }
                        let (s, ticket, id) = waiting_tickets.remove(i as usize % waiting_tickets.len());
                        prop_assert!(q.cancel(s, ticket));
                        outcomes.insert(id, "cancelled");
                    }
                }
                q.check_invariants();
                prop_assert_eq!(q.in_use(), holding.len());
                prop_assert_eq!(q.waiting(), waiting_tickets.len());
            }
        }
    }
}
