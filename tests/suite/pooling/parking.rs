//! Backends parked with idle clients (`src/pool/park.rs`): in transaction mode a client
//! between transactions keeps its clean backend while nobody else needs it, from its second
//! transaction on (a login that runs one transaction and leaves hands its backend straight
//! back). Each test shows that the pool still has it back whenever it matters, against a
//! real PostgreSQL:
//!
//! * a client that has to wait for a full pool gets a parked backend at once, well inside a
//!   checkout timeout shorter than the pool's upkeep tick (which also takes parked backends
//!   back), and the client that parked it then gets one back the same way;
//! * a parked backend killed on the server meanwhile is replaced without the client seeing an
//!   error;
//! * a pause takes parked backends back at once (it reports them drained) and their clients'
//!   next statements wait for the resume like everyone else's.
//!
//! With `PGSLUICE_TEST_DIRECT=1` these tests are skipped: they are about the pool.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::Client;

use super::settings::{pid, pool_stats, proxy, skip_direct, spawn_query};
use crate::support::pg::{APP_DB, APP_USER, Cluster};
use crate::support::proxy::Proxy;
use crate::support::sql::{STEP, eventually};
use crate::support::within;

/// A checkout waits at most 400 ms: less than the upkeep's second, so a waiter served only
/// by the upkeep's revocation would time out most of the time.
const YAML: &str = "\
admin:
  write_token: park-write
pool:
  checkout_timeout_ms: 400
";

/// Waits until the pool reports `n` parked backends.
async fn parked(proxy: &Proxy, n: u64) {
    eventually(STEP, &format!("{n} parked backends"), || async {
        pool_stats(proxy).await["parked"].as_u64() == Some(n)
    })
    .await;
}

/// Two clients that each ran a query at the same time twice, so the pool opened two
/// backends. The first time both went back idle (a client parks from its second
/// transaction, so a login that runs one and leaves never keeps one). The second time the
/// first to finish put its backend back idle and the other parked its own (a client parks
/// only while an idle connection is left for the next one). Returns the clients and their
/// backend pids.
async fn one_parked(proxy: &Proxy) -> ([Arc<Client>; 2], [i32; 2]) {
    let clients = [
        Arc::new(proxy.client().await),
        Arc::new(proxy.client().await),
    ];
    let first = both_at_once(&clients).await;
    assert_ne!(first[0], first[1], "two backends at once");
    // Both backends are back in the pool within moments, neither kept by its client. (The
    // upkeep takes parked backends back only every second, so a first transaction that did
    // park would be seen here as parked.)
    eventually(STEP, "both first transactions' backends back", || async {
        let stats = pool_stats(proxy).await;
        stats["idle"].as_u64().unwrap_or(0) + stats["parked"].as_u64().unwrap_or(0) == 2
    })
    .await;
    let stats = pool_stats(proxy).await;
    assert_eq!(stats["parked"], 0, "a first transaction parked: {stats}");
    let pids = both_at_once(&clients).await;
    assert_ne!(pids[0], pids[1], "two backends at once");
    parked(proxy, 1).await;
    let stats = pool_stats(proxy).await;
    assert_eq!(
        (stats["idle"].as_u64(), stats["open"].as_u64()),
        (Some(1), Some(2)),
        "{stats}"
    );
    (clients, pids)
}

/// Runs a 0.3 s query on both clients at once; returns their backends' pids.
async fn both_at_once(clients: &[Arc<Client>; 2]) -> [i32; 2] {
    let sql = "SELECT pg_backend_pid() FROM pg_sleep(0.3)";
    let runs = [spawn_query(&clients[0], sql), spawn_query(&clients[1], sql)];
    let mut pids = [0; 2];
    for (p, run) in pids.iter_mut().zip(runs) {
        let (_, r) = within(STEP, sql, run).await.expect("join");
        let v = r.expect("a query on its own backend");
        *p = v[0].as_deref().expect("a pid").parse().expect("pid");
    }
    pids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_backend_goes_to_a_waiting_client_at_once_and_comes_back() {
    if skip_direct() {
        return;
    }
    let cluster = Cluster::start();
    let (proxy, _cfg) = proxy(&cluster, 2, YAML, None);
    let (clients, pids) = one_parked(&proxy).await;

    // A third client holds the idle backend in a transaction: the pool is full.
    let holder = proxy.client().await;
    holder.batch_execute("BEGIN").await.expect("BEGIN");
    let held = pid(&holder).await;
    assert!(pids.contains(&held), "the idle backend: {held} of {pids:?}");
    let parked_pid = if pids[0] == held { pids[1] } else { pids[0] };
    // A fourth must wait: the parked backend is taken back for it, well inside 400 ms.
    let waiter = proxy.client().await;
    assert_eq!(
        pid(&waiter).await,
        parked_pid,
        "the parked backend, handed over"
    );
    // And its client gets one back the same way once the fourth is done with it.
    for c in &clients {
        assert_eq!(pid(c).await, parked_pid);
    }
    holder.batch_execute("COMMIT").await.expect("COMMIT");
    let stats = pool_stats(&proxy).await;
    assert_eq!(stats["checkout_timeouts"], 0, "{stats}");
    assert_eq!(stats["open"], 2, "{stats}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_backend_killed_meanwhile_is_replaced_without_an_error() {
    if skip_direct() {
        return;
    }
    let cluster = Cluster::start();
    let (proxy, _cfg) = proxy(&cluster, 3, YAML, None);
    let monitor = cluster.superuser_client(APP_DB).await;
    let (clients, pids) = one_parked(&proxy).await;
    for p in pids {
        let killed: bool = monitor
            .query_one("SELECT pg_terminate_backend($1)", &[&p])
            .await
            .expect("pg_terminate_backend")
            .get(0);
        assert!(killed);
    }
    eventually(STEP, "the killed backends gone", || async {
        // Both may still be there: `query`, not `query_opt` (which fails on two rows).
        monitor
            .query(
                "SELECT 1 FROM pg_stat_activity WHERE pid = ANY($1)",
                &[&pids.to_vec()],
            )
            .await
            .expect("pg_stat_activity")
            .is_empty()
    })
    .await;
    // Give the proxy's event loop a moment to see the closed sockets (it reads none of them).
    tokio::time::sleep(Duration::from_millis(100)).await;
    for c in &clients {
        let after = pid(c).await;
        assert!(
            !pids.contains(&after),
            "a new backend ({after}), and no error"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_takes_parked_backends_back_and_holds_their_clients() {
    if skip_direct() {
        return;
    }
    let cluster = Cluster::start();
    let (proxy, _cfg) = proxy(&cluster, 3, YAML, None);
    let (clients, _) = one_parked(&proxy).await;

    let pool = format!("/v1/pools/{APP_DB}/{APP_USER}");
    let (status, body) = proxy
        .admin_request(
            "POST",
            &format!("{pool}/pause"),
            "park-write",
            Some(r#"{"hold_ms": 20000, "wait_ms": 5000}"#),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(
        (v["drained"].as_bool(), v["in_use"].as_u64()),
        (Some(true), Some(0)),
        "{v}"
    );
    assert_eq!(pool_stats(&proxy).await["parked"], 0);

    // Both clients' next statements wait for the resume, the one that had parked too.
    let qs = [
        spawn_query(&clients[0], "SELECT 1"),
        spawn_query(&clients[1], "SELECT 1"),
    ];
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(
        qs.iter().all(|q| !q.is_finished()),
        "a statement ran while the pool was paused"
    );
    let (status, body) = proxy
        .admin_request("POST", &format!("{pool}/resume"), "park-write", None)
        .await;
    assert_eq!(status, 200, "{body}");
    for q in qs {
        let (_, r) = within(STEP, "a held statement", q).await.expect("join");
        assert_eq!(r.expect("runs after the resume"), [Some("1".to_owned())]);
    }
}
