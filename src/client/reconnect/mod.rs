//! `nbdgw client --reconnect`: the server's connection as a stream that
//! outlives the server. The transmission relay above it is the same as
//! without `--reconnect`; it reads replies from and writes requests to
//! this stream, which
//!
//! - keeps every request it passes on (header and write payload, from
//!   its first byte) until the request's last reply has come back, at
//!   most `--replay-buffer` bytes of them: beyond that, a new request
//!   waits;
//! - passes each reply message up only once it has come whole, so a drop
//!   never leaves half a message on the local connection, and holds the
//!   chunks of a structured reply until its last one has come (at most
//!   `--reply-buffer` bytes of them), so a drop never leaves half a reply
//!   there either: a cut reply is asked for again whole; a reply to a
//!   write whose payload is still passing is held until it has passed;
//! - holds back an ESHUTDOWN answer (simple, or an error chunk): the
//!   server is going. New requests wait; once every request sent to it
//!   has its answer, the connection is dropped and the held ones are sent
//!   again on the next (a server that closes instead is a drop);
//! - when the connection drops (an error, or an end the local client did
//!   not ask for with NBD_CMD_DISC), reconnects with backoff, opens the
//!   same export with the same framing, checks that its size and
//!   transmission flags are unchanged, and sends the kept requests again
//!   from where they are kept, in their original order, before any new
//!   one, reading the server's replies meanwhile (a server that blocks
//!   while its replies do not fit on the way back stops reading).
//!
//! A connection is good once a reply other than ESHUTDOWN has come on it.
//! The backoff (0.1 s doubling to 2 s) goes on across drops until one is
//! good: after a good connection drops, the first try is at once. One
//! deadline, `--reconnect-timeout`, runs from the first drop with requests
//! in flight until a connection is good (a slow request on a connection
//! that answers is the stall timeout's business); further drops do not
//! restart it. A request given to a connection that replaced a dropped
//! one and has not answered yet starts it too (after an idle drop, or
//! past the deadline). When it passes, every request in
//! flight gets EIO and, until a connection is good again, a new request
//! gets EIO at once while no connection is up (one that is up is given
//! it); the tries go on in the background, so the local connection
//! serves again once the server does.
//!
//! A request whose reply had already been passed up in part (a structured
//! reply of several chunks, larger than what `--reply-buffer` had left)
//! cannot be sent again without repeating those chunks: it gets an EIO
//! error chunk instead. If the export changed, every request in flight
//! gets EIO and the stream ends, which closes the local connection: a
//! different disk is never served.

mod deadline;
mod handed;
mod kept;
mod link;
mod reopen;
mod replies;

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use self::reopen::Reopened;
use super::remote::RemoteTls;
use crate::client::ClientSettings;
use crate::conn::relayed::Framing;
use crate::proto::transmission::{InFlightTable, ReplyFrame, ReplyMode};

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
/// Room for replies to a write come before its payload has passed (held
/// until it has), when `--reply-buffer` is smaller.
const EARLY_ROOM: usize = 64 * 1024;

/// Replies waiting for the local client beyond which a request that would
/// be answered EIO at once waits instead: a client that writes and never
/// reads does not grow them without bound. The bound is at least
/// `--reply-buffer`'s replies, which wait there too.
const OUT_BACKLOG: usize = 1024 * 1024;

type Reconnect = Pin<Box<dyn Future<Output = Result<Reopened, String>> + Send + Sync>>;

enum Link {
    Up(Box<handed::UpStream>),
    Reconnecting(Reconnect),
    /// The export changed: what is left in `out` goes up, then the end.
    Changed,
}

/// A request passed on and not yet wholly answered.
struct Kept {
    /// Its place in the line: numbers only grow, so the replay's place
    /// survives the removal of any answered request before it.
    seq: u64,
    /// Known once its header is whole (the last one may be in part).
    cookie: u64,
    /// Its header and payload as passed on so far.
    bytes: Vec<u8>,
    /// How many of `bytes` went on the current connection.
    sent: usize,
    /// It was in flight at a drop: the reconnect deadline runs until it
    /// is answered.
    resent: bool,
    /// The server answered it ESHUTDOWN: held back, and sent again on the
    /// next connection.
    shut: bool,
}

/// What the reply side waits for next.
#[derive(Clone, Copy)]
enum Need {
    Magic,
    Header(usize),
    Payload(ReplyFrame, u64),
}

/// Where a local connection stands with the server, as `/readyz` and the
/// gauges count it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Standing {
    Fine,
    /// Down, or up and not yet answering, within --reconnect-timeout.
    Reconnecting,
    /// Past --reconnect-timeout with no connection: requests fail at once.
    Unreachable,
}

/// How reading the server's connection ended, if it did.
enum ReadEnd {
    /// A drop: reconnect.
    Lost(String),
    /// The server broke the protocol.
    Invalid(io::Error),
    /// After NBD_CMD_DISC: the end.
    Done,
}

pub struct Reconnecting {
    link: Link,
    settings: Arc<ClientSettings>,
    opened: Arc<Opened>,
    mode: ReplyMode,
    max_reply: u64,
    /// Bytes so far of the header of the request being written (kept as
    /// the last of `kept`, so that a drop replays it), until it is whole.
    head_len: usize,
    /// Payload bytes of the request being written still to come.
    payload_left: u64,
    kept: VecDeque<Kept>,
    /// Bytes in `kept`, against `--replay-buffer`.
    held: usize,
    /// How many of `kept` are `resent`.
    resent: usize,
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
    /// A write waits for the reconnect: once the export changed, what it
    /// brings gets its EIO before the end is read.
    writer_blocked: bool,
    /// Why requests fail, for the EIO replies.
    failed: String,
    /// Sending the kept requests again on a new connection: the `seq` of
    /// the next one (how much of it is written is its `sent`). Replies
    /// are read meanwhile (a server blocked sending them would stop
    /// reading the replay), and nothing is copied: they are written from
    /// `kept` itself.
    replay: Option<u64>,
    /// The `seq` the next kept request gets.
    next_seq: u64,
    /// A reply other than ESHUTDOWN came on this connection.
    good: bool,
    /// This connection replaced one that dropped (for the metrics).
    after_drop: bool,
    /// The wait before the first try after a drop: none after a good
    /// connection, else the backoff where it was.
    wait: Duration,
    /// One deadline from the first drop with requests in flight (or the
    /// first request to a connection after a drop) until a connection is
    /// good; drops in between do not restart it.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The deadline passed: until a connection is good, a request fails at
    /// once while none is up (tries go on in the background).
    failing: bool,
    /// The server answered ESHUTDOWN: new requests wait, and once each
    /// one in flight has its answer the connection is dropped.
    server_going: bool,
    /// Requests answered ESHUTDOWN whose later chunks are still to come:
    /// dropped as they come.
    shut_chunks: HashSet<u64>,
    /// The write being passed on had its last reply before its payload
    /// passed: the reply goes up once the payload has.
    early_done: Option<u64>,
    progress: reopen::Shared,
    standing: Standing,
}

impl Reconnecting {
    pub fn new(
        remote: RemoteTls,
        settings: Arc<ClientSettings>,
        opened: Opened,
        mode: ReplyMode,
    ) -> Self {
        let up = Link::Up(Box::new(handed::UpStream::Fresh(remote)));
        Self::with_link(up, settings, opened, mode)
    }

    fn with_link(
        link: Link,
        settings: Arc<ClientSettings>,
        opened: Opened,
        mode: ReplyMode,
    ) -> Self {
        let max_reply = crate::conn::relay::max_reply(settings.relay.max_payload);
        Reconnecting {
            link,
            settings,
            opened: Arc::new(opened),
            mode,
            max_reply,
            head_len: 0,
            payload_left: 0,
            kept: VecDeque::new(),
            held: 0,
            resent: 0,
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
            replay: None,
            next_seq: 0,
            good: false,
            after_drop: false,
            // The first connection has not answered yet either.
            wait: reopen::FIRST_DELAY,
            deadline: None,
            failing: false,
            server_going: false,
            shut_chunks: HashSet::new(),
            early_done: None,
            progress: reopen::Shared::default(),
            standing: Standing::Fine,
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

    /// A request is being written (its header or payload in part).
    fn passing(&self) -> bool {
        self.head_len > 0 || self.payload_left > 0
    }

    fn wake_writer(&mut self) {
        if let Some(waker) = self.write_waiting.take() {
            waker.wake();
        }
    }

    /// Writes the kept requests to a new connection, from `kept` itself,
    /// then flushes them. Requests answered meanwhile leave `kept`: the
    /// place is a `seq`, which their removal does not move.
    fn poll_replay(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), String>> {
        let failed =
            |e: &dyn std::fmt::Display| format!("sending the requests in flight again: {e}");
        while let Some(seq) = self.replay {
            let at = self.kept.partition_point(|k| k.seq < seq);
            let Link::Up(conn) = &mut self.link else {
                return Poll::Ready(Ok(()));
            };
            let Some(kept) = self.kept.get_mut(at) else {
                std::task::ready!(Pin::new(conn.as_mut()).poll_flush(cx))
                    .map_err(|e| failed(&e))?;
                self.replay = None;
                // A new request may have waited for the replay.
                self.wake_writer();
                break;
            };
            if kept.sent == kept.bytes.len() {
                let cookie = kept.cookie;
                self.replay = Some(kept.seq + 1);
                if at + 1 < self.kept.len() || !self.passing() {
                    self.release_early(cookie);
                }
                continue;
            }
            let written =
                std::task::ready!(Pin::new(conn.as_mut()).poll_write(cx, &kept.bytes[kept.sent..]));
            match written {
                Ok(0) => return Poll::Ready(Err(failed(&"the connection took nothing"))),
                Ok(n) => kept.sent += n,
                Err(e) => return Poll::Ready(Err(failed(&e))),
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Reads what the server sent on, assembling replies.
    fn read_server(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ReadEnd>> {
        let Link::Up(conn) = &mut self.link else {
            return Poll::Ready(Ok(()));
        };
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut read = ReadBuf::new(&mut scratch);
        let polled = Pin::new(conn.as_mut()).poll_read(cx, &mut read);
        let n = read.filled().len();
        let result = match polled {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Err(e.to_string())),
            Poll::Ready(Ok(())) if n == 0 => {
                Poll::Ready(Err("the server closed the connection".to_string()))
            }
            Poll::Ready(Ok(())) => Poll::Ready(Ok(self.follow_replies(&scratch[..n]))),
        };
        self.scratch = scratch;
        match std::task::ready!(result) {
            Ok(Ok(())) => Poll::Ready(Ok(())),
            Ok(Err(e)) => Poll::Ready(Err(ReadEnd::Invalid(e))),
            // After DISC the server's end is the end.
            Err(_) if self.disconnecting && self.kept.is_empty() => Poll::Ready(Err(ReadEnd::Done)),
            Err(why) => Poll::Ready(Err(ReadEnd::Lost(why))),
        }
    }

    /// Copies what is ready for the relay into `buf`: false if nothing is.
    fn deliver(&mut self, buf: &mut ReadBuf<'_>) -> bool {
        if self.out_at == self.out.len() {
            return false;
        }
        let n = buf.remaining().min(self.out.len() - self.out_at);
        buf.put_slice(&self.out[self.out_at..self.out_at + n]);
        let was_backlogged = self.backlogged();
        self.out_at += n;
        if was_backlogged && !self.backlogged() {
            self.wake_writer();
        }
        if self.out_at == self.out.len() {
            self.out.clear();
            self.out_at = 0;
            // A large read's buffer is not kept for an idle connection's
            // life.
            if self.out.capacity() > KEPT_CAPACITY {
                self.out = Vec::new();
            }
            if self.message.capacity() > KEPT_CAPACITY {
                self.message = Vec::new();
            }
        }
        true
    }

    /// `bytes` went to the server.
    fn wrote(&mut self, cx: &mut Context<'_>, bytes: &[u8]) -> io::Result<usize> {
        self.record(bytes)?;
        if !self.good && (self.failing || self.after_drop) && self.deadline.is_none() {
            // A connection that replaced a dropped one (after an idle
            // drop, or past the deadline) and has not answered yet gets
            // --reconnect-timeout to answer this request: a silent server
            // fails it in time too.
            self.arm_deadline();
            self.poll_deadline(cx);
        }
        if self.out_at < self.out.len() {
            // An early reply went up with the payload's end.
            cx.waker().wake_by_ref();
        }
        Ok(bytes.len())
    }

    /// Whether the replies waiting for the local client are past the
    /// bound beyond which an EIO answer waits (only a whole request: one
    /// being written is taken to its end).
    fn backlogged(&self) -> bool {
        !self.passing() && self.out.len() - self.out_at > OUT_BACKLOG
    }

    /// Past the deadline with no connection up (or the export changed):
    /// the request is taken and answered EIO at once, unless the local
    /// client has left too many answers unread: then it waits for them
    /// to be read.
    fn swallow(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.backlogged() {
            self.write_waiting = Some(cx.waker().clone());
            return Poll::Pending;
        }
        self.writer_blocked = false;
        self.record(buf)?;
        self.fail_kept();
        cx.waker().wake_by_ref();
        Poll::Ready(Ok(buf.len()))
    }
}

impl Drop for Reconnecting {
    fn drop(&mut self) {
        self.set_standing(Standing::Fine);
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
            if this.deliver(buf) {
                return Poll::Ready(Ok(()));
            }
            if let Link::Changed = this.link {
                // The write side is polled in the same task: its request
                // gets its EIO first, and then the end.
                if this.writer_blocked {
                    return Poll::Pending;
                }
                return Poll::Ready(Ok(()));
            }
            if this.disconnecting && this.kept.is_empty() && !matches!(this.link, Link::Up(_)) {
                return Poll::Ready(Ok(()));
            }
            if this.poll_deadline(cx) {
                continue;
            }
            if !std::task::ready!(this.drive(cx)) {
                continue;
            }
            // The replay goes on while replies are read: a server blocked
            // sending them does not read it.
            if let Poll::Ready(Err(why)) = this.poll_replay(cx) {
                this.lost(&why);
                continue;
            }
            match std::task::ready!(this.read_server(cx)) {
                Ok(()) => {}
                Err(ReadEnd::Lost(why)) => this.lost(&why),
                Err(ReadEnd::Invalid(e)) => return Poll::Ready(Err(e)),
                Err(ReadEnd::Done) => return Poll::Ready(Ok(())),
            }
            if this.server_done() {
                this.lost("the server is shutting down (it answered ESHUTDOWN)");
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
            if let Link::Changed = this.link {
                // Nothing will be sent any more: each request is answered
                // EIO at once, so the local client hears of it.
                return this.swallow(cx, buf);
            }
            if this.poll_deadline(cx) {
                continue;
            }
            match this.drive(cx) {
                Poll::Pending if this.failing => return this.swallow(cx, buf),
                Poll::Pending if this.deadline.is_none() => {
                    // A request waits for a connection: the deadline runs.
                    this.arm_deadline();
                    continue;
                }
                Poll::Pending => {
                    this.writer_blocked = true;
                    return Poll::Pending;
                }
                Poll::Ready(false) => continue,
                Poll::Ready(true) => this.writer_blocked = false,
            }
            match this.poll_replay(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(why)) => {
                    this.lost(&why);
                    continue;
                }
                Poll::Pending => {
                    // Reading replies may finish the replay.
                    this.write_waiting = Some(cx.waker().clone());
                    return Poll::Pending;
                }
            }
            // A new request waits while the kept ones fill the buffer (one
            // is always let through, however large), and while a server
            // that is going answers what it has.
            let full = !this.kept.is_empty() && this.held >= this.replay_buffer();
            if !this.passing() && (full || this.server_going) {
                this.write_waiting = Some(cx.waker().clone());
                return Poll::Pending;
            }
            let Link::Up(conn) = &mut this.link else {
                continue;
            };
            match Pin::new(conn.as_mut()).poll_write(cx, buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(n)) => return Poll::Ready(this.wrote(cx, &buf[..n])),
                Poll::Ready(Err(e)) => this.lost(&e.to_string()),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.poll_deadline(cx) {
                continue;
            }
            match this.drive(cx) {
                // Past the deadline or the export changed: the writes were
                // answered, nothing to flush.
                Poll::Pending if this.failing => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
                Poll::Ready(false) => return Poll::Ready(Ok(())),
                Poll::Ready(true) => {}
            }
            match this.poll_replay(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(why)) => {
                    this.lost(&why);
                    continue;
                }
                Poll::Pending => {
                    this.write_waiting = Some(cx.waker().clone());
                    return Poll::Pending;
                }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::consts::*;

    fn settings() -> Arc<ClientSettings> {
        let tls = rustls::ClientConfig::builder_with_provider(crate::tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        Arc::new(ClientSettings {
            server: "localhost:10809".into(),
            host: "localhost".into(),
            port: 10809,
            server_name: "localhost".try_into().unwrap(),
            tls: Arc::new(crate::reloadable::Swap::new(Arc::new(tls))),
            server_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            relay: crate::config::RelayLimits {
                idle_timeout: None,
                stall_timeout: None,
                keepalive: None,
                max_payload: 32 << 20,
                max_option_len: 64 << 10,
            },
            max_connections: 1,
            cork: crate::config::Cork::Deferred,
            shutdown_grace: Duration::from_secs(1),
            reconnect: Some(crate::client::Reconnect {
                timeout: Duration::from_secs(60),
                replay_buffer: 64 << 20,
                reply_buffer: 64 << 20,
            }),
            metrics: Arc::new(crate::metrics::Metrics::client_mode()),
            health: Arc::default(),
            handover: None,
            tls_paths: Default::default(),
            min_version: Default::default(),
        })
    }

    /// A stream with no server connection, to follow what it keeps.
    fn detached() -> Reconnecting {
        let opened = Opened {
            reopen: Reopen::ExportName(Vec::new()),
            framing: Framing::default(),
            meta: None,
            export: (1 << 20, 0),
        };
        Reconnecting::with_link(Link::Changed, settings(), opened, ReplyMode::Simple)
    }

    /// What a replay would send: every kept byte, in order.
    fn replayed(r: &Reconnecting) -> Vec<u8> {
        r.kept
            .iter()
            .flat_map(|k| k.bytes.iter().copied())
            .collect()
    }

    fn request(command: u16, cookie: u64, length: u32) -> Vec<u8> {
        let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&0u16.to_be_bytes());
        b.extend_from_slice(&command.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&0u64.to_be_bytes());
        b.extend_from_slice(&length.to_be_bytes());
        b
    }

    /// Issue 27 item 6a: on a0fc9df a header passed in part was held
    /// outside what is kept, so a drop then replayed the requests before
    /// it and the rest of the header followed alone (misframed).
    #[test]
    fn a_header_passed_in_part_is_kept_and_replayed() {
        let mut r = detached();
        let read = request(CMD_READ, 1, 4096);
        let mut write = request(CMD_WRITE, 2, 8);
        write.extend_from_slice(b"payload!");
        r.record(&read).unwrap();
        r.record(&write[..10]).unwrap();
        assert_eq!(replayed(&r), [&read[..], &write[..10]].concat());
        r.record(&write[10..31]).unwrap();
        r.record(&write[31..]).unwrap();
        assert_eq!(replayed(&r), [&read[..], &write[..]].concat());
        assert!(!r.passing());
        assert_eq!(r.held, read.len() + write.len() + 2 * KEPT_OVERHEAD);
    }

    /// A failing stream answers whole requests EIO and keeps the one
    /// still passing until its payload is in, so it never frames the
    /// rest of a payload as a header.
    #[test]
    fn failing_answers_whole_requests_and_waits_for_a_payload_to_end() {
        let mut r = detached();
        r.failed = "nbdgw client: test".into();
        let mut write = request(CMD_WRITE, 3, 8);
        write.extend_from_slice(b"payload!");
        r.record(&write[..30]).unwrap();
        r.fail_kept();
        assert_eq!(r.kept.len(), 1);
        assert!(r.out.is_empty());
        r.record(&write[30..]).unwrap();
        r.fail_kept();
        assert!(r.kept.is_empty());
        // A simple reply: EIO for cookie 3.
        assert_eq!(r.out[4..8], EIO.to_be_bytes());
        assert_eq!(r.out[8..16], 3u64.to_be_bytes());
    }

    fn simple_reply(cookie: u64, error: u32) -> Vec<u8> {
        let mut b = SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&error.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b
    }

    /// Issue 27 follow-up: a reply to a write whose payload was still
    /// passing left its cookie in the table, so a second reply was taken
    /// too: passed up twice, or (ESHUTDOWN) it deleted the held success
    /// and the request was later forgotten with no reply at all.
    #[test]
    fn a_second_reply_to_a_write_answered_before_its_payload_passed_is_refused() {
        for second in [0, ESHUTDOWN] {
            let mut r = detached();
            let mut write = request(CMD_WRITE, 4, 8);
            write.extend_from_slice(b"payload!");
            r.record(&write[..30]).unwrap();
            r.follow_replies(&simple_reply(4, 0)).unwrap();
            // Held until the payload has passed.
            assert!(r.out.is_empty());
            let again = r.follow_replies(&simple_reply(4, second));
            assert_eq!(
                again.map_err(|e| e.kind()).err(),
                Some(io::ErrorKind::InvalidData),
                "a second reply (error {second}) was taken"
            );
        }
    }

    /// Issue 27 follow-up: past the deadline, a local client that writes
    /// requests and never reads got EIO answers appended without bound.
    #[test]
    fn failing_requests_wait_while_their_answers_are_not_read() {
        let mut r = detached();
        r.failed = "nbdgw client: test".into();
        let mut cx = Context::from_waker(Waker::noop());
        let read = request(CMD_READ, 5, 4096);
        let mut waited = false;
        for _ in 0..4 * OUT_BACKLOG / 16 {
            match Pin::new(&mut r).poll_write(&mut cx, &read) {
                Poll::Ready(written) => assert_eq!(written.unwrap(), read.len()),
                Poll::Pending => {
                    waited = true;
                    break;
                }
            }
        }
        let backlog = r.out.len() - r.out_at;
        assert!(waited, "never waited; {backlog} bytes of answers unread");
        assert!(backlog <= OUT_BACKLOG + 16, "{backlog}");
        // Reading the answers lets the next request through.
        let mut buf = vec![0u8; backlog];
        let mut into = ReadBuf::new(&mut buf);
        assert!(Pin::new(&mut r).poll_read(&mut cx, &mut into).is_ready());
        assert!(r.write_waiting.is_none(), "the writer was not woken");
        assert!(Pin::new(&mut r).poll_write(&mut cx, &read).is_ready());
    }
}
