//! Who may open what, and who may ask: options naming an export refused,
//! access policy reloads, and the admin listener's own connections.

use prometheus_client::registry::Registry;

use super::Metrics;

impl Metrics {
    pub(super) fn register_exports(&self, r: &mut Registry) {
        let m = self;
        r.register(
            "admin_connections_open",
            "Admin listener connections open now",
            m.admin_connections_open.clone(),
        );
        r.register(
            "admin_connections_refused",
            "Admin listener connections closed at accept: --admin-max-connections were open",
            m.admin_connections_refused.clone(),
        );
        r.register(
            "exports_refused",
            "Options naming an export the client may not open, or that does not exist",
            m.exports_refused.clone(),
        );
        r.register(
            "policy_reloads",
            "Access policy reloads that replaced the policy",
            m.policy_reloads.clone(),
        );
        r.register(
            "policy_reload_failures",
            "Access policy reloads refused (missing, broken, or wider than the running policy)",
            m.policy_reload_failures.clone(),
        );
    }
}
