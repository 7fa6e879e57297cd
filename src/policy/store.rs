//! The `--policy` file, read at start and reloaded live with the TLS
//! files' rule: a file that is missing, broken, or would grant anything
//! the running policy does not is refused, logged, and the running policy
//! kept. Access can only be narrowed while nbdgw runs.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use thiserror::Error;
use tracing::{debug, error, info, warn};

use super::{Policy, PolicyError};
use crate::reloadable::{ReloadOutcome, Swap, Trigger, Triggers};

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

/// A version of the file as a poll read it: its bytes, or why it could not
/// be read.
type Seen = Result<Vec<u8>, std::io::ErrorKind>;

/// What a reload calls to end the sessions it narrowed.
type CloseNarrowed = Box<dyn Fn(&Policy) -> usize + Send + Sync>;

pub struct PolicyReloader {
    path: PathBuf,
    store: Arc<PolicyStore>,
    /// The bytes in force, so an unchanged file costs nothing.
    in_force: Vec<u8>,
    /// The last refusal, so a file that stays bad is reported once.
    last_refusal: Option<String>,
    /// What the previous poll read when it differed from `in_force`: a
    /// poll acts only on a change two polls in a row agree on, so a file
    /// caught half-written by an editor is never judged. A truncated
    /// policy is often valid and narrower; applied, it would leave the
    /// complete file refused as wider until a restart.
    settling: Option<Seen>,
    /// The version last refused, so a file that stays bad is judged (and
    /// counted in the metrics) once, not at every poll.
    refused: Option<Seen>,
    /// Reloads done and refused, for the metrics.
    reloaded: Counter,
    refusals: Counter,
    /// Reloads that changed the policy (the generation proven sources are
    /// proven under; a SIGHUP with the file unchanged changes nothing).
    changes: Counter,
    /// Ends the established sessions whose access a reload narrowed
    /// (`--policy-revoke-closes`), returning how many; `None`: they keep
    /// it. A hook, so that the policy need not know the session registry
    /// (which knows the policy).
    close_narrowed: Option<CloseNarrowed>,
}

impl PolicyReloader {
    /// The first read; unlike a reload, its failure stops start-up.
    pub fn start(path: PathBuf) -> Result<Self, PolicyLoadError> {
        let (bytes, policy) = read(&path)?;
        info!(path = %path.display(), rules = policy.rule_count(), "access policy loaded");
        warn_apart(&path, &policy);
        Ok(PolicyReloader {
            store: Arc::new(Swap::new(Arc::new(policy))),
            path,
            in_force: bytes,
            last_refusal: None,
            settling: None,
            refused: None,
            reloaded: Counter::default(),
            refusals: Counter::default(),
            changes: Counter::default(),
            close_narrowed: None,
        })
    }

    /// Ends, at each reload, the sessions whose access the new policy
    /// narrows (`--policy-revoke-closes`): `close` judges them (the
    /// registry `--tls-revoke-closes` uses) and says how many it ended.
    pub fn close_narrowed_with(
        &mut self,
        close: impl Fn(&Policy) -> usize + Send + Sync + 'static,
    ) {
        self.close_narrowed = Some(Box::new(close));
    }

    /// Counts reloads into these (the metrics' counters).
    pub fn count_into(&mut self, reloaded: Counter, refused: Counter) {
        self.reloaded = reloaded;
        self.refusals = refused;
    }

    /// Counts reloads that change the policy into this.
    pub fn count_changes_into(&mut self, changes: Counter) {
        self.changes = changes;
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
        let seen: Seen = match &result {
            Ok(bytes) => Ok(bytes.clone()),
            Err(PolicyLoadError::Read { error, .. }) => Err(error.kind()),
            Err(PolicyLoadError::Invalid { .. }) => Err(std::io::ErrorKind::InvalidData),
        };
        if trigger == Trigger::Poll && !self.settled(&result, &seen) {
            return ReloadOutcome::Unchanged;
        }
        self.settling = None;
        let checked = result.and_then(|bytes| {
            let policy = parse(&self.path, &bytes)?
                .replacing(&self.store.current())
                .map_err(|error| PolicyLoadError::Invalid {
                    path: self.path.display().to_string(),
                    error,
                })?;
            Ok((bytes, policy))
        });
        match checked {
            Ok((bytes, policy)) => self.put_in_force(bytes, policy),
            Err(e) => {
                let text = e.to_string();
                if self.last_refusal.as_ref() != Some(&text) {
                    error!(error = %text, "access policy reload refused; the running policy stays in force");
                }
                self.last_refusal = Some(text);
                self.refused = Some(seen);
                self.refusals.inc();
                ReloadOutcome::Failed
            }
        }
    }

    /// A poll's judgement: whether the file is worth reading as a new
    /// policy now. Unchanged, or refused before as it is: no. Changed
    /// since the last poll: not yet, but at the next if it stays so (an
    /// editor's half-written file is never judged).
    fn settled(&mut self, result: &Result<Vec<u8>, PolicyLoadError>, seen: &Seen) -> bool {
        if matches!(result, Ok(bytes) if *bytes == self.in_force) {
            self.last_refusal = None;
            self.settling = None;
            self.refused = None;
            return false;
        }
        if self.refused.as_ref() == Some(seen) {
            self.settling = None;
            return false;
        }
        if self.settling.as_ref() != Some(seen) {
            debug!(path = %self.path.display(), "the policy file changed; judged at the next poll if it stays so");
            self.settling = Some(seen.clone());
            return false;
        }
        true
    }

    /// A checked policy replaces the one in force; the sessions it
    /// narrows are ended.
    fn put_in_force(&mut self, bytes: Vec<u8>, policy: Policy) -> ReloadOutcome {
        self.refused = None;
        let policy = Arc::new(policy);
        let changed = *policy != *self.store.current();
        // Replaced first, then the sessions judged: one recording its
        // grant meanwhile is judged by the new policy there.
        self.store.replace(policy.clone());
        // Counted before any session is told: the changes are the
        // generation `admission` proves sources under, and a session this
        // reload ends must not end under the old one.
        self.reloaded.inc();
        if changed {
            self.changes.inc();
        }
        let closed = self
            .close_narrowed
            .as_ref()
            .map_or(0, |close| close(&policy));
        info!(
            path = %self.path.display(),
            rules = policy.rule_count(),
            sessions_closed = closed,
            "access policy reloaded; new connections use it"
        );
        warn_apart(&self.path, &policy);
        self.in_force = bytes;
        self.last_refusal = None;
        ReloadOutcome::Reloaded
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

/// Warns, as `nbdgw policy check` does, of templated rules that may name
/// the tenant apart: a certificate both bind gets nothing from any
/// templated rule, and the refusal alone would not say why.
fn warn_apart(path: &std::path::Path, policy: &Policy) {
    for (a, b) in policy.unrelated_templates() {
        warn!(path = %path.display(), "{}", super::apart_warning(a, b));
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
        // Judged once two polls agree on it.
        assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Unchanged);
        assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Reloaded);
        assert_eq!(
            store.current().decide(&a(), "x"),
            Some(super::super::Access::ReadOnly)
        );

        for bad in [RW, "[[rule]]\nexports = 3", ""] {
            std::fs::write(&path, bad).unwrap();
            assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Unchanged);
            let outcome = reloader.check(Trigger::Poll);
            if bad.is_empty() {
                // No rules at all is the narrowest policy there is.
                assert_eq!(outcome, ReloadOutcome::Reloaded);
                assert_eq!(store.current().decide(&a(), "x"), None);
                continue;
            }
            assert_eq!(outcome, ReloadOutcome::Failed, "{bad}");
            // A file that stays bad is judged, and counted, once.
            assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Unchanged);
            assert_eq!(
                store.current().decide(&a(), "x"),
                Some(super::super::Access::ReadOnly)
            );
        }
        std::fs::remove_file(&path).unwrap();
        assert_eq!(reloader.check(Trigger::Signal), ReloadOutcome::Failed);
        assert_eq!(store.current().decide(&a(), "x"), None);
    }

    /// An editor rewriting the file in place: a poll that reads it half
    /// written (here cut after its first rule, a valid and narrower
    /// policy) must not apply it, or the complete file that follows would
    /// be refused as wider and the narrowing stay until a restart.
    #[test]
    fn a_file_caught_half_written_is_not_applied() {
        let two = format!(
            "{RO}[[rule]]\nexports = [\"*\"]\nallow = {{ cn = [\"b\"] }}\naccess = \"read-only\"\n"
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.toml");
        std::fs::write(&path, &two).unwrap();
        let mut reloader = PolicyReloader::start(path.clone()).unwrap();
        let store = reloader.store();
        let b = crate::tls::CertInfo::with_names("b", &[], &[]);
        // The poll lands between the editor's truncate and its last write.
        std::fs::write(&path, RO).unwrap();
        assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Unchanged);
        std::fs::write(&path, &two).unwrap();
        assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Unchanged);
        assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Unchanged);
        assert_eq!(
            store.current().decide(&b, "x"),
            Some(super::super::Access::ReadOnly)
        );
        // SIGHUP is the operator saying the file is complete: judged now.
        std::fs::write(&path, RO).unwrap();
        assert_eq!(reloader.check(Trigger::Signal), ReloadOutcome::Reloaded);
        assert_eq!(store.current().decide(&b, "x"), None);
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
