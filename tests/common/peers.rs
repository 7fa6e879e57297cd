//! Peers that play other machines from this one: connections bound to a
//! chosen source address (loopback's 127.0.0.0/8, or a test namespace's
//! addresses), silent ones, and a handshaker that crawls.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::Duration;

use nbdgw::proto::consts::{IHAVEOPT, OPT_STARTTLS};

/// A TCP connection to `to` from the address `from`.
pub fn connect_from(from: IpAddr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let domain = match from {
        IpAddr::V4(_) => socket2::Domain::IPV4,
        IpAddr::V6(_) => socket2::Domain::IPV6,
    };
    let socket = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
    socket.bind(&SocketAddr::new(from, 0).into())?;
    socket.connect_timeout(&to.into(), Duration::from_secs(5))?;
    Ok(socket.into())
}

/// Whether nbdgw has sent this connection anything (its greeting: the
/// connection holds a handshake slot) without closing it. Reads without
/// waiting.
#[allow(dead_code)]
pub fn greeted(stream: &TcpStream) -> bool {
    stream.set_nonblocking(true).expect("nonblocking");
    let mut buf = [0u8; 64];
    let got = (&*stream).read(&mut buf);
    stream.set_nonblocking(false).expect("blocking");
    matches!(got, Ok(n) if n > 0)
}

/// Starts TLS from `from`, then sends its ClientHello's first bytes one
/// every 400 ms: a handshake that holds its slot as long as it can.
#[allow(dead_code)]
pub fn slow_client_hello(from: IpAddr, to: SocketAddr) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let Ok(mut tcp) = connect_from(from, to) else {
            return;
        };
        let mut greeting = [0u8; 18];
        if tcp.read_exact(&mut greeting).is_err() {
            return;
        }
        let mut starttls = 3u32.to_be_bytes().to_vec();
        starttls.extend_from_slice(&IHAVEOPT.to_be_bytes());
        starttls.extend_from_slice(&OPT_STARTTLS.to_be_bytes());
        starttls.extend_from_slice(&0u32.to_be_bytes());
        if tcp.write_all(&starttls).is_err() {
            return;
        }
        let mut ack = [0u8; 20];
        if tcp.read_exact(&mut ack).is_err() {
            return;
        }
        for byte in [0x16u8, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00] {
            std::thread::sleep(Duration::from_millis(400));
            if tcp.write_all(&[byte]).is_err() {
                break;
            }
        }
    })
}
