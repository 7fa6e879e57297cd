//! The Unix-socket connection to the NBD server behind the gateway.

use std::path::Path;
use std::time::Duration;

use socket2::{Domain, SockRef, Socket, Type};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::exports::{DirSocket, SocketFile};
use crate::proto::consts::GREETING_LEN;
use crate::proto::handshake::{parse_upstream_greeting, upstream_client_flags};
use crate::proto::ProtoError;

#[derive(Debug, Error)]
pub enum UpstreamError {
    #[error("cannot connect to {path}: {error}")]
    Connect {
        path: String,
        error: crate::exports::CheckError,
    },
    #[error("{path} did not accept and greet within {after:?} (--upstream-timeout)")]
    Timeout { path: String, after: Duration },
    #[error("greeting: {0}")]
    Io(#[from] std::io::Error),
    #[error("bad greeting: {0}")]
    Proto(#[from] ProtoError),
}

/// An upstream connection that has finished the greeting and is ready for
/// options.
pub struct Upstream {
    pub stream: UnixStream,
    /// Whether the upstream will pad an EXPORT_NAME reply with zeroes.
    pub pads_export_name: bool,
    /// Which server this is; `None` when it cannot be told (then the read
    /// cache is not used for the session).
    pub incarnation: Option<Incarnation>,
}

/// One running upstream server, as a connection to it can tell: the
/// socket file it was reached through, and the credentials (`SO_PEERCRED`)
/// its server had when it called listen(). A server started again on the
/// same path binds a new socket file, and is another process: both change.
/// What does not change is the bytes behind a server that keeps running
/// (an image rewritten in place), nor a listening socket handed from one
/// process to the next (systemd socket activation: the file and systemd's
/// pid stay), so neither can be seen here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Incarnation {
    pub file: SocketFile,
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

impl Incarnation {
    fn of(stream: &UnixStream, file: Option<SocketFile>) -> Option<Self> {
        let cred = stream.peer_cred().ok()?;
        Some(Incarnation {
            file: file?,
            // Always set on Linux; 0 if the server's pid is in no
            // namespace this one sees (the file still tells servers apart).
            pid: cred.pid().unwrap_or(0),
            uid: cred.uid(),
            gid: cred.gid(),
        })
    }
}

/// How an upstream is reached: its own settings, so that this module
/// needs nothing of the gateway's `Config` (which builds it).
#[derive(Debug, Clone, Copy)]
pub struct Dial {
    /// To accept and greet (`--upstream-timeout`).
    pub timeout: std::time::Duration,
    /// `SO_SNDBUF` to ask for; 0 keeps the kernel's (`--upstream-sndbuf`).
    pub sndbuf: usize,
}

/// Connects to `socket`, sizes the send buffer, and does the newstyle
/// greeting, all within `--upstream-timeout`: a server that accepts (the
/// kernel does that for it, into the backlog) but never greets would
/// otherwise hold the client until the handshake timeout, and the client
/// would learn nothing.
/// A socket found in `--export-dir` (`in_dir`) is reached only through
/// its checks (see `crate::exports`).
pub async fn open(
    socket: &Path,
    in_dir: Option<&DirSocket>,
    dial: Dial,
) -> Result<Upstream, UpstreamError> {
    let after = dial.timeout;
    tokio::time::timeout(after, connect_and_greet(socket, in_dir, dial))
        .await
        .map_err(|_| UpstreamError::Timeout {
            path: socket.display().to_string(),
            after,
        })?
}

async fn connect_and_greet(
    socket: &Path,
    in_dir: Option<&DirSocket>,
    dial: Dial,
) -> Result<Upstream, UpstreamError> {
    let (stream, file) = crate::exports::connect(socket, in_dir)
        .await
        .map_err(|error| UpstreamError::Connect {
            path: socket.display().to_string(),
            error,
        })?;
    let incarnation = Incarnation::of(&stream, file);
    greet(stream, incarnation, dial).await
}

/// The greeting on a connected stream.
async fn greet(
    mut stream: UnixStream,
    incarnation: Option<Incarnation>,
    dial: Dial,
) -> Result<Upstream, UpstreamError> {
    if dial.sndbuf > 0 {
        // Best effort: the start-up probe already told the operator what
        // the kernel grants.
        let _ = SockRef::from(&stream).set_send_buffer_size(dial.sndbuf);
    }
    let pads_export_name = newstyle_greeting(&mut stream).await?;
    Ok(Upstream {
        stream,
        pads_export_name,
        incarnation,
    })
}

/// The client's half of the fixed-newstyle greeting on any stream (a Unix
/// socket here, the remote server's TCP connection in client mode):
/// reads the server's greeting, answers with our flags, and returns
/// whether the server will pad an EXPORT_NAME reply with zeroes.
pub async fn newstyle_greeting<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
) -> Result<bool, UpstreamError> {
    let mut greeting = [0u8; GREETING_LEN];
    stream.read_exact(&mut greeting).await?;
    let server_flags = parse_upstream_greeting(&greeting)?;
    let client_flags = upstream_client_flags(server_flags);
    stream.write_all(&client_flags.to_be_bytes()).await?;
    Ok(client_flags & crate::proto::consts::FLAG_C_NO_ZEROES == 0)
}

/// What the kernel makes of a requested Unix-socket send buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SndbufReport {
    pub requested: usize,
    /// As `getsockopt(SO_SNDBUF)` reports it: Linux doubles the request
    /// for bookkeeping overhead and caps it at twice `net.core.wmem_max`.
    pub effective: usize,
}

impl SndbufReport {
    pub fn clipped(&self) -> bool {
        self.requested > 0 && self.effective < self.requested.saturating_mul(2)
    }
}

/// Tries the send buffer size on a throw-away Unix socket, so the operator
/// learns at start-up, before any client, what every connection will get.
pub fn probe_sndbuf(requested: usize) -> std::io::Result<SndbufReport> {
    let socket = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    if requested > 0 {
        socket.set_send_buffer_size(requested)?;
    }
    Ok(SndbufReport {
        requested,
        effective: socket.send_buffer_size()?,
    })
}

/// True when the path exists and is a socket (for start-up warnings).
pub fn looks_like_socket(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path)
        .map(|m| m.file_type().is_socket())
        .unwrap_or(false)
}
