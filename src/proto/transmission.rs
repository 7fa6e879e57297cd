//! Transmission-phase framing: request headers from the client, reply
//! headers from the upstream, and the few replies nbdgw writes itself.

use std::collections::HashMap;

use super::consts::*;
use super::{be_u16, be_u32, be_u64, ProtoError};

/// Which reply format the upstream agreed to during negotiation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyMode {
    /// Neither structured replies nor extended headers: 16-byte simple
    /// replies, and only the request tells whether data follows.
    Simple,
    /// `NBD_OPT_STRUCTURED_REPLY` acknowledged: 20-byte chunks (and
    /// data-less simple replies).
    Structured,
    /// `NBD_OPT_EXTENDED_HEADERS` acknowledged: 32-byte requests and
    /// 32-byte reply chunks.
    Extended,
}

impl ReplyMode {
    pub fn request_header_len(self) -> usize {
        match self {
            ReplyMode::Extended => EXTENDED_REQUEST_LEN,
            _ => COMPACT_REQUEST_LEN,
        }
    }
}

/// A parsed request header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u64,
}

impl Request {
    /// Parses a request header of `mode.request_header_len()` bytes.
    pub fn parse(mode: ReplyMode, buf: &[u8]) -> Result<Self, ProtoError> {
        if buf.len() != mode.request_header_len() {
            return Err(ProtoError::Malformed("request header has the wrong size"));
        }
        let magic = be_u32(buf, 0);
        let expected = match mode {
            ReplyMode::Extended => EXTENDED_REQUEST_MAGIC,
            _ => REQUEST_MAGIC,
        };
        if magic != expected {
            return Err(ProtoError::BadMagic {
                what: "request",
                found: magic.into(),
            });
        }
        let length = match mode {
            ReplyMode::Extended => be_u64(buf, 24),
            _ => be_u32(buf, 24).into(),
        };
        Ok(Request {
            flags: be_u16(buf, 4),
            command: be_u16(buf, 6),
            cookie: be_u64(buf, 8),
            offset: be_u64(buf, 16),
            length,
        })
    }

    pub fn encode(&self, mode: ReplyMode, out: &mut Vec<u8>) {
        match mode {
            ReplyMode::Extended => out.extend_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes()),
            _ => out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes()),
        }
        out.extend_from_slice(&self.flags.to_be_bytes());
        out.extend_from_slice(&self.command.to_be_bytes());
        out.extend_from_slice(&self.cookie.to_be_bytes());
        out.extend_from_slice(&self.offset.to_be_bytes());
        match mode {
            ReplyMode::Extended => out.extend_from_slice(&self.length.to_be_bytes()),
            // Compact headers were parsed from a u32, so this cannot truncate.
            _ => out.extend_from_slice(&(self.length as u32).to_be_bytes()),
        }
    }

    /// Bytes of payload that follow the header. A write always carries its
    /// length as payload (qemu-nbd reads it so even when an extended-header
    /// client forgets `PAYLOAD_LEN`, and nbdgw must stay in step with it);
    /// with extended headers any command may carry one via `PAYLOAD_LEN`.
    pub fn payload_len(&self, mode: ReplyMode) -> u64 {
        if self.command == CMD_WRITE
            || (mode == ReplyMode::Extended && self.flags & CMD_FLAG_PAYLOAD_LEN != 0)
        {
            self.length
        } else {
            0
        }
    }

    /// Whether a read-only session must refuse it: anything not known to
    /// leave the export as it is (WRITE, TRIM, WRITE_ZEROES, RESIZE, and
    /// commands nbdgw does not know), so an extension cannot slip past.
    pub fn is_modifying(&self) -> bool {
        !matches!(
            self.command,
            CMD_READ | CMD_DISC | CMD_FLUSH | CMD_CACHE | CMD_BLOCK_STATUS
        )
    }
}

/// What nbdgw remembers of a request until its last reply has passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlight {
    pub command: u16,
    pub offset: u64,
    pub length: u64,
}

impl From<&Request> for InFlight {
    fn from(r: &Request) -> Self {
        InFlight {
            command: r.command,
            offset: r.offset,
            length: r.length,
        }
    }
}

/// Requests sent upstream and not yet fully answered, by cookie.
#[derive(Debug, Default)]
pub struct InFlightTable {
    by_cookie: HashMap<u64, InFlight>,
}

impl InFlightTable {
    /// Records a request; false if its cookie is already in flight.
    pub fn insert(&mut self, cookie: u64, req: InFlight) -> bool {
        match self.by_cookie.entry(cookie) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(req);
                true
            }
        }
    }

    pub fn contains(&self, cookie: u64) -> bool {
        self.by_cookie.contains_key(&cookie)
    }

    pub fn get(&self, cookie: u64) -> Option<InFlight> {
        self.by_cookie.get(&cookie).copied()
    }

    pub fn remove(&mut self, cookie: u64) -> Option<InFlight> {
        self.by_cookie.remove(&cookie)
    }

    pub fn len(&self) -> usize {
        self.by_cookie.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_cookie.is_empty()
    }
}

/// How many header bytes a reply whose first four bytes are `magic` has
/// in `mode`, or why such a reply is not allowed there.
pub fn reply_header_len(mode: ReplyMode, magic: u32) -> Result<usize, ProtoError> {
    match (mode, magic) {
        (ReplyMode::Simple | ReplyMode::Structured, SIMPLE_REPLY_MAGIC) => Ok(SIMPLE_REPLY_LEN),
        (ReplyMode::Structured, STRUCTURED_REPLY_MAGIC) => Ok(STRUCTURED_REPLY_LEN),
        (ReplyMode::Extended, EXTENDED_REPLY_MAGIC) => Ok(EXTENDED_REPLY_LEN),
        (_, SIMPLE_REPLY_MAGIC) => Err(ProtoError::UnexpectedReply {
            what: "simple",
            mode,
        }),
        (_, STRUCTURED_REPLY_MAGIC) => Err(ProtoError::UnexpectedReply {
            what: "structured",
            mode,
        }),
        (_, EXTENDED_REPLY_MAGIC) => Err(ProtoError::UnexpectedReply {
            what: "extended",
            mode,
        }),
        _ => Err(ProtoError::BadMagic {
            what: "reply",
            found: magic.into(),
        }),
    }
}

/// One reply message (a simple reply or one chunk), framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyFrame {
    pub cookie: u64,
    /// Bytes that follow the header.
    pub payload_len: u64,
    /// The request's last reply: its cookie may be reused after this.
    pub done: bool,
    /// The error a simple reply carries (chunks carry theirs in the payload).
    pub simple_error: u32,
    /// The chunk type (0 for a simple reply).
    pub kind: u16,
}

impl ReplyFrame {
    /// An error chunk, whose payload nbdgw reads whole to check it.
    pub fn is_error_chunk(&self) -> bool {
        self.kind & REPLY_TYPE_ERROR_BIT != 0
    }
}

/// Frames a reply header (`reply_header_len` bytes). A simple reply does
/// not say whether data follows; the in-flight request does.
pub fn parse_reply(
    mode: ReplyMode,
    header: &[u8],
    in_flight: &InFlightTable,
    max_payload: u64,
) -> Result<ReplyFrame, ProtoError> {
    if header.len() < 4 {
        return Err(ProtoError::Malformed("reply header is too short"));
    }
    let magic = be_u32(header, 0);
    let expected_len = reply_header_len(mode, magic)?;
    if header.len() != expected_len {
        return Err(ProtoError::Malformed("reply header has the wrong size"));
    }
    let frame = match magic {
        SIMPLE_REPLY_MAGIC => {
            let error = be_u32(header, 4);
            let cookie = be_u64(header, 8);
            let req = in_flight
                .get(cookie)
                .ok_or(ProtoError::UnknownCookie(cookie))?;
            // Only a successful read in simple mode carries data.
            let payload_len = if mode == ReplyMode::Simple && req.command == CMD_READ && error == 0
            {
                req.length
            } else {
                0
            };
            ReplyFrame {
                cookie,
                payload_len,
                done: true,
                simple_error: error,
                kind: 0,
            }
        }
        STRUCTURED_REPLY_MAGIC => ReplyFrame {
            cookie: be_u64(header, 8),
            payload_len: be_u32(header, 16).into(),
            done: be_u16(header, 4) & REPLY_FLAG_DONE != 0,
            simple_error: 0,
            kind: be_u16(header, 6),
        },
        _ => ReplyFrame {
            cookie: be_u64(header, 8),
            payload_len: be_u64(header, 24),
            done: be_u16(header, 4) & REPLY_FLAG_DONE != 0,
            simple_error: 0,
            kind: be_u16(header, 6),
        },
    };
    let req = in_flight
        .get(frame.cookie)
        .ok_or(ProtoError::UnknownCookie(frame.cookie))?;
    if magic != SIMPLE_REPLY_MAGIC {
        check_chunk(&frame, &req)?;
    }
    ProtoError::check_limit("reply payload", frame.payload_len, max_payload)?;
    Ok(frame)
}

/// Whether a chunk's type and length fit the request it answers, as the
/// spec lays them out: a client must never get data it did not ask for,
/// nor a chunk it cannot frame.
fn check_chunk(frame: &ReplyFrame, req: &InFlight) -> Result<(), ProtoError> {
    const OFFSET: u64 = 8;
    let length = frame.payload_len;
    let fits = match frame.kind {
        REPLY_TYPE_NONE => length == 0 && frame.done,
        REPLY_TYPE_OFFSET_DATA => {
            req.command == CMD_READ && length > OFFSET && length <= OFFSET + req.length
        }
        REPLY_TYPE_OFFSET_HOLE => req.command == CMD_READ && length == OFFSET + 4,
        REPLY_TYPE_BLOCK_STATUS => {
            req.command == CMD_BLOCK_STATUS && length >= 12 && (length - 4) % 8 == 0
        }
        REPLY_TYPE_BLOCK_STATUS_EXT => {
            req.command == CMD_BLOCK_STATUS && length >= 24 && (length - 8) % 16 == 0
        }
        kind if kind & REPLY_TYPE_ERROR_BIT != 0 => {
            let extra = if kind == REPLY_TYPE_ERROR_OFFSET {
                OFFSET
            } else {
                0
            };
            (6 + extra..=6 + extra + MAX_ERROR_MESSAGE as u64).contains(&length)
        }
        _ => false,
    };
    if fits {
        return Ok(());
    }
    Err(ProtoError::BadChunk {
        kind: frame.kind,
        length,
        command: command_name(req.command),
    })
}

/// An error chunk's payload (error, message length, message, and for
/// ERROR_OFFSET an offset): the message must fit inside it.
pub fn check_error_payload(kind: u16, payload: &[u8]) -> Result<(), ProtoError> {
    let extra = if kind == REPLY_TYPE_ERROR_OFFSET {
        8
    } else {
        0
    };
    let message = match payload.get(4..6) {
        Some(len) => usize::from(be_u16(len, 0)),
        None => 0,
    };
    if payload.len() >= 6 && message <= MAX_ERROR_MESSAGE && 6 + message + extra == payload.len() {
        return Ok(());
    }
    Err(ProtoError::BadErrorChunk {
        message,
        length: payload.len(),
    })
}

/// Appends an error reply for `req` that nbdgw itself answers, in the
/// negotiated reply format, completing the request.
pub fn encode_error_reply(
    mode: ReplyMode,
    cookie: u64,
    req: &InFlight,
    error: u32,
    message: &str,
    out: &mut Vec<u8>,
) {
    // Messages are strings: at most 4096 bytes, well inside the u16 length.
    let message = &message.as_bytes()[..message.len().min(4096)];
    let payload_len = 4 + 2 + message.len();
    match mode {
        ReplyMode::Simple => {
            out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
            out.extend_from_slice(&error.to_be_bytes());
            out.extend_from_slice(&cookie.to_be_bytes());
            return;
        }
        ReplyMode::Structured => {
            out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
            out.extend_from_slice(&REPLY_FLAG_DONE.to_be_bytes());
            out.extend_from_slice(&REPLY_TYPE_ERROR.to_be_bytes());
            out.extend_from_slice(&cookie.to_be_bytes());
            out.extend_from_slice(&(payload_len as u32).to_be_bytes());
        }
        ReplyMode::Extended => {
            out.extend_from_slice(&EXTENDED_REPLY_MAGIC.to_be_bytes());
            out.extend_from_slice(&REPLY_FLAG_DONE.to_be_bytes());
            out.extend_from_slice(&REPLY_TYPE_ERROR.to_be_bytes());
            out.extend_from_slice(&cookie.to_be_bytes());
            out.extend_from_slice(&req.offset.to_be_bytes());
            out.extend_from_slice(&(payload_len as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&(message.len() as u16).to_be_bytes());
    out.extend_from_slice(message);
}

/// Appends the header of a successful read reply nbdgw answers itself
/// (from the read cache), in the negotiated format: a simple reply, or
/// one `OFFSET_DATA` chunk that completes the request (the offset field
/// included). `length` bytes of data follow it.
pub fn encode_read_reply_header(
    mode: ReplyMode,
    cookie: u64,
    offset: u64,
    length: u64,
    out: &mut Vec<u8>,
) {
    let chunk_len = 8 + length;
    match mode {
        ReplyMode::Simple => {
            out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
            out.extend_from_slice(&0u32.to_be_bytes());
            out.extend_from_slice(&cookie.to_be_bytes());
            return;
        }
        ReplyMode::Structured => {
            out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
            out.extend_from_slice(&REPLY_FLAG_DONE.to_be_bytes());
            out.extend_from_slice(&REPLY_TYPE_OFFSET_DATA.to_be_bytes());
            out.extend_from_slice(&cookie.to_be_bytes());
            // Callers answer reads of at most a few MiB this way.
            out.extend_from_slice(&(chunk_len as u32).to_be_bytes());
        }
        ReplyMode::Extended => {
            out.extend_from_slice(&EXTENDED_REPLY_MAGIC.to_be_bytes());
            out.extend_from_slice(&REPLY_FLAG_DONE.to_be_bytes());
            out.extend_from_slice(&REPLY_TYPE_OFFSET_DATA.to_be_bytes());
            out.extend_from_slice(&cookie.to_be_bytes());
            out.extend_from_slice(&offset.to_be_bytes());
            out.extend_from_slice(&chunk_len.to_be_bytes());
        }
    }
    out.extend_from_slice(&offset.to_be_bytes());
}

/// The name of an NBD error value, for labels: the spec's errors by
/// name, every other value (which an upstream may send at will) as
/// `other`, so the upstream cannot choose how many there are.
pub fn error_name(error: u32) -> &'static str {
    match error {
        EPERM => "EPERM",
        EIO => "EIO",
        ENOMEM => "ENOMEM",
        EINVAL => "EINVAL",
        ENOSPC => "ENOSPC",
        EOVERFLOW => "EOVERFLOW",
        ENOTSUP => "ENOTSUP",
        ESHUTDOWN => "ESHUTDOWN",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_names_are_the_specs_or_other() {
        let named = [
            EPERM, EIO, ENOMEM, EINVAL, ENOSPC, EOVERFLOW, ENOTSUP, ESHUTDOWN,
        ];
        let names: Vec<_> = named.iter().map(|&e| error_name(e)).collect();
        assert_eq!(
            names,
            [
                "EPERM",
                "EIO",
                "ENOMEM",
                "EINVAL",
                "ENOSPC",
                "EOVERFLOW",
                "ENOTSUP",
                "ESHUTDOWN"
            ]
        );
        for unknown in [0, 2, 1000, u32::MAX] {
            assert_eq!(error_name(unknown), "other");
        }
    }

    #[test]
    fn only_commands_known_to_leave_the_export_alone_pass_a_read_only_session() {
        let request = |command| Request {
            command,
            ..Request::default()
        };
        for command in [CMD_READ, CMD_DISC, CMD_FLUSH, CMD_CACHE, CMD_BLOCK_STATUS] {
            assert!(!request(command).is_modifying(), "{command}");
        }
        for command in [CMD_WRITE, CMD_TRIM, CMD_WRITE_ZEROES, CMD_RESIZE, 9, 0xffff] {
            assert!(request(command).is_modifying(), "{command}");
        }
    }
    use proptest::prelude::*;

    fn table(cookie: u64, command: u16, length: u64) -> InFlightTable {
        let mut t = InFlightTable::default();
        assert!(t.insert(
            cookie,
            InFlight {
                command,
                offset: 512,
                length
            }
        ));
        t
    }

    fn simple_reply(error: u32, cookie: u64) -> Vec<u8> {
        let mut v = SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
        v.extend_from_slice(&error.to_be_bytes());
        v.extend_from_slice(&cookie.to_be_bytes());
        v
    }

    #[test]
    fn compact_write_carries_payload() {
        let req = Request {
            flags: CMD_FLAG_FUA,
            command: CMD_WRITE,
            cookie: 7,
            offset: 4096,
            length: 512,
        };
        let mut b = Vec::new();
        req.encode(ReplyMode::Structured, &mut b);
        assert_eq!(b.len(), 28);
        let parsed = Request::parse(ReplyMode::Structured, &b).unwrap();
        assert_eq!(parsed, req);
        assert_eq!(parsed.payload_len(ReplyMode::Structured), 512);
    }

    #[test]
    fn extended_payload_only_with_flag_or_write() {
        let mut req = Request {
            flags: 0,
            command: CMD_BLOCK_STATUS,
            cookie: 1,
            offset: 0,
            length: 1 << 40,
        };
        assert_eq!(req.payload_len(ReplyMode::Extended), 0);
        req.flags = CMD_FLAG_PAYLOAD_LEN;
        req.length = 16;
        assert_eq!(req.payload_len(ReplyMode::Extended), 16);
        // PAYLOAD_LEN means nothing without extended headers.
        assert_eq!(req.payload_len(ReplyMode::Structured), 0);
        req.command = CMD_READ;
        req.flags = 0;
        assert_eq!(req.payload_len(ReplyMode::Extended), 0);
    }

    #[test]
    fn request_magic_must_match_mode() {
        let req = Request {
            flags: 0,
            command: CMD_READ,
            cookie: 1,
            offset: 0,
            length: 4096,
        };
        let mut compact = Vec::new();
        req.encode(ReplyMode::Simple, &mut compact);
        let mut ext = Vec::new();
        req.encode(ReplyMode::Extended, &mut ext);
        assert_eq!(ext.len(), 32);
        assert_eq!(Request::parse(ReplyMode::Extended, &ext), Ok(req));
        let mut wrong = ext.clone();
        wrong[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        assert!(matches!(
            Request::parse(ReplyMode::Extended, &wrong),
            Err(ProtoError::BadMagic { .. })
        ));
        compact[0] ^= 0xff;
        assert!(Request::parse(ReplyMode::Simple, &compact).is_err());
    }

    #[test]
    fn simple_read_reply_length_comes_from_the_request() {
        let t = table(9, CMD_READ, 4096);
        let f = parse_reply(ReplyMode::Simple, &simple_reply(0, 9), &t, 1 << 25).unwrap();
        assert_eq!(f.payload_len, 4096);
        assert!(f.done);
        // A failed read carries no data.
        let f = parse_reply(ReplyMode::Simple, &simple_reply(5, 9), &t, 1 << 25).unwrap();
        assert_eq!(f.payload_len, 0);
        assert_eq!(f.simple_error, 5);
        // In structured mode a simple reply never carries data.
        let f = parse_reply(ReplyMode::Structured, &simple_reply(0, 9), &t, 1 << 25).unwrap();
        assert_eq!(f.payload_len, 0);
        let t = table(9, CMD_WRITE, 4096);
        let f = parse_reply(ReplyMode::Simple, &simple_reply(0, 9), &t, 1 << 25).unwrap();
        assert_eq!(f.payload_len, 0);
    }

    #[test]
    fn reply_for_unknown_cookie_is_an_error() {
        let t = table(9, CMD_READ, 4096);
        assert_eq!(
            parse_reply(ReplyMode::Simple, &simple_reply(0, 10), &t, 1 << 25),
            Err(ProtoError::UnknownCookie(10))
        );
    }

    #[test]
    fn reply_magic_must_fit_the_mode() {
        assert_eq!(
            reply_header_len(ReplyMode::Structured, STRUCTURED_REPLY_MAGIC),
            Ok(20)
        );
        assert_eq!(
            reply_header_len(ReplyMode::Extended, EXTENDED_REPLY_MAGIC),
            Ok(32)
        );
        assert!(reply_header_len(ReplyMode::Extended, SIMPLE_REPLY_MAGIC).is_err());
        assert!(reply_header_len(ReplyMode::Simple, STRUCTURED_REPLY_MAGIC).is_err());
        assert!(reply_header_len(ReplyMode::Structured, 0x1256_0953).is_err());
    }

    #[test]
    fn error_replies_frame_in_every_mode() {
        let req = InFlight {
            command: CMD_WRITE,
            offset: 1 << 20,
            length: 4096,
        };
        for mode in [
            ReplyMode::Simple,
            ReplyMode::Structured,
            ReplyMode::Extended,
        ] {
            let mut t = InFlightTable::default();
            t.insert(42, req);
            let mut out = Vec::new();
            encode_error_reply(mode, 42, &req, EPERM, "read-only export", &mut out);
            let magic = u32::from_be_bytes(out[..4].try_into().unwrap());
            let hlen = reply_header_len(mode, magic).unwrap();
            let f = parse_reply(mode, &out[..hlen], &t, 1 << 20).unwrap();
            assert_eq!(f.cookie, 42);
            assert!(f.done);
            assert_eq!(f.payload_len as usize, out.len() - hlen);
            if mode == ReplyMode::Simple {
                assert_eq!(f.simple_error, EPERM);
            } else {
                assert_eq!(&out[hlen..hlen + 4], &EPERM.to_be_bytes());
                assert_eq!(&out[hlen + 6..], b"read-only export");
            }
            if mode == ReplyMode::Extended {
                assert_eq!(&out[16..24], &(1u64 << 20).to_be_bytes());
            }
        }
    }

    #[test]
    fn read_replies_frame_in_every_mode() {
        let req = InFlight {
            command: CMD_READ,
            offset: 1 << 20,
            length: 4096,
        };
        for mode in [
            ReplyMode::Simple,
            ReplyMode::Structured,
            ReplyMode::Extended,
        ] {
            let mut t = InFlightTable::default();
            t.insert(42, req);
            let mut out = Vec::new();
            encode_read_reply_header(mode, 42, req.offset, req.length, &mut out);
            let magic = u32::from_be_bytes(out[..4].try_into().unwrap());
            let hlen = reply_header_len(mode, magic).unwrap();
            let f = parse_reply(mode, &out[..hlen], &t, 1 << 20).unwrap();
            assert_eq!(f.cookie, 42);
            assert!(f.done);
            assert_eq!(f.simple_error, 0);
            if mode == ReplyMode::Simple {
                assert_eq!(out.len(), hlen);
                assert_eq!(f.payload_len, 4096);
            } else {
                assert_eq!(f.kind, REPLY_TYPE_OFFSET_DATA);
                assert_eq!(f.payload_len, 8 + 4096);
                assert_eq!(&out[hlen..], &(1u64 << 20).to_be_bytes());
            }
        }
    }

    #[test]
    fn oversize_reply_payload_rejected() {
        let t = table(1, CMD_READ, 1 << 26);
        let mut h = STRUCTURED_REPLY_MAGIC.to_be_bytes().to_vec();
        h.extend_from_slice(&REPLY_FLAG_DONE.to_be_bytes());
        h.extend_from_slice(&REPLY_TYPE_OFFSET_DATA.to_be_bytes());
        h.extend_from_slice(&1u64.to_be_bytes());
        h.extend_from_slice(&(64u32 << 20).to_be_bytes());
        assert!(matches!(
            parse_reply(ReplyMode::Structured, &h, &t, 32 << 20),
            Err(ProtoError::TooLong { .. })
        ));
    }

    #[test]
    fn in_flight_table_rejects_duplicates() {
        let mut t = table(3, CMD_READ, 1);
        assert!(!t.insert(
            3,
            InFlight {
                command: CMD_WRITE,
                offset: 0,
                length: 0
            }
        ));
        assert_eq!(t.len(), 1);
        assert_eq!(t.remove(3).map(|r| r.command), Some(CMD_READ));
        assert!(t.is_empty());
    }

    fn any_mode() -> impl Strategy<Value = ReplyMode> {
        prop_oneof![
            Just(ReplyMode::Simple),
            Just(ReplyMode::Structured),
            Just(ReplyMode::Extended)
        ]
    }

    proptest! {
        #[test]
        fn request_roundtrip(mode in any_mode(), flags: u16, command: u16, cookie: u64, offset: u64, length: u64) {
            let length = if mode == ReplyMode::Extended { length } else { length & 0xffff_ffff };
            let req = Request { flags, command, cookie, offset, length };
            let mut b = Vec::new();
            req.encode(mode, &mut b);
            prop_assert_eq!(b.len(), mode.request_header_len());
            prop_assert_eq!(Request::parse(mode, &b), Ok(req));
        }

        #[test]
        fn parse_reply_never_panics(mode in any_mode(), bytes in proptest::collection::vec(any::<u8>(), 0..40), cookie: u64) {
            let mut t = InFlightTable::default();
            t.insert(cookie, InFlight { command: CMD_READ, offset: 0, length: 4096 });
            if let Ok(f) = parse_reply(mode, &bytes, &t, 1 << 25) {
                prop_assert!(f.payload_len <= 1 << 25);
                prop_assert_eq!(f.cookie, cookie);
            }
        }

        #[test]
        fn structured_chunk_framing(cookie: u64, flags: u16, kind: u16, len in 0u32..(1 << 25)) {
            let mut t = InFlightTable::default();
            t.insert(cookie, InFlight { command: CMD_READ, offset: 0, length: 1 << 25 });
            let mut h = STRUCTURED_REPLY_MAGIC.to_be_bytes().to_vec();
            h.extend_from_slice(&flags.to_be_bytes());
            h.extend_from_slice(&kind.to_be_bytes());
            h.extend_from_slice(&cookie.to_be_bytes());
            h.extend_from_slice(&len.to_be_bytes());
            match parse_reply(ReplyMode::Structured, &h, &t, 1 << 25) {
                Ok(f) => {
                    prop_assert_eq!(f.payload_len, u64::from(len));
                    prop_assert_eq!(f.done, flags & 1 == 1);
                    prop_assert_eq!(f.kind, kind);
                }
                Err(e) => prop_assert!(matches!(e, ProtoError::BadChunk { .. }), "{e}"),
            }
            // Data within the request always frames.
            h[6..8].copy_from_slice(&REPLY_TYPE_OFFSET_DATA.to_be_bytes());
            h[16..20].copy_from_slice(&(len.max(1) + 8).to_be_bytes());
            let f = parse_reply(ReplyMode::Structured, &h, &t, 1 << 26).unwrap();
            prop_assert_eq!(f.payload_len, u64::from(len.max(1) + 8));
        }
    }

    fn chunk(kind: u16, flags: u16, cookie: u64, len: u32) -> Vec<u8> {
        let mut h = STRUCTURED_REPLY_MAGIC.to_be_bytes().to_vec();
        h.extend_from_slice(&flags.to_be_bytes());
        h.extend_from_slice(&kind.to_be_bytes());
        h.extend_from_slice(&cookie.to_be_bytes());
        h.extend_from_slice(&len.to_be_bytes());
        h
    }

    #[test]
    fn chunks_that_do_not_fit_their_request_are_refused() {
        let mut t = InFlightTable::default();
        t.insert(
            1,
            InFlight {
                command: CMD_READ,
                offset: 0,
                length: 4096,
            },
        );
        t.insert(
            2,
            InFlight {
                command: CMD_FLUSH,
                offset: 0,
                length: 0,
            },
        );
        let frame = |h: &[u8]| parse_reply(ReplyMode::Structured, h, &t, 1 << 25);
        let refused = [
            chunk(REPLY_TYPE_OFFSET_DATA, 1, 1, 8 + 4097),
            chunk(REPLY_TYPE_OFFSET_DATA, 1, 1, 8),
            chunk(REPLY_TYPE_OFFSET_DATA, 1, 2, 8 + 512),
            chunk(REPLY_TYPE_OFFSET_HOLE, 1, 1, 16),
            chunk(REPLY_TYPE_NONE, 0, 1, 0),
            chunk(REPLY_TYPE_NONE, 1, 1, 4),
            chunk(REPLY_TYPE_BLOCK_STATUS, 1, 1, 12),
            chunk(REPLY_TYPE_ERROR, 1, 1, 5),
            chunk(REPLY_TYPE_ERROR, 1, 1, 6 + 4097),
            chunk(77, 1, 1, 0),
        ];
        for h in &refused {
            assert!(
                matches!(frame(h), Err(ProtoError::BadChunk { .. })),
                "{:?}",
                frame(h)
            );
        }
        for h in [
            chunk(REPLY_TYPE_OFFSET_DATA, 0, 1, 8 + 4096),
            chunk(REPLY_TYPE_OFFSET_HOLE, 1, 1, 12),
            chunk(REPLY_TYPE_NONE, 1, 2, 0),
            chunk(REPLY_TYPE_ERROR, 1, 2, 6 + 10),
            chunk(REPLY_TYPE_ERROR_OFFSET, 1, 1, 6 + 10 + 8),
        ] {
            assert!(frame(&h).is_ok(), "{:?}", frame(&h));
        }
    }

    #[test]
    fn an_error_message_must_fit_its_chunk() {
        let payload = |message_len: u16, actual: usize| {
            let mut p = 5u32.to_be_bytes().to_vec();
            p.extend_from_slice(&message_len.to_be_bytes());
            p.extend(std::iter::repeat_n(b'x', actual));
            p
        };
        assert!(check_error_payload(REPLY_TYPE_ERROR, &payload(3, 3)).is_ok());
        assert!(check_error_payload(REPLY_TYPE_ERROR, &payload(300, 3)).is_err());
        assert!(check_error_payload(REPLY_TYPE_ERROR, &payload(3, 5)).is_err());
        let mut with_offset = payload(3, 3);
        with_offset.extend_from_slice(&0u64.to_be_bytes());
        assert!(check_error_payload(REPLY_TYPE_ERROR_OFFSET, &with_offset).is_ok());
        assert!(check_error_payload(REPLY_TYPE_ERROR, &with_offset).is_err());
    }
}
