//! Kernel TLS (kTLS): once rustls has finished the handshake, the kernel's
//! `tls` upper-layer protocol can take over the record layer. A request
//! payload is then decrypted while it is copied out of the socket, and a
//! reply encrypted while it is copied in, instead of passing through
//! rustls's buffers (three copies on the write path, measured as 15 % of
//! nbdgw's CPU for 256 KiB writes).
//!
//! Only TLS 1.3 with an AEAD the kernel takes is handed over; a kernel
//! without the ULP (CONFIG_TLS), TLS 1.2, or any failure before the keys
//! leave rustls keeps the connection in rustls. This module holds what
//! needs no connection: the start-up probe and the key layout.

use std::net::{Ipv4Addr, TcpListener, TcpStream};

use nix::libc;
use nix::sys::socket::setsockopt;
use nix::sys::socket::sockopt::{TcpTlsRx, TcpTlsTx, TcpUlp, TlsCryptoInfo};

use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags, TlsGetRecordType};
use tracing::info;

use super::key_update::{
    KeyUpdateError, Keys, Suite, HANDSHAKE_RECORD, KEY_UPDATE_LEN, KEY_UPDATE_NOT_REQUESTED,
};

/// Whether nbdgw hands established sessions to kernel TLS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum KernelTlsMode {
    /// When the kernel offers it (probed at start), rustls otherwise.
    #[default]
    Auto,
    /// Never: rustls keeps every session.
    Off,
}

/// The AEADs this kernel's TLS offload accepts, found once at start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelCiphers {
    pub aes_128_gcm: bool,
    pub aes_256_gcm: bool,
    pub chacha20_poly1305: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum KernelTlsError {
    #[error("the kernel has no `tls` upper-layer protocol (CONFIG_TLS): {0}")]
    NoUlp(nix::Error),
    #[error("cannot open a loopback connection to probe kernel TLS: {0}")]
    Probe(std::io::Error),
    #[error("kernel TLS takes none of the AEADs TLS 1.3 uses")]
    NoCiphers,
    #[error(
        "this kernel cannot re-key a TLS 1.3 session ({0}; Linux 6.14 and later can), \
         so a client's key update would end a session handed to it"
    )]
    NoRekey(String),
    #[error("rustls did not hand over the session keys: {0}")]
    Secrets(rustls::Error),
    #[error("the kernel refused the session's {direction} keys: {error}", direction = .0.label(), error = .1)]
    Setup(Direction, nix::Error),
    #[error("the session's cipher is not one the kernel took at start")]
    Cipher,
    #[error("draining rustls before the hand-over: {0}")]
    Drain(std::io::Error),
    #[error("the handshake was not read record by record, so it cannot be handed over")]
    NotAligned,
    #[error("key update: {0}")]
    KeyUpdate(#[from] KeyUpdateError),
}

/// What one cipher's probe found.
enum Verdict {
    /// Both directions, and a key update in each.
    Full,
    Refused,
    /// Keys once, but not a key update: why.
    NoRekey(String),
}

/// Asks the kernel, on loopback connections of its own, whether it has the
/// `tls` ULP and which ciphers it takes for the whole life of a session:
/// the calls a session's hand-over and its key updates make, with
/// throw-away keys. A cipher counts only if application data passes in
/// both directions' kernel code and a key update, sent as a session's is
/// and installed on both sides, is followed: a kernel that takes keys
/// but cannot re-key (before Linux 6.14) would lose every session at the
/// client's first KeyUpdate, so its ciphers are not taken at all.
pub fn probe() -> Result<KernelCiphers, KernelTlsError> {
    let verdicts = [
        probe_cipher(Suite::Aes128GcmSha256)?,
        probe_cipher(Suite::Aes256GcmSha384)?,
        probe_cipher(Suite::Chacha20Poly1305Sha256)?,
    ];
    let full = |v: &Verdict| matches!(v, Verdict::Full);
    let ciphers = KernelCiphers {
        aes_128_gcm: full(&verdicts[0]),
        aes_256_gcm: full(&verdicts[1]),
        chacha20_poly1305: full(&verdicts[2]),
    };
    if ciphers != KernelCiphers::default() {
        return Ok(ciphers);
    }
    match verdicts.into_iter().find_map(|v| match v {
        Verdict::NoRekey(why) => Some(why),
        _ => None,
    }) {
        Some(why) => Err(KernelTlsError::NoRekey(why)),
        None => Err(KernelTlsError::NoCiphers),
    }
}

/// How long the probe waits for its own loopback bytes.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

fn probe_cipher(suite: Suite) -> Result<Verdict, KernelTlsError> {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    let (client, server) = loopback_pair().map_err(KernelTlsError::Probe)?;
    for s in [&client, &server] {
        s.set_read_timeout(Some(PROBE_TIMEOUT))
            .map_err(KernelTlsError::Probe)?;
    }
    attach_ulp(&client)?;
    attach_ulp(&server)?;
    let (first, second) = (Keys::filled(suite, 0x11), Keys::filled(suite, 0x22));
    if set_keys(&client, Direction::Tx, 0, &first).is_err()
        || set_keys(&server, Direction::Rx, 0, &first).is_err()
    {
        return Ok(Verdict::Refused);
    }
    let roundtrip = |mut from: &TcpStream, mut to: &TcpStream, what: &[u8; 5]| {
        let mut got = [0u8; 5];
        from.write_all(what)?;
        to.read_exact(&mut got)?;
        Ok::<bool, std::io::Error>(&got == what)
    };
    if !roundtrip(&client, &server, b"probe").unwrap_or(false) {
        return Ok(Verdict::Refused);
    }
    // As a client's key update: the KeyUpdate under the old keys, then
    // the new ones.
    if let Err(e) = send_record(client.as_fd(), HANDSHAKE_RECORD, &KEY_UPDATE_NOT_REQUESTED) {
        return Ok(Verdict::NoRekey(format!("sending a KeyUpdate: {e}")));
    }
    if let Err(e) = set_keys(&client, Direction::Tx, 0, &second) {
        return Ok(Verdict::NoRekey(e.to_string()));
    }
    let mut record = [0u8; 64];
    match recv_record(server.as_fd(), &mut record) {
        Ok((Some(TlsGetRecordType::Handshake), KEY_UPDATE_LEN))
            if record[..KEY_UPDATE_LEN] == KEY_UPDATE_NOT_REQUESTED => {}
        other => {
            return Ok(Verdict::NoRekey(format!(
                "the KeyUpdate read back as {other:?}"
            )))
        }
    }
    if let Err(e) = set_keys(&server, Direction::Rx, 0, &second) {
        return Ok(Verdict::NoRekey(e.to_string()));
    }
    match roundtrip(&client, &server, b"again") {
        Ok(true) => Ok(Verdict::Full),
        other => Ok(Verdict::NoRekey(format!(
            "data after the key update read back as {other:?}"
        ))),
    }
}

/// Reads one record that is not application data (a plain read of it
/// fails with EIO) and its type; `buf` takes its plaintext.
pub fn recv_record(
    fd: std::os::fd::BorrowedFd<'_>,
    buf: &mut [u8],
) -> nix::Result<(Option<TlsGetRecordType>, usize)> {
    use std::os::fd::AsRawFd;
    let mut space = nix::cmsg_space!(u8);
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(
        fd.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::empty(),
    )?;
    let kind = msg.cmsgs()?.find_map(|c| match c {
        ControlMessageOwned::TlsGetRecordType(t) => Some(t),
        _ => None,
    });
    Ok((kind, msg.bytes))
}

fn loopback_pair() -> std::io::Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let client = TcpStream::connect(listener.local_addr()?)?;
    let (server, _) = listener.accept()?;
    Ok((client, server))
}

impl KernelCiphers {
    pub fn names(&self) -> Vec<&'static str> {
        [
            (self.aes_128_gcm, "AES-128-GCM"),
            (self.aes_256_gcm, "AES-256-GCM"),
            (self.chacha20_poly1305, "CHACHA20-POLY1305"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect()
    }
}

/// The kernel's layout of one direction's TLS 1.3 keys: `seq` is the
/// number of the next record, as rustls counted it (0 after an update).
pub fn crypto_info(seq: u64, keys: &Keys) -> Option<TlsCryptoInfo> {
    let make: Layout = match keys.suite {
        Suite::Aes128GcmSha256 => aes_128_gcm,
        Suite::Aes256GcmSha384 => aes_256_gcm,
        Suite::Chacha20Poly1305Sha256 => chacha20_poly1305,
    };
    let mut info = make(keys.key(), keys.iv())?;
    let rec_seq = seq.to_be_bytes();
    match &mut info {
        TlsCryptoInfo::Aes128Gcm(i) => i.rec_seq = rec_seq,
        TlsCryptoInfo::Aes256Gcm(i) => i.rec_seq = rec_seq,
        TlsCryptoInfo::Chacha20Poly1305(i) => i.rec_seq = rec_seq,
    }
    Some(info)
}

/// Lays out a key and a 12-byte TLS 1.3 IV for one AEAD.
type Layout = fn(&[u8], &[u8]) -> Option<TlsCryptoInfo>;

fn header(cipher_type: u16) -> libc::tls_crypto_info {
    libc::tls_crypto_info {
        version: libc::TLS_1_3_VERSION,
        cipher_type,
    }
}

// TLS 1.3's 12-byte nonce base is, for the kernel's GCM layout, a 4-byte
// salt followed by 8 bytes it calls the IV.
fn aes_128_gcm(key: &[u8], iv: &[u8]) -> Option<TlsCryptoInfo> {
    Some(TlsCryptoInfo::Aes128Gcm(
        libc::tls12_crypto_info_aes_gcm_128 {
            info: header(libc::TLS_CIPHER_AES_GCM_128),
            iv: iv.get(4..12)?.try_into().ok()?,
            key: key.try_into().ok()?,
            salt: iv.get(..4)?.try_into().ok()?,
            rec_seq: [0; 8],
        },
    ))
}

fn aes_256_gcm(key: &[u8], iv: &[u8]) -> Option<TlsCryptoInfo> {
    Some(TlsCryptoInfo::Aes256Gcm(
        libc::tls12_crypto_info_aes_gcm_256 {
            info: header(libc::TLS_CIPHER_AES_GCM_256),
            iv: iv.get(4..12)?.try_into().ok()?,
            key: key.try_into().ok()?,
            salt: iv.get(..4)?.try_into().ok()?,
            rec_seq: [0; 8],
        },
    ))
}

fn chacha20_poly1305(key: &[u8], iv: &[u8]) -> Option<TlsCryptoInfo> {
    Some(TlsCryptoInfo::Chacha20Poly1305(
        libc::tls12_crypto_info_chacha20_poly1305 {
            info: header(libc::TLS_CIPHER_CHACHA20_POLY1305),
            iv: iv.try_into().ok()?,
            key: key.try_into().ok()?,
            salt: [],
            rec_seq: [0; 8],
        },
    ))
}

/// Puts the `tls` ULP on a connected socket. Until keys are set, data
/// passes as before.
pub fn attach_ulp(socket: &impl std::os::fd::AsFd) -> Result<(), KernelTlsError> {
    setsockopt(socket, TcpUlp::default(), &&b"tls"[..]).map_err(KernelTlsError::NoUlp)
}

/// Whether a socket handed over as a kernel TLS session has a ULP on
/// it: Linux refuses a second one with EEXIST (`__tcp_set_ulp`,
/// net/ipv4/tcp_ulp.c). A socket without one gets the `tls` ULP here,
/// keyless, which changes nothing on it; its session is refused anyway.
pub fn has_ulp(socket: &impl std::os::fd::AsFd) -> bool {
    matches!(
        setsockopt(socket, TcpUlp::default(), &&b"tls"[..]),
        Err(nix::errno::Errno::EEXIST)
    )
}

/// One direction's keys to the kernel: the first time after the
/// handshake, or again after a key update (kernels that re-key).
pub fn set_keys(
    socket: &impl std::os::fd::AsFd,
    direction: Direction,
    seq: u64,
    keys: &Keys,
) -> Result<(), KernelTlsError> {
    let info = crypto_info(seq, keys).ok_or(KernelTlsError::Cipher)?;
    match direction {
        Direction::Tx => setsockopt(socket, TcpTlsTx, &info),
        Direction::Rx => setsockopt(socket, TcpTlsRx, &info),
    }
    .map_err(|e| KernelTlsError::Setup(direction, e))
}

/// Which way records go, as nbdgw sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Rx,
    Tx,
}

impl Direction {
    pub fn label(self) -> &'static str {
        match self {
            Direction::Rx => "rx",
            Direction::Tx => "tx",
        }
    }
}

/// The record type of a TLS alert.
pub const ALERT_RECORD: u8 = 21;
/// A warning-level close_notify alert.
pub const CLOSE_NOTIFY: [u8; 2] = [1, 0];

/// Sends one record of a type other than application data on a kernel
/// TLS socket (close_notify at the end, a KeyUpdate): the kernel sends
/// one only when told the record type in a control message. Clients
/// expect close_notify (rustls reports its absence as an error, GnuTLS as
/// a premature termination), a key update needs its KeyUpdate, and no
/// safe crate builds that control message (nix and rustix have no
/// TLS_SET_RECORD_TYPE), hence the one unsafe function in nbdgw.
/// Non-blocking: WouldBlock when the socket's send buffer is full.
#[allow(unsafe_code)]
pub fn send_record(
    socket: std::os::fd::BorrowedFd<'_>,
    record_type: u8,
    body: &[u8],
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // u64s, so the control buffer is aligned for cmsghdr.
    let mut control = [0u64; 4];
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(1) } as usize;
    if space > std::mem::size_of_val(&control) {
        return Err(std::io::Error::other("control message buffer too small"));
    }
    let mut iov = libc::iovec {
        iov_base: body.as_ptr() as *mut libc::c_void,
        iov_len: body.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg points at `control`, which has room for one cmsghdr with
    // one byte of data (checked above), so CMSG_FIRSTHDR is non-null and
    // CMSG_DATA within it; `iov` and `body` outlive the sendmsg call,
    // which only reads them.
    let sent = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_TLS;
        (*cmsg).cmsg_type = libc::TLS_SET_RECORD_TYPE;
        (*cmsg).cmsg_len = libc::CMSG_LEN(1) as _;
        *libc::CMSG_DATA(cmsg) = record_type;
        libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_DONTWAIT)
    };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // A record this small goes whole or not at all.
    if sent as usize != body.len() {
        return Err(std::io::Error::other(
            "the kernel took part of a control record",
        ));
    }
    Ok(())
}

/// At start: whether sessions may go to the kernel, said once in the log,
/// and whether the kernel has TLS but cannot re-key it.
pub fn decide(mode: KernelTlsMode) -> (Option<KernelCiphers>, bool) {
    if mode == KernelTlsMode::Off {
        info!("kernel TLS off (--ktls off): TLS stays in rustls");
        return (None, false);
    }
    match probe() {
        Ok(ciphers) => {
            info!(ciphers = ?ciphers.names(), "kernel TLS available: TLS 1.3 sessions go to the kernel after the handshake, and key updates are followed there");
            (Some(ciphers), false)
        }
        Err(e) => {
            info!(reason = %e, "kernel TLS unavailable: TLS stays in rustls");
            (None, matches!(e, KernelTlsError::NoRekey(_)))
        }
    }
}

/// Where TLS records end in a byte stream, so that reads before the
/// hand-over stop exactly at a record boundary: whatever rustls has read
/// it must also decrypt, and the kernel must start at a record header.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RecordCursor {
    header: [u8; 5],
    header_have: usize,
    body_left: usize,
}

/// A TLS record header: type, version, then the length of what follows.
const RECORD_HEADER: usize = 5;

impl RecordCursor {
    /// How many bytes the next read may take without crossing the end of
    /// the current record (or header).
    pub fn read_limit(&self) -> usize {
        if self.body_left > 0 {
            self.body_left
        } else {
            RECORD_HEADER - self.header_have
        }
    }

    pub fn at_boundary(&self) -> bool {
        self.header_have == 0 && self.body_left == 0
    }

    /// Accounts for bytes just read; `bytes` is at most `read_limit()` long.
    pub fn advance(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let take = self.read_limit().min(bytes.len());
            if self.body_left > 0 {
                self.body_left -= take;
            } else {
                self.header[self.header_have..self.header_have + take]
                    .copy_from_slice(&bytes[..take]);
                self.header_have += take;
                if self.header_have == RECORD_HEADER {
                    self.header_have = 0;
                    self.body_left =
                        usize::from(u16::from_be_bytes([self.header[3], self.header[4]]));
                }
            }
            bytes = &bytes[take..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rustls::ConnectionTrafficSecrets;

    fn record(len: usize) -> Vec<u8> {
        let mut r = vec![23, 3, 3];
        r.extend_from_slice(&(len as u16).to_be_bytes());
        r.extend(std::iter::repeat_n(0xAB, len));
        r
    }

    proptest! {
        /// Read in pieces no larger than the limit, the cursor is at a
        /// boundary exactly where a record ends, whatever the split.
        #[test]
        fn boundaries_are_where_records_end(
            lens in proptest::collection::vec(0usize..3000, 1..8),
            pieces in proptest::collection::vec(1usize..5000, 1..64),
        ) {
            let mut stream = Vec::new();
            let mut ends = std::collections::BTreeSet::new();
            for len in lens {
                stream.extend(record(len));
                ends.insert(stream.len());
            }
            let mut cursor = RecordCursor::default();
            let (mut at, mut piece) = (0, pieces.iter().cycle());
            while at < stream.len() {
                let want = (*piece.next().unwrap()).min(cursor.read_limit()).min(stream.len() - at);
                cursor.advance(&stream[at..at + want]);
                at += want;
                prop_assert_eq!(cursor.at_boundary(), ends.contains(&at), "at {}", at);
            }
        }
    }

    #[test]
    fn an_empty_record_ends_with_its_header() {
        let mut cursor = RecordCursor::default();
        cursor.advance(&record(0));
        assert!(cursor.at_boundary());
        assert_eq!(cursor.read_limit(), RECORD_HEADER);
    }

    #[test]
    fn tls13_keys_are_laid_out_as_the_kernel_reads_them() {
        let iv: Vec<u8> = (1..=12).collect();
        let key = [7u8; 32];
        let secrets = Keys::from_extracted(&ConnectionTrafficSecrets::Aes256Gcm {
            key: key.into(),
            iv: rustls::crypto::cipher::Iv::copy(&iv),
        })
        .unwrap();
        let Some(TlsCryptoInfo::Aes256Gcm(info)) = crypto_info(0x0102_0304_0506_0708, &secrets)
        else {
            panic!("AES-256-GCM expected");
        };
        assert_eq!(info.info.version, 0x0304);
        assert_eq!(info.info.cipher_type, 52);
        assert_eq!(info.salt, [1, 2, 3, 4]);
        assert_eq!(info.iv, [5, 6, 7, 8, 9, 10, 11, 12]);
        assert_eq!(info.key, key);
        assert_eq!(info.rec_seq, [1, 2, 3, 4, 5, 6, 7, 8]);

        let chacha = Keys::from_extracted(&ConnectionTrafficSecrets::Chacha20Poly1305 {
            key: key.into(),
            iv: rustls::crypto::cipher::Iv::copy(&iv),
        })
        .unwrap();
        let Some(TlsCryptoInfo::Chacha20Poly1305(info)) = crypto_info(9, &chacha) else {
            panic!("CHACHA20-POLY1305 expected");
        };
        assert_eq!(info.iv[..], iv[..]);
        assert_eq!(info.rec_seq, 9u64.to_be_bytes());
    }

    #[test]
    fn a_key_of_the_wrong_length_is_not_handed_over() {
        let secrets = ConnectionTrafficSecrets::Aes128Gcm {
            key: [0u8; 32].into(),
            iv: rustls::crypto::cipher::Iv::copy(&[0; 12]),
        };
        assert!(Keys::from_extracted(&secrets).is_none());
    }

    /// This machine's kernel lacks CONFIG_TLS: the probe must say so, not
    /// fail some other way. Where the kernel has it and re-keys, the probe
    /// finds at least AES-GCM; where it cannot re-key, it says that.
    #[test]
    fn the_probe_reports_what_this_kernel_has() {
        let ulp =
            std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_ulp").unwrap_or_default();
        match probe() {
            Ok(ciphers) => assert!(ciphers.aes_128_gcm || ciphers.aes_256_gcm, "{ciphers:?}"),
            Err(KernelTlsError::NoUlp(e)) => {
                assert!(!ulp.split_whitespace().any(|u| u == "tls"), "{ulp}");
                assert_eq!(e, nix::Error::ENOENT);
            }
            // Linux before 6.14 takes keys once: a second TLS_TX is EBUSY.
            Err(KernelTlsError::NoRekey(why)) => {
                assert!(ulp.split_whitespace().any(|u| u == "tls"), "{ulp}");
                assert!(why.contains("EBUSY"), "{why}");
            }
            Err(e) => panic!("unexpected probe failure: {e}"),
        }
    }
}
