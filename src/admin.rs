//! The admin listener (`--admin-listen`): plain HTTP for probes and
//! scrapers on localhost or the pod network. `/healthz` is 200 while the
//! accept loop runs; `/readyz` is 200 only with the upstream reachable and
//! no shutdown under way (503 and a one-line reason otherwise);
//! `/metrics` is the Prometheus text format.

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, UnixStream};
use tracing::{debug, info, warn};

use crate::logsafe::Escaped;
use crate::metrics::{Health, Metrics};

/// How often the upstream socket is tried for `/readyz`: probes are
/// answered from the last result, never by a connection of their own.
pub const UPSTREAM_CHECK_EVERY: Duration = Duration::from_secs(2);

/// Serves the admin endpoints until the process ends.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, health: Arc<Health>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!(error = %e, "admin listener: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (metrics, health) = (metrics.clone(), health.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let response = respond(&request, &metrics, &health);
                async move { Ok::<_, Infallible>(response) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                debug!(error = %e, "admin connection ended");
            }
        });
    }
}

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
            "try /healthz, /readyz or /metrics\n".into(),
        ),
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
}

/// Tries the upstream socket every `UPSTREAM_CHECK_EVERY` and records the
/// result for `/readyz`; logs each change once (a sidecar may start before
/// its NBD server has made the socket).
pub async fn watch_upstream(path: PathBuf, health: Arc<Health>) {
    let mut last: Option<Option<String>> = None;
    loop {
        let problem = match UnixStream::connect(&path).await {
            Ok(_) => None,
            Err(e) => Some(format!("{}: {e}", path.display())),
        };
        if last.as_ref() != Some(&problem) {
            match &problem {
                None => {
                    info!(upstream = %path.display(), "upstream socket accepts connections: ready")
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
