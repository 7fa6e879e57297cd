//! One hand-over connection: frames (`crate::proto::handover`) over a
//! Unix stream socket, with descriptors passed by SCM_RIGHTS, every read
//! and write bounded by the hand-over's deadline.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};
use thiserror::Error;

use crate::proto::handover::{Header, Message, WireError, HEADER_LEN, MAX_FDS};

#[derive(Debug, Error)]
pub enum ChannelError {
    #[error("the peer closed the hand-over connection")]
    Closed,
    #[error("the hand-over took longer than its timeout")]
    Timeout,
    // The cause is in the text and not a `source`, so that an anyhow
    // chain does not print it twice (review N1).
    #[error("hand-over connection: {0}")]
    Io(std::io::Error),
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("hand-over peer: {0}")]
    Peer(String),
}

impl From<std::io::Error> for ChannelError {
    fn from(e: std::io::Error) -> Self {
        ChannelError::Io(e)
    }
}

impl ChannelError {
    /// The peer's end is gone without a word (EOF, EPIPE, ECONNRESET):
    /// a death, or a peer that gave up without Refuse.
    pub fn is_bare_end(&self) -> bool {
        match self {
            ChannelError::Closed => true,
            ChannelError::Io(e) => matches!(
                e.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            ),
            _ => false,
        }
    }
}

/// How long a Refuse may take past the hand-over's deadline: a give-up
/// at the timeout still says so, so that the peer never reads a bare end
/// as a death.
pub const REFUSE_GRACE: Duration = Duration::from_secs(1);

pub struct Channel {
    stream: UnixStream,
    deadline: Instant,
    refused: bool,
}

impl Channel {
    pub fn new(stream: UnixStream, deadline: Instant) -> std::io::Result<Self> {
        stream.set_nonblocking(false)?;
        Ok(Channel {
            stream,
            deadline,
            refused: false,
        })
    }

    /// A new deadline for what follows (per-message bounds: sessions).
    pub fn set_deadline(&mut self, deadline: Instant) {
        self.deadline = deadline;
    }

    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    fn remaining(&self) -> Result<Duration, ChannelError> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ChannelError::Timeout);
        }
        Ok(left)
    }

    /// Sends `message` with `fds` on its first byte.
    pub fn send(&mut self, message: &Message, fds: &[BorrowedFd]) -> Result<(), ChannelError> {
        assert_eq!(message.fds(), fds.len(), "descriptors as the message says");
        // A session's state holds keys: its frame is wiped once sent.
        let frame = message.encode();
        let mut sent = 0;
        while sent < frame.len() {
            self.stream.set_write_timeout(Some(self.remaining()?))?;
            let mut space =
                [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS as usize))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            // The descriptors ride on the frame's first byte only.
            if sent == 0 && !fds.is_empty() {
                control.push(SendAncillaryMessage::ScmRights(fds));
            }
            let iov = [IoSlice::new(&frame[sent..])];
            match sendmsg(&self.stream, &iov, &mut control, SendFlags::NOSIGNAL) {
                Ok(n) => sent += n,
                Err(Errno::INTR) => continue,
                Err(Errno::AGAIN) => return Err(ChannelError::Timeout),
                Err(e) => return Err(std::io::Error::from(e).into()),
            }
        }
        Ok(())
    }

    /// The next message and the descriptors that came with it (their
    /// number checked against the message's; each one closed if the
    /// frame is refused). A Refuse from the peer is returned as an error.
    pub fn recv(&mut self) -> Result<(Message, Vec<OwnedFd>), ChannelError> {
        let mut fds = Vec::new();
        let mut head = [0u8; HEADER_LEN];
        self.fill(&mut head, &mut fds)?;
        let header = Header::decode(&head)?;
        // A session's state holds keys: wiped once decoded.
        let mut body = zeroize::Zeroizing::new(vec![0u8; header.length as usize]);
        self.fill(&mut body, &mut fds)?;
        if fds.len() != usize::from(header.fds) {
            return Err(WireError::FdCount(fds.len(), header.fds.into()).into());
        }
        match Message::decode(&header, &body)? {
            // The peer's words go into our log and errors: escaped.
            Message::Refuse { reason } => Err(ChannelError::Peer(
                crate::logsafe::escape(&reason).into_owned(),
            )),
            message => Ok((message, fds)),
        }
    }

    /// Reads exactly `buf`, collecting any descriptors that arrive.
    fn fill(&mut self, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> Result<(), ChannelError> {
        let mut got = 0;
        while got < buf.len() {
            self.stream.set_read_timeout(Some(self.remaining()?))?;
            let mut space =
                [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS as usize))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let mut iov = [IoSliceMut::new(&mut buf[got..])];
            let msg = match recvmsg(
                &self.stream,
                &mut iov,
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            ) {
                Ok(msg) => msg,
                Err(Errno::INTR) => continue,
                Err(Errno::AGAIN) => return Err(ChannelError::Timeout),
                Err(e) => return Err(std::io::Error::from(e).into()),
            };
            for message in control.drain() {
                if let RecvAncillaryMessage::ScmRights(received) = message {
                    fds.extend(received);
                }
            }
            let bytes = msg.bytes;
            if msg.flags.contains(ReturnFlags::CTRUNC) || fds.len() > usize::from(MAX_FDS) {
                return Err(WireError::TooManyFds(fds.len() as u16).into());
            }
            if bytes == 0 {
                return Err(ChannelError::Closed);
            }
            got += bytes;
        }
        Ok(())
    }

    /// Refuses, best effort, once: the connection is ending either way.
    /// Bounded by REFUSE_GRACE even when the deadline has passed.
    pub fn refuse(&mut self, reason: &str) {
        if std::mem::replace(&mut self.refused, true) {
            return;
        }
        self.deadline = self.deadline.max(Instant::now() + REFUSE_GRACE);
        let _ = self.send(
            &Message::Refuse {
                reason: reason.to_string(),
            },
            &[],
        );
    }
}

impl AsFd for Channel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }
}

/// The uid of the process at the other end (SO_PEERCRED: as it was at
/// connect, which is what the kernel vouches for).
pub fn peer_uid(stream: &impl AsFd) -> std::io::Result<u32> {
    Ok(super::alive::peer_cred(stream)?.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_io_error_is_told_once_in_a_chain() {
        let e = ChannelError::from(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        assert!(e.is_bare_end());
        let text = format!("{:#}", anyhow::Error::from(e).context("--take-over P"));
        assert_eq!(text.matches("broken pipe").count(), 1, "{text}");
    }
}
