//! Throw-away certificate authorities for identity tests: leaves with
//! chosen names and serials, and CRLs revoking some of them.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyIdMethod, KeyPair, KeyUsagePurpose,
    RevocationReason, RevokedCertParams, SanType, SerialNumber,
};
use time::{Duration, OffsetDateTime};

pub struct Ca {
    params: CertificateParams,
    key: KeyPair,
    pub pem: String,
}

/// A leaf certificate and its key, as PEM.
pub struct Leaf {
    pub cert: String,
    pub key: String,
}

impl Ca {
    pub fn new(name: &str) -> Self {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = dn(name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.not_before = OffsetDateTime::now_utc() - Duration::days(1);
        params.not_after = OffsetDateTime::now_utc() + Duration::days(30);
        let pem = params.self_signed(&key).unwrap().pem();
        Ca { params, key, pem }
    }

    /// An intermediate CA signed by this one; `serial` is what this CA's
    /// CRL names to revoke it.
    pub fn intermediate(&self, name: &str, serial: u64) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = dn(name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.serial_number = Some(SerialNumber::from(serial));
        params.not_before = OffsetDateTime::now_utc() - Duration::days(1);
        params.not_after = OffsetDateTime::now_utc() + Duration::days(30);
        let pem = params.signed_by(&key, &self.issuer()).unwrap().pem();
        Ca { params, key, pem }
    }

    fn issuer(&self) -> Issuer<'_, &KeyPair> {
        Issuer::new(self.params.clone(), &self.key)
    }

    pub fn server(&self, cn: &str) -> Leaf {
        self.leaf(
            cn,
            &["localhost", "127.0.0.1"],
            &[],
            1,
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// A client certificate; `serial` is what a CRL names to revoke it.
    pub fn client(&self, cn: &str, dns: &[&str], uris: &[&str], serial: u64) -> Leaf {
        self.leaf(cn, dns, uris, serial, ExtendedKeyUsagePurpose::ClientAuth)
    }

    fn leaf(
        &self,
        cn: &str,
        dns: &[&str],
        uris: &[&str],
        serial: u64,
        usage: ExtendedKeyUsagePurpose,
    ) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(dns.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        for uri in uris {
            params
                .subject_alt_names
                .push(SanType::URI((*uri).try_into().unwrap()));
        }
        params.distinguished_name = dn(cn);
        params.serial_number = Some(SerialNumber::from(serial));
        // GnuTLS refuses leaves without keyEncipherment.
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![usage];
        params.not_before = OffsetDateTime::now_utc() - Duration::days(1);
        params.not_after = OffsetDateTime::now_utc() + Duration::days(20);
        let cert = params.signed_by(&key, &self.issuer()).unwrap();
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    pub fn crl(&self, revoked_serials: &[u64]) -> String {
        self.crl_until(
            revoked_serials,
            OffsetDateTime::now_utc() + Duration::days(7),
        )
    }

    /// A CRL whose nextUpdate is `next_update` (in the past: expired).
    pub fn crl_until(&self, revoked_serials: &[u64], next_update: OffsetDateTime) -> String {
        let now = OffsetDateTime::now_utc();
        let params = CertificateRevocationListParams {
            this_update: next_update.min(now) - Duration::days(1),
            next_update,
            crl_number: SerialNumber::from(1u64),
            issuing_distribution_point: None,
            revoked_certs: revoked_serials
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
        params.signed_by(&self.issuer()).unwrap().pem().unwrap()
    }
}

impl Leaf {
    /// A client's certificate directory as qemu and libnbd read it:
    /// `ca-cert.pem` to trust the server, and this leaf as the client's.
    pub fn client_dir(&self, dir: &Path, server_ca: &Ca) -> std::path::PathBuf {
        self.client_dir_trusting(dir, &[server_ca])
    }

    /// As `client_dir`, with several CAs in `ca-cert.pem`: qemu checks its
    /// own certificate against that file before it connects, so a client
    /// certificate from a CA nbdgw does not trust needs its CA listed there.
    pub fn client_dir_trusting(&self, dir: &Path, cas: &[&Ca]) -> std::path::PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        let bundle: String = cas.iter().map(|ca| ca.pem.as_str()).collect();
        std::fs::write(dir.join("ca-cert.pem"), bundle).unwrap();
        std::fs::write(dir.join("client-cert.pem"), &self.cert).unwrap();
        std::fs::write(dir.join("client-key.pem"), &self.key).unwrap();
        dir.to_owned()
    }

    /// As `client_dir`, with `client-cert.pem` holding this leaf followed
    /// by `intermediate`, the chain a client of an intermediate CA sends.
    pub fn client_dir_via(&self, dir: &Path, server_ca: &Ca, intermediate: &Ca) -> PathBuf {
        let dir = self.client_dir(dir, server_ca);
        let chain = format!("{}{}", self.cert, intermediate.pem);
        std::fs::write(dir.join("client-cert.pem"), chain).unwrap();
        dir
    }

    pub fn der(&self) -> Vec<u8> {
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

fn dn(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn
}
