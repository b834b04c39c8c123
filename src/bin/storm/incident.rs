//! The incident (issue 17): a payment service that must stay fast, an analytics job that is
//! running anyway, and a storm of mobile clients that reconnect at once and flush their
//! offline writes — each storm client a new connection with a full login, retrying the whole
//! session on any error.
//!
//! Timeline: one second of warm-up (payment and analytics connect), `calm` with payment and
//! analytics alone (the baseline), then `clients` storm clients arrive spread over `ramp`
//! (1 500 in 500 ms by default). A storm client's *session* is: connect and log in with
//! `application_name` = the storm's (SCRAM when the target asks for it, the client's PBKDF2
//! included), `BEGIN`, `inserts` INSERTs, `COMMIT`, disconnect. Any failure — at the door,
//! in the transaction, a timeout — ends the attempt (the connection is closed; the proxy or
//! Postgres rolls back) and the client starts a new session after a full-jitter backoff
//! (`random(0, min(cap, base·2^failures))`) or, when the refusal carried `retry_after_ms=N`,
//! after N ms. Sessions not completed `deadline` after the storm began are abandoned. The
//! storm phase lasts until every client has completed or given up; then two seconds of calm.
//!
//! Beside it the whole time: payment, `conns` connections paced at `rate` transactions per
//! second in total (`BEGIN`, a read, a write, `COMMIT`, each tagged `/*service:billing*/`,
//! latency from when the transaction was due) on the probe runtime; analytics, closed-loop
//! connections with `application_name=analytics` running `--analytics-sql` (a 0.5 s query
//! by default), backing off after refusals as the storm does.
//!
//! What it reports besides the usual tables: sessions completed and when the last one did,
//! attempts and retries, how many failures carried a retry hint, the storm's and payment's
//! failures by step and reason, and the session time (first attempt to completion).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::client::{self, Failure};
use super::hist::Histogram;
use super::record::Snapshot;
use super::scenarios::{Ctx, Extra, Op, Phase, Who, warm_up, worker};

/// The critical caller's comment tag (the example config's `service_payment` and a caller
/// named `billing` both match it).
const PAYMENT_TAG: &str = "/*service:billing*/";
/// Label of the storm clients in the tables.
const STORM: &str = "mobile_sync";

/// Shape of the incident.
#[derive(Debug, Clone)]
pub struct IncidentShape {
    pub clients: u64,
    /// INSERTs in a storm session's transaction.
    pub inserts: u64,
    pub ramp: Duration,
    pub calm: Duration,
    /// Longest the storm may last, counted from its first arrival.
    pub deadline: Duration,
    /// Payment connections and transactions per second in total.
    pub payment: (u64, f64),
    pub analytics: u64,
    /// `application_name` of the storm clients.
    pub storm_app: &'static str,
    /// Storm clients connect from 127.0.0.2 … 127.0.0.(1+N), client i from the (i mod N)th,
    /// as clients on N machines would; 0: from wherever the OS chooses (127.0.0.1).
    pub source_addresses: u8,
}

/// Counters the progress line and the report read.
#[derive(Default)]
pub struct IncidentState {
    pub done: AtomicU64,
    /// Session attempts (first tries and retries).
    pub attempts: AtomicU64,
    /// Clients that made at least one attempt.
    pub started: AtomicU64,
    /// Storm connections logged in right now.
    pub connected: AtomicU64,
    /// Microseconds from the storm's start to the last completed session.
    pub last_done_us: AtomicU64,
    /// Failed attempts whose refusal carried `retry_after_ms`, the sum of those hints, and
    /// failed attempts without one.
    pub hinted: AtomicU64,
    pub hint_ms_sum: AtomicU64,
    pub unhinted: AtomicU64,
    /// First attempt → completion, of the completed sessions (µs).
    pub session_time: Mutex<Histogram>,
}

pub async fn run(
    ctx: Arc<Ctx>,
    shape: IncidentShape,
    phase: Arc<Phase>,
    st: Arc<IncidentState>,
) -> Extra {
    let stop = ctx.abort.child_token();
    let mut side = spawn_payment(&ctx, shape.payment, &phase, &stop);
    side.extend(spawn_analytics(&ctx, shape.analytics, &stop));
    warm_up(&ctx, &phase).await;
    tokio::select! {
        _ = tokio::time::sleep(shape.calm) => {}
        _ = ctx.abort.cancelled() => {}
    }
    phase.set(2);
    let t0 = Instant::now();
    let deadline = t0 + shape.deadline;
    let clients: Vec<_> = (0..shape.clients)
        .map(|c| {
            let offset =
                Duration::from_micros(rand::random_range(0..=shape.ramp.as_micros().max(1) as u64));
            tokio::spawn(storm_client(
                ctx.clone(),
                c,
                Timing {
                    start: t0 + offset,
                    deadline,
                    t0,
                },
                shape.clone(),
                st.clone(),
                stop.clone(),
            ))
        })
        .collect();
    for t in clients {
        let _ = t.await;
    }
    let storm_secs = t0.elapsed().as_secs_f64();
    phase.set(3);
    tokio::select! {
        _ = tokio::time::sleep(shape.calm.min(Duration::from_secs(2))) => {}
        _ = ctx.abort.cancelled() => {}
    }
    stop.cancel();
    for t in side {
        let _ = t.await;
    }
    report(&ctx.rec.snapshot(), &shape, &st, storm_secs)
}

/// The scenario's own figures, as (key, value) pairs.
fn report(snap: &Snapshot, shape: &IncidentShape, st: &IncidentState, storm_secs: f64) -> Extra {
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let attempts = load(&st.attempts);
    let hinted = load(&st.hinted);
    let session = st.session_time.lock().clone();
    let secs = |q: f64| {
        session
            .quantile(q)
            .map_or("-".into(), |us| format!("{:.2}", us as f64 / 1e6))
    };
    let (payment_failures, payment_kinds) = failures(snap, |c| c.starts_with("payment"));
    let (_, storm_kinds) = failures(snap, |c| c == STORM);
    let analytics = snap.callers.get("analytics");
    vec![
        ("storm_clients".into(), shape.clients.to_string()),
        ("sessions_completed".into(), load(&st.done).to_string()),
        (
            "last_session_secs".into(),
            format!("{:.2}", load(&st.last_done_us) as f64 / 1e6),
        ),
        ("storm_secs".into(), format!("{storm_secs:.2}")),
        ("session_attempts".into(), attempts.to_string()),
        (
            "session_retries".into(),
            attempts.saturating_sub(load(&st.started)).to_string(),
        ),
        ("session_p50_secs".into(), secs(0.5)),
        ("session_p99_secs".into(), secs(0.99)),
        ("failures_with_hint".into(), hinted.to_string()),
        (
            "failures_without_hint".into(),
            load(&st.unhinted).to_string(),
        ),
        (
            "hint_mean_ms".into(),
            if hinted == 0 {
                "-".into()
            } else {
                format!("{:.0}", load(&st.hint_ms_sum) as f64 / hinted as f64)
            },
        ),
        ("payment_failures".into(), payment_failures.to_string()),
        ("payment_failure_kinds".into(), payment_kinds),
        ("storm_failure_kinds".into(), storm_kinds),
        (
            "analytics_ok".into(),
            analytics.map_or(0, |c| c.ok).to_string(),
        ),
        (
            "analytics_refused_or_failed".into(),
            analytics.map_or(0, |c| c.refused + c.errors).to_string(),
        ),
    ]
}

/// Total failures of the callers `pick` selects, and the commonest reasons as
/// `N× reason; …` (at most six, then how many others).
fn failures(snap: &Snapshot, pick: impl Fn(&str) -> bool) -> (u64, String) {
    let mut by: std::collections::BTreeMap<&str, u64> = Default::default();
    for ((caller, _, reason), n) in &snap.reasons {
        if pick(caller) {
            *by.entry(reason.as_str()).or_default() += n;
        }
    }
    let total = by.values().sum();
    let mut v: Vec<_> = by.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let mut parts: Vec<String> = v.iter().take(6).map(|(r, n)| format!("{n}× {r}")).collect();
    let rest: u64 = v.iter().skip(6).map(|(_, n)| n).sum();
    if rest > 0 {
        parts.push(format!("{rest}× other"));
    }
    if parts.is_empty() {
        parts.push("none".into());
    }
    (total, parts.join("; "))
}

/// Payment: paced transactions on the probe runtime, so the storm's tasks cannot delay the
/// measurement inside the tool.
fn spawn_payment(
    ctx: &Arc<Ctx>,
    (conns, rate): (u64, f64),
    phase: &Arc<Phase>,
    stop: &CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    if conns == 0 || rate <= 0.0 {
        return Vec::new();
    }
    let pace = Duration::from_secs_f64(conns as f64 / rate);
    let op: Op = Arc::new(|ctx: &Ctx, c, seq| {
        let id = rand::random_range(1..=ctx.rows.max(1));
        (
            "payment",
            vec![
                format!("{PAYMENT_TAG} BEGIN"),
                format!("{PAYMENT_TAG} SELECT v FROM pgsluice_storm_kv WHERE id = {id}"),
                ctx.expand(&ctx.sql.billing, c, seq),
                format!("{PAYMENT_TAG} COMMIT"),
            ],
        )
    });
    (0..conns)
        .map(|c| {
            ctx.probe.spawn(worker(
                ctx.clone(),
                2_000_000 + c,
                Who {
                    name: "payment",
                    critical: true,
                    phase: Some(phase.clone()),
                    application_name: Some("payment"),
                },
                Some(pace),
                op.clone(),
                stop.clone(),
            ))
        })
        .collect()
}

/// Analytics: closed-loop connections running the analytics query.
fn spawn_analytics(
    ctx: &Arc<Ctx>,
    conns: u64,
    stop: &CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    let op: Op =
        Arc::new(|ctx: &Ctx, c, seq| ("analytics", vec![ctx.expand(&ctx.sql.analytics, c, seq)]));
    (0..conns)
        .map(|c| {
            tokio::spawn(worker(
                ctx.clone(),
                1_000_000 + c,
                Who {
                    name: "analytics",
                    critical: false,
                    phase: None,
                    application_name: Some("analytics"),
                },
                None,
                op.clone(),
                stop.clone(),
            ))
        })
        .collect()
}

/// When a storm client arrives, when it must give up, and the storm's start.
#[derive(Clone, Copy)]
struct Timing {
    start: Instant,
    deadline: Instant,
    t0: Instant,
}

async fn storm_client(
    ctx: Arc<Ctx>,
    id: u64,
    at: Timing,
    shape: IncidentShape,
    st: Arc<IncidentState>,
    stop: CancellationToken,
) {
    tokio::select! {
        _ = tokio::time::sleep_until(at.start) => {}
        _ = stop.cancelled() => return,
    }
    st.started.fetch_add(1, Ordering::Relaxed);
    let first = Instant::now();
    let mut failed = 0u32;
    loop {
        let left = at.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        st.attempts.fetch_add(1, Ordering::Relaxed);
        let r = tokio::select! {
            r = tokio::time::timeout(left, session(&ctx, id, &shape, &st)) => r,
            _ = stop.cancelled() => return,
        };
        let f = match r {
            // The deadline passed mid-session: abandoned.
            Err(_) => return,
            Ok(Ok(())) => {
                let now = Instant::now();
                ctx.rec.session_done();
                st.done.fetch_add(1, Ordering::Relaxed);
                st.last_done_us.fetch_max(
                    now.saturating_duration_since(at.t0).as_micros() as u64,
                    Ordering::Relaxed,
                );
                st.session_time
                    .lock()
                    .record(now.saturating_duration_since(first).as_micros() as u64);
                return;
            }
            Ok(Err(f)) => f,
        };
        match f.retry_after_ms() {
            Some(ms) => {
                st.hinted.fetch_add(1, Ordering::Relaxed);
                st.hint_ms_sum.fetch_add(ms, Ordering::Relaxed);
            }
            None => {
                st.unhinted.fetch_add(1, Ordering::Relaxed);
            }
        }
        let pause = ctx.retry.delay(failed, &f);
        if pause >= at.deadline.saturating_duration_since(Instant::now()) {
            return;
        }
        tokio::select! {
            _ = client::sleep_or_yield(pause) => {}
            _ = stop.cancelled() => return,
        }
        failed = failed.saturating_add(1);
    }
}

/// One whole session: log in, BEGIN, the INSERTs, COMMIT, disconnect. Every step is an
/// arrival; the login and each statement are recorded under the storm's label, failures
/// with the step in front of the reason.
async fn session(
    ctx: &Ctx,
    id: u64,
    shape: &IncidentShape,
    st: &IncidentState,
) -> Result<(), Failure> {
    ctx.rec.arrival();
    let began = Instant::now();
    let local = (shape.source_addresses > 0).then(|| {
        let host = 2 + (id % u64::from(shape.source_addresses)) as u8;
        std::net::IpAddr::from([127, 0, 0, host])
    });
    let r = client::connect_from(&ctx.target, Some(shape.storm_app), local)
        .await
        .map_err(|f| f.at("login"));
    ctx.rec.connect(STORM, began, r.as_ref().map(|_| ()));
    let mut conn = r?;
    let _connected = Connected::new(&st.connected);
    let mut steps = Vec::with_capacity(shape.inserts as usize + 2);
    steps.push(("BEGIN", "BEGIN".to_owned()));
    for seq in 0..shape.inserts {
        steps.push(("INSERT", ctx.expand(&ctx.sql.write, id, seq)));
    }
    steps.push(("COMMIT", "COMMIT".to_owned()));
    let mut outcome = Ok(());
    for (step, sql) in &steps {
        ctx.rec.arrival();
        let began = Instant::now();
        let r = client::run(&mut conn, sql).await.map_err(|f| f.at(step));
        ctx.rec
            .statement(STORM, false, began, r.as_ref().map(|_| ()));
        if let Err(f) = r {
            outcome = Err(f);
            break;
        }
    }
    client::terminate(conn).await;
    outcome
}

/// Counts a logged-in storm connection while it lives (also when the deadline drops the
/// session mid-way).
struct Connected<'a>(&'a AtomicU64);

impl<'a> Connected<'a> {
    fn new(n: &'a AtomicU64) -> Self {
        n.fetch_add(1, Ordering::Relaxed);
        Connected(n)
    }
}

impl Drop for Connected<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storm::record::Recorder;

    #[test]
    fn failures_are_summed_and_ranked_per_caller() {
        let rec = Recorder::new(Duration::from_millis(100));
        let refusal = |reason: &str| Failure::Refused {
            reason: reason.into(),
            retry_after_ms: Some(10),
            fatal: false,
        };
        let began = Instant::now();
        for _ in 0..3 {
            rec.connect(STORM, began, Err(&refusal("53300 busy").at("login")));
        }
        rec.statement(
            STORM,
            false,
            began,
            Err(&refusal("53300 ERR_X").at("BEGIN")),
        );
        rec.statement("payment storm", true, began, Err(&refusal("53000 ERR_Y")));
        let snap = rec.snapshot();
        let (n, kinds) = failures(&snap, |c| c == STORM);
        assert_eq!(n, 4);
        assert_eq!(kinds, "3× login: 53300 busy; 1× BEGIN: 53300 ERR_X");
        let (n, kinds) = failures(&snap, |c| c.starts_with("payment"));
        assert_eq!((n, kinds.as_str()), (1, "1× 53000 ERR_Y"));
        assert_eq!(failures(&snap, |c| c == "nobody").1, "none");
    }
}
