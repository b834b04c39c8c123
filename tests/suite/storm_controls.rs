//! The controls that keep a storm from holding the database hostage (issue 17), against a
//! real PostgreSQL: a client idle inside its transaction past its caller's
//! `idle_transaction_timeout_ms` is disconnected with FATAL 25P03, its transaction rolled
//! back and its backend returned (a critical caller without the limit keeps its
//! transaction); and the pool's critical reserve keeps a backend that lower priorities cannot
//! take, so a critical statement runs at once while batch work queues — and the batch work
//! still completes instead of being refused.
//!
//! `limits.client_idle_timeout_ms` ends a client idle between transactions with FATAL 57P05
//! (never one that works or sits inside a transaction).
//!
//! The incident controls of the admin API: pause (in-flight transactions finish, new ones
//! wait, resume releases them, none lost), reconnect (every backend pid replaced), the client
//! and server lists, terminating a client (57P01, its statement stops on the server) or
//! cancelling its statement, and disabling new logins to a database (57P03).
//!
//! With `PGSLUICE_TEST_DIRECT=1` these tests are skipped (they are about the proxy).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_postgres::Client;

use crate::support::env::Env;
use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{ADMIN_READ_TOKEN, Proxy};
use crate::support::sql::{STEP, eventually, scalar, sqlstate};
use crate::support::wire::{Backend, WireClient};
use crate::support::{direct_mode, note_skipped, within};

fn start(pool: usize, yaml: &str) -> Option<Env> {
    if direct_mode() {
        note_skipped("storm controls (they need the proxy)");
        return None;
    }
    Some(Env::start(pool, yaml, |cluster| {
        cluster.psql_on(
            APP_DB,
            &format!(
                "CREATE TABLE acct (id int PRIMARY KEY, v int); INSERT INTO acct VALUES (1, 0); \
                 ALTER TABLE acct OWNER TO {APP_USER};"
            ),
        );
    }))
}

async fn client(proxy: &Proxy, application_name: &str) -> Arc<Client> {
    let mut cfg = proxy.app_config();
    cfg.application_name(application_name);
    Arc::new(proxy.client_with(&cfg).await.0)
}

const IDLE_YAML: &str = "\
global_defaults:
  idle_transaction_timeout_ms: 400
callers:
  - name: payment
    priority: critical
    idle_transaction_timeout_ms: 0
    match: { application_name: payment }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_idle_in_its_transaction_is_ended_and_its_backend_returned() {
    let Some(env) = start(1, IDLE_YAML) else {
        return;
    };
    let proxy = &env.proxy;
    // A default-caller client takes a row lock inside a transaction and goes quiet.
    let mut idle = WireClient::connect(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB)
        .await
        .expect("wire client");
    idle.simple("BEGIN").await.expect("BEGIN");
    idle.simple("UPDATE acct SET v = 42 WHERE id = 1")
        .await
        .expect("UPDATE");
    let quiet = Instant::now();
    let fatal = within(
        Duration::from_secs(10),
        "the idle-in-transaction FATAL",
        idle.recv(),
    )
    .await
    .expect("an ErrorResponse before the connection closes");
    let waited = quiet.elapsed();
    assert_eq!(fatal.error_code(), Some("25P03"), "{fatal:?}");
    assert!(
        waited >= Duration::from_millis(350) && waited < Duration::from_secs(4),
        "ended after its 400 ms, not before and not much later: {waited:?}"
    );
    if let Backend::Error { message, .. } = &fatal {
        assert!(message.contains("idle-in-transaction timeout"), "{message}");
    }
    assert!(
        idle.recv().await.is_err(),
        "the connection is closed after the FATAL"
    );

    // The only backend came back, rolled back: the lock is free and the update is gone.
    let other = client(proxy, "web").await;
    let t = Instant::now();
    let v = within(
        STEP,
        "the row the idle client locked",
        other.simple_query("UPDATE acct SET v = v + 1 WHERE id = 1 RETURNING v"),
    )
    .await
    .expect("the row is free again");
    let v = crate::support::sql::simple_values(&v);
    assert_eq!(
        v,
        vec![Some("1".to_owned())],
        "the idle client's update was rolled back"
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());

    // A critical caller with the limit turned off keeps its transaction open across a pause.
    let payment = client(proxy, "payment").await;
    within(STEP, "BEGIN", payment.batch_execute("BEGIN; SELECT 1"))
        .await
        .expect("BEGIN");
    tokio::time::sleep(Duration::from_millis(900)).await;
    within(
        STEP,
        "COMMIT",
        payment.batch_execute("UPDATE acct SET v = 7; COMMIT"),
    )
    .await
    .expect("the critical transaction survives the pause");
    assert_eq!(scalar(&other, "SELECT v FROM acct").await, "7");
    proxy.assert_healthy().await;
}

const RESERVE_YAML: &str = "\
callers:
  - name: payment
    priority: critical
    match: { application_name: payment }
  - name: batch
    priority: low
    match: { application_name: batch }
";

/// Backends of the proxy running `pg_sleep`, seen from the database.
async fn sleeping(cluster: &Cluster) -> usize {
    cluster
        .monitor()
        .await
        .active_queries_like("pg_sleep")
        .await
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_critical_reserve_is_free_while_batch_work_queues_and_completes() {
    // Pool of 4 with a critical caller: one backend (a tenth, at least 1) is reserved.
    let Some(env) = start(4, RESERVE_YAML) else {
        return;
    };
    let proxy = &env.proxy;
    let (status, pools) = proxy
        .admin_request("GET", "/v1/pools", ADMIN_READ_TOKEN, None)
        .await;
    assert_eq!(status, 200, "{pools}");
    let mut batch = Vec::new();
    for _ in 0..5 {
        batch.push(client(proxy, "batch").await);
    }
    let payment = client(proxy, "payment").await;
    let started = Instant::now();
    let tasks: Vec<_> = batch
        .iter()
        .map(|c| {
            let c = Arc::clone(c);
            tokio::spawn(async move {
                let r = within(STEP, "batch", c.simple_query("SELECT pg_sleep(0.8)")).await;
                (r.map(|_| ()).map_err(|e| sqlstate(&e)), Instant::now())
            })
        })
        .collect();
    // Three of the five run; the reserve stays free.
    eventually(
        Duration::from_secs(10),
        "three batch statements running",
        || async { sleeping(&env.cluster).await == 3 },
    )
    .await;
    assert_eq!(
        sleeping(&env.cluster).await,
        3,
        "the fourth backend is reserved"
    );
    let t = Instant::now();
    within(STEP, "payment", payment.simple_query("SELECT 1"))
        .await
        .expect("the critical statement runs");
    let critical_took = t.elapsed();
    assert!(
        critical_took < Duration::from_millis(400),
        "the critical statement did not wait for batch work: {critical_took:?}"
    );
    // Every batch statement completes (queued, not refused), in two waves.
    let mut last = started;
    for t in tasks {
        let (r, at) = within(STEP, "batch task", t).await.expect("task");
        assert_eq!(r, Ok(()), "batch work queues and runs");
        last = last.max(at);
    }
    assert!(
        last.duration_since(started) >= Duration::from_millis(1500),
        "five 0.8 s statements on three backends take two waves: {:?}",
        last.duration_since(started)
    );
    let (_, pools) = proxy
        .admin_request("GET", "/v1/pools", ADMIN_READ_TOKEN, None)
        .await;
    let v: serde_json::Value = serde_json::from_str(&pools).expect("JSON");
    assert_eq!(v["pools"][0]["critical_reserve"], 1, "{pools}");
    let (_, metrics) = proxy
        .admin_request("GET", "/metrics", ADMIN_READ_TOKEN, None)
        .await;
    assert!(
        metrics.contains(
            "pgsluice_pool_critical_reserve{database=\"appdb\",pool=\"appdb/app\",user=\"app\"} 1"
        ),
        "{metrics}"
    );
    proxy.assert_healthy().await;
}

const DRAIN_YAML: &str = "\
callers:
  - name: sync
    max_concurrency: 1
    queue_depth: 0
    match: { application_name: sync }
";

/// N from a `retry_after_ms=N` HINT.
fn hint_ms(e: &tokio_postgres::Error) -> u64 {
    let db = e.as_db_error().expect("an ErrorResponse");
    db.hint()
        .and_then(|h| h.strip_prefix("retry_after_ms="))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("a retry hint: {db:?}"))
}

/// A caller whose one slot is busy with 0.4 s statements drains about 2.5 statements a
/// second: once the proxy has seen that rate, its refusals say "come back in about 0.4 s"
/// (spread over half to one and a half of it) however long the streak of refusals — not a
/// window that doubles with every refusal up to 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_hint_the_expected_wait_of_the_queue_that_refused() {
    let Some(env) = start(4, DRAIN_YAML) else {
        return;
    };
    let proxy = &env.proxy;
    let busy = client(proxy, "sync").await;
    let worker = tokio::spawn(async move {
        for _ in 0..12 {
            let _ = busy.simple_query("SELECT pg_sleep(0.4)").await;
        }
    });
    let refused = client(proxy, "sync").await;
    let mut hints = Vec::new();
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        if let Err(e) = within(
            STEP,
            "a refused statement",
            refused.simple_query("SELECT 1"),
        )
        .await
        {
            assert_eq!(sqlstate(&e), "53300", "{e:?}");
            hints.push(hint_ms(&e));
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    worker.abort();
    assert!(hints.len() >= 10, "the slot stayed busy: {hints:?}");
    let last = &hints[hints.len() - 5..];
    assert!(
        last.iter().all(|h| (150..=1200).contains(h)),
        "hints follow the 0.4 s drain, not the streak: {hints:?}"
    );
    proxy.assert_healthy().await;
}

/// The adaptive limit follows the database load: here the probe reads a number the test
/// sets (`probe_sql`), so the control law is driven exactly. High load: the low priority's
/// share of the pool falls (a third off per reading, low cut twice as fast) while critical
/// work still gets every backend; quiet again: the limit climbs back to the whole pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_adaptive_limit_holds_low_priority_back_while_the_database_is_loaded() {
    let yaml = "\
pool: { critical_reserve: 0, checkout_timeout_ms: 15000 }
global_defaults:
  circuit_breaker:
    probe_sql: \"SELECT v FROM load_knob\"
    probe_interval_ms: 100
callers:
  - { name: payment, priority: critical, match: { application_name: payment } }
  - { name: batch, priority: low, queue_timeout_ms: 15000, match: { application_name: batch } }
";
    let Some(env) = start(6, yaml) else {
        return;
    };
    env.cluster.psql_on(
        APP_DB,
        &format!(
            "CREATE TABLE load_knob (v float8); INSERT INTO load_knob VALUES (0); \
             ALTER TABLE load_knob OWNER TO {APP_USER};"
        ),
    );
    let proxy = &env.proxy;
    let pools = || async {
        let (_, body) = proxy
            .admin_request("GET", "/v1/pools", ADMIN_READ_TOKEN, None)
            .await;
        let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        v["pools"][0].clone()
    };
    let knob = client(proxy, "ops").await;
    // Warm the pool's entry (pools appear with their first client).
    scalar(&knob, "SELECT 1").await;
    eventually(
        Duration::from_secs(10),
        "the whole pool while quiet",
        || async { pools().await["adaptive_limit"] == 6 },
    )
    .await;
    knob.batch_execute("UPDATE load_knob SET v = 95")
        .await
        .expect("load up");
    eventually(
        Duration::from_secs(10),
        "the limit at its floor",
        || async { pools().await["adaptive_limit"] == 2 },
    )
    .await;
    let caps = pools().await["priority_caps"].clone();
    assert_eq!(caps, serde_json::json!([6, 4, 2, 1]), "low is cut first");

    // Low work runs one at a time; critical work is not held back.
    let mut batch = Vec::new();
    for _ in 0..3 {
        batch.push(client(proxy, "batch").await);
    }
    let tasks: Vec<_> = batch
        .iter()
        .map(|c| {
            let c = Arc::clone(c);
            tokio::spawn(async move {
                within(STEP, "batch", c.simple_query("SELECT pg_sleep(0.6)"))
                    .await
                    .map(|_| ())
                    .map_err(|e| sqlstate(&e))
            })
        })
        .collect();
    eventually(
        Duration::from_secs(5),
        "one batch statement running",
        || async { sleeping(&env.cluster).await == 1 },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(sleeping(&env.cluster).await, 1, "low holds one backend");
    let payment = client(proxy, "payment").await;
    let t = Instant::now();
    within(STEP, "payment", payment.simple_query("SELECT 1"))
        .await
        .expect("critical runs");
    assert!(
        t.elapsed() < Duration::from_millis(400),
        "{:?}",
        t.elapsed()
    );
    // Quiet again: the limit climbs back and the waiting batch work is let in.
    knob.batch_execute("UPDATE load_knob SET v = 0")
        .await
        .expect("load down");
    eventually(Duration::from_secs(10), "the whole pool again", || async {
        pools().await["adaptive_limit"] == 6
    })
    .await;
    for t in tasks {
        assert_eq!(within(STEP, "batch", t).await.expect("task"), Ok(()));
    }
    let (_, metrics) = proxy
        .admin_request("GET", "/metrics", ADMIN_READ_TOKEN, None)
        .await;
    assert!(
        metrics.contains(
            "pgsluice_pool_adaptive_limit{database=\"appdb\",pool=\"appdb/app\",user=\"app\"} 6"
        ),
        "{metrics}"
    );
    proxy.assert_healthy().await;
}

const CLIENT_IDLE_YAML: &str = "\
limits:
  client_idle_timeout_ms: 400
";

/// Waits for the 57P05 FATAL of `limits.client_idle_timeout_ms` and the close after it;
/// returns how long the client had been quiet.
async fn ended_for_idling(c: &mut WireClient, quiet: Instant) -> Duration {
    let fatal = within(Duration::from_secs(10), "the idle-session FATAL", c.recv())
        .await
        .expect("an ErrorResponse before the connection closes");
    let waited = quiet.elapsed();
    assert_eq!(fatal.error_code(), Some("57P05"), "{fatal:?}");
    if let Backend::Error { message, .. } = &fatal {
        assert!(message.contains("idle-session timeout"), "{message}");
    }
    assert!(
        c.recv().await.is_err(),
        "the connection is closed after the FATAL"
    );
    waited
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_idle_between_transactions_is_ended_but_not_one_that_works_or_is_in_a_transaction()
{
    let Some(env) = start(1, CLIENT_IDLE_YAML) else {
        return;
    };
    let proxy = &env.proxy;
    let connect = || WireClient::connect(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB);

    // Logged in and never said a word.
    let mut silent = connect().await.expect("wire client");
    let waited = ended_for_idling(&mut silent, Instant::now()).await;
    assert!(
        waited >= Duration::from_millis(350) && waited < Duration::from_secs(4),
        "ended after its 400 ms, not before and not much later: {waited:?}"
    );

    // Ran a statement, then went quiet: the clock starts at the answer.
    let mut quiet = connect().await.expect("wire client");
    quiet.simple("SELECT 1").await.expect("SELECT 1");
    let waited = ended_for_idling(&mut quiet, Instant::now()).await;
    assert!(waited >= Duration::from_millis(350), "{waited:?}");

    // A client that keeps working is never idle for 400 ms.
    let mut busy = connect().await.expect("wire client");
    for _ in 0..6 {
        busy.simple("SELECT 1")
            .await
            .expect("a working client stays");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Inside a transaction the idle-in-transaction limit applies (off here), not this one.
    let mut in_txn = connect().await.expect("wire client");
    in_txn.simple("BEGIN").await.expect("BEGIN");
    in_txn
        .simple("UPDATE acct SET v = 3 WHERE id = 1")
        .await
        .expect("UPDATE");
    tokio::time::sleep(Duration::from_millis(900)).await;
    in_txn
        .simple("COMMIT")
        .await
        .expect("the transaction survives a pause longer than the idle-client limit");
    // ... and once it is over, the client-idle clock runs again.
    let waited = ended_for_idling(&mut in_txn, Instant::now()).await;
    assert!(waited >= Duration::from_millis(350), "{waited:?}");
    drop(busy);
    proxy.assert_healthy().await;
}

const CONTROL_YAML: &str = "\
admin:
  write_token: control-write
";

/// An admin request with the write token (reads accept it too): (status, JSON body).
async fn control(
    proxy: &Proxy,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, serde_json::Value) {
    let (status, text) = proxy
        .admin_request(method, path, "control-write", body)
        .await;
    let v = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    (status, v)
}

/// Backend pids of the app user, from Postgres itself.
async fn app_backends(db: &Client) -> Vec<i32> {
    let rows = db
        .query(
            "SELECT pid FROM pg_stat_activity WHERE usename = $1 AND datname = $2",
            &[&APP_USER, &APP_DB],
        )
        .await
        .expect("pg_stat_activity");
    rows.iter().map(|r| r.get::<_, i32>(0)).collect()
}

/// The client record whose latest statement runs on `pid`.
async fn client_on(proxy: &Proxy, pid: i32) -> Option<serde_json::Value> {
    let (status, v) = control(proxy, "GET", "/v1/clients", None).await;
    assert_eq!(status, 200, "{v}");
    v["clients"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["backend_pid"] == pid).cloned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incident_controls_pause_resume_reconnect_list_kill_and_disable() {
    let Some(env) = start(4, CONTROL_YAML) else {
        return;
    };
    let proxy = &env.proxy;
    let db = env.cluster.superuser_client(APP_DB).await;
    let pool = format!("/v1/pools/{APP_DB}/{APP_USER}");
    let (status, v) = control(proxy, "POST", "/v1/pools/nodb/nouser/pause", None).await;
    assert_eq!(status, 404, "{v}");

    // Pause with 20 clients running transactions: those in flight finish, new ones wait,
    // the resume releases them, and not one transaction is lost.
    const CLIENTS: usize = 20;
    const EACH: usize = 10;
    let mut workers = Vec::new();
    for _ in 0..CLIENTS {
        let c = client(proxy, "web").await;
        workers.push(tokio::spawn(async move {
            for _ in 0..EACH {
                c.batch_execute(
                    "BEGIN; UPDATE acct SET v = v + 1 WHERE id = 1; SELECT pg_sleep(0.02); COMMIT",
                )
                .await?;
            }
            Ok::<_, tokio_postgres::Error>(())
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, v) = control(
        proxy,
        "POST",
        &format!("{pool}/pause"),
        Some(r#"{"hold_ms": 20000, "wait_ms": 10000}"#),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["paused"].as_bool(), v["drained"].as_bool()),
        (Some(true), Some(true)),
        "{v}"
    );
    let busy: i64 = db
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = $1 AND state <> 'idle'",
            &[&APP_USER],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(busy, 0, "no transaction runs while paused");
    let at_pause = scalar(&db, "SELECT v FROM acct WHERE id = 1").await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        scalar(&db, "SELECT v FROM acct WHERE id = 1").await,
        at_pause,
        "nothing committed while paused"
    );
    let (_, clients) = control(proxy, "GET", "/v1/clients", None).await;
    let waiting = clients["clients"]
        .as_array()
        .map_or(0, |c| c.iter().filter(|c| c["state"] == "waiting").count());
    assert!(waiting > 0, "held clients show as waiting: {clients}");
    let (_, pools) = control(proxy, "GET", "/v1/pools", None).await;
    assert_eq!(pools["pools"][0]["paused"], true, "{pools}");
    let (status, v) = control(proxy, "POST", &format!("{pool}/resume"), None).await;
    assert_eq!((status, v["paused"].as_bool()), (200, Some(false)), "{v}");
    for w in workers {
        within(STEP, "a worker after the resume", w)
            .await
            .expect("join")
            .expect("every transaction of every client succeeds");
    }
    assert_eq!(
        scalar(&db, "SELECT v FROM acct WHERE id = 1").await,
        (CLIENTS * EACH).to_string(),
        "none lost"
    );

    // Reconnect replaces every backend: the idle ones at once, one in a transaction when it
    // commits.
    let holder = client(proxy, "web").await;
    holder
        .batch_execute("BEGIN; SELECT 1")
        .await
        .expect("BEGIN");
    let before = app_backends(&db).await;
    assert!(!before.is_empty());
    let (status, v) = control(proxy, "POST", &format!("{pool}/reconnect"), None).await;
    assert_eq!((status, v["in_use"].as_u64()), (200, Some(1)), "{v}");
    holder.batch_execute("COMMIT").await.expect("COMMIT");
    let worker = client(proxy, "web").await;
    for _ in 0..8 {
        scalar(&worker, "SELECT 1").await;
    }
    eventually(STEP, "every backend replaced", || async {
        let after = app_backends(&db).await;
        !after.is_empty() && after.iter().all(|p| !before.contains(p))
    })
    .await;

    // The client list shows a running statement, and DELETE ends it: the client gets 57P01
    // and the statement stops on the server.
    let sleeper = client(proxy, "web").await;
    let running = tokio::spawn({
        let s = sleeper.clone();
        async move { s.simple_query("SELECT pg_sleep(30)").await }
    });
    eventually(STEP, "pg_sleep running", || async {
        sleeping(&env.cluster).await != 0
    })
    .await;
    let pids: Vec<i32> = db
        .query(
            "SELECT pid FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(30)%'",
            &[],
        )
        .await
        .expect("pids")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let row = client_on(proxy, pids[0])
        .await
        .expect("the sleeper is listed with its backend");
    assert_eq!(row["state"], "active", "{row}");
    assert_eq!(row["caller"], "default", "{row}");
    assert_eq!(row["user"], APP_USER, "{row}");
    assert!(
        row["fingerprint"].as_str().is_some_and(|f| f.len() == 16),
        "{row}"
    );
    let (_, servers) = control(proxy, "GET", "/v1/servers", None).await;
    assert!(
        servers["servers"].as_array().is_some_and(|s| s
            .iter()
            .any(|s| s["pid"] == pids[0] && s["client"] == row["id"])),
        "{servers}"
    );
    let id = row["id"].as_u64().expect("id");
    let t = Instant::now();
    let (status, v) = control(proxy, "DELETE", &format!("/v1/clients/{id}"), None).await;
    assert_eq!(status, 200, "{v}");
    let err = within(STEP, "the killed statement", running)
        .await
        .expect("join")
        .expect_err("the session is ended");
    assert_eq!(sqlstate(&err), "57P01", "{err:?}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    eventually(STEP, "the statement stops on the server", || async {
        sleeping(&env.cluster).await == 0
    })
    .await;
    let (status, _) = control(proxy, "DELETE", &format!("/v1/clients/{id}"), None).await;
    assert_eq!(status, 404);

    // Cancel only the statement: the session goes on.
    let other = client(proxy, "web").await;
    let running = tokio::spawn({
        let s = other.clone();
        async move { s.simple_query("SELECT pg_sleep(30)").await }
    });
    eventually(STEP, "pg_sleep running again", || async {
        sleeping(&env.cluster).await != 0
    })
    .await;
    let pid: i32 = db
        .query_one(
            "SELECT pid FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(30)%'",
            &[],
        )
        .await
        .expect("pid")
        .get(0);
    let row = client_on(proxy, pid).await.expect("listed");
    let (status, v) = control(
        proxy,
        "POST",
        &format!("/v1/clients/{}/cancel", row["id"]),
        None,
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let err = within(STEP, "the cancelled statement", running)
        .await
        .expect("join")
        .expect_err("cancelled");
    assert_eq!(sqlstate(&err), "57014", "{err:?}");
    assert_eq!(scalar(&other, "SELECT 2").await, "2", "the session goes on");

    // Disable refuses new logins to the database (57P03); open sessions go on; enable.
    let (status, v) = control(
        proxy,
        "POST",
        &format!("/v1/databases/{APP_DB}/disable"),
        None,
    )
    .await;
    assert_eq!((status, v["enabled"].as_bool()), (200, Some(false)), "{v}");
    let refused = proxy
        .try_client_with(&proxy.app_config())
        .await
        .map(|_| ())
        .expect_err("disabled");
    assert_eq!(sqlstate(&refused), "57P03", "{refused:?}");
    assert_eq!(scalar(&other, "SELECT 3").await, "3");
    let (status, _) = control(
        proxy,
        "POST",
        &format!("/v1/databases/{APP_DB}/enable"),
        None,
    )
    .await;
    assert_eq!(status, 200);
    let again = client(proxy, "web").await;
    assert_eq!(scalar(&again, "SELECT 4").await, "4");
    proxy.assert_healthy().await;
}

const CAPS_YAML: &str = "\
pool:
  max_db_connections: 3
  checkout_timeout_ms: 15000
global_defaults:
  queue_timeout_ms: 15000
auth:
  users:
    - { name: app2, password: secret2 }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_db_connections_holds_across_two_users_under_load() {
    if direct_mode() {
        note_skipped("max_db_connections (a proxy setting)");
        return;
    }
    let env = Env::start(10, CAPS_YAML, |cluster| {
        cluster.psql_on(
            APP_DB,
            "CREATE ROLE app2 LOGIN PASSWORD 'secret2'; GRANT CONNECT ON DATABASE appdb TO app2;",
        );
    });
    let proxy = &env.proxy;
    let db = env.cluster.superuser_client(APP_DB).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut most = 0i64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let n: i64 = db
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity \
                         WHERE datname = 'appdb' AND usename IN ('app', 'app2')",
                        &[],
                    )
                    .await
                    .expect("count")
                    .get(0);
                most = most.max(n);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            most
        }
    });
    let mut workers = Vec::new();
    for i in 0..16 {
        let mut cfg = proxy.app_config();
        if i % 2 == 1 {
            cfg.user("app2").password("secret2");
        }
        let (c, _conn) = proxy.client_with(&cfg).await;
        workers.push(tokio::spawn(async move {
            for _ in 0..15 {
                c.simple_query("SELECT pg_sleep(0.01)").await?;
            }
            c.simple_query("SELECT current_user").await
        }));
    }
    let mut users = std::collections::BTreeSet::new();
    for w in workers {
        let rows = within(STEP, "a worker", w)
            .await
            .expect("join")
            .expect("every statement of both users runs (waiting, not refused)");
        users.extend(
            crate::support::sql::simple_values(&rows)
                .into_iter()
                .flatten(),
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let most = watcher.await.expect("watcher");
    assert!(
        most <= 3,
        "pg_stat_activity showed {most} backends of appdb; the cap is 3"
    );
    assert!(most >= 2, "the load used the cap ({most})");
    assert_eq!(users.len(), 2, "both users were served: {users:?}");
    let (status, text) = proxy
        .admin_request("GET", "/v1/pools", ADMIN_READ_TOKEN, None)
        .await;
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&text).expect("pools JSON");
    let cap = v["caps"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "database appdb"))
        .unwrap_or_else(|| panic!("no appdb cap: {v}"));
    assert_eq!(cap["limit"], 3, "{cap}");
    assert!(cap["open"].as_u64().is_some_and(|n| n <= 3), "{cap}");
    proxy.assert_healthy().await;
}
