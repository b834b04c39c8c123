//! Tests for `Policy::admit`: the order of checks, the exact refusals of the DESIGN table,
//! waiting and cancellation, breaker integration, hot reload and the admin snapshots.

use std::time::Duration;

use tokio::time::Instant;

use super::breaker::{BreakerSettings, BreakerState, TripReason};
use super::rules::RuleSpec;
use super::*;

const PAYMENT: u16 = 0;
const ANALYTICS: u16 = 1;
const DEFAULT: u16 = 2;
const FP: u64 = 0x1234_5678_9abc_def0;

fn callers() -> Vec<CallerPolicy> {
    vec![
        CallerPolicy {
            retry: RetryPolicy::default(),
            idle_transaction_timeout: None,
            weight: 1,
            db_time_share: None,
            name: "service_payment".into(),
            max_concurrency: 2,
            queue_depth: 20,
            queue_timeout: Duration::from_millis(200),
            priority: Priority::Critical,
            max_qps: None,
            burst: None,
            scope: Scope::Instance,
        },
        CallerPolicy {
            retry: RetryPolicy::default(),
            idle_transaction_timeout: None,
            weight: 1,
            db_time_share: None,
            name: "service_analytics".into(),
            max_concurrency: 5,
            queue_depth: 0,
            queue_timeout: Duration::ZERO,
            priority: Priority::Low,
            max_qps: None,
            burst: None,
            scope: Scope::Instance,
        },
        CallerPolicy {
            retry: RetryPolicy::default(),
            idle_transaction_timeout: None,
            weight: 1,
            db_time_share: None,
            name: "default".into(),
            max_concurrency: 10,
            queue_depth: 10,
            queue_timeout: Duration::from_millis(300),
            priority: Priority::Normal,
            max_qps: None,
            burst: None,
            scope: Scope::Instance,
        },
    ]
}

fn breaker_config() -> BreakerSettings {
    BreakerSettings {
        consecutive_errors: 5,
        max_inflight_threshold: Some(100),
        db_cpu_threshold_percent: Some(85.0),
        open: Duration::from_millis(5000),
        half_open_trials: 1,
        critical_reserve: 20,
    }
}

fn policy() -> Policy {
    Policy::new(callers(), breaker_config()).unwrap()
}

fn req(caller: u16, fingerprint: u64) -> AdmitRequest {
    AdmitRequest {
        caller,
        fingerprint,
        now: Instant::now(),
    }
}

fn put(p: &Policy, fp: u64, json: &str) {
    p.rules()
        .put(fp, RuleSpec::from_json(json.as_bytes()).unwrap())
        .unwrap();
}

async fn refused(p: &Policy, caller: u16, fp: u64) -> Refusal {
    match p.admit(&req(caller, fp)).await {
        Ok(a) => panic!("admitted: {a:?}"),
        Err(r) => r,
    }
}

#[tokio::test(start_paused = true)]
async fn seed_scenario_sixth_analytics_query_is_refused_at_once() {
    let p = policy();
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(p.admit(&req(ANALYTICS, FP)).await.unwrap());
    }
    let start = Instant::now();
    let r = refused(&p, ANALYTICS, FP).await;
    assert_eq!(Instant::now(), start, "refused without waiting");
    assert_eq!(r.kind, RefusalKind::CallerLimitExceeded);
    assert_eq!(r.sqlstate, "53300");
    assert_eq!(
        r.message,
        "pgsluice: ERR_CALLER_LIMIT_EXCEEDED: caller service_analytics is at max_concurrency=5 and its queue is full"
    );
    assert!(
        r.detail.contains("max_concurrency=5") && r.detail.contains("queue_depth=0"),
        "{}",
        r.detail
    );
    assert!(r.retry_after_ms <= 50, "first refusal: window is the base");
    assert_eq!(
        r.hint(),
        Some(format!("retry_after_ms={}", r.retry_after_ms))
    );
    assert_eq!((r.caller, r.fingerprint), (ANALYTICS, FP));
    // The other caller is unaffected.
    let pay = p.admit(&req(PAYMENT, FP)).await.unwrap();
    assert_eq!(pay.queue_wait, Duration::ZERO);
    assert!(pay.warnings.is_empty());
    let snap = p.callers();
    assert_eq!(
        (
            snap[1].in_flight,
            snap[1].admitted,
            snap[1].refusals.caller_limit
        ),
        (5, 5, 1)
    );
    drop(held);
    assert_eq!(p.callers()[1].in_flight, 0);
}

#[tokio::test(start_paused = true)]
async fn queue_timeout_fires_at_queue_timeout_and_a_freed_slot_is_handed_over() {
    let p = policy();
    let a = p.admit(&req(PAYMENT, FP)).await.unwrap();
    let _b = p.admit(&req(PAYMENT, FP)).await.unwrap();
    let start = Instant::now();
    let r = refused(&p, PAYMENT, FP).await;
    assert_eq!(
        Instant::now() - start,
        Duration::from_millis(200),
        "never later"
    );
    assert_eq!((r.kind, r.sqlstate), (RefusalKind::QueueTimeout, "53300"));
    assert_eq!(
        r.message,
        "pgsluice: ERR_QUEUE_TIMEOUT: caller service_payment waited 200 ms for one of its max_concurrency=2 slots"
    );
    assert!(r.detail.contains("queue_timeout_ms=200"), "{}", r.detail);

    // A waiter is admitted as soon as a permit is dropped, and reports its wait.
    let request = req(PAYMENT, FP);
    let fut = p.admit(&request);
    let release = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(a);
    };
    let (admitted, ()) = tokio::join!(fut, release);
    assert_eq!(admitted.unwrap().queue_wait, Duration::from_millis(50));
}

#[tokio::test(start_paused = true)]
async fn disconnected_waiter_leaves_the_queue() {
    let p = policy();
    let _held = (
        p.admit(&req(PAYMENT, FP)).await.unwrap(),
        p.admit(&req(PAYMENT, FP)).await.unwrap(),
    );
    let request = req(PAYMENT, FP);
    let waiter = p.admit(&request);
    // Poll it for a while, then give up on it like a session whose client went away.
    let gave_up = tokio::time::timeout(Duration::from_millis(50), waiter).await;
    assert!(gave_up.is_err());
    assert_eq!(p.callers()[0].queued, 0);
    assert_eq!(p.callers()[0].in_flight, 2);
    assert_eq!(p.callers()[0].refusals, RefusalCounts::default());
}

#[tokio::test(start_paused = true)]
async fn caller_rate_limit_refuses_with_time_to_next_token() {
    let mut c = callers();
    c[2].max_qps = Some(2.0);
    let p = Policy::new(c, breaker_config()).unwrap();
    let _a = p.admit(&req(DEFAULT, FP)).await.unwrap();
    let _b = p.admit(&req(DEFAULT, FP)).await.unwrap();
    let r = refused(&p, DEFAULT, FP).await;
    assert_eq!((r.kind, r.sqlstate), (RefusalKind::RateLimited, "53400"));
    assert_eq!(
        r.message,
        "pgsluice: ERR_RATE_LIMITED: caller default is over max_qps=2"
    );
    assert_eq!(r.detail, "limit: caller default max_qps=2, burst=2");
    assert!(
        (500..=550).contains(&r.retry_after_ms),
        "{}",
        r.retry_after_ms
    );
    tokio::time::advance(Duration::from_millis(500)).await;
    assert!(p.admit(&req(DEFAULT, FP)).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn rule_refusal_wins_over_caller_limits_and_costs_no_slot() {
    let p = policy();
    put(
        &p,
        FP,
        r#"{"action":"REJECT","error_message":"Query pattern is blocked during INC-9"}"#,
    );
    let held: Vec<_> = futures(&p, ANALYTICS, FP + 1, 5).await;
    let r = refused(&p, ANALYTICS, FP).await;
    assert_eq!((r.kind, r.sqlstate), (RefusalKind::QueryBlocked, "53400"));
    assert_eq!(
        r.message,
        "pgsluice: ERR_QUERY_BLOCKED: fingerprint 123456789abcdef0 is blocked by a rule: Query pattern is blocked during INC-9"
    );
    assert_eq!(
        r.detail,
        "limit: rule on fingerprint 123456789abcdef0 action=REJECT (not retryable)"
    );
    assert_eq!(r.hint(), None, "a blocked pattern carries no retry hint");
    assert_eq!(p.callers()[1].in_flight, 5);
    assert_eq!(p.callers()[1].refusals.query_blocked, 1);
    assert_eq!(p.rules().get(FP).unwrap().refusals(), 1);
    drop(held);
    // Other fingerprints are unaffected.
    assert!(p.admit(&req(ANALYTICS, FP + 1)).await.is_ok());
}

async fn futures(p: &Policy, caller: u16, fp: u64, n: usize) -> Vec<Admission> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(p.admit(&req(caller, fp)).await.unwrap());
    }
    out
}

#[tokio::test(start_paused = true)]
async fn rule_throttle_reject_and_queue() {
    let p = policy();
    put(
        &p,
        FP,
        r#"{"action":"THROTTLE","max_qps":2,"burst":1,"error_message":"Query pattern is throttled"}"#,
    );
    let _ok = p.admit(&req(DEFAULT, FP)).await.unwrap();
    let r = refused(&p, DEFAULT, FP).await;
    assert_eq!((r.kind, r.sqlstate), (RefusalKind::RateLimited, "53400"));
    assert_eq!(
        r.message,
        "pgsluice: ERR_RATE_LIMITED: fingerprint 123456789abcdef0 is throttled to max_qps=2 by a rule: Query pattern is throttled"
    );
    assert!(
        r.detail.contains("burst=1, action_on_exceed=REJECT"),
        "{}",
        r.detail
    );
    assert!(r.retry_after_ms >= 500, "{}", r.retry_after_ms);

    // QUEUE: wait for a token within the caller's queue timeout (default: 300 ms).
    put(
        &p,
        FP,
        r#"{"action":"THROTTLE","max_qps":4,"burst":1,"action_on_exceed":"QUEUE"}"#,
    );
    let _first = p.admit(&req(DEFAULT, FP)).await.unwrap();
    let start = Instant::now();
    let second = async {
        let a = p.admit(&req(DEFAULT, FP)).await;
        (a, Instant::now() - start)
    };
    let third = async {
        let r = p.admit(&req(DEFAULT, FP)).await;
        (r, Instant::now() - start)
    };
    let ((second, t2), (third, t3)) = tokio::join!(second, third);
    // The second reserved the token 250 ms ahead and waited for it.
    assert_eq!(t2, Duration::from_millis(250));
    assert_eq!(second.unwrap().queue_wait, Duration::from_millis(250));
    // The third would need 500 ms, beyond the queue timeout: refused at once.
    assert_eq!(t3, Duration::ZERO);
    let r = third.unwrap_err();
    assert_eq!(r.kind, RefusalKind::RateLimited);
    assert!(r.detail.ends_with("action_on_exceed=QUEUE"), "{}", r.detail);
    assert!(r.retry_after_ms >= 500, "{}", r.retry_after_ms);
}

#[tokio::test(start_paused = true)]
async fn rule_concurrency_and_timeout_overrides() {
    let p = policy();
    put(&p, FP, r#"{"action":"CONCURRENCY","max_inflight":1}"#);
    let first = p.admit(&req(DEFAULT, FP)).await.unwrap();
    let r = refused(&p, DEFAULT, FP).await;
    assert_eq!(
        (r.kind, r.sqlstate),
        (RefusalKind::QueryConcurrency, "53300")
    );
    assert_eq!(
        r.message,
        "pgsluice: ERR_QUERY_CONCURRENCY: fingerprint 123456789abcdef0 is at max_inflight=1 set by a rule"
    );
    drop(first);
    assert!(p.admit(&req(DEFAULT, FP)).await.is_ok());

    put(
        &p,
        FP,
        r#"{"action":"TIMEOUT","statement_timeout_ms":800,"lock_timeout_ms":200}"#,
    );
    let a = p.admit(&req(DEFAULT, FP)).await.unwrap();
    assert_eq!(
        a.statement_timeout_override,
        Some(Duration::from_millis(800))
    );
    assert_eq!(a.lock_timeout_override, Some(Duration::from_millis(200)));
    let other = p.admit(&req(DEFAULT, FP + 1)).await.unwrap();
    assert_eq!(
        (
            other.statement_timeout_override,
            other.lock_timeout_override
        ),
        (None, None)
    );
}

#[tokio::test(start_paused = true)]
async fn warn_mode_admits_with_a_notice() {
    let p = policy();
    put(
        &p,
        FP,
        r#"{"action":"REJECT","mode":"warn","error_message":"would be blocked"}"#,
    );
    let a = p.admit(&req(ANALYTICS, FP)).await.unwrap();
    assert_eq!(
        a.warnings,
        vec![
            "pgsluice: rule in warn mode would refuse this statement with ERR_QUERY_BLOCKED: fingerprint \
             123456789abcdef0 is blocked by a rule: would be blocked (limit: rule on fingerprint \
             123456789abcdef0 action=REJECT (not retryable))"
                .to_owned()
        ]
    );
    let rule = p.rules().get(FP).unwrap();
    assert_eq!((rule.hits(), rule.refusals(), rule.warned()), (1, 0, 1));
    assert_eq!(p.callers()[1].refusals, RefusalCounts::default());
}

#[tokio::test(start_paused = true)]
async fn breaker_sheds_non_critical_admits_critical_and_recovers() {
    let p = policy();
    let transitions = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let sink = std::sync::Arc::clone(&transitions);
    p.set_transition_observer(Some(std::sync::Arc::new(move |t: &breaker::Transition| {
        sink.lock().push((t.to, t.reason));
    })));
    for _ in 0..5 {
        p.record_backend_result(false);
    }
    assert_eq!(p.breaker_state(), BreakerState::Open);
    let r = refused(&p, DEFAULT, FP).await;
    assert_eq!((r.kind, r.sqlstate), (RefusalKind::CircuitOpen, "53000"));
    assert_eq!(
        r.message,
        "pgsluice: ERR_CIRCUIT_OPEN: circuit breaker is open; only critical traffic is admitted \
         (caller default has priority normal)"
    );
    assert_eq!(
        r.detail,
        "limit: circuit_breaker consecutive_errors=5, open_ms=5000"
    );
    assert!(
        r.retry_after_ms >= 5000,
        "at least the rest of the open period: {}",
        r.retry_after_ms
    );
    let critical = p.admit(&req(PAYMENT, FP)).await.unwrap();
    assert!(!critical.is_breaker_trial());

    tokio::time::advance(Duration::from_secs(5)).await;
    let trial = p.admit(&req(DEFAULT, FP)).await.unwrap();
    assert!(trial.is_breaker_trial());
    let r = refused(&p, ANALYTICS, FP).await;
    assert!(
        r.message.contains("half-open and its trial slots are busy"),
        "{}",
        r.message
    );
    p.record_backend_result(true);
    drop(trial);
    assert_eq!(p.breaker_state(), BreakerState::Closed);
    assert!(p.admit(&req(ANALYTICS, FP)).await.is_ok());
    assert_eq!(
        *transitions.lock(),
        vec![
            (BreakerState::Open, Some(TripReason::ConsecutiveErrors)),
            (BreakerState::HalfOpen, None),
            (BreakerState::Closed, None),
        ]
    );
    let snap = p.breaker();
    assert_eq!((snap.transitions, snap.in_flight), (3, 1));
}

#[tokio::test(start_paused = true)]
async fn probe_trips_and_open_breaker_fails_fast_instead_of_queueing() {
    let p = policy();
    let _held = futures(&p, DEFAULT, FP, 10).await;
    p.on_probe(92.5);
    assert_eq!(p.breaker().reason, Some(TripReason::Probe));
    let start = Instant::now();
    let r = refused(&p, DEFAULT, FP).await;
    assert_eq!(
        Instant::now(),
        start,
        "no 300 ms queue wait before shedding"
    );
    assert_eq!(r.kind, RefusalKind::CircuitOpen);
    assert_eq!(
        r.detail,
        "limit: circuit_breaker db_cpu_threshold_percent=85, open_ms=5000"
    );
    assert_eq!(p.callers()[2].queued, 0);
}

#[tokio::test(start_paused = true)]
async fn inflight_threshold_sheds_non_critical_while_over() {
    let mut config = breaker_config();
    config.max_inflight_threshold = Some(3);
    let p = Policy::new(callers(), config).unwrap();
    let held = futures(&p, DEFAULT, FP, 3).await;
    let r = refused(&p, DEFAULT, FP).await;
    assert_eq!(r.kind, RefusalKind::CircuitOpen);
    assert_eq!(r.detail, "limit: circuit_breaker max_inflight_threshold=3");
    assert!(r.message.contains("only critical traffic"), "{}", r.message);
    assert_eq!(
        p.callers()[2].in_flight,
        3,
        "the refused statement's caller slot came back"
    );
    drop(held);
    // Not opened: below the threshold the next statement is admitted at once.
    let _again = futures(&p, DEFAULT, FP, 1).await;
}

#[tokio::test(start_paused = true)]
async fn hot_reload_keeps_in_flight_and_counters() {
    let p = policy();
    let held = futures(&p, ANALYTICS, FP, 5).await;
    let _ = refused(&p, ANALYTICS, FP).await;
    let mut c = callers();
    c[1].max_concurrency = 2;
    c[1].max_qps = Some(100.0);
    let table = p.rebuild(c.clone()).unwrap();
    // Built, not yet installed: the policy's table is still the old one.
    assert_eq!(p.callers()[1].max_concurrency, 5);
    p.install(table, breaker_config());
    let snap = &p.callers()[1];
    assert_eq!(
        (
            snap.max_concurrency,
            snap.in_flight,
            snap.refusals.caller_limit
        ),
        (2, 5, 1)
    );
    assert_eq!((snap.max_qps, snap.burst), (Some(100.0), Some(100)));
    drop(held);
    let _two = futures(&p, ANALYTICS, FP, 2).await;
    assert_eq!(
        refused(&p, ANALYTICS, FP).await.kind,
        RefusalKind::CallerLimitExceeded
    );

    // An invalid table is refused whole; the running one stays.
    let mut bad = c;
    bad[0].max_concurrency = 0;
    let e = p.rebuild(bad).unwrap_err();
    assert_eq!(e.to_string(), "callers[0].max_concurrency: must be >= 1");
    assert_eq!(p.callers()[0].max_concurrency, 2);
    assert_eq!(p.caller_id("service_analytics"), Some(ANALYTICS));
}

#[tokio::test(start_paused = true)]
async fn unknown_caller_id_is_the_default_caller() {
    let p = policy();
    let a = p.admit(&req(999, FP)).await.unwrap();
    assert_eq!(a.caller, DEFAULT);
    assert_eq!(p.callers()[2].in_flight, 1);
}

#[test]
fn invalid_tables_are_refused() {
    type Edit = Box<dyn Fn(&mut Vec<CallerPolicy>)>;
    let cases: Vec<(Edit, &str)> = vec![
        (Box::new(|c| c.clear()), "callers[0].name"),
        (
            Box::new(|c| c[1].name = "service_payment".into()),
            "callers[1].name: duplicate",
        ),
        (
            Box::new(|c| c[2].max_qps = Some(f64::NAN)),
            "callers[2].max_qps",
        ),
        (
            Box::new(|c| c[2].max_qps = Some(-1.0)),
            "callers[2].max_qps",
        ),
        (Box::new(|c| c[2].burst = Some(0)), "callers[2].burst"),
    ];
    for (edit, expected) in cases {
        let mut c = callers();
        edit(&mut c);
        let e = Policy::new(c, breaker_config())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.starts_with(expected), "{e}");
    }
}

#[tokio::test(start_paused = true)]
async fn repeated_refusals_widen_the_retry_window() {
    let p = policy();
    let _held = futures(&p, ANALYTICS, FP, 5).await;
    let hints: Vec<u64> = {
        let mut v = Vec::new();
        for _ in 0..40 {
            v.push(refused(&p, ANALYTICS, FP).await.retry_after_ms);
        }
        v
    };
    assert!(hints[0] <= 50);
    assert!(hints.iter().all(|&h| h <= 5000));
    assert!(hints[20..].iter().any(|&h| h > 400), "{hints:?}");
}

#[tokio::test(start_paused = true)]
async fn snapshots_serialise_for_the_admin_api() {
    let p = policy();
    put(
        &p,
        FP,
        r#"{"action":"THROTTLE","max_qps":2,"ttl_seconds":60}"#,
    );
    let callers = serde_json::to_value(p.callers()).unwrap();
    assert_eq!(callers[1]["name"], "service_analytics");
    assert_eq!(callers[1]["priority"], "low");
    assert_eq!(callers[1]["queue_timeout_ms"], 0);
    assert_eq!(callers[1]["refusals"]["caller_limit"], 0);
    let breaker = serde_json::to_value(p.breaker()).unwrap();
    assert_eq!(breaker["state"], "closed");
    assert_eq!(breaker["config"]["open_ms"], 5000);
    let rules = serde_json::to_value(p.rules().list(Instant::now())).unwrap();
    assert_eq!(rules[0]["fingerprint"], "123456789abcdef0");
    assert_eq!(rules[0]["action"], "THROTTLE");
    assert_eq!(rules[0]["expires_in_ms"], 60_000);
    assert_eq!("high".parse::<Priority>(), Ok(Priority::High));
    assert!("urgent".parse::<Priority>().is_err());
    assert!(Priority::Critical < Priority::Low);
}

/// A transaction's later statements are checked against the breaker but take no ticket of
/// their own: in flight counts the unit once, so a storm of open transactions cannot fill
/// the in-flight threshold (or the critical reserve) with its own later statements.
#[tokio::test(start_paused = true)]
async fn later_statements_of_a_unit_are_not_counted_in_flight_again() {
    let mut config = breaker_config();
    config.max_inflight_threshold = Some(2);
    let p = Policy::new(callers(), config).unwrap();
    let units = futures(&p, DEFAULT, FP, 2).await;
    let mut later = Vec::new();
    for _ in 0..5 {
        later.push(
            p.check_statement(&req(DEFAULT, FP))
                .await
                .expect("a later statement of an admitted unit"),
        );
    }
    assert_eq!(p.breaker().in_flight, 2, "the two units, once each");
    drop((units, later));
    assert_eq!(p.breaker().in_flight, 0);
}

#[tokio::test(start_paused = true)]
async fn decided_at_once_only_when_nothing_can_wait_and_nothing_taken_otherwise() {
    let p = policy();
    let table = p.table();
    // No rule, no max_qps, a free slot: decided here, counted as `admit` counts it.
    let a = p.admit_now(&table, &req(PAYMENT, FP)).unwrap().unwrap();
    let b = p.admit_now(&table, &req(PAYMENT, FP)).unwrap().unwrap();
    assert_eq!((p.callers()[0].in_flight, p.callers()[0].admitted), (2, 2));
    // The caller is full: the queue is `admit_in`'s, and the slot count is untouched.
    assert!(p.admit_now(&table, &req(PAYMENT, FP)).is_none());
    assert_eq!((p.callers()[0].in_flight, p.callers()[0].queued), (2, 0));
    drop((a, b));
    assert_eq!(p.callers()[0].in_flight, 0);
    // Inside a unit: the statement check, decided here too.
    assert!(
        p.check_statement_now(&table, &req(DEFAULT, FP))
            .unwrap()
            .is_ok()
    );

    // Any rule loaded (even for another fingerprint): the rules may wait, so nothing is
    // decided or taken here.
    put(&p, FP + 1, r#"{"action":"REJECT"}"#);
    assert!(p.admit_now(&table, &req(DEFAULT, FP)).is_none());
    assert!(p.check_statement_now(&table, &req(DEFAULT, FP)).is_none());
    assert_eq!(p.callers()[2].in_flight, 0);
    // …and the awaited path still applies the rule.
    let r = refused(&p, DEFAULT, FP + 1).await;
    assert_eq!(r.kind, RefusalKind::QueryBlocked);

    // A caller with max_qps: its bucket may make it wait.
    let mut c = callers();
    c[2].max_qps = Some(100.0);
    let p = Policy::new(c, breaker_config()).unwrap();
    let table = p.table();
    assert!(p.admit_now(&table, &req(DEFAULT, FP)).is_none());
    assert!(p.check_statement_now(&table, &req(DEFAULT, FP)).is_none());
    assert!(p.admit_now(&table, &req(PAYMENT, FP)).unwrap().is_ok());
}
