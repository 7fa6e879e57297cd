//! Client certificate checks: webpki validates the chain (and the CRLs),
//! then the allow-list decides. A refusal fails the TLS handshake itself,
//! so a refused client never gets as far as an upstream connection.

use std::sync::Arc;

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
}

impl AuthorizingVerifier {
    pub fn new(chain: Arc<dyn ClientCertVerifier>, allow: AllowList) -> Self {
        AuthorizingVerifier { chain, allow }
    }
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
        let verdict = self
            .chain
            .verify_client_cert(end_entity, intermediates, now);
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
