//! Read endpoints (`/v1/fingerprints`, `/v1/callers`, `/v1/pools`, `/v1/breaker`,
//! `/metrics`) and `POST /v1/reload`.
//!
//! These only read app state; none of them changes anything (reload aside, which runs the
//! process's reloader, the same code as SIGHUP). `/metrics` turns app state into a plain
//! [`Scrape`] for `observe::metrics`, so that module never needs to know about the app.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::{Uri, header};
use axum::response::IntoResponse;
use serde::Serialize;

use super::AdminState;
use super::error::{ApiError, NoQuery, truncate};
use crate::observe::arrival_series::ArrivalSample;
use crate::observe::metrics::{
    BREAKER_CLOSED, BREAKER_HALF_OPEN, BREAKER_OPEN, CallerSample, FleetSample, PoolSample, Scrape,
};
use crate::observe::stats::{FingerprintSnapshot, SortKey};
use crate::policy::CallerSnapshot;
use crate::policy::breaker::{BreakerSnapshot, BreakerState};
use crate::pool::PoolSnapshot;

/// Default and largest `limit` of `GET /v1/fingerprints`.
pub const DEFAULT_LIMIT: usize = 50;
pub const MAX_LIMIT: usize = 1000;

#[derive(Serialize)]
struct Fingerprints {
    sort: String,
    limit: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    caller: Option<String>,
    /// Fingerprints with their own statistics (plus one if the "other" row is non-empty).
    tracked: usize,
    fingerprints: Vec<FingerprintSnapshot>,
}

/// `GET /v1/fingerprints?sort=total_time|calls|errors|refusals&limit=N&caller=X`.
pub async fn fingerprints(
    State(st): State<Arc<AdminState>>,
    uri: Uri,
) -> Result<Json<impl Serialize>, ApiError> {
    let Query(params) = Query::<Vec<(String, String)>>::try_from_uri(&uri)
        .map_err(|_| ApiError::bad_request("query", "malformed query string"))?;
    let (mut sort, mut limit, mut caller) = ("total_time".to_owned(), DEFAULT_LIMIT, None);
    for (k, v) in params {
        match k.as_str() {
            "sort" => sort = v,
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=MAX_LIMIT).contains(n))
                    .ok_or_else(|| {
                        ApiError::bad_request(
                            "limit",
                            format!("must be an integer between 1 and {MAX_LIMIT}"),
                        )
                    })?;
            }
            "caller" => caller = Some(v),
            other => {
                return Err(ApiError::bad_request(
                    "query",
                    format!(
                        "unknown query parameter {:?}; expected sort, limit or caller",
                        truncate(other, 64)
                    ),
                ));
            }
        }
    }
    let key: SortKey = sort.parse().map_err(|_| {
        ApiError::bad_request(
            "sort",
            format!(
                "unknown sort key {:?}; expected total_time, calls, errors or refusals",
                truncate(&sort, 64)
            ),
        )
    })?;
    let fingerprints = st.app.fp_stats.top(key, limit, caller.as_deref());
    Ok(Json(Fingerprints {
        sort,
        limit,
        caller,
        tracked: st.app.fp_stats.len(),
        fingerprints,
    }))
}

#[derive(Serialize)]
struct Callers {
    callers: Vec<CallerSnapshot>,
}

/// `GET /v1/callers`: limits, in flight, queued, admitted and refusals per caller, and the
/// backend time its units held.
pub async fn callers(State(st): State<Arc<AdminState>>, _: NoQuery) -> Json<impl Serialize> {
    Json(Callers {
        callers: caller_snapshots(&st, &pool_snapshots(&st)),
    })
}

/// The policy's callers with their backend time from `pools` (summed; the share of the pool
/// where it is largest).
fn caller_snapshots(st: &AdminState, pools: &[PoolSnapshot]) -> Vec<CallerSnapshot> {
    let mut callers = st.app.policy.callers_in(&st.app.runtime.load().limits);
    for t in pools.iter().flat_map(|p| &p.caller_time) {
        if let Some(c) = callers.iter_mut().find(|c| c.id == t.caller) {
            c.backend_seconds_total += t.backend_seconds_total;
            c.backend_share = c.backend_share.max(t.share);
        }
    }
    callers
}

#[derive(Serialize)]
struct Pools {
    pools: Vec<PoolSnapshot>,
    /// Limits shared by pools (`max_db_connections`, `max_user_connections`; limit 0: none).
    caps: Vec<crate::pool::caps::CapSnapshot>,
}

/// Every pool's snapshot, by name.
pub(super) fn pool_snapshots(st: &AdminState) -> Vec<PoolSnapshot> {
    let mut v: Vec<PoolSnapshot> = st.app.pools.all().iter().map(|p| p.snapshot()).collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    let callers = st.app.policy.callers_in(&st.app.runtime.load().limits);
    for t in v.iter_mut().flat_map(|p| &mut p.caller_time) {
        if let Some(c) = callers.iter().find(|c| c.id == t.caller) {
            t.name.clone_from(&c.name);
        }
    }
    v
}

/// `GET /v1/pools`: active, idle, waiting, pinned, connects per (database, user) pool.
pub async fn pools(State(st): State<Arc<AdminState>>, _: NoQuery) -> Json<impl Serialize> {
    Json(Pools {
        pools: pool_snapshots(&st),
        caps: st.app.pools.cap_snapshots(),
    })
}

/// `GET /v1/breaker`.
pub async fn breaker(State(st): State<Arc<AdminState>>, _: NoQuery) -> Json<BreakerSnapshot> {
    Json(st.app.policy.breaker())
}

/// `GET /metrics`: Prometheus text format.
pub async fn metrics(State(st): State<Arc<AdminState>>, _: NoQuery) -> impl IntoResponse {
    let text = st.app.metrics.render_with(&scrape(&st));
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
}

fn scrape(st: &AdminState) -> Scrape {
    use std::sync::atomic::Ordering::Relaxed;
    let app = &st.app;
    let breaker = app.policy.breaker();
    let u = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    let pools = pool_snapshots(st);
    let callers = caller_snapshots(st, &pools);
    let arrivals = pools
        .iter()
        .map(|p| ArrivalSample {
            queue: "pool",
            name: p.name.clone(),
            stats: p.arrival,
        })
        .chain(callers.iter().map(|c| ArrivalSample {
            queue: "caller",
            name: c.name.clone(),
            stats: c.arrival,
        }))
        .collect();
    Scrape {
        arrivals,
        pools: pools
            .into_iter()
            .map(|p| PoolSample {
                size: u(p.size),
                active: u(p.active),
                idle: u(p.idle),
                parked: u(p.parked),
                waiting: u(p.waiting),
                pinned: u(p.pinned),
                listening: u(p.listening),
                listen_channels: u(p.listen_channels),
                connect_attempts: p.connects,
                connect_failures: p.connect_failures,
                checkout_timeouts: p.checkout_timeouts,
                waiting_refused: p.waiting_refused,
                session_checks: p.session_checks,
                session_check_differences: p.session_check_differences,
                critical_reserve: u(p.critical_reserve),
                adaptive_limit: p.adaptive_limit.map(u),
                transactions: p.transactions,
                queries: p.queries,
                bytes_received: p.bytes_received,
                bytes_sent: p.bytes_sent,
                transaction_us: p.transaction_us,
                query_us: p.query_us,
                wait_us: p.wait_us,
                database: p.database,
                user: p.user,
                name: p.name,
            })
            .collect(),
        callers: callers
            .into_iter()
            .map(|c| CallerSample {
                in_flight: c.in_flight.into(),
                queued: c.queued.into(),
                admitted: c.admitted,
                backend_seconds: c.backend_seconds_total,
                backend_share: c.backend_share,
                name: c.name,
            })
            .collect(),
        client_connections: u(app.stats.clients.load(Relaxed)),
        client_connections_accepted: app.stats.clients_total.load(Relaxed),
        handshakes_in_progress: u(app.stats.handshakes.load(Relaxed)),
        logins_offloaded: app.stats.offloaded_logins.load(Relaxed),
        accept_moves: app.stats.accept_moves.load(Relaxed),
        logins_held: app.stats.logins_held.load(Relaxed),
        logins_waiting: app.stats.door_held.now() as u64,
        client_errors: app.stats.client_errors.load(Relaxed),
        breaker_state: match breaker.state {
            BreakerState::Closed => BREAKER_CLOSED,
            BreakerState::HalfOpen => BREAKER_HALF_OPEN,
            BreakerState::Open => BREAKER_OPEN,
        },
        breaker_trips: vec![
            ("consecutive_errors", breaker.trips.consecutive_errors),
            ("probe", breaker.trips.probe),
            ("trial_failed", breaker.trips.trial_failed),
        ],
        in_flight: breaker.in_flight.into(),
        breaker_inflight_sheds: breaker.inflight_sheds,
        breaker_probe_value: breaker.last_probe_value,
        cancels_sent: app.cancels.sent.load(Relaxed),
        cancels_ignored: app.cancels.ignored.load(Relaxed),
        cancels_forwarded: app.cancels.forwarded.load(Relaxed),
        cancels_address_limited: app.cancels.address_limited.load(Relaxed),
        rules: u(app.policy.rules().len()),
        rule_warned: app.policy.rules().warned_by_action().to_vec(),
        fingerprints_tracked: u(app.fp_stats.len()),
        coalesce_led: app.coalescer.counters.led.load(Relaxed),
        coalesce_shared: app.coalescer.counters.shared.load(Relaxed),
        coalesce_fallbacks: crate::coalesce::Fallback::ALL
            .iter()
            .map(|f| {
                let n = app.coalescer.counters.fallbacks[*f as usize].load(Relaxed);
                (f.name(), n)
            })
            .collect(),
        fleet: app.fleet.as_ref().map(|f| FleetSample {
            redis_up: f.redis_up(),
            members: u(f.members().len()),
            rule_syncs: f.counters.rule_syncs.load(Relaxed),
            lease_requests: f.counters.lease_requests.load(Relaxed),
            lease_tokens: f.counters.lease_tokens.load(Relaxed),
            redis_errors: f.counters.redis_errors.load(Relaxed),
        }),
    }
}

/// `GET /v1/fleet`: membership, Redis reachability, the applied rule-set version and lease
/// counters; 404 when no fleet is configured.
pub async fn fleet(
    State(st): State<Arc<AdminState>>,
    _: NoQuery,
) -> Result<Json<crate::fleet::FleetSnapshot>, ApiError> {
    let app = &st.app;
    let fleet = app
        .fleet
        .as_ref()
        .ok_or_else(|| ApiError::NotFound("no fleet is configured".into()))?;
    Ok(Json(fleet.snapshot(app.policy.rules())))
}

#[derive(Serialize)]
struct Reloaded {
    reloaded: bool,
}

/// `POST /v1/reload`: what SIGHUP does. 400 with the config errors (old config kept).
pub async fn reload(
    State(st): State<Arc<AdminState>>,
    _: NoQuery,
) -> Result<Json<impl Serialize>, ApiError> {
    run_reload(&st, "admin API").await?;
    Ok(Json(Reloaded { reloaded: true }))
}

/// Runs the process's reloader (the same re-read as SIGHUP) on the blocking pool; `via`
/// names who asked, for the log.
pub(super) async fn run_reload(st: &AdminState, via: &'static str) -> Result<(), ApiError> {
    let Some(reloader) = st.app.reloader.get().cloned() else {
        return Err(ApiError::Unavailable(
            "this process has no configuration source to reload".into(),
        ));
    };
    // Reading and validating the file is blocking work.
    let result = tokio::task::spawn_blocking(move || reloader())
        .await
        .map_err(|e| ApiError::Internal(format!("reload task failed: {e}")))?;
    match result {
        Ok(()) => {
            tracing::info!(via, "configuration reloaded");
            Ok(())
        }
        Err(errs) => {
            tracing::error!(via, errors = ?errs, "reload rejected; keeping the running configuration");
            Err(ApiError::InvalidConfig(errs))
        }
    }
}
