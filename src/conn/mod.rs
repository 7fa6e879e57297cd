//! One client connection: plaintext greeting, STARTTLS, the relayed
//! option haggling, then transmission. This module owns all the I/O;
//! `crate::proto` only parses.

mod negotiate;
mod plain;
mod relay;

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, BufReader};
use tokio::net::TcpStream;
use tracing::{info, warn, Instrument};

use crate::config::Config;
use crate::proto::ProtoError;

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

/// Serves one accepted connection to its end and logs how it ended.
pub async fn serve(
    tcp: TcpStream,
    peer: SocketAddr,
    id: u64,
    config: &Config,
    shutting_down: &AtomicBool,
) {
    let span = tracing::info_span!("conn", id, %peer);
    async move {
        info!("accepted");
        let started = Instant::now();
        let stats = Stats::default();
        let result = run(tcp, config, shutting_down, &stats).await;
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

/// Returns why the connection ended normally, or what went wrong.
async fn run(
    tcp: TcpStream,
    config: &Config,
    shutting_down: &AtomicBool,
    stats: &Stats,
) -> Result<&'static str, ConnError> {
    // Before the TLS handshake: in TLS 1.3 the client speaks last, and
    // Nagle would hold its first request behind our unacknowledged data.
    tcp.set_nodelay(true).map_err(ConnError::Client)?;
    // A second handle on the same socket for TCP_CORK once the TLS stream
    // is split into halves.
    let cork_handle = if config.cork != crate::config::Cork::Off {
        socket2::SockRef::from(&tcp).try_clone().ok()
    } else {
        None
    };
    let io = BufReader::with_capacity(CLIENT_READ_BUF, tcp);

    let handshake = async {
        let (io, client_flags) = match plain::negotiate(io, config, shutting_down).await? {
            plain::Outcome::StartTls(io, flags) => (io, flags),
            plain::Outcome::Closed(reason) => return Ok(negotiate::Outcome::Closed(reason)),
        };
        let tls = plain::accept_tls(io, config).await?;
        let (_, conn) = tls.get_ref();
        let client = match conn.peer_certificates().and_then(|chain| chain.first()) {
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
        negotiate::relay_options(tls, client_flags, config, shutting_down).await
    };
    let outcome = tokio::time::timeout(config.handshake_timeout, handshake)
        .await
        .map_err(|_| ConnError::HandshakeTimeout(config.handshake_timeout))??;
    match outcome {
        negotiate::Outcome::Closed(reason) => Ok(reason),
        negotiate::Outcome::Transmission(session) => {
            relay::run(session, cork_handle, config, stats).await
        }
    }
}

/// Reads and drops `len` bytes: the data of an option nbdgw refuses must
/// still leave the stream, or the next option header is read from it.
async fn discard<R: AsyncRead + Unpin>(reader: &mut R, len: u64) -> io::Result<()> {
    let copied = tokio::io::copy(&mut reader.take(len), &mut tokio::io::sink()).await?;
    if copied < len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}
