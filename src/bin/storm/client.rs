//! Talking to the target: log in (`login.rs`, which hands back the crate's own
//! `pool::backend::BackendConn`), run one simple query, read a scalar, say goodbye — and turn
//! every failure into a [`Failure`] that the recorder can count and the retry policy can act
//! on.
//!
//! A failure is a *refusal* when the message carries a pgsluice `ERR_…` code (the proxy said
//! "not now", usually with a `retry_after_ms=N` HINT); anything else — Postgres' own "too many
//! clients", I/O errors, timeouts — is an *error*. Reasons are short, bounded strings (SQLSTATE
//! plus the `ERR_…` code or the message with digits folded) so they can be tabulated.

use std::time::Duration;

use pgsluice::config::BackendUrl;
use pgsluice::pool::backend::{BackendConn, ConnectError, ConnectParams};

use super::login;
use pgsluice::protocol::error::field_of;
use tokio::io::AsyncWriteExt;

/// Why an attempt failed.
#[derive(Debug, Clone)]
pub enum Failure {
    Refused {
        reason: String,
        retry_after_ms: Option<u64>,
        fatal: bool,
    },
    Error {
        reason: String,
        retry_after_ms: Option<u64>,
        fatal: bool,
    },
}

impl Failure {
    /// The connection is gone (FATAL, I/O): reconnect before the next attempt.
    pub fn fatal(&self) -> bool {
        match self {
            Failure::Refused { fatal, .. } | Failure::Error { fatal, .. } => *fatal,
        }
    }

    /// The same failure with the step it happened at in front of its reason (`login: …`,
    /// `INSERT: …`), so the tables tell refusals at the door from those after a login.
    pub fn at(self, step: &str) -> Failure {
        match self {
            Failure::Refused {
                reason,
                retry_after_ms,
                fatal,
            } => Failure::Refused {
                reason: format!("{step}: {reason}"),
                retry_after_ms,
                fatal,
            },
            Failure::Error {
                reason,
                retry_after_ms,
                fatal,
            } => Failure::Error {
                reason: format!("{step}: {reason}"),
                retry_after_ms,
                fatal,
            },
        }
    }

    /// Marks the connection as unusable (e.g. its rollback failed too).
    pub fn set_fatal(&mut self) {
        match self {
            Failure::Refused { fatal, .. } | Failure::Error { fatal, .. } => *fatal = true,
        }
    }

    pub fn retry_after_ms(&self) -> Option<u64> {
        match self {
            Failure::Refused { retry_after_ms, .. } | Failure::Error { retry_after_ms, .. } => {
                *retry_after_ms
            }
        }
    }
}

/// `postgres://USER:PASSWORD@HOST:PORT/DB` → connection parameters.
pub fn params(url: &str, connect_timeout: Duration) -> Result<ConnectParams, String> {
    let u = BackendUrl::parse(url).map_err(|e| format!("invalid URL: {e}"))?;
    Ok(ConnectParams::from_url(
        &u,
        connect_timeout,
        None,
        pgsluice::tls::BackendTlsHandle::disabled(),
    ))
}

/// Folds digit runs to `N` and bounds the length, so messages group into few reasons.
fn fold(message: &str) -> String {
    let mut out = String::new();
    let mut in_digits = false;
    for ch in message.chars() {
        if ch.is_ascii_digit() {
            if !in_digits {
                out.push('N');
            }
            in_digits = true;
        } else {
            in_digits = false;
            out.push(ch);
        }
        if out.len() >= 80 {
            out.push('…');
            break;
        }
    }
    out
}

/// The `ERR_…` code in a pgsluice message, if any.
fn err_code(message: &str) -> Option<&str> {
    let at = message.find("ERR_")?;
    let rest = &message[at..];
    let end = rest
        .find(|c: char| !(c.is_ascii_uppercase() || c == '_'))
        .unwrap_or(rest.len());
    Some(&rest[..end])
}

/// `retry_after_ms=N` in a HINT.
fn hint_ms(hint: &str) -> Option<u64> {
    let at = hint.find("retry_after_ms=")?;
    let digits: String = hint[at + "retry_after_ms=".len()..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

pub fn classify(e: &ConnectError) -> Failure {
    match e {
        ConnectError::Server {
            code,
            message,
            frame,
        } => {
            let body = frame.get(5..).unwrap_or_default();
            let retry_after_ms = field_of(body, b'H').and_then(hint_ms);
            let fatal = matches!(field_of(body, b'V'), Some("FATAL" | "PANIC"));
            match err_code(message) {
                Some(c) => Failure::Refused {
                    reason: format!("{code} {c}"),
                    retry_after_ms,
                    fatal,
                },
                None => Failure::Error {
                    reason: format!("{code} {}", fold(message)),
                    retry_after_ms,
                    fatal,
                },
            }
        }
        ConnectError::Io(io) => Failure::Error {
            reason: format!("io {:?}", io.kind()),
            retry_after_ms: None,
            fatal: true,
        },
        ConnectError::Timeout(_) => Failure::Error {
            reason: "timeout".into(),
            retry_after_ms: None,
            fatal: true,
        },
        ConnectError::Auth(m) => Failure::Error {
            reason: format!("auth {}", fold(m)),
            retry_after_ms: None,
            fatal: true,
        },
        ConnectError::MethodNotAllowed { method, .. } => Failure::Error {
            reason: format!("auth method {} not allowed", method.name()),
            retry_after_ms: None,
            fatal: true,
        },
        ConnectError::Target(m) => Failure::Error {
            reason: format!("target {}", fold(m)),
            retry_after_ms: None,
            fatal: true,
        },
        ConnectError::Protocol(m) => Failure::Error {
            reason: format!("protocol {}", fold(m)),
            retry_after_ms: None,
            fatal: true,
        },
    }
}

pub async fn connect(p: &ConnectParams) -> Result<BackendConn, Failure> {
    connect_as(p, None).await
}

/// Logs in with `application_name` in the startup packet.
pub async fn connect_as(
    p: &ConnectParams,
    application_name: Option<&str>,
) -> Result<BackendConn, Failure> {
    connect_from(p, application_name, None).await
}

/// Logs in with `application_name`, from the local address `local` when given.
pub async fn connect_from(
    p: &ConnectParams,
    application_name: Option<&str>,
    local: Option<std::net::IpAddr>,
) -> Result<BackendConn, Failure> {
    login::connect(p, application_name, local)
        .await
        .map_err(|e| classify(&e))
}

/// One simple query; `Ok` at ReadyForQuery without an error.
pub async fn run(conn: &mut BackendConn, sql: &str) -> Result<(), Failure> {
    conn.simple(sql).await.map(|_| ()).map_err(|e| classify(&e))
}

/// Sends Terminate and drops the connection (so the server does not log an unexpected EOF).
pub async fn terminate(mut conn: BackendConn) {
    let _ = tokio::time::timeout(
        Duration::from_millis(200),
        conn.stream.write_all(&[b'X', 0, 0, 0, 4]),
    )
    .await;
}

/// How a client behaves after a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RetryMode {
    /// Retry at once (a yield, no sleep): the herd that knocks databases over.
    Naive,
    /// Full-jitter exponential backoff, honouring the proxy's `retry_after_ms` hint.
    Backoff,
}

#[derive(Debug, Clone, Copy)]
pub struct Retry {
    pub mode: RetryMode,
    pub base: Duration,
    pub cap: Duration,
}

impl Retry {
    /// Pause before retry number `attempt` (0-based) after failure `f`.
    ///
    /// Backoff: the proxy's hint when it gave one (it already carries full jitter, computed
    /// from how many refusals that caller got recently), capped at `cap`; otherwise
    /// `random(0, min(cap, base · 2^attempt))`.
    pub fn delay(&self, attempt: u32, f: &Failure) -> Duration {
        match self.mode {
            RetryMode::Naive => Duration::ZERO,
            RetryMode::Backoff => {
                if let Some(ms) = f.retry_after_ms() {
                    return Duration::from_millis(ms).min(self.cap);
                }
                let window = self
                    .base
                    .saturating_mul(1u32 << attempt.min(20))
                    .min(self.cap);
                let micros = window.as_micros() as u64;
                if micros == 0 {
                    return Duration::ZERO;
                }
                Duration::from_micros(rand::random_range(0..=micros))
            }
        }
    }

    /// Sleeps the delay (or yields, for naive clients).
    pub async fn pause(&self, attempt: u32, f: &Failure) {
        sleep_or_yield(self.delay(attempt, f)).await;
    }
}

/// A zero pause still yields, so a naive retry loop cannot starve the runtime.
pub async fn sleep_or_yield(d: Duration) {
    if d.is_zero() {
        tokio::task::yield_now().await;
    } else {
        tokio::time::sleep(d).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_codes_and_hints() {
        assert_eq!(
            err_code("pgsluice: ERR_QUEUE_TIMEOUT: caller x waited"),
            Some("ERR_QUEUE_TIMEOUT")
        );
        assert_eq!(err_code("sorry, too many clients already"), None);
        assert_eq!(hint_ms("retry_after_ms=137"), Some(137));
        assert_eq!(hint_ms("nothing"), None);
        assert_eq!(fold("waited 123 ms for 4"), "waited N ms for N");
    }

    #[test]
    fn backoff_is_bounded() {
        let r = Retry {
            mode: RetryMode::Backoff,
            base: Duration::from_millis(10),
            cap: Duration::from_millis(500),
        };
        let f = Failure::Error {
            reason: "x".into(),
            retry_after_ms: None,
            fatal: true,
        };
        for attempt in 0..40 {
            assert!(r.delay(attempt, &f) <= Duration::from_millis(500));
        }
        let hinted = Failure::Refused {
            reason: "x".into(),
            retry_after_ms: Some(42),
            fatal: false,
        };
        assert_eq!(r.delay(3, &hinted), Duration::from_millis(42));
    }
}
