//! `POST /v1/rules/preview` and `pgsluice rules preview`:
//!
//! * in process (`crate::support::admin_api`): the body is validated as a PUT's is (the same
//!   field errors), read access is enough, nothing changes, and a rule that touches a
//!   `critical` caller lists it (one limited to other callers does not);
//! * against a real PostgreSQL through the spawned proxy: a steady workload runs one pattern
//!   at a known rate, the preview of a THROTTLE predicts its refusals per second, the rule is
//!   PUT, and the refusals the clients then see per second match the prediction within 20 %.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use serde_json::{Value, json};

use pgsluice::config::Config;
use pgsluice::observe::stats::Outcome;

use super::{W as PROXY_W, admin, offline_fingerprint, pgsluice, run};
use crate::support::admin_api::{FP, R, Resp, W, api, app_with, call, put_rule};
use crate::support::env::Env;
use crate::support::policy::connect;
use crate::support::proxy::ADMIN_READ_TOKEN;
use crate::support::sql::sqlstate;
use crate::support::{direct_mode, note_skipped};

const CALLERS: &str = "callers:\n  \
    - { name: pay, match: { application_name: pay }, priority: critical }\n  \
    - { name: web, match: { application_name: web } }\n";

async fn preview(r: &Router, token: Option<&str>, body: &Value) -> Resp {
    let bytes = serde_json::to_vec(body).expect("json");
    call(
        r,
        "POST",
        "/v1/rules/preview",
        token,
        Some(("application/json", bytes)),
    )
    .await
}

/// `rule` with `"fingerprint": FP` added.
fn at_fp(mut rule: Value) -> Value {
    rule["fingerprint"] = json!(FP);
    rule
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

#[tokio::test]
async fn a_preview_names_the_critical_callers_it_touches_and_changes_nothing() {
    let mut c = Config::from_yaml(CALLERS).expect("config");
    c.admin.write_token = Some(W.into());
    c.admin.read_token = Some(R.into());
    let app = app_with(c);
    let r = api(&app);
    // The pattern: 60 calls of web and 30 of pay, just now, 2 ms each.
    let text: Arc<str> = Arc::from("SELECT * FROM t WHERE id = ?");
    for (caller, n) in [("web", 60), ("pay", 30)] {
        let name: Arc<str> = Arc::from(caller);
        for _ in 0..n {
            app.fp_stats.record(
                0xdead_beef,
                &text,
                "read",
                &name,
                Duration::from_millis(2),
                Outcome::Ok { rows: 1 },
            );
        }
    }

    // The read token is enough.
    let resp = preview(&r, Some(R), &at_fp(json!({"action": "REJECT"}))).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    let v = resp.json();
    assert_eq!(v["fingerprint"], FP, "{v}");
    assert_eq!(v["tracked"], true, "{v}");
    assert_eq!(v["normalized"], "SELECT * FROM t WHERE id = ?", "{v}");
    assert_eq!(v["basis"]["rate_window_ms"], 10_000, "{v}");
    let matched = f(&v["matched"]["calls_per_s"]);
    assert!(matched > 0.0, "{v}");
    assert_eq!(f(&v["effect"]["refused_per_s"]), matched, "REJECT: all");
    let callers: Vec<&str> = v["matched"]["callers"]
        .as_array()
        .map(|l| l.iter().filter_map(|c| c["caller"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(callers, ["web", "pay"], "busiest first: {v}");
    assert!((f(&v["matched"]["mean_ms"]) - 2.0).abs() < 0.01, "{v}");
    let critical = v["critical_callers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(critical.len(), 1, "{v}");
    assert_eq!(critical[0]["caller"], "pay", "{v}");
    assert!(f(&critical[0]["refused_per_s"]) > 0.0, "{v}");
    let warned = v["warnings"].as_array().is_some_and(|w| {
        w.iter().any(|w| {
            w.as_str()
                .is_some_and(|w| w.contains("critical caller pay"))
        })
    });
    assert!(warned, "a clear warning names the critical caller: {v}");

    // Limited to web: pay is untouched, and nothing warns about it.
    let only_web = at_fp(json!({"action": "THROTTLE", "max_qps": 1, "callers": ["web"]}));
    let v = preview(&r, Some(W), &only_web).await.json();
    assert_eq!(v["critical_callers"], json!([]), "{v}");
    assert!(!v.to_string().contains("critical caller"), "{v}");
    assert_eq!(v["matched"]["callers"][0]["caller"], "web", "{v}");
    assert_eq!(v["matched"]["callers"].as_array().map(Vec::len), Some(1));

    // Validated exactly like a PUT: the same field errors, and nothing is stored.
    for (rule, field) in [
        (json!({"action": "THROTTLE", "max_qps": -1}), "max_qps"),
        (json!({"action": "THROTTLE"}), "max_qps"),
        (json!({"action": "EXPLODE"}), "action"),
        (json!({"action": "REJECT", "max_qps": 2}), "max_qps"),
        (json!({"action": "REJECT", "colour": "red"}), "colour"),
        (json!({"action": "REJECT", "mode": "loud"}), "mode"),
        (
            json!({"action": "REJECT", "mode": "warn", "warn_first_ms": 5}),
            "warn_first_ms",
        ),
    ] {
        let put = put_rule(&r, FP, Some(W), &rule).await;
        let pre = preview(&r, Some(R), &at_fp(rule.clone())).await;
        assert_eq!(pre.status, StatusCode::BAD_REQUEST, "{rule}");
        assert_eq!(put.status, StatusCode::BAD_REQUEST, "{rule}");
        assert_eq!(pre.json()["field"], field, "{rule}: {}", pre.text());
        assert_eq!(pre.json()["message"], put.json()["message"], "{rule}");
    }
    for (body, field) in [
        (json!({"action": "REJECT"}), "fingerprint"),
        (
            json!({"action": "REJECT", "fingerprint": "beef"}),
            "fingerprint",
        ),
        (json!({"action": "REJECT", "sql": "-- nothing"}), "sql"),
    ] {
        let resp = preview(&r, Some(R), &body).await;
        assert_eq!(resp.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(resp.json()["field"], field, "{body}");
    }
    let no_token = preview(&r, None, &at_fp(json!({"action": "REJECT"}))).await;
    assert_eq!(no_token.status, StatusCode::UNAUTHORIZED);
    let form = call(
        &r,
        "POST",
        "/v1/rules/preview",
        Some(R),
        Some(("text/plain", br#"{"action":"REJECT"}"#.to_vec())),
    )
    .await;
    assert_eq!(form.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert!(app.policy.rules().is_empty(), "a preview stores nothing");

    // From SQL, a pattern never seen: all zero, and said so.
    let v = preview(
        &r,
        Some(R),
        &json!({"sql": "SELECT 1 FROM nowhere", "action": "REJECT"}),
    )
    .await
    .json();
    assert_eq!(v["tracked"], false, "{v}");
    assert_eq!(f(&v["effect"]["refused_per_s"]), 0.0, "{v}");
    assert!(
        v["warnings"][0]
            .as_str()
            .is_some_and(|w| w.starts_with("nothing to go on")),
        "{v}"
    );

    // A live rule on the pattern is named as what a PUT would replace.
    let resp = put_rule(
        &r,
        FP,
        Some(W),
        &json!({"action": "REJECT", "mode": "warn"}),
    )
    .await;
    assert_eq!(resp.status, StatusCode::CREATED, "{}", resp.text());
    let v = preview(&r, Some(R), &at_fp(json!({"action": "REJECT"})))
        .await
        .json();
    assert_eq!(v["replaces"]["action"], "REJECT", "{v}");
    assert_eq!(v["replaces"]["mode"], "warn", "{v}");
}

/// The measured refusal rate of an enforced THROTTLE matches what its preview predicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_preview_of_a_throttle_predicts_its_refusals() {
    if direct_mode() {
        note_skipped("the rule preview test (it needs the proxy)");
        return;
    }
    let env = Env::start(
        4,
        &format!("admin:\n  write_token: {PROXY_W}\n{CALLERS}"),
        |_| {},
    );
    let proxy = &env.proxy;
    let web = connect(proxy, Some("web")).await;
    run(
        &web,
        "CREATE TABLE accounts (id int PRIMARY KEY, v int); \
         INSERT INTO accounts SELECT g, g FROM generate_series(1, 1000) g",
    )
    .await
    .expect("create accounts");
    let sql = |i: u64| format!("SELECT v FROM accounts WHERE id = {}", i % 1000 + 1);
    let fp = offline_fingerprint(&sql(0));

    // 3 clients x 50/s = 150/s of the pattern, paced (a refusal does not make a client
    // faster), from the first statement of the pattern on.
    const CLIENTS: u64 = 3;
    const PER_CLIENT_QPS: u64 = 50;
    let stop = Arc::new(AtomicBool::new(false));
    let (sent, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut load = Vec::new();
    for k in 0..CLIENTS {
        let (stop, sent, refused) = (stop.clone(), sent.clone(), refused.clone());
        let c = connect(proxy, Some("web")).await;
        load.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(1000 / PER_CLIENT_QPS));
            let mut i = k * 1000;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                i += 1;
                sent.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = c.simple_query(&sql(i)).await {
                    assert_eq!(sqlstate(&e), "53400", "{e:?}");
                    refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(4)).await;

    let rule = json!({"action": "THROTTLE", "max_qps": 50, "burst": 5});
    let mut body = rule.clone();
    body["fingerprint"] = json!(fp);
    // Read access is enough for a preview.
    let (status, text) = proxy
        .admin_request(
            "POST",
            "/v1/rules/preview",
            ADMIN_READ_TOKEN,
            Some(&body.to_string()),
        )
        .await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("preview JSON");
    eprintln!("preview: {v}");
    let offered = f(&v["matched"]["calls_per_s"]);
    let predicted = f(&v["effect"]["refused_per_s"]);
    assert!(
        (100.0..=175.0).contains(&offered),
        "about 150 calls/s offered: {v}"
    );
    assert!(
        (predicted - (offered - 50.0)).abs() < 1e-6,
        "THROTTLE refuses what is above max_qps: {v}"
    );
    assert_eq!(v["matched"]["callers"][0]["caller"], "web", "{v}");
    assert_eq!(v["critical_callers"], json!([]), "{v}");
    assert!(f(&v["matched"]["db_ms_per_s"]) > 0.0, "{v}");

    // Enforce it; skip the first second (the burst), then count for five.
    let (status, v) = admin(
        proxy,
        "PUT",
        &format!("/v1/rules/fingerprint/{fp}"),
        Some(&rule.to_string()),
    )
    .await;
    assert_eq!(status, 201, "{v}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (sent0, refused0, t0) = (
        sent.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        std::time::Instant::now(),
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (sent1, refused1, secs) = (
        sent.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        t0.elapsed().as_secs_f64(),
    );
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.await.expect("a load task");
    }
    let measured = (refused1 - refused0) as f64 / secs;
    let offered_now = (sent1 - sent0) as f64 / secs;
    eprintln!(
        "predicted {predicted:.1} refused/s of {offered:.1}/s; measured {measured:.1} of \
         {offered_now:.1}/s over {secs:.2} s"
    );
    assert!(
        (measured - predicted).abs() <= 0.2 * predicted,
        "measured {measured:.1} refused/s (of {offered_now:.1}/s sent) against the \
         predicted {predicted:.1} (of {offered:.1}/s)"
    );

    // The CLI prints the same estimate, and names the live rule a PUT would replace.
    let admin_addr = proxy.admin_addr().expect("admin address").to_string();
    let (ok, out, err) = pgsluice(&[
        "rules",
        "preview",
        &fp,
        "--admin",
        &admin_addr,
        "--token",
        ADMIN_READ_TOKEN,
        "--action",
        "THROTTLE",
        "--max-qps",
        "100",
    ]);
    assert!(ok, "pgsluice rules preview: {err}");
    eprintln!("pgsluice rules preview:\n{out}");
    assert!(out.contains("would refuse"), "{out}");
    assert!(out.contains("SELECT v FROM accounts WHERE id = ?"), "{out}");
    assert!(
        out.contains("would replace the live THROTTLE rule"),
        "{out}"
    );
}
