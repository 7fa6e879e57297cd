//! The Landlock sandbox drawn at start around what the gateway still
//! has to reach, and the probes its tests use.

use std::path::{Path, PathBuf};

use anyhow::Result;
use tracing::{info, warn};

use crate::cli::ServeArgs;
use crate::config::Config;
use crate::confinement::{Enforcement, LandlockMode, SocketRule};
use crate::policy::PolicyReloader;
use crate::tls::Reloader;

/// `--landlock true`: a kernel with less than all of it logs what stays
/// open and serves anyway; `--landlock required` refuses to start then.
/// Readable: the files (and directories) read after start; connectable:
/// each upstream socket (see confinement::socket_rule), all of --export-dir,
/// and systemd's notification socket.
pub fn apply(
    mode: LandlockMode,
    tls: &Reloader,
    policy: Option<&PolicyReloader>,
    config: &Config,
    args: &ServeArgs,
) -> Result<()> {
    let rules = rules(tls, policy, config, args);
    let shown = |dirs: &[PathBuf]| -> Vec<String> {
        dirs.iter().map(|d| d.display().to_string()).collect()
    };
    // The readiness check reads the mount table, which Landlock would
    // not let it open later.
    crate::listening::keep_mountinfo();
    let outcome = match crate::confinement::restrict(&rules) {
        Ok(outcome) => outcome,
        Err(e) if mode == LandlockMode::Required => {
            return Err(crate::confinement::SandboxError::Restrict(e).into())
        }
        Err(e) => {
            warn!(error = %e, "landlock: cannot restrict the process; it is not sandboxed");
            return Ok(());
        }
    };
    crate::confinement::decide(mode, &outcome)?;
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
            let missing = crate::confinement::missing_at(outcome.abi);
            if !missing.is_empty() {
                info!(abi = outcome.abi, missing = ?missing, "landlock: this kernel leaves these open (--landlock required refuses to start then)");
            }
        }
    }
    Ok(())
}

/// What stays reachable: the files read after start, the upstream
/// sockets and the export directory, and systemd's notification socket.
fn rules(
    tls: &Reloader,
    policy: Option<&PolicyReloader>,
    config: &Config,
    args: &ServeArgs,
) -> crate::confinement::Rules {
    let readable: Vec<&Path> = tls
        .paths()
        .files()
        .chain(args.tls.tls_dir.as_deref())
        .chain(policy.map(|p| p.path()))
        .chain(config.exports.as_ref().and_then(|e| e.dir()))
        .collect();
    let readable = crate::confinement::dirs_covering(readable.iter().copied());
    let sockets: Vec<&Path> = match &config.exports {
        Some(table) => table.fixed_sockets().collect(),
        None => vec![config.upstream.as_path()],
    };
    // The export directory is read at every lookup, sockets come and go
    // in it and its tenant subdirectories: the whole of it, nothing else.
    let mut connectable =
        crate::confinement::dirs_covering(config.exports.as_ref().and_then(|e| e.dir()));
    add_sockets(&mut connectable, sockets);
    add_notify_socket(&mut connectable);
    crate::confinement::Rules {
        readable,
        connectable,
    }
}

/// Each upstream socket's rule (see `confinement::socket_rule`).
fn add_sockets(connectable: &mut Vec<PathBuf>, sockets: Vec<&Path>) {
    for socket in sockets {
        let rule = crate::confinement::socket_rule(socket);
        // A rule on the socket file would not survive the upstream's
        // restart (see socket_rule): said, not narrowed.
        if let SocketRule::SharedDirectory(dir) = &rule {
            info!(socket = %socket.display(), dir = %dir.display(), "landlock: connects are allowed to every socket in the upstream socket's directory, which holds more than it; give the socket a directory of its own to narrow that");
        }
        if !connectable.iter().any(|p| p == rule.path()) {
            connectable.push(rule.path().to_path_buf());
        }
    }
}

/// systemd's notification socket, when it is a path: it stays for the
/// service's life, so the socket itself. (sd-notify sends to a path
/// only, so an abstract @NAME one is never reached, scoped or not.) One
/// that is not there could not be named and would fail the whole
/// ruleset; notify() logs its own errors.
fn add_notify_socket(connectable: &mut Vec<PathBuf>) {
    let notify = std::env::var_os("NOTIFY_SOCKET")
        .map(PathBuf::from)
        .filter(|path| path.is_absolute() && path.symlink_metadata().is_ok());
    if let Some(path) = notify {
        let path = std::fs::canonicalize(&path).unwrap_or(path);
        if !connectable.contains(&path) {
            connectable.push(path);
        }
    }
}

/// Hooks for the sandbox's tests, compiled into debug builds only: after
/// start, a runtime thread tries to open NBDGW_DEBUG_OPEN, to connect to
/// the Unix socket NBDGW_DEBUG_CONNECT (a path, or `@NAME` for an
/// abstract one) and to signal (signal 0: the permission check alone) the
/// process NBDGW_DEBUG_SIGNAL, and logs what happened.
pub mod debug_probe {
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
