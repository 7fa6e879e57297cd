//! The process around either mode: logging, the async runtime, systemd's
//! notifications, the stop signals, and the listening sockets handed to
//! the runtime.

use std::io::IsTerminal;

use anyhow::{Context, Result};
use sd_notify::NotifyState;
use tokio::net::TcpListener;
use tracing::warn;

use crate::cli::LogFormat;

/// rustls's own warnings are about what a peer sent and let pass (libnbd
/// names an IP address in SNI, on every connection to one: "Illegal SNI
/// extension"), a line per connection any peer can cause; a refusal is
/// logged by nbdgw with its reason.
pub const DEFAULT_LOG_FILTER: &str = "info,rustls=error";

/// Logs to stderr in `format`, filtered by RUST_LOG (else
/// [`DEFAULT_LOG_FILTER`]).
pub fn init_logging(format: LogFormat) {
    let filter = log_filter(std::env::var("RUST_LOG").ok().as_deref());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// RUST_LOG when it parses, else the default: a typo there must not
/// silence the log.
fn log_filter(rust_log: Option<&str>) -> tracing_subscriber::EnvFilter {
    rust_log
        .and_then(|value| tracing_subscriber::EnvFilter::try_new(value).ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER))
}

/// The multi-threaded runtime both modes run on.
pub fn runtime(threads: usize) -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Resolves at SIGTERM or SIGINT, once systemd has been told.
pub async fn stopping() {
    crate::shutdown::signals().await;
    notify(&[NotifyState::Stopping]);
}

/// `stopping`, with the signal handlers installed at this call
/// (`crate::shutdown::watch_signals`).
pub fn stopping_from_now() -> impl std::future::Future<Output = ()> + Send + 'static {
    let signals = crate::shutdown::watch_signals();
    async move {
        signals.await;
        notify(&[NotifyState::Stopping]);
    }
}

/// Tells systemd (Type=notify) where start-up and shutdown are; a no-op
/// without NOTIFY_SOCKET.
pub fn notify(state: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(state) {
        warn!(target: "nbdgw", error = %e, "cannot notify systemd (NOTIFY_SOCKET)");
    }
}

/// A listener bound before the runtime (and the sandbox), handed to it.
pub fn async_listener(listener: std::net::TcpListener) -> Result<TcpListener> {
    listener
        .set_nonblocking(true)
        .context("setting the listening socket non-blocking")?;
    TcpListener::from_std(listener).context("registering the listening socket")
}

/// The address a listener has, for the start line.
pub fn display_addr(listener: &TcpListener) -> String {
    listener
        .local_addr()
        .map_or_else(|e| format!("(unknown: {e})"), |addr| addr.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_filter_quiets_rustls_and_keeps_info() {
        let filter = log_filter(None).to_string();
        assert!(filter.contains("rustls=error"), "{filter}");
        assert!(filter.contains("info"), "{filter}");
    }

    #[test]
    fn rust_log_replaces_the_default_and_a_bad_one_does_not() {
        assert_eq!(log_filter(Some("debug")).to_string(), "debug");
        let bad = log_filter(Some("nbdgw=notalevel")).to_string();
        assert!(bad.contains("rustls=error"), "{bad}");
    }

    #[test]
    fn a_listener_is_handed_to_the_runtime_with_its_address() {
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = std_listener.local_addr().unwrap();
        let runtime = runtime(1).unwrap();
        let shown = runtime.block_on(async {
            let listener = async_listener(std_listener).unwrap();
            display_addr(&listener)
        });
        assert_eq!(shown, addr.to_string());
    }
}
