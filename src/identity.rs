//! Who a certificate names, and whether an allow-list admits it. No I/O:
//! the verifier and the loader both call in here.

use std::fmt;

use thiserror::Error;
use x509_parser::extensions::GeneralName;

use x509_parser::prelude::{FromDer, X509Certificate};

/// The parts of a certificate nbdgw logs and authorises on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CertInfo {
    /// The whole subject, as `CN=…, O=…`.
    pub subject: String,
    pub common_names: Vec<String>,
    pub dns_names: Vec<String>,
    pub uris: Vec<String>,
    /// Hex, as `openssl x509 -serial` prints it.
    pub serial: String,
    pub not_after: String,
    pub not_after_unix: i64,
    /// `AA:BB:…`, as `openssl x509 -fingerprint -sha256` prints it.
    pub sha256: String,
}

#[derive(Debug, Error)]
#[error("not a parsable X.509 certificate: {0}")]
pub struct CertParseError(String);

impl CertInfo {
    /// A certificate reduced to the names allow-lists and policies judge.
    pub fn with_names(cn: &str, dns: &[&str], uris: &[&str]) -> Self {
        let owned = |names: &[&str]| names.iter().map(|n| n.to_string()).collect();
        CertInfo {
            common_names: vec![cn.to_string()],
            dns_names: owned(dns),
            uris: owned(uris),
            ..CertInfo::default()
        }
    }

    pub fn from_der(der: &[u8]) -> Result<Self, CertParseError> {
        let (_, cert) =
            X509Certificate::from_der(der).map_err(|e| CertParseError(e.to_string()))?;
        let common_names = cert
            .subject()
            .iter_common_name()
            .filter_map(|cn| cn.as_str().ok().map(String::from))
            .collect();
        let mut dns_names = Vec::new();
        let mut uris = Vec::new();
        // A certificate with a malformed SAN extension simply names nothing
        // there; chain validation has already judged its structure.
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for name in &san.value.general_names {
                match name {
                    GeneralName::DNSName(dns) => dns_names.push(dns.to_string()),
                    GeneralName::URI(uri) => uris.push(uri.to_string()),
                    _ => {}
                }
            }
        }
        let not_after = cert.validity().not_after;
        Ok(CertInfo {
            subject: cert.subject().to_string(),
            common_names,
            dns_names,
            uris,
            serial: cert.raw_serial_as_string().replace(':', "").to_uppercase(),
            not_after: not_after.to_string(),
            not_after_unix: not_after.timestamp(),
            sha256: sha256_fingerprint(der),
        })
    }

    /// Whole days until the certificate expires (negative once it has).
    pub fn days_left(&self, now_unix: i64) -> i64 {
        (self.not_after_unix - now_unix).div_euclid(86_400)
    }
}

/// How a client is named in log lines: every name an allow-list could
/// match. Any peer can present any certificate, so every name is quoted
/// on its own with quotes, backslashes, control and format characters
/// escaped: a CN of `x", DNS admin` cannot pass for a second name, nor a
/// URI with a space for two.
impl fmt::Display for CertInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "subject {:?}", self.subject)?;
        if !self.dns_names.is_empty() {
            write!(f, ", DNS {:?}", self.dns_names)?;
        }
        if !self.uris.is_empty() {
            write!(f, ", URI {:?}", self.uris)?;
        }
        write!(f, ", serial {}", self.serial)
    }
}

/// A certificate's names for a log line, or why it has none.
pub fn describe(der: &[u8]) -> String {
    match CertInfo::from_der(der) {
        Ok(info) => info.to_string(),
        Err(e) => crate::logsafe::escape(&e.to_string()).into_owned(),
    }
}

pub fn sha256_fingerprint(der: &[u8]) -> String {
    let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, der);
    digest
        .as_ref()
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PatternError {
    #[error("empty {0} pattern")]
    Empty(&'static str),
    #[error("{kind} pattern {pattern:?}: a '*' must stand alone for one whole {unit}")]
    PartialWildcard {
        kind: &'static str,
        pattern: String,
        unit: &'static str,
    },
}

/// Client identities admitted after chain validation. The lists are OR-ed;
/// with all three empty every certificate from the client CA is admitted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowList {
    common_names: Vec<String>,
    dns_names: Vec<String>,
    uris: Vec<String>,
}

impl AllowList {
    /// Common names match exactly. In DNS names a `*` label matches one
    /// label (case-insensitively, as DNS is); in URIs a `*` matches one
    /// `/`-separated segment (SPIFFE IDs: `spiffe://td/ns/*/sa/backup`).
    pub fn new(
        common_names: Vec<String>,
        dns_names: Vec<String>,
        uris: Vec<String>,
    ) -> Result<Self, PatternError> {
        if common_names.iter().any(String::is_empty) {
            return Err(PatternError::Empty("--allow-cn"));
        }
        for pattern in &dns_names {
            check_pattern(pattern, DNS)?;
        }
        for pattern in &uris {
            check_pattern(pattern, URI)?;
        }
        Ok(AllowList {
            common_names,
            dns_names,
            uris,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.common_names.is_empty() && self.dns_names.is_empty() && self.uris.is_empty()
    }

    pub fn permits(&self, cert: &CertInfo) -> bool {
        if self.is_empty() {
            return true;
        }
        let cn = cert
            .common_names
            .iter()
            .any(|cn| self.common_names.contains(cn));
        let dns = cert.dns_names.iter().any(|name| {
            self.dns_names
                .iter()
                .any(|pattern| matches(pattern, name, DNS))
        });
        let uri = cert
            .uris
            .iter()
            .any(|uri| self.uris.iter().any(|pattern| matches(pattern, uri, URI)));
        cn || dns || uri
    }
}

struct Syntax {
    flag: &'static str,
    separator: char,
    unit: &'static str,
    ignore_case: bool,
}

const DNS: Syntax = Syntax {
    flag: "--allow-dns",
    separator: '.',
    unit: "label",
    ignore_case: true,
};
const URI: Syntax = Syntax {
    flag: "--allow-uri",
    separator: '/',
    unit: "path segment",
    ignore_case: false,
};

fn check_pattern(pattern: &str, syntax: Syntax) -> Result<(), PatternError> {
    if pattern.is_empty() {
        return Err(PatternError::Empty(syntax.flag));
    }
    let partial = pattern
        .split(syntax.separator)
        .any(|part| part.contains('*') && part != "*");
    if partial {
        return Err(PatternError::PartialWildcard {
            kind: syntax.flag,
            pattern: pattern.to_string(),
            unit: syntax.unit,
        });
    }
    Ok(())
}

/// Part by part: a `*` part matches any one non-empty part, so it never
/// spans a separator and never matches nothing.
fn matches(pattern: &str, value: &str, syntax: Syntax) -> bool {
    let mut patterns = pattern.split(syntax.separator);
    let mut values = value.split(syntax.separator);
    loop {
        match (patterns.next(), values.next()) {
            (None, None) => return true,
            (Some("*"), Some(part)) if !part.is_empty() => {}
            (Some(p), Some(v)) if syntax.ignore_case && p.eq_ignore_ascii_case(v) => {}
            (Some(p), Some(v)) if p == v => {}
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cert(cn: &str, dns: &[&str], uris: &[&str]) -> CertInfo {
        CertInfo::with_names(cn, dns, uris)
    }

    fn allow(cn: &[&str], dns: &[&str], uris: &[&str]) -> AllowList {
        let v = |xs: &[&str]| xs.iter().map(|s| s.to_string()).collect();
        AllowList::new(v(cn), v(dns), v(uris)).unwrap()
    }

    #[test]
    fn uri_star_matches_exactly_one_segment() {
        let list = allow(&[], &[], &["spiffe://td/ns/*/sa/backup"]);
        let ok = cert("x", &[], &["spiffe://td/ns/prod/sa/backup"]);
        assert!(list.permits(&ok));
        for refused in [
            "spiffe://td/ns/prod/sa/other",
            "spiffe://td/ns/a/b/sa/backup",
            "spiffe://td/ns//sa/backup",
            "spiffe://td/ns/prod/sa/backup/extra",
            "spiffe://other/ns/prod/sa/backup",
            "SPIFFE://td/ns/prod/sa/backup",
        ] {
            assert!(!list.permits(&cert("x", &[], &[refused])), "{refused}");
        }
    }

    #[test]
    fn dns_star_matches_one_label_case_insensitively() {
        let list = allow(&[], &["*.backup.example.com"], &[]);
        assert!(list.permits(&cert("x", &["node1.Backup.example.COM"], &[])));
        assert!(!list.permits(&cert("x", &["a.node1.backup.example.com"], &[])));
        assert!(!list.permits(&cert("x", &["backup.example.com"], &[])));
    }

    #[test]
    fn lists_are_ored_and_cn_is_exact() {
        let list = allow(&["backup-agent"], &["host.example"], &[]);
        assert!(list.permits(&cert("backup-agent", &[], &[])));
        assert!(list.permits(&cert("other", &["host.example"], &[])));
        assert!(!list.permits(&cert("Backup-Agent", &[], &[])));
        assert!(!list.permits(&cert("backup-agent2", &["other.example"], &[])));
        assert!(AllowList::default().permits(&cert("anyone", &[], &[])));
    }

    #[test]
    fn partial_wildcards_and_empty_patterns_are_refused() {
        let err = AllowList::new(vec![], vec!["a*.example".into()], vec![]).unwrap_err();
        assert!(err.to_string().contains("one whole label"), "{err}");
        let err = AllowList::new(vec![], vec![], vec!["spiffe://td/ns/x*".into()]).unwrap_err();
        assert!(err.to_string().contains("--allow-uri"), "{err}");
        assert_eq!(
            AllowList::new(vec![String::new()], vec![], vec![]).unwrap_err(),
            PatternError::Empty("--allow-cn")
        );
    }

    proptest! {
        #[test]
        fn a_name_always_matches_itself_and_star_never_crosses_a_separator(
            segments in proptest::collection::vec("[a-z0-9-]{1,8}", 1..6),
            star in 0usize..6,
        ) {
            let uri = segments.join("/");
            prop_assert!(matches(&uri, &uri, URI));
            let star = star % segments.len();
            let mut pattern = segments.clone();
            pattern[star] = "*".into();
            let pattern = pattern.join("/");
            prop_assert!(matches(&pattern, &uri, URI));
            let longer = format!("{uri}/x");
            prop_assert!(!matches(&pattern, &longer, URI));
        }
    }
}

#[cfg(test)]
mod display_tests {
    use super::*;

    /// Review finding: a CN holding `", DNS admin.example.org` read in the
    /// log as a second name.
    #[test]
    fn names_in_log_lines_cannot_pass_for_other_names() {
        let mut info = CertInfo::with_names("x\", DNS admin.example.org", &[], &["spiffe://a/b c"]);
        info.subject = "CN=x\", DNS admin.example.org\u{202e}".into();
        let shown = info.to_string();
        // The quote inside the CN is escaped, so the only `, DNS` that
        // follows a closing quote would be a real DNS name (none here).
        assert_eq!(
            shown,
            format!(
                r#"subject "CN=x\", DNS admin.example.org\u{{202e}}", URI ["spiffe://a/b c"], serial {}"#,
                info.serial
            )
        );
    }
}
