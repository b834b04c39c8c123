//! `pgsluice-storm`: drives a target (direct Postgres, PgBouncer or pgsluice) with load
//! scenarios and reports what the database and its callers went through.
//!
//! Scenarios: `reconnect-storm` (N clients arrive within 500 ms and flush queued writes,
//! retrying naively or with full-jitter backoff), `incident` (issue 17's: payment and
//! analytics running, then 1 500 clients each log in anew, run BEGIN + 5 INSERTs + COMMIT and
//! retry the whole session on any error), `noisy-neighbour` (an analytics flood next to a
//! steady critical billing caller), `pattern-step` (one query pattern steps 30x among steady
//! traffic; how fast pgsluice's detector names it), `fair-share` (2 ms lookups next to 800 ms
//! reports of the same priority: do the lookups queue behind them?), `coalesce` (identical
//! reads all at once, for COALESCE rules), `steady` (read/write mix) and `idle` (hold N logged-in
//! connections, for memory measurements). Output: per-caller throughput and
//! latency, refusals and errors by reason, the most backend connections seen (with
//! `--monitor`) on stdout; progress on stderr; optionally a CSV time series, an SVG chart and
//! a `key value` summary for scripts. See `storm/mod.rs` for the module map.

mod storm;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use tokio_util::sync::CancellationToken;

use storm::client::{self, Retry, RetryMode};
use storm::record::Recorder;
use storm::scenarios::{self, Ctx, Phase, Sql};
use storm::{chart, monitor, report};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    /// N clients connect within --ramp-ms and each flushes --writes INSERTs.
    ReconnectStorm,
    /// Payment (paced transactions) and analytics run; then --clients clients arrive within
    /// --ramp-ms, each logging in anew for BEGIN + --writes INSERTs + COMMIT, and retry the
    /// whole session (new connection, new login) on any error.
    Incident,
    /// Analytics floods with --analytics-conns connections while billing runs at a steady rate.
    NoisyNeighbour,
    /// Steady patterns and billing, then one pattern steps --step-factor times within
    /// --ramp-ms; with --admin, how long pgsluice's detector took to name it (issue 18).
    PatternStep,
    /// Lookups (`SELECT 1`, application_name lookup) on --clients connections, alone and then
    /// with reports (--analytics-sql, default `SELECT pg_sleep(0.8)`, application_name
    /// report) on --analytics-conns connections: compare pgsluice's pool.fair_shares off/on.
    FairShare,
    /// --clients connections log in, then all send the same read (--hot-sql) within
    /// --ramp-ms: compare pgsluice without and with a COALESCE rule (with --monitor: Postgres's
    /// executions of the read and its CPU).
    Coalesce,
    /// Read/write mix on --clients connections.
    Steady,
    /// Hold --clients logged-in idle connections for --hold-secs.
    Idle,
}

#[derive(Parser, Debug)]
#[command(
    name = "pgsluice-storm",
    version,
    about = "Load and storm scenarios against Postgres, PgBouncer or pgsluice"
)]
struct Cli {
    /// Where the load goes: postgres://USER:PASSWORD@HOST:PORT/DB.
    #[arg(long)]
    target: String,
    #[arg(long, value_enum)]
    scenario: Scenario,
    /// A direct connection to the database (superuser): counts the target user's backends
    /// in pg_stat_activity every --monitor-ms.
    #[arg(long)]
    monitor: Option<String>,
    #[arg(long, default_value_t = 100)]
    monitor_ms: u64,
    /// Clients [default: reconnect-storm 5000, incident 1500, coalesce 1000, steady 16, idle 10000;
    /// fair-share: 2 lookup connections].
    #[arg(long)]
    clients: Option<u64>,
    /// Reconnect storm: writes each client flushes; incident: INSERTs in each session.
    #[arg(long, default_value_t = 5)]
    writes: u64,
    /// Incident: application_name of the storm clients.
    #[arg(long, default_value = "mobile_sync")]
    storm_application_name: String,
    /// Incident: storm clients connect from this many loopback addresses (127.0.0.2 …), as
    /// clients on that many machines; 0 = the OS's choice (all from 127.0.0.1). Loopback
    /// targets only.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=250))]
    storm_source_addresses: u8,
    /// Reconnect storm: seconds a client keeps its connection after flushing its writes,
    /// as an application's connection pool would.
    #[arg(long, default_value_t = 5.0)]
    linger_secs: f64,
    /// Reconnect storm: window in which all clients arrive.
    #[arg(long, default_value_t = 500)]
    ramp_ms: u64,
    /// What a client does after a failure.
    #[arg(long, value_enum, default_value = "backoff")]
    retry: RetryMode,
    /// Backoff: sleep = random(0, min(cap, base·2^attempt)) unless the proxy hints
    /// [default: base 10 ms, cap 2 000 ms; incident: 100 ms, 5 000 ms].
    #[arg(long)]
    backoff_base_ms: Option<u64>,
    #[arg(long)]
    backoff_cap_ms: Option<u64>,
    /// Storms and noisy neighbour: seconds of billing alone (incident: payment and
    /// analytics) before the load starts, after one second of warm-up that is reported
    /// apart, so connecting and cold caches do not count as "calm" [default: 3; incident: 4,
    /// so the storm starts at t = 5 s].
    #[arg(long)]
    calm_secs: Option<f64>,
    /// Steady and noisy neighbour: how long the load runs; storms: the deadline after which
    /// unfinished work is abandoned [default: 20; incident: 60].
    #[arg(long)]
    duration_secs: Option<f64>,
    /// Critical caller (`/*service:billing*/`): connections and total statements per second
    /// (incident: transactions per second) [default: 4 at 100/s; incident: 20 at 400/s].
    #[arg(long)]
    billing_conns: Option<u64>,
    #[arg(long)]
    billing_rate: Option<f64>,
    /// Noisy neighbour and incident: closed-loop analytics connections; fair-share: report
    /// connections [default: 32; incident: 16; fair-share: 6].
    #[arg(long)]
    analytics_conns: Option<u64>,
    /// Steady: percentage of reads.
    #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(u8).range(0..=100))]
    read_pct: u8,
    /// Steady: total statements per second (default: closed loop, as fast as it goes).
    #[arg(long)]
    rate: Option<f64>,
    /// Pattern step: pgsluice's admin API (`/v1/anomalies` is polled every 50 ms).
    #[arg(long)]
    admin: Option<std::net::SocketAddr>,
    /// Pattern step: a read token for --admin.
    #[arg(long, env = "PGSLUICE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Pattern step: the hot pattern's rate before the step, per second.
    #[arg(long, default_value_t = 20.0)]
    hot_rate: f64,
    /// Pattern step: the hot pattern's rate after the step, as a multiple of --hot-rate.
    #[arg(long, default_value_t = 30.0)]
    step_factor: f64,
    /// Pattern step: the steady patterns' rate, per second, all together.
    #[arg(long, default_value_t = 200.0)]
    steady_rate: f64,
    /// Pattern step: the stepped pattern [default: a range aggregate of a few ms];
    /// coalesce: the read every client sends [default: an aggregate over 50 000 rows].
    #[arg(long)]
    hot_sql: Option<String>,
    /// Pattern step: no step, steady traffic for --duration-secs (every anomaly named is a
    /// false positive).
    #[arg(long)]
    no_step: bool,
    /// Idle: seconds to hold the connections once all are open.
    #[arg(long, default_value_t = 10)]
    hold_secs: u64,
    /// Idle: handshakes in flight at once.
    #[arg(long, default_value_t = 200)]
    connect_concurrency: usize,
    /// Idle: file written (with the number held) once all connections are attempted.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Idle: a statement each connection runs once after its login, before it is held (an
    /// application's idle pool: its connections have all run queries before).
    #[arg(long)]
    idle_sql: Option<String>,
    #[arg(long, default_value_t = 10_000)]
    connect_timeout_ms: u64,
    /// Width of a time-series slot.
    #[arg(long, default_value_t = 100)]
    bucket_ms: u64,
    /// Time series: t, arrivals/admitted/refused/errors per second, p50/p99, backends.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Chart of arrival rate, admitted rate, latency and backends over time.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// `key value` summary for scripts.
    #[arg(long)]
    summary: Option<PathBuf>,
    /// Rows of the key/value table the statements use.
    #[arg(long, default_value_t = 100_000)]
    rows: u32,
    /// Do not create/fill the tables (pgsluice_storm_kv, pgsluice_storm_writes).
    #[arg(long)]
    no_setup: bool,
    /// Runtime worker threads [default: one per core].
    #[arg(long)]
    threads: Option<usize>,
    /// Nice value (0-19) of the threads that run the load — storm clients, analytics, setup —
    /// while the critical billing/payment caller and the monitor keep the tool's priority on
    /// a thread of their own. On one machine the storm clients' own login work (SCRAM's
    /// PBKDF2 on the client side) competes with the database and the proxy for the cores,
    /// which clients on other machines would not; a positive value hands that CPU back to
    /// the system under test.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i32).range(0..=19))]
    load_nice: i32,
    /// Run the load's threads under SCHED_IDLE as well: below any nice value, so a thread at
    /// the tool's priority (payment, the monitor) that wakes runs at once instead of taking
    /// turns with hundreds of busy PBKDF2 threads of its own process. Across processes
    /// nothing changes: the kernel shares the cores between the tool, the proxy and
    /// Postgres as before.
    #[arg(long)]
    load_idle: bool,
    /// SQL templates: {id} = random row, {client}, {seq}.
    #[arg(
        long,
        default_value = "/*service:billing*/ UPDATE pgsluice_storm_kv SET v = v + 1 WHERE id = {id}"
    )]
    billing_sql: String,
    /// [default: a full-scan aggregate; incident: `/*service:analytics*/ SELECT pg_sleep(0.5)`;
    /// fair-share: `SELECT pg_sleep(0.8)`]
    #[arg(long)]
    analytics_sql: Option<String>,
    #[arg(
        long,
        default_value = "/*service:web*/ SELECT v, pad FROM pgsluice_storm_kv WHERE id = {id}"
    )]
    read_sql: String,
    /// [default: `/*service:web*/ INSERT …`; incident: the same INSERT untagged, the storm
    /// clients being known by their application_name]
    #[arg(long)]
    write_sql: Option<String>,
}

impl Cli {
    fn clients(&self) -> u64 {
        self.clients.unwrap_or(match self.scenario {
            Scenario::ReconnectStorm => 5_000,
            Scenario::Incident => 1_500,
            Scenario::Steady => 16,
            Scenario::FairShare => 2,
            Scenario::Coalesce => 1_000,
            Scenario::Idle => 10_000,
            Scenario::NoisyNeighbour | Scenario::PatternStep => 0,
        })
    }

    fn incident(&self) -> bool {
        self.scenario == Scenario::Incident
    }

    /// A setting whose default depends on the scenario: `(others, incident)`.
    fn or<T: Copy>(&self, v: Option<T>, (others, incident): (T, T)) -> T {
        v.unwrap_or(if self.incident() { incident } else { others })
    }

    fn calm_secs(&self) -> f64 {
        if self.scenario == Scenario::PatternStep {
            // Past the detector's 10 s warm-up, with some baseline after it.
            return self.calm_secs.unwrap_or(15.0);
        }
        self.or(self.calm_secs, (3.0, 4.0))
    }

    fn duration_secs(&self) -> f64 {
        self.or(self.duration_secs, (20.0, 60.0))
    }

    fn billing(&self) -> (u64, f64) {
        (
            self.or(self.billing_conns, (4, 20)),
            self.or(self.billing_rate, (100.0, 400.0)),
        )
    }

    fn analytics_conns(&self) -> u64 {
        if self.scenario == Scenario::FairShare {
            return self.analytics_conns.unwrap_or(6);
        }
        self.or(self.analytics_conns, (32, 16))
    }

    fn analytics_sql(&self) -> String {
        self.analytics_sql.clone().unwrap_or_else(|| {
            if self.incident() {
                "/*service:analytics*/ SELECT pg_sleep(0.5)".into()
            } else if self.scenario == Scenario::FairShare {
                "SELECT pg_sleep(0.8)".into()
            } else {
                "/*service:analytics*/ SELECT count(*), sum(v) FROM pgsluice_storm_kv WHERE pad LIKE '%ab%'".into()
            }
        })
    }

    fn write_sql(&self) -> String {
        let insert = "INSERT INTO pgsluice_storm_writes (client, seq) VALUES ({client}, {seq})";
        self.write_sql.clone().unwrap_or_else(|| {
            if self.incident() {
                insert.into()
            } else {
                format!("/*service:web*/ {insert}")
            }
        })
    }

    fn secs(v: f64, name: &str) -> Result<Duration, String> {
        Duration::try_from_secs_f64(v)
            .map_err(|_| format!("--{name} must be a number of seconds >= 0"))
    }
}

/// The soft open-files limit, from /proc (no libc dependency needed).
fn open_files_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Lowers the calling thread's CPU priority to `nice` (Linux nice values are per thread),
/// and with `idle` its policy to SCHED_IDLE. Failure is harmless: the thread keeps the
/// process' priority.
fn lower_thread_priority(nice: i32, idle: bool) {
    // SAFETY: plain system calls on the calling thread's own id (0 = the calling thread for
    // sched_setscheduler); the parameter struct lives on this stack frame.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, nice);
        if idle {
            let param = libc::sched_param { sched_priority: 0 };
            libc::sched_setscheduler(0, libc::SCHED_IDLE, &param);
        }
    }
}

/// Connections this process will hold at once.
fn needed_fds(cli: &Cli) -> u64 {
    let base = cli.billing().0 + 16;
    match cli.scenario {
        Scenario::NoisyNeighbour => base + cli.analytics_conns(),
        Scenario::FairShare => base + cli.analytics_conns() + cli.clients(),
        Scenario::PatternStep => base + 22,
        Scenario::Incident => base + cli.analytics_conns() + cli.clients(),
        _ => base + cli.clients(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(limit) = open_files_limit()
        && needed_fds(&cli) > limit
    {
        eprintln!(
            "warning: up to {} connections but the open-files limit is {limit}; raise it (ulimit -n) or connections will fail with EMFILE (counted as errors)",
            needed_fds(&cli)
        );
    }
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.enable_all();
    if let Some(n) = cli.threads {
        rt.worker_threads(n.max(1));
    }
    if cli.load_nice > 0 || cli.load_idle {
        let (nice, idle) = (cli.load_nice, cli.load_idle);
        rt.on_thread_start(move || lower_thread_priority(nice, idle));
    }
    let rt = match rt.build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pgsluice-storm: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let probe = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("storm-probe")
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pgsluice-storm: cannot start the probe runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(cli, probe.handle().clone())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pgsluice-storm: {e}");
            ExitCode::from(1)
        }
    }
}

async fn run(cli: Cli, probe: tokio::runtime::Handle) -> Result<(), String> {
    let timeout = Duration::from_millis(cli.connect_timeout_ms.max(1));
    let target = client::params(&cli.target, timeout).map_err(|e| format!("--target: {e}"))?;
    let monitor_params = cli
        .monitor
        .as_deref()
        .map(|m| client::params(m, timeout).map_err(|e| format!("--monitor: {e}")))
        .transpose()?;
    let shown_target = format!(
        "{}@{}:{}/{}",
        target.user, target.host, target.port, target.database
    );
    let ctx_user = target.user.clone();
    let calm = Cli::secs(cli.calm_secs(), "calm-secs")?;
    let duration = Cli::secs(cli.duration_secs(), "duration-secs")?;
    let scenario_name = cli
        .scenario
        .to_possible_value()
        .map_or("?".to_owned(), |v| v.get_name().to_owned());

    if cli.scenario != Scenario::Idle && !cli.no_setup {
        scenarios::setup(&target, cli.rows).await?;
    }

    let rec = Arc::new(Recorder::new(Duration::from_millis(cli.bucket_ms)));
    let abort = CancellationToken::new();
    {
        let abort = abort.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("interrupted: stopping and reporting what was measured");
                abort.cancel();
            }
        });
    }
    let done = CancellationToken::new();
    let monitor = match &monitor_params {
        Some(p) => Some(
            monitor::start(
                p,
                &ctx_user,
                rec.clone(),
                Duration::from_millis(cli.monitor_ms.max(10)),
                done.clone(),
                &probe,
            )
            .await?,
        ),
        None => None,
    };
    let ctx = Arc::new(Ctx {
        target,
        rec: rec.clone(),
        retry: Retry {
            mode: cli.retry,
            base: Duration::from_millis(cli.or(cli.backoff_base_ms, (10, 100))),
            cap: Duration::from_millis(cli.or(cli.backoff_cap_ms, (2_000, 5_000))),
        },
        rows: cli.rows,
        sql: Sql {
            billing: cli.billing_sql.clone(),
            analytics: cli.analytics_sql(),
            read: cli.read_sql.clone(),
            write: cli.write_sql(),
        },
        abort,
        probe,
    });
    let billing = cli.billing();
    let clients = cli.clients();

    let extra = match cli.scenario {
        Scenario::ReconnectStorm => {
            let phase = Phase::new(&["warmup", "calm", "storm", "after"]);
            let st = Arc::new(storm::reconnect::StormState::default());
            let shown = st.clone();
            let line = Arc::new(move || {
                format!(
                    "clients done {}/{clients}  flushed {}  connected {}",
                    shown.done_clients.load(Ordering::Relaxed),
                    shown.flushed.load(Ordering::Relaxed),
                    shown.connected_now.load(Ordering::Relaxed)
                )
            });
            let progress =
                scenarios::progress(rec.clone(), Some(phase.clone()), line, done.clone());
            let shape = storm::reconnect::StormShape {
                clients,
                writes: cli.writes,
                ramp: Duration::from_millis(cli.ramp_ms),
                calm,
                deadline: duration,
                linger: Cli::secs(cli.linger_secs, "linger-secs")?,
                billing,
            };
            let extra = storm::reconnect::run(ctx, shape, phase, st).await;
            drop(progress);
            extra
        }
        Scenario::Incident => {
            let phase = Phase::new(&["warmup", "calm", "storm", "after"]);
            let st = Arc::new(storm::incident::IncidentState::default());
            let shown = st.clone();
            let line = Arc::new(move || {
                format!(
                    "sessions done {}/{clients}  attempts {}  logged in {}",
                    shown.done.load(Ordering::Relaxed),
                    shown.attempts.load(Ordering::Relaxed),
                    shown.connected.load(Ordering::Relaxed)
                )
            });
            let progress =
                scenarios::progress(rec.clone(), Some(phase.clone()), line, done.clone());
            let shape = storm::incident::IncidentShape {
                clients,
                inserts: cli.writes,
                ramp: Duration::from_millis(cli.ramp_ms),
                calm,
                deadline: duration,
                payment: billing,
                analytics: cli.analytics_conns(),
                storm_app: cli.storm_application_name.clone().leak(),
                source_addresses: cli.storm_source_addresses,
            };
            let extra = storm::incident::run(ctx, shape, phase, st).await;
            drop(progress);
            extra
        }
        Scenario::NoisyNeighbour => {
            let phase = Phase::new(&["warmup", "calm", "flood"]);
            let _progress = scenarios::progress(
                rec.clone(),
                Some(phase.clone()),
                Arc::new(String::new),
                done.clone(),
            );
            scenarios::noisy(ctx, billing, cli.analytics_conns(), calm, duration, phase).await
        }
        Scenario::PatternStep => {
            let phase = Phase::new(&["warmup", "calm", "step"]);
            let _progress = scenarios::progress(
                rec.clone(),
                Some(phase.clone()),
                Arc::new(String::new),
                done.clone(),
            );
            let shape = storm::step::StepShape {
                calm,
                duration,
                billing,
                steady_rate: cli.steady_rate,
                hot_rate: cli.hot_rate,
                factor: cli.step_factor.max(1.0),
                ramp: Duration::from_millis(cli.ramp_ms),
                step: !cli.no_step,
                hot_sql: cli
                    .hot_sql
                    .clone()
                    .unwrap_or_else(|| storm::step::HOT_SQL.to_owned()),
                admin: cli
                    .admin
                    .map(|admin| pgsluice::cli::AdminConn::at(admin, cli.admin_token.clone())),
            };
            storm::step::run(ctx, shape, phase).await
        }
        Scenario::FairShare => {
            let phase = Phase::new(&["warmup", "calm", "reports"]);
            let _progress = scenarios::progress(
                rec.clone(),
                Some(phase.clone()),
                Arc::new(String::new),
                done.clone(),
            );
            let reports = cli.analytics_conns();
            storm::fair::run(ctx, clients, reports, calm, duration, phase).await
        }
        Scenario::Coalesce => {
            let _progress =
                scenarios::progress(rec.clone(), None, Arc::new(String::new), done.clone());
            let sql = cli
                .hot_sql
                .clone()
                .unwrap_or_else(|| storm::coalesce::HOT_SQL.to_owned());
            let ramp = Duration::from_millis(cli.ramp_ms);
            storm::coalesce::run(ctx, clients, sql, ramp, monitor_params.clone()).await
        }
        Scenario::Steady => {
            let _progress =
                scenarios::progress(rec.clone(), None, Arc::new(String::new), done.clone());
            scenarios::steady(ctx, clients, cli.read_pct, cli.rate, duration).await
        }
        Scenario::Idle => {
            let hold = Duration::from_secs(cli.hold_secs);
            scenarios::idle(
                ctx,
                clients,
                cli.connect_concurrency,
                hold,
                cli.ready_file.clone(),
                cli.idle_sql.clone(),
            )
            .await
        }
    };
    done.cancel();
    if let Some(m) = monitor {
        let _ = m.await;
    }
    let mut extra = extra;
    extra.push(("logins_by_method".into(), storm::login::methods_seen()));

    let snap = rec.snapshot();
    let title = format!(
        "pgsluice-storm {scenario_name} → {shown_target} (retry {})",
        cli.retry
            .to_possible_value()
            .map_or("?".to_owned(), |v| v.get_name().to_owned())
    );
    print!("{}", report::tables(&title, &snap, &extra));
    if let Some(p) = &cli.csv {
        report::write(p, "CSV", &report::csv(&snap))?;
    }
    if let Some(p) = &cli.svg {
        report::write(p, "chart", &chart::svg(&title, &snap))?;
    }
    if let Some(p) = &cli.summary {
        report::write(
            p,
            "summary",
            &report::summary(&scenario_name, &snap, &extra),
        )?;
    }
    Ok(())
}
