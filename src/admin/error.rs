//! The admin API's one error type and the extractors that turn malformed requests into it.
//!
//! Every failure leaves the API as JSON `{"error": <kind>, "field"?: <name>, "message": <text>}`
//! with the matching status, through [`ApiError`]'s `IntoResponse`. Messages never echo tokens
//! or request bodies back. The extractors here replace axum's plain-text rejections so that a
//! bad path, query or body names what was wrong.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::policy::rules::{RuleError, parse_fingerprint};

/// Largest request body accepted anywhere in the admin API (a rule is well under 2 KiB).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Everything that can go wrong in a request, mapped to a status in one place.
#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// Missing or wrong bearer token (the same answer for both).
    Unauthorized,
    /// Authenticated but not allowed, or mutations not configured.
    Forbidden(String),
    /// A request field is wrong; `kind` is the `error` value (`invalid rule`, `bad request`).
    Invalid {
        kind: &'static str,
        field: String,
        message: String,
    },
    NotFound(String),
    MethodNotAllowed,
    /// Mutations take `application/json`.
    UnsupportedMediaType,
    PayloadTooLarge,
    /// `POST /v1/reload` with a config that does not load; the old one stays.
    InvalidConfig(Vec<String>),
    Unavailable(String),
    /// The request conflicts with the state of what it names (409).
    Conflict(String),
    /// The `Host` the request names is not one this API answers to (DNS rebinding).
    MisdirectedHost(String),
    /// Server-side failure; `message` is safe to show (no paths with secrets, no tokens).
    Internal(String),
}

#[derive(Serialize)]
struct Body<'a> {
    error: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<&'a str>,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    errors: Option<&'a [String]>,
}

impl ApiError {
    /// A request parameter or field is wrong.
    pub fn bad_request(field: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::Invalid {
            kind: "bad request",
            field: field.into(),
            message: message.into(),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::Invalid { .. } | ApiError::InvalidConfig(_) => StatusCode::BAD_REQUEST,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::MisdirectedHost(_) => StatusCode::MISDIRECTED_REQUEST,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// A rule that failed validation: `{"error":"invalid rule","field":"max_qps",…}`.
impl From<RuleError> for ApiError {
    fn from(e: RuleError) -> Self {
        ApiError::Invalid {
            kind: "invalid rule",
            field: e.field,
            message: e.message,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let too_large = format!("request body exceeds {MAX_BODY_BYTES} bytes");
        let (error, field, message, errors): (&str, Option<&str>, &str, Option<&[String]>) =
            match &self {
                ApiError::Unauthorized => (
                    "unauthorized",
                    None,
                    "a valid bearer token is required",
                    None,
                ),
                ApiError::Forbidden(m) => ("forbidden", None, m, None),
                ApiError::Invalid {
                    kind,
                    field,
                    message,
                } => (kind, Some(field), message, None),
                ApiError::NotFound(m) => ("not found", None, m, None),
                ApiError::MethodNotAllowed => (
                    "method not allowed",
                    None,
                    "this endpoint does not take that method; see /v1/openapi.json",
                    None,
                ),
                ApiError::UnsupportedMediaType => (
                    "unsupported media type",
                    Some("content-type"),
                    "requests with a body must be Content-Type: application/json",
                    None,
                ),
                ApiError::PayloadTooLarge => {
                    ("payload too large", Some("body"), too_large.as_str(), None)
                }
                ApiError::InvalidConfig(errs) => (
                    "invalid config",
                    None,
                    "the configuration was not reloaded; the running one is kept",
                    Some(errs.as_slice()),
                ),
                ApiError::Unavailable(m) => ("unavailable", None, m, None),
                ApiError::Conflict(m) => ("conflict", None, m, None),
                ApiError::MisdirectedHost(m) => ("misdirected request", Some("host"), m, None),
                ApiError::Internal(m) => ("internal error", None, m, None),
            };
        let body = Body {
            error,
            field,
            message,
            errors,
        };
        let mut resp = (status, axum::Json(body)).into_response();
        if matches!(self, ApiError::Unauthorized) {
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"pgsluice\""),
            );
        }
        resp
    }
}

/// True when the request declares `application/json` (parameters such as charset allowed).
pub fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
}

/// A request without a query string. GET endpoints take no parameters unless they say so,
/// so `GET /v1/rules/fingerprint/…?action=REJECT` is a 400, never a silent no-op.
pub struct NoQuery;

impl<S: Send + Sync> FromRequestParts<S> for NoQuery {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        match parts.uri.query() {
            None | Some("") => Ok(NoQuery),
            Some(q) => {
                let key = q.split(['=', '&']).next().unwrap_or_default();
                Err(ApiError::bad_request(
                    "query",
                    format!(
                        "unknown query parameter {:?}; this endpoint takes none",
                        truncate(key, 64)
                    ),
                ))
            }
        }
    }
}

/// The `{hash}` path segment as a fingerprint: 16 hex digits, else 400 naming `hash`.
pub struct Fingerprint(pub u64);

impl<S: Send + Sync> FromRequestParts<S> for Fingerprint {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let axum::extract::Path(hash) =
            axum::extract::Path::<String>::from_request_parts(parts, state)
                .await
                .map_err(|e| ApiError::bad_request("hash", e.body_text()))?;
        parse_fingerprint(&hash)
            .map(Fingerprint)
            .map_err(|e| ApiError::bad_request("hash", e.message))
    }
}

/// A JSON request body: `application/json` (else 415) of at most [`MAX_BODY_BYTES`] (else
/// 413). Parsing is left to the handler so errors can name fields.
pub struct JsonBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if !is_json(req.headers()) {
            return Err(ApiError::UnsupportedMediaType);
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge
            } else {
                ApiError::bad_request("body", e.body_text())
            }
        })?;
        Ok(JsonBody(bytes))
    }
}

/// At most `max` bytes of `s`, cut at a character boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
