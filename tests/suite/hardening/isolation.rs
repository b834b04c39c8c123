//! TESTS.md C5–C7: cancel isolation, protocol 3.2 and grease, mid-stream disconnects.

use std::time::{Duration, Instant};

use crate::support::pg::{APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::raw::{
    Raw, field, first_error, first_value, frame, key_data, oracle, query, send_cancel,
};
use crate::support::sql::{eventually, scalar};

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

/// Starts a large result and resets the connection after some of it arrived.
async fn reset_mid_result(addr: std::net::SocketAddr, extended: bool) {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    socket2::SockRef::from(&tcp)
        .set_linger(Some(Duration::ZERO))
        .expect("linger");
    let mut c = Raw::over(tcp);
    c.app_login().await;
    let sql = "SELECT repeat('x', 1000000) FROM generate_series(1, 20)";
    if extended {
        let mut b = frame(b'P', format!("\0{sql}\0\0\0").as_bytes());
        b.extend(frame(b'B', b"\0\0\0\0\0\0\0\0"));
        b.extend(frame(b'E', b"\0\0\0\0\0"));
        b.extend(frame(b'S', &[]));
        c.send(&b).await.expect("extended");
    } else {
        c.send(&query(sql)).await.expect("query");
    }
    // Read ~200 KB (the middle of the first DataRow), then vanish.
    let mut got = 0;
    while got < 200_000 {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 64 * 1024];
        match tokio::time::timeout(Duration::from_secs(10), c.s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got += n,
            _ => break,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c7_mid_stream_disconnect_never_leaks_residual_bytes() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let addr = proxy.addr();
    let workers: Vec<_> = (0..5)
        .map(|w| {
            tokio::spawn(async move {
                for i in 0..4 {
                    reset_mid_result(addr, (w + i) % 2 == 0).await;
                }
            })
        })
        .collect();
    // B keeps getting exact results while the servers are being abandoned mid-row.
    let mut b = Raw::tcp(addr).await;
    b.app_login().await;
    for i in 0..30 {
        let msgs = b.query(&format!("SELECT {i}")).await.expect("B query");
        assert_eq!(first_value(&msgs), Some(i.to_string()), "{msgs:?}");
        assert_eq!(msgs.iter().filter(|m| m.0 == b'D').count(), 1);
    }
    for w in workers {
        w.await.expect("worker");
    }
    let monitor = cluster.monitor().await;
    eventually(
        Duration::from_secs(10),
        "no abandoned query left running",
        || async { monitor.active_queries_like("repeat('x'").await.is_empty() },
    )
    .await;
    for i in 0..10 {
        let msgs = b
            .query(&format!("SELECT {i} + 100"))
            .await
            .expect("B after");
        assert_eq!(first_value(&msgs), Some((i + 100).to_string()));
    }
    oracle(&proxy).await;
}
