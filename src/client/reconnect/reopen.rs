//! One try at opening the export again on a new server connection, and
//! the tries with backoff until one opens it.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tracing::debug;

use super::{Opened, Reopen};
use crate::client::remote::{self, Remote, RemoteTls};
use crate::client::ClientSettings;
use crate::conn::relayed;
use crate::logsafe::Escaped;
use crate::proto::consts::*;
use crate::proto::handshake::parse_info_export;

/// Backoff between tries: from the first to the longest.
pub(super) const FIRST_DELAY: Duration = Duration::from_millis(100);
const LONGEST_DELAY: Duration = Duration::from_secs(2);

/// The wait after `wait`: doubled, from `FIRST_DELAY` up to `LONGEST_DELAY`.
pub(super) fn backoff(wait: Duration) -> Duration {
    (wait * 2).clamp(FIRST_DELAY, LONGEST_DELAY)
}

/// One try's failure: worth another try, or final.
pub(super) enum Attempt {
    Failed(String),
    Changed(String),
}

/// A new connection with the export open on it.
pub(super) struct Reopened {
    pub conn: RemoteTls,
    pub tries: u32,
    /// The wait before the first try if this connection drops before it
    /// answers anything: the backoff goes on from where it was.
    pub next_wait: Duration,
}

/// The tries so far and the last one's failure, for the EIO replies
/// when --reconnect-timeout passes while tries go on.
#[derive(Default)]
pub(super) struct Progress {
    pub tries: u32,
    pub last: String,
}

pub(super) type Shared = Arc<Mutex<Progress>>;

pub(super) fn progress(shared: &Shared) -> std::sync::MutexGuard<'_, Progress> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Tries until a connection opens the same export: the first try after
/// `wait`, then with backoff, without end (the caller's deadline decides
/// what the requests waiting get). `Err` once the export is seen changed.
pub(super) async fn until_open(
    settings: Arc<ClientSettings>,
    opened: Arc<Opened>,
    mut wait: Duration,
    shared: Shared,
) -> Result<Reopened, String> {
    let tries_metric = &settings.metrics.reconnects.tries;
    let mut tries = 0;
    loop {
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        tries += 1;
        let outcome = reopen(&settings, &opened).await;
        let outcome_name = if outcome.is_ok() { "opened" } else { "failed" };
        tries_metric
            .get_or_create(&crate::metrics::Outcome {
                outcome: outcome_name,
            })
            .inc();
        let why = match outcome {
            Ok(conn) => {
                let next_wait = backoff(wait);
                return Ok(Reopened {
                    conn,
                    tries,
                    next_wait,
                });
            }
            Err(Attempt::Changed(what)) => return Err(what),
            Err(Attempt::Failed(why)) => why,
        };
        debug!(tries, error = %Escaped(&why), "reconnect failed; trying again");
        let mut shared = progress(&shared);
        shared.tries += 1;
        shared.last = why;
        drop(shared);
        wait = backoff(wait);
    }
}

fn failed(e: &dyn std::fmt::Display) -> Attempt {
    Attempt::Failed(e.to_string())
}

/// One try: TLS, the framing, the metadata contexts, the export, checked
/// unchanged. Each step is bounded by --server-timeout.
async fn reopen(settings: &ClientSettings, opened: &Opened) -> Result<RemoteTls, Attempt> {
    let mut remote = remote::connect(settings).await.map_err(|e| failed(&e))?;
    agree_framing(&mut remote, opened).await?;
    if let Some(meta) = &opened.meta {
        agree_meta(&mut remote, meta).await?;
    }
    let export = match &opened.reopen {
        Reopen::Go(data) => go(&mut remote, data).await?,
        Reopen::ExportName(name) => {
            let pads = remote.pads_export_name;
            match relayed::export_name_exchange(&mut remote.channel, pads, name).await {
                Ok(Ok(export)) => Some(export),
                Ok(Err(e)) | Err(e) => return Err(failed(&e)),
            }
        }
    };
    let Some((size, tflags)) = export else {
        return Err(Attempt::Changed(
            "the server sent no export information".into(),
        ));
    };
    let (was_size, was_tflags) = opened.export;
    if (size, tflags) != (was_size, was_tflags) {
        return Err(Attempt::Changed(format!(
            "size {size} and flags {tflags:#x} where they were size {was_size} and flags {was_tflags:#x}"
        )));
    }
    Ok(remote.channel.into_inner())
}

/// The reply framing agreed before, asked again.
async fn agree_framing(remote: &mut Remote, opened: &Opened) -> Result<(), Attempt> {
    let Some(code) = opened.framing.replay() else {
        return Ok(());
    };
    let channel = &mut remote.channel;
    channel
        .send_option(code, &[])
        .await
        .map_err(|e| failed(&e))?;
    let mut reply = Vec::new();
    let header = channel
        .read_reply(code, &mut reply)
        .await
        .map_err(|e| failed(&e))?;
    let refused = format!(
        "the server refused the reply framing agreed before ({})",
        remote::reply_name(header.reply_type)
    );
    match header.reply_type {
        REP_ACK => Ok(()),
        // A server (a gateway whose own server is still starting)
        // that says it is shutting down may say yes in a moment.
        REP_ERR_SHUTDOWN => Err(Attempt::Failed(refused)),
        _ => Err(Attempt::Changed(refused)),
    }
}

/// The metadata contexts agreed before, with the same ids.
async fn agree_meta(remote: &mut Remote, meta: &super::MetaContexts) -> Result<(), Attempt> {
    let channel = &mut remote.channel;
    channel
        .send_option(OPT_SET_META_CONTEXT, &meta.request)
        .await
        .map_err(|e| failed(&e))?;
    let mut chosen = Vec::new();
    loop {
        let mut reply = Vec::new();
        let header = channel
            .read_reply(OPT_SET_META_CONTEXT, &mut reply)
            .await
            .map_err(|e| failed(&e))?;
        if header.reply_type == REP_META_CONTEXT {
            // No more than were agreed before: a server sending endless
            // contexts is not the one the client agreed with.
            if chosen.len() >= meta.chosen.len() {
                return Err(Attempt::Changed(
                    "the server chose more metadata contexts than before".into(),
                ));
            }
            chosen.push(reply[OPTION_REPLY_HEADER_LEN..].to_vec());
        }
        if header.is_final() {
            match header.reply_type {
                REP_ACK => break,
                REP_ERR_SHUTDOWN => {
                    return Err(Attempt::Failed(
                        "the server is shutting down (NBD_OPT_SET_META_CONTEXT)".into(),
                    ))
                }
                other => {
                    return Err(Attempt::Changed(format!(
                        "the server refused the metadata contexts agreed before ({})",
                        remote::reply_name(other)
                    )))
                }
            }
        }
    }
    if chosen != meta.chosen {
        return Err(Attempt::Changed(
            "the server chose other metadata contexts (or ids) than before".into(),
        ));
    }
    Ok(())
}

/// NBD_OPT_GO with the data of the first: the export's size and flags.
async fn go(remote: &mut Remote, data: &[u8]) -> Result<Option<(u64, u16)>, Attempt> {
    let channel = &mut remote.channel;
    channel
        .send_option(OPT_GO, data)
        .await
        .map_err(|e| failed(&e))?;
    let mut export = None;
    loop {
        let mut reply = Vec::new();
        let header = channel
            .read_reply(OPT_GO, &mut reply)
            .await
            .map_err(|e| failed(&e))?;
        if header.reply_type == REP_INFO {
            export = parse_info_export(&reply[OPTION_REPLY_HEADER_LEN..]).or(export);
        }
        if header.is_final() {
            if header.reply_type != REP_ACK {
                // A gateway whose own server is still starting says so:
                // worth another try.
                return Err(Attempt::Failed(format!(
                    "NBD_OPT_GO refused ({})",
                    remote::reply_name(header.reply_type)
                )));
            }
            return Ok(export);
        }
    }
}
