//! INFO, GO and the META_CONTEXT options: each names an export, so each
//! is judged as a name (malformed, not granted, unknown, unavailable: an
//! error reply, and past `--max-refused-options` the connection ends),
//! then sent to that export's upstream under the upstream's name for it.

use tracing::{debug, warn};

use super::{Negotiation, Renamed, Step, TOO_MANY_REFUSALS};
use crate::conn::error::ConnError;
use crate::logsafe::Escaped;
use crate::proto::consts::*;
use crate::proto::handshake::{split_export_name, with_export_name, OptionHeader};
use crate::proto::name::export_name;

impl Negotiation<'_> {
    /// INFO, GO and the META_CONTEXT options: authorized for the export
    /// they name, sent to its upstream under the upstream's name for it.
    pub(super) async fn naming_an_export(
        &mut self,
        option: &OptionHeader,
    ) -> Result<Step, ConnError> {
        self.renamed = None;
        let Some((name, _)) = split_export_name(self.client.data()) else {
            return self
                .refuse(option, REP_ERR_INVALID, "malformed option data")
                .await;
        };
        // Judged before the policy, as for EXPORT_NAME.
        let name = match export_name(name) {
            Ok(name) => name.to_owned(),
            Err(e) => {
                self.log_malformed(name, e);
                if self.one_refusal_too_many() {
                    return Ok(Step::Closed(TOO_MANY_REFUSALS));
                }
                return self.refuse(option, REP_ERR_INVALID, &e.to_string()).await;
            }
        };
        let Some(decision) = self.policy.decide_with_rule(&self.identity, &name) else {
            self.log_refused(&name);
            return self.unknown(option).await;
        };
        self.granted(decision, &name);
        if let Some(found) = self.route(&name) {
            let Some(target) = found else {
                debug!(export = %Escaped(&name), "no such export");
                return self.unknown(option).await;
            };
            if let Err(why) = self.attach(&target).await? {
                // `why` may name the socket's path: the log's, not the client's.
                warn!(export = %Escaped(&name), why = %Escaped(&why), "refused: export unavailable");
                let message = "nbdgw: export unavailable";
                return self.refuse(option, REP_ERR_SHUTDOWN, message).await;
            }
            self.renamed =
                with_export_name(self.client.data(), &target.upstream_name).map(|data| Renamed {
                    data,
                    client_name: name,
                });
            self.target = Some(target);
        } else if !self.reach_single().await {
            return self.single_unavailable(option).await;
        }
        self.relayed(option).await
    }
}
