//! Issue 16, item 8: `pool.min_idle` and `pools[].min_idle` keep warm backend connections.
//!
//! Watched from Postgres itself (`pg_stat_activity`, on a superuser connection to another
//! database): the pools the config names are warm before any client connects, with exactly
//! their `min_idle` backends; those backends stay the same — same pids — for seconds (no
//! close-and-reopen each upkeep round); the first client runs on one of them without a new
//! connection being opened (`connects` in `/v1/pools`). A pool that exists only from a
//! client's first login is topped up to `min_idle` as well, and kept there.
//!
//! With `PGSLUICE_TEST_DIRECT=1` this test is skipped: it is about the proxy's pool.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::Value;

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster, Monitor};
use crate::support::proxy::{ADMIN_READ_TOKEN, Proxy, ProxyOptions};
use crate::support::sql::{STEP, scalar};
use crate::support::{direct_mode, note_skipped, within};

/// A database with a `pools[]` override, and one the config does not name.
const OVERRIDDEN_DB: &str = "warmdb";
const UNNAMED_DB: &str = "lazydb";

/// The pids of the client backends of `db` as `app`.
async fn pids(monitor: &Monitor, db: &str) -> BTreeSet<i32> {
    let rows = within(
        STEP,
        "pg_stat_activity pids",
        monitor.client().query(
            "SELECT pid FROM pg_stat_activity \
             WHERE datname = $1 AND usename = $2 AND backend_type = 'client backend'",
            &[&db, &APP_USER],
        ),
    )
    .await
    .expect("list backends");
    rows.iter().map(|r| r.get(0)).collect()
}

/// Waits until `db` has exactly `n` backends (the same ones 300 ms apart), then checks every
/// 100 ms for `hold` that the same ones stay; returns them.
async fn stable_pids(monitor: &Monitor, db: &str, n: usize, hold: Duration) -> BTreeSet<i32> {
    stable_pids_in(monitor, db, n..=n, hold).await
}

/// [`stable_pids`] for a number of backends in `range`.
async fn stable_pids_in(
    monitor: &Monitor,
    db: &str,
    range: std::ops::RangeInclusive<usize>,
    hold: Duration,
) -> BTreeSet<i32> {
    let deadline = std::time::Instant::now() + STEP;
    let seen = loop {
        let seen = pids(monitor, db).await;
        // Settled: the same set twice, 300 ms apart (an upkeep round opens one at a time).
        if range.contains(&seen.len()) {
            tokio::time::sleep(Duration::from_millis(300)).await;
            if pids(monitor, db).await == seen {
                break seen;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not {range:?} warm backends on {db} within {STEP:?}: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let until = std::time::Instant::now() + hold;
    while std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = pids(monitor, db).await;
        assert_eq!(now, seen, "the warm backends of {db} changed");
    }
    seen
}

/// `connects` of pool `name` in `/v1/pools`.
async fn connects(proxy: &Proxy, name: &str) -> u64 {
    let (status, body) = proxy
        .admin_request("GET", "/v1/pools", ADMIN_READ_TOKEN, None)
        .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("pools JSON");
    v["pools"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["name"] == name))
        .and_then(|p| p["connects"].as_u64())
        .unwrap_or_else(|| panic!("no pool {name} in {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_idle_connections_open_at_start_stay_open_and_are_reused() {
    if direct_mode() {
        note_skipped("the min_idle test (it needs the proxy)");
        return;
    }
    let dir = tempfile::tempdir().expect("config dir");
    let config = dir.path().join("pgsluice.yaml");
    std::fs::write(
        &config,
        format!(
            "pool:\n  min_idle: 2\npools:\n  - database: {OVERRIDDEN_DB}\n    user: {APP_USER}\n    min_idle: 3\n"
        ),
    )
    .expect("write config");
    let cluster = Cluster::start();
    for db in [OVERRIDDEN_DB, UNNAMED_DB] {
        cluster.psql(&format!("CREATE DATABASE {db} OWNER {APP_USER}"));
    }
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(5).config_file(&config));
    let monitor = cluster.monitor().await;

    // Before any client: backend.url's pool has pool.min_idle, the override its own.
    let hold = Duration::from_secs(3);
    let warm = stable_pids(&monitor, APP_DB, 2, hold).await;
    let overridden = stable_pids(&monitor, OVERRIDDEN_DB, 3, Duration::ZERO).await;
    assert!(pids(&monitor, UNNAMED_DB).await.is_empty());
    let name = format!("{APP_DB}/{APP_USER}");
    assert_eq!(
        connects(&proxy, &name).await,
        2,
        "opened once, not reopened"
    );

    // The first client runs on one of them; nothing new is opened.
    let client = proxy.client().await;
    let pid: i32 = scalar(&client, "SELECT pg_backend_pid()")
        .await
        .parse()
        .expect("pid");
    assert!(warm.contains(&pid), "client got {pid}, warm were {warm:?}");
    drop(client);
    assert_eq!(stable_pids(&monitor, APP_DB, 2, hold).await, warm);
    assert_eq!(connects(&proxy, &name).await, 2);
    assert_eq!(
        stable_pids(&monitor, OVERRIDDEN_DB, 3, Duration::ZERO).await,
        overridden
    );

    // A pool made at a client's first login: topped up to 2 idle and kept. When the
    // once-a-second upkeep runs while the client still holds its backend, 2 others open
    // (`min_idle` counts idle connections), so 2 or 3 — but stable, and opened once each.
    let cfg = proxy.config(APP_USER, APP_PASSWORD, UNNAMED_DB);
    let (lazy, _task) = proxy.client_with(&cfg).await;
    scalar(&lazy, "SELECT 1").await;
    drop(lazy);
    let kept = stable_pids_in(&monitor, UNNAMED_DB, 2..=3, hold).await;
    assert_eq!(
        connects(&proxy, &format!("{UNNAMED_DB}/{APP_USER}")).await,
        kept.len() as u64
    );
}
