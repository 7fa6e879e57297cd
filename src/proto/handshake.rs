//! Fixed-newstyle handshake messages: greetings, client flags, options and
//! option replies.

use super::consts::*;
use super::{be_u16, be_u32, be_u64, ProtoError};

/// What the client chose in its flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientFlags {
    pub no_zeroes: bool,
}

/// The 18-byte greeting nbdgw sends: fixed newstyle, no zeroes.
pub fn server_greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    g[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    g[16..18].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    g
}

/// Checks the client's flags against what nbdgw offered. The spec makes
/// the server drop a client that sends a flag it does not know, and TLS
/// needs fixed newstyle.
pub fn parse_client_flags(raw: u32) -> Result<ClientFlags, ProtoError> {
    let known = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;
    if raw & !known != 0 {
        return Err(ProtoError::UnknownClientFlags(raw));
    }
    if raw & FLAG_C_FIXED_NEWSTYLE == 0 {
        return Err(ProtoError::NotFixedNewstyle(raw));
    }
    Ok(ClientFlags {
        no_zeroes: raw & FLAG_C_NO_ZEROES != 0,
    })
}

/// Reads an upstream server's greeting and returns its handshake flags.
pub fn parse_upstream_greeting(buf: &[u8; GREETING_LEN]) -> Result<u16, ProtoError> {
    let magic = be_u64(buf, 0);
    if magic != NBDMAGIC {
        return Err(ProtoError::BadMagic {
            what: "server greeting",
            found: magic,
        });
    }
    let opts = be_u64(buf, 8);
    if opts != IHAVEOPT {
        // Oldstyle servers send cliserv_magic here; nbdgw only speaks newstyle.
        return Err(ProtoError::BadMagic {
            what: "server newstyle",
            found: opts,
        });
    }
    let flags = be_u16(buf, 16);
    if flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(ProtoError::ServerNotFixedNewstyle(flags));
    }
    Ok(flags)
}

/// The client flags nbdgw sends upstream: fixed newstyle, and no zeroes
/// whenever the upstream offers it (nbdgw pads for the client itself).
pub fn upstream_client_flags(upstream_handshake_flags: u16) -> u32 {
    let mut flags = FLAG_C_FIXED_NEWSTYLE;
    if upstream_handshake_flags & FLAG_NO_ZEROES != 0 {
        flags |= FLAG_C_NO_ZEROES;
    }
    flags
}

/// A client option header: `IHAVEOPT`, option, data length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub length: u32,
}

impl OptionHeader {
    pub fn parse(buf: &[u8; OPTION_HEADER_LEN]) -> Result<Self, ProtoError> {
        let magic = be_u64(buf, 0);
        if magic != IHAVEOPT {
            return Err(ProtoError::BadMagic {
                what: "option",
                found: magic,
            });
        }
        Ok(OptionHeader {
            option: be_u32(buf, 8),
            length: be_u32(buf, 12),
        })
    }

    pub fn encode(&self) -> [u8; OPTION_HEADER_LEN] {
        let mut b = [0u8; OPTION_HEADER_LEN];
        b[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        b[8..12].copy_from_slice(&self.option.to_be_bytes());
        b[12..16].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// An option reply header: reply magic, option, reply type, data length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    pub option: u32,
    pub reply_type: u32,
    pub length: u32,
}

impl OptionReplyHeader {
    pub fn parse(buf: &[u8; OPTION_REPLY_HEADER_LEN]) -> Result<Self, ProtoError> {
        let magic = be_u64(buf, 0);
        if magic != REPLY_MAGIC {
            return Err(ProtoError::BadMagic {
                what: "option reply",
                found: magic,
            });
        }
        Ok(OptionReplyHeader {
            option: be_u32(buf, 8),
            reply_type: be_u32(buf, 12),
            length: be_u32(buf, 16),
        })
    }

    /// ACK and every error end an option's replies; SERVER, INFO and
    /// META_CONTEXT replies are followed by more.
    pub fn is_final(&self) -> bool {
        self.reply_type == REP_ACK || self.is_error()
    }

    pub fn is_error(&self) -> bool {
        self.reply_type & REP_FLAG_ERROR != 0
    }

    pub fn encode(&self) -> [u8; OPTION_REPLY_HEADER_LEN] {
        let mut b = [0u8; OPTION_REPLY_HEADER_LEN];
        b[0..8].copy_from_slice(&REPLY_MAGIC.to_be_bytes());
        b[8..12].copy_from_slice(&self.option.to_be_bytes());
        b[12..16].copy_from_slice(&self.reply_type.to_be_bytes());
        b[16..20].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// A whole option reply with its data (an error's message, say).
pub fn encode_option_reply(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
    let length = u32::try_from(data.len()).unwrap_or(u32::MAX);
    let header = OptionReplyHeader {
        option,
        reply_type,
        length,
    };
    let mut out = Vec::with_capacity(OPTION_REPLY_HEADER_LEN + data.len());
    out.extend_from_slice(&header.encode());
    out.extend_from_slice(&data[..length as usize]);
    out
}

/// The export size and transmission flags of an `NBD_REP_INFO` reply of
/// type `NBD_INFO_EXPORT`; `None` for every other info type.
pub fn parse_info_export(data: &[u8]) -> Option<(u64, u16)> {
    if data.len() != 12 || be_u16(data, 0) != INFO_EXPORT {
        return None;
    }
    Some((be_u64(data, 2), be_u16(data, 10)))
}

/// Lowers the maximum block size of an `NBD_INFO_BLOCK_SIZE` body to
/// `limit`, in place, so that a compliant client never sends a request
/// nbdgw would refuse. The result keeps the spec's rules: the maximum a
/// multiple of the minimum, the preferred size a power of two no larger
/// than the maximum. Returns whether anything changed; other bodies, and
/// limits below the minimum block size, are left alone.
pub fn clamp_block_size(body: &mut [u8], limit: u32) -> bool {
    if body.len() != 14 || be_u16(body, 0) != INFO_BLOCK_SIZE {
        return false;
    }
    let (minimum, preferred, maximum) = (be_u32(body, 2), be_u32(body, 6), be_u32(body, 10));
    if maximum <= limit || minimum == 0 || limit < minimum {
        return false;
    }
    let maximum = limit - limit % minimum;
    let preferred = if preferred > maximum {
        // The largest power of two not above the new maximum.
        1 << (31 - maximum.leading_zeros())
    } else {
        preferred
    };
    body[6..10].copy_from_slice(&preferred.to_be_bytes());
    body[10..14].copy_from_slice(&maximum.to_be_bytes());
    true
}

/// The export name at the start of INFO, GO and META_CONTEXT option data
/// (a u32 length, then the name); for logs only.
pub fn export_name_prefix(data: &[u8]) -> Option<String> {
    if data.len() < 4 {
        return None;
    }
    let len = be_u32(data, 0) as usize;
    let name = data.get(4..4usize.checked_add(len)?)?;
    Some(String::from_utf8_lossy(name).into_owned())
}

/// The export name at the start of INFO, GO and META_CONTEXT option data,
/// as raw bytes, and what follows it.
pub fn split_export_name(data: &[u8]) -> Option<(&[u8], &[u8])> {
    let len = usize::try_from(be_u32(data.get(..4)?, 0)).ok()?;
    let end = 4usize.checked_add(len)?;
    Some((data.get(4..end)?, &data[end..]))
}

/// The same option data naming `name` instead: how a routed option is
/// sent to an upstream that knows the export by another name.
pub fn with_export_name(data: &[u8], name: &str) -> Option<Vec<u8>> {
    let (_, rest) = split_export_name(data)?;
    let len = u32::try_from(name.len()).ok()?;
    let mut out = Vec::with_capacity(4 + name.len() + rest.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(rest);
    Some(out)
}

/// Whether an `NBD_REP_INFO` body is `NBD_INFO_NAME`, the server's own
/// name for the export, which a routed client must see as its own name.
pub fn is_info_name(body: &[u8]) -> bool {
    body.len() >= 2 && be_u16(body, 0) == INFO_NAME
}

/// An `NBD_INFO_NAME` body naming `name`.
pub fn encode_info_name(name: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + name.len());
    out.extend_from_slice(&INFO_NAME.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

/// Marks transmission flags read-only (and valid).
pub fn read_only_flags(tflags: u16) -> u16 {
    tflags | TFLAG_HAS_FLAGS | TFLAG_READ_ONLY
}

/// Sets the read-only flag in an `NBD_INFO_EXPORT` body, in place, so a
/// client granted read-only access is told so whatever the upstream
/// offers. Returns whether the body was one.
pub fn force_read_only(body: &mut [u8]) -> bool {
    let Some((_, tflags)) = parse_info_export(body) else {
        return false;
    };
    body[10..12].copy_from_slice(&read_only_flags(tflags).to_be_bytes());
    true
}

/// The data of one `NBD_REP_SERVER` reply to LIST: the name, no
/// description.
pub fn encode_server_entry(name: &str) -> Vec<u8> {
    let len = u32::try_from(name.len()).unwrap_or(u32::MAX);
    let mut out = Vec::with_capacity(4 + name.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

/// Size and transmission flags of a reply to `NBD_OPT_EXPORT_NAME`.
pub fn parse_export_name_reply(buf: &[u8; 10]) -> (u64, u16) {
    (be_u64(buf, 0), be_u16(buf, 8))
}

/// The reply to `NBD_OPT_EXPORT_NAME` as the client expects it: padded
/// with 124 zeroes unless the client chose `NO_ZEROES`.
pub fn encode_export_name_reply(size: u64, tflags: u16, client: ClientFlags) -> Vec<u8> {
    let mut out = Vec::with_capacity(10 + EXPORT_NAME_PADDING);
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&tflags.to_be_bytes());
    if !client.no_zeroes {
        out.resize(10 + EXPORT_NAME_PADDING, 0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_export_name_is_replaced_and_the_rest_kept() {
        let mut data = 3u32.to_be_bytes().to_vec();
        data.extend_from_slice(b"vm1");
        data.extend_from_slice(&[0, 1, 0, 3]);
        assert_eq!(
            split_export_name(&data),
            Some((&b"vm1"[..], &[0, 1, 0, 3][..]))
        );
        let renamed = with_export_name(&data, "").unwrap();
        assert_eq!(renamed, [0, 0, 0, 0, 0, 1, 0, 3]);
        let renamed = with_export_name(&renamed, "disk0").unwrap();
        assert_eq!(
            split_export_name(&renamed),
            Some((&b"disk0"[..], &[0, 1, 0, 3][..]))
        );
        for short in [&[0u8, 0, 0][..], &[0, 0, 0, 9, b'a'][..]] {
            assert_eq!(split_export_name(short), None);
            assert_eq!(with_export_name(short, "x"), None);
        }
    }

    #[test]
    fn info_name_is_recognised_and_made() {
        let body = encode_info_name("vm-1");
        assert!(is_info_name(&body));
        assert_eq!(body, [0, 1, b'v', b'm', b'-', b'1']);
        assert!(!is_info_name(&[0, 0, 0]));
        assert!(!is_info_name(&[0]));
    }

    #[test]
    fn read_only_is_forced_in_info_export_only() {
        let mut body = [0u8; 12];
        body[1] = INFO_EXPORT as u8;
        body[11] = 0b1101; // HAS_FLAGS, FLUSH, FUA
        assert!(force_read_only(&mut body));
        assert_eq!(parse_info_export(&body), Some((0, 0b1111)));
        let mut block_size = [0u8; 14];
        block_size[1] = INFO_BLOCK_SIZE as u8;
        assert!(!force_read_only(&mut block_size));
        assert_eq!(block_size, {
            let mut b = [0u8; 14];
            b[1] = INFO_BLOCK_SIZE as u8;
            b
        });
    }

    #[test]
    fn greeting_is_fixed_newstyle_with_no_zeroes() {
        let g = server_greeting();
        assert_eq!(&g[0..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(&g[16..18], &[0, 3]);
        assert_eq!(parse_upstream_greeting(&g), Ok(3));
    }

    #[test]
    fn client_flags_rules() {
        assert_eq!(parse_client_flags(1), Ok(ClientFlags { no_zeroes: false }));
        assert_eq!(parse_client_flags(3), Ok(ClientFlags { no_zeroes: true }));
        assert_eq!(parse_client_flags(0), Err(ProtoError::NotFixedNewstyle(0)));
        assert_eq!(parse_client_flags(2), Err(ProtoError::NotFixedNewstyle(2)));
        assert_eq!(
            parse_client_flags(5),
            Err(ProtoError::UnknownClientFlags(5))
        );
    }

    #[test]
    fn upstream_greeting_rejects_oldstyle() {
        let mut g = server_greeting();
        g[8..16].copy_from_slice(&0x0000_4202_8186_1253_u64.to_be_bytes());
        assert!(matches!(
            parse_upstream_greeting(&g),
            Err(ProtoError::BadMagic { .. })
        ));
        let mut g = server_greeting();
        g[17] = 2;
        assert_eq!(
            parse_upstream_greeting(&g),
            Err(ProtoError::ServerNotFixedNewstyle(2))
        );
    }

    #[test]
    fn option_reply_finality() {
        let r = |t| OptionReplyHeader {
            option: OPT_GO,
            reply_type: t,
            length: 0,
        };
        assert!(r(REP_ACK).is_final());
        assert!(r(REP_ERR_UNSUP).is_final());
        assert!(!r(REP_INFO).is_final());
        assert!(!r(REP_SERVER).is_final());
        assert!(!r(REP_META_CONTEXT).is_final());
    }

    #[test]
    fn export_name_reply_padding_follows_client_choice() {
        let padded = encode_export_name_reply(1 << 20, 0x1ed, ClientFlags { no_zeroes: false });
        assert_eq!(padded.len(), 134);
        assert!(padded[10..].iter().all(|&b| b == 0));
        let short = encode_export_name_reply(1 << 20, 0x1ed, ClientFlags { no_zeroes: true });
        assert_eq!(short.len(), 10);
        let mut ten = [0u8; 10];
        ten.copy_from_slice(&short);
        assert_eq!(parse_export_name_reply(&ten), (1 << 20, 0x1ed));
    }

    #[test]
    fn info_export_parse() {
        let mut d = vec![0, 0];
        d.extend_from_slice(&4096u64.to_be_bytes());
        d.extend_from_slice(&3u16.to_be_bytes());
        assert_eq!(parse_info_export(&d), Some((4096, 3)));
        d[1] = 3;
        assert_eq!(parse_info_export(&d), None);
        assert_eq!(parse_info_export(&d[..5]), None);
    }

    #[test]
    fn export_name_prefix_handles_short_data() {
        let mut d = 3u32.to_be_bytes().to_vec();
        d.extend_from_slice(b"abc\0\0");
        assert_eq!(export_name_prefix(&d).as_deref(), Some("abc"));
        assert_eq!(export_name_prefix(&d[..5]), None);
        assert_eq!(export_name_prefix(&[0xff; 4]), None);
    }

    proptest! {
        #[test]
        fn option_header_roundtrip(option: u32, length: u32) {
            let h = OptionHeader { option, length };
            prop_assert_eq!(OptionHeader::parse(&h.encode()), Ok(h));
        }

        #[test]
        fn option_reply_roundtrip(option: u32, reply_type: u32, data in proptest::collection::vec(any::<u8>(), 0..64)) {
            let bytes = encode_option_reply(option, reply_type, &data);
            let mut hdr = [0u8; OPTION_REPLY_HEADER_LEN];
            hdr.copy_from_slice(&bytes[..OPTION_REPLY_HEADER_LEN]);
            let parsed = OptionReplyHeader::parse(&hdr).unwrap();
            prop_assert_eq!(parsed.option, option);
            prop_assert_eq!(parsed.reply_type, reply_type);
            prop_assert_eq!(parsed.length as usize, data.len());
            prop_assert_eq!(&bytes[OPTION_REPLY_HEADER_LEN..], &data[..]);
        }

        #[test]
        fn option_header_rejects_any_other_magic(buf: [u8; 16]) {
            let ok = OptionHeader::parse(&buf).is_ok();
            prop_assert_eq!(ok, &buf[..8] == b"IHAVEOPT");
        }

        #[test]
        fn client_flags_never_accept_unknown_bits(raw: u32) {
            if let Ok(f) = parse_client_flags(raw) {
                prop_assert!(raw & !3 == 0 && raw & 1 == 1);
                prop_assert_eq!(f.no_zeroes, raw & 2 != 0);
            }
        }
    }

    fn block_size(minimum: u32, preferred: u32, maximum: u32) -> Vec<u8> {
        let mut body = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        for v in [minimum, preferred, maximum] {
            body.extend_from_slice(&v.to_be_bytes());
        }
        body
    }

    #[test]
    fn block_size_maximum_is_clamped_to_the_limit() {
        // qemu-nbd advertises 1 / 4096 / 32 MiB.
        let mut body = block_size(1, 4096, 32 << 20);
        assert!(clamp_block_size(&mut body, 1 << 20));
        assert_eq!(body, block_size(1, 4096, 1 << 20));
        // Already below: untouched.
        assert!(!clamp_block_size(&mut body, 2 << 20));
        // The preferred size follows a maximum that falls below it.
        let mut body = block_size(512, 2 << 20, 32 << 20);
        assert!(clamp_block_size(&mut body, (1 << 20) + 100));
        assert_eq!(body, block_size(512, 1 << 20, 1 << 20));
        // Not a block-size body, or a limit below the minimum: left alone.
        let mut export = vec![0u8; 12];
        assert!(!clamp_block_size(&mut export, 1));
        let mut body = block_size(4096, 4096, 1 << 20);
        assert!(!clamp_block_size(&mut body, 1000));
    }

    proptest! {
        #[test]
        fn a_clamped_block_size_keeps_the_spec_rules(
            min_log in 0u32..17, pref_log in 0u32..26, max in 1u32.., limit in 1u32..,
        ) {
            let minimum = 1u32 << min_log;
            let preferred = 1u32 << pref_log.max(min_log);
            let maximum = max.max(preferred) / minimum * minimum;
            let mut body = block_size(minimum, preferred, maximum);
            clamp_block_size(&mut body, limit);
            let (mn, pr, mx) = (be_u32(&body, 2), be_u32(&body, 6), be_u32(&body, 10));
            prop_assert_eq!(mn, minimum);
            if limit >= minimum {
                prop_assert!(mx <= limit);
            }
            prop_assert!(mx <= maximum && mx % mn == 0);
            prop_assert!(pr.is_power_of_two() && pr >= mn && pr <= mx);
        }
    }
}
