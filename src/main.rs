//! The nbdgw command: flags and environment, logging, signals, start-up.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use tokio::net::TcpListener;
use tracing::{info, warn};

use nbdgw::cli::{CertsArgs, ClientArgs, Command, LogFormat, PolicyCommand, ServeArgs};
use nbdgw::config::{seconds_or_off, Config};
use nbdgw::confinement::LandlockMode;
use nbdgw::handover;
use nbdgw::setup::sandbox;
use sd_notify::NotifyState;

/// glibc's malloc keeps what a burst of connections freed (a 64-client
/// soak left RSS at its peak, 66 MiB against 13 idle); jemalloc, with its
/// background thread, gives freed pages back within seconds.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

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
    let client::settings::Started {
        settings,
        paths,
        reloader,
    } = client::settings::build(&args)?;
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
    nbdgw::shutdown::signals().await;
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
    let nbdgw::setup::Setup {
        reloader,
        policy,
        config,
        admin_limits,
    } = nbdgw::setup::configure(&args)?;
    let reload_interval = seconds_or_off(args.tls_reload_interval);
    let opened = handover::open(
        &args.handover,
        args.listen,
        args.admin_listen,
        &config.metrics,
    )?;
    // Counted before the sandbox hides /sys and /proc from the runtime.
    let threads = worker_threads(args.threads);
    match args.landlock {
        LandlockMode::Off => info!("--landlock false: the process is not sandboxed"),
        mode => sandbox::apply(mode, &reloader, policy.as_ref(), &config, &args)?,
    }

    let runtime = runtime(threads)?;
    runtime.block_on(async move {
        let handover::Opened { listeners, predecessor, mut successor, gate } = opened;
        // A successor accepts only once the running gateway has stopped.
        if let Some(successor) = &mut successor {
            tokio::task::block_in_place(|| successor.commit())?;
        }
        tokio::spawn(reloader.watch(reload_interval));
        if let Some(policy) = policy {
            tokio::spawn(policy.watch(reload_interval));
        }
        sandbox::debug_probe::after_start();
        if let Some(admin) = listeners.admin {
            start_admin(async_listener(admin)?, &config, admin_limits, gate.clone());
        }
        let listener = async_listener(listeners.nbd)?;
        let shown = display_addr(&listener);
        let (upstream, exports, cork) = (config.upstream.display().to_string(), config.exports.is_some(), config.cork);
        // The accept loop runs on a worker, not on this thread (which
        // only waits): each accepted connection's task then starts on the
        // worker that accepted it, instead of one thread waking another
        // for every connection (bench/RESULTS.md, handshake CPU).
        let serving = tokio::spawn(nbdgw::run_gated(listener, Arc::new(config), stopping(), gate));
        if let Some(successor) = successor {
            tokio::task::block_in_place(|| successor.serving())?;
        }
        if let Some(predecessor) = predecessor {
            tokio::spawn(predecessor.serve());
        }
        info!(listen = %shown, from_systemd = listeners.from_systemd, %upstream, exports, ?cork, "nbdgw listening");
        notify(&[NotifyState::Ready]);
        serving.await.context("the accept loop")??;
        Ok(())
    })
}

fn start_admin(
    listener: TcpListener,
    config: &Config,
    limits: nbdgw::admin::AdminLimits,
    gate: handover::Gate,
) {
    info!(admin = %display_addr(&listener), "admin endpoints: /healthz /readyz /metrics");
    let (metrics, health) = (config.metrics.clone(), config.health.clone());
    // With named exports each has its own server; one being down does
    // not make the gateway unready.
    if config.exports.is_none() {
        let upstream = config.upstream.clone();
        tokio::spawn(nbdgw::admin::watch_upstream(upstream, health.clone()));
    }
    tokio::spawn(nbdgw::admin::serve_gated(
        listener, metrics, health, limits, gate,
    ));
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
