//! The relay's per-request features, each a layer of one stack that the
//! two byte-moving loops (`requests`, `replies`) call: refusals,
//! revocation by reload, accounting, the read cache.
//!
//! NBD is pipelined and its replies come in any order, so a layer is not a
//! function from a request to its reply (nbdkit's filters can be, since
//! nbdkit calls each request on its own thread); it is two halves, one per
//! direction, that see events as the loops move bytes:
//!
//! - the request half ([`OnRequest`]) sees each request the client sends
//!   and says what becomes of it ([`Verdict`]): passed on, refused (an
//!   error reply nbdgw makes), answered locally (a cache hit), or replaced
//!   by a request of the layer's own under a cookie it claimed in the
//!   flight table (a cache fill); afterwards it may add requests of its
//!   own (read-ahead);
//! - the reply half ([`OnReply`]) sees each reply chunk's header and says
//!   whether it claims it ([`Take::Claim`]: a reply to one of its own
//!   cookies, which never reaches the client), wants to see its payload as
//!   it passes ([`Take::Tee`]), or lets it pass; then sees the payload,
//!   errors and the reply's end, where a layer that claimed a reply may
//!   answer the client request it was made for.
//!
//! The halves live in the two loops, which run concurrently; a layer whose
//! halves share state (the cache's reads in flight) shares it through an
//! `Arc` made when it is split, once per session.
//!
//! Dispatch is static: the stack is a nest of pairs (`Stack<((A, B), C)>`)
//! whose methods the compiler inlines into the loops; a layer that is off
//! for a session is an `Option` that passes everything.
//!
//! Who sees what (the pair impls below are the whole of it):
//!
//! - [`OnRequest::request`] asks the layers in the order they are stacked
//!   (outermost first); the first that does not pass a request decides
//!   it, and the ones after it are not asked. Every other event goes to
//!   every layer, whichever decided: [`OnRequest::arrived`] (each request
//!   read), [`OnRequest::refused`] (after a `Refuse`), and
//!   [`OnRequest::follow`], which runs after `Pass`, `Answer` and
//!   `Instead` but not after `Refuse` or `End`, so a layer must look at
//!   the request itself (the cache adds read-ahead only after a READ,
//!   whether it was passed or its own). Accounting sees every request and
//!   reply because it listens to `arrived` and `answered`, not because of
//!   its place in the stack.
//! - On the reply side every event goes to every layer: `take` is asked of
//!   each and the strongest wish wins (`Claim` over `Tee` over `Pass`);
//!   at most one layer may claim a reply, and at most one may answer from
//!   `done` (debug builds assert both; a release build keeps the first
//!   answer).
//! - [`Verdict::Answer`] and [`Verdict::Instead`] are only for requests
//!   without payload; the request loop drops a payload should a layer
//!   break that rule.
//!
//! Adding a layer is a file and a `.with(...)` in `relay::run`, unless it
//! needs what the interface does not carry: revocation, for one, also
//! needs its `until_ended` wired into `relay::run` to end a session
//! between requests. The reply loop keeps a scratch buffer for teed
//! payloads up to its own `SCRATCH_KEPT`; a layer teeing longer ones
//! allocates per reply.

pub mod accounting;
pub mod cache;
pub mod refusals;
pub mod revocation;

use std::time::Duration;

use super::flight::Flight;
use super::local::Local;
use crate::conn::error::ConnError;
use crate::proto::transmission::{InFlight, ReplyFrame, ReplyMode, Request};
use crate::shutdown::DrainAnswer;

/// What a request half decides for a client's request (claimed in the
/// flight table under the client's cookie).
pub enum Verdict {
    /// On to the next layer, and then upstream as it came.
    Pass,
    /// Refused: the client gets this error, nothing goes upstream.
    Refuse { error: u32, message: &'static str },
    /// Answered by the layer: the reply goes to the client as it is.
    /// Only for requests without payload (`request.payload_len(at.mode)`
    /// is 0): the loop drops the payload of one that has it (and asserts
    /// in debug builds), but the layer has answered what it never saw.
    Answer(Local),
    /// This request of the layer's own goes upstream instead (claimed in
    /// the flight table under its own cookie); the layer answers the
    /// client's request when that reply is done (see [`OnReply::done`]).
    /// Only for requests without payload, as for `Answer`.
    Instead(Request),
    /// The session ends before this request reaches the upstream.
    End(ConnError),
}

/// What the request side knows about one request besides the request.
pub struct At<'a> {
    pub mode: ReplyMode,
    pub flight: &'a Flight,
    /// The drain's phase as this request saw it (read once per request).
    pub draining: Option<DrainAnswer>,
}

/// A layer's request half. Every method has a default that does nothing.
pub trait OnRequest {
    /// Every request read, NBD_CMD_DISC and requests left unanswered by a
    /// drain included, once its fate is sealed.
    fn arrived(&mut self, _request: &Request) {}
    /// A request to decide.
    fn request(&mut self, _at: &At<'_>, _request: &Request) -> Verdict {
        Verdict::Pass
    }
    /// A layer refused `request` with `error` (its payload is read).
    fn refused(&mut self, _request: &Request, _error: u32) {}
    /// After `request` went its way: requests of the layer's own to send
    /// upstream too, each already claimed in `at.flight` under its own
    /// cookie, whose replies the layer claims.
    fn follow(&mut self, _at: &At<'_>, _request: &Request, _out: &mut Vec<Request>) {}
}

/// What a reply half wants of a reply chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Take {
    /// Relayed to the client as it comes, unseen.
    Pass,
    /// Relayed to the client, its payload read whole and shown first.
    Tee,
    /// A reply to one of the layer's own requests: shown, never relayed.
    Claim,
}

/// A client request answered by the layer that claimed the reply to its
/// own request (a fill): the reply's bytes, and its error if it is one.
pub struct Answer {
    pub cookie: u64,
    pub request: InFlight,
    pub bytes: Vec<u8>,
    pub data: Vec<u8>,
    pub error: Option<u32>,
}

/// A layer's reply half. Every method has a default that does nothing.
pub trait OnReply {
    /// A reply chunk to `cookie`, a request of `req`, begins.
    fn take(&mut self, _cookie: u64, _req: &InFlight) -> Take {
        Take::Pass
    }
    /// The payload of a chunk some layer claimed or teed (not an error's).
    fn payload(&mut self, _frame: &ReplyFrame, _req: &InFlight, _payload: &[u8], _claimed: bool) {}
    /// A reply carried `error` (a simple reply's, or an error chunk's);
    /// `claimed`: in a reply a layer claimed, which the client never sees.
    /// Also called, with `claimed` false, for an error reply a layer made
    /// itself from [`OnReply::done`] (a failed fill) as it goes to the
    /// client: the client got that error all the same.
    fn error(&mut self, _cookie: u64, _req: &InFlight, _error: u32, _claimed: bool) {}
    /// The reply to `cookie` is done. A layer that claimed it may answer
    /// the client request it made it for.
    fn done(&mut self, _cookie: u64, _claimed: bool) -> Option<Answer> {
        None
    }
    /// A client's request (`command`) was answered, `took` after it came.
    fn answered(&mut self, _command: u16, _took: Duration) {}
}

/// A layer: split into its two halves once per session.
pub trait Layer {
    type Requests: OnRequest;
    type Replies: OnReply;
    fn split(self) -> (Self::Requests, Self::Replies);
}

/// The stack being built: `Stack::new().with(a).with(b)` consults `a`,
/// then `b`.
pub struct Stack<L>(L);

impl Stack<()> {
    pub fn new() -> Self {
        Stack(())
    }
}

impl<L: Layer> Stack<L> {
    pub fn with<M: Layer>(self, layer: M) -> Stack<(L, M)> {
        Stack((self.0, layer))
    }

    pub fn split(self) -> (L::Requests, L::Replies) {
        self.0.split()
    }
}

impl OnRequest for () {}
impl OnReply for () {}

impl Layer for () {
    type Requests = ();
    type Replies = ();
    fn split(self) -> ((), ()) {
        ((), ())
    }
}

impl<A: Layer, B: Layer> Layer for (A, B) {
    type Requests = (A::Requests, B::Requests);
    type Replies = (A::Replies, B::Replies);
    fn split(self) -> (Self::Requests, Self::Replies) {
        let (a_req, a_rep) = self.0.split();
        let (b_req, b_rep) = self.1.split();
        ((a_req, b_req), (a_rep, b_rep))
    }
}

/// A layer that is off for this session passes everything.
impl<L: Layer> Layer for Option<L> {
    type Requests = Option<L::Requests>;
    type Replies = Option<L::Replies>;
    fn split(self) -> (Self::Requests, Self::Replies) {
        match self.map(Layer::split) {
            Some((requests, replies)) => (Some(requests), Some(replies)),
            None => (None, None),
        }
    }
}

impl<A: OnRequest, B: OnRequest> OnRequest for (A, B) {
    fn arrived(&mut self, request: &Request) {
        self.0.arrived(request);
        self.1.arrived(request);
    }
    fn request(&mut self, at: &At<'_>, request: &Request) -> Verdict {
        match self.0.request(at, request) {
            Verdict::Pass => self.1.request(at, request),
            decided => decided,
        }
    }
    fn refused(&mut self, request: &Request, error: u32) {
        self.0.refused(request, error);
        self.1.refused(request, error);
    }
    fn follow(&mut self, at: &At<'_>, request: &Request, out: &mut Vec<Request>) {
        self.0.follow(at, request, out);
        self.1.follow(at, request, out);
    }
}

impl<A: OnReply, B: OnReply> OnReply for (A, B) {
    fn take(&mut self, cookie: u64, req: &InFlight) -> Take {
        let (first, second) = (self.0.take(cookie, req), self.1.take(cookie, req));
        debug_assert!(
            first != Take::Claim || second != Take::Claim,
            "two layers claim the reply to {cookie:#x}"
        );
        first.max(second)
    }
    fn payload(&mut self, frame: &ReplyFrame, req: &InFlight, payload: &[u8], claimed: bool) {
        self.0.payload(frame, req, payload, claimed);
        self.1.payload(frame, req, payload, claimed);
    }
    fn error(&mut self, cookie: u64, req: &InFlight, error: u32, claimed: bool) {
        self.0.error(cookie, req, error, claimed);
        self.1.error(cookie, req, error, claimed);
    }
    fn done(&mut self, cookie: u64, claimed: bool) -> Option<Answer> {
        let first = self.0.done(cookie, claimed);
        let second = self.1.done(cookie, claimed);
        debug_assert!(
            first.is_none() || second.is_none(),
            "two layers answer from the reply to {cookie:#x}"
        );
        first.or(second)
    }
    fn answered(&mut self, command: u16, took: Duration) {
        self.0.answered(command, took);
        self.1.answered(command, took);
    }
}

impl<L: OnRequest> OnRequest for Option<L> {
    fn arrived(&mut self, request: &Request) {
        if let Some(layer) = self {
            layer.arrived(request);
        }
    }
    fn request(&mut self, at: &At<'_>, request: &Request) -> Verdict {
        match self {
            Some(layer) => layer.request(at, request),
            None => Verdict::Pass,
        }
    }
    fn refused(&mut self, request: &Request, error: u32) {
        if let Some(layer) = self {
            layer.refused(request, error);
        }
    }
    fn follow(&mut self, at: &At<'_>, request: &Request, out: &mut Vec<Request>) {
        if let Some(layer) = self {
            layer.follow(at, request, out);
        }
    }
}

impl<L: OnReply> OnReply for Option<L> {
    fn take(&mut self, cookie: u64, req: &InFlight) -> Take {
        self.as_mut().map_or(Take::Pass, |l| l.take(cookie, req))
    }
    fn payload(&mut self, frame: &ReplyFrame, req: &InFlight, payload: &[u8], claimed: bool) {
        if let Some(layer) = self {
            layer.payload(frame, req, payload, claimed);
        }
    }
    fn error(&mut self, cookie: u64, req: &InFlight, error: u32, claimed: bool) {
        if let Some(layer) = self {
            layer.error(cookie, req, error, claimed);
        }
    }
    fn done(&mut self, cookie: u64, claimed: bool) -> Option<Answer> {
        self.as_mut().and_then(|l| l.done(cookie, claimed))
    }
    fn answered(&mut self, command: u16, took: Duration) {
        if let Some(layer) = self {
            layer.answered(command, took);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::consts::*;

    /// A layer that decides every request with its `error` (0: passes),
    /// takes every reply as `take`, and records what it saw.
    #[derive(Default)]
    struct Probe {
        error: u32,
        take: Option<Take>,
        seen: Vec<&'static str>,
    }

    impl Layer for Probe {
        type Requests = Self;
        type Replies = Self;
        fn split(self) -> (Self, Self) {
            let take = self.take;
            (
                self,
                Probe {
                    take,
                    ..Probe::default()
                },
            )
        }
    }

    impl OnRequest for Probe {
        fn arrived(&mut self, _request: &Request) {
            self.seen.push("arrived");
        }
        fn request(&mut self, _at: &At<'_>, _request: &Request) -> Verdict {
            self.seen.push("request");
            match self.error {
                0 => Verdict::Pass,
                error => Verdict::Refuse {
                    error,
                    message: "no",
                },
            }
        }
    }

    impl OnReply for Probe {
        fn take(&mut self, _cookie: u64, _req: &InFlight) -> Take {
            self.take.unwrap_or(Take::Pass)
        }
    }

    fn read() -> Request {
        Request {
            flags: 0,
            command: CMD_READ,
            cookie: 1,
            offset: 0,
            length: 512,
        }
    }

    #[test]
    fn the_first_layer_that_decides_a_request_hides_it_from_the_rest() {
        let flight = Flight::new();
        let at = At {
            mode: ReplyMode::Simple,
            flight: &flight,
            draining: None,
        };
        let refuser = Probe {
            error: EPERM,
            ..Probe::default()
        };
        let (mut requests, _) = Stack::new()
            .with(Probe::default())
            .with(refuser)
            .with(Probe::default())
            .split();
        requests.arrived(&read());
        let verdict = requests.request(&at, &read());
        assert!(matches!(verdict, Verdict::Refuse { error: EPERM, .. }));
        let (((_, first), second), third) = requests;
        assert_eq!(first.seen, ["arrived", "request"]);
        assert_eq!(second.seen, ["arrived", "request"]);
        // Every layer sees a request arrive; only those up to the one that
        // decided it are asked.
        assert_eq!(third.seen, ["arrived"]);
    }

    #[test]
    fn a_claim_beats_a_tee_and_a_layer_that_is_off_passes() {
        let req = InFlight {
            command: CMD_READ,
            offset: 0,
            length: 512,
        };
        let (_, mut replies) = Stack::new()
            .with(Probe {
                take: Some(Take::Tee),
                ..Probe::default()
            })
            .with(Some(Probe {
                take: Some(Take::Claim),
                ..Probe::default()
            }))
            .split();
        assert_eq!(replies.take(1, &req), Take::Claim);
        let (_, mut replies) = Stack::new()
            .with(Probe {
                take: Some(Take::Tee),
                ..Probe::default()
            })
            .with(None::<Probe>)
            .split();
        assert_eq!(replies.take(1, &req), Take::Tee);
        let mut off = Stack::new().with(None::<Probe>).split();
        let at = At {
            mode: ReplyMode::Simple,
            flight: &Flight::new(),
            draining: None,
        };
        assert!(matches!(off.0.request(&at, &read()), Verdict::Pass));
    }
}
