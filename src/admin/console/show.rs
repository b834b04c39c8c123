//! The console's `SHOW` answers, built from what the HTTP API reads (`read::pool_snapshots`,
//! `control::client_rows`, `control::server_rows`, the callers, fingerprints, rules and
//! anomalies), laid out as PgBouncer lays out its own.
//!
//! PgBouncer's column names, order and types are kept where pgsluice has the same quantity;
//! a column pgsluice has no value for is `0` (numbers) or empty (text) — never a guess. Which
//! is which is listed in docs/OPERATIONS.md ("The admin console"). Two columns PgBouncer 1.7
//! had are appended for the exporters that still read them: `total_requests` (SHOW STATS)
//! and `reserve_pool` (SHOW DATABASES). pgsluice's own tables are in `own.rs`.

use std::collections::{BTreeMap, BTreeSet};

use tokio::time::Instant;

use super::table::{Table, Type, count, int, text, timestamp, whole};
use crate::admin::{AdminState, control, read};
use crate::clients::{ClientSnapshot, ClientState};
use crate::config::{AuthMethod, Config, ConsoleConfig, PoolConfig, PoolMode};
use crate::observe::stats::unix_ms;
use crate::pool::PoolSnapshot;

use Type::{Int4 as I4, Numeric as N, Text as T};

/// The clients of the proxy's pools: the console's own sessions are not pool clients.
fn pool_clients(st: &AdminState, console: &ConsoleConfig) -> Vec<ClientSnapshot> {
    control::client_rows(st)
        .into_iter()
        .filter(|c| !console.serves(&c.database))
        .collect()
}

fn mode_name(m: PoolMode) -> &'static str {
    match m {
        PoolMode::Transaction => "transaction",
        PoolMode::Session => "session",
    }
}

/// `SHOW POOLS`: one row per (database, user) pool.
pub fn pools(st: &AdminState) -> Table {
    let cfg = st.app.config();
    let clients = pool_clients(st, &cfg.admin.console);
    let mut t = Table::new(&[
        ("database", T),
        ("user", T),
        ("cl_active", I4),
        ("cl_waiting", I4),
        ("cl_active_cancel_req", I4),
        ("cl_waiting_cancel_req", I4),
        ("sv_active", I4),
        ("sv_active_cancel", I4),
        ("sv_being_canceled", I4),
        ("sv_idle", I4),
        ("sv_used", I4),
        ("sv_tested", I4),
        ("sv_login", I4),
        ("maxwait", I4),
        ("maxwait_us", I4),
        ("pool_mode", T),
        ("load_balance_hosts", T),
    ]);
    for p in read::pool_snapshots(st) {
        let mine = clients
            .iter()
            .filter(|c| c.database == p.database && c.user == p.user);
        let (mut active, mut waiting, mut max_wait_ms) = (0, 0, 0);
        for c in mine {
            if c.state == ClientState::Waiting {
                waiting += 1;
                max_wait_ms = max_wait_ms.max(c.state_for_ms);
            } else {
                active += 1;
            }
        }
        t.push(vec![
            text(&p.database),
            text(&p.user),
            count(active),
            count(waiting),
            count(0),
            count(0),
            count(p.active),
            count(0),
            count(0),
            // A backend an idle client keeps (parked) is given up to the first checkout
            // that needs it: as usable as an idle one.
            count(p.idle + p.parked),
            count(0),
            count(0),
            count(0),
            int(max_wait_ms / 1000),
            int(max_wait_ms % 1000 * 1000),
            text(p.mode),
            None,
        ]);
    }
    t
}

/// Per database: the sum of its pools' counters.
fn per_database(st: &AdminState) -> BTreeMap<String, PoolSnapshot> {
    let mut dbs: BTreeMap<String, PoolSnapshot> = BTreeMap::new();
    for p in read::pool_snapshots(st) {
        match dbs.get_mut(&p.database) {
            None => {
                dbs.insert(p.database.clone(), p);
            }
            Some(d) => {
                d.checkouts += p.checkouts;
                d.transactions += p.transactions;
                d.queries += p.queries;
                d.bytes_received += p.bytes_received;
                d.bytes_sent += p.bytes_sent;
                d.transaction_us += p.transaction_us;
                d.query_us += p.query_us;
                d.wait_us += p.wait_us;
            }
        }
    }
    dbs
}

/// The counters SHOW STATS totals, in PgBouncer's order after `database`:
/// server_assignment, xact, query, received, sent, xact_time, query_time, wait_time,
/// client_parse, server_parse, bind, client_login.
fn totals(p: &PoolSnapshot) -> [u64; 12] {
    [
        p.checkouts,
        p.transactions,
        p.queries,
        p.bytes_received,
        p.bytes_sent,
        p.transaction_us,
        p.query_us,
        p.wait_us,
        0,
        0,
        0,
        0,
    ]
}

/// Averages since the proxy started: per second for counts and bytes, per transaction or
/// query for times (PgBouncer averages over its last `stats_period` instead).
fn averages(p: &PoolSnapshot, secs: f64) -> [f64; 12] {
    let per = |total: u64, n: u64| if n == 0 { 0.0 } else { total as f64 / n as f64 };
    let rate = |n: u64| n as f64 / secs.max(1.0);
    [
        rate(p.checkouts),
        rate(p.transactions),
        rate(p.queries),
        rate(p.bytes_received),
        rate(p.bytes_sent),
        per(p.transaction_us, p.transactions),
        per(p.query_us, p.queries),
        per(p.wait_us, p.checkouts),
        0.0,
        0.0,
        0.0,
        0.0,
    ]
}

const TOTAL_COLUMNS: [&str; 12] = [
    "total_server_assignment_count",
    "total_xact_count",
    "total_query_count",
    "total_received",
    "total_sent",
    "total_xact_time",
    "total_query_time",
    "total_wait_time",
    "total_client_parse_count",
    "total_server_parse_count",
    "total_bind_count",
    "total_client_login_count",
];

const AVG_COLUMNS: [&str; 12] = [
    "avg_server_assignment_count",
    "avg_xact_count",
    "avg_query_count",
    "avg_recv",
    "avg_sent",
    "avg_xact_time",
    "avg_query_time",
    "avg_wait_time",
    "avg_client_parse_count",
    "avg_server_parse_count",
    "avg_bind_count",
    "avg_client_login_count",
];

/// `SHOW STATS`: totals and averages per database, then `total_requests` (PgBouncer 1.7's
/// name for the query count, read by older exporters).
pub fn stats(st: &AdminState, started: Instant) -> Table {
    let mut cols = vec![("database", T)];
    cols.extend(TOTAL_COLUMNS.iter().map(|c| (*c, N)));
    cols.extend(AVG_COLUMNS.iter().map(|c| (*c, N)));
    cols.push(("total_requests", N));
    let mut t = Table::new(&cols);
    let secs = started.elapsed().as_secs_f64();
    for (db, p) in per_database(st) {
        let mut row = vec![text(db)];
        row.extend(totals(&p).into_iter().map(int));
        row.extend(averages(&p, secs).into_iter().map(whole));
        row.push(int(p.queries));
        t.push(row);
    }
    t
}

/// The short column names of `SHOW STATS_TOTALS` and `SHOW STATS_AVERAGES`.
const SHORT_COLUMNS: [&str; 8] = [
    "server_assignment_count",
    "xact_count",
    "query_count",
    "bytes_received",
    "bytes_sent",
    "xact_time",
    "query_time",
    "wait_time",
];

/// `SHOW STATS_TOTALS`.
pub fn stats_totals(st: &AdminState) -> Table {
    let mut cols = vec![("database", T)];
    cols.extend(SHORT_COLUMNS.iter().map(|c| (*c, N)));
    cols.extend(
        [
            "client_parse_count",
            "server_parse_count",
            "bind_count",
            "client_login_count",
        ]
        .map(|c| (c, N)),
    );
    let mut t = Table::new(&cols);
    for (db, p) in per_database(st) {
        let mut row = vec![text(db)];
        row.extend(totals(&p).into_iter().map(int));
        t.push(row);
    }
    t
}

/// `SHOW STATS_AVERAGES`.
pub fn stats_averages(st: &AdminState, started: Instant) -> Table {
    let mut cols = vec![("database", T)];
    cols.extend(SHORT_COLUMNS.iter().map(|c| (*c, N)));
    cols.extend(
        [
            "avg_client_parse_count",
            "avg_server_parse_count",
            "avg_bind_count",
            "avg_client_login_count",
        ]
        .map(|c| (c, N)),
    );
    let mut t = Table::new(&cols);
    let secs = started.elapsed().as_secs_f64();
    for (db, p) in per_database(st) {
        let mut row = vec![text(db)];
        row.extend(averages(&p, secs).into_iter().map(whole));
        t.push(row);
    }
    t
}

/// The columns of `SHOW CLIENTS` and `SHOW SERVERS` (PgBouncer's socket rows).
const SOCKET_COLUMNS: [(&str, Type); 21] = [
    ("type", T),
    ("user", T),
    ("database", T),
    ("replication", T),
    ("state", T),
    ("addr", T),
    ("port", I4),
    ("local_addr", T),
    ("local_port", I4),
    ("connect_time", T),
    ("request_time", T),
    ("wait", I4),
    ("wait_us", I4),
    ("close_needed", I4),
    ("ptr", T),
    ("link", T),
    ("remote_pid", I4),
    ("tls", T),
    ("application_name", T),
    ("prepared_statements", I4),
    ("id", I4),
];

/// `ip:port` as (ip, port); `unix` (a Unix-socket client) as (`unix`, 0).
fn split_addr(a: &str) -> (String, u64) {
    match a.parse::<std::net::SocketAddr>() {
        Ok(s) => (s.ip().to_string(), u64::from(s.port())),
        Err(_) => (a.to_owned(), 0),
    }
}

/// `SHOW CLIENTS`: every logged-in client, console sessions included (as PgBouncer lists
/// its own). `ptr` is the client's id and `link` the pid of the backend it holds, so a row
/// of `SHOW SERVERS` (whose `ptr` is that pid) can be matched to it.
pub fn clients(st: &AdminState) -> Table {
    let cfg = st.app.config();
    let now = unix_ms();
    let mut t = Table::new(&SOCKET_COLUMNS);
    for c in control::client_rows(st) {
        let (addr, port) = split_addr(&c.address);
        let state = match c.state {
            ClientState::Idle => "idle",
            ClientState::Active | ClientState::IdleInTransaction => "active",
            ClientState::Waiting => "waiting",
        };
        let wait_ms = if c.state == ClientState::Waiting {
            c.state_for_ms
        } else {
            0
        };
        t.push(vec![
            text("C"),
            text(&c.user),
            text(&c.database),
            text("none"),
            text(state),
            text(addr),
            int(port),
            text(cfg.listen.ip().to_string()),
            int(cfg.listen.port()),
            text(timestamp(now.saturating_sub(c.connected_for_ms))),
            text(timestamp(now.saturating_sub(c.state_for_ms))),
            int(wait_ms / 1000),
            int(wait_ms % 1000 * 1000),
            int(0u8),
            text(c.id.to_string()),
            text(c.backend_pid.map(|p| p.to_string()).unwrap_or_default()),
            int(0u8),
            text(if c.tls { "TLS" } else { "" }),
            text(""),
            int(0u8),
            int(c.id),
        ]);
    }
    t
}

/// `SHOW SERVERS`: every backend connection, idle or held by a client. `ptr` is the
/// backend's pid, `link` the id of the client holding it.
pub fn servers(st: &AdminState) -> Table {
    let now = unix_ms();
    let mut t = Table::new(&SOCKET_COLUMNS);
    for s in control::server_rows(st) {
        // Idle in the pool, or parked with an idle client: usable by the next checkout.
        let state = if s.state == "idle" { "idle" } else { "active" };
        let at = |ms: Option<u64>| text(ms.map(|ms| timestamp(now - ms)).unwrap_or_default());
        t.push(vec![
            text("S"),
            text(&s.user),
            text(&s.database),
            text("none"),
            text(state),
            text(""),
            int(0u8),
            text(""),
            int(0u8),
            at(s.age_ms),
            at(s.idle_ms),
            int(0u8),
            int(0u8),
            int(0u8),
            text(s.pid.to_string()),
            text(s.client.map(|c| c.to_string()).unwrap_or_default()),
            int(s.pid),
            text(""),
            text(""),
            int(0u8),
            int(s.pid),
        ]);
    }
    t
}

/// Where a database's pools connect: (host, port, database on the server, forced user).
fn target_of(cfg: &Config, name: &str) -> (String, u16, String, Option<String>) {
    let url = match cfg.database_entry(name) {
        Some(e) => e.target(),
        None => cfg.backend_url(),
    };
    match url {
        Some(u) => {
            let forced = cfg
                .database_entry(name)
                .is_some()
                .then(|| u.user.clone())
                .filter(|u| !u.is_empty());
            let db = if u.database.is_empty() || u.database == "*" {
                name.to_owned()
            } else {
                u.database
            };
            (u.host, u.port, db, forced)
        }
        None => (
            cfg.backend.host.clone(),
            cfg.backend.port,
            name.to_owned(),
            None,
        ),
    }
}

/// `SHOW DATABASES`: the configured `databases[]` entries (`*` included), every database a
/// pool has been made for, and the console's names; then `reserve_pool` (PgBouncer 1.7's
/// name of `reserve_pool_size`, read by older exporters).
pub fn databases(st: &AdminState) -> Table {
    let cfg = st.app.config();
    let pools = read::pool_snapshots(st);
    let clients = control::client_rows(st);
    let disabled = st.app.disabled.read().clone();
    let mut t = Table::new(&[
        ("name", T),
        ("host", T),
        ("port", I4),
        ("database", T),
        ("force_user", T),
        ("pool_size", I4),
        ("min_pool_size", I4),
        ("reserve_pool_size", I4),
        ("server_lifetime", I4),
        ("pool_mode", T),
        ("load_balance_hosts", T),
        ("max_connections", I4),
        ("current_connections", I4),
        ("max_client_connections", I4),
        ("current_client_connections", I4),
        ("paused", I4),
        ("disabled", I4),
        ("reserve_pool", I4),
    ]);
    let mut names: BTreeSet<String> = cfg.databases.iter().map(|d| d.name.clone()).collect();
    names.extend(pools.iter().map(|p| p.database.clone()));
    for name in names {
        let (host, port, db, forced) = target_of(&cfg, &name);
        let pc: PoolConfig = cfg.pool_for(&name, "");
        let mine: Vec<&PoolSnapshot> = pools.iter().filter(|p| p.database == name).collect();
        let reserve = mine
            .iter()
            .map(|p| p.critical_reserve)
            .max()
            .unwrap_or_else(|| pc.critical_reserve.unwrap_or(0));
        let balanced = cfg
            .database_entry(&name)
            .and_then(|e| e.target())
            .is_some_and(|u| u.hosts.len() > 1);
        t.push(vec![
            text(&name),
            text(host),
            int(port),
            text(db),
            forced.map(text).unwrap_or(None),
            count(pc.size),
            count(pc.min_idle),
            count(reserve),
            int(pc.max_lifetime_ms / 1000),
            text(mode_name(pc.mode)),
            balanced.then(|| "disable".to_owned()),
            count(pc.max_db_connections),
            count(mine.iter().map(|p| p.open).sum()),
            count(0),
            count(clients.iter().filter(|c| c.database == name).count()),
            int(u8::from(mine.iter().any(|p| p.paused))),
            int(u8::from(disabled.contains(&name))),
            count(reserve),
        ]);
    }
    for name in &cfg.admin.console.databases {
        if !cfg.admin.console.enabled() {
            break;
        }
        t.push(vec![
            text(name),
            None,
            int(0u8),
            text(name),
            None,
            count(0),
            count(0),
            count(0),
            count(0),
            text("statement"),
            None,
            count(0),
            count(0),
            count(0),
            count(clients.iter().filter(|c| &c.database == name).count()),
            int(0u8),
            int(0u8),
            count(0),
        ]);
    }
    t
}

/// `SHOW USERS`: the users of `auth.users` and every user with a pool or a client.
pub fn users(st: &AdminState) -> Table {
    let cfg = st.app.config();
    let pools = read::pool_snapshots(st);
    let clients = control::client_rows(st);
    let mut names: BTreeSet<String> = cfg.auth.users.iter().map(|u| u.name.clone()).collect();
    names.extend(pools.iter().map(|p| p.user.clone()));
    names.extend(clients.iter().map(|c| c.user.clone()));
    let mut t = Table::new(&[
        ("name", T),
        ("pool_size", T),
        ("reserve_pool_size", T),
        ("pool_mode", T),
        ("max_user_connections", I4),
        ("current_connections", I4),
        ("max_user_client_connections", I4),
        ("current_client_connections", I4),
    ]);
    for name in names {
        t.push(vec![
            text(&name),
            text(""),
            text(""),
            None,
            count(cfg.pool.max_user_connections),
            count(
                pools
                    .iter()
                    .filter(|p| p.user == name)
                    .map(|p| p.open)
                    .sum(),
            ),
            count(0),
            count(clients.iter().filter(|c| c.user == name).count()),
        ]);
    }
    t
}

/// `SHOW LISTS`: counts, one per row. pgsluice keeps no free lists of client or server
/// objects and no DNS cache: those rows are 0.
pub fn lists(st: &AdminState) -> Table {
    let cfg = st.app.config();
    let pools = read::pool_snapshots(st);
    let mut databases: BTreeSet<&str> = cfg.databases.iter().map(|d| d.name.as_str()).collect();
    databases.extend(pools.iter().map(|p| p.database.as_str()));
    let mut users: BTreeSet<&str> = cfg.auth.users.iter().map(|u| u.name.as_str()).collect();
    users.extend(pools.iter().map(|p| p.user.as_str()));
    let clients = control::client_rows(st).len();
    let handshakes = st
        .app
        .stats
        .handshakes
        .load(std::sync::atomic::Ordering::Relaxed);
    let servers: usize = pools.iter().map(|p| p.open).sum();
    let mut t = Table::new(&[("list", T), ("items", I4)]);
    for (name, n) in [
        ("databases", databases.len()),
        ("users", users.len()),
        ("peers", cfg.peers.len()),
        ("pools", pools.len()),
        ("peer_pools", 0),
        ("free_clients", 0),
        ("used_clients", clients),
        ("login_clients", handshakes),
        ("free_servers", 0),
        ("used_servers", servers),
        ("dns_names", 0),
        ("dns_zones", 0),
        ("dns_queries", 0),
        ("dns_pending", 0),
    ] {
        t.push(vec![text(name), count(n)]);
    }
    t
}

/// `SHOW VERSION`.
pub fn version_table() -> Table {
    let mut t = Table::new(&[("version", T)]);
    t.push(vec![text(crate::app::CONSOLE_VERSION)]);
    t
}

/// `SHOW STATE`: PgBouncer's process states; pgsluice pauses pools, not the process, so
/// `paused` is `yes` when every pool is paused, and it is never suspended.
pub fn state(st: &AdminState) -> Table {
    let pools = read::pool_snapshots(st);
    let paused = !pools.is_empty() && pools.iter().all(|p| p.paused);
    let yes = |b: bool| text(if b { "yes" } else { "no" });
    let mut t = Table::new(&[("key", T), ("value", T)]);
    t.push(vec![
        text("active"),
        yes(!paused && !st.app.life.is_stopping()),
    ]);
    t.push(vec![text("paused"), yes(paused)]);
    t.push(vec![text("suspended"), yes(false)]);
    t
}

/// `SHOW CONFIG`: the settings an operator coming from PgBouncer looks for, under
/// pgsluice's names. `changeable` says whether RELOAD applies a change (the `pool` and
/// `backend` settings reach only pools made after it; existing pools keep theirs).
pub fn config(st: &AdminState) -> Table {
    let cfg = st.app.config();
    let mut t = Table::new(&[("key", T), ("value", T), ("default", T), ("changeable", T)]);
    for ((key, value), (_, default)) in settings(&cfg).into_iter().zip(settings(&Config::default()))
    {
        t.push(vec![
            text(key),
            text(value),
            text(default),
            text(if reloadable(key) { "yes" } else { "no" }),
        ]);
    }
    t
}

/// `SHOW CONFIG`'s rows of `c`: (key, value).
fn settings(c: &Config) -> Vec<(&'static str, String)> {
    let socket_dir = c
        .unix_socket_dir
        .as_ref()
        .map(|d| d.display().to_string())
        .unwrap_or_default();
    let console = &c.admin.console;
    vec![
        ("listen", c.listen.to_string()),
        ("unix_socket_dir", socket_dir),
        ("admin.listen", c.admin.listen.to_string()),
        ("admin.console.databases", console.databases.join(",")),
        ("admin.console.admin_users", console.admin_users.join(",")),
        ("admin.console.stats_users", console.stats_users.join(",")),
        (
            "auth.method",
            match c.auth.method {
                AuthMethod::ScramSha256 => "scram-sha-256",
                AuthMethod::Md5 => "md5",
                AuthMethod::Trust => "trust",
            }
            .into(),
        ),
        ("pool.mode", mode_name(c.pool.mode).into()),
        ("pool.size", c.pool.size.to_string()),
        ("pool.min_idle", c.pool.min_idle.to_string()),
        ("pool.idle_timeout_ms", c.pool.idle_timeout_ms.to_string()),
        ("pool.max_lifetime_ms", c.pool.max_lifetime_ms.to_string()),
        (
            "pool.checkout_timeout_ms",
            c.pool.checkout_timeout_ms.to_string(),
        ),
        ("pool.max_waiting", c.pool.max_waiting.to_string()),
        (
            "pool.max_db_connections",
            c.pool.max_db_connections.to_string(),
        ),
        (
            "pool.max_user_connections",
            c.pool.max_user_connections.to_string(),
        ),
        (
            "limits.max_client_conn",
            c.limits.max_client_conn.to_string(),
        ),
        (
            "limits.handshake_timeout_ms",
            c.limits.handshake_timeout_ms.to_string(),
        ),
        (
            "limits.client_idle_timeout_ms",
            c.limits.client_idle_timeout_ms.to_string(),
        ),
        (
            "backend.connect_timeout_ms",
            c.backend.connect_timeout_ms.to_string(),
        ),
        ("worker_threads", c.worker_threads.to_string()),
    ]
}

/// Whether RELOAD applies a change of `key` (docs/OPERATIONS.md, "Reload"): not the sockets
/// or threads, and of `pool` and `backend` only the shared `max_*_connections` limits.
fn reloadable(key: &str) -> bool {
    match key {
        "listen" | "unix_socket_dir" | "admin.listen" | "worker_threads" => false,
        "pool.max_db_connections" | "pool.max_user_connections" => true,
        k => !k.starts_with("pool.") && !k.starts_with("backend."),
    }
}
