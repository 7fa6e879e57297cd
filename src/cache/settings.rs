//! The read cache's settings, one value from its flag group
//! (`cli::serve::CacheArgs`) to the layer that uses them per session
//! (`conn::relay::layers::cache`): which exports are immutable, the shared
//! store, and how far each session may read ahead and fill.

use std::sync::Arc;

/// Exports declared immutable and the read cache they share.
#[derive(Clone)]
pub struct ReadCacheSettings {
    /// Exports declared immutable: read-only for everyone, and cached.
    pub immutable: Arc<crate::exports::Immutable>,
    /// The read cache immutable exports share; `None`: off.
    pub cache: Option<Arc<super::ReadCache>>,
    /// Bytes one read-ahead request fetches; 0: no read-ahead.
    pub read_ahead: u32,
    /// Read-ahead requests one connection may have in flight.
    pub read_ahead_depth: u32,
    /// Fill reads one connection may have in flight.
    pub cache_fill_depth: u32,
}

impl Default for ReadCacheSettings {
    /// No export immutable, so no cache; the flags' defaults otherwise.
    fn default() -> Self {
        ReadCacheSettings {
            immutable: Arc::default(),
            cache: None,
            read_ahead: super::DEFAULT_READ_AHEAD,
            read_ahead_depth: super::DEFAULT_READ_AHEAD_DEPTH,
            cache_fill_depth: super::DEFAULT_CACHE_FILL_DEPTH,
        }
    }
}
