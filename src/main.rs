//! The nbdgw command: flags and environment, logging, signals, start-up.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::net::TcpListener;
use tracing::{info, warn};

use nbdgw::cli::{CertsArgs, ClientArgs, Command, LogFormat, PolicyCommand, ServeArgs};
use nbdgw::config::{Config, Keepalive};
use nbdgw::listeners::Listeners;
use nbdgw::sandbox::{Enforcement, LandlockMode, SocketRule};
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
        Some(Command::Policy(args)) => return policy(args.command),
        Some(Command::Client(args)) => client(args),
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

/// `nbdgw policy check|explain`; the work is in `nbdgw::policy::tool`.
fn policy(command: PolicyCommand) -> ExitCode {
    use nbdgw::policy::tool;
    match command {
        PolicyCommand::Check { file } => match tool::check(&file) {
            Ok(checked) => {
                for warning in &checked.warnings {
                    eprintln!("nbdgw: warning: {warning}");
                }
                println!("{}: valid, {} rule(s)", file.display(), checked.rules);
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("nbdgw: {e}");
                ExitCode::FAILURE
            }
        },
        PolicyCommand::Explain {
            policy,
            cert,
            export,
        } => match tool::explain(&policy, &cert, &export) {
            Ok(explanation) => {
                print!("{explanation}");
                ExitCode::from(if explanation.granted() { 0 } else { 1 })
            }
            Err(e) => {
                eprintln!("nbdgw: {e}");
                ExitCode::from(2)
            }
        },
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

/// `nbdgw client`: the files read and the settings fixed before any
/// socket is touched, then the local listener served.
fn client(args: ClientArgs) -> Result<()> {
    use nbdgw::client::{self, LocalListener};
    init_logging(args.log_format);
    let (host, port) = client::parse_server(&args.server)?;
    let server_name = client::server_name(args.server_name.as_deref().unwrap_or(&host))?;
    let (paths, reloader) = client_tls(&args, &server_name)?;
    let settings = client_settings(&args, (host, port, server_name), reloader.store())?;
    let admin = args
        .admin_listen
        .map(|addr| {
            std::net::TcpListener::bind(addr).with_context(|| format!("--admin-listen {addr}"))
        })
        .transpose()?;
    let runtime = runtime(worker_threads(args.threads))?;
    runtime.block_on(async move {
        let listener = LocalListener::bind(&args.listen)?;
        tokio::spawn(reloader.watch(seconds_or_off(args.tls_reload_interval)));
        if let Some(admin) = admin {
            let admin = async_listener(admin)?;
            info!(admin = %display_addr(&admin), "admin endpoints: /healthz /readyz /server /metrics");
            let limits = nbdgw::admin::AdminLimits::default();
            let (metrics, health) = (settings.metrics.clone(), settings.health.clone());
            tokio::spawn(nbdgw::admin::serve(admin, metrics, health, limits));
        }
        client::log_start(
            &listener,
            &settings,
            paths.layout.unwrap_or("files"),
            &args.tls_groups,
        );
        notify(&[NotifyState::Ready]);
        let drain_answer = args.drain_answer;
        client::run(listener, Arc::new(settings), (stopping(), drain_answer)).await?;
        Ok(())
    })
}

/// Client mode's settings from its flags; `server` is the server's host,
/// port and the name its certificate must carry.
fn client_settings(
    args: &ClientArgs,
    (host, port, server_name): (String, u16, rustls::pki_types::ServerName<'static>),
    tls: Arc<nbdgw::reload::Swap<rustls::ClientConfig>>,
) -> Result<nbdgw::client::ClientSettings> {
    use nbdgw::client::{self, ClientSettings};
    let keepalive = (args.tcp_keepalive > 0).then(|| Keepalive {
        idle: Duration::from_secs(args.tcp_keepalive),
        ..Keepalive::default()
    });
    if args.server_timeout >= args.handshake_timeout {
        warn!(
            server_timeout = args.server_timeout,
            handshake_timeout = args.handshake_timeout,
            "--server-timeout is not below --handshake-timeout: a local client waiting on a slow server is cut before it hears why"
        );
    }
    let mut max_connections = args.max_connections;
    fit_client_fd_limit(&mut max_connections, args.admin_listen.is_some())?;
    Ok(ClientSettings {
        server: args.server.clone(),
        host,
        port,
        server_name,
        tls,
        server_timeout: Duration::from_secs(args.server_timeout),
        handshake_timeout: Duration::from_secs(args.handshake_timeout),
        idle_timeout: seconds_or_off(args.idle_timeout),
        stall_timeout: seconds_or_off(args.stall_timeout),
        keepalive,
        max_payload: args.max_payload,
        max_option_len: args.max_option_len,
        max_connections,
        cork: nbdgw::config::Cork::Deferred,
        shutdown_grace: Duration::from_secs(args.shutdown_grace),
        reconnect: args.reconnect.then(|| client::Reconnect {
            timeout: Duration::from_secs(args.reconnect_timeout),
            replay_buffer: args.replay_buffer,
            reply_buffer: args.reply_buffer,
        }),
        metrics: Arc::new(nbdgw::metrics::Metrics::client_mode()),
        health: Arc::default(),
    })
}

/// Client mode's first load of its TLS files, whose failure stops the
/// start; the groups are checked first, so that their error is not
/// reported as one of the files'.
fn client_tls(
    args: &ClientArgs,
    server_name: &rustls::pki_types::ServerName<'static>,
) -> Result<(
    nbdgw::tls::client::ClientTlsPaths,
    nbdgw::tls::client::ClientReloader,
)> {
    use nbdgw::tls::client::{ClientReloader, ClientTlsPolicy, ClientTlsSources};
    check_groups(&args.tls_groups, args.tls_min_version)?;
    let sources = ClientTlsSources {
        dir: args.tls_dir.clone(),
        ca: args.tls_ca.clone(),
        cert: args.tls_cert.clone(),
        key: args.tls_key.clone(),
    };
    let paths = sources.resolve().context("client TLS files")?;
    let policy = ClientTlsPolicy {
        min_version: args.tls_min_version,
        groups: args.tls_groups.clone(),
    };
    let (reloader, loaded) =
        ClientReloader::start(paths.clone(), policy).context("client TLS files")?;
    let identity = loaded
        .identity
        .as_ref()
        .map_or_else(|| "none".to_string(), |i| i.to_string());
    info!(
        layout = paths.layout.unwrap_or("files"),
        ca = %paths.ca.display(),
        cas = loaded.cas,
        crls = loaded.crls,
        client_certificate = %identity,
        server_name = ?server_name,
        "client TLS loaded"
    );
    Ok((paths, reloader))
}

/// `--tls-groups`, either mode: a list with no group TLS 1.2 can use
/// while TLS 1.2 is allowed stops the start; a pure ML-KEM list is
/// taken, with a warning.
fn check_groups(groups: &nbdgw::tls::KxGroups, min_version: nbdgw::tls::MinVersion) -> Result<()> {
    nbdgw::tls::check_groups(groups, min_version)?;
    if let Some(warning) = groups.pure_mlkem_warning() {
        warn!("{warning}");
    }
    Ok(())
}

/// `--threads`: 0 is one per CPU.
fn worker_threads(threads: usize) -> usize {
    match threads {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    }
}

fn runtime(threads: usize) -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Resolves at SIGTERM or SIGINT, once systemd has been told.
async fn stopping() {
    shutdown_signals().await;
    notify(&[NotifyState::Stopping]);
}

/// rustls's own warnings are about what a peer sent and let pass (libnbd
/// names an IP address in SNI, on every connection to one: "Illegal SNI
/// extension"), a line per connection any peer can cause; a refusal is
/// logged by nbdgw with its reason.
const DEFAULT_LOG_FILTER: &str = "info,rustls=error";

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER));
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
    let (reloader, policy, mut config) = configure(&args)?;
    let reload_interval = seconds_or_off(args.tls_reload_interval);
    let mut admin_limits = admin_limits(&args);
    fit_fd_limit(
        &mut config,
        &mut admin_limits,
        &args,
        reloader.requires_client_certificates(),
    )?;
    report_sndbuf(args.upstream_sndbuf, &config.metrics);
    if config.exports.is_none() && !nbdgw::upstream::looks_like_socket(&config.upstream) {
        warn!(upstream = %config.upstream.display(), "upstream socket does not exist yet; clients will get an error until it does");
    }
    let listeners = Listeners::open(args.listen, args.admin_listen)?;
    // Counted before the sandbox hides /sys and /proc from the runtime.
    let threads = worker_threads(args.threads);
    match args.landlock {
        LandlockMode::Off => info!("--landlock false: the process is not sandboxed"),
        mode => sandbox(mode, &reloader, policy.as_ref(), &config, &args)?,
    }

    let runtime = runtime(threads)?;
    runtime.block_on(async move {
        tokio::spawn(reloader.watch(reload_interval));
        if let Some(policy) = policy {
            tokio::spawn(policy.watch(reload_interval));
        }
        debug_probe::after_start();
        if let Some(admin) = listeners.admin {
            start_admin(async_listener(admin)?, &config, admin_limits);
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
        // The accept loop runs on a worker, not on this thread (which
        // only waits): each accepted connection's task then starts on the
        // worker that accepted it, instead of one thread waking another
        // for every connection (bench/RESULTS.md, handshake CPU).
        tokio::spawn(nbdgw::run(listener, Arc::new(config), stopping()))
            .await
            .context("the accept loop")??;
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
    let source_prefixes = check_limits(args)?;
    // Probed before the sandbox, which forbids the loopback connection.
    let (kernel_tls, kernel_tls_no_rekey) = nbdgw::tls::kernel::decide(args.ktls);
    let reloader = tls_reloader(args, kernel_tls.is_some())?;
    let mut policy = policy_reloader(args, &reloader)?;
    let mut config = gateway_config(args, upstream, reloader.store());
    config.source_prefixes = source_prefixes;
    config.proxy_protocol = nbdgw::proxy::Trusted {
        from: args.proxy_protocol_from.clone(),
        max_header: args.proxy_protocol_max_header,
    };
    // Only a client certificate the policy honours proves a source; with
    // no client CA nothing can, and a reserve would only idle.
    if !reloader.requires_client_certificates() && args.source_memory > 0 {
        info!("no client CA: no source can prove itself, so --source-memory and --handshake-reserve are off");
        config.source_memory = Duration::ZERO;
    }
    config.handshake_reserve = handshake_reserve(
        args,
        args.max_handshakes,
        reloader.requires_client_certificates(),
    );
    config.max_sessions_per_identity = args.max_sessions_per_identity.unwrap_or_else(|| {
        nbdgw::config::default_sessions_per_identity(
            args.max_connections,
            reloader.requires_client_certificates(),
        )
    });
    config.exports = exports.map(Arc::new);
    config.kernel_tls = kernel_tls;
    config.kernel_tls_no_rekey = kernel_tls_no_rekey;
    config.ktls_key_limit = args.ktls_key_limit;
    read_cache(args, &mut config)?;
    if let Some(policy) = &mut policy {
        config.policy = policy.store();
        let m = &config.metrics;
        policy.count_into(m.policy_reloads.clone(), m.policy_reload_failures.clone());
        policy.count_changes_into(m.policy_changes.clone());
        if args.policy_revoke_closes {
            policy.close_narrowed_in(config.tls.sessions().clone());
        }
    }
    Ok((reloader, policy, config))
}

fn admin_limits(args: &ServeArgs) -> nbdgw::admin::AdminLimits {
    nbdgw::admin::AdminLimits {
        max_connections: args.admin_max_connections,
        header_timeout: Duration::from_secs(args.admin_header_timeout),
        keepalive_requests: args.admin_keepalive_requests,
        keepalive_timeout: Duration::from_secs(args.admin_keepalive_timeout),
        max_header_bytes: args.admin_max_header_bytes as usize,
    }
}

fn start_admin(listener: TcpListener, config: &Config, limits: nbdgw::admin::AdminLimits) {
    info!(admin = %display_addr(&listener), "admin endpoints: /healthz /readyz /metrics");
    let (metrics, health) = (config.metrics.clone(), config.health.clone());
    // With named exports each has its own server; one being down does
    // not make the gateway unready.
    if config.exports.is_none() {
        let upstream = config.upstream.clone();
        tokio::spawn(nbdgw::admin::watch_upstream(upstream, health.clone()));
    }
    tokio::spawn(nbdgw::admin::serve(listener, metrics, health, limits));
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

/// `--landlock true`: a kernel with less than all of it logs what stays
/// open and serves anyway; `--landlock required` refuses to start then.
/// Readable: the files (and directories) read after start; connectable:
/// each upstream socket (see sandbox::socket_rule), all of --export-dir,
/// and systemd's notification socket.
fn sandbox(
    mode: LandlockMode,
    tls: &Reloader,
    policy: Option<&nbdgw::policy::PolicyReloader>,
    config: &Config,
    args: &ServeArgs,
) -> Result<()> {
    let readable: Vec<&Path> = tls
        .paths()
        .files()
        .chain(args.tls_dir.as_deref())
        .chain(policy.map(|p| p.path()))
        .chain(config.exports.as_ref().and_then(|e| e.dir()))
        .collect();
    let readable = nbdgw::sandbox::dirs_covering(readable.iter().copied());
    let sockets: Vec<&Path> = match &config.exports {
        Some(table) => table.fixed_sockets().collect(),
        None => vec![config.upstream.as_path()],
    };
    // The export directory is read at every lookup, sockets come and go
    // in it and its tenant subdirectories: the whole of it, nothing else.
    let mut connectable =
        nbdgw::sandbox::dirs_covering(config.exports.as_ref().and_then(|e| e.dir()));
    for socket in sockets {
        let rule = nbdgw::sandbox::socket_rule(socket);
        // A rule on the socket file would not survive the upstream's
        // restart (see socket_rule): said, not narrowed.
        if let SocketRule::SharedDirectory(dir) = &rule {
            info!(socket = %socket.display(), dir = %dir.display(), "landlock: connects are allowed to every socket in the upstream socket's directory, which holds more than it; give the socket a directory of its own to narrow that");
        }
        if !connectable.iter().any(|p| p == rule.path()) {
            connectable.push(rule.path().to_path_buf());
        }
    }
    // systemd's notification socket, when it is a path: it stays for the
    // service's life, so the socket itself. (sd-notify sends to a path
    // only, so an abstract @NAME one is never reached, scoped or not.)
    // One that is not there could not be named and would fail the whole
    // ruleset; notify() logs its own errors.
    let notify = std::env::var_os("NOTIFY_SOCKET")
        .map(PathBuf::from)
        .filter(|path| path.is_absolute() && path.symlink_metadata().is_ok());
    if let Some(path) = notify {
        let path = std::fs::canonicalize(&path).unwrap_or(path);
        if !connectable.contains(&path) {
            connectable.push(path);
        }
    }
    let rules = nbdgw::sandbox::Rules {
        readable,
        connectable,
    };
    let shown = |dirs: &[PathBuf]| -> Vec<String> {
        dirs.iter().map(|d| d.display().to_string()).collect()
    };
    let outcome = match nbdgw::sandbox::restrict(&rules) {
        Ok(outcome) => outcome,
        Err(e) if mode == LandlockMode::Required => {
            return Err(nbdgw::sandbox::SandboxError::Restrict(e).into())
        }
        Err(e) => {
            warn!(error = %e, "landlock: cannot restrict the process; it is not sandboxed");
            return Ok(());
        }
    };
    nbdgw::sandbox::decide(mode, &outcome)?;
    match outcome.enforcement {
        Enforcement::None => {
            warn!("landlock is not available in this kernel: the process is not sandboxed (--landlock required refuses to start then)")
        }
        ref enforcement => {
            info!(
                enforcement = enforcement.as_str(),
                abi = outcome.abi,
                readable = ?shown(&rules.readable),
                unix_connect = ?shown(&rules.connectable),
                "landlock: the process may read only beneath these directories, connect only to these Unix sockets (or beneath these directories), neither bind nor connect TCP, nor reach abstract Unix sockets or signal processes outside it"
            );
            // Info, not a warning: every kernel before Linux 7.1 lacks
            // something, and --landlock required is there for those who
            // must not run so.
            let missing = nbdgw::sandbox::missing_at(outcome.abi);
            if !missing.is_empty() {
                info!(abi = outcome.abi, missing = ?missing, "landlock: this kernel leaves these open (--landlock required refuses to start then)");
            }
        }
    }
    Ok(())
}

/// Hooks for the sandbox's tests, compiled into debug builds only: after
/// start, a runtime thread tries to open NBDGW_DEBUG_OPEN, to connect to
/// the Unix socket NBDGW_DEBUG_CONNECT (a path, or `@NAME` for an
/// abstract one) and to signal (signal 0: the permission check alone) the
/// process NBDGW_DEBUG_SIGNAL, and logs what happened.
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
        if let Some(address) = std::env::var_os("NBDGW_DEBUG_CONNECT") {
            tokio::spawn(async move {
                let address = address.to_string_lossy().into_owned();
                match connect(&address) {
                    Ok(_) => tracing::info!(address, "debug probe: connected"),
                    Err(e) => {
                        tracing::info!(address, error = %e, "debug probe: cannot connect")
                    }
                }
            });
        }
        if let Some(pid) = std::env::var_os("NBDGW_DEBUG_SIGNAL") {
            tokio::spawn(async move {
                let pid = pid.to_string_lossy().into_owned();
                let result = pid
                    .parse::<i32>()
                    .ok()
                    .and_then(rustix::process::Pid::from_raw)
                    .ok_or(rustix::io::Errno::INVAL)
                    .and_then(rustix::process::test_kill_process);
                match result {
                    Ok(()) => tracing::info!(pid, "debug probe: signalled"),
                    Err(e) => tracing::info!(pid, error = %e, "debug probe: cannot signal"),
                }
            });
        }
    }

    #[cfg(debug_assertions)]
    fn connect(address: &str) -> std::io::Result<std::os::unix::net::UnixStream> {
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::net::{SocketAddr, UnixStream};
        match address.strip_prefix('@') {
            Some(name) => UnixStream::connect_addr(&SocketAddr::from_abstract_name(name)?),
            None => UnixStream::connect(address),
        }
    }

    #[cfg(not(debug_assertions))]
    pub fn after_start() {}
}

fn export_table(args: &ServeArgs) -> Result<Option<nbdgw::exports::ExportTable>> {
    // An owner check that checks nothing must not look like one. Unset,
    // it is the strict default (same). An explicit `any` (the old
    // default, which checks nothing anyway) is accepted alone, so a
    // deployment that set it everywhere keeps starting.
    let checks = !matches!(
        args.export_dir_owner,
        None | Some(nbdgw::exports::OwnerCheck::Any)
    );
    if args.export_dir.is_none() && checks {
        bail!("--export-dir-owner (NBDGW_EXPORT_DIR_OWNER) needs --export-dir: it checks only the sockets found there");
    }
    let owner = args.export_dir_owner.unwrap_or_default();
    if args.exports.is_empty() && args.export_dir.is_none() {
        return Ok(None);
    }
    if let Some(dir) = &args.export_dir {
        if !dir.is_dir() {
            bail!("--export-dir {}: not a directory", dir.display());
        }
        // Sockets there are connected through the descriptor the checks
        // were made on (/proc/self/fd/N): without /proc every open would
        // fail later as "export unavailable".
        if !std::path::Path::new("/proc/self/fd").is_dir() {
            bail!("--export-dir needs /proc mounted (sockets are connected through /proc/self/fd)");
        }
    }
    let table = nbdgw::exports::ExportTable::new(args.exports.clone(), args.export_dir.clone())?
        .with_owner_check(owner);
    info!(exports = ?table.names(), dir = ?args.export_dir, owner = %owner, "exports routed by name");
    Ok(Some(table))
}

/// The immutable exports, and the read cache they share when it is on.
fn read_cache(args: &ServeArgs, config: &mut Config) -> Result<()> {
    // With named exports, every export immutable would be a blanket the
    // operator should spell out (--immutable-export '*').
    if args.immutable && args.upstream.is_none() {
        bail!(
            "--immutable (NBDGW_IMMUTABLE) needs --upstream; name exports with --immutable-export"
        );
    }
    let immutable = nbdgw::exports::Immutable::new(args.immutable, args.immutable_exports.clone())?;
    if args.read_ahead > args.max_payload {
        bail!("--read-ahead must not exceed --max-payload");
    }
    config.read_ahead = args.read_ahead;
    config.read_ahead_depth = args.read_ahead_depth;
    config.cache_fill_depth = args.cache_fill_depth;
    if immutable.any() && args.cache_size > 0 {
        config.cache = Some(nbdgw::cache::ReadCache::with_block_size(
            args.cache_size,
            args.cache_block_size,
            config.metrics.cache.clone(),
        ));
        info!(
            cache_size = args.cache_size,
            cache_block_size = args.cache_block_size,
            read_ahead = args.read_ahead,
            read_ahead_depth = args.read_ahead_depth,
            cache_fill_depth = args.cache_fill_depth,
            "read cache on for immutable exports"
        );
    }
    config.immutable = Arc::new(immutable);
    Ok(())
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

/// Returns the source prefixes, checked here with the other limits so a
/// length out of range stops start-up, naming its flag, before anything
/// is loaded.
fn check_limits(args: &ServeArgs) -> Result<nbdgw::config::SourcePrefixes> {
    if args.tls_cert.is_none() && args.tls_dir.is_none() {
        bail!("a server certificate is required: --tls-cert and --tls-key, or --tls-dir (or NBDGW_TLS_CERT, NBDGW_TLS_KEY, NBDGW_TLS_DIR); see --help");
    }
    if args.max_connections == 0
        || args.max_sessions_per_identity == Some(0)
        || args.max_handshakes == 0
        || args.max_handshakes_per_source == 0
        || args.max_payload == 0
        || args.handshake_timeout == 0
        || args.upstream_timeout == 0
    {
        bail!("--max-connections, --max-sessions-per-identity, --max-handshakes, --max-handshakes-per-source, --max-payload, --handshake-timeout and --upstream-timeout must be greater than 0");
    }
    if !(nbdgw::proxy::MIN_MAX_HEADER..=nbdgw::proxy::MAX_MAX_HEADER)
        .contains(&args.proxy_protocol_max_header)
    {
        bail!(
            "--proxy-protocol-max-header must be {} to {}: a v2 header of TCP over IPv6 is {} bytes",
            nbdgw::proxy::MIN_MAX_HEADER,
            nbdgw::proxy::MAX_MAX_HEADER,
            nbdgw::proxy::MIN_MAX_HEADER
        );
    }
    if args
        .handshake_reserve
        .is_some_and(|reserve| reserve >= args.max_handshakes)
    {
        bail!("--handshake-reserve must be less than --max-handshakes: unproven sources need at least one slot");
    }
    if args.tcp_keepalive > 0 && (args.tcp_keepalive_interval == 0 || args.tcp_keepalive_count == 0)
    {
        bail!("--tcp-keepalive-interval and --tcp-keepalive-count must be greater than 0 while keepalive is on");
    }
    Ok(nbdgw::config::SourcePrefixes::new(
        args.source_prefix_v4,
        args.source_prefix_v6,
    )?)
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
        verified_chain_cache: args.verified_chain_cache,
        cipher_order: args.tls_cipher_order,
        groups: args.tls_groups.clone(),
    };
    check_groups(&args.tls_groups, args.tls_min_version)?;
    Reloader::start(sources, policy).context("loading the TLS files")
}

fn gateway_config(args: &ServeArgs, upstream: PathBuf, tls: Arc<TlsStore>) -> Config {
    let mut config = Config::new(upstream, tls);
    config.upstream_sndbuf = args.upstream_sndbuf;
    config.policy_revoke_closes = args.policy_revoke_closes;
    config.max_connections = args.max_connections;
    config.max_handshakes = args.max_handshakes;
    config.max_handshakes_per_source = args.max_handshakes_per_source;
    config.handshake_queue = args.handshake_queue;
    config.handshake_queue_per_source = args.handshake_queue_per_source;
    config.handshake_queue_timeout = Duration::from_secs(args.handshake_queue_timeout);
    config.source_memory = Duration::from_secs(args.source_memory);
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
    config.max_refused_options = args.max_refused_options;
    config.shutdown_grace = Duration::from_secs(args.shutdown_grace);
    config.drain_delay = Duration::from_secs(args.drain_delay);
    config.drain_answer = args.drain_answer;
    config.cork = args.cork;
    config.allow_lists =
        !(args.allow_cn.is_empty() && args.allow_dns.is_empty() && args.allow_uri.is_empty());
    config
}

/// The handshake slots kept for proven sources out of `handshakes`: none
/// where no source can be proven (no client CA, or `--source-memory 0`);
/// a quarter by default; a given reserve lowered with `--max-handshakes`
/// when the descriptor limit lowers that.
fn handshake_reserve(args: &ServeArgs, handshakes: usize, client_certificates: bool) -> usize {
    if !client_certificates || args.source_memory == 0 {
        return 0;
    }
    match args.handshake_reserve {
        Some(given) => given * handshakes / args.max_handshakes.max(1),
        None => handshakes / 4,
    }
    .min(handshakes.saturating_sub(1))
}

fn seconds_or_off(secs: u64) -> Option<Duration> {
    (secs > 0).then(|| Duration::from_secs(secs))
}

fn fd_limit_too_low(limit: Option<u64>) -> String {
    format!(
        "the file descriptor limit (RLIMIT_NOFILE) is {}: too low for even one connection; raise it (LimitNOFILE= in systemd, ulimit -n)",
        limit.unwrap_or_default()
    )
}

/// The descriptor limit, raised to the hard limit where it can be.
fn raised_fd_limit() -> nbdgw::limits::FdLimit {
    use nbdgw::limits::{raise_fd_limit, FdLimit};
    let limit = raise_fd_limit().unwrap_or_else(|e| {
        warn!(error = %e, "cannot raise the file descriptor limit");
        let now = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
        FdLimit { before: now, now }
    });
    if limit.before != limit.now {
        info!(
            from = limit.before,
            to = limit.now,
            "raised the file descriptor limit"
        );
    }
    limit
}

/// `nbdgw client`'s share of the same: its local connections (each a
/// local socket and a server socket, counted as a session) and the admin
/// listener's, lowered to fit with a warning.
fn fit_client_fd_limit(max_connections: &mut usize, admin: bool) -> Result<()> {
    use nbdgw::limits::FdDemand;
    let limit = raised_fd_limit();
    let asked = FdDemand {
        sessions: *max_connections,
        handshakes: 0,
        waiting: 0,
        admin: match admin {
            true => nbdgw::config::DEFAULT_ADMIN_MAX_CONNECTIONS as usize,
            false => 0,
        },
    };
    let Some(fitted) = asked.fitted(limit.now) else {
        bail!(fd_limit_too_low(limit.now));
    };
    if fitted.sessions < *max_connections {
        warn!(
            limit = limit.now,
            max_connections = fitted.sessions,
            "the file descriptor limit is too low for --max-connections {}; lowered it to fit",
            *max_connections
        );
        *max_connections = fitted.sessions;
    }
    Ok(())
}

/// Raises the descriptor limit, then makes the bounds fit under it: every
/// session and handshake slot, every waiting place and the admin
/// listener's connections, each budgeted on top of the others so a full
/// admin cap or queue leaves every descriptor the sessions count on.
/// Bounds that do not fit are lowered in proportion, with a warning, so
/// nbdgw never takes a connection it then fails at accept (EMFILE) or at
/// its upstream connect; a limit too low for one of each stops start-up.
fn fit_fd_limit(
    config: &mut Config,
    admin: &mut nbdgw::admin::AdminLimits,
    args: &ServeArgs,
    client_certificates: bool,
) -> Result<()> {
    use nbdgw::limits::FdDemand;
    let limit = raised_fd_limit();
    let asked = FdDemand {
        sessions: config.max_connections,
        handshakes: config.max_handshakes,
        waiting: config.handshake_queue,
        admin: match args.admin_listen {
            Some(_) => admin.max_connections as usize,
            None => 0,
        },
    };
    let Some(fitted) = asked.fitted(limit.now) else {
        bail!(fd_limit_too_low(limit.now));
    };
    if fitted == asked {
        return Ok(());
    }
    warn!(
        limit = limit.now,
        needed = asked.needed(),
        max_connections = fitted.sessions,
        max_handshakes = fitted.handshakes,
        handshake_queue = fitted.waiting,
        admin_max_connections = fitted.admin,
        handshake_reserve = handshake_reserve(args, fitted.handshakes, client_certificates),
        "the file descriptor limit (RLIMIT_NOFILE, e.g. LimitNOFILE= in systemd) is too low for the configured bounds; lowered them in proportion to fit (was --max-connections {}, --max-handshakes {}, --handshake-queue {}, --admin-max-connections {})",
        asked.sessions, asked.handshakes, asked.waiting, asked.admin,
    );
    config.max_connections = fitted.sessions;
    config.max_handshakes = fitted.handshakes;
    config.max_handshakes_per_source = config.max_handshakes_per_source.min(fitted.handshakes);
    config.handshake_reserve = handshake_reserve(args, fitted.handshakes, client_certificates);
    config.handshake_queue = fitted.waiting;
    config.handshake_queue_per_source = config.handshake_queue_per_source.min(fitted.waiting);
    // The default share follows --max-connections down; a share given
    // is kept (the session budget caps it in any case).
    if args.max_sessions_per_identity.is_none() {
        config.max_sessions_per_identity =
            nbdgw::config::default_sessions_per_identity(fitted.sessions, client_certificates);
    }
    if fitted.admin > 0 {
        admin.max_connections = u32::try_from(fitted.admin).unwrap_or(u32::MAX);
    }
    Ok(())
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
