//! End-to-end tests of the traffic policy (issue 5) against a real PostgreSQL: per-caller
//! concurrency limits and queues, priority-ordered pool checkout, token-bucket rate limits, the
//! circuit breaker (error streaks and the health probe), injected statement/lock timeouts and
//! the proxy's backstop behind them, refusals inside transactions, and hot reload on SIGHUP.
//!
//! Every test starts its own cluster and proxy with a YAML config written to a temp dir, so
//! caller tables, breakers and buckets never leak between tests. Refusals are checked the way a
//! client sees them: SQLSTATE, the `pgsluice: ERR_…` message, a DETAIL naming the limit and a
//! `retry_after_ms=N` HINT. Timing assertions use generous slack (the suite must pass on two
//! busy cores) but keep "at once" (well under the competing sleeps) distinct from "after the
//! timeout". Every await on the proxy or the database is bounded by `within`.
//!
//! These tests are about the proxy's policy; with `PGSLUICE_TEST_DIRECT=1` they are skipped.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;
use tokio_postgres::error::{DbError, ErrorPosition};
use tokio_postgres::types::Type;
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::sql::{STEP, scalar, simple_values, sqlstate};
use crate::support::{direct_mode, note_skipped, within};

// ------------------------------------------------------------------------------ helpers

/// A cluster, a proxy in front of it, and the config file the proxy reads (and re-reads on
/// SIGHUP). Field order is drop order: proxy first, then the cluster, then the temp dir.
struct Env {
    proxy: Proxy,
    cluster: Cluster,
    config: PathBuf,
    _dir: tempfile::TempDir,
}

/// Starts a cluster and a transaction-mode proxy with `pool` backends and config `yaml`;
/// `None` (after saying so) in direct mode, where there is no policy to test.
fn start(pool: usize, yaml: &str) -> Option<Env> {
    start_with(pool, yaml, |_| {})
}

/// As [`start`], running `prepare` against the cluster before the proxy starts.
fn start_with(pool: usize, yaml: &str, prepare: impl FnOnce(&Cluster)) -> Option<Env> {
    if direct_mode() {
        note_skipped("the whole policy test (it needs the proxy)");
        return None;
    }
    let dir = tempfile::Builder::new()
        .prefix("pgsluice-policy-")
        .tempdir()
        .expect("temp dir for the config");
    let config = dir.path().join("pgsluice.yaml");
    std::fs::write(&config, yaml).expect("write the config");
    let cluster = Cluster::start();
    prepare(&cluster);
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(pool).config_file(&config));
    Some(Env {
        proxy,
        cluster,
        config,
        _dir: dir,
    })
}

/// A client of the proxy as `app`, with `application_name` if given.
async fn connect(proxy: &Proxy, application_name: Option<&str>) -> Client {
    let mut cfg = proxy.app_config();
    if let Some(name) = application_name {
        cfg.application_name(name);
    }
    proxy.client_with(&cfg).await.0
}

/// `n` clients with the same `application_name`, shareable with spawned tasks.
async fn connect_many(proxy: &Proxy, application_name: Option<&str>, n: usize) -> Vec<Arc<Client>> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(Arc::new(connect(proxy, application_name).await));
    }
    clients
}

/// A client connected straight to PostgreSQL as `app` (the reference behaviour).
async fn direct_client(cluster: &Cluster) -> Client {
    let (client, conn) = within(
        STEP,
        "a direct connection as app",
        tokio_postgres::connect(&cluster.connect_str(APP_USER, APP_PASSWORD, APP_DB), NoTls),
    )
    .await
    .expect("direct connection as app");
    tokio::spawn(conn);
    client
}

/// The outcome of one simple query and how long it took.
struct Timed {
    elapsed: Duration,
    result: Result<Vec<SimpleQueryMessage>, tokio_postgres::Error>,
}

impl Timed {
    fn is_ok(&self) -> bool {
        self.result.is_ok()
    }

    /// The error, or a panic naming `what` succeeded unexpectedly.
    fn err(&self, what: &str) -> &tokio_postgres::Error {
        match &self.result {
            Ok(_) => panic!(
                "{what}: succeeded after {:?}, expected an error",
                self.elapsed
            ),
            Err(e) => e,
        }
    }
}

async fn timed(client: &Client, sql: &str) -> Timed {
    let start = Instant::now();
    let result = within(STEP, sql, client.simple_query(sql)).await;
    Timed {
        elapsed: start.elapsed(),
        result,
    }
}

fn spawn_timed(client: &Arc<Client>, sql: &str) -> JoinHandle<Timed> {
    let (client, sql) = (Arc::clone(client), sql.to_string());
    tokio::spawn(async move { timed(&client, &sql).await })
}

async fn join<T>(task: JoinHandle<T>) -> T {
    within(STEP, "a client task", task)
        .await
        .expect("client task panicked")
}

async fn join_all<T>(tasks: Vec<JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(join(t).await);
    }
    out
}

/// Runs a statement that must succeed.
async fn exec(client: &Client, sql: &str) {
    within(STEP, sql, client.batch_execute(sql))
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
}

/// The server error inside `e` (panics if it is a connection-level error).
fn db_error(e: &tokio_postgres::Error) -> &DbError {
    e.as_db_error()
        .unwrap_or_else(|| panic!("expected an ErrorResponse, got {e:?}"))
}

/// Asserts `e` is a pgsluice refusal with `code` and `err_code` in its message, a DETAIL and
/// a `retry_after_ms=N` HINT; returns the server error and N.
fn assert_refusal<'a>(
    e: &'a tokio_postgres::Error,
    code: &str,
    err_code: &str,
) -> (&'a DbError, u64) {
    let db = db_error(e);
    assert_eq!(db.code().code(), code, "SQLSTATE of {db:?}");
    assert!(
        db.message().starts_with("pgsluice: ") && db.message().contains(err_code),
        "message should be `pgsluice: {err_code}: …`: {db:?}"
    );
    assert!(
        db.detail().is_some_and(|d| !d.is_empty()),
        "a refusal's DETAIL names the limit: {db:?}"
    );
    if err_code == "ERR_QUERY_BLOCKED" {
        // Not retryable: no hint, and the DETAIL says so.
        assert_eq!(
            db.hint(),
            None,
            "a blocked pattern carries no retry hint: {db:?}"
        );
        assert!(detail(db).ends_with("(not retryable)"), "{db:?}");
        return (db, 0);
    }
    let retry = retry_after_ms(db);
    (db, retry)
}

/// N from a `retry_after_ms=N` HINT.
fn retry_after_ms(db: &DbError) -> u64 {
    let hint = db
        .hint()
        .unwrap_or_else(|| panic!("refusal without a HINT: {db:?}"));
    hint.strip_prefix("retry_after_ms=")
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("HINT should be retry_after_ms=<n>, got {hint:?}"))
}

fn detail(db: &DbError) -> &str {
    db.detail().unwrap_or("")
}

/// The error position (1-based, in characters) of a server error.
fn position(e: &tokio_postgres::Error) -> Option<u32> {
    match db_error(e).position() {
        Some(ErrorPosition::Original(p)) => Some(*p),
        Some(ErrorPosition::Internal { position, .. }) => Some(*position),
        None => None,
    }
}

/// Polls `cond` every 25 ms for up to `limit`; returns whether it became true.
async fn poll_until<F, Fut>(limit: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// `GET path` on the admin API (reads are open in the configs that use this), as JSON.
async fn admin_get(proxy: &Proxy, path: &str) -> serde_json::Value {
    let addr = proxy
        .admin_addr()
        .expect("the proxy printed its admin address");
    let text = within(STEP, path, async {
        let mut s = tokio::net::TcpStream::connect(addr)
            .await
            .expect("connect admin");
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
        s.write_all(request.as_bytes())
            .await
            .expect("send admin request");
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.expect("read admin reply");
        String::from_utf8_lossy(&buf).into_owned()
    })
    .await;
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP reply");
    assert!(
        head.starts_with("HTTP/1.1 200"),
        "GET {path}: {head}\n{body}"
    );
    let start = body.find(['[', '{']).expect("a JSON body");
    let end = body.rfind([']', '}']).expect("a JSON body");
    serde_json::from_str(&body[start..=end]).unwrap_or_else(|e| panic!("GET {path}: {e}: {body}"))
}

/// Clients waiting for a backend in all pools, from `GET /v1/pools`.
async fn pool_waiting(proxy: &Proxy) -> u64 {
    let reply = admin_get(proxy, "/v1/pools").await;
    // `{"pools": [...]}` (or a bare array, as the first admin API had it).
    let pools = reply.get("pools").unwrap_or(&reply);
    pools
        .as_array()
        .unwrap_or_else(|| panic!("GET /v1/pools: no array of pools in {reply}"))
        .iter()
        .map(|p| p["waiting"].as_u64().expect("waiting count"))
        .sum()
}

/// Waits until `GET /v1/breaker` reports `state`; returns the snapshot. A client can see a
/// statement's error before the proxy has told the breaker about it, so tests that need the
/// breaker's verdict wait for it here instead of racing it.
async fn wait_for_breaker(proxy: &Proxy, state: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let snapshot = admin_get(proxy, "/v1/breaker").await;
        if snapshot["state"] == state {
            return snapshot;
        }
        assert!(
            Instant::now() < deadline,
            "the breaker never became {state}: {snapshot}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn wait_for_pool_waiting(proxy: &Proxy, n: u64, what: &str) {
    let reached = poll_until(Duration::from_secs(5), move || async move {
        pool_waiting(proxy).await == n
    })
    .await;
    assert!(
        reached,
        "expected {n} pool waiters ({what}), the admin API reports {}",
        pool_waiting(proxy).await
    );
}

/// Waits until PostgreSQL shows `n` running statements containing `needle`.
async fn wait_for_running(cluster: &Cluster, needle: &str, n: usize) {
    let monitor = cluster.monitor().await;
    let monitor = &monitor;
    let reached = poll_until(Duration::from_secs(5), move || async move {
        monitor.active_queries_like(needle).await.len() >= n
    })
    .await;
    assert!(reached, "{n} statements like {needle:?} never ran together");
}

/// Sends SIGHUP to the proxy and waits for its log to report the outcome; returns whether the
/// reload was applied (`configuration reloaded`) or rejected.
async fn sighup(proxy: &Proxy) -> bool {
    let count = |needle: &str| proxy.stderr_tail().matches(needle).count();
    let (ok0, bad0) = (count("configuration reloaded"), count("reload rejected"));
    let pid = proxy.pid().expect("a proxy process");
    let status = std::process::Command::new("kill")
        .arg("-HUP")
        .arg(pid.to_string())
        .status()
        .expect("run kill -HUP");
    assert!(status.success(), "kill -HUP {pid} failed");
    let mut outcome = None;
    let seen = poll_until(Duration::from_secs(5), || {
        let (ok, bad) = (count("configuration reloaded"), count("reload rejected"));
        if ok > ok0 {
            outcome = Some(true);
        } else if bad > bad0 {
            outcome = Some(false);
        }
        std::future::ready(outcome.is_some())
    })
    .await;
    assert!(
        seen,
        "the proxy logged no reload outcome after SIGHUP:\n{}",
        proxy.stderr_tail()
    );
    outcome.expect("reload outcome")
}

// ------------------------------------------------------------------------------ caller limits

const SEED_CONFIG: &str = r#"
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
"#;

/// The seed scenario: the sixth concurrent analytics query is refused at once with 53300
/// `ERR_CALLER_LIMIT_EXCEEDED` while payment queries keep running fast — including one sent
/// on an `analytics` connection but tagged `service:billing` (tags win over
/// application_name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn analytics_flood_is_refused_at_once_while_payment_runs() {
    let Some(env) = start(10, SEED_CONFIG) else {
        return;
    };
    let analytics = connect_many(&env.proxy, Some("analytics"), 7).await;
    let payment = connect(&env.proxy, Some("payments")).await;
    assert_eq!(scalar(&payment, "/*service:billing*/ SELECT 1").await, "1");

    let launched = Instant::now();
    let flood: Vec<_> = analytics[..6]
        .iter()
        .map(|c| spawn_timed(c, "SELECT pg_sleep(1)"))
        .collect();
    tokio::time::sleep(Duration::from_millis(150)).await;

    // Payment traffic during the flood: fast and never refused.
    let mut slowest = Duration::ZERO;
    for i in 0..10 {
        let t = timed(&payment, &format!("/*service:billing*/ SELECT {i}")).await;
        assert!(t.is_ok(), "payment query {i} failed: {:?}", t.result.err());
        slowest = slowest.max(t.elapsed);
    }
    let tagged = timed(&analytics[6], "/*service:billing*/ SELECT 42").await;
    assert!(
        tagged.is_ok(),
        "a billing-tagged statement on an analytics connection is service_payment's: {:?}",
        tagged.result.err()
    );
    let payment_done = launched.elapsed();

    let results = join_all(flood).await;
    let (ok, refused): (Vec<&Timed>, Vec<&Timed>) = results.iter().partition(|t| t.is_ok());
    assert_eq!(
        ok.len(),
        5,
        "5 of 6 analytics queries run (max_concurrency 5)"
    );
    assert_eq!(refused.len(), 1, "exactly one analytics query is refused");
    let r = refused[0];
    let (db, _) = assert_refusal(
        r.err("the sixth analytics query"),
        "53300",
        "ERR_CALLER_LIMIT_EXCEEDED",
    );
    assert!(
        db.message().contains("service_analytics"),
        "names the caller: {db:?}"
    );
    assert!(
        detail(db).contains("max_concurrency=5"),
        "DETAIL names the limit: {db:?}"
    );
    assert!(
        r.elapsed < Duration::from_millis(500),
        "the refusal must come at once, not after a sleep: {:?}",
        r.elapsed
    );
    for t in &ok {
        assert!(
            t.elapsed >= Duration::from_millis(950),
            "pg_sleep(1) ran: {:?}",
            t.elapsed
        );
    }
    assert!(
        slowest < Duration::from_millis(500),
        "payment latency stays low during the flood; slowest {slowest:?}"
    );
    assert!(
        payment_done < Duration::from_millis(1000),
        "payment finished while analytics still slept ({payment_done:?}): it never queued behind them"
    );

    // Slots come back once the flood ends.
    assert_eq!(scalar(&analytics[0], "SELECT 7").await, "7");
    env.proxy.assert_healthy().await;
}

/// tokio-postgres' `client.query(&str)` and `prepare` + `query(&stmt)` send the Parse in one
/// batch and the Bind/Execute in a later one: the execution must be admitted like any other
/// statement (here: refused while the caller's only slot is taken).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statement_executions_are_admitted_like_any_other() {
    let Some(env) = start(
        6,
        r#"
callers:
  - name: single
    match: { application_name: single }
    max_concurrency: 1
    queue_depth: 0
    queue_timeout_ms: 0
"#,
    ) else {
        return;
    };
    let holder = Arc::new(connect(&env.proxy, Some("single")).await);
    let other = connect(&env.proxy, Some("single")).await;
    let statement = within(STEP, "prepare", other.prepare("SELECT 1::int AS one"))
        .await
        .expect("prepare while the caller is idle");

    let hold = spawn_timed(&holder, "SELECT pg_sleep(1)");
    wait_for_running(&env.cluster, "pg_sleep(1)", 1).await;

    let started = Instant::now();
    let r = within(
        STEP,
        "execute the prepared statement",
        other.query(&statement, &[]),
    )
    .await;
    match r {
        Ok(rows) => panic!(
            "executing a prepared statement bypassed the caller's max_concurrency=1 \
             (got {} row(s) after {:?} while the only slot was held)",
            rows.len(),
            started.elapsed()
        ),
        Err(e) => {
            assert_refusal(&e, "53300", "ERR_CALLER_LIMIT_EXCEEDED");
        }
    }
    let r = within(
        STEP,
        "query(&str) = prepare + execute",
        other.query("SELECT 2::int", &[]),
    )
    .await;
    assert!(
        r.is_err(),
        "client.query(&str) ran while the caller's only slot was held"
    );
    assert!(join(hold).await.is_ok());
    let rows = within(
        STEP,
        "execute after the slot is free",
        other.query(&statement, &[]),
    )
    .await
    .expect("execute once the slot is free");
    assert_eq!(rows[0].get::<_, i32>(0), 1);
}

/// Over an exhausted pool, waiters are served critical before low even when the low ones
/// queued first; a waiter whose client disconnects leaves the queue at once and never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_waiters_are_served_critical_first_and_leave_when_they_disconnect() {
    let Some(env) = start(
        2,
        r#"
admin: { open_reads: true }
# No critical reserve: this test is about the order of waiters on an exhausted pool.
pool: { checkout_timeout_ms: 8000, critical_reserve: 0 }
global_defaults: { queue_timeout_ms: 8000 }
callers:
  - name: service_payment
    match: { tag: { service: billing } }
    max_concurrency: 50
    queue_depth: 20
    queue_timeout_ms: 8000
    priority: critical
  - name: batch
    match: { application_name: batch }
    priority: low
  - name: filler
    match: { application_name: filler }
    priority: normal
"#,
    ) else {
        return;
    };
    let setup = connect(&env.proxy, None).await;
    exec(
        &setup,
        "CREATE TABLE served (id serial PRIMARY KEY, who text NOT NULL)",
    )
    .await;
    drop(setup);

    let fillers = connect_many(&env.proxy, Some("filler"), 2).await;
    let low = connect_many(&env.proxy, Some("batch"), 3).await;
    let critical = connect_many(&env.proxy, None, 3).await;
    let (gone, gone_task) = env.proxy.client_with(&env.proxy.app_config()).await;
    let gone = Arc::new(gone);

    let started = Instant::now();
    // The fillers free their slots 0.9 s apart, so the six waiters are granted one slot in
    // turn (50 ms each) and their inserts cannot race each other for the serial id.
    let fill: Vec<_> = fillers
        .iter()
        .zip(["SELECT pg_sleep(2)", "SELECT pg_sleep(2.9)"])
        .map(|(c, sql)| spawn_timed(c, sql))
        .collect();
    wait_for_running(&env.cluster, "pg_sleep(2", 2).await;

    let mut waiters = Vec::new();
    for (i, c) in low.iter().enumerate() {
        let sql = format!("INSERT INTO served (who) VALUES ('low-{i}'); SELECT pg_sleep(0.05)");
        waiters.push(spawn_timed(c, &sql));
        wait_for_pool_waiting(&env.proxy, i as u64 + 1, "low waiters").await;
    }
    let gone_waiter = spawn_timed(
        &gone,
        "/*service:billing*/ INSERT INTO served (who) VALUES ('gone'); SELECT pg_sleep(0.05)",
    );
    wait_for_pool_waiting(&env.proxy, 4, "the waiter that will disconnect").await;
    gone_task.abort();
    let left = Instant::now();
    wait_for_pool_waiting(&env.proxy, 3, "after a waiter's client disconnected").await;
    assert!(
        left.elapsed() < Duration::from_millis(1000),
        "a disconnected waiter leaves the queue at once ({:?})",
        left.elapsed()
    );
    for (i, c) in critical.iter().enumerate() {
        let sql = format!(
            "/*service:billing*/ INSERT INTO served (who) VALUES ('critical-{i}'); SELECT pg_sleep(0.05)"
        );
        waiters.push(spawn_timed(c, &sql));
        wait_for_pool_waiting(&env.proxy, 4 + i as u64, "critical waiters").await;
    }
    assert!(
        started.elapsed() < Duration::from_millis(1800),
        "setup took {:?}; the fillers' 2 s sleep no longer covers it (machine too slow?)",
        started.elapsed()
    );

    for t in join_all(fill).await {
        assert!(t.is_ok(), "filler: {:?}", t.result.err());
    }
    for t in join_all(waiters).await {
        assert!(
            t.is_ok(),
            "every waiter runs within the 8 s checkout timeout: {:?}",
            t.result.err()
        );
    }
    let _ = join(gone_waiter).await; // its connection is gone: an error on the client side

    let check = connect(&env.proxy, None).await;
    let order = within(
        STEP,
        "served order",
        check.simple_query("SELECT who FROM served ORDER BY id"),
    )
    .await
    .expect("read served order");
    let order: Vec<String> = simple_values(&order)
        .into_iter()
        .map(|v| v.unwrap_or_default())
        .collect();
    assert_eq!(
        order.len(),
        6,
        "three low and three critical waiters ran, the gone one did not: {order:?}"
    );
    let kinds: Vec<&str> = order
        .iter()
        .map(|w| w.split('-').next().unwrap_or(""))
        .collect();
    assert_eq!(
        kinds,
        ["critical", "critical", "critical", "low", "low", "low"],
        "pool waiters must be served critical → low (low queued first): {order:?}"
    );
    let low_order: Vec<&String> = order.iter().filter(|w| w.starts_with("low")).collect();
    assert_eq!(
        low_order,
        ["low-0", "low-1", "low-2"],
        "FIFO within a priority"
    );
}

/// Queue deadlines: a pool checkout waits at most `checkout_timeout_ms`, a caller-slot wait at
/// most the caller's `queue_timeout_ms`, both answered with 53300 `ERR_QUEUE_TIMEOUT` after
/// about 200 ms and never much later; a full caller queue refuses at once; a waiter whose slot
/// frees in time runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_timeouts_refuse_after_about_200ms_never_later() {
    let Some(env) = start(
        2,
        r#"
# No critical reserve: the fillers must be able to exhaust the pool.
pool: { checkout_timeout_ms: 200, critical_reserve: 0 }
callers:
  - name: service_payment
    match: { tag: { service: billing } }
    max_concurrency: 50
    queue_depth: 20
    queue_timeout_ms: 200
    priority: critical
  - name: capped
    match: { application_name: capped }
    max_concurrency: 1
    queue_depth: 1
    queue_timeout_ms: 200
  - name: filler
    match: { application_name: filler }
"#,
    ) else {
        return;
    };
    let slack = Duration::from_millis(700);
    let fillers = connect_many(&env.proxy, Some("filler"), 2).await;
    let payment = connect_many(&env.proxy, None, 4).await;

    // 1. Exhausted pool: payment waiters time out on the checkout.
    let fill: Vec<_> = fillers
        .iter()
        .map(|c| spawn_timed(c, "SELECT pg_sleep(1.5)"))
        .collect();
    wait_for_running(&env.cluster, "pg_sleep(1.5)", 2).await;
    let waits: Vec<_> = payment
        .iter()
        .map(|c| spawn_timed(c, "/*service:billing*/ SELECT 1"))
        .collect();
    for t in join_all(waits).await {
        let (db, _) = assert_refusal(
            t.err("a payment waiter over an exhausted pool"),
            "53300",
            "ERR_QUEUE_TIMEOUT",
        );
        assert!(
            t.elapsed >= Duration::from_millis(180)
                && t.elapsed < Duration::from_millis(200) + slack,
            "refused after {:?}; expected about 200 ms",
            t.elapsed
        );
        assert!(
            detail(db).contains("checkout wait of 200 ms"),
            "DETAIL names the configured limit (200 ms): {db:?}"
        );
    }
    for t in join_all(fill).await {
        assert!(t.is_ok(), "filler: {:?}", t.result.err());
    }

    // 2. Caller slots: one runs, one queues and times out, one finds the queue full.
    let capped = connect_many(&env.proxy, Some("capped"), 3).await;
    let hold = spawn_timed(&capped[0], "SELECT pg_sleep(1)");
    wait_for_running(&env.cluster, "pg_sleep(1)", 1).await;
    let queued = spawn_timed(&capped[1], "SELECT 1");
    tokio::time::sleep(Duration::from_millis(60)).await;
    let overflow = spawn_timed(&capped[2], "SELECT 2");
    let (a, b) = (join(queued).await, join(overflow).await);
    let codes = |t: &Timed| {
        db_error(t.err("a capped caller's extra query"))
            .message()
            .to_string()
    };
    let (timed_out, full) = if codes(&a).contains("ERR_QUEUE_TIMEOUT") {
        (a, b)
    } else {
        (b, a)
    };
    let (db, _) = assert_refusal(
        timed_out.err("the queued statement"),
        "53300",
        "ERR_QUEUE_TIMEOUT",
    );
    assert!(
        detail(db).contains("queue_timeout_ms=200"),
        "DETAIL names the limit: {db:?}"
    );
    assert!(
        timed_out.elapsed >= Duration::from_millis(180)
            && timed_out.elapsed < Duration::from_millis(200) + slack,
        "queued statement refused after {:?}; expected about 200 ms",
        timed_out.elapsed
    );
    let (db, _) = assert_refusal(
        full.err("the statement finding the queue full"),
        "53300",
        "ERR_CALLER_LIMIT_EXCEEDED",
    );
    assert!(
        detail(db).contains("queue_depth=1"),
        "DETAIL names the limit: {db:?}"
    );
    assert!(
        full.elapsed < Duration::from_millis(150),
        "a full queue refuses at once: {:?}",
        full.elapsed
    );
    assert!(join(hold).await.is_ok());

    // 3. A waiter whose slot frees before its deadline runs.
    let hold = spawn_timed(&capped[0], "SELECT pg_sleep(0.15)");
    tokio::time::sleep(Duration::from_millis(40)).await;
    let waiter = timed(&capped[1], "SELECT 3").await;
    assert!(
        waiter.is_ok(),
        "the slot freed within queue_timeout_ms: {:?}",
        waiter.result.err()
    );
    assert!(
        waiter.elapsed >= Duration::from_millis(40),
        "it waited for the slot: {:?}",
        waiter.elapsed
    );
    assert!(join(hold).await.is_ok());
    env.proxy.assert_healthy().await;
}

// ------------------------------------------------------------------------------ timeouts

const TIMEOUT_CONFIG: &str = r#"
callers:
  - name: reporting
    match: { application_name: reporting }
    statement_timeout_ms: { read: 800, write: 5000 }
    lock_timeout_ms: 200
"#;

/// `SELECT pg_sleep(2)` through the extended protocol (unnamed statement, typed parameter).
async fn timed_typed_sleep(client: &Client) -> Timed {
    let start = Instant::now();
    let r = within(
        STEP,
        "query_typed pg_sleep",
        client.query_typed("SELECT pg_sleep($1)", &[(&2.0f64, Type::FLOAT8)]),
    )
    .await;
    Timed {
        elapsed: start.elapsed(),
        result: r.map(|_| Vec::new()),
    }
}

fn assert_statement_timeout(t: &Timed, what: &str) {
    let e = t.err(what);
    assert_eq!(sqlstate(e), "57014", "{what}: {e:?}");
    assert!(
        db_error(e).message().contains("statement timeout"),
        "{what}: cancelled by Postgres' statement_timeout, not the backstop: {e:?}"
    );
    assert!(
        t.elapsed >= Duration::from_millis(750) && t.elapsed < Duration::from_millis(1800),
        "{what}: cancelled after {:?}, expected about 800 ms",
        t.elapsed
    );
}

/// TESTS.md B7's lesson for the SQL the proxy runs inside a client's session: a client whose
/// `search_path` puts its own schema first, holding its own `set_config` and
/// `current_setting`, cannot neutralize the injected statement timeout — from the startup
/// packet's `options`, from a tracked `SET`, simple and extended protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_search_path_cannot_neutralize_the_injected_timeout() {
    let Some(env) = start(4, TIMEOUT_CONFIG) else {
        return;
    };
    let setup = connect(&env.proxy, None).await;
    exec(&setup, "CREATE SCHEMA evil").await;
    exec(
        &setup,
        "CREATE FUNCTION evil.set_config(text, text, boolean) RETURNS text \
         LANGUAGE sql AS $$ SELECT 'neutralized'::text $$",
    )
    .await;
    exec(
        &setup,
        "CREATE FUNCTION evil.current_setting(text) RETURNS text \
         LANGUAGE sql AS $$ SELECT '1h'::text $$",
    )
    .await;
    // The trap works: unqualified calls under this search_path reach the schema's functions.
    exec(&setup, "SET search_path = evil, pg_catalog").await;
    assert_eq!(
        scalar(
            &setup,
            "SELECT set_config('statement_timeout', '1ms', true)"
        )
        .await,
        "neutralized"
    );
    drop(setup);

    let mut cfg = env.proxy.app_config();
    cfg.application_name("reporting")
        .options("-c search_path=evil,pg_catalog");
    let from_startup = env.proxy.client_with(&cfg).await.0;
    assert_eq!(
        scalar(&from_startup, "SHOW search_path")
            .await
            .replace(' ', ""),
        "evil,pg_catalog"
    );
    let t = timed(&from_startup, "SELECT pg_sleep(2)").await;
    assert_statement_timeout(&t, "search_path from the startup packet");

    let from_set = connect(&env.proxy, Some("reporting")).await;
    exec(&from_set, "SET search_path = evil, pg_catalog").await;
    let t = timed(&from_set, "SELECT pg_sleep(2)").await;
    assert_statement_timeout(&t, "search_path from a tracked SET");
    let t = timed_typed_sleep(&from_set).await;
    assert_statement_timeout(&t, "search_path from a tracked SET, extended protocol");
}

/// statement_timeout 800 ms (read) cancels `pg_sleep(2)` with 57014 through the simple
/// protocol, the extended protocol (unnamed and prepared) and inside BEGIN … COMMIT, while a
/// write of the same caller gets its own 5 s budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statement_timeout_cancels_simple_extended_and_in_transaction() {
    let Some(env) = start(4, TIMEOUT_CONFIG) else {
        return;
    };
    let client = connect(&env.proxy, Some("reporting")).await;

    let t = timed(&client, "SELECT pg_sleep(2)").await;
    assert_statement_timeout(&t, "simple protocol");

    let t = timed_typed_sleep(&client).await;
    assert_statement_timeout(&t, "extended protocol (unnamed statement)");

    let statement = within(STEP, "prepare", client.prepare("SELECT pg_sleep(2)"))
        .await
        .expect("prepare");
    let start = Instant::now();
    let r = within(
        STEP,
        "execute prepared pg_sleep",
        client.query(&statement, &[]),
    )
    .await;
    assert_statement_timeout(
        &Timed {
            elapsed: start.elapsed(),
            result: r.map(|_| Vec::new()),
        },
        "extended protocol (prepared statement)",
    );

    // Inside an explicit transaction: the timeout is injected before the statement.
    exec(&client, "BEGIN").await;
    assert_eq!(scalar(&client, "SELECT 1").await, "1");
    let t = timed(&client, "SELECT pg_sleep(2)").await;
    assert_statement_timeout(&t, "inside BEGIN");
    let t = timed(&client, "SELECT 1").await;
    assert_eq!(
        sqlstate(t.err("after the timeout in a transaction")),
        "25P02"
    );
    exec(&client, "COMMIT").await;

    // Extended protocol inside a transaction.
    exec(&client, "BEGIN").await;
    let t = timed_typed_sleep(&client).await;
    assert_statement_timeout(&t, "extended protocol inside BEGIN");
    exec(&client, "ROLLBACK").await;

    // A write has the caller's write budget (5 s), so a 1.2 s write completes.
    exec(&client, "CREATE TABLE sink (v int)").await;
    let t = timed(&client, "INSERT INTO sink SELECT 1 FROM pg_sleep(1.2)").await;
    assert!(
        t.is_ok(),
        "a write within its 5 s budget: {:?}",
        t.result.err()
    );
    assert!(t.elapsed >= Duration::from_millis(1150));
    assert_eq!(scalar(&client, "SELECT count(*) FROM sink").await, "1");
    env.proxy.assert_healthy().await;
}

/// The proxy's backstop belongs to the statements it was armed for. A budgeted `SELECT 1`
/// arms it for 3 s + 1 s; the transaction then idles, and a `DO` block (kind `other`, which
/// arms nothing) runs across that deadline, well within the 3 s statement_timeout the
/// transaction-scoped injection gave it: it must not be cancelled by the stale backstop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backstop_ends_with_its_statement() {
    const CONFIG: &str = r#"
callers:
  - name: reporting
    match: { application_name: reporting }
    statement_timeout_ms: 3000
"#;
    let Some(env) = start(4, CONFIG) else {
        return;
    };
    let client = connect(&env.proxy, Some("reporting")).await;
    exec(&client, "BEGIN").await;
    assert_eq!(scalar(&client, "SELECT 1").await, "1");
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let t = timed(&client, "DO $$ BEGIN PERFORM pg_sleep(1); END $$").await;
    assert!(
        t.is_ok(),
        "a statement was cancelled by an earlier one's backstop: {:?}",
        t.result.err()
    );
    exec(&client, "COMMIT").await;
    env.proxy.assert_healthy().await;
}

/// `SHOW` is never given a budget (it must report the session's own settings), so it shows
/// what the client's `SET`s left in place.
async fn own_settings(client: &Client) -> String {
    format!(
        "st={} lt={}",
        scalar(client, "SHOW statement_timeout").await,
        scalar(client, "SHOW lock_timeout").await
    )
}

/// lock_timeout 200 ms gives 55P03 on a row lock held by another client; the client's own
/// `SET lock_timeout` / `SET statement_timeout` survive the injected `SET LOCAL`s, while every
/// statement (a `DO` block too) keeps the caller's limits where they are stricter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_timeout_and_the_clients_own_settings() {
    let Some(env) = start(4, TIMEOUT_CONFIG) else {
        return;
    };
    let client = connect(&env.proxy, Some("reporting")).await;
    exec(
        &client,
        "CREATE TABLE locked (id int PRIMARY KEY, v int); INSERT INTO locked VALUES (1, 0)",
    )
    .await;
    let reference = own_settings(&direct_client(&env.cluster).await).await;
    assert_eq!(
        own_settings(&client).await,
        reference,
        "no settings of our own yet"
    );

    let holder = direct_client(&env.cluster).await;
    exec(
        &holder,
        "BEGIN; SELECT * FROM locked WHERE id = 1 FOR UPDATE",
    )
    .await;

    for sql in [
        "UPDATE locked SET v = v + 1 WHERE id = 1",
        "SELECT * FROM locked WHERE id = 1 FOR UPDATE",
    ] {
        let t = timed(&client, sql).await;
        let e = t.err(sql);
        assert_eq!(sqlstate(e), "55P03", "{sql}: {e:?}");
        assert!(
            t.elapsed >= Duration::from_millis(180) && t.elapsed < Duration::from_millis(750),
            "{sql}: lock_timeout after {:?}, expected about 200 ms",
            t.elapsed
        );
    }
    assert_eq!(
        own_settings(&client).await,
        reference,
        "the next statement runs with the session's settings, not the injected ones"
    );

    exec(&client, "SET statement_timeout = '5s'").await;
    exec(&client, "SET lock_timeout = '400ms'").await;
    assert_eq!(own_settings(&client).await, "st=5s lt=400ms");
    let t = timed(&client, "UPDATE locked SET v = v + 1 WHERE id = 1").await;
    assert_eq!(
        sqlstate(t.err("UPDATE under the caller's lock budget")),
        "55P03"
    );
    assert!(
        t.elapsed < Duration::from_millis(350),
        "the caller's 200 ms lock budget applied: {:?}",
        t.elapsed
    );
    let t = timed(&client, "SELECT pg_sleep(2)").await;
    assert_statement_timeout(
        &t,
        "read after the client's own SET statement_timeout = '5s'",
    );
    assert_eq!(
        own_settings(&client).await,
        "st=5s lt=400ms",
        "the client's SETs survived"
    );

    // A DO block has no statement budget here (kind `other`), but the lock budget holds for
    // every kind: 200 ms, not the client's own 400 ms.
    let t = timed(
        &client,
        "DO $$ BEGIN PERFORM 1 FROM locked WHERE id = 1 FOR UPDATE; END $$",
    )
    .await;
    assert_eq!(
        sqlstate(t.err("DO under the caller's lock budget")),
        "55P03"
    );
    assert!(
        t.elapsed >= Duration::from_millis(180) && t.elapsed < Duration::from_millis(350),
        "the caller's lock_timeout = 200ms applied: {:?}",
        t.elapsed
    );
    assert_eq!(
        own_settings(&client).await,
        "st=5s lt=400ms",
        "the client's SETs survived the DO block's budget"
    );

    exec(&holder, "ROLLBACK").await;
    let t = timed(&client, "UPDATE locked SET v = v + 1 WHERE id = 1").await;
    assert!(t.is_ok(), "no lock held any more: {:?}", t.result.err());
    assert_eq!(scalar(&client, "SELECT v FROM locked").await, "1");
}

/// `SHOW` reports the session's settings as direct Postgres would: the client's own values
/// (or the server defaults), never the caller budget injected for the statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_reports_the_clients_own_settings() {
    let Some(env) = start(4, TIMEOUT_CONFIG) else {
        return;
    };
    let client = connect(&env.proxy, Some("reporting")).await;
    let direct = direct_client(&env.cluster).await;
    let t = timed(&client, "SELECT pg_sleep(2)").await;
    assert_statement_timeout(&t, "budgeted read");
    for name in ["statement_timeout", "lock_timeout"] {
        let sql = format!("SHOW {name}");
        assert_eq!(
            scalar(&client, &sql).await,
            scalar(&direct, &sql).await,
            "{sql} after a timeout shows the session's value, not the injected budget"
        );
    }
    exec(&client, "SET statement_timeout = '5s'").await;
    assert_eq!(scalar(&client, "SELECT 1").await, "1");
    assert_eq!(scalar(&client, "SHOW statement_timeout").await, "5s");
}

/// A client's own, stricter `SET statement_timeout` must not be loosened by the caller's
/// budget injected with `SET LOCAL` (the budget is a ceiling, not a replacement).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stricter_client_statement_timeout_is_kept() {
    let Some(env) = start(4, TIMEOUT_CONFIG) else {
        return;
    };
    let client = connect(&env.proxy, Some("reporting")).await;
    exec(&client, "SET statement_timeout = '150ms'").await;
    let t = timed(&client, "SELECT pg_sleep(0.6)").await;
    match &t.result {
        Ok(_) => panic!(
            "the client's statement_timeout = 150ms was replaced by the caller's 800 ms: \
             pg_sleep(0.6) completed after {:?} (direct Postgres cancels it at 150 ms)",
            t.elapsed
        ),
        Err(e) => assert_eq!(sqlstate(e), "57014"),
    }
    assert!(t.elapsed < Duration::from_millis(500), "{:?}", t.elapsed);
}

/// The injected `SET LOCAL` prefix is invisible: error positions match direct Postgres (also
/// with multibyte text and multi-statement queries) and replies have the same shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injection_keeps_error_positions_and_replies_identical() {
    let Some(env) = start(4, TIMEOUT_CONFIG) else {
        return;
    };
    let proxied = connect(&env.proxy, Some("reporting")).await;
    let direct = direct_client(&env.cluster).await;
    exec(&direct, "CREATE TABLE sink (v int)").await;

    for sql in [
        "SELECT nonexistent_column",
        "SELECT 'äöü€', nonexistent_column",
        "SELECT 1; SELECT nonexistent_column",
        "\n  SELECT\n    1 + nonexistent_column",
        "INSERT INTO sink VALUES (nonexistent_column)",
    ] {
        let want = timed(&direct, sql).await;
        let got = timed(&proxied, sql).await;
        let (want, got) = (want.err(sql), got.err(sql));
        assert_eq!(sqlstate(got), sqlstate(want), "{sql}");
        assert_eq!(position(got), position(want), "error position of {sql:?}");
        assert!(position(got).is_some(), "{sql:?} has a position");
    }

    // Extended protocol and inside a transaction.
    let sql = "SELECT 'ü', nonexistent_column";
    let want = within(STEP, sql, direct.query_typed(sql, &[]))
        .await
        .expect_err(sql);
    let got = within(STEP, sql, proxied.query_typed(sql, &[]))
        .await
        .expect_err(sql);
    assert_eq!(position(&got), position(&want), "extended: {sql}");
    exec(&proxied, "BEGIN").await;
    exec(&direct, "BEGIN").await;
    assert_eq!(scalar(&proxied, "SELECT 1").await, "1");
    let want = timed(&direct, "SELECT nonexistent_column").await;
    let got = timed(&proxied, "SELECT nonexistent_column").await;
    assert_eq!(
        position(got.err("in txn")),
        position(want.err("in txn")),
        "inside BEGIN"
    );
    exec(&proxied, "ROLLBACK").await;
    exec(&direct, "ROLLBACK").await;

    // Same replies, none of the injected SET's.
    fn shape(msgs: &[SimpleQueryMessage]) -> Vec<String> {
        msgs.iter()
            .map(|m| match m {
                SimpleQueryMessage::Row(r) => format!("row {:?}", r.get(0)),
                SimpleQueryMessage::CommandComplete(n) => format!("complete {n}"),
                SimpleQueryMessage::RowDescription(d) => format!("desc {}", d.len()),
                _ => "other".into(),
            })
            .collect()
    }
    for sql in [
        "SELECT 1",
        "SELECT 1; SELECT 2, 3",
        "INSERT INTO sink VALUES (1), (2)",
        "UPDATE sink SET v = v + 1; SELECT count(*) FROM sink",
    ] {
        let want = within(STEP, sql, direct.simple_query(sql))
            .await
            .expect(sql);
        let got = within(STEP, sql, proxied.simple_query(sql))
            .await
            .expect(sql);
        assert_eq!(shape(&got), shape(&want), "replies to {sql:?}");
    }
}

// ------------------------------------------------------------------------------ rate limits

/// Counts the successes of a burst and checks every refusal is a well-formed rate refusal;
/// returns (successes, distinct retry hints).
fn rate_outcomes(results: &[Timed]) -> (usize, Vec<u64>) {
    let mut hints = Vec::new();
    for t in results.iter().filter(|t| !t.is_ok()) {
        let (db, retry) = assert_refusal(t.err("over max_qps"), "53400", "ERR_RATE_LIMITED");
        assert!(
            detail(db).contains("max_qps=5"),
            "DETAIL names the limit: {db:?}"
        );
        assert!(db.message().contains("limited"), "names the caller: {db:?}");
        assert!(
            t.elapsed < Duration::from_millis(500),
            "refused at once: {:?}",
            t.elapsed
        );
        assert!(retry <= 10_000, "retry hint {retry} ms is absurd");
        hints.push(retry);
    }
    hints.sort_unstable();
    hints.dedup();
    (results.iter().filter(|t| t.is_ok()).count(), hints)
}

fn assert_about_burst(ok: usize, took: Duration, what: &str) {
    let refill = (took.as_secs_f64() * 5.0).ceil() as usize;
    assert!(
        (5..=5 + refill).contains(&ok),
        "{what}: {ok} of 20 ran in {took:?}; expected the burst of 5 (+{refill} refilled)"
    );
}

/// `max_qps: 5, burst: 5`: of a burst of 20 quick queries about 5 run and the rest get 53400
/// `ERR_RATE_LIMITED` with a jittered retry hint; other callers are unaffected; a second later
/// the bucket has refilled. The burst is sent three ways — one after another on one
/// connection, at once on 20 connections, and pipelined on 4 connections (what
/// tokio-postgres does with concurrent queries on one client) — and the limit holds for all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caller_rate_limit_refuses_beyond_burst_and_refills() {
    let Some(env) = start(
        6,
        r#"
callers:
  - name: limited
    match: { application_name: limited }
    max_qps: 5
    burst: 5
"#,
    ) else {
        return;
    };
    let limited = connect_many(&env.proxy, Some("limited"), 20).await;
    let other = connect(&env.proxy, None).await;

    // 1. One after another.
    let started = Instant::now();
    let mut results = Vec::new();
    for i in 0..20 {
        results.push(timed(&limited[0], &format!("SELECT {i}")).await);
    }
    let (ok, hints) = rate_outcomes(&results);
    assert_about_burst(ok, started.elapsed(), "sequential burst");
    assert!(
        hints.len() > 1,
        "retry hints carry jitter, got only {hints:?}"
    );

    for i in 0..20 {
        let t = timed(&other, "SELECT 1").await;
        assert!(
            t.is_ok(),
            "an unlimited caller is unaffected ({i}): {:?}",
            t.result.err()
        );
    }

    // 2. A second later the bucket is full again.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for (i, c) in limited.iter().take(5).enumerate() {
        let t = timed(c, "SELECT 1").await;
        assert!(
            t.is_ok(),
            "after 1 s the bucket has refilled ({i}): {:?}",
            t.result.err()
        );
    }

    // 3. At once on 20 connections.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let started = Instant::now();
    let tasks: Vec<_> = limited.iter().map(|c| spawn_timed(c, "SELECT 1")).collect();
    let results = join_all(tasks).await;
    let (ok, _) = rate_outcomes(&results);
    assert_about_burst(ok, started.elapsed(), "20 connections at once");

    // 4. Pipelined: five queries in flight on each of 4 connections.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let started = Instant::now();
    let tasks: Vec<_> = (0..20)
        .map(|i| spawn_timed(&limited[i % 4], "SELECT 1"))
        .collect();
    let results = join_all(tasks).await;
    let (ok, _) = rate_outcomes(&results);
    assert_about_burst(ok, started.elapsed(), "pipelined on 4 connections");
}

// ------------------------------------------------------------------------------ breaker

const BREAKER_CONFIG: &str = r#"
admin: { open_reads: true }
callers:
  - name: service_payment
    match: { tag: { service: billing } }
    priority: critical
  - name: flaky
    match: { application_name: flaky }
    statement_timeout_ms: 100
global_defaults:
  circuit_breaker:
    consecutive_errors: 3
    open_ms: 1000
"#;

/// A 57014 the client asked for (its own CancelRequest) says nothing about the server: five
/// cancelled statements in a row leave the breaker closed, where three statement timeouts of
/// the same SQLSTATE open it (the test below).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_cancels_do_not_open_the_breaker() {
    let Some(env) = start(6, BREAKER_CONFIG) else {
        return;
    };
    for i in 0..5 {
        let c = Arc::new(connect(&env.proxy, None).await);
        let token = c.cancel_token();
        let run = spawn_timed(&c, "SELECT pg_sleep(30)");
        wait_for_running(&env.cluster, "pg_sleep(30)", 1).await;
        within(STEP, "send the cancel", token.cancel_query(NoTls))
            .await
            .expect("cancel request");
        let t = join(run).await;
        let e = t.err("a cancelled statement");
        assert_eq!(sqlstate(e), "57014", "cancel {i}: {e:?}");
        assert!(
            db_error(e).message().contains("user request"),
            "cancel {i}: {e:?}"
        );
        let monitor = env.cluster.monitor().await;
        let monitor = &monitor;
        let gone = poll_until(Duration::from_secs(5), move || async move {
            monitor.active_queries_like("pg_sleep(30)").await.is_empty()
        })
        .await;
        assert!(gone, "cancel {i}: the statement is gone");
    }
    let snapshot = admin_get(&env.proxy, "/v1/breaker").await;
    assert_eq!(snapshot["state"], "closed", "{snapshot}");
    let c = connect(&env.proxy, None).await;
    assert_eq!(scalar(&c, "SELECT 1").await, "1");
}

/// Three consecutive statement timeouts (57014, a backend fault) open the breaker: normal
/// traffic gets 53000 `ERR_CIRCUIT_OPEN` at once, critical traffic runs. After `open_ms` a
/// failed trial reopens it; after another `open_ms` a successful trial closes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaker_opens_on_backend_faults_sheds_non_critical_and_recovers() {
    let Some(env) = start(6, BREAKER_CONFIG) else {
        return;
    };
    let normal = connect(&env.proxy, None).await;
    let flaky = connect(&env.proxy, Some("flaky")).await;
    let payment = connect(&env.proxy, Some("payments")).await;
    assert_eq!(scalar(&normal, "SELECT 1").await, "1");

    // One fault per connection, so each is its own unit whatever the reply timing
    // (`pipelined_faults_each_count_for_the_breaker` covers one connection).
    for i in 0..3 {
        let c = connect(&env.proxy, Some("flaky")).await;
        let t = timed(&c, "SELECT pg_sleep(1)").await;
        assert_eq!(
            sqlstate(t.err("a statement over its 100 ms budget")),
            "57014",
            "fault {i}"
        );
    }
    let snapshot = wait_for_breaker(&env.proxy, "open").await;
    assert_eq!(snapshot["reason"], "consecutive_errors", "{snapshot}");
    let opened = Instant::now();

    let shed = |t: &Timed, what: &str, limit: &str| {
        let (db, _) = assert_refusal(t.err(what), "53000", "ERR_CIRCUIT_OPEN");
        assert!(
            detail(db).contains(limit),
            "{what}: DETAIL names the trigger {limit}: {db:?}"
        );
        assert!(
            t.elapsed < Duration::from_millis(500),
            "{what}: shed at once: {:?}",
            t.elapsed
        );
    };
    let t = timed(&flaky, "SELECT 1").await;
    shed(&t, "the flaky caller while open", "consecutive_errors=3");
    let t = timed(&normal, "SELECT 1").await;
    shed(&t, "normal traffic while open", "consecutive_errors=3");
    for i in 0..5 {
        let t = timed(&payment, &format!("/*service:billing*/ SELECT {i}")).await;
        assert!(
            t.is_ok(),
            "critical traffic is admitted while open: {:?}",
            t.result.err()
        );
    }
    let t = timed(&normal, "SELECT 1").await;
    shed(
        &t,
        "normal traffic after critical successes",
        "consecutive_errors=3",
    );
    assert!(
        opened.elapsed() < Duration::from_millis(900),
        "checks while open took too long ({:?})",
        opened.elapsed()
    );

    // Half-open: the first non-critical statement is the trial; it fails, so the breaker reopens.
    tokio::time::sleep(
        Duration::from_millis(1000).saturating_sub(opened.elapsed()) + Duration::from_millis(150),
    )
    .await;
    let t = timed(&flaky, "SELECT pg_sleep(1)").await;
    assert_eq!(sqlstate(t.err("the failing half-open trial")), "57014");
    let snapshot = wait_for_breaker(&env.proxy, "open").await;
    assert_eq!(snapshot["reason"], "trial_failed", "{snapshot}");
    let reopened = Instant::now();
    let t = timed(&flaky, "SELECT 1").await;
    shed(
        &t,
        "the flaky caller after its failed trial",
        "trial failed",
    );
    let t = timed(&normal, "SELECT 1").await;
    shed(&t, "normal traffic after a failed trial", "trial failed");

    // After another open period a successful trial closes it.
    tokio::time::sleep(
        Duration::from_millis(1000).saturating_sub(reopened.elapsed()) + Duration::from_millis(150),
    )
    .await;
    let t = timed(&normal, "SELECT 1").await;
    assert!(
        t.is_ok(),
        "the half-open trial is admitted: {:?}",
        t.result.err()
    );
    let snapshot = wait_for_breaker(&env.proxy, "closed").await;
    assert_eq!(snapshot["trips"]["consecutive_errors"], 1, "{snapshot}");
    assert_eq!(snapshot["trips"]["trial_failed"], 1, "{snapshot}");
    let clients = [Arc::new(normal), Arc::new(flaky)];
    let tasks: Vec<_> = (0..10)
        .map(|i| spawn_timed(&clients[i % 2], "SELECT 1"))
        .collect();
    for t in join_all(tasks).await {
        assert!(
            t.is_ok(),
            "closed again: normal traffic flows: {:?}",
            t.result.err()
        );
    }
}

/// Back-to-back faults on one connection are separate statements (separate implicit
/// transactions in Postgres) and must each count for the breaker — also when the client sends
/// the next one before the previous ReadyForQuery, as tokio-postgres does with concurrent
/// queries on one client (and, after an error, Postgres flushes the ErrorResponse before its
/// ReadyForQuery, so even a strictly sequential client can get there first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_faults_each_count_for_the_breaker() {
    let Some(env) = start(6, BREAKER_CONFIG) else {
        return;
    };
    let flaky = Arc::new(connect(&env.proxy, Some("flaky")).await);
    let tasks: Vec<_> = (0..3)
        .map(|_| spawn_timed(&flaky, "SELECT pg_sleep(1)"))
        .collect();
    for t in join_all(tasks).await {
        assert_eq!(
            sqlstate(t.err("a statement over its 100 ms budget")),
            "57014"
        );
    }
    let opened = poll_until(Duration::from_secs(2), || async {
        admin_get(&env.proxy, "/v1/breaker").await["state"] == "open"
    })
    .await;
    let snapshot = admin_get(&env.proxy, "/v1/breaker").await;
    assert!(
        opened,
        "three consecutive 57014 faults (pipelined on one connection) did not open the breaker \
         (consecutive_errors: 3): {snapshot}"
    );
    let normal = connect(&env.proxy, None).await;
    let t = timed(&normal, "SELECT 1").await;
    assert_refusal(
        t.err("normal traffic while open"),
        "53000",
        "ERR_CIRCUIT_OPEN",
    );
}

/// The health probe: a value at or above `db_cpu_threshold_percent` opens the breaker (normal
/// traffic shed with 53000, critical admitted), it stays open while the value stays high, and
/// it closes once the value drops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaker_opens_on_the_probe_and_closes_when_it_recovers() {
    let Some(env) = start_with(
        4,
        r#"
callers:
  - name: service_payment
    match: { tag: { service: billing } }
    priority: critical
global_defaults:
  circuit_breaker:
    db_cpu_threshold_percent: 85
    probe_sql: "SELECT v FROM cpu"
    probe_interval_ms: 100
    open_ms: 500
"#,
        |cluster| {
            cluster.psql_on(
                APP_DB,
                "CREATE TABLE cpu (v float8); INSERT INTO cpu VALUES (10); GRANT SELECT ON cpu TO app",
            );
        },
    ) else {
        return;
    };
    let normal = connect(&env.proxy, None).await;
    let payment = connect(&env.proxy, None).await;
    let admin = env.cluster.superuser_client(APP_DB).await;

    tokio::time::sleep(Duration::from_millis(400)).await; // a few probes below the threshold
    for _ in 0..5 {
        assert_eq!(scalar(&normal, "SELECT 1").await, "1");
    }

    exec(&admin, "UPDATE cpu SET v = 95").await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let t = loop {
        let t = timed(&normal, "SELECT 1").await;
        if !t.is_ok() {
            break t;
        }
        assert!(
            Instant::now() < deadline,
            "the probe reading 95 >= 85 never opened the breaker"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    let (db, _) = assert_refusal(
        t.err("normal traffic while the probe is high"),
        "53000",
        "ERR_CIRCUIT_OPEN",
    );
    assert!(
        detail(db).contains("db_cpu_threshold_percent=85"),
        "DETAIL names the probe limit: {db:?}"
    );
    let t = timed(&payment, "/*service:billing*/ SELECT 1").await;
    assert!(
        t.is_ok(),
        "critical traffic is admitted: {:?}",
        t.result.err()
    );

    // Still high after more than open_ms: still open.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let t = timed(&normal, "SELECT 1").await;
    assert_refusal(
        t.err("normal traffic while the probe stays high"),
        "53000",
        "ERR_CIRCUIT_OPEN",
    );

    exec(&admin, "UPDATE cpu SET v = 20").await;
    let dropped = Instant::now();
    let normal_ref = &normal;
    let closed = poll_until(Duration::from_secs(5), move || async move {
        timed(normal_ref, "SELECT 1").await.is_ok()
    })
    .await;
    assert!(
        closed,
        "the breaker never closed after the probe dropped to 20"
    );
    assert!(
        dropped.elapsed() >= Duration::from_millis(100),
        "it stayed open for about open_ms after the last high reading ({:?})",
        dropped.elapsed()
    );
    for _ in 0..5 {
        assert_eq!(scalar(&normal, "SELECT 1").await, "1");
    }
}

// ------------------------------------------------------------------------------ transactions

/// A refusal inside a transaction block (fingerprint rules: a THROTTLE over its rate, a
/// REJECT) behaves like a Postgres error there: the error reaches the client, the transaction
/// is aborted (25P02), ROLLBACK works and the connection stays usable — simple and extended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusal_inside_a_transaction_aborts_it_like_a_postgres_error() {
    let classifier = pgsluice::classify::Classifier::new(100, 64 * 1024);
    let throttled = "SELECT count(*) FROM pg_class";
    let blocked = "SELECT count(*) FROM pg_namespace";
    let fp = |sql: &str| format!("{:016x}", classifier.classify(sql).fingerprint);
    assert_ne!(fp(throttled), fp(blocked));
    assert_ne!(fp(throttled), fp("SELECT 1"));
    let rules = format!(
        r#"{{"version": 1, "rules": [
  {{"fingerprint": "{}", "created_unix_ms": 0,
    "rule": {{"action": "THROTTLE", "max_qps": 0.2, "burst": 1, "action_on_exceed": "REJECT"}}}},
  {{"fingerprint": "{}", "created_unix_ms": 0,
    "rule": {{"action": "REJECT", "error_message": "no catalog scans in transactions"}}}}
]}}"#,
        fp(throttled),
        fp(blocked)
    );
    let rules_dir = tempfile::tempdir().expect("rules dir");
    let rules_path = rules_dir.path().join("rules.json");
    std::fs::write(&rules_path, rules).expect("write rules");
    let Some(env) = start(
        4,
        &format!("admin:\n  rules_file: {}\n", rules_path.display()),
    ) else {
        return;
    };
    let client = connect(&env.proxy, None).await;

    // Simple protocol: the first throttled statement runs, the second is over the rate.
    exec(&client, "BEGIN").await;
    assert_eq!(scalar(&client, "SELECT 1").await, "1");
    let t = timed(&client, throttled).await;
    assert!(
        t.is_ok(),
        "the first one is within the burst: {:?}",
        t.result.err()
    );
    let t = timed(&client, throttled).await;
    assert_refusal(
        t.err("a throttled statement in a transaction"),
        "53400",
        "ERR_RATE_LIMITED",
    );
    let t = timed(&client, "SELECT 1").await;
    assert_eq!(
        sqlstate(t.err("after the refusal")),
        "25P02",
        "the transaction is aborted"
    );
    exec(&client, "ROLLBACK").await;
    assert_eq!(scalar(&client, "SELECT 2").await, "2");

    // Extended protocol inside a transaction.
    exec(&client, "BEGIN").await;
    assert_eq!(scalar(&client, "SELECT 3").await, "3");
    let r = within(
        STEP,
        "query_typed a blocked statement",
        client.query_typed(blocked, &[]),
    )
    .await;
    let e = r.expect_err("a blocked statement in a transaction");
    let (db, _) = assert_refusal(&e, "53400", "ERR_QUERY_BLOCKED");
    assert!(
        db.message().contains("no catalog scans in transactions"),
        "{db:?}"
    );
    let r = within(
        STEP,
        "query_typed after the refusal",
        client.query_typed("SELECT 4", &[]),
    )
    .await;
    assert_eq!(sqlstate(&r.expect_err("after the refusal")), "25P02");
    exec(&client, "ROLLBACK").await;
    let rows = within(
        STEP,
        "query_typed after ROLLBACK",
        client.query_typed("SELECT 5::int", &[]),
    )
    .await
    .expect("usable after ROLLBACK");
    assert_eq!(rows[0].get::<_, i32>(0), 5);

    // Outside a transaction the refusal comes from the proxy, and nothing is aborted.
    let t = timed(&client, blocked).await;
    assert_refusal(
        t.err("blocked outside a transaction"),
        "53400",
        "ERR_QUERY_BLOCKED",
    );
    assert_eq!(scalar(&client, "SELECT 6").await, "6");
    env.proxy.assert_healthy().await;
}

// ------------------------------------------------------------------------------ reload

fn elastic_config(max_concurrency: &str) -> String {
    format!(
        r#"
callers:
  - name: elastic
    match: {{ application_name: elastic }}
    max_concurrency: {max_concurrency}
    queue_depth: 0
"#
    )
}

/// Runs `n` concurrent `pg_sleep(0.4)` on `clients`; returns how many were refused, checking
/// the refusals name `limit`.
async fn refused_of(clients: &[Arc<Client>], n: usize, limit: &str) -> usize {
    let tasks: Vec<_> = clients[..n]
        .iter()
        .map(|c| spawn_timed(c, "SELECT pg_sleep(0.4)"))
        .collect();
    let mut refused = 0;
    for t in join_all(tasks).await {
        if let Err(e) = &t.result {
            let (db, _) = assert_refusal(e, "53300", "ERR_CALLER_LIMIT_EXCEEDED");
            assert!(detail(db).contains(limit), "DETAIL names {limit}: {db:?}");
            refused += 1;
        }
    }
    refused
}

/// SIGHUP after rewriting the config: connected clients stay, the new limit applies; an
/// invalid file is rejected and the running limits stay; a later valid file applies again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reload_applies_new_limits_and_rejects_invalid_files() {
    let Some(env) = start(8, &elastic_config("4")) else {
        return;
    };
    let clients = connect_many(&env.proxy, Some("elastic"), 4).await;
    assert_eq!(
        refused_of(&clients, 4, "max_concurrency=4").await,
        0,
        "4 of 4 run"
    );

    std::fs::write(&env.config, elastic_config("2")).expect("rewrite config");
    assert!(sighup(&env.proxy).await, "a valid config is reloaded");
    assert_eq!(
        refused_of(&clients, 3, "max_concurrency=2").await,
        1,
        "the new max_concurrency=2 applies to clients connected before the reload"
    );

    for bad in [
        elastic_config("0"),
        "callers: [ {name: elastic, match: {application_name: elastic}, max_concurrency: lots} ]\n"
            .to_string(),
        "callers: [\n".to_string(),
    ] {
        std::fs::write(&env.config, &bad).expect("write invalid config");
        assert!(
            !sighup(&env.proxy).await,
            "an invalid config is rejected:\n{bad}"
        );
        assert_eq!(
            refused_of(&clients, 3, "max_concurrency=2").await,
            1,
            "the running limit (2) stays after rejecting:\n{bad}"
        );
    }

    std::fs::write(&env.config, elastic_config("3")).expect("rewrite config");
    assert!(
        sighup(&env.proxy).await,
        "a valid config after invalid ones is reloaded"
    );
    assert_eq!(
        refused_of(&clients, 3, "max_concurrency=3").await,
        0,
        "3 of 3 run"
    );
    for c in &clients {
        assert_eq!(
            scalar(c, "SELECT 1").await,
            "1",
            "clients survived every reload"
        );
    }
}
