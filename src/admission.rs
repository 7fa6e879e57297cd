//! Who gets a slot. Peers that have not yet authenticated draw from a
//! budget of their own (`--max-handshakes`, at most
//! `--max-handshakes-per-source` from one source, with a short queue),
//! apart from the authenticated sessions (`--max-connections`), so a flood
//! of silent or slow connections can delay other handshakes but never
//! takes an established session's place, and one source cannot hold all
//! the handshake slots. A source is a prefix, not an address
//! (`--source-prefix-v6`, default /64; `--source-prefix-v4`, default /32):
//! one IPv6 host is routinely given a whole /64, so keyed by address it
//! could be as many sources as it cares to configure addresses. Authenticated sessions are capped per client
//! identity as well (`--max-sessions-per-identity`), so one tenant's
//! certificate cannot hold every session slot with idle sessions.
//!
//! The identity a session counts against is the set of names the policy
//! and the `--allow-*` lists judge (subject CNs, DNS and URI SANs), not
//! the certificate's fingerprint or key: a tenant whose issuer re-issues
//! certificates on demand (cert-manager, SPIRE) gets a new fingerprint,
//! and usually a new key, with every issuance, so either would let it
//! split itself into as many identities as it asks for certificates, and
//! a rotation would free its old sessions' count. Its names are what the
//! trust gives it and it cannot choose them, and across a rotation they
//! stay the same. The issuer is left out for the same reason the policy
//! ignores it: certificates with the same names are one principal to
//! every rule. Clients without certificates (no client CA) are one
//! identity together.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{debug, warn};

use crate::config::Config;

/// How long a connection may wait for a handshake slot once all are taken.
/// Long enough to ride out a burst of reconnecting VMs; short enough that
/// a waiting peer costs a descriptor for moments, not minutes.
pub const HANDSHAKE_QUEUE_WAIT: Duration = Duration::from_secs(2);
/// Refusals are summed up in one log line this often, so a flood cannot
/// turn into a flood of log lines.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// How many leading bits of a peer's address make its source, per family.
/// Only [`SourcePrefixes::new`] (and the default) makes one, so the
/// lengths are always in range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourcePrefixes {
    v4: u8,
    v6: u8,
}

pub const DEFAULT_SOURCE_PREFIX_V4: u8 = 32;
/// The smallest prefix an IPv6 host is usually given (RFC 6177, SLAAC):
/// every address in it may be the same machine.
pub const DEFAULT_SOURCE_PREFIX_V6: u8 = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum PrefixError {
    #[error("--source-prefix-v4 must be 0 to 32, not {0}")]
    V4(u8),
    #[error("--source-prefix-v6 must be 0 to 128, not {0}")]
    V6(u8),
}

impl SourcePrefixes {
    pub fn new(v4: u8, v6: u8) -> Result<Self, PrefixError> {
        if v4 > 32 {
            return Err(PrefixError::V4(v4));
        }
        if v6 > 128 {
            return Err(PrefixError::V6(v6));
        }
        Ok(SourcePrefixes { v4, v6 })
    }

    /// The source `ip` counts against.
    pub fn source_of(&self, ip: IpAddr) -> Source {
        source_key(ip, self.v4, self.v6)
    }
}

impl Default for SourcePrefixes {
    fn default() -> Self {
        SourcePrefixes {
            v4: DEFAULT_SOURCE_PREFIX_V4,
            v6: DEFAULT_SOURCE_PREFIX_V6,
        }
    }
}

/// A source: a network address with its host bits cleared, and the
/// prefix length that cleared them. Shown as `2001:db8:1:2::/64`, so a
/// log line names the whole prefix that was busy, not one of its hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Source {
    network: IpAddr,
    len: u8,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.len)
    }
}

/// The source `ip` counts against: its first `v4_prefix` (IPv4) or
/// `v6_prefix` (IPv6) bits. An IPv4-mapped IPv6 address is its IPv4
/// address first, so a client on a dual-stack socket is judged by the
/// IPv4 prefix like every other IPv4 client (as a /64 of `::ffff:0:0/96`
/// the whole IPv4 internet would be one source). Lengths beyond the
/// family's width are taken as the full width, so the function is total;
/// `SourcePrefixes` never passes such a length.
pub fn source_key(ip: IpAddr, v4_prefix: u8, v6_prefix: u8) -> Source {
    match ip.to_canonical() {
        IpAddr::V4(v4) => {
            let len = v4_prefix.min(32);
            // `checked_shl` is `None` for a shift by the full width, which
            // is the /0 case: no bit of the address is kept.
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            Source {
                network: IpAddr::V4(Ipv4Addr::from(u32::from(v4) & mask)),
                len,
            }
        }
        IpAddr::V6(v6) => {
            let len = v6_prefix.min(128);
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            Source {
                network: IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask)),
                len,
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Refusal {
    #[error("--max-handshakes-per-source ({limit}) reached for {prefix}")]
    SourceBusy { limit: usize, prefix: Source },
    #[error("--max-handshakes ({0}) reached and the queue is full")]
    QueueFull(usize),
    #[error("no handshake slot within {0:?} (--max-handshakes reached)")]
    QueueTimeout(Duration),
    #[error("--max-connections ({0}) reached")]
    SessionsFull(usize),
    #[error("--max-sessions-per-identity ({0}) reached for this client identity")]
    IdentityFull(usize),
}

impl Refusal {
    /// The `reason` label of a refused session: a fixed few values.
    pub fn metric_reason(&self) -> &'static str {
        match self {
            Refusal::SourceBusy { .. } => "per_source",
            Refusal::QueueFull(_) => "queue_full",
            Refusal::QueueTimeout(_) => "queue_timeout",
            Refusal::SessionsFull(_) => "max_connections",
            Refusal::IdentityFull(_) => "per_identity",
        }
    }
}

/// Who a session counts against for `--max-sessions-per-identity`: the
/// certificate's names, sorted and without repeats (DNS names lower-cased,
/// as they are matched), or no certificate at all.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Identity {
    Anonymous,
    Named {
        common_names: Vec<String>,
        dns_names: Vec<String>,
        uris: Vec<String>,
    },
}

impl Identity {
    /// `cert`: the client certificate's names, `None` without one.
    pub fn of(cert: Option<&crate::tls::CertInfo>) -> Self {
        let Some(cert) = cert else {
            return Identity::Anonymous;
        };
        let canonical = |names: &[String], fold: fn(&str) -> String| {
            let mut names: Vec<String> = names.iter().map(|n| fold(n)).collect();
            names.sort();
            names.dedup();
            names
        };
        Identity::Named {
            common_names: canonical(&cert.common_names, str::to_owned),
            dns_names: canonical(&cert.dns_names, str::to_ascii_lowercase),
            uris: canonical(&cert.uris, str::to_owned),
        }
    }
}

pub struct Admission {
    handshakes: Arc<Semaphore>,
    max_handshakes: usize,
    /// Connections waiting for a handshake slot; at most `max_handshakes`.
    queued: Semaphore,
    per_source_limit: usize,
    prefixes: SourcePrefixes,
    per_source: Mutex<HashMap<Source, usize>>,
    sessions: Arc<Semaphore>,
    max_sessions: usize,
    per_identity_limit: usize,
    /// Sessions held per identity; an identity is forgotten with its last
    /// session, so this never holds more entries than there are sessions.
    per_identity: Arc<IdentityCounts>,
    refusals: RefusalLog,
}

/// One connection counted against its source prefix until dropped.
pub struct SourceClaim {
    admission: Arc<Admission>,
    source: Source,
}

/// Held from accept until the client has authenticated.
pub struct HandshakePermit {
    _slot: OwnedSemaphorePermit,
    _source: SourceClaim,
}

/// Held for as long as an authenticated session lasts.
pub struct SessionPermit {
    _slot: OwnedSemaphorePermit,
    _identity: IdentityClaim,
}

type IdentityCounts = Mutex<HashMap<Identity, usize>>;

/// One session counted against its identity until dropped.
struct IdentityClaim {
    counts: Arc<IdentityCounts>,
    identity: Identity,
}

/// As `Admission::sources`: one increment or decrement at a time, never
/// half done.
fn lock_counts(counts: &IdentityCounts) -> MutexGuard<'_, HashMap<Identity, usize>> {
    counts.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Admission {
    pub fn new(config: &Config) -> Arc<Self> {
        Arc::new(Admission {
            handshakes: Arc::new(Semaphore::new(config.max_handshakes)),
            max_handshakes: config.max_handshakes,
            queued: Semaphore::new(config.max_handshakes),
            per_source_limit: config.max_handshakes_per_source,
            prefixes: config.source_prefixes,
            per_source: Mutex::default(),
            sessions: Arc::new(Semaphore::new(config.max_connections)),
            max_sessions: config.max_connections,
            per_identity_limit: config.max_sessions_per_identity,
            per_identity: Arc::default(),
            refusals: RefusalLog::default(),
        })
    }

    fn sources(&self) -> MutexGuard<'_, HashMap<Source, usize>> {
        // Each change is one increment or decrement: never half done.
        self.per_source
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// At accept, without waiting: counts the connection against its
    /// source prefix, or refuses it.
    pub fn claim_source(self: &Arc<Self>, peer: SocketAddr) -> Result<SourceClaim, Refusal> {
        let source = self.prefixes.source_of(peer.ip());
        let mut sources = self.sources();
        let held = sources.entry(source).or_insert(0);
        if *held >= self.per_source_limit {
            return Err(Refusal::SourceBusy {
                limit: self.per_source_limit,
                prefix: source,
            });
        }
        *held += 1;
        Ok(SourceClaim {
            admission: self.clone(),
            source,
        })
    }

    /// A handshake slot, at once or after a short wait in the queue.
    pub async fn handshake(&self, source: SourceClaim) -> Result<HandshakePermit, Refusal> {
        let slot = match self.handshakes.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                let _place = self
                    .queued
                    .try_acquire()
                    .map_err(|_| Refusal::QueueFull(self.max_handshakes))?;
                let wait = self.handshakes.clone().acquire_owned();
                tokio::time::timeout(HANDSHAKE_QUEUE_WAIT, wait)
                    .await
                    .map_err(|_| Refusal::QueueTimeout(HANDSHAKE_QUEUE_WAIT))?
                    .map_err(|_| Refusal::QueueFull(self.max_handshakes))?
            }
        };
        Ok(HandshakePermit {
            _slot: slot,
            _source: source,
        })
    }

    /// A session slot for a client that has just authenticated as
    /// `identity`: refused when that identity holds its share, or when
    /// every slot is taken.
    pub fn session(&self, identity: Identity) -> Result<SessionPermit, Refusal> {
        let claim = {
            let mut held = lock_counts(&self.per_identity);
            let count = held.entry(identity.clone()).or_insert(0);
            if *count >= self.per_identity_limit {
                // Nothing claimed: an entry this call created is dropped
                // again, so refusals leave nothing behind.
                if *count == 0 {
                    held.remove(&identity);
                }
                return Err(Refusal::IdentityFull(self.per_identity_limit));
            }
            *count += 1;
            IdentityClaim {
                counts: self.per_identity.clone(),
                identity,
            }
        };
        // Dropping `claim` on this error gives the identity's count back.
        let slot = self
            .sessions
            .clone()
            .try_acquire_owned()
            .map_err(|_| Refusal::SessionsFull(self.max_sessions))?;
        Ok(SessionPermit {
            _slot: slot,
            _identity: claim,
        })
    }

    /// Logs a refusal: each at debug, a summary at warn every ten seconds.
    pub fn log_refusal(&self, peer: SocketAddr, refusal: Refusal) {
        debug!(%peer, reason = %refusal, "connection refused");
        if let Some(count) = self.refusals.due() {
            warn!(
                refused = count,
                last_peer = %peer,
                last_reason = %refusal,
                "connections refused (at most one such line every {}s)",
                REFUSAL_LOG_EVERY.as_secs()
            );
        }
    }
}

impl Drop for SourceClaim {
    fn drop(&mut self) {
        let mut sources = self.admission.sources();
        if let Some(held) = sources.get_mut(&self.source) {
            *held -= 1;
            if *held == 0 {
                sources.remove(&self.source);
            }
        }
    }
}

impl Drop for IdentityClaim {
    fn drop(&mut self) {
        let mut held = lock_counts(&self.counts);
        if let Some(count) = held.get_mut(&self.identity) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.identity);
            }
        }
    }
}

#[derive(Default)]
struct RefusalLog {
    since_last: AtomicU64,
    last: Mutex<Option<Instant>>,
}

impl RefusalLog {
    /// Counts one refusal; returns the count to log when a line is due.
    fn due(&self) -> Option<u64> {
        self.since_last.fetch_add(1, Ordering::Relaxed);
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        if last.is_some_and(|at| now.duration_since(at) < REFUSAL_LOG_EVERY) {
            return None;
        }
        *last = Some(now);
        Some(self.since_last.swap(0, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(handshakes: usize, per_source: usize, sessions: usize) -> Arc<Admission> {
        let tls = crate::tls::TlsStore::fixed(test_server_config());
        let mut config = Config::new("/nonexistent".into(), tls);
        config.max_handshakes = handshakes;
        config.max_handshakes_per_source = per_source;
        config.max_connections = sessions;
        Admission::new(&config)
    }

    fn test_server_config() -> rustls::ServerConfig {
        let dir = tempfile::tempdir().unwrap();
        crate::certs::for_test(dir.path(), "localhost", 1);
        crate::tls::load_server_config(
            &dir.path().join("server-cert.pem"),
            &dir.path().join("server-key.pem"),
        )
        .unwrap()
    }

    fn peer(ip: &str, port: u16) -> SocketAddr {
        SocketAddr::new(ip.parse().unwrap(), port)
    }

    #[test]
    fn one_source_cannot_hold_more_than_its_share() {
        let a = admission(64, 2, 10);
        let first = a.claim_source(peer("192.0.2.1", 1)).unwrap();
        let second = a.claim_source(peer("192.0.2.1", 2)).unwrap();
        assert_eq!(
            a.claim_source(peer("192.0.2.1", 3))
                .err()
                .map(|r| r.to_string()),
            Some("--max-handshakes-per-source (2) reached for 192.0.2.1/32".to_owned())
        );
        // The same address as IPv4-mapped IPv6 is the same source.
        assert!(a.claim_source(peer("::ffff:192.0.2.1", 4)).is_err());
        let other = a.claim_source(peer("192.0.2.2", 1)).unwrap();
        drop(first);
        let third = a.claim_source(peer("192.0.2.1", 5)).unwrap();
        // Every claim given back leaves nothing behind.
        drop((second, third, other));
        assert!(a.sources().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn handshakes_queue_briefly_and_sessions_have_their_own_budget() {
        let a = admission(1, 8, 1);
        let source = |port| a.claim_source(peer("192.0.2.1", port)).unwrap();
        let held = a.handshake(source(1)).await.unwrap();
        // All handshake slots busy: one more waits, then gives up.
        let waited = a.handshake(source(2)).await.err();
        assert_eq!(waited, Some(Refusal::QueueTimeout(HANDSHAKE_QUEUE_WAIT)));
        // A slot freed while waiting is taken.
        let waiting = a.handshake(source(3));
        let (got, ()) = tokio::join!(waiting, async { drop(held) });
        let _permit = got.unwrap();
        // Sessions do not depend on handshake slots.
        let session = a.session(Identity::Anonymous).unwrap();
        assert_eq!(
            a.session(Identity::Anonymous).err(),
            Some(Refusal::SessionsFull(1))
        );
        drop(session);
        assert!(a.session(Identity::Anonymous).is_ok());
    }

    #[test]
    fn the_default_cap_is_a_quarter_with_certificates_and_everything_without() {
        use crate::config::default_sessions_per_identity as default;
        assert_eq!(default(1024, true), 256);
        assert_eq!(default(3, true), 1);
        assert_eq!(default(1024, false), 1024);
    }

    fn named(cn: &str, dns: &[&str]) -> Identity {
        Identity::of(Some(&crate::tls::CertInfo::with_names(cn, dns, &[])))
    }

    #[test]
    fn one_identity_cannot_hold_every_session_slot() {
        let tls = crate::tls::TlsStore::fixed(test_server_config());
        let mut config = Config::new("/nonexistent".into(), tls);
        config.max_connections = 4;
        config.max_sessions_per_identity = 2;
        let a = Admission::new(&config);
        let held: Vec<_> = (0..2)
            .map(|_| a.session(named("a", &[])).unwrap())
            .collect();
        assert_eq!(
            a.session(named("a", &[])).err(),
            Some(Refusal::IdentityFull(2))
        );
        // The same names in another order or case are the same identity
        // (a rotated certificate included); other names are another.
        let b = a.session(named("b", &["X.example", "y.example"])).unwrap();
        let b2 = a.session(named("b", &["y.example", "x.example"])).unwrap();
        assert_eq!(
            a.session(named("b", &["x.example", "y.example", "x.example"]))
                .err(),
            Some(Refusal::IdentityFull(2))
        );
        assert_eq!(
            a.session(named("c", &[])).err(),
            Some(Refusal::SessionsFull(4)),
            "the global budget still holds"
        );
        // Anonymous clients share one identity of their own.
        drop((b, b2));
        let anonymous = a.session(Identity::Anonymous).unwrap();
        drop(held);
        let second = a.session(Identity::Anonymous).unwrap();
        assert_eq!(
            a.session(Identity::Anonymous).err(),
            Some(Refusal::IdentityFull(2))
        );
        // Every refusal and every ended session leaves nothing behind.
        drop((anonymous, second));
        assert!(lock_counts(&a.per_identity).is_empty());
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_source_is_the_prefix_and_is_shown_as_one() {
        let key = |s, v4, v6| source_key(ip(s), v4, v6).to_string();
        assert_eq!(key("2001:db8:1:2:aaaa::5", 32, 64), "2001:db8:1:2::/64");
        assert_eq!(
            key("2001:db8:1:2:aaaa::5", 32, 128),
            "2001:db8:1:2:aaaa::5/128"
        );
        assert_eq!(key("2001:db8:1:2:aaaa::5", 32, 0), "::/0");
        assert_eq!(key("2001:db8:1:2:aaaa::5", 32, 63), "2001:db8:1:2::/63");
        assert_eq!(key("2001:db8:1:3::1", 32, 63), "2001:db8:1:2::/63");
        assert_eq!(key("192.0.2.77", 32, 64), "192.0.2.77/32");
        assert_eq!(key("192.0.2.77", 24, 64), "192.0.2.0/24");
        assert_eq!(key("192.0.2.77", 0, 64), "0.0.0.0/0");
        // IPv4-mapped IPv6 is IPv4 first: the v4 prefix applies, not the
        // v6 one (which would make all of IPv4 one source).
        assert_eq!(key("::ffff:192.0.2.77", 24, 64), "192.0.2.0/24");
        assert_eq!(key("::ffff:192.0.2.77", 32, 64), "192.0.2.77/32");
        // Lengths past the width are the width (the function is total).
        assert_eq!(key("192.0.2.77", 200, 200), "192.0.2.77/32");
        assert_eq!(key("::1", 200, 200), "::1/128");
    }

    #[test]
    fn prefix_lengths_are_checked() {
        assert!(SourcePrefixes::new(0, 0).is_ok());
        assert!(SourcePrefixes::new(32, 128).is_ok());
        assert_eq!(SourcePrefixes::new(33, 64), Err(PrefixError::V4(33)));
        assert_eq!(SourcePrefixes::new(32, 129), Err(PrefixError::V6(129)));
        assert_eq!(
            PrefixError::V6(129).to_string(),
            "--source-prefix-v6 must be 0 to 128, not 129"
        );
        assert_eq!(
            SourcePrefixes::default(),
            SourcePrefixes::new(32, 64).unwrap()
        );
    }

    #[test]
    fn one_slash_64_is_one_source_and_another_is_not_held_up() {
        let a = admission(64, 3, 10);
        // Many addresses of one /64, as one host may configure.
        let held: Vec<_> = (1..=3u16)
            .map(|i| {
                a.claim_source(peer(&format!("2001:db8:1:2::{i:x}"), 1))
                    .unwrap()
            })
            .collect();
        for i in 4..40u16 {
            let refused = a
                .claim_source(peer(&format!("2001:db8:1:2:{i:x}::{i:x}"), 1))
                .err()
                .map(|r| r.to_string());
            assert_eq!(
                refused.as_deref(),
                Some("--max-handshakes-per-source (3) reached for 2001:db8:1:2::/64")
            );
        }
        // The neighbouring /64 is another source.
        let other = a.claim_source(peer("2001:db8:1:3::1", 1)).unwrap();
        drop((held, other));
        assert!(a.sources().is_empty());
    }

    /// `a` and `b` agree in their first `len` of `width` bits.
    fn same_prefix(a: u128, b: u128, len: u8, width: u32) -> bool {
        let shift = width - u32::from(len);
        (a ^ b).checked_shr(shift).unwrap_or(0) == 0
    }

    fn not_mapped(v: u128) -> bool {
        Ipv6Addr::from(v).to_ipv4_mapped().is_none()
    }

    proptest::proptest! {
        #[test]
        fn v6_addresses_share_a_key_exactly_when_they_share_the_prefix(
            a: u128, b: u128, len in 0u8..=128, host: u128, bit in 0u32..128,
        ) {
            proptest::prop_assume!(not_mapped(a) && not_mapped(b));
            let key = |v: u128| source_key(IpAddr::V6(Ipv6Addr::from(v)), 32, len);
            proptest::prop_assert_eq!(key(a) == key(b), same_prefix(a, b, len, 128));
            // Any host part within a's prefix: the same key.
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            let sibling = (a & mask) | (host & !mask);
            proptest::prop_assume!(not_mapped(sibling));
            proptest::prop_assert_eq!(key(sibling), key(a));
            // One bit changed inside the prefix: another key.
            if len > 0 {
                let flipped = a ^ (1u128 << (127 - bit % u32::from(len)));
                proptest::prop_assume!(not_mapped(flipped));
                proptest::prop_assert_ne!(key(flipped), key(a));
            }
            // The key is the prefix itself: keying it again changes nothing.
            let IpAddr::V6(network) = key(a).network else {
                return Err(proptest::test_runner::TestCaseError::fail("v6 became v4"));
            };
            proptest::prop_assert_eq!(key(u128::from(network)), key(a));
        }

        #[test]
        fn v4_addresses_share_a_key_exactly_when_they_share_the_prefix(
            a: u32, b: u32, len in 0u8..=32, v6 in 0u8..=128,
        ) {
            let key = |v: u32| source_key(IpAddr::V4(Ipv4Addr::from(v)), len, v6);
            let same = same_prefix(u128::from(a), u128::from(b), len, 32);
            proptest::prop_assert_eq!(key(a) == key(b), same);
            // Mapped into IPv6, the same source, whatever the v6 length.
            let mapped = IpAddr::V6(Ipv4Addr::from(a).to_ipv6_mapped());
            proptest::prop_assert_eq!(source_key(mapped, len, v6), key(a));
        }
    }
}
