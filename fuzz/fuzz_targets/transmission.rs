//! Request and reply framing on arbitrary bytes in every reply mode: no
//! panic, payload lengths within the cap, requests round-trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nbdgw::proto::transmission::*;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let mode = match selector % 3 {
        0 => ReplyMode::Simple,
        1 => ReplyMode::Structured,
        _ => ReplyMode::Extended,
    };
    let len = mode.request_header_len();
    if let Some(header) = rest.get(..len) {
        if let Ok(req) = Request::parse(mode, header) {
            let mut out = Vec::new();
            req.encode(mode, &mut out);
            assert_eq!(out, header);
            let _ = req.payload_len(mode);
        }
    }
    let mut table = InFlightTable::default();
    for cookie in [0u64, 1, u64::MAX] {
        table.insert(
            cookie,
            InFlight {
                command: u16::from(selector & 7),
                offset: 0,
                length: 4096,
            },
        );
    }
    for end in [16usize, 20, 32] {
        if let Some(header) = rest.get(..end) {
            if let Ok(frame) = parse_reply(mode, header, &table, 1 << 25) {
                assert!(frame.payload_len <= 1 << 25);
                assert!(table.contains(frame.cookie));
            }
        }
    }
});
