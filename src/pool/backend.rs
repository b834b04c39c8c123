//! One server connection: connect, authenticate as the pool's user (SCRAM-SHA-256, md5,
//! cleartext or trust), read the server's ParameterStatus and BackendKeyData, and carry the
//! per-connection state the session layer needs (applied startup parameters, prepared
//! statement cache, dirtiness).
//!
//! The server chooses the method, so whoever answers on the server's address (with `prefer`, a
//! man in the middle that says 'N' to TLS) could ask for the password in cleartext: the method
//! asked for must be in `backend.require_auth` (libpq's `require_auth`; by default SCRAM-SHA-256
//! alone unless the server's certificate is verified) before anything is sent, an
//! AuthenticationOk that skips authentication counts as `trust`, and one that ends a SCRAM
//! exchange before the server has proved itself (SASLFinal) is refused.
//!
//! Defensive toward the server too: message lengths are checked against per-type limits, the
//! SCRAM iteration count the server asks for is capped, and TLS follows `backend.tls` (libpq's
//! `sslmode`): when it is required, a server that answers 'N' (or a man in the middle that does)
//! gets no plaintext fallback, and bytes a server sends after its one-byte SSL answer, before
//! the TLS handshake, abort the connection (CVE-2021-23222) rather than being read as protocol.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::addr::ServerAddr;
use crate::config::{BackendAuthMethod, BackendTlsMode};
pub use crate::tls::BackendStream;
use crate::tls::BackendTlsHandle;

use crate::protocol::error::{field_of, sqlstate_of};
use crate::protocol::framing::{self, Direction};
use crate::protocol::tag::{backend, status};

use super::prepared::PreparedCache;

/// Highest SCRAM iteration count we will compute for a server (Postgres' default is 4096).
const MAX_SCRAM_ITERATIONS: u32 = 100_000;
/// Longest cancel key a server may hand out (protocol 3.2).
const MAX_CANCEL_KEY: usize = 256;

/// Where and as whom to connect.
#[derive(Clone)]
pub struct ConnectParams {
    /// The first host to try, then `also` in order (a URL's host list, as libpq tries it).
    pub host: String,
    pub port: u16,
    pub also: Vec<(String, u16)>,
    /// Which of those hosts may serve (`target_session_attrs`).
    pub target: crate::config::TargetAttrs,
    /// Startup-packet parameters besides user and database (`application_name`, `options`).
    pub startup: Vec<(String, String)>,
    /// Without a password: the key a client of this user proved (SCRAM pass-through).
    pub client_key: Option<Arc<crate::auth::passthrough::ClientKey>>,
    pub user: String,
    pub password: Option<String>,
    pub database: String,
    pub connect_timeout: Duration,
    /// TCP_USER_TIMEOUT for the socket (`backend.tcp_user_timeout_ms`); `None` leaves it off.
    pub tcp_user_timeout: Option<Duration>,
    /// The live `backend.tls` settings (reloadable).
    pub tls: BackendTlsHandle,
}

/// Where a pool's new connections go: everything of [`ConnectParams`] a reload may change
/// besides the password.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    pub also: Vec<(String, u16)>,
    pub target: crate::config::TargetAttrs,
    pub startup: Vec<(String, String)>,
    pub connect_timeout: Duration,
    pub tcp_user_timeout: Option<Duration>,
}

impl Endpoint {
    fn of(p: &ConnectParams) -> Endpoint {
        Endpoint {
            host: p.host.clone(),
            port: p.port,
            also: p.also.clone(),
            target: p.target,
            startup: p.startup.clone(),
            connect_timeout: p.connect_timeout,
            tcp_user_timeout: p.tcp_user_timeout,
        }
    }
}

impl ConnectParams {
    /// Nowhere and as nobody yet: a route fills it in (`pool::Route::apply`).
    pub fn blank(tls: BackendTlsHandle) -> ConnectParams {
        ConnectParams {
            host: String::new(),
            port: 0,
            also: Vec::new(),
            target: crate::config::TargetAttrs::Any,
            startup: Vec::new(),
            client_key: None,
            user: String::new(),
            password: None,
            database: String::new(),
            connect_timeout: Duration::ZERO,
            tcp_user_timeout: None,
            tls,
        }
    }

    /// Where it connects to (see [`Endpoint`]).
    pub fn endpoint(&self) -> Endpoint {
        Endpoint::of(self)
    }

    /// It points at `e` (compared in place: a login checks this).
    pub fn has_endpoint(&self, e: &Endpoint) -> bool {
        self.host == e.host
            && self.port == e.port
            && self.also == e.also
            && self.target == e.target
            && self.startup == e.startup
            && self.connect_timeout == e.connect_timeout
            && self.tcp_user_timeout == e.tcp_user_timeout
    }

    /// Points it at `e`.
    pub fn set_endpoint(&mut self, e: Endpoint) {
        self.host = e.host;
        self.port = e.port;
        self.also = e.also;
        self.target = e.target;
        self.startup = e.startup;
        self.connect_timeout = e.connect_timeout;
        self.tcp_user_timeout = e.tcp_user_timeout;
    }

    /// Where `url` points, as its user (the URL's connect timeout, when it gives one, wins
    /// over `connect_timeout`).
    pub fn from_url(
        url: &crate::config::BackendUrl,
        connect_timeout: Duration,
        tcp_user_timeout: Option<Duration>,
        tls: BackendTlsHandle,
    ) -> ConnectParams {
        ConnectParams {
            host: url.host.clone(),
            port: url.port,
            also: url.hosts.iter().skip(1).cloned().collect(),
            target: url.target,
            startup: url.startup(),
            client_key: None,
            user: url.user.clone(),
            password: url.password.clone(),
            database: url.database.clone(),
            connect_timeout: url.connect_timeout.unwrap_or(connect_timeout),
            tcp_user_timeout,
            tls,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// The server refused us with an ErrorResponse; the raw frame is forwarded to the client.
    #[error("server error {code}: {message}")]
    Server {
        code: String,
        message: String,
        frame: Bytes,
    },
    #[error("authentication with the server failed: {0}")]
    Auth(String),
    /// The server asked for a method `backend.require_auth` does not list; nothing was sent.
    #[error(
        "the server asked for {}, which backend.require_auth does not allow (allowed: {allowed})",
        describe(*.method)
    )]
    MethodNotAllowed {
        method: BackendAuthMethod,
        allowed: String,
    },
    #[error("protocol error from the server: {0}")]
    Protocol(String),
    /// The server logged us in but does not qualify for `target_session_attrs`.
    #[error("{0}")]
    Target(String),
}

/// A live, authenticated server connection.
pub struct BackendConn {
    pub stream: BackendStream,
    /// Where cancel requests for this backend go.
    pub addr: ServerAddr,
    pub pid: i32,
    /// Shared with the session's cancel target, so lending the connection copies no key.
    pub secret: Arc<[u8]>,
    /// ParameterStatus values reported at login.
    pub server_params: Vec<(String, String)>,
    /// Client startup parameters currently `SET` on this connection (sorted by name).
    pub applied: crate::protocol::params::Shared,
    /// Protocol-level statements prepared here under proxy-chosen names.
    pub prepared: PreparedCache,
    /// Statements Postgres refused to reuse (result type changed): closed before re-Parse.
    pub stale: Vec<u64>,
    /// Session state a client left behind; reset (or discard) before the next client.
    pub dirty: Dirt,
    /// The last statement that left `dirty.verify`, named in the check's log line.
    pub unproven_fingerprint: u64,
    pub created: Instant,
    pub expires: Instant,
    pub idle_since: Instant,
}

/// What a client changed on this connection that must be undone before reuse.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Dirt {
    /// Settings (the role and session authorization among them).
    pub gucs: bool,
    pub listen: bool,
    pub advisory: bool,
    pub cursors: bool,
    pub sql_prepared: bool,
    pub temp: bool,
    /// The proxy cannot tell what was changed (a user function, `DO`, a FunctionCall, a
    /// client gone before its settings were read back): `DISCARD ALL`.
    pub all: bool,
    /// Something we cannot reset reliably (e.g. LOAD): close the connection instead.
    pub unresettable: bool,
    /// A statement the parse could not prove harmless ran: check the session against
    /// Postgres before the next client (`pool::verify`), unless `all` resets it anyway.
    pub verify: bool,
    /// A statement may have changed the catalog: the pool's snapshot of user code
    /// (`pool::catalog`) is invalidated when the connection is released.
    pub catalog: bool,
}

impl Dirt {
    pub fn any(&self) -> bool {
        *self != Dirt::default()
    }

    pub fn merge(&mut self, o: Dirt) {
        self.gucs |= o.gucs;
        self.listen |= o.listen;
        self.advisory |= o.advisory;
        self.cursors |= o.cursors;
        self.sql_prepared |= o.sql_prepared;
        self.temp |= o.temp;
        self.all |= o.all;
        self.unresettable |= o.unresettable;
        self.verify |= o.verify;
        self.catalog |= o.catalog;
    }

    /// SQL that returns a connection to a clean state (empty: nothing beyond the check of
    /// `verify`), or `None` when it must be closed.
    pub fn reset_sql(&self) -> Option<String> {
        if self.unresettable {
            return None;
        }
        if self.all {
            // Everything below and more (plans, sequences); also drops our statements.
            return Some("DISCARD ALL".to_owned());
        }
        let mut s = String::new();
        if self.gucs {
            // `RESET ALL` leaves `role` and `session_authorization` alone, yet the caller
            // forgets every applied setting after it: a role the proxy re-applied for the
            // client (who need not have set it on this backend) would outlive it.
            s.push_str("RESET SESSION AUTHORIZATION;RESET ROLE;RESET ALL;");
        }
        if self.listen {
            s.push_str("UNLISTEN *;");
        }
        if self.advisory {
            // Qualified: the reset runs under whatever search_path the session was left with.
            s.push_str("SELECT pg_catalog.pg_advisory_unlock_all();");
        }
        if self.cursors {
            s.push_str("CLOSE ALL;");
        }
        if self.sql_prepared {
            // Also drops the proxy's own statements; the caller clears its cache with it.
            s.push_str("DEALLOCATE ALL;");
        }
        if self.temp {
            s.push_str("DISCARD TEMP;");
        }
        Some(s)
    }
}

impl BackendConn {
    /// Opens and authenticates a connection, bounded by `p.connect_timeout` as a whole.
    /// Logs in to the first host that answers and qualifies for `p.target`, trying each in
    /// order with `p.connect_timeout`; the last host's error when none does.
    pub async fn connect(
        p: &ConnectParams,
        cache_size: usize,
    ) -> Result<BackendConn, ConnectError> {
        let hosts = std::iter::once((p.host.as_str(), p.port))
            .chain(p.also.iter().map(|(h, port)| (h.as_str(), *port)));
        let mut last = None;
        for (host, port) in hosts {
            let attempt = async {
                let mut conn = Self::connect_inner(p, host, port, cache_size).await?;
                conn.check_target(p.target).await?;
                Ok(conn)
            };
            match tokio::time::timeout(p.connect_timeout, attempt).await {
                Ok(Ok(conn)) => return Ok(conn),
                Ok(Err(e)) => {
                    if !p.also.is_empty() {
                        tracing::debug!(host, port, error = %e, "backend host skipped");
                    }
                    last = Some(e);
                }
                Err(_) => last = Some(ConnectError::Timeout(p.connect_timeout)),
            }
        }
        Err(last.unwrap_or(ConnectError::Timeout(p.connect_timeout)))
    }

    /// Whether the server qualifies for `target`: libpq's test, from the ParameterStatus
    /// Postgres 14+ reports at login (`in_hot_standby`, `default_transaction_read_only`),
    /// else from `SHOW transaction_read_only`.
    async fn check_target(
        &mut self,
        target: crate::config::TargetAttrs,
    ) -> Result<(), ConnectError> {
        use crate::config::TargetAttrs;
        if target == TargetAttrs::Any {
            return Ok(());
        }
        let param = |k: &str| {
            self.server_params
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v == "on")
        };
        let read_only = match (
            param("in_hot_standby"),
            param("default_transaction_read_only"),
        ) {
            (Some(standby), Some(default_ro)) => standby || default_ro,
            _ => {
                self.first_value("SHOW transaction_read_only")
                    .await?
                    .as_deref()
                    == Some("on")
            }
        };
        let wanted_read_only = target == TargetAttrs::ReadOnly;
        if read_only == wanted_read_only {
            return Ok(());
        }
        Err(ConnectError::Target(if read_only {
            "the server is read-only and target_session_attrs is read-write".into()
        } else {
            "the server accepts writes and target_session_attrs is read-only".into()
        }))
    }

    async fn connect_inner(
        p: &ConnectParams,
        host: &str,
        port: u16,
        cache_size: usize,
    ) -> Result<BackendConn, ConnectError> {
        let tls = p.tls.current();
        let (mut stream, addr) = Self::dial(p, host, port, &tls).await?;
        let mut buf = BytesMut::with_capacity(1024);
        Self::authenticate(p, &mut stream, &mut buf, &tls).await?;
        let (server_params, pid, secret) = Self::read_startup(&mut stream, &mut buf).await?;
        let now = Instant::now();
        Ok(BackendConn {
            stream,
            addr,
            pid,
            secret,
            server_params,
            applied: Default::default(),
            prepared: PreparedCache::new(cache_size, usize::MAX),
            stale: Vec::new(),
            dirty: Dirt::default(),
            unproven_fingerprint: 0,
            created: now,
            expires: now + Duration::from_secs(3600),
            idle_since: now,
        })
    }

    /// The connection to `host:port` (a TCP address, or a Unix socket directory): TCP with
    /// no delay, keepalive and the user timeout, then TLS as `backend.tls` asks.
    async fn dial(
        p: &ConnectParams,
        host: &str,
        port: u16,
        tls: &crate::tls::BackendTls,
    ) -> Result<(BackendStream, ServerAddr), ConnectError> {
        Ok(if crate::addr::is_socket_dir(host) {
            // Postgres speaks no TLS on its Unix sockets (libpq does not ask there either).
            // The config check refuses this already; a backstop, before any connect.
            if tls.connector.is_some() && tls.mode != BackendTlsMode::Prefer {
                return Err(ConnectError::Protocol(format!(
                    "backend.tls is {:?} but {host} is a Unix-domain socket, where Postgres \
                     speaks no TLS (use disable or prefer)",
                    tls.mode
                )));
            }
            let path = crate::addr::socket_file(std::path::Path::new(host), port);
            let unix = tokio::net::UnixStream::connect(&path)
                .await
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
            (BackendStream::Unix(unix), ServerAddr::Unix(path.into()))
        } else {
            let tcp = TcpStream::connect((host, port)).await?;
            tcp.set_nodelay(true)?;
            let sock = socket2::SockRef::from(&tcp);
            let ka = socket2::TcpKeepalive::new()
                .with_time(Duration::from_secs(30))
                .with_interval(Duration::from_secs(10));
            sock.set_tcp_keepalive(&ka)?;
            // Keepalive alone never fires while sent data waits unacknowledged (a partition
            // in the middle of a query): the user timeout covers that case, and bounds
            // keepalive too.
            #[cfg(any(target_os = "linux", target_os = "android"))]
            if let Some(t) = p.tcp_user_timeout {
                sock.set_tcp_user_timeout(Some(t))?;
            }
            let addr = ServerAddr::Tcp(tcp.peer_addr()?);
            (negotiate_tls(tcp, host, tls).await?, addr)
        })
    }

    /// The startup message and the authentication exchange the server asks for (only the
    /// methods `backend.require_auth` allows; a SCRAM server must prove it knows the
    /// secret), up to AuthenticationOk; what the server sent after it stays in `buf`.
    async fn authenticate(
        p: &ConnectParams,
        stream: &mut BackendStream,
        buf: &mut BytesMut,
        tls: &crate::tls::BackendTls,
    ) -> Result<(), ConnectError> {
        let allow = |method: BackendAuthMethod| {
            if tls.require_auth.contains(&method) {
                return Ok(());
            }
            let names: Vec<&str> = tls.require_auth.iter().map(|m| m.name()).collect();
            Err(ConnectError::MethodNotAllowed {
                method,
                allowed: names.join(", "),
            })
        };

        let mut out = BytesMut::new();
        frontend::startup_message(
            [("user", p.user.as_str()), ("database", p.database.as_str())]
                .into_iter()
                .chain(p.startup.iter().map(|(k, v)| (k.as_str(), v.as_str()))),
            &mut out,
        )?;
        stream.write_all(&out).await?;
        out.clear();

        let mut scram: Option<ScramSha256> = None;
        let mut keyed: Option<crate::auth::passthrough::KeyedScram<'_>> = None;
        // The method the server asked for, and whether its SCRAM proof was checked.
        let mut asked: Option<BackendAuthMethod> = None;
        let mut server_proved = false;
        let password = || {
            p.password.as_deref().ok_or_else(|| {
                ConnectError::Auth("the server wants a password and none is configured".into())
            })
        };
        // Authentication.
        loop {
            let (tag, body) = read_message(stream, buf).await?;
            match tag {
                backend::AUTHENTICATION => {
                    if body.len() < 4 {
                        return Err(ConnectError::Protocol(
                            "short authentication message".into(),
                        ));
                    }
                    let code = i32::from_be_bytes([body[0], body[1], body[2], body[3]]);
                    let data = &body[4..];
                    match code {
                        0 => {
                            match asked {
                                None => allow(BackendAuthMethod::Trust)?,
                                Some(BackendAuthMethod::ScramSha256) if !server_proved => {
                                    return Err(ConnectError::Auth(
                                        "the server ended SCRAM authentication before proving \
                                         it knows the password"
                                            .into(),
                                    ));
                                }
                                Some(_) => {}
                            }
                            return Ok(());
                        }
                        3 => {
                            allow(BackendAuthMethod::Password)?;
                            asked = Some(BackendAuthMethod::Password);
                            frontend::password_message(password()?.as_bytes(), &mut out)?;
                        }
                        5 => {
                            allow(BackendAuthMethod::Md5)?;
                            asked = Some(BackendAuthMethod::Md5);
                            let salt: [u8; 4] = data
                                .get(..4)
                                .and_then(|s| s.try_into().ok())
                                .ok_or_else(|| ConnectError::Protocol("short md5 salt".into()))?;
                            let h = postgres_protocol::authentication::md5_hash(
                                p.user.as_bytes(),
                                password()?.as_bytes(),
                                salt,
                            );
                            frontend::password_message(h.as_bytes(), &mut out)?;
                        }
                        10 => {
                            allow(BackendAuthMethod::ScramSha256)?;
                            asked = Some(BackendAuthMethod::ScramSha256);
                            let mechs: Vec<&[u8]> =
                                data.split(|&b| b == 0).filter(|m| !m.is_empty()).collect();
                            if !mechs.contains(&&b"SCRAM-SHA-256"[..]) {
                                return Err(ConnectError::Auth(
                                    "the server offers no SASL mechanism we support".into(),
                                ));
                            }
                            match (&p.password, &p.client_key) {
                                (None, Some(key)) => {
                                    let k = crate::auth::passthrough::KeyedScram::new(key);
                                    frontend::sasl_initial_response(
                                        "SCRAM-SHA-256",
                                        k.message(),
                                        &mut out,
                                    )?;
                                    keyed = Some(k);
                                }
                                _ => {
                                    let s = ScramSha256::new(
                                        password()?.as_bytes(),
                                        ChannelBinding::unsupported(),
                                    );
                                    frontend::sasl_initial_response(
                                        "SCRAM-SHA-256",
                                        s.message(),
                                        &mut out,
                                    )?;
                                    scram = Some(s);
                                }
                            }
                        }
                        11 => {
                            check_server_first(data)?;
                            if let Some(k) = keyed.as_mut() {
                                k.update(data).map_err(ConnectError::Auth)?;
                                frontend::sasl_response(k.message(), &mut out)?;
                            } else {
                                let s = scram.as_mut().ok_or_else(|| {
                                    ConnectError::Protocol("SASLContinue without SASL".into())
                                })?;
                                s.update(data)
                                    .map_err(|e| ConnectError::Auth(e.to_string()))?;
                                frontend::sasl_response(s.message(), &mut out)?;
                            }
                        }
                        12 => {
                            if let Some(k) = keyed.as_mut() {
                                k.finish(data).map_err(ConnectError::Auth)?;
                            } else {
                                let s = scram.as_mut().ok_or_else(|| {
                                    ConnectError::Protocol("SASLFinal without SASL".into())
                                })?;
                                s.finish(data)
                                    .map_err(|e| ConnectError::Auth(e.to_string()))?;
                            }
                            server_proved = true;
                        }
                        other => {
                            return Err(ConnectError::Auth(format!(
                                "unsupported authentication request {other}"
                            )));
                        }
                    }
                    if !out.is_empty() {
                        stream.write_all(&out).await?;
                        out.clear();
                    }
                }
                backend::ERROR_RESPONSE => return Err(server_error(body)),
                backend::NEGOTIATE_PROTOCOL_VERSION | backend::NOTICE_RESPONSE => {}
                t => {
                    return Err(ConnectError::Protocol(format!(
                        "unexpected message '{}' during authentication",
                        char::from(t)
                    )));
                }
            }
        }
    }

    /// After authentication: the server's parameters and cancel key, up to ReadyForQuery.
    async fn read_startup(
        stream: &mut BackendStream,
        buf: &mut BytesMut,
    ) -> Result<(Vec<(String, String)>, i32, Arc<[u8]>), ConnectError> {
        // Startup: parameters and key data until ReadyForQuery.
        let mut server_params = Vec::new();
        let mut pid = 0;
        let mut secret: Arc<[u8]> = Arc::from(&[][..]);
        loop {
            let (tag, body) = read_message(stream, buf).await?;
            match tag {
                backend::PARAMETER_STATUS => {
                    let mut parts = body.split(|&b| b == 0);
                    if let (Some(n), Some(v)) = (parts.next(), parts.next()) {
                        server_params.push((
                            String::from_utf8_lossy(n).into_owned(),
                            String::from_utf8_lossy(v).into_owned(),
                        ));
                    }
                }
                backend::BACKEND_KEY_DATA => {
                    // Protocol 3.2 allows keys of 4 to 256 bytes; anything else is hostile.
                    if body.len() < 8 || body.len() > 4 + MAX_CANCEL_KEY {
                        return Err(ConnectError::Protocol(format!(
                            "BackendKeyData of {} bytes",
                            body.len()
                        )));
                    }
                    pid = i32::from_be_bytes([body[0], body[1], body[2], body[3]]);
                    secret = Arc::from(&body[4..]);
                }
                backend::READY_FOR_QUERY => break,
                backend::ERROR_RESPONSE => return Err(server_error(body)),
                backend::NOTICE_RESPONSE => {}
                t => {
                    return Err(ConnectError::Protocol(format!(
                        "unexpected message '{}' during startup",
                        char::from(t)
                    )));
                }
            }
        }
        if !buf.is_empty() {
            return Err(ConnectError::Protocol(
                "unexpected bytes after ReadyForQuery".into(),
            ));
        }
        Ok((server_params, pid, secret))
    }

    /// True when the server has sent something (or closed) while the connection sat idle:
    /// such a connection is not handed to a client.
    ///
    /// The peek runs only when the runtime has seen the socket become readable since its
    /// last `WouldBlock` (`try_io` returns `WouldBlock` without a system call otherwise, and
    /// clears the readiness when the peek finds nothing): a checkout of a quiet connection
    /// costs no system call. A close or message that arrived since the runtime last polled
    /// for events is caught by the first read or write instead, like any other fault.
    pub fn has_pending_input(&self) -> bool {
        self.stream.has_pending_input()
    }

    /// Where a cancel request for this backend's running statement goes.
    pub fn cancel_target(&self) -> crate::cancel::Target {
        crate::cancel::Target {
            addr: self.addr.clone(),
            pid: self.pid,
            secret: self.secret.clone(),
        }
    }

    /// The first column of the first row of a one-statement simple query (`None`: no row).
    pub async fn first_value(&mut self, sql: &str) -> Result<Option<String>, ConnectError> {
        Ok(self
            .first_row(sql)
            .await?
            .and_then(|r| r.into_iter().next())
            .flatten())
    }

    /// The first row of a one-statement simple query as text (`None`: no row; a column is
    /// `None` when NULL).
    pub async fn first_row(
        &mut self,
        sql: &str,
    ) -> Result<Option<Vec<Option<String>>>, ConnectError> {
        let mut row = None;
        self.simple_query(sql, |tag, body| {
            if tag == backend::DATA_ROW && row.is_none() {
                row = Some(columns(body));
            }
        })
        .await?;
        Ok(row)
    }

    /// Runs one simple query and waits for ReadyForQuery; `Ok(status)` or the error.
    pub async fn simple(&mut self, sql: &str) -> Result<u8, ConnectError> {
        self.simple_query(sql, |_, _| {}).await
    }

    /// The one way the proxy runs a query of its own on a connection it holds: sends `sql`
    /// as a simple Query, shows every message up to the ReadyForQuery to `each` (type and
    /// body, errors included), and returns the transaction status — or the first error,
    /// once the ReadyForQuery has come, so the connection is left between requests.
    pub async fn simple_query(
        &mut self,
        sql: &str,
        each: impl FnMut(u8, &[u8]),
    ) -> Result<u8, ConnectError> {
        let mut out = BytesMut::new();
        crate::protocol::messages::query(&mut out, sql);
        self.request(&out, 1, each).await
    }

    /// [`BackendConn::simple_query`] for requests the caller framed itself (`out`, one write)
    /// that end in `readies` ReadyForQuery messages (a Sync or a Query each): every message
    /// up to the last goes to `each`; the status of the last, or the first error once all
    /// have come.
    pub async fn request(
        &mut self,
        out: &[u8],
        mut readies: usize,
        mut each: impl FnMut(u8, &[u8]),
    ) -> Result<u8, ConnectError> {
        self.stream.write_all(out).await?;
        let mut buf = BytesMut::new();
        let mut err = None;
        loop {
            let (tag, body) = read_message(&mut self.stream, &mut buf).await?;
            if tag == backend::READY_FOR_QUERY {
                readies = readies.saturating_sub(1);
                if readies > 0 {
                    each(tag, &body);
                    continue;
                }
                return err.map_or(Ok(body.first().copied().unwrap_or(status::IDLE)), Err);
            }
            each(tag, &body);
            if tag == backend::ERROR_RESPONSE && err.is_none() {
                err = Some(server_error(body));
            }
        }
    }
}

/// SSLRequest according to `backend.tls`; returns the stream to speak the protocol on.
async fn negotiate_tls(
    mut tcp: TcpStream,
    host: &str,
    tls: &crate::tls::BackendTls,
) -> Result<BackendStream, ConnectError> {
    let Some(connector) = tls.connector.clone() else {
        return Ok(BackendStream::Plain(tcp));
    };
    let mut req = BytesMut::new();
    frontend::ssl_request(&mut req);
    tcp.write_all(&req).await?;
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer).await?;
    // Nothing may follow the one-byte answer: the server has not seen our ClientHello yet, so
    // such bytes can only be injected (CVE-2021-23222).
    if bytes_waiting(&tcp) {
        return Err(ConnectError::Protocol(format!(
            "server sent data after its SSL response '{}'",
            char::from(answer[0]).escape_default()
        )));
    }
    match answer[0] {
        b'S' => {
            let name = rustls_pki_types::ServerName::try_from(host.to_owned()).map_err(|e| {
                ConnectError::Protocol(format!("backend host is not a TLS server name: {e}"))
            })?;
            // rustls' errors (certificate name, expiry, unknown issuer) travel as io::Error.
            let s = connector.connect(name, tcp).await?;
            Ok(BackendStream::tls(s))
        }
        b'N' if tls.mode == BackendTlsMode::Prefer => Ok(BackendStream::Plain(tcp)),
        b'N' => Err(ConnectError::Protocol(format!(
            "backend.tls is {:?} but the server does not accept TLS",
            tls.mode
        ))),
        // An old server's ErrorResponse: not read (it comes before any authentication and may
        // be anything, CVE-2024-10977).
        backend::ERROR_RESPONSE => Err(ConnectError::Protocol(
            "server answered the SSL request with an error".into(),
        )),
        other => Err(ConnectError::Protocol(format!(
            "invalid response {other:#04x} to the SSL request"
        ))),
    }
}

/// A method as the error about it names it.
fn describe(method: BackendAuthMethod) -> &'static str {
    match method {
        BackendAuthMethod::ScramSha256 => "SCRAM-SHA-256 authentication",
        BackendAuthMethod::Md5 => "an md5 password (md5)",
        BackendAuthMethod::Password => "the password in cleartext (password)",
        BackendAuthMethod::Trust => "no authentication at all (trust)",
    }
}

/// True when the peer has sent bytes we have not read (non-blocking peek).
fn bytes_waiting(tcp: &TcpStream) -> bool {
    let mut b = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    matches!(socket2::SockRef::from(tcp).peek(&mut b), Ok(n) if n > 0)
}

/// Rejects a SCRAM server-first message that asks for an absurd iteration count.
fn check_server_first(data: &[u8]) -> Result<(), ConnectError> {
    if data.len() > 4096 {
        return Err(ConnectError::Auth(
            "SCRAM server-first message too long".into(),
        ));
    }
    let text = std::str::from_utf8(data)
        .map_err(|_| ConnectError::Auth("SCRAM server-first message is not UTF-8".into()))?;
    for attr in text.split(',') {
        if let Some(i) = attr.strip_prefix("i=") {
            match i.parse::<u32>() {
                Ok(n) if (1..=MAX_SCRAM_ITERATIONS).contains(&n) => {}
                _ => {
                    return Err(ConnectError::Auth(format!(
                        "server asked for {i} SCRAM iterations (cap {MAX_SCRAM_ITERATIONS})"
                    )));
                }
            }
        }
    }
    Ok(())
}

fn server_error(body: Bytes) -> ConnectError {
    let code = sqlstate_of(&body).unwrap_or("XX000").to_string();
    let message = field_of(&body, b'M').unwrap_or("").to_string();
    let mut frame = BytesMut::with_capacity(body.len() + 5);
    crate::protocol::messages::raw(&mut frame, backend::ERROR_RESPONSE, &[&body]);
    ConnectError::Server {
        code,
        message,
        frame: frame.freeze(),
    }
}

/// The columns of a DataRow as text (`None` for NULL, or text that is not UTF-8; a
/// malformed row ends the list where it breaks).
fn columns(body: &[u8]) -> Vec<Option<String>> {
    let mut out = Vec::new();
    let Some(n) = body.get(..2).map(|b| i16::from_be_bytes([b[0], b[1]])) else {
        return out;
    };
    let mut at = 2;
    for _ in 0..n.max(0) {
        let Some(len) = body
            .get(at..at + 4)
            .map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        else {
            break;
        };
        at += 4;
        match usize::try_from(len) {
            Err(_) => out.push(None),
            Ok(len) => {
                let Some(v) = body.get(at..at + len) else {
                    break;
                };
                out.push(String::from_utf8(v.to_vec()).ok());
                at += len;
            }
        }
    }
    out
}

/// Reads one whole backend message (used only during login and for proxy-run queries).
pub async fn read_message<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut BytesMut,
) -> Result<(u8, Bytes), ConnectError> {
    loop {
        match framing::complete(buf, Direction::Backend) {
            Ok(Some(h)) => {
                let mut frame = buf.split_to(h.total);
                frame.advance(framing::HEADER_LEN);
                return Ok((h.tag, frame.freeze()));
            }
            Ok(None) => {}
            Err(e) => return Err(ConnectError::Protocol(e.to_string())),
        }
        if stream.read_buf(buf).await? == 0 {
            return Err(ConnectError::Io(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "server closed the connection",
            )));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// `RESET ALL` skips `role` and `session_authorization`, and after any settings reset
    /// the pool forgets every applied setting: each such reset must undo the identity too.
    #[test]
    fn every_settings_reset_undoes_the_role() {
        for d in [
            Dirt {
                gucs: true,
                ..Dirt::default()
            },
            Dirt {
                gucs: true,
                advisory: true,
                ..Dirt::default()
            },
        ] {
            let sql = d.reset_sql().expect("resettable");
            assert!(
                sql.contains("RESET SESSION AUTHORIZATION;RESET ROLE;"),
                "{d:?}: {sql}"
            );
        }
        let all = Dirt {
            all: true,
            ..Dirt::default()
        };
        assert_eq!(all.reset_sql().as_deref(), Some("DISCARD ALL"));
    }

    /// A server that reads the startup packet, answers `script` and closes its side, and
    /// returns everything the client sent after the startup packet until it closed.
    async fn scripted(script: Vec<u8>) -> (u16, tokio::task::JoinHandle<Vec<u8>>) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = l.local_addr().expect("addr").port();
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.expect("accept");
            let mut len = [0u8; 4];
            s.read_exact(&mut len).await.expect("startup length");
            let mut startup = vec![0u8; i32::from_be_bytes(len) as usize - 4];
            s.read_exact(&mut startup).await.expect("startup");
            s.write_all(&script).await.expect("script");
            // Nothing more from us: a client that waits for more sees the end at once.
            s.shutdown().await.expect("shutdown");
            let mut rest = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
            rest
        });
        (port, server)
    }

    fn params(port: u16, allowed: &[BackendAuthMethod]) -> ConnectParams {
        ConnectParams {
            host: "127.0.0.1".into(),
            port,
            also: Vec::new(),
            target: crate::config::TargetAttrs::Any,
            startup: Vec::new(),
            client_key: None,
            user: "app".into(),
            password: Some("secret".into()),
            database: "db".into(),
            connect_timeout: Duration::from_secs(5),
            tcp_user_timeout: None,
            tls: BackendTlsHandle::plain(allowed.to_vec()),
        }
    }

    /// An Authentication message with `code` and `data`.
    fn auth(code: i32, data: &[u8]) -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend_from_slice(&(8 + data.len() as i32).to_be_bytes());
        m.extend_from_slice(&code.to_be_bytes());
        m.extend_from_slice(data);
        m
    }

    #[tokio::test]
    async fn a_method_not_allowed_gets_nothing() {
        use BackendAuthMethod as M;
        for (code, data, method) in [
            (3, &[][..], M::Password),
            (5, &[1, 2, 3, 4][..], M::Md5),
            (0, &[][..], M::Trust),
        ] {
            let (port, server) = scripted(auth(code, data)).await;
            let e = BackendConn::connect(&params(port, &[M::ScramSha256]), 4)
                .await
                .err()
                .expect("refused");
            match &e {
                ConnectError::MethodNotAllowed { method: m, allowed } => {
                    assert_eq!((*m, allowed.as_str()), (method, "scram-sha-256"));
                }
                other => panic!("{other:?}"),
            }
            let shown = e.to_string();
            assert!(shown.contains("backend.require_auth"), "{shown}");
            assert!(shown.contains(&format!("({})", method.name())), "{shown}");
            assert!(
                server.await.expect("server").is_empty(),
                "{method:?}: nothing sent"
            );
        }
    }

    #[tokio::test]
    async fn allowed_cleartext_is_answered() {
        let (port, server) = scripted(auth(3, &[])).await;
        let p = params(port, &[BackendAuthMethod::Password]);
        let e = BackendConn::connect(&p, 4)
            .await
            .err()
            .expect("server closed");
        assert!(!matches!(e, ConnectError::MethodNotAllowed { .. }), "{e:?}");
        let sent = server.await.expect("server");
        assert_eq!(sent.first(), Some(&b'p'));
        assert!(sent.ends_with(b"secret\0"), "{sent:?}");
    }

    #[tokio::test]
    async fn scram_ended_before_the_server_proof_is_refused() {
        let mut script = auth(10, b"SCRAM-SHA-256\0\0");
        script.extend(auth(0, &[]));
        let (port, server) = scripted(script).await;
        let p = params(port, &[BackendAuthMethod::ScramSha256]);
        let e = BackendConn::connect(&p, 4).await.err().expect("refused");
        assert!(
            matches!(&e, ConnectError::Auth(m) if m.contains("before proving")),
            "{e:?}"
        );
        assert_eq!(server.await.expect("server").first(), Some(&b'p'));
    }
}
