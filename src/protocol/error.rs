//! Errors the proxy itself reports to clients, as ordinary Postgres ErrorResponses.
//!
//! One place maps each situation to its SQLSTATE and client-visible text, with named
//! constructors, so every refusal reads the same to every driver. Encoding goes through pgwire.

use bytes::BytesMut;
use pgwire::messages::Message;
use pgwire::messages::response::{ErrorResponse, NoticeResponse};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Error,
    Fatal,
}

/// An error as a client will see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgError {
    pub severity: Severity,
    pub code: &'static str,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

impl std::fmt::Display for PgError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.code)
    }
}

impl std::error::Error for PgError {}

impl PgError {
    pub fn new(severity: Severity, code: &'static str, message: impl Into<String>) -> Self {
        PgError {
            severity,
            code,
            message: message.into(),
            detail: None,
            hint: None,
        }
    }

    pub fn fatal(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(Severity::Fatal, code, message)
    }

    pub fn error(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(Severity::Error, code, message)
    }

    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    pub fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// Framing or protocol violation: FATAL 08P01, then the connection is closed.
    pub fn protocol_violation(message: impl Into<String>) -> Self {
        Self::fatal("08P01", message)
    }

    /// Same text for unknown users and wrong passwords, so users cannot be enumerated.
    pub fn auth_failed(user: &str) -> Self {
        Self::fatal(
            "28P01",
            format!("password authentication failed for user \"{user}\""),
        )
    }

    pub fn too_many_clients(max: usize, retry_after_ms: u64) -> Self {
        Self::fatal("53300", "pgsluice: sorry, too many clients already")
            .with_detail(format!("limits.max_client_conn={max}"))
            .with_hint(format!("retry_after_ms={retry_after_ms}"))
    }

    /// More handshakes in progress than `limit` (`max_handshakes`, or the client address's
    /// `max_handshakes_per_address`) allows: the connection is refused before startup.
    pub fn too_many_handshakes(limit: &'static str, max: usize, retry_after_ms: u64) -> Self {
        let message = if limit == "max_handshakes" {
            "sorry, too many clients are connecting right now; try again"
        } else {
            "sorry, too many clients are connecting right now from this address; try again"
        };
        Self::fatal("53300", message)
            .with_detail(format!("limits.{limit}={max}"))
            .with_hint(format!("retry_after_ms={retry_after_ms}"))
    }

    /// Waited longer than the pool's checkout timeout for a backend connection.
    pub fn checkout_timeout(
        pool: &str,
        waited_ms: u128,
        limit_ms: u128,
        retry_after_ms: u64,
    ) -> Self {
        let what =
            format!("no backend connection of pool {pool} became free within {waited_ms} ms");
        Self::checkout_refused(pool, &what, limit_ms, retry_after_ms)
    }

    /// The pool's queue is far longer than this client may wait: refused on arrival, not
    /// after the wait (`place_ms`: when its turn would come, at the rate the pool serves).
    pub fn checkout_would_wait(
        pool: &str,
        place_ms: u128,
        limit_ms: u128,
        retry_after_ms: u64,
    ) -> Self {
        let what = format!(
            "a backend connection of pool {pool} is expected in {place_ms} ms, far longer than this client may wait; refused now rather than after the wait"
        );
        Self::checkout_refused(pool, &what, limit_ms, retry_after_ms)
    }

    /// `ERR_QUEUE_TIMEOUT` for a pool's checkout: `what` happened, against its wait limit.
    fn checkout_refused(pool: &str, what: &str, limit_ms: u128, retry_after_ms: u64) -> Self {
        Self::error("53300", format!("pgsluice: ERR_QUEUE_TIMEOUT: {what}"))
            .with_detail(format!("limit: pool {pool} checkout wait of {limit_ms} ms (pool.checkout_timeout_ms or the caller's queue_timeout_ms, whichever is shorter)"))
            .with_hint(format!("retry_after_ms={retry_after_ms}"))
    }

    /// The backend could not be reached or refused the proxy's login.
    pub fn backend_unavailable(reason: impl std::fmt::Display, retry_after_ms: u64) -> Self {
        Self::error(
            "08006",
            format!("pgsluice: could not connect to the database server: {reason}"),
        )
        .with_hint(format!("retry_after_ms={retry_after_ms}"))
    }

    /// The backend connection died under a running request.
    pub fn backend_lost() -> Self {
        Self::fatal(
            "08006",
            "pgsluice: the server connection was lost while a request was in progress",
        )
    }

    /// The server sent nothing after a statement outran its timeout and the proxy's cancel:
    /// its connection was closed (a network partition or a hung server).
    pub fn backend_unresponsive(grace_ms: u64) -> Self {
        Self::fatal(
            "08006",
            "pgsluice: the server stopped answering: nothing came back after the statement timeout and the proxy's cancel",
        )
        .with_detail(format!(
            "no reply within pool.cancel_grace_ms={grace_ms} after the cancel; the server connection was closed"
        ))
    }

    pub fn shutting_down() -> Self {
        Self::fatal(
            "57P01",
            "pgsluice: terminating connection because the proxy is shutting down",
        )
    }

    /// An operator ended the session (`DELETE /v1/clients/{id}`), as Postgres words
    /// `pg_terminate_backend`.
    pub fn terminated_by_admin() -> Self {
        Self::fatal(
            "57P01",
            "pgsluice: terminating connection due to administrator command",
        )
    }

    /// Encodes as an ErrorResponse.
    pub fn encode(&self, out: &mut BytesMut) {
        let msg = ErrorResponse::new(self.fields());
        // Encoding into a BytesMut only fails on strings with interior NULs; ours have none.
        if msg.encode(out).is_err() {
            tracing::error!(code = self.code, "failed to encode an ErrorResponse");
        }
    }

    /// Encodes the same fields as a NoticeResponse (used for warn-mode rules).
    pub fn encode_notice(&self, out: &mut BytesMut) {
        let mut fields = self.fields();
        fields[0].1 = "NOTICE".into();
        fields[1].1 = "NOTICE".into();
        if NoticeResponse::new(fields).encode(out).is_err() {
            tracing::error!(code = self.code, "failed to encode a NoticeResponse");
        }
    }

    fn fields(&self) -> Vec<(u8, String)> {
        let sev = match self.severity {
            Severity::Error => "ERROR",
            Severity::Fatal => "FATAL",
        };
        let mut fields = vec![
            (b'S', sev.to_string()),
            (b'V', sev.to_string()),
            (b'C', self.code.to_string()),
            (b'M', strip_nul(&self.message)),
        ];
        if let Some(d) = &self.detail {
            fields.push((b'D', strip_nul(d)));
        }
        if let Some(h) = &self.hint {
            fields.push((b'H', strip_nul(h)));
        }
        fields
    }
}

/// Client-provided text (user names, statement names) may carry NULs; they cannot go on the wire.
fn strip_nul(s: &str) -> String {
    s.replace('\0', "")
}

/// Rebuilds an ErrorResponse body with its error position (`P`) moved `shift` characters to
/// the left (dropped if it would point before the client's text).
pub fn shift_position(body: &[u8], shift: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len());
    let mut rest = body;
    while let Some((&code, tail)) = rest.split_first() {
        if code == 0 {
            break;
        }
        let Some(end) = tail.iter().position(|&b| b == 0) else {
            break;
        };
        let value = &tail[..end];
        rest = &tail[end + 1..];
        if code == b'P' {
            let pos = std::str::from_utf8(value)
                .ok()
                .and_then(|v| v.parse::<u64>().ok());
            if let Some(p) = pos
                .and_then(|p| p.checked_sub(u64::from(shift)))
                .filter(|p| *p >= 1)
            {
                out.push(b'P');
                out.extend_from_slice(p.to_string().as_bytes());
                out.push(0);
            }
            continue;
        }
        out.push(code);
        out.extend_from_slice(value);
        out.push(0);
    }
    out.push(0);
    out
}

/// Reads the SQLSTATE (`C` field) of an ErrorResponse body, if present.
pub fn sqlstate_of(body: &[u8]) -> Option<&str> {
    field_of(body, b'C')
}

/// Reads one field of an ErrorResponse/NoticeResponse body.
pub fn field_of(body: &[u8], want: u8) -> Option<&str> {
    let mut rest = body;
    while let Some((&code, tail)) = rest.split_first() {
        if code == 0 {
            return None;
        }
        let end = tail.iter().position(|&b| b == 0)?;
        if code == want {
            return std::str::from_utf8(&tail[..end]).ok();
        }
        rest = &tail[end + 1..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_and_reads_back_fields() {
        let e = PgError::auth_failed("bob").with_hint("retry_after_ms=5");
        let mut b = BytesMut::new();
        e.encode(&mut b);
        assert_eq!(b[0], b'E');
        let body = &b[5..];
        assert_eq!(sqlstate_of(body), Some("28P01"));
        assert_eq!(field_of(body, b'S'), Some("FATAL"));
        assert_eq!(field_of(body, b'H'), Some("retry_after_ms=5"));
        assert_eq!(
            field_of(body, b'M'),
            Some("password authentication failed for user \"bob\"")
        );
    }

    #[test]
    fn positions_shift_left() {
        let body = b"SERROR\0C42601\0P40\0Msyntax\0\0";
        let out = shift_position(body, 30);
        assert_eq!(field_of(&out, b'P'), Some("10"));
        assert_eq!(field_of(&out, b'M'), Some("syntax"));
        assert_eq!(field_of(&shift_position(body, 45), b'P'), None);
    }

    #[test]
    fn field_reader_survives_garbage() {
        assert_eq!(sqlstate_of(b""), None);
        assert_eq!(sqlstate_of(b"Cabc"), None);
        assert_eq!(sqlstate_of(b"\0Cxx\0"), None);
    }
}
