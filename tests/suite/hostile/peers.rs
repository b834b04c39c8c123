//! Item 12: per-source-address limits. One address holding connections in their startup
//! takes only its own share of the handshake slots (`limits.max_handshakes_per_address`), so
//! other addresses still log in; and forged CancelRequests to a slow peer take only the
//! sender's share of the cancel slots (`limits.max_cancels_per_address`), the rest dropped and
//! counted. Other addresses are real ones: Linux routes all of 127/8 to the loopback
//! interface, so a client socket bound to 127.0.0.2 reaches the proxy on 127.0.0.1.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio_postgres::NoTls;
use tokio_postgres::error::SqlState;

use super::common;
use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER};
use crate::support::proxy::{ADMIN_READ_TOKEN, Proxy};
use crate::support::sql::{eventually, scalar};
use crate::support::{direct_mode, note_skipped, within};

const OTHER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// A TCP connection to `addr` from the local address `from`.
async fn connect_from(from: Ipv4Addr, addr: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::new(IpAddr::V4(from), 0))
        .unwrap_or_else(|e| panic!("bind {from}: {e}"));
    within(Duration::from_secs(10), "connect", socket.connect(addr))
        .await
        .unwrap_or_else(|e| panic!("connect from {from} to {addr}: {e}"))
}

/// The value of the Prometheus series `series` (with labels, if any) on the proxy's /metrics.
async fn metric(proxy: &Proxy, series: &str) -> Option<f64> {
    let (_, text) = proxy
        .admin_request("GET", "/metrics", ADMIN_READ_TOKEN, None)
        .await;
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

/// Logs in as the app user over `stream` and runs `SELECT 1`.
async fn select_one_over(proxy: &Proxy, stream: TcpStream) {
    let (client, connection) = within(
        Duration::from_secs(10),
        "login",
        proxy.app_config().connect_raw(stream, NoTls),
    )
    .await
    .expect("login from another address");
    let task = tokio::spawn(async move {
        let _ = connection.await;
    });
    let row = within(
        Duration::from_secs(10),
        "SELECT 1",
        client.query_one("SELECT 1", &[]),
    )
    .await
    .expect("SELECT 1");
    assert_eq!(row.get::<_, i32>(0), 1);
    drop(client);
    let _ = task.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn item12_one_address_holds_only_its_share_of_handshakes() {
    if direct_mode() {
        note_skipped("per-address handshake limits of pgsluice");
        return;
    }
    let env = common::start(
        2,
        "limits:\n  max_handshakes_per_address: 4\n  handshake_timeout_ms: 30000\n",
        |_| {},
    );
    let proxy = &env.proxy;
    let addr = proxy.addr();
    // Four connections from 127.0.0.1 that start a startup packet and never finish it.
    let mut silent = Vec::new();
    for _ in 0..4 {
        let mut s = connect_from(Ipv4Addr::LOCALHOST, addr).await;
        s.write_all(&[0, 0]).await.expect("a first byte");
        silent.push(s);
    }
    eventually(
        Duration::from_secs(10),
        "4 handshakes in progress",
        || async { metric(proxy, "pgsluice_client_handshakes").await == Some(4.0) },
    )
    .await;

    // A fifth from the same address waits for the share (it holds no handshake slot) ...
    let fifth = tokio::spawn(async move {
        let t = Instant::now();
        let r = tokio_postgres::connect(
            &format!(
                "host={} port={} user={APP_USER} password={APP_PASSWORD} dbname={APP_DB}",
                addr.ip(),
                addr.port()
            ),
            tokio_postgres::NoTls,
        )
        .await;
        (
            r.map(|(c, conn)| {
                tokio::spawn(conn);
                c
            }),
            t.elapsed(),
        )
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!fifth.is_finished(), "the fifth waits, it is not refused");
    assert_eq!(metric(proxy, "pgsluice_client_handshakes").await, Some(4.0));
    // ... and so do 15 more, up to 4 × the share waiting; beyond, refused at once, naming
    // the per-address limit.
    let mut waiting = Vec::new();
    for _ in 0..15 {
        waiting.push(connect_from(Ipv4Addr::LOCALHOST, addr).await);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    let err = match proxy.try_client_with(&proxy.app_config()).await {
        Ok(_) => panic!("a 21st connection from 127.0.0.1 was accepted"),
        Err(e) => e,
    };
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let db = err.as_db_error().unwrap_or_else(|| panic!("{err:?}"));
    assert_eq!(db.code(), &SqlState::TOO_MANY_CONNECTIONS, "{db:?}");
    assert!(db.message().contains("from this address"), "{db:?}");
    assert_eq!(
        db.detail(),
        Some("limits.max_handshakes_per_address=4"),
        "{db:?}"
    );
    assert!(
        db.hint().is_some_and(|h| h.starts_with("retry_after_ms=")),
        "{db:?}"
    );

    // Another address still logs in, while 127.0.0.1's share stays taken.
    select_one_over(proxy, connect_from(OTHER, addr).await).await;
    assert_eq!(metric(proxy, "pgsluice_client_handshakes").await, Some(4.0));

    // The share comes back when the slow clients leave, and the first waiter logs in.
    drop(silent);
    let (client, waited) = within(Duration::from_secs(15), "the fifth client", fifth)
        .await
        .expect("task");
    let client = client.expect("the fifth logs in once the share frees");
    assert!(waited >= Duration::from_millis(500), "{waited:?}");
    assert_eq!(scalar(&client, "SELECT 1").await, "1");
    drop(waiting);
    eventually(Duration::from_secs(10), "the handshakes end", || async {
        metric(proxy, "pgsluice_client_handshakes").await == Some(0.0)
    })
    .await;
    proxy.assert_healthy().await;
}

/// A CancelRequest packet for `pid` with a 4-byte key.
fn cancel_packet(pid: i32) -> Vec<u8> {
    let mut b = Vec::with_capacity(16);
    b.extend_from_slice(&16i32.to_be_bytes());
    b.extend_from_slice(&80_877_102i32.to_be_bytes());
    b.extend_from_slice(&pid.to_be_bytes());
    b.extend_from_slice(&[1, 2, 3, 4]);
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn item12_cancels_beyond_an_address_share_are_dropped() {
    if direct_mode() {
        note_skipped("per-address cancel limits of pgsluice");
        return;
    }
    // Peer 2 accepts forwarded cancels and never answers: each holds a cancel slot until the
    // forwarding timeout, as a dead or slow peer does.
    let slow = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let slow_addr = slow.local_addr().expect("addr");
    let taken = Arc::new(AtomicUsize::new(0));
    let held = {
        let taken = Arc::clone(&taken);
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = slow.accept().await {
                taken.fetch_add(1, Ordering::SeqCst);
                held.push(s);
            }
        })
    };
    let env = common::start(
        2,
        &format!(
            "peer_id: 1\npeers:\n  - {{ id: 2, addr: \"{slow_addr}\" }}\n\
             limits:\n  max_cancels_per_address: 2\n"
        ),
        |_| {},
    );
    let proxy = &env.proxy;
    let addr = proxy.addr();
    // A key that names peer 2 with a full hop budget: forwarded without any check here.
    let forged = ((2u32 << 23) | (3 << 21) | 0x1234) as i32;

    // Five at once from 127.0.0.1: two are forwarded and held, three are dropped.
    let mut senders = Vec::new();
    for _ in 0..5 {
        let mut s = connect_from(Ipv4Addr::LOCALHOST, addr).await;
        s.write_all(&cancel_packet(forged)).await.expect("cancel");
        senders.push(s);
    }
    eventually(Duration::from_secs(5), "three cancels dropped", || async {
        metric(proxy, r#"pgsluice_cancels_total{outcome="address_limit"}"#).await == Some(3.0)
    })
    .await;
    assert_eq!(taken.load(Ordering::SeqCst), 2, "only the address's share");

    // Another address's cancel still reaches the peer meanwhile.
    let mut s = connect_from(OTHER, addr).await;
    s.write_all(&cancel_packet(forged)).await.expect("cancel");
    senders.push(s);
    eventually(
        Duration::from_secs(5),
        "the other address's cancel",
        || async { taken.load(Ordering::SeqCst) == 3 },
    )
    .await;
    assert_eq!(
        metric(proxy, r#"pgsluice_cancels_total{outcome="address_limit"}"#).await,
        Some(3.0)
    );

    // Cancels get no reply: every sender is closed once the proxy is done with it (the held
    // ones at the forwarding timeout), and the share then comes back.
    for mut s in senders {
        let mut sink = [0u8; 16];
        let n = within(Duration::from_secs(10), "cancel closed", s.read(&mut sink)).await;
        assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
    }
    let mut s = connect_from(Ipv4Addr::LOCALHOST, addr).await;
    s.write_all(&cancel_packet(forged)).await.expect("cancel");
    eventually(Duration::from_secs(5), "forwarded again", || async {
        taken.load(Ordering::SeqCst) == 4
    })
    .await;
    held.abort();
    proxy.assert_healthy().await;
}
