//! An export name judged: well formed, granted by the policy (and made
//! read-only if the export is immutable), routed to the export that serves
//! it; and what a refusal logs and counts. Denied and nonexistent names
//! get one answer, so that names do not leak.

use tracing::info;

use super::{Negotiation, Step, TOO_MANY_REFUSALS};
use crate::conn::error::ConnError;
use crate::exports::Export;
use crate::logsafe::{escape_bytes, Escaped};
use crate::policy::Access;
use crate::proto::consts::*;
use crate::proto::handshake::OptionHeader;
use crate::proto::name::NameError;

/// How much of a malformed export name the log shows.
const LOGGED_NAME_BYTES: usize = 256;

impl Negotiation<'_> {
    /// Records what the policy granted for the export `name`: an
    /// immutable export is read-only to everyone, so that no write can
    /// make the shared cache disagree with it.
    pub(super) fn granted(&mut self, decision: crate::policy::Decision, name: &str) {
        (self.access, self.rule) = (decision.access, decision.rule);
        self.immutable = self.config.read_cache.immutable.matches(name);
        if self.immutable {
            self.access = Access::ReadOnly;
        }
    }

    /// With named exports: `Some(the export)`, or `Some(None)` for a name
    /// nothing serves. Without (one upstream for every name): `None`.
    pub(super) fn route(&self, name: &str) -> Option<Option<Export>> {
        let table = self.config.exports.as_ref()?;
        Some(table.lookup(name))
    }

    /// Denied and nonexistent exports get the same answer, so names do
    /// not leak.
    pub(super) async fn unknown(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
        self.config.metrics.exports_refused.inc();
        if self.one_refusal_too_many() {
            return Ok(Step::Closed(TOO_MANY_REFUSALS));
        }
        self.refuse(option, REP_ERR_UNKNOWN, "unknown export").await
    }

    /// Counts a refused name; true once past `--max-refused-options`.
    pub(super) fn one_refusal_too_many(&mut self) -> bool {
        self.refusals += 1;
        self.refusals > self.config.max_refused_options
    }

    pub(super) fn log_malformed(&self, raw: &[u8], error: NameError) {
        info!(
            client = %self.identity,
            // A too-long name is logged only in part.
            export = %escape_bytes(&raw[..raw.len().min(LOGGED_NAME_BYTES)]),
            %error,
            "refused: not an export name"
        );
    }

    pub(super) fn log_refused(&self, export: &str) {
        // When the templated rules withheld it for the one-tenant check,
        // say so: otherwise the operator sees a refusal the rules seem to
        // contradict (`nbdgw policy explain` shows the bindings).
        let Some((why, _)) = self.policy.two_tenants(&self.identity) else {
            info!(
                client = %self.identity,
                export = %Escaped(export),
                "refused: the policy does not open this export to this client"
            );
            return;
        };
        let why = match why {
            crate::policy::NotOneTenant::Apart => "its names are bound by templated rules that name the tenant apart (placeholder sets not nested)",
            crate::policy::NotOneTenant::TwoValues => "its names bind two tenants across templated rules",
        };
        info!(
            client = %self.identity,
            export = %Escaped(export),
            "refused: the policy does not open this export to this client; templated rules grant it nothing: {why} (one certificate, one tenant; see nbdgw policy explain)"
        );
    }
}
