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
mod go_quiet;
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
pub use crate::handing::Quiesce;
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
    match run_quiescible(ends, socket, link, registered, None).await? {
        Relayed::Ended(reason) => Ok(reason),
        Relayed::Quiet(_) => unreachable!("no hook, never quiet"),
    }
}

/// How a relay that may be handed over ended.
pub enum Relayed<CR, CW, UR, UW> {
    Ended(&'static str),
    /// The hook asked and the session went quiet: its parts, for a
    /// hand-over (or to relay again if that fails).
    Quiet(Parts<CR, CW, UR, UW>),
}

/// A quiet session's parts: nothing in flight, every reply written and
/// flushed, nothing read from the upstream that was not relayed.
pub struct Parts<CR, CW, UR, UW> {
    pub client: (CR, CW),
    pub upstream: (UR, UW),
    /// The bytes of a request header read before the stop.
    pub pending: Vec<u8>,
    pub socket: Option<socket2::Socket>,
}

/// `run`, with the hand-over hook: asked, the relay goes quiet and hands
/// its parts back instead of closing (`quiesce`).
pub async fn run_quiescible<CR, CW, UR, UW>(
    ends: Ends<CR, CW, UR, UW>,
    socket: Option<socket2::Socket>,
    link: &Transmit<'_>,
    registered: Option<&crate::tls::SessionGuard>,
    hook: Option<&Quiesce>,
) -> Result<Relayed<CR, CW, UR, UW>, ConnError>
where
    CR: AsyncRead + Unpin,
    CW: AsyncWrite + Unpin,
    UR: AsyncRead + Unpin,
    UW: AsyncWrite + Unpin,
{
    let relayed = relay(ends, socket, link, registered, hook);
    revocation::until_ended(registered, relayed).await
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
    hook: Option<&Quiesce>,
) -> Result<Relayed<CR, CW, UR, UW>, ConnError>
where
    CR: AsyncRead + Unpin,
    CW: AsyncWrite + Unpin,
    UR: AsyncRead + Unpin,
    UW: AsyncWrite + Unpin,
{
    let flight = Flight::new();
    let (mut requests, mut replies, mut writer) =
        sides(ends, socket, (link, registered, hook), &flight);
    let mut requesting = Box::pin(requests.run());
    let mut requests_done = false;
    let result = {
        let mut replying = pin!(replies.run(&mut writer));
        loop {
            let both = (requesting.as_mut(), replying.as_mut());
            match go_quiet::both_sides(both.0, both.1, &mut requests_done, (&flight, hook)).await {
                go_quiet::Step::Ended(result) => break Some(result),
                go_quiet::Step::Quiet => break None,
                go_quiet::Step::Resume => {
                    drop(requesting);
                    requesting = Box::pin(requests.run());
                    requests_done = false;
                }
            }
        }
    };
    let Some(result) = result else {
        drop(requesting);
        return parts(requests, replies, writer).map(Relayed::Quiet);
    };
    let requesting = (!requests_done).then_some(requesting.as_mut());
    close_down(result, writer, requesting, link.shutdown.clone())
        .await
        .map(Relayed::Ended)
}

/// The relay's two loops and the reply writer, over `ends`.
#[allow(clippy::type_complexity)]
fn sides<'a, CR, CW, UR, UW>(
    ends: Ends<CR, CW, UR, UW>,
    socket: Option<socket2::Socket>,
    (link, registered, hook): (
        &'a Transmit<'_>,
        Option<&'a crate::tls::SessionGuard>,
        Option<&'a Quiesce>,
    ),
    flight: &'a Flight,
) -> (
    Requests<'a, CR, UW, impl OnRequest + Send + 'a>,
    Replies<'a, UR, impl OnReply + Send + 'a>,
    ReplyWriter<'a, CW>,
)
where
    CR: AsyncRead + Unpin,
    CW: AsyncWrite + Unpin,
    UR: AsyncRead + Unpin,
    UW: AsyncWrite + Unpin,
{
    let Ends {
        client,
        upstream,
        mode,
        read_only,
        cache,
    } = ends;
    let ((client_rd, client_wr), (up_rd, up_wr)) = (client, upstream);
    let (on_request, on_reply) = stack(link, (mode, read_only), registered, cache);
    let (local_tx, local_rx) = mpsc::channel(LOCAL_QUEUE);
    let sides = (client_rd, up_wr);
    let requests = Requests::new(sides, flight, local_tx, mode, link, on_request).quiescible(hook);
    let upstream = Buffered::new(UPSTREAM_READ_BUF, up_rd);
    let lingers = link.shutdown.answer() == DrainAnswer::Eshutdown;
    let (limits, shutdown) = ((mode, link.limits.max_payload), link.shutdown.clone());
    let replies =
        Replies::new(upstream, flight, local_rx, limits, shutdown, on_reply).lingering(lingers);
    let writer = ReplyWriter::new(client_wr, socket, &link.limits, link.stats);
    (requests, replies, writer)
}

/// A quiet relay's parts (nothing in flight, every reply written).
fn parts<CR, CW: AsyncWrite + Unpin, UR: AsyncRead + Unpin, UW, L1, L2>(
    requests: Requests<'_, CR, UW, L1>,
    replies: Replies<'_, UR, L2>,
    writer: ReplyWriter<'_, CW>,
) -> Result<Parts<CR, CW, UR, UW>, ConnError> {
    let (client_rd, up_wr, pending) = requests.into_parts();
    let up_rd = replies.into_upstream()?;
    let (client_wr, socket) = writer.into_parts();
    Ok(Parts {
        client: (client_rd, client_wr),
        upstream: (up_rd, up_wr),
        pending,
        socket,
    })
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
