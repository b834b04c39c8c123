//! The admin API in process, for `admin` and `rules::api`: an `App` built from a `Config`, its
//! router (`router_with_env`, with the write token [`W`] and the read token [`R`]), and requests
//! through `tower::ServiceExt::oneshot` — no socket.

use std::path::Path;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode, header};
use serde_json::{Value, json};
use tower::ServiceExt;

use pgsluice::admin::auth::EnvTokens;
use pgsluice::admin::router_with_env;
use pgsluice::app::App;
use pgsluice::config::Config;
use pgsluice::policy::rules::RuleSet;

/// The write token of the admin API under test.
pub const W: &str = "write-secret-token";
/// Its read token.
pub const R: &str = "read-secret-token";
/// A fingerprint (16 hex digits) for rules.
pub const FP: &str = "00000000deadbeef";

pub fn config(rules_file: Option<&Path>) -> Config {
    let mut c = Config::default();
    c.admin.write_token = Some(W.into());
    c.admin.read_token = Some(R.into());
    c.admin.rules_file = rules_file.map(|p| p.display().to_string());
    c
}

pub fn app_with(c: Config) -> Arc<App> {
    App::new(c, Arc::new(RuleSet::new())).expect("app")
}

pub fn api(app: &Arc<App>) -> Router {
    router_with_env(app.clone(), EnvTokens::default())
}

pub struct Resp {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub async fn call(
    r: &Router,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<(&str, Vec<u8>)>,
) -> Resp {
    let mut b = Request::builder().method(method).uri(path);
    if let Some(t) = token {
        b = b.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let req = match body {
        Some((ctype, bytes)) => b
            .header(header::CONTENT_TYPE, ctype)
            .header(header::CONTENT_LENGTH, bytes.len())
            .body(Body::from(bytes)),
        None => b.body(Body::empty()),
    }
    .expect("request");
    let resp = r.clone().oneshot(req).await.expect("infallible");
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = axum::body::to_bytes(resp.into_body(), 64 << 20)
        .await
        .expect("body");
    Resp {
        status,
        headers,
        body,
    }
}

pub async fn get(r: &Router, path: &str, token: Option<&str>) -> Resp {
    call(r, "GET", path, token, None).await
}

pub async fn put_rule(r: &Router, fp: &str, token: Option<&str>, rule: &Value) -> Resp {
    let body = serde_json::to_vec(rule).expect("json");
    call(
        r,
        "PUT",
        &format!("/v1/rules/fingerprint/{fp}"),
        token,
        Some(("application/json", body)),
    )
    .await
}

pub fn throttle() -> Value {
    json!({"action":"THROTTLE","max_qps":2,"action_on_exceed":"REJECT",
           "error_message":"Query pattern is throttled due to high read amplification",
           "ttl_seconds":3600})
}
