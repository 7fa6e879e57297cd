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

impl FdLimit {
    /// Whether `max_connections` connections fit under the limit.
    pub fn fits(&self, max_connections: usize) -> bool {
        self.now
            .is_none_or(|limit| limit >= fds_needed(max_connections))
    }
}

pub fn fds_needed(max_connections: usize) -> u64 {
    max_connections as u64 * FDS_PER_CONNECTION + FDS_SPARE
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_fit_under_the_limit() {
        let limit = FdLimit {
            before: Some(1024),
            now: Some(1024),
        };
        assert!(limit.fits(320));
        assert!(!limit.fits(1024));
        assert!(FdLimit {
            before: None,
            now: None
        }
        .fits(1_000_000));
        // Raising never lowers the limit.
        let raised = raise_fd_limit().unwrap();
        assert!(raised.now.unwrap_or(u64::MAX) >= raised.before.unwrap_or(u64::MAX));
    }
}
