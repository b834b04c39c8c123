//! `auto_rules.warn_first_ms`, in process (`crate::support::admin_api`, the detector running
//! as a service of the router): statistics fed directly show a rate step, the automatic rule
//! is installed enforcing with a warn window — listed as `effective_mode: warn` with the time
//! left — lets the flood run (warned) during the window, and enforces by itself after it.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use pgsluice::config::Config;
use pgsluice::observe::stats::Outcome;
use pgsluice::policy::rules::RuleCheck;

use crate::support::admin_api::{R, W, api, app_with, get};

const FP: u64 = 0x0123_4567_89ab_cdef;
const WINDOW_MS: u64 = 3000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_automatic_rule_warns_for_its_window_then_enforces() {
    let mut c = Config::from_yaml(&format!(
        "detector: {{ tick_ms: 100, window_ms: 200, warmup_ms: 1000 }}\n\
         auto_rules: {{ mode: enforce, ttl_seconds: 60, warn_first_ms: {WINDOW_MS} }}\n"
    ))
    .expect("config");
    c.admin.write_token = Some(W.into());
    c.admin.read_token = Some(R.into());
    let app = app_with(c);
    let r = api(&app);
    let text: Arc<str> = Arc::from("SELECT v FROM t WHERE id = ?");
    let web: Arc<str> = Arc::from("web");
    let record = |n: u32| {
        for _ in 0..n {
            app.fp_stats.record(
                FP,
                &text,
                "read",
                &web,
                Duration::from_micros(200),
                Outcome::Ok { rows: 1 },
            );
        }
    };
    // 10/s through the warm-up, then 500/s.
    for _ in 0..20 {
        record(1);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut rule = Value::Null;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        record(5);
        tokio::time::sleep(Duration::from_millis(10)).await;
        if app.policy.rules().get(FP).is_some() {
            let v = get(&r, "/v1/rules", Some(R)).await.json();
            rule = v["rules"][0].clone();
            break;
        }
    }
    assert!(rule.is_object(), "no automatic rule within 10 s");
    assert_eq!(rule["origin"], "auto", "{rule}");
    assert_eq!(rule["mode"], "enforce", "{rule}");
    assert_eq!(rule["warn_first_ms"], WINDOW_MS, "{rule}");
    assert_eq!(rule["effective_mode"], "warn", "{rule}");
    let left = rule["enforces_in_ms"].as_u64().unwrap_or(0);
    assert!(left > 0 && left <= WINDOW_MS, "{rule}");
    let created = rule["created_unix_ms"].as_u64().unwrap_or(0);
    assert_eq!(rule["enforce_at_unix_ms"], created + WINDOW_MS, "{rule}");
    let anomalies = get(&r, "/v1/anomalies", Some(R)).await.json();
    assert_eq!(
        anomalies["anomalies"][0]["rule"]["mode"], "warn",
        "{anomalies}"
    );

    // Inside the window nothing is refused, whatever the rate: what would be is warned.
    let rules = app.policy.rules();
    let mut warned = 0;
    for _ in 0..200 {
        match rules.check(FP, "web", Instant::now(), Duration::ZERO, false) {
            RuleCheck::Admit(a) => warned += u32::from(a.would_refuse.is_some()),
            other => panic!("refused inside the warn window: {other:?}"),
        }
    }
    assert!(warned > 0, "200 at once exceed the throttle's burst");

    // After it, the same rule refuses.
    tokio::time::sleep(Duration::from_millis(left + 100)).await;
    let refused = (0..200)
        .filter(|_| {
            matches!(
                rules.check(FP, "web", Instant::now(), Duration::ZERO, false),
                RuleCheck::Refuse { .. }
            )
        })
        .count();
    assert!(refused > 0, "the rule enforces after its window");
    let v = get(&r, "/v1/rules", Some(R)).await.json();
    let rule = &v["rules"][0];
    assert_eq!(rule["effective_mode"], "enforce", "{rule}");
    assert!(rule["enforces_in_ms"].is_null(), "{rule}");
    assert!(
        rule["warned"].as_u64().unwrap_or(0) >= u64::from(warned),
        "{rule}"
    );
    // /metrics has the warned statements by action.
    let metrics = get(&r, "/metrics", Some(R)).await.text();
    let line = metrics
        .lines()
        .find(|l| l.starts_with("pgsluice_rule_warned_total{action=\"THROTTLE\"}"))
        .unwrap_or_default();
    let n: f64 = line
        .rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(n >= f64::from(warned), "{line:?}");
}
