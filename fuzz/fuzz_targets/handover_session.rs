//! The per-session hand-over bodies (state version 2): an offer or a
//! state decoded from arbitrary bytes (the first byte chooses). Decoding
//! may refuse but never panic, and what it accepts encodes back to the
//! same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nbdgw::proto::handover_session::{Offer, State};

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    if which % 2 == 0 {
        if let Ok(offer) = Offer::decode(rest) {
            assert_eq!(offer.encode(), rest);
        }
    } else if let Ok(state) = State::decode(rest) {
        assert_eq!(&state.encode()[..], rest);
    }
});
