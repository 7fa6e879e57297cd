//! The end of negotiation: the upstream connection and the client's
//! stream become a `Session`, with its handle on the read cache (for an
//! immutable export) and what the audit trail says of it, logged once as
//! the session's "negotiated" line.

use tracing::{debug, info};

use super::{Negotiation, Outcome};
use crate::conn::error::{ConnError, Side};
use crate::conn::relayed;
use crate::conn::session::{Audit, Session, AUDIT};
use crate::logsafe::{escape, Escaped};
use crate::proto::consts::*;
use crate::upstream;

impl Negotiation<'_> {
    pub(super) fn enter_transmission(
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
        let target = self.target_of(export, size, tflags);
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
            target,
        };
        Ok(Outcome::Transmission(Box::new(session), Box::new(audit)))
    }

    /// The session's handle on the read cache, for an immutable export
    /// with the cache on. Keyed by the upstream's socket and its name for
    /// the export, so two client names for one export share blocks; the
    /// server it reached (`incarnation`) and the size and flags it
    /// reported now decide the generation.
    pub(super) fn cache(
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

    /// The upstream end, unescaped, for a hand-over.
    fn target_of(&self, export: &str, size: u64, tflags: u16) -> crate::conn::session::Target {
        let (upstream_export, socket) = match &self.target {
            Some(target) => (target.upstream_name.clone(), target.socket.clone()),
            None => (export.to_string(), self.config.upstream.clone()),
        };
        crate::conn::session::Target {
            socket,
            upstream_export,
            size,
            tflags,
        }
    }

    /// What the audit trail says of the session entering transmission on
    /// `export` (the client's name for it).
    pub(super) fn audit(&self, export: &str) -> Audit {
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
