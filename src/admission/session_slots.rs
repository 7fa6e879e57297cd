//! The budget after authentication: one slot per session
//! (`--max-connections`), and at most `--max-sessions-per-identity` of
//! them per identity, an identity being the certificate's names (see the
//! module's comment for why not its fingerprint or key).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::OwnedSemaphorePermit;

use super::{Admission, Refusal};

/// Who a session counts against for `--max-sessions-per-identity`: the
/// certificate's names, sorted and without repeats (DNS names lower-cased,
/// as they are matched), or no certificate at all.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Identity {
    Anonymous,
    Named {
        common_names: Vec<String>,
        dns_names: Vec<String>,
        uris: Vec<String>,
    },
}

impl Identity {
    /// `cert`: the client certificate's names, `None` without one.
    pub fn of(cert: Option<&crate::tls::CertInfo>) -> Self {
        let Some(cert) = cert else {
            return Identity::Anonymous;
        };
        let canonical = |names: &[String], fold: fn(&str) -> String| {
            let mut names: Vec<String> = names.iter().map(|n| fold(n)).collect();
            names.sort();
            names.dedup();
            names
        };
        Identity::Named {
            common_names: canonical(&cert.common_names, str::to_owned),
            dns_names: canonical(&cert.dns_names, str::to_ascii_lowercase),
            uris: canonical(&cert.uris, str::to_owned),
        }
    }
}

/// Held for as long as an authenticated session lasts.
pub struct SessionPermit {
    _slot: OwnedSemaphorePermit,
    _identity: IdentityClaim,
}

pub(super) type IdentityCounts = Mutex<HashMap<Identity, usize>>;

/// One session counted against its identity until dropped.
struct IdentityClaim {
    counts: Arc<IdentityCounts>,
    identity: Identity,
}

/// As `Admission::slots`: every change is made whole under the lock.
pub(super) fn lock_counts(counts: &IdentityCounts) -> MutexGuard<'_, HashMap<Identity, usize>> {
    counts.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Admission {
    /// A session slot for a client that has just authenticated as
    /// `identity`: refused when that identity holds its share, or when
    /// every slot is taken.
    pub fn session(&self, identity: Identity) -> Result<SessionPermit, Refusal> {
        let claim = {
            let mut held = lock_counts(&self.per_identity);
            let count = held.entry(identity.clone()).or_insert(0);
            if *count >= self.per_identity_limit {
                // Nothing claimed: an entry this call created is dropped
                // again, so refusals leave nothing behind.
                if *count == 0 {
                    held.remove(&identity);
                }
                return Err(Refusal::IdentityFull(self.per_identity_limit));
            }
            *count += 1;
            IdentityClaim {
                counts: self.per_identity.clone(),
                identity,
            }
        };
        // Dropping `claim` on this error gives the identity's count back.
        let slot = self
            .sessions
            .clone()
            .try_acquire_owned()
            .map_err(|_| Refusal::SessionsFull(self.max_sessions))?;
        Ok(SessionPermit {
            _slot: slot,
            _identity: claim,
        })
    }
}

impl Drop for IdentityClaim {
    fn drop(&mut self) {
        let mut held = lock_counts(&self.counts);
        if let Some(count) = held.get_mut(&self.identity) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.identity);
            }
        }
    }
}
