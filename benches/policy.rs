//! Admission benchmarks for `policy::Policy`: 50 callers (plus `default`) and 1 000 runtime
//! rules (THROTTLE and REJECT on random fingerprints, plus a few TIMEOUT rules), measuring
//! `admit` for a fingerprint with no rule, with a rule that admits (TIMEOUT, THROTTLE under
//! its rate) and with a REJECT rule (the refusal path, message and retry hint included), and
//! `check_statement` for statements inside an admitted transaction.
//!
//! `admit` is async (it may queue), and criterion's async support is not enabled, so each
//! sample runs its whole batch of iterations inside one `block_on` of a current-thread tokio
//! runtime (`iter_custom`): per-iteration `block_on` would mostly measure the runtime's
//! enter/exit. No admission here ever waits, so the runtime is only there to poll the future.
//! Every admission is dropped at once, as a session does when its statement completes.
//!
//! Also the anomaly detector's tick (`detector_tick`): reading the counters of a full
//! statistics table (1 000 fingerprints, 8 callers each) and feeding them to the detector,
//! as the admin task does every `detector.tick_ms`. Statements themselves do no detector work,
//! so this is its whole cost: divide by the tick (250 ms) for the share of a core.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use pgsluice::policy::breaker::BreakerSettings;
use pgsluice::policy::rules::RuleSpec;
use pgsluice::policy::{AdmitRequest, CallerPolicy, Policy, Priority, RetryPolicy};
use tokio::runtime::Runtime;
use tokio::time::Instant;

const CALLERS: u16 = 50;
const RULES: usize = 1_000;
/// THROTTLE rules the "under its rate" case rotates over, so no bucket ever runs dry.
const THROTTLE_ROTATION: usize = 256;

struct Setup {
    policy: Policy,
    /// Fingerprints with an admitting THROTTLE rule (max_qps at the maximum).
    throttled: Vec<u64>,
    rejected: u64,
    timeout: u64,
    unruled: u64,
}

fn callers() -> Vec<CallerPolicy> {
    let prio = [
        Priority::Critical,
        Priority::High,
        Priority::Normal,
        Priority::Low,
    ];
    let mut v: Vec<CallerPolicy> = (0..CALLERS)
        .map(|i| CallerPolicy {
            retry: RetryPolicy::default(),
            idle_transaction_timeout: None,
            weight: 1,
            db_time_share: None,
            name: format!("service_{i}"),
            max_concurrency: 64,
            queue_depth: 100,
            queue_timeout: Duration::from_millis(200),
            priority: prio[usize::from(i) % prio.len()],
            // Every fifth caller has a rate bucket, at the maximum rate so a benchmark
            // loop never empties it.
            max_qps: (i % 5 == 0).then_some(1_000_000.0),
            burst: None,
            scope: pgsluice::policy::Scope::Instance,
        })
        .collect();
    v.push(CallerPolicy {
        retry: RetryPolicy::default(),
        idle_transaction_timeout: None,
        weight: 1,
        db_time_share: None,
        name: "default".into(),
        max_concurrency: 120,
        queue_depth: 1_000,
        queue_timeout: Duration::from_millis(300),
        priority: Priority::Normal,
        max_qps: None,
        burst: None,
        scope: pgsluice::policy::Scope::Instance,
    });
    v
}

/// xorshift64*: deterministic "random" fingerprints without pulling an RNG into the timing.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

fn setup() -> Setup {
    let breaker = BreakerSettings {
        max_inflight_threshold: Some(10_000),
        ..BreakerSettings::default()
    };
    let policy = match Policy::new(callers(), breaker) {
        Ok(p) => p,
        Err(e) => panic!("bench policy: {e}"),
    };
    let rules = policy.rules();
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut throttled = Vec::new();
    let mut rejected = 0;
    for i in 0..RULES - 1 {
        let fp = next(&mut seed);
        let spec = if i % 2 == 0 {
            throttled.push(fp);
            RuleSpec {
                action: Some("THROTTLE".into()),
                max_qps: Some(1_000_000.0),
                action_on_exceed: Some("REJECT".into()),
                ..RuleSpec::default()
            }
        } else {
            rejected = fp;
            RuleSpec {
                action: Some("REJECT".into()),
                error_message: Some("blocked during the incident".into()),
                ..RuleSpec::default()
            }
        };
        if let Err(e) = rules.put(fp, spec) {
            panic!("bench rule: {e}");
        }
    }
    let timeout = next(&mut seed);
    let spec = RuleSpec {
        action: Some("TIMEOUT".into()),
        statement_timeout_ms: Some(2_000),
        ..RuleSpec::default()
    };
    if let Err(e) = rules.put(timeout, spec) {
        panic!("bench rule: {e}");
    }
    assert_eq!(rules.len(), RULES);
    throttled.truncate(THROTTLE_ROTATION);
    Setup {
        policy,
        throttled,
        rejected,
        timeout,
        unruled: next(&mut seed),
    }
}

fn runtime() -> Runtime {
    match tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => panic!("tokio runtime: {e}"),
    }
}

/// Times `iters` admissions of `fp(i)` for rotating callers inside one `block_on`.
fn admit_loop(rt: &Runtime, p: &Policy, iters: u64, fp: impl Fn(u64) -> u64) -> Duration {
    rt.block_on(async {
        let start = std::time::Instant::now();
        for i in 0..iters {
            let req = AdmitRequest {
                caller: (i % u64::from(CALLERS)) as u16,
                fingerprint: fp(i),
                now: Instant::now(),
            };
            let _ = black_box(p.admit(black_box(&req)).await);
        }
        start.elapsed()
    })
}

fn admission(c: &mut Criterion) {
    let s = setup();
    let rt = runtime();
    let p = &s.policy;
    let mut g = c.benchmark_group("policy_admit_50_callers_1000_rules");
    g.bench_function("no_rule", |b| {
        b.iter_custom(|iters| admit_loop(&rt, p, iters, |_| s.unruled))
    });
    g.bench_function("timeout_rule_admitted", |b| {
        b.iter_custom(|iters| admit_loop(&rt, p, iters, |_| s.timeout))
    });
    g.bench_function("throttle_rule_under_rate", |b| {
        b.iter_custom(|iters| {
            admit_loop(&rt, p, iters, |i| {
                s.throttled[(i as usize) % s.throttled.len()]
            })
        })
    });
    g.bench_function("reject_rule_refused", |b| {
        b.iter_custom(|iters| admit_loop(&rt, p, iters, |_| s.rejected))
    });
    g.bench_function("check_statement_no_rule", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = std::time::Instant::now();
                for i in 0..iters {
                    let req = AdmitRequest {
                        caller: (i % u64::from(CALLERS)) as u16,
                        fingerprint: s.unruled,
                        now: Instant::now(),
                    };
                    let _ = black_box(p.check_statement(black_box(&req)).await);
                }
                start.elapsed()
            })
        })
    });
    g.finish();

    // Same lookups with no rules at all: the one-atomic-load fast path.
    let empty = match Policy::new(callers(), BreakerSettings::default()) {
        Ok(p) => p,
        Err(e) => panic!("bench policy: {e}"),
    };
    let mut g = c.benchmark_group("policy_admit_50_callers_0_rules");
    g.bench_function("no_rule", |b| {
        b.iter_custom(|iters| admit_loop(&rt, &empty, iters, |_| s.unruled))
    });
    g.finish();
}

fn detector_tick(c: &mut Criterion) {
    use pgsluice::observe::anomaly::Detector;
    use pgsluice::observe::stats::{FingerprintStats, Outcome};
    let stats = FingerprintStats::new(1_000);
    let text: std::sync::Arc<str> = std::sync::Arc::from("SELECT v FROM t WHERE id = ?");
    let callers: Vec<std::sync::Arc<str>> = (0..8).map(|i| format!("caller{i}").into()).collect();
    let mut seed = 7u64;
    let fps: Vec<u64> = (0..1_000).map(|_| next(&mut seed)).collect();
    let record = |round: usize| {
        for (i, fp) in fps.iter().enumerate() {
            let caller = &callers[(i + round) % callers.len()];
            let took = Duration::from_micros(100 + (i as u64 % 50));
            stats.record(*fp, &text, "read", caller, took, Outcome::Ok { rows: 1 });
        }
    };
    record(0);
    let settings = pgsluice::config::DetectorConfig::default();
    let mut det = Detector::new(settings);
    let mut now = 1_700_000_000_000u64;
    // Past the warm-up, every fingerprint known, so each tick does the whole work.
    for round in 0..50 {
        record(round);
        now += 250;
        det.observe(now, stats.counters());
    }
    c.bench_function("detector_tick_1000_fingerprints", |b| {
        b.iter(|| {
            now += 250;
            black_box(det.observe(now, stats.counters()))
        })
    });
}

criterion_group!(benches, admission, detector_tick);
criterion_main!(benches);
