//! Option haggling after TLS: relay the client's options one at a time to
//! the upstream of the export they name (connected only once the option
//! passed authorization), learning from the upstream's replies what
//! framing transmission will use. One short function per kind of option.
//!
//! This file holds the option loop and the state it carries from option to
//! option; each concern has a file of its own, read in this order:
//! - `authorize`: what the policy grants for a name, and how a refusal is
//!   logged and counted;
//! - `attached`: the upstream connection options go to, connected only
//!   once an option passed authorization;
//! - `export_name`: NBD_OPT_EXPORT_NAME, the old way in, which has no
//!   error reply;
//! - `naming`: INFO, GO and the META_CONTEXT options, which name an export;
//! - `list` and `framing`: the options that name none;
//! - `forward`: an option sent upstream and its replies edited on the way
//!   back (renamed exports, read-only flags, the LIST entries shown);
//! - `into_transmission`: the session, its read cache handle and its audit
//!   line, once GO or EXPORT_NAME succeeded.

mod attached;
mod authorize;
mod export_name;
mod forward;
mod framing;
mod into_transmission;
mod list;
mod naming;

use std::sync::Arc;

use super::error::{ConnError, Side};
use super::options::{OptionChannel, ShutdownAnswer};
use super::relayed::{self, Batch, Framing};
use super::session::{Audit, ClientStream, Session};
use crate::config::Config;
use crate::exports::Export;
use crate::policy::{Access, Policy, RuleRef};
use crate::proto::consts::*;
use crate::proto::handshake::{ClientFlags, OptionHeader};
use crate::shutdown::Shutdown;
use crate::tls::CertInfo;
use attached::Attached;

pub enum Outcome {
    /// The session, and what the audit trail says of it.
    Transmission(Box<Session>, Box<Audit>),
    Closed(&'static str),
}

/// What a client hears when the single `--upstream` cannot be reached
/// (why, with its path, is in the log only).
const SINGLE_UNAVAILABLE: &str = "nbdgw: upstream NBD server unavailable";

/// Why a connection that kept naming exports it may not open ended.
const TOO_MANY_REFUSALS: &str = "more export names refused than --max-refused-options";

type Client = OptionChannel<ClientStream>;

pub async fn relay_options(
    tls: ClientStream,
    client_flags: ClientFlags,
    identity: CertInfo,
    config: &Config,
    shutdown: &Shutdown,
) -> Result<Outcome, ConnError> {
    let client = OptionChannel::new(tls, Side::Client, config.relay.max_option_len);
    // No upstream hears of this client yet: only an option that passed
    // authorization connects one (see `reach_single` and `attach`).
    let mut negotiation = Negotiation::new(client, client_flags, identity, config);
    loop {
        let option = negotiation.client.read_option().await?;
        match negotiation
            .client
            .refuse_for_shutdown(&option, shutdown)
            .await?
        {
            ShutdownAnswer::Serve => {}
            ShutdownAnswer::Refused => continue,
            ShutdownAnswer::End(reason) => return Ok(Outcome::Closed(reason)),
        }
        // Each option is judged by the policy in force when it arrives:
        // a narrowing reload during negotiation lists and opens no more.
        negotiation.policy = config.policy.current();
        let step = match option.option {
            OPT_STARTTLS => negotiation.starttls_again().await?,
            OPT_ABORT => negotiation.abort(&option).await?,
            OPT_EXPORT_NAME => negotiation.export_name().await?,
            OPT_LIST => negotiation.list(&option).await?,
            OPT_INFO | OPT_GO | OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                negotiation.naming_an_export(&option).await?
            }
            OPT_STRUCTURED_REPLY | OPT_EXTENDED_HEADERS => negotiation.framing(&option).await?,
            _ => negotiation.unsupported(&option).await?,
        };
        match step {
            Step::Next => {}
            Step::Closed(reason) => return Ok(Outcome::Closed(reason)),
            Step::Unavailable => {
                // The single upstream is not there: every further option
                // gets the same answer, rather than a fresh wait of up to
                // --upstream-timeout each.
                return refuse_all(negotiation.client, SINGLE_UNAVAILABLE)
                    .await
                    .map(Outcome::Closed);
            }
            Step::Transmission {
                export,
                size,
                tflags,
            } => return negotiation.enter_transmission(&export, size, tflags),
        }
    }
}

/// What an option leads to.
enum Step {
    Next,
    Closed(&'static str),
    /// The single `--upstream` could not be reached; the option was
    /// refused saying so.
    Unavailable,
    /// The export, its size and transmission flags, as the upstream said.
    Transmission {
        export: String,
        size: u64,
        tflags: u16,
    },
}

struct Negotiation<'a> {
    client: Client,
    /// The upstream options go to: with one upstream, connected by the
    /// first option that needs it once authorized; with named exports,
    /// that of the export the last option named.
    upstream: Option<Attached>,
    client_flags: ClientFlags,
    framing: Framing,
    /// Upstream replies to the current option not yet sent to the client.
    batch: Batch,
    /// The current option as the upstream must see it, when it names an
    /// export the upstream knows by another name.
    renamed: Option<Renamed>,
    /// What the identity may do with the export the current option named,
    /// and the policy rule that decided it (`None` without a policy).
    access: Access,
    rule: Option<RuleRef>,
    /// Whether that export is one the operator declared immutable: then
    /// `access` is read-only whatever the policy granted.
    immutable: bool,
    /// Export names refused so far (malformed, not granted, or unknown):
    /// each logs a line, so past `--max-refused-options` the connection
    /// ends instead of filling the log for the handshake timeout.
    refusals: u32,
    /// The named export the last naming option was routed to (`None`
    /// with one `--upstream`).
    target: Option<Export>,
    identity: CertInfo,
    /// The policy as it was when the connection started.
    policy: Arc<Policy>,
    config: &'a Config,
}

/// An option's data rewritten for the upstream, and the name the client
/// gave the export, which the upstream's replies must show again.
struct Renamed {
    data: Vec<u8>,
    client_name: String,
}

impl<'a> Negotiation<'a> {
    fn new(
        client: Client,
        client_flags: ClientFlags,
        identity: CertInfo,
        config: &'a Config,
    ) -> Self {
        Negotiation {
            client,
            upstream: None,
            client_flags,
            framing: Framing::default(),
            batch: Batch::default(),
            renamed: None,
            access: Access::ReadWrite,
            rule: None,
            immutable: false,
            refusals: 0,
            target: None,
            identity,
            policy: config.policy.current(),
            config,
        }
    }

    async fn starttls_again(&mut self) -> Result<Step, ConnError> {
        self.client
            .send_reply(OPT_STARTTLS, REP_ERR_INVALID, "TLS is already active")
            .await?;
        Ok(Step::Next)
    }

    async fn abort(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
        // Tell the upstream too, so it sees a clean soft disconnect; the
        // client's ACK does not depend on it.
        if let Some(upstream) = self.upstream.as_mut() {
            let _ = upstream
                .channel
                .send_option(option.option, self.client.data())
                .await;
        }
        self.client.acknowledge_abort().await?;
        Ok(Step::Closed("client sent NBD_OPT_ABORT"))
    }

    async fn unsupported(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
        relayed::refuse_unsupported(&mut self.client, option).await?;
        Ok(Step::Next)
    }

    /// Answers the option with `reply_type` (an error, or nbdgw's own
    /// ACK) and goes on to the next; used by every file beside this one.
    async fn refuse(
        &mut self,
        option: &OptionHeader,
        reply_type: u32,
        message: &str,
    ) -> Result<Step, ConnError> {
        self.client
            .send_reply(option.option, reply_type, message)
            .await?;
        Ok(Step::Next)
    }
}

pub use super::relayed::refuse_all;
