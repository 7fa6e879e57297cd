//! NBD_OPT_EXPORT_NAME, the old way in: it has no error reply, so every
//! refusal (a malformed name, one not granted, unknown or unavailable, or
//! one the upstream refused) closes the connection.

use tracing::warn;

use super::{Negotiation, Renamed, Step};
use crate::conn::error::ConnError;
use crate::conn::relayed;
use crate::logsafe::Escaped;
use crate::policy::Access;
use crate::proto::handshake::read_only_flags;
use crate::proto::name::export_name;

impl Negotiation<'_> {
    /// The old way in: no error reply exists, so a refusal closes.
    pub(super) async fn export_name(&mut self) -> Result<Step, ConnError> {
        // Judged before the policy, so that the name it judges is the
        // name the upstream is asked for, byte for byte.
        let export = match export_name(self.client.data()) {
            Ok(export) => export.to_owned(),
            Err(e) => {
                self.log_malformed(self.client.data(), e);
                return Ok(Step::Closed("NBD_OPT_EXPORT_NAME with a malformed name"));
            }
        };
        let Some(decision) = self.policy.decide_with_rule(&self.identity, &export) else {
            self.log_refused(&export);
            self.config.metrics.exports_refused.inc();
            return Ok(Step::Closed(
                "NBD_OPT_EXPORT_NAME for an export not open to it",
            ));
        };
        self.granted(decision, &export);
        if let Some(reason) = self.connect_for(&export).await? {
            return Ok(Step::Closed(reason));
        }
        self.exchange(export).await
    }

    /// Connects the upstream that serves `export` (routed, or the single
    /// `--upstream`); `Some(why)` is the reason to close with when there
    /// is none.
    async fn connect_for(&mut self, export: &str) -> Result<Option<&'static str>, ConnError> {
        let Some(found) = self.route(export) else {
            let reachable = self.reach_single().await;
            return Ok((!reachable).then_some("NBD_OPT_EXPORT_NAME with the upstream unavailable"));
        };
        let Some(target) = found else {
            self.config.metrics.exports_refused.inc();
            return Ok(Some("NBD_OPT_EXPORT_NAME for an unknown export"));
        };
        if let Err(why) = self.attach(&target).await? {
            warn!(export = %Escaped(export), why = %Escaped(&why), "closing: NBD_OPT_EXPORT_NAME cannot be refused");
            return Ok(Some("NBD_OPT_EXPORT_NAME for an unavailable export"));
        }
        self.renamed = Some(Renamed {
            data: target.upstream_name.clone().into_bytes(),
            client_name: export.to_owned(),
        });
        self.target = Some(target);
        Ok(None)
    }

    /// Asks the upstream for the export and gives the client its answer,
    /// read-only if that is all the policy granted.
    async fn exchange(&mut self, export: String) -> Result<Step, ConnError> {
        let Some(upstream) = self.upstream.as_mut() else {
            return Ok(Step::Closed("no upstream"));
        };
        let data = self
            .renamed
            .as_ref()
            .map_or(self.client.data(), |r| &r.data);
        let answered =
            relayed::export_name_exchange(&mut upstream.channel, upstream.pads_export_name, data)
                .await?;
        let (size, mut tflags) = match answered {
            Ok(export) => export,
            Err(e) => {
                // Closing is the only way a server can refuse EXPORT_NAME.
                warn!(export = %Escaped(&export), error = %e, "upstream refused NBD_OPT_EXPORT_NAME");
                return Ok(Step::Closed("upstream refused the export"));
            }
        };
        if self.access == Access::ReadOnly {
            tflags = read_only_flags(tflags);
        }
        relayed::answer_export_name(&mut self.client, (size, tflags), self.client_flags).await?;
        Ok(Step::Transmission {
            export,
            size,
            tflags,
        })
    }
}
