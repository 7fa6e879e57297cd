//! The claim, with real descriptors: a TCP connection, a Unix socket
//! pair, a memfd, and a datagram socket standing for systemd's.

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::time::Duration;

use zeroize::Zeroizing;

use super::blob::{self, Stored};
use super::notify::Notifier;
use super::restore::claim;

struct Parts {
    /// The client's end of the TCP connection.
    client: TcpStream,
    fds: Vec<OwnedFd>,
    memfd: OwnedFd,
    systemd: UnixDatagram,
    notifier: Notifier,
    _dir: tempfile::TempDir,
}

fn parts() -> Parts {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server, _) = listener.accept().unwrap();
    let (upstream, _far) = UnixStream::pair().unwrap();
    std::mem::forget(_far);
    let stored = Stored {
        handover: [5; 16],
        was: 7,
        offer: vec![1],
        state: Zeroizing::new(vec![2; 10]),
    };
    let memfd = stored.write().unwrap();
    // What systemd passes is its own descriptor of the same file.
    let fds = vec![
        memfd.try_clone().unwrap(),
        OwnedFd::from(upstream),
        OwnedFd::from(server),
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notify");
    let systemd = UnixDatagram::bind(&path).unwrap();
    systemd
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    Parts {
        client,
        fds,
        memfd,
        systemd,
        notifier: Notifier::at(&path),
        _dir: dir,
    }
}

fn message(systemd: &UnixDatagram) -> String {
    let mut buf = [0u8; 256];
    let n = systemd.recv(&mut buf).unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[test]
fn an_untaken_session_is_marked_then_removed_and_a_later_instance_finds_it_taken() {
    let p = parts();
    let claimed = claim("nbdgw-s.1.7", p.fds, &p.notifier).unwrap_or_else(|e| panic!("{}", e.0));
    assert_eq!(
        (claimed.stored.was, claimed.stored.offer.clone()),
        (7, vec![1])
    );
    assert_eq!(message(&p.systemd), "FDSTOREREMOVE=1\nFDNAME=nbdgw-s.1.7\n");
    // The mark is in the file systemd holds.
    assert!(matches!(blob::read(&p.memfd).unwrap(), blob::Found::Taken));
}

#[test]
fn a_session_an_earlier_instance_took_is_closed_without_a_byte_written() {
    let mut p = parts();
    blob::mark_taken(&p.memfd).unwrap();
    let error = claim("nbdgw-s.1.7", p.fds, &p.notifier)
        .err()
        .expect("refused");
    assert!(
        error.0.contains("an earlier instance took it"),
        "{}",
        error.0
    );
    assert_eq!(message(&p.systemd), "FDSTOREREMOVE=1\nFDNAME=nbdgw-s.1.7\n");
    // The client sees the connection end, and nothing on it: no record
    // was sealed with the session's keys here.
    p.client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut got = Vec::new();
    p.client.read_to_end(&mut got).unwrap();
    assert!(got.is_empty(), "{} bytes written", got.len());
}

#[test]
fn a_session_missing_a_descriptor_or_of_another_format_is_removed_and_closed() {
    let mut p = parts();
    p.fds.pop();
    let error = claim("nbdgw-s.1.7", p.fds, &p.notifier)
        .err()
        .expect("refused");
    assert!(error.0.contains("2 descriptor(s)"), "{}", error.0);
    assert_eq!(message(&p.systemd), "FDSTOREREMOVE=1\nFDNAME=nbdgw-s.1.7\n");

    let p = parts();
    rustix::io::pwrite(&p.memfd, &[9], 4).unwrap();
    let error = claim("nbdgw-s.1.7", p.fds, &p.notifier)
        .err()
        .expect("refused");
    assert!(error.0.contains("format 9"), "{}", error.0);
    // Untouched: a build that knows the format could still read it.
    assert!(matches!(
        blob::read(&p.memfd).unwrap(),
        blob::Found::Unknown(_)
    ));
}
