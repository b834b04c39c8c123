//! PgBouncer's admin console on the client listener (`admin.console`): psql against `SHOW …`
//! after some traffic, the controls (`PAUSE`/`RESUME` hold and release a client), who may use
//! it (a stats user cannot `PAUSE`, other users are refused at login), errors that leave the
//! session usable, the column types psycopg2 sees, and Debian's
//! `prometheus-pgbouncer-exporter` scraping it.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::env::Env;
use crate::support::proxy::Proxy;
use crate::support::wire::{Backend, WireClient};

const ADMIN: (&str, &str) = ("ops", "ops-secret");
const STATS: (&str, &str) = ("watcher", "watch-secret");

/// Two console names (`pgbouncer` for PgBouncer's tools), one admin and one stats user.
const YAML: &str = r#"
admin:
  console:
    databases: [pgsluice, pgbouncer]
    admin_users: [ops]
    stats_users: [watcher]
auth:
  users:
    - name: ops
      password: ops-secret
    - name: watcher
      password: watch-secret
"#;

/// psql's answer: exit success, stdout, stderr.
struct Psql {
    ok: bool,
    out: String,
    err: String,
}

/// Runs each of `commands` as its own simple Query in one psql session (`-c` repeated, not
/// stopping at errors), unaligned with headers, errors with their SQLSTATE.
fn psql(proxy: &Proxy, who: (&str, &str), db: &str, commands: &[&str]) -> Psql {
    let mut cmd = proxy.tool_command("psql", who.0, who.1, db);
    cmd.args([
        "-X",
        "-A",
        "-F",
        "|",
        "-P",
        "footer=off",
        "-v",
        "VERBOSITY=verbose",
    ]);
    for c in commands {
        cmd.args(["-c", c]);
    }
    let out = cmd.output().expect("run psql");
    Psql {
        ok: out.status.success(),
        out: String::from_utf8_lossy(&out.stdout).into_owned(),
        err: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// One `SHOW` as (column names, rows by column name).
fn show(
    proxy: &Proxy,
    who: (&str, &str),
    what: &str,
) -> (Vec<String>, Vec<HashMap<String, String>>) {
    let r = psql(proxy, who, "pgbouncer", &[&format!("SHOW {what}")]);
    assert!(
        r.ok,
        "SHOW {what} failed: {}\n{}",
        r.err,
        proxy.stderr_tail()
    );
    let mut lines = r.out.lines();
    let header: Vec<String> = lines
        .next()
        .unwrap_or_default()
        .split('|')
        .map(str::to_owned)
        .collect();
    let rows = lines
        .map(|l| {
            header
                .iter()
                .cloned()
                .zip(l.split('|').map(str::to_owned))
                .collect()
        })
        .collect();
    (header, rows)
}

fn num(row: &HashMap<String, String>, col: &str) -> i64 {
    row.get(col)
        .unwrap_or_else(|| panic!("no column {col} in {row:?}"))
        .parse()
        .unwrap_or_else(|_| panic!("{col} is not a number in {row:?}"))
}

fn find<'a>(
    rows: &'a [HashMap<String, String>],
    pairs: &[(&str, &str)],
) -> Option<&'a HashMap<String, String>> {
    rows.iter().find(|r| {
        pairs
            .iter()
            .all(|(k, v)| r.get(*k).map(String::as_str) == Some(*v))
    })
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("blocking task")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_commands_answer_with_pgbouncer_columns_after_traffic() {
    let env = Env::start(4, YAML, |_| {});
    let proxy = &env.proxy;
    let client = proxy.client().await;
    for _ in 0..5 {
        client.simple_query("SELECT 1").await.expect("select");
    }
    client
        .batch_execute("BEGIN; SELECT pg_sleep(0); COMMIT")
        .await
        .expect("transaction");
    // One client holds its backend inside a transaction while the console looks.
    let holder = proxy.client().await;
    holder.batch_execute("BEGIN").await.expect("begin");
    holder.simple_query("SELECT 1").await.expect("in tx");

    let (cols, pools) = show(proxy, STATS, "POOLS");
    assert_eq!(
        cols,
        [
            "database",
            "user",
            "cl_active",
            "cl_waiting",
            "cl_active_cancel_req",
            "cl_waiting_cancel_req",
            "sv_active",
            "sv_active_cancel",
            "sv_being_canceled",
            "sv_idle",
            "sv_used",
            "sv_tested",
            "sv_login",
            "maxwait",
            "maxwait_us",
            "pool_mode",
            "load_balance_hosts"
        ]
    );
    let p = find(&pools, &[("database", "appdb"), ("user", "app")])
        .unwrap_or_else(|| panic!("no appdb/app pool in {pools:?}"));
    assert_eq!(num(p, "cl_active"), 2, "{p:?}");
    assert_eq!(num(p, "cl_waiting"), 0, "{p:?}");
    assert_eq!(num(p, "sv_active"), 1, "the holder's backend: {p:?}");
    let open = num(p, "sv_active") + num(p, "sv_idle");
    assert_eq!(p["pool_mode"], "transaction");
    assert!(
        !pools.iter().any(|r| r["database"] == "pgbouncer"),
        "the console has no pool: {pools:?}"
    );

    let (cols, stats) = show(proxy, STATS, "STATS");
    assert_eq!(
        cols[..4],
        [
            "database",
            "total_server_assignment_count",
            "total_xact_count",
            "total_query_count"
        ]
    );
    assert!(cols.iter().any(|c| c == "avg_query_time"));
    let s = find(&stats, &[("database", "appdb")]).unwrap_or_else(|| panic!("{stats:?}"));
    assert!(num(s, "total_xact_count") >= 6, "{s:?}");
    assert!(num(s, "total_query_count") >= 6, "{s:?}");
    assert!(
        num(s, "total_received") > 0 && num(s, "total_sent") > 0,
        "{s:?}"
    );
    assert!(num(s, "total_server_assignment_count") >= 1, "{s:?}");
    assert_eq!(num(s, "total_requests"), num(s, "total_query_count"));

    let (cols, totals) = show(proxy, STATS, "STATS_TOTALS");
    assert_eq!(
        cols[..3],
        ["database", "server_assignment_count", "xact_count"]
    );
    assert!(num(&totals[0], "xact_count") >= 6, "{totals:?}");

    let (cols, clients) = show(proxy, STATS, "CLIENTS");
    assert_eq!(
        cols[..5],
        ["type", "user", "database", "replication", "state"]
    );
    assert_eq!(cols.last().map(String::as_str), Some("id"));
    let app_clients: Vec<_> = clients
        .iter()
        .filter(|r| r["user"] == "app" && r["database"] == "appdb")
        .collect();
    assert_eq!(app_clients.len(), 2, "{clients:?}");
    assert!(
        app_clients
            .iter()
            .all(|r| r["type"] == "C" && r["addr"] == "127.0.0.1")
    );
    let linked = app_clients
        .iter()
        .find(|r| r["state"] == "active")
        .unwrap_or_else(|| panic!("the holder is active: {clients:?}"));
    assert!(
        find(&clients, &[("user", "watcher"), ("database", "pgbouncer")]).is_some(),
        "the console session itself is listed: {clients:?}"
    );

    let (_, servers) = show(proxy, STATS, "SERVERS");
    let held = find(&servers, &[("state", "active"), ("database", "appdb")])
        .unwrap_or_else(|| panic!("{servers:?}"));
    assert_eq!(held["type"], "S");
    assert_eq!(
        held["link"], linked["ptr"],
        "server and client point at each other"
    );
    assert_eq!(held["ptr"], linked["link"]);
    let pid = num(held, "remote_pid");
    let in_pg = env.cluster.psql(&format!(
        "SELECT count(*) FROM pg_stat_activity WHERE pid = {pid} AND usename = 'app'"
    ));
    assert_eq!(in_pg.trim(), "1", "remote_pid {pid} is a real backend");
    assert_eq!(
        servers.len() as i64,
        open,
        "SHOW SERVERS lists what SHOW POOLS counts"
    );

    let (_, version) = show(proxy, STATS, "VERSION");
    assert!(
        version[0]["version"].starts_with("pgsluice "),
        "{version:?}"
    );

    let (cols, config) = show(proxy, STATS, "CONFIG");
    assert_eq!(cols, ["key", "value", "default", "changeable"]);
    let size = find(&config, &[("key", "pool.size")]).unwrap_or_else(|| panic!("{config:?}"));
    assert_eq!(
        (size["value"].as_str(), size["default"].as_str()),
        ("4", "20")
    );
    assert_eq!(size["changeable"], "no");
    let users = find(&config, &[("key", "admin.console.stats_users")]).expect("console users");
    assert_eq!(users["value"], "watcher");

    let (cols, lists) = show(proxy, STATS, "LISTS");
    assert_eq!(cols, ["list", "items"]);
    let item = |name: &str| {
        num(
            find(&lists, &[("list", name)]).unwrap_or_else(|| panic!("{lists:?}")),
            "items",
        )
    };
    assert_eq!(item("pools"), 1);
    assert_eq!(
        item("used_clients"),
        3,
        "two app clients and this console session"
    );
    assert_eq!(item("used_servers"), open);
    assert_eq!(item("dns_names"), 0);

    let (_, dbs) = show(proxy, STATS, "DATABASES");
    let d = find(&dbs, &[("name", "appdb")]).unwrap_or_else(|| panic!("{dbs:?}"));
    assert_eq!(
        (num(d, "pool_size"), num(d, "paused"), num(d, "disabled")),
        (4, 0, 0)
    );
    assert_eq!(num(d, "current_connections"), open);
    assert_eq!(num(d, "current_client_connections"), 2);

    holder.batch_execute("COMMIT").await.expect("commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stats_user_cannot_pause_and_errors_leave_the_session_usable() {
    let env = Env::start(2, YAML, |_| {});
    let proxy = &env.proxy;
    proxy
        .client()
        .await
        .simple_query("SELECT 1")
        .await
        .expect("select");
    let r = psql(
        proxy,
        STATS,
        "pgsluice",
        &[
            "SHOW NONSENSE",
            "PAUSE appdb",
            "SELECT 1",
            "frobnicate;",
            "show version;",
        ],
    );
    assert!(!r.ok || r.err.contains("ERROR"), "{}", r.err);
    assert!(
        r.err.contains("42704") && r.err.contains("unknown SHOW item \"NONSENSE\""),
        "{}",
        r.err
    );
    assert!(
        r.err.contains("42501") && r.err.contains("permission denied for PAUSE"),
        "{}",
        r.err
    );
    assert!(
        r.err.contains("\"SELECT\" is not a console command"),
        "{}",
        r.err
    );
    assert!(
        r.err.contains("\"frobnicate\" is not a console command"),
        "{}",
        r.err
    );
    assert!(
        r.out.contains("pgsluice "),
        "the session went on after the errors: {}",
        r.out
    );
    // Nothing was paused, and nothing reached PostgreSQL for the console.
    let (_, pools) = show(proxy, STATS, "POOLS");
    assert_eq!(pools.len(), 1, "{pools:?}");
    let (_, dbs) = show(proxy, STATS, "DATABASES");
    assert_eq!(
        num(find(&dbs, &[("name", "appdb")]).expect("appdb"), "paused"),
        0
    );

    // The admin user may; a bad argument is an error, not a crash.
    let r = psql(
        proxy,
        ADMIN,
        "pgsluice",
        &["PAUSE nosuchdb", "RESUME appdb", "KILL"],
    );
    assert!(
        r.err.contains("no pool of database \"nosuchdb\""),
        "{}",
        r.err
    );
    assert!(r.err.contains("KILL needs a database name"), "{}", r.err);
    assert!(r.out.contains("RESUME"), "{}", r.out);

    // The extended protocol gets one error per Sync block; simple Query still works after.
    let mut w = WireClient::connect(proxy.addr(), STATS.0, STATS.1, "pgbouncer")
        .await
        .expect("console login");
    w.parse("", "SHOW POOLS").sync();
    w.send().await.expect("send");
    let got = w.until_ready().await.expect("answer");
    assert_eq!(
        got.iter()
            .filter_map(Backend::error_code)
            .collect::<Vec<_>>(),
        ["0A000"],
        "{got:?}"
    );
    let rows = w.simple("SHOW VERSION").await.expect("simple query after");
    assert!(
        rows.iter().flatten().any(|v| v.starts_with("pgsluice ")),
        "{rows:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_users_are_refused_at_login() {
    let env = Env::start(2, YAML, |_| {});
    let proxy = &env.proxy;
    let r = psql(proxy, ("app", "secret"), "pgbouncer", &["SHOW POOLS"]);
    assert!(
        !r.ok && r.err.contains("user \"app\" may not use the admin console"),
        "{}",
        r.err
    );
    let refused = WireClient::connect(proxy.addr(), "app", "secret", "pgsluice").await;
    let e = refused.err().expect("refused");
    assert!(e.starts_with("28000: "), "{e}");
    // A wrong password is an authentication failure first (the console is not revealed).
    let wrong = WireClient::connect(proxy.addr(), "ops", "wrong", "pgsluice").await;
    let e = wrong.err().expect("refused");
    assert!(e.starts_with("28P01: "), "{e}");
    // The console users may.
    for who in [ADMIN, STATS] {
        let r = psql(proxy, who, "pgsluice", &["SHOW LISTS"]);
        assert!(r.ok, "{}: {}", who.0, r.err);
    }
    // The same user reaches PostgreSQL through a database that is not a console.
    let r = psql(proxy, ("app", "secret"), "appdb", &["SELECT 41 + 1"]);
    assert!(r.ok && r.out.contains("42"), "{} {}", r.out, r.err);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_holds_a_client_and_resume_releases_it() {
    let env = Env::start(2, YAML, |_| {});
    let client = env.proxy.client().await;
    client
        .simple_query("SELECT 1")
        .await
        .expect("warm the pool");
    let p = &env.proxy;
    let r = psql(p, ADMIN, "pgsluice", &["PAUSE appdb"]);
    assert!(r.ok && r.out.contains("PAUSE"), "{} {}", r.out, r.err);

    let started = Instant::now();
    let held = tokio::spawn(async move {
        client
            .simple_query("SELECT 2")
            .await
            .map(|_| started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !held.is_finished(),
        "the query ran while the pool was paused"
    );
    let (_, pools) = show(p, STATS, "POOLS");
    let row = find(&pools, &[("database", "appdb")]).expect("pool");
    assert_eq!(num(row, "cl_waiting"), 1, "{row:?}");
    assert!(
        num(row, "maxwait_us") > 0 || num(row, "maxwait") > 0,
        "{row:?}"
    );
    let (_, dbs) = show(p, STATS, "DATABASES");
    assert_eq!(
        num(find(&dbs, &[("name", "appdb")]).expect("appdb"), "paused"),
        1
    );

    let r = psql(p, ADMIN, "pgsluice", &["resume appdb;"]);
    assert!(r.ok, "{}", r.err);
    let waited = tokio::time::timeout(Duration::from_secs(10), held)
        .await
        .expect("the held query finishes after RESUME")
        .expect("task")
        .expect("query");
    assert!(
        waited >= Duration::from_millis(700),
        "it was held: {waited:?}"
    );
}

/// A free TCP port on 127.0.0.1.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// GET `path` from `addr` over HTTP/1.0; the body, or `None` when nothing answers yet.
fn http_get(addr: SocketAddr, path: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.0 200").then(|| body.to_owned())
}

/// The value of the first series `name{labels…}` in Prometheus text.
fn series(metrics: &str, name_and_labels: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(name_and_labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psycopg2_sees_pgbouncer_column_types() {
    let env = Env::start(2, YAML, |_| {});
    env.proxy
        .client()
        .await
        .simple_query("SELECT 1")
        .await
        .expect("select");
    let addr = env.proxy.addr();
    let script = format!(
        "import psycopg2\n\
         c = psycopg2.connect(host='{}', port={}, user='watcher', password='watch-secret', dbname='pgbouncer')\n\
         c.set_session(autocommit=True)\n\
         cur = c.cursor()\n\
         for what in ('POOLS', 'STATS', 'LISTS', 'DATABASES'):\n\
         \x20   cur.execute('SHOW %s;' % what)\n\
         \x20   rows = cur.fetchall()\n\
         \x20   print(what, len(rows), ' '.join('%s:%d' % (d.name, d.type_code) for d in cur.description))\n",
        addr.ip(),
        addr.port()
    );
    let out = blocking(move || {
        Command::new("/usr/bin/python3")
            .args(["-c", &script])
            .output()
            .expect("run python3 (Debian's python3-psycopg2 is a test prerequisite)")
    })
    .await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{}",
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    let types: HashMap<&str, &str> = text
        .lines()
        .flat_map(|l| l.split(' ').skip(2))
        .filter_map(|c| c.split_once(':'))
        .collect();
    // text 25, int4 23, numeric 1700 — PgBouncer's types for these columns.
    for (col, oid) in [
        ("database", "25"),
        ("cl_active", "23"),
        ("maxwait", "23"),
        ("total_xact_count", "1700"),
        ("avg_query_time", "1700"),
        ("items", "23"),
        ("pool_size", "23"),
    ] {
        assert_eq!(types.get(col).copied(), Some(oid), "{col} in {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debian_pgbouncer_exporter_scrapes_the_console() {
    let bin = "/usr/bin/prometheus-pgbouncer-exporter";
    assert!(
        std::path::Path::new(bin).exists(),
        "{bin} is missing: install the Debian package prometheus-pgbouncer-exporter \
         (scripts/test does)"
    );
    let env = Env::start(2, YAML, |_| {});
    let client = env.proxy.client().await;
    for _ in 0..3 {
        client.simple_query("SELECT 1").await.expect("select");
    }
    let port = free_port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let proxy = env.proxy.addr();
    let mut exporter = Command::new(bin)
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--pgbouncer-host",
            &proxy.ip().to_string(),
            "--pgbouncer-port",
            &proxy.port().to_string(),
            "--pgbouncer-user",
            STATS.0,
        ])
        .env("PGPASSWORD", STATS.1)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the exporter");
    let metrics = blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(m) = http_get(addr, "/metrics") {
                return Some(m);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    })
    .await;
    let _ = exporter.kill();
    let out = exporter.wait_with_output().expect("exporter output");
    let metrics = metrics.unwrap_or_else(|| {
        panic!(
            "the exporter never served /metrics:\n{}\n{}",
            String::from_utf8_lossy(&out.stderr),
            env.proxy.stderr_tail()
        )
    });
    let get =
        |s: &str| series(&metrics, s).unwrap_or_else(|| panic!("no series {s} in:\n{metrics}"));
    // SHOW POOLS, SHOW STATS, SHOW DATABASES and SHOW LISTS, as this exporter names them.
    assert_eq!(
        get("pgbouncer_active_clients{database=\"appdb\",user=\"app\"}"),
        1.0
    );
    assert_eq!(
        get("pgbouncer_waiting_clients{database=\"appdb\",user=\"app\"}"),
        0.0
    );
    assert!(get("pgbouncer_requests_total{database=\"appdb\"}") >= 3.0);
    assert!(get("pgbouncer_received_bytes_total{database=\"appdb\"}") > 0.0);
    assert!(get("pgbouncer_sent_bytes_total{database=\"appdb\"}") > 0.0);
    assert!(get("pgbouncer_query_microseconds_total{database=\"appdb\"}") > 0.0);
    assert_eq!(get("pgbouncer_pool_size{database=\"appdb\"}"), 2.0);
    assert_eq!(get("pgbouncer_pools "), 1.0);
    assert!(get("pgbouncer_used_clients ") >= 2.0);
}
