//! The kernel's own NBD driver over TLS through `nbdgw client`: nbd-client
//! hands `/dev/nbd0` a connection to client mode's Unix socket, client
//! mode speaks verified TLS to the nbdgw server in front of qemu-nbd, and
//! the kernel formats the disk, checks it, and writes and reads back a
//! pattern that must then be in qemu-nbd's image. The kernel here has no
//! `nbd` module, so this runs in the test VM (`scripts/ktls-vm.sh`, which
//! loads it); elsewhere it says SKIPPED and passes.

mod common;

use std::ffi::OsStr;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::process::Command;

use common::process::NbdgwProcess;
use common::{pattern, run, Env, QemuNbd};

const SIZE: usize = 64 << 20;
const TAIL: usize = 4 << 20;

#[test]
fn the_kernel_nbd_driver_formats_and_reads_back_through_client_mode() {
    let device = Path::new("/dev/nbd0");
    if !device.exists() {
        // No modprobe, or no module: the check below says so.
        let _ = Command::new("modprobe").arg("nbd").output();
    }
    let nbd_client = ["/usr/sbin/nbd-client", "/sbin/nbd-client"]
        .into_iter()
        .find(|p| Path::new(p).exists());
    let (true, Some(nbd_client)) = (device.exists(), nbd_client) else {
        eprintln!("SKIPPED: no /dev/nbd0 (the nbd module) or no nbd-client here; scripts/ktls-vm.sh runs this");
        return;
    };
    let env = Env::new();
    let image = env.random_image("disk.img", SIZE, 31);
    let upstream = QemuNbd::start(&env, &image, &[]);
    let server = NbdgwProcess::in_front_of(&env, &upstream.socket, &["--landlock", "false"]);
    let socket = env.path("client.sock");
    let server_addr = format!("localhost:{}", server.port);
    let client = NbdgwProcess::client(
        socket.as_os_str(),
        [
            OsStr::new("--server"),
            OsStr::new(&server_addr),
            OsStr::new("--tls-dir"),
            env.certs().as_os_str(),
        ],
    );

    let attach = run(Command::new(nbd_client)
        .arg("-u")
        .arg(&socket)
        .arg(device)
        .args(["-b", "4096", "-N", ""]));
    assert!(
        attach.status.success(),
        "nbd-client: {}{}\nclient log:\n{}",
        String::from_utf8_lossy(&attach.stdout),
        String::from_utf8_lossy(&attach.stderr),
        client.log()
    );
    let detach = Detach(nbd_client);

    // The kernel formats the disk and checks it.
    let mkfs = run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-E", "nodiscard"])
        .arg(device));
    assert!(
        mkfs.status.success(),
        "{}",
        String::from_utf8_lossy(&mkfs.stderr)
    );
    let fsck = run(Command::new("e2fsck").args(["-f", "-n"]).arg(device));
    assert!(
        fsck.status.success(),
        "e2fsck: {}{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );

    // A pattern over the last 4 MiB, past the page cache both ways.
    let data = pattern(TAIL, 32);
    let at = (SIZE - TAIL) as u64;
    let mut dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(device)
        .expect("open /dev/nbd0");
    let mut aligned = AlignedBuf::new(TAIL);
    aligned.as_mut().copy_from_slice(&data);
    dev.seek(SeekFrom::Start(at)).unwrap();
    dev.write_all(aligned.as_ref())
        .expect("write through the kernel");
    dev.sync_all().expect("flush through the kernel");
    let mut back = AlignedBuf::new(TAIL);
    dev.seek(SeekFrom::Start(at)).unwrap();
    dev.read_exact(back.as_mut())
        .expect("read through the kernel");
    assert!(
        back.as_ref() == &data[..],
        "the kernel read back other bytes"
    );
    drop(dev);
    drop(detach);

    // It went through TLS to qemu-nbd's image.
    let disk = upstream.read_direct();
    assert!(
        disk[SIZE - TAIL..] == data[..],
        "the image does not hold the pattern"
    );
    assert!(server.log().contains("TLS established"), "{}", server.log());
    assert!(client.log().contains("TLS established"), "{}", client.log());
}

/// `nbd-client -d` when the test ends, passed or not, so the device is
/// free for the next run.
struct Detach(&'static str);

impl Drop for Detach {
    fn drop(&mut self) {
        let _ = run(Command::new(self.0).args(["-d", "/dev/nbd0"]));
    }
}

/// O_DIRECT wants buffers aligned to the logical block size: a slice of
/// a larger vector that starts on a 4 KiB boundary.
struct AlignedBuf {
    bytes: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let bytes = vec![0u8; len + 4096];
        let start = bytes.as_ptr().align_offset(4096);
        AlignedBuf { bytes, start, len }
    }

    fn as_ref(&self) -> &[u8] {
        &self.bytes[self.start..self.start + self.len]
    }

    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.bytes[self.start..self.start + self.len]
    }
}
