//! What `--reconnect` keeps: every request passed on, from its first
//! byte, until its last reply has come; failed with EIO past the
//! deadline.

use std::io;

use super::{push_out, Kept, Reconnecting, HELD_OVERHEAD, KEPT_OVERHEAD};
use crate::proto::consts::*;
use crate::proto::transmission::{encode_error_reply, InFlight, Request};

impl Reconnecting {
    /// Every whole kept request gets EIO; one being written stays kept
    /// until it is whole (its bytes still come).
    pub(super) fn fail_kept(&mut self) {
        let passing = if self.passing() {
            self.kept.pop_back()
        } else {
            None
        };
        for kept in std::mem::take(&mut self.kept) {
            if let Some(request) = self.table.remove(kept.cookie) {
                let (mode, cookie) = (self.mode, kept.cookie);
                encode_error_reply(mode, cookie, &request, EIO, &self.failed, &mut self.out);
                self.settings.metrics.error(EIO);
            }
        }
        self.held = 0;
        self.resent = 0;
        if let Some(kept) = passing {
            self.held = kept.bytes.len() + KEPT_OVERHEAD;
            self.resent = usize::from(kept.resent);
            self.kept.push_back(kept);
        }
        self.wake_writer();
    }

    pub(super) fn forget(&mut self, cookie: u64) {
        if let Some(at) = self.kept.iter().position(|k| k.cookie == cookie) {
            if let Some(kept) = self.kept.remove(at) {
                self.held = self.held.saturating_sub(kept.bytes.len() + KEPT_OVERHEAD);
                self.resent -= usize::from(kept.resent);
            }
        }
        self.wake_writer();
        self.settle();
    }

    /// Follows the requests in the bytes passed on (or, failing, taken).
    /// A header is kept from its first byte: a drop in its middle replays
    /// the part already written, and the rest follows it.
    pub(super) fn record(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            let n = if self.payload_left > 0 {
                self.record_payload(bytes)
            } else {
                self.record_header(bytes)?
            };
            bytes = &bytes[n..];
        }
        Ok(())
    }

    /// Payload bytes of the last request: how many of `bytes` were its.
    pub(super) fn record_payload(&mut self, bytes: &[u8]) -> usize {
        let n = bytes
            .len()
            .min(usize::try_from(self.payload_left).unwrap_or(usize::MAX));
        if let Some(kept) = self.kept.back_mut() {
            kept.bytes.extend_from_slice(&bytes[..n]);
            kept.sent += n;
        }
        self.held += n;
        self.payload_left -= n as u64;
        if self.payload_left == 0 {
            self.passed();
        }
        n
    }

    /// Header bytes of the next request: how many of `bytes` were its.
    pub(super) fn record_header(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let header_len = self.mode.request_header_len();
        if self.head_len == 0 {
            // The memory a kept request costs beyond its bytes (its
            // vector, its place in the line and in the in-flight table)
            // counts too: otherwise many small requests hold several
            // times --replay-buffer (measured: 134 MB for a 16 MiB
            // buffer).
            self.held += KEPT_OVERHEAD;
            self.kept.push_back(Kept {
                seq: self.next_seq,
                cookie: 0,
                bytes: Vec::with_capacity(header_len),
                sent: 0,
                resent: false,
                shut: false,
            });
            self.next_seq += 1;
        }
        let Some(kept) = self.kept.back_mut() else {
            return Ok(bytes.len());
        };
        let n = (header_len - self.head_len).min(bytes.len());
        kept.bytes.extend_from_slice(&bytes[..n]);
        kept.sent += n;
        self.head_len += n;
        self.held += n;
        if self.head_len < header_len {
            return Ok(n);
        }
        self.head_len = 0;
        let request = Request::parse(self.mode, &kept.bytes[..header_len])
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if request.command == CMD_DISC {
            // No reply comes, and the server's end follows.
            self.disconnecting = true;
            if let Some(kept) = self.kept.pop_back() {
                self.held = self.held.saturating_sub(kept.bytes.len() + KEPT_OVERHEAD);
                self.resent -= usize::from(kept.resent);
            }
            return Ok(n);
        }
        kept.cookie = request.cookie;
        self.table.insert(request.cookie, InFlight::from(&request));
        self.payload_left = request.payload_len(self.mode);
        // The payload follows (the relay checked it against
        // --max-payload): room for it at once, not doubled as it comes,
        // so the memory kept is what --replay-buffer counts.
        kept.bytes
            .reserve_exact(usize::try_from(self.payload_left).unwrap_or(0));
        if self.payload_left == 0 {
            self.passed();
        }
        Ok(n)
    }

    /// The last request is whole: a reply that came before its payload
    /// had passed goes up now.
    pub(super) fn passed(&mut self) {
        if let Some(cookie) = self.kept.back().map(|k| k.cookie) {
            self.release_early(cookie);
        }
    }

    /// The request `cookie` went whole on this connection: if its last
    /// reply came before, that reply goes up now and the request is done.
    pub(super) fn release_early(&mut self, cookie: u64) {
        if self.early_done != Some(cookie) {
            return;
        }
        self.early_done = None;
        if let Some(mut held) = self.held_replies.remove(&cookie) {
            self.held_reply_bytes -= held.capacity() + HELD_OVERHEAD;
            push_out(&mut self.out, &mut self.out_at, &mut held);
        }
        self.table.remove(cookie);
        self.answered_in_part.remove(&cookie);
        self.forget(cookie);
    }
}
