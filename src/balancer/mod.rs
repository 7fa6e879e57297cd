//! Behind a load balancer: the PROXY protocol header (v1 or v2) that a
//! trusted balancer (`--proxy-protocol-from`) puts before each connection
//! to say whose it is. The parsing is `proto::proxy`'s; this reads it off
//! the socket and decides what the connection's peer is.
//!
//! From a trusted prefix the header is required (the spec: a receiver
//! "MUST not try to guess whether the protocol header is present"), and
//! a connection without a valid one is closed. From anyone else no header
//! is looked for: bytes that look like one are the client's first NBD
//! bytes, and fail there.
//!
//! Before its header, a connection's TCP peer is the balancer, so it
//! cannot be judged per source yet: all clients behind the balancer would
//! be one source, and a herd from one of them would starve the rest. Such
//! a connection is therefore admitted per source only once its header is
//! read, under its real address; until then it counts against a bound of
//! its own (`--max-handshakes` plus `--handshake-queue`, the most that
//! admission itself holds before authentication) and against
//! `--handshake-timeout`, which runs from accept and goes on counting
//! after the header.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use thiserror::Error;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::proto::proxy::{self, Address, Parsed, ProxyError, Version};
use crate::source::{source_key, Source};

pub mod pending;

/// The default and least `--proxy-protocol-max-header`: a v2 header of
/// TCP over IPv6 (16 + 36 bytes) must fit, and the default leaves room
/// for the TLVs cloud balancers add (an endpoint ID, a TLS summary).
pub const DEFAULT_MAX_HEADER: usize = 1024;
/// The default `--proxy-protocol-timeout`: a balancer writes the header
/// with its connect, so seconds are ample even on a loaded path, and a
/// peer that holds a place of the bound is let go sooner.
pub const DEFAULT_HEADER_TIMEOUT_SECS: u64 = 5;
pub const MIN_MAX_HEADER: usize = proxy::V2_PREFIX + 36;
/// A v2 header can announce no more than 16 + 65535 bytes.
pub const MAX_MAX_HEADER: usize = proxy::V2_PREFIX + u16::MAX as usize;

/// A trusted prefix: a source (`crate::source`) as admission has them,
/// an address and how many leading bits of it count, so the two match
/// peers alike (IPv4-mapped ones as IPv4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefix(Source);

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0:?} is not an address or a CIDR prefix (192.0.2.0/24, 2001:db8::/32, 10.1.2.3)")]
pub struct PrefixParseError(String);

impl FromStr for Prefix {
    type Err = PrefixParseError;

    /// `ADDR/LEN`, or a bare address (a /32 or /128). Host bits set past
    /// the length are refused: `10.0.0.1/8` is more likely a typo for a
    /// single host than a wish to trust all of 10/8.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // `10.0.0.0/8, 192.168.0.0/16` in the variable: items trimmed.
        let s = s.trim();
        let bad = || PrefixParseError(s.to_string());
        let (addr, len) = match s.split_once('/') {
            Some((addr, len)) => (addr, Some(len)),
            None => (s, None),
        };
        let network: IpAddr = addr.parse().map_err(|_| bad())?;
        let width = if network.is_ipv4() { 32 } else { 128 };
        let len = match len {
            None => width,
            Some(len) if len.bytes().all(|b| b.is_ascii_digit()) => {
                len.parse::<u8>().map_err(|_| bad())?
            }
            Some(_) => return Err(bad()),
        };
        // Peers are matched as IPv4 when IPv4-mapped, so an IPv4-mapped
        // prefix is too, or it would match nothing.
        let len = match network {
            IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => {
                len.checked_sub(96).ok_or_else(bad)?
            }
            _ => len,
        };
        let width = if network.to_canonical().is_ipv4() {
            32
        } else {
            128
        };
        let source = source_key(network, len, len);
        if len > width || source.network() != network.to_canonical() {
            return Err(bad());
        }
        Ok(Prefix(source))
    }
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Prefix {
    /// Whether `ip` is inside; an IPv4-mapped IPv6 peer (a dual-stack
    /// listener) is its IPv4 address, as it is for admission.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let len = self.0.prefix_len();
        source_key(ip, len, len) == self.0
    }
}

/// An item of `--proxy-protocol-from`: a prefix, or nothing for an empty
/// item (an empty variable, a trailing comma), which is skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixItem(pub Option<Prefix>);

impl FromStr for PrefixItem {
    type Err = PrefixParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "" => Ok(PrefixItem(None)),
            s => s.parse().map(|p| PrefixItem(Some(p))),
        }
    }
}

/// `--proxy-protocol-from` and `--proxy-protocol-max-header`.
#[derive(Debug, Clone, Default)]
pub struct Trusted {
    pub from: Vec<Prefix>,
    /// The longest v2 header taken, 16 bytes and the rest together.
    pub max_header: usize,
    /// The most connections from balancers waiting for their header
    /// (see `pending`), after the descriptor limit's fitting.
    pub pending: usize,
    /// `--proxy-protocol-serve-local`: serve v2 LOCAL connections as the
    /// balancer's own, rather than close them after their header.
    pub serve_local: bool,
    /// `--proxy-protocol-timeout`.
    pub header_timeout: std::time::Duration,
}

impl Trusted {
    /// The trusted balancers, once at start: who must send a header; a
    /// prefix of length 0 trusts every client to name any source, so it
    /// is warned of.
    pub fn announce(&self) {
        if self.from.is_empty() {
            return;
        }
        let from: Vec<String> = self.from.iter().map(ToString::to_string).collect();
        tracing::info!(from = %from.join(","), "a PROXY protocol header is required from these balancers, and read from no one else");
        if let Some(all) = self.from.iter().find(|p| p.0.prefix_len() == 0) {
            tracing::warn!(prefix = %all, "--proxy-protocol-from trusts every address: any client can claim any source, a proven one too; name the balancers instead");
        }
    }

    /// Whether a connection from `ip` must start with a header.
    pub fn trusts(&self, ip: IpAddr) -> bool {
        self.from.iter().any(|p| p.contains(ip))
    }
}

/// Why a trusted peer's connection was closed before NBD.
#[derive(Debug, Error)]
pub enum HeaderError {
    #[error("{0}")]
    Invalid(#[from] ProxyError),
    #[error("a PROXY header that does not say whom it relays (v1 UNKNOWN, or v2 PROXY over a family other than TCP): refused rather than counted as the balancer")]
    Unknown,
    #[error("the balancer closed the connection before the end of the PROXY header")]
    Closed,
    #[error("the balancer closed the connection without sending a byte (a TCP check)")]
    Empty,
    #[error("reading the PROXY header: {0}")]
    Io(std::io::Error),
}

impl HeaderError {
    /// The `outcome` label of `nbdgw_proxy_headers_total`.
    pub fn metric_outcome(&self) -> &'static str {
        match self {
            HeaderError::Invalid(_) => "invalid",
            HeaderError::Unknown => "unknown",
            HeaderError::Closed | HeaderError::Empty | HeaderError::Io(_) => "closed",
        }
    }
}

/// How a connection from a balancer ended before its session, if it did.
#[derive(Debug, Error)]
pub enum PreHeaderEnd {
    #[error("{0}")]
    Header(#[from] HeaderError),
    #[error("no PROXY header within {}s (--proxy-protocol-timeout, or --handshake-timeout if shorter)", .0.as_secs())]
    Timeout(std::time::Duration),
    #[error("nbdgw is shutting down")]
    ShuttingDown,
    #[error("a v2 LOCAL header (the balancer's own connection, or clients it cannot name): closed after it, as --proxy-protocol-serve-local is off")]
    Local,
}

impl PreHeaderEnd {
    /// The `outcome` label of `nbdgw_proxy_headers_total`.
    pub fn metric_outcome(&self) -> &'static str {
        match self {
            PreHeaderEnd::Header(e) => e.metric_outcome(),
            PreHeaderEnd::Timeout(_) => "timeout",
            PreHeaderEnd::ShuttingDown => "shutting_down",
            PreHeaderEnd::Local => "local",
        }
    }

    /// Counted, and said in a line: a warning for what a trusted peer got
    /// wrong, only at debug for what is routine (a TCP check's connect
    /// and close, a LOCAL health check, a shutdown with many pending).
    pub fn log(&self, metrics: &crate::metrics::Metrics, balancer: SocketAddr) {
        let outcome = self.metric_outcome();
        metrics.proxy_header(outcome);
        if !matches!(self, PreHeaderEnd::Local) {
            metrics.connection("refused");
        }
        let reason = self.to_string();
        let reason = crate::logsafe::escape(&reason);
        match self {
            PreHeaderEnd::Header(HeaderError::Empty)
            | PreHeaderEnd::ShuttingDown
            | PreHeaderEnd::Local => {
                tracing::debug!(%balancer, outcome, %reason, "connection from a --proxy-protocol-from balancer closed before NBD")
            }
            _ => {
                tracing::warn!(%balancer, outcome, %reason, "connection from a --proxy-protocol-from balancer refused: it must start with a valid PROXY protocol header")
            }
        }
    }
}

/// What a header said: the peer to use from now on, and the label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Carried {
    pub peer: SocketAddr,
    pub outcome: &'static str,
}

/// Reads the header off `tcp`, exactly to its last byte, and returns the
/// real peer: the carried source, or the balancer itself (`balancer`)
/// for its own connections (v2 LOCAL: health checks, which the spec says
/// to accept with the real endpoints). Not bounded in time here: the
/// caller's handshake timeout is.
pub async fn read_header(
    tcp: &mut TcpStream,
    balancer: SocketAddr,
    max_header: usize,
) -> Result<Carried, HeaderError> {
    let max_v2 = max_header.saturating_sub(proxy::V2_PREFIX);
    let mut buf = Vec::with_capacity(proxy::V1_MAX);
    let header = loop {
        match proxy::parse(&buf, max_v2)? {
            Parsed::Done(header) => break header,
            Parsed::Incomplete { need } => {
                // At most `need`: never a byte past the header.
                let have = buf.len();
                buf.resize(have + need, 0);
                let read = tcp.read(&mut buf[have..]).await.map_err(HeaderError::Io)?;
                buf.truncate(have + read);
                match (read, have) {
                    (0, 0) => return Err(HeaderError::Empty),
                    (0, _) => return Err(HeaderError::Closed),
                    _ => {}
                }
            }
        }
    };
    let (peer, outcome) = match (header.address, header.version) {
        (Address::Proxied(peer), Version::V1) => (peer, "v1"),
        (Address::Proxied(peer), Version::V2) => (peer, "v2"),
        (Address::Local, _) => (balancer, "local"),
        (Address::Unknown, _) => return Err(HeaderError::Unknown),
    };
    // HAProxy carries an IPv4 client as IPv4-mapped TCP6 when the two
    // ends' families differ: logged and judged as a direct client is.
    Ok(Carried {
        peer: SocketAddr::new(peer.ip().to_canonical(), peer.port()),
        outcome,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// Sends `bytes` then `after` over loopback TCP, in one write, and
    /// reads the header: returns it and the bytes left on the socket.
    async fn over_tcp(bytes: &[u8], after: &[u8]) -> (Result<Carried, HeaderError>, Vec<u8>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut sender = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut tcp, balancer) = listener.accept().await.unwrap();
        let mut all = bytes.to_vec();
        all.extend(after);
        sender.write_all(&all).await.unwrap();
        sender.shutdown().await.unwrap();
        let carried = read_header(&mut tcp, balancer, DEFAULT_MAX_HEADER).await;
        let mut rest = Vec::new();
        tcp.read_to_end(&mut rest).await.unwrap();
        (carried, rest)
    }

    #[tokio::test]
    async fn the_header_is_read_to_its_last_byte_and_no_further() {
        let client: SocketAddr = "[2001:db8::7]:40000".parse().unwrap();
        let dest: SocketAddr = "[2001:db8::1]:10809".parse().unwrap();
        let after = b"NBD bytes that are not the header's";
        for header in [
            proxy::encode_v1(client, dest),
            proxy::encode_v2(client, dest, &[4, 0, 3, 0, 0, 0]),
        ] {
            let (carried, rest) = over_tcp(&header, after).await;
            assert_eq!(carried.unwrap().peer, client);
            assert_eq!(rest, after);
        }
        let mut local = proxy::V2_SIGNATURE.to_vec();
        local.extend([0x20, 0, 0, 0]);
        let (carried, rest) = over_tcp(&local, after).await;
        let carried = carried.unwrap();
        assert_eq!(
            (carried.outcome, carried.peer.ip()),
            ("local", [127, 0, 0, 1].into())
        );
        assert_eq!(rest, after);
        let (carried, _) = over_tcp(b"PROXY UNKNOWN\r\n", after).await;
        assert!(matches!(carried, Err(HeaderError::Unknown)));
        let (carried, _) = over_tcp(b"PROXY TCP4 1.2.3.4", b"").await;
        assert!(matches!(carried, Err(HeaderError::Closed)));
    }

    /// Review items 6 and 10: a connect-and-close (an L4 check) is told
    /// apart from a cut header; an IPv4 client carried IPv4-mapped in a
    /// TCP6 header is its IPv4 address, as a direct client is.
    #[tokio::test]
    async fn a_silent_close_is_empty_and_a_mapped_client_is_ipv4() {
        let (carried, _) = over_tcp(b"", b"").await;
        assert!(matches!(carried, Err(HeaderError::Empty)), "{carried:?}");
        let (carried, _) = over_tcp(b"P", b"").await;
        assert!(matches!(carried, Err(HeaderError::Closed)), "{carried:?}");
        let mapped: SocketAddr = "[::ffff:192.0.2.7]:40000".parse().unwrap();
        let dest: SocketAddr = "[2001:db8::1]:10809".parse().unwrap();
        let (carried, _) = over_tcp(&proxy::encode_v2(mapped, dest, &[]), b"").await;
        assert_eq!(carried.unwrap().peer, "192.0.2.7:40000".parse().unwrap());
    }

    /// Review items 4 and 7: an IPv4-mapped prefix is its IPv4 prefix (it
    /// matched nothing); items are trimmed and empty ones skipped.
    #[test]
    fn mapped_prefixes_match_and_list_items_are_trimmed() {
        let p: Prefix = "::ffff:127.0.0.9".parse().unwrap();
        assert!(p.contains("127.0.0.9".parse().unwrap()), "{p}");
        assert_eq!(p.to_string(), "127.0.0.9/32");
        let p: Prefix = "::ffff:10.0.0.0/104".parse().unwrap();
        assert_eq!(p.to_string(), "10.0.0.0/8");
        assert!("::ffff:0.0.0.0/95".parse::<Prefix>().is_err());
        assert_eq!(
            " 192.168.0.0/16".parse::<PrefixItem>().unwrap(),
            PrefixItem(Some("192.168.0.0/16".parse().unwrap()))
        );
        assert_eq!("".parse::<PrefixItem>().unwrap(), PrefixItem(None));
        assert_eq!(" ".parse::<PrefixItem>().unwrap(), PrefixItem(None));
    }

    #[test]
    fn prefixes_parse_and_match_as_cidr_says() {
        let p: Prefix = "10.1.0.0/16".parse().unwrap();
        assert!(p.contains("10.1.255.3".parse().unwrap()));
        assert!(p.contains("::ffff:10.1.0.9".parse().unwrap()));
        assert!(!p.contains("10.2.0.1".parse().unwrap()));
        let host: Prefix = "127.0.0.1".parse().unwrap();
        assert_eq!(host.to_string(), "127.0.0.1/32");
        assert!(!host.contains("127.0.0.2".parse().unwrap()));
        let v6: Prefix = "fd00::/8".parse().unwrap();
        assert!(v6.contains("fd12::1".parse().unwrap()));
        assert!(!v6.contains("10.0.0.1".parse().unwrap()));
        let all: Prefix = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("192.0.2.1".parse().unwrap()));
        assert!(!all.contains("2001:db8::1".parse().unwrap()));
        for bad in [
            "10.0.0.1/8",
            "10.0.0.0/33",
            "::/129",
            "10.0.0.0/",
            "x",
            "10.0.0.0/+8",
        ] {
            assert!(bad.parse::<Prefix>().is_err(), "{bad}");
        }
    }
}
