//! A shared read cache for exports the operator declared immutable
//! (`--immutable-export`, `--immutable`), after nbdkit's `cache` filter:
//! a layer the relay's request path asks before forwarding a READ, and
//! its reply path fills from the upstream's answers.
//!
//! The core (`BlockMap`) knows nothing of sockets or framing: fixed-size
//! aligned blocks keyed by an export generation and a block index,
//! evicted by CLOCK with a small use count (a block read again survives
//! more sweeps than one read once, so a single pass over a large image
//! does not flush what every VM reads), bounded by a number of blocks
//! fixed at start. `ReadCache` puts it behind one lock, shared by every
//! connection, and counts what happens into the metrics.
//!
//! An export's blocks belong to a generation: the upstream's socket and
//! export name, the server that answered there (`Incarnation`: its socket
//! file and its credentials), and the size and flags it reported. A
//! session that reached another server or sees another size or flags
//! starts a new generation and drops the old one's blocks; a session
//! still holding the old generation neither reads nor fills the cache
//! from then on, so what a session of the old server brings in never
//! lands in the new server's generation.

mod eviction;
mod settings;
pub use settings::ReadCacheSettings;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytes::Bytes;

use crate::metrics::CacheMetrics;
use crate::upstream::Incarnation;

/// Block size: large enough that a boot's scattered 4 KiB reads pull in
/// their neighbours, small enough that a 256 MiB cache holds 4096 blocks.
pub const BLOCK_SIZE: u64 = 64 * 1024;
/// `--cache-block-size`: a power of two from 4 KiB to `BLOCK_SIZE` (the
/// largest, which holes' shared zeros cover).
pub fn parse_block_size(text: &str) -> Result<u64, String> {
    let size: u64 = text.parse().map_err(|e| format!("{e}"))?;
    if size.is_power_of_two() && (4096..=BLOCK_SIZE).contains(&size) {
        Ok(size)
    } else {
        Err(format!(
            "{size} is not a power of two from 4096 to {BLOCK_SIZE}"
        ))
    }
}

/// `--cache-size` when not given.
pub const DEFAULT_CACHE_SIZE: u64 = 256 * 1024 * 1024;
/// `--read-ahead` when not given: the length of one read-ahead request.
pub const DEFAULT_READ_AHEAD: u32 = 1024 * 1024;
/// `--read-ahead-depth` when not given: one request filling while the
/// client reads what the other brought.
pub const DEFAULT_READ_AHEAD_DEPTH: u32 = 2;
/// `--cache-fill-depth` when not given. A fill holds the whole blocks of
/// a client read that missed (at most 2 MiB and two blocks) until its
/// reply is complete, so this bounds a connection's fill buffers to about
/// 36 MiB; a boot's reads, far shorter, need a few.
pub const DEFAULT_CACHE_FILL_DEPTH: u32 = 16;
/// Distinct export generations remembered at once. With `--immutable` on
/// a single `--upstream`, a client chooses export names; past this many,
/// exports with no block cached are forgotten, and new ones go uncached.
pub const MAX_EXPORTS: usize = 4096;
/// The highest use count a block reaches: a block read four times
/// survives four sweeps of the clock hand without being read again.
const MAX_USES: u8 = 3;

/// Zeros for holes: a hole's blocks share this, costing no memory.
static ZEROS: [u8; BLOCK_SIZE as usize] = [0; BLOCK_SIZE as usize];

/// Which export a cached block is of: the upstream's socket and the name
/// it is asked for (the client's name for it is not part of it: two
/// names for one upstream export share its blocks).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ExportKey {
    pub socket: PathBuf,
    pub upstream_name: String,
}

/// A generation of one export's blocks.
pub type Generation = u64;

#[derive(Debug)]
struct ExportState {
    generation: Generation,
    incarnation: Incarnation,
    size: u64,
    flags: u16,
}

/// Why an export's generation ended (a metric's label: a fixed few).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Another server answers at its socket.
    Replaced,
    /// The same server reports another size or flags.
    Resized,
}

/// How an upstream's reply to a read broke the protocol (a metric's
/// label: a fixed few).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Chunks that overlap.
    Overlap,
    /// A chunk outside the read.
    Outside,
    /// Success with bytes no chunk covered.
    Uncovered,
}

impl Fault {
    pub fn label(self) -> &'static str {
        match self {
            Fault::Overlap => "overlap",
            Fault::Outside => "outside",
            Fault::Uncovered => "uncovered",
        }
    }
}

/// At most one warning of an upstream's faulty replies this often: the
/// upstream may be a tenant's, and every read of it could fault. The
/// metric counts them all.
const FAULT_WARNING_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

impl Change {
    pub fn label(self) -> &'static str {
        match self {
            Change::Replaced => "replaced",
            Change::Resized => "resized",
        }
    }
}

/// A generation still current: its export's size, and its blocks.
#[derive(Debug)]
struct Live {
    size: u64,
    blocks: usize,
}

#[derive(Debug)]
struct Slot {
    key: (Generation, u64),
    data: Bytes,
    uses: u8,
    /// Filled by read-ahead and not read since: wasted if evicted so.
    prefetched: bool,
}

/// What an operation did, for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Events {
    pub evicted: u64,
    /// Blocks dropped because their export's generation ended.
    pub dropped: u64,
    /// A generation ended, and why.
    pub ended: Option<Change>,
    /// A session's server no longer answers at its socket: not cached.
    pub superseded: bool,
    pub read_ahead_used: u64,
    pub read_ahead_wasted: u64,
    /// Bytes added (positive) or removed.
    pub bytes_delta: i64,
    pub inserted: u64,
    pub inserted_bytes: u64,
}

/// The pure core: the block map and its eviction.
#[derive(Debug)]
pub struct BlockMap {
    block_size: u64,
    max_blocks: usize,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    index: HashMap<(Generation, u64), usize>,
    hand: usize,
    exports: HashMap<ExportKey, ExportState>,
    /// Each current generation's size (to bound a tail block) and count.
    live: HashMap<Generation, Live>,
    next_generation: Generation,
    bytes: u64,
    /// Blocks some connection's read-ahead is fetching: not fetched
    /// again by another's. At most every connection's read-ahead depth
    /// in windows of blocks.
    pending: std::collections::HashSet<(Generation, u64)>,
}

/// The blocks that cover a read, as slices in order.
pub type Covered = Vec<Bytes>;

impl BlockMap {
    /// Holds at most `capacity / block_size` blocks; `block_size` must be
    /// a power of two no larger than `BLOCK_SIZE` (holes share `ZEROS`).
    pub fn new(capacity: u64, block_size: u64) -> Self {
        debug_assert!(block_size.is_power_of_two() && block_size <= BLOCK_SIZE);
        BlockMap {
            block_size,
            max_blocks: usize::try_from(capacity / block_size).unwrap_or(usize::MAX),
            slots: Vec::new(),
            free: Vec::new(),
            index: HashMap::new(),
            hand: 0,
            exports: HashMap::new(),
            live: HashMap::new(),
            next_generation: 1,
            bytes: 0,
            pending: std::collections::HashSet::new(),
        }
    }

    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// Bytes held in blocks now.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn blocks(&self) -> usize {
        self.index.len()
    }

    /// The generation of `key` as a session now sees it (the server it
    /// reached, `size` and `flags` as that server reported them): the
    /// current one if they match, else a new one, the old one's blocks
    /// dropped. `None` when too many exports are known already, or when
    /// the server is not the one the export knows and `current` (asked
    /// then, under the cache's lock) says it no longer answers at the
    /// socket: a session of a server since replaced, opening late, never
    /// takes the export back from the new server's generation.
    pub fn open(
        &mut self,
        key: &ExportKey,
        incarnation: Incarnation,
        (size, flags): (u64, u16),
        current: impl FnOnce() -> bool,
    ) -> (Option<Generation>, Events) {
        let mut events = Events::default();
        let known = self.exports.get(key).map(|state| state.incarnation);
        if known != Some(incarnation) && !current() {
            events.superseded = true;
            return (None, events);
        }
        if let Some(state) = self.exports.get(key) {
            let change = if state.incarnation != incarnation {
                Change::Replaced
            } else if state.size != size || state.flags != flags {
                Change::Resized
            } else {
                return (Some(state.generation), events);
            };
            let old = state.generation;
            events = self.drop_generation(old);
            events.ended = Some(change);
            self.live.remove(&old);
            self.exports.remove(key);
        }
        if self.exports.len() >= MAX_EXPORTS {
            let live = &mut self.live;
            self.exports.retain(|_, state| {
                let keep = live.get(&state.generation).is_some_and(|l| l.blocks > 0);
                if !keep {
                    live.remove(&state.generation);
                }
                keep
            });
            if self.exports.len() >= MAX_EXPORTS {
                return (None, events);
            }
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        self.exports.insert(
            key.clone(),
            ExportState {
                generation,
                incarnation,
                size,
                flags,
            },
        );
        self.live.insert(generation, Live { size, blocks: 0 });
        (Some(generation), events)
    }

    /// The block indices a read of `length` bytes at `offset` touches, if
    /// it lies within an export of `size` bytes.
    fn span(&self, size: u64, offset: u64, length: u64) -> Option<std::ops::RangeInclusive<u64>> {
        let end = offset.checked_add(length)?;
        if length == 0 || end > size {
            return None;
        }
        Some(offset / self.block_size..=(end - 1) / self.block_size)
    }

    /// The bytes of the read, if every block it touches is cached; each
    /// touched block counts one more use.
    pub fn lookup(
        &mut self,
        generation: Generation,
        offset: u64,
        length: u64,
    ) -> (Option<Covered>, Events) {
        let mut events = Events::default();
        let Some(size) = self.live.get(&generation).map(|l| l.size) else {
            return (None, events);
        };
        let Some(span) = self.span(size, offset, length) else {
            return (None, events);
        };
        let mut found = Vec::new();
        for block in span.clone() {
            match self.index.get(&(generation, block)) {
                Some(&slot) => found.push(slot),
                None => return (None, events),
            }
        }
        let end = offset + length;
        let mut covered = Vec::with_capacity(found.len());
        for (block, slot) in span.zip(found) {
            let Some(slot) = self.slots[slot].as_mut() else {
                return (None, events);
            };
            let start = block * self.block_size;
            let from = offset.saturating_sub(start);
            let to = (end - start).min(slot.data.len() as u64);
            // Blocks are whole (or the export's tail), so this holds; a
            // short one is a miss rather than wrong data.
            if from >= to {
                return (None, events);
            }
            covered.push(slot.data.slice(from as usize..to as usize));
            slot.uses = (slot.uses + 1).min(MAX_USES);
            if std::mem::take(&mut slot.prefetched) {
                events.read_ahead_used += slot.data.len() as u64;
            }
        }
        (Some(covered), events)
    }

    /// The part of a read from its first block not cached to its last,
    /// without counting a use (read-ahead asks this before fetching);
    /// `None` when every block is cached. Outside the export: all of it.
    pub fn missing(&self, generation: Generation, offset: u64, length: u64) -> Option<(u64, u64)> {
        let size = self.live.get(&generation).map(|l| l.size)?;
        let Some(span) = self.span(size, offset, length) else {
            return Some((offset, length));
        };
        let absent = |block: &u64| {
            let key = (generation, *block);
            !self.index.contains_key(&key) && !self.pending.contains(&key)
        };
        let first = span.clone().find(absent)?;
        let last = span.rev().find(absent).unwrap_or(first);
        let start = (first * self.block_size).max(offset);
        let end = ((last + 1) * self.block_size).min(offset + length);
        Some((start, end - start))
    }

    /// Marks (or, with `on` false, unmarks) the blocks of a read-ahead
    /// range as being fetched.
    pub fn set_pending(&mut self, generation: Generation, offset: u64, length: u64, on: bool) {
        let Some(size) = self.live.get(&generation).map(|l| l.size) else {
            return;
        };
        let Some(span) = self.span(size, offset, length) else {
            return;
        };
        for block in span {
            match on {
                true => self.pending.insert((generation, block)),
                false => self.pending.remove(&(generation, block)),
            };
        }
    }

    /// Caches the whole blocks inside `data`, which is the export's bytes
    /// at `offset`; partial blocks at either end are not kept.
    pub fn insert(
        &mut self,
        generation: Generation,
        offset: u64,
        data: &[u8],
        prefetched: bool,
    ) -> Events {
        self.fill(
            generation,
            offset,
            data.len() as u64,
            prefetched,
            |from, to| Bytes::copy_from_slice(&data[from..to]),
        )
    }

    /// Caches the whole blocks of a hole (zeros) of `length` at `offset`.
    pub fn insert_zeros(
        &mut self,
        generation: Generation,
        offset: u64,
        length: u64,
        prefetched: bool,
    ) -> Events {
        self.fill(generation, offset, length, prefetched, |from, to| {
            Bytes::from_static(&ZEROS[..to - from])
        })
    }

    /// Drops the blocks a range of the export touches (the upstream
    /// contradicted itself about them).
    pub fn forget(&mut self, generation: Generation, offset: u64, length: u64) -> Events {
        let mut events = Events::default();
        let Some(size) = self.live.get(&generation).map(|l| l.size) else {
            return events;
        };
        let Some(span) = self.span(size, offset, length) else {
            return events;
        };
        for block in span {
            if let Some(&at) = self.index.get(&(generation, block)) {
                self.remove(at, &mut events);
            }
        }
        events
    }

    fn fill(
        &mut self,
        generation: Generation,
        offset: u64,
        length: u64,
        prefetched: bool,
        mut bytes: impl FnMut(usize, usize) -> Bytes,
    ) -> Events {
        let mut events = Events::default();
        let Some(size) = self.live.get(&generation).map(|l| l.size) else {
            return events;
        };
        let Some(end) = offset.checked_add(length).filter(|&end| end <= size) else {
            return events;
        };
        if self.max_blocks == 0 || length == 0 {
            return events;
        }
        let bs = self.block_size;
        // The first block that starts inside the data.
        let mut block = offset.div_ceil(bs);
        loop {
            let start = block * bs;
            let block_end = (start + bs).min(size);
            if start >= size || block_end > end {
                break;
            }
            if !self.index.contains_key(&(generation, block)) {
                let data = bytes((start - offset) as usize, (block_end - offset) as usize);
                self.put((generation, block), data, prefetched, &mut events);
            }
            block += 1;
        }
        events
    }
}

/// The cache every connection shares.
pub struct ReadCache {
    map: Mutex<BlockMap>,
    metrics: CacheMetrics,
    /// When an upstream's fault was last warned of, and how many came
    /// since without a warning.
    fault_warned: Mutex<Option<(std::time::Instant, u64)>>,
}

impl ReadCache {
    pub fn new(capacity: u64, metrics: CacheMetrics) -> Arc<Self> {
        Self::with_block_size(capacity, BLOCK_SIZE, metrics)
    }

    pub fn with_block_size(capacity: u64, block_size: u64, metrics: CacheMetrics) -> Arc<Self> {
        metrics.capacity_bytes.set(capacity as i64);
        Arc::new(ReadCache {
            map: Mutex::new(BlockMap::new(capacity, block_size)),
            metrics,
            fault_warned: Mutex::new(None),
        })
    }

    fn lock(&self) -> MutexGuard<'_, BlockMap> {
        // The map stays consistent even if a holder panicked.
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn count(&self, events: Events) {
        let m = &self.metrics;
        m.evictions.inc_by(events.evicted);
        m.invalidated_blocks.inc_by(events.dropped);
        m.read_ahead_used_bytes.inc_by(events.read_ahead_used);
        m.read_ahead_wasted_bytes.inc_by(events.read_ahead_wasted);
        m.cached_bytes.inc_by(events.bytes_delta);
    }

    /// A session's view of an export: `None` when the cache cannot take
    /// one more export.
    /// `current` says whether the session's server still answers at the
    /// socket (see `BlockMap::open`).
    pub fn open(
        self: &Arc<Self>,
        key: &ExportKey,
        incarnation: Incarnation,
        (size, flags): (u64, u16),
        current: impl FnOnce() -> bool,
    ) -> Option<Handle> {
        let (generation, events) = self.lock().open(key, incarnation, (size, flags), current);
        self.count(events);
        if let Some(change) = events.ended {
            self.metrics.generation_ended(change.label());
            let why = match change {
                Change::Replaced => "another server answers at the export's socket",
                Change::Resized => "the upstream reported another size or flags",
            };
            // A tenant's directory and socket names are in the path.
            let socket = key.socket.display().to_string();
            tracing::info!(
                socket = %crate::logsafe::Escaped(&socket),
                blocks = events.dropped,
                server_pid = incarnation.pid,
                size,
                flags = format_args!("{flags:#x}"),
                "read cache: {why}; the export's cached blocks are dropped"
            );
        }
        Some(Handle {
            cache: self.clone(),
            generation: generation?,
            size,
        })
    }
}

/// One session's handle on its export's generation.
#[derive(Clone)]
pub struct Handle {
    cache: Arc<ReadCache>,
    generation: Generation,
    size: u64,
}

impl Handle {
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn block_size(&self) -> u64 {
        self.cache.lock().block_size()
    }

    /// The read's bytes, if all cached: a hit or a miss is counted.
    pub fn read(&self, offset: u64, length: u64) -> Option<Covered> {
        let (covered, events) = self.cache.lock().lookup(self.generation, offset, length);
        self.cache.count(events);
        match covered.is_some() {
            true => self.cache.metrics.hits.inc(),
            false => self.cache.metrics.misses.inc(),
        };
        covered
    }

    pub fn missing(&self, offset: u64, length: u64) -> Option<(u64, u64)> {
        self.cache.lock().missing(self.generation, offset, length)
    }

    /// A READ of this export goes upstream: a fill, a read-ahead, or a
    /// client read the cache does not answer.
    pub fn count_upstream_read(&self) {
        self.cache.metrics.upstream_reads.inc();
    }

    /// Read-ahead of this range is on its way (`on`), or over.
    pub fn set_pending(&self, offset: u64, length: u64, on: bool) {
        self.cache
            .lock()
            .set_pending(self.generation, offset, length, on);
    }

    /// The upstream's data for `offset`.
    pub fn fill(&self, offset: u64, data: &[u8], prefetched: bool) {
        let events = self
            .cache
            .lock()
            .insert(self.generation, offset, data, prefetched);
        self.count(events, prefetched, data.len() as u64);
    }

    /// Drops the cached blocks `offset..offset + length` touches.
    pub fn forget(&self, offset: u64, length: u64) {
        let events = self.cache.lock().forget(self.generation, offset, length);
        self.cache.count(events);
    }

    /// A hole the upstream reported.
    pub fn fill_zeros(&self, offset: u64, length: u64, prefetched: bool) {
        let events = self
            .cache
            .lock()
            .insert_zeros(self.generation, offset, length, prefetched);
        self.count(events, prefetched, length);
    }

    /// Read-ahead counts what it fetched: kept (`read_ahead_bytes`), or
    /// not kept because it was cached already or evicted at once.
    fn count(&self, events: Events, prefetched: bool, fetched: u64) {
        if prefetched {
            let kept = events.inserted_bytes;
            self.cache.metrics.read_ahead_bytes.inc_by(kept);
            self.read_ahead_wasted(fetched.saturating_sub(kept));
        }
        self.cache.count(events);
    }

    /// The upstream's reply to a read of `offset..offset + length` broke
    /// the protocol (`kind`); `what` says how and what came of it, for
    /// the log. Counted always, warned of at most once in
    /// `FAULT_WARNING_EVERY`.
    pub fn upstream_fault(&self, kind: Fault, (offset, length): (u64, u64), what: &str) {
        self.cache.metrics.upstream_fault(kind.label());
        let now = std::time::Instant::now();
        let mut warned = self
            .cache
            .fault_warned
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let not_logged = match &mut *warned {
            Some((at, quiet)) if now.duration_since(*at) < FAULT_WARNING_EVERY => {
                *quiet += 1;
                return;
            }
            Some((_, quiet)) => *quiet,
            None => 0,
        };
        *warned = Some((now, 0));
        drop(warned);
        tracing::warn!(
            offset,
            length,
            kind = kind.label(),
            not_logged,
            "read cache: the upstream {what} (one such warning in 10 s at most; not_logged counts those since the last, the metric nbdgw_cache_upstream_faults_total all of them)"
        );
    }

    /// Read-ahead bytes fetched but not cached (already there, or the
    /// export changed meanwhile) count as wasted.
    pub fn read_ahead_wasted(&self, bytes: u64) {
        self.cache.metrics.read_ahead_wasted_bytes.inc_by(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(name: &str) -> ExportKey {
        ExportKey {
            socket: PathBuf::from("/run/x.sock"),
            upstream_name: name.to_string(),
        }
    }

    /// The server `n` answering at the socket.
    fn server(n: u64) -> Incarnation {
        Incarnation {
            file: crate::exports::SocketFile::test_file(n),
            pid: 100 + n as i32,
            uid: 0,
            gid: 0,
        }
    }

    fn image(size: usize) -> Vec<u8> {
        (0..size).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    fn concat(covered: Covered) -> Vec<u8> {
        covered.iter().flat_map(|b| b.iter().copied()).collect()
    }

    #[test]
    fn a_read_is_answered_only_when_every_block_it_touches_is_cached() {
        let img = image(10 * 1024 + 100);
        let mut map = BlockMap::new(1 << 20, 1024);
        let (g, _) = map.open(&key("a"), server(1), (img.len() as u64, 1), || true);
        let g = g.unwrap();
        // Partial blocks at both ends are not kept.
        map.insert(g, 500, &img[500..3500], false);
        assert_eq!(map.blocks(), 2);
        assert!(map.lookup(g, 1024, 2048).0.is_some());
        assert!(map.lookup(g, 1000, 100).0.is_none());
        assert!(map.lookup(g, 3000, 100).0.is_none());
        let got = concat(map.lookup(g, 1100, 1500).0.unwrap());
        assert_eq!(got, &img[1100..2600]);
        // The export's tail block is shorter, and is kept.
        map.insert(g, 10 * 1024, &img[10 * 1024..], false);
        assert_eq!(
            concat(map.lookup(g, 10 * 1024 + 1, 99).0.unwrap()),
            &img[10 * 1024 + 1..]
        );
        // Past the end, or empty: never a hit.
        assert!(map.lookup(g, 10 * 1024, 101).0.is_none());
        assert!(map.lookup(g, 1024, 0).0.is_none());
        assert!(map.lookup(g, u64::MAX, 2).0.is_none());
        // What read-ahead would still have to fetch.
        assert_eq!(map.missing(g, 1024, 2048), None);
        assert_eq!(map.missing(g, 0, 4096), Some((0, 4096)));
        assert_eq!(map.missing(g, 1024, 4096), Some((3072, 2048)));
        assert_eq!(map.missing(g, 2048, 1024), None);
        // Blocks another connection is fetching need not be fetched.
        map.set_pending(g, 3072, 2048, true);
        assert_eq!(map.missing(g, 1024, 6144), Some((5120, 2048)));
        map.set_pending(g, 3072, 2048, false);
        assert_eq!(map.missing(g, 1024, 6144), Some((3072, 4096)));
    }

    #[test]
    fn another_size_or_flags_drops_the_exports_blocks() {
        let img = image(8192);
        let mut map = BlockMap::new(1 << 20, 1024);
        let g = map
            .open(&key("a"), server(1), (8192, 1), || true)
            .0
            .unwrap();
        let other = map
            .open(&key("b"), server(1), (8192, 1), || true)
            .0
            .unwrap();
        map.insert(g, 0, &img, false);
        map.insert(other, 0, &img, false);
        assert_eq!(
            map.open(&key("a"), server(1), (8192, 1), || true).0,
            Some(g)
        );
        let (g2, events) = map.open(&key("a"), server(1), (4096, 1), || true);
        assert_eq!(events.dropped, 8);
        let g2 = g2.unwrap();
        assert_ne!(g, g2);
        assert!(map.lookup(g, 0, 1024).0.is_none());
        assert!(map.lookup(g2, 0, 1024).0.is_none());
        // The old generation can no longer fill.
        map.insert(g, 0, &img, false);
        assert_eq!(map.blocks(), 8);
        let (_, events) = map.open(&key("a"), server(1), (4096, 3), || true);
        assert_eq!(events.dropped, 0);
        assert!(map.lookup(other, 0, 8192).0.is_some());
    }

    #[test]
    fn another_server_at_the_socket_starts_a_new_generation() {
        let a = vec![b'A'; 8192];
        let b = vec![b'B'; 8192];
        let mut map = BlockMap::new(1 << 20, 1024);
        let old = map
            .open(&key("a"), server(1), (8192, 1), || true)
            .0
            .unwrap();
        map.insert(old, 0, &a, false);
        map.set_pending(old, 0, 8192, true);
        // Another server (socket file and process), same size and flags.
        let (new, events) = map.open(&key("a"), server(2), (8192, 1), || true);
        let new = new.unwrap();
        assert_ne!(new, old);
        assert_eq!(events.ended, Some(Change::Replaced));
        assert_eq!(events.dropped, 8);
        assert_eq!(map.bytes(), 0);
        assert!(map.lookup(new, 0, 1024).0.is_none());
        assert_eq!(map.missing(new, 0, 8192), Some((0, 8192)));
        // A session of the old server still reading: its fills land
        // nowhere, and it finds nothing.
        map.insert(old, 0, &a, false);
        map.insert_zeros(old, 0, 8192, false);
        assert_eq!(map.blocks(), 0);
        assert!(map.lookup(old, 0, 1024).0.is_none());
        map.insert(new, 0, &b, false);
        assert_eq!(concat(map.lookup(new, 0, 8192).0.unwrap()), b);
        // The same server again: the same generation. Only the server's
        // pid differing (a pid of another process, the same file) is
        // another server too.
        assert_eq!(
            map.open(&key("a"), server(2), (8192, 1), || true).0,
            Some(new)
        );
        let mut other_pid = server(2);
        other_pid.pid += 1;
        let (third, events) = map.open(&key("a"), other_pid, (8192, 1), || true);
        assert_ne!(third, Some(new));
        assert_eq!(events.ended, Some(Change::Replaced));
        let (_, events) = map.open(&key("a"), other_pid, (4096, 1), || true);
        assert_eq!(events.ended, Some(Change::Resized));
        // Only the socket file differing (the same pid, as a server in a
        // pid namespace nbdgw cannot see reads 0 each time, or a server
        // that bound its socket again) is another server too.
        let current = map.open(&key("a"), other_pid, (4096, 1), || true).0;
        let mut other_file = other_pid;
        other_file.file = crate::exports::SocketFile::test_file(99);
        let (fourth, events) = map.open(&key("a"), other_file, (4096, 1), || true);
        assert_ne!(fourth, current);
        assert_eq!(events.ended, Some(Change::Replaced));
    }

    #[test]
    fn a_session_of_a_replaced_server_never_takes_the_generation_back() {
        let mut map = BlockMap::new(1 << 20, 1024);
        let old = map.open(&key("a"), server(1), (8192, 1), || true).0;
        // The new server's first session, then one of the old server's
        // that negotiated meanwhile and opens late: its server no longer
        // answers at the socket, and it is not cached.
        let new = map.open(&key("a"), server(2), (8192, 1), || true).0;
        assert_ne!(new, old);
        let (late, events) = map.open(&key("a"), server(1), (8192, 1), || false);
        assert_eq!(late, None);
        assert!(events.superseded);
        assert_eq!(events.ended, None);
        // The new server's generation stands; its sessions are not asked
        // about the socket again.
        let again = map.open(&key("a"), server(2), (8192, 1), || {
            panic!("the known server checked again")
        });
        assert_eq!(again.0, new);
        // The first session of all is checked too.
        assert_eq!(map.open(&key("b"), server(1), (8192, 1), || false).0, None);
    }

    #[test]
    fn blocks_read_again_outlive_a_single_pass() {
        let mut map = BlockMap::new(4 * 1024, 1024);
        let g = map
            .open(&key("a"), server(1), (1 << 20, 0), || true)
            .0
            .unwrap();
        let hot = image(1024);
        map.insert(g, 0, &hot, false);
        for _ in 0..3 {
            assert!(map.lookup(g, 0, 1024).0.is_some());
        }
        // A scan of blocks read once each.
        let mut evicted = 0;
        for block in 1..40u64 {
            evicted += map.insert(g, block * 1024, &hot, false).evicted;
            if block % 3 == 0 {
                assert!(map.lookup(g, 0, 1024).0.is_some(), "block {block}");
            }
        }
        assert!(evicted > 30);
        assert!(map.lookup(g, 0, 1024).0.is_some());
        assert_eq!(map.bytes(), 4 * 1024);
    }

    #[test]
    fn read_ahead_is_used_once_or_wasted_on_eviction() {
        let mut map = BlockMap::new(2 * 1024, 1024);
        let g = map
            .open(&key("a"), server(1), (1 << 20, 0), || true)
            .0
            .unwrap();
        let data = image(2048);
        map.insert(g, 0, &data, true);
        assert_eq!(map.lookup(g, 0, 100).1.read_ahead_used, 1024);
        assert_eq!(map.lookup(g, 0, 100).1.read_ahead_used, 0);
        let events = map.insert(g, 4096, &data, false);
        assert_eq!(events.evicted, 2);
        assert_eq!(events.read_ahead_wasted, 1024);
    }

    #[test]
    fn a_forgotten_range_drops_every_block_it_touches() {
        let mut map = BlockMap::new(1 << 20, 1024);
        let g = map
            .open(&key("a"), server(1), (8192, 0), || true)
            .0
            .unwrap();
        map.insert(g, 0, &image(8192), false);
        map.forget(g, 1500, 1000);
        assert_eq!(map.blocks(), 6);
        assert!(map.lookup(g, 1024, 1).0.is_none());
        assert!(map.lookup(g, 2048, 1).0.is_none());
        assert!(map.lookup(g, 0, 1024).0.is_some());
        assert!(map.lookup(g, 3072, 5120).0.is_some());
        assert_eq!(map.bytes(), 6 * 1024);
    }

    #[test]
    fn holes_are_zeros() {
        let mut map = BlockMap::new(1 << 20, 1024);
        let g = map
            .open(&key("a"), server(1), (1 << 20, 0), || true)
            .0
            .unwrap();
        map.insert_zeros(g, 0, 4096, false);
        assert_eq!(concat(map.lookup(g, 10, 4000).0.unwrap()), vec![0; 4000]);
    }

    #[test]
    fn block_sizes_are_powers_of_two_up_to_the_zeros() {
        assert_eq!(parse_block_size("4096"), Ok(4096));
        assert_eq!(parse_block_size("65536"), Ok(65536));
        for bad in ["0", "2048", "5000", "131072", "x", "-1"] {
            assert!(parse_block_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_zero_capacity_holds_nothing() {
        let mut map = BlockMap::new(0, 1024);
        let g = map
            .open(&key("a"), server(1), (1 << 20, 0), || true)
            .0
            .unwrap();
        map.insert(g, 0, &image(4096), false);
        assert_eq!(map.blocks(), 0);
    }

    #[test]
    fn exports_are_bounded() {
        let mut map = BlockMap::new(1 << 20, 1024);
        let first = map
            .open(&key("keep"), server(1), (4096, 0), || true)
            .0
            .unwrap();
        map.insert(first, 0, &image(1024), false);
        for i in 0..MAX_EXPORTS + 10 {
            map.open(&key(&i.to_string()), server(1), (4096, 0), || true);
        }
        assert!(map.exports.len() <= MAX_EXPORTS);
        assert!(map.lookup(first, 0, 1024).0.is_some());
    }

    proptest! {
        /// Whatever is filled, read and evicted, a hit returns the image's
        /// bytes and memory stays within the capacity.
        #[test]
        fn hits_are_the_image_and_memory_stays_bounded(
            ops in proptest::collection::vec((any::<bool>(), 0u64..20_000, 1u64..6000), 1..200),
            capacity_blocks in 0u64..12,
        ) {
            let img = image(20_000);
            let size = img.len() as u64;
            let mut map = BlockMap::new(capacity_blocks * 1024, 1024);
            let g = map.open(&key("a"), server(1), (size, 0), || true).0.unwrap();
            for (fill, offset, length) in ops {
                let length = length.min(size - offset);
                let range = offset as usize..(offset + length) as usize;
                if fill {
                    map.insert(g, offset, &img[range], offset % 3 == 0);
                } else if let (Some(covered), _) = map.lookup(g, offset, length) {
                    prop_assert_eq!(concat(covered), &img[range]);
                }
                prop_assert!(map.bytes() <= capacity_blocks * 1024);
                prop_assert!(map.blocks() as u64 <= capacity_blocks);
                prop_assert_eq!(map.index.len(), map.slots.iter().flatten().count());
            }
        }

        #[test]
        fn a_full_fill_is_a_hit(offset in 0u64..20_000, length in 1u64..8000) {
            let img = image(20_000);
            let size = img.len() as u64;
            let length = length.min(size - offset);
            let mut map = BlockMap::new(1 << 20, 1024);
            let g = map.open(&key("a"), server(1), (size, 0), || true).0.unwrap();
            // The enclosing aligned range, as read-ahead and a client
            // read of whole blocks would bring.
            let start = offset / 1024 * 1024;
            let end = ((offset + length).div_ceil(1024) * 1024).min(size);
            map.insert(g, start, &img[start as usize..end as usize], false);
            let covered = map.lookup(g, offset, length).0;
            prop_assert!(covered.is_some());
            prop_assert_eq!(concat(covered.unwrap()), &img[offset as usize..(offset + length) as usize]);
        }
    }
}
