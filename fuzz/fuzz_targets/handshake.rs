//! Every handshake parser on arbitrary bytes: none may panic, and what
//! parses must encode back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nbdgw::proto::handshake::*;

fuzz_target!(|data: &[u8]| {
    if let Some(b) = data.get(..16).and_then(|b| <&[u8; 16]>::try_from(b).ok()) {
        if let Ok(h) = OptionHeader::parse(b) {
            assert_eq!(&h.encode(), b);
        }
    }
    if let Some(b) = data.get(..20).and_then(|b| <&[u8; 20]>::try_from(b).ok()) {
        if let Ok(h) = OptionReplyHeader::parse(b) {
            assert_eq!(&h.encode(), b);
        }
    }
    if let Some(b) = data.get(..18).and_then(|b| <&[u8; 18]>::try_from(b).ok()) {
        let _ = parse_upstream_greeting(b);
    }
    if let Some(b) = data.get(..4) {
        let _ = parse_client_flags(u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
    }
    let _ = parse_info_export(data);
    let _ = export_name_prefix(data);
    // An accepted export name is the bytes unchanged, with no NUL or
    // other control character.
    if let Ok(name) = nbdgw::proto::name::export_name(data) {
        assert_eq!(name.as_bytes(), data);
        assert!(!name.chars().any(char::is_control));
    }
    // A block-size body nbdgw lowers keeps the spec's rules.
    if let Some((limit, body)) = data.split_first_chunk::<4>() {
        let mut body = body.to_vec();
        if clamp_block_size(&mut body, u32::from_be_bytes(*limit)) {
            let field = |at: usize| u32::from_be_bytes(body[at..at + 4].try_into().unwrap());
            let (minimum, preferred, maximum) = (field(2), field(6), field(10));
            assert!(maximum <= u32::from_be_bytes(*limit));
            assert_eq!(maximum % minimum, 0);
            assert!(preferred <= maximum);
        }
    }
});
