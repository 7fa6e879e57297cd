//! The `--policy` file, read at start and reloaded live with the TLS
//! files' rule: a file that is missing, broken, or would grant anything
//! the running policy does not is refused, logged, and the running policy
//! kept. Access can only be narrowed while nbdgw runs.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use thiserror::Error;
use tracing::{error, info};

use super::{Policy, PolicyError};
use crate::reload::{ReloadOutcome, Swap, Trigger, Triggers};
use crate::tls::Sessions;

/// The policy new connections use; each connection keeps the one it
/// started with.
pub type PolicyStore = Swap<Policy>;

#[derive(Debug, Error)]
pub enum PolicyLoadError {
    #[error("cannot read {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("{path}: {error}")]
    Invalid { path: String, error: PolicyError },
}

pub struct PolicyReloader {
    path: PathBuf,
    store: Arc<PolicyStore>,
    /// The bytes in force, so an unchanged file costs nothing.
    in_force: Vec<u8>,
    /// The last refusal, so a file that stays bad is reported once.
    last_refusal: Option<String>,
    /// Reloads done and refused, for the metrics.
    reloaded: Counter,
    refused: Counter,
    /// The established sessions a narrowing reload ends when their access
    /// is narrowed (`--policy-revoke-closes`); `None`: they keep it.
    sessions: Option<Arc<Sessions>>,
}

impl PolicyReloader {
    /// The first read; unlike a reload, its failure stops start-up.
    pub fn start(path: PathBuf) -> Result<Self, PolicyLoadError> {
        let (bytes, policy) = read(&path)?;
        info!(path = %path.display(), rules = policy.rule_count(), "access policy loaded");
        Ok(PolicyReloader {
            store: Arc::new(Swap::new(Arc::new(policy))),
            path,
            in_force: bytes,
            last_refusal: None,
            reloaded: Counter::default(),
            refused: Counter::default(),
            sessions: None,
        })
    }

    /// Ends, at each reload, the sessions in `sessions` whose access the
    /// new policy narrows (`--policy-revoke-closes`). The same registry
    /// `--tls-revoke-closes` uses.
    pub fn close_narrowed_in(&mut self, sessions: Arc<Sessions>) {
        self.sessions = Some(sessions);
    }

    /// Counts reloads into these (the metrics' counters).
    pub fn count_into(&mut self, reloaded: Counter, refused: Counter) {
        self.reloaded = reloaded;
        self.refused = refused;
    }

    pub fn store(&self) -> Arc<PolicyStore> {
        self.store.clone()
    }

    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    pub fn check(&mut self, trigger: Trigger) -> ReloadOutcome {
        let result = std::fs::read(&self.path).map_err(|error| PolicyLoadError::Read {
            path: self.path.display().to_string(),
            error,
        });
        if matches!(&result, Ok(bytes) if *bytes == self.in_force) && trigger == Trigger::Poll {
            self.last_refusal = None;
            return ReloadOutcome::Unchanged;
        }
        let checked = result.and_then(|bytes| {
            let policy = parse(&self.path, &bytes)?;
            policy
                .check_no_wider_than(&self.store.current())
                .map_err(|error| PolicyLoadError::Invalid {
                    path: self.path.display().to_string(),
                    error,
                })?;
            Ok((bytes, policy))
        });
        match checked {
            Ok((bytes, policy)) => {
                let policy = Arc::new(policy);
                // Replaced first, then the sessions judged: one recording
                // its grant meanwhile is judged by the new policy there.
                self.store.replace(policy.clone());
                let closed = self
                    .sessions
                    .as_ref()
                    .map_or(0, |sessions| sessions.close_narrowed(&policy));
                info!(
                    path = %self.path.display(),
                    rules = policy.rule_count(),
                    sessions_closed = closed,
                    "access policy reloaded; new connections use it"
                );
                self.in_force = bytes;
                self.last_refusal = None;
                self.reloaded.inc();
                ReloadOutcome::Reloaded
            }
            Err(e) => {
                let text = e.to_string();
                if self.last_refusal.as_ref() != Some(&text) {
                    error!(error = %text, "access policy reload refused; the running policy stays in force");
                }
                self.last_refusal = Some(text);
                self.refused.inc();
                ReloadOutcome::Failed
            }
        }
    }

    /// Reloads on SIGHUP and whenever a poll every `interval` finds the
    /// file changed. Runs until the process ends.
    pub async fn watch(mut self, interval: Option<Duration>) {
        let mut triggers = Triggers::new(interval, "the policy file");
        while let Some(trigger) = triggers.next().await {
            self.check(trigger);
        }
    }
}

/// Reads and parses the policy file at `path` (`nbdgw policy check`).
pub fn load(path: &std::path::Path) -> Result<Policy, PolicyLoadError> {
    read(path).map(|(_, policy)| policy)
}

fn read(path: &std::path::Path) -> Result<(Vec<u8>, Policy), PolicyLoadError> {
    let bytes = std::fs::read(path).map_err(|error| PolicyLoadError::Read {
        path: path.display().to_string(),
        error,
    })?;
    let policy = parse(path, &bytes)?;
    Ok((bytes, policy))
}

fn parse(path: &std::path::Path, bytes: &[u8]) -> Result<Policy, PolicyLoadError> {
    let invalid = |error| PolicyLoadError::Invalid {
        path: path.display().to_string(),
        error,
    };
    let text = std::str::from_utf8(bytes).map_err(|e| {
        let valid = &bytes[..e.valid_up_to()];
        invalid(PolicyError::Syntax {
            at: std::str::from_utf8(valid)
                .ok()
                .map(|valid| super::Location::of(valid, valid.len())),
            message: format!("not UTF-8: {e}"),
        })
    })?;
    Policy::parse(text).map_err(invalid)
}

#[cfg(test)]
mod tests {
    use super::*;

    const RW: &str =
        "[[rule]]\nexports = [\"*\"]\nallow = { cn = [\"a\"] }\naccess = \"read-write\"\n";
    const RO: &str =
        "[[rule]]\nexports = [\"*\"]\nallow = { cn = [\"a\"] }\naccess = \"read-only\"\n";

    fn a() -> crate::tls::CertInfo {
        crate::tls::CertInfo::with_names("a", &[], &[])
    }

    #[test]
    fn narrowing_applies_and_widening_broken_or_missing_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.toml");
        std::fs::write(&path, RW).unwrap();
        let mut reloader = PolicyReloader::start(path.clone()).unwrap();
        let store = reloader.store();
        assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Unchanged);

        std::fs::write(&path, RO).unwrap();
        assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Reloaded);
        assert_eq!(
            store.current().decide(&a(), "x"),
            Some(super::super::Access::ReadOnly)
        );

        for bad in [RW, "[[rule]]\nexports = 3", ""] {
            std::fs::write(&path, bad).unwrap();
            let outcome = reloader.check(Trigger::Poll);
            if bad.is_empty() {
                // No rules at all is the narrowest policy there is.
                assert_eq!(outcome, ReloadOutcome::Reloaded);
                assert_eq!(store.current().decide(&a(), "x"), None);
                continue;
            }
            assert_eq!(outcome, ReloadOutcome::Failed, "{bad}");
            assert_eq!(
                store.current().decide(&a(), "x"),
                Some(super::super::Access::ReadOnly)
            );
        }
        std::fs::remove_file(&path).unwrap();
        assert_eq!(reloader.check(Trigger::Signal), ReloadOutcome::Failed);
        assert_eq!(store.current().decide(&a(), "x"), None);
    }

    #[test]
    fn a_broken_file_stops_start_up() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.toml");
        std::fs::write(&path, "[[rule]]\nexports = [\"*\"]\n").unwrap();
        let Err(error) = PolicyReloader::start(path) else {
            panic!("a rule without allow and access was accepted");
        };
        let error = error.to_string();
        assert!(
            error.contains("policy.toml") && error.contains("missing field"),
            "{error}"
        );
    }
}
