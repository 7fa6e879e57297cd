//! TLS beyond the handshake: sessions handed to kernel TLS and their key
//! updates, the key exchange groups negotiated, and the served
//! certificate's reloads and expiry (kept current by the TLS store).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::registry::Registry;

use super::Metrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Direction {
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KeyExchange {
    /// A name from `tls::groups::name`: a fixed few, never a peer's value.
    pub key_exchange: &'static str,
}

impl Metrics {
    /// Sessions handed to the kernel, and their key updates.
    pub(super) fn register_kernel_tls(&self, r: &mut Registry) {
        let m = self;
        r.register(
            "kernel_tls_sessions",
            "TLS sessions handed to the kernel (kTLS) after the handshake",
            m.kernel_tls_sessions.clone(),
        );
        r.register(
            "kernel_tls_no_rekey_sessions",
            "TLS 1.3 sessions kept in rustls because this kernel's TLS cannot re-key",
            m.kernel_tls_no_rekey.clone(),
        );
        r.register(
            "tls_key_updates",
            "TLS 1.3 key updates followed on kernel TLS sessions: rx the client's, tx nbdgw's own",
            m.tls_key_updates.clone(),
        );
    }

    pub(super) fn register_tls(r: &mut Registry, tls: &crate::tls::TlsStore) {
        r.register(
            "tls_reloads",
            "TLS reloads that replaced the configuration",
            tls.reloads_ok.clone(),
        );
        r.register(
            "tls_reload_failures",
            "TLS reloads refused (broken files, or files weakening authentication)",
            tls.reloads_failed.clone(),
        );
        r.register(
            "certificate_not_after_seconds",
            "Expiry of the served certificate, Unix time",
            tls.certificate_not_after.clone(),
        );
        r.register(
            "client_ca_not_after_seconds",
            "Earliest expiry in the client CA bundle, Unix time (0: none)",
            tls.client_ca_not_after.clone(),
        );
    }

    /// A key update on a kernel TLS session, "rx" or "tx".
    pub fn key_update(&self, direction: &'static str) {
        self.tls_key_updates
            .get_or_create(&Direction { direction })
            .inc();
    }

    /// A TLS session was established with the key exchange `group`.
    pub fn tls_established(&self, group: Option<rustls::NamedGroup>) {
        let key_exchange = crate::tls::groups::name(group);
        self.tls_sessions
            .get_or_create(&KeyExchange { key_exchange })
            .inc();
    }
}
