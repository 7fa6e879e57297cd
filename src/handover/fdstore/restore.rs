//! The new instance's side: the sessions systemd passes back in
//! LISTEN_FDS (named `nbdgw-s.PID.ID`, three descriptors each), each
//! claimed, then judged and served as one handed over on the channel.
//!
//! Claiming is the commit point (never two writers, no nonce twice
//! across a crash): the memfd's mark is read; if an earlier instance
//! already took the session (and then died), it is closed without a byte
//! written; else the mark is written (systemd holds the same file, so
//! every later instance sees it) and only then is the session removed
//! from the store and judged. A name whose descriptors are not the
//! three expected, or whose memfd this build cannot read (another
//! format), is removed and closed: what it holds cannot be served
//! safely, and left in the store it would come back at every restart.

use std::collections::BTreeMap;
use std::os::fd::{FromRawFd, OwnedFd};

use tracing::{info, warn};

use super::blob::{self, Stored};
use super::is_session_name;
use super::notify::Notifier;
use crate::admission::Admission;
use crate::config::Config;
use crate::handover::sessions::judge::judge;
use crate::handover::sessions::take::{resume, Resumed};
use crate::logsafe::escape;
use crate::proto::handover_session::Offer;

/// The descriptors passed under session names, by name.
#[derive(Default)]
pub struct Found {
    pub by_name: BTreeMap<String, Vec<OwnedFd>>,
}

/// A session claimed: marked taken and removed from the store.
pub struct Claimed {
    pub stored: Stored,
    pub tcp: OwnedFd,
    pub upstream: OwnedFd,
}

/// Takes the descriptors systemd passed under session names; the others
/// (the listening sockets) are left to `Listeners::open`, which skips
/// these names. Reads the environment before anything clears it.
pub fn collect() -> Found {
    let mine = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
        == Some(std::process::id());
    let count = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok());
    let (true, Some(count)) = (mine, count) else {
        return Found::default();
    };
    let names = std::env::var("LISTEN_FDNAMES").unwrap_or_default();
    let mut found = Found::default();
    for (index, name) in names.split(':').take(count).enumerate() {
        if !is_session_name(name) {
            continue;
        }
        let fd = passed(index);
        let _ = rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC);
        found.by_name.entry(name.to_string()).or_default().push(fd);
    }
    found
}

/// Descriptor 3 + `index`, owned. No safe crate turns a passed descriptor
/// that is not a socket (the memfd) into an owned one.
#[allow(unsafe_code)]
fn passed(index: usize) -> OwnedFd {
    // SAFETY: systemd passed descriptor 3 + index open to this process
    // (LISTEN_PID is ours, `collect`), and nothing else takes it:
    // `Listeners::open` skips session names, and `collect` runs once.
    unsafe { OwnedFd::from_raw_fd(3 + index as i32) }
}

/// Claims, judges and serves every session found (blocking). `serve`
/// hands one to the accept loop; false if it is stopping.
pub fn take(
    found: Found,
    (config, admission): (&Config, &Admission),
    notifier: &Notifier,
    serve: impl Fn(Resumed) -> bool,
) {
    if found.by_name.is_empty() {
        return;
    }
    info!(
        sessions = found.by_name.len(),
        "restart: taking the sessions systemd kept in its file-descriptor store"
    );
    let mut closed: BTreeMap<&'static str, usize> = BTreeMap::new();
    let stored = found.by_name.len();
    for (name, fds) in found.by_name {
        let outcome = claim(&name, fds, notifier).and_then(|claimed| {
            let was = claimed.stored.was;
            serve_claimed(claimed, (config, admission), &serve)
                .map_err(|(e, label)| (e, label, was))
        });
        match outcome {
            Ok(()) => config.metrics.session_handover("resumed"),
            Err((reason, label, was)) => {
                config.metrics.session_handover(label);
                *closed.entry(label).or_default() += 1;
                warn!(fdname = %escape(&name), was, reason = %escape(&reason), "restart: a stored session cannot be served; it is closed");
            }
        }
    }
    let closed_total: usize = closed.values().sum();
    info!(
        stored,
        restored = stored - closed_total,
        closed = closed_total,
        why = ?closed,
        "restart: the stored sessions are restored before accepting and READY=1 (closed: by reason, each logged above)"
    );
}

/// The commit point for one name: its descriptors sorted, its memfd read
/// and, if untaken, marked; the name removed from the store either way.
/// An error: why, the metric's label, the old connection id (0: unknown).
pub fn claim(
    name: &str,
    fds: Vec<OwnedFd>,
    notifier: &Notifier,
) -> Result<Claimed, (String, &'static str, u64)> {
    let lost = |why: String| (why, "lost", 0);
    let outcome = sort(fds).and_then(|(tcp, upstream, memfd)| {
        match blob::read(&memfd).map_err(|e| format!("its memfd cannot be read: {e}"))? {
            blob::Found::Unknown(why) => {
                Err(format!("its memfd is not one this build reads ({why})"))
            }
            blob::Found::Taken => {
                Err("an earlier instance took it (and then failed): closed without writing".into())
            }
            blob::Found::Fresh(stored) => {
                blob::mark_taken(&memfd).map_err(|e| format!("it cannot be marked taken: {e}"))?;
                debug_die_after_mark();
                Ok(Claimed {
                    stored,
                    tcp,
                    upstream,
                })
            }
        }
    });
    // Taken or not, it leaves the store: nobody may serve it after this.
    if let Err(e) = notifier.remove(name) {
        warn!(fdname = %escape(name), error = %e, "restart: cannot remove a stored session from systemd's store (it is marked taken)");
    }
    outcome.map_err(lost)
}

/// Debug builds: NBDGW_DEBUG_FDSTORE_DIE_AFTER_MARK=1 makes the new
/// instance abort once it has marked a session taken, before removing it
/// from the store, so that a test can show the next instance closing it.
fn debug_die_after_mark() {
    #[cfg(debug_assertions)]
    if std::env::var_os("NBDGW_DEBUG_FDSTORE_DIE_AFTER_MARK").is_some() {
        warn!("debug: aborting with a stored session marked taken (NBDGW_DEBUG_FDSTORE_DIE_AFTER_MARK)");
        std::process::abort();
    }
}

/// The three descriptors by kind: TCP, Unix, memfd (not a socket).
fn sort(fds: Vec<OwnedFd>) -> Result<(OwnedFd, OwnedFd, OwnedFd), String> {
    use rustix::net::AddressFamily;
    let (mut tcp, mut unix, mut file) = (None, None, None);
    let count = fds.len();
    for fd in fds {
        let slot = match rustix::net::getsockname(&fd).map(|a| a.address_family()) {
            Ok(AddressFamily::INET | AddressFamily::INET6) => &mut tcp,
            Ok(AddressFamily::UNIX) => &mut unix,
            Ok(_) => return Err("a socket of another family".into()),
            Err(rustix::io::Errno::NOTSOCK) => &mut file,
            Err(e) => return Err(e.to_string()),
        };
        if slot.replace(fd).is_some() {
            break;
        }
    }
    match (tcp, unix, file) {
        (Some(t), Some(u), Some(f)) if count == 3 => Ok((t, u, f)),
        _ => Err(format!("{count} descriptor(s), not a TCP socket, a Unix socket and a memfd (systemd drops a socket whose peer hung up)")),
    }
}

/// A claimed session judged as the channel's offers are, then served.
fn serve_claimed(
    claimed: Claimed,
    (config, admission): (&Config, &Admission),
    serve: &impl Fn(Resumed) -> bool,
) -> Result<(), (String, &'static str)> {
    let lost = |e: String| (e, "lost");
    let Claimed {
        stored,
        tcp,
        upstream,
    } = claimed;
    let offer = Offer::decode(&stored.offer).map_err(|e| lost(e.to_string()))?;
    // This configuration's judgement, as for an offer on the channel; a
    // session it would not admit, or would narrow, is closed here (the
    // old instance is gone: nowhere to drain it).
    let judged = judge(&offer, (config, admission)).map_err(|e| (e, "refused"))?;
    resume(
        (stored.was, Some((offer, judged))),
        (stored.handover, &stored.state),
        vec![tcp, upstream],
        serve,
    )
    .map_err(lost)?;
    info!(
        was = stored.was,
        "restart: serving a session from systemd's file-descriptor store (no new TLS handshake)"
    );
    Ok(())
}
