//! `nbdgw certs`: a CA, a server certificate and client certificates in
//! the directory layout qemu (`tls-creds-x509,dir=`), nbdkit
//! (`--tls-certificates=`) and libnbd (`tls-certificates=`) read.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
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
}

pub const DEFAULT_SERVER_NAMES: [&str; 2] = ["localhost", "127.0.0.1"];
pub const DEFAULT_CLIENT_NAME: &str = "nbdgw-client";

/// Generates the files and returns their paths.
pub fn generate(req: &CertsRequest) -> Result<Vec<PathBuf>, CertsError> {
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
    let mut files = vec![
        ("ca-cert.pem".to_string(), false),
        ("server-cert.pem".to_string(), false),
        ("server-key.pem".to_string(), true),
    ];
    for (i, name) in req.client_names.iter().enumerate() {
        let stem = client_stem(i, name);
        files.push((format!("{stem}-cert.pem"), false));
        files.push((format!("{stem}-key.pem"), true));
    }
    // Check everything before writing anything, so a refusal leaves no
    // half-written directory behind.
    if !req.force {
        for (f, _) in &files {
            let p = req.out.join(f);
            if p.exists() {
                return Err(CertsError::Exists(p));
            }
        }
    }
    std::fs::create_dir_all(&req.out).map_err(|error| CertsError::Mkdir {
        path: req.out.clone(),
        error,
    })?;

    let now = OffsetDateTime::now_utc();
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.distinguished_name = dn("nbdgw CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca_params.not_before = now - Duration::days(1);
    ca_params.not_after = now + Duration::days(i64::from(req.days) + 1);
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, &ca_key);

    let mut written = Vec::new();
    let mut put = |name: &str, contents: &str, secret: bool| -> Result<(), CertsError> {
        let path = req.out.join(name);
        write_file(&path, contents, secret, req.force)?;
        written.push(path);
        Ok(())
    };
    put("ca-cert.pem", &ca_cert.pem(), false)?;

    let leaf =
        |names: &[String], uri: Option<&String>, cn: &str, usage: ExtendedKeyUsagePurpose| {
            let key = KeyPair::generate()?;
            let mut params = CertificateParams::new(names.to_vec())?;
            if let Some(uri) = uri {
                params
                    .subject_alt_names
                    .push(SanType::URI(uri.as_str().try_into()?));
            }
            params.distinguished_name = dn(cn);
            // GnuTLS (qemu, libnbd, nbdkit) refuses leaves without keyEncipherment.
            params.key_usages = vec![
                KeyUsagePurpose::DigitalSignature,
                KeyUsagePurpose::KeyEncipherment,
            ];
            params.extended_key_usages = vec![usage];
            params.not_before = now - Duration::days(1);
            params.not_after = now + Duration::days(i64::from(req.days));
            let cert = params.signed_by(&key, &issuer)?;
            Ok::<_, CertsError>((cert.pem(), key.serialize_pem()))
        };

    let server_cn = req
        .server_names
        .first()
        .map(String::as_str)
        .unwrap_or("localhost");
    let (cert, key) = leaf(
        &req.server_names,
        None,
        server_cn,
        ExtendedKeyUsagePurpose::ServerAuth,
    )?;
    put("server-cert.pem", &cert, false)?;
    put("server-key.pem", &key, true)?;

    for (i, name) in req.client_names.iter().enumerate() {
        let (cert, key) = leaf(
            std::slice::from_ref(name),
            req.client_uris.get(i),
            name,
            ExtendedKeyUsagePurpose::ClientAuth,
        )?;
        let stem = client_stem(i, name);
        put(&format!("{stem}-cert.pem"), &cert, false)?;
        put(&format!("{stem}-key.pem"), &key, true)?;
    }
    Ok(written)
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
