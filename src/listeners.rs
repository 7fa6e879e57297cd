//! Where the listening sockets come from: passed in by systemd (socket
//! activation, `LISTEN_FDS`) or bound here. Both happen before the process
//! restricts itself, so nothing after start-up needs to bind.

use std::net::{SocketAddr, TcpListener};

use thiserror::Error;

/// The descriptor name (`FileDescriptorName=` in a .socket unit, `--fdname`
/// for systemd-socket-activate) that marks a passed socket as the admin
/// endpoint; any other name is the NBD port.
pub const ADMIN_FD_NAME: &str = "admin";

/// The names of sessions in systemd's file-descriptor store
/// (`crate::handover::fdstore`): passed in LISTEN_FDS too, never
/// listeners.
pub const SESSION_PREFIX: &str = "nbdgw-s.";

pub fn is_session_name(name: &str) -> bool {
    name.starts_with(SESSION_PREFIX)
}

#[derive(Debug, Error)]
pub enum ListenError {
    #[error("cannot listen on {addr}{flag}: {source}")]
    Bind {
        addr: SocketAddr,
        flag: &'static str,
        source: std::io::Error,
    },
    #[error(
        "socket {index} passed by systemd (LISTEN_FDS) is not a listening TCP socket: {source}"
    )]
    Passed {
        index: usize,
        source: std::io::Error,
    },
    #[error("systemd passed {count} sockets (LISTEN_FDNAMES {names:?}) but none for NBD: name one other than \"admin\"")]
    NoNbdSocket { count: usize, names: String },
    #[error(
        "systemd passed more than one NBD socket; nbdgw serves one (a [::] socket takes IPv4 too)"
    )]
    SeveralNbdSockets,
}

/// The listeners, still blocking `std` sockets: the async runtime that
/// takes them over starts only after the process is sandboxed.
#[derive(Debug)]
pub struct Listeners {
    pub nbd: TcpListener,
    pub admin: Option<TcpListener>,
    /// Whether systemd passed them (then `--listen` was not used).
    pub from_systemd: bool,
}

impl Listeners {
    /// Takes the sockets systemd passed, if it passed any; otherwise binds
    /// `listen` and, if asked for, `admin`.
    pub fn open(listen: SocketAddr, admin: Option<SocketAddr>) -> Result<Self, ListenError> {
        // Read before listenfd clears LISTEN_FDS and LISTEN_PID.
        let names = std::env::var("LISTEN_FDNAMES").unwrap_or_default();
        let mut passed = listenfd::ListenFd::from_env();
        // Sessions from systemd's file-descriptor store are not listeners
        // (`crate::handover::fdstore::restore::collect` has them).
        let listening = (0..passed.len())
            .filter(|i| !is_session_name(names.split(':').nth(*i).unwrap_or("")))
            .count();
        if listening == 0 {
            return Ok(Listeners {
                nbd: bind(listen, "")?,
                admin: admin
                    .map(|addr| bind(addr, " (--admin-listen)"))
                    .transpose()?,
                from_systemd: false,
            });
        }
        let mut listeners = Listeners::from_passed(&mut passed, &names)?;
        if listeners.admin.is_none() {
            listeners.admin = admin
                .map(|addr| bind(addr, " (--admin-listen)"))
                .transpose()?;
        }
        Ok(listeners)
    }

    /// Those taken over from a running gateway (`--take-over`), and
    /// the ones it did not give bound here.
    pub fn with(
        nbd: Option<TcpListener>,
        admin: Option<TcpListener>,
        listen: SocketAddr,
        admin_addr: Option<SocketAddr>,
    ) -> Result<Self, ListenError> {
        let nbd = match nbd {
            Some(nbd) => nbd,
            None => bind(listen, "")?,
        };
        let admin = match admin {
            Some(admin) => Some(admin),
            None => admin_addr
                .map(|addr| bind(addr, " (--admin-listen)"))
                .transpose()?,
        };
        Ok(Listeners {
            nbd,
            admin,
            from_systemd: false,
        })
    }

    fn from_passed(passed: &mut listenfd::ListenFd, names: &str) -> Result<Self, ListenError> {
        let count = passed.len();
        let mut each_name = names.split(':');
        let (mut nbd, mut admin) = (None, None);
        for index in 0..count {
            let name = each_name.next().unwrap_or("");
            if is_session_name(name) {
                continue;
            }
            let listener = passed
                .take_tcp_listener(index)
                .map_err(|source| ListenError::Passed { index, source })?;
            let Some(listener) = listener else { continue };
            if name == ADMIN_FD_NAME {
                admin = Some(listener);
            } else if nbd.replace(listener).is_some() {
                return Err(ListenError::SeveralNbdSockets);
            }
        }
        let nbd = nbd.ok_or_else(|| ListenError::NoNbdSocket {
            count,
            names: names.to_string(),
        })?;
        Ok(Listeners {
            nbd,
            admin,
            from_systemd: true,
        })
    }
}

fn bind(addr: SocketAddr, flag: &'static str) -> Result<TcpListener, ListenError> {
    TcpListener::bind(addr).map_err(|source| ListenError::Bind { addr, flag, source })
}

/// Out of descriptors or similar, in either mode's accept loop: keep
/// serving the connections there are, and try again shortly.
pub(crate) async fn accept_failed(e: std::io::Error) {
    tracing::error!(error = %e, "accept failed");
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_systemd_it_binds_and_names_the_flag_that_failed() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let error = Listeners::open("127.0.0.1:0".parse().unwrap(), Some(addr)).unwrap_err();
        let text = error.to_string();
        assert!(text.contains("(--admin-listen)"), "{text}");
        assert!(text.contains(&addr.to_string()), "{text}");
    }
}
