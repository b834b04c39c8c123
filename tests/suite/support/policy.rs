//! The environment of the traffic-policy tests of issue 5 (`admission`, `timeouts`, `breaker`,
//! `lifecycle`): a cluster, a proxy in front of it and the config file the proxy reads (and
//! re-reads on SIGHUP); clients by `application_name`; timed queries; refusals checked the way
//! a client sees them (SQLSTATE, the `pgsluice: ERR_…` message, a DETAIL, a `retry_after_ms`
//! HINT); waits on the admin API and on Postgres. `start` returns `None` in direct mode, where
//! there is no policy to test.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;
use tokio_postgres::error::DbError;
use tokio_postgres::{Client, SimpleQueryMessage};

use super::pg::Cluster;
use super::proxy::{Proxy, ProxyOptions};
use super::sql::{STEP, join};
use super::{direct_mode, note_skipped, within};

/// A cluster, a proxy in front of it, and the config file the proxy reads (and re-reads on
/// SIGHUP). Field order is drop order: proxy first, then the cluster, then the temp dir.
pub struct Env {
    pub proxy: Proxy,
    pub cluster: Cluster,
    pub config: PathBuf,
    _dir: tempfile::TempDir,
}

/// Starts a cluster and a transaction-mode proxy with `pool` backends and config `yaml`;
/// `None` (after saying so) in direct mode, where there is no policy to test.
pub fn start(pool: usize, yaml: &str) -> Option<Env> {
    start_with(pool, yaml, |_| {})
}

/// As [`start`], running `prepare` against the cluster before the proxy starts.
pub fn start_with(pool: usize, yaml: &str, prepare: impl FnOnce(&Cluster)) -> Option<Env> {
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
pub async fn connect(proxy: &Proxy, application_name: Option<&str>) -> Client {
    let mut cfg = proxy.app_config();
    if let Some(name) = application_name {
        cfg.application_name(name);
    }
    proxy.client_with(&cfg).await.0
}

/// `n` clients with the same `application_name`, shareable with spawned tasks.
pub async fn connect_many(
    proxy: &Proxy,
    application_name: Option<&str>,
    n: usize,
) -> Vec<Arc<Client>> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(Arc::new(connect(proxy, application_name).await));
    }
    clients
}

/// The outcome of one simple query and how long it took.
pub struct Timed {
    pub elapsed: Duration,
    pub result: Result<Vec<SimpleQueryMessage>, tokio_postgres::Error>,
}

impl Timed {
    pub fn is_ok(&self) -> bool {
        self.result.is_ok()
    }

    /// The error, or a panic naming `what` succeeded unexpectedly.
    pub fn err(&self, what: &str) -> &tokio_postgres::Error {
        match &self.result {
            Ok(_) => panic!(
                "{what}: succeeded after {:?}, expected an error",
                self.elapsed
            ),
            Err(e) => e,
        }
    }
}

pub async fn timed(client: &Client, sql: &str) -> Timed {
    let start = Instant::now();
    let result = within(STEP, sql, client.simple_query(sql)).await;
    Timed {
        elapsed: start.elapsed(),
        result,
    }
}

pub fn spawn_timed(client: &Arc<Client>, sql: &str) -> JoinHandle<Timed> {
    let (client, sql) = (Arc::clone(client), sql.to_string());
    tokio::spawn(async move { timed(&client, &sql).await })
}

pub async fn join_all<T>(tasks: Vec<JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(join(t).await);
    }
    out
}

/// Runs a statement that must succeed.
pub async fn exec(client: &Client, sql: &str) {
    within(STEP, sql, client.batch_execute(sql))
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
}

/// The server error inside `e` (panics if it is a connection-level error).
pub fn db_error(e: &tokio_postgres::Error) -> &DbError {
    e.as_db_error()
        .unwrap_or_else(|| panic!("expected an ErrorResponse, got {e:?}"))
}

/// Asserts `e` is a pgsluice refusal with `code` and `err_code` in its message, a DETAIL and
/// a `retry_after_ms=N` HINT; returns the server error and N.
pub fn assert_refusal<'a>(
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
pub fn retry_after_ms(db: &DbError) -> u64 {
    let hint = db
        .hint()
        .unwrap_or_else(|| panic!("refusal without a HINT: {db:?}"));
    hint.strip_prefix("retry_after_ms=")
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("HINT should be retry_after_ms=<n>, got {hint:?}"))
}

pub fn detail(db: &DbError) -> &str {
    db.detail().unwrap_or("")
}

/// Polls `cond` every 25 ms for up to `limit`; returns whether it became true.
pub async fn poll_until<F, Fut>(limit: Duration, mut cond: F) -> bool
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
pub async fn admin_get(proxy: &Proxy, path: &str) -> serde_json::Value {
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

/// Waits until PostgreSQL shows `n` running statements containing `needle`.
pub async fn wait_for_running(cluster: &Cluster, needle: &str, n: usize) {
    let monitor = cluster.monitor().await;
    let monitor = &monitor;
    let reached = poll_until(Duration::from_secs(5), move || async move {
        monitor.active_queries_like(needle).await.len() >= n
    })
    .await;
    assert!(reached, "{n} statements like {needle:?} never ran together");
}
