//! Who may call what: bearer tokens, and the JSON-only rule for mutations (after the
//! `Host` check of [`super::host`], for every path that is not open).
//!
//! Access is decided by method, so a new endpoint is protected by default:
//! * open: `/healthz`, `/readyz`, `/v1/openapi.json` (liveness, readiness, the API document);
//! * read (`GET`, `HEAD`, and the POSTs in [`READ_POSTS`], which compute an answer from a
//!   body and change nothing): the read token or the write token; no token at all when
//!   `admin.open_reads: true`;
//! * write (any other method): the write token only.
//!
//! Tokens come from `admin.write_token` / `admin.read_token` in the config; when a config
//! value is absent, `PGSLUICE_ADMIN_TOKEN` / `PGSLUICE_ADMIN_READ_TOKEN` (read once, when the
//! router is built) are used. The config wins so a reload can rotate a token. Empty strings
//! count as unset.
//!
//! Answers: a missing and a wrong token get the same 401 body; a valid read token on a
//! mutation gets 403; with no write token configured, every mutation is 403 with a message
//! saying how to configure one; with no token of any kind and reads not open, reads are 403
//! the same way. Comparison is constant-time in the presented value: both configured tokens
//! are always compared in full, so timing says nothing about which one, or how much of it,
//! matched (only the configured tokens' lengths influence the time).
//!
//! After authorization, a mutation that carries a body (or declares a Content-Type) must be
//! `application/json` (415 otherwise); a bodiless `DELETE` or `POST /v1/reload` needs no
//! Content-Type. This refuses `text/plain` form posts from browsers (F2).

use std::sync::Arc;

use axum::body::HttpBody;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::Response;

use super::AdminState;
use super::error::{ApiError, is_json};
use crate::config::AdminConfig;

pub const ENV_WRITE_TOKEN: &str = "PGSLUICE_ADMIN_TOKEN";
pub const ENV_READ_TOKEN: &str = "PGSLUICE_ADMIN_READ_TOKEN";

/// Paths anyone may call.
const OPEN_PATHS: [&str; 3] = ["/healthz", "/readyz", "/v1/openapi.json"];

/// POSTs that change nothing (the body is a question, not a change): read access. Their
/// handlers still take only `application/json` bodies (`JsonBody`).
pub const READ_POSTS: [&str; 1] = ["/v1/rules/preview"];

/// Tokens from the environment, used where the config leaves them unset.
#[derive(Debug, Clone, Default)]
pub struct EnvTokens {
    pub write: Option<String>,
    pub read: Option<String>,
}

impl EnvTokens {
    pub fn from_env() -> Self {
        EnvTokens {
            write: std::env::var(ENV_WRITE_TOKEN).ok(),
            read: std::env::var(ENV_READ_TOKEN).ok(),
        }
    }
}

/// What a request needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Open,
    Read,
    Write,
}

impl Access {
    pub fn of(method: &Method, path: &str) -> Access {
        if OPEN_PATHS.contains(&path) {
            Access::Open
        } else if method == Method::GET
            || method == Method::HEAD
            || (method == Method::POST && READ_POSTS.contains(&path))
        {
            Access::Read
        } else {
            Access::Write
        }
    }
}

/// The effective credentials for one request.
struct Tokens<'a> {
    write: Option<&'a str>,
    read: Option<&'a str>,
    open_reads: bool,
}

fn non_empty(s: &Option<String>) -> Option<&str> {
    s.as_deref().filter(|t| !t.is_empty())
}

impl<'a> Tokens<'a> {
    fn resolve(cfg: &'a AdminConfig, env: &'a EnvTokens) -> Self {
        Tokens {
            write: non_empty(&cfg.write_token).or(non_empty(&env.write)),
            read: non_empty(&cfg.read_token).or(non_empty(&env.read)),
            open_reads: cfg.open_reads,
        }
    }
}

/// The token from `Authorization: Bearer <token>` (scheme case-insensitive).
fn presented(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Equality whose time depends on `expected.len()` only, never on where `given` differs.
fn ct_eq(expected: &[u8], given: &[u8]) -> bool {
    let mut diff = u8::from(expected.len() != given.len());
    for (i, e) in expected.iter().enumerate() {
        diff |= e ^ given.get(i).copied().unwrap_or(!e);
    }
    std::hint::black_box(diff) == 0
}

fn matches(token: Option<&str>, given: &str) -> bool {
    token.is_some_and(|t| ct_eq(t.as_bytes(), given.as_bytes()))
}

/// The decision, separate from HTTP plumbing so it is easy to read and test.
fn authorize(access: Access, tokens: &Tokens<'_>, given: Option<&str>) -> Result<(), ApiError> {
    let given = given.unwrap_or("");
    // Both comparisons always run (`&` and `|` do not short-circuit on bools used this way).
    let is_write = matches(tokens.write, given) & !given.is_empty();
    let is_read = matches(tokens.read, given) & !given.is_empty();
    match access {
        Access::Open => Ok(()),
        Access::Read if tokens.open_reads || is_write | is_read => Ok(()),
        Access::Read if tokens.write.is_none() && tokens.read.is_none() => {
            Err(ApiError::Forbidden(format!(
                "no admin token is configured: set admin.read_token or admin.write_token \
                 (or {ENV_READ_TOKEN} / {ENV_WRITE_TOKEN}), or admin.open_reads: true"
            )))
        }
        Access::Read => Err(ApiError::Unauthorized),
        Access::Write if tokens.write.is_none() => Err(ApiError::Forbidden(format!(
            "changes are disabled: no write token is configured; set admin.write_token in \
             the config or {ENV_WRITE_TOKEN} in the environment"
        ))),
        Access::Write if is_write => Ok(()),
        Access::Write if is_read => Err(ApiError::Forbidden(
            "the read token cannot change anything; use the write token".into(),
        )),
        Access::Write => Err(ApiError::Unauthorized),
    }
}

/// Middleware: authorization, then the JSON-only rule for mutations.
pub async fn guard(
    State(st): State<Arc<AdminState>>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let access = Access::of(req.method(), req.uri().path());
    let cfg = st.app.config();
    if access != Access::Open {
        super::host::check(&req, &cfg.admin.allowed_hosts)?;
    }
    let tokens = Tokens::resolve(&cfg.admin, &st.env);
    if let Err(e) = authorize(access, &tokens, presented(req.headers())) {
        if e == ApiError::Unauthorized {
            tracing::warn!(method = %req.method(), path = req.uri().path(), "admin API: rejected token");
        }
        return Err(e);
    }
    if access == Access::Write {
        let h = req.headers();
        let has_body = req.body().size_hint().upper() != Some(0);
        if (h.contains_key(header::CONTENT_TYPE) || has_body) && !is_json(h) {
            return Err(ApiError::UnsupportedMediaType);
        }
    }
    Ok(next.run(req).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t<'a>(w: Option<&'a str>, r: Option<&'a str>, open: bool) -> Tokens<'a> {
        Tokens {
            write: w,
            read: r,
            open_reads: open,
        }
    }

    #[test]
    fn ct_eq_is_equality() {
        assert!(ct_eq(b"secret", b"secret"));
        assert!(!ct_eq(b"secret", b"secreT"));
        assert!(!ct_eq(b"secret", b"secret2"));
        assert!(!ct_eq(b"secret", b"secre"));
        assert!(!ct_eq(b"secret", b""));
        assert!(!ct_eq(b"\xff", b""));
    }

    #[test]
    fn matrix() {
        let both = t(Some("w"), Some("r"), false);
        assert_eq!(authorize(Access::Write, &both, Some("w")), Ok(()));
        assert!(matches!(
            authorize(Access::Write, &both, Some("r")),
            Err(ApiError::Forbidden(_))
        ));
        assert_eq!(
            authorize(Access::Write, &both, Some("x")),
            Err(ApiError::Unauthorized)
        );
        assert_eq!(
            authorize(Access::Write, &both, None),
            Err(ApiError::Unauthorized)
        );
        assert_eq!(authorize(Access::Read, &both, Some("r")), Ok(()));
        assert_eq!(authorize(Access::Read, &both, Some("w")), Ok(()));
        assert_eq!(
            authorize(Access::Read, &both, None),
            Err(ApiError::Unauthorized)
        );
        assert_eq!(authorize(Access::Open, &both, None), Ok(()));

        let open = t(Some("w"), None, true);
        assert_eq!(authorize(Access::Read, &open, None), Ok(()));
        assert_eq!(
            authorize(Access::Write, &open, None),
            Err(ApiError::Unauthorized)
        );

        let none = t(None, None, false);
        assert!(matches!(
            authorize(Access::Write, &none, Some("w")),
            Err(ApiError::Forbidden(_))
        ));
        assert!(matches!(
            authorize(Access::Read, &none, None),
            Err(ApiError::Forbidden(_))
        ));
    }

    #[test]
    fn a_preview_is_a_read_and_other_posts_are_writes() {
        assert_eq!(Access::of(&Method::POST, "/v1/rules/preview"), Access::Read);
        assert_eq!(Access::of(&Method::PUT, "/v1/rules/preview"), Access::Write);
        assert_eq!(
            Access::of(&Method::POST, "/v1/rules/fingerprint"),
            Access::Write
        );
        assert_eq!(Access::of(&Method::POST, "/v1/reload"), Access::Write);
    }

    #[test]
    fn bearer_parsing() {
        let mut h = HeaderMap::new();
        assert_eq!(presented(&h), None);
        h.insert(header::AUTHORIZATION, "bearer  abc ".parse().unwrap());
        assert_eq!(presented(&h), Some("abc"));
        h.insert(header::AUTHORIZATION, "Basic abc".parse().unwrap());
        assert_eq!(presented(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer ".parse().unwrap());
        assert_eq!(presented(&h), None);
    }
}
