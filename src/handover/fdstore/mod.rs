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

/// FileDescriptorStoreMax=, as systemd 254 and later say it in FDSTORE=
/// (None on 252, which does not).
fn descriptors_room() -> Option<usize> {
    std::env::var("FDSTORE").ok()?.parse().ok()
}

/// How many sessions (three descriptors each) systemd's store takes, if
/// it says (systemd 254+: FDSTORE=). systemd stores descriptors one by one
/// and closes those beyond its limit (service_add_fd_store_set), so a
/// session beyond it would be cut, or stored in part: the stash asks no
/// more than this many to go quiet, and the rest drain. The sessions
/// restored at this instance's start were all removed from the store
/// (`restore::claim`), so the whole room is free. None (systemd 252):
/// not known, every session is asked, as the guide says.
pub fn sessions_room() -> Option<usize> {
    descriptors_room().map(|n| n / 3)
}

/// Whether systemd's store has room for every session: systemd 254 and
/// later say its size in FDSTORE= (252 does not: nothing to check then).
/// A session that does not fit is closed at a restart, not drained.
pub fn check_room(max_connections: usize) {
    if let Some(room) = descriptors_room().filter(|room| *room < 3 * max_connections) {
        tracing::warn!(
            file_descriptor_store_max = room,
            max_connections,
            "--handover-fdstore: FileDescriptorStoreMax= holds fewer than 3 descriptors per connection; at a restart the sessions beyond {} are not stored and drain",
            room / 3
        );
    }
}

#[cfg(test)]
mod tests;
