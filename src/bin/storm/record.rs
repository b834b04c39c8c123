//! The run's measurements: per-caller counters and latency histograms, refusals and errors by
//! reason, and a time series in fixed slots (default 100 ms) of arrivals, admitted statements,
//! refusals, errors, latency and the backend connections the monitor saw.
//!
//! Definitions used everywhere (report, CSV, chart):
//! * an *arrival* is one attempt to do work: a connection attempt or a statement attempt
//!   (retries included), counted in the slot where it starts;
//! * *admitted* is a statement that completed successfully, *refused* one refused by the proxy
//!   with an `ERR_…` code, *errors* everything else that failed (connects included: a
//!   "too many clients" from Postgres is an error here), each counted where it completes;
//! * latency is measured for successful statements only, from the moment the statement was
//!   due (paced callers) or started (closed-loop callers) to its ReadyForQuery;
//! * login time is measured for successful logins, from the TCP connect to ReadyForQuery;
//! * a *session* (incident scenario) is one storm client's whole unit of work (log in, the
//!   transaction, disconnect), counted once, where its last attempt succeeds.
//!
//! One mutex guards it all: at the few tens of thousands of events per second this tool
//! generates on two cores, that is far below the cost of the queries it measures.

use std::collections::BTreeMap;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::client::Failure;
use super::hist::Histogram;

/// One time-series slot.
#[derive(Debug, Clone, Default)]
pub struct Slot {
    pub arrivals: u64,
    pub admitted: u64,
    pub refused: u64,
    pub errors: u64,
    /// Latency of every admitted statement completing in this slot.
    pub latency: Histogram,
    /// Latency of the critical caller only.
    pub critical: Histogram,
    /// Login time of every successful login completing in this slot.
    pub login: Histogram,
    /// Storm sessions completed in this slot.
    pub sessions: u64,
    /// Last monitor reading in this slot.
    pub backends: Option<u64>,
}

/// Totals for one caller label (e.g. `billing calm`).
#[derive(Debug, Clone, Default)]
pub struct CallerStats {
    pub ok: u64,
    pub refused: u64,
    pub errors: u64,
    pub connects: u64,
    pub connect_failures: u64,
    pub latency: Histogram,
    /// Time of the successful logins.
    pub login: Histogram,
    /// First and last successful completion, for throughput over the active period.
    pub first_ok: Option<Instant>,
    pub last_ok: Option<Instant>,
    /// When the label saw its first attempt (throughput is counted from there).
    pub first_seen: Option<Instant>,
}

/// Refusal or error key: (caller, "refused"/"error", reason text).
pub type ReasonKey = (String, &'static str, String);

#[derive(Default)]
struct Inner {
    slots: Vec<Slot>,
    callers: BTreeMap<String, CallerStats>,
    reasons: BTreeMap<ReasonKey, u64>,
    max_backends: Option<u64>,
    backend_samples: u64,
}

pub struct Recorder {
    start: Instant,
    slot: Duration,
    inner: Mutex<Inner>,
}

/// What the report needs, copied out at the end.
pub struct Snapshot {
    pub slot: Duration,
    pub slots: Vec<Slot>,
    pub callers: BTreeMap<String, CallerStats>,
    pub reasons: BTreeMap<ReasonKey, u64>,
    pub max_backends: Option<u64>,
    pub backend_samples: u64,
    pub elapsed: Duration,
}

impl Inner {
    fn slot(&mut self, i: usize) -> &mut Slot {
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, Slot::default);
        }
        &mut self.slots[i]
    }

    fn caller(&mut self, name: &str, now: Instant) -> &mut CallerStats {
        self.callers
            .entry(name.to_owned())
            .or_insert_with(|| CallerStats {
                first_seen: Some(now),
                ..CallerStats::default()
            })
    }

    fn failure(&mut self, i: usize, caller: &str, f: &Failure, now: Instant) {
        let (kind, reason) = match f {
            Failure::Refused { reason, .. } => ("refused", reason),
            Failure::Error { reason, .. } => ("error", reason),
        };
        *self
            .reasons
            .entry((caller.to_owned(), kind, reason.clone()))
            .or_insert(0) += 1;
        let refused = matches!(f, Failure::Refused { .. });
        let slot = self.slot(i);
        if refused {
            slot.refused += 1;
        } else {
            slot.errors += 1;
        }
        let c = self.caller(caller, now);
        if refused {
            c.refused += 1;
        } else {
            c.errors += 1;
        }
    }
}

impl Recorder {
    pub fn new(slot: Duration) -> Self {
        Self {
            start: Instant::now(),
            slot: slot.max(Duration::from_millis(10)),
            inner: Mutex::new(Inner::default()),
        }
    }

    pub fn start(&self) -> Instant {
        self.start
    }

    fn index(&self, t: Instant) -> usize {
        let d = t.saturating_duration_since(self.start);
        (d.as_micros() / self.slot.as_micros().max(1)) as usize
    }

    /// An attempt (connect or statement) starts now.
    pub fn arrival(&self) {
        let i = self.index(Instant::now());
        self.inner.lock().slot(i).arrivals += 1;
    }

    /// A statement that was due at `due` has finished now.
    pub fn statement(&self, caller: &str, critical: bool, due: Instant, r: Result<(), &Failure>) {
        let now = Instant::now();
        let i = self.index(now);
        let mut g = self.inner.lock();
        match r {
            Ok(()) => {
                let us = now.saturating_duration_since(due).as_micros() as u64;
                let slot = g.slot(i);
                slot.admitted += 1;
                slot.latency.record(us);
                if critical {
                    slot.critical.record(us);
                }
                let c = g.caller(caller, now);
                c.ok += 1;
                c.latency.record(us);
                c.first_ok.get_or_insert(now);
                c.last_ok = Some(now);
            }
            Err(f) => g.failure(i, caller, f, now),
        }
    }

    /// A connection attempt begun at `began` has finished now.
    pub fn connect(&self, caller: &str, began: Instant, r: Result<(), &Failure>) {
        let now = Instant::now();
        let i = self.index(now);
        let mut g = self.inner.lock();
        match r {
            Ok(()) => {
                let us = now.saturating_duration_since(began).as_micros() as u64;
                g.slot(i).login.record(us);
                let c = g.caller(caller, now);
                c.connects += 1;
                c.login.record(us);
            }
            Err(f) => {
                g.failure(i, caller, f, now);
                g.caller(caller, now).connect_failures += 1;
            }
        }
    }

    /// A storm session has completed now.
    pub fn session_done(&self) {
        let i = self.index(Instant::now());
        self.inner.lock().slot(i).sessions += 1;
    }

    /// A monitor reading: client backends on the database right now.
    pub fn backends(&self, n: u64) {
        let i = self.index(Instant::now());
        let mut g = self.inner.lock();
        g.slot(i).backends = Some(n);
        g.max_backends = Some(g.max_backends.map_or(n, |m| m.max(n)));
        g.backend_samples += 1;
    }

    /// Sums over the slots that start within `[from, to)`, for the progress line.
    pub fn window(&self, from: Instant, to: Instant) -> (Slot, Option<u64>) {
        let (a, b) = (self.index(from), self.index(to));
        let g = self.inner.lock();
        let mut sum = Slot::default();
        for s in g.slots.iter().take(b).skip(a) {
            sum.arrivals += s.arrivals;
            sum.admitted += s.admitted;
            sum.refused += s.refused;
            sum.errors += s.errors;
            sum.latency.merge(&s.latency);
            sum.critical.merge(&s.critical);
            sum.login.merge(&s.login);
            sum.sessions += s.sessions;
            if s.backends.is_some() {
                sum.backends = s.backends;
            }
        }
        (sum, g.max_backends)
    }

    pub fn snapshot(&self) -> Snapshot {
        let g = self.inner.lock();
        Snapshot {
            slot: self.slot,
            slots: g.slots.clone(),
            callers: g.callers.clone(),
            reasons: g.reasons.clone(),
            max_backends: g.max_backends,
            backend_samples: g.backend_samples,
            elapsed: self.start.elapsed(),
        }
    }
}
