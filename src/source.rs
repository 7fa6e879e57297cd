//! A source: the prefix of addresses judged as one, for admission's
//! fairness and for the trusted balancers' prefixes alike.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

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
