//! NBD_OPT_LIST: with named exports nbdgw answers itself; with the single
//! `--upstream` the upstream's answer is relayed (see `forward`). Either
//! way a client sees only the exports it may open.

use super::{Negotiation, Step};
use crate::conn::error::ConnError;
use crate::policy::Policy;
use crate::proto::consts::*;
use crate::proto::handshake::{
    encode_option_reply, encode_server_entry, split_export_name, OptionHeader,
};
use crate::proto::name::export_name;
use crate::tls::CertInfo;

impl Negotiation<'_> {
    /// LIST: with named exports nbdgw answers itself, else the upstream's
    /// answer is relayed; either way only the exports this client may
    /// open are listed.
    pub(super) async fn list(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
        self.renamed = None;
        if self.may_reach_single() {
            if !self.reach_single().await {
                return self.single_unavailable(option).await;
            }
            return self.relayed(option).await;
        }
        if !self.client.data().is_empty() {
            return self
                .refuse(option, REP_ERR_INVALID, "LIST takes no data")
                .await;
        }
        // With the single upstream and an identity no rule admits, the
        // list it may see is empty, and nbdgw says so itself.
        let names = self
            .config
            .exports
            .as_ref()
            .map(|table| table.names())
            .unwrap_or_default();
        let mut replies = Vec::new();
        for name in names {
            if self.policy.decide(&self.identity, &name).is_some() {
                replies.extend(encode_option_reply(
                    OPT_LIST,
                    REP_SERVER,
                    &encode_server_entry(&name),
                ));
            }
        }
        replies.extend(encode_option_reply(OPT_LIST, REP_ACK, &[]));
        self.client.send(&replies).await?;
        Ok(Step::Next)
    }
}

/// Whether a relayed LIST entry names an export this client may open.
pub(super) fn listed(policy: &Policy, identity: &CertInfo, body: &[u8]) -> bool {
    let Some((name, _)) = split_export_name(body) else {
        return false;
    };
    // A name no client could open through nbdgw is not listed either.
    export_name(name).is_ok_and(|name| policy.is_open() || policy.decide(identity, name).is_some())
}
