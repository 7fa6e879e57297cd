//! Hand-overs of the listening sockets to a successor process
//! (`crate::handover`), by outcome.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::{Metrics, Outcome};

/// Sessions offered to a successor, by outcome, and the pause each saw.
pub struct SessionsHanded {
    pub outcomes: Family<Outcome, Counter>,
    pub pause_seconds: Histogram,
}

impl Default for SessionsHanded {
    fn default() -> Self {
        SessionsHanded {
            outcomes: Family::default(),
            pause_seconds: Histogram::new(exponential_buckets(1e-3, 2.0, 15)),
        }
    }
}

impl Metrics {
    pub(super) fn register_handover(&self, r: &mut Registry) {
        r.register(
            "handovers",
            "Successors that connected to --handover-socket, by outcome (handed_over: it serves the listening sockets and this process drains; refused_uid: another uid; refused_version: no state version in common; timeout: not done within --handover-timeout; successor_gone: it closed or died first; failed: a broken message or socket); every outcome but handed_over leaves this process serving",
            self.handovers.clone(),
        );
        r.register(
            "takeovers",
            "This process's start as a successor (--take-over), by outcome (taken_over: the old gateway handed its listening sockets over and stopped accepting; predecessor_gone: it died after giving them, before Go, and this process serves them); a take-over that fails fails the start, so it is never counted here. The old gateway's own count (nbdgw_handovers_total) leaves with it",
            self.takeovers.clone(),
        );
        r.register(
            "session_handovers",
            "Sessions offered to a successor, by outcome: in the old gateway handed_over (the successor serves it), declined_certificate / declined_policy / declined_export / declined_tls / declined_limits / declined_server / declined_other (the successor's configuration would not admit it as it is: it stays and drains; declined_server: in client mode, another remote server or server name, and declined_certificate there: the server's chain does not verify with the successor's CA), withdrawn (not quiet within --handover-quiesce-timeout, or its state could not be taken: it stays and drains), ended (it ended, the client gone, before it was quiet), lost (its state left but the successor did not serve it: closed, never resumed here); in the successor resumed and lost. With --handover-fdstore (systemctl restart): in the old instance stored (left in systemd's file-descriptor store), withdrawn and lost; in the new one resumed, refused (its configuration would not admit it as it is: closed, the old instance is gone) and lost (taken by an earlier instance, incomplete, or of an unknown format: closed)",
            self.sessions_handed.outcomes.clone(),
        );
        r.register(
            "session_handover_pause_seconds",
            "Per session handed over: from when it stopped reading requests to when the successor served it (measured in the old gateway)",
            self.sessions_handed.pause_seconds.clone(),
        );
    }

    /// One session's hand-over, by `outcome` (one of `register_handover`'s).
    pub fn session_handover(&self, outcome: &'static str) {
        let outcomes = &self.sessions_handed.outcomes;
        outcomes.get_or_create(&Outcome { outcome }).inc();
    }

    /// This process's take-over, by `outcome` (one of `register_handover`'s).
    pub fn takeover(&self, outcome: &'static str) {
        self.takeovers.get_or_create(&Outcome { outcome }).inc();
    }

    /// One successor's attempt, by `outcome` (one of `register_handover`'s).
    pub fn handover(&self, outcome: &'static str) {
        self.handovers.get_or_create(&Outcome { outcome }).inc();
    }
}
