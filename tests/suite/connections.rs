//! How clients reach the proxy and the proxy reaches Postgres, and which threads serve them:
//! Unix-domain sockets on both sides (PgBouncer's `unix_socket_dir`, and a backend URL with
//! `host=DIR`), and, with one session thread, logins on that thread while few arrive at once
//! and on a login thread of lower priority (nice 10) beyond.
//!
//! TLS is in `tls`; the limit on connected clients, `limits.max_client_conn`, in `limits`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future;
use tokio_postgres::NoTls;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{ADMIN_READ_TOKEN, Proxy, ProxyOptions};
use crate::support::spawned::metric;
use crate::support::sql::{STEP, scalar, send_cancel, sleep_running, sqlstate};
use crate::support::{note_skipped, within};

/// Unix-domain sockets on both sides (PgBouncer's `unix_socket_dir`, and a backend URL with
/// `host=DIR`): a client reaches the proxy at DIR/.s.PGSQL.PORT while TCP clients go on, the
/// proxy reaches Postgres through its socket (the server sees no client address), a cancel
/// travels both sockets, the client list says `unix`, and a graceful stop removes the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_sockets_on_both_sides() {
    if crate::support::direct_mode() {
        note_skipped("Unix-domain sockets (proxy options)");
        return;
    }
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("socket dir");
    let mut proxy = Proxy::start(
        &cluster,
        ProxyOptions::pool(2)
            .backend_over_socket()
            .arg("--unix-socket-dir")
            .arg(dir.path().to_str().expect("utf-8 dir")),
    );
    let port = proxy.addr().port();
    let file = dir.path().join(format!(".s.PGSQL.{port}"));
    assert!(file.exists(), "{} missing", file.display());

    let mut config = tokio_postgres::Config::new();
    config
        .host_path(dir.path())
        .port(port)
        .user(APP_USER)
        .password(APP_PASSWORD)
        .dbname(APP_DB);
    let (client, conn) = within(STEP, "login over the socket", config.connect(NoTls))
        .await
        .expect("login over the proxy's Unix socket");
    tokio::spawn(conn);
    let client = Arc::new(client);
    // Extended protocol; the server's end is its Unix socket (no client address).
    let row = client
        .query_one("SELECT inet_client_addr() IS NULL, $1::int + 1", &[&41i32])
        .await
        .expect("query over the sockets");
    assert!(
        row.get::<_, bool>(0),
        "the backend connection is not on the Unix socket"
    );
    assert_eq!(row.get::<_, i32>(1), 42);
    // A TCP client at the same time.
    let tcp = proxy.client().await;
    assert_eq!(scalar(&tcp, "SELECT 'tcp'").await, "tcp");

    let (status, body) = proxy
        .admin_request(
            "GET",
            "/v1/clients",
            crate::support::proxy::ADMIN_READ_TOKEN,
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let clients: serde_json::Value = serde_json::from_str(&body).expect("json");
    let addresses: Vec<&str> = clients["clients"]
        .as_array()
        .expect("clients")
        .iter()
        .filter_map(|c| c["address"].as_str())
        .collect();
    assert!(addresses.contains(&"unix"), "{body}");
    assert!(
        addresses.iter().any(|a| a.starts_with("127.0.0.1:")),
        "{body}"
    );

    // A cancel: client → proxy over its socket, proxy → Postgres over the server's.
    let monitor = cluster.monitor().await;
    let running = sleep_running(&client, &monitor).await;
    let started = Instant::now();
    send_cancel(&client).await;
    let err = within(Duration::from_secs(5), "the cancelled query", running)
        .await
        .expect("task")
        .expect_err("a cancelled pg_sleep(10) must fail");
    assert_eq!(sqlstate(&err), SqlState::QUERY_CANCELED.code(), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(scalar(&client, "SELECT 'after'").await, "after");

    drop((client, tcp));
    proxy.sigterm();
    assert!(
        proxy.wait_exit(Duration::from_secs(20)).is_some(),
        "the proxy did not stop"
    );
    assert!(!file.exists(), "the socket file outlived the proxy");
}

/// With one session thread: a login thread at nice 10 beside it; a client that logs in while
/// fewer than 4 others do logs in on the session thread, one that arrives while 4 are
/// logging in there (here: 4 connections that never send their startup packet) logs in on the
/// login thread (`pgsluice_client_logins_offloaded_total`) and moves accepting there
/// (`pgsluice_client_accept_moves_total`) until a second passes without another, and a burst
/// of 40 clients logged in on either is served with each its own answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_session_thread_logs_a_burst_of_clients_in_on_a_lower_priority_thread() {
    let cluster = Cluster::start();
    let options = ProxyOptions::pool(4).arg("--worker-threads").arg("1");
    let proxy = Arc::new(Proxy::start(&cluster, options));
    if proxy.is_direct() {
        return;
    }
    let pid = proxy.pid().expect("a proxy process");
    // The runtime starts its worker thread at once, but the thread names itself and lowers
    // its priority when it first runs: on a loaded machine that can come a moment later.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let threads = loop {
        let threads = thread_names_and_nice(pid);
        let named = threads
            .iter()
            .any(|(c, n)| c == "pgsluice-login" && *n == 10);
        if named || std::time::Instant::now() >= deadline {
            break threads;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let login: Vec<_> = threads
        .iter()
        .filter(|(c, _)| c == "pgsluice-login")
        .collect();
    assert_eq!(login.len(), 1, "one login thread expected: {threads:?}");
    assert_eq!(
        login[0].1, 10,
        "the login thread runs at nice 10: {threads:?}"
    );
    assert_eq!(
        threads.iter().filter(|(_, n)| *n == 0).count(),
        threads.len() - 1,
        "every other thread keeps the process priority: {threads:?}"
    );
    let scrape = |series: &'static str| {
        let proxy = Arc::clone(&proxy);
        async move {
            let (status, text) = proxy
                .admin_request("GET", "/metrics", ADMIN_READ_TOKEN, None)
                .await;
            assert_eq!(status, 200, "{text}");
            metric(&text, series).unwrap_or_else(|| panic!("no {series} in /metrics:\n{text}"))
        }
    };
    const OFFLOADED: &str = "pgsluice_client_logins_offloaded_total";
    // One login at a time: each on the session thread.
    for i in 0..3 {
        let client = proxy.client().await;
        assert_eq!(scalar(&client, &format!("SELECT {i}")).await, i.to_string());
    }
    assert_eq!(
        scrape(OFFLOADED).await,
        0.0,
        "lone logins went to the login thread"
    );
    // Four connections that never send a startup packet hold the session thread's places.
    let silent = silent_logins(&proxy, 4).await;
    const MOVES: &str = "pgsluice_client_accept_moves_total";
    assert_eq!(
        scrape(MOVES).await,
        0.0,
        "accepting stays while logins are few"
    );
    let client = proxy.client().await;
    assert_eq!(scalar(&client, "SELECT 'offloaded'").await, "offloaded");
    assert_eq!(
        scrape(OFFLOADED).await,
        1.0,
        "a login beside 4 in progress on the session thread belongs to the login thread"
    );
    assert_eq!(
        scrape(MOVES).await,
        1.0,
        "a login sent to the login thread moves accepting there"
    );
    // Accepted on the login thread: logs in there while the 4 places are taken...
    let client2 = proxy.client().await;
    assert_eq!(
        scalar(&client2, "SELECT 'accepted there'").await,
        "accepted there"
    );
    assert_eq!(scrape(OFFLOADED).await, 2.0);
    drop((client, client2, silent));
    // ...and on the session thread once they are free (its socket moves there first).
    let deadline = Instant::now() + Duration::from_secs(10);
    while scrape("pgsluice_client_handshakes").await > 0.0 {
        assert!(
            Instant::now() < deadline,
            "the silent connections never ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let client = proxy.client().await;
    assert_eq!(scalar(&client, "SELECT 'moved'").await, "moved");
    assert_eq!(
        scrape(OFFLOADED).await,
        2.0,
        "a login beside none stays inline"
    );
    drop(client);
    // Logged in on either, served here: 40 clients connect at once and each sees its own answer.
    let clients = (0..40i32).map(|i| {
        let proxy = Arc::clone(&proxy);
        tokio::spawn(async move {
            let client = proxy.client().await;
            let rows = client
                .query_typed("SELECT $1::int + 1", &[(&i, Type::INT4)])
                .await
                .map_err(|e| format!("client {i}: {e:?}"))?;
            if rows[0].get::<_, i32>(0) != i + 1 {
                return Err(format!("client {i} got another answer"));
            }
            Ok::<(), String>(())
        })
    });
    for r in within(
        Duration::from_secs(60),
        "40 clients",
        future::join_all(clients),
    )
    .await
    {
        r.expect("client task").expect("client result");
    }
    // A second after the last login sent to the login thread, accepting is back on the
    // session thread: lone logins are served, and a new burst moves it again.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let moves = scrape(MOVES).await;
    for i in 0..3 {
        let client = proxy.client().await;
        assert_eq!(scalar(&client, &format!("SELECT {i}")).await, i.to_string());
    }
    assert_eq!(scrape(MOVES).await, moves, "lone logins move nothing");
    let silent = silent_logins(&proxy, 4).await;
    let client = proxy.client().await;
    assert_eq!(scalar(&client, "SELECT 'again'").await, "again");
    assert_eq!(
        scrape(MOVES).await,
        moves + 1.0,
        "accepting had come back to the session thread, and moves again"
    );
    drop((client, silent));
    proxy.assert_healthy().await;
}

/// `n` connections that never send a startup packet, once the proxy counts them as
/// handshakes in progress (each holds a login place).
async fn silent_logins(proxy: &Proxy, n: usize) -> Vec<tokio::net::TcpStream> {
    let mut silent = Vec::new();
    for _ in 0..n {
        silent.push(
            tokio::net::TcpStream::connect(proxy.addr())
                .await
                .expect("connect"),
        );
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, text) = proxy
            .admin_request("GET", "/metrics", ADMIN_READ_TOKEN, None)
            .await;
        if metric(&text, "pgsluice_client_handshakes").is_some_and(|h| h >= n as f64) {
            return silent;
        }
        assert!(
            Instant::now() < deadline,
            "{n} silent connections never showed as handshakes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// (name, nice value) of every thread of process `pid`, from /proc; a thread that exits
/// while it is read is left out.
fn thread_names_and_nice(pid: u32) -> Vec<(String, i64)> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("/proc task list")
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
            let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
            // Field 19 is the nice value; fields count from after the parenthesised name.
            let after = &stat[stat.rfind(')')? + 2..];
            let nice = after.split(' ').nth(16)?.parse().ok()?;
            Some((comm.trim().to_owned(), nice))
        })
        .collect()
}
