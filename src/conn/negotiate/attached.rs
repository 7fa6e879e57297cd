//! The upstream an option goes to: with one `--upstream`, connected by
//! the first option that passed authorization; with named exports, that
//! of the export the last naming option chose, switched as names change.
//! Connecting only after authorization means an identity no rule admits
//! never holds one of the server's slots.

use std::path::Path;

use tokio::net::UnixStream;
use tracing::{info, warn};

use super::{Negotiation, Step, SINGLE_UNAVAILABLE};
use crate::config::Config;
use crate::conn::buffered::Buffered;
use crate::conn::error::{ConnError, Side};
use crate::conn::options::OptionChannel;
use crate::exports::{DirSocket, Export};
use crate::logsafe::{escape, Escaped};
use crate::proto::consts::*;
use crate::proto::handshake::OptionHeader;
use crate::upstream::{self, UpstreamError};

/// Upstream option replies come in bursts (INFO, INFO, ACK): read through
/// a buffer, each burst is one read instead of two per reply.
const UPSTREAM_NEGOTIATION_BUF: usize = 4096;

pub(super) type UpstreamChannel = OptionChannel<Buffered<UnixStream>>;

/// An upstream connection in negotiation.
pub(super) struct Attached {
    pub(super) channel: UpstreamChannel,
    /// The client's name for the export it serves; `None` for the single
    /// `--upstream`, which serves every name.
    pub(super) export: Option<String>,
    pub(super) pads_export_name: bool,
    /// Which server it reached, for the read cache.
    pub(super) incarnation: Option<upstream::Incarnation>,
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

impl Negotiation<'_> {
    /// With the single `--upstream`: whether an option from this client
    /// may reach it at all, the options that name no export (LIST and the
    /// framing ones) included. An identity no rule admits never causes a
    /// connection, so it can hold none of the server's slots
    /// (`qemu-nbd --shared=N`).
    pub(super) fn may_reach_single(&self) -> bool {
        self.config.exports.is_none() && self.policy.grants_anything(&self.identity)
    }

    /// Connects the single `--upstream` if not yet connected; for options
    /// that passed authorization only. False when it cannot be reached
    /// (logged by `Attached::connect`).
    pub(super) async fn reach_single(&mut self) -> bool {
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

    pub(super) async fn single_unavailable(
        &mut self,
        option: &OptionHeader,
    ) -> Result<Step, ConnError> {
        self.client
            .send_reply(option.option, REP_ERR_SHUTDOWN, SINGLE_UNAVAILABLE)
            .await?;
        Ok(Step::Unavailable)
    }

    /// Makes `target`'s upstream the one options go to, connecting (and
    /// agreeing the framing already agreed with the client) if it is not
    /// already. `Err(why)` when that fails; the client is told by the caller.
    pub(super) async fn attach(
        &mut self,
        target: &Export,
    ) -> Result<Result<(), String>, ConnError> {
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
}
