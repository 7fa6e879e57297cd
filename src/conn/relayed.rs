//! What relaying one option means, whichever way a connection points: the
//! server mode relays a TLS client's options to a Unix-socket upstream, the
//! client mode a plaintext local client's options to a TLS remote server.
//! Both forward the option, relay the replies up to the final one in
//! batches, learn the framing from the ACKs, and leave for transmission
//! with nothing read ahead. The server mode adds its policy and routing
//! around these; the client mode uses them as they are.

use tokio::io::{AsyncRead, AsyncWrite};

use super::error::{ConnError, Side};
use super::options::OptionChannel;
use crate::proto::consts::*;
use crate::proto::handshake::{
    clamp_block_size, encode_export_name_reply, parse_export_name_reply, parse_info_export,
    split_export_name, ClientFlags, OptionHeader,
};
use crate::proto::transmission::ReplyMode;

/// Option replies to the client are gathered into one write per option,
/// up to this much (a long LIST goes out in pieces).
const CLIENT_REPLY_BATCH: usize = 16 * 1024;

/// The reply framings agreed so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Framing {
    pub structured: bool,
    pub extended: bool,
}

impl Framing {
    /// The upstream acknowledged `option`.
    pub fn acknowledged(&mut self, option: u32) {
        match option {
            OPT_STRUCTURED_REPLY => self.structured = true,
            OPT_EXTENDED_HEADERS => self.extended = true,
            _ => {}
        }
    }

    /// Whether any framing beyond simple replies is agreed.
    pub fn any(&self) -> bool {
        self.structured || self.extended
    }

    /// The option that asks a fresh upstream for the same framing, if any.
    pub fn replay(&self) -> Option<u32> {
        if self.extended {
            Some(OPT_EXTENDED_HEADERS)
        } else {
            self.structured.then_some(OPT_STRUCTURED_REPLY)
        }
    }

    /// Extended headers take precedence over structured replies.
    pub fn mode(&self) -> ReplyMode {
        match (self.extended, self.structured) {
            (true, _) => ReplyMode::Extended,
            (false, true) => ReplyMode::Structured,
            (false, false) => ReplyMode::Simple,
        }
    }
}

/// The final reply to a relayed option, and the export it announced.
pub struct Relayed {
    pub reply_type: u32,
    pub export: Option<(u64, u16)>,
    /// The last error reply's message (its data), for the log.
    pub message: Vec<u8>,
}

/// The replies of one option on their way to the client.
#[derive(Default)]
pub struct Batch {
    bytes: Vec<u8>,
    /// Whether any reply to the current option has reached the client.
    pub answered: bool,
}

/// Relays the upstream's replies to `option` (already sent) up to the
/// final one, gathered so that each burst reaches the client as one write.
/// `edit` may change each reply, which starts at the given offset of the
/// batch, and returns the export's size and flags if the reply gave them.
pub async fn relay_replies<C, U>(
    client: &mut OptionChannel<C>,
    upstream: &mut OptionChannel<U>,
    option: u32,
    batch: &mut Batch,
    mut edit: impl FnMut(u32, &mut Vec<u8>, usize) -> Option<(u64, u16)>,
) -> Result<Relayed, ConnError>
where
    C: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    batch.answered = false;
    batch.bytes.clear();
    let mut export = None;
    let mut message = Vec::new();
    loop {
        let start = batch.bytes.len();
        let reply = upstream.read_reply(option, &mut batch.bytes).await?;
        if reply.is_error() {
            message = batch.bytes[start + OPTION_REPLY_HEADER_LEN..].to_vec();
        }
        export = edit(reply.reply_type, &mut batch.bytes, start).or(export);
        if reply.is_final() || batch.bytes.len() >= CLIENT_REPLY_BATCH {
            client.send(&batch.bytes).await?;
            batch.bytes.clear();
            batch.answered = true;
        }
        if reply.is_final() {
            return Ok(Relayed {
                reply_type: reply.reply_type,
                export,
                message,
            });
        }
    }
}

/// `relay_replies`, and after an upstream failure an answer to the client
/// (`failed`, as NBD_REP_ERR_SHUTDOWN) if it has had none yet, rather than
/// a hang. The error itself ends the connection and is logged then.
pub async fn relay_or_answer<C, U>(
    client: &mut OptionChannel<C>,
    upstream: &mut OptionChannel<U>,
    option: u32,
    batch: &mut Batch,
    edit: impl FnMut(u32, &mut Vec<u8>, usize) -> Option<(u64, u16)>,
    failed: &str,
) -> Result<Relayed, ConnError>
where
    C: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    match relay_replies(client, upstream, option, batch, edit).await {
        Err(e) if e.is_upstream() && !batch.answered => {
            let _ = client.send_reply(option, REP_ERR_SHUTDOWN, failed).await;
            Err(e)
        }
        relayed => relayed,
    }
}

/// What an upstream's INFO reply body tells of the export, with its
/// maximum block size lowered to `max_payload` first, so that a compliant
/// client never sends more than nbdgw takes.
pub fn info_export(body: &mut [u8], max_payload: u32) -> Option<(u64, u16)> {
    if clamp_block_size(body, max_payload) {
        tracing::debug!(
            max_payload,
            "lowered the upstream's maximum block size to --max-payload"
        );
    }
    parse_info_export(body)
}

/// The export an INFO or GO names, for the log and the audit trail.
pub fn go_export_name(data: &[u8]) -> String {
    String::from_utf8_lossy(split_name(data)).into_owned()
}

/// The export name's bytes in an INFO or GO's data (empty if malformed).
pub fn split_name(data: &[u8]) -> &[u8] {
    split_export_name(data).map_or(&[], |(name, _)| name)
}

/// NBD_OPT_EXPORT_NAME with `data` to the upstream, and its answer: the
/// export's size and flags, or `None` when the upstream closed, which is
/// the only way a server can refuse it (`Err` is any other failure).
pub async fn export_name_exchange<U: AsyncRead + AsyncWrite + Unpin>(
    upstream: &mut OptionChannel<U>,
    pads_export_name: bool,
    data: &[u8],
) -> Result<Result<(u64, u16), ConnError>, ConnError> {
    upstream.send_option(OPT_EXPORT_NAME, data).await?;
    let mut reply = [0u8; 10];
    let when = "in an EXPORT_NAME reply";
    if let Err(e) = upstream.read_exact(&mut reply, when).await {
        return Ok(Err(e));
    }
    if pads_export_name {
        let mut zeroes = [0u8; EXPORT_NAME_PADDING];
        upstream.read_exact(&mut zeroes, when).await?;
    }
    Ok(Ok(parse_export_name_reply(&reply)))
}

/// Sends the client the EXPORT_NAME answer in the form its flags asked for.
pub async fn answer_export_name<C: AsyncRead + AsyncWrite + Unpin>(
    client: &mut OptionChannel<C>,
    (size, tflags): (u64, u16),
    flags: ClientFlags,
) -> Result<(), ConnError> {
    client
        .send(&encode_export_name_reply(size, tflags, flags))
        .await
}

/// An option whose effect on framing nbdgw does not know: never relayed.
pub async fn refuse_unsupported<C: AsyncRead + AsyncWrite + Unpin>(
    client: &mut OptionChannel<C>,
    option: &OptionHeader,
) -> Result<(), ConnError> {
    tracing::debug!(code = option.option, "refused unknown option");
    let message = format!(
        "nbdgw does not relay option {}: its effect on framing is unknown",
        option.option
    );
    client
        .send_reply(option.option, REP_ERR_UNSUP, &message)
        .await
}

/// A server sends nothing in transmission before a request, so nothing
/// may be left read ahead when negotiation ends.
pub fn check_nothing_ahead(buffered: usize) -> Result<(), ConnError> {
    if buffered == 0 {
        return Ok(());
    }
    Err(ConnError::Proto {
        side: Side::Upstream,
        error: crate::proto::ProtoError::Malformed(
            "data after the end of negotiation, before any request",
        ),
    })
}

/// Without an upstream (or a session slot), every option gets an error
/// that names the cause, so clients report it instead of hanging.
pub async fn refuse_all<C: AsyncRead + AsyncWrite + Unpin>(
    mut client: OptionChannel<C>,
    message: &str,
) -> Result<&'static str, ConnError> {
    loop {
        let option = client.read_option().await?;
        match option.option {
            OPT_EXPORT_NAME => return Ok("refused NBD_OPT_EXPORT_NAME: no reply is possible"),
            OPT_ABORT => {
                client.acknowledge_abort().await?;
                return Ok("client sent NBD_OPT_ABORT after a refusal");
            }
            _ => {
                client
                    .send_reply(option.option, REP_ERR_SHUTDOWN, message)
                    .await?
            }
        }
    }
}
