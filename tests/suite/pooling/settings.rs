//! The `pool` settings of docs/OPERATIONS.md shown to take effect (issue 16, item 9), each
//! against a real PostgreSQL through the proxy and observed from outside: backend pids and
//! ages in `pg_stat_activity`, the `/v1/pools` counters, connection attempts counted where
//! they arrive (a TCP hop in front of the cluster), and the errors clients get.
//!
//! * `idle_timeout_ms` — idle connections are closed once idle that long (by the pool upkeep,
//!   which runs every second), not before, and a connection in use is not;
//! * `max_lifetime_ms` — a connection is used until 90 % of it at least and never past it: the
//!   release after that age closes it and a new backend serves the next query;
//! * `health_check_after_ms` — a connection idle longer than this is checked before reuse, so
//!   one whose server vanished without a word is replaced and the client sees no error; one
//!   idle for less is handed out unchecked;
//! * `max_connect_attempts`, `connect_backoff_base_ms`, `connect_backoff_cap_ms` — a storm of
//!   clients against a database that does not answer makes only that many attempts at once,
//!   and after they fail the clients queued behind them get 08006 with a retry hint at once
//!   instead of each trying in turn; the first window is at most the base, later ones at most
//!   the cap;
//! * `prepared_cache_size` — more named statements than that on one backend still run, are
//!   re-prepared transparently, and the backend never holds more than the cache;
//! * `max_waiting` — beyond that many waiters a checkout is refused at once with 53300
//!   `ERR_QUEUE_FULL` and a hint, while a critical caller still waits and runs.
//!
//! `min_idle` is in `pooling::min_idle`. Each test has its own cluster and proxy (they run in
//! parallel); the waits are a few seconds at most, with slack for two busy cores, and each
//! check still tells the setting's effect from its absence. With `PGSLUICE_TEST_DIRECT=1`
//! these tests are skipped: they are about the pool.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_postgres::Client;
use tokio_postgres::error::DbError;
use tokio_util::sync::CancellationToken;

use crate::support::faults::{Fault, FaultProxy};
use crate::support::pg::{APP_DB, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::sql::{STEP, eventually, join, scalar, simple_values, sqlstate};
use crate::support::{direct_mode, note_skipped, within};

/// A config file in a temp dir, kept as long as the proxy that reads it.
pub(super) struct ConfigFile {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

fn config_file(yaml: &str) -> ConfigFile {
    let dir = tempfile::Builder::new()
        .prefix("pgsluice-pool-settings-")
        .tempdir()
        .expect("temp dir for the config");
    let path = dir.path().join("pgsluice.yaml");
    std::fs::write(&path, yaml).expect("write the config");
    ConfigFile { path, _dir: dir }
}

/// True (after saying so) in direct mode, where there is no pool to test.
pub(super) fn skip_direct() -> bool {
    if direct_mode() {
        note_skipped("the whole pool-settings test (it needs the proxy)");
    }
    direct_mode()
}

/// Starts a transaction-mode proxy with `size` backends and config `yaml` in front of
/// `cluster` (or of `via`, a hop that leads to it).
pub(super) fn proxy(
    cluster: &Cluster,
    size: usize,
    yaml: &str,
    via: Option<SocketAddr>,
) -> (Proxy, ConfigFile) {
    let cfg = config_file(yaml);
    let mut options = ProxyOptions::pool(size).config_file(&cfg.path);
    if let Some(addr) = via {
        options = options.backend_via(addr);
    }
    (Proxy::start(cluster, options), cfg)
}

/// The `appdb/app` entry of `GET /v1/pools` (`Null` while that pool does not exist).
pub(super) async fn pool_stats(proxy: &Proxy) -> serde_json::Value {
    proxy.app_pool().await
}

fn counter(stats: &serde_json::Value, name: &str) -> u64 {
    stats[name]
        .as_u64()
        .unwrap_or_else(|| panic!("no counter {name} in {stats}"))
}

/// The backend pid serving this query, and the age of that backend in seconds.
async fn pid_and_age(client: &Client) -> (i32, f64) {
    let sql = "SELECT pg_backend_pid() || ' ' || \
               extract(epoch FROM clock_timestamp() - backend_start) \
               FROM pg_stat_activity WHERE pid = pg_backend_pid()";
    let text = scalar(client, sql).await;
    let (pid, age) = text
        .split_once(' ')
        .unwrap_or_else(|| panic!("pid and age: {text:?}"));
    (pid.parse().expect("pid"), age.parse().expect("backend age"))
}

pub(super) async fn pid(client: &Client) -> i32 {
    scalar(client, "SELECT pg_backend_pid()")
        .await
        .parse()
        .expect("pid")
}

/// Pids of the `app` client backends, seen from a direct superuser connection.
async fn app_backends(monitor: &Client) -> Vec<i32> {
    let rows = within(
        STEP,
        "app backends in pg_stat_activity",
        monitor.query(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND usename = $2 \
             AND backend_type = 'client backend' ORDER BY pid",
            &[&APP_DB, &APP_USER],
        ),
    )
    .await
    .expect("list app backends");
    rows.iter().map(|r| r.get(0)).collect()
}

fn db_error(e: &tokio_postgres::Error) -> &DbError {
    e.as_db_error()
        .unwrap_or_else(|| panic!("expected an ErrorResponse from the proxy, got {e:?}"))
}

/// The N of a `retry_after_ms=N` HINT.
fn retry_hint(db: &DbError) -> u64 {
    db.hint()
        .and_then(|h| h.strip_prefix("retry_after_ms="))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no retry_after_ms=N hint on {db:?}"))
}

/// A query's time to answer, and its first column or its error.
type Answer = (Duration, Result<Vec<Option<String>>, tokio_postgres::Error>);

/// Runs `sql` on its own task.
pub(super) fn spawn_query(client: &Arc<Client>, sql: &str) -> JoinHandle<Answer> {
    let (client, sql) = (Arc::clone(client), sql.to_owned());
    tokio::spawn(async move {
        let started = Instant::now();
        let r = within(STEP, &sql, client.simple_query(&sql)).await;
        (started.elapsed(), r.map(|m| simple_values(&m)))
    })
}

// ------------------------------------------------------------------------------ idle_timeout_ms

/// Three connections go idle together; the two nobody uses are closed about
/// `idle_timeout_ms` (1.5 s) later — not before, and not much after (the upkeep runs every
/// second) — while the one a client keeps using stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_timeout_ms_closes_connections_left_idle_that_long() {
    if skip_direct() {
        return;
    }
    let cluster = Cluster::start();
    let (proxy, _cfg) = proxy(&cluster, 3, "pool: { idle_timeout_ms: 1500 }\n", None);
    let monitor = cluster.superuser_client("postgres").await;
    let clients: Vec<Arc<Client>> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(Arc::new(proxy.client().await));
        }
        v
    };
    // Three at once: the pool opens three backends.
    let runs: Vec<_> = clients
        .iter()
        .map(|c| spawn_query(c, "SELECT pg_sleep(0.3)"))
        .collect();
    for r in runs {
        let (_, result) = join(r).await;
        result.expect("pg_sleep on a pooled backend");
    }
    let released = Instant::now();
    let opened = app_backends(&monitor).await;
    assert_eq!(opened.len(), 3, "three concurrent queries, three backends");
    // Idle on the server: in the idle list, or parked with their idle clients.
    let stats = pool_stats(&proxy).await;
    assert_eq!(
        (
            counter(&stats, "open"),
            counter(&stats, "idle") + counter(&stats, "parked")
        ),
        (3, 3),
        "{stats}"
    );

    // One client keeps its connection busy every 200 ms; the pool hands it the same one
    // each time (LIFO), so the other two stay idle.
    let busy = Arc::clone(&clients[0]);
    let stop = CancellationToken::new();
    let stop2 = stop.clone();
    let keeper = tokio::spawn(async move {
        let mut pids = Vec::new();
        while !stop2.is_cancelled() {
            pids.push(pid(&busy).await);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        pids
    });

    // Well before the timeout nothing is closed.
    tokio::time::sleep(Duration::from_millis(900).saturating_sub(released.elapsed())).await;
    let early = app_backends(&monitor).await;
    let early_at = released.elapsed();
    assert_eq!(
        early, opened,
        "{early_at:?} after going idle (idle_timeout_ms 1500) no connection may be closed"
    );

    let mut closed_at = None;
    let deadline = released + Duration::from_millis(1500 + 1000 + 3000);
    while Instant::now() < deadline {
        if app_backends(&monitor).await.len() == 1 {
            closed_at = Some(released.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let closed_at = closed_at.unwrap_or_else(|| {
        panic!(
            "the two idle connections were still open {:?} after going idle \
             (idle_timeout_ms 1500, upkeep every 1 s): {:?}",
            released.elapsed(),
            opened
        )
    });
    assert!(
        closed_at >= Duration::from_millis(1300),
        "idle connections were closed after {closed_at:?}, before idle_timeout_ms (1500)"
    );
    stop.cancel();
    let pids = join(keeper).await;
    let remaining = app_backends(&monitor).await;
    assert_eq!(
        remaining.len(),
        1,
        "the connection in use stays open: {remaining:?}"
    );
    assert!(
        pids.iter().all(|p| *p == remaining[0]),
        "the busy client was served by the one connection that stayed: {pids:?} vs {remaining:?}"
    );
    let stats = pool_stats(&proxy).await;
    assert_eq!(counter(&stats, "open"), 1, "{stats}");
}

// ------------------------------------------------------------------------------ max_lifetime_ms

/// With `max_lifetime_ms` 2000 a connection serves query after query until well into its
/// life (it is reused, not replaced, up to 90 % of it), and the release after its age passes
/// 2 s closes it: the next query runs on a new backend and the old one is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_lifetime_ms_replaces_a_connection_released_past_that_age() {
    if skip_direct() {
        return;
    }
    let cluster = Cluster::start();
    let (proxy, _cfg) = proxy(&cluster, 1, "pool: { max_lifetime_ms: 2000 }\n", None);
    let monitor = cluster.superuser_client("postgres").await;
    let client = proxy.client().await;

    let (first, age) = pid_and_age(&client).await;
    // The backend started a little before the proxy's connection to it was made, so this
    // clock runs slightly ahead of the connection's age.
    let born = Instant::now() - Duration::from_secs_f64(age);
    let mut served = 1;
    // Until 1.5 s of its age (the jitter takes at most 10 %: it lives 1.8 s at least).
    while born.elapsed() < Duration::from_millis(1500) {
        let at = born.elapsed();
        let p = pid(&client).await;
        assert_eq!(
            p, first,
            "a connection {at:?} old (max_lifetime_ms 2000) was replaced after {served} queries"
        );
        served += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(served >= 5, "the connection served only {served} queries");

    // Checked out while it passes 2 s; its release closes it.
    scalar(&client, "SELECT pg_sleep(0.8)::text").await;
    let (next, next_age) = pid_and_age(&client).await;
    assert_ne!(
        next, first,
        "a connection past max_lifetime_ms (2000) was reused after its release"
    );
    assert!(
        next_age < 1.5,
        "the replacement is a new backend ({next_age:.3} s old)"
    );
    eventually(
        Duration::from_secs(5),
        "the expired backend to exit",
        || async { !app_backends(&monitor).await.contains(&first) },
    )
    .await;
    let stats = pool_stats(&proxy).await;
    assert_eq!(counter(&stats, "connects"), 2, "{stats}");
    assert_eq!(counter(&stats, "open"), 1, "{stats}");
}

// ------------------------------------------------------------------------------ health_check_after_ms

/// A TCP hop to the cluster whose established connections can be cut *silently*: the server
/// side is closed (its backend exits) while the proxy's side stays open and says nothing, as
/// when the database host dies behind a partition. New connections pass as before.
struct SilentCut {
    addr: SocketAddr,
    cut: Arc<std::sync::Mutex<CancellationToken>>,
    stop: CancellationToken,
}

impl SilentCut {
    async fn start(upstream: SocketAddr) -> SilentCut {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the hop");
        let addr = listener.local_addr().expect("hop address");
        let cut = Arc::new(std::sync::Mutex::new(CancellationToken::new()));
        let stop = CancellationToken::new();
        let (cut2, stop2) = (Arc::clone(&cut), stop.clone());
        tokio::spawn(async move {
            loop {
                let client = tokio::select! {
                    r = listener.accept() => match r {
                        Ok((s, _)) => s,
                        Err(_) => continue,
                    },
                    _ = stop2.cancelled() => return,
                };
                let cut = cut2.lock().expect("cut lock").clone();
                tokio::spawn(forward(client, upstream, cut, stop2.clone()));
            }
        });
        SilentCut { addr, cut, stop }
    }

    /// Cuts every connection established so far.
    fn cut(&self) {
        let mut g = self.cut.lock().expect("cut lock");
        g.cancel();
        *g = CancellationToken::new();
    }
}

impl Drop for SilentCut {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn forward(
    mut client: TcpStream,
    upstream: SocketAddr,
    cut: CancellationToken,
    stop: CancellationToken,
) {
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    let was_cut = {
        let (mut cr, mut cw) = client.split();
        let (mut sr, mut sw) = server.split();
        tokio::select! {
            _ = tokio::io::copy(&mut cr, &mut sw) => false,
            _ = tokio::io::copy(&mut sr, &mut cw) => false,
            _ = cut.cancelled() => true,
            _ = stop.cancelled() => false,
        }
    };
    drop(server);
    if was_cut {
        // Hold the proxy's side open, unread and silent.
        stop.cancelled().await;
    }
    drop(client);
}

/// Two proxies, each behind a hop whose connections are then cut silently while idle in the
/// pool: the one with `health_check_after_ms` 300 checks the connection (idle 0.8 s) before
/// reuse, finds it dead and serves the query on a new backend with no error; the one with
/// 10 min hands the dead connection out unchecked, and its client gets no answer at all.
///
/// Why a silent cut and not `pg_terminate_backend`: a terminated backend says so (FATAL 57P01,
/// then EOF), and the pool sees those pending bytes at checkout and drops the connection
/// whatever `health_check_after_ms` is, so that would pass without the check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_check_after_ms_replaces_a_silently_dead_idle_connection() {
    if skip_direct() {
        return;
    }
    let cluster = Cluster::start();
    let monitor = cluster.superuser_client("postgres").await;
    let hop_checked = SilentCut::start(cluster.addr()).await;
    let hop_unchecked = SilentCut::start(cluster.addr()).await;
    let (checked, _c1) = proxy(
        &cluster,
        1,
        "pool: { health_check_after_ms: 300 }\n",
        Some(hop_checked.addr),
    );
    let (unchecked, _c2) = proxy(
        &cluster,
        1,
        "pool: { health_check_after_ms: 600000 }\n",
        Some(hop_unchecked.addr),
    );
    let a = Arc::new(checked.client().await);
    let b = Arc::new(unchecked.client().await);
    let (pid_a, pid_b) = (pid(&a).await, pid(&b).await);

    hop_checked.cut();
    hop_unchecked.cut();
    let cut_at = Instant::now();
    eventually(
        Duration::from_secs(5),
        "both cut backends to exit",
        || async {
            let live = app_backends(&monitor).await;
            !live.contains(&pid_a) && !live.contains(&pid_b)
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(800).saturating_sub(cut_at.elapsed())).await;

    let query_a = spawn_query(&a, "SELECT pg_backend_pid()");
    let query_b = spawn_query(&b, "SELECT pg_backend_pid()");
    let (took, result) = join(query_a).await;
    let rows = result.unwrap_or_else(|e| {
        panic!(
            "a connection idle past health_check_after_ms whose server is gone must be \
             replaced before reuse, but the client got {e:?}"
        )
    });
    let new_pid: i32 = rows[0].as_deref().expect("pid").parse().expect("pid");
    assert_ne!(new_pid, pid_a, "the query ran on a new backend");
    assert!(
        took < Duration::from_secs(8),
        "the health check (2 s limit) and the new connection took {took:?}"
    );
    let stats = pool_stats(&checked).await;
    assert_eq!(counter(&stats, "connects"), 2, "{stats}");

    // The control: idle 0.8 s is under its 10 min, so the dead connection is used as is.
    tokio::time::sleep(Duration::from_secs(4).saturating_sub(cut_at.elapsed())).await;
    if query_b.is_finished() {
        panic!(
            "with health_check_after_ms above the idle time the silently dead connection is \
             used unchecked, so this query cannot have been answered: {:?}",
            join(query_b).await
        );
    }
    query_b.abort();
}

// ------------------------------------------------------------------------------ connect attempts and backoff

/// A storm of 12 logins against a database that accepts TCP and then says nothing: only
/// `max_connect_attempts` (2) attempts are in flight, the other ten wait for them. When the
/// two fail, the failure backoff (20 s window) turns the ten away at once with 08006 and a
/// retry hint; none of them makes an attempt of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_connect_attempts_caps_a_storm_and_queued_clients_back_off() {
    if skip_direct() {
        return;
    }
    let cluster = Cluster::start();
    let hop = FaultProxy::start(cluster.addr()).await;
    hop.set(Fault::HangNew);
    let (proxy, _cfg) = proxy(
        &cluster,
        20,
        r#"
pool:
  max_connect_attempts: 2
  connect_backoff_base_ms: 20000
  connect_backoff_cap_ms: 20000
  checkout_timeout_ms: 15000
backend: { connect_timeout_ms: 10000 }
"#,
        Some(hop.addr()),
    );
    let started = Instant::now();
    let logins: Vec<_> = (0..12)
        .map(|_| {
            let cfg = proxy.app_config();
            tokio::spawn(async move {
                let r = within(
                    Duration::from_secs(20),
                    "a login",
                    cfg.connect(tokio_postgres::NoTls),
                )
                .await;
                (Instant::now(), r.map(|_| ()))
            })
        })
        .collect();
    eventually(
        Duration::from_secs(5),
        "the first connection attempts to reach the database",
        || async { hop.accepted() >= 2 },
    )
    .await;
    // Time for all twelve logins to queue behind the two attempts.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        hop.accepted(),
        2,
        "twelve logins at once, max_connect_attempts 2: only two attempts in flight"
    );
    let all_waiting = started.elapsed();

    // The database answers the two with a close; every new connection is reset.
    hop.set(Fault::Reset);
    let failed_at = Instant::now();
    for login in logins {
        let (done, result) = join(login).await;
        let e = match result {
            Ok(()) => panic!("a login succeeded against a database that never answers"),
            Err(e) => e,
        };
        let db = db_error(&e);
        assert_eq!(db.code().code(), "08006", "{db:?}");
        retry_hint(db);
        let after = done.saturating_duration_since(failed_at);
        assert!(
            after < Duration::from_secs(3),
            "a queued login got its error {after:?} after the attempts failed"
        );
    }
    let stats = pool_stats(&proxy).await;
    assert!(
        hop.accepted() <= 4,
        "after the first attempts failed, the queued logins must back off (20 s window), \
         not each try to connect: {} attempts for 12 logins ({stats})",
        hop.accepted()
    );
    assert_eq!(
        counter(&stats, "connect_failures"),
        hop.accepted() as u64,
        "{stats}"
    );
    assert!(
        all_waiting < Duration::from_secs(10),
        "setup took {all_waiting:?}"
    );
}

/// The backoff window after a failed connect: the first is at most
/// `connect_backoff_base_ms` (200), so a query 250 ms after a failure makes a new attempt
/// (tried ten times, a success in between resetting the streak); while the failures go on
/// the window doubles but never beyond `connect_backoff_cap_ms` (400), so every query 450 ms
/// after the last failure makes an attempt again, six failures deep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_backoff_windows_start_at_base_and_stop_at_cap() {
    if skip_direct() {
        return;
    }
    let cluster = Cluster::start();
    let hop = FaultProxy::start(cluster.addr()).await;
    let (proxy, _cfg) = proxy(
        &cluster,
        1,
        r#"
pool:
  max_connect_attempts: 1
  connect_backoff_base_ms: 200
  connect_backoff_cap_ms: 400
global_defaults:
  circuit_breaker: { consecutive_errors: 1000 }
"#,
        Some(hop.addr()),
    );
    let client = proxy.client().await;
    scalar(&client, "SELECT 1").await;

    // Fails the pooled connection and the next attempt; returns the attempts made.
    let fail_once = |what: String| {
        let client = &client;
        let hop = &hop;
        async move {
            let before = hop.accepted();
            let e = within(STEP, &what, client.simple_query("SELECT 1"))
                .await
                .expect_err("the database resets every connection");
            let db = db_error(&e);
            assert_eq!(db.code().code(), "08006", "{what}: {db:?}");
            retry_hint(db);
            hop.accepted() - before
        }
    };

    for trial in 0..10 {
        hop.set(Fault::Reset);
        hop.reset_all();
        // Let the proxy see the reset of its idle connection before the next checkout.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let made = fail_once(format!("trial {trial}: the first failure")).await;
        assert_eq!(made, 1, "trial {trial}: one attempt, which failed");
        tokio::time::sleep(Duration::from_millis(250)).await;
        hop.set(Fault::Pass);
        let before = hop.accepted();
        let r = within(
            STEP,
            "a query after the first window",
            client.simple_query("SELECT 1"),
        )
        .await;
        assert!(
            r.is_ok() && hop.accepted() == before + 1,
            "trial {trial}: 250 ms after the first failure the window \
             (connect_backoff_base_ms 200) is over: the query must connect ({r:?})"
        );
    }

    hop.set(Fault::Reset);
    hop.reset_all();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(fail_once("the first failure".into()).await, 1);
    for failures in 2..=6 {
        tokio::time::sleep(Duration::from_millis(450)).await;
        let made = fail_once(format!("failure {failures}")).await;
        assert_eq!(
            made,
            1,
            "450 ms after failure {} the window (at most connect_backoff_cap_ms 400) is over: \
             the query must make an attempt",
            failures - 1
        );
    }
    let stats = pool_stats(&proxy).await;
    assert_eq!(counter(&stats, "connect_failures"), 10 + 6, "{stats}");
}

// ------------------------------------------------------------------------------ prepared_cache_size

/// Five named statements on one backend whose cache holds two: every execution, in an order
/// that evicts each statement before its next use, returns its own result, and the backend
/// never holds more than two prepared statements.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_cache_size_bounds_the_backend_and_reprepares_evicted_statements() {
    if skip_direct() {
        return;
    }
    let cluster = Cluster::start();
    let (proxy, _cfg) = proxy(&cluster, 1, "pool: { prepared_cache_size: 2 }\n", None);
    let client = proxy.client().await;
    let mut statements = Vec::new();
    for k in 1..=5 {
        let sql = format!("SELECT $1::int4 + {k}");
        let s = within(STEP, "prepare", client.prepare(&sql))
            .await
            .unwrap_or_else(|e| panic!("prepare {sql}: {e:?}"));
        statements.push((k, s));
    }
    let mut most = 0;
    for round in 0..3 {
        for (k, s) in &statements {
            let x: i32 = 10 * round + k;
            let row = within(STEP, "execute", client.query_one(s, &[&x]))
                .await
                .unwrap_or_else(|e| panic!("execute statement {k} in round {round}: {e:?}"));
            assert_eq!(row.get::<_, i32>(0), x + k, "statement {k}, round {round}");
            let held: usize = scalar(&client, "SELECT count(*) FROM pg_prepared_statements")
                .await
                .parse()
                .expect("count");
            assert!(
                held <= 2,
                "the backend holds {held} prepared statements, prepared_cache_size is 2"
            );
            most = most.max(held);
        }
    }
    assert_eq!(most, 2, "the cache was used up to its size");
    let stats = pool_stats(&proxy).await;
    assert_eq!(
        counter(&stats, "connects"),
        1,
        "one backend served it all: {stats}"
    );
}

// ------------------------------------------------------------------------------ max_waiting

/// Pool of one, held by a 3 s query; `max_waiting` 2. Two clients wait; a third is refused
/// at once with 53300 `ERR_QUEUE_FULL` and a retry hint; a critical caller is not refused
/// by the cap, waits, and runs (first of the waiters) once the holder is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_waiting_refuses_at_once_beyond_the_cap_but_never_critical_callers() {
    if skip_direct() {
        return;
    }
    let cluster = Cluster::start();
    let (proxy, _cfg) = proxy(
        &cluster,
        1,
        r#"
pool: { max_waiting: 2, checkout_timeout_ms: 10000 }
global_defaults: { queue_timeout_ms: 10000 }
callers:
  - name: ops
    match: { application_name: ops }
    priority: critical
    queue_timeout_ms: 10000
"#,
        None,
    );
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(Arc::new(proxy.client().await));
    }
    let mut ops_cfg = proxy.app_config();
    ops_cfg.application_name("ops");
    let ops = Arc::new(proxy.client_with(&ops_cfg).await.0);
    // Every client has logged in and been served once: what follows needs no new login work.
    for c in clients.iter().chain([&ops]) {
        scalar(c, "SELECT 1").await;
    }

    let holder = spawn_query(&clients[0], "SELECT pg_sleep(3)");
    eventually(STEP, "the holder to run", || async {
        counter(&pool_stats(&proxy).await, "idle") == 0
    })
    .await;
    let w1 = spawn_query(&clients[1], "SELECT 'w1'");
    let w2 = spawn_query(&clients[2], "SELECT 'w2'");
    eventually(Duration::from_secs(5), "two waiters", || async {
        counter(&pool_stats(&proxy).await, "waiting") == 2
    })
    .await;

    let started = Instant::now();
    let refused = within(
        STEP,
        "the third waiter",
        clients[3].simple_query("SELECT 'w3'"),
    )
    .await;
    let took = started.elapsed();
    let e = refused.expect_err("a third waiter beyond max_waiting 2 is refused");
    let db = db_error(&e);
    assert_eq!(sqlstate(&e), "53300", "{db:?}");
    assert!(db.message().contains("ERR_QUEUE_FULL"), "{db:?}");
    retry_hint(db);
    assert!(
        took < Duration::from_millis(1000),
        "refused at once, not after a wait: {took:?}"
    );
    assert!(
        !holder.is_finished(),
        "the holder still runs: the refusal was not a timeout"
    );

    let critical = spawn_query(&ops, "SELECT 'ops'");
    eventually(
        Duration::from_secs(5),
        "the critical caller to wait",
        || async { counter(&pool_stats(&proxy).await, "waiting") == 3 },
    )
    .await;
    let stats = pool_stats(&proxy).await;
    assert_eq!(counter(&stats, "waiting_refused"), 1, "{stats}");
    assert_eq!(counter(&stats, "max_waiting"), 2, "{stats}");

    let (_, r) = join(holder).await;
    r.expect("the holder");
    let (ops_took, r) = join(critical).await;
    assert_eq!(
        r.expect("the critical caller runs"),
        [Some("ops".to_owned())]
    );
    assert!(
        ops_took > Duration::from_millis(500),
        "the critical caller waited for the holder ({ops_took:?})"
    );
    for (w, name) in [(w1, "w1"), (w2, "w2")] {
        let (_, r) = join(w).await;
        assert_eq!(
            r.expect("a waiter within the cap runs"),
            [Some(name.to_owned())]
        );
    }
    let stats = pool_stats(&proxy).await;
    assert_eq!(counter(&stats, "waiting_refused"), 1, "{stats}");
    assert_eq!(counter(&stats, "checkout_timeouts"), 0, "{stats}");
}
