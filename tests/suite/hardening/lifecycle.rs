//! TESTS.md G: SIGTERM drain, a second SIGTERM, SIGHUP reload (limits and TLS files).
//! G3 (several instances) is in `peers`.

use std::time::{Duration, Instant};

use crate::support::pg::{APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{ADMIN_READ_TOKEN, Proxy, ProxyOptions};
use crate::support::raw::{
    Raw, cert, client_tls, first_value, oracle, query, signal, tls_via_request, write,
};
use crate::support::sql::scalar;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g1_sigterm_drains_then_forces() {
    let cluster = Cluster::start();
    cluster.psql_on(
        "appdb",
        "CREATE TABLE g (v int); ALTER TABLE g OWNER TO app",
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = write(
        dir.path(),
        "c.yaml",
        "limits:\n  shutdown_timeout_ms: 3000\n",
    );
    let mut proxy = Proxy::start(&cluster, ProxyOptions::pool(10).config_file(cfg));
    let mut active = Vec::new();
    for i in 0..5 {
        let mut c = Raw::tcp(proxy.addr()).await;
        c.app_login().await;
        c.query(&format!("BEGIN; INSERT INTO g VALUES ({i})"))
            .await
            .expect("begin");
        active.push(c);
    }
    let mut idle = Vec::new();
    for _ in 0..10 {
        let mut c = Raw::tcp(proxy.addr()).await;
        c.app_login().await;
        idle.push(c);
    }
    let mut long = Raw::tcp(proxy.addr()).await;
    long.app_login().await;
    long.query("BEGIN; INSERT INTO g VALUES (999)")
        .await
        .expect("long begin");
    long.send(&query("SELECT pg_sleep(30)"))
        .await
        .expect("sleep");
    tokio::time::sleep(Duration::from_millis(200)).await;

    let t = Instant::now();
    proxy.sigterm();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        tokio::net::TcpStream::connect(proxy.addr()).await.is_err(),
        "the listener must be closed"
    );
    // The admin API outlives the drain: not ready (a load balancer or Kubernetes sends new
    // clients elsewhere), and /metrics still scrapable.
    let (status, body) = proxy.admin_request("GET", "/readyz", "", None).await;
    assert_eq!(status, 503, "GET /readyz while draining: {body}");
    assert!(body.contains("shutting down"), "{body}");
    let (status, body) = proxy
        .admin_request("GET", "/metrics", ADMIN_READ_TOKEN, None)
        .await;
    assert_eq!(status, 200, "GET /metrics while draining: {body}");
    for (i, c) in idle.iter_mut().enumerate() {
        let err = c.error().await;
        assert_eq!(
            err.map(|e| e.0).as_deref(),
            Some("57P01"),
            "idle client {i}"
        );
    }
    for (i, c) in active.iter_mut().enumerate() {
        let msgs = c
            .query(&format!("INSERT INTO g VALUES ({}); COMMIT", i + 100))
            .await
            .expect("an active transaction finishes");
        assert!(msgs.iter().all(|m| m.0 != b'E'), "{msgs:?}");
        assert_eq!(c.error().await.map(|e| e.0).as_deref(), Some("57P01"));
    }
    // The long transaction is cancelled at shutdown_timeout and rolled back.
    let mut codes = Vec::new();
    while let Some((code, _)) = long.error().await {
        codes.push(code);
    }
    assert!(codes.contains(&"57P01".to_string()), "{codes:?}");
    let status = proxy
        .wait_exit(Duration::from_secs(8))
        .expect("the proxy exits");
    assert!(status.success(), "{status}");
    assert!(t.elapsed() < Duration::from_secs(9), "{:?}", t.elapsed());
    let rows = cluster.psql_on("appdb", "SELECT string_agg(v::text, ',' ORDER BY v) FROM g");
    assert_eq!(
        rows.trim(),
        "0,1,2,3,4,100,101,102,103,104",
        "no half-applied transaction"
    );
    let monitor = cluster.monitor().await;
    assert!(monitor.active_queries_like("pg_sleep(30)").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g2_second_sigterm_exits_at_once() {
    let cluster = Cluster::start();
    let mut proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let c = proxy.client().await;
    let busy = tokio::spawn(async move { c.simple_query("SELECT pg_sleep(20)").await.is_ok() });
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.sigterm();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        proxy.wait_exit(Duration::from_millis(100)).is_none(),
        "first SIGTERM drains"
    );
    let t = Instant::now();
    proxy.sigterm();
    let status = proxy
        .wait_exit(Duration::from_secs(3))
        .expect("exit on the second SIGTERM");
    assert!(status.success(), "{status}");
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(
        !busy.await.expect("task"),
        "the running query did not complete"
    );
}

/// Under systemd (`Type=notify`, NOTIFY_SOCKET set) the proxy says READY=1 once it accepts
/// clients, RELOADING=1 (with MONOTONIC_USEC) then READY=1 around a SIGHUP reload, and
/// STOPPING=1 when SIGTERM starts the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g5_service_manager_notifications() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("notify.sock");
    let socket = std::os::unix::net::UnixDatagram::bind(&path).expect("bind the notify socket");
    socket
        .set_read_timeout(Some(Duration::from_secs(15)))
        .expect("read timeout");
    let recv = || {
        let mut buf = [0u8; 1024];
        let n = socket.recv(&mut buf).expect("a notification within 15 s");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let mut proxy = Proxy::start(
        &cluster,
        ProxyOptions::pool(2).env("NOTIFY_SOCKET", path.to_string_lossy()),
    );
    if proxy.is_direct() {
        return;
    }
    let ready = recv();
    assert!(
        ready.starts_with("READY=1\nSTATUS=serving on "),
        "{ready:?}"
    );
    // Ready means ready: a client gets in right away.
    let c = proxy.client().await;
    assert_eq!(scalar(&c, "SELECT 1").await, "1");

    signal(&proxy, "HUP");
    let reloading = recv();
    assert!(
        reloading.starts_with("RELOADING=1\nMONOTONIC_USEC="),
        "{reloading:?}"
    );
    let after = recv();
    assert!(after.starts_with("READY=1\n"), "{after:?}");

    drop(c);
    proxy.sigterm();
    let stopping = recv();
    assert!(stopping.starts_with("STOPPING=1\n"), "{stopping:?}");
    let status = proxy
        .wait_exit(Duration::from_secs(10))
        .expect("the proxy exits");
    assert!(status.success(), "{status}");
}

fn reload_yaml(dir: &std::path::Path, timeout_ms: u64) -> String {
    format!(
        "tls:\n  mode: allow\n  cert_file: {0}/cert.pem\n  key_file: {0}/key.pem\n\
         pool:\n  checkout_timeout_ms: {timeout_ms}\nlimits:\n  max_client_conn: 500\n",
        dir.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g4_sighup_reload_keeps_clients_and_rejects_bad_configs() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let (c1, k1, root1) = cert(&["localhost"], false);
    write(dir.path(), "cert.pem", &c1);
    write(dir.path(), "key.pem", &k1);
    let cfg = write(dir.path(), "c.yaml", &reload_yaml(dir.path(), 5000));
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(4).config_file(&cfg));
    let plain = proxy.client().await;
    let mut tls = tls_via_request(proxy.addr(), client_tls(&root1, false))
        .await
        .expect("TLS with the first certificate");
    tls.app_login().await;
    let txn = proxy.client().await;
    txn.batch_execute("BEGIN; CREATE TEMP TABLE IF NOT EXISTS x (v int)")
        .await
        .ok();
    // New limits and new certificate files.
    let (c2, k2, root2) = cert(&["localhost"], false);
    write(dir.path(), "cert.pem", &c2);
    write(dir.path(), "key.pem", &k2);
    write(dir.path(), "c.yaml", &reload_yaml(dir.path(), 7000));
    signal(&proxy, "HUP");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(scalar(&plain, "SELECT 1").await, "1");
    assert_eq!(
        first_value(&tls.query("SELECT 2").await.expect("TLS client kept")).as_deref(),
        Some("2")
    );
    txn.batch_execute("COMMIT")
        .await
        .expect("open transaction kept");
    assert!(
        tls_via_request(proxy.addr(), client_tls(&root1, false))
            .await
            .is_err(),
        "the old certificate is no longer served"
    );
    let mut fresh = tls_via_request(proxy.addr(), client_tls(&root2, false))
        .await
        .expect("the new certificate is served");
    fresh
        .login(0, APP_USER, APP_PASSWORD, &[])
        .await
        .expect("login over new TLS");
    // Invalid configs are rejected and the running one stays.
    for bad in [
        "pool:\n  size: 0\n".to_string(),
        "listen: [not an address\n".to_string(),
        format!(
            "tls:\n  mode: allow\n  cert_file: {0}/nope.pem\n  key_file: {0}/key.pem\n",
            dir.path().display()
        ),
    ] {
        write(dir.path(), "c.yaml", &bad);
        signal(&proxy, "HUP");
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(scalar(&plain, "SELECT 3").await, "3");
        assert_eq!(
            first_value(&tls.query("SELECT 4").await.expect("TLS")).as_deref(),
            Some("4")
        );
        let mut c = tls_via_request(proxy.addr(), client_tls(&root2, false))
            .await
            .expect("the running TLS configuration stays");
        c.app_login().await;
    }
    assert!(
        proxy.stderr_tail().contains("reload rejected"),
        "{}",
        proxy.stderr_tail()
    );
    drop((plain, txn));
    oracle(&proxy).await;
}
