//! The PROXY protocol header parser on arbitrary bytes, read as the
//! gateway reads: exactly as many bytes as it asks for. It may not panic,
//! may not ask past its bounds (107 bytes for v1, 16 plus the limit for
//! v2), and what it accepts must be no longer than what was read.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nbdgw::proto::proxy::{parse, Parsed, V1_MAX, V2_PREFIX};

const MAX: usize = 1024;

fuzz_target!(|data: &[u8]| {
    let mut read = 0;
    loop {
        match parse(&data[..read], MAX) {
            Ok(Parsed::Incomplete { need }) => {
                assert!(need >= 1);
                read += need;
                assert!(read <= (V2_PREFIX + MAX).max(V1_MAX));
                if read > data.len() {
                    return;
                }
            }
            Ok(Parsed::Done(header)) => {
                // Never a byte past the header: it ends where the read did.
                assert_eq!(header.len, read);
                return;
            }
            Err(_) => return,
        }
    }
});
