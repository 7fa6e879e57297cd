//! What the gateway reports and refuses when peers misbehave: counters
//! that tell the truth, and upstream replies that break the protocol.

mod common;

use std::ffi::OsStr;
use std::time::Duration;

use common::process::NbdgwProcess;
use common::raw::RawClient;
use common::{Env, QemuNbd};
use nbdgw::proto::consts::*;
use nbdgw::proto::transmission::ReplyMode;

fn gateway(env: &Env, upstream: &std::path::Path) -> NbdgwProcess {
    let certs = env.certs();
    NbdgwProcess::start([
        OsStr::new("--upstream"),
        upstream.as_os_str(),
        OsStr::new("--tls-cert"),
        certs.join("server-cert.pem").as_os_str(),
        OsStr::new("--tls-key"),
        certs.join("server-key.pem").as_os_str(),
    ])
}

#[test]
fn bytes_in_counts_what_arrived_not_what_was_announced() {
    let env = Env::new();
    let image = env.random_image("disk.img", 4 << 20, 2);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let gw = gateway(&env, &upstream.socket);
    let mut c = RawClient::tls(gw.addr(), &env.certs());
    c.go(ReplyMode::Structured);
    // A write announcing 1 MiB, of which 1000 bytes arrive.
    let mut request = c.request_bytes(0, CMD_WRITE, 1, 0, 1 << 20);
    request.extend_from_slice(&[9u8; 1000]);
    c.send(&request);
    std::thread::sleep(Duration::from_millis(200));
    drop(c);
    gw.wait_for_log("in the middle of a request payload", 1);
    let log = gw.log();
    let closed = log
        .lines()
        .find(|l| l.contains("in the middle of a request payload"))
        .unwrap();
    // The 28-byte header and the 1000 bytes that came.
    assert!(closed.contains("bytes_in=1028"), "{closed}");
}
