//! A hand-over's TLS state and the records of the session rebuilt from
//! it. The first byte chooses:
//! - even: the rest is a state's encoding from another process. Decoding
//!   may refuse but never panic; what it accepts encodes back to the same
//!   bytes and gives a record layer (a kernel TLS state, `KernelState`:
//!   the same, but for the layer, which is the kernel's).
//! - odd: the rest is a run of (type, length, plaintext) records that a
//!   peer holding the same keys seals, of any type and content, and a
//!   layer rebuilt from a fixed state (TLS 1.3 or 1.2 by the byte's
//!   second bit) opens them until it refuses one. Never a panic, and
//!   application data stays within its record.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nbdgw::tls::handover::record::{Opened, RecordLayer};
use nbdgw::tls::handover::KernelState;
use nbdgw::tls::handover::state::{DirectionState, KeyBytes, Side, TlsState};
use nbdgw::tls::key_update::{Secret, Suite};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        if let Ok(state) = TlsState::decode(rest) {
            assert_eq!(&*state.encode(), rest);
            RecordLayer::new(&state, None).expect("a decoded state gives a layer");
        }
        // A kernel TLS session's state: the same promise.
        if let Ok(state) = KernelState::decode(rest) {
            assert_eq!(&*state.encode(), rest);
        }
        return;
    }
    let tls13 = mode & 2 != 0;
    let (ours, theirs) = (state(tls13, Side::Server), state(tls13, Side::Client));
    let mut layer = RecordLayer::new(&ours, None).unwrap();
    let mut peer = RecordLayer::new(&theirs, None).unwrap();
    let mut records = rest;
    while let [kind, len, tail @ ..] = records {
        let len = usize::from(*len).min(tail.len());
        let mut wire = Vec::new();
        if peer.seal_any_for_test(*kind, &tail[..len], &mut wire).is_err() {
            return;
        }
        records = &tail[len..];
        let Ok(Some(whole)) = RecordLayer::whole_record(&wire) else {
            return;
        };
        assert_eq!(whole, wire.len());
        match layer.open(&mut wire) {
            Ok(Opened::Data(range)) => assert!(range.end <= wire.len()),
            Ok(Opened::Control) => {}
            Ok(Opened::Closed) | Err(_) => return,
        }
    }
});

/// A fixed session: one end's state, or the other's (directions swapped).
fn state(tls13: bool, side: Side) -> TlsState {
    let direction = |seed: u8| {
        if tls13 {
            let secret = Secret::new(&[seed; 32]);
            let keys = Suite::Aes128GcmSha256.keys(&secret);
            DirectionState {
                key: KeyBytes(keys.key().to_vec()),
                iv: *keys.iv(),
                seq: 7,
                secret: Some(secret),
            }
        } else {
            DirectionState {
                key: KeyBytes(vec![seed; 16]),
                iv: [seed; 12],
                seq: 7,
                secret: None,
            }
        }
    };
    let (tx, rx) = match side {
        Side::Server => (direction(1), direction(2)),
        Side::Client => (direction(2), direction(1)),
    };
    TlsState {
        side,
        suite: if tls13 { 0x1301 } else { 0xc02b },
        tx,
        rx,
        plaintext: Vec::new(),
        read_closed: false,
        partial: Vec::new(),
    }
}
