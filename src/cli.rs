//! `pgsluice rules …` and `pgsluice top`: a terminal client for a running proxy's admin API;
//! and `pgsluice fingerprint`, which needs no proxy: it runs the proxy's own classifier on a
//! statement and prints the normal form and the fingerprint a rule is written for.
//!
//! Owns the clap subcommands and a deliberately tiny HTTP/1.1 client (one request per TCP
//! connection, `Connection: close`, plain HTTP to the admin port, which binds to loopback by
//! default) so the binary needs no HTTP client crate. It validates nothing itself: rules go
//! to the server as JSON and its field-level errors are printed as they come back, so there
//! is one source of truth for what a valid rule is.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use clap::{Args, Subcommand};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::classify::{Classifier, DEFAULT_MAX_TEXT_BYTES, fingerprint_hex};
use crate::policy::rules::RuleSpec;

/// Whole exchange (connect, send, read the answer).
const TIMEOUT: Duration = Duration::from_secs(10);
/// Largest response read (a full `top --limit 1000` is well under this).
const MAX_RESPONSE: usize = 32 * 1024 * 1024;

/// Where the admin API is and how to authenticate; accepted before or after the subcommand.
#[derive(Args, Debug, Clone)]
pub struct AdminConn {
    /// Admin API address.
    #[arg(long, global = true, default_value = "127.0.0.1:9930")]
    pub admin: SocketAddr,
    /// Bearer token (write token for changes; read or write token for listings).
    #[arg(
        long,
        global = true,
        env = "PGSLUICE_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
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
    /// Top query fingerprints of a running proxy.
    Top {
        #[command(flatten)]
        conn: AdminConn,
        /// total_time, calls, errors, refusals or qps.
        #[arg(long, default_value = "total_time")]
        sort: String,
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
    /// Delete the rule for a fingerprint.
    Delete { hash: String },
}

#[derive(Args, Debug, Clone)]
#[command(allow_negative_numbers = true)]
pub struct PutArgs {
    /// Fingerprint, 16 hex digits (see `pgsluice top`).
    pub hash: String,
    /// The whole rule as a JSON object, instead of the flags below.
    #[arg(long, conflicts_with = "action")]
    pub json: Option<String>,
    /// REJECT, THROTTLE, CONCURRENCY or TIMEOUT.
    #[arg(long)]
    pub action: Option<String>,
    /// THROTTLE: statements per second.
    #[arg(long)]
    pub max_qps: Option<f64>,
    /// THROTTLE: bucket size (default: one second's worth).
    #[arg(long)]
    pub burst: Option<u32>,
    /// THROTTLE: REJECT (default) or QUEUE up to the caller's queue timeout.
    #[arg(long = "on-exceed")]
    pub action_on_exceed: Option<String>,
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
    #[arg(long)]
    pub mode: Option<String>,
    /// Free text for the next person on call.
    #[arg(long)]
    pub note: Option<String>,
    /// THROTTLE: instance (default) or fleet (one rate for every instance of a fleet).
    #[arg(long)]
    pub scope: Option<String>,
}

impl PutArgs {
    fn body(&self) -> anyhow::Result<Vec<u8>> {
        if let Some(j) = &self.json {
            return Ok(j.as_bytes().to_vec());
        }
        if self.action.is_none() {
            bail!("give --action (REJECT, THROTTLE, CONCURRENCY or TIMEOUT) or --json");
        }
        let spec = RuleSpec {
            action: self.action.clone(),
            max_qps: self.max_qps,
            burst: self.burst,
            action_on_exceed: self.action_on_exceed.clone(),
            max_inflight: self.max_inflight,
            statement_timeout_ms: self.statement_timeout_ms,
            lock_timeout_ms: self.lock_timeout_ms,
            error_message: self.error_message.clone(),
            ttl_seconds: self.ttl_seconds,
            callers: (!self.callers.is_empty()).then(|| self.callers.clone()),
            mode: self.mode.clone(),
            note: self.note.clone(),
            scope: self.scope.clone(),
            origin: None,
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
        AdminCmd::Rules { conn, cmd } => {
            let c = Client::new(conn);
            match cmd {
                RulesCmd::List { json } => {
                    let v = c.call("GET", "/v1/rules", None).await?;
                    if json {
                        emit(&pretty(&v)?)?;
                    } else {
                        emit(&rules_table(&v))?;
                    }
                }
                RulesCmd::Get { hash } => {
                    let v = c.call("GET", &rule_path(&hash), None).await?;
                    emit(&pretty(&v)?)?;
                }
                RulesCmd::Put(args) => {
                    let body = args.body()?;
                    let v = c.call("PUT", &rule_path(&args.hash), Some(&body)).await?;
                    emit(&pretty(&v)?)?;
                    if v.get("persisted") == Some(&Value::Bool(false)) {
                        eprintln!(
                            "note: no admin.rules_file configured; the rule is lost on restart"
                        );
                    }
                }
                RulesCmd::Delete { hash } => {
                    c.call("DELETE", &rule_path(&hash), None).await?;
                    emit(&format!("deleted rule {hash}\n"))?;
                }
            }
        }
        AdminCmd::Top {
            conn,
            sort,
            limit,
            caller,
            json,
            watch: _,
        } => {
            let c = Client::new(conn);
            let mut path = format!(
                "/v1/fingerprints?sort={}&limit={limit}",
                percent_encode(&sort)
            );
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
    }
    Ok(())
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

struct Client {
    addr: SocketAddr,
    token: Option<String>,
}

/// `GET path` on the admin API at `conn`: the JSON answer of a 2xx, else the server's error
/// (for tools beside the CLI, such as the storm tool's anomaly poller).
pub async fn admin_get(conn: &AdminConn, path: &str) -> anyhow::Result<Value> {
    Client::new(conn.clone()).call("GET", path, None).await
}

impl Client {
    fn new(conn: AdminConn) -> Self {
        Client {
            addr: conn.admin,
            token: conn.token.filter(|t| !t.is_empty()),
        }
    }

    /// One request; a JSON answer on 2xx, else an error carrying the server's message.
    async fn call(&self, method: &str, path: &str, body: Option<&[u8]>) -> anyhow::Result<Value> {
        let (status, bytes) = tokio::time::timeout(TIMEOUT, self.exchange(method, path, body))
            .await
            .map_err(|_| {
                anyhow!(
                    "admin API at {} did not answer within {TIMEOUT:?}",
                    self.addr
                )
            })??;
        let v: Value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
        };
        if (200..300).contains(&status) {
            return Ok(v);
        }
        let field = |k: &str| v.get(k).and_then(Value::as_str);
        let mut msg = format!("HTTP {status}");
        if let Some(e) = field("error") {
            let _ = write!(msg, ": {e}");
        }
        if let Some(f) = field("field") {
            let _ = write!(msg, ": {f}");
        }
        match field("message") {
            Some(m) => {
                let _ = write!(msg, ": {m}");
            }
            None if v.is_string() => {
                let _ = write!(msg, ": {}", v.as_str().unwrap_or_default());
            }
            None => {}
        }
        if let Some(errs) = v.get("errors").and_then(Value::as_array) {
            for e in errs {
                let _ = write!(msg, "\n  {}", e.as_str().unwrap_or_default());
            }
        }
        if status == 401 && self.token.is_none() {
            msg.push_str("\n(no token given: use --token or PGSLUICE_ADMIN_TOKEN)");
        }
        Err(anyhow!(msg))
    }

    async fn exchange(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> anyhow::Result<(u16, Vec<u8>)> {
        let mut s = TcpStream::connect(self.addr)
            .await
            .with_context(|| format!("cannot connect to the admin API at {}", self.addr))?;
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nAccept: application/json\r\n",
            self.addr
        );
        if let Some(t) = &self.token {
            let _ = write!(req, "Authorization: Bearer {t}\r\n");
        }
        if let Some(b) = body {
            let _ = write!(
                req,
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            );
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes()).await?;
        if let Some(b) = body {
            s.write_all(b).await?;
        }
        let mut raw = Vec::new();
        (&mut s)
            .take(u64::try_from(MAX_RESPONSE).unwrap_or(u64::MAX))
            .read_to_end(&mut raw)
            .await?;
        parse_response(&raw)
    }
}

/// Status and body of an HTTP/1.1 response read to EOF (length-delimited or chunked).
fn parse_response(raw: &[u8]) -> anyhow::Result<(u16, Vec<u8>)> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("malformed HTTP response (no end of headers)"))?;
    let head = std::str::from_utf8(&raw[..end]).context("malformed HTTP response headers")?;
    let rest = &raw[end + 4..];
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow!("malformed HTTP status line"))?;
    let (mut chunked, mut length) = (false, None);
    for l in lines {
        let Some((k, v)) = l.split_once(':') else {
            continue;
        };
        let (k, v) = (k.trim(), v.trim());
        if k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked") {
            chunked = true;
        } else if k.eq_ignore_ascii_case("content-length") {
            length = v.parse::<usize>().ok();
        }
    }
    let body = if chunked {
        dechunk(rest)?
    } else {
        let n = length.unwrap_or(rest.len()).min(rest.len());
        rest[..n].to_vec()
    };
    Ok((status, body))
}

fn dechunk(mut b: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| anyhow!("malformed chunked body"))?;
        let size_text = std::str::from_utf8(&b[..eol])?;
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16).context("malformed chunk size")?;
        b = &b[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size + 2 {
            bail!("truncated chunked body");
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// Left-aligned columns, two spaces apart.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::new();
        for (i, c) in cells.enumerate() {
            let _ = write!(l, "{c:<w$}  ", w = widths.get(i).copied().unwrap_or(0));
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for r in rows {
        line(&mut r.iter().map(String::as_str));
    }
    out
}

fn num(v: &Value, k: &str) -> String {
    match v.get(k) {
        Some(Value::Number(n)) => n.to_string(),
        _ => "-".to_owned(),
    }
}

fn ms(v: &Value, k: &str) -> String {
    v.get(k)
        .and_then(Value::as_f64)
        .map_or_else(|| "-".to_owned(), |f| format!("{f:.2}"))
}

/// A rate: one decimal.
fn rate(v: &Value, k: &str) -> String {
    v.get(k)
        .and_then(Value::as_f64)
        .map_or_else(|| "-".to_owned(), |f| format!("{f:.1}"))
}

fn text(v: &Value, k: &str) -> String {
    v.get(k).and_then(Value::as_str).unwrap_or("-").to_owned()
}

/// What the rule limits, in a few words.
fn rule_limit(r: &Value) -> String {
    match r.get("action").and_then(Value::as_str).unwrap_or_default() {
        "THROTTLE" => format!(
            "{}/s burst {} then {}",
            num(r, "max_qps"),
            num(r, "burst"),
            text(r, "action_on_exceed")
        ),
        "CONCURRENCY" => format!("{} in flight", num(r, "max_inflight")),
        "TIMEOUT" => format!(
            "statement {} ms, lock {} ms",
            num(r, "statement_timeout_ms"),
            num(r, "lock_timeout_ms")
        ),
        _ => "-".to_owned(),
    }
}

fn rules_table(v: &Value) -> String {
    let rules = v
        .get("rules")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if rules.is_empty() {
        return "no rules\n".to_owned();
    }
    let rows: Vec<Vec<String>> = rules
        .iter()
        .map(|r| {
            let callers = r.get("callers").and_then(Value::as_array).map_or_else(
                || "*".to_owned(),
                |c| {
                    c.iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join(",")
                },
            );
            let expires = r.get("expires_in_ms").and_then(Value::as_u64).map_or_else(
                || "never".to_owned(),
                |ms| format!("{}s", ms.div_ceil(1000)),
            );
            vec![
                text(r, "fingerprint"),
                text(r, "action"),
                text(r, "mode"),
                rule_limit(r),
                callers,
                num(r, "hits"),
                num(r, "refusals"),
                num(r, "warned"),
                expires,
                text(r, "note"),
            ]
        })
        .collect();
    table(
        &[
            "FINGERPRINT",
            "ACTION",
            "MODE",
            "LIMIT",
            "CALLERS",
            "HITS",
            "REFUSED",
            "WARNED",
            "EXPIRES",
            "NOTE",
        ],
        &rows,
    )
}

/// Whitespace collapsed, cut to `max` characters.
fn one_line(s: &str, max: usize) -> String {
    let flat = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= max {
        return flat;
    }
    let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// What `/v1/anomalies` reports, one paragraph each, after the table: the subject, the
/// evidence, the rule in place or the one to PUT, and whether its row is in the table.
fn anomaly_lines(anomalies: Option<&Value>, top: &Value) -> String {
    let list = anomalies
        .and_then(|a| a.get("anomalies"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut out = String::new();
    let shown: Vec<String> = top
        .get("fingerprints")
        .and_then(Value::as_array)
        .map(|r| r.iter().map(|f| text(f, "fingerprint")).collect())
        .unwrap_or_default();
    for a in &list {
        let e = a.get("evidence").cloned().unwrap_or_default();
        let unit = text(&e, "unit");
        let fmt = |k: &str| {
            let v = e.get(k).and_then(Value::as_f64).unwrap_or(0.0);
            if unit == "share" {
                format!("{:.0}%", v * 100.0)
            } else {
                format!("{v:.1}")
            }
        };
        let who = match a.get("caller").and_then(Value::as_str) {
            Some(c) => format!("caller {c}"),
            None => {
                let fp = text(a, "fingerprint");
                let mark = if shown.contains(&fp) { " (above)" } else { "" };
                format!("fingerprint {fp}{mark}")
            }
        };
        let _ = writeln!(
            out,
            "ANOMALY {who}: {} {} {unit} against a baseline of {} ({:.1}x), for {} s",
            text(a, "signal"),
            fmt("current"),
            fmt("baseline"),
            e.get("ratio").and_then(Value::as_f64).unwrap_or(0.0),
            a.get("active_for_ms").and_then(Value::as_u64).unwrap_or(0) / 1000
        );
        if let Some(q) = a.get("normalized").and_then(Value::as_str) {
            let _ = writeln!(out, "  query: {}", one_line(q, 100));
        }
        if let Some(callers) = a.get("top_callers").and_then(Value::as_array)
            && !callers.is_empty()
        {
            let names: Vec<String> = callers
                .iter()
                .map(|c| format!("{} ({})", text(c, "caller"), num(c, "calls")))
                .collect();
            let _ = writeln!(out, "  callers in the window: {}", names.join(", "));
        }
        if let Some(r) = a.get("rule") {
            let _ = writeln!(
                out,
                "  rule in place: {} {} ({})",
                text(r, "action"),
                text(r, "mode"),
                text(r, "origin")
            );
        } else if let Some(s) = a.get("suggested_rule") {
            let body = s.get("body").map(Value::to_string).unwrap_or_default();
            let _ = writeln!(
                out,
                "  suggested: {} {} {body}",
                text(s, "method"),
                text(s, "path")
            );
        }
    }
    out
}

fn top_table(v: &Value) -> String {
    let rows = v
        .get("fingerprints")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if rows.is_empty() {
        return "no fingerprints recorded yet\n".to_owned();
    }
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|f| {
            vec![
                text(f, "fingerprint"),
                num(f, "calls"),
                rate(f, "qps"),
                num(f, "errors"),
                num(f, "lock_not_available"),
                ms(f, "lock_wait_ms"),
                num(f, "statement_timeouts"),
                num(f, "refusals"),
                ms(f, "total_ms"),
                ms(f, "mean_ms"),
                ms(f, "p99_ms"),
                one_line(&text(f, "normalized"), 80),
            ]
        })
        .collect();
    table(
        &[
            "FINGERPRINT",
            "CALLS",
            "QPS",
            "ERRORS",
            "55P03",
            "LOCK_MS",
            "TIMEOUTS",
            "REFUSED",
            "TOTAL_MS",
            "MEAN_MS",
            "P99_MS",
            "QUERY",
        ],
        &rows,
    )
}

/// `pgsluice fingerprint`: what the proxy makes of one statement, computed offline.
#[derive(Args, Debug)]
pub struct FingerprintArgs {
    /// The statement as the application sends it (quote it); `-` reads it from standard input.
    /// A text that starts with a `--` comment is taken as text, not as an option.
    #[arg(allow_hyphen_values = true)]
    pub sql: String,
    /// The proxy's `classify.max_text_bytes`, if its config changes it (longer texts are read
    /// by a simpler scanner, which can give another fingerprint).
    #[arg(long, default_value_t = DEFAULT_MAX_TEXT_BYTES)]
    pub max_text_bytes: usize,
    /// Print JSON (`fingerprint`, `normalized`, `kind`) instead of labelled lines.
    #[arg(long)]
    pub json: bool,
}

/// The text `pgsluice fingerprint` prints for `sql`: fingerprint, normal form and kind, from
/// the classifier the proxy runs on every statement (the cache off, which changes nothing
/// but the speed). An input without a statement is an error.
pub fn fingerprint_report(sql: &str, max_text_bytes: usize, json: bool) -> anyhow::Result<String> {
    if sql.trim().is_empty() {
        bail!(
            "no SQL given: pass the statement as one quoted argument, \
             e.g. pgsluice fingerprint \"SELECT * FROM users WHERE id = 1\", or - to read it \
             from standard input"
        );
    }
    let class = Classifier::new(0, max_text_bytes).classify(sql);
    if class.normalized.trim().is_empty() {
        bail!("the input holds no statement (only comments or semicolons)");
    }
    let hash = fingerprint_hex(class.fingerprint);
    if json {
        let v = serde_json::json!({
            "fingerprint": hash,
            "normalized": &*class.normalized,
            "kind": class.kind.as_str(),
        });
        return pretty(&v);
    }
    Ok(format!(
        "fingerprint  {hash}\nnormalized   {}\nkind         {}\n",
        one_line(&class.normalized, usize::MAX),
        class.kind.as_str()
    ))
}

/// Runs `pgsluice fingerprint`, printing to stdout.
pub fn fingerprint(args: &FingerprintArgs) -> anyhow::Result<()> {
    let sql = if args.sql == "-" {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin().lock(), &mut text)
            .context("cannot read the statement from standard input")?;
        text
    } else {
        args.sql.clone()
    };
    emit(&fingerprint_report(&sql, args.max_text_bytes, args.json)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_length_and_chunked_responses() {
        let r = b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse_response(r).unwrap(), (201, b"{}".to_vec()));
        let r = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(r).unwrap(), (200, b"abcde".to_vec()));
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_err());
    }

    #[test]
    fn put_flags_become_a_rule_body() {
        let args = PutArgs {
            hash: "00000000000000ff".into(),
            json: None,
            action: Some("THROTTLE".into()),
            max_qps: Some(2.0),
            burst: None,
            action_on_exceed: None,
            max_inflight: None,
            statement_timeout_ms: None,
            lock_timeout_ms: None,
            error_message: None,
            ttl_seconds: Some(60),
            callers: vec!["app".into()],
            mode: None,
            note: None,
            scope: None,
        };
        let v: Value = serde_json::from_slice(&args.body().unwrap()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"action":"THROTTLE","max_qps":2.0,"ttl_seconds":60,"callers":["app"]})
        );
    }

    #[test]
    fn fingerprint_report_matches_the_proxys_classifier() {
        let sql = "SELECT * FROM users WHERE id = 1204 AND status = 'active'";
        let out = fingerprint_report(sql, DEFAULT_MAX_TEXT_BYTES, false).unwrap();
        let proxy = Classifier::new(100, DEFAULT_MAX_TEXT_BYTES).classify(sql);
        let other = Classifier::new(100, DEFAULT_MAX_TEXT_BYTES)
            .classify("select *  from users where id=7 and status='x' /*service:a*/");
        assert_eq!(proxy.fingerprint, other.fingerprint);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[0],
            format!("fingerprint  {}", fingerprint_hex(proxy.fingerprint))
        );
        assert_eq!(lines[1], format!("normalized   {}", proxy.normalized));
        assert_eq!(lines[2], "kind         read");
        let hash = lines[0].rsplit(' ').next().unwrap();
        assert_eq!(hash.len(), 16);
        assert!(
            hash.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        let v: Value =
            serde_json::from_str(&fingerprint_report(sql, DEFAULT_MAX_TEXT_BYTES, true).unwrap())
                .unwrap();
        assert_eq!(v["fingerprint"], hash);
        assert_eq!(v["normalized"], &*proxy.normalized);
        for empty in ["", "  \n\t", "/* nothing */", ";"] {
            let err = fingerprint_report(empty, DEFAULT_MAX_TEXT_BYTES, false).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains("no SQL given") || msg.contains("holds no statement"),
                "{empty:?}: {msg}"
            );
        }
    }

    #[test]
    fn top_shows_rate_and_lock_evidence() {
        let v = serde_json::json!({"fingerprints": [{
            "fingerprint": "00000000000000ff", "calls": 12, "qps": 2.345, "errors": 3,
            "lock_not_available": 2, "lock_wait_ms": 401.5, "statement_timeouts": 1,
            "refusals": 0, "total_ms": 500.0, "mean_ms": 41.7, "p99_ms": 210.0,
            "normalized": "SELECT ? FROM t FOR UPDATE NOWAIT"
        }]});
        let t = top_table(&v);
        let mut lines = t.lines();
        let head: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        let col = |name: &str| row[head.iter().position(|h| *h == name).unwrap()];
        assert_eq!(col("QPS"), "2.3");
        assert_eq!(col("55P03"), "2");
        assert_eq!(col("LOCK_MS"), "401.50");
        assert_eq!(col("TIMEOUTS"), "1");
    }

    #[test]
    fn tables_and_encoding() {
        assert_eq!(percent_encode("a b/é"), "a%20b%2F%C3%A9");
        let t = table(&["A", "BB"], &[vec!["xyz".into(), "1".into()]]);
        assert_eq!(t, "A    BB\nxyz  1\n");
        assert_eq!(one_line("select  1\n from t", 8), "select …");
    }
}
