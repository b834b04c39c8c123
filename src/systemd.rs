//! Service-manager notifications for a systemd unit with `Type=notify` (deploy/systemd/):
//! `READY=1` once both listeners are bound, `RELOADING=1` (with `MONOTONIC_USEC`) then
//! `READY=1` around a SIGHUP reload, `STOPPING=1` when the drain begins, and a one-line
//! `STATUS=`.
//!
//! The protocol is one datagram of `KEY=value` lines to the unix socket named by
//! `NOTIFY_SOCKET` (a path, or `@name` in the abstract namespace), so it is written by hand
//! with std's `UnixDatagram` instead of taking a crate. Without `NOTIFY_SOCKET` (not under
//! systemd) every call does nothing. Sending is best effort: a failure is logged once at debug
//! level and never affects the proxy, which must not depend on its supervisor to serve.
//!
//! Owns nothing else: it does not read signals or decide when the proxy is ready; `main` calls
//! it at those points.

use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::atomic::{AtomicBool, Ordering};

/// Where notifications go; `None` when the process was not started by a service manager.
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr)>,
    /// A failed send has been logged (later failures are not, to keep logs quiet).
    warned: AtomicBool,
}

impl Notifier {
    /// From `NOTIFY_SOCKET`; a notifier that does nothing when it is unset, empty or
    /// unusable.
    pub fn from_env() -> Notifier {
        let target = std::env::var_os("NOTIFY_SOCKET")
            .filter(|v| !v.is_empty())
            .and_then(|v| match Self::connect(v.as_encoded_bytes()) {
                Ok(t) => Some(t),
                Err(e) => {
                    tracing::warn!(error = %e, "NOTIFY_SOCKET is set but unusable; not notifying the service manager");
                    None
                }
            });
        Notifier {
            target,
            warned: AtomicBool::new(false),
        }
    }

    /// A notifier that sends to the socket at `path` (tests, and `from_env`).
    pub fn to_path(path: &std::path::Path) -> std::io::Result<Notifier> {
        Ok(Notifier {
            target: Some(Self::connect(path.as_os_str().as_encoded_bytes())?),
            warned: AtomicBool::new(false),
        })
    }

    fn connect(name: &[u8]) -> std::io::Result<(UnixDatagram, SocketAddr)> {
        let addr = match name.strip_prefix(b"@") {
            Some(abstract_name) => {
                use std::os::linux::net::SocketAddrExt;
                SocketAddr::from_abstract_name(abstract_name)?
            }
            None => {
                use std::os::unix::ffi::OsStrExt;
                SocketAddr::from_pathname(std::ffi::OsStr::from_bytes(name))?
            }
        };
        Ok((UnixDatagram::unbound()?, addr))
    }

    /// Whether a service manager is listening (`NOTIFY_SOCKET` was usable).
    pub fn enabled(&self) -> bool {
        self.target.is_some()
    }

    /// Startup finished (or a reload did): the listeners accept.
    pub fn ready(&self, status: &str) {
        self.send(&format!("READY=1\nSTATUS={}", one_line(status)));
    }

    /// A configuration reload starts; [`Notifier::ready`] ends it.
    pub fn reloading(&self) {
        self.send(&format!(
            "RELOADING=1\nMONOTONIC_USEC={}\nSTATUS=reloading the configuration",
            monotonic_usec()
        ));
    }

    /// The graceful stop began (no new connections; transactions in flight finish).
    pub fn stopping(&self) {
        self.send("STOPPING=1\nSTATUS=draining: no new connections");
    }

    fn send(&self, msg: &str) {
        let Some((socket, addr)) = &self.target else {
            return;
        };
        if let Err(e) = socket.send_to_addr(msg.as_bytes(), addr)
            && !self.warned.swap(true, Ordering::Relaxed)
        {
            tracing::debug!(error = %e, "cannot notify the service manager");
        }
    }
}

/// `STATUS=` is one line: newlines would start new (bogus) assignments.
fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

/// CLOCK_MONOTONIC in microseconds, as `RELOADING=1` wants it (systemd compares it with its
/// own clock to order reloads).
fn monotonic_usec() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only into the timespec passed, which lives on this stack.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return 0;
    }
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000
        + u64::try_from(ts.tv_nsec).unwrap_or(0) / 1_000
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (tempfile::TempDir, UnixDatagram, Notifier) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify");
        let server = UnixDatagram::bind(&path).expect("bind");
        server
            .set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .expect("timeout");
        let n = Notifier::to_path(&path).expect("notifier");
        (dir, server, n)
    }

    fn recv(server: &UnixDatagram) -> String {
        let mut buf = [0u8; 512];
        let n = server.recv(&mut buf).expect("a datagram");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn sends_the_protocol_lines() {
        let (_dir, server, n) = pair();
        assert!(n.enabled());
        n.ready("serving\non two lines");
        assert_eq!(recv(&server), "READY=1\nSTATUS=serving on two lines");
        n.reloading();
        let msg = recv(&server);
        let lines: Vec<&str> = msg.lines().collect();
        assert_eq!(lines[0], "RELOADING=1");
        let usec: u64 = lines[1]
            .strip_prefix("MONOTONIC_USEC=")
            .and_then(|v| v.parse().ok())
            .expect("MONOTONIC_USEC=<n>");
        assert!(usec > 0);
        n.stopping();
        assert!(recv(&server).starts_with("STOPPING=1\n"));
    }

    #[test]
    fn a_missing_listener_is_not_an_error() {
        let (dir, server, n) = pair();
        drop(server);
        std::fs::remove_file(dir.path().join("notify")).expect("rm");
        n.ready("nobody listens");
        n.stopping();
    }
}
