//! Sessions across `systemctl restart` through systemd's file-descriptor
//! store (`--handover-fdstore`, docs/design/handover.md "systemd's
//! file-descriptor store"): the old instance leaves each quiet session
//! there as its client socket, its upstream socket and a memfd with its
//! state (`stash`); the new one gets them back in LISTEN_FDS, claims each
//! through the memfd's mark, judges and serves it (`restore`).
//!
//! - `blob`: the memfd's contents and its "taken" mark;
//! - `notify`: FDSTORE=1, FDSTOREREMOVE=1 and BARRIER=1 messages;
//! - `stash`, `restore`: the old instance and the new.

pub mod blob;
pub mod notify;
pub mod restore;
pub mod stash;

pub use crate::listeners::{is_session_name, SESSION_PREFIX};

/// A stored session's descriptor name: the storing process's pid and the
/// session's connection id there.
pub fn session_name(pid: u32, id: u64) -> String {
    format!("{SESSION_PREFIX}{pid}.{id}")
}

/// `--handover-fdstore` stores into systemd: without NOTIFY_SOCKET it
/// could only close the sessions at a stop, so the start fails.
pub fn check(enabled: bool) -> anyhow::Result<()> {
    if enabled && std::env::var_os("NOTIFY_SOCKET").is_none() {
        anyhow::bail!("--handover-fdstore needs systemd's NOTIFY_SOCKET (run nbdgw as a Type=notify unit with FileDescriptorStoreMax=), or leave it off");
    }
    Ok(())
}

/// Whether systemd's store has room for every session: systemd 254 and
/// later say its size in FDSTORE= (252 does not: nothing to check then).
/// A session that does not fit is closed at a restart, not drained.
pub fn check_room(max_connections: usize) {
    let room = std::env::var("FDSTORE")
        .ok()
        .and_then(|n| n.parse::<usize>().ok());
    if let Some(room) = room.filter(|room| *room < 3 * max_connections) {
        tracing::warn!(
            file_descriptor_store_max = room,
            max_connections,
            "--handover-fdstore: FileDescriptorStoreMax= holds fewer than 3 descriptors per connection; at a restart the sessions beyond {} are closed",
            room / 3
        );
    }
}

#[cfg(test)]
mod tests;
