//! The pattern-step scenario (issue 18): steady traffic from several patterns and a critical
//! caller; then one fingerprint steps `factor` times (30 by default) within `ramp` (500 ms),
//! as a retry loop or a deploy's N+1 query would. Against pgsluice, a poller on the probe
//! runtime reads `GET /v1/anomalies` every 50 ms and reports how long the detector took to
//! name the stepped pattern, what else it named (false positives), and when a rule was in
//! place on it (`auto_rules.mode: enforce`). Billing's latency before and during the step
//! is in the usual per-caller table (`billing calm`, `billing step`).
//!
//! Without `--step` the same steady traffic runs for the whole duration: every anomaly named
//! is a false positive (the 10-minute steady run of the issue).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use pgsluice::classify::{Classifier, fingerprint_hex};
use pgsluice::cli::{AdminConn, admin_get};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::scenarios::{Ctx, Extra, Op, Phase, Who, spawn_billing, warm_up, worker};

/// The stepped pattern's default (`--hot-sql`): a range aggregate of a few milliseconds, so
/// that 30 times its rate saturates a small database; `{id}` a random row.
pub const HOT_SQL: &str =
    "/*service:web*/ SELECT sum(v) FROM pgsluice_storm_kv WHERE id BETWEEN {id} AND {id} + 20000";
/// The steady patterns next to it.
const STEADY_SQL: [&str; 3] = [
    "/*service:web*/ SELECT v, pad FROM pgsluice_storm_kv WHERE id = {id}",
    "/*service:web*/ SELECT count(*) FROM pgsluice_storm_kv WHERE id BETWEEN {id} AND {id} + 10",
    "/*service:reports*/ SELECT max(v) FROM pgsluice_storm_kv WHERE id BETWEEN {id} AND {id} + 100",
];

pub struct StepShape {
    pub calm: Duration,
    /// How long the stepped (or, without a step, the steady) phase runs.
    pub duration: Duration,
    pub billing: (u64, f64),
    /// Statements per second of the steady patterns together, and of the hot one before the step.
    pub steady_rate: f64,
    pub hot_rate: f64,
    /// The hot pattern's rate after the step, as a multiple of `hot_rate`.
    pub factor: f64,
    pub ramp: Duration,
    pub step: bool,
    /// The stepped pattern (`{id}`: a random row).
    pub hot_sql: String,
    /// pgsluice's admin API, for `/v1/anomalies`.
    pub admin: Option<AdminConn>,
}

/// One anomaly as first seen by the poller.
struct Seen {
    at: Duration,
    subject: String,
    signal: String,
    what: String,
}

/// What the poller saw.
#[derive(Default)]
struct Watch {
    /// By subject key (`fingerprint:…` / `caller:…`): first sighting.
    seen: BTreeMap<String, Seen>,
    /// When a rule was first seen on the hot fingerprint (and its origin).
    rule: Option<(Duration, String)>,
    polls: u64,
    failures: u64,
}

fn paced(rate: f64, conns: u64) -> Duration {
    Duration::from_secs_f64(conns as f64 / rate.max(0.001))
}

fn spawn_workers(
    ctx: &Arc<Ctx>,
    first: u64,
    conns: u64,
    pace: Duration,
    op: &Op,
    stop: &CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..conns)
        .map(|c| {
            tokio::spawn(worker(
                ctx.clone(),
                first + c,
                Who {
                    name: "web",
                    critical: false,
                    phase: None,
                    application_name: None,
                },
                Some(pace),
                op.clone(),
                stop.clone(),
            ))
        })
        .collect()
}

pub async fn run(ctx: Arc<Ctx>, shape: StepShape, phase: Arc<Phase>) -> Extra {
    let stop = ctx.abort.child_token();
    let hot_fp = fingerprint_hex(
        Classifier::new(0, 64 * 1024)
            .classify(&shape.hot_sql.replace("{id}", "1"))
            .fingerprint,
    );
    let billing = spawn_billing(&ctx, shape.billing, &phase, &stop);
    let steady_op: Op = Arc::new(|ctx: &Ctx, c, seq| {
        let sql = STEADY_SQL[rand::random_range(0..STEADY_SQL.len())];
        ("steady", vec![ctx.expand(sql, c, seq)])
    });
    let hot_sql = shape.hot_sql.clone();
    let hot_op: Op = Arc::new(move |ctx: &Ctx, c, seq| ("hot", vec![ctx.expand(&hot_sql, c, seq)]));
    let mut tasks = billing;
    tasks.extend(spawn_workers(
        &ctx,
        3_000_000,
        4,
        paced(shape.steady_rate, 4),
        &steady_op,
        &stop,
    ));
    tasks.extend(spawn_workers(
        &ctx,
        4_000_000,
        2,
        paced(shape.hot_rate, 2),
        &hot_op,
        &stop,
    ));
    let watch = Arc::new(parking_lot::Mutex::new(Watch::default()));
    let origin = Instant::now();
    let step_at = Arc::new(parking_lot::Mutex::new(None::<Instant>));
    let poller = shape.admin.clone().map(|conn| {
        let (watch, stop, step_at, hot_fp) =
            (watch.clone(), stop.clone(), step_at.clone(), hot_fp.clone());
        ctx.probe.spawn(async move {
            poll(conn, watch, stop, origin, step_at, hot_fp).await;
        })
    });
    warm_up(&ctx, &phase).await;
    tokio::select! {
        _ = tokio::time::sleep(shape.calm) => {}
        _ = ctx.abort.cancelled() => {}
    }
    let extra_conns = 16u64;
    if shape.step {
        phase.set(2);
        *step_at.lock() = Some(Instant::now());
        // The step: more connections running the hot pattern, arriving within `ramp`.
        let pace = paced(shape.hot_rate * (shape.factor - 1.0), extra_conns);
        for c in 0..extra_conns {
            let gap = shape.ramp.as_secs_f64() / extra_conns as f64;
            tokio::time::sleep(Duration::from_secs_f64(gap)).await;
            tasks.extend(spawn_workers(&ctx, 5_000_000 + c, 1, pace, &hot_op, &stop));
        }
    }
    tokio::select! {
        _ = tokio::time::sleep(shape.duration) => {}
        _ = ctx.abort.cancelled() => {}
    }
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    if let Some(p) = poller {
        let _ = p.await;
    }
    report(&watch.lock(), &shape, &hot_fp, *step_at.lock(), origin)
}

/// Polls `/v1/anomalies` every 50 ms until `stop`, and the hot fingerprint's rule once the
/// step began.
async fn poll(
    conn: AdminConn,
    watch: Arc<parking_lot::Mutex<Watch>>,
    stop: CancellationToken,
    origin: Instant,
    step_at: Arc<parking_lot::Mutex<Option<Instant>>>,
    hot_fp: String,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let rule_path = format!("/v1/rules/fingerprint/{hot_fp}");
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => break,
        }
        let now = origin.elapsed();
        match admin_get(&conn, "/v1/anomalies").await {
            Ok(v) => {
                let mut w = watch.lock();
                w.polls += 1;
                for a in v["anomalies"].as_array().into_iter().flatten() {
                    let subject = a["subject"].as_str().unwrap_or("?").to_owned();
                    let id = a["fingerprint"]
                        .as_str()
                        .or(a["caller"].as_str())
                        .unwrap_or("?");
                    let key = format!("{subject}:{id}");
                    w.seen.entry(key).or_insert_with(|| Seen {
                        at: now,
                        subject,
                        signal: a["signal"].as_str().unwrap_or("?").to_owned(),
                        what: a["normalized"]
                            .as_str()
                            .or(a["caller"].as_str())
                            .unwrap_or("?")
                            .to_owned(),
                    });
                }
            }
            Err(_) => watch.lock().failures += 1,
        }
        let stepped = step_at.lock().is_some();
        if stepped
            && watch.lock().rule.is_none()
            && let Ok(r) = admin_get(&conn, &rule_path).await
        {
            let origin_of = r["origin"].as_str().unwrap_or("operator").to_owned();
            watch.lock().rule = Some((origin.elapsed(), origin_of));
        }
    }
}

fn report(
    w: &Watch,
    shape: &StepShape,
    hot_fp: &str,
    step_at: Option<Instant>,
    origin: Instant,
) -> Extra {
    let step = step_at.map(|s| s.duration_since(origin));
    let ms = |d: Duration| format!("{}", d.as_millis());
    let hot_key = format!("fingerprint:{hot_fp}");
    let mut extra: Extra = vec![
        ("hot_fingerprint".into(), hot_fp.to_owned()),
        ("hot_rate_per_s".into(), format!("{}", shape.hot_rate)),
        (
            "step".into(),
            if shape.step {
                format!("{}x within {} ms", shape.factor, shape.ramp.as_millis())
            } else {
                "none (steady run)".into()
            },
        ),
    ];
    if shape.admin.is_none() {
        extra.push((
            "detection".into(),
            "not measured (no --admin: the target is not pgsluice)".into(),
        ));
        return extra;
    }
    extra.push(("anomaly_polls".into(), format!("{}", w.polls)));
    extra.push(("anomaly_poll_failures".into(), format!("{}", w.failures)));
    match (w.seen.get(&hot_key), step) {
        (Some(s), Some(step)) if s.at >= step => {
            extra.push(("detected_after_step_ms".into(), ms(s.at - step)));
            extra.push(("detected_signal".into(), s.signal.clone()));
        }
        (_, Some(_)) => extra.push(("detected_after_step_ms".into(), "never".into())),
        _ => {}
    }
    if let (Some((at, origin_of)), Some(step)) = (&w.rule, step) {
        extra.push(("rule_in_place_after_step_ms".into(), ms(*at - step)));
        extra.push(("rule_origin".into(), origin_of.clone()));
    }
    // False positives: anything named before the step, or any other fingerprint after it.
    // The stepped caller (`web`) naming itself after the step is right, not false.
    let mut false_positives = Vec::new();
    for (key, s) in &w.seen {
        let before = step.is_none_or(|st| s.at < st);
        let right = !before && (*key == hot_key || key == "caller:web");
        if !right {
            false_positives.push(format!(
                "{} {} at {:.1}s ({})",
                s.subject,
                s.signal,
                s.at.as_secs_f64(),
                s.what
            ));
        }
    }
    extra.push((
        "false_positives".into(),
        format!("{}", false_positives.len()),
    ));
    for (i, f) in false_positives.iter().take(10).enumerate() {
        extra.push((format!("false_positive_{i}"), f.clone()));
    }
    extra
}
