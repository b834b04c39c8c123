//! Deciding at arrival (DESIGN §5): a newcomer that finds no room either waits in its queue,
//! when its expected wait fits the time it may wait, or is refused at once with a hint equal
//! to that wait — never refused after it has waited, unless the estimate was wrong. A refusal
//! after a wait throws away the wait *and* the place in line, and the retry costs a new login.
//!
//! Owns [`Arrival`], one per queue (a pool's priority, a caller's FIFO), kept under its
//! owner's lock and fed by it: a monotonic count of the waiters the queue has served (grants,
//! not arrivals) and the waiters ahead of the newcomer. From those it keeps:
//!
//! * the queue's **service rate**, measured only while it is busy: two readings count only
//!   when waiters were ahead at both (a rate read across an idle spell measures arrivals, not
//!   room, and would refuse the first wave of a storm); a rate not refreshed for
//!   [`RATE_TTL`] is forgotten. Until a rate is known, everyone queues.
//! * the **places promised** to clients refused earlier: the next refused client's place is
//!   behind the queue *and* behind them, one service interval later, so the refused come back
//!   spread at the rate the queue drains instead of as a herd that overflows it again.
//! * **hint checks**: a refused client's place is a number of services from now; when the
//!   count reaches it, the time that took is the wait it would have had, compared with the
//!   hint it got ([`ArrivalStats`]). The crossing time is interpolated between two readings,
//!   so a check resolved late (at the next reading) is still accurate.
//!
//! Pure: time and counts come in; nothing here locks, sleeps or reads a clock.

use std::collections::VecDeque;
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

/// Readings closer than this reuse the last rate (a burst of arrivals reads it once).
const MIN_SPAN: Duration = Duration::from_millis(200);
/// Time constant of the rate's smoothing.
const SMOOTHING: Duration = Duration::from_secs(1);
/// A rate not refreshed for this long no longer describes the queue.
pub const RATE_TTL: Duration = Duration::from_secs(5);
/// Longest wait or place ever estimated.
pub const MAX_WAIT: Duration = Duration::from_secs(60);
/// Hint checks kept at once; beyond, refusals go unchecked (the sample stays unbiased).
const MAX_CHECKS: usize = 512;

/// What a newcomer that finds no room does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Wait: its expected wait fits (or is not known yet).
    Queue,
    /// Refuse now; `place` is when its turn would come, the retry hint.
    Refuse { place: Duration },
}

/// What a queue's arrival decisions did, for the admin API and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ArrivalStats {
    /// Refused at once because the expected wait did not fit.
    pub refused_on_arrival: u64,
    /// Queued and refused when the wait ran out: each a wasted wait (the estimate was wrong,
    /// or there was none yet).
    pub refused_after_wait: u64,
    /// Refusals whose hint was checked against the wait the client would have had.
    pub hint_checks: u64,
    /// Sum of the checked hints, and of |would-have-waited − hint| (ms).
    pub hint_ms: u64,
    pub hint_error_ms: u64,
    /// Checked hints shorter than the wait (the client came back before its turn).
    pub hints_short: u64,
}

impl ArrivalStats {
    pub fn add(&mut self, o: &ArrivalStats) {
        self.refused_on_arrival += o.refused_on_arrival;
        self.refused_after_wait += o.refused_after_wait;
        self.hint_checks += o.hint_checks;
        self.hint_ms += o.hint_ms;
        self.hint_error_ms += o.hint_error_ms;
        self.hints_short += o.hints_short;
    }
}

/// One queue's arrival estimate. See the module doc.
#[derive(Debug, Default)]
pub struct Arrival {
    /// The start of the current busy reading: (when, served).
    sample: Option<(Instant, u64)>,
    /// Services per second, and when it was last refreshed.
    rate: Option<(f64, Instant)>,
    /// When the last place promised to a refused client falls due.
    promised: Option<Instant>,
    /// The last (when, served) seen, for interpolating the checks.
    seen: Option<(Instant, u64)>,
    checks: VecDeque<Check>,
    stats: ArrivalStats,
}

#[derive(Debug, Clone, Copy)]
struct Check {
    /// The served count at which the refused client's turn would have come.
    target: u64,
    issued: Instant,
    hint: Duration,
}

impl Arrival {
    /// A newcomer with `ahead` waiters in front of it (0: the queue is empty but nothing is
    /// free) may wait `room`: queue it, or refuse it with its place.
    pub fn decide(&mut self, served: u64, ahead: u64, room: Duration, now: Instant) -> Decision {
        let Some(rate) = self.read(served, ahead, now) else {
            return Decision::Queue;
        };
        let wait = secs((ahead + 1) as f64 / rate);
        if wait <= room {
            return Decision::Queue;
        }
        self.stats.refused_on_arrival += 1;
        Decision::Refuse {
            place: self.promise(served, wait, rate, now),
        }
    }

    /// A client refused anyway (the queue is full, or its wait ran out) with `ahead` in front
    /// of it: its place, promised and checked as [`Arrival::decide`]'s are; `None` while the
    /// rate is unknown.
    pub fn place(&mut self, served: u64, ahead: u64, now: Instant) -> Option<Duration> {
        let rate = self.read(served, ahead, now)?;
        let wait = secs((ahead + 1) as f64 / rate);
        Some(self.promise(served, wait, rate, now))
    }

    /// A queued client's wait ran out with `ahead` still in front of it: counted as a wasted
    /// wait; its place is the retry hint, as [`Arrival::place`].
    pub fn waited_out(&mut self, served: u64, ahead: u64, now: Instant) -> Option<Duration> {
        self.stats.refused_after_wait += 1;
        self.place(served, ahead, now)
    }

    /// The owner's periodic look (about once a second): resolves the checks whose turn has
    /// come, so they do not wait for the next arrival.
    pub fn tick(&mut self, served: u64, now: Instant) {
        self.observe(served, now);
    }

    pub fn stats(&self) -> ArrivalStats {
        self.stats
    }

    /// The service rate now, if known: reads the count (while busy) and resolves checks.
    fn read(&mut self, served: u64, ahead: u64, now: Instant) -> Option<f64> {
        self.observe(served, now);
        match self.sample {
            // An empty queue ends the busy reading: the next one starts here.
            _ if ahead == 0 => self.sample = Some((now, served)),
            None => self.sample = Some((now, served)),
            // Too long since: the queue may have been idle meanwhile; start again.
            Some((at, _)) if now.saturating_duration_since(at) > RATE_TTL => {
                self.sample = Some((now, served))
            }
            Some((at, count)) => {
                let span = now.saturating_duration_since(at);
                if span >= MIN_SPAN {
                    let seen = served.saturating_sub(count) as f64 / span.as_secs_f64();
                    let rate = match self.rate {
                        Some((r, _)) => {
                            let w = (span.as_secs_f64() / SMOOTHING.as_secs_f64()).min(1.0);
                            r + w * (seen - r)
                        }
                        None => seen,
                    };
                    self.rate = Some((rate, now));
                    self.sample = Some((now, served));
                }
            }
        }
        match self.rate {
            Some((r, at)) if now.saturating_duration_since(at) <= RATE_TTL => {
                // A queue that served nothing at all is "much later", not "never".
                Some(r.max(1.0 / MAX_WAIT.as_secs_f64()))
            }
            _ => None,
        }
    }

    /// The place of a refused client whose own wait would be `wait`: behind the queue and
    /// behind every place promised before, one service later.
    fn promise(&mut self, served: u64, wait: Duration, rate: f64, now: Instant) -> Duration {
        let step = secs(1.0 / rate);
        let behind = self.promised.filter(|p| *p > now).map(|p| p + step);
        let at = behind.map_or(now + wait, |b| b.max(now + wait));
        let place = at.saturating_duration_since(now).min(MAX_WAIT);
        self.promised = Some(now + place);
        if self.checks.len() < MAX_CHECKS {
            self.checks.push_back(Check {
                target: served + (place.as_secs_f64() * rate).round() as u64,
                issued: now,
                hint: place,
            });
        }
        place
    }

    /// Resolves the checks whose target count has been reached by `served` at `now`.
    fn observe(&mut self, served: u64, now: Instant) {
        let (t0, c0) = self.seen.unwrap_or((now, served));
        self.seen = Some((now, served));
        while let Some(c) = self.checks.front().copied() {
            if c.target > served {
                // Nothing moves for a long time: the place is past any estimate; drop it.
                if now.saturating_duration_since(c.issued) > 2 * MAX_WAIT {
                    self.checks.pop_front();
                    continue;
                }
                break;
            }
            self.checks.pop_front();
            // When the count crossed the target, between the last reading and this one.
            let crossed = if c.target <= c0 || served == c0 {
                t0
            } else {
                let f = (c.target - c0) as f64 / (served - c0) as f64;
                t0 + now.saturating_duration_since(t0).mul_f64(f)
            };
            let waited = crossed.saturating_duration_since(c.issued);
            let s = &mut self.stats;
            s.hint_checks += 1;
            s.hint_ms += millis(c.hint);
            s.hint_error_ms += millis(waited.abs_diff(c.hint));
            if waited > c.hint {
                s.hints_short += 1;
            }
        }
    }
}

fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).map_or(MAX_WAIT, |d| d.min(MAX_WAIT))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A queue served at `rate` per second with `ahead` waiting, read every 250 ms for
    /// `reads` readings starting at `t0`; returns the served count and the time after.
    fn warm(a: &mut Arrival, t0: Instant, rate: u64, ahead: u64, reads: u32) -> (u64, Instant) {
        let mut served = 0;
        let mut t = t0;
        for _ in 0..reads {
            assert_eq!(a.decide(served, ahead, Duration::MAX, t), Decision::Queue);
            t += 250 * MS;
            served += rate / 4;
        }
        (served, t)
    }

    #[tokio::test(start_paused = true)]
    async fn everyone_queues_until_a_busy_rate_is_known() {
        let mut a = Arrival::default();
        let t0 = Instant::now();
        // However long the queue, a first look knows no rate: queue.
        assert_eq!(a.decide(0, 10_000, 10 * MS, t0), Decision::Queue);
        // A reading across an idle spell (nobody ahead) measures nothing either.
        assert_eq!(a.decide(5, 0, 10 * MS, t0 + 300 * MS), Decision::Queue);
        assert_eq!(a.decide(5, 10_000, 10 * MS, t0 + 350 * MS), Decision::Queue);
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_fits_queues_and_one_that_does_not_is_refused_with_its_wait() {
        let mut a = Arrival::default();
        let (served, t) = warm(&mut a, Instant::now(), 100, 50, 6);
        // 100 a second: 49 ahead is a 0.5 s wait, fitting 2 s.
        assert_eq!(
            a.decide(served, 49, Duration::from_secs(2), t),
            Decision::Queue
        );
        // 399 ahead is 4 s: refused at once, told to come back in 4 s.
        match a.decide(served, 399, Duration::from_secs(2), t) {
            Decision::Refuse { place } => assert!(
                place.abs_diff(Duration::from_secs(4)) < 50 * MS,
                "{place:?}"
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(a.stats().refused_on_arrival, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_refused_are_given_places_one_service_apart() {
        let mut a = Arrival::default();
        let (served, t) = warm(&mut a, Instant::now(), 100, 300, 6);
        let places: Vec<Duration> = (0..5)
            .map(|_| match a.decide(served, 300, Duration::from_secs(1), t) {
                Decision::Refuse { place } => place,
                other => panic!("{other:?}"),
            })
            .collect();
        // 301 / 100 s for the first, then 10 ms (one service) apart, not all at once.
        assert!(places[0].abs_diff(Duration::from_millis(3010)) < 20 * MS);
        for w in places.windows(2) {
            assert!(w[1].abs_diff(w[0] + 10 * MS) <= MS, "{places:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_rate_not_refreshed_is_forgotten() {
        let mut a = Arrival::default();
        let (served, t) = warm(&mut a, Instant::now(), 100, 50, 6);
        let late = t + RATE_TTL + Duration::from_secs(1);
        // The old rate would refuse this; it no longer counts, so the newcomer waits.
        assert_eq!(a.decide(served, 5_000, MS, late), Decision::Queue);
    }

    #[tokio::test(start_paused = true)]
    async fn hint_checks_compare_the_place_with_when_the_turn_came() {
        let mut a = Arrival::default();
        let (mut served, mut t) = warm(&mut a, Instant::now(), 100, 200, 8);
        let place = match a.decide(served, 199, Duration::from_millis(500), t) {
            Decision::Refuse { place } => place,
            other => panic!("{other:?}"),
        };
        assert!(
            place.abs_diff(Duration::from_secs(2)) < 20 * MS,
            "{place:?}"
        );
        // The queue then drains at half the estimated rate: the turn comes after 4 s.
        for _ in 0..20 {
            t += 250 * MS;
            served += 12;
            a.tick(served, t);
            if a.stats().hint_checks > 0 {
                break;
            }
        }
        let s = a.stats();
        assert_eq!(s.hint_checks, 1);
        assert_eq!(s.hints_short, 1, "the turn came after the hint");
        // Would have waited 200 / 48 s = 4.17 s (interpolated), was told 2 s.
        assert!(s.hint_error_ms.abs_diff(2_167) < 30, "{s:?}");
        assert!(s.hint_ms.abs_diff(2_000) < 30, "{s:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_queue_places_late_but_not_never() {
        let mut a = Arrival::default();
        let t0 = Instant::now();
        a.decide(0, 10, MS, t0);
        // Busy for a second, nothing served.
        let place = a.place(0, 10, t0 + Duration::from_secs(1)).expect("a rate");
        assert_eq!(place, MAX_WAIT);
    }
}
