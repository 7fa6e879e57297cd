//! Client certificates arrive from unauthenticated peers: parsing one and
//! matching it against allow-lists must never panic, and the names it
//! puts in a log line must never carry a control character.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nbdgw::identity::{AllowList, CertInfo};

fuzz_target!(|data: &[u8]| {
    let described = nbdgw::identity::describe(data);
    assert!(
        !described.chars().any(char::is_control),
        "a control character reaches the log: {described:?}"
    );
    if let Ok(info) = CertInfo::from_der(data) {
        let allow = AllowList::new(
            vec!["agent".into()],
            vec!["*.example.com".into()],
            vec!["spiffe://td/ns/*/sa/x".into()],
        )
        .expect("valid patterns");
        let _ = allow.permits(&info);
        let _ = info.days_left(0);
    }
});
