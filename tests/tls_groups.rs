//! Key exchange groups (`--tls-groups`): `nbdgw client` to an nbdgw
//! server negotiates the hybrid X25519MLKEM768 by default, as both ends'
//! logs and metrics say; GnuTLS clients (qemu-img, libnbd's nbdinfo),
//! which offer no hybrid, still connect with a classical group; a server
//! without the hybrid still takes client mode (after a HelloRetryRequest
//! when it lacks X25519 too); unknown names stop the start.

mod common;

use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;

use common::clients::{nbdinfo_size, qemu_img_info, text};
use common::metrics::{sample, scrape};
use common::process::{start_must_fail, NbdgwProcess};
use common::{free_port, pattern, run_ok, unix_uri, Env, QemuNbd};

const SIZE: usize = 1 << 20;

fn sessions_with(group: &str) -> String {
    format!("nbdgw_tls_sessions_total{{key_exchange=\"{group}\"}}")
}

/// The nbdgw server in front of `upstream`, with an admin listener.
fn server(env: &Env, upstream: &Path, admin: u16, extra: &[&str]) -> NbdgwProcess {
    server_in(&env.certs(), upstream, admin, extra)
}

/// [`server`] with its certificates from `certs`.
fn server_in(certs: &Path, upstream: &Path, admin: u16, extra: &[&str]) -> NbdgwProcess {
    let admin = format!("127.0.0.1:{admin}");
    let flags = ["--admin-listen", &admin, "--landlock", "false"];
    let args: Vec<&str> = flags.into_iter().chain(extra.iter().copied()).collect();
    NbdgwProcess::in_front_of_certs(certs, upstream, &args)
}

/// `nbdgw client` on a Unix socket towards `server`, with an admin
/// listener.
fn client_mode(env: &Env, server: &NbdgwProcess, admin: u16, extra: &[&str]) -> NbdgwProcess {
    client_mode_in(env, &env.certs(), server, admin, extra)
}

/// [`client_mode`] with its certificates from `certs`.
fn client_mode_in(
    env: &Env,
    certs: &Path,
    server: &NbdgwProcess,
    admin: u16,
    extra: &[&str],
) -> NbdgwProcess {
    let socket = env.path("client.sock");
    let target = format!("localhost:{}", server.port);
    let admin = format!("127.0.0.1:{admin}");
    let args: Vec<&str> = ["--admin-listen", &admin]
        .into_iter()
        .chain(extra.iter().copied())
        .collect();
    NbdgwProcess::client_of(socket.as_os_str(), &target, certs, &args)
}

/// nbdcopy through client mode's socket reads the image.
fn copy_through(env: &Env, client: &NbdgwProcess) {
    let copy = env.path("copy.img");
    let _ = std::fs::remove_file(&copy);
    let uri = unix_uri(&env.path("client.sock"));
    let out = run_ok(Command::new("nbdcopy").arg(&uri).arg(&copy));
    assert!(out.status.success(), "{}\n{}", text(&out), client.log());
    assert_eq!(std::fs::read(&copy).unwrap(), pattern(SIZE, 31));
}

/// The `TLS established` lines of a log.
fn tls_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains("TLS established"))
        .collect()
}

#[test]
fn client_mode_and_server_negotiate_x25519mlkem768_by_default() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 31);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let (server_admin, client_admin) = (free_port(), free_port());
    let server = server(&env, &upstream.socket, server_admin, &[]);
    let client = client_mode(&env, &server, client_admin, &[]);
    copy_through(&env, &client);

    // Both ends say so, each from its own side of the handshake.
    let hybrid = "key_exchange=X25519MLKEM768";
    for (who, log) in [("server", server.log()), ("client mode", client.log())] {
        let lines = tls_lines(&log);
        assert!(!lines.is_empty(), "{who} logged no TLS session:\n{log}");
        assert!(
            lines.iter().all(|l| l.contains(hybrid)),
            "{who} did not negotiate X25519MLKEM768:\n{}",
            lines.join("\n")
        );
    }
    let hybrid = sessions_with("X25519MLKEM768");
    assert!(sample(&scrape(server_admin), &hybrid) >= 1.0);
    assert!(sample(&scrape(client_admin), &hybrid) >= 1.0);
    assert!(!scrape(server_admin).contains("key_exchange=\"X25519\""));
}

#[test]
fn gnutls_clients_still_connect_with_a_classical_group() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 31);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let admin = free_port();
    let server = server(&env, &upstream.socket, admin, &[]);

    let out = qemu_img_info(server.port, &env.certs());
    assert!(out.status.success(), "qemu-img: {}", text(&out));
    let out = nbdinfo_size(server.port, &env.certs());
    assert!(out.status.success(), "nbdinfo: {}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        SIZE.to_string()
    );

    server.wait_for_log("TLS established", 2);
    let log = server.log();
    let lines = tls_lines(&log);
    assert_eq!(lines.len(), 2, "{log}");
    let classical = ["X25519", "secp256r1", "secp384r1"];
    for line in &lines {
        assert!(
            classical
                .iter()
                .any(|g| line.contains(&format!("key_exchange={g} "))),
            "a GnuTLS client with a group other than a classical one: {line}"
        );
    }
    let metrics = scrape(admin);
    let counted: f64 = classical
        .iter()
        .filter_map(|g| {
            let name = sessions_with(g);
            metrics.contains(&name).then(|| sample(&metrics, &name))
        })
        .sum();
    assert_eq!(counted, 2.0, "{metrics}");
    assert!(!metrics.contains("MLKEM"), "{metrics}");
}

#[test]
fn a_server_without_the_hybrid_still_takes_client_mode() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 31);
    let upstream = QemuNbd::start(&env, &image, &[]);
    // X25519: client mode's ClientHello carries an X25519 share beside
    // the hybrid's, so no retry. secp384r1: a HelloRetryRequest first.
    for group in ["X25519", "secp384r1"] {
        let (server_admin, client_admin) = (free_port(), free_port());
        let server = server(
            &env,
            &upstream.socket,
            server_admin,
            &["--tls-groups", group],
        );
        let client = client_mode(&env, &server, client_admin, &[]);
        copy_through(&env, &client);
        let expected = format!("key_exchange={group} ");
        for (who, log) in [("server", server.log()), ("client mode", client.log())] {
            let lines = tls_lines(&log);
            assert!(
                !lines.is_empty() && lines.iter().all(|l| l.contains(&expected)),
                "{who} with a {group}-only server:\n{log}"
            );
        }
        assert!(sample(&scrape(client_admin), &sessions_with(group)) >= 1.0);
    }
}

#[test]
fn client_mode_offers_the_groups_it_is_given() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 31);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let (server_admin, client_admin) = (free_port(), free_port());
    let server = server(&env, &upstream.socket, server_admin, &[]);
    // OpenSSL's spelling of P-256.
    let client = client_mode(&env, &server, client_admin, &["--tls-groups", "P-256"]);
    copy_through(&env, &client);
    assert!(sample(&scrape(server_admin), &sessions_with("secp256r1")) >= 1.0);
    assert!(tls_lines(&client.log())
        .iter()
        .all(|l| l.contains("key_exchange=secp256r1 ")));
}

#[test]
fn unknown_or_unusable_groups_stop_the_start() {
    let env = Env::new();
    let certs = env.certs();
    let upstream = env.path("none.sock");
    let serve = |groups: &str, extra: &[&str]| {
        let mut args = vec![
            OsStr::new("--upstream"),
            upstream.as_os_str(),
            OsStr::new("--tls-dir"),
            certs.as_os_str(),
            OsStr::new("--tls-groups"),
            OsStr::new(groups),
        ];
        args.extend(extra.iter().map(OsStr::new));
        start_must_fail(args)
    };
    let err = serve("X25519MLKEM768,X448", &[]);
    assert!(
        err.contains("unknown key exchange group \"X448\"") && err.contains("known: "),
        "{err}"
    );
    let err = serve("X25519,x25519", &[]);
    assert!(err.contains("listed twice"), "{err}");
    let err = serve("X25519MLKEM768", &[]);
    assert!(
        err.contains("has no group TLS 1.2 can use") && err.contains("--tls-min-version 1.3"),
        "{err}"
    );

    let client = |groups: &str| {
        start_must_fail([
            OsStr::new("client"),
            OsStr::new("--server"),
            OsStr::new("localhost:10809"),
            OsStr::new("--tls-dir"),
            certs.as_os_str(),
            OsStr::new("--tls-groups"),
            OsStr::new(groups),
        ])
    };
    let err = client("X25519Kyber768Draft00");
    assert!(
        err.contains("unknown key exchange group \"X25519Kyber768Draft00\""),
        "{err}"
    );
    let err = client("MLKEM768");
    assert!(err.contains("has no group TLS 1.2 can use"), "{err}");
    // A group error, not one of the TLS files'.
    assert!(!err.contains("TLS files"), "{err}");
    let err = client("");
    assert!(err.contains("empty group list"), "{err}");
}

/// `nbdgw certs` into `out` from the CA kept in `ca`.
fn issue_from(ca: &Path, out: &Path, force: bool) {
    let mut cmd = Command::new(common::process::nbdgw_binary());
    cmd.arg("certs").arg("--out").arg(out);
    cmd.arg("--ca-cert").arg(ca.join("ca-cert.pem"));
    cmd.arg("--ca-key").arg(ca.join("ca-key.pem"));
    if force {
        cmd.arg("--force");
    }
    let out = run_ok(&mut cmd);
    assert!(out.status.success(), "{}", text(&out));
}

/// The line of `log` that says `needle`, the last if several.
fn line_with<'a>(log: &'a str, needle: &str) -> &'a str {
    log.lines()
        .rev()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no {needle:?} line in:\n{log}"))
}

#[test]
fn groups_survive_a_certificate_reload_on_both_sides() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 31);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let (ca, live) = (env.path("ca"), env.path("live"));
    keep_a_ca(&ca);
    issue_from(&ca, &live, false);
    let (server_admin, client_admin) = (free_port(), free_port());
    let no_poll = ["--tls-reload-interval", "0"];
    let server = server_in(
        &live,
        &upstream.socket,
        server_admin,
        &[&no_poll[..], &["--tls-groups", "secp384r1"]].concat(),
    );
    let client = client_mode_in(
        &env,
        &live,
        &server,
        client_admin,
        &[&no_poll[..], &["--tls-groups", "P-256,secp384r1"]].concat(),
    );
    // The effective groups are in each side's start lines.
    let loaded = line_with(&server.log(), "TLS certificate loaded").to_string();
    assert!(loaded.contains("groups=secp384r1"), "{loaded}");
    let listening = line_with(&client.log(), "nbdgw client listening").to_string();
    assert!(
        listening.contains("groups=secp256r1,secp384r1"),
        "{listening}"
    );
    copy_through(&env, &client);
    let before = tls_lines(&server.log()).len();

    // New certificates from the same CA, then SIGHUP to both.
    issue_from(&ca, &live, true);
    server.signal("HUP");
    client.signal("HUP");
    server.wait_for_log("TLS certificate reloaded", 1);
    client.wait_for_log("client TLS reloaded", 1);
    let reloaded = line_with(&server.log(), "TLS certificate reloaded").to_string();
    assert!(reloaded.contains("groups=secp384r1"), "{reloaded}");
    let sha = |line: &str| line.split("sha256=").nth(1).map(|s| s[..16].to_string());
    assert_ne!(sha(&loaded), sha(&reloaded), "{loaded}\n{reloaded}");
    let reloaded = line_with(&client.log(), "client TLS reloaded").to_string();
    assert!(
        reloaded.contains("groups=secp256r1,secp384r1"),
        "{reloaded}"
    );

    // A connection after the reload: both ends still agree on secp384r1
    // (client mode's secp256r1 share is refused: a HelloRetryRequest).
    copy_through(&env, &client);
    let after = all_sessions_with("secp384r1", &[&server, &client], before);
    let sessions = sessions_with("secp384r1");
    assert_eq!(sample(&scrape(server_admin), &sessions), after as f64);
    assert_eq!(sample(&scrape(client_admin), &sessions), after as f64);
}

/// A CA whose key `nbdgw certs` keeps, in `dir`.
fn keep_a_ca(dir: &Path) {
    let kept = run_ok(
        Command::new(common::process::nbdgw_binary())
            .args(["certs", "--keep-ca-key", "--out"])
            .arg(dir),
    );
    assert!(kept.status.success(), "{}", text(&kept));
}

/// Every TLS session of each process negotiated `group`, and each has
/// more than `before`; returns how many the first has.
fn all_sessions_with(group: &str, processes: &[&NbdgwProcess], before: usize) -> usize {
    let expected = format!("key_exchange={group} ");
    let counts: Vec<usize> = processes
        .iter()
        .map(|p| {
            let log = p.log();
            let lines = tls_lines(&log);
            assert!(lines.len() > before, "no new session:\n{log}");
            assert!(
                lines.iter().all(|l| l.contains(&expected)),
                "a session without {group}:\n{}",
                lines.join("\n")
            );
            lines.len()
        })
        .collect();
    counts[0]
}

#[test]
fn a_pure_mlkem_list_starts_with_a_warning() {
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 31);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let (server_admin, client_admin) = (free_port(), free_port());
    let tls13 = ["--tls-min-version", "1.3"];
    let server = server(
        &env,
        &upstream.socket,
        server_admin,
        &[&tls13[..], &["--tls-groups", "MLKEM768"]].concat(),
    );
    let warning = line_with(&server.log(), "pure ML-KEM").to_string();
    assert!(
        warning.contains("WARN")
            && warning.contains("--tls-groups MLKEM768 has a pure ML-KEM group and no hybrid"),
        "{warning}"
    );
    // Still used as given: client mode, a pure ML-KEM group before the
    // hybrid, gets MLKEM768 from it (and is warned too).
    let client = client_mode(
        &env,
        &server,
        client_admin,
        &[&tls13[..], &["--tls-groups", "MLKEM768,X25519MLKEM768"]].concat(),
    );
    let warning = line_with(&client.log(), "pure ML-KEM").to_string();
    assert!(warning.contains("before the hybrid"), "{warning}");
    copy_through(&env, &client);
    assert!(sample(&scrape(server_admin), &sessions_with("MLKEM768")) >= 1.0);
    // The default list is not warned about.
    assert_eq!(
        server_in(&env.certs(), &upstream.socket, free_port(), &[]).count_in_log("pure ML-KEM"),
        0
    );
}
