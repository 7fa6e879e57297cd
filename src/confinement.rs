//! After start-up the process restricts itself with Landlock: it may read
//! beneath the directories of its TLS (and policy) files, connect to its
//! upstream Unix sockets (each socket itself, or its own directory; all
//! of `--export-dir`) and systemd's notification socket, and may not
//! open anything else, nor bind or connect TCP sockets, nor connect to
//! abstract Unix sockets or signal processes outside its own domain. A
//! bug in the TLS stack or the protocol code then cannot read host files
//! or reach the network, the host's abstract sockets (a container shares
//! its network namespace's) or other processes.
//!
//! Landlock restricts the calling thread and the threads it starts later,
//! so this runs on the main thread before the async runtime exists.
//! Kernels before Landlock ABI 9 (Linux 7.1) have no right for connecting
//! to pathname Unix sockets, before ABI 6 (Linux 6.12) no scopes, before
//! ABI 4 (Linux 6.7) no TCP rights; there the rest is enforced
//! ("partial"), unless `--landlock required` asks for all of it.

use std::path::{Path, PathBuf};

use landlock::{
    path_beneath_rules, Access, AccessFs, AccessNet, BitFlags, LandlockStatus, Ruleset,
    RulesetAttr, RulesetCreatedAttr, RulesetError, RulesetStatus, Scope, ABI,
};
use thiserror::Error;

/// The newest ABI this code asks for (9: connecting to pathname Unix
/// sockets); an older kernel enforces what it has.
const ABI_TARGET: ABI = ABI::V9;

/// `--landlock`: whether the process sandboxes itself, and whether less
/// than everything it asks for is good enough.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LandlockMode {
    /// Sandbox with what the kernel has; a kernel with less logs what is
    /// left open and serves.
    #[default]
    #[value(name = "true")]
    On,
    /// No sandbox.
    #[value(name = "false")]
    Off,
    /// Refuse to start unless every restriction is enforced.
    Required,
}

/// What the kernel enforced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Enforcement {
    Full,
    /// An older kernel: some rights (e.g. Unix-socket connects before ABI
    /// 9, TCP before ABI 4) are not covered.
    Partial,
    /// No Landlock in this kernel (or it is disabled at boot).
    None,
}

impl Enforcement {
    pub fn as_str(&self) -> &'static str {
        match self {
            Enforcement::Full => "full",
            Enforcement::Partial => "partial",
            Enforcement::None => "none",
        }
    }
}

/// What the process may still do once sandboxed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rules {
    /// Read beneath each (a directory) or the file itself.
    pub readable: Vec<PathBuf>,
    /// Connect to each Unix socket, or to any beneath each directory.
    pub connectable: Vec<PathBuf>,
}

/// What `restrict` achieved, for the log and for `--landlock required`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub enforcement: Enforcement,
    /// The Landlock ABI in use (the kernel's, capped at what this build
    /// knows); 0 without Landlock.
    pub abi: i32,
}

#[derive(Debug, Error)]
pub enum SandboxError {
    #[error("--landlock required: this kernel has no Landlock (not built in, or disabled at boot: add landlock to lsm= on the kernel command line); refusing to start unsandboxed")]
    Unavailable,
    #[error("--landlock required: the kernel enforces Landlock ABI {abi}, and every restriction needs ABI {needed} (Linux 7.1); left open would be: {}; refusing to start", missing.join(", "))]
    Partial {
        abi: i32,
        needed: i32,
        missing: Vec<&'static str>,
    },
    #[error("--landlock required: cannot restrict the process: {0}")]
    Restrict(#[from] RulesetError),
}

/// The rights a kernel of Landlock ABI `abi` leaves uncovered, of those
/// `restrict` asks for.
pub fn missing_at(abi: i32) -> Vec<&'static str> {
    let mut missing = Vec::new();
    if abi < 1 {
        missing.push("every file and network restriction");
        return missing;
    }
    if abi < 2 {
        missing.push("renaming and linking across directories");
    }
    if abi < 3 {
        missing.push("truncating files");
    }
    if abi < 4 {
        missing.push("binding and connecting TCP sockets");
    }
    if abi < 5 {
        missing.push("device ioctls");
    }
    if abi < 6 {
        missing.push(
            "connecting to abstract Unix sockets and signalling processes outside the sandbox",
        );
    }
    if abi < 9 {
        missing.push("connecting to pathname Unix sockets other than the upstream's");
    }
    missing
}

/// Whether nbdgw may serve after `restrict` gave `outcome`: in
/// `required` mode only with everything enforced. (`On` always may: what
/// is missing is logged by the caller.)
pub fn decide(mode: LandlockMode, outcome: &Outcome) -> Result<(), SandboxError> {
    if mode != LandlockMode::Required {
        return Ok(());
    }
    match outcome.enforcement {
        Enforcement::None => Err(SandboxError::Unavailable),
        Enforcement::Partial => Err(SandboxError::Partial {
            abi: outcome.abi,
            needed: ABI_TARGET as i32,
            missing: missing_at(outcome.abi),
        }),
        Enforcement::Full => Ok(()),
    }
}

/// The path a connect rule names for one upstream socket: the narrowest
/// that keeps working. A rule covers an inode, and a server re-creates
/// its socket (a new inode) when it restarts, so a rule on the socket
/// file itself would shut nbdgw out after the first restart of its
/// upstream: an outage until nbdgw restarts too. So the rule is the
/// socket's directory, which survives that, and which is exactly the
/// socket where the socket has a directory of its own (as the shipped
/// Kubernetes and systemd files give it); a directory that holds more
/// (`/run` would mean every daemon's socket) is said at start, with the
/// advice to give the socket its own. Symbolic links are resolved: the
/// connect is checked on the socket they lead to.
pub fn socket_rule(socket: &Path) -> SocketRule {
    let resolved = std::fs::canonicalize(socket).unwrap_or_else(|_| socket.to_path_buf());
    let dir = match resolved.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let others = std::fs::read_dir(&dir).map_or(true, |entries| {
        entries
            .filter_map(Result::ok)
            .any(|entry| Some(entry.file_name().as_os_str()) != resolved.file_name())
    });
    match others {
        false => SocketRule::OwnDirectory(dir),
        true => SocketRule::SharedDirectory(dir),
    }
}

/// See `socket_rule`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SocketRule {
    /// The socket's directory, which holds nothing else.
    OwnDirectory(PathBuf),
    /// The socket's directory, which holds other things too (said in the
    /// log at start).
    SharedDirectory(PathBuf),
}

impl SocketRule {
    pub fn path(&self) -> &Path {
        match self {
            SocketRule::OwnDirectory(p) | SocketRule::SharedDirectory(p) => p,
        }
    }
}

/// The directories a rule must name to cover each path: its directory
/// and, if it is a symbolic link, its target's. Certificates are replaced
/// by renaming a new file into place (certbot, cert-manager's `..data`
/// swap) and sockets are re-created when their server restarts, and a
/// rule on the old inode would not cover the new one.
pub fn dirs_covering<'a>(files: impl IntoIterator<Item = &'a Path>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for file in files {
        let resolved = std::fs::canonicalize(file).ok();
        for path in std::iter::once(file.to_path_buf()).chain(resolved) {
            let dir = if path.is_dir() {
                path
            } else {
                match path.parent() {
                    Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
                    _ => PathBuf::from("."),
                }
            };
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
    }
    dirs
}

/// Applies `rules` and nothing else on the filesystem; no TCP bind or
/// connect; no abstract Unix socket or signal outside the sandbox; for
/// this thread and every thread it starts.
pub fn restrict(rules: &Rules) -> Result<Outcome, RulesetError> {
    // nbdgw connects to no abstract socket (sd-notify sends to paths
    // only) and signals no one: both scopes, whole.
    let scopes: BitFlags<Scope> = Scope::from_all(ABI_TARGET);
    let status = Ruleset::default()
        .handle_access(AccessFs::from_all(ABI_TARGET))?
        .handle_access(AccessNet::from_all(ABI_TARGET))?
        .scope(scopes)?
        .create()?
        .add_rules(path_beneath_rules(
            &rules.readable,
            AccessFs::from_read(ABI_TARGET),
        ))?
        .add_rules(path_beneath_rules(
            &rules.connectable,
            AccessFs::ResolveUnix,
        ))?
        .restrict_self()?;
    let abi = match status.landlock {
        LandlockStatus::Available { effective_abi, .. } => effective_abi as i32,
        LandlockStatus::NotEnabled | LandlockStatus::NotImplemented => 0,
    };
    Ok(Outcome {
        enforcement: match status.ruleset {
            RulesetStatus::FullyEnforced => Enforcement::Full,
            RulesetStatus::PartiallyEnforced => Enforcement::Partial,
            RulesetStatus::NotEnforced => Enforcement::None,
        },
        abi,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(enforcement: Enforcement, abi: i32) -> Outcome {
        Outcome { enforcement, abi }
    }

    #[test]
    fn required_serves_only_with_everything_enforced() {
        let full = outcome(Enforcement::Full, 9);
        assert!(decide(LandlockMode::Required, &full).is_ok());
        let partial = outcome(Enforcement::Partial, 7);
        let refused = decide(LandlockMode::Required, &partial).unwrap_err();
        let said = refused.to_string();
        assert!(said.contains("ABI 7") && said.contains("ABI 9"), "{said}");
        assert!(said.contains("pathname Unix sockets"), "{said}");
        assert!(!said.contains("abstract"), "{said}");
        let old = decide(LandlockMode::Required, &outcome(Enforcement::Partial, 5)).unwrap_err();
        assert!(old.to_string().contains("abstract Unix sockets"), "{old}");
        assert!(matches!(
            decide(LandlockMode::Required, &outcome(Enforcement::None, 0)),
            Err(SandboxError::Unavailable)
        ));
    }

    #[test]
    fn best_effort_serves_whatever_was_enforced() {
        for (enforcement, abi) in [
            (Enforcement::Full, 9),
            (Enforcement::Partial, 4),
            (Enforcement::None, 0),
        ] {
            assert!(decide(LandlockMode::On, &outcome(enforcement, abi)).is_ok());
        }
    }

    #[test]
    fn every_abi_before_the_target_misses_something_and_the_target_nothing() {
        for abi in 0..ABI_TARGET as i32 {
            assert!(!missing_at(abi).is_empty(), "ABI {abi}");
        }
        assert!(missing_at(ABI_TARGET as i32).is_empty());
    }

    #[test]
    fn a_socket_among_other_files_gets_its_directory_and_it_is_said() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("disk.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let _sibling =
            std::os::unix::net::UnixListener::bind(dir.path().join("other.sock")).unwrap();
        let canonical = std::fs::canonicalize(dir.path()).unwrap();
        assert_eq!(socket_rule(&socket), SocketRule::SharedDirectory(canonical));
    }

    #[test]
    fn a_socket_alone_in_its_directory_gets_the_directory_which_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("disk.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let canonical = std::fs::canonicalize(dir.path()).unwrap();
        assert_eq!(
            socket_rule(&socket),
            SocketRule::OwnDirectory(canonical.clone())
        );
        // Not there yet, in an empty directory: the same.
        drop(_listener);
        std::fs::remove_file(&socket).unwrap();
        assert_eq!(socket_rule(&socket), SocketRule::OwnDirectory(canonical));
    }

    #[test]
    fn a_missing_socket_beside_other_files_falls_back_to_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("unrelated"), "x").unwrap();
        let canonical = std::fs::canonicalize(dir.path()).unwrap();
        assert_eq!(
            socket_rule(&dir.path().join("disk.sock")),
            SocketRule::SharedDirectory(canonical)
        );
    }

    #[test]
    fn a_symlinked_socket_is_named_where_it_lives() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let socket = real.join("disk.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        std::fs::write(real.join("unrelated"), "x").unwrap();
        let link = dir.path().join("link.sock");
        std::os::unix::fs::symlink(&socket, &link).unwrap();
        assert_eq!(
            socket_rule(&link),
            SocketRule::SharedDirectory(std::fs::canonicalize(&real).unwrap())
        );
    }

    #[test]
    fn a_symlinked_file_keeps_both_directories_readable() {
        let outer = tempfile::tempdir().unwrap();
        let archive = outer.path().join("archive");
        let live = outer.path().join("live");
        std::fs::create_dir_all(&archive).unwrap();
        std::fs::create_dir_all(&live).unwrap();
        std::fs::write(archive.join("cert1.pem"), "x").unwrap();
        std::os::unix::fs::symlink(archive.join("cert1.pem"), live.join("cert.pem")).unwrap();
        let cert = live.join("cert.pem");
        let dirs = dirs_covering([cert.as_path(), cert.as_path()]);
        let archive = std::fs::canonicalize(archive).unwrap();
        assert_eq!(dirs, vec![live, archive]);
    }

    #[test]
    fn a_directory_is_kept_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let canonical = std::fs::canonicalize(dir.path()).unwrap();
        let dirs = dirs_covering([dir.path()]);
        assert!(dirs.contains(&dir.path().to_path_buf()));
        assert!(dirs.contains(&canonical));
        assert!(dirs.len() <= 2);
    }
}
