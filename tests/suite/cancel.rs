//! Query cancellation: a CancelRequest ends the running query of the client that owns the key,
//! and never another client's — not from an idle client whose last backend now runs someone
//! else's query, not with a key that went stale.
//!
//! * `requests` — CancelRequests written byte by byte: wrong keys, storms, protocol 3.2's long
//!   keys, a hung cancel path (TESTS.md C5, C6, E4).
//! * `peers` — several instances: a cancel that lands on the wrong one reaches the owner
//!   (TESTS.md G3).
//!
//! A cancel over Unix-domain sockets is in `connections`, one through another fleet member in
//! `fleet`, the per-address share of cancel slots in `limits`, and cancels and the breaker in
//! `breaker`.

mod peers;
mod requests;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_postgres::NoTls;
use tokio_postgres::error::SqlState;

use crate::support::pg::Cluster;
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::sql::{STEP, eventually, scalar, send_cancel, simple_values, sqlstate};
use crate::support::within;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_running_query() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let client = Arc::new(proxy.client().await);
    let token = client.cancel_token();

    let running = {
        let client = Arc::clone(&client);
        tokio::spawn(async move {
            let result = client.simple_query("SELECT pg_sleep(10)").await;
            (result, Instant::now())
        })
    };
    let monitor = cluster.monitor().await;
    eventually(STEP, "pg_sleep(10) to show up as active", || async {
        !monitor.active_queries_like("pg_sleep(10)").await.is_empty()
    })
    .await;
    let cancelled_at = Instant::now();
    within(STEP, "CancelRequest", token.cancel_query(NoTls))
        .await
        .expect("send cancel");
    let (result, ended_at) = within(
        Duration::from_secs(5),
        "the cancelled query to end",
        running,
    )
    .await
    .expect("task");
    let err = result.expect_err("a cancelled pg_sleep(10) must fail");
    assert_eq!(
        sqlstate(&err),
        SqlState::QUERY_CANCELED.code(),
        "cancel gives 57014: {err:?}"
    );
    let took = ended_at.duration_since(cancelled_at);
    assert!(
        took < Duration::from_secs(2),
        "the query ended {took:?} after the cancel"
    );

    // The client carries on.
    assert_eq!(
        scalar(&client, "SELECT 'after cancel'").await,
        "after cancel"
    );
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_from_an_idle_client_never_hits_another_client() {
    let cluster = Cluster::start();
    // One backend: whatever backend the idle client last used is the one the busy client runs
    // on, so a cancel key mapped to "the last backend" would hit the wrong query.
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(1));
    let idle = proxy.client().await;
    assert_eq!(scalar(&idle, "SELECT 1").await, "1");
    let busy = Arc::new(proxy.client().await);

    let running = {
        let busy = Arc::clone(&busy);
        tokio::spawn(async move { busy.simple_query("SELECT pg_sleep(1.5), 'finished'").await })
    };
    let monitor = cluster.monitor().await;
    eventually(STEP, "the busy client's pg_sleep to be active", || async {
        !monitor
            .active_queries_like("pg_sleep(1.5)")
            .await
            .is_empty()
    })
    .await;
    for _ in 0..3 {
        send_cancel(&idle).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let result = within(STEP, "the busy client's query", running)
        .await
        .expect("task");
    let messages = result
        .unwrap_or_else(|e| panic!("an idle client's cancel hit another client's query: {e:?}"));
    assert_eq!(simple_values(&messages).len(), 1);

    // A cancel after the query finished is a no-op too (a stale key must not linger).
    within(
        STEP,
        "late CancelRequest",
        busy.cancel_token().cancel_query(NoTls),
    )
    .await
    .expect("send cancel");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let messages = within(
        STEP,
        "a query after a stale cancel",
        busy.simple_query("SELECT pg_sleep(0.3), 1"),
    )
    .await
    .unwrap_or_else(|e| panic!("a cancel sent while idle hit a later query: {e:?}"));
    assert_eq!(simple_values(&messages).len(), 1);
    assert_eq!(scalar(&idle, "SELECT 2").await, "2");
    proxy.assert_healthy().await;
}
