//! Option haggling after TLS: relay the client's options one at a time to
//! the upstream of the export they name (connected only once the option
//! passed authorization), learning from the upstream's replies what
//! framing transmission will use. One short function per kind of option.

use super::buffered::Buffered;
use tokio::net::UnixStream;
use tracing::{debug, info, warn};

use super::error::{ConnError, Side};
use super::options::{OptionChannel, ShutdownAnswer};
use super::relayed::{self, Batch, Framing, Relayed};
use super::session::{Audit, ClientStream, Session, AUDIT};
use crate::config::Config;
use crate::exports::{DirSocket, Export};
use crate::logsafe::{escape, escape_bytes, Escaped};
use crate::policy::{Access, Policy, RuleRef};
use crate::proto::consts::*;
use crate::proto::handshake::{
    encode_info_name, encode_option_reply, encode_server_entry, force_read_only, is_info_name,
    read_only_flags, split_export_name, with_export_name, ClientFlags, OptionHeader,
};
use crate::proto::name::{export_name, NameError};
use crate::shutdown::Shutdown;
use crate::tls::CertInfo;
use crate::upstream::{self, UpstreamError};
use std::path::Path;
use std::sync::Arc;

pub enum Outcome {
    /// The session, and what the audit trail says of it.
    Transmission(Box<Session>, Box<Audit>),
    Closed(&'static str),
}

/// Upstream option replies come in bursts (INFO, INFO, ACK): read through
/// a buffer, each burst is one read instead of two per reply.
const UPSTREAM_NEGOTIATION_BUF: usize = 4096;

/// What a client hears when the single `--upstream` cannot be reached
/// (why, with its path, is in the log only).
const SINGLE_UNAVAILABLE: &str = "nbdgw: upstream NBD server unavailable";

/// Why a connection that kept naming exports it may not open ended.
const TOO_MANY_REFUSALS: &str = "more export names refused than --max-refused-options";

/// How much of a malformed export name the log shows.
const LOGGED_NAME_BYTES: usize = 256;

type Client = OptionChannel<ClientStream>;
type UpstreamChannel = OptionChannel<Buffered<UnixStream>>;

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

/// An upstream connection in negotiation.
struct Attached {
    channel: UpstreamChannel,
    /// The client's name for the export it serves; `None` for the single
    /// `--upstream`, which serves every name.
    export: Option<String>,
    pads_export_name: bool,
    /// Which server it reached, for the read cache.
    incarnation: Option<upstream::Incarnation>,
}

impl Attached {
    /// Connects and greets the upstream on `socket`; a failure is counted
    /// and logged here, once, for every caller.
    async fn connect(
        socket: &Path,
        in_dir: Option<&DirSocket>,
        export: Option<String>,
        config: &Config,
    ) -> Result<Self, UpstreamError> {
        let upstream = match upstream::open(socket, in_dir, config.dial()).await {
            Ok(upstream) => upstream,
            Err(e) => {
                config.metrics.upstream_connect_failures.inc();
                let named = export
                    .as_deref()
                    .map(|e| tracing::field::display(Escaped(e)));
                // The error names the socket's path: for the log only.
                // During the shutdown the drain's end says it once.
                if config.health.is_draining() {
                    // Named as the audit lines name it, to share their count.
                    let upstream = escape(&socket.display().to_string()).into_owned();
                    config.health.refused_by_upstream(&upstream);
                    info!(export = named, error = %Escaped(&e.to_string()), "upstream unavailable during the shutdown");
                } else {
                    warn!(export = named, error = %Escaped(&e.to_string()), "upstream unavailable");
                }
                return Err(e);
            }
        };
        let stream = Buffered::new(UPSTREAM_NEGOTIATION_BUF, upstream.stream);
        let channel = OptionChannel::new(stream, Side::Upstream, config.relay.max_option_len)
            .bounded(config.upstream_timeout);
        Ok(Attached {
            channel,
            export,
            pads_export_name: upstream.pads_export_name,
            incarnation: upstream.incarnation,
        })
    }
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

    /// The old way in: no error reply exists, so a refusal closes.
    async fn export_name(&mut self) -> Result<Step, ConnError> {
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
        if let Some(found) = self.route(&export) {
            let Some(target) = found else {
                self.config.metrics.exports_refused.inc();
                return Ok(Step::Closed("NBD_OPT_EXPORT_NAME for an unknown export"));
            };
            if let Err(why) = self.attach(&target).await? {
                warn!(export = %Escaped(&export), why = %Escaped(&why), "closing: NBD_OPT_EXPORT_NAME cannot be refused");
                return Ok(Step::Closed(
                    "NBD_OPT_EXPORT_NAME for an unavailable export",
                ));
            }
            self.renamed = Some(Renamed {
                data: target.upstream_name.clone().into_bytes(),
                client_name: export.clone(),
            });
            self.target = Some(target);
        } else if !self.reach_single().await {
            return Ok(Step::Closed(
                "NBD_OPT_EXPORT_NAME with the upstream unavailable",
            ));
        }
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

    /// Records what the policy granted for the export `name`: an
    /// immutable export is read-only to everyone, so that no write can
    /// make the shared cache disagree with it.
    fn granted(&mut self, decision: crate::policy::Decision, name: &str) {
        (self.access, self.rule) = (decision.access, decision.rule);
        self.immutable = self.config.read_cache.immutable.matches(name);
        if self.immutable {
            self.access = Access::ReadOnly;
        }
    }

    /// With named exports: `Some(the export)`, or `Some(None)` for a name
    /// nothing serves. Without (one upstream for every name): `None`.
    fn route(&self, name: &str) -> Option<Option<Export>> {
        let table = self.config.exports.as_ref()?;
        Some(table.lookup(name))
    }

    /// With the single `--upstream`: whether an option from this client
    /// may reach it at all, the options that name no export (LIST and the
    /// framing ones) included. An identity no rule admits never causes a
    /// connection, so it can hold none of the server's slots
    /// (`qemu-nbd --shared=N`).
    fn may_reach_single(&self) -> bool {
        self.config.exports.is_none() && self.policy.grants_anything(&self.identity)
    }

    /// Connects the single `--upstream` if not yet connected; for options
    /// that passed authorization only. False when it cannot be reached
    /// (logged by `Attached::connect`).
    async fn reach_single(&mut self) -> bool {
        if self.upstream.is_some() {
            return true;
        }
        match Attached::connect(&self.config.upstream, None, None, self.config).await {
            Ok(attached) => {
                self.upstream = Some(attached);
                true
            }
            Err(_) => false,
        }
    }

    async fn single_unavailable(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
        self.client
            .send_reply(option.option, REP_ERR_SHUTDOWN, SINGLE_UNAVAILABLE)
            .await?;
        Ok(Step::Unavailable)
    }

    /// INFO, GO and the META_CONTEXT options: authorized for the export
    /// they name, sent to its upstream under the upstream's name for it.
    async fn naming_an_export(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
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

    /// Denied and nonexistent exports get the same answer, so names do
    /// not leak.
    async fn unknown(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
        self.config.metrics.exports_refused.inc();
        if self.one_refusal_too_many() {
            return Ok(Step::Closed(TOO_MANY_REFUSALS));
        }
        self.refuse(option, REP_ERR_UNKNOWN, "unknown export").await
    }

    /// Counts a refused name; true once past `--max-refused-options`.
    fn one_refusal_too_many(&mut self) -> bool {
        self.refusals += 1;
        self.refusals > self.config.max_refused_options
    }

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

    fn log_malformed(&self, raw: &[u8], error: NameError) {
        info!(
            client = %self.identity,
            // A too-long name is logged only in part.
            export = %escape_bytes(&raw[..raw.len().min(LOGGED_NAME_BYTES)]),
            %error,
            "refused: not an export name"
        );
    }

    fn log_refused(&self, export: &str) {
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

    /// Makes `target`'s upstream the one options go to, connecting (and
    /// agreeing the framing already agreed with the client) if it is not
    /// already. `Err(why)` when that fails; the client is told by the caller.
    async fn attach(&mut self, target: &Export) -> Result<Result<(), String>, ConnError> {
        let current = self.upstream.as_ref().and_then(|u| u.export.as_deref());
        if current == Some(target.name.as_str()) {
            return Ok(Ok(()));
        }
        if let Some(mut old) = self.upstream.take() {
            // A soft disconnect, so the server does not log a lost client.
            let _ = old.channel.send_option(OPT_ABORT, &[]).await;
            old.channel.goodbye().await;
        }
        let export = Some(target.name.clone());
        let mut attached =
            match Attached::connect(&target.socket, target.in_dir.as_ref(), export, self.config)
                .await
            {
                Ok(attached) => attached,
                Err(e) => return Ok(Err(e.to_string())),
            };
        if let Some(code) = self.framing.replay() {
            attached.channel.send_option(code, &[]).await?;
            let mut scratch = Vec::new();
            let reply = attached.channel.read_reply(code, &mut scratch).await?;
            if reply.reply_type != REP_ACK {
                return Ok(Err(format!(
                    "its server refused the reply framing already agreed (option {code})"
                )));
            }
        }
        self.upstream = Some(attached);
        Ok(Ok(()))
    }

    /// LIST: with named exports nbdgw answers itself, else the upstream's
    /// answer is relayed; either way only the exports this client may
    /// open are listed.
    async fn list(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
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

    /// STRUCTURED_REPLY and EXTENDED_HEADERS go to the upstream in use
    /// (the single `--upstream` is connected for them if this client may
    /// reach it). Before any export is chosen (named exports, or an
    /// identity no rule admits), nbdgw agrees to
    /// structured replies itself and asks each upstream for them as it
    /// connects; extended headers it cannot promise for an upstream not
    /// yet chosen, so it declines them then and clients fall back.
    async fn framing(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
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

    /// Forwards the option and relays every reply to it. After an
    /// upstream failure the client still gets an answer, not a hang, if
    /// it has had none yet.
    async fn relayed(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
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
    async fn relay_replies(&mut self, option: &OptionHeader) -> Result<Relayed, ConnError> {
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

    fn enter_transmission(
        mut self,
        export: &str,
        size: u64,
        tflags: u16,
    ) -> Result<Outcome, ConnError> {
        let Some(upstream) = self.upstream.take() else {
            return Err(ConnError::closed(
                Side::Upstream,
                "before an export was chosen",
            ));
        };
        // A server sends nothing in transmission before a request, so
        // nothing read ahead can be left behind in the negotiation buffer.
        let mut channel = upstream.channel;
        relayed::check_nothing_ahead(channel.get_mut().buffer().len())?;
        let mode = self.framing.mode();
        let read_only = tflags & TFLAG_READ_ONLY != 0;
        let cache = self.cache(export, size, tflags, upstream.incarnation);
        let audit = self.audit(export);
        info!(
            target: AUDIT,
            client = %audit.client,
            export = %audit.export,
            upstream_export = %audit.upstream_export,
            upstream = %audit.upstream,
            access = %audit.access,
            rule = %audit.rule,
            rule_line = audit.rule_line,
            ?mode,
            size,
            transmission_flags = format_args!("{tflags:#x}"),
            read_only,
            immutable = self.immutable,
            cached = cache.is_some(),
            "negotiated"
        );
        let session = Session {
            tls: self.client.into_inner(),
            upstream: channel.into_inner().into_inner(),
            mode,
            read_only,
            export: export.to_string(),
            access: self.access,
            cache,
        };
        Ok(Outcome::Transmission(Box::new(session), Box::new(audit)))
    }

    /// The session's handle on the read cache, for an immutable export
    /// with the cache on. Keyed by the upstream's socket and its name for
    /// the export, so two client names for one export share blocks; the
    /// server it reached (`incarnation`) and the size and flags it
    /// reported now decide the generation.
    fn cache(
        &self,
        export: &str,
        size: u64,
        tflags: u16,
        incarnation: Option<upstream::Incarnation>,
    ) -> Option<crate::cache::Handle> {
        if !self.immutable {
            return None;
        }
        let cache = self.config.read_cache.cache.as_ref()?;
        let (key, in_dir) = match &self.target {
            Some(target) => (
                crate::cache::ExportKey {
                    socket: target.socket.clone(),
                    upstream_name: target.upstream_name.clone(),
                },
                target.in_dir.as_ref(),
            ),
            None => (
                crate::cache::ExportKey {
                    socket: self.config.upstream.clone(),
                    upstream_name: export.to_string(),
                },
                None,
            ),
        };
        let Some(incarnation) = incarnation else {
            debug!(export = %Escaped(export), "read cache: the upstream's socket file is unknown; not cached");
            return None;
        };
        // A session that reached a server whose socket has been replaced
        // since (a new server started while this one negotiated) neither
        // takes the new server's generation away nor is cached. Checked
        // by the cache under its lock, only when the server is not the
        // one the export knows, so that no other session's open comes
        // between the check and the generation changing hands.
        let current = || {
            let current =
                crate::exports::socket_file_now(&key.socket, in_dir) == Some(incarnation.file);
            if !current {
                info!(export = %Escaped(export), "read cache: the upstream was replaced while this session negotiated; not cached");
            }
            current
        };
        // What the upstream offers only to clients of some framing says
        // nothing of the export: clients of every framing share blocks.
        let flags = tflags & !(TFLAG_SEND_DF | TFLAG_BLOCK_STAT_PAYLOAD);
        cache.open(&key, incarnation, (size, flags), current)
    }

    /// What the audit trail says of the session entering transmission on
    /// `export` (the client's name for it).
    fn audit(&self, export: &str) -> Audit {
        let (upstream_export, upstream) = match &self.target {
            Some(target) => (target.upstream_name.as_str(), target.socket.as_path()),
            // One upstream for every name: asked for the client's name.
            None => (export, self.config.upstream.as_path()),
        };
        let (rule, rule_line) = match self.rule {
            Some(rule) => (format!("policy:{}", rule.number), rule.line),
            None if self.config.allow_lists => ("--allow-*".to_string(), 0),
            None => ("open".to_string(), 0),
        };
        Audit {
            client: self.identity.to_string(),
            export: escape(export).into_owned(),
            upstream_export: escape(upstream_export).into_owned(),
            upstream: escape(&upstream.display().to_string()).into_owned(),
            access: self.access,
            rule,
            rule_line,
        }
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

/// Whether a relayed LIST entry names an export this client may open.
fn listed(policy: &Policy, identity: &CertInfo, body: &[u8]) -> bool {
    let Some((name, _)) = split_export_name(body) else {
        return false;
    };
    // A name no client could open through nbdgw is not listed either.
    export_name(name).is_ok_and(|name| policy.is_open() || policy.decide(identity, name).is_some())
}

pub use super::relayed::refuse_all;
