//! A throwaway Redis for fleet tests: `redis-server` from PATH on a loopback port the OS
//! picked, no persistence, its own working directory, killed with the test (a [`Watchdog`]
//! covers a test binary that dies). [`Redis::kill`] and [`Redis::restart`] simulate an outage:
//! the restarted server comes back empty on the same port, as a Redis without persistence does.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::Watchdog;

const STARTUP_TIMEOUT: Duration = Duration::from_secs(10);

pub struct Redis {
    child: Option<Child>,
    watchdog: Option<Watchdog>,
    port: u16,
    dir: tempfile::TempDir,
}

impl Redis {
    pub fn start() -> Redis {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("pick a free port")
            .port();
        let dir = tempfile::tempdir().expect("redis dir");
        let mut r = Redis {
            child: None,
            watchdog: None,
            port,
            dir,
        };
        r.spawn();
        r
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// SIGKILL: the server is gone at once, connections reset.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.watchdog = None;
    }

    /// A new, empty server on the same port.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// One command in RESP (inline form); the raw reply.
    pub fn command(&self, line: &str) -> String {
        let mut s = TcpStream::connect(self.addr()).expect("connect to redis");
        s.set_read_timeout(Some(Duration::from_secs(5))).ok();
        s.write_all(format!("{line}\r\n").as_bytes())
            .expect("write to redis");
        let mut buf = [0u8; 4096];
        let n = s.read(&mut buf).unwrap_or(0);
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = cmd.spawn().unwrap_or_else(|e| {
            panic!(
                "cannot start redis-server (Debian package redis-server; .ci/run installs it): {e}"
            )
        });
        self.watchdog = Some(Watchdog::spawn(
            "kill -KILL \"$ARG1\"",
            &[child.id().to_string().as_ref()],
            None,
        ));
        self.child = Some(child);
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Ok(mut s) = TcpStream::connect(self.addr()) {
                s.set_read_timeout(Some(Duration::from_secs(1))).ok();
                let mut buf = [0u8; 16];
                if s.write_all(b"PING\r\n").is_ok()
                    && s.read(&mut buf)
                        .is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
                {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not answer PING on port {} within {STARTUP_TIMEOUT:?}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}
