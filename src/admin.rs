//! The admin listener (`--admin-listen`): plain HTTP for probes and
//! scrapers on localhost or the pod network. `/healthz` is 200 while the
//! accept loop runs; `/readyz` is 200 only with the upstream reachable and
//! no shutdown under way (503 and a one-line reason otherwise); `/server`
//! is 503 while a local connection of client mode's `--reconnect` is
//! reconnecting to the server (not `/readyz`'s business: the server is a
//! dependency); `/metrics` is the Prometheus text format.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info, warn};

use crate::handover::gate::{Accepting, Gate};
use crate::listening::{look, visit, Look};
use crate::logsafe::Escaped;
use crate::metrics::{Health, Metrics};

/// How often the upstream socket is tried for `/readyz`: probes are
/// answered from the last result, never by a connection of their own.
pub const UPSTREAM_CHECK_EVERY: Duration = Duration::from_secs(2);

/// How the admin listener protects itself and the data plane.
#[derive(Debug, Clone, Copy)]
pub struct AdminLimits {
    /// Connections open at once; more are closed at accept. Its own
    /// budget, apart from the NBD listener's, so that neither can use up
    /// the descriptors of the other.
    pub max_connections: u32,
    /// For a request's head, from accept or the previous response (hyper
    /// starts it whenever it waits for a head, idle keep-alive included).
    pub header_timeout: Duration,
    /// Requests per connection; the last response says `Connection: close`.
    pub keepalive_requests: u32,
    /// A connection's whole life, however busy.
    pub keepalive_timeout: Duration,
    /// Largest request head (hyper's read buffer; at least 8192).
    pub max_header_bytes: usize,
}

impl Default for AdminLimits {
    /// The flags' defaults, for `nbdgw client`, which has no flags for them.
    fn default() -> Self {
        use crate::config::*;
        AdminLimits {
            max_connections: DEFAULT_ADMIN_MAX_CONNECTIONS,
            header_timeout: Duration::from_secs(DEFAULT_ADMIN_HEADER_TIMEOUT_SECS),
            keepalive_requests: DEFAULT_ADMIN_KEEPALIVE_REQUESTS,
            keepalive_timeout: Duration::from_secs(DEFAULT_ADMIN_KEEPALIVE_TIMEOUT_SECS),
            max_header_bytes: DEFAULT_ADMIN_MAX_HEADER_BYTES as usize,
        }
    }
}

/// The endpoints read no header at all; a probe sends a handful.
const MAX_HEADERS: usize = 32;

/// Serves the admin endpoints until the process ends.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    limits: AdminLimits,
) {
    serve_gated(listener, metrics, health, limits, Gate::always()).await
}

/// `serve`, pausing while a successor takes the listener over and ending
/// once it serves (`crate::handover`).
pub async fn serve_gated(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    limits: AdminLimits,
    mut gate: Gate,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections as usize));
    loop {
        let accepted = tokio::select! {
            state = gate.changed() => match state {
                Accepting::HandedOver => return,
                _ => continue,
            },
            accepted = listener.accept(), if gate.accepting() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!(error = %e, "admin listener: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Closed at once rather than queued: a waiting connection would
        // hold the very descriptor the cap is there to bound.
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            metrics.admin_connections_refused.inc();
            debug!(%peer, "admin connection refused: --admin-max-connections open");
            drop(stream);
            continue;
        };
        let (metrics, health) = (metrics.clone(), health.clone());
        tokio::spawn(async move {
            let open = OpenAdmin::new(&metrics, slot);
            serve_one(stream, &metrics, &health, limits).await;
            drop(open);
        });
    }
}

/// One admin connection's slot and its place in the open gauge, given
/// back however the connection ends.
struct OpenAdmin<'a> {
    metrics: &'a Metrics,
    _slot: OwnedSemaphorePermit,
}

impl<'a> OpenAdmin<'a> {
    fn new(metrics: &'a Metrics, slot: OwnedSemaphorePermit) -> Self {
        metrics.admin_connections_open.inc();
        OpenAdmin {
            metrics,
            _slot: slot,
        }
    }
}

impl Drop for OpenAdmin<'_> {
    fn drop(&mut self) {
        self.metrics.admin_connections_open.dec();
    }
}

async fn serve_one(stream: TcpStream, metrics: &Metrics, health: &Health, limits: AdminLimits) {
    let served = AtomicU32::new(0);
    let service = hyper::service::service_fn(|request| {
        let mut response = respond(&request, metrics, health);
        // The last request keep-alive allows: hyper closes after it.
        if served.fetch_add(1, Ordering::Relaxed) + 1 >= limits.keepalive_requests {
            response.headers_mut().insert(
                hyper::header::CONNECTION,
                hyper::header::HeaderValue::from_static("close"),
            );
        }
        async move { Ok::<_, Infallible>(response) }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        // Without a timer hyper's header timeout is silently inactive.
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(limits.keepalive_requests > 1)
        .max_buf_size(limits.max_header_bytes.max(MIN_HYPER_BUF))
        .max_headers(MAX_HEADERS);
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    let mut connection = pin!(connection);
    let ended = tokio::select! {
        ended = connection.as_mut() => ended,
        () = tokio::time::sleep(limits.keepalive_timeout) => {
            // Lets a response in progress finish; one the client does not
            // read is given one more header timeout, then dropped.
            connection.as_mut().graceful_shutdown();
            match tokio::time::timeout(limits.header_timeout, connection).await {
                Ok(ended) => ended,
                Err(_) => Ok(()),
            }
        }
    };
    if let Err(e) = ended {
        debug!(error = %e, "admin connection ended");
    }
}

/// hyper panics on a smaller read buffer; the flag's parser refuses one
/// too, this only keeps a library caller from the panic.
const MIN_HYPER_BUF: usize = 8192;

fn respond(
    request: &Request<Incoming>,
    metrics: &Metrics,
    health: &Health,
) -> Response<Full<Bytes>> {
    if request.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n".into());
    }
    match request.uri().path() {
        "/healthz" if health.is_accepting() => text(StatusCode::OK, "ok\n".into()),
        "/healthz" => text(StatusCode::SERVICE_UNAVAILABLE, "not accepting\n".into()),
        "/readyz" => match health.readiness() {
            Ok(()) => text(StatusCode::OK, "ready\n".into()),
            Err(reason) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")),
        },
        "/server" => match health.server_state() {
            Ok(()) => text(StatusCode::OK, "ok\n".into()),
            Err(reason) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")),
        },
        "/metrics" => {
            let mut response = text(StatusCode::OK, metrics.encode());
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            response
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "try /healthz, /readyz, /server or /metrics\n".into(),
        ),
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
}

/// Checks the upstream socket every `UPSTREAM_CHECK_EVERY` and records
/// the result for `/readyz`; logs each change once (a sidecar may start
/// before its NBD server has made the socket). The check asks the kernel
/// whether the socket file has a listener this process may connect to
/// (`crate::listening`) and does not connect: a connection is a client to
/// the NBD server, which qemu-nbd 7.2 and nbdkit log as an error when it
/// hangs up unnegotiated. Where the kernel cannot tell, it visits the
/// server with a whole handshake that the servers do not log.
pub async fn watch_upstream(path: PathBuf, health: Arc<Health>) {
    let mut last: Option<Option<String>> = None;
    let mut warned = Warned::default();
    loop {
        let problem = check_upstream(&path, &mut warned).await;
        if last.as_ref() != Some(&problem) {
            match &problem {
                None => {
                    info!(upstream = %path.display(), "upstream socket has a listener: ready")
                }
                // During a shutdown the drain's end says it once, with
                // the sessions it cut (`server::shut_down`).
                Some(p) if health.is_draining() => {
                    info!(problem = %Escaped(p), "upstream socket unavailable during the shutdown")
                }
                // The path is told to the log only, never to /readyz.
                Some(p) => warn!(problem = %Escaped(p), "upstream socket unavailable: not ready"),
            }
            last = Some(problem.clone());
        }
        health.set_upstream_down(problem.is_some());
        tokio::time::sleep(UPSTREAM_CHECK_EVERY).await;
    }
}

/// The fallbacks to visiting the server, each said once.
#[derive(Default)]
struct Warned {
    no_sock_diag: bool,
    not_found: bool,
}

/// `None` when the upstream listens, else why not (for the log).
async fn check_upstream(path: &Path, warned: &mut Warned) -> Option<String> {
    match off_runtime(path, look).await.unwrap_or_else(Look::NoDiag) {
        Look::Ready => None,
        Look::Problem(problem) => Some(problem),
        // A stale file (the server died) or a server that has bound but
        // not listened refuses the visit, silently for it; a listener
        // sock_diag cannot see or match greets it.
        Look::NotHere => {
            if let Err(e) = visit_upstream(path).await {
                return Some(format!("{}: no listener ({e})", path.display()));
            }
            // Or it began to listen just now: looked at again, so as not
            // to warn of nothing.
            let again = off_runtime(path, look).await;
            if !matches!(again, Ok(Look::Ready)) && !warned.not_found {
                warned.not_found = true;
                warn!(upstream = %path.display(), "sock_diag did not find the upstream socket's listener (another network namespace, or a filesystem whose stat device differs): the readiness check visits the NBD server instead (greeting, NBD_OPT_ABORT)");
            }
            None
        }
        Look::NoDiag(e) => {
            if !warned.no_sock_diag {
                warned.no_sock_diag = true;
                warn!(error = %e, "cannot ask the kernel for listening Unix sockets ({}): the readiness check visits the NBD server instead (greeting, NBD_OPT_ABORT)", why_no_sock_diag(&e));
            }
            let visited = visit_upstream(path).await;
            visited.err().map(|e| format!("{}: {e}", path.display()))
        }
    }
}

/// The likely cause of a sock_diag failure, for the operator: a refused
/// netlink socket is a sandbox's doing; anything else (a timeout,
/// ENOBUFS, an interrupted dump) is the kernel's, and may pass.
fn why_no_sock_diag(e: &std::io::Error) -> &'static str {
    use nix::libc::{EACCES, EAFNOSUPPORT, EPERM, EPROTONOSUPPORT};
    match e.raw_os_error() {
        Some(EAFNOSUPPORT | EPERM | EACCES) => {
            "netlink refused; under systemd RestrictAddressFamilies needs AF_NETLINK"
        }
        Some(EPROTONOSUPPORT) => "this kernel has no sock_diag for Unix sockets (unix_diag)",
        _ => "sock_diag failed, maybe for a moment",
    }
}

/// How long each step of a visit may wait for the server.
const VISIT_WITHIN: Duration = Duration::from_secs(5);

async fn visit_upstream(path: &Path) -> std::io::Result<()> {
    off_runtime(path, |path| visit(path, VISIT_WITHIN)).await?
}

/// A stat, a netlink dump or a visit, off the runtime's threads: short,
/// but blocking.
async fn off_runtime<T: Send + 'static>(
    path: &Path,
    blocking: impl FnOnce(&Path) -> T + Send + 'static,
) -> std::io::Result<T> {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || blocking(&path))
        .await
        .map_err(std::io::Error::other)
}
