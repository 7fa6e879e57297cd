//! Established sessions and the certificates they authenticated with, so
//! that a reload which revokes a client can end the sessions it already
//! has (`--tls-revoke-closes`), not only refuse its next handshake.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use rustls::{CertificateError, Error};
use tokio::sync::Notify;
use tracing::warn;

use super::identity::describe;

#[derive(Default)]
pub struct Sessions {
    open: Mutex<HashMap<u64, Session>>,
}

struct Session {
    /// End entity first, then the intermediates the client sent.
    chain: Vec<CertificateDer<'static>>,
    revoked: Arc<Notify>,
}

/// Held by a connection for as long as it is established; dropping it
/// forgets the session.
pub struct SessionGuard {
    sessions: Arc<Sessions>,
    id: u64,
    revoked: Arc<Notify>,
}

impl SessionGuard {
    /// Resolves once a reload has revoked this session's certificate.
    pub async fn revoked(&self) {
        self.revoked.notified().await
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.sessions.lock().remove(&self.id);
    }
}

impl Sessions {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Session>> {
        // Each change is a single insert or remove: never half done.
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers connection `id`, authenticated by `chain`.
    pub fn register(self: &Arc<Self>, id: u64, chain: &[CertificateDer<'_>]) -> SessionGuard {
        let revoked = Arc::new(Notify::new());
        let session = Session {
            chain: chain.iter().map(|c| c.clone().into_owned()).collect(),
            revoked: revoked.clone(),
        };
        self.lock().insert(id, session);
        SessionGuard {
            sessions: self.clone(),
            id,
            revoked,
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
                session.revoked.notify_one();
                closed += 1;
            }
        }
        closed
    }
}
