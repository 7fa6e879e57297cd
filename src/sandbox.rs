//! After start-up the process restricts itself with Landlock: it may read
//! beneath the directories of its TLS (and policy) files, and may not open
//! anything else, nor bind or connect TCP sockets. A bug in the TLS stack
//! or the protocol code then cannot read host files or reach the network.
//!
//! Landlock restricts the calling thread and the threads it starts later,
//! so this runs on the main thread before the async runtime exists.
//! Connecting to a Unix socket by path is not a Landlock right, so the
//! upstream socket needs no rule and stays reachable.

use std::path::{Path, PathBuf};

use landlock::{
    path_beneath_rules, Access, AccessFs, AccessNet, Ruleset, RulesetAttr, RulesetCreatedAttr,
    RulesetError, RulesetStatus, ABI,
};

/// The newest ABI this code knows; an older kernel enforces what it can.
const ABI_TARGET: ABI = ABI::V6;

/// What the kernel enforced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Enforcement {
    Full,
    /// An older kernel: some rights (e.g. the network ones) are not covered.
    Partial,
    /// No Landlock in this kernel (or it is disabled at boot).
    None,
}

/// The directories to keep readable: for each file, its directory and, if
/// it is a symbolic link, the directory of its target. Certificates are
/// replaced by renaming a new file into place (certbot, cert-manager's
/// `..data` swap), and a rule on the old file would not cover the new one.
pub fn readable_dirs<'a>(files: impl IntoIterator<Item = &'a Path>) -> Vec<PathBuf> {
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

/// Allows reading beneath `dirs` and nothing else on the filesystem, and
/// no TCP bind or connect, for this thread and every thread it starts.
pub fn restrict(dirs: &[PathBuf]) -> Result<Enforcement, RulesetError> {
    let status = Ruleset::default()
        .handle_access(AccessFs::from_all(ABI_TARGET))?
        .handle_access(AccessNet::from_all(ABI_TARGET))?
        .create()?
        .add_rules(path_beneath_rules(dirs, AccessFs::from_read(ABI_TARGET)))?
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
        let dirs = readable_dirs([cert.as_path(), cert.as_path()]);
        let archive = std::fs::canonicalize(archive).unwrap();
        assert_eq!(dirs, vec![live, archive]);
    }

    #[test]
    fn a_directory_is_kept_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let canonical = std::fs::canonicalize(dir.path()).unwrap();
        let dirs = readable_dirs([dir.path()]);
        assert!(dirs.contains(&dir.path().to_path_buf()));
        assert!(dirs.contains(&canonical));
        assert!(dirs.len() <= 2);
    }
}
