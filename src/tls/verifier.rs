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

use crate::identity::{describe, AllowList, CertInfo};

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

    /// webpki's verdict on the chain, or the one remembered; with the
    /// chain to remember once the client has proved it holds the key.
    fn verify_chain(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> (Result<ClientCertVerified, rustls::Error>, Option<Pending>) {
        let key = VerifiedChains::key(end_entity, intermediates);
        if self.verified.holds(&key, now) {
            return (Ok(ClientCertVerified::assertion()), None);
        }
        let verdict = self
            .chain
            .verify_client_cert(end_entity, intermediates, now);
        let pending = match verdict {
            Ok(_) => self.verified.pending(key, end_entity, intermediates, now),
            Err(_) => None,
        };
        (verdict, pending)
    }
}

/// A chain webpki accepted in a handshake that has not finished: it is
/// remembered only once the client's signature over the handshake proves
/// it holds the certificate's key, so a copy of someone's certificate
/// (sent in the clear in TLS 1.2) with made-up intermediates appended
/// cannot fill the cache.
#[derive(Debug, Clone, Copy)]
struct Pending {
    key: [u8; 32],
    from: u64,
    until: u64,
}

/// Chains webpki accepted under one set of CA and CRL files, by the
/// SHA-256 of the end-entity certificate and intermediates as presented.
/// Each is good from when it was judged until the first moment time alone
/// could change the verdict: the earliest notAfter among its certificates
/// and, when CRL expiry is enforced, the earliest nextUpdate among the
/// CRLs. Every reload builds a new verifier with an empty cache, so a
/// verdict never outlives the files it was reached under (a new CRL is a
/// new cache). Only chains of clients that were admitted and proved
/// their key are kept, at most `max` (`--verified-chain-cache`; 0 keeps
/// none), with at most `MAX_INTERMEDIATES`; when full, expired ones make
/// room, and otherwise new chains are judged every time.
#[derive(Debug)]
pub struct VerifiedChains {
    max: usize,
    /// The CRLs' earliest nextUpdate, Unix seconds, when it is enforced.
    crl_deadline: Option<u64>,
    seen: Mutex<HashMap<[u8; 32], (u64, u64)>>,
    /// Accepted chains of handshakes in progress, by the SHA-256 of their
    /// end-entity certificate; at most `max`, emptied when full.
    pending: Mutex<HashMap<[u8; 32], Pending>>,
}

/// Chains with more intermediates than this are judged every time.
const MAX_INTERMEDIATES: usize = 4;

impl VerifiedChains {
    pub fn new(max: usize, crl_deadline: Option<u64>) -> Self {
        VerifiedChains {
            max,
            crl_deadline,
            seen: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
        }
    }

    fn end_entity_key(end_entity: &[u8]) -> [u8; 32] {
        let mut key = [0u8; 32];
        key.copy_from_slice(
            aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, end_entity).as_ref(),
        );
        key
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

    /// What to remember of an accepted chain, if anything: nothing when
    /// the cache is off or full of live entries, for long chains, or when
    /// a certificate's dates cannot be read.
    fn pending(
        &self,
        key: [u8; 32],
        end_entity: &[u8],
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Option<Pending> {
        let now = now.as_secs();
        if self.max == 0 || intermediates.len() > MAX_INTERMEDIATES || !self.has_room(now) {
            return None;
        }
        let mut until = self.crl_deadline.unwrap_or(u64::MAX);
        for der in std::iter::once(end_entity).chain(intermediates.iter().map(|c| c.as_ref())) {
            until = until.min(not_after(der)?);
        }
        Some(Pending {
            key,
            from: now,
            until,
        })
    }

    /// Room for one more, after dropping what has expired if full.
    fn has_room(&self, now: u64) -> bool {
        let Ok(mut seen) = self.seen.lock() else {
            return false;
        };
        if seen.len() >= self.max {
            seen.retain(|_, &mut (_, until)| now < until);
        }
        seen.len() < self.max
    }

    /// The chain's handshake is under way: held until its signature.
    fn hold(&self, end_entity: &[u8], pending: Pending) {
        let Ok(mut held) = self.pending.lock() else {
            return;
        };
        if held.len() >= self.max {
            held.clear();
        }
        held.insert(Self::end_entity_key(end_entity), pending);
    }

    /// The client proved it holds `end_entity`'s key: its chain, if one
    /// is held, is remembered.
    fn confirm(&self, end_entity: &[u8]) {
        let pending = match self.pending.lock() {
            Ok(mut held) => held.remove(&Self::end_entity_key(end_entity)),
            Err(_) => return,
        };
        let (Some(p), Ok(mut seen)) = (pending, self.seen.lock()) else {
            return;
        };
        if seen.len() < self.max || seen.contains_key(&p.key) {
            seen.insert(p.key, (p.from, p.until));
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
        let (verdict, pending) = self.verify_chain(end_entity, intermediates, now);
        let info = CertInfo::from_der(end_entity);
        let permitted = info.as_ref().is_ok_and(|info| self.allow.permits(info));
        let reason = match verdict {
            Ok(verified) if permitted => {
                if let Some(pending) = pending {
                    self.verified.hold(end_entity, pending);
                }
                return Ok(verified);
            }
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
        let valid = self.chain.verify_tls12_signature(message, cert, dss)?;
        self.verified.confirm(cert);
        Ok(valid)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let valid = self.chain.verify_tls13_signature(message, cert, dss)?;
        self.verified.confirm(cert);
        Ok(valid)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.chain.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts the chain checks. With `webpki`, it asks webpki; without,
    /// it stands for it and accepts every chain until `expires`, and the
    /// handshake signatures are not asked of it.
    #[derive(Debug)]
    struct Counting {
        calls: AtomicUsize,
        expires: u64,
        webpki: Option<Arc<dyn ClientCertVerifier>>,
    }

    impl Counting {
        fn webpki(&self) -> &dyn ClientCertVerifier {
            self.webpki
                .as_deref()
                .expect("a stand-in is asked only for chains")
        }
    }

    impl ClientCertVerifier for Counting {
        fn root_hint_subjects(&self) -> &[DistinguishedName] {
            self.webpki
                .as_deref()
                .map_or(&[], |w| w.root_hint_subjects())
        }
        fn verify_client_cert(
            &self,
            ee: &CertificateDer<'_>,
            im: &[CertificateDer<'_>],
            now: UnixTime,
        ) -> Result<ClientCertVerified, rustls::Error> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            match &self.webpki {
                Some(webpki) => webpki.verify_client_cert(ee, im, now),
                None if now.as_secs() > self.expires => Err(CertificateError::Expired.into()),
                None => Ok(ClientCertVerified::assertion()),
            }
        }
        fn verify_tls12_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.webpki().verify_tls12_signature(m, c, d)
        }
        fn verify_tls13_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.webpki().verify_tls13_signature(m, c, d)
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.webpki().supported_verify_schemes()
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
            webpki: None,
        });
        let v =
            AuthorizingVerifier::new(inner.clone(), allow, VerifiedChains::new(max, crl_deadline));
        (v, inner)
    }

    /// What a handshake does: the chain, then (once accepted) the
    /// client's signature, which the stand-in always finds good.
    fn handshake(
        v: &AuthorizingVerifier,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> bool {
        let ok = v.verify_client_cert(end_entity, intermediates, now).is_ok();
        if ok {
            v.verified.confirm(end_entity);
        }
        ok
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
        assert!(handshake(&v, &f.client, &[], at(now)));
        assert!(handshake(&v, &f.client, &[], at(now + 60)));
        assert_eq!(calls(), 1, "the second came from the cache");
        // Other intermediates: another chain, judged.
        assert!(v
            .verify_client_cert(&f.client, std::slice::from_ref(&f.ca), at(now))
            .is_ok());
        assert_eq!(calls(), 2);
        // At the certificate's notAfter the cache no longer answers, and
        // past it the chain is refused.
        assert!(handshake(&v, &f.client, &[], at(f.not_after)));
        assert_eq!(calls(), 3);
        assert!(!handshake(&v, &f.client, &[], at(f.not_after + 1)));
        assert!(!handshake(&v, &f.client, &[], at(f.not_after + 2)));
        assert_eq!(calls(), 5, "a refusal is never remembered");
    }

    #[test]
    fn a_chain_is_remembered_only_once_the_client_proved_its_key() {
        let f = fixture();
        let now = f.not_after - 3600;
        let (v, inner) = verifier(&f, 16, None, AllowList::default());
        let calls = || inner.calls.load(Ordering::SeqCst);
        // Someone with a copy of the certificate, not its key: accepted
        // chains, and no signature ever made.
        for _ in 0..3 {
            assert!(v.verify_client_cert(&f.client, &[], at(now)).is_ok());
        }
        assert_eq!(calls(), 3, "nothing remembered");
        assert!(handshake(&v, &f.client, &[], at(now)));
        assert!(handshake(&v, &f.client, &[], at(now)));
        assert_eq!(calls(), 4, "remembered after the signature");
        // More intermediates than are remembered: judged every time.
        let (v, inner) = verifier(&f, 16, None, AllowList::default());
        let long = vec![f.ca.clone(); MAX_INTERMEDIATES + 1];
        for _ in 0..3 {
            assert!(handshake(&v, &f.client, &long, at(now)));
        }
        assert_eq!(inner.calls.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_full_cache_makes_room_by_dropping_what_has_expired() {
        let f = fixture();
        let now = f.not_after - 3600;
        let (v, inner) = verifier(&f, 1, None, AllowList::default());
        let calls = || inner.calls.load(Ordering::SeqCst);
        // The one place taken by a live entry: nothing more is kept.
        v.verified
            .seen
            .lock()
            .unwrap()
            .insert([1; 32], (0, now + 60));
        assert!(handshake(&v, &f.client, &[], at(now)));
        assert!(handshake(&v, &f.client, &[], at(now)));
        assert_eq!(calls(), 2);
        // Once that entry has expired, it makes room.
        v.verified
            .seen
            .lock()
            .unwrap()
            .insert([1; 32], (0, now - 1));
        assert!(handshake(&v, &f.client, &[], at(now)));
        assert!(handshake(&v, &f.client, &[], at(now)));
        assert_eq!(calls(), 3, "the expired entry made room");
    }

    #[test]
    fn the_crls_next_update_and_a_clock_gone_back_end_a_remembered_verdict() {
        let f = fixture();
        let now = f.not_after - 3600;
        let (v, inner) = verifier(&f, 16, Some(now + 10), AllowList::default());
        let calls = || inner.calls.load(Ordering::SeqCst);
        assert!(handshake(&v, &f.client, &[], at(now)));
        assert!(handshake(&v, &f.client, &[], at(now + 9)));
        assert_eq!(calls(), 1);
        assert!(handshake(&v, &f.client, &[], at(now + 10)));
        assert_eq!(calls(), 2, "judged again at the CRL's nextUpdate");
        // Remembered from now + 10; a clock stepped back is not trusted.
        assert!(handshake(&v, &f.client, &[], at(now + 5)));
        assert_eq!(calls(), 3);
    }

    #[test]
    fn the_allow_list_is_applied_to_a_remembered_chain_and_the_bound_holds() {
        let f = fixture();
        let now = f.not_after - 3600;
        let other = AllowList::new(vec!["someone-else".into()], vec![], vec![]).unwrap();
        let (v, inner) = verifier(&f, 16, None, other);
        for _ in 0..3 {
            assert!(!handshake(&v, &f.client, &[], at(now)));
        }
        assert_eq!(
            inner.calls.load(Ordering::SeqCst),
            3,
            "a refused client's chain is not remembered"
        );
        // None kept with 0; one kept with 1, the next chain judged each time.
        let (v, inner) = verifier(&f, 0, None, AllowList::default());
        for _ in 0..3 {
            assert!(handshake(&v, &f.client, &[], at(now)));
        }
        assert_eq!(inner.calls.load(Ordering::SeqCst), 3);
        let (v, inner) = verifier(&f, 1, None, AllowList::default());
        for _ in 0..3 {
            assert!(handshake(&v, &f.client, &[], at(now)));
            assert!(v
                .verify_client_cert(&f.client, std::slice::from_ref(&f.ca), at(now))
                .is_ok());
        }
        assert_eq!(inner.calls.load(Ordering::SeqCst), 1 + 3);
    }

    #[derive(Debug)]
    struct Presents(Arc<rustls::sign::CertifiedKey>);

    impl rustls::client::ResolvesClientCert for Presents {
        fn resolve(
            &self,
            _: &[&[u8]],
            _: &[SignatureScheme],
        ) -> Option<Arc<rustls::sign::CertifiedKey>> {
            Some(self.0.clone())
        }
        fn has_certs(&self) -> bool {
            true
        }
    }

    /// A whole handshake in memory: true if both sides finished.
    fn handshakes(server: Arc<rustls::ServerConfig>, client: Arc<rustls::ClientConfig>) -> bool {
        let mut server = rustls::ServerConnection::new(server).unwrap();
        let name = "localhost".try_into().unwrap();
        let mut client = rustls::ClientConnection::new(client, name).unwrap();
        for _ in 0..10 {
            let mut wire = Vec::new();
            while client.wants_write() {
                client.write_tls(&mut wire).unwrap();
            }
            if server.read_tls(&mut wire.as_slice()).is_err()
                || server.process_new_packets().is_err()
            {
                return false;
            }
            wire.clear();
            while server.wants_write() {
                server.write_tls(&mut wire).unwrap();
            }
            if client.read_tls(&mut wire.as_slice()).is_err()
                || client.process_new_packets().is_err()
            {
                return false;
            }
            if !server.is_handshaking() && !client.is_handshaking() {
                return true;
            }
        }
        false
    }

    /// Certificates made for a test, read back as rustls takes them.
    struct Made(tempfile::TempDir);

    impl Made {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            crate::certs::for_test(dir.path(), "localhost", 1);
            Made(dir)
        }

        fn file(&self, name: &str) -> Vec<u8> {
            std::fs::read(self.0.path().join(name)).unwrap()
        }

        fn certs(&self, name: &str) -> Vec<CertificateDer<'static>> {
            CertificateDer::pem_slice_iter(&self.file(name))
                .collect::<Result<Vec<_>, _>>()
                .unwrap()
        }

        fn key(&self, name: &str) -> rustls::pki_types::PrivateKeyDer<'static> {
            rustls::pki_types::PrivateKeyDer::from_pem_slice(&self.file(name)).unwrap()
        }

        fn roots(&self) -> Arc<rustls::RootCertStore> {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(self.certs("ca-cert.pem").remove(0)).unwrap();
            Arc::new(roots)
        }

        /// A client that presents `cert` and signs with `key_file`'s key,
        /// matching or not (rustls's own loader would refuse a mismatch).
        fn client(
            &self,
            version: &'static rustls::SupportedProtocolVersion,
            cert: &str,
            key_file: &str,
        ) -> Arc<rustls::ClientConfig> {
            let provider = super::super::provider();
            let signer = provider
                .key_provider
                .load_private_key(self.key(key_file))
                .unwrap();
            let certified = rustls::sign::CertifiedKey::new(self.certs(cert), signer);
            Arc::new(
                rustls::ClientConfig::builder_with_provider(provider)
                    .with_protocol_versions(&[version])
                    .unwrap()
                    .with_root_certificates(self.roots())
                    .with_client_cert_resolver(Arc::new(Presents(Arc::new(certified)))),
            )
        }

        /// A server whose verifier counts webpki's calls behind the
        /// verified-chain cache.
        fn server(
            &self,
            version: &'static rustls::SupportedProtocolVersion,
        ) -> (Arc<rustls::ServerConfig>, Arc<Counting>) {
            let webpki = rustls::server::WebPkiClientVerifier::builder_with_provider(
                self.roots(),
                super::super::provider(),
            )
            .build()
            .unwrap();
            let counting = Arc::new(Counting {
                calls: AtomicUsize::new(0),
                expires: u64::MAX,
                webpki: Some(webpki),
            });
            let verifier = AuthorizingVerifier::new(
                counting.clone(),
                AllowList::default(),
                VerifiedChains::new(16, None),
            );
            let server = rustls::ServerConfig::builder_with_provider(super::super::provider())
                .with_protocol_versions(&[version])
                .unwrap()
                .with_client_cert_verifier(Arc::new(verifier))
                .with_single_cert(self.certs("server-cert.pem"), self.key("server-key.pem"))
                .unwrap();
            (Arc::new(server), counting)
        }
    }

    #[test]
    fn rustls_handshakes_remember_the_chain_after_the_signature_in_tls_1_3_and_1_2() {
        let made = Made::new();
        for version in [&rustls::version::TLS13, &rustls::version::TLS12] {
            let (server, counting) = made.server(version);
            let good = made.client(version, "client-cert.pem", "client-key.pem");
            // The client's certificate with another key (the server's):
            // the chain is fine, the signature is not.
            let thief = made.client(version, "client-cert.pem", "server-key.pem");
            assert!(!handshakes(server.clone(), thief.clone()), "{version:?}");
            assert!(!handshakes(server.clone(), thief.clone()), "{version:?}");
            assert_eq!(
                counting.calls.load(Ordering::SeqCst),
                2,
                "{version:?}: not remembered"
            );
            for _ in 0..3 {
                assert!(handshakes(server.clone(), good.clone()), "{version:?}");
            }
            assert_eq!(
                counting.calls.load(Ordering::SeqCst),
                3,
                "{version:?}: remembered"
            );
            // A remembered chain does not spare the signature.
            assert!(!handshakes(server.clone(), thief), "{version:?}");
        }
    }
}
