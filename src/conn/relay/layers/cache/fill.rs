//! What one reply has said so far: the ranges a reply that fills the
//! cache as it passes has covered (`Seen`), and a fill read's blocks as
//! they come (`Filling`).

use crate::cache::Fault;
use crate::proto::consts::*;
use crate::proto::transmission::{InFlight, Request};

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
pub struct Seen {
    ranges: Vec<(u64, u64)>,
    pub stopped: bool,
}

impl Seen {
    /// Adds `from..to`; false if it overlaps a range already covered. A
    /// range that would be the `MAX_RANGES + 1`th is not recorded, and
    /// stops the reply's caching.
    pub fn add(&mut self, from: u64, to: u64) -> bool {
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

pub fn within(req: &InFlight, offset: u64, length: u64) -> bool {
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
