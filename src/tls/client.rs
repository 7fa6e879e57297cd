//! Client-side TLS for `nbdgw client`: the CA the remote server's
//! certificate must chain to, and the client certificate to present, from
//! a directory in the layout libnbd and qemu read (`ca-cert.pem`,
//! `client-cert.pem`, `client-key.pem`, optionally `ca-crl.pem`) or a
//! Kubernetes TLS Secret (`ca.crt`, `tls.crt`, `tls.key`), or from files.
//! Verification is not optional: a CA is required, and the server's name
//! is checked against its certificate's SANs by rustls's webpki verifier.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::{Resumption, WebPkiServerVerifier};
use rustls::{ClientConfig, RootCertStore};

use super::TlsConfigError;
use super::{certificates, crls, private_key, provider, CertInfo, MinVersion, PemFile};

/// Where the client-side files come from: a directory, with any file
/// overridden by its own flag.
#[derive(Debug, Clone, Default)]
pub struct ClientTlsSources {
    pub dir: Option<PathBuf>,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// A directory layout, by the name of each file.
struct ClientLayout {
    name: &'static str,
    ca: &'static str,
    cert: &'static str,
    key: &'static str,
    crl: Option<&'static str>,
}

/// libnbd's `tls-certificates` directory and qemu's `tls-creds-x509`
/// directory with `endpoint=client` use the same names.
const LIBNBD_LAYOUT: ClientLayout = ClientLayout {
    name: "libnbd/qemu",
    ca: "ca-cert.pem",
    cert: "client-cert.pem",
    key: "client-key.pem",
    crl: Some("ca-crl.pem"),
};
const KUBERNETES_LAYOUT: ClientLayout = ClientLayout {
    name: "Kubernetes",
    ca: "ca.crt",
    cert: "tls.crt",
    key: "tls.key",
    crl: None,
};

/// The files `nbdgw client` reads, fixed at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientTlsPaths {
    pub layout: Option<&'static str>,
    pub ca: PathBuf,
    pub crl: Option<PathBuf>,
    /// The client certificate and its key; `None`: none is presented.
    pub identity: Option<(PathBuf, PathBuf)>,
}

impl ClientTlsSources {
    pub fn resolve(&self) -> Result<ClientTlsPaths, TlsConfigError> {
        let present = |dir: &Path, name: &str| Some(dir.join(name)).filter(|p| p.exists());
        let (mut layout, mut ca, mut crl, mut cert, mut key) = (None, None, None, None, None);
        if let Some(dir) = &self.dir {
            let found = [&LIBNBD_LAYOUT, &KUBERNETES_LAYOUT]
                .into_iter()
                .find(|l| dir.join(l.ca).exists() || dir.join(l.cert).exists());
            if let Some(found) = found {
                layout = Some(found.name);
                ca = present(dir, found.ca);
                crl = found.crl.and_then(|name| present(dir, name));
                cert = present(dir, found.cert);
                key = present(dir, found.key);
            }
        }
        let ca = match (self.ca.clone().or(ca), &self.dir) {
            (Some(ca), _) => ca,
            (None, Some(dir)) => return Err(TlsConfigError::NoServerCa(dir.clone())),
            (None, None) => return Err(TlsConfigError::NoServerCaGiven),
        };
        let identity = match (self.cert.clone().or(cert), self.key.clone().or(key)) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (Some(cert), None) => return Err(TlsConfigError::ClientKeyMissing(cert)),
            // A key alone presents nothing: no certificate to go with it.
            (None, _) => None,
        };
        Ok(ClientTlsPaths {
            layout,
            ca,
            crl,
            identity,
        })
    }
}

/// A built client configuration and what the start-up log says of it.
pub struct LoadedClient {
    pub config: Arc<ClientConfig>,
    /// CA certificates the server's chain may end in.
    pub cas: usize,
    pub crls: usize,
    /// The client certificate presented, if any.
    pub identity: Option<CertInfo>,
}

/// Reads the files and builds the configuration every remote connection
/// uses.
pub fn build_client(
    paths: &ClientTlsPaths,
    min_version: MinVersion,
) -> Result<LoadedClient, TlsConfigError> {
    let ca_file = PemFile::read(&paths.ca)?;
    let ca_err = |error: String| TlsConfigError::ServerCa {
        path: paths.ca.clone(),
        error,
    };
    let mut roots = RootCertStore::empty();
    for ca in certificates(&ca_file, "server CA")? {
        roots.add(ca).map_err(|e| ca_err(e.to_string()))?;
    }
    let cas = roots.len();
    let crl_list = match &paths.crl {
        Some(path) => crls(&PemFile::read(path)?)?,
        None => Vec::new(),
    };
    let crl_count = crl_list.len();
    let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
        .with_crls(crl_list)
        .allow_unknown_revocation_status()
        .build()
        .map_err(|e| ca_err(e.to_string()))?;
    let builder = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(min_version.versions())
        .map_err(|e| ca_err(e.to_string()))?
        .with_webpki_verifier(verifier);
    let (mut config, identity) = match &paths.identity {
        Some((cert, key)) => {
            let cert_file = PemFile::read(cert)?;
            let key_file = PemFile::read(key)?;
            let chain = certificates(&cert_file, "certificate")?;
            let info =
                CertInfo::from_der(&chain[0]).map_err(|error| TlsConfigError::Unparsable {
                    path: cert.clone(),
                    error,
                })?;
            let config = builder
                .with_client_auth_cert(chain, private_key(&key_file)?)
                .map_err(|error| TlsConfigError::Rustls {
                    cert: cert.clone(),
                    key: key.clone(),
                    error,
                })?;
            (config, Some(info))
        }
        None => (builder.with_no_client_auth(), None),
    };
    // Every connection makes a full handshake, so that the server's
    // certificate is checked each time (and a resumed session cannot
    // outlive a rotation on either side).
    config.resumption = Resumption::disabled();
    Ok(LoadedClient {
        config: Arc::new(config),
        cas,
        crls: crl_count,
        identity,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_libnbd_layout_and_needs_a_ca() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("c");
        crate::certs::for_test(&out, "localhost", 3);
        let sources = ClientTlsSources {
            dir: Some(out.clone()),
            ..ClientTlsSources::default()
        };
        let paths = sources.resolve().unwrap();
        assert_eq!(paths.layout, Some("libnbd/qemu"));
        assert_eq!(paths.ca, out.join("ca-cert.pem"));
        let loaded = build_client(&paths, MinVersion::Tls12).unwrap();
        assert_eq!(loaded.cas, 1);
        assert!(loaded.identity.is_some());

        std::fs::remove_file(out.join("client-key.pem")).unwrap();
        let err = sources.resolve().unwrap_err().to_string();
        assert!(err.contains("has no key"), "{err}");
        std::fs::remove_file(out.join("client-cert.pem")).unwrap();
        let paths = sources.resolve().unwrap();
        assert!(paths.identity.is_none(), "anonymous without a certificate");

        std::fs::remove_file(out.join("ca-cert.pem")).unwrap();
        let err = sources.resolve().unwrap_err().to_string();
        assert!(err.contains("no CA to check"), "{err}");
    }
}
