//! Transaction pooling of backend connections: 200 clients share a pool of ten (on a
//! work-stealing runtime of two threads), pgbench in simple and extended mode runs without a
//! failure, and `pool.max_db_connections` holds across two users under load — each time with
//! the backends sampled from `pg_stat_activity`, never more than the pool allows.
//!
//! * `settings` — the `pool` settings of docs/OPERATIONS.md take effect (issue 16, item 9).
//! * `min_idle` — `pool.min_idle` and `pools[].min_idle` keep warm backend connections
//!   (issue 16, item 8).
//! * `parking` — a backend parked with an idle client comes back when another client needs
//!   it, when it died meanwhile, and when the pool is paused.
//!
//! Priority-ordered checkout is in `admission`, the critical reserve in `overload`, session
//! mode in `session_mode`, and the session state pooling must not leak in `session_state`.

mod min_idle;
mod parking;
mod settings;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future;
use tokio_postgres::types::Type;

use crate::support::env::Env;
use crate::support::pg::{APP_DB, Cluster};
use crate::support::proxy::{ADMIN_READ_TOKEN, Proxy, ProxyOptions};
use crate::support::sql::{BackendSampler, STEP, assert_pool_bound, simple_values};
use crate::support::{direct_mode, note_skipped, pgbench, within};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_clients_share_a_pool_of_ten() {
    let cluster = Cluster::start();
    // A work-stealing runtime of 2 threads: the other tests run the default, which is one
    // thread on machines with at most 2 CPUs (the CI machines), so this one covers sessions
    // and pools shared across threads.
    let options = ProxyOptions::pool(10).arg("--worker-threads").arg("2");
    let proxy = Arc::new(Proxy::start(&cluster, options));
    if !proxy.is_direct() {
        let threads = proxy_threads(&proxy);
        assert!(
            threads >= 3,
            "--worker-threads 2 should run a main thread and 2 workers, found {threads} threads"
        );
    }
    let sampler = BackendSampler::start(&cluster).await;

    let clients = (0..200i32).map(|i| {
        let proxy = Arc::clone(&proxy);
        tokio::spawn(async move {
            let mut client = proxy.client().await;
            let one = client
                .simple_query("SELECT 1")
                .await
                .map_err(|e| format!("client {i} SELECT 1: {e:?}"))?;
            if simple_values(&one) != vec![Some("1".to_string())] {
                return Err(format!("client {i}: SELECT 1 returned {one:?}"));
            }
            let rows = client
                .query_typed("SELECT $1::int * 2", &[(&i, Type::INT4)])
                .await
                .map_err(|e| format!("client {i} extended: {e:?}"))?;
            if rows[0].get::<_, i32>(0) != i * 2 {
                return Err(format!("client {i} got another client's answer"));
            }
            client
                .simple_query("SELECT pg_sleep(0.05)")
                .await
                .map_err(|e| format!("client {i} sleep: {e:?}"))?;
            let tx = client
                .transaction()
                .await
                .map_err(|e| format!("client {i} BEGIN: {e:?}"))?;
            let rows = tx
                .query_typed("SELECT $1::text", &[(&format!("client {i}"), Type::TEXT)])
                .await
                .map_err(|e| format!("client {i} in tx: {e:?}"))?;
            tx.commit()
                .await
                .map_err(|e| format!("client {i} COMMIT: {e:?}"))?;
            let text: String = rows[0].get(0);
            if text != format!("client {i}") {
                return Err(format!("client {i} got {text:?}"));
            }
            Ok::<(), String>(())
        })
    });
    let results = within(
        Duration::from_secs(120),
        "200 concurrent clients",
        future::join_all(clients),
    )
    .await;
    let failures: Vec<String> = results
        .into_iter()
        .filter_map(|r| match r {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(e) => Some(format!("client task panicked: {e:?}")),
        })
        .collect();
    let (max, samples) = sampler.finish().await;
    assert!(
        failures.is_empty(),
        "{} of 200 clients failed, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert_pool_bound(&proxy, max, samples);
    proxy.assert_healthy().await;
}

/// Threads of the proxy process, from /proc.
fn proxy_threads(proxy: &Proxy) -> usize {
    let pid = proxy.pid().expect("a proxy process");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("a Threads: line")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbench_simple_and_extended_have_no_failures() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(10));

    pgbench::init(&proxy, 1).await;
    let check = cluster.psql_on(APP_DB, "SELECT count(*) FROM pgbench_accounts");
    assert_eq!(
        check.trim(),
        "100000",
        "pgbench -i -s 1 loads 100 000 accounts"
    );

    let sampler = BackendSampler::start(&cluster).await;
    let mut tps = HashMap::new();
    for mode in ["simple", "extended"] {
        let report = pgbench::run_ok(
            &proxy,
            &["-S", "-c", "16", "-j", "2", "-T", "5", "-M", mode, "-n"],
        )
        .await;
        tps.insert(mode, report.tps);
    }
    let (max, samples) = sampler.finish().await;
    eprintln!("pgbench -S -c 16 through the proxy: {tps:?}");
    assert_pool_bound(&proxy, max, samples);
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
