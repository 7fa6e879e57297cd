//! nbdgw's own reads in flight (`Ahead`), and the sequential reads that
//! call for read-ahead (`Sequential`).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use crate::cache::Handle;
use crate::proto::transmission::Request;

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
pub struct Ahead {
    cookies: Mutex<HashMap<u64, Purpose>>,
    /// Where read-ahead ranges are marked as being fetched.
    handle: Handle,
}

impl Drop for Ahead {
    /// The session ended with read-ahead in flight: other connections may
    /// fetch those blocks again.
    fn drop(&mut self) {
        for purpose in self.lock().values() {
            if let Purpose::ReadAhead { offset, length } = *purpose {
                self.handle.set_pending(offset, length, false);
            }
        }
    }
}

impl Ahead {
    pub fn new(handle: Handle) -> Self {
        Ahead {
            cookies: Mutex::default(),
            handle,
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Purpose>> {
        self.cookies.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn read_aheads(&self) -> usize {
        let cookies = self.lock();
        cookies
            .values()
            .filter(|p| matches!(p, Purpose::ReadAhead { .. }))
            .count()
    }

    pub(super) fn fills(&self) -> usize {
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
        if let Some(Purpose::ReadAhead { offset, length }) = purpose {
            self.handle.set_pending(offset, length, false);
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
}
