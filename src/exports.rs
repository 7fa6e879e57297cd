//! Named upstreams: `--export NAME=PATH[:UPSTREAM_NAME]` and
//! `--export-dir DIR`, where every Unix socket `NAME.sock` is the export
//! NAME, and every `TENANT/NAME.sock` one directory down the export
//! `TENANT/NAME` (the form a templated policy rule `{ns}/*` grants). The
//! directory is looked at when a client names an export or asks for the
//! list, so sockets are picked up and dropped as they come and go, with
//! nothing to watch or cache.
//!
//! Whoever can write in the directory chooses what its names lead to, so
//! a name leads only to a socket that really is there: no symbolic link
//! is followed, neither a socket's nor a tenant directory's, in LIST and
//! in open alike; and optionally (`--export-dir-owner`) only to sockets
//! owned by their directory's owner and served by a process of that uid
//! (`SO_PEERCRED`). Opening walks the path by file descriptors
//! (`O_PATH|O_NOFOLLOW`, one component at a time) and connects through
//! the checked socket's own descriptor (`/proc/self/fd/N`), so what was
//! checked is what is connected to, however the directory changes
//! meanwhile.

use std::fmt;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use rustix::fs::{FileType, Mode, OFlags};
use thiserror::Error;
use tokio::net::UnixStream;

use crate::logsafe::Escaped;
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

/// Whose sockets `--export-dir` serves: `same` (the default: the
/// socket's owner must be its directory's, and its server must run as
/// that uid), a uid (directory, socket and server all that uid), or `any`
/// (only the checks against symbolic links). Strict by default: with
/// `any`, a socket any local user who can write a directory there plants
/// is served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OwnerCheck {
    Any,
    #[default]
    Same,
    Uid(u32),
}

#[derive(Debug, Error, PartialEq, Eq)]
#[error("--export-dir-owner {0:?}: expected any, same or a numeric uid")]
pub struct OwnerCheckError(String);

impl FromStr for OwnerCheck {
    type Err = OwnerCheckError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "any" => Ok(OwnerCheck::Any),
            "same" => Ok(OwnerCheck::Same),
            // A user name would be looked up in a passwd file the
            // sandbox later hides, and could be renamed: numbers only.
            _ => text
                .parse()
                .map(OwnerCheck::Uid)
                .map_err(|_| OwnerCheckError(text.to_string())),
        }
    }
}

impl fmt::Display for OwnerCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OwnerCheck::Any => f.write_str("any"),
            OwnerCheck::Same => f.write_str("same"),
            OwnerCheck::Uid(uid) => write!(f, "{uid}"),
        }
    }
}

impl OwnerCheck {
    /// The uid a socket in a directory owned by `dir_uid`, the directory
    /// itself, and the socket's server must all have; `None`: unchecked.
    fn wanted(self, dir_uid: u32) -> Option<u32> {
        match self {
            OwnerCheck::Any => None,
            OwnerCheck::Same => Some(dir_uid),
            OwnerCheck::Uid(uid) => Some(uid),
        }
    }

    /// What LIST can know without connecting: the directory's and the
    /// socket's owners.
    fn admits(self, dir_uid: u32, socket_uid: u32) -> bool {
        self.wanted(dir_uid)
            .is_none_or(|want| dir_uid == want && socket_uid == want)
    }
}

/// One export: the name clients use, the socket behind it, and the name
/// to ask that server for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Export {
    pub name: String,
    pub socket: PathBuf,
    pub upstream_name: String,
    /// Set for a socket found in `--export-dir`: connected to only
    /// through the checks (`None`: a path the operator gave).
    pub in_dir: Option<DirSocket>,
}

/// Where in `--export-dir` a socket is, and what it must pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirSocket {
    dir: PathBuf,
    tenant: Option<String>,
    /// The socket's file name, `NAME.sock`.
    file: String,
    owner: OwnerCheck,
}

/// Why a name in `--export-dir` leads nowhere.
#[derive(Debug, Error)]
pub enum CheckError {
    #[error("no such socket")]
    Missing,
    #[error("{0} is a symbolic link, which nbdgw never follows")]
    Symlink(&'static str),
    #[error("{0} is not a {1}")]
    WrongType(&'static str, &'static str),
    #[error("{what} is owned by uid {uid}, not {want} (--export-dir-owner)")]
    Owner {
        what: &'static str,
        uid: u32,
        want: u32,
    },
    #[error("its server runs as uid {uid}, not {want} (--export-dir-owner)")]
    Peer { uid: u32, want: u32 },
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl From<rustix::io::Errno> for CheckError {
    fn from(errno: rustix::io::Errno) -> Self {
        if errno == rustix::io::Errno::NOENT {
            CheckError::Missing
        } else {
            CheckError::Io(errno.into())
        }
    }
}

/// The socket file a connection was made through: its device, inode and
/// change time. A server that starts again binds a new file (a new
/// inode, or the same number reused with another change time), so this
/// tells one server's socket from the next one's at the same path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SocketFile {
    dev: u64,
    ino: u64,
    /// `st_ctime` in nanoseconds: an inode number reused by a later bind
    /// has a later one (a chmod or chown of the socket also changes it,
    /// which only costs a new generation).
    ctime_ns: i128,
}

impl SocketFile {
    fn of(stat: &rustix::fs::Stat) -> Self {
        SocketFile {
            dev: stat.st_dev,
            ino: stat.st_ino,
            ctime_ns: i128::from(stat.st_ctime) * 1_000_000_000 + i128::from(stat.st_ctime_nsec),
        }
    }

    fn of_metadata(meta: &std::fs::Metadata) -> Self {
        SocketFile {
            dev: meta.dev(),
            ino: meta.ino(),
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
        }
    }

    /// A made-up file, for tests of what keeps files apart.
    #[cfg(test)]
    pub(crate) fn test_file(ino: u64) -> Self {
        SocketFile {
            dev: 1,
            ino,
            ctime_ns: 0,
        }
    }

    /// The socket file at `path` now (following links, as connecting by
    /// path does).
    pub fn at(path: &Path) -> Option<Self> {
        std::fs::metadata(path)
            .ok()
            .filter(|m| m.file_type().is_socket())
            .map(|m| Self::of_metadata(&m))
    }
}

/// A socket that passed the checks, held open (`O_PATH`) until connected.
struct Checked {
    socket: OwnedFd,
    /// The uid its server must run as, if checked.
    peer: Option<u32>,
}

impl DirSocket {
    /// Walks to the socket one component at a time, never following a
    /// symbolic link (the export directory itself is the operator's and
    /// may be one), checking types and owners on the descriptors it holds.
    fn check(&self) -> Result<Checked, CheckError> {
        let path_only = OFlags::PATH | OFlags::CLOEXEC;
        let base = rustix::fs::open(&self.dir, path_only | OFlags::DIRECTORY, Mode::empty())?;
        let parent = match &self.tenant {
            Some(tenant) => {
                let fd =
                    rustix::fs::openat(&base, tenant, path_only | OFlags::NOFOLLOW, Mode::empty())?;
                expect_type(
                    &fd,
                    FileType::Directory,
                    "the tenant directory",
                    "directory",
                )?;
                fd
            }
            None => base,
        };
        let dir_uid = rustix::fs::fstat(&parent)?.st_uid;
        let socket = rustix::fs::openat(
            &parent,
            &self.file,
            path_only | OFlags::NOFOLLOW,
            Mode::empty(),
        )?;
        expect_type(&socket, FileType::Socket, "the socket", "socket")?;
        let socket_uid = rustix::fs::fstat(&socket)?.st_uid;
        let want = self.owner.wanted(dir_uid);
        if let Some(want) = want {
            for (what, uid) in [("its directory", dir_uid), ("the socket", socket_uid)] {
                if uid != want {
                    return Err(CheckError::Owner { what, uid, want });
                }
            }
        }
        Ok(Checked { socket, peer: want })
    }

    /// Checks, connects through the checked socket's descriptor, and
    /// checks the server's uid.
    async fn connect(&self) -> Result<(UnixStream, SocketFile), CheckError> {
        self.check()?.connect().await
    }

    /// The socket file its name leads to now, through the same checks.
    fn file_now(&self) -> Option<SocketFile> {
        let checked = self.check().ok()?;
        Some(SocketFile::of(&rustix::fs::fstat(&checked.socket).ok()?))
    }
}

impl Checked {
    async fn connect(self) -> Result<(UnixStream, SocketFile), CheckError> {
        let checked = self;
        // The inode connected to below, whatever the name leads to later.
        let file = SocketFile::of(&rustix::fs::fstat(&checked.socket)?);
        // The magic link names the very inode checked above: a socket
        // swapped in since (or a link put in its place) is not reached.
        let via = format!("/proc/self/fd/{}", checked.socket.as_raw_fd());
        let stream = UnixStream::connect(&via).await?;
        if let Some(want) = checked.peer {
            // The credentials the server had when it called listen().
            let uid = stream.peer_cred()?.uid();
            if uid != want {
                return Err(CheckError::Peer { uid, want });
            }
        }
        Ok((stream, file))
    }
}

fn expect_type(
    fd: &OwnedFd,
    wanted: FileType,
    what: &'static str,
    kind: &'static str,
) -> Result<(), CheckError> {
    match FileType::from_raw_mode(rustix::fs::fstat(fd)?.st_mode) {
        found if found == wanted => Ok(()),
        FileType::Symlink => Err(CheckError::Symlink(what)),
        _ => Err(CheckError::WrongType(what, kind)),
    }
}

/// Connects to an export's socket: a path the operator gave as it is, a
/// socket in `--export-dir` only through its checks. With the stream,
/// the socket file it was made through, when that is certain: a path
/// that led to another file after the connect than before (a server
/// starting again just then) gives `None`.
pub async fn connect(
    socket: &Path,
    in_dir: Option<&DirSocket>,
) -> Result<(UnixStream, Option<SocketFile>), CheckError> {
    match in_dir {
        Some(in_dir) => {
            let (stream, file) = in_dir.connect().await?;
            Ok((stream, Some(file)))
        }
        None => {
            // The operator's path, connected to by name (no /proc needed):
            // the same file before and after is the file connected to.
            let before = SocketFile::at(socket);
            let stream = UnixStream::connect(socket).await?;
            let after = SocketFile::at(socket);
            Ok((stream, before.filter(|_| before == after)))
        }
    }
}

/// The socket file an export's name leads to now: `None` when it leads
/// nowhere (or, in `--export-dir`, nowhere the checks allow).
pub fn socket_file_now(socket: &Path, in_dir: Option<&DirSocket>) -> Option<SocketFile> {
    match in_dir {
        Some(in_dir) => in_dir.file_now(),
        None => SocketFile::at(socket),
    }
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
            in_dir: None,
        })
    }
}

/// Which exports the operator declared immutable (`--immutable-export`,
/// `--immutable`): served read-only to every identity, and read through
/// the shared read cache. Patterns are the client's names for exports;
/// a `*` component matches any one component (`golden/*`, `*`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Immutable {
    /// Every export (`--immutable`, for a single `--upstream`).
    all: bool,
    patterns: Vec<String>,
}

#[derive(Debug, Error, PartialEq, Eq)]
#[error("--immutable-export {0:?}: {1}")]
pub struct ImmutableError(String, NameError);

impl Immutable {
    pub fn new(all: bool, patterns: Vec<String>) -> Result<Self, ImmutableError> {
        for pattern in &patterns {
            // A pattern no client name could match is a mistake.
            export_name(pattern.as_bytes()).map_err(|e| ImmutableError(pattern.clone(), e))?;
        }
        Ok(Immutable { all, patterns })
    }

    /// Whether any export is immutable (and the cache is worth having).
    pub fn any(&self) -> bool {
        self.all || !self.patterns.is_empty()
    }

    pub fn matches(&self, name: &str) -> bool {
        self.all || self.patterns.iter().any(|p| pattern_matches(p, name))
    }
}

/// Component by component: `*` matches any one component, anything else
/// itself; the counts must agree.
fn pattern_matches(pattern: &str, name: &str) -> bool {
    let (mut p, mut n) = (pattern.split('/'), name.split('/'));
    loop {
        match (p.next(), n.next()) {
            (None, None) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            _ => return false,
        }
    }
}

/// Every export the gateway routes to.
#[derive(Debug, Clone, Default)]
pub struct ExportTable {
    fixed: Vec<Export>,
    dir: Option<PathBuf>,
    owner: OwnerCheck,
    /// Sockets the owner check hid and a warning named (each once).
    hidden: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<(PathBuf, u32)>>>,
}

/// Hidden sockets warned of at most; a local user planting sockets by
/// the thousand gets one line saying the rest go unlogged.
const HIDDEN_WARNED: usize = 256;

impl ExportTable {
    pub fn new(fixed: Vec<Export>, dir: Option<PathBuf>) -> Result<Self, ExportError> {
        for (i, export) in fixed.iter().enumerate() {
            if fixed[..i].iter().any(|e| e.name == export.name) {
                return Err(ExportError::Duplicate(export.name.clone()));
            }
        }
        Ok(ExportTable {
            fixed,
            dir,
            owner: OwnerCheck::default(),
            hidden: Default::default(),
        })
    }

    /// Serves only the directory's sockets that pass `owner`.
    pub fn with_owner_check(mut self, owner: OwnerCheck) -> Self {
        self.owner = owner;
        self
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
    /// directory (`NAME`) or in one of its subdirectories (`TENANT/NAME`)
    /// that passes the checks connecting will make again. A name that
    /// could step out of the directory is never looked up there: each
    /// component must be a plain file name.
    pub fn lookup(&self, name: &str) -> Option<Export> {
        if let Some(export) = self.fixed.iter().find(|e| e.name == name) {
            return Some(export.clone());
        }
        let dir = self.dir.as_ref()?;
        let (tenant, file) = match name.split_once('/') {
            Some((tenant, file)) if is_plain_file_name(tenant) => (Some(tenant), file),
            Some(_) => return None,
            None => (None, name),
        };
        if !is_plain_file_name(file) {
            return None;
        }
        let in_dir = DirSocket {
            dir: dir.clone(),
            tenant: tenant.map(str::to_string),
            file: format!("{file}{SOCKET_SUFFIX}"),
            owner: self.owner,
        };
        match in_dir.check() {
            Ok(_) => {}
            Err(CheckError::Missing) => return None,
            Err(why) => {
                // A name someone put there that leads nowhere it may:
                // worth the operator's eye, and answered as unknown.
                tracing::info!(export = %Escaped(name), %why, "export-dir: not served");
                return None;
            }
        }
        let mut socket = tenant.map_or_else(|| dir.clone(), |t| dir.join(t));
        socket.push(&in_dir.file);
        Some(Export {
            name: name.to_string(),
            socket,
            upstream_name: String::new(),
            in_dir: Some(in_dir),
        })
    }

    /// Every export's name, fixed ones first, then the directory's
    /// (its subdirectories' as `TENANT/NAME`) sorted; by the same rules as
    /// `lookup` (no symbolic link, owners as `--export-dir-owner` says),
    /// so that LIST shows what can be opened.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.fixed.iter().map(|e| e.name.clone()).collect();
        let mut found = Vec::new();
        if let Some(dir) = &self.dir {
            for (tenant, path) in entries(dir) {
                // lstat: a link to a directory is not a tenant directory.
                match std::fs::symlink_metadata(&path) {
                    Ok(meta) if meta.is_dir() => found.extend(
                        self.sockets(&path, meta.uid())
                            .into_iter()
                            .map(|name| format!("{tenant}/{name}")),
                    ),
                    _ => {}
                }
            }
            // The export directory itself may be a link (the operator's).
            if let Ok(meta) = std::fs::metadata(dir) {
                found.extend(self.sockets(dir, meta.uid()));
            }
        }
        found.retain(|name| !names.contains(name));
        found.sort();
        names.append(&mut found);
        names
    }

    /// The export names of the sockets directly in `dir`, owned by
    /// `dir_uid`, that the owner check admits.
    fn sockets(&self, dir: &Path, dir_uid: u32) -> Vec<String> {
        entries(dir)
            .into_iter()
            .filter_map(|(file_name, path)| {
                let name = file_name.strip_suffix(SOCKET_SUFFIX)?;
                let meta = std::fs::symlink_metadata(&path).ok()?;
                if !meta.file_type().is_socket() || !is_plain_file_name(name) {
                    return None;
                }
                if !self.owner.admits(dir_uid, meta.uid()) {
                    self.warn_hidden(&path, dir_uid, meta.uid());
                    return None;
                }
                Some(name.to_string())
            })
            .collect()
    }
}

impl ExportTable {
    /// A socket the owner check hides is logged once at WARN (at start
    /// and whenever a listing finds it): since `same` became the default,
    /// a deployment whose servers run as another user than the directory's
    /// owner would otherwise just see its exports vanish.
    fn warn_hidden(&self, path: &Path, dir_uid: u32, uid: u32) {
        let mut hidden = self.hidden.lock().unwrap_or_else(|e| e.into_inner());
        let key = (path.to_path_buf(), uid);
        if hidden.len() > HIDDEN_WARNED || hidden.contains(&key) {
            return;
        }
        if hidden.len() == HIDDEN_WARNED {
            hidden.insert(key);
            tracing::warn!(
                "export-dir: more sockets hidden by the owner check; not logged further"
            );
            return;
        }
        hidden.insert(key);
        tracing::warn!(
            socket = %Escaped(&path.display().to_string()),
            socket_uid = uid,
            dir_uid,
            owner = %self.owner,
            "export-dir: socket not served, its owner fails --export-dir-owner; if its server is trusted, run it as the directory's owner, or pass --export-dir-owner UID (that uid's directories only) or --export-dir-owner any"
        );
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
    fn immutable_patterns_match_whole_components() {
        let immutable = Immutable::new(false, vec!["golden".into(), "base/*".into()]).unwrap();
        assert!(immutable.any());
        for name in ["golden", "base/x", "base/golden"] {
            assert!(immutable.matches(name), "{name}");
        }
        for name in [
            "", "golden2", "golde", "base", "base/x/y", "other/x", "x/golden",
        ] {
            assert!(!immutable.matches(name), "{name}");
        }
        assert!(Immutable::new(true, vec![])
            .unwrap()
            .matches("anything/at/all"));
        assert!(!Immutable::default().any());
        assert!(!Immutable::default().matches(""));
        assert!(Immutable::new(false, vec!["a\nb".into()]).is_err());
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

    #[test]
    fn the_owner_flag_takes_any_same_or_a_uid() {
        assert_eq!("any".parse(), Ok(OwnerCheck::Any));
        assert_eq!("same".parse(), Ok(OwnerCheck::Same));
        assert_eq!("65534".parse(), Ok(OwnerCheck::Uid(65534)));
        for bad in ["", "nobody", "-1", "same "] {
            assert!(bad.parse::<OwnerCheck>().is_err(), "{bad:?}");
        }
        assert_eq!(OwnerCheck::Uid(7).to_string(), "7");
    }

    #[test]
    fn symbolic_links_are_neither_listed_nor_looked_up() {
        let outer = tempfile::tempdir().unwrap();
        let dir = outer.path().join("exports");
        std::fs::create_dir_all(dir.join("team")).unwrap();
        let _db = UnixListener::bind(dir.join("team/db.sock")).unwrap();
        let _outside = UnixListener::bind(outer.path().join("secret.sock")).unwrap();
        std::os::unix::fs::symlink(outer.path().join("secret.sock"), dir.join("x.sock")).unwrap();
        std::os::unix::fs::symlink("db.sock", dir.join("team/alias.sock")).unwrap();
        std::os::unix::fs::symlink("team", dir.join("evil")).unwrap();
        let table = ExportTable::new(vec![], Some(dir)).unwrap();
        assert_eq!(table.names(), ["team/db"]);
        for name in ["x", "team/alias", "evil/db", "evil/alias"] {
            assert!(table.lookup(name).is_none(), "{name}");
        }
        assert!(table.lookup("team/db").is_some());
    }

    #[test]
    fn the_owner_check_lists_and_looks_up_alike() {
        use std::os::unix::fs::lchown;
        let outer = tempfile::tempdir().unwrap();
        let dir = outer.path().join("exports");
        std::fs::create_dir_all(dir.join("a")).unwrap();
        std::fs::create_dir_all(dir.join("b")).unwrap();
        let _a = UnixListener::bind(dir.join("a/disk.sock")).unwrap();
        let _b = UnixListener::bind(dir.join("b/disk.sock")).unwrap();
        let _top = UnixListener::bind(dir.join("top.sock")).unwrap();
        // Chown needs root (the test suite runs as root; elsewhere the
        // owners cannot be made to differ, and this checks nothing).
        let me = std::fs::metadata(&dir).unwrap().uid();
        let other = me.wrapping_add(4242);
        if lchown(dir.join("b/disk.sock"), Some(other), None).is_err() {
            return;
        }
        lchown(dir.join("a"), Some(other), None).unwrap();
        lchown(dir.join("a/disk.sock"), Some(other), None).unwrap();
        let table = |owner| {
            ExportTable::new(vec![], Some(dir.clone()))
                .unwrap()
                .with_owner_check(owner)
        };
        let served = |owner| {
            let table = table(owner);
            let listed = table.names();
            for name in ["a/disk", "b/disk", "top"] {
                let found = table.lookup(name).is_some();
                assert_eq!(found, listed.iter().any(|n| n == name), "{owner} {name}");
            }
            listed
        };
        assert_eq!(served(OwnerCheck::Any), ["a/disk", "b/disk", "top"]);
        // b's socket is not its directory owner's.
        assert_eq!(served(OwnerCheck::Same), ["a/disk", "top"]);
        // a's directory and socket are the other uid's; top is mine,
        // in my directory.
        assert_eq!(served(OwnerCheck::Uid(other)), ["a/disk"]);
        assert_eq!(served(OwnerCheck::Uid(me)), ["top"]);
    }

    #[tokio::test]
    async fn what_was_checked_is_what_is_connected_to() {
        let dir = tempfile::tempdir().unwrap();
        let real = std::os::unix::net::UnixListener::bind(dir.path().join("db.sock")).unwrap();
        let decoy = std::os::unix::net::UnixListener::bind(dir.path().join("decoy.sock")).unwrap();
        real.set_nonblocking(true).unwrap();
        decoy.set_nonblocking(true).unwrap();
        let in_dir = DirSocket {
            dir: dir.path().to_path_buf(),
            tenant: None,
            file: "db.sock".into(),
            owner: OwnerCheck::Same,
        };
        let checked = in_dir.check().unwrap();
        // Between the check and the connect, the name is made a link to
        // another socket.
        std::fs::remove_file(dir.path().join("db.sock")).unwrap();
        std::os::unix::fs::symlink("decoy.sock", dir.path().join("db.sock")).unwrap();
        let (_stream, file) = checked.connect().await.unwrap();
        assert!(
            real.accept().is_ok(),
            "the checked socket got the connection"
        );
        assert!(decoy.accept().is_err(), "the decoy got none");
        // Checked afresh, the link is refused.
        assert!(matches!(in_dir.check(), Err(CheckError::Symlink(_))));
        // The file it names is the one connected to, not the decoy, and
        // the name leads to no file the checks allow now.
        assert_ne!(Some(file), SocketFile::at(&dir.path().join("decoy.sock")));
        assert_eq!(in_dir.file_now(), None);
    }

    /// A server started again at the same path binds a new socket file,
    /// told from the old one although ext4 hands the unlinked inode's
    /// number to the new one (as it did here): its change time differs.
    #[test]
    fn a_socket_bound_again_at_the_same_path_is_another_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sock");
        // Made first, so that it does not take the freed inode.
        let probe = dir.path().join("probe");
        std::fs::write(&probe, "").unwrap();
        let first = UnixListener::bind(&path).unwrap();
        let before = SocketFile::at(&path).unwrap();
        drop(first);
        std::fs::remove_file(&path).unwrap();
        // Kernels before 6.13 stamp a change time from a clock that moves
        // a few milliseconds at a time: a bind within the same tick is
        // not told apart (the README says so). Wait for the tick to pass,
        // seen on a file touched now.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            std::fs::write(&probe, "").unwrap();
            let now = std::fs::metadata(&probe).unwrap();
            let now_ns = i128::from(now.ctime()) * 1_000_000_000 + i128::from(now.ctime_nsec());
            if now_ns > before.ctime_ns {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the clock never moved"
            );
            std::thread::yield_now();
        }
        let _second = UnixListener::bind(&path).unwrap();
        let after = SocketFile::at(&path).unwrap();
        assert_ne!(before, after);
    }

    #[test]
    fn a_socket_file_is_found_only_where_a_socket_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sock");
        let first = UnixListener::bind(&path).unwrap();
        let before = SocketFile::at(&path).unwrap();
        assert_eq!(SocketFile::at(&path), Some(before));
        drop(first);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(SocketFile::at(&path), None);
        std::fs::write(dir.path().join("plain"), "").unwrap();
        assert_eq!(SocketFile::at(&dir.path().join("plain")), None);
    }
}
