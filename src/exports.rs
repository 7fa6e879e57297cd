//! Named upstreams: `--export NAME=PATH[:UPSTREAM_NAME]` and
//! `--export-dir DIR`, where every Unix socket `NAME.sock` is the export
//! NAME, and every `TENANT/NAME.sock` one directory down the export
//! `TENANT/NAME` (the form a templated policy rule `{ns}/*` grants). The
//! directory is looked at when a client names an export or asks for the
//! list, so sockets are picked up and dropped as they come and go, with
//! nothing to watch or cache.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use thiserror::Error;

use crate::proto::name::{export_name, NameError};

/// The suffix that makes a file in `--export-dir` an export.
pub const SOCKET_SUFFIX: &str = ".sock";

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ExportError {
    #[error("--export {0:?}: expected NAME=PATH or NAME=PATH:UPSTREAM_NAME")]
    Syntax(String),
    #[error("--export {0:?} is given twice")]
    Duplicate(String),
    #[error("--export {0:?}: {1}")]
    Name(String, NameError),
}

/// One export: the name clients use, the socket behind it, and the name
/// to ask that server for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Export {
    pub name: String,
    pub socket: PathBuf,
    pub upstream_name: String,
}

impl FromStr for Export {
    type Err = ExportError;

    /// `NAME=PATH[:UPSTREAM_NAME]`; a path holding `:` cannot be given
    /// this way (use --export-dir).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let syntax = || ExportError::Syntax(text.to_string());
        let (name, rest) = text.split_once('=').ok_or_else(syntax)?;
        let (socket, upstream_name) = rest.split_once(':').unwrap_or((rest, ""));
        if socket.is_empty() {
            return Err(syntax());
        }
        // A name no client could ask for (see proto::name) is a mistake.
        export_name(name.as_bytes()).map_err(|e| ExportError::Name(text.to_string(), e))?;
        Ok(Export {
            name: name.to_string(),
            socket: PathBuf::from(socket),
            upstream_name: upstream_name.to_string(),
        })
    }
}

/// Every export the gateway routes to.
#[derive(Debug, Clone, Default)]
pub struct ExportTable {
    fixed: Vec<Export>,
    dir: Option<PathBuf>,
}

impl ExportTable {
    pub fn new(fixed: Vec<Export>, dir: Option<PathBuf>) -> Result<Self, ExportError> {
        for (i, export) in fixed.iter().enumerate() {
            if fixed[..i].iter().any(|e| e.name == export.name) {
                return Err(ExportError::Duplicate(export.name.clone()));
            }
        }
        Ok(ExportTable { fixed, dir })
    }

    /// The sockets of `--export` (for the sandbox, which gives each its
    /// own rule; `dir` gets one for all beneath it).
    pub fn fixed_sockets(&self) -> impl Iterator<Item = &Path> {
        self.fixed.iter().map(|e| e.socket.as_path())
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The export called `name`: a fixed one, else a socket in the
    /// directory (`NAME`) or in one of its subdirectories (`TENANT/NAME`).
    /// A name that could step out of the directory is never looked up
    /// there: each component must be a plain file name.
    pub fn lookup(&self, name: &str) -> Option<Export> {
        if let Some(export) = self.fixed.iter().find(|e| e.name == name) {
            return Some(export.clone());
        }
        let dir = self.dir.as_ref()?;
        let (subdir, file) = match name.split_once('/') {
            Some((tenant, file)) if is_plain_file_name(tenant) => (dir.join(tenant), file),
            Some(_) => return None,
            None => (dir.clone(), name),
        };
        if !is_plain_file_name(file) {
            return None;
        }
        let socket = subdir.join(format!("{file}{SOCKET_SUFFIX}"));
        is_socket(&socket).then(|| Export {
            name: name.to_string(),
            socket,
            upstream_name: String::new(),
        })
    }

    /// Every export's name, fixed ones first, then the directory's
    /// (its subdirectories' as `TENANT/NAME`) sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.fixed.iter().map(|e| e.name.clone()).collect();
        let mut found = Vec::new();
        if let Some(dir) = &self.dir {
            for (tenant, path) in entries(dir) {
                // A directory as lookup sees it: through a symbolic link.
                if path.is_dir() {
                    found.extend(
                        sockets(&path)
                            .into_iter()
                            .map(|name| format!("{tenant}/{name}")),
                    );
                }
            }
            found.extend(sockets(dir));
        }
        found.retain(|name| !names.contains(name));
        found.sort();
        names.append(&mut found);
        names
    }
}

/// A directory's entries with plain names (nothing hidden), and their
/// paths.
fn entries(dir: &Path) -> Vec<(String, PathBuf)> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let name = entry.file_name().into_string().ok()?;
            is_plain_file_name(&name).then(|| (name, entry.path()))
        })
        .collect()
}

/// The export names of the sockets directly in `dir`.
fn sockets(dir: &Path) -> Vec<String> {
    entries(dir)
        .into_iter()
        .filter_map(|(file_name, path)| {
            let name = file_name.strip_suffix(SOCKET_SUFFIX)?;
            let socket = std::fs::symlink_metadata(&path)
                .ok()?
                .file_type()
                .is_socket();
            (socket && is_plain_file_name(name)).then(|| name.to_string())
        })
        .collect()
}

/// An export name (no NUL, no control character), non-empty, no `/`, not
/// hidden (so never `.` or `..`), short enough for a file name: a socket
/// called otherwise is neither listed nor opened.
fn is_plain_file_name(name: &str) -> bool {
    export_name(name.as_bytes()).is_ok()
        && !name.is_empty()
        && !name.starts_with('.')
        && !name.contains('/')
        && name.len() + SOCKET_SUFFIX.len() <= 255
}

fn is_socket(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_socket())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn the_flag_names_an_export_its_socket_and_optionally_its_upstream_name() {
        let export: Export = "vm-1=/run/nbd/a.sock".parse().unwrap();
        assert_eq!(export.name, "vm-1");
        assert_eq!(export.socket, PathBuf::from("/run/nbd/a.sock"));
        assert_eq!(export.upstream_name, "");
        let export: Export = "db=/run/x.sock:disk0".parse().unwrap();
        assert_eq!(export.upstream_name, "disk0");
        let export: Export = "=/run/default.sock".parse().unwrap();
        assert_eq!(export.name, "");
        for bad in ["vm-1", "vm-1=", "vm-1=:name"] {
            assert!(bad.parse::<Export>().is_err(), "{bad}");
        }
        // Names no client could send are refused at start.
        for (bad, why) in [
            ("a\0b=/x.sock", NameError::Nul),
            ("a\nb=/x.sock", NameError::Control),
        ] {
            assert_eq!(
                bad.parse::<Export>(),
                Err(ExportError::Name(bad.to_string(), why))
            );
        }
    }

    #[test]
    fn a_name_given_twice_is_refused() {
        let a: Export = "a=/x.sock".parse().unwrap();
        let error = ExportTable::new(vec![a.clone(), a], None).unwrap_err();
        assert_eq!(error, ExportError::Duplicate("a".into()));
    }

    #[test]
    fn the_directory_is_read_when_asked_so_sockets_come_and_go() {
        let dir = tempfile::tempdir().unwrap();
        let fixed: Export = format!("fixed={}", dir.path().join("elsewhere").display())
            .parse()
            .unwrap();
        let table = ExportTable::new(vec![fixed], Some(dir.path().to_path_buf())).unwrap();
        assert_eq!(table.names(), ["fixed"]);
        assert!(table.lookup("b").is_none());

        let b = UnixListener::bind(dir.path().join("b.sock")).unwrap();
        let _a = UnixListener::bind(dir.path().join("a.sock")).unwrap();
        std::fs::write(dir.path().join("not-a-socket.sock"), "").unwrap();
        std::fs::write(dir.path().join("c.img"), "").unwrap();
        // A socket whose name is not an export name is not one.
        let _escape = UnixListener::bind(dir.path().join("e\x1b[2Jx.sock")).unwrap();
        assert_eq!(table.names(), ["fixed", "a", "b"]);
        assert!(table.lookup("e\x1b[2Jx").is_none());
        let found = table.lookup("b").unwrap();
        assert_eq!(found.socket, dir.path().join("b.sock"));
        assert_eq!(found.upstream_name, "");
        assert!(table.lookup("not-a-socket").is_none());

        drop(b);
        std::fs::remove_file(dir.path().join("b.sock")).unwrap();
        assert_eq!(table.names(), ["fixed", "a"]);
        assert!(table.lookup("b").is_none());
    }

    #[test]
    fn names_that_could_leave_the_directory_are_never_looked_up() {
        let outer = tempfile::tempdir().unwrap();
        let dir = outer.path().join("exports");
        std::fs::create_dir(&dir).unwrap();
        let _outside = UnixListener::bind(outer.path().join("secret.sock")).unwrap();
        let table = ExportTable::new(vec![], Some(dir)).unwrap();
        for name in [
            "../secret",
            "..",
            ".",
            "",
            "a/../../secret",
            ".hidden",
            "x\0y",
            "x\ny",
        ] {
            assert!(table.lookup(name).is_none(), "{name:?}");
        }
    }

    #[test]
    fn a_tenant_subdirectory_holds_that_tenants_exports() {
        let outer = tempfile::tempdir().unwrap();
        let dir = outer.path().join("exports");
        std::fs::create_dir_all(dir.join("team")).unwrap();
        std::fs::create_dir_all(dir.join("team-prod/deeper")).unwrap();
        std::fs::create_dir_all(dir.join(".hidden")).unwrap();
        let _db = UnixListener::bind(dir.join("team/db.sock")).unwrap();
        let _prod = UnixListener::bind(dir.join("team-prod/db.sock")).unwrap();
        let _deep = UnixListener::bind(dir.join("team-prod/deeper/x.sock")).unwrap();
        let _hidden = UnixListener::bind(dir.join(".hidden/h.sock")).unwrap();
        let _top = UnixListener::bind(dir.join("vm.sock")).unwrap();
        let _outside = UnixListener::bind(outer.path().join("secret.sock")).unwrap();
        let table = ExportTable::new(vec![], Some(dir.clone())).unwrap();
        assert_eq!(table.names(), ["team-prod/db", "team/db", "vm"]);
        let found = table.lookup("team/db").unwrap();
        assert_eq!(found.socket, dir.join("team/db.sock"));
        assert_eq!(found.name, "team/db");
        // One level only, and never a hidden or empty component.
        for name in [
            "team-prod/deeper/x",
            ".hidden/h",
            "team/",
            "/team/db",
            "team//db",
            "team/../vm",
            "../exports/vm",
            "team/.db",
        ] {
            assert!(table.lookup(name).is_none(), "{name:?}");
        }
    }
}
