//! A source: the prefix of addresses judged as one, for admission's
//! fairness and for the trusted balancers' prefixes alike.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use thiserror::Error;

/// How many leading bits of a peer's address make its source, per family.
/// Only [`SourcePrefixes::new`] (and the default) makes one, so the
/// lengths are always in range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourcePrefixes {
    v4: u8,
    v6: u8,
}

pub const DEFAULT_SOURCE_PREFIX_V4: u8 = 32;
/// The smallest prefix an IPv6 host is usually given (RFC 6177, SLAAC):
/// every address in it may be the same machine.
pub const DEFAULT_SOURCE_PREFIX_V6: u8 = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum PrefixError {
    #[error("--source-prefix-v4 must be 0 to 32, not {0}")]
    V4(u8),
    #[error("--source-prefix-v6 must be 0 to 128, not {0}")]
    V6(u8),
}

impl SourcePrefixes {
    pub fn new(v4: u8, v6: u8) -> Result<Self, PrefixError> {
        if v4 > 32 {
            return Err(PrefixError::V4(v4));
        }
        if v6 > 128 {
            return Err(PrefixError::V6(v6));
        }
        Ok(SourcePrefixes { v4, v6 })
    }

    /// The source `ip` counts against.
    pub fn source_of(&self, ip: IpAddr) -> Source {
        source_key(ip, self.v4, self.v6)
    }
}

impl Default for SourcePrefixes {
    fn default() -> Self {
        SourcePrefixes {
            v4: DEFAULT_SOURCE_PREFIX_V4,
            v6: DEFAULT_SOURCE_PREFIX_V6,
        }
    }
}

/// A source: a network address with its host bits cleared, and the
/// prefix length that cleared them. Shown as `2001:db8:1:2::/64`, so a
/// log line names the whole prefix that was busy, not one of its hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Source {
    network: IpAddr,
    len: u8,
}

impl Source {
    /// The network address, host bits cleared.
    pub fn network(&self) -> IpAddr {
        self.network
    }

    /// The prefix length.
    pub fn prefix_len(&self) -> u8 {
        self.len
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.len)
    }
}

/// The source `ip` counts against: its first `v4_prefix` (IPv4) or
/// `v6_prefix` (IPv6) bits. An IPv4-mapped IPv6 address is its IPv4
/// address first, so a client on a dual-stack socket is judged by the
/// IPv4 prefix like every other IPv4 client (as a /64 of `::ffff:0:0/96`
/// the whole IPv4 internet would be one source). Lengths beyond the
/// family's width are taken as the full width, so the function is total;
/// `SourcePrefixes` never passes such a length.
pub fn source_key(ip: IpAddr, v4_prefix: u8, v6_prefix: u8) -> Source {
    match ip.to_canonical() {
        IpAddr::V4(v4) => {
            let len = v4_prefix.min(32);
            // `checked_shl` is `None` for a shift by the full width, which
            // is the /0 case: no bit of the address is kept.
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            Source {
                network: IpAddr::V4(Ipv4Addr::from(u32::from(v4) & mask)),
                len,
            }
        }
        IpAddr::V6(v6) => {
            let len = v6_prefix.min(128);
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            Source {
                network: IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask)),
                len,
            }
        }
    }
}
