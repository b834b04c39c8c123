//! The load shapes other than the reconnect storm (`reconnect.rs`): steady read/write mixes,
//! the noisy neighbour, and idle connections held open — plus what they share: the run
//! context, the phase label, one worker loop (paced or closed-loop), table setup and the
//! progress line on stderr.
//!
//! Callers are told apart by SQL comment tags (`/*service:billing*/ …`), which pgsluice
//! resolves per statement; direct Postgres and PgBouncer simply ignore the comment. Paced
//! workers measure latency from when each statement was *due*, not when it was sent, so a
//! stalled target shows up as latency instead of silently lowering the rate.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use pgsluice::pool::backend::{BackendConn, ConnectParams};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::client::{self, Failure, Retry};
use super::record::Recorder;

/// SQL templates; `{id}` becomes a random row id, `{client}` and `{seq}` the client number
/// and its statement counter.
#[derive(Debug, Clone)]
pub struct Sql {
    pub billing: String,
    pub analytics: String,
    pub read: String,
    pub write: String,
}

/// Everything a scenario needs.
pub struct Ctx {
    pub target: ConnectParams,
    pub rec: Arc<Recorder>,
    pub retry: Retry,
    /// Rows in the key/value table, for `{id}`.
    pub rows: u32,
    pub sql: Sql,
    /// Cancelled on Ctrl-C: every loop stops.
    pub abort: CancellationToken,
    /// A runtime of its own (one thread) for the critical caller and the monitor, so that
    /// thousands of load tasks on the main runtime cannot starve the measurement: the OS
    /// shares the CPU between threads, tokio would queue the probe behind the herd.
    pub probe: tokio::runtime::Handle,
}

impl Ctx {
    pub fn expand(&self, template: &str, client: u64, seq: u64) -> String {
        let id = rand::random_range(1..=self.rows.max(1));
        template
            .replace("{id}", &id.to_string())
            .replace("{client}", &client.to_string())
            .replace("{seq}", &seq.to_string())
    }
}

/// Scenario-specific results, as (key, value) pairs for the report and the summary file.
pub type Extra = Vec<(String, String)>;

/// The current phase name, shared by workers whose label follows it (`billing calm`).
pub struct Phase {
    names: &'static [&'static str],
    at: AtomicUsize,
}

impl Phase {
    pub fn new(names: &'static [&'static str]) -> Arc<Self> {
        Arc::new(Self {
            names,
            at: AtomicUsize::new(0),
        })
    }

    pub fn set(&self, i: usize) {
        self.at
            .store(i.min(self.names.len() - 1), Ordering::Relaxed);
    }

    pub fn name(&self) -> &'static str {
        self.names[self.at.load(Ordering::Relaxed).min(self.names.len() - 1)]
    }
}

/// What a worker runs: `(caller label, statements)` for client `c`, round `seq`. One
/// statement is the usual case; several are a transaction sent one statement at a time
/// (`BEGIN` … `COMMIT`, as a driver does), measured as one round from when it was due to the
/// last ReadyForQuery, and rolled back when a statement fails part-way.
pub type Op = Arc<dyn Fn(&Ctx, u64, u64) -> (&'static str, Vec<String>) + Send + Sync>;

/// Who runs a worker: the label its connects are counted under, whether its statements are
/// the critical caller's, the phase its labels follow and the `application_name` it logs in
/// with.
#[derive(Clone)]
pub struct Who {
    pub name: &'static str,
    pub critical: bool,
    pub phase: Option<Arc<Phase>>,
    pub application_name: Option<&'static str>,
}

impl Who {
    fn label(&self, base: &str) -> String {
        match &self.phase {
            Some(p) => format!("{base} {}", p.name()),
            None => base.to_owned(),
        }
    }
}

/// One connection's loop until `stop`: paced at `pace` (a due time every `pace`, no retry
/// pause — the pace is the pause; a worker that falls behind catches up back-to-back) or closed-loop (next statement as soon as the last one is
/// done, pausing per the retry policy after a failure). Reconnects after fatal failures.
pub async fn worker(
    ctx: Arc<Ctx>,
    client: u64,
    who: Who,
    pace: Option<Duration>,
    op: Op,
    stop: CancellationToken,
) {
    let critical = who.critical;
    let mut conn: Option<BackendConn> = None;
    let mut next = Instant::now()
        + pace.map_or(Duration::ZERO, |p| {
            Duration::from_micros(rand::random_range(0..=p.as_micros() as u64))
        });
    let (mut seq, mut attempt) = (0u64, 0u32);
    loop {
        let due = match pace {
            Some(p) => {
                // Behind schedule (the last statement overran its slot): latency counts from
                // when this one was due. On schedule: from when it is sent, so the timer's
                // own wake-up lag (up to a millisecond) is not charged to the target.
                let due = if Instant::now() >= next {
                    next
                } else {
                    tokio::select! {
                        _ = tokio::time::sleep_until(next) => {}
                        _ = stop.cancelled() => break,
                    }
                    Instant::now()
                };
                next += p;
                due
            }
            None if stop.is_cancelled() => break,
            None => Instant::now(),
        };
        let failure = match conn.as_mut() {
            None => {
                let name = who.label(who.name);
                ctx.rec.arrival();
                let began = Instant::now();
                let r = tokio::select! {
                    r = client::connect_as(&ctx.target, who.application_name) => r,
                    _ = stop.cancelled() => break,
                };
                match r {
                    Ok(c) => {
                        ctx.rec.connect(&name, began, Ok(()));
                        conn = Some(c);
                        // The statement it connected for runs at once; connecting is
                        // measured apart, so the schedule restarts from here.
                        next = Instant::now();
                        None
                    }
                    Err(f) => {
                        ctx.rec.connect(&name, began, Err(&f));
                        Some(f)
                    }
                }
            }
            Some(c) => {
                let (base, statements) = op(&ctx, client, seq);
                let name = who.label(base);
                ctx.rec.arrival();
                let r = tokio::select! {
                    r = run_round(c, &statements) => r,
                    _ = stop.cancelled() => break,
                };
                ctx.rec
                    .statement(&name, critical, due, r.as_ref().map(|_| ()));
                seq += 1;
                r.err()
            }
        };
        match failure {
            None => attempt = 0,
            Some(f) => {
                if f.fatal() {
                    conn = None;
                }
                if pace.is_none() {
                    tokio::select! {
                        _ = ctx.retry.pause(attempt, &f) => {}
                        _ = stop.cancelled() => break,
                    }
                }
                attempt = attempt.saturating_add(1);
            }
        }
    }
    if let Some(c) = conn {
        client::terminate(c).await;
    }
}

/// Runs one round's statements in order; a failure part-way through a transaction is
/// followed by a `ROLLBACK` (with the round's comment tag, so a proxy files it under the same
/// caller), and a connection whose rollback fails is given up.
async fn run_round(conn: &mut BackendConn, statements: &[String]) -> Result<(), Failure> {
    for sql in statements {
        let Err(mut f) = client::run(conn, sql).await else {
            continue;
        };
        if statements.len() > 1 && !f.fatal() {
            let tag = leading_comment(&statements[0]);
            if client::run(conn, &format!("{tag} ROLLBACK")).await.is_err() {
                f.set_fatal();
            }
        }
        return Err(f);
    }
    Ok(())
}

/// The `/* … */` comment a statement starts with, or "".
fn leading_comment(sql: &str) -> &str {
    sql.strip_prefix("/*")
        .and_then(|rest| rest.find("*/"))
        .map_or("", |end| &sql[..end + 4])
}

/// Creates and fills the scenario tables (idempotent), through the target as its user.
pub async fn setup(params: &ConnectParams, rows: u32) -> Result<(), String> {
    let mut conn = client::connect(params)
        .await
        .map_err(|f| format!("setup connection failed: {f:?}"))?;
    let sql = format!(
        "CREATE TABLE IF NOT EXISTS pgsluice_storm_kv (id int PRIMARY KEY, v bigint NOT NULL DEFAULT 0, pad text NOT NULL);\
         INSERT INTO pgsluice_storm_kv SELECT g, 0, md5(g::text) FROM generate_series(1, {rows}) g ON CONFLICT DO NOTHING;\
         CREATE TABLE IF NOT EXISTS pgsluice_storm_writes (id bigserial PRIMARY KEY, client int NOT NULL, seq int NOT NULL, at timestamptz NOT NULL DEFAULT now());\
         ANALYZE pgsluice_storm_kv"
    );
    let r = client::run(&mut conn, &sql).await;
    client::terminate(conn).await;
    r.map_err(|f| format!("setup failed: {f:?}"))
}

/// Prints one progress line a second on stderr until `stop`.
pub fn progress(
    rec: Arc<Recorder>,
    phase: Option<Arc<Phase>>,
    extra: Arc<dyn Fn() -> String + Send + Sync>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            let now = Instant::now();
            let from = now.checked_sub(Duration::from_secs(1)).unwrap_or(now);
            let (w, max) = rec.window(from, now);
            let ms = |v: Option<u64>| v.map_or("-".into(), |us| format!("{:.1}", us as f64 / 1e3));
            eprintln!(
                "[{:6.1}s] {:<6} attempts/s {:>6}  ok/s {:>6}  refused/s {:>5}  errors/s {:>5}  p99 {:>7} ms  critical p99 {:>7} ms  backends {:>4} (max {:>4})  {}",
                now.saturating_duration_since(rec.start()).as_secs_f64(),
                phase.as_ref().map_or("", |p| p.name()),
                w.arrivals,
                w.admitted,
                w.refused,
                w.errors,
                ms(w.latency.quantile(0.99)),
                ms(w.critical.quantile(0.99)),
                w.backends.map_or("-".into(), |b| b.to_string()),
                max.map_or("-".into(), |b| b.to_string()),
                extra(),
            );
        }
    })
}

/// Read/write mix on `clients` connections for `duration`, closed-loop or paced at `rate`
/// statements per second in total.
pub async fn steady(
    ctx: Arc<Ctx>,
    clients: u64,
    read_pct: u8,
    rate: Option<f64>,
    duration: Duration,
) -> Extra {
    let stop = ctx.abort.child_token();
    let pace = rate
        .filter(|r| *r > 0.0)
        .map(|r| Duration::from_secs_f64(clients as f64 / r));
    let op: Op = Arc::new(move |ctx: &Ctx, c, seq| {
        if rand::random_range(0..100u8) < read_pct {
            ("read", vec![ctx.expand(&ctx.sql.read, c, seq)])
        } else {
            ("write", vec![ctx.expand(&ctx.sql.write, c, seq)])
        }
    });
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            tokio::spawn(worker(
                ctx.clone(),
                c,
                Who {
                    name: "web",
                    critical: false,
                    phase: None,
                    application_name: None,
                },
                pace,
                op.clone(),
                stop.clone(),
            ))
        })
        .collect();
    tokio::select! {
        _ = tokio::time::sleep(duration) => {}
        _ = ctx.abort.cancelled() => {}
    }
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    vec![("clients".into(), clients.to_string())]
}

/// Billing runs at a steady rate alone (`warmup`, `calm`), then analytics floods with `flood_conns`
/// closed-loop connections for `duration` (`flood`) while billing carries on.
pub async fn noisy(
    ctx: Arc<Ctx>,
    billing: (u64, f64),
    flood_conns: u64,
    calm: Duration,
    duration: Duration,
    phase: Arc<Phase>,
) -> Extra {
    let stop = ctx.abort.child_token();
    let billing_tasks = spawn_billing(&ctx, billing, &phase, &stop);
    warm_up(&ctx, &phase).await;
    tokio::select! {
        _ = tokio::time::sleep(calm) => {}
        _ = ctx.abort.cancelled() => {}
    }
    phase.set(2);
    let op: Op =
        Arc::new(|ctx: &Ctx, c, seq| ("analytics", vec![ctx.expand(&ctx.sql.analytics, c, seq)]));
    let flood: Vec<_> = (0..flood_conns)
        .map(|c| {
            tokio::spawn(worker(
                ctx.clone(),
                1_000_000 + c,
                Who {
                    name: "analytics",
                    critical: false,
                    phase: None,
                    application_name: None,
                },
                None,
                op.clone(),
                stop.clone(),
            ))
        })
        .collect();
    tokio::select! {
        _ = tokio::time::sleep(duration) => {}
        _ = ctx.abort.cancelled() => {}
    }
    stop.cancel();
    for t in billing_tasks.into_iter().chain(flood) {
        let _ = t.await;
    }
    vec![
        ("analytics_connections".into(), flood_conns.to_string()),
        ("billing_rate_per_s".into(), format!("{}", billing.1)),
    ]
}

/// One second in phase 0 (`warmup`: billing connects, the proxy opens its server
/// connections, caches warm up), then phase 1 (`calm`).
pub async fn warm_up(ctx: &Ctx, phase: &Phase) {
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        _ = ctx.abort.cancelled() => {}
    }
    phase.set(1);
}

/// `conns` paced billing (critical caller) workers sharing `rate` statements per second.
pub fn spawn_billing(
    ctx: &Arc<Ctx>,
    (conns, rate): (u64, f64),
    phase: &Arc<Phase>,
    stop: &CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    if conns == 0 || rate <= 0.0 {
        return Vec::new();
    }
    let pace = Duration::from_secs_f64(conns as f64 / rate);
    let op: Op =
        Arc::new(|ctx: &Ctx, c, seq| ("billing", vec![ctx.expand(&ctx.sql.billing, c, seq)]));
    (0..conns)
        .map(|c| {
            ctx.probe.spawn(worker(
                ctx.clone(),
                2_000_000 + c,
                Who {
                    name: "billing",
                    critical: true,
                    phase: Some(phase.clone()),
                    application_name: None,
                },
                Some(pace),
                op.clone(),
                stop.clone(),
            ))
        })
        .collect()
}

/// Opens `clients` logged-in connections (at most `concurrency` handshakes at once), has each
/// run `sql` once when given, holds them for `hold`, then closes them. `ready` is written (with
/// the count) once every connection has been attempted, so a script can measure the target
/// meanwhile. A connection whose statement fails is not held.
pub async fn idle(
    ctx: Arc<Ctx>,
    clients: u64,
    concurrency: usize,
    hold: Duration,
    ready: Option<std::path::PathBuf>,
    sql: Option<String>,
) -> Extra {
    let sql = Arc::new(sql);
    let gate = Arc::new(Semaphore::new(concurrency.max(1)));
    let held = Arc::new(AtomicU64::new(0));
    let release = ctx.abort.child_token();
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(clients as usize);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    for _ in 0..clients {
        let (ctx, gate, held, release, tx, sql) = (
            ctx.clone(),
            gate.clone(),
            held.clone(),
            release.clone(),
            tx.clone(),
            sql.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let conn = {
                let Ok(_permit) = gate.acquire().await else {
                    return;
                };
                ctx.rec.arrival();
                let began = Instant::now();
                let r = client::connect(&ctx.target).await;
                ctx.rec.connect("idle", began, r.as_ref().map(|_| ()));
                match (r, sql.as_deref()) {
                    (Ok(mut c), Some(sql)) => {
                        let due = Instant::now();
                        let r = client::run(&mut c, sql).await;
                        ctx.rec
                            .statement("idle", false, due, r.as_ref().map(|_| ()));
                        r.ok().map(|()| c)
                    }
                    (r, _) => r.ok(),
                }
            };
            let _ = tx.send(());
            if let Some(c) = conn {
                held.fetch_add(1, Ordering::Relaxed);
                release.cancelled().await;
                client::terminate(c).await;
            }
        }));
    }
    drop(tx);
    let mut attempted = 0u64;
    while attempted < clients {
        tokio::select! {
            r = rx.recv() => match r {
                Some(()) => attempted += 1,
                None => break,
            },
            _ = ctx.abort.cancelled() => break,
        }
    }
    let connect_secs = started.elapsed().as_secs_f64();
    let n = held.load(Ordering::Relaxed);
    eprintln!(
        "holding {n} of {clients} connections for {hold:?} (connected in {connect_secs:.1} s)"
    );
    if let Some(path) = &ready
        && let Err(e) = std::fs::write(path, format!("{n}\n"))
    {
        eprintln!("cannot write {}: {e}", path.display());
    }
    tokio::select! {
        _ = tokio::time::sleep(hold) => {}
        _ = ctx.abort.cancelled() => {}
    }
    release.cancel();
    for t in tasks {
        let _ = t.await;
    }
    vec![
        ("idle_connections_held".into(), n.to_string()),
        ("idle_connect_secs".into(), format!("{connect_secs:.2}")),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rollback_keeps_the_rounds_tag() {
        assert_eq!(
            leading_comment("/*service:billing*/ BEGIN"),
            "/*service:billing*/"
        );
        assert_eq!(leading_comment("BEGIN /*x*/"), "");
        assert_eq!(leading_comment("/* unterminated BEGIN"), "");
    }
}
