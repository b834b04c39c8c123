//! Pool statistics in `/metrics`, from a proxy started by hand (`crate::support::spawned`): what
//! SHOW STATS users graph, per pool with database and user labels; the time spent on the backend
//! apart from the waits; wait buckets that reach the configured timeout.

use std::sync::Arc;
use std::time::Duration;

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::spawned::{get, metric, spawn};

/// What SHOW STATS users graph, per pool with database and user labels; backend time apart
/// from the waits; wait buckets that reach the configured timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_statistics_and_separate_wait_and_backend_times_reach_the_metrics() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("pgsluice.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nbackend:\n  url: postgres://{APP_USER}:{APP_PASSWORD}@{}/{APP_DB}\n\
             admin:\n  listen: 127.0.0.1:0\npool:\n  size: 1\n  checkout_timeout_ms: 5000\n",
            cluster.addr()
        ),
    )
    .expect("write config");
    let p = spawn(&[], &["--config", &config.display().to_string()]);
    let url = format!(
        "host={} port={} user={APP_USER} password={APP_PASSWORD} dbname={APP_DB}",
        p.listen.ip(),
        p.listen.port()
    );
    let connect = || async {
        let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("login");
        tokio::spawn(conn);
        c
    };
    let a = connect().await;
    // Kept open to the end: its Terminate would race the scrapes.
    let b = Arc::new(connect().await);
    // Every client message after login is a Query: the bytes received are their frames.
    let mut sent_by_clients = 0usize;
    let mut frame = |sql: &str| {
        sent_by_clients += 1 + 4 + sql.len() + 1;
        sql.to_owned()
    };
    for i in 0..10 {
        a.simple_query(&frame(&format!("SELECT {i}")))
            .await
            .expect("select");
    }
    // One explicit transaction of three statements, holding the only backend for 400 ms
    // while the other client waits for it; 100 ms into its wait, that client pipelines a
    // second query, read while it waits.
    a.batch_execute(&frame("BEGIN; SELECT 1"))
        .await
        .expect("begin");
    let (first, second) = (frame("SELECT 'waited'"), frame("SELECT 'pipelined'"));
    let b2 = Arc::clone(&b);
    let waiter = tokio::spawn(async move {
        let b = b2;
        let later = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            b.simple_query(&second).await
        };
        let (x, y) = tokio::join!(b.simple_query(&first), later);
        x.and(y)
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    a.batch_execute(&frame("SELECT pg_sleep(0.01); COMMIT"))
        .await
        .expect("commit");
    waiter.await.expect("join").expect("the waiting client ran");

    let (status, text) = get(p.admin, "/metrics");
    assert_eq!(status, 200);
    let pool = r#"{database="appdb",pool="appdb/app",user="app"}"#;
    let received = r#"pgsluice_pool_bytes_total{database="appdb",direction="received",pool="appdb/app",user="app"}"#;
    let sent = r#"pgsluice_pool_bytes_total{database="appdb",direction="sent",pool="appdb/app",user="app"}"#;
    assert_eq!(
        metric(&text, received),
        Some(sent_by_clients as f64),
        "every byte the clients sent, the pipelined query included\n{text}"
    );
    let at = |name: &str| metric(&text, &format!("{name}{pool}")).unwrap_or(-1.0);
    // Ten, one explicit, and the waiting client's two (pipelined on one backend, each
    // ended by its own ReadyForQuery).
    assert_eq!(at("pgsluice_pool_transactions_total"), 13.0, "{text}");
    // One per Query message (a multi-statement text is one), as PgBouncer counts them.
    assert_eq!(at("pgsluice_pool_queries_total"), 14.0, "{text}");
    assert!(
        at("pgsluice_pool_transaction_seconds_total") >= 0.4,
        "{text}"
    );
    assert!(at("pgsluice_pool_query_seconds_total") > 0.0, "{text}");
    assert!(at("pgsluice_pool_wait_seconds_total") >= 0.3, "{text}");
    for direction in ["received", "sent"] {
        let series = format!(
            r#"pgsluice_pool_bytes_total{{database="appdb",direction="{direction}",pool="appdb/app",user="app"}}"#
        );
        assert!(
            metric(&text, &series).is_some_and(|v| v > 100.0),
            "{series}\n{text}"
        );
    }
    let backend = metric(
        &text,
        r#"pgsluice_backend_duration_seconds_count{caller="default"}"#,
    );
    assert!(backend.is_some_and(|n| n >= 13.0), "{backend:?}");
    // The 400 ms wait: above the 0.25 s bucket, inside 0.5 s; buckets reach the 5 s timeout.
    let bucket = |le: &str| {
        metric(
            &text,
            &format!(r#"pgsluice_checkout_wait_seconds_bucket{{caller="default",le="{le}"}}"#),
        )
        .unwrap_or(-1.0)
    };
    let count = metric(
        &text,
        r#"pgsluice_checkout_wait_seconds_count{caller="default"}"#,
    )
    .unwrap_or(0.0);
    assert!(bucket("0.25") < count && bucket("0.5") >= 1.0, "{text}");
    assert_eq!(bucket("5"), count, "a bucket at the 5 s checkout timeout");
    // The client-observed time of the waiting statement includes its wait; its backend time
    // does not.
    let total_slow = count_above(&text, "pgsluice_query_duration_seconds", 0.25);
    let backend_slow = count_above(&text, "pgsluice_backend_duration_seconds", 0.25);
    assert!(total_slow > backend_slow, "{total_slow} vs {backend_slow}");

    // N transactions of the extended protocol (Bind/Execute/Sync of a prepared statement,
    // as most drivers send them) move every counter by at least N.
    const N: i32 = 20;
    let stmt = a.prepare("SELECT $1::int4").await.expect("prepare");
    let series = [
        format!("pgsluice_pool_transactions_total{pool}"),
        format!("pgsluice_pool_queries_total{pool}"),
        r#"pgsluice_backend_duration_seconds_count{caller="default"}"#.to_owned(),
        received.to_owned(),
        sent.to_owned(),
    ];
    let read = |text: &str| -> Vec<f64> {
        series
            .iter()
            .map(|s| metric(text, s).unwrap_or(-1.0))
            .collect()
    };
    let before = read(&get(p.admin, "/metrics").1);
    for i in 0..N {
        let row = a.query_one(&stmt, &[&i]).await.expect("execute");
        assert_eq!(row.get::<_, i32>(0), i);
    }
    let (status, text) = get(p.admin, "/metrics");
    assert_eq!(status, 200);
    let after = read(&text);
    for (i, s) in series.iter().enumerate() {
        let grew = after[i] - before[i];
        let least = if i < 3 { f64::from(N) } else { 1.0 };
        assert!(
            before[i] >= 0.0 && grew >= least,
            "{s}: {} -> {}\n{text}",
            before[i],
            after[i]
        );
    }
}

/// Observations of `histogram{caller="default"}` above `le` (count minus that bucket).
fn count_above(text: &str, histogram: &str, le: f64) -> f64 {
    let count = metric(text, &format!(r#"{histogram}_count{{caller="default"}}"#)).unwrap_or(0.0);
    let below = metric(
        text,
        &format!(r#"{histogram}_bucket{{caller="default",le="{le}"}}"#),
    )
    .unwrap_or(0.0);
    count - below
}
