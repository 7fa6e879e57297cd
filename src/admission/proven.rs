//! Which sources have proven themselves: one of their clients presented
//! a certificate, was given a session and opened an export, within
//! `--source-memory`, under the TLS files and policy in force now. Such a
//! source may use the handshake reserve and keeps its waiters when the
//! line is full (see `fair`).
//!
//! Why this bar and no lower: anything a peer can do without a credential
//! the policy honours (finish a TLS handshake, present a certificate the
//! policy then gives nothing) an attacker can do once per address and
//! then flood as a trusted source. Why a generation: a reload can revoke
//! the certificate or narrow the policy that proved a source, and what it
//! proved must not outlive that: neither here nor in the queue, where a
//! source's line keeps its class while it has a handshake open or
//! waiting (`Admission` demotes every line at a reload, and a line whose
//! source is no longer proven when a connection of it arrives). Why a cap per identity: one tenant's
//! certificate must not prove every address it can reach (the /64s of a
//! /48 are 65,536 sources).

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::{Duration, Instant};

use super::{Identity, Source};

/// Sources remembered at most. Full, new ones are not added (the expired
/// are dropped first): hosts proven before keep their standing.
pub const MAX_SOURCES: usize = 65_536;
/// Sources one client identity may prove; beyond it, its connections from
/// further sources are served as unproven.
pub const SOURCES_PER_IDENTITY: usize = 16;

/// The TLS files and policy in force: `(TLS reloads, policy reloads)`.
pub type Generation = (u64, u64);

struct Entry {
    at: Instant,
    identity: u64,
    generation: Generation,
}

pub struct Proven {
    memory: Duration,
    entries: HashMap<Source, Entry>,
    per_identity: HashMap<u64, usize>,
    /// The generation last seen by [`Proven::reloaded`].
    seen: Generation,
}

impl Proven {
    pub fn new(memory: Duration) -> Self {
        Proven {
            memory,
            entries: HashMap::new(),
            per_identity: HashMap::new(),
            seen: (0, 0),
        }
    }

    /// Whether `generation` differs from the one seen last: then a reload
    /// happened since, and everything proven before it is forgotten here
    /// (the caller demotes the sources' lines in the queue, which would
    /// otherwise stay proven while they keep a handshake open or waiting).
    pub fn reloaded(&mut self, generation: Generation) -> bool {
        if generation == self.seen {
            return false;
        }
        self.seen = generation;
        // Whatever was proven under this generation already stays.
        self.forget_expired(generation);
        true
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_proven(&self, source: Source, generation: Generation) -> bool {
        self.entries
            .get(&source)
            .is_some_and(|e| self.live(e, generation))
    }

    fn live(&self, entry: &Entry, generation: Generation) -> bool {
        entry.generation == generation && entry.at.elapsed() < self.memory
    }

    /// `identity` opened an export from `source` (or its session there
    /// ended): the source is proven from now. Returns whether it is.
    pub fn prove(&mut self, source: Source, identity: &Identity, generation: Generation) -> bool {
        if self.memory.is_zero() {
            return false;
        }
        let identity = {
            let mut h = DefaultHasher::new();
            identity.hash(&mut h);
            h.finish()
        };
        if let Some(entry) = self.entries.get_mut(&source) {
            if entry.identity == identity {
                entry.at = Instant::now();
                entry.generation = generation;
                return true;
            }
        }
        let room = |p: &Self| {
            p.per_identity.get(&identity).copied().unwrap_or(0) < SOURCES_PER_IDENTITY
                && (p.entries.len() < MAX_SOURCES || p.entries.contains_key(&source))
        };
        if !room(self) {
            // Linear, but only when an identity or the map is at its cap.
            self.forget_expired(generation);
            if !room(self) {
                return false;
            }
        }
        let entry = Entry {
            at: Instant::now(),
            identity,
            generation,
        };
        if let Some(old) = self.entries.insert(source, entry) {
            self.uncount(old.identity);
        }
        *self.per_identity.entry(identity).or_insert(0) += 1;
        true
    }

    fn forget_expired(&mut self, generation: Generation) {
        let memory = self.memory;
        let mut gone = Vec::new();
        self.entries.retain(|_, e| {
            let keep = e.generation == generation && e.at.elapsed() < memory;
            if !keep {
                gone.push(e.identity);
            }
            keep
        });
        for identity in gone {
            self.uncount(identity);
        }
    }

    fn uncount(&mut self, identity: u64) {
        if let Some(n) = self.per_identity.get_mut(&identity) {
            *n -= 1;
            if *n == 0 {
                self.per_identity.remove(&identity);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    fn source(i: u32) -> Source {
        crate::source::source_key(IpAddr::from(i.to_be_bytes()), 32, 64)
    }

    fn named(cn: &str) -> Identity {
        Identity::of(Some(&crate::tls::CertInfo::with_names(cn, &[], &[])))
    }

    #[test]
    fn a_reload_or_the_memory_running_out_unproves() {
        let mut p = Proven::new(Duration::from_secs(3600));
        assert!(p.prove(source(1), &named("a"), (0, 0)));
        assert!(p.is_proven(source(1), (0, 0)));
        assert!(!p.is_proven(source(2), (0, 0)));
        // A TLS or policy reload since: no longer.
        assert!(!p.is_proven(source(1), (1, 0)));
        assert!(!p.is_proven(source(1), (0, 1)));
        let mut p = Proven::new(Duration::ZERO);
        assert!(!p.prove(source(1), &named("a"), (0, 0)));
        assert!(!p.is_proven(source(1), (0, 0)));
    }

    #[test]
    fn one_identity_proves_at_most_its_share_of_sources() {
        let mut p = Proven::new(Duration::from_secs(3600));
        for i in 0..SOURCES_PER_IDENTITY as u32 {
            assert!(p.prove(source(i), &named("tenant"), (0, 0)));
        }
        assert!(!p.prove(source(1000), &named("tenant"), (0, 0)));
        assert!(!p.is_proven(source(1000), (0, 0)));
        // Another identity is not held back, and refreshing is free.
        assert!(p.prove(source(1000), &named("host"), (0, 0)));
        assert!(p.prove(source(0), &named("tenant"), (0, 0)));
        // After a reload the old entries are expired: room again.
        assert!(p.prove(source(2000), &named("tenant"), (1, 0)));
        assert_eq!(p.len(), 1, "the entries of the old generation are gone");
    }

    #[test]
    fn a_reload_seen_forgets_everything_once() {
        let mut p = Proven::new(Duration::from_secs(3600));
        assert!(!p.reloaded((0, 0)));
        assert!(p.prove(source(1), &named("a"), (0, 0)));
        assert!(!p.reloaded((0, 0)));
        assert!(p.reloaded((0, 1)));
        assert_eq!(p.len(), 0);
        assert!(!p.reloaded((0, 1)));
        assert!(p.prove(source(1), &named("a"), (0, 1)));
        assert!(p.reloaded((1, 1)));
        assert!(!p.is_proven(source(1), (1, 1)));
        // Proven under the new generation before the reload was seen:
        // kept.
        assert!(p.prove(source(2), &named("a"), (2, 1)));
        assert!(p.reloaded((2, 1)));
        assert!(p.is_proven(source(2), (2, 1)));
        assert_eq!(p.len(), 1);
    }
}
