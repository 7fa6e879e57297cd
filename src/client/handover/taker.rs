//! The client-mode successor's end of a session hand-over: each offer
//! judged against this process's own configuration (fail closed: the same
//! remote server, the same name to verify, the server's chain verified
//! afresh by this process's CA and CRL files, its TLS minimum, its
//! `--max-payload`), then each State checked and served on. The exchange
//! is the server mode's (`crate::handover::sessions::take::take_with`).

use std::os::fd::OwnedFd;
use std::sync::Arc;

use rustls::client::danger::ServerCertVerifier;
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::ProtocolVersion;

use crate::client::ClientSettings;
use crate::handover::sessions::take::{check_socket, Taker};
use crate::proto::handover_client::{unpack_ahead, ClientOffer};
use crate::proto::handover_session::State;
use crate::tls::handover::{Side, TlsState};
use crate::tls::MinVersion;

/// A session to serve, as the old process left it.
pub struct ResumedClient {
    pub offer: ClientOffer,
    pub local: LocalSocket,
    /// Local plaintext read and not relayed (a request header in part).
    pub before: Vec<u8>,
    pub remote: std::net::TcpStream,
    pub tls: TlsState,
    /// Remote ciphertext read ahead of the old process's TLS layer.
    pub remote_ahead: Vec<u8>,
    pub counts: [u64; 4],
    /// The old process's id for it (logged).
    pub was: u64,
}

/// The local client's socket as it came.
pub enum LocalSocket {
    Unix(std::os::unix::net::UnixStream),
    Tcp(std::net::TcpStream),
}

/// Client mode's `Taker`: `serve` hands a session to the accept loop
/// (false: it is stopping).
pub struct ClientTaker<'a, F> {
    settings: &'a ClientSettings,
    /// The CA and CRL files as they are now (read once per hand-over);
    /// Err: they cannot be read, and every session is declined.
    verifier: Result<Arc<WebPkiServerVerifier>, String>,
    serve: F,
    /// Offers accepted in this exchange: with the sessions open here,
    /// held to `--max-connections` (a withdrawn one still counts: the
    /// bound errs on the closed side).
    accepted: std::cell::Cell<usize>,
}

impl<'a, F: Fn(ResumedClient) -> bool> ClientTaker<'a, F> {
    pub fn new(settings: &'a ClientSettings, serve: F) -> Self {
        let verifier = crate::client::credentials::current_verifier(&settings.tls_paths)
            .map_err(|e| e.to_string());
        ClientTaker {
            settings,
            verifier,
            serve,
            accepted: std::cell::Cell::new(0),
        }
    }
}

impl<F: Fn(ResumedClient) -> bool> Taker for ClientTaker<'_, F> {
    type Judged = ClientOffer;

    fn metrics(&self) -> &crate::metrics::Metrics {
        &self.settings.metrics
    }

    fn judge(&self, body: &[u8]) -> Result<ClientOffer, String> {
        let offer = ClientOffer::decode(body).map_err(|e| format!("other: {e}"))?;
        judge(&offer, self.settings, &self.verifier)?;
        let open = self.settings.metrics.connections_open.get().max(0) as usize;
        let max = self.settings.max_connections;
        if open + self.accepted.get() >= max {
            return Err(format!("limits: --max-connections {max} is reached here"));
        }
        self.accepted.set(self.accepted.get() + 1);
        Ok(offer)
    }

    fn resume(
        &self,
        was: u64,
        judged: Option<ClientOffer>,
        (handover, body): ([u8; 16], &[u8]),
        fds: Vec<OwnedFd>,
    ) -> Result<(), String> {
        let offer = judged.ok_or("a state for a session not accepted, or already given")?;
        crate::handover::sessions::take::debug_stall();
        let state = State::decode(body).map_err(|e| e.to_string())?;
        if state.handover != handover {
            return Err("a state of another hand-over".into());
        }
        let tls = TlsState::decode(&state.tls).map_err(|e| e.to_string())?;
        if tls.side != Side::Client || tls.suite != offer.suite {
            return Err("the state's TLS is not the offer's (side or suite)".into());
        }
        let (before, remote_ahead) = unpack_ahead(&state.ahead).map_err(|e| e.to_string())?;
        let (local, remote) = sockets(fds)?;
        let resumed = ResumedClient {
            offer,
            local,
            before,
            remote,
            tls,
            remote_ahead,
            counts: state.counts,
            was,
        };
        match (self.serve)(resumed) {
            true => Ok(()),
            false => Err("this process is stopping".into()),
        }
    }
}

/// The State's two sockets: the local client's (Unix or TCP), then the
/// remote server's (TCP), each a connected stream socket.
fn sockets(fds: Vec<OwnedFd>) -> Result<(LocalSocket, std::net::TcpStream), String> {
    use rustix::net::AddressFamily;
    let [local, remote]: [OwnedFd; 2] = fds.try_into().map_err(|_| "two sockets expected")?;
    check_socket(&remote, AddressFamily::INET, AddressFamily::INET6)?;
    let family = rustix::net::getsockname(&local)
        .map_err(|e| e.to_string())?
        .address_family();
    let local = if family == AddressFamily::UNIX {
        check_socket(&local, AddressFamily::UNIX, AddressFamily::UNIX)?;
        LocalSocket::Unix(local.into())
    } else {
        check_socket(&local, AddressFamily::INET, AddressFamily::INET6)?;
        LocalSocket::Tcp(local.into())
    };
    Ok((local, remote.into()))
}

/// Whether this process would have made this session itself: the same
/// server, verified the same way now. The reason's first word is its
/// class (the old process's metric label).
fn judge(
    offer: &ClientOffer,
    settings: &ClientSettings,
    verifier: &Result<Arc<WebPkiServerVerifier>, String>,
) -> Result<(), String> {
    if (offer.host.as_str(), offer.port) != (settings.host.as_str(), settings.port) {
        return Err(format!(
            "server: the session's server is {}:{}, this process's --server is {}",
            offer.host, offer.port, settings.server
        ));
    }
    let name = settings.server_name.to_str();
    if offer.server_name != name {
        return Err(format!(
            "server: the session's server was verified as {:?}, this process verifies {name:?}",
            offer.server_name
        ));
    }
    if settings.min_version == MinVersion::Tls13
        && offer.tls_version != u16::from(ProtocolVersion::TLSv1_3)
    {
        return Err("tls: the session is TLS 1.2, this process's --tls-min-version is 1.3".into());
    }
    group(offer, settings)?;
    if offer.max_payload > settings.relay.max_payload {
        return Err(format!(
            "limits: the session's local client may send payloads of {} bytes, this process's --max-payload is {}",
            offer.max_payload, settings.relay.max_payload
        ));
    }
    verify(offer, settings, verifier)
}

/// The key exchange group must be one this process offers (its
/// `--tls-groups`, review C2): an operator who drops a group, or requires
/// the post-quantum hybrid, replaces the process to apply it. A session
/// that recorded none (0: every full handshake has one, and client mode
/// turns resumption off) is declined too: fail closed.
fn group(offer: &ClientOffer, settings: &ClientSettings) -> Result<(), String> {
    let config = settings.tls.current();
    let here = (config.crypto_provider().kx_groups.iter())
        .any(|g| offer.group != 0 && u16::from(g.name()) == offer.group);
    if here {
        return Ok(());
    }
    Err(format!(
        "tls: the session's key exchange group {} ({:#06x}) is not offered by this process (--tls-groups)",
        crate::tls::groups::name(Some(offer.group.into())),
        offer.group
    ))
}

/// The server's chain as carried, verified by this process's CA and CRL
/// files for the name it verifies.
fn verify(
    offer: &ClientOffer,
    settings: &ClientSettings,
    verifier: &Result<Arc<WebPkiServerVerifier>, String>,
) -> Result<(), String> {
    let verifier = verifier
        .as_ref()
        .map_err(|e| format!("certificate: the CA files cannot be read: {e}"))?;
    let Some((leaf, rest)) = offer.chain.split_first() else {
        return Err("certificate: the session carries no server certificate".into());
    };
    let leaf = CertificateDer::from(leaf.as_slice());
    let intermediates: Vec<_> = rest
        .iter()
        .map(|c| CertificateDer::from(c.as_slice()))
        .collect();
    verifier
        .verify_server_cert(
            &leaf,
            &intermediates,
            &settings.server_name,
            &[],
            UnixTime::now(),
        )
        .map(|_| ())
        .map_err(|e| {
            format!(
                "certificate: the server's certificate does not verify with this process's CA: {e}"
            )
        })
}
