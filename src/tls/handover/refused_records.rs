//! What a rebuilt record layer refuses, and how: records a rustls peer
//! does not send (sealed here by a peer layer holding the same keys), the
//! limits, and the preconditions of taking a state out of rustls.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::record::{Opened, RecordError, RecordLayer, ALERT, APPLICATION_DATA, HANDSHAKE};
use super::state::{DirectionState, KeyBytes, Side, StateError, TlsState};
use super::ResumedTls;
use crate::tls::key_update::{Secret, Suite};

fn direction(tls13: bool, seed: u8, seq: u64) -> DirectionState {
    if tls13 {
        let secret = Secret::new(&[seed; 32]);
        let keys = Suite::Aes128GcmSha256.keys(&secret);
        DirectionState {
            key: KeyBytes(keys.key().to_vec()),
            iv: *keys.iv(),
            seq,
            secret: Some(secret),
        }
    } else {
        DirectionState {
            key: KeyBytes(vec![seed; 16]),
            iv: [seed; 12],
            seq,
            secret: None,
        }
    }
}

/// A session's two ends: (this side's state, the peer's).
fn ends(tls13: bool, side: Side, seq: u64) -> (TlsState, TlsState) {
    let state = |side, tx, rx| TlsState {
        side,
        suite: if tls13 { 0x1301 } else { 0xc02b },
        tx: direction(tls13, tx, seq),
        rx: direction(tls13, rx, seq),
        plaintext: Vec::new(),
        read_closed: false,
        partial: Vec::new(),
    };
    let other = match side {
        Side::Server => Side::Client,
        Side::Client => Side::Server,
    };
    (state(side, 1, 2), state(other, 2, 1))
}

fn layers(tls13: bool, side: Side) -> (RecordLayer, RecordLayer) {
    let (ours, theirs) = ends(tls13, side, 3);
    (
        RecordLayer::new(&ours, None).unwrap(),
        RecordLayer::new(&theirs, None).unwrap(),
    )
}

/// The peer seals one record of `kind`; ours opens it.
fn deliver(
    ours: &mut RecordLayer,
    peer: &mut RecordLayer,
    kind: u8,
    plain: &[u8],
) -> Result<Opened, RecordError> {
    let mut wire = Vec::new();
    peer.seal_any_for_test(kind, plain, &mut wire).unwrap();
    assert_eq!(RecordLayer::whole_record(&wire).unwrap(), Some(wire.len()));
    ours.open(&mut wire)
}

#[test]
fn tls12_refuses_renegotiation_and_fatal_alerts_and_caps_warnings() {
    let (mut ours, mut peer) = layers(false, Side::Client);
    assert!(
        matches!(deliver(&mut ours, &mut peer, APPLICATION_DATA, b"ok"), Ok(Opened::Data(r)) if r.len() == 2)
    );
    // A server's HelloRequest: renegotiation, refused.
    let refused = deliver(&mut ours, &mut peer, HANDSHAKE, &[0, 0, 0, 0]);
    assert!(
        matches!(refused, Err(RecordError::UnexpectedHandshake(0))),
        "{refused:?}"
    );
    let (mut ours, mut peer) = layers(false, Side::Server);
    for _ in 0..4 {
        assert_eq!(
            deliver(&mut ours, &mut peer, ALERT, &[1, 90]).unwrap(),
            Opened::Control
        );
    }
    assert!(matches!(
        deliver(&mut ours, &mut peer, ALERT, &[1, 90]),
        Err(RecordError::TooMany(4))
    ));
    let (mut ours, mut peer) = layers(false, Side::Server);
    let fatal = deliver(&mut ours, &mut peer, ALERT, &[2, 40]);
    assert!(matches!(
        fatal,
        Err(RecordError::PeerAlert {
            level: 2,
            description: 40
        })
    ));
    let (mut ours, mut peer) = layers(false, Side::Server);
    let ccs = deliver(&mut ours, &mut peer, 20, &[1]);
    assert!(matches!(ccs, Err(RecordError::UnexpectedType(20))));
    assert_eq!(
        deliver(&mut ours, &mut peer, ALERT, &[1, 0]).unwrap(),
        Opened::Closed
    );
}

#[test]
fn tls13_skips_tickets_in_client_mode_and_refuses_other_handshake_messages() {
    let ticket = [4, 0, 0, 3, 1, 2, 3];
    let (mut ours, mut peer) = layers(true, Side::Client);
    assert_eq!(
        deliver(
            &mut ours,
            &mut peer,
            HANDSHAKE,
            &[&ticket[..], &ticket].concat()
        )
        .unwrap(),
        Opened::Control
    );
    // A CertificateRequest (post-handshake authentication).
    let refused = deliver(&mut ours, &mut peer, HANDSHAKE, &[13, 0, 0, 0]);
    assert!(matches!(refused, Err(RecordError::UnexpectedHandshake(13))));
    // A client does not send tickets.
    let (mut ours, mut peer) = layers(true, Side::Server);
    assert!(deliver(&mut ours, &mut peer, HANDSHAKE, &ticket).is_err());
    // A KeyUpdate must end its record; a message may not span records.
    let (mut ours, mut peer) = layers(true, Side::Server);
    assert!(deliver(
        &mut ours,
        &mut peer,
        HANDSHAKE,
        &[24, 0, 0, 1, 0, 4, 0, 0, 0]
    )
    .is_err());
    let (mut ours, mut peer) = layers(true, Side::Server);
    assert!(matches!(
        deliver(&mut ours, &mut peer, HANDSHAKE, &[24, 0, 0, 1]),
        Err(RecordError::Malformed(_))
    ));
    let (mut ours, mut peer) = layers(true, Side::Server);
    assert!(matches!(
        deliver(&mut ours, &mut peer, 20, &[1]),
        Err(RecordError::UnexpectedType(20))
    ));
}

#[test]
fn tls13_follows_key_updates_and_caps_them_without_data() {
    let (mut ours, mut peer) = layers(true, Side::Server);
    let mut out = Vec::new();
    for round in 0..32u64 {
        peer.request_key_update();
        out.clear();
        // The peer's KeyUpdate, then data under its next key; ours
        // follows (and only the first of a run is data-free here).
        peer.seal_data(b"x", &mut out).unwrap();
        let len = RecordLayer::whole_record(&out).unwrap().unwrap();
        let (update, data) = out.split_at_mut(len);
        assert_eq!(ours.open(update).unwrap(), Opened::Control);
        assert!(matches!(ours.open(data).unwrap(), Opened::Data(_)));
        assert_eq!(ours.updates[0], round + 1);
    }
    // 33 KeyUpdates with no data between them.
    let update = [24, 0, 0, 1, 0];
    for _ in 0..32 {
        peer.request_key_update();
        let mut wire = Vec::new();
        peer.seal_owed_update(&mut wire).unwrap();
        assert_eq!(ours.open(&mut wire).unwrap(), Opened::Control);
    }
    assert!(matches!(
        deliver(&mut ours, &mut peer, HANDSHAKE, &update),
        Err(RecordError::TooMany(32))
    ));
}

#[test]
fn tampered_padded_oversized_and_wrapping_records_are_refused() {
    for tls13 in [true, false] {
        let (mut ours, mut peer) = layers(tls13, Side::Server);
        let mut wire = Vec::new();
        peer.seal_data(b"data", &mut wire).unwrap();
        let last = wire.len() - 1;
        wire[last] ^= 1;
        assert!(matches!(
            ours.open(&mut wire),
            Err(RecordError::BadRecordMac)
        ));
        let mut header = vec![23, 3, 3, 0x48, 0x01];
        header.resize(5 + 0x4801, 0);
        assert!(matches!(
            RecordLayer::whole_record(&header),
            Err(RecordError::Overflow(_))
        ));
        // The last sequence number is never used, and never wraps.
        let (mut ours, _) = ends(tls13, Side::Server, u64::MAX);
        ours.tx.seq = u64::MAX;
        let mut layer = RecordLayer::new(&ours, Some(u64::MAX)).unwrap();
        let wrapped = layer.seal_data(b"x", &mut Vec::new());
        assert!(
            matches!(wrapped, Err(RecordError::SequenceWrap("send"))),
            "{wrapped:?}"
        );
    }
    let (mut ours, mut peer) = layers(true, Side::Server);
    // TLS 1.3: a record of padding only has no content type.
    assert!(matches!(
        deliver(&mut ours, &mut peer, 0, &[]),
        Err(RecordError::Malformed(_))
    ));
    let (mut ours, mut peer) = layers(true, Side::Server);
    let big = vec![7u8; 16_385];
    assert!(matches!(
        deliver(&mut ours, &mut peer, APPLICATION_DATA, &big),
        Err(RecordError::Overflow(16_385))
    ));
}

/// A peer's error over a stream: the read fails, and the peer is told
/// with a fatal alert it can open.
#[tokio::test]
async fn a_tampered_record_is_answered_with_bad_record_mac() {
    let (ours, theirs) = ends(true, Side::Server, 0);
    let mut peer = RecordLayer::new(&theirs, None).unwrap();
    let (near, mut far) = tokio::io::duplex(1 << 16);
    let mut resumed = ResumedTls::new(near, ours, None).unwrap();
    let mut wire = Vec::new();
    peer.seal_data(b"fine", &mut wire).unwrap();
    let start = wire.len();
    peer.seal_data(b"tampered", &mut wire).unwrap();
    wire[start + 7] ^= 0x80;
    far.write_all(&wire).await.unwrap();
    let mut got = [0u8; 4];
    resumed.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"fine");
    let e = resumed.read(&mut [0u8; 8]).await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    assert!(e.to_string().contains("did not decrypt"), "{e}");
    // Every later read and write reports the same end.
    assert!(resumed.write_all(b"more").await.is_err());
    let mut alert = vec![0u8; 5 + 2 + 1 + 16];
    far.read_exact(&mut alert).await.unwrap();
    let opened = peer.open(&mut alert);
    assert!(
        matches!(
            opened,
            Err(RecordError::PeerAlert {
                level: 2,
                description: 20
            })
        ),
        "{opened:?}"
    );
}

#[test]
fn a_state_is_not_taken_mid_handshake() {
    let dir = tempfile::tempdir().unwrap();
    crate::certs::for_test(dir.path(), "localhost", 1);
    let mut config = crate::tls::load_server_config(
        &dir.path().join("server-cert.pem"),
        &dir.path().join("server-key.pem"),
    )
    .unwrap();
    config.enable_secret_extraction = true;
    let fresh = rustls::ServerConnection::new(std::sync::Arc::new(config)).unwrap();
    assert!(matches!(
        TlsState::take(fresh, Vec::new(), None),
        Err(StateError::Handshaking)
    ));
}

#[test]
fn a_partial_that_is_already_a_whole_record_is_refused() {
    let (mut ours, _) = ends(false, Side::Server, 0);
    ours.partial = vec![23, 3, 3, 0, 2, 9, 9];
    assert!(matches!(
        RecordLayer::new(&ours, None),
        Err(StateError::Partial(7))
    ));
    ours.partial = vec![23, 3, 3, 0xff, 0xff];
    assert!(matches!(
        RecordLayer::new(&ours, None),
        Err(StateError::Partial(5))
    ));
    ours.partial = vec![23, 3, 3];
    assert!(RecordLayer::new(&ours, None).is_ok());
}
