//! Validation of a parsed [`Config`]: every problem is reported with the field's path and, when
//! the source text is known, the line it is on. Also the backend URL parser, whose errors never
//! contain the password (they reach stderr, `check-config` and the reload API's answer).

use std::collections::HashSet;
use std::fmt;

use super::{BackendUrl, Config};

/// Largest `backend.tcp_user_timeout_ms`: one hour, ample for any network and far inside the
/// kernel's `int` of milliseconds.
const MAX_TCP_USER_TIMEOUT_MS: u64 = 3_600_000;
/// The longest read-your-writes window a caller may have (`callers[].read_your_writes_ms`).
const MAX_READ_YOUR_WRITES_MS: u64 = 3_600_000;

/// The longest Unix-domain socket path Linux takes (`sun_path` is 108 bytes with its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// One problem in a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Dotted path, e.g. `pool.size` or `callers[1].max_concurrency`; empty when unknown.
    pub field: String,
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.line, self.field.is_empty()) {
            (Some(l), false) => write!(f, "line {l}: {}: {}", self.field, self.message),
            (Some(l), true) => write!(f, "line {l}: {}", self.message),
            (None, false) => write!(f, "{}: {}", self.field, self.message),
            (None, true) => write!(f, "{}", self.message),
        }
    }
}

impl ConfigError {
    pub fn plain(message: String) -> Self {
        ConfigError {
            field: String::new(),
            line: None,
            message,
        }
    }

    pub(super) fn from_yaml(e: &serde_yaml::Error) -> Self {
        ConfigError {
            field: String::new(),
            line: e.location().map(|l| l.line()),
            message: e.to_string(),
        }
    }
}

/// Whether `s` has the shape of a SCRAM-SHA-256 verifier:
/// `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`, parts in base64 (the keys
/// 32 bytes). The auth module decodes it; this is only the config's check.
fn verifier_shape(s: &str) -> bool {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let Some((iter_salt, keys)) = s
        .strip_prefix("SCRAM-SHA-256$")
        .and_then(|r| r.split_once('$'))
    else {
        return false;
    };
    let (Some((iter, salt)), Some((stored, server))) =
        (iter_salt.split_once(':'), keys.split_once(':'))
    else {
        return false;
    };
    iter.parse::<u32>().is_ok_and(|i| i > 0)
        && b64.decode(salt).is_ok_and(|s| !s.is_empty())
        && [stored, server]
            .iter()
            .all(|k| b64.decode(k).is_ok_and(|k| k.len() == 32))
}

/// Checks that `s` is `ADDR/LEN` with a sane prefix length.
fn check_cidr(s: &str) -> Result<(), String> {
    let (ip, len) = s.split_once('/').unwrap_or((s, ""));
    let ip: std::net::IpAddr = ip
        .parse()
        .map_err(|_| format!("`{s}` is not an IP network"))?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    if !len.is_empty() {
        match len.parse::<u8>() {
            Ok(l) if l <= max => {}
            _ => return Err(format!("prefix length in `{s}` must be 0..={max}")),
        }
    }
    Ok(())
}

/// Checks that `s` is `HOST:PORT` (`[v6]:PORT` for IPv6 literals) with a non-zero port.
fn check_host_port(s: &str) -> Result<(), String> {
    let err = || format!("`{s}` is not HOST:PORT");
    let (host, port) = s.rsplit_once(':').ok_or_else(err)?;
    let host = host
        .strip_prefix('[')
        .map_or(Some(host), |h| h.strip_suffix(']'));
    match (host, port.parse::<u16>()) {
        (Some(h), Ok(p)) if !h.is_empty() && p != 0 && (!h.contains(':') || s.starts_with('[')) => {
            Ok(())
        }
        _ => Err(err()),
    }
}

/// Checks that `s` is an address worth dialling: an IP socket address (not unspecified, not
/// multicast, port not 0), or `NAME:PORT` with a DNS-style name (labels of letters, digits,
/// `-` and `_`, at most 63 bytes each, 253 in all). Used for `fleet.cancel_addr` and for the
/// cancel addresses other fleet members announce through Redis, which are never dialled
/// unchecked.
pub fn check_dial_addr(s: &str) -> Result<(), String> {
    let err = || {
        let shown: String = s.chars().take(80).collect();
        format!("`{shown}` is not IP:PORT, [IPv6]:PORT or HOSTNAME:PORT")
    };
    if let Ok(a) = s.parse::<std::net::SocketAddr>() {
        return if a.port() != 0 && !a.ip().is_unspecified() && !a.ip().is_multicast() {
            Ok(())
        } else {
            Err(err())
        };
    }
    let (host, port) = s.rsplit_once(':').ok_or_else(err)?;
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    match port.parse::<u16>() {
        Ok(p) if p != 0 && host.len() <= 253 && host.split('.').all(label_ok) => Ok(()),
        _ => Err(err()),
    }
}

struct Problems<'a> {
    text: Option<&'a str>,
    out: Vec<ConfigError>,
}

impl Problems<'_> {
    fn add(&mut self, field: String, message: impl Into<String>) {
        let line = self.text.and_then(|t| locate(t, &field));
        self.out.push(ConfigError {
            field,
            line,
            message: message.into(),
        });
    }
}

/// Finds the line of a dotted field path (`a.b[2].c`) in YAML text by indentation; best effort.
fn locate(text: &str, field: &str) -> Option<usize> {
    let lines: Vec<&str> = text.lines().collect();
    let mut from = 0usize;
    let mut min_indent = 0usize;
    let mut found = None;
    for seg in field.split('.') {
        let (key, index) = match seg.split_once('[') {
            Some((k, i)) => (k, i.trim_end_matches(']').parse::<usize>().ok()),
            None => (seg, None),
        };
        let mut hit = None;
        for (i, l) in lines.iter().enumerate().skip(from) {
            let trimmed = l.trim_start().trim_start_matches("- ");
            let indent = l.len() - l.trim_start().len();
            if found.is_some() && indent < min_indent && !l.trim().is_empty() {
                break;
            }
            if trimmed.starts_with(&format!("{key}:")) {
                hit = Some((i, indent));
                break;
            }
        }
        let (mut line, indent) = hit?;
        if let Some(n) = index {
            // Walk to the n-th list item below the key.
            let mut seen = 0;
            let mut item = None;
            for (i, l) in lines.iter().enumerate().skip(line + 1) {
                let ind = l.len() - l.trim_start().len();
                if !l.trim().is_empty() && ind <= indent && !l.trim_start().starts_with('-') {
                    break;
                }
                if l.trim_start().starts_with('-') {
                    if seen == n {
                        item = Some(i);
                        break;
                    }
                    seen += 1;
                }
            }
            line = item?;
            // Keys of the item may sit on the dash line itself.
            from = line;
        } else {
            from = line + 1;
        }
        min_indent = indent + 1;
        found = Some(line);
    }
    found.map(|l| l + 1)
}

/// A retry policy's keys: a positive base no larger than the cap, everything within 10 min.
fn check_retry(p: &mut Problems<'_>, at: &str, base: u64, cap: u64, floor: u64) {
    if !(1..=600_000).contains(&base) {
        p.add(
            format!("{at}.retry_base_ms"),
            "must be between 1 and 600000",
        );
    } else if !(base..=600_000).contains(&cap) {
        p.add(
            format!("{at}.retry_cap_ms"),
            format!("must be between retry_base_ms ({base}) and 600000"),
        );
    }
    if floor > 600_000 {
        p.add(format!("{at}.retry_floor_ms"), "must be at most 600000");
    }
}

impl Config {
    pub(super) fn validate(&self, text: Option<&str>) -> Result<(), Vec<ConfigError>> {
        let mut p = Problems {
            text,
            out: Vec::new(),
        };
        self.check_sockets(&mut p);
        self.check_backend_url_and_users(&mut p);
        self.check_auth_query(&mut p);
        self.check_databases(&mut p);
        self.check_backend(&mut p);
        self.check_admin_and_process(&mut p);
        self.check_pool(&mut p);
        self.check_user_names(&mut p);
        self.check_limits(&mut p);
        self.check_tls(&mut p);
        self.check_callers(&mut p);
        self.check_fleet_and_peers(&mut p);
        self.check_classify_and_detector(&mut p);
        self.check_breaker(&mut p);
        if p.out.is_empty() { Ok(()) } else { Err(p.out) }
    }

    /// The Unix socket: its mode bits and a directory whose socket path fits.
    fn check_sockets(&self, p: &mut Problems<'_>) {
        if self.unix_socket_mode_bits().is_none() {
            p.add(
                "unix_socket_mode".into(),
                format!(
                    "{:?} is not permission bits in octal, e.g. \"0770\"",
                    self.unix_socket_mode
                ),
            );
        }
        if let Some(dir) = &self.unix_socket_dir {
            if !dir.is_absolute() {
                p.add("unix_socket_dir".into(), "must be an absolute path");
            } else if crate::addr::socket_file(dir, self.listen.port())
                .as_os_str()
                .len()
                > MAX_SOCKET_PATH
            {
                p.add(
                    "unix_socket_dir".into(),
                    format!("the socket path would pass the {MAX_SOCKET_PATH}-byte limit"),
                );
            }
        }
    }

    /// `backend.url`, and each `auth.users[]` entry's secret: one source, a verifier that
    /// parses, no md5 with a verifier.
    fn check_backend_url_and_users(&self, p: &mut Problems<'_>) {
        if let Some(url) = &self.backend.url
            && let Err(e) = BackendUrl::parse(url)
        {
            p.add("backend.url".into(), e);
        }
        for (i, u) in self.auth.users.iter().enumerate() {
            let given = [
                u.password.is_some(),
                u.password_file.is_some(),
                u.password_env.is_some(),
            ];
            if given.iter().filter(|g| **g).count() > 1 {
                p.add(
                    format!("auth.users[{i}]"),
                    "give one of password, password_file and password_env",
                );
            }
            if let Some(pw) = &u.password
                && pw.starts_with("SCRAM-SHA-256$")
            {
                if !verifier_shape(pw) {
                    p.add(
                        format!("auth.users[{i}].password"),
                        "looks like a SCRAM-SHA-256 verifier but does not parse \
                         (SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>)",
                    );
                }
                if u.method == Some(super::AuthMethod::Md5) {
                    p.add(
                        format!("auth.users[{i}].method"),
                        "md5 needs the password itself; a SCRAM verifier serves scram-sha-256",
                    );
                }
            }
        }
    }

    /// `auth.auth_query`.
    fn check_auth_query(&self, p: &mut Problems<'_>) {
        if let Some(q) = &self.auth.auth_query {
            if q.user.is_empty() {
                p.add(
                    "auth.auth_query.user".into(),
                    "required: the user the lookups log in as",
                );
            }
            if !q.query.contains("$1") {
                p.add(
                    "auth.auth_query.query".into(),
                    "must use $1 for the user name being looked up",
                );
            }
            if q.cache_ttl_ms == 0 {
                p.add("auth.auth_query.cache_ttl_ms".into(), "must be > 0");
            }
        }
    }

    /// `databases[]`: unique names, URLs, pool sizes and replicas.
    fn check_databases(&self, p: &mut Problems<'_>) {
        let mut names = HashSet::new();
        for (i, d) in self.databases.iter().enumerate() {
            let at = |k: &str| format!("databases[{i}].{k}");
            if d.name.is_empty() || d.name.len() > 63 {
                p.add(at("name"), "must be a database name (1 to 63 bytes) or *");
            } else if !names.insert(d.name.as_str()) {
                p.add(at("name"), format!("{:?} has two entries", d.name));
            }
            match BackendUrl::parse_entry(&d.url) {
                Err(e) => p.add(at("url"), e),
                Ok(u) => {
                    if u.sslmode.is_some() {
                        p.add(
                            at("url"),
                            "sslmode is set once for every database, in backend.tls (or \
                             backend.url)",
                        );
                    }
                    if d.password_file.is_some() && u.user.is_empty() {
                        p.add(
                            at("password_file"),
                            "is the password of the URL's user: the URL names none",
                        );
                    }
                }
            }
            if d.pool_size == Some(0) {
                p.add(at("pool_size"), "must be at least 1");
            }
            for (j, r) in d.replicas.iter().enumerate() {
                if let Err(e) = BackendUrl::parse_entry(r) {
                    p.add(format!("databases[{i}].replicas[{j}]"), e);
                }
            }
        }
    }

    /// `backend.*`: the password file, `require_auth`, the connect and TCP user timeouts.
    fn check_backend(&self, p: &mut Problems<'_>) {
        if self.backend.password_file.as_deref() == Some("") {
            p.add(
                "backend.password_file".into(),
                "must be a path (omit it to use the URL's password)",
            );
        }
        if self
            .backend
            .require_auth
            .as_ref()
            .is_some_and(Vec::is_empty)
        {
            p.add(
                "backend.require_auth".into(),
                "must list at least one method (scram-sha-256, md5, password, trust)",
            );
        }
        if self.backend.connect_timeout_ms == 0 {
            p.add("backend.connect_timeout_ms".into(), "must be > 0");
        }
        if self.backend.tcp_user_timeout_ms > MAX_TCP_USER_TIMEOUT_MS {
            p.add(
                "backend.tcp_user_timeout_ms".into(),
                format!("must be between 0 (off) and {MAX_TCP_USER_TIMEOUT_MS}"),
            );
        }
    }

    /// `admin.allowed_hosts`, the log rate and the worker threads.
    fn check_admin_and_process(&self, p: &mut Problems<'_>) {
        for (i, h) in self.admin.allowed_hosts.iter().enumerate() {
            let name = h.strip_prefix("*.").unwrap_or(h);
            let ok = h == "*"
                || (!name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.'));
            if !ok {
                p.add(
                    format!("admin.allowed_hosts[{i}]"),
                    format!(
                        "{h:?} is not a host name (letters, digits, - and . only, no port; \
                         *.domain for its subdomains, * for any)"
                    ),
                );
            }
        }
        self.check_console(p);
        if self.log.max_lines_per_second > 100_000 {
            p.add(
                "log.max_lines_per_second".into(),
                "must be between 0 (none of those lines) and 100000",
            );
        }
        if self.worker_threads > 1024 {
            p.add(
                "worker_threads".into(),
                "must be between 0 (automatic) and 1024",
            );
        }
    }

    /// `pool.*` and `pools[]` overrides.
    /// `admin.console`: database names that could be a client's, none of them hiding a
    /// `databases[]` entry, and user names that are names.
    fn check_console(&self, p: &mut Problems<'_>) {
        let c = &self.admin.console;
        if c.enabled() && c.databases.is_empty() {
            p.add(
                "admin.console.databases".into(),
                "must name at least one database when admin.console.admin_users or \
                 stats_users is set (for example [pgsluice, pgbouncer])",
            );
        }
        let mut seen = HashSet::new();
        for (i, d) in c.databases.iter().enumerate() {
            let at = format!("admin.console.databases[{i}]");
            if d.is_empty() || d.len() > 63 || d == "*" {
                p.add(
                    at,
                    format!("{d:?} is not a database name (1 to 63 bytes, not *)"),
                );
            } else if !seen.insert(d.as_str()) {
                p.add(at, format!("{d:?} is listed twice"));
            } else if self.databases.iter().any(|e| &e.name == d) {
                p.add(
                    at,
                    format!(
                        "{d:?} is also a databases[] entry: the console would hide that \
                         database from its clients; name the console differently"
                    ),
                );
            }
        }
        for (list, users) in [
            ("admin_users", &c.admin_users),
            ("stats_users", &c.stats_users),
        ] {
            for (i, u) in users.iter().enumerate() {
                if u.is_empty() {
                    p.add(
                        format!("admin.console.{list}[{i}]"),
                        "must be a user name (empty)",
                    );
                }
            }
        }
    }

    fn check_pool(&self, p: &mut Problems<'_>) {
        let pool = &self.pool;
        if pool.size == 0 || pool.size > 10_000 {
            p.add("pool.size".into(), "must be between 1 and 10000");
        }
        if pool.min_idle > pool.size {
            p.add("pool.min_idle".into(), "must not exceed pool.size");
        }
        if pool.checkout_timeout_ms == 0 {
            p.add("pool.checkout_timeout_ms".into(), "must be > 0");
        }
        if let Some(r) = pool.critical_reserve
            && r >= pool.size
        {
            p.add(
                "pool.critical_reserve".into(),
                format!(
                    "must be below pool.size ({}): other callers need a backend too",
                    pool.size
                ),
            );
        }
        if pool.adaptive_floor == 0 {
            p.add(
                "pool.adaptive_floor".into(),
                "must be at least 1 (a pool smaller than it is never limited)",
            );
        }
        if !(pool.adaptive_target_percent > 0.0 && pool.adaptive_target_percent <= 100.0) {
            p.add(
                "pool.adaptive_target_percent".into(),
                "must be above 0 and at most 100",
            );
        }
        if pool.max_waiting == 0 {
            p.add(
                "pool.max_waiting".into(),
                "must be > 0 (0 would refuse every client that finds the pool busy)",
            );
        }
        if pool.max_connect_attempts == 0 {
            p.add("pool.max_connect_attempts".into(), "must be > 0");
        }
        if pool.connect_backoff_base_ms > pool.connect_backoff_cap_ms {
            p.add(
                "pool.connect_backoff_base_ms".into(),
                "must not exceed pool.connect_backoff_cap_ms",
            );
        }
        if pool.prepared_cache_bytes < 1024 {
            p.add("pool.prepared_cache_bytes".into(), "must be >= 1024");
        }
        if pool.prepared_cache_size == 0 {
            p.add("pool.prepared_cache_size".into(), "must be > 0");
        }
        if pool.cancel_grace_ms == 0 {
            p.add("pool.cancel_grace_ms".into(), "must be > 0");
        }
        for (i, o) in self.pools.iter().enumerate() {
            if o.size == Some(0) {
                p.add(format!("pools[{i}].size"), "must be > 0");
            }
        }
    }

    /// `auth.users[]` names: present and unique.
    fn check_user_names(&self, p: &mut Problems<'_>) {
        let mut users = HashSet::new();
        for (i, u) in self.auth.users.iter().enumerate() {
            if u.name.is_empty() {
                p.add(format!("auth.users[{i}].name"), "must not be empty");
            }
            if !users.insert(u.name.as_str()) {
                p.add(
                    format!("auth.users[{i}].name"),
                    format!("duplicate user `{}`", u.name),
                );
            }
            let method = u.method.unwrap_or(self.auth.method);
            if method != super::AuthMethod::Trust
                && u.password.is_none()
                && u.password_file.is_none()
                && u.password_env.is_none()
            {
                p.add(
                    format!("auth.users[{i}].password"),
                    "required unless the method is trust (or password_file, password_env)",
                );
            }
        }
    }

    /// `limits.*` and the breaker's critical reserve.
    fn check_limits(&self, p: &mut Problems<'_>) {
        let l = &self.limits;
        if l.max_client_conn == 0 {
            p.add("limits.max_client_conn".into(), "must be > 0");
        }
        if l.max_handshakes == 0 {
            p.add("limits.max_handshakes".into(), "must be > 0");
        }
        if l.max_handshakes_per_address == 0 {
            p.add("limits.max_handshakes_per_address".into(), "must be > 0");
        }
        if l.max_cancels_per_address == 0 {
            p.add("limits.max_cancels_per_address".into(), "must be > 0");
        }
        if l.handshake_timeout_ms == 0 {
            p.add("limits.handshake_timeout_ms".into(), "must be > 0");
        }
        if l.client_write_timeout_ms == 0 {
            p.add("limits.client_write_timeout_ms".into(), "must be > 0");
        }
        // Below 64 KiB ordinary ORM statements would be refused; above 1 GiB is Postgres' own.
        if !(64 << 10..=1 << 30).contains(&l.max_message_bytes) {
            p.add(
                "limits.max_message_bytes".into(),
                "must be between 65536 and 1073741824",
            );
        }
        if l.max_client_statements == 0 {
            p.add("limits.max_client_statements".into(), "must be > 0");
        }
        if l.max_pools == 0 {
            p.add("limits.max_pools".into(), "must be > 0");
        }
        if self.global_defaults.circuit_breaker.critical_reserve == Some(0) {
            p.add(
                "global_defaults.circuit_breaker.critical_reserve".into(),
                "must be > 0 (critical traffic needs some room while the breaker is open)",
            );
        }
    }

    /// The TLS files each mode needs: `tls.*` toward clients, `backend.root_cert_file` for a
    /// verifying backend mode.
    fn check_tls(&self, p: &mut Problems<'_>) {
        if self.tls.mode != super::ClientTlsMode::Disable {
            for (field, v) in [
                ("tls.cert_file", &self.tls.cert_file),
                ("tls.key_file", &self.tls.key_file),
            ] {
                if v.as_deref().is_none_or(str::is_empty) {
                    p.add(field.into(), "required unless tls.mode is disable");
                }
            }
        }
        if matches!(
            self.backend.tls,
            super::BackendTlsMode::VerifyCa | super::BackendTlsMode::VerifyFull
        ) && self
            .backend
            .root_cert_file
            .as_deref()
            .is_none_or(str::is_empty)
        {
            p.add(
                "backend.root_cert_file".into(),
                "required when backend.tls is verify-ca or verify-full",
            );
        }
    }

    /// `callers[]` (unique names, limits, matches, retry hints) and the global defaults'
    /// retry hints.
    fn check_callers(&self, p: &mut Problems<'_>) {
        let mut names = HashSet::new();
        for (i, c) in self.callers.iter().enumerate() {
            if c.name.is_empty() || c.name == "default" {
                p.add(
                    format!("callers[{i}].name"),
                    "must be a non-empty name other than `default`",
                );
            }
            if !names.insert(c.name.as_str()) {
                p.add(
                    format!("callers[{i}].name"),
                    format!("duplicate caller `{}`", c.name),
                );
            }
            if c.max_concurrency == Some(0) {
                p.add(format!("callers[{i}].max_concurrency"), "must be > 0");
            }
            if let Some(q) = c.max_qps
                && !(crate::policy::bucket::MIN_RATE..=1e6).contains(&q)
            {
                p.add(
                    format!("callers[{i}].max_qps"),
                    "must be a number in [0.001, 1000000] (one statement per 1000 s at least)",
                );
            }
            if let Some(w) = c.weight
                && !(1..=crate::policy::share::MAX_WEIGHT).contains(&w)
            {
                p.add(format!("callers[{i}].weight"), "must be between 1 and 1000");
            }
            if let Some(s) = c.db_time_share {
                if !(s > 0.0 && s <= 1.0) {
                    p.add(
                        format!("callers[{i}].db_time_share"),
                        "must be a share of the pool's backend time, 0 < share <= 1",
                    );
                } else if !self.pool.fair_shares {
                    p.add(
                        format!("callers[{i}].db_time_share"),
                        "needs pool.fair_shares: true (the pools measure backend time per caller then)",
                    );
                }
            }
            if c.read_your_writes_ms
                .is_some_and(|ms| ms > MAX_READ_YOUR_WRITES_MS)
            {
                p.add(
                    format!("callers[{i}].read_your_writes_ms"),
                    format!(
                        "must be at most {MAX_READ_YOUR_WRITES_MS} (an hour); leave it unset to \
                         wait for the write's WAL position instead of a time"
                    ),
                );
            }
            if let Some(cidr) = &c.matcher.client_cidr
                && let Err(e) = check_cidr(cidr)
            {
                p.add(format!("callers[{i}].match.client_cidr"), e);
            }
            let g = &self.global_defaults;
            check_retry(
                p,
                &format!("callers[{i}]"),
                c.retry_base_ms.unwrap_or(g.retry_base_ms),
                c.retry_cap_ms.unwrap_or(g.retry_cap_ms),
                c.retry_floor_ms.unwrap_or(g.retry_floor_ms),
            );
        }
        let g = &self.global_defaults;
        check_retry(
            p,
            "global_defaults",
            g.retry_base_ms,
            g.retry_cap_ms,
            g.retry_floor_ms,
        );
    }

    /// `fleet` and `peers[]`.
    fn check_fleet_and_peers(&self, p: &mut Problems<'_>) {
        if let Some(f) = &self.fleet {
            if let Err(e) = redis::Client::open(f.redis_url.as_str()) {
                p.add("fleet.redis_url".into(), format!("not a Redis URL: {e}"));
            }
            if let Some(id) = &f.instance_id
                && (id.is_empty()
                    || id.len() > 64
                    || !id
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "._-:".contains(c)))
            {
                p.add(
                    "fleet.instance_id".into(),
                    "1 to 64 letters, digits, '.', '_', '-' or ':'",
                );
            }
            if !(50..=60_000).contains(&f.heartbeat_ms) {
                p.add("fleet.heartbeat_ms".into(), "must be between 50 and 60000");
            }
            if f.key_prefix.is_empty() || f.key_prefix.len() > 64 {
                p.add("fleet.key_prefix".into(), "1 to 64 characters");
            }
            if let Some(addr) = &f.cancel_addr
                && let Err(e) = check_dial_addr(addr)
            {
                p.add("fleet.cancel_addr".into(), e);
            }
        } else {
            for (i, c) in self.callers.iter().enumerate() {
                if c.scope == super::Scope::Fleet {
                    p.add(
                        format!("callers[{i}].scope"),
                        "fleet needs a fleet section (fleet.redis_url)",
                    );
                }
            }
        }
        if !self.peers.is_empty() && self.peer_id == 0 {
            p.add(
                "peer_id".into(),
                "must be between 1 and 255 when peers are configured",
            );
        }
        let mut ids = HashSet::new();
        for (i, peer) in self.peers.iter().enumerate() {
            if peer.id == 0 {
                p.add(format!("peers[{i}].id"), "must be between 1 and 255");
            }
            if !ids.insert(peer.id) {
                p.add(
                    format!("peers[{i}].id"),
                    format!("duplicate peer id {}", peer.id),
                );
            }
            if let Err(e) = check_host_port(&peer.addr) {
                p.add(format!("peers[{i}].addr"), e);
            }
        }
    }

    /// `classify.*`, `detector` and `auto_rules`.
    fn check_classify_and_detector(&self, p: &mut Problems<'_>) {
        if self.classify.max_text_bytes == 0 {
            p.add("classify.max_text_bytes".into(), "must be > 0");
        }
        for (field, message) in super::detect::problems(&self.detector, &self.auto_rules) {
            p.add(field, message);
        }
        if self.classify.stats_capacity == 0 {
            p.add("classify.stats_capacity".into(), "must be > 0");
        }
    }

    /// `global_defaults.circuit_breaker` and `global_defaults.max_concurrency`.
    fn check_breaker(&self, p: &mut Problems<'_>) {
        let b = &self.global_defaults.circuit_breaker;
        if let Some(t) = b.db_cpu_threshold_percent
            && !(0.0..=100.0).contains(&t)
        {
            p.add(
                "global_defaults.circuit_breaker.db_cpu_threshold_percent".into(),
                "must be between 0 and 100",
            );
        }
        let field = |k: &str| format!("global_defaults.circuit_breaker.{k}");
        if b.max_inflight_threshold == Some(0) {
            p.add(
                field("max_inflight_threshold"),
                "must be > 0 (omit it to turn it off)",
            );
        }
        if !(1..=1000).contains(&b.half_open_trials) {
            p.add(field("half_open_trials"), "must be between 1 and 1000");
        }
        if !(100..=600_000).contains(&b.probe_interval_ms) {
            p.add(field("probe_interval_ms"), "must be between 100 and 600000");
        }
        if let Some(sql) = &b.probe_sql
            && (sql.trim().is_empty() || sql.trim().trim_end_matches(';').contains(';'))
        {
            p.add(
                field("probe_sql"),
                "must be one statement returning a number in its first column",
            );
        }
        if self.global_defaults.max_concurrency == 0 {
            p.add("global_defaults.max_concurrency".into(), "must be > 0");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_backend_urls() {
        let u = BackendUrl::parse("postgres://app:s%40cret@db.local:6000/appdb").unwrap();
        assert_eq!(
            (
                u.user.as_str(),
                u.password.as_deref(),
                u.host.as_str(),
                u.port,
                u.database.as_str()
            ),
            ("app", Some("s@cret"), "db.local", 6000, "appdb")
        );
        let u = BackendUrl::parse("postgresql://app@127.0.0.1").unwrap();
        assert_eq!(
            (u.port, u.database.as_str(), u.password.as_deref()),
            (5432, "app", None)
        );
        assert!(BackendUrl::parse("mysql://x@y/z").is_err());
        assert!(BackendUrl::parse("postgres://h:5432/db").is_err());
        assert!(BackendUrl::parse("postgres://a:b@h:99999/db").is_err());
        assert!(!format!("{u:?}").contains("s@cret"));
    }

    #[test]
    fn console_settings_are_checked() {
        let base = "backend:\n  url: postgres://app:pw@db/appdb\n";
        let c = Config::from_yaml(base).unwrap();
        assert!(!c.admin.console.enabled(), "off unless a user is named");
        assert!(!c.admin.console.serves("pgsluice"));
        let ok = format!(
            "{base}admin:\n  console:\n    databases: [pgsluice, pgbouncer]\n    \
             admin_users: [ops]\n    stats_users: [exporter, ops]\n"
        );
        let c = Config::from_yaml(&ok).unwrap().admin.console;
        assert!(c.serves("pgbouncer") && c.serves("pgsluice") && !c.serves("appdb"));
        assert_eq!(c.role("ops"), Some(super::super::ConsoleRole::Admin));
        assert_eq!(c.role("exporter"), Some(super::super::ConsoleRole::Stats));
        assert_eq!(c.role("app"), None);
        for (yaml, field, says) in [
            (
                "admin:\n  console:\n    databases: []\n    stats_users: [x]\n",
                "admin.console.databases",
                "at least one",
            ),
            (
                "admin:\n  console:\n    databases: [a, a]\n    stats_users: [x]\n",
                "admin.console.databases[1]",
                "twice",
            ),
            (
                "admin:\n  console:\n    databases: ['*']\n",
                "admin.console.databases[0]",
                "not a database name",
            ),
            (
                "admin:\n  console:\n    databases: [appdb]\n    admin_users: [x]\n\
                 databases:\n  - name: appdb\n    url: postgres://h/appdb\n",
                "admin.console.databases[0]",
                "hide that database",
            ),
            (
                "admin:\n  console:\n    admin_users: ['']\n",
                "admin.console.admin_users[0]",
                "user name",
            ),
        ] {
            let errs = Config::from_yaml(&format!("{base}{yaml}")).unwrap_err();
            assert!(
                errs.iter()
                    .any(|e| e.field == field && e.message.contains(says)),
                "{yaml}: {errs:?}"
            );
        }
    }

    #[test]
    fn url_errors_never_contain_the_password() {
        for (url, secret) in [
            ("postgres://app:hunter%zz2@db/appdb", "hunter"),
            ("postgres://app:hunter%2@db/appdb", "hunter"),
            ("postgres://app:hunter%ff@db/appdb", "hunter"),
        ] {
            let e = BackendUrl::parse(url).unwrap_err();
            assert!(!e.contains(secret), "{e}");
            assert!(e.contains("the password in backend.url"), "{e}");
            let text = format!("backend:\n  url: \"{url}\"\n");
            let errs = Config::from_yaml(&text).unwrap_err();
            let shown = errs
                .iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("\n");
            assert!(!shown.contains(secret), "{shown}");
            assert!(shown.contains("backend.url"), "{shown}");
        }
        // Segments that are no secret are still quoted.
        let e = BackendUrl::parse("postgres://ap%zzp:pw@db/appdb").unwrap_err();
        assert!(e.contains("ap%zzp"), "{e}");
        assert!(!e.contains("pw"), "{e}");
    }

    #[test]
    fn dial_addresses_are_checked() {
        for ok in [
            "127.0.0.1:6433",
            "[::1]:6433",
            "db-proxy-2:6433",
            "pgsluice_2.internal:1",
            "localhost:65535",
        ] {
            assert_eq!(check_dial_addr(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "nope",
            "127.0.0.1:0",
            "0.0.0.0:6432",
            "[::]:6432",
            "224.0.0.1:6432",
            "a b:6432",
            "host:port",
            "-x:1",
            "x..y:1",
            "::1:6432",
            "evil\r\n:1",
            &format!("{}:1", "a".repeat(64)),
        ] {
            assert!(check_dial_addr(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn errors_name_field_and_line() {
        let text = "listen: 127.0.0.1:6432\npool:\n  mode: transaction\n  size: 0\n";
        let errs = Config::from_yaml(text).unwrap_err();
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].field, "pool.size");
        assert_eq!(errs[0].line, Some(4));
    }

    #[test]
    fn worker_threads_choice_and_bounds() {
        let auto = Config::from_yaml("").unwrap();
        assert_eq!(auto.runtime_threads(1), 1);
        assert_eq!(
            auto.runtime_threads(2),
            1,
            "2 CPUs shared with Postgres: one thread"
        );
        assert_eq!(auto.runtime_threads(8), 8);
        let two = Config::from_yaml("worker_threads: 2\n").unwrap();
        assert_eq!(two.runtime_threads(2), 2);
        assert_eq!(two.runtime_threads(64), 2);
        let errs = Config::from_yaml("listen: 127.0.0.1:6432\nworker_threads: 5000\n").unwrap_err();
        assert_eq!(errs[0].field, "worker_threads");
        assert_eq!(errs[0].line, Some(2));
    }

    #[test]
    fn unknown_keys_are_errors_with_lines() {
        let errs = Config::from_yaml("pool:\n  sise: 3\n").unwrap_err();
        assert!(errs[0].message.contains("sise"), "{}", errs[0]);
        assert_eq!(errs[0].line, Some(2));
    }

    #[test]
    fn list_items_are_located() {
        let text =
            "callers:\n  - name: a\n    max_concurrency: 5\n  - name: b\n    max_concurrency: 0\n";
        let errs = Config::from_yaml(text).unwrap_err();
        assert_eq!(errs[0].field, "callers[1].max_concurrency");
        assert_eq!(errs[0].line, Some(5));
    }

    #[test]
    fn read_your_writes_windows_are_bounded() {
        let text = "callers:\n  - name: a\n    read_your_writes_ms: 3600001\n";
        let errs = Config::from_yaml(text).unwrap_err();
        assert_eq!(errs[0].field, "callers[0].read_your_writes_ms");
        let text = "callers:\n  - name: a\n    read_your_writes_ms: 2000\n  - name: b\n    \
                    read_your_writes_ms: 0\n  - name: c\n";
        let c = Config::from_yaml(text).expect("valid");
        let windows: Vec<_> = c.callers.iter().map(|c| c.read_your_writes_ms).collect();
        assert_eq!(windows, [Some(2000), Some(0), None]);
    }

    #[test]
    fn weights_and_time_shares_are_checked() {
        let text = "callers:\n  - name: a\n    weight: 0\n  - name: b\n    db_time_share: 0.2\n";
        let errs = Config::from_yaml(text).unwrap_err();
        let fields: Vec<&str> = errs.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["callers[0].weight", "callers[1].db_time_share"]);
        assert!(errs[1].message.contains("fair_shares"), "{}", errs[1]);
        let text = "pool:\n  fair_shares: true\ncallers:\n  - name: b\n    db_time_share: 1.5\n";
        let errs = Config::from_yaml(text).unwrap_err();
        assert_eq!(errs[0].field, "callers[0].db_time_share");
        let text = "pool:\n  fair_shares: true\ncallers:\n  - name: a\n    weight: 3\n    db_time_share: 0.2\n";
        let c = Config::from_yaml(text).expect("valid");
        assert!(c.pool.fair_shares);
        assert_eq!(c.callers[0].weight, Some(3));
    }

    #[test]
    fn tls_modes_need_their_files() {
        let errs = Config::from_yaml("tls:\n  mode: require\n").unwrap_err();
        let fields: Vec<&str> = errs.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["tls.cert_file", "tls.key_file"]);
        let errs = Config::from_yaml("backend:\n  tls: verify-full\n").unwrap_err();
        assert_eq!(errs[0].field, "backend.root_cert_file");
        let c =
            Config::from_yaml("backend:\n  tls: verify-ca\n  root_cert_file: /r.pem\n").unwrap();
        assert_eq!(c.backend.tls, super::super::BackendTlsMode::VerifyCa);
        assert!(Config::from_yaml("tls:\n  mode: sometimes\n").is_err());
    }

    #[test]
    fn per_address_limits_are_positive() {
        let c = Config::from_yaml("").unwrap();
        assert_eq!(
            (
                c.limits.max_handshakes,
                c.limits.max_handshakes_per_address,
                c.limits.max_cancels_per_address
            ),
            (4096, 512, 32),
            "it takes eight addresses to hold every handshake slot"
        );
        let errs = Config::from_yaml(
            "limits:\n  max_handshakes_per_address: 0\n  max_cancels_per_address: 0\n",
        )
        .unwrap_err();
        let got: Vec<(&str, Option<usize>)> =
            errs.iter().map(|e| (e.field.as_str(), e.line)).collect();
        assert_eq!(
            got,
            [
                ("limits.max_handshakes_per_address", Some(2)),
                ("limits.max_cancels_per_address", Some(3))
            ]
        );
        // At or above the process-wide cap: allowed, and then the process-wide cap is the one.
        let c =
            Config::from_yaml("limits:\n  max_handshakes: 8\n  max_handshakes_per_address: 100\n")
                .unwrap();
        assert_eq!(c.limits.max_handshakes_per_address, 100);
    }

    #[test]
    fn backend_require_auth_defaults_follow_verification() {
        use super::super::BackendAuthMethod as M;
        let c = Config::from_yaml("").unwrap();
        assert_eq!(
            c.backend.allowed_auth(),
            [M::ScramSha256],
            "prefer: SCRAM only"
        );
        for mode in ["disable", "require"] {
            let c = Config::from_yaml(&format!("backend:\n  tls: {mode}\n")).unwrap();
            assert_eq!(c.backend.allowed_auth(), [M::ScramSha256], "{mode}");
        }
        let c =
            Config::from_yaml("backend:\n  tls: verify-full\n  root_cert_file: /r.pem\n").unwrap();
        assert_eq!(c.backend.allowed_auth(), M::ALL);
        let c = Config::from_yaml("backend:\n  require_auth: [password, none, md5]\n").unwrap();
        assert_eq!(c.backend.allowed_auth(), [M::Password, M::Trust, M::Md5]);
        let errs = Config::from_yaml("backend:\n  require_auth: []\n").unwrap_err();
        assert_eq!(errs[0].field, "backend.require_auth");
        assert_eq!(errs[0].line, Some(2));
        let errs = Config::from_yaml("backend:\n  require_auth: [gss]\n").unwrap_err();
        assert!(errs[0].message.contains("gss"), "{}", errs[0]);
    }

    #[test]
    fn the_unix_socket_settings_are_checked() {
        let c = Config::from_yaml("unix_socket_dir: /run/pgsluice\nunix_socket_mode: \"0770\"\n")
            .unwrap();
        assert_eq!(
            c.unix_socket_dir.as_deref(),
            Some(std::path::Path::new("/run/pgsluice"))
        );
        assert_eq!(c.unix_socket_mode_bits(), Some(0o770));
        assert_eq!(Config::default().unix_socket_mode_bits(), Some(0o777));
        for (yaml, field, says) in [
            ("unix_socket_dir: run\n", "unix_socket_dir", "absolute"),
            ("unix_socket_mode: \"0778\"\n", "unix_socket_mode", "octal"),
            ("unix_socket_mode: \"1777\"\n", "unix_socket_mode", "octal"),
        ] {
            let errs = Config::from_yaml(yaml).unwrap_err();
            assert_eq!(errs[0].field, field, "{yaml}");
            assert!(errs[0].message.contains(says), "{}", errs[0]);
        }
        // A socket-directory backend host cannot have TLS; prefer falls back to plain.
        let over = |tls: &str| {
            Config::from_yaml(&format!(
                "backend:\n  url: \"postgres://app@/db?host=/run/pg\"\n  tls: {tls}\n"
            ))
            .unwrap()
            .apply(&crate::config::Overrides::default())
        };
        assert!(over("prefer").is_ok());
        let errs = over("require").unwrap_err();
        assert_eq!(errs[0].field, "backend.tls");
        assert!(errs[0].message.contains("/run/pg"), "{}", errs[0]);
        let long = format!("unix_socket_dir: /{}\n", "d".repeat(100));
        let errs = Config::from_yaml(&long).unwrap_err();
        assert!(errs[0].message.contains("107-byte"), "{}", errs[0]);
    }

    #[test]
    fn dead_server_timeouts_are_bounded() {
        let errs = Config::from_yaml("pool:\n  cancel_grace_ms: 0\n").unwrap_err();
        assert_eq!(errs[0].field, "pool.cancel_grace_ms");
        let errs = Config::from_yaml("backend:\n  tcp_user_timeout_ms: 3600001\n").unwrap_err();
        assert_eq!(errs[0].field, "backend.tcp_user_timeout_ms");
        let c = Config::from_yaml("backend:\n  tcp_user_timeout_ms: 30000\n").unwrap();
        assert_eq!(c.backend.tcp_user_timeout_ms, 30_000);
        let c = Config::from_yaml("").unwrap();
        assert_eq!(
            (c.backend.tcp_user_timeout_ms, c.pool.cancel_grace_ms),
            (0, 2_000)
        );
    }

    #[test]
    fn peers_are_validated_with_lines() {
        let c = Config::from_yaml(
            "listen_reuseport: true\npeer_id: 1\npeers:\n  - { id: 1, addr: \"127.0.0.1:6432\" }\n  - id: 2\n    addr: \"db-proxy-2:6433\"\n  - { id: 3, addr: \"[::1]:6434\" }\n",
        )
        .unwrap();
        assert!(c.listen_reuseport);
        assert_eq!((c.peer_id, c.peers.len()), (1, 3));
        let text = "peers:\n  - id: 2\n    addr: a:1\n  - id: 2\n    addr: nope\n  - id: 0\n    addr: \"b:0\"\n";
        let errs = Config::from_yaml(text).unwrap_err();
        let got: Vec<(&str, Option<usize>)> =
            errs.iter().map(|e| (e.field.as_str(), e.line)).collect();
        assert_eq!(
            got,
            [
                ("peer_id", None),
                ("peers[1].id", Some(4)),
                ("peers[1].addr", Some(5)),
                ("peers[2].id", Some(6)),
                ("peers[2].addr", Some(7)),
            ]
        );
        let errs = Config::from_yaml("peer_id: 256\n").unwrap_err();
        assert_eq!(errs[0].line, Some(1), "{}", errs[0]);
        // An id without peers is allowed (and unused).
        assert_eq!(Config::from_yaml("peer_id: 4\n").unwrap().peer_id, 4);
    }

    #[test]
    fn fleet_is_validated_with_lines() {
        let ok = "peer_id: 2\nfleet:\n  redis_url: \"redis://10.0.0.9:6379/2\"\n  instance_id: \"db-proxy-2\"\ncallers:\n  - name: app\n    scope: fleet\n";
        let c = Config::from_yaml(ok).unwrap();
        let f = c.fleet.as_ref().unwrap();
        assert_eq!((f.heartbeat_ms, f.key_prefix.as_str()), (1000, "pgsluice"));
        assert_eq!(c.callers[0].scope, crate::config::Scope::Fleet);
        let text = "fleet:\n  redis_url: \"http://x\"\n  instance_id: \"a b\"\n  heartbeat_ms: 10\n  key_prefix: \"\"\n  cancel_addr: nope\n";
        let errs = Config::from_yaml(text).unwrap_err();
        let got: Vec<(&str, Option<usize>)> =
            errs.iter().map(|e| (e.field.as_str(), e.line)).collect();
        assert_eq!(
            got,
            [
                ("fleet.redis_url", Some(2)),
                ("fleet.instance_id", Some(3)),
                ("fleet.heartbeat_ms", Some(4)),
                ("fleet.key_prefix", Some(5)),
                ("fleet.cancel_addr", Some(6)),
            ]
        );
        let errs = Config::from_yaml("callers:\n  - name: app\n    scope: fleet\n").unwrap_err();
        assert_eq!(errs[0].field, "callers[0].scope");
        assert_eq!(errs[0].line, Some(3), "{}", errs[0]);
        let errs = Config::from_yaml("fleet:\n  instance_id: a\n").unwrap_err();
        assert!(errs[0].message.contains("redis_url"), "{}", errs[0]);
    }

    #[test]
    fn empty_file_is_the_defaults() {
        let c = Config::from_yaml("").unwrap();
        assert_eq!(c.pool.size, 20);
    }

    #[test]
    fn issue_example_parses() {
        let text = r#"
callers:
  - name: service_payment
    match: { tag: { service: billing } }
    max_concurrency: 50
    queue_depth: 20
    queue_timeout_ms: 200
    priority: critical
  - name: service_analytics
    match: { application_name: analytics }
    max_concurrency: 5
    queue_depth: 0
    queue_timeout_ms: 0
    priority: low
    max_qps: 100
    statement_timeout_ms: { read: 1000, write: 5000 }
    lock_timeout_ms: 200
global_defaults:
  max_concurrency: 120
  queue_timeout_ms: 300
  statement_timeout_ms: 30000
  circuit_breaker:
    max_inflight_threshold: 100
    db_cpu_threshold_percent: 85
    probe_sql: "SELECT 1"
    consecutive_errors: 5
    open_ms: 5000
"#;
        let c = Config::from_yaml(text).unwrap();
        assert_eq!(c.callers.len(), 2);
    }
}
