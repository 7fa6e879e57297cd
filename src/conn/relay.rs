//! Transmission: requests from the client go upstream, replies come back.
//!
//! Both directions run as two futures joined in the connection's own task.
//! The reply side is the only writer to the client: replies nbdgw makes
//! itself (refused writes) reach it through a channel, so they never land
//! inside an upstream reply.
//!
//! Reply write path: header and payload are gathered into one plaintext
//! buffer and handed to rustls in pieces of `REPLY_CHUNK` bytes, each
//! flushed before the next, so every TLS record is full except the last of
//! a burst. While another reply is already readable from the upstream, the
//! buffer keeps filling; a burst larger than one write holds TCP_CORK and is
//! uncorked only when nothing more is waiting. A burst that fits one write
//! needs no cork: with TCP_NODELAY its segments are full but the last.

use std::future::poll_fn;
use std::pin::{pin, Pin};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufRead, AsyncReadExt, AsyncWriteExt, BufReader, ReadHalf, WriteHalf};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, Notify};
use tracing::debug;

use super::negotiate::Session;
use super::{discard, within_stall, ClientTls, ConnError, Link, Stats};
use crate::config::{Config, Cork};
use crate::proto::consts::*;
use crate::proto::transmission::{
    encode_error_reply, parse_reply, reply_header_len, InFlight, InFlightTable, ReplyMode, Request,
};
use crate::proto::ProtoError;
use crate::shutdown::Shutdown;

/// Plaintext gathered per write to rustls: a multiple of the 16 KiB record
/// size, so that every record of a large reply is full.
const REPLY_CHUNK: usize = 256 * 1024;
/// rustls accepts a whole `REPLY_CHUNK` at once only if its queue has room
/// for it; the queue is empty after each flush, so this is enough.
pub(super) const TLS_BUFFER_LIMIT: usize = REPLY_CHUNK + 64 * 1024;
/// Bursts up to this size go out in one write without TCP_CORK.
const UNCORKED_BURST_MAX: usize = 64 * 1024;
/// Request payload is forwarded upstream in pieces of this size.
const REQUEST_CHUNK: usize = 256 * 1024;
/// Reads from the upstream smaller than this go through a buffer (reply
/// headers); larger ones (payload) go straight into the reply buffer.
const UPSTREAM_READ_BUF: usize = 64 * 1024;
/// Replies nbdgw makes itself, queued for the reply side.
const LOCAL_QUEUE: usize = 64;
/// How long a hard disconnect waits to send TLS close_notify.
const GOODBYE_TIMEOUT: Duration = Duration::from_secs(2);

enum Local {
    Reply {
        cookie: u64,
        bytes: Vec<u8>,
    },
    /// Finish what is in flight, then close with this reason: the client
    /// sent NBD_CMD_DISC, or nbdgw is shutting down.
    Drain(&'static str),
}

const CLIENT_DISCONNECTED: &str = "client sent NBD_CMD_DISC";
const SHUTTING_DOWN: &str = "nbdgw shutting down: nothing left in flight";

struct Shared {
    flight: Mutex<Flight>,
    /// Signalled whenever a request completes.
    completed: Notify,
}

/// Requests in flight, and since when there have been none and every
/// reply has been written: the two change together, under one lock, so
/// the idle timeout never sees a request between them.
struct Flight {
    table: InFlightTable,
    idle_since: Option<Instant>,
}

impl Shared {
    fn flight(&self) -> MutexGuard<'_, Flight> {
        // The table stays consistent even if a holder panicked.
        self.flight.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn complete(&self, cookie: u64) {
        self.flight().table.remove(cookie);
        self.completed.notify_waiters();
    }

    fn is_idle(&self) -> bool {
        self.flight().table.is_empty()
    }

    /// Called when every reply so far has been written to the client.
    fn replies_written(&self) {
        let mut flight = self.flight();
        if flight.table.is_empty() && flight.idle_since.is_none() {
            flight.idle_since = Some(Instant::now());
        }
    }
}

pub(super) async fn run(
    session: Box<Session>,
    cork: Option<socket2::Socket>,
    link: &Link<'_>,
) -> Result<&'static str, ConnError> {
    let Session {
        tls,
        upstream,
        mode,
        read_only,
    } = *session;
    let config = link.config;
    let (mut client_rd, mut client_wr) = tokio::io::split(tls);
    let (up_rd, mut up_wr) = upstream.into_split();
    let mut up_rd = BufReader::with_capacity(UPSTREAM_READ_BUF, up_rd);
    let shared = Shared {
        flight: Mutex::new(Flight {
            table: InFlightTable::default(),
            idle_since: Some(Instant::now()),
        }),
        completed: Notify::new(),
    };
    let (local_tx, local_rx) = mpsc::channel(LOCAL_QUEUE);

    let requests = Requests {
        client: &mut client_rd,
        upstream: &mut up_wr,
        shared: &shared,
        local: local_tx,
        mode,
        read_only,
        config,
        stats: link.stats,
        shutdown: link.shutdown.clone(),
    };
    let mut writer = ReplyWriter {
        client: &mut client_wr,
        out: Vec::with_capacity(REPLY_CHUNK),
        cork: cork.as_ref(),
        corked: false,
        per_reply: config.cork == Cork::PerReply,
        config,
        stats: link.stats,
    };
    let result = {
        let mut requests = pin!(requests.run());
        let mut replies = pin!(relay_replies(
            &mut up_rd,
            &mut writer,
            &shared,
            local_rx,
            mode,
            config
        ));
        // The reply side decides when a drained connection ends; the
        // request side ends on its own only with DISC or an error.
        tokio::select! {
            requested = &mut requests => match requested {
                Ok(()) => replies.await,
                Err(e) => Err(e),
            },
            replied = &mut replies => replied,
        }
    };
    if result.is_err() {
        writer.uncork();
    }
    drop(writer);
    if result.is_err() {
        // A hard disconnect still ends TLS properly where it can.
        let _ = tokio::time::timeout(GOODBYE_TIMEOUT, client_wr.shutdown()).await;
    }
    result
}

struct Requests<'a> {
    client: &'a mut ReadHalf<ClientTls>,
    upstream: &'a mut OwnedWriteHalf,
    shared: &'a Shared,
    local: mpsc::Sender<Local>,
    mode: ReplyMode,
    read_only: bool,
    config: &'a Config,
    stats: &'a Stats,
    shutdown: Shutdown,
}

impl Requests<'_> {
    async fn run(self) -> Result<(), ConnError> {
        let Requests {
            client,
            upstream,
            shared,
            local,
            mode,
            read_only,
            config,
            stats,
            mut shutdown,
        } = self;
        let mut told_to_drain = false;
        let header_len = mode.request_header_len();
        let mut header = [0u8; EXTENDED_REQUEST_LEN];
        let mut buf: Vec<u8> = Vec::with_capacity(REQUEST_CHUNK);
        let max_payload = u64::from(config.max_payload);
        loop {
            let header = &mut header[..header_len];
            loop {
                let draining = !told_to_drain;
                match read_request_header(client, header, shared, config, &mut shutdown, draining)
                    .await?
                {
                    HeaderRead::Complete => break,
                    HeaderRead::ShutdownBegan => {
                        told_to_drain = true;
                        if local.send(Local::Drain(SHUTTING_DOWN)).await.is_err() {
                            return Ok(());
                        }
                    }
                }
            }
            let req = Request::parse(mode, header).map_err(ConnError::ClientProto)?;
            let payload = req.payload_len(mode);
            ProtoError::check_limit("request payload", payload, max_payload)
                .map_err(ConnError::ClientProto)?;
            Stats::add(&stats.requests, 1);
            Stats::add(&stats.bytes_from_client, header_len as u64 + payload);

            if req.command == CMD_DISC {
                // qemu-nbd drops requests still in flight when it sees DISC,
                // so it only goes upstream once every reply has come back.
                wait_until_idle(shared).await;
                upstream
                    .write_all(header)
                    .await
                    .map_err(ConnError::Upstream)?;
                // The reply side finishes what is in flight, then closes.
                let _ = local.send(Local::Drain(CLIENT_DISCONNECTED)).await;
                return Ok(());
            }

            claim_cookie(shared, req.cookie, InFlight::from(&req)).await;

            let draining = shutdown.is_draining();
            if let Some((error, message)) = refusal(&req, read_only, max_payload, draining) {
                discard(client, payload, config).await?;
                debug!(
                    command = command_name(req.command),
                    cookie = req.cookie,
                    error,
                    message,
                    "refused request"
                );
                let mut bytes = Vec::new();
                encode_error_reply(
                    mode,
                    req.cookie,
                    &InFlight::from(&req),
                    error,
                    message,
                    &mut bytes,
                );
                if local
                    .send(Local::Reply {
                        cookie: req.cookie,
                        bytes,
                    })
                    .await
                    .is_err()
                {
                    return Ok(());
                }
                continue;
            }

            // Header and the first part of the payload leave in one write.
            buf.clear();
            buf.extend_from_slice(header);
            let mut remaining = payload;
            loop {
                if remaining > 0 {
                    let room = (REQUEST_CHUNK - buf.len()) as u64;
                    let n = within_stall(config, "sending a request payload", async {
                        (&mut *client)
                            .take(remaining.min(room))
                            .read_buf(&mut buf)
                            .await
                            .map_err(ConnError::Client)
                    })
                    .await?;
                    if n == 0 {
                        return Err(ConnError::ClientClosed(
                            "in the middle of a request payload",
                        ));
                    }
                    remaining -= n as u64;
                    if remaining > 0 && buf.len() < REQUEST_CHUNK {
                        continue;
                    }
                }
                upstream
                    .write_all(&buf)
                    .await
                    .map_err(ConnError::Upstream)?;
                buf.clear();
                if remaining == 0 {
                    break;
                }
            }
        }
    }
}

/// What nbdgw answers itself instead of forwarding, if anything.
fn refusal(
    req: &Request,
    read_only: bool,
    max_payload: u64,
    draining: bool,
) -> Option<(u32, &'static str)> {
    if draining {
        Some((ESHUTDOWN, "nbdgw is shutting down"))
    } else if read_only && req.is_modifying() {
        // The spec asks for EPERM; qemu-nbd itself would answer EINVAL.
        Some((EPERM, "nbdgw: the export is read-only"))
    } else if req.command == CMD_READ && req.length > max_payload {
        Some((EINVAL, "nbdgw: read length exceeds --max-payload"))
    } else {
        None
    }
}

enum HeaderRead {
    Complete,
    /// Shutdown began while waiting; the header may still come.
    ShutdownBegan,
}

/// Waits for the next request header. Gives up after the idle timeout,
/// counted from the moment nothing was in flight and every reply had been
/// written; with `watch_shutdown`, returns when a shutdown begins.
async fn read_request_header(
    client: &mut ReadHalf<ClientTls>,
    header: &mut [u8],
    shared: &Shared,
    config: &Config,
    shutdown: &mut Shutdown,
    watch_shutdown: bool,
) -> Result<HeaderRead, ConnError> {
    let mut read = pin!(client.read_exact(header));
    loop {
        let idle_check = config.idle_timeout.map(|idle| {
            let since = shared.flight().idle_since;
            // While busy, look again one idle period from now.
            since.unwrap_or_else(Instant::now) + idle
        });
        tokio::select! {
            read = &mut read => {
                read.map_err(|e| ConnError::client_read(e, "without sending NBD_CMD_DISC"))?;
                shared.flight().idle_since = None;
                return Ok(HeaderRead::Complete);
            }
            () = shutdown.draining(), if watch_shutdown => return Ok(HeaderRead::ShutdownBegan),
            () = sleep_until(idle_check) => {
                let idle = config.idle_timeout.unwrap_or_default();
                let flight = shared.flight();
                if flight.table.is_empty() && flight.idle_since.is_some_and(|t| t.elapsed() >= idle) {
                    return Err(ConnError::IdleTimeout(idle));
                }
            }
        }
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Records the request as in flight. A client that reuses a cookie still
/// in flight is served in order: the second request waits until the
/// first one's last reply has passed, so replies stay unambiguous.
async fn claim_cookie(shared: &Shared, cookie: u64, req: InFlight) {
    wait_for(shared, |flight| {
        let claimed = flight.table.insert(cookie, req);
        if claimed {
            flight.idle_since = None;
        }
        claimed
    })
    .await;
}

async fn wait_until_idle(shared: &Shared) {
    wait_for(shared, |flight| flight.table.is_empty()).await;
}

/// Waits until `ready` holds, checking again after every completion.
async fn wait_for(shared: &Shared, mut ready: impl FnMut(&mut Flight) -> bool) {
    loop {
        let mut completed = pin!(shared.completed.notified());
        // Registered before the check, so a completion in between is not missed.
        completed.as_mut().enable();
        if ready(&mut shared.flight()) {
            return;
        }
        completed.await;
    }
}

/// The client's write side plus the plaintext gathered for it.
struct ReplyWriter<'a> {
    client: &'a mut WriteHalf<ClientTls>,
    out: Vec<u8>,
    cork: Option<&'a socket2::Socket>,
    corked: bool,
    /// Cork every reply and release it at the reply's end (`Cork::PerReply`).
    per_reply: bool,
    config: &'a Config,
    stats: &'a Stats,
}

impl ReplyWriter<'_> {
    fn cork(&mut self) {
        if let (false, Some(socket)) = (self.corked, self.cork) {
            let _ = socket.set_tcp_cork(true);
            self.corked = true;
        }
    }

    fn uncork(&mut self) {
        if let (true, Some(socket)) = (self.corked, self.cork) {
            let _ = socket.set_tcp_cork(false);
            self.corked = false;
        }
    }

    /// Room left before the buffer must go out.
    fn room(&self) -> usize {
        REPLY_CHUNK - self.out.len()
    }

    /// Appends bytes, sending full chunks as they fill.
    async fn append(&mut self, mut bytes: &[u8]) -> Result<(), ConnError> {
        while !bytes.is_empty() {
            if self.room() == 0 {
                self.send_more().await?;
            }
            let n = self.room().min(bytes.len());
            self.out.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
        }
        Ok(())
    }

    /// The buffer is full and more of the burst follows: cork first, so
    /// the partial segment at its end waits for the rest.
    async fn send_more(&mut self) -> Result<(), ConnError> {
        self.cork();
        self.send().await
    }

    /// Hands the buffer to rustls and flushes it to the socket. A burst
    /// small enough to leave in one write goes out as whole segments with
    /// TCP_NODELAY alone, saving the two cork syscalls per reply that QD1
    /// traffic would otherwise pay.
    async fn send(&mut self) -> Result<(), ConnError> {
        if self.out.is_empty() {
            return Ok(());
        }
        if self.per_reply || self.out.len() > UNCORKED_BURST_MAX {
            self.cork();
        }
        let (client, out) = (&mut self.client, &self.out);
        within_stall(self.config, "reading replies", async {
            client.write_all(out).await.map_err(ConnError::Client)?;
            client.flush().await.map_err(ConnError::Client)
        })
        .await?;
        Stats::add(&self.stats.bytes_to_client, self.out.len() as u64);
        self.out.clear();
        Ok(())
    }

    /// Nothing more is waiting: send what is held and let TCP go.
    async fn end_burst(&mut self) -> Result<(), ConnError> {
        self.send().await?;
        self.uncork();
        Ok(())
    }
}

enum Next {
    Local(Option<Local>),
    Upstream,
    UpstreamEof,
}

async fn relay_replies(
    upstream: &mut BufReader<OwnedReadHalf>,
    writer: &mut ReplyWriter<'_>,
    shared: &Shared,
    mut local: mpsc::Receiver<Local>,
    mode: ReplyMode,
    config: &Config,
) -> Result<&'static str, ConnError> {
    // Room for the largest payload plus a chunk's fixed overhead and an
    // error message.
    let max_reply = u64::from(config.max_payload).max(u64::from(DEFAULT_MAX_PAYLOAD)) + 8192;
    let mut header = [0u8; EXTENDED_REPLY_LEN];
    let mut draining = None;
    let mut local_open = true;
    loop {
        if let (Some(reason), true) = (draining, shared.is_idle()) {
            writer.end_burst().await?;
            // close_notify: the client knows every reply has arrived.
            let _ = tokio::time::timeout(GOODBYE_TIMEOUT, writer.client.shutdown()).await;
            return Ok(reason);
        }
        let next = match next_ready(upstream, &mut local, local_open).await? {
            Some(next) => next,
            None => {
                writer.end_burst().await?;
                shared.replies_written();
                next_waiting(upstream, &mut local, local_open).await?
            }
        };
        match next {
            Next::Local(Some(Local::Reply { cookie, bytes })) => {
                writer.append(&bytes).await?;
                shared.complete(cookie);
                Stats::add(&writer.stats.replies, 1);
                if writer.per_reply {
                    writer.end_burst().await?;
                }
            }
            Next::Local(Some(Local::Drain(reason))) => draining = Some(reason),
            Next::Local(None) => {
                local_open = false;
                draining = draining.or(Some(CLIENT_DISCONNECTED));
            }
            Next::UpstreamEof => {
                let in_flight = shared.flight().table.len();
                if !(draining.is_some() && in_flight == 0) {
                    writer.end_burst().await?;
                    return Err(ConnError::UpstreamClosed(format!(
                        "with {in_flight} requests in flight"
                    )));
                }
            }
            Next::Upstream => {
                let done =
                    relay_one_reply(upstream, writer, shared, mode, max_reply, &mut header).await?;
                if done && writer.per_reply {
                    writer.end_burst().await?;
                }
            }
        }
    }
}

/// What can be handled without waiting, if anything.
async fn next_ready(
    upstream: &mut BufReader<OwnedReadHalf>,
    local: &mut mpsc::Receiver<Local>,
    local_open: bool,
) -> Result<Option<Next>, ConnError> {
    if local_open {
        match local.try_recv() {
            Ok(m) => return Ok(Some(Next::Local(Some(m)))),
            Err(mpsc::error::TryRecvError::Disconnected) => return Ok(Some(Next::Local(None))),
            Err(mpsc::error::TryRecvError::Empty) => {}
        }
    }
    poll_fn(|cx| match Pin::new(&mut *upstream).poll_fill_buf(cx) {
        Poll::Ready(Ok([])) => Poll::Ready(Ok(Some(Next::UpstreamEof))),
        Poll::Ready(Ok(_)) => Poll::Ready(Ok(Some(Next::Upstream))),
        Poll::Ready(Err(e)) => Poll::Ready(Err(ConnError::Upstream(e))),
        Poll::Pending => Poll::Ready(Ok(None)),
    })
    .await
}

/// Waits for the upstream or a local reply.
async fn next_waiting(
    upstream: &mut BufReader<OwnedReadHalf>,
    local: &mut mpsc::Receiver<Local>,
    local_open: bool,
) -> Result<Next, ConnError> {
    let upstream_ready = poll_fn(|cx| {
        Pin::new(&mut *upstream)
            .poll_fill_buf(cx)
            .map_ok(|b| b.is_empty())
    });
    tokio::select! {
        biased;
        m = local.recv(), if local_open => Ok(Next::Local(m)),
        r = upstream_ready => match r {
            Ok(true) => Ok(Next::UpstreamEof),
            Ok(false) => Ok(Next::Upstream),
            Err(e) => Err(ConnError::Upstream(e)),
        },
    }
}

async fn relay_one_reply(
    upstream: &mut BufReader<OwnedReadHalf>,
    writer: &mut ReplyWriter<'_>,
    shared: &Shared,
    mode: ReplyMode,
    max_reply: u64,
    header: &mut [u8; EXTENDED_REPLY_LEN],
) -> Result<bool, ConnError> {
    let eof = |e| ConnError::upstream_read(e, "in the middle of a reply");
    // The magic tells how long the header is.
    upstream.read_exact(&mut header[..4]).await.map_err(eof)?;
    let magic = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
    let header_len = reply_header_len(mode, magic).map_err(ConnError::UpstreamProto)?;
    upstream
        .read_exact(&mut header[4..header_len])
        .await
        .map_err(eof)?;
    let frame = parse_reply(
        mode,
        &header[..header_len],
        &shared.flight().table,
        max_reply,
    )
    .map_err(ConnError::UpstreamProto)?;

    writer.append(&header[..header_len]).await?;
    let mut remaining = frame.payload_len;
    while remaining > 0 {
        if writer.room() == 0 {
            writer.send_more().await?;
        }
        let want = remaining.min(writer.room() as u64);
        // Straight into the spare capacity of the reply buffer: no zeroing,
        // no intermediate copy for large payloads.
        let n = (&mut *upstream)
            .take(want)
            .read_buf(&mut writer.out)
            .await
            .map_err(ConnError::Upstream)?;
        if n == 0 {
            return Err(ConnError::UpstreamClosed(
                "in the middle of a reply payload".into(),
            ));
        }
        remaining -= n as u64;
    }
    if frame.done {
        shared.complete(frame.cookie);
        Stats::add(&writer.stats.replies, 1);
    }
    Ok(frame.done)
}
