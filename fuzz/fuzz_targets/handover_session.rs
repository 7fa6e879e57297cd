//! The per-session hand-over bodies (state version 2, and client mode's
//! offer): an offer, a state or a client-mode offer decoded from
//! arbitrary bytes (the first byte chooses). Decoding
//! may refuse but never panic, and what it accepts encodes back to the
//! same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nbdgw::proto::handover_client::{unpack_ahead, ClientOffer};
use nbdgw::proto::handover_session::{Offer, State};

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 3 {
        0 => {
            if let Ok(offer) = Offer::decode(rest) {
                assert_eq!(offer.encode(), rest);
            }
        }
        1 => {
            if let Ok(state) = State::decode(rest) {
                assert_eq!(&state.encode()[..], rest);
            }
        }
        _ => {
            if let Ok(offer) = ClientOffer::decode(rest) {
                assert_eq!(offer.encode(), rest);
            }
            let _ = unpack_ahead(rest);
        }
    }
});
