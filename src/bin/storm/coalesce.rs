//! The `coalesce` scenario: `--clients` connections log in first, then all send the same
//! read (`--hot-sql`, default an aggregate over the key/value table) within `--ramp-ms`, once
//! each. Run it against pgsluice without and with a COALESCE rule on the read's pattern (and
//! against Postgres directly) to compare: the clients' latency percentiles (caller `read`),
//! how many times Postgres ran the read, and Postgres's CPU.
//!
//! Both Postgres readings need `--monitor` (a superuser connection straight to the server):
//! executions are the scans of the key/value table in `pg_stat_user_tables`; CPU is read from
//! `/proc` for the postmaster and its children (reaped ones included), so the tool must run
//! on the database's machine for that one (`postgres_cpu_secs` is left out otherwise).

use std::sync::Arc;
use std::time::Duration;

use pgsluice::pool::backend::ConnectParams;
use tokio::sync::{Barrier, Semaphore};
use tokio::time::Instant;

use super::client;
use super::scenarios::{Ctx, Extra};

/// The default read: the same text for every client (no `{id}`).
pub const HOT_SQL: &str =
    "SELECT count(*), sum(v), max(pad) FROM pgsluice_storm_kv WHERE id <= 50000";

/// Handshakes at once while the clients log in.
const LOGINS_AT_ONCE: usize = 100;

/// Scans of the key/value table so far, as Postgres counts them (a fresh statistics
/// snapshot each call: every simple query is a transaction of its own).
async fn scans(conn: &mut pgsluice::pool::backend::BackendConn) -> Option<i64> {
    let v = conn
        .first_value(
            "SELECT coalesce(sum(seq_scan + coalesce(idx_scan, 0)), 0) FROM pg_stat_user_tables \
             WHERE relname = 'pgsluice_storm_kv'",
        )
        .await
        .ok()??;
    v.parse().ok()
}

/// CPU seconds of the postmaster whose data directory the monitor names, its live children
/// and the children it reaped; `None` when `/proc` does not have it (another machine).
async fn postgres_cpu(conn: &mut pgsluice::pool::backend::BackendConn) -> Option<f64> {
    let dir = conn.first_value("SHOW data_directory").await.ok()??;
    let pid_file = std::fs::read_to_string(format!("{dir}/postmaster.pid")).ok()?;
    let pid: u32 = pid_file.lines().next()?.trim().parse().ok()?;
    let ticks = |pid: u32, reaped: bool| -> Option<(u64, u32)> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the command (which may hold spaces) : state is field 3.
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split(' ').collect();
        let ppid: u32 = f.get(1)?.parse().ok()?;
        let n = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        // utime, stime are fields 14, 15; cutime, cstime 16, 17 (1-based, state = 3).
        let own = n(11) + n(12);
        Some((if reaped { own + n(13) + n(14) } else { own }, ppid))
    };
    let mut total = ticks(pid, true)?.0;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some((t, ppid)) = ticks(child, false)
            && ppid == pid
        {
            total += t;
        }
    }
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some(total as f64 / hz)
}

/// The scenario; `monitor`: a direct superuser connection for the Postgres readings.
pub async fn run(
    ctx: Arc<Ctx>,
    clients: u64,
    sql: String,
    ramp: Duration,
    monitor: Option<ConnectParams>,
) -> Extra {
    let mut probe = match &monitor {
        Some(p) => client::connect(p).await.ok(),
        None => None,
    };
    let n = usize::try_from(clients).unwrap_or(usize::MAX).max(1);
    let gate = Arc::new(Semaphore::new(LOGINS_AT_ONCE));
    // Every client logs in, then waits here until all have, then sends at its moment.
    let ready = Arc::new(Barrier::new(n + 1));
    let start = Arc::new(tokio::sync::OnceCell::<Instant>::new());
    let sql = Arc::new(sql);
    let mut tasks = Vec::with_capacity(n);
    for c in 0..n {
        let (ctx, gate, ready, start, sql) = (
            ctx.clone(),
            gate.clone(),
            ready.clone(),
            start.clone(),
            sql.clone(),
        );
        let offset = ramp.mul_f64(c as f64 / n as f64);
        tasks.push(tokio::spawn(async move {
            let conn = {
                let _permit = gate.acquire().await;
                let began = Instant::now();
                let r = client::connect(&ctx.target).await;
                ctx.rec.connect("read", began, r.as_ref().map(|_| ()));
                r.ok()
            };
            ready.wait().await;
            let Some(mut conn) = conn else { return };
            let at = *start.get().expect("set before the barrier opens") + offset;
            tokio::time::sleep_until(at).await;
            ctx.rec.arrival();
            let r = client::run(&mut conn, &sql).await;
            ctx.rec.statement("read", false, at, r.as_ref().map(|_| ()));
            client::terminate(conn).await;
        }));
    }
    let (scans_before, cpu_before) = match probe.as_mut() {
        Some(p) => {
            // The table's setup (or a previous run) may not be counted yet: wait until the
            // count stands still.
            let mut last = scans(p).await;
            loop {
                tokio::time::sleep(Duration::from_millis(1100)).await;
                let now = scans(p).await;
                if now == last {
                    break;
                }
                last = now;
            }
            (last, postgres_cpu(p).await)
        }
        None => (None, None),
    };
    let _ = start.set(Instant::now() + Duration::from_millis(200));
    ready.wait().await;
    let began = Instant::now();
    for t in tasks {
        let _ = t.await;
    }
    let secs = began.elapsed().as_secs_f64();
    let mut extra: Extra = vec![("coalesce_all_answered_secs".into(), format!("{secs:.3}"))];
    if let Some(p) = probe.as_mut() {
        // An idle backend reports its statistics within 1 s, or within 10 s when its first
        // try found the shared statistics busy.
        tokio::time::sleep(Duration::from_secs(11)).await;
        if let (Some(b), Some(a)) = (scans_before, scans(p).await) {
            extra.push(("postgres_executions".into(), (a - b).to_string()));
        }
        if let (Some(b), Some(a)) = (cpu_before, postgres_cpu(p).await) {
            extra.push(("postgres_cpu_secs".into(), format!("{:.2}", a - b)));
        }
        client::terminate(probe.take().expect("probe")).await;
    }
    extra
}
