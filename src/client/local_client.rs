//! One local connection of `nbdgw client`: the plaintext fixed-newstyle
//! server side towards the local client (the greeting the server mode
//! sends before STARTTLS), the remote server reached with TLS (`remote`),
//! the local client's options relayed through the shared option relay
//! (`relayed`), then the shared transmission relay (`relay`). Only these
//! phases differ from the server mode; nothing here parses or relays on
//! its own.

use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncWrite};
use tracing::{debug, info, warn, Instrument};

use super::handover::{self, side::Local};
use super::reconnect::{MetaContexts, Opened, Reconnecting, Reopen};
use super::remote::{self, Remote, RemoteTls};
use crate::client::ClientSettings;
use crate::conn::error::{ConnError, Side};
use crate::conn::options::{OptionChannel, ShutdownAnswer};
use crate::conn::relayed::{self, Batch, Framing, Relayed};
use crate::conn::session::{Stats, Transmit};
use crate::logsafe::{escape_bytes, Escaped};
use crate::proto::consts::*;
use crate::proto::handover_client::ClientOffer;
use crate::proto::handshake::{ClientFlags, OptionHeader};
use crate::shutdown::Shutdown;

/// What the local client hears when the server fails mid-option: a TLS
/// alert after the handshake (in TLS 1.3 the server judges the client's
/// certificate after the client has finished) says the certificate was
/// refused; anything else is the error as logged.
fn server_failure(error: &ConnError) -> String {
    let alert = match error {
        ConnError::Io { error, .. } => error
            .get_ref()
            .and_then(|e| e.downcast_ref::<rustls::Error>())
            .and_then(|e| match e {
                rustls::Error::AlertReceived(alert) => Some(*alert),
                _ => None,
            }),
        _ => None,
    };
    match alert {
        Some(alert) => format!(
            "the server ended the TLS session with alert {alert:?}: it did not accept this client's certificate"
        ),
        None => format!("the server failed: {error}"),
    }
}

/// Serves one local connection to its end and logs how it ended.
pub async fn serve<S>(
    local: S,
    id: u64,
    peer: String,
    shared: Arc<ClientSettings>,
    shutdown: Shutdown,
) where
    S: Local,
{
    let span = tracing::info_span!("conn", id, peer = %peer);
    async move {
        let settings = &*shared;
        let metrics = &settings.metrics;
        info!("accepted");
        metrics.connections_open.inc();
        let started = Instant::now();
        let stats = Stats::new(metrics.clone());
        let mut cut = shutdown.clone();
        let result = tokio::select! {
            result = run((local, id), &shared, shutdown, &stats) => result,
            () = cut.cut() => Err(ConnError::GraceOver),
        };
        metrics.connections_open.dec();
        metrics.connection(match &result {
            Err(e) if !e.is_routine() => "error",
            _ => "closed",
        });
        crate::conn::log_close(result, &stats, started, false);
    }
    .instrument(span)
    .await
}

/// How negotiation ended.
enum Negotiated<S> {
    Closed(&'static str),
    /// Boxed: the TLS stream is large beside the other variant.
    Transmission(Box<Ready<S>>),
}

/// Both ends of a session entering transmission, and how it was agreed.
struct Ready<S> {
    local: S,
    remote: RemoteTls,
    opened: Opened,
    read_only: bool,
}

async fn run<S>(
    (local, id): (S, u64),
    shared: &Arc<ClientSettings>,
    shutdown: Shutdown,
    stats: &Stats,
) -> Result<&'static str, ConnError>
where
    S: Local,
{
    let settings = &**shared;
    let negotiated = tokio::time::timeout(
        settings.handshake_timeout,
        negotiate(local, settings, &shutdown),
    )
    .await
    .map_err(|_| ConnError::HandshakeTimeout(settings.handshake_timeout))??;
    let ready = match negotiated {
        Negotiated::Closed(reason) => return Ok(reason),
        Negotiated::Transmission(ready) => *ready,
    };
    let Ready {
        local,
        remote,
        opened,
        read_only,
    } = ready;
    let mode = opened.framing.mode();
    let transmit = Transmit {
        limits: super::limits(settings),
        shutdown,
        stats,
    };
    // A session that may be handed to a successor (`--handover-socket`).
    let mut offer = offer_of(&remote, &opened, settings);
    let both = (mode, read_only);
    match settings.reconnect {
        None => {
            let registered = handover::register(settings.handover.as_ref(), id, &offer);
            handover::transmit((local, Vec::new()), remote, both, registered, &transmit).await
        }
        Some(_) => {
            // The same relay, over a server stream that outlives drops;
            // a successor gets how to open the export again.
            offer.reconnect = Some(opened.to_wire());
            let registered = handover::register(settings.handover.as_ref(), id, &offer);
            let upstream = Reconnecting::new(remote, shared.clone(), opened, mode);
            handover::transmit((local, Vec::new()), upstream, both, registered, &transmit).await
        }
    }
}

/// What a successor judges of this session, and needs to relay it.
fn offer_of(remote: &RemoteTls, opened: &Opened, settings: &ClientSettings) -> ClientOffer {
    let conn = remote.get_ref().1;
    let export = match &opened.reopen {
        Reopen::Go(data) => relayed::split_name(data).to_vec(),
        Reopen::ExportName(name) => name.clone(),
    };
    ClientOffer {
        host: settings.host.clone(),
        port: settings.port,
        server_name: settings.server_name.to_str().into_owned(),
        chain: (conn.peer_certificates().unwrap_or_default().iter())
            .map(|c| c.to_vec())
            .collect(),
        tls_version: conn.protocol_version().map_or(0, u16::from),
        suite: (conn.negotiated_cipher_suite()).map_or(0, |s| u16::from(s.suite())),
        group: (conn.negotiated_key_exchange_group()).map_or(0, |g| u16::from(g.name())),
        export,
        max_payload: settings.relay.max_payload,
        mode: opened.framing.mode(),
        size: opened.export.0,
        tflags: opened.export.1,
        reconnect: None,
    }
}

/// The greeting towards the local client, the remote server reached, then
/// the local client's options relayed.
async fn negotiate<S>(
    local: S,
    settings: &ClientSettings,
    shutdown: &Shutdown,
) -> Result<Negotiated<S>, ConnError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut local = OptionChannel::new(local, Side::Client, settings.relay.max_option_len);
    let flags = crate::conn::plain::greet(&mut local).await?;
    let remote = match reach_server(settings).await {
        Ok(remote) => remote,
        // The local client is the operator's own: it may hear why.
        Err(message) => {
            return relayed::refuse_all(local, &message)
                .await
                .map(Negotiated::Closed)
        }
    };
    let options = Options {
        local,
        remote,
        flags,
        framing: Framing::default(),
        batch: Batch::default(),
        meta: None,
        settings,
    };
    options.run(shutdown).await
}

/// The remote server, connected and greeted; or, counted and logged, what
/// the local client is told instead.
async fn reach_server(settings: &ClientSettings) -> Result<Remote, String> {
    match remote::connect(settings).await {
        Ok(remote) => {
            settings.health.set_upstream_down(false);
            Ok(remote)
        }
        Err(e) => {
            settings.metrics.upstream_connect_failures.inc();
            settings.health.set_upstream_down(true);
            let error = e.to_string();
            warn!(reason = e.reason(), error = %Escaped(&error), "server unavailable");
            Err(format!("nbdgw client: {error}"))
        }
    }
}

enum Step {
    Next,
    Closed(&'static str),
    /// How the export was opened, and its size and flags.
    Transmission(Reopen, (u64, u16)),
}

/// The option relay of one connection.
struct Options<'a, S> {
    local: OptionChannel<S>,
    remote: Remote,
    flags: ClientFlags,
    framing: Framing,
    batch: Batch,
    /// The last NBD_OPT_SET_META_CONTEXT the server acknowledged, with
    /// the contexts it chose, for `--reconnect` to agree on again.
    meta: Option<MetaContexts>,
    settings: &'a ClientSettings,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Options<'_, S> {
    /// The local client's options, each answered or relayed, until one
    /// opens an export or the connection ends.
    async fn run(mut self, shutdown: &Shutdown) -> Result<Negotiated<S>, ConnError> {
        loop {
            let option = self.local.read_option().await?;
            match self.local.refuse_for_shutdown(&option, shutdown).await? {
                ShutdownAnswer::Serve => {}
                ShutdownAnswer::Refused => continue,
                ShutdownAnswer::End(reason) => return Ok(Negotiated::Closed(reason)),
            }
            self.batch.answered = false;
            let step = match self.dispatch(&option).await {
                Ok(step) => step,
                // No error reply exists for EXPORT_NAME: a failure closes.
                Err(e)
                    if e.is_upstream()
                        && !self.batch.answered
                        && option.option != OPT_EXPORT_NAME =>
                {
                    return self.server_failed(&option, &e).await;
                }
                Err(e) => return Err(e),
            };
            match step {
                Step::Next => {}
                Step::Closed(reason) => return Ok(Negotiated::Closed(reason)),
                Step::Transmission(reopen, export) => {
                    return Ok(self.enter_transmission(reopen, export))
                }
            }
        }
    }

    async fn dispatch(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
        match option.option {
            OPT_STARTTLS => self.starttls().await,
            OPT_ABORT => self.abort().await,
            OPT_EXPORT_NAME => self.export_name().await,
            OPT_LIST
            | OPT_INFO
            | OPT_GO
            | OPT_LIST_META_CONTEXT
            | OPT_SET_META_CONTEXT
            | OPT_STRUCTURED_REPLY
            | OPT_EXTENDED_HEADERS => self.relayed(option).await,
            _ => relayed::refuse_unsupported(&mut self.local, option)
                .await
                .map(|()| Step::Next),
        }
    }

    /// The server failed before this option was answered: the local
    /// client hears why, on this option and every later one (qemu goes on
    /// to its next option after an error to one that only asks for a
    /// framing), not just a closed socket.
    async fn server_failed(
        mut self,
        option: &OptionHeader,
        e: &ConnError,
    ) -> Result<Negotiated<S>, ConnError> {
        warn!(error = %Escaped(&e.to_string()), "the server failed during negotiation");
        let message = format!("nbdgw client: {}", server_failure(e));
        self.local
            .send_reply(option.option, REP_ERR_SHUTDOWN, &message)
            .await?;
        relayed::refuse_all(self.local, &message)
            .await
            .map(Negotiated::Closed)
    }

    /// TLS is this side's job towards the server; the local side is
    /// plaintext, which the spec's answer for "no TLS here" says.
    async fn starttls(&mut self) -> Result<Step, ConnError> {
        let message = "nbdgw client: the local side is plaintext; TLS is used towards the server";
        self.local
            .send_reply(OPT_STARTTLS, REP_ERR_UNSUP, message)
            .await?;
        Ok(Step::Next)
    }

    async fn abort(&mut self) -> Result<Step, ConnError> {
        // A soft disconnect for the server too; the ACK does not wait on it.
        let _ = self.remote.channel.send_option(OPT_ABORT, &[]).await;
        self.remote.channel.goodbye().await;
        self.local.acknowledge_abort().await?;
        Ok(Step::Closed("client sent NBD_OPT_ABORT"))
    }

    /// The old way in: a server refuses it by closing, and so must we.
    async fn export_name(&mut self) -> Result<Step, ConnError> {
        let data = self.local.data();
        let answered = relayed::export_name_exchange(
            &mut self.remote.channel,
            self.remote.pads_export_name,
            data,
        )
        .await?;
        let export = match answered {
            Ok(export) => export,
            Err(e) => {
                warn!(export = %escape_bytes(self.local.data()), error = %e, "the server refused NBD_OPT_EXPORT_NAME");
                return Ok(Step::Closed("the server refused the export"));
            }
        };
        relayed::answer_export_name(&mut self.local, export, self.flags).await?;
        self.log_negotiated(self.local.data(), export);
        let reopen = Reopen::ExportName(self.local.data().to_vec());
        Ok(Step::Transmission(reopen, export))
    }

    /// Forwards the option unchanged and relays every reply to it, with
    /// the maximum block size lowered to `--max-payload`.
    async fn relayed(&mut self, option: &OptionHeader) -> Result<Step, ConnError> {
        self.remote
            .channel
            .send_option(option.option, self.local.data())
            .await?;
        let (relayed, contexts) = self.relay_replies(option).await?;
        if option.option == OPT_SET_META_CONTEXT && relayed.reply_type == REP_ACK {
            let Some(chosen) = contexts else {
                warn!(
                    max_option_len = self.settings.relay.max_option_len,
                    "the server chose more metadata contexts than --max-option-len holds"
                );
                return Ok(Step::Closed("the server sent too many metadata contexts"));
            };
            self.meta = Some(MetaContexts {
                request: self.local.data().to_vec(),
                chosen,
            });
        }
        debug!(
            option = option_name(option.option),
            reply = format_args!("{:#x}", relayed.reply_type),
            "relayed"
        );
        if relayed.reply_type != REP_ACK {
            self.log_refusal(option, &relayed);
            return Ok(Step::Next);
        }
        self.framing.acknowledged(option.option);
        if option.option != OPT_GO {
            return Ok(Step::Next);
        }
        // The spec makes INFO_EXPORT mandatory before GO's ACK.
        let Some(export) = relayed.export else {
            warn!("the server acknowledged NBD_OPT_GO without NBD_INFO_EXPORT");
            return Ok(Step::Closed("the server sent no export information"));
        };
        let name = relayed::split_name(self.local.data());
        self.log_negotiated(name, export);
        Ok(Step::Transmission(
            Reopen::Go(self.local.data().to_vec()),
            export,
        ))
    }

    /// The server's replies to `option`, relayed; with the metadata
    /// contexts it chose, kept for `--reconnect` within `--max-option-len`
    /// in all (a server's endless replies must not grow memory; `None`:
    /// it sent more, and cannot be agreed with again).
    async fn relay_replies(
        &mut self,
        option: &OptionHeader,
    ) -> Result<(Relayed, Option<Vec<Vec<u8>>>), ConnError> {
        let max_payload = self.settings.relay.max_payload;
        let max_option_len = self.settings.relay.max_option_len as usize;
        let mut contexts = Vec::new();
        let (mut kept, mut too_many) = (0usize, false);
        let relayed = relayed::relay_replies(
            &mut self.local,
            &mut self.remote.channel,
            option.option,
            &mut self.batch,
            |reply_type, batch, start| match reply_type {
                REP_INFO => {
                    relayed::info_export(&mut batch[start + OPTION_REPLY_HEADER_LEN..], max_payload)
                }
                REP_META_CONTEXT => {
                    let context = &batch[start + OPTION_REPLY_HEADER_LEN..];
                    kept += context.len() + 16;
                    if kept <= max_option_len {
                        contexts.push(context.to_vec());
                    } else {
                        too_many = true;
                    }
                    None
                }
                _ => None,
            },
        )
        .await?;
        Ok((relayed, (!too_many).then_some(contexts)))
    }

    /// Why a disk cannot be opened belongs in the log, with the server's
    /// own words (escaped: they are the server's).
    fn log_refusal(&self, option: &OptionHeader, relayed: &Relayed) {
        if matches!(option.option, OPT_GO | OPT_INFO) {
            warn!(
                option = option_name(option.option),
                export = %Escaped(&relayed::go_export_name(self.local.data())),
                reply = remote::reply_name(relayed.reply_type),
                message = %escape_bytes(&relayed.message),
                "the server refused the export"
            );
        }
    }

    fn log_negotiated(&self, export: &[u8], (size, tflags): (u64, u16)) {
        info!(
            export = %escape_bytes(export),
            server = %Escaped(&self.settings.server),
            mode = ?self.framing.mode(),
            size,
            transmission_flags = format_args!("{tflags:#x}"),
            read_only = tflags & TFLAG_READ_ONLY != 0,
            "negotiated"
        );
    }

    fn enter_transmission(self, reopen: Reopen, export: (u64, u16)) -> Negotiated<S> {
        Negotiated::Transmission(Box::new(Ready {
            local: self.local.into_inner(),
            remote: self.remote.channel.into_inner(),
            opened: Opened {
                reopen,
                framing: self.framing,
                meta: self.meta,
                export,
            },
            read_only: export.1 & TFLAG_READ_ONLY != 0,
        }))
    }
}
