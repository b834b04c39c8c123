//! The `pgsluice` subcommands that talk to a running proxy's admin API (`rules`, `top`,
//! `pools`, `callers`, `breaker`, `reload`) and `pgsluice fingerprint`, which needs no proxy.
//!
//! Owns the clap definitions of those subcommands, where the admin API is and which token to
//! send (flag, environment, then the proxy's own config file), and running one subcommand.
//! The HTTP client is in [`http`], the tables in [`tables`]. It validates nothing itself:
//! rules go to the server as JSON and its field-level errors are printed as they come back,
//! so there is one source of truth for what a valid rule is.

pub mod fingerprint;
pub mod http;
pub mod tables;

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail};
use clap::{Args, Subcommand, ValueEnum};
use serde_json::Value;

pub use self::fingerprint::{FingerprintArgs, fingerprint, fingerprint_report};
use self::http::{Client, Endpoint};
use self::tables::{
    anomaly_lines, breaker_text, callers_table, clients_table, num, pools_table, preview_text,
    rules_table, servers_table, text, top_table,
};
use crate::config::Config;
use crate::policy::rules::RuleSpec;

/// The admin address when neither `--admin` nor a config file says otherwise.
pub const DEFAULT_ADMIN: &str = "127.0.0.1:9930";

/// Where the admin API is and how to authenticate; accepted before or after the subcommand.
#[derive(Args, Debug, Clone, Default)]
pub struct AdminConn {
    /// Admin API: HOST:PORT or http(s)://HOST[:PORT][/PREFIX] [default: the config file's
    /// admin.listen, else 127.0.0.1:9930].
    // The brackets are the help text's, not links.
    #[allow(rustdoc::broken_intra_doc_links)]
    #[arg(long, global = true, value_name = "URL", env = "PGSLUICE_ADMIN_URL")]
    pub admin: Option<String>,
    /// Bearer token (write token for changes; read or write token for listings) [default:
    /// the config file's admin.write_token, else its admin.read_token].
    #[arg(
        long,
        global = true,
        env = "PGSLUICE_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// CA certificates (PEM) an https admin URL's certificate must chain to [default: the
    /// system's bundle].
    #[arg(long, global = true, value_name = "PATH", env = "PGSLUICE_ADMIN_CA")]
    pub admin_ca: Option<PathBuf>,
    /// The proxy's config file, read for the admin address and token.
    #[arg(
        long,
        short = 'c',
        global = true,
        value_name = "FILE",
        env = "PGSLUICE_CONFIG"
    )]
    pub config: Option<PathBuf>,
}

impl AdminConn {
    /// The admin API at `addr` with `token` (tools beside the CLI).
    pub fn at(addr: SocketAddr, token: Option<String>) -> AdminConn {
        AdminConn {
            admin: Some(addr.to_string()),
            token,
            ..AdminConn::default()
        }
    }

    /// The endpoint and token this invocation uses: flags and the environment first, then
    /// the config file, then the default address.
    fn client(&self) -> anyhow::Result<Client> {
        let file = match &self.config {
            Some(path) if self.admin.is_none() || self.token.is_none() => {
                Some(Config::load(path).map_err(|errs| {
                    let list: Vec<String> = errs.iter().map(|e| format!("  {e}")).collect();
                    anyhow!("{}:\n{}", path.display(), list.join("\n"))
                })?)
            }
            _ => None,
        };
        let endpoint = match (&self.admin, &file) {
            (Some(a), _) => Endpoint::parse(a)?,
            (None, Some(c)) => Endpoint::parse(&reachable(c.admin.listen).to_string())?,
            (None, None) => Endpoint::parse(DEFAULT_ADMIN)?,
        };
        let token = self.token.clone().or_else(|| {
            let a = &file.as_ref()?.admin;
            a.write_token.clone().or_else(|| a.read_token.clone())
        });
        let ca = self.admin_ca.as_ref().map(|p| p.display().to_string());
        Client::new(endpoint, token, ca.as_deref())
    }
}

/// Where to connect to reach a server listening on `listen`: an unspecified address
/// (`0.0.0.0`, `::`) is reached on loopback.
fn reachable(listen: SocketAddr) -> SocketAddr {
    match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, listen.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, listen.port()).into(),
        _ => listen,
    }
}

/// Client subcommands; `main` flattens them next to its own.
#[derive(Subcommand, Debug, Clone)]
pub enum AdminCmd {
    /// Runtime fingerprint rules of a running proxy.
    Rules {
        #[command(flatten)]
        conn: AdminConn,
        #[command(subcommand)]
        cmd: RulesCmd,
    },
    /// Top query fingerprints of a running proxy, and the anomalies it sees.
    Top {
        #[command(flatten)]
        conn: AdminConn,
        #[arg(long, value_enum, default_value_t = TopSort::TotalTime)]
        sort: TopSort,
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// Only fingerprints this caller ran.
        #[arg(long)]
        caller: Option<String>,
        /// Print the API's JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Redraw every SECS seconds (2 without a value) until Ctrl-C.
        #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2")]
        watch: Option<f64>,
    },
    /// Backend pools: size, active, idle, waiting clients, connects, timeouts.
    Pools {
        #[command(flatten)]
        conn: AdminConn,
        /// Print the API's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Callers: limits, in flight, queued, admitted and refused by reason.
    Callers {
        #[command(flatten)]
        conn: AdminConn,
        /// Print the API's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// The circuit breaker: state, reason, trips.
    Breaker {
        #[command(flatten)]
        conn: AdminConn,
        /// Print the API's JSON instead of the summary.
        #[arg(long)]
        json: bool,
    },
    /// Re-read the proxy's config file, as SIGHUP does (errors keep the running config).
    Reload {
        #[command(flatten)]
        conn: AdminConn,
    },
    /// Logged-in clients: caller, state, backend, latest fingerprint, how long.
    Clients {
        #[command(flatten)]
        conn: AdminConn,
        /// Print the API's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Backend connections: idle ones and the client holding each busy one.
    Servers {
        #[command(flatten)]
        conn: AdminConn,
        /// Print the API's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// End a client's session (FATAL 57P01), or with --cancel only its running statement.
    Kill {
        #[command(flatten)]
        conn: AdminConn,
        /// Client id (see `pgsluice clients`).
        id: u64,
        /// Cancel the running statement instead of ending the session.
        #[arg(long)]
        cancel: bool,
    },
    /// Hold new transactions of a pool (DATABASE/USER) and wait for those in flight.
    Pause {
        #[command(flatten)]
        conn: AdminConn,
        /// DATABASE/USER, as `pgsluice pools` names it.
        pool: String,
        /// How long each held transaction waits for the resume [default: 60000].
        #[arg(long, value_name = "MS")]
        hold_ms: Option<u64>,
        /// How long to wait for the transactions in flight [default: 30000].
        #[arg(long, value_name = "MS")]
        wait_ms: Option<u64>,
    },
    /// Release a paused pool (DATABASE/USER).
    Resume {
        #[command(flatten)]
        conn: AdminConn,
        pool: String,
    },
    /// Replace every backend of a pool (DATABASE/USER) after its current transaction.
    Reconnect {
        #[command(flatten)]
        conn: AdminConn,
        pool: String,
    },
    /// Refuse new client logins to a database (sessions already open go on).
    Disable {
        #[command(flatten)]
        conn: AdminConn,
        database: String,
    },
    /// Accept new client logins to a database again.
    Enable {
        #[command(flatten)]
        conn: AdminConn,
        database: String,
    },
}

/// `pgsluice top --sort`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
#[value(rename_all = "snake_case")]
pub enum TopSort {
    TotalTime,
    Calls,
    Errors,
    Refusals,
    Qps,
}

/// `--action` of a rule.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
#[value(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RuleAction {
    Reject,
    Throttle,
    Concurrency,
    Timeout,
    Route,
    Coalesce,
}

/// `--route` of a ROUTE rule.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
#[value(rename_all = "lowercase")]
pub enum RuleRoute {
    Replica,
    Primary,
}

/// `--on-exceed` of a THROTTLE rule.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
#[value(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum OnExceed {
    Reject,
    Queue,
}

/// `--mode` of a rule.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
#[value(rename_all = "lowercase")]
pub enum RuleMode {
    Enforce,
    Warn,
}

/// `--scope` of a THROTTLE rule.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
#[value(rename_all = "lowercase")]
pub enum RuleScope {
    Instance,
    Fleet,
}

/// The name clap shows for a value (what the API takes, too).
fn name<V: ValueEnum>(v: V) -> String {
    v.to_possible_value()
        .map(|p| p.get_name().to_owned())
        .unwrap_or_default()
}

#[derive(Subcommand, Debug, Clone)]
pub enum RulesCmd {
    /// List rules with their counters and expiry.
    List {
        /// Print the API's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one rule.
    Get { hash: String },
    /// Create or replace the rule for a fingerprint (16 hex digits).
    Put(Box<PutArgs>),
    /// What a rule would match and refuse now, from the proxy's statistics; changes nothing.
    Preview(Box<PreviewArgs>),
    /// Delete the rule for a fingerprint.
    Delete { hash: String },
}

#[derive(Args, Debug, Clone)]
#[command(allow_negative_numbers = true)]
pub struct PutArgs {
    /// Fingerprint, 16 hex digits (see `pgsluice top`).
    pub hash: String,
    #[command(flatten)]
    pub rule: RuleFlags,
}

/// `pgsluice rules preview`: the rule's target (a fingerprint, or SQL whose fingerprint the
/// proxy computes) and the rule, as for `put`.
#[derive(Args, Debug, Clone)]
#[command(allow_negative_numbers = true)]
pub struct PreviewArgs {
    /// Fingerprint, 16 hex digits (see `pgsluice top`).
    #[arg(required_unless_present = "sql")]
    pub hash: Option<String>,
    /// A statement whose fingerprint the rule is for, instead of HASH.
    #[arg(long, conflicts_with = "hash")]
    pub sql: Option<String>,
    /// Print the API's JSON instead of the summary.
    #[arg(long)]
    pub raw: bool,
    #[command(flatten)]
    pub rule: RuleFlags,
}

impl PreviewArgs {
    /// The rule body with its target (`fingerprint` or `sql`) added.
    fn body(&self) -> anyhow::Result<Vec<u8>> {
        let mut v: Value = serde_json::from_slice(&self.rule.body()?)
            .map_err(|e| anyhow!("--json is not a JSON object: {e}"))?;
        let Some(map) = v.as_object_mut() else {
            bail!("--json must be a JSON object");
        };
        match (&self.hash, &self.sql) {
            (Some(h), _) => map.insert("fingerprint".into(), Value::String(h.clone())),
            (None, Some(s)) => map.insert("sql".into(), Value::String(s.clone())),
            (None, None) => bail!("give a fingerprint (HASH) or --sql"),
        };
        Ok(serde_json::to_vec(&v)?)
    }
}

/// The rule's fields as flags (`put`, `preview`).
#[derive(Args, Debug, Clone)]
pub struct RuleFlags {
    /// The whole rule as a JSON object, instead of the flags below.
    #[arg(long, conflicts_with = "action")]
    pub json: Option<String>,
    /// What the rule does.
    #[arg(long, value_enum, ignore_case = true)]
    pub action: Option<RuleAction>,
    /// THROTTLE: statements per second.
    #[arg(long)]
    pub max_qps: Option<f64>,
    /// THROTTLE: bucket size (default: one second's worth).
    #[arg(long)]
    pub burst: Option<u32>,
    /// THROTTLE: refuse at once (default) or queue up to the caller's queue timeout.
    #[arg(long = "on-exceed", value_enum, ignore_case = true)]
    pub action_on_exceed: Option<OnExceed>,
    /// CONCURRENCY: statements of this pattern in flight at once.
    #[arg(long)]
    pub max_inflight: Option<u32>,
    /// TIMEOUT: statement_timeout in milliseconds (0 = none).
    #[arg(long)]
    pub statement_timeout_ms: Option<u64>,
    /// TIMEOUT: lock_timeout in milliseconds (0 = none).
    #[arg(long)]
    pub lock_timeout_ms: Option<u64>,
    /// Text the refused client sees.
    #[arg(long)]
    pub error_message: Option<String>,
    /// Remove the rule after this many seconds.
    #[arg(long, alias = "ttl")]
    pub ttl_seconds: Option<u64>,
    /// Apply only to this caller (repeatable).
    #[arg(long = "caller")]
    pub callers: Vec<String>,
    /// enforce (default) or warn (NOTICE only, count what would be refused).
    #[arg(long, value_enum, ignore_case = true)]
    pub mode: Option<RuleMode>,
    /// Free text for the next person on call.
    #[arg(long)]
    pub note: Option<String>,
    /// THROTTLE: one rate per instance (default) or one for every instance of a fleet.
    #[arg(long, value_enum, ignore_case = true)]
    pub scope: Option<RuleScope>,
    /// ROUTE: send the pattern's plain reads to the replicas, or keep them on the primary.
    #[arg(long, value_enum, ignore_case = true)]
    pub route: Option<RuleRoute>,
    /// Act as --mode warn for this many milliseconds, then enforce (a confirmation window).
    #[arg(long, value_name = "MS")]
    pub warn_first_ms: Option<u64>,
    /// COALESCE: how long a read waits for an identical one already running (default 1000).
    #[arg(long, value_name = "MS")]
    pub max_wait_ms: Option<u64>,
    /// COALESCE: the largest result shared, in bytes (default 65536).
    #[arg(long, value_name = "BYTES")]
    pub max_result_bytes: Option<u64>,
}

impl RuleFlags {
    fn body(&self) -> anyhow::Result<Vec<u8>> {
        if let Some(j) = &self.json {
            return Ok(j.as_bytes().to_vec());
        }
        let Some(action) = self.action else {
            bail!(
                "give --action (REJECT, THROTTLE, CONCURRENCY, TIMEOUT, ROUTE or COALESCE) or \
                 --json"
            );
        };
        let spec = RuleSpec {
            action: Some(name(action)),
            max_qps: self.max_qps,
            burst: self.burst,
            action_on_exceed: self.action_on_exceed.map(name),
            max_inflight: self.max_inflight,
            statement_timeout_ms: self.statement_timeout_ms,
            lock_timeout_ms: self.lock_timeout_ms,
            error_message: self.error_message.clone(),
            ttl_seconds: self.ttl_seconds,
            callers: (!self.callers.is_empty()).then(|| self.callers.clone()),
            mode: self.mode.map(name),
            note: self.note.clone(),
            scope: self.scope.map(name),
            route: self.route.map(name),
            origin: None,
            warn_first_ms: self.warn_first_ms,
            max_wait_ms: self.max_wait_ms,
            max_result_bytes: self.max_result_bytes,
        };
        Ok(serde_json::to_vec(&spec)?)
    }
}

/// Runs one client subcommand, printing to stdout.
pub async fn run(cmd: AdminCmd) -> anyhow::Result<()> {
    if let AdminCmd::Top {
        watch: Some(secs), ..
    } = &cmd
    {
        return watch_top(cmd.clone(), *secs).await;
    }
    match cmd {
        AdminCmd::Rules { conn, cmd } => rules(&conn.client()?, cmd).await?,
        AdminCmd::Top {
            conn,
            sort,
            limit,
            caller,
            json,
            watch: _,
        } => {
            let c = conn.client()?;
            let mut path = format!("/v1/fingerprints?sort={}&limit={limit}", name(sort));
            if let Some(caller) = caller {
                let _ = write!(path, "&caller={}", percent_encode(&caller));
            }
            let v = c.call("GET", &path, None).await?;
            if json {
                emit(&pretty(&v)?)?;
            } else {
                // Anomalies mark their rows; a proxy without the endpoint just has no marks.
                let anomalies = c.call("GET", "/v1/anomalies", None).await.ok();
                emit(&top_table(&v))?;
                emit(&anomaly_lines(anomalies.as_ref(), &v))?;
            }
        }
        AdminCmd::Pools { conn, json } => show(&conn, "/v1/pools", json, pools_table).await?,
        AdminCmd::Callers { conn, json } => {
            show(&conn, "/v1/callers", json, callers_table).await?;
        }
        AdminCmd::Breaker { conn, json } => show(&conn, "/v1/breaker", json, breaker_text).await?,
        AdminCmd::Reload { conn } => {
            conn.client()?.call("POST", "/v1/reload", None).await?;
            emit("configuration reloaded\n")?;
        }
        AdminCmd::Clients { conn, json } => {
            show(&conn, "/v1/clients", json, clients_table).await?;
        }
        AdminCmd::Servers { conn, json } => {
            show(&conn, "/v1/servers", json, servers_table).await?;
        }
        AdminCmd::Kill { conn, id, cancel } => {
            let c = conn.client()?;
            if cancel {
                c.call("POST", &format!("/v1/clients/{id}/cancel"), None)
                    .await?;
                emit(&format!("cancel sent to client {id}'s statement\n"))?;
            } else {
                c.call("DELETE", &format!("/v1/clients/{id}"), None).await?;
                emit(&format!("client {id} terminated\n"))?;
            }
        }
        AdminCmd::Pause {
            conn,
            pool,
            hold_ms,
            wait_ms,
        } => {
            let body = serde_json::json!({ "hold_ms": hold_ms, "wait_ms": wait_ms });
            let body = serde_json::to_vec(&strip_nulls(body))?;
            let v = conn
                .client()?
                .call("POST", &pool_path(&pool, "pause")?, Some(&body))
                .await?;
            let drained = v.get("drained") == Some(&Value::Bool(true));
            emit(&format!(
                "pool {} paused; {}\n",
                text(&v, "pool"),
                if drained {
                    "no transaction in flight".to_owned()
                } else {
                    format!("{} connections still in use", num(&v, "in_use"))
                }
            ))?;
        }
        AdminCmd::Resume { conn, pool } => {
            let v = conn
                .client()?
                .call("POST", &pool_path(&pool, "resume")?, None)
                .await?;
            emit(&format!("pool {} resumed\n", text(&v, "pool")))?;
        }
        AdminCmd::Reconnect { conn, pool } => {
            let v = conn
                .client()?
                .call("POST", &pool_path(&pool, "reconnect")?, None)
                .await?;
            emit(&format!(
                "pool {}: {} idle connections closed, {} replaced when released\n",
                text(&v, "pool"),
                num(&v, "closed"),
                num(&v, "in_use")
            ))?;
        }
        AdminCmd::Disable { conn, database } => {
            let path = format!("/v1/databases/{}/disable", percent_encode(&database));
            conn.client()?.call("POST", &path, None).await?;
            emit(&format!("new logins to {database} are refused\n"))?;
        }
        AdminCmd::Enable { conn, database } => {
            let path = format!("/v1/databases/{}/enable", percent_encode(&database));
            conn.client()?.call("POST", &path, None).await?;
            emit(&format!("new logins to {database} are accepted\n"))?;
        }
    }
    Ok(())
}

/// `/v1/pools/{db}/{user}/{action}` from `DATABASE/USER`.
fn pool_path(pool: &str, action: &str) -> anyhow::Result<String> {
    let Some((db, user)) = pool
        .split_once('/')
        .filter(|(d, u)| !d.is_empty() && !u.is_empty())
    else {
        bail!("a pool is named DATABASE/USER, as `pgsluice pools` lists it (got {pool:?})");
    };
    Ok(format!(
        "/v1/pools/{}/{}/{action}",
        percent_encode(db),
        percent_encode(user)
    ))
}

/// The object without its null fields.
fn strip_nulls(v: Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(m.into_iter().filter(|(_, v)| !v.is_null()).collect()),
        other => other,
    }
}

async fn rules(c: &Client, cmd: RulesCmd) -> anyhow::Result<()> {
    match cmd {
        RulesCmd::List { json } => {
            let v = c.call("GET", "/v1/rules", None).await?;
            emit(&if json { pretty(&v)? } else { rules_table(&v) })
        }
        RulesCmd::Get { hash } => emit(&pretty(&c.call("GET", &rule_path(&hash), None).await?)?),
        RulesCmd::Put(args) => {
            let body = args.rule.body()?;
            let v = c.call("PUT", &rule_path(&args.hash), Some(&body)).await?;
            emit(&pretty(&v)?)?;
            if v.get("persisted") == Some(&Value::Bool(false)) {
                eprintln!("note: no admin.rules_file configured; the rule is lost on restart");
            }
            Ok(())
        }
        RulesCmd::Preview(args) => {
            let v = c
                .call("POST", "/v1/rules/preview", Some(&args.body()?))
                .await?;
            emit(&if args.raw {
                pretty(&v)?
            } else {
                preview_text(&v)
            })
        }
        RulesCmd::Delete { hash } => {
            c.call("DELETE", &rule_path(&hash), None).await?;
            emit(&format!("deleted rule {hash}\n"))
        }
    }
}

/// `GET path`, printed as JSON or through `render`.
async fn show(
    conn: &AdminConn,
    path: &str,
    json: bool,
    render: fn(&Value) -> String,
) -> anyhow::Result<()> {
    let v = conn.client()?.call("GET", path, None).await?;
    emit(&if json { pretty(&v)? } else { render(&v) })
}

/// `GET path` on the admin API at `conn`: the JSON answer of a 2xx, else the server's error
/// (for tools beside the CLI, such as the storm tool's anomaly poller).
pub async fn admin_get(conn: &AdminConn, path: &str) -> anyhow::Result<Value> {
    conn.client()?.call("GET", path, None).await
}

/// `top --watch`: the table again every `secs` seconds until Ctrl-C, on a cleared screen at a
/// terminal, one after another with a time line otherwise. A failed request (the proxy
/// restarting) is shown in place of the table and the watch goes on.
async fn watch_top(mut cmd: AdminCmd, secs: f64) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    let every = Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| *d >= Duration::from_millis(100))
        .ok_or_else(|| anyhow!("--watch takes a number of seconds, at least 0.1"))?;
    if let AdminCmd::Top { watch, .. } = &mut cmd {
        *watch = None;
    }
    let tty = std::io::stdout().is_terminal();
    loop {
        if tty {
            // Cursor home, clear the screen.
            emit("\x1b[H\x1b[2J")?;
        }
        emit(&format!(
            "pgsluice top, every {secs} s, {} UTC (Ctrl-C to stop)\n\n",
            clock_utc(std::time::SystemTime::now())
        ))?;
        if let Err(e) = Box::pin(run(cmd.clone())).await {
            emit(&format!("pgsluice: {e:#}\n"))?;
        }
        if !tty {
            emit("\n")?;
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}

/// `HH:MM:SS` of a time of day in UTC (no calendar needed for a watch header).
fn clock_utc(t: std::time::SystemTime) -> String {
    let s = t
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

fn pretty(v: &Value) -> anyhow::Result<String> {
    Ok(serde_json::to_string_pretty(v)? + "\n")
}

/// Writes to stdout; a closed pipe (`pgsluice top | head`) ends output quietly.
fn emit(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.map_err(Into::into),
    }
}

fn rule_path(hash: &str) -> String {
    format!("/v1/rules/fingerprint/{}", percent_encode(hash))
}

/// Percent-encodes everything but unreserved characters (RFC 3986).
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_flags_become_a_rule_body() {
        let args = RuleFlags {
            json: None,
            action: Some(RuleAction::Throttle),
            max_qps: Some(2.0),
            burst: None,
            action_on_exceed: Some(OnExceed::Queue),
            max_inflight: None,
            statement_timeout_ms: None,
            lock_timeout_ms: None,
            error_message: None,
            ttl_seconds: Some(60),
            callers: vec!["app".into()],
            mode: Some(RuleMode::Warn),
            note: None,
            scope: Some(RuleScope::Fleet),
            route: None,
            warn_first_ms: None,
            max_wait_ms: None,
            max_result_bytes: None,
        };
        let v: Value = serde_json::from_slice(&args.body().unwrap()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"action":"THROTTLE","max_qps":2.0,"ttl_seconds":60,
                "callers":["app"],"action_on_exceed":"QUEUE","mode":"warn","scope":"fleet"})
        );
        assert_eq!(name(TopSort::TotalTime), "total_time");
    }

    #[test]
    fn preview_adds_its_target_to_the_rule_body() {
        let flags = |json: Option<&str>| RuleFlags {
            json: json.map(str::to_owned),
            action: json.is_none().then_some(RuleAction::Reject),
            max_qps: None,
            burst: None,
            action_on_exceed: None,
            max_inflight: None,
            statement_timeout_ms: None,
            lock_timeout_ms: None,
            error_message: None,
            ttl_seconds: None,
            callers: vec![],
            mode: None,
            note: None,
            scope: None,
            route: None,
            warn_first_ms: Some(5000),
            max_wait_ms: None,
            max_result_bytes: None,
        };
        let args = PreviewArgs {
            hash: Some("00000000000000ff".into()),
            sql: None,
            raw: false,
            rule: flags(None),
        };
        let v: Value = serde_json::from_slice(&args.body().unwrap()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"action":"REJECT","warn_first_ms":5000,
                "fingerprint":"00000000000000ff"})
        );
        let args = PreviewArgs {
            hash: None,
            sql: Some("SELECT 1".into()),
            raw: true,
            rule: flags(Some(r#"{"action":"THROTTLE","max_qps":5}"#)),
        };
        let v: Value = serde_json::from_slice(&args.body().unwrap()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"action":"THROTTLE","max_qps":5,"sql":"SELECT 1"})
        );
        let args = PreviewArgs {
            rule: flags(Some("[1]")),
            ..args
        };
        assert!(args.body().is_err());
    }

    #[test]
    fn percent_encoding_and_reachable_addresses() {
        assert_eq!(percent_encode("a b/é"), "a%20b%2F%C3%A9");
        let any: SocketAddr = "0.0.0.0:9930".parse().unwrap();
        assert_eq!(reachable(any).to_string(), "127.0.0.1:9930");
        let any6: SocketAddr = "[::]:9930".parse().unwrap();
        assert_eq!(reachable(any6).to_string(), "[::1]:9930");
        let one: SocketAddr = "10.1.2.3:9930".parse().unwrap();
        assert_eq!(reachable(one), one);
    }
}
