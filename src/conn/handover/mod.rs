//! A session that may be handed to a successor process (issue 29):
//! relayed with the quiesce hook, and when it goes quiet for a hand-over,
//! its state taken and reported to the hand-over (`crate::handover::
//! sessions::give`), or, if that cannot be done, relayed on here.
//!
//! - `take`: the TLS state out of rustls or `ResumedTls`;
//! - `resume`: a session handed to this process, served.

pub mod extract;
pub mod resume;

use std::os::fd::OwnedFd;
use std::time::Instant;

use tokio::net::UnixStream;
use tokio_util::either::Either;
use tracing::warn;

use super::error::{ConnError, Side};
use super::kernel_tls::TlsPeer;
use super::prefixed::Prefixed;
use super::relay::{self, Ends, Parts, Relayed};
use super::session::{ClientStream, Link};
use crate::handing::{Outcome, Ready, Registered};
use crate::proto::handover_session::Offer;
use crate::proto::transmission::ReplyMode;
use extract::{Handable, TakeError, Taken};

/// What the relay needs of the session besides its streams.
pub struct Relaying<'a> {
    pub mode: ReplyMode,
    pub read_only: bool,
    pub cache: Option<relay::Cached>,
    pub socket: Option<socket2::Socket>,
    pub registered: Option<&'a crate::tls::SessionGuard>,
}

/// The reason a handed-over session's close line gives.
pub const HANDED_OVER: &str = "handed over to the successor";

/// Relays `stream` (after `before`, plaintext already read from it) to
/// `upstream`; if the hand-over asks, goes quiet and hands the session
/// over, or goes on here when that cannot be done.
pub async fn transmit<S: Handable>(
    (mut stream, mut before): (S, Vec<u8>),
    mut upstream: UnixStream,
    mut relaying: Relaying<'_>,
    handover: Option<Registered>,
    link: &Link<'_>,
) -> Result<&'static str, ConnError> {
    let hook = handover.as_ref().map(Registered::hook);
    loop {
        let (rd, wr) = tokio::io::split(stream);
        let ends = Ends {
            client: (Prefixed::new(rd, before), wr),
            upstream: upstream.into_split(),
            mode: relaying.mode,
            read_only: relaying.read_only,
            // A relay started again (a hand-over withdrawn) goes uncached.
            cache: relaying.cache.take(),
        };
        let socket = relaying.socket.take();
        let transmit = link.transmit();
        let quiet = relay::run_quiescible(ends, socket, &transmit, relaying.registered, hook);
        let parts = match quiet.await? {
            Relayed::Ended(reason) => return Ok(reason),
            Relayed::Quiet(parts) => parts,
        };
        let handover = handover.as_ref().expect("quiet only with a hook");
        let (back, again) = reassemble(parts)?;
        (stream, upstream, relaying.socket) = again;
        match hand_over(stream, (back, upstream), handover, link).await? {
            Step::HandedOver => return Ok(HANDED_OVER),
            Step::Again(s, b, u) => (stream, before, upstream) = (s, b, u),
        }
    }
}

type Again<S> = (S, UnixStream, Option<socket2::Socket>);

/// The quiet relay's parts back together: the bytes read and not
/// processed (a request header read in part, then what was left of the
/// prefix), and the streams whole.
fn reassemble<S: Handable>(
    parts: Parts<
        Prefixed<tokio::io::ReadHalf<S>>,
        tokio::io::WriteHalf<S>,
        tokio::net::unix::OwnedReadHalf,
        tokio::net::unix::OwnedWriteHalf,
    >,
) -> Result<(Vec<u8>, Again<S>), ConnError> {
    let Parts {
        client: (rd, wr),
        upstream: (ur, uw),
        pending,
        socket,
    } = parts;
    let (rd, rest) = rd.into_parts();
    let mut back = pending;
    back.extend_from_slice(&rest);
    let upstream = ur
        .reunite(uw)
        .map_err(|_| ConnError::closed(Side::Upstream, "at a hand-over"))?;
    Ok((back, (rd.unsplit(wr), upstream, socket)))
}

enum Step<S> {
    HandedOver,
    /// Relay on: the stream, the plaintext to read first, the upstream.
    Again(S, Vec<u8>, UnixStream),
}

/// A quiet session: its state taken and reported, or, if nobody waits
/// any more or it cannot be taken, given back to relay on.
async fn hand_over<S: Handable>(
    mut stream: S,
    (back, upstream): (Vec<u8>, UnixStream),
    handover: &Registered,
    link: &Link<'_>,
) -> Result<Step<S>, ConnError> {
    let withdraw = |why: String, stream, back, upstream| {
        handover.hook().cancel();
        let _ = handover.report(Outcome::Withdrawn(why));
        Ok(Step::Again(stream, back, upstream))
    };
    if !handover.awaited() {
        return withdraw("nobody waits".into(), stream, back, upstream);
    }
    stream
        .send_owed()
        .await
        .map_err(ConnError::io(Side::Client, "at a hand-over"))?;
    let taken = match take(stream, handover).await? {
        Ok(taken) => taken,
        Err(TakeError::Back(stream, plaintext, why)) => {
            let mut all = back;
            all.extend_from_slice(&plaintext);
            return withdraw(why, stream, all, upstream);
        }
        Err(TakeError::Lost(why)) => return Err(lost(link, &why)),
    };
    let (delivered, told) = tokio::sync::oneshot::channel();
    let ready = ready(taken, (back, delivered), upstream, handover, link)?;
    if handover.report(Outcome::Ready(Box::new(ready))).is_err() {
        return Err(lost(link, "the hand-over gave up as the state was taken"));
    }
    // The hand-over's every step is bounded: it answers or drops `told`.
    match told.await {
        Ok(Ok(())) => Ok(Step::HandedOver),
        Ok(Err(why)) => Err(not_served(&why)),
        Err(_) => Err(not_served("the hand-over ended")),
    }
}

/// A session whose state left but which the successor does not serve
/// (counted and logged by the hand-over): closed, and its audit line
/// says so.
fn not_served(why: &str) -> ConnError {
    let error = std::io::Error::other(format!("hand-over failed: {why}"));
    ConnError::io(Side::Client, "at a hand-over")(error)
}

/// The state taken on the blocking pool, one session at a time
/// (`Registry::takes`): a TLS 1.3 key walk never holds an async worker,
/// and hostile walks queue behind each other (review round 2, R2). A
/// session whose turn comes after the hand-over stopped waiting is given
/// back whole.
async fn take<S: Handable>(
    stream: S,
    handover: &Registered,
) -> Result<Result<Taken, TakeError<S>>, ConnError> {
    let registry = handover.registry();
    let _turn = registry.takes.acquire().await;
    if !handover.awaited() {
        let why = "the hand-over stopped waiting before this session's turn".into();
        return Ok(Err(TakeError::Back(stream, Vec::new(), why)));
    }
    let generations = registry.max_key_generations;
    let taken = tokio::task::spawn_blocking(move || stream.take(generations)).await;
    taken.map_err(|e| ConnError::io(Side::Client, "at a hand-over")(std::io::Error::other(e)))
}

/// The State's parts: the plaintext read ahead goes before rustls's.
fn ready(
    taken: Taken,
    (back, delivered): (Vec<u8>, tokio::sync::oneshot::Sender<Result<(), String>>),
    upstream: UnixStream,
    handover: &Registered,
    link: &Link<'_>,
) -> Result<Ready, ConnError> {
    let Taken {
        tcp,
        mut state,
        ahead,
    } = taken;
    state.put_before_plaintext(back);
    state.check().map_err(|e| lost(link, &e.to_string()))?;
    let fd = |e: std::io::Error| lost(link, &e.to_string());
    let tcp: OwnedFd = tcp.into_std().map_err(fd)?.into();
    let upstream: OwnedFd = upstream.into_std().map_err(fd)?.into();
    let c = link.stats.counts();
    Ok(Ready {
        tls: zeroize::Zeroizing::new(state.encode().to_vec()),
        ahead,
        counts: [c.requests, c.replies, c.bytes_in, c.bytes_out],
        tcp,
        upstream,
        stopped_at: (handover.hook().stopped_at())
            .or(handover.hook().asked_at())
            .unwrap_or_else(Instant::now),
        delivered,
    })
}

/// A session whose state was taken and cannot be handed over: closed,
/// never served again here (its keys left rustls).
fn lost(link: &Link<'_>, why: &str) -> ConnError {
    link.config.metrics.session_handover("lost");
    warn!(reason = %why, "hand-over: the session's state was taken but cannot be handed over; closing it");
    let error = std::io::Error::other(format!("hand-over: {why}"));
    ConnError::io(Side::Client, "at a hand-over")(error)
}

/// The offer for a session: what a successor judges. `None` for a
/// kernel TLS session that kept no `TlsPeer` (no hand-over was possible
/// when it went to the kernel). `max_payload`: this process's
/// `--max-payload`, which the relay holds the session to.
pub fn offer(
    tls: &ClientStream,
    session: &super::session::Session,
    max_payload: u32,
) -> Option<Offer> {
    let (peer, version, kernel_tls) = match tls {
        Either::Left(tls) => {
            let conn = tls.get_ref().1;
            let version = conn.protocol_version().map_or(0, u16::from);
            (TlsPeer::of(conn), version, false)
        }
        // Kept from rustls's handshake when the kernel took the session
        // (or from the offer it was handed over with), group included.
        Either::Right(kernel) => (kernel.peer()?.clone(), TLS13, true),
    };
    Some(offer_of((peer, version, kernel_tls), max_payload, session))
}

/// TLS 1.3's protocol version: the only one kernel TLS takes here.
const TLS13: u16 = 0x0304;

fn offer_of(
    (peer, tls_version, kernel_tls): (TlsPeer, u16, bool),
    max_payload: u32,
    session: &super::session::Session,
) -> Offer {
    Offer {
        chain: peer.chain,
        sni: peer.sni,
        export: session.export.clone(),
        upstream_export: session.target.upstream_export.clone(),
        upstream: session
            .target
            .socket
            .as_os_str()
            .as_encoded_bytes()
            .to_vec(),
        tls_version,
        suite: peer.suite,
        kernel_tls,
        group: peer.group,
        max_payload,
        mode: session.mode,
        read_only: session.read_only,
        read_write: session.access == crate::policy::Access::ReadWrite,
        size: session.target.size,
        tflags: session.target.tflags,
    }
}

/// Registers a session for hand-over, if this process can hand over.
pub fn register(link: &Link<'_>, offer: &Offer) -> Option<Registered> {
    let registry = link.config.handover.as_ref()?;
    tracing::debug!("hand-over: this session may be handed to a successor");
    Some(registry.register(link.id, offer.encode()))
}
