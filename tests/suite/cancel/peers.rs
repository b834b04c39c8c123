//! TESTS.md G3: several instances. A CancelRequest that lands on the wrong instance is passed
//! on to the one that owns the key (`peer_id`/`peers`), also between instances sharing one
//! port through their own `peer_listen` addresses.
//!
//! The rolling restart of G3 is in `lifecycle::rolling_restart`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::support::pg::{APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::raw::{Raw, admin_text, key_data, oracle, query, send_cancel, write};
use crate::support::sql::eventually;
use crate::support::{direct_mode, note_skipped, within};

/// `pgsluice_cancels_total{outcome="…"}` from the proxy's /metrics (0 when absent).
async fn cancels(proxy: &Proxy, outcome: &str) -> u64 {
    let text = admin_text(proxy, "/metrics").await;
    let series = format!("pgsluice_cancels_total{{outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// A loopback address nothing listens on right now.
fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local addr")
}

fn peer_yaml(id: u8, peer: u8, addr: SocketAddr) -> String {
    format!("peer_id: {id}\npeers:\n  - {{ id: {peer}, addr: \"{addr}\" }}\n")
}

/// Logs in on protocol 3.`minor` at `addr` and starts `SELECT pg_sleep(30)`; the connection and
/// its cancel key.
async fn sleeping_client(addr: SocketAddr, minor: u16) -> (Raw, i32, Vec<u8>) {
    let mut c = Raw::tcp(addr).await;
    let msgs = c
        .login(minor, APP_USER, APP_PASSWORD, &[])
        .await
        .expect("login");
    let (pid, secret) = key_data(&msgs);
    c.send(&query("SELECT pg_sleep(30)")).await.expect("query");
    (c, pid, secret)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g3_cancel_is_routed_to_the_owning_instance() {
    if direct_mode() {
        note_skipped("cancel routing between pgsluice instances");
        return;
    }
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    // Instance 1's address is chosen first so that instance 2 can name it.
    let addr1 = free_addr();
    let two = Proxy::start(
        &cluster,
        ProxyOptions::pool(4).config_file(write(dir.path(), "two.yaml", &peer_yaml(2, 1, addr1))),
    );
    let one = Proxy::start(
        &cluster,
        ProxyOptions::pool(4).listen(addr1).config_file(write(
            dir.path(),
            "one.yaml",
            &peer_yaml(1, 2, two.addr()),
        )),
    );
    let monitor = cluster.monitor().await;

    for (round, minor) in [0u16, 2].into_iter().enumerate() {
        let (mut c, pid, secret) = sleeping_client(one.addr(), minor).await;
        assert_eq!(pid as u32 >> 23, 1, "the key names instance 1: {pid:#x}");
        assert_eq!(secret.len(), if minor == 0 { 4 } else { 32 });
        eventually(Duration::from_secs(10), "pg_sleep(30) runs", || async {
            !monitor.active_queries_like("pg_sleep(30)").await.is_empty()
        })
        .await;

        // A wrong secret is forwarded (instance 2 cannot check it) and ignored by the owner.
        let ignored = cancels(&one, "ignored").await;
        let mut wrong = secret.clone();
        wrong[0] ^= 0xff;
        send_cancel(two.addr(), pid, &wrong).await;
        assert_eq!(cancels(&two, "forwarded").await, 2 * round as u64 + 1);
        assert_eq!(cancels(&one, "ignored").await, ignored + 1);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            monitor.active_queries_like("pg_sleep(30)").await.len(),
            1,
            "a wrong secret cancels nothing"
        );

        // The right one, sent to the instance that does not own the key, ends the query.
        let t = Instant::now();
        send_cancel(two.addr(), pid, &secret).await;
        let code = within(
            Duration::from_secs(10),
            "the cancelled query ends",
            c.error(),
        )
        .await
        .map(|e| e.0);
        assert_eq!(
            code.as_deref(),
            Some("57014"),
            "protocol 3.{minor}\n--- two ---\n{}\n--- one ---\n{}",
            two.stderr_tail(),
            one.stderr_tail()
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        c.until_ready()
            .await
            .expect("ReadyForQuery after the cancel");
        assert_eq!(cancels(&two, "forwarded").await, 2 * round as u64 + 2);
        assert_eq!(cancels(&one, "sent").await, round as u64 + 1);
        assert_eq!(cancels(&two, "sent").await, 0);
        assert_eq!(
            crate::support::raw::first_value(&c.query("SELECT 5").await.expect("session goes on"))
                .as_deref(),
            Some("5")
        );
    }
    // A key naming an instance nobody configured is ignored, not forwarded.
    let forwarded = cancels(&two, "forwarded").await;
    send_cancel(two.addr(), (9 << 23) | (3 << 21) | 1, &[1, 2, 3, 4]).await;
    assert_eq!(cancels(&two, "forwarded").await, forwarded);
    oracle(&one).await;
    oracle(&two).await;
}

/// Two instances on one SO_REUSEPORT port, each with a `peer_listen` address of its own that
/// the other lists: every client's cancel, sent through the shared port (which spreads it over
/// the instances), ends that client's query; and a cancel handed to the non-owner's
/// `peer_listen` is passed on to the owner's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g3_cancel_through_the_shared_port_reaches_the_owner() {
    if direct_mode() {
        note_skipped("cancel routing between pgsluice instances");
        return;
    }
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let (peer1, peer2) = (free_addr(), free_addr());
    let yaml = |id: u8, own: SocketAddr, other: u8, other_addr: SocketAddr| {
        format!(
            "listen_reuseport: true\npeer_listen: \"{own}\"\n{}",
            peer_yaml(id, other, other_addr)
        )
    };
    let one = Proxy::start(
        &cluster,
        ProxyOptions::pool(6).config_file(write(dir.path(), "one.yaml", &yaml(1, peer1, 2, peer2))),
    );
    let port = one.addr();
    let two = Proxy::start(
        &cluster,
        ProxyOptions::pool(6).listen(port).config_file(write(
            dir.path(),
            "two.yaml",
            &yaml(2, peer2, 1, peer1),
        )),
    );
    assert_eq!(two.addr(), port, "both instances share one port");
    let monitor = cluster.monitor().await;

    // Sessions land on either instance; the key says which.
    let mut clients = Vec::new();
    for _ in 0..6 {
        clients.push(sleeping_client(port, 0).await);
    }
    let owners: Vec<u32> = clients
        .iter()
        .map(|(_, pid, _)| *pid as u32 >> 23)
        .collect();
    assert!(owners.iter().all(|o| *o == 1 || *o == 2), "{owners:?}");
    eventually(Duration::from_secs(10), "six pg_sleep(30) run", || async {
        monitor.active_queries_like("pg_sleep(30)").await.len() >= 6
    })
    .await;

    // The deterministic path first: the first client's key, handed to the other instance's
    // peer_listen, goes to its owner's peer_listen.
    let (c0, pid0, secret0) = &mut clients[0];
    let (owner, other_peer) = if *pid0 as u32 >> 23 == 1 {
        (&one, peer2)
    } else {
        (&two, peer1)
    };
    let sent = cancels(owner, "sent").await;
    send_cancel(other_peer, *pid0, secret0).await;
    let code = within(Duration::from_secs(10), "the first query ends", c0.error())
        .await
        .map(|e| e.0);
    assert_eq!(
        code.as_deref(),
        Some("57014"),
        "via the other's peer_listen"
    );
    assert_eq!(cancels(owner, "sent").await, sent + 1);
    c0.until_ready().await.expect("ReadyForQuery");

    // Then the rest through the shared port, wherever each request lands.
    for (c, pid, secret) in clients.iter_mut().skip(1) {
        send_cancel(port, *pid, secret).await;
        let code = within(Duration::from_secs(10), "a cancelled query ends", c.error())
            .await
            .map(|e| e.0);
        assert_eq!(
            code.as_deref(),
            Some("57014"),
            "key of instance {}\n--- one ---\n{}\n--- two ---\n{}",
            *pid as u32 >> 23,
            one.stderr_tail(),
            two.stderr_tail()
        );
        c.until_ready().await.expect("ReadyForQuery");
    }
    assert_eq!(
        cancels(&one, "sent").await + cancels(&two, "sent").await,
        6,
        "each query cancelled once, by its owner"
    );
    // Garbage on a peer_listen address is closed and changes nothing.
    let mut junk = tokio::net::TcpStream::connect(peer1)
        .await
        .expect("connect");
    tokio::io::AsyncWriteExt::write_all(&mut junk, b"GET / HTTP/1.0\r\n\r\n")
        .await
        .expect("write");
    let mut buf = [0u8; 16];
    let n = within(
        Duration::from_secs(5),
        "peer_listen closes junk",
        tokio::io::AsyncReadExt::read(&mut junk, &mut buf),
    )
    .await
    .unwrap_or(0);
    assert_eq!(n, 0, "nothing is answered on peer_listen");
    drop(clients);
    oracle(&one).await;
    oracle(&two).await;
}
