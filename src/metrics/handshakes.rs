//! Before a client's TLS handshake: the handshake slots and their line
//! (`--max-handshakes`, `--handshake-queue`), the sources remembered as
//! proven, and the PROXY protocol headers of trusted balancers.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::registry::Registry;

use super::{Metrics, SessionRefusal};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProxyOutcome {
    pub outcome: &'static str,
}

impl Metrics {
    /// The handshake slots and queue (`--max-handshakes`), and the
    /// sources remembered as proven.
    pub(super) fn register_handshakes(&self, r: &mut Registry) {
        let m = self;
        r.register(
            "handshakes_in_progress",
            "Handshake slots (--max-handshakes) held now",
            m.handshakes_in_progress.clone(),
        );
        r.register(
            "handshakes_waiting",
            "Connections waiting now for a handshake slot",
            m.handshakes_waiting.clone(),
        );
        r.register(
            "handshake_waits",
            "Connections that had to wait for a handshake slot",
            m.handshake_waits.clone(),
        );
        r.register(
            "handshake_wait_seconds",
            "How long connections that waited for a handshake slot waited, for those that got one",
            m.handshake_wait_seconds.clone(),
        );
        r.register(
            "handshakes_refused",
            "Connections closed before their handshake, by reason (source_queue_full: its source's line full; shed_busiest_source: made room as the longest waiter of the busiest source; queue_full: unproven, and only proven sources wait; queue_timeout; shutting_down)",
            m.handshakes_refused.clone(),
        );
        r.register(
            "proven_sources",
            "Sources remembered as proven (a client of theirs opened an export with a certificate within --source-memory)",
            m.proven_sources.clone(),
        );
    }

    /// PROXY protocol headers from trusted balancers.
    pub(super) fn register_proxy(&self, r: &mut Registry) {
        r.register(
            "proxy_headers",
            "Connections from a --proxy-protocol-from balancer, by what their PROXY header was (v1, v2: a client's address taken; local: v2 LOCAL, closed after it unless --proxy-protocol-serve-local; unknown: refused, it gave no address (v1 UNKNOWN, v2 PROXY not over TCP); invalid; timeout: none within --proxy-protocol-timeout (or --handshake-timeout if shorter); closed; busy: closed before their header for the bound of --max-handshakes plus --handshake-queue, refused or shed for a less busy balancer address; shutting_down)",
            self.proxy_headers.clone(),
        );
    }

    /// A connection from a trusted balancer, by `outcome` (one of the
    /// fixed few `register_proxy` names).
    pub fn proxy_header(&self, outcome: &'static str) {
        self.proxy_headers
            .get_or_create(&ProxyOutcome { outcome })
            .inc();
    }

    /// A connection closed before its handshake for `reason`, one of
    /// `Refusal::metric_reason`'s.
    pub fn handshake_refused(&self, reason: &'static str) {
        self.handshakes_refused
            .get_or_create(&SessionRefusal { reason })
            .inc();
    }
}
