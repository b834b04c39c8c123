//! The admin HTTP API (axum, its own port, default `127.0.0.1:9930`; DESIGN §7).
//!
//! [`Admin`] holds the API's state: its router is built apart from serving it, so tests call
//! it with `tower::ServiceExt::oneshot` and no socket, and its two background services (the
//! expired-rule purge and the anomaly detector) join the process's list in `main`. Endpoints (documented in `docs/openapi.json`,
//! served at `/v1/openapi.json`):
//!
//! ```text
//! open   GET  /healthz  /readyz  /v1/openapi.json
//! read   GET  /metrics  /v1/rules  /v1/rules/fingerprint/{hash}  /v1/fingerprints
//!             /v1/anomalies  /v1/callers  /v1/pools  /v1/breaker  /v1/fleet (fleet mode)
//! write  PUT|DELETE /v1/rules/fingerprint/{hash}   POST /v1/rules/fingerprint (from SQL)
//!        POST /v1/reload
//! read   POST /v1/rules/preview (changes nothing)
//! read   GET  /v1/clients  /v1/servers
//! write  DELETE /v1/clients/{id}   POST /v1/clients/{id}/cancel
//!        POST /v1/pools/{db}/{user}/pause|resume|reconnect   /v1/databases/{db}/disable|enable
//! ```
//!
//! Layout: [`host`] refuses host names the API does not answer to (DNS rebinding);
//! [`auth`] decides who may call what (by method, so new endpoints are protected by
//! default) and enforces JSON on mutations; [`error`] is the one error type every failure
//! goes through, plus the extractors that name the bad field; [`rules`] owns rule mutations
//! (in fleet mode written to Redis first, see `crate::fleet`)
//! and their persistence; [`console`] answers PgBouncer's admin console on the client
//! listener with the same reads and controls; [`anomalies`] the detector's tick, its automatic rules and
//! `/v1/anomalies`; [`read`] the stats, `/metrics` and reload; [`control`] the incident
//! controls (clients, servers, pause, resume, reconnect, disable, enable). Bodies are capped at
//! [`error::MAX_BODY_BYTES`]; GET handlers refuse query parameters they do not define, so a
//! GET can never be mistaken for a mutation.
//!
//! What it must not do: hold a lock across a socket write, block the runtime on file I/O
//! (persistence and reload run on the blocking pool), or put secrets in any response.

pub mod anomalies;
pub mod auth;
pub mod console;
pub mod control;
pub mod error;
pub mod host;
pub mod preview;
pub mod read;
pub mod rules;

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{delete, get, post};
use serde::Serialize;

use self::auth::EnvTokens;
use self::error::{ApiError, MAX_BODY_BYTES, NoQuery};
use crate::app::App;
use crate::services::Service;

/// The hand-written OpenAPI 3.0 document, kept in the repository.
pub const OPENAPI_JSON: &str = include_str!("../../docs/openapi.json");

/// Shared by every handler.
pub struct AdminState {
    pub app: Arc<App>,
    /// Token fallbacks from the environment (the config wins).
    env: EnvTokens,
    /// Serialises rule mutations and purges; holds the bytes last written to the rules file.
    rules_file: tokio::sync::Mutex<Option<Vec<u8>>>,
    /// The anomaly detector and its automatic rules ([`anomalies::detect_loop`]).
    anomalies: parking_lot::Mutex<anomalies::Board>,
}

/// The admin API: its state, its router, its background services.
pub struct Admin {
    st: Arc<AdminState>,
}

impl Admin {
    /// The admin API over `app`, with token fallbacks from the environment (`env`).
    pub fn new(app: Arc<App>, env: EnvTokens) -> Admin {
        let written = app.policy.rules().to_json_bytes().ok();
        let board = anomalies::Board::new(&app.config().detector);
        let st = Arc::new(AdminState {
            app,
            env,
            rules_file: tokio::sync::Mutex::new(written),
            anomalies: parking_lot::Mutex::new(board),
        });
        // The first admin API of an app answers its console (tests may build several).
        let _ = st
            .app
            .console
            .set(Arc::new(console::Console::new(&st)) as Arc<dyn crate::app::Console>);
        Admin { st }
    }

    /// The expired-rule purge ([`rules::purge_loop`]) and the anomaly detector
    /// ([`anomalies::detect_loop`]); both end when the drain begins (`app.life`).
    pub fn services(&self) -> Vec<Service> {
        vec![
            Service::task("rule purge", rules::purge_loop(Arc::clone(&self.st))),
            Service::task(
                "anomaly detector",
                anomalies::detect_loop(Arc::clone(&self.st)),
            ),
        ]
    }

    pub fn router(&self) -> Router {
        routes(Arc::clone(&self.st))
    }
}

/// [`Admin::new`]'s router with explicit environment tokens, its services started when called
/// inside a tokio runtime (the tests' entry: one call, no process around it).
pub fn router_with_env(app: Arc<App>, env: EnvTokens) -> Router {
    let admin = Admin::new(app, env);
    if tokio::runtime::Handle::try_current().is_ok() {
        // Tasks only: this cannot fail.
        let _ = crate::services::start(admin.services());
    }
    admin.router()
}

fn routes(st: Arc<AdminState>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/v1/openapi.json", get(openapi))
        .route("/metrics", get(read::metrics))
        .route("/v1/rules", get(rules::list))
        .route("/v1/rules/fingerprint", post(rules::post_sql))
        .route("/v1/rules/preview", post(preview::preview))
        .route(
            "/v1/rules/fingerprint/{hash}",
            get(rules::get).put(rules::put).delete(rules::delete),
        )
        .route("/v1/fingerprints", get(read::fingerprints))
        .route("/v1/anomalies", get(anomalies::list))
        .route("/v1/callers", get(read::callers))
        .route("/v1/pools", get(read::pools))
        .route("/v1/breaker", get(read::breaker))
        .route("/v1/fleet", get(read::fleet))
        .route("/v1/reload", post(read::reload))
        .route("/v1/clients", get(control::clients))
        .route("/v1/clients/{id}", delete(control::terminate))
        .route("/v1/clients/{id}/cancel", post(control::cancel))
        .route("/v1/servers", get(control::servers))
        .route("/v1/pools/{db}/{user}/pause", post(control::pause))
        .route("/v1/pools/{db}/{user}/resume", post(control::resume))
        .route("/v1/pools/{db}/{user}/reconnect", post(control::reconnect))
        .route("/v1/databases/{db}/disable", post(control::disable))
        .route("/v1/databases/{db}/enable", post(control::enable))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&st),
            auth::guard,
        ))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(st)
}

/// Liveness: the process answers.
async fn healthz() -> &'static str {
    "ok\n"
}

#[derive(Serialize)]
struct Ready {
    ready: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
}

/// Readiness: ready unless shutting down (draining) or the database cannot be reached: every pool
/// has its last connection attempt failed with none succeeding since (a pool that has not
/// tried yet says nothing). A load balancer then sends new clients elsewhere.
async fn readyz(State(st): State<Arc<AdminState>>, _: NoQuery) -> impl IntoResponse {
    let pools = st.app.pools.all();
    let failing: Vec<String> = pools.iter().filter_map(|p| p.unreachable()).collect();
    let unreachable = !pools.is_empty() && failing.len() == pools.len();
    if st.app.life.is_stopping() {
        let body = Ready {
            ready: false,
            reason: Some("shutting down".into()),
        };
        (StatusCode::SERVICE_UNAVAILABLE, Json(body))
    } else if unreachable {
        let body = Ready {
            ready: false,
            reason: Some(format!(
                "the database cannot be reached: {}",
                failing.first().map_or("", String::as_str)
            )),
        };
        (StatusCode::SERVICE_UNAVAILABLE, Json(body))
    } else {
        let body = Ready {
            ready: true,
            reason: None,
        };
        (StatusCode::OK, Json(body))
    }
}

async fn openapi(_: NoQuery) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI_JSON)
}

async fn not_found() -> ApiError {
    ApiError::NotFound("no such endpoint; see /v1/openapi.json".into())
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}
