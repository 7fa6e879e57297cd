//! The server mode's start: its flags made into a running gateway's
//! parts before any socket is touched. The TLS files and the policy are
//! read (their failure stops the start), the limits checked and fitted to
//! the descriptor limit, the exports and the read cache set up
//! (`files`, `limits`), and the sandbox drawn around what is left to
//! reach (`sandbox`); `run` serves it, and `process` holds what both
//! modes need around them (logging, runtime, systemd, signals). `main` only
//! parses and calls `serve` (or `crate::client::start`).

mod files;
mod limits;
pub mod process;
mod run;
pub mod sandbox;

pub use run::serve;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use tracing::{info, warn};

use crate::admin::AdminLimits;
use crate::cli::ServeArgs;
use crate::config::Config;
use crate::policy::PolicyReloader;
use crate::tls::{Reloader, TlsStore};

/// What the start hands the runtime.
pub struct Setup {
    pub reloader: Reloader,
    pub policy: Option<PolicyReloader>,
    pub config: Config,
    pub admin_limits: AdminLimits,
}

/// Everything decided before any socket is touched, fitted to the
/// descriptor limit.
pub fn configure(args: &ServeArgs) -> Result<Setup> {
    let (reloader, policy, mut config) = read(args)?;
    let mut admin_limits = args.admin.limits();
    limits::fit_fd_limit(
        &mut config,
        &mut admin_limits,
        args,
        reloader.requires_client_certificates(),
    )?;
    limits::report_sndbuf(args.routing.upstream_sndbuf, &config.metrics);
    if config.exports.is_none() && !crate::upstream::looks_like_socket(&config.upstream) {
        warn!(upstream = %config.upstream.display(), "upstream socket does not exist yet; clients will get an error until it does");
    }
    Ok(Setup {
        reloader,
        policy,
        config,
        admin_limits,
    })
}

/// The files read (TLS, policy), the exports and the limits checked.
fn read(args: &ServeArgs) -> Result<(Reloader, Option<PolicyReloader>, Config)> {
    let exports = files::export_table(args)?;
    let upstream = match (&args.routing.upstream, &exports) {
        (Some(upstream), _) => upstream.clone(),
        (None, Some(_)) => PathBuf::new(),
        (None, None) => bail!("--upstream, --export or --export-dir is required (or NBDGW_UPSTREAM, NBDGW_EXPORT, NBDGW_EXPORT_DIR); see --help"),
    };
    let source_prefixes = limits::check_limits(args)?;
    // Probed before the sandbox, which forbids the loopback connection.
    let (kernel_tls, kernel_tls_no_rekey) = crate::tls::kernel::decide(args.tls.ktls);
    // A session handed to a successor leaves rustls as keys, as one
    // handed to the kernel does.
    let handover = args.handover.handover_socket.is_some() || args.handover.handover_fdstore;
    let reloader = files::tls_reloader(args, kernel_tls.is_some() || handover)?;
    let mut policy = files::policy_reloader(args, &reloader)?;
    let mut config = gateway_config(args, upstream, reloader.store());
    config.source_prefixes = source_prefixes;
    let pending = args.proxy_protocol.pending_bound(&args.admission);
    config.proxy_protocol = args.proxy_protocol.trusted(pending);
    // Only a client certificate the policy honours proves a source; with
    // no client CA nothing can, and a reserve would only idle.
    if !reloader.requires_client_certificates() && args.admission.source_memory > 0 {
        info!("no client CA: no source can prove itself, so --source-memory and --handshake-reserve are off");
        config.source_memory = Duration::ZERO;
    }
    let client_certificates = reloader.requires_client_certificates();
    let admission = &args.admission;
    config.handshake_reserve =
        admission.handshake_reserve(admission.max_handshakes, client_certificates);
    config.max_sessions_per_identity =
        admission.sessions_per_identity(admission.connections.max_connections, client_certificates);
    config.exports = exports.map(Arc::new);
    config.kernel_tls = kernel_tls;
    config.kernel_tls_no_rekey = kernel_tls_no_rekey;
    config.ktls_key_limit = args.tls.ktls_key_limit;
    config.handover = handover.then(|| handover_registry(args, &config));
    if args.handover.handover_fdstore {
        crate::handover::fdstore::check_room(admission.connections.max_connections);
    }
    config.read_cache = args.cache.settings(
        args.routing.upstream.is_some(),
        args.relay.common.max_payload,
        config.metrics.cache.clone(),
    )?;
    if let Some(policy) = &mut policy {
        config.policy = policy.store();
        let m = &config.metrics;
        policy.count_into(m.policy_reloads.clone(), m.policy_reload_failures.clone());
        policy.count_changes_into(m.policy_changes.clone());
        if args.access.policy_revoke_closes {
            let sessions = config.tls.sessions().clone();
            policy.close_narrowed_with(move |policy| sessions.close_narrowed(policy));
        }
    }
    Ok((reloader, policy, config))
}

/// The sessions a successor (or the next instance, through systemd's
/// file-descriptor store) may be handed, with the hand-over's bounds.
fn handover_registry(args: &ServeArgs, config: &Config) -> Arc<crate::handing::Registry> {
    let flags = &args.handover;
    let quiesce = Duration::from_secs_f64(flags.handover_quiesce_timeout);
    let timeout = Duration::from_secs(flags.handover_timeout);
    let generations = flags.handover_max_key_generations;
    crate::handing::Registry::new(quiesce, timeout, generations, config.metrics.clone())
}

/// The settings taken as the flags give them; what is derived from the
/// files read, or fitted to the descriptor limit, is set by `read`.
fn gateway_config(args: &ServeArgs, upstream: PathBuf, tls: Arc<TlsStore>) -> Config {
    let mut config = Config::new(upstream, tls);
    config.upstream_sndbuf = args.routing.upstream_sndbuf;
    config.policy_revoke_closes = args.access.policy_revoke_closes;
    args.admission.apply(&mut config);
    config.handshake_timeout = Duration::from_secs(args.relay.handshake_timeout);
    config.upstream_timeout = Duration::from_secs(args.relay.upstream_timeout);
    config.relay = args.relay.limits();
    config.max_refused_options = args.relay.max_refused_options;
    config.shutdown_grace = args.shutdown.common.grace();
    config.drain_delay = Duration::from_secs(args.shutdown.drain_delay);
    config.drain_answer = args.shutdown.common.drain_answer;
    config.cork = args.relay.cork;
    config.allow_lists = args.access.allow_lists();
    config
}
