//! What an operator can see from outside: Prometheus metrics, and the
//! health the admin listener reports. Counters are cheap atomics, updated
//! where things happen; the text exposition is prometheus-client's.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProxyOutcome {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SessionRefusal {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GenerationEnd {
    /// One of `cache::Change::label`'s.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamFault {
    /// One of `cache::Fault::label`'s.
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Command {
    pub command: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NbdError {
    /// A name from `proto::transmission::error_name`, never the raw value:
    /// the upstream would choose the number of series.
    pub error: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Direction {
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KeyExchange {
    /// A name from `tls::groups::name`: a fixed few, never a peer's value.
    pub key_exchange: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Build {
    version: &'static str,
}

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
    pub cache: CacheMetrics,
    /// `nbdgw client --reconnect`'s counters (registered in client mode).
    pub reconnects: ReconnectMetrics,
}

/// What `nbdgw client --reconnect` did, summed over local connections:
/// fixed labels only, never the server's words.
#[derive(Clone, Debug, Default)]
pub struct ReconnectMetrics {
    /// Tries to open the export again, by outcome: "opened" or "failed".
    pub tries: Family<Outcome, Counter>,
    /// Server connections that answered a request after a drop: the
    /// reconnect that worked.
    pub good: Counter,
    /// Times --reconnect gave up, by reason: "timeout" (the requests in
    /// flight failed with EIO, later ones fail at once until the server
    /// answers) or "export_changed" (the local connection closed).
    pub give_ups: Family<Outcome, Counter>,
    /// ESHUTDOWN answers held back and their requests sent again.
    pub shutdown_answers_held: Counter,
    /// Local connections whose server connection is down or not yet
    /// answering, within --reconnect-timeout.
    pub reconnecting: Gauge,
    /// Local connections past --reconnect-timeout: their requests fail
    /// at once.
    pub unreachable: Gauge,
}

/// The read cache's counters (see `crate::cache`): one set for the
/// gateway, with no label, so no client chooses a series.
#[derive(Clone, Debug, Default)]
pub struct CacheMetrics {
    /// Reads answered from the cache, without the upstream.
    pub hits: Counter,
    /// Reads of a cached export forwarded to the upstream.
    pub misses: Counter,
    /// READs of cached exports sent upstream (fills, read-ahead, and
    /// reads the cache does not answer).
    pub upstream_reads: Counter,
    /// Blocks evicted to make room.
    pub evictions: Counter,
    /// Blocks dropped because their export's generation ended (another
    /// server at its socket, or another size or flags).
    pub invalidated_blocks: Counter,
    /// Exports' generations ended, by why: `replaced` (another server
    /// answers at the socket) or `resized` (another size or flags).
    pub generations_ended: Family<GenerationEnd, Counter>,
    /// Replies to reads on cached exports that broke the protocol, by
    /// kind (one of `cache::Fault::label`'s): nothing of them is cached.
    pub upstream_faults: Family<UpstreamFault, Counter>,
    /// Bytes read ahead into the cache.
    pub read_ahead_bytes: Counter,
    /// Of those, bytes a client then read from the cache.
    pub read_ahead_used_bytes: Counter,
    /// Bytes read ahead and evicted, dropped or not kept before a client
    /// read them.
    pub read_ahead_wasted_bytes: Counter,
    /// Bytes held in blocks now.
    pub cached_bytes: Gauge,
    /// `--cache-size`.
    pub capacity_bytes: Gauge,
}

impl CacheMetrics {
    /// A generation ended for `reason`, one of `cache::Change::label`'s.
    pub fn generation_ended(&self, reason: &'static str) {
        self.generations_ended
            .get_or_create(&GenerationEnd { reason })
            .inc();
    }

    /// An upstream's reply broke the protocol in the way `kind` says, one
    /// of `cache::Fault::label`'s.
    pub fn upstream_fault(&self, kind: &'static str) {
        self.upstream_faults
            .get_or_create(&UpstreamFault { kind })
            .inc();
    }
}

fn latency_histogram() -> Histogram {
    // 20 µs to about 5 s.
    Histogram::new(exponential_buckets(20e-6, 2.0, 18))
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
            // 1 ms to about 16 s, past the longest --handshake-queue-timeout
            // anyone should need.
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
            cache: CacheMetrics::default(),
            reconnects: ReconnectMetrics::default(),
            registry: Registry::default(),
        };
        metrics.register_connections(&mut registry);
        metrics.register_handshakes(&mut registry);
        metrics.register_proxy(&mut registry);
        metrics.register_handover(&mut registry);
        metrics.register_kernel_tls(&mut registry);
        metrics.register_requests(&mut registry, tls);
        metrics.register_exports(&mut registry);
        metrics.register_cache(&mut registry);
        if tls.is_none() {
            metrics.reconnects.register(&mut registry);
        }
        Metrics {
            registry,
            ..metrics
        }
    }
}

/// Counted per event, outside the registry's making.
impl Metrics {
    /// A connection from a trusted balancer, by `outcome` (one of the
    /// fixed few `register_proxy` names).
    pub fn proxy_header(&self, outcome: &'static str) {
        self.proxy_headers
            .get_or_create(&ProxyOutcome { outcome })
            .inc();
    }

    fn register_handover(&self, r: &mut Registry) {
        r.register(
            "handovers",
            "Successors that connected to --handover-socket, by outcome (handed_over: it serves the listening sockets and this process drains; refused_uid: another uid; refused_version: no state version in common; timeout: not done within --handover-timeout; successor_gone: it closed or died first; failed: a broken message or socket); every outcome but handed_over leaves this process serving",
            self.handovers.clone(),
        );
    }

    /// One successor's attempt, by `outcome` (one of `register_handover`'s).
    pub fn handover(&self, outcome: &'static str) {
        self.handovers.get_or_create(&Outcome { outcome }).inc();
    }
}

impl ReconnectMetrics {
    /// Client mode's `--reconnect` counters.
    fn register(&self, r: &mut Registry) {
        let m = self;
        r.register(
            "reconnect_tries",
            "Tries to open the server's export again after a drop, by outcome",
            m.tries.clone(),
        );
        r.register(
            "reconnects_good",
            "Server connections that answered a request after a drop",
            m.good.clone(),
        );
        r.register(
            "reconnect_give_ups",
            "Times --reconnect gave up, by reason (timeout, export_changed)",
            m.give_ups.clone(),
        );
        r.register(
            "reconnect_shutdown_answers_held",
            "ESHUTDOWN answers held back from the local client, their requests sent again",
            m.shutdown_answers_held.clone(),
        );
        r.register(
            "reconnecting_connections",
            "Local connections whose server connection is down or not yet answering",
            m.reconnecting.clone(),
        );
        r.register(
            "unreachable_connections",
            "Local connections past --reconnect-timeout, whose requests fail at once",
            m.unreachable.clone(),
        );
    }
}

impl Metrics {
    fn register_connections(&self, r: &mut Registry) {
        let m = self;
        r.register(
            "connections_open",
            "Client connections open now",
            m.connections_open.clone(),
        );
        r.register(
            "connections",
            "Client connections ended, by outcome",
            m.connections.clone(),
        );
        r.register(
            "handshake_failures",
            "TLS handshakes that failed, by the reason (the alert sent)",
            m.handshake_failures.clone(),
        );
        r.register(
            "tls_sessions",
            "TLS sessions established (client mode: with the server), by the key exchange group negotiated",
            m.tls_sessions.clone(),
        );
        r.register(
            "identities_refused",
            "Client certificates refused (chain, revocation or allow-lists)",
            m.identities_refused.clone(),
        );
        r.register(
            "sessions_refused",
            "Authenticated clients refused a session, by reason (max_connections, per_identity)",
            m.sessions_refused.clone(),
        );
        r.register(
            "received_bytes",
            "Request bytes received from clients",
            m.bytes_received.clone(),
        );
        r.register(
            "sent_bytes",
            "Reply bytes sent to clients",
            m.bytes_sent.clone(),
        );
    }

    /// The handshake slots and queue (`--max-handshakes`), and the
    /// sources remembered as proven.
    fn register_handshakes(&self, r: &mut Registry) {
        let m = self;
        r.register(
            "handshakes_in_progress",
            "Handshake slots (--max-handshakes) held now",
            m.handshakes_in_progress.clone(),
        );
        r.register(
            "handshakes_waiting",
            "Connections waiting now for a handshake slot",
            m.handshakes_waiting.clone(),
        );
        r.register(
            "handshake_waits",
            "Connections that had to wait for a handshake slot",
            m.handshake_waits.clone(),
        );
        r.register(
            "handshake_wait_seconds",
            "How long connections that waited for a handshake slot waited, for those that got one",
            m.handshake_wait_seconds.clone(),
        );
        r.register(
            "handshakes_refused",
            "Connections closed before their handshake, by reason (source_queue_full: its source's line full; shed_busiest_source: made room as the longest waiter of the busiest source; queue_full: unproven, and only proven sources wait; queue_timeout; shutting_down)",
            m.handshakes_refused.clone(),
        );
        r.register(
            "proven_sources",
            "Sources remembered as proven (a client of theirs opened an export with a certificate within --source-memory)",
            m.proven_sources.clone(),
        );
    }

    /// PROXY protocol headers from trusted balancers.
    fn register_proxy(&self, r: &mut Registry) {
        r.register(
            "proxy_headers",
            "Connections from a --proxy-protocol-from balancer, by what their PROXY header was (v1, v2: a client's address taken; local: v2 LOCAL, closed after it unless --proxy-protocol-serve-local; unknown: refused, it gave no address (v1 UNKNOWN, v2 PROXY not over TCP); invalid; timeout: none within --proxy-protocol-timeout (or --handshake-timeout if shorter); closed; busy: closed before their header for the bound of --max-handshakes plus --handshake-queue, refused or shed for a less busy balancer address; shutting_down)",
            self.proxy_headers.clone(),
        );
    }

    /// Sessions handed to the kernel, and their key updates.
    fn register_kernel_tls(&self, r: &mut Registry) {
        let m = self;
        r.register(
            "kernel_tls_sessions",
            "TLS sessions handed to the kernel (kTLS) after the handshake",
            m.kernel_tls_sessions.clone(),
        );
        r.register(
            "kernel_tls_no_rekey_sessions",
            "TLS 1.3 sessions kept in rustls because this kernel's TLS cannot re-key",
            m.kernel_tls_no_rekey.clone(),
        );
        r.register(
            "tls_key_updates",
            "TLS 1.3 key updates followed on kernel TLS sessions: rx the client's, tx nbdgw's own",
            m.tls_key_updates.clone(),
        );
    }

    fn register_exports(&self, r: &mut Registry) {
        let m = self;
        r.register(
            "admin_connections_open",
            "Admin listener connections open now",
            m.admin_connections_open.clone(),
        );
        r.register(
            "admin_connections_refused",
            "Admin listener connections closed at accept: --admin-max-connections were open",
            m.admin_connections_refused.clone(),
        );
        r.register(
            "exports_refused",
            "Options naming an export the client may not open, or that does not exist",
            m.exports_refused.clone(),
        );
        r.register(
            "policy_reloads",
            "Access policy reloads that replaced the policy",
            m.policy_reloads.clone(),
        );
        r.register(
            "policy_reload_failures",
            "Access policy reloads refused (missing, broken, or wider than the running policy)",
            m.policy_reload_failures.clone(),
        );
    }

    fn register_cache(&self, r: &mut Registry) {
        let c = &self.cache;
        for (name, help, counter) in [
            (
                "cache_hits",
                "Reads of immutable exports answered from the read cache",
                &c.hits,
            ),
            (
                "cache_misses",
                "Reads of immutable exports forwarded to the upstream",
                &c.misses,
            ),
            (
                "cache_upstream_reads",
                "READs of immutable exports sent upstream: fills, read-ahead, and reads too long to cache",
                &c.upstream_reads,
            ),
            (
                "cache_evictions",
                "Read cache blocks evicted to make room",
                &c.evictions,
            ),
            (
                "cache_invalidated_blocks",
                "Read cache blocks dropped because their export's generation ended (another server at its socket, or another size or flags)",
                &c.invalidated_blocks,
            ),
            (
                "cache_read_ahead_bytes",
                "Bytes read ahead into the read cache",
                &c.read_ahead_bytes,
            ),
            (
                "cache_read_ahead_used_bytes",
                "Read-ahead bytes a client then read from the cache",
                &c.read_ahead_used_bytes,
            ),
            (
                "cache_read_ahead_wasted_bytes",
                "Read-ahead bytes evicted, dropped or not kept before a client read them",
                &c.read_ahead_wasted_bytes,
            ),
        ] {
            r.register(name, help, counter.clone());
        }
        r.register(
            "cache_generations_ended",
            "Read cache generations ended, by reason: replaced (another server answers at the export's socket) or resized (another size or flags)",
            c.generations_ended.clone(),
        );
        r.register(
            "cache_upstream_faults",
            "Replies to reads of cached exports that broke the protocol, by kind: overlap (chunks that overlap), outside (a chunk outside the read), uncovered (success with bytes no chunk covered); nothing of them is cached",
            c.upstream_faults.clone(),
        );
        r.register(
            "cache_bytes",
            "Bytes held in the read cache",
            c.cached_bytes.clone(),
        );
        r.register(
            "cache_capacity_bytes",
            "The read cache's bound (--cache-size)",
            c.capacity_bytes.clone(),
        );
    }

    fn register_requests(&self, r: &mut Registry, tls: Option<&crate::tls::TlsStore>) {
        let m = self;
        r.register("requests", "Requests by command", m.requests.clone());
        r.register(
            "request_errors",
            "Replies carrying an NBD error, by error",
            m.request_errors.clone(),
        );
        r.register(
            "request_duration_seconds",
            "From a request read to its last reply handed to TLS, by command",
            m.request_seconds.clone(),
        );
        r.register(
            "upstream_connect_failures",
            "Connections to the upstream socket that failed",
            m.upstream_connect_failures.clone(),
        );
        r.register(
            "upstream_sndbuf_bytes",
            "SO_SNDBUF the kernel grants upstream sockets",
            m.upstream_sndbuf.clone(),
        );
        if let Some(tls) = tls {
            Self::register_tls(r, tls);
        }
        let build = Family::<Build, Gauge>::default();
        build
            .get_or_create(&Build {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        r.register("build_info", "The running build", build);
    }

    fn register_tls(r: &mut Registry, tls: &crate::tls::TlsStore) {
        r.register(
            "tls_reloads",
            "TLS reloads that replaced the configuration",
            tls.reloads_ok.clone(),
        );
        r.register(
            "tls_reload_failures",
            "TLS reloads refused (broken files, or files weakening authentication)",
            tls.reloads_failed.clone(),
        );
        r.register(
            "certificate_not_after_seconds",
            "Expiry of the served certificate, Unix time",
            tls.certificate_not_after.clone(),
        );
        r.register(
            "client_ca_not_after_seconds",
            "Earliest expiry in the client CA bundle, Unix time (0: none)",
            tls.client_ca_not_after.clone(),
        );
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// A key update on a kernel TLS session, "rx" or "tx".
    pub fn key_update(&self, direction: &'static str) {
        self.tls_key_updates
            .get_or_create(&Direction { direction })
            .inc();
    }

    /// A TLS session was established with the key exchange `group`.
    pub fn tls_established(&self, group: Option<rustls::NamedGroup>) {
        let key_exchange = crate::tls::groups::name(group);
        self.tls_sessions
            .get_or_create(&KeyExchange { key_exchange })
            .inc();
    }

    /// A client connection ended: "closed", "error", or "refused" (at
    /// accept or in the handshake queue, before a word was exchanged).
    pub fn connection(&self, outcome: &'static str) {
        self.connections.get_or_create(&Outcome { outcome }).inc();
    }

    /// A TLS handshake failed; `certificate` when the client's
    /// certificate was what was refused.
    pub fn handshake_failed(&self, reason: String, certificate: bool) {
        self.handshake_failures
            .get_or_create(&Reason { reason })
            .inc();
        if certificate {
            self.identities_refused.inc();
        }
    }

    /// A session refused for `reason`, one of `Refusal::metric_reason`'s.
    pub fn session_refused(&self, reason: &'static str) {
        self.sessions_refused
            .get_or_create(&SessionRefusal { reason })
            .inc();
    }

    /// A connection closed before its handshake for `reason`, one of
    /// `Refusal::metric_reason`'s.
    pub fn handshake_refused(&self, reason: &'static str) {
        self.handshakes_refused
            .get_or_create(&SessionRefusal { reason })
            .inc();
    }

    pub fn request(&self, command: &'static str) {
        self.requests.get_or_create(&Command { command }).inc();
    }

    /// A request's last reply has been handed on, `took` after it came.
    pub fn answered(&self, command: &'static str, took: Duration) {
        self.request_seconds
            .get_or_create(&Command { command })
            .observe(took.as_secs_f64());
    }

    /// A reply carried NBD error `error`, counted by name (or `other`).
    pub fn error(&self, error: u32) {
        let error = crate::proto::transmission::error_name(error);
        self.request_errors.get_or_create(&NbdError { error }).inc();
    }
}

/// What `/healthz`, `/readyz` and `/server` report.
#[derive(Default)]
pub struct Health {
    accepting: AtomicBool,
    draining: AtomicBool,
    /// Whether the upstream socket refused the last try.
    upstream_down: AtomicBool,
    /// Client mode: local connections reconnecting to the server, and
    /// those past --reconnect-timeout (failing at once).
    reconnecting: AtomicUsize,
    unreachable: AtomicUsize,
    /// Sessions that lost their upstream after SIGTERM, and connections
    /// whose upstream refused them then, by upstream: said once for all
    /// at the end of the drain (`server::run`), as a pod's NBD server
    /// stopping beside nbdgw cuts them all at once.
    cut_by_upstream: std::sync::Mutex<std::collections::BTreeMap<String, GoneUpstream>>,
}

/// What an upstream gone during the shutdown did to the connections.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GoneUpstream {
    /// Sessions it cut.
    pub cut: usize,
    /// Connections it refused while negotiating.
    pub refused: usize,
}

impl Health {
    pub fn set_accepting(&self, on: bool) {
        self.accepting.store(on, Ordering::Relaxed);
    }

    pub fn is_accepting(&self) -> bool {
        self.accepting.load(Ordering::Relaxed)
    }

    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// From SIGTERM on (the drain delay included).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// A session ended because its upstream (`upstream`, as the audit
    /// line names it) went away during the shutdown.
    pub fn cut_by_upstream(&self, upstream: &str) {
        self.gone_upstream(upstream, |gone| gone.cut += 1);
    }

    /// A connection's upstream refused it during the shutdown.
    pub fn refused_by_upstream(&self, upstream: &str) {
        self.gone_upstream(upstream, |gone| gone.refused += 1);
    }

    fn gone_upstream(&self, upstream: &str, count: impl FnOnce(&mut GoneUpstream)) {
        let mut gone = self
            .cut_by_upstream
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        count(gone.entry(upstream.to_owned()).or_default());
    }

    /// What `cut_by_upstream` and `refused_by_upstream` counted, by
    /// upstream, and forgets it.
    pub fn take_cut_by_upstream(&self) -> std::collections::BTreeMap<String, GoneUpstream> {
        std::mem::take(
            &mut *self
                .cut_by_upstream
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }

    /// Records whether the upstream accepts connections; why not is the
    /// caller's to log.
    pub fn set_upstream_down(&self, down: bool) {
        self.upstream_down.store(down, Ordering::Relaxed);
    }

    /// A local connection of client mode starts (`true`) or stops
    /// reconnecting to the server.
    pub fn set_reconnecting(&self, on: bool) {
        Self::count(&self.reconnecting, on);
    }

    /// A local connection of client mode starts (`true`) or stops failing
    /// its requests at once, past --reconnect-timeout.
    pub fn set_unreachable(&self, on: bool) {
        Self::count(&self.unreachable, on);
    }

    fn count(counter: &AtomicUsize, on: bool) {
        if on {
            counter.fetch_add(1, Ordering::Relaxed);
        } else {
            let _ =
                counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
    }

    /// `Ok` when ready for clients, or the one-line reason it is not: a
    /// fixed text, since whoever can reach the admin listener is told it
    /// (the upstream's path and error are in the log only).
    pub fn readiness(&self) -> Result<(), &'static str> {
        if self.draining.load(Ordering::Relaxed) {
            return Err("shutting down");
        }
        if !self.is_accepting() {
            return Err("not accepting connections yet");
        }
        if self.upstream_down.load(Ordering::Relaxed) {
            return Err("upstream unavailable");
        }
        // Not the connections reconnecting (client mode's --reconnect):
        // the server is a dependency, and a not-ready sidecar takes the
        // whole pod out of its Service while the server restarts. Their
        // state is `server_state`'s, and the gauges'.
        Ok(())
    }

    /// Client mode with --reconnect: `Ok` when no local connection is
    /// reconnecting to the server, else a fixed one-line reason (for the
    /// admin listener's `/server`).
    pub fn server_state(&self) -> Result<(), &'static str> {
        if self.unreachable.load(Ordering::Relaxed) > 0 {
            return Err("server unreachable past --reconnect-timeout");
        }
        if self.reconnecting.load(Ordering::Relaxed) > 0 {
            return Err("reconnecting to the server");
        }
        Ok(())
    }
}
