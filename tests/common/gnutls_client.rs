//! The GnuTLS NBD client of tests/clients/gnutls_keyupdate.c, compiled
//! once per test binary with the system's C compiler and libgnutls
//! (scripts/setup.sh installs gcc, pkg-config and libgnutls28-dev).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

const SOURCE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/clients/gnutls_keyupdate.c"
);

/// The compiled client, built on first use.
pub fn binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(compile)
}

/// Where the client is built: under the target directory, or, where that
/// is read-only (scripts/ktls-vm.sh shares the checkout so), a fresh
/// directory under the system's temporary one.
fn build_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("clients");
    let writable = std::fs::create_dir_all(&dir).is_ok() && tempfile::tempfile_in(&dir).is_ok();
    if writable {
        return dir;
    }
    tempfile::Builder::new()
        .prefix("nbdgw-clients-")
        .tempdir()
        .expect("create a directory for the compiled client")
        .keep()
}

fn compile() -> PathBuf {
    let dir = build_dir();
    let flags = Command::new("pkg-config")
        .args(["--cflags", "--libs", "gnutls"])
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run pkg-config ({e}): run scripts/setup.sh (apt-get install pkg-config libgnutls28-dev)")
        });
    assert!(
        flags.status.success(),
        "pkg-config finds no gnutls: run scripts/setup.sh (apt-get install libgnutls28-dev)\n{}",
        String::from_utf8_lossy(&flags.stderr)
    );
    let flags = String::from_utf8(flags.stdout).expect("pkg-config output");
    // Test binaries run at once may each compile: each writes its own
    // file and renames it into place, so none runs a half-written one.
    let out = dir.join("gnutls_keyupdate");
    let partial = dir.join(format!("gnutls_keyupdate.{}.tmp", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(&cc)
        .args(["-std=c11", "-D_POSIX_C_SOURCE=200809L", "-D_DEFAULT_SOURCE"])
        .args(["-O1", "-g", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&partial)
        .arg(SOURCE)
        .args(flags.split_whitespace())
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run the C compiler {cc:?} ({e}): run scripts/setup.sh (apt-get install gcc)")
        });
    assert!(
        built.status.success(),
        "compiling {SOURCE} failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    std::fs::rename(&partial, &out).expect("move the compiled client into place");
    out
}

/// Where the client writes: `REGION_LEN` bytes at `REGION_OFFSET` (as in
/// the C source), so the export must be at least `REGION_END` bytes.
pub const REGION_OFFSET: usize = 64 << 10;
pub const REGION_LEN: usize = 64 << 10;
pub const REGION_END: usize = REGION_OFFSET + REGION_LEN;

/// What the client does once the export is open (its MODE argument).
#[derive(Debug, Clone, Copy)]
pub enum Mode {
    /// Write and read back, with no key update.
    NoKeyUpdate,
    /// `gnutls_session_key_update(session, 0)` between the round trips.
    KeyUpdate,
    /// `gnutls_session_key_update(session, GNUTLS_KU_PEER)`: the server
    /// must send a KeyUpdate of its own.
    KeyUpdatePeer,
    /// This many 512-byte reads at queue depth 1.
    Long(u32),
    /// One round trip, then a warning-level unrecognized_name alert: the
    /// server must end the session.
    Alert,
    /// One round trip, then 40 KeyUpdates with no data between: the
    /// server must end the session.
    KeyUpdateFlood,
}

impl Mode {
    /// What the region holds after a successful run: the client's
    /// pattern (`common::pattern`, the same generator as the C source's
    /// `fill_pattern`) of the seed it wrote last.
    pub fn last_written(self) -> Vec<u8> {
        let seed = match self {
            // Round trips with seeds 1 to 6.
            Mode::NoKeyUpdate | Mode::KeyUpdate | Mode::KeyUpdatePeer => 6,
            // One write, with seed 7, before the reads.
            Mode::Long(_) => 7,
            Mode::Alert | Mode::KeyUpdateFlood => 1,
        };
        super::pattern(REGION_LEN, seed)
    }
}

/// What a run printed, and how it ended.
pub struct Run {
    pub output: Output,
}

impl Run {
    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.output.stdout).into_owned()
    }

    pub fn success(&self) -> bool {
        self.output.status.success()
    }

    /// The run, for assertion messages.
    pub fn describe(&self) -> String {
        format!(
            "{}\nstdout:\n{}stderr:\n{}",
            self.output.status,
            self.stdout(),
            String::from_utf8_lossy(&self.output.stderr)
        )
    }

    /// The count on the `server rekeys: K` line: KeyUpdate messages the
    /// client received from the server.
    pub fn server_rekeys(&self) -> u32 {
        let stdout = self.stdout();
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("server rekeys: "))
            .unwrap_or_else(|| panic!("no `server rekeys:` line: {}", self.describe()))
            .trim()
            .parse()
            .expect("server rekeys count")
    }
}

/// Runs the client against `addr` with the certificates in `certs` (the
/// layout `Env::certs` makes: ca-cert.pem, client-cert.pem,
/// client-key.pem), for `export`.
pub fn run(addr: SocketAddr, certs: &Path, export: &str, mode: Mode) -> Run {
    let mut cmd = Command::new(binary());
    cmd.arg(addr.ip().to_string())
        .arg(addr.port().to_string())
        .arg(certs.join("ca-cert.pem"))
        .arg(certs.join("client-cert.pem"))
        .arg(certs.join("client-key.pem"))
        .arg(export);
    match mode {
        Mode::NoKeyUpdate => cmd.arg("none"),
        Mode::KeyUpdate => cmd.arg("ku0"),
        Mode::KeyUpdatePeer => cmd.arg("kupeer"),
        Mode::Long(n) => cmd.arg("long").arg(n.to_string()),
        Mode::Alert => cmd.arg("alert"),
        Mode::KeyUpdateFlood => cmd.arg("kuflood"),
    };
    // The client bounds every wait itself (20 s per read or write).
    let output = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    Run { output }
}
