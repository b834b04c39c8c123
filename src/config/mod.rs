//! The configuration file: serde structs (unknown keys are errors), defaults, command-line
//! overrides, and validation with errors that name the field and its line.
//!
//! Imports nothing else of ours. Loading returns a complete, validated [`Config`] or a list of
//! [`ConfigError`]s; it never half-applies. Reloading is the app's job (it swaps the snapshot).
//!
//! Secrets: the backend password may come from a file (`--backend-password-file`,
//! `backend.password_file`) or `PGSLUICE_BACKEND_PASSWORD` instead of the URL, so it need not
//! be on a command line; [`Config::apply`] reads it. No error, here or in `validate`, ever
//! contains a password: they name where it came from instead.

mod detect;
mod notes;
mod url;
mod validate;

use std::collections::BTreeMap;
use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

pub use detect::{AutoRulesConfig, AutoRulesMode, DetectorConfig};
pub use url::{BackendUrl, TargetAttrs, URL_PARAMETERS};
pub use validate::{ConfigError, check_dial_addr};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address clients connect to.
    pub listen: SocketAddr,
    /// SO_REUSEPORT (and SO_REUSEADDR) on the client listener, so that several instances can
    /// share `listen` and one can be restarted while the others accept. Read at start only.
    pub listen_reuseport: bool,
    /// A directory for a Unix-domain socket besides `listen` (PgBouncer's `unix_socket_dir`):
    /// clients reach it as `DIR/.s.PGSQL.PORT`, PORT being `listen`'s port (`psql -h DIR -p
    /// PORT`). Unset: TCP only. Read at start only.
    pub unix_socket_dir: Option<PathBuf>,
    /// Permissions of that socket, in octal (`"0777"`: every local user may connect, as
    /// PgBouncer's default; `"0770"`: the proxy's group only). Read at start only.
    pub unix_socket_mode: String,
    /// This instance's id among `peers` (1..=255); its cancel keys carry it. Read at start only.
    pub peer_id: u8,
    /// The other instances sharing the port: a CancelRequest for a key one of them issued is
    /// passed on to it. Empty: keys carry no instance id and no cancel is forwarded.
    pub peers: Vec<PeerConfig>,
    /// An address of this instance alone that accepts CancelRequests passed on by peers (and
    /// nothing else): what the others list as its `peers[].addr` when instances share
    /// `listen` on one host. Read at start only.
    pub peer_listen: Option<SocketAddr>,
    /// Runtime threads that run sessions, the admin API and background work. 1: one thread
    /// (PgBouncer's model: no cross-thread wake-ups, least CPU per transaction); N > 1: a
    /// work-stealing pool of N; 0 (default): 1 on a machine with at most 2 CPUs (where the
    /// proxy shares cores with Postgres and the clients), else one per CPU. Read at start only.
    pub worker_threads: usize,
    pub admin: AdminConfig,
    pub backend: BackendConfig,
    /// Defaults for every (database, user) pool.
    pub pool: PoolConfig,
    /// Per-(database, user) overrides of `pool`.
    pub pools: Vec<PoolOverride>,
    /// Where each database a client names lives (`databases:`; empty: every database on
    /// `backend.url`'s server, by its own name).
    pub databases: Vec<DatabaseEntry>,
    pub auth: AuthConfig,
    pub limits: LimitsConfig,
    pub callers: Vec<CallerConfig>,
    pub global_defaults: GlobalDefaults,
    pub classify: ClassifyConfig,
    /// Culprit detection over the statistics (`config/detect.rs`).
    pub detector: DetectorConfig,
    /// Rules the detector may install.
    pub auto_rules: AutoRulesConfig,
    pub log: LogConfig,
    /// TLS toward clients.
    pub tls: TlsConfig,
    /// Several instances acting as one through Redis (rules, fleet-wide limits, membership,
    /// cancel routing). Absent: no Redis is used. Read at start only.
    pub fleet: Option<FleetConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 6432)),
            listen_reuseport: false,
            unix_socket_dir: None,
            unix_socket_mode: "0777".to_owned(),
            peer_id: 0,
            peers: Vec::new(),
            peer_listen: None,
            worker_threads: 0,
            admin: AdminConfig::default(),
            backend: BackendConfig::default(),
            pool: PoolConfig::default(),
            pools: Vec::new(),
            databases: Vec::new(),
            auth: AuthConfig::default(),
            limits: LimitsConfig::default(),
            callers: Vec::new(),
            global_defaults: GlobalDefaults::default(),
            classify: ClassifyConfig::default(),
            detector: DetectorConfig::default(),
            auto_rules: AutoRulesConfig::default(),
            log: LogConfig::default(),
            tls: TlsConfig::default(),
            fleet: None,
        }
    }
}

/// `fleet:` — coordination of several instances through Redis.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// `redis://[:PASSWORD@]HOST:PORT[/DB]` (or `redis+unix:///path`).
    pub redis_url: String,
    /// This instance's name among the members (letters, digits, `.`, `_`, `-`, `:`; at most
    /// 64). Default: `HOSTNAME-PID`.
    #[serde(default)]
    pub instance_id: Option<String>,
    /// How often membership is renewed; a member missing 3 heartbeats is gone.
    #[serde(default = "FleetConfig::default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// Prefix of every Redis key and channel, so fleets can share a Redis.
    #[serde(default = "FleetConfig::default_key_prefix")]
    pub key_prefix: String,
    /// `host:port` where the other members send CancelRequests for keys this instance
    /// issued: default `peer_listen`, else `listen` (when not shared). Needs `peer_id`.
    #[serde(default)]
    pub cancel_addr: Option<String>,
}

impl FleetConfig {
    fn default_heartbeat_ms() -> u64 {
        1000
    }

    fn default_key_prefix() -> String {
        "pgsluice".to_owned()
    }
}

/// Another pgsluice instance, for cancel routing.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// Its `peer_id`.
    pub id: u8,
    /// `host:port` that reaches that instance alone: its `peer_listen`, or its client listener
    /// when that is not shared (never the shared port, which could lead back to any instance).
    pub addr: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    pub write_token: Option<String>,
    pub read_token: Option<String>,
    /// Serve stats and /metrics without a token.
    pub open_reads: bool,
    /// Where runtime rules are persisted.
    pub rules_file: Option<String>,
    /// Host names the API answers to besides IP literals and `localhost` (`*.domain` for
    /// subdomains, `*` for any): a browser tricked by DNS rebinding names another host.
    pub allowed_hosts: Vec<String>,
    /// PgBouncer's admin console over the Postgres protocol, on the client listener.
    pub console: ConsoleConfig,
}

/// `admin.console`: virtual databases on the client listener where `SHOW POOLS`, `PAUSE`
/// and the rest of PgBouncer's console commands are answered by the proxy itself. Off until
/// some user is named: a console nobody may use is no console, and a config written before
/// it existed keeps sending a database called `pgsluice` to Postgres.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleConfig {
    /// The database names that reach the console (PgBouncer tools connect to `pgbouncer`).
    pub databases: Vec<String>,
    /// Users who may run every console command (PgBouncer's `admin_users`).
    pub admin_users: Vec<String>,
    /// Users who may run `SHOW …` only (PgBouncer's `stats_users`).
    pub stats_users: Vec<String>,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        ConsoleConfig {
            databases: vec!["pgsluice".into()],
            admin_users: Vec::new(),
            stats_users: Vec::new(),
        }
    }
}

/// What a console user may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsoleRole {
    /// `SHOW …` only.
    Stats,
    /// Every command.
    Admin,
}

impl ConsoleConfig {
    /// Whether the console is on (some user may use it).
    pub fn enabled(&self) -> bool {
        !self.admin_users.is_empty() || !self.stats_users.is_empty()
    }

    /// Whether a client of `database` reaches the console rather than Postgres.
    pub fn serves(&self, database: &str) -> bool {
        self.enabled() && self.databases.iter().any(|d| d == database)
    }

    /// What `user` may do on the console (`None`: nothing); an admin user listed in both
    /// lists is an admin.
    pub fn role(&self, user: &str) -> Option<ConsoleRole> {
        if self.admin_users.iter().any(|u| u == user) {
            Some(ConsoleRole::Admin)
        } else if self.stats_users.iter().any(|u| u == user) {
            Some(ConsoleRole::Stats)
        } else {
            None
        }
    }
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 9930)),
            write_token: None,
            read_token: None,
            open_reads: false,
            rules_file: None,
            allowed_hosts: Vec::new(),
            console: ConsoleConfig::default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BackendConfig {
    /// `postgres://USER:PASSWORD@HOST:PORT/DB`; its user may log in with its password.
    pub url: Option<String>,
    /// A file holding the password of `url`'s user (one trailing newline ignored); wins over
    /// the URL's password, so the secret need not be in the config or on a command line.
    /// Read at start and on every reload.
    pub password_file: Option<String>,
    /// The password [`Config::apply`] read from `--backend-password-file`,
    /// `PGSLUICE_BACKEND_PASSWORD` or `password_file`; [`Config::backend_url`] puts it in
    /// place of the URL's. Never part of the file.
    #[serde(skip)]
    pub password: Option<Secret>,
    pub host: String,
    pub port: u16,
    pub connect_timeout_ms: u64,
    /// TCP_USER_TIMEOUT on server sockets (Linux): sent data unacknowledged this long, or
    /// keepalive probes unanswered this long, close the connection. 0 leaves the kernel's
    /// default (off), as libpq and PgBouncer do.
    pub tcp_user_timeout_ms: u64,
    /// TLS toward Postgres (libpq's `sslmode` values; `gssenc` is never used).
    pub tls: BackendTlsMode,
    /// PEM roots for `verify-ca`/`verify-full` (required by both).
    pub root_cert_file: Option<String>,
    /// The authentication methods the server may ask for (libpq's `require_auth`); unset:
    /// see [`BackendConfig::allowed_auth`].
    pub require_auth: Option<Vec<BackendAuthMethod>>,
}

impl Default for BackendConfig {
    fn default() -> Self {
        BackendConfig {
            url: None,
            password_file: None,
            password: None,
            host: "127.0.0.1".into(),
            port: 5432,
            connect_timeout_ms: 5_000,
            tcp_user_timeout_ms: 0,
            tls: BackendTlsMode::Prefer,
            root_cert_file: None,
            require_auth: None,
        }
    }
}

impl BackendConfig {
    /// Whether the server must show a certificate chained to `root_cert_file`.
    pub fn tls_verified(&self) -> bool {
        matches!(
            self.tls,
            BackendTlsMode::VerifyCa | BackendTlsMode::VerifyFull
        )
    }

    /// The methods the server may ask for: `require_auth` when set; else SCRAM-SHA-256 alone
    /// while the server is not verified (`disable`, `prefer`, `require`), because only SCRAM
    /// makes the server prove it knows the password and never gives it, or anything replayable,
    /// to whoever answers; any method once `verify-ca`/`verify-full` has checked the server.
    pub fn allowed_auth(&self) -> Vec<BackendAuthMethod> {
        match &self.require_auth {
            Some(list) => list.clone(),
            None if self.tls_verified() => BackendAuthMethod::ALL.to_vec(),
            None => vec![BackendAuthMethod::ScramSha256],
        }
    }

    /// `tcp_user_timeout_ms` as the socket option wants it (`None` = off).
    pub fn tcp_user_timeout(&self) -> Option<std::time::Duration> {
        (self.tcp_user_timeout_ms > 0)
            .then(|| std::time::Duration::from_millis(self.tcp_user_timeout_ms))
    }
}

/// A secret string; `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: String) -> Secret {
        Secret(s)
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Longest backend password file read (far above any real password; a wrong path to a
/// large file fails instead of being read whole).
const MAX_PASSWORD_FILE_BYTES: u64 = 4096;

/// How the proxy speaks TLS to Postgres.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackendTlsMode {
    /// Never ask for TLS.
    Disable,
    /// Ask; use plaintext if the server says 'N'. Certificates are not checked.
    Prefer,
    /// TLS or no connection; certificates are not checked.
    Require,
    /// TLS with a certificate chain rooted in `root_cert_file`; any host name.
    VerifyCa,
    /// Like `verify-ca`, and the certificate must name the backend host.
    VerifyFull,
}

/// An authentication method Postgres may ask the proxy for, by libpq's `require_auth` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum BackendAuthMethod {
    #[serde(rename = "scram-sha-256")]
    ScramSha256,
    #[serde(rename = "md5")]
    Md5,
    /// The password in cleartext.
    #[serde(rename = "password")]
    Password,
    /// No authentication at all (pg_hba `trust`; libpq's `none`).
    #[serde(rename = "trust", alias = "none")]
    Trust,
}

impl BackendAuthMethod {
    pub const ALL: [BackendAuthMethod; 4] = [
        BackendAuthMethod::ScramSha256,
        BackendAuthMethod::Md5,
        BackendAuthMethod::Password,
        BackendAuthMethod::Trust,
    ];

    /// The name used in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            BackendAuthMethod::ScramSha256 => "scram-sha-256",
            BackendAuthMethod::Md5 => "md5",
            BackendAuthMethod::Password => "password",
            BackendAuthMethod::Trust => "trust",
        }
    }

    /// Whether the server learns the password, or something it can replay, from it.
    pub fn exposes_password(self) -> bool {
        matches!(self, BackendAuthMethod::Md5 | BackendAuthMethod::Password)
    }
}

/// How the proxy speaks TLS to clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ClientTlsMode {
    /// Answer 'N' to SSLRequest; refuse direct TLS.
    #[default]
    Disable,
    /// TLS for clients that ask (SSLRequest or direct TLS); plaintext still accepted.
    Allow,
    /// TLS for everyone: a plaintext StartupMessage is refused with 28000 before auth.
    Require,
}

/// Client-side TLS: certificate and key are read at start and on every reload.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    pub mode: ClientTlsMode,
    /// PEM certificate chain, leaf first.
    pub cert_file: Option<String>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolMode {
    Transaction,
    Session,
}

impl std::str::FromStr for PoolMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "transaction" => Ok(PoolMode::Transaction),
            "session" => Ok(PoolMode::Session),
            _ => Err(format!(
                "unknown pool mode `{s}` (expected transaction or session)"
            )),
        }
    }
}

/// What to do with session state (SET, LISTEN, advisory locks, …) in transaction mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SessionStateMode {
    /// Re-apply trackable `SET`s on every backend; pin the client for the rest.
    Track,
    /// Pin the client to its backend on any session state.
    Pin,
    /// Refuse session state with 0A000 ERR_SESSION_STATE.
    Reject,
}

/// What a transaction-mode pool does after a unit whose statements the parse could not prove
/// harmless (a user function, a write that fires a trigger, `DO`, …) before another client
/// gets the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum UnprovenMode {
    /// Ask Postgres (settings, identity, LISTEN, advisory locks, cursors, prepared
    /// statements, temporary objects), reset settings, sequences and the random seed, and
    /// reset fully only when the check finds more.
    #[default]
    Verify,
    /// `DISCARD ALL` (and a fresh random seed) after every such unit: more work for Postgres,
    /// nothing left to a check.
    Reset,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolConfig {
    pub mode: PoolMode,
    /// Backend connections per (database, user) pool.
    pub size: usize,
    pub min_idle: usize,
    pub idle_timeout_ms: u64,
    /// Connections are closed on release after this age, minus up to 10% jitter (never later).
    pub max_lifetime_ms: u64,
    /// How long a client waits for a backend before 53300 (capped by its caller's
    /// `queue_timeout_ms`).
    pub checkout_timeout_ms: u64,
    /// Backends only critical callers may take (the last free ones), so lower priorities can
    /// never hold the whole pool while critical work waits. Unset: a tenth of `size` (at
    /// least 1) in pools of 4 or more when some caller is `critical`, else none, growing with
    /// critical work's recent peak (`pool::slots`); set, exactly that. At most `size - 1`.
    pub critical_reserve: Option<usize>,
    /// `critical_reserve` was set by the operator (filled in by [`Config::pool_for`]): the
    /// reserve stays as set instead of growing with critical work's peak.
    #[serde(skip)]
    pub critical_reserve_fixed: bool,
    /// The adaptive concurrency limit: non-critical priorities may hold fewer backends while
    /// the database's measured load is above `adaptive_target_percent` (lowest priority cut
    /// first). Unset: on when some caller has a priority other than `normal`.
    pub adaptive: Option<bool>,
    /// The adaptive limit's lowest value.
    pub adaptive_floor: usize,
    /// Load (the breaker probe's reading, percent) above which the adaptive limit falls.
    pub adaptive_target_percent: f64,
    /// Clients waiting for a backend at once; beyond it a checkout is refused at once with
    /// 53300 `ERR_QUEUE_FULL` (critical callers are never refused by it).
    pub max_waiting: usize,
    /// A connection idle longer than this is health-checked before reuse.
    pub health_check_after_ms: u64,
    /// Concurrent connection attempts per pool.
    pub max_connect_attempts: usize,
    pub connect_backoff_base_ms: u64,
    pub connect_backoff_cap_ms: u64,
    pub session_state: SessionStateMode,
    /// After a unit the parse could not prove harmless: check the session, or reset it.
    pub unproven: UnprovenMode,
    /// Protocol-level prepared statements kept per backend connection (LRU).
    pub prepared_cache_size: usize,
    /// Bytes of statement text those may hold per backend connection (LRU beyond it).
    pub prepared_cache_bytes: usize,
    /// After the statement backstop's cancel, how long a server that sends nothing may stay
    /// silent before its connection is closed and the client gets 08006 (a partition or a hung
    /// host would otherwise hold the client and the pool slot forever).
    pub cancel_grace_ms: u64,
    /// Backend connections to one database across all its users' pools (0: no limit). Read
    /// from the `pool` section only (a per-pool override would not be shared).
    pub max_db_connections: usize,
    /// Backend connections as one user across all databases (0: no limit). `pool` only.
    pub max_user_connections: usize,
    /// Among waiters of one priority, a free backend goes to the caller that held the least
    /// backend time lately (per its `weight`), not to the longest waiting. `pool` only.
    pub fair_shares: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            mode: PoolMode::Transaction,
            size: 20,
            min_idle: 0,
            idle_timeout_ms: 600_000,
            max_lifetime_ms: 3_600_000,
            checkout_timeout_ms: 2_000,
            critical_reserve: None,
            critical_reserve_fixed: false,
            adaptive: None,
            adaptive_floor: 2,
            adaptive_target_percent: 50.0,
            max_waiting: 2_000,
            health_check_after_ms: 30_000,
            max_connect_attempts: 4,
            connect_backoff_base_ms: 100,
            connect_backoff_cap_ms: 5_000,
            session_state: SessionStateMode::Track,
            unproven: UnprovenMode::Verify,
            prepared_cache_size: 1_000,
            prepared_cache_bytes: 8 << 20,
            cancel_grace_ms: 2_000,
            max_db_connections: 0,
            max_user_connections: 0,
            fair_shares: false,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolOverride {
    pub database: String,
    pub user: String,
    pub mode: Option<PoolMode>,
    pub size: Option<usize>,
    pub min_idle: Option<usize>,
    pub session_state: Option<SessionStateMode>,
    pub unproven: Option<UnprovenMode>,
}

/// One `databases:` entry: the name clients use, and where and as whom its pools connect.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseEntry {
    /// The database name clients connect to; `*` matches every name without an entry.
    pub name: String,
    /// `postgres://[USER[:PASSWORD]@]HOST[:PORT][,HOST…][/DBNAME][?PARAMS]`, read as
    /// `backend.url` is. Without a user, pools log in as the client's user (its password
    /// from `auth.users`); with one, every client of this database logs in to Postgres as
    /// that user. Without a database name: the entry's name (`*`: the client's).
    pub url: String,
    /// A file holding the URL user's password (one trailing newline ignored), in place of
    /// the URL's; re-read on reload.
    pub password_file: Option<String>,
    /// Backend connections per pool of this database (else `pool.size` / `pools[]`).
    pub pool_size: Option<usize>,
    /// Pool mode of this database's pools (else `pool.mode` / `pools[]`).
    pub pool_mode: Option<PoolMode>,
    /// Backend connections to this database across its users (else
    /// `pool.max_db_connections`; 0: no limit).
    pub max_db_connections: Option<usize>,
    /// Standbys of this database, as URLs (several hosts each, tried in order): reads of
    /// `route: replica` callers outside explicit transactions run there.
    #[serde(default)]
    pub replicas: Vec<String>,
    /// A replica whose replay lags more than this is skipped (0: never skipped for lag).
    #[serde(default = "default_replica_lag_ms")]
    pub max_replica_lag_ms: u64,
    /// What such a read does when no replica qualifies.
    #[serde(default)]
    pub replica_fallback: ReplicaFallback,
    /// The password read from `password_file` by [`Config::apply`]. Never part of the file.
    #[serde(skip)]
    pub password: Option<Secret>,
}

fn default_replica_lag_ms() -> u64 {
    5_000
}

impl DatabaseEntry {
    /// The replicas' URLs, parsed, as one host list (validated at load).
    pub fn replica_target(&self) -> Option<BackendUrl> {
        let mut urls = self
            .replicas
            .iter()
            .filter_map(|u| BackendUrl::parse_entry(u).ok());
        let mut first = urls.next()?;
        for u in urls {
            first.hosts.extend(u.hosts);
        }
        if let Some(p) = &self.password {
            first.password.get_or_insert_with(|| p.expose().to_owned());
        }
        Some(first)
    }

    /// The entry's URL, parsed (validated at load, so `None` only for a config that was not).
    pub fn target(&self) -> Option<BackendUrl> {
        let mut u = BackendUrl::parse_entry(&self.url).ok()?;
        if let Some(p) = &self.password {
            u.password = Some(p.expose().to_owned());
        }
        Some(u)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum AuthMethod {
    #[serde(rename = "scram-sha-256")]
    ScramSha256,
    #[serde(rename = "md5")]
    Md5,
    #[serde(rename = "trust")]
    Trust,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Client authentication method for users that do not set their own.
    pub method: AuthMethod,
    pub users: Vec<UserConfig>,
    /// Users not in `users` are looked up in Postgres through this query (PgBouncer's
    /// `auth_query`).
    pub auth_query: Option<AuthQueryConfig>,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            method: AuthMethod::ScramSha256,
            users: Vec::new(),
            auth_query: None,
        }
    }
}

/// `auth.auth_query`: where the SCRAM verifier of a user the config does not list is read.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthQueryConfig {
    /// The user the lookups log in as (it needs to read `pg_shadow`, or to run a `SECURITY
    /// DEFINER` function that does).
    pub user: String,
    pub password: Option<String>,
    pub password_file: Option<String>,
    pub password_env: Option<String>,
    /// `$1` is the user name (passed as a quoted literal); the last column of the first row
    /// is the verifier.
    pub query: String,
    /// The database the lookups run in.
    pub database: String,
    /// How long an answer is reused.
    pub cache_ttl_ms: u64,
    /// How long "no such user" is reused (short: a new role becomes usable soon, a flood of
    /// unknown names does not reach Postgres at its rate).
    pub negative_ttl_ms: u64,
}

impl Default for AuthQueryConfig {
    fn default() -> Self {
        AuthQueryConfig {
            user: String::new(),
            password: None,
            password_file: None,
            password_env: None,
            query: "SELECT usename, passwd FROM pg_catalog.pg_shadow WHERE usename = $1".into(),
            database: "postgres".into(),
            cache_ttl_ms: 60_000,
            negative_ttl_ms: 5_000,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserConfig {
    pub name: String,
    /// Used both to check the client and to log in to Postgres as this user. May be a
    /// SCRAM-SHA-256 verifier (`SCRAM-SHA-256$4096:…`, as `pg_authid.rolpassword` holds it)
    /// instead: then the proxy logs in to Postgres with the key the client proved
    /// (SCRAM pass-through; Postgres must hold the same verifier).
    pub password: Option<String>,
    /// The password (or verifier) from a file, one trailing newline ignored; re-read on
    /// reload.
    pub password_file: Option<String>,
    /// The password (or verifier) from this environment variable, read at start and on
    /// reload.
    pub password_env: Option<String>,
    pub method: Option<AuthMethod>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    pub max_client_conn: usize,
    /// Time a client has to finish startup and authentication.
    pub handshake_timeout_ms: u64,
    /// In-flight handshakes before new connections are refused.
    pub max_handshakes: usize,
    /// In-flight handshakes from one source address (IPv6: one /64) before its new
    /// connections are refused, so one host cannot hold every handshake slot.
    pub max_handshakes_per_address: usize,
    /// CancelRequests from one source address talking to Postgres or a peer at once; more
    /// are dropped, so one host cannot hold the process-wide cancel slots.
    pub max_cancels_per_address: usize,
    /// Graceful shutdown: how long in-flight transactions may run after SIGTERM.
    pub shutdown_timeout_ms: u64,
    /// A client write that makes no progress for this long ends the session (slow reader).
    pub client_write_timeout_ms: u64,
    /// Largest Query/Parse/Bind/FunctionCall message a client may send (CopyData is
    /// streamed and not bounded by it); larger ones get 54000 and are skipped unread.
    pub max_message_bytes: usize,
    /// Named prepared statements one client may hold at once (54000 beyond).
    pub max_client_statements: usize,
    /// Bytes of text (SQL and parameter types) those may hold together (54000 beyond).
    pub max_client_statement_bytes: usize,
    /// (database, user) pools; pools without clients or connections are removed.
    pub max_pools: usize,
    /// A client idle between transactions (nothing in flight, no transaction open) longer
    /// than this is disconnected with FATAL 57P05, as Postgres' `idle_session_timeout` and
    /// PgBouncer's `client_idle_timeout` do. 0 = off.
    pub client_idle_timeout_ms: u64,
    /// TCP keepalive on client sockets: idle time before the first probe (then every 10 s;
    /// the kernel's probe count). A vanished client host is found and its session ends.
    /// 0 = off. Read at start.
    pub client_tcp_keepalive_ms: u64,
    /// A non-critical login waits after its authentication exchange, before it is told it
    /// is in, while its pool's or its caller's queue is crowded (`App::door`).
    pub hold_logins: bool,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_client_conn: 10_000,
            handshake_timeout_ms: 10_000,
            max_handshakes: 4096,
            max_handshakes_per_address: 512,
            max_cancels_per_address: 32,
            shutdown_timeout_ms: 30_000,
            client_write_timeout_ms: 30_000,
            max_message_bytes: 16 << 20,
            max_client_statements: 10_000,
            max_client_statement_bytes: 16 << 20,
            client_idle_timeout_ms: 0,
            max_pools: 1_000,
            client_tcp_keepalive_ms: 60_000,
            hold_logins: true,
        }
    }
}

/// A caller's priority and whether its limits are this instance's or the fleet's: the
/// policy's own types, read from the file as they are.
pub use crate::policy::{Priority, Scope};

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct CallerMatch {
    #[serde(default)]
    pub tag: BTreeMap<String, String>,
    pub application_name: Option<String>,
    pub user: Option<String>,
    pub client_cidr: Option<String>,
}

/// Per-statement-kind timeouts in milliseconds, or one number for every kind.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum KindTimeouts {
    All(u64),
    PerKind(PerKindTimeouts),
}

/// `{ read, write, ddl, other }`; a misspelt kind is an error, not a timeout that never applies.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PerKindTimeouts {
    #[serde(default)]
    pub read: Option<u64>,
    #[serde(default)]
    pub write: Option<u64>,
    #[serde(default)]
    pub ddl: Option<u64>,
    #[serde(default)]
    pub other: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallerConfig {
    pub name: String,
    #[serde(rename = "match", default)]
    pub matcher: CallerMatch,
    pub max_concurrency: Option<u32>,
    pub queue_depth: Option<u32>,
    pub queue_timeout_ms: Option<u64>,
    #[serde(default)]
    pub priority: Priority,
    pub max_qps: Option<f64>,
    pub burst: Option<u32>,
    pub statement_timeout_ms: Option<KindTimeouts>,
    pub lock_timeout_ms: Option<u64>,
    /// A client of this caller idle inside a transaction this long is disconnected with
    /// FATAL 25P03 and its transaction rolled back (default: `global_defaults`'; 0 = off).
    pub idle_transaction_timeout_ms: Option<u64>,
    /// Retry hints of this caller's refusals (default: `global_defaults`').
    pub retry_base_ms: Option<u64>,
    pub retry_cap_ms: Option<u64>,
    pub retry_floor_ms: Option<u64>,
    /// `fleet`: `max_qps` and `max_concurrency` hold across the fleet (needs `fleet`).
    #[serde(default)]
    pub scope: Scope,
    /// `replica`: this caller's reads outside an explicit transaction go to its database's
    /// replicas (`databases[].replicas`).
    #[serde(default)]
    pub route: ReadRoute,
    /// Read-your-writes for this caller's routed reads after a write of its client. Unset:
    /// they wait for a replica that has replayed the write's WAL position (read on the
    /// primary after the write); `N`: they stay on the primary for `N` ms after the write
    /// instead (no position is read); `0`: they go to the replicas at once.
    pub read_your_writes_ms: Option<u64>,
    /// Its claim on backend time among the callers of its priority in pools with
    /// `pool.fair_shares` (1..=1000; default 1).
    pub weight: Option<u32>,
    /// Most of a pool's backend time (over a window of about 15 s) this caller may hold,
    /// 0 < share ≤ 1; beyond it its checkouts wait. Needs `pool.fair_shares`.
    pub db_time_share: Option<f64>,
}

/// Where a caller's reads go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReadRoute {
    #[default]
    Primary,
    Replica,
}

/// What a `route: replica` read does when no replica qualifies (down, or lagging).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReplicaFallback {
    /// Run on the primary.
    #[default]
    Primary,
    /// Refuse with 53400 and a retry hint.
    Refuse,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GlobalDefaults {
    pub max_concurrency: u32,
    pub queue_depth: u32,
    pub queue_timeout_ms: u64,
    pub statement_timeout_ms: Option<KindTimeouts>,
    pub lock_timeout_ms: Option<u64>,
    /// A client idle inside a transaction this long holds a backend (and its locks) for
    /// nothing: it is disconnected with FATAL 25P03 and the transaction rolled back. Unset:
    /// off.
    pub idle_transaction_timeout_ms: Option<u64>,
    /// Retry hints (`retry_after_ms`) of refusals: `max(limit's floor, retry_floor_ms) +
    /// random(0, min(retry_cap_ms, retry_base_ms · 2^k))`, `k` the refusals in the burst.
    /// Callers may set their own; connection-level refusals use these.
    pub retry_base_ms: u64,
    pub retry_cap_ms: u64,
    pub retry_floor_ms: u64,
    pub circuit_breaker: BreakerConfig,
}

impl Default for GlobalDefaults {
    fn default() -> Self {
        GlobalDefaults {
            // Without configured limits pgsluice is a plain pooler: the pool's checkout
            // timeout is what bounds waiting.
            max_concurrency: 10_000,
            queue_depth: 10_000,
            queue_timeout_ms: 2_000,
            statement_timeout_ms: None,
            lock_timeout_ms: None,
            idle_transaction_timeout_ms: None,
            retry_base_ms: 50,
            retry_cap_ms: 5_000,
            retry_floor_ms: 0,
            circuit_breaker: BreakerConfig::default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// While more statements than this are in flight proxy-wide, non-critical ones are shed
    /// (critical ones up to `critical_reserve` more); the breaker does not open for it.
    pub max_inflight_threshold: Option<u32>,
    /// Open when the probe reads at or above this: `probe_sql`'s number, or without it the
    /// built-in database-load estimate in percent (see `probe.rs`).
    pub db_cpu_threshold_percent: Option<f64>,
    pub probe_sql: Option<String>,
    pub probe_interval_ms: u64,
    pub consecutive_errors: u32,
    pub open_ms: u64,
    /// Half-open: non-critical trial statements at once, and the successes that close it.
    pub half_open_trials: u32,
    /// Critical statements admitted at once while the breaker is open or half-open.
    /// Unset: the sum of the critical callers' own `max_concurrency`, at least 20 (so a
    /// critical caller's statements all fit while the breaker is open).
    pub critical_reserve: Option<u32>,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            max_inflight_threshold: None,
            db_cpu_threshold_percent: None,
            probe_sql: None,
            probe_interval_ms: 1_000,
            consecutive_errors: 5,
            open_ms: 5_000,
            half_open_trials: 1,
            critical_reserve: None,
        }
    }
}

/// Statement classification (fingerprint, kind, tags, session effects).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClassifyConfig {
    /// Off: no fingerprints, tags or session-state handling (for A/B measurements only).
    pub enabled: bool,
    /// Distinct statement texts kept in the classification cache.
    pub cache_entries: usize,
    /// Texts longer than this are read by the cheaper byte scanner.
    pub max_text_bytes: usize,
    /// Fingerprints kept with full statistics (the rest are aggregated as "other").
    pub stats_capacity: usize,
}

impl Default for ClassifyConfig {
    fn default() -> Self {
        ClassifyConfig {
            enabled: true,
            cache_entries: 10_000,
            max_text_bytes: 64 * 1024,
            stats_capacity: 1_000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    pub format: LogFormat,
    /// tracing EnvFilter directive; RUST_LOG wins when set.
    pub level: String,
    /// Log logins, failed logins and logouts (INFO, target `pgsluice::connections`).
    pub connections: bool,
    /// Log refused statements (INFO, target `pgsluice::refusals`).
    pub refusals: bool,
    /// Most lines a second of each of those two kinds; the next line written counts the
    /// ones left out.
    pub max_lines_per_second: u32,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Human,
            level: "info".into(),
            connections: false,
            refusals: true,
            max_lines_per_second: 20,
        }
    }
}

/// Command-line (and environment) values that override the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub listen: Option<SocketAddr>,
    pub unix_socket_dir: Option<PathBuf>,
    pub admin_listen: Option<SocketAddr>,
    pub backend: Option<String>,
    /// `--backend-password-file`: wins over the two below and the URL's password.
    pub backend_password_file: Option<PathBuf>,
    /// `PGSLUICE_BACKEND_PASSWORD`: wins over `backend.password_file` and the URL's password.
    pub backend_password: Option<Secret>,
    pub pool_size: Option<usize>,
    pub pool_mode: Option<PoolMode>,
    pub worker_threads: Option<usize>,
}

/// A password file's text without one trailing newline (`\n` or `\r\n`). Errors name the
/// path, never the content.
fn read_password_file(path: &Path) -> Result<Secret, String> {
    let shown = path.display();
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| {
            f.take(MAX_PASSWORD_FILE_BYTES + 1)
                .read_to_string(&mut text)
        })
        .map_err(|e| format!("cannot read the password file {shown}: {e}"))?;
    if text.len() as u64 > MAX_PASSWORD_FILE_BYTES {
        return Err(format!(
            "the password file {shown} is longer than {MAX_PASSWORD_FILE_BYTES} bytes"
        ));
    }
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    Ok(Secret::new(text))
}

impl Config {
    /// `unix_socket_mode` as permission bits (validated: octal, at most `0777`).
    pub fn unix_socket_mode_bits(&self) -> Option<u32> {
        let digits = self.unix_socket_mode.trim_start_matches("0o");
        u32::from_str_radix(digits, 8).ok().filter(|m| *m <= 0o777)
    }

    /// Parses YAML text; `Err` lists every problem found, each naming field and line.
    pub fn from_yaml(text: &str) -> Result<Config, Vec<ConfigError>> {
        let cfg: Config = if text.trim().is_empty() {
            Config::default()
        } else {
            serde_yaml::from_str(text).map_err(|e| vec![ConfigError::from_yaml(&e)])?
        };
        cfg.validate(Some(text))?;
        Ok(cfg)
    }

    /// Reads and parses a file (errors carry the path).
    pub fn load(path: &Path) -> Result<Config, Vec<ConfigError>> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            vec![ConfigError::plain(format!(
                "cannot read {}: {e}",
                path.display()
            ))]
        })?;
        Config::from_yaml(&text)
    }

    /// Applies command-line overrides, then validates again.
    pub fn apply(mut self, o: &Overrides) -> Result<Config, Vec<ConfigError>> {
        if let Some(l) = o.listen {
            self.listen = l;
        }
        if let Some(d) = &o.unix_socket_dir {
            self.unix_socket_dir = Some(d.clone());
        }
        if let Some(l) = o.admin_listen {
            self.admin.listen = l;
        }
        if let Some(b) = &o.backend {
            self.backend.url = Some(b.clone());
        }
        if let Some(n) = o.pool_size {
            self.pool.size = n;
        }
        if let Some(m) = o.pool_mode {
            self.pool.mode = m;
        }
        if let Some(n) = o.worker_threads {
            self.worker_threads = n;
        }
        let password = self.backend_password(o);
        let mut errs = self.validate(None).err().unwrap_or_default();
        for (i, u) in self.auth.users.iter_mut().enumerate() {
            let at = |k: &str| format!("auth.users[{i}].{k}");
            let read = match (&u.password_file, &u.password_env) {
                (Some(path), _) => {
                    Some(read_password_file(Path::new(path)).map_err(|m| (at("password_file"), m)))
                }
                (None, Some(var)) => Some(std::env::var(var).map(Secret::new).map_err(|_| {
                    (
                        at("password_env"),
                        format!("{var} is not set (or not UTF-8)"),
                    )
                })),
                (None, None) => None,
            };
            match read {
                Some(Ok(p)) if !p.expose().is_empty() => u.password = Some(p.expose().to_owned()),
                Some(Ok(_)) => errs.push(ConfigError {
                    field: at("password"),
                    line: None,
                    message: "the password is empty".into(),
                }),
                Some(Err((field, message))) => errs.push(ConfigError {
                    field,
                    line: None,
                    message,
                }),
                None => {}
            }
        }
        if let Some(q) = self.auth.auth_query.as_mut() {
            let read =
                match (&q.password_file, &q.password_env) {
                    (Some(path), _) => Some(
                        read_password_file(Path::new(path))
                            .map_err(|m| ("auth.auth_query.password_file", m)),
                    ),
                    (None, Some(var)) => Some(std::env::var(var).map(Secret::new).map_err(|_| {
                        ("auth.auth_query.password_env", format!("{var} is not set"))
                    })),
                    (None, None) => None,
                };
            match read {
                Some(Ok(p)) => q.password = Some(p.expose().to_owned()),
                Some(Err((field, message))) => errs.push(ConfigError {
                    field: field.into(),
                    line: None,
                    message,
                }),
                None => {}
            }
        }
        for (i, d) in self.databases.iter_mut().enumerate() {
            if let Some(path) = &d.password_file {
                match read_password_file(Path::new(path)) {
                    Ok(p) if !p.expose().is_empty() => d.password = Some(p),
                    Ok(_) => errs.push(ConfigError {
                        field: format!("databases[{i}].password_file"),
                        line: None,
                        message: "the password is empty".into(),
                    }),
                    Err(m) => errs.push(ConfigError {
                        field: format!("databases[{i}].password_file"),
                        line: None,
                        message: m,
                    }),
                }
            }
        }
        // The URL's sslmode is the backend TLS mode, unless backend.tls says otherwise.
        if let Some(mode) = self.backend_url().and_then(|u| u.sslmode) {
            if self.backend.tls == BackendTlsMode::Prefer || self.backend.tls == mode {
                self.backend.tls = mode;
            } else {
                errs.push(ConfigError {
                    field: "backend.url".into(),
                    line: None,
                    message: format!(
                        "its sslmode ({mode:?}) conflicts with backend.tls ({:?}): give one",
                        self.backend.tls
                    ),
                });
            }
        }
        // Postgres speaks no TLS on its Unix sockets: a mode that demands TLS cannot be met.
        if !matches!(
            self.backend.tls,
            BackendTlsMode::Disable | BackendTlsMode::Prefer
        ) && let Some(dir) = self.socket_hosts().next()
        {
            errs.push(ConfigError {
                field: "backend.tls".into(),
                line: None,
                message: format!(
                    "{:?} demands TLS, which Postgres does not speak on the Unix-domain socket \
                     in {dir}: use disable or prefer, or a TCP host",
                    self.backend.tls
                ),
            });
        }
        let b = &self.global_defaults.circuit_breaker;
        if self.backend.url.is_none() {
            for (key, set) in [
                (
                    "db_cpu_threshold_percent",
                    b.db_cpu_threshold_percent.is_some(),
                ),
                ("probe_sql", b.probe_sql.is_some()),
            ] {
                if set {
                    errs.push(ConfigError {
                        field: format!("global_defaults.circuit_breaker.{key}"),
                        line: None,
                        message: "its probe logs in as backend.url's user: set backend.url \
                                  (or --backend), or the breaker would never read the load"
                            .into(),
                    });
                }
            }
        }
        match password {
            Ok(p) => self.backend.password = p,
            Err(e) => errs.push(e),
        }
        if errs.is_empty() { Ok(self) } else { Err(errs) }
    }

    /// The backend password from the first source set: `--backend-password-file`,
    /// `PGSLUICE_BACKEND_PASSWORD`, `backend.password_file` (`None`: the URL's, if any).
    /// Errors name the source and, for files, the path; never the password.
    fn backend_password(&self, o: &Overrides) -> Result<Option<Secret>, ConfigError> {
        let error = |field: &str, message: String| ConfigError {
            field: field.to_owned(),
            line: None,
            message,
        };
        let (field, secret) = if let Some(path) = &o.backend_password_file {
            let field = "--backend-password-file";
            (
                field,
                read_password_file(path).map_err(|m| error(field, m))?,
            )
        } else if let Some(s) = &o.backend_password {
            ("PGSLUICE_BACKEND_PASSWORD", s.clone())
        } else if let Some(path) = &self.backend.password_file {
            let field = "backend.password_file";
            let secret = read_password_file(Path::new(path)).map_err(|m| error(field, m))?;
            (field, secret)
        } else {
            return Ok(None);
        };
        if self.backend.url.is_none() {
            return Err(error(
                field,
                "needs backend.url (or --backend): the password is for its user".into(),
            ));
        }
        if secret.expose().is_empty() {
            return Err(error(field, "the password is empty".into()));
        }
        Ok(Some(secret))
    }

    /// Runtime threads to start: `worker_threads`, or for 0 the automatic choice (1 with at
    /// most 2 CPUs, else one per CPU).
    pub fn runtime_threads(&self, cpus: usize) -> usize {
        match self.worker_threads {
            0 if cpus <= 2 => 1,
            0 => cpus,
            n => n,
        }
    }

    /// Every server host that is a Unix-domain socket directory (backend, databases,
    /// replicas).
    fn socket_hosts(&self) -> impl Iterator<Item = String> + '_ {
        let primary = match self.backend_url() {
            Some(u) => u.hosts,
            None => vec![(self.backend.host.clone(), self.backend.port)],
        };
        let entries = self.databases.iter().flat_map(|d| {
            std::iter::once(&d.url)
                .chain(&d.replicas)
                .filter_map(|u| BackendUrl::parse_entry(u).ok())
                .flat_map(|u| u.hosts)
        });
        primary
            .into_iter()
            .chain(entries)
            .map(|(h, _)| h)
            .filter(|h| crate::addr::is_socket_dir(h))
    }

    /// The backend URL, parsed (validated on load, so `None` only when absent), with the
    /// password from a file or the environment in place of the URL's, if one was given.
    pub fn backend_url(&self) -> Option<BackendUrl> {
        let mut url = self
            .backend
            .url
            .as_deref()
            .and_then(|u| BackendUrl::parse(u).ok())?;
        if let Some(p) = &self.backend.password {
            url.password = Some(p.expose().to_owned());
        }
        Some(url)
    }

    /// Effective pool settings for one (database, user).
    pub fn pool_for(&self, database: &str, user: &str) -> PoolConfig {
        let mut p = self.pool.clone();
        // The database's entry first, then a `pools[]` entry of this (database, user).
        if let Some(d) = self.database_entry(database) {
            if let Some(s) = d.pool_size {
                p.size = s;
            }
            if let Some(m) = d.pool_mode {
                p.mode = m;
            }
            if let Some(n) = d.max_db_connections {
                p.max_db_connections = n;
            }
        }
        if let Some(o) = self
            .pools
            .iter()
            .find(|o| o.database == database && o.user == user)
        {
            if let Some(m) = o.mode {
                p.mode = m;
            }
            if let Some(s) = o.size {
                p.size = s;
            }
            if let Some(s) = o.min_idle {
                p.min_idle = s;
            }
            if let Some(u) = o.unproven {
                p.unproven = u;
            }
            if let Some(s) = o.session_state {
                p.session_state = s;
            }
        }
        let critical = self
            .callers
            .iter()
            .any(|c| c.priority == Priority::Critical);
        // A tenth of the pool, at least one backend — but not in pools under four, where one
        // backend would be a third or more of the pool kept idle.
        let auto = if critical && p.size >= 4 {
            (p.size / 10).max(1)
        } else {
            0
        };
        p.critical_reserve_fixed = p.critical_reserve.is_some();
        let reserve = p.critical_reserve.unwrap_or(auto);
        p.critical_reserve = Some(reserve.min(p.size.saturating_sub(1)));
        let prioritised = self.callers.iter().any(|c| c.priority != Priority::Normal);
        p.adaptive = Some(p.adaptive.unwrap_or(prioritised));
        p
    }

    /// The `databases:` entry a client's database name selects: its own, else `*`.
    pub fn database_entry(&self, database: &str) -> Option<&DatabaseEntry> {
        self.databases
            .iter()
            .find(|d| d.name == database)
            .or_else(|| self.databases.iter().find(|d| d.name == "*"))
    }

    /// Whether any pool this file describes runs the adaptive limit (so the load probe must
    /// run even without a breaker threshold).
    pub fn adaptive_wanted(&self) -> bool {
        let on = |d: &str, u: &str| self.pool_for(d, u).adaptive == Some(true);
        // A name no `pools:` entry uses stands for every pool without an override.
        on("\0", "\0") || self.pools.iter().any(|o| on(&o.database, &o.user))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_url(password_file: Option<&Path>) -> Config {
        let mut text = "backend:\n  url: \"postgres://app:from-url@db:5432/appdb\"\n".to_owned();
        if let Some(p) = password_file {
            text.push_str(&format!("  password_file: \"{}\"\n", p.display()));
        }
        Config::from_yaml(&text).unwrap()
    }

    fn password(c: &Config) -> Option<String> {
        c.backend_url().and_then(|u| u.password)
    }

    /// The critical reserve: unset, a tenth of the pool that may grow; set, fixed as set.
    #[test]
    fn an_operator_s_critical_reserve_is_fixed_and_the_default_grows() {
        let callers = "callers:\n  - { name: pay, priority: critical }\n";
        let auto = Config::from_yaml(&format!("pool:\n  size: 20\n{callers}")).unwrap();
        let p = auto.pool_for("d", "u");
        assert_eq!(
            (p.critical_reserve, p.critical_reserve_fixed),
            (Some(2), false)
        );
        let set = Config::from_yaml(&format!(
            "pool:\n  size: 20\n  critical_reserve: 3\n{callers}"
        ))
        .unwrap();
        let p = set.pool_for("d", "u");
        assert_eq!(
            (p.critical_reserve, p.critical_reserve_fixed),
            (Some(3), true)
        );
    }

    #[test]
    fn the_backend_password_comes_from_a_file_or_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let key_file = dir.path().join("key");
        std::fs::write(&key_file, "from-key-file\n").unwrap();
        let flag_file = dir.path().join("flag");
        std::fs::write(&flag_file, "from-flag-file\r\n").unwrap();
        let env = Some(Secret::new("from-env".into()));

        let plain = with_url(None).apply(&Overrides::default()).unwrap();
        assert_eq!(password(&plain).as_deref(), Some("from-url"));
        let keyed = with_url(Some(&key_file));
        let c = keyed.clone().apply(&Overrides::default()).unwrap();
        assert_eq!(password(&c).as_deref(), Some("from-key-file"));
        let o = Overrides {
            backend_password: env.clone(),
            ..Overrides::default()
        };
        let c = keyed.clone().apply(&o).unwrap();
        assert_eq!(password(&c).as_deref(), Some("from-env"));
        let o = Overrides {
            backend_password: env,
            backend_password_file: Some(flag_file.clone()),
            ..Overrides::default()
        };
        let c = keyed.apply(&o).unwrap();
        assert_eq!(password(&c).as_deref(), Some("from-flag-file"));
        // The URL without a password gets one; the user and host stay.
        let o = Overrides {
            backend: Some("postgres://app@db:5432/appdb".into()),
            backend_password_file: Some(flag_file),
            ..Overrides::default()
        };
        let c = Config::default().apply(&o).unwrap();
        let u = c.backend_url().unwrap();
        assert_eq!(
            (u.user.as_str(), u.password.as_deref()),
            ("app", Some("from-flag-file"))
        );
        assert!(!format!("{c:?}").contains("from-flag-file"));
    }

    #[test]
    fn password_file_errors_name_the_path_never_the_content() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing");
        let errs = with_url(Some(&missing))
            .apply(&Overrides::default())
            .unwrap_err();
        assert_eq!(errs[0].field, "backend.password_file");
        assert!(
            errs[0].message.contains(&missing.display().to_string()),
            "{}",
            errs[0]
        );
        let long = dir.path().join("long");
        std::fs::write(&long, "x".repeat(5000)).unwrap();
        let o = Overrides {
            backend_password_file: Some(long),
            ..Overrides::default()
        };
        let errs = with_url(None).apply(&o).unwrap_err();
        assert_eq!(errs[0].field, "--backend-password-file");
        assert!(!errs[0].message.contains("xxxx"), "{}", errs[0]);
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").unwrap();
        let errs = with_url(Some(&empty))
            .apply(&Overrides::default())
            .unwrap_err();
        assert!(errs[0].message.contains("empty"), "{}", errs[0]);
        // A password with no URL whose user it belongs to is a mistake.
        let o = Overrides {
            backend_password: Some(Secret::new("lonely".into())),
            ..Overrides::default()
        };
        let errs = Config::default().apply(&o).unwrap_err();
        assert_eq!(errs[0].field, "PGSLUICE_BACKEND_PASSWORD");
        assert!(!errs[0].to_string().contains("lonely"));
        let errs = Config::from_yaml("backend:\n  password_file: \"\"\n").unwrap_err();
        assert_eq!(errs[0].field, "backend.password_file");
    }
}
