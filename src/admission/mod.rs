//! Who gets a slot. Peers that have not yet authenticated draw from a
//! budget of their own (`--max-handshakes`, at most
//! `--max-handshakes-per-source` from one source), apart from the
//! authenticated sessions (`--max-connections`), so a flood of silent or
//! slow connections can delay other handshakes but never takes an
//! established session's place, and one source cannot hold all the
//! handshake slots. Connections beyond a source's share are not refused:
//! they wait (`--handshake-queue`, `--handshake-queue-per-source`, each
//! costing a descriptor and no buffers; see `fair` for the order), so
//! the VMs of one host reconnecting together are all served. A source is a prefix, not an address
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

//!
//! This file holds the budgets' shared state and the sources proven;
//! `handshake_slots` is the budget before authentication and its line,
//! `session_slots` the sessions after it and their count per identity;
//! `fair` and `proven` are their bookkeeping, without sockets or tasks.

mod fair;
mod handshake_slots;
mod proven;
mod session_slots;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use thiserror::Error;
use tokio::sync::{oneshot, Semaphore};
use tracing::{debug, warn};

use crate::config::Config;
use crate::metrics::Metrics;
use crate::source::{Source, SourcePrefixes};
use fair::{Bounds, FairQueue};
pub use handshake_slots::{HandshakePermit, Place};
use session_slots::IdentityCounts;
pub use session_slots::{Identity, SessionPermit};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Refusal {
    #[error("--handshake-queue-per-source ({limit}) reached for {prefix}: its handshakes (--max-handshakes-per-source) and its waiting places are all taken")]
    SourceBusy { limit: usize, prefix: Source },
    #[error("--handshake-queue ({0}) full: shed as the longest waiter of the source with the most waiting")]
    Shed(usize),
    #[error("--handshake-queue ({0}) full, and only proven sources wait")]
    QueueFull(usize),
    #[error("no handshake slot within {0:?} of accept (--handshake-queue-timeout, at most --handshake-timeout)")]
    QueueTimeout(Duration),
    #[error("nbdgw stopped accepting while it waited for a handshake slot")]
    ShuttingDown,
    #[error("--max-connections ({0}) reached")]
    SessionsFull(usize),
    #[error("--max-sessions-per-identity ({0}) reached for this client identity")]
    IdentityFull(usize),
}

impl Refusal {
    /// The `reason` label of a refused session: a fixed few values.
    pub fn metric_reason(&self) -> &'static str {
        match self {
            Refusal::SourceBusy { .. } => "source_queue_full",
            Refusal::Shed(_) => "shed_busiest_source",
            Refusal::QueueFull(_) => "queue_full",
            Refusal::QueueTimeout(_) => "queue_timeout",
            Refusal::ShuttingDown => "shutting_down",
            Refusal::SessionsFull(_) => "max_connections",
            Refusal::IdentityFull(_) => "per_identity",
        }
    }
}

pub struct Admission {
    /// Handshake slots and the connections waiting for one.
    slots: Mutex<FairQueue<Source, oneshot::Sender<HandshakePermit>>>,
    bounds: Bounds,
    queue_timeout: Duration,
    /// The time from accept to a session (`--handshake-timeout`): a place
    /// in line counts against it too, up to a guaranteed minimum (see
    /// `session_deadline`).
    handshake_timeout: Duration,
    prefixes: SourcePrefixes,
    /// The sources proven (see `proven`), for `fair`'s classes.
    proven: Mutex<proven::Proven>,
    /// Whose reloads end what proved a source.
    tls: Arc<crate::tls::TlsStore>,
    /// Set once nbdgw stops accepting: waiters are told at once.
    closed: std::sync::atomic::AtomicBool,
    sessions: Arc<Semaphore>,
    max_sessions: usize,
    per_identity_limit: usize,
    /// Sessions held per identity; an identity is forgotten with its last
    /// session, so this never holds more entries than there are sessions.
    per_identity: Arc<IdentityCounts>,
    refusals: crate::logsafe::RefusalLog,
    metrics: Arc<Metrics>,
}

impl Admission {
    pub fn new(config: &Config) -> Arc<Self> {
        let bounds = Bounds {
            budget: config.max_handshakes,
            // At least one slot for unproven sources whatever the config.
            unproven_budget: config
                .max_handshakes
                .saturating_sub(config.handshake_reserve)
                .max(1),
            cap: config.max_handshakes_per_source,
            waiting: config.handshake_queue,
            waiting_per_source: config.handshake_queue_per_source,
        };
        Arc::new(Admission {
            slots: Mutex::new(FairQueue::new(bounds)),
            bounds,
            queue_timeout: config.handshake_queue_timeout,
            handshake_timeout: config.handshake_timeout,
            prefixes: config.source_prefixes,
            proven: Mutex::new(proven::Proven::new(config.source_memory)),
            tls: config.tls.clone(),
            closed: std::sync::atomic::AtomicBool::new(false),
            sessions: Arc::new(Semaphore::new(config.max_connections)),
            max_sessions: config.max_connections,
            per_identity_limit: config.max_sessions_per_identity,
            per_identity: Arc::default(),
            refusals: crate::logsafe::RefusalLog::default(),
            metrics: config.metrics.clone(),
        })
    }

    fn proven(&self) -> MutexGuard<'_, proven::Proven> {
        self.proven.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The TLS files and policy in force, as reload counts: a reload ends
    /// what proved a source under the previous ones. A connection notes
    /// it before its handshake, to prove its source under it alone.
    pub fn generation(&self) -> proven::Generation {
        (
            self.tls.trust_changes.get(),
            self.metrics.policy_changes.get(),
        )
    }

    /// `identity` (a client certificate's names) was given a session from
    /// `peer` and opened an export, or such a session ended: its source is
    /// proven for `--source-memory`, and its waiters may take the reserve.
    /// `since`: the generation the connection started under; if a reload
    /// came since, the certificate or policy that let it in may no longer
    /// hold, and nothing is proven.
    pub fn prove(
        self: &Arc<Self>,
        peer: SocketAddr,
        identity: &Identity,
        since: proven::Generation,
    ) {
        if *identity == Identity::Anonymous || since != self.generation() {
            return;
        }
        let source = self.prefixes.source_of(peer.ip());
        // Stored under `since`: a reload racing this makes it stale at
        // once (an entry is live only under its own generation).
        let generation = since;
        let (proved, known) = {
            let mut proven = self.proven();
            (proven.prove(source, identity, generation), proven.len())
        };
        self.metrics.proven_sources.set(known as i64);
        if !proved {
            return;
        }
        let granted = {
            let mut slots = self.slots();
            let granted = slots.promote(source);
            self.show(&slots);
            granted
        };
        self.hand_over(granted);
    }

    /// Counts and logs a refusal before the handshake: each at debug, a
    /// summary at warn every ten seconds.
    pub fn log_refusal(&self, peer: SocketAddr, refusal: Refusal) {
        log_refusal(&self.metrics, &self.refusals, peer, refusal);
    }
}

fn log_refusal(
    metrics: &Metrics,
    refusals: &crate::logsafe::RefusalLog,
    peer: SocketAddr,
    refusal: Refusal,
) {
    metrics.handshake_refused(refusal.metric_reason());
    debug!(%peer, reason = %refusal, "connection refused");
    if let Some(count) = refusals.due() {
        warn!(
            refused = count,
            last_peer = %peer,
            last_reason = %refusal,
            "connections refused (at most one such line every {}s)",
            crate::logsafe::REFUSAL_LOG_EVERY.as_secs()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::session_slots::lock_counts;
    use super::*;
    use crate::source::*;
    use std::net::IpAddr;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn admission(handshakes: usize, per_source: usize, sessions: usize) -> Arc<Admission> {
        // Waiting places beyond what any test here fills.
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

    /// Issue 30 review, item 9: a connection whose PROXY header completed
    /// after `close_waiters` is refused, not queued where no one serves.
    #[tokio::test]
    async fn an_arrival_after_the_waiters_were_closed_is_refused() {
        let a = admission(4, 4, 4);
        a.close_waiters();
        let arrived = a.arrive_since(peer("192.0.2.1", 1), tokio::time::Instant::now());
        assert!(matches!(arrived, Err(Refusal::ShuttingDown)));
    }

    /// The slots `a` has handed out and the connections waiting.
    fn counts(a: &Admission) -> (usize, usize) {
        let slots = a.slots();
        (slots.in_use(), slots.waiting())
    }

    #[tokio::test(start_paused = true)]
    async fn one_source_beyond_its_share_waits_its_turn_and_others_go_first() {
        let a = admission(64, 2, 10);
        let first = a
            .handshake(a.arrive(peer("192.0.2.1", 1)).unwrap())
            .await
            .unwrap();
        let second = a
            .handshake(a.arrive(peer("192.0.2.1", 2)).unwrap())
            .await
            .unwrap();
        // The same address as IPv4-mapped IPv6 is the same source: it waits.
        let third = a.arrive(peer("::ffff:192.0.2.1", 3)).unwrap();
        assert_eq!(counts(&a), (2, 1));
        // Another source is not held up.
        let other = a
            .handshake(a.arrive(peer("192.0.2.2", 1)).unwrap())
            .await
            .unwrap();
        // A slot its source gives back is the waiter's.
        let (third, ()) = tokio::join!(a.handshake(third), async { drop(first) });
        let third = third.unwrap();
        assert_eq!(counts(&a), (3, 0));
        // Every slot given back leaves nothing behind.
        drop((second, third, other));
        assert_eq!(counts(&a), (0, 0));
        assert_eq!(a.metrics.handshake_waits.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_is_bounded_in_time_and_in_places() {
        let tls = crate::tls::TlsStore::fixed(test_server_config());
        let mut config = Config::new("/nonexistent".into(), tls);
        config.max_handshakes = 1;
        config.handshake_queue = 3;
        config.handshake_queue_per_source = 2;
        let a = Admission::new(&config);
        let held = a
            .handshake(a.arrive(peer("192.0.2.1", 1)).unwrap())
            .await
            .unwrap();
        // Its turn does not come in time.
        let waited = a
            .handshake(a.arrive(peer("192.0.2.1", 2)).unwrap())
            .await
            .err();
        assert_eq!(
            waited,
            Some(Refusal::QueueTimeout(Duration::from_secs(
                crate::config::DEFAULT_HANDSHAKE_QUEUE_TIMEOUT_SECS
            )))
        );
        assert_eq!(counts(&a), (1, 0), "the one that gave up left its place");
        // Its source's line full: refused at once, naming the prefix.
        let a1 = a.arrive(peer("192.0.2.1", 3)).unwrap();
        let a2 = a.arrive(peer("192.0.2.1", 4)).unwrap();
        assert_eq!(
            a.arrive(peer("192.0.2.1", 5)).err().map(|r| r.to_string()).as_deref(),
            Some("--handshake-queue-per-source (2) reached for 192.0.2.1/32: its handshakes (--max-handshakes-per-source) and its waiting places are all taken")
        );
        // Every place taken: the busiest source's longest waiter is shed.
        let b1 = a.arrive(peer("198.51.100.1", 1)).unwrap();
        let c1 = a.arrive(peer("203.0.113.1", 1)).unwrap();
        assert_eq!(a.handshake(a1).await.err(), Some(Refusal::Shed(3)));
        // Turns go by source, in the order the sources lined up: a (its
        // second), then b, then c.
        let (a2, ()) = tokio::join!(a.handshake(a2), async { drop(held) });
        let a2 = a2.unwrap();
        let (b1, ()) = tokio::join!(a.handshake(b1), async { drop(a2) });
        let b1 = b1.unwrap();
        let (c1, ()) = tokio::join!(a.handshake(c1), async { drop(b1) });
        drop(c1.unwrap());
        assert_eq!(counts(&a), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn at_shutdown_waiters_are_told_at_once_and_proven_sources_keep_the_reserve() {
        let tls = crate::tls::TlsStore::fixed(test_server_config());
        let mut config = Config::new("/nonexistent".into(), tls);
        config.max_handshakes = 2;
        config.handshake_reserve = 1;
        let a = Admission::new(&config); // A client of this source opened an export before.
        let first = a
            .handshake(a.arrive(peer("203.0.113.1", 1)).unwrap())
            .await
            .unwrap();
        assert!(!first.proven);
        drop(first);
        let host = Identity::of(Some(&crate::tls::CertInfo::with_names("host", &[], &[])));
        a.prove(peer("203.0.113.1", 1), &Identity::Anonymous, a.generation());
        let source = a.prefixes.source_of(peer("203.0.113.1", 1).ip());
        assert!(!a.proven().is_proven(source, a.generation()));
        // Proven under a generation a reload has left behind: nothing.
        let (tls, policy) = a.generation();
        a.prove(peer("203.0.113.1", 1), &host, (tls, policy + 1));
        assert!(!a.proven().is_proven(source, a.generation()));
        a.prove(peer("203.0.113.1", 1), &host, a.generation());
        // An unproven source holds the unproven share; the next waits
        // though a slot is free.
        let held = a
            .handshake(a.arrive(peer("192.0.2.1", 1)).unwrap())
            .await
            .unwrap();
        let waiting = a.arrive(peer("198.51.100.1", 1)).unwrap();
        assert_eq!(counts(&a), (1, 1));
        // The proven source takes the reserve at once.
        let again = a
            .handshake(a.arrive(peer("203.0.113.1", 2)).unwrap())
            .await
            .unwrap();
        assert!(again.proven);
        // Accepting stops: the waiter is closed now, not given a slot.
        a.close_waiters();
        assert_eq!(
            a.handshake(waiting).await.err(),
            Some(Refusal::ShuttingDown)
        );
        drop((held, again));
        assert_eq!(counts(&a), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn sessions_have_their_own_budget() {
        let a = admission(1, 8, 1);
        let _handshake = a
            .handshake(a.arrive(peer("192.0.2.1", 1)).unwrap())
            .await
            .unwrap();
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

    #[tokio::test(start_paused = true)]
    async fn one_slash_64_is_one_source_and_another_is_not_held_up() {
        let a = admission(64, 3, 10);
        // Many addresses of one /64, as one host may configure.
        let mut held = Vec::new();
        for i in 1..=3u16 {
            let place = a.arrive(peer(&format!("2001:db8:1:2::{i:x}"), 1)).unwrap();
            held.push(a.handshake(place).await.unwrap());
        }
        let waiting: Vec<_> = (4..40u16)
            .map(|i| {
                a.arrive(peer(&format!("2001:db8:1:2:{i:x}::{i:x}"), 1))
                    .unwrap()
            })
            .collect();
        assert_eq!(counts(&a), (3, 36));
        // The neighbouring /64 is another source: a slot at once.
        let other = a
            .handshake(a.arrive(peer("2001:db8:1:3::1", 1)).unwrap())
            .await
            .unwrap();
        drop((held, other, waiting));
        // The waiters gone, their places are given back as their turns come.
        assert_eq!(counts(&a), (0, 0));
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
            let IpAddr::V6(network) = key(a).network() else {
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
