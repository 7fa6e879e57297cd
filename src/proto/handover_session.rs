//! The bodies of the per-session hand-over messages (state version 2,
//! docs/design/handover.md "Sessions"), without I/O: an `Offer` says
//! what the successor needs to judge a session against its own
//! configuration; a `State` is what it needs to serve it on. Both are
//! parsed strictly (a byte short or left over is refused; every length is
//! checked before use), with the fuzz target
//! `fuzz/fuzz_targets/handover_session.rs`.

use zeroize::Zeroizing;

use super::handover::WireError;
use crate::proto::transmission::ReplyMode;

/// The format of both bodies; another is refused (the session drains).
pub const FORMAT: u8 = 1;
/// The format of an offer of a kernel TLS session: format 1's fields,
/// the session in the kernel's record layer. A build that knows only
/// format 1 (rustls sessions) refuses it at the offer, so the session
/// drains in the old gateway rather than reaching a successor that
/// would have to close it at its state (the commit point is passed by
/// then). Its State body is format 1 with a `KernelState` as `tls`.
pub const FORMAT_KERNEL_TLS: u8 = 2;
/// The longest client certificate chain carried (DER, all certificates).
pub const MAX_CHAIN: usize = 64 * 1024;
/// Certificates in a chain.
pub const MAX_CERTS: u16 = 16;
/// Names: export, upstream export, SNI (NBD allows 4 KiB export names).
pub const MAX_NAME: u16 = 4096;
/// An upstream socket path (sockaddr_un).
pub const MAX_PATH: u16 = 108;
/// The TLS state's encoding and the ciphertext read ahead of rustls.
pub const MAX_TLS: u32 = 512 * 1024;

/// What the successor judges: who the client is, what it opened, how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    /// The client certificate chain, leaf first (empty: anonymous).
    pub chain: Vec<Vec<u8>>,
    /// The server name the client asked for (SNI), if any.
    pub sni: Option<String>,
    /// The export name the policy judged.
    pub export: String,
    /// The name the upstream was asked for.
    pub upstream_export: String,
    /// The upstream's Unix socket path.
    pub upstream: Vec<u8>,
    /// The protocol version (0x0303, 0x0304) and the suite's IANA number.
    pub tls_version: u16,
    pub suite: u16,
    /// In the kernel's record layer (kernel TLS), not rustls.
    pub kernel_tls: bool,
    /// The key exchange group's IANA number (0: not known).
    pub group: u16,
    /// The largest request payload the old gateway accepts from this
    /// client (its `--max-payload`, what NBD_INFO_BLOCK_SIZE told it at
    /// most): a successor accepting less would cut a request the client
    /// was allowed to send.
    pub max_payload: u32,
    pub mode: ReplyMode,
    pub read_only: bool,
    /// The access granted: true read-write, false read-only.
    pub read_write: bool,
    pub size: u64,
    pub tflags: u16,
}

/// What the successor serves the session from, with its two sockets.
/// Secrets inside: wiped when dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    /// The hand-over this state belongs to (`Message::Sessions`).
    pub handover: [u8; 16],
    /// `TlsState::encode` (keys, sequence numbers, unread plaintext).
    pub tls: Zeroizing<Vec<u8>>,
    /// Ciphertext read from the socket and not given to the TLS layer:
    /// whole records and a partial one, before anything the socket holds.
    pub ahead: Vec<u8>,
    /// The audit counters so far: requests, replies, bytes in, bytes out.
    pub counts: [u64; 4],
}

pub(crate) fn mode_code(mode: ReplyMode) -> u8 {
    match mode {
        ReplyMode::Simple => 0,
        ReplyMode::Structured => 1,
        ReplyMode::Extended => 2,
    }
}

impl Offer {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![match self.kernel_tls {
            false => FORMAT,
            true => FORMAT_KERNEL_TLS,
        }];
        put_u16(&mut out, self.chain.len() as u16);
        for cert in &self.chain {
            put_u32(&mut out, cert.len() as u32);
            out.extend_from_slice(cert);
        }
        put_str(&mut out, self.sni.as_deref().unwrap_or("").as_bytes());
        put_str(&mut out, self.export.as_bytes());
        put_str(&mut out, self.upstream_export.as_bytes());
        put_str(&mut out, &self.upstream);
        put_u16(&mut out, self.tls_version);
        put_u16(&mut out, self.suite);
        put_u16(&mut out, self.group);
        put_u32(&mut out, self.max_payload);
        out.push(mode_code(self.mode));
        out.push(u8::from(self.read_only));
        out.push(u8::from(self.read_write));
        out.extend_from_slice(&self.size.to_be_bytes());
        put_u16(&mut out, self.tflags);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader(bytes);
        let kernel_tls = match r.u8()? {
            FORMAT => false,
            FORMAT_KERNEL_TLS => true,
            other => return Err(WireError::Invalid("session body format", other.into())),
        };
        let count = r.u16()?;
        if count > MAX_CERTS {
            return Err(WireError::Invalid("certificates in a chain", count.into()));
        }
        let mut chain = Vec::new();
        let mut total = 0usize;
        for _ in 0..count {
            let len = r.u32()? as usize;
            total += len;
            if total > MAX_CHAIN {
                return Err(WireError::Invalid("certificate chain length", total as u64));
            }
            chain.push(r.take(len)?.to_vec());
        }
        let sni = r.text(MAX_NAME, "server name")?;
        let offer = Offer {
            chain,
            sni: (!sni.is_empty()).then_some(sni),
            export: r.text(MAX_NAME, "export name")?,
            upstream_export: r.text(MAX_NAME, "upstream export name")?,
            upstream: r.str(MAX_PATH, "upstream path")?.to_vec(),
            tls_version: r.u16()?,
            suite: r.u16()?,
            kernel_tls,
            group: r.u16()?,
            max_payload: r.u32()?,
            mode: match r.u8()? {
                0 => ReplyMode::Simple,
                1 => ReplyMode::Structured,
                2 => ReplyMode::Extended,
                other => return Err(WireError::Invalid("reply mode", other.into())),
            },
            read_only: r.flag("read-only flag")?,
            read_write: r.flag("access")?,
            size: r.u64()?,
            tflags: r.u16()?,
        };
        r.end()?;
        Ok(offer)
    }
}

impl State {
    /// The encoding, in a buffer sized exactly first and wiped when
    /// dropped, so that no copy of the keys is left in freed memory.
    pub fn encode(&self) -> Zeroizing<Vec<u8>> {
        let len = 1 + 16 + 4 + self.tls.len() + 4 + self.ahead.len() + 32;
        let mut out = Zeroizing::new(Vec::with_capacity(len));
        out.push(FORMAT);
        out.extend_from_slice(&self.handover);
        put_u32(&mut out, self.tls.len() as u32);
        out.extend_from_slice(&self.tls);
        put_u32(&mut out, self.ahead.len() as u32);
        out.extend_from_slice(&self.ahead);
        for count in self.counts {
            out.extend_from_slice(&count.to_be_bytes());
        }
        debug_assert_eq!(out.len(), len);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader(bytes);
        r.format()?;
        let handover = r.take(16)?.try_into().expect("16 bytes");
        let tls = Zeroizing::new(r.long(MAX_TLS, "TLS state length")?.to_vec());
        let ahead = r.long(MAX_TLS, "ciphertext read ahead")?.to_vec();
        let mut counts = [0u64; 4];
        for count in &mut counts {
            *count = r.u64()?;
        }
        r.end()?;
        Ok(State {
            handover,
            tls,
            ahead,
            counts,
        })
    }
}

pub(crate) fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_be_bytes());
}

pub(crate) fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_be_bytes());
}

pub(crate) fn put_str(out: &mut Vec<u8>, bytes: &[u8]) {
    put_u16(out, bytes.len() as u16);
    out.extend_from_slice(bytes);
}

pub(crate) struct Reader<'a>(pub(crate) &'a [u8]);

impl<'a> Reader<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Short);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    pub(crate) fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_be_bytes(self.take(2)?.try_into().expect("2")))
    }

    pub(crate) fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().expect("4")))
    }

    pub(crate) fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().expect("8")))
    }

    pub(crate) fn format(&mut self) -> Result<(), WireError> {
        match self.u8()? {
            FORMAT => Ok(()),
            other => Err(WireError::Invalid("session body format", other.into())),
        }
    }

    pub(crate) fn flag(&mut self, what: &'static str) -> Result<bool, WireError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(WireError::Invalid(what, other.into())),
        }
    }

    pub(crate) fn str(&mut self, max: u16, what: &'static str) -> Result<&'a [u8], WireError> {
        let len = self.u16()?;
        if len > max {
            return Err(WireError::Invalid(what, len.into()));
        }
        self.take(len.into())
    }

    pub(crate) fn text(&mut self, max: u16, what: &'static str) -> Result<String, WireError> {
        let bytes = self.str(max, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| WireError::Invalid(what, 0))
    }

    pub(crate) fn long(&mut self, max: u32, what: &'static str) -> Result<&'a [u8], WireError> {
        let len = self.u32()?;
        if len > max {
            return Err(WireError::Invalid(what, len.into()));
        }
        self.take(len as usize)
    }

    pub(crate) fn end(&self) -> Result<(), WireError> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(WireError::Trailing(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer() -> Offer {
        Offer {
            chain: vec![vec![1, 2, 3], vec![4; 300]],
            sni: Some("gw.example".into()),
            export: "disk".into(),
            upstream_export: "disk".into(),
            upstream: b"/run/qemu.sock".to_vec(),
            tls_version: 0x0304,
            suite: 0x1301,
            kernel_tls: false,
            group: 0x11ec,
            max_payload: 32 << 20,
            mode: ReplyMode::Extended,
            read_only: false,
            read_write: true,
            size: 1 << 30,
            tflags: 0x1ed,
        }
    }

    #[test]
    fn an_offer_and_a_state_round_trip_and_every_cut_is_refused() {
        let o = offer();
        let bytes = o.encode();
        assert_eq!(Offer::decode(&bytes).unwrap(), o);
        for cut in 0..bytes.len() {
            assert!(Offer::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(Offer::decode(&longer), Err(WireError::Trailing(1)));
        let s = State {
            handover: [7; 16],
            tls: Zeroizing::new(vec![9; 200]),
            ahead: vec![23; 40],
            counts: [1, 2, 3, 4],
        };
        let bytes = s.encode();
        assert_eq!(bytes.capacity(), bytes.len(), "sized exactly: no realloc");
        assert_eq!(State::decode(&bytes).unwrap(), s);
        for cut in 0..bytes.len() {
            assert!(State::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn another_format_is_refused() {
        let mut bytes = offer().encode();
        bytes[0] = 3;
        assert!(Offer::decode(&bytes).is_err());
    }

    /// A kernel TLS session's offer is format 2: format 1's fields, so
    /// a build that knows only format 1 refuses it as another format.
    #[test]
    fn a_kernel_tls_offer_is_format_2_and_round_trips() {
        let o = Offer {
            kernel_tls: true,
            ..offer()
        };
        let bytes = o.encode();
        assert_eq!(bytes[0], FORMAT_KERNEL_TLS);
        assert_eq!(Offer::decode(&bytes).unwrap(), o);
        assert_eq!(&bytes[1..], &offer().encode()[1..]);
    }
}
