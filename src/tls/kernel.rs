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
use rustls::ConnectionTrafficSecrets;
use tracing::info;

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
    #[error("rustls did not hand over the session keys: {0}")]
    Secrets(rustls::Error),
    #[error("the kernel refused the session keys: {0}")]
    Setup(nix::Error),
    #[error("the session's cipher is not one the kernel took at start")]
    Cipher,
    #[error("draining rustls before the hand-over: {0}")]
    Drain(std::io::Error),
    #[error("the handshake was not read record by record, so it cannot be handed over")]
    NotAligned,
}

/// Asks the kernel, on loopback connections of its own, whether it has the
/// `tls` ULP and which ciphers it takes: the same calls a session's
/// hand-over makes, with throw-away keys.
pub fn probe() -> Result<KernelCiphers, KernelTlsError> {
    let try_cipher = |info: TlsCryptoInfo| -> Result<bool, KernelTlsError> {
        let (client, _server) = loopback_pair().map_err(KernelTlsError::Probe)?;
        attach_ulp(&client)?;
        Ok(setsockopt(&client, TcpTlsTx, &info).is_ok())
    };
    let zero =
        |make: Layout, key_len| make(&vec![0; key_len], &[0; 12]).ok_or(KernelTlsError::NoCiphers);
    let ciphers = KernelCiphers {
        aes_128_gcm: try_cipher(zero(aes_128_gcm, 16)?)?,
        aes_256_gcm: try_cipher(zero(aes_256_gcm, 32)?)?,
        chacha20_poly1305: try_cipher(zero(chacha20_poly1305, 32)?)?,
    };
    if ciphers == KernelCiphers::default() {
        return Err(KernelTlsError::NoCiphers);
    }
    Ok(ciphers)
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
/// number of the next record, as rustls counted it.
pub fn crypto_info(seq: u64, secrets: &ConnectionTrafficSecrets) -> Option<TlsCryptoInfo> {
    let (make, key, iv): (Layout, _, _) = match secrets {
        ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (aes_128_gcm, key, iv),
        ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (aes_256_gcm, key, iv),
        ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (chacha20_poly1305, key, iv),
        _ => return None,
    };
    let mut info = make(key.as_ref(), iv.as_ref())?;
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

/// Hands both directions of an established TLS 1.3 session to the kernel
/// (the ULP already on). After an error the socket is unusable for TLS:
/// the keys have left rustls.
pub fn install_keys(
    socket: &impl std::os::fd::AsFd,
    secrets: rustls::ExtractedSecrets,
) -> Result<(), KernelTlsError> {
    let (tx_seq, tx) = secrets.tx;
    let (rx_seq, rx) = secrets.rx;
    let tx = crypto_info(tx_seq, &tx).ok_or(KernelTlsError::Cipher)?;
    let rx = crypto_info(rx_seq, &rx).ok_or(KernelTlsError::Cipher)?;
    setsockopt(socket, TcpTlsTx, &tx).map_err(KernelTlsError::Setup)?;
    setsockopt(socket, TcpTlsRx, &rx).map_err(KernelTlsError::Setup)
}

/// Sends close_notify on a kernel TLS socket: an alert record, which the
/// kernel sends only when told the record type in a control message.
/// Clients expect it at the end (rustls reports its absence as an error,
/// GnuTLS as a premature termination), and no safe crate builds that
/// control message (nix and rustix have no TLS_SET_RECORD_TYPE), hence
/// the one unsafe function in nbdgw. Non-blocking: WouldBlock when the
/// socket's send buffer is full.
#[allow(unsafe_code)]
pub fn send_close_notify(socket: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    const ALERT_RECORD: u8 = 21;
    let alert = [1u8, 0]; // warning, close_notify
                          // u64s, so the control buffer is aligned for cmsghdr.
    let mut control = [0u64; 4];
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(1) } as usize;
    if space > std::mem::size_of_val(&control) {
        return Err(std::io::Error::other("control message buffer too small"));
    }
    let mut iov = libc::iovec {
        iov_base: alert.as_ptr() as *mut libc::c_void,
        iov_len: alert.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg points at `control`, which has room for one cmsghdr with
    // one byte of data (checked above), so CMSG_FIRSTHDR is non-null and
    // CMSG_DATA within it; `iov` and `alert` outlive the sendmsg call,
    // which only reads them.
    let sent = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_TLS;
        (*cmsg).cmsg_type = libc::TLS_SET_RECORD_TYPE;
        (*cmsg).cmsg_len = libc::CMSG_LEN(1) as _;
        *libc::CMSG_DATA(cmsg) = ALERT_RECORD;
        libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_DONTWAIT)
    };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// At start: whether sessions may go to the kernel, said once in the log.
pub fn decide(mode: KernelTlsMode) -> Option<KernelCiphers> {
    if mode == KernelTlsMode::Off {
        info!("kernel TLS off (--ktls off): TLS stays in rustls");
        return None;
    }
    match probe() {
        Ok(ciphers) => {
            info!(ciphers = ?ciphers.names(), "kernel TLS available: TLS 1.3 sessions go to the kernel after the handshake");
            Some(ciphers)
        }
        Err(e) => {
            info!(reason = %e, "kernel TLS unavailable: TLS stays in rustls");
            None
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
        let secrets = ConnectionTrafficSecrets::Aes256Gcm {
            key: key.into(),
            iv: rustls::crypto::cipher::Iv::copy(&iv),
        };
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

        let chacha = ConnectionTrafficSecrets::Chacha20Poly1305 {
            key: key.into(),
            iv: rustls::crypto::cipher::Iv::copy(&iv),
        };
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
        assert!(crypto_info(0, &secrets).is_none());
    }

    /// This machine's kernel lacks CONFIG_TLS: the probe must say so, not
    /// fail some other way. Where the kernel has it, the probe finds at
    /// least AES-GCM.
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
            Err(e) => panic!("unexpected probe failure: {e}"),
        }
    }
}
