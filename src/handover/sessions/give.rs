//! The predecessor's side of the session hand-over, on the channel after
//! Serving: every session is offered at once; those accepted are asked to
//! go quiet, all together; each State leaves as soon as its session is
//! quiet and taken. Every wait is bounded.
//!
//! The commit rule (no nonce is used twice, no session is served twice):
//! until a session's State is sent, the session is this process's and a
//! failure anywhere leaves it here (Withdraw); once its state is taken,
//! its rustls connection is consumed and its sockets leave with the
//! State, so this process can never write on it again, whatever the
//! successor does.

use std::collections::{HashMap, HashSet};
use std::os::fd::AsFd;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::{Listed, Outcome, Ready, Registry};
use crate::handing::{not_quiet, Patience};
use crate::handover::channel::{Channel, ChannelError};
use crate::logsafe::escape;
use crate::proto::handover::Message;
use crate::proto::handover_session::State;

/// Beyond the quiesce timeout: taking the state of a quiet session (a
/// flush, the keys, an encoding).
const TAKE_MARGIN: Duration = Duration::from_secs(2);

/// Offers every registered session to the successor and hands over those
/// it accepts; then, in further rounds, the sessions that finished
/// negotiating meanwhile (the listeners left with the successor, but the
/// connections accepted before go on negotiating, and would otherwise be
/// drained just after their connect succeeded), until a round finds none
/// or `--handover-timeout` has passed since the first. An error ends the
/// exchange: sessions not sent stay here.
pub fn give(channel: &mut Channel, registry: &Registry) -> Result<(), ChannelError> {
    let bound = |channel: &mut Channel| channel.set_deadline(Instant::now() + registry.timeout);
    let handover = random_id();
    bound(channel);
    channel.send(&Message::Sessions { handover }, &[])?;
    let last_round = Instant::now() + registry.timeout;
    let mut seen = HashSet::new();
    loop {
        let listed: Vec<Listed> = registry
            .list()
            .into_iter()
            .filter(|l| seen.insert(l.id))
            .collect();
        if listed.is_empty() && !seen.is_empty() {
            break;
        }
        info!(
            sessions = listed.len(),
            "hand-over: offering the sessions to the successor"
        );
        let outcome = round(channel, registry, handover, &listed);
        // Whatever happened: nobody waits for a report any more, and a
        // session still asked to go quiet reads on (and drains).
        for session in &listed {
            session.slot.close();
            session.hook.cancel();
        }
        outcome?;
        if listed.is_empty() || Instant::now() >= last_round {
            break;
        }
    }
    bound(channel);
    channel.send(&Message::Done, &[])
}

/// One round: these sessions offered, and the accepted ones handed over.
fn round(
    channel: &mut Channel,
    registry: &Registry,
    handover: [u8; 16],
    listed: &[Listed],
) -> Result<(), ChannelError> {
    let (tx, rx) = mpsc::channel();
    let waiting = answers(channel, registry, listed, &tx)?;
    drop(tx);
    states(channel, registry, (handover, waiting), (listed, &rx))
}

/// Each offer, and its Accept or Decline before the next (in lock-step:
/// a peer that sent a thousand answers unread would fill the socket's
/// buffer, and both sides would wait on each other); then every accepted
/// session is asked to go quiet, so that they quiesce in parallel.
fn answers(
    channel: &mut Channel,
    registry: &Registry,
    listed: &[Listed],
    tx: &mpsc::Sender<(u64, Outcome)>,
) -> Result<HashSet<u64>, ChannelError> {
    let by_id: HashMap<u64, &Listed> = listed.iter().map(|l| (l.id, l)).collect();
    let mut waiting = HashSet::new();
    for session in listed {
        channel.set_deadline(Instant::now() + registry.timeout);
        let offer = Message::Offer {
            id: session.id,
            body: session.offer.to_vec().into(),
        };
        channel.send(&offer, &[])?;
        match channel.recv()? {
            (Message::Accept { id }, _) if by_id.contains_key(&id) && !waiting.contains(&id) => {
                by_id[&id].slot.open(tx.clone());
                waiting.insert(id);
            }
            (Message::Decline { id, reason }, _) if by_id.contains_key(&id) => {
                let reason = escape(&reason).into_owned();
                registry.metrics.session_handover(decline_class(&reason));
                info!(conn = id, %reason, "hand-over: the successor declined the session; it stays here and drains");
            }
            (other, _) => return Err(unexpected(channel, &other)),
        }
    }
    // All at once, once every session is judged: the pause each client
    // sees does not include the offers of the others.
    for id in &waiting {
        by_id[id].hook.ask();
    }
    Ok(waiting)
}

/// The bounded label of a decline (the successor's reason starts with
/// its class, `judge::Declined`).
fn decline_class(reason: &str) -> &'static str {
    match reason.split(':').next().unwrap_or("") {
        "certificate" => "declined_certificate",
        "policy" => "declined_policy",
        "export" => "declined_export",
        "tls" => "declined_tls",
        "limits" => "declined_limits",
        // Client mode: another remote server, or another name to verify.
        "server" => "declined_server",
        _ => "declined_other",
    }
}

/// Each session's State (or Withdraw) as soon as it reports, and the
/// successor's Taken or Lost before the next (lock-step, as the offers).
/// A session not quiet when the quiesce timeout (and the take's margin)
/// has passed is withdrawn; one quiet by then is waited for, however
/// long the queue of takes before it (one at a time, each with its own
/// exchange: hundreds of sessions on a loaded machine take longer than
/// any fixed window), as long as reports keep coming (`Patience`).
fn states(
    channel: &mut Channel,
    registry: &Registry,
    (handover, mut waiting): ([u8; 16], HashSet<u64>),
    (listed, rx): (&[Listed], &mpsc::Receiver<(u64, Outcome)>),
) -> Result<(), ChannelError> {
    let mut patience = Patience::new(registry, TAKE_MARGIN);
    let mut sent = HashMap::new();
    while !waiting.is_empty() {
        if patience.quiesce_over() {
            let late = not_quiet(listed, &waiting);
            let going = (handover, &mut waiting, &mut sent);
            withdraw(channel, registry, going, (listed, rx), &late)?;
        }
        let left = patience.left();
        if left.is_zero() || waiting.is_empty() {
            break;
        }
        let (id, outcome) = match rx.recv_timeout(left.min(WATCH)) {
            Ok(report) => report,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                hung_up(channel, listed)?;
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        patience.reported();
        waiting.remove(&id);
        send_outcome(channel, registry, (id, handover, outcome), &mut sent)?;
    }
    let rest: Vec<u64> = waiting.iter().copied().collect();
    withdraw(
        channel,
        registry,
        (handover, &mut waiting, &mut sent),
        (listed, rx),
        &rest,
    )
}

/// The sessions `late` withdrawn: nobody waits for them now, what
/// reported meanwhile (theirs or another's) still goes, and the others
/// read on here and drain.
fn withdraw(
    channel: &mut Channel,
    registry: &Registry,
    (handover, waiting, sent): Going<'_>,
    (listed, rx): (&[Listed], &mpsc::Receiver<(u64, Outcome)>),
    late: &[u64],
) -> Result<(), ChannelError> {
    let late: Vec<&Listed> = listed.iter().filter(|l| late.contains(&l.id)).collect();
    late.iter().for_each(|session| session.slot.close());
    for (id, outcome) in rx.try_iter() {
        waiting.remove(&id);
        send_outcome(channel, registry, (id, handover, outcome), sent)?;
    }
    for session in late.into_iter().filter(|l| waiting.remove(&l.id)) {
        session.hook.cancel();
        registry.metrics.session_handover("withdrawn");
        info!(
            conn = session.id,
            "hand-over: the session was not quiet in time; it stays here and drains"
        );
        channel.set_deadline(Instant::now() + registry.timeout);
        channel.send(&Message::Withdraw { id: session.id }, &[])?;
    }
    Ok(())
}

/// This hand-over's id, the sessions still waited for, and the States
/// sent (when each session stopped).
type Going<'a> = (
    [u8; 16],
    &'a mut HashSet<u64>,
    &'a mut HashMap<u64, Instant>,
);

/// How often the wait for reports looks whether the successor is gone.
const WATCH: Duration = Duration::from_millis(100);

/// A successor that hung up (died) while sessions were going quiet: every
/// session not yet taken is told at once that nobody waits (it then reads
/// on here and drains), instead of having its state taken for a State
/// that cannot be sent, and so being closed.
fn hung_up(channel: &Channel, listed: &[Listed]) -> Result<(), ChannelError> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let watched = PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR;
    let mut fds = [PollFd::new(channel, watched)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    if poll(&mut fds, Some(&now)).unwrap_or(0) == 0 || fds[0].revents().is_empty() {
        return Ok(());
    }
    listed.iter().for_each(|session| session.slot.close());
    warn!("hand-over: the successor hung up; the sessions not yet taken stay here and drain");
    Err(ChannelError::Peer("the successor hung up".into()))
}

fn send_outcome(
    channel: &mut Channel,
    registry: &Registry,
    (id, handover, outcome): (u64, [u8; 16], Outcome),
    sent: &mut HashMap<u64, Instant>,
) -> Result<(), ChannelError> {
    channel.set_deadline(Instant::now() + registry.timeout);
    let ready: Box<Ready> = match outcome {
        Outcome::Withdrawn(why) => {
            registry.metrics.session_handover("withdrawn");
            info!(conn = id, reason = %why, "hand-over: the session's state could not be taken; it stays here and drains");
            return channel.send(&Message::Withdraw { id }, &[]);
        }
        Outcome::Ended => {
            registry.metrics.session_handover("ended");
            info!(
                conn = id,
                "hand-over: the session ended before it was quiet; nothing to hand over"
            );
            return channel.send(&Message::Withdraw { id }, &[]);
        }
        Outcome::Ready(ready) => ready,
    };
    let state = State {
        handover,
        tls: ready.tls,
        ahead: ready.ahead,
        counts: ready.counts,
    };
    let message = Message::State {
        id,
        body: state.encode(),
    };
    let fds = [ready.tcp.as_fd(), ready.upstream.as_fd()];
    let result = channel.send(&message, &fds);
    // Its body wipes itself (Zeroizing; review round 2, R3).
    drop(message);
    match result {
        Ok(()) => {
            sent.insert(id, ready.stopped_at);
            let served = served(channel, registry, sent);
            let told = match &served {
                Ok(answer) => answer.clone(),
                Err(e) => Err(e.to_string()),
            };
            let _ = ready.delivered.send(told);
            served.map(|_| ())
        }
        Err(e) => {
            // Taken and not delivered: closed, never resumed here.
            registry.metrics.session_handover("lost");
            warn!(conn = id, error = %e, "hand-over: the session's state could not be sent; it is closed");
            let _ = ready
                .delivered
                .send(Err(format!("its state could not be sent: {e}")));
            Err(e)
        }
    }
}

/// Taken or Lost (why), for one State sent.
fn served(
    channel: &mut Channel,
    registry: &Registry,
    sent: &HashMap<u64, Instant>,
) -> Result<Result<(), String>, ChannelError> {
    match channel.recv()? {
        (Message::Taken { id }, _) if sent.contains_key(&id) => {
            let pause = sent[&id].elapsed();
            registry.metrics.session_handover("handed_over");
            registry
                .metrics
                .sessions_handed
                .pause_seconds
                .observe(pause.as_secs_f64());
            info!(
                conn = id,
                pause_ms = pause.as_millis() as u64,
                "hand-over: the successor serves the session"
            );
            Ok(Ok(()))
        }
        (Message::Lost { id, reason }, _) if sent.contains_key(&id) => {
            registry.metrics.session_handover("lost");
            let reason = escape(&reason).into_owned();
            warn!(conn = id, %reason, "hand-over: the successor could not serve the session; it is closed");
            Ok(Err(format!("the successor could not serve it: {reason}")))
        }
        (other, _) => Err(unexpected(channel, &other)),
    }
}

fn unexpected(channel: &mut Channel, got: &Message) -> ChannelError {
    channel.refuse(&format!(
        "unexpected {} in the session hand-over",
        got.name()
    ));
    ChannelError::Peer(format!("the successor sent {} out of turn", got.name()))
}

/// This hand-over's id: a State carrying another is refused.
fn random_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    aws_lc_rs::rand::fill(&mut id).expect("the system's random source");
    id
}
