//! The `limits` that keep one client, or one address, from growing the process without bound
//! or holding more than its place (issue 15, items 9–12, and TESTS.md E5):
//!
//! * pools per database name a client asks for (`limits.max_pools`; pools without clients or
//!   connections go);
//! * a message larger than `limits.max_message_bytes` is refused with 54000 before it is
//!   buffered, and the connection stays usable;
//! * named prepared statements per session (`limits.max_client_statements`), and their bytes
//!   per session and per backend (`limits.max_client_statement_bytes`,
//!   `pool.prepared_cache_bytes`);
//! * per source address, a share of the handshake slots (`limits.max_handshakes_per_address`)
//!   and of the cancel slots (`limits.max_cancels_per_address`). Other addresses are real ones:
//!   Linux routes all of 127/8 to the loopback interface, so a client socket bound to 127.0.0.2
//!   reaches the proxy on 127.0.0.1;
//! * `limits.max_client_conn` counts a client for its whole session.
//!
//! `limits.client_idle_timeout_ms` is in `timeouts::idle`, `limits.client_write_timeout_ms`
//! (slow readers) in `overload`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio_postgres::NoTls;
use tokio_postgres::error::SqlState;

use crate::support::isolation::{start, wire};
use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{ADMIN_READ_TOKEN, Proxy, ProxyOptions};
use crate::support::raw::write;
use crate::support::sql::{eventually, scalar, sqlstate};
use crate::support::wire::Backend;
use crate::support::{direct_mode, isolation as common, note_skipped, random_u64, within};

async fn pool_count(proxy: &Proxy) -> usize {
    let (status, body) = proxy
        .admin_request(
            "GET",
            "/v1/pools",
            crate::support::proxy::ADMIN_READ_TOKEN,
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("pools JSON");
    v.as_array()
        .or_else(|| v.get("pools").and_then(|p| p.as_array()))
        .map_or(0, Vec::len)
}

/// Item 9: every database name a client asks for used to get a pool, kept forever. Now
/// pools are bounded by `limits.max_pools`, and pools without clients or connections go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_database_names_do_not_grow_the_pool_map() {
    let env = start(2, "limits: { max_pools: 8 }\n", |_| {});
    let proxy = &env.proxy;
    if proxy.is_direct() {
        note_skipped("pools (direct mode has none)");
        return;
    }
    let good = proxy.client().await;
    let names: Vec<String> = (0..400)
        .map(|_| format!("nodb_{:x}", random_u64()))
        .collect();
    // Four at a time: with the real pool, at most five are in use at once.
    for (i, chunk) in names.chunks(4).enumerate() {
        let attempts: Vec<_> = chunk
            .iter()
            .map(|db| {
                let cfg = proxy.config(APP_USER, APP_PASSWORD, db);
                tokio::spawn(async move { cfg.connect(tokio_postgres::NoTls).await.map(|_| ()) })
            })
            .collect();
        for a in attempts {
            let e = a
                .await
                .expect("task")
                .expect_err("a database that does not exist");
            // Never "too many pools": pools nobody uses make room.
            assert_eq!(sqlstate(&e), "3D000", "{e:?}");
        }
        assert!(
            pool_count(proxy).await <= 8,
            "chunk {i}: pools beyond limits.max_pools"
        );
    }
    // The client that was there all along still works, and idle pools are swept.
    assert_eq!(
        crate::support::sql::scalar(&good, "SELECT 1").await,
        "1",
        "the real pool"
    );
    eventually(Duration::from_secs(10), "unused pools removed", || async {
        pool_count(proxy).await <= 1
    })
    .await;
    proxy.assert_healthy().await;
}

/// Peak resident memory of a process (`VmHWM`), in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

/// Item 10: a Query larger than `limits.max_message_bytes` is refused with 54000 before it
/// is buffered (peak memory does not grow by its size), and the connection stays usable; in
/// a transaction the refusal aborts it, like any error there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_messages_are_refused_without_being_buffered() {
    let env = start(2, "limits: { max_message_bytes: 1048576 }\n", |_| {});
    let proxy = &env.proxy;
    let Some(pid) = proxy.pid() else {
        note_skipped("the proxy's memory (direct mode has none)");
        return;
    };
    let mut c = wire(proxy).await;
    assert_eq!(
        c.simple("SELECT 1").await.expect("warm up"),
        [Some("1".into())]
    );
    let before = peak_rss_kib(pid);
    let huge = format!("SELECT '{}'", "x".repeat(96 << 20));
    for round in 0..2 {
        let e = c.simple(&huge).await.expect_err("an oversized Query");
        assert!(
            e.starts_with("54000") && e.contains("max_message_bytes"),
            "round {round}: {e}"
        );
        assert_eq!(
            c.simple("SELECT 2").await.expect("after"),
            [Some("2".into())]
        );
    }
    let grown = peak_rss_kib(pid).saturating_sub(before);
    assert!(
        grown < 48 << 10,
        "peak RSS grew by {grown} KiB for two 96 MiB messages it should have dropped"
    );
    // Inside a transaction: the transaction is aborted, as by any error.
    c.simple("BEGIN").await.expect("BEGIN");
    let e = c
        .simple(&huge)
        .await
        .expect_err("oversized in a transaction");
    assert!(e.starts_with("54000"), "{e}");
    let e = c.simple("SELECT 3").await.expect_err("aborted transaction");
    assert!(e.starts_with("25P02"), "{e}");
    c.simple("ROLLBACK").await.expect("ROLLBACK");
    assert_eq!(
        c.simple("SELECT 4").await.expect("after"),
        [Some("4".into())]
    );
    proxy.assert_healthy().await;
}

/// Item 11: named prepared statements per session are capped (`limits.max_client_statements`):
/// one more is refused with 54000 and the session goes on; closing one makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statements_per_session_are_capped() {
    let env = start(2, "limits: { max_client_statements: 20 }\n", |_| {});
    let proxy = &env.proxy;
    if proxy.is_direct() {
        note_skipped("the proxy's cap (direct mode has none)");
        return;
    }
    let mut c = wire(proxy).await;
    for i in 0..20 {
        c.parse(&format!("s{i}"), &format!("SELECT {i}"));
    }
    c.sync();
    c.send().await.expect("send");
    let replies = c.until_ready().await.expect("20 Parses");
    assert!(
        replies.iter().all(|m| m.error_code().is_none()),
        "{replies:?}"
    );
    c.parse("s20", "SELECT 20").sync();
    c.send().await.expect("send");
    let replies = c.until_ready().await.expect("the 21st");
    let refused = replies.iter().find_map(|m| match m {
        Backend::Error { code, message } => Some(format!("{code}: {message}")),
        _ => None,
    });
    let refused = refused.expect("the 21st statement must be refused");
    assert!(
        refused.starts_with("54000") && refused.contains("max_client_statements"),
        "{refused}"
    );
    // The session goes on; closing one makes room for another.
    c.close_statement("s0")
        .parse("s20", "SELECT 20")
        .bind("", "s20", &[]);
    c.execute("", 0).sync();
    c.send().await.expect("send");
    let replies = within(
        Duration::from_secs(20),
        "after closing one",
        c.until_ready(),
    )
    .await
    .expect("replies");
    assert!(
        replies.iter().all(|m| m.error_code().is_none()),
        "{replies:?}"
    );
    assert!(
        replies.contains(&Backend::DataRow(vec![Some("20".into())])),
        "{replies:?}"
    );
    proxy.assert_healthy().await;
}

/// Memory in bytes, not statements: a client that prepares many 1 MiB statements is refused
/// past `limits.max_client_statement_bytes`, and the backend's statement cache holds at most
/// `pool.prepared_cache_bytes` of text — what it evicted is closed on the server too, as
/// `pg_prepared_statements` on that backend shows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statement_bytes_are_bounded_per_client_and_per_backend() {
    let env = start(
        1,
        "limits: { max_client_statement_bytes: 6291456 }\n\
         pool: { prepared_cache_bytes: 3145728 }\n",
        |_| {},
    );
    let proxy = &env.proxy;
    if proxy.is_direct() {
        note_skipped("the proxy's caps (direct mode has none)");
        return;
    }
    let mib = |i: usize| format!("SELECT {i} AS n, '{}' AS pad", "x".repeat(1 << 20));
    let mut c = wire(proxy).await;
    let mut refused = 0;
    for i in 0..10 {
        c.parse(&format!("big{i}"), &mib(i))
            .bind("", &format!("big{i}"), &[])
            .execute("", 1)
            .sync();
        c.send().await.expect("send");
        let replies = within(
            Duration::from_secs(20),
            "a 1 MiB statement",
            c.until_ready(),
        )
        .await
        .expect("replies");
        match replies.iter().find_map(|m| match m {
            Backend::Error { code, message } => Some(format!("{code}: {message}")),
            _ => None,
        }) {
            None => assert_eq!(refused, 0, "a statement after a refusal ran: {replies:?}"),
            Some(e) => {
                assert!(
                    e.starts_with("54000") && e.contains("max_client_statement_bytes"),
                    "{e}"
                );
                refused += 1;
            }
        }
    }
    // 6 MiB of text for the client: five statements of a little over 1 MiB, not more.
    assert_eq!(refused, 5, "the sixth and later must be refused");
    // On its one backend: at most 3 MiB of the proxy's statements (the rest closed there).
    let held = scalar(
        &proxy.client().await,
        "SELECT count(*) || ' ' || coalesce(sum(length(statement)), 0) \
         FROM pg_prepared_statements WHERE name LIKE '\\_pgsl\\_%'",
    )
    .await;
    let (count, bytes) = held.split_once(' ').expect("count and bytes");
    let (count, bytes): (u64, u64) = (count.parse().unwrap(), bytes.parse().unwrap());
    assert!(
        count <= 3 && bytes <= 3 << 20,
        "the backend holds {count} statements, {bytes} bytes of text"
    );
    // Closing gives the client its bytes back.
    for i in 0..5 {
        c.close_statement(&format!("big{i}"));
    }
    c.parse("again", &mib(99)).sync();
    c.send().await.expect("send");
    let replies = c.until_ready().await.expect("after closing");
    assert!(
        replies.iter().all(|m| m.error_code().is_none()),
        "{replies:?}"
    );
    proxy.assert_healthy().await;
}

const OTHER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// With limits in the defaults' proportion (an address's share an eighth of the process-wide
/// cap; here 64 of 512, to keep the sockets few), two addresses of silent sockets (a slowloris
/// from two hosts) hold only their two shares of the handshake slots: a third address logs
/// in at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_addresses_cannot_fill_the_handshake_cap() {
    if direct_mode() {
        note_skipped("per-address handshake limits of pgsluice");
        return;
    }
    let env = common::start(
        2,
        "limits:\n  handshake_timeout_ms: 30000\n  max_handshakes: 512\n  \
         max_handshakes_per_address: 64\n",
        |_| {},
    );
    let proxy = &env.proxy;
    let addr = proxy.addr();
    let mut silent = Vec::new();
    for from in [Ipv4Addr::LOCALHOST, OTHER] {
        // The share (64), and more that wait for it: two addresses' worth of
        // sockets that would fill all 512 slots if a share were half of them.
        for _ in 0..260 {
            let mut s = connect_from(from, addr).await;
            s.write_all(&[0, 0]).await.expect("a first byte");
            silent.push(s);
        }
    }
    eventually(
        Duration::from_secs(10),
        "two shares in progress",
        || async { metric(proxy, "pgsluice_client_handshakes").await == Some(128.0) },
    )
    .await;
    let t = Instant::now();
    select_one_over(proxy, connect_from(Ipv4Addr::new(127, 0, 0, 3), addr).await).await;
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    drop(silent);
    proxy.assert_healthy().await;
}

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
    // ... and so do more, up to WAITING_PER_SHARE × the share waiting; beyond, refused at
    // once, naming the per-address limit.
    let mut waiting = Vec::new();
    for _ in 0..4 * pgsluice::session::WAITING_PER_SHARE - 1 {
        waiting.push(connect_from(Ipv4Addr::LOCALHOST, addr).await);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    let err = match proxy.try_client_with(&proxy.app_config()).await {
        Ok(_) => panic!("a connection beyond the waiting share of 127.0.0.1 was accepted"),
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
    // The two forwarded ones may still be on their way to the peer when the third drop is
    // counted: wait for them, then make sure no third one follows.
    eventually(Duration::from_secs(5), "two cancels forwarded", || async {
        taken.load(Ordering::SeqCst) >= 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
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

/// `limits.max_client_conn` counts a client for as long as it is connected, including after
/// a login thread handed its session to the session thread: the next client is told 53300
/// at once, and a freed place is reusable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e5_max_client_conn_counts_clients_for_their_whole_session() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = write(dir.path(), "c.yaml", "limits:\n  max_client_conn: 3\n");
    for threads in ["1", "2"] {
        let options = ProxyOptions::pool(2)
            .config_file(&cfg)
            .arg("--worker-threads")
            .arg(threads);
        let proxy = Proxy::start(&cluster, options);
        if proxy.is_direct() {
            return note_skipped("max_client_conn is the proxy's limit");
        }
        let config = proxy.app_config();
        let mut held = Vec::new();
        for i in 0..3 {
            let (client, task) = proxy
                .try_client_with(&config)
                .await
                .unwrap_or_else(|e| panic!("client {i} of 3 ({threads} threads): {e}"));
            client.simple_query("SELECT 1").await.expect("SELECT 1");
            held.push((client, task));
        }
        let e = match proxy.try_client_with(&config).await {
            Ok(_) => panic!("a 4th client was let in with max_client_conn 3 ({threads} threads)"),
            Err(e) => e,
        };
        let db = e.as_db_error().expect("a server error");
        assert_eq!(db.code().code(), "53300", "{db:?}");
        assert!(db.message().contains("too many clients"), "{db:?}");
        // Every held client still works, then one leaves and its place is reusable.
        for (client, _) in &held {
            client.simple_query("SELECT 2").await.expect("held client");
        }
        drop(held.pop());
        let deadline = Instant::now() + Duration::from_secs(5);
        let (client, _task) = loop {
            match proxy.try_client_with(&config).await {
                Ok(c) => break c,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("the freed place was not reusable ({threads} threads): {e}"),
            }
        };
        client
            .simple_query("SELECT 3")
            .await
            .expect("the freed place");
    }
}
