//! Established sessions, the certificates they authenticated with and the
//! access the policy granted them, so that a reload which takes away what
//! a session holds ends the sessions that already hold it, not only the
//! next handshake or option: a CRL that revokes the client
//! (`--tls-revoke-closes`), or a policy that withdraws or reduces its
//! access to the export it opened (`--policy-revoke-closes`). One
//! registry and one signal per session serve both.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use rustls::{CertificateError, Error};
use tokio::sync::Notify;
use tracing::warn;

use crate::identity::{describe, CertInfo};
use crate::logsafe::Escaped;
use crate::policy::{Access, Policy, PolicyStore};

/// Why a reload ended a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// A reloaded CRL revokes its certificate.
    CertificateRevoked,
    /// A reloaded policy no longer grants the access it was opened with.
    PolicyNarrowed,
}

#[derive(Default)]
pub struct Sessions {
    open: Mutex<HashMap<u64, Session>>,
}

/// What an established session was granted: the identity the policy
/// judged, the export name it judged, and the access it gave.
#[derive(Debug, Clone)]
pub struct Grant {
    pub identity: CertInfo,
    pub export: String,
    pub access: Access,
}

struct Session {
    /// End entity first, then the intermediates the client sent.
    chain: Vec<CertificateDer<'static>>,
    /// Set once negotiation chose an export; until then the policy has
    /// granted nothing that a reload could take away.
    grant: Option<Grant>,
    end: Arc<End>,
}

/// The signal: the first reason set wins, then the connection is woken.
#[derive(Default)]
struct End {
    why: OnceLock<Ended>,
    notify: Notify,
}

impl End {
    fn signal(&self, why: Ended) {
        // A session already told to end keeps its first reason.
        if self.why.set(why).is_ok() {
            // notify_one stores a permit if the connection is not waiting
            // yet (still negotiating): it ends as soon as it does wait.
            self.notify.notify_one();
        }
    }
}

/// Held by a connection for as long as it is established; dropping it
/// forgets the session.
pub struct SessionGuard {
    sessions: Arc<Sessions>,
    id: u64,
    end: Arc<End>,
}

impl SessionGuard {
    /// Whether a reload has ended this session, without waiting: the
    /// relay asks before it forwards each request, so that nothing read
    /// after the reload reaches the upstream however busy the relay is.
    pub fn signalled(&self) -> Option<Ended> {
        self.end.why.get().copied()
    }

    /// Resolves, with the reason, once a reload has ended this session.
    pub async fn ended(&self) -> Ended {
        self.end.notify.notified().await;
        // Set before every notification.
        self.end
            .why
            .get()
            .copied()
            .unwrap_or(Ended::CertificateRevoked)
    }

    /// Records what the policy granted this session once it chose its
    /// export. With `current` (`--policy-revoke-closes`), the grant is
    /// judged again by the policy in force *under the registry's lock*: a
    /// reload that replaced the policy after this connection took its copy
    /// but before this call would otherwise find no grant to judge, and
    /// the session would keep access the new policy denies.
    pub fn granted(&self, grant: Grant, current: Option<&PolicyStore>) {
        let mut open = self.sessions.lock();
        let Some(session) = open.get_mut(&self.id) else {
            return;
        };
        if let Some(store) = current {
            narrowed(self.id, &grant, &store.current(), &session.end);
        }
        session.grant = Some(grant);
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.sessions.lock().remove(&self.id);
    }
}

/// Signals `end` if `policy` grants `grant`'s identity less than the
/// session holds on its export; logs what changed. Returns whether it did.
fn narrowed(id: u64, grant: &Grant, policy: &Policy, end: &End) -> bool {
    let now = policy.decide(&grant.identity, &grant.export);
    // None (no access) < read-only < read-write.
    if now >= Some(grant.access) {
        return false;
    }
    warn!(
        conn = id,
        client = %grant.identity,
        export = %Escaped(&grant.export),
        was = %grant.access,
        now = %now.map_or("none".to_string(), |access| access.to_string()),
        "access policy narrowed by a reload (--policy-revoke-closes): the policy narrowed this session's access, closing it"
    );
    end.signal(Ended::PolicyNarrowed);
    true
}

impl Sessions {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Session>> {
        // Each change is a single insert, remove or field assignment:
        // never half done.
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers connection `id`, authenticated by `chain`.
    pub fn register(self: &Arc<Self>, id: u64, chain: &[CertificateDer<'_>]) -> SessionGuard {
        let end = Arc::new(End::default());
        let session = Session {
            chain: chain.iter().map(|c| c.clone().into_owned()).collect(),
            grant: None,
            end: end.clone(),
        };
        self.lock().insert(id, session);
        SessionGuard {
            sessions: self.clone(),
            id,
            end,
        }
    }

    /// Judges every session again with `verifier` (the chain and CRL check
    /// of a freshly loaded configuration) and signals those whose
    /// certificate is now revoked. Returns how many were signalled.
    pub fn close_revoked(&self, verifier: &dyn ClientCertVerifier) -> usize {
        let now = UnixTime::now();
        let mut closed = 0;
        for (id, session) in self.lock().iter() {
            let Some((end_entity, intermediates)) = session.chain.split_first() else {
                continue;
            };
            let verdict = verifier.verify_client_cert(end_entity, intermediates, now);
            if let Err(Error::InvalidCertificate(CertificateError::Revoked)) = verdict {
                warn!(
                    conn = id,
                    client = %describe(end_entity),
                    "client certificate revoked by the reload: closing its session"
                );
                session.end.signal(Ended::CertificateRevoked);
                closed += 1;
            }
        }
        closed
    }

    /// Judges every session's grant again with `policy`, freshly put in
    /// force, and signals those it grants less than they hold: access to
    /// their export withdrawn, or read-write reduced to read-only. Call it
    /// after the policy store holds `policy`, so that a session recording
    /// its grant meanwhile is judged by one or the other (see
    /// [`SessionGuard::granted`]). Returns how many were signalled.
    pub fn close_narrowed(&self, policy: &Policy) -> usize {
        self.lock()
            .iter()
            // A session already told to end is not told (and logged) twice.
            .filter(|(_, s)| s.end.why.get().is_none())
            .filter_map(|(id, s)| s.grant.as_ref().map(|grant| (id, grant, &s.end)))
            .filter(|(id, grant, end)| narrowed(**id, grant, policy, end))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reloadable::Swap;

    const BOTH: &str =
        "[[rule]]\nexports = [\"*\"]\nallow = { cn = [\"a\", \"b\"] }\naccess = \"read-write\"\n";
    const B_RO: &str =
        "[[rule]]\nexports = [\"*\"]\nallow = { cn = [\"a\"] }\naccess = \"read-write\"\n\
        [[rule]]\nexports = [\"*\"]\nallow = { cn = [\"b\"] }\naccess = \"read-only\"\n";

    fn grant(cn: &str, access: Access) -> Grant {
        Grant {
            identity: CertInfo::with_names(cn, &[], &[]),
            export: "disk".into(),
            access,
        }
    }

    fn is_signalled(guard: &SessionGuard) -> Option<Ended> {
        guard.end.why.get().copied()
    }

    #[test]
    fn a_narrowing_policy_signals_exactly_the_sessions_it_narrows() {
        let sessions = Arc::new(Sessions::default());
        let a = sessions.register(1, &[]);
        let b = sessions.register(2, &[]);
        let b_ro = sessions.register(3, &[]);
        let negotiating = sessions.register(4, &[]);
        let store = Swap::new(Arc::new(Policy::parse(BOTH).unwrap()));
        a.granted(grant("a", Access::ReadWrite), Some(&store));
        b.granted(grant("b", Access::ReadWrite), Some(&store));
        b_ro.granted(grant("b", Access::ReadOnly), Some(&store));
        assert_eq!(sessions.close_narrowed(&Policy::parse(BOTH).unwrap()), 0);

        let narrower = Arc::new(Policy::parse(B_RO).unwrap());
        store.replace(narrower.clone());
        assert_eq!(sessions.close_narrowed(&narrower), 1);
        assert_eq!(is_signalled(&a), None);
        assert_eq!(is_signalled(&b), Some(Ended::PolicyNarrowed));
        // Read-only was all it held, and all it still has.
        assert_eq!(is_signalled(&b_ro), None);
        assert_eq!(is_signalled(&negotiating), None);

        // A session recording its grant after the reload is judged by the
        // policy now in force, not the copy it negotiated with.
        negotiating.granted(grant("b", Access::ReadWrite), Some(&store));
        assert_eq!(is_signalled(&negotiating), Some(Ended::PolicyNarrowed));
        // Without --policy-revoke-closes it is not.
        let kept = sessions.register(5, &[]);
        kept.granted(grant("b", Access::ReadWrite), None);
        assert_eq!(is_signalled(&kept), None);

        // Nothing at all: every remaining grant goes.
        assert_eq!(sessions.close_narrowed(&Policy::parse("").unwrap()), 3);
        drop((a, b, b_ro, negotiating, kept));
        assert!(sessions.lock().is_empty());
    }

    #[tokio::test]
    async fn the_first_reason_is_the_one_reported() {
        let sessions = Arc::new(Sessions::default());
        let guard = sessions.register(1, &[]);
        guard.end.signal(Ended::PolicyNarrowed);
        guard.end.signal(Ended::CertificateRevoked);
        assert_eq!(guard.ended().await, Ended::PolicyNarrowed);
    }
}
