//! Revocation by reload: a reload that revokes the session's certificate
//! or narrows its access ends the session. Two guards: the relay as a
//! whole stops at once when the reload signals (`until_ended`), even while
//! idle; and each request checks again before it may go upstream, since a
//! reload may have signalled while the request was being read.

use std::future::Future;

use super::{At, Layer, OnRequest, Verdict};
use crate::conn::error::ConnError;
use crate::proto::transmission::Request;
use crate::tls::SessionGuard;

/// For a session with a client certificate; anonymous sessions have no
/// registration and pass.
pub struct Revocation<'a>(&'a SessionGuard);

impl<'a> Revocation<'a> {
    pub fn new(registered: Option<&'a SessionGuard>) -> Option<Self> {
        registered.map(Revocation)
    }
}

impl Layer for Revocation<'_> {
    type Requests = Self;
    type Replies = ();
    fn split(self) -> (Self, ()) {
        (self, ())
    }
}

impl OnRequest for Revocation<'_> {
    fn request(&mut self, _at: &At<'_>, _request: &Request) -> Verdict {
        match self.0.signalled() {
            Some(why) => Verdict::End(ConnError::ended(why)),
            None => Verdict::Pass,
        }
    }
}

/// Runs `work` unless a reload ends the session first (its certificate
/// revoked, or its access narrowed).
pub async fn until_ended<T>(
    registered: Option<&SessionGuard>,
    work: impl Future<Output = Result<T, ConnError>>,
) -> Result<T, ConnError> {
    let Some(guard) = registered else {
        return work.await;
    };
    tokio::select! {
        // The end first: once signalled, the relay is not polled again, so
        // a request that arrives after the reload is never forwarded.
        biased;
        ended = guard.ended() => Err(ConnError::ended(ended)),
        result = work => result,
    }
}
