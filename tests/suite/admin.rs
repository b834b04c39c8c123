//! Admin HTTP API: authentication and authorization, rule validation and persistence, read
//! endpoints, `/metrics` (checked with `promtool`), reload and the OpenAPI document.
//!
//! Everything runs through `router_with_env(app, …)` with `tower::ServiceExt::oneshot`, no
//! socket. `promtool` (Debian package `prometheus`) must be installed: the metrics test
//! fails, rather than skips, without it.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode, header};
use serde_json::{Value, json};
use tower::ServiceExt;

use pgsluice::admin::auth::EnvTokens;
use pgsluice::admin::router_with_env;
use pgsluice::app::{App, Reloader};
use pgsluice::config::Config;
use pgsluice::observe::metrics::KNOWN_REASONS;
use pgsluice::observe::stats::Outcome;
use pgsluice::policy::RefusalKind;
use pgsluice::policy::rules::RuleSet;

const W: &str = "write-secret-token";
const R: &str = "read-secret-token";
const FP: &str = "00000000deadbeef";

fn config(rules_file: Option<&Path>) -> Config {
    let mut c = Config::default();
    c.admin.write_token = Some(W.into());
    c.admin.read_token = Some(R.into());
    c.admin.rules_file = rules_file.map(|p| p.display().to_string());
    c
}

fn app_with(c: Config) -> Arc<App> {
    App::new(c, Arc::new(RuleSet::new())).expect("app")
}

fn api(app: &Arc<App>) -> Router {
    router_with_env(app.clone(), EnvTokens::default())
}

struct Resp {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

async fn call(
    r: &Router,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<(&str, Vec<u8>)>,
) -> Resp {
    let mut b = Request::builder().method(method).uri(path);
    if let Some(t) = token {
        b = b.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let req = match body {
        Some((ctype, bytes)) => b
            .header(header::CONTENT_TYPE, ctype)
            .header(header::CONTENT_LENGTH, bytes.len())
            .body(Body::from(bytes)),
        None => b.body(Body::empty()),
    }
    .expect("request");
    let resp = r.clone().oneshot(req).await.expect("infallible");
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = axum::body::to_bytes(resp.into_body(), 64 << 20)
        .await
        .expect("body");
    Resp {
        status,
        headers,
        body,
    }
}

async fn get(r: &Router, path: &str, token: Option<&str>) -> Resp {
    call(r, "GET", path, token, None).await
}

async fn put_rule(r: &Router, fp: &str, token: Option<&str>, rule: &Value) -> Resp {
    let body = serde_json::to_vec(rule).expect("json");
    call(
        r,
        "PUT",
        &format!("/v1/rules/fingerprint/{fp}"),
        token,
        Some(("application/json", body)),
    )
    .await
}

fn throttle() -> Value {
    json!({"action":"THROTTLE","max_qps":2,"action_on_exceed":"REJECT",
           "error_message":"Query pattern is throttled due to high read amplification",
           "ttl_seconds":3600})
}

fn assert_error(resp: &Resp, status: StatusCode, field: &str) {
    assert_eq!(resp.status, status, "{}", resp.text());
    let v = resp.json();
    assert_eq!(v["field"], field, "{v}");
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
}

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

#[tokio::test]
async fn bad_rule_bodies_name_the_field() {
    let app = app_with(config(None));
    let r = api(&app);
    let cases = [
        (json!({"action":"THROTTLE","max_qps":-1}), "max_qps"),
        (json!({"action":"THROTTLE","max_qps":0}), "max_qps"),
        (json!({"action":"THROTTLE","max_qps":1e300}), "max_qps"),
        (json!({"action":"THROTTLE","max_qps":"2"}), "max_qps"),
        (json!({"action":"THROTTLE"}), "max_qps"),
        (json!({"action":"EXPLODE"}), "action"),
        (json!({"action":"REJECT","max_qps":2}), "max_qps"),
        (json!({"action":"REJECT","colour":"red"}), "colour"),
        (
            json!({"action":"CONCURRENCY","max_inflight":0}),
            "max_inflight",
        ),
        (json!({"action":"REJECT","ttl_seconds":0}), "ttl_seconds"),
        (json!({"action":"REJECT","mode":"loud"}), "mode"),
        (json!(["REJECT"]), "body"),
    ];
    for (body, field) in cases {
        let resp = put_rule(&r, FP, Some(W), &body).await;
        assert_error(&resp, StatusCode::BAD_REQUEST, field);
        assert_eq!(resp.json()["error"], "invalid rule", "{body}");
    }
    let path = format!("/v1/rules/fingerprint/{FP}");
    let bad_json = call(
        &r,
        "PUT",
        &path,
        Some(W),
        Some(("application/json", b"{".to_vec())),
    )
    .await;
    assert_error(&bad_json, StatusCode::BAD_REQUEST, "body");

    let mut huge = br#"{"action":"REJECT","note":""#.to_vec();
    huge.resize(10 * 1024 * 1024, b'x');
    huge.extend_from_slice(br#""}"#);
    let resp = call(&r, "PUT", &path, Some(W), Some(("application/json", huge))).await;
    assert_error(&resp, StatusCode::PAYLOAD_TOO_LARGE, "body");
    assert!(resp.text().contains("65536"), "{}", resp.text());

    let body = br#"{"action":"REJECT"}"#.to_vec();
    let resp = call(
        &r,
        "PUT",
        &path,
        Some(W),
        Some(("text/plain", body.clone())),
    )
    .await;
    assert_error(&resp, StatusCode::UNSUPPORTED_MEDIA_TYPE, "content-type");
    let form = "application/x-www-form-urlencoded";
    let resp = call(
        &r,
        "POST",
        "/v1/reload",
        Some(W),
        Some((form, body.clone())),
    )
    .await;
    assert_eq!(resp.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let resp = call(&r, "DELETE", &path, Some(W), Some(("text/plain", body))).await;
    assert_eq!(resp.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);

    for bad in [
        "deadbeef",
        "00000000deadbeeg",
        "00000000deadbeef0",
        "%2e%2e",
    ] {
        let resp = put_rule(&r, bad, Some(W), &throttle()).await;
        assert_error(&resp, StatusCode::BAD_REQUEST, "hash");
    }
    assert!(app.policy.rules().is_empty(), "nothing applied");
}

#[tokio::test]
async fn put_get_list_delete() {
    let app = app_with(config(None));
    let r = api(&app);
    let path = format!("/v1/rules/fingerprint/{FP}");
    let created = put_rule(&r, FP, Some(W), &throttle()).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    let v = created.json();
    assert_eq!(v["fingerprint"], FP);
    assert_eq!(v["action"], "THROTTLE");
    assert_eq!(v["burst"], 2);
    assert_eq!(v["persisted"], false);
    assert!(v["expires_in_ms"].as_u64().is_some_and(|ms| ms > 3_500_000));

    // Upper-case hex is the same fingerprint; a second PUT replaces.
    let replaced = put_rule(&r, &FP.to_uppercase(), Some(W), &json!({"action":"REJECT"})).await;
    assert_eq!(replaced.status, StatusCode::OK);

    let one = get(&r, &path, Some(R)).await;
    assert_eq!(one.status, StatusCode::OK);
    assert_eq!(one.json()["action"], "REJECT");
    let list = get(&r, "/v1/rules", Some(R)).await.json();
    let rules = list["rules"].as_array().cloned().unwrap_or_default();
    assert_eq!(rules.len(), 1);
    for k in [
        "hits",
        "refusals",
        "warned",
        "expires_in_ms",
        "created_unix_ms",
    ] {
        assert!(rules[0].get(k).is_some(), "{k} missing: {list}");
    }

    let del = call(&r, "DELETE", &path, Some(W), None).await;
    assert_eq!(del.status, StatusCode::OK);
    assert_eq!(del.json()["deleted"], FP);
    assert_eq!(get(&r, &path, Some(R)).await.status, StatusCode::NOT_FOUND);
    let again = call(&r, "DELETE", &path, Some(W), None).await;
    assert_eq!(again.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn get_never_mutates() {
    let app = app_with(config(None));
    let r = api(&app);
    let resp = get(
        &r,
        &format!("/v1/rules/fingerprint/{FP}?action=REJECT"),
        Some(W),
    )
    .await;
    assert_error(&resp, StatusCode::BAD_REQUEST, "query");
    let resp = get(&r, "/v1/rules?delete=all", Some(W)).await;
    assert_error(&resp, StatusCode::BAD_REQUEST, "query");
    assert!(app.policy.rules().is_empty());
    let wrong = call(&r, "POST", "/v1/rules", Some(W), None).await;
    assert_eq!(wrong.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(wrong.json()["error"], "method not allowed");
    let missing = get(&r, "/v1/nothing", Some(R)).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn rules_persist_and_load_into_a_new_app() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("rules.json");
    let app = app_with(config(Some(&file)));
    let r = api(&app);
    let resp = put_rule(&r, FP, Some(W), &throttle()).await;
    assert_eq!(resp.status, StatusCode::CREATED);
    assert_eq!(resp.json()["persisted"], true);
    let other = "0123456789abcdef";
    let rule = json!({"action":"CONCURRENCY","max_inflight":3,"callers":["app"]});
    assert_eq!(
        put_rule(&r, other, Some(W), &rule).await.status,
        StatusCode::CREATED
    );

    let bytes = std::fs::read(&file).expect("rules file written");
    let loaded = Arc::new(RuleSet::from_json_bytes(&bytes).expect("loads"));
    let restarted = App::new(config(Some(&file)), loaded).expect("app");
    let r2 = api(&restarted);
    let list = get(&r2, "/v1/rules", Some(R)).await.json();
    let fps: Vec<&str> = list["rules"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x["fingerprint"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(fps, vec![FP, other]);
    let t = get(&r2, &format!("/v1/rules/fingerprint/{FP}"), Some(R))
        .await
        .json();
    assert_eq!(t["max_qps"], 2.0);
    assert!(
        t["expires_in_ms"].as_u64().is_some_and(|ms| ms > 3_500_000),
        "{t}"
    );

    let del = call(
        &r,
        "DELETE",
        &format!("/v1/rules/fingerprint/{FP}"),
        Some(W),
        None,
    )
    .await;
    assert_eq!(del.status, StatusCode::OK);
    let after = RuleSet::from_json_bytes(&std::fs::read(&file).expect("read")).expect("loads");
    assert_eq!(after.len(), 1);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .expect("dir")
        .filter_map(Result::ok)
        .map(|e| e.file_name())
        .collect();
    assert_eq!(leftovers, vec![std::ffi::OsString::from("rules.json")]);
}

#[tokio::test]
async fn a_failed_write_applies_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = dir.path().join("rules.json");
    let app = app_with(config(Some(&good)));
    let r = api(&app);
    assert_eq!(
        put_rule(&r, FP, Some(W), &throttle()).await.status,
        StatusCode::CREATED
    );

    let unwritable = dir.path().join("missing-dir").join("rules.json");
    app.reload(config(Some(&unwritable))).expect("reload");
    let other = "0123456789abcdef";
    let resp = put_rule(&r, other, Some(W), &json!({"action":"REJECT"})).await;
    assert_eq!(
        resp.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{}",
        resp.text()
    );
    assert!(!resp.text().contains(W));
    let path = format!("/v1/rules/fingerprint/{other}");
    assert_eq!(get(&r, &path, Some(R)).await.status, StatusCode::NOT_FOUND);

    let replace = put_rule(&r, FP, Some(W), &json!({"action":"REJECT"})).await;
    assert_eq!(replace.status, StatusCode::INTERNAL_SERVER_ERROR);
    let del = call(
        &r,
        "DELETE",
        &format!("/v1/rules/fingerprint/{FP}"),
        Some(W),
        None,
    )
    .await;
    assert_eq!(del.status, StatusCode::INTERNAL_SERVER_ERROR);
    let kept = get(&r, &format!("/v1/rules/fingerprint/{FP}"), Some(R)).await;
    assert_eq!(kept.status, StatusCode::OK);
    assert_eq!(kept.json()["action"], "THROTTLE", "old rule untouched");
}

#[tokio::test]
async fn ttl_rules_expire_and_leave_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("rules.json");
    let app = app_with(config(Some(&file)));
    let r = api(&app);
    let rule = json!({"action":"REJECT","ttl_seconds":1});
    assert_eq!(
        put_rule(&r, FP, Some(W), &rule).await.status,
        StatusCode::CREATED
    );
    let path = format!("/v1/rules/fingerprint/{FP}");
    assert_eq!(get(&r, &path, Some(R)).await.status, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(get(&r, &path, Some(R)).await.status, StatusCode::NOT_FOUND);
    let list = get(&r, "/v1/rules", Some(R)).await.json();
    assert_eq!(list["rules"], json!([]));
    // The purge (every 2 s) removes it from memory and rewrites the file.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(&file).expect("read");
        if !text.contains(FP) && app.policy.rules().is_empty() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "not purged: {text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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
async fn fingerprints_endpoint_validates_and_sorts() {
    let app = app_with(config(None));
    let r = api(&app);
    let slow: Arc<str> = Arc::from("select * from t where id = $1");
    let fast: Arc<str> = Arc::from("select 1");
    for _ in 0..3 {
        let ok = Outcome::Ok { rows: 1 };
        app.fp_stats
            .record(1, &fast, "read", "app", Duration::from_micros(10), ok);
    }
    let ok = Outcome::Ok { rows: 5 };
    app.fp_stats
        .record(2, &slow, "read", "app", Duration::from_millis(50), ok);

    let v = get(&r, "/v1/fingerprints", Some(R)).await.json();
    assert_eq!(
        (v["sort"].clone(), v["limit"].clone()),
        (json!("total_time"), json!(50))
    );
    assert_eq!(v["tracked"], 2);
    assert_eq!(v["fingerprints"][0]["fingerprint"], "0000000000000002");
    let v = get(
        &r,
        "/v1/fingerprints?sort=calls&limit=1&caller=app",
        Some(R),
    )
    .await
    .json();
    let rows = v["fingerprints"].as_array().cloned().unwrap_or_default();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["fingerprint"], "0000000000000001");
    assert_eq!(rows[0]["normalized"], "select 1");
    let none = get(&r, "/v1/fingerprints?caller=nobody", Some(R))
        .await
        .json();
    assert_eq!(none["fingerprints"], json!([]));

    for (q, field) in [
        ("sort=speed", "sort"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=ten", "limit"),
        ("order=desc", "query"),
    ] {
        let resp = get(&r, &format!("/v1/fingerprints?{q}"), Some(R)).await;
        assert_error(&resp, StatusCode::BAD_REQUEST, field);
    }
}

async fn post_sql(r: &Router, token: Option<&str>, body: &Value) -> Resp {
    let body = serde_json::to_vec(body).expect("json");
    call(
        r,
        "POST",
        "/v1/rules/fingerprint",
        token,
        Some(("application/json", body)),
    )
    .await
}

#[tokio::test]
async fn unseen_fingerprints_get_a_warning_and_rules_come_from_sql() {
    let app = app_with(config(None));
    let r = api(&app);
    // Never seen: 201, kept, with a warning naming the hash.
    let resp = put_rule(&r, FP, Some(W), &throttle()).await;
    assert_eq!(resp.status, StatusCode::CREATED, "{}", resp.text());
    let v = resp.json();
    assert!(v["warning"].as_str().is_some_and(|w| w.contains(FP)), "{v}");
    assert!(app.policy.rules().get(0xdead_beef).is_some());
    // Replaced, still unseen: 200 and the warning again.
    let resp = put_rule(&r, FP, Some(W), &throttle()).await;
    assert_eq!(resp.status, StatusCode::OK);
    assert!(resp.json()["warning"].is_string());
    // Seen (a statement with it ended): no warning, status as before.
    let text: Arc<str> = Arc::from("select 1");
    let ok = Outcome::Ok { rows: 1 };
    app.fp_stats.record(
        0xdead_beef,
        &text,
        "read",
        "app",
        Duration::from_micros(5),
        ok,
    );
    let resp = put_rule(&r, FP, Some(W), &throttle()).await;
    assert_eq!(resp.status, StatusCode::OK);
    assert!(resp.json().get("warning").is_none(), "{}", resp.text());

    // From SQL: stored under the proxy's own fingerprint of the text.
    let sql = "SELECT * FROM users WHERE id = 1204 AND status = 'active'";
    let fp = app.classifier.classify(sql).fingerprint;
    let hex = format!("{fp:016x}");
    let mut body = throttle();
    body["sql"] = json!(sql);
    let resp = post_sql(&r, Some(W), &body).await;
    assert_eq!(resp.status, StatusCode::CREATED, "{}", resp.text());
    assert_eq!(
        resp.headers[header::LOCATION],
        format!("/v1/rules/fingerprint/{hex}")
    );
    let v = resp.json();
    assert_eq!(v["fingerprint"], hex.as_str());
    assert_eq!(
        v["normalized"],
        "SELECT * FROM users WHERE id = ? AND status = ?"
    );
    assert_eq!(v["max_qps"], 2.0);
    assert!(v["warning"].is_string(), "{v}");
    let rule = app.policy.rules().get(fp).expect("live");
    assert_eq!(rule.def().action.name(), "THROTTLE");
    // Other literals name the same rule: 200.
    body["sql"] = json!("select * from users where id=7 and status='x' /*service:a*/");
    let resp = post_sql(&r, Some(W), &body).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    assert_eq!(app.policy.rules().len(), 2);

    // Field-level 400s, nothing stored; writes need the write token.
    let mut bad_rule = throttle();
    bad_rule["sql"] = json!("SELECT 2");
    bad_rule["max_qps"] = json!(-1);
    for (b, field) in [
        (json!({"action": "REJECT"}), "sql"),
        (json!({"sql": 5, "action": "REJECT"}), "sql"),
        (json!({"sql": "", "action": "REJECT"}), "sql"),
        (
            json!({"sql": "-- only a comment", "action": "REJECT"}),
            "sql",
        ),
        (json!({"sql": "SELECT 2"}), "action"),
        (bad_rule, "max_qps"),
    ] {
        assert_error(
            &post_sql(&r, Some(W), &b).await,
            StatusCode::BAD_REQUEST,
            field,
        );
    }
    let mut with_sql = throttle();
    with_sql["sql"] = json!("SELECT 2");
    assert_error(
        &put_rule(&r, "00000000000000aa", Some(W), &with_sql).await,
        StatusCode::BAD_REQUEST,
        "sql",
    );
    assert_eq!(
        post_sql(&r, Some(R), &body).await.status,
        StatusCode::FORBIDDEN
    );
    assert_eq!(app.policy.rules().len(), 2);
}

#[tokio::test]
async fn with_classification_off_every_rule_is_warned_about() {
    let mut c = config(None);
    c.classify.enabled = false;
    let r = api(&app_with(c));
    let resp = put_rule(&r, FP, Some(W), &throttle()).await;
    assert_eq!(resp.status, StatusCode::CREATED);
    let v = resp.json();
    assert!(
        v["warning"]
            .as_str()
            .is_some_and(|w| w.contains("classify.enabled")),
        "{v}"
    );
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
