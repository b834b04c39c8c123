//! Refusals: the one place that turns a policy "no" into SQLSTATE, client-visible text and a
//! retry hint (DESIGN §5 error table).
//!
//! Owns the refusal kinds, their codes and message wording, the warn-mode notice wording, and
//! the full-jitter retry hint. It does not send anything: the protocol layer turns a
//! [`Refusal`] into an ErrorResponse (message, DETAIL = `detail`, HINT = [`Refusal::hint`]).
//!
//! Retry hint: `retry_after_ms = max(floor, retry_floor) + random(0, min(cap, base · 2^k))`
//! where `floor` is the time the limit itself says nothing can change (a bucket's time to the
//! next token, the rest of a breaker's open period), `retry_floor`/`base`/`cap` are the
//! caller's [`RetryPolicy`] (defaults [`BACKOFF_BASE`], [`BACKOFF_CAP`], no floor) and `k` is
//! the number of refusals the same caller got in the preceding burst (reset after
//! [`BACKOFF_WINDOW`] without refusals). A flooding caller's clients therefore spread their
//! retries over a growing window instead of returning as a herd, while an occasional refusal
//! suggests a retry within `base`. A blocked pattern (`ERR_QUERY_BLOCKED`) is not retryable:
//! it carries no hint, and its DETAIL says so.

use std::time::Duration;

use parking_lot::Mutex;
use serde::Serialize;
use tokio::time::Instant;

/// Jitter window for a caller's first refusal in a burst.
pub const BACKOFF_BASE: Duration = Duration::from_millis(50);
/// Largest jitter window, however long the burst of refusals.
pub const BACKOFF_CAP: Duration = Duration::from_secs(5);
/// A caller with no refusal for this long starts again at `BACKOFF_BASE`.
pub const BACKOFF_WINDOW: Duration = Duration::from_secs(1);

/// How a caller's clients are told to come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RetryPolicy {
    /// Jitter window of a burst's first refusal.
    #[serde(rename = "retry_base_ms", serialize_with = "super::ser_ms")]
    pub base: Duration,
    /// Largest jitter window.
    #[serde(rename = "retry_cap_ms", serialize_with = "super::ser_ms")]
    pub cap: Duration,
    /// Least wait suggested, before the jitter (e.g. 5–15 s for a saturated database).
    #[serde(rename = "retry_floor_ms", serialize_with = "super::ser_ms")]
    pub floor: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            base: BACKOFF_BASE,
            cap: BACKOFF_CAP,
            floor: Duration::ZERO,
        }
    }
}

impl RetryPolicy {
    /// The hint for the `k`-th refusal of a burst, over a limit that says `floor`. With an
    /// `expected` wait until there is room (the drain rate of the queue that refused), the
    /// retries are spread over `[W/2, 3W/2]` around it (`W` at least `base`) instead of the
    /// streak's window, so clients that honour it come back when there is room.
    pub fn hint_ms(&self, floor: Duration, k: u32, expected: Option<Duration>) -> u64 {
        let least = floor_ms(floor.max(self.floor));
        match expected {
            Some(w) => {
                let w = floor_ms(w.max(self.base));
                least
                    .saturating_add(w / 2)
                    .saturating_add(rand::random_range(0..=w))
            }
            None => least.saturating_add(jitter_ms(self.base, self.cap, k)),
        }
    }
}

/// Why a statement was refused. `reason()` is the bounded metrics label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum RefusalKind {
    /// Caller at `max_concurrency` and its queue full.
    #[serde(rename = "caller_limit")]
    CallerLimitExceeded,
    /// Waited longer than the caller's `queue_timeout_ms`.
    #[serde(rename = "queue_timeout")]
    QueueTimeout,
    /// Caller `max_qps` or rule THROTTLE.
    #[serde(rename = "rate_limited")]
    RateLimited,
    /// Rule REJECT.
    #[serde(rename = "query_blocked")]
    QueryBlocked,
    /// Breaker open (or half-open with its trial slots busy), non-critical traffic.
    #[serde(rename = "circuit_open")]
    CircuitOpen,
    /// Rule CONCURRENCY at its `max_inflight`. Not in the DESIGN table; it shares 53300 with
    /// the other concurrency refusal and has its own code so operators can tell them apart.
    #[serde(rename = "query_concurrency")]
    QueryConcurrency,
}

impl RefusalKind {
    pub const ALL: [RefusalKind; 6] = [
        Self::CallerLimitExceeded,
        Self::QueueTimeout,
        Self::RateLimited,
        Self::QueryBlocked,
        Self::CircuitOpen,
        Self::QueryConcurrency,
    ];

    /// Metrics label.
    pub fn reason(self) -> &'static str {
        match self {
            Self::CallerLimitExceeded => "caller_limit",
            Self::QueueTimeout => "queue_timeout",
            Self::RateLimited => "rate_limited",
            Self::QueryBlocked => "query_blocked",
            Self::CircuitOpen => "circuit_open",
            Self::QueryConcurrency => "query_concurrency",
        }
    }

    /// SQLSTATE: 53300 too_many_connections, 53400 configuration_limit_exceeded,
    /// 53000 insufficient_resources.
    pub fn sqlstate(self) -> &'static str {
        match self {
            Self::CallerLimitExceeded | Self::QueueTimeout | Self::QueryConcurrency => "53300",
            Self::RateLimited | Self::QueryBlocked => "53400",
            Self::CircuitOpen => "53000",
        }
    }

    /// The `ERR_…` code that leads the message.
    pub fn code(self) -> &'static str {
        match self {
            Self::CallerLimitExceeded => "ERR_CALLER_LIMIT_EXCEEDED",
            Self::QueueTimeout => "ERR_QUEUE_TIMEOUT",
            Self::RateLimited => "ERR_RATE_LIMITED",
            Self::QueryBlocked => "ERR_QUERY_BLOCKED",
            Self::CircuitOpen => "ERR_CIRCUIT_OPEN",
            Self::QueryConcurrency => "ERR_QUERY_CONCURRENCY",
        }
    }

    pub(super) fn index(self) -> usize {
        self as usize
    }

    /// Whether the same statement can succeed later: all but a blocked pattern.
    pub fn retryable(self) -> bool {
        self != Self::QueryBlocked
    }
}

/// A refused statement, ready for the protocol layer to send as an ErrorResponse.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub kind: RefusalKind,
    pub sqlstate: &'static str,
    /// `pgsluice: ERR_…: <what happened, which caller/fingerprint/limit>`.
    pub message: String,
    /// Names the limit (sent as DETAIL).
    pub detail: String,
    /// Suggested back-off with full jitter (sent as HINT `retry_after_ms=N`).
    pub retry_after_ms: u64,
    /// Caller id the statement was classified as.
    pub caller: u16,
    pub fingerprint: u64,
    /// The runtime rule's action when a fingerprint rule refused (metrics label).
    pub rule_action: Option<&'static str>,
}

impl Refusal {
    /// HINT text; `None` for a refusal that retrying cannot change (a blocked pattern).
    pub fn hint(&self) -> Option<String> {
        self.kind
            .retryable()
            .then(|| format!("retry_after_ms={}", self.retry_after_ms))
    }
}

/// A refusal before it gets its retry hint and counters: what happened and the limit's floor.
#[derive(Debug, Clone)]
pub(super) struct Reason {
    pub kind: RefusalKind,
    pub what: String,
    pub detail: String,
    pub floor: Duration,
}

impl Reason {
    pub fn new(kind: RefusalKind, what: String, detail: String, floor: Duration) -> Self {
        Self {
            kind,
            what,
            detail,
            floor,
        }
    }

    pub fn into_refusal(self, retry_after_ms: u64, caller: u16, fingerprint: u64) -> Refusal {
        Refusal {
            kind: self.kind,
            sqlstate: self.kind.sqlstate(),
            message: format!("pgsluice: {}: {}", self.kind.code(), self.what),
            detail: self.detail,
            retry_after_ms,
            caller,
            fingerprint,
            rule_action: None,
        }
    }

    /// NOTICE text for a warn-mode rule that would have refused.
    pub fn warning(&self) -> String {
        format!(
            "pgsluice: rule in warn mode would refuse this statement with {}: {} ({})",
            self.kind.code(),
            self.what,
            self.detail
        )
    }
}

/// Per-caller refusal streak, for the exponent of the jitter window.
#[derive(Debug)]
pub(super) struct Backoff {
    state: Mutex<Option<(Instant, u32)>>,
}

impl Backoff {
    pub fn new() -> Self {
        Self {
            state: Mutex::new(None),
        }
    }

    /// Record a refusal at `now` and return its retry hint in ms (`expected`: the refusing
    /// queue's expected wait, when known).
    pub fn retry_after_ms(
        &self,
        retry: &RetryPolicy,
        floor: Duration,
        expected: Option<Duration>,
        now: Instant,
    ) -> u64 {
        let k = {
            let mut st = self.state.lock();
            let streak = match *st {
                Some((last, n)) if now.saturating_duration_since(last) < BACKOFF_WINDOW => {
                    n.saturating_add(1)
                }
                _ => 0,
            };
            *st = Some((now, streak));
            streak
        };
        retry.hint_ms(floor, k, expected)
    }
}

/// `random(0, min(cap, base · 2^k))` in ms: the one full-jitter function (retry hints here,
/// the pool's and the fleet's reconnect backoff).
pub fn full_jitter_ms(base_ms: u64, cap_ms: u64, k: u32) -> u64 {
    let window = base_ms.saturating_mul(1u64 << k.min(32)).min(cap_ms);
    rand::random_range(0..=window)
}

fn jitter_ms(base: Duration, cap: Duration, k: u32) -> u64 {
    full_jitter_ms(floor_ms(base), floor_ms(cap), k)
}

/// Duration → ms, rounded up so a floor of 0.3 ms is not hinted as "retry now".
fn floor_ms(d: Duration) -> u64 {
    let ms = d.as_micros().div_ceil(1000);
    u64::try_from(ms).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use std::ops::Not;

    use super::*;

    #[test]
    fn codes_and_states_match_the_design_table() {
        let table = [
            (
                RefusalKind::CallerLimitExceeded,
                "53300",
                "ERR_CALLER_LIMIT_EXCEEDED",
                "caller_limit",
            ),
            (
                RefusalKind::QueueTimeout,
                "53300",
                "ERR_QUEUE_TIMEOUT",
                "queue_timeout",
            ),
            (
                RefusalKind::RateLimited,
                "53400",
                "ERR_RATE_LIMITED",
                "rate_limited",
            ),
            (
                RefusalKind::QueryBlocked,
                "53400",
                "ERR_QUERY_BLOCKED",
                "query_blocked",
            ),
            (
                RefusalKind::CircuitOpen,
                "53000",
                "ERR_CIRCUIT_OPEN",
                "circuit_open",
            ),
            (
                RefusalKind::QueryConcurrency,
                "53300",
                "ERR_QUERY_CONCURRENCY",
                "query_concurrency",
            ),
        ];
        for (kind, state, code, reason) in table {
            assert_eq!(
                (kind.sqlstate(), kind.code(), kind.reason()),
                (state, code, reason)
            );
            assert_eq!(serde_json::to_value(kind).ok(), Some(reason.into()));
        }
        for (i, kind) in RefusalKind::ALL.iter().enumerate() {
            assert_eq!(kind.index(), i);
        }
    }

    #[test]
    fn jitter_window_grows_and_caps() {
        let j = |k| jitter_ms(BACKOFF_BASE, BACKOFF_CAP, k);
        for _ in 0..200 {
            assert!(j(0) <= 50);
            assert!(j(3) <= 400);
            assert!(j(7) <= 5000);
            assert!(j(u32::MAX) <= 5000);
        }
        // Over many draws the cap is actually reached for, not stuck at the base.
        assert!((0..200).map(|_| j(10)).max().unwrap_or(0) > 1000);
    }

    /// A caller's own base, cap and floor shape its hints; a blocked pattern has none.
    #[test]
    fn retry_policy_sets_base_cap_and_floor() {
        let saturated = RetryPolicy {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(10),
            floor: Duration::from_secs(5),
        };
        let hints: Vec<u64> = (0..300)
            .map(|_| saturated.hint_ms(Duration::ZERO, 0, None))
            .collect();
        assert!(hints.iter().all(|h| (5000..=6000).contains(h)), "{hints:?}");
        assert!(
            hints.iter().any(|h| *h > 5500),
            "jitter spreads over the base"
        );
        // A limit's own floor above the caller's wins; the cap bounds the jitter.
        let h = saturated.hint_ms(Duration::from_secs(8), 30, None);
        assert!((8000..=18_000).contains(&h), "{h}");
        // A known wait of 2 s: retries spread over 1–3 s (plus the floor), whatever the
        // streak; a tiny one still gets the base as its window.
        let plain = RetryPolicy::default();
        let spread: Vec<u64> = (0..300)
            .map(|_| plain.hint_ms(Duration::ZERO, 9, Some(Duration::from_secs(2))))
            .collect();
        assert!(
            spread.iter().all(|h| (1000..=3000).contains(h)),
            "{spread:?}"
        );
        assert!(spread.iter().any(|h| *h < 1500) && spread.iter().any(|h| *h > 2500));
        let tiny = plain.hint_ms(Duration::ZERO, 0, Some(Duration::from_millis(1)));
        assert!((25..=75).contains(&tiny), "{tiny}");
        assert!(RefusalKind::QueryBlocked.retryable().not());
        assert!(RefusalKind::ALL.iter().filter(|k| !k.retryable()).count() == 1);
    }

    #[tokio::test(start_paused = true)]
    async fn streak_resets_after_a_quiet_window() {
        let b = Backoff::new();
        let floor = Duration::from_micros(300);
        for _ in 0..20 {
            b.retry_after_ms(&RetryPolicy::default(), floor, None, Instant::now());
        }
        let hot = (0..50)
            .map(|_| b.retry_after_ms(&RetryPolicy::default(), floor, None, Instant::now()))
            .max()
            .unwrap_or(0);
        assert!(hot > 100, "a long streak widens the window: {hot}");
        tokio::time::advance(BACKOFF_WINDOW).await;
        let cool = b.retry_after_ms(&RetryPolicy::default(), floor, None, Instant::now());
        assert!(
            (1..=51).contains(&cool),
            "floor rounds up to 1 ms, window back to base: {cool}"
        );
    }
}
