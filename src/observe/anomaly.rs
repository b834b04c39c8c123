//! Culprit detection: which query pattern (fingerprint) or caller is behind an overload, and
//! the evidence for it.
//!
//! Owns the detector's state machine, fed on a tick (every `tick_ms`, 250 by default) with the
//! cumulative counters of the statistics table ([`super::stats::FingerprintStats::counters`]). Recording a
//! statement does no extra work for it: the hot path is untouched, the tick walks at most
//! `classify.stats_capacity` rows, and memory is bounded by that top-K plus the configured
//! callers. It does no I/O and reads no clock: the caller passes the time in, so unit tests
//! drive it with synthetic series.
//!
//! Per subject (a tracked fingerprint, or a caller summed over every fingerprint), each tick:
//! - the deltas of the last `window_ms` (500 by default) give the current rate (calls/s,
//!   refusals included: a refused client that retries is load too), the time rate (client
//!   ms per second, about the backends it keeps busy), the error share and the lock-wait
//!   share (time of statements that ended in 55P03 over its total time);
//! - baselines are exponentially weighted means of the per-tick values with a
//!   `baseline_half_life_ms` half-life, compared *before* the tick is folded in, and folded
//!   in twenty times slower while an anomaly is active, so a flood does not become its own
//!   baseline for minutes (a flood that lasts about five minutes does become the new normal);
//! - a subject already seen during the warm-up (`warmup_ms` after the detector started) gets
//!   a bias-corrected mean, so steady patterns at start are not flagged; one that appears
//!   later starts from zero (the floors below apply), so a new N+1 pattern is flagged. A row
//!   evicted from the statistics and tracked again keeps what was learnt of it.
//!
//! Signals, in order (the first that holds names the anomaly; the specific before the broad):
//! - `rate_step`: rate ≥ `min_qps` and ≥ `step_factor` × max(baseline, `baseline_floor_qps`);
//! - `error_share`: errors (timeouts included) ≥ `error_share` of ≥ `min_calls` calls while the
//!   baseline share is at most half that;
//! - `lock_wait_share`: the same with the lock-wait share and `lock_wait_share`;
//! - `db_time_share` (fingerprints): its share of all fingerprints' time over the last
//!   `share_window_ms` (2 s: a stall that slows everything ends in a burst of completions
//!   that can land on one pattern in a short window, but evens out over a longer one) ≥
//!   `time_share` and grown over its baseline share (by as much as that was, up to 30
//!   points: when everything slows down at once, no pattern is the culprit), time rate ≥
//!   `step_factor` × max(baseline, `time_floor_ms_per_s`), at least `min_calls` calls — a
//!   slow pattern called aggressively.
//!
//! To start, a signal must hold in the window *and* in the newest tick alone on
//! `confirm_ticks` ticks in a row (one burst of completions after a stall stays in the window
//! for a while but is in one tick only); the time, error and lock-wait signals for half of
//! `share_window_ms` (1 s) as well, since a stall's slow completions can mimic them for a
//! tick or two. While an anomaly is active its thresholds are halved
//! (hysteresis), and it clears after `clear_after_ms` without its signal.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use serde::Serialize;

use super::stats::{CounterSnapshot, Counters, FingerprintCounters};
use crate::config::DetectorConfig;

/// Which test fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Signal {
    RateStep,
    DbTimeShare,
    ErrorShare,
    LockWaitShare,
}

impl Signal {
    /// Bounded set: safe as a metric label.
    pub fn name(self) -> &'static str {
        match self {
            Signal::RateStep => "rate_step",
            Signal::DbTimeShare => "db_time_share",
            Signal::ErrorShare => "error_share",
            Signal::LockWaitShare => "lock_wait_share",
        }
    }

    /// The unit of `baseline` and `current` in its evidence.
    fn unit(self) -> &'static str {
        match self {
            Signal::RateStep => "calls_per_second",
            Signal::DbTimeShare => "ms_per_second",
            Signal::ErrorShare | Signal::LockWaitShare => "share",
        }
    }
}

/// What an anomaly is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Subject {
    Fingerprint(u64),
    Caller(Arc<str>),
}

/// The numbers behind an anomaly.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Evidence {
    /// What the signal compared against when the anomaly started ([`Signal`]'s unit).
    pub baseline: f64,
    /// The signal's value on the latest tick that showed it.
    pub current: f64,
    /// `current` over the baseline (or its floor, when larger); for shares, over the limit.
    pub ratio: f64,
    /// The largest `ratio` seen in this episode.
    pub peak_ratio: f64,
    pub unit: &'static str,
    pub window_ms: u64,
    pub calls_in_window: u64,
    /// Calls per second in the window, and its baseline.
    pub qps: f64,
    pub baseline_qps: f64,
    /// Client ms per second in the window (≈ backends kept busy × 1000), and its baseline.
    pub db_ms_per_s: f64,
    pub baseline_db_ms_per_s: f64,
    /// Share of all fingerprints' time in the window.
    pub db_time_share: f64,
    pub error_share: f64,
    pub lock_wait_share: f64,
}

/// A current anomaly.
#[derive(Debug, Clone, PartialEq)]
pub struct Anomaly {
    pub subject: Subject,
    /// The fingerprint's normal form (fingerprint anomalies).
    pub normalized: Option<Arc<str>>,
    pub kind: Option<&'static str>,
    pub signal: Signal,
    pub since_unix_ms: u64,
    pub last_signal_unix_ms: u64,
    pub evidence: Evidence,
    /// Who sent it in the window, most calls first (at most 5): callers of a fingerprint.
    pub top_callers: Vec<(String, u64)>,
    /// A caller anomaly's fingerprint with the most calls in the window.
    pub top_fingerprint: Option<u64>,
}

impl Anomaly {
    pub fn subject_fingerprint(&self) -> Option<u64> {
        match self.subject {
            Subject::Fingerprint(fp) => Some(fp),
            Subject::Caller(_) => None,
        }
    }

    pub fn subject_caller(&self) -> Option<&str> {
        match &self.subject {
            Subject::Caller(name) => Some(name),
            Subject::Fingerprint(_) => None,
        }
    }
}

/// An anomaly began or ended on this tick.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Started(Anomaly),
    Cleared(Anomaly),
}

/// Exponentially weighted mean; `weight` is the sum of the weights given so far, so that a
/// mean started from zero can be bias-corrected.
#[derive(Debug, Clone, Copy, Default)]
struct Ewma {
    value: f64,
    weight: f64,
}

impl Ewma {
    fn update(&mut self, x: f64, alpha: f64) {
        self.value += alpha * (x - self.value);
        self.weight += alpha * (1.0 - self.weight);
    }

    /// Takes the bias-corrected value as a plain one.
    fn settle(&mut self) {
        if self.weight > 0.0 {
            self.value /= self.weight;
            self.weight = 1.0;
        }
    }

    fn get(&self, corrected: bool) -> f64 {
        if corrected && self.weight > 0.0 {
            self.value / self.weight
        } else {
            self.value
        }
    }
}

/// The values of one window (or tick).
#[derive(Debug, Clone, Copy, Default)]
struct Reading {
    calls: u64,
    qps: f64,
    ms_per_s: f64,
    error_share: f64,
    lock_share: f64,
}

impl Reading {
    fn of(c: &Counters, ms: u64) -> Reading {
        let secs = ms.max(1) as f64 / 1000.0;
        let share = |part: u64, whole: u64| {
            if whole == 0 {
                0.0
            } else {
                part as f64 / whole as f64
            }
        };
        Reading {
            calls: c.calls,
            qps: c.calls as f64 / secs,
            ms_per_s: c.total_ns as f64 / 1e6 / secs,
            error_share: share(c.errors, c.calls),
            lock_share: share(c.lock_wait_ns, c.total_ns),
        }
    }
}

#[derive(Debug, Clone)]
struct Active {
    signal: Signal,
    since_ms: u64,
    last_signal_ms: u64,
    evidence: Evidence,
}

#[derive(Debug)]
struct State {
    last: Counters,
    /// Fingerprints: the row's creation stamp (a change means it was evicted and came back).
    first_ms: u64,
    /// (tick length in ms, counters of that tick), newest last.
    window: VecDeque<(u64, Counters)>,
    rate: Ewma,
    time: Ewma,
    errors: Ewma,
    locks: Ewma,
    /// Fingerprints: the share of all fingerprints' time.
    shares: Ewma,
    /// Seen during the warm-up: its baselines are bias-corrected means.
    corrected: bool,
    streak: u32,
    active: Option<Active>,
    /// Not in the statistics since then (evicted, or a reset).
    missing_since: Option<u64>,
    /// The tick it was last in the statistics.
    seen: u64,
    normalized: Option<Arc<str>>,
    kind: Option<&'static str>,
    /// Fingerprints: cumulative per-caller counters at each of the window's tick edges,
    /// oldest first, for the callers behind an anomaly.
    callers: VecDeque<Vec<(Arc<str>, Counters)>>,
}

impl State {
    fn new(last: Counters, first_ms: u64, corrected: bool) -> State {
        State {
            last,
            first_ms,
            window: VecDeque::new(),
            rate: Ewma::default(),
            time: Ewma::default(),
            errors: Ewma::default(),
            locks: Ewma::default(),
            shares: Ewma::default(),
            corrected,
            streak: 0,
            active: None,
            missing_since: None,
            seen: 0,
            normalized: None,
            kind: None,
            callers: VecDeque::new(),
        }
    }

    /// The newest `ticks` ticks: (their length in ms, their counters together).
    fn window_sum(&self, ticks: usize) -> (u64, Counters) {
        let mut ms = 0;
        let mut sum = Counters::default();
        for (dt, c) in self.window.iter().rev().take(ticks) {
            ms += dt;
            sum.add(c);
        }
        (ms, sum)
    }
}

/// A subject's baselines.
struct Bases {
    qps: f64,
    time: f64,
    errors: f64,
    locks: f64,
    share: f64,
}

impl DetectorConfig {
    /// The first signal `r` shows against `bases`: (signal, baseline, current, ratio). With
    /// `hold` (an anomaly is active) the thresholds are halved, so an episode does not flap
    /// while its baseline slowly catches up.
    fn test(
        &self,
        r: &Reading,
        share: f64,
        min_calls: u64,
        is_fp: bool,
        b: &Bases,
        hold: bool,
    ) -> Option<(Signal, f64, f64, f64)> {
        let k = if hold { 0.5 } else { 1.0 };
        let enough = r.calls >= min_calls;
        let rate_ref = b.qps.max(self.baseline_floor_qps);
        let time_ref = b.time.max(self.time_floor_ms_per_s);
        if r.qps >= self.min_qps && r.qps >= k * self.step_factor * rate_ref {
            return Some((Signal::RateStep, b.qps, r.qps, r.qps / rate_ref));
        }
        if enough && r.error_share >= k * self.error_share && b.errors <= self.error_share / 2.0 {
            let ratio = r.error_share / self.error_share;
            return Some((Signal::ErrorShare, b.errors, r.error_share, ratio));
        }
        if enough
            && r.lock_share >= k * self.lock_wait_share
            && b.locks <= self.lock_wait_share / 2.0
        {
            let ratio = r.lock_share / self.lock_wait_share;
            return Some((Signal::LockWaitShare, b.locks, r.lock_share, ratio));
        }
        // A pattern's share must grow too (by as much as it was, up to 30 points): when
        // everything slows down at once (the host starved of CPU, a checkpoint), every
        // pattern's time steps but no pattern is the culprit.
        if is_fp
            && enough
            && share >= k * self.time_share
            && share >= b.share + k * b.share.min(0.3)
            && r.ms_per_s >= k * self.step_factor * time_ref
        {
            let ratio = r.ms_per_s / time_ref;
            return Some((Signal::DbTimeShare, b.time, r.ms_per_s, ratio));
        }
        None
    }
}

/// Counter growth from `old` to `new`; `None` when a counter went back (a reset).
fn delta(new: &Counters, old: &Counters) -> Option<Counters> {
    Some(Counters {
        calls: new.calls.checked_sub(old.calls)?,
        errors: new.errors.checked_sub(old.errors)?,
        lock_wait_ns: new.lock_wait_ns.checked_sub(old.lock_wait_ns)?,
        total_ns: new.total_ns.checked_sub(old.total_ns)?,
    })
}

/// The detector. Feed it with [`Detector::observe`] on every tick.
#[derive(Debug)]
pub struct Detector {
    settings: DetectorConfig,
    started_ms: Option<u64>,
    last_ms: u64,
    states: HashMap<Subject, State>,
    /// Ticks observed; a state last `seen` on an earlier one is missing from the statistics.
    tick_no: u64,
}

impl Detector {
    pub fn new(settings: DetectorConfig) -> Detector {
        Detector {
            settings,
            started_ms: None,
            last_ms: 0,
            states: HashMap::new(),
            tick_no: 0,
        }
    }

    /// New knobs (a reload); what was learnt stays.
    pub fn set_settings(&mut self, settings: DetectorConfig) {
        self.settings = settings;
    }

    pub fn settings(&self) -> &DetectorConfig {
        &self.settings
    }

    /// Subjects with state: bounded by the statistics' top-K plus the callers.
    pub fn tracked(&self) -> usize {
        self.states.len()
    }

    /// One tick at `now_ms` (unix ms) with the statistics' cumulative counters; returns the
    /// anomalies that started or cleared.
    pub fn observe(&mut self, now_ms: u64, snapshot: CounterSnapshot) -> Vec<Event> {
        let first_tick = self.started_ms.is_none();
        let started = *self.started_ms.get_or_insert(now_ms);
        let dt = if first_tick {
            0
        } else {
            now_ms.saturating_sub(self.last_ms).max(1)
        };
        self.last_ms = now_ms;
        let warming = now_ms.saturating_sub(started) < self.settings.warmup_ms;

        // Per-caller totals over every fingerprint and the "other" row.
        let mut callers: HashMap<Arc<str>, Counters> = HashMap::new();
        for row in &snapshot.fingerprints {
            for (name, c) in &row.by_caller {
                callers.entry(name.clone()).or_default().add(c);
            }
        }
        for (name, c) in &snapshot.other_callers {
            callers.entry(name.clone()).or_default().add(c);
        }

        self.tick_no += 1;
        for row in snapshot.fingerprints {
            let subject = Subject::Fingerprint(row.fingerprint);
            self.advance_fingerprint(subject, row, now_ms, dt, first_tick, warming);
        }
        for (name, c) in callers {
            self.advance(Subject::Caller(name), c, 0, dt, first_tick, warming);
        }
        let mut events = Vec::new();
        // Rows evicted from the statistics (or gone after a reset) stop counting at once and
        // leave after `clear_after_ms`; one that comes back in time keeps its baselines.
        let linger = self.settings.clear_after_ms;
        let mut gone: Vec<Subject> = Vec::new();
        for (s, st) in self.states.iter_mut() {
            if st.seen == self.tick_no {
                st.missing_since = None;
                continue;
            }
            st.window.clear();
            st.streak = 0;
            let since = *st.missing_since.get_or_insert(now_ms);
            if now_ms.saturating_sub(since) >= linger {
                gone.push(s.clone());
            }
        }
        for s in gone {
            if let Some(st) = self.states.remove(&s)
                && let Some(a) = &st.active
            {
                events.push(Event::Cleared(self.anomaly(&s, &st, a)));
            }
        }
        if !warming {
            // The warm-up is over: what was learnt becomes a plain mean, so that from now on
            // each tick weighs what its half-life says (a bias-corrected mean with little
            // weight behind it would follow a flood far faster).
            for st in self.states.values_mut().filter(|st| st.corrected) {
                for e in [
                    &mut st.rate,
                    &mut st.time,
                    &mut st.errors,
                    &mut st.locks,
                    &mut st.shares,
                ] {
                    e.settle();
                }
                st.corrected = false;
            }
        }
        if dt > 0 && !warming {
            self.judge(now_ms, &mut events);
        }
        self.fold(dt);
        events
    }

    fn advance_fingerprint(
        &mut self,
        subject: Subject,
        row: FingerprintCounters,
        now_ms: u64,
        dt: u64,
        first_tick: bool,
        warming: bool,
    ) {
        let ticks = self.window_ticks() + 1;
        let started = self.started_ms.unwrap_or(now_ms);
        // A row created since the last look (new, or evicted and tracked again, or after a
        // reset): every call it counts is new, over the time since it was created. What was
        // learnt of a pattern seen before stays.
        let known = self.states.get_mut(&subject);
        let reborn = known.is_some_and(|st| {
            if st.first_ms == row.first_ms {
                return false;
            }
            st.first_ms = row.first_ms;
            st.last = Counters::default();
            st.window.clear();
            st.callers.clear();
            st.streak = 0;
            true
        });
        let new_row = reborn
            || (!self.states.contains_key(&subject) && !first_tick && row.first_ms >= started);
        let st = self.advance(subject, row.counters, row.first_ms, dt, first_tick, warming);
        if new_row {
            st.window.clear();
            st.window
                .push_back((dt.max(now_ms.saturating_sub(row.first_ms)), row.counters));
            st.callers.clear();
            st.callers.push_back(Vec::new());
        }
        if st.normalized.is_none() {
            st.normalized = Some(row.normalized);
            st.kind = Some(row.kind);
        }
        st.callers.push_back(row.by_caller);
        while st.callers.len() > ticks {
            st.callers.pop_front();
        }
    }

    /// Moves `subject` to its new cumulative counters `c`.
    fn advance(
        &mut self,
        subject: Subject,
        c: Counters,
        first_ms: u64,
        dt: u64,
        first_tick: bool,
        warming: bool,
    ) -> &mut State {
        let ticks = self.window_ticks().max(self.share_ticks());
        let tick_no = self.tick_no;
        let st = self
            .states
            .entry(subject)
            .or_insert_with(|| State::new(c, first_ms, warming));
        st.seen = tick_no;
        if first_tick {
            st.last = c;
            return st;
        }
        match delta(&c, &st.last) {
            Some(d) => st.window.push_back((dt, d)),
            None => {
                // The statistics were reset: start the window over, keep the baselines.
                st.window.clear();
                st.streak = 0;
            }
        }
        st.last = c;
        while st.window.len() > ticks {
            st.window.pop_front();
        }
        st
    }

    fn window_ticks(&self) -> usize {
        let s = &self.settings;
        (s.window_ms.div_ceil(s.tick_ms.max(1))).max(1) as usize
    }

    fn share_ticks(&self) -> usize {
        let s = &self.settings;
        (s.share_window_ms.div_ceil(s.tick_ms.max(1))).max(1) as usize
    }

    /// Tests every subject's window against its baselines.
    fn judge(&mut self, now_ms: u64, events: &mut Vec<Event>) {
        let s = self.settings.clone();
        let (ticks, share_ticks) = (self.window_ticks(), self.share_ticks());
        // Shares of the time are taken over `share_window_ms`: a stall that slows everything
        // ends in a burst of completions that lands on a few patterns in one short window,
        // but evens out over a longer one.
        let long_fp_ns: u64 = self
            .states
            .iter()
            .filter(|(k, _)| matches!(k, Subject::Fingerprint(_)))
            .map(|(_, st)| st.window_sum(share_ticks).1.total_ns)
            .sum();
        let share_of = |ns: u64, total: u64| {
            if total == 0 {
                0.0
            } else {
                ns as f64 / total as f64
            }
        };
        // A rate step is confirmed in `confirm_ticks`; the time and share signals, which a
        // stall's burst of slow completions can mimic for a tick or two, must hold for half
        // the share window (1 s) too.
        let needed = |signal: Signal| {
            let confirm = s.confirm_ticks.max(1);
            if signal == Signal::RateStep {
                confirm
            } else {
                confirm.max((share_ticks / 2) as u32)
            }
        };
        let tick_min_calls = (s.min_calls * s.tick_ms)
            .div_ceil(s.window_ms.max(1))
            .max(1);
        let mut started: Vec<Subject> = Vec::new();
        let mut cleared: Vec<(Subject, Active)> = Vec::new();
        for (subject, st) in self.states.iter_mut() {
            let (ms, sum) = st.window_sum(ticks);
            if ms == 0 {
                continue;
            }
            let now = Reading::of(&sum, ms);
            let bases = Bases {
                qps: st.rate.get(st.corrected),
                time: st.time.get(st.corrected),
                errors: st.errors.get(st.corrected),
                locks: st.locks.get(st.corrected),
                share: st.shares.get(st.corrected),
            };
            let (base_qps, base_time) = (bases.qps, bases.time);
            let is_fp = matches!(subject, Subject::Fingerprint(_));
            let hold = st.active.is_some();
            let share = share_of(st.window_sum(share_ticks).1.total_ns, long_fp_ns);
            let found = s.test(&now, share, s.min_calls, is_fp, &bases, hold);
            // To start, the newest tick alone must show it too: one burst of completions
            // (after a stall) stays in the window for several ticks but is in one tick only.
            let confirmed = found.is_some()
                && (hold
                    || st.window.back().is_some_and(|&(tick_ms, c)| {
                        let r = Reading::of(&c, tick_ms);
                        s.test(&r, share, tick_min_calls, is_fp, &bases, false)
                            .is_some()
                    }));
            let found = found.filter(|_| confirmed);
            match found {
                Some((signal, baseline, current, ratio)) => {
                    st.streak += 1;
                    let evidence = |baseline: f64, peak: f64| Evidence {
                        baseline,
                        current,
                        ratio,
                        peak_ratio: peak.max(ratio),
                        unit: signal.unit(),
                        window_ms: ms,
                        calls_in_window: now.calls,
                        qps: now.qps,
                        baseline_qps: base_qps,
                        db_ms_per_s: now.ms_per_s,
                        baseline_db_ms_per_s: base_time,
                        db_time_share: share,
                        error_share: now.error_share,
                        lock_wait_share: now.lock_share,
                    };
                    match &mut st.active {
                        Some(a) => {
                            a.last_signal_ms = now_ms;
                            let (b, p) = if a.signal == signal {
                                (a.evidence.baseline, a.evidence.peak_ratio)
                            } else {
                                (baseline, 0.0)
                            };
                            a.evidence = evidence(b, p);
                            if a.signal != signal {
                                // Keep the signal that started the episode; the evidence
                                // shows what holds now.
                                a.evidence.unit = signal.unit();
                            }
                        }
                        None if st.streak >= needed(signal) => {
                            st.active = Some(Active {
                                signal,
                                since_ms: now_ms,
                                last_signal_ms: now_ms,
                                evidence: evidence(baseline, 0.0),
                            });
                            started.push(subject.clone());
                        }
                        None => {}
                    }
                }
                None => {
                    st.streak = 0;
                    if let Some(a) = &st.active
                        && now_ms.saturating_sub(a.last_signal_ms) >= s.clear_after_ms
                    {
                        cleared.push((subject.clone(), a.clone()));
                        st.active = None;
                    }
                }
            }
        }
        started.sort();
        for subject in started {
            if let Some(st) = self.states.get(&subject)
                && let Some(a) = &st.active
            {
                events.push(Event::Started(self.anomaly(&subject, st, a)));
            }
        }
        cleared.sort_by(|a, b| a.0.cmp(&b.0));
        for (subject, a) in cleared {
            if let Some(st) = self.states.get(&subject) {
                events.push(Event::Cleared(self.anomaly(&subject, st, &a)));
            }
        }
    }

    /// Folds the newest tick into every baseline.
    fn fold(&mut self, dt: u64) {
        if dt == 0 {
            return;
        }
        let half_life = self.settings.baseline_half_life_ms.max(1) as f64;
        let alpha = 1.0 - 0.5f64.powf(dt as f64 / half_life);
        let tick_fp_ns: u64 = self
            .states
            .iter()
            .filter(|(k, _)| matches!(k, Subject::Fingerprint(_)))
            .map(|(_, st)| st.window.back().map_or(0, |(_, c)| c.total_ns))
            .sum();
        for (subject, st) in self.states.iter_mut() {
            let Some(&(tick_ms, last)) = st.window.back() else {
                continue;
            };
            let a = if st.active.is_some() {
                alpha / 20.0
            } else {
                alpha
            };
            let r = Reading::of(&last, tick_ms);
            st.rate.update(r.qps, a);
            st.time.update(r.ms_per_s, a);
            if r.calls > 0 {
                st.errors.update(r.error_share, a);
                st.locks.update(r.lock_share, a);
            }
            if matches!(subject, Subject::Fingerprint(_)) && tick_fp_ns > 0 {
                st.shares
                    .update(last.total_ns as f64 / tick_fp_ns as f64, a);
            }
        }
    }

    fn anomaly(&self, subject: &Subject, st: &State, a: &Active) -> Anomaly {
        let (top_callers, top_fingerprint) = match subject {
            Subject::Fingerprint(_) => (window_callers(st), None),
            Subject::Caller(name) => (Vec::new(), self.top_fingerprint_of(name)),
        };
        Anomaly {
            subject: subject.clone(),
            normalized: st.normalized.clone(),
            kind: st.kind,
            signal: a.signal,
            since_unix_ms: a.since_ms,
            last_signal_unix_ms: a.last_signal_ms,
            evidence: a.evidence.clone(),
            top_callers,
            top_fingerprint,
        }
    }

    /// The fingerprint `caller` sent the most calls of in the window.
    fn top_fingerprint_of(&self, caller: &str) -> Option<u64> {
        let mut best: Option<(u64, u64)> = None;
        for (subject, st) in &self.states {
            let Subject::Fingerprint(fp) = subject else {
                continue;
            };
            let calls = |v: Option<&Vec<(Arc<str>, Counters)>>| {
                v.and_then(|v| v.iter().find(|(n, _)| &**n == caller))
                    .map_or(0, |(_, c)| c.calls)
            };
            let n = calls(st.callers.back()).saturating_sub(calls(st.callers.front()));
            if n > 0 && best.is_none_or(|(b, bfp)| n > b || (n == b && *fp < bfp)) {
                best = Some((n, *fp));
            }
        }
        best.map(|(_, fp)| fp)
    }

    /// The current anomalies, oldest first.
    pub fn active(&self) -> Vec<Anomaly> {
        let mut out: Vec<Anomaly> = self
            .states
            .iter()
            .filter_map(|(s, st)| st.active.as_ref().map(|a| self.anomaly(s, st, a)))
            .collect();
        out.sort_by(|a, b| {
            a.since_unix_ms
                .cmp(&b.since_unix_ms)
                .then_with(|| a.subject.cmp(&b.subject))
        });
        out
    }
}

/// A fingerprint's callers by calls in its window, most first (at most 5).
fn window_callers(st: &State) -> Vec<(String, u64)> {
    let (Some(new), Some(old)) = (st.callers.back(), st.callers.front()) else {
        return Vec::new();
    };
    let mut out: Vec<(String, u64)> = new
        .iter()
        .map(|(n, c)| {
            let before = old.iter().find(|(o, _)| o == n).map_or(0, |(_, c)| c.calls);
            (n.to_string(), c.calls.saturating_sub(before))
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    out.truncate(5);
    out
}

#[cfg(test)]
#[path = "anomaly_tests.rs"]
mod tests;
