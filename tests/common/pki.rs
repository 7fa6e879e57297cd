//! Throw-away certificate authorities for identity tests: leaves with
//! chosen names and serials, and CRLs revoking some of them.

use std::path::{Path, PathBuf};

pub use nbdgw::certs::Leaf;
use nbdgw::certs::{Authority, LeafSpec};
use time::{Duration, OffsetDateTime};

/// A throw-away CA (valid 30 days) whose leaves are valid 20 days.
pub struct Ca {
    authority: Authority,
    pub pem: String,
}

const CA_DAYS: i64 = 30;
const LEAF_DAYS: u32 = 20;

impl Ca {
    pub fn new(name: &str) -> Self {
        Self::from(Authority::new(name, CA_DAYS).unwrap())
    }

    fn from(authority: Authority) -> Self {
        Ca {
            pem: authority.pem.clone(),
            authority,
        }
    }

    /// An intermediate CA signed by this one; `serial` is what this CA's
    /// CRL names to revoke it.
    pub fn intermediate(&self, name: &str, serial: u64) -> Ca {
        Self::from(self.authority.intermediate(name, serial, CA_DAYS).unwrap())
    }

    pub fn server(&self, cn: &str) -> Leaf {
        let names = ["localhost".to_string(), "127.0.0.1".to_string()];
        self.authority
            .leaf(&LeafSpec {
                names: &names,
                serial: Some(1),
                ..LeafSpec::server(cn, LEAF_DAYS)
            })
            .unwrap()
    }

    /// A server certificate for `names` (DNS names or IP addresses),
    /// valid from yesterday for `days` days: 0 makes one that has expired
    /// by the time a client checks it, a second later.
    pub fn server_for(&self, cn: &str, names: &[&str], days: u32) -> Leaf {
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        self.authority
            .leaf(&LeafSpec {
                names: &names,
                serial: Some(1),
                ..LeafSpec::server(cn, days)
            })
            .unwrap()
    }

    /// A client certificate; `serial` is what a CRL names to revoke it.
    pub fn client(&self, cn: &str, dns: &[&str], uris: &[&str], serial: u64) -> Leaf {
        let owned = |xs: &[&str]| xs.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let (dns, uris) = (owned(dns), owned(uris));
        self.authority
            .leaf(&LeafSpec {
                names: &dns,
                uris: &uris,
                serial: Some(serial),
                ..LeafSpec::client(cn, LEAF_DAYS)
            })
            .unwrap()
    }

    pub fn crl(&self, revoked_serials: &[u64]) -> String {
        self.crl_until(
            revoked_serials,
            OffsetDateTime::now_utc() + Duration::days(7),
        )
    }

    /// A CRL whose nextUpdate is `next_update` (in the past: expired).
    pub fn crl_until(&self, revoked_serials: &[u64], next_update: OffsetDateTime) -> String {
        self.authority.crl(revoked_serials, next_update).unwrap()
    }
}

/// Client directories as qemu and libnbd read them.
pub trait ClientDir {
    fn client_dir(&self, dir: &Path, server_ca: &Ca) -> PathBuf;
    fn client_dir_trusting(&self, dir: &Path, cas: &[&Ca]) -> PathBuf;
    fn client_dir_via(&self, dir: &Path, server_ca: &Ca, intermediate: &Ca) -> PathBuf;
    fn der(&self) -> Vec<u8>;
}

impl ClientDir for Leaf {
    /// A client's certificate directory as qemu and libnbd read it:
    /// `ca-cert.pem` to trust the server, and this leaf as the client's.
    fn client_dir(&self, dir: &Path, server_ca: &Ca) -> std::path::PathBuf {
        self.client_dir_trusting(dir, &[server_ca])
    }

    /// As `client_dir`, with several CAs in `ca-cert.pem`: qemu checks its
    /// own certificate against that file before it connects, so a client
    /// certificate from a CA nbdgw does not trust needs its CA listed there.
    fn client_dir_trusting(&self, dir: &Path, cas: &[&Ca]) -> std::path::PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        let bundle: String = cas.iter().map(|ca| ca.pem.as_str()).collect();
        std::fs::write(dir.join("ca-cert.pem"), bundle).unwrap();
        std::fs::write(dir.join("client-cert.pem"), &self.cert).unwrap();
        std::fs::write(dir.join("client-key.pem"), &self.key).unwrap();
        dir.to_owned()
    }

    /// As `client_dir`, with `client-cert.pem` holding this leaf followed
    /// by `intermediate`, the chain a client of an intermediate CA sends.
    fn client_dir_via(&self, dir: &Path, server_ca: &Ca, intermediate: &Ca) -> PathBuf {
        let dir = self.client_dir(dir, server_ca);
        let chain = format!("{}{}", self.cert, intermediate.pem);
        std::fs::write(dir.join("client-cert.pem"), chain).unwrap();
        dir
    }

    fn der(&self) -> Vec<u8> {
        use rustls::pki_types::pem::PemObject;
        rustls::pki_types::CertificateDer::from_pem_slice(self.cert.as_bytes())
            .unwrap()
            .to_vec()
    }
}

/// A directory that trusts `server_ca` and presents no client certificate.
pub fn anonymous_client_dir(dir: &Path, server_ca: &Ca) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("ca-cert.pem"), &server_ca.pem).unwrap();
    dir.to_owned()
}
