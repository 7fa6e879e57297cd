//! The read cache's counters (see `crate::cache`): one set for the
//! gateway, with no label a client could choose.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GenerationEnd {
    /// One of `cache::Change::label`'s.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamFault {
    /// One of `cache::Fault::label`'s.
    pub kind: &'static str,
}

/// The read cache's counters (see `crate::cache`): one set for the
/// gateway, with no label, so no client chooses a series.
#[derive(Clone, Debug, Default)]
pub struct CacheMetrics {
    /// Reads answered from the cache, without the upstream.
    pub hits: Counter,
    /// Reads of a cached export forwarded to the upstream.
    pub misses: Counter,
    /// READs of cached exports sent upstream (fills, read-ahead, and
    /// reads the cache does not answer).
    pub upstream_reads: Counter,
    /// Blocks evicted to make room.
    pub evictions: Counter,
    /// Blocks dropped because their export's generation ended (another
    /// server at its socket, or another size or flags).
    pub invalidated_blocks: Counter,
    /// Exports' generations ended, by why: `replaced` (another server
    /// answers at the socket) or `resized` (another size or flags).
    pub generations_ended: Family<GenerationEnd, Counter>,
    /// Replies to reads on cached exports that broke the protocol, by
    /// kind (one of `cache::Fault::label`'s): nothing of them is cached.
    pub upstream_faults: Family<UpstreamFault, Counter>,
    /// Bytes read ahead into the cache.
    pub read_ahead_bytes: Counter,
    /// Of those, bytes a client then read from the cache.
    pub read_ahead_used_bytes: Counter,
    /// Bytes read ahead and evicted, dropped or not kept before a client
    /// read them.
    pub read_ahead_wasted_bytes: Counter,
    /// Bytes held in blocks now.
    pub cached_bytes: Gauge,
    /// `--cache-size`.
    pub capacity_bytes: Gauge,
}

impl CacheMetrics {
    /// A generation ended for `reason`, one of `cache::Change::label`'s.
    pub fn generation_ended(&self, reason: &'static str) {
        self.generations_ended
            .get_or_create(&GenerationEnd { reason })
            .inc();
    }

    /// An upstream's reply broke the protocol in the way `kind` says, one
    /// of `cache::Fault::label`'s.
    pub fn upstream_fault(&self, kind: &'static str) {
        self.upstream_faults
            .get_or_create(&UpstreamFault { kind })
            .inc();
    }
}

impl CacheMetrics {
    /// Registers the counters, then the families and gauges, in the order
    /// `/metrics` lists them.
    pub(super) fn register(&self, r: &mut Registry) {
        for (name, help, counter) in self.counters() {
            r.register(name, help, counter.clone());
        }
        let c = self;
        r.register(
            "cache_generations_ended",
            "Read cache generations ended, by reason: replaced (another server answers at the export's socket) or resized (another size or flags)",
            c.generations_ended.clone(),
        );
        r.register(
            "cache_upstream_faults",
            "Replies to reads of cached exports that broke the protocol, by kind: overlap (chunks that overlap), outside (a chunk outside the read), uncovered (success with bytes no chunk covered); nothing of them is cached",
            c.upstream_faults.clone(),
        );
        r.register(
            "cache_bytes",
            "Bytes held in the read cache",
            c.cached_bytes.clone(),
        );
        r.register(
            "cache_capacity_bytes",
            "The read cache's bound (--cache-size)",
            c.capacity_bytes.clone(),
        );
    }

    /// The plain counters, with their names and help texts.
    fn counters(&self) -> [(&'static str, &'static str, &Counter); 8] {
        let c = self;
        [
            (
                "cache_hits",
                "Reads of immutable exports answered from the read cache",
                &c.hits,
            ),
            (
                "cache_misses",
                "Reads of immutable exports forwarded to the upstream",
                &c.misses,
            ),
            (
                "cache_upstream_reads",
                "READs of immutable exports sent upstream: fills, read-ahead, and reads too long to cache",
                &c.upstream_reads,
            ),
            (
                "cache_evictions",
                "Read cache blocks evicted to make room",
                &c.evictions,
            ),
            (
                "cache_invalidated_blocks",
                "Read cache blocks dropped because their export's generation ended (another server at its socket, or another size or flags)",
                &c.invalidated_blocks,
            ),
            (
                "cache_read_ahead_bytes",
                "Bytes read ahead into the read cache",
                &c.read_ahead_bytes,
            ),
            (
                "cache_read_ahead_used_bytes",
                "Read-ahead bytes a client then read from the cache",
                &c.read_ahead_used_bytes,
            ),
            (
                "cache_read_ahead_wasted_bytes",
                "Read-ahead bytes evicted, dropped or not kept before a client read them",
                &c.read_ahead_wasted_bytes,
            ),
        ]
    }
}
