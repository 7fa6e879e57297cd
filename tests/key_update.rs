//! TLS 1.3 KeyUpdate (issue 19): sessions survive key updates either side
//! starts, in rustls and after the hand-over to the kernel (kTLS), with
//! every byte checked. The clients are real TLS stacks: GnuTLS
//! (tests/clients/gnutls_keyupdate.c, compiled at test time) calling
//! `gnutls_session_key_update()`, and rustls calling
//! `refresh_traffic_keys()`. On a kernel without TLS the sessions stay in
//! rustls (which answers KeyUpdates itself); on one with it
//! (scripts/ktls-vm.sh) they are handed to the kernel, and each test
//! checks they were.

mod common;

use common::gnutls_client::{self, Mode, REGION_END, REGION_LEN, REGION_OFFSET};
use common::process::NbdgwProcess;
use common::raw::{client_tls, RawClient, Stream};
use common::{Env, QemuNbd};
use nbdgw::proto::transmission::ReplyMode;

const SIZE: usize = 4 << 20;
const _: () = assert!(REGION_END <= SIZE);

const HANDED_OVER: &str = "TLS handed to the kernel (kTLS)";
const ESTABLISHED: &str = "TLS established";
/// How a session the client ended with NBD_CMD_DISC closes.
const CLOSED_BY_DISC: &str = r#"closed reason="client sent NBD_CMD_DISC""#;

fn kernel_has_tls() -> bool {
    nbdgw::tls::kernel::probe().is_ok()
}

/// nbdgw (the binary, with `extra` flags) in front of a real qemu-nbd
/// serving a random image. Fields drop in order: nbdgw, qemu-nbd, then
/// the directory holding the image and certificates.
struct Setup {
    gw: NbdgwProcess,
    upstream: QemuNbd,
    env: Env,
}

impl Setup {
    fn start(seed: u64, extra: &[&str]) -> Self {
        let env = Env::new();
        let image = env.random_image("disk.img", SIZE, seed);
        let upstream = QemuNbd::start(&env, &image, &[]);
        let gw = NbdgwProcess::in_front_of(&env, &upstream.socket, extra);
        Setup { gw, upstream, env }
    }

    fn gnutls(&self, mode: Mode) -> gnutls_client::Run {
        gnutls_client::run(self.gw.addr(), &self.env.certs(), "", mode)
    }

    /// The upstream, read directly, holds `want` where the client wrote.
    fn assert_upstream_holds(&self, want: &[u8]) {
        let image = self.upstream.read_direct();
        assert!(
            image[REGION_OFFSET..REGION_OFFSET + want.len()] == *want,
            "the upstream does not hold what the client wrote last"
        );
    }

    /// Once the one TLS session (the start-up check's bare connection
    /// aside) has closed: it ended at the client's NBD_CMD_DISC, no
    /// connection logged a warning, and where the kernel has TLS the
    /// session ran there.
    fn assert_clean_session(&self) {
        self.gw.wait_for_log(CLOSED_BY_DISC, 1);
        let log = self.gw.log();
        assert_eq!(log.matches(ESTABLISHED).count(), 1, "{log}");
        assert_eq!(log.matches(CLOSED_BY_DISC).count(), 1, "{log}");
        assert!(
            !log.contains("WARN conn") && !log.contains("ERROR conn"),
            "{log}"
        );
        if kernel_has_tls() {
            assert_eq!(log.matches(HANDED_OVER).count(), 1, "{log}");
        } else {
            assert!(!log.contains(HANDED_OVER), "{log}");
        }
        // Which mode ran, and what the session's key updates were, for
        // scripts/ktls-vm.sh to show (libtest's --show-output).
        for line in log.lines().filter(|l| {
            l.contains("nbdgw::tls::kernel: kernel TLS")
                || l.contains(HANDED_OVER)
                || l.contains("session ends after key updates")
        }) {
            println!(
                "mode: {}",
                line.split_once(" INFO ").map_or(line, |(_, l)| l)
            );
        }
    }
}

fn gnutls_key_update(mode: Mode, seed: u64) -> (Setup, gnutls_client::Run) {
    let setup = Setup::start(seed, &[]);
    let run = setup.gnutls(mode);
    assert!(run.success(), "GnuTLS client: {}", run.describe());
    setup.assert_upstream_holds(&mode.last_written());
    setup.assert_clean_session();
    (setup, run)
}

/// The client updates its own keys (request_update = update_not_requested):
/// nbdgw must take the client's new read key mid-session.
#[test]
fn gnutls_client_key_update_not_requested_survives() {
    let (_setup, run) = gnutls_key_update(Mode::KeyUpdate, 31);
    assert!(
        run.stdout().contains("key update sent (flags 0)"),
        "{}",
        run.describe()
    );
}

/// The client updates its keys and asks nbdgw to update its own
/// (GNUTLS_KU_PEER): nbdgw must send a KeyUpdate, which the client sees
/// (its handshake hook counts it, and its read key changes).
#[test]
fn gnutls_client_key_update_requested_survives() {
    let (_setup, run) = gnutls_key_update(Mode::KeyUpdatePeer, 32);
    assert!(
        run.stdout().contains("key update sent (flags 1)"),
        "{}",
        run.describe()
    );
    assert!(run.server_rekeys() >= 1, "{}", run.describe());
}

/// Writes a fresh pattern over the region and reads it back.
fn round_trip(c: &mut RawClient, cookie: &mut u64, seed: u64) -> Vec<u8> {
    let data = common::pattern(REGION_LEN, seed);
    *cookie += 1;
    c.write(*cookie, REGION_OFFSET as u64, &data);
    let reply = c.read_reply(0);
    assert_eq!(reply.len(), 1);
    assert_eq!(reply[0].cookie, *cookie);
    assert_eq!(reply[0].error_code(), 0, "write failed");
    *cookie += 1;
    let back = c.read(*cookie, REGION_OFFSET as u64, REGION_LEN);
    assert!(
        back == data,
        "read back other bytes than written (seed {seed})"
    );
    data
}

/// rustls's `refresh_traffic_keys()` sends a KeyUpdate asking for the
/// peer's (update_requested): nbdgw must take the new read key and
/// answer with its own, twice in one session.
#[test]
fn rustls_client_refresh_traffic_keys_survives() {
    let setup = Setup::start(33, &[]);
    let certs = setup.env.certs();
    let mut c = RawClient::handshake(setup.gw.addr());
    c.try_starttls(client_tls(
        &certs.join("ca-cert.pem"),
        Some((
            &certs.join("client-cert.pem"),
            &certs.join("client-key.pem"),
        )),
        &[&rustls::version::TLS13],
    ))
    .expect("TLS handshake");
    c.go(ReplyMode::Simple);
    let mut cookie = 0;
    let mut seed = 100;
    let mut last = Vec::new();
    for _ in 0..2 {
        seed += 1;
        last = round_trip(&mut c, &mut cookie, seed);
    }
    for update in 0..2 {
        let Stream::Tls(tls) = &mut c.stream else {
            unreachable!("TLS is up")
        };
        assert_eq!(
            tls.conn.protocol_version(),
            Some(rustls::ProtocolVersion::TLSv1_3)
        );
        tls.conn
            .refresh_traffic_keys()
            .unwrap_or_else(|e| panic!("refresh_traffic_keys #{update}: {e}"));
        // The KeyUpdate goes out with the next request's records.
        for _ in 0..3 {
            seed += 1;
            last = round_trip(&mut c, &mut cookie, seed);
        }
    }
    c.disconnect();
    setup.assert_upstream_holds(&last);
    setup.assert_clean_session();
}

/// A session longer than a (test-sized) key limit: nbdgw re-keys its own
/// TX with a KeyUpdate after about `--ktls-key-limit` records under one
/// key, and the GnuTLS client sees it happen at least once, with every
/// read compared.
#[test]
fn long_session_server_rekeys_its_tx() {
    let setup = Setup::start(34, &["--ktls-key-limit", "1000"]);
    let mode = Mode::Long(5000);
    let run = setup.gnutls(mode);
    assert!(run.success(), "GnuTLS client: {}", run.describe());
    assert!(
        run.stdout().contains("requests: 5000"),
        "{}",
        run.describe()
    );
    let rekeys = run.server_rekeys();
    if kernel_has_tls() {
        assert!(
            rekeys >= 1,
            "nbdgw never re-keyed its TX in 5000 replies with --ktls-key-limit 1000: {}",
            run.describe()
        );
        let log = setup.gw.log();
        let logged = log
            .split("tx_key_updates=")
            .nth(1)
            .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse::<u64>().ok());
        assert!(logged.is_some_and(|n| n >= 1), "{log}");
    } else {
        // rustls keeps the session and re-keys only near the cipher's own
        // limit; the flag is for kernel sessions.
        assert_eq!(rekeys, 0, "{}", run.describe());
    }
    setup.assert_upstream_holds(&mode.last_written());
    setup.assert_clean_session();
}

/// TLS 1.3 treats every alert but close_notify and user_canceled as an
/// error, whatever its level (RFC 8446 §6): a warning-level
/// unrecognized_name from the client ends the session, in rustls and in
/// the kernel alike, with the reason logged.
#[test]
fn a_warning_alert_ends_the_session() {
    let setup = Setup::start(35, &[]);
    let run = setup.gnutls(Mode::Alert);
    assert!(run.success(), "GnuTLS client: {}", run.describe());
    assert!(
        run.stdout()
            .contains("session ended by the server after the alert"),
        "{}",
        run.describe()
    );
    setup.assert_upstream_holds(&Mode::Alert.last_written());
    // The start-up check's bare connection, then the session.
    setup.gw.wait_for_log("closed error=", 2);
    let log = setup.gw.log();
    let closed = log
        .lines()
        .filter(|l| l.contains("closed error="))
        .nth(1)
        .unwrap_or_default();
    let reason = if kernel_has_tls() {
        "client sent TLS alert 112 (level 1)"
    } else {
        "received fatal alert: UnrecognisedName"
    };
    assert!(closed.contains(reason), "{log}");
}

/// A client that sends KeyUpdate after KeyUpdate with no application
/// data costs the server a key derivation each for a few bytes: past 32
/// (rustls's and BoringSSL's limit) the session ends, with
/// unexpected_message from the kernel session, and the reason logged.
#[test]
fn a_key_update_flood_ends_the_session() {
    let setup = Setup::start(36, &[]);
    let run = setup.gnutls(Mode::KeyUpdateFlood);
    assert!(run.success(), "GnuTLS client: {}", run.describe());
    assert!(
        run.stdout()
            .contains("session ended by the server after the flood"),
        "{}",
        run.describe()
    );
    setup.gw.wait_for_log("closed error=", 2);
    let log = setup.gw.log();
    if kernel_has_tls() {
        assert!(
            run.stdout().contains("server alert: 10"),
            "{}",
            run.describe()
        );
        assert!(
            log.contains("client sent more than 32 KeyUpdates without application data"),
            "{log}"
        );
    } else {
        assert!(log.contains("TooManyKeyUpdateRequests"), "{log}");
    }
}
