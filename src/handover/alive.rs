//! Whether the process at the other end of the hand-over is still there:
//! a bare end of the channel is a death only if it is gone, since every
//! deliberate give-up says Refuse first.

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::process::{pidfd_open, test_kill_process, Pid, PidfdFlags};

/// The peer process, watched by a pidfd opened when its pid arrived (so
/// that a later reuse of the pid is not mistaken for it), or by pid
/// alone where the kernel has no pidfd_open (before 5.3).
pub struct Peer {
    pid: Option<Pid>,
    pidfd: Option<OwnedFd>,
}

impl Peer {
    /// `pid` as the peer said it. A pid that is not a process (0, or
    /// already gone) is a peer that cannot be watched: never gone.
    pub fn watch(pid: u32) -> Self {
        let pid = i32::try_from(pid).ok().and_then(Pid::from_raw);
        let pidfd = pid.and_then(|pid| pidfd_open(pid, PidfdFlags::empty()).ok());
        Peer { pid, pidfd }
    }

    /// True if the process is gone, waiting at most `within` for it to
    /// go: its end of the channel closes as it exits, a moment before
    /// the kernel marks it exited.
    pub fn gone_within(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        match (&self.pidfd, self.pid) {
            (Some(pidfd), _) => exited(pidfd, within),
            // Without a pidfd: polled by pid. A zombie still answers, so
            // this errs towards "alive" (the caller fails closed).
            (None, Some(pid)) => loop {
                if test_kill_process(pid) == Err(Errno::SRCH) {
                    return true;
                }
                if Instant::now() >= deadline {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(20));
            },
            (None, None) => false,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_process_is_not_gone_and_an_exited_one_is() {
        let me = Peer::watch(std::process::id());
        assert!(!me.gone_within(Duration::from_millis(50)));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let peer = Peer::watch(child.id());
        assert!(peer.pidfd.is_some(), "pidfd_open");
        // Exited (a zombie until reaped) is gone.
        assert!(peer.gone_within(Duration::from_secs(30)));
        child.wait().unwrap();
        assert!(!Peer::watch(0).gone_within(Duration::ZERO));
    }
}
