//! An option sent to the upstream (under the upstream's name for the
//! export, if routed) and its replies relayed back, edited on the way:
//! the export's name as the client knows it, read-only flags where the
//! policy grants read-only access, the block sizes nbdgw can carry, and
//! only the LIST entries this client may open. A GO whose ACK came leads
//! to transmission.

use tracing::debug;

use super::list::listed;
use super::{Negotiation, Renamed, Step};
use crate::conn::error::{ConnError, Side};
use crate::conn::relayed::{self, Relayed};
use crate::policy::{Access, Policy};
use crate::proto::consts::*;
use crate::proto::handshake::{
    encode_info_name, encode_option_reply, force_read_only, is_info_name, read_only_flags,
    OptionHeader,
};
use crate::tls::CertInfo;

impl Negotiation<'_> {
    /// Forwards the option and relays every reply to it. After an
    /// upstream failure the client still gets an answer, not a hang, if
    /// it has had none yet.
    pub(super) async fn relayed(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
        if self.upstream.is_none() {
            return self
                .refuse(option, REP_ERR_INVALID, "name an export first")
                .await;
        }
        let relayed = self.relay_replies(option).await?;
        debug!(
            option = option_name(option.option),
            reply = format_args!("{:#x}", relayed.reply_type),
            "relayed"
        );
        if relayed.reply_type != REP_ACK {
            return Ok(Step::Next);
        }
        self.framing.acknowledged(option.option);
        if option.option != OPT_GO {
            return Ok(Step::Next);
        }
        let export = relayed::go_export_name(self.client.data());
        // The spec makes INFO_EXPORT mandatory before GO's ACK; a server
        // that omits it gets no read-only enforcement unless the policy
        // grants read-only access.
        let (size, tflags) = relayed.export.unwrap_or((0, 0));
        let tflags = match self.access {
            Access::ReadOnly => read_only_flags(tflags),
            Access::ReadWrite => tflags,
        };
        Ok(Step::Transmission {
            export,
            size,
            tflags,
        })
    }

    /// Forwards the option (renamed, if routed) and relays the
    /// upstream's replies to it, edited as `ReplyEdits` says.
    pub(super) async fn relay_replies(
        &mut self,
        option: &OptionHeader,
    ) -> Result<Relayed, ConnError> {
        let Some(upstream) = self.upstream.as_mut() else {
            return Err(ConnError::closed(
                Side::Upstream,
                "before an export was chosen",
            ));
        };
        let data = self
            .renamed
            .as_ref()
            .map_or(self.client.data(), |r| &r.data);
        upstream.channel.send_option(option.option, data).await?;
        let edits = ReplyEdits {
            renamed: self.renamed.as_ref(),
            access: self.access,
            policy: &self.policy,
            identity: &self.identity,
            max_payload: self.config.relay.max_payload,
        };
        relayed::relay_or_answer(
            &mut self.client,
            &mut upstream.channel,
            option.option,
            &mut self.batch,
            |reply_type, batch, start| edits.apply((option.option, reply_type), batch, start),
            "nbdgw: upstream NBD server failed",
        )
        .await
    }
}

/// What nbdgw changes in the upstream's option replies before the client
/// sees them.
struct ReplyEdits<'a> {
    renamed: Option<&'a Renamed>,
    access: Access,
    policy: &'a Policy,
    identity: &'a CertInfo,
    max_payload: u32,
}

impl ReplyEdits<'_> {
    /// Edits the reply that starts at `start` in `batch`, in place or by
    /// replacing it; returns the export's size and flags if it gave them.
    fn apply(&self, reply: (u32, u32), batch: &mut Vec<u8>, start: usize) -> Option<(u64, u16)> {
        let (option, reply_type) = reply;
        let body = &mut batch[start + OPTION_REPLY_HEADER_LEN..];
        match reply_type {
            REP_INFO if is_info_name(body) => {
                // The upstream's own name for the export, which the client
                // knows by another.
                if let Some(renamed) = self.renamed {
                    batch.truncate(start);
                    let body = encode_info_name(&renamed.client_name);
                    batch.extend(encode_option_reply(option, REP_INFO, &body));
                }
                None
            }
            REP_INFO => {
                if self.access == Access::ReadOnly {
                    force_read_only(body);
                }
                // A compliant client then never sends more than nbdgw takes.
                relayed::info_export(body, self.max_payload)
            }
            REP_SERVER if !listed(self.policy, self.identity, body) => {
                batch.truncate(start);
                None
            }
            _ => None,
        }
    }
}
