//! `--handover-fdstore` against a FAKE systemd (tests/fdstore_fake.py:
//! it holds the listening socket and the file-descriptor store and starts
//! each instance as systemd does), with a real qemu-nbd and real
//! python3-libnbd clients, so that these run without the VM
//! (tests/fdstore_restart.py runs the real systemd). From the review of
//! the fd store (M1, M2).

mod common;

use std::process::Command;

/// Runs one case of tests/fdstore_fake.py against the binary under test.
fn case(name: &str) {
    let out = common::run(
        Command::new("/usr/bin/python3")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/fdstore_fake.py"
            ))
            .arg(common::process::nbdgw_binary())
            .arg(name),
    );
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two `systemctl restart` in a row, the second at the new instance's
/// READY=1: all 20 sessions are stored again and answer on the third
/// instance (before: the second drained the ones it was still restoring).
#[test]
fn a_restart_right_after_ready_stores_every_session_again() {
    case("back_to_back");
}

/// A WRITE left half sent by one client does not hold an idle stored
/// session in the store for --shutdown-grace (before: 37 s).
#[test]
fn a_half_sent_write_does_not_hold_the_stored_sessions_for_the_grace() {
    case("half_sent_write");
}

/// FDSTORE=4 (room for one session), 3 sessions: one stored whole, the
/// other two drain instead of being taken and cut by systemd.
#[test]
fn sessions_beyond_the_stores_room_drain() {
    case("store_room");
}

/// A SIGTERM while the new instance restores (at its first claim): the
/// restore finishes, then all 40 sessions are stored again.
#[test]
fn a_stop_during_the_restore_stores_every_session_again() {
    case("term_during_restore");
}
