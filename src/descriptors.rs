//! The process's file descriptor limit, which `--max-connections` needs.

use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

/// Descriptors per client connection: the client socket, its duplicate
/// for TCP_CORK, and the upstream socket.
pub const FDS_PER_CONNECTION: u64 = 3;
/// The listener, standard streams, the runtime's own descriptors.
const FDS_SPARE: u64 = 64;

/// The soft limit before and after `raise_fd_limit`; `None` is unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdLimit {
    pub before: Option<u64>,
    pub now: Option<u64>,
}

/// What the bounds let be open at once. A session or a handshake costs
/// [`FDS_PER_CONNECTION`] (a handshake may become a session before its
/// slot is given back); a connection waiting for a handshake slot, or an
/// admin connection, one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdDemand {
    /// `--max-connections`.
    pub sessions: usize,
    /// `--max-handshakes`.
    pub handshakes: usize,
    /// `--handshake-queue`.
    pub waiting: usize,
    /// `--admin-max-connections`, or 0 without an admin listener.
    pub admin: usize,
    /// Connections from `--proxy-protocol-from` balancers before their
    /// header (`--max-handshakes` plus `--handshake-queue`; 0 without
    /// trusted balancers): admission holds them only after it, so they
    /// come on top of its bounds.
    pub pre_header: usize,
}

impl FdDemand {
    pub fn needed(&self) -> u64 {
        (self.sessions as u64 + self.handshakes as u64) * FDS_PER_CONNECTION
            + self.waiting as u64
            + self.admin as u64
            + self.pre_header as u64
            + FDS_SPARE
    }

    /// These bounds if they fit under `limit`; otherwise each lowered in
    /// the same proportion until they do (at least one session and one
    /// handshake), or `None` if not even that fits.
    pub fn fitted(&self, limit: Option<u64>) -> Option<FdDemand> {
        let Some(limit) = limit else {
            return Some(*self);
        };
        let needed = self.needed();
        if needed <= limit {
            return Some(*self);
        }
        let room = u128::from(limit.checked_sub(FDS_SPARE)?);
        let asked = u128::from(needed - FDS_SPARE);
        let scale = |n: usize| (n as u128 * room / asked) as usize;
        let mut fitted = FdDemand {
            sessions: scale(self.sessions).max(1),
            handshakes: scale(self.handshakes).max(1),
            waiting: scale(self.waiting),
            admin: scale(self.admin).max(usize::from(self.admin > 0)),
            pre_header: scale(self.pre_header).max(usize::from(self.pre_header > 0)),
        };
        // The floors of one may overshoot by a few: the queue gives way.
        let over = fitted.needed().saturating_sub(limit);
        fitted.waiting = fitted.waiting.saturating_sub(over as usize);
        (fitted.needed() <= limit).then_some(fitted)
    }
}

/// Raises the soft RLIMIT_NOFILE to the hard limit, as servers do: the
/// usual soft default of 1024 would stop nbdgw at about 320 connections
/// with `accept` failing, whatever `--max-connections` says.
pub fn raise_fd_limit() -> std::io::Result<FdLimit> {
    let limit = getrlimit(Resource::Nofile);
    if limit.current == limit.maximum {
        return Ok(FdLimit {
            before: limit.current,
            now: limit.current,
        });
    }
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        },
    )?;
    Ok(FdLimit {
        before: limit.current,
        now: getrlimit(Resource::Nofile).current,
    })
}

/// The start's error when the limit cannot hold even one connection.
pub fn fd_limit_too_low(limit: Option<u64>) -> String {
    format!(
        "the file descriptor limit (RLIMIT_NOFILE) is {}: too low for even one connection; raise it (LimitNOFILE= in systemd, ulimit -n)",
        limit.unwrap_or_default()
    )
}

/// The descriptor limit, raised to the hard limit where it can be; what
/// happened is logged.
pub fn raised_fd_limit() -> FdLimit {
    let limit = raise_fd_limit().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "cannot raise the file descriptor limit");
        let now = getrlimit(Resource::Nofile).current;
        FdLimit { before: now, now }
    });
    if limit.before != limit.now {
        tracing::info!(
            from = limit.before,
            to = limit.now,
            "raised the file descriptor limit"
        );
    }
    limit
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULTS: FdDemand = FdDemand {
        sessions: 1024,
        handshakes: 64,
        waiting: 1024,
        admin: 512,
        pre_header: 0,
    };

    #[test]
    fn bounds_that_do_not_fit_are_lowered_in_proportion() {
        assert_eq!(DEFAULTS.needed(), (1024 + 64) * 3 + 1024 + 512 + 64);
        assert_eq!(DEFAULTS.fitted(Some(1 << 20)), Some(DEFAULTS));
        assert_eq!(DEFAULTS.fitted(None), Some(DEFAULTS));
        let fitted = DEFAULTS.fitted(Some(1024)).unwrap();
        assert!(fitted.needed() <= 1024, "{fitted:?}");
        // Each in about the same proportion (960 of 4800 descriptors).
        assert_eq!(
            fitted,
            FdDemand {
                sessions: 204,
                handshakes: 12,
                waiting: 204,
                admin: 102,
                pre_header: 0,
            }
        );
        // Nothing left beyond the spare: no bound can hold.
        assert_eq!(DEFAULTS.fitted(Some(64)), None);
        assert_eq!(DEFAULTS.fitted(Some(10)), None);
        // Just enough for one of each.
        let least = DEFAULTS.fitted(Some(64 + 6 + 1)).unwrap();
        assert_eq!((least.sessions, least.handshakes, least.admin), (1, 1, 1));
    }

    /// The review's case (issue 30, PROXY protocol): 190 descriptors for
    /// 4 sessions, 2 handshakes, 100 waiting, 1 admin and the 102 that
    /// may wait for their PROXY header. Left out, those 102 made accept
    /// fail with EMFILE; counted, every bound is lowered to fit.
    #[test]
    fn connections_before_their_proxy_header_are_budgeted() {
        let asked = FdDemand {
            sessions: 4,
            handshakes: 2,
            waiting: 100,
            admin: 1,
            pre_header: 102,
        };
        assert_eq!(asked.needed(), 6 * 3 + 100 + 1 + 102 + 64);
        let fitted = asked.fitted(Some(190)).unwrap();
        assert!(fitted.needed() <= 190, "{fitted:?}");
        assert!(
            fitted.pre_header >= 1 && fitted.pre_header < 102,
            "{fitted:?}"
        );
    }

    #[test]
    fn raising_never_lowers_the_limit() {
        let raised = raise_fd_limit().unwrap();
        assert!(raised.now.unwrap_or(u64::MAX) >= raised.before.unwrap_or(u64::MAX));
    }
}
