//! A gateway with a CA, its server files and a policy file: what the
//! policy tests share.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;

use super::clients::write_server_files;
use super::pki::{Ca, ClientDir};
use super::process::NbdgwProcess;
use super::Env;

pub struct PolicySite {
    pub env: Env,
    pub ca: Ca,
    /// Server certificate, key and client CA.
    pub server: [PathBuf; 3],
    pub policy: PathBuf,
}

#[allow(dead_code)]
impl PolicySite {
    pub fn new(ca_name: &str, policy: &str) -> Self {
        let env = Env::new();
        let ca = Ca::new(ca_name);
        let (cert, key, client_ca) = write_server_files(&env.path("server"), &ca.server("gw"), &ca);
        let path = env.path("policy.toml");
        std::fs::write(&path, policy).unwrap();
        PolicySite {
            env,
            ca,
            server: [cert, key, client_ca],
            policy: path,
        }
    }

    /// A client directory for a certificate with CN `cn`.
    pub fn client(&self, cn: &str, serial: u64) -> PathBuf {
        self.ca
            .client(cn, &[], &[], serial)
            .client_dir(&self.env.path(cn), &self.ca)
    }

    /// The gateway with the policy, `extra` flags (routing and more) and
    /// `vars` in its environment.
    pub fn gateway(&self, extra: &[&OsStr], vars: &[(&str, &OsStr)]) -> NbdgwProcess {
        let [cert, key, client_ca] = &self.server;
        let mut args: Vec<OsString> = [
            ("--tls-cert", cert),
            ("--tls-key", key),
            ("--tls-client-ca", client_ca),
            ("--policy", &self.policy),
        ]
        .into_iter()
        .flat_map(|(flag, path)| [OsString::from(flag), path.into()])
        .collect();
        args.extend(extra.iter().map(|a| a.to_os_string()));
        NbdgwProcess::start_with(args, vars)
    }
}
