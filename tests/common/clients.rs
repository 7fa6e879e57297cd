//! Real and raw clients as the identity and security tests run them:
//! qemu-img and nbdinfo with a certificate directory, and the raw client
//! presenting a directory's certificate.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use super::pki::{Ca, Leaf};
use super::raw::{client_tls, RawClient};
use super::run;

/// qemu's `--object` and `--image-opts` arguments for an NBD client
/// using the certificates in `client_dir`.
pub fn qemu_tls_args(host: &str, port: u16, client_dir: &Path) -> [String; 4] {
    [
        "--object".into(),
        format!(
            "tls-creds-x509,id=tls0,dir={},endpoint=client",
            client_dir.display()
        ),
        "--image-opts".into(),
        format!("driver=nbd,host={host},port={port},tls-creds=tls0"),
    ]
}

pub fn qemu_img_info(port: u16, client_dir: &Path) -> Output {
    run(Command::new("qemu-img")
        .arg("info")
        .args(qemu_tls_args("localhost", port, client_dir)))
}

pub fn nbds_uri(port: u16, client_dir: &Path) -> String {
    format!(
        "nbds://localhost:{port}/?tls-certificates={}",
        client_dir.display()
    )
}

pub fn nbdinfo_size(port: u16, client_dir: &Path) -> Output {
    run(Command::new("nbdinfo")
        .arg("--size")
        .arg(nbds_uri(port, client_dir)))
}

/// A command's standard error, trimmed.
pub fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).trim().to_string()
}

/// Server certificate, key, and the CA clients must chain to, as files.
pub fn write_server_files(
    dir: &Path,
    server: &Leaf,
    client_ca: &Ca,
) -> (PathBuf, PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let files = (
        dir.join("server-cert.pem"),
        dir.join("server-key.pem"),
        dir.join("client-ca.pem"),
    );
    std::fs::write(&files.0, &server.cert).unwrap();
    std::fs::write(&files.1, &server.key).unwrap();
    std::fs::write(&files.2, &client_ca.pem).unwrap();
    files
}

/// The raw client through STARTTLS and TLS, presenting the certificate in
/// `client_dir` (the layout `Leaf::client_dir` writes).
pub fn try_connect_as(addr: SocketAddr, client_dir: &Path) -> io::Result<RawClient> {
    let mut c = RawClient::handshake(addr);
    c.try_starttls(client_tls(
        &client_dir.join("ca-cert.pem"),
        Some((
            &client_dir.join("client-cert.pem"),
            &client_dir.join("client-key.pem"),
        )),
        &[],
    ))?;
    Ok(c)
}

pub fn connect_as(addr: SocketAddr, client_dir: &Path) -> RawClient {
    try_connect_as(addr, client_dir).expect("TLS handshake")
}

/// Whether the gateway admits the certificate in `client_dir`: in TLS 1.3
/// a refusal reaches the client on its first read after the handshake, so
/// this asks for the export list. Returns the error text of a refusal.
pub fn admitted(addr: SocketAddr, client_dir: &Path) -> Result<(), String> {
    let mut c = try_connect_as(addr, client_dir).map_err(|e| e.to_string())?;
    c.send_option(nbdgw::proto::consts::OPT_LIST, &[]);
    c.try_read_option_reply()
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Status code and body of `GET http://127.0.0.1:PORT/PATH`, by curl.
#[allow(dead_code)]
pub fn http_get(port: u16, path: &str) -> (u16, String) {
    let out = super::run(
        Command::new("curl")
            .args(["-s", "-m", "5", "-w", "\n%{http_code}"])
            .arg(format!("http://127.0.0.1:{port}{path}")),
    );
    let body = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = body.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}
