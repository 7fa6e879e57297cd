//! Transmission: requests from the client go upstream, replies come back.
//!
//! The two directions run as two futures in the connection's own task,
//! sharing the in-flight table (`flight`). The reply side is the only
//! writer to the client (`writer`): replies nbdgw makes itself (refused
//! requests) reach it through a channel, so they never land inside an
//! upstream reply.

mod cache;
mod flight;
mod local;
mod replies;
mod requests;
mod writer;

use std::pin::pin;

use tokio::io::{AsyncRead, AsyncWrite};

use super::buffered::Buffered;
use tokio::sync::mpsc;

use crate::conn::error::ConnError;
use crate::conn::session::Transmit;
use crate::proto::transmission::ReplyMode;
use crate::shutdown::DrainAnswer;
pub use cache::Cached;
use cache::{Ahead, ReplyLayer, RequestLayer};
use flight::Flight;
use local::{Local, SHUTTING_DOWN};
pub use replies::max_reply;
use replies::Replies;
use requests::Requests;
use writer::ReplyWriter;

/// Reads from the upstream smaller than this go through a buffer (reply
/// headers); larger ones (payload) go straight into the reply buffer.
const UPSTREAM_READ_BUF: usize = 64 * 1024;
/// Replies nbdgw makes itself, queued for the reply side.
const LOCAL_QUEUE: usize = 64;
/// After a drain's close_notify and FIN, how long the client's bytes are
/// still read, until it closes its side. A client that is told at once
/// (libnbd polls) closes in a round trip; one that reads only while it
/// waits for a reply (qemu) is not told until it sends, so this bounds
/// how long an idle one holds the connection's end.
const CLOSE_LINGER: std::time::Duration = std::time::Duration::from_secs(1);

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

/// Relays until the client disconnects, a drain completes, or a side
/// fails. Returns why the connection ended.
pub async fn run<CR, CW, UR, UW>(
    ends: Ends<CR, CW, UR, UW>,
    cork: Option<socket2::Socket>,
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
    let ahead = Ahead::new(cache.as_ref().map(|c| c.handle.clone()));
    let reply_cache = cache
        .as_ref()
        .map(|c| ReplyLayer::new(c.handle.clone(), &ahead));
    let request_cache = cache.map(|c| RequestLayer::new(c, &ahead));
    let (local_tx, local_rx) = mpsc::channel(LOCAL_QUEUE);
    let drain = local_tx.clone();
    let requests = Requests::new(
        (client_rd, up_wr),
        &flight,
        local_tx,
        (mode, read_only),
        link,
    )
    .cached(request_cache)
    .ended_by(registered);
    let upstream = Buffered::new(UPSTREAM_READ_BUF, up_rd);
    let lingers = link.shutdown.answer() == DrainAnswer::Eshutdown;
    let replies = Replies::new(upstream, &flight, local_rx, mode, link.limits.max_payload)
        .cached(reply_cache)
        .lingering(lingers);
    let mut writer = ReplyWriter::new(client_wr, cork, &link.limits, link.stats);
    let mut requests = pin!(requests.run());
    let mut requests_done = false;
    let result = {
        let mut replies = pin!(replies.run(&mut writer));
        let mut shutdown = link.shutdown.clone();
        let mut told_to_drain = false;
        // The reply side decides when a drained connection ends; the
        // request side ends on its own only with DISC or an error. The
        // shutdown is watched here, once per connection rather than once
        // per request; new requests see it through `is_draining`.
        loop {
            tokio::select! {
                requested = &mut requests, if !requests_done => match requested {
                    Ok(()) => requests_done = true,
                    Err(e) => break Err(e),
                },
                replied = &mut replies => break replied,
                () = shutdown.draining(), if !told_to_drain => {
                    told_to_drain = true;
                    let _ = drain.send(Local::Drain(SHUTTING_DOWN)).await;
                }
            }
        }
    };
    match result {
        Ok(reason) => {
            writer.close().await?;
            if !requests_done {
                // A drain, not the client's DISC: the client may still be
                // sending. Its bytes are read (and dropped) until it
                // closes too, for a while: a socket closed with bytes
                // unread sends a reset and throws away what the kernel
                // has not sent yet, replies and close_notify included.
                let _ = tokio::time::timeout(CLOSE_LINGER, &mut requests).await;
            }
            Ok(reason)
        }
        Err(e) => {
            writer.abandon().await;
            Err(e)
        }
    }
}
