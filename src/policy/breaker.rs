//! Circuit breaker: the proxy-wide "is the database in trouble" switch (DESIGN §5 step 3).
//!
//! An explicit state machine — closed → open → half-open → closed — with the reason for every
//! trip kept and counted. It trips on a streak of backend errors/timeouts
//! (`consecutive_errors`) or on a health-probe value (e.g. DB load %) at or above
//! `db_cpu_threshold_percent`. While open only `critical` traffic is admitted, up to
//! `critical_reserve` statements at once; after `open` it goes half-open and lets at most
//! `half_open_trials` non-critical statements run at once as trials: that many successes
//! close it, a failure reopens it.
//!
//! In-flight statements above `max_inflight_threshold` do not open it (the design article's
//! `AllowQuery`): while the count is over the threshold non-critical statements are shed and
//! critical ones are admitted up to `critical_reserve` above it; once the count drops, all
//! traffic flows again at once. Those sheds are counted apart from trips.
//!
//! What it must not do: classify errors. The session decides which failures are backend faults
//! (DESIGN: only those feed the breaker) and reports them with `on_success`/`on_failure`.
//! Results are not tied to tickets, so a statement admitted before a trip that finishes during
//! half-open counts as a trial; with `open` in seconds and statement timeouts below that, this
//! is rare and errs towards closing a breaker whose database is answering again.
//!
//! Hot path: `allow` while closed and below the in-flight threshold is two atomic operations;
//! the mutex is only taken when the state is not closed or a transition may happen. Transitions
//! are reported to an observer callback (for logs and metrics) after the mutex is released.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use tokio::time::Instant;

use super::Priority;

/// Breaker settings as the policy runs them: `global_defaults.circuit_breaker` resolved
/// (durations, the critical reserve worked out; the same field names).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BreakerSettings {
    /// Backend errors/timeouts in a row that trip the breaker; 0 disables this trigger.
    pub consecutive_errors: u32,
    /// Shed non-critical statements while more than this are in flight proxy-wide (critical
    /// ones up to `critical_reserve` more); `None` disables.
    pub max_inflight_threshold: Option<u32>,
    /// Trip when a health-probe value is at or above this; `None` disables.
    pub db_cpu_threshold_percent: Option<f64>,
    /// How long the breaker stays open before trying half-open.
    #[serde(rename = "open_ms", serialize_with = "super::ser_ms")]
    pub open: Duration,
    /// Non-critical trial statements allowed at once while half-open, and the successes that
    /// close it (at least 1).
    pub half_open_trials: u32,
    /// Critical statements allowed in flight at once while the breaker is not closed: a
    /// reserve, not a bypass. Comment tags are claims a client makes about itself, so
    /// "critical" must not mean "unlimited" on a database that is already in trouble.
    pub critical_reserve: u32,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        Self {
            consecutive_errors: 5,
            max_inflight_threshold: None,
            db_cpu_threshold_percent: None,
            open: Duration::from_millis(5000),
            half_open_trials: 1,
            critical_reserve: 20,
        }
    }
}

/// Where the state machine is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

impl BreakerState {
    /// Stable label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Closed,
            1 => Self::Open,
            _ => Self::HalfOpen,
        }
    }

    fn to_u8(self) -> u8 {
        match self {
            Self::Closed => 0,
            Self::Open => 1,
            Self::HalfOpen => 2,
        }
    }
}

/// Why the breaker (last) opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TripReason {
    /// `consecutive_errors` backend errors/timeouts in a row.
    ConsecutiveErrors,
    /// In-flight statements above `max_inflight_threshold`: a shed reason, never a trip.
    Inflight,
    /// Health-probe value at or above `db_cpu_threshold_percent`.
    Probe,
    /// A half-open trial statement failed.
    TrialFailed,
}

impl TripReason {
    /// Stable label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ConsecutiveErrors => "consecutive_errors",
            Self::Inflight => "inflight",
            Self::Probe => "probe",
            Self::TrialFailed => "trial_failed",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One state change, handed to the observer.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    pub from: BreakerState,
    pub to: BreakerState,
    /// Set when `to` is `Open`: what tripped it.
    pub reason: Option<TripReason>,
    pub at: Instant,
}

/// Callback for transitions (logging, metrics). Called outside the breaker's lock.
pub type TransitionObserver = Arc<dyn Fn(&Transition) + Send + Sync>;

/// Why a statement was shed, and a floor for the client's retry hint.
#[derive(Debug, Clone, PartialEq)]
pub struct BreakerRefusal {
    pub state: BreakerState,
    pub reason: Option<TripReason>,
    /// Time until the breaker will try half-open (zero when already half-open).
    pub retry_after: Duration,
    /// A critical statement found the critical reserve in use.
    pub reserve_full: bool,
}

/// Trip counts per reason, for the admin API and metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TripCounts {
    pub consecutive_errors: u64,
    pub probe: u64,
    pub trial_failed: u64,
}

/// Read-only view for `GET /v1/breaker`.
#[derive(Debug, Clone, Serialize)]
pub struct BreakerSnapshot {
    pub state: BreakerState,
    /// Reason of the current (or last, while half-open) trip; `None` when closed.
    pub reason: Option<TripReason>,
    /// Milliseconds since the breaker entered `state`.
    pub since_ms: u64,
    /// While open: milliseconds until half-open.
    pub open_remaining_ms: Option<u64>,
    /// All state changes since start (kept across reconfiguration).
    pub transitions: u64,
    pub trips: TripCounts,
    pub consecutive_errors: u32,
    pub in_flight: u32,
    /// Statements shed while in flight was above `max_inflight_threshold` (since start).
    pub inflight_sheds: u64,
    pub half_open_probes: u32,
    /// Successful statements since the breaker went half-open.
    pub half_open_successes: u32,
    pub last_probe_value: Option<f64>,
    pub config: BreakerSettings,
}

/// The breaker. Cheap to share: clone the `Arc` it lives in, tickets keep their own reference.
pub struct Breaker {
    shared: Arc<Shared>,
}

struct Shared {
    /// Mirror of `Inner::state` so the closed fast path needs no lock.
    state: AtomicU8,
    /// Statements holding a ticket (all priorities); feeds the in-flight trigger.
    in_flight: AtomicU32,
    /// Current error streak while closed.
    consecutive: AtomicU32,
    /// Outstanding half-open trial tickets; incremented under the lock, released lock-free.
    probes: AtomicU32,
    /// Outstanding critical tickets taken while not closed (the reserve in use).
    critical: AtomicU32,
    /// Mirrors of the config values the fast paths read (thresholds: 0 = disabled).
    inflight_threshold: AtomicU32,
    error_threshold: AtomicU32,
    critical_reserve: AtomicU32,
    /// Statements shed by the in-flight threshold.
    inflight_sheds: AtomicU64,
    inner: Mutex<Inner>,
    observer: RwLock<Option<TransitionObserver>>,
}

struct Inner {
    config: BreakerSettings,
    state: BreakerState,
    reason: Option<TripReason>,
    since: Instant,
    open_until: Instant,
    transitions: u64,
    trips: [u64; 4],
    /// Successes since entering half-open.
    trial_successes: u32,
    last_probe: Option<f64>,
}

/// Proof that the breaker admitted a statement; dropping it ends the statement's in-flight
/// accounting (and frees its half-open trial slot, if it was a trial).
pub struct BreakerTicket {
    shared: Arc<Shared>,
    probe: bool,
    /// Taken from the critical reserve (while not closed).
    reserve: bool,
}

impl BreakerTicket {
    /// True when this statement was admitted as a half-open trial.
    pub fn is_probe(&self) -> bool {
        self.probe
    }
}

impl Drop for BreakerTicket {
    fn drop(&mut self) {
        self.shared.in_flight.fetch_sub(1, Ordering::AcqRel);
        if self.probe {
            self.shared.probes.fetch_sub(1, Ordering::AcqRel);
        }
        if self.reserve {
            self.shared.critical.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl std::fmt::Debug for BreakerTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BreakerTicket")
            .field("probe", &self.probe)
            .finish()
    }
}

impl Breaker {
    pub fn new(config: BreakerSettings, now: Instant) -> Self {
        let shared = Shared {
            state: AtomicU8::new(BreakerState::Closed.to_u8()),
            in_flight: AtomicU32::new(0),
            consecutive: AtomicU32::new(0),
            probes: AtomicU32::new(0),
            critical: AtomicU32::new(0),
            inflight_threshold: AtomicU32::new(config.max_inflight_threshold.unwrap_or(0)),
            error_threshold: AtomicU32::new(config.consecutive_errors),
            critical_reserve: AtomicU32::new(config.critical_reserve.max(1)),
            inflight_sheds: AtomicU64::new(0),
            inner: Mutex::new(Inner {
                config,
                state: BreakerState::Closed,
                reason: None,
                since: now,
                open_until: now,
                transitions: 0,
                trips: [0; 4],
                trial_successes: 0,
                last_probe: None,
            }),
            observer: RwLock::new(None),
        };
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Install the transition callback (replaces any previous one).
    pub fn set_observer(&self, observer: Option<TransitionObserver>) {
        *self.shared.observer.write() = observer;
    }

    /// Hot reload: new thresholds apply from now on; state, streak and counters are kept.
    pub fn set_config(&self, config: BreakerSettings) {
        let mut inner = self.shared.inner.lock();
        self.shared.inflight_threshold.store(
            config.max_inflight_threshold.unwrap_or(0),
            Ordering::Release,
        );
        self.shared
            .error_threshold
            .store(config.consecutive_errors, Ordering::Release);
        self.shared
            .critical_reserve
            .store(config.critical_reserve.max(1), Ordering::Release);
        inner.config = config;
    }

    /// Current settings.
    pub fn config(&self) -> BreakerSettings {
        self.shared.inner.lock().config.clone()
    }

    /// Current state (advancing open → half-open if its time has come).
    pub fn state(&self, now: Instant) -> BreakerState {
        self.locked(now, |_, _| ());
        BreakerState::from_u8(self.shared.state.load(Ordering::Acquire))
    }

    /// Statements currently holding a ticket.
    pub fn in_flight(&self) -> u32 {
        self.shared.in_flight.load(Ordering::Acquire)
    }

    /// Admit a statement of `priority`, or shed it. The ticket must be held until the
    /// statement finishes.
    pub fn allow(&self, priority: Priority, now: Instant) -> Result<BreakerTicket, BreakerRefusal> {
        let s = &self.shared;
        if s.state.load(Ordering::Acquire) == BreakerState::Closed.to_u8() {
            return self.allow_closed(priority);
        }
        self.locked(now, |inner, _| {
            if inner.state == BreakerState::Closed {
                return self.allow_closed(priority);
            }
            if priority == Priority::Critical {
                if s.critical.load(Ordering::Acquire) >= inner.config.critical_reserve.max(1) {
                    return Err(BreakerRefusal {
                        reserve_full: true,
                        ..refusal(inner, inner.state, now)
                    });
                }
                s.critical.fetch_add(1, Ordering::AcqRel);
                s.in_flight.fetch_add(1, Ordering::AcqRel);
                let mut t = self.ticket(false);
                t.reserve = true;
                return Ok(t);
            }
            match inner.state {
                BreakerState::HalfOpen
                    if s.probes.load(Ordering::Acquire) < inner.config.half_open_trials.max(1) =>
                {
                    s.probes.fetch_add(1, Ordering::AcqRel);
                    s.in_flight.fetch_add(1, Ordering::AcqRel);
                    Ok(self.ticket(true))
                }
                state => Err(refusal(inner, state, now)),
            }
        })
    }

    /// Closed: everything is admitted up to the in-flight threshold, critical statements up
    /// to `critical_reserve` beyond it. Lock-free.
    fn allow_closed(&self, priority: Priority) -> Result<BreakerTicket, BreakerRefusal> {
        let s = &self.shared;
        let n = s.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        let threshold = s.inflight_threshold.load(Ordering::Acquire);
        if threshold == 0 || n <= threshold {
            return Ok(self.ticket(false));
        }
        let critical = priority == Priority::Critical;
        if critical && n <= threshold.saturating_add(s.critical_reserve.load(Ordering::Acquire)) {
            return Ok(self.ticket(false));
        }
        s.in_flight.fetch_sub(1, Ordering::AcqRel);
        s.inflight_sheds.fetch_add(1, Ordering::Relaxed);
        Err(BreakerRefusal {
            state: BreakerState::Closed,
            reason: Some(TripReason::Inflight),
            retry_after: Duration::ZERO,
            reserve_full: critical,
        })
    }

    /// Would `allow` shed this priority right now? Used to fail fast instead of queueing for a
    /// caller slot only to be shed afterwards. Ignores the in-flight trigger (that needs the
    /// statement to actually be admitted).
    pub fn would_shed(&self, priority: Priority, now: Instant) -> Option<BreakerRefusal> {
        if priority == Priority::Critical
            || self.shared.state.load(Ordering::Acquire) == BreakerState::Closed.to_u8()
        {
            return None;
        }
        let probes = &self.shared.probes;
        self.locked(now, |inner, _| match inner.state {
            BreakerState::Closed => None,
            BreakerState::HalfOpen
                if probes.load(Ordering::Acquire) < inner.config.half_open_trials.max(1) =>
            {
                None
            }
            state => Some(refusal(inner, state, now)),
        })
    }

    /// A statement reached the backend and it answered (errors the client caused count as
    /// success here: the database is alive). Resets the streak; closes a half-open breaker.
    pub fn on_success(&self, now: Instant) {
        let s = &self.shared;
        if s.state.load(Ordering::Acquire) == BreakerState::Closed.to_u8() {
            // Load first: under steady success the shared cache line is only read.
            if s.consecutive.load(Ordering::Relaxed) != 0 {
                s.consecutive.store(0, Ordering::Release);
            }
            return;
        }
        self.locked(now, |inner, out| {
            if inner.state == BreakerState::HalfOpen {
                inner.trial_successes = inner.trial_successes.saturating_add(1);
                if inner.trial_successes < inner.config.half_open_trials.max(1) {
                    return;
                }
                self.set_state(
                    inner,
                    BreakerState::HalfOpen,
                    BreakerState::Closed,
                    None,
                    now,
                    out,
                );
                inner.reason = None;
                s.consecutive.store(0, Ordering::Release);
            }
        });
    }

    /// A backend error or timeout. Trips after the configured streak; reopens a half-open
    /// breaker at once.
    pub fn on_failure(&self, now: Instant) {
        let s = &self.shared;
        if s.state.load(Ordering::Acquire) == BreakerState::Closed.to_u8() {
            let threshold = s.error_threshold.load(Ordering::Acquire);
            if threshold == 0 {
                return;
            }
            let n = s.consecutive.fetch_add(1, Ordering::AcqRel) + 1;
            if n < threshold {
                return;
            }
        }
        self.locked(now, |inner, out| match inner.state {
            BreakerState::Closed => {
                let threshold = s.error_threshold.load(Ordering::Acquire);
                if threshold != 0 && s.consecutive.load(Ordering::Acquire) >= threshold {
                    self.trip(inner, TripReason::ConsecutiveErrors, now, out);
                }
            }
            BreakerState::HalfOpen => self.trip(inner, TripReason::TrialFailed, now, out),
            BreakerState::Open => {}
        });
    }

    /// A health-probe reading. At or above the threshold it trips a closed or half-open
    /// breaker and keeps an open one open for another full `open` period. NaN is ignored.
    pub fn on_probe(&self, value: f64, now: Instant) {
        if value.is_nan() {
            return;
        }
        self.locked(now, |inner, out| {
            inner.last_probe = Some(value);
            let Some(threshold) = inner.config.db_cpu_threshold_percent else {
                return;
            };
            if value < threshold {
                return;
            }
            match inner.state {
                BreakerState::Open => {
                    inner.open_until = open_until(now, inner.config.open);
                    inner.reason = Some(TripReason::Probe);
                }
                _ => self.trip(inner, TripReason::Probe, now, out),
            }
        });
    }

    /// Snapshot for the admin API.
    pub fn snapshot(&self, now: Instant) -> BreakerSnapshot {
        let s = &self.shared;
        self.locked(now, |inner, _| BreakerSnapshot {
            state: inner.state,
            reason: inner.reason,
            since_ms: millis(now.saturating_duration_since(inner.since)),
            open_remaining_ms: (inner.state == BreakerState::Open)
                .then(|| millis(inner.open_until.saturating_duration_since(now))),
            transitions: inner.transitions,
            trips: TripCounts {
                consecutive_errors: inner.trips[TripReason::ConsecutiveErrors.index()],
                probe: inner.trips[TripReason::Probe.index()],
                trial_failed: inner.trips[TripReason::TrialFailed.index()],
            },
            consecutive_errors: s.consecutive.load(Ordering::Acquire),
            in_flight: s.in_flight.load(Ordering::Acquire),
            inflight_sheds: s.inflight_sheds.load(Ordering::Relaxed),
            half_open_probes: s.probes.load(Ordering::Acquire),
            half_open_successes: inner.trial_successes,
            last_probe_value: inner.last_probe,
            config: inner.config.clone(),
        })
    }

    fn ticket(&self, probe: bool) -> BreakerTicket {
        BreakerTicket {
            shared: Arc::clone(&self.shared),
            probe,
            reserve: false,
        }
    }

    /// Run `f` under the lock after applying the time-driven open → half-open step, then
    /// report the transitions it produced once the lock is released.
    fn locked<R>(&self, now: Instant, f: impl FnOnce(&mut Inner, &mut Vec<Transition>) -> R) -> R {
        let mut out = Vec::new();
        let result = {
            let mut inner = self.shared.inner.lock();
            if inner.state == BreakerState::Open && now >= inner.open_until {
                self.set_state(
                    &mut inner,
                    BreakerState::Open,
                    BreakerState::HalfOpen,
                    None,
                    now,
                    &mut out,
                );
            }
            f(&mut inner, &mut out)
        };
        if !out.is_empty()
            && let Some(observer) = self.shared.observer.read().clone()
        {
            for t in &out {
                observer(t);
            }
        }
        result
    }

    fn trip(&self, inner: &mut Inner, reason: TripReason, now: Instant, out: &mut Vec<Transition>) {
        let from = inner.state;
        self.set_state(inner, from, BreakerState::Open, Some(reason), now, out);
        inner.reason = Some(reason);
        inner.open_until = open_until(now, inner.config.open);
        inner.trips[reason.index()] += 1;
        self.shared.consecutive.store(0, Ordering::Release);
    }

    fn set_state(
        &self,
        inner: &mut Inner,
        from: BreakerState,
        to: BreakerState,
        reason: Option<TripReason>,
        now: Instant,
        out: &mut Vec<Transition>,
    ) {
        inner.state = to;
        inner.since = now;
        inner.trial_successes = 0;
        inner.transitions += 1;
        self.shared.state.store(to.to_u8(), Ordering::Release);
        out.push(Transition {
            from,
            to,
            reason,
            at: now,
        });
    }
}

fn refusal(inner: &Inner, state: BreakerState, now: Instant) -> BreakerRefusal {
    BreakerRefusal {
        state,
        reserve_full: false,
        reason: inner.reason,
        retry_after: match state {
            BreakerState::Open => inner.open_until.saturating_duration_since(now),
            _ => Duration::ZERO,
        },
    }
}

/// `now + open`, saturating far in the future instead of panicking on absurd durations.
fn open_until(now: Instant, open: Duration) -> Instant {
    now.checked_add(open)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> BreakerSettings {
        BreakerSettings {
            consecutive_errors: 3,
            max_inflight_threshold: Some(4),
            db_cpu_threshold_percent: Some(85.0),
            open: Duration::from_secs(5),
            half_open_trials: 2,
            critical_reserve: 20,
        }
    }

    fn recording(b: &Breaker) -> Arc<Mutex<Vec<Transition>>> {
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&log);
        b.set_observer(Some(Arc::new(move |t: &Transition| {
            sink.lock().push(t.clone())
        })));
        log
    }

    fn states(log: &Mutex<Vec<Transition>>) -> Vec<(BreakerState, Option<TripReason>)> {
        log.lock().iter().map(|t| (t.to, t.reason)).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn error_streak_trips_and_success_resets_it() {
        let b = Breaker::new(config(), Instant::now());
        let log = recording(&b);
        let now = Instant::now();
        b.on_failure(now);
        b.on_failure(now);
        b.on_success(now);
        b.on_failure(now);
        b.on_failure(now);
        assert_eq!(b.state(now), BreakerState::Closed);
        b.on_failure(now);
        assert_eq!(b.state(now), BreakerState::Open);
        assert_eq!(
            states(&log),
            vec![(BreakerState::Open, Some(TripReason::ConsecutiveErrors))]
        );
        let snap = b.snapshot(now);
        assert_eq!(snap.reason, Some(TripReason::ConsecutiveErrors));
        assert_eq!(snap.trips.consecutive_errors, 1);
        assert_eq!(snap.open_remaining_ms, Some(5000));
    }

    /// Open: critical traffic is admitted up to the reserve and no further; a ticket handed
    /// back makes room again; closed, the reserve does not apply.
    #[tokio::test(start_paused = true)]
    async fn critical_traffic_is_bounded_by_the_reserve_while_open() {
        let b = Breaker::new(
            BreakerSettings {
                critical_reserve: 2,
                ..config()
            },
            Instant::now(),
        );
        let now = Instant::now();
        let closed: Vec<_> = (0..5)
            .map(|_| {
                b.allow(Priority::Critical, now)
                    .expect("closed: no reserve")
            })
            .collect();
        drop(closed);
        for _ in 0..3 {
            b.on_failure(now);
        }
        assert_eq!(b.state(now), BreakerState::Open);
        let first = b
            .allow(Priority::Critical, now)
            .expect("first of the reserve");
        let second = b
            .allow(Priority::Critical, now)
            .expect("second of the reserve");
        let r = b.allow(Priority::Critical, now).unwrap_err();
        assert!(r.reserve_full && r.state == BreakerState::Open, "{r:?}");
        drop(first);
        let third = b.allow(Priority::Critical, now).expect("room again");
        drop((second, third));
    }

    #[tokio::test(start_paused = true)]
    async fn open_sheds_non_critical_admits_critical_then_half_open_trickle() {
        let b = Breaker::new(config(), Instant::now());
        let log = recording(&b);
        for _ in 0..3 {
            b.on_failure(Instant::now());
        }
        let now = Instant::now();
        for p in [Priority::High, Priority::Normal, Priority::Low] {
            let r = b.allow(p, now).unwrap_err();
            assert_eq!(r.state, BreakerState::Open);
            assert_eq!(r.retry_after, Duration::from_secs(5));
            assert!(b.would_shed(p, now).is_some());
        }
        let critical = b.allow(Priority::Critical, now).unwrap();
        assert!(!critical.is_probe());
        assert!(b.would_shed(Priority::Critical, now).is_none());

        tokio::time::advance(Duration::from_millis(4999)).await;
        assert!(b.allow(Priority::Low, Instant::now()).is_err());
        tokio::time::advance(Duration::from_millis(1)).await;
        let now = Instant::now();
        assert_eq!(b.state(now), BreakerState::HalfOpen);
        // At most two trials at once.
        let t1 = b.allow(Priority::Low, now).unwrap();
        let t2 = b.allow(Priority::Normal, now).unwrap();
        assert!(t1.is_probe() && t2.is_probe());
        let r = b.allow(Priority::Normal, now).unwrap_err();
        assert_eq!(r.state, BreakerState::HalfOpen);
        assert!(b.would_shed(Priority::Normal, now).is_some());
        drop(t1);
        let t3 = b.allow(Priority::Normal, now).unwrap();
        assert!(t3.is_probe());
        // Two trials succeed (half_open_trials = 2): closed, everything flows.
        b.on_success(now);
        assert_eq!(b.state(now), BreakerState::HalfOpen, "one success of two");
        assert_eq!(b.snapshot(now).half_open_successes, 1);
        b.on_success(now);
        assert_eq!(b.state(now), BreakerState::Closed);
        assert!(!b.allow(Priority::Low, now).unwrap().is_probe());
        drop((t2, t3, critical));
        assert_eq!(b.in_flight(), 0);
        assert_eq!(b.snapshot(now).half_open_probes, 0);
        assert_eq!(
            states(&log),
            vec![
                (BreakerState::Open, Some(TripReason::ConsecutiveErrors)),
                (BreakerState::HalfOpen, None),
                (BreakerState::Closed, None),
            ]
        );
        assert_eq!(b.snapshot(now).transitions, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn half_open_failure_reopens() {
        let b = Breaker::new(config(), Instant::now());
        for _ in 0..3 {
            b.on_failure(Instant::now());
        }
        tokio::time::advance(Duration::from_secs(5)).await;
        let now = Instant::now();
        let _trial = b.allow(Priority::Normal, now).unwrap();
        b.on_failure(now);
        assert_eq!(b.state(now), BreakerState::Open);
        let snap = b.snapshot(now);
        assert_eq!(snap.reason, Some(TripReason::TrialFailed));
        assert_eq!(snap.open_remaining_ms, Some(5000));
    }

    /// Over the in-flight threshold non-critical statements are shed and critical ones get
    /// `critical_reserve` more; the breaker never opens, and once the count drops everything
    /// flows again with no open period.
    #[tokio::test(start_paused = true)]
    async fn inflight_above_threshold_sheds_without_opening() {
        let b = Breaker::new(
            BreakerSettings {
                critical_reserve: 2,
                ..config()
            },
            Instant::now(),
        );
        let log = recording(&b);
        let now = Instant::now();
        let mut held: Vec<_> = (0..4)
            .map(|_| b.allow(Priority::Normal, now).unwrap())
            .collect();
        for p in [Priority::High, Priority::Normal, Priority::Low] {
            let r = b.allow(p, now).unwrap_err();
            assert_eq!(
                (r.state, r.reason, r.reserve_full),
                (BreakerState::Closed, Some(TripReason::Inflight), false)
            );
        }
        let c1 = b.allow(Priority::Critical, now).expect("critical: reserve");
        let c2 = b.allow(Priority::Critical, now).expect("critical: reserve");
        let r = b.allow(Priority::Critical, now).unwrap_err();
        assert!(r.reserve_full, "{r:?}");
        assert_eq!(b.state(now), BreakerState::Closed);
        assert_eq!(b.in_flight(), 6);
        let snap = b.snapshot(now);
        assert_eq!((snap.inflight_sheds, snap.transitions), (4, 0));
        drop((c1, c2));
        held.pop();
        // Below the threshold again: admitted at once, no open period.
        let again = b.allow(Priority::Low, now).expect("room again");
        assert!(states(&log).is_empty(), "never opened");
        drop((held, again));
        assert_eq!(b.in_flight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn probe_trips_and_keeps_it_open() {
        let b = Breaker::new(config(), Instant::now());
        let log = recording(&b);
        b.on_probe(50.0, Instant::now());
        b.on_probe(f64::NAN, Instant::now());
        assert_eq!(b.state(Instant::now()), BreakerState::Closed);
        b.on_probe(85.0, Instant::now());
        assert_eq!(b.state(Instant::now()), BreakerState::Open);
        tokio::time::advance(Duration::from_secs(4)).await;
        // Still hot: the open period restarts.
        b.on_probe(90.0, Instant::now());
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(b.state(Instant::now()), BreakerState::Open);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(b.state(Instant::now()), BreakerState::HalfOpen);
        // Hot again while half-open: reopen.
        b.on_probe(99.0, Instant::now());
        assert_eq!(b.state(Instant::now()), BreakerState::Open);
        assert_eq!(
            states(&log),
            vec![
                (BreakerState::Open, Some(TripReason::Probe)),
                (BreakerState::HalfOpen, None),
                (BreakerState::Open, Some(TripReason::Probe)),
            ]
        );
        assert_eq!(b.snapshot(Instant::now()).last_probe_value, Some(99.0));
    }

    #[tokio::test(start_paused = true)]
    async fn disabled_triggers_and_reconfigure() {
        let b = Breaker::new(
            BreakerSettings {
                consecutive_errors: 0,
                max_inflight_threshold: None,
                db_cpu_threshold_percent: None,
                ..BreakerSettings::default()
            },
            Instant::now(),
        );
        let now = Instant::now();
        for _ in 0..100 {
            b.on_failure(now);
        }
        b.on_probe(100.0, now);
        let held: Vec<_> = (0..100)
            .map(|_| b.allow(Priority::Low, now).unwrap())
            .collect();
        assert_eq!(b.state(now), BreakerState::Closed);
        b.set_config(BreakerSettings {
            consecutive_errors: 2,
            ..BreakerSettings::default()
        });
        b.on_failure(now);
        b.on_failure(now);
        assert_eq!(b.state(now), BreakerState::Open);
        drop(held);
    }
}
