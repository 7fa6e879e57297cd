//! The reply side of `--reconnect`: reply messages assembled whole,
//! passed up or held (structured chunks until the last, replies to a
//! request still going to the server, ESHUTDOWN answers).

use std::io;

use tracing::info;

use super::{push_out, Need, Reconnecting, EARLY_ROOM, HELD_OVERHEAD};
use crate::proto::consts::*;
use crate::proto::transmission::{parse_reply, reply_header_len, ReplyFrame};

impl Reconnecting {
    /// Whether a whole message is the server's ESHUTDOWN, in a simple
    /// reply or an error chunk.
    pub(super) fn says_shutdown(&self, frame: &ReplyFrame) -> bool {
        if frame.kind == 0 {
            return frame.simple_error == ESHUTDOWN;
        }
        let header = self.message.len() - frame.payload_len as usize;
        frame.is_error_chunk()
            && self
                .message
                .get(header..header + 4)
                .is_some_and(|e| e == ESHUTDOWN.to_be_bytes())
    }

    /// An ESHUTDOWN answer (or a later chunk of one) does not go up: its
    /// request stays kept, to be sent again on the next connection.
    pub(super) fn hold_shutdown(&mut self, frame: ReplyFrame) {
        let cookie = frame.cookie;
        self.message.clear();
        if let Some(held) = self.held_replies.remove(&cookie) {
            self.held_reply_bytes -= held.capacity() + HELD_OVERHEAD;
        }
        if !self.server_going {
            info!("the server is shutting down (ESHUTDOWN): its answers are held back and the requests sent again on a new connection (--reconnect)");
            self.server_going = true;
        }
        if !frame.done {
            self.shut_chunks.insert(cookie);
            return;
        }
        self.shut_chunks.remove(&cookie);
        self.settings.metrics.reconnects.shutdown_answers_held.inc();
        let whole = self.kept.len() - usize::from(self.head_len > 0);
        if let Some(kept) = self
            .kept
            .iter_mut()
            .take(whole)
            .find(|k| k.cookie == cookie)
        {
            kept.shut = true;
        }
    }

    /// The server is going and has answered everything it was sent (the
    /// rest ESHUTDOWN): time to drop it and go to the next.
    pub(super) fn server_done(&self) -> bool {
        let whole = self.kept.len() - usize::from(self.passing());
        self.server_going
            && self.shut_chunks.is_empty()
            && self.kept.iter().take(whole).all(|k| k.shut)
    }

    /// A reply to the write being passed on, before its payload has: held
    /// until it has (the entry must stay where the payload goes).
    pub(super) fn hold_early(&mut self, frame: ReplyFrame) -> io::Result<()> {
        let held = self.held_replies.entry(frame.cookie).or_default();
        let before = if held.is_empty() {
            0
        } else {
            held.capacity() + HELD_OVERHEAD
        };
        held.extend_from_slice(&self.message);
        self.held_reply_bytes = self.held_reply_bytes - before + held.capacity() + HELD_OVERHEAD;
        self.message.clear();
        if self.held_reply_bytes > self.reply_buffer().max(EARLY_ROOM) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the server's replies to a write whose payload it has not had outgrew --reply-buffer",
            ));
        }
        if frame.done {
            self.early_done = Some(frame.cookie);
        }
        Ok(())
    }

    /// A whole reply message: up it goes, and a last one frees its request.
    /// A structured reply's earlier chunks are held until its last one,
    /// while `--reply-buffer` has room: then a drop in between loses
    /// nothing the local client has seen, and the request is asked again.
    pub(super) fn whole(&mut self, frame: ReplyFrame) -> io::Result<()> {
        self.need = Need::Magic;
        let cookie = frame.cookie;
        if self.early_done == Some(cookie) {
            // Its last reply came already (held until the request has
            // passed): a second one is the server's error, not to be
            // passed up twice or to undo the first.
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the server replied again to a request it had answered",
            ));
        }
        let can_hold = !self.answered_in_part.contains(&cookie);
        if self.shut_chunks.contains(&cookie) || (can_hold && self.says_shutdown(&frame)) {
            self.hold_shutdown(frame);
            return Ok(());
        }
        self.mark_good();
        if self.writing(cookie) {
            return self.hold_early(frame);
        }
        self.pass_up(frame);
        Ok(())
    }

    /// Whether the request `cookie` is still going to the server on this
    /// connection (its payload passing, or its replay under way): a reply
    /// to it is held until it has gone, so that its entry stays where
    /// its bytes come from.
    pub(super) fn writing(&self, cookie: u64) -> bool {
        if self.payload_left > 0 && self.kept.back().is_some_and(|k| k.cookie == cookie) {
            return true;
        }
        let Some(seq) = self.replay else {
            return false;
        };
        let at = self.kept.partition_point(|k| k.seq < seq);
        // The last one may have its header in part: no cookie yet.
        let header_whole = at + 1 < self.kept.len() || self.head_len == 0;
        self.kept
            .get(at)
            .is_some_and(|k| header_whole && k.cookie == cookie && k.sent < k.bytes.len())
    }

    /// Assembles reply messages; whole ones go to `out`.
    pub(super) fn follow_replies(&mut self, mut data: &[u8]) -> io::Result<()> {
        let invalid = |e| io::Error::new(io::ErrorKind::InvalidData, e);
        while !data.is_empty() {
            match self.need {
                Need::Magic => {
                    let n = (4 - self.message.len()).min(data.len());
                    self.message.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    if self.message.len() == 4 {
                        let magic = u32::from_be_bytes([
                            self.message[0],
                            self.message[1],
                            self.message[2],
                            self.message[3],
                        ]);
                        self.need =
                            Need::Header(reply_header_len(self.mode, magic).map_err(invalid)?);
                    }
                }
                Need::Header(len) => {
                    let n = (len - self.message.len()).min(data.len());
                    self.message.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    if self.message.len() == len {
                        let frame =
                            parse_reply(self.mode, &self.message, &self.table, self.max_reply)
                                .map_err(invalid)?;
                        match frame.payload_len {
                            0 => self.whole(frame)?,
                            left => self.need = Need::Payload(frame, left),
                        }
                    }
                }
                Need::Payload(frame, left) => {
                    let n = data.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    self.message.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    match left - n as u64 {
                        0 => self.whole(frame)?,
                        left => self.need = Need::Payload(frame, left),
                    }
                }
            }
        }
        Ok(())
    }

    /// A reply message for the local client, or held with its earlier
    /// chunks while `--reply-buffer` has room.
    pub(super) fn pass_up(&mut self, frame: ReplyFrame) {
        let cookie = frame.cookie;
        // A held entry costs its buffer's capacity and its place in the
        // map. Holding this message grows the entry to at most twice its
        // capacity, or to exactly what it then holds.
        let (before, capacity, used) = match self.held_replies.get(&cookie) {
            Some(held) => (held.capacity() + HELD_OVERHEAD, held.capacity(), held.len()),
            None => (0, 0, 0),
        };
        let at_most = (2 * capacity).max(used + self.message.len()) + HELD_OVERHEAD;
        if !frame.done
            && !self.answered_in_part.contains(&cookie)
            && self.held_reply_bytes - before + at_most <= self.reply_buffer()
        {
            // Copied, not moved: the message buffer may be far larger
            // than this message (it assembled a large one before).
            let held = self.held_replies.entry(cookie).or_default();
            held.extend_from_slice(&self.message);
            self.held_reply_bytes =
                self.held_reply_bytes - before + held.capacity() + HELD_OVERHEAD;
            self.message.clear();
            return;
        }
        if let Some(mut held) = self.held_replies.remove(&cookie) {
            self.held_reply_bytes -= held.capacity() + HELD_OVERHEAD;
            push_out(&mut self.out, &mut self.out_at, &mut held);
        }
        push_out(&mut self.out, &mut self.out_at, &mut self.message);
        if frame.done {
            self.table.remove(frame.cookie);
            self.answered_in_part.remove(&frame.cookie);
            self.forget(frame.cookie);
        } else {
            self.answered_in_part.insert(frame.cookie);
        }
    }
}
