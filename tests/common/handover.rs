//! Gateway generations for the hand-over tests: each one on the port
//! every generation shares, the later ones taking over from the earlier.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::process::{nbdgw_binary, NbdgwProcess};
use super::Env;

/// One generation of the gateway, listening once it returns.
pub fn generation(
    env: &Env,
    upstream: &Path,
    port: u16,
    handover: &Path,
    take_over: bool,
    extra: &[&str],
) -> NbdgwProcess {
    let process = spawn_generation(env, upstream, port, (handover, take_over), extra);
    process.wait_for_log("nbdgw listening", 1);
    process
}

/// `generation`, not waiting for it to listen.
pub fn spawn_generation(
    env: &Env,
    upstream: &Path,
    port: u16,
    (handover, take_over): (&Path, bool),
    extra: &[&str],
) -> NbdgwProcess {
    let mut cmd = Command::new(nbdgw_binary());
    cmd.arg("--tls-dir")
        .arg(env.certs())
        .arg("--upstream")
        .arg(upstream)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--handover-socket")
        .arg(handover)
        .args(["--shutdown-grace", "20", "--handover-timeout", "20"])
        .args(extra);
    if take_over {
        cmd.arg("--take-over").arg(handover);
    }
    NbdgwProcess::spawn(cmd, port)
}

/// A directory only its owner may write into, for the hand-over socket.
pub fn private_dir(env: &Env) -> PathBuf {
    let dir = env.path("run");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    dir
}

/// A successor that stops once it holds a session's State
/// (`NBDGW_DEBUG_HANDOVER_STATE_STALL`), killed there: it has the keys
/// and never says Taken.
pub fn successor_killed_holding_the_state(env: &Env, upstream: &Path, port: u16, handover: &Path) {
    let mut cmd = Command::new(nbdgw_binary());
    cmd.arg("--tls-dir")
        .arg(env.certs())
        .arg("--upstream")
        .arg(upstream)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--take-over")
        .arg(handover)
        .env("NBDGW_DEBUG_HANDOVER_STATE_STALL", "1");
    let new = NbdgwProcess::spawn(cmd, port);
    new.wait_for_log("debug: stalling the session take-over", 1);
    new.signal("KILL");
}
