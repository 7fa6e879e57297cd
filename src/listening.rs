//! Whether a Unix socket file has a listener, asked of the kernel instead
//! of the server: the readiness check must not connect, because every
//! connection is a client to the NBD server behind it. qemu-nbd 7.2 and
//! nbdkit 1.32 log an error for each connection that hangs up before the
//! handshake ends, and a connection counts against qemu-nbd's `--shared`
//! while it lasts.
//!
//! The kernel's sock_diag (NETLINK_SOCK_DIAG, `net/unix/diag.c`) lists the
//! listening Unix sockets of this network namespace with the device and
//! inode of the file each is bound to (`UDIAG_SHOW_VFS`). Matching the
//! socket file's own device and inode, rather than its path as
//! /proc/net/unix prints it, is right however the path was spelt at bind
//! (relative, through a symlink, from another mount namespace as a pod's
//! other container), and a stale file left by a server that died has no
//! listener at all. Only a listening SOCK_STREAM socket counts, and only
//! if this process may connect to the file (write permission; Landlock
//! and other LSMs are not seen). Needs AF_NETLINK (systemd's
//! RestrictAddressFamilies) and is blind to listeners in another network
//! namespace: the caller falls back to `visit` then, a whole NBD
//! handshake ended by NBD_OPT_ABORT.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use nix::sys::socket::{
    recvfrom, sendto, setsockopt, socket, sockopt, AddressFamily, MsgFlags, NetlinkAddr, SockFlag,
    SockProtocol, SockType,
};
use nix::sys::time::TimeVal;

/// What sock_diag said about a socket file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// A socket of this network namespace listens on the file.
    Found,
    /// None of this network namespace does (a stale file, a server that
    /// has bound but not yet listened, or one in another namespace).
    NotHere,
}

/// The file behind `path` (symlinks followed) as sock_diag names it:
/// the kernel's device encoding (major << 20 | minor, `s_dev`) and the
/// inode's low 32 bits (`unix_diag_vfs` has no room for more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    pub dev: u32,
    pub ino: u32,
    /// The device of the file's mount (`/proc/self/mountinfo`), where it
    /// differs from stat's: btrfs reports a subvolume's own device, and
    /// overlayfs the device of the layer that holds the file, while
    /// sock_diag reports the superblock's, as mountinfo does.
    pub mount_dev: Option<u32>,
}

impl FileId {
    /// `Err` with `InvalidInput` when the path exists but is no socket.
    pub fn of(path: &Path) -> io::Result<FileId> {
        let meta = std::fs::metadata(path)?;
        if !meta.file_type().is_socket() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a socket"));
        }
        let dev = meta.dev();
        let dev = kernel_dev(rustix::fs::major(dev), rustix::fs::minor(dev));
        Ok(FileId {
            dev,
            ino: meta.ino() as u32,
            mount_dev: mount_dev_of(path).filter(|&mount| mount != dev),
        })
    }

    /// Whether sock_diag's device and inode are this file's.
    fn is(&self, dev: u32, ino: u32) -> bool {
        ino == self.ino && (dev == self.dev || Some(dev) == self.mount_dev)
    }
}

fn kernel_dev(major: u32, minor: u32) -> u32 {
    (major << 20) | (minor & 0xf_ffff)
}

/// The superblock device of the mount holding `path`: statx's mount id
/// looked up in /proc/self/mountinfo. `None` where either is missing
/// (before Linux 5.8, no /proc): stat's device is used alone then.
fn mount_dev_of(path: &Path) -> Option<u32> {
    use rustix::fs::{statx, AtFlags, StatxFlags, CWD};
    let stx = statx(CWD, path, AtFlags::empty(), StatxFlags::MNT_ID).ok()?;
    if stx.stx_mask & StatxFlags::MNT_ID.bits() == 0 {
        return None;
    }
    mount_dev_in(&read_mountinfo()?, stx.stx_mnt_id)
}

/// /proc/self/mountinfo, opened before the Landlock sandbox, which does
/// not let the process open it afterwards.
static MOUNTINFO: OnceLock<Option<File>> = OnceLock::new();

/// Opens /proc/self/mountinfo for the readiness check's later reads;
/// called before the process sandboxes itself.
pub fn keep_mountinfo() {
    MOUNTINFO.get_or_init(|| File::open("/proc/self/mountinfo").ok());
}

/// The mount table as it is now: a kept descriptor is read again from
/// offset 0, which makes the kernel's seq_file start over.
fn read_mountinfo() -> Option<String> {
    let Some(Some(file)) = MOUNTINFO.get() else {
        return std::fs::read_to_string("/proc/self/mountinfo").ok();
    };
    let (mut text, mut chunk) = (Vec::new(), vec![0u8; 16 << 10]);
    loop {
        match file.read_at(&mut chunk, text.len() as u64).ok()? {
            0 => return String::from_utf8(text).ok(),
            n => text.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Field 1 of a mountinfo line is the mount id, field 3 `major:minor`.
fn mount_dev_in(mountinfo: &str, mount_id: u64) -> Option<u32> {
    mountinfo.lines().find_map(|line| {
        let mut fields = line.split(' ');
        if fields.next()?.parse::<u64>().ok()? != mount_id {
            return None;
        }
        let (major, minor) = fields.nth(1)?.split_once(':')?;
        Some(kernel_dev(major.parse().ok()?, minor.parse().ok()?))
    })
}

/// What the kernel says of the upstream socket file, for the readiness
/// check; asked without connecting.
#[derive(Debug)]
pub enum Look {
    /// A listener of this network namespace that this process may
    /// connect to, as far as file permissions go.
    Ready,
    /// Not ready, and why (for the log).
    Problem(String),
    /// sock_diag saw no listener on the file: a stale file, or one in
    /// another network namespace, or a filesystem it cannot be matched on.
    NotHere,
    /// sock_diag could not be asked.
    NoDiag(io::Error),
}

/// Looks at `path`: its file, its listener and the right to connect.
/// Blocking (a stat, a netlink dump, /proc/self/mountinfo).
pub fn look(path: &Path) -> Look {
    let file = match FileId::of(path) {
        Ok(file) => file,
        Err(e) => return Look::Problem(format!("{}: {e}", path.display())),
    };
    match listener_of(file) {
        Ok(Listener::Found) => match may_connect(path) {
            Ok(()) => Look::Ready,
            Err(e) => Look::Problem(format!(
                "{}: has a listener, but this process may not connect to it ({e})",
                path.display()
            )),
        },
        Ok(Listener::NotHere) => Look::NotHere,
        Err(e) => Look::NoDiag(e),
    }
}

/// connect(2) to a Unix socket file needs write permission on the file
/// (`unix_find_bsd` in net/unix/af_unix.c asks `path_permission(MAY_WRITE)`),
/// judged with the effective ids as connect judges it. Landlock and other
/// LSMs that refuse a connect are not seen here.
fn may_connect(path: &Path) -> io::Result<()> {
    use rustix::fs::{accessat, Access, AtFlags, CWD};
    accessat(CWD, path, Access::WRITE_OK, AtFlags::EACCESS).map_err(io::Error::from)
}

/// The readiness check's fallback where sock_diag cannot answer: a
/// whole, clean NBD visit, which NBD servers do not log as an error
/// (qemu-nbd 7.2 and nbdkit 1.32 log a connection that hangs up before
/// the handshake ends). Reads the greeting, sends the client flags the
/// server offers, NBD_OPT_ABORT, and waits for the answer or the close.
/// Blocking, bounded by `within` for each read and write.
pub fn visit(path: &Path, within: Duration) -> io::Result<()> {
    use crate::proto::consts::*;
    let mut stream = UnixStream::connect(path)?;
    stream.set_read_timeout(Some(within))?;
    stream.set_write_timeout(Some(within))?;
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting)?;
    if greeting[0..8] != NBDMAGIC.to_be_bytes() || greeting[8..16] != IHAVEOPT.to_be_bytes() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "no NBD fixed-newstyle greeting",
        ));
    }
    let offered = u16::from_be_bytes([greeting[16], greeting[17]]);
    let flags = u32::from(offered & (FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
    let mut abort = [0u8; 20];
    abort[0..4].copy_from_slice(&flags.to_be_bytes());
    abort[4..12].copy_from_slice(&IHAVEOPT.to_be_bytes());
    abort[12..16].copy_from_slice(&OPT_ABORT.to_be_bytes());
    stream.write_all(&abort)?;
    // Waits for the answer (an ACK) or the close, so that the server has
    // ended the visit before this side hangs up. The server has greeted:
    // it is there, whatever comes now.
    let mut reply = [0u8; 20];
    let _ = stream.read_exact(&mut reply);
    Ok(())
}

/// Asks sock_diag whether a listening socket is bound to `file`. An
/// `Err` means sock_diag could not be asked (no AF_NETLINK, no
/// unix_diag in the kernel) or answered something unreadable.
pub fn listener_of(file: FileId) -> io::Result<Listener> {
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkSockDiag,
    )?;
    // The kernel answers a dump at once; bounded all the same, since the
    // readiness check waits for it.
    setsockopt(&fd, sockopt::ReceiveTimeout, &TimeVal::new(2, 0))?;
    sendto(
        fd.as_raw_fd(),
        &dump_request(),
        &NetlinkAddr::new(0, 0),
        MsgFlags::empty(),
    )?;
    // A dump arrives as datagrams of at most 32 KiB each (netlink_dump).
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let (n, from) = recvfrom::<NetlinkAddr>(fd.as_raw_fd(), &mut buf)?;
        // Only the kernel (port 0) answers; another process could send to
        // this socket's port.
        if from.is_some_and(|from| from.pid() != 0) {
            continue;
        }
        if n == 0 {
            return Err(bad("the dump ended without NLMSG_DONE"));
        }
        // The first match is enough: closing the socket drops the rest
        // of the dump, and with many listeners the rest is most of it.
        match scan(&buf[..n], file)? {
            Scan::More { seen: false } => continue,
            Scan::More { seen: true } | Scan::Done { seen: true } => return Ok(Listener::Found),
            Scan::Done { seen: false } => return Ok(Listener::NotHere),
        }
    }
}

const NLMSG_HDR: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
/// Set on a dump's messages when the table changed while it was read.
const NLM_F_DUMP_INTR: u16 = 0x10;
/// The request's sequence number, which every answer carries.
const SEQ: u32 = 1;
/// `TCP_LISTEN`, the state af_unix gives a listening socket.
const TCP_LISTEN: u32 = 10;
const UDIAG_SHOW_VFS: u32 = 0x2;
const UNIX_DIAG_VFS: u16 = 1;
/// `unix_diag_msg`: family, type, state, pad, inode, cookie.
const UNIX_DIAG_MSG: usize = 16;

/// `nlmsghdr` and `unix_diag_req`: every listening Unix socket, with
/// the device and inode of its file.
fn dump_request() -> [u8; 40] {
    let mut req = [0u8; 40];
    req[0..4].copy_from_slice(&40u32.to_ne_bytes());
    req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    req[8..12].copy_from_slice(&SEQ.to_ne_bytes());
    req[16] = nix::libc::AF_UNIX as u8;
    req[20..24].copy_from_slice(&(1u32 << TCP_LISTEN).to_ne_bytes());
    req[28..32].copy_from_slice(&UDIAG_SHOW_VFS.to_ne_bytes());
    req
}

#[derive(Debug, PartialEq, Eq)]
enum Scan {
    More { seen: bool },
    Done { seen: bool },
}

fn u16_at(buf: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(buf.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(buf: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(buf.get(at..at + 4)?.try_into().ok()?))
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("sock_diag: {what}"))
}

/// One datagram of the dump: whether one of its sockets is `file`'s,
/// and whether the dump ended with it.
fn scan(datagram: &[u8], file: FileId) -> io::Result<Scan> {
    let mut seen = false;
    let mut at = 0;
    while at + NLMSG_HDR <= datagram.len() {
        let len = u32_at(datagram, at).ok_or_else(|| bad("short header"))? as usize;
        let kind = u16_at(datagram, at + 4).ok_or_else(|| bad("short header"))?;
        let flags = u16_at(datagram, at + 6).ok_or_else(|| bad("short header"))?;
        let seq = u32_at(datagram, at + 8).ok_or_else(|| bad("short header"))?;
        let end = at.checked_add(len).filter(|&end| end <= datagram.len());
        let Some(end) = end.filter(|_| len >= NLMSG_HDR) else {
            return Err(bad("message length out of bounds"));
        };
        if seq != SEQ {
            return Err(bad("an answer to another request"));
        }
        // An interrupted dump may have skipped the very socket asked for.
        if flags & NLM_F_DUMP_INTR != 0 {
            return Err(bad("the dump was interrupted"));
        }
        let message = &datagram[at + NLMSG_HDR..end];
        match kind {
            // NLMSG_DONE carries the dump's error, if it failed.
            NLMSG_DONE | NLMSG_ERROR => {
                let code = u32_at(message, 0).ok_or_else(|| bad("short error"))? as i32;
                if code < 0 {
                    return Err(io::Error::from_raw_os_error(code.saturating_neg()));
                }
                if kind == NLMSG_ERROR {
                    return Err(bad("an acknowledgement instead of a dump"));
                }
                return Ok(Scan::Done { seen });
            }
            SOCK_DIAG_BY_FAMILY => {
                seen |= is_stream_listener(message)?
                    && vfs_of(message)?.is_some_and(|(dev, ino)| file.is(dev, ino))
            }
            _ => return Err(bad("unexpected message type")),
        }
        at += align4(len);
    }
    Ok(Scan::More { seen })
}

/// Whether one socket of the dump is a listening stream socket, as NBD
/// needs. The kernel's filter on the state asked for (`udiag_states`)
/// is not relied on, and a SOCK_SEQPACKET listener passes that filter
/// but refuses a stream connection (EPROTOTYPE).
fn is_stream_listener(message: &[u8]) -> io::Result<bool> {
    match message.get(1..3) {
        Some(&[kind, state]) => {
            Ok(i32::from(kind) == nix::libc::SOCK_STREAM && u32::from(state) == TCP_LISTEN)
        }
        _ => Err(bad("short unix_diag_msg")),
    }
}

/// The `UNIX_DIAG_VFS` attribute of one socket, if it has one (a socket
/// bound in the abstract namespace or not at all has none).
fn vfs_of(message: &[u8]) -> io::Result<Option<(u32, u32)>> {
    let mut at = UNIX_DIAG_MSG;
    while at + 4 <= message.len() {
        let len = u16_at(message, at).unwrap_or(0) as usize;
        let kind = u16_at(message, at + 2).unwrap_or(0);
        if len < 4 || at + len > message.len() {
            return Err(bad("attribute length out of bounds"));
        }
        if kind == UNIX_DIAG_VFS {
            let (ino, dev) = (u32_at(message, at + 4), u32_at(message, at + 8));
            return match (ino, dev) {
                (Some(ino), Some(dev)) if len >= 12 => Ok(Some((dev, ino))),
                _ => Err(bad("short UNIX_DIAG_VFS")),
            };
        }
        at += align4(len);
    }
    Ok(None)
}

fn align4(len: usize) -> usize {
    (len + 3) & !3
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::{UnixDatagram, UnixListener};

    fn dir() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    #[test]
    fn a_listening_socket_is_found_by_its_file() {
        let dir = dir();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let file = FileId::of(&path).unwrap();
        assert_eq!(listener_of(file).unwrap(), Listener::Found);
        // Through a symlink, as a pod's other container may spell it.
        let link = dir.path().join("link.sock");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert_eq!(FileId::of(&link).unwrap(), file);
        drop(listener);
        // The file stays behind with no listener: stale.
        assert_eq!(listener_of(file).unwrap(), Listener::NotHere);
    }

    #[test]
    fn a_socket_bound_but_not_listening_is_not_a_listener() {
        let dir = dir();
        let path = dir.path().join("d.sock");
        let _bound = UnixDatagram::bind(&path).unwrap();
        assert_eq!(
            listener_of(FileId::of(&path).unwrap()).unwrap(),
            Listener::NotHere
        );
    }

    /// A listener of the wrong type passes the kernel's state filter but
    /// refuses every NBD client (EPROTOTYPE).
    #[test]
    fn a_seqpacket_listener_is_not_an_nbd_listener() {
        use nix::sys::socket::{bind, listen, Backlog, UnixAddr};
        let dir = dir();
        let path = dir.path().join("p.sock");
        let fd = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        bind(fd.as_raw_fd(), &UnixAddr::new(&path).unwrap()).unwrap();
        listen(&fd, Backlog::new(1).unwrap()).unwrap();
        assert_eq!(
            listener_of(FileId::of(&path).unwrap()).unwrap(),
            Listener::NotHere
        );
    }

    #[test]
    fn the_mount_device_is_read_from_mountinfo() {
        let mountinfo = "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n\
                         57 22 0:53 / /merged rw - overlay overlay rw,lowerdir=/l\n";
        assert_eq!(mount_dev_in(mountinfo, 57), Some(53));
        assert_eq!(mount_dev_in(mountinfo, 22), Some((8 << 20) | 1));
        assert_eq!(mount_dev_in(mountinfo, 9), None);
        let file = FileId {
            dev: 54,
            ino: 8,
            mount_dev: Some(53),
        };
        assert!(file.is(53, 8) && file.is(54, 8) && !file.is(53, 9));
    }

    #[test]
    fn a_regular_file_is_no_socket() {
        let dir = dir();
        let path = dir.path().join("plain");
        std::fs::write(&path, b"x").unwrap();
        let err = FileId::of(&path).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn a_truncated_or_lying_dump_is_an_error_not_a_listener() {
        let file = FileId {
            dev: 1,
            ino: 2,
            mount_dev: None,
        };
        let mut msg = vec![0u8; 16 + UNIX_DIAG_MSG + 12];
        let len = msg.len() as u32;
        msg[0..4].copy_from_slice(&(len + 4).to_ne_bytes());
        msg[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        msg[8..12].copy_from_slice(&SEQ.to_ne_bytes());
        // A listening stream socket (udiag_type, udiag_state).
        msg[17] = nix::libc::SOCK_STREAM as u8;
        msg[18] = TCP_LISTEN as u8;
        assert!(scan(&msg, file).is_err());
        msg[0..4].copy_from_slice(&len.to_ne_bytes());
        // An attribute that claims more than the message holds.
        msg[32..34].copy_from_slice(&200u16.to_ne_bytes());
        assert!(scan(&msg, file).is_err());
        // A well-formed VFS attribute naming the file.
        msg[32..34].copy_from_slice(&12u16.to_ne_bytes());
        msg[34..36].copy_from_slice(&UNIX_DIAG_VFS.to_ne_bytes());
        msg[36..40].copy_from_slice(&2u32.to_ne_bytes());
        msg[40..44].copy_from_slice(&1u32.to_ne_bytes());
        assert_eq!(scan(&msg, file).unwrap(), Scan::More { seen: true });
        // The same file, but a socket not listening: not counted.
        msg[18] = 7;
        assert_eq!(scan(&msg, file).unwrap(), Scan::More { seen: false });
        msg[18] = TCP_LISTEN as u8;
        // Interrupted, or answering another request: an error, never a
        // "no listener".
        msg[6..8].copy_from_slice(&NLM_F_DUMP_INTR.to_ne_bytes());
        assert!(scan(&msg, file).is_err());
        msg[6..8].copy_from_slice(&0u16.to_ne_bytes());
        msg[8..12].copy_from_slice(&7u32.to_ne_bytes());
        assert!(scan(&msg, file).is_err());
    }

    /// A dump that failed ends with its error in NLMSG_DONE.
    #[test]
    fn a_failed_dump_is_an_error_not_a_missing_listener() {
        let mut done = [0u8; 20];
        done[0..4].copy_from_slice(&20u32.to_ne_bytes());
        done[4..6].copy_from_slice(&NLMSG_DONE.to_ne_bytes());
        done[8..12].copy_from_slice(&SEQ.to_ne_bytes());
        let file = FileId {
            dev: 1,
            ino: 2,
            mount_dev: None,
        };
        assert_eq!(scan(&done, file).unwrap(), Scan::Done { seen: false });
        done[16..20].copy_from_slice(&(-nix::libc::ENOBUFS).to_ne_bytes());
        let err = scan(&done, file).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(nix::libc::ENOBUFS));
    }
}
