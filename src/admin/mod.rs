//! The admin HTTP API (axum, its own port): health and pool state so far.
//!
//! `router(app)` is built apart from serving so tests can call it without a socket.

use std::sync::Arc;

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};

use crate::app::App;
use crate::pool::PoolSnapshot;

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/v1/pools", get(pools))
        .with_state(app)
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn pools(State(app): State<Arc<App>>) -> Json<Vec<PoolSnapshot>> {
    let mut v: Vec<PoolSnapshot> = app.pools.all().iter().map(|p| p.snapshot()).collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    Json(v)
}
