//! Hand-overs of the listening sockets to a successor process
//! (`crate::handover`), by outcome.

use prometheus_client::registry::Registry;

use super::{Metrics, Outcome};

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
