//! The server's flags (`nbdgw` without a subcommand), one group per
//! subsystem, each with its own `--help` section and its build step into
//! that subsystem's settings. Cross-group checks and what needs files
//! read are in `crate::setup`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use super::shared::{
    AdminListenArgs, ConnectionLimitArgs, ProcessArgs, RelayArgs, ShutdownArgs, TlsProtocolArgs,
};
use crate::config::{self, Cork, RelayLimits};
use crate::confinement::LandlockMode;
use crate::tls::kernel::KernelTlsMode;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on (the IANA NBD port by default).
    #[arg(long, env = "NBDGW_LISTEN", default_value = "0.0.0.0:10809")]
    pub listen: SocketAddr,
    #[command(flatten, next_help_heading = "TLS")]
    pub tls: ServerTlsArgs,
    #[command(flatten, next_help_heading = "Client access")]
    pub access: AccessArgs,
    #[command(flatten, next_help_heading = "Routing")]
    pub routing: RoutingArgs,
    #[command(flatten, next_help_heading = "Immutable exports and read cache")]
    pub cache: CacheArgs,
    #[command(flatten, next_help_heading = "Admission")]
    pub admission: AdmissionArgs,
    #[command(flatten, next_help_heading = "PROXY protocol")]
    pub proxy_protocol: ProxyProtocolArgs,
    #[command(flatten, next_help_heading = "Relay and timeouts")]
    pub relay: ServerRelayArgs,
    #[command(flatten, next_help_heading = "Admin endpoints")]
    pub admin: AdminArgs,
    #[command(flatten, next_help_heading = "Shutdown")]
    pub shutdown: ServerShutdownArgs,
    #[command(flatten, next_help_heading = "Hand-over to a successor process")]
    pub handover: crate::handover::HandoverArgs,
    #[command(flatten, next_help_heading = "Sandbox")]
    pub sandbox: SandboxArgs,
    #[command(flatten, next_help_heading = "Process and logging")]
    pub process: ProcessArgs,
}

/// The server's certificate, the client CA and revocation, and the TLS
/// protocol (`crate::tls::TlsSources`, `TlsPolicy`).
#[derive(Args, Debug)]
pub struct ServerTlsArgs {
    /// Server certificate chain (PEM).
    #[arg(long, env = "NBDGW_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Server private key (PEM).
    #[arg(long, env = "NBDGW_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Directory holding the certificate, key and optionally the client CA
    /// and CRL: the qemu/nbdkit layout (server-cert.pem, server-key.pem,
    /// ca-cert.pem, ca-crl.pem) or a Kubernetes TLS Secret (tls.crt,
    /// tls.key, ca.crt). A CA there makes client certificates required.
    /// Files named by the other --tls-* flags take precedence.
    #[arg(long, env = "NBDGW_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
    /// CA bundle (PEM) that client certificates must chain to. Without it
    /// (or a CA in --tls-dir) client certificates are not requested.
    #[arg(long, env = "NBDGW_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// CRLs (PEM) from the client CA: revoked client certificates are refused.
    #[arg(long, env = "NBDGW_TLS_CRL")]
    pub tls_crl: Option<PathBuf>,
    /// Accepted client certificate chains remembered, so that a client
    /// reconnecting is not put through its chain's path building and
    /// signature checks again (its handshake signature is always
    /// checked). Each is kept until its earliest notAfter or the CRLs'
    /// nextUpdate, and every TLS reload starts afresh; 0 keeps none.
    #[arg(long, env = "NBDGW_VERIFIED_CHAIN_CACHE", value_name = "N", default_value_t = crate::tls::VERIFIED_CHAIN_CACHE)]
    pub verified_chain_cache: usize,
    /// Admit clients whose CRL is past its nextUpdate. Without it such a
    /// client is refused until a fresh CRL is in place.
    #[arg(long, env = "NBDGW_TLS_CRL_ALLOW_EXPIRED")]
    pub tls_crl_allow_expired: bool,
    /// End established sessions whose client certificate a reloaded CRL
    /// revokes (true or false).
    #[arg(long, env = "NBDGW_TLS_REVOKE_CLOSES", default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub tls_revoke_closes: bool,
    /// Whose order picks the cipher suite among those both sides have.
    #[arg(
        long,
        env = "NBDGW_TLS_CIPHER_ORDER",
        value_enum,
        default_value = "server"
    )]
    pub tls_cipher_order: crate::tls::CipherOrder,
    #[command(flatten)]
    pub protocol: TlsProtocolArgs,
    /// Kernel TLS: after the handshake, hand TLS 1.3 sessions to the
    /// kernel's record layer when it has one (auto: probed at start,
    /// rustls otherwise), or never (off).
    #[arg(long, env = "NBDGW_KTLS", value_enum, default_value_t = KernelTlsMode::Auto)]
    pub ktls: KernelTlsMode,
    /// For tests: records nbdgw sends under one key on a kernel TLS
    /// session before it updates its own keys (default: the cipher's
    /// confidentiality limit, halved).
    #[arg(long, env = "NBDGW_KTLS_KEY_LIMIT", hide = true, value_parser = clap::value_parser!(u64).range(1..))]
    pub ktls_key_limit: Option<u64>,
}

/// Which client identities are admitted, and what each may open.
#[derive(Args, Debug)]
pub struct AccessArgs {
    /// Admit client certificates with this subject CN (repeatable). Exact
    /// match. The flag takes its value whole, commas included; only the
    /// variable is a comma-separated list.
    #[arg(long = "allow-cn", value_name = "NAME", env = "NBDGW_ALLOW_CN")]
    pub allow_cn: Vec<String>,
    /// Admit client certificates with this DNS SAN; a `*` label matches
    /// one label (repeatable; comma-separated in the variable).
    #[arg(long = "allow-dns", value_name = "NAME", env = "NBDGW_ALLOW_DNS")]
    pub allow_dns: Vec<String>,
    /// Admit client certificates with this URI SAN, e.g. a SPIFFE ID; a `*`
    /// segment matches one path segment (repeatable; comma-separated in
    /// the variable).
    #[arg(long = "allow-uri", value_name = "URI", env = "NBDGW_ALLOW_URI")]
    pub allow_uri: Vec<String>,
    /// TOML file saying which client identities may open which exports,
    /// read-write or read-only; reloaded like the TLS files, and a reload
    /// may only narrow it. Without it every admitted client may open every
    /// export read-write. Needs client certificates (a client CA).
    #[arg(long, env = "NBDGW_POLICY", value_name = "FILE")]
    pub policy: Option<PathBuf>,
    /// End established sessions whose access a policy reload withdraws or
    /// reduces to read-only, for their identity and export (true or
    /// false); false leaves them their access until they end.
    #[arg(long, env = "NBDGW_POLICY_REVOKE_CLOSES", default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub policy_revoke_closes: bool,
}

/// Where export names go: one upstream, named exports or a directory.
#[derive(Args, Debug)]
pub struct RoutingArgs {
    /// Unix socket of the NBD server to relay to; every export name the
    /// client asks for goes to it unchanged.
    #[arg(long, env = "NBDGW_UPSTREAM", conflicts_with_all = ["exports", "export_dir"])]
    pub upstream: Option<PathBuf>,
    /// A named export instead of --upstream: clients asking for NAME are
    /// relayed to the server on the Unix socket PATH, which is asked for
    /// UPSTREAM_NAME (default ""). Repeatable, or comma-separated.
    #[arg(
        long = "export",
        value_name = "NAME=PATH[:UPSTREAM_NAME]",
        env = "NBDGW_EXPORT",
        value_delimiter = ','
    )]
    pub exports: Vec<crate::exports::Export>,
    /// Every Unix socket NAME.sock in this directory is the export NAME,
    /// and TENANT/NAME.sock in a subdirectory the export TENANT/NAME;
    /// picked up and dropped as sockets appear and disappear.
    #[arg(long, env = "NBDGW_EXPORT_DIR", value_name = "DIR")]
    pub export_dir: Option<PathBuf>,
    /// Whose sockets --export-dir serves: same (the default: a socket
    /// owned by its directory's owner, whose server, by SO_PEERCRED, runs
    /// as that uid); a numeric uid (directory, socket and server all that
    /// uid); or any (whoever can create a socket there). Symbolic links
    /// are never followed, whatever this says.
    #[arg(long, env = "NBDGW_EXPORT_DIR_OWNER", value_name = "same|UID|any")]
    pub export_dir_owner: Option<crate::exports::OwnerCheck>,
    /// SO_SNDBUF for upstream sockets in bytes; 0 keeps the kernel default.
    #[arg(long, env = "NBDGW_UPSTREAM_SNDBUF", default_value_t = config::DEFAULT_UPSTREAM_SNDBUF)]
    pub upstream_sndbuf: usize,
}

/// Immutable exports and the read cache they share.
#[derive(Args, Debug)]
pub struct CacheArgs {
    /// Declares the export NAME immutable: its data never changes while
    /// nbdgw runs (a golden image). It is read-only for every identity,
    /// and its reads go through the shared read cache (--cache-size).
    /// A `*` component matches any one component (`golden/*`).
    /// Repeatable, or comma-separated. Never the default.
    #[arg(
        long = "immutable-export",
        value_name = "NAME",
        env = "NBDGW_IMMUTABLE_EXPORT",
        value_delimiter = ','
    )]
    pub immutable_exports: Vec<String>,
    /// With --upstream: every export it serves is immutable (see
    /// --immutable-export).
    #[arg(long, env = "NBDGW_IMMUTABLE")]
    pub immutable: bool,
    /// Bytes of memory the read cache of immutable exports may hold, in
    /// blocks (--cache-block-size) shared by every connection; 0 turns it
    /// off (the exports stay read-only).
    #[arg(long, env = "NBDGW_CACHE_SIZE", value_name = "BYTES", default_value_t = crate::cache::DEFAULT_CACHE_SIZE)]
    pub cache_size: u64,
    /// Bytes per read cache block (a power of two, 4096 to 65536): a
    /// read that misses fetches the whole blocks around it. Larger blocks
    /// bring a boot's neighbouring reads in with one upstream read;
    /// smaller ones fetch less for scattered reads of a working set
    /// larger than the cache.
    #[arg(long, env = "NBDGW_CACHE_BLOCK_SIZE", value_name = "BYTES", default_value_t = crate::cache::BLOCK_SIZE, value_parser = crate::cache::parse_block_size)]
    pub cache_block_size: u64,
    /// Bytes one read-ahead request fetches into the cache once a
    /// connection reads an immutable export sequentially (rounded down to
    /// whole blocks, at most --max-payload); 0 turns read-ahead off.
    #[arg(long, env = "NBDGW_READ_AHEAD", value_name = "BYTES", default_value_t = crate::cache::DEFAULT_READ_AHEAD)]
    pub read_ahead: u32,
    /// Read-ahead requests one connection may have in flight at once.
    #[arg(long, env = "NBDGW_READ_AHEAD_DEPTH", value_name = "N", default_value_t = crate::cache::DEFAULT_READ_AHEAD_DEPTH, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub read_ahead_depth: u32,
    /// Reads that missed the cache one connection may have in flight at
    /// once as fills (widened to whole blocks, answered from a buffer
    /// when the reply is complete); past this, a read goes upstream as
    /// it came, and is cached as its reply passes if it is short.
    #[arg(long, env = "NBDGW_CACHE_FILL_DEPTH", value_name = "N", default_value_t = crate::cache::DEFAULT_CACHE_FILL_DEPTH, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub cache_fill_depth: u32,
}

/// Admission: sessions, handshake slots, the queue before them and what
/// makes one source.
#[derive(Args, Debug)]
pub struct AdmissionArgs {
    #[command(flatten)]
    pub connections: ConnectionLimitArgs,
    /// Of those, how many one client identity (the certificate's CN, DNS
    /// and URI names; clients without certificates are one identity) may
    /// hold; more are told so and closed. Default: a quarter of
    /// --max-connections with client certificates, all of it without.
    #[arg(long, env = "NBDGW_MAX_SESSIONS_PER_IDENTITY", value_name = "N")]
    pub max_sessions_per_identity: Option<usize>,
    /// Connections still negotiating (before their client certificate is
    /// verified) served at once, apart from --max-connections; more wait
    /// their turn (see --handshake-queue).
    #[arg(long, env = "NBDGW_MAX_HANDSHAKES", default_value_t = config::DEFAULT_MAX_HANDSHAKES)]
    pub max_handshakes: usize,
    /// Of those, how many one source (see --source-prefix-v4 and
    /// --source-prefix-v6) may hold.
    #[arg(long, env = "NBDGW_MAX_HANDSHAKES_PER_SOURCE", default_value_t = config::DEFAULT_MAX_HANDSHAKES_PER_SOURCE)]
    pub max_handshakes_per_source: usize,
    /// Connections that may wait for a handshake slot, all sources
    /// together (one descriptor each, no buffers); when full, the longest
    /// waiter of the source with the most waiting makes room.
    #[arg(long, env = "NBDGW_HANDSHAKE_QUEUE", default_value_t = config::DEFAULT_HANDSHAKE_QUEUE)]
    pub handshake_queue: usize,
    /// Of those, how many one source may have waiting; more from it are
    /// closed at accept.
    #[arg(long, env = "NBDGW_HANDSHAKE_QUEUE_PER_SOURCE", default_value_t = config::DEFAULT_HANDSHAKE_QUEUE_PER_SOURCE)]
    pub handshake_queue_per_source: usize,
    /// Seconds a connection may wait for its handshake slot before it is
    /// closed, counted from accept; never more than --handshake-timeout,
    /// which the wait uses up.
    #[arg(long, env = "NBDGW_HANDSHAKE_QUEUE_TIMEOUT", default_value_t = config::DEFAULT_HANDSHAKE_QUEUE_TIMEOUT_SECS, value_parser = clap::value_parser!(u64).range(1..))]
    pub handshake_queue_timeout: u64,
    /// Of --max-handshakes, the slots only proven sources (see
    /// --source-memory) may take, so slow handshakes from unproven
    /// sources, however many, never hold them all. Default: a quarter.
    #[arg(long, env = "NBDGW_HANDSHAKE_RESERVE", value_name = "N")]
    pub handshake_reserve: Option<usize>,
    /// Seconds a source stays "proven" after one of its clients opened an
    /// export with a client certificate: it may use --handshake-reserve,
    /// and its waiting connections are never shed for those of unproven
    /// sources; 0 (or no client CA): no source is.
    #[arg(long, env = "NBDGW_SOURCE_MEMORY", value_name = "SECS", default_value_t = config::DEFAULT_SOURCE_MEMORY_SECS)]
    pub source_memory: u64,
    /// Leading bits of an IPv4 address (0 to 32) that make one source for
    /// --max-handshakes-per-source; IPv4-mapped IPv6 peers count as IPv4.
    #[arg(long, env = "NBDGW_SOURCE_PREFIX_V4", value_name = "BITS", default_value_t = config::DEFAULT_SOURCE_PREFIX_V4)]
    pub source_prefix_v4: u8,
    /// Leading bits of an IPv6 address (0 to 128) that make one source for
    /// --max-handshakes-per-source: a host usually owns a whole /64.
    #[arg(long, env = "NBDGW_SOURCE_PREFIX_V6", value_name = "BITS", default_value_t = config::DEFAULT_SOURCE_PREFIX_V6)]
    pub source_prefix_v6: u8,
}

/// Balancers trusted to send a PROXY protocol header.
#[derive(Args, Debug)]
pub struct ProxyProtocolArgs {
    /// Trust this balancer (an address, or a CIDR prefix; repeatable;
    /// comma-separated in the variable) to put a PROXY protocol header
    /// (v1 or v2) before each connection: its connections must start with
    /// one, and the address it carries is the client's for admission,
    /// logs and the audit trail. From anyone else no header is read.
    /// Items are trimmed; empty ones are skipped.
    #[arg(
        long,
        env = "NBDGW_PROXY_PROTOCOL_FROM",
        value_name = "CIDR",
        value_delimiter = ','
    )]
    pub proxy_protocol_from: Vec<crate::balancer::PrefixItem>,
    /// Serve connections whose PROXY v2 header is LOCAL as the balancer's
    /// own (true or false). HAProxy sends LOCAL for its health checks but
    /// also for clients it cannot name (a unix socket frontend), which
    /// would all count as one source; by default such a connection is
    /// closed right after its header (a balancer's check has passed by
    /// then).
    #[arg(long, env = "NBDGW_PROXY_PROTOCOL_SERVE_LOCAL", default_value_t = false, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub proxy_protocol_serve_local: bool,
    /// Seconds a connection from a --proxy-protocol-from balancer has from
    /// accept to the end of its PROXY header (balancers send it at once);
    /// --handshake-timeout still bounds it if shorter.
    #[arg(long, env = "NBDGW_PROXY_PROTOCOL_TIMEOUT", value_name = "SECONDS", default_value_t = crate::balancer::DEFAULT_HEADER_TIMEOUT_SECS)]
    pub proxy_protocol_timeout: u64,
    /// The longest PROXY protocol v2 header taken, in bytes (16, the
    /// addresses, and TLVs, which are skipped); a longer one is refused.
    #[arg(long, env = "NBDGW_PROXY_PROTOCOL_MAX_HEADER", value_name = "BYTES", default_value_t = crate::balancer::DEFAULT_MAX_HEADER)]
    pub proxy_protocol_max_header: usize,
}

/// The server's relay: negotiation bounds, timeouts and keepalive.
#[derive(Args, Debug)]
pub struct ServerRelayArgs {
    /// Seconds a client has from its accept to its session: the wait for
    /// a handshake slot, the TLS handshake and negotiation together; one
    /// whose slot came late in line still has half of it from then (the
    /// whole time is at most 1.5 times it).
    #[arg(long, env = "NBDGW_HANDSHAKE_TIMEOUT", default_value_t = config::DEFAULT_HANDSHAKE_TIMEOUT_SECS)]
    pub handshake_timeout: u64,
    /// Seconds an upstream may take, in negotiation, to accept and greet,
    /// and then to answer each option; a server that does not gets the
    /// client NBD_REP_ERR_SHUTDOWN. Keep it below --handshake-timeout.
    #[arg(long, env = "NBDGW_UPSTREAM_TIMEOUT", default_value_t = config::DEFAULT_UPSTREAM_TIMEOUT_SECS)]
    pub upstream_timeout: u64,
    #[command(flatten)]
    pub common: RelayArgs,
    /// Seconds between keepalive probes.
    #[arg(long, env = "NBDGW_TCP_KEEPALIVE_INTERVAL", default_value_t = config::DEFAULT_KEEPALIVE_INTERVAL_SECS)]
    pub tcp_keepalive_interval: u64,
    /// Unanswered keepalive probes before the connection is dropped.
    #[arg(long, env = "NBDGW_TCP_KEEPALIVE_COUNT", default_value_t = config::DEFAULT_KEEPALIVE_COUNT)]
    pub tcp_keepalive_count: u32,
    /// Export names one connection may have refused (malformed, not
    /// granted by the policy, or unknown) before it is closed: each
    /// refusal logs a line.
    #[arg(long, env = "NBDGW_MAX_REFUSED_OPTIONS", default_value_t = config::DEFAULT_MAX_REFUSED_OPTIONS)]
    pub max_refused_options: u32,
    /// TCP_CORK around replies: deferred (held while the next reply is
    /// already waiting), per-reply (as QEMU), or off. For measuring; the
    /// default gives full segments.
    #[arg(long, env = "NBDGW_CORK", value_enum, default_value_t = Cork::Deferred)]
    pub cork: Cork,
}

/// The admin endpoints: where, and the bounds on their connections.
#[derive(Args, Debug)]
pub struct AdminArgs {
    #[command(flatten)]
    pub listen: AdminListenArgs,
    /// Admin connections open at once; more are closed at accept (and
    /// counted), so probes and scrapers can never take the descriptors the
    /// NBD clients need.
    #[arg(long, env = "NBDGW_ADMIN_MAX_CONNECTIONS", default_value_t = config::DEFAULT_ADMIN_MAX_CONNECTIONS, value_parser = clap::value_parser!(u32).range(1..))]
    pub admin_max_connections: u32,
    /// Seconds an admin connection has to send a request's headers, from
    /// accept or from the previous response; slower ones are closed.
    #[arg(long, env = "NBDGW_ADMIN_HEADER_TIMEOUT", default_value_t = config::DEFAULT_ADMIN_HEADER_TIMEOUT_SECS, value_parser = clap::value_parser!(u64).range(1..))]
    pub admin_header_timeout: u64,
    /// Requests one admin connection may send (keep-alive); the response
    /// to the last says Connection: close. 1: no keep-alive.
    #[arg(long, env = "NBDGW_ADMIN_KEEPALIVE_REQUESTS", default_value_t = config::DEFAULT_ADMIN_KEEPALIVE_REQUESTS, value_parser = clap::value_parser!(u32).range(1..))]
    pub admin_keepalive_requests: u32,
    /// Seconds an admin connection may stay open in all, however busy;
    /// then it is closed after the response in progress.
    #[arg(long, env = "NBDGW_ADMIN_KEEPALIVE_TIMEOUT", default_value_t = config::DEFAULT_ADMIN_KEEPALIVE_TIMEOUT_SECS, value_parser = clap::value_parser!(u64).range(1..))]
    pub admin_keepalive_timeout: u64,
    /// Largest admin request head (request line and headers) in bytes;
    /// larger ones are refused. At least 8192 (hyper's smallest buffer).
    #[arg(long, env = "NBDGW_ADMIN_MAX_HEADER_BYTES", default_value_t = config::DEFAULT_ADMIN_MAX_HEADER_BYTES, value_parser = clap::value_parser!(u32).range(8192..=1048576))]
    pub admin_max_header_bytes: u32,
}

/// SIGTERM: how long the server goes on accepting, then the grace.
#[derive(Args, Debug)]
pub struct ServerShutdownArgs {
    /// Seconds to go on accepting after SIGTERM, not ready, so that load
    /// balancers stop sending clients first (5 s suits Kubernetes).
    #[arg(long, env = "NBDGW_DRAIN_DELAY", default_value_t = 0)]
    pub drain_delay: u64,
    #[command(flatten)]
    pub common: ShutdownArgs,
}

/// The Landlock sandbox.
#[derive(Args, Debug)]
pub struct SandboxArgs {
    /// Restrict the process with Landlock once started: read access only
    /// beneath the TLS (and policy) files' directories, no other file, Unix
    /// connects only to the upstream sockets, no TCP bind or connect, no
    /// abstract Unix socket or signal outside the process. true: what the
    /// kernel has (a kernel with less logs what stays open and serves);
    /// required: refuse to start unless all of it is enforced (Landlock
    /// ABI 9, Linux 7.1); false: no sandbox.
    #[arg(long, env = "NBDGW_LANDLOCK", value_enum, default_value_t = LandlockMode::On, value_name = "MODE")]
    pub landlock: LandlockMode,
}

impl ServerTlsArgs {
    /// Where the TLS files are read from.
    pub fn sources(&self) -> crate::tls::TlsSources {
        crate::tls::TlsSources {
            dir: self.tls_dir.clone(),
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
            client_ca: self.tls_client_ca.clone(),
            crl: self.tls_crl.clone(),
        }
    }

    /// How handshakes are held; `allow` comes from the access group,
    /// `secret_extraction` from whether kernel TLS is on.
    pub fn policy(
        &self,
        allow: crate::tls::AllowList,
        secret_extraction: bool,
    ) -> crate::tls::TlsPolicy {
        crate::tls::TlsPolicy {
            min_version: self.protocol.tls_min_version,
            allow,
            crl_allow_expired: self.tls_crl_allow_expired,
            revoke_closes: self.tls_revoke_closes,
            secret_extraction,
            verified_chain_cache: self.verified_chain_cache,
            cipher_order: self.tls_cipher_order,
            groups: self.protocol.tls_groups.clone(),
        }
    }
}

impl AccessArgs {
    pub fn allow_list(&self) -> anyhow::Result<crate::tls::AllowList> {
        Ok(crate::tls::AllowList::new(
            self.allow_cn.clone(),
            self.allow_dns.clone(),
            self.allow_uri.clone(),
        )?)
    }

    /// Whether any `--allow-*` list admits clients (the audit trail then
    /// names them as what granted a session).
    pub fn allow_lists(&self) -> bool {
        !(self.allow_cn.is_empty() && self.allow_dns.is_empty() && self.allow_uri.is_empty())
    }
}

impl CacheArgs {
    /// The immutable exports, and the read cache they share when it is
    /// on; `upstream` says whether --upstream is given, `max_payload`
    /// bounds --read-ahead.
    pub fn settings(
        &self,
        upstream: bool,
        max_payload: u32,
        metrics: crate::metrics::CacheMetrics,
    ) -> anyhow::Result<config::ReadCacheSettings> {
        // With named exports, every export immutable would be a blanket
        // the operator should spell out (--immutable-export '*').
        if self.immutable && !upstream {
            anyhow::bail!(
                "--immutable (NBDGW_IMMUTABLE) needs --upstream; name exports with --immutable-export"
            );
        }
        let immutable =
            crate::exports::Immutable::new(self.immutable, self.immutable_exports.clone())?;
        if self.read_ahead > max_payload {
            anyhow::bail!("--read-ahead must not exceed --max-payload");
        }
        let cache = (immutable.any() && self.cache_size > 0).then(|| {
            tracing::info!(
                cache_size = self.cache_size,
                cache_block_size = self.cache_block_size,
                read_ahead = self.read_ahead,
                read_ahead_depth = self.read_ahead_depth,
                cache_fill_depth = self.cache_fill_depth,
                "read cache on for immutable exports"
            );
            crate::cache::ReadCache::with_block_size(
                self.cache_size,
                self.cache_block_size,
                metrics,
            )
        });
        Ok(config::ReadCacheSettings {
            immutable: Arc::new(immutable),
            cache,
            read_ahead: self.read_ahead,
            read_ahead_depth: self.read_ahead_depth,
            cache_fill_depth: self.cache_fill_depth,
        })
    }
}

impl AdmissionArgs {
    /// The handshake slots kept for proven sources out of `handshakes`:
    /// none where no source can be proven (no client CA, or
    /// `--source-memory 0`); a quarter by default; a given reserve lowered
    /// with `--max-handshakes` when the descriptor limit lowers that.
    pub fn handshake_reserve(&self, handshakes: usize, client_certificates: bool) -> usize {
        if !client_certificates || self.source_memory == 0 {
            return 0;
        }
        match self.handshake_reserve {
            Some(given) => given * handshakes / self.max_handshakes.max(1),
            None => handshakes / 4,
        }
        .min(handshakes.saturating_sub(1))
    }

    /// `--max-sessions-per-identity`, or its default share of `sessions`
    /// (which the descriptor limit may have lowered).
    pub fn sessions_per_identity(&self, sessions: usize, client_certificates: bool) -> usize {
        self.max_sessions_per_identity
            .unwrap_or_else(|| config::default_sessions_per_identity(sessions, client_certificates))
    }

    /// The admission bounds as given, before the descriptor limit's
    /// fitting and the derived defaults (`crate::setup`).
    pub fn apply(&self, config: &mut config::Config) {
        config.max_connections = self.connections.max_connections;
        config.max_handshakes = self.max_handshakes;
        config.max_handshakes_per_source = self.max_handshakes_per_source;
        config.handshake_queue = self.handshake_queue;
        config.handshake_queue_per_source = self.handshake_queue_per_source;
        config.handshake_queue_timeout = Duration::from_secs(self.handshake_queue_timeout);
        config.source_memory = Duration::from_secs(self.source_memory);
    }
}

impl ProxyProtocolArgs {
    /// The balancers trusted; `pending` bounds their connections before
    /// the header.
    pub fn trusted(&self, pending: usize) -> crate::balancer::Trusted {
        crate::balancer::Trusted {
            from: self
                .proxy_protocol_from
                .iter()
                .filter_map(|p| p.0)
                .collect(),
            max_header: self.proxy_protocol_max_header,
            serve_local: self.proxy_protocol_serve_local,
            header_timeout: Duration::from_secs(self.proxy_protocol_timeout),
            pending,
        }
    }

    /// Connections from balancers before their PROXY header, before the
    /// descriptor limit's fitting: what admission itself holds
    /// unauthenticated (see `crate::balancer`), if any balancer is trusted.
    pub fn pending_bound(&self, admission: &AdmissionArgs) -> usize {
        match self.proxy_protocol_from.iter().any(|p| p.0.is_some()) {
            true => admission
                .max_handshakes
                .saturating_add(admission.handshake_queue),
            false => 0,
        }
    }
}

impl ServerRelayArgs {
    pub fn limits(&self) -> RelayLimits {
        self.common.limits(
            Duration::from_secs(self.tcp_keepalive_interval),
            self.tcp_keepalive_count,
        )
    }
}

impl AdminArgs {
    pub fn limits(&self) -> crate::admin::AdminLimits {
        crate::admin::AdminLimits {
            max_connections: self.admin_max_connections,
            header_timeout: Duration::from_secs(self.admin_header_timeout),
            keepalive_requests: self.admin_keepalive_requests,
            keepalive_timeout: Duration::from_secs(self.admin_keepalive_timeout),
            max_header_bytes: self.admin_max_header_bytes as usize,
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches};

    use super::*;

    fn serve(args: &[&str]) -> ServeArgs {
        let matches = crate::cli::Cli::command()
            .try_get_matches_from(std::iter::once("nbdgw").chain(args.iter().copied()))
            .unwrap();
        crate::cli::Cli::from_arg_matches(&matches).unwrap().serve
    }

    #[test]
    fn the_handshake_reserve_is_a_quarter_and_only_with_client_certificates() {
        let admission = serve(&["--max-handshakes", "64"]).admission;
        assert_eq!(admission.handshake_reserve(64, true), 16);
        assert_eq!(admission.handshake_reserve(64, false), 0);
        // Lowered by the descriptor limit, it follows the slots down.
        assert_eq!(admission.handshake_reserve(8, true), 2);
    }

    #[test]
    fn a_given_reserve_shrinks_with_the_slots_and_leaves_one_unproven() {
        let admission = serve(&["--max-handshakes", "64", "--handshake-reserve", "32"]).admission;
        assert_eq!(admission.handshake_reserve(64, true), 32);
        assert_eq!(admission.handshake_reserve(16, true), 8);
        assert_eq!(admission.handshake_reserve(1, true), 0);
        let no_memory = serve(&["--handshake-reserve", "8", "--source-memory", "0"]).admission;
        assert_eq!(no_memory.handshake_reserve(64, true), 0);
    }

    #[test]
    fn sessions_per_identity_default_to_a_quarter_with_client_certificates() {
        let admission = serve(&[]).admission;
        assert_eq!(admission.sessions_per_identity(1024, true), 256);
        assert_eq!(admission.sessions_per_identity(1024, false), 1024);
        assert_eq!(admission.sessions_per_identity(2, true), 1);
        let given = serve(&["--max-sessions-per-identity", "10"]).admission;
        assert_eq!(given.sessions_per_identity(1024, true), 10);
    }

    #[test]
    fn admission_bounds_are_applied_as_given() {
        let args = serve(&[
            "--max-connections",
            "100",
            "--max-handshakes",
            "20",
            "--max-handshakes-per-source",
            "4",
            "--handshake-queue",
            "50",
            "--handshake-queue-per-source",
            "5",
            "--handshake-queue-timeout",
            "3",
            "--source-memory",
            "60",
        ]);
        let dir = tempfile::tempdir().unwrap();
        crate::certs::for_test(dir.path(), "localhost", 1);
        let (cert, key) = (
            dir.path().join("server-cert.pem"),
            dir.path().join("server-key.pem"),
        );
        let tls = crate::tls::TlsStore::fixed(crate::tls::load_server_config(&cert, &key).unwrap());
        let mut config = config::Config::new(PathBuf::from("/u.sock"), tls);
        args.admission.apply(&mut config);
        assert_eq!(config.max_connections, 100);
        assert_eq!(config.max_handshakes, 20);
        assert_eq!(config.max_handshakes_per_source, 4);
        assert_eq!(config.handshake_queue, 50);
        assert_eq!(config.handshake_queue_per_source, 5);
        assert_eq!(config.handshake_queue_timeout, Duration::from_secs(3));
        assert_eq!(config.source_memory, Duration::from_secs(60));
    }

    #[test]
    fn only_a_trusted_balancer_makes_connections_wait_for_a_header() {
        let none = serve(&["--max-handshakes", "10", "--handshake-queue", "30"]);
        assert_eq!(none.proxy_protocol.pending_bound(&none.admission), 0);
        assert!(none.proxy_protocol.trusted(0).from.is_empty());
        let args = serve(&[
            "--max-handshakes",
            "10",
            "--handshake-queue",
            "30",
            "--proxy-protocol-from",
            "10.0.0.0/8",
            "--proxy-protocol-timeout",
            "2",
        ]);
        let pending = args.proxy_protocol.pending_bound(&args.admission);
        assert_eq!(pending, 40);
        let trusted = args.proxy_protocol.trusted(pending);
        assert_eq!(trusted.from.len(), 1);
        assert_eq!(trusted.header_timeout, Duration::from_secs(2));
        assert_eq!(trusted.pending, 40);
        assert!(!trusted.serve_local);
    }

    #[test]
    fn the_server_relay_takes_its_keepalive_probes_from_its_flags() {
        let relay = serve(&[
            "--tcp-keepalive",
            "30",
            "--tcp-keepalive-interval",
            "4",
            "--tcp-keepalive-count",
            "2",
        ])
        .relay
        .limits();
        let keepalive = relay.keepalive.unwrap();
        assert_eq!(keepalive.idle, Duration::from_secs(30));
        assert_eq!(
            (keepalive.interval, keepalive.count),
            (Duration::from_secs(4), 2)
        );
        let defaults = serve(&[]).relay.limits();
        assert_eq!(defaults.keepalive, Some(config::Keepalive::default()));
        assert_eq!(defaults.idle_timeout, None);
        assert_eq!(
            defaults.stall_timeout,
            Some(Duration::from_secs(config::DEFAULT_STALL_TIMEOUT_SECS))
        );
    }

    #[test]
    fn admin_limits_from_their_flags() {
        let limits = serve(&[
            "--admin-max-connections",
            "7",
            "--admin-header-timeout",
            "2",
        ])
        .admin
        .limits();
        assert_eq!(limits.max_connections, 7);
        assert_eq!(limits.header_timeout, Duration::from_secs(2));
        assert_eq!(
            limits.max_header_bytes,
            config::DEFAULT_ADMIN_MAX_HEADER_BYTES as usize
        );
    }

    #[test]
    fn the_tls_policy_takes_the_shared_protocol_flags() {
        let tls = serve(&["--tls-min-version", "1.3", "--tls-groups", "X25519"]).tls;
        let policy = tls.policy(crate::tls::AllowList::default(), false);
        assert_eq!(policy.min_version, crate::tls::MinVersion::Tls13);
        assert_eq!(policy.groups.to_string(), "X25519");
        assert!(policy.revoke_closes);
    }

    fn cache(args: &[&str], upstream: bool) -> anyhow::Result<config::ReadCacheSettings> {
        let args = serve(args);
        let metrics = crate::metrics::CacheMetrics::default();
        args.cache
            .settings(upstream, args.relay.common.max_payload, metrics)
    }

    #[test]
    fn the_read_cache_is_on_only_for_immutable_exports_and_a_size() {
        let off = cache(&[], true).unwrap();
        assert!(off.cache.is_none());
        assert!(!off.immutable.any());
        let on = cache(&["--immutable", "--read-ahead", "65536"], true).unwrap();
        assert!(on.cache.is_some());
        assert!(on.immutable.matches(""));
        assert_eq!(on.read_ahead, 65536);
        let sized_out =
            cache(&["--immutable-export", "golden", "--cache-size", "0"], true).unwrap();
        assert!(sized_out.cache.is_none(), "0 turns the cache off");
        assert!(
            sized_out.immutable.matches("golden"),
            "the export stays read-only"
        );
    }

    #[test]
    fn bad_read_cache_flags_are_refused() {
        let err = cache(&["--immutable"], false).err().unwrap().to_string();
        assert!(
            err.contains("--immutable (NBDGW_IMMUTABLE) needs --upstream"),
            "{err}"
        );
        let err = cache(&["--max-payload", "4096", "--read-ahead", "8192"], true)
            .err()
            .unwrap()
            .to_string();
        assert_eq!(err, "--read-ahead must not exceed --max-payload");
    }
}
