//! Key exchange groups (`--tls-groups`), in preference order.
//!
//! rustls 0.23's aws-lc-rs provider lists X25519MLKEM768 *last* in its
//! default groups unless the crate is built with `prefer-post-quantum`
//! (`DEFAULT_KX_GROUPS` in `crypto/aws_lc_rs/mod.rs`), and a rustls client
//! sends a key share for its first group only (plus the hybrid's X25519
//! half when the first is a hybrid). So nbdgw sets the provider's
//! `kx_groups` itself, from this list: by default the hybrid first, then
//! the classical groups for peers (GnuTLS's NORMAL) that do not offer it.
//!
//! A rustls server picks the first group of the *client's* list that it
//! supports (`choose_suite_and_kx_group` in `server/hs.rs`), so on the
//! server side the list says which groups are accepted; its order is used
//! only by the client side.

use std::fmt;

use rustls::crypto::aws_lc_rs::kx_group;
use rustls::crypto::SupportedKxGroup;
use rustls::NamedGroup;

/// `--tls-groups`'s default: rustls's own default with
/// `prefer-post-quantum`, as Chrome, Firefox and Go order them.
pub const DEFAULT_GROUPS: &str = "X25519MLKEM768,X25519,secp256r1,secp384r1";

/// Every group the provider has: the name nbdgw prints (rustls's, which
/// is also the IANA registry's and OpenSSL's for the hybrids), the other
/// spellings accepted (OpenSSL's), and the group. Names are compared
/// without case, so OpenSSL's `SecP256r1MLKEM768` needs no entry.
const KNOWN: &[(&str, &[&str], &dyn SupportedKxGroup)] = &[
    ("X25519MLKEM768", &[], kx_group::X25519MLKEM768),
    ("secp256r1MLKEM768", &[], kx_group::SECP256R1MLKEM768),
    ("X25519", &[], kx_group::X25519),
    ("secp256r1", &["P-256", "prime256v1"], kx_group::SECP256R1),
    ("secp384r1", &["P-384"], kx_group::SECP384R1),
    ("MLKEM768", &[], kx_group::MLKEM768),
    ("MLKEM1024", &[], kx_group::MLKEM1024),
];

/// The groups offered (client mode) or accepted (server mode), in order.
#[derive(Clone)]
pub struct KxGroups(Vec<&'static dyn SupportedKxGroup>);

impl KxGroups {
    /// Parses a comma-separated list of names, as `--tls-groups` takes it.
    pub fn parse(list: &str) -> Result<Self, String> {
        if list.trim().is_empty() {
            return Err(
                "empty group list: name at least one group (the default is ".to_string()
                    + DEFAULT_GROUPS
                    + ")",
            );
        }
        let mut groups: Vec<&'static dyn SupportedKxGroup> = Vec::new();
        for name in list.split(',').map(str::trim) {
            let Some(&(_, _, group)) = KNOWN.iter().find(|(canonical, others, _)| {
                canonical.eq_ignore_ascii_case(name)
                    || others.iter().any(|o| o.eq_ignore_ascii_case(name))
            }) else {
                let known: Vec<&str> = KNOWN.iter().map(|(n, _, _)| *n).collect();
                return Err(format!(
                    "unknown key exchange group {name:?}; known: {}",
                    known.join(", ")
                ));
            };
            if groups.iter().any(|g| g.name() == group.name()) {
                return Err(format!("key exchange group {name:?} is listed twice"));
            }
            groups.push(group);
        }
        Ok(KxGroups(groups))
    }

    /// The list for the provider's `kx_groups`.
    pub fn to_provider(&self) -> Vec<&'static dyn SupportedKxGroup> {
        self.0.clone()
    }

    /// Whether a TLS 1.2 peer could agree on any of them: the ML-KEM
    /// groups exist in TLS 1.3 only.
    pub fn usable_in_tls12(&self) -> bool {
        self.0
            .iter()
            .any(|g| g.usable_for_version(rustls::ProtocolVersion::TLSv1_2))
    }
}

impl KxGroups {
    /// Why the list is an expert's choice, if it is: a pure ML-KEM group
    /// with no hybrid, or before one, rests the secrecy on ML-KEM alone
    /// (young, as deployed cryptography goes), where the hybrid keeps
    /// X25519's too. Said once at start; the list is still used.
    pub fn pure_mlkem_warning(&self) -> Option<String> {
        let first = |wanted: &[NamedGroup]| self.0.iter().position(|g| wanted.contains(&g.name()));
        let pure = first(&[NamedGroup::MLKEM768, NamedGroup::MLKEM1024])?;
        let hybrid = first(&[NamedGroup::X25519MLKEM768, NamedGroup::secp256r1MLKEM768]);
        let why = match hybrid {
            None => "has a pure ML-KEM group and no hybrid",
            Some(h) if pure < h => "puts a pure ML-KEM group before the hybrid",
            Some(_) => return None,
        };
        Some(format!(
            "--tls-groups {self} {why}: a peer that takes it has only ML-KEM's secrecy, with no classical half (an expert choice; the default {DEFAULT_GROUPS} puts the hybrid first)"
        ))
    }
}

impl Default for KxGroups {
    fn default() -> Self {
        KxGroups::parse(DEFAULT_GROUPS).expect("the default groups are known")
    }
}

impl fmt::Debug for KxGroups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for KxGroups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.0.iter().map(|g| name(Some(g.name()))).collect();
        f.write_str(&names.join(","))
    }
}

/// A negotiated group's name for logs and the metric label: one of a
/// fixed few, so no peer chooses a series. "none" when no key exchange
/// took place (a resumed TLS 1.2 session, which nbdgw does not allow),
/// "other" for a group this table lacks (the provider has none such).
pub fn name(group: Option<NamedGroup>) -> &'static str {
    let Some(group) = group else {
        return "none";
    };
    KNOWN
        .iter()
        .find(|(_, _, known)| known.name() == group)
        .map_or("other", |(name, _, _)| name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_puts_the_hybrid_first_and_keeps_the_classical_groups() {
        let groups = KxGroups::default().to_provider();
        let names: Vec<NamedGroup> = groups.iter().map(|g| g.name()).collect();
        assert_eq!(
            names,
            [
                NamedGroup::X25519MLKEM768,
                NamedGroup::X25519,
                NamedGroup::secp256r1,
                NamedGroup::secp384r1
            ]
        );
        assert_eq!(KxGroups::default().to_string(), DEFAULT_GROUPS);
        assert!(KxGroups::default().usable_in_tls12());
    }

    #[test]
    fn takes_openssl_spellings_and_refuses_unknown_or_repeated_names() {
        let groups = KxGroups::parse("x25519, P-256,prime256v1").unwrap_err();
        assert!(groups.contains("listed twice"), "{groups}");
        let groups = KxGroups::parse("SecP256r1MLKEM768,x25519,P-384").unwrap();
        assert_eq!(groups.to_string(), "secp256r1MLKEM768,X25519,secp384r1");
        let err = KxGroups::parse("X25519,X448").unwrap_err();
        assert!(
            err.contains("unknown key exchange group \"X448\"") && err.contains("X25519MLKEM768"),
            "{err}"
        );
        let err = KxGroups::parse("").err().unwrap();
        assert!(err.starts_with("empty group list"), "{err}");
        assert!(KxGroups::parse(" ")
            .err()
            .unwrap()
            .starts_with("empty group list"));
        assert!(!KxGroups::parse("X25519MLKEM768").unwrap().usable_in_tls12());
    }

    #[test]
    fn warns_of_pure_mlkem_alone_or_before_a_hybrid() {
        let warning = |list: &str| KxGroups::parse(list).unwrap().pure_mlkem_warning();
        let alone = warning("MLKEM768").unwrap();
        assert!(
            alone.contains("MLKEM768 has a pure ML-KEM group and no hybrid"),
            "{alone}"
        );
        assert!(warning("X25519,MLKEM1024").unwrap().contains("no hybrid"));
        let before = warning("MLKEM1024,X25519MLKEM768,X25519").unwrap();
        assert!(before.contains("before the hybrid"), "{before}");
        assert_eq!(warning("X25519MLKEM768,MLKEM768,X25519"), None);
        assert_eq!(warning(DEFAULT_GROUPS), None);
        assert_eq!(warning("X25519,secp256r1"), None);
    }

    #[test]
    fn names_are_a_fixed_set() {
        assert_eq!(name(Some(NamedGroup::X25519MLKEM768)), "X25519MLKEM768");
        assert_eq!(name(Some(NamedGroup::X448)), "other");
        assert_eq!(name(Some(NamedGroup::Unknown(0x1234))), "other");
        assert_eq!(name(None), "none");
    }
}
