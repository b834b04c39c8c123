//! How fast a queue drains, and so how long a newcomer would wait: the estimate behind a
//! refusal's retry hint (DESIGN §5: the jitter window should be the *expected time until
//! there is room*, not a fixed base, or honouring clients come back as retries that cost a
//! new login while the queue still needs seconds).
//!
//! Owns [`DrainRate`]: fed a monotonic count of completions (slots given back, checkouts
//! served, logins finished) that its owner already keeps, it samples that count only when
//! asked — at a refusal — so the hot path pays nothing. The rate is the completions since the
//! previous sample over the time between: a rise (of a few completions at least) is taken at
//! once, anything else smoothed over about a second. Pure: time comes in.

use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

/// Samples closer than this reuse the last rate (a burst of refusals samples once).
const MIN_SPAN: Duration = Duration::from_millis(200);
/// Time constant of the smoothing.
const SMOOTHING: Duration = Duration::from_secs(1);
/// Completions a reading needs for a rise to be believed at once.
const MIN_RISE: u64 = 4;
/// Longest wait ever estimated (a stalled queue is "come back much later", not infinity).
pub const MAX_WAIT: Duration = Duration::from_secs(60);

/// A completion-rate estimate; cheap to share behind a reference.
#[derive(Debug, Default)]
pub struct DrainRate {
    sample: Mutex<Option<Sample>>,
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    count: u64,
    /// Completions per second; `None` until two samples exist.
    rate: Option<f64>,
}

impl DrainRate {
    pub fn new() -> Self {
        Self::default()
    }

    /// Completions per second given the count now; `None` before the second sample.
    pub fn rate(&self, count: u64, now: Instant) -> Option<f64> {
        let mut s = self.sample.lock();
        let Some(prev) = *s else {
            *s = Some(Sample {
                at: now,
                count,
                rate: None,
            });
            return None;
        };
        let span = now.saturating_duration_since(prev.at);
        if span < MIN_SPAN {
            return prev.rate;
        }
        let done = count.saturating_sub(prev.count);
        let seen = done as f64 / span.as_secs_f64();
        let rate = match prev.rate {
            // A queue that starts to move is believed at once (the backends a long query
            // held come free together, and a login held at the door for that estimate
            // should not wait a smoothing window longer) — when the reading counts enough
            // completions to be one: one or two of them in a short span say little. Other
            // changes are weighted by how much of the smoothing window the reading covers.
            Some(r) if seen > r && done >= MIN_RISE => seen,
            Some(r) => {
                let w = (span.as_secs_f64() / SMOOTHING.as_secs_f64()).min(1.0);
                r + w * (seen - r)
            }
            None => seen,
        };
        *s = Some(Sample {
            at: now,
            count,
            rate: Some(rate),
        });
        Some(rate)
    }

    /// The expected wait of one more arrival with `ahead` already waiting: `(ahead + 1) /
    /// rate`, capped at [`MAX_WAIT`]. `None` while the rate is unknown; [`MAX_WAIT`] when
    /// nothing completes.
    pub fn expected_wait(&self, count: u64, ahead: u64, now: Instant) -> Option<Duration> {
        let rate = self.rate(count, now)?;
        if rate <= 0.0 {
            return Some(MAX_WAIT);
        }
        let secs = (ahead as f64 + 1.0) / rate;
        Some(Duration::from_secs_f64(secs.min(MAX_WAIT.as_secs_f64())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 100 completions a second with 49 waiting: the 50th waits half a second; the
    /// estimate follows a slowdown within about a second, caps a stall and reuses the last
    /// rate for samples too close together.
    #[tokio::test(start_paused = true)]
    async fn expected_wait_follows_the_drain_rate() {
        let d = DrainRate::new();
        let t0 = Instant::now();
        assert_eq!(d.expected_wait(0, 49, t0), None, "one sample is no rate");
        tokio::time::advance(Duration::from_secs(1)).await;
        let w = d.expected_wait(100, 49, Instant::now()).expect("a rate");
        assert_eq!(w, Duration::from_millis(500));
        // Ten times slower for two seconds: the estimate moves all the way.
        tokio::time::advance(Duration::from_secs(2)).await;
        let w = d.expected_wait(120, 49, Instant::now()).expect("a rate");
        assert_eq!(w, Duration::from_secs(5));
        // Within MIN_SPAN: the last rate, whatever the count says.
        tokio::time::advance(Duration::from_millis(50)).await;
        let w = d.expected_wait(10_000, 9, Instant::now()).expect("a rate");
        assert_eq!(w, Duration::from_secs(1));
        // Nothing completes: capped, not infinite.
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(d.expected_wait(120, 9, Instant::now()), Some(MAX_WAIT));
    }

    /// A stalled queue that starts to move (long queries ending together) is believed from
    /// the first reading; a slowdown after it is smoothed, not believed at once.
    #[tokio::test(start_paused = true)]
    async fn a_rise_is_taken_at_once_and_a_fall_is_smoothed() {
        let d = DrainRate::new();
        d.rate(0, Instant::now());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(d.rate(0, Instant::now()), Some(0.0), "stalled");
        tokio::time::advance(Duration::from_millis(200)).await;
        assert_eq!(
            d.rate(200, Instant::now()),
            Some(1000.0),
            "moving: believed at once"
        );
        tokio::time::advance(Duration::from_millis(200)).await;
        let r = d.rate(200, Instant::now()).expect("a rate");
        assert!(
            (799.0..=801.0).contains(&r),
            "a fall is a fifth of the way per 200 ms: {r}"
        );
    }

    /// One or two completions in a short span are no evidence of a faster queue: a queue
    /// served every 0.4 s that sees one completion in 200 ms is not taken as 5 a second.
    #[tokio::test(start_paused = true)]
    async fn a_rise_of_a_few_completions_is_smoothed() {
        let d = DrainRate::new();
        d.rate(0, Instant::now());
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(d.rate(5, Instant::now()), Some(2.5));
        tokio::time::advance(Duration::from_millis(200)).await;
        let r = d.rate(6, Instant::now()).expect("a rate");
        assert!(
            (2.99..=3.01).contains(&r),
            "a fifth of the way from 2.5 to 5: {r}"
        );
    }
}
