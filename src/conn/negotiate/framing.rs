//! STRUCTURED_REPLY and EXTENDED_HEADERS: the reply framing transmission
//! will use, agreed with the upstream in use, or by nbdgw itself before an
//! export (and so an upstream) is chosen.

use super::{Negotiation, Step};
use crate::conn::error::ConnError;
use crate::proto::consts::*;
use crate::proto::handshake::OptionHeader;

impl Negotiation<'_> {
    /// STRUCTURED_REPLY and EXTENDED_HEADERS go to the upstream in use
    /// (the single `--upstream` is connected for them if this client may
    /// reach it). Before any export is chosen (named exports, or an
    /// identity no rule admits), nbdgw agrees to
    /// structured replies itself and asks each upstream for them as it
    /// connects; extended headers it cannot promise for an upstream not
    /// yet chosen, so it declines them then and clients fall back.
    pub(super) async fn framing(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
        self.renamed = None;
        if self.upstream.is_none() && self.may_reach_single() && !self.reach_single().await {
            return self.single_unavailable(option).await;
        }
        if self.upstream.is_some() {
            return self.relayed(option).await;
        }
        if !self.client.data().is_empty() {
            return self
                .refuse(option, REP_ERR_INVALID, "this option takes no data")
                .await;
        }
        if option.option == OPT_EXTENDED_HEADERS {
            let message = "nbdgw: extended headers are not offered before an export is chosen";
            return self.refuse(option, REP_ERR_UNSUP, message).await;
        }
        if self.framing.any() {
            return self
                .refuse(
                    option,
                    REP_ERR_INVALID,
                    "structured replies already negotiated",
                )
                .await;
        }
        self.framing.structured = true;
        self.refuse(option, REP_ACK, "").await
    }
}
