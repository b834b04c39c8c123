//! Deciding at arrival (DESIGN §5): a newcomer that finds no room either waits in its queue,
//! when its expected wait fits the time it may wait, or is refused at once with a hint around
//! that wait — not refused after it has waited, unless the estimate was wrong. A refusal after
//! a wait throws away the wait *and* the place in line, and the retry costs a new login.
//!
//! Owns [`Arrival`], one per queue (a pool's priority, a caller's FIFO), kept under its
//! owner's lock and fed by it: a monotonic count of the waiters the queue has served (grants,
//! not arrivals) and the waiters ahead of the newcomer. From those it keeps:
//!
//! * the queue's **service rate**, measured only while it is busy: two readings count only
//!   when waiters were ahead at both (a rate read across an idle spell measures arrivals, not
//!   room); a reading needs [`MIN_SPAN`] and [`MIN_SERVED`] services, and is smoothed over
//!   [`SMOOTHING`]. A rate not refreshed for [`RATE_TTL`] is forgotten.
//! * **two estimates from it.** Whether to queue is judged at the *best* pace the queue has
//!   shown — the fastest of the smoothed rate, the last reading and the fastest reading of
//!   the last [`PEAK_TTL`] — because a queue speeds up (logins stop taking the CPU, long
//!   work holding backends ends) faster than an average follows, and a wrong refusal costs
//!   more than a wrong wait: the refused client pays a new login and comes back after the
//!   queue had room, while one queued on an optimistic estimate loses at most its wait. So a
//!   refusal on arrival means the queue could not serve the newcomer in [`SLACK`] times the
//!   time it may wait even at its best. Where a refused client should come back is judged at the *smoothed* pace (a
//!   hint from the best pace sends it back to a queue still full), spread over half to one
//!   and a half of that wait, so the refused of one moment come back spread out.
//! * **a standing queue**: nobody is refused until the queue has been busy for [`SLACK`]
//!   times as long as the newcomer may wait, and a rate is known; until then everyone
//!   queues. The first
//!   moments of a storm are its slowest, and a refusal on their pace would send away
//!   clients the queue would have served; a queue still busy after a whole wait is one that
//!   waiting does not clear.
//! * **hint checks**: a refused client's expected wait is a number of services from now;
//!   when the count reaches it, the time that took is the wait it would have had, compared
//!   with the expected wait its hint was spread around ([`ArrivalStats`]). The crossing time
//!   is interpolated between two readings, so a check resolved late (at the next reading) is
//!   still accurate. (The count moves only while someone is there to be served: when most
//!   of a queue's clients were refused and are away, the check measures how long the queue
//!   took to serve them after they came back.)
//!
//! Pure but for the hint's jitter: time and counts come in; nothing here locks, sleeps or
//! reads a clock.

use std::collections::VecDeque;
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

/// Readings closer than this reuse the last rate (a burst of arrivals reads it once).
pub const MIN_SPAN: Duration = Duration::from_millis(200);
/// Services a reading needs, unless the queue stalled for [`RATE_TTL`].
pub const MIN_SERVED: u64 = 4;
/// Time constant of the rate's smoothing.
pub const SMOOTHING: Duration = Duration::from_millis(500);
/// A rate not refreshed for this long no longer describes the queue.
pub const RATE_TTL: Duration = Duration::from_secs(5);
/// How long the fastest reading counts as the pace the queue can reach again.
pub const PEAK_TTL: Duration = Duration::from_secs(30);
/// A newcomer is refused on arrival only when its wait at the best pace is more than this
/// many times what it may wait: a refusal costs the client a new login and takes away the
/// natural backoff of a wait, so only the clearly hopeless are sent away at once.
pub const SLACK: u32 = 2;
/// Longest wait or place ever estimated.
pub const MAX_WAIT: Duration = Duration::from_secs(60);
/// Hint checks kept at once; beyond, refusals go unchecked (the sample stays unbiased).
const MAX_CHECKS: usize = 512;

/// What a newcomer that finds no room does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Wait: its expected wait fits (or is not known yet).
    Queue,
    /// Refuse now, with its place.
    Refuse(Placed),
}

/// Where a newcomer stands, as its queue's owner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Line {
    /// Waiters the queue has served so far (monotonic).
    pub served: u64,
    /// Waiters in front of the newcomer (0: the queue is empty but nothing is free).
    pub ahead: u64,
    /// How long the newcomer may wait.
    pub room: Duration,
}

/// A refused client's place in line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    /// When its turn would come, at the queue's smoothed pace.
    pub place: Duration,
    /// When it should come back (its retry hint): spread over half to one and a half of
    /// `place`.
    pub retry: Duration,
}

/// What a queue's arrival decisions did, for the admin API and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ArrivalStats {
    /// Refused at once because the expected wait did not fit.
    pub refused_on_arrival: u64,
    /// Queued and refused when the wait ran out: each a wasted wait (the estimate was wrong,
    /// or there was none yet).
    pub refused_after_wait: u64,
    /// Refusals whose expected wait was checked against the wait the client would have had.
    pub hint_checks: u64,
    /// Sum of the checked expected waits, and of |would-have-waited − expected| (ms).
    pub hint_ms: u64,
    pub hint_error_ms: u64,
    /// Checked expected waits shorter than the wait would have been.
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
    /// Services per second (smoothed), and when it was last refreshed.
    rate: Option<(f64, Instant)>,
    /// The last reading's rate alone.
    latest: f64,
    /// The fastest reading of the last [`PEAK_TTL`], and when it was read.
    peak: Option<(f64, Instant)>,
    /// Since when waiters have been ahead at every reading.
    busy_since: Option<Instant>,
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
    expected: Duration,
}

/// The queue's pace: the best it has shown, and its smoothed one (services per second).
#[derive(Debug, Clone, Copy)]
struct Pace {
    best: f64,
    smooth: f64,
}

impl Arrival {
    /// Queue the newcomer at `line`, or refuse it with its place.
    pub fn decide(&mut self, line: Line, now: Instant) -> Decision {
        let Line { ahead, room, .. } = line;
        let Some(pace) = self.read(line.served, ahead, now) else {
            return Decision::Queue;
        };
        let established = self
            .busy_since
            .is_some_and(|t| now.saturating_duration_since(t) >= room.saturating_mul(SLACK));
        if secs((ahead + 1) as f64 / pace.best) <= room.saturating_mul(SLACK) || !established {
            return Decision::Queue;
        }
        self.stats.refused_on_arrival += 1;
        Decision::Refuse(self.promise(line, pace, now))
    }

    /// A queued client's wait ran out: a wasted wait.
    pub fn waited_out(&mut self) {
        self.stats.refused_after_wait += 1;
    }

    /// The owner's periodic look (about once a second): resolves the checks whose turn has
    /// come, so they do not wait for the next arrival.
    pub fn tick(&mut self, served: u64, now: Instant) {
        self.observe(served, now);
    }

    pub fn stats(&self) -> ArrivalStats {
        self.stats
    }

    /// The pace now, if known: reads the count (while busy) and resolves checks.
    fn read(&mut self, served: u64, ahead: u64, now: Instant) -> Option<Pace> {
        self.observe(served, now);
        if ahead == 0 || self.busy_since.is_none() {
            self.busy_since = Some(now);
        }
        match self.sample {
            // An empty queue ends the busy reading: the next one starts here.
            _ if ahead == 0 => self.sample = Some((now, served)),
            None => self.sample = Some((now, served)),
            // Too long since: the queue may have been idle meanwhile; start again.
            Some((at, _)) if now.saturating_duration_since(at) > RATE_TTL => {
                self.sample = Some((now, served));
                self.busy_since = Some(now);
            }
            Some((at, count)) => {
                let span = now.saturating_duration_since(at);
                let stalled = span >= RATE_TTL / 2;
                if span >= MIN_SPAN && (served.saturating_sub(count) >= MIN_SERVED || stalled) {
                    let seen = served.saturating_sub(count) as f64 / span.as_secs_f64();
                    let rate = match self.rate {
                        Some((r, _)) => {
                            let w = (span.as_secs_f64() / SMOOTHING.as_secs_f64()).min(1.0);
                            r + w * (seen - r)
                        }
                        None => seen,
                    };
                    self.rate = Some((rate, now));
                    self.latest = seen;
                    let higher = |&(p, at): &(f64, Instant)| {
                        p > seen && now.saturating_duration_since(at) < PEAK_TTL
                    };
                    if !self.peak.is_some_and(|p| higher(&p)) {
                        self.peak = Some((seen, now));
                    }
                    self.sample = Some((now, served));
                }
            }
        }
        let (smooth, at) = self.rate?;
        if now.saturating_duration_since(at) > RATE_TTL {
            return None;
        }
        let peak = self
            .peak
            .filter(|(_, t)| now.saturating_duration_since(*t) < PEAK_TTL)
            .map_or(0.0, |(p, _)| p);
        // A queue that served nothing at all is "much later", not "never".
        let least = 1.0 / MAX_WAIT.as_secs_f64();
        Some(Pace {
            best: smooth.max(self.latest).max(peak).max(least),
            smooth: smooth.max(least),
        })
    }

    /// The place of a refused client at `line`: its wait at the smoothed pace, and a retry
    /// spread around it; checked later against the turn it would have had.
    fn promise(&mut self, line: Line, pace: Pace, now: Instant) -> Placed {
        let place = secs((line.ahead + 1) as f64 / pace.smooth);
        if self.checks.len() < MAX_CHECKS {
            self.checks.push_back(Check {
                target: line.served + line.ahead + 1,
                issued: now,
                expected: place,
            });
        }
        let spread = rand::random_range(0.5..=1.5);
        Placed {
            place,
            retry: place.mul_f64(spread).min(MAX_WAIT),
        }
    }

    /// Resolves the checks whose target count has been reached by `served` at `now`.
    fn observe(&mut self, served: u64, now: Instant) {
        let (t0, c0) = self.seen.unwrap_or((now, served));
        self.seen = Some((now, served));
        if self.checks.is_empty() {
            return;
        }
        let stats = &mut self.stats;
        self.checks.retain(|c| {
            if c.target > served {
                // Nothing moves for a long time: past any estimate; dropped unchecked.
                return now.saturating_duration_since(c.issued) <= 2 * MAX_WAIT;
            }
            // When the count crossed the target, between the last reading and this one.
            let crossed = if c.target <= c0 || served == c0 {
                t0
            } else {
                let f = (c.target - c0) as f64 / (served - c0) as f64;
                t0 + now.saturating_duration_since(t0).mul_f64(f)
            };
            let waited = crossed.saturating_duration_since(c.issued);
            stats.hint_checks += 1;
            stats.hint_ms += millis(c.expected);
            stats.hint_error_ms += millis(waited.abs_diff(c.expected));
            if waited > c.expected {
                stats.hints_short += 1;
            }
            false
        });
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

    fn line(served: u64, ahead: u64, room: Duration) -> Line {
        Line {
            served,
            ahead,
            room,
        }
    }

    /// A queue served at `rate` per second with `ahead` waiting, read every 250 ms for
    /// `reads` readings starting at `t0`; returns the served count and the time after.
    fn warm(a: &mut Arrival, t0: Instant, rate: u64, ahead: u64, reads: u32) -> (u64, Instant) {
        let mut served = 0;
        let mut t = t0;
        for _ in 0..reads {
            assert_eq!(
                a.decide(line(served, ahead, Duration::MAX), t),
                Decision::Queue
            );
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
        assert_eq!(a.decide(line(0, 10_000, 10 * MS), t0), Decision::Queue);
        // A reading across an idle spell (nobody ahead) measures nothing either.
        assert_eq!(
            a.decide(line(5, 0, 10 * MS), t0 + 300 * MS),
            Decision::Queue
        );
        assert_eq!(
            a.decide(line(5, 10_000, 10 * MS), t0 + 350 * MS),
            Decision::Queue
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_fits_queues_and_one_that_does_not_is_refused_with_its_wait() {
        let mut a = Arrival::default();
        let (served, t) = warm(&mut a, Instant::now(), 100, 50, 20);
        // 100 a second: 49 ahead is a 0.5 s wait, fitting 2 s.
        assert_eq!(
            a.decide(line(served, 49, Duration::from_secs(2)), t),
            Decision::Queue
        );
        // 399 ahead is 4 s: more than it may wait, but not hopeless (twice that): queued.
        assert_eq!(
            a.decide(line(served, 399, Duration::from_secs(2)), t),
            Decision::Queue
        );
        // 599 ahead is 6 s: refused at once; its turn in 6 s, told to come back around then.
        match a.decide(line(served, 599, Duration::from_secs(2)), t) {
            Decision::Refuse(Placed { place, retry }) => {
                assert!(
                    place.abs_diff(Duration::from_secs(6)) < 50 * MS,
                    "{place:?}"
                );
                assert!(retry >= place / 2 && retry <= place * 3 / 2, "{retry:?}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(a.stats().refused_on_arrival, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_refused_are_told_to_come_back_spread_around_their_turn() {
        let mut a = Arrival::default();
        let (served, t) = warm(&mut a, Instant::now(), 100, 300, 8);
        let retries: Vec<Duration> = (0..200)
            .map(
                |_| match a.decide(line(served, 300, Duration::from_secs(1)), t) {
                    Decision::Refuse(Placed { place, retry }) => {
                        // 301 ahead at 100 a second.
                        assert!(place.abs_diff(Duration::from_millis(3010)) < 20 * MS);
                        assert!(retry >= place / 2 && retry <= place * 3 / 2, "{retry:?}");
                        retry
                    }
                    other => panic!("{other:?}"),
                },
            )
            .collect();
        // Spread over the window, not one instant: a herd would overflow the queue again.
        let early = retries
            .iter()
            .filter(|r| **r < Duration::from_secs(3))
            .count();
        assert!(
            (50..=150).contains(&early),
            "{early} of 200 before the turn"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn nobody_is_refused_before_the_queue_has_been_busy_a_while() {
        let mut a = Arrival::default();
        // A fast rate known from a busy spell...
        let (served, t) = warm(&mut a, Instant::now(), 100, 50, 6);
        // ...then the queue empties: the next busy spell starts from scratch.
        let room = Duration::from_secs(2);
        assert_eq!(a.decide(line(served, 0, room), t), Decision::Queue);
        // Half a wait into it, 50 s of queue still waits: it may not be standing yet.
        let t = t + 500 * MS;
        assert_eq!(a.decide(line(served + 50, 5_000, room), t), Decision::Queue);
        // Twice its wait into it, the same newcomer is refused.
        let t = t + 3_600 * MS;
        assert!(matches!(
            a.decide(line(served + 410, 5_000, room), t),
            Decision::Refuse(_)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_queue_that_was_fast_is_expected_to_be_fast_again() {
        let mut a = Arrival::default();
        let room = Duration::from_secs(1);
        let (mut served, mut t) = warm(&mut a, Instant::now(), 1_000, 500, 6);
        // Then it slows to 10 a second for two seconds (logins take the CPU, say).
        for _ in 0..8 {
            t += 250 * MS;
            served += 3;
            assert_eq!(a.decide(line(served, 500, room), t), Decision::Queue);
        }
        // 500 ahead is 50 s at the pace now, half a second at the pace it has shown: queued.
        assert_eq!(a.decide(line(served, 500, room), t), Decision::Queue);
        // Beyond what even that pace serves in time: refused.
        assert!(matches!(
            a.decide(line(served, 5_000, room), t),
            Decision::Refuse(_)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_rate_not_refreshed_is_forgotten() {
        let mut a = Arrival::default();
        let (served, t) = warm(&mut a, Instant::now(), 100, 50, 6);
        let late = t + RATE_TTL + Duration::from_secs(1);
        // The old rate would refuse this; it no longer counts, so the newcomer waits.
        assert_eq!(a.decide(line(served, 5_000, MS), late), Decision::Queue);
    }

    #[tokio::test(start_paused = true)]
    async fn hint_checks_compare_the_place_with_when_the_turn_came() {
        let mut a = Arrival::default();
        let (mut served, mut t) = warm(&mut a, Instant::now(), 100, 200, 8);
        let place = match a.decide(line(served, 199, Duration::from_millis(500)), t) {
            Decision::Refuse(Placed { place, .. }) => place,
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
        a.decide(line(0, 10, MS), t0);
        // Busy for a second, nothing served: too little to tell, so it waits.
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(a.decide(line(0, 10, MS), t1), Decision::Queue);
        // For three, nothing served: stalled, its turn as far as any estimate goes.
        match a.decide(line(0, 10, MS), t0 + Duration::from_secs(3)) {
            Decision::Refuse(placed) => assert_eq!(placed.place, MAX_WAIT),
            other => panic!("{other:?}"),
        }
    }
}
