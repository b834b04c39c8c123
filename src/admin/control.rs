//! The controls an on-call engineer reaches for during an incident, PgBouncer's `SHOW
//! CLIENTS`, `SHOW SERVERS`, `PAUSE`, `RESUME`, `RECONNECT`, `KILL`, `DISABLE` and `ENABLE`
//! as endpoints:
//!
//! ```text
//! read   GET    /v1/clients   /v1/servers
//! write  DELETE /v1/clients/{id}                 end a session (57P01)
//!        POST   /v1/clients/{id}/cancel          cancel its running statement
//!        POST   /v1/pools/{db}/{user}/pause      hold new checkouts, wait for those in use
//!        POST   /v1/pools/{db}/{user}/resume
//!        POST   /v1/pools/{db}/{user}/reconnect  replace every backend after its current use
//!        POST   /v1/databases/{db}/disable|enable   refuse / accept new client logins
//! ```
//!
//! The state lives where the work is (client records in the cancel registry, pause and
//! reconnect in the pool, the disabled set in the app); this module reads and orders it.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::AdminState;
use super::error::{ApiError, NoQuery};
use crate::clients::ClientSnapshot;
use crate::pool::{IdleServer, Pool};

/// How long checkouts of a paused pool wait for the resume when the request does not say.
pub const DEFAULT_PAUSE_HOLD_MS: u64 = 60_000;
/// How long `pause` waits for the connections in use to come back when it does not say.
pub const DEFAULT_PAUSE_WAIT_MS: u64 = 30_000;
/// Longest hold or wait a request may ask for.
const MAX_PAUSE_MS: u64 = 3_600_000;

#[derive(Serialize)]
struct Clients {
    clients: Vec<ClientSnapshot>,
}

/// `GET /v1/clients`: every logged-in client, in login order.
pub async fn clients(State(st): State<Arc<AdminState>>, _: NoQuery) -> Json<impl Serialize> {
    Json(Clients {
        clients: client_rows(&st),
    })
}

/// Every logged-in client (console sessions included), in login order.
pub(super) fn client_rows(st: &AdminState) -> Vec<ClientSnapshot> {
    let rt = st.app.runtime.load();
    let names = &rt.callers;
    let mut rows: Vec<ClientSnapshot> = st
        .app
        .cancels
        .entries()
        .iter()
        .filter(|e| e.client.meta.is_some())
        .map(|e| e.client.snapshot(|id| names.name(id).to_string()))
        .collect();
    rows.sort_by_key(|c| c.id);
    rows
}

fn client_id(raw: &str) -> Result<u64, ApiError> {
    raw.parse()
        .map_err(|_| ApiError::bad_request("id", "must be a client id from GET /v1/clients"))
}

fn no_client(id: u64) -> ApiError {
    ApiError::NotFound(format!("no client {id} (it may have disconnected)"))
}

#[derive(Serialize)]
struct Ordered {
    client: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    backend_pid: Option<i32>,
    done: &'static str,
}

/// `DELETE /v1/clients/{id}`: the session ends with FATAL 57P01; what it had running is
/// cancelled and its backend reset or closed, as for any client that leaves mid-work.
pub async fn terminate(
    State(st): State<Arc<AdminState>>,
    Path(id): Path<String>,
    _: NoQuery,
) -> Result<Json<impl Serialize>, ApiError> {
    let id = client_id(&id)?;
    let entry = st
        .app
        .cancels
        .find_client(id)
        .ok_or_else(|| no_client(id))?;
    let backend_pid = entry.client.backend_pid();
    entry.terminate();
    tracing::warn!(
        client = id,
        ?backend_pid,
        "client terminated by an operator"
    );
    Ok(Json(Ordered {
        client: id,
        backend_pid,
        done: "terminated",
    }))
}

/// `POST /v1/clients/{id}/cancel`: cancels the statement the client runs now (as its own
/// CancelRequest would); 409 when it holds no backend.
pub async fn cancel(
    State(st): State<Arc<AdminState>>,
    Path(id): Path<String>,
    _: NoQuery,
) -> Result<Json<impl Serialize>, ApiError> {
    let id = client_id(&id)?;
    let entry = st
        .app
        .cancels
        .find_client(id)
        .ok_or_else(|| no_client(id))?;
    let Some(pid) = entry.client.backend_pid() else {
        return Err(ApiError::Conflict(format!(
            "client {id} runs nothing on a backend now"
        )));
    };
    let sent = entry.cancel_current(pid);
    let _ = tokio::time::timeout(Duration::from_secs(5), sent).await;
    tracing::warn!(
        client = id,
        backend_pid = pid,
        "statement cancelled by an operator"
    );
    Ok(Json(Ordered {
        client: id,
        backend_pid: Some(pid),
        done: "cancel sent",
    }))
}

/// One backend connection as `GET /v1/servers` and the console's `SHOW SERVERS` show it.
#[derive(Serialize)]
pub(super) struct Server {
    pub pool: String,
    pub pid: i32,
    /// `idle`, or the state of the client holding it.
    pub state: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub age_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_ms: Option<u64>,
    /// The pool's database and user (named in `pool`), for the console's columns.
    #[serde(skip)]
    pub database: String,
    #[serde(skip)]
    pub user: String,
}

#[derive(Serialize)]
struct Servers {
    servers: Vec<Server>,
}

/// `GET /v1/servers`: each backend connection: idle ones from their pool, those in use with
/// the client that holds them.
pub async fn servers(State(st): State<Arc<AdminState>>, _: NoQuery) -> Json<impl Serialize> {
    Json(Servers {
        servers: server_rows(&st),
    })
}

/// Every backend connection: the idle ones of each pool (by pool name), then those in use,
/// by the client holding them.
pub(super) fn server_rows(st: &AdminState) -> Vec<Server> {
    let mut servers = Vec::new();
    let mut pools = st.app.pools.all();
    pools.sort_by(|a, b| a.name.cmp(&b.name));
    for p in &pools {
        for IdleServer {
            pid,
            age_ms,
            idle_ms,
        } in p.idle_servers()
        {
            servers.push(Server {
                pool: p.name.clone(),
                pid,
                state: "idle".into(),
                client: None,
                age_ms: Some(age_ms),
                idle_ms: Some(idle_ms),
                database: p.database.clone(),
                user: p.user.clone(),
            });
        }
    }
    for c in client_rows(st) {
        if let Some(pid) = c.backend_pid {
            let state = serde_json::to_value(c.state)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            servers.push(Server {
                pool: format!("{}/{}", c.database, c.user),
                pid,
                state,
                client: Some(c.id),
                age_ms: None,
                idle_ms: None,
                database: c.database,
                user: c.user,
            });
        }
    }
    servers
}

fn pool_of(st: &AdminState, db: &str, user: &str) -> Result<Arc<Pool>, ApiError> {
    st.app.pools.get(db, user).ok_or_else(|| {
        ApiError::NotFound(format!(
            "no pool {db}/{user} (a pool exists once a client of that database and user \
             logged in; see GET /v1/pools)"
        ))
    })
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct PauseBody {
    /// How long each new checkout waits for the resume before it is refused.
    hold_ms: Option<u64>,
    /// How long this request waits for the connections in use to come back.
    wait_ms: Option<u64>,
}

fn pause_body(body: &Bytes) -> Result<PauseBody, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(PauseBody::default());
    }
    let b: PauseBody = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request("body", format!("invalid pause request: {e}")))?;
    for (field, v) in [("hold_ms", b.hold_ms), ("wait_ms", b.wait_ms)] {
        if v.is_some_and(|v| v > MAX_PAUSE_MS) {
            return Err(ApiError::bad_request(
                field,
                format!("must be at most {MAX_PAUSE_MS}"),
            ));
        }
    }
    if b.hold_ms == Some(0) {
        return Err(ApiError::bad_request("hold_ms", "must be > 0"));
    }
    Ok(b)
}

#[derive(Serialize)]
struct PoolState {
    pool: String,
    paused: bool,
    /// Connections checked out when the answer was written.
    in_use: usize,
    /// `pause`: every connection in use came back within `wait_ms`.
    #[serde(skip_serializing_if = "Option::is_none")]
    drained: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    waited_ms: Option<u64>,
    /// `reconnect`: idle connections closed now.
    #[serde(skip_serializing_if = "Option::is_none")]
    closed: Option<usize>,
}

/// `POST /v1/pools/{db}/{user}/pause`: new checkouts wait (each up to `hold_ms`, then 53300
/// with a retry hint); the answer comes when the connections in use are back, or after
/// `wait_ms` with `drained: false` (the pause stays either way).
pub async fn pause(
    State(st): State<Arc<AdminState>>,
    Path((db, user)): Path<(String, String)>,
    _: NoQuery,
    body: Bytes,
) -> Result<Json<impl Serialize>, ApiError> {
    let b = pause_body(&body)?;
    let pool = pool_of(&st, &db, &user)?;
    let waited = pause_pools(
        std::slice::from_ref(&pool),
        Duration::from_millis(b.hold_ms.unwrap_or(DEFAULT_PAUSE_HOLD_MS)),
        Duration::from_millis(b.wait_ms.unwrap_or(DEFAULT_PAUSE_WAIT_MS)),
    )
    .await;
    let in_use = pool.in_use();
    Ok(Json(PoolState {
        pool: pool.name.clone(),
        paused: pool.is_paused(),
        in_use,
        drained: Some(in_use == 0),
        waited_ms: Some(u64::try_from(waited.as_millis()).unwrap_or(u64::MAX)),
        closed: None,
    }))
}

/// Pauses `pools` (each new checkout waits up to `hold` for the resume), then waits up to
/// `wait` for their connections in use to come back, or for one of them to be resumed.
/// Returns how long it waited.
pub(super) async fn pause_pools(pools: &[Arc<Pool>], hold: Duration, wait: Duration) -> Duration {
    for pool in pools {
        pool.pause(hold);
    }
    let started = Instant::now();
    let until = started + wait;
    while pools.iter().any(|p| p.in_use() > 0)
        && Instant::now() < until
        && pools.iter().all(|p| p.is_paused())
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    started.elapsed()
}

/// `POST /v1/pools/{db}/{user}/resume`.
pub async fn resume(
    State(st): State<Arc<AdminState>>,
    Path((db, user)): Path<(String, String)>,
    _: NoQuery,
) -> Result<Json<impl Serialize>, ApiError> {
    let pool = pool_of(&st, &db, &user)?;
    pool.resume();
    Ok(Json(PoolState {
        pool: pool.name.clone(),
        paused: false,
        in_use: pool.in_use(),
        drained: None,
        waited_ms: None,
        closed: None,
    }))
}

/// `POST /v1/pools/{db}/{user}/reconnect`: idle backends closed now, those in use when
/// released; new ones open on demand (and to `min_idle`).
pub async fn reconnect(
    State(st): State<Arc<AdminState>>,
    Path((db, user)): Path<(String, String)>,
    _: NoQuery,
) -> Result<Json<impl Serialize>, ApiError> {
    let pool = pool_of(&st, &db, &user)?;
    let (closed, in_use) = pool.reconnect();
    Ok(Json(PoolState {
        pool: pool.name.clone(),
        paused: pool.is_paused(),
        in_use,
        drained: None,
        waited_ms: None,
        closed: Some(closed),
    }))
}

#[derive(Serialize)]
struct Databases {
    database: String,
    enabled: bool,
    /// Every database now refusing new client logins.
    disabled: Vec<String>,
}

fn databases(st: &AdminState, db: &str) -> Databases {
    let disabled: Vec<String> = st.app.disabled.read().iter().cloned().collect();
    Databases {
        database: db.to_owned(),
        enabled: !disabled.iter().any(|d| d == db),
        disabled,
    }
}

/// `POST /v1/databases/{db}/disable`: new client logins to `db` get FATAL 57P03; sessions
/// already open go on.
pub async fn disable(
    State(st): State<Arc<AdminState>>,
    Path(db): Path<String>,
    _: NoQuery,
) -> Result<Json<impl Serialize>, ApiError> {
    disable_database(&st, &db)?;
    Ok(Json(databases(&st, &db)))
}

/// Closes `db` to new client logins (what `disable` and the console's `DISABLE` do).
pub(super) fn disable_database(st: &AdminState, db: &str) -> Result<(), ApiError> {
    if db.is_empty() || db.len() > 63 {
        return Err(ApiError::bad_request(
            "database",
            "must be a database name (1 to 63 bytes)",
        ));
    }
    {
        let mut d = st.app.disabled.write();
        if d.len() >= 10_000 && !d.contains(db) {
            return Err(ApiError::Conflict(
                "10000 databases are disabled already".into(),
            ));
        }
        d.insert(db.to_owned());
    }
    tracing::warn!(database = %db, "new client connections disabled by an operator");
    Ok(())
}

/// `POST /v1/databases/{db}/enable`.
pub async fn enable(
    State(st): State<Arc<AdminState>>,
    Path(db): Path<String>,
    _: NoQuery,
) -> Result<Json<impl Serialize>, ApiError> {
    enable_database(&st, &db);
    Ok(Json(databases(&st, &db)))
}

/// Opens `db` to new client logins again (`enable`, the console's `ENABLE`).
pub(super) fn enable_database(st: &AdminState, db: &str) {
    if st.app.disabled.write().remove(db) {
        tracing::warn!(database = %db, "new client connections enabled by an operator");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pause_bodies() {
        let b = pause_body(&Bytes::new()).unwrap();
        assert_eq!((b.hold_ms, b.wait_ms), (None, None));
        let b = pause_body(&Bytes::from_static(br#"{"hold_ms": 5000, "wait_ms": 0}"#)).unwrap();
        assert_eq!((b.hold_ms, b.wait_ms), (Some(5000), Some(0)));
        for bad in [
            &br#"{"hold": 1}"#[..],
            br#"{"hold_ms": 0}"#,
            br#"{"wait_ms": 99999999}"#,
            b"[",
        ] {
            assert!(pause_body(&Bytes::copy_from_slice(bad)).is_err(), "{bad:?}");
        }
    }
}
