//! A scripted NBD server, for upstream faults a real qemu-nbd cannot be
//! made to produce. Only tests of those faults use it.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use nbdgw::proto::consts::*;

pub struct FakeUpstream {
    pub socket: PathBuf,
}

impl FakeUpstream {
    /// Serves one connection: greeting, then answers GO for an export of
    /// `size` bytes with INFO_EXPORT and ACK, followed by `after_ack`
    /// bytes nobody asked for.
    pub fn go_then_send(socket: &Path, size: u64, after_ack: &'static [u8]) -> Self {
        let listener = UnixListener::bind(socket).unwrap();
        std::thread::spawn(move || {
            let Ok((mut s, _)) = listener.accept() else {
                return;
            };
            let mut greeting = NBDMAGIC.to_be_bytes().to_vec();
            greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
            greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
            s.write_all(&greeting).unwrap();
            let mut flags = [0u8; 4];
            s.read_exact(&mut flags).unwrap();
            loop {
                let mut header = [0u8; 16];
                if s.read_exact(&mut header).is_err() {
                    return;
                }
                let option = u32::from_be_bytes(header[8..12].try_into().unwrap());
                let len = u32::from_be_bytes(header[12..16].try_into().unwrap());
                let mut data = vec![0u8; len as usize];
                s.read_exact(&mut data).unwrap();
                let reply = |kind: u32, body: &[u8]| {
                    let mut r = REPLY_MAGIC.to_be_bytes().to_vec();
                    r.extend_from_slice(&option.to_be_bytes());
                    r.extend_from_slice(&kind.to_be_bytes());
                    r.extend_from_slice(&(body.len() as u32).to_be_bytes());
                    r.extend_from_slice(body);
                    r
                };
                if option != OPT_GO {
                    s.write_all(&reply(REP_ERR_UNSUP, &[])).unwrap();
                    continue;
                }
                let mut info = INFO_EXPORT.to_be_bytes().to_vec();
                info.extend_from_slice(&size.to_be_bytes());
                info.extend_from_slice(&(TFLAG_HAS_FLAGS).to_be_bytes());
                let mut burst = reply(REP_INFO, &info);
                burst.extend_from_slice(&reply(REP_ACK, &[]));
                burst.extend_from_slice(after_ack);
                s.write_all(&burst).unwrap();
                // Hold the connection until nbdgw closes it.
                let _ = s.read(&mut [0u8; 64]);
                return;
            }
        });
        FakeUpstream {
            socket: socket.to_owned(),
        }
    }
}
