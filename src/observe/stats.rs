//! Per-fingerprint statistics: the proxy's own `pg_stat_statements`.
//!
//! Owns: counting calls, errors, refusals (by reason), rows and client-observed time per
//! fingerprint, with a latency histogram for p50/p95/p99, the current call rate, lock-wait
//! evidence (55P03 and 57014 counts, time of the statements that ended in 55P03) and a
//! per-caller breakdown, in bounded memory. It takes the fingerprint as a `u64` and formats the hex itself; it imports
//! no other pgsluice module, does no I/O and never holds a lock across an `.await` (the API is
//! synchronous; each call takes one short shard lock).
//!
//! Bounded memory — space-saving top-K with an "other" row:
//! - At most `capacity` fingerprints are tracked (split evenly over up to 16 shards by
//!   fingerprint, each a `parking_lot::Mutex`), plus one aggregate "other" row.
//! - Every entry has an eviction *priority*: its client-observed time in µs (at least 1 per
//!   call, so cheap-but-frequent and refused statements count too) plus the priority it
//!   inherited. When a new fingerprint arrives at a full shard, the entry with the lowest
//!   priority is evicted, its statistics are merged into "other" (so totals are conserved),
//!   and the newcomer inherits the evicted priority. This is the space-saving algorithm:
//!   any fingerprint whose true weight exceeds total/K is guaranteed to stay tracked, and a
//!   newcomer is not immediately evicted by the next one-off statement. Reported numbers are
//!   always the entry's own (counted since it was admitted), never the inherited priority.
//! - The minimum is found through a lazy min-heap (priorities only grow, so stale heap items
//!   are refreshed when popped): O(log K) amortized per eviction.
//! - Per entry, at most `MAX_CALLERS` callers and `MAX_REASONS` refusal reasons are kept
//!   apart; the rest are summed under "other".
//!
//! Times: `elapsed` is what the client waited through the proxy (queue wait included), for
//! every outcome, refusals included. The histogram has 4 log-spaced buckets per doubling from
//! 1 µs to ~67 s (longer times land in the last bucket); a quantile is the geometric middle of
//! its bucket clamped to the observed min/max, so it is within ~9% of the true value.
//!
//! Current rate (`qps`): calls per second over the last [`RATE_WINDOW_MS`], estimated from two
//! fixed windows aligned to multiples of it on the wall clock — the previous window's count,
//! weighted by the share of it the sliding window still covers, plus the current one's (the
//! sliding-window estimate of rate limiters). Recording is O(1): one division and two
//! additions, with the timestamp the record already takes. An entry younger than the window is
//! divided by its age, so a pattern that just appeared shows its real rate at once. Each
//! caller of a row keeps its own rate the same way (`by_caller[..].qps`), so what one caller
//! sends now is known apart from the row's lifetime mix of callers.
//!
//! Lock-wait evidence: 55P03 (`lock_not_available`: a `lock_timeout` expired or `NOWAIT` found
//! the lock taken) and 57014 that the client did not ask for (`statement_timeout`, the proxy's
//! backstop cancel, `pg_cancel_backend` by someone else) are counted apart from other errors
//! (and in `errors` too), and the time of the statements that ended in 55P03 is summed: for a
//! `lock_timeout` that is about the time spent waiting for the lock. Statistics are kept per
//! client request, so when one request carries several statements (a pipeline, a
//! multi-statement Query) and fails, each of them is counted with that outcome.

use foldhash::HashMap;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

/// Default number of tracked fingerprints.
pub const DEFAULT_CAPACITY: usize = 1000;
/// Callers kept apart per fingerprint; the rest are summed under `OTHER`.
pub const MAX_CALLERS: usize = 64;
/// Refusal reasons kept apart per fingerprint; the rest are summed under `OTHER`.
pub const MAX_REASONS: usize = 32;
/// Name of the aggregate row / bucket.
pub const OTHER: &str = "other";

const MAX_SHARDS: usize = 16;
const SUB_BUCKETS: u32 = 4;
const BUCKETS: usize = 26 * SUB_BUCKETS as usize;
/// The span `qps` is measured over.
pub const RATE_WINDOW_MS: u64 = 10_000;

/// How a statement ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok {
        rows: u64,
    },
    /// Postgres answered with an error other than the two below.
    Error,
    /// 55P03 `lock_not_available`: `lock_timeout` expired, or `NOWAIT` found the lock taken.
    LockNotAvailable,
    /// 57014 `query_canceled` the client did not ask for: `statement_timeout`, the proxy's
    /// backstop cancel, or a cancel by someone else.
    StatementTimeout,
    Refused(&'static str),
}

impl Outcome {
    /// The outcome of a statement that Postgres answered with an ErrorResponse of `sqlstate`;
    /// `client_cancel`: the client had sent a CancelRequest, so a 57014 is its own doing.
    pub fn of_error(sqlstate: Option<&str>, client_cancel: bool) -> Outcome {
        match sqlstate {
            Some("55P03") => Outcome::LockNotAvailable,
            Some("57014") if !client_cancel => Outcome::StatementTimeout,
            _ => Outcome::Error,
        }
    }
}

/// Ordering for `FingerprintStats::top`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SortKey {
    TotalTime,
    Calls,
    Errors,
    Refusals,
    /// Current rate (`qps`).
    Qps,
}

/// An unknown `sort=` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownSortKey(pub String);

impl fmt::Display for UnknownSortKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown sort key `{}`: expected one of total_time, calls, errors, refusals, qps",
            self.0
        )
    }
}

impl std::error::Error for UnknownSortKey {}

impl FromStr for SortKey {
    type Err = UnknownSortKey;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "total_time" => Ok(SortKey::TotalTime),
            "calls" => Ok(SortKey::Calls),
            "errors" => Ok(SortKey::Errors),
            "refusals" => Ok(SortKey::Refusals),
            "qps" => Ok(SortKey::Qps),
            other => Err(UnknownSortKey(other.to_owned())),
        }
    }
}

/// Per-caller share of one fingerprint.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct CallerBreakdown {
    pub calls: u64,
    /// This caller's calls per second of the pattern over the last [`RATE_WINDOW_MS`].
    pub qps: f64,
    pub errors: u64,
    pub refusals: u64,
    pub total_ms: f64,
}

/// One row of the top-K table; `fingerprint` is 16 hex digits, or `"other"` for the
/// aggregate of everything not tracked.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct FingerprintSnapshot {
    pub fingerprint: String,
    pub normalized: String,
    pub kind: String,
    pub calls: u64,
    /// Calls per second over the last [`RATE_WINDOW_MS`] (refused ones included, like `calls`).
    pub qps: f64,
    pub errors: u64,
    /// 55P03 errors (also counted in `errors`).
    pub lock_not_available: u64,
    /// Total time of the statements that ended in 55P03.
    pub lock_wait_ms: f64,
    /// 57014 errors the client did not ask for (also counted in `errors`).
    pub statement_timeouts: u64,
    pub refusals: u64,
    pub refusals_by_reason: BTreeMap<String, u64>,
    pub rows: u64,
    pub total_ms: f64,
    pub mean_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub first_seen_unix_ms: u64,
    pub last_seen_unix_ms: u64,
    pub by_caller: BTreeMap<String, CallerBreakdown>,
}

fn bucket(us: u64) -> usize {
    let v = us.max(1);
    let e = 63 - v.leading_zeros();
    let sub = if e >= 2 {
        (v >> (e - 2)) & 3
    } else {
        (v << (2 - e)) & 3
    };
    // `e * 4 + sub` ≤ 255; clamp to the last bucket.
    ((e * SUB_BUCKETS) as usize + sub as usize).min(BUCKETS - 1)
}

/// Lower bound of bucket `i` in µs.
fn bucket_floor_us(i: usize) -> f64 {
    let e = i / SUB_BUCKETS as usize;
    let sub = i % SUB_BUCKETS as usize;
    (4 + sub) as f64 * 2f64.powi(e as i32) / 4.0
}

#[derive(Debug, Clone)]
struct CallerAgg {
    calls: u64,
    /// The caller's own current rate, so that a preview of a rule limited to some callers
    /// (`admin::preview`) sees what those callers send now, not a share of the lifetime mix.
    rate: Rate,
    /// When this caller's entry was made (its rate is divided by its age while younger than
    /// the window, as the row's is).
    first_ms: u64,
    errors: u64,
    refusals: u64,
    total_ns: u64,
}

impl CallerAgg {
    fn new(now_ms: u64) -> Self {
        CallerAgg {
            calls: 0,
            rate: Rate::default(),
            first_ms: now_ms,
            errors: 0,
            refusals: 0,
            total_ns: 0,
        }
    }

    fn add(&mut self, o: &CallerAgg, now_ms: u64) {
        self.calls += o.calls;
        self.rate.merge(&o.rate, now_ms);
        self.first_ms = self.first_ms.min(o.first_ms);
        self.errors += o.errors;
        self.refusals += o.refusals;
        self.total_ns = self.total_ns.saturating_add(o.total_ns);
    }

    fn breakdown(&self, now_ms: u64) -> CallerBreakdown {
        CallerBreakdown {
            calls: self.calls,
            qps: self.rate.per_second(now_ms, self.first_ms),
            errors: self.errors,
            refusals: self.refusals,
            total_ms: ns_to_ms(self.total_ns),
        }
    }
}

fn ns_to_ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// Calls in the current and the previous [`RATE_WINDOW_MS`] window (see the module doc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Rate {
    /// Start of the current window, unix ms, a multiple of the window.
    start_ms: u64,
    current: u64,
    previous: u64,
}

impl Rate {
    /// Moves to the window of `now_ms`. A clock that went back keeps the current window.
    fn roll(&mut self, now_ms: u64) {
        let start = now_ms - now_ms % RATE_WINDOW_MS;
        if start <= self.start_ms {
            return;
        }
        self.previous = if start - self.start_ms == RATE_WINDOW_MS {
            self.current
        } else {
            0
        };
        self.current = 0;
        self.start_ms = start;
    }

    fn add(&mut self, now_ms: u64) {
        self.roll(now_ms);
        self.current += 1;
    }

    fn merge(&mut self, o: &Rate, now_ms: u64) {
        let mut o = *o;
        o.roll(now_ms);
        self.roll(now_ms);
        self.current += o.current;
        self.previous += o.previous;
    }

    /// Calls per second over the last window, or over the time since `first_ms` when that
    /// is shorter (at least a second).
    fn per_second(&self, now_ms: u64, first_ms: u64) -> f64 {
        let mut r = *self;
        r.roll(now_ms);
        // What the estimate covers: the sliding window, or the counting's life if shorter.
        let from = now_ms.saturating_sub(RATE_WINDOW_MS).max(first_ms);
        // How long the previous window counted, and how much of that lies after `from`.
        let prev_start = r.start_ms.saturating_sub(RATE_WINDOW_MS);
        let counted = r.start_ms.saturating_sub(prev_start.max(first_ms));
        let covered = r.start_ms.saturating_sub(from).min(counted);
        let previous = if counted == 0 {
            0.0
        } else {
            r.previous as f64 * covered as f64 / counted as f64
        };
        let span_ms = now_ms.saturating_sub(from).max(1000);
        (previous + r.current as f64) * 1000.0 / span_ms as f64
    }
}

/// Statistics of one fingerprint (or of "other").
#[derive(Debug, Clone)]
struct Agg {
    calls: u64,
    rate: Rate,
    errors: u64,
    lock_not_available: u64,
    lock_wait_ns: u64,
    statement_timeouts: u64,
    refusals: u64,
    reasons: Vec<(&'static str, u64)>,
    rows: u64,
    total_ns: u64,
    min_ns: u64,
    max_ns: u64,
    hist: Box<[u64; BUCKETS]>,
    first_ms: u64,
    last_ms: u64,
    callers: Vec<(Arc<str>, CallerAgg)>,
}

impl Agg {
    fn new(now_ms: u64) -> Self {
        Agg {
            calls: 0,
            rate: Rate::default(),
            errors: 0,
            lock_not_available: 0,
            lock_wait_ns: 0,
            statement_timeouts: 0,
            refusals: 0,
            reasons: Vec::new(),
            rows: 0,
            total_ns: 0,
            min_ns: u64::MAX,
            max_ns: 0,
            hist: Box::new([0; BUCKETS]),
            first_ms: now_ms,
            last_ms: now_ms,
            callers: Vec::new(),
        }
    }

    /// The entry of caller `name`. The matcher hands out one shared name per caller, and an
    /// entry holds a clone of it: while the entry lives that address holds that name, so an
    /// equal address is the same caller without comparing bytes (a name from another
    /// configuration is compared by its bytes).
    fn caller_mut(&mut self, name: &Arc<str>, now_ms: u64) -> &mut CallerAgg {
        let found = match self.callers.iter().position(|(n, _)| Arc::ptr_eq(n, name)) {
            Some(p) => Some(p),
            None => {
                let p = self.callers.iter().position(|(n, _)| **n == **name);
                // Held from now on: the next statement of this configuration's caller takes
                // the first branch.
                if let Some(p) = p {
                    self.callers[p].0 = Arc::clone(name);
                }
                p
            }
        };
        let pos = match found {
            Some(p) => p,
            None if self.callers.len() < MAX_CALLERS => {
                self.callers
                    .push((Arc::clone(name), CallerAgg::new(now_ms)));
                self.callers.len() - 1
            }
            None => match self.callers.iter().position(|(n, _)| &**n == OTHER) {
                Some(p) => p,
                None => {
                    self.callers.push((OTHER.into(), CallerAgg::new(now_ms)));
                    self.callers.len() - 1
                }
            },
        };
        &mut self.callers[pos].1
    }

    fn add_reason(&mut self, reason: &'static str, n: u64) {
        if let Some(r) = self.reasons.iter_mut().find(|(r, _)| *r == reason) {
            r.1 += n;
        } else if self.reasons.len() < MAX_REASONS {
            self.reasons.push((reason, n));
        } else {
            self.add_reason(OTHER, n);
        }
    }

    #[inline(always)]
    fn record(&mut self, caller: &Arc<str>, ns: u64, outcome: Outcome, now_ms: u64) {
        self.calls += 1;
        self.rate.add(now_ms);
        self.total_ns = self.total_ns.saturating_add(ns);
        self.min_ns = self.min_ns.min(ns);
        self.max_ns = self.max_ns.max(ns);
        self.hist[bucket(ns / 1000)] += 1;
        self.first_ms = self.first_ms.min(now_ms);
        self.last_ms = self.last_ms.max(now_ms);
        let c = self.caller_mut(caller, now_ms);
        c.calls += 1;
        c.rate.add(now_ms);
        c.total_ns = c.total_ns.saturating_add(ns);
        match outcome {
            Outcome::Ok { rows } => self.rows = self.rows.saturating_add(rows),
            Outcome::Error | Outcome::LockNotAvailable | Outcome::StatementTimeout => {
                c.errors += 1;
                self.errors += 1;
                if outcome == Outcome::LockNotAvailable {
                    self.lock_not_available += 1;
                    self.lock_wait_ns = self.lock_wait_ns.saturating_add(ns);
                } else if outcome == Outcome::StatementTimeout {
                    self.statement_timeouts += 1;
                }
            }
            Outcome::Refused(reason) => {
                c.refusals += 1;
                self.refusals += 1;
                self.add_reason(reason, 1);
            }
        }
    }

    fn merge(&mut self, o: &Agg, now_ms: u64) {
        self.calls += o.calls;
        self.rate.merge(&o.rate, now_ms);
        self.errors += o.errors;
        self.lock_not_available += o.lock_not_available;
        self.lock_wait_ns = self.lock_wait_ns.saturating_add(o.lock_wait_ns);
        self.statement_timeouts += o.statement_timeouts;
        self.refusals += o.refusals;
        for &(r, n) in &o.reasons {
            self.add_reason(r, n);
        }
        self.rows = self.rows.saturating_add(o.rows);
        self.total_ns = self.total_ns.saturating_add(o.total_ns);
        self.min_ns = self.min_ns.min(o.min_ns);
        self.max_ns = self.max_ns.max(o.max_ns);
        for (a, b) in self.hist.iter_mut().zip(o.hist.iter()) {
            *a += b;
        }
        self.first_ms = self.first_ms.min(o.first_ms);
        self.last_ms = self.last_ms.max(o.last_ms);
        for (name, c) in &o.callers {
            self.caller_mut(name, now_ms).add(c, now_ms);
        }
    }

    fn quantile_ms(&self, q: f64) -> f64 {
        let count: u64 = self.hist.iter().sum();
        if count == 0 {
            return 0.0;
        }
        let rank = ((q * count as f64).ceil() as u64).clamp(1, count);
        let mut seen = 0;
        let mut idx = BUCKETS - 1;
        for (i, n) in self.hist.iter().enumerate() {
            seen += n;
            if seen >= rank {
                idx = i;
                break;
            }
        }
        let mid_us = (bucket_floor_us(idx) * bucket_floor_us(idx + 1)).sqrt();
        let ms = mid_us / 1000.0;
        ms.clamp(
            ns_to_ms(self.min_ns.min(self.max_ns)),
            ns_to_ms(self.max_ns),
        )
    }

    fn sort_value(&self, sort: SortKey, caller: Option<&str>, now_ms: u64) -> Option<u64> {
        let (calls, errors, refusals, total_ns) = match caller {
            None => (self.calls, self.errors, self.refusals, self.total_ns),
            Some(name) => {
                let (_, c) = self.callers.iter().find(|(n, _)| &**n == name)?;
                (c.calls, c.errors, c.refusals, c.total_ns)
            }
        };
        Some(match sort {
            SortKey::TotalTime => total_ns,
            SortKey::Calls => calls,
            SortKey::Errors => errors,
            SortKey::Refusals => refusals,
            // Milli-calls per second: the row's rate, also with a caller (who only filters).
            SortKey::Qps => (self.rate.per_second(now_ms, self.first_ms) * 1000.0) as u64,
        })
    }

    fn snapshot(
        &self,
        fingerprint: String,
        normalized: &str,
        kind: &str,
        now_ms: u64,
    ) -> FingerprintSnapshot {
        let calls = self.calls.max(1) as f64;
        FingerprintSnapshot {
            fingerprint,
            normalized: normalized.to_owned(),
            kind: kind.to_owned(),
            calls: self.calls,
            qps: self.rate.per_second(now_ms, self.first_ms),
            errors: self.errors,
            lock_not_available: self.lock_not_available,
            lock_wait_ms: ns_to_ms(self.lock_wait_ns),
            statement_timeouts: self.statement_timeouts,
            refusals: self.refusals,
            refusals_by_reason: self
                .reasons
                .iter()
                .map(|&(r, n)| (r.to_owned(), n))
                .collect(),
            rows: self.rows,
            total_ms: ns_to_ms(self.total_ns),
            mean_ms: ns_to_ms(self.total_ns) / calls,
            min_ms: if self.calls == 0 {
                0.0
            } else {
                ns_to_ms(self.min_ns)
            },
            max_ms: ns_to_ms(self.max_ns),
            p50_ms: self.quantile_ms(0.50),
            p95_ms: self.quantile_ms(0.95),
            p99_ms: self.quantile_ms(0.99),
            first_seen_unix_ms: self.first_ms,
            last_seen_unix_ms: self.last_ms,
            by_caller: self
                .callers
                .iter()
                .map(|(n, c)| (n.to_string(), c.breakdown(now_ms)))
                .collect(),
        }
    }
}

/// Cumulative counters of one fingerprint or one caller ([`FingerprintStats::counters`]):
/// they only grow while the row is tracked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Statements ended or refused.
    pub calls: u64,
    /// Errors from Postgres, timeouts and 55P03 included.
    pub errors: u64,
    /// Time of the statements that ended in 55P03 (0 per caller: not kept apart there).
    pub lock_wait_ns: u64,
    /// Client-observed time of every call.
    pub total_ns: u64,
}

impl Counters {
    pub fn add(&mut self, o: &Counters) {
        self.calls += o.calls;
        self.errors += o.errors;
        self.lock_wait_ns = self.lock_wait_ns.saturating_add(o.lock_wait_ns);
        self.total_ns = self.total_ns.saturating_add(o.total_ns);
    }
}

/// One tracked fingerprint's [`Counters`], in total and per caller.
#[derive(Debug, Clone)]
pub struct FingerprintCounters {
    pub fingerprint: u64,
    /// When the row was created (unix ms): a row evicted and tracked again starts anew.
    pub first_ms: u64,
    pub normalized: Arc<str>,
    pub kind: &'static str,
    pub counters: Counters,
    pub by_caller: Vec<(Arc<str>, Counters)>,
}

/// What [`FingerprintStats::counters`] returns.
#[derive(Debug, Clone, Default)]
pub struct CounterSnapshot {
    pub fingerprints: Vec<FingerprintCounters>,
    /// The callers' counters in the "other" row (fingerprints no longer tracked), so that
    /// per-caller totals stay whole across evictions.
    pub other_callers: Vec<(Arc<str>, Counters)>,
}

impl Agg {
    fn counters(&self) -> Counters {
        Counters {
            calls: self.calls,
            errors: self.errors,
            lock_wait_ns: self.lock_wait_ns,
            total_ns: self.total_ns,
        }
    }

    fn caller_counters(&self) -> Vec<(Arc<str>, Counters)> {
        self.callers
            .iter()
            .map(|(n, c)| {
                let counters = Counters {
                    calls: c.calls,
                    errors: c.errors,
                    lock_wait_ns: 0,
                    total_ns: c.total_ns,
                };
                (n.clone(), counters)
            })
            .collect()
    }
}

#[derive(Debug)]
struct Entry {
    normalized: Arc<str>,
    kind: &'static str,
    /// Space-saving eviction weight (inherited + own µs); never reported.
    priority: u64,
    agg: Agg,
}

#[derive(Debug, Default)]
struct Shard {
    map: HashMap<u64, Entry>,
    /// (priority when pushed, fingerprint); exactly one item per tracked entry.
    heap: BinaryHeap<Reverse<(u64, u64)>>,
    capacity: usize,
    other: Option<Agg>,
}

impl Shard {
    /// Evicts the lowest-priority entry into "other" and returns its priority.
    fn evict_min(&mut self, now_ms: u64) -> u64 {
        while let Some(Reverse((prio, fp))) = self.heap.pop() {
            let current = match self.map.get(&fp) {
                Some(e) => e.priority,
                None => continue,
            };
            if current != prio {
                self.heap.push(Reverse((current, fp)));
                continue;
            }
            if let Some(e) = self.map.remove(&fp) {
                self.other
                    .get_or_insert_with(|| Agg::new(now_ms))
                    .merge(&e.agg, now_ms);
            }
            return prio;
        }
        0
    }
}

/// Thread-safe per-fingerprint statistics with bounded memory.
#[derive(Debug)]
pub struct FingerprintStats {
    shards: Box<[Mutex<Shard>]>,
}

/// Wall-clock milliseconds since the epoch, the clock the statistics' timestamps are on (the
/// anomaly detector is fed with it too, so row creation stamps and ticks compare). The fine
/// clock: the detector's rates split calls into 100 ms windows, and a stamp a tick late puts
/// a step's first calls into the window before it.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `d` in nanoseconds, saturating (without the 128-bit arithmetic of `as_nanos`).
fn nanos(d: Duration) -> u64 {
    d.as_secs()
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::from(d.subsec_nanos()))
}

/// [`unix_ms`] from the coarse clock: the kernel's time at its last tick (a few ms behind,
/// never ahead), read from the vDSO without reading the hardware counter — for stamps only
/// shown to people, such as how long a client has been in its state (two per statement), and
/// the per-fingerprint statistics' stamps and per-second rates (one per statement).
pub fn unix_ms_coarse() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) };
    // A clock that read fine holds 0 <= tv_nsec < 10^9 and seconds since 1970 far from
    // overflowing in milliseconds: plain arithmetic (this runs at every state change).
    match (rc, u64::try_from(ts.tv_sec)) {
        (0, Ok(s)) => s * 1000 + (ts.tv_nsec as u64) / 1_000_000,
        _ => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
    }
}

impl FingerprintStats {
    /// Tracks at most `capacity` fingerprints (plus the "other" row).
    pub fn new(capacity: usize) -> Self {
        let n = (capacity / 64).clamp(1, MAX_SHARDS);
        let shards = (0..n)
            .map(|i| {
                Mutex::new(Shard {
                    capacity: capacity / n + usize::from(i < capacity % n),
                    ..Shard::default()
                })
            })
            .collect();
        FingerprintStats { shards }
    }

    fn shard(&self, fingerprint: u64) -> &Mutex<Shard> {
        // Fingerprints are xxh3 output: the high bits are as uniform as any.
        let i = ((fingerprint >> 32) as usize) % self.shards.len();
        &self.shards[i]
    }

    #[inline(always)]
    pub fn record(
        &self,
        fingerprint: u64,
        normalized: &Arc<str>,
        kind: &'static str,
        caller: &Arc<str>,
        elapsed: Duration,
        outcome: Outcome,
    ) {
        let ns = nanos(elapsed);
        let weight = (ns / 1000).max(1);
        // The coarse clock: stamps and per-second rates, a few ms late at most, never early.
        let now_ms = unix_ms_coarse();
        let mut s = self.shard(fingerprint).lock();
        if let Some(e) = s.map.get_mut(&fingerprint) {
            e.agg.record(caller, ns, outcome, now_ms);
            e.priority = e.priority.saturating_add(weight);
            return;
        }
        if s.capacity == 0 {
            s.other
                .get_or_insert_with(|| Agg::new(now_ms))
                .record(caller, ns, outcome, now_ms);
            return;
        }
        let floor = if s.map.len() >= s.capacity {
            s.evict_min(now_ms)
        } else {
            0
        };
        let mut agg = Agg::new(now_ms);
        agg.record(caller, ns, outcome, now_ms);
        let priority = floor.saturating_add(weight);
        s.map.insert(
            fingerprint,
            Entry {
                normalized: Arc::clone(normalized),
                kind,
                priority,
                agg,
            },
        );
        s.heap.push(Reverse((priority, fingerprint)));
    }

    /// The `limit` largest rows by `sort` (ties by fingerprint), the "other" row included
    /// when it ranks. With `caller`, only rows that caller contributed to, ranked by that
    /// caller's share; the numbers in each row stay the row's totals.
    pub fn top(
        &self,
        sort: SortKey,
        limit: usize,
        caller: Option<&str>,
    ) -> Vec<FingerprintSnapshot> {
        let now_ms = unix_ms();
        let mut rows: Vec<(u64, FingerprintSnapshot)> = Vec::new();
        let mut other: Option<Agg> = None;
        for shard in self.shards.iter() {
            let s = shard.lock();
            let mut keyed: Vec<(u64, u64)> = s
                .map
                .iter()
                .filter_map(|(&fp, e)| e.agg.sort_value(sort, caller, now_ms).map(|v| (v, fp)))
                .collect();
            keyed.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            keyed.truncate(limit);
            for (v, fp) in keyed {
                if let Some(e) = s.map.get(&fp) {
                    rows.push((
                        v,
                        e.agg
                            .snapshot(format!("{fp:016x}"), &e.normalized, e.kind, now_ms),
                    ));
                }
            }
            if let Some(o) = &s.other {
                other
                    .get_or_insert_with(|| Agg::new(o.first_ms))
                    .merge(o, now_ms);
            }
        }
        if let Some(o) = other
            && let Some(v) = o.sort_value(sort, caller, now_ms)
        {
            rows.push((
                v,
                o.snapshot(
                    OTHER.to_owned(),
                    "(fingerprints not tracked)",
                    OTHER,
                    now_ms,
                ),
            ));
        }
        rows.sort_by(|a, b| {
            b.0.cmp(&a.0)
                .then_with(|| a.1.fingerprint.cmp(&b.1.fingerprint))
        });
        rows.truncate(limit);
        rows.into_iter().map(|(_, r)| r).collect()
    }

    /// The row of `fingerprint`, if it has one of its own ([`FingerprintStats::contains`]).
    pub fn get(&self, fingerprint: u64) -> Option<FingerprintSnapshot> {
        let now_ms = unix_ms();
        let s = self.shard(fingerprint).lock();
        let e = s.map.get(&fingerprint)?;
        Some(
            e.agg
                .snapshot(format!("{fingerprint:016x}"), &e.normalized, e.kind, now_ms),
        )
    }

    /// Whether `fingerprint` has a row of its own: a statement with it ended (or was refused)
    /// since the start or the last reset, and it was not evicted into "other" since.
    pub fn contains(&self, fingerprint: u64) -> bool {
        self.shard(fingerprint)
            .lock()
            .map
            .contains_key(&fingerprint)
    }

    /// Tracked fingerprints, plus one if the "other" row is non-empty.
    pub fn len(&self) -> usize {
        let mut tracked = 0;
        let mut other = false;
        for shard in self.shards.iter() {
            let s = shard.lock();
            tracked += s.map.len();
            other |= s.other.is_some();
        }
        tracked + usize::from(other)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cumulative counters of every tracked fingerprint, and of the callers of the
    /// "other" row, for the anomaly detector (`observe::anomaly`), which reads them on its
    /// own tick so that recording a statement does no extra work. One shard lock at a time.
    pub fn counters(&self) -> CounterSnapshot {
        let mut out = CounterSnapshot::default();
        for shard in self.shards.iter() {
            let s = shard.lock();
            out.fingerprints.reserve(s.map.len());
            for (&fp, e) in &s.map {
                out.fingerprints.push(FingerprintCounters {
                    fingerprint: fp,
                    first_ms: e.agg.first_ms,
                    normalized: Arc::clone(&e.normalized),
                    kind: e.kind,
                    counters: e.agg.counters(),
                    by_caller: e.agg.caller_counters(),
                });
            }
            if let Some(o) = &s.other {
                for (name, c) in o.caller_counters() {
                    match out.other_callers.iter_mut().find(|(n, _)| *n == name) {
                        Some((_, t)) => t.add(&c),
                        None => out.other_callers.push((name, c)),
                    }
                }
            }
        }
        out
    }

    /// Forgets everything (like `pg_stat_statements_reset()`).
    pub fn reset(&self) {
        for shard in self.shards.iter() {
            let mut s = shard.lock();
            s.map.clear();
            s.heap.clear();
            s.other = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    #[test]
    fn sort_key_parse() {
        assert_eq!("total_time".parse::<SortKey>(), Ok(SortKey::TotalTime));
        assert_eq!("refusals".parse::<SortKey>(), Ok(SortKey::Refusals));
        let err = "p99".parse::<SortKey>().err().map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some(
                "unknown sort key `p99`: expected one of total_time, calls, errors, refusals, qps"
            )
        );
    }

    #[test]
    fn buckets_are_monotonic_and_quantiles_close() {
        let mut last = 0;
        for us in [
            0u64,
            1,
            2,
            3,
            4,
            5,
            7,
            8,
            100,
            1000,
            65_000,
            1_000_000,
            60_000_000,
            u64::MAX,
        ] {
            let b = bucket(us);
            assert!(b >= last && b < BUCKETS, "{us} -> {b}");
            last = b;
            if (1..60_000_000).contains(&us) {
                let (lo, hi) = (bucket_floor_us(b), bucket_floor_us(b + 1));
                assert!(lo <= us as f64 && (us as f64) < hi, "{us}: {lo}..{hi}");
            }
        }
        let st = FingerprintStats::new(10);
        let t = text("SELECT ?");
        for ms in 1..=100u64 {
            st.record(
                1,
                &t,
                "read",
                &"a".into(),
                Duration::from_millis(ms),
                Outcome::Ok { rows: 1 },
            );
        }
        let r = &st.top(SortKey::Calls, 1, None)[0];
        assert_eq!((r.calls, r.rows), (100, 100));
        assert!((r.p50_ms - 50.0).abs() / 50.0 < 0.1, "{}", r.p50_ms);
        assert!((r.p95_ms - 95.0).abs() / 95.0 < 0.1, "{}", r.p95_ms);
        assert!((r.p99_ms - 99.0).abs() / 99.0 < 0.1, "{}", r.p99_ms);
        assert!((r.mean_ms - 50.5).abs() < 1e-9);
        assert_eq!((r.min_ms, r.max_ms), (1.0, 100.0));
    }

    #[test]
    fn outcomes_reasons_and_callers() {
        let st = FingerprintStats::new(100);
        let t = text("UPDATE t SET x = ?");
        let d = Duration::from_micros(500);
        st.record(
            7,
            &t,
            "write",
            &"billing".into(),
            d,
            Outcome::Ok { rows: 3 },
        );
        st.record(7, &t, "write", &"billing".into(), d, Outcome::Error);
        st.record(
            7,
            &t,
            "write",
            &"web".into(),
            d,
            Outcome::Refused("caller_limit"),
        );
        st.record(7, &t, "write", &"web".into(), d, Outcome::Refused("rule"));
        st.record(7, &t, "write", &"web".into(), d, Outcome::Refused("rule"));
        for i in 0..100 {
            st.record(
                7,
                &t,
                "write",
                &format!("c{i}").into(),
                d,
                Outcome::Ok { rows: 0 },
            );
        }
        let r = &st.top(SortKey::TotalTime, 10, None)[0];
        assert_eq!(r.fingerprint, "0000000000000007");
        assert_eq!((r.calls, r.errors, r.refusals, r.rows), (105, 1, 3, 3));
        assert_eq!(r.refusals_by_reason.get("rule"), Some(&2));
        assert_eq!(r.by_caller.len(), MAX_CALLERS + 1);
        assert_eq!(r.by_caller["web"].refusals, 3);
        assert_eq!(r.by_caller[OTHER].calls, 100 - (MAX_CALLERS as u64 - 2));
        assert!(r.last_seen_unix_ms >= r.first_seen_unix_ms && r.first_seen_unix_ms > 0);
        assert_eq!(st.top(SortKey::Refusals, 10, Some("web")).len(), 1);
        assert!(st.top(SortKey::Calls, 10, Some("nobody")).is_empty());
        is_serialize(r);
    }

    fn is_serialize<T: serde::Serialize>(_: &T) {}

    /// A caller is one entry whether its name comes shared (one configuration's matcher) or
    /// as another copy of the same bytes (a reloaded one), in either order.
    #[test]
    fn a_callers_name_is_one_entry_by_address_or_by_bytes() {
        let st = FingerprintStats::new(10);
        let t = text("SELECT ?");
        let d = Duration::from_micros(5);
        let ok = Outcome::Ok { rows: 1 };
        let (web, billing): (Arc<str>, Arc<str>) = ("web".into(), "billing".into());
        for _ in 0..3 {
            st.record(1, &t, "read", &web, d, ok);
            st.record(1, &t, "read", &billing, d, ok);
        }
        let reloaded: Arc<str> = "web".into();
        st.record(1, &t, "read", &reloaded, d, ok);
        st.record(1, &t, "read", &web, d, ok);
        let r = &st.top(SortKey::Calls, 1, None)[0];
        assert_eq!(r.by_caller.len(), 2);
        assert_eq!(
            (r.by_caller["web"].calls, r.by_caller["billing"].calls),
            (5, 3)
        );
    }

    #[test]
    fn top_sorts_and_filters() {
        let st = FingerprintStats::new(100);
        let t = text("SELECT ?");
        for fp in 1..=5u64 {
            for _ in 0..fp {
                st.record(
                    fp,
                    &t,
                    "read",
                    &"a".into(),
                    Duration::from_millis(6 - fp),
                    Outcome::Ok { rows: 0 },
                );
            }
        }
        let by_calls: Vec<_> = st
            .top(SortKey::Calls, 3, None)
            .into_iter()
            .map(|r| r.calls)
            .collect();
        assert_eq!(by_calls, vec![5, 4, 3]);
        let by_time = st.top(SortKey::TotalTime, 1, None);
        assert_eq!(by_time[0].fingerprint, "0000000000000003"); // 3 × 3 ms = 9 ms
        assert_eq!(st.len(), 5);
        st.reset();
        assert!(st.is_empty());
    }

    #[test]
    fn heavy_hitters_survive_and_totals_are_conserved() {
        let st = FingerprintStats::new(64);
        let t = text("q");
        let mut total_calls = 0u64;
        for i in 0..20_000u64 {
            // fingerprint 1 is heavy; the rest are one-offs
            st.record(
                1 << 40,
                &t,
                "read",
                &"a".into(),
                Duration::from_millis(5),
                Outcome::Ok { rows: 0 },
            );
            st.record(
                i.wrapping_mul(0x9E37_79B9_7F4A_7C15),
                &t,
                "read",
                &"a".into(),
                Duration::from_micros(10),
                Outcome::Ok { rows: 0 },
            );
            total_calls += 2;
        }
        let rows = st.top(SortKey::TotalTime, 1000, None);
        assert!(rows.len() <= 65);
        assert_eq!(rows[0].fingerprint, format!("{:016x}", 1u64 << 40));
        assert_eq!(rows[0].calls, 20_000);
        assert_eq!(rows.iter().map(|r| r.calls).sum::<u64>(), total_calls);
        assert!(rows.iter().any(|r| r.fingerprint == OTHER));
    }

    #[test]
    fn memory_bounded_under_a_million_distinct_fingerprints() {
        let st = FingerprintStats::new(DEFAULT_CAPACITY);
        let t = text("SELECT ?");
        let d = Duration::from_micros(100);
        for i in 0..1_000_000u64 {
            let fp = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i >> 7);
            st.record(
                fp,
                &t,
                "read",
                &"default".into(),
                d,
                Outcome::Ok { rows: 1 },
            );
        }
        assert!(st.len() <= DEFAULT_CAPACITY + 1, "{}", st.len());
        for shard in st.shards.iter() {
            let s = shard.lock();
            assert_eq!(s.heap.len(), s.map.len());
            assert!(s.map.len() <= s.capacity);
        }
        let calls: u64 = st
            .top(SortKey::Calls, usize::MAX, None)
            .iter()
            .map(|r| r.calls)
            .sum();
        assert_eq!(calls, 1_000_000);
    }

    /// `n` calls spread evenly over `[from_ms, to_ms)`.
    fn spread(r: &mut Rate, from_ms: u64, to_ms: u64, n: u64) {
        for i in 0..n {
            r.add(from_ms + (to_ms - from_ms) * i / n);
        }
    }

    #[test]
    fn rate_is_calls_per_second_over_the_sliding_window() {
        let w = RATE_WINDOW_MS;
        let base = 1_000 * w; // a window boundary
        // Steady 10/s since long ago: 10 at every point of a window.
        let start = base - 3 * w;
        let steady = |to: u64| {
            let mut r = Rate::default();
            spread(&mut r, start, to, (to - start) / 100);
            r
        };
        for at in [base + 1, base + w / 4, base + w / 2, base + w - 1] {
            let q = steady(at).per_second(at, 0);
            assert!((q - 10.0).abs() < 0.5, "at +{} ms: {q}", at - base);
        }
        // Quiet from base + w/2 on: the estimate fades with the previous window's share of
        // the sliding window (its 50 calls are taken as spread over it), then is 0.
        let r = steady(base + w / 2);
        let q = r.per_second(base + w + w / 2, 0);
        assert!((q - 2.5).abs() < 0.1, "{q}");
        assert_eq!(r.per_second(base + 3 * w, 0), 0.0);

        // A pattern that appeared 2 s ago at 50/s shows 50/s, not 100 calls / 10 s.
        let mut young = Rate::default();
        let first = base + w / 2;
        spread(&mut young, first, first + 2_000, 100);
        let q = young.per_second(first + 2_000, first);
        assert!((q - 50.0).abs() < 1.0, "{q}");
        // ... and across a window boundary, its half-filled previous window counts fully.
        let mut across = Rate::default();
        spread(&mut across, base + w / 2, base + w + w / 2, 100);
        let q = across.per_second(base + w + w / 2, base + w / 2);
        assert!((q - 10.0).abs() < 0.5, "{q}");
        // One call just now reads as one per second, not as a burst.
        let mut one = Rate::default();
        one.add(base + 5);
        assert_eq!(one.per_second(base + 5, base + 5), 1.0);
        // A clock that went back counts in the current window.
        one.add(base - 3 * w);
        assert_eq!(one.current, 2);
        // Merging aligns both to now.
        let mut a = Rate::default();
        a.add(base - w + 1);
        let mut b = Rate::default();
        b.add(base + 1);
        a.merge(&b, base + 2);
        assert_eq!((a.previous, a.current, a.start_ms), (1, 1, base));
    }

    #[test]
    fn lock_and_timeout_errors_are_counted_apart() {
        assert_eq!(
            Outcome::of_error(Some("55P03"), false),
            Outcome::LockNotAvailable
        );
        assert_eq!(
            Outcome::of_error(Some("55P03"), true),
            Outcome::LockNotAvailable
        );
        assert_eq!(
            Outcome::of_error(Some("57014"), false),
            Outcome::StatementTimeout
        );
        assert_eq!(Outcome::of_error(Some("57014"), true), Outcome::Error);
        assert_eq!(Outcome::of_error(Some("23505"), false), Outcome::Error);
        assert_eq!(Outcome::of_error(None, false), Outcome::Error);

        let st = FingerprintStats::new(10);
        let t = text("SELECT * FROM t WHERE id = ? FOR UPDATE");
        let a: &Arc<str> = &"app".into();
        st.record(
            9,
            &t,
            "read",
            a,
            Duration::from_millis(200),
            Outcome::LockNotAvailable,
        );
        st.record(
            9,
            &t,
            "read",
            a,
            Duration::from_millis(300),
            Outcome::LockNotAvailable,
        );
        st.record(
            9,
            &t,
            "read",
            a,
            Duration::from_millis(50),
            Outcome::StatementTimeout,
        );
        st.record(9, &t, "read", a, Duration::from_millis(1), Outcome::Error);
        st.record(
            9,
            &t,
            "read",
            a,
            Duration::from_millis(1),
            Outcome::Ok { rows: 1 },
        );
        assert!(st.contains(9));
        assert!(!st.contains(10));
        let r = &st.top(SortKey::Calls, 1, None)[0];
        assert_eq!(r.calls, 5);
        assert_eq!(r.errors, 4);
        assert_eq!(r.lock_not_available, 2);
        assert_eq!(r.statement_timeouts, 1);
        assert!((r.lock_wait_ms - 500.0).abs() < 1e-9, "{}", r.lock_wait_ms);
        assert_eq!(r.by_caller[&**a].errors, 4);
        // Five calls within the last second.
        assert!(r.qps >= 4.0 && r.qps <= 5.0, "{}", r.qps);
        // Evicted into "other": the counts go with it, the row is gone.
        let small = FingerprintStats::new(1);
        small.record(
            1,
            &t,
            "read",
            a,
            Duration::from_millis(7),
            Outcome::LockNotAvailable,
        );
        small.record(
            2,
            &t,
            "read",
            a,
            Duration::from_secs(1),
            Outcome::Ok { rows: 0 },
        );
        assert!(!small.contains(1) && small.contains(2));
        let other = small
            .top(SortKey::Calls, 10, None)
            .into_iter()
            .find(|r| r.fingerprint == OTHER)
            .unwrap();
        assert_eq!((other.lock_not_available, other.errors), (1, 1));
        st.reset();
        assert!(!st.contains(9));
    }

    #[test]
    fn top_sorts_by_current_rate() {
        let st = FingerprintStats::new(10);
        let t = text("q");
        let ok = Outcome::Ok { rows: 0 };
        // 1 is slow and rare, 2 cheap and frequent.
        st.record(1, &t, "read", &"a".into(), Duration::from_secs(5), ok);
        for _ in 0..20 {
            st.record(2, &t, "read", &"b".into(), Duration::from_micros(10), ok);
        }
        let fps = |k| -> Vec<String> {
            st.top(k, 2, None)
                .into_iter()
                .map(|r| r.fingerprint)
                .collect()
        };
        assert_eq!(fps(SortKey::TotalTime)[0], "0000000000000001");
        assert_eq!(fps(SortKey::Qps)[0], "0000000000000002");
        assert_eq!("qps".parse::<SortKey>(), Ok(SortKey::Qps));
        let rows = st.top(SortKey::Qps, 5, Some("a"));
        assert_eq!(rows.len(), 1);
        assert!(rows[0].qps > 0.0);
        // Each caller has its own current rate: 20 calls of "b" just now read as 20/s.
        st.record(2, &t, "read", &"c".into(), Duration::from_micros(10), ok);
        let row = st.get(2).expect("a tracked row");
        assert_eq!(row.by_caller["b"].qps, 20.0);
        assert_eq!(row.by_caller["c"].qps, 1.0);
        assert_eq!(row.qps, 21.0);
        assert!(st.get(3).is_none());
    }

    #[test]
    fn zero_capacity_goes_to_other() {
        let st = FingerprintStats::new(0);
        st.record(
            1,
            &text("x"),
            "read",
            &"a".into(),
            Duration::ZERO,
            Outcome::Ok { rows: 0 },
        );
        assert_eq!(st.len(), 1);
        assert_eq!(st.top(SortKey::Calls, 5, None)[0].fingerprint, OTHER);
    }
}
