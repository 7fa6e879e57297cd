//! Which client identities may open which exports, and with what access:
//! the `--policy` file, parsed and judged without I/O.
//!
//! ```toml
//! [[rule]]
//! exports = ["{ns}/*"]                                      # globs over export names
//! allow = { uri = ["spiffe://example.org/ns/{ns}/sa/*"] }   # cn / dns / uri
//! access = "read-write"                                     # or "read-only"
//! ```
//!
//! A client may open an export when a rule's identity pattern matches its
//! certificate and one of that rule's export patterns matches the name;
//! with several rules, the most permissive access wins. A `{name}`
//! placeholder in an identity pattern binds one whole label (DNS), path
//! segment (URI) or the whole CN, and stands for that text in the rule's
//! export patterns, so one rule gives every tenant its own exports.
//!
//! Tenants stay apart by construction, not by care in the file: in an
//! export pattern a placeholder must be one whole `/`-separated segment
//! (`{ns}/*`, never `{ns}-*`), a `*` never matches a `/`, and a bound
//! value holding a `/` (or NUL, or being `.` or `..`) matches nothing. So
//! the name's segment at the placeholder is the tenant, exactly: `team`
//! cannot reach `team-prod/db`, though `team-prod-db` starts with `team`.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use thiserror::Error;
use toml::Spanned;

use crate::identity::CertInfo;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Access {
    ReadOnly,
    ReadWrite,
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Access::ReadOnly => "read-only",
            Access::ReadWrite => "read-write",
        })
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("{}not a valid policy file: {message}", at.map(|at| at.to_string()).unwrap_or_default())]
    Syntax {
        /// Where in the file, when the parser could say.
        at: Option<Location>,
        message: String,
    },
    #[error("{}rule {rule}: {problem}", at.map(|at| at.to_string()).unwrap_or_default())]
    Rule {
        rule: usize,
        /// Where in the file: the pattern the problem is in, else the rule.
        at: Option<Location>,
        problem: String,
    },
    #[error("rule {rule} of the new policy may grant what the running one does not ({why}); access can only be narrowed while nbdgw runs: restart it to widen access")]
    Wider { rule: usize, why: String },
}

/// A place in the policy file, counted from 1 (columns in characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub line: usize,
    pub column: usize,
}

impl PolicyError {
    /// Where in the file the problem is, when it is in one place.
    pub fn location(&self) -> Option<Location> {
        match self {
            PolicyError::Syntax { at, .. } | PolicyError::Rule { at, .. } => *at,
            PolicyError::Wider { .. } => None,
        }
    }

    /// The problem without its location, for a caller that puts the
    /// location elsewhere (`FILE:LINE:COLUMN: problem`).
    pub fn problem(&self) -> String {
        match self {
            PolicyError::Syntax { message, .. } => format!("not a valid policy file: {message}"),
            PolicyError::Rule { rule, problem, .. } => format!("rule {rule}: {problem}"),
            PolicyError::Wider { .. } => self.to_string(),
        }
    }
}

impl Location {
    /// The place of byte `offset` in `text`.
    pub fn of(text: &str, offset: usize) -> Self {
        let before = text.get(..offset).unwrap_or(text);
        let line_start = before.rfind('\n').map_or(0, |at| at + 1);
        Location {
            line: before.matches('\n').count() + 1,
            column: before[line_start..].chars().count() + 1,
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}, column {}: ", self.line, self.column)
    }
}

/// A rule's problem, and the byte range in the file of the pattern it
/// is in, when it is one pattern's.
type RuleProblem = (Option<std::ops::Range<usize>>, String);

/// The file as written; `deny_unknown_fields` so a misspelt key is an
/// error instead of a rule that silently matches nothing (or everything).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileShape {
    /// Spanned so a rule can be named by its line.
    #[serde(default)]
    rule: Vec<Spanned<RuleShape>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleShape {
    /// Spanned so an error in one pattern can say where it is.
    exports: Vec<Spanned<String>>,
    allow: AllowShape,
    access: Access,
}

/// Spanned, as `exports`, so a bad pattern is reported where it is.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct AllowShape {
    #[serde(default)]
    cn: Vec<Spanned<String>>,
    #[serde(default)]
    dns: Vec<Spanned<String>>,
    #[serde(default)]
    uri: Vec<Spanned<String>>,
}

/// One piece of a pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    /// `*`: in an export name any run of characters; in an identity one
    /// whole, non-empty label or segment.
    Any,
    Placeholder(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Cn,
    Dns,
    Uri,
}

impl Field {
    /// What one part of the value is: the whole CN, a DNS label, a URI
    /// path segment.
    fn separator(self) -> Option<char> {
        match self {
            Field::Cn => None,
            Field::Dns => Some('.'),
            Field::Uri => Some('/'),
        }
    }

    /// The key of the `allow` table that holds this field's patterns.
    fn key(self) -> &'static str {
        match self {
            Field::Cn => "cn",
            Field::Dns => "dns",
            Field::Uri => "uri",
        }
    }

    fn values(self, cert: &CertInfo) -> &[String] {
        match self {
            Field::Cn => &cert.common_names,
            Field::Dns => &cert.dns_names,
            Field::Uri => &cert.uris,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct IdentityPattern {
    field: Field,
    text: String,
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct ExportPattern {
    text: String,
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    exports: Vec<ExportPattern>,
    identities: Vec<IdentityPattern>,
    access: Access,
    /// Where the rule starts in its file (not part of what it grants).
    line: usize,
}

/// Which rule of a policy: its number (the Nth `[[rule]]`, from 1) and
/// the line it starts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuleRef {
    pub number: usize,
    pub line: usize,
}

/// What a policy decided for one identity and export: the access, and
/// the rule that granted it (`None`: no policy, everyone read-write).
/// With several rules granting, the most permissive access wins and the
/// first rule in the file granting that access is the one named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub access: Access,
    pub rule: Option<RuleRef>,
}

/// One rule granting an identity an export, as `nbdgw policy explain`
/// shows it: the rule, its access and patterns, the identity pattern that
/// admitted the certificate, and what its placeholders were bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub rule: RuleRef,
    pub access: Access,
    pub exports: Vec<String>,
    /// `cn`, `dns` or `uri`, and the pattern as written.
    pub admitted_by: (&'static str, String),
    pub bindings: Vec<(String, String)>,
}

type Bindings = BTreeMap<String, String>;

/// What a certificate's names bound in one rule, as `(placeholder,
/// value)` pairs.
pub type RuleBindings = (RuleRef, Vec<(String, String)>);

/// Why a certificate is not one tenant across the templated rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotOneTenant {
    /// Two rules it binds use placeholder sets neither of which contains
    /// the other (`{ns}` and `{team}`, or `{ns}, {sa}` and `{tenant},
    /// {sa}`): they may name the tenant apart, so whatever values it
    /// binds, it is not known to be one tenant.
    Apart,
    /// Its names bind one placeholder to two values (`{ns}` = `a` by its
    /// URI SAN, `b` by its DNS SAN).
    TwoValues,
}

/// One certificate, one tenant, across the whole policy: every binding
/// the certificate's names make in templated rules (kept to the
/// placeholders those rules' exports use) must agree with every other on
/// each placeholder they share, and the placeholder sets of the rules
/// that bound anything must be nested (of any two, one contains the
/// other). Sharing one placeholder is not enough: rules naming the
/// tenant `{ns}` in one and `{tenant}` in the other, both also using
/// `{sa}`, would agree on `{sa}` and still give a certificate binding
/// `a` in one and `b` in the other both tenants. Nested sets leave each
/// placeholder one value that every rule using it sees, so two rules
/// that each grant `{ns}/*` cannot give a certificate whose URI SAN binds
/// `a` in one and whose DNS SAN binds `b` in the other both tenants, and
/// rules naming the tenant apart (`{ns}` and `{team}`) grant a
/// certificate both bind nothing (fail closed; name the tenant alike in
/// every rule). `sets` are the placeholder sets of the rules that bound
/// anything, each once.
fn one_tenant(all: &[Bindings], sets: &[Vec<&str>]) -> Result<(), NotOneTenant> {
    let nested = sets
        .iter()
        .enumerate()
        .all(|(i, a)| sets[i + 1..].iter().all(|b| nested(a, b)));
    if !nested {
        return Err(NotOneTenant::Apart);
    }
    let mut seen = Bindings::new();
    let agree = all.iter().flatten().all(|(name, value)| {
        seen.entry(name.clone())
            .or_insert_with(|| value.clone())
            .as_str()
            == value
    });
    if agree {
        Ok(())
    } else {
        Err(NotOneTenant::TwoValues)
    }
}

/// Whether one of two placeholder sets contains the other.
fn nested(a: &[&str], b: &[&str]) -> bool {
    a.iter().all(|name| b.contains(name)) || b.iter().all(|name| a.contains(name))
}

/// What `nbdgw policy check` and the gateway (at start and each reload)
/// say of two templated rules whose placeholder sets are not nested.
pub fn apart_warning(a: RuleRef, b: RuleRef) -> String {
    format!(
        "rules {} (line {}) and {} (line {}) use placeholder sets in their exports neither of which contains the other (they may name the tenant apart): a certificate both bind is not known to be one tenant and gets nothing from any templated rule; name the tenant alike in both",
        a.number, a.line, b.number, b.line
    )
}

/// The rules in force. Without `--policy` it is [`Policy::open`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// None: every admitted client may open every export read-write.
    rules: Option<Vec<Rule>>,
    /// Templated rules (or identity patterns of them) that a policy
    /// earlier in this process had and a reload dropped. They grant
    /// nothing, but still count in the one-tenant check
    /// ([`Policy::one_tenant`]) for the life of the process: a certificate
    /// a dropped rule kept out for binding two tenants stays out, so
    /// dropping a templated rule only ever narrows.
    retired: Vec<Rule>,
}

impl Policy {
    /// Every client the `--allow-*` flags admit may open every export
    /// read-write (nbdgw without `--policy`).
    pub fn open() -> Self {
        Policy {
            rules: None,
            retired: Vec::new(),
        }
    }

    /// How many rules; `None` for the open policy.
    pub fn rule_count(&self) -> Option<usize> {
        self.rules.as_ref().map(Vec::len)
    }

    /// Whether any rule limits anything (false without `--policy`).
    pub fn is_open(&self) -> bool {
        self.rules.is_none()
    }

    pub fn parse(text: &str) -> Result<Self, PolicyError> {
        let shape: FileShape = toml::from_str(text).map_err(|e| PolicyError::Syntax {
            at: e.span().map(|span| Location::of(text, span.start)),
            message: e.message().to_string(),
        })?;
        let rules = shape
            .rule
            .into_iter()
            .enumerate()
            .map(|(i, rule)| {
                let whole = rule.span();
                let line = Location::of(text, whole.start).line;
                Rule::parse(rule.into_inner(), line).map_err(|(span, problem)| PolicyError::Rule {
                    rule: i + 1,
                    at: Some(Location::of(text, span.unwrap_or(whole).start)),
                    problem,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Policy {
            rules: Some(rules),
            retired: Vec::new(),
        })
    }

    /// The access `cert` has to `export`, if any.
    pub fn decide(&self, cert: &CertInfo, export: &str) -> Option<Access> {
        self.decide_with_rule(cert, export).map(|d| d.access)
    }

    /// The access `cert` has to `export`, if any, and the rule that
    /// granted it: the first in the file of those granting the most.
    pub fn decide_with_rule(&self, cert: &CertInfo, export: &str) -> Option<Decision> {
        let Some(rules) = &self.rules else {
            return Some(Decision {
                access: Access::ReadWrite,
                rule: None,
            });
        };
        let tenant = self.one_tenant(cert).is_ok();
        rules
            .iter()
            .enumerate()
            .filter(|(_, rule)| rule.admitting(cert, export, tenant).is_some())
            .map(|(i, rule)| Decision {
                access: rule.access,
                rule: Some(rule.reference(i)),
            })
            .reduce(|best, next| {
                if next.access > best.access {
                    next
                } else {
                    best
                }
            })
    }

    /// Every rule granting `cert` the export, in file order (none for
    /// the open policy, which has no rules).
    pub fn grants(&self, cert: &CertInfo, export: &str) -> Vec<Grant> {
        let Some(rules) = &self.rules else {
            return Vec::new();
        };
        let tenant = self.one_tenant(cert).is_ok();
        rules
            .iter()
            .enumerate()
            .filter_map(|(i, rule)| {
                let (identity, bindings) = rule.admitting(cert, export, tenant)?;
                Some(Grant {
                    rule: rule.reference(i),
                    access: rule.access,
                    exports: rule.exports.iter().map(|e| e.text.clone()).collect(),
                    admitted_by: (identity.field.key(), identity.text.clone()),
                    bindings: bindings.into_iter().collect(),
                })
            })
            .collect()
    }

    /// When `cert` is not one tenant across the templated rules (so
    /// those rules grant it nothing): why, and every binding they made,
    /// with its rule, for `nbdgw policy explain` and the refusal log to
    /// show. `None` when the certificate is one tenant (or the policy is
    /// open). Rules a reload dropped count too but are not listed.
    pub fn two_tenants(&self, cert: &CertInfo) -> Option<(NotOneTenant, Vec<RuleBindings>)> {
        let rules = self.rules.as_ref()?;
        let why = self.one_tenant(cert).err()?;
        let mut seen = Vec::new();
        for (i, rule) in rules.iter().enumerate().filter(|(_, r)| r.templated()) {
            for bindings in rule.tenant_bindings(cert) {
                let bindings: Vec<(String, String)> = bindings.into_iter().collect();
                let entry = (rule.reference(i), bindings);
                if !seen.contains(&entry) {
                    seen.push(entry);
                }
            }
        }
        Some((why, seen))
    }

    /// Pairs of templated rules whose exports' placeholder sets are not
    /// nested (neither contains the other): a certificate both bind is
    /// not known to be one tenant, so it gets nothing from any templated
    /// rule (see [`one_tenant`]). Said by `nbdgw policy check` and logged
    /// at start and at each reload, since that is rarely what was meant.
    pub fn unrelated_templates(&self) -> Vec<(RuleRef, RuleRef)> {
        let Some(rules) = &self.rules else {
            return Vec::new();
        };
        let templated: Vec<(RuleRef, Vec<&str>)> = rules
            .iter()
            .enumerate()
            .filter(|(_, rule)| rule.templated())
            .map(|(i, rule)| (rule.reference(i), rule.used()))
            .collect();
        let mut pairs = Vec::new();
        for (i, (a, used_a)) in templated.iter().enumerate() {
            for (b, used_b) in &templated[i + 1..] {
                if !nested(used_a, used_b) {
                    pairs.push((*a, *b));
                }
            }
        }
        pairs
    }

    /// Whether `cert` is one tenant across every templated rule of this
    /// policy and those reloads retired (see [`one_tenant`]).
    fn one_tenant(&self, cert: &CertInfo) -> Result<(), NotOneTenant> {
        let mut all = Vec::new();
        let mut sets: Vec<Vec<&str>> = Vec::new();
        let rules = self.rules.iter().flatten().chain(&self.retired);
        for rule in rules.filter(|rule| rule.templated()) {
            let bound = rule.tenant_bindings(cert);
            if bound.is_empty() {
                continue;
            }
            let used = rule.used();
            if !sets.contains(&used) {
                sets.push(used);
            }
            all.extend(bound);
        }
        one_tenant(&all, &sets)
    }

    /// Whether any rule admits `cert` at all, to any export: an identity
    /// no rule names has no business with any upstream, so with the
    /// single `--upstream` nbdgw connects it only for identities this
    /// holds for (and only once an option needs it).
    pub fn grants_anything(&self, cert: &CertInfo) -> bool {
        let Some(rules) = &self.rules else {
            return true;
        };
        let tenant = self.one_tenant(cert).is_ok();
        rules.iter().any(|rule| {
            (tenant || !rule.templated())
                && rule.identities.iter().any(|identity| {
                    identity
                        .field
                        .values(cert)
                        .iter()
                        .any(|value| identity.bind(value).is_some())
                })
        })
    }

    /// This policy as the replacement of `running` at a reload: refused
    /// if it might grant what `running` does not
    /// ([`Policy::check_no_wider_than`]); else carrying, as retired, the
    /// templated rules `running` had (or had retired) that this one drops
    /// or drops an identity pattern of. One certificate, one tenant is
    /// judged across the templated rules together, so a dropped rule
    /// could otherwise give a certificate it kept out what it binds in
    /// the others; retired, it still counts and grants nothing, so a
    /// reload dropping it only narrows.
    pub fn replacing(mut self, running: &Policy) -> Result<Policy, PolicyError> {
        self.check_no_wider_than(running)?;
        let kept = self.rules.clone().unwrap_or_default();
        let dropped = running
            .rules
            .iter()
            .flatten()
            .chain(&running.retired)
            .filter(|old| old.templated() && !kept.iter().any(|rule| rule.keeps(old)));
        for old in dropped {
            if !self.retired.iter().any(|done| done.keeps(old)) {
                self.retired.push(old.clone());
            }
        }
        Ok(self)
    }

    /// Refuses a replacement that might grant any identity an export, or
    /// an access, the running policy does not. Judged rule by rule and
    /// conservatively: a rule the running one does not plainly cover is
    /// refused even if it happens to grant nothing new. Sound only with
    /// the running policy's dropped templated rules carried as retired:
    /// use [`Policy::replacing`].
    pub fn check_no_wider_than(&self, running: &Policy) -> Result<(), PolicyError> {
        let Some(running) = &running.rules else {
            return Ok(());
        };
        let Some(new) = &self.rules else {
            return Err(PolicyError::Wider {
                rule: 0,
                why: "no policy admits everyone read-write".into(),
            });
        };
        for (i, rule) in new.iter().enumerate() {
            if !running.iter().any(|old| old.covers(rule)) {
                let exports: Vec<&str> = rule.exports.iter().map(|e| e.text.as_str()).collect();
                return Err(PolicyError::Wider {
                    rule: i + 1,
                    why: format!("exports {exports:?}, {}", rule.access),
                });
            }
        }
        Ok(())
    }
}

impl Rule {
    fn parse(shape: RuleShape, line: usize) -> Result<Self, RuleProblem> {
        if shape.exports.is_empty() {
            return Err((
                None,
                "`exports` is empty: name at least one pattern (\"*\" for all)".into(),
            ));
        }
        let mut identities = Vec::new();
        for (field, texts) in [
            (Field::Cn, shape.allow.cn),
            (Field::Dns, shape.allow.dns),
            (Field::Uri, shape.allow.uri),
        ] {
            for spanned in texts {
                let span = spanned.span();
                identities.push(
                    IdentityPattern::parse(field, spanned.into_inner())
                        .map_err(|e| (Some(span), e))?,
                );
            }
        }
        if identities.is_empty() {
            return Err((None, "`allow` names no identity (cn, dns or uri)".into()));
        }
        let mut exports = Vec::new();
        for spanned in shape.exports {
            let span = spanned.span();
            let export = ExportPattern::parse(spanned.into_inner())
                .map_err(|problem| (Some(span.clone()), problem))?;
            for name in export.placeholders() {
                if let Some(unbound) = identities.iter().find(|id| !id.binds(name)) {
                    return Err((
                        Some(span),
                        format!(
                            "placeholder {{{name}}} in {:?} is not bound by the identity pattern {:?}",
                            export.text, unbound.text
                        ),
                    ));
                }
            }
            exports.push(export);
        }
        Ok(Rule {
            exports,
            identities,
            access: shape.access,
            line,
        })
    }

    fn templated(&self) -> bool {
        self.exports.iter().any(|e| !e.placeholders().is_empty())
    }

    /// The placeholders this rule's exports use, each once, sorted.
    fn used(&self) -> Vec<&str> {
        let mut used: Vec<&str> = self.exports.iter().flat_map(|e| e.placeholders()).collect();
        used.sort_unstable();
        used.dedup();
        used
    }

    /// What `cert`'s names bind in this rule, kept to the placeholders
    /// its exports use. Placeholders only the identity patterns use
    /// (`{host}` in `{host}.{ns}.svc`) may differ: they name no tenant.
    fn tenant_bindings(&self, cert: &CertInfo) -> Vec<Bindings> {
        let used = self.used();
        self.identities
            .iter()
            .flat_map(|identity| {
                identity
                    .field
                    .values(cert)
                    .iter()
                    .filter_map(|value| identity.bind(value))
            })
            .map(|mut bindings| {
                bindings.retain(|name, _| used.contains(&name.as_str()));
                bindings
            })
            .collect()
    }

    fn reference(&self, index: usize) -> RuleRef {
        RuleRef {
            number: index + 1,
            line: self.line,
        }
    }

    /// If this rule admits `cert` to `export`: the identity pattern that
    /// matched, and what it bound. `one_tenant`: whether the certificate
    /// is one tenant across the policy's templated rules
    /// ([`Policy::one_tenant`]); if not, a templated rule admits it nowhere.
    fn admitting(
        &self,
        cert: &CertInfo,
        export: &str,
        one_tenant: bool,
    ) -> Option<(&IdentityPattern, Bindings)> {
        if !one_tenant && self.templated() {
            return None;
        }
        self.identities.iter().find_map(|identity| {
            identity
                .field
                .values(cert)
                .iter()
                .filter_map(|value| identity.bind(value))
                .find(|bindings| self.exports.iter().any(|e| e.matches(export, bindings)))
                .map(|bindings| (identity, bindings))
        })
    }

    /// Whether this (new) rule keeps everything the running templated
    /// rule `old` adds to the one-tenant check: all its identity patterns
    /// and the same placeholders in its exports, so every binding `old`
    /// made is still made and compared.
    fn keeps(&self, old: &Rule) -> bool {
        self.templated()
            && self.used() == old.used()
            && old.identities.iter().all(|id| self.identities.contains(id))
    }

    /// Whether every grant of `new` is plainly a grant of this rule.
    fn covers(&self, new: &Rule) -> bool {
        if self.templated() || new.templated() {
            // Placeholders tie identities to exports: only the same rule
            // (at no more access) is plainly no wider.
            return self.exports == new.exports
                && new.identities.iter().all(|id| self.identities.contains(id))
                && new.access <= self.access;
        }
        new.access <= self.access
            && new
                .identities
                .iter()
                .all(|id| self.identities.iter().any(|old| old.covers(id)))
            && new
                .exports
                .iter()
                .all(|e| self.exports.iter().any(|old| old.covers(e)))
    }
}

fn parse_braced(text: &str, chars: &mut std::str::Chars<'_>) -> Result<String, String> {
    let mut name = String::new();
    for c in chars.by_ref() {
        if c == '}' {
            return if !name.is_empty()
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            {
                Ok(name)
            } else {
                Err(format!(
                    "{text:?}: a placeholder is {{name}} with letters, digits or _"
                ))
            };
        }
        name.push(c);
    }
    Err(format!("{text:?}: unclosed {{"))
}

impl ExportPattern {
    fn parse(text: String) -> Result<Self, String> {
        if text.is_empty() {
            return Err("an empty export pattern".into());
        }
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut chars = text.chars();
        while let Some(c) = chars.next() {
            let part = match c {
                '*' => Part::Any,
                '{' => Part::Placeholder(parse_braced(&text, &mut chars)?),
                c => {
                    literal.push(c);
                    continue;
                }
            };
            if !literal.is_empty() {
                parts.push(Part::Literal(std::mem::take(&mut literal)));
            }
            parts.push(part);
        }
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        // Export names have no empty, `.` or `..` segment (see
        // proto::name), so a pattern with one could match nothing; said
        // at load instead.
        if text.contains('/')
            && text
                .split('/')
                .any(|segment| segment.is_empty() || segment == "." || segment == "..")
        {
            return Err(format!(
                "{text:?}: an export pattern has no empty, `.` or `..` segment (no leading, trailing or doubled `/`)"
            ));
        }
        // A placeholder with anything beside it in its segment would let
        // one tenant's value run on into another's: `{ns}-*` gives `team`
        // the name `team-prod-db` of `team-prod`.
        if segments(&parts).iter().any(|segment| {
            segment.len() > 1 && segment.iter().any(|p| matches!(p, Part::Placeholder(_)))
        }) {
            return Err(format!(
                "{text:?}: a placeholder must be a whole `/`-separated segment of the export name, as in \"{{ns}}/*\", so that no tenant's value can run on into another tenant's names"
            ));
        }
        Ok(ExportPattern { text, parts })
    }

    fn placeholders(&self) -> Vec<&str> {
        self.parts
            .iter()
            .filter_map(|p| match p {
                Part::Placeholder(name) => Some(name.as_str()),
                _ => None,
            })
            .collect()
    }

    fn matches(&self, name: &str, bindings: &Bindings) -> bool {
        glob(&self.parts, name, bindings)
    }

    /// Whether every name `new` matches, this matches too. Both match
    /// only names with as many segments as they have, so segment by
    /// segment: a lone `*` covers any segment (it too matches the empty
    /// one), and anything covers itself or a literal segment it matches.
    fn covers(&self, new: &ExportPattern) -> bool {
        let (old, new) = (segments(&self.parts), segments(&new.parts));
        old.len() == new.len()
            && old.iter().zip(&new).all(|(old, new)| {
                let literal = new.iter().all(|p| matches!(p, Part::Literal(_)));
                old.as_slice() == [Part::Any]
                    || old == new
                    || (literal && glob_segment(old, &literal_text(new), &Bindings::new()))
            })
    }
}

/// The parts of a pattern segment by segment, literals split at `/`
/// (no empty literal is kept: an empty segment is an empty list).
fn segments(parts: &[Part]) -> Vec<Vec<Part>> {
    let mut done = Vec::new();
    let mut current = Vec::new();
    for part in parts {
        let Part::Literal(text) = part else {
            current.push(part.clone());
            continue;
        };
        for (i, piece) in text.split('/').enumerate() {
            if i > 0 {
                done.push(std::mem::take(&mut current));
            }
            if !piece.is_empty() {
                current.push(Part::Literal(piece.to_string()));
            }
        }
    }
    done.push(current);
    done
}

fn literal_text(parts: &[Part]) -> String {
    parts
        .iter()
        .filter_map(|p| match p {
            Part::Literal(text) => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

/// Whether a placeholder's value may fill an export name's segment. A
/// URI segment or DNS label cannot hold a `/`, but a CN can: such a value,
/// or one that names a directory's self or parent, or holds a NUL (which
/// ends a path), matches nothing, whatever the pattern around it.
fn fits_one_segment(value: &str) -> bool {
    !value.is_empty() && value != "." && value != ".." && !value.contains(['/', '\0'])
}

/// `*` matches any run of characters but `/` (none included); a
/// placeholder its bound text exactly, and only text that fits one
/// segment. The pattern and the name are matched segment by segment.
fn glob(parts: &[Part], name: &str, bindings: &Bindings) -> bool {
    let pattern = segments(parts);
    let mut names = name.split('/');
    pattern.iter().all(|segment| {
        names
            .next()
            .is_some_and(|name| glob_segment(segment, name, bindings))
    }) && names.next().is_none()
}

/// One segment's glob. The name comes from the client, so this is linear
/// in it for each literal: the literals between stars are found left to
/// right, each at its leftmost place, which is all a star-only glob needs
/// (no backtracking, however many stars the pattern has).
fn glob_segment(parts: &[Part], name: &str, bindings: &Bindings) -> bool {
    // The pattern as literal runs between stars, placeholders filled in.
    let mut runs: Vec<String> = Vec::new();
    let mut current = String::new();
    for part in parts {
        match part {
            Part::Literal(text) => current.push_str(text),
            Part::Placeholder(key) => match bindings.get(key) {
                Some(value) if fits_one_segment(value) => current.push_str(value),
                _ => return false,
            },
            Part::Any => runs.push(std::mem::take(&mut current)),
        }
    }
    runs.push(current);
    let Some(mut tail) = name.strip_prefix(runs[0].as_str()) else {
        return false;
    };
    let Some((last, middle)) = runs[1..].split_last() else {
        return tail.is_empty();
    };
    for run in middle {
        match tail.find(run.as_str()) {
            Some(at) => tail = &tail[at + run.len()..],
            None => return false,
        }
    }
    tail.len() >= last.len() && tail.ends_with(last.as_str())
}

impl IdentityPattern {
    fn parse(field: Field, text: String) -> Result<Self, String> {
        if text.is_empty() {
            return Err("an empty identity pattern".into());
        }
        let units: Vec<&str> = match field.separator() {
            Some(sep) => text.split(sep).collect(),
            None => vec![text.as_str()],
        };
        let parts = units
            .into_iter()
            .map(|unit| match unit {
                // As `--allow-cn`: a CN is matched exactly (or bound
                // whole); `cn = ["*"]` meaning "any client" would be a
                // surprise the documentation does not make.
                "*" if field == Field::Cn => Err(format!(
                    "{text:?}: cn patterns are exact names or one {{placeholder}}; `*` is not a glob here"
                )),
                "*" => Ok(Part::Any),
                _ if unit.starts_with('{') => {
                    let mut chars = unit[1..].chars();
                    let name = parse_braced(&text, &mut chars)?;
                    match chars.as_str() {
                        "" => Ok(Part::Placeholder(name)),
                        _ => Err(format!("{text:?}: a placeholder stands for one whole part")),
                    }
                }
                _ if unit.contains('*') || unit.contains('{') => Err(format!(
                    "{text:?}: '*' and placeholders stand for one whole part"
                )),
                _ => Ok(Part::Literal(unit.to_string())),
            })
            .collect::<Result<_, _>>()?;
        Ok(IdentityPattern { field, text, parts })
    }

    fn binds(&self, name: &str) -> bool {
        self.parts.contains(&Part::Placeholder(name.to_string()))
    }

    /// The placeholders' values if `value` matches, part by part.
    fn bind(&self, value: &str) -> Option<Bindings> {
        let units: Vec<&str> = match self.field.separator() {
            Some(sep) => value.split(sep).collect(),
            None => vec![value],
        };
        if units.len() != self.parts.len() {
            return None;
        }
        let mut bindings = Bindings::new();
        for (part, unit) in self.parts.iter().zip(units) {
            let same = |p: &str| match self.field {
                Field::Dns => p.eq_ignore_ascii_case(unit),
                _ => p == unit,
            };
            match part {
                Part::Literal(p) if same(p) => {}
                Part::Any if !unit.is_empty() => {}
                Part::Placeholder(name) if !unit.is_empty() => {
                    let unit = if self.field == Field::Dns {
                        unit.to_ascii_lowercase()
                    } else {
                        unit.to_string()
                    };
                    if bindings
                        .insert(name.clone(), unit.clone())
                        .is_some_and(|old| old != unit)
                    {
                        return None;
                    }
                }
                _ => return None,
            }
        }
        Some(bindings)
    }

    /// Whether every value `new` matches, this matches too. A `*` or a
    /// placeholder seen once matches any non-empty part; a placeholder
    /// seen twice (`{a}.{a}`) only equal parts, so `new` must pin those
    /// places to one literal or to one placeholder of its own.
    fn covers(&self, new: &IdentityPattern) -> bool {
        if self.field != new.field || self.parts.len() != new.parts.len() {
            return false;
        }
        let same_literal = |a: &str, b: &str| match self.field {
            Field::Dns => a.eq_ignore_ascii_case(b),
            _ => a == b,
        };
        let each_part = self
            .parts
            .iter()
            .zip(&new.parts)
            .all(|(old, new)| match (old, new) {
                // Never an empty literal: `*` and placeholders bind only
                // non-empty parts.
                (Part::Any | Part::Placeholder(_), Part::Literal(b)) => !b.is_empty(),
                (Part::Any | Part::Placeholder(_), _) => true,
                (Part::Literal(a), Part::Literal(b)) => same_literal(a, b),
                _ => false,
            });
        each_part
            && self.parts.iter().enumerate().all(|(i, old)| {
                if !matches!(old, Part::Placeholder(_)) {
                    return true;
                }
                // Every later place this placeholder recurs must be bound
                // to the same text in `new` as its first place is.
                self.parts[i + 1..]
                    .iter()
                    .zip(&new.parts[i + 1..])
                    .filter(|(later, _)| *later == old)
                    .all(|(_, there)| match (&new.parts[i], there) {
                        (Part::Literal(a), Part::Literal(b)) => same_literal(a, b),
                        (Part::Placeholder(a), Part::Placeholder(b)) => a == b,
                        _ => false,
                    })
            })
    }
}

mod store;
pub mod tool;
pub use store::{load, PolicyLoadError, PolicyReloader, PolicyStore};

#[cfg(test)]
mod tests;
