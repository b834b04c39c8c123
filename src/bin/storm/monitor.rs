//! Counts the database's client backends while a scenario runs, on one direct connection
//! opened *before* the load starts (a storm may leave no connection slot for it later; a
//! superuser still gets one of the reserved slots).
//!
//! The count is `pg_stat_activity` rows with `backend_type = 'client backend'` of the
//! target's user, minus the monitor's own: through a proxy those are the proxy's server
//! connections for that user's pool; direct, the clients themselves. Filtering by user keeps
//! other tenants of the cluster (another pooler's idle server connections, say) out of it.

use std::sync::Arc;
use std::time::Duration;

use pgsluice::pool::backend::ConnectParams;
use tokio_util::sync::CancellationToken;

use super::client;
use super::record::Recorder;

fn count_sql(user: &str) -> String {
    format!(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() AND usename = '{}'",
        user.replace('\'', "''")
    )
}

/// Connects now (so a failure is reported before any load starts), then polls every
/// `every` until `stop` is cancelled, feeding readings to `rec`; the polling runs on `on`
/// (the probe runtime, away from the load).
pub async fn start(
    params: &ConnectParams,
    user: &str,
    rec: Arc<Recorder>,
    every: Duration,
    stop: CancellationToken,
    on: &tokio::runtime::Handle,
) -> Result<tokio::task::JoinHandle<()>, String> {
    let mut conn = client::connect(params)
        .await
        .map_err(|f| format!("monitor connection failed: {f:?}"))?;
    let sql = count_sql(user);
    // Probe once so a bad monitor URL fails loudly instead of silently reporting nothing.
    conn.first_value(&sql)
        .await
        .map_err(|e| format!("monitor query failed: {e}"))?;
    Ok(on.spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => break,
            }
            match conn.first_value(&sql).await {
                Ok(Some(v)) => {
                    if let Ok(n) = v.parse::<u64>() {
                        rec.backends(n);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    eprintln!("monitor: {e}; stopping the backend count");
                    return;
                }
            }
        }
        client::terminate(conn).await;
    }))
}
