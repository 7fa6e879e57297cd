//! The hand-over's flags, one clap group flattened into the server's.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

/// Seconds a successor has, once served, to finish taking the
/// listeners over; past it the predecessor takes them back.
pub const DEFAULT_HANDOVER_TIMEOUT_SECS: u64 = 10;

#[derive(Args, Debug, Clone)]
pub struct HandoverArgs {
    /// Listen on this Unix socket for a successor (`--take-over PATH`):
    /// it is given the listening sockets, this process stops accepting,
    /// drains its sessions as on SIGTERM and exits 0. Created 0600; a
    /// directory others may write is refused unless it is sticky; only
    /// a stale socket of this uid is replaced. Off by default.
    #[arg(long, env = "NBDGW_HANDOVER_SOCKET", value_name = "PATH")]
    pub handover_socket: Option<PathBuf>,
    /// Start as the successor of the gateway listening on this hand-over
    /// socket (same uid): take its listening sockets (those whose address
    /// matches --listen / --admin-listen / --handover-socket; others are
    /// bound here) and serve them. Fails the start if the predecessor
    /// refuses, and under systemd (NOTIFY_SOCKET set: a successor in the
    /// unit dies with it; use --handover-fdstore and systemctl restart).
    #[arg(long, env = "NBDGW_TAKE_OVER", value_name = "PATH")]
    pub take_over: Option<PathBuf>,
    /// What --take-over does when no gateway is there to take over:
    /// `fail` the start (the default), or `start` fresh, binding the
    /// listeners itself, but only when nothing is at PATH or nothing
    /// listens there (a stale socket: connect is refused), i.e. no
    /// process holds a hand-over socket there. A gateway that answers
    /// there and refuses, or a hand-over that fails part-way, fails the
    /// start either way. For a pod that starts the same way whether or
    /// not an older one runs on the node (docs/guides/restarts.md).
    #[arg(long, env = "NBDGW_TAKE_OVER_MISSING", requires = "take_over", value_enum, value_name = "WHAT", default_value_t = TakeOverMissing::Fail)]
    pub take_over_missing: TakeOverMissing,
    /// What this gateway does once a successor serves its listeners and
    /// the sessions not handed over have drained: `exit` 0 (the default),
    /// or `wait`: stay alive, idle, listening on nothing, until SIGTERM
    /// or SIGINT, then exit 0 at once (one that came during the drain
    /// ends it when the drain does). For a container whose restart
    /// policy would start an exited gateway again (Kubernetes'
    /// restartPolicy: Always), which would then fight its successor.
    #[arg(long, env = "NBDGW_AFTER_HANDOVER", requires = "handover_socket", value_enum, value_name = "WHAT", default_value_t = AfterHandover::Exit)]
    pub after_handover: AfterHandover,
    /// Seconds a hand-over may take, on either side, from the moment the
    /// predecessor serves the successor to its first accept (a successor
    /// queued behind another waits apart, --handover-queue-timeout). A
    /// successor that stalls or dies before it is told to
    /// serve leaves the predecessor serving; once told, it keeps the
    /// sockets unless it gives up or its process is gone. While a
    /// successor holds the listeners nobody accepts (connections wait in
    /// the backlog), so this is also the longest such pause.
    #[arg(long, env = "NBDGW_HANDOVER_TIMEOUT", default_value_t = DEFAULT_HANDOVER_TIMEOUT_SECS, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub handover_timeout: u64,
    /// Seconds a successor waits to be served by the running gateway,
    /// which serves one successor at a time, each for up to its own
    /// --handover-timeout: a successor queued behind others (or behind
    /// a connection that says nothing) fails its start past this, saying
    /// so. The running gateway serves on meanwhile.
    #[arg(long, env = "NBDGW_HANDOVER_QUEUE_TIMEOUT", value_name = "SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub handover_queue_timeout: u64,
    /// Seconds a session being handed to a successor may take to go
    /// quiet: it stops reading requests at a request boundary and the
    /// replies to those already upstream finish. One that is not quiet
    /// in time stays here and drains as on SIGTERM. On the hand-over
    /// socket it is also the longest pause a client can see in its
    /// requests. With --handover-fdstore the stored sessions wait until
    /// this process exits: it drains for at most this long too, then
    /// closes what is left (nothing it acknowledged is lost), so their
    /// pause is at most twice this plus 2 s and systemd's confirmation
    /// (up to 10 s), plus the next instance's start.
    #[arg(long, env = "NBDGW_HANDOVER_QUIESCE_TIMEOUT", value_name = "SECS", default_value_t = 5.0, value_parser = quiesce_secs)]
    pub handover_quiesce_timeout: f64,
    /// Key generations a TLS 1.3 session may be at when it is handed to
    /// a successor: its traffic secrets are followed from the handshake's
    /// through each KeyUpdate (two HKDF-Expands each, off the async
    /// workers and one session at a time). rustls re-keys every 2^24
    /// records, so the default is ~64 TiB of traffic for an honest peer;
    /// a session past it is closed at the hand-over (its keys have left
    /// rustls by then), with a log line.
    #[arg(long, env = "NBDGW_HANDOVER_MAX_KEY_GENERATIONS", value_name = "N", default_value_t = crate::tls::key_update::DEFAULT_MAX_GENERATIONS_AT_HAND_OVER, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1 << 20))]
    pub handover_max_key_generations: usize,
    /// Under systemd (`systemctl restart`): at SIGTERM, instead of
    /// draining them, quiesce the sessions and leave each one in systemd's
    /// file-descriptor store (its client socket, its upstream socket and
    /// a memfd with its state), for the next instance of the unit to
    /// serve on. Needs FileDescriptorStoreMax= and NOTIFY_SOCKET (the
    /// start fails without it). Sessions that cannot be stored drain as
    /// today, and so do those beyond the store's room when systemd says
    /// it (FDSTORE=, systemd 254 and later; on 252 nbdgw cannot know it,
    /// and systemd closes the sessions beyond FileDescriptorStoreMax= /
    /// 3). A stop that is not a restart closes the stored ones. Off by
    /// default; the shipped unit sets it.
    #[arg(long, env = "NBDGW_HANDOVER_FDSTORE")]
    pub handover_fdstore: bool,
}

/// `--take-over-missing`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TakeOverMissing {
    /// Fail the start: a successor was asked for, and none can be.
    Fail,
    /// Start fresh when no gateway holds the hand-over socket.
    Start,
}

/// `--after-handover`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AfterHandover {
    /// Exit 0.
    Exit,
    /// Stay, idle, until SIGTERM or SIGINT; then exit 0.
    Wait,
}

fn quiesce_secs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.01..=600.0).contains(&v) => Ok(v),
        _ => Err("a number of seconds from 0.01 to 600".to_string()),
    }
}
