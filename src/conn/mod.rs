//! One client connection: plaintext greeting, STARTTLS, the relayed
//! option haggling, then transmission. This module owns all the I/O;
//! `crate::proto` only parses.

mod negotiate;
mod plain;
mod relay;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, BufReader};
use tokio::net::TcpStream;
use tracing::{info, warn, Instrument};

use crate::admission::{Admission, HandshakePermit, SessionPermit, SourceClaim};
use crate::config::Config;
use crate::proto::ProtoError;
use crate::shutdown::Shutdown;
use crate::tls::SessionGuard;

/// Plaintext reads before STARTTLS are tiny, but the same buffer sits under
/// TLS afterwards, where large reads cut syscalls (a 32 MiB write payload:
/// about 2,000 reads of one record each without it, about 130 with it).
/// Its pages are only touched as data arrives, so idle connections stay small.
const CLIENT_READ_BUF: usize = 256 * 1024;

type ClientIo = BufReader<TcpStream>;
type ClientTls = tokio_rustls::server::TlsStream<ClientIo>;

#[derive(Debug, Error)]
pub enum ConnError {
    #[error("client I/O error: {0}")]
    Client(io::Error),
    #[error("client closed the connection {0}")]
    ClientClosed(&'static str),
    #[error("client broke the protocol: {0}")]
    ClientProto(ProtoError),
    #[error("TLS handshake failed: {0}")]
    Tls(io::Error),
    #[error("negotiation not finished within {0:?}")]
    HandshakeTimeout(Duration),
    #[error("idle for {0:?} with no request in flight")]
    IdleTimeout(Duration),
    #[error("upstream I/O error: {0}")]
    Upstream(io::Error),
    #[error("upstream closed the connection {0}")]
    UpstreamClosed(String),
    #[error("upstream broke the protocol: {0}")]
    UpstreamProto(ProtoError),
    #[error("client made no progress {0} for {1:?} (--stall-timeout)")]
    Stalled(&'static str, Duration),
    #[error("client certificate revoked by a reload (--tls-revoke-closes)")]
    Revoked,
    #[error("shutdown grace period over with requests still in flight")]
    GraceOver,
}

impl ConnError {
    /// Maps a failed client read: EOF means the client went away.
    fn client_read(e: io::Error, when: &'static str) -> Self {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            ConnError::ClientClosed(when)
        } else {
            ConnError::Client(e)
        }
    }

    /// Before the client has said anything, a reset or broken pipe is
    /// just a health check or port scan leaving, not a fault.
    fn client_left_early(e: io::Error, when: &'static str) -> Self {
        match e.kind() {
            io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
                ConnError::ClientClosed(when)
            }
            _ => Self::client_read(e, when),
        }
    }

    fn upstream_read(e: io::Error, when: &str) -> Self {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            ConnError::UpstreamClosed(when.to_string())
        } else {
            ConnError::Upstream(e)
        }
    }
}

/// Counters for the close log line.
#[derive(Debug, Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub replies: AtomicU64,
    pub bytes_from_client: AtomicU64,
    pub bytes_to_client: AtomicU64,
}

impl Stats {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// A connection the accept loop took, counted against its source address.
pub struct Accepted {
    pub tcp: TcpStream,
    pub peer: SocketAddr,
    pub id: u64,
    pub source: SourceClaim,
}

/// Serves one accepted connection to its end and logs how it ended.
pub async fn serve(conn: Accepted, config: &Config, admission: &Admission, shutdown: Shutdown) {
    let Accepted {
        tcp,
        peer,
        id,
        source,
    } = conn;
    let span = tracing::info_span!("conn", id, %peer);
    async move {
        let handshake = match admission.handshake(source).await {
            Ok(permit) => permit,
            Err(refusal) => return admission.log_refusal(peer, refusal),
        };
        info!("accepted");
        let started = Instant::now();
        let stats = Stats::default();
        let mut cut = shutdown.clone();
        let link = Link {
            id,
            config,
            admission,
            shutdown,
            stats: &stats,
        };
        let result = tokio::select! {
            result = run(tcp, handshake, link) => result,
            () = cut.cut() => Err(ConnError::GraceOver),
        };
        let requests = Stats::get(&stats.requests);
        let replies = Stats::get(&stats.replies);
        let bytes_in = Stats::get(&stats.bytes_from_client);
        let bytes_out = Stats::get(&stats.bytes_to_client);
        let secs = started.elapsed().as_secs_f64();
        match result {
            Ok(reason) => info!(
                reason,
                requests, replies, bytes_in, bytes_out, secs, "closed"
            ),
            // Health checks and port scanners connect and leave: routine.
            Err(error @ ConnError::ClientClosed(_)) => info!(
                %error,
                requests, replies, bytes_in, bytes_out, secs, "closed"
            ),
            Err(error) => warn!(
                %error,
                requests, replies, bytes_in, bytes_out, secs, "closed"
            ),
        }
    }
    .instrument(span)
    .await
}

/// What a connection's phases share besides its streams.
pub(crate) struct Link<'a> {
    pub id: u64,
    pub config: &'a Config,
    pub admission: &'a Admission,
    pub shutdown: Shutdown,
    pub stats: &'a Stats,
}

/// Returns why the connection ended normally, or what went wrong.
async fn run(
    tcp: TcpStream,
    handshake_permit: HandshakePermit,
    link: Link<'_>,
) -> Result<&'static str, ConnError> {
    let config = link.config;
    // Before the TLS handshake: in TLS 1.3 the client speaks last, and
    // Nagle would hold its first request behind our unacknowledged data.
    tcp.set_nodelay(true).map_err(ConnError::Client)?;
    set_liveness_checks(&tcp, config);
    // A second handle on the same socket for TCP_CORK once the TLS stream
    // is split into halves.
    let cork_handle = if config.cork != crate::config::Cork::Off {
        socket2::SockRef::from(&tcp).try_clone().ok()
    } else {
        None
    };
    let io = BufReader::with_capacity(CLIENT_READ_BUF, tcp);

    let handshake = async {
        let (io, client_flags) = match plain::negotiate(io, config, &link.shutdown).await? {
            plain::Outcome::StartTls(io, flags) => (io, flags),
            plain::Outcome::Closed(reason) => return Ok(Negotiated::Closed(reason)),
        };
        let tls = plain::accept_tls(io, config).await?;
        let (_, conn) = tls.get_ref();
        let chain = conn.peer_certificates().unwrap_or_default();
        let client = match chain.first() {
            Some(cert) => crate::tls::identity::describe(cert),
            None => "no certificate".to_string(),
        };
        info!(
            tls_version = ?conn.protocol_version(),
            cipher_suite = ?conn.negotiated_cipher_suite().map(|s| s.suite()),
            key_exchange = ?conn.negotiated_key_exchange_group().map(|g| g.name()),
            %client,
            "TLS established"
        );
        // Authenticated: from here on the connection holds a session slot,
        // not a handshake slot.
        let session = match link.admission.session() {
            Ok(session) => session,
            Err(refusal) => {
                warn!(reason = %refusal, "session refused");
                let message = format!("nbdgw: {refusal}; try again later");
                let reason = negotiate::refuse_all(tls, &message, config).await?;
                return Ok(Negotiated::Closed(reason));
            }
        };
        drop(handshake_permit);
        let registered =
            (!chain.is_empty()).then(|| config.tls.sessions().register(link.id, chain));
        Ok(
            match negotiate::relay_options(tls, client_flags, config, &link.shutdown).await? {
                negotiate::Outcome::Closed(reason) => Negotiated::Closed(reason),
                negotiate::Outcome::Transmission(transmission) => Negotiated::Transmission {
                    session: transmission,
                    slot: session,
                    registered,
                },
            },
        )
    };
    let negotiated = tokio::time::timeout(config.handshake_timeout, handshake)
        .await
        .map_err(|_| ConnError::HandshakeTimeout(config.handshake_timeout))??;
    match negotiated {
        Negotiated::Closed(reason) => Ok(reason),
        Negotiated::Transmission {
            session,
            slot: _slot,
            registered,
        } => {
            let relayed = relay::run(session, cork_handle, &link);
            until_revoked(registered.as_ref(), relayed).await
        }
    }
}

/// How negotiation ended, with what an established session holds.
enum Negotiated {
    Closed(&'static str),
    Transmission {
        session: Box<negotiate::Session>,
        slot: SessionPermit,
        registered: Option<SessionGuard>,
    },
}

/// Runs `work` unless the session's certificate is revoked first.
async fn until_revoked<T>(
    registered: Option<&SessionGuard>,
    work: impl Future<Output = Result<T, ConnError>>,
) -> Result<T, ConnError> {
    let Some(guard) = registered else {
        return work.await;
    };
    tokio::select! {
        result = work => result,
        () = guard.revoked() => Err(ConnError::Revoked),
    }
}

/// Keepalive notices a client that vanished without a FIN or RST while
/// idle; TCP_USER_TIMEOUT one that vanished with our data unacknowledged.
fn set_liveness_checks(tcp: &TcpStream, config: &Config) {
    let socket = socket2::SockRef::from(tcp);
    if let Some(keepalive) = config.keepalive {
        let params = socket2::TcpKeepalive::new()
            .with_time(keepalive.idle)
            .with_interval(keepalive.interval)
            .with_retries(keepalive.count);
        if let Err(e) = socket.set_tcp_keepalive(&params) {
            warn!(error = %e, "cannot set TCP keepalive");
        }
    }
    if let Some(stall) = config.stall_timeout {
        if let Err(e) = socket.set_tcp_user_timeout(Some(stall)) {
            warn!(error = %e, "cannot set TCP_USER_TIMEOUT");
        }
    }
}

/// `io` with the stall timeout: an error if it makes no progress in time.
async fn within_stall<T>(
    config: &Config,
    doing: &'static str,
    io: impl Future<Output = Result<T, ConnError>>,
) -> Result<T, ConnError> {
    match config.stall_timeout {
        None => io.await,
        Some(limit) => tokio::time::timeout(limit, io)
            .await
            .map_err(|_| ConnError::Stalled(doing, limit))?,
    }
}

/// Reads and drops `len` bytes of a request payload nbdgw refuses: it must
/// still leave the stream, or the next request header is read from it.
/// Each read must make progress within the stall timeout.
async fn discard<R: AsyncRead + Unpin>(
    reader: &mut R,
    len: u64,
    config: &Config,
) -> Result<(), ConnError> {
    let mut scratch = [0u8; 16 * 1024];
    let mut left = len;
    while left > 0 {
        let want = scratch
            .len()
            .min(usize::try_from(left).unwrap_or(usize::MAX));
        let read = within_stall(config, "sending a request payload", async {
            reader
                .read(&mut scratch[..want])
                .await
                .map_err(ConnError::Client)
        })
        .await?;
        if read == 0 {
            return Err(ConnError::ClientClosed(
                "in the middle of a request payload",
            ));
        }
        left -= read as u64;
    }
    Ok(())
}
