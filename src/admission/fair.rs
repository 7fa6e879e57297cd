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
//! waiter and is below its cap.
//!
//! Sources come in two classes. A proven source is one whose client
//! recently authenticated with a certificate and opened an export (see
//! `Admission::prove`); every other source is unproven. Unproven sources
//! together hold at most `unproven_budget` slots (`--max-handshakes` less
//! `--handshake-reserve`): slow or silent handshakes from any number of
//! unproven sources cannot hold the slots a proven host's VMs need when
//! they reconnect. Otherwise both classes take turns alike (no strict
//! priority, so a source that has proven itself cannot lock unproven
//! ones out). When every place in line is taken an unproven waiter makes
//! room, the longest waiter of the unproven source with the most waiting;
//! a proven waiter makes room only for another proven connection, so an
//! attacker spread over many sources cannot make a proven host's burst,
//! the busiest source, the one shed.
//!
//! Finding the busiest source and leaving a turn order are linear in the
//! sources waiting, which `--handshake-queue` bounds (1024 by default).

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// What a connection arriving gets.
#[derive(Debug)]
pub enum Arrival<T> {
    /// A slot, now; `proven`: one of the proven sources' (given back with
    /// [`FairQueue::release`] saying so).
    Go { proven: bool },
    /// A place in its source's line, known by `ticket`. `shed` is the
    /// waiter that had to make room (the longest waiter of the source
    /// with the most waiting), when every place was taken.
    Wait { ticket: u64, shed: Option<T> },
    /// Its source already has `--handshake-queue-per-source` waiting.
    SourceLineFull,
    /// Every place is taken by waiters it may not displace (proven ones,
    /// for an unproven newcomer), or there are no places at all.
    QueueFull,
}

#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Slots in all (`--max-handshakes`).
    pub budget: usize,
    /// Of those, how many unproven sources may hold together
    /// (`--max-handshakes` less `--handshake-reserve`).
    pub unproven_budget: usize,
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
    /// Of `in_use`, the slots given to unproven sources.
    unproven_in_use: usize,
    waiting: usize,
    sources: HashMap<S, Line<T>>,
    /// The sources with someone waiting, in the order they are served.
    turns: VecDeque<S>,
    next_ticket: u64,
}

const PROVEN: usize = 0;
const UNPROVEN: usize = 1;

struct Line<T> {
    active: usize,
    proven: bool,
    waiters: VecDeque<(u64, T)>,
}

impl<T> Line<T> {
    fn class(&self) -> usize {
        if self.proven {
            PROVEN
        } else {
            UNPROVEN
        }
    }
}

impl<T> Default for Line<T> {
    fn default() -> Self {
        Line {
            active: 0,
            proven: false,
            waiters: VecDeque::new(),
        }
    }
}

impl<S: Copy + Eq + Hash, T> FairQueue<S, T> {
    pub fn new(bounds: Bounds) -> Self {
        FairQueue {
            bounds,
            in_use: 0,
            unproven_in_use: 0,
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

    /// A connection from `source` (`proven`: see the module's comment);
    /// `waiter` is what it is woken through.
    pub fn arrive(&mut self, source: S, proven: bool, waiter: T) -> Arrival<T> {
        let bounds = self.bounds;
        let line = self.sources.entry(source).or_default();
        // A line with waiters becomes proven only through `promote`, which
        // hands on the slots that may then be theirs. It stops being
        // proven as soon as a connection of its source arrives unproven
        // (its memory ran out, or a reload forgot it), however many
        // handshakes it holds or has waiting: that is no standing to keep.
        if line.waiters.is_empty() || !proven {
            line.proven = proven;
        }
        // No one of this source waits ahead of it, and (the queue being
        // work-conserving) no other source of its class waits while a
        // slot it may take is free.
        let room = match line.proven {
            true => self.in_use < bounds.budget,
            false => self.in_use < bounds.budget && self.unproven_in_use < bounds.unproven_budget,
        };
        if line.waiters.is_empty() && line.active < bounds.cap && room {
            line.active += 1;
            self.in_use += 1;
            if !line.proven {
                self.unproven_in_use += 1;
            }
            return Arrival::Go {
                proven: line.proven,
            };
        }
        let class = line.class();
        if line.waiters.len() >= bounds.waiting_per_source {
            self.forget_if_idle(source);
            return Arrival::SourceLineFull;
        }
        let mut shed = None;
        if self.waiting >= bounds.waiting {
            // An unproven waiter makes room; a proven one only for another
            // proven connection.
            shed = self.shed_one(UNPROVEN);
            if shed.is_none() && class == PROVEN {
                shed = self.shed_one(PROVEN);
            }
            if shed.is_none() {
                self.forget_if_idle(source);
                return Arrival::QueueFull;
            }
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        // Made anew if shedding emptied this very line and forgot it.
        let line = self.sources.entry(source).or_default();
        line.proven = class == PROVEN;
        line.waiters.push_back((ticket, waiter));
        if line.waiters.len() == 1 {
            self.turns.push_back(source);
        }
        self.waiting += 1;
        Arrival::Wait { ticket, shed }
    }

    /// A reload forgot every proven source: their lines, waiters
    /// included, are unproven from now on. Slots already held keep the
    /// class they were given with (each is given back saying so).
    pub fn demote_all(&mut self) {
        for line in self.sources.values_mut() {
            line.proven = false;
        }
    }

    /// Every waiter, taken out of line (nbdgw stopped accepting).
    pub fn take_waiters(&mut self) -> Vec<T> {
        let mut taken = Vec::with_capacity(self.waiting);
        for line in self.sources.values_mut() {
            taken.extend(line.waiters.drain(..).map(|(_, waiter)| waiter));
        }
        self.sources.retain(|_, line| line.active > 0);
        self.turns.clear();
        self.waiting = 0;
        taken
    }

    /// One of `source`'s connections authenticated: from now on it is
    /// served as proven, its waiters included. Returns the waiters that
    /// get a slot now (the reserve may have been free).
    pub fn promote(&mut self, source: S) -> Vec<(S, T, bool)> {
        let Some(line) = self.sources.get_mut(&source) else {
            return Vec::new();
        };
        if line.proven {
            return Vec::new();
        }
        line.proven = true;
        if line.waiters.is_empty() {
            return Vec::new();
        }
        // Its waiters may now take the reserve.
        let mut granted = Vec::new();
        while let Some(grant) = self.next_turn() {
            granted.push(grant);
        }
        granted
    }

    /// A slot `source` held is free (`proven`: as [`Arrival::Go`] and the
    /// grants said): returns the waiters it goes to, now counted as
    /// holding their slots, and whether as proven. Usually one; two when
    /// an unproven slot given back leaves room in the unproven share as
    /// well as a slot a proven waiter takes.
    pub fn release(&mut self, source: S, proven: bool) -> Vec<(S, T, bool)> {
        if let Some(line) = self.sources.get_mut(&source) {
            line.active = line.active.saturating_sub(1);
            self.in_use = self.in_use.saturating_sub(1);
            if !proven {
                self.unproven_in_use = self.unproven_in_use.saturating_sub(1);
            }
        }
        self.forget_if_idle(source);
        let mut granted = Vec::new();
        while let Some(grant) = self.next_turn() {
            granted.push(grant);
        }
        granted
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

    /// The next source in turn that may take a slot (below its cap, and
    /// for an unproven source, below the unproven share) gives its longest
    /// waiter the free slot; the others keep their turn for later.
    fn next_turn(&mut self) -> Option<(S, T, bool)> {
        if self.in_use >= self.bounds.budget {
            return None;
        }
        let unproven_room = self.unproven_in_use < self.bounds.unproven_budget;
        for _ in 0..self.turns.len() {
            let source = self.turns.pop_front()?;
            let Some(line) = self.sources.get_mut(&source) else {
                continue;
            };
            if line.active >= self.bounds.cap || (!line.proven && !unproven_room) {
                self.turns.push_back(source);
                continue;
            }
            let Some((_, waiter)) = line.waiters.pop_front() else {
                continue;
            };
            line.active += 1;
            self.in_use += 1;
            if !line.proven {
                self.unproven_in_use += 1;
            }
            self.waiting -= 1;
            if !line.waiters.is_empty() {
                self.turns.push_back(source);
            }
            return Some((source, waiter, line.proven));
        }
        None
    }

    /// The source of `class` with the most waiting (the first such in
    /// turn order) gives up its longest waiter.
    fn shed_one(&mut self, class: usize) -> Option<T> {
        let mut busiest: Option<(S, usize)> = None;
        for source in &self.turns {
            let Some(line) = self.sources.get(source) else {
                continue;
            };
            if line.class() != class {
                continue;
            }
            let len = line.waiters.len();
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
        assert!(self.unproven_in_use <= b.unproven_budget);
        assert!(self.unproven_in_use <= self.in_use);
        assert!(self.waiting <= b.waiting);
        for (source, line) in &self.sources {
            assert!(line.active <= b.cap);
            assert!(line.waiters.len() <= b.waiting_per_source);
            assert!(line.active > 0 || !line.waiters.is_empty(), "idle kept");
            let in_turns = self.turns.iter().filter(|s| *s == source).count();
            assert_eq!(in_turns, usize::from(!line.waiters.is_empty()));
            // Work-conserving: no free slot while a waiter that may take
            // it waits.
            if !line.waiters.is_empty() && line.active < b.cap {
                assert!(
                    self.in_use == b.budget
                        || (!line.proven && self.unproven_in_use >= b.unproven_budget),
                    "a slot idle while {in_turns} waits"
                );
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
            unproven_budget: budget,
            cap,
            waiting,
            waiting_per_source: per_source,
        }
    }

    #[test]
    fn a_burst_from_one_source_waits_in_order_beyond_its_cap() {
        let mut q = FairQueue::new(bounds(64, 2, 100, 100));
        assert!(matches!(q.arrive('a', false, 0), Arrival::Go { .. }));
        assert!(matches!(q.arrive('a', false, 1), Arrival::Go { .. }));
        for i in 2..10 {
            assert!(matches!(
                q.arrive('a', false, i),
                Arrival::Wait { shed: None, .. }
            ));
        }
        // Each slot it frees goes to its next waiter, first come first.
        for i in 2..10 {
            assert_eq!(q.release('a', false), vec![('a', i, false)]);
            q.check_invariants();
        }
        assert_eq!(q.release('a', false), vec![]);
        assert_eq!(q.release('a', false), vec![]);
        assert!(q.sources.is_empty());
    }

    #[test]
    fn a_source_with_one_waiter_is_served_before_a_crowd_behind_it() {
        // Budget 2, both held by a; a has 5 more waiting; b arrives.
        let mut q = FairQueue::new(bounds(2, 2, 100, 100));
        q.arrive('a', false, 0);
        q.arrive('a', false, 1);
        for i in 2..7 {
            q.arrive('a', false, i);
        }
        assert!(matches!(q.arrive('b', false, 100), Arrival::Wait { .. }));
        // a's turn came first (it waited first), then b's.
        assert_eq!(q.release('a', false), vec![('a', 2, false)]);
        assert_eq!(q.release('a', false), vec![('b', 100, false)]);
        assert_eq!(q.release('a', false), vec![('a', 3, false)]);
        q.check_invariants();
    }

    #[test]
    fn the_longest_waiter_of_the_busiest_source_is_shed() {
        let mut q = FairQueue::new(bounds(1, 1, 4, 10));
        q.arrive('x', false, 0);
        q.arrive('b', false, 10);
        for i in 1..4 {
            q.arrive('a', false, i);
        }
        // Four waiting: a place for c costs a its longest waiter.
        let Arrival::Wait { shed, .. } = q.arrive('c', false, 20) else {
            panic!("c was not given a place");
        };
        assert_eq!(shed, Some(1));
        q.check_invariants();
        // A line of its own full: refused, nothing shed.
        let mut q = FairQueue::new(bounds(1, 1, 100, 2));
        q.arrive('a', false, 0);
        q.arrive('a', false, 1);
        q.arrive('a', false, 2);
        assert!(matches!(q.arrive('a', false, 3), Arrival::SourceLineFull));
        assert!(matches!(
            q.arrive('b', false, 4),
            Arrival::Wait { shed: None, .. }
        ));
        q.check_invariants();
    }

    /// Issue 20's review: an attacker spread over many sources fills the
    /// budget and every place, then a host that has authenticated before
    /// reconnects its VMs together. It is served before every one of the
    /// attacker's sources and none of its connections is shed; the
    /// attacker's waiters make room instead.
    #[test]
    fn a_proven_source_goes_first_and_is_never_shed_for_an_unproven_one() {
        let mut q = FairQueue::new(bounds(4, 1, 8, 8));
        // Four attacker sources hold the budget, eight more fill the line.
        for s in 0..12u32 {
            q.arrive(s, false, s);
        }
        assert_eq!((q.in_use(), q.waiting()), (4, 8));
        // The host: eight at once, each taking an attacker's place.
        for i in 0..8u32 {
            let Arrival::Wait {
                shed: Some(victim), ..
            } = q.arrive(100, true, 1000 + i)
            else {
                panic!("the proven host was not given a place");
            };
            assert!(victim < 100, "shed one of the host's own: {victim}");
        }
        // Only the host waits now: an unproven newcomer may not displace it.
        assert!(matches!(q.arrive(200, false, 2000), Arrival::QueueFull));
        q.check_invariants();
        // The first slot an attacker frees is the host's, and each the
        // host frees goes to its next (its cap is one), before any of the
        // attacker's waiters.
        assert_eq!(q.release(0, false), vec![(100, 1000, true)]);
        for i in 1..8 {
            assert_eq!(q.release(100, true), vec![(100, 1000 + i, true)]);
        }
        q.check_invariants();
    }

    #[test]
    fn at_shutdown_every_waiter_is_taken_out_of_line() {
        let mut q = FairQueue::new(bounds(1, 1, 10, 10));
        q.arrive('x', false, 0);
        q.arrive('a', false, 1);
        q.arrive('b', true, 2);
        let mut taken = q.take_waiters();
        taken.sort();
        assert_eq!(taken, vec![1, 2]);
        q.check_invariants();
        assert_eq!(q.release('x', false), vec![]);
        assert!(q.sources.is_empty());
    }

    /// Slow handshakes from any number of unproven sources hold at most
    /// the unproven share; the reserve stays for proven sources, and a
    /// source proven while it waits gets it at once.
    #[test]
    fn unproven_sources_cannot_hold_the_reserve() {
        let mut q = FairQueue::new(Bounds {
            budget: 4,
            unproven_budget: 2,
            cap: 4,
            waiting: 10,
            waiting_per_source: 10,
        });
        assert!(matches!(
            q.arrive(1, false, 1),
            Arrival::Go { proven: false }
        ));
        assert!(matches!(
            q.arrive(2, false, 2),
            Arrival::Go { proven: false }
        ));
        // The unproven share is spent: the next unproven waits, slots free.
        assert!(matches!(q.arrive(3, false, 3), Arrival::Wait { .. }));
        assert!(matches!(q.arrive(3, false, 4), Arrival::Wait { .. }));
        assert_eq!(q.in_use(), 2);
        q.check_invariants();
        // A proven source takes the reserve at once.
        assert!(matches!(q.arrive(9, true, 9), Arrival::Go { proven: true }));
        // Source 3 proves itself (one of its connections authenticated
        // elsewhere): its waiters take what is left of the budget.
        assert_eq!(q.promote(3), vec![(3, 3, true)]);
        q.check_invariants();
        assert_eq!(q.in_use(), 4);
        // An unproven slot given back goes to the proven waiter.
        assert_eq!(q.release(1, false), vec![(3, 4, true)]);
        q.check_invariants();
    }

    /// No strict priority: a source proven while it waits keeps its turn
    /// (only the reserve is its alone).
    #[test]
    fn a_source_proven_while_waiting_keeps_its_turn() {
        let mut q = FairQueue::new(bounds(1, 1, 10, 10));
        q.arrive('x', false, 0);
        q.arrive('a', false, 1);
        q.arrive('b', false, 2);
        assert!(q.promote('b').is_empty(), "no slot was free");
        q.check_invariants();
        assert_eq!(q.release('x', false), vec![('a', 1, false)]);
        assert_eq!(q.release('a', false), vec![('b', 2, true)]);
    }

    /// Issue 27 item 7: a source proven once stayed proven for as long
    /// as it kept one handshake open or waiting, past its memory and
    /// across reloads. Now a connection arriving unproven demotes its
    /// line, and a reload demotes every line.
    #[test]
    fn a_line_stops_being_proven_when_its_source_does() {
        let mut q = FairQueue::new(Bounds {
            budget: 3,
            unproven_budget: 1,
            cap: 3,
            waiting: 10,
            waiting_per_source: 10,
        });
        assert!(matches!(q.arrive(1, true, 1), Arrival::Go { proven: true }));
        assert!(matches!(
            q.arrive(2, false, 2),
            Arrival::Go { proven: false }
        ));
        // Source 1's memory ran out while it held a slot: its next
        // connection is unproven and waits for the unproven share.
        assert!(matches!(q.arrive(1, false, 3), Arrival::Wait { .. }));
        assert!(!q.sources[&1].proven);
        q.check_invariants();
        // Proven again, then a reload: its waiters lose the reserve.
        assert_eq!(q.promote(1), vec![(1, 3, true)]);
        assert!(matches!(q.arrive(1, true, 4), Arrival::Wait { .. }));
        q.demote_all();
        assert!(!q.sources[&1].proven);
        assert_eq!(q.release(1, true), vec![]);
        assert!(matches!(q.arrive(1, false, 5), Arrival::Wait { .. }));
        // The unproven share frees: 1's longest waiter, as unproven.
        assert_eq!(q.release(2, false), vec![(1, 4, false)]);
        q.check_invariants();
    }

    #[test]
    fn a_cancelled_waiter_leaves_nothing_behind() {
        let mut q = FairQueue::new(bounds(1, 1, 10, 10));
        q.arrive('a', false, 0);
        let Arrival::Wait { ticket, .. } = q.arrive('b', false, 1) else {
            panic!("no wait");
        };
        assert!(q.cancel('b', ticket));
        assert!(!q.cancel('b', ticket));
        q.check_invariants();
        assert_eq!(q.release('a', false), vec![]);
        assert!(q.sources.is_empty() && q.turns.is_empty());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Arrive(u8),
        Release(u8),
        Cancel(u8),
        Promote(u8),
        /// A connection of a source whose memory ran out arrives.
        ArriveForgotten(u8),
        /// A reload forgets every proven source.
        Reload,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u8..5).prop_map(Op::Arrive),
            3 => (0u8..5).prop_map(Op::Release),
            2 => (0u8..5).prop_map(Op::Cancel),
            1 => (0u8..5).prop_map(Op::Promote),
            1 => (0u8..5).prop_map(Op::ArriveForgotten),
            1 => Just(Op::Reload),
        ]
    }

    /// What the property test knows of the queue: who holds a slot (and
    /// as proven or not), who waits (source, ticket, id), which sources
    /// are proven, and how each arrival ended.
    #[derive(Default)]
    struct Model {
        holding: Vec<(u8, bool)>,
        waiting: Vec<(u8, u64, u32)>,
        proven: std::collections::HashSet<u8>,
        next: u32,
        outcomes: HashMap<u32, &'static str>,
    }

    type Queue = FairQueue<u8, u32>;

    impl Model {
        fn apply(&mut self, q: &mut Queue, op: Op) -> Result<(), TestCaseError> {
            match op {
                Op::ArriveForgotten(s) => {
                    self.proven.remove(&s);
                    self.arrive(q, s)
                }
                Op::Reload => {
                    self.proven.clear();
                    q.demote_all();
                    Ok(())
                }
                Op::Arrive(s) => self.arrive(q, s),
                Op::Release(i) => self.release(q, i),
                Op::Cancel(i) => self.cancel(q, i),
                Op::Promote(s) => self.promote(q, s),
            }
        }

        fn arrive(&mut self, q: &mut Queue, s: u8) -> Result<(), TestCaseError> {
            let id = self.next;
            self.next += 1;
            let unproven_waiting = self.waiting.iter().any(|w| !self.proven.contains(&w.0));
            match q.arrive(s, self.proven.contains(&s), id) {
                Arrival::Go { proven: as_proven } => {
                    prop_assert_eq!(as_proven, self.proven.contains(&s) || q.sources[&s].proven);
                    self.holding.push((s, as_proven));
                    self.outcomes.insert(id, "go");
                }
                Arrival::Wait { ticket, shed } => {
                    if let Some(victim) = shed {
                        prop_assert_eq!(self.outcomes.insert(victim, "shed"), Some("wait"));
                        let from = self.take_waiting(victim).0;
                        if self.proven.contains(&from) {
                            prop_assert!(
                                self.proven.contains(&s) && !unproven_waiting,
                                "a proven waiter shed for {}",
                                s
                            );
                        }
                    }
                    self.waiting.push((s, ticket, id));
                    self.outcomes.insert(id, "wait");
                }
                Arrival::SourceLineFull | Arrival::QueueFull => {
                    self.outcomes.insert(id, "refused");
                }
            }
            Ok(())
        }

        fn release(&mut self, q: &mut Queue, i: u8) -> Result<(), TestCaseError> {
            if self.holding.is_empty() {
                return Ok(());
            }
            let (s, as_proven) = self.holding.remove(i as usize % self.holding.len());
            for (to, id, to_proven) in q.release(s, as_proven) {
                prop_assert_eq!(self.outcomes.insert(id, "granted"), Some("wait"));
                let from = self.take_waiting(id).0;
                prop_assert_eq!(from, to);
                prop_assert_eq!(to_proven, self.proven.contains(&to));
                self.holding.push((to, to_proven));
            }
            Ok(())
        }

        fn cancel(&mut self, q: &mut Queue, i: u8) -> Result<(), TestCaseError> {
            if self.waiting.is_empty() {
                return Ok(());
            }
            let (s, ticket, id) = self.waiting.remove(i as usize % self.waiting.len());
            prop_assert!(q.cancel(s, ticket));
            self.outcomes.insert(id, "cancelled");
            Ok(())
        }

        fn promote(&mut self, q: &mut Queue, s: u8) -> Result<(), TestCaseError> {
            self.proven.insert(s);
            for (to, id, to_proven) in q.promote(s) {
                prop_assert_eq!((to, to_proven), (s, true));
                prop_assert_eq!(self.outcomes.insert(id, "granted"), Some("wait"));
                self.take_waiting(id);
                self.holding.push((to, true));
            }
            Ok(())
        }

        fn take_waiting(&mut self, id: u32) -> (u8, u64, u32) {
            let at = self.waiting.iter().position(|w| w.2 == id).unwrap();
            self.waiting.remove(at)
        }
    }

    proptest! {
        /// Whatever the order of arrivals, ends, give-ups and promotions:
        /// no source above its cap, the bounds hold, no slot idle while a
        /// waiter could use it, every waiter accounted for exactly once
        /// (granted, shed, cancelled or still waiting), unproven sources
        /// never above their share, and a proven waiter is shed only for a
        /// proven newcomer when no unproven one waits.
        #[test]
        fn the_bounds_hold_no_slot_idles_and_proven_waiters_are_kept(
            budget in 1usize..6, reserve in 0usize..3, cap in 1usize..4, waiting in 0usize..6,
            per_source in 1usize..4, ops in proptest::collection::vec(op(), 1..200)
        ) {
            let unproven_budget = budget.saturating_sub(reserve).max(1);
            let mut q = FairQueue::new(Bounds { unproven_budget, ..bounds(budget, cap, waiting, per_source) });
            let mut model = Model::default();
            for op in ops {
                let reload = matches!(op, Op::Reload);
                model.apply(&mut q, op)?;
                q.check_invariants();
                if reload {
                    continue;
                }
                prop_assert_eq!(q.in_use(), model.holding.len());
                prop_assert_eq!(q.unproven_in_use, model.holding.iter().filter(|h| !h.1).count());
                prop_assert!(q.unproven_in_use <= unproven_budget);
                prop_assert_eq!(q.waiting(), model.waiting.len());
            }
        }
    }
}
