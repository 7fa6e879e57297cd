//! The nbdgw command: flags and environment, logging, signals, start-up.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::net::TcpListener;
use tracing::{info, warn};

use nbdgw::cli::{CertsArgs, Command, LogFormat, ServeArgs};
use nbdgw::config::{Config, Keepalive};
use nbdgw::listeners::Listeners;
use nbdgw::sandbox::Enforcement;
use sd_notify::NotifyState;

/// glibc's malloc keeps what a burst of connections freed (a 64-client
/// soak left RSS at its peak, 66 MiB against 13 idle); jemalloc, with its
/// background thread, gives freed pages back within seconds.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
use nbdgw::tls::{AllowList, Reloader, TlsPolicy, TlsSources, TlsStore};

fn main() -> ExitCode {
    let cli = nbdgw::cli::parse();
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
    let (reloader, policy, config) = configure(&args)?;
    let reload_interval = seconds_or_off(args.tls_reload_interval);

    report_fd_limit(args.max_connections + args.max_handshakes);
    report_sndbuf(args.upstream_sndbuf, &config.metrics);
    if config.exports.is_none() && !nbdgw::upstream::looks_like_socket(&config.upstream) {
        warn!(upstream = %config.upstream.display(), "upstream socket does not exist yet; clients will get an error until it does");
    }
    let listeners = Listeners::open(args.listen, args.admin_listen)?;
    // Counted before the sandbox hides /sys and /proc from the runtime.
    let threads = match args.threads {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    };
    if args.landlock {
        sandbox(&args, &reloader, policy.as_ref(), &config);
    } else {
        info!("--landlock false: the process is not sandboxed");
    }

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        tokio::spawn(reloader.watch(reload_interval));
        if let Some(policy) = policy {
            tokio::spawn(policy.watch(reload_interval));
        }
        debug_probe::after_start();
        if let Some(admin) = listeners.admin {
            start_admin(async_listener(admin)?, &config);
        }
        let listener = async_listener(listeners.nbd)?;
        info!(
            listen = %display_addr(&listener),
            from_systemd = listeners.from_systemd,
            upstream = %config.upstream.display(),
            exports = config.exports.is_some(),
            cork = ?config.cork,
            "nbdgw listening"
        );
        notify(&[NotifyState::Ready]);
        nbdgw::run(listener, Arc::new(config), async {
            shutdown_signals().await;
            notify(&[NotifyState::Stopping]);
        })
        .await?;
        Ok(())
    })
}

/// Everything decided before any socket is touched: the files read (TLS,
/// policy) and the exports.
fn configure(
    args: &ServeArgs,
) -> Result<(Reloader, Option<nbdgw::policy::PolicyReloader>, Config)> {
    let exports = export_table(args)?;
    let upstream = match (&args.upstream, &exports) {
        (Some(upstream), _) => upstream.clone(),
        (None, Some(_)) => PathBuf::new(),
        (None, None) => bail!("--upstream, --export or --export-dir is required (or NBDGW_UPSTREAM, NBDGW_EXPORT, NBDGW_EXPORT_DIR); see --help"),
    };
    check_limits(args)?;
    // Probed before the sandbox, which forbids the loopback connection.
    let (kernel_tls, kernel_tls_no_rekey) = nbdgw::tls::kernel::decide(args.ktls);
    let reloader = tls_reloader(args, kernel_tls.is_some())?;
    let mut policy = policy_reloader(args, &reloader)?;
    let mut config = gateway_config(args, upstream, reloader.store());
    config.exports = exports.map(Arc::new);
    config.kernel_tls = kernel_tls;
    config.kernel_tls_no_rekey = kernel_tls_no_rekey;
    config.ktls_key_limit = args.ktls_key_limit;
    if let Some(policy) = &mut policy {
        config.policy = policy.store();
        let m = &config.metrics;
        policy.count_into(m.policy_reloads.clone(), m.policy_reload_failures.clone());
    }
    Ok((reloader, policy, config))
}

fn start_admin(listener: TcpListener, config: &Config) {
    info!(admin = %display_addr(&listener), "admin endpoints: /healthz /readyz /metrics");
    let (metrics, health) = (config.metrics.clone(), config.health.clone());
    // With named exports each has its own server; one being down does
    // not make the gateway unready.
    if config.exports.is_none() {
        let upstream = config.upstream.clone();
        tokio::spawn(nbdgw::admin::watch_upstream(upstream, health.clone()));
    }
    tokio::spawn(nbdgw::admin::serve(listener, metrics, health));
}

fn async_listener(listener: std::net::TcpListener) -> Result<TcpListener> {
    listener
        .set_nonblocking(true)
        .context("setting the listening socket non-blocking")?;
    TcpListener::from_std(listener).context("registering the listening socket")
}

fn display_addr(listener: &TcpListener) -> String {
    listener
        .local_addr()
        .map_or_else(|e| format!("(unknown: {e})"), |addr| addr.to_string())
}

/// Tells systemd (Type=notify) where start-up and shutdown are; a no-op
/// without NOTIFY_SOCKET.
fn notify(state: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(state) {
        warn!(error = %e, "cannot notify systemd (NOTIFY_SOCKET)");
    }
}

/// Best effort: a kernel without Landlock logs once and serves anyway.
/// Readable: the files (and directories) read after start; connectable:
/// the Unix sockets (or their directory) connected to.
fn sandbox(
    args: &ServeArgs,
    tls: &Reloader,
    policy: Option<&nbdgw::policy::PolicyReloader>,
    config: &Config,
) {
    let readable: Vec<&Path> = tls
        .paths()
        .files()
        .chain(args.tls_dir.as_deref())
        .chain(policy.map(|p| p.path()))
        .chain(config.exports.as_ref().and_then(|e| e.dir()))
        .collect();
    let sockets: Vec<&Path> = match &config.exports {
        Some(table) => table.socket_paths().collect(),
        None => vec![config.upstream.as_path()],
    };
    let readable = nbdgw::sandbox::dirs_covering(readable.iter().copied());
    // systemd's notification socket, when it is a path (not abstract).
    let notify = std::env::var_os("NOTIFY_SOCKET")
        .map(PathBuf::from)
        .filter(|path| path.is_absolute());
    let connectable =
        nbdgw::sandbox::dirs_covering(sockets.iter().copied().chain(notify.as_deref()));
    let shown = |dirs: &[PathBuf]| -> Vec<String> {
        dirs.iter().map(|d| d.display().to_string()).collect()
    };
    match nbdgw::sandbox::restrict(&readable, &connectable) {
        Ok(Enforcement::None) => {
            warn!("landlock is not available in this kernel: the process is not sandboxed")
        }
        Ok(enforcement) => info!(
            enforcement = enforcement.as_str(),
            readable = ?shown(&readable),
            unix_connect = ?shown(&connectable),
            "landlock: the process may read only beneath these directories, connect only to Unix sockets beneath those, and neither bind nor connect TCP"
        ),
        Err(e) => warn!(error = %e, "landlock: cannot restrict the process; it is not sandboxed"),
    }
}

/// A hook for the sandbox's test, compiled into debug builds only: after
/// start, a runtime thread tries to open NBDGW_DEBUG_OPEN and logs what
/// happened.
mod debug_probe {
    #[cfg(debug_assertions)]
    pub fn after_start() {
        if let Some(path) = std::env::var_os("NBDGW_DEBUG_OPEN") {
            tokio::spawn(async move {
                let path = std::path::PathBuf::from(path);
                match std::fs::File::open(&path) {
                    Ok(_) => tracing::info!(path = %path.display(), "debug probe: opened"),
                    Err(e) => {
                        tracing::info!(path = %path.display(), error = %e, "debug probe: cannot open")
                    }
                }
            });
        }
    }

    #[cfg(not(debug_assertions))]
    pub fn after_start() {}
}

fn export_table(args: &ServeArgs) -> Result<Option<nbdgw::exports::ExportTable>> {
    // An owner check that checks nothing must not look like one.
    if args.export_dir.is_none() && args.export_dir_owner != nbdgw::exports::OwnerCheck::Any {
        bail!("--export-dir-owner (NBDGW_EXPORT_DIR_OWNER) needs --export-dir: it checks only the sockets found there");
    }
    if args.exports.is_empty() && args.export_dir.is_none() {
        return Ok(None);
    }
    if let Some(dir) = &args.export_dir {
        if !dir.is_dir() {
            bail!("--export-dir {}: not a directory", dir.display());
        }
    }
    let table = nbdgw::exports::ExportTable::new(args.exports.clone(), args.export_dir.clone())?
        .with_owner_check(args.export_dir_owner);
    info!(exports = ?table.names(), dir = ?args.export_dir, owner = %args.export_dir_owner, "exports routed by name");
    Ok(Some(table))
}

/// The policy file's first read, which must succeed; it only means
/// something when clients are identified by certificates.
fn policy_reloader(
    args: &ServeArgs,
    tls: &Reloader,
) -> Result<Option<nbdgw::policy::PolicyReloader>> {
    let Some(path) = &args.policy else {
        return Ok(None);
    };
    if !tls.requires_client_certificates() {
        bail!("--policy needs client certificates: give a client CA (--tls-client-ca, or ca-cert.pem / ca.crt in --tls-dir)");
    }
    let policy = nbdgw::policy::PolicyReloader::start(path.clone())
        .context("loading the access policy (--policy)")?;
    Ok(Some(policy))
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
        || args.upstream_timeout == 0
    {
        bail!("--max-connections, --max-handshakes, --max-handshakes-per-source, --max-payload, --handshake-timeout and --upstream-timeout must be greater than 0");
    }
    if args.tcp_keepalive > 0 && (args.tcp_keepalive_interval == 0 || args.tcp_keepalive_count == 0)
    {
        bail!("--tcp-keepalive-interval and --tcp-keepalive-count must be greater than 0 while keepalive is on");
    }
    Ok(())
}

/// The first load of the TLS files, whose failure stops start-up.
fn tls_reloader(args: &ServeArgs, secret_extraction: bool) -> Result<Reloader> {
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
        secret_extraction,
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
    config.upstream_timeout = Duration::from_secs(args.upstream_timeout);
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
