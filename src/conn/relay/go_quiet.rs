//! The relay's hand-over hook: asked to go quiet, the request side stops
//! at a request boundary (before the next header, or inside it: what was
//! read of it is kept), the replies to what is already upstream finish,
//! and the relay hands its parts back instead of closing. Not quiet
//! within the timeout (`--handover-quiesce-timeout`), the request side
//! reads on as if nothing had happened and the hand-over of this session
//! is withdrawn.

use std::future::Future;
use std::pin::Pin;
use std::time::Instant;

use super::flight::Flight;
use crate::conn::error::ConnError;
use crate::handing::Quiesce;

/// How a relay that may be asked to go quiet goes on.
pub(super) enum Step {
    Ended(Result<&'static str, ConnError>),
    /// Nothing in flight, every reply written: hand the parts back.
    Quiet,
    /// Not quiet in time: read requests again.
    Resume,
}

/// Resolves once `quiesce` (if any) is asked; never without one.
pub(super) async fn asked(quiesce: Option<&Quiesce>) {
    match quiesce {
        Some(q) => q.asked().await,
        None => std::future::pending().await,
    }
}

/// `relay::both_sides` with the hook: also ends when the request side
/// stopped for a hand-over and everything in flight is answered
/// (`Quiet`), or that does not happen within the timeout (`Resume`).
pub(super) async fn both_sides(
    mut requests: Pin<&mut impl Future<Output = Result<(), ConnError>>>,
    mut replies: Pin<&mut impl Future<Output = Result<&'static str, ConnError>>>,
    requests_done: &mut bool,
    (flight, quiesce): (&Flight, Option<&Quiesce>),
) -> Step {
    loop {
        let stopped = *requests_done && quiesce.is_some_and(Quiesce::is_stopped);
        tokio::select! {
            requested = &mut requests, if !*requests_done => match requested {
                Ok(()) => *requests_done = true,
                Err(e) => return Step::Ended(Err(e)),
            },
            replied = &mut replies => return Step::Ended(replied),
            quiet = quiet(flight, quiesce), if stopped => return quiet,
        }
    }
}

async fn quiet(flight: &Flight, quiesce: Option<&Quiesce>) -> Step {
    let Some(q) = quiesce else {
        return std::future::pending().await;
    };
    let deadline = q.asked_at().unwrap_or_else(Instant::now) + q.timeout();
    match tokio::time::timeout_at(deadline.into(), flight.wait_quiet()).await {
        Ok(()) => Step::Quiet,
        Err(_) => {
            q.cancel();
            Step::Resume
        }
    }
}
