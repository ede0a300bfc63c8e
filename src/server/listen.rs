//! Binding the gateway's listeners so that a port another process listens on
//! is an error that names the address, never a shared port. The serving
//! threads share one port with `SO_REUSEPORT`, which would also let a second
//! gateway join the group and take part of the traffic; so the port is first
//! claimed by a probe socket *without* `SO_REUSEPORT`, which fails while any
//! other socket listens there (with or without the option), and only then
//! are the threads' sockets bound. The window between the probe's close and
//! the first shared bind is a few system calls; a process that binds in it
//! with `SO_REUSEPORT` under the same user could still join, which is why the
//! probe comes first rather than a check afterwards.

use socket2::{Domain, Protocol, Socket, Type};
use std::io;
use std::net::SocketAddr;

/// Bind `addr` for one listener (admin API, `server::spawn`), without
/// `SO_REUSEPORT`. `what` names the config key in the error.
pub fn bind_exclusive(addr: SocketAddr, what: &str) -> io::Result<tokio::net::TcpListener> {
    let s = socket(addr, false).and_then(|s| {
        s.bind(&addr.into())?;
        s.listen(1024)?;
        Ok(s)
    });
    let s = s.map_err(|e| explain(e, addr, what))?;
    tokio::net::TcpListener::from_std(s.into())
}

/// Bind `n` listeners on `addr` sharing its port with `SO_REUSEPORT` (the
/// kernel spreads connections over them), after a probe has made sure no other
/// process listens there. Port 0 picks one free port shared by all of them.
pub fn bind_shared(
    addr: SocketAddr,
    n: usize,
    what: &str,
) -> io::Result<Vec<std::net::TcpListener>> {
    let probe = socket(addr, false).and_then(|s| {
        s.bind(&addr.into())?;
        Ok(s)
    });
    let probe = probe.map_err(|e| explain(e, addr, what))?;
    let mut addr = addr;
    addr.set_port(
        probe
            .local_addr()?
            .as_socket()
            .map_or(addr.port(), |a| a.port()),
    );
    drop(probe);
    let mut out: Vec<std::net::TcpListener> = Vec::with_capacity(n.max(1));
    for _ in 0..n.max(1) {
        let s = socket(addr, true).and_then(|s| {
            s.bind(&addr.into())?;
            s.listen(4096)?;
            Ok(s)
        });
        out.push(s.map_err(|e| explain(e, addr, what))?.into());
    }
    Ok(out)
}

/// A non-blocking TCP socket for `addr`, `SO_REUSEADDR` set (a restart may bind
/// over connections in TIME_WAIT), `SO_REUSEPORT` only when `shared`.
fn socket(addr: SocketAddr, shared: bool) -> io::Result<Socket> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    s.set_reuse_address(true)?;
    #[cfg(unix)]
    if shared {
        s.set_reuse_port(true)?;
    }
    #[cfg(not(unix))]
    let _ = shared;
    s.set_nonblocking(true)?;
    Ok(s)
}

/// The bind error with the address and what it means.
fn explain(e: io::Error, addr: SocketAddr, what: &str) -> io::Error {
    let msg = match e.kind() {
        io::ErrorKind::AddrInUse => format!(
            "{what} {addr}: address already in use: another process listens on this port (is another gateway running?); refusing to share it"
        ),
        _ => format!("{what} {addr}: cannot listen: {e}"),
    };
    io::Error::new(e.kind(), msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_in_use_is_refused_by_name_and_our_own_threads_share_it() {
        let first = bind_shared("127.0.0.1:0".parse().unwrap(), 2, "server.listen").unwrap();
        let addr = first[0].local_addr().unwrap();
        assert_eq!(first[1].local_addr().unwrap(), addr);
        let e = bind_shared(addr, 2, "server.listen").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("server.listen {addr}")) && msg.contains("already in use"),
            "{msg}"
        );
        // A plain listener elsewhere (another program) blocks it too.
        let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let e = bind_shared(other.local_addr().unwrap(), 1, "server.listen").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
    }
}
