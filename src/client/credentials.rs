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

use crate::reloadable::{LastSeen, ReloadOutcome, Swap, Trigger, Triggers};
use crate::tls::TlsConfigError;
use crate::tls::{
    certificates, check_groups, crls, private_key, provider, provider_with_groups, CertInfo,
    KxGroups, MinVersion, PemFile,
};
use tracing::{error, info};

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
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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

/// The bytes of every file, read in one go: what a configuration is built
/// from, and what a poll compares to notice rotation.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientMaterial {
    ca: PemFile,
    crl: Option<PemFile>,
    identity: Option<(PemFile, PemFile)>,
}

impl ClientMaterial {
    /// Every file `paths` names must be there: one present at start and
    /// gone now is an error, never a quieter configuration.
    pub fn read(paths: &ClientTlsPaths) -> Result<Self, TlsConfigError> {
        Ok(ClientMaterial {
            ca: PemFile::read(&paths.ca)?,
            crl: paths.crl.as_deref().map(PemFile::read).transpose()?,
            identity: match &paths.identity {
                Some((cert, key)) => Some((PemFile::read(cert)?, PemFile::read(key)?)),
                None => None,
            },
        })
    }
}

/// What the operator asks of the TLS towards the server, fixed for the
/// life of the process.
#[derive(Debug, Clone, Default)]
pub struct ClientTlsPolicy {
    pub min_version: MinVersion,
    /// The key exchange groups offered, in preference order
    /// (`--tls-groups`); the first gets a key share in the ClientHello.
    pub groups: KxGroups,
}

/// Builds the configuration every remote connection uses.
pub fn build_client(
    material: &ClientMaterial,
    policy: &ClientTlsPolicy,
) -> Result<LoadedClient, TlsConfigError> {
    check_groups(&policy.groups, policy.min_version)?;
    let (verifier, cas, crl_count) = server_verifier(material)?;
    let ca_err = |error: String| TlsConfigError::ServerCa {
        path: material.ca.path.clone(),
        error,
    };
    let builder =
        ClientConfig::builder_with_provider(Arc::new(provider_with_groups(&policy.groups)))
            .with_protocol_versions(policy.min_version.versions())
            .map_err(|e| ca_err(e.to_string()))?
            .with_webpki_verifier(verifier);
    let (mut config, identity) = match &material.identity {
        Some((cert, key)) => {
            let chain = certificates(cert, "certificate")?;
            let info =
                CertInfo::from_der(&chain[0]).map_err(|error| TlsConfigError::Unparsable {
                    path: cert.path.clone(),
                    error,
                })?;
            let config = builder
                .with_client_auth_cert(chain, private_key(key)?)
                .map_err(|error| TlsConfigError::Rustls {
                    cert: cert.path.clone(),
                    key: key.path.clone(),
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

/// The verifier a client-mode successor judges a handed-over session's
/// server chain with: the CA and CRL files as they are now, as a new
/// connection would be verified.
pub fn current_verifier(
    paths: &ClientTlsPaths,
) -> Result<Arc<WebPkiServerVerifier>, TlsConfigError> {
    let material = ClientMaterial::read(paths)?;
    Ok(server_verifier(&material)?.0)
}

/// The server's certificate is checked against the CA file, and the CRLs
/// if any: the verifier, and how many CAs and CRLs it holds.
fn server_verifier(
    material: &ClientMaterial,
) -> Result<(Arc<WebPkiServerVerifier>, usize, usize), TlsConfigError> {
    let ca_err = |error: String| TlsConfigError::ServerCa {
        path: material.ca.path.clone(),
        error,
    };
    let mut roots = RootCertStore::empty();
    for ca in certificates(&material.ca, "server CA")? {
        roots.add(ca).map_err(|e| ca_err(e.to_string()))?;
    }
    let cas = roots.len();
    let crl_list = match &material.crl {
        Some(file) => crls(file)?,
        None => Vec::new(),
    };
    let crl_count = crl_list.len();
    let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
        .with_crls(crl_list)
        .allow_unknown_revocation_status()
        // As the server side (without --tls-crl-allow-expired): a CRL past
        // its next update is refused, not trusted as current.
        .enforce_revocation_expiration()
        .build()
        .map_err(|e| ca_err(e.to_string()))?;
    Ok((verifier, cas, crl_count))
}

/// Rotation for the client side, as the server side has it: SIGHUP or a
/// poll that finds the files' bytes changed builds a new configuration
/// for new connections; a broken set keeps the previous one, and says so.
pub struct ClientReloader {
    paths: ClientTlsPaths,
    policy: ClientTlsPolicy,
    last_seen: LastSeen<ClientMaterial>,
    store: Arc<Swap<ClientConfig>>,
}

impl ClientReloader {
    /// Reads and builds once; an error here stops the start.
    pub fn start(
        paths: ClientTlsPaths,
        policy: ClientTlsPolicy,
    ) -> Result<(Self, LoadedClient), TlsConfigError> {
        let material = ClientMaterial::read(&paths)?;
        let loaded = build_client(&material, &policy)?;
        let reloader = ClientReloader {
            paths,
            policy,
            last_seen: LastSeen::new(material),
            store: Arc::new(Swap::new(loaded.config.clone())),
        };
        Ok((reloader, loaded))
    }

    /// What each new remote connection reads its configuration from.
    pub fn store(&self) -> Arc<Swap<ClientConfig>> {
        self.store.clone()
    }

    pub fn check(&mut self, trigger: Trigger) -> ReloadOutcome {
        let read = ClientMaterial::read(&self.paths).map_err(|e| e.to_string());
        let Some(seen) = self.last_seen.changed(trigger, read) else {
            return ReloadOutcome::Unchanged;
        };
        let built = seen
            .and_then(|material| build_client(&material, &self.policy).map_err(|e| e.to_string()));
        match built {
            Ok(loaded) => {
                let identity = loaded
                    .identity
                    .as_ref()
                    .map_or_else(|| "none".to_string(), |i| i.to_string());
                info!(cas = loaded.cas, crls = loaded.crls, client_certificate = %identity, groups = %self.policy.groups, "client TLS reloaded");
                self.store.replace(loaded.config);
                ReloadOutcome::Reloaded
            }
            Err(e) => {
                error!(
                    error = %e,
                    ?trigger,
                    "client TLS reload failed; new connections keep the previous CA and certificate"
                );
                ReloadOutcome::Failed
            }
        }
    }

    /// Reloads on SIGHUP and whenever a poll every `interval` (if any)
    /// finds the files changed, until the process ends.
    pub async fn watch(mut self, interval: Option<std::time::Duration>) {
        let mut triggers = Triggers::new(interval, "client certificates");
        while let Some(trigger) = triggers.next().await {
            if trigger == Trigger::Signal {
                info!("SIGHUP received: reloading client TLS files");
            }
            self.check(trigger);
        }
    }
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
        let (mut reloader, loaded) =
            ClientReloader::start(paths.clone(), ClientTlsPolicy::default()).unwrap();
        assert_eq!(loaded.cas, 1);
        assert!(loaded.identity.is_some());
        assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Unchanged);
        std::fs::write(out.join("ca-cert.pem"), "not a certificate").unwrap();
        assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Failed);
        assert_eq!(reloader.check(Trigger::Signal), ReloadOutcome::Failed);
        crate::certs::for_test(&out, "localhost", 3);
        assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Reloaded);

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
