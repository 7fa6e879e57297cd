//! `nbdgw client`'s flags made into what it runs with: the TLS files
//! loaded once (their failure stops the start), the descriptor budget
//! fitted, and `ClientSettings` filled. Nothing here touches a socket.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rustls::pki_types::ServerName;
use tracing::{info, warn};

use super::credentials::{ClientReloader, ClientTlsPaths};
use super::{parse_server, server_name, ClientSettings};
use crate::cli::{ClientArgs, ClientTlsArgs, ReconnectArgs};
use crate::config::{Cork, DEFAULT_ADMIN_MAX_CONNECTIONS};
use crate::descriptors::{fd_limit_too_low, raised_fd_limit, FdDemand};
use crate::metrics::Metrics;

/// What the start needs besides the settings: where the TLS files were
/// found (for the start line) and the reloader that watches them.
pub struct Started {
    pub settings: ClientSettings,
    pub paths: ClientTlsPaths,
    pub reloader: ClientReloader,
}

/// Reads the TLS files and builds the settings from `args`.
pub fn build(args: &ClientArgs) -> Result<Started> {
    let (host, port) = parse_server(&args.server.server)?;
    let name = server_name(args.server.server_name.as_deref().unwrap_or(&host))?;
    let (paths, reloader) = tls(args, &name)?;
    let mut settings = settings(args, (host, port, name), reloader.store())?;
    settings.tls_paths = paths.clone();
    settings.handover = handover_registry(args, &settings.metrics)?;
    Ok(Started {
        settings,
        paths,
        reloader,
    })
}

/// Client mode's settings from its flags; `server` is the server's host,
/// port and the name its certificate must carry.
fn settings(
    args: &ClientArgs,
    (host, port, server_name): (String, u16, ServerName<'static>),
    tls: Arc<crate::reloadable::Swap<rustls::ClientConfig>>,
) -> Result<ClientSettings> {
    if args.server.server_timeout >= args.relay.handshake_timeout {
        warn!(
            server_timeout = args.server.server_timeout,
            handshake_timeout = args.relay.handshake_timeout,
            "--server-timeout is not below --handshake-timeout: a local client waiting on a slow server is cut before it hears why"
        );
    }
    Ok(ClientSettings {
        server: args.server.server.clone(),
        host,
        port,
        server_name,
        tls,
        server_timeout: Duration::from_secs(args.server.server_timeout),
        handshake_timeout: Duration::from_secs(args.relay.handshake_timeout),
        relay: args.relay.limits(),
        max_connections: fitted_connections(
            args.connections.max_connections,
            args.admin.admin_listen.is_some(),
        )?,
        cork: Cork::Deferred,
        shutdown_grace: args.shutdown.grace(),
        reconnect: args.reconnect.settings(),
        metrics: Arc::new(Metrics::client_mode()),
        health: Arc::default(),
        handover: None,
        tls_paths: ClientTlsPaths::default(),
        min_version: args.tls.protocol.tls_min_version,
    })
}

/// The sessions a successor may be handed (`--handover-socket`), with
/// the hand-over's bounds. systemd's file-descriptor store is the server
/// mode's only: client mode refuses `--handover-fdstore`.
fn handover_registry(
    args: &ClientArgs,
    metrics: &Arc<Metrics>,
) -> Result<Option<Arc<crate::handing::Registry>>> {
    let flags = &args.handover;
    if flags.handover_fdstore {
        bail!("--handover-fdstore is not supported by nbdgw client: use --handover-socket and --take-over");
    }
    // A Kubernetes node gateway's flag: client mode runs beside its local
    // clients, not as a DaemonSet taking over from its own old pod.
    if flags.after_handover != crate::handover::flags::AfterHandover::Exit {
        bail!("--after-handover wait is not supported by nbdgw client: it exits once handed over");
    }
    if flags.handover_socket.is_none() {
        return Ok(None);
    }
    let quiesce = Duration::from_secs_f64(flags.handover_quiesce_timeout);
    let timeout = Duration::from_secs(flags.handover_timeout);
    let generations = flags.handover_max_key_generations;
    let registry = crate::handing::Registry::new(quiesce, timeout, generations, metrics.clone());
    Ok(Some(registry))
}

/// Client mode's first load of its TLS files, whose failure stops the
/// start; the groups are checked first, so that their error is not
/// reported as one of the files'.
fn tls(
    args: &ClientArgs,
    server_name: &ServerName<'static>,
) -> Result<(ClientTlsPaths, ClientReloader)> {
    crate::tls::check_groups_or_warn(
        &args.tls.protocol.tls_groups,
        args.tls.protocol.tls_min_version,
    )?;
    let sources = args.tls.sources();
    let paths = sources.resolve().context("client TLS files")?;
    let policy = args.tls.policy();
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

/// Client mode's share of the descriptor limit: its local connections
/// (each a local socket and a server socket, counted as a session) and
/// the admin listener's, lowered to fit with a warning.
fn fitted_connections(max_connections: usize, admin: bool) -> Result<usize> {
    let limit = raised_fd_limit();
    let asked = FdDemand {
        sessions: max_connections,
        handshakes: 0,
        waiting: 0,
        admin: match admin {
            true => DEFAULT_ADMIN_MAX_CONNECTIONS as usize,
            false => 0,
        },
        pre_header: 0,
    };
    let Some(fitted) = asked.fitted(limit.now) else {
        bail!(fd_limit_too_low(limit.now));
    };
    if fitted.sessions < max_connections {
        warn!(
            limit = limit.now,
            max_connections = fitted.sessions,
            "the file descriptor limit is too low for --max-connections {max_connections}; lowered it to fit",
        );
    }
    Ok(fitted.sessions.min(max_connections))
}

// The build steps of client mode's own flag groups, beside the settings
// they fill (the groups are in `crate::cli`, which knows nothing of them).

impl ClientTlsArgs {
    /// Where the TLS files are read from.
    pub fn sources(&self) -> super::credentials::ClientTlsSources {
        super::credentials::ClientTlsSources {
            dir: self.tls_dir.clone(),
            ca: self.tls_ca.clone(),
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
        }
    }

    /// What the client offers the server.
    pub fn policy(&self) -> super::credentials::ClientTlsPolicy {
        super::credentials::ClientTlsPolicy {
            min_version: self.protocol.tls_min_version,
            groups: self.protocol.tls_groups.clone(),
        }
    }
}

impl ReconnectArgs {
    /// `None` without `--reconnect`.
    pub fn settings(&self) -> Option<super::Reconnect> {
        self.reconnect.then(|| super::Reconnect {
            timeout: std::time::Duration::from_secs(self.reconnect_timeout),
            replay_buffer: self.replay_buffer,
            reply_buffer: self.reply_buffer,
        })
    }
}
