//! Hand-overs against real rustls peers: a handshake with rustls on both
//! ends over loopback TCP, one end taken out of rustls at a quiet point
//! (with plaintext unread and half a record in rustls), carried through
//! the encoding, rebuilt, and driven on; and, in memory, the first record
//! after a hand-over compared byte for byte with rustls's own.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use crate::tls::key_update::DEFAULT_MAX_GENERATIONS_AT_HAND_OVER;
use rustls::crypto::aws_lc_rs::cipher_suite::*;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::SupportedCipherSuite;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsStream;

use super::*;
use crate::tls::key_update::SecretLog;

// A child of this module (its helpers are private), kept in its own file.
#[path = "long_sessions.rs"]
mod long_sessions;

const LIMIT: Duration = Duration::from_secs(120);

fn all_suites() -> Vec<SupportedCipherSuite> {
    vec![
        TLS13_AES_128_GCM_SHA256,
        TLS13_AES_256_GCM_SHA384,
        TLS13_CHACHA20_POLY1305_SHA256,
        TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
        TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
    ]
}

/// Both ends' configurations, one suite only, each with its own key log.
struct Configs {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
    server_log: Arc<SecretLog>,
    client_log: Arc<SecretLog>,
    _dir: tempfile::TempDir,
}

fn configs(suite: SupportedCipherSuite) -> Configs {
    let dir = tempfile::tempdir().unwrap();
    crate::certs::for_test(dir.path(), "localhost", 1);
    let mut server = crate::tls::load_server_config(
        &dir.path().join("server-cert.pem"),
        &dir.path().join("server-key.pem"),
    )
    .unwrap();
    let (server_log, client_log) = (SecretLog::new(), SecretLog::new());
    server.enable_secret_extraction = true;
    server.key_log = server_log.clone();
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(dir.path().join("ca-cert.pem")).unwrap())
        .unwrap();
    let mut provider = (*crate::tls::provider()).clone();
    provider.cipher_suites = vec![suite];
    let version = match suite {
        SupportedCipherSuite::Tls13(_) => &rustls::version::TLS13,
        SupportedCipherSuite::Tls12(_) => &rustls::version::TLS12,
    };
    let mut client = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(&[version])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    client.enable_secret_extraction = true;
    client.key_log = client_log.clone();
    Configs {
        server: Arc::new(server),
        client: Arc::new(client),
        server_log,
        client_log,
        _dir: dir,
    }
}

type Tls = TlsStream<RecordTail<TcpStream>>;

/// A TLS session over loopback: (server end, client end).
async fn connected(c: &Configs) -> (Tls, Tls) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (client_tcp, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
    let server_tcp = accepted.unwrap().0;
    let acceptor = tokio_rustls::TlsAcceptor::from(c.server.clone());
    let connector = tokio_rustls::TlsConnector::from(c.client.clone());
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let (server, client) = tokio::join!(
        acceptor.accept(RecordTail::new(server_tcp)),
        connector.connect(name, RecordTail::new(client_tcp.unwrap()))
    );
    (server.unwrap().into(), client.unwrap().into())
}

async fn send_owed(tls: &mut Tls) {
    match tls {
        TlsStream::Client(c) => send_owed_client(c).await.unwrap(),
        TlsStream::Server(s) => send_owed_server(s).await.unwrap(),
    }
}

/// The predecessor's part: rustls out, the state through its encoding.
fn take(tls: Tls, log: &SecretLog) -> (TcpStream, TlsState) {
    let (tcp, state) = match tls {
        TlsStream::Client(c) => take_client(c, Some(log)).unwrap(),
        TlsStream::Server(s) => take_server(s, Some(log)).unwrap(),
    };
    (tcp, TlsState::decode(&state.encode()).unwrap())
}

/// One record as rustls seals it for `data` (not sent).
fn rustls_record(peer: &mut Tls, data: &[u8]) -> Vec<u8> {
    fn seal<D>(conn: &mut rustls::ConnectionCommon<D>, data: &[u8]) -> Vec<u8> {
        conn.writer().write_all(data).unwrap();
        let mut wire = Vec::new();
        while conn.wants_write() {
            conn.write_tls(&mut wire).unwrap();
        }
        wire
    }
    match peer {
        TlsStream::Client(c) => seal(&mut **c.get_mut().1, data),
        TlsStream::Server(s) => seal(&mut **s.get_mut().1, data),
    }
}

fn raw_tcp(peer: &mut Tls) -> &mut TcpStream {
    match peer {
        TlsStream::Client(c) => c.get_mut().0.get_mut(),
        TlsStream::Server(s) => s.get_mut().0.get_mut(),
    }
}

fn refresh(peer: &mut Tls) {
    match peer {
        TlsStream::Client(c) => c.get_mut().1.refresh_traffic_keys().unwrap(),
        TlsStream::Server(s) => s.get_mut().1.refresh_traffic_keys().unwrap(),
    }
}

fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 31 + seed * 7) % 251) as u8)
        .collect()
}

/// Waits until the socket holds at least `want` unread bytes (peeked,
/// not taken), so that rustls reads them in one go.
async fn buffered(tcp: &TcpStream, want: usize) {
    let mut buf = vec![0u8; want];
    loop {
        tcp.readable().await.unwrap();
        if tcp.peek(&mut buf).await.unwrap() >= want {
            return;
        }
        tokio::task::yield_now().await;
    }
}

/// The hand-over at a quiet point with 90 bytes of plaintext unread and
/// the start of the next record in rustls; the rest of that record comes
/// after it. Returns the rebuilt end and the rustls peer.
async fn handed_over(
    c: &Configs,
    side: Side,
    key_limit_after: Option<u64>,
) -> (ResumedTls<TcpStream>, Tls) {
    let (server, client) = connected(c).await;
    let (mut taken, mut peer, log) = match side {
        Side::Server => (server, client, &c.server_log),
        Side::Client => (client, server, &c.client_log),
    };
    taken.write_all(b"hello").await.unwrap();
    taken.flush().await.unwrap();
    let mut got = [0u8; 5];
    peer.read_exact(&mut got).await.unwrap();
    peer.write_all(b"world").await.unwrap();
    peer.flush().await.unwrap();
    taken.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"world");

    // One record read in part by the application, one half read by rustls.
    let mut wire = rustls_record(&mut peer, &pattern(1, 100));
    let split = rustls_record(&mut peer, &pattern(2, 200));
    // Into the body of the record on one side, into its header on the
    // other.
    let cut = if side == Side::Server { 50 } else { 3 };
    wire.extend_from_slice(&split[..cut]);
    raw_tcp(&mut peer).write_all(&wire).await.unwrap();
    let taken_tcp = match &taken {
        TlsStream::Client(c) => c.get_ref().0.get_ref(),
        TlsStream::Server(s) => s.get_ref().0.get_ref(),
    };
    buffered(taken_tcp, wire.len()).await;
    let mut first = [0u8; 10];
    taken.read_exact(&mut first).await.unwrap();
    assert_eq!(&first[..], &pattern(1, 100)[..10]);

    // The quiet point: rustls owes nothing (a write of nothing queues a
    // KeyUpdate it owes), everything it made is sent.
    send_owed(&mut taken).await;
    let (tcp, state) = take(taken, log);
    assert_eq!(state.plaintext, &pattern(1, 100)[10..]);
    assert_eq!(state.partial, &split[..cut]);
    let key_limit = key_limit_after.map(|n| state.tx.seq + n);
    let resumed = ResumedTls::new(tcp, state, key_limit).unwrap();
    raw_tcp(&mut peer).write_all(&split[cut..]).await.unwrap();
    (resumed, peer)
}

/// The relay moves the stream into tasks and splits it.
#[test]
fn the_rebuilt_stream_is_send_and_unpin() {
    fn relay_can_take<T: AsyncRead + AsyncWrite + Send + Unpin + 'static>() {}
    relay_can_take::<ResumedTls<TcpStream>>();
}

/// Many records both ways at once: 2,000 small writes (a record each)
/// and a 1 MiB write (64 full records) from each end, every byte checked.
async fn bulk<A, B>(a: &mut A, b: &mut B)
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    async fn send(w: &mut (impl AsyncWrite + Unpin), seed: usize) {
        for i in 0..2000 {
            w.write_all(&pattern(seed + i, 37)).await.unwrap();
        }
        w.write_all(&pattern(seed, 1 << 20)).await.unwrap();
        w.flush().await.unwrap();
    }
    async fn receive(r: &mut (impl AsyncRead + Unpin), seed: usize) {
        let mut small = [0u8; 37];
        for i in 0..2000 {
            r.read_exact(&mut small).await.unwrap();
            assert_eq!(&small[..], &pattern(seed + i, 37)[..], "small record {i}");
        }
        let mut large = vec![0u8; 1 << 20];
        r.read_exact(&mut large).await.unwrap();
        assert!(large == pattern(seed, 1 << 20), "the 1 MiB write");
    }
    let (mut ar, mut aw) = tokio::io::split(a);
    let (mut br, mut bw) = tokio::io::split(b);
    tokio::join!(
        send(&mut aw, 3),
        receive(&mut br, 3),
        send(&mut bw, 5),
        receive(&mut ar, 5)
    );
}

async fn continue_after_hand_over(suite: SupportedCipherSuite, side: Side) {
    let c = configs(suite);
    let (mut resumed, mut peer) = handed_over(&c, side, None).await;
    let mut got = vec![0u8; 290];
    resumed.read_exact(&mut got).await.unwrap();
    assert_eq!(
        got[..90],
        pattern(1, 100)[10..],
        "the plaintext rustls held"
    );
    assert_eq!(
        got[90..],
        pattern(2, 200)[..],
        "the record cut at the hand-over"
    );

    bulk(&mut resumed, &mut peer).await;

    if resumed.layer().version() == Version::Tls13 {
        // The peer updates its keys and asks for ours (rustls does).
        refresh(&mut peer);
        peer.write_all(b"after the peer's update").await.unwrap();
        peer.flush().await.unwrap();
        let mut got = [0u8; 23];
        resumed.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"after the peer's update");
        // Asked: ours goes before this.
        resumed.write_all(b"answered").await.unwrap();
        resumed.request_key_update();
        resumed.write_all(b"and our own").await.unwrap();
        resumed.flush().await.unwrap();
        let mut got = [0u8; 19];
        peer.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"answeredand our own");
        assert_eq!(resumed.layer().updates, [1, 2]);
        bulk(&mut resumed, &mut peer).await;
    }

    // close_notify each way.
    resumed.shutdown().await.unwrap();
    let mut rest = Vec::new();
    assert_eq!(peer.read_to_end(&mut rest).await.unwrap(), 0);
    peer.shutdown().await.unwrap();
    assert_eq!(resumed.read(&mut [0u8; 8]).await.unwrap(), 0);
}

/// Every suite nbdgw negotiates, both versions, the server's end and the
/// client's (client mode) each taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_go_on_after_the_hand_over_in_every_suite_and_side() {
    for suite in all_suites() {
        for side in [Side::Server, Side::Client] {
            let run = continue_after_hand_over(suite, side);
            tokio::time::timeout(LIMIT, run)
                .await
                .unwrap_or_else(|_| panic!("{suite:?} {side:?} timed out"));
        }
    }
}

/// TLS 1.3 replaces its key before the limit; TLS 1.2 closes.
#[tokio::test]
async fn the_key_limit_updates_a_tls13_key_and_closes_a_tls12_session() {
    for suite in [
        TLS13_AES_128_GCM_SHA256,
        TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
    ] {
        let c = configs(suite);
        // Five records under a key, counting those rustls sent under it.
        let (mut resumed, mut peer) = handed_over(&c, Side::Server, Some(5)).await;
        resumed.read_exact(&mut [0u8; 290]).await.unwrap();
        let tls13 = resumed.layer().version() == Version::Tls13;
        let mut sent = 0;
        for i in 0..12 {
            match resumed.write_all(&pattern(i, 100)).await {
                Ok(()) => sent += 1,
                Err(e) => {
                    assert!(!tls13, "{e}");
                    assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe);
                    assert!(e.to_string().contains("record limit"), "{e}");
                    break;
                }
            }
        }
        resumed.flush().await.unwrap();
        let mut got = Vec::new();
        if tls13 {
            assert_eq!(sent, 12);
            assert!(
                resumed.layer().updates[1] >= 2,
                "{:?}",
                resumed.layer().updates
            );
            got.resize(1200, 0);
            peer.read_exact(&mut got).await.unwrap();
        } else {
            // Four data records and close_notify: the key's fifth.
            assert_eq!(sent, 4);
            peer.read_to_end(&mut got).await.unwrap();
            assert_eq!(got.len(), 400);
        }
        for (i, chunk) in got.chunks(100).enumerate() {
            assert_eq!(chunk, pattern(i, 100), "{suite:?} record {i}");
        }
    }
}

fn handshaken_in_memory(c: &Configs) -> (rustls::ClientConnection, rustls::ServerConnection) {
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut client = rustls::ClientConnection::new(c.client.clone(), name).unwrap();
    let mut server = rustls::ServerConnection::new(c.server.clone()).unwrap();
    while client.is_handshaking() || server.is_handshaking() || server.wants_write() {
        let mut wire = Vec::new();
        while client.wants_write() {
            client.write_tls(&mut wire).unwrap();
        }
        server.read_tls(&mut &wire[..]).unwrap();
        server.process_new_packets().unwrap();
        let mut wire = Vec::new();
        while server.wants_write() {
            server.write_tls(&mut wire).unwrap();
        }
        client.read_tls(&mut &wire[..]).unwrap();
        client.process_new_packets().unwrap();
    }
    (client, server)
}

/// rustls's own record protection for the extracted send keys.
fn rustls_encrypter(
    suite: SupportedCipherSuite,
    secrets: rustls::ConnectionTrafficSecrets,
) -> Box<dyn rustls::crypto::cipher::MessageEncrypter> {
    use rustls::ConnectionTrafficSecrets::*;
    let (key, iv) = match secrets {
        Aes128Gcm { key, iv } | Aes256Gcm { key, iv } | Chacha20Poly1305 { key, iv } => (key, iv),
        _ => unreachable!(),
    };
    match suite {
        SupportedCipherSuite::Tls13(s) => s.aead_alg.encrypter(key, iv),
        SupportedCipherSuite::Tls12(s) => {
            let iv = iv.as_ref();
            match s.common.suite {
                rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256 => {
                    s.aead_alg.encrypter(key, iv, &[])
                }
                _ => s.aead_alg.encrypter(key, &iv[..4], &iv[4..]),
            }
        }
    }
}

/// The first record a rebuilt layer seals is byte for byte the one
/// rustls would have sealed next, and the rustls peer reads it; a state
/// whose send number is one lower (a nonce used again) is refused by the
/// peer.
#[test]
fn the_first_record_after_the_hand_over_is_the_one_rustls_would_send() {
    use rustls::crypto::cipher::{OutboundChunks, OutboundPlainMessage};
    for suite in all_suites() {
        for lowered in [false, true] {
            let c = configs(suite);
            let (mut client, mut server) = handshaken_in_memory(&c);
            // Some records first, so that the count is not at its start.
            for i in 0..3 {
                let wire = seal_with(&mut server, &pattern(i, 10));
                client.read_tls(&mut &wire[..]).unwrap();
                client.process_new_packets().unwrap();
            }
            client.reader().read_exact(&mut [0u8; 30]).unwrap();
            let extracted = server.dangerous_extract_secrets().unwrap();
            let mut state = state_of(suite, &extracted, &c.server_log);
            let seq = extracted.tx.0;
            assert!(seq >= 3);
            if lowered {
                state.tx.seq -= 1;
            }
            let state = TlsState::decode(&state.encode()).unwrap();
            let mut layer = RecordLayer::new(&state, None).unwrap();
            let mut ours = Vec::new();
            layer.seal_data(b"the next record", &mut ours).unwrap();
            let theirs = rustls_encrypter(suite, extracted.tx.1)
                .encrypt(
                    OutboundPlainMessage {
                        typ: rustls::ContentType::ApplicationData,
                        version: rustls::ProtocolVersion::TLSv1_2,
                        payload: OutboundChunks::Single(b"the next record"),
                    },
                    seq,
                )
                .unwrap()
                .encode();
            client.read_tls(&mut &ours[..]).unwrap();
            let read = client.process_new_packets();
            if lowered {
                assert_ne!(ours, theirs, "{suite:?}");
                assert!(
                    matches!(read, Err(rustls::Error::DecryptError)),
                    "{suite:?}: a reused sequence number was not refused: {read:?}"
                );
            } else {
                assert_eq!(ours, theirs, "{suite:?}");
                read.unwrap();
                let mut got = [0u8; 15];
                client.reader().read_exact(&mut got).unwrap();
                assert_eq!(&got, b"the next record");
            }
        }
    }
}

fn state_of(
    suite: SupportedCipherSuite,
    extracted: &rustls::ExtractedSecrets,
    log: &SecretLog,
) -> TlsState {
    let version = match suite {
        SupportedCipherSuite::Tls13(_) => Version::Tls13,
        SupportedCipherSuite::Tls12(_) => Version::Tls12,
    };
    TlsState::from_extracted(
        Side::Server,
        (u16::from(suite.suite()), version),
        (extracted.tx.0, &extracted.tx.1),
        (extracted.rx.0, &extracted.rx.1),
        (Some(log), DEFAULT_MAX_GENERATIONS_AT_HAND_OVER),
    )
    .unwrap()
}

fn seal_with(conn: &mut rustls::ServerConnection, data: &[u8]) -> Vec<u8> {
    conn.writer().write_all(data).unwrap();
    let mut wire = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut wire).unwrap();
    }
    wire
}

/// The peer updates its keys, asking for ours, right before the quiet
/// point: rustls follows and owes a KeyUpdate. A state taken before that
/// is sent is refused (the KeyUpdate would be lost, or sent twice); sent,
/// the session goes on under the generations the key log was followed to.
#[tokio::test]
async fn a_key_update_right_before_the_hand_over_is_sent_first() {
    for sent in [false, true] {
        let c = configs(TLS13_AES_256_GCM_SHA384);
        let (mut taken, mut peer) = connected(&c).await;
        refresh(&mut peer);
        peer.write_all(b"updated").await.unwrap();
        peer.flush().await.unwrap();
        let mut got = [0u8; 7];
        taken.read_exact(&mut got).await.unwrap();
        let TlsStream::Server(mut server) = taken else {
            unreachable!()
        };
        if !sent {
            let refused = take_server(server, Some(&c.server_log));
            assert!(
                matches!(refused, Err(StateError::Unsent)),
                "{:?}",
                refused.err()
            );
            continue;
        }
        send_owed_server(&mut server).await.unwrap();
        let (tcp, state) = take_server(server, Some(&c.server_log)).unwrap();
        let mut resumed = ResumedTls::new(tcp, state, None).unwrap();
        resumed.write_all(b"after").await.unwrap();
        resumed.flush().await.unwrap();
        let mut got = [0u8; 5];
        peer.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"after");
        peer.write_all(b"more").await.unwrap();
        peer.flush().await.unwrap();
        let mut got = [0u8; 4];
        resumed.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"more");
        assert_eq!(resumed.layer().updates, [0, 0], "rustls had followed both");
    }
}

/// The peer's close_notify read before the hand-over: the rebuilt end
/// reads its end at once, and can still write.
#[tokio::test]
async fn a_close_notify_read_before_the_hand_over_is_carried() {
    let c = configs(TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256);
    let (mut taken, mut peer) = connected(&c).await;
    peer.write_all(b"last words").await.unwrap();
    peer.shutdown().await.unwrap();
    let mut got = Vec::new();
    taken.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"last words");
    send_owed(&mut taken).await;
    let (tcp, state) = take(taken, &c.server_log);
    assert!(state.read_closed);
    let mut resumed = ResumedTls::new(tcp, state, None).unwrap();
    assert_eq!(resumed.read(&mut [0u8; 4]).await.unwrap(), 0);
    resumed.write_all(b"reply").await.unwrap();
    resumed.shutdown().await.unwrap();
    let mut got = [0u8; 5];
    peer.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"reply");
}

/// Client mode taken right after its handshake: a rustls server that
/// sends TLS 1.3 tickets (nbdgw's own sends none; a GnuTLS qemu-nbd
/// does) sends them after the client's Finished, which ends the client's
/// handshake, so they reach the rebuilt client, which skips them.
#[tokio::test]
async fn a_servers_tickets_after_the_hand_over_are_skipped_in_client_mode() {
    let mut c = configs(TLS13_CHACHA20_POLY1305_SHA256);
    let mut server = (*c.server).clone();
    server.send_tls13_tickets = 2;
    server.session_storage = rustls::server::ServerSessionMemoryCache::new(8);
    c.server = Arc::new(server);
    let (mut peer, mut taken) = connected(&c).await;
    send_owed(&mut taken).await;
    let (tcp, state) = take(taken, &c.client_log);
    let mut resumed = ResumedTls::new(tcp, state, None).unwrap();
    peer.write_all(b"world").await.unwrap();
    peer.flush().await.unwrap();
    let mut got = [0u8; 5];
    resumed.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"world");
    assert_eq!(resumed.layer().tickets_skipped, 2);
    resumed.write_all(b"hello").await.unwrap();
    resumed.flush().await.unwrap();
    peer.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"hello");
}
