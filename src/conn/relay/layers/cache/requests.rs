//! The read cache's request half: answers a READ whose bytes are all
//! cached (a hit never reaches the upstream), sends a READ that missed
//! upstream widened to whole blocks (a fill, under a cookie of nbdgw's
//! own), and plans read-ahead after sequential reads.

use std::sync::Arc;

use super::ahead::{Ahead, Purpose, Sequential};
use super::{Cached, FIRST_READ_AHEAD_COOKIE, MAX_HIT};
use crate::conn::relay::flight::Flight;
use crate::conn::relay::layers::{At, OnRequest, Verdict};
use crate::conn::relay::local::Local;
use crate::proto::consts::*;
use crate::proto::transmission::{encode_read_reply_header, InFlight, ReplyMode, Request};

/// The request side's half.
pub struct CacheRequests {
    cached: Cached,
    ahead: Arc<Ahead>,
    sequential: Sequential,
    next_cookie: u64,
    block: u64,
}

impl CacheRequests {
    pub fn new(cached: Cached, ahead: Arc<Ahead>) -> Self {
        let block = cached.handle.block_size();
        // Read-ahead in whole blocks: what is fetched is what is kept.
        let chunk = u64::from(cached.read_ahead) / block * block;
        let cached = Cached {
            read_ahead: u32::try_from(chunk).unwrap_or(0),
            ..cached
        };
        CacheRequests {
            cached,
            ahead,
            sequential: Sequential::default(),
            next_cookie: FIRST_READ_AHEAD_COOKIE,
            block,
        }
    }

    /// The reply to a READ, if every byte of it is cached.
    fn answer(&self, mode: ReplyMode, request: &Request) -> Option<Local> {
        if request.command != CMD_READ || request.length > MAX_HIT {
            return None;
        }
        let data = self.cached.handle.read(request.offset, request.length)?;
        let mut header = Vec::with_capacity(40);
        encode_read_reply_header(
            mode,
            request.cookie,
            request.offset,
            request.length,
            &mut header,
        );
        Some(Local::Data {
            cookie: request.cookie,
            header,
            data,
        })
    }

    /// Adds to `out` the read-ahead requests to send upstream after this
    /// client request, each already claimed in the flight table.
    fn read_ahead(&mut self, request: &Request, flight: &Flight, out: &mut Vec<Request>) {
        if request.command != CMD_READ {
            return;
        }
        let depth = u64::from(self.cached.depth);
        let room = (self.cached.depth as usize).saturating_sub(self.ahead.read_aheads());
        let handle = &self.cached.handle;
        let plan = self.sequential.observe(
            (request.offset, request.length),
            (handle.size(), self.block, u64::from(self.cached.read_ahead)),
            (depth, room),
            |offset, length| handle.missing(offset, length),
        );
        for (offset, length) in plan {
            self.cached.handle.set_pending(offset, length, true);
            let purpose = Purpose::ReadAhead { offset, length };
            out.push(self.own_read((offset, length), purpose, flight));
        }
    }

    /// For a READ that missed: the read of the whole blocks around it to
    /// send upstream instead, whose reply fills the cache and answers the
    /// client. `None` (forward the request as it is) for a read too long
    /// to answer from the cache, or not within the export, or when the
    /// connection has as many fills in flight as it may (each holds a
    /// buffer of its blocks until its reply is complete).
    fn fill(&mut self, request: &Request, flight: &Flight) -> Option<Request> {
        if request.command != CMD_READ {
            return None;
        }
        let size = self.cached.handle.size();
        let room = self.ahead.fills() < self.cached.fills as usize;
        let end = match request.offset.checked_add(request.length) {
            Some(end)
                if request.length != 0 && request.length <= MAX_HIT && end <= size && room =>
            {
                end
            }
            _ => {
                self.cached.handle.count_upstream_read();
                return None;
            }
        };
        let start = request.offset / self.block * self.block;
        let end = end
            .div_ceil(self.block)
            .saturating_mul(self.block)
            .min(size);
        Some(self.own_read((start, end - start), Purpose::Fill(*request), flight))
    }

    /// A READ of nbdgw's own, claimed in the flight table under a cookie
    /// no request in flight has.
    fn own_read(
        &mut self,
        (offset, length): (u64, u64),
        purpose: Purpose,
        flight: &Flight,
    ) -> Request {
        let in_flight = InFlight {
            command: CMD_READ,
            offset,
            length,
        };
        // A free cookie is found within a few tries: at most the client's
        // requests in flight and ours are taken.
        let cookie = loop {
            let cookie = self.next_cookie;
            self.next_cookie = self.next_cookie.wrapping_add(1);
            if flight.try_claim(cookie, in_flight) {
                break cookie;
            }
        };
        self.ahead.lock().insert(cookie, purpose);
        self.cached.handle.count_upstream_read();
        Request {
            flags: 0,
            command: CMD_READ,
            cookie,
            offset,
            length,
        }
    }
}

impl OnRequest for CacheRequests {
    /// A hit, a fill, or (a READ the cache cannot take) as it came. A READ
    /// that carries a payload (NBD_CMD_FLAG_PAYLOAD_LEN) is the upstream's
    /// to judge (qemu-nbd: EINVAL), payload and all: answering it here
    /// would leave its payload in the stream.
    fn request(&mut self, at: &At<'_>, request: &Request) -> Verdict {
        if request.command != CMD_READ {
            return Verdict::Pass;
        }
        if request.payload_len(at.mode) != 0 {
            self.cached.handle.count_upstream_read();
            return Verdict::Pass;
        }
        if let Some(hit) = self.answer(at.mode, request) {
            return Verdict::Answer(hit);
        }
        match self.fill(request, at.flight) {
            Some(fill) => Verdict::Instead(fill),
            None => Verdict::Pass,
        }
    }

    /// Read-ahead, in one write after the request: its replies fill the
    /// cache and never reach the client. None for a session that is
    /// closing: its replies would only hold the drain up.
    fn follow(&mut self, at: &At<'_>, request: &Request, out: &mut Vec<Request>) {
        if at.draining.is_none() && request.payload_len(at.mode) == 0 {
            self.read_ahead(request, at.flight, out);
        }
    }
}
