//! The files the start reads, whose failure stops it: TLS, the policy,
//! the export table, and the immutable exports' read cache.

use anyhow::{bail, Context, Result};
use tracing::info;

use crate::cli::ServeArgs;
use crate::tls::Reloader;

pub(crate) fn export_table(args: &ServeArgs) -> Result<Option<crate::exports::ExportTable>> {
    // An owner check that checks nothing must not look like one. Unset,
    // it is the strict default (same). An explicit `any` (the old
    // default, which checks nothing anyway) is accepted alone, so a
    // deployment that set it everywhere keeps starting.
    let checks = !matches!(
        args.routing.export_dir_owner,
        None | Some(crate::exports::OwnerCheck::Any)
    );
    if args.routing.export_dir.is_none() && checks {
        bail!("--export-dir-owner (NBDGW_EXPORT_DIR_OWNER) needs --export-dir: it checks only the sockets found there");
    }
    let owner = args.routing.export_dir_owner.unwrap_or_default();
    if args.routing.exports.is_empty() && args.routing.export_dir.is_none() {
        return Ok(None);
    }
    if let Some(dir) = &args.routing.export_dir {
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
    let table = crate::exports::ExportTable::new(
        args.routing.exports.clone(),
        args.routing.export_dir.clone(),
    )?
    .with_owner_check(owner);
    info!(exports = ?table.names(), dir = ?args.routing.export_dir, owner = %owner, "exports routed by name");
    Ok(Some(table))
}

/// The policy file's first read, which must succeed; it only means
/// something when clients are identified by certificates.
pub(crate) fn policy_reloader(
    args: &ServeArgs,
    tls: &Reloader,
) -> Result<Option<crate::policy::PolicyReloader>> {
    let Some(path) = &args.access.policy else {
        return Ok(None);
    };
    if !tls.requires_client_certificates() {
        bail!("--policy needs client certificates: give a client CA (--tls-client-ca, or ca-cert.pem / ca.crt in --tls-dir)");
    }
    let policy = crate::policy::PolicyReloader::start(path.clone())
        .context("loading the access policy (--policy)")?;
    Ok(Some(policy))
}

/// The first load of the TLS files, whose failure stops start-up.
pub(crate) fn tls_reloader(args: &ServeArgs, secret_extraction: bool) -> Result<Reloader> {
    let sources = args.tls.sources();
    let policy = args
        .tls
        .policy(args.access.allow_list()?, secret_extraction);
    crate::tls::check_groups_or_warn(
        &args.tls.protocol.tls_groups,
        args.tls.protocol.tls_min_version,
    )?;
    Reloader::start(sources, policy).context("loading the TLS files")
}
