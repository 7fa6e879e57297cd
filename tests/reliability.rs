//! What the gateway reports and refuses when peers misbehave: counters
//! that tell the truth, and upstream replies that break the protocol.

mod common;

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::clients::{nbdinfo_size, qemu_img_info, text};
use common::fake_upstream;
use common::process::NbdgwProcess;
use common::raw::RawClient;
use common::{Env, QemuNbd};
use nbdgw::proto::consts::*;
use nbdgw::proto::transmission::ReplyMode;

fn gateway(env: &Env, upstream: &std::path::Path) -> NbdgwProcess {
    let certs = env.certs();
    NbdgwProcess::start([
        OsStr::new("--upstream"),
        upstream.as_os_str(),
        OsStr::new("--tls-cert"),
        certs.join("server-cert.pem").as_os_str(),
        OsStr::new("--tls-key"),
        certs.join("server-key.pem").as_os_str(),
    ])
}

#[test]
fn bytes_in_counts_what_arrived_not_what_was_announced() {
    let env = Env::new();
    let image = env.random_image("disk.img", 4 << 20, 2);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let gw = gateway(&env, &upstream.socket);
    let mut c = RawClient::tls(gw.addr(), &env.certs());
    c.go(ReplyMode::Structured);
    // A write announcing 1 MiB, of which 1000 bytes arrive.
    let mut request = c.request_bytes(0, CMD_WRITE, 1, 0, 1 << 20);
    request.extend_from_slice(&[9u8; 1000]);
    c.send(&request);
    std::thread::sleep(Duration::from_millis(200));
    drop(c);
    gw.wait_for_log("in the middle of a request payload", 1);
    let log = gw.log();
    let closed = log
        .lines()
        .find(|l| l.contains("in the middle of a request payload"))
        .unwrap();
    // The 28-byte header and the 1000 bytes that came.
    assert!(closed.contains("bytes_in=1028"), "{closed}");
}

fn nbdgw_certs(out: &Path, extra: &[&OsStr]) -> std::process::Output {
    common::run(
        Command::new(common::process::nbdgw_binary())
            .arg("certs")
            .arg("--out")
            .arg(out)
            .args(extra),
    )
}

fn ca_subject(dir: &Path) -> String {
    use rustls::pki_types::pem::PemObject;
    let der = rustls::pki_types::CertificateDer::from_pem_file(dir.join("ca-cert.pem")).unwrap();
    nbdgw::tls::CertInfo::from_der(&der).unwrap().subject
}

#[test]
fn clients_trust_two_certificate_sets_at_once_and_a_kept_ca_issues_more() {
    let env = Env::new();
    let image = env.random_image("disk.img", 1 << 20, 3);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let (old, new) = (env.path("old"), env.path("new"));
    assert!(nbdgw_certs(&old, &[OsStr::new("--keep-ca-key")])
        .status
        .success());
    assert!(nbdgw_certs(&new, &[]).status.success());
    let key_mode = std::fs::metadata(old.join("ca-key.pem"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(key_mode & 0o777, 0o600);
    assert!(
        !new.join("ca-key.pem").exists(),
        "the CA key is kept only when asked"
    );
    assert_ne!(ca_subject(&old), ca_subject(&new));

    // During a CA rotation a client trusts the old and the new CA.
    let both = env.path("both");
    std::fs::create_dir_all(&both).unwrap();
    let bundle = [old.join("ca-cert.pem"), new.join("ca-cert.pem")]
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect::<String>();
    std::fs::write(both.join("ca-cert.pem"), bundle).unwrap();
    for name in ["client-cert.pem", "client-key.pem"] {
        std::fs::copy(new.join(name), both.join(name)).unwrap();
    }
    let serve = |dir: &Path| {
        NbdgwProcess::start([
            OsStr::new("--upstream"),
            upstream.socket.as_os_str(),
            OsStr::new("--tls-dir"),
            dir.as_os_str(),
        ])
    };
    let gw = serve(&new);
    let info = qemu_img_info(gw.port, &both);
    assert!(info.status.success(), "{}", text(&info));
    assert!(nbdinfo_size(gw.port, &both).status.success());

    // More certificates from the kept CA: old clients keep working.
    let more = env.path("more");
    let (old_ca, old_key) = (old.join("ca-cert.pem"), old.join("ca-key.pem"));
    let ca_args = [
        OsStr::new("--ca-cert"),
        old_ca.as_os_str(),
        OsStr::new("--ca-key"),
        old_key.as_os_str(),
    ];
    let issued = nbdgw_certs(&more, &ca_args);
    assert!(issued.status.success(), "{}", text(&issued));
    assert_eq!(ca_subject(&more), ca_subject(&old));
    let gw = serve(&more);
    let info = qemu_img_info(gw.port, &old);
    assert!(info.status.success(), "{}", text(&info));

    // A key that is not the CA's is refused before anything is written.
    let not_the_ca_key = new.join("server-key.pem");
    let wrong = [
        ca_args[0],
        ca_args[1],
        OsStr::new("--ca-key"),
        not_the_ca_key.as_os_str(),
    ];
    let refused = nbdgw_certs(&env.path("wrong"), &wrong);
    assert!(!refused.status.success());
    assert!(
        text(&refused).contains("does not belong"),
        "{}",
        text(&refused)
    );
}

/// One misbehaviour: how the victim connection negotiates, what the
/// upstream answers its read, and what nbdgw must log.
struct Misbehaviour {
    name: &'static str,
    mode: ReplyMode,
    script: fake_upstream::Script,
    logged: &'static str,
}

const VICTIM: usize = 1;

fn misbehaviours() -> Vec<Misbehaviour> {
    use fake_upstream::{chunk, good_read, Asked};
    // Connection 0 is the bystander, and is always answered correctly.
    vec![
        Misbehaviour {
            name: "a reply to another cookie",
            mode: ReplyMode::Structured,
            script: |c, r| {
                let cookie = r.cookie + u64::from(c == VICTIM);
                good_read(Asked { cookie, ..r }).into()
            },
            logged: "a reply to cookie 0x2, which has no request in flight",
        },
        Misbehaviour {
            name: "a reply to a request never sent",
            mode: ReplyMode::Structured,
            script: |c, r| {
                let mut out = Vec::new();
                if c == VICTIM {
                    out = good_read(Asked { cookie: 999, ..r });
                }
                out.extend(good_read(r));
                out.into()
            },
            logged: "a reply to cookie 0x3e7",
        },
        Misbehaviour {
            name: "more data than was asked for",
            mode: ReplyMode::Structured,
            script: |c, r| {
                let length = if c == VICTIM { r.length * 2 } else { r.length };
                good_read(Asked { length, ..r }).into()
            },
            logged: "a chunk of type 0x1 and 8200 bytes, which a READ request cannot get",
        },
        Misbehaviour {
            name: "a structured reply in simple mode",
            mode: ReplyMode::Simple,
            // The bystander negotiated structured replies; the victim did not.
            script: |_, r| good_read(r).into(),
            logged: "a structured reply, which the negotiated Simple mode does not allow",
        },
        Misbehaviour {
            name: "a chunk after the DONE flag",
            mode: ReplyMode::Structured,
            script: |c, r| {
                let mut out = good_read(r);
                if c == VICTIM {
                    out.extend(chunk(REPLY_FLAG_DONE, REPLY_TYPE_NONE, r.cookie, 0));
                }
                out.into()
            },
            logged: "a reply to cookie 0x1, which has no request in flight",
        },
        Misbehaviour {
            name: "an error chunk whose message overruns it",
            mode: ReplyMode::Structured,
            script: |c, r| {
                if c != VICTIM {
                    return good_read(r).into();
                }
                let mut out = chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, r.cookie, 6 + 10);
                out.extend_from_slice(&EIO.to_be_bytes());
                out.extend_from_slice(&300u16.to_be_bytes());
                out.extend_from_slice(b"0123456789");
                out.into()
            },
            logged: "an error chunk whose message length 300 does not fit its 16 bytes",
        },
        Misbehaviour {
            name: "a close in the middle of a payload",
            mode: ReplyMode::Structured,
            script: |c, r| {
                let mut bytes = good_read(r);
                let close = c == VICTIM;
                if close {
                    bytes.truncate(20 + 100);
                }
                fake_upstream::Answer { bytes, close }
            },
            logged: "upstream closed the connection in the middle of a reply payload",
        },
    ]
}

#[test]
fn a_misbehaving_upstream_ends_only_that_connection_with_the_reason_logged() {
    for case in misbehaviours() {
        let env = Env::new();
        let fake = fake_upstream::scripted(&env.path("fake.sock"), 1 << 20, case.script);
        let gw = gateway(&env, &fake.socket);
        let mut bystander = RawClient::tls(gw.addr(), &env.certs());
        bystander.go(ReplyMode::Structured);
        assert_eq!(bystander.read(1, 0, 4096), vec![7u8; 4096], "{}", case.name);

        let mut victim = RawClient::tls(gw.addr(), &env.certs());
        victim.go(case.mode);
        victim.send_request(0, CMD_READ, 1, 0, 4096, &[]);
        let received = common::drain_stream(&mut victim.stream);
        assert!(
            received < 4096 + 32 + 8 || case.name.contains("DONE"),
            "{}: {received}",
            case.name
        );
        gw.wait_for_log(case.logged, 1);
        assert_eq!(
            bystander.read(2, 4096, 4096),
            vec![7u8; 4096],
            "{}",
            case.name
        );
        bystander.disconnect();
        eprintln!("{}: {}", case.name, case.logged);
    }
}

/// libnbd (async API) with one read held at the upstream when SIGTERM
/// arrives and a second read issued during the grace: the first
/// completes with its data, the second with ESHUTDOWN, neither hangs.
#[test]
fn a_read_issued_during_the_shutdown_grace_is_answered_with_eshutdown() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::Stdio;

    let env = Env::new();
    let image = env.random_image("disk.img", 1 << 20, 21);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let held = common::process::UpstreamCounter::start(&upstream.socket, &env.path("held.sock"));
    let gw = gateway(&env, &held.socket);
    let mut probe = Command::new("/usr/bin/python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/shutdown_grace_probe.py"
        ))
        .arg(gw.port.to_string())
        .arg(env.certs())
        .arg(gw.pid().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 with libnbd's bindings");
    let mut to_probe = probe.stdin.take().unwrap();
    let mut from_probe = BufReader::new(probe.stdout.take().unwrap());
    let mut line = String::new();
    let mut expect = |word: &str, line: &mut String| {
        line.clear();
        from_probe.read_line(line).unwrap();
        assert_eq!(line.trim(), word, "probe said {line:?}");
    };
    expect("connected", &mut line);
    held.hold_replies(true);
    to_probe.write_all(b"\n").unwrap();
    expect("issued", &mut line);
    // Logged once the connections are told to drain (the "SIGTERM
    // received" line comes before that).
    gw.wait_for_log("shutting down: no longer accepting", 1);
    held.hold_replies(false);
    to_probe.write_all(b"\n").unwrap();
    line.clear();
    from_probe.read_line(&mut line).unwrap();
    let _ = probe.wait();
    let expected = hex(&std::fs::read(&image).unwrap()[..8]);
    assert_eq!(
        line.trim(),
        format!(
            r#"{{"first": {{"ok": true, "data": "{expected}"}}, "second": {{"ok": false, "errno": "ESHUTDOWN"}}}}"#
        ),
        "nbdgw log:\n{}",
        gw.log()
    );
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
