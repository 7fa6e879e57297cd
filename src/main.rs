//! The nbdgw command: flags and environment, logging, signals, start-up.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use tokio::net::TcpListener;
use tracing::{info, warn};

use nbdgw::config::{self, Config, Cork, Keepalive};

/// glibc's malloc keeps what a burst of connections freed (a 64-client
/// soak left RSS at its peak, 66 MiB against 13 idle); jemalloc, with its
/// background thread, gives freed pages back within seconds.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
use nbdgw::tls::{AllowList, MinVersion, Reloader, TlsPolicy, TlsSources, TlsStore};

/// TLS gateway for the Network Block Device protocol: accepts NBD clients
/// over TCP, requires NBD_OPT_STARTTLS, and relays them to an NBD server's
/// Unix socket.
#[derive(Parser, Debug)]
#[command(version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Make a CA, a server certificate and client certificates in the
    /// layout qemu, nbdkit and libnbd read.
    Certs(CertsArgs),
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// Address to listen on (the IANA NBD port by default).
    #[arg(long, env = "NBDGW_LISTEN", default_value = "0.0.0.0:10809")]
    listen: SocketAddr,
    /// Server certificate chain (PEM).
    #[arg(long, env = "NBDGW_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Server private key (PEM).
    #[arg(long, env = "NBDGW_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Directory holding the certificate, key and optionally the client CA
    /// and CRL: the qemu/nbdkit layout (server-cert.pem, server-key.pem,
    /// ca-cert.pem, ca-crl.pem) or a Kubernetes TLS Secret (tls.crt,
    /// tls.key, ca.crt). A CA there makes client certificates required.
    /// Files named by the other --tls-* flags take precedence.
    #[arg(long, env = "NBDGW_TLS_DIR")]
    tls_dir: Option<PathBuf>,
    /// CA bundle (PEM) that client certificates must chain to. Without it
    /// (or a CA in --tls-dir) client certificates are not requested.
    #[arg(long, env = "NBDGW_TLS_CLIENT_CA")]
    tls_client_ca: Option<PathBuf>,
    /// CRLs (PEM) from the client CA: revoked client certificates are refused.
    #[arg(long, env = "NBDGW_TLS_CRL")]
    tls_crl: Option<PathBuf>,
    /// Admit client certificates with this subject CN (repeatable). Exact
    /// match. The flag takes its value whole, commas included; only the
    /// variable is a comma-separated list.
    #[arg(long = "allow-cn", value_name = "NAME", env = "NBDGW_ALLOW_CN")]
    allow_cn: Vec<String>,
    /// Admit client certificates with this DNS SAN; a `*` label matches
    /// one label (repeatable; comma-separated in the variable).
    #[arg(long = "allow-dns", value_name = "NAME", env = "NBDGW_ALLOW_DNS")]
    allow_dns: Vec<String>,
    /// Admit client certificates with this URI SAN, e.g. a SPIFFE ID; a `*`
    /// segment matches one path segment (repeatable; comma-separated in
    /// the variable).
    #[arg(long = "allow-uri", value_name = "URI", env = "NBDGW_ALLOW_URI")]
    allow_uri: Vec<String>,
    /// Admit clients whose CRL is past its nextUpdate. Without it such a
    /// client is refused until a fresh CRL is in place.
    #[arg(long, env = "NBDGW_TLS_CRL_ALLOW_EXPIRED")]
    tls_crl_allow_expired: bool,
    /// End established sessions whose client certificate a reloaded CRL
    /// revokes (true or false).
    #[arg(long, env = "NBDGW_TLS_REVOKE_CLOSES", default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    tls_revoke_closes: bool,
    /// Oldest TLS version accepted.
    #[arg(long, env = "NBDGW_TLS_MIN_VERSION", value_enum, default_value = "1.2")]
    tls_min_version: MinVersion,
    /// Seconds between looks at the TLS files for changes; 0 reloads only
    /// on SIGHUP.
    #[arg(long, env = "NBDGW_TLS_RELOAD_INTERVAL", default_value_t = 5)]
    tls_reload_interval: u64,
    /// Unix socket of the NBD server to relay to.
    #[arg(long, env = "NBDGW_UPSTREAM")]
    upstream: Option<PathBuf>,
    /// SO_SNDBUF for upstream sockets in bytes; 0 keeps the kernel default.
    #[arg(long, env = "NBDGW_UPSTREAM_SNDBUF", default_value_t = config::DEFAULT_UPSTREAM_SNDBUF)]
    upstream_sndbuf: usize,
    /// Most client connections served at once; more are closed at accept.
    #[arg(long, env = "NBDGW_MAX_CONNECTIONS", default_value_t = config::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// Connections still negotiating (before their client certificate is
    /// verified) served at once, apart from --max-connections; more wait
    /// briefly in a short queue, then are closed.
    #[arg(long, env = "NBDGW_MAX_HANDSHAKES", default_value_t = config::DEFAULT_MAX_HANDSHAKES)]
    max_handshakes: usize,
    /// Of those, how many one source address may hold.
    #[arg(long, env = "NBDGW_MAX_HANDSHAKES_PER_SOURCE", default_value_t = config::DEFAULT_MAX_HANDSHAKES_PER_SOURCE)]
    max_handshakes_per_source: usize,
    /// Seconds a client has from connecting to finishing negotiation.
    #[arg(long, env = "NBDGW_HANDSHAKE_TIMEOUT", default_value_t = config::DEFAULT_HANDSHAKE_TIMEOUT_SECS)]
    handshake_timeout: u64,
    /// Seconds a connection may sit with no request in flight and no reply
    /// being written, counted from the last reply's last byte; 0 never
    /// closes it (VM disks can be idle for hours).
    #[arg(long, env = "NBDGW_IDLE_TIMEOUT", default_value_t = 0)]
    idle_timeout: u64,
    /// Seconds a started request payload, or a reply the client does not
    /// read, may make no progress before the connection is closed; also
    /// the TCP_USER_TIMEOUT for unacknowledged data. 0: never.
    #[arg(long, env = "NBDGW_STALL_TIMEOUT", default_value_t = config::DEFAULT_STALL_TIMEOUT_SECS)]
    stall_timeout: u64,
    /// Seconds of silence before TCP keepalive probes a client; 0 turns
    /// keepalive off. A client that powered off is closed after about
    /// IDLE + INTERVAL x COUNT seconds.
    #[arg(long, env = "NBDGW_TCP_KEEPALIVE", value_name = "IDLE", default_value_t = config::DEFAULT_KEEPALIVE_IDLE_SECS)]
    tcp_keepalive: u64,
    /// Seconds between keepalive probes.
    #[arg(long, env = "NBDGW_TCP_KEEPALIVE_INTERVAL", default_value_t = config::DEFAULT_KEEPALIVE_INTERVAL_SECS)]
    tcp_keepalive_interval: u64,
    /// Unanswered keepalive probes before the connection is dropped.
    #[arg(long, env = "NBDGW_TCP_KEEPALIVE_COUNT", default_value_t = config::DEFAULT_KEEPALIVE_COUNT)]
    tcp_keepalive_count: u32,
    /// Largest request payload and read length in bytes.
    #[arg(long, env = "NBDGW_MAX_PAYLOAD", default_value_t = nbdgw::proto::consts::DEFAULT_MAX_PAYLOAD)]
    max_payload: u32,
    /// Largest option data (and option reply) in bytes.
    #[arg(long, env = "NBDGW_MAX_OPTION_LEN", default_value_t = config::DEFAULT_MAX_OPTION_LEN)]
    max_option_len: u32,
    /// Plain-HTTP admin endpoints (/healthz, /readyz, /metrics) on this
    /// address, meant for localhost or the pod network; off by default.
    #[arg(long, env = "NBDGW_ADMIN_LISTEN", value_name = "HOST:PORT")]
    admin_listen: Option<SocketAddr>,
    /// Seconds to go on accepting after SIGTERM, not ready, so that load
    /// balancers stop sending clients first (5 s suits Kubernetes).
    #[arg(long, env = "NBDGW_DRAIN_DELAY", default_value_t = 0)]
    drain_delay: u64,
    /// Seconds open connections may finish after SIGTERM or SIGINT.
    #[arg(long, env = "NBDGW_SHUTDOWN_GRACE", default_value_t = config::DEFAULT_SHUTDOWN_GRACE_SECS)]
    shutdown_grace: u64,
    /// TCP_CORK around replies: deferred (held while the next reply is
    /// already waiting), per-reply (as QEMU), or off. For measuring; the
    /// default gives full segments.
    #[arg(long, env = "NBDGW_CORK", value_enum, default_value_t = Cork::Deferred)]
    cork: Cork,
    /// Worker threads; 0 means one per CPU. In a container, match the CPU
    /// limit.
    #[arg(long, env = "NBDGW_THREADS", default_value_t = 0)]
    threads: usize,
    /// Log format; the filter comes from RUST_LOG (default info).
    #[arg(long, env = "NBDGW_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Args, Debug)]
struct CertsArgs {
    /// Directory to write into (created if missing).
    #[arg(long, env = "NBDGW_CERTS_OUT")]
    out: PathBuf,
    /// DNS name or IP address for the server certificate (repeatable;
    /// default localhost and 127.0.0.1).
    #[arg(long = "server-name")]
    server_names: Vec<String>,
    /// Common name of a client certificate (repeatable; default
    /// nbdgw-client). The first is client-cert.pem, others client-NAME-cert.pem.
    #[arg(long = "client-name")]
    client_names: Vec<String>,
    /// URI SAN for a client certificate, e.g. a SPIFFE ID (repeatable: the
    /// Nth goes into the Nth client certificate).
    #[arg(long = "client-uri")]
    client_uris: Vec<String>,
    /// Validity of the leaf certificates in days.
    #[arg(long, default_value_t = 365)]
    days: u32,
    /// Overwrite existing files.
    #[arg(long)]
    force: bool,
    /// Issue from this existing CA certificate instead of making a new CA
    /// (with --ca-key), e.g. one kept with --keep-ca-key.
    #[arg(long, requires = "ca_key", value_name = "FILE")]
    ca_cert: Option<PathBuf>,
    /// The key of --ca-cert.
    #[arg(long, requires = "ca_cert", value_name = "FILE")]
    ca_key: Option<PathBuf>,
    /// Keep the new CA's key as ca-key.pem (mode 0600), to issue more
    /// certificates from it later; without it the key is thrown away.
    #[arg(long, conflicts_with = "ca_cert")]
    keep_ca_key: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum LogFormat {
    Text,
    Json,
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    split_lists_from_the_environment(&mut cli.serve, &matches);
    let result = match cli.command {
        Some(Command::Certs(args)) => certs(args),
        None => serve(cli.serve),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nbdgw: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Names may hold commas (`CN=ACME, Backup`), so a flag's value is taken
/// whole; a variable can hold only one value, so it is a comma-separated
/// list.
fn split_lists_from_the_environment(args: &mut ServeArgs, matches: &ArgMatches) {
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

fn certs(args: CertsArgs) -> Result<()> {
    let request = nbdgw::certs::CertsRequest {
        out: args.out,
        server_names: if args.server_names.is_empty() {
            nbdgw::certs::DEFAULT_SERVER_NAMES
                .map(String::from)
                .to_vec()
        } else {
            args.server_names
        },
        client_names: if args.client_names.is_empty() {
            vec![nbdgw::certs::DEFAULT_CLIENT_NAME.to_string()]
        } else {
            args.client_names
        },
        client_uris: args.client_uris,
        days: args.days,
        force: args.force,
        ca: args.ca_cert.zip(args.ca_key),
        keep_ca_key: args.keep_ca_key,
    };
    for path in nbdgw::certs::generate(&request)? {
        println!("{}", path.display());
    }
    Ok(())
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn serve(args: ServeArgs) -> Result<()> {
    init_logging(args.log_format);
    let Some(upstream) = args.upstream.clone() else {
        bail!("--upstream is required (or NBDGW_UPSTREAM); see --help");
    };
    check_limits(&args)?;
    let reloader = tls_reloader(&args)?;
    let reload_interval = seconds_or_off(args.tls_reload_interval);
    let config = gateway_config(&args, upstream, reloader.store());

    report_fd_limit(args.max_connections + args.max_handshakes);
    report_sndbuf(args.upstream_sndbuf, &config.metrics);
    if !nbdgw::upstream::looks_like_socket(&config.upstream) {
        warn!(upstream = %config.upstream.display(), "upstream socket does not exist yet; clients will get an error until it does");
    }

    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if args.threads > 0 {
        runtime.worker_threads(args.threads);
    }
    let runtime = runtime
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        tokio::spawn(reloader.watch(reload_interval));
        if let Some(admin) = args.admin_listen {
            let listener = TcpListener::bind(admin)
                .await
                .with_context(|| format!("cannot listen on {admin} (--admin-listen)"))?;
            info!(admin = %listener.local_addr().unwrap_or(admin), "admin endpoints: /healthz /readyz /metrics");
            let (metrics, health) = (config.metrics.clone(), config.health.clone());
            tokio::spawn(nbdgw::admin::watch_upstream(config.upstream.clone(), health.clone()));
            tokio::spawn(nbdgw::admin::serve(listener, metrics, health));
        }
        let listener = TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        info!(
            listen = %listener.local_addr().unwrap_or(args.listen),
            upstream = %config.upstream.display(),
            cork = ?config.cork,
            "nbdgw listening"
        );
        nbdgw::run(listener, Arc::new(config), shutdown_signals()).await?;
        Ok(())
    })
}

fn check_limits(args: &ServeArgs) -> Result<()> {
    if args.tls_cert.is_none() && args.tls_dir.is_none() {
        bail!("a server certificate is required: --tls-cert and --tls-key, or --tls-dir (or NBDGW_TLS_CERT, NBDGW_TLS_KEY, NBDGW_TLS_DIR); see --help");
    }
    if args.max_connections == 0
        || args.max_handshakes == 0
        || args.max_handshakes_per_source == 0
        || args.max_payload == 0
        || args.handshake_timeout == 0
    {
        bail!("--max-connections, --max-handshakes, --max-handshakes-per-source, --max-payload and --handshake-timeout must be greater than 0");
    }
    if args.tcp_keepalive > 0 && (args.tcp_keepalive_interval == 0 || args.tcp_keepalive_count == 0)
    {
        bail!("--tcp-keepalive-interval and --tcp-keepalive-count must be greater than 0 while keepalive is on");
    }
    Ok(())
}

/// The first load of the TLS files, whose failure stops start-up.
fn tls_reloader(args: &ServeArgs) -> Result<Reloader> {
    let sources = TlsSources {
        dir: args.tls_dir.clone(),
        cert: args.tls_cert.clone(),
        key: args.tls_key.clone(),
        client_ca: args.tls_client_ca.clone(),
        crl: args.tls_crl.clone(),
    };
    let policy = TlsPolicy {
        min_version: args.tls_min_version,
        allow: AllowList::new(
            args.allow_cn.clone(),
            args.allow_dns.clone(),
            args.allow_uri.clone(),
        )?,
        crl_allow_expired: args.tls_crl_allow_expired,
        revoke_closes: args.tls_revoke_closes,
    };
    Reloader::start(sources, policy).context("loading the TLS files")
}

fn gateway_config(args: &ServeArgs, upstream: PathBuf, tls: Arc<TlsStore>) -> Config {
    let mut config = Config::new(upstream, tls);
    config.upstream_sndbuf = args.upstream_sndbuf;
    config.max_connections = args.max_connections;
    config.max_handshakes = args.max_handshakes;
    config.max_handshakes_per_source = args.max_handshakes_per_source;
    config.handshake_timeout = Duration::from_secs(args.handshake_timeout);
    config.idle_timeout = seconds_or_off(args.idle_timeout);
    config.stall_timeout = seconds_or_off(args.stall_timeout);
    config.keepalive = seconds_or_off(args.tcp_keepalive).map(|idle| Keepalive {
        idle,
        interval: Duration::from_secs(args.tcp_keepalive_interval),
        count: args.tcp_keepalive_count,
    });
    config.max_payload = args.max_payload;
    config.max_option_len = args.max_option_len;
    config.shutdown_grace = Duration::from_secs(args.shutdown_grace);
    config.drain_delay = Duration::from_secs(args.drain_delay);
    config.cork = args.cork;
    config
}

fn seconds_or_off(secs: u64) -> Option<Duration> {
    (secs > 0).then(|| Duration::from_secs(secs))
}

/// Raises the descriptor limit and warns when it still cannot hold
/// `--max-connections` (3 descriptors each).
fn report_fd_limit(max_connections: usize) {
    use nbdgw::limits::{fds_needed, raise_fd_limit};
    match raise_fd_limit() {
        Ok(limit) if !limit.fits(max_connections) => warn!(
            limit = limit.now,
            needed = fds_needed(max_connections),
            max_connections,
            "the file descriptor limit (RLIMIT_NOFILE, e.g. LimitNOFILE= in systemd) is too low for --max-connections; connections beyond it will fail at accept"
        ),
        Ok(limit) if limit.before != limit.now => {
            info!(from = limit.before, to = limit.now, "raised the file descriptor limit")
        }
        Ok(_) => {}
        Err(e) => warn!(error = %e, "cannot raise the file descriptor limit"),
    }
}

/// Logs the upstream send buffer the kernel grants, and warns once when
/// `net.core.wmem_max` clipped it.
fn report_sndbuf(requested: usize, metrics: &nbdgw::metrics::Metrics) {
    let report = nbdgw::upstream::probe_sndbuf(requested);
    if let Ok(report) = &report {
        metrics
            .upstream_sndbuf
            .set(i64::try_from(report.effective).unwrap_or(i64::MAX));
    }
    match report {
        Ok(report) if report.clipped() => warn!(
            requested,
            effective = report.effective,
            "upstream SO_SNDBUF clipped by the kernel: raise net.core.wmem_max (sysctl -w net.core.wmem_max={}) for full speed",
            requested
        ),
        Ok(report) => info!(requested, effective = report.effective, "upstream SO_SNDBUF"),
        Err(e) => warn!(error = %e, "cannot probe the upstream socket send buffer"),
    }
}

/// Resolves at the first SIGTERM or SIGINT, which starts a graceful
/// shutdown; a second one ends the process at once, as operators expect
/// of a daemon that is taking too long.
async fn shutdown_signals() {
    let mut signals = match Signals::new() {
        Ok(s) => s,
        Err(e) => {
            warn!(error = %e, "cannot watch SIGTERM; only Ctrl-C stops nbdgw");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    signals.next().await;
    tokio::spawn(async move {
        let name = signals.next().await;
        warn!("second {name}: exiting at once, open connections are cut");
        std::process::exit(1);
    });
}

struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    async fn next(&mut self) -> &'static str {
        let name = tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        };
        info!("{name} received");
        name
    }
}
