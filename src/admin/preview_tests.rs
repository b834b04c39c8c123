//! Tests for `admin::preview`: the estimate per action over synthetic statistics rows, the
//! per-caller split, critical callers, bounded output, and the body's target.

use std::collections::BTreeMap;

use super::*;
use crate::observe::stats::CallerBreakdown;

/// A row of `qps` per caller, `mean_ms` each, over 10 s.
fn row(callers: &[(&str, f64)], mean_ms: f64) -> FingerprintSnapshot {
    let mut r = empty_row();
    let mut by_caller = BTreeMap::new();
    for (name, qps) in callers {
        let calls = (qps * 10.0) as u64;
        by_caller.insert(
            (*name).to_owned(),
            CallerBreakdown {
                calls,
                qps: *qps,
                errors: 0,
                refusals: 0,
                total_ms: calls as f64 * mean_ms,
            },
        );
        r.calls += calls;
        r.qps += qps;
        r.total_ms += calls as f64 * mean_ms;
    }
    r.by_caller = by_caller;
    r
}

fn rule(json: &str) -> RuleDef {
    RuleSpec::from_json(json.as_bytes())
        .and_then(|s| s.validate())
        .unwrap_or_else(|e| panic!("{json}: {e}"))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

fn critical() -> Vec<String> {
    vec!["pay".to_owned()]
}

#[test]
fn throttle_refuses_the_rate_above_max_qps_split_by_share() {
    let r = row(&[("web", 100.0), ("pay", 50.0)], 2.0);
    let e = estimate(
        &rule(r#"{"action":"THROTTLE","max_qps":50}"#),
        Some(&r),
        &critical(),
    );
    assert!(close(e.calls_per_s, 150.0));
    assert!(close(e.effect.refused_per_s, 100.0), "{e:?}");
    assert!(close(e.effect.delayed_per_s, 0.0));
    assert!(close(e.effect.refused_share, 100.0 / 150.0));
    assert!(close(e.db_ms_per_s, 300.0), "150/s x 2 ms");
    let names: Vec<&str> = e.callers.iter().map(|c| c.caller.as_str()).collect();
    assert_eq!(names, ["web", "pay"], "busiest first");
    assert!(close(e.callers[0].refused_per_s, 100.0 * 2.0 / 3.0));
    assert!(close(e.callers[1].refused_per_s, 100.0 / 3.0));
    assert_eq!(e.critical_callers.len(), 1);
    assert_eq!(e.critical_callers[0].caller, "pay");
    assert!(e.callers[1].critical && !e.callers[0].critical);
    assert!(
        e.warnings
            .iter()
            .any(|w| w.contains("critical caller pay") && w.contains("refuse about 33.3/s")),
        "{:?}",
        e.warnings
    );

    let below = estimate(
        &rule(r#"{"action":"THROTTLE","max_qps":200}"#),
        Some(&r),
        &critical(),
    );
    assert_eq!(below.effect.refused_per_s, 0.0);
    assert_eq!(below.critical_callers[0].refused_per_s, 0.0);

    let queue = estimate(
        &rule(r#"{"action":"THROTTLE","max_qps":50,"action_on_exceed":"QUEUE"}"#),
        Some(&r),
        &critical(),
    );
    assert!(close(queue.effect.refused_per_s, 100.0));
    assert!(close(queue.effect.delayed_per_s, 50.0), "{queue:?}");
    assert!(queue.effect.method.contains("QUEUE"));
}

#[test]
fn a_rule_listing_callers_counts_only_their_traffic() {
    let r = row(&[("web", 100.0), ("pay", 50.0)], 2.0);
    let e = estimate(
        &rule(r#"{"action":"THROTTLE","max_qps":50,"callers":["web"]}"#),
        Some(&r),
        &critical(),
    );
    assert!(close(e.calls_per_s, 100.0));
    assert!(close(e.effect.refused_per_s, 50.0));
    assert_eq!(e.callers.len(), 1);
    assert!(e.critical_callers.is_empty(), "pay is not matched");
    assert!(e.warnings.is_empty(), "{:?}", e.warnings);

    // A critical caller the rule names is listed even before it sends the pattern.
    let e = estimate(
        &rule(r#"{"action":"REJECT","callers":["web","pay"]}"#),
        Some(&row(&[("web", 10.0)], 1.0)),
        &critical(),
    );
    assert_eq!(e.critical_callers.len(), 1);
    assert_eq!(e.critical_callers[0].calls_per_s, 0.0);
    assert!(e.warnings[0].contains("named by this REJECT rule"), "{e:?}");
}

#[test]
fn reject_refuses_everything_matched() {
    let r = row(&[("web", 40.0), ("etl", 2.5)], 10.0);
    let e = estimate(&rule(r#"{"action":"REJECT"}"#), Some(&r), &critical());
    assert!(close(e.effect.refused_per_s, 42.5));
    assert!(close(e.effect.refused_share, 1.0));
    assert!(e.critical_callers.is_empty());
}

#[test]
fn concurrency_uses_littles_law_on_the_admitted_mean() {
    // 100/s of 50 ms statements: 5 in flight; a limit of 2 admits 2 / 0.05 s = 40/s.
    let mut r = row(&[("web", 100.0)], 50.0);
    // Refused calls take no database time: 10 more calls, refused, add no time.
    r.calls += 10;
    r.refusals += 10;
    if let Some(c) = r.by_caller.get_mut("web") {
        c.calls += 10;
        c.refusals += 10;
    }
    let e = estimate(
        &rule(r#"{"action":"CONCURRENCY","max_inflight":2}"#),
        Some(&r),
        &critical(),
    );
    assert!(close(e.mean_ms, 50.0), "{}", e.mean_ms);
    assert!(close(e.effect.estimated_concurrency.unwrap_or(0.0), 5.0));
    assert!(close(e.effect.refused_per_s, 60.0), "{e:?}");
    assert!(e.effect.method.contains("Little's law"));
    let roomy = estimate(
        &rule(r#"{"action":"CONCURRENCY","max_inflight":5}"#),
        Some(&r),
        &critical(),
    );
    assert_eq!(roomy.effect.refused_per_s, 0.0, "exactly at the limit");
}

#[test]
fn timeout_bounds_the_share_over_it_from_the_quantiles() {
    let mut r = row(&[("web", 10.0)], 100.0);
    (r.p50_ms, r.p95_ms, r.p99_ms, r.max_ms) = (50.0, 200.0, 800.0, 2000.0);
    let share = |ms: u64| {
        let json = format!(r#"{{"action":"TIMEOUT","statement_timeout_ms":{ms}}}"#);
        let e = estimate(&rule(&json), Some(&r), &critical());
        assert_eq!(e.effect.refused_per_s, 0.0);
        e.effect.over_timeout_share_at_least
    };
    assert_eq!(share(10), Some(0.5));
    assert_eq!(share(100), Some(0.05));
    assert_eq!(share(500), Some(0.01));
    assert_eq!(share(1000), Some(0.0));
    // 0 is "no timeout".
    assert_eq!(share(0), None);
}

#[test]
fn output_is_bounded_and_an_unseen_pattern_is_all_zero() {
    let names: Vec<String> = (0..30).map(|i| format!("c{i:02}")).collect();
    let callers: Vec<(&str, f64)> = names.iter().map(|n| (n.as_str(), 1.0)).collect();
    let e = estimate(
        &rule(r#"{"action":"REJECT"}"#),
        Some(&row(&callers, 1.0)),
        &critical(),
    );
    assert_eq!(e.callers.len(), MAX_CALLERS);
    assert_eq!(e.callers_omitted, 30 - MAX_CALLERS);
    assert!(
        close(e.effect.refused_per_s, 30.0),
        "omitted callers still count"
    );

    let none = estimate(&rule(r#"{"action":"REJECT"}"#), None, &critical());
    assert_eq!(none.calls_per_s, 0.0);
    assert_eq!(none.effect.refused_share, 0.0);
    assert!(none.callers.is_empty());
}

#[test]
fn a_body_names_its_target_once() {
    let (t, spec) = parse_body(br#"{"fingerprint":"00000000000000ff","action":"REJECT"}"#).unwrap();
    assert!(matches!(t, Target::Fingerprint(0xff)));
    assert_eq!(spec.action.as_deref(), Some("REJECT"));
    let (t, _) = parse_body(br#"{"sql":"SELECT 1","action":"REJECT"}"#).unwrap();
    assert!(matches!(t, Target::Sql(s) if s == "SELECT 1"));
    for (body, field) in [
        (r#"{"action":"REJECT"}"#, "fingerprint"),
        (r#"{"fingerprint":"xyz","action":"REJECT"}"#, "fingerprint"),
        (r#"{"fingerprint":7,"action":"REJECT"}"#, "fingerprint"),
        (
            r#"{"fingerprint":"00000000000000ff","sql":"SELECT 1"}"#,
            "fingerprint",
        ),
        (r#"{"sql":" ","action":"REJECT"}"#, "sql"),
        (r#"{"sql":1,"action":"REJECT"}"#, "sql"),
        (r#"{"sql":"SELECT 1","max_qps":"two"}"#, "max_qps"),
        (r#"{"sql":"SELECT 1","bogus":1}"#, "bogus"),
        ("[]", "body"),
    ] {
        let err = parse_body(body.as_bytes()).unwrap_err();
        assert_eq!(err.field, field, "{body}: {err}");
    }
}
