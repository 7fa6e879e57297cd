//! After start-up the process restricts itself with Landlock: it may read
//! beneath the directories of its TLS (and policy) files, connect to Unix
//! sockets beneath the upstream's (and systemd's notification socket's)
//! directory, and may not open anything else, nor bind or connect TCP
//! sockets. A bug in the TLS stack or the protocol code then cannot read
//! host files or reach the network.
//!
//! Landlock restricts the calling thread and the threads it starts later,
//! so this runs on the main thread before the async runtime exists.
//! Kernels before Landlock ABI 9 (Linux 7.1) have no right for connecting
//! to pathname Unix sockets; there such connects stay open and the rest
//! is enforced ("partial").

use std::path::{Path, PathBuf};

use landlock::{
    path_beneath_rules, Access, AccessFs, AccessNet, Ruleset, RulesetAttr, RulesetCreatedAttr,
    RulesetError, RulesetStatus, ABI,
};

/// The newest ABI this code asks for (9: connecting to pathname Unix
/// sockets); an older kernel enforces what it has.
const ABI_TARGET: ABI = ABI::V9;

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

/// Allows reading beneath `readable`, connecting to Unix sockets beneath
/// `connectable`, and nothing else on the filesystem; no TCP bind or
/// connect; for this thread and every thread it starts.
pub fn restrict(
    readable: &[PathBuf],
    connectable: &[PathBuf],
) -> Result<Enforcement, RulesetError> {
    let status = Ruleset::default()
        .handle_access(AccessFs::from_all(ABI_TARGET))?
        .handle_access(AccessNet::from_all(ABI_TARGET))?
        .create()?
        .add_rules(path_beneath_rules(
            readable,
            AccessFs::from_read(ABI_TARGET),
        ))?
        .add_rules(path_beneath_rules(connectable, AccessFs::ResolveUnix))?
        .restrict_self()?;
    Ok(match status.ruleset {
        RulesetStatus::FullyEnforced => Enforcement::Full,
        RulesetStatus::PartiallyEnforced => Enforcement::Partial,
        RulesetStatus::NotEnforced => Enforcement::None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
