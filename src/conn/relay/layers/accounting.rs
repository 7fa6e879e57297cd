//! Accounting: requests counted by command as they arrive, errors by name
//! as they reach the client, and each request's time in flight once
//! answered. Bytes are counted where they move (`Requests`, the reply
//! writer), not here.

use std::time::Duration;

use super::{Layer, OnReply, OnRequest};
use crate::conn::session::Stats;
use crate::metrics::Metrics;
use crate::proto::consts::command_name;
use crate::proto::transmission::{InFlight, ReplyMode, Request};

/// Sees every request and every answer whichever layer decides it,
/// because it listens to `arrived` and `answered`, which go to every
/// layer (its place in the stack does not matter for that).
pub struct Accounting<'a> {
    stats: &'a Stats,
    mode: ReplyMode,
}

impl<'a> Accounting<'a> {
    pub fn new(stats: &'a Stats, mode: ReplyMode) -> Self {
        Accounting { stats, mode }
    }
}

impl<'a> Layer for Accounting<'a> {
    type Requests = Self;
    type Replies = &'a Metrics;
    fn split(self) -> (Self, &'a Metrics) {
        let metrics = &self.stats.metrics;
        (self, metrics)
    }
}

impl OnRequest for Accounting<'_> {
    /// Counted once its fate is decided, so that whoever waits for the
    /// count (the tests) sees a request whose fate is sealed.
    fn arrived(&mut self, request: &Request) {
        let header_len = self.mode.request_header_len() as u64;
        self.stats
            .request(command_name(request.command), header_len);
    }

    fn refused(&mut self, _request: &Request, error: u32) {
        self.stats.metrics.error(error);
    }
}

impl OnReply for &Metrics {
    /// Only what the client sees: a reply to nbdgw's own request is not.
    fn error(&mut self, _cookie: u64, _req: &InFlight, error: u32, claimed: bool) {
        if !claimed {
            Metrics::error(self, error);
        }
    }

    fn answered(&mut self, command: u16, took: Duration) {
        Metrics::answered(self, command_name(command), took);
    }
}
