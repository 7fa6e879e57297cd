//! Runtime settings of the gateway, independent of how they were given.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use crate::cache::ReadCacheSettings;
pub use crate::source::{
    PrefixError, Source, SourcePrefixes, DEFAULT_SOURCE_PREFIX_V4, DEFAULT_SOURCE_PREFIX_V6,
};

/// Everything a running gateway needs. `main` builds it from flags and
/// environment; tests build it directly.
#[derive(Clone)]
pub struct Config {
    /// Unix socket of the NBD server nbdgw relays to (unless `exports`).
    pub upstream: PathBuf,
    /// Named exports, each with its own socket; `None`: every export name
    /// goes to `upstream` as the client gave it.
    pub exports: Option<Arc<crate::exports::ExportTable>>,
    /// Which identities may open which exports, and how; read afresh for
    /// each connection: a reload may narrow it.
    pub policy: Arc<crate::policy::PolicyStore>,
    /// Whether a policy reload ends open sessions whose access it
    /// narrows (`--policy-revoke-closes`).
    pub policy_revoke_closes: bool,
    /// Read afresh for each connection: a reload may replace it.
    pub tls: Arc<crate::tls::TlsStore>,
    /// `SO_SNDBUF` requested on each upstream socket; 0 keeps the kernel's.
    pub upstream_sndbuf: usize,
    /// Established (authenticated) sessions at once.
    pub max_connections: usize,
    /// Of those, how many one client identity may hold (see
    /// `crate::admission::Identity`). `Config::new` leaves it at
    /// `max_connections`; `main` applies [`default_sessions_per_identity`].
    pub max_sessions_per_identity: usize,
    /// Connections still negotiating, not yet authenticated, at once: a
    /// budget of their own, so silent or slow peers cannot take the
    /// slots of authenticated ones.
    pub max_handshakes: usize,
    /// Of `max_handshakes`, how many one source prefix may hold.
    pub max_handshakes_per_source: usize,
    /// Which addresses are one source for `max_handshakes_per_source`.
    pub source_prefixes: SourcePrefixes,
    /// The balancers trusted to send a PROXY protocol header.
    pub proxy_protocol: crate::balancer::Trusted,
    /// Connections that may wait for a handshake slot, all sources
    /// together; beyond it the longest waiter of the source with the most
    /// waiting is shed.
    pub handshake_queue: usize,
    /// Of those, how many from one source; beyond it its connections are
    /// closed at accept.
    pub handshake_queue_per_source: usize,
    /// How long a connection may wait for its handshake slot.
    pub handshake_queue_timeout: Duration,
    /// Of `max_handshakes`, the slots only proven sources may take.
    pub handshake_reserve: usize,
    /// How long a source one of whose connections authenticated is served
    /// before sources that have not (zero: never).
    pub source_memory: Duration,
    /// From accept until transmission starts (or the connection ends).
    pub handshake_timeout: Duration,
    /// Bounds each step of talking to an upstream in negotiation: the
    /// connect and greeting together, then each option reply. Shorter
    /// than the handshake timeout, so that a hung server gets the client
    /// an error reply rather than a silent close.
    pub upstream_timeout: Duration,
    /// What the relay allows a connection: timeouts, keepalive, sizes.
    pub relay: RelayLimits,
    /// Export names one connection may have refused (malformed, not
    /// granted, unknown) before it is closed.
    pub max_refused_options: u32,
    /// How replies are held back into full TCP segments.
    pub cork: Cork,
    /// The ciphers kernel TLS takes, when sessions go to the kernel after
    /// the handshake; `None` keeps every session in rustls.
    pub kernel_tls: Option<crate::tls::kernel::KernelCiphers>,
    /// The kernel has TLS but cannot re-key it: sessions stay in rustls,
    /// and are counted.
    pub kernel_tls_no_rekey: bool,
    /// Records nbdgw sends under one key on a kernel TLS session before
    /// it updates its keys; `None`: the cipher suite's confidentiality
    /// limit, halved for margin.
    pub ktls_key_limit: Option<u64>,
    /// How long open connections may finish after SIGTERM.
    pub shutdown_grace: Duration,
    /// After SIGTERM, how long to go on accepting (not ready) so that
    /// load balancers stop sending clients first.
    pub drain_delay: Duration,
    /// What a draining connection does with a request read after the
    /// drain began: close instead, or answer ESHUTDOWN.
    pub drain_answer: crate::shutdown::DrainAnswer,
    /// Whether `--allow-*` lists admit clients: without a policy, the
    /// audit trail names them (else "open") as what granted a session.
    pub allow_lists: bool,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub health: Arc<crate::metrics::Health>,
    /// Immutable exports and the read cache they share.
    pub read_cache: ReadCacheSettings,
    /// The sessions a successor may take (`--handover-socket`); None:
    /// sessions are never handed over.
    pub handover: Option<Arc<crate::handing::Registry>>,
}

/// What the relay allows one connection, and when it gives up on it: the
/// same for a server's clients and client mode's local ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayLimits {
    /// Closes a connection with no request in flight and no reply being
    /// written for this long, counted from the last reply's last byte.
    pub idle_timeout: Option<Duration>,
    /// Closes a connection whose started request payload, or whose reply
    /// the client does not read, makes no progress for this long.
    pub stall_timeout: Option<Duration>,
    /// TCP keepalive, so a peer that vanished without a FIN or RST
    /// (powered off, cable pulled) is noticed.
    pub keepalive: Option<Keepalive>,
    /// Largest request payload (and read length) accepted from a client.
    pub max_payload: u32,
    /// Largest option data (or option reply data) either side may send.
    pub max_option_len: u32,
}

impl Default for RelayLimits {
    /// The flags' defaults.
    fn default() -> Self {
        RelayLimits {
            idle_timeout: None,
            stall_timeout: Some(Duration::from_secs(DEFAULT_STALL_TIMEOUT_SECS)),
            keepalive: Some(Keepalive::default()),
            max_payload: crate::proto::consts::DEFAULT_MAX_PAYLOAD,
            max_option_len: DEFAULT_MAX_OPTION_LEN,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// Silence before the first probe.
    pub idle: Duration,
    pub interval: Duration,
    /// Unanswered probes before the connection is dropped.
    pub count: u32,
}

impl Default for Keepalive {
    fn default() -> Self {
        Keepalive {
            idle: Duration::from_secs(DEFAULT_KEEPALIVE_IDLE_SECS),
            interval: Duration::from_secs(DEFAULT_KEEPALIVE_INTERVAL_SECS),
            count: DEFAULT_KEEPALIVE_COUNT,
        }
    }
}

impl Config {
    /// How upstreams are reached.
    pub fn dial(&self) -> crate::upstream::Dial {
        crate::upstream::Dial {
            timeout: self.upstream_timeout,
            sndbuf: self.upstream_sndbuf,
        }
    }
    /// Defaults for everything but the two things only the operator knows.
    pub fn new(upstream: PathBuf, tls: Arc<crate::tls::TlsStore>) -> Self {
        Config {
            metrics: Arc::new(crate::metrics::Metrics::new(&tls)),
            health: Arc::default(),
            drain_delay: Duration::ZERO,
            drain_answer: crate::shutdown::DrainAnswer::Close,
            allow_lists: false,
            handover: None,
            upstream,
            exports: None,
            policy: Arc::new(crate::reloadable::Swap::new(Arc::new(
                crate::policy::Policy::open(),
            ))),
            policy_revoke_closes: true,
            tls,
            upstream_sndbuf: DEFAULT_UPSTREAM_SNDBUF,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_sessions_per_identity: DEFAULT_MAX_CONNECTIONS,
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
            max_handshakes_per_source: DEFAULT_MAX_HANDSHAKES_PER_SOURCE,
            source_prefixes: SourcePrefixes::default(),
            proxy_protocol: crate::balancer::Trusted {
                from: Vec::new(),
                max_header: crate::balancer::DEFAULT_MAX_HEADER,
                pending: 0,
                serve_local: false,
                header_timeout: Duration::from_secs(crate::balancer::DEFAULT_HEADER_TIMEOUT_SECS),
            },
            handshake_queue: DEFAULT_HANDSHAKE_QUEUE,
            handshake_queue_per_source: DEFAULT_HANDSHAKE_QUEUE_PER_SOURCE,
            handshake_queue_timeout: Duration::from_secs(DEFAULT_HANDSHAKE_QUEUE_TIMEOUT_SECS),
            source_memory: Duration::from_secs(DEFAULT_SOURCE_MEMORY_SECS),
            // `main` sets it from the flags and the TLS files; none by
            // default here, so tests and embedders see plain round-robin.
            handshake_reserve: 0,
            handshake_timeout: Duration::from_secs(DEFAULT_HANDSHAKE_TIMEOUT_SECS),
            upstream_timeout: Duration::from_secs(DEFAULT_UPSTREAM_TIMEOUT_SECS),
            relay: RelayLimits::default(),
            max_refused_options: DEFAULT_MAX_REFUSED_OPTIONS,
            cork: Cork::Deferred,
            kernel_tls: None,
            kernel_tls_no_rekey: false,
            ktls_key_limit: None,
            shutdown_grace: Duration::from_secs(DEFAULT_SHUTDOWN_GRACE_SECS),
            read_cache: ReadCacheSettings::default(),
        }
    }
}

/// TCP_CORK around replies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Cork {
    /// Corked while the next reply is already waiting; released when
    /// nothing more is (a burst that fits one write needs no cork at all).
    #[default]
    Deferred,
    /// Corked around every reply and released after it, as QEMU does.
    PerReply,
    Off,
}

pub const DEFAULT_UPSTREAM_SNDBUF: usize = 2 * 1024 * 1024;
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// `--max-sessions-per-identity` when not given. With client certificates,
/// a quarter of `--max-connections` (256 of the default 1024): a
/// hypervisor attaching a disk per VM for a few hundred VMs under one
/// certificate fits, and one identity still leaves three quarters of the
/// slots to the others. Without client certificates every client is the
/// one anonymous identity, and a cap below `--max-connections` would only
/// leave slots unused.
/// A flag in seconds where 0 turns the thing off.
pub fn seconds_or_off(secs: u64) -> Option<Duration> {
    (secs > 0).then(|| Duration::from_secs(secs))
}

pub fn default_sessions_per_identity(max_connections: usize, client_certificates: bool) -> usize {
    if client_certificates {
        (max_connections / 4).max(1)
    } else {
        max_connections
    }
}
/// Enough for a host's VMs reconnecting at once; a TLS handshake takes
/// about half a millisecond of CPU, so 64 finish in well under a second.
pub const DEFAULT_MAX_HANDSHAKES: usize = 64;
/// A NAT gateway may front several honest clients; one address holding
/// more than this is more likely a flood.
pub const DEFAULT_MAX_HANDSHAKES_PER_SOURCE: usize = 8;
/// A waiting connection costs one descriptor and no buffers, so a
/// thousand cost little; enough for several hosts' VMs reconnecting after
/// a gateway restart.
pub const DEFAULT_HANDSHAKE_QUEUE: usize = 1024;
/// One hypervisor's VMs, or a node's pods behind SNAT, reconnecting
/// together: hundreds from one address is a legitimate burst.
pub const DEFAULT_HANDSHAKE_QUEUE_PER_SOURCE: usize = 256;
/// Served eight at a time, 256 handshakes from one source take about a
/// second on loopback; ten leaves room for slow links and busy hosts.
pub const DEFAULT_HANDSHAKE_QUEUE_TIMEOUT_SECS: u64 = 10;
/// A day: a hypervisor whose VMs were connected yesterday is still the
/// same host when they reconnect together (after a gateway restart the
/// memory starts empty).
pub const DEFAULT_SOURCE_MEMORY_SECS: u64 = 86_400;
/// Long enough for a VM paused by its host or a congested link, short
/// enough that a dead peer does not hold a slot for the 15 minutes TCP
/// retransmission would take.
pub const DEFAULT_STALL_TIMEOUT_SECS: u64 = 60;
/// A dead client is noticed after about 60 + 10 x 6 = 120 seconds.
pub const DEFAULT_KEEPALIVE_IDLE_SECS: u64 = 60;
pub const DEFAULT_KEEPALIVE_INTERVAL_SECS: u64 = 10;
pub const DEFAULT_KEEPALIVE_COUNT: u32 = 6;
pub const DEFAULT_HANDSHAKE_TIMEOUT_SECS: u64 = 10;
/// A local server greets and answers options in milliseconds; one that
/// says nothing for this long is hung, and half the handshake timeout
/// leaves the client time to hear so.
pub const DEFAULT_UPSTREAM_TIMEOUT_SECS: u64 = 5;
pub const DEFAULT_SHUTDOWN_GRACE_SECS: u64 = 30;
/// A client trying names, or a LIST-less one guessing a few, stays far
/// below it; each refusal logs a line.
pub const DEFAULT_MAX_REFUSED_OPTIONS: u32 = 32;
/// Option data is a few short strings (export names and meta-context
/// queries of at most 4096 bytes each); 64 KiB leaves room for many
/// queries and still bounds what an unauthenticated client can send.
pub const DEFAULT_MAX_OPTION_LEN: u32 = 64 * 1024;
/// Admin connections at once: room for a burst of half-open ones to wait
/// out the header timeout while probes still get in, and a bounded share
/// of descriptors (about a sixth of what `--max-connections` needs).
pub const DEFAULT_ADMIN_MAX_CONNECTIONS: u32 = 512;
/// A probe sends its request at once; 5 s is generous on a loaded node.
pub const DEFAULT_ADMIN_HEADER_TIMEOUT_SECS: u64 = 5;
pub const DEFAULT_ADMIN_KEEPALIVE_REQUESTS: u32 = 100;
pub const DEFAULT_ADMIN_KEEPALIVE_TIMEOUT_SECS: u64 = 60;
/// hyper's smallest read buffer: the endpoints take no headers worth
/// more than a line or two.
pub const DEFAULT_ADMIN_MAX_HEADER_BYTES: u32 = 8192;
