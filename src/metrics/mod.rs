//! What an operator can see from outside: Prometheus metrics, and the
//! health the admin listener reports. Counters are cheap atomics, updated
//! where things happen; the text exposition is prometheus-client's.
//!
//! `Metrics` holds every family; each file beside this one registers one
//! group of them, with the labels and the helpers that count into them:
//! `connections` (client connections, TLS failures, bytes),
//! `handshakes` (the handshake budget, its line and PROXY headers),
//! `tls_sessions` (kernel TLS and the served certificate's reloads),
//! `traffic` (requests, their errors and latency, the upstream socket),
//! `access` (exports refused, policy reloads, the admin listener),
//! `handovers` (successors given the listening sockets, and this
//! process's own take-over),
//! `read_cache` and `client_reconnect` (each its own struct of counters),
//! and `health` (what `/healthz`, `/readyz` and `/server` say, no metric).
//! The order families are registered in is the order `/metrics` and
//! `docs/reference/metrics.md` list them in.

mod access;
mod client_reconnect;
mod connections;
mod handovers;
mod handshakes;
mod health;
mod read_cache;
mod tls_sessions;
mod traffic;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

pub use client_reconnect::ReconnectMetrics;
pub use connections::{Outcome, Reason, SessionRefusal};
pub use handshakes::ProxyOutcome;
pub use health::{GoneUpstream, Health};
pub use read_cache::{CacheMetrics, GenerationEnd, UpstreamFault};
pub use tls_sessions::{Direction, KeyExchange};
use traffic::latency_histogram;
pub use traffic::{Command, NbdError};

type Latency = Family<Command, Histogram, fn() -> Histogram>;

/// Every metric nbdgw exports.
pub struct Metrics {
    registry: Registry,
    pub connections_open: Gauge,
    pub connections: Family<Outcome, Counter>,
    pub handshake_failures: Family<Reason, Counter>,
    pub identities_refused: Counter,
    pub kernel_tls_sessions: Counter,
    pub kernel_tls_no_rekey: Counter,
    pub tls_key_updates: Family<Direction, Counter>,
    /// TLS sessions established, by the key exchange group negotiated.
    pub tls_sessions: Family<KeyExchange, Counter>,
    pub bytes_received: Counter,
    pub bytes_sent: Counter,
    pub requests: Family<Command, Counter>,
    pub request_errors: Family<NbdError, Counter>,
    pub request_seconds: Latency,
    pub upstream_connect_failures: Counter,
    pub upstream_sndbuf: Gauge,
    pub exports_refused: Counter,
    /// Authenticated clients refused a session, by which limit: a fixed
    /// few reasons, never the identity.
    pub sessions_refused: Family<SessionRefusal, Counter>,
    pub handshakes_in_progress: Gauge,
    pub handshakes_waiting: Gauge,
    pub handshake_waits: Counter,
    pub handshake_wait_seconds: Histogram,
    pub handshakes_refused: Family<SessionRefusal, Counter>,
    pub proven_sources: Gauge,
    pub proxy_headers: Family<ProxyOutcome, Counter>,
    pub policy_reloads: Counter,
    pub policy_reload_failures: Counter,
    /// Policy reloads that changed the policy (not exported): the policy
    /// half of the generation a proven source is proven under.
    pub policy_changes: Counter,
    pub admin_connections_open: Gauge,
    pub admin_connections_refused: Counter,
    /// Hand-overs to a successor process, by outcome (see
    /// `crate::handover`).
    pub handovers: Family<Outcome, Counter>,
    /// This process's own start as a successor (`--take-over`), by
    /// outcome: readable here, on the admin port it took over.
    pub takeovers: Family<Outcome, Counter>,
    /// Sessions offered to a successor (`handovers.rs`).
    pub sessions_handed: handovers::SessionsHanded,
    pub cache: CacheMetrics,
    /// `nbdgw client --reconnect`'s counters (registered in client mode).
    pub reconnects: ReconnectMetrics,
}

impl Metrics {
    /// The registry, with the TLS store's reload counters and expiry
    /// gauges (which the store keeps current) among the rest.
    pub fn new(tls: &crate::tls::TlsStore) -> Self {
        Self::with_tls(Some(tls))
    }

    /// The registry of `nbdgw client`, which serves no certificate: the
    /// same families, without the served certificate's reload counters
    /// and expiry gauges.
    pub fn client_mode() -> Self {
        Self::with_tls(None)
    }

    fn with_tls(tls: Option<&crate::tls::TlsStore>) -> Self {
        let mut registry = Registry::with_prefix("nbdgw");
        let metrics = Metrics {
            connections_open: Gauge::default(),
            connections: Family::default(),
            handshake_failures: Family::default(),
            identities_refused: Counter::default(),
            kernel_tls_sessions: Counter::default(),
            kernel_tls_no_rekey: Counter::default(),
            tls_key_updates: Family::default(),
            tls_sessions: Family::default(),
            bytes_received: Counter::default(),
            bytes_sent: Counter::default(),
            requests: Family::default(),
            request_errors: Family::default(),
            request_seconds: Family::new_with_constructor(latency_histogram),
            upstream_connect_failures: Counter::default(),
            upstream_sndbuf: Gauge::default(),
            exports_refused: Counter::default(),
            sessions_refused: Family::default(),
            handshakes_in_progress: Gauge::default(),
            handshakes_waiting: Gauge::default(),
            handshake_waits: Counter::default(),
            // 1 ms to ~16 s: past any --handshake-queue-timeout one needs.
            handshake_wait_seconds: Histogram::new(exponential_buckets(1e-3, 2.0, 15)),
            handshakes_refused: Family::default(),
            proven_sources: Gauge::default(),
            proxy_headers: Family::default(),
            policy_reloads: Counter::default(),
            policy_changes: Counter::default(),
            policy_reload_failures: Counter::default(),
            admin_connections_open: Gauge::default(),
            admin_connections_refused: Counter::default(),
            handovers: Family::default(),
            takeovers: Family::default(),
            sessions_handed: handovers::SessionsHanded::default(),
            cache: CacheMetrics::default(),
            reconnects: ReconnectMetrics::default(),
            registry: Registry::default(),
        };
        metrics.register_connections(&mut registry);
        metrics.register_handshakes(&mut registry);
        metrics.register_proxy(&mut registry);
        metrics.register_handover(&mut registry);
        metrics.register_kernel_tls(&mut registry);
        metrics.register_requests(&mut registry);
        if let Some(tls) = tls {
            Self::register_tls(&mut registry, tls);
        }
        Self::register_build(&mut registry);
        metrics.register_exports(&mut registry);
        metrics.cache.register(&mut registry);
        if tls.is_none() {
            metrics.reconnects.register(&mut registry);
        }
        Metrics {
            registry,
            ..metrics
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
