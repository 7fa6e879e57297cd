//! Client to upstream: reads each request, answers locally what nbdgw
//! refuses (through the reply side, the only writer to the client), and
//! forwards the rest with their payload.

use std::pin::pin;
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tracing::debug;

use super::cache::RequestLayer;
use super::flight::Flight;
use super::local::{Local, CLIENT_DISCONNECTED};
use crate::conn::error::{ConnError, Side};
use crate::conn::session::{within_stall, Limits, Transmit};
use crate::proto::consts::*;
use crate::proto::transmission::{encode_error_reply, InFlight, ReplyMode, Request};
use crate::proto::ProtoError;
use crate::shutdown::{DrainAnswer, Shutdown};

/// Request payload is forwarded upstream in pieces of this size, with
/// room for the header, so that a 256 KiB write (nbdcopy's and fio's usual
/// size) leaves in one piece instead of 256 KiB and a 28-byte tail.
const REQUEST_CHUNK: usize = 256 * 1024 + EXTENDED_REQUEST_LEN;

/// Generic over the halves: the server mode reads a TLS client and writes
/// a Unix socket, the client mode reads a plaintext local client and
/// writes TLS to the remote server.
pub struct Requests<'a, C, U> {
    client: C,
    upstream: U,
    flight: &'a Flight,
    local: mpsc::Sender<Local>,
    mode: ReplyMode,
    read_only: bool,
    link: &'a Transmit<'a>,
    shutdown: Shutdown,
    /// Header and the first part of the payload, then further pieces.
    buf: Vec<u8>,
    /// The session's registration, which a reload may end.
    registered: Option<&'a crate::tls::SessionGuard>,
    /// The read cache, on an immutable export.
    cache: Option<RequestLayer<'a>>,
}

impl<'a, C: AsyncRead + Unpin, U: AsyncWrite + Unpin> Requests<'a, C, U> {
    pub fn new(
        (client, upstream): (C, U),
        flight: &'a Flight,
        local: mpsc::Sender<Local>,
        (mode, read_only): (ReplyMode, bool),
        link: &'a Transmit<'a>,
    ) -> Self {
        Requests {
            client,
            upstream,
            flight,
            local,
            mode,
            read_only,
            link,
            shutdown: link.shutdown.clone(),
            buf: Vec::with_capacity(REQUEST_CHUNK),
            registered: None,
            cache: None,
        }
    }

    /// Answers reads from the read cache where it can, and reads ahead.
    pub fn cached(mut self, cache: Option<RequestLayer<'a>>) -> Self {
        self.cache = cache;
        self
    }

    /// Ends the relay, before it forwards another request, once a reload
    /// has ended the session.
    pub fn ended_by(mut self, registered: Option<&'a crate::tls::SessionGuard>) -> Self {
        self.registered = registered;
        self
    }

    fn limits(&self) -> &Limits {
        &self.link.limits
    }

    /// Relays requests until the client disconnects (Ok) or fails.
    pub async fn run(mut self) -> Result<(), ConnError> {
        let header_len = self.mode.request_header_len();
        let mut header = [0u8; EXTENDED_REQUEST_LEN];
        let header = &mut header[..header_len];
        loop {
            self.read_header(header).await?;
            let request =
                Request::parse(self.mode, header).map_err(ConnError::proto(Side::Client))?;
            let payload = request.payload_len(self.mode);
            let max_payload = u64::from(self.limits().max_payload);
            ProtoError::check_limit("request payload", payload, max_payload)
                .map_err(ConnError::proto(Side::Client))?;
            if request.command == CMD_DISC {
                self.count(&request);
                return self.disconnect(header).await;
            }
            // The phase is read once: what this request gets is decided
            // by one look, whatever the drain does meanwhile.
            let draining = self.shutdown.answer_now();
            // Counted once decided, so that whoever waits for the count
            // (the tests) sees a request whose fate is sealed.
            self.count(&request);
            if draining == Some(DrainAnswer::Close) {
                self.leave_unanswered(&request, payload).await?;
                continue;
            }
            if !self.handle(&request, header, payload, draining).await? {
                return Ok(());
            }
        }
    }

    fn count(&self, request: &Request) {
        let header_len = self.mode.request_header_len() as u64;
        self.link
            .stats
            .request(command_name(request.command), header_len);
    }

    /// A request read after a drain began, with `DrainAnswer::Close`:
    /// never forwarded and never answered: the connection closes once what
    /// was forwarded before the drain is answered, and the client may send
    /// it again elsewhere. Read on (payload too), so that nothing the
    /// client sent is left unread when the socket closes: that would make
    /// it a reset, which throws away replies not sent yet.
    async fn leave_unanswered(&mut self, request: &Request, payload: u64) -> Result<(), ConnError> {
        self.discard(payload).await?;
        debug!(
            command = command_name(request.command),
            cookie = request.cookie,
            "request read while draining: left unanswered, the connection closes"
        );
        Ok(())
    }

    /// Refuses, answers from the cache or forwards one request. Returns
    /// false once the reply side is gone and nothing more is to be read.
    async fn handle(
        &mut self,
        request: &Request,
        header: &[u8],
        payload: u64,
        draining: Option<DrainAnswer>,
    ) -> Result<bool, ConnError> {
        self.flight
            .claim(request.cookie, InFlight::from(request))
            .await;
        if let Some((error, message)) = self.refusal(request, draining) {
            let queued = self.refuse(request, payload, error, message).await?;
            // Once a drained connection's reply side is done, its requests
            // are still read until the client closes (see `relay::run`).
            return Ok(queued || self.shutdown.is_draining());
        }
        // A reload may have ended the session while this request was
        // read: it must not reach the upstream.
        if let Some(why) = self.registered.and_then(|g| g.signalled()) {
            return Err(ConnError::ended(why));
        }
        let hit = self
            .cache
            .as_ref()
            .and_then(|c| c.answer(self.mode, request));
        match hit {
            Some(reply) => {
                if self.local.send(reply).await.is_err() {
                    return Ok(false);
                }
            }
            None => self.miss(request, header, payload).await?,
        }
        // No read-ahead for a session that is closing: its replies would
        // only hold the drain up.
        if draining.is_none() {
            self.read_ahead(request).await?;
        }
        Ok(true)
    }

    /// What nbdgw answers itself instead of forwarding, if anything.
    /// `draining` is the phase as this request saw it: ESHUTDOWN only when
    /// the drain answers so (never with `DrainAnswer::Close`).
    fn refusal(
        &self,
        request: &Request,
        draining: Option<DrainAnswer>,
    ) -> Option<(u32, &'static str)> {
        if draining == Some(DrainAnswer::Eshutdown) {
            Some((ESHUTDOWN, "nbdgw is shutting down"))
        } else if self.read_only && request.is_modifying() {
            // The spec asks for EPERM; qemu-nbd itself would answer EINVAL.
            Some((EPERM, "nbdgw: the export is read-only"))
        } else if request.command == CMD_READ
            && request.length > u64::from(self.limits().max_payload)
        {
            Some((EINVAL, "nbdgw: read length exceeds --max-payload"))
        } else {
            None
        }
    }

    /// A request the cache did not answer: a READ of a cached session goes
    /// upstream widened to whole blocks (see `RequestLayer::fill`), all
    /// else as it came.
    async fn miss(
        &mut self,
        request: &Request,
        header: &[u8],
        payload: u64,
    ) -> Result<(), ConnError> {
        let flight = self.flight;
        let fill = match (&mut self.cache, payload) {
            (Some(cache), 0) => cache.fill(request, flight),
            _ => None,
        };
        let Some(fill) = fill else {
            return self.forward(header, payload).await;
        };
        self.buf.clear();
        fill.encode(self.mode, &mut self.buf);
        self.send_upstream().await
    }

    /// Sends the read-ahead the cache layer plans after `request`, in one
    /// write: their replies fill the cache and never reach the client.
    async fn read_ahead(&mut self, request: &Request) -> Result<(), ConnError> {
        let Some(cache) = self.cache.as_mut() else {
            return Ok(());
        };
        let ahead = cache.read_ahead(request, self.flight);
        if ahead.is_empty() {
            return Ok(());
        }
        self.buf.clear();
        for request in &ahead {
            request.encode(self.mode, &mut self.buf);
        }
        self.send_upstream().await
    }

    /// Consumes the payload and queues an error reply. Returns false when
    /// the reply side is gone.
    async fn refuse(
        &mut self,
        request: &Request,
        payload: u64,
        error: u32,
        message: &'static str,
    ) -> Result<bool, ConnError> {
        self.discard(payload).await?;
        debug!(
            command = command_name(request.command),
            cookie = request.cookie,
            error,
            message,
            "refused request"
        );
        let mut bytes = Vec::new();
        let in_flight = InFlight::from(request);
        encode_error_reply(
            self.mode,
            request.cookie,
            &in_flight,
            error,
            message,
            &mut bytes,
        );
        self.link.stats.metrics.error(error);
        let reply = Local::Reply {
            cookie: request.cookie,
            bytes,
        };
        Ok(self.local.send(reply).await.is_ok())
    }

    /// Header and the first part of the payload leave in one write.
    async fn forward(&mut self, header: &[u8], payload: u64) -> Result<(), ConnError> {
        self.buf.clear();
        self.buf.extend_from_slice(header);
        let mut remaining = payload;
        loop {
            if remaining > 0 {
                remaining -= self.read_payload(remaining).await?;
                if remaining > 0 && self.buf.len() < REQUEST_CHUNK {
                    continue;
                }
            }
            self.send_upstream().await?;
            if remaining == 0 {
                return Ok(());
            }
        }
    }

    /// Reads what is there of the next `remaining` payload bytes onto the
    /// buffer, up to its `REQUEST_CHUNK`: some progress within the stall
    /// timeout, or an error.
    async fn read_payload(&mut self, remaining: u64) -> Result<u64, ConnError> {
        const WHEN: &str = "in the middle of a request payload";
        let room = (REQUEST_CHUNK - self.buf.len()) as u64;
        let (client, buf) = (&mut self.client, &mut self.buf);
        let read = within_stall(
            self.link.limits.stall_timeout,
            "sending a request payload",
            async {
                client
                    .take(remaining.min(room))
                    .read_buf(buf)
                    .await
                    .map_err(ConnError::io(Side::Client, WHEN))
            },
        )
        .await?;
        if read == 0 {
            return Err(ConnError::closed(Side::Client, WHEN));
        }
        self.link.stats.received(read as u64);
        Ok(read as u64)
    }

    /// Reads and drops the payload of a request nbdgw refuses: it must
    /// still leave the stream, or the next request header is read from it.
    async fn discard(&mut self, payload: u64) -> Result<(), ConnError> {
        let mut remaining = payload;
        while remaining > 0 {
            self.buf.clear();
            remaining -= self.read_payload(remaining).await?;
        }
        Ok(())
    }

    async fn send_upstream(&mut self) -> Result<(), ConnError> {
        let when = "while a request was forwarded";
        self.upstream
            .write_all(&self.buf)
            .await
            .map_err(ConnError::io(Side::Upstream, when))?;
        // A Unix socket has nothing to flush; a TLS stream towards the
        // remote (client mode) holds records until flushed.
        self.upstream
            .flush()
            .await
            .map_err(ConnError::io(Side::Upstream, when))?;
        self.buf.clear();
        Ok(())
    }

    /// qemu-nbd drops requests still in flight when it sees DISC, so it
    /// only goes upstream once every reply has come back; the reply side
    /// then finishes and closes.
    async fn disconnect(&mut self, header: &[u8]) -> Result<(), ConnError> {
        self.flight.wait_until_empty().await;
        self.buf.clear();
        self.buf.extend_from_slice(header);
        self.send_upstream().await?;
        let _ = self.local.send(Local::Drain(CLIENT_DISCONNECTED)).await;
        Ok(())
    }

    /// Waits for the next request header. Gives up after the idle
    /// timeout, counted from the moment nothing was in flight and every
    /// reply had been written.
    async fn read_header(&mut self, header: &mut [u8]) -> Result<(), ConnError> {
        let when = "without sending NBD_CMD_DISC";
        let Some(idle) = self.limits().idle_timeout else {
            let read = self.client.read_exact(header).await;
            return read.map(|_| ()).map_err(ConnError::io(Side::Client, when));
        };
        let flight = self.flight;
        let mut read = pin!(self.client.read_exact(header));
        loop {
            // While busy, look again one idle period from now.
            let check_at = flight.idle_since().unwrap_or_else(Instant::now) + idle;
            tokio::select! {
                read = &mut read => {
                    return read.map(|_| ()).map_err(ConnError::io(Side::Client, when));
                }
                () = tokio::time::sleep_until(check_at.into()) => {
                    if flight.is_empty() && flight.idle_since().is_some_and(|t| t.elapsed() >= idle) {
                        return Err(ConnError::IdleTimeout(idle));
                    }
                }
            }
        }
    }
}
