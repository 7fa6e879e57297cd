//! Handing established sessions to the successor (state version 2,
//! docs/design/handover.md "Sessions"), after the listeners.
//!
//! - `crate::handing`: the registry of sessions that may be handed
//!   over, each with its offer and its relay's quiesce hook;
//! - `give`: the predecessor's side of the exchange;
//! - `take`: the successor's side;
//! - `judge`: the successor's judgement of an offer against its own
//!   configuration.

pub mod give;
pub mod judge;
pub mod take;

pub use crate::handing::{Listed, Outcome, Ready, Registered, Registry, Slot};
