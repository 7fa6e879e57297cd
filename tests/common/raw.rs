//! A raw NBD client over a std TCP socket and rustls, for driving the
//! gateway into every framing and every error path byte by byte.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use nbdgw::proto::consts::*;
use nbdgw::proto::transmission::ReplyMode;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

pub enum Stream {
    Plain(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
    Gone,
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
            Stream::Gone => Err(io::ErrorKind::NotConnected.into()),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
            Stream::Gone => Err(io::ErrorKind::NotConnected.into()),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Tls(s) => s.flush(),
            Stream::Gone => Ok(()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptReply {
    pub option: u32,
    pub reply_type: u32,
    pub data: Vec<u8>,
}

impl OptReply {
    pub fn message(&self) -> String {
        String::from_utf8_lossy(&self.data).into_owned()
    }
}

/// One reply message: a simple reply or a chunk.
#[derive(Debug, Clone)]
pub struct Chunk {
    pub cookie: u64,
    pub flags: u16,
    pub kind: u16,
    /// For simple replies: the error field.
    pub error: u32,
    pub offset: u64,
    pub payload: Vec<u8>,
    pub simple: bool,
}

impl Chunk {
    pub fn done(&self) -> bool {
        self.simple || self.flags & REPLY_FLAG_DONE != 0
    }

    /// The error this message carries, in any framing.
    pub fn error_code(&self) -> u32 {
        if self.simple {
            self.error
        } else if self.kind & 0x8000 != 0 {
            u32::from_be_bytes(self.payload[..4].try_into().unwrap())
        } else {
            0
        }
    }

    pub fn error_message(&self) -> String {
        if self.simple || self.kind & 0x8000 == 0 {
            return String::new();
        }
        let len = u16::from_be_bytes([self.payload[4], self.payload[5]]) as usize;
        String::from_utf8_lossy(&self.payload[6..6 + len]).into_owned()
    }
}

pub struct RawClient {
    pub stream: Stream,
    pub mode: ReplyMode,
}

pub fn tls_config(certs: &Path) -> Arc<rustls::ClientConfig> {
    client_tls(&certs.join("ca-cert.pem"), None, &[])
}

/// A client configuration trusting `ca`, presenting `identity` (certificate
/// and key PEM files) if given, limited to `versions` if not empty.
pub fn client_tls(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(nbdgw::tls::provider());
    let builder = if versions.is_empty() {
        builder.with_safe_default_protocol_versions()
    } else {
        builder.with_protocol_versions(versions)
    }
    .unwrap()
    .with_root_certificates(roots);
    Arc::new(match identity {
        Some((cert, key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .unwrap()
                .map(Result::unwrap)
                .collect();
            let key = rustls::pki_types::PrivateKeyDer::from_pem_file(key).unwrap();
            builder.with_client_auth_cert(chain, key).unwrap()
        }
        None => builder.with_no_client_auth(),
    })
}

impl RawClient {
    pub fn connect(addr: SocketAddr) -> Self {
        let tcp = TcpStream::connect(addr).expect("connect to gateway");
        tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        tcp.set_nodelay(true).unwrap();
        RawClient {
            stream: Stream::Plain(tcp),
            mode: ReplyMode::Simple,
        }
    }

    /// Reads the greeting and returns its handshake flags.
    pub fn greeting(&mut self) -> u16 {
        let mut g = [0u8; 18];
        self.stream.read_exact(&mut g).expect("greeting");
        assert_eq!(&g[0..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        u16::from_be_bytes([g[16], g[17]])
    }

    /// Connect, greeting, client flags with fixed newstyle and no zeroes.
    pub fn handshake(addr: SocketAddr) -> Self {
        let mut c = Self::connect(addr);
        assert_eq!(c.greeting(), 3);
        c.send(&3u32.to_be_bytes());
        c
    }

    /// Handshake, STARTTLS, TLS.
    pub fn tls(addr: SocketAddr, certs: &Path) -> Self {
        let mut c = Self::handshake(addr);
        c.starttls(certs);
        c
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("send");
        self.stream.flush().expect("flush");
    }

    pub fn send_option(&mut self, option: u32, data: &[u8]) {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.send(&b);
    }

    pub fn read_option_reply(&mut self) -> OptReply {
        self.try_read_option_reply().expect("option reply")
    }

    pub fn try_read_option_reply(&mut self) -> io::Result<OptReply> {
        let mut h = [0u8; 20];
        self.stream.read_exact(&mut h)?;
        assert_eq!(u64::from_be_bytes(h[0..8].try_into().unwrap()), REPLY_MAGIC);
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let mut data = vec![0u8; len];
        self.stream.read_exact(&mut data)?;
        Ok(OptReply {
            option: u32::from_be_bytes(h[8..12].try_into().unwrap()),
            reply_type: u32::from_be_bytes(h[12..16].try_into().unwrap()),
            data,
        })
    }

    /// Sends an option and collects its replies up to the final one.
    pub fn option(&mut self, option: u32, data: &[u8]) -> Vec<OptReply> {
        self.send_option(option, data);
        let mut replies = Vec::new();
        loop {
            let r = self.read_option_reply();
            assert_eq!(r.option, option, "reply to the wrong option");
            let last = r.reply_type == REP_ACK || r.reply_type & REP_FLAG_ERROR != 0;
            replies.push(r);
            if last {
                return replies;
            }
        }
    }

    pub fn starttls(&mut self, certs: &Path) {
        self.try_starttls(tls_config(certs)).expect("TLS handshake");
    }

    /// STARTTLS, then a TLS handshake that may fail (a refused client
    /// certificate, say): the error is returned, not a panic.
    pub fn try_starttls(&mut self, config: Arc<rustls::ClientConfig>) -> io::Result<()> {
        let r = self.option(OPT_STARTTLS, &[]);
        assert_eq!(
            r[0].reply_type,
            REP_ACK,
            "STARTTLS refused: {}",
            r[0].message()
        );
        let Stream::Plain(tcp) = std::mem::replace(&mut self.stream, Stream::Gone) else {
            panic!("TLS is already up")
        };
        let name = ServerName::try_from("localhost").unwrap().to_owned();
        let conn = rustls::ClientConnection::new(config, name).unwrap();
        let mut s = rustls::StreamOwned::new(conn, tcp);
        while s.conn.is_handshaking() {
            s.conn.complete_io(&mut s.sock)?;
        }
        // In TLS 1.3 the server judges the client's certificate after the
        // client considers the handshake done: a refusal arrives as an
        // alert on the first read, which callers testing refusals do.
        self.stream = Stream::Tls(Box::new(s));
        Ok(())
    }

    /// The server certificate the TLS handshake presented.
    pub fn server_cert(&self) -> Vec<u8> {
        match &self.stream {
            Stream::Tls(s) => s.conn.peer_certificates().unwrap()[0].to_vec(),
            _ => panic!("TLS is not up"),
        }
    }

    /// Negotiates the framing and selects the default export with GO.
    /// Returns the transmission flags.
    pub fn go(&mut self, mode: ReplyMode) -> u16 {
        match mode {
            ReplyMode::Simple => {}
            ReplyMode::Structured => {
                assert_eq!(
                    self.option(OPT_STRUCTURED_REPLY, &[])[0].reply_type,
                    REP_ACK
                )
            }
            ReplyMode::Extended => {
                assert_eq!(
                    self.option(OPT_EXTENDED_HEADERS, &[])[0].reply_type,
                    REP_ACK
                )
            }
        }
        let replies = self.option(OPT_GO, &go_data("", &[]));
        let last = replies.last().unwrap();
        assert_eq!(last.reply_type, REP_ACK, "GO failed: {:?}", last.message());
        self.mode = mode;
        replies
            .iter()
            .find(|r| r.reply_type == REP_INFO && r.data.len() == 12 && r.data[..2] == [0, 0])
            .map(|r| u16::from_be_bytes([r.data[10], r.data[11]]))
            .expect("GO without NBD_INFO_EXPORT")
    }

    pub fn request_bytes(
        &self,
        flags: u16,
        command: u16,
        cookie: u64,
        offset: u64,
        length: u64,
    ) -> Vec<u8> {
        let mut b = Vec::new();
        if self.mode == ReplyMode::Extended {
            b.extend_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
        } else {
            b.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        }
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&command.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        if self.mode == ReplyMode::Extended {
            b.extend_from_slice(&length.to_be_bytes());
        } else {
            b.extend_from_slice(&(length as u32).to_be_bytes());
        }
        b
    }

    pub fn send_request(
        &mut self,
        flags: u16,
        command: u16,
        cookie: u64,
        offset: u64,
        length: u64,
        payload: &[u8],
    ) {
        let mut b = self.request_bytes(flags, command, cookie, offset, length);
        b.extend_from_slice(payload);
        self.send(&b);
    }

    pub fn write(&mut self, cookie: u64, offset: u64, data: &[u8]) {
        let flags = if self.mode == ReplyMode::Extended {
            CMD_FLAG_PAYLOAD_LEN
        } else {
            0
        };
        self.send_request(flags, CMD_WRITE, cookie, offset, data.len() as u64, data);
    }

    /// Reads one reply message. `read_len` is the data length a simple
    /// reply to a successful read carries.
    pub fn read_chunk(&mut self, read_len: usize) -> Chunk {
        let mut magic = [0u8; 4];
        self.stream.read_exact(&mut magic).expect("reply magic");
        let magic = u32::from_be_bytes(magic);
        match magic {
            SIMPLE_REPLY_MAGIC => {
                let mut h = [0u8; 12];
                self.stream.read_exact(&mut h).expect("simple reply");
                let error = u32::from_be_bytes(h[0..4].try_into().unwrap());
                let mut payload = Vec::new();
                if error == 0 && self.mode == ReplyMode::Simple {
                    payload.resize(read_len, 0);
                    self.stream
                        .read_exact(&mut payload)
                        .expect("simple reply data");
                }
                Chunk {
                    cookie: u64::from_be_bytes(h[4..12].try_into().unwrap()),
                    flags: 0,
                    kind: 0,
                    error,
                    offset: 0,
                    payload,
                    simple: true,
                }
            }
            STRUCTURED_REPLY_MAGIC | EXTENDED_REPLY_MAGIC => {
                let ext = magic == EXTENDED_REPLY_MAGIC;
                let mut h = vec![0u8; if ext { 28 } else { 16 }];
                self.stream.read_exact(&mut h).expect("chunk header");
                let len = if ext {
                    u64::from_be_bytes(h[20..28].try_into().unwrap()) as usize
                } else {
                    u32::from_be_bytes(h[12..16].try_into().unwrap()) as usize
                };
                let mut payload = vec![0u8; len];
                self.stream.read_exact(&mut payload).expect("chunk payload");
                Chunk {
                    cookie: u64::from_be_bytes(h[4..12].try_into().unwrap()),
                    flags: u16::from_be_bytes([h[0], h[1]]),
                    kind: u16::from_be_bytes([h[2], h[3]]),
                    error: 0,
                    offset: if ext {
                        u64::from_be_bytes(h[12..20].try_into().unwrap())
                    } else {
                        0
                    },
                    payload,
                    simple: false,
                }
            }
            other => panic!("bad reply magic {other:#x}"),
        }
    }

    /// All messages of one reply, up to the one marked done.
    pub fn read_reply(&mut self, read_len: usize) -> Vec<Chunk> {
        let mut chunks = Vec::new();
        loop {
            let c = self.read_chunk(read_len);
            let done = c.done();
            chunks.push(c);
            if done {
                return chunks;
            }
        }
    }

    /// Reads `len` bytes at `offset` and returns the data, whatever the framing.
    pub fn read(&mut self, cookie: u64, offset: u64, len: usize) -> Vec<u8> {
        self.send_request(0, CMD_READ, cookie, offset, len as u64, &[]);
        let chunks = self.read_reply(len);
        assemble(&chunks, cookie, offset, len)
    }

    /// Expects the server to close: EOF or an error, no further data.
    pub fn expect_closed(&mut self) {
        let mut buf = [0u8; 256];
        match self.stream.read(&mut buf) {
            Ok(0) => {}
            Ok(n) => panic!(
                "expected the connection to close, got {n} bytes: {:02x?}",
                &buf[..n]
            ),
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::TimedOut =>
            {
                panic!("connection still open after the read timeout")
            }
            Err(_) => {}
        }
    }

    /// Sends NBD_CMD_DISC and expects a clean TLS close.
    pub fn disconnect(&mut self) {
        self.send_request(0, CMD_DISC, 0, 0, 0, &[]);
        let mut buf = [0u8; 1];
        assert_eq!(self.stream.read(&mut buf).expect("clean close_notify"), 0);
    }
}

/// Reassembles read data from a reply's messages, checking cookies.
pub fn assemble(chunks: &[Chunk], cookie: u64, offset: u64, len: usize) -> Vec<u8> {
    let mut data = vec![0u8; len];
    for c in chunks {
        assert_eq!(c.cookie, cookie);
        assert_eq!(c.error_code(), 0, "read failed: {}", c.error_message());
        if c.simple {
            if !c.payload.is_empty() {
                data.copy_from_slice(&c.payload);
            }
            continue;
        }
        match c.kind {
            REPLY_TYPE_OFFSET_DATA => {
                let at = u64::from_be_bytes(c.payload[..8].try_into().unwrap()) - offset;
                let at = at as usize;
                data[at..at + c.payload.len() - 8].copy_from_slice(&c.payload[8..]);
            }
            2 => {} // OFFSET_HOLE: zeroes, already there
            REPLY_TYPE_NONE => {}
            other => panic!("unexpected chunk type {other}"),
        }
    }
    data
}

/// INFO/GO option data: name, then info requests.
pub fn go_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

/// LIST/SET_META_CONTEXT option data.
pub fn meta_context_data(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut d = (export.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(export.as_bytes());
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        d.extend_from_slice(&(q.len() as u32).to_be_bytes());
        d.extend_from_slice(q.as_bytes());
    }
    d
}
