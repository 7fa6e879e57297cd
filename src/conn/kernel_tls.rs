//! Handing an established session from rustls to kernel TLS, and the
//! stream that reads and writes through the kernel afterwards. What needs
//! no socket (the probe's verdict, the key layout, record boundaries) is
//! in `crate::tls::kernel`.
//!
//! The hand-over must leave the socket at a record boundary: rustls
//! decrypts every byte it has read, and the kernel starts at the next
//! record header. So while a hand-over is possible, rustls reads through
//! `RecordAligned`, which never reads past the record it is in.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use std::sync::Arc;

use nix::sys::socket::TlsGetRecordType;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, Interest, ReadBuf};
use tokio::net::TcpStream;
use tokio_util::either::Either;
use tracing::{debug, info};

use super::error::ConnError;
use crate::config::Config;
use crate::tls::handover::RecordTail;
use crate::tls::kernel::{self, Direction, KernelCiphers, KernelTlsError, RecordCursor};
use crate::tls::key_update::{
    self, KeyUpdateError, KeyUpdateRequest, Keys, SecretLog, TrafficSecrets, HANDSHAKE_RECORD,
    KEY_UPDATE_NOT_REQUESTED, MAX_KEY_UPDATES_WITHOUT_DATA, MAX_WARNING_ALERTS,
};

/// The client socket before TLS; its buffer carries what the client sent
/// behind STARTTLS into the handshake.
pub type ClientIo = super::buffered::Buffered<TcpStream>;
/// What rustls reads the handshake through: all it can get when the
/// session stays in rustls, exactly up to record boundaries when the
/// kernel may take it over.
/// Under rustls the socket is read through `RecordTail`, which keeps the
/// record rustls holds in part when a hand-over may take the session
/// (a pass-through otherwise).
pub type TlsIo = Either<RecordTail<ClientIo>, RecordAligned>;
pub type ClientTls = tokio_rustls::server::TlsStream<TlsIo>;
/// After the handshake: rustls, or the kernel's record layer.
pub type ClientStream = Either<ClientTls, KernelTls>;

/// Bytes read before a stream changed hands (plaintext phase to TLS,
/// rustls to the kernel), served before anything more is read.
#[derive(Default)]
pub(super) struct Carried {
    pub(super) bytes: Vec<u8>,
    pub(super) at: usize,
}

impl Carried {
    pub(super) fn new(bytes: Vec<u8>) -> Self {
        Carried { bytes, at: 0 }
    }

    /// What is left, consumed (a hand-over carries it on).
    pub(super) fn into_rest(self) -> Vec<u8> {
        let Carried { mut bytes, at } = self;
        bytes.drain(..at);
        bytes
    }

    /// The next at most `limit` carried bytes, consumed; empty once all
    /// are (the buffer is freed then).
    fn take(&mut self, limit: usize) -> &[u8] {
        if self.at == self.bytes.len() {
            if !self.bytes.is_empty() {
                *self = Carried::default();
            }
            return &[];
        }
        let start = self.at;
        self.at += limit.min(self.bytes.len() - start);
        &self.bytes[start..self.at]
    }
}

/// The client socket under rustls while a hand-over to the kernel is still
/// possible. Reads stop at the end of each record; with `stop` set, a read
/// at a boundary returns end-of-file, which is how the drain knows rustls
/// holds no partial record.
pub struct RecordAligned {
    /// What the plaintext phase had read ahead (the start of the
    /// ClientHello, if any).
    carried: Carried,
    tcp: TcpStream,
    cursor: RecordCursor,
    /// Cleared once the session is known to stay in rustls.
    aligned: bool,
    stop: bool,
    /// This connection's traffic secrets, which a key update needs.
    secrets: Arc<SecretLog>,
    /// It stays in rustls, read record by record, and may be handed to
    /// a successor.
    handable: bool,
}

impl RecordAligned {
    pub fn new(io: ClientIo, secrets: Arc<SecretLog>) -> Self {
        RecordAligned {
            carried: Carried::new(io.buffer().to_vec()),
            tcp: io.into_inner(),
            cursor: RecordCursor::default(),
            aligned: true,
            stop: false,
            secrets,
            handable: false,
        }
    }

    /// A rustls session read through here may be handed over: it stayed
    /// in rustls with reads record by record.
    pub fn is_handable(&self) -> bool {
        self.handable
    }

    /// rustls holds no record in part: every byte read was a whole
    /// record's (the cursor is between records).
    pub fn at_boundary(&self) -> bool {
        self.cursor.at_boundary()
    }

    pub fn secrets(&self) -> &Arc<SecretLog> {
        &self.secrets
    }

    /// The socket, and the bytes read ahead of rustls (before the
    /// handshake) that it has not been given.
    pub fn into_parts(self) -> (TcpStream, Vec<u8>) {
        (self.tcp, self.carried.into_rest())
    }
}

impl AsyncRead for RecordAligned {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.stop && this.cursor.at_boundary() {
            return Poll::Ready(Ok(()));
        }
        let mut limit = buf.remaining();
        if this.aligned {
            limit = limit.min(this.cursor.read_limit());
        }
        let carried = this.carried.take(limit);
        if !carried.is_empty() {
            buf.put_slice(carried);
            this.cursor.advance(carried);
            return Poll::Ready(Ok(()));
        }
        // At most one record (16 KiB and a little) at a time, and only
        // before the hand-over: zeroing it costs little beside the syscall.
        let room = buf.initialize_unfilled_to(limit);
        let mut limited = ReadBuf::new(room);
        ready!(Pin::new(&mut this.tcp).poll_read(cx, &mut limited))?;
        let n = limited.filled().len();
        if this.aligned {
            this.cursor.advance(&room[..n]);
        }
        buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

// Writes go straight to the socket: rustls writes ciphertext through
// `RecordAligned` until the hand-over.
crate::write_through::write_through!([] RecordAligned, tcp);

/// The socket rustls should read the handshake through, and the TLS
/// configuration to read it with. Where the kernel may take the session,
/// the configuration is the current one with a key log of this
/// connection's own, so that the traffic secrets reach the hand-over and
/// no other connection (a clone per handshake: a few Arcs and Vecs,
/// beside the handshake's signatures).
pub fn tls_io(io: ClientIo, config: &Config) -> (TlsIo, Arc<rustls::ServerConfig>) {
    let current = config.tls.current();
    match config.kernel_tls {
        Some(_) => {
            let secrets = SecretLog::new();
            let mut own = (*current).clone();
            own.key_log = secrets.clone();
            (
                Either::Right(RecordAligned::new(io, secrets)),
                Arc::new(own),
            )
        }
        None if config.handover.is_some() => {
            // A hand-over takes TLS 1.3 traffic secrets from this
            // connection's own key log, as kernel TLS does.
            let secrets = SecretLog::new();
            let mut own = (*current).clone();
            own.key_log = secrets.clone();
            let io = RecordTail::new(io).with_secrets(secrets);
            (Either::Left(io), Arc::new(own))
        }
        None => (Either::Left(RecordTail::off(io)), current),
    }
}

/// Moves a TLS 1.3 session to the kernel if it can go; otherwise it stays
/// in rustls. An error means the keys had already left rustls and the
/// connection cannot go on.
pub async fn hand_over(mut tls: ClientTls, config: &Config) -> Result<ClientStream, ConnError> {
    let Some(ciphers) = config.kernel_tls else {
        if config.kernel_tls_no_rekey && is_tls13(tls.get_ref().1) {
            config.metrics.kernel_tls_no_rekey.inc();
        }
        return Ok(Either::Left(tls));
    };
    let attached = match tls.get_mut() {
        (Either::Right(aligned), conn) => {
            let attached = eligible(conn, &ciphers) && attach_ulp(aligned);
            if !attached && config.handover.is_some() {
                // Stays in rustls, and may be handed to a successor:
                // reads stay record by record, so that a quiet point can
                // tell rustls holds no record in part, and the secrets
                // are kept for the hand-over (as `RecordTail` keeps them).
                aligned.handable = true;
            } else if !attached {
                // Stays in rustls: no more boundary-sized reads, and no
                // copy of its secrets kept for the session's life.
                aligned.aligned = false;
                aligned.secrets.discard();
            }
            attached
        }
        (Either::Left(_), _) => false,
    };
    if !attached {
        return Ok(Either::Left(tls));
    }
    let key_limit = key_limit(tls.get_ref().1, config.ktls_key_limit);
    // Only what a hand-over offers a successor (`Offer`), and only where
    // one may come: rustls, which knows it, is gone after this.
    let peer = config
        .handover
        .is_some()
        .then(|| TlsPeer::of(tls.get_ref().1));
    let (drained, tcp, secrets) = drain_and_extract(tls).await?;
    config.metrics.kernel_tls_sessions.inc();
    info!(
        early_bytes = drained.early.len(),
        client_closed = drained.closed,
        "TLS handed to the kernel (kTLS)"
    );
    let mut kernel = KernelTls::new(tcp, drained, secrets, key_limit, config.metrics.clone());
    kernel.peer = peer;
    Ok(Either::Right(kernel))
}

/// What a successor judges a kernel TLS session by, kept from rustls's
/// handshake (the offer of a rustls session reads it from rustls).
#[derive(Debug, Clone, Default)]
pub struct TlsPeer {
    /// The client certificate chain, leaf first (empty: anonymous).
    pub chain: Vec<Vec<u8>>,
    pub sni: Option<String>,
    /// The negotiated suite's IANA number.
    pub suite: u16,
    /// The key exchange group's IANA number (0: not known), which a
    /// successor with narrower `--tls-groups` declines: rustls, which
    /// knows it, is gone once the kernel has the session.
    pub group: u16,
}

impl TlsPeer {
    /// Read from rustls: at the hand-over to the kernel, or for the offer
    /// of a session that stays in rustls.
    pub(super) fn of(conn: &rustls::ServerConnection) -> Self {
        TlsPeer {
            chain: conn
                .peer_certificates()
                .unwrap_or_default()
                .iter()
                .map(|c| c.to_vec())
                .collect(),
            sni: conn.server_name().map(str::to_string),
            suite: conn
                .negotiated_cipher_suite()
                .map_or(0, |s| u16::from(s.suite())),
            group: conn
                .negotiated_key_exchange_group()
                .map_or(0, |g| u16::from(g.name())),
        }
    }
}

/// Records nbdgw sends under one key before it updates its own: the
/// suite's confidentiality limit (RFC 8446 §5.5, as rustls states it per
/// suite) halved, as the count is an upper bound; or the test's limit.
fn key_limit(conn: &rustls::ServerConnection, configured: Option<u64>) -> u64 {
    let suite = conn.negotiated_cipher_suite().map(|s| s.suite());
    key_limit_of(suite, configured)
}

/// As `key_limit`, from the suite's number (a session handed over: the
/// successor's own `--ktls-key-limit` applies).
pub(super) fn key_limit_of(suite: Option<rustls::CipherSuite>, configured: Option<u64>) -> u64 {
    let suite_limit = crate::tls::provider()
        .cipher_suites
        .iter()
        .find(|s| Some(s.suite()) == suite)
        .and_then(|s| s.tls13())
        .map_or(1 << 23, |s| s.common.confidentiality_limit);
    configured.unwrap_or(suite_limit / 2).max(1)
}

/// The ULP goes on first: until keys are set it changes nothing, so a
/// kernel that refuses it leaves the session whole in rustls.
fn attach_ulp(aligned: &RecordAligned) -> bool {
    match kernel::attach_ulp(&aligned.tcp) {
        Ok(()) => true,
        Err(e) => {
            debug!(error = %e, "TLS stays in rustls: the kernel refused the tls ULP");
            false
        }
    }
}

/// Past this point the keys leave rustls: any failure ends the connection.
/// The logged traffic secrets are used only if they give the very keys
/// rustls extracted.
async fn drain_and_extract(
    mut tls: ClientTls,
) -> Result<(Drained, TcpStream, TrafficSecrets), KernelTlsError> {
    let drained = drain(&mut tls).await.map_err(KernelTlsError::Drain)?;
    // A KeyUpdate asking for one that rustls read in the drain left
    // rustls's own queued, to go before its next record: a write of
    // nothing sends it now, under the key the client expects it under.
    if let Err(e) = std::io::Write::write(&mut tls.get_mut().1.writer(), &[]) {
        return Err(KernelTlsError::Drain(e));
    }
    tls.flush().await.map_err(KernelTlsError::Drain)?;
    let (io, conn) = tls.into_inner();
    let Either::Right(aligned) = io else {
        return Err(KernelTlsError::NotAligned);
    };
    #[allow(deprecated)] // the kernel-connection API is for unbuffered connections only
    let extracted = conn
        .dangerous_extract_secrets()
        .map_err(KernelTlsError::Secrets)?;
    let ((tx_seq, tx), (rx_seq, rx)) = (extracted.tx, extracted.rx);
    let tx = Keys::from_extracted(&tx).ok_or(KernelTlsError::Cipher)?;
    let rx = Keys::from_extracted(&rx).ok_or(KernelTlsError::Cipher)?;
    let secrets = TrafficSecrets::new(&aligned.secrets, &rx, &tx)?;
    kernel::set_keys(&aligned.tcp, Direction::Tx, tx_seq, &tx)?;
    kernel::set_keys(&aligned.tcp, Direction::Rx, rx_seq, &rx)?;
    Ok((drained, aligned.tcp, secrets))
}

fn is_tls13(conn: &rustls::ServerConnection) -> bool {
    conn.protocol_version() == Some(rustls::ProtocolVersion::TLSv1_3)
}

fn eligible(conn: &rustls::ServerConnection, ciphers: &KernelCiphers) -> bool {
    use rustls::CipherSuite::*;
    let tls13 = is_tls13(conn);
    let taken = conn
        .negotiated_cipher_suite()
        .is_some_and(|suite| match suite.suite() {
            TLS13_AES_128_GCM_SHA256 => ciphers.aes_128_gcm,
            TLS13_AES_256_GCM_SHA384 => ciphers.aes_256_gcm,
            TLS13_CHACHA20_POLY1305_SHA256 => ciphers.chacha20_poly1305,
            _ => false,
        });
    tls13 && taken
}

/// What the drain found in rustls before the hand-over.
#[derive(Debug, Default)]
struct Drained {
    /// Plaintext that came with the handshake.
    early: Vec<u8>,
    /// The client's close_notify came too: nothing more is to be read.
    closed: bool,
}

/// Sends what rustls still holds, then reads until the socket is at a
/// record boundary, keeping the plaintext that came with the handshake
/// (a client may send its first option right behind its Finished) and
/// whether the client's close_notify did.
async fn drain(tls: &mut ClientTls) -> io::Result<Drained> {
    tls.flush().await?;
    if let (Either::Right(aligned), _) = tls.get_mut() {
        aligned.stop = true;
    }
    let mut drained = Drained::default();
    let mut chunk = [0u8; 4096];
    loop {
        match tls.read(&mut chunk).await {
            // rustls reads its end only from a close_notify.
            Ok(0) => {
                drained.closed = true;
                return Ok(drained);
            }
            Ok(n) => drained.early.extend_from_slice(&chunk[..n]),
            // rustls reports the boundary as a close without close_notify.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(drained),
            Err(e) => return Err(e),
        }
    }
}

/// Linux reports a record that is not application data (an alert, a
/// handshake message) as EIO to a plain read; recvmsg tells its type.
const EIO: i32 = nix::libc::EIO;
/// What a read returns while the kernel waits for a new receive key.
const EKEYEXPIRED: i32 = nix::libc::EKEYEXPIRED;
const ALERT_CLOSE_NOTIFY: u8 = 0;
const ALERT_UNEXPECTED_MESSAGE: u8 = 10;
const ALERT_ILLEGAL_PARAMETER: u8 = 47;
const ALERT_DECODE_ERROR: u8 = 50;
const ALERT_USER_CANCELED: u8 = 90;
const ALERT_LEVEL_FATAL: u8 = 2;

/// What nbdgw sends as the session ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Goodbye {
    CloseNotify,
    /// A fatal alert for the client's protocol error (RFC 8446 §6.2).
    Alert(u8),
    /// Nothing: the client ended the session with an error alert.
    Nothing,
}
/// The largest plaintext of one record: writes are counted in records of
/// this size at most, plus two.
const MAX_RECORD_PLAINTEXT: usize = 16_384;

/// The client socket once the kernel does the record layer. Application
/// data reads and writes are plain socket calls. Of the other records,
/// close_notify reads as end-of-file, a KeyUpdate is followed (the kernel
/// gets the next receive key, and nbdgw updates its own sending keys
/// before its next record when asked to), and anything else ends the
/// session with the reason. nbdgw also updates its own keys after
/// `key_limit` records.
pub struct KernelTls {
    pub(super) tcp: TcpStream,
    /// Plaintext rustls had decrypted before the hand-over.
    pub(super) early: Carried,
    pub(super) read_closed: bool,
    pub(super) said_goodbye: bool,
    pub(super) secrets: TrafficSecrets,
    /// An upper bound of the records sent under the current key.
    pub(super) tx_records: u64,
    pub(super) key_limit: u64,
    /// nbdgw's KeyUpdate goes before its next record.
    pub(super) update_tx: bool,
    /// Key updates followed: the client's, nbdgw's own.
    pub(super) updates: UpdateCount,
    /// The client's KeyUpdates since it last sent application data, and
    /// its warning alerts: both capped, as rustls caps them.
    pub(super) updates_without_data: u32,
    pub(super) warning_alerts: u32,
    /// How the session ends on nbdgw's side.
    pub(super) goodbye: Goodbye,
    pub(super) metrics: Arc<crate::metrics::Metrics>,
    /// Who the client is, for a hand-over's offer (`None`: no hand-over
    /// may come).
    pub(super) peer: Option<TlsPeer>,
    /// A socket handed over, not read yet here (see `first_read`).
    pub(super) fresh: bool,
}

/// Key updates followed: the client's, nbdgw's own. Its own type, so
/// that a hand-over can take `KernelTls` apart.
#[derive(Default)]
pub(super) struct UpdateCount(pub(super) [u64; 2]);

impl Drop for UpdateCount {
    /// One line per session that had key updates, when it ends (here, or
    /// in a successor, which carries the count on): each is rare
    /// (millions of records apart), so the count is what is worth
    /// keeping.
    fn drop(&mut self) {
        let [rx, tx] = self.0;
        if rx + tx > 0 {
            info!(
                rx_key_updates = rx,
                tx_key_updates = tx,
                "kernel TLS session ends after key updates"
            );
        }
    }
}

impl KernelTls {
    fn new(
        tcp: TcpStream,
        drained: Drained,
        secrets: TrafficSecrets,
        key_limit: u64,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> Self {
        KernelTls {
            tcp,
            early: Carried::new(drained.early),
            read_closed: drained.closed,
            said_goodbye: false,
            secrets,
            tx_records: 0,
            key_limit,
            update_tx: false,
            updates: UpdateCount::default(),
            updates_without_data: 0,
            warning_alerts: 0,
            goodbye: Goodbye::CloseNotify,
            metrics,
            peer: None,
            fresh: false,
        }
    }

    /// Reads the record that made the plain read fail.
    fn control_record(&mut self) -> io::Result<()> {
        let tcp = &self.tcp;
        // Every record nbdgw takes is shorter; a longer one is refused
        // whole, whatever of it was read.
        let mut data = [0u8; 64];
        // Straight to the socket, not through tokio's readiness (which a
        // handed-over socket's first read does not have): a WouldBlock
        // here sends the caller back to `poll_read`, whose own read then
        // clears the readiness and waits.
        let (kind, len) = kernel::recv_record(std::os::fd::AsFd::as_fd(tcp), &mut data)
            .map_err(io::Error::from)?;
        let record = &data[..len.min(data.len())];
        match kind {
            Some(TlsGetRecordType::Alert) => self.alert(record),
            Some(TlsGetRecordType::Handshake) => self.key_update(record),
            other => Err(self.fatal(
                ALERT_UNEXPECTED_MESSAGE,
                format!("client sent a TLS record kernel TLS does not handle: {other:?}"),
            )),
        }
    }

    /// TLS 1.3 (RFC 8446 §6): close_notify ends the client's side,
    /// user_canceled announces one, and every other alert is an error
    /// whatever its level (after which nbdgw sends nothing more).
    fn alert(&mut self, record: &[u8]) -> io::Result<()> {
        match *record {
            [_, ALERT_CLOSE_NOTIFY] => {
                self.read_closed = true;
                Ok(())
            }
            [_, ALERT_USER_CANCELED] if self.warning_alerts < MAX_WARNING_ALERTS => {
                self.warning_alerts += 1;
                Ok(())
            }
            [_, ALERT_USER_CANCELED] => Err(self.fatal(
                ALERT_UNEXPECTED_MESSAGE,
                format!("client sent more than {MAX_WARNING_ALERTS} warning alerts"),
            )),
            [level, description] => {
                self.goodbye = Goodbye::Nothing;
                Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    format!("client sent TLS alert {description} (level {level})"),
                ))
            }
            _ => Err(self.fatal(
                ALERT_DECODE_ERROR,
                format!(
                    "client sent a malformed alert record ({} bytes)",
                    record.len()
                ),
            )),
        }
    }

    /// A protocol error of the client's: the session ends with the alert
    /// RFC 8446 names for it instead of close_notify.
    fn fatal(&mut self, alert: u8, why: String) -> io::Error {
        self.goodbye = Goodbye::Alert(alert);
        io::Error::new(io::ErrorKind::InvalidData, why)
    }

    /// The client's KeyUpdate: the kernel (which holds back what follows
    /// until then) gets the next receive key; asked to, nbdgw updates its
    /// own keys before its next record (RFC 8446 §4.6.3).
    fn key_update(&mut self, record: &[u8]) -> io::Result<()> {
        let request = match key_update::parse_key_update(record) {
            Ok(request) => request,
            Err(e @ KeyUpdateError::IllegalRequest(_)) => {
                return Err(self.fatal(ALERT_ILLEGAL_PARAMETER, e.to_string()))
            }
            Err(e) => return Err(self.fatal(ALERT_UNEXPECTED_MESSAGE, e.to_string())),
        };
        if self.updates_without_data >= MAX_KEY_UPDATES_WITHOUT_DATA {
            return Err(self.fatal(
                ALERT_UNEXPECTED_MESSAGE,
                format!(
                    "client sent more than {MAX_KEY_UPDATES_WITHOUT_DATA} KeyUpdates without application data"
                ),
            ));
        }
        self.updates_without_data += 1;
        let keys = self.secrets.next_rx();
        kernel::set_keys(&self.tcp, Direction::Rx, 0, &keys).map_err(io::Error::other)?;
        self.metrics.key_update(Direction::Rx.label());
        self.updates.0[0] += 1;
        if request == KeyUpdateRequest::Requested {
            self.update_tx = true;
        }
        debug!(?request, "followed the client's TLS key update");
        Ok(())
    }

    /// Sends nbdgw's KeyUpdate and moves the kernel to the next sending
    /// key, if one is due: asked for by the client or at the key limit.
    pub(super) fn poll_update_tx(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.update_tx {
            ready!(self.tcp.poll_write_ready(cx))?;
            let tcp = &self.tcp;
            match tcp.try_io(Interest::WRITABLE, || {
                kernel::send_record(
                    std::os::fd::AsFd::as_fd(tcp),
                    HANDSHAKE_RECORD,
                    &KEY_UPDATE_NOT_REQUESTED,
                )
            }) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
            // The KeyUpdate went under the old key; all after it must go
            // under the new one, or the client cannot read on.
            let keys = self.secrets.next_tx();
            kernel::set_keys(&self.tcp, Direction::Tx, 0, &keys).map_err(io::Error::other)?;
            self.metrics.key_update(Direction::Tx.label());
            self.updates.0[1] += 1;
            self.tx_records = 0;
            self.update_tx = false;
            debug!("updated nbdgw's own TLS keys");
        }
        Poll::Ready(Ok(()))
    }

    /// Accounts for `n` bytes the kernel took. The kernel closes a record
    /// when it is full and at the end of each write (nbdgw never sends
    /// MSG_MORE; TCP_CORK holds segments, not records), and a write the
    /// kernel took only in part leaves its last record open for the next
    /// one to close: so a write closes at most two records that are not
    /// full, and records ≤ 2 × writes + bytes / 16 KiB.
    fn sent(&mut self, n: usize) {
        let records = 2 + (n / MAX_RECORD_PLAINTEXT) as u64;
        self.tx_records = self.tx_records.saturating_add(records);
        if self.tx_records >= self.key_limit {
            self.update_tx = true;
        }
    }
}

impl AsyncRead for KernelTls {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let early = this.early.take(buf.remaining());
        if !early.is_empty() {
            buf.put_slice(early);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        loop {
            if this.read_closed || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            let read = match this.fresh {
                true => this.first_read(buf),
                false => ready!(Pin::new(&mut this.tcp).poll_read(cx, buf)),
            };
            match read {
                Err(e) if e.raw_os_error() == Some(EIO) => match this.control_record() {
                    Ok(()) => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    Err(e) => return Poll::Ready(Err(e)),
                },
                // Only from `first_read`: nothing there; wait as usual.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) if e.raw_os_error() == Some(EKEYEXPIRED) => {
                    return Poll::Ready(Err(io::Error::other(
                        "kernel TLS waits for a receive key after a key update nbdgw did not see",
                    )))
                }
                Ok(()) => {
                    if buf.filled().len() > before {
                        this.updates_without_data = 0;
                    }
                    return Poll::Ready(Ok(()));
                }
                other => return Poll::Ready(other),
            }
        }
    }
}

impl AsyncWrite for KernelTls {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_update_tx(cx))?;
        let n = ready!(Pin::new(&mut this.tcp).poll_write(cx, b))?;
        this.sent(n);
        Poll::Ready(Ok(n))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_update_tx(cx))?;
        let n = ready!(Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs))?;
        this.sent(n);
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    /// close_notify (or the alert for the client's protocol error, or
    /// nothing after the client's own error alert), then FIN, as rustls
    /// would.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let alert = match this.goodbye {
            Goodbye::CloseNotify => Some(kernel::CLOSE_NOTIFY),
            Goodbye::Alert(description) => Some([ALERT_LEVEL_FATAL, description]),
            Goodbye::Nothing => None,
        };
        while let (false, Some(alert)) = (this.said_goodbye, alert) {
            ready!(this.tcp.poll_write_ready(cx))?;
            let tcp = &this.tcp;
            match tcp.try_io(Interest::WRITABLE, || {
                kernel::send_record(std::os::fd::AsFd::as_fd(tcp), kernel::ALERT_RECORD, &alert)
            }) {
                Ok(()) => this.said_goodbye = true,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        Pin::new(&mut this.tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::Arc;

    use crate::conn::buffered::Buffered;
    use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey};
    use nix::sys::socket::sockopt::TlsCryptoInfo;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    use tokio::io::AsyncReadExt;

    use super::*;
    use crate::tls::kernel::crypto_info;

    /// What the kernel would do with the keys nbdgw gives it: open TLS 1.3
    /// application records with the key, salt, IV and sequence number
    /// exactly as laid out for TLS_RX.
    fn open_as_the_kernel_would(wire: &[u8], info: TlsCryptoInfo) -> Vec<u8> {
        let (alg, key, base, rec_seq): (_, Vec<u8>, Vec<u8>, [u8; 8]) = match info {
            TlsCryptoInfo::Aes128Gcm(i) => (
                &aws_lc_rs::aead::AES_128_GCM,
                i.key.to_vec(),
                [&i.salt[..], &i.iv[..]].concat(),
                i.rec_seq,
            ),
            TlsCryptoInfo::Aes256Gcm(i) => (
                &aws_lc_rs::aead::AES_256_GCM,
                i.key.to_vec(),
                [&i.salt[..], &i.iv[..]].concat(),
                i.rec_seq,
            ),
            TlsCryptoInfo::Chacha20Poly1305(i) => (
                &aws_lc_rs::aead::CHACHA20_POLY1305,
                i.key.to_vec(),
                i.iv.to_vec(),
                i.rec_seq,
            ),
        };
        let key = LessSafeKey::new(UnboundKey::new(alg, &key).unwrap());
        let (mut seq, mut at, mut out) = (u64::from_be_bytes(rec_seq), 0, Vec::new());
        while at < wire.len() {
            let header: [u8; 5] = wire[at..at + 5].try_into().unwrap();
            assert_eq!(header[0], 23, "an application data record at offset {at}");
            let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
            let mut body = wire[at + 5..at + 5 + len].to_vec();
            let mut nonce: [u8; 12] = base[..].try_into().unwrap();
            for (n, s) in nonce[4..].iter_mut().zip(seq.to_be_bytes()) {
                *n ^= s;
            }
            let plain = key
                .open_in_place(
                    Nonce::assume_unique_for_key(nonce),
                    Aad::from(header),
                    &mut body,
                )
                .expect("the record opens with the handed-over keys");
            let end = plain.iter().rposition(|&b| b != 0).unwrap();
            assert_eq!(plain[end], 23, "inner content type");
            out.extend_from_slice(&plain[..end]);
            (at, seq) = (at + 5 + len, seq + 1);
        }
        out
    }

    #[test]
    fn carried_bytes_come_out_in_order_within_each_limit_then_none() {
        let mut carried = Carried::new(b"abcdefg".to_vec());
        assert_eq!(carried.take(3), b"abc");
        assert_eq!(carried.take(10), b"defg");
        assert_eq!(carried.take(10), b"");
        assert_eq!(carried.take(10), b"");
        assert!(carried.bytes.is_empty());
    }

    /// A TLS 1.3 server config whose keys may be extracted, and a client
    /// config trusting it.
    fn configs(dir: &std::path::Path) -> (rustls::ServerConfig, rustls::ClientConfig) {
        crate::certs::for_test(dir, "localhost", 1);
        let mut server = crate::tls::load_server_config(
            &dir.join("server-cert.pem"),
            &dir.join("server-key.pem"),
        )
        .unwrap();
        server.enable_secret_extraction = true;
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_file(dir.join("ca-cert.pem")).unwrap())
            .unwrap();
        let client = rustls::ClientConfig::builder_with_provider(crate::tls::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        (server, client)
    }

    /// A client connected to `addr` and through its handshake but for its
    /// Finished, which stays queued, to leave in the same write as what
    /// the test sends next.
    fn handshaken_client(
        addr: std::net::SocketAddr,
        config: rustls::ClientConfig,
    ) -> (std::net::TcpStream, rustls::ClientConnection) {
        let mut tcp = std::net::TcpStream::connect(addr).unwrap();
        let name = "localhost".try_into().unwrap();
        let mut conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
        while conn.is_handshaking() {
            if conn.wants_write() {
                conn.write_tls(&mut tcp).unwrap();
            } else {
                conn.read_tls(&mut tcp).unwrap();
                conn.process_new_packets().unwrap();
            }
        }
        (tcp, conn)
    }

    /// A client that handshakes, then sends its Finished and `message` in
    /// one flight cut mid-record: Finished and a record and a half, a
    /// pause, then the rest.
    fn client_sending_behind_finished(
        addr: std::net::SocketAddr,
        config: rustls::ClientConfig,
        message: Vec<u8>,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let (mut tcp, mut conn) = handshaken_client(addr, config);
            conn.writer().write_all(&message).unwrap();
            let mut wire = Vec::new();
            while conn.wants_write() {
                conn.write_tls(&mut wire).unwrap();
            }
            let cut = wire.len() - message.len() + 16_406 + 8_000 - 4 * 22;
            tcp.write_all(&wire[..cut]).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(100));
            tcp.write_all(&wire[cut..]).unwrap();
        })
    }

    /// A client sends application data straight behind its Finished, in
    /// pieces that split records. After the handshake through
    /// `RecordAligned` and the drain, the socket must sit at a record
    /// boundary, and the extracted receive keys, in the kernel's layout,
    /// must open everything that follows.
    #[tokio::test]
    async fn the_hand_over_leaves_the_socket_at_a_record_the_keys_open() {
        let dir = tempfile::tempdir().unwrap();
        let (server, client) = configs(dir.path());
        let message: Vec<u8> = (0..60_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client =
            client_sending_behind_finished(listener.local_addr().unwrap(), client, message.clone());

        let (tcp, _) = listener.accept().await.unwrap();
        let io = Either::Right(RecordAligned::new(
            Buffered::new(8192, tcp),
            SecretLog::new(),
        ));
        let mut tls = tokio_rustls::TlsAcceptor::from(Arc::new(server))
            .accept(io)
            .await
            .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(eligible(
            tls.get_ref().1,
            &KernelCiphers {
                aes_128_gcm: true,
                aes_256_gcm: true,
                chacha20_poly1305: true
            }
        ));
        let early = drain(&mut tls).await.unwrap();
        let (io, conn) = tls.into_inner();
        let Either::Right(aligned) = io else {
            panic!("the handshake went through RecordAligned");
        };
        let secrets = conn.dangerous_extract_secrets().unwrap();
        let mut rest = Vec::new();
        let mut tcp = aligned.tcp;
        client.join().unwrap();
        tcp.read_to_end(&mut rest).await.unwrap();
        let (seq, rx) = secrets.rx;
        let rx = Keys::from_extracted(&rx).unwrap();
        let opened = open_as_the_kernel_would(&rest, crypto_info(seq, &rx).unwrap());
        assert!(!early.closed);
        assert_eq!([early.early, opened].concat(), message);
    }

    /// Where rustls already holds the client's close_notify at the
    /// hand-over (it read past its Finished), the drain says so, and the
    /// kernel session reads end-of-file at once instead of waiting for a
    /// record that never comes.
    #[tokio::test]
    async fn a_close_notify_rustls_read_before_the_hand_over_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let (server, client) = configs(dir.path());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = std::thread::spawn(move || {
            let (mut tcp, mut conn) = handshaken_client(addr, client);
            conn.writer().write_all(b"last words").unwrap();
            conn.send_close_notify();
            // Finished, the data and close_notify in one write, so that
            // they arrive together.
            let mut wire = Vec::new();
            while conn.wants_write() {
                conn.write_tls(&mut wire).unwrap();
            }
            tcp.write_all(&wire).unwrap();
            tcp
        });
        let (tcp, _) = listener.accept().await.unwrap();
        let mut aligned = RecordAligned::new(Buffered::new(8192, tcp), SecretLog::new());
        // Unaligned reads, so that rustls reads all the client sent.
        aligned.aligned = false;
        let accepting = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let mut tls = accepting.accept(Either::Right(aligned)).await.unwrap();
        let client_tcp = client.join().unwrap();
        let drained = drain(&mut tls).await.unwrap();
        assert_eq!(drained.early, b"last words");
        assert!(drained.closed);
        drop(client_tcp);
    }
}
