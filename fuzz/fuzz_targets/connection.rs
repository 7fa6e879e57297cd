//! A whole connection: arbitrary bytes, in arbitrary chunks, sent by a
//! client after STARTTLS and TLS (options, then requests, in whatever
//! order the input makes) to a running gateway in this process, in front
//! of a scripted upstream. Nothing may panic or hang the gateway.
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
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

struct Gateway {
    addr: SocketAddr,
    client: Arc<rustls::ClientConfig>,
}

fn gateway() -> &'static Gateway {
    static GATEWAY: OnceLock<Gateway> = OnceLock::new();
    GATEWAY.get_or_init(|| {
        // libFuzzer's main, unlike Rust's, leaves SIGPIPE fatal: a write
        // to a connection the gateway closed would end the run.
        // SAFETY: setting a signal's disposition to SIG_IGN, before any
        // other thread of ours exists, touches no Rust state.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
        let dir = std::env::temp_dir().join(format!("nbdgw-fuzz-{}", std::process::id()));
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
        config.stall_timeout = Some(Duration::from_secs(1));
        config.max_payload = 1 << 20;
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
    })
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

/// A scripted upstream: options are answered (structured replies and GO
/// accepted, the rest unsupported), then every request gets an EIO simple
/// reply, which frames in every compact mode.
fn upstream(mut s: UnixStream) {
    let mut greeting = NBDMAGIC.to_be_bytes().to_vec();
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    if s.write_all(&greeting).is_err() || s.read_exact(&mut [0u8; 4]).is_err() {
        return;
    }
    loop {
        let mut header = [0u8; 16];
        if s.read_exact(&mut header).is_err() {
            return;
        }
        let option = u32::from_be_bytes([header[8], header[9], header[10], header[11]]);
        let len = u32::from_be_bytes([header[12], header[13], header[14], header[15]]);
        if std::io::copy(&mut (&mut s).take(len.into()), &mut std::io::sink()).is_err() {
            return;
        }
        let mut out = Vec::new();
        let mut reply = |kind: u32, body: &[u8]| {
            out.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
            out.extend_from_slice(&option.to_be_bytes());
            out.extend_from_slice(&kind.to_be_bytes());
            out.extend_from_slice(&(body.len() as u32).to_be_bytes());
            out.extend_from_slice(body);
        };
        let go = option == OPT_GO;
        match option {
            OPT_STRUCTURED_REPLY | OPT_ABORT => reply(REP_ACK, &[]),
            OPT_GO | OPT_INFO => {
                let mut info = INFO_EXPORT.to_be_bytes().to_vec();
                info.extend_from_slice(&(1u64 << 20).to_be_bytes());
                info.extend_from_slice(&TFLAG_HAS_FLAGS.to_be_bytes());
                reply(REP_INFO, &info);
                reply(REP_ACK, &[]);
            }
            _ => reply(REP_ERR_UNSUP, &[]),
        }
        if s.write_all(&out).is_err() {
            return;
        }
        if go {
            break;
        }
    }
    loop {
        let mut request = [0u8; 28];
        if s.read_exact(&mut request).is_err() {
            return;
        }
        let command = u16::from_be_bytes([request[6], request[7]]);
        let length = u32::from_be_bytes([request[24], request[25], request[26], request[27]]);
        if command == CMD_DISC {
            return;
        }
        if command == CMD_WRITE
            && std::io::copy(&mut (&mut s).take(length.into()), &mut std::io::sink()).is_err()
        {
            return;
        }
        let mut reply = SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
        reply.extend_from_slice(&EIO.to_be_bytes());
        reply.extend_from_slice(&request[8..16]);
        if s.write_all(&reply).is_err() {
            return;
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&chunking, bytes)) = data.split_first() else {
        return;
    };
    let gw = gateway();
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
