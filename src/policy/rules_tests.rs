//! Tests for `rules`: validation with field-level errors, the hot-path check per action,
//! TTL expiry and the persisted file round-trip.

use std::time::Duration;

use tokio::time::Instant;

use super::rules::*;

const FP: u64 = 0x00ab_cdef_0123_4567;

fn spec(json: &str) -> Result<RuleSpec, RuleError> {
    RuleSpec::from_json(json.as_bytes())
}

fn err(json: &str) -> RuleError {
    match spec(json).and_then(|s| s.validate().map(|_| s)) {
        Ok(s) => panic!("accepted {json}: {s:?}"),
        Err(e) => e,
    }
}

#[test]
fn valid_rules_parse_and_normalise() {
    let s = spec(r#"{"action":"throttle","max_qps":2,"action_on_exceed":"queue","error_message":"slow down","ttl_seconds":3600}"#)
        .unwrap();
    let def = s.validate().unwrap();
    assert_eq!(
        def.action,
        RuleAction::Throttle {
            max_qps: 2.0,
            burst: 2,
            on_exceed: OnExceed::Queue
        }
    );
    assert_eq!(def.mode, RuleMode::Enforce);
    assert_eq!(def.ttl, Some(Duration::from_secs(3600)));
    let canon = def.to_spec();
    assert_eq!(canon.action.as_deref(), Some("THROTTLE"));
    assert_eq!(canon.action_on_exceed.as_deref(), Some("QUEUE"));
    assert_eq!(canon.burst, Some(2));
    assert_eq!(canon.validate().unwrap(), def);

    for ok in [
        r#"{"action":"REJECT"}"#,
        r#"{"action":"REJECT","mode":"warn","callers":["a","b"],"note":"INC-42"}"#,
        r#"{"action":"THROTTLE","max_qps":0.5}"#,
        r#"{"action":"THROTTLE","max_qps":1000000,"burst":10}"#,
        r#"{"action":"CONCURRENCY","max_inflight":1}"#,
        r#"{"action":"TIMEOUT","statement_timeout_ms":800}"#,
        r#"{"action":"TIMEOUT","lock_timeout_ms":0}"#,
        r#"{"action":"ROUTE","route":"replica"}"#,
        r#"{"action":"ROUTE","route":"primary","callers":["web"]}"#,
        r#"{"action":"REJECT","ttl_seconds":null}"#,
    ] {
        spec(ok)
            .unwrap()
            .validate()
            .unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
}

#[test]
fn bad_rules_name_the_field() {
    let cases = [
        (
            r#"{"action":"THROTTLE","max_qps":-1}"#,
            "max_qps",
            "must be > 0",
        ),
        (
            r#"{"action":"THROTTLE","max_qps":0}"#,
            "max_qps",
            "must be > 0",
        ),
        (r#"{"action":"THROTTLE","max_qps":1e7}"#, "max_qps", "<="),
        // A rate so low the bucket's clock cannot express it would never refuse.
        (
            r#"{"action":"THROTTLE","max_qps":1e-11}"#,
            "max_qps",
            ">= 0.001",
        ),
        (
            r#"{"action":"THROTTLE","max_qps":0.0009}"#,
            "max_qps",
            ">= 0.001",
        ),
        (r#"{"action":"THROTTLE"}"#, "max_qps", "required"),
        (
            r#"{"action":"THROTTLE","max_qps":"2"}"#,
            "max_qps",
            "invalid type",
        ),
        (
            r#"{"action":"THROTTLE","max_qps":2,"burst":0}"#,
            "burst",
            "between",
        ),
        (
            r#"{"action":"THROTTLE","max_qps":2,"burst":-3}"#,
            "burst",
            "invalid value",
        ),
        (
            r#"{"action":"THROTTLE","max_qps":2,"action_on_exceed":"WAIT"}"#,
            "action_on_exceed",
            "unknown",
        ),
        (r#"{"action":"EXPLODE"}"#, "action", "unknown action"),
        (r#"{"max_qps":2}"#, "action", "required"),
        (
            r#"{"action":"REJECT","colour":"red"}"#,
            "colour",
            "unknown field",
        ),
        (
            r#"{"action":"REJECT","max_qps":2}"#,
            "max_qps",
            "only valid with action THROTTLE",
        ),
        (
            r#"{"action":"THROTTLE","max_qps":2,"max_inflight":3}"#,
            "max_inflight",
            "only valid",
        ),
        (r#"{"action":"CONCURRENCY"}"#, "max_inflight", "required"),
        (
            r#"{"action":"CONCURRENCY","max_inflight":0}"#,
            "max_inflight",
            "between",
        ),
        (r#"{"action":"TIMEOUT"}"#, "statement_timeout_ms", "and/or"),
        (r#"{"action":"ROUTE"}"#, "route", "required"),
        (
            r#"{"action":"ROUTE","route":"elsewhere"}"#,
            "route",
            "replica or primary",
        ),
        (
            r#"{"action":"REJECT","route":"replica"}"#,
            "route",
            "only valid",
        ),
        (
            r#"{"action":"ROUTE","route":"replica","mode":"warn"}"#,
            "mode",
            "nothing is refused",
        ),
        (
            r#"{"action":"TIMEOUT","lock_timeout_ms":3000000000}"#,
            "lock_timeout_ms",
            "between",
        ),
        (
            r#"{"action":"TIMEOUT","lock_timeout_ms":10,"mode":"warn"}"#,
            "mode",
            "warn",
        ),
        (
            r#"{"action":"TIMEOUT","lock_timeout_ms":10,"error_message":"x"}"#,
            "error_message",
            "TIMEOUT",
        ),
        (
            r#"{"action":"REJECT","mode":"loud"}"#,
            "mode",
            "unknown mode",
        ),
        (
            r#"{"action":"REJECT","ttl_seconds":0}"#,
            "ttl_seconds",
            "between",
        ),
        (
            r#"{"action":"REJECT","callers":[]}"#,
            "callers",
            "must not be empty",
        ),
        (
            r#"{"action":"REJECT","callers":[""]}"#,
            "callers[0]",
            "must not be empty",
        ),
        (
            r#"{"action":"REJECT","error_message":"a\u0000b"}"#,
            "error_message",
            "NUL",
        ),
        (r#"[1,2]"#, "body", "JSON object"),
        (r#"{"action":"#, "body", "invalid JSON"),
    ];
    for (json, field, fragment) in cases {
        let e = err(json);
        assert_eq!(e.field, field, "{json}: {e}");
        assert!(e.message.contains(fragment), "{json}: {e}");
        // Positions help only for broken JSON; once a field is named they are noise.
        assert!(
            field == "body" || !e.message.contains("at line"),
            "{json}: {e}"
        );
    }
    let e =
        err(r#"{"action":"REJECT","error_message":"x"}"#.replace('x', &"x".repeat(2000)).as_str());
    assert_eq!(e.field, "error_message");
    let huge = format!(
        r#"{{"action":"REJECT","note":"{}"}}"#,
        "n".repeat(MAX_RULE_JSON_BYTES)
    );
    assert_eq!(err(&huge).field, "body");
    // Displayed as `field: message`, as the admin API's 400 body will show it.
    assert_eq!(
        err(r#"{"action":"THROTTLE","max_qps":0}"#).to_string(),
        "max_qps: must be > 0 (use REJECT to block)"
    );
}

#[test]
fn non_finite_qps_is_refused() {
    // JSON has no NaN/Infinity literals; a spec built in code must still be checked.
    for q in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let s = RuleSpec {
            action: Some("THROTTLE".into()),
            max_qps: Some(q),
            ..RuleSpec::default()
        };
        let e = s.validate().unwrap_err();
        assert_eq!(e.field, "max_qps");
        assert!(e.message.contains("finite"), "{e}");
    }
}

#[test]
fn fingerprint_hex_round_trip() {
    assert_eq!(fingerprint_hex(FP), "00abcdef01234567");
    assert_eq!(parse_fingerprint("00ABCDEF01234567"), Ok(FP));
    for bad in [
        "",
        "abc",
        "00abcdef0123456g",
        "+0abcdef01234567",
        "00abcdef012345678",
    ] {
        assert_eq!(
            parse_fingerprint(bad).unwrap_err().field,
            "fingerprint",
            "{bad}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn empty_set_and_unknown_fingerprint_pass() {
    let set = RuleSet::new();
    assert!(matches!(
        set.check(FP, "a", Instant::now(), Duration::ZERO, false),
        RuleCheck::NoRule
    ));
    set.put(FP, spec(r#"{"action":"REJECT"}"#).unwrap())
        .unwrap();
    assert!(matches!(
        set.check(FP + 1, "a", Instant::now(), Duration::ZERO, false),
        RuleCheck::NoRule
    ));
}

#[tokio::test(start_paused = true)]
async fn throttle_limits_to_rate_plus_burst() {
    let set = RuleSet::new();
    set.put(FP, spec(r#"{"action":"THROTTLE","max_qps":2}"#).unwrap())
        .unwrap();
    let (mut ok, mut refused) = (0, 0);
    // 10 statements per second for 3 s (0.0 .. 2.9 s).
    for _ in 0..30 {
        match set.check(FP, "a", Instant::now(), Duration::ZERO, false) {
            RuleCheck::Admit(a) => {
                assert_eq!(a.wait, Duration::ZERO);
                ok += 1;
            }
            RuleCheck::Refuse { violation, .. } => {
                assert!(
                    matches!(violation, RuleViolation::RateLimited { retry_after } if retry_after <= Duration::from_millis(500))
                );
                refused += 1;
            }
            RuleCheck::NoRule | RuleCheck::AwaitLease { .. } => panic!("rule vanished"),
        }
        tokio::time::advance(Duration::from_millis(100)).await;
    }
    // Burst 2, then a token at 0.5, 1.0, 1.5, 2.0, 2.5 s.
    assert_eq!((ok, refused), (7, 23));
    let rule = set.get(FP).unwrap();
    assert_eq!((rule.hits(), rule.refusals(), rule.warned()), (30, 23, 0));
}

#[tokio::test(start_paused = true)]
async fn throttle_queue_reserves_within_the_wait() {
    let set = RuleSet::new();
    set.put(
        FP,
        spec(r#"{"action":"THROTTLE","max_qps":10,"burst":1,"action_on_exceed":"QUEUE"}"#).unwrap(),
    )
    .unwrap();
    let now = Instant::now();
    let waits: Vec<_> = (0..4)
        .map(
            |_| match set.check(FP, "a", now, Duration::from_millis(250), false) {
                RuleCheck::Admit(a) => Ok(a.wait),
                RuleCheck::Refuse { violation, .. } => Err(violation),
                RuleCheck::NoRule | RuleCheck::AwaitLease { .. } => panic!("rule vanished"),
            },
        )
        .collect();
    assert_eq!(
        waits,
        vec![
            Ok(Duration::ZERO),
            Ok(Duration::from_millis(100)),
            Ok(Duration::from_millis(200)),
            Err(RuleViolation::RateLimited {
                retry_after: Duration::from_millis(300)
            }),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn concurrency_guard_counts_and_releases() {
    let set = RuleSet::new();
    set.put(
        FP,
        spec(r#"{"action":"CONCURRENCY","max_inflight":2}"#).unwrap(),
    )
    .unwrap();
    let take = || match set.check(FP, "a", Instant::now(), Duration::ZERO, false) {
        RuleCheck::Admit(a) => Some(a.guard),
        _ => None,
    };
    let g1 = take().unwrap();
    let g2 = take().unwrap();
    assert!(take().is_none());
    assert_eq!(set.list(Instant::now())[0].in_flight, 2);
    drop(g1);
    let g3 = take().unwrap();
    drop((g2, g3));
    assert_eq!(set.list(Instant::now())[0].in_flight, 0);
}

#[tokio::test(start_paused = true)]
async fn reject_warn_timeout_and_caller_scope() {
    let set = RuleSet::new();
    set.put(
        1,
        spec(r#"{"action":"REJECT","error_message":"use the replica","callers":["batch"]}"#)
            .unwrap(),
    )
    .unwrap();
    set.put(2, spec(r#"{"action":"REJECT","mode":"warn"}"#).unwrap())
        .unwrap();
    set.put(
        3,
        spec(r#"{"action":"TIMEOUT","statement_timeout_ms":800,"lock_timeout_ms":200}"#).unwrap(),
    )
    .unwrap();
    let now = Instant::now();
    assert!(matches!(
        set.check(1, "web", now, Duration::ZERO, false),
        RuleCheck::NoRule
    ));
    match set.check(1, "batch", now, Duration::ZERO, false) {
        RuleCheck::Refuse { rule, violation } => {
            assert_eq!(violation, RuleViolation::Blocked);
            assert_eq!(rule.def().error_message.as_deref(), Some("use the replica"));
        }
        other => panic!("{other:?}"),
    }
    match set.check(2, "web", now, Duration::ZERO, false) {
        RuleCheck::Admit(a) => assert_eq!(a.would_refuse, Some(RuleViolation::Blocked)),
        other => panic!("{other:?}"),
    }
    match set.check(3, "web", now, Duration::ZERO, false) {
        RuleCheck::Admit(a) => {
            assert_eq!(a.statement_timeout, Some(Duration::from_millis(800)));
            assert_eq!(a.lock_timeout, Some(Duration::from_millis(200)));
            assert!(a.would_refuse.is_none());
        }
        other => panic!("{other:?}"),
    }
    let list = set.list(now);
    let counts: Vec<_> = list
        .iter()
        .map(|r| (r.hits, r.refusals, r.warned))
        .collect();
    // The out-of-scope caller is not a hit.
    assert_eq!(counts, vec![(1, 1, 0), (1, 0, 1), (1, 0, 0)]);
}

#[tokio::test(start_paused = true)]
async fn ttl_expiry_lazy_and_purged() {
    let set = RuleSet::new();
    set.put(1, spec(r#"{"action":"REJECT","ttl_seconds":60}"#).unwrap())
        .unwrap();
    set.put(2, spec(r#"{"action":"REJECT","ttl_seconds":120}"#).unwrap())
        .unwrap();
    set.put(3, spec(r#"{"action":"REJECT"}"#).unwrap()).unwrap();
    assert_eq!(set.list(Instant::now())[0].expires_in_ms, Some(60_000));
    tokio::time::advance(Duration::from_secs(59)).await;
    assert!(matches!(
        set.check(1, "a", Instant::now(), Duration::ZERO, false),
        RuleCheck::Refuse { .. }
    ));
    tokio::time::advance(Duration::from_secs(1)).await;
    let now = Instant::now();
    assert!(matches!(
        set.check(1, "a", now, Duration::ZERO, false),
        RuleCheck::NoRule
    ));
    assert!(set.get(1).is_none());
    assert_eq!(set.len(), 2, "the expired rule was removed on sight");
    tokio::time::advance(Duration::from_secs(60)).await;
    let now = Instant::now();
    assert_eq!(set.list(now).len(), 1, "expired rules are not listed");
    assert_eq!(set.purge_expired(now), 1);
    assert_eq!(set.len(), 1);
    assert!(set.delete(3));
    assert!(!set.delete(3));
    assert!(set.is_empty());
}

#[tokio::test(start_paused = true)]
async fn put_replaces_and_resets() {
    let set = RuleSet::new();
    set.put(FP, spec(r#"{"action":"REJECT"}"#).unwrap())
        .unwrap();
    let _ = set.check(FP, "a", Instant::now(), Duration::ZERO, false);
    let e = set
        .put(FP, spec(r#"{"action":"THROTTLE"}"#).unwrap())
        .unwrap_err();
    assert_eq!(e.field, "max_qps");
    assert_eq!(
        set.get(FP).unwrap().hits(),
        1,
        "a failed PUT changes nothing"
    );
    set.put(FP, spec(r#"{"action":"THROTTLE","max_qps":5}"#).unwrap())
        .unwrap();
    let rule = set.get(FP).unwrap();
    assert_eq!(rule.def().action.name(), "THROTTLE");
    assert_eq!(rule.hits(), 0);
}

#[tokio::test(start_paused = true)]
async fn persistence_round_trip_keeps_absolute_expiry() {
    let set = RuleSet::new();
    set.put(FP, spec(r#"{"action":"THROTTLE","max_qps":2,"error_message":"busy","ttl_seconds":3600,"note":"INC-7"}"#).unwrap())
        .unwrap();
    set.put(
        7,
        spec(r#"{"action":"CONCURRENCY","max_inflight":3,"callers":["x"],"mode":"warn"}"#).unwrap(),
    )
    .unwrap();
    let bytes = set.to_json_bytes().unwrap();
    let text = String::from_utf8(bytes.clone()).unwrap();
    assert!(text.contains("\"00abcdef01234567\""), "{text}");
    assert!(text.contains("expires_unix_ms"), "{text}");

    let loaded = RuleSet::from_json_bytes(&bytes).unwrap();
    let (a, b) = (set.list(Instant::now()), loaded.list(Instant::now()));
    assert_eq!(a.len(), 2);
    assert_eq!(a[0].fingerprint, "0000000000000007");
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.fingerprint, y.fingerprint);
        assert_eq!(x.spec, y.spec);
        assert_eq!(x.created_unix_ms, y.created_unix_ms);
        assert_eq!(x.expires_unix_ms, y.expires_unix_ms);
    }
    assert_eq!(loaded.to_json_bytes().unwrap(), bytes);

    // An entry whose absolute expiry has passed is skipped on load.
    let stale = text.replace(&format!("{}", a[1].expires_unix_ms.unwrap_or(0)), "1");
    assert_eq!(RuleSet::from_json_bytes(stale.as_bytes()).unwrap().len(), 1);

    // One bad entry fails the whole load, naming it; the running set is untouched.
    let bad = text.replace("\"max_inflight\": 3", "\"max_inflight\": 0");
    let e = loaded.replace_from_json_bytes(bad.as_bytes()).unwrap_err();
    assert_eq!(e.field, "rules[0].rule.max_inflight");
    assert_eq!(loaded.len(), 2);
    let e = RuleSet::from_json_bytes(br#"{"version":2,"rules":[]}"#).unwrap_err();
    assert_eq!(e.field, "version");
}

#[tokio::test]
async fn sync_keeps_unchanged_rules_and_their_state() {
    let set = RuleSet::new();
    let throttle = spec(r#"{"action":"THROTTLE","max_qps":1,"burst":1}"#).unwrap();
    let reject = spec(r#"{"action":"REJECT"}"#).unwrap();
    let a = RuleSet::stage(FP, &throttle).unwrap();
    let b = RuleSet::stage(FP + 1, &reject).unwrap();
    let (out, errors) = set.sync(&[a.clone(), b.clone()]);
    assert!(errors.is_empty());
    assert_eq!((out.added, out.replaced, out.removed), (2, 0, 0));
    // Spend the throttle's only token; an identical sync must not refill it.
    let now = Instant::now();
    assert!(matches!(
        set.check(FP, "c", now, Duration::ZERO, false),
        RuleCheck::Admit(_)
    ));
    let (out, _) = set.sync(&[a.clone(), b.clone()]);
    assert_eq!((out.kept, out.changed()), (2, false));
    assert!(matches!(
        set.check(FP, "c", now, Duration::ZERO, false),
        RuleCheck::Refuse { .. }
    ));
    assert_eq!(set.get(FP).unwrap().hits(), 2, "counters carried over");
    // A changed rule is rebuilt, a missing one removed, an invalid one skipped and named.
    let mut a2 = a.clone();
    a2.created_unix_ms += 1;
    let mut bad = b.clone();
    bad.fingerprint = "0000000000000003".into();
    bad.rule.max_qps = Some(1.0);
    let (out, errors) = set.sync(&[a2, bad]);
    assert_eq!((out.replaced, out.removed, errors.len()), (1, 1, 1));
    assert_eq!(
        errors[0].field, "rule 0000000000000003.rule.max_qps",
        "{errors:?}"
    );
    assert!(set.get(FP + 1).is_none());
    assert!(matches!(
        set.check(FP, "c", now, Duration::ZERO, false),
        RuleCheck::Admit(_)
    ));
    // Expired entries are left out.
    let mut gone = b;
    gone.expires_unix_ms = Some(1);
    let (out, _) = set.sync(&[gone]);
    assert_eq!((out.added, out.removed), (0, 1));
    assert!(set.is_empty());
}

#[test]
fn fleet_scope_is_for_throttle_only() {
    let e = err(r#"{"action":"REJECT","scope":"fleet"}"#);
    assert_eq!(e.field, "scope");
    let e = err(r#"{"action":"THROTTLE","max_qps":1,"scope":"galaxy"}"#);
    assert_eq!(e.field, "scope");
    let def = spec(r#"{"action":"THROTTLE","max_qps":1,"scope":"FLEET"}"#)
        .unwrap()
        .validate()
        .unwrap();
    assert_eq!(def.to_spec().scope.as_deref(), Some("fleet"));
    let def = spec(r#"{"action":"REJECT","scope":"instance"}"#)
        .unwrap()
        .validate()
        .unwrap();
    assert_eq!(def.to_spec().scope, None);
}

#[test]
fn a_rule_lists_a_bounded_number_of_callers() {
    let names = |n: usize| {
        (0..n)
            .map(|i| format!("\"c{i}\""))
            .collect::<Vec<_>>()
            .join(",")
    };
    let at_cap = format!(
        r#"{{"action":"REJECT","callers":[{}]}}"#,
        names(MAX_RULE_CALLERS)
    );
    assert!(spec(&at_cap).unwrap().validate().is_ok());
    let over = format!(
        r#"{{"action":"REJECT","callers":[{}]}}"#,
        names(MAX_RULE_CALLERS + 1)
    );
    let e = err(&over);
    assert_eq!(e.field, "callers");
    assert!(e.message.contains("at most"), "{e}");
    // A rules file (and so a fleet's Redis, which shares the loader) is held to the same cap.
    let file = format!(
        r#"{{"version":1,"rules":[{{"fingerprint":"00abcdef01234567","created_unix_ms":1,"rule":{over}}}]}}"#
    );
    let e = RuleSet::from_json_bytes(file.as_bytes()).unwrap_err();
    assert!(e.field.ends_with("callers"), "{e}");
}

#[tokio::test(start_paused = true)]
async fn warn_first_warns_for_its_window_then_enforces() {
    let set = RuleSet::new();
    set.put(
        FP,
        spec(r#"{"action":"REJECT","warn_first_ms":30000,"ttl_seconds":600}"#).unwrap(),
    )
    .unwrap();
    let info = &set.list(Instant::now())[0];
    assert_eq!(info.effective_mode, "warn");
    assert_eq!(info.enforces_in_ms, Some(30_000));
    assert_eq!(info.enforce_at_unix_ms, Some(info.created_unix_ms + 30_000));
    assert_eq!(info.spec.warn_first_ms, Some(30_000));
    match set.check(FP, "a", Instant::now(), Duration::ZERO, false) {
        RuleCheck::Admit(a) => assert_eq!(a.would_refuse, Some(RuleViolation::Blocked)),
        other => panic!("inside the window: {other:?}"),
    }
    // The persisted form keeps the window; loaded now, it switches at the same moment.
    let reloaded = RuleSet::from_json_bytes(&set.to_json_bytes().unwrap()).unwrap();
    let r = &reloaded.list(Instant::now())[0];
    assert_eq!(r.enforce_at_unix_ms, info.enforce_at_unix_ms);
    assert_eq!(r.effective_mode, "warn");

    tokio::time::advance(Duration::from_millis(29_999)).await;
    assert!(matches!(
        set.check(FP, "a", Instant::now(), Duration::ZERO, false),
        RuleCheck::Admit(_)
    ));
    tokio::time::advance(Duration::from_millis(1)).await;
    assert!(matches!(
        set.check(FP, "a", Instant::now(), Duration::ZERO, false),
        RuleCheck::Refuse { .. }
    ));
    let info = &set.list(Instant::now())[0];
    assert_eq!(info.effective_mode, "enforce");
    assert_eq!(info.enforces_in_ms, None);
    assert_eq!((info.hits, info.warned, info.refusals), (3, 2, 1));
    assert_eq!(
        set.warned_by_action(),
        [("REJECT", 2), ("THROTTLE", 0), ("CONCURRENCY", 0)]
    );
    // Replacing the rule does not take back what was counted per action.
    set.put(FP, spec(r#"{"action":"REJECT"}"#).unwrap())
        .unwrap();
    assert_eq!(set.warned_by_action()[0], ("REJECT", 2));
}

#[test]
fn warn_first_needs_an_enforcing_refusing_rule_shorter_than_its_ttl() {
    for (json, field) in [
        (
            r#"{"action":"REJECT","mode":"warn","warn_first_ms":1000}"#,
            "warn_first_ms",
        ),
        (
            r#"{"action":"TIMEOUT","statement_timeout_ms":5,"warn_first_ms":1000}"#,
            "warn_first_ms",
        ),
        (
            r#"{"action":"ROUTE","route":"replica","warn_first_ms":1000}"#,
            "warn_first_ms",
        ),
        (
            r#"{"action":"REJECT","ttl_seconds":10,"warn_first_ms":10000}"#,
            "warn_first_ms",
        ),
        (r#"{"action":"REJECT","warn_first_ms":-1}"#, "warn_first_ms"),
    ] {
        assert_eq!(err(json).field, field, "{json}");
    }
    let ok = spec(r#"{"action":"THROTTLE","max_qps":5,"ttl_seconds":10,"warn_first_ms":9999}"#)
        .unwrap()
        .validate()
        .unwrap();
    assert_eq!(ok.warn_first, Some(Duration::from_millis(9999)));
    // 0 is no window.
    let none = spec(r#"{"action":"REJECT","warn_first_ms":0}"#)
        .unwrap()
        .validate()
        .unwrap();
    assert_eq!(none.warn_first, None);
}
