//! Refusals: what nbdgw answers itself with an error instead of
//! forwarding: a write to a read-only export, a read longer than
//! `--max-payload`, and, while draining with `--drain-answer eshutdown`,
//! everything.

use super::{At, Layer, OnRequest, Verdict};
use crate::proto::consts::*;
use crate::proto::transmission::Request;
use crate::shutdown::DrainAnswer;

pub struct Refusals {
    read_only: bool,
    max_payload: u32,
}

impl Refusals {
    pub fn new(read_only: bool, max_payload: u32) -> Self {
        Refusals {
            read_only,
            max_payload,
        }
    }
}

impl Layer for Refusals {
    type Requests = Self;
    type Replies = ();
    fn split(self) -> (Self, ()) {
        (self, ())
    }
}

impl OnRequest for Refusals {
    /// `at.draining` is the phase as this request saw it: ESHUTDOWN only
    /// when the drain answers so (with `DrainAnswer::Close` the relay
    /// leaves the request unanswered before any layer sees it).
    fn request(&mut self, at: &At<'_>, request: &Request) -> Verdict {
        let (error, message) = if at.draining == Some(DrainAnswer::Eshutdown) {
            (ESHUTDOWN, "nbdgw is shutting down")
        } else if self.read_only && request.is_modifying() {
            // The spec asks for EPERM; qemu-nbd itself would answer EINVAL.
            (EPERM, "nbdgw: the export is read-only")
        } else if request.command == CMD_READ && request.length > u64::from(self.max_payload) {
            (EINVAL, "nbdgw: read length exceeds --max-payload")
        } else {
            return Verdict::Pass;
        };
        Verdict::Refuse { error, message }
    }
}
