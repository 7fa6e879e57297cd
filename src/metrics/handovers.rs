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
    }

    /// One successor's attempt, by `outcome` (one of `register_handover`'s).
    pub fn handover(&self, outcome: &'static str) {
        self.handovers.get_or_create(&Outcome { outcome }).inc();
    }
}
