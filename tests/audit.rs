//! The audit trail: one `nbdgw::audit` line when a session enters
//! transmission and one when it ends, in the JSON log format, with the
//! fields docs/reference/audit.md documents. Real sessions: libnbd (write, then read)
//! through a policy to a named export, and qemu-img through the
//! `--allow-*` lists to a single upstream.

mod common;

use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

use common::clients::text;
use common::pki::{Ca, ClientDir};
use common::process::NbdgwProcess;
use common::{run, Env, QemuNbd};

const POLICY: &str = r#"
[[rule]]
exports = ["*"]
allow = { cn = ["backup"] }
access = "read-only"

[[rule]]
exports = ["{ns}/*"]
allow = { uri = ["spiffe://example.org/ns/{ns}/sa/app"] }
access = "read-write"
"#;

/// The audit lines of a JSON log, parsed.
fn audit_lines(log: &str) -> Vec<Value> {
    log.lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|line| line["target"] == "nbdgw::audit")
        .collect()
}

fn start(env: &Env, ca: &Ca, extra: &[&OsStr]) -> NbdgwProcess {
    let (cert, key, client_ca) =
        common::clients::write_server_files(&env.path("server"), &ca.server("gw"), ca);
    let mut args: Vec<&OsStr> = vec![
        "--tls-cert".as_ref(),
        cert.as_os_str(),
        "--tls-key".as_ref(),
        key.as_os_str(),
        "--tls-client-ca".as_ref(),
        client_ca.as_os_str(),
        "--log-format".as_ref(),
        "json".as_ref(),
    ];
    args.extend_from_slice(extra);
    NbdgwProcess::start(args)
}

fn str_field<'a>(line: &'a Value, name: &str) -> &'a str {
    line["fields"][name]
        .as_str()
        .unwrap_or_else(|| panic!("no string field {name} in {line}"))
}

fn num_field(line: &Value, name: &str) -> f64 {
    line["fields"][name]
        .as_f64()
        .unwrap_or_else(|| panic!("no number field {name} in {line}"))
}

/// Both lines name the session alike: identity, both export names,
/// access and the rule.
fn assert_names(line: &Value, expected: &[(&str, &str)], rule_line: f64) {
    for (name, value) in expected {
        assert_eq!(str_field(line, name), *value, "{name} in {line}");
    }
    assert_eq!(num_field(line, "rule_line"), rule_line, "{line}");
}

#[test]
fn a_policy_session_has_one_open_and_one_close_line_naming_rule_and_counts() {
    let env = Env::new();
    let ca = Ca::new("audit CA");
    let db = QemuNbd::start_at(
        env.path("db.sock"),
        &env.filled_image("db.img", b'I', 1 << 20),
        &["-x", "disk0"],
    );
    let policy = env.path("policy.toml");
    std::fs::write(&policy, POLICY).unwrap();
    // Names a peer chose, escaped in the log: a bidi override in the
    // export name (a valid name), an ANSI escape in the certificate's CN.
    let export = format!("team/\u{202e}db={}:disk0", db.socket.display());
    let gw = start(
        &env,
        &ca,
        &[
            "--export".as_ref(),
            export.as_ref(),
            "--policy".as_ref(),
            policy.as_os_str(),
        ],
    );
    let app = ca
        .client(
            "team-app\x1b[31m",
            &[],
            &["spiffe://example.org/ns/team/sa/app"],
            7,
        )
        .client_dir(&env.path("app"), &ca);

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/libnbd_probe.py");
    let out = run(Command::new("/usr/bin/python3")
        .arg(script)
        .arg("open")
        .arg(gw.port.to_string())
        .arg(&app)
        .arg("team/\u{202e}db"));
    assert!(out.status.success(), "{}", text(&out));
    let probe = String::from_utf8_lossy(&out.stdout);
    assert!(probe.contains(r#""write": "ok""#), "{probe}");
    // Both audit lines (the start-up probe has a close line of its own).
    gw.wait_for_log(r#""target":"nbdgw::audit""#, 2);

    let log = gw.log();
    let lines = audit_lines(&log);
    assert_eq!(lines.len(), 2, "{log}");
    let (open, close) = (&lines[0], &lines[1]);
    assert_eq!(str_field(open, "message"), "negotiated");
    assert_eq!(str_field(close, "message"), "closed");
    let socket = db.socket.display().to_string();
    let names = [
        ("export", r"team/\u{202e}db"),
        ("upstream_export", "disk0"),
        ("upstream", socket.as_str()),
        ("access", "read-write"),
        // The second [[rule]], which starts on line 7 of POLICY.
        ("rule", "policy:2"),
    ];
    for line in [open, close] {
        assert_names(line, &names, 7.0);
        let client = str_field(line, "client");
        assert!(
            client.contains(r#"subject "CN=team-app\u{1b}[31m""#)
                && client.contains(r#"URI ["spiffe://example.org/ns/team/sa/app"]"#),
            "{client}"
        );
        // The connection's span: the same session on both lines.
        assert_eq!(line["span"]["id"], open["span"]["id"], "{line}");
        assert!(line["span"]["peer"].as_str().is_some(), "{line}");
    }
    assert_eq!(str_field(open, "mode"), "Structured");
    assert_eq!(open["fields"]["read_only"], false);

    // A write and a read, each way, and why it ended.
    assert_eq!(str_field(close, "reason"), "client sent NBD_CMD_DISC");
    assert!(close["fields"].get("error").is_none(), "{close}");
    assert!(num_field(close, "requests") >= 2.0, "{close}");
    // NBD_CMD_DISC is a request without a reply.
    assert_eq!(
        num_field(close, "requests"),
        num_field(close, "replies") + 1.0
    );
    assert!(num_field(close, "bytes_in") >= 512.0, "{close}");
    assert!(num_field(close, "bytes_out") >= 512.0, "{close}");
    assert!(num_field(close, "secs") > 0.0, "{close}");
}

#[test]
fn without_a_policy_the_allow_lists_are_named_as_the_grant() {
    let env = Env::new();
    let ca = Ca::new("audit CA");
    let upstream = QemuNbd::start(&env, &env.filled_image("u.img", b'I', 1 << 20), &[]);
    let gw = start(
        &env,
        &ca,
        &[
            "--upstream".as_ref(),
            upstream.socket.as_os_str(),
            "--allow-cn".as_ref(),
            "vm-host".as_ref(),
        ],
    );
    let client = ca
        .client("vm-host", &[], &[], 8)
        .client_dir(&env.path("vm"), &ca);
    let out = common::clients::qemu_img_info(gw.port, &client);
    assert!(out.status.success(), "{}", text(&out));
    // Both audit lines (the start-up probe has a close line of its own).
    gw.wait_for_log(r#""target":"nbdgw::audit""#, 2);

    let log = gw.log();
    let lines = audit_lines(&log);
    assert_eq!(lines.len(), 2, "{log}");
    let socket = upstream.socket.display().to_string();
    let names = [
        ("export", ""),
        // One upstream for every name: asked for the client's.
        ("upstream_export", ""),
        ("upstream", socket.as_str()),
        ("access", "read-write"),
        ("rule", "--allow-*"),
    ];
    for line in &lines {
        assert_names(line, &names, 0.0);
    }
    assert!(Path::new(&socket).is_absolute());
}
