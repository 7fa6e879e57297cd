//! The hand-over channel's frames on arbitrary bytes, with an arbitrary
//! count of descriptors said to have come with them (the first byte).
//! Decoding may not panic; what it accepts must encode back to exactly
//! the bytes it took, so that nothing is read past a frame or ignored
//! within it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nbdgw::proto::handover::{decode_frame, HEADER_LEN, MAX_BODY};

fuzz_target!(|data: &[u8]| {
    let Some((&fds, bytes)) = data.split_first() else {
        return;
    };
    if let Ok((message, used)) = decode_frame(bytes, usize::from(fds % 10)) {
        assert!(used <= HEADER_LEN + MAX_BODY as usize);
        assert_eq!(message.fds(), usize::from(fds % 10));
        assert_eq!(&message.encode()[..], &bytes[..used]);
    }
});
