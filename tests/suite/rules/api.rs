//! The rules and fingerprints endpoints of the admin API, in process
//! (`crate::support::admin_api`: `router_with_env` with `tower::ServiceExt::oneshot`, no
//! socket): a bad rule body names the field, PUT/GET/list/DELETE, GET never mutates, rules
//! persist and load into a new app, a failed write applies nothing, TTL rules expire and leave
//! the file, the fingerprints endpoint validates and sorts, unseen fingerprints get a warning
//! and rules come from SQL, and with classification off every rule is warned about.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::{StatusCode, header};
use serde_json::{Value, json};

use pgsluice::app::App;
use pgsluice::observe::stats::Outcome;
use pgsluice::policy::rules::RuleSet;

use crate::support::admin_api::{
    FP, R, Resp, W, api, app_with, call, config, get, put_rule, throttle,
};

fn assert_error(resp: &Resp, status: StatusCode, field: &str) {
    assert_eq!(resp.status, status, "{}", resp.text());
    let v = resp.json();
    assert_eq!(v["field"], field, "{v}");
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
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

#[tokio::test]
async fn fingerprints_endpoint_validates_and_sorts() {
    let app = app_with(config(None));
    let r = api(&app);
    let slow: Arc<str> = Arc::from("select * from t where id = $1");
    let fast: Arc<str> = Arc::from("select 1");
    for _ in 0..3 {
        let ok = Outcome::Ok { rows: 1 };
        app.fp_stats.record(
            1,
            &fast,
            "read",
            &"app".into(),
            Duration::from_micros(10),
            ok,
        );
    }
    let ok = Outcome::Ok { rows: 5 };
    app.fp_stats.record(
        2,
        &slow,
        "read",
        &"app".into(),
        Duration::from_millis(50),
        ok,
    );

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
        &"app".into(),
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
