//! Server-side TLS configuration: certificates and keys from PEM files.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum TlsConfigError {
    #[error("cannot read certificate file {path}: {error}")]
    Cert {
        path: PathBuf,
        error: rustls::pki_types::pem::Error,
    },
    #[error("certificate file {0} holds no certificate")]
    NoCert(PathBuf),
    #[error("cannot read private key file {path}: {error}")]
    Key {
        path: PathBuf,
        error: rustls::pki_types::pem::Error,
    },
    #[error("certificate {cert} and key {key} cannot be used together: {error}")]
    Rustls {
        cert: PathBuf,
        key: PathBuf,
        error: rustls::Error,
    },
}

/// The one crypto provider nbdgw uses. Naming it explicitly keeps rustls
/// from panicking should another crate ever enable a second provider.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// Loads a certificate chain and key and builds the server configuration.
/// TLS 1.2 and 1.3 only (the NBD spec requires 1.2), AEAD suites only
/// (the provider's defaults), no client certificates.
pub fn load_server_config(cert: &Path, key: &Path) -> Result<ServerConfig, TlsConfigError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|error| TlsConfigError::Cert {
            path: cert.to_owned(),
            error,
        })?;
    if chain.is_empty() {
        return Err(TlsConfigError::NoCert(cert.to_owned()));
    }
    let private_key = PrivateKeyDer::from_pem_file(key).map_err(|error| TlsConfigError::Key {
        path: key.to_owned(),
        error,
    })?;
    let rustls_err = |error| TlsConfigError::Rustls {
        cert: cert.to_owned(),
        key: key.to_owned(),
        error,
    };
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(rustls_err)?
        .with_no_client_auth()
        .with_single_cert(chain, private_key)
        .map_err(rustls_err)?;
    // NBD has no ALPN and sessions are long-lived; nothing else to tune.
    config.ignore_client_order = false;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs::{generate, CertsRequest};

    #[test]
    fn loads_generated_certificates_and_names_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("c");
        generate(&CertsRequest {
            out: out.clone(),
            server_names: vec!["localhost".into()],
            client_names: vec!["a".into()],
            days: 1,
            force: false,
        })
        .unwrap();
        load_server_config(&out.join("server-cert.pem"), &out.join("server-key.pem")).unwrap();

        let mismatch =
            load_server_config(&out.join("client-cert.pem"), &out.join("server-key.pem"))
                .unwrap_err()
                .to_string();
        assert!(mismatch.contains("cannot be used together"), "{mismatch}");

        let missing = load_server_config(&out.join("nope.pem"), &out.join("server-key.pem"))
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("cannot read certificate file"),
            "{missing}"
        );

        let no_cert = load_server_config(&out.join("server-key.pem"), &out.join("server-key.pem"))
            .unwrap_err()
            .to_string();
        assert!(no_cert.contains("holds no certificate"), "{no_cert}");

        let no_key = load_server_config(&out.join("server-cert.pem"), &out.join("server-cert.pem"))
            .unwrap_err()
            .to_string();
        assert!(no_key.contains("cannot read private key file"), "{no_key}");
    }
}
