//! Token bucket used for caller `max_qps` and fingerprint THROTTLE rules.
//!
//! Owns only the arithmetic of "may one more statement start now, and if not, when". It knows
//! nothing of callers, rules or refusals; the caller turns a `Err(wait)` into a refusal or a
//! sleep.
//!
//! Implemented as GCRA (generic cell rate algorithm): instead of a token count plus a refill
//! timestamp, the whole state is one "theoretical arrival time" (TAT) in nanoseconds since the
//! bucket was built, kept in an `AtomicU64` and advanced with a compare-and-swap. That is exactly
//! equivalent to a bucket of `burst` tokens refilled at `rate` per second, but lock-free, so a
//! hot fingerprint rule shared by every session never serialises them on a mutex.
//!
//! Time is `tokio::time::Instant`, so paused-time tests drive refills deterministically.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// Rates above this are treated as this; one token per microsecond is far beyond what a single
/// proxy can forward, and the bound keeps the nanosecond arithmetic away from zero intervals.
pub const MAX_RATE: f64 = 1_000_000.0;

/// The lowest rate a limit may be configured with: one statement per 1 000 s. Slower rates
/// are refused at validation (at ~5e-11/s the emission interval no longer fits the bucket's
/// nanosecond clock, and such a "limit" would never refuse); to stop a pattern, REJECT it.
pub const MIN_RATE: f64 = 0.001;

/// A GCRA token bucket: `burst` statements may start back to back, then one per `1/rate` s.
#[derive(Debug)]
pub struct TokenBucket {
    /// Origin of the nanosecond clock stored in `tat`; `Instant` itself is not atomic.
    base: Instant,
    /// Nanoseconds between tokens (the emission interval, `1e9 / rate`).
    interval_ns: u64,
    /// How far the TAT may run ahead of "now": `burst · interval`. Saturates instead of
    /// overflowing for absurd (validated-away) inputs.
    tolerance_ns: u64,
    /// Theoretical arrival time of the next conforming request, ns since `base`.
    tat: AtomicU64,
    /// Kept for snapshots; the algorithm only uses the derived intervals above.
    rate: f64,
    burst: u32,
}

impl TokenBucket {
    /// A full bucket at `now`. `rate` is tokens per second (clamped into `(0, MAX_RATE]`; NaN
    /// is treated as `MAX_RATE` — callers validate first, this is only a guard against
    /// dividing by zero), `burst` is the capacity (at least 1).
    pub fn new(rate: f64, burst: u32, now: Instant) -> Self {
        let rate = if rate.is_finite() && rate > 0.0 {
            rate.min(MAX_RATE)
        } else {
            MAX_RATE
        };
        let burst = burst.max(1);
        // `as` saturates for floats, and rate ≥ tiny keeps this finite; 1 ns minimum so that a
        // zero interval never makes the bucket unlimited.
        let interval_ns = ((1e9 / rate).round() as u64).max(1);
        let tolerance_ns = interval_ns.saturating_mul(u64::from(burst));
        Self {
            base: now,
            interval_ns,
            tolerance_ns,
            tat: AtomicU64::new(0),
            rate,
            burst,
        }
    }

    /// The default burst for a rate: one second's worth of tokens, at least one.
    pub fn default_burst(rate: f64) -> u32 {
        if rate.is_finite() && rate >= 1.0 {
            rate.min(MAX_RATE).ceil() as u32
        } else {
            1
        }
    }

    /// Tokens per second.
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// Bucket capacity.
    pub fn burst(&self) -> u32 {
        self.burst
    }

    /// Take one token now, or say how long until one is available. Never blocks.
    pub fn try_take(&self, now: Instant) -> Result<(), Duration> {
        self.reserve(now, Duration::ZERO).map(|_| ())
    }

    /// Take one token that becomes valid within `max_wait`: `Ok(wait)` means the token is
    /// yours once `wait` has passed (the caller sleeps that long, then proceeds); `Err(wait)`
    /// means even that would take too long and nothing was taken.
    ///
    /// Reserving ahead (instead of sleeping and retrying) serves queued statements in arrival
    /// order and needs no wake-up machinery. A reservation abandoned by a client that went
    /// away is not refunded: the bucket runs slightly under its rate for one interval, which
    /// errs on the safe side for a limit that protects the database.
    pub fn reserve(&self, now: Instant, max_wait: Duration) -> Result<Duration, Duration> {
        let now_ns = nanos(now.saturating_duration_since(self.base));
        let max_wait_ns = nanos(max_wait);
        let mut tat = self.tat.load(Ordering::Acquire);
        loop {
            let new_tat = tat.max(now_ns).saturating_add(self.interval_ns);
            let wait_ns = new_tat
                .saturating_sub(now_ns)
                .saturating_sub(self.tolerance_ns);
            if wait_ns > max_wait_ns {
                return Err(Duration::from_nanos(wait_ns));
            }
            match self
                .tat
                .compare_exchange_weak(tat, new_tat, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(Duration::from_nanos(wait_ns)),
                Err(actual) => tat = actual,
            }
        }
    }

    /// Whole tokens available at `now` (for snapshots; racy by nature).
    pub fn available(&self, now: Instant) -> u32 {
        let now_ns = nanos(now.saturating_duration_since(self.base));
        let tat = self.tat.load(Ordering::Acquire).max(now_ns);
        let used_ns = tat - now_ns;
        let free_ns = self.tolerance_ns.saturating_sub(used_ns);
        u32::try_from(free_ns / self.interval_ns).unwrap_or(u32::MAX)
    }
}

/// Duration → u64 nanoseconds, saturating (584 years fit, so saturation never matters).
pub(super) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn burst_then_refill_at_rate() {
        let now = Instant::now();
        let b = TokenBucket::new(10.0, 3, now);
        assert_eq!(b.available(now), 3);
        for _ in 0..3 {
            assert_eq!(b.try_take(now), Ok(()));
        }
        // Empty: the next token is one interval (100 ms) away.
        assert_eq!(b.try_take(now), Err(Duration::from_millis(100)));
        tokio::time::advance(Duration::from_millis(99)).await;
        assert_eq!(b.try_take(Instant::now()), Err(Duration::from_millis(1)));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(b.try_take(Instant::now()), Ok(()));
        assert!(b.try_take(Instant::now()).is_err());
        // A long idle period refills only up to the burst.
        tokio::time::advance(Duration::from_secs(60)).await;
        let now = Instant::now();
        assert_eq!(b.available(now), 3);
        for _ in 0..3 {
            assert_eq!(b.try_take(now), Ok(()));
        }
        assert!(b.try_take(now).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn rate_over_a_window_is_rate_plus_burst() {
        let start = Instant::now();
        let b = TokenBucket::new(2.0, 2, start);
        let mut ok = 0;
        // Try every 10 ms from 0 to 5 s inclusive: 2 (burst) + 5 s · 2/s = 12.
        for _ in 0..=500 {
            if b.try_take(Instant::now()).is_ok() {
                ok += 1;
            }
            tokio::time::advance(Duration::from_millis(10)).await;
        }
        assert_eq!(ok, 12);
    }

    #[tokio::test(start_paused = true)]
    async fn reserve_queues_in_order_and_respects_max_wait() {
        let now = Instant::now();
        let b = TokenBucket::new(4.0, 1, now);
        assert_eq!(b.reserve(now, Duration::from_secs(1)), Ok(Duration::ZERO));
        assert_eq!(
            b.reserve(now, Duration::from_secs(1)),
            Ok(Duration::from_millis(250))
        );
        assert_eq!(
            b.reserve(now, Duration::from_secs(1)),
            Ok(Duration::from_millis(500))
        );
        // Too far ahead: refused, and nothing is consumed.
        assert_eq!(
            b.reserve(now, Duration::from_millis(600)),
            Err(Duration::from_millis(750))
        );
        assert_eq!(
            b.reserve(now, Duration::from_millis(750)),
            Ok(Duration::from_millis(750))
        );
    }

    #[test]
    fn hostile_parameters_do_not_panic() {
        let now = Instant::now();
        for rate in [f64::NAN, f64::INFINITY, -1.0, 0.0, 1e-300, 1e300] {
            let b = TokenBucket::new(rate, u32::MAX, now);
            let _ = b.try_take(now);
            let _ = b.available(now);
        }
        assert_eq!(TokenBucket::default_burst(0.5), 1);
        assert_eq!(TokenBucket::default_burst(2.5), 3);
        assert_eq!(TokenBucket::default_burst(f64::NAN), 1);
    }
}
