//! `--reconnect`'s one deadline, when a connection is good, and where a
//! local connection stands (for `/server` and the gauges).

use std::future::Future;
use std::task::Context;
use std::time::Duration;

use tracing::{error, info};

use super::{reopen, Link, Reconnecting, Standing};
use crate::logsafe::Escaped;
use crate::metrics::Outcome;

impl Reconnecting {
    /// Polls the deadline: true if it passed now.
    pub(super) fn poll_deadline(&mut self, cx: &mut Context<'_>) -> bool {
        let passed = self
            .deadline
            .as_mut()
            .is_some_and(|d| d.as_mut().poll(cx).is_ready());
        if passed {
            self.time_out();
        }
        passed
    }

    pub(super) fn arm_deadline(&mut self) {
        let timeout = self
            .settings
            .reconnect
            .map_or(Duration::ZERO, |r| r.timeout);
        self.deadline = Some(Box::pin(tokio::time::sleep(timeout)));
        self.refresh_standing();
    }

    pub(super) fn refresh_standing(&mut self) {
        let up = matches!(self.link, Link::Up(_));
        let standing = match self.link {
            Link::Changed => Standing::Fine,
            _ if self.failing && !up => Standing::Unreachable,
            Link::Reconnecting(_) => Standing::Reconnecting,
            _ if self.failing || self.deadline.is_some() => Standing::Reconnecting,
            _ => Standing::Fine,
        };
        self.set_standing(standing);
    }

    pub(super) fn set_standing(&mut self, standing: Standing) {
        if self.standing == standing {
            return;
        }
        let (health, gauges) = (&self.settings.health, &self.settings.metrics.reconnects);
        for (which, on) in [(self.standing, false), (standing, true)] {
            let delta = if on { 1 } else { -1 };
            match which {
                Standing::Fine => {}
                Standing::Reconnecting => {
                    health.set_reconnecting(on);
                    gauges.reconnecting.inc_by(delta);
                }
                Standing::Unreachable => {
                    health.set_unreachable(on);
                    gauges.unreachable.inc_by(delta);
                }
            }
        }
        self.standing = standing;
    }

    /// No connection was good within --reconnect-timeout: every request
    /// in flight gets EIO; later ones fail at once until one is good, and
    /// the tries go on in the background, so that the connection serves
    /// again once the server does.
    pub(super) fn time_out(&mut self) {
        self.deadline = None;
        let (tries, last) = {
            let progress = reopen::progress(&self.progress);
            (progress.tries, progress.last.clone())
        };
        let last = if last.is_empty() {
            "connections opened, none answered".to_string()
        } else {
            format!("last: {last}")
        };
        self.failed = format!(
            "nbdgw client: no connection within --reconnect-timeout answered ({tries} tries failed; {last})"
        );
        error!(
            error = %Escaped(&self.failed),
            in_flight = self.kept.len(),
            "no server connection answered within --reconnect-timeout; the requests in flight fail with EIO, and new ones fail at once until the server answers again (--reconnect)"
        );
        self.settings
            .metrics
            .reconnects
            .give_ups
            .get_or_create(&Outcome { outcome: "timeout" })
            .inc();
        self.failing = true;
        if let Link::Up(_) = self.link {
            // Its replies to what fails now must not come after the EIO.
            self.drop_connection();
            self.cut_replies();
            self.wait = self.wait.max(reopen::FIRST_DELAY);
            self.start_reconnect();
        }
        self.fail_kept();
        self.refresh_standing();
    }

    /// A reply other than ESHUTDOWN came: this connection is good.
    pub(super) fn mark_good(&mut self) {
        if self.good {
            return;
        }
        self.good = true;
        self.wait = Duration::ZERO;
        if std::mem::take(&mut self.after_drop) {
            self.settings.metrics.reconnects.good.inc();
        }
        if self.failing {
            info!("the server answers again; requests pass again (--reconnect)");
            self.failing = false;
        }
        *reopen::progress(&self.progress) = reopen::Progress::default();
        self.settle();
    }

    /// The deadline ends once the connection is good: it answers, and a
    /// slow request on it is the stall timeout's business, not a reason
    /// to drop it.
    pub(super) fn settle(&mut self) {
        if self.good {
            self.deadline = None;
        }
        self.refresh_standing();
    }
}
