//! Option haggling after TLS: connect upstream, then relay the client's
//! options one at a time, learning from the upstream's replies what
//! framing transmission will use. One short function per kind of option.

use tokio::io::BufReader;
use tokio::net::UnixStream;
use tracing::{debug, info, warn};

use super::error::{ConnError, Side};
use super::options::{OptionChannel, ShutdownAnswer};
use super::session::{ClientTls, Session};
use crate::config::Config;
use crate::logsafe::Escaped;
use crate::proto::consts::*;
use crate::proto::handshake::{
    clamp_block_size, encode_export_name_reply, export_name_prefix, parse_export_name_reply,
    parse_info_export, ClientFlags, OptionHeader,
};
use crate::proto::transmission::ReplyMode;
use crate::proto::ProtoError;
use crate::shutdown::Shutdown;
use crate::upstream::{self, Upstream};

pub enum Outcome {
    Transmission(Box<Session>),
    Closed(&'static str),
}

/// Upstream option replies come in bursts (INFO, INFO, ACK): read through
/// a buffer, each burst is one read instead of two per reply.
const UPSTREAM_NEGOTIATION_BUF: usize = 4096;
/// Option replies to the client are gathered into one TLS write per
/// option, up to this much (a long LIST goes out in pieces).
const CLIENT_REPLY_BATCH: usize = 16 * 1024;

type Client = OptionChannel<ClientTls>;
type UpstreamChannel = OptionChannel<BufReader<UnixStream>>;

pub async fn relay_options(
    tls: ClientTls,
    client_flags: ClientFlags,
    config: &Config,
    shutdown: &Shutdown,
) -> Result<Outcome, ConnError> {
    let client = OptionChannel::new(tls, Side::Client, config.max_option_len);
    // Only now, with TLS up, does the upstream hear of this client.
    let upstream = match upstream::open(config).await {
        Ok(upstream) => upstream,
        Err(e) => {
            config.metrics.upstream_connect_failures.inc();
            warn!(error = %e, "upstream unavailable");
            let message = format!("nbdgw: upstream NBD server unavailable: {e}");
            return refuse_all(client, &message).await.map(Outcome::Closed);
        }
    };
    let mut negotiation = Negotiation::new(client, upstream, client_flags, config);
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
        let step = match option.option {
            OPT_STARTTLS => negotiation.starttls_again().await?,
            OPT_ABORT => negotiation.abort(&option).await?,
            OPT_EXPORT_NAME => negotiation.export_name(&option).await?,
            OPT_LIST
            | OPT_INFO
            | OPT_GO
            | OPT_STRUCTURED_REPLY
            | OPT_LIST_META_CONTEXT
            | OPT_SET_META_CONTEXT
            | OPT_EXTENDED_HEADERS => negotiation.relayed(&option).await?,
            _ => negotiation.unsupported(&option).await?,
        };
        match step {
            Step::Next => {}
            Step::Closed(reason) => return Ok(Outcome::Closed(reason)),
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
    /// The export, its size and transmission flags, as the upstream said.
    Transmission {
        export: String,
        size: u64,
        tflags: u16,
    },
}

struct Negotiation<'a> {
    client: Client,
    upstream: UpstreamChannel,
    client_flags: ClientFlags,
    pads_export_name: bool,
    structured: bool,
    extended: bool,
    /// Upstream replies to the current option not yet sent to the client.
    batch: Vec<u8>,
    /// Whether any reply to the current option has reached the client.
    answered: bool,
    config: &'a Config,
}

/// The final reply to a relayed option, and the export it announced.
struct Relayed {
    reply_type: u32,
    export: Option<(u64, u16)>,
}

impl<'a> Negotiation<'a> {
    fn new(
        client: Client,
        upstream: Upstream,
        client_flags: ClientFlags,
        config: &'a Config,
    ) -> Self {
        let stream = BufReader::with_capacity(UPSTREAM_NEGOTIATION_BUF, upstream.stream);
        Negotiation {
            client,
            upstream: OptionChannel::new(stream, Side::Upstream, config.max_option_len),
            client_flags,
            pads_export_name: upstream.pads_export_name,
            structured: false,
            extended: false,
            batch: Vec::new(),
            answered: false,
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
        let _ = self.upstream.send_option(option, self.client.data()).await;
        self.client.acknowledge_abort().await?;
        Ok(Step::Closed("client sent NBD_OPT_ABORT"))
    }

    async fn unsupported(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
        debug!(code = option.option, "refused unknown option");
        let message = format!(
            "nbdgw does not relay option {}: its effect on framing is unknown",
            option.option
        );
        self.client
            .send_reply(option.option, REP_ERR_UNSUP, &message)
            .await?;
        Ok(Step::Next)
    }

    async fn export_name(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
        let export = String::from_utf8_lossy(self.client.data()).into_owned();
        self.upstream
            .send_option(option, self.client.data())
            .await?;
        let mut reply = [0u8; 10];
        let when = "in an EXPORT_NAME reply";
        if let Err(e) = self.upstream.read_exact(&mut reply, when).await {
            // Closing is the only way a server can refuse EXPORT_NAME.
            warn!(export = %Escaped(&export), error = %e, "upstream refused NBD_OPT_EXPORT_NAME");
            return Ok(Step::Closed("upstream refused the export"));
        }
        if self.pads_export_name {
            let mut zeroes = [0u8; EXPORT_NAME_PADDING];
            self.upstream.read_exact(&mut zeroes, when).await?;
        }
        let (size, tflags) = parse_export_name_reply(&reply);
        self.client
            .send(&encode_export_name_reply(size, tflags, self.client_flags))
            .await?;
        Ok(Step::Transmission {
            export,
            size,
            tflags,
        })
    }

    /// Forwards the option and relays every reply to it. After an
    /// upstream failure the client still gets an answer, not a hang, if
    /// it has had none yet.
    async fn relayed(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
        let relayed = match self.relay_replies(option).await {
            Ok(relayed) => relayed,
            Err(e) if e.is_upstream() && !self.answered => {
                let message = format!("nbdgw: upstream NBD server failed: {e}");
                let _ = self
                    .client
                    .send_reply(option.option, REP_ERR_SHUTDOWN, &message)
                    .await;
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        debug!(
            option = option_name(option.option),
            reply = format_args!("{:#x}", relayed.reply_type),
            "relayed"
        );
        if relayed.reply_type != REP_ACK {
            return Ok(Step::Next);
        }
        match option.option {
            OPT_STRUCTURED_REPLY => self.structured = true,
            OPT_EXTENDED_HEADERS => self.extended = true,
            OPT_GO => {
                let export = export_name_prefix(self.client.data()).unwrap_or_default();
                // The spec makes INFO_EXPORT mandatory before GO's ACK; a
                // server that omits it gets no read-only enforcement.
                let (size, tflags) = relayed.export.unwrap_or((0, 0));
                return Ok(Step::Transmission {
                    export,
                    size,
                    tflags,
                });
            }
            _ => {}
        }
        Ok(Step::Next)
    }

    /// Relays the upstream's replies to `option` up to the final one,
    /// gathered so that each burst reaches the client as one TLS write.
    async fn relay_replies(&mut self, option: &OptionHeader) -> Result<Relayed, ConnError> {
        self.answered = false;
        self.batch.clear();
        self.upstream
            .send_option(option, self.client.data())
            .await?;
        let mut export = None;
        loop {
            let start = self.batch.len();
            let reply = self
                .upstream
                .read_reply(option.option, &mut self.batch)
                .await?;
            if reply.reply_type == REP_INFO {
                let body = &mut self.batch[start + OPTION_REPLY_HEADER_LEN..];
                export = parse_info_export(body).or(export);
                // A compliant client then never sends more than nbdgw takes.
                if clamp_block_size(body, self.config.max_payload) {
                    debug!(
                        max_payload = self.config.max_payload,
                        "lowered the upstream's maximum block size to --max-payload"
                    );
                }
            }
            if reply.is_final() || self.batch.len() >= CLIENT_REPLY_BATCH {
                self.client.send(&self.batch).await?;
                self.batch.clear();
                self.answered = true;
            }
            if reply.is_final() {
                return Ok(Relayed {
                    reply_type: reply.reply_type,
                    export,
                });
            }
        }
    }

    fn enter_transmission(
        mut self,
        export: &str,
        size: u64,
        tflags: u16,
    ) -> Result<Outcome, ConnError> {
        // A server sends nothing in transmission before a request, so
        // nothing read ahead can be left behind in the negotiation buffer.
        if !self.upstream.get_mut().buffer().is_empty() {
            return Err(ConnError::Proto {
                side: Side::Upstream,
                error: ProtoError::Malformed(
                    "data after the end of negotiation, before any request",
                ),
            });
        }
        // Extended headers take precedence over structured replies.
        let mode = match (self.extended, self.structured) {
            (true, _) => ReplyMode::Extended,
            (false, true) => ReplyMode::Structured,
            (false, false) => ReplyMode::Simple,
        };
        let read_only = tflags & TFLAG_READ_ONLY != 0;
        info!(
            export = %Escaped(export),
            ?mode,
            size,
            transmission_flags = format_args!("{tflags:#x}"),
            read_only,
            "negotiated"
        );
        Ok(Outcome::Transmission(Box::new(Session {
            tls: self.client.into_inner(),
            upstream: self.upstream.into_inner().into_inner(),
            mode,
            read_only,
        })))
    }
}

/// Without an upstream (or a session slot), every option gets an error
/// that names the cause, so clients report it instead of hanging.
pub async fn refuse_all(mut client: Client, message: &str) -> Result<&'static str, ConnError> {
    loop {
        let option = client.read_option().await?;
        match option.option {
            OPT_EXPORT_NAME => return Ok("refused NBD_OPT_EXPORT_NAME: no reply is possible"),
            OPT_ABORT => {
                client.acknowledge_abort().await?;
                return Ok("client sent NBD_OPT_ABORT after a refusal");
            }
            _ => {
                client
                    .send_reply(option.option, REP_ERR_SHUTDOWN, message)
                    .await?
            }
        }
    }
}
