//! A stored session's memfd: what the next instance needs besides the two
//! sockets (the offer to judge, the state to serve on), and the "taken"
//! mark that makes the memfd the single source of truth for who holds
//! the session (docs/design/handover.md "systemd's file-descriptor
//! store").
//!
//! Layout, big-endian: `NBGF`, format (1), mark (0 untaken, 1 taken), two
//! zero bytes, the hand-over id (16), the old connection id (8), the
//! offer's length (4) and the offer (`Offer::encode`), the state's length
//! (4) and the state (`State::encode`).
//!
//! systemd keeps the same open file the old instance wrote, so a mark
//! written here (pwrite) is seen by every later instance that gets the
//! memfd from the store. Taking writes the mark first, then cuts the
//! file back to its header so that the keys do not stay in the store.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{fstat, ftruncate, memfd_create, MemfdFlags};
use rustix::io::{pread, pwrite};
use zeroize::Zeroizing;

use crate::proto::handover_session::{MAX_CHAIN, MAX_TLS};

pub const MAGIC: &[u8; 4] = b"NBGF";
/// This build's format; another is refused (the session is closed).
pub const FORMAT: u8 = 1;
const MARK_AT: u64 = 5;
const UNTAKEN: u8 = 0;
const TAKEN: u8 = 1;
/// Magic, format, mark, two spare bytes.
pub const HEADER: usize = 8;
/// The largest memfd read: an offer with the longest chain and names, a
/// state with the longest TLS state and ciphertext ahead, and margin.
const MAX_LEN: u64 =
    (HEADER + 16 + 8 + 8 + MAX_CHAIN + 3 * 4096 + 2 * MAX_TLS as usize) as u64 + 65536;

/// One stored session's data.
pub struct Stored {
    pub handover: [u8; 16],
    /// Its connection id in the instance that stored it (logged).
    pub was: u64,
    /// `Offer::encode`.
    pub offer: Vec<u8>,
    /// `State::encode`: keys inside, wiped when dropped.
    pub state: Zeroizing<Vec<u8>>,
}

/// What the next instance finds in a memfd.
pub enum Found {
    /// Untaken: the session may be served, once marked.
    Fresh(Stored),
    /// An earlier instance took it (and then failed): never served again.
    Taken,
    /// Not this build's format, or broken: why.
    Unknown(String),
}

impl Stored {
    /// A new memfd holding this session, untaken.
    pub fn write(&self) -> io::Result<OwnedFd> {
        let fd = memfd_create("nbdgw-session", MemfdFlags::CLOEXEC)?;
        let mut out = Zeroizing::new(Vec::with_capacity(
            HEADER + 16 + 8 + 8 + self.offer.len() + self.state.len(),
        ));
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&[FORMAT, UNTAKEN, 0, 0]);
        out.extend_from_slice(&self.handover);
        out.extend_from_slice(&self.was.to_be_bytes());
        out.extend_from_slice(&(self.offer.len() as u32).to_be_bytes());
        out.extend_from_slice(&self.offer);
        out.extend_from_slice(&(self.state.len() as u32).to_be_bytes());
        out.extend_from_slice(&self.state);
        write_all_at(&fd, &out, 0)?;
        Ok(fd)
    }
}

/// Reads a memfd from the store; writes nothing.
pub fn read(fd: impl AsFd) -> io::Result<Found> {
    let len = fstat(&fd)?.st_size as u64;
    if len > MAX_LEN {
        return Ok(Found::Unknown(format!(
            "{len} bytes, more than any session"
        )));
    }
    let mut bytes = Zeroizing::new(vec![0u8; len as usize]);
    let mut got = 0;
    while got < bytes.len() {
        match pread(&fd, &mut bytes[got..], got as u64)? {
            0 => break,
            n => got += n,
        }
    }
    bytes.truncate(got);
    Ok(parse(&bytes))
}

fn parse(bytes: &[u8]) -> Found {
    if bytes.len() < HEADER || &bytes[..4] != MAGIC {
        return Found::Unknown("not a session memfd of nbdgw".into());
    }
    if bytes[4] != FORMAT {
        return Found::Unknown(format!(
            "stored format {}, this build knows {FORMAT}",
            bytes[4]
        ));
    }
    match bytes[MARK_AT as usize] {
        UNTAKEN => {}
        TAKEN => return Found::Taken,
        other => return Found::Unknown(format!("mark {other}")),
    }
    let mut r = &bytes[HEADER..];
    let mut take = |n: usize| -> Option<&[u8]> {
        let (head, rest) = (r.get(..n)?, r.get(n..)?);
        r = rest;
        Some(head)
    };
    let mut body = || -> Option<Stored> {
        let handover = take(16)?.try_into().ok()?;
        let was = u64::from_be_bytes(take(8)?.try_into().ok()?);
        let len = u32::from_be_bytes(take(4)?.try_into().ok()?) as usize;
        let offer = take(len)?.to_vec();
        let len = u32::from_be_bytes(take(4)?.try_into().ok()?) as usize;
        let state = Zeroizing::new(take(len)?.to_vec());
        Some(Stored {
            handover,
            was,
            offer,
            state,
        })
    };
    match body() {
        Some(stored) if r.is_empty() => Found::Fresh(stored),
        Some(_) => Found::Unknown("bytes after the state".into()),
        None => Found::Unknown("cut short".into()),
    }
}

/// The commit point: from the moment this returns Ok no other instance
/// will serve the session (it reads Taken). The file is then cut back to
/// its header: the keys leave the store, overwritten first (a truncation
/// frees the shmem pages without clearing them; they could be read in a
/// later dump of whatever reuses them, or sit in swap).
pub fn mark_taken(fd: impl AsFd) -> io::Result<()> {
    write_all_at(&fd, &[TAKEN], MARK_AT)?;
    if let Err(e) = wipe(&fd) {
        tracing::warn!(error = %e, "restart: a stored session's memfd could not be overwritten before its cut (its keys stay in freed pages)");
    }
    ftruncate(&fd, HEADER as u64)?;
    Ok(())
}

/// Zeros over everything after the header.
fn wipe(fd: impl AsFd) -> io::Result<()> {
    let len = u64::try_from(fstat(&fd)?.st_size).unwrap_or(0);
    let zeros = [0u8; 4096];
    let mut at = HEADER as u64;
    while at < len {
        let n = (len - at).min(zeros.len() as u64) as usize;
        write_all_at(&fd, &zeros[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

fn write_all_at(fd: impl AsFd, mut bytes: &[u8], mut at: u64) -> io::Result<()> {
    while !bytes.is_empty() {
        let n = pwrite(&fd, bytes, at)?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        bytes = &bytes[n..];
        at += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> Stored {
        Stored {
            handover: [3; 16],
            was: 42,
            offer: vec![1, 2, 3],
            state: Zeroizing::new(vec![9; 100]),
        }
    }

    #[test]
    fn a_stored_session_reads_back_fresh_until_marked_then_taken_through_another_descriptor() {
        let fd = stored().write().unwrap();
        // What systemd hands the next instance is another descriptor of
        // the same open file: a dup stands for it.
        let later = fd.try_clone().unwrap();
        let Found::Fresh(back) = read(&later).unwrap() else {
            panic!("fresh expected")
        };
        assert_eq!(
            (back.handover, back.was, back.offer),
            ([3; 16], 42, vec![1, 2, 3])
        );
        assert_eq!(*back.state, vec![9; 100]);
        mark_taken(&later).unwrap();
        drop(later);
        assert!(matches!(read(&fd).unwrap(), Found::Taken));
        // The keys are gone from the file, not only marked.
        assert_eq!(fstat(&fd).unwrap().st_size as usize, HEADER);
    }

    #[test]
    fn the_wipe_zeros_everything_after_the_header_before_the_cut() {
        let fd = stored().write().unwrap();
        let len = fstat(&fd).unwrap().st_size as usize;
        wipe(&fd).unwrap();
        let mut bytes = vec![1u8; len];
        pread(&fd, &mut bytes, 0).unwrap();
        assert_eq!(&bytes[..4], MAGIC);
        assert!(
            bytes[HEADER..].iter().all(|b| *b == 0),
            "the state is overwritten"
        );
    }

    #[test]
    fn another_format_a_foreign_file_and_a_cut_one_are_unknown() {
        let mut bytes = Vec::new();
        let fd = stored().write().unwrap();
        bytes.resize(fstat(&fd).unwrap().st_size as usize, 0);
        pread(&fd, &mut bytes, 0).unwrap();
        assert!(matches!(parse(&bytes), Found::Fresh(_)));
        let mut other = bytes.clone();
        other[4] = 2;
        assert!(matches!(parse(&other), Found::Unknown(why) if why.contains("format 2")));
        assert!(matches!(parse(b"hello, world"), Found::Unknown(_)));
        for cut in HEADER..bytes.len() {
            assert!(
                matches!(parse(&bytes[..cut]), Found::Unknown(_)),
                "cut at {cut}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(matches!(parse(&longer), Found::Unknown(_)));
    }
}
