//! Option haggling after TLS: connect upstream, then relay the client's
//! options one at a time, learning from the upstream's replies what
//! framing transmission will use.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tracing::{debug, info, warn};

use super::plain::{read_option, refused_for_shutdown, send_reply, ShutdownAnswer};
use super::{ClientTls, ConnError};
use crate::config::Config;
use crate::logsafe::Escaped;
use crate::proto::consts::*;
use crate::proto::handshake::{
    clamp_block_size, encode_export_name_reply, export_name_prefix, parse_export_name_reply,
    parse_info_export, ClientFlags, OptionHeader, OptionReplyHeader,
};
use crate::proto::transmission::ReplyMode;
use crate::proto::ProtoError;
use crate::shutdown::Shutdown;
use crate::upstream::{self, Upstream};

/// A connection that has entered transmission.
pub struct Session {
    pub tls: ClientTls,
    pub upstream: UnixStream,
    pub mode: ReplyMode,
    pub read_only: bool,
}

pub enum Outcome {
    Transmission(Box<Session>),
    Closed(&'static str),
}

/// How long a soft disconnect may take to say goodbye (close_notify).
const GOODBYE_TIMEOUT: Duration = Duration::from_secs(2);
/// Upstream option replies come in bursts (INFO, INFO, ACK): read through
/// a buffer, each burst is one read instead of two per reply.
const UPSTREAM_NEGOTIATION_BUF: usize = 4096;
/// Option replies to the client are gathered into one TLS write per
/// option, up to this much (a long LIST goes out in pieces).
const CLIENT_REPLY_BATCH: usize = 16 * 1024;

pub async fn relay_options(
    mut tls: ClientTls,
    client: ClientFlags,
    config: &Config,
    shutdown: &Shutdown,
) -> Result<Outcome, ConnError> {
    // Only now, with TLS up, does the upstream hear of this client.
    let upstream = match upstream::open(config).await {
        Ok(u) => u,
        Err(e) => {
            warn!(error = %e, "upstream unavailable");
            let message = format!("nbdgw: upstream NBD server unavailable: {e}");
            return refuse_all(tls, &message, config).await.map(Outcome::Closed);
        }
    };
    let Upstream {
        stream,
        pads_export_name,
    } = upstream;
    let mut up = BufReader::with_capacity(UPSTREAM_NEGOTIATION_BUF, stream);

    let mut data = Vec::new();
    let mut reply_data = Vec::new();
    let mut structured = false;
    let mut extended = false;
    loop {
        let option = read_option(&mut tls, config, &mut data).await?;
        match refused_for_shutdown(&mut tls, &option, shutdown).await? {
            ShutdownAnswer::Serve => {}
            ShutdownAnswer::Refused => continue,
            ShutdownAnswer::End(reason) => return Ok(Outcome::Closed(reason)),
        }
        let name = option_name(option.option);
        match option.option {
            OPT_STARTTLS => {
                send_reply(
                    &mut tls,
                    OPT_STARTTLS,
                    REP_ERR_INVALID,
                    "TLS is already active",
                )
                .await?;
            }
            OPT_ABORT => {
                // Tell the upstream too, so it sees a clean soft disconnect;
                // the client's ACK does not depend on it.
                let _ = forward_option(&mut up, &option, &data).await;
                send_reply(&mut tls, OPT_ABORT, REP_ACK, "").await?;
                let _ = tokio::time::timeout(GOODBYE_TIMEOUT, tls.shutdown()).await;
                return Ok(Outcome::Closed("client sent NBD_OPT_ABORT"));
            }
            OPT_EXPORT_NAME => {
                let export = String::from_utf8_lossy(&data).into_owned();
                forward_option(&mut up, &option, &data).await?;
                let mut reply = [0u8; 10];
                if let Err(e) = up.read_exact(&mut reply).await {
                    // The only way a server can refuse EXPORT_NAME.
                    warn!(export = %Escaped(&export), error = %e, "upstream refused NBD_OPT_EXPORT_NAME");
                    return Ok(Outcome::Closed("upstream refused the export"));
                }
                if pads_export_name {
                    let mut zeroes = [0u8; EXPORT_NAME_PADDING];
                    up.read_exact(&mut zeroes)
                        .await
                        .map_err(|e| ConnError::upstream_read(e, "in an EXPORT_NAME reply"))?;
                }
                let (size, tflags) = parse_export_name_reply(&reply);
                let bytes = encode_export_name_reply(size, tflags, client);
                tls.write_all(&bytes).await.map_err(ConnError::Client)?;
                tls.flush().await.map_err(ConnError::Client)?;
                let mode = reply_mode(structured, extended);
                return enter_transmission(tls, up, &export, mode, size, tflags);
            }
            OPT_LIST
            | OPT_INFO
            | OPT_GO
            | OPT_STRUCTURED_REPLY
            | OPT_LIST_META_CONTEXT
            | OPT_SET_META_CONTEXT
            | OPT_EXTENDED_HEADERS => {
                let mut replied = false;
                let relayed = relay_one(
                    &mut tls,
                    &mut up,
                    &option,
                    &data,
                    &mut reply_data,
                    config,
                    &mut replied,
                )
                .await;
                let (final_type, info_export) = match relayed {
                    Ok(r) => r,
                    Err(
                        e @ (ConnError::Upstream(_)
                        | ConnError::UpstreamClosed(_)
                        | ConnError::UpstreamProto(_)),
                    ) if !replied => {
                        // The client gets an answer, not a hang.
                        let msg = format!("nbdgw: upstream NBD server failed: {e}");
                        let _ = send_reply(&mut tls, option.option, REP_ERR_SHUTDOWN, &msg).await;
                        return Err(e);
                    }
                    Err(e) => return Err(e),
                };
                debug!(
                    option = name,
                    reply = format_args!("{final_type:#x}"),
                    "relayed"
                );
                if final_type != REP_ACK {
                    continue;
                }
                match option.option {
                    OPT_STRUCTURED_REPLY => structured = true,
                    OPT_EXTENDED_HEADERS => extended = true,
                    OPT_GO => {
                        let export = export_name_prefix(&data).unwrap_or_default();
                        // The spec makes INFO_EXPORT mandatory before GO's ACK;
                        // a server that omits it gets no read-only enforcement.
                        let (size, tflags) = info_export.unwrap_or((0, 0));
                        let mode = reply_mode(structured, extended);
                        return enter_transmission(tls, up, &export, mode, size, tflags);
                    }
                    _ => {}
                }
            }
            _ => {
                debug!(code = option.option, "refused unknown option");
                let msg = format!(
                    "nbdgw does not relay option {}: its effect on framing is unknown",
                    option.option
                );
                send_reply(&mut tls, option.option, REP_ERR_UNSUP, &msg).await?;
            }
        }
    }
}

fn reply_mode(structured: bool, extended: bool) -> ReplyMode {
    // Extended headers take precedence over structured replies.
    if extended {
        ReplyMode::Extended
    } else if structured {
        ReplyMode::Structured
    } else {
        ReplyMode::Simple
    }
}

fn enter_transmission(
    tls: ClientTls,
    upstream: BufReader<UnixStream>,
    export: &str,
    mode: ReplyMode,
    size: u64,
    tflags: u16,
) -> Result<Outcome, ConnError> {
    // A server sends nothing in transmission before a request, so nothing
    // read ahead can be left behind in the negotiation buffer.
    if !upstream.buffer().is_empty() {
        return Err(ConnError::UpstreamProto(ProtoError::Malformed(
            "upstream sent data after the end of negotiation, before any request",
        )));
    }
    let upstream = upstream.into_inner();
    let read_only = tflags & TFLAG_READ_ONLY != 0;
    info!(
        export = %Escaped(export),
        ?mode,
        size,
        transmission_flags = format_args!("{tflags:#x}"),
        read_only,
        "negotiated"
    );
    Ok(Outcome::Transmission(Box::new(Session {
        tls,
        upstream,
        mode,
        read_only,
    })))
}

async fn forward_option(
    up: &mut (impl AsyncWrite + Unpin),
    option: &OptionHeader,
    data: &[u8],
) -> Result<(), ConnError> {
    let mut bytes = Vec::with_capacity(OPTION_HEADER_LEN + data.len());
    bytes.extend_from_slice(&option.encode());
    bytes.extend_from_slice(data);
    up.write_all(&bytes).await.map_err(ConnError::Upstream)
}

/// Forwards one option and relays the upstream's replies to it up to and
/// including the final one. Returns the final reply type and, for INFO
/// and GO, the export size and transmission flags the upstream announced.
async fn relay_one(
    tls: &mut ClientTls,
    up: &mut BufReader<UnixStream>,
    option: &OptionHeader,
    data: &[u8],
    reply_data: &mut Vec<u8>,
    config: &Config,
    replied: &mut bool,
) -> Result<(u32, Option<(u64, u16)>), ConnError> {
    forward_option(up, option, data).await?;
    reply_data.clear();
    let mut info_export = None;
    loop {
        let mut header = [0u8; OPTION_REPLY_HEADER_LEN];
        up.read_exact(&mut header)
            .await
            .map_err(|e| ConnError::upstream_read(e, "during option haggling"))?;
        let reply = OptionReplyHeader::parse(&header).map_err(ConnError::UpstreamProto)?;
        if reply.option != option.option {
            return Err(ConnError::UpstreamProto(ProtoError::OptionMismatch {
                expected: option.option,
                got: reply.option,
            }));
        }
        ProtoError::check_limit(
            "option reply",
            reply.length.into(),
            config.max_option_len.into(),
        )
        .map_err(ConnError::UpstreamProto)?;
        // Replies gather in `reply_data` and reach the client together,
        // as one TLS record, when the final one has come.
        let start = reply_data.len();
        reply_data.extend_from_slice(&header);
        let read = (&mut *up)
            .take(reply.length.into())
            .read_to_end(reply_data)
            .await
            .map_err(ConnError::Upstream)?;
        if read < reply.length as usize {
            return Err(ConnError::UpstreamClosed(
                "in the middle of an option reply".into(),
            ));
        }
        if reply.reply_type == REP_INFO {
            let body = &mut reply_data[start + OPTION_REPLY_HEADER_LEN..];
            if let Some(export) = parse_info_export(body) {
                info_export = Some(export);
            }
            // A compliant client then never sends more than nbdgw takes.
            if clamp_block_size(body, config.max_payload) {
                debug!(
                    max_payload = config.max_payload,
                    "lowered the upstream's maximum block size to --max-payload"
                );
            }
        }
        if reply.is_final() || reply_data.len() >= CLIENT_REPLY_BATCH {
            tls.write_all(reply_data).await.map_err(ConnError::Client)?;
            tls.flush().await.map_err(ConnError::Client)?;
            reply_data.clear();
            *replied = true;
        }
        if reply.is_final() {
            return Ok((reply.reply_type, info_export));
        }
    }
}

/// Without an upstream (or a session slot), every option gets an error
/// that names the cause, so clients report it instead of hanging.
pub async fn refuse_all(
    mut tls: ClientTls,
    message: &str,
    config: &Config,
) -> Result<&'static str, ConnError> {
    let mut data = Vec::new();
    loop {
        let option = read_option(&mut tls, config, &mut data).await?;
        match option.option {
            OPT_EXPORT_NAME => return Ok("refused NBD_OPT_EXPORT_NAME: no reply is possible"),
            OPT_ABORT => {
                send_reply(&mut tls, OPT_ABORT, REP_ACK, "").await?;
                let _ = tokio::time::timeout(GOODBYE_TIMEOUT, tls.shutdown()).await;
                return Ok("client sent NBD_OPT_ABORT after a refusal");
            }
            _ => send_reply(&mut tls, option.option, REP_ERR_SHUTDOWN, message).await?,
        }
    }
}
