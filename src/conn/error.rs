//! How a connection ends badly. Each error names the side once (client or
//! upstream) and when it happened; what was wrong with the bytes comes
//! from `ProtoError`, which knows nothing of sides.

use std::fmt;
use std::io;
use std::time::Duration;

use thiserror::Error;

use crate::proto::ProtoError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Client,
    Upstream,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Client => "client",
            Side::Upstream => "upstream",
        })
    }
}

#[derive(Debug, Error)]
pub enum ConnError {
    #[error("{side} I/O error: {error}")]
    Io { side: Side, error: io::Error },
    #[error("{side} closed the connection {when}")]
    Closed { side: Side, when: &'static str },
    #[error("{side} broke the protocol: {error}")]
    Proto { side: Side, error: ProtoError },
    #[error("upstream closed the connection with {0} requests in flight")]
    UpstreamGone(usize),
    #[error("TLS handshake failed: {0}")]
    Tls(io::Error),
    #[error("kernel TLS hand-over failed: {0}")]
    KernelTls(#[from] crate::tls::kernel::KernelTlsError),
    #[error("{side} made no progress {when} for {after:?} (--upstream-timeout)")]
    NoAnswer {
        side: Side,
        when: &'static str,
        after: Duration,
    },
    /// `--handshake-timeout` (a connection whose slot came late in line
    /// had half of it from then, see `Admission::session_deadline`).
    #[error(
        "negotiation not finished within {0:?} of accept (or of a late handshake slot, half of it)"
    )]
    HandshakeTimeout(Duration),
    #[error("idle for {0:?} with no request in flight")]
    IdleTimeout(Duration),
    #[error("client made no progress {0} for {1:?} (--stall-timeout)")]
    Stalled(&'static str, Duration),
    #[error("client certificate revoked by a reload (--tls-revoke-closes)")]
    Revoked,
    #[error(
        "access to the export withdrawn or reduced by a policy reload (--policy-revoke-closes)"
    )]
    PolicyNarrowed,
    #[error("shutdown grace period over")]
    GraceOver,
}

impl ConnError {
    /// Why a reload ended the session.
    pub fn ended(why: crate::tls::Ended) -> Self {
        use crate::tls::Ended;
        match why {
            Ended::CertificateRevoked => ConnError::Revoked,
            Ended::PolicyNarrowed => ConnError::PolicyNarrowed,
        }
    }

    /// A failed read or write on `side`: EOF means that side went away.
    pub fn io(side: Side, when: &'static str) -> impl FnOnce(io::Error) -> Self {
        move |error| {
            if error.kind() == io::ErrorKind::UnexpectedEof {
                ConnError::Closed { side, when }
            } else {
                ConnError::Io { side, error }
            }
        }
    }

    /// Before the client has said anything, a reset or broken pipe is
    /// just a health check or port scan leaving, not a fault.
    pub fn client_left_early(when: &'static str) -> impl FnOnce(io::Error) -> Self {
        move |error| match error.kind() {
            io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => ConnError::Closed {
                side: Side::Client,
                when,
            },
            _ => Self::io(Side::Client, when)(error),
        }
    }

    pub fn proto(side: Side) -> impl FnOnce(ProtoError) -> Self {
        move |error| ConnError::Proto { side, error }
    }

    pub fn closed(side: Side, when: &'static str) -> Self {
        ConnError::Closed { side, when }
    }

    /// The upstream went away (EOF, reset), as against one that broke the
    /// protocol or stalled.
    pub fn is_upstream_gone(&self) -> bool {
        matches!(
            self,
            ConnError::UpstreamGone(_)
                | ConnError::Closed {
                    side: Side::Upstream,
                    ..
                }
                | ConnError::Io {
                    side: Side::Upstream,
                    ..
                }
        )
    }

    pub fn is_upstream(&self) -> bool {
        matches!(
            self,
            ConnError::Io {
                side: Side::Upstream,
                ..
            } | ConnError::Closed {
                side: Side::Upstream,
                ..
            } | ConnError::Proto {
                side: Side::Upstream,
                ..
            } | ConnError::NoAnswer {
                side: Side::Upstream,
                ..
            } | ConnError::UpstreamGone(_)
        )
    }

    /// Health checks and port scanners connect and leave: routine.
    pub fn is_routine(&self) -> bool {
        matches!(
            self,
            ConnError::Closed {
                side: Side::Client,
                ..
            }
        )
    }
}
