//! The new gateway's end (`--take-over PATH`): it asks the running one
//! for its listening sockets, checks each, takes those that match its own
//! flags, and says when it serves them.

use std::net::{SocketAddr, TcpListener};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tracing::{info, warn};

use super::alive::Peer;
use super::channel::{peer_uid, Channel, ChannelError};
use super::describe::{check, show};
use super::flags::TakeOverMissing;
use crate::metrics::Metrics;
use crate::proto::handover::{Address, Descriptor, Message, Role, Speaks};

/// What this gateway wants to serve, from its own flags.
pub struct Wanted<'a> {
    /// The TCP listener (`--listen`), if one is served.
    pub listen: Option<SocketAddr>,
    /// Client mode's local Unix listener (`nbdgw client --listen PATH`).
    pub listen_unix: Option<&'a Path>,
    pub admin: Option<SocketAddr>,
    pub handover: Option<&'a Path>,
    /// The state versions this mode speaks.
    pub speaks: Speaks,
}

/// The sockets taken over (None: not given, or not matching).
#[derive(Default)]
pub struct Taken {
    pub nbd: Option<TcpListener>,
    /// Client mode's local Unix listener.
    pub nbd_unix: Option<UnixListener>,
    pub admin: Option<TcpListener>,
    pub handover: Option<UnixListener>,
}

/// The connection to the predecessor, between taking its listeners and
/// serving them.
pub struct Successor {
    /// Always there until `serving` moves it on to `Sessions`.
    channel: Option<Channel>,
    path: PathBuf,
    /// The running gateway's process, by the pidfd it sent with Chosen.
    predecessor: Peer,
    timeout: Duration,
    /// When the listeners arrived: from then on they only queue, until
    /// this process accepts (the pause logged at Serving).
    paused_at: Instant,
    /// The predecessor died before Go: nobody to tell Serving.
    orphaned: bool,
    /// `serving` ran; dropped before that, this process gave up.
    served: bool,
    /// The state version agreed (2: sessions follow Serving).
    version: u32,
    /// The version under which sessions follow Serving.
    sessions_version: u32,
}

impl Drop for Successor {
    /// A start that fails after the take-over began (its own checks, a
    /// bind, anything after Go) says so before the channel closes.
    fn drop(&mut self) {
        if let (false, Some(channel)) = (self.served, &mut self.channel) {
            channel.refuse("the successor gave up before it served the listening sockets");
        }
    }
}

/// The channel after Serving, for the sessions (state version 2).
pub struct Sessions {
    channel: Channel,
    timeout: Duration,
}

impl Sessions {
    /// Takes the sessions the old gateway offers, until it is done;
    /// `serve` starts one (false: this gateway is stopping).
    pub fn take(
        mut self,
        judging: (&crate::config::Config, &crate::admission::Admission),
        serve: impl Fn(super::sessions::take::Resumed) -> bool,
    ) {
        let result = super::sessions::take::take(&mut self.channel, judging, self.timeout, serve);
        report(result);
    }

    /// `take` with another mode's judge and serve (client mode's).
    pub fn take_with<T: super::sessions::take::Taker>(mut self, taker: &T) {
        let result = super::sessions::take::take_with(&mut self.channel, taker, self.timeout);
        report(result);
    }
}

fn report(result: Result<(), ChannelError>) {
    match result {
        Ok(()) => info!("take-over: the old gateway has handed over its sessions"),
        Err(e) => {
            warn!(error = %e, "take-over: the session hand-over ended early; sessions not handed over drain in the old gateway, or were closed with it if it died")
        }
    }
}

/// Connects to `path`, agrees on a state version and takes the
/// listeners. Any failure fails the start; the predecessor, seeing the
/// connection end, goes on serving.
pub fn take_over(
    path: &Path,
    stream: UnixStream,
    wanted: &Wanted,
    (queue, timeout): (Duration, Duration),
) -> Result<(Successor, Taken)> {
    let shown = path.display();
    let (ours, theirs) = (rustix::process::getuid().as_raw(), peer_uid(&stream)?);
    if theirs != ours {
        bail!("--take-over {shown}: the gateway there runs as uid {theirs}, this one as {ours}");
    }
    // The running gateway serves one successor at a time: this one may
    // wait in the backlog while others are served (each up to the
    // predecessor's own timeout), so --handover-timeout starts at Chosen,
    // and the wait for it is --handover-queue-timeout (review round 2,
    // S1, R4).
    let mut channel = Channel::new(stream, Instant::now() + queue)?;
    let (predecessor, version) = agree(&mut channel, path, queue, wanted.speaks)?;
    channel.set_deadline(Instant::now() + timeout);
    let listeners = channel.recv().map_err(|e| give_up(&mut channel, path, e));
    let (sockets, fds) = match listeners? {
        (Message::Listeners { sockets }, fds) => (sockets, fds),
        (other, _) => return Err(violation(&mut channel, path, &other)),
    };
    let paused_at = Instant::now();
    let taken = match take(sockets, fds, wanted) {
        Ok(taken) => taken,
        Err(e) => {
            channel.refuse(&e);
            bail!("--take-over {shown}: {e}");
        }
    };
    debug_stall();
    let successor = Successor {
        channel: Some(channel),
        path: path.to_path_buf(),
        predecessor,
        timeout,
        paused_at,
        orphaned: false,
        served: false,
        version,
        sessions_version: wanted.speaks.sessions,
    };
    Ok((successor, taken))
}

/// The connection to the gateway running at `path`; None, with
/// `--take-over-missing start`, when there is none to take over: nothing
/// at the path (ENOENT), or a socket nothing listens on (ECONNREFUSED,
/// which Linux answers for a socket file no process has bound or
/// listens on: a gateway that is gone). No process then holds a
/// hand-over socket there, so a fresh start takes nothing from anyone;
/// and if a gateway without one still holds the port, the bind fails.
/// Anything else fails the start: a file that is not a socket (connect
/// says ECONNREFUSED there too), a path this uid may not reach.
/// The connect waits at most `queue` (`--handover-queue-timeout`) while
/// the hand-over socket's listen queue is full, then fails the start:
/// a blocking connect would wait there for ever, with no log line.
pub fn connect(
    path: &Path,
    missing: TakeOverMissing,
    queue: Duration,
) -> Result<Option<UnixStream>> {
    let shown = path.display();
    let error = match connect_within(path, queue) {
        Ok(stream) => return Ok(Some(stream)),
        Err(e) => e,
    };
    let none_there = match error.kind() {
        std::io::ErrorKind::NotFound => true,
        std::io::ErrorKind::ConnectionRefused => std::fs::symlink_metadata(path)
            .is_ok_and(|meta| std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type())),
        _ => false,
    };
    if !none_there || missing == TakeOverMissing::Fail {
        return Err(error).with_context(|| format!("--take-over {shown}"));
    }
    info!(path = %shown, reason = %error, "take-over: no gateway listens there; starting fresh (--take-over-missing start)");
    Ok(None)
}

/// Hello, then the predecessor's Chosen: its process (by the pidfd it
/// sent) and the state version. Before Chosen this process only waited
/// its turn: past the queue's bound it says it was not served, not that
/// a hand-over took too long (review round 2, R4).
fn agree(
    channel: &mut Channel,
    path: &Path,
    queue: Duration,
    speaks: Speaks,
) -> Result<(Peer, u32)> {
    let hello = Message::Hello {
        versions: speaks.known.to_vec(),
        pid: std::process::id(),
    };
    let sent = channel.send(&hello, &[]);
    sent.map_err(|e| give_up(channel, path, e))?;
    let chosen = match channel.recv() {
        Err(ChannelError::Timeout) => {
            let why = format!("not served within --handover-queue-timeout ({} s): the running gateway serves one successor at a time and did not come to this one", queue.as_secs());
            channel.refuse(&format!("the successor gives up: {why}"));
            bail!("--take-over {}: {why}", path.display());
        }
        other => other.map_err(|e| give_up(channel, path, e))?,
    };
    match chosen {
        (Message::Chosen { version, pid, .. }, fds) if speaks.known.contains(&version) => {
            let predecessor = Peer::of_pidfd(fds.into_iter().next());
            let watched = predecessor.watchable();
            info!(
                version,
                pid, watched, "take-over: the running gateway agreed on a state version"
            );
            Ok((predecessor, version))
        }
        (other, _) => Err(violation(channel, path, &other)),
    }
}

/// This process gives up on a channel error: it says so (unless the
/// running gateway refused first), so that the running gateway never has
/// to guess from a bare end (review round 2, S6).
fn give_up(channel: &mut Channel, path: &Path, e: ChannelError) -> anyhow::Error {
    if !matches!(e, ChannelError::Peer(_)) {
        channel.refuse(&format!("the successor gives up: {e}"));
    }
    anyhow::anyhow!("--take-over {}: {e}", path.display())
}

fn violation(channel: &mut Channel, path: &Path, got: &Message) -> anyhow::Error {
    channel.refuse(&format!("unexpected {}", got.name()));
    anyhow::anyhow!(
        "--take-over {}: the running gateway sent {} out of turn",
        path.display(),
        got.name()
    )
}

/// Each descriptor checked against its description, then kept if its
/// address is what this gateway's flags ask for; one that is not is
/// closed here (the predecessor closes its own as it exits).
fn take(sockets: Vec<Descriptor>, fds: Vec<OwnedFd>, wanted: &Wanted) -> Result<Taken, String> {
    let mut taken = Taken::default();
    for (said, fd) in sockets.iter().zip(fds) {
        check(&fd, said)?;
        let matches = match (&said.role, &said.address) {
            (Role::Nbd, Address::Inet(addr)) => Some(*addr) == wanted.listen,
            (Role::Nbd, Address::Unix(path)) => {
                wanted.listen_unix.map(|p| p.as_os_str().as_bytes()) == Some(path.as_slice())
            }
            (Role::Admin, Address::Inet(addr)) => Some(*addr) == wanted.admin,
            (Role::Handover, Address::Unix(path)) => {
                wanted.handover.map(|p| p.as_os_str().as_bytes()) == Some(path.as_slice())
            }
            _ => false,
        };
        let (role, socket) = (said.role.as_str(), show(said));
        if !matches {
            warn!(role, %socket, "take-over: the running gateway's socket does not match this one's flags; it closes with the old process, this one binds its own");
            continue;
        }
        let duplicate = match (said.role, &said.address) {
            (Role::Nbd, Address::Unix(_)) => {
                taken.nbd_unix.replace(UnixListener::from(fd)).is_some()
            }
            (Role::Nbd, _) => taken.nbd.replace(TcpListener::from(fd)).is_some(),
            (Role::Admin, _) => taken.admin.replace(TcpListener::from(fd)).is_some(),
            (Role::Handover, _) => taken.handover.replace(UnixListener::from(fd)).is_some(),
        };
        if duplicate {
            return Err(format!("two {role} sockets were given"));
        }
        info!(role, %socket, "take-over: serving the running gateway's socket");
    }
    Ok(taken)
}

impl Successor {
    /// Ready, then Go: after this the predecessor no longer accepts, and
    /// this process must (it calls `serving` once its loops run). A
    /// predecessor that ends the channel without a Refuse and whose
    /// process is gone died holding nothing: this process serves the
    /// listeners it was given rather than leave nothing accepting.
    pub fn commit(&mut self) -> Result<()> {
        let shown = self.path.display();
        let channel = self.channel.as_mut().expect("the channel until serving");
        let answer = match channel.send(&Message::Ready, &[]) {
            Ok(()) => channel.recv(),
            // A predecessor that gave up said Refuse before it closed:
            // its reason is still there to read behind the broken pipe.
            Err(e) => match channel.recv() {
                Err(refused @ ChannelError::Peer(_)) => Err(refused),
                _ => Err(e),
            },
        };
        match answer {
            Ok((Message::Go, _)) => {
                debug_stall_after_go();
                Ok(())
            }
            Ok((other, _)) => Err(violation(channel, &self.path, &other)),
            Err(e) if e.is_bare_end() && self.predecessor.gone_within(self.timeout) => {
                warn!(from = %shown, error = %e, "take-over: the old gateway died before Go (its process is gone); serving the listening sockets it gave");
                self.orphaned = true;
                Ok(())
            }
            Err(e) => Err(give_up(channel, &self.path, e)),
        }
    }

    /// The accept loops run: the predecessor may drain and exit. Never
    /// fatal: after Go the predecessor has stopped accepting, so if it
    /// cannot be told (it died, or gave up and accepts again) this process
    /// serves on rather than leave nothing accepting. Counted here, where
    /// the admin port now is (`nbdgw_takeovers_total`).
    pub fn serving(mut self, metrics: &Metrics) -> Option<Sessions> {
        self.served = true;
        let shown = self.path.display();
        // What a client that connected just after the listeners left
        // the old accept loops waited, at most, before an accept.
        let pause_ms = self.paused_at.elapsed().as_millis() as u64;
        if self.orphaned {
            metrics.takeover("predecessor_gone");
            info!(from = %shown, pause_ms, "take-over: serving the old gateway's listening sockets (it had died)");
            return None;
        }
        metrics.takeover("taken_over");
        let channel = self.channel.as_mut().expect("the channel until serving");
        match channel.send(&Message::Serving, &[]) {
            Ok(()) => {
                info!(from = %shown, pause_ms, "take-over: serving; the old gateway drains its sessions and exits")
            }
            Err(e) => {
                warn!(from = %shown, pause_ms, error = %e, "take-over: the old gateway did not hear that this one serves (it may have died); serving on");
                return None;
            }
        }
        let channel = self.channel.take()?;
        (self.version == self.sessions_version).then_some(Sessions {
            channel,
            timeout: self.timeout,
        })
    }
}

/// Debug builds: NBDGW_DEBUG_HANDOVER_AFTER_GO_STALL=1 makes a successor
/// stop once told Go, before it accepts or says Serving, so that a test
/// can kill it there (the predecessor must then take the listeners back).
fn debug_stall_after_go() {
    #[cfg(debug_assertions)]
    if std::env::var_os("NBDGW_DEBUG_HANDOVER_AFTER_GO_STALL").is_some() {
        warn!("debug: stalling the take-over after Go, before serving (NBDGW_DEBUG_HANDOVER_AFTER_GO_STALL)");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

/// Debug builds: NBDGW_DEBUG_HANDOVER_STALL=1 makes a successor stop
/// once it holds the listeners, so that a test can kill it there.
fn debug_stall() {
    #[cfg(debug_assertions)]
    if std::env::var_os("NBDGW_DEBUG_HANDOVER_STALL").is_some() {
        warn!("debug: stalling the take-over with the listeners held (NBDGW_DEBUG_HANDOVER_STALL)");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

/// `UnixStream::connect`, but a full listen queue (EAGAIN on a
/// non-blocking connect) is retried until `within`, then TimedOut.
fn connect_within(path: &Path, within: Duration) -> std::io::Result<UnixStream> {
    use socket2::{Domain, SockAddr, Socket, Type};
    let socket = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    socket.set_nonblocking(true)?;
    let address = SockAddr::unix(path)?;
    let deadline = std::time::Instant::now() + within;
    loop {
        match socket.connect(&address) {
            Ok(()) => break,
            Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => return Err(e),
            Err(_) if std::time::Instant::now() >= deadline => {
                let why = format!(
                    "its listen queue stayed full for {} s (--handover-queue-timeout)",
                    within.as_secs()
                );
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, why));
            }
            // Rare (a queue full of successors): a short poll is enough.
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    socket.set_nonblocking(false)?;
    Ok(UnixStream::from(std::os::fd::OwnedFd::from(socket)))
}
