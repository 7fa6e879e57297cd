//! Live rotation: the configuration new connections use can be swapped at
//! any time; connections already established keep the one they started with.

use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use std::time::{Duration, Instant};

use rustls::ServerConfig;
use tracing::{error, info, warn};

use crate::reloadable::{LastSeen, Swap, Triggers};
pub use crate::reloadable::{ReloadOutcome, Trigger};

use super::{
    build, CertInfo, Guards, Loaded, Material, Sessions, TlsConfigError, TlsPaths, TlsPolicy,
    TlsSources,
};

/// Warn this long before the served certificate expires.
pub const EXPIRY_WARNING_DAYS: i64 = 7;

/// The configuration handed to each new connection, the sessions it
/// established, and how reloads went.
pub struct TlsStore {
    current: Swap<ServerConfig>,
    /// The client certificate check of the configuration in force (chain,
    /// CRL, allow-lists): how a successor judges a session offered to it.
    judge: Swap<Judge>,
    sessions: Arc<Sessions>,
    /// `--tls-min-version`, fixed for the life of the process: a
    /// successor declines a session of an older version (rustls keeps
    /// the enabled versions private in `ServerConfig`).
    min_version: crate::tls::MinVersion,
    /// Shared with the metrics registry.
    pub reloads_ok: Counter,
    pub reloads_failed: Counter,
    /// Reloads that changed the client CA or the CRL (what decides whose
    /// certificate is good): the TLS half of the generation a proven
    /// source is proven under. A reload changing only the server's own
    /// certificate and key, or nothing (a SIGHUP), revokes nobody.
    pub trust_changes: Counter,
    /// Unix times, for alerts before expiry.
    pub certificate_not_after: Gauge,
    pub client_ca_not_after: Gauge,
}

/// A configuration's client certificate check; None: none asked for.
#[derive(Default)]
pub struct Judge(pub Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>);

impl TlsStore {
    pub fn fixed(config: ServerConfig) -> Arc<Self> {
        Arc::new(Self::new(Arc::new(config)))
    }

    fn new(config: Arc<ServerConfig>) -> Self {
        TlsStore {
            current: Swap::new(config),
            judge: Swap::new(Arc::default()),
            sessions: Arc::default(),
            min_version: crate::tls::MinVersion::default(),
            reloads_ok: Counter::default(),
            reloads_failed: Counter::default(),
            trust_changes: Counter::default(),
            certificate_not_after: Gauge::default(),
            client_ca_not_after: Gauge::default(),
        }
    }

    fn note_expiry(&self, loaded: &Loaded) {
        self.certificate_not_after.set(loaded.served.not_after_unix);
        self.client_ca_not_after
            .set(loaded.client_ca_not_after.unwrap_or(0));
    }

    pub fn sessions(&self) -> &Arc<Sessions> {
        &self.sessions
    }

    pub fn min_version(&self) -> crate::tls::MinVersion {
        self.min_version
    }

    pub fn current(&self) -> Arc<ServerConfig> {
        self.current.current()
    }

    /// The client certificate check in force (see `Judge`).
    pub fn judge(&self) -> Arc<Judge> {
        self.judge.current()
    }

    fn set_judge(&self, loaded: &crate::tls::Loaded) {
        self.judge.replace(Arc::new(Judge(loaded.verifier.clone())));
    }

    fn replace(&self, config: Arc<ServerConfig>) {
        self.current.replace(config)
    }
}

/// Owns the files and the last bytes seen, and swaps the store's
/// configuration when they change, build cleanly, and keep every guard
/// the start-up configuration had.
pub struct Reloader {
    paths: TlsPaths,
    policy: TlsPolicy,
    /// Decided once, at start: a reload may not drop any of them.
    guards: Guards,
    store: Arc<TlsStore>,
    /// What the last look at the files found, good or bad, so a file that
    /// stays broken is reported once, not on every poll.
    last_seen: LastSeen<Material>,
    served: CertInfo,
    /// The client CA and CRL in force, to tell a reload that changes
    /// them (see [`TlsStore::trust_changes`]).
    trust: Trust,
}

type Trust = (Option<crate::tls::PemFile>, Option<crate::tls::PemFile>);

impl Reloader {
    /// The first load: unlike a reload, its failure stops start-up.
    pub fn start(sources: TlsSources, policy: TlsPolicy) -> Result<Self, TlsConfigError> {
        let paths = sources.resolve()?;
        let material = Material::read(&paths)?;
        let loaded = build(&material, &policy)?;
        log_loaded(&loaded, &material, &policy.groups, "loaded");
        let guards = loaded.guards();
        let min_version = policy.min_version;
        info!(
            layout = paths.layout.unwrap_or("files"),
            client_certificates = if guards.client_certificates { "required" } else { "not requested" },
            revocation = if guards.revocation { "checked" } else { "no CRL" },
            "client authentication fixed for the life of the process; reloads may replace the files' contents, not drop them"
        );
        Ok(Reloader {
            paths,
            policy,
            guards,
            store: {
                let mut store = TlsStore::new(loaded.config.clone());
                store.min_version = min_version;
                let store = Arc::new(store);
                store.note_expiry(&loaded);
                store.set_judge(&loaded);
                store
            },
            trust: (material.client_ca.clone(), material.crl.clone()),
            last_seen: LastSeen::new(material),
            served: loaded.served,
        })
    }

    /// Whether clients must present certificates, fixed for the life of
    /// the process.
    pub fn requires_client_certificates(&self) -> bool {
        self.guards.client_certificates
    }

    /// The files fixed at start, which every reload reads again.
    pub fn paths(&self) -> &TlsPaths {
        &self.paths
    }

    pub fn store(&self) -> Arc<TlsStore> {
        self.store.clone()
    }

    pub fn check(&mut self, trigger: Trigger) -> ReloadOutcome {
        let read = Material::read(&self.paths).map_err(|e| e.to_string());
        let Some(seen) = self.last_seen.changed(trigger, read) else {
            return ReloadOutcome::Unchanged;
        };
        let built = seen.and_then(|material| {
            let loaded = build(&material, &self.policy).map_err(|e| e.to_string())?;
            self.keeps_the_guards(&loaded)?;
            Ok((loaded, material))
        });
        match built {
            Ok((loaded, material)) => {
                log_loaded(&loaded, &material, &self.policy.groups, "reloaded");
                self.store.reloads_ok.inc();
                let trust = (material.client_ca, material.crl);
                if trust != self.trust {
                    // Before the new configuration and the revocations:
                    // nothing it ends may end under the old generation.
                    self.store.trust_changes.inc();
                    self.trust = trust;
                }
                self.store.note_expiry(&loaded);
                self.store.set_judge(&loaded);
                self.store.replace(loaded.config);
                self.served = loaded.served;
                if let (true, Some(verifier)) = (self.policy.revoke_closes, &loaded.chain_verifier)
                {
                    self.store.sessions.close_revoked(verifier.as_ref());
                }
                ReloadOutcome::Reloaded
            }
            Err(e) => {
                let failed = self.store.reloads_failed.inc() + 1;
                error!(
                    error = %e,
                    reloads_failed = failed,
                    still_serving = %self.served.sha256,
                    ?trigger,
                    "TLS reload failed; new connections keep getting the previous certificate and client policy"
                );
                ReloadOutcome::Failed
            }
        }
    }

    /// The paths are fixed at start, so a missing CA or CRL already fails
    /// to read; this says it again where a future change could not miss it.
    fn keeps_the_guards(&self, loaded: &Loaded) -> Result<(), String> {
        let now = loaded.guards();
        if now == self.guards {
            return Ok(());
        }
        Err(format!(
            "it would change client authentication from {:?} to {now:?}; restart nbdgw to change it",
            self.guards
        ))
    }

    /// Reloads on SIGHUP, and whenever a poll every `interval` (if any)
    /// finds the files changed. Repeats the expiry warning daily. Runs
    /// until the process ends.
    pub async fn watch(mut self, interval: Option<Duration>) {
        let mut triggers = Triggers::new(interval, "certificates");
        let mut next_expiry_check = Instant::now() + Duration::from_secs(86_400);
        while let Some(trigger) = triggers.next().await {
            if trigger == Trigger::Signal {
                info!("SIGHUP received: reloading TLS files");
            }
            self.check(trigger);
            if Instant::now() >= next_expiry_check {
                warn_if_expiring(&self.served);
                next_expiry_check += Duration::from_secs(86_400);
            }
        }
    }
}

fn log_loaded(
    loaded: &Loaded,
    material: &Material,
    groups: &crate::tls::KxGroups,
    what: &'static str,
) {
    let served = &loaded.served;
    let client_auth = match (&material.client_ca, loaded.client_cas) {
        (Some(ca), Some(count)) => format!(
            "required ({count} CA certificate(s) from {}, {} CRL(s))",
            ca.path.display(),
            loaded.crls
        ),
        _ => "not requested".to_string(),
    };
    info!(
        cert = %material.cert.path.display(),
        subject = %crate::logsafe::Escaped(&served.subject),
        not_after = %served.not_after,
        sha256 = %served.sha256,
        %client_auth,
        %groups,
        "TLS certificate {what}"
    );
    warn_if_expiring(served);
}

fn warn_if_expiring(served: &CertInfo) {
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let days = served.days_left(now);
    if days < 0 {
        error!(subject = %crate::logsafe::Escaped(&served.subject), not_after = %served.not_after, "the served certificate has expired; clients will refuse it");
    } else if days < EXPIRY_WARNING_DAYS {
        warn!(subject = %crate::logsafe::Escaped(&served.subject), not_after = %served.not_after, days_left = days, "the served certificate expires within {EXPIRY_WARNING_DAYS} days");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn make(out: &std::path::Path, server: &str) {
        crate::certs::for_test(out, server, 30);
    }

    #[test]
    fn reloads_on_change_keeps_old_on_failure_and_reports_a_failure_once() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        make(d, "first");
        let sources = TlsSources {
            dir: Some(d.to_owned()),
            ..TlsSources::default()
        };
        let mut reloader = Reloader::start(sources, TlsPolicy::default()).unwrap();
        let store = reloader.store();
        let first = store.current();
        assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Unchanged);
        assert!(Arc::ptr_eq(&first, &store.current()));
        assert_eq!(reloader.check(Trigger::Signal), ReloadOutcome::Reloaded);

        make(d, "second");
        assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Reloaded);
        assert_eq!(reloader.served.common_names, vec!["second".to_string()]);
        let second = store.current();
        assert!(!Arc::ptr_eq(&first, &second));

        std::fs::write(d.join("server-key.pem"), "garbage").unwrap();
        assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Failed);
        assert_eq!(reloader.check(Trigger::Poll), ReloadOutcome::Unchanged);
        assert_eq!(reloader.check(Trigger::Signal), ReloadOutcome::Failed);
        assert!(Arc::ptr_eq(&second, &store.current()));
        assert_eq!(reloader.served.common_names, vec!["second".to_string()]);
    }
}
