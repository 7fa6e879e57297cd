//! The successor's side of the session hand-over: each offer judged
//! against this process's configuration (`judge`) and answered; each
//! State checked (this hand-over's id, a session it accepted and has not
//! been given, two connected stream sockets, a state that passes every
//! check) and handed to the accept loop's task set to be served, then
//! Taken; or Lost, and the sockets closed. A State is never served twice
//! (its id is forgotten once given), and one of another hand-over is
//! refused.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::time::Instant;

use tracing::{info, warn};

use super::judge::{judge, Judged};
use crate::admission::Admission;
use crate::config::Config;
use crate::handover::channel::{Channel, ChannelError};
use crate::logsafe::escape;
use crate::proto::handover::Message;
use crate::proto::handover_session::{Offer, State};
use crate::tls::handover::SessionTls;

/// A session to serve, as the predecessor left it.
pub struct Resumed {
    pub offer: Offer,
    pub judged: Judged,
    /// rustls's (served over `ResumedTls`) or the kernel's (`KernelTls`).
    pub state: SessionTls,
    pub ahead: Vec<u8>,
    pub counts: [u64; 4],
    pub tcp: std::net::TcpStream,
    pub upstream: std::os::unix::net::UnixStream,
    /// The predecessor's id for it (logged).
    pub was: u64,
}

/// What a successor does with the sessions offered to it: the server
/// mode's judge and serve (`Serving`), or client mode's
/// (`crate::client::handover`). The exchange itself (Offer, Accept or
/// Decline, State, Taken or Lost, Withdraw, Done) is the same for both.
pub trait Taker {
    /// What the judgement of an accepted offer keeps for its State.
    type Judged;
    fn metrics(&self) -> &crate::metrics::Metrics;
    /// An offer's body judged; Err: the Decline's reason, its class first
    /// (`judge::Declined`'s words).
    fn judge(&self, body: &[u8]) -> Result<Self::Judged, String>;
    /// The State of a session accepted as `judged` (None: not accepted,
    /// or given already), served; Err: why not (it is closed).
    fn resume(
        &self,
        was: u64,
        judged: Option<Self::Judged>,
        state: ([u8; 16], &[u8]),
        fds: Vec<OwnedFd>,
    ) -> Result<(), String>;
}

/// The server mode's taker: its configuration judges, `serve` hands a
/// session to the accept loop (false if it is stopping).
struct Serving<'a, F> {
    config: &'a Config,
    admission: &'a Admission,
    serve: F,
}

impl<F: Fn(Resumed) -> bool> Taker for Serving<'_, F> {
    type Judged = (Offer, Judged);

    fn metrics(&self) -> &crate::metrics::Metrics {
        &self.config.metrics
    }

    fn judge(&self, body: &[u8]) -> Result<Self::Judged, String> {
        let offer = Offer::decode(body).map_err(|e| format!("other: {e}"))?;
        judge(&offer, (self.config, self.admission)).map(|judged| (offer, judged))
    }

    fn resume(
        &self,
        was: u64,
        judged: Option<Self::Judged>,
        state: ([u8; 16], &[u8]),
        fds: Vec<OwnedFd>,
    ) -> Result<(), String> {
        resume((was, judged), state, fds, &self.serve)
    }
}

/// Runs the exchange to Done. `serve` hands a session to the accept
/// loop; false if it is stopping.
pub fn take(
    channel: &mut Channel,
    (config, admission): (&Config, &Admission),
    timeout: std::time::Duration,
    serve: impl Fn(Resumed) -> bool,
) -> Result<(), ChannelError> {
    let taker = Serving {
        config,
        admission,
        serve,
    };
    take_with(channel, &taker, timeout)
}

/// The exchange to Done, for either mode.
pub fn take_with<T: Taker>(
    channel: &mut Channel,
    taker: &T,
    timeout: std::time::Duration,
) -> Result<(), ChannelError> {
    channel.set_deadline(Instant::now() + timeout);
    let handover = match channel.recv()? {
        (Message::Sessions { handover }, _) => handover,
        (other, _) => return Err(unexpected(channel, &other)),
    };
    let mut offered: HashMap<u64, T::Judged> = HashMap::new();
    loop {
        channel.set_deadline(Instant::now() + timeout);
        let answer = match channel.recv()? {
            (Message::Offer { id, body }, _) => offer(taker, id, &body, &mut offered),
            (Message::State { id, body }, fds) => {
                let given = offered.remove(&id);
                // The body holds keys: wiped once decoded.
                let body = zeroize::Zeroizing::new(body);
                match taker.resume(id, given, (handover, &body), fds) {
                    Ok(()) => {
                        taker.metrics().session_handover("resumed");
                        Message::Taken { id }
                    }
                    Err(reason) => {
                        taker.metrics().session_handover("lost");
                        warn!(conn = id, %reason, "take-over: a session's state came but cannot be served; it is closed");
                        Message::Lost { id, reason }
                    }
                }
            }
            (Message::Withdraw { id }, _) => {
                offered.remove(&id);
                continue;
            }
            (Message::Done, _) => return Ok(()),
            (other, _) => return Err(unexpected(channel, &other)),
        };
        channel.send(&answer, &[])?;
    }
}

fn offer<T: Taker>(
    taker: &T,
    id: u64,
    body: &[u8],
    offered: &mut HashMap<u64, T::Judged>,
) -> Message {
    match taker.judge(body) {
        Ok(session) => {
            offered.insert(id, session);
            Message::Accept { id }
        }
        Err(reason) => {
            info!(conn = id, reason = %escape(&reason), "take-over: declining a session this configuration does not admit as it is");
            Message::Decline { id, reason }
        }
    }
}

pub(crate) fn resume(
    (was, given): (u64, Option<(Offer, Judged)>),
    (handover, body): ([u8; 16], &[u8]),
    fds: Vec<OwnedFd>,
    serve: &impl Fn(Resumed) -> bool,
) -> Result<(), String> {
    let (offer, judged) = given.ok_or("a state for a session not accepted, or already given")?;
    debug_stall();
    let state = State::decode(body).map_err(|e| e.to_string())?;
    if state.handover != handover {
        return Err("a state of another hand-over".into());
    }
    let tls = SessionTls::decode(&state.tls).map_err(|e| e.to_string())?;
    if tls.suite() != offer.suite {
        return Err("the state's suite is not the offer's".into());
    }
    if tls.is_kernel() != offer.kernel_tls {
        return Err("the state's TLS path is not the offer's".into());
    }
    if tls.is_kernel() && !state.ahead.is_empty() {
        return Err("ciphertext ahead of a kernel TLS session".into());
    }
    let [tcp, upstream]: [OwnedFd; 2] = fds.try_into().map_err(|_| "two sockets expected")?;
    check_socket(
        &tcp,
        rustix::net::AddressFamily::INET,
        rustix::net::AddressFamily::INET6,
    )?;
    check_socket(
        &upstream,
        rustix::net::AddressFamily::UNIX,
        rustix::net::AddressFamily::UNIX,
    )?;
    let resumed = Resumed {
        offer,
        judged,
        state: tls,
        ahead: state.ahead,
        counts: state.counts,
        tcp: tcp.into(),
        upstream: upstream.into(),
        was,
    };
    if !serve(resumed) {
        return Err("this gateway is stopping".into());
    }
    Ok(())
}

/// A connected stream socket of one of two families.
pub(crate) fn check_socket(
    fd: &OwnedFd,
    a: rustix::net::AddressFamily,
    b: rustix::net::AddressFamily,
) -> Result<(), String> {
    let kind = rustix::net::sockopt::socket_type(fd).map_err(|e| e.to_string())?;
    if kind != rustix::net::SocketType::STREAM {
        return Err("a descriptor is not a stream socket".into());
    }
    let peer =
        rustix::net::getpeername(fd).map_err(|e| format!("a socket is not connected: {e}"))?;
    let family = peer.ok_or("a socket is not connected")?.address_family();
    if family != a && family != b {
        return Err("a socket of the wrong family".into());
    }
    Ok(())
}

fn unexpected(channel: &mut Channel, got: &Message) -> ChannelError {
    channel.refuse(&format!(
        "unexpected {} in the session hand-over",
        got.name()
    ));
    ChannelError::Peer(format!("the old gateway sent {} out of turn", got.name()))
}

/// Debug builds: NBDGW_DEBUG_HANDOVER_STATE_STALL=1 makes a successor
/// stop once a session's State has arrived, before it serves it, so that
/// a test can kill it there.
pub(crate) fn debug_stall() {
    #[cfg(debug_assertions)]
    if std::env::var_os("NBDGW_DEBUG_HANDOVER_STATE_STALL").is_some() {
        warn!("debug: stalling the session take-over with a State received (NBDGW_DEBUG_HANDOVER_STATE_STALL)");
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
}
