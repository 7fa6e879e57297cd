//! A client that powers off: no FIN, no RST, its packets simply stop.
//! Two network namespaces made by this test, joined by a veth pair; nbdgw
//! in one, qemu-io (qemu's own NBD client) in the other. Removing the
//! client's address is the power cut. Needs root (as CI runs); without
//! the rights to make namespaces the test says so and passes nothing off
//! as checked.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::process::NbdgwProcess;
use common::{Env, QemuNbd};

const SERVER_IP: &str = "10.232.0.1";
const CLIENT_IP: &str = "10.232.0.2";

/// The two namespaces and their link; removed on drop.
struct Lan {
    server: String,
    client: String,
    client_dev: String,
}

impl Lan {
    fn new() -> Option<Self> {
        let tag = std::process::id() % 100_000;
        let lan = Lan {
            server: format!("nbdgw-s{tag}"),
            client: format!("nbdgw-c{tag}"),
            client_dev: format!("ngc{tag}"),
        };
        let server_dev = format!("ngs{tag}");
        if !ip(&["netns", "add", &lan.server]) {
            return None;
        }
        let ok = ip(&["netns", "add", &lan.client])
            && ip(&[
                "link",
                "add",
                &server_dev,
                "netns",
                &lan.server,
                "type",
                "veth",
                "peer",
                "name",
                &lan.client_dev,
                "netns",
                &lan.client,
            ])
            && [
                (&lan.server, &server_dev, SERVER_IP),
                (&lan.client, &lan.client_dev, CLIENT_IP),
            ]
            .iter()
            .all(|(ns, dev, addr)| {
                ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])
                    && ip(&["-n", ns, "link", "set", dev, "up"])
                    && ip(&["-n", ns, "link", "set", "lo", "up"])
            });
        assert!(ok, "could make a namespace but not the link between two");
        Some(lan)
    }

    fn exec(&self, ns: &str, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns, program]);
        cmd
    }

    /// The client's host stops answering: its address is gone, so what
    /// nbdgw sends still leaves (the link is up, the neighbour known) but
    /// is dropped on arrival without a reset, as by a host powered off.
    /// (Taking the link down instead makes every send fail locally, which
    /// TCP retries without ever counting a lost probe.)
    fn power_off_client(&self) {
        assert!(ip(&[
            "-n",
            &self.client,
            "addr",
            "flush",
            "dev",
            &self.client_dev
        ]));
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        for ns in [&self.server, &self.client] {
            ip(&["netns", "del", ns]);
        }
    }
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn keepalive_drops_a_client_that_powered_off() {
    let Some(lan) = Lan::new() else {
        eprintln!("SKIPPED: cannot create network namespaces here (not root?)");
        return;
    };
    let env = Env::new();
    let certs = env.path("lan-certs");
    nbdgw::certs::generate(&nbdgw::certs::CertsRequest {
        out: certs.clone(),
        server_names: vec![SERVER_IP.into()],
        client_names: vec!["vm-host".into()],
        client_uris: vec![],
        days: 2,
        force: false,
        ca: None,
        keep_ca_key: false,
    })
    .unwrap();
    let image = env.random_image("disk.img", 1 << 20, 4);
    let upstream = QemuNbd::start(&env, &image, &[]);

    let mut gateway = lan.exec(&lan.server, env!("CARGO_BIN_EXE_nbdgw"));
    gateway
        .arg("--listen")
        .arg(format!("{SERVER_IP}:10809"))
        .arg("--upstream")
        .arg(&upstream.socket)
        .arg("--tls-dir")
        .arg(&certs)
        .args(["--tcp-keepalive", "1", "--tcp-keepalive-interval", "1"])
        .args(["--tcp-keepalive-count", "2", "--stall-timeout", "0"]);
    let gw = NbdgwProcess::spawn(gateway, 10809);
    gw.wait_for_log("nbdgw listening", 1);

    // qemu-io holds its connection open while it waits for commands.
    let client = lan
        .exec(&lan.client, "qemu-io")
        .args(common::clients::qemu_tls_args(SERVER_IP, 10809, &certs))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("qemu-io");
    let _client = KillOnDrop(client);
    gw.wait_for_log("negotiated", 1);
    // qemu reads a little right after connecting; keepalive is for a
    // connection with nothing outstanding (TCP_USER_TIMEOUT, set by
    // --stall-timeout, is for the other kind).
    std::thread::sleep(Duration::from_secs(1));

    lan.power_off_client();
    let cut = Instant::now();
    gw.wait_for_log("closed error=client I/O error", 1);
    let noticed = cut.elapsed();
    // 1 s of silence, then 2 probes 1 s apart.
    assert!(
        noticed >= Duration::from_secs(2) && noticed < Duration::from_secs(10),
        "noticed after {noticed:?}"
    );
    assert!(gw.log().contains("timed out"), "{}", gw.log());
}
