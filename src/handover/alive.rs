//! Whether the process at the other end of the hand-over is still there:
//! a bare end of the channel is a death only if it is gone, since every
//! deliberate give-up says Refuse first.
//!
//! A peer is watched by a pidfd, which names one process whatever the
//! pid namespaces and is never recycled. The predecessor takes it from
//! the kernel, not from the successor's Hello (review round 2, M2): the
//! pid a successor can say is the one of its own pid namespace, which in
//! a container is 1 and names another process here (or none).
//!
//! A peer that cannot be watched (no pidfd: not visible from this pid
//! namespace, gone before it could be opened, a kernel without
//! pidfd_open, EMFILE) counts as gone. Both callers decide about
//! listening sockets on a bare end, and "gone" makes each keep or take
//! them: at worst two processes accept on one socket, both correct
//! gateways, where "alive" could leave nothing accepting.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use nix::libc;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::{fcntl_setfd, Errno, FdFlags};
use rustix::process::{pidfd_open, Pid, PidfdFlags};

/// The peer process, by a pidfd opened when it was learnt (so that a
/// later reuse of its pid is not mistaken for it); None if it cannot be
/// watched.
pub struct Peer {
    pidfd: Option<OwnedFd>,
}

impl Peer {
    /// The process at the other end of a connected Unix socket, as the
    /// kernel recorded it at connect(): SO_PEERPIDFD (Linux 6.5) names
    /// it in any pid namespace; before 6.5, SO_PEERCRED's pid, which the
    /// kernel gives in this process's pid namespace (0 if it is not
    /// visible here), opened at once (a window of a few system calls in
    /// which the peer would have to die and its pid be reused).
    pub fn of_socket(stream: &impl AsFd) -> Self {
        let pidfd = peer_pidfd(stream).ok().or_else(|| {
            let (pid, _) = peer_cred(stream).ok()?;
            Peer::open(u32::try_from(pid).ok()?)
        });
        Peer { pidfd }
    }

    /// The successor's view of its predecessor: the pidfd the
    /// predecessor sent of itself with Chosen (review round 2, R1). A
    /// pid it says cannot be watched: in a container it is 1, another
    /// process here; a listening socket's SO_PEERCRED names whoever first
    /// listened on it. No pidfd: counted as gone.
    pub fn of_pidfd(pidfd: Option<OwnedFd>) -> Self {
        Peer { pidfd }
    }

    /// `pid` in this pid namespace (tests: a pid that is not a process
    /// here, 0 or reaped, cannot be watched, and so counts as gone).
    #[cfg(test)]
    pub fn watch(pid: u32) -> Self {
        Peer {
            pidfd: Peer::open(pid),
        }
    }

    fn open(pid: u32) -> Option<OwnedFd> {
        let pid = i32::try_from(pid).ok().and_then(Pid::from_raw)?;
        pidfd_open(pid, PidfdFlags::empty()).ok()
    }

    pub fn watchable(&self) -> bool {
        self.pidfd.is_some()
    }

    /// True if the process is gone (or cannot be watched), waiting at
    /// most `within` for it to go: its end of the channel closes as it
    /// exits, a moment before the kernel marks it exited. A zombie is
    /// gone: a pidfd polls readable once its process has exited.
    pub fn gone_within(&self, within: Duration) -> bool {
        match &self.pidfd {
            Some(pidfd) => exited(pidfd, within),
            None => true,
        }
    }
}

/// A pidfd polls readable once its process has exited.
fn exited(pidfd: &OwnedFd, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let borrowed = pidfd.as_fd();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let timeout = Timespec {
            tv_sec: left.as_secs() as i64,
            tv_nsec: left.subsec_nanos().into(),
        };
        let mut fds = [PollFd::new(&borrowed, PollFlags::IN)];
        match poll(&mut fds, Some(&timeout)) {
            Ok(n) => return n > 0,
            Err(Errno::INTR) if !left.is_zero() => continue,
            Err(_) => return false,
        }
    }
}

/// SO_PEERPIDFD: a pidfd of the socket's peer (Linux 6.5+).
#[allow(unsafe_code)]
fn peer_pidfd(stream: &impl AsFd) -> std::io::Result<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: the socket is borrowed for the call; the kernel writes at
    // most `len` bytes (one c_int) through the valid pointer.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 || fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: on success the kernel installed `fd` in this process's
    // table for the caller, who owns it from here on.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd) };
    fcntl_setfd(&pidfd, FdFlags::CLOEXEC)?;
    Ok(pidfd)
}

/// SO_PEERCRED: the peer's pid (in this pid namespace; 0 if it is not
/// visible here) and uid, as at connect(). Read by hand because
/// rustix's `UCred` holds the pid as non-zero, which 0 would break.
#[allow(unsafe_code)]
pub fn peer_cred(stream: &impl AsFd) -> std::io::Result<(i32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: as above, one `ucred` written through a valid pointer.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((cred.pid, cred.uid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_process_is_not_gone_and_an_exited_one_is() {
        let me = Peer::watch(std::process::id());
        assert!(!me.gone_within(Duration::from_millis(50)));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let peer = Peer::watch(child.id());
        assert!(peer.watchable(), "pidfd_open");
        // Exited (a zombie until reaped) is gone.
        assert!(peer.gone_within(Duration::from_secs(30)));
        child.wait().unwrap();
    }

    /// Review round 2, M2: a pid that names no process here (0, or one
    /// reaped) cannot be watched and counts as gone at once, never as
    /// alive forever.
    #[test]
    fn a_peer_that_cannot_be_watched_counts_as_gone() {
        assert!(Peer::of_pidfd(None).gone_within(Duration::ZERO));
        let unwatched = Peer::watch(0);
        assert!(!unwatched.watchable());
        assert!(unwatched.gone_within(Duration::ZERO));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(Peer::watch(pid).gone_within(Duration::ZERO));
    }

    /// The kernel's word for a socket's peer: here, this very process.
    #[test]
    fn a_sockets_peer_is_the_process_that_connected() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let peer = Peer::of_socket(&a);
        assert!(peer.watchable());
        assert!(!peer.gone_within(Duration::from_millis(50)));
        assert_eq!(peer_cred(&b).unwrap().0 as u32, std::process::id());
    }
}
