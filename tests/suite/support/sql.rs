//! Client-side helpers shared by the end-to-end tests: reading simple-query results, SQLSTATEs,
//! polling for a condition, and sampling the backend count while a workload runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

use futures_util::future;
use tokio::task::JoinHandle;
use tokio_postgres::{Client, SimpleQueryMessage};

use super::pg::{APP_DB, APP_USER, Cluster, Monitor};
use super::proxy::Proxy;
use super::{note_skipped, within};

/// Deadline for one ordinary step (a query, a connect).
pub const STEP: Duration = Duration::from_secs(15);

/// The first column of every row of a simple-query response.
pub fn simple_values(messages: &[SimpleQueryMessage]) -> Vec<Option<String>> {
    messages
        .iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(row) => Some(row.get(0).map(str::to_string)),
            _ => None,
        })
        .collect()
}

/// Runs one simple query and returns its first value.
pub async fn scalar(client: &Client, sql: &str) -> String {
    let messages = within(STEP, sql, client.simple_query(sql))
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
    simple_values(&messages)
        .into_iter()
        .next()
        .flatten()
        .unwrap_or_else(|| panic!("{sql} returned no value"))
}

/// The SQLSTATE of an error, or a description of why it has none.
pub fn sqlstate(err: &tokio_postgres::Error) -> String {
    match err.code() {
        Some(code) => code.code().to_string(),
        None => format!("<no SQLSTATE: {err:?}>"),
    }
}

/// Polls `cond` every 20 ms until it holds, panicking with `what` after `limit`.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !cond().await {
        assert!(Instant::now() < deadline, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A statement left running: `SELECT pg_sleep(10)` on `client`, in a task.
pub type Running = tokio::task::JoinHandle<Result<Vec<SimpleQueryMessage>, tokio_postgres::Error>>;

/// Starts `SELECT pg_sleep(10)` on `client` in a task and returns once Postgres shows it
/// active (`monitor` reads pg_stat_activity): a statement to cancel, kill or interrupt.
pub async fn sleep_running(client: &Arc<Client>, monitor: &Monitor) -> Running {
    let running = {
        let client = Arc::clone(client);
        tokio::spawn(async move { client.simple_query("SELECT pg_sleep(10)").await })
    };
    eventually(STEP, "pg_sleep(10) to show up as active", || async {
        !monitor.active_queries_like("pg_sleep(10)").await.is_empty()
    })
    .await;
    running
}

/// Sends a CancelRequest for `client`'s running statement (on a new connection, as libpq).
pub async fn send_cancel(client: &Client) {
    within(
        STEP,
        "CancelRequest",
        client.cancel_token().cancel_query(tokio_postgres::NoTls),
    )
    .await
    .expect("send cancel");
}

/// Samples the number of `app` backends until stopped; returns the maximum seen.
pub struct BackendSampler {
    stop: Arc<AtomicBool>,
    max: Arc<AtomicI64>,
    task: tokio::task::JoinHandle<usize>,
}

impl BackendSampler {
    pub async fn start(cluster: &Cluster) -> BackendSampler {
        let monitor = cluster.monitor().await;
        let stop = Arc::new(AtomicBool::new(false));
        let max = Arc::new(AtomicI64::new(0));
        let (stop2, max2) = (Arc::clone(&stop), Arc::clone(&max));
        let task = tokio::spawn(async move {
            let mut samples = 0;
            while !stop2.load(Ordering::Relaxed) {
                let n = monitor.backend_count(APP_DB, APP_USER).await;
                max2.fetch_max(n, Ordering::Relaxed);
                samples += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            samples
        });
        BackendSampler { stop, max, task }
    }

    /// Stops sampling; returns (max backends seen, number of samples).
    pub async fn finish(self) -> (i64, usize) {
        self.stop.store(true, Ordering::Relaxed);
        let samples = within(STEP, "the backend sampler to stop", self.task)
            .await
            .expect("sampler task");
        (self.max.load(Ordering::Relaxed), samples)
    }
}

/// Asserts the sampled backend maximum respects the pool size (skipped in direct mode).
pub fn assert_pool_bound(proxy: &Proxy, max: i64, samples: usize) {
    assert!(
        samples >= 3,
        "the sampler took only {samples} samples; the bound was not really checked"
    );
    assert!(
        max >= 1,
        "the sampler never saw an app backend; is it counting the right database/user?"
    );
    if proxy.is_direct() {
        note_skipped(&format!(
            "backend count {max} <= pool size {}",
            proxy.pool_size()
        ));
    } else {
        assert!(
            max <= proxy.pool_size() as i64,
            "saw {max} app backends in pg_stat_activity, pool size is {}",
            proxy.pool_size()
        );
    }
}

/// Awaits a spawned client task, within [`STEP`]; panics if it panicked.
pub async fn join<T>(task: JoinHandle<T>) -> T {
    within(STEP, "a client task", task)
        .await
        .expect("client task panicked")
}

/// Joins spawned tasks, panicking with the first failure.
pub async fn join_all_ok<T>(
    what: &str,
    limit: Duration,
    tasks: Vec<tokio::task::JoinHandle<T>>,
) -> Vec<T> {
    within(limit, what, future::join_all(tasks))
        .await
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())))
        .collect()
}
