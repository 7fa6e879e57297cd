//! nbdgw: a TLS gateway for the Network Block Device protocol.
//!
//! Remote clients connect over TCP, upgrade with `NBD_OPT_STARTTLS`, and
//! are relayed to an NBD server on a local Unix socket.
// One exception, `tls::kernel::send_close_notify`: no safe crate builds
// the control message that makes kernel TLS send an alert.
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

pub use config::Config;
pub use server::{run, run_gated};
