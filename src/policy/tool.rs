//! `nbdgw policy check FILE` and `nbdgw policy explain`: what an operator
//! runs before a rollout. The same parser and matcher as the gateway
//! (`Policy::parse`, `Policy::decide_with_rule`), so what they say is what
//! nbdgw will do, `--allow-*` aside (those are checked first, in the TLS
//! handshake).

use std::fmt;
use std::path::{Path, PathBuf};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use thiserror::Error;

use super::{load, Decision, Grant, NotOneTenant, PolicyLoadError, RuleBindings};
use crate::identity::CertInfo;
use crate::logsafe::Escaped;
use crate::proto::name::{export_name, NameError};

#[derive(Debug, Error)]
pub enum ToolError {
    /// `FILE:LINE:COLUMN: problem` when the problem has a place, as
    /// compilers say it (editors jump there).
    #[error("{}", describe_load(.0))]
    Policy(PolicyLoadError),
    #[error("{path}: cannot read a PEM certificate: {why}")]
    CertPem { path: PathBuf, why: String },
    #[error("{path}: not a certificate nbdgw can read: {why}")]
    Cert { path: PathBuf, why: String },
}

fn describe_load(error: &PolicyLoadError) -> String {
    match error {
        PolicyLoadError::Invalid { path, error } => match error.location() {
            Some(at) => format!("{path}:{}:{}: {}", at.line, at.column, error.problem()),
            None => format!("{path}: {error}"),
        },
        other => other.to_string(),
    }
}

/// What `nbdgw policy check` found in a valid file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    pub rules: usize,
    /// What is valid but likely not meant, one line each.
    pub warnings: Vec<String>,
}

/// Parses the policy file as nbdgw would at start; says how many rules
/// it has, and warns of templated rules that name their tenant apart.
pub fn check(path: &Path) -> Result<Checked, ToolError> {
    let policy = load(path).map_err(ToolError::Policy)?;
    let warnings = policy
        .unrelated_templates()
        .into_iter()
        .map(|(a, b)| format!("{}: {}", path.display(), super::apart_warning(a, b)))
        .collect();
    Ok(Checked {
        rules: policy.rule_count().unwrap_or(0),
        warnings,
    })
}

/// What the policy in `policy` lets the client certificate (PEM; the
/// first certificate of the file) do with `export`.
pub fn explain(policy: &Path, cert: &Path, export: &str) -> Result<Explanation, ToolError> {
    let policy = load(policy).map_err(ToolError::Policy)?;
    let der = CertificateDer::from_pem_file(cert).map_err(|e| ToolError::CertPem {
        path: cert.to_path_buf(),
        why: e.to_string(),
    })?;
    let identity = CertInfo::from_der(&der).map_err(|e| ToolError::Cert {
        path: cert.to_path_buf(),
        why: e.to_string(),
    })?;
    // nbdgw refuses such a name before the policy is asked.
    let name_problem = export_name(export.as_bytes()).err();
    let (decision, grants) = match name_problem {
        Some(_) => (None, Vec::new()),
        None => (
            policy.decide_with_rule(&identity, export),
            policy.grants(&identity, export),
        ),
    };
    let two_tenants = policy.two_tenants(&identity);
    Ok(Explanation {
        two_tenants,
        identity,
        export: export.to_string(),
        name_problem,
        decision,
        grants,
    })
}

/// The answer of `nbdgw policy explain`, printed by its `Display`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Explanation {
    pub identity: CertInfo,
    pub export: String,
    pub name_problem: Option<NameError>,
    pub decision: Option<Decision>,
    /// Every rule granting the export, in file order.
    pub grants: Vec<Grant>,
    /// Why the certificate is not one tenant across the templated rules
    /// (so those rules grant it nothing), and what its names bound in
    /// them.
    pub two_tenants: Option<(NotOneTenant, Vec<RuleBindings>)>,
}

impl Explanation {
    pub fn granted(&self) -> bool {
        self.decision.is_some()
    }
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "certificate: {}", self.identity)?;
        let export = Escaped(&self.export);
        if let Some(problem) = self.name_problem {
            return writeln!(
                f,
                "export \"{export}\": refused before the policy is asked: {problem}"
            );
        }
        let Some(decision) = self.decision else {
            writeln!(
                f,
                "export \"{export}\": no rule grants it (the client is told the export does not exist)"
            )?;
            return self.show_two_tenants(f);
        };
        writeln!(f, "export \"{export}\": {}", decision.access)?;
        let decisive = decision.rule;
        for grant in &self.grants {
            let lead = if Some(grant.rule) == decisive {
                "decided by"
            } else {
                "also granted by"
            };
            write!(
                f,
                "{lead} rule {} (line {}): {} to exports [{}], admitted by {} \"{}\"",
                grant.rule.number,
                grant.rule.line,
                grant.access,
                quoted(grant.exports.iter().map(String::as_str)),
                grant.admitted_by.0,
                Escaped(&grant.admitted_by.1),
            )?;
            for (i, (name, value)) in grant.bindings.iter().enumerate() {
                let lead = if i == 0 { " with" } else { "," };
                write!(f, "{lead} {{{name}}} = \"{}\"", Escaped(value))?;
            }
            writeln!(f)?;
        }
        self.show_two_tenants(f)
    }
}

impl Explanation {
    /// Why templated rules grant nothing, when that is why.
    fn show_two_tenants(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some((why, bound)) = &self.two_tenants else {
            return Ok(());
        };
        let why = match why {
            NotOneTenant::Apart => "its names are bound by rules that name the tenant apart (their exports' placeholder sets are not nested, so one certificate is not known to be one tenant; name the tenant alike in every rule)",
            NotOneTenant::TwoValues => "its names bind two tenants, one placeholder to two values (one certificate, one tenant, across all rules)",
        };
        writeln!(f, "templated rules grant this certificate nothing: {why}:")?;
        for (rule, bindings) in bound {
            write!(f, "  rule {} (line {}):", rule.number, rule.line)?;
            for (i, (name, value)) in bindings.iter().enumerate() {
                let lead = if i == 0 { "" } else { "," };
                write!(f, "{lead} {{{name}}} = \"{}\"", Escaped(value))?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

fn quoted<'a>(texts: impl Iterator<Item = &'a str>) -> String {
    texts
        .map(|t| format!("\"{}\"", Escaped(t)))
        .collect::<Vec<_>>()
        .join(", ")
}
