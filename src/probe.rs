//! The circuit breaker's health probe, run every `probe_interval_ms` on its own connection
//! (logged in as `backend.url`'s user): either the DBA's `probe_sql` (its first column read as
//! a number, e.g. the host's CPU % from an extension), or — with `db_cpu_threshold_percent`
//! and no `probe_sql` — the built-in database-load estimate, which needs no extension.
//!
//! The built-in estimate reads the database's queueing delay: it times [`SAMPLES`]
//! back-to-back `SELECT 1` round trips and keeps the fastest (`current`), and keeps the
//! fastest `current` of the last [`BASELINE_READINGS`] intervals (`baseline`, the idle cost of
//! a round trip). A saturated server (CPU, or a run queue of backends) makes even the
//! fastest trivial query wait, so `load % = 100 × (1 − baseline / current)` — the busy share
//! a single queue shows at that stretch (response time = service time / (1 − utilisation)).
//! Stretches smaller than [`NOISE`] read as 0, and the value reported is the lowest of the
//! last [`SUSTAINED`] readings (the load must hold for that many intervals), so scheduler
//! jitter on an idle or briefly busy box cannot trip the breaker. It measures saturation as the database's clients feel it, not the CPU
//! counter: a database that is slow because of locks shows nothing here (statement timeouts
//! and the error streak cover that).
//!
//! Every reading feeds the breaker and the `pgsluice_breaker_probe_value` gauge; a probe that
//! cannot connect or fails counts as a backend fault.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::app::App;
use crate::config::Config;
use crate::pool::backend::{BackendConn, ConnectError, ConnectParams};

/// Round trips timed per built-in reading.
pub const SAMPLES: usize = 5;
/// Readings the baseline is the fastest of (10 minutes at the default 1 s interval).
pub const BASELINE_READINGS: usize = 600;
/// Stretch of the fastest round trip over the baseline below which the load reads 0.
pub const NOISE: Duration = Duration::from_millis(1);
/// Readings in a row the reported load is the lowest of.
pub const SUSTAINED: usize = 3;

/// What the probe runs, from the configuration.
#[derive(Debug, Clone, PartialEq)]
pub enum Probe {
    /// `probe_sql`: its value is the reading.
    Sql(String),
    /// The built-in load estimate.
    Load,
}

impl Probe {
    /// The probe `cfg` asks for, if any: `probe_sql`, else the built-in one when a load
    /// threshold is set or a pool runs the adaptive limit.
    pub fn of(cfg: &Config) -> Option<Probe> {
        let b = &cfg.global_defaults.circuit_breaker;
        match (&b.probe_sql, b.db_cpu_threshold_percent) {
            (Some(sql), _) => Some(Probe::Sql(sql.clone())),
            (None, Some(_)) => Some(Probe::Load),
            (None, None) if cfg.adaptive_wanted() => Some(Probe::Load),
            (None, None) => None,
        }
    }
}

/// The built-in estimate's memory: the fastest round trip of each recent reading.
#[derive(Debug, Default)]
pub struct LoadEstimate {
    fastest: VecDeque<Duration>,
    recent: VecDeque<f64>,
}

impl LoadEstimate {
    /// Adds one reading's fastest round trip; returns the load in percent (0 to 100): the
    /// lowest of the last [`SUSTAINED`] instant values.
    pub fn reading(&mut self, current: Duration) -> f64 {
        let now = self.instant(current);
        if self.recent.len() == SUSTAINED {
            self.recent.pop_front();
        }
        self.recent.push_back(now);
        self.recent.iter().copied().fold(f64::INFINITY, f64::min)
    }

    /// This reading alone.
    fn instant(&mut self, current: Duration) -> f64 {
        if self.fastest.len() == BASELINE_READINGS {
            self.fastest.pop_front();
        }
        self.fastest.push_back(current);
        let baseline = self.fastest.iter().min().copied().unwrap_or(current);
        if current <= baseline + NOISE || current.is_zero() {
            return 0.0;
        }
        (100.0 * (1.0 - baseline.as_secs_f64() / current.as_secs_f64())).clamp(0.0, 100.0)
    }
}

/// Starts the probe on a thread of its own with its own one-thread runtime: the built-in
/// estimate times round trips, and on the proxy's runtime they would include the time the
/// probe waits behind client sessions for its turn (the proxy's load read as the database's).
pub fn spawn(app: Arc<App>) -> std::io::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("pgsluice-probe".into())
        .spawn(move || runtime.block_on(run(app)))?;
    Ok(())
}

/// Runs until shutdown; idles while no probe is configured (reload may add one).
pub async fn run(app: Arc<App>) {
    let mut conn: Option<BackendConn> = None;
    let mut running: Option<Probe> = None;
    let mut load = LoadEstimate::default();
    loop {
        let cfg = app.config();
        let b = &cfg.global_defaults.circuit_breaker;
        let interval = Duration::from_millis(b.probe_interval_ms.max(100));
        let probe = Probe::of(&cfg);
        if probe != running {
            // A new kind of probe starts a new baseline.
            load = LoadEstimate::default();
            running = probe.clone();
        }
        match (probe, cfg.backend_url()) {
            (Some(probe), Some(url)) => {
                if conn.is_none() {
                    let params = ConnectParams::from_url(
                        &url,
                        Duration::from_millis(cfg.backend.connect_timeout_ms),
                        cfg.backend.tcp_user_timeout(),
                        app.tls.backend(),
                    );
                    match BackendConn::connect(&params, 1).await {
                        Ok(c) => conn = Some(c),
                        Err(e) => {
                            tracing::warn!(error = %e, "breaker probe cannot connect");
                            app.policy.record_backend_result(false);
                        }
                    }
                }
                if let Some(c) = conn.as_mut() {
                    let limit = interval.max(Duration::from_secs(1));
                    match tokio::time::timeout(limit, read(c, &probe, &mut load)).await {
                        Ok(Ok(Some(v))) => {
                            app.policy.on_probe(v);
                            for pool in app.pools.all() {
                                pool.on_load(v);
                            }
                        }
                        Ok(Ok(None)) => tracing::warn!("breaker probe returned no number"),
                        Ok(Err(e)) => {
                            tracing::warn!(error = %e, "breaker probe failed");
                            app.policy.record_backend_result(false);
                            conn = None;
                        }
                        Err(_) => {
                            tracing::warn!("breaker probe timed out");
                            app.policy.record_backend_result(false);
                            conn = None;
                        }
                    }
                }
            }
            _ => conn = None,
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = app.life.stopping() => return,
        }
    }
}

/// One reading of `probe`.
pub async fn read(
    c: &mut BackendConn,
    probe: &Probe,
    load: &mut LoadEstimate,
) -> Result<Option<f64>, ConnectError> {
    match probe {
        Probe::Sql(sql) => scalar(c, sql).await,
        Probe::Load => {
            let mut fastest = Duration::MAX;
            for _ in 0..SAMPLES {
                let start = Instant::now();
                scalar(c, "SELECT 1").await?;
                fastest = fastest.min(start.elapsed());
            }
            Ok(Some(load.reading(fastest)))
        }
    }
}

/// Runs `sql` and returns the first column of the first row as a number.
pub async fn scalar(c: &mut BackendConn, sql: &str) -> Result<Option<f64>, ConnectError> {
    let value = c.first_value(sql).await?;
    Ok(value.and_then(|s| s.trim().parse::<f64>().ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1000.0)
    }

    /// Idle jitter reads 0; a stretched round trip reads as the busy share once it has held
    /// for `SUSTAINED` readings; the baseline forgets readings older than its window.
    #[test]
    fn the_load_estimate_reads_queueing_over_the_baseline() {
        let mut e = LoadEstimate::default();
        assert_eq!(e.instant(ms(0.05)), 0.0);
        assert_eq!(e.instant(ms(0.9)), 0.0, "under the noise floor");
        let busy = e.instant(ms(5.0));
        assert!((busy - 99.0).abs() < 1e-9, "{busy}");
        let half = e.instant(ms(2.0));
        assert!((half - 97.5).abs() < 1e-9, "{half}");
        // 85 % is a round trip 6.7 times the idle one.
        let mut e = LoadEstimate::default();
        e.instant(ms(1.0));
        let at = e.instant(ms(1000.0 / 150.0));
        assert!((at - 85.0).abs() < 1e-6, "{at}");
        // Reported: only a stretch that holds for SUSTAINED readings.
        let mut e = LoadEstimate::default();
        assert_eq!(e.reading(ms(0.05)), 0.0);
        assert_eq!(e.reading(ms(5.0)), 0.0, "one slow reading is not load");
        assert_eq!(e.reading(ms(5.0)), 0.0);
        assert_eq!(e.reading(ms(5.0)), 99.0, "three in a row are");
        assert!(
            e.reading(ms(0.05)) == 0.0,
            "and it ends with the first fast one"
        );
        // A baseline taken under load is forgotten once its window has passed.
        let mut e = LoadEstimate::default();
        e.reading(ms(0.1));
        for _ in 0..BASELINE_READINGS {
            e.reading(ms(3.0));
        }
        assert_eq!(
            e.reading(ms(3.0)),
            0.0,
            "the slow readings are the new baseline"
        );
    }
}
