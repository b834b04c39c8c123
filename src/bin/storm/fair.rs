//! The `fair-share` scenario: two callers of one priority with very different transaction
//! lengths — `lookup` (`application_name` lookup, `--clients` closed-loop connections running
//! `SELECT 1`) and `report` (`application_name` report, `--analytics-conns` closed-loop
//! connections running `--analytics-sql`, by default `SELECT pg_sleep(0.8)`). The lookups run
//! alone first (`calm`), then with the reports (`reports`): their latency percentiles by
//! phase show whether they queue behind the reports. Run it against pgsluice with
//! `pool.fair_shares` off and on (a small pool, both callers in `callers:` at one priority)
//! to compare.

use std::sync::Arc;
use std::time::Duration;

use super::scenarios::{Ctx, Extra, Op, Phase, Who, warm_up, worker};

/// The lookups' statement.
const LOOKUP_SQL: &str = "SELECT 1";

/// Lookups alone for `calm`, then with `reports` report connections for `duration`.
pub async fn run(
    ctx: Arc<Ctx>,
    lookups: u64,
    reports: u64,
    calm: Duration,
    duration: Duration,
    phase: Arc<Phase>,
) -> Extra {
    let stop = ctx.abort.child_token();
    let lookup: Op = Arc::new(|_: &Ctx, _, _| ("lookup", vec![LOOKUP_SQL.to_owned()]));
    // The lookups are the measured caller: on the probe runtime, counted as critical (the
    // progress line's "critical p99"), whatever priority the proxy gives them.
    let lookup_tasks: Vec<_> = (0..lookups)
        .map(|c| {
            ctx.probe.spawn(worker(
                ctx.clone(),
                3_000_000 + c,
                Who {
                    name: "lookup",
                    critical: true,
                    phase: Some(phase.clone()),
                    application_name: Some("lookup"),
                },
                None,
                lookup.clone(),
                stop.clone(),
            ))
        })
        .collect();
    warm_up(&ctx, &phase).await;
    tokio::select! {
        _ = tokio::time::sleep(calm) => {}
        _ = ctx.abort.cancelled() => {}
    }
    phase.set(2);
    let report: Op =
        Arc::new(|ctx: &Ctx, c, seq| ("report", vec![ctx.expand(&ctx.sql.analytics, c, seq)]));
    let report_tasks: Vec<_> = (0..reports)
        .map(|c| {
            tokio::spawn(worker(
                ctx.clone(),
                4_000_000 + c,
                Who {
                    name: "report",
                    critical: false,
                    phase: None,
                    application_name: Some("report"),
                },
                None,
                report.clone(),
                stop.clone(),
            ))
        })
        .collect();
    tokio::select! {
        _ = tokio::time::sleep(duration) => {}
        _ = ctx.abort.cancelled() => {}
    }
    stop.cancel();
    for t in lookup_tasks.into_iter().chain(report_tasks) {
        let _ = t.await;
    }
    vec![
        ("lookup_connections".into(), lookups.to_string()),
        ("report_connections".into(), reports.to_string()),
    ]
}
