//! The PROXY protocol header (HAProxy's doc/proxy-protocol.txt, versions
//! 1 and 2) that an L4 load balancer puts before a connection's first
//! byte to say whom it relays. Parsing only: the caller reads, and asks
//! `parse` after each read how many more bytes it needs, so it never
//! reads a byte past the header (what follows belongs to NBD).
//!
//! What the spec says and this relies on (section numbers of
//! doc/proxy-protocol.txt):
//! - 2.1: a v1 line is "PROXY" SP ("TCP4" | "TCP6" | "UNKNOWN") SP src SP
//!   dst SP sport SP dport CRLF, at most 107 bytes with the CRLF; no
//!   leading zeroes in ports or IPv4 numbers; a lone CR or LF does not end
//!   it; anything else is invalid and aborts the connection.
//! - 2.2: v2 is a 12-byte signature, a version/command byte (version 2;
//!   command 0 LOCAL, 1 PROXY, others dropped), a family/protocol byte
//!   (families 0-3 and protocols 0-2, others rejected), a 16-bit length
//!   of what follows (always to be skipped whole, even for LOCAL), then
//!   the addresses (12 bytes for TCP over IPv4, 36 over IPv6) and TLVs,
//!   which nbdgw skips.
//! - LOCAL (v2) is the balancer's own connection (a health check): "the
//!   receiver must accept this connection as valid and must use the real
//!   connection endpoints". UNKNOWN (v1), and a PROXY command over an
//!   unspecified or non-TCP family (v2), relay someone whose address the
//!   balancer could not say; the spec lets the receiver accept those
//!   with the real endpoints or reject them, and `Address::Unknown` lets
//!   the caller choose.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use thiserror::Error;

/// The longest v1 line, CRLF included (spec 2.1).
pub const V1_MAX: usize = 107;
/// The v2 signature, version byte, family byte and length.
pub const V2_PREFIX: usize = 16;
/// The v2 signature (spec 2.2).
pub const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
const V1_START: &[u8] = b"PROXY ";
/// The shortest v1 lines of each kind: "PROXY UNKNOWN\r\n",
/// "PROXY TCP4 0.0.0.0 0.0.0.0 0 0\r\n" and "PROXY TCP6 :: :: 0 0\r\n".
const V1_MIN_UNKNOWN: usize = 15;
const V1_MIN_TCP4: usize = 32;
const V1_MIN_TCP6: usize = 22;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// Whom the balancer says it relays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Address {
    /// A relayed TCP connection from this address.
    Proxied(SocketAddr),
    /// The balancer's own connection (v2 LOCAL): its TCP address is the
    /// real one.
    Local,
    /// A relayed connection whose source the balancer did not give (v1
    /// UNKNOWN; v2 PROXY over AF_UNSPEC, AF_UNIX or UDP).
    Unknown,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub version: Version,
    pub address: Address,
    /// The header's whole length in bytes: what the caller consumed.
    pub len: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// The header is not complete: read exactly `need` more bytes (at
    /// least 1) and ask again. Never more than a valid header still has.
    Incomplete {
        need: usize,
    },
    Done(Header),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum ProxyError {
    #[error("not a PROXY protocol header (first byte {0:#04x})")]
    NotProxy(u8),
    #[error("a v1 header without its CRLF in the first {V1_MAX} bytes")]
    V1TooLong,
    #[error("a malformed v1 header: {0}")]
    V1Malformed(&'static str),
    #[error("a v2 header of version {0}, not 2")]
    V2Version(u8),
    #[error("a v2 header with the unassigned command {0:#x}")]
    V2Command(u8),
    #[error("a v2 header with the unassigned family/protocol byte {0:#04x}")]
    V2Family(u8),
    #[error("a v2 header of {length} address bytes, over the limit of {limit}")]
    V2TooLong { length: usize, limit: usize },
    #[error("a v2 header whose {length} address bytes are too few for its family")]
    V2Short { length: usize },
}

/// `buf`: the bytes read so far, from the connection's first. `max_v2`:
/// the most address and TLV bytes a v2 header may announce.
pub fn parse(buf: &[u8], max_v2: usize) -> Result<Parsed, ProxyError> {
    let Some(&first) = buf.first() else {
        // No header of either version is shorter than "PROXY UNKNOWN\r\n".
        return Ok(Parsed::Incomplete {
            need: V1_MIN_UNKNOWN,
        });
    };
    match first {
        b'P' => parse_v1(buf),
        b'\r' => parse_v2(buf, max_v2),
        other => Err(ProxyError::NotProxy(other)),
    }
}

fn parse_v1(buf: &[u8]) -> Result<Parsed, ProxyError> {
    let start = buf.len().min(V1_START.len());
    if buf[..start] != V1_START[..start] {
        return Err(ProxyError::V1Malformed("it does not start with \"PROXY \""));
    }
    // A CR may only be the line's end, and an LF only after it.
    if let Some(at) = buf.iter().position(|&b| b == b'\r' || b == b'\n') {
        if buf[at] == b'\n' {
            return Err(ProxyError::V1Malformed("a bare LF"));
        }
        match buf.get(at + 1) {
            Some(b'\n') => return v1_line(&buf[..at]).map(Parsed::Done),
            Some(_) => return Err(ProxyError::V1Malformed("a CR without its LF")),
            None => {}
        }
    }
    if buf.len() >= V1_MAX {
        return Err(ProxyError::V1TooLong);
    }
    let rest = &buf[buf.len().min(V1_START.len())..];
    let shortest = if rest.starts_with(b"TCP4 ") {
        V1_MIN_TCP4
    } else if rest.starts_with(b"TCP6 ") {
        V1_MIN_TCP6
    } else {
        V1_MIN_UNKNOWN
    };
    // The CRLF can end the line no sooner than the next two bytes (the
    // next one, if a CR is last), nor before the shortest line of its kind.
    let crlf = if buf.last() == Some(&b'\r') { 1 } else { 2 };
    let need = shortest.saturating_sub(buf.len()).max(crlf);
    if buf.len() + need > V1_MAX {
        return Err(ProxyError::V1TooLong);
    }
    Ok(Parsed::Incomplete { need })
}

/// A whole v1 line without its CRLF.
fn v1_line(line: &[u8]) -> Result<Header, ProxyError> {
    let len = line.len() + 2;
    let text = std::str::from_utf8(line).map_err(|_| ProxyError::V1Malformed("not ASCII"))?;
    let mut fields = text.split(' ');
    // `parse_v1` saw "PROXY " already.
    fields.next();
    let family = fields.next().unwrap_or_default();
    if family == "UNKNOWN" {
        // "the receiver must ignore anything presented before the CRLF".
        return Ok(Header {
            version: Version::V1,
            address: Address::Unknown,
            len,
        });
    }
    let ip = |s: Option<&str>| -> Result<IpAddr, ProxyError> {
        let s = s.ok_or(ProxyError::V1Malformed("an address is missing"))?;
        let ip: IpAddr = match family {
            "TCP4" => v1_ipv4(s)?.into(),
            "TCP6" => v1_ipv6(s)?.into(),
            _ => return Err(ProxyError::V1Malformed("an unknown protocol")),
        };
        Ok(ip)
    };
    let source = ip(fields.next())?;
    ip(fields.next())?;
    let source_port = v1_port(fields.next())?;
    v1_port(fields.next())?;
    if fields.next().is_some() {
        return Err(ProxyError::V1Malformed("more than six fields"));
    }
    Ok(Header {
        version: Version::V1,
        address: Address::Proxied(SocketAddr::new(source, source_port)),
        len,
    })
}

/// Four decimal numbers without leading zeroes (spec 2.1), checked here
/// rather than trusted to the standard parser's rules.
fn v1_ipv4(s: &str) -> Result<Ipv4Addr, ProxyError> {
    let bad = ProxyError::V1Malformed("a bad IPv4 address");
    let mut octets = [0u8; 4];
    let mut parts = s.split('.');
    for octet in &mut octets {
        *octet = decimal(parts.next().ok_or(bad)?)
            .and_then(|n| u8::try_from(n).ok())
            .ok_or(bad)?;
    }
    if parts.next().is_some() {
        return Err(bad);
    }
    Ok(Ipv4Addr::from(octets))
}

/// Hexadecimal groups with at most one `::` (spec 2.1); the dotted IPv4
/// tail the standard parser also takes is refused.
fn v1_ipv6(s: &str) -> Result<Ipv6Addr, ProxyError> {
    let bad = ProxyError::V1Malformed("a bad IPv6 address");
    if !s.bytes().all(|b| b.is_ascii_hexdigit() || b == b':') {
        return Err(bad);
    }
    s.parse().map_err(|_| bad)
}

fn v1_port(s: Option<&str>) -> Result<u16, ProxyError> {
    let bad = ProxyError::V1Malformed("a bad port");
    decimal(s.ok_or(bad)?)
        .and_then(|n| u16::try_from(n).ok())
        .ok_or(bad)
}

/// 1 to 5 digits, no sign, no leading zero but in "0" itself.
fn decimal(s: &str) -> Option<u32> {
    let digits = !s.is_empty() && s.len() <= 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits || (s.len() > 1 && s.starts_with('0')) {
        return None;
    }
    s.parse().ok()
}

fn parse_v2(buf: &[u8], max_v2: usize) -> Result<Parsed, ProxyError> {
    let signature = buf.len().min(V2_SIGNATURE.len());
    if buf[..signature] != V2_SIGNATURE[..signature] {
        return Err(ProxyError::NotProxy(buf[0]));
    }
    if buf.len() < V2_PREFIX {
        return Ok(Parsed::Incomplete {
            need: V2_PREFIX - buf.len(),
        });
    }
    let (version, command) = (buf[12] >> 4, buf[12] & 0xf);
    if version != 2 {
        return Err(ProxyError::V2Version(version));
    }
    if command > 1 {
        return Err(ProxyError::V2Command(command));
    }
    let family = buf[13];
    if family >> 4 > 3 || family & 0xf > 2 {
        return Err(ProxyError::V2Family(family));
    }
    let length = usize::from(u16::from_be_bytes([buf[14], buf[15]]));
    if length > max_v2 {
        return Err(ProxyError::V2TooLong {
            length,
            limit: max_v2,
        });
    }
    let len = V2_PREFIX + length;
    if buf.len() < len {
        return Ok(Parsed::Incomplete {
            need: len - buf.len(),
        });
    }
    let body = &buf[V2_PREFIX..len];
    let address = match (command, family) {
        (0, _) => Address::Local,
        (_, 0x11) => Address::Proxied(v2_ipv4(body)?),
        (_, 0x21) => Address::Proxied(v2_ipv6(body)?),
        _ => Address::Unknown,
    };
    Ok(Parsed::Done(Header {
        version: Version::V2,
        address,
        len,
    }))
}

fn v2_ipv4(body: &[u8]) -> Result<SocketAddr, ProxyError> {
    let short = ProxyError::V2Short { length: body.len() };
    // src (4), dst (4), src port (2), dst port (2), then TLVs.
    let b = body.get(..12).ok_or(short)?;
    let ip = Ipv4Addr::new(b[0], b[1], b[2], b[3]);
    Ok(SocketAddr::new(ip.into(), u16::from_be_bytes([b[8], b[9]])))
}

fn v2_ipv6(body: &[u8]) -> Result<SocketAddr, ProxyError> {
    let short = ProxyError::V2Short { length: body.len() };
    // src (16), dst (16), src port (2), dst port (2), then TLVs.
    let b = body.get(..36).ok_or(short)?;
    let mut octets = [0u8; 16];
    octets.copy_from_slice(&b[..16]);
    let port = u16::from_be_bytes([b[32], b[33]]);
    Ok(SocketAddr::new(Ipv6Addr::from(octets).into(), port))
}

/// A v1 line for `source` (to `dest`), as a balancer writes it: for
/// tests and the fuzz target.
pub fn encode_v1(source: SocketAddr, dest: SocketAddr) -> Vec<u8> {
    let family = if source.is_ipv4() { "TCP4" } else { "TCP6" };
    format!(
        "PROXY {family} {} {} {} {}\r\n",
        source.ip(),
        dest.ip(),
        source.port(),
        dest.port()
    )
    .into_bytes()
}

/// A v2 PROXY header for `source` (to `dest`, of the same family),
/// followed by `tlvs` (raw bytes, skipped by the parser).
pub fn encode_v2(source: SocketAddr, dest: SocketAddr, tlvs: &[u8]) -> Vec<u8> {
    let mut out = V2_SIGNATURE.to_vec();
    let mut body = Vec::new();
    let family = match (source.ip(), dest.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            body.extend(s.octets());
            body.extend(d.octets());
            0x11
        }
        (s, d) => {
            body.extend(to_v6(s).octets());
            body.extend(to_v6(d).octets());
            0x21
        }
    };
    body.extend(source.port().to_be_bytes());
    body.extend(dest.port().to_be_bytes());
    body.extend(tlvs);
    out.extend([0x21, family]);
    out.extend(u16::try_from(body.len()).unwrap_or(u16::MAX).to_be_bytes());
    out.extend(body);
    out
}

fn to_v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

#[cfg(test)]
mod tests;
