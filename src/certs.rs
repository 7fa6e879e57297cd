//! `nbdgw certs`: a CA, a server certificate and client certificates in
//! the directory layout qemu (`tls-creds-x509,dir=`), nbdkit
//! (`--tls-certificates=`) and libnbd (`tls-certificates=`) read.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyIdMethod, KeyPair, KeyUsagePurpose,
    RevocationReason, RevokedCertParams, SanType, SerialNumber,
};
use rustls::pki_types::pem::PemObject;
use thiserror::Error;
use time::{Duration, OffsetDateTime};

#[derive(Debug, Error)]
pub enum CertsError {
    #[error("{0} already exists (pass --force to overwrite)")]
    Exists(PathBuf),
    #[error("cannot write {path}: {error}")]
    Write {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("cannot create directory {path}: {error}")]
    Mkdir {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("certificate generation failed: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("invalid name {0:?}: names must be non-empty and contain no '/'")]
    BadName(String),
    #[error("{uris} --client-uri given for {names} client certificate(s): the Nth URI goes into the Nth certificate")]
    TooManyUris { uris: usize, names: usize },
    #[error(
        "invalid --client-uri {0:?}: expected scheme:rest, e.g. spiffe://example.org/ns/x/sa/y"
    )]
    BadUri(String),
    #[error("cannot read {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("CA certificate {0}: not a parsable CA certificate")]
    BadCa(PathBuf),
    #[error("CA key {key} does not belong to CA certificate {cert}")]
    CaKeyMismatch { cert: PathBuf, key: PathBuf },
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct CertsRequest {
    pub out: PathBuf,
    /// DNS names or IP addresses for the server certificate's SANs.
    pub server_names: Vec<String>,
    /// One client certificate per name: the first is `client-cert.pem`,
    /// the others `client-NAME-cert.pem`.
    pub client_names: Vec<String>,
    /// URI SANs (SPIFFE IDs, say): the Nth goes into the Nth client
    /// certificate, beside its DNS name.
    pub client_uris: Vec<String>,
    pub days: u32,
    pub force: bool,
    /// Issue from this existing CA (certificate, key) instead of a new one.
    pub ca: Option<(PathBuf, PathBuf)>,
    /// Write a new CA's key to `ca-key.pem`, to issue more later;
    /// otherwise it is thrown away.
    pub keep_ca_key: bool,
}

pub const DEFAULT_SERVER_NAMES: [&str; 2] = ["localhost", "127.0.0.1"];
pub const DEFAULT_CLIENT_NAME: &str = "nbdgw-client";

/// Generates the files and returns their paths.
pub fn generate(req: &CertsRequest) -> Result<Vec<PathBuf>, CertsError> {
    check_request(req)?;
    // Everything is checked, the CA read, before anything is written, so
    // a refusal leaves no half-written directory behind.
    let ca = match &req.ca {
        Some((cert, key)) => Authority::load(cert, key)?,
        None => Authority::new(&unique_ca_name(), i64::from(req.days) + 1)?,
    };
    let keep_ca_key = req.keep_ca_key && req.ca.is_none();
    if !req.force {
        for name in planned_files(req, keep_ca_key) {
            let path = req.out.join(name);
            if path.exists() {
                return Err(CertsError::Exists(path));
            }
        }
    }
    std::fs::create_dir_all(&req.out).map_err(|error| CertsError::Mkdir {
        path: req.out.clone(),
        error,
    })?;
    let mut written = Vec::new();
    let mut put = |name: &str, contents: &str, secret: bool| -> Result<(), CertsError> {
        let path = req.out.join(name);
        write_file(&path, contents, secret, req.force)?;
        written.push(path);
        Ok(())
    };
    put("ca-cert.pem", &ca.pem, false)?;
    if keep_ca_key {
        put("ca-key.pem", &ca.issuer.key().serialize_pem(), true)?;
    }
    let server_cn = req
        .server_names
        .first()
        .map(String::as_str)
        .unwrap_or("localhost");
    let server = ca.leaf(&LeafSpec {
        names: &req.server_names,
        ..LeafSpec::server(server_cn, req.days)
    })?;
    put("server-cert.pem", &server.cert, false)?;
    put("server-key.pem", &server.key, true)?;
    for (i, name) in req.client_names.iter().enumerate() {
        let client = ca.leaf(&LeafSpec {
            names: std::slice::from_ref(name),
            uris: req
                .client_uris
                .get(i)
                .map(std::slice::from_ref)
                .unwrap_or(&[]),
            ..LeafSpec::client(name, req.days)
        })?;
        let stem = client_stem(i, name);
        put(&format!("{stem}-cert.pem"), &client.cert, false)?;
        put(&format!("{stem}-key.pem"), &client.key, true)?;
    }
    Ok(written)
}

fn check_request(req: &CertsRequest) -> Result<(), CertsError> {
    for name in req.server_names.iter().chain(&req.client_names) {
        if name.is_empty() || name.contains('/') {
            return Err(CertsError::BadName(name.clone()));
        }
    }
    if req.client_uris.len() > req.client_names.len() {
        return Err(CertsError::TooManyUris {
            uris: req.client_uris.len(),
            names: req.client_names.len(),
        });
    }
    for uri in &req.client_uris {
        if !uri.contains(':') || uri.chars().any(char::is_whitespace) {
            return Err(CertsError::BadUri(uri.clone()));
        }
    }
    Ok(())
}

/// The files `generate` writes.
fn planned_files(req: &CertsRequest, keep_ca_key: bool) -> Vec<String> {
    let mut files: Vec<String> = ["ca-cert.pem", "server-cert.pem", "server-key.pem"]
        .map(String::from)
        .to_vec();
    if keep_ca_key {
        files.push("ca-key.pem".into());
    }
    for (i, name) in req.client_names.iter().enumerate() {
        let stem = client_stem(i, name);
        files.push(format!("{stem}-cert.pem"));
        files.push(format!("{stem}-key.pem"));
    }
    files
}

/// A certificate authority: what `nbdgw certs` makes, and what tests use
/// to make CAs, intermediates, leaves with chosen names and serials, and
/// CRLs.
pub struct Authority {
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate, PEM.
    pub pem: String,
}

/// A leaf certificate and its key, as PEM.
pub struct Leaf {
    pub cert: String,
    pub key: String,
}

/// What a leaf certificate says.
#[derive(Debug, Clone)]
pub struct LeafSpec<'a> {
    pub common_name: &'a str,
    /// DNS names and IP addresses (an address becomes an IP SAN).
    pub names: &'a [String],
    /// URI SANs, SPIFFE IDs say.
    pub uris: &'a [String],
    /// What a CRL names to revoke it; random when not given.
    pub serial: Option<u64>,
    pub server: bool,
    pub days: u32,
}

impl<'a> LeafSpec<'a> {
    pub fn server(common_name: &'a str, days: u32) -> Self {
        LeafSpec {
            common_name,
            names: &[],
            uris: &[],
            serial: None,
            server: true,
            days,
        }
    }

    pub fn client(common_name: &'a str, days: u32) -> Self {
        LeafSpec {
            server: false,
            ..LeafSpec::server(common_name, days)
        }
    }
}

impl Authority {
    /// A self-signed CA valid from yesterday for `days` days.
    pub fn new(name: &str, days: i64) -> Result<Self, CertsError> {
        let key = KeyPair::generate()?;
        let params = ca_params(name, days, None)?;
        let pem = params.self_signed(&key)?.pem();
        Ok(Authority {
            issuer: Issuer::new(params, key),
            pem,
        })
    }

    /// An existing CA, read from its certificate and key files, to issue
    /// more leaves from.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, CertsError> {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|error| CertsError::Read {
                path: path.to_owned(),
                error,
            })
        };
        let (pem, key_pem) = (read(cert)?, read(key)?);
        let key_pair = KeyPair::from_pem(&key_pem)?;
        let bad_ca = || CertsError::BadCa(cert.to_owned());
        let der = rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes())
            .map_err(|_| bad_ca())?;
        let (_, parsed) = x509_parser::parse_x509_certificate(&der).map_err(|_| bad_ca())?;
        if *parsed.public_key().subject_public_key.data != *key_pair.public_key_raw() {
            return Err(CertsError::CaKeyMismatch {
                cert: cert.to_owned(),
                key: key.to_owned(),
            });
        }
        let issuer = Issuer::from_ca_cert_der(&der, key_pair).map_err(|_| bad_ca())?;
        Ok(Authority { issuer, pem })
    }

    /// An intermediate CA signed by this one; `serial` is what this CA's
    /// CRL names to revoke it.
    pub fn intermediate(&self, name: &str, serial: u64, days: i64) -> Result<Self, CertsError> {
        let key = KeyPair::generate()?;
        let params = ca_params(name, days, Some(serial))?;
        let pem = params.signed_by(&key, &self.issuer)?.pem();
        Ok(Authority {
            issuer: Issuer::new(params, key),
            pem,
        })
    }

    pub fn leaf(&self, spec: &LeafSpec<'_>) -> Result<Leaf, CertsError> {
        let now = OffsetDateTime::now_utc();
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(spec.names.to_vec())?;
        for uri in spec.uris {
            params
                .subject_alt_names
                .push(SanType::URI(uri.as_str().try_into()?));
        }
        params.distinguished_name = dn(spec.common_name);
        if let Some(serial) = spec.serial {
            params.serial_number = Some(SerialNumber::from(serial));
        }
        // GnuTLS (qemu, libnbd, nbdkit) refuses leaves without keyEncipherment.
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![if spec.server {
            ExtendedKeyUsagePurpose::ServerAuth
        } else {
            ExtendedKeyUsagePurpose::ClientAuth
        }];
        params.not_before = now - Duration::days(1);
        params.not_after = now + Duration::days(i64::from(spec.days));
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }

    /// A CRL revoking `serials`, valid until `next_update` (in the past:
    /// an expired CRL).
    pub fn crl(&self, serials: &[u64], next_update: OffsetDateTime) -> Result<String, CertsError> {
        let now = OffsetDateTime::now_utc();
        let params = CertificateRevocationListParams {
            this_update: next_update.min(now) - Duration::days(1),
            next_update,
            crl_number: SerialNumber::from(1u64),
            issuing_distribution_point: None,
            revoked_certs: serials
                .iter()
                .map(|&serial| RevokedCertParams {
                    serial_number: SerialNumber::from(serial),
                    revocation_time: now - Duration::hours(1),
                    reason_code: Some(RevocationReason::KeyCompromise),
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: KeyIdMethod::Sha256,
        };
        Ok(params.signed_by(&self.issuer)?.pem()?)
    }
}

/// GnuTLS (qemu, libnbd) looks a certificate's issuer up by name, so two
/// CAs with one name cannot be trusted side by side, as they must be
/// while clients move from an old CA to a new one.
fn unique_ca_name() -> String {
    let mut tag = [0u8; 4];
    let _ = aws_lc_rs::rand::fill(&mut tag);
    let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
    format!("nbdgw CA {hex}")
}

fn ca_params(name: &str, days: i64, serial: Option<u64>) -> Result<CertificateParams, CertsError> {
    let now = OffsetDateTime::now_utc();
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name = dn(name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.serial_number = serial.map(SerialNumber::from);
    params.not_before = now - Duration::days(1);
    params.not_after = now + Duration::days(days);
    Ok(params)
}

/// A CA, a server certificate for `server_name` and one client
/// certificate `client`, valid `days`: what unit tests load.
#[cfg(test)]
pub(crate) fn for_test(out: &Path, server_name: &str, days: u32) -> Vec<PathBuf> {
    generate(&CertsRequest {
        out: out.to_owned(),
        server_names: vec![server_name.into()],
        client_names: vec!["client".into()],
        client_uris: vec![],
        days,
        force: true,
        ca: None,
        keep_ca_key: false,
    })
    .expect("generate test certificates")
}

fn client_stem(index: usize, name: &str) -> String {
    if index == 0 {
        "client".to_string()
    } else {
        format!("client-{name}")
    }
}

fn dn(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn
}

fn write_file(path: &Path, contents: &str, secret: bool, force: bool) -> Result<(), CertsError> {
    let err = |error| CertsError::Write {
        path: path.to_owned(),
        error,
    };
    if force {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e)),
        }
    }
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                CertsError::Exists(path.to_owned())
            } else {
                err(e)
            }
        })?;
    f.write_all(contents.as_bytes()).map_err(err)?;
    f.sync_all().map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::CertInfo;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;

    fn request(out: &Path, uris: &[&str]) -> CertsRequest {
        CertsRequest {
            out: out.to_owned(),
            server_names: vec!["localhost".into()],
            client_names: vec!["a".into(), "b".into()],
            client_uris: uris.iter().map(|u| u.to_string()).collect(),
            days: 1,
            force: false,
            ca: None,
            keep_ca_key: false,
        }
    }

    #[test]
    fn the_nth_uri_goes_into_the_nth_client_certificate() {
        let dir = tempfile::tempdir().unwrap();
        generate(&request(dir.path(), &["spiffe://td/a", "spiffe://td/b"])).unwrap();
        for (file, cn, uri) in [
            ("client-cert.pem", "a", "spiffe://td/a"),
            ("client-b-cert.pem", "b", "spiffe://td/b"),
        ] {
            let der = CertificateDer::from_pem_file(dir.path().join(file)).unwrap();
            let info = CertInfo::from_der(&der).unwrap();
            assert_eq!(info.common_names, [cn]);
            assert_eq!(info.dns_names, [cn]);
            assert_eq!(info.uris, [uri]);
        }
    }

    #[test]
    fn more_uris_than_clients_or_a_uri_without_scheme_is_refused_before_writing() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let err = generate(&request(&out, &["a:1", "b:2", "c:3"])).unwrap_err();
        assert!(
            err.to_string().contains("3 --client-uri given for 2"),
            "{err}"
        );
        let err = generate(&request(&out, &["no-scheme"])).unwrap_err();
        assert!(err.to_string().contains("expected scheme:rest"), "{err}");
        assert!(!out.exists(), "nothing written");
    }
}
