//! Whatever happens to the TLS files while nbdgw runs (a file missing,
//! empty, truncated, swapped with another, a second layout's files
//! dropped in), no reload ever yields a configuration that admits a
//! client the start-up configuration refused. Each configuration the
//! store holds is judged by real TLS handshakes in memory.

mod common;

use std::path::Path;
use std::sync::{Arc, OnceLock};

use common::pki::{Ca, Leaf};
use nbdgw::tls::{AllowList, Reloader, TlsPolicy, TlsSources, Trigger};
use proptest::prelude::*;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, ClientConnection, ServerConfig, ServerConnection};

const FILES: [&str; 4] = [
    "server-cert.pem",
    "server-key.pem",
    "ca-cert.pem",
    "ca-crl.pem",
];

struct Fixture {
    files: Vec<(&'static str, String)>,
    admitted: Arc<ClientConfig>,
    /// Anonymous, revoked, not on the allow-list, from another CA.
    refused: Vec<(&'static str, Arc<ClientConfig>)>,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let ca = Ca::new("reload CA");
        let stranger = Ca::new("stranger CA");
        let server = ca.server("localhost");
        let client = |leaf: Option<&Leaf>| client_config(&ca, leaf);
        Fixture {
            files: vec![
                ("server-cert.pem", server.cert.clone()),
                ("server-key.pem", server.key.clone()),
                ("ca-cert.pem", ca.pem.clone()),
                ("ca-crl.pem", ca.crl(&[66])),
            ],
            admitted: client(Some(&ca.client("agent", &[], &[], 10))),
            refused: vec![
                ("anonymous", client(None)),
                ("revoked", client(Some(&ca.client("agent", &[], &[], 66)))),
                (
                    "not allowed",
                    client(Some(&ca.client("intruder", &[], &[], 11))),
                ),
                (
                    "other CA",
                    client(Some(&stranger.client("agent", &[], &[], 12))),
                ),
            ],
        }
    })
}

fn client_config(server_ca: &Ca, leaf: Option<&Leaf>) -> Arc<ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(server_ca.pem.as_bytes()).unwrap())
        .unwrap();
    let builder = ClientConfig::builder_with_provider(nbdgw::tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    Arc::new(match leaf {
        Some(leaf) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(leaf.cert.as_bytes()).unwrap()],
                PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    })
}

/// A whole TLS handshake between the two, in memory.
fn admits(server: Arc<ServerConfig>, client: Arc<ClientConfig>) -> bool {
    let mut server = ServerConnection::new(server).unwrap();
    let mut client = ClientConnection::new(client, "localhost".try_into().unwrap()).unwrap();
    for _ in 0..10 {
        let mut wire = Vec::new();
        while client.wants_write() {
            client.write_tls(&mut wire).unwrap();
        }
        if server.read_tls(&mut wire.as_slice()).is_err() || server.process_new_packets().is_err() {
            return false;
        }
        wire.clear();
        while server.wants_write() {
            server.write_tls(&mut wire).unwrap();
        }
        if client.read_tls(&mut wire.as_slice()).is_err() || client.process_new_packets().is_err() {
            return false;
        }
        if !server.is_handshaking() && !client.is_handshaking() {
            return true;
        }
    }
    false
}

#[derive(Debug, Clone)]
enum Change {
    Remove(usize),
    Empty(usize),
    Truncate(usize, usize),
    Swap(usize, usize),
    /// A Kubernetes Secret's files (and no ca.crt) appear beside.
    KubernetesFiles,
    Restore(usize),
}

fn change() -> impl Strategy<Value = Change> {
    let file = 0..FILES.len();
    prop_oneof![
        file.clone().prop_map(Change::Remove),
        file.clone().prop_map(Change::Empty),
        (file.clone(), 1usize..400).prop_map(|(f, n)| Change::Truncate(f, n)),
        (file.clone(), file.clone()).prop_map(|(a, b)| Change::Swap(a, b)),
        Just(Change::KubernetesFiles),
        file.prop_map(Change::Restore),
    ]
}

fn apply(dir: &Path, change: &Change) {
    let files = &fixture().files;
    let path = |i: usize| dir.join(FILES[i]);
    match *change {
        Change::Remove(i) => {
            let _ = std::fs::remove_file(path(i));
        }
        Change::Empty(i) => std::fs::write(path(i), "").unwrap(),
        Change::Truncate(i, n) => {
            let text = &files[i].1;
            std::fs::write(path(i), &text.as_bytes()[..n.min(text.len())]).unwrap()
        }
        Change::Swap(a, b) => {
            std::fs::write(path(a), &files[b].1).unwrap();
            std::fs::write(path(b), &files[a].1).unwrap();
        }
        Change::KubernetesFiles => {
            std::fs::write(dir.join("tls.crt"), &files[0].1).unwrap();
            std::fs::write(dir.join("tls.key"), &files[1].1).unwrap();
        }
        Change::Restore(i) => std::fs::write(path(i), &files[i].1).unwrap(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn no_sequence_of_file_states_admits_a_refused_client(
        changes in proptest::collection::vec((change(), any::<bool>()), 1..8)
    ) {
        let fixture = fixture();
        let dir = tempfile::tempdir().unwrap();
        for (name, contents) in &fixture.files {
            std::fs::write(dir.path().join(name), contents).unwrap();
        }
        let sources = TlsSources { dir: Some(dir.path().to_owned()), ..TlsSources::default() };
        let policy = TlsPolicy {
            allow: AllowList::new(vec!["agent".into()], vec![], vec![]).unwrap(),
            ..TlsPolicy::default()
        };
        let mut reloader = Reloader::start(sources, policy).unwrap();
        let store = reloader.store();
        prop_assert!(admits(store.current(), fixture.admitted.clone()));

        for (change, hangup) in &changes {
            apply(dir.path(), change);
            reloader.check(if *hangup { Trigger::Signal } else { Trigger::Poll });
            for (who, client) in &fixture.refused {
                prop_assert!(
                    !admits(store.current(), client.clone()),
                    "{} admitted after {:?}", who, change
                );
            }
        }
        // Put right, the files serve again.
        for i in 0..FILES.len() {
            apply(dir.path(), &Change::Restore(i));
        }
        reloader.check(Trigger::Signal);
        prop_assert!(admits(store.current(), fixture.admitted.clone()));
    }
}
