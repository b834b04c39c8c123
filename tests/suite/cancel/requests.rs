//! CancelRequests written byte by byte (`crate::support::raw`).
//!
//! * TESTS.md C5 — cancel isolation: a wrong secret, a fabricated pid and an oversized key are
//!   silent no-ops; 100 concurrent cancels with the right key end only that client's query; a
//!   stale key (its client idle, then gone) never reaches another client's query.
//! * C6 — protocol 3.2 (no negotiation, 32-byte keys, a long-key cancel), grease (3.9999 with
//!   a `_pq_` option is negotiated down to 3.2) and 3.0 with a `_pq_` option.
//! * E4 — a storm of 1 000 cancel requests keeps the admin API and other clients responsive,
//!   and a cancel path that accepts but never answers blocks nobody.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::support::faults::{Fault, FaultProxy};
use crate::support::pg::{APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::raw::{
    Raw, admin_get, field, first_error, first_value, key_data, oracle, query, send_cancel,
};
use crate::support::sql::scalar;
use crate::support::within;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c5_cancel_isolation_wrong_keys_and_storm() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let addr = proxy.addr();
    let mut a = Raw::tcp(addr).await;
    let login = a
        .login(0, APP_USER, APP_PASSWORD, &[])
        .await
        .expect("login");
    let (pid, key) = key_data(&login);
    assert_eq!(key.len(), 4, "3.0 keys are 4 bytes");
    // B works on the same pool meanwhile.
    let b = proxy.client().await;
    let b_loop = tokio::spawn(async move {
        for i in 0..40 {
            let v = b
                .simple_query(&format!("SELECT {i}, pg_sleep(0.05)"))
                .await
                .map_err(|e| format!("B failed: {e:?}"))?;
            drop(v);
        }
        Ok::<_, String>(b)
    });
    a.send(&query("SELECT pg_sleep(4)")).await.expect("sleep");
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Wrong secret and fabricated pid: silent no-ops.
    let mut wrong = key.clone();
    wrong[0] ^= 0xff;
    send_cancel(addr, pid, &wrong).await;
    send_cancel(addr, pid.wrapping_add(7919), &key).await;
    send_cancel(addr, pid, &[0u8; 32]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // 100 concurrent cancels with the right key: only A's query is cancelled.
    let t = Instant::now();
    let storm: Vec<_> = (0..100)
        .map(|_| {
            let key = key.clone();
            tokio::spawn(async move { send_cancel(addr, pid, &key).await })
        })
        .collect();
    for s in storm {
        s.await.expect("cancel task");
    }
    let msgs = a.until_ready().await.expect("A's reply");
    let (_, body) = msgs.iter().find(|m| m.0 == b'E').expect("A was cancelled");
    assert_eq!(field(body, b'C'), "57014");
    assert!(
        field(body, b'M').contains("user request"),
        "{:?}",
        field(body, b'M')
    );
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "the cancel did not cut the sleep short"
    );
    let b = b_loop
        .await
        .expect("B task")
        .expect("B unaffected by the cancels");
    // A stale key (A idle now, then A gone) never reaches B's query on the shared servers.
    let b_sleep = tokio::spawn(async move {
        let r = b.simple_query("SELECT pg_sleep(0.8)").await.map(|_| ());
        (b, r)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    send_cancel(addr, pid, &key).await;
    drop(a);
    tokio::time::sleep(Duration::from_millis(100)).await;
    send_cancel(addr, pid, &key).await;
    let (b, r) = b_sleep.await.expect("B task");
    r.expect("B's query must not be cancelled by A's stale key");
    assert_eq!(scalar(&b, "SELECT 1").await, "1");
    oracle(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c6_protocol_32_grease_and_long_key_cancel() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    // 3.2: no negotiation, a 32-byte key.
    let mut c = Raw::tcp(proxy.addr()).await;
    let msgs = c
        .login(2, APP_USER, APP_PASSWORD, &[])
        .await
        .expect("3.2 login");
    assert!(
        !msgs.iter().any(|m| m.0 == b'v'),
        "3.2 needs no negotiation"
    );
    let (pid, key) = key_data(&msgs);
    assert_eq!(key.len(), 32);
    // Long-key cancel works.
    c.send(&query("SELECT pg_sleep(5)")).await.expect("sleep");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    send_cancel(proxy.addr(), pid, &key).await;
    let msgs = c.until_ready().await.expect("reply");
    assert_eq!(first_error(&msgs).as_deref(), Some("57014"));
    assert!(t.elapsed() < Duration::from_secs(3));
    // 3.9999 with a _pq_ option: NegotiateProtocolVersion(3.2, [_pq_.foo]) and a login.
    let mut g = Raw::tcp(proxy.addr()).await;
    let msgs = g
        .login(9999, APP_USER, APP_PASSWORD, &[("_pq_.foo", "1")])
        .await
        .expect("grease login");
    let (_, v) = msgs
        .iter()
        .find(|m| m.0 == b'v')
        .expect("NegotiateProtocolVersion");
    assert_eq!(&v[..4], &2u32.to_be_bytes(), "newest minor supported: 2");
    assert_eq!(&v[4..8], &1u32.to_be_bytes(), "one unsupported option");
    assert_eq!(&v[8..], b"_pq_.foo\0");
    assert_eq!(key_data(&msgs).1.len(), 32);
    assert_eq!(
        first_value(&g.query("SELECT 5").await.expect("q")).as_deref(),
        Some("5")
    );
    // 3.0 with a _pq_ option: negotiation to 3.0, 4-byte key.
    let mut o = Raw::tcp(proxy.addr()).await;
    let msgs = o
        .login(0, APP_USER, APP_PASSWORD, &[("_pq_.bar", "x")])
        .await
        .expect("3.0 + _pq_ login");
    let (_, v) = msgs
        .iter()
        .find(|m| m.0 == b'v')
        .expect("NegotiateProtocolVersion");
    assert_eq!(&v[..4], &0u32.to_be_bytes());
    assert_eq!(key_data(&msgs).1.len(), 4);
    // A 256-byte key and a 300-byte key: no-op and refused, never a crash.
    send_cancel(proxy.addr(), pid, &[7u8; 256]).await;
    send_cancel(proxy.addr(), pid, &[7u8; 300]).await;
    oracle(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e4_cancel_storm_and_hung_cancel_path() {
    let cluster = Cluster::start();
    let fault = FaultProxy::start(cluster.addr()).await;
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(3).backend_via(fault.addr()));
    let addr = proxy.addr();
    let mut a = Raw::tcp(addr).await;
    let login = a.login(0, "app", "secret", &[]).await.expect("login");
    let (pid, key) = crate::support::raw::key_data(&login);
    // 1 000 cancel requests, 50 in flight at a time, mostly bogus, a few valid for an idle
    // client; the admin API and other clients stay responsive.
    let t = Instant::now();
    let sent = Arc::new(AtomicUsize::new(0));
    let storm: Vec<_> = (0..50)
        .map(|w| {
            let (key, sent) = (key.clone(), sent.clone());
            tokio::spawn(async move {
                for i in 0..20 {
                    if (w + i) % 10 == 0 {
                        send_cancel(addr, pid, &key).await;
                    } else {
                        send_cancel(addr, w * 1000 + i, &[1, 2, 3, 4]).await;
                    }
                    sent.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let other = proxy.client().await;
    while sent.load(Ordering::Relaxed) < 500 {
        let t0 = Instant::now();
        admin_get(&proxy, "/v1/pools").await;
        assert_eq!(scalar(&other, "SELECT 1").await, "1");
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "proxy unresponsive in the storm"
        );
    }
    for s in storm {
        within(Duration::from_secs(60), "cancel storm", s)
            .await
            .expect("storm task");
    }
    eprintln!("1000 cancels in {:?}", t.elapsed());
    // `other` holds a backend in a transaction meanwhile, so the pool has two open: after the
    // hung cancel below, `a`'s session keeps its backend until that cancel gives up (a late
    // cancel must not reach the next borrower), and `other` must then find the second one
    // idle rather than need a new connection through the hung path.
    other.batch_execute("BEGIN").await.expect("BEGIN");
    assert_eq!(scalar(&other, "SELECT 2").await, "2");
    let msgs = a.query("SELECT 3").await.expect("idle client unaffected");
    assert_eq!(first_value(&msgs).as_deref(), Some("3"));
    other.batch_execute("COMMIT").await.expect("COMMIT");
    // A cancel path that accepts but never answers: the client's cancel times out without
    // blocking anyone else, and the query still finishes.
    fault.set(Fault::HangNew);
    a.send(&query("SELECT pg_sleep(1), 4"))
        .await
        .expect("sleep");
    tokio::time::sleep(Duration::from_millis(200)).await;
    send_cancel(addr, pid, &key).await;
    let msgs = a.until_ready().await.expect("the query finishes");
    assert!(msgs.iter().any(|m| m.0 == b'D' || m.0 == b'E'));
    assert_eq!(scalar(&other, "SELECT 5").await, "5");
    fault.set(Fault::Pass);
    drop((a, other));
    oracle(&proxy).await;
}
