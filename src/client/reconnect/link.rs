//! The server connection's life under `--reconnect`: a drop, the
//! reconnect, the new connection opened (the kept requests go first),
//! and the end when the export changed.

use std::task::{Context, Poll};

use tracing::{error, info, warn};

use super::reopen::{self, Reopened};
use super::{Link, Need, Reconnecting};
use crate::logsafe::Escaped;
use crate::metrics::Outcome;
use crate::proto::consts::*;
use crate::proto::transmission::encode_error_reply;

impl Reconnecting {
    /// Brings the link up: `Ready(true)` when up, `Ready(false)` once the
    /// export changed.
    pub(super) fn drive(&mut self, cx: &mut Context<'_>) -> Poll<bool> {
        let done = match &mut self.link {
            Link::Up(_) => return Poll::Ready(true),
            Link::Changed => return Poll::Ready(false),
            Link::Reconnecting(future) => std::task::ready!(future.as_mut().poll(cx)),
        };
        match done {
            Ok(reopened) => {
                self.reopened(reopened);
                Poll::Ready(true)
            }
            Err(what) => {
                self.give_up(&what);
                Poll::Ready(false)
            }
        }
    }

    /// A new connection opened the export: the kept requests go first.
    pub(super) fn reopened(&mut self, reopened: Reopened) {
        info!(
            tries = reopened.tries,
            requests_sent_again = self.kept.len(),
            failing = self.failing,
            "reconnected to the server (--reconnect)"
        );
        self.link = Link::Up(Box::new(super::handed::UpStream::Fresh(reopened.conn)));
        self.wait = reopened.next_wait;
        self.good = false;
        for kept in &mut self.kept {
            kept.sent = 0;
        }
        self.replay = self.kept.front().map(|k| k.seq);
        self.refresh_standing();
    }

    pub(super) fn start_reconnect(&mut self) {
        let future = reopen::until_open(
            self.settings.clone(),
            self.opened.clone(),
            self.wait,
            self.progress.clone(),
        );
        self.link = Link::Reconnecting(Box::pin(future));
        self.good = false;
        self.after_drop = true;
        self.refresh_standing();
    }

    /// The connection dropped: start over, with what is kept.
    pub(super) fn lost(&mut self, why: &str) {
        let replies_held = self.drop_connection();
        warn!(
            error = %Escaped(why),
            in_flight = self.kept.len(),
            replies_held,
            replies_cut = self.answered_in_part.len(),
            "connection to the server lost; reconnecting (--reconnect)"
        );
        self.cut_replies();
        for kept in &mut self.kept {
            if !kept.resent {
                kept.resent = true;
                self.resent += 1;
            }
        }
        if self.failing {
            // Past the deadline: nothing waits for a connection.
            self.fail_kept();
        } else if self.resent > 0 && self.deadline.is_none() {
            self.arm_deadline();
        }
        self.start_reconnect();
    }

    /// Forgets what the dropped connection was in the middle of: how many
    /// replies were held unfinished (their requests are still kept).
    pub(super) fn drop_connection(&mut self) -> usize {
        self.message.clear();
        self.need = Need::Magic;
        self.replay = None;
        self.server_going = false;
        self.shut_chunks.clear();
        self.early_done = None;
        for kept in &mut self.kept {
            kept.shut = false;
        }
        self.held_reply_bytes = 0;
        std::mem::take(&mut self.held_replies).len()
    }

    /// Those with a reply in part on the local connection cannot be asked
    /// again: their reply ends here, with EIO.
    pub(super) fn cut_replies(&mut self) {
        for cookie in std::mem::take(&mut self.answered_in_part) {
            if let Some(request) = self.table.remove(cookie) {
                let message = "nbdgw client: the server was lost in the middle of this reply";
                encode_error_reply(self.mode, cookie, &request, EIO, message, &mut self.out);
                self.settings.metrics.error(EIO);
                self.forget(cookie);
            }
        }
    }

    /// The export changed: every request in flight gets EIO, and the
    /// stream ends, which closes the local connection.
    pub(super) fn give_up(&mut self, what: &str) {
        let why = format!("the export changed: {what}");
        error!(
            error = %Escaped(&why),
            in_flight = self.kept.len(),
            "giving up on the server; the requests in flight fail with EIO and the local connection closes"
        );
        self.settings
            .metrics
            .reconnects
            .give_ups
            .get_or_create(&Outcome {
                outcome: "export_changed",
            })
            .inc();
        self.failed = format!("nbdgw client: {why}");
        self.link = Link::Changed;
        self.deadline = None;
        self.failing = false;
        // Nothing is held here: `lost` dropped it, and nothing is read
        // while reconnecting.
        self.fail_kept();
        self.refresh_standing();
    }
}
