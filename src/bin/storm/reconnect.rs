//! The reconnect storm: after a warm-up second and a calm period in which only the critical caller (billing) runs,
//! `clients` clients arrive spread uniformly over `ramp` (default 5 000 in 500 ms, as after a
//! deploy or a network blip), each connects and flushes its queue of `writes` INSERTs, then
//! keeps its connection for `linger` (as an application's pool does) and disconnects. A client that fails retries — at once (`naive`) or after a full-jitter backoff
//! that honours the proxy's `retry_after_ms` hint (`backoff`) — until its queue is flushed or
//! the storm's deadline passes; whatever is left then counts as abandoned.
//!
//! What it shows: direct, the database takes every connection it can (`max_connections`) and
//! refuses the rest, so the backend count spikes and the critical caller's latency with it;
//! through pgsluice the spike becomes a hill — backend connections stay at the pool size and
//! the writes drain at the rate the database can take.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use pgsluice::pool::backend::BackendConn;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::client;
use super::scenarios::{Ctx, Extra, Phase, spawn_billing, warm_up};

/// Shape of the storm.
#[derive(Debug, Clone, Copy)]
pub struct StormShape {
    pub clients: u64,
    pub writes: u64,
    pub ramp: Duration,
    pub calm: Duration,
    /// Longest the storm may last, counted from its first arrival.
    pub deadline: Duration,
    /// How long a client keeps its connection open after flushing, as an application's
    /// connection pool would (bounded by the deadline).
    pub linger: Duration,
    pub billing: (u64, f64),
}

/// Counters the progress line and the summary read.
#[derive(Default)]
pub struct StormState {
    pub done_clients: AtomicU64,
    pub flushed: AtomicU64,
    pub connected_now: AtomicU64,
    /// Microseconds from the storm's start to the last flushed write.
    pub last_flush_us: AtomicU64,
}

pub async fn run(
    ctx: Arc<Ctx>,
    shape: StormShape,
    phase: Arc<Phase>,
    st: Arc<StormState>,
) -> Extra {
    let stop = ctx.abort.child_token();
    let billing = spawn_billing(&ctx, shape.billing, &phase, &stop);
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
                shape.writes,
                t0 + offset,
                deadline,
                shape.linger,
                t0,
                st.clone(),
                stop.clone(),
            ))
        })
        .collect();
    for t in clients {
        let _ = t.await;
    }
    let storm_secs = t0.elapsed().as_secs_f64();
    // A moment of calm afterwards, so the chart shows the recovery.
    phase.set(3);
    tokio::select! {
        _ = tokio::time::sleep(shape.calm.min(Duration::from_secs(2))) => {}
        _ = ctx.abort.cancelled() => {}
    }
    stop.cancel();
    for t in billing {
        let _ = t.await;
    }
    let total = shape.clients * shape.writes;
    let flushed = st.flushed.load(Ordering::Relaxed);
    let last = st.last_flush_us.load(Ordering::Relaxed) as f64 / 1e6;
    vec![
        ("storm_clients".into(), shape.clients.to_string()),
        ("writes_total".into(), total.to_string()),
        ("writes_flushed".into(), flushed.to_string()),
        (
            "writes_abandoned".into(),
            (total - flushed.min(total)).to_string(),
        ),
        (
            "clients_completed".into(),
            st.done_clients.load(Ordering::Relaxed).to_string(),
        ),
        ("last_write_flushed_secs".into(), format!("{last:.2}")),
        ("storm_secs".into(), format!("{storm_secs:.2}")),
    ]
}

#[allow(clippy::too_many_arguments)]
async fn storm_client(
    ctx: Arc<Ctx>,
    id: u64,
    writes: u64,
    start: Instant,
    deadline: Instant,
    linger: Duration,
    t0: Instant,
    st: Arc<StormState>,
    stop: CancellationToken,
) {
    const LABEL: &str = "web (storm)";
    tokio::select! {
        _ = tokio::time::sleep_until(start) => {}
        _ = stop.cancelled() => return,
    }
    let mut conn: Option<BackendConn> = None;
    let (mut seq, mut attempt) = (0u64, 0u32);
    while seq < writes {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let failure = match conn.as_mut() {
            None => {
                ctx.rec.arrival();
                let began = Instant::now();
                let r = tokio::select! {
                    r = tokio::time::timeout(left, client::connect(&ctx.target)) => r,
                    _ = stop.cancelled() => break,
                };
                let Ok(r) = r else { break };
                match r {
                    Ok(c) => {
                        ctx.rec.connect(LABEL, began, Ok(()));
                        st.connected_now.fetch_add(1, Ordering::Relaxed);
                        conn = Some(c);
                        continue;
                    }
                    Err(f) => {
                        ctx.rec.connect(LABEL, began, Err(&f));
                        f
                    }
                }
            }
            Some(c) => {
                let sql = ctx.expand(&ctx.sql.write, id, seq);
                ctx.rec.arrival();
                let began = Instant::now();
                let r = tokio::select! {
                    r = tokio::time::timeout(left, client::run(c, &sql)) => r,
                    _ = stop.cancelled() => break,
                };
                let Ok(r) = r else { break };
                ctx.rec
                    .statement(LABEL, false, began, r.as_ref().map(|_| ()));
                match r {
                    Ok(()) => {
                        seq += 1;
                        attempt = 0;
                        st.flushed.fetch_add(1, Ordering::Relaxed);
                        st.last_flush_us
                            .fetch_max(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                        continue;
                    }
                    Err(f) => f,
                }
            }
        };
        if failure.fatal() && conn.take().is_some() {
            st.connected_now.fetch_sub(1, Ordering::Relaxed);
        }
        let pause = ctx.retry.delay(attempt, &failure);
        if pause >= deadline.saturating_duration_since(Instant::now()) {
            break;
        }
        tokio::select! {
            _ = client::sleep_or_yield(pause) => {}
            _ = stop.cancelled() => break,
        }
        attempt = attempt.saturating_add(1);
    }
    if seq >= writes {
        st.done_clients.fetch_add(1, Ordering::Relaxed);
        if conn.is_some() {
            let until = (Instant::now() + linger).min(deadline);
            tokio::select! {
                _ = tokio::time::sleep_until(until) => {}
                _ = stop.cancelled() => {}
            }
        }
    }
    if let Some(c) = conn {
        st.connected_now.fetch_sub(1, Ordering::Relaxed);
        client::terminate(c).await;
    }
}
