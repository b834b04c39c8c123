//! The process lifecycle (TESTS.md G): SIGTERM drains the sessions, then forces (G1); a second
//! SIGTERM exits at once (G2); a SIGHUP reload keeps connected clients, applies new limits and
//! TLS files (SCRAM-SHA-256-PLUS then binds to the new certificate) and rejects an invalid
//! file, keeping the running configuration (G4, and the caller limits of issue 5); under
//! systemd the proxy tells the service manager READY, RELOADING and STOPPING (G5); and the failover steps of the runbook, with the CLI — pause, point the config
//! at the new server, reload, reconnect, resume — move clients without an error.
//!
//! * `rolling_restart` — G3: one of two instances sharing a SO_REUSEPORT port restarts under
//!   load and no new connection is refused.
//!
//! A backend password changed on reload is in `auth::backend`, a reloaded databases map in
//! `routing`, the admin API's reload in `admin`.

mod rolling_restart;

use std::sync::Arc;
use std::time::{Duration, Instant};

use postgres_protocol::authentication::sasl::ChannelBinding;
use tokio_postgres::Client;

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::policy::{
    assert_refusal, connect_many, detail, join_all, poll_until, spawn_timed, start,
};
use crate::support::proxy::{ADMIN_READ_TOKEN, Proxy, ProxyOptions};
use crate::support::raw::{
    Raw, cert, client_tls, first_value, oracle, query, sasl_login, signal, tls_via_request, write,
};
use crate::support::spawned::{client, spawn};
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
    // SCRAM-SHA-256-PLUS binds to the certificate now served, and no longer to the old one.
    for (root, want) in [(&root2, "ok"), (&root1, "28P01")] {
        let c = tls_via_request(proxy.addr(), client_tls(&root2, false))
            .await
            .expect("TLS with the new certificate");
        let hash = ring::digest::digest(&ring::digest::SHA256, root.as_ref());
        let binding = ChannelBinding::tls_server_end_point(hash.as_ref().to_vec());
        let (_, got) = sasl_login(c, "SCRAM-SHA-256-PLUS", binding, APP_PASSWORD).await;
        assert!(got.starts_with(want), "{got}");
    }
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

/// Sends SIGHUP to the proxy and waits for its log to report the outcome; returns whether the
/// reload was applied (`configuration reloaded`) or rejected.
async fn sighup(proxy: &Proxy) -> bool {
    let count = |needle: &str| proxy.stderr_tail().matches(needle).count();
    let (ok0, bad0) = (count("configuration reloaded"), count("reload rejected"));
    let pid = proxy.pid().expect("a proxy process");
    let status = std::process::Command::new("kill")
        .arg("-HUP")
        .arg(pid.to_string())
        .status()
        .expect("run kill -HUP");
    assert!(status.success(), "kill -HUP {pid} failed");
    let mut outcome = None;
    let seen = poll_until(Duration::from_secs(5), || {
        let (ok, bad) = (count("configuration reloaded"), count("reload rejected"));
        if ok > ok0 {
            outcome = Some(true);
        } else if bad > bad0 {
            outcome = Some(false);
        }
        std::future::ready(outcome.is_some())
    })
    .await;
    assert!(
        seen,
        "the proxy logged no reload outcome after SIGHUP:\n{}",
        proxy.stderr_tail()
    );
    outcome.expect("reload outcome")
}

fn elastic_config(max_concurrency: &str) -> String {
    format!(
        r#"
callers:
  - name: elastic
    match: {{ application_name: elastic }}
    max_concurrency: {max_concurrency}
    queue_depth: 0
"#
    )
}

/// Runs `n` concurrent `pg_sleep(0.4)` on `clients`; returns how many were refused, checking
/// the refusals name `limit`.
async fn refused_of(clients: &[Arc<Client>], n: usize, limit: &str) -> usize {
    let tasks: Vec<_> = clients[..n]
        .iter()
        .map(|c| spawn_timed(c, "SELECT pg_sleep(0.4)"))
        .collect();
    let mut refused = 0;
    for t in join_all(tasks).await {
        if let Err(e) = &t.result {
            let (db, _) = assert_refusal(e, "53300", "ERR_CALLER_LIMIT_EXCEEDED");
            assert!(detail(db).contains(limit), "DETAIL names {limit}: {db:?}");
            refused += 1;
        }
    }
    refused
}

/// SIGHUP after rewriting the config: connected clients stay, the new limit applies; an
/// invalid file is rejected and the running limits stay; a later valid file applies again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reload_applies_new_limits_and_rejects_invalid_files() {
    let Some(env) = start(8, &elastic_config("4")) else {
        return;
    };
    let clients = connect_many(&env.proxy, Some("elastic"), 4).await;
    assert_eq!(
        refused_of(&clients, 4, "max_concurrency=4").await,
        0,
        "4 of 4 run"
    );

    std::fs::write(&env.config, elastic_config("2")).expect("rewrite config");
    assert!(sighup(&env.proxy).await, "a valid config is reloaded");
    assert_eq!(
        refused_of(&clients, 3, "max_concurrency=2").await,
        1,
        "the new max_concurrency=2 applies to clients connected before the reload"
    );

    for bad in [
        elastic_config("0"),
        "callers: [ {name: elastic, match: {application_name: elastic}, max_concurrency: lots} ]\n"
            .to_string(),
        "callers: [\n".to_string(),
    ] {
        std::fs::write(&env.config, &bad).expect("write invalid config");
        assert!(
            !sighup(&env.proxy).await,
            "an invalid config is rejected:\n{bad}"
        );
        assert_eq!(
            refused_of(&clients, 3, "max_concurrency=2").await,
            1,
            "the running limit (2) stays after rejecting:\n{bad}"
        );
    }

    std::fs::write(&env.config, elastic_config("3")).expect("rewrite config");
    assert!(
        sighup(&env.proxy).await,
        "a valid config after invalid ones is reloaded"
    );
    assert_eq!(
        refused_of(&clients, 3, "max_concurrency=3").await,
        0,
        "3 of 3 run"
    );
    for c in &clients {
        assert_eq!(
            scalar(c, "SELECT 1").await,
            "1",
            "clients survived every reload"
        );
    }
}

/// The failover steps of the runbook, with the CLI: pause, point the config at the new
/// server, reload, reconnect, resume — a client in the middle sees a pause, not an error, and
/// its next transaction runs on the new server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_by_the_runbook_moves_clients_to_the_new_server_without_an_error() {
    let old = Cluster::start();
    let new = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let admin_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let config = dir.path().join("pgsluice.yaml");
    let write = |server: &Cluster| {
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:0\nbackend:\n  url: postgres://{APP_USER}:{APP_PASSWORD}@{}/{APP_DB}\n\
                 admin:\n  listen: 127.0.0.1:{admin_port}\n  write_token: w\n",
                server.addr()
            ),
        )
        .expect("write config");
    };
    write(&old);
    let cfg = config.display().to_string();
    let p = spawn(&[], &["--config", &cfg]);
    let url = format!(
        "host={} port={} user={APP_USER} password={APP_PASSWORD} dbname={APP_DB}",
        p.listen.ip(),
        p.listen.port()
    );
    let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("login");
    tokio::spawn(conn);
    let port = |rows: Vec<tokio_postgres::SimpleQueryMessage>| -> u16 {
        rows.iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            })
            .and_then(|p| p.parse().ok())
            .expect("a port")
    };
    let server_port = "SELECT current_setting('port')";
    assert_eq!(
        port(c.simple_query(server_port).await.expect("query")),
        old.addr().port()
    );

    let run = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            client(&args)
        })
    };
    let pool = format!("{APP_DB}/{APP_USER}");
    let (ok, out, err) = run(vec!["pause".into(), pool.clone(), "-c".into(), cfg.clone()])
        .await
        .expect("pause");
    assert!(
        ok && out.contains("paused; no transaction in flight"),
        "{out}{err}"
    );
    // A transaction started during the pause waits for the resume.
    let waiting = tokio::spawn({
        let url = url.clone();
        async move {
            let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
            tokio::spawn(conn);
            c.simple_query("SELECT current_setting('port')").await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "held while paused");

    write(&new);
    for step in ["reload", "reconnect", "resume"] {
        let mut args = vec![step.to_owned()];
        if step != "reload" {
            args.push(pool.clone());
        }
        args.extend(["-c".to_owned(), cfg.clone()]);
        let (ok, out, err) = run(args).await.expect(step);
        assert!(ok, "{step}: {out}{err}");
    }
    let rows = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("released by the resume")
        .expect("join")
        .expect("the held transaction ran, without an error");
    assert_eq!(port(rows), new.addr().port(), "it ran on the new server");
    assert_eq!(
        port(
            c.simple_query(server_port)
                .await
                .expect("the first client goes on")
        ),
        new.addr().port()
    );
    drop(old);
    assert_eq!(
        port(
            c.simple_query(server_port)
                .await
                .expect("after the old server is gone")
        ),
        new.addr().port()
    );
}
