//! Spawning `pgsluice` in front of a test cluster, and connecting real clients to it.
//!
//! The proxy is started with `--listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --backend
//! postgres://app:secret@127.0.0.1:PGPORT/appdb --pool-size N --pool-mode MODE [--config F]`
//! and reports its ports on stdout (`pgsluice listening on ADDR`, `pgsluice admin listening on
//! ADDR`). Its stderr (the logs) is forwarded line by line to the test's stderr, which the test
//! runner shows for failing tests, and the tail is kept for startup-failure messages.
//!
//! [`ProxyOptions::listen`] replaces `127.0.0.1:0` with a chosen address (a second instance on
//! a SO_REUSEPORT port, or an address a peer was told about before this proxy started).
//!
//! [`ProxyOptions::without_url_password`] leaves the password out of `--backend`
//! (`postgres://app@...`), for tests that hand it over another way.
//!
//! [`ProxyOptions::nofile`] starts the proxy under `prlimit --nofile=N:N` (util-linux), which
//! lowers the file-descriptor limit of the proxy process alone — not of the test process,
//! Postgres or the harness — and then execs it, so the child's pid is the proxy's.
//!
//! With `PGSLUICE_TEST_DIRECT=1` no proxy is spawned: [`Proxy::start`] returns a handle whose
//! address is PostgreSQL's own. That mode exists to validate the tests themselves against the
//! reference behaviour; tests skip (and say so) the assertions that only a pooler can satisfy.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc as tokio_mpsc;
use tokio::task::JoinHandle;
use tokio_postgres::{AsyncMessage, Client, Config, NoTls};

use super::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use super::{Watchdog, direct_mode, within};

/// How long the proxy may take to print its listening line.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(20);
/// How long any single client connect may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// The admin read token every spawned proxy gets (`PGSLUICE_ADMIN_READ_TOKEN`), so tests can
/// read `/v1/pools` and friends.
pub const ADMIN_READ_TOKEN: &str = "pgsluice-test-read-token";
/// How many stderr lines to keep for failure messages.
const STDERR_TAIL_LINES: usize = 200;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolMode {
    Transaction,
    Session,
}

impl PoolMode {
    fn as_arg(self) -> &'static str {
        match self {
            PoolMode::Transaction => "transaction",
            PoolMode::Session => "session",
        }
    }
}

/// How to start the proxy. `ProxyOptions::pool(10)` is transaction mode with 10 backends.
#[derive(Clone, Debug)]
pub struct ProxyOptions {
    pub pool_size: usize,
    pub pool_mode: PoolMode,
    pub config: Option<PathBuf>,
    pub extra_args: Vec<String>,
    /// Where the proxy connects instead of the cluster (a fault-injection proxy in front of it).
    pub backend_addr: Option<SocketAddr>,
    /// RLIMIT_NOFILE (soft and hard) of the proxy process, for fd-exhaustion tests.
    pub nofile: Option<u64>,
    /// `--listen` instead of `127.0.0.1:0`.
    pub listen: Option<SocketAddr>,
    /// Whether `--backend` carries the app password (`postgres://app:secret@...`).
    pub url_password: bool,
    /// Extra environment variables of the proxy process.
    pub envs: Vec<(String, String)>,
    /// Reach the cluster through its Unix-domain socket instead of TCP.
    pub backend_socket: bool,
}

impl ProxyOptions {
    pub fn pool(pool_size: usize) -> ProxyOptions {
        ProxyOptions {
            pool_size,
            pool_mode: PoolMode::Transaction,
            config: None,
            extra_args: Vec::new(),
            backend_addr: None,
            nofile: None,
            listen: None,
            url_password: true,
            envs: Vec::new(),
            backend_socket: false,
        }
    }

    /// `--backend postgres://app@...`: the proxy must get the password another way.
    pub fn without_url_password(mut self) -> ProxyOptions {
        self.url_password = false;
        self
    }

    /// Listen on `addr` instead of an ephemeral port.
    pub fn listen(mut self, addr: SocketAddr) -> ProxyOptions {
        self.listen = Some(addr);
        self
    }

    /// Start the proxy with at most `limit` open file descriptors.
    pub fn nofile(mut self, limit: u64) -> ProxyOptions {
        self.nofile = Some(limit);
        self
    }

    /// Connect to Postgres through its Unix-domain socket (`host=DIR` in the URL).
    pub fn backend_over_socket(mut self) -> ProxyOptions {
        self.backend_socket = true;
        self
    }

    /// Connect to Postgres through `addr` (which forwards to the cluster).
    pub fn backend_via(mut self, addr: SocketAddr) -> ProxyOptions {
        self.backend_addr = Some(addr);
        self
    }

    pub fn session(mut self) -> ProxyOptions {
        self.pool_mode = PoolMode::Session;
        self
    }

    pub fn config_file(mut self, path: impl Into<PathBuf>) -> ProxyOptions {
        self.config = Some(path.into());
        self
    }

    pub fn arg(mut self, arg: impl Into<String>) -> ProxyOptions {
        self.extra_args.push(arg.into());
        self
    }

    /// Sets an environment variable of the proxy process.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> ProxyOptions {
        self.envs.push((key.into(), value.into()));
        self
    }
}

/// A running proxy (or, in direct mode, a stand-in pointing at PostgreSQL). Killed on drop.
pub struct Proxy {
    child: Option<Child>,
    addr: SocketAddr,
    admin_addr: Arc<Mutex<Option<SocketAddr>>>,
    options: ProxyOptions,
    stderr_tail: Arc<Mutex<Vec<String>>>,
    watchdog: Option<Watchdog>,
}

impl Proxy {
    /// Starts the proxy in front of `cluster` and waits until it listens; panics (with the
    /// proxy's stderr) if it does not within 20 s.
    pub fn start(cluster: &Cluster, options: ProxyOptions) -> Proxy {
        if direct_mode() {
            eprintln!(
                "PGSLUICE_TEST_DIRECT=1: clients connect to PostgreSQL at {} directly",
                cluster.addr()
            );
            return Proxy {
                child: None,
                addr: cluster.addr(),
                admin_addr: Arc::new(Mutex::new(None)),
                options,
                stderr_tail: Arc::new(Mutex::new(Vec::new())),
                watchdog: None,
            };
        }
        let backend_addr = options.backend_addr.unwrap_or_else(|| cluster.addr());
        let (at, query) = if options.backend_socket {
            let dir = cluster.socket_dir().display();
            (
                String::new(),
                format!("?host={dir}&port={}", cluster.port()),
            )
        } else {
            (backend_addr.to_string(), String::new())
        };
        let backend = if options.url_password {
            format!("postgres://{APP_USER}:{APP_PASSWORD}@{at}/{APP_DB}{query}")
        } else {
            format!("postgres://{APP_USER}@{at}/{APP_DB}{query}")
        };
        let bin = env!("CARGO_BIN_EXE_pgsluice");
        let mut cmd = match options.nofile {
            Some(n) => {
                let mut c = Command::new("prlimit");
                c.arg(format!("--nofile={n}:{n}")).arg("--").arg(bin);
                c
            }
            None => Command::new(bin),
        };
        let listen = options
            .listen
            .map_or_else(|| "127.0.0.1:0".to_string(), |a| a.to_string());
        cmd.args([
            "--listen",
            &listen,
            "--admin-listen",
            "127.0.0.1:0",
            "--backend",
            &backend,
        ])
        .args([
            "--pool-size",
            &options.pool_size.to_string(),
            "--pool-mode",
            options.pool_mode.as_arg(),
        ]);
        if let Some(config) = &options.config {
            cmd.arg("--config").arg(config);
        }
        cmd.args(&options.extra_args)
            .envs(options.envs.iter().map(|(k, v)| (k, v)))
            .env("PGSLUICE_ADMIN_READ_TOKEN", ADMIN_READ_TOKEN)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let shown = format!("{cmd:?}");
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot spawn {shown}: {e}"));
        let watchdog = Watchdog::spawn(
            "kill -KILL \"$ARG1\"",
            &[child.id().to_string().as_ref()],
            None,
        );

        let stderr_tail = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("piped stderr");
        let tail = Arc::clone(&stderr_tail);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("[pgsluice] {line}");
                let mut tail = tail.lock().expect("stderr tail lock");
                if tail.len() == STDERR_TAIL_LINES {
                    tail.remove(0);
                }
                tail.push(line);
            }
        });

        let admin_addr = Arc::new(Mutex::new(None));
        let (listening_tx, listening_rx) = mpsc::channel();
        let stdout = child.stdout.take().expect("piped stdout");
        let admin = Arc::clone(&admin_addr);
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                eprintln!("[pgsluice stdout] {line}");
                if let Some(rest) = line.trim().strip_prefix("pgsluice admin listening on ") {
                    *admin.lock().expect("admin addr lock") = rest.trim().parse().ok();
                } else if let Some(rest) = line.trim().strip_prefix("pgsluice listening on ") {
                    let _ = listening_tx.send(rest.trim().to_string());
                }
            }
        });

        let deadline = Instant::now() + STARTUP_TIMEOUT;
        let addr = loop {
            match listening_rx.recv_timeout(Duration::from_millis(50)) {
                Ok(text) => match text.parse::<SocketAddr>() {
                    Ok(addr) => break addr,
                    Err(e) => {
                        let _ = child.kill();
                        panic!(
                            "pgsluice printed an unparsable listen address {text:?}: {e}\n{}",
                            tail_text(&stderr_tail)
                        );
                    }
                },
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // stdout closed without the line: the process is exiting or closed stdout.
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
            if let Some(status) = child.try_wait().expect("try_wait pgsluice") {
                std::thread::sleep(Duration::from_millis(100)); // let the stderr thread finish
                panic!(
                    "pgsluice exited ({status}) before printing `pgsluice listening on ADDR`\n\
                     command: {shown}\n--- pgsluice stderr (tail) ---\n{}",
                    tail_text(&stderr_tail)
                );
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "pgsluice did not print `pgsluice listening on ADDR` within {STARTUP_TIMEOUT:?}\n\
                     command: {shown}\n--- pgsluice stderr (tail) ---\n{}",
                    tail_text(&stderr_tail)
                );
            }
        };
        Proxy {
            child: Some(child),
            addr,
            admin_addr,
            options,
            stderr_tail,
            watchdog: Some(watchdog),
        }
    }

    /// True when no proxy runs and clients talk to PostgreSQL directly.
    pub fn is_direct(&self) -> bool {
        self.child.is_none()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The admin listener's address, if the proxy printed it.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        *self.admin_addr.lock().expect("admin addr lock")
    }

    pub fn pool_size(&self) -> usize {
        self.options.pool_size
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The proxy's recent stderr lines, for assertion messages.
    pub fn stderr_tail(&self) -> String {
        tail_text(&self.stderr_tail)
    }

    /// A libpq-style connection string to the proxy.
    pub fn connect_str(&self, user: &str, password: &str, db: &str) -> String {
        format!(
            "host={} port={} user={user} password={password} dbname={db} connect_timeout=10",
            self.addr.ip(),
            self.addr.port()
        )
    }

    /// A tokio-postgres config for the proxy; tweak it (application_name, …) before connecting.
    pub fn config(&self, user: &str, password: &str, db: &str) -> Config {
        let mut config = Config::new();
        config
            .host(self.addr.ip().to_string())
            .port(self.addr.port())
            .user(user)
            .password(password)
            .dbname(db)
            .connect_timeout(Duration::from_secs(10));
        config
    }

    /// The standard application login (`app`/`secret`, database `appdb`).
    pub fn app_config(&self) -> Config {
        self.config(APP_USER, APP_PASSWORD, APP_DB)
    }

    /// Connects as `app` to `appdb`; the connection task runs detached until the client drops.
    pub async fn client(&self) -> Client {
        self.client_with(&self.app_config()).await.0
    }

    /// Connects with `config`, panicking on failure; returns the connection task's handle
    /// (abort it to make the client vanish without a Terminate message).
    pub async fn client_with(&self, config: &Config) -> (Client, JoinHandle<()>) {
        self.try_client_with(config)
            .await
            .unwrap_or_else(|e| panic!("connect to {} failed: {e:?}", self.addr))
    }

    /// Like [`Proxy::client_with`] but returns the connect error (for auth tests).
    pub async fn try_client_with(
        &self,
        config: &Config,
    ) -> Result<(Client, JoinHandle<()>), tokio_postgres::Error> {
        let (client, connection) = within(
            CONNECT_TIMEOUT,
            "connecting a client",
            config.connect(NoTls),
        )
        .await?;
        let task = tokio::spawn(async move {
            // Connection errors are expected in fault tests; the client side sees them.
            let _ = connection.await;
        });
        Ok((client, task))
    }

    /// Connects with `config` and forwards the connection's asynchronous messages (notices,
    /// notifications) to the returned channel; the plain connection future drops them.
    pub async fn client_with_messages(
        &self,
        config: &Config,
    ) -> (
        Client,
        tokio_mpsc::UnboundedReceiver<AsyncMessage>,
        JoinHandle<()>,
    ) {
        let (client, mut connection) = within(
            CONNECT_TIMEOUT,
            "connecting a client",
            config.connect(NoTls),
        )
        .await
        .unwrap_or_else(|e| panic!("connect to {} failed: {e:?}", self.addr));
        let (tx, rx) = tokio_mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            while let Some(Ok(message)) =
                std::future::poll_fn(|cx| connection.poll_message(cx)).await
            {
                // A dropped receiver is fine: keep driving the connection for the client.
                let _ = tx.send(message);
            }
        });
        (client, rx, task)
    }

    /// The universal oracle of TESTS.md: a fresh client can connect and `SELECT 1`.
    pub async fn assert_healthy(&self) {
        let client = self.client().await;
        let rows = within(
            Duration::from_secs(10),
            "SELECT 1 on a fresh client",
            client.simple_query("SELECT 1"),
        )
        .await
        .unwrap_or_else(|e| {
            panic!(
                "a fresh client cannot SELECT 1: {e:?}\n{}",
                self.stderr_tail()
            )
        });
        assert!(
            rows.iter().any(
                |m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("1"))
            ),
            "SELECT 1 on a fresh client returned no row 1"
        );
    }

    /// The `appdb/app` entry of `GET /v1/pools` (`Null` while that pool does not exist).
    pub async fn app_pool(&self) -> serde_json::Value {
        let (status, body) = self
            .admin_request("GET", "/v1/pools", ADMIN_READ_TOKEN, None)
            .await;
        assert_eq!(status, 200, "GET /v1/pools: {body}");
        let reply: serde_json::Value = serde_json::from_str(&body).expect("/v1/pools is JSON");
        let name = format!("{APP_DB}/{APP_USER}");
        reply["pools"]
            .as_array()
            .unwrap_or_else(|| panic!("GET /v1/pools: no array of pools in {reply}"))
            .iter()
            .find(|p| p["name"] == name.as_str())
            .cloned()
            .unwrap_or(serde_json::Value::Null)
    }

    /// One HTTP/1.0 request to the admin API with `Authorization: Bearer token` (and a JSON
    /// body, if any); (status, body). Panics if the admin port does not answer in 15 s.
    pub async fn admin_request(
        &self,
        method: &str,
        path: &str,
        token: &str,
        body: Option<&str>,
    ) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        const LIMIT: Duration = Duration::from_secs(15);
        let addr = self.admin_addr().expect("admin address");
        let mut s = within(LIMIT, "admin connect", tokio::net::TcpStream::connect(addr))
            .await
            .expect("admin connect");
        let body = body.unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.0\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.expect("admin request");
        let mut resp = Vec::new();
        within(LIMIT, "admin response", s.read_to_end(&mut resp))
            .await
            .expect("admin response");
        let text = String::from_utf8_lossy(&resp);
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        (status, body)
    }

    /// A client tool (`psql`, `pgbench`) aimed at the proxy through libpq environment variables.
    pub fn tool_command(&self, bin: &str, user: &str, password: &str, db: &str) -> Command {
        Cluster::tool_command(bin, self.addr, user, password, db)
    }

    /// Sends SIGTERM (graceful shutdown) to the proxy. No-op in direct mode.
    pub fn sigterm(&self) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status();
        }
    }

    /// Waits up to `limit` for the proxy to exit; `None` if it is still running (or direct).
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = child.try_wait().expect("try_wait pgsluice") {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        drop(self.watchdog.take());
    }
}

fn tail_text(tail: &Mutex<Vec<String>>) -> String {
    tail.lock().map(|t| t.join("\n")).unwrap_or_default()
}

/// A client of `proxy` as `app` with `application_name`, shareable with spawned tasks.
pub async fn client(proxy: &Proxy, application_name: &str) -> Arc<Client> {
    let mut cfg = proxy.app_config();
    cfg.application_name(application_name);
    Arc::new(proxy.client_with(&cfg).await.0)
}
