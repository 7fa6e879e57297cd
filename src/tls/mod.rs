//! Server-side TLS: certificate material from files or a directory, the
//! client-certificate policy, and the configuration new connections use,
//! which a reload may replace at any time.

pub mod groups;
pub mod handover;
pub mod kernel;
pub mod key_update;
mod material;
mod reload;
mod sessions;
mod verifier;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer};
use rustls::server::danger::ClientCertVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use thiserror::Error;

pub use crate::identity::{AllowList, CertInfo, PatternError};
pub use groups::KxGroups;
pub use material::{
    DirLayout, Material, PemFile, TlsPaths, TlsSources, KUBERNETES_LAYOUT, QEMU_LAYOUT,
};
pub use reload::{ReloadOutcome, Reloader, TlsStore, Trigger, EXPIRY_WARNING_DAYS};
pub use sessions::{Ended, Grant, SessionGuard, Sessions};

#[derive(Debug, Error)]
pub enum TlsConfigError {
    #[error("no server certificate given: pass --tls-cert and --tls-key, or --tls-dir")]
    NoCertificateGiven,
    #[error("{0} holds neither tls.crt (Kubernetes layout) nor server-cert.pem (qemu layout)")]
    NoLayout(PathBuf),
    #[error("cannot read {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{what} file {path}: {error}")]
    Pem {
        what: &'static str,
        path: PathBuf,
        error: rustls::pki_types::pem::Error,
    },
    #[error("{what} file {path} holds no {what}")]
    Empty { what: &'static str, path: PathBuf },
    #[error("server certificate {path}: {error}")]
    Unparsable {
        path: PathBuf,
        error: crate::identity::CertParseError,
    },
    #[error("certificate {cert} and key {key} cannot be used together: {error}")]
    Rustls {
        cert: PathBuf,
        key: PathBuf,
        error: rustls::Error,
    },
    #[error("client CA {path}: {error}")]
    ClientCa { path: PathBuf, error: String },
    #[error("a CRL ({0}) needs a client CA to check against (--tls-client-ca)")]
    CrlWithoutCa(PathBuf),
    #[error("no CA to check the server's certificate against: {0} holds neither ca-cert.pem (libnbd and qemu layout) nor ca.crt (Kubernetes layout); pass --tls-ca")]
    NoServerCa(PathBuf),
    #[error("no CA to check the server's certificate against: pass --tls-dir or --tls-ca")]
    NoServerCaGiven,
    #[error("server CA {path}: {error}")]
    ServerCa { path: PathBuf, error: String },
    #[error("client certificate {0} has no key beside it (client-key.pem, tls.key or --tls-key)")]
    ClientKeyMissing(PathBuf),
    #[error("--tls-groups {0} has no group TLS 1.2 can use (the ML-KEM groups are TLS 1.3 only): add a classical group (X25519, secp256r1) or pass --tls-min-version 1.3")]
    GroupsWithoutTls12(KxGroups),
    #[error("--allow-cn, --allow-dns and --allow-uri need a client CA (--tls-client-ca, or ca-cert.pem / ca.crt in --tls-dir)")]
    AllowWithoutCa,
}

/// The one crypto provider nbdgw uses. Naming it explicitly keeps rustls
/// from panicking should another crate ever enable a second provider.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// The provider of TLS connections (either side): the key exchange
/// groups `groups` lists, in its order (see `groups` for why rustls's
/// default order is not used).
pub(crate) fn provider_with_groups(groups: &KxGroups) -> rustls::crypto::CryptoProvider {
    let mut provider = rustls::crypto::aws_lc_rs::default_provider();
    provider.kx_groups = groups.to_provider();
    provider
}

/// A TLS 1.2 peer must find a group in `groups` if TLS 1.2 is allowed.
/// Checked again by every build; main checks it first so that the error
/// is not reported as one of the TLS files'.
/// `--tls-groups`, either mode, at start: as `check_groups`, and a pure
/// ML-KEM list is taken with a warning.
pub fn check_groups_or_warn(
    groups: &KxGroups,
    min_version: MinVersion,
) -> Result<(), TlsConfigError> {
    check_groups(groups, min_version)?;
    if let Some(warning) = groups.pure_mlkem_warning() {
        tracing::warn!("{warning}");
    }
    Ok(())
}

pub fn check_groups(groups: &KxGroups, min_version: MinVersion) -> Result<(), TlsConfigError> {
    if min_version == MinVersion::Tls12 && !groups.usable_in_tls12() {
        return Err(TlsConfigError::GroupsWithoutTls12(groups.clone()));
    }
    Ok(())
}

/// The server's provider: its groups, and its suites in the order
/// `CipherOrder::Server` describes (AES-128-GCM before AES-256-GCM, in
/// TLS 1.3 and 1.2 alike; the rest as rustls has them).
fn server_provider(order: CipherOrder, groups: &KxGroups) -> Arc<rustls::crypto::CryptoProvider> {
    let mut provider = provider_with_groups(groups);
    if order == CipherOrder::Server {
        // A stable sort: only the AES-128 suites move ahead of their
        // AES-256 counterparts, TLS 1.3 ones still before TLS 1.2 ones.
        provider.cipher_suites.sort_by_key(|suite| {
            let tls12 = matches!(suite, rustls::SupportedCipherSuite::Tls12(_));
            let aes128 = matches!(
                suite.suite(),
                rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
                    | rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
                    | rustls::CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
            );
            (tls12, !aes128)
        });
    }
    Arc::new(provider)
}

/// The oldest TLS version offered. Nothing below 1.2 exists in rustls, and
/// its suites are all AEAD, so this is the only protocol knob there is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MinVersion {
    /// The NBD spec requires servers to support TLS 1.2.
    #[default]
    #[value(name = "1.2")]
    Tls12,
    #[value(name = "1.3")]
    Tls13,
}

impl MinVersion {
    pub(crate) fn versions(self) -> &'static [&'static rustls::SupportedProtocolVersion] {
        const FROM_12: &[&rustls::SupportedProtocolVersion] =
            &[&rustls::version::TLS13, &rustls::version::TLS12];
        const ONLY_13: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];
        match self {
            MinVersion::Tls12 => FROM_12,
            MinVersion::Tls13 => ONLY_13,
        }
    }
}

/// Who chooses the cipher suite among those both sides support.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum CipherOrder {
    /// nbdgw's: AES-128-GCM, then AES-256-GCM, then ChaCha20-Poly1305 (as
    /// Go's and BoringSSL's servers choose). GnuTLS clients (qemu,
    /// libnbd) list AES-256-GCM first; AES-128-GCM is a TLS 1.3 suite
    /// every client must have, costs a SHA-256 key schedule (with the
    /// CPU's SHA instructions) instead of SHA-384, and encrypts faster.
    #[default]
    Server,
    /// The client's order, as rustls does by default.
    Client,
}

/// How many accepted client chains a configuration remembers by default.
pub const VERIFIED_CHAIN_CACHE: usize = 4096;

/// What the operator asks of clients, as opposed to the files (which can
/// change while nbdgw runs). Fixed for the life of the process.
#[derive(Debug, Clone)]
pub struct TlsPolicy {
    pub min_version: MinVersion,
    pub allow: AllowList,
    /// Admit clients whose CRL is past its nextUpdate (otherwise refused).
    pub crl_allow_expired: bool,
    /// End established sessions whose certificate a reload revokes.
    pub revoke_closes: bool,
    /// Let established sessions' keys leave rustls, for kernel TLS.
    pub secret_extraction: bool,
    /// How many accepted client chains one configuration remembers
    /// (`--verified-chain-cache`).
    pub verified_chain_cache: usize,
    pub cipher_order: CipherOrder,
    /// The key exchange groups accepted (`--tls-groups`).
    pub groups: KxGroups,
}

impl Default for TlsPolicy {
    fn default() -> Self {
        TlsPolicy {
            min_version: MinVersion::default(),
            allow: AllowList::default(),
            crl_allow_expired: false,
            revoke_closes: false,
            secret_extraction: false,
            verified_chain_cache: VERIFIED_CHAIN_CACHE,
            cipher_order: CipherOrder::default(),
            groups: KxGroups::default(),
        }
    }
}

/// A built configuration and what the log should say about it.
pub struct Loaded {
    pub config: Arc<ServerConfig>,
    pub served: CertInfo,
    /// Client CA certificates, when client certificates are required.
    pub client_cas: Option<usize>,
    pub crls: usize,
    /// The chain and revocation check alone (no allow-list, no logging),
    /// to judge established sessions again after a reload.
    pub chain_verifier: Option<Arc<dyn ClientCertVerifier>>,
    /// The whole client certificate check (chain, CRL, allow-lists), as
    /// handshakes run it: to judge a session a predecessor offers.
    pub verifier: Option<Arc<dyn ClientCertVerifier>>,
    /// The earliest expiry in the client CA bundle, Unix time.
    pub client_ca_not_after: Option<i64>,
}

/// What decides who may connect, as far as the files decide it. A reload
/// may replace the CA bundle or the CRLs, never drop either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guards {
    pub client_certificates: bool,
    pub revocation: bool,
}

impl Loaded {
    pub fn guards(&self) -> Guards {
        Guards {
            client_certificates: self.client_cas.is_some(),
            revocation: self.crls > 0,
        }
    }
}

/// Builds the server configuration from one consistent set of files.
pub fn build(material: &Material, policy: &TlsPolicy) -> Result<Loaded, TlsConfigError> {
    let chain = certificates(&material.cert, "certificate")?;
    let private_key = private_key(&material.key)?;
    let served = CertInfo::from_der(&chain[0]).map_err(|error| TlsConfigError::Unparsable {
        path: material.cert.path.clone(),
        error,
    })?;

    let rustls_err = |error| TlsConfigError::Rustls {
        cert: material.cert.path.clone(),
        key: material.key.path.clone(),
        error,
    };
    check_groups(&policy.groups, policy.min_version)?;
    let builder =
        ServerConfig::builder_with_provider(server_provider(policy.cipher_order, &policy.groups))
            .with_protocol_versions(policy.min_version.versions())
            .map_err(rustls_err)?;
    let mut whole: Option<Arc<dyn ClientCertVerifier>> = None;
    let (builder, client) = match &material.client_ca {
        Some(ca_file) => {
            let client = client_verifier(ca_file, material.crl.as_ref(), policy)?;
            let verified =
                verifier::VerifiedChains::new(policy.verified_chain_cache, client.crl_deadline);
            let authorizing = verifier::AuthorizingVerifier::new(
                client.chain.clone(),
                policy.allow.clone(),
                verified,
            );
            let authorizing: Arc<dyn ClientCertVerifier> = Arc::new(authorizing);
            whole = Some(authorizing.clone());
            (builder.with_client_cert_verifier(authorizing), Some(client))
        }
        None if !policy.allow.is_empty() => return Err(TlsConfigError::AllowWithoutCa),
        None => match &material.crl {
            Some(crl) => return Err(TlsConfigError::CrlWithoutCa(crl.path.clone())),
            None => (builder.with_no_client_auth(), None),
        },
    };
    let mut config = builder
        .with_single_cert(chain, private_key)
        .map_err(rustls_err)?;
    // No session resumption: NBD clients (qemu, libnbd) do not resume, so
    // tickets would cost a signature-free but needless record per
    // connection, and a resumed session would skip the client certificate
    // checks (and a CRL loaded since).
    config.send_tls13_tickets = 0;
    config.ignore_client_order = policy.cipher_order == CipherOrder::Server;
    config.enable_secret_extraction = policy.secret_extraction;
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    Ok(Loaded {
        config: Arc::new(config),
        served,
        client_cas: client.as_ref().map(|c| c.cas),
        crls: client.as_ref().map_or(0, |c| c.crls),
        client_ca_not_after: client.as_ref().and_then(|c| c.not_after),
        chain_verifier: client.map(|c| c.chain),
        verifier: whole,
    })
}

struct ClientVerifier {
    chain: Arc<dyn ClientCertVerifier>,
    cas: usize,
    crls: usize,
    not_after: Option<i64>,
    /// The CRLs' earliest nextUpdate, Unix seconds, if it is enforced.
    crl_deadline: Option<u64>,
}

fn client_verifier(
    ca_file: &PemFile,
    crl_file: Option<&PemFile>,
    policy: &TlsPolicy,
) -> Result<ClientVerifier, TlsConfigError> {
    let ca_err = |error: String| TlsConfigError::ClientCa {
        path: ca_file.path.clone(),
        error,
    };
    let mut roots = RootCertStore::empty();
    let mut not_after = None::<i64>;
    for ca in certificates(ca_file, "client CA")? {
        if let Ok(info) = CertInfo::from_der(&ca) {
            not_after = Some(not_after.map_or(info.not_after_unix, |t| t.min(info.not_after_unix)));
        }
        roots.add(ca).map_err(|e| ca_err(e.to_string()))?;
    }
    let crls = match crl_file {
        Some(file) => crls(file)?,
        None => Vec::new(),
    };
    let crl_count = crls.len();
    // A CRL whose nextUpdate cannot be read here (another parser than
    // webpki's) leaves nothing remembered under these files: 0.
    let crl_deadline = if policy.crl_allow_expired {
        None
    } else {
        crls.iter()
            .map(|crl| crl_next_update(crl).unwrap_or(0))
            .min()
    };
    let cas = roots.len();
    // Revocation is checked for every certificate of the client's chain
    // that a CRL in the file covers, intermediates included. A certificate
    // whose issuer has no CRL in the file is not refused for that, so a
    // CRL for one CA of a bundle does not lock out the others.
    let mut builder = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
        .with_crls(crls)
        .allow_unknown_revocation_status();
    if !policy.crl_allow_expired {
        builder = builder.enforce_revocation_expiration();
    }
    let chain = builder.build().map_err(|e| match crl_file {
        Some(crl) => ca_err(format!("with CRL {}: {e}", crl.path.display())),
        None => ca_err(e.to_string()),
    })?;
    Ok(ClientVerifier {
        chain,
        cas,
        crls: crl_count,
        not_after,
        crl_deadline,
    })
}

/// A CRL's nextUpdate in Unix seconds (before 1970: 0); none if it has
/// none (webpki refuses such a CRL) or cannot be parsed.
fn crl_next_update(crl: &CertificateRevocationListDer<'_>) -> Option<u64> {
    use x509_parser::prelude::FromDer;
    use x509_parser::revocation_list::CertificateRevocationList;
    let (_, crl) = CertificateRevocationList::from_der(crl.as_ref()).ok()?;
    Some(u64::try_from(crl.next_update()?.timestamp()).unwrap_or(0))
}

/// A CRL file must hold at least one CRL: an empty file (one being
/// rewritten in place) or a certificate put there by mistake would
/// otherwise switch revocation off without a word.
pub(crate) fn crls(
    file: &PemFile,
) -> Result<Vec<CertificateRevocationListDer<'static>>, TlsConfigError> {
    let crls = CertificateRevocationListDer::pem_slice_iter(&file.bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| TlsConfigError::Pem {
            what: "CRL",
            path: file.path.clone(),
            error,
        })?;
    if crls.is_empty() {
        return Err(TlsConfigError::Empty {
            what: "CRL",
            path: file.path.clone(),
        });
    }
    Ok(crls)
}

/// The first private key in `file`, in whichever PEM form it is.
pub(crate) fn private_key(file: &PemFile) -> Result<PrivateKeyDer<'static>, TlsConfigError> {
    PrivateKeyDer::from_pem_slice(&file.bytes).map_err(|error| match error {
        rustls::pki_types::pem::Error::NoItemsFound => TlsConfigError::Empty {
            what: "private key",
            path: file.path.clone(),
        },
        error => TlsConfigError::Pem {
            what: "private key",
            path: file.path.clone(),
            error,
        },
    })
}

pub(crate) fn certificates(
    file: &PemFile,
    what: &'static str,
) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    let certs = CertificateDer::pem_slice_iter(&file.bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| TlsConfigError::Pem {
            what,
            path: file.path.clone(),
            error,
        })?;
    if certs.is_empty() {
        return Err(TlsConfigError::Empty {
            what,
            path: file.path.clone(),
        });
    }
    Ok(certs)
}

/// A server configuration from a certificate and key alone, with no client
/// certificates: what tests and simple set-ups need.
pub fn load_server_config(cert: &Path, key: &Path) -> Result<ServerConfig, TlsConfigError> {
    let material = Material::read(&TlsSources::files(cert, key).resolve()?)?;
    let loaded = build(&material, &TlsPolicy::default())?;
    Ok(Arc::unwrap_or_clone(loaded.config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_what_is_wrong_with_the_files() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("c");
        crate::certs::for_test(&out, "localhost", 1);
        let f = |name: &str| out.join(name);
        load_server_config(&f("server-cert.pem"), &f("server-key.pem")).unwrap();
        let cases = [
            (
                "client-cert.pem",
                "server-key.pem",
                "cannot be used together",
            ),
            ("nope.pem", "server-key.pem", "cannot read"),
            ("server-key.pem", "server-key.pem", "holds no certificate"),
            ("server-cert.pem", "server-cert.pem", "holds no private key"),
        ];
        for (cert, key, expected) in cases {
            let err = load_server_config(&f(cert), &f(key))
                .unwrap_err()
                .to_string();
            assert!(err.contains(expected), "{cert} + {key}: {err}");
        }
    }

    #[test]
    fn policy_needs_a_client_ca() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().to_owned();
        crate::certs::for_test(&out, "localhost", 3);
        let mut material = Material::read(
            &TlsSources::files(&out.join("server-cert.pem"), &out.join("server-key.pem"))
                .resolve()
                .unwrap(),
        )
        .unwrap();
        let policy = TlsPolicy {
            allow: AllowList::new(vec!["client".into()], vec![], vec![]).unwrap(),
            ..TlsPolicy::default()
        };
        let err = build(&material, &policy).err().unwrap().to_string();
        assert!(err.contains("need a client CA"), "{err}");

        material.client_ca = Some(material.cert.clone());
        material.client_ca.as_mut().unwrap().bytes =
            std::fs::read(out.join("ca-cert.pem")).unwrap();
        let loaded = build(&material, &policy).unwrap();
        assert_eq!(loaded.client_cas, Some(1));
        assert_eq!(loaded.served.common_names, vec!["localhost".to_string()]);
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        let days = loaded.served.days_left(now);
        assert!(
            (2..=3).contains(&days),
            "3-day certificate, just made: {days}"
        );
    }
}
