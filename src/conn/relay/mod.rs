//! Transmission: requests from the client go upstream, replies come back.
//!
//! The two directions run as two futures in the connection's own task,
//! sharing the in-flight table (`flight`). The reply side is the only
//! writer to the client (`writer`): replies nbdgw makes itself (refused
//! requests, cache hits) reach it through a channel, so they never land
//! inside an upstream reply. The two loops only move bytes; what happens
//! to each request and reply beyond that is decided by the stack of
//! `layers` (see `stack`).

mod flight;
pub mod layers;
mod local;
mod replies;
mod requests;
mod writer;

use std::future::Future;
use std::pin::{pin, Pin};

use tokio::io::{AsyncRead, AsyncWrite};

use super::buffered::Buffered;
use tokio::sync::mpsc;

use crate::conn::error::ConnError;
use crate::conn::session::Transmit;
use crate::proto::transmission::ReplyMode;
use crate::shutdown::DrainAnswer;
use flight::Flight;
pub use layers::cache::Cached;
use layers::{accounting::Accounting, cache::ReadCache, refusals::Refusals};
use layers::{revocation, revocation::Revocation, OnReply, OnRequest, Stack};
pub use replies::max_reply;
use replies::Replies;
use requests::Requests;
use writer::ReplyWriter;

/// Reads from the upstream smaller than this go through a buffer (reply
/// headers); larger ones (payload) go straight into the reply buffer.
const UPSTREAM_READ_BUF: usize = 64 * 1024;
/// Replies nbdgw makes itself, queued for the reply side.
const LOCAL_QUEUE: usize = 64;
/// After a drain's close_notify and FIN, without a socket to ask whether
/// the client has everything, how long the client's bytes are still read,
/// until it closes its side.
const CLOSE_LINGER: std::time::Duration = std::time::Duration::from_secs(1);
/// How often a lingering connection asks the kernel whether the client
/// has acknowledged everything.
const OUTPUT_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// The two halves of each end of a session in transmission, and how it
/// was negotiated: the same relay serves a TLS client and a Unix-socket
/// upstream (server mode) and a plaintext local client and a TLS remote
/// server (client mode).
pub struct Ends<CR, CW, UR, UW> {
    pub client: (CR, CW),
    pub upstream: (UR, UW),
    pub mode: ReplyMode,
    pub read_only: bool,
    /// The read cache, for a session on an immutable export.
    pub cache: Option<Cached>,
}

/// Relays until the client disconnects, a drain completes, a reload ends
/// the session, or a side fails. Returns why the connection ended.
/// `socket` is a second handle on the client's TCP socket (none in client
/// mode, whose local side is not TCP to a remote): for TCP_CORK, and to
/// see the last replies delivered.
pub async fn run<CR, CW, UR, UW>(
    ends: Ends<CR, CW, UR, UW>,
    socket: Option<socket2::Socket>,
    link: &Transmit<'_>,
    registered: Option<&crate::tls::SessionGuard>,
) -> Result<&'static str, ConnError>
where
    CR: AsyncRead + Unpin,
    CW: AsyncWrite + Unpin,
    UR: AsyncRead + Unpin,
    UW: AsyncWrite + Unpin,
{
    revocation::until_ended(registered, relay(ends, socket, link, registered)).await
}

/// The relay's layers, outermost first: each is asked to decide a request
/// only if every layer before it passed it; the other events go to all
/// (see `layers`). A new per-request feature (a quota, a rate limit) is
/// one file in `layers/` that implements `layers::Layer` and one
/// `.with(...)` line here, unless it must act outside a request
/// (revocation also wraps the relay in `until_ended`, above). Split into
/// the two loops' halves once per session.
fn stack<'a>(
    link: &'a Transmit<'_>,
    (mode, read_only): (ReplyMode, bool),
    registered: Option<&'a crate::tls::SessionGuard>,
    cache: Option<Cached>,
) -> (impl OnRequest + Send + 'a, impl OnReply + Send + 'a) {
    Stack::new()
        .with(Accounting::new(link.stats, mode))
        .with(Refusals::new(read_only, link.limits.max_payload))
        .with(Revocation::new(registered))
        .with(ReadCache::new(cache, mode))
        .split()
}

async fn relay<CR, CW, UR, UW>(
    ends: Ends<CR, CW, UR, UW>,
    socket: Option<socket2::Socket>,
    link: &Transmit<'_>,
    registered: Option<&crate::tls::SessionGuard>,
) -> Result<&'static str, ConnError>
where
    CR: AsyncRead + Unpin,
    CW: AsyncWrite + Unpin,
    UR: AsyncRead + Unpin,
    UW: AsyncWrite + Unpin,
{
    let Ends {
        client: (client_rd, client_wr),
        upstream: (up_rd, up_wr),
        mode,
        read_only,
        cache,
    } = ends;
    let flight = Flight::new();
    let (on_request, on_reply) = stack(link, (mode, read_only), registered, cache);
    let (local_tx, local_rx) = mpsc::channel(LOCAL_QUEUE);
    let requests = Requests::new(
        (client_rd, up_wr),
        &flight,
        local_tx,
        mode,
        link,
        on_request,
    );
    let upstream = Buffered::new(UPSTREAM_READ_BUF, up_rd);
    let lingers = link.shutdown.answer() == DrainAnswer::Eshutdown;
    let limits = (mode, link.limits.max_payload);
    let shutdown = link.shutdown.clone();
    let replies =
        Replies::new(upstream, &flight, local_rx, limits, shutdown, on_reply).lingering(lingers);
    let mut writer = ReplyWriter::new(client_wr, socket, &link.limits, link.stats);
    let mut requests = pin!(requests.run());
    let mut requests_done = false;
    let result = {
        let replies = pin!(replies.run(&mut writer));
        both_sides(requests.as_mut(), replies, &mut requests_done).await
    };
    let requests = (!requests_done).then_some(requests);
    close_down(result, writer, requests, link.shutdown.clone()).await
}

/// The end of a relay: once every reply is written, close_notify and FIN,
/// then, for a drain (`requests` still running: not the client's DISC,
/// so the client may still be sending), the linger; after a failure, the
/// writer abandoned.
async fn close_down<W: AsyncWrite + Unpin>(
    result: Result<&'static str, ConnError>,
    writer: ReplyWriter<'_, W>,
    requests: Option<Pin<&mut impl Future<Output = Result<(), ConnError>>>>,
    mut shutdown: crate::shutdown::Shutdown,
) -> Result<&'static str, ConnError> {
    match result {
        Ok(reason) => {
            let socket = writer.close().await?;
            if let Some(requests) = requests {
                linger(requests, socket.as_ref(), &mut shutdown).await;
            }
            Ok(reason)
        }
        Err(e) => {
            writer.abandon().await;
            Err(e)
        }
    }
}

/// Polls both sides until the reply side ends (it decides when a drained
/// connection ends; it watches the shutdown itself) or either fails. The
/// request side ends on its own only with DISC or when the reply side is
/// gone.
async fn both_sides(
    mut requests: Pin<&mut impl Future<Output = Result<(), ConnError>>>,
    mut replies: Pin<&mut impl Future<Output = Result<&'static str, ConnError>>>,
    requests_done: &mut bool,
) -> Result<&'static str, ConnError> {
    loop {
        tokio::select! {
            requested = &mut requests, if !*requests_done => match requested {
                Ok(()) => *requests_done = true,
                Err(e) => return Err(e),
            },
            replied = &mut replies => return replied,
        }
    }
}

/// After a drain's close_notify and FIN: the client's bytes are read (and
/// dropped) until it closes too, or until the kernel holds nothing of ours
/// unacknowledged, or the grace period ends. A socket closed with bytes
/// unread, or that receives bytes once closed, is reset, and Linux then
/// throws away what it has not sent yet: replies and close_notify. Once
/// the client has acknowledged everything (FIN included), a reset costs
/// nothing. Without a socket handle (client mode's local side), for at
/// most `CLOSE_LINGER`.
async fn linger(
    mut requests: Pin<&mut impl Future<Output = Result<(), ConnError>>>,
    socket: Option<&socket2::Socket>,
    shutdown: &mut crate::shutdown::Shutdown,
) {
    let Some(socket) = socket else {
        let _ = tokio::time::timeout(CLOSE_LINGER, requests).await;
        return;
    };
    let mut poll = tokio::time::interval(OUTPUT_POLL);
    loop {
        tokio::select! {
            _ = &mut requests => return,
            () = shutdown.cut() => return,
            _ = poll.tick() => {
                if output_queue(socket).is_none_or(|queued| queued == 0) {
                    return;
                }
            }
        }
    }
}

/// Bytes the kernel still holds for the client socket, sent or not, with
/// the FIN: SIOCOUTQ (the same request number as TIOCOUTQ on Linux).
/// Neither rustix, nix nor socket2 offers it safely, hence the one ioctl.
#[allow(unsafe_code)]
fn output_queue(socket: &socket2::Socket) -> Option<u32> {
    use nix::libc;
    use std::os::fd::AsRawFd;
    let mut queued: libc::c_int = 0;
    // SAFETY: the fd is open for the call (`socket` borrows it), and
    // SIOCOUTQ writes one c_int through the pointer, which is valid.
    let rc = unsafe { libc::ioctl(socket.as_raw_fd(), libc::TIOCOUTQ, &mut queued) };
    (rc == 0).then(|| u32::try_from(queued).unwrap_or(0))
}
