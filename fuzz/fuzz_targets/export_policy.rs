//! Export names and certificate names come from clients: judging them
//! against a policy (globs with many stars, placeholders) must never
//! panic, nor take long, however they are made. The policy file's parser
//! gets the same bytes as a file, and must fail cleanly on garbage. A
//! templated rule must never open a name outside the identity's tenant.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use nbdgw::policy::{Access, Policy};
use nbdgw::identity::CertInfo;

const POLICY: &str = r#"
[[rule]]
exports = ["*-*-*-*-x", "vm-*"]
allow = { uri = ["spiffe://td/ns/*/sa/vm-host"], cn = ["backup"] }
access = "read-write"

[[rule]]
exports = ["{ns}/*", "x/{ns}/*-*-y", "{ns}"]
allow = { uri = ["spiffe://td/ns/{ns}/sa/*"], dns = ["{ns}.tenants.example"], cn = ["{ns}"] }
access = "read-only"
"#;

fuzz_target!(|data: &[u8]| {
    static FIXED: OnceLock<Policy> = OnceLock::new();
    let policy = FIXED.get_or_init(|| Policy::parse(POLICY).expect("the fixed policy parses"));
    let _ = Policy::parse(&String::from_utf8_lossy(data));
    let (name, identity) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &b""[..]),
    };
    let identity = String::from_utf8_lossy(identity);
    let cert = CertInfo::with_names(&identity, &[&identity], &[&identity]);
    let name = String::from_utf8_lossy(name);
    // Tenants stay apart: whatever the names, the templated rule (the
    // only read-only one) opens a name only when its first segment, or
    // the second under `x/`, is the identity's whole CN (or a part bound
    // from its DNS name or URI, which cannot hold a `/` either).
    if policy.decide(&cert, &name) == Some(Access::ReadOnly) {
        let segments: Vec<&str> = name.split('/').collect();
        let lowered = identity.to_ascii_lowercase();
        let is_mine = |tenant: &&str| {
            !tenant.is_empty()
                && *tenant != ".."
                && (identity == **tenant
                    || identity.contains(&format!("/{tenant}/"))
                    || lowered.starts_with(&format!("{tenant}.")))
        };
        let tenants = match segments[..] {
            ["x", second, ..] => vec![segments[0], second],
            _ => vec![segments[0]],
        };
        assert!(tenants.iter().any(is_mine), "{identity:?} opens {name:?}");
    }
});
