//! Flag groups both modes take, each declared once: the server flattens
//! them as they are, client mode through [`ForClient`], which gives each
//! flag its `NBDGW_CLIENT_*` variable and, where the meaning reads
//! differently from a client's side, its own help. The type, parser,
//! default and build step stay one.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{ArgMatches, Args, FromArgMatches};

use super::LogFormat;
use crate::config::{self, seconds_or_off, Keepalive, RelayLimits};
use crate::tls::MinVersion;

/// How one shared flag reads in client mode: its variable (a server's
/// environment must never configure a client by accident) and, where it
/// differs, its help.
pub struct Wording {
    /// The flag's id (its field name).
    pub id: &'static str,
    pub env: &'static str,
    /// `None`: the same help as the server's.
    pub help: Option<&'static str>,
}

/// A shared group's client-mode wording, one entry for each of its flags.
pub trait ClientWording {
    const CLIENT: &'static [Wording];
}

/// A shared group as client mode takes it: the same fields, reworded by
/// [`ClientWording`] when clap builds the command.
#[derive(Debug)]
pub struct ForClient<T>(pub T);

impl<T> std::ops::Deref for ForClient<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: FromArgMatches> FromArgMatches for ForClient<T> {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        T::from_arg_matches(matches).map(ForClient)
    }
    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        self.0.update_from_arg_matches(matches)
    }
}

impl<T: Args + ClientWording> Args for ForClient<T> {
    fn group_id() -> Option<clap::Id> {
        T::group_id()
    }
    fn augment_args(cmd: clap::Command) -> clap::Command {
        reword(T::augment_args(cmd), T::CLIENT)
    }
    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        reword(T::augment_args_for_update(cmd), T::CLIENT)
    }
}

/// `mut_arg` panics on an id the group lacks, so a wording left behind
/// by a renamed flag fails every test that builds the command.
fn reword(mut cmd: clap::Command, words: &[Wording]) -> clap::Command {
    for word in words {
        cmd = cmd.mut_arg(word.id, |arg| match word.help {
            // The long help too: a server doc comment of two paragraphs
            // would otherwise show in client mode's `--help`.
            Some(help) => arg.env(word.env).help(help).long_help(None::<&str>),
            None => arg.env(word.env),
        });
    }
    cmd
}

/// TLS protocol settings both modes take (the files differ: a server's
/// certificate, a client's CA), each given once.
#[derive(Args, Debug)]
pub struct TlsProtocolArgs {
    /// Oldest TLS version accepted.
    #[arg(long, env = "NBDGW_TLS_MIN_VERSION", value_enum, default_value = "1.2")]
    pub tls_min_version: MinVersion,
    /// Key exchange groups accepted, comma-separated, as rustls and
    /// OpenSSL name them: X25519MLKEM768 (hybrid post-quantum),
    /// secp256r1MLKEM768, X25519, secp256r1 (P-256), secp384r1 (P-384),
    /// MLKEM768, MLKEM1024. The client's order picks among them (rustls);
    /// GnuTLS clients offer no hybrid and get a classical group.
    #[arg(long, env = "NBDGW_TLS_GROUPS", value_name = "GROUPS", default_value = crate::tls::groups::DEFAULT_GROUPS, value_parser = crate::tls::KxGroups::parse)]
    pub tls_groups: crate::tls::KxGroups,
    /// Seconds between looks at the TLS files for changes; 0 reloads only
    /// on SIGHUP.
    #[arg(long, env = "NBDGW_TLS_RELOAD_INTERVAL", default_value_t = 5)]
    pub tls_reload_interval: u64,
}

impl ClientWording for TlsProtocolArgs {
    const CLIENT: &'static [Wording] = &[
        Wording {
            id: "tls_min_version",
            env: "NBDGW_CLIENT_TLS_MIN_VERSION",
            help: Some("Oldest TLS version offered to the server"),
        },
        Wording {
            id: "tls_groups",
            env: "NBDGW_CLIENT_TLS_GROUPS",
            help: Some("Key exchange groups offered to the server, most preferred first, comma-separated, as rustls and OpenSSL name them: X25519MLKEM768 (hybrid post-quantum), secp256r1MLKEM768, X25519, secp256r1 (P-256), secp384r1 (P-384), MLKEM768, MLKEM1024. The first gets a key share in the ClientHello (with the default order, a hybrid's X25519 half too); a server with neither costs a HelloRetryRequest. Pure ML-KEM groups are an expert's choice (a warning at start)"),
        },
        Wording {
            id: "tls_reload_interval",
            env: "NBDGW_CLIENT_TLS_RELOAD_INTERVAL",
            help: Some("Seconds between looks at the TLS files for changes (a new CA bundle or client certificate is used by new connections); 0 reloads only on SIGHUP"),
        },
    ];
}

/// What the relay allows a connection, and when it gives up on one.
#[derive(Args, Debug)]
pub struct RelayArgs {
    /// Seconds a connection may sit with no request in flight and no reply
    /// being written, counted from the last reply's last byte; 0 never
    /// closes it (VM disks can be idle for hours).
    #[arg(long, env = "NBDGW_IDLE_TIMEOUT", default_value_t = 0)]
    pub idle_timeout: u64,
    /// Seconds a started request payload, or a reply the client does not
    /// read, may make no progress before the connection is closed; also
    /// the TCP_USER_TIMEOUT for unacknowledged data. 0: never.
    #[arg(long, env = "NBDGW_STALL_TIMEOUT", default_value_t = config::DEFAULT_STALL_TIMEOUT_SECS)]
    pub stall_timeout: u64,
    /// Seconds of silence before TCP keepalive probes a client; 0 turns
    /// keepalive off. A client that powered off is closed after about
    /// IDLE + INTERVAL x COUNT seconds.
    #[arg(long, env = "NBDGW_TCP_KEEPALIVE", value_name = "IDLE", default_value_t = config::DEFAULT_KEEPALIVE_IDLE_SECS)]
    pub tcp_keepalive: u64,
    /// Largest request payload and read length in bytes.
    #[arg(long, env = "NBDGW_MAX_PAYLOAD", default_value_t = crate::proto::consts::DEFAULT_MAX_PAYLOAD)]
    pub max_payload: u32,
    /// Largest option data (and option reply) in bytes.
    #[arg(long, env = "NBDGW_MAX_OPTION_LEN", default_value_t = config::DEFAULT_MAX_OPTION_LEN)]
    pub max_option_len: u32,
}

impl ClientWording for RelayArgs {
    const CLIENT: &'static [Wording] = &[
        Wording {
            id: "idle_timeout",
            env: "NBDGW_CLIENT_IDLE_TIMEOUT",
            help: Some("Seconds a connection may sit with no request in flight; 0 never closes it"),
        },
        Wording {
            id: "stall_timeout",
            env: "NBDGW_CLIENT_STALL_TIMEOUT",
            help: Some("Seconds a started request payload or an unread reply may make no progress before the connection is closed; also the server connection's TCP_USER_TIMEOUT. 0: never"),
        },
        Wording {
            id: "tcp_keepalive",
            env: "NBDGW_CLIENT_TCP_KEEPALIVE",
            help: Some("Seconds of silence before TCP keepalive probes the server; 0 turns keepalive off"),
        },
        Wording {
            id: "max_payload",
            env: "NBDGW_CLIENT_MAX_PAYLOAD",
            help: None,
        },
        Wording {
            id: "max_option_len",
            env: "NBDGW_CLIENT_MAX_OPTION_LEN",
            help: None,
        },
    ];
}

/// How many connections are served at once.
#[derive(Args, Debug)]
pub struct ConnectionLimitArgs {
    /// Most client connections served at once; more are closed at accept.
    #[arg(long, env = "NBDGW_MAX_CONNECTIONS", default_value_t = config::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
}

impl ClientWording for ConnectionLimitArgs {
    const CLIENT: &'static [Wording] = &[Wording {
        id: "max_connections",
        env: "NBDGW_CLIENT_MAX_CONNECTIONS",
        help: Some("Most local connections served at once; more are closed at accept"),
    }];
}

/// Where the admin endpoints listen.
#[derive(Args, Debug)]
pub struct AdminListenArgs {
    /// Plain-HTTP admin endpoints (/healthz, /readyz, /metrics) on this
    /// address, meant for localhost or the pod network; off by default.
    #[arg(long, env = "NBDGW_ADMIN_LISTEN", value_name = "HOST:PORT")]
    pub admin_listen: Option<SocketAddr>,
}

impl ClientWording for AdminListenArgs {
    const CLIENT: &'static [Wording] = &[
        Wording {
            id: "admin_listen",
            env: "NBDGW_CLIENT_ADMIN_LISTEN",
            help: Some("Plain-HTTP admin endpoints (/healthz, /readyz, /server, /metrics) on this address, as the server mode's; off by default. /readyz fails while the last try to reach the server failed; /server fails while a --reconnect connection is reconnecting (/readyz stays ready)"),
        },
    ];
}

/// What SIGTERM leaves to connections in flight.
#[derive(Args, Debug)]
pub struct ShutdownArgs {
    /// Seconds open connections may finish after SIGTERM or SIGINT.
    #[arg(long, env = "NBDGW_SHUTDOWN_GRACE", default_value_t = config::DEFAULT_SHUTDOWN_GRACE_SECS)]
    pub shutdown_grace: u64,
    /// While draining, a request that arrives after the drain began:
    /// close (unanswered; the connection closes once every earlier request
    /// is answered, so qemu's reconnect-delay sends it again) or eshutdown
    /// (answered ESHUTDOWN, which qemu hands to the guest).
    #[arg(long, env = "NBDGW_DRAIN_ANSWER", value_enum, default_value_t = crate::shutdown::DrainAnswer::Close)]
    pub drain_answer: crate::shutdown::DrainAnswer,
}

impl ClientWording for ShutdownArgs {
    const CLIENT: &'static [Wording] = &[
        Wording {
            id: "shutdown_grace",
            env: "NBDGW_CLIENT_SHUTDOWN_GRACE",
            help: None,
        },
        Wording {
            id: "drain_answer",
            env: "NBDGW_CLIENT_DRAIN_ANSWER",
            help: Some("While draining, a local request that arrives after the drain began: close (unanswered; the connection closes once every earlier request is answered) or eshutdown (answered ESHUTDOWN)"),
        },
    ];
}

/// The process: worker threads and log format.
#[derive(Args, Debug)]
pub struct ProcessArgs {
    /// Worker threads; 0 means one per CPU. In a container, match the CPU
    /// limit.
    #[arg(long, env = "NBDGW_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Log format; the filter comes from RUST_LOG (default info).
    #[arg(long, env = "NBDGW_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

impl ClientWording for ProcessArgs {
    const CLIENT: &'static [Wording] = &[
        Wording {
            id: "threads",
            env: "NBDGW_CLIENT_THREADS",
            help: Some("Worker threads; 0 means one per CPU"),
        },
        Wording {
            id: "log_format",
            env: "NBDGW_CLIENT_LOG_FORMAT",
            help: None,
        },
    ];
}

impl TlsProtocolArgs {
    /// `--tls-reload-interval`: 0 reloads only on SIGHUP.
    pub fn reload_interval(&self) -> Option<Duration> {
        seconds_or_off(self.tls_reload_interval)
    }
}

impl RelayArgs {
    /// The relay's bounds; `interval` and `count` are the keepalive
    /// probes' (the server's flags, client mode's defaults).
    pub fn limits(&self, interval: Duration, count: u32) -> RelayLimits {
        RelayLimits {
            idle_timeout: seconds_or_off(self.idle_timeout),
            stall_timeout: seconds_or_off(self.stall_timeout),
            keepalive: seconds_or_off(self.tcp_keepalive).map(|idle| Keepalive {
                idle,
                interval,
                count,
            }),
            max_payload: self.max_payload,
            max_option_len: self.max_option_len,
        }
    }
}

impl ShutdownArgs {
    pub fn grace(&self) -> Duration {
        Duration::from_secs(self.shutdown_grace)
    }
}

impl ProcessArgs {
    /// `--threads`: 0 is one per CPU.
    pub fn worker_threads(&self) -> usize {
        match self.threads {
            0 => std::thread::available_parallelism().map_or(1, usize::from),
            n => n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every flag of a shared group has client mode's wording: one left
    /// out would read a server's variable.
    fn worded<T: Args + ClientWording>() {
        let cmd = T::augment_args(clap::Command::new("t"));
        let ids: Vec<&str> = cmd
            .get_arguments()
            .filter(|a| a.get_env().is_some())
            .map(|a| a.get_id().as_str())
            .collect();
        let worded: Vec<&str> = T::CLIENT.iter().map(|w| w.id).collect();
        assert_eq!(ids, worded);
    }

    #[test]
    fn every_shared_flag_has_its_client_wording() {
        worded::<TlsProtocolArgs>();
        worded::<RelayArgs>();
        worded::<ConnectionLimitArgs>();
        worded::<AdminListenArgs>();
        worded::<ShutdownArgs>();
        worded::<ProcessArgs>();
    }

    fn relay(idle: u64, stall: u64, keepalive: u64) -> RelayArgs {
        RelayArgs {
            idle_timeout: idle,
            stall_timeout: stall,
            tcp_keepalive: keepalive,
            max_payload: 4096,
            max_option_len: 512,
        }
    }

    #[test]
    fn zero_turns_a_relay_timeout_and_keepalive_off() {
        let limits = relay(0, 0, 0).limits(Duration::from_secs(10), 6);
        assert_eq!(limits.idle_timeout, None);
        assert_eq!(limits.stall_timeout, None);
        assert_eq!(limits.keepalive, None);
        assert_eq!((limits.max_payload, limits.max_option_len), (4096, 512));
    }

    #[test]
    fn relay_timeouts_and_keepalive_in_seconds() {
        let limits = relay(300, 60, 30).limits(Duration::from_secs(5), 3);
        assert_eq!(limits.idle_timeout, Some(Duration::from_secs(300)));
        assert_eq!(limits.stall_timeout, Some(Duration::from_secs(60)));
        assert_eq!(
            limits.keepalive,
            Some(Keepalive {
                idle: Duration::from_secs(30),
                interval: Duration::from_secs(5),
                count: 3,
            })
        );
    }

    #[test]
    fn zero_threads_is_one_per_cpu() {
        let process = |threads| ProcessArgs {
            threads,
            log_format: LogFormat::Text,
        };
        assert_eq!(process(3).worker_threads(), 3);
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        assert_eq!(process(0).worker_threads(), cpus);
    }

    #[test]
    fn a_zero_reload_interval_reloads_only_on_sighup() {
        let tls = |secs| TlsProtocolArgs {
            tls_min_version: MinVersion::Tls12,
            tls_groups: crate::tls::KxGroups::parse(crate::tls::groups::DEFAULT_GROUPS).unwrap(),
            tls_reload_interval: secs,
        };
        assert_eq!(tls(0).reload_interval(), None);
        assert_eq!(tls(5).reload_interval(), Some(Duration::from_secs(5)));
    }
}
