//! The two ends' addresses: where a client connected from (a TCP peer, or the proxy's own
//! Unix-domain socket) and where a server listens (a TCP address, or a socket file). As in
//! libpq and PgBouncer, a host that starts with `/` is a socket directory and the socket in
//! it is `.s.PGSQL.PORT`.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a client connected from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientAddr {
    Tcp(SocketAddr),
    /// The Unix-domain socket in `unix_socket_dir`: a process on this host.
    Unix,
}

impl ClientAddr {
    /// The client's IP address; none over a Unix socket, where address-based callers do not
    /// match (as Postgres's `client_addr` is NULL there). Shares use [`Self::source_ip`].
    pub fn ip(&self) -> Option<IpAddr> {
        match self {
            ClientAddr::Tcp(a) => Some(a.ip()),
            ClientAddr::Unix => None,
        }
    }

    /// The address its per-address shares (handshakes, cancels in flight) are counted under:
    /// its IP, or loopback for the Unix socket (every local process together, as they would
    /// be over 127.0.0.1).
    pub fn source_ip(&self) -> IpAddr {
        self.ip().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
    }
}

impl fmt::Display for ClientAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientAddr::Tcp(a) => a.fmt(f),
            ClientAddr::Unix => f.write_str("unix"),
        }
    }
}

/// Where a server listens: what a cancel request for one of its backends connects to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerAddr {
    Tcp(SocketAddr),
    /// A socket file (`DIR/.s.PGSQL.PORT`).
    Unix(Arc<Path>),
}

impl fmt::Display for ServerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServerAddr::Tcp(a) => a.fmt(f),
            ServerAddr::Unix(p) => p.display().fmt(f),
        }
    }
}

/// True when `host` names a socket directory rather than a host.
pub fn is_socket_dir(host: &str) -> bool {
    host.starts_with('/')
}

/// The socket file of port `port` in directory `dir`.
pub fn socket_file(dir: &Path, port: u16) -> PathBuf {
    dir.join(format!(".s.PGSQL.{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_dirs_and_files_are_named_as_libpq_names_them() {
        assert!(is_socket_dir("/var/run/postgresql"));
        assert!(!is_socket_dir("db.internal"));
        assert!(!is_socket_dir("127.0.0.1"));
        assert_eq!(
            socket_file(Path::new("/tmp"), 6432),
            PathBuf::from("/tmp/.s.PGSQL.6432")
        );
        assert_eq!(ClientAddr::Unix.to_string(), "unix");
        assert_eq!(ClientAddr::Unix.ip(), None);
        assert_eq!(ClientAddr::Unix.source_ip(), IpAddr::from([127, 0, 0, 1]));
        let tcp = ClientAddr::Tcp(SocketAddr::from(([10, 0, 0, 1], 5000)));
        assert_eq!(tcp.to_string(), "10.0.0.1:5000");
        assert_eq!(tcp.ip(), Some(IpAddr::from([10, 0, 0, 1])));
    }
}
