//! The admin HTTP API: authentication and authorization (tokens, read versus write, tokens from
//! the environment), health and readiness, the read endpoints, `/metrics` (checked with
//! `promtool`), reload and the OpenAPI document; and the incident controls (issue 17).
//!
//! Most tests run through `router_with_env(app, …)` with `tower::ServiceExt::oneshot`, no socket
//! (`crate::support::admin_api`). `promtool` (Debian package `prometheus`) must be installed: the
//! metrics test fails, rather than skips, without it.
//!
//! The incident controls run against a real PostgreSQL through the proxy: pause (in-flight
//! transactions finish, new ones wait, resume releases them, none lost), reconnect (every
//! backend pid replaced), the client and server lists, terminating a client (57P01, its
//! statement stops on the server) or cancelling its statement, and disabling new logins to a
//! database (57P03). With `PGSLUICE_TEST_DIRECT=1` that test is skipped.
//!
//! * `stats` — the pool statistics that SHOW STATS users graph reach `/metrics`, wait and
//!   backend times apart.
//!
//! The rules and fingerprints endpoints are in `rules::api`; the `pgsluice` admin commands in
//! `cli`.

mod stats;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{StatusCode, header};
use serde_json::json;
use tokio_postgres::Client;

use pgsluice::admin::auth::EnvTokens;
use pgsluice::admin::router_with_env;
use pgsluice::app::Reloader;
use pgsluice::observe::metrics::KNOWN_REASONS;
use pgsluice::policy::RefusalKind;

use crate::support::admin_api::{FP, R, W, api, app_with, call, config, get, put_rule, throttle};
use crate::support::pg::{APP_DB, APP_USER};
use crate::support::proxy::{Proxy, client};
use crate::support::sql::{STEP, eventually, scalar, sqlstate};
use crate::support::storm::{sleeping, start};
use crate::support::within;

#[tokio::test]
async fn missing_and_wrong_tokens_get_the_same_401() {
    let app = app_with(config(None));
    let r = api(&app);
    let none = put_rule(&r, FP, None, &throttle()).await;
    let wrong = put_rule(&r, FP, Some("write-secret-tokeN"), &throttle()).await;
    let longer = put_rule(&r, FP, Some("write-secret-token-and-more"), &throttle()).await;
    for resp in [&none, &wrong, &longer] {
        assert_eq!(resp.status, StatusCode::UNAUTHORIZED);
        assert!(resp.headers.contains_key(header::WWW_AUTHENTICATE));
    }
    assert_eq!(none.body, wrong.body);
    assert_eq!(none.body, longer.body);
    let read_none = get(&r, "/v1/rules", None).await;
    let read_wrong = get(&r, "/v1/rules", Some("nope")).await;
    assert_eq!(read_none.status, StatusCode::UNAUTHORIZED);
    assert_eq!(read_none.body, read_wrong.body);
    assert_eq!(
        get(&r, "/metrics", None).await.status,
        StatusCode::UNAUTHORIZED
    );
    // Unknown paths do not reveal themselves without a token either.
    assert_eq!(
        get(&r, "/v1/nothing", None).await.status,
        StatusCode::UNAUTHORIZED
    );
    assert!(app.policy.rules().is_empty());
}

#[tokio::test]
async fn read_token_reads_but_cannot_mutate() {
    let app = app_with(config(None));
    let r = api(&app);
    let resp = put_rule(&r, FP, Some(R), &throttle()).await;
    assert_eq!(resp.status, StatusCode::FORBIDDEN);
    assert_eq!(resp.json()["error"], "forbidden");
    let del = call(
        &r,
        "DELETE",
        &format!("/v1/rules/fingerprint/{FP}"),
        Some(R),
        None,
    )
    .await;
    assert_eq!(del.status, StatusCode::FORBIDDEN);
    let reload = call(&r, "POST", "/v1/reload", Some(R), None).await;
    assert_eq!(reload.status, StatusCode::FORBIDDEN);
    for path in [
        "/v1/rules",
        "/v1/fingerprints",
        "/v1/callers",
        "/v1/pools",
        "/v1/breaker",
        "/metrics",
    ] {
        assert_eq!(
            get(&r, path, Some(R)).await.status,
            StatusCode::OK,
            "{path}"
        );
        assert_eq!(
            get(&r, path, Some(W)).await.status,
            StatusCode::OK,
            "{path}"
        );
    }
    assert!(app.policy.rules().is_empty());
}

#[tokio::test]
async fn no_write_token_disables_mutations_with_a_hint() {
    let mut c = config(None);
    c.admin.write_token = None;
    let r = api(&app_with(c));
    let resp = put_rule(&r, FP, Some(R), &throttle()).await;
    assert_eq!(resp.status, StatusCode::FORBIDDEN);
    let msg = resp.json()["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        msg.contains("admin.write_token") && msg.contains("PGSLUICE_ADMIN_TOKEN"),
        "{msg}"
    );
    assert_eq!(
        put_rule(&r, FP, None, &throttle()).await.status,
        StatusCode::FORBIDDEN
    );
}

#[tokio::test]
async fn open_reads_and_environment_tokens() {
    let mut c = config(None);
    c.admin.read_token = None;
    c.admin.write_token = None;
    c.admin.open_reads = true;
    let app = app_with(c);
    let env = EnvTokens {
        write: Some("from-env".into()),
        read: None,
    };
    let r = router_with_env(app.clone(), env);
    assert_eq!(get(&r, "/v1/rules", None).await.status, StatusCode::OK);
    assert_eq!(get(&r, "/metrics", None).await.status, StatusCode::OK);
    assert_eq!(
        put_rule(&r, FP, Some("from-env"), &throttle()).await.status,
        StatusCode::CREATED
    );
    // A config token wins over the environment.
    let mut c = config(None);
    c.admin.write_token = Some("from-config".into());
    app.reload(c).expect("reload");
    assert_eq!(
        put_rule(&r, FP, Some("from-env"), &throttle()).await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        put_rule(&r, FP, Some("from-config"), &throttle())
            .await
            .status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn health_and_readiness_are_open() {
    let app = app_with(config(None));
    let r = api(&app);
    let h = get(&r, "/healthz", None).await;
    assert_eq!((h.status, h.text().as_str()), (StatusCode::OK, "ok\n"));
    let ready = get(&r, "/readyz", None).await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(ready.json()["ready"], true);
    app.begin_shutdown();
    let ready = get(&r, "/readyz", None).await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(ready.json()["ready"], false);
}

/// While every pool's last connection attempt failed, /readyz is 503 naming the error; a
/// pool that has not tried says nothing.
#[tokio::test]
async fn readiness_is_503_while_the_database_cannot_be_reached() {
    let mut c = config(None);
    c.backend.url = Some("postgres://app:secret@127.0.0.1:1/appdb".into());
    c.backend.connect_timeout_ms = 500;
    let app = app_with(c);
    let r = api(&app);
    let pool = app.pool_for("appdb", "app").expect("pool");
    assert_eq!(get(&r, "/readyz", None).await.status, StatusCode::OK);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    assert!(
        pool.checkout(2, deadline).await.is_err(),
        "nothing listens on port 1"
    );
    let ready = get(&r, "/readyz", None).await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    let reason = ready.json()["reason"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(reason.contains("cannot be reached"), "{reason}");
}

fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

fn promtool_check(text: &str) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
            "promtool not found: install the Debian package `prometheus` \
             (apt-get install -y prometheus); this test does not skip"
        ),
        Err(e) => panic!("cannot run promtool: {e}"),
    };
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}\n--- metrics ---\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn metrics_parse_and_move() {
    let mut c = config(None);
    c.callers = serde_yaml::from_str(
        "- name: payments\n  priority: critical\n- name: analytics\n  priority: low\n",
    )
    .expect("callers");
    let app = app_with(c);
    let r = api(&app);
    let before = get(&r, "/metrics", Some(R)).await;
    assert_eq!(before.status, StatusCode::OK);
    assert!(
        before
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/plain"))
    );
    promtool_check(&before.text());
    let build = format!(
        r#"pgsluice_build_info{{version="{}"}}"#,
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(sample(&before.text(), &build), Some(1.0), "build info");
    // The standard process series (Linux), read from /proc at scrape time.
    for series in [
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_threads",
        "process_start_time_seconds",
    ] {
        assert!(
            sample(&before.text(), series).is_some_and(|v| v > 0.0),
            "{series} missing or zero"
        );
    }
    assert!(sample(&before.text(), "process_cpu_seconds_total").is_some());
    let ok = r#"pgsluice_queries_total{caller="payments",outcome="ok"}"#;
    let refused = r#"pgsluice_refusals_total{caller="analytics",reason="rate_limited"}"#;
    assert_eq!(sample(&before.text(), ok), Some(0.0));
    assert_eq!(sample(&before.text(), refused), Some(0.0));

    app.metrics
        .callers()
        .query(0, Duration::from_millis(4), Duration::from_millis(3), true);
    app.metrics.callers().query(
        0,
        Duration::from_millis(40),
        Duration::from_millis(30),
        true,
    );
    app.metrics
        .callers()
        .queue_wait(1, Duration::from_millis(2));
    app.metrics.callers().refusal(1, "rate_limited");
    app.metrics.rule_hit("THROTTLE", true);
    for _ in 0..5 {
        app.policy.record_backend_result(false);
    }
    put_rule(&r, FP, Some(W), &throttle()).await;
    let after = get(&r, "/metrics", Some(R)).await.text();
    promtool_check(&after);
    assert_eq!(sample(&after, ok), Some(2.0));
    assert_eq!(sample(&after, refused), Some(1.0));
    let count = r#"pgsluice_query_duration_seconds_count{caller="payments"}"#;
    assert_eq!(sample(&after, count), Some(2.0));
    let waited = r#"pgsluice_queue_wait_seconds_count{caller="analytics"}"#;
    assert_eq!(sample(&after, waited), Some(1.0));
    let hits = r#"pgsluice_rule_hits_total{action="THROTTLE",outcome="refused"}"#;
    assert_eq!(sample(&after, hits), Some(1.0));
    let opened = r#"pgsluice_breaker_transitions_total{to="open"}"#;
    assert_eq!(sample(&after, opened), Some(1.0), "observer wired");
    assert_eq!(sample(&after, "pgsluice_breaker_state"), Some(2.0));
    let trips = r#"pgsluice_breaker_trips_total{reason="consecutive_errors"}"#;
    assert_eq!(sample(&after, trips), Some(1.0));
    assert_eq!(sample(&after, "pgsluice_rules"), Some(1.0));
    assert_eq!(sample(&after, "pgsluice_fingerprints_tracked"), Some(0.0));
    for secret in [W, R] {
        assert!(!after.contains(secret));
    }
    // No fingerprint ever becomes a label.
    assert!(!after.contains("fingerprint="));
}

#[test]
fn every_policy_refusal_reason_is_pre_resolved() {
    for kind in RefusalKind::ALL {
        assert!(KNOWN_REASONS.contains(&kind.reason()), "{}", kind.reason());
    }
}

#[tokio::test]
async fn callers_pools_breaker() {
    let mut c = config(None);
    c.callers = serde_yaml::from_str("- name: payments\n  max_concurrency: 7\n").expect("yaml");
    let r = api(&app_with(c));
    let callers = get(&r, "/v1/callers", Some(R)).await.json();
    let names: Vec<&str> = callers["callers"]
        .as_array()
        .map(|a| a.iter().filter_map(|c| c["name"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(names, vec!["payments", "default"]);
    assert_eq!(callers["callers"][0]["max_concurrency"], 7);
    assert!(callers["callers"][0]["refusals"]["rate_limited"].is_u64());
    assert_eq!(
        get(&r, "/v1/pools", Some(R)).await.json(),
        json!({"pools": [], "caps": []})
    );
    let b = get(&r, "/v1/breaker", Some(R)).await.json();
    assert_eq!(b["state"], "closed");
    assert!(b["config"]["open_ms"].is_u64());
}

#[tokio::test]
async fn reload_runs_the_hook() {
    let app = app_with(config(None));
    let r = api(&app);
    let resp = call(&r, "POST", "/v1/reload", Some(W), None).await;
    assert_eq!(resp.status, StatusCode::SERVICE_UNAVAILABLE);

    let fail = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = fail.clone();
    let hook: Reloader = Arc::new(move || {
        if flag.load(std::sync::atomic::Ordering::SeqCst) {
            Err(vec![
                "callers[0].max_concurrency: must be at least 1 (line 3)".into(),
            ])
        } else {
            Ok(())
        }
    });
    assert!(app.reloader.set(hook).is_ok());
    let ok = call(&r, "POST", "/v1/reload", Some(W), None).await;
    assert_eq!(
        (ok.status, ok.json()),
        (StatusCode::OK, json!({"reloaded": true}))
    );
    let with_body = call(
        &r,
        "POST",
        "/v1/reload",
        Some(W),
        Some(("application/json", b"{}".to_vec())),
    )
    .await;
    assert_eq!(with_body.status, StatusCode::OK);
    fail.store(true, std::sync::atomic::Ordering::SeqCst);
    let bad = call(&r, "POST", "/v1/reload", Some(W), None).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    let v = bad.json();
    assert_eq!(v["error"], "invalid config");
    assert!(
        v["errors"][0]
            .as_str()
            .is_some_and(|e| e.contains("max_concurrency"))
    );
    assert_eq!(
        get(&r, "/v1/reload", Some(W)).await.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
}

#[tokio::test]
async fn openapi_document_covers_every_route() {
    let r = api(&app_with(config(None)));
    let resp = get(&r, "/v1/openapi.json", None).await;
    assert_eq!(resp.status, StatusCode::OK);
    let doc = resp.json();
    assert!(
        doc["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.0"))
    );
    assert!(doc["components"]["securitySchemes"]["bearer"].is_object());
    let routes = [
        ("/healthz", "get"),
        ("/readyz", "get"),
        ("/v1/openapi.json", "get"),
        ("/metrics", "get"),
        ("/v1/rules", "get"),
        ("/v1/rules/fingerprint", "post"),
        ("/v1/rules/fingerprint/{hash}", "get"),
        ("/v1/rules/fingerprint/{hash}", "put"),
        ("/v1/rules/fingerprint/{hash}", "delete"),
        ("/v1/rules/preview", "post"),
        ("/v1/fingerprints", "get"),
        ("/v1/anomalies", "get"),
        ("/v1/callers", "get"),
        ("/v1/pools", "get"),
        ("/v1/breaker", "get"),
        ("/v1/fleet", "get"),
        ("/v1/reload", "post"),
        ("/v1/clients", "get"),
        ("/v1/clients/{id}", "delete"),
        ("/v1/clients/{id}/cancel", "post"),
        ("/v1/servers", "get"),
        ("/v1/pools/{db}/{user}/pause", "post"),
        ("/v1/pools/{db}/{user}/resume", "post"),
        ("/v1/pools/{db}/{user}/reconnect", "post"),
        ("/v1/databases/{db}/disable", "post"),
        ("/v1/databases/{db}/enable", "post"),
    ];
    let paths = doc["paths"].as_object().cloned().unwrap_or_default();
    for (path, method) in routes {
        assert!(
            paths.get(path).is_some_and(|p| p.get(method).is_some()),
            "{method} {path}"
        );
    }
    let documented: usize = paths
        .values()
        .map(|p| {
            p.as_object()
                .map_or(0, |o| o.keys().filter(|k| *k != "parameters").count())
        })
        .sum();
    assert_eq!(documented, routes.len(), "undocumented extra operations");
    // Every $ref resolves.
    let text = resp.text();
    for part in text.split("\"$ref\": \"#/").skip(1) {
        let target = part.split('"').next().unwrap_or_default();
        let mut node = &doc;
        for seg in target.split('/') {
            node = &node[seg];
        }
        assert!(!node.is_null(), "dangling $ref {target}");
    }
}

const CONTROL_YAML: &str = "\
admin:
  write_token: control-write
";

/// An admin request with the write token (reads accept it too): (status, JSON body).
async fn control(
    proxy: &Proxy,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, serde_json::Value) {
    let (status, text) = proxy
        .admin_request(method, path, "control-write", body)
        .await;
    let v = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    (status, v)
}

/// Backend pids of the app user, from Postgres itself.
async fn app_backends(db: &Client) -> Vec<i32> {
    let rows = db
        .query(
            "SELECT pid FROM pg_stat_activity WHERE usename = $1 AND datname = $2",
            &[&APP_USER, &APP_DB],
        )
        .await
        .expect("pg_stat_activity");
    rows.iter().map(|r| r.get::<_, i32>(0)).collect()
}

/// The client record whose latest statement runs on `pid`.
async fn client_on(proxy: &Proxy, pid: i32) -> Option<serde_json::Value> {
    let (status, v) = control(proxy, "GET", "/v1/clients", None).await;
    assert_eq!(status, 200, "{v}");
    v["clients"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["backend_pid"] == pid).cloned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incident_controls_pause_resume_reconnect_list_kill_and_disable() {
    let Some(env) = start(4, CONTROL_YAML) else {
        return;
    };
    let proxy = &env.proxy;
    let db = env.cluster.superuser_client(APP_DB).await;
    let pool = format!("/v1/pools/{APP_DB}/{APP_USER}");
    let (status, v) = control(proxy, "POST", "/v1/pools/nodb/nouser/pause", None).await;
    assert_eq!(status, 404, "{v}");

    // Pause with 20 clients running transactions: those in flight finish, new ones wait,
    // the resume releases them, and not one transaction is lost.
    const CLIENTS: usize = 20;
    const EACH: usize = 10;
    let mut workers = Vec::new();
    for _ in 0..CLIENTS {
        let c = client(proxy, "web").await;
        workers.push(tokio::spawn(async move {
            for _ in 0..EACH {
                c.batch_execute(
                    "BEGIN; UPDATE acct SET v = v + 1 WHERE id = 1; SELECT pg_sleep(0.02); COMMIT",
                )
                .await?;
            }
            Ok::<_, tokio_postgres::Error>(())
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, v) = control(
        proxy,
        "POST",
        &format!("{pool}/pause"),
        Some(r#"{"hold_ms": 20000, "wait_ms": 10000}"#),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["paused"].as_bool(), v["drained"].as_bool()),
        (Some(true), Some(true)),
        "{v}"
    );
    let busy: i64 = db
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = $1 AND state <> 'idle'",
            &[&APP_USER],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(busy, 0, "no transaction runs while paused");
    let at_pause = scalar(&db, "SELECT v FROM acct WHERE id = 1").await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        scalar(&db, "SELECT v FROM acct WHERE id = 1").await,
        at_pause,
        "nothing committed while paused"
    );
    let (_, clients) = control(proxy, "GET", "/v1/clients", None).await;
    let waiting = clients["clients"]
        .as_array()
        .map_or(0, |c| c.iter().filter(|c| c["state"] == "waiting").count());
    assert!(waiting > 0, "held clients show as waiting: {clients}");
    let (_, pools) = control(proxy, "GET", "/v1/pools", None).await;
    assert_eq!(pools["pools"][0]["paused"], true, "{pools}");
    let (status, v) = control(proxy, "POST", &format!("{pool}/resume"), None).await;
    assert_eq!((status, v["paused"].as_bool()), (200, Some(false)), "{v}");
    for w in workers {
        within(STEP, "a worker after the resume", w)
            .await
            .expect("join")
            .expect("every transaction of every client succeeds");
    }
    assert_eq!(
        scalar(&db, "SELECT v FROM acct WHERE id = 1").await,
        (CLIENTS * EACH).to_string(),
        "none lost"
    );

    // Reconnect replaces every backend: the idle ones at once, one in a transaction when it
    // commits.
    let holder = client(proxy, "web").await;
    holder
        .batch_execute("BEGIN; SELECT 1")
        .await
        .expect("BEGIN");
    let before = app_backends(&db).await;
    assert!(!before.is_empty());
    let (status, v) = control(proxy, "POST", &format!("{pool}/reconnect"), None).await;
    assert_eq!((status, v["in_use"].as_u64()), (200, Some(1)), "{v}");
    holder.batch_execute("COMMIT").await.expect("COMMIT");
    let worker = client(proxy, "web").await;
    for _ in 0..8 {
        scalar(&worker, "SELECT 1").await;
    }
    eventually(STEP, "every backend replaced", || async {
        let after = app_backends(&db).await;
        !after.is_empty() && after.iter().all(|p| !before.contains(p))
    })
    .await;

    // The client list shows a running statement, and DELETE ends it: the client gets 57P01
    // and the statement stops on the server.
    let sleeper = client(proxy, "web").await;
    let running = tokio::spawn({
        let s = sleeper.clone();
        async move { s.simple_query("SELECT pg_sleep(30)").await }
    });
    eventually(STEP, "pg_sleep running", || async {
        sleeping(&env.cluster).await != 0
    })
    .await;
    let pids: Vec<i32> = db
        .query(
            "SELECT pid FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(30)%'",
            &[],
        )
        .await
        .expect("pids")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let row = client_on(proxy, pids[0])
        .await
        .expect("the sleeper is listed with its backend");
    assert_eq!(row["state"], "active", "{row}");
    assert_eq!(row["caller"], "default", "{row}");
    assert_eq!(row["user"], APP_USER, "{row}");
    assert!(
        row["fingerprint"].as_str().is_some_and(|f| f.len() == 16),
        "{row}"
    );
    let (_, servers) = control(proxy, "GET", "/v1/servers", None).await;
    assert!(
        servers["servers"].as_array().is_some_and(|s| s
            .iter()
            .any(|s| s["pid"] == pids[0] && s["client"] == row["id"])),
        "{servers}"
    );
    let id = row["id"].as_u64().expect("id");
    let t = Instant::now();
    let (status, v) = control(proxy, "DELETE", &format!("/v1/clients/{id}"), None).await;
    assert_eq!(status, 200, "{v}");
    let err = within(STEP, "the killed statement", running)
        .await
        .expect("join")
        .expect_err("the session is ended");
    assert_eq!(sqlstate(&err), "57P01", "{err:?}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    eventually(STEP, "the statement stops on the server", || async {
        sleeping(&env.cluster).await == 0
    })
    .await;
    let (status, _) = control(proxy, "DELETE", &format!("/v1/clients/{id}"), None).await;
    assert_eq!(status, 404);

    // Cancel only the statement: the session goes on.
    let other = client(proxy, "web").await;
    let running = tokio::spawn({
        let s = other.clone();
        async move { s.simple_query("SELECT pg_sleep(30)").await }
    });
    eventually(STEP, "pg_sleep running again", || async {
        sleeping(&env.cluster).await != 0
    })
    .await;
    let pid: i32 = db
        .query_one(
            "SELECT pid FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(30)%'",
            &[],
        )
        .await
        .expect("pid")
        .get(0);
    let row = client_on(proxy, pid).await.expect("listed");
    let (status, v) = control(
        proxy,
        "POST",
        &format!("/v1/clients/{}/cancel", row["id"]),
        None,
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let err = within(STEP, "the cancelled statement", running)
        .await
        .expect("join")
        .expect_err("cancelled");
    assert_eq!(sqlstate(&err), "57014", "{err:?}");
    assert_eq!(scalar(&other, "SELECT 2").await, "2", "the session goes on");

    // Disable refuses new logins to the database (57P03); open sessions go on; enable.
    let (status, v) = control(
        proxy,
        "POST",
        &format!("/v1/databases/{APP_DB}/disable"),
        None,
    )
    .await;
    assert_eq!((status, v["enabled"].as_bool()), (200, Some(false)), "{v}");
    let refused = proxy
        .try_client_with(&proxy.app_config())
        .await
        .map(|_| ())
        .expect_err("disabled");
    assert_eq!(sqlstate(&refused), "57P03", "{refused:?}");
    assert_eq!(scalar(&other, "SELECT 3").await, "3");
    let (status, _) = control(
        proxy,
        "POST",
        &format!("/v1/databases/{APP_DB}/enable"),
        None,
    )
    .await;
    assert_eq!(status, 200);
    let again = client(proxy, "web").await;
    assert_eq!(scalar(&again, "SELECT 4").await, "4");
    proxy.assert_healthy().await;
}
