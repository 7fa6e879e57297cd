//! The successor's judgement of an offered session, against its own
//! configuration, as a reload judges a live session
//! (`crate::tls::sessions`): the client certificate through this
//! process's whole check (chain, CRL, allow-lists), the policy's access
//! to the export at least what the session holds, and the export
//! reaching the same upstream. A session this configuration would not
//! admit, or would narrow, is declined: it stays with the predecessor,
//! which is draining, and so ends at its next request boundary once what
//! it has in flight is answered (as at SIGTERM) — never moved here with
//! more than this configuration grants.

use rustls::pki_types::{CertificateDer, UnixTime};

use crate::admission::{Admission, Identity, SessionPermit};
use crate::config::Config;
use crate::identity::CertInfo;
use crate::policy::Access;
use crate::proto::handover_session::Offer;
use crate::tls::handover::state::suite_params;
use crate::tls::MinVersion;

/// What an admitted session is, here.
pub struct Judged {
    pub identity: CertInfo,
    pub access: Access,
    /// `policy:N`, `--allow-*` or `open`, and the rule's line.
    pub rule: (String, usize),
    /// Its session slot here (`--max-connections`,
    /// `--max-sessions-per-identity`), reserved when the offer is
    /// accepted: a session over the limits is declined and drains in the
    /// old gateway, never closed after its state left. Given back when the
    /// offer is withdrawn or its state lost; the session holds it.
    pub slot: SessionPermit,
}

/// Why not: `class: words`, the class one of the metric's labels.
pub fn judge(offer: &Offer, (config, admission): (&Config, &Admission)) -> Result<Judged, String> {
    if suite_params(offer.suite).is_none() {
        return Err(format!(
            "other: cipher suite {:#06x} is not handed over",
            offer.suite
        ));
    }
    tls(offer, config)?;
    limits(offer, config)?;
    if offer.kernel_tls {
        kernel_tls(offer.suite, config)?;
    }
    let identity = certificate(offer, config)?;
    let held = if offer.read_write {
        Access::ReadWrite
    } else {
        Access::ReadOnly
    };
    let policy = config.policy.current();
    let decision = policy.decide_with_rule(&identity, &offer.export);
    let Some(decision) = decision.filter(|d| d.access >= held) else {
        return Err(format!(
            "policy: this gateway's policy grants the client less than {held} on the export"
        ));
    };
    upstream(offer, config)?;
    let who = Identity::of((!offer.chain.is_empty()).then_some(&identity));
    let slot = admission.session(who).map_err(|refusal| {
        config.metrics.session_refused(refusal.metric_reason());
        format!("limits: {refusal}")
    })?;
    let rule = match decision.rule {
        Some(rule) => (format!("policy:{}", rule.number), rule.line),
        None if config.allow_lists => ("--allow-*".to_string(), 0),
        None => ("open".to_string(), 0),
    };
    Ok(Judged {
        identity,
        access: held,
        rule,
        slot,
    })
}

/// A kernel TLS session stays in the kernel (its keys are in the
/// socket): only a process that would itself put such a session there
/// takes it, one whose start-up probe found the kernel takes the suite
/// and follows key updates in it. Otherwise (`--ktls off`, or a probe
/// that failed) it is declined and drains in the old gateway.
fn kernel_tls(suite: u16, config: &Config) -> Result<(), String> {
    use rustls::CipherSuite::*;
    let Some(ciphers) = config.kernel_tls else {
        return Err("other: kernel TLS is off or unavailable in this gateway".to_string());
    };
    let taken = match rustls::CipherSuite::from(suite) {
        TLS13_AES_128_GCM_SHA256 => ciphers.aes_128_gcm,
        TLS13_AES_256_GCM_SHA384 => ciphers.aes_256_gcm,
        TLS13_CHACHA20_POLY1305_SHA256 => ciphers.chacha20_poly1305,
        _ => false,
    };
    match taken {
        true => Ok(()),
        false => Err(format!(
            "other: the kernel does not take cipher suite {suite:#06x} here"
        )),
    }
}

/// The TLS settings this process would negotiate: a session of an older
/// version than `--tls-min-version`, or a suite or key exchange group
/// this configuration does not offer, is one it would not admit. A
/// session that recorded no group (0) is judged on the rest.
fn tls(offer: &Offer, config: &Config) -> Result<(), String> {
    let min = match config.tls.min_version() {
        MinVersion::Tls12 => 0x0303,
        MinVersion::Tls13 => 0x0304,
    };
    if offer.tls_version < min {
        return Err(format!(
            "tls: TLS version {:#06x} is below this gateway's --tls-min-version",
            offer.tls_version
        ));
    }
    let server = config.tls.current();
    let provider = server.crypto_provider();
    let suite_here = provider
        .cipher_suites
        .iter()
        .any(|s| u16::from(s.suite()) == offer.suite);
    if !suite_here {
        return Err(format!(
            "tls: cipher suite {:#06x} is not offered by this gateway",
            offer.suite
        ));
    }
    let group_here = provider
        .kx_groups
        .iter()
        .any(|g| u16::from(g.name()) == offer.group);
    if offer.group != 0 && !group_here {
        return Err(format!(
            "tls: key exchange group {:#06x} is not accepted by this gateway (--tls-groups)",
            offer.group
        ));
    }
    Ok(())
}

/// The per-request limits the relay applies here must allow whatever the
/// session was allowed there: otherwise its next large request would be
/// cut mid-session (and blamed on the client); declined, it drains in the
/// old gateway instead.
fn limits(offer: &Offer, config: &Config) -> Result<(), String> {
    let here = config.relay.max_payload;
    if here < offer.max_payload {
        return Err(format!(
            "limits: --max-payload {here} is below the {} bytes the session may send",
            offer.max_payload
        ));
    }
    Ok(())
}

/// The chain through this process's client certificate check; an
/// anonymous session only where no client certificate is asked for.
fn certificate(offer: &Offer, config: &Config) -> Result<CertInfo, String> {
    let judge = config.tls.judge();
    let Some((leaf, intermediates)) = offer.chain.split_first() else {
        return match judge.0 {
            None => Ok(CertInfo::default()),
            Some(_) => Err("certificate: a client certificate is required here".to_string()),
        };
    };
    let identity = CertInfo::from_der(leaf).map_err(|e| format!("certificate: {e}"))?;
    if let Some(verifier) = &judge.0 {
        let leaf = CertificateDer::from(leaf.as_slice());
        let intermediates: Vec<_> = intermediates
            .iter()
            .map(|c| CertificateDer::from(c.as_slice()))
            .collect();
        verifier
            .verify_client_cert(&leaf, &intermediates, UnixTime::now())
            .map_err(|e| format!("certificate: {e}"))?;
    }
    Ok(identity)
}

/// The export must reach the very upstream it reaches there, under the
/// same name: the successor serves it on the predecessor's connection.
fn upstream(offer: &Offer, config: &Config) -> Result<(), String> {
    let (socket, name) = match &config.exports {
        Some(table) => match table.lookup(&offer.export) {
            Some(export) => (export.socket, export.upstream_name),
            None => return Err("export: no such export here".to_string()),
        },
        None => (config.upstream.clone(), offer.export.clone()),
    };
    let same_socket = socket.as_os_str().as_encoded_bytes() == offer.upstream.as_slice();
    if !same_socket || name != offer.upstream_export {
        return Err("export: the export reaches another upstream here".to_string());
    }
    Ok(())
}
