//! TESTS.md D: backend faults — restart, smart shutdown, unreachable, slow, killed sessions,
//! clients gone mid-transaction. Network faults go through `crate::support::faults::FaultProxy`.
//!
//! D4 (a partition of an *established* connection) has its own file, `hardening::partition`.

use std::time::{Duration, Instant};

use crate::support::faults::{Fault, FaultProxy};
use crate::support::pg::Cluster;
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::raw::{Raw, oracle, pools_at_rest, query, write};
use crate::support::sql::{eventually, scalar, sqlstate};
use crate::support::within;

/// Connects and runs `SELECT 1`: `None` on success, else the SQLSTATE of the failure (login
/// needs no server once the pool knows the server's parameters, so the query is what fails).
async fn select_one_with(proxy: &Proxy, cfg: &tokio_postgres::Config) -> Option<String> {
    match proxy.try_client_with(cfg).await {
        Err(e) => Some(sqlstate(&e)),
        Ok((c, _)) => c.simple_query("SELECT 1").await.err().map(|e| sqlstate(&e)),
    }
}

async fn select_one(proxy: &Proxy) -> Option<String> {
    select_one_with(proxy, &proxy.app_config()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_fast_restart_mid_query_then_recovery() {
    let mut cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(10));
    let mut running = Vec::new();
    for _ in 0..10 {
        let c = proxy.client().await;
        running.push(tokio::spawn(async move {
            c.simple_query("SELECT pg_sleep(5)")
                .await
                .err()
                .map(|e| sqlstate(&e))
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t = Instant::now();
    cluster.restart_fast();
    for r in running {
        let code = within(Duration::from_secs(10), "a client after restart", r)
            .await
            .expect("task");
        let code = code.expect("the sleeping query must fail, not finish");
        assert!(
            code == "57P01" || code.starts_with("08") || code.contains("closed"),
            "{code}"
        );
    }
    assert!(t.elapsed() < Duration::from_secs(20));
    eventually(Duration::from_secs(10), "traffic resumes", || async {
        match proxy.try_client_with(&proxy.app_config()).await {
            Ok((c, _)) => c.simple_query("SELECT 1").await.is_ok(),
            Err(_) => false,
        }
    })
    .await;
    oracle(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d2_smart_shutdown_lets_the_transaction_finish() {
    let mut cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(3));
    let a = proxy.client().await;
    a.batch_execute("CREATE TABLE smart (v int)")
        .await
        .expect("create");
    a.batch_execute("BEGIN; INSERT INTO smart VALUES (1)")
        .await
        .expect("begin");
    let pidfile = cluster.socket_dir().join("data/postmaster.pid");
    let pid = std::fs::read_to_string(pidfile).expect("postmaster.pid");
    let pid = pid.lines().next().expect("pid line").trim().to_string();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // New work needs a new server connection: 57P03 comes through verbatim.
    assert_eq!(select_one(&proxy).await.as_deref(), Some("57P03"));
    // The open transaction completes.
    a.batch_execute("INSERT INTO smart VALUES (2); COMMIT")
        .await
        .expect("the in-flight transaction completes");
    drop(a);
    cluster.restart_fast();
    eventually(Duration::from_secs(10), "traffic resumes", || async {
        match proxy.try_client_with(&proxy.app_config()).await {
            Ok((c, _)) => c.simple_query("SELECT 1").await.is_ok(),
            Err(_) => false,
        }
    })
    .await;
    let c = proxy.client().await;
    assert_eq!(scalar(&c, "SELECT count(*) FROM smart").await, "2");
    oracle(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d3_backend_unreachable_black_hole_and_reset() {
    let cluster = Cluster::start();
    let fault = FaultProxy::start(cluster.addr()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = write(
        dir.path(),
        "c.yaml",
        "backend:\n  connect_timeout_ms: 700\npool:\n  checkout_timeout_ms: 2000\n",
    );
    let proxy = Proxy::start(
        &cluster,
        ProxyOptions::pool(2)
            .config_file(cfg)
            .backend_via(fault.addr()),
    );
    proxy.assert_healthy().await;
    for f in [Fault::BlackHole, Fault::Reset] {
        // The pooled connections die with the fault; new ones cannot be made.
        fault.set(f);
        fault.reset_all();
        let before = fault.accepted();
        let clients: Vec<_> = (0..10)
            .map(|_| {
                let cfg = proxy.app_config();
                let p = &proxy;
                async move {
                    let t = Instant::now();
                    (select_one_with(p, &cfg).await, t.elapsed())
                }
            })
            .collect();
        for (code, took) in futures_util::future::join_all(clients).await {
            let code = code.expect("no query while the backend is unreachable");
            assert!(
                // 08xxx while connects fail, then 53000 once the breaker opens.
                code.starts_with("08") || code == "53000" || code == "53300",
                "{f:?}: {code}"
            );
            assert!(took < Duration::from_secs(5), "{f:?}: waited {took:?}");
        }
        let attempts = fault.accepted() - before;
        assert!(
            attempts <= 12,
            "{f:?}: {attempts} connect attempts for 10 clients"
        );
        fault.set(Fault::Pass);
        eventually(
            Duration::from_secs(15),
            "recovery after the fault",
            || async {
                match proxy.try_client_with(&proxy.app_config()).await {
                    Ok((c, _)) => c.simple_query("SELECT 1").await.is_ok(),
                    Err(_) => false,
                }
            },
        )
        .await;
    }
    oracle(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d5_slow_backend_statement_and_lock_timeouts() {
    let cluster = Cluster::start();
    let fault = FaultProxy::start(cluster.addr()).await;
    fault.set(Fault::Latency(Duration::from_millis(20)));
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = write(
        dir.path(),
        "c.yaml",
        "global_defaults:\n  statement_timeout_ms: 400\n  lock_timeout_ms: 300\n",
    );
    let proxy = Proxy::start(
        &cluster,
        ProxyOptions::pool(3)
            .config_file(cfg)
            .backend_via(fault.addr()),
    );
    let a = proxy.client().await;
    a.batch_execute("CREATE TABLE locked (id int)")
        .await
        .expect("create");
    let e = a
        .simple_query("SELECT pg_sleep(3)")
        .await
        .expect_err("statement timeout");
    assert_eq!(sqlstate(&e), "57014");
    assert!(format!("{e:?}").contains("statement timeout"), "{e:?}");
    assert_eq!(scalar(&a, "SELECT 1").await, "1");
    // A lock wait longer than lock_timeout.
    a.batch_execute("BEGIN; LOCK TABLE locked IN ACCESS EXCLUSIVE MODE")
        .await
        .expect("lock");
    let b = proxy.client().await;
    let e = b
        .simple_query("SELECT * FROM locked")
        .await
        .expect_err("lock timeout");
    assert_eq!(sqlstate(&e), "55P03");
    a.batch_execute("COMMIT").await.expect("commit");
    assert_eq!(scalar(&b, "SELECT count(*) FROM locked").await, "0");
    drop((a, b));
    oracle(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d6_backend_kills_sessions_repeatedly() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    // The backend kills itself mid-query, five times: the victim gets 57P01, the pool recovers.
    for _ in 0..5 {
        let c = proxy.client().await;
        let e = c
            .simple_query("SELECT pg_terminate_backend(pg_backend_pid())")
            .await
            .expect_err("terminated");
        assert_eq!(sqlstate(&e), "57P01");
        proxy.assert_healthy().await;
    }
    // Idle pooled connections killed from outside are not handed out dead.
    let c = proxy.client().await;
    for _ in 0..3 {
        cluster.terminate_backends("appdb", "app").await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(scalar(&c, "SELECT 2").await, "2");
    }
    // idle_in_transaction_session_timeout fires: 25P03 to the victim.
    let mut v = Raw::tcp(proxy.addr()).await;
    v.app_login().await;
    v.query("BEGIN; SET LOCAL idle_in_transaction_session_timeout = '200ms'")
        .await
        .expect("begin");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let _ = v.send(&query("SELECT 1")).await;
    let err = v.error().await.expect("an error for the victim");
    assert_eq!(err.0, "25P03", "{err:?}");
    assert!(v.closes().await);
    oracle(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d7_client_reset_mid_transaction_releases_locks() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let setup = proxy.client().await;
    setup
        .batch_execute(
            "CREATE TABLE acct (id int PRIMARY KEY, v int); INSERT INTO acct VALUES (1, 0)",
        )
        .await
        .expect("setup");
    let tcp = tokio::net::TcpStream::connect(proxy.addr())
        .await
        .expect("connect");
    socket2::SockRef::from(&tcp)
        .set_linger(Some(Duration::ZERO))
        .expect("linger");
    let mut a = Raw::over(tcp);
    a.app_login().await;
    a.query("BEGIN; UPDATE acct SET v = 1 WHERE id = 1")
        .await
        .expect("update");
    a.send(&query("SELECT pg_sleep(60)")).await.expect("sleep");
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(a);
    let t = Instant::now();
    let monitor = cluster.monitor().await;
    eventually(
        Duration::from_secs(3),
        "no orphaned pg_sleep(60)",
        || async { monitor.active_queries_like("pg_sleep(60)").await.is_empty() },
    )
    .await;
    setup
        .batch_execute("SET lock_timeout = '3s'; UPDATE acct SET v = 2 WHERE id = 1")
        .await
        .expect("the row lock was released");
    assert!(t.elapsed() < Duration::from_secs(4));
    assert_eq!(
        scalar(&setup, "SELECT v FROM acct").await,
        "2",
        "A's update rolled back"
    );
    drop(setup);
    oracle(&proxy).await;
    assert!(pools_at_rest(&proxy).await);
}
