//! A `--reconnect` session and the hand-over (`crate::client::handover`):
//! the server's connection is either one made here (`RemoteTls`) or one
//! handed to this process (`ResumedRemote`), and a quiet `Reconnecting`
//! gives its connection up for a successor only when nothing is kept,
//! held or half passed and the link is up: one that is reconnecting at
//! that moment is refused (it stays with the old process and drains).
//! What the successor needs to reconnect later (the export's opening,
//! framing and metadata contexts) travels in the offer.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::{Link, MetaContexts, Opened, Reconnecting, Reopen};
use crate::client::handover::side::{RemoteSide, ResumedRemote, TakeError, Taken};
use crate::client::remote::RemoteTls;
use crate::client::ClientSettings;
use crate::proto::handover_client::Reopening;
use crate::proto::transmission::ReplyMode;

/// The server's connection while it is up. Boxed where it is kept
/// (`Link::Up`), so the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum UpStream {
    /// Made by this process.
    Fresh(RemoteTls),
    /// Handed to this process by the one before.
    Resumed(ResumedRemote),
}

impl Reconnecting {
    /// A session handed over with `--reconnect`: its connection as it
    /// came, and how to open the export again after a later drop.
    pub fn resumed(
        remote: ResumedRemote,
        settings: Arc<ClientSettings>,
        opened: Opened,
        mode: ReplyMode,
    ) -> Self {
        let up = Link::Up(Box::new(UpStream::Resumed(remote)));
        Self::with_link(up, settings, opened, mode)
    }

    /// Why this session cannot be handed over now, if it cannot.
    fn busy(&self) -> Option<&'static str> {
        if !matches!(self.link, Link::Up(_)) {
            return Some("it is reconnecting to the server (--reconnect)");
        }
        let idle = self.kept.is_empty()
            && !self.passing()
            && self.out_at == self.out.len()
            && self.message.is_empty()
            && self.held_replies.is_empty()
            && self.replay.is_none()
            && !self.server_going
            && !self.disconnecting;
        (!idle).then_some("requests or replies are kept for --reconnect")
    }
}

impl Opened {
    /// What the offer carries of it.
    pub fn to_wire(&self) -> Reopening {
        let (go, data) = match &self.reopen {
            Reopen::Go(data) => (true, data.clone()),
            Reopen::ExportName(name) => (false, name.clone()),
        };
        Reopening {
            go,
            data,
            structured: self.framing.structured,
            extended: self.framing.extended,
            meta: (self.meta.as_ref()).map(|m| (m.request.clone(), m.chosen.clone())),
        }
    }

    /// The opening a handed-over session reconnects with; its size and
    /// flags as first announced (checked again at each reconnect).
    pub fn from_wire(wire: Reopening, export: (u64, u16)) -> Self {
        let framing = crate::conn::relayed::Framing {
            structured: wire.structured,
            extended: wire.extended,
        };
        Opened {
            reopen: match wire.go {
                true => Reopen::Go(wire.data),
                false => Reopen::ExportName(wire.data),
            },
            framing,
            meta: wire
                .meta
                .map(|(request, chosen)| MetaContexts { request, chosen }),
            export,
        }
    }
}

impl RemoteSide for Reconnecting {
    async fn send_owed(&mut self) -> io::Result<()> {
        match &mut self.link {
            Link::Up(up) => match up.as_mut() {
                UpStream::Fresh(tls) => tls.send_owed().await,
                UpStream::Resumed(tls) => tls.send_owed().await,
            },
            _ => Ok(()),
        }
    }

    fn take(mut self, generations: usize) -> Result<Taken, TakeError<Self>> {
        if let Some(why) = self.busy() {
            return Err(TakeError::Back(self, why.to_string()));
        }
        let Link::Up(up) = std::mem::replace(&mut self.link, Link::Changed) else {
            unreachable!("busy() refuses a link that is not up");
        };
        let (up, why) = match *up {
            UpStream::Fresh(tls) => match tls.take(generations) {
                Ok(taken) => return Ok(taken),
                Err(TakeError::Back(tls, why)) => (UpStream::Fresh(tls), why),
                Err(TakeError::Lost(why)) => return Err(TakeError::Lost(why)),
            },
            UpStream::Resumed(tls) => match tls.take(generations) {
                Ok(taken) => return Ok(taken),
                Err(TakeError::Back(tls, why)) => (UpStream::Resumed(tls), why),
                Err(TakeError::Lost(why)) => return Err(TakeError::Lost(why)),
            },
        };
        // Nothing consumed: the session goes on here as it was.
        self.link = Link::Up(Box::new(up));
        Err(TakeError::Back(self, why))
    }
}

impl AsyncRead for UpStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpStream::Fresh(tls) => Pin::new(tls).poll_read(cx, buf),
            UpStream::Resumed(tls) => Pin::new(tls).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for UpStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            UpStream::Fresh(tls) => Pin::new(tls).poll_write(cx, buf),
            UpStream::Resumed(tls) => Pin::new(tls).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpStream::Fresh(tls) => Pin::new(tls).poll_flush(cx),
            UpStream::Resumed(tls) => Pin::new(tls).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpStream::Fresh(tls) => Pin::new(tls).poll_shutdown(cx),
            UpStream::Resumed(tls) => Pin::new(tls).poll_shutdown(cx),
        }
    }
}
