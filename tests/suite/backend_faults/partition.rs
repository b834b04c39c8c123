//! TESTS.md D4: a partition of an *established* server connection in the middle of a query.
//!
//! The proxy's backend goes through `crate::support::faults::FaultProxy`; once the query runs, the
//! fault proxy black-holes both directions. Its kernel still acknowledges every segment, so
//! neither keepalive nor TCP_USER_TIMEOUT can fire: what must end the wait is the relay's own
//! escalation — statement timeout, then the backstop's cancel (which vanishes too), then
//! `pool.cancel_grace_ms` of silence — after which the connection is discarded and the client
//! gets 08006. Then the oracle: the proxy is up, a fresh client works, the pool is at rest.
//! `backend.tcp_user_timeout_ms` is set only to exercise the socket option: if setting it
//! failed, no server connection could be made at all.

use std::time::{Duration, Instant};

use crate::support::faults::{Fault, FaultProxy};
use crate::support::pg::Cluster;
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::raw::{Raw, admin_get, oracle, query, write};
use crate::support::sql::eventually;
use crate::support::within;

/// Statement timeout the proxy injects, and the grace it gives the server after its cancel.
const STATEMENT_TIMEOUT_MS: u64 = 1_500;
const CANCEL_GRACE_MS: u64 = 1_000;
/// The relay's backstop fires this long after the statement timeout (src/session/relay).
const BACKSTOP: Duration = Duration::from_secs(1);

/// Open backend connections of the only pool, from the admin API.
async fn open_backends(proxy: &Proxy) -> u64 {
    let v = admin_get(proxy, "/v1/pools").await;
    v["pools"][0]["open"].as_u64().expect("pools[0].open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d4_partition_established_mid_query() {
    let cluster = Cluster::start();
    let fault = FaultProxy::start(cluster.addr()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = write(
        dir.path(),
        "c.yaml",
        &format!(
            "global_defaults:\n  statement_timeout_ms: {STATEMENT_TIMEOUT_MS}\n\
             pool:\n  cancel_grace_ms: {CANCEL_GRACE_MS}\n\
             backend:\n  tcp_user_timeout_ms: 30000\n"
        ),
    );
    let proxy = Proxy::start(
        &cluster,
        ProxyOptions::pool(2)
            .config_file(cfg)
            .backend_via(fault.addr()),
    );
    let mut victim = Raw::tcp(proxy.addr()).await;
    victim.app_login().await;
    // The connection is healthy before the partition.
    let msgs = victim.query("SELECT 1").await.expect("SELECT 1");
    assert!(msgs.iter().any(|m| m.0 == b'D'));
    assert_eq!(open_backends(&proxy).await, 1);

    let t = Instant::now();
    victim
        .send(&query("SELECT pg_sleep(30)"))
        .await
        .expect("send the long query");
    // Partition once Postgres runs it, well before its statement timeout would answer.
    let monitor = cluster.monitor().await;
    eventually(Duration::from_secs(5), "pg_sleep(30) running", || async {
        !monitor.active_queries_like("pg_sleep(30)").await.is_empty()
    })
    .await;
    fault.set(Fault::BlackHole);

    // Postgres' own 57014 is swallowed by the partition, and so is the backstop's cancel: the
    // relay gives up after the grace period. Generous margin for a loaded two-core machine.
    let expected = Duration::from_millis(STATEMENT_TIMEOUT_MS + CANCEL_GRACE_MS) + BACKSTOP;
    let limit = expected + Duration::from_secs(5);
    let err = within(limit, "the partitioned client's error", victim.error())
        .await
        .expect("an ErrorResponse, not a silent close");
    let took = t.elapsed();
    eprintln!("partitioned client got {err:?} after {took:?} (expected about {expected:?})");
    assert_eq!(err.0, "08006", "{err:?}");
    assert!(err.1.contains("stopped answering"), "{err:?}");
    // Not before the statement timeout, the backstop and the grace have all run out (they
    // start when the proxy reads the query, after `t`).
    assert!(
        took + Duration::from_millis(50) >= expected,
        "gave up after {took:?}, before {expected:?}"
    );
    assert!(victim.closes().await, "the victim's session ends");

    // The slot is reclaimed while the partition lasts: the dead connection is closed, not
    // pooled, and nothing is counted active.
    assert_eq!(open_backends(&proxy).await, 0, "{}", proxy.stderr_tail());
    assert!(crate::support::raw::pools_at_rest(&proxy).await);

    fault.set(Fault::Pass);
    oracle(&proxy).await;
}
