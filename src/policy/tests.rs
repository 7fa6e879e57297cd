use super::*;
use proptest::prelude::*;

fn cert(cn: &str, dns: &[&str], uris: &[&str]) -> CertInfo {
    CertInfo::with_names(cn, dns, uris)
}

const EXAMPLE: &str = r#"
[[rule]]
exports = ["vm-*"]
allow = { uri = ["spiffe://example.org/ns/*/sa/vm-host"] }
access = "read-write"

[[rule]]
exports = ["*"]
allow = { cn = ["backup"] }
access = "read-only"
"#;

#[test]
fn the_documented_example_grants_what_it_says() {
    let policy = Policy::parse(EXAMPLE).unwrap();
    let vm_host = cert("h1", &[], &["spiffe://example.org/ns/prod/sa/vm-host"]);
    let backup = cert("backup", &[], &[]);
    let both = cert("backup", &[], &["spiffe://example.org/ns/prod/sa/vm-host"]);
    let other = cert(
        "someone",
        &["backup"],
        &["spiffe://example.org/ns/prod/sa/other"],
    );
    assert_eq!(policy.decide(&vm_host, "vm-1"), Some(Access::ReadWrite));
    assert_eq!(policy.decide(&vm_host, "db-1"), None);
    assert_eq!(policy.decide(&backup, "db-1"), Some(Access::ReadOnly));
    assert_eq!(policy.decide(&backup, ""), Some(Access::ReadOnly));
    // The most permissive rule wins.
    assert_eq!(policy.decide(&both, "vm-1"), Some(Access::ReadWrite));
    assert_eq!(policy.decide(&both, "db-1"), Some(Access::ReadOnly));
    assert_eq!(policy.decide(&other, "vm-1"), None);
}

#[test]
fn a_placeholder_ties_each_tenant_to_its_own_exports() {
    let policy = Policy::parse(
        r#"
        [[rule]]
        exports = ["{ns}-*"]
        allow = { uri = ["spiffe://example.org/ns/{ns}/sa/*"], dns = ["{ns}.tenants.example"] }
        access = "read-write"
        "#,
    )
    .unwrap();
    let a = cert("x", &[], &["spiffe://example.org/ns/a/sa/vm"]);
    assert_eq!(policy.decide(&a, "a-disk1"), Some(Access::ReadWrite));
    assert_eq!(policy.decide(&a, "a-"), Some(Access::ReadWrite));
    assert_eq!(policy.decide(&a, "ab-disk1"), None);
    assert_eq!(policy.decide(&a, "b-disk1"), None);
    let b = cert("x", &["B.Tenants.example"], &[]);
    assert_eq!(policy.decide(&b, "b-disk1"), Some(Access::ReadWrite));
    assert_eq!(policy.decide(&b, "a-disk1"), None);
    // A placeholder binds one whole segment, never a slash.
    let deep = cert("x", &[], &["spiffe://example.org/ns/a/b/sa/vm"]);
    assert_eq!(policy.decide(&deep, "a/b-disk1"), None);
}

#[test]
fn without_a_policy_file_everyone_admitted_opens_everything_read_write() {
    let policy = Policy::open();
    assert_eq!(
        policy.decide(&cert("x", &[], &[]), "any"),
        Some(Access::ReadWrite)
    );
}

#[test]
fn mistakes_in_the_file_are_errors_that_say_where() {
    let cases = [
        (
            r#"[[rule]]
exports = ["*"]
allow = { cn = ["a"] }
acess = "read-only""#,
            "unknown field",
        ),
        (
            r#"[[rule]]
exports = ["*"]
allow = { cn = ["a"] }
access = "write""#,
            "unknown variant",
        ),
        (
            r#"[[rule]]
exports = ["{ns}-*"]
allow = { cn = ["a"] }
access = "read-only""#,
            "rule 1: placeholder {ns}",
        ),
        (
            r#"[[rule]]
exports = ["*"]
allow = { uri = ["spiffe://td/ns/prod*/sa/x"] }
access = "read-only""#,
            "one whole part",
        ),
        (
            r#"[[rule]]
exports = []
allow = { cn = ["a"] }
access = "read-only""#,
            "`exports` is empty",
        ),
        (
            r#"[[rule]]
exports = ["*"]
allow = {}
access = "read-only""#,
            "names no identity",
        ),
        (
            r#"[[rule]]
exports = ["{ns"]
allow = { cn = ["{ns}"] }
access = "read-only""#,
            "unclosed",
        ),
        ("[[rule]\nexports", "not a valid policy file"),
    ];
    for (text, expected) in cases {
        let error = Policy::parse(text).unwrap_err().to_string();
        assert!(error.contains(expected), "{text:?}: {error}");
    }
}

#[test]
fn narrowing_reloads_are_accepted_and_widening_ones_refused() {
    let running = Policy::parse(EXAMPLE).unwrap();
    let narrower = [
        // A rule dropped.
        "[[rule]]\nexports = [\"*\"]\nallow = { cn = [\"backup\"] }\naccess = \"read-only\"",
        // A glob replaced by names it matches, a wildcard by a name.
        "[[rule]]\nexports = [\"vm-1\", \"vm-2\"]\nallow = { uri = [\"spiffe://example.org/ns/prod/sa/vm-host\"] }\naccess = \"read-only\"",
        "",
    ];
    for text in narrower {
        let new = Policy::parse(text).unwrap();
        assert_eq!(new.check_no_wider_than(&running), Ok(()), "{text}");
    }
    let wider = [
        "[[rule]]\nexports = [\"*\"]\nallow = { cn = [\"backup\"] }\naccess = \"read-write\"",
        "[[rule]]\nexports = [\"db-*\"]\nallow = { uri = [\"spiffe://example.org/ns/*/sa/vm-host\"] }\naccess = \"read-only\"",
        "[[rule]]\nexports = [\"*\"]\nallow = { cn = [\"intruder\"] }\naccess = \"read-only\"",
        "[[rule]]\nexports = [\"*\"]\nallow = { uri = [\"spiffe://example.org/ns/*/sa/*\"] }\naccess = \"read-only\"",
    ];
    for text in wider {
        let new = Policy::parse(text).unwrap();
        let error = new.check_no_wider_than(&running).unwrap_err().to_string();
        assert!(
            error.contains("rule 1 of the new policy may grant"),
            "{error}"
        );
    }
    assert!(Policy::open().check_no_wider_than(&running).is_err());
    assert_eq!(running.check_no_wider_than(&Policy::open()), Ok(()));
}

#[test]
fn stars_cover_neither_a_repeated_placeholder_nor_an_empty_segment() {
    let rule = |allow: &str| {
        Policy::parse(&format!(
            "[[rule]]\nexports = [\"*\"]\nallow = {{ {allow} }}\naccess = \"read-only\"\n"
        ))
        .unwrap()
    };
    for (running, wider) in [
        // `{a}.{a}` admits x.x.example only; `*.*` also x.y.example.
        ("dns = [\"{a}.{a}.example\"]", "dns = [\"*.*.example\"]"),
        ("dns = [\"{a}.{a}.example\"]", "dns = [\"{a}.{b}.example\"]"),
        ("dns = [\"{a}.{a}.example\"]", "dns = [\"x.{a}.example\"]"),
        // A `*` segment is never empty; a literal empty one is.
        (
            "uri = [\"spiffe://td/ns/*/sa/vm\"]",
            "uri = [\"spiffe://td/ns//sa/vm\"]",
        ),
        (
            "uri = [\"spiffe://td/ns/{a}/sa/vm\"]",
            "uri = [\"spiffe://td/ns//sa/vm\"]",
        ),
    ] {
        let result = rule(wider).check_no_wider_than(&rule(running));
        assert!(result.is_err(), "{wider} accepted under {running}");
    }
    for (running, narrower) in [
        ("dns = [\"{a}.{a}.example\"]", "dns = [\"x.x.example\"]"),
        ("dns = [\"{a}.{a}.example\"]", "dns = [\"{b}.{b}.example\"]"),
        ("dns = [\"*.*.example\"]", "dns = [\"{a}.{a}.example\"]"),
        ("dns = [\"{a}.*.example\"]", "dns = [\"{b}.{b}.example\"]"),
        (
            "uri = [\"spiffe://td/ns//sa/vm\"]",
            "uri = [\"spiffe://td/ns//sa/vm\"]",
        ),
    ] {
        let result = rule(narrower).check_no_wider_than(&rule(running));
        assert_eq!(result, Ok(()), "{narrower} refused under {running}");
    }
}

fn arb_rule() -> impl Strategy<Value = String> {
    let exports = prop::sample::select(vec![
        "*", "vm-*", "vm-1", "db-*", "db-1", "{ns}-*", "{ns}-1", "*-1",
    ]);
    let identity = prop::sample::select(vec![
        "cn = [\"backup\"]",
        "cn = [\"*\"]",
        "cn = [\"{ns}\"]",
        "uri = [\"spiffe://td/ns/*/sa/vm\"]",
        "uri = [\"spiffe://td/ns/{ns}/sa/vm\"]",
        "uri = [\"spiffe://td/ns/vm/sa/*\"]",
        "dns = [\"{ns}.example\"]",
        "dns = [\"*.example\"]",
        // A repeated placeholder matches only equal labels: it is not `*.*`.
        "dns = [\"{a}.{a}.example\"]",
        "dns = [\"{a}.{b}.example\"]",
        "dns = [\"*.*.example\"]",
        "dns = [\"x.{a}.example\"]",
        // An empty segment, which a `*` does not match.
        "uri = [\"spiffe://td/ns//sa/vm\"]",
        "uri = [\"spiffe://td/ns/{a}/sa/{a}\"]",
    ]);
    let access = prop::sample::select(vec!["read-only", "read-write"]);
    (prop::collection::vec(exports, 1..3), identity, access).prop_map(|(e, id, a)| {
        format!("[[rule]]\nexports = {e:?}\nallow = {{ {id} }}\naccess = \"{a}\"\n")
    })
}

fn arb_policy() -> impl Strategy<Value = Policy> {
    prop::collection::vec(arb_rule(), 0..4)
        .prop_map(|rules| rules.concat())
        .prop_filter_map("placeholders must be bound", |text| {
            Policy::parse(&text).ok()
        })
}

fn sample_certs() -> Vec<CertInfo> {
    let names = ["backup", "vm", "db", "x"];
    let mut certs = Vec::new();
    for cn in names {
        for ns in names {
            certs.push(cert(
                cn,
                &[&format!("{ns}.example")],
                &[
                    &format!("spiffe://td/ns/{ns}/sa/vm"),
                    &format!("spiffe://td/ns/vm/sa/{ns}"),
                ],
            ));
            // Two labels, equal or not, for the repeated placeholder.
            certs.push(cert(cn, &[&format!("{ns}.x.example")], &[]));
        }
    }
    // An empty segment, and a URI whose two placeholder segments differ.
    certs.push(cert("x", &[], &["spiffe://td/ns//sa/vm"]));
    certs.push(cert("x", &[], &["spiffe://td/ns/vm/sa/db"]));
    certs
}

proptest! {
    // The pairs that break a careless check are a few in thousands of
    // policies; these run in about a second.
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// What check_no_wider_than accepts never grants more than the
    /// running policy, for any identity and export name tried.
    #[test]
    fn an_accepted_reload_never_grants_more(running in arb_policy(), new in arb_policy()) {
        if new.check_no_wider_than(&running).is_ok() {
            let exports = ["vm-1", "vm-2", "db-1", "backup-1", "x-1", "1", "", "vm-", "db-x"];
            for cert in sample_certs() {
                for export in exports {
                    prop_assert!(
                        new.decide(&cert, export) <= running.decide(&cert, export),
                        "{cert:?} {export}"
                    );
                }
            }
        }
    }

    /// A policy is never wider than itself.
    #[test]
    fn a_policy_may_always_be_reloaded_unchanged(policy in arb_policy()) {
        prop_assert_eq!(policy.check_no_wider_than(&policy), Ok(()));
    }
}

/// The glob by the book (dynamic programming over pattern and name), to
/// check the linear one against.
fn reference_glob(pattern: &[char], name: &[char]) -> bool {
    let mut reach = vec![vec![false; name.len() + 1]; pattern.len() + 1];
    reach[0][0] = true;
    for p in 1..=pattern.len() {
        for n in 0..=name.len() {
            reach[p][n] = if pattern[p - 1] == '*' {
                reach[p - 1][n] || (n > 0 && reach[p][n - 1])
            } else {
                n > 0 && reach[p - 1][n - 1] && pattern[p - 1] == name[n - 1]
            };
        }
    }
    reach[pattern.len()][name.len()]
}

proptest! {
    #[test]
    fn export_globs_match_as_the_reference_does(
        pattern in "[ab*-]{0,8}",
        name in "[ab-]{0,12}",
    ) {
        let parsed = ExportPattern::parse(if pattern.is_empty() { "a".into() } else { pattern.clone() }).unwrap();
        let pattern: Vec<char> = parsed.text.chars().collect();
        let name_chars: Vec<char> = name.chars().collect();
        prop_assert_eq!(
            parsed.matches(&name, &Bindings::new()),
            reference_glob(&pattern, &name_chars)
        );
    }
}

#[test]
fn a_long_name_against_many_stars_is_decided_at_once() {
    // Backtracking would try about n^5 splits here; the client chooses n.
    let policy = Policy::parse(
        "[[rule]]\nexports = [\"*-*-*-*-*-x\"]\nallow = { cn = [\"a\"] }\naccess = \"read-only\"\n",
    )
    .unwrap();
    let name = "-".repeat(4096);
    let started = std::time::Instant::now();
    assert_eq!(policy.decide(&cert("a", &[], &[]), &name), None);
    assert!(started.elapsed() < std::time::Duration::from_secs(1));
}
