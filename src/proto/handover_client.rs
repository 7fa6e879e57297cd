//! The offer of a client-mode session (`nbdgw client`, state version
//! `CLIENT_SESSIONS_VERSION`), without I/O: what a client-mode successor
//! judges against its own configuration (the remote server it would
//! dial, the name and the CA it would verify it with) and what its relay
//! needs (framing, size, flags). Its own format byte, which the server
//! mode's `Offer::decode` refuses: even a session of the wrong mode that
//! somehow reached a successor would be declined, never misread. The
//! State is `handover_session::State` (format 1): `tls` is the remote
//! connection's client-side TLS state, and `ahead` the plaintext read
//! from the local client and not yet relayed (a request header in part).

use super::handover::WireError;
use super::handover_session::{
    mode_code, put_str, put_u16, put_u32, Reader, MAX_CERTS, MAX_CHAIN, MAX_NAME,
};
use crate::proto::transmission::ReplyMode;

/// Client mode's offer format (server mode's are 1 and 2). 4 since the
/// offer carries the key exchange group (review C2); 3, without it, is
/// refused, so that no successor judges a session whose group it cannot
/// see, and an older build refuses a 4 rather than misread it.
pub const FORMAT_CLIENT: u8 = 4;

/// A client-mode session as the successor judges it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOffer {
    /// The remote server's host and port, as the old process dialled.
    pub host: String,
    pub port: u16,
    /// The name the server's certificate was verified against.
    pub server_name: String,
    /// The remote server's certificate chain, leaf first.
    pub chain: Vec<Vec<u8>>,
    /// The protocol version (0x0303, 0x0304) and the suite's IANA number.
    pub tls_version: u16,
    pub suite: u16,
    /// The key exchange group's IANA number (0: not known), judged
    /// against the successor's `--tls-groups`.
    pub group: u16,
    /// The export the local client opened (for the log).
    pub export: Vec<u8>,
    /// The largest request payload the old process let the local client
    /// send (its `--max-payload`).
    pub max_payload: u32,
    pub mode: ReplyMode,
    pub size: u64,
    pub tflags: u16,
    /// `--reconnect`: how the export was opened, for the successor to
    /// open it again the same way after a later drop.
    pub reconnect: Option<Reopening>,
}

/// How a `--reconnect` session opened its export (the client's
/// `reconnect::Opened` as bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reopening {
    /// NBD_OPT_GO (true) or NBD_OPT_EXPORT_NAME (false), with its data.
    pub go: bool,
    pub data: Vec<u8>,
    pub structured: bool,
    pub extended: bool,
    /// The last NBD_OPT_SET_META_CONTEXT acknowledged, and the contexts
    /// the server chose (each an id and a name).
    pub meta: Option<(Vec<u8>, Vec<Vec<u8>>)>,
}

/// An option's data, or one metadata context, carried for `--reconnect`.
const MAX_OPTION: u32 = 1 << 20;
/// Metadata contexts carried.
const MAX_CONTEXTS: u16 = 4096;

impl Reopening {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&[
            u8::from(self.go),
            u8::from(self.structured),
            u8::from(self.extended),
        ]);
        put_u32(out, self.data.len() as u32);
        out.extend_from_slice(&self.data);
        let Some((request, chosen)) = &self.meta else {
            return out.push(0);
        };
        out.push(1);
        put_u32(out, request.len() as u32);
        out.extend_from_slice(request);
        put_u16(out, chosen.len() as u16);
        for context in chosen {
            put_u32(out, context.len() as u32);
            out.extend_from_slice(context);
        }
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let (go, structured, extended) = (
            r.flag("reopen kind")?,
            r.flag("structured")?,
            r.flag("extended")?,
        );
        let data = r.long(MAX_OPTION, "reopen data")?.to_vec();
        let meta = match r.flag("metadata contexts")? {
            false => None,
            true => {
                let request = r.long(MAX_OPTION, "metadata request")?.to_vec();
                let count = r.u16()?;
                if count > MAX_CONTEXTS {
                    return Err(WireError::Invalid("metadata contexts", count.into()));
                }
                let chosen = (0..count)
                    .map(|_| r.long(MAX_OPTION, "metadata context").map(<[u8]>::to_vec))
                    .collect::<Result<_, _>>()?;
                Some((request, chosen))
            }
        };
        Ok(Reopening {
            go,
            data,
            structured,
            extended,
            meta,
        })
    }
}

impl ClientOffer {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![FORMAT_CLIENT];
        put_str(&mut out, self.host.as_bytes());
        put_u16(&mut out, self.port);
        put_str(&mut out, self.server_name.as_bytes());
        put_u16(&mut out, self.chain.len() as u16);
        for cert in &self.chain {
            put_u32(&mut out, cert.len() as u32);
            out.extend_from_slice(cert);
        }
        put_u16(&mut out, self.tls_version);
        put_u16(&mut out, self.suite);
        put_u16(&mut out, self.group);
        put_str(&mut out, &self.export);
        put_u32(&mut out, self.max_payload);
        out.push(mode_code(self.mode));
        out.extend_from_slice(&self.size.to_be_bytes());
        put_u16(&mut out, self.tflags);
        match &self.reconnect {
            None => out.push(0),
            Some(reopening) => {
                out.push(1);
                reopening.encode(&mut out);
            }
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader(bytes);
        match r.u8()? {
            FORMAT_CLIENT => {}
            other => {
                return Err(WireError::Invalid(
                    "client-mode session format",
                    other.into(),
                ))
            }
        }
        let host = r.text(MAX_NAME, "server host")?;
        let port = r.u16()?;
        let server_name = r.text(MAX_NAME, "server name")?;
        let count = r.u16()?;
        if count > MAX_CERTS {
            return Err(WireError::Invalid("certificates in a chain", count.into()));
        }
        let (mut chain, mut total) = (Vec::new(), 0usize);
        for _ in 0..count {
            let len = r.u32()? as usize;
            total += len;
            if total > MAX_CHAIN {
                return Err(WireError::Invalid("certificate chain length", total as u64));
            }
            chain.push(r.take(len)?.to_vec());
        }
        let offer = ClientOffer {
            host,
            port,
            server_name,
            chain,
            tls_version: r.u16()?,
            suite: r.u16()?,
            group: r.u16()?,
            export: r.str(MAX_NAME, "export name")?.to_vec(),
            max_payload: r.u32()?,
            mode: match r.u8()? {
                0 => ReplyMode::Simple,
                1 => ReplyMode::Structured,
                2 => ReplyMode::Extended,
                other => return Err(WireError::Invalid("reply mode", other.into())),
            },
            size: r.u64()?,
            tflags: r.u16()?,
            reconnect: match r.flag("reconnect")? {
                false => None,
                true => Some(Reopening::decode(&mut r)?),
            },
        };
        r.end()?;
        Ok(offer)
    }
}

/// Client mode's State `ahead`: the local plaintext read and not
/// relayed (a request header in part), then the remote's ciphertext read
/// ahead of its TLS layer, the first's length before them.
pub fn pack_ahead(local: &[u8], remote: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + local.len() + remote.len());
    put_u32(&mut out, local.len() as u32);
    out.extend_from_slice(local);
    out.extend_from_slice(remote);
    out
}

/// `pack_ahead`'s two parts; a local part longer than a request header
/// (the quiesce stops at a request boundary or inside a header) is
/// refused.
pub fn unpack_ahead(ahead: &[u8]) -> Result<(Vec<u8>, Vec<u8>), WireError> {
    let mut r = Reader(ahead);
    let local = r.long(MAX_LOCAL_AHEAD, "local bytes read ahead")?.to_vec();
    Ok((local, r.0.to_vec()))
}

/// The most local bytes a quiet session has read ahead: what is left
/// of a request header (the extended one is the longest, 32 bytes).
pub const MAX_LOCAL_AHEAD: u32 = 32;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::handover_session::Offer;

    fn offer() -> ClientOffer {
        ClientOffer {
            host: "nbd.example".into(),
            port: 10809,
            server_name: "nbd.example".into(),
            chain: vec![vec![1, 2, 3], vec![4; 300]],
            tls_version: 0x0304,
            suite: 0x1301,
            group: 0x11ec,
            export: b"disk".to_vec(),
            max_payload: 32 << 20,
            mode: ReplyMode::Extended,
            size: 1 << 30,
            tflags: 0x1ed,
            reconnect: Some(Reopening {
                go: true,
                data: b"\0\0\0\x04disk\0\0".to_vec(),
                structured: true,
                extended: false,
                meta: Some((
                    b"meta".to_vec(),
                    vec![b"\0\0\0\x01base:allocation".to_vec()],
                )),
            }),
        }
    }

    #[test]
    fn round_trips_and_every_cut_is_refused() {
        let bytes = offer().encode();
        assert_eq!(ClientOffer::decode(&bytes).unwrap(), offer());
        for cut in 0..bytes.len() {
            assert!(ClientOffer::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(ClientOffer::decode(&longer).is_err());
        let plain = ClientOffer {
            reconnect: None,
            ..offer()
        };
        assert_eq!(ClientOffer::decode(&plain.encode()).unwrap(), plain);
        // Format 3 (no group) is refused, never read as this one.
        let mut older = plain.encode();
        older[0] = 3;
        let err = ClientOffer::decode(&older).unwrap_err();
        assert!(
            err.to_string().contains("client-mode session format"),
            "{err}"
        );
    }

    #[test]
    fn the_bytes_ahead_of_both_sides_round_trip() {
        let packed = pack_ahead(b"\x25\x60\x95", b"record");
        let (local, remote) = unpack_ahead(&packed).unwrap();
        assert_eq!(
            (&local[..], &remote[..]),
            (&b"\x25\x60\x95"[..], &b"record"[..])
        );
        assert!(unpack_ahead(&pack_ahead(&[0; 33], b"")).is_err());
        assert!(unpack_ahead(&[0, 0]).is_err());
    }

    /// Each mode refuses the other's offers: a session never reaches a
    /// successor of the other mode as something it would misread.
    #[test]
    fn the_server_mode_refuses_a_client_offer_and_back() {
        let err = Offer::decode(&offer().encode()).unwrap_err();
        assert!(err.to_string().contains("format"), "{err}");
        let server = Offer {
            chain: vec![],
            sni: None,
            export: "disk".into(),
            upstream_export: "disk".into(),
            upstream: b"/run/disk.sock".to_vec(),
            tls_version: 0x0304,
            suite: 0x1301,
            kernel_tls: false,
            group: 0,
            max_payload: 1 << 20,
            mode: ReplyMode::Structured,
            read_only: false,
            read_write: true,
            size: 1 << 20,
            tflags: 0,
        };
        let err = ClientOffer::decode(&server.encode()).unwrap_err();
        assert!(
            err.to_string().contains("client-mode session format"),
            "{err}"
        );
    }
}
