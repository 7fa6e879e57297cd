//! Client connections: open and ended, TLS handshakes that failed and
//! certificates refused, sessions refused, and the bytes carried.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::registry::Registry;

use super::Metrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SessionRefusal {
    pub reason: &'static str,
}

impl Metrics {
    pub(super) fn register_connections(&self, r: &mut Registry) {
        let m = self;
        r.register(
            "connections_open",
            "Client connections open now",
            m.connections_open.clone(),
        );
        r.register(
            "connections",
            "Client connections ended, by outcome",
            m.connections.clone(),
        );
        r.register(
            "handshake_failures",
            "TLS handshakes that failed, by the reason (the alert sent)",
            m.handshake_failures.clone(),
        );
        r.register(
            "tls_sessions",
            "TLS sessions established (client mode: with the server), by the key exchange group negotiated",
            m.tls_sessions.clone(),
        );
        r.register(
            "identities_refused",
            "Client certificates refused (chain, revocation or allow-lists)",
            m.identities_refused.clone(),
        );
        r.register(
            "sessions_refused",
            "Authenticated clients refused a session, by reason (max_connections, per_identity)",
            m.sessions_refused.clone(),
        );
        r.register(
            "received_bytes",
            "Request bytes received from clients",
            m.bytes_received.clone(),
        );
        r.register(
            "sent_bytes",
            "Reply bytes sent to clients",
            m.bytes_sent.clone(),
        );
    }

    /// A client connection ended: "closed", "error", or "refused" (at
    /// accept or in the handshake queue, before a word was exchanged).
    pub fn connection(&self, outcome: &'static str) {
        self.connections.get_or_create(&Outcome { outcome }).inc();
    }

    /// A TLS handshake failed; `certificate` when the client's
    /// certificate was what was refused.
    pub fn handshake_failed(&self, reason: String, certificate: bool) {
        self.handshake_failures
            .get_or_create(&Reason { reason })
            .inc();
        if certificate {
            self.identities_refused.inc();
        }
    }

    /// A session refused for `reason`, one of `Refusal::metric_reason`'s.
    pub fn session_refused(&self, reason: &'static str) {
        self.sessions_refused
            .get_or_create(&SessionRefusal { reason })
            .inc();
    }
}
