//! One side of option haggling, as mini-redis's `Connection` is one side
//! of its protocol: a stream, the buffer its messages are read into, and
//! the side it is, so that every read, parse and error mapping happens
//! here once. The client's channel reads options and sends replies; the
//! upstream's sends options and reads replies.

use std::future::Future;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::error::{ConnError, Side};
use super::session::GOODBYE_TIMEOUT;
use crate::proto::consts::*;
use crate::proto::handshake::{encode_option_reply, OptionHeader, OptionReplyHeader};
use crate::proto::ProtoError;
use crate::shutdown::Shutdown;

pub struct OptionChannel<S> {
    stream: S,
    side: Side,
    /// The data of the last option read.
    data: Vec<u8>,
    /// Largest option data, or option reply data, accepted.
    max_len: u32,
    /// How long each read or write may take; `None` for the client,
    /// whose whole negotiation the handshake timeout bounds.
    bound: Option<Duration>,
}

/// What the shutdown makes of an option.
pub enum ShutdownAnswer {
    /// Not shutting down, or an option served even then (ABORT).
    Serve,
    /// Answered with `NBD_REP_ERR_SHUTDOWN`.
    Refused,
    /// No reply is possible: the connection ends.
    End(&'static str),
}

const WHEN_HAGGLING: &str = "during option haggling";

impl<S: AsyncRead + AsyncWrite + Unpin> OptionChannel<S> {
    pub fn new(stream: S, side: Side, max_len: u32) -> Self {
        OptionChannel {
            stream,
            side,
            data: Vec::new(),
            max_len,
            bound: None,
        }
    }

    /// Bounds each read and each write (the upstream's, by
    /// `--upstream-timeout`): a server that stops answering mid-option
    /// gets the client an error reply, not a wait for the handshake
    /// timeout.
    pub fn bounded(mut self, bound: Duration) -> Self {
        self.bound = Some(bound);
        self
    }

    pub fn get_mut(&mut self) -> &mut S {
        &mut self.stream
    }

    pub fn into_inner(self) -> S {
        self.stream
    }

    /// The data of the option `read_option` returned last.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// Reads exactly `buf.len()` bytes.
    pub async fn read_exact(
        &mut self,
        buf: &mut [u8],
        when: &'static str,
    ) -> Result<(), ConnError> {
        let (side, bound) = (self.side, self.bound);
        within(bound, side, when, self.stream.read_exact(buf))
            .await
            .map(|_| ())
    }

    /// Reads one option: header and all its data (at most the limit, so
    /// that a refused option's data leaves the stream too).
    pub async fn read_option(&mut self) -> Result<OptionHeader, ConnError> {
        let mut header = [0u8; OPTION_HEADER_LEN];
        self.read_exact(&mut header, WHEN_HAGGLING).await?;
        let option = OptionHeader::parse(&header).map_err(ConnError::proto(self.side))?;
        self.check_length("option data", option.length)?;
        self.data.clear();
        self.read_data(option.length, "in the middle of an option")
            .await?;
        Ok(option)
    }

    /// Reads one option reply, header and data, onto the end of `into`,
    /// checking that it answers `option`.
    pub async fn read_reply(
        &mut self,
        option: u32,
        into: &mut Vec<u8>,
    ) -> Result<OptionReplyHeader, ConnError> {
        let mut header = [0u8; OPTION_REPLY_HEADER_LEN];
        self.read_exact(&mut header, WHEN_HAGGLING).await?;
        let reply = OptionReplyHeader::parse(&header).map_err(ConnError::proto(self.side))?;
        if reply.option != option {
            return Err(ConnError::Proto {
                side: self.side,
                error: ProtoError::OptionMismatch {
                    expected: option,
                    got: reply.option,
                },
            });
        }
        self.check_length("option reply", reply.length)?;
        into.extend_from_slice(&header);
        let (side, bound) = (self.side, self.bound);
        let mut body = (&mut self.stream).take(reply.length.into());
        let read = within(bound, side, WHEN_HAGGLING, body.read_to_end(into)).await?;
        if read < reply.length as usize {
            return Err(ConnError::closed(
                self.side,
                "in the middle of an option reply",
            ));
        }
        Ok(reply)
    }

    fn check_length(&self, what: &'static str, length: u32) -> Result<(), ConnError> {
        ProtoError::check_limit(what, length.into(), self.max_len.into())
            .map_err(ConnError::proto(self.side))
    }

    async fn read_data(&mut self, length: u32, when: &'static str) -> Result<(), ConnError> {
        let (side, bound) = (self.side, self.bound);
        let mut data = (&mut self.stream).take(length.into());
        let read = within(bound, side, when, data.read_to_end(&mut self.data)).await?;
        if read < length as usize {
            return Err(ConnError::closed(self.side, when));
        }
        Ok(())
    }

    /// Writes `bytes` and flushes them.
    pub async fn send(&mut self, bytes: &[u8]) -> Result<(), ConnError> {
        let (side, bound) = (self.side, self.bound);
        within(bound, side, WHEN_HAGGLING, self.stream.write_all(bytes)).await?;
        within(bound, side, WHEN_HAGGLING, self.stream.flush()).await
    }

    /// One option reply with an optional message.
    pub async fn send_reply(
        &mut self,
        option: u32,
        reply_type: u32,
        message: &str,
    ) -> Result<(), ConnError> {
        self.send(&encode_option_reply(option, reply_type, message.as_bytes()))
            .await
    }

    /// Sends option `option` with `data`, its length taken from `data`
    /// (which a routed option's renamed export changes).
    pub async fn send_option(&mut self, option: u32, data: &[u8]) -> Result<(), ConnError> {
        let header = OptionHeader {
            option,
            length: u32::try_from(data.len()).map_err(|_| {
                ConnError::proto(self.side)(ProtoError::Malformed("option data over 4 GiB"))
            })?,
        };
        let mut bytes = Vec::with_capacity(OPTION_HEADER_LEN + data.len());
        bytes.extend_from_slice(&header.encode());
        bytes.extend_from_slice(data);
        self.send(&bytes).await
    }

    /// Acknowledges NBD_OPT_ABORT, then says goodbye.
    pub async fn acknowledge_abort(&mut self) -> Result<(), ConnError> {
        self.send_reply(OPT_ABORT, REP_ACK, "").await?;
        self.goodbye().await;
        Ok(())
    }

    /// Ends the stream politely (close_notify, for TLS), briefly: the peer
    /// may already be gone.
    pub async fn goodbye(&mut self) {
        let _ = tokio::time::timeout(GOODBYE_TIMEOUT, self.stream.shutdown()).await;
    }

    /// While nbdgw shuts down, options other than ABORT get
    /// `NBD_REP_ERR_SHUTDOWN`, which makes the client disconnect softly;
    /// EXPORT_NAME has no error reply in the spec, so it ends the
    /// connection.
    pub async fn refuse_for_shutdown(
        &mut self,
        option: &OptionHeader,
        shutdown: &Shutdown,
    ) -> Result<ShutdownAnswer, ConnError> {
        if option.option == OPT_ABORT || !shutdown.refuses_options() {
            return Ok(ShutdownAnswer::Serve);
        }
        if option.option == OPT_EXPORT_NAME {
            return Ok(ShutdownAnswer::End(
                "NBD_OPT_EXPORT_NAME while shutting down: closed without a reply",
            ));
        }
        self.send_reply(option.option, REP_ERR_SHUTDOWN, "nbdgw is shutting down")
            .await?;
        Ok(ShutdownAnswer::Refused)
    }
}

/// `io` with its error mapped to `side`, and cut off after `bound` if
/// there is one.
async fn within<T>(
    bound: Option<Duration>,
    side: Side,
    when: &'static str,
    io: impl Future<Output = std::io::Result<T>>,
) -> Result<T, ConnError> {
    let Some(after) = bound else {
        return io.await.map_err(ConnError::io(side, when));
    };
    match tokio::time::timeout(after, io).await {
        Ok(done) => done.map_err(ConnError::io(side, when)),
        Err(_) => Err(ConnError::NoAnswer { side, when, after }),
    }
}
