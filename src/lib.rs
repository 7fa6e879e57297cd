//! nbdgw: a TLS gateway for the Network Block Device protocol.
//!
//! Remote clients connect over TCP, upgrade with `NBD_OPT_STARTTLS`, and
//! are relayed to an NBD server on a local Unix socket.
// Unsafe code is refused except in five narrow functions, each allowed
// by name with a SAFETY comment, where no safe crate offers the call:
// `tls::kernel::send_close_notify` (the control message that makes kernel
// TLS send an alert), `conn::relay::output_queue` (SIOCOUTQ),
// `handover::alive::{peer_pidfd, peer_cred}` (SO_PEERPIDFD, and
// SO_PEERCRED with a pid that may be 0), `handover::fdstore::restore::
// passed` (a non-socket descriptor systemd passed, as an `OwnedFd`).
#![deny(unsafe_code)]

pub mod admin;
mod admission;
pub mod balancer;
pub mod cache;
pub mod certs;
pub mod cli;
pub mod client;
pub mod config;
pub mod confinement;
mod conn;
pub mod descriptors;
pub mod exports;
pub mod handing;
pub mod handover;
pub mod identity;
pub mod listeners;
pub mod listening;
pub mod logsafe;
pub mod metrics;
pub mod policy;
pub mod proto;
pub mod reloadable;
pub(crate) mod server;
pub mod setup;
pub mod shutdown;
mod source;
pub mod tls;
pub mod upstream;
mod write_through;

pub use config::Config;
pub use server::{run, run_gated};
