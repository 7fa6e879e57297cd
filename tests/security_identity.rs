//! Identity checks that cannot fail open: client authentication and
//! revocation fixed at start, CRLs that must hold a CRL, revocation of
//! intermediates and of sessions already established, expired CRLs,
//! names with commas, and peer-controlled names escaped in the log. The
//! nbdgw binary, a real qemu-nbd, qemu-img and nbdinfo, and the raw
//! client where a certificate chain or an alert must be chosen exactly.

mod common;

use std::ffi::OsString;
use std::path::PathBuf;

use common::clients::{
    admitted, connect_as, nbdinfo_size, qemu_img_info, text, write_server_files,
};
use common::pki::{anonymous_client_dir, Ca, ClientDir};
use common::process::{start_must_fail, NbdgwProcess};
use common::raw::RawClient;
use common::{Env, QemuNbd};
use nbdgw::proto::transmission::ReplyMode;

const IMAGE_LEN: usize = 1 << 20;

/// A qemu-nbd upstream, a CA, and the gateway's files signed by it.
struct Site {
    env: Env,
    upstream: QemuNbd,
    image: Vec<u8>,
    ca: Ca,
    cert: PathBuf,
    key: PathBuf,
    client_ca: PathBuf,
}

impl Site {
    fn new() -> Self {
        let env = Env::new();
        let image_path = env.random_image("disk.img", IMAGE_LEN, 8);
        let upstream = QemuNbd::start(&env, &image_path, &[]);
        let ca = Ca::new("nbdgw security CA");
        let (cert, key, client_ca) =
            write_server_files(&env.path("server"), &ca.server("localhost"), &ca);
        Site {
            image: std::fs::read(&image_path).unwrap(),
            env,
            upstream,
            ca,
            cert,
            key,
            client_ca,
        }
    }

    /// `--upstream`, `--tls-cert`, `--tls-key` and `--tls-client-ca`.
    fn args(&self) -> Vec<OsString> {
        [
            ("--upstream", &self.upstream.socket),
            ("--tls-cert", &self.cert),
            ("--tls-key", &self.key),
            ("--tls-client-ca", &self.client_ca),
        ]
        .into_iter()
        .flat_map(|(flag, path)| [OsString::from(flag), path.into()])
        .collect()
    }

    fn gateway(&self, extra: &[&dyn AsRef<std::ffi::OsStr>]) -> NbdgwProcess {
        let mut args = self.args();
        args.extend(extra.iter().map(|a| a.as_ref().to_owned()));
        NbdgwProcess::start(args)
    }

    /// A client directory with a certificate of this CA.
    fn client(&self, cn: &str, serial: u64) -> PathBuf {
        // qemu's option syntax takes no commas or spaces in the path.
        let tame: String = cn
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let dir = self.env.path(&format!("client-{tame}-{serial}"));
        self.ca
            .client(cn, &[], &[], serial)
            .client_dir(&dir, &self.ca)
    }

    fn reads_correctly(&self, client: &mut RawClient, cookie: u64) {
        let got = client.read(cookie, 4096, 8192);
        assert!(got == self.image[4096..4096 + 8192], "wrong data");
    }
}

fn hangup_and_wait(gw: &NbdgwProcess, outcome: &str) {
    let (hups, before) = (gw.count_in_log("SIGHUP received"), gw.count_in_log(outcome));
    gw.signal("HUP");
    gw.wait_for_log("SIGHUP received", hups + 1);
    gw.wait_for_log(outcome, before + 1);
}

#[test]
fn a_reload_cannot_switch_client_certificates_off() {
    let site = Site::new();
    // The qemu layout: ca-cert.pem in the directory makes client
    // certificates required.
    let dir = site.env.path("server");
    std::fs::rename(&site.client_ca, dir.join("ca-cert.pem")).unwrap();
    let gw = NbdgwProcess::start([
        "--upstream".as_ref(),
        site.upstream.socket.as_os_str(),
        "--tls-dir".as_ref(),
        dir.as_os_str(),
        "--tls-reload-interval".as_ref(),
        "0".as_ref() as &std::ffi::OsStr,
    ]);
    assert!(
        gw.log().contains("client_certificates=\"required\""),
        "{}",
        gw.log()
    );
    let good = site.client("agent", 10);
    let anonymous = anonymous_client_dir(&site.env.path("anonymous"), &site.ca);

    // A rotation script moves the CA away for a moment.
    std::fs::rename(dir.join("ca-cert.pem"), dir.join("ca-cert.pem.new")).unwrap();
    hangup_and_wait(&gw, "TLS reload failed");
    assert!(gw.log().contains("ca-cert.pem"), "{}", gw.log());
    let anon = nbdinfo_size(gw.port, &anonymous);
    assert!(
        !anon.status.success(),
        "anonymous client let in after the CA vanished"
    );
    let info = qemu_img_info(gw.port, &good);
    assert!(info.status.success(), "{}", text(&info));
    std::fs::rename(dir.join("ca-cert.pem.new"), dir.join("ca-cert.pem")).unwrap();

    // A Kubernetes-layout certificate (and no ca.crt) dropped into the
    // qemu-layout directory does not flip the layout.
    std::fs::copy(dir.join("server-cert.pem"), dir.join("tls.crt")).unwrap();
    std::fs::copy(dir.join("server-key.pem"), dir.join("tls.key")).unwrap();
    hangup_and_wait(&gw, "TLS certificate reloaded");
    assert!(!nbdinfo_size(gw.port, &anonymous).status.success());
    assert!(nbdinfo_size(gw.port, &good).status.success());
}

#[test]
fn a_crl_file_without_a_crl_stops_start_and_is_refused_on_reload() {
    let site = Site::new();
    let crl = site.env.path("crl.pem");
    let mut args = site.args();
    args.extend(["--tls-crl".into(), crl.clone().into()]);
    for (what, contents) in [
        ("empty", String::new()),
        ("a certificate", site.ca.pem.clone()),
    ] {
        std::fs::write(&crl, contents).unwrap();
        let said = start_must_fail(&args);
        assert!(said.contains("holds no CRL"), "{what}: {said}");
    }

    std::fs::write(&crl, site.ca.crl(&[66])).unwrap();
    args.extend(["--tls-reload-interval".into(), "0".into()]);
    let gw = NbdgwProcess::start(&args);
    let revoked = site.client("agent", 66);
    let err = admitted(gw.addr(), &revoked).unwrap_err();
    assert!(err.contains("CertificateRevoked"), "{err}");
    // Rewritten in place (empty for a moment), or the wrong file copied.
    for (n, contents) in [String::new(), site.ca.pem.clone()].into_iter().enumerate() {
        std::fs::write(&crl, contents).unwrap();
        hangup_and_wait(&gw, "TLS reload failed");
        assert_eq!(gw.count_in_log("holds no CRL"), n + 1, "{}", gw.log());
        let err = admitted(gw.addr(), &revoked).unwrap_err();
        assert!(err.contains("CertificateRevoked"), "{err}");
    }
    assert!(admitted(gw.addr(), &site.client("agent", 10)).is_ok());
}

#[test]
fn revocation_is_checked_for_intermediates_too() {
    let site = Site::new();
    let crl = site.env.path("crl.pem");
    std::fs::write(&crl, site.ca.crl(&[5])).unwrap();
    let gw = site.gateway(&[&"--tls-crl", &crl]);
    let revoked_ca = site.ca.intermediate("revoked intermediate", 5);
    let good_ca = site.ca.intermediate("good intermediate", 6);
    let via = |ca: &Ca, name: &str| {
        ca.client("agent", &[], &[], 20)
            .client_dir_via(&site.env.path(name), &site.ca, ca)
    };
    admitted(gw.addr(), &via(&good_ca, "via-good")).expect("an unrevoked chain");
    let err = admitted(gw.addr(), &via(&revoked_ca, "via-revoked")).unwrap_err();
    assert!(err.contains("CertificateRevoked"), "{err}");
    gw.wait_for_log("Revoked", 1);
}

#[test]
fn an_expired_crl_refuses_clients_unless_allowed() {
    let site = Site::new();
    let crl = site.env.path("crl.pem");
    let yesterday = time::OffsetDateTime::now_utc() - time::Duration::days(1);
    std::fs::write(&crl, site.ca.crl_until(&[66], yesterday)).unwrap();
    let good = site.client("agent", 10);

    let strict = site.gateway(&[&"--tls-crl", &crl]);
    assert!(
        admitted(strict.addr(), &good).is_err(),
        "expired CRL accepted"
    );
    strict.wait_for_log("certificate revocation list expired", 1);

    let lenient = site.gateway(&[&"--tls-crl", &crl, &"--tls-crl-allow-expired"]);
    admitted(lenient.addr(), &good).expect("--tls-crl-allow-expired admits");
    let err = admitted(lenient.addr(), &site.client("agent", 66)).unwrap_err();
    assert!(err.contains("CertificateRevoked"), "{err}");
}

fn revoke_while_connected(revoke_closes: bool) {
    let site = Site::new();
    let crl = site.env.path("crl.pem");
    std::fs::write(&crl, site.ca.crl(&[99])).unwrap();
    let closes = revoke_closes.to_string();
    let gw = site.gateway(&[
        &"--tls-crl",
        &crl,
        &"--tls-reload-interval",
        &"0",
        &"--tls-revoke-closes",
        &closes,
    ]);
    let (agent, other) = (site.client("agent", 10), site.client("other", 11));
    let mut revoked = connect_as(gw.addr(), &agent);
    revoked.go(ReplyMode::Structured);
    site.reads_correctly(&mut revoked, 1);
    let mut bystander = connect_as(gw.addr(), &other);
    bystander.go(ReplyMode::Structured);

    std::fs::write(&crl, site.ca.crl(&[10, 99])).unwrap();
    hangup_and_wait(&gw, "TLS certificate reloaded");
    if revoke_closes {
        gw.wait_for_log("client certificate revoked by the reload", 1);
        revoked.expect_closed();
        gw.wait_for_log("closed error=client certificate revoked by a reload", 1);
    } else {
        site.reads_correctly(&mut revoked, 2);
        assert_eq!(gw.count_in_log("revoked by the reload"), 0);
    }
    site.reads_correctly(&mut bystander, 3);
    // Either way, a new connection with the revoked certificate is refused.
    let err = admitted(gw.addr(), &agent).unwrap_err();
    assert!(err.contains("CertificateRevoked"), "{err}");
}

#[test]
fn a_reload_that_revokes_a_client_closes_its_established_session() {
    revoke_while_connected(true);
}

#[test]
fn tls_revoke_closes_false_leaves_established_sessions_alone() {
    revoke_while_connected(false);
}

/// What the log holds after a certificate named to forge log lines was
/// refused, in the given log format.
fn log_after_a_forging_certificate(format: &str) -> String {
    let site = Site::new();
    let gw = site.gateway(&[&"--log-format", &format]);
    let stranger = Ca::new("stranger");
    let dir = stranger
        .client(
            "evil\nINFO forged line\x1b[31m\u{202e}",
            &["x\x1b.example"],
            &["spiffe://td/\x1b[2J"],
            7,
        )
        .client_dir_trusting(&site.env.path("forger"), &[&site.ca]);
    assert!(admitted(gw.addr(), &dir).is_err());
    gw.wait_for_log("client certificate refused", 1);
    gw.log()
}

#[test]
fn peer_controlled_names_are_escaped_in_text_and_json_logs() {
    for format in ["text", "json"] {
        let log = log_after_a_forging_certificate(format);
        assert!(
            !log.contains('\x1b'),
            "{format}: raw ESC in the log:\n{log}"
        );
        assert!(!log.contains('\u{202e}'), "{format}: raw bidi override");
        assert!(
            !log.lines().any(|l| l.starts_with("INFO forged")),
            "{format}: a forged line:\n{log}"
        );
        let escaped = match format {
            // JSON escapes the backslash of our escape once more.
            "json" => r"evil\\nINFO forged line\\u{1b}[31m",
            _ => r"evil\nINFO forged line\u{1b}[31m",
        };
        assert!(log.contains(escaped), "{format}:\n{log}");
        if format == "json" {
            for line in log.lines().filter(|l| l.starts_with('{')) {
                assert!(line.ends_with('}'), "a JSON line was split: {line}");
            }
        }
    }
}

#[test]
fn allow_cn_takes_a_name_with_a_comma_whole_and_the_variable_splits() {
    let site = Site::new();
    let comma = site.client("ACME, Backup", 30);
    let backup = site.client("Backup", 31);
    let flag = site.gateway(&[&"--allow-cn", &"ACME, Backup"]);
    admitted(flag.addr(), &comma).expect("the whole name is allowed");
    assert!(admitted(flag.addr(), &backup).is_err());
    let info = qemu_img_info(flag.port, &comma);
    assert!(info.status.success(), "{}", text(&info));

    let env = NbdgwProcess::start_with(
        site.args(),
        &[("NBDGW_ALLOW_CN", "nobody, Backup".as_ref())],
    );
    admitted(env.addr(), &backup).expect("the variable is a list");
    assert!(admitted(env.addr(), &comma).is_err());
}
