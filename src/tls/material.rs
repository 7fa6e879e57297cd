//! Where the certificate, key, client CA and CRL come from, and reading
//! them in one go so a reload builds from one consistent set of bytes.

use std::path::{Path, PathBuf};

use super::TlsConfigError;

/// The operator's choice: explicit files, a directory in the qemu/nbdkit
/// or the Kubernetes Secret layout, or a directory with some files
/// overridden. The directory's layout is looked at anew on every load, so
/// a CA or CRL that appears later is picked up.
#[derive(Debug, Clone, Default)]
pub struct TlsSources {
    pub dir: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub client_ca: Option<PathBuf>,
    pub crl: Option<PathBuf>,
}

/// The two directory layouts nbdgw reads, by the file that identifies each.
pub const KUBERNETES_LAYOUT: DirLayout = DirLayout {
    name: "Kubernetes",
    cert: "tls.crt",
    key: "tls.key",
    client_ca: "ca.crt",
    crl: None,
};
pub const QEMU_LAYOUT: DirLayout = DirLayout {
    name: "qemu",
    cert: "server-cert.pem",
    key: "server-key.pem",
    client_ca: "ca-cert.pem",
    crl: Some("ca-crl.pem"),
};

pub struct DirLayout {
    pub name: &'static str,
    pub cert: &'static str,
    pub key: &'static str,
    pub client_ca: &'static str,
    pub crl: Option<&'static str>,
}

impl TlsSources {
    pub fn files(cert: &Path, key: &Path) -> Self {
        TlsSources {
            cert: Some(cert.to_owned()),
            key: Some(key.to_owned()),
            ..TlsSources::default()
        }
    }

    fn resolve(&self) -> Result<Paths, TlsConfigError> {
        let mut paths = Paths::default();
        if let Some(dir) = &self.dir {
            let layout = [&KUBERNETES_LAYOUT, &QEMU_LAYOUT]
                .into_iter()
                .find(|layout| dir.join(layout.cert).exists())
                .ok_or_else(|| TlsConfigError::NoLayout(dir.clone()))?;
            let optional = |name: &str| Some(dir.join(name)).filter(|p| p.exists());
            paths.cert = Some(dir.join(layout.cert));
            paths.key = Some(dir.join(layout.key));
            paths.client_ca = optional(layout.client_ca);
            paths.crl = layout.crl.and_then(optional);
        }
        let chosen = |flag: &Option<PathBuf>, from_dir: Option<PathBuf>| flag.clone().or(from_dir);
        Ok(Paths {
            cert: chosen(&self.cert, paths.cert),
            key: chosen(&self.key, paths.key),
            client_ca: chosen(&self.client_ca, paths.client_ca),
            crl: chosen(&self.crl, paths.crl),
        })
    }
}

#[derive(Default)]
struct Paths {
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
    crl: Option<PathBuf>,
}

/// One file's path and the bytes read from it.
#[derive(Clone, PartialEq, Eq)]
pub struct PemFile {
    pub path: PathBuf,
    pub bytes: Vec<u8>,
}

impl PemFile {
    fn read(path: &Path) -> Result<Self, TlsConfigError> {
        let bytes = std::fs::read(path).map_err(|error| TlsConfigError::Read {
            path: path.to_owned(),
            error,
        })?;
        Ok(PemFile {
            path: path.to_owned(),
            bytes,
        })
    }
}

/// Everything a TLS configuration is built from. Compared byte for byte to
/// notice rotation, whether files were rewritten, renamed over, or swapped
/// in by a symlink (as Kubernetes does with `..data`).
#[derive(Clone, PartialEq, Eq)]
pub struct Material {
    pub cert: PemFile,
    pub key: PemFile,
    pub client_ca: Option<PemFile>,
    pub crl: Option<PemFile>,
}

impl Material {
    pub fn read(sources: &TlsSources) -> Result<Self, TlsConfigError> {
        let paths = sources.resolve()?;
        let (Some(cert), Some(key)) = (&paths.cert, &paths.key) else {
            return Err(TlsConfigError::NoCertificateGiven);
        };
        Ok(Material {
            cert: PemFile::read(cert)?,
            key: PemFile::read(key)?,
            client_ca: paths.client_ca.as_deref().map(PemFile::read).transpose()?,
            crl: paths.crl.as_deref().map(PemFile::read).transpose()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(dir: &Path, names: &[&str]) {
        for name in names {
            std::fs::write(dir.join(name), name).unwrap();
        }
    }

    #[test]
    fn directory_layouts_and_overrides() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let sources = TlsSources {
            dir: Some(d.to_owned()),
            ..TlsSources::default()
        };
        let err = Material::read(&sources).err().unwrap().to_string();
        assert!(err.contains("neither tls.crt"), "{err}");

        touch(d, &["server-cert.pem", "server-key.pem"]);
        let m = Material::read(&sources).unwrap();
        assert_eq!(m.cert.bytes, b"server-cert.pem");
        assert!(m.client_ca.is_none() && m.crl.is_none());

        touch(d, &["ca-cert.pem", "ca-crl.pem"]);
        let m = Material::read(&sources).unwrap();
        assert_eq!(m.client_ca.unwrap().bytes, b"ca-cert.pem");
        assert_eq!(m.crl.unwrap().bytes, b"ca-crl.pem");

        touch(d, &["tls.crt", "tls.key", "ca.crt"]);
        let m = Material::read(&sources).unwrap();
        assert_eq!(
            (m.cert.bytes, m.key.bytes, m.client_ca.unwrap().bytes),
            (b"tls.crt".to_vec(), b"tls.key".to_vec(), b"ca.crt".to_vec())
        );
        assert!(m.crl.is_none(), "the Kubernetes layout has no CRL file");

        touch(d, &["other-ca.pem"]);
        let overridden = TlsSources {
            client_ca: Some(d.join("other-ca.pem")),
            ..sources
        };
        let m = Material::read(&overridden).unwrap();
        assert_eq!(m.client_ca.unwrap().bytes, b"other-ca.pem");

        std::fs::remove_file(d.join("tls.key")).unwrap();
        let err = Material::read(&overridden).err().unwrap().to_string();
        assert!(err.contains("tls.key"), "{err}");
    }
}
