//! The read cache as a layer of the relay, for a session on an immutable
//! export: the request half answers a READ from the cache (a hit never
//! reaches the upstream), sends a READ that missed upstream widened to
//! whole blocks, and plans read-ahead; the reply half gives the upstream's
//! read data to the cache, and claims the replies to nbdgw's own reads,
//! which fill the cache and never reach the client as they are.
//!
//! nbdgw's own reads go upstream on the session's own connection under
//! cookies nbdgw picks that are not in flight (`Flight::try_claim`); a
//! client that then reuses one waits, as for any cookie in flight, so
//! replies stay unambiguous. The two halves share which cookies are
//! nbdgw's (`ahead::Ahead`).
//!
//! The cache's memory, blocks and generations are `crate::cache` (shared
//! by every session on the export); this is one session's use of it.

mod ahead;
mod fill;
mod replies;
mod requests;

use std::sync::Arc;

use crate::cache::Handle;
use crate::proto::transmission::ReplyMode;

use super::Layer;
use ahead::Ahead;
use replies::CacheReplies;
use requests::CacheRequests;

/// Reads longer than this always go to the upstream (and fill the cache
/// on the way back): a hit is queued for the reply side with its blocks,
/// and the queue holds `LOCAL_QUEUE` of them, so this bounds what a
/// client that does not read its replies keeps alive.
pub const MAX_HIT: u64 = 2 * 1024 * 1024;
/// Client reads on a cached session longer than this are relayed as they
/// come, wholly uncached: a client's long reads would otherwise keep a
/// buffer as long as `--max-payload` on its connection. Fill reads (at
/// most `MAX_HIT` and a block either side) always fit.
pub const TEE_MAX: u64 = MAX_HIT + 2 * crate::cache::BLOCK_SIZE + 8;
// A teed reply's buffer is kept for the next one on the connection.
const _: () = assert!(TEE_MAX <= crate::conn::relay::replies::SCRATCH_KEPT as u64);
/// Cookies for read-ahead start here and count up, skipping any the
/// client has in flight: a client may use any value, so this is only
/// where a clash is least likely, not a reserved range.
const FIRST_READ_AHEAD_COOKIE: u64 = 0xcac4_e000_0000_0000;

/// The layer's settings for one session: the export's cache and the
/// read-ahead and fill flags.
#[derive(Clone)]
pub struct Cached {
    pub handle: Handle,
    /// Bytes per read-ahead request; 0: none (`--read-ahead`).
    pub read_ahead: u32,
    /// Read-ahead requests in flight at most (`--read-ahead-depth`).
    pub depth: u32,
    /// Fill reads in flight at most (`--cache-fill-depth`).
    pub fills: u32,
}

/// The layer, before it is split into its halves.
pub struct ReadCache {
    cached: Cached,
    mode: ReplyMode,
}

impl ReadCache {
    /// `None` (a layer that passes everything) for a session whose export
    /// is not cached.
    pub fn new(cached: Option<Cached>, mode: ReplyMode) -> Option<Self> {
        cached.map(|cached| ReadCache { cached, mode })
    }
}

impl Layer for ReadCache {
    type Requests = CacheRequests;
    type Replies = CacheReplies;
    fn split(self) -> (CacheRequests, CacheReplies) {
        let ahead = Arc::new(Ahead::new(self.cached.handle.clone()));
        let replies = CacheReplies::new(self.cached.handle.clone(), ahead.clone(), self.mode);
        (CacheRequests::new(self.cached, ahead), replies)
    }
}
