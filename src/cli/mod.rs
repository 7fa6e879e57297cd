//! The command line: every flag, its environment variable and its default,
//! in one place the binary, the man page and the shell completions share.

//!
//! Flags come in groups, one per subsystem (`serve`, `client`, and the
//! `shared` ones both modes flatten), each a `--help` section with its
//! own build step, so a new flag touches its group and its subsystem.

mod client;
mod serve;
mod shared;

use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

pub use client::{ClientArgs, ClientRelayArgs, ClientTlsArgs, ReconnectArgs, ServerArgs};
pub use serve::{
    AccessArgs, AdminArgs, AdmissionArgs, CacheArgs, ProxyProtocolArgs, RoutingArgs, SandboxArgs,
    ServeArgs, ServerRelayArgs, ServerShutdownArgs, ServerTlsArgs,
};
pub use shared::{
    AdminListenArgs, ClientWording, ConnectionLimitArgs, ForClient, ProcessArgs, RelayArgs,
    ShutdownArgs, TlsProtocolArgs, Wording,
};

const AFTER_HELP: &str = "\
Signals: SIGHUP re-reads the TLS files at once. SIGTERM or SIGINT stops \
accepting (after --drain-delay), lets requests in flight finish within \
--shutdown-grace, then exits 0; a second one exits 1 at once.

systemd: a listening socket passed by socket activation (LISTEN_FDS) is \
served instead of --listen; one named \"admin\" (FileDescriptorName=admin) \
serves the admin endpoints. With NOTIFY_SOCKET set, nbdgw sends READY=1 \
once it serves and STOPPING=1 when a shutdown starts (Type=notify).

Examples:
  nbdgw certs --out /etc/nbdgw/tls --server-name gateway.example
  nbdgw --tls-dir /etc/nbdgw/tls --upstream /run/nbd/disk.sock
  nbdinfo 'nbds://gateway.example/?tls-certificates=DIR'";

/// TLS gateway for the Network Block Device protocol: accepts NBD clients
/// over TCP, requires NBD_OPT_STARTTLS, and relays them to an NBD server's
/// Unix socket.
#[derive(Parser, Debug)]
#[command(
    version,
    args_conflicts_with_subcommands = true,
    after_long_help = AFTER_HELP
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Make a CA, a server certificate and client certificates in the
    /// layout qemu, nbdkit and libnbd read.
    Certs(CertsArgs),
    /// Validate a --policy file, or show what it grants one certificate,
    /// before a rollout.
    Policy(PolicyArgs),
    /// Client mode: serve plaintext NBD on a Unix socket or loopback port
    /// to local clients (the kernel's nbd-client, clients without TLS),
    /// and relay each to a remote NBD server over STARTTLS and verified
    /// TLS.
    Client(Box<ClientArgs>),
}

#[derive(Args, Debug)]
pub struct PolicyArgs {
    #[command(subcommand)]
    pub command: PolicyCommand,
}

#[derive(Subcommand, Debug)]
pub enum PolicyCommand {
    /// Parse the policy file as nbdgw would at start. Exit status 0 when
    /// it is valid; otherwise 1, with FILE:LINE:COLUMN and the problem on
    /// stderr.
    Check {
        /// The policy file (TOML).
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
    /// Show which rule decides whether the client certificate may open the
    /// export, and with what access. Exit status 0 when a rule grants it,
    /// 1 when none does, 2 on an error. The --allow-* flags, which nbdgw
    /// checks first, are not consulted.
    Explain {
        /// The policy file (TOML).
        #[arg(long, value_name = "FILE")]
        policy: PathBuf,
        /// The client certificate (PEM; the first certificate in the file).
        #[arg(long, value_name = "FILE")]
        cert: PathBuf,
        /// The export name as the client would ask for it.
        #[arg(long, value_name = "NAME")]
        export: String,
    },
}

#[derive(Args, Debug)]
pub struct CertsArgs {
    /// Directory to write into (created if missing).
    #[arg(long, env = "NBDGW_CERTS_OUT")]
    pub out: PathBuf,
    /// DNS name or IP address for the server certificate (repeatable;
    /// default localhost and 127.0.0.1).
    #[arg(long = "server-name")]
    pub server_names: Vec<String>,
    /// Common name of a client certificate (repeatable; default
    /// nbdgw-client). The first is client-cert.pem, others client-NAME-cert.pem.
    #[arg(long = "client-name")]
    pub client_names: Vec<String>,
    /// URI SAN for a client certificate, e.g. a SPIFFE ID (repeatable: the
    /// Nth goes into the Nth client certificate).
    #[arg(long = "client-uri")]
    pub client_uris: Vec<String>,
    /// Validity of the leaf certificates in days.
    #[arg(long, default_value_t = 365)]
    pub days: u32,
    /// Overwrite existing files.
    #[arg(long)]
    pub force: bool,
    /// Issue from this existing CA certificate instead of making a new CA
    /// (with --ca-key), e.g. one kept with --keep-ca-key.
    #[arg(long, requires = "ca_key", value_name = "FILE")]
    pub ca_cert: Option<PathBuf>,
    /// The key of --ca-cert.
    #[arg(long, requires = "ca_cert", value_name = "FILE")]
    pub ca_key: Option<PathBuf>,
    /// Keep the new CA's key as ca-key.pem (mode 0600), to issue more
    /// certificates from it later; without it the key is thrown away.
    #[arg(long, conflicts_with = "ca_cert")]
    pub keep_ca_key: bool,
}

impl CertsArgs {
    /// What `nbdgw certs` makes: the names given, or the defaults.
    pub fn request(self) -> crate::certs::CertsRequest {
        crate::certs::CertsRequest {
            out: self.out,
            server_names: if self.server_names.is_empty() {
                crate::certs::DEFAULT_SERVER_NAMES
                    .map(String::from)
                    .to_vec()
            } else {
                self.server_names
            },
            client_names: if self.client_names.is_empty() {
                vec![crate::certs::DEFAULT_CLIENT_NAME.to_string()]
            } else {
                self.client_names
            },
            client_uris: self.client_uris,
            days: self.days,
            force: self.force,
            ca: self.ca_cert.zip(self.ca_key),
            keep_ca_key: self.keep_ca_key,
        }
    }
}

#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum LogFormat {
    Text,
    Json,
}

/// Parses the process's arguments and environment, exiting with clap's
/// message on an error, as a command line tool should.
pub fn parse() -> Cli {
    let matches = Cli::command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    split_lists_from_the_environment(&mut cli.serve, &matches);
    cli
}

/// The clap definition, for the man page and shell completions.
pub fn command() -> clap::Command {
    Cli::command()
}

/// Names may hold commas (`CN=ACME, Backup`), so a flag's value is taken
/// whole; a variable can hold only one value, so it is a comma-separated
/// list.
pub fn split_lists_from_the_environment(args: &mut ServeArgs, matches: &ArgMatches) {
    for (id, list) in [
        ("allow_cn", &mut args.access.allow_cn),
        ("allow_dns", &mut args.access.allow_dns),
        ("allow_uri", &mut args.access.allow_uri),
    ] {
        if matches.value_source(id) == Some(ValueSource::EnvVariable) {
            *list = list
                .iter()
                .flat_map(|value| value.split(','))
                .map(|name| name.trim().to_string())
                .collect();
        }
    }
}

/// Where local clients connect: a Unix socket path or a loopback address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalAddr {
    Unix(std::path::PathBuf),
    Tcp(std::net::SocketAddr),
}

impl std::str::FromStr for LocalAddr {
    type Err = String;

    /// An address (`127.0.0.1:10809`, `[::1]:10809`, `localhost:10809`) is
    /// TCP; a path is a socket. A name with a port that is not
    /// `localhost` is refused rather than taken as a file name
    /// (`myhost:10809` would otherwise become a socket in the current
    /// directory, and nothing would listen where the operator meant).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(addr) = s.parse::<std::net::SocketAddr>() {
            return Ok(LocalAddr::Tcp(addr));
        }
        if s.contains('/') {
            return Ok(LocalAddr::Unix(std::path::PathBuf::from(s)));
        }
        match s.rsplit_once(':') {
            Some(("localhost", port)) => port
                .parse::<u16>()
                .map(|port| LocalAddr::Tcp((std::net::Ipv4Addr::LOCALHOST, port).into()))
                .map_err(|_| format!("{s}: not a port")),
            Some((_, port)) if port.parse::<u16>().is_ok() => Err(format!(
                "{s}: a TCP listen address is a loopback address (127.0.0.1:PORT, [::1]:PORT, localhost:PORT); a socket path needs a '/' (./{s})"
            )),
            _ => Ok(LocalAddr::Unix(std::path::PathBuf::from(s))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        let matches = command()
            .try_get_matches_from(std::iter::once("nbdgw").chain(args.iter().copied()))
            .unwrap();
        let mut cli = Cli::from_arg_matches(&matches).unwrap();
        split_lists_from_the_environment(&mut cli.serve, &matches);
        cli
    }

    fn every_arg(cmd: &clap::Command) -> Vec<&clap::Arg> {
        cmd.get_arguments()
            .filter(|a| a.get_env().is_some())
            .collect()
    }

    #[test]
    fn the_command_is_consistent() {
        command().debug_assert();
    }

    /// A server's environment must never configure a client, nor a
    /// client's a server: every shared flag is reworded in client mode.
    #[test]
    fn client_mode_reads_only_client_variables_and_the_server_none() {
        let root = command();
        for arg in every_arg(&root) {
            let env = arg.get_env().unwrap().to_string_lossy();
            assert!(
                env.starts_with("NBDGW_") && !env.starts_with("NBDGW_CLIENT_"),
                "--{}: {env}",
                arg.get_id()
            );
        }
        let client = root.find_subcommand("client").unwrap();
        let args = every_arg(client);
        assert_eq!(
            args.len(),
            36,
            "every client flag but --help has a variable"
        );
        for arg in args {
            let env = arg.get_env().unwrap().to_string_lossy();
            assert!(
                env.starts_with("NBDGW_CLIENT_"),
                "--{}: {env}",
                arg.get_id()
            );
        }
    }

    #[test]
    fn a_shared_flag_is_parsed_in_both_modes_and_reads_as_each_mode_says() {
        let serve = cli(&["--max-payload", "4096", "--threads", "3"]).serve;
        assert_eq!(serve.relay.common.max_payload, 4096);
        assert_eq!(serve.process.worker_threads(), 3);
        let Some(Command::Client(client)) = cli(&[
            "client",
            "--server",
            "nbd.example:10809",
            "--max-payload",
            "8192",
            "--shutdown-grace",
            "7",
        ])
        .command
        else {
            panic!("not client mode");
        };
        assert_eq!(client.relay.common.max_payload, 8192);
        assert_eq!(client.shutdown.grace(), std::time::Duration::from_secs(7));
        let root = command();
        let help = |cmd: &clap::Command, id: &str| {
            let arg = cmd.get_arguments().find(|a| a.get_id() == id).unwrap();
            arg.get_help().unwrap().to_string()
        };
        let client = root.find_subcommand("client").unwrap();
        assert_eq!(
            help(&root, "tls_min_version"),
            "Oldest TLS version accepted"
        );
        assert_eq!(
            help(client, "tls_min_version"),
            "Oldest TLS version offered to the server"
        );
        // Where the meaning is the same, so is the help.
        assert_eq!(help(&root, "max_payload"), help(client, "max_payload"));
    }

    #[test]
    fn the_help_reads_in_sections() {
        let root = command();
        let heading = |id: &str| {
            let arg = root.get_arguments().find(|a| a.get_id() == id).unwrap();
            arg.get_help_heading().map(str::to_string)
        };
        assert_eq!(heading("listen"), None);
        assert_eq!(heading("tls_groups").as_deref(), Some("TLS"));
        assert_eq!(
            heading("max_payload").as_deref(),
            Some("Relay and timeouts")
        );
        assert_eq!(heading("admin_listen").as_deref(), Some("Admin endpoints"));
        assert_eq!(heading("landlock").as_deref(), Some("Sandbox"));
        // A group flattened after a headed one does not inherit its
        // heading.
        assert_eq!(
            heading("log_format").as_deref(),
            Some("Process and logging")
        );
    }

    /// The flags take a name whole, commas and all; only a variable is a
    /// list (it holds one value). Set only here, and read by no other
    /// test's assertions.
    #[test]
    fn allow_lists_from_the_environment_are_split_and_flags_are_not() {
        std::env::set_var("NBDGW_ALLOW_DNS", "a.example, b.example,c.example");
        let serve = cli(&["--allow-cn", "ACME, Backup"]).serve;
        std::env::remove_var("NBDGW_ALLOW_DNS");
        assert_eq!(serve.access.allow_cn, ["ACME, Backup"]);
        assert_eq!(
            serve.access.allow_dns,
            ["a.example", "b.example", "c.example"]
        );
        assert!(serve.access.allow_lists());
        assert!(!cli(&[]).serve.access.allow_lists());
    }

    #[test]
    fn certs_without_names_makes_the_default_ones() {
        let Some(Command::Certs(args)) = cli(&["certs", "--out", "/tmp/x"]).command else {
            panic!("not certs");
        };
        let request = args.request();
        assert_eq!(request.server_names, crate::certs::DEFAULT_SERVER_NAMES);
        assert_eq!(request.client_names, [crate::certs::DEFAULT_CLIENT_NAME]);
        assert!(request.ca.is_none());
        let Some(Command::Certs(args)) = cli(&[
            "certs",
            "--out",
            "/tmp/x",
            "--server-name",
            "gw.example",
            "--client-name",
            "backup",
        ])
        .command
        else {
            panic!("not certs");
        };
        let request = args.request();
        assert_eq!(request.server_names, ["gw.example"]);
        assert_eq!(request.client_names, ["backup"]);
    }
}
