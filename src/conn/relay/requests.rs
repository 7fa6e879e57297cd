//! Client to upstream: reads each request, asks the layers what becomes
//! of it, answers locally what they refuse or answer (through the reply
//! side, the only writer to the client), and forwards the rest with their
//! payload.

use std::time::Instant;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tracing::debug;

use super::flight::Flight;
use super::layers::{At, OnRequest, Verdict};
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
pub struct Requests<'a, C, U, L> {
    client: C,
    upstream: U,
    flight: &'a Flight,
    local: mpsc::Sender<Local>,
    mode: ReplyMode,
    link: &'a Transmit<'a>,
    shutdown: Shutdown,
    /// Header and the first part of the payload, then further pieces.
    buf: Vec<u8>,
    /// The request halves of the relay's layers.
    layers: L,
    /// Requests the layers send of their own after a request.
    own: Vec<Request>,
    /// The hand-over's hook, if this session may be handed over.
    quiesce: Option<&'a crate::handing::Quiesce>,
    /// What was read of a header when the hook stopped the reading.
    pending: Vec<u8>,
}

impl<'a, C: AsyncRead + Unpin, U: AsyncWrite + Unpin, L: OnRequest> Requests<'a, C, U, L> {
    pub fn new(
        (client, upstream): (C, U),
        flight: &'a Flight,
        local: mpsc::Sender<Local>,
        mode: ReplyMode,
        link: &'a Transmit<'a>,
        layers: L,
    ) -> Self {
        Requests {
            client,
            upstream,
            flight,
            local,
            mode,
            link,
            shutdown: link.shutdown.clone(),
            buf: Vec::with_capacity(REQUEST_CHUNK),
            layers,
            own: Vec::new(),
            quiesce: None,
            pending: Vec::new(),
        }
    }

    /// Stops before a request header when `quiesce` asks it to, keeping
    /// what was read of it (see `quiesce`).
    pub fn quiescible(mut self, quiesce: Option<&'a crate::handing::Quiesce>) -> Self {
        self.quiesce = quiesce;
        self
    }

    fn limits(&self) -> &Limits {
        &self.link.limits
    }

    /// Relays requests until the client disconnects (Ok), the hand-over
    /// hook stops it (Ok, and the hook says so), or it fails. Called
    /// again after a stop, it reads on where it stopped.
    pub async fn run(&mut self) -> Result<(), ConnError> {
        let header_len = self.mode.request_header_len();
        let mut header = [0u8; EXTENDED_REQUEST_LEN];
        let header = &mut header[..header_len];
        loop {
            if !self.read_header(header).await? {
                return Ok(());
            }
            let request =
                Request::parse(self.mode, header).map_err(ConnError::proto(Side::Client))?;
            let payload = request.payload_len(self.mode);
            let max_payload = u64::from(self.limits().max_payload);
            ProtoError::check_limit("request payload", payload, max_payload)
                .map_err(ConnError::proto(Side::Client))?;
            if request.command == CMD_DISC {
                self.layers.arrived(&request);
                return self.disconnect(header).await;
            }
            // The phase is read once: what this request gets is decided
            // by one look, whatever the drain does meanwhile.
            let draining = self.shutdown.answer_now();
            self.layers.arrived(&request);
            if draining == Some(DrainAnswer::Close) {
                self.leave_unanswered(&request, payload).await?;
                continue;
            }
            if !self.handle(&request, header, payload, draining).await? {
                return Ok(());
            }
        }
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

    /// Claims the request's cookie, then does what the layers decide:
    /// refuse it, answer it, send a request of theirs instead, or forward
    /// it; then sends what the layers add of their own. Returns false once
    /// the reply side is gone and nothing more is to be read.
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
        let flight = self.flight;
        let at = At {
            mode: self.mode,
            flight,
            draining,
        };
        match self.layers.request(&at, request) {
            Verdict::Pass => self.forward(header, payload).await?,
            Verdict::Refuse { error, message } => {
                let queued = self.refuse(request, payload, error, message).await?;
                // Once a drained connection's reply side is done, its
                // requests are still read until the client closes (see
                // `relay::run`).
                return Ok(queued || self.shutdown.is_draining());
            }
            Verdict::Answer(reply) => {
                // Here, not inside: a hit builds no future for it (~87 Ir).
                if payload != 0 {
                    self.drop_payload_of_local(request, payload).await?;
                }
                if self.local.send(reply).await.is_err() {
                    return Ok(false);
                }
            }
            Verdict::Instead(own) => {
                if payload != 0 {
                    self.drop_payload_of_local(request, payload).await?;
                }
                self.send_own(&[own]).await?;
            }
            Verdict::End(error) => return Err(error),
        }
        let mut own = std::mem::take(&mut self.own);
        self.layers.follow(&at, request, &mut own);
        let sent = self.send_own(&own).await;
        own.clear();
        self.own = own;
        sent.map(|()| true)
    }

    /// A layer answers (or replaces) only requests without payload: a
    /// payload left in the stream would be read as the next header. Should
    /// one break that rule, its payload is still read and dropped.
    async fn drop_payload_of_local(&mut self, req: &Request, len: u64) -> Result<(), ConnError> {
        debug_assert_eq!(len, 0, "a layer answered a request with a payload");
        let command = command_name(req.command);
        tracing::error!(
            command,
            len,
            "a layer answered a request with a payload: dropped"
        );
        self.discard(len).await
    }

    /// Requests of the layers' own, in one write.
    async fn send_own(&mut self, own: &[Request]) -> Result<(), ConnError> {
        if own.is_empty() {
            return Ok(());
        }
        self.buf.clear();
        for request in own {
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
        self.layers.refused(request, error);
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
}

/// The hand-over's side of the request loop: where it stops.
impl<C: AsyncRead + Unpin, U: AsyncWrite + Unpin, L: OnRequest> Requests<'_, C, U, L> {
    /// Waits for the next request header: true once it is whole; false
    /// if the hand-over hook asked to stop first (what was read of it
    /// is kept for the next call, or for the successor). Gives up after
    /// the idle timeout, counted from the moment nothing was in flight
    /// and every reply had been written. Reads are cancel-safe, so a
    /// stop loses nothing.
    async fn read_header(&mut self, header: &mut [u8]) -> Result<bool, ConnError> {
        let when = "without sending NBD_CMD_DISC";
        if self.quiesce.is_none() && self.limits().idle_timeout.is_none() {
            // Nothing to wait for beside the read (no hand-over hook, no
            // idle timeout: the defaults): the plain read, which costs
            // about 150 instructions a request less than the loop below
            // (bench/callgrind.py). `pending` is only kept by a hook.
            let read = self.client.read_exact(header).await;
            return read
                .map(|_| true)
                .map_err(ConnError::io(Side::Client, when));
        }
        let pending = std::mem::take(&mut self.pending);
        header[..pending.len()].copy_from_slice(&pending);
        let mut filled = pending.len();
        let (flight, idle, quiesce) = (self.flight, self.limits().idle_timeout, self.quiesce);
        while filled < header.len() {
            if let Some(q) = quiesce.filter(|q| q.is_asked()) {
                self.pending = header[..filled].to_vec();
                q.set_stopped();
                return Ok(false);
            }
            // While busy, look again one idle period from now.
            let check_at = idle.map(|idle| flight.idle_since().unwrap_or_else(Instant::now) + idle);
            let read = tokio::select! {
                read = self.client.read(&mut header[filled..]) => read,
                () = super::go_quiet::asked(quiesce) => continue,
                () = sleep_until(check_at) => {
                    let idle = idle.unwrap_or_default();
                    if flight.is_empty() && flight.idle_since().is_some_and(|t| t.elapsed() >= idle) {
                        return Err(ConnError::IdleTimeout(idle));
                    }
                    continue;
                }
            };
            match read {
                Ok(0) => {
                    let eof = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
                    return Err(ConnError::io(Side::Client, when)(eof));
                }
                Ok(n) => filled += n,
                Err(e) => return Err(ConnError::io(Side::Client, when)(e)),
            }
        }
        Ok(true)
    }
}

impl<C, U, L> Requests<'_, C, U, L> {
    /// The halves, and the bytes of a request header read in part.
    pub fn into_parts(self) -> (C, U, Vec<u8>) {
        (self.client, self.upstream, self.pending)
    }
}

/// Sleeps until `at`; never without one.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
