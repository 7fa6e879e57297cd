//! The server mode's start: its flags made into a running gateway's
//! parts before any socket is touched. The TLS files and the policy are
//! read (their failure stops the start), the limits checked and fitted to
//! the descriptor limit, the exports and the read cache set up
//! (`files`, `limits`), and the sandbox drawn around what is left to
//! reach (`sandbox`). `main` only parses, calls `configure`, and runs.

mod files;
mod limits;
pub mod sandbox;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use tracing::{info, warn};

use crate::admin::AdminLimits;
use crate::cli::ServeArgs;
use crate::config::{seconds_or_off, Config, Keepalive};
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
    let mut admin_limits = admin_limits(args);
    limits::fit_fd_limit(
        &mut config,
        &mut admin_limits,
        args,
        reloader.requires_client_certificates(),
    )?;
    limits::report_sndbuf(args.upstream_sndbuf, &config.metrics);
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

/// Connections from balancers before their PROXY header, before the
/// descriptor limit's fitting: what admission itself holds
/// unauthenticated (see `crate::proxy`), if any balancer is trusted.
fn pending_bound(args: &ServeArgs) -> usize {
    match args.proxy_protocol_from.iter().any(|p| p.0.is_some()) {
        true => args.max_handshakes.saturating_add(args.handshake_queue),
        false => 0,
    }
}

/// The files read (TLS, policy), the exports and the limits checked.
fn read(args: &ServeArgs) -> Result<(Reloader, Option<PolicyReloader>, Config)> {
    let exports = files::export_table(args)?;
    let upstream = match (&args.upstream, &exports) {
        (Some(upstream), _) => upstream.clone(),
        (None, Some(_)) => PathBuf::new(),
        (None, None) => bail!("--upstream, --export or --export-dir is required (or NBDGW_UPSTREAM, NBDGW_EXPORT, NBDGW_EXPORT_DIR); see --help"),
    };
    let source_prefixes = limits::check_limits(args)?;
    // Probed before the sandbox, which forbids the loopback connection.
    let (kernel_tls, kernel_tls_no_rekey) = crate::tls::kernel::decide(args.ktls);
    let reloader = files::tls_reloader(args, kernel_tls.is_some())?;
    let mut policy = files::policy_reloader(args, &reloader)?;
    let mut config = gateway_config(args, upstream, reloader.store());
    config.source_prefixes = source_prefixes;
    config.proxy_protocol = crate::balancer::Trusted {
        from: args
            .proxy_protocol_from
            .iter()
            .filter_map(|p| p.0)
            .collect(),
        max_header: args.proxy_protocol_max_header,
        serve_local: args.proxy_protocol_serve_local,
        header_timeout: Duration::from_secs(args.proxy_protocol_timeout),
        pending: pending_bound(args),
    };
    // Only a client certificate the policy honours proves a source; with
    // no client CA nothing can, and a reserve would only idle.
    if !reloader.requires_client_certificates() && args.source_memory > 0 {
        info!("no client CA: no source can prove itself, so --source-memory and --handshake-reserve are off");
        config.source_memory = Duration::ZERO;
    }
    config.handshake_reserve = limits::handshake_reserve(
        args,
        args.max_handshakes,
        reloader.requires_client_certificates(),
    );
    config.max_sessions_per_identity = args.max_sessions_per_identity.unwrap_or_else(|| {
        crate::config::default_sessions_per_identity(
            args.max_connections,
            reloader.requires_client_certificates(),
        )
    });
    config.exports = exports.map(Arc::new);
    config.kernel_tls = kernel_tls;
    config.kernel_tls_no_rekey = kernel_tls_no_rekey;
    config.ktls_key_limit = args.ktls_key_limit;
    files::read_cache(args, &mut config)?;
    if let Some(policy) = &mut policy {
        config.policy = policy.store();
        let m = &config.metrics;
        policy.count_into(m.policy_reloads.clone(), m.policy_reload_failures.clone());
        policy.count_changes_into(m.policy_changes.clone());
        if args.policy_revoke_closes {
            let sessions = config.tls.sessions().clone();
            policy.close_narrowed_with(move |policy| sessions.close_narrowed(policy));
        }
    }
    Ok((reloader, policy, config))
}

fn admin_limits(args: &ServeArgs) -> AdminLimits {
    AdminLimits {
        max_connections: args.admin_max_connections,
        header_timeout: Duration::from_secs(args.admin_header_timeout),
        keepalive_requests: args.admin_keepalive_requests,
        keepalive_timeout: Duration::from_secs(args.admin_keepalive_timeout),
        max_header_bytes: args.admin_max_header_bytes as usize,
    }
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
