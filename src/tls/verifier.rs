//! Client certificate checks: webpki validates the chain (and the CRLs),
//! then the allow-list decides. A refusal fails the TLS handshake itself,
//! so a refused client never gets as far as an upstream connection.
//!
//! A chain webpki accepted is remembered (`VerifiedChains`), so the same
//! client reconnecting is not put through the path building and the
//! signature checks of its chain again: see there for what bounds that.
//! The handshake's own proof, the client's signature over the transcript
//! with the certificate's key, is checked on every connection.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};
use tracing::warn;

use super::identity::{describe, AllowList, CertInfo};

#[derive(Debug)]
pub struct AuthorizingVerifier {
    chain: Arc<dyn ClientCertVerifier>,
    allow: AllowList,
    verified: VerifiedChains,
}

impl AuthorizingVerifier {
    pub fn new(
        chain: Arc<dyn ClientCertVerifier>,
        allow: AllowList,
        verified: VerifiedChains,
    ) -> Self {
        AuthorizingVerifier {
            chain,
            allow,
            verified,
        }
    }

    fn verify_chain(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let key = VerifiedChains::key(end_entity, intermediates);
        if self.verified.holds(&key, now) {
            return Ok(ClientCertVerified::assertion());
        }
        let verdict = self
            .chain
            .verify_client_cert(end_entity, intermediates, now);
        if verdict.is_ok() {
            self.verified.remember(key, end_entity, intermediates, now);
        }
        verdict
    }
}

/// Chains webpki accepted under one set of CA and CRL files, by the
/// SHA-256 of the end-entity certificate and intermediates as presented.
/// Each is good from when it was judged until the first moment time alone
/// could change the verdict: the earliest notAfter among its certificates
/// and, when CRL expiry is enforced, the earliest nextUpdate among the
/// CRLs. Every reload builds a new verifier with an empty cache, so a
/// verdict never outlives the files it was reached under (a new CRL is a
/// new cache). Only acceptances are kept, at most `max`
/// (`--verified-chain-cache`; 0 keeps none): a stranger's refused chains
/// cost nothing here, and once full, new chains are judged every time.
#[derive(Debug)]
pub struct VerifiedChains {
    max: usize,
    /// The CRLs' earliest nextUpdate, Unix seconds, when it is enforced.
    crl_deadline: Option<u64>,
    seen: Mutex<HashMap<[u8; 32], (u64, u64)>>,
}

impl VerifiedChains {
    pub fn new(max: usize, crl_deadline: Option<u64>) -> Self {
        VerifiedChains {
            max,
            crl_deadline,
            seen: Mutex::new(HashMap::new()),
        }
    }

    fn key(end_entity: &[u8], intermediates: &[CertificateDer<'_>]) -> [u8; 32] {
        let mut hash = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
        // Each certificate with its length: no two chains hash alike by
        // moving bytes from one certificate to the next.
        for der in std::iter::once(end_entity).chain(intermediates.iter().map(|c| c.as_ref())) {
            hash.update(&(der.len() as u64).to_be_bytes());
            hash.update(der);
        }
        let mut key = [0u8; 32];
        key.copy_from_slice(hash.finish().as_ref());
        key
    }

    fn holds(&self, key: &[u8; 32], now: UnixTime) -> bool {
        let now = now.as_secs();
        let Ok(mut seen) = self.seen.lock() else {
            return false;
        };
        match seen.get(key) {
            Some(&(from, until)) if from <= now && now < until => true,
            Some(_) => {
                // Expired, or the clock went back: judged again.
                seen.remove(key);
                false
            }
            None => false,
        }
    }

    fn remember(
        &self,
        key: [u8; 32],
        end_entity: &[u8],
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) {
        if self.max == 0 {
            return;
        }
        // A certificate whose dates cannot be read is not remembered.
        let mut until = self.crl_deadline.unwrap_or(u64::MAX);
        for der in std::iter::once(end_entity).chain(intermediates.iter().map(|c| c.as_ref())) {
            match not_after(der) {
                Some(t) => until = until.min(t),
                None => return,
            }
        }
        let Ok(mut seen) = self.seen.lock() else {
            return;
        };
        if seen.len() < self.max || seen.contains_key(&key) {
            seen.insert(key, (now.as_secs(), until));
        }
    }
}

/// A certificate's notAfter in Unix seconds (before 1970: 0).
fn not_after(der: &[u8]) -> Option<u64> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der).ok()?;
    Some(u64::try_from(cert.validity().not_after.timestamp()).unwrap_or(0))
}

impl ClientCertVerifier for AuthorizingVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.chain.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verdict = self.verify_chain(end_entity, intermediates, now);
        let info = CertInfo::from_der(end_entity);
        let permitted = info.as_ref().is_ok_and(|info| self.allow.permits(info));
        let reason = match verdict {
            Ok(verified) if permitted => return Ok(verified),
            Ok(_) => "no name matches --allow-cn, --allow-dns or --allow-uri".to_string(),
            Err(ref error) => error.to_string(),
        };
        let presented = describe(end_entity);
        // Runs inside the connection's span, so this line carries its id
        // and peer address; it is the one place that names who was refused.
        warn!(client = %presented, %reason, "client certificate refused");
        // An allow-list refusal reaches the client as the access_denied alert.
        verdict.and(Err(CertificateError::ApplicationVerificationFailure.into()))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.chain.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.chain.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.chain.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Stands for webpki: counts its calls, accepts until `expires`.
    #[derive(Debug)]
    struct Counting {
        calls: AtomicUsize,
        expires: u64,
    }

    impl ClientCertVerifier for Counting {
        fn root_hint_subjects(&self) -> &[DistinguishedName] {
            &[]
        }
        fn verify_client_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            now: UnixTime,
        ) -> Result<ClientCertVerified, rustls::Error> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if now.as_secs() > self.expires {
                return Err(CertificateError::Expired.into());
            }
            Ok(ClientCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            unreachable!("not called by these tests")
        }
        fn verify_tls13_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            unreachable!("not called by these tests")
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            vec![]
        }
    }

    struct Fixture {
        client: CertificateDer<'static>,
        ca: CertificateDer<'static>,
        not_after: u64,
        _dir: tempfile::TempDir,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        crate::certs::for_test(dir.path(), "localhost", 1);
        let read = |name: &str| {
            let pem = std::fs::read(dir.path().join(name)).unwrap();
            CertificateDer::pem_slice_iter(&pem)
                .next()
                .unwrap()
                .unwrap()
        };
        let client = read("client-cert.pem");
        let not_after = not_after(&client).unwrap();
        Fixture {
            client,
            ca: read("ca-cert.pem"),
            not_after,
            _dir: dir,
        }
    }

    fn verifier(
        f: &Fixture,
        max: usize,
        crl_deadline: Option<u64>,
        allow: AllowList,
    ) -> (AuthorizingVerifier, Arc<Counting>) {
        let inner = Arc::new(Counting {
            calls: AtomicUsize::new(0),
            expires: f.not_after,
        });
        let v =
            AuthorizingVerifier::new(inner.clone(), allow, VerifiedChains::new(max, crl_deadline));
        (v, inner)
    }

    fn at(secs: u64) -> UnixTime {
        UnixTime::since_unix_epoch(std::time::Duration::from_secs(secs))
    }

    use rustls::pki_types::pem::PemObject;

    #[test]
    fn a_chain_accepted_once_is_not_judged_again_until_its_certificate_expires() {
        let f = fixture();
        let (v, inner) = verifier(&f, 16, None, AllowList::default());
        let now = f.not_after - 3600;
        let calls = || inner.calls.load(Ordering::SeqCst);
        assert!(v.verify_client_cert(&f.client, &[], at(now)).is_ok());
        assert!(v.verify_client_cert(&f.client, &[], at(now + 60)).is_ok());
        assert_eq!(calls(), 1, "the second came from the cache");
        // Other intermediates: another chain, judged.
        assert!(v
            .verify_client_cert(&f.client, std::slice::from_ref(&f.ca), at(now))
            .is_ok());
        assert_eq!(calls(), 2);
        // At the certificate's notAfter the cache no longer answers, and
        // past it the chain is refused.
        assert!(v
            .verify_client_cert(&f.client, &[], at(f.not_after))
            .is_ok());
        assert_eq!(calls(), 3);
        assert!(v
            .verify_client_cert(&f.client, &[], at(f.not_after + 1))
            .is_err());
        assert!(v
            .verify_client_cert(&f.client, &[], at(f.not_after + 2))
            .is_err());
        assert_eq!(calls(), 5, "a refusal is never remembered");
    }

    #[test]
    fn the_crls_next_update_and_a_clock_gone_back_end_a_remembered_verdict() {
        let f = fixture();
        let now = f.not_after - 3600;
        let (v, inner) = verifier(&f, 16, Some(now + 10), AllowList::default());
        let calls = || inner.calls.load(Ordering::SeqCst);
        assert!(v.verify_client_cert(&f.client, &[], at(now)).is_ok());
        assert!(v.verify_client_cert(&f.client, &[], at(now + 9)).is_ok());
        assert_eq!(calls(), 1);
        assert!(v.verify_client_cert(&f.client, &[], at(now + 10)).is_ok());
        assert_eq!(calls(), 2, "judged again at the CRL's nextUpdate");
        // Remembered from now + 10; a clock stepped back is not trusted.
        assert!(v.verify_client_cert(&f.client, &[], at(now + 5)).is_ok());
        assert_eq!(calls(), 3);
    }

    #[test]
    fn the_allow_list_is_applied_to_a_remembered_chain_and_the_bound_holds() {
        let f = fixture();
        let now = f.not_after - 3600;
        let other = AllowList::new(vec!["someone-else".into()], vec![], vec![]).unwrap();
        let (v, inner) = verifier(&f, 16, None, other);
        for _ in 0..3 {
            assert!(v.verify_client_cert(&f.client, &[], at(now)).is_err());
        }
        assert_eq!(inner.calls.load(Ordering::SeqCst), 1, "the chain was fine");
        // None kept with 0; one kept with 1, the next chain judged each time.
        let (v, inner) = verifier(&f, 0, None, AllowList::default());
        for _ in 0..3 {
            assert!(v.verify_client_cert(&f.client, &[], at(now)).is_ok());
        }
        assert_eq!(inner.calls.load(Ordering::SeqCst), 3);
        let (v, inner) = verifier(&f, 1, None, AllowList::default());
        for _ in 0..3 {
            assert!(v.verify_client_cert(&f.client, &[], at(now)).is_ok());
            assert!(v
                .verify_client_cert(&f.client, std::slice::from_ref(&f.ca), at(now))
                .is_ok());
        }
        assert_eq!(inner.calls.load(Ordering::SeqCst), 1 + 3);
    }
}
