//! The command line: every flag, its environment variable and its default,
//! in one place the binary, the man page and the shell completions share.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

use crate::config::{self, Cork};
use crate::confinement::LandlockMode;
use crate::tls::kernel::KernelTlsMode;
use crate::tls::MinVersion;

const AFTER_HELP: &str = "\
Signals: SIGHUP re-reads the TLS files at once. SIGTERM or SIGINT stops \
accepting (after --drain-delay), lets requests in flight finish within \
--shutdown-grace, then exits 0; a second one exits 1 at once.

systemd: a listening socket passed by socket activation (LISTEN_FDS) is \
served instead of --listen; one named \"admin\" (FileDescriptorName=admin) \
serves the admin endpoints. With NOTIFY_SOCKET set, nbdgw sends READY=1 \
once it serves and STOPPING=1 when a shutdown starts (Type=notify).

Examples:
  nbdgw certs --out /etc/nbdgw/tls --server-name gateway.example
  nbdgw --tls-dir /etc/nbdgw/tls --upstream /run/nbd/disk.sock
  nbdinfo 'nbds://gateway.example/?tls-certificates=DIR'";

/// TLS gateway for the Network Block Device protocol: accepts NBD clients
/// over TCP, requires NBD_OPT_STARTTLS, and relays them to an NBD server's
/// Unix socket.
#[derive(Parser, Debug)]
#[command(
    version,
    args_conflicts_with_subcommands = true,
    after_long_help = AFTER_HELP
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Make a CA, a server certificate and client certificates in the
    /// layout qemu, nbdkit and libnbd read.
    Certs(CertsArgs),
    /// Validate a --policy file, or show what it grants one certificate,
    /// before a rollout.
    Policy(PolicyArgs),
    /// Client mode: serve plaintext NBD on a Unix socket or loopback port
    /// to local clients (the kernel's nbd-client, clients without TLS),
    /// and relay each to a remote NBD server over STARTTLS and verified
    /// TLS.
    Client(ClientArgs),
}

const CLIENT_AFTER_HELP: &str = "\
The server's certificate must chain to the CA (ca-cert.pem in --tls-dir, \
or --tls-ca) and carry the --server host (or --server-name) as a DNS or IP \
SAN; there is no way to turn verification off. A client certificate \
(client-cert.pem and client-key.pem) is presented when there is one.

Signals: SIGHUP re-reads the TLS files at once. SIGTERM or SIGINT stops \
accepting, lets requests in flight finish within --shutdown-grace, then \
exits 0.

Examples:
  nbdgw client --server nbd.example:10809 --tls-dir /etc/nbdgw/client
  nbd-client -unix /run/nbdgw-client.sock /dev/nbd0 -N disk0
  qemu-img info 'nbd+unix:///disk0?socket=/run/nbdgw-client.sock'";

/// `nbdgw client`'s flags; their variables are NBDGW_CLIENT_*, so that a
/// server's environment never configures a client by accident.
#[derive(Args, Debug)]
#[command(after_long_help = CLIENT_AFTER_HELP)]
pub struct ClientArgs {
    /// Where local clients connect: a Unix socket path, or a loopback
    /// HOST:PORT (the local side is plaintext, so no other address is
    /// accepted).
    #[arg(
        long,
        env = "NBDGW_CLIENT_LISTEN",
        value_name = "PATH|HOST:PORT",
        default_value = "/run/nbdgw-client.sock"
    )]
    pub listen: LocalAddr,
    /// The remote NBD server (TLS with STARTTLS), e.g. nbd.example:10809
    /// or [2001:db8::1]:10809.
    #[arg(long, env = "NBDGW_CLIENT_SERVER", value_name = "HOST:PORT")]
    pub server: String,
    /// The name the server's certificate must carry (a DNS or IP SAN);
    /// default: the host of --server.
    #[arg(long, env = "NBDGW_CLIENT_SERVER_NAME", value_name = "NAME")]
    pub server_name: Option<String>,
    /// Directory with the CA and the client certificate: the layout of
    /// libnbd and qemu (ca-cert.pem, client-cert.pem, client-key.pem,
    /// optionally ca-crl.pem) or a Kubernetes TLS Secret (ca.crt, tls.crt,
    /// tls.key). Files named by the other --tls-* flags take precedence.
    #[arg(long, env = "NBDGW_CLIENT_TLS_DIR", value_name = "DIR")]
    pub tls_dir: Option<PathBuf>,
    /// CA bundle (PEM) the server's certificate must chain to.
    #[arg(long, env = "NBDGW_CLIENT_TLS_CA", value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate chain (PEM) to present.
    #[arg(
        long,
        env = "NBDGW_CLIENT_TLS_CERT",
        value_name = "FILE",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(
        long,
        env = "NBDGW_CLIENT_TLS_KEY",
        value_name = "FILE",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// Oldest TLS version offered to the server.
    #[arg(
        long,
        env = "NBDGW_CLIENT_TLS_MIN_VERSION",
        value_enum,
        default_value = "1.2"
    )]
    pub tls_min_version: MinVersion,
    /// Key exchange groups offered to the server, most preferred first,
    /// comma-separated, as rustls and OpenSSL name them: X25519MLKEM768
    /// (hybrid post-quantum), secp256r1MLKEM768, X25519, secp256r1
    /// (P-256), secp384r1 (P-384), MLKEM768, MLKEM1024. The first gets a
    /// key share in the ClientHello (with the default order, a hybrid's
    /// X25519 half too); a server with neither costs a HelloRetryRequest.
    /// Pure ML-KEM groups are an expert's choice (a warning at start).
    #[arg(long, env = "NBDGW_CLIENT_TLS_GROUPS", value_name = "GROUPS", default_value = crate::tls::groups::DEFAULT_GROUPS, value_parser = crate::tls::KxGroups::parse)]
    pub tls_groups: crate::tls::KxGroups,
    /// Seconds between looks at the TLS files for changes (a new CA
    /// bundle or client certificate is used by new connections); 0
    /// reloads only on SIGHUP.
    #[arg(long, env = "NBDGW_CLIENT_TLS_RELOAD_INTERVAL", default_value_t = 5)]
    pub tls_reload_interval: u64,
    /// Seconds the server may take to accept, greet and finish TLS, and
    /// then to answer each option; a local client then hears why.
    /// Keep it below --handshake-timeout.
    #[arg(long, env = "NBDGW_CLIENT_SERVER_TIMEOUT", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub server_timeout: u64,
    /// Keep local connections when the server's connection drops:
    /// reconnect, open the same export (its size and flags checked
    /// unchanged) and send the requests in flight again, in order.
    #[arg(long, env = "NBDGW_CLIENT_RECONNECT")]
    pub reconnect: bool,
    /// Seconds from a drop --reconnect waits for a server connection that
    /// answers before the requests in flight fail with EIO; new ones then
    /// fail at once until the server answers again (tries go on).
    #[arg(long, env = "NBDGW_CLIENT_RECONNECT_TIMEOUT", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub reconnect_timeout: u64,
    /// Bytes of requests in flight (write payloads included) --reconnect
    /// keeps per connection until they are answered; beyond it new
    /// requests wait. One request is always let through.
    #[arg(long, env = "NBDGW_CLIENT_REPLAY_BUFFER", value_name = "BYTES", default_value_t = 64 * 1024 * 1024)]
    pub replay_buffer: usize,
    /// Bytes of structured replies --reconnect holds per connection until
    /// their last chunk has come, so that a reply cut by a drop is asked
    /// again whole instead of ending in EIO. A reply beyond it goes up as
    /// it comes (and, if cut, ends in EIO).
    #[arg(long, env = "NBDGW_CLIENT_REPLY_BUFFER", value_name = "BYTES", default_value_t = 64 * 1024 * 1024)]
    pub reply_buffer: usize,
    /// Seconds a local client has from connecting to finishing negotiation.
    #[arg(long, env = "NBDGW_CLIENT_HANDSHAKE_TIMEOUT", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub handshake_timeout: u64,
    /// Seconds a connection may sit with no request in flight; 0 never
    /// closes it.
    #[arg(long, env = "NBDGW_CLIENT_IDLE_TIMEOUT", default_value_t = 0)]
    pub idle_timeout: u64,
    /// Seconds a started request payload or an unread reply may make no
    /// progress before the connection is closed; also the server
    /// connection's TCP_USER_TIMEOUT. 0: never.
    #[arg(long, env = "NBDGW_CLIENT_STALL_TIMEOUT", default_value_t = config::DEFAULT_STALL_TIMEOUT_SECS)]
    pub stall_timeout: u64,
    /// Seconds of silence before TCP keepalive probes the server; 0 turns
    /// keepalive off.
    #[arg(long, env = "NBDGW_CLIENT_TCP_KEEPALIVE", value_name = "IDLE", default_value_t = config::DEFAULT_KEEPALIVE_IDLE_SECS)]
    pub tcp_keepalive: u64,
    /// Largest request payload and read length in bytes.
    #[arg(long, env = "NBDGW_CLIENT_MAX_PAYLOAD", default_value_t = crate::proto::consts::DEFAULT_MAX_PAYLOAD)]
    pub max_payload: u32,
    /// Largest option data (and option reply) in bytes.
    #[arg(long, env = "NBDGW_CLIENT_MAX_OPTION_LEN", default_value_t = config::DEFAULT_MAX_OPTION_LEN)]
    pub max_option_len: u32,
    /// Most local connections served at once; more are closed at accept.
    #[arg(long, env = "NBDGW_CLIENT_MAX_CONNECTIONS", default_value_t = config::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Seconds open connections may finish after SIGTERM or SIGINT.
    #[arg(long, env = "NBDGW_CLIENT_SHUTDOWN_GRACE", default_value_t = config::DEFAULT_SHUTDOWN_GRACE_SECS)]
    pub shutdown_grace: u64,
    /// While draining, a local request that arrives after the drain
    /// began: close (unanswered; the connection closes once every earlier
    /// request is answered) or eshutdown (answered ESHUTDOWN).
    #[arg(long, env = "NBDGW_CLIENT_DRAIN_ANSWER", value_enum, default_value_t = crate::shutdown::DrainAnswer::Close)]
    pub drain_answer: crate::shutdown::DrainAnswer,
    /// Plain-HTTP admin endpoints (/healthz, /readyz, /server, /metrics)
    /// on this address, as the server mode's; off by default. /readyz
    /// fails while the last try to reach the server failed; /server
    /// fails while a --reconnect connection is reconnecting (/readyz
    /// stays ready).
    #[arg(long, env = "NBDGW_CLIENT_ADMIN_LISTEN", value_name = "HOST:PORT")]
    pub admin_listen: Option<SocketAddr>,
    /// Worker threads; 0 means one per CPU.
    #[arg(long, env = "NBDGW_CLIENT_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Log format; the filter comes from RUST_LOG (default info).
    #[arg(long, env = "NBDGW_CLIENT_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

#[derive(Args, Debug)]
pub struct PolicyArgs {
    #[command(subcommand)]
    pub command: PolicyCommand,
}

#[derive(Subcommand, Debug)]
pub enum PolicyCommand {
    /// Parse the policy file as nbdgw would at start. Exit status 0 when
    /// it is valid; otherwise 1, with FILE:LINE:COLUMN and the problem on
    /// stderr.
    Check {
        /// The policy file (TOML).
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
    /// Show which rule decides whether the client certificate may open the
    /// export, and with what access. Exit status 0 when a rule grants it,
    /// 1 when none does, 2 on an error. The --allow-* flags, which nbdgw
    /// checks first, are not consulted.
    Explain {
        /// The policy file (TOML).
        #[arg(long, value_name = "FILE")]
        policy: PathBuf,
        /// The client certificate (PEM; the first certificate in the file).
        #[arg(long, value_name = "FILE")]
        cert: PathBuf,
        /// The export name as the client would ask for it.
        #[arg(long, value_name = "NAME")]
        export: String,
    },
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on (the IANA NBD port by default).
    #[arg(long, env = "NBDGW_LISTEN", default_value = "0.0.0.0:10809")]
    pub listen: SocketAddr,
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
    /// Oldest TLS version accepted.
    #[arg(long, env = "NBDGW_TLS_MIN_VERSION", value_enum, default_value = "1.2")]
    pub tls_min_version: MinVersion,
    /// Whose order picks the cipher suite among those both sides have.
    #[arg(
        long,
        env = "NBDGW_TLS_CIPHER_ORDER",
        value_enum,
        default_value = "server"
    )]
    pub tls_cipher_order: crate::tls::CipherOrder,
    /// Key exchange groups accepted, comma-separated, as rustls and
    /// OpenSSL name them: X25519MLKEM768 (hybrid post-quantum),
    /// secp256r1MLKEM768, X25519, secp256r1 (P-256), secp384r1 (P-384),
    /// MLKEM768, MLKEM1024. The client's order picks among them (rustls);
    /// GnuTLS clients offer no hybrid and get a classical group.
    #[arg(long, env = "NBDGW_TLS_GROUPS", value_name = "GROUPS", default_value = crate::tls::groups::DEFAULT_GROUPS, value_parser = crate::tls::KxGroups::parse)]
    pub tls_groups: crate::tls::KxGroups,
    /// Seconds between looks at the TLS files for changes; 0 reloads only
    /// on SIGHUP.
    #[arg(long, env = "NBDGW_TLS_RELOAD_INTERVAL", default_value_t = 5)]
    pub tls_reload_interval: u64,
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
    /// SO_SNDBUF for upstream sockets in bytes; 0 keeps the kernel default.
    #[arg(long, env = "NBDGW_UPSTREAM_SNDBUF", default_value_t = config::DEFAULT_UPSTREAM_SNDBUF)]
    pub upstream_sndbuf: usize,
    /// Most client connections served at once; more are closed at accept.
    #[arg(long, env = "NBDGW_MAX_CONNECTIONS", default_value_t = config::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
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
    /// Seconds a connection may sit with no request in flight and no reply
    /// being written, counted from the last reply's last byte; 0 never
    /// closes it (VM disks can be idle for hours).
    #[arg(long, env = "NBDGW_IDLE_TIMEOUT", default_value_t = 0)]
    pub idle_timeout: u64,
    /// Seconds a started request payload, or a reply the client does not
    /// read, may make no progress before the connection is closed; also
    /// the TCP_USER_TIMEOUT for unacknowledged data. 0: never.
    #[arg(long, env = "NBDGW_STALL_TIMEOUT", default_value_t = config::DEFAULT_STALL_TIMEOUT_SECS)]
    pub stall_timeout: u64,
    /// Seconds of silence before TCP keepalive probes a client; 0 turns
    /// keepalive off. A client that powered off is closed after about
    /// IDLE + INTERVAL x COUNT seconds.
    #[arg(long, env = "NBDGW_TCP_KEEPALIVE", value_name = "IDLE", default_value_t = config::DEFAULT_KEEPALIVE_IDLE_SECS)]
    pub tcp_keepalive: u64,
    /// Seconds between keepalive probes.
    #[arg(long, env = "NBDGW_TCP_KEEPALIVE_INTERVAL", default_value_t = config::DEFAULT_KEEPALIVE_INTERVAL_SECS)]
    pub tcp_keepalive_interval: u64,
    /// Unanswered keepalive probes before the connection is dropped.
    #[arg(long, env = "NBDGW_TCP_KEEPALIVE_COUNT", default_value_t = config::DEFAULT_KEEPALIVE_COUNT)]
    pub tcp_keepalive_count: u32,
    /// Largest request payload and read length in bytes.
    #[arg(long, env = "NBDGW_MAX_PAYLOAD", default_value_t = crate::proto::consts::DEFAULT_MAX_PAYLOAD)]
    pub max_payload: u32,
    /// Largest option data (and option reply) in bytes.
    #[arg(long, env = "NBDGW_MAX_OPTION_LEN", default_value_t = config::DEFAULT_MAX_OPTION_LEN)]
    pub max_option_len: u32,
    /// Export names one connection may have refused (malformed, not
    /// granted by the policy, or unknown) before it is closed: each
    /// refusal logs a line.
    #[arg(long, env = "NBDGW_MAX_REFUSED_OPTIONS", default_value_t = config::DEFAULT_MAX_REFUSED_OPTIONS)]
    pub max_refused_options: u32,
    /// Plain-HTTP admin endpoints (/healthz, /readyz, /metrics) on this
    /// address, meant for localhost or the pod network; off by default.
    #[arg(long, env = "NBDGW_ADMIN_LISTEN", value_name = "HOST:PORT")]
    pub admin_listen: Option<SocketAddr>,
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
    /// Seconds to go on accepting after SIGTERM, not ready, so that load
    /// balancers stop sending clients first (5 s suits Kubernetes).
    #[arg(long, env = "NBDGW_DRAIN_DELAY", default_value_t = 0)]
    pub drain_delay: u64,
    /// Seconds open connections may finish after SIGTERM or SIGINT.
    #[arg(long, env = "NBDGW_SHUTDOWN_GRACE", default_value_t = config::DEFAULT_SHUTDOWN_GRACE_SECS)]
    pub shutdown_grace: u64,
    /// While draining, a request that arrives after the drain began:
    /// close (unanswered; the connection closes once every earlier request
    /// is answered, so qemu's reconnect-delay sends it again) or eshutdown
    /// (answered ESHUTDOWN, which qemu hands to the guest).
    #[arg(long, env = "NBDGW_DRAIN_ANSWER", value_enum, default_value_t = crate::shutdown::DrainAnswer::Close)]
    pub drain_answer: crate::shutdown::DrainAnswer,
    /// TCP_CORK around replies: deferred (held while the next reply is
    /// already waiting), per-reply (as QEMU), or off. For measuring; the
    /// default gives full segments.
    #[arg(long, env = "NBDGW_CORK", value_enum, default_value_t = Cork::Deferred)]
    pub cork: Cork,
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
    /// Worker threads; 0 means one per CPU. In a container, match the CPU
    /// limit.
    #[arg(long, env = "NBDGW_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Restrict the process with Landlock once started: read access only
    /// beneath the TLS (and policy) files' directories, no other file, Unix
    /// connects only to the upstream sockets, no TCP bind or connect, no
    /// abstract Unix socket or signal outside the process. true: what the
    /// kernel has (a kernel with less logs what stays open and serves);
    /// required: refuse to start unless all of it is enforced (Landlock
    /// ABI 9, Linux 7.1); false: no sandbox.
    #[arg(long, env = "NBDGW_LANDLOCK", value_enum, default_value_t = LandlockMode::On, value_name = "MODE")]
    pub landlock: LandlockMode,
    /// Log format; the filter comes from RUST_LOG (default info).
    #[arg(long, env = "NBDGW_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Hand-over to a successor process (`crate::handover`).
    #[command(flatten)]
    pub handover: crate::handover::HandoverArgs,
}

#[derive(Args, Debug)]
pub struct CertsArgs {
    /// Directory to write into (created if missing).
    #[arg(long, env = "NBDGW_CERTS_OUT")]
    pub out: PathBuf,
    /// DNS name or IP address for the server certificate (repeatable;
    /// default localhost and 127.0.0.1).
    #[arg(long = "server-name")]
    pub server_names: Vec<String>,
    /// Common name of a client certificate (repeatable; default
    /// nbdgw-client). The first is client-cert.pem, others client-NAME-cert.pem.
    #[arg(long = "client-name")]
    pub client_names: Vec<String>,
    /// URI SAN for a client certificate, e.g. a SPIFFE ID (repeatable: the
    /// Nth goes into the Nth client certificate).
    #[arg(long = "client-uri")]
    pub client_uris: Vec<String>,
    /// Validity of the leaf certificates in days.
    #[arg(long, default_value_t = 365)]
    pub days: u32,
    /// Overwrite existing files.
    #[arg(long)]
    pub force: bool,
    /// Issue from this existing CA certificate instead of making a new CA
    /// (with --ca-key), e.g. one kept with --keep-ca-key.
    #[arg(long, requires = "ca_key", value_name = "FILE")]
    pub ca_cert: Option<PathBuf>,
    /// The key of --ca-cert.
    #[arg(long, requires = "ca_cert", value_name = "FILE")]
    pub ca_key: Option<PathBuf>,
    /// Keep the new CA's key as ca-key.pem (mode 0600), to issue more
    /// certificates from it later; without it the key is thrown away.
    #[arg(long, conflicts_with = "ca_cert")]
    pub keep_ca_key: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum LogFormat {
    Text,
    Json,
}

/// Parses the process's arguments and environment, exiting with clap's
/// message on an error, as a command line tool should.
pub fn parse() -> Cli {
    let matches = Cli::command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    split_lists_from_the_environment(&mut cli.serve, &matches);
    cli
}

/// The clap definition, for the man page and shell completions.
pub fn command() -> clap::Command {
    Cli::command()
}

/// Names may hold commas (`CN=ACME, Backup`), so a flag's value is taken
/// whole; a variable can hold only one value, so it is a comma-separated
/// list.
pub fn split_lists_from_the_environment(args: &mut ServeArgs, matches: &ArgMatches) {
    for (id, list) in [
        ("allow_cn", &mut args.allow_cn),
        ("allow_dns", &mut args.allow_dns),
        ("allow_uri", &mut args.allow_uri),
    ] {
        if matches.value_source(id) == Some(ValueSource::EnvVariable) {
            *list = list
                .iter()
                .flat_map(|value| value.split(','))
                .map(|name| name.trim().to_string())
                .collect();
        }
    }
}

/// Where local clients connect: a Unix socket path or a loopback address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalAddr {
    Unix(std::path::PathBuf),
    Tcp(std::net::SocketAddr),
}

impl std::str::FromStr for LocalAddr {
    type Err = String;

    /// An address (`127.0.0.1:10809`, `[::1]:10809`, `localhost:10809`) is
    /// TCP; a path is a socket. A name with a port that is not
    /// `localhost` is refused rather than taken as a file name
    /// (`myhost:10809` would otherwise become a socket in the current
    /// directory, and nothing would listen where the operator meant).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(addr) = s.parse::<std::net::SocketAddr>() {
            return Ok(LocalAddr::Tcp(addr));
        }
        if s.contains('/') {
            return Ok(LocalAddr::Unix(std::path::PathBuf::from(s)));
        }
        match s.rsplit_once(':') {
            Some(("localhost", port)) => port
                .parse::<u16>()
                .map(|port| LocalAddr::Tcp((std::net::Ipv4Addr::LOCALHOST, port).into()))
                .map_err(|_| format!("{s}: not a port")),
            Some((_, port)) if port.parse::<u16>().is_ok() => Err(format!(
                "{s}: a TCP listen address is a loopback address (127.0.0.1:PORT, [::1]:PORT, localhost:PORT); a socket path needs a '/' (./{s})"
            )),
            _ => Ok(LocalAddr::Unix(std::path::PathBuf::from(s))),
        }
    }
}
