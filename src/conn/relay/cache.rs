//! The read cache as a layer of the relay, for a session on an immutable
//! export: the request side asks it to answer a READ (a hit never reaches
//! the upstream) and to plan read-ahead; the reply side gives it the
//! upstream's read data, and recognises the replies to read-ahead, which
//! fill the cache and never reach the client.
//!
//! Read-ahead requests go upstream on the session's own connection under
//! cookies nbdgw picks that are not in flight (`Flight::try_claim`); a
//! client that then reuses one waits, as for any cookie in flight, so
//! replies stay unambiguous.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use crate::cache::{Fault, Handle};
use crate::proto::consts::*;
use crate::proto::transmission::{encode_read_reply_header, InFlight, ReplyMode, Request};

use super::flight::Flight;
use super::local::Local;

/// Reads longer than this always go to the upstream (and fill the cache
/// on the way back): a hit is queued for the reply side with its blocks,
/// and the queue holds `LOCAL_QUEUE` of them, so this bounds what a
/// client that does not read its replies keeps alive.
pub const MAX_HIT: u64 = 2 * 1024 * 1024;
/// Cookies for read-ahead start here and count up, skipping any the
/// client has in flight: a client may use any value, so this is only
/// where a clash is least likely, not a reserved range.
const FIRST_READ_AHEAD_COOKIE: u64 = 0xcac4_e000_0000_0000;

/// What the session was configured with.
#[derive(Clone)]
pub struct Cached {
    pub handle: Handle,
    /// Bytes per read-ahead request; 0: none.
    pub read_ahead: u32,
    /// Read-ahead requests in flight at most.
    pub depth: u32,
    /// Fill reads in flight at most (`--cache-fill-depth`).
    pub fills: u32,
}

/// Why nbdgw sent a read of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// Read-ahead of this range: fills the cache, answers no one.
    ReadAhead { offset: u64, length: u64 },
    /// A client's read that missed, widened to whole blocks: fills the
    /// cache, and its data answers the client's request.
    Fill(Request),
}

/// nbdgw's own reads in flight, by cookie: the request side adds, the
/// reply side takes away. At most `depth` read-aheads and `fills` fills.
#[derive(Default)]
pub struct Ahead {
    cookies: Mutex<HashMap<u64, Purpose>>,
    /// Where read-ahead ranges are marked as being fetched.
    handle: Option<Handle>,
}

impl Drop for Ahead {
    /// The session ended with read-ahead in flight: other connections may
    /// fetch those blocks again.
    fn drop(&mut self) {
        let Some(handle) = &self.handle else {
            return;
        };
        for purpose in self.lock().values() {
            if let Purpose::ReadAhead { offset, length } = *purpose {
                handle.set_pending(offset, length, false);
            }
        }
    }
}

impl Ahead {
    pub fn new(handle: Option<Handle>) -> Self {
        Ahead {
            cookies: Mutex::default(),
            handle,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Purpose>> {
        self.cookies.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn read_aheads(&self) -> usize {
        let cookies = self.lock();
        cookies
            .values()
            .filter(|p| matches!(p, Purpose::ReadAhead { .. }))
            .count()
    }

    fn fills(&self) -> usize {
        let cookies = self.lock();
        cookies
            .values()
            .filter(|p| matches!(p, Purpose::Fill(_)))
            .count()
    }

    pub fn purpose(&self, cookie: u64) -> Option<Purpose> {
        self.lock().get(&cookie).copied()
    }

    /// The read's last reply has come: its blocks are cached (or the
    /// read failed) and no longer being fetched.
    pub fn done(&self, cookie: u64) {
        let purpose = self.lock().remove(&cookie);
        if let (Some(Purpose::ReadAhead { offset, length }), Some(handle)) = (purpose, &self.handle)
        {
            handle.set_pending(offset, length, false);
        }
    }
}

/// Where a connection's reads have been going: a run of reads each
/// starting where the one before ended is sequential.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Sequential {
    /// Where the next read of a run would start.
    next: u64,
    /// Reads in the current run.
    reads: u32,
    /// Where read-ahead has reached in this run.
    frontier: u64,
    /// The length of this run's next read-ahead: it starts at two blocks
    /// and doubles each time the run goes on, up to `--read-ahead`, so
    /// that a short run fetches little it will not read.
    window: u64,
}

impl Sequential {
    /// Notes a read; the ranges to fetch ahead now, if any: whole blocks
    /// from where read-ahead (or the read) has reached to one window past
    /// the read's end (the window grows to `chunk` as the run goes on),
    /// at most `room` requests (`depth` less those in flight), within the
    /// export's `size`. `missing` narrows a range to the part still to
    /// fetch (`None`: all cached).
    pub fn observe(
        &mut self,
        (offset, length): (u64, u64),
        (size, block, chunk): (u64, u64, u64),
        (depth, room): (u64, usize),
        missing: impl Fn(u64, u64) -> Option<(u64, u64)>,
    ) -> Vec<(u64, u64)> {
        let end = offset.saturating_add(length);
        if offset == self.next && self.reads > 0 {
            self.reads = self.reads.saturating_add(1);
        } else {
            *self = Sequential {
                next: end,
                reads: 1,
                frontier: 0,
                window: 0,
            };
        }
        self.next = end;
        let mut plan = Vec::new();
        // Three reads in a row make a run: a boot's short runs of two
        // reads would fetch ahead what nobody reads.
        if self.reads < 3 || chunk == 0 || block == 0 {
            return plan;
        }
        let window = match self.window {
            0 => block.saturating_mul(2).min(chunk),
            window => window,
        };
        let limit = end.saturating_add(window).min(size);
        let mut start = self.frontier.max(end / block * block);
        // Each turn moves `start` forward by at least a block, and at most
        // depth turns fetch: bounded by depth twice over.
        for _ in 0..depth * 2 {
            if plan.len() >= room || start >= limit {
                break;
            }
            let len = window.min(size - start);
            if let Some(range) = missing(start, len) {
                plan.push(range);
            }
            start += len;
            self.frontier = start;
        }
        if !plan.is_empty() {
            self.window = window.saturating_mul(2).min(chunk);
        }
        plan
    }
}

/// The request side's part.
pub struct RequestLayer<'a> {
    cached: Cached,
    ahead: &'a Ahead,
    sequential: Sequential,
    next_cookie: u64,
    block: u64,
}

impl<'a> RequestLayer<'a> {
    pub fn new(cached: Cached, ahead: &'a Ahead) -> Self {
        let block = cached.handle.block_size();
        // Read-ahead in whole blocks: what is fetched is what is kept.
        let chunk = u64::from(cached.read_ahead) / block * block;
        let cached = Cached {
            read_ahead: u32::try_from(chunk).unwrap_or(0),
            ..cached
        };
        RequestLayer {
            cached,
            ahead,
            sequential: Sequential::default(),
            next_cookie: FIRST_READ_AHEAD_COOKIE,
            block,
        }
    }

    /// The reply to a READ, if every byte of it is cached.
    pub fn answer(&self, mode: ReplyMode, request: &Request) -> Option<Local> {
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

    /// The read-ahead requests to send upstream after this client
    /// request, each already claimed in the flight table.
    pub fn read_ahead(&mut self, request: &Request, flight: &Flight) -> Vec<Request> {
        if request.command != CMD_READ {
            return Vec::new();
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
        plan.into_iter()
            .map(|(offset, length)| {
                self.cached.handle.set_pending(offset, length, true);
                let purpose = Purpose::ReadAhead { offset, length };
                self.own_read((offset, length), purpose, flight)
            })
            .collect()
    }

    /// For a READ that missed: the read of the whole blocks around it to
    /// send upstream instead, whose reply fills the cache and answers the
    /// client. `None` (forward the request as it is) for a read too long
    /// to answer from the cache, or not within the export, or when the
    /// connection has as many fills in flight as it may (each holds a
    /// buffer of its blocks until its reply is complete).
    pub fn fill(&mut self, request: &Request, flight: &Flight) -> Option<Request> {
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

/// The reply side's part.
pub struct ReplyLayer<'a> {
    pub handle: Handle,
    pub ahead: &'a Ahead,
    /// What each reply whose chunks fill the cache as they come
    /// (read-ahead, and client reads relayed as they are) has covered so
    /// far, by cookie: at most one entry per request in flight.
    seen: Mutex<HashMap<u64, Seen>>,
}

/// Past this many separate ranges in one reply (chunks out of order with
/// gaps between them, which no server this was tried with sends), the
/// rest of the reply is relayed without being cached: what is kept per
/// reply stays small without a flag. Its later chunks are still checked
/// against the ranges recorded, so that one contradicting a block cached
/// earlier has it forgotten.
const MAX_RANGES: usize = 64;

/// The byte ranges one reply's chunks covered: sorted, disjoint, merged
/// where they touch, at most `MAX_RANGES`. `stopped`: the rest of the
/// reply is not cached (it contradicted itself, or a range of it went
/// unrecorded, which a later chunk could overlap unseen).
#[derive(Default)]
struct Seen {
    ranges: Vec<(u64, u64)>,
    stopped: bool,
}

impl Seen {
    /// Adds `from..to`; false if it overlaps a range already covered. A
    /// range that would be the `MAX_RANGES + 1`th is not recorded, and
    /// stops the reply's caching.
    fn add(&mut self, from: u64, to: u64) -> bool {
        // The first range ending after `from`: the only one that can
        // overlap, and where the new one goes.
        let at = self.ranges.partition_point(|&(_, end)| end <= from);
        if self.ranges.get(at).is_some_and(|&(start, _)| start < to) {
            return false;
        }
        let joins_before = at > 0 && self.ranges[at - 1].1 == from;
        let joins_after = self.ranges.get(at).is_some_and(|&(start, _)| start == to);
        match (joins_before, joins_after) {
            (true, true) => {
                self.ranges[at - 1].1 = self.ranges[at].1;
                self.ranges.remove(at);
            }
            (true, false) => self.ranges[at - 1].1 = to,
            (false, true) => self.ranges[at].0 = from,
            (false, false) if self.ranges.len() < MAX_RANGES => self.ranges.insert(at, (from, to)),
            (false, false) => self.stopped = true,
        }
        true
    }
}

impl<'a> ReplyLayer<'a> {
    pub fn new(handle: Handle, ahead: &'a Ahead) -> Self {
        ReplyLayer {
            handle,
            ahead,
            seen: Mutex::default(),
        }
    }

    /// Data the upstream sent for `req` (under `cookie`): `data` is the
    /// export's bytes at `offset`, kept only if it lies within what was
    /// asked and overlaps no earlier chunk of the reply (an upstream that
    /// strays is relayed, never believed).
    pub fn data(&self, cookie: u64, req: &InFlight, offset: u64, data: &[u8], ours: bool) {
        if self.admit(cookie, req, offset, data.len() as u64) {
            self.handle.fill(offset, data, ours);
        } else if ours {
            self.handle.read_ahead_wasted(data.len() as u64);
        }
    }

    /// A hole the upstream reported: zeros.
    pub fn hole(&self, cookie: u64, req: &InFlight, offset: u64, length: u64, ours: bool) {
        if self.admit(cookie, req, offset, length) {
            self.handle.fill_zeros(offset, length, ours);
        }
    }

    /// A chunk of `req`'s reply (under `cookie`) that says nothing
    /// believable (outside the read): the rest of the reply is not
    /// cached, and what the read covers is forgotten.
    fn untrusted(&self, cookie: u64, req: &InFlight) {
        self.lock().entry(cookie).or_default().stopped = true;
        self.handle.forget(req.offset, req.length);
        self.handle.upstream_fault(
            Fault::Outside,
            (req.offset, req.length),
            "sent a chunk outside the read; the blocks the read touches are not cached",
        );
    }

    /// The reply under `cookie` is complete (or failed).
    pub fn reply_done(&self, cookie: u64) {
        self.lock().remove(&cookie);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Seen>> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a chunk may go into the cache. A chunk overlapping an
    /// earlier one of its reply (which the protocol forbids) means the
    /// upstream contradicts itself: the blocks it touches, which the
    /// earlier chunk may have filled, are forgotten, and nothing more of
    /// the reply is cached. (A reader that hit those blocks between the
    /// two chunks got the earlier chunk's bytes.) Every chunk is checked,
    /// also once the reply is no longer cached. A chunk outside the read
    /// is `untrusted`.
    fn admit(&self, cookie: u64, req: &InFlight, offset: u64, length: u64) -> bool {
        if length == 0 {
            return false;
        }
        if !within(req, offset, length) {
            self.untrusted(cookie, req);
            return false;
        }
        let mut seen = self.lock();
        let reply = seen.entry(cookie).or_default();
        if !reply.add(offset, offset + length) {
            reply.stopped = true;
            drop(seen);
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

/// Which bytes of a fill read the upstream's reply has covered so far:
/// one bit a byte, an eighth of the fill's own buffer. Counting bytes
/// would take two overlapping chunks for a whole reply, and the hole they
/// leave (zeros in the buffer) for data.
struct Coverage {
    words: Vec<u64>,
    len: u64,
}

impl Coverage {
    fn new(len: u64) -> Self {
        Coverage {
            words: vec![0; len.div_ceil(64) as usize],
            len,
        }
    }

    /// Marks `from..to` (within `len`) covered; false if any byte of it
    /// was already.
    fn mark(&mut self, from: u64, to: u64) -> bool {
        let mut fresh = true;
        let mut at = from;
        while at < to {
            let bit = at % 64;
            let n = (64 - bit).min(to - at);
            let mask = match n {
                64 => u64::MAX,
                n => ((1u64 << n) - 1) << bit,
            };
            let word = &mut self.words[(at / 64) as usize];
            fresh &= *word & mask == 0;
            *word |= mask;
            at += n;
        }
        fresh
    }

    /// Whether every byte is covered.
    fn complete(&self) -> bool {
        let full = (self.len / 64) as usize;
        let tail = self.len % 64;
        self.words[..full].iter().all(|&w| w == u64::MAX)
            && (tail == 0 || self.words[full] == (1u64 << tail) - 1)
    }
}

/// A fill read's reply as it comes: the whole blocks' bytes, which of
/// them the upstream has covered (data or hole), and its error if any.
pub struct Filling {
    base: u64,
    buf: Vec<u8>,
    coverage: Coverage,
    error: Option<u32>,
    /// What made the reply one nbdgw cannot vouch for.
    fault: Option<Fault>,
}

impl Filling {
    /// For the fill read `req` (at most `MAX_HIT` and two blocks long).
    pub fn new(req: &InFlight) -> Self {
        Filling {
            base: req.offset,
            buf: vec![0; req.length as usize],
            coverage: Coverage::new(req.length),
            error: None,
            fault: None,
        }
    }

    pub fn data(&mut self, offset: u64, data: &[u8]) {
        if self.place(offset, data.len() as u64) {
            let at = (offset - self.base) as usize;
            self.buf[at..at + data.len()].copy_from_slice(data);
        }
    }

    /// Zeros, as the buffer already holds.
    pub fn hole(&mut self, offset: u64, length: u64) {
        self.place(offset, length);
    }

    pub fn error(&mut self, error: u32) {
        self.error = self.error.or(Some(error));
    }

    fn place(&mut self, offset: u64, length: u64) -> bool {
        let req = InFlight {
            command: CMD_READ,
            offset: self.base,
            length: self.buf.len() as u64,
        };
        if !within(&req, offset, length) {
            // Data outside what was asked: the reply cannot be trusted.
            self.fault(Fault::Outside);
            return false;
        }
        let from = offset - self.base;
        if !self.coverage.mark(from, from + length) {
            // The protocol forbids a chunk overlapping an earlier one:
            // which of the two is the export's bytes is anyone's guess.
            self.fault(Fault::Overlap);
            return false;
        }
        true
    }

    fn fault(&mut self, what: Fault) {
        self.fault = self.fault.or(Some(what));
        self.error(EIO);
    }

    /// The data to answer the client's `request` with, or the error; on
    /// success the whole blocks go to `keep` (the cache) first. A reply
    /// that broke the protocol goes to `faulty` (the metric and the log),
    /// once per read, as the read fails with nothing of it cached.
    pub fn finish(
        mut self,
        request: &Request,
        keep: impl FnOnce(u64, &[u8]),
        faulty: impl FnOnce(Fault, (u64, u64), &str),
    ) -> Result<Vec<u8>, u32> {
        // A successful read covers every byte exactly once.
        if self.error.is_none() && !self.coverage.complete() {
            self.fault(Fault::Uncovered);
        }
        if let Some(error) = self.error {
            if let Some(fault) = self.fault {
                let what = match fault {
                    Fault::Overlap => "chunks that overlap",
                    Fault::Outside => "a chunk outside the read",
                    Fault::Uncovered => "success with bytes no chunk covered",
                };
                faulty(
                    fault,
                    (self.base, self.buf.len() as u64),
                    &format!("answered a read with {what}; the client's read fails with EIO and nothing of it is cached"),
                );
            }
            return Err(error);
        }
        keep(self.base, &self.buf);
        // The fill read was widened from the request, so it holds it.
        let at = request.offset.saturating_sub(self.base) as usize;
        let mut data = self.buf;
        data.truncate(at + request.length as usize);
        data.drain(..at);
        Ok(data)
    }
}

fn within(req: &InFlight, offset: u64, length: u64) -> bool {
    req.command == CMD_READ
        && offset >= req.offset
        && offset
            .checked_add(length)
            .is_some_and(|end| end <= req.offset.saturating_add(req.length))
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: u64 = 1024;

    fn run(reads: &[(u64, u64)], room: usize) -> Vec<Vec<(u64, u64)>> {
        let mut s = Sequential::default();
        reads
            .iter()
            .map(|&r| {
                s.observe(r, (1 << 20, 64 * K, 256 * K), (2, room), |o, l| {
                    Some((o, l))
                })
            })
            .collect()
    }

    #[test]
    fn a_single_read_or_random_reads_fetch_nothing_ahead() {
        assert!(run(&[(0, 4 * K)], 2)[0].is_empty());
        let random = run(&[(0, 4 * K), (100 * K, 4 * K), (8 * K, 4 * K)], 2);
        assert!(random.iter().all(Vec::is_empty));
    }

    #[test]
    fn a_run_fetches_whole_blocks_ahead_up_to_the_depth() {
        let reads: Vec<_> = (0..5).map(|i| (i * 4 * K, 4 * K)).collect();
        let plans = run(&reads, 2);
        // Two reads in a row are not yet a run.
        assert!(plans[0].is_empty() && plans[1].is_empty());
        // From the block the read ended in, two windows of two blocks.
        assert_eq!(plans[2], [(0, 128 * K), (128 * K, 128 * K)]);
        // The window doubles up to the chunk; read-ahead reaches one
        // window past the read's end, no more.
        assert_eq!(plans[3], [(256 * K, 256 * K)]);
        assert!(plans[4].is_empty());
        // No room (requests in flight): nothing.
        assert!(run(&reads[..3], 0)[2].is_empty());
    }

    #[test]
    fn read_ahead_follows_the_run_and_stops_at_the_end() {
        let mut s = Sequential::default();
        let mut fetched = Vec::new();
        let mut offset = 0;
        while offset < 1 << 20 {
            let plan = s.observe(
                (offset, 64 * K),
                (1 << 20, 64 * K, 256 * K),
                (2, 2),
                |o, l| Some((o, l)),
            );
            fetched.extend(plan);
            offset += 64 * K;
        }
        // Every byte past the run's third read once, in order, never
        // past the end.
        let mut at = 192 * K;
        for (o, l) in &fetched {
            assert_eq!(*o, at);
            at += l;
        }
        assert_eq!(at, 1 << 20);
    }

    #[test]
    fn cached_ranges_are_not_fetched() {
        let mut s = Sequential::default();
        for read in [(0, 4 * K), (4 * K, 4 * K)] {
            s.observe(read, (1 << 20, 64 * K, 256 * K), (2, 2), |_, _| None);
        }
        // The first window is cached, the others from their second block
        // on (windows of two blocks, as a run begins).
        let plan = s.observe(
            (8 * K, 4 * K),
            (1 << 20, 64 * K, 256 * K),
            (2, 2),
            |o, l| (o > 0).then_some((o + 64 * K, l - 64 * K)),
        );
        assert_eq!(plan, [(192 * K, 64 * K)]);
    }

    fn fill_of(offset: u64, length: u64) -> Filling {
        Filling::new(&InFlight {
            command: CMD_READ,
            offset,
            length,
        })
    }

    fn client_read(offset: u64, length: u64) -> Request {
        Request {
            command: CMD_READ,
            cookie: 9,
            offset,
            length,
            flags: 0,
        }
    }

    #[test]
    fn a_fill_answers_the_client_from_data_and_holes() {
        let mut f = fill_of(64 * K, 128 * K);
        f.data(64 * K, &[7; 64 * 1024]);
        f.hole(128 * K, 64 * K);
        let mut kept = None;
        let data = f
            .finish(
                &client_read(120 * K, 16 * K),
                |at, b| kept = Some((at, b.len())),
                |_, _, _| {},
            )
            .unwrap();
        assert_eq!(kept, Some((64 * K, 128 * 1024)));
        assert_eq!(&data[..8 * 1024], &[7; 8 * 1024]);
        assert_eq!(&data[8 * 1024..], &[0; 8 * 1024]);
    }

    #[test]
    fn a_fill_that_failed_or_fell_short_is_an_error_and_caches_nothing() {
        let never = |_: u64, _: &[u8]| panic!("cached a failed read");
        let read = client_read(64 * K, 4 * K);
        let mut short = fill_of(64 * K, 64 * K);
        short.data(64 * K, &[1; 4096]);
        assert_eq!(short.finish(&read, never, |_, _, _| {}), Err(EIO));
        let mut failed = fill_of(64 * K, 64 * K);
        failed.data(64 * K, &[1; 64 * 1024]);
        failed.error(ENOSPC);
        failed.error(EINVAL);
        assert_eq!(failed.finish(&read, never, |_, _, _| {}), Err(ENOSPC));
        let mut stray = fill_of(64 * K, 64 * K);
        stray.data(64 * K, &[1; 64 * 1024]);
        stray.data(0, &[1; 4096]);
        assert_eq!(stray.finish(&read, never, |_, _, _| {}), Err(EIO));
    }

    #[test]
    fn overlapping_chunks_that_leave_a_hole_are_an_error_and_cache_nothing() {
        let never = |_: u64, _: &[u8]| panic!("cached an incomplete read");
        let read = client_read(64 * K, 4 * K);
        // Two halves' worth of bytes, the second overlapping the first by
        // a quarter: as many bytes as the read, the last quarter uncovered.
        let mut f = fill_of(64 * K, 64 * K);
        f.data(64 * K, &[1; 32 * 1024]);
        f.data(80 * K, &[2; 32 * 1024]);
        assert_eq!(f.finish(&read, never, |_, _, _| {}), Err(EIO));
        // A hole overlapping data is the same.
        let mut f = fill_of(64 * K, 64 * K);
        f.data(64 * K, &[1; 64 * 1024]);
        f.hole(100 * K, 1);
        assert_eq!(f.finish(&read, never, |_, _, _| {}), Err(EIO));
        // Covered in any order, exactly once: the data.
        let mut f = fill_of(64 * K, 64 * K + 100);
        f.data(64 * K + 3, &[3; 64 * 1024 + 97]);
        f.hole(64 * K, 3);
        let data = f
            .finish(&client_read(64 * K, 8), |_, _| {}, |_, _, _| {})
            .unwrap();
        assert_eq!(data, [0, 0, 0, 3, 3, 3, 3, 3]);
    }

    #[test]
    fn a_replys_ranges_merge_and_overlaps_are_seen() {
        let mut seen = Seen::default();
        assert!(seen.add(100, 200));
        assert!(seen.add(300, 400));
        assert!(seen.add(200, 250));
        assert_eq!(seen.ranges, [(100, 250), (300, 400)]);
        assert!(seen.add(250, 300));
        assert_eq!(seen.ranges, [(100, 400)]);
        assert!(seen.add(0, 100));
        assert!(seen.add(500, 600));
        assert_eq!(seen.ranges, [(0, 400), (500, 600)]);
        for (from, to) in [
            (399, 401),
            (0, 1),
            (450, 501),
            (599, 700),
            (10, 20),
            (0, 700),
        ] {
            assert!(!seen.add(from, to), "{from}..{to}");
        }
        assert_eq!(seen.ranges, [(0, 400), (500, 600)]);
        assert!(seen.add(400, 500));
        assert_eq!(seen.ranges, [(0, 600)]);
    }

    #[test]
    fn past_the_range_cap_caching_stops_and_overlaps_are_still_seen() {
        let mut seen = Seen::default();
        for i in 0..MAX_RANGES as u64 {
            assert!(seen.add(i * 10, i * 10 + 5));
        }
        assert!(!seen.stopped);
        // One more separate range: not recorded, and caching stops.
        assert!(seen.add(10_000, 10_001));
        assert!(seen.stopped);
        assert_eq!(seen.ranges.len(), MAX_RANGES);
        // Touching ranges still merge; overlaps with recorded ones are seen.
        assert!(seen.add(5, 10));
        assert!(!seen.add(0, 1));
        assert!(!seen.add(634, 636));
    }

    #[test]
    fn coverage_is_every_byte_once() {
        for len in [1u64, 63, 64, 65, 200, 4096] {
            let mut c = Coverage::new(len);
            assert!(!c.complete());
            // Odd pieces, crossing word boundaries.
            let mut at = 0;
            for piece in [1u64, 70, 3, 64, 128, 1].iter().cycle() {
                if at >= len {
                    break;
                }
                let to = (at + piece).min(len);
                assert!(c.mark(at, to), "{len}: {at}..{to}");
                at = to;
            }
            assert!(c.complete(), "{len}");
            assert!(!c.mark(len - 1, len), "{len}: the last byte again");
        }
        let mut c = Coverage::new(256);
        assert!(c.mark(10, 100));
        assert!(!c.mark(99, 101));
        assert!(c.mark(101, 256));
        // 0..10 never covered.
        assert!(!c.complete());
    }

    #[test]
    fn only_data_within_the_request_is_believed() {
        let req = InFlight {
            command: CMD_READ,
            offset: 4096,
            length: 4096,
        };
        assert!(within(&req, 4096, 4096));
        assert!(within(&req, 6000, 100));
        assert!(!within(&req, 0, 4096));
        assert!(!within(&req, 8000, 200));
        assert!(!within(&req, u64::MAX, 2));
        let write = InFlight {
            command: CMD_WRITE,
            ..req
        };
        assert!(!within(&write, 4096, 4096));
    }
}
