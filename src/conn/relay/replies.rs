//! Upstream to client: relays each reply (or a reply nbdgw made itself)
//! through the reply writer, keeps filling while more is already waiting,
//! and ends the burst when nothing is. The layers see each reply chunk on
//! its way, and may claim it (a reply to a request of their own).

use std::future::poll_fn;
use std::pin::Pin;
use std::task::Poll;

use tokio::io::{AsyncBufRead, AsyncRead, AsyncReadExt, AsyncWrite};

use crate::conn::buffered::Buffered;
use tokio::sync::mpsc;

use super::flight::Flight;
use super::layers::{Answer, OnReply, Take};
use super::local::{Local, CLIENT_DISCONNECTED, SHUTTING_DOWN};
use super::writer::ReplyWriter;
use crate::conn::error::{ConnError, Side};
use crate::proto::consts::*;
use crate::proto::transmission::{
    check_error_payload, parse_reply, reply_header_len, InFlight, ReplyFrame, ReplyMode,
};
use crate::proto::ProtoError;
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
/// A buffer for payloads the layers see larger than this is not kept
/// once used: a long read-ahead reply must not leave its buffer behind on
/// every idle connection. The loop's own figure, not a layer's: a layer
/// that tees longer payloads still works, it only allocates per reply
/// (the cache checks that its tees, up to `TEE_MAX`, fit).
pub(in crate::conn::relay) const SCRATCH_KEPT: usize = (2 << 20) + (256 << 10);

pub struct Replies<'a, U, L> {
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
    /// The reply halves of the relay's layers.
    layers: L,
    /// A reply payload the layers see, on its way to them (and the
    /// client).
    scratch: Vec<u8>,
}

enum Next {
    Local(Option<Local>),
    Upstream,
    UpstreamEof,
}

impl<'a, U: AsyncRead + Unpin, L: OnReply> Replies<'a, U, L> {
    pub fn new(
        upstream: Buffered<U>,
        flight: &'a Flight,
        local: mpsc::Receiver<Local>,
        (mode, max_payload): (ReplyMode, u32),
        shutdown: Shutdown,
        layers: L,
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
            layers,
            scratch: Vec::new(),
        }
    }

    /// Whether a drained connection lingers for requests already sent.
    pub fn lingering(mut self, lingers: bool) -> Self {
        self.lingers = lingers;
        self
    }

    /// Relays replies until a drain is complete (returns why the
    /// connection ends) or something fails.
    pub async fn run<W: AsyncWrite + Unpin>(
        &mut self,
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
}

/// One reply from the upstream, on its way through the layers.
impl<U: AsyncRead + Unpin, L: OnReply> Replies<'_, U, L> {
    /// One reply message: header (its magic tells how long), then its
    /// payload straight into the writer, or, for a reply the layers see,
    /// read whole and shown to them first; a reply a layer claims never
    /// reaches the client.
    async fn relay_one<W: AsyncWrite + Unpin>(
        &mut self,
        writer: &mut ReplyWriter<'_, W>,
    ) -> Result<(), ConnError> {
        let mut header = [0u8; EXTENDED_REPLY_LEN];
        let (header_len, frame) = self.read_header(&mut header).await?;
        // parse_reply found the cookie in flight.
        let req = self.flight.lock().table.get(frame.cookie);
        let req = req.ok_or(ProtoError::UnknownCookie(frame.cookie));
        let req = req.map_err(ConnError::proto(Side::Upstream))?;
        let take = self.layers.take(frame.cookie, &req);
        let claimed = take == Take::Claim;
        if !claimed {
            writer.append(&header[..header_len]).await?;
        }
        if frame.is_error_chunk() {
            self.relay_error_chunk(&frame, &req, claimed, writer)
                .await?;
        } else if take == Take::Pass || frame.payload_len == 0 {
            writer
                .append_from(&mut self.upstream, frame.payload_len)
                .await?;
        } else {
            self.relay_seen(&frame, &req, claimed, writer).await?;
        }
        if frame.simple_error != 0 {
            let error = frame.simple_error;
            self.layers.error(frame.cookie, &req, error, claimed);
        }
        if frame.done {
            self.reply_done(frame.cookie, claimed, writer).await?;
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
        req: &InFlight,
        claimed: bool,
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
        self.layers.error(frame.cookie, req, error, claimed);
        if !claimed {
            writer.append(&payload).await?;
        }
        Ok(())
    }

    /// A chunk's payload (not an error's) that a layer claimed or teed:
    /// read whole into `scratch`, shown to the layers, then (unless
    /// claimed) relayed. parse_reply holds each chunk to the request it
    /// answers (data no longer than a read, after its 8-byte offset; a
    /// hole of 12 bytes), and the layers see only replies they bound (the
    /// cache: reads up to `TEE_MAX`, and its own reads, at most
    /// `--max-payload`).
    async fn relay_seen<W: AsyncWrite + Unpin>(
        &mut self,
        frame: &ReplyFrame,
        req: &InFlight,
        claimed: bool,
        writer: &mut ReplyWriter<'_, W>,
    ) -> Result<(), ConnError> {
        self.read_scratch(frame.payload_len).await?;
        self.layers.payload(frame, req, &self.scratch, claimed);
        if !claimed {
            writer.append(&self.scratch).await?;
        }
        if self.scratch.capacity() > SCRATCH_KEPT {
            self.scratch = Vec::new();
        }
        Ok(())
    }

    /// `cookie`'s reply is complete: a client's is finished; one a layer
    /// claimed leaves the flight, and may answer a client's request.
    async fn reply_done<W: AsyncWrite + Unpin>(
        &mut self,
        cookie: u64,
        claimed: bool,
        writer: &mut ReplyWriter<'_, W>,
    ) -> Result<(), ConnError> {
        let answer = self.layers.done(cookie, claimed);
        if !claimed {
            return self.finish(cookie, writer).await;
        }
        self.flight.complete(cookie);
        match answer {
            Some(answer) => self.answer(answer, writer).await,
            None => Ok(()),
        }
    }

    /// A client's request answered by a layer.
    async fn answer<W: AsyncWrite + Unpin>(
        &mut self,
        answer: Answer,
        writer: &mut ReplyWriter<'_, W>,
    ) -> Result<(), ConnError> {
        if let Some(error) = answer.error {
            self.layers
                .error(answer.cookie, &answer.request, error, false);
        }
        writer.append(&answer.bytes).await?;
        writer.append(&answer.data).await?;
        self.finish(answer.cookie, writer).await
    }

    /// Reads `len` bytes of reply payload into `scratch`, into spare
    /// capacity, which is not zeroed first.
    async fn read_scratch(&mut self, len: u64) -> Result<(), ConnError> {
        self.scratch.clear();
        self.scratch.reserve(len as usize);
        let read = (&mut self.upstream)
            .take(len)
            .read_to_end(&mut self.scratch)
            .await
            .map_err(ConnError::io(Side::Upstream, "in the middle of a reply"))?;
        if read as u64 != len {
            return Err(ConnError::closed(
                Side::Upstream,
                "in the middle of a reply",
            ));
        }
        Ok(())
    }

    /// A request's last reply is in the writer.
    async fn finish<W: AsyncWrite + Unpin>(
        &mut self,
        cookie: u64,
        writer: &mut ReplyWriter<'_, W>,
    ) -> Result<(), ConnError> {
        if let Some((command, took)) = self.flight.complete(cookie) {
            self.layers.answered(command, took);
        }
        writer.end_of_reply().await
    }
}

impl<U, L> Replies<'_, U, L> {
    /// The upstream's read half, once quiet (a hand-over): anything it
    /// read ahead is a reply to no request, so it must be nothing.
    pub fn into_upstream(self) -> Result<U, ConnError> {
        let ahead = self.upstream.buffer().len();
        if ahead != 0 {
            let why = format!("{ahead} bytes from the upstream answer no request");
            let error = std::io::Error::new(std::io::ErrorKind::InvalidData, why);
            return Err(ConnError::io(Side::Upstream, "at a hand-over")(error));
        }
        Ok(self.upstream.into_inner())
    }
}
