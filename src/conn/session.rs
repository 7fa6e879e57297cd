//! The contract between a connection's phases: the streams each hands to
//! the next, the buffer sizes and limits they share, the counters.

use std::future::{poll_fn, Future};
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::Poll;
use std::time::Duration;

use tokio::net::UnixStream;

use super::error::ConnError;
use crate::admission::Admission;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::proto::transmission::ReplyMode;
use crate::shutdown::Shutdown;

pub use super::kernel_tls::{ClientIo, ClientStream, ClientTls};

/// Plaintext reads before STARTTLS are tiny, but the same buffer sits under
/// TLS afterwards, where large reads cut syscalls (a 32 MiB write payload:
/// about 2,000 reads of one record each without it, about 130 with it).
/// Its pages are only touched as data arrives, so idle connections stay small.
pub const CLIENT_READ_BUF: usize = 256 * 1024;
/// Plaintext gathered per write to rustls: a multiple of the 16 KiB record
/// size, so that every record of a large reply is full.
pub const REPLY_CHUNK: usize = 256 * 1024;
/// rustls accepts a whole `REPLY_CHUNK` at once only if its queue has room
/// for it; the queue is empty after each flush, so this is enough.
pub const TLS_BUFFER_LIMIT: usize = REPLY_CHUNK + 64 * 1024;
/// How long a closing connection may take to say goodbye (close_notify).
pub const GOODBYE_TIMEOUT: Duration = Duration::from_secs(2);

/// A connection that has entered transmission.
pub struct Session {
    pub tls: ClientStream,
    pub upstream: UnixStream,
    pub mode: ReplyMode,
    pub read_only: bool,
    /// The export name the policy judged, and the access it granted: what
    /// a narrowing reload judges again (`--policy-revoke-closes`).
    pub export: String,
    pub access: crate::policy::Access,
    /// The read cache of an immutable export (`None`: not cached).
    pub cache: Option<crate::cache::Handle>,
    /// Where it goes and what the upstream said of it: what a successor
    /// needs to judge and serve it (a hand-over).
    pub target: Target,
}

/// The upstream end of a session, as negotiated.
#[derive(Debug, Clone, Default)]
pub struct Target {
    pub socket: std::path::PathBuf,
    pub upstream_export: String,
    pub size: u64,
    pub tflags: u16,
}

/// The tracing target of the audit trail: one line when a session
/// enters transmission ("negotiated") and one when it ends ("closed"),
/// with the fields README.md documents, so operators can route them.
pub const AUDIT: &str = "nbdgw::audit";

/// What the audit trail says of a session on both of its lines, fixed
/// when it enters transmission. Peer-controlled text is escaped here.
#[derive(Debug, Clone)]
pub struct Audit {
    /// The client certificate's names (subject, SANs, serial), escaped.
    pub client: String,
    /// The export as the client named it, escaped.
    pub export: String,
    /// The name the upstream was asked for, escaped.
    pub upstream_export: String,
    /// The upstream's socket, escaped.
    pub upstream: String,
    pub access: crate::policy::Access,
    /// `policy:N` (the Nth `[[rule]]`), or without a policy `--allow-*`
    /// (the allow-lists admitted the client) or `open`.
    pub rule: String,
    /// The line of that `[[rule]]`; 0 when no policy rule decided.
    pub rule_line: usize,
}

/// What a connection's phases share besides its streams.
pub struct Link<'a> {
    pub id: u64,
    pub config: &'a Config,
    pub admission: &'a std::sync::Arc<Admission>,
    pub shutdown: Shutdown,
    pub stats: &'a Stats,
}

/// Counters for the close log line, and the gateway's metrics beside.
pub struct Stats {
    requests: AtomicU64,
    replies: AtomicU64,
    bytes_from_client: AtomicU64,
    bytes_to_client: AtomicU64,
    /// Set when the connection enters transmission: it is a session the
    /// audit trail follows to its end.
    audit: OnceLock<Audit>,
    pub metrics: Arc<Metrics>,
}

/// The counters as the close line reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub requests: u64,
    pub replies: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

impl Stats {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Stats {
            requests: AtomicU64::new(0),
            replies: AtomicU64::new(0),
            bytes_from_client: AtomicU64::new(0),
            bytes_to_client: AtomicU64::new(0),
            audit: OnceLock::new(),
            metrics,
        }
    }

    /// A request header of `bytes` arrived.
    pub fn request(&self, command: &'static str, bytes: u64) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.metrics.request(command);
        self.received(bytes);
    }

    /// `bytes` of request payload arrived: counted as they do, so a client
    /// that leaves mid-payload is not credited with what it announced.
    pub fn received(&self, bytes: u64) {
        self.bytes_from_client.fetch_add(bytes, Ordering::Relaxed);
        self.metrics.bytes_received.inc_by(bytes);
    }

    /// A request's last reply has been queued for the client.
    pub fn reply(&self) {
        self.replies.fetch_add(1, Ordering::Relaxed);
    }

    /// `bytes` of replies were handed to TLS.
    pub fn sent(&self, bytes: u64) {
        self.bytes_to_client.fetch_add(bytes, Ordering::Relaxed);
        self.metrics.bytes_sent.inc_by(bytes);
    }

    /// A session handed over from another process: its counts so far
    /// (requests, replies, bytes in, bytes out), so that its close line
    /// tells the whole session.
    pub fn restore(&self, [requests, replies, bytes_in, bytes_out]: [u64; 4]) {
        self.requests.store(requests, Ordering::Relaxed);
        self.replies.store(replies, Ordering::Relaxed);
        self.bytes_from_client.store(bytes_in, Ordering::Relaxed);
        self.bytes_to_client.store(bytes_out, Ordering::Relaxed);
    }

    /// The connection entered transmission as `audit` says.
    pub fn opened(&self, audit: Audit) {
        // Only one negotiation per connection: a second is impossible.
        let _ = self.audit.set(audit);
    }

    pub fn audit(&self) -> Option<&Audit> {
        self.audit.get()
    }

    pub fn counts(&self) -> Counts {
        Counts {
            requests: self.requests.load(Ordering::Relaxed),
            replies: self.replies.load(Ordering::Relaxed),
            bytes_in: self.bytes_from_client.load(Ordering::Relaxed),
            bytes_out: self.bytes_to_client.load(Ordering::Relaxed),
        }
    }
}

/// What transmission needs of the configuration, the same in both
/// directions (server mode and client mode).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_payload: u32,
    pub idle_timeout: Option<Duration>,
    pub stall_timeout: Option<Duration>,
    pub cork: crate::config::Cork,
}

impl Limits {
    pub fn of(config: &Config) -> Self {
        Limits {
            max_payload: config.relay.max_payload,
            idle_timeout: config.relay.idle_timeout,
            stall_timeout: config.relay.stall_timeout,
            cork: config.cork,
        }
    }
}

/// What the relay of one session shares besides its streams, whichever
/// way the session points.
pub struct Transmit<'a> {
    pub limits: Limits,
    pub shutdown: Shutdown,
    pub stats: &'a Stats,
}

impl Link<'_> {
    pub fn transmit(&self) -> Transmit<'_> {
        Transmit {
            limits: Limits::of(self.config),
            shutdown: self.shutdown.clone(),
            stats: self.stats,
        }
    }
}

/// `io` under the stall timeout: an error if it makes no progress in time.
/// Most reads and writes finish at the first poll (the data or the buffer
/// space is there), so the timer is armed only for those that wait: a
/// timer per request would cost every request a trip to the timer wheel.
pub async fn within_stall<T>(
    stall_timeout: Option<Duration>,
    doing: &'static str,
    io: impl Future<Output = Result<T, ConnError>>,
) -> Result<T, ConnError> {
    let Some(limit) = stall_timeout else {
        return io.await;
    };
    let mut io = pin!(io);
    if let Poll::Ready(done) = poll_fn(|cx| Poll::Ready(io.as_mut().poll(cx))).await {
        return done;
    }
    tokio::time::timeout(limit, io)
        .await
        .map_err(|_| ConnError::Stalled(doing, limit))?
}
