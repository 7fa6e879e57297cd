//! Client mode's sessions handed to a successor (`nbdgw client
//! --handover-socket` / `--take-over`, issue 29): the same channel,
//! frames and commit rule as the server mode's (`crate::handover`), under
//! client mode's own state version, so that neither mode is ever sent
//! the other's state.
//!
//! A session here is a local plaintext socket (Unix or loopback TCP) and
//! a remote TCP socket under client-side TLS. It goes quiet on the LOCAL
//! side, as the server mode's on its client side: it stops reading local
//! requests at a request boundary (a header read in part is kept) and
//! waits for the remote's replies to those in flight, within
//! `--handover-quiesce-timeout`. Then the remote's TLS state is taken out
//! of rustls (or of `ResumedTls`, for a session handed over before), and
//! the State carries both sockets, that TLS state, and the bytes read
//! ahead on either side.
//!
//! - `open`: the listeners taken over or bound, the hand-over socket;
//! - `side`: the two sockets' kinds, and taking the remote's TLS state;
//! - `taker`: the successor's judgement of each offer, and its State;
//! - `served`: a session handed over, served.
//!
//! Under `--reconnect` (`crate::client::reconnect::handed`) a session
//! moves when its link is up and nothing is kept; one reconnecting at
//! that moment stays and drains.

pub mod open;
pub mod served;
pub mod side;
pub mod taker;

use std::time::Instant;

use tokio::sync::oneshot;
use tracing::warn;

use self::side::{Local, RemoteSide, Taken};
use crate::conn::error::{ConnError, Side};
use crate::conn::prefixed::Prefixed;
use crate::conn::relay::{self, Ends, Parts, Relayed};
use crate::conn::session::Transmit;
use crate::handing::{Outcome, Ready, Registered};
use crate::proto::handover_client::{pack_ahead, ClientOffer};
use crate::proto::transmission::ReplyMode;

/// The reason a handed-over session's close line gives.
pub const HANDED_OVER: &str = "handed over to the successor";

/// Registers a session for hand-over, if this process can hand over.
pub fn register(
    registry: Option<&std::sync::Arc<crate::handing::Registry>>,
    id: u64,
    offer: &ClientOffer,
) -> Option<Registered> {
    let registry = registry?;
    tracing::debug!("hand-over: this session may be handed to a successor");
    Some(registry.register(id, offer.encode()))
}

/// Relays `local` (after `before`, read from it already) to `remote`; if
/// the hand-over asks, goes quiet and hands the session over, or goes on
/// here when that cannot be done.
pub async fn transmit<L: Local, R: RemoteSide>(
    (mut local, mut before): (L, Vec<u8>),
    mut remote: R,
    (mode, read_only): (ReplyMode, bool),
    handover: Option<Registered>,
    transmit: &Transmit<'_>,
) -> Result<&'static str, ConnError> {
    let hook = handover.as_ref().map(Registered::hook);
    loop {
        let (rd, wr) = tokio::io::split(local);
        let ends = Ends {
            client: (Prefixed::new(rd, before), wr),
            upstream: tokio::io::split(remote),
            mode,
            read_only,
            // The read cache is the gateway's, for exports it serves.
            cache: None,
        };
        let parts = match relay::run_quiescible(ends, None, transmit, None, hook).await? {
            Relayed::Ended(reason) => return Ok(reason),
            Relayed::Quiet(parts) => parts,
        };
        let handover = handover.as_ref().expect("quiet only with a hook");
        let (back, l, r) = reassemble(parts);
        match hand_over((l, back), r, handover, transmit).await? {
            Step::HandedOver => return Ok(HANDED_OVER),
            Step::Again(l, b, r) => (local, before, remote) = (l, b, r),
        }
    }
}

type Halves<L, R> = Parts<
    Prefixed<tokio::io::ReadHalf<L>>,
    tokio::io::WriteHalf<L>,
    tokio::io::ReadHalf<R>,
    tokio::io::WriteHalf<R>,
>;

/// The quiet relay's parts back together: the local bytes read and not
/// relayed (a request header in part, then what was left of the
/// prefix), and both streams whole.
fn reassemble<L: Local, R: RemoteSide>(parts: Halves<L, R>) -> (Vec<u8>, L, R) {
    let Parts {
        client: (rd, wr),
        upstream: (rr, rw),
        pending,
        ..
    } = parts;
    let (rd, rest) = rd.into_parts();
    let mut back = pending;
    back.extend_from_slice(&rest);
    (back, rd.unsplit(wr), rr.unsplit(rw))
}

enum Step<L, R> {
    HandedOver,
    /// Relay on: the local stream, its bytes to read first, the remote.
    Again(L, Vec<u8>, R),
}

/// A quiet session: its remote's TLS state taken and reported, or, if
/// nobody waits any more or it cannot be taken, given back to relay on.
async fn hand_over<L: Local, R: RemoteSide>(
    (local, back): (L, Vec<u8>),
    mut remote: R,
    handover: &Registered,
    transmit: &Transmit<'_>,
) -> Result<Step<L, R>, ConnError> {
    let withdraw = |why: String, local, back, remote| {
        handover.hook().cancel();
        let _ = handover.report(Outcome::Withdrawn(why));
        Ok(Step::Again(local, back, remote))
    };
    if !handover.awaited() {
        return withdraw("nobody waits".into(), local, back, remote);
    }
    remote
        .send_owed()
        .await
        .map_err(ConnError::io(Side::Upstream, "at a hand-over"))?;
    let taken = match take(remote, handover).await {
        Ok(Ok(taken)) => taken,
        Ok(Err(side::TakeError::Back(remote, why))) => return withdraw(why, local, back, remote),
        Ok(Err(side::TakeError::Lost(why))) | Err(why) => return Err(lost(transmit, &why)),
    };
    let (delivered, told) = oneshot::channel();
    let ready = ready(taken, (local, back), delivered, handover, transmit)?;
    if handover.report(Outcome::Ready(Box::new(ready))).is_err() {
        return Err(lost(
            transmit,
            "the hand-over gave up as the state was taken",
        ));
    }
    // The hand-over's every step is bounded: it answers or drops `told`.
    match told.await {
        Ok(Ok(())) => Ok(Step::HandedOver),
        Ok(Err(why)) => Err(not_served(&why)),
        Err(_) => Err(not_served("the hand-over ended")),
    }
}

/// The remote's state taken on the blocking pool, one session at a time
/// (`Registry::takes`), as the server mode's: a TLS 1.3 key walk never
/// holds an async worker. A session whose turn comes after the hand-over
/// stopped waiting is given back whole.
async fn take<R: RemoteSide>(
    remote: R,
    handover: &Registered,
) -> Result<Result<Taken, side::TakeError<R>>, String> {
    let registry = handover.registry();
    let _turn = registry.takes.acquire().await;
    if !handover.awaited() {
        let why = "the hand-over stopped waiting before this session's turn".into();
        return Ok(Err(side::TakeError::Back(remote, why)));
    }
    let generations = registry.max_key_generations;
    tokio::task::spawn_blocking(move || remote.take(generations))
        .await
        .map_err(|e| e.to_string())
}

/// The State's parts: the local socket and its bytes read ahead, the
/// remote socket, its TLS state and its ciphertext read ahead.
fn ready<L: Local>(
    taken: Taken,
    (local, back): (L, Vec<u8>),
    delivered: oneshot::Sender<Result<(), String>>,
    handover: &Registered,
    transmit: &Transmit<'_>,
) -> Result<Ready, ConnError> {
    let Taken { tcp, state, ahead } = taken;
    state.check().map_err(|e| lost(transmit, &e.to_string()))?;
    let fd = |e: std::io::Error| lost(transmit, &e.to_string());
    let remote: std::os::fd::OwnedFd = tcp.into_std().map_err(fd)?.into();
    let local = local.into_fd().map_err(fd)?;
    let c = transmit.stats.counts();
    Ok(Ready {
        tls: zeroize::Zeroizing::new(state.encode().to_vec()),
        ahead: pack_ahead(&back, &ahead),
        counts: [c.requests, c.replies, c.bytes_in, c.bytes_out],
        // The State's first socket is the local client's, the second
        // the remote server's.
        tcp: local,
        upstream: remote,
        stopped_at: (handover.hook().stopped_at())
            .or(handover.hook().asked_at())
            .unwrap_or_else(Instant::now),
        delivered,
    })
}

/// A session whose state left but which the successor does not serve
/// (counted and logged by the hand-over): closed, and its close line
/// says so.
fn not_served(why: &str) -> ConnError {
    let error = std::io::Error::other(format!("hand-over failed: {why}"));
    ConnError::io(Side::Upstream, "at a hand-over")(error)
}

/// A session whose state was taken and cannot be handed over: closed,
/// never served again here (its keys left rustls).
fn lost(transmit: &Transmit<'_>, why: &str) -> ConnError {
    transmit.stats.metrics.session_handover("lost");
    warn!(reason = %why, "hand-over: the session's state was taken but cannot be handed over; closing it");
    let error = std::io::Error::other(format!("hand-over: {why}"));
    ConnError::io(Side::Upstream, "at a hand-over")(error)
}
