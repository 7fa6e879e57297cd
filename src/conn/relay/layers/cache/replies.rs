//! The read cache's reply half: read data fills the cache as it passes
//! (client reads up to `TEE_MAX`, and nbdgw's own reads), the replies to
//! nbdgw's own reads are claimed (never relayed), and a fill's reply
//! answers the client read it was widened from.

use std::collections::HashMap;
use std::sync::Arc;

use super::ahead::{Ahead, Purpose};
use super::fill::{within, Filling, Seen};
use super::TEE_MAX;
use crate::cache::{Fault, Handle};
use crate::conn::relay::layers::{Answer, OnReply, Take};
use crate::proto::consts::*;
use crate::proto::transmission::{
    encode_error_reply, encode_read_reply_header, InFlight, ReplyFrame, ReplyMode, Request,
};
use crate::proto::{be_u32, be_u64};

/// The reply side's half.
pub struct CacheReplies {
    handle: Handle,
    ahead: Arc<Ahead>,
    mode: ReplyMode,
    /// What each reply whose chunks fill the cache as they come
    /// (read-ahead, and client reads relayed as they are) has covered so
    /// far, by cookie: at most one entry per request in flight.
    seen: HashMap<u64, Seen>,
    /// Fill reads whose replies have begun, by nbdgw's cookie: one at a
    /// time from an upstream that sends each reply's chunks together.
    fills: HashMap<u64, Filling>,
    /// Why nbdgw sent the request whose reply chunk is passing, if it did.
    purpose: Option<Purpose>,
}

impl CacheReplies {
    pub fn new(handle: Handle, ahead: Arc<Ahead>, mode: ReplyMode) -> Self {
        CacheReplies {
            handle,
            ahead,
            mode,
            seen: HashMap::new(),
            fills: HashMap::new(),
            purpose: None,
        }
    }

    /// Data the upstream sent for `req` (under `cookie`): `data` is the
    /// export's bytes at `offset`, kept only if it lies within what was
    /// asked and overlaps no earlier chunk of the reply (an upstream that
    /// strays is relayed, never believed).
    fn data(&mut self, cookie: u64, req: &InFlight, offset: u64, data: &[u8], ours: bool) {
        if self.admit(cookie, req, offset, data.len() as u64) {
            self.handle.fill(offset, data, ours);
        } else if ours {
            self.handle.read_ahead_wasted(data.len() as u64);
        }
    }

    /// A hole the upstream reported: zeros.
    fn hole(&mut self, cookie: u64, req: &InFlight, offset: u64, length: u64, ours: bool) {
        if self.admit(cookie, req, offset, length) {
            self.handle.fill_zeros(offset, length, ours);
        }
    }

    /// A chunk of `req`'s reply (under `cookie`) that says nothing
    /// believable (outside the read): the rest of the reply is not
    /// cached, and what the read covers is forgotten.
    fn untrusted(&mut self, cookie: u64, req: &InFlight) {
        self.seen.entry(cookie).or_default().stopped = true;
        self.handle.forget(req.offset, req.length);
        self.handle.upstream_fault(
            Fault::Outside,
            (req.offset, req.length),
            "sent a chunk outside the read; the blocks the read touches are not cached",
        );
    }

    /// Whether a chunk may go into the cache. A chunk overlapping an
    /// earlier one of its reply (which the protocol forbids) means the
    /// upstream contradicts itself: the blocks it touches, which the
    /// earlier chunk may have filled, are forgotten, and nothing more of
    /// the reply is cached. (A reader that hit those blocks between the
    /// two chunks got the earlier chunk's bytes.) Every chunk is checked,
    /// also once the reply is no longer cached. A chunk outside the read
    /// is `untrusted`.
    fn admit(&mut self, cookie: u64, req: &InFlight, offset: u64, length: u64) -> bool {
        if length == 0 {
            return false;
        }
        if !within(req, offset, length) {
            self.untrusted(cookie, req);
            return false;
        }
        let reply = self.seen.entry(cookie).or_default();
        if !reply.add(offset, offset + length) {
            reply.stopped = true;
            self.handle.forget(offset, length);
            self.handle.upstream_fault(
                Fault::Overlap,
                (offset, length),
                "sent chunks that overlap in one reply; the blocks they touch are not cached",
            );
            return false;
        }
        !reply.stopped
    }
}

impl OnReply for CacheReplies {
    /// nbdgw's own reads are claimed; client reads are teed when short
    /// enough. Decided by the read, not by each chunk: a longer client
    /// read is relayed wholly uncached, so that no chunk of it is cached
    /// without every other chunk of its reply having been seen (a small
    /// chunk could overlap a long one streamed past unrecorded).
    fn take(&mut self, cookie: u64, req: &InFlight) -> Take {
        self.purpose = self.ahead.purpose(cookie);
        if self.purpose.is_some() {
            Take::Claim
        } else if req.command == CMD_READ && req.length <= TEE_MAX {
            Take::Tee
        } else {
            Take::Pass
        }
    }

    /// What a chunk says of the export's bytes: a simple reply's data, an
    /// OFFSET_DATA chunk, an OFFSET_HOLE chunk; into the fill, or into the
    /// cache.
    fn payload(&mut self, frame: &ReplyFrame, req: &InFlight, payload: &[u8], claimed: bool) {
        if let Some(Purpose::Fill(_)) = self.purpose {
            let filling = self
                .fills
                .entry(frame.cookie)
                .or_insert_with(|| Filling::new(req));
            fill_from_chunk(filling, frame, req, payload);
            return;
        }
        match (frame.kind, chunk_offset(payload)) {
            (0, _) if frame.simple_error == 0 => {
                self.data(frame.cookie, req, req.offset, payload, claimed)
            }
            (REPLY_TYPE_OFFSET_DATA, Some(offset)) => {
                self.data(frame.cookie, req, offset, &payload[8..], claimed)
            }
            (REPLY_TYPE_OFFSET_HOLE, Some(offset)) => {
                if let Some(len) = payload.get(8..12) {
                    let len = be_u32(len, 0).into();
                    self.hole(frame.cookie, req, offset, len, claimed);
                }
            }
            _ => {}
        }
    }

    /// An error in a fill's reply fails the client's read.
    fn error(&mut self, cookie: u64, req: &InFlight, error: u32, claimed: bool) {
        if let (true, Some(Purpose::Fill(_))) = (claimed, self.purpose) {
            let filling = self
                .fills
                .entry(cookie)
                .or_insert_with(|| Filling::new(req));
            filling.error(error);
        }
    }

    /// A fill answers its client: its bytes, or the upstream's error.
    fn done(&mut self, cookie: u64, claimed: bool) -> Option<Answer> {
        self.seen.remove(&cookie);
        if !claimed {
            return None;
        }
        // Before the flight completes, so that a client request reusing
        // the cookie is never taken for one of nbdgw's.
        self.ahead.done(cookie);
        let filling = self.fills.remove(&cookie);
        match self.purpose.take()? {
            Purpose::Fill(request) => Some(self.answer_fill(&request, filling)),
            Purpose::ReadAhead { .. } => None,
        }
    }
}

impl CacheReplies {
    /// The answer to the client's read a fill read was made for.
    fn answer_fill(&self, request: &Request, filling: Option<Filling>) -> Answer {
        let handle = &self.handle;
        let answer = match filling {
            Some(filling) => filling.finish(
                request,
                |at, blocks| handle.fill(at, blocks, false),
                |fault, range, what| handle.upstream_fault(fault, range, what),
            ),
            // A reply with no data, hole or error for a read.
            None => Err(EIO),
        };
        let in_flight = InFlight::from(request);
        let mut bytes = Vec::with_capacity(64);
        let (data, error) = match answer {
            Ok(data) => {
                let (offset, length) = (request.offset, request.length);
                encode_read_reply_header(self.mode, request.cookie, offset, length, &mut bytes);
                (data, None)
            }
            Err(error) => {
                let message = "nbdgw: the upstream failed the read";
                let cookie = request.cookie;
                encode_error_reply(self.mode, cookie, &in_flight, error, message, &mut bytes);
                (Vec::new(), Some(error))
            }
        };
        Answer {
            cookie: request.cookie,
            request: in_flight,
            bytes,
            data,
            error,
        }
    }
}

/// The offset an OFFSET_DATA or OFFSET_HOLE chunk's payload starts with.
fn chunk_offset(payload: &[u8]) -> Option<u64> {
    payload.get(..8).map(|b| be_u64(b, 0))
}

/// What a chunk of a fill read's reply (`payload`, of `frame`) says of
/// the export's bytes, into the fill.
fn fill_from_chunk(filling: &mut Filling, frame: &ReplyFrame, req: &InFlight, payload: &[u8]) {
    match (frame.kind, chunk_offset(payload)) {
        (0, _) if frame.simple_error == 0 => filling.data(req.offset, payload),
        (REPLY_TYPE_OFFSET_DATA, Some(offset)) => filling.data(offset, &payload[8..]),
        (REPLY_TYPE_OFFSET_HOLE, Some(offset)) => match payload.get(8..12) {
            Some(len) => filling.hole(offset, be_u32(len, 0).into()),
            None => filling.error(EIO),
        },
        _ => filling.error(EIO),
    }
}
