//! systemd's notification socket, for what the sd-notify crate does not
//! send without its `fdstore` feature's extra dependency: descriptors
//! (FDSTORE=1), removals (FDSTOREREMOVE=1) and the barrier
//! (sd_notify_barrier(3)).

use std::ffi::OsString;
use std::io::{self, IoSlice, Read};
use std::mem::MaybeUninit;
use std::os::fd::BorrowedFd;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::time::Duration;

use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

/// Descriptors in one message: a session's three.
const MAX_FDS: usize = 3;

/// Where notifications go: NOTIFY_SOCKET, or (tests) a socket of theirs.
pub struct Notifier {
    path: Option<OsString>,
}

impl Notifier {
    pub fn from_env() -> Self {
        Notifier {
            path: std::env::var_os("NOTIFY_SOCKET"),
        }
    }

    pub fn at(path: impl Into<OsString>) -> Self {
        Notifier {
            path: Some(path.into()),
        }
    }

    pub fn present(&self) -> bool {
        self.path.is_some()
    }

    /// `fds` stored under `name`, in one message: all of them or none.
    pub fn store(&self, name: &str, fds: &[BorrowedFd]) -> io::Result<()> {
        self.send(&format!("FDSTORE=1\nFDNAME={name}\n"), fds)
    }

    /// Every descriptor stored under `name` closed by systemd.
    pub fn remove(&self, name: &str) -> io::Result<()> {
        self.send(&format!("FDSTOREREMOVE=1\nFDNAME={name}\n"), &[])
    }

    /// Returns once systemd has processed every message sent before it
    /// (it closes the descriptor the barrier carries), or at `timeout`:
    /// a message still queued when its sender is gone may be dropped.
    pub fn barrier(&self, timeout: Duration) -> io::Result<()> {
        let (mut ours, theirs) = UnixStream::pair()?;
        self.send("BARRIER=1\n", &[std::os::fd::AsFd::as_fd(&theirs)])?;
        drop(theirs);
        ours.set_read_timeout(Some(timeout))?;
        let mut byte = [0u8; 1];
        match ours.read(&mut byte)? {
            0 => Ok(()),
            _ => Err(io::Error::other("bytes on the barrier")),
        }
    }

    fn send(&self, text: &str, fds: &[BorrowedFd]) -> io::Result<()> {
        let Some(path) = &self.path else {
            return Err(io::Error::other("NOTIFY_SOCKET is not set"));
        };
        assert!(fds.len() <= MAX_FDS);
        let socket = UnixDatagram::unbound()?;
        connect(&socket, path)?;
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() {
            control.push(SendAncillaryMessage::ScmRights(fds));
        }
        let iov = [IoSlice::new(text.as_bytes())];
        let sent = sendmsg(&socket, &iov, &mut control, SendFlags::NOSIGNAL)?;
        if sent != text.len() {
            return Err(io::ErrorKind::WriteZero.into());
        }
        Ok(())
    }
}

/// A path, or `@NAME` for an abstract socket.
fn connect(socket: &UnixDatagram, path: &OsString) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    match path.as_bytes().strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            socket.connect_addr(&addr)
        }
        None => socket.connect(path),
    }
}
