//! The circuit breaker (issue 5), against a real PostgreSQL: consecutive backend faults
//! (statement timeouts) open it — a client's own cancel does not, and pipelined faults each
//! count — and so does the health probe (`db_cpu_threshold_percent`); while it is open normal
//! traffic gets 53000 `ERR_CIRCUIT_OPEN` at once and critical traffic runs; a failed trial
//! reopens it, a successful one closes it.
//!
//! Every test starts its own cluster and proxy with a YAML config (`crate::support::policy`);
//! with `PGSLUICE_TEST_DIRECT=1` they are skipped.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_postgres::NoTls;

use crate::support::pg::APP_DB;
use crate::support::policy::{
    Timed, admin_get, assert_refusal, connect, db_error, detail, exec, join_all, poll_until,
    spawn_timed, start, start_with, timed, wait_for_running,
};
use crate::support::proxy::Proxy;
use crate::support::sql::{STEP, join, scalar, sqlstate};
use crate::support::within;

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
