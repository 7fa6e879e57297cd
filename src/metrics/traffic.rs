//! Transmission: requests by command, the NBD errors replies carried, how
//! long requests took, and the upstream sockets; and the build running.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::Metrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Command {
    pub command: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NbdError {
    /// A name from `proto::transmission::error_name`, never the raw value:
    /// the upstream would choose the number of series.
    pub error: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Build {
    version: &'static str,
}

pub(super) fn latency_histogram() -> Histogram {
    // 20 µs to about 5 s.
    Histogram::new(exponential_buckets(20e-6, 2.0, 18))
}

impl Metrics {
    pub(super) fn register_requests(&self, r: &mut Registry) {
        let m = self;
        r.register("requests", "Requests by command", m.requests.clone());
        r.register(
            "request_errors",
            "Replies carrying an NBD error, by error",
            m.request_errors.clone(),
        );
        r.register(
            "request_duration_seconds",
            "From a request read to its last reply handed to TLS, by command",
            m.request_seconds.clone(),
        );
        r.register(
            "upstream_connect_failures",
            "Connections to the upstream socket that failed",
            m.upstream_connect_failures.clone(),
        );
        r.register(
            "upstream_sndbuf_bytes",
            "SO_SNDBUF the kernel grants upstream sockets",
            m.upstream_sndbuf.clone(),
        );
    }

    /// The build running, as a gauge of 1 labelled with its version.
    pub(super) fn register_build(r: &mut Registry) {
        let build = Family::<Build, Gauge>::default();
        build
            .get_or_create(&Build {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        r.register("build_info", "The running build", build);
    }

    pub fn request(&self, command: &'static str) {
        self.requests.get_or_create(&Command { command }).inc();
    }

    /// A request's last reply has been handed on, `took` after it came.
    pub fn answered(&self, command: &'static str, took: Duration) {
        self.request_seconds
            .get_or_create(&Command { command })
            .observe(took.as_secs_f64());
    }

    /// A reply carried NBD error `error`, counted by name (or `other`).
    pub fn error(&self, error: u32) {
        let error = crate::proto::transmission::error_name(error);
        self.request_errors.get_or_create(&NbdError { error }).inc();
    }
}
