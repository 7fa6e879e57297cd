//! What a descriptor is, as the kernel says: the description sent with
//! each one, and the check of each one that arrives against it.

use std::os::fd::AsFd;

use rustix::net::{sockopt, AddressFamily, SocketType};

use crate::proto::handover::{Address, Descriptor, Role};

/// The kernel's view of `fd`, for the role it is sent in.
pub fn describe(fd: impl AsFd, role: Role) -> std::io::Result<Descriptor> {
    let fd = fd.as_fd();
    let stream = sockopt::socket_type(fd)? == SocketType::STREAM;
    let listening = sockopt::socket_acceptconn(fd)?;
    let local = rustix::net::getsockname(fd)?;
    let address = match local.address_family() {
        AddressFamily::INET | AddressFamily::INET6 => {
            Address::Inet(std::net::SocketAddr::try_from(local).map_err(std::io::Error::from)?)
        }
        AddressFamily::UNIX => {
            let unix =
                rustix::net::SocketAddrUnix::try_from(local).map_err(std::io::Error::from)?;
            Address::Unix(
                unix.path()
                    .map(|p| p.to_bytes().to_vec())
                    .unwrap_or_default(),
            )
        }
        other => {
            return Err(std::io::Error::other(format!(
                "address family {} is not one the hand-over passes",
                other.as_raw()
            )))
        }
    };
    Ok(Descriptor {
        role,
        stream,
        listening,
        address,
    })
}

/// `fd` is what `said` says it is: a listening stream socket of that
/// family at that address. A descriptor that is anything else (another
/// socket, a file, a connected socket) is refused before it is used.
pub fn check(fd: impl AsFd, said: &Descriptor) -> Result<(), String> {
    let found = describe(fd, said.role).map_err(|e| format!("{}: {e}", said.role.as_str()))?;
    if &found != said {
        return Err(format!(
            "the {} descriptor is not what was described: described {}, found {}",
            said.role.as_str(),
            show(said),
            show(&found)
        ));
    }
    if !said.stream || !said.listening {
        return Err(format!(
            "the {} descriptor is not a listening stream socket",
            said.role.as_str()
        ));
    }
    Ok(())
}

/// For log lines: "listening stream 127.0.0.1:10809".
pub fn show(d: &Descriptor) -> String {
    let kind = match (d.listening, d.stream) {
        (true, true) => "listening stream",
        (false, true) => "connected stream",
        (_, false) => "non-stream",
    };
    let address = match &d.address {
        Address::Inet(addr) => addr.to_string(),
        Address::Unix(path) => crate::logsafe::escape_bytes(path),
    };
    format!("{kind} {address}")
}
