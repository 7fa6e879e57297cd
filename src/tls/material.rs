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

    /// Which files to read, decided once: the directory's layout, and
    /// whether a client CA and a CRL are there, are fixed at start so that
    /// no later change in the directory (a CA moved away for a moment, a
    /// `tls.crt` dropped into a qemu-layout directory) can switch client
    /// authentication or revocation off. A file fixed here that later
    /// goes missing fails the reload instead.
    pub fn resolve(&self) -> Result<TlsPaths, TlsConfigError> {
        let mut layout = None;
        let (mut cert, mut key, mut client_ca, mut crl) = (None, None, None, None);
        if let Some(dir) = &self.dir {
            let found = [&KUBERNETES_LAYOUT, &QEMU_LAYOUT]
                .into_iter()
                .find(|layout| dir.join(layout.cert).exists())
                .ok_or_else(|| TlsConfigError::NoLayout(dir.clone()))?;
            let present = |name: &str| Some(dir.join(name)).filter(|p| p.exists());
            layout = Some(found.name);
            cert = Some(dir.join(found.cert));
            key = Some(dir.join(found.key));
            client_ca = present(found.client_ca);
            crl = found.crl.and_then(present);
        }
        // A flag overrides the directory's file of the same role.
        let (Some(cert), Some(key)) = (self.cert.clone().or(cert), self.key.clone().or(key)) else {
            return Err(TlsConfigError::NoCertificateGiven);
        };
        Ok(TlsPaths {
            layout,
            cert,
            key,
            client_ca: self.client_ca.clone().or(client_ca),
            crl: self.crl.clone().or(crl),
        })
    }
}

/// The files a gateway reads for its whole life (see `TlsSources::resolve`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsPaths {
    /// The directory layout the files were found in, if from a directory.
    pub layout: Option<&'static str>,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
    pub crl: Option<PathBuf>,
}

impl TlsPaths {
    /// Every file a reload reads.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        [
            Some(&self.cert),
            Some(&self.key),
            self.client_ca.as_ref(),
            self.crl.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(PathBuf::as_path)
    }
}

/// One file's path and the bytes read from it.
#[derive(Clone, PartialEq, Eq)]
pub struct PemFile {
    pub path: PathBuf,
    pub bytes: Vec<u8>,
}

impl PemFile {
    pub(crate) fn read(path: &Path) -> Result<Self, TlsConfigError> {
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
    /// Every file `paths` names must be there: a CA or CRL that was there
    /// at start and is gone now is an error, not a policy change.
    pub fn read(paths: &TlsPaths) -> Result<Self, TlsConfigError> {
        Ok(Material {
            cert: PemFile::read(&paths.cert)?,
            key: PemFile::read(&paths.key)?,
            client_ca: paths.client_ca.as_deref().map(PemFile::read).transpose()?,
            crl: paths.crl.as_deref().map(PemFile::read).transpose()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(sources: &TlsSources) -> Result<Material, TlsConfigError> {
        Material::read(&sources.resolve()?)
    }

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
        let err = read(&sources).err().unwrap().to_string();
        assert!(err.contains("neither tls.crt"), "{err}");

        touch(d, &["server-cert.pem", "server-key.pem"]);
        let m = read(&sources).unwrap();
        assert_eq!(m.cert.bytes, b"server-cert.pem");
        assert!(m.client_ca.is_none() && m.crl.is_none());

        touch(d, &["ca-cert.pem", "ca-crl.pem"]);
        let m = read(&sources).unwrap();
        assert_eq!(m.client_ca.unwrap().bytes, b"ca-cert.pem");
        assert_eq!(m.crl.unwrap().bytes, b"ca-crl.pem");

        touch(d, &["tls.crt", "tls.key", "ca.crt"]);
        let m = read(&sources).unwrap();
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
        let m = read(&overridden).unwrap();
        assert_eq!(m.client_ca.unwrap().bytes, b"other-ca.pem");

        std::fs::remove_file(d.join("tls.key")).unwrap();
        let err = read(&overridden).err().unwrap().to_string();
        assert!(err.contains("tls.key"), "{err}");
    }

    #[test]
    fn paths_are_fixed_at_start_so_a_vanished_ca_fails_instead_of_switching_auth_off() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        touch(
            d,
            &[
                "server-cert.pem",
                "server-key.pem",
                "ca-cert.pem",
                "ca-crl.pem",
            ],
        );
        let sources = TlsSources {
            dir: Some(d.to_owned()),
            ..TlsSources::default()
        };
        let paths = sources.resolve().unwrap();
        assert_eq!(paths.layout, Some("qemu"));
        assert_eq!(paths.client_ca, Some(d.join("ca-cert.pem")));

        // A Kubernetes-layout file appearing does not flip the layout.
        touch(d, &["tls.crt", "tls.key"]);
        let m = Material::read(&paths).unwrap();
        assert_eq!(m.cert.bytes, b"server-cert.pem");
        assert_eq!(m.client_ca.unwrap().bytes, b"ca-cert.pem");

        for gone in ["ca-cert.pem", "ca-crl.pem"] {
            std::fs::rename(d.join(gone), d.join("moved")).unwrap();
            let err = Material::read(&paths).err().unwrap().to_string();
            assert!(err.contains(gone) && err.contains("cannot read"), "{err}");
            std::fs::rename(d.join("moved"), d.join(gone)).unwrap();
        }
    }
}
