//! The limits: checked against each other at start, and fitted under the
//! process's descriptor limit.

use anyhow::{bail, Result};
use tracing::{info, warn};

use crate::admin::AdminLimits;
use crate::cli::ServeArgs;
use crate::config::Config;
use crate::descriptors::{fd_limit_too_low, raised_fd_limit};

/// Returns the source prefixes, checked here with the other limits so a
/// length out of range stops start-up, naming its flag, before anything
/// is loaded.
pub(crate) fn check_limits(args: &ServeArgs) -> Result<crate::config::SourcePrefixes> {
    if args.tls.tls_cert.is_none() && args.tls.tls_dir.is_none() {
        bail!("a server certificate is required: --tls-cert and --tls-key, or --tls-dir (or NBDGW_TLS_CERT, NBDGW_TLS_KEY, NBDGW_TLS_DIR); see --help");
    }
    if args.admission.connections.max_connections == 0
        || args.admission.max_sessions_per_identity == Some(0)
        || args.admission.max_handshakes == 0
        || args.admission.max_handshakes_per_source == 0
        || args.relay.common.max_payload == 0
        || args.relay.handshake_timeout == 0
        || args.relay.upstream_timeout == 0
        || args.proxy_protocol.proxy_protocol_timeout == 0
    {
        bail!("--max-connections, --max-sessions-per-identity, --max-handshakes, --max-handshakes-per-source, --max-payload, --handshake-timeout, --upstream-timeout and --proxy-protocol-timeout must be greater than 0");
    }
    if !(crate::balancer::MIN_MAX_HEADER..=crate::balancer::MAX_MAX_HEADER)
        .contains(&args.proxy_protocol.proxy_protocol_max_header)
    {
        bail!(
            "--proxy-protocol-max-header must be {} to {}: a v2 header of TCP over IPv6 is {} bytes",
            crate::balancer::MIN_MAX_HEADER,
            crate::balancer::MAX_MAX_HEADER,
            crate::balancer::MIN_MAX_HEADER
        );
    }
    if args
        .admission
        .handshake_reserve
        .is_some_and(|reserve| reserve >= args.admission.max_handshakes)
    {
        bail!("--handshake-reserve must be less than --max-handshakes: unproven sources need at least one slot");
    }
    if args.relay.common.tcp_keepalive > 0
        && (args.relay.tcp_keepalive_interval == 0 || args.relay.tcp_keepalive_count == 0)
    {
        bail!("--tcp-keepalive-interval and --tcp-keepalive-count must be greater than 0 while keepalive is on");
    }
    Ok(crate::config::SourcePrefixes::new(
        args.admission.source_prefix_v4,
        args.admission.source_prefix_v6,
    )?)
}

/// Raises the descriptor limit, then makes the bounds fit under it: every
/// session and handshake slot, every waiting place, the admin listener's
/// connections and those from balancers before their PROXY header, each budgeted on top of the others so a full
/// admin cap or queue leaves every descriptor the sessions count on.
/// Bounds that do not fit are lowered in proportion, with a warning, so
/// nbdgw never takes a connection it then fails at accept (EMFILE) or at
/// its upstream connect; a limit too low for one of each stops start-up.
pub(crate) fn fit_fd_limit(
    config: &mut Config,
    admin: &mut AdminLimits,
    args: &ServeArgs,
    client_certificates: bool,
) -> Result<()> {
    use crate::descriptors::FdDemand;
    let limit = raised_fd_limit();
    let asked = FdDemand {
        sessions: config.max_connections,
        handshakes: config.max_handshakes,
        waiting: config.handshake_queue,
        admin: match args.admin.listen.admin_listen {
            Some(_) => admin.max_connections as usize,
            None => 0,
        },
        pre_header: config.proxy_protocol.pending,
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
        proxy_header_waiting = fitted.pre_header,
        handshake_reserve = args.admission.handshake_reserve(fitted.handshakes, client_certificates),
        "the file descriptor limit (RLIMIT_NOFILE, e.g. LimitNOFILE= in systemd) is too low for the configured bounds; lowered them in proportion to fit (was --max-connections {}, --max-handshakes {}, --handshake-queue {}, --admin-max-connections {})",
        asked.sessions, asked.handshakes, asked.waiting, asked.admin,
    );
    config.max_connections = fitted.sessions;
    config.max_handshakes = fitted.handshakes;
    config.max_handshakes_per_source = config.max_handshakes_per_source.min(fitted.handshakes);
    config.handshake_reserve = args
        .admission
        .handshake_reserve(fitted.handshakes, client_certificates);
    config.handshake_queue = fitted.waiting;
    config.proxy_protocol.pending = fitted.pre_header;
    config.handshake_queue_per_source = config.handshake_queue_per_source.min(fitted.waiting);
    // The default share follows --max-connections down; a share given
    // is kept (the session budget caps it in any case).
    if args.admission.max_sessions_per_identity.is_none() {
        config.max_sessions_per_identity =
            crate::config::default_sessions_per_identity(fitted.sessions, client_certificates);
    }
    if fitted.admin > 0 {
        admin.max_connections = u32::try_from(fitted.admin).unwrap_or(u32::MAX);
    }
    Ok(())
}

/// Logs the upstream send buffer the kernel grants, and warns once when
/// `net.core.wmem_max` clipped it.
pub(crate) fn report_sndbuf(requested: usize, metrics: &crate::metrics::Metrics) {
    let report = crate::upstream::probe_sndbuf(requested);
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
