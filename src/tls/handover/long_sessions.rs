//! Sessions handed over late in their life (review round 2, S2 and S3):
//! at the edge of their key's record limit, and many key generations
//! after their handshake.

use super::*;

/// A TLS 1.2 session is served to the very record rustls would have
/// sealed last under its key (number C - 1, C the suite's
/// confidentiality limit), byte for byte; the next write gets
/// close_notify (number C) and `KeyLimit`, as rustls does then.
#[test]
fn a_tls12_session_runs_to_rustls_own_key_limit() {
    use rustls::crypto::cipher::{OutboundChunks, OutboundPlainMessage};
    for suite in [
        TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
    ] {
        let limit = match suite {
            SupportedCipherSuite::Tls12(s) => s.common.confidentiality_limit,
            _ => unreachable!(),
        };
        assert_eq!(limit, 1 << 24, "{suite:?}");
        let c = configs(suite);
        let (_client, server) = handshaken_in_memory(&c);
        let extracted = server.dangerous_extract_secrets().unwrap();
        let mut state = state_of(suite, &extracted, &c.server_log);
        state.tx.seq = limit - 1;
        let mut layer = RecordLayer::new(&state, None).unwrap();
        let mut ours = Vec::new();
        assert_eq!(layer.seal_data(b"last", &mut ours).unwrap(), 4);
        let theirs = rustls_encrypter(suite, extracted.tx.1)
            .encrypt(
                OutboundPlainMessage {
                    typ: rustls::ContentType::ApplicationData,
                    version: rustls::ProtocolVersion::TLSv1_2,
                    payload: OutboundChunks::Single(b"last"),
                },
                limit - 1,
            )
            .unwrap()
            .encode();
        assert_eq!(ours, theirs, "{suite:?}");
        let mut closing = Vec::new();
        let worn = layer.seal_data(b"one more", &mut closing);
        assert!(matches!(worn, Err(RecordError::KeyLimit)), "{worn:?}");
        // One alert record (type 21): close_notify, under number C.
        assert_eq!(closing[0], 21, "{suite:?}");
        assert_eq!(layer.sequence_numbers().0, limit + 1);
    }
}

/// TLS 1.3: the KeyUpdate takes the last number under the key, C - 1,
/// as rustls's does; one record before, nothing is updated.
#[test]
fn a_tls13_key_is_updated_where_rustls_updates_it() {
    let suite = TLS13_AES_256_GCM_SHA384;
    let limit = match suite {
        SupportedCipherSuite::Tls13(s) => s.common.confidentiality_limit,
        _ => unreachable!(),
    };
    // (rustls's 2^23 for this suite is QUIC's, not TLS's.)
    assert_eq!(limit, 1 << 24);
    let c = configs(suite);
    let (_client, server) = handshaken_in_memory(&c);
    let extracted = server.dangerous_extract_secrets().unwrap();
    // The key log gives its secrets once.
    let taken = state_of(suite, &extracted, &c.server_log);
    for (seq, updates) in [(limit - 2, 0), (limit - 1, 1)] {
        let mut state = taken.clone();
        state.tx.seq = seq;
        let mut layer = RecordLayer::new(&state, None).unwrap();
        layer.seal_data(b"x", &mut Vec::new()).unwrap();
        assert_eq!(layer.updates[1], updates, "at {seq}");
    }
}

/// 40 key updates each way since the handshake (each with a data record
/// between, as rustls requires): the session is taken, carried and goes
/// on both ways in the successor.
#[tokio::test]
async fn a_session_forty_key_generations_on_is_handed_over() {
    for suite in [TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384] {
        let c = configs(suite);
        let (mut server, mut client) = connected(&c).await;
        for i in 0..40u8 {
            refresh(&mut client);
            client.write_all(&[i]).await.unwrap();
            client.flush().await.unwrap();
            let mut b = [0u8; 1];
            server.read_exact(&mut b).await.unwrap();
            refresh(&mut server);
            server.write_all(&[i]).await.unwrap();
            server.flush().await.unwrap();
            client.read_exact(&mut b).await.unwrap();
            assert_eq!(b, [i]);
        }
        send_owed(&mut server).await;
        let (tcp, state) = take(server, &c.server_log);
        let mut resumed = ResumedTls::new(tcp, state, None).unwrap();
        resumed.write_all(b"after forty").await.unwrap();
        resumed.flush().await.unwrap();
        let mut got = [0u8; 11];
        client.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"after forty");
        client.write_all(b"and back").await.unwrap();
        client.flush().await.unwrap();
        let mut got = [0u8; 8];
        resumed.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"and back");
    }
}
