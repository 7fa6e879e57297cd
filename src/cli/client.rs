//! `nbdgw client`'s flags: its own groups (the server it reaches, its TLS
//! files, `--reconnect`) and the shared ones, flattened through
//! [`ForClient`] so that each variable is `NBDGW_CLIENT_*`.

use std::path::PathBuf;

use clap::Args;

use super::shared::{
    AdminListenArgs, ClientWording, ConnectionLimitArgs, ForClient, ProcessArgs, RelayArgs,
    ShutdownArgs, TlsProtocolArgs, Wording,
};
use super::LocalAddr;

const CLIENT_AFTER_HELP: &str = "\
The server's certificate must chain to the CA (ca-cert.pem in --tls-dir, \
or --tls-ca) and carry the --server host (or --server-name) as a DNS or IP \
SAN; there is no way to turn verification off. A client certificate \
(client-cert.pem and client-key.pem) is presented when there is one.

Signals: SIGHUP re-reads the TLS files at once. SIGTERM or SIGINT stops \
accepting, lets requests in flight finish within --shutdown-grace, then \
exits 0.

Examples:
  nbdgw client --server nbd.example:10809 --tls-dir /etc/nbdgw/client
  nbd-client -unix /run/nbdgw-client.sock /dev/nbd0 -N disk0
  qemu-img info 'nbd+unix:///disk0?socket=/run/nbdgw-client.sock'";

/// `nbdgw client`'s flags; their variables are NBDGW_CLIENT_*, so that a
/// server's environment never configures a client by accident.
#[derive(Args, Debug)]
#[command(after_long_help = CLIENT_AFTER_HELP)]
pub struct ClientArgs {
    /// Where local clients connect: a Unix socket path, or a loopback
    /// HOST:PORT (the local side is plaintext, so no other address is
    /// accepted).
    #[arg(
        long,
        env = "NBDGW_CLIENT_LISTEN",
        value_name = "PATH|HOST:PORT",
        default_value = "/run/nbdgw-client.sock"
    )]
    pub listen: LocalAddr,
    #[command(flatten, next_help_heading = "Server")]
    pub server: ServerArgs,
    #[command(flatten, next_help_heading = "TLS")]
    pub tls: ClientTlsArgs,
    #[command(flatten, next_help_heading = "Reconnect")]
    pub reconnect: ReconnectArgs,
    #[command(flatten, next_help_heading = "Relay and timeouts")]
    pub relay: ClientRelayArgs,
    #[command(flatten, next_help_heading = "Admission")]
    pub connections: ForClient<ConnectionLimitArgs>,
    #[command(flatten, next_help_heading = "Admin endpoints")]
    pub admin: ForClient<AdminListenArgs>,
    #[command(flatten, next_help_heading = "Shutdown")]
    pub shutdown: ForClient<ShutdownArgs>,
    /// The server mode's hand-over flags: a successor `nbdgw client
    /// --take-over PATH` takes the local listener and every established
    /// session (--handover-fdstore is refused in client mode).
    #[command(flatten, next_help_heading = "Hand-over to a successor process")]
    pub handover: ForClient<crate::handover::HandoverArgs>,
    #[command(flatten, next_help_heading = "Process and logging")]
    pub process: ForClient<ProcessArgs>,
}

/// The remote server and the name its certificate must carry.
#[derive(Args, Debug)]
pub struct ServerArgs {
    /// The remote NBD server (TLS with STARTTLS), e.g. nbd.example:10809
    /// or [2001:db8::1]:10809.
    #[arg(long, env = "NBDGW_CLIENT_SERVER", value_name = "HOST:PORT")]
    pub server: String,
    /// The name the server's certificate must carry (a DNS or IP SAN);
    /// default: the host of --server.
    #[arg(long, env = "NBDGW_CLIENT_SERVER_NAME", value_name = "NAME")]
    pub server_name: Option<String>,
    /// Seconds the server may take to accept, greet and finish TLS, and
    /// then to answer each option; a local client then hears why.
    /// Keep it below --handshake-timeout.
    #[arg(long, env = "NBDGW_CLIENT_SERVER_TIMEOUT", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub server_timeout: u64,
}

/// The CA the server must chain to, the client certificate, and the TLS
/// protocol.
#[derive(Args, Debug)]
pub struct ClientTlsArgs {
    /// Directory with the CA and the client certificate: the layout of
    /// libnbd and qemu (ca-cert.pem, client-cert.pem, client-key.pem,
    /// optionally ca-crl.pem) or a Kubernetes TLS Secret (ca.crt, tls.crt,
    /// tls.key). Files named by the other --tls-* flags take precedence.
    #[arg(long, env = "NBDGW_CLIENT_TLS_DIR", value_name = "DIR")]
    pub tls_dir: Option<PathBuf>,
    /// CA bundle (PEM) the server's certificate must chain to.
    #[arg(long, env = "NBDGW_CLIENT_TLS_CA", value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate chain (PEM) to present.
    #[arg(
        long,
        env = "NBDGW_CLIENT_TLS_CERT",
        value_name = "FILE",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(
        long,
        env = "NBDGW_CLIENT_TLS_KEY",
        value_name = "FILE",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    #[command(flatten)]
    pub protocol: ForClient<TlsProtocolArgs>,
}

/// `--reconnect`: local connections kept across a drop of the server's.
#[derive(Args, Debug)]
pub struct ReconnectArgs {
    /// Keep local connections when the server's connection drops:
    /// reconnect, open the same export (its size and flags checked
    /// unchanged) and send the requests in flight again, in order.
    #[arg(long, env = "NBDGW_CLIENT_RECONNECT")]
    pub reconnect: bool,
    /// Seconds from a drop --reconnect waits for a server connection that
    /// answers before the requests in flight fail with EIO; new ones then
    /// fail at once until the server answers again (tries go on).
    #[arg(long, env = "NBDGW_CLIENT_RECONNECT_TIMEOUT", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub reconnect_timeout: u64,
    /// Bytes of requests in flight (write payloads included) --reconnect
    /// keeps per connection until they are answered; beyond it new
    /// requests wait. One request is always let through.
    #[arg(long, env = "NBDGW_CLIENT_REPLAY_BUFFER", value_name = "BYTES", default_value_t = 64 * 1024 * 1024)]
    pub replay_buffer: usize,
    /// Bytes of structured replies --reconnect holds per connection until
    /// their last chunk has come, so that a reply cut by a drop is asked
    /// again whole instead of ending in EIO. A reply beyond it goes up as
    /// it comes (and, if cut, ends in EIO).
    #[arg(long, env = "NBDGW_CLIENT_REPLY_BUFFER", value_name = "BYTES", default_value_t = 64 * 1024 * 1024)]
    pub reply_buffer: usize,
}

/// Client mode's relay: the local negotiation bound and the shared relay
/// limits.
#[derive(Args, Debug)]
pub struct ClientRelayArgs {
    /// Seconds a local client has from connecting to finishing negotiation.
    #[arg(long, env = "NBDGW_CLIENT_HANDSHAKE_TIMEOUT", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub handshake_timeout: u64,
    #[command(flatten)]
    pub common: ForClient<RelayArgs>,
}

impl ClientRelayArgs {
    /// Client mode has no keepalive interval or count flags: the
    /// defaults, with `--tcp-keepalive` the idle time.
    pub fn limits(&self) -> crate::config::RelayLimits {
        let probes = crate::config::Keepalive::default();
        self.common.limits(probes.interval, probes.count)
    }
}

/// The hand-over's flags as client mode reads them (its own variables:
/// a server's environment never configures a client).
impl ClientWording for crate::handover::HandoverArgs {
    const CLIENT: &'static [Wording] = &[
        Wording {
            id: "handover_socket",
            env: "NBDGW_CLIENT_HANDOVER_SOCKET",
            help: Some("Listen on this Unix socket for a successor (nbdgw client --take-over PATH): it is given the local listener (and the admin one) and every established local session with its remote TLS session; this process then drains what it kept and exits 0. Created 0600, as the server mode's. Off by default"),
        },
        Wording {
            id: "take_over",
            env: "NBDGW_CLIENT_TAKE_OVER",
            help: Some("Start as the successor of the nbdgw client listening on this hand-over socket (same uid): take its local listener and its sessions, each judged against this process's --server, --server-name, CA and CRL files. A server-mode nbdgw is refused (no state version in common)"),
        },
        Wording {
            id: "handover_timeout",
            env: "NBDGW_CLIENT_HANDOVER_TIMEOUT",
            help: None,
        },
        Wording {
            id: "handover_queue_timeout",
            env: "NBDGW_CLIENT_HANDOVER_QUEUE_TIMEOUT",
            help: None,
        },
        Wording {
            id: "handover_quiesce_timeout",
            env: "NBDGW_CLIENT_HANDOVER_QUIESCE_TIMEOUT",
            help: Some("Seconds a session being handed to a successor may take to go quiet: it stops reading local requests at a request boundary and the remote server's replies to those in flight finish. One that is not quiet in time stays here and drains"),
        },
        Wording {
            id: "handover_max_key_generations",
            env: "NBDGW_CLIENT_HANDOVER_MAX_KEY_GENERATIONS",
            help: None,
        },
        Wording {
            id: "take_over_missing",
            env: "NBDGW_CLIENT_TAKE_OVER_MISSING",
            help: Some("What --take-over does when no nbdgw client is there to take over: `fail` the start (the default), or `start` fresh, but only when nothing is at PATH or nothing listens there. One that answers and refuses, or a hand-over that fails part-way, fails the start either way"),
        },
        Wording {
            id: "after_handover",
            env: "NBDGW_CLIENT_AFTER_HANDOVER",
            help: Some("Only `exit` (the default) in client mode: `wait` is the server's, for a Kubernetes node gateway, and is refused at start"),
        },
        Wording {
            id: "handover_fdstore",
            env: "NBDGW_CLIENT_HANDOVER_FDSTORE",
            help: Some("Not supported by nbdgw client: refused at start (use --handover-socket and --take-over)"),
        },
    ];
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::{CommandFactory, FromArgMatches};

    use super::*;

    fn client(args: &[&str]) -> ClientArgs {
        let all = ["nbdgw", "client", "--server", "nbd.example:10809"];
        let matches = crate::cli::Cli::command()
            .try_get_matches_from(all.iter().chain(args))
            .unwrap();
        match crate::cli::Cli::from_arg_matches(&matches).unwrap().command {
            Some(crate::cli::Command::Client(args)) => *args,
            _ => panic!("not client mode"),
        }
    }

    #[test]
    fn client_mode_keepalive_has_the_default_probes_and_its_own_idle() {
        let relay = client(&["--tcp-keepalive", "15"]).relay.limits();
        let keepalive = relay.keepalive.unwrap();
        assert_eq!(keepalive.idle, Duration::from_secs(15));
        let defaults = crate::config::Keepalive::default();
        assert_eq!(
            (keepalive.interval, keepalive.count),
            (defaults.interval, defaults.count)
        );
        assert_eq!(
            client(&["--tcp-keepalive", "0"]).relay.limits().keepalive,
            None
        );
    }

    #[test]
    fn reconnect_settings_only_with_reconnect() {
        assert!(client(&[]).reconnect.settings().is_none());
        let reconnect = client(&[
            "--reconnect",
            "--reconnect-timeout",
            "9",
            "--replay-buffer",
            "1024",
        ])
        .reconnect
        .settings()
        .unwrap();
        assert_eq!(reconnect.timeout, Duration::from_secs(9));
        assert_eq!(reconnect.replay_buffer, 1024);
        assert_eq!(reconnect.reply_buffer, 64 * 1024 * 1024);
    }

    #[test]
    fn client_tls_takes_the_shared_protocol_flags() {
        let tls = client(&["--tls-min-version", "1.3", "--tls-ca", "/ca.pem"]).tls;
        assert_eq!(tls.policy().min_version, crate::tls::MinVersion::Tls13);
        assert_eq!(tls.sources().ca, Some(PathBuf::from("/ca.pem")));
    }
}
