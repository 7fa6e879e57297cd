//! `nbdgw client --reconnect`: the server's connection as a stream that
//! outlives the server. The transmission relay above it is the same as
//! without `--reconnect`; it reads replies from and writes requests to
//! this stream, which
//!
//! - keeps every request it passes on (header and write payload) until
//!   the request's last reply has come back, at most `--replay-buffer`
//!   bytes of them: beyond that, a new request waits;
//! - passes each reply message up only once it has come whole, so a drop
//!   never leaves half a message on the local connection, and holds the
//!   chunks of a structured reply until its last one has come (at most
//!   `--reply-buffer` bytes of them), so a drop never leaves half a reply
//!   there either: a cut reply is asked for again whole;
//! - when the connection drops (an error, or an end the local client did
//!   not ask for with NBD_CMD_DISC), reconnects with backoff for up to
//!   `--reconnect-timeout`, opens the same export with the same framing,
//!   checks that its size and transmission flags are unchanged, and sends
//!   the kept requests again, in their original order, before any new one.
//!
//! A request whose reply had already been passed up in part (a structured
//! reply of several chunks, larger than what `--reply-buffer` had left)
//! cannot be sent again without repeating those chunks: it gets an EIO
//! error chunk instead. If the export changed, or
//! no connection could be made in time, every request in flight gets EIO
//! and the stream ends, which closes the local connection: a different
//! disk is never served.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tracing::{error, info, warn};

use super::relayed::{self, Framing};
use super::remote::{self, RemoteTls};
use crate::client::ClientSettings;
use crate::logsafe::Escaped;
use crate::proto::consts::*;
use crate::proto::handshake::parse_info_export;
use crate::proto::transmission::{
    encode_error_reply, parse_reply, reply_header_len, InFlight, InFlightTable, ReplyFrame,
    ReplyMode, Request,
};

/// How the export was opened, to open it again the same way.
#[derive(Debug, Clone)]
pub enum Reopen {
    /// NBD_OPT_GO with this data (the name and the information requests).
    Go(Vec<u8>),
    /// NBD_OPT_EXPORT_NAME with this name.
    ExportName(Vec<u8>),
}

/// The metadata contexts the local client set (its last acknowledged
/// NBD_OPT_SET_META_CONTEXT) and the server's NBD_REP_META_CONTEXT
/// replies to it (each a context id and name): block status replies name
/// contexts by those ids, so a new connection must be given the same.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContexts {
    pub request: Vec<u8>,
    pub chosen: Vec<Vec<u8>>,
}

/// What a new connection must agree to again.
#[derive(Debug, Clone)]
pub struct Opened {
    pub reopen: Reopen,
    pub framing: Framing,
    pub meta: Option<MetaContexts>,
    /// The export's size and transmission flags as first announced.
    pub export: (u64, u16),
}

/// Reads from the server go through this much at a time.
const READ_CHUNK: usize = 64 * 1024;
/// What one kept request costs beyond its bytes, counted against
/// `--replay-buffer`.
const KEPT_OVERHEAD: usize = 256;
/// What one held reply costs beyond its buffer (its place in the map),
/// counted against `--reply-buffer`.
const HELD_OVERHEAD: usize = 64;
/// Message buffers larger than this are freed once delivered.
const KEPT_CAPACITY: usize = 1024 * 1024;
/// Backoff between tries: from the first to the longest.
const FIRST_DELAY: Duration = Duration::from_millis(100);
const LONGEST_DELAY: Duration = Duration::from_secs(2);

/// Why reconnecting ended without a connection.
#[derive(Debug)]
enum GiveUp {
    /// The export is not the one the local client opened.
    Changed(String),
    TimedOut {
        tries: u32,
        last: String,
    },
}

impl std::fmt::Display for GiveUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GiveUp::Changed(what) => write!(f, "the export changed: {what}"),
            GiveUp::TimedOut { tries, last } => write!(
                f,
                "no connection within --reconnect-timeout ({tries} tries; last: {last})"
            ),
        }
    }
}

/// One try's failure: worth another try, or final.
enum Attempt {
    Failed(String),
    Changed(String),
}

type Reconnect = Pin<Box<dyn Future<Output = Result<RemoteTls, GiveUp>> + Send + Sync>>;

enum Link {
    Up(Box<RemoteTls>),
    Reconnecting(Reconnect),
    /// Given up: what is left in `out` goes up, then the end.
    Failed,
}

/// A request passed on and not yet wholly answered.
struct Kept {
    cookie: u64,
    bytes: Vec<u8>,
}

/// What the reply side waits for next.
#[derive(Clone, Copy)]
enum Need {
    Magic,
    Header(usize),
    Payload(ReplyFrame, u64),
}

pub struct Reconnecting {
    link: Link,
    settings: Arc<ClientSettings>,
    opened: Arc<Opened>,
    mode: ReplyMode,
    max_reply: u64,
    /// The header of the request being written, until it is whole.
    head: Vec<u8>,
    /// Payload bytes of the request being written still to come.
    payload_left: u64,
    kept: VecDeque<Kept>,
    /// Bytes in `kept`, against `--replay-buffer`.
    held: usize,
    table: InFlightTable,
    /// The local client sent NBD_CMD_DISC: the server's end is expected.
    disconnecting: bool,
    write_waiting: Option<Waker>,
    /// The reply message being assembled.
    message: Vec<u8>,
    need: Need,
    /// Whole messages ready for the relay.
    out: Vec<u8>,
    out_at: usize,
    /// Requests part of whose reply has gone up.
    answered_in_part: HashSet<u64>,
    /// The chunks so far of structured replies not yet whole, by cookie:
    /// they go up with their last chunk, or are dropped with the
    /// connection (the request is sent again).
    held_replies: HashMap<u64, Vec<u8>>,
    /// The memory `held_replies` takes (each entry's capacity and
    /// `HELD_OVERHEAD`), against `--reply-buffer`.
    held_reply_bytes: usize,
    scratch: Vec<u8>,
    /// A write waits for the reconnect: once given up, what it brings
    /// gets its EIO before the end is read.
    writer_blocked: bool,
    /// Why it gave up, for the EIO replies.
    failed: String,
}

impl Reconnecting {
    pub fn new(
        remote: RemoteTls,
        settings: Arc<ClientSettings>,
        opened: Opened,
        mode: ReplyMode,
    ) -> Self {
        let max_reply = super::relay::max_reply(settings.max_payload);
        Reconnecting {
            link: Link::Up(Box::new(remote)),
            settings,
            opened: Arc::new(opened),
            mode,
            max_reply,
            head: Vec::new(),
            payload_left: 0,
            kept: VecDeque::new(),
            held: 0,
            table: InFlightTable::default(),
            disconnecting: false,
            write_waiting: None,
            message: Vec::new(),
            need: Need::Magic,
            out: Vec::new(),
            out_at: 0,
            answered_in_part: HashSet::new(),
            held_replies: HashMap::new(),
            held_reply_bytes: 0,
            scratch: vec![0; READ_CHUNK],
            writer_blocked: false,
            failed: String::new(),
        }
    }

    fn replay_buffer(&self) -> usize {
        self.settings
            .reconnect
            .map_or(usize::MAX, |r| r.replay_buffer)
    }

    fn reply_buffer(&self) -> usize {
        self.settings.reconnect.map_or(0, |r| r.reply_buffer)
    }

    /// The replies held unfinished are dropped (their requests are still
    /// kept): how many there were.
    fn drop_held_replies(&mut self) -> usize {
        self.held_reply_bytes = 0;
        std::mem::take(&mut self.held_replies).len()
    }

    /// Brings the link up, or says it cannot be: `Ready(Err)` once given up.
    fn drive(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let done = match &mut self.link {
            Link::Up(_) => return Poll::Ready(Ok(())),
            Link::Failed => return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
            Link::Reconnecting(future) => match future.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(done) => done,
            },
        };
        match done {
            Ok(conn) => {
                self.link = Link::Up(Box::new(conn));
                Poll::Ready(Ok(()))
            }
            Err(why) => {
                self.give_up(&why);
                Poll::Ready(Err(io::Error::other(why.to_string())))
            }
        }
    }

    /// The connection dropped: start over, with what is kept.
    fn lost(&mut self, why: &str) {
        let replies_held = self.drop_held_replies();
        warn!(
            error = %Escaped(why),
            in_flight = self.kept.len(),
            replies_held,
            replies_cut = self.answered_in_part.len(),
            "connection to the server lost; reconnecting (--reconnect)"
        );
        self.message.clear();
        self.need = Need::Magic;
        // Those with a reply in part on the local connection cannot be
        // asked again: their reply ends here, with EIO.
        for cookie in std::mem::take(&mut self.answered_in_part) {
            if let Some(request) = self.table.remove(cookie) {
                let message = "nbdgw client: the server was lost in the middle of this reply";
                encode_error_reply(self.mode, cookie, &request, EIO, message, &mut self.out);
                self.settings.metrics.error(EIO);
                self.forget(cookie);
            }
        }
        let replay: Vec<u8> = self
            .kept
            .iter()
            .flat_map(|k| k.bytes.iter().copied())
            .collect();
        let requests = self.kept.len();
        self.link = Link::Reconnecting(Box::pin(reconnect(
            self.settings.clone(),
            self.opened.clone(),
            replay,
            requests,
        )));
    }

    /// Every request in flight gets EIO, and the stream ends.
    fn give_up(&mut self, why: &GiveUp) {
        error!(
            error = %why,
            in_flight = self.kept.len(),
            "giving up on the server; the requests in flight fail with EIO and the local connection closes"
        );
        self.failed = format!("nbdgw client: {why}");
        // Nothing is held here: `lost` dropped it, and nothing is read
        // while reconnecting.
        self.fail_kept();
        self.link = Link::Failed;
    }

    fn fail_kept(&mut self) {
        for kept in std::mem::take(&mut self.kept) {
            if let Some(request) = self.table.remove(kept.cookie) {
                let (mode, cookie) = (self.mode, kept.cookie);
                encode_error_reply(mode, cookie, &request, EIO, &self.failed, &mut self.out);
                self.settings.metrics.error(EIO);
            }
        }
        self.held = 0;
    }

    fn forget(&mut self, cookie: u64) {
        if let Some(at) = self.kept.iter().position(|k| k.cookie == cookie) {
            if let Some(kept) = self.kept.remove(at) {
                self.held = self.held.saturating_sub(kept.bytes.len() + KEPT_OVERHEAD);
            }
        }
        if let Some(waker) = self.write_waiting.take() {
            waker.wake();
        }
    }

    /// Follows the requests in the bytes the server accepted.
    fn record(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            if self.payload_left > 0 {
                let n = bytes
                    .len()
                    .min(usize::try_from(self.payload_left).unwrap_or(usize::MAX));
                if let Some(kept) = self.kept.back_mut() {
                    kept.bytes.extend_from_slice(&bytes[..n]);
                }
                self.held += n;
                self.payload_left -= n as u64;
                bytes = &bytes[n..];
                continue;
            }
            let header_len = self.mode.request_header_len();
            let n = (header_len - self.head.len()).min(bytes.len());
            self.head.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.head.len() < header_len {
                break;
            }
            let request = Request::parse(self.mode, &self.head)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            if request.command == CMD_DISC {
                // No reply comes, and the server's end follows.
                self.disconnecting = true;
                self.head.clear();
                continue;
            }
            self.table.insert(request.cookie, InFlight::from(&request));
            self.payload_left = request.payload_len(self.mode);
            // The memory a kept request costs beyond its bytes (its vector,
            // its place in the line and in the in-flight table) counts
            // too: otherwise many small requests hold several times
            // --replay-buffer (measured: 134 MB for a 16 MiB buffer).
            self.held += self.head.len() + KEPT_OVERHEAD;
            self.kept.push_back(Kept {
                cookie: request.cookie,
                bytes: std::mem::take(&mut self.head),
            });
        }
        Ok(())
    }

    /// Assembles reply messages; whole ones go to `out`.
    fn follow_replies(&mut self, mut data: &[u8]) -> io::Result<()> {
        let invalid = |e| io::Error::new(io::ErrorKind::InvalidData, e);
        while !data.is_empty() {
            match self.need {
                Need::Magic => {
                    let n = (4 - self.message.len()).min(data.len());
                    self.message.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    if self.message.len() == 4 {
                        let magic = u32::from_be_bytes([
                            self.message[0],
                            self.message[1],
                            self.message[2],
                            self.message[3],
                        ]);
                        self.need =
                            Need::Header(reply_header_len(self.mode, magic).map_err(invalid)?);
                    }
                }
                Need::Header(len) => {
                    let n = (len - self.message.len()).min(data.len());
                    self.message.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    if self.message.len() == len {
                        let frame =
                            parse_reply(self.mode, &self.message, &self.table, self.max_reply)
                                .map_err(invalid)?;
                        match frame.payload_len {
                            0 => self.whole(frame),
                            left => self.need = Need::Payload(frame, left),
                        }
                    }
                }
                Need::Payload(frame, left) => {
                    let n = data.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    self.message.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    match left - n as u64 {
                        0 => self.whole(frame),
                        left => self.need = Need::Payload(frame, left),
                    }
                }
            }
        }
        Ok(())
    }

    /// A whole reply message: up it goes, and a last one frees its request.
    /// A structured reply's earlier chunks are held until its last one,
    /// while `--reply-buffer` has room: then a drop in between loses
    /// nothing the local client has seen, and the request is asked again.
    fn whole(&mut self, frame: ReplyFrame) {
        self.need = Need::Magic;
        let cookie = frame.cookie;
        // A held entry costs its buffer's capacity and its place in the
        // map. Holding this message grows the entry to at most twice its
        // capacity, or to exactly what it then holds.
        let (before, capacity, used) = match self.held_replies.get(&cookie) {
            Some(held) => (held.capacity() + HELD_OVERHEAD, held.capacity(), held.len()),
            None => (0, 0, 0),
        };
        let at_most = (2 * capacity).max(used + self.message.len()) + HELD_OVERHEAD;
        if !frame.done
            && !self.answered_in_part.contains(&cookie)
            && self.held_reply_bytes - before + at_most <= self.reply_buffer()
        {
            // Copied, not moved: the message buffer may be far larger
            // than this message (it assembled a large one before).
            let held = self.held_replies.entry(cookie).or_default();
            held.extend_from_slice(&self.message);
            self.held_reply_bytes =
                self.held_reply_bytes - before + held.capacity() + HELD_OVERHEAD;
            self.message.clear();
            return;
        }
        if let Some(mut held) = self.held_replies.remove(&cookie) {
            self.held_reply_bytes -= held.capacity() + HELD_OVERHEAD;
            push_out(&mut self.out, &mut self.out_at, &mut held);
        }
        push_out(&mut self.out, &mut self.out_at, &mut self.message);
        if frame.done {
            self.table.remove(frame.cookie);
            self.answered_in_part.remove(&frame.cookie);
            self.forget(frame.cookie);
        } else {
            self.answered_in_part.insert(frame.cookie);
        }
    }
}

/// Appends whole messages to what goes up; when nothing is waiting there,
/// they become it as they are, without a copy (`bytes` is left empty).
fn push_out(out: &mut Vec<u8>, out_at: &mut usize, bytes: &mut Vec<u8>) {
    if *out_at == out.len() {
        out.clear();
        *out_at = 0;
        std::mem::swap(out, bytes);
    } else {
        out.append(bytes);
    }
}

impl AsyncRead for Reconnecting {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.out_at < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.out_at);
                buf.put_slice(&this.out[this.out_at..this.out_at + n]);
                this.out_at += n;
                if this.out_at == this.out.len() {
                    this.out.clear();
                    this.out_at = 0;
                    // A large read's buffer is not kept for an idle
                    // connection's life.
                    if this.out.capacity() > KEPT_CAPACITY {
                        this.out = Vec::new();
                    }
                    if this.message.capacity() > KEPT_CAPACITY {
                        this.message = Vec::new();
                    }
                }
                return Poll::Ready(Ok(()));
            }
            if let Link::Failed = this.link {
                // The write side is polled in the same task: its request
                // gets its EIO first, and then the end.
                if this.writer_blocked {
                    return Poll::Pending;
                }
                return Poll::Ready(Ok(()));
            }
            match this.drive(cx) {
                Poll::Pending => return Poll::Pending,
                // Given up: the EIO replies, then the end.
                Poll::Ready(Err(_)) => continue,
                Poll::Ready(Ok(())) => {}
            }
            let Link::Up(conn) = &mut this.link else {
                continue;
            };
            let mut scratch = std::mem::take(&mut this.scratch);
            let mut read = ReadBuf::new(&mut scratch);
            let polled = Pin::new(conn.as_mut()).poll_read(cx, &mut read);
            let n = read.filled().len();
            let result = match polled {
                Poll::Pending => None,
                Poll::Ready(Err(e)) => Some(Err(e.to_string())),
                Poll::Ready(Ok(())) if n == 0 => {
                    Some(Err("the server closed the connection".into()))
                }
                Poll::Ready(Ok(())) => Some(Ok(this.follow_replies(&scratch[..n]))),
            };
            this.scratch = scratch;
            match result {
                None => return Poll::Pending,
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(e))) => return Poll::Ready(Err(e)),
                // After DISC the server's end is the end.
                Some(Err(_)) if this.disconnecting && this.kept.is_empty() => {
                    return Poll::Ready(Ok(()))
                }
                Some(Err(why)) => this.lost(&why),
            }
        }
    }
}

impl AsyncWrite for Reconnecting {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        loop {
            if let Link::Failed = this.link {
                // Nothing will be sent any more: each request is answered
                // EIO at once, so the local client hears of it.
                this.writer_blocked = false;
                this.record(buf)?;
                this.fail_kept();
                cx.waker().wake_by_ref();
                return Poll::Ready(Ok(buf.len()));
            }
            match this.drive(cx) {
                Poll::Pending => {
                    this.writer_blocked = true;
                    return Poll::Pending;
                }
                Poll::Ready(Err(_)) => continue,
                Poll::Ready(Ok(())) => this.writer_blocked = false,
            }
            // A new request waits while the kept ones fill the buffer (one
            // is always let through, however large).
            let between = this.head.is_empty() && this.payload_left == 0;
            if between && !this.kept.is_empty() && this.held >= this.replay_buffer() {
                this.write_waiting = Some(cx.waker().clone());
                return Poll::Pending;
            }
            let Link::Up(conn) = &mut this.link else {
                continue;
            };
            match Pin::new(conn.as_mut()).poll_write(cx, buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(n)) => {
                    this.record(&buf[..n])?;
                    return Poll::Ready(Ok(n));
                }
                Poll::Ready(Err(e)) => this.lost(&e.to_string()),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if std::task::ready!(this.drive(cx)).is_err() {
                // Given up: the writes were answered, nothing to flush.
                return Poll::Ready(Ok(()));
            }
            let Link::Up(conn) = &mut this.link else {
                continue;
            };
            match Pin::new(conn.as_mut()).poll_flush(cx) {
                Poll::Ready(Err(e)) => this.lost(&e.to_string()),
                done => return done,
            }
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().link {
            Link::Up(conn) => Pin::new(conn.as_mut()).poll_shutdown(cx),
            _ => Poll::Ready(Ok(())),
        }
    }
}

/// Tries until a connection opens the same export, with backoff, within
/// `--reconnect-timeout`; then sends the kept requests again.
async fn reconnect(
    settings: Arc<ClientSettings>,
    opened: Arc<Opened>,
    replay: Vec<u8>,
    requests: usize,
) -> Result<RemoteTls, GiveUp> {
    let timeout = settings.reconnect.map_or(Duration::ZERO, |r| r.timeout);
    let started = Instant::now();
    let mut delay = FIRST_DELAY;
    let mut tries = 0;
    loop {
        tries += 1;
        // Each try within what is left of the timeout, whatever the server
        // does: one that trickles replies must not hold the requests past it.
        let left = timeout.saturating_sub(started.elapsed());
        let attempt = tokio::time::timeout(left, async {
            let mut conn = reopen(&settings, &opened).await?;
            send_again(&mut conn, &replay).await.map_err(|e| {
                Attempt::Failed(format!("sending the requests in flight again: {e}"))
            })?;
            Ok(conn)
        })
        .await
        .unwrap_or_else(|_| {
            Err(Attempt::Failed(
                "the try outlasted --reconnect-timeout".into(),
            ))
        });
        let last = match attempt {
            Ok(conn) => {
                info!(
                    tries,
                    after_ms = started.elapsed().as_millis() as u64,
                    requests_sent_again = requests,
                    "reconnected to the server (--reconnect)"
                );
                return Ok(conn);
            }
            Err(Attempt::Changed(what)) => return Err(GiveUp::Changed(what)),
            Err(Attempt::Failed(why)) => why,
        };
        if started.elapsed() + delay > timeout {
            return Err(GiveUp::TimedOut { tries, last });
        }
        tracing::debug!(tries, error = %Escaped(&last), "reconnect failed; trying again");
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(LONGEST_DELAY);
    }
}

async fn send_again(conn: &mut RemoteTls, replay: &[u8]) -> io::Result<()> {
    conn.write_all(replay).await?;
    conn.flush().await
}

/// One try: TLS, the framing, the export, checked unchanged.
async fn reopen(settings: &ClientSettings, opened: &Opened) -> Result<RemoteTls, Attempt> {
    let failed = |e: &dyn std::fmt::Display| Attempt::Failed(e.to_string());
    let mut remote = remote::connect(settings).await.map_err(|e| failed(&e))?;
    let channel = &mut remote.channel;
    if let Some(code) = opened.framing.replay() {
        channel
            .send_option(code, &[])
            .await
            .map_err(|e| failed(&e))?;
        let mut reply = Vec::new();
        let header = channel
            .read_reply(code, &mut reply)
            .await
            .map_err(|e| failed(&e))?;
        let refused = format!(
            "the server refused the reply framing agreed before ({})",
            remote::reply_name(header.reply_type)
        );
        match header.reply_type {
            REP_ACK => {}
            // A server (a gateway whose own server is still starting)
            // that says it is shutting down may say yes in a moment.
            REP_ERR_SHUTDOWN => return Err(Attempt::Failed(refused)),
            _ => return Err(Attempt::Changed(refused)),
        }
    }
    if let Some(meta) = &opened.meta {
        channel
            .send_option(OPT_SET_META_CONTEXT, &meta.request)
            .await
            .map_err(|e| failed(&e))?;
        let mut chosen = Vec::new();
        loop {
            let mut reply = Vec::new();
            let header = channel
                .read_reply(OPT_SET_META_CONTEXT, &mut reply)
                .await
                .map_err(|e| failed(&e))?;
            if header.reply_type == REP_META_CONTEXT {
                // No more than were agreed before: a server sending
                // endless contexts is not the one the client agreed with.
                if chosen.len() >= meta.chosen.len() {
                    return Err(Attempt::Changed(
                        "the server chose more metadata contexts than before".into(),
                    ));
                }
                chosen.push(reply[OPTION_REPLY_HEADER_LEN..].to_vec());
            }
            if header.is_final() {
                match header.reply_type {
                    REP_ACK => break,
                    REP_ERR_SHUTDOWN => {
                        return Err(Attempt::Failed(
                            "the server is shutting down (NBD_OPT_SET_META_CONTEXT)".into(),
                        ))
                    }
                    other => {
                        return Err(Attempt::Changed(format!(
                            "the server refused the metadata contexts agreed before ({})",
                            remote::reply_name(other)
                        )))
                    }
                }
            }
        }
        if chosen != meta.chosen {
            return Err(Attempt::Changed(
                "the server chose other metadata contexts (or ids) than before".into(),
            ));
        }
    }
    let export = match &opened.reopen {
        Reopen::Go(data) => {
            channel
                .send_option(OPT_GO, data)
                .await
                .map_err(|e| failed(&e))?;
            let mut export = None;
            loop {
                let mut reply = Vec::new();
                let header = channel
                    .read_reply(OPT_GO, &mut reply)
                    .await
                    .map_err(|e| failed(&e))?;
                if header.reply_type == REP_INFO {
                    export = parse_info_export(&reply[OPTION_REPLY_HEADER_LEN..]).or(export);
                }
                if header.is_final() {
                    if header.reply_type != REP_ACK {
                        // A gateway whose own server is still starting
                        // says so: worth another try.
                        return Err(Attempt::Failed(format!(
                            "NBD_OPT_GO refused ({})",
                            remote::reply_name(header.reply_type)
                        )));
                    }
                    break;
                }
            }
            export
        }
        Reopen::ExportName(name) => {
            let pads = remote.pads_export_name;
            match relayed::export_name_exchange(channel, pads, name).await {
                Ok(Ok(export)) => Some(export),
                Ok(Err(e)) | Err(e) => return Err(failed(&e)),
            }
        }
    };
    let Some((size, tflags)) = export else {
        return Err(Attempt::Changed(
            "the server sent no export information".into(),
        ));
    };
    let (was_size, was_tflags) = opened.export;
    if (size, tflags) != (was_size, was_tflags) {
        return Err(Attempt::Changed(format!(
            "size {size} and flags {tflags:#x} where they were size {was_size} and flags {was_tflags:#x}"
        )));
    }
    Ok(remote.channel.into_inner())
}
