//! The hand-over socket made safely: a successor that connects there is
//! given the gateway's listening sockets, so who can reach the path and
//! who can replace it is who can take the gateway over.

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use anyhow::{bail, Context, Result};
use tracing::info;

/// Binds `path` mode 0600. Refused: a directory that a uid other than
/// ours (or root) owns, or that group or others may write, unless it is
/// sticky (then no one else can rename or remove what is ours in it); a
/// file there that is not a socket, or not ours, or a socket something
/// still listens on. A stale socket of ours (nothing listening) is
/// replaced.
pub fn create(path: &Path) -> Result<UnixListener> {
    let uid = rustix::process::getuid().as_raw();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let meta = std::fs::metadata(dir)
        .with_context(|| format!("--handover-socket: directory {}", dir.display()))?;
    let mode = meta.permissions().mode();
    let sticky = mode & 0o1000 != 0;
    if meta.uid() != uid && meta.uid() != 0 {
        bail!(
            "--handover-socket: directory {} belongs to uid {}, not to this uid ({uid}) or root",
            dir.display(),
            meta.uid()
        );
    }
    if mode & 0o022 != 0 && !sticky {
        bail!(
            "--handover-socket: directory {} may be written by others (mode {:o}) and is not sticky: anyone could put their own socket there",
            dir.display(),
            mode & 0o7777
        );
    }
    remove_stale(path, uid)?;
    // 0600 from the start: no moment where another uid could connect.
    let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o177));
    let bound = UnixListener::bind(path);
    rustix::process::umask(old);
    let listener = bound.with_context(|| format!("--handover-socket {}", path.display()))?;
    info!(path = %path.display(), "hand-over socket: a successor may take over here (--take-over)");
    Ok(listener)
}

/// Whatever is at `path` must be a stale socket of ours, then removed.
fn remove_stale(path: &Path, uid: u32) -> Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("--handover-socket {}", path.display())),
    };
    if !meta.file_type().is_socket() {
        bail!(
            "--handover-socket {}: exists and is not a socket",
            path.display()
        );
    }
    if meta.uid() != uid {
        bail!(
            "--handover-socket {}: a socket of uid {} is there, not ours ({uid})",
            path.display(),
            meta.uid()
        );
    }
    match UnixStream::connect(path) {
        Ok(_) => bail!(
            "--handover-socket {}: a running gateway listens there; start this one with --take-over {} to replace it",
            path.display(),
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            info!(path = %path.display(), "hand-over socket: replacing a stale socket of ours");
            std::fs::remove_file(path).with_context(|| format!("removing stale {}", path.display()))
        }
        Err(e) => Err(e).with_context(|| format!("--handover-socket {}: probing", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_is_made_0600_and_a_stale_one_replaced() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let path = dir.path().join("h.sock");
        let first = create(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let live = create(&path).unwrap_err().to_string();
        assert!(live.contains("a running gateway listens there"), "{live}");
        drop(first);
        create(&path).unwrap();
    }

    #[test]
    fn a_directory_others_may_write_is_refused_unless_sticky() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let error = create(&dir.path().join("h.sock")).unwrap_err().to_string();
        assert!(error.contains("may be written by others"), "{error}");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        create(&dir.path().join("h.sock")).unwrap();
    }

    #[test]
    fn a_file_that_is_not_a_socket_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let path = dir.path().join("h.sock");
        std::fs::write(&path, b"keep").unwrap();
        let error = create(&path).unwrap_err().to_string();
        assert!(error.contains("is not a socket"), "{error}");
        assert_eq!(std::fs::read(&path).unwrap(), b"keep");
    }
}
