//! `nbdgw client --reconnect`'s counters, registered in client mode only.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::Outcome;

/// What `nbdgw client --reconnect` did, summed over local connections:
/// fixed labels only, never the server's words.
#[derive(Clone, Debug, Default)]
pub struct ReconnectMetrics {
    /// Tries to open the export again, by outcome: "opened" or "failed".
    pub tries: Family<Outcome, Counter>,
    /// Server connections that answered a request after a drop: the
    /// reconnect that worked.
    pub good: Counter,
    /// Times --reconnect gave up, by reason: "timeout" (the requests in
    /// flight failed with EIO, later ones fail at once until the server
    /// answers) or "export_changed" (the local connection closed).
    pub give_ups: Family<Outcome, Counter>,
    /// ESHUTDOWN answers held back and their requests sent again.
    pub shutdown_answers_held: Counter,
    /// Local connections whose server connection is down or not yet
    /// answering, within --reconnect-timeout.
    pub reconnecting: Gauge,
    /// Local connections past --reconnect-timeout: their requests fail
    /// at once.
    pub unreachable: Gauge,
}

impl ReconnectMetrics {
    /// Client mode's `--reconnect` counters.
    pub(super) fn register(&self, r: &mut Registry) {
        let m = self;
        r.register(
            "reconnect_tries",
            "Tries to open the server's export again after a drop, by outcome",
            m.tries.clone(),
        );
        r.register(
            "reconnects_good",
            "Server connections that answered a request after a drop",
            m.good.clone(),
        );
        r.register(
            "reconnect_give_ups",
            "Times --reconnect gave up, by reason (timeout, export_changed)",
            m.give_ups.clone(),
        );
        r.register(
            "reconnect_shutdown_answers_held",
            "ESHUTDOWN answers held back from the local client, their requests sent again",
            m.shutdown_answers_held.clone(),
        );
        r.register(
            "reconnecting_connections",
            "Local connections whose server connection is down or not yet answering",
            m.reconnecting.clone(),
        );
        r.register(
            "unreachable_connections",
            "Local connections past --reconnect-timeout, whose requests fail at once",
            m.unreachable.clone(),
        );
    }
}
