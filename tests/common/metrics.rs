//! The admin port's Prometheus exposition as the tests read it: a scrape,
//! one sample by its exact name and labels, and the polling forms.

use std::str::FromStr;
use std::time::{Duration, Instant};

use super::clients::http_get;
use super::process::NbdgwProcess;

/// `GET /metrics` on the admin port `admin`: the body, the status
/// asserted to be 200.
pub fn scrape(admin: u16) -> String {
    let (code, body) = http_get(admin, "/metrics");
    assert_eq!(code, 200, "{body}");
    body
}

/// The value of the sample `name` (with its labels, `name{k="v"}`,
/// exactly as exposed) in an exposition; panics, showing the exposition,
/// where there is none.
pub fn sample(metrics: &str, name: &str) -> f64 {
    sample_as(metrics, name)
}

/// As [`sample`], parsed as `T` (an integer type is checked strictly: a
/// value that is not one is no sample).
pub fn sample_as<T: FromStr>(metrics: &str, name: &str) -> T {
    find(metrics, name).unwrap_or_else(|| panic!("no sample {name} in:\n{metrics}"))
}

/// As [`sample`], 0 where there is none: a labelled counter is exposed
/// only from its first increment, so absent means none counted yet.
pub fn sample_or_zero(metrics: &str, name: &str) -> f64 {
    find(metrics, name).unwrap_or(0.0)
}

/// The sample `name` scraped from the admin port `admin` now, 0 where
/// there is none or the port does not answer: the form to poll with.
pub fn metric(admin: u16, name: &str) -> f64 {
    sample_or_zero(&http_get(admin, "/metrics").1, name)
}

/// `nbdgw_requests_total{command="READ"}` on the admin port `admin`:
/// reads nbdgw has decided to forward (0 before the first).
pub fn reads_counted(admin: u16) -> u64 {
    metric(admin, r#"nbdgw_requests_total{command="READ"}"#) as u64
}

/// Waits (20 s at most) until `gw`, on the admin port `admin`, has
/// counted `n` reads; panics with its log if it does not.
pub fn await_reads(admin: u16, n: u64, gw: &NbdgwProcess) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while reads_counted(admin) < n {
        assert!(
            Instant::now() < deadline,
            "nbdgw did not count {n} reads:\n{}",
            gw.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn find<T: FromStr>(metrics: &str, name: &str) -> Option<T> {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}
