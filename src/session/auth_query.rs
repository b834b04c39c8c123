//! `auth.auth_query`: users the config does not list are looked up in Postgres (PgBouncer's
//! `auth_query`): the proxy logs in as `auth_query.user`, runs the query with the name as a
//! quoted literal for `$1`, and takes the SCRAM verifier from the last column of the first
//! row. The client is then checked against that verifier and the proxy's own logins as the
//! user use SCRAM pass-through (`auth::passthrough`).
//!
//! Answers are cached per name (`cache_ttl_ms`; "no such user" for `negative_ttl_ms`), at
//! most `auth::cache::MAX_CACHED` names, so a flood of logins — or of made-up names — costs Postgres at
//! most one query per name per TTL. A name with no row, or a NULL verifier, is an unknown
//! user (the mock exchange, 28P01: nothing tells which names exist). An md5 hash is refused
//! with a message that says why. A failed lookup is FATAL with the reason, never cached.

use std::time::Duration;

use crate::app::App;
use crate::auth::{UserAuth, Verifier};
use crate::config::AuthMethod;
use crate::pool::{BackendConn, ConnectParams};
use crate::protocol::PgError;
use crate::protocol::params;

/// The credentials of `user` from `auth.auth_query`: `Ok(None)` when none is configured or
/// Postgres has no such user.
pub async fn lookup(app: &App, user: &str) -> Result<Option<UserAuth>, PgError> {
    let cfg = app.config();
    let Some(q) = cfg.auth.auth_query.as_ref() else {
        return Ok(None);
    };
    let ttl = Duration::from_millis(q.cache_ttl_ms);
    let negative_ttl = Duration::from_millis(q.negative_ttl_ms);
    let verifier = match app.auth_cache.get(user, ttl, negative_ttl) {
        Some(v) => v,
        None => {
            let v = query(app, &cfg, q, user).await?;
            app.auth_cache.put(user, v.clone(), ttl.max(negative_ttl));
            v
        }
    };
    Ok(verifier.map(|v| UserAuth {
        method: AuthMethod::ScramSha256,
        verifier: Some(v),
        md5_inner: None,
        backend_password: None,
    }))
}

async fn query(
    app: &App,
    cfg: &crate::config::Config,
    q: &crate::config::AuthQueryConfig,
    user: &str,
) -> Result<Option<Verifier>, PgError> {
    let failed = |why: String| {
        tracing::error!(auth_user = %q.user, error = %why, "auth_query lookup failed");
        PgError::fatal(
            "08006",
            format!("pgsluice: the user could not be looked up (auth_query): {why}"),
        )
    };
    let mut params = ConnectParams {
        user: q.user.clone(),
        password: q.password.clone(),
        database: q.database.clone(),
        ..ConnectParams::blank(app.tls.backend())
    };
    params.set_endpoint(crate::app::endpoint(cfg));
    let mut conn = BackendConn::connect(&params, 1)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let sql = q.query.replace("$1", &params::literal(user));
    let row = conn
        .first_row(&sql)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let secret = row.and_then(|r| r.into_iter().last()).flatten();
    match secret {
        None => Ok(None),
        Some(s) if s.starts_with("SCRAM-SHA-256$") => Verifier::parse(&s)
            .map(Some)
            .ok_or_else(|| failed("the verifier it returned does not parse".into())),
        Some(s) if s.starts_with("md5") => Err(PgError::fatal(
            "28000",
            "pgsluice: Postgres stores an md5 hash for this user; the proxy needs a \
             SCRAM-SHA-256 verifier (set password_encryption = scram-sha-256 and the password \
             again)",
        )),
        Some(_) => Err(failed(
            "it returned something other than a SCRAM-SHA-256 verifier".into(),
        )),
    }
}
