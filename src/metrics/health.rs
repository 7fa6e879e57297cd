//! What `/healthz`, `/readyz` and `/server` report: not metrics, but
//! kept beside them as the other half of what an operator sees.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// What `/healthz`, `/readyz` and `/server` report.
#[derive(Default)]
pub struct Health {
    accepting: AtomicBool,
    draining: AtomicBool,
    /// Whether the upstream socket refused the last try.
    upstream_down: AtomicBool,
    /// Client mode: local connections reconnecting to the server, and
    /// those past --reconnect-timeout (failing at once).
    reconnecting: AtomicUsize,
    unreachable: AtomicUsize,
    /// Sessions that lost their upstream after SIGTERM, and connections
    /// whose upstream refused them then, by upstream: said once for all
    /// at the end of the drain (`server::run`), as a pod's NBD server
    /// stopping beside nbdgw cuts them all at once.
    cut_by_upstream: std::sync::Mutex<std::collections::BTreeMap<String, GoneUpstream>>,
}

/// What an upstream gone during the shutdown did to the connections.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GoneUpstream {
    /// Sessions it cut.
    pub cut: usize,
    /// Connections it refused while negotiating.
    pub refused: usize,
}

impl Health {
    pub fn set_accepting(&self, on: bool) {
        self.accepting.store(on, Ordering::Relaxed);
    }

    pub fn is_accepting(&self) -> bool {
        self.accepting.load(Ordering::Relaxed)
    }

    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// From SIGTERM on (the drain delay included).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// A session ended because its upstream (`upstream`, as the audit
    /// line names it) went away during the shutdown.
    pub fn cut_by_upstream(&self, upstream: &str) {
        self.gone_upstream(upstream, |gone| gone.cut += 1);
    }

    /// A connection's upstream refused it during the shutdown.
    pub fn refused_by_upstream(&self, upstream: &str) {
        self.gone_upstream(upstream, |gone| gone.refused += 1);
    }

    fn gone_upstream(&self, upstream: &str, count: impl FnOnce(&mut GoneUpstream)) {
        let mut gone = self
            .cut_by_upstream
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        count(gone.entry(upstream.to_owned()).or_default());
    }

    /// What `cut_by_upstream` and `refused_by_upstream` counted, by
    /// upstream, and forgets it.
    pub fn take_cut_by_upstream(&self) -> std::collections::BTreeMap<String, GoneUpstream> {
        std::mem::take(
            &mut *self
                .cut_by_upstream
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }

    /// Records whether the upstream accepts connections; why not is the
    /// caller's to log.
    pub fn set_upstream_down(&self, down: bool) {
        self.upstream_down.store(down, Ordering::Relaxed);
    }

    /// A local connection of client mode starts (`true`) or stops
    /// reconnecting to the server.
    pub fn set_reconnecting(&self, on: bool) {
        Self::count(&self.reconnecting, on);
    }

    /// A local connection of client mode starts (`true`) or stops failing
    /// its requests at once, past --reconnect-timeout.
    pub fn set_unreachable(&self, on: bool) {
        Self::count(&self.unreachable, on);
    }

    fn count(counter: &AtomicUsize, on: bool) {
        if on {
            counter.fetch_add(1, Ordering::Relaxed);
        } else {
            let _ =
                counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
    }

    /// `Ok` when ready for clients, or the one-line reason it is not: a
    /// fixed text, since whoever can reach the admin listener is told it
    /// (the upstream's path and error are in the log only).
    pub fn readiness(&self) -> Result<(), &'static str> {
        if self.draining.load(Ordering::Relaxed) {
            return Err("shutting down");
        }
        if !self.is_accepting() {
            return Err("not accepting connections yet");
        }
        if self.upstream_down.load(Ordering::Relaxed) {
            return Err("upstream unavailable");
        }
        // Not the connections reconnecting (client mode's --reconnect):
        // the server is a dependency, and a not-ready sidecar takes the
        // whole pod out of its Service while the server restarts. Their
        // state is `server_state`'s, and the gauges'.
        Ok(())
    }

    /// Client mode with --reconnect: `Ok` when no local connection is
    /// reconnecting to the server, else a fixed one-line reason (for the
    /// admin listener's `/server`).
    pub fn server_state(&self) -> Result<(), &'static str> {
        if self.unreachable.load(Ordering::Relaxed) > 0 {
            return Err("server unreachable past --reconnect-timeout");
        }
        if self.reconnecting.load(Ordering::Relaxed) > 0 {
            return Err("reconnecting to the server");
        }
        Ok(())
    }
}
