//! Upstream to client: relays each reply (or a reply nbdgw made itself)
//! through the reply writer, keeps filling while more is already waiting,
//! and ends the burst when nothing is.

use std::collections::HashMap;
use std::future::poll_fn;
use std::pin::Pin;
use std::task::Poll;

use tokio::io::{AsyncBufRead, AsyncRead, AsyncReadExt, AsyncWrite};

use crate::conn::buffered::Buffered;
use tokio::sync::mpsc;

use super::cache::{Filling, Purpose, ReplyLayer};
use super::flight::Flight;
use super::local::{Local, CLIENT_DISCONNECTED, SHUTTING_DOWN};
use super::writer::ReplyWriter;
use crate::conn::error::{ConnError, Side};
use crate::proto::consts::*;
use crate::proto::transmission::{
    check_error_payload, encode_error_reply, encode_read_reply_header, parse_reply,
    reply_header_len, InFlight, ReplyFrame, ReplyMode, Request,
};
use crate::proto::{be_u32, be_u64};
use crate::shutdown::Shutdown;

/// Beyond its payload, a reply chunk carries its own fields: an offset, an
/// error code and a message of at most 4 KiB, block-status descriptors.
/// 8 KiB covers them all.
const REPLY_FIELDS_ALLOWANCE: u64 = 8192;

/// The longest reply payload accepted from the upstream, for `--max-payload`.
pub fn max_reply(max_payload: u32) -> u64 {
    u64::from(max_payload).max(u64::from(DEFAULT_MAX_PAYLOAD)) + REPLY_FIELDS_ALLOWANCE
}
/// At shutdown, how long a connection with nothing left in flight stays
/// open for requests already on their way: a client that sent one just
/// as the last reply left gets ESHUTDOWN for it, not a close with a
/// request unanswered (libnbd then fails it with ENOTCONN). One window,
/// from when the flight first empties after the drain: a client that
/// keeps sending gets ESHUTDOWN for what arrives within it, then the
/// close, rather than holding the connection until the grace period cuts
/// it. A few round trips of a slow link; an idle session still closes in
/// a blink.
const SHUTDOWN_LINGER: std::time::Duration = std::time::Duration::from_millis(250);
/// Client reads on a cached session longer than this are relayed as they
/// come, wholly uncached: a client's long reads would otherwise keep a
/// buffer as long as `--max-payload` on its connection. Fill reads (at
/// most `MAX_HIT` and a block either side) always fit.
const TEE_MAX: u64 = super::cache::MAX_HIT + 2 * crate::cache::BLOCK_SIZE + 8;

pub struct Replies<'a, U> {
    upstream: Buffered<U>,
    flight: &'a Flight,
    local: mpsc::Receiver<Local>,
    local_open: bool,
    mode: ReplyMode,
    /// Longest reply payload accepted from the upstream.
    max_reply: u64,
    /// Set by DISC or shutdown: finish what is in flight, then close.
    draining: Option<&'static str>,
    /// The gateway's shutdown, watched here rather than passed through the
    /// local queue: a full queue (cache hits or refusals behind a client
    /// that reads slowly) must not keep the drain from starting, nor the
    /// relay from polling either side while it waits.
    shutdown: Shutdown,
    /// When the shutdown's wait for requests already sent ends.
    linger_until: Option<tokio::time::Instant>,
    /// Whether a drained connection waits for requests already sent
    /// (answered ESHUTDOWN); with `DrainAnswer::Close` it does not: they
    /// go unanswered, and the close tells the client so.
    lingers: bool,
    /// The read cache, on an immutable export: read data fills it.
    cache: Option<ReplyLayer<'a>>,
    /// Read reply payload on its way into the cache (and the client).
    scratch: Vec<u8>,
    /// Fill reads whose replies have begun, by nbdgw's cookie: one at a
    /// time from an upstream that sends each reply's chunks together.
    fills: HashMap<u64, Filling>,
}

enum Next {
    Local(Option<Local>),
    Upstream,
    UpstreamEof,
}

impl<'a, U: AsyncRead + Unpin> Replies<'a, U> {
    pub fn new(
        upstream: Buffered<U>,
        flight: &'a Flight,
        local: mpsc::Receiver<Local>,
        (mode, max_payload): (ReplyMode, u32),
        shutdown: Shutdown,
    ) -> Self {
        Replies {
            shutdown,
            upstream,
            flight,
            local,
            local_open: true,
            mode,
            max_reply: max_reply(max_payload),
            draining: None,
            linger_until: None,
            lingers: true,
            cache: None,
            scratch: Vec::new(),
            fills: HashMap::new(),
        }
    }

    /// Whether a drained connection lingers for requests already sent.
    pub fn lingering(mut self, lingers: bool) -> Self {
        self.lingers = lingers;
        self
    }

    pub fn cached(mut self, cache: Option<ReplyLayer<'a>>) -> Self {
        self.cache = cache;
        self
    }

    /// Relays replies until a drain is complete (returns why the
    /// connection ends) or something fails.
    pub async fn run<W: AsyncWrite + Unpin>(
        mut self,
        writer: &mut ReplyWriter<'_, W>,
    ) -> Result<&'static str, ConnError> {
        loop {
            if self.draining.is_none() && self.shutdown.is_draining() {
                self.draining = Some(SHUTTING_DOWN);
            }
            if let (Some(reason), true) = (self.draining, self.flight.is_empty()) {
                if reason == CLIENT_DISCONNECTED || !self.local_open || !self.lingers {
                    return Ok(reason);
                }
                // Shutting down: what was written goes out now; then wait
                // briefly for requests already sent (refused by the request
                // side with ESHUTDOWN) or the client's DISC.
                writer.end_burst().await?;
                self.flight.replies_written();
                let until = *self
                    .linger_until
                    .get_or_insert_with(|| tokio::time::Instant::now() + SHUTDOWN_LINGER);
                match tokio::time::timeout_at(until, self.local.recv()).await {
                    Err(_) => return Ok(reason),
                    Ok(m) => {
                        self.handle_local(m, writer).await?;
                        continue;
                    }
                }
            }
            let next = match self.next_ready().await? {
                Some(next) => next,
                None => {
                    writer.end_burst().await?;
                    self.flight.replies_written();
                    self.next_waiting().await?
                }
            };
            match next {
                Next::Local(m) => self.handle_local(m, writer).await?,
                Next::UpstreamEof => {
                    // What the upstream did answer still reaches the client.
                    writer.end_burst().await?;
                    self.upstream_ended()?
                }
                Next::Upstream => self.relay_one(writer).await?,
            }
        }
    }

    /// A message from the request side: a reply nbdgw made, a drain, or
    /// (`None`) the request side ended.
    async fn handle_local<W: AsyncWrite + Unpin>(
        &mut self,
        message: Option<Local>,
        writer: &mut ReplyWriter<'_, W>,
    ) -> Result<(), ConnError> {
        match message {
            Some(Local::Reply { cookie, bytes }) => {
                writer.append(&bytes).await?;
                self.finish(cookie, writer).await?;
            }
            Some(Local::Data {
                cookie,
                header,
                data,
            }) => {
                writer.append(&header).await?;
                for block in &data {
                    writer.append(block).await?;
                }
                self.finish(cookie, writer).await?;
            }
            // A DISC while shutting down ends the wait above.
            Some(Local::Drain(reason)) => {
                self.draining = match self.draining {
                    Some(CLIENT_DISCONNECTED) => Some(CLIENT_DISCONNECTED),
                    _ => Some(reason),
                }
            }
            None => {
                self.local_open = false;
                self.draining = self.draining.or(Some(CLIENT_DISCONNECTED));
            }
        }
        Ok(())
    }

    /// The upstream closed: fine only once the client's DISC has drained.
    fn upstream_ended(&self) -> Result<(), ConnError> {
        let in_flight = self.flight.lock().table.len();
        if self.draining.is_some() && in_flight == 0 {
            return Ok(());
        }
        Err(ConnError::UpstreamGone(in_flight))
    }

    /// What can be handled without waiting, if anything.
    async fn next_ready(&mut self) -> Result<Option<Next>, ConnError> {
        if self.local_open {
            match self.local.try_recv() {
                Ok(m) => return Ok(Some(Next::Local(Some(m)))),
                Err(mpsc::error::TryRecvError::Disconnected) => return Ok(Some(Next::Local(None))),
                Err(mpsc::error::TryRecvError::Empty) => {}
            }
        }
        let upstream = &mut self.upstream;
        poll_fn(|cx| match Pin::new(&mut *upstream).poll_fill_buf(cx) {
            Poll::Ready(Ok([])) => Poll::Ready(Ok(Some(Next::UpstreamEof))),
            Poll::Ready(Ok(_)) => Poll::Ready(Ok(Some(Next::Upstream))),
            Poll::Ready(Err(e)) => Poll::Ready(Err(ConnError::Io {
                side: Side::Upstream,
                error: e,
            })),
            Poll::Pending => Poll::Ready(Ok(None)),
        })
        .await
    }

    /// Waits for the upstream or a local reply.
    async fn next_waiting(&mut self) -> Result<Next, ConnError> {
        let upstream = &mut self.upstream;
        let upstream_ready = poll_fn(|cx| {
            Pin::new(&mut *upstream)
                .poll_fill_buf(cx)
                .map_ok(|b| b.is_empty())
        });
        let watch_shutdown = self.draining.is_none();
        tokio::select! {
            biased;
            m = self.local.recv(), if self.local_open => Ok(Next::Local(m)),
            () = self.shutdown.draining(), if watch_shutdown => {
                Ok(Next::Local(Some(Local::Drain(SHUTTING_DOWN))))
            }
            r = upstream_ready => match r {
                Ok(true) => Ok(Next::UpstreamEof),
                Ok(false) => Ok(Next::Upstream),
                Err(error) => Err(ConnError::Io { side: Side::Upstream, error }),
            },
        }
    }

    /// One reply message: header (its magic tells how long), then its
    /// payload straight into the writer (or, read whole, into the cache).
    async fn relay_one<W: AsyncWrite + Unpin>(
        &mut self,
        writer: &mut ReplyWriter<'_, W>,
    ) -> Result<(), ConnError> {
        let mut header = [0u8; EXTENDED_REPLY_LEN];
        let (header_len, frame) = self.read_header(&mut header).await?;
        // parse_reply found the cookie in flight.
        let req = self.flight.lock().table.get(frame.cookie);
        // A reply to nbdgw's own read fills the cache, and reaches the
        // client only as the answer to the read it was widened from.
        let purpose = self
            .cache
            .as_ref()
            .and_then(|c| c.ahead.purpose(frame.cookie));
        let ours = purpose.is_some();
        if !ours {
            writer.append(&header[..header_len]).await?;
        }
        if frame.is_error_chunk() {
            self.relay_error_chunk(&frame, req.as_ref(), purpose, writer)
                .await?;
        } else {
            self.relay_payload(&frame, req.as_ref(), purpose, writer)
                .await?;
        }
        if frame.simple_error != 0 {
            if !ours {
                writer.metrics().error(frame.simple_error);
            } else if let Some(filling) = self.filling(frame.cookie, req.as_ref(), purpose) {
                filling.error(frame.simple_error);
            }
        }
        if frame.done {
            self.reply_done(frame.cookie, purpose, writer).await?;
        }
        Ok(())
    }

    /// A reply's header, into `header`: its length and what it says.
    async fn read_header(
        &mut self,
        header: &mut [u8; EXTENDED_REPLY_LEN],
    ) -> Result<(usize, ReplyFrame), ConnError> {
        let eof = || ConnError::io(Side::Upstream, "in the middle of a reply");
        self.upstream
            .read_exact(&mut header[..4])
            .await
            .map_err(eof())?;
        let magic = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
        let header_len =
            reply_header_len(self.mode, magic).map_err(ConnError::proto(Side::Upstream))?;
        self.upstream
            .read_exact(&mut header[4..header_len])
            .await
            .map_err(eof())?;
        let frame = parse_reply(
            self.mode,
            &header[..header_len],
            &self.flight.lock().table,
            self.max_reply,
        )
        .map_err(ConnError::proto(Side::Upstream))?;
        Ok((header_len, frame))
    }

    /// An error chunk: small (a message of at most 4 KiB), read whole and
    /// checked, so a message longer than its chunk never reaches the
    /// client.
    async fn relay_error_chunk<W: AsyncWrite + Unpin>(
        &mut self,
        frame: &ReplyFrame,
        req: Option<&InFlight>,
        purpose: Option<Purpose>,
        writer: &mut ReplyWriter<'_, W>,
    ) -> Result<(), ConnError> {
        let eof = || ConnError::io(Side::Upstream, "in the middle of a reply");
        let mut payload = vec![0u8; frame.payload_len as usize];
        self.upstream
            .read_exact(&mut payload)
            .await
            .map_err(eof())?;
        check_error_payload(frame.kind, &payload).map_err(ConnError::proto(Side::Upstream))?;
        let error = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
        if purpose.is_some() {
            if let Some(filling) = self.filling(frame.cookie, req, purpose) {
                filling.error(error);
            }
        } else {
            writer.metrics().error(error);
            writer.append(&payload).await?;
        }
        Ok(())
    }

    /// A chunk's payload (not an error's): streamed to the client as it
    /// comes, or, for a read whose reply the cache takes, read whole and
    /// given to the cache on its way. Whether the cache takes a reply is
    /// decided by the read, not by each chunk: nbdgw's own reads, and
    /// client reads at most `TEE_MAX` long. A longer client read is
    /// relayed wholly uncached, so that no chunk of it is cached without
    /// every other chunk of its reply having been seen (a small chunk
    /// could overlap a long one streamed past unrecorded).
    async fn relay_payload<W: AsyncWrite + Unpin>(
        &mut self,
        frame: &ReplyFrame,
        req: Option<&InFlight>,
        purpose: Option<Purpose>,
        writer: &mut ReplyWriter<'_, W>,
    ) -> Result<(), ConnError> {
        let ours = purpose.is_some();
        let teed = req
            .filter(|r| r.command == CMD_READ)
            .filter(|r| self.cache.is_some() && (ours || r.length <= TEE_MAX));
        let Some(req) = teed.filter(|_| frame.payload_len > 0) else {
            return writer
                .append_from(&mut self.upstream, frame.payload_len)
                .await;
        };
        // parse_reply holds each chunk to the read it answers (data no
        // longer than the read, after its 8-byte offset; a hole of 12
        // bytes): what is buffered is at most a read nbdgw tees, `TEE_MAX`
        // or its own read-ahead (`--read-ahead`, at most `--max-payload`).
        self.read_into_cache(frame, req, purpose).await?;
        if !ours {
            writer.append(&self.scratch).await?;
        }
        // A long read-ahead reply must not leave its buffer behind on
        // every idle connection.
        if self.scratch.capacity() > TEE_MAX as usize {
            self.scratch = Vec::new();
        }
        Ok(())
    }

    /// `cookie`'s reply is complete: a client's is finished, one of
    /// nbdgw's own leaves the flight (and a fill answers its client).
    async fn reply_done<W: AsyncWrite + Unpin>(
        &mut self,
        cookie: u64,
        purpose: Option<Purpose>,
        writer: &mut ReplyWriter<'_, W>,
    ) -> Result<(), ConnError> {
        if let Some(cache) = &self.cache {
            cache.reply_done(cookie);
        }
        let Some(purpose) = purpose else {
            return self.finish(cookie, writer).await;
        };
        if let Some(cache) = &self.cache {
            // Before completing, so that a client request reusing the
            // cookie is never taken for one of nbdgw's.
            cache.ahead.done(cookie);
        }
        self.flight.complete(cookie);
        let filling = self.fills.remove(&cookie);
        if let Purpose::Fill(request) = purpose {
            self.answer_fill(&request, filling, writer).await?;
        }
        Ok(())
    }

    /// The fill read `cookie` (of `req`) as its reply has come so far;
    /// `None` for a read-ahead, which answers no one.
    fn filling(
        &mut self,
        cookie: u64,
        req: Option<&InFlight>,
        purpose: Option<Purpose>,
    ) -> Option<&mut Filling> {
        let (Some(req), Some(Purpose::Fill(_))) = (req, purpose) else {
            return None;
        };
        Some(
            self.fills
                .entry(cookie)
                .or_insert_with(|| Filling::new(req)),
        )
    }

    /// Answers the client's read a fill read was made for: its bytes from
    /// the fill, or the upstream's error.
    async fn answer_fill<W: AsyncWrite + Unpin>(
        &mut self,
        request: &Request,
        filling: Option<Filling>,
        writer: &mut ReplyWriter<'_, W>,
    ) -> Result<(), ConnError> {
        let answer = match (filling, &self.cache) {
            (Some(filling), Some(cache)) => {
                let handle = &cache.handle;
                filling.finish(
                    request,
                    |at, blocks| handle.fill(at, blocks, false),
                    |fault, range, what| handle.upstream_fault(fault, range, what),
                )
            }
            // A reply with no data, hole or error for a read.
            _ => Err(EIO),
        };
        let mut header = Vec::with_capacity(64);
        match answer {
            Ok(data) => {
                encode_read_reply_header(
                    self.mode,
                    request.cookie,
                    request.offset,
                    request.length,
                    &mut header,
                );
                writer.append(&header).await?;
                writer.append(&data).await?;
            }
            Err(error) => {
                let in_flight = InFlight::from(request);
                let message = "nbdgw: the upstream failed the read";
                encode_error_reply(
                    self.mode,
                    request.cookie,
                    &in_flight,
                    error,
                    message,
                    &mut header,
                );
                writer.metrics().error(error);
                writer.append(&header).await?;
            }
        }
        self.finish(request.cookie, writer).await
    }

    /// Reads a reply payload on a cached session into `scratch`, and gives
    /// what it says of the export's bytes to the cache: a simple reply's
    /// data, an OFFSET_DATA chunk, an OFFSET_HOLE chunk.
    async fn read_into_cache(
        &mut self,
        frame: &ReplyFrame,
        req: &InFlight,
        purpose: Option<Purpose>,
    ) -> Result<(), ConnError> {
        // Bounded by parse_reply: at most the read's length and a chunk's
        // fields. Read into spare capacity, which is not zeroed first.
        self.scratch.clear();
        self.scratch.reserve(frame.payload_len as usize);
        let read = (&mut self.upstream)
            .take(frame.payload_len)
            .read_to_end(&mut self.scratch)
            .await
            .map_err(ConnError::io(Side::Upstream, "in the middle of a reply"))?;
        if read as u64 != frame.payload_len {
            return Err(ConnError::closed(
                Side::Upstream,
                "in the middle of a reply",
            ));
        }
        if let Some(Purpose::Fill(_)) = purpose {
            let filling = self
                .fills
                .entry(frame.cookie)
                .or_insert_with(|| Filling::new(req));
            fill_from_chunk(filling, frame, req, &self.scratch);
            return Ok(());
        }
        let Some(cache) = &self.cache else {
            return Ok(());
        };
        let payload = &self.scratch[..];
        let ours = purpose.is_some();
        match (frame.kind, chunk_offset(payload)) {
            (0, _) if frame.simple_error == 0 => {
                cache.data(frame.cookie, req, req.offset, payload, ours)
            }
            (REPLY_TYPE_OFFSET_DATA, Some(offset)) => {
                cache.data(frame.cookie, req, offset, &payload[8..], ours)
            }
            (REPLY_TYPE_OFFSET_HOLE, Some(offset)) => {
                if let Some(len) = payload.get(8..12) {
                    cache.hole(frame.cookie, req, offset, be_u32(len, 0).into(), ours);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// A request's last reply is in the writer.
    async fn finish<W: AsyncWrite + Unpin>(
        &self,
        cookie: u64,
        writer: &mut ReplyWriter<'_, W>,
    ) -> Result<(), ConnError> {
        if let Some((command, took)) = self.flight.complete(cookie) {
            writer.metrics().answered(command_name(command), took);
        }
        writer.end_of_reply().await
    }
}

/// The offset an OFFSET_DATA or OFFSET_HOLE chunk's payload starts with.
fn chunk_offset(payload: &[u8]) -> Option<u64> {
    payload.get(..8).map(|b| be_u64(b, 0))
}

/// What a chunk of a fill read's reply (`payload`, of `frame`) says of
/// the export's bytes, into the fill.
fn fill_from_chunk(filling: &mut Filling, frame: &ReplyFrame, req: &InFlight, payload: &[u8]) {
    match (frame.kind, chunk_offset(payload)) {
        (0, _) if frame.simple_error == 0 => filling.data(req.offset, payload),
        (REPLY_TYPE_OFFSET_DATA, Some(offset)) => filling.data(offset, &payload[8..]),
        (REPLY_TYPE_OFFSET_HOLE, Some(offset)) => match payload.get(8..12) {
            Some(len) => filling.hole(offset, be_u32(len, 0).into()),
            None => filling.error(EIO),
        },
        _ => filling.error(EIO),
    }
}
