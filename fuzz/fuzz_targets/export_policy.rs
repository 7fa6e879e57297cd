//! Export names and certificate names come from clients: judging them
//! against a policy (globs with many stars, placeholders) must never
//! panic, nor take long, however they are made. The policy file's parser
//! gets the same bytes as a file, and must fail cleanly on garbage.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use nbdgw::policy::Policy;
use nbdgw::tls::CertInfo;

const POLICY: &str = r#"
[[rule]]
exports = ["*-*-*-*-x", "vm-*"]
allow = { uri = ["spiffe://td/ns/*/sa/vm-host"], cn = ["backup"] }
access = "read-write"

[[rule]]
exports = ["{ns}-*", "*{ns}*"]
allow = { uri = ["spiffe://td/ns/{ns}/sa/*"], dns = ["{ns}.tenants.example"] }
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
    let _ = policy.decide(&cert, &String::from_utf8_lossy(name));
});
