//! A scripted NBD server, for upstream faults a real qemu-nbd cannot be
//! made to produce. Only tests of those faults use it.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
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
            if negotiate(&mut s, size, after_ack) {
                // Hold the connection until nbdgw closes it.
                let _ = s.read(&mut [0u8; 64]);
            }
        });
        FakeUpstream {
            socket: socket.to_owned(),
        }
    }
}

/// Greeting, then options until GO: structured replies if asked, GO for
/// an export of `size` bytes, with `after_ack` behind the ACK. Returns
/// whether negotiation finished.
fn negotiate(s: &mut UnixStream, size: u64, after_ack: &[u8]) -> bool {
    let mut greeting = NBDMAGIC.to_be_bytes().to_vec();
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    if s.write_all(&greeting).is_err() || s.read_exact(&mut [0u8; 4]).is_err() {
        return false;
    }
    loop {
        let mut header = [0u8; 16];
        if s.read_exact(&mut header).is_err() {
            return false;
        }
        let option = u32::from_be_bytes(header[8..12].try_into().unwrap());
        let mut data = vec![0u8; u32::from_be_bytes(header[12..16].try_into().unwrap()) as usize];
        if s.read_exact(&mut data).is_err() {
            return false;
        }
        let reply = |kind: u32, body: &[u8]| {
            let mut r = REPLY_MAGIC.to_be_bytes().to_vec();
            r.extend_from_slice(&option.to_be_bytes());
            r.extend_from_slice(&kind.to_be_bytes());
            r.extend_from_slice(&(body.len() as u32).to_be_bytes());
            r.extend_from_slice(body);
            r
        };
        let burst = match option {
            OPT_STRUCTURED_REPLY => reply(REP_ACK, &[]),
            OPT_GO => {
                let mut info = INFO_EXPORT.to_be_bytes().to_vec();
                info.extend_from_slice(&size.to_be_bytes());
                info.extend_from_slice(&TFLAG_HAS_FLAGS.to_be_bytes());
                let mut burst = reply(REP_INFO, &info);
                burst.extend_from_slice(&reply(REP_ACK, &[]));
                burst.extend_from_slice(after_ack);
                return s.write_all(&burst).is_ok();
            }
            _ => reply(REP_ERR_UNSUP, &[]),
        };
        if s.write_all(&burst).is_err() {
            return false;
        }
    }
}

/// The reply a scripted upstream sends to one request: the connection's
/// index (in accept order) and the request.
pub type Script = fn(connection: usize, request: Asked) -> Answer;

/// Bytes to send, and whether to close the connection after them.
pub struct Answer {
    pub bytes: Vec<u8>,
    pub close: bool,
}

impl From<Vec<u8>> for Answer {
    fn from(bytes: Vec<u8>) -> Self {
        Answer {
            bytes,
            close: false,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Asked {
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

/// Serves any number of connections: structured replies if asked, GO for
/// an export of `size` bytes, then each request (compact headers) is
/// answered with what `script` returns.
pub fn scripted(socket: &Path, size: u64, script: Script) -> FakeUpstream {
    let listener = UnixListener::bind(socket).unwrap();
    std::thread::spawn(move || {
        for (index, stream) in listener.incoming().enumerate() {
            let Ok(stream) = stream else { return };
            std::thread::spawn(move || serve_scripted(stream, index, size, script));
        }
    });
    FakeUpstream {
        socket: socket.to_owned(),
    }
}

fn serve_scripted(mut s: UnixStream, index: usize, size: u64, script: Script) {
    if !negotiate(&mut s, size, &[]) {
        return;
    }
    loop {
        let mut request = [0u8; 28];
        if s.read_exact(&mut request).is_err() {
            return;
        }
        let command = u16::from_be_bytes([request[6], request[7]]);
        let cookie = u64::from_be_bytes(request[8..16].try_into().unwrap());
        let offset = u64::from_be_bytes(request[16..24].try_into().unwrap());
        let length = u32::from_be_bytes(request[24..28].try_into().unwrap());
        if command == CMD_DISC {
            return;
        }
        if command == CMD_WRITE {
            let mut payload = vec![0u8; length as usize];
            if s.read_exact(&mut payload).is_err() {
                return;
            }
        }
        let answer = script(
            index,
            Asked {
                cookie,
                offset,
                length,
            },
        );
        if s.write_all(&answer.bytes).is_err() || answer.close {
            return;
        }
    }
}

/// A structured chunk header.
pub fn chunk(flags: u16, kind: u16, cookie: u64, length: u32) -> Vec<u8> {
    let mut c = STRUCTURED_REPLY_MAGIC.to_be_bytes().to_vec();
    c.extend_from_slice(&flags.to_be_bytes());
    c.extend_from_slice(&kind.to_be_bytes());
    c.extend_from_slice(&cookie.to_be_bytes());
    c.extend_from_slice(&length.to_be_bytes());
    c
}

/// A correct reply to a read: its data (bytes of 7) in one chunk.
pub fn good_read(read: Asked) -> Vec<u8> {
    let Asked {
        cookie,
        offset,
        length,
    } = read;
    let mut c = chunk(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, cookie, 8 + length);
    c.extend_from_slice(&offset.to_be_bytes());
    c.extend(std::iter::repeat_n(7u8, length as usize));
    c
}

/// A server that accepts every connection and then says nothing, not even
/// its greeting (a hung NBD server), holding each connection open until
/// the other side closes it. With `greets`, it sends the greeting, reads
/// the client flags, and is silent from then on (it never answers an
/// option).
pub fn silent(socket: &Path, greets: bool) -> FakeUpstream {
    let listener = UnixListener::bind(socket).unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { return };
            std::thread::spawn(move || {
                if greets {
                    let mut greeting = NBDMAGIC.to_be_bytes().to_vec();
                    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
                    greeting
                        .extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
                    if s.write_all(&greeting).is_err() {
                        return;
                    }
                }
                // Reads (and drops) whatever comes until nbdgw closes.
                let mut sink = [0u8; 4096];
                while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
            });
        }
    });
    FakeUpstream {
        socket: socket.to_owned(),
    }
}
