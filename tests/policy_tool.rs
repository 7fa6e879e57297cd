//! `nbdgw policy check` and `nbdgw policy explain`, run as operators run
//! them: the binary, a policy file, client certificates made here.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::pki::Ca;

const POLICY: &str = r#"# tenants and the backup server
[[rule]]
exports = ["vm-*"]
allow = { uri = ["spiffe://example.org/ns/*/sa/vm-host"] }
access = "read-write"

[[rule]]
exports = ["*", "*/*"]
allow = { cn = ["backup"] }
access = "read-only"

[[rule]]
exports = ["{ns}/*"]
allow = { uri = ["spiffe://example.org/ns/{ns}/sa/app"] }
access = "read-write"
"#;

fn nbdgw(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(common::process::nbdgw_binary())
        .args(args)
        .output()
        .expect("run nbdgw")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn check(file: &Path) -> Output {
    nbdgw(&["policy".as_ref(), "check".as_ref(), file.as_os_str()])
}

#[test]
fn check_accepts_a_valid_file_and_names_line_and_column_of_a_broken_one() {
    let dir = tempfile::tempdir().unwrap();
    let good = write(dir.path(), "good.toml", POLICY);
    let out = check(&good);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("valid, 3 rule(s)"),
        "{}",
        stdout(&out)
    );

    // A placeholder that is not a whole segment: the pattern's place.
    let templated = POLICY.replace(r#"["{ns}/*"]"#, r#"["vm", "{ns}-*"]"#);
    let broken = write(dir.path(), "templated.toml", &templated);
    let out = check(&broken);
    assert_eq!(out.status.code(), Some(1));
    let message = stderr(&out);
    let at = format!("{}:13:18: rule 3:", broken.display());
    assert!(message.contains(&at), "{message}");
    assert!(message.contains("whole `/`-separated segment"), "{message}");
    assert!(stdout(&out).is_empty());

    // A TOML syntax error, and a misspelt key: where the parser stopped.
    for (text, at, what) in [
        ("[[rule]]\nexports = [\"x\"\nallow = 3\n", "3:1:", "not a valid policy file"),
        (
            "[[rule]]\nexports = [\"x\"]\nallow = { cn = [\"a\"] }\naccess = \"read-only\"\ncolour = 1\n",
            "5:1:",
            "unknown field `colour`",
        ),
        // A rule-wide problem: the rule's own line.
        (
            "\n\n[[rule]]\nexports = [\"x\"]\nallow = {}\naccess = \"read-only\"\n",
            "3:1: rule 1:",
            "names no identity",
        ),
    ] {
        let file = write(dir.path(), "bad.toml", text);
        let out = check(&file);
        assert_eq!(out.status.code(), Some(1), "{text}");
        let message = stderr(&out);
        assert!(
            message.contains(&format!("{}:{at}", file.display())) && message.contains(what),
            "{text}: {message}"
        );
    }

    let out = check(&dir.path().join("missing.toml"));
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("cannot read"), "{}", stderr(&out));
}

struct Certs {
    _dir: tempfile::TempDir,
    policy: PathBuf,
    vm_host: PathBuf,
    backup: PathBuf,
    db_app: PathBuf,
    intruder: PathBuf,
}

fn certs() -> Certs {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("explain CA");
    let cert = |name: &str, uris: &[&str], serial| {
        let leaf = ca.client(name, &[], uris, serial);
        write(dir.path(), &format!("{name}.pem"), &leaf.cert)
    };
    Certs {
        policy: write(dir.path(), "policy.toml", POLICY),
        vm_host: cert("vm-host", &["spiffe://example.org/ns/prod/sa/vm-host"], 1),
        backup: cert("backup", &[], 2),
        db_app: cert("db-app", &["spiffe://example.org/ns/db/sa/app"], 3),
        intruder: cert("intruder", &["spiffe://example.org/ns/db/sa/other"], 4),
        _dir: dir,
    }
}

fn explain(certs: &Certs, cert: &Path, export: &str) -> Output {
    nbdgw(&[
        "policy".as_ref(),
        "explain".as_ref(),
        "--policy".as_ref(),
        certs.policy.as_os_str(),
        "--cert".as_ref(),
        cert.as_os_str(),
        "--export".as_ref(),
        export.as_ref(),
    ])
}

#[test]
fn explain_names_the_deciding_rule_and_its_access() {
    let c = certs();

    // A templated rule, with what its placeholder bound.
    let out = explain(&c, &c.db_app, "db/c");
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("subject \"CN=db-app\""), "{text}");
    assert!(text.contains("export \"db/c\": read-write"), "{text}");
    assert!(
        text.contains(r#"decided by rule 3 (line 12): read-write to exports ["{ns}/*"], admitted by uri "spiffe://example.org/ns/{ns}/sa/app" with {ns} = "db""#),
        "{text}"
    );

    // The neighbouring namespace's disk, and one that merely starts with
    // the same letters: nothing grants them.
    for export in ["db-prod/d", "dbx/c", "vm-a"] {
        let out = explain(&c, &c.db_app, export);
        assert_eq!(out.status.code(), Some(1), "{export}");
        let text = stdout(&out);
        assert!(
            text.contains(&format!("export \"{export}\": no rule grants it")),
            "{text}"
        );
    }
    let out = explain(&c, &c.intruder, "db/c");
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains("no rule grants it"));

    // Read-only against read-write, by different rules.
    let out = explain(&c, &c.backup, "vm-a");
    assert_eq!(out.status.code(), Some(0));
    let text = stdout(&out);
    assert!(text.contains("export \"vm-a\": read-only"), "{text}");
    assert!(
        text.contains("decided by rule 2 (line 7): read-only"),
        "{text}"
    );
    let out = explain(&c, &c.vm_host, "vm-a");
    assert_eq!(out.status.code(), Some(0));
    let text = stdout(&out);
    assert!(text.contains("export \"vm-a\": read-write"), "{text}");
    assert!(
        text.contains("decided by rule 1 (line 2): read-write"),
        "{text}"
    );

    // A name nbdgw refuses before any policy is asked, escaped.
    let out = explain(&c, &c.backup, "vm-\x1b[2J");
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(
        text.contains(r#"export "vm-\u{1b}[2J": refused before the policy is asked"#),
        "{text}"
    );

    // Not a certificate: an error, status 2.
    let out = explain(&c, &c.policy, "vm-a");
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("policy.toml"), "{}", stderr(&out));
}

/// Issue 27 item 5: two templated rules, one by URI SAN and one by DNS
/// SAN; a certificate naming namespace `a` in its URI SAN and `b` in its
/// DNS SAN was shown (and given) read-write on both tenants' disks.
/// Now `explain` says no rule grants either, and why.
#[test]
fn explain_grants_a_certificate_naming_two_tenants_in_two_rules_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let policy = write(
        dir.path(),
        "policy.toml",
        r#"[[rule]]
exports = ["{ns}/*"]
allow = { uri = ["spiffe://cluster.local/ns/{ns}/sa/*"] }
access = "read-write"

[[rule]]
exports = ["{ns}/*"]
allow = { dns = ["*.{ns}.svc"] }
access = "read-write"
"#,
    );
    let ca = Ca::new("two rules CA");
    let leaf = ca.client("x", &["vm.b.svc"], &["spiffe://cluster.local/ns/a/sa/x"], 1);
    let cert = write(dir.path(), "both.pem", &leaf.cert);
    for export in ["a/db", "b/db"] {
        let out = nbdgw(&[
            "policy".as_ref(),
            "explain".as_ref(),
            "--policy".as_ref(),
            policy.as_os_str(),
            "--cert".as_ref(),
            cert.as_os_str(),
            "--export".as_ref(),
            export.as_ref(),
        ]);
        let text = stdout(&out);
        assert_eq!(out.status.code(), Some(1), "{export}: {text}");
        assert!(
            text.contains(&format!("export \"{export}\": no rule grants it")),
            "{text}"
        );
        assert!(text.contains("its names bind two tenants"), "{text}");
        assert!(text.contains("rule 1 (line 1): {ns} = \"a\""), "{text}");
        assert!(text.contains("rule 2 (line 6): {ns} = \"b\""), "{text}");
    }
}

/// Hostile review of issue 27 item 5: rules naming the tenant `{ns}` and
/// `{tenant}` but sharing `{sa}` passed the one-tenant check, and
/// `explain` showed (as the gateway gave) read-write on `a/db` and
/// `b/db` to a certificate with URI SAN `.../ns/a/sa/x` and DNS SAN
/// `x.b.svc`. Now neither, and `explain` says the rules name the tenant
/// apart.
#[test]
fn explain_grants_nothing_when_rules_name_the_tenant_apart_and_share_a_placeholder() {
    let dir = tempfile::tempdir().unwrap();
    let policy = write(
        dir.path(),
        "policy.toml",
        r#"[[rule]]
exports = ["{ns}/*", "scratch/{sa}"]
allow = { uri = ["spiffe://cluster.local/ns/{ns}/sa/{sa}"] }
access = "read-write"

[[rule]]
exports = ["{tenant}/*", "scratch/{sa}"]
allow = { dns = ["{sa}.{tenant}.svc"] }
access = "read-write"
"#,
    );
    let ca = Ca::new("apart CA");
    let leaf = ca.client("x", &["x.b.svc"], &["spiffe://cluster.local/ns/a/sa/x"], 1);
    let cert = write(dir.path(), "both.pem", &leaf.cert);
    for export in ["a/db", "b/db"] {
        let out = nbdgw(&[
            "policy".as_ref(),
            "explain".as_ref(),
            "--policy".as_ref(),
            policy.as_os_str(),
            "--cert".as_ref(),
            cert.as_os_str(),
            "--export".as_ref(),
            export.as_ref(),
        ]);
        let text = stdout(&out);
        assert_eq!(out.status.code(), Some(1), "{export}: {text}");
        assert!(
            text.contains(&format!("export \"{export}\": no rule grants it")),
            "{text}"
        );
        assert!(
            text.contains("bound by rules that name the tenant apart"),
            "{text}"
        );
        assert!(
            text.contains("rule 1 (line 1): {ns} = \"a\", {sa} = \"x\""),
            "{text}"
        );
        assert!(
            text.contains("rule 2 (line 6): {sa} = \"x\", {tenant} = \"b\""),
            "{text}"
        );
    }
}

/// Issue 27 item 7: a bad identity pattern was reported at its rule's
/// `[[rule]]` line; now at the pattern itself, line and column.
#[test]
fn check_names_the_line_and_column_of_a_bad_identity_pattern() {
    let dir = tempfile::tempdir().unwrap();
    let text = "# tenants\n[[rule]]\nexports = [\"{ns}/*\"]\nallow = { dns = [\"*.example\"],\n          uri = [\"spiffe://td/ns/{ns}/sa/*\", \"spiffe://td/ns/x{ns}/sa/*\"] }\naccess = \"read-write\"\n";
    let file = write(dir.path(), "bad.toml", text);
    let out = check(&file);
    assert_eq!(out.status.code(), Some(1));
    let message = stderr(&out);
    // Line 5, the second string of the uri list (column of its quote).
    let at = format!("{}:5:46: rule 1:", file.display());
    assert!(message.contains(&at), "{message}");
    assert!(message.contains("stand for one whole part"), "{message}");
}

/// Templated rules naming the tenant apart (`{ns}` and `{team}`) are valid
/// but make a certificate both bind get nothing from either: `check`
/// warns, and still exits 0.
#[test]
fn check_warns_of_templated_rules_naming_the_tenant_apart() {
    let dir = tempfile::tempdir().unwrap();
    let text = "[[rule]]\nexports = [\"{ns}/*\"]\nallow = { uri = [\"spiffe://td/ns/{ns}/sa/*\"] }\naccess = \"read-write\"\n\n[[rule]]\nexports = [\"{team}/*\"]\nallow = { dns = [\"*.{team}.svc\"] }\naccess = \"read-write\"\n";
    let file = write(dir.path(), "apart.toml", text);
    let out = check(&file);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let message = stderr(&out);
    assert!(
        message.contains("rules 1 (line 1) and 2 (line 6) use placeholder sets in their exports neither of which contains the other"),
        "{message}"
    );
    let same = write(dir.path(), "same.toml", &text.replace("team", "ns"));
    let out = check(&same);
    assert_eq!(out.status.code(), Some(0));
    assert!(stderr(&out).is_empty(), "{}", stderr(&out));
}
