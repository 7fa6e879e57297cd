//! A whole connection: arbitrary bytes, in arbitrary chunks, sent by a
//! client after STARTTLS and TLS (options, then requests, in whatever
//! order the input makes) to a running gateway in this process, in front
//! of a scripted upstream. Nothing may panic or hang the gateway.
//!
//! Input: one byte for the piece size, one whose low bit picks the
//! gateway (0: a plain export; 1: an immutable one with the read cache and
//! read-ahead, so that hits, fills and nbdgw's own reads are fuzzed too),
//! then the bytes the client sends.
//!
//! The gateway listens on 127.0.0.1 (its connection code is written over
//! TCP sockets, not generic streams); each input is one loopback
//! connection, at about a thousand a second.
#![no_main]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use nbdgw::proto::consts::*;
use nbdgw::proto::transmission::{
    encode_error_reply, encode_read_reply_header, InFlight, ReplyMode, Request,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

struct Gateway {
    addr: SocketAddr,
    client: Arc<rustls::ClientConfig>,
}

/// The export's size, as the scripted upstream states it.
const EXPORT_SIZE: u64 = 1 << 20;

fn gateway(cached: bool) -> &'static Gateway {
    static PLAIN: OnceLock<Gateway> = OnceLock::new();
    static CACHED: OnceLock<Gateway> = OnceLock::new();
    // libFuzzer's main, unlike Rust's, leaves SIGPIPE fatal: a write to a
    // connection the gateway closed would end the run.
    static SIGPIPE: OnceLock<()> = OnceLock::new();
    SIGPIPE.get_or_init(|| {
        // SAFETY: setting a signal's disposition to SIG_IGN, before any
        // other thread of ours exists, touches no Rust state.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
    });
    if cached {
        CACHED.get_or_init(|| start(true))
    } else {
        PLAIN.get_or_init(|| start(false))
    }
}

fn start(cached: bool) -> Gateway {
    let dir = std::env::temp_dir().join(format!(
        "nbdgw-fuzz-{}-{}",
        std::process::id(),
        if cached { "cached" } else { "plain" }
    ));
    let certs = dir.join("certs");
    nbdgw::certs::generate(&nbdgw::certs::CertsRequest {
        out: certs.clone(),
        server_names: vec!["localhost".into()],
        client_names: vec!["fuzz".into()],
        client_uris: vec![],
        days: 2,
        force: true,
        ca: None,
        keep_ca_key: false,
    })
    .expect("certificates");
    let socket = dir.join("upstream.sock");
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket).expect("upstream socket");
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || upstream(stream));
        }
    });
    let tls = nbdgw::tls::load_server_config(
        &certs.join("server-cert.pem"),
        &certs.join("server-key.pem"),
    )
    .expect("server config");
    let mut config = nbdgw::Config::new(socket, nbdgw::tls::TlsStore::fixed(tls));
    config.handshake_timeout = Duration::from_secs(2);
    config.relay.stall_timeout = Some(Duration::from_secs(1));
    config.relay.max_payload = 1 << 20;
    if cached {
        // Small blocks and read-ahead: fills, hits and nbdgw's own
        // reads within a few requests.
        config.read_cache.immutable =
            Arc::new(nbdgw::exports::Immutable::new(true, vec![]).expect("immutable"));
        config.read_cache.cache = Some(nbdgw::cache::ReadCache::with_block_size(
            4 << 20,
            4096,
            config.metrics.cache.clone(),
        ));
        config.read_cache.read_ahead = 16384;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            tx.send(listener.local_addr().expect("addr")).expect("send");
            let _ = nbdgw::run(listener, Arc::new(config), std::future::pending()).await;
        })
    });
    Gateway {
        addr: rx.recv().expect("gateway address"),
        client: client_config(&certs),
    }
}

fn client_config(certs: &Path) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(certs.join("ca-cert.pem")).expect("ca") {
        roots.add(cert.expect("ca cert")).expect("root");
    }
    Arc::new(
        rustls::ClientConfig::builder_with_provider(nbdgw::tls::provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// A scripted upstream: options are answered (structured replies,
/// extended headers and GO accepted, the rest unsupported), then a READ
/// within the export gets data (so that the cache fills and hits) and
/// every other request an EIO, in the framing negotiated.
fn upstream(mut s: UnixStream) {
    let mut greeting = NBDMAGIC.to_be_bytes().to_vec();
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    if s.write_all(&greeting).is_err() || s.read_exact(&mut [0u8; 4]).is_err() {
        return;
    }
    if let Some(mode) = options(&mut s) {
        transmission(&mut s, mode);
    }
}

/// The options until GO; the reply mode they negotiated.
fn options(s: &mut UnixStream) -> Option<ReplyMode> {
    let mut mode = ReplyMode::Simple;
    loop {
        let mut header = [0u8; 16];
        s.read_exact(&mut header).ok()?;
        let option = u32::from_be_bytes([header[8], header[9], header[10], header[11]]);
        let len = u32::from_be_bytes([header[12], header[13], header[14], header[15]]);
        std::io::copy(&mut (&mut *s).take(len.into()), &mut std::io::sink()).ok()?;
        let mut out = Vec::new();
        let mut reply = |kind: u32, body: &[u8]| {
            out.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
            out.extend_from_slice(&option.to_be_bytes());
            out.extend_from_slice(&kind.to_be_bytes());
            out.extend_from_slice(&(body.len() as u32).to_be_bytes());
            out.extend_from_slice(body);
        };
        match option {
            OPT_STRUCTURED_REPLY | OPT_ABORT => reply(REP_ACK, &[]),
            OPT_EXTENDED_HEADERS => reply(REP_ACK, &[]),
            OPT_GO | OPT_INFO => {
                let mut info = INFO_EXPORT.to_be_bytes().to_vec();
                info.extend_from_slice(&EXPORT_SIZE.to_be_bytes());
                info.extend_from_slice(&TFLAG_HAS_FLAGS.to_be_bytes());
                reply(REP_INFO, &info);
                reply(REP_ACK, &[]);
            }
            _ => reply(REP_ERR_UNSUP, &[]),
        }
        s.write_all(&out).ok()?;
        match option {
            OPT_STRUCTURED_REPLY if mode == ReplyMode::Simple => mode = ReplyMode::Structured,
            OPT_EXTENDED_HEADERS => mode = ReplyMode::Extended,
            OPT_GO => return Some(mode),
            _ => {}
        }
    }
}

fn transmission(s: &mut UnixStream, mode: ReplyMode) {
    let mut header = vec![0u8; mode.request_header_len()];
    loop {
        if s.read_exact(&mut header).is_err() {
            return;
        }
        let Ok(request) = Request::parse(mode, &header) else {
            return;
        };
        if request.command == CMD_DISC {
            return;
        }
        let payload = request.payload_len(mode);
        if std::io::copy(&mut (&mut *s).take(payload), &mut std::io::sink()).is_err() {
            return;
        }
        let in_flight = InFlight::from(&request);
        let mut reply = Vec::new();
        let within = request
            .offset
            .checked_add(request.length)
            .is_some_and(|end| end <= EXPORT_SIZE);
        if request.command == CMD_READ && payload == 0 && within && request.length > 0 {
            let (offset, length) = (request.offset, request.length);
            encode_read_reply_header(mode, request.cookie, offset, length, &mut reply);
            reply.extend((offset..offset + length).map(|at| (at % 251) as u8));
        } else {
            encode_error_reply(mode, request.cookie, &in_flight, EIO, "", &mut reply);
        }
        if s.write_all(&reply).is_err() {
            return;
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&chunking, data)) = data.split_first() else {
        return;
    };
    let Some((&variant, bytes)) = data.split_first() else {
        return;
    };
    let gw = gateway(variant & 1 == 1);
    let Ok(mut tcp) = TcpStream::connect(gw.addr) else {
        return;
    };
    let _ = tcp.set_read_timeout(Some(Duration::from_millis(500)));
    let _ = tcp.set_nodelay(true);
    let mut greeting = [0u8; 18];
    if tcp.read_exact(&mut greeting).is_err() {
        return;
    }
    let mut starttls = 3u32.to_be_bytes().to_vec();
    starttls.extend_from_slice(&IHAVEOPT.to_be_bytes());
    starttls.extend_from_slice(&OPT_STARTTLS.to_be_bytes());
    starttls.extend_from_slice(&0u32.to_be_bytes());
    if tcp.write_all(&starttls).is_err() || tcp.read_exact(&mut [0u8; 20]).is_err() {
        return;
    }
    let name = ServerName::try_from("localhost").expect("name");
    let conn = rustls::ClientConnection::new(gw.client.clone(), name).expect("client");
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    // The bytes go out in pieces of 1 to 256 bytes, as the first byte says.
    let piece = usize::from(chunking) + 1;
    for part in bytes.chunks(piece) {
        if tls.write_all(part).and_then(|()| tls.flush()).is_err() {
            return;
        }
    }
    tls.conn.send_close_notify();
    let _ = tls.flush();
    let _ = tls.sock.shutdown(std::net::Shutdown::Write);
    // Whatever comes back, until the gateway closes (or the read times
    // out: a connection the gateway keeps would show up as a leak below).
    let mut sink = [0u8; 16384];
    while let Ok(1..) = tls.read(&mut sink) {}
});
