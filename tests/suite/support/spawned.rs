//! A proxy process started by hand, the way an operator starts it — flags, `PGSLUICE_*`
//! variables, a config file (the harness's `Proxy` always passes flags) — and the `pgsluice`
//! command line run against it, for `cli`, `logging`, `lifecycle`, `routing`, `auth` and
//! `admin::stats`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_pgsluice");

/// A proxy process started by hand (the harness's `Proxy` always passes flags), killed on
/// drop.
pub struct Spawned {
    child: Child,
    pub admin: SocketAddr,
    pub listen: SocketAddr,
    /// Everything the proxy wrote to stderr (a pipe, not a terminal) so far.
    pub stderr: Arc<Mutex<String>>,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn spawn(envs: &[(&str, String)], args: &[&str]) -> Spawned {
    let mut cmd = Command::new(BIN);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("PGSLUICE_") {
            cmd.env_remove(k);
        }
    }
    cmd.args(args)
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .env("PGSLUICE_ADMIN_READ_TOKEN", "read")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn pgsluice");
    let stderr = Arc::new(Mutex::new(String::new()));
    let pipe = child.stderr.take().expect("stderr");
    let log = Arc::clone(&stderr);
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            eprintln!("[pgsluice] {line}");
            let mut log = log.lock().expect("stderr lock");
            log.push_str(&line);
            log.push('\n');
        }
    });
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let (mut admin, mut listen) = (None, None);
    let deadline = Instant::now() + Duration::from_secs(20);
    while listen.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .expect("pgsluice printed its addresses within 20 s");
        if let Some(a) = line.strip_prefix("pgsluice admin listening on ") {
            admin = a.parse().ok();
        } else if let Some(a) = line.strip_prefix("pgsluice listening on ") {
            listen = a.parse().ok();
        }
    }
    Spawned {
        child,
        admin: admin.expect("admin address"),
        listen: listen.expect("listen address"),
        stderr,
    }
}

/// GET with the read token: (status, body).
pub fn get(admin: SocketAddr, path: &str) -> (u16, String) {
    let (status, text) = get_as(admin, "127.0.0.1", path);
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    (status, body)
}

/// `pgsluice ARGS` with no PGSLUICE_* variable inherited: (success, stdout, stderr).
pub fn client(args: &[&str]) -> (bool, String, String) {
    let mut cmd = Command::new(BIN);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("PGSLUICE_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd.args(args).output().expect("run the pgsluice client");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A GET naming `host` in its Host header, with the read token: (status, body).
pub fn get_as(admin: SocketAddr, host: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(admin).expect("connect to the admin API");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        s,
        "GET {path} HTTP/1.0\r\nHost: {host}\r\nAuthorization: Bearer read\r\n\r\n"
    )
    .expect("request");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("response");
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// The value of the exposition line that starts with `series` (labels in the encoder's
/// alphabetical order).
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}
