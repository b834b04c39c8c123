//! The design article's examples, pasted as they are (issue 16): its callers YAML
//! (`tests/seeds/001-callers.yaml`, byte for byte the article's block, with no `match:`) is the
//! whole config file; only the listen and backend addresses and the pool size come from the
//! command line. Its scenario is replayed against a real PostgreSQL: the sixth concurrent
//! `service_analytics` query is refused at once with 53300 `ERR_CALLER_LIMIT_EXCEEDED`, and
//! `service_payment` waits up to its 200 ms before being refused. `check-config` on the same
//! file names the implicit match, runs the built-in load probe of
//! `db_cpu_threshold_percent: 85` and reports `max_connections`; on a config with a setting
//! that does nothing it says so.
//!
//! With `PGSLUICE_TEST_DIRECT=1` these tests are skipped (they are about the proxy).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_postgres::Client;

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{ADMIN_READ_TOKEN, Proxy, ProxyOptions, client};
use crate::support::sql::{STEP, eventually, sqlstate};
use crate::support::{direct_mode, note_skipped, run_with_timeout, within};

/// The article's callers block, verbatim.
fn article_yaml() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/seeds/001-callers.yaml")
}

/// Runs `sql`; the elapsed time and the SQLSTATE and message of its error, if any.
async fn timed(c: &Client, sql: &str) -> (Duration, Option<(String, String)>) {
    let start = Instant::now();
    let r = within(STEP, sql, c.simple_query(sql)).await;
    let e = r.err().map(|e| {
        let message = e
            .as_db_error()
            .map_or_else(|| e.to_string(), |d| d.message().to_owned());
        (sqlstate(&e), message)
    });
    (start.elapsed(), e)
}

/// Backends of the proxy running `pg_sleep`, seen from the database.
async fn sleeping(cluster: &Cluster) -> i64 {
    let (c, conn) = tokio_postgres::connect(
        &cluster.connect_str(APP_USER, APP_PASSWORD, APP_DB),
        tokio_postgres::NoTls,
    )
    .await
    .expect("direct connection");
    tokio::spawn(conn);
    let rows = c
        .query(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%pg_sleep%' \
             AND state = 'active' AND pid <> pg_backend_pid()",
            &[],
        )
        .await
        .expect("pg_stat_activity");
    rows[0].get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_articles_callers_yaml_limits_as_the_article_says() {
    if direct_mode() {
        note_skipped("the article's scenario (it needs the proxy)");
        return;
    }
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(20).config_file(article_yaml()));

    // Five service_analytics queries run (max_concurrency: 5) ...
    let mut analytics = Vec::new();
    for _ in 0..6 {
        analytics.push(client(&proxy, "service_analytics").await);
    }
    let running: Vec<_> = analytics[..5]
        .iter()
        .map(|c| {
            let c = Arc::clone(c);
            tokio::spawn(async move { timed(&c, "SELECT pg_sleep(1.5)").await })
        })
        .collect();
    eventually(
        Duration::from_secs(10),
        "five analytics queries running",
        || {
            let cluster = &cluster;
            async move { sleeping(cluster).await == 5 }
        },
    )
    .await;
    // ... and the sixth is refused at once, without waiting (queue_depth: 0).
    let (took, err) = timed(&analytics[5], "SELECT 1").await;
    let (state, message) = err.expect("the sixth analytics query is refused");
    assert_eq!(state, "53300", "{message}");
    assert!(
        message.contains("ERR_CALLER_LIMIT_EXCEEDED") && message.contains("service_analytics"),
        "{message}"
    );
    assert!(
        took < Duration::from_millis(500),
        "refused at once, took {took:?}"
    );
    for t in running {
        let (_, err) = within(STEP, "an analytics query", t).await.expect("task");
        assert!(err.is_none(), "the first five run: {err:?}");
    }

    // The default caller (max_concurrency: 120) can take 18 of the 20 backends: with a
    // critical caller configured, a tenth of the pool is reserved for it. Long sleeps:
    // opening the further backends (4 at a time) takes a while on a busy box.
    // (Connected first: a login whose settings the pool has not seen needs a backend.)
    let payment = client(&proxy, "checkout-web").await;
    let mut holders = Vec::new();
    for _ in 0..18 {
        holders.push(client(&proxy, "batch").await);
    }
    let sleep = |c: &Arc<Client>, sql: &'static str| {
        let c = Arc::clone(c);
        tokio::spawn(async move { timed(&c, sql).await })
    };
    let mut held: Vec<_> = holders
        .iter()
        .map(|c| sleep(c, "SELECT pg_sleep(5)"))
        .collect();
    eventually(Duration::from_secs(10), "18 batch sleepers", || {
        let cluster = &cluster;
        async move { sleeping(cluster).await == 18 }
    })
    .await;
    // The reserve is service_payment's: two of its statements run at once.
    for _ in 0..2 {
        let c = client(&proxy, "checkout-web").await;
        held.push(sleep(&c, "/*service:service_payment*/ SELECT pg_sleep(5)"));
        holders.push(c);
    }
    eventually(
        Duration::from_secs(10),
        "the pool held by 20 sleepers",
        || {
            let cluster = &cluster;
            async move { sleeping(cluster).await == 20 }
        },
    )
    .await;
    // Now service_payment waits up to its queue_timeout_ms (200) for a backend, then is
    // refused.
    let (took, err) = timed(&payment, "/*service:service_payment*/ SELECT 1").await;
    let (state, message) = err.unwrap_or_else(|| {
        panic!("payment is refused once its 200 ms are up; it ran after {took:?}")
    });
    assert_eq!(state, "53300", "{message}");
    assert!(message.contains("ERR_QUEUE_TIMEOUT"), "{message}");
    assert!(
        took >= Duration::from_millis(180) && took < Duration::from_millis(1500),
        "payment waited its 200 ms, not the pool's 2 s: {took:?}"
    );
    for t in held {
        let (_, err) = within(STEP, "a holder", t).await.expect("task");
        assert!(err.is_none(), "{err:?}");
    }
    // With room it runs, identified by its tag (and the login user's pool is not the limit).
    let (_, err) = timed(&payment, "/*service:service_payment*/ SELECT 1").await;
    assert!(err.is_none(), "{err:?}");
    let (status, body) = proxy
        .admin_request("GET", "/v1/callers", ADMIN_READ_TOKEN, None)
        .await;
    assert_eq!(status, 200, "{body}");
    let callers: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let list = callers
        .get("callers")
        .and_then(|c| c.as_array())
        .or_else(|| callers.as_array())
        .cloned()
        .unwrap_or_default();
    let of = |name: &str| {
        list.iter()
            .find(|c| c["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("caller {name} in {body}"))
    };
    assert!(
        of("service_payment")["admitted"].as_u64() >= Some(1),
        "{body}"
    );
    assert!(
        of("service_analytics")["admitted"].as_u64() >= Some(5),
        "{body}"
    );
    proxy.assert_healthy().await;
}

fn check_config(file: &Path, backend: Option<&str>) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgsluice"));
    cmd.arg("check-config").arg(file);
    if let Some(b) = backend {
        cmd.args(["--backend", b]);
    }
    let out = run_with_timeout(cmd, Duration::from_secs(30));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn check_config_explains_the_article_yaml_and_inert_settings() {
    let file = article_yaml();
    let (ok, text) = check_config(&file, None);
    assert!(ok, "{text}");
    assert!(
        text.contains("callers[0] (service_payment) has no match: it is matched by its name")
            && text.contains("/*service:service_payment*/")
            && text.contains("callers[1] (service_analytics) has no match"),
        "{text}"
    );
    assert!(
        text.contains("--backend"),
        "says the probe was not checked: {text}"
    );
    if direct_mode() {
        return;
    }
    // Against a database: the built-in probe runs and max_connections is compared.
    let cluster = Cluster::start();
    let url = format!(
        "postgres://{APP_USER}:{APP_PASSWORD}@{}/{APP_DB}",
        cluster.addr()
    );
    let (ok, text) = check_config(&file, Some(&url));
    assert!(ok, "{text}");
    assert!(
        text.contains("the built-in database-load probe runs"),
        "{text}"
    );
    assert!(text.contains("max_connections="), "{text}");

    // A probe that cannot run is an error, not a breaker that never opens.
    let dir = tempfile::tempdir().expect("temp dir");
    let bad = dir.path().join("bad-probe.yaml");
    std::fs::write(
        &bad,
        "global_defaults:\n  circuit_breaker:\n    db_cpu_threshold_percent: 85\n    \
         probe_sql: \"SELECT cpu FROM no_such_table\"\n",
    )
    .expect("write");
    let (ok, text) = check_config(&bad, Some(&url));
    assert!(!ok, "{text}");
    assert!(
        text.contains("probe_sql fails") && text.contains("no_such_table"),
        "{text}"
    );

    // Inert settings are named, with the reason.
    let inert = dir.path().join("inert.yaml");
    std::fs::write(
        &inert,
        "pool:\n  mode: session\n  session_state: pin\n\
         callers:\n  - { name: etl, burst: 10, match: { application_name: etl } }\n\
         global_defaults:\n  circuit_breaker:\n    probe_sql: \"SELECT 1\"\n",
    )
    .expect("write");
    let (ok, text) = check_config(&inert, None);
    assert!(ok, "{text}");
    for key in [
        "pool.session_state has no effect",
        "callers[0].burst has no effect: it needs max_qps",
        "probe_sql has no effect",
    ] {
        assert!(text.contains(key), "{key}: {text}");
    }
}
