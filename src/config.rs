//! Runtime settings of the gateway, independent of how they were given.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Everything a running gateway needs. `main` builds it from flags and
/// environment; tests build it directly.
#[derive(Clone)]
pub struct Config {
    /// Unix socket of the NBD server nbdgw relays to.
    pub upstream: PathBuf,
    /// Read afresh for each connection: a reload may replace it.
    pub tls: Arc<crate::tls::TlsStore>,
    /// `SO_SNDBUF` requested on each upstream socket; 0 keeps the kernel's.
    pub upstream_sndbuf: usize,
    pub max_connections: usize,
    /// From accept until transmission starts (or the connection ends).
    pub handshake_timeout: Duration,
    /// Closes a connection with no request in flight for this long.
    pub idle_timeout: Option<Duration>,
    /// Largest request payload (and read length) accepted from a client.
    pub max_payload: u32,
    /// Largest option data (or option reply data) either side may send.
    pub max_option_len: u32,
    /// How replies are held back into full TCP segments.
    pub cork: Cork,
    /// How long open connections may finish after SIGTERM.
    pub shutdown_grace: Duration,
    pub upstream_connect_timeout: Duration,
}

impl Config {
    /// Defaults for everything but the two things only the operator knows.
    pub fn new(upstream: PathBuf, tls: Arc<crate::tls::TlsStore>) -> Self {
        Config {
            upstream,
            tls,
            upstream_sndbuf: DEFAULT_UPSTREAM_SNDBUF,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            handshake_timeout: Duration::from_secs(DEFAULT_HANDSHAKE_TIMEOUT_SECS),
            idle_timeout: None,
            max_payload: crate::proto::consts::DEFAULT_MAX_PAYLOAD,
            max_option_len: DEFAULT_MAX_OPTION_LEN,
            cork: Cork::Deferred,
            shutdown_grace: Duration::from_secs(DEFAULT_SHUTDOWN_GRACE_SECS),
            upstream_connect_timeout: Duration::from_secs(5),
        }
    }
}

/// TCP_CORK around replies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Cork {
    /// Corked while the next reply is already waiting; released when
    /// nothing more is (a burst that fits one write needs no cork at all).
    #[default]
    Deferred,
    /// Corked around every reply and released after it, as QEMU does.
    PerReply,
    Off,
}

pub const DEFAULT_UPSTREAM_SNDBUF: usize = 2 * 1024 * 1024;
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
pub const DEFAULT_HANDSHAKE_TIMEOUT_SECS: u64 = 10;
pub const DEFAULT_SHUTDOWN_GRACE_SECS: u64 = 30;
/// Option data is a few short strings (export names and meta-context
/// queries of at most 4096 bytes each); 64 KiB leaves room for many
/// queries and still bounds what an unauthenticated client can send.
pub const DEFAULT_MAX_OPTION_LEN: u32 = 64 * 1024;
