//! Prometheus metrics: one typed [`Metrics`] struct over a private `prometheus::Registry`.
//!
//! Owns the metric names, their label sets and the text exposition. It imports nothing else
//! of ours: sessions report events through the typed methods, and the admin `/metrics`
//! handler hands over a plain-data [`Scrape`] of app state (pools, callers, breaker, …) that
//! is written into gauges and counters just before rendering.
//!
//! Rules it keeps:
//! * Names are `pgsluice_*` with the unit in the name (`_seconds`, `_total`, `_connections`).
//! * Labels come only from bounded sets: caller names from the config (plus `default`),
//!   refusal reasons, rule actions and breaker states (all `&'static str` chosen by our code),
//!   pool names (capped at [`MAX_POOL_SERIES`], the rest summed into `pool="other"`; the pool
//!   series are in `pool_series`). Never
//!   SQL, fingerprints or client-chosen strings: per-fingerprint detail lives in the admin
//!   API (`GET /v1/fingerprints`); here there is only `pgsluice_fingerprints_tracked`.
//! * The hot path never calls `with_label_values`: per-caller handles (query counters,
//!   histograms, refusal counters for every known reason) are resolved once, kept in a `Vec`
//!   indexed by caller id and swapped with arc-swap on reload. An id past the end is the last
//!   entry, `default`, as in the policy. A reason or action outside the known lists still
//!   works (bounded: they are `&'static str`) but takes the slower labelled lookup.
//! * Counters whose source of truth is an atomic elsewhere (backend connects, cancels, …) are
//!   real Prometheus counters set at scrape time; scrapes are serialised so two concurrent
//!   scrapes cannot observe each other's half-written values.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use super::arrival_series::{ArrivalSample, ArrivalSeries};
pub use super::pool_series::{MAX_POOL_SERIES, PoolSample};
use super::pool_series::{PoolSeries, reg};

/// Refusal reasons with pre-resolved per-caller counters (the policy's `RefusalKind` labels).
pub const KNOWN_REASONS: [&str; 6] = [
    "caller_limit",
    "queue_timeout",
    "rate_limited",
    "query_blocked",
    "circuit_open",
    "query_concurrency",
];
/// Where a read that may go to a replica went (`pgsluice_replica_reads_total{decision}`):
/// to a replica; kept on the primary because no replica had replayed the client's last write
/// yet (read-your-writes); on the primary because no replica qualified (down or lagging).
pub const REPLICA_READ_DECISIONS: [&str; 3] = ["replica", "read_your_writes", "no_replica"];
/// Rule actions with pre-resolved hit counters.
pub const KNOWN_ACTIONS: [&str; 4] = ["REJECT", "THROTTLE", "CONCURRENCY", "TIMEOUT"];
/// Breaker states with pre-resolved transition counters.
pub const KNOWN_BREAKER_STATES: [&str; 3] = ["closed", "open", "half_open"];
/// Values of `pgsluice_breaker_state`.
pub const BREAKER_CLOSED: i64 = 0;
pub const BREAKER_HALF_OPEN: i64 = 1;
pub const BREAKER_OPEN: i64 = 2;

const QUERY_BUCKETS: [f64; 16] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];
const QUEUE_BUCKETS: [f64; 13] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];
/// Coarser wait buckets past a second, used up to the first one above the longest wait the
/// config allows.
const LONG_WAIT_BUCKETS: [f64; 10] = [
    2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
];

/// Buckets of the wait histograms: fine ones up to 1 s, then coarser ones up to the first
/// above `longest` (the longest queue or checkout timeout configured), with a bucket at
/// `longest` itself. A wait that ran into that timeout measures a little more than it, so it
/// lands in the bucket above instead of `+Inf`, and `le` = the timeout counts the waits that
/// ended in time. Fixed at start: a reload that raises a timeout beyond the last bucket
/// counts those waits in `+Inf` until a restart.
pub fn wait_buckets(longest: Duration) -> Vec<f64> {
    let longest = longest.as_secs_f64();
    let mut b = QUEUE_BUCKETS.to_vec();
    for x in LONG_WAIT_BUCKETS {
        if b.last().is_some_and(|l| *l > longest) {
            break;
        }
        b.push(x);
    }
    if longest > 0.0 {
        let at = b.partition_point(|x| *x < longest);
        if b.get(at) != Some(&longest) {
            b.insert(at, longest);
        }
        if b.last().is_some_and(|l| *l <= longest) {
            // Past the coarse list: one more bucket for the waits that ran into it.
            b.push(longest * 2.0);
        }
    }
    b
}

/// One caller at scrape time.
#[derive(Debug, Clone, Default)]
pub struct CallerSample {
    pub name: String,
    pub in_flight: u64,
    pub queued: u64,
    pub admitted: u64,
    /// Backend time its units held, in all pools.
    pub backend_seconds: f64,
    /// Its share of a pool's backend time over the fair-share window (largest of its pools).
    pub backend_share: f64,
}

/// App state read by the `/metrics` handler, written into the scrape-time series.
#[derive(Debug, Clone, Default)]
pub struct Scrape {
    pub pools: Vec<PoolSample>,
    pub callers: Vec<CallerSample>,
    /// The arrival decisions of the pools' and callers' queues.
    pub arrivals: Vec<ArrivalSample>,
    pub client_connections: u64,
    pub client_connections_accepted: u64,
    pub handshakes_in_progress: u64,
    /// Connections handed to the login thread (the session thread had enough logins).
    pub logins_offloaded: u64,
    /// Times accepting moved to the login thread for a burst of logins.
    pub accept_moves: u64,
    /// Logins that waited, once authenticated, while their pool or caller was crowded.
    pub logins_held: u64,
    /// Logins waiting at the door now.
    pub logins_waiting: u64,
    pub client_errors: u64,
    /// [`BREAKER_CLOSED`], [`BREAKER_HALF_OPEN`] or [`BREAKER_OPEN`].
    pub breaker_state: i64,
    /// Trips so far by reason (bounded set of `&'static str`).
    pub breaker_trips: Vec<(&'static str, u64)>,
    /// Statements holding a breaker ticket, proxy-wide.
    pub in_flight: u64,
    /// Statements shed while in flight was above `max_inflight_threshold`.
    pub breaker_inflight_sheds: u64,
    /// The breaker probe's last reading (the built-in database-load estimate or
    /// `probe_sql`'s value); `None` before the first or without a probe.
    pub breaker_probe_value: Option<f64>,
    pub cancels_sent: u64,
    pub cancels_ignored: u64,
    /// Passed on to the peer instance that owns the key.
    pub cancels_forwarded: u64,
    /// Dropped: their source address had `limits.max_cancels_per_address` in flight.
    pub cancels_address_limited: u64,
    pub rules: u64,
    /// Statements rules in warn mode would have refused, by action (bounded `&'static str`).
    pub rule_warned: Vec<(&'static str, u64)>,
    pub fingerprints_tracked: u64,
    /// COALESCE: reads run for others to share, reads answered from such a run, and reads
    /// that ran themselves after all (by reason).
    pub coalesce_led: u64,
    pub coalesce_shared: u64,
    pub coalesce_fallbacks: Vec<(&'static str, u64)>,
    /// Fleet mode only.
    pub fleet: Option<FleetSample>,
}

/// Fleet state for the `pgsluice_fleet_*` series (registered only in fleet mode).
#[derive(Debug, Clone, Default)]
pub struct FleetSample {
    pub redis_up: bool,
    pub members: u64,
    pub rule_syncs: u64,
    pub lease_requests: u64,
    pub lease_tokens: u64,
    pub redis_errors: u64,
}

/// The `pgsluice_fleet_*` series.
struct FleetSeries {
    redis_up: IntGauge,
    members: IntGauge,
    rule_syncs: IntCounter,
    lease_requests: IntCounter,
    lease_tokens: IntCounter,
    redis_errors: IntCounter,
}

impl FleetSeries {
    fn register(r: &Registry) -> Self {
        FleetSeries {
            redis_up: reg(
                r,
                IntGauge::new(
                    "pgsluice_fleet_redis_up",
                    "1 while the fleet's Redis answers, 0 while this instance runs on what it last knew.",
                ),
            ),
            members: reg(
                r,
                IntGauge::new(
                    "pgsluice_fleet_members",
                    "Live fleet members as last seen (this instance included).",
                ),
            ),
            rule_syncs: reg(
                r,
                IntCounter::new(
                    "pgsluice_fleet_rule_syncs_total",
                    "Rule-set versions read from Redis and applied.",
                ),
            ),
            lease_requests: reg(
                r,
                IntCounter::new(
                    "pgsluice_fleet_lease_requests_total",
                    "Requests to Redis for tokens of fleet-wide rate limits.",
                ),
            ),
            lease_tokens: reg(
                r,
                IntCounter::new(
                    "pgsluice_fleet_lease_tokens_total",
                    "Tokens of fleet-wide rate limits leased to this instance.",
                ),
            ),
            redis_errors: reg(
                r,
                IntCounter::new(
                    "pgsluice_fleet_redis_errors_total",
                    "Redis calls that failed or timed out (each one starts a reconnect).",
                ),
            ),
        }
    }

    fn set(&self, s: &FleetSample) {
        self.redis_up.set(i64::from(s.redis_up));
        self.members.set(gauge_value(s.members));
        set_counter(&self.rule_syncs, s.rule_syncs);
        set_counter(&self.lease_requests, s.lease_requests);
        set_counter(&self.lease_tokens, s.lease_tokens);
        set_counter(&self.redis_errors, s.redis_errors);
    }
}

/// All metrics of one process. Cheap to clone (shared inside), so the breaker's transition
/// observer can hold its own handle.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Registry,
    queries: IntCounterVec,
    query_duration: HistogramVec,
    backend_duration: HistogramVec,
    queue_wait: HistogramVec,
    checkout_wait: HistogramVec,
    refusals: IntCounterVec,
    replica_reads: IntCounterVec,
    rule_hits: IntCounterVec,
    /// `[action][refused as usize]`, in [`KNOWN_ACTIONS`] order.
    rule_hit_handles: Vec<[IntCounter; 2]>,
    breaker_transitions: IntCounterVec,
    /// In [`KNOWN_BREAKER_STATES`] order.
    transition_handles: Vec<IntCounter>,
    /// Index = caller id; never empty (the last entry is `default`).
    callers: ArcSwap<CallerMetrics>,
    /// Serialises `set_callers` so two reloads cannot interleave their series cleanup.
    callers_lock: Mutex<()>,
    /// Scrape-time series; the lock is held from writing them to the end of encoding.
    scrape: Mutex<ScrapeSeries>,
    fleet: std::sync::OnceLock<FleetSeries>,
    detect: DetectSeries,
}

/// The anomaly detector's series (`observe::anomaly`, `admin::anomalies`).
struct DetectSeries {
    anomalies: IntCounterVec,
    active: IntGauge,
    auto_rules: IntCounterVec,
}

/// The per-caller series, indexed by caller id (last = `default`): one value per reload,
/// held in the runtime snapshot beside the matcher that hands out the ids.
#[derive(Clone)]
pub struct CallerMetrics {
    handles: Arc<[CallerHandles]>,
    /// For refusal reasons outside [`KNOWN_REASONS`].
    refusals: IntCounterVec,
}

impl CallerMetrics {
    /// Runs `f` with the caller's handles; unknown ids are the last entry (`default`).
    fn with_caller(&self, caller: u16, f: impl FnOnce(&CallerHandles)) {
        let table = &self.handles;
        if let Some(h) = table.get(usize::from(caller)).or_else(|| table.last()) {
            f(h);
        }
    }

    /// A statement that reached the backend finished: `pgsluice_queries_total{caller,outcome}`,
    /// `pgsluice_query_duration_seconds{caller}` (`total`: from its arrival) and
    /// `pgsluice_backend_duration_seconds{caller}` (`backend`: from its sending).
    pub fn query(&self, caller: u16, total: Duration, backend: Duration, ok: bool) {
        self.with_caller(caller, |h| {
            if ok { &h.ok } else { &h.error }.inc();
            h.duration.observe(total.as_secs_f64());
            h.backend.observe(backend.as_secs_f64());
        });
    }

    /// A checkout waited this long: `pgsluice_checkout_wait_seconds{caller}`.
    pub fn checkout_wait(&self, caller: u16, waited: Duration) {
        self.with_caller(caller, |h| h.checkout_wait.observe(waited.as_secs_f64()));
    }

    /// An admitted statement waited this long: `pgsluice_queue_wait_seconds{caller}`.
    pub fn queue_wait(&self, caller: u16, waited: Duration) {
        self.with_caller(caller, |h| h.queue_wait.observe(waited.as_secs_f64()));
    }

    /// A read that may go to a replica went where `decision` says (one of
    /// [`REPLICA_READ_DECISIONS`], by index): `pgsluice_replica_reads_total{caller,decision}`.
    pub fn replica_read(&self, caller: u16, decision: usize) {
        self.with_caller(caller, |h| {
            if let Some(c) = h.replica_reads.get(decision) {
                c.inc();
            }
        });
    }

    /// A statement was refused: `pgsluice_refusals_total{caller,reason}`.
    pub fn refusal(&self, caller: u16, reason: &'static str) {
        self.with_caller(caller, |h| {
            match KNOWN_REASONS.iter().position(|r| *r == reason) {
                Some(i) => h.refusals[i].inc(),
                None => self
                    .refusals
                    .with_label_values(&[h.name.as_str(), reason])
                    .inc(),
            }
        });
    }
}

/// Pre-resolved handles of one caller.
struct CallerHandles {
    name: String,
    ok: IntCounter,
    error: IntCounter,
    duration: Histogram,
    backend: Histogram,
    queue_wait: Histogram,
    checkout_wait: Histogram,
    /// In [`KNOWN_REASONS`] order.
    refusals: Vec<IntCounter>,
    /// In [`REPLICA_READ_DECISIONS`] order.
    replica_reads: Vec<IntCounter>,
}

struct ScrapeSeries {
    pools: PoolSeries,
    arrivals: ArrivalSeries,
    clients: IntGauge,
    clients_accepted: IntCounter,
    handshakes: IntGauge,
    logins_offloaded: IntCounter,
    accept_moves: IntCounter,
    logins_held: IntCounter,
    logins_waiting: IntGauge,
    client_errors: IntCounter,
    breaker_state: IntGauge,
    breaker_trips: IntCounterVec,
    breaker_inflight_sheds: IntCounter,
    breaker_probe_value: prometheus::Gauge,
    in_flight: IntGauge,
    cancels: IntCounterVec,
    caller_in_flight: IntGaugeVec,
    caller_queued: IntGaugeVec,
    caller_admitted: IntCounterVec,
    caller_backend_seconds: prometheus::CounterVec,
    caller_backend_share: prometheus::GaugeVec,
    rules: IntGauge,
    rule_warned: IntCounterVec,
    fingerprints_tracked: IntGauge,
    coalesce_led: IntCounter,
    coalesce_shared: IntCounter,
    coalesce_fallbacks: IntCounterVec,
}

fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    reg(r, IntCounterVec::new(Opts::new(name, help), labels))
}

fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    reg(r, IntGaugeVec::new(Opts::new(name, help), labels))
}

fn histogram_vec(r: &Registry, name: &str, help: &str, buckets: &[f64]) -> HistogramVec {
    let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
    reg(r, HistogramVec::new(opts, &["caller"]))
}

/// `pgsluice_build_info{version} 1`, and on Linux the standard `process_*` series (CPU,
/// resident and virtual memory, open and maximum descriptors, threads, start time) that
/// every Prometheus exporter has, so the usual dashboards and alerts work unchanged. The
/// process collector reads /proc/self at scrape time and keeps no state of its own.
fn register_process_series(r: &Registry) {
    let info = gauge_vec(
        r,
        "pgsluice_build_info",
        "Always 1; the version label is the running build's.",
        &["version"],
    );
    info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
    #[cfg(target_os = "linux")]
    r.register(Box::new(
        prometheus::process_collector::ProcessCollector::for_self(),
    ))
    .expect("process_* names are unique");
}

/// Sets a scrape-time counter to `v` (the scrape lock is held, so nobody sees the reset).
fn set_counter(c: &IntCounter, v: u64) {
    c.reset();
    c.inc_by(v);
}

fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Metrics {
    /// Index = caller id, last = `default` (appended when `caller_names` lacks it at the end).
    pub fn new(caller_names: &[String]) -> Metrics {
        Metrics::with_longest_wait(caller_names, Duration::from_secs(1))
    }

    /// As [`Metrics::new`], with wait histograms whose buckets reach `longest_wait` (see
    /// [`wait_buckets`]).
    pub fn with_longest_wait(caller_names: &[String], longest_wait: Duration) -> Metrics {
        let waits = wait_buckets(longest_wait);
        let r = Registry::new();
        register_process_series(&r);
        let queries = counter_vec(
            &r,
            "pgsluice_queries_total",
            "Statements that reached the backend, by caller and outcome (ok, error).",
            &["caller", "outcome"],
        );
        let query_duration = histogram_vec(
            &r,
            "pgsluice_query_duration_seconds",
            "Client-observed statement time through the proxy: from its arrival to its \
             completion, queue and checkout waits included.",
            &QUERY_BUCKETS,
        );
        let backend_duration = histogram_vec(
            &r,
            "pgsluice_backend_duration_seconds",
            "Statement time on the backend: from sending it to its completion, without the \
             waits before.",
            &QUERY_BUCKETS,
        );
        let queue_wait = histogram_vec(
            &r,
            "pgsluice_queue_wait_seconds",
            "Time admitted statements waited for a caller slot or a THROTTLE token.",
            &waits,
        );
        let checkout_wait = histogram_vec(
            &r,
            "pgsluice_checkout_wait_seconds",
            "Time clients waited for a backend connection of their pool (every checkout; \
             0 when one was free).",
            &waits,
        );
        let refusals = counter_vec(
            &r,
            "pgsluice_refusals_total",
            "Statements refused before reaching Postgres, by caller and reason.",
            &["caller", "reason"],
        );
        let replica_reads = counter_vec(
            &r,
            "pgsluice_replica_reads_total",
            "Reads that may go to a replica (route: replica callers, ROUTE rules), by caller and \
             where they went: replica, read_your_writes (kept on the primary until a replica has \
             replayed the client's last write), no_replica (none qualified: the primary).",
            &["caller", "decision"],
        );
        let rule_hits = counter_vec(
            &r,
            "pgsluice_rule_hits_total",
            "Statements matched by a fingerprint rule, by action and outcome (admitted, refused).",
            &["action", "outcome"],
        );
        let rule_hit_handles = KNOWN_ACTIONS
            .iter()
            .map(|a| {
                [
                    rule_hits.with_label_values(&[*a, "admitted"]),
                    rule_hits.with_label_values(&[*a, "refused"]),
                ]
            })
            .collect();
        let breaker_transitions = counter_vec(
            &r,
            "pgsluice_breaker_transitions_total",
            "Circuit breaker state changes, by the state entered.",
            &["to"],
        );
        let transition_handles = KNOWN_BREAKER_STATES
            .iter()
            .map(|s| breaker_transitions.with_label_values(&[*s]))
            .collect();
        let scrape = ScrapeSeries::register(&r);
        let detect = DetectSeries {
            anomalies: counter_vec(
                &r,
                "pgsluice_anomalies_total",
                "Anomalies the detector started, by subject (fingerprint, caller) and signal.",
                &["subject", "signal"],
            ),
            active: reg(
                &r,
                IntGauge::new(
                    "pgsluice_anomalies_active",
                    "Anomalies the detector holds now.",
                ),
            ),
            auto_rules: counter_vec(
                &r,
                "pgsluice_auto_rules_total",
                "What the detector did about anomalies by auto_rules.mode: installed, renewed, \
                 or why not (at_max_rules, only_exempt_callers, operator_rule, \
                 deleted_by_operator, failed).",
                &["outcome"],
            ),
        };
        let inner = Inner {
            registry: r,
            queries,
            query_duration,
            backend_duration,
            queue_wait,
            checkout_wait,
            refusals: refusals.clone(),
            replica_reads,
            rule_hits,
            rule_hit_handles,
            breaker_transitions,
            transition_handles,
            callers: ArcSwap::from_pointee(CallerMetrics {
                handles: Arc::new([]),
                refusals: refusals.clone(),
            }),
            callers_lock: Mutex::new(()),
            scrape: Mutex::new(scrape),
            fleet: std::sync::OnceLock::new(),
            detect,
        };
        let m = Metrics {
            inner: Arc::new(inner),
        };
        m.set_callers(caller_names);
        m
    }

    /// Swaps in the caller table after a reload and returns it (for the runtime snapshot
    /// sessions load, so a caller id always meets the table of its own configuration).
    /// Series of callers that are gone are removed (so the label set stays the configured
    /// one); the rest keep counting.
    pub fn set_callers(&self, caller_names: &[String]) -> CallerMetrics {
        let i = &self.inner;
        let _serial = i.callers_lock.lock();
        let mut names: Vec<String> = caller_names.to_vec();
        if names.last().map(String::as_str) != Some("default") {
            names.push("default".to_owned());
        }
        let handles: Arc<[CallerHandles]> = names
            .iter()
            .map(|n| CallerHandles {
                name: n.clone(),
                ok: i.queries.with_label_values(&[n.as_str(), "ok"]),
                error: i.queries.with_label_values(&[n.as_str(), "error"]),
                duration: i.query_duration.with_label_values(&[n.as_str()]),
                backend: i.backend_duration.with_label_values(&[n.as_str()]),
                queue_wait: i.queue_wait.with_label_values(&[n.as_str()]),
                checkout_wait: i.checkout_wait.with_label_values(&[n.as_str()]),
                refusals: KNOWN_REASONS
                    .iter()
                    .map(|r| i.refusals.with_label_values(&[n.as_str(), *r]))
                    .collect(),
                replica_reads: REPLICA_READ_DECISIONS
                    .iter()
                    .map(|d| i.replica_reads.with_label_values(&[n.as_str(), *d]))
                    .collect(),
            })
            .collect();
        let table = CallerMetrics {
            handles,
            refusals: i.refusals.clone(),
        };
        let old = i.callers.swap(Arc::new(table.clone()));
        for gone in old.handles.iter().filter(|h| !names.contains(&h.name)) {
            let n = gone.name.as_str();
            // Removal of a series that was never created only returns an error: ignored.
            let _ = i.queries.remove_label_values(&[n, "ok"]);
            let _ = i.queries.remove_label_values(&[n, "error"]);
            let _ = i.query_duration.remove_label_values(&[n]);
            let _ = i.backend_duration.remove_label_values(&[n]);
            let _ = i.queue_wait.remove_label_values(&[n]);
            let _ = i.checkout_wait.remove_label_values(&[n]);
            for r in KNOWN_REASONS {
                let _ = i.refusals.remove_label_values(&[n, r]);
            }
            for d in REPLICA_READ_DECISIONS {
                let _ = i.replica_reads.remove_label_values(&[n, d]);
            }
        }
        table
    }

    /// The caller table installed last (for callers that hold no runtime snapshot).
    pub fn callers(&self) -> Arc<CallerMetrics> {
        self.inner.callers.load_full()
    }

    /// A fingerprint rule matched: `pgsluice_rule_hits_total{action,outcome}`.
    pub fn rule_hit(&self, action: &'static str, refused: bool) {
        let i = &self.inner;
        match KNOWN_ACTIONS.iter().position(|a| *a == action) {
            Some(a) => i.rule_hit_handles[a][usize::from(refused)].inc(),
            None => {
                let outcome = if refused { "refused" } else { "admitted" };
                i.rule_hits.with_label_values(&[action, outcome]).inc();
            }
        }
    }

    /// An anomaly started: `pgsluice_anomalies_total{subject,signal}` (both bounded sets).
    pub fn anomaly_started(&self, subject: &'static str, signal: &'static str) {
        self.inner
            .detect
            .anomalies
            .with_label_values(&[subject, signal])
            .inc();
    }

    /// `pgsluice_anomalies_active`.
    pub fn set_anomalies_active(&self, n: usize) {
        self.inner.detect.active.set(gauge_value(n as u64));
    }

    /// What was done about an anomaly: `pgsluice_auto_rules_total{outcome}`.
    pub fn auto_rule(&self, outcome: &'static str) {
        self.inner
            .detect
            .auto_rules
            .with_label_values(&[outcome])
            .inc();
    }

    /// The breaker entered state `to`: `pgsluice_breaker_transitions_total{to}`.
    pub fn breaker_transition(&self, to: &'static str) {
        let i = &self.inner;
        match KNOWN_BREAKER_STATES.iter().position(|s| *s == to) {
            Some(s) => i.transition_handles[s].inc(),
            None => i.breaker_transitions.with_label_values(&[to]).inc(),
        }
    }

    /// Text exposition of everything, scrape-time series as last set.
    pub fn render(&self) -> String {
        let _scrape = self.inner.scrape.lock();
        self.encode()
    }

    /// Registers the `pgsluice_fleet_*` series (fleet mode; once).
    pub fn enable_fleet(&self) {
        self.inner
            .fleet
            .get_or_init(|| FleetSeries::register(&self.inner.registry));
    }

    /// Writes `scrape` into the scrape-time series and renders, as one step.
    pub fn render_with(&self, scrape: &Scrape) -> String {
        let series = self.inner.scrape.lock();
        series.set(scrape);
        if let (Some(f), Some(sample)) = (self.inner.fleet.get(), &scrape.fleet) {
            f.set(sample);
        }
        self.encode()
    }

    fn encode(&self) -> String {
        let families = self.inner.registry.gather();
        let mut out = String::with_capacity(16 * 1024);
        match TextEncoder::new().encode_utf8(&families, &mut out) {
            Ok(()) => out,
            Err(e) => format!("# pgsluice: metrics encoding failed: {e}\n"),
        }
    }
}

impl ScrapeSeries {
    fn register(r: &Registry) -> Self {
        let gauge = |name: &str, help: &str| reg(r, IntGauge::new(name, help));
        let counter = |name: &str, help: &str| reg(r, IntCounter::new(name, help));
        ScrapeSeries {
            pools: PoolSeries::register(r),
            arrivals: ArrivalSeries::register(r),
            clients: gauge(
                "pgsluice_client_connections",
                "Client connections currently open.",
            ),
            clients_accepted: counter(
                "pgsluice_client_connections_accepted_total",
                "Client connections accepted since start.",
            ),
            handshakes: gauge(
                "pgsluice_client_handshakes",
                "Client handshakes (startup and authentication) in progress.",
            ),
            logins_offloaded: counter(
                "pgsluice_client_logins_offloaded_total",
                "Client connections handed to the login thread to log in (or be refused) since \
                 start: with one session thread, those that arrived while 4 were logging in on it, \
                 and all while client TLS is on.",
            ),
            accept_moves: counter(
                "pgsluice_client_accept_moves_total",
                "Times new connections began to be accepted on the login thread for a burst of \
                 logins (back on the session thread after a second without one) since start.",
            ),
            logins_waiting: gauge(
                "pgsluice_client_logins_waiting",
                "Authenticated logins waiting at the door now (limits.hold_logins); they hold \
                 no handshake slot.",
            ),
            logins_held: counter(
                "pgsluice_client_logins_held_total",
                "Logins of non-critical callers that waited, once authenticated, while their \
                 pool's or caller's queue was crowded (limits.hold_logins).",
            ),
            client_errors: counter(
                "pgsluice_client_errors_total",
                "Client connections that ended with a protocol or I/O error.",
            ),
            breaker_state: gauge(
                "pgsluice_breaker_state",
                "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
            ),
            breaker_trips: counter_vec(
                r,
                "pgsluice_breaker_trips_total",
                "Times the circuit breaker opened, by reason.",
                &["reason"],
            ),
            breaker_inflight_sheds: reg(
                r,
                IntCounter::new(
                    "pgsluice_breaker_inflight_sheds_total",
                    "Statements shed because more than max_inflight_threshold were in flight \
                     (the breaker does not open for this).",
                ),
            ),
            breaker_probe_value: reg(
                r,
                prometheus::Gauge::new(
                    "pgsluice_breaker_probe_value",
                    "Last reading of the circuit breaker's probe: the built-in database load \
                     estimate in percent, or the value of probe_sql (NaN before the first).",
                ),
            ),
            in_flight: gauge(
                "pgsluice_in_flight_statements",
                "Admitted statements not yet finished, proxy-wide.",
            ),
            cancels: counter_vec(
                r,
                "pgsluice_cancels_total",
                "Client cancel requests, by outcome (sent to a backend, forwarded to the owning peer \
                 instance, ignored, dropped over the address's limit).",
                &["outcome"],
            ),
            caller_in_flight: gauge_vec(
                r,
                "pgsluice_caller_in_flight_statements",
                "Statements holding a caller concurrency slot.",
                &["caller"],
            ),
            caller_queued: gauge_vec(
                r,
                "pgsluice_caller_queued_statements",
                "Statements waiting for a caller concurrency slot.",
                &["caller"],
            ),
            caller_admitted: counter_vec(
                r,
                "pgsluice_caller_admitted_total",
                "Statements admitted by the policy, by caller.",
                &["caller"],
            ),
            caller_backend_seconds: reg(
                r,
                prometheus::CounterVec::new(
                    Opts::new(
                        "pgsluice_caller_backend_seconds_total",
                        "Time the caller's units (transactions) held a backend connection, all \
                         pools.",
                    ),
                    &["caller"],
                ),
            ),
            caller_backend_share: reg(
                r,
                prometheus::GaugeVec::new(
                    Opts::new(
                        "pgsluice_caller_backend_share",
                        "The caller's share of a pool's backend time over the fair-share window \
                         (~14 s, decayed), in the pool where it is largest (0..1).",
                    ),
                    &["caller"],
                ),
            ),
            rules: gauge("pgsluice_rules", "Runtime fingerprint rules installed."),
            rule_warned: counter_vec(
                r,
                "pgsluice_rule_warned_total",
                "Statements a fingerprint rule in warn mode (or in its warn_first_ms window) \
                 would have refused, by action; they ran, and are also counted in \
                 pgsluice_rule_hits_total{outcome=\"admitted\"}. Per rule: GET /v1/rules.",
                &["action"],
            ),
            fingerprints_tracked: gauge(
                "pgsluice_fingerprints_tracked",
                "Fingerprints with their own statistics (see GET /v1/fingerprints).",
            ),
            coalesce_led: counter(
                "pgsluice_coalesce_led_total",
                "Reads under a COALESCE rule that ran on a server with their result recorded \
                 for identical reads arriving meanwhile.",
            ),
            coalesce_shared: counter(
                "pgsluice_coalesce_shared_total",
                "Reads under a COALESCE rule answered with another client's identical read's \
                 result: executions saved.",
            ),
            coalesce_fallbacks: counter_vec(
                r,
                "pgsluice_coalesce_fallbacks_total",
                "Reads that waited for an identical read and then ran themselves, by reason \
                 (too_large, error, timeout, leader_gone: joined the next run).",
                &["reason"],
            ),
        }
    }

    fn set(&self, s: &Scrape) {
        self.pools.set(&s.pools);
        self.arrivals.set(&s.arrivals);
        self.clients.set(gauge_value(s.client_connections));
        set_counter(&self.clients_accepted, s.client_connections_accepted);
        self.handshakes.set(gauge_value(s.handshakes_in_progress));
        set_counter(&self.logins_offloaded, s.logins_offloaded);
        set_counter(&self.accept_moves, s.accept_moves);
        set_counter(&self.logins_held, s.logins_held);
        self.logins_waiting.set(gauge_value(s.logins_waiting));
        set_counter(&self.client_errors, s.client_errors);
        self.breaker_state.set(s.breaker_state);
        for (reason, n) in &s.breaker_trips {
            set_counter(&self.breaker_trips.with_label_values(&[*reason]), *n);
        }
        set_counter(&self.breaker_inflight_sheds, s.breaker_inflight_sheds);
        self.breaker_probe_value
            .set(s.breaker_probe_value.unwrap_or(f64::NAN));
        self.in_flight.set(gauge_value(s.in_flight));
        set_counter(&self.cancels.with_label_values(&["sent"]), s.cancels_sent);
        set_counter(
            &self.cancels.with_label_values(&["ignored"]),
            s.cancels_ignored,
        );
        set_counter(
            &self.cancels.with_label_values(&["forwarded"]),
            s.cancels_forwarded,
        );
        set_counter(
            &self.cancels.with_label_values(&["address_limit"]),
            s.cancels_address_limited,
        );
        self.caller_in_flight.reset();
        self.caller_queued.reset();
        self.caller_admitted.reset();
        self.caller_backend_seconds.reset();
        self.caller_backend_share.reset();
        for c in &s.callers {
            self.caller_backend_seconds
                .with_label_values(&[c.name.as_str()])
                .inc_by(c.backend_seconds.max(0.0));
            self.caller_backend_share
                .with_label_values(&[c.name.as_str()])
                .set(c.backend_share);
            let l = [c.name.as_str()];
            self.caller_in_flight
                .with_label_values(&l)
                .set(gauge_value(c.in_flight));
            self.caller_queued
                .with_label_values(&l)
                .set(gauge_value(c.queued));
            set_counter(&self.caller_admitted.with_label_values(&l), c.admitted);
        }
        self.rules.set(gauge_value(s.rules));
        for (action, n) in &s.rule_warned {
            set_counter(&self.rule_warned.with_label_values(&[*action]), *n);
        }
        self.fingerprints_tracked
            .set(gauge_value(s.fingerprints_tracked));
        set_counter(&self.coalesce_led, s.coalesce_led);
        set_counter(&self.coalesce_shared, s.coalesce_shared);
        for (reason, n) in &s.coalesce_fallbacks {
            set_counter(&self.coalesce_fallbacks.with_label_values(&[*reason]), *n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    fn sample(text: &str, prefix: &str) -> Option<f64> {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    #[test]
    fn wait_buckets_reach_the_longest_configured_wait() {
        // A bucket at the timeout and one above it, whatever the timeout.
        let tail = |ms: u64| {
            let b = wait_buckets(Duration::from_millis(ms));
            assert!(b.windows(2).all(|w| w[0] < w[1]), "{ms}: {b:?}");
            assert!(QUEUE_BUCKETS.iter().all(|x| b.contains(x)), "{ms}: {b:?}");
            b[b.len().saturating_sub(3)..].to_vec()
        };
        assert_eq!(tail(1000), [0.5, 1.0, 2.5]);
        assert_eq!(tail(2000), [1.0, 2.0, 2.5]);
        assert_eq!(tail(5000), [2.5, 5.0, 10.0]);
        assert_eq!(tail(7000), [5.0, 7.0, 10.0]);
        assert_eq!(tail(30_000), [10.0, 30.0, 60.0]);
        assert_eq!(tail(3_600_000), [1800.0, 3600.0, 7200.0]);
        assert_eq!(tail(7_200_000), [3600.0, 7200.0, 14400.0]);
        assert_eq!(tail(300), [0.3, 0.5, 1.0]);
        assert_eq!(wait_buckets(Duration::ZERO), QUEUE_BUCKETS.to_vec());
        // A wait that ran into a 5 s timeout is above le="5", below +Inf.
        let m = Metrics::with_longest_wait(&names(&["app"]), Duration::from_secs(5));
        m.callers().queue_wait(0, Duration::from_millis(5003));
        let t = m.render();
        let queue = |le: &str| {
            sample(
                &t,
                &format!(r#"pgsluice_queue_wait_seconds_bucket{{caller="app",le="{le}"}}"#),
            )
        };
        assert_eq!((queue("5"), queue("10")), (Some(0.0), Some(1.0)), "{t}");
        // A checkout that ended just inside a 2 s timeout: above 1 s, not +Inf.
        let m = Metrics::with_longest_wait(&names(&["app"]), Duration::from_secs(2));
        m.callers().checkout_wait(0, Duration::from_millis(1999));
        m.callers().query(
            0,
            Duration::from_millis(2100),
            Duration::from_millis(100),
            true,
        );
        let t = m.render();
        assert_eq!(
            sample(
                &t,
                r#"pgsluice_checkout_wait_seconds_bucket{caller="app",le="2.5"}"#
            ),
            Some(1.0)
        );
        assert_eq!(
            sample(
                &t,
                r#"pgsluice_checkout_wait_seconds_bucket{caller="app",le="1"}"#
            ),
            Some(0.0)
        );
        assert_eq!(
            sample(
                &t,
                r#"pgsluice_backend_duration_seconds_bucket{caller="app",le="0.1"}"#
            ),
            Some(1.0)
        );
        assert_eq!(
            sample(
                &t,
                r#"pgsluice_query_duration_seconds_bucket{caller="app",le="1"}"#
            ),
            Some(0.0)
        );
    }

    #[test]
    fn unknown_caller_id_counts_as_default() {
        let m = Metrics::new(&names(&["app", "default"]));
        m.callers()
            .query(0, Duration::from_millis(3), Duration::from_millis(2), true);
        m.callers().query(
            999,
            Duration::from_millis(3),
            Duration::from_millis(2),
            false,
        );
        m.callers().refusal(999, "rate_limited");
        let t = m.render();
        assert_eq!(
            sample(&t, r#"pgsluice_queries_total{caller="app",outcome="ok"}"#),
            Some(1.0)
        );
        assert_eq!(
            sample(
                &t,
                r#"pgsluice_queries_total{caller="default",outcome="error"}"#
            ),
            Some(1.0)
        );
        assert_eq!(
            sample(
                &t,
                r#"pgsluice_refusals_total{caller="default",reason="rate_limited"}"#
            ),
            Some(1.0)
        );
    }

    #[test]
    fn default_is_appended_and_removed_callers_disappear() {
        let m = Metrics::new(&names(&["a", "b"]));
        m.callers().query(1, Duration::ZERO, Duration::ZERO, true);
        m.set_callers(&names(&["b", "default"]));
        m.callers().query(0, Duration::ZERO, Duration::ZERO, true);
        let t = m.render();
        assert!(!t.contains(r#"caller="a""#), "{t}");
        assert_eq!(
            sample(&t, r#"pgsluice_queries_total{caller="b",outcome="ok"}"#),
            Some(2.0)
        );
        assert!(t.contains(r#"caller="default""#));
    }

    #[test]
    fn replica_reads_are_counted_per_caller_and_decision() {
        let m = Metrics::new(&names(&["web"]));
        let c = m.callers();
        c.replica_read(0, 0);
        c.replica_read(0, 1);
        c.replica_read(0, 1);
        c.replica_read(7, 2);
        // Past the known decisions: ignored, not a panic.
        c.replica_read(0, REPLICA_READ_DECISIONS.len());
        let t = m.render();
        let got = |caller: &str, decision: &str| {
            sample(
                &t,
                &format!(
                    "pgsluice_replica_reads_total{{caller=\"{caller}\",decision=\"{decision}\"}}"
                ),
            )
        };
        assert_eq!(got("web", "replica"), Some(1.0));
        assert_eq!(got("web", "read_your_writes"), Some(2.0));
        assert_eq!(got("web", "no_replica"), Some(0.0));
        assert_eq!(got("default", "no_replica"), Some(1.0));
    }

    #[test]
    fn unknown_labels_take_the_slow_path() {
        let m = Metrics::new(&[]);
        m.callers().refusal(0, "client_limit");
        m.rule_hit("SOMETHING", true);
        m.rule_hit("THROTTLE", false);
        m.breaker_transition("open");
        let t = m.render();
        assert!(t.contains(r#"reason="client_limit""#));
        assert_eq!(
            sample(
                &t,
                r#"pgsluice_rule_hits_total{action="THROTTLE",outcome="admitted"}"#
            ),
            Some(1.0)
        );
        assert_eq!(
            sample(&t, r#"pgsluice_breaker_transitions_total{to="open"}"#),
            Some(1.0)
        );
    }

    #[test]
    fn scrape_series_are_set_and_stale_pools_dropped() {
        let m = Metrics::new(&[]);
        let mut s = Scrape {
            pools: vec![PoolSample {
                name: "db/u".into(),
                database: "db".into(),
                user: "u".into(),
                active: 3,
                connect_attempts: 7,
                transactions: 11,
                bytes_sent: 4096,
                wait_us: 1_500_000,
                ..PoolSample::default()
            }],
            cancels_sent: 2,
            cancels_forwarded: 5,
            cancels_address_limited: 4,
            rule_warned: vec![("THROTTLE", 9), ("REJECT", 0)],
            callers: vec![CallerSample {
                name: "reports".into(),
                backend_seconds: 12.5,
                backend_share: 0.5,
                ..CallerSample::default()
            }],
            ..Scrape::default()
        };
        let t = m.render_with(&s);
        assert_eq!(
            sample(
                &t,
                r#"pgsluice_caller_backend_seconds_total{caller="reports"}"#
            ),
            Some(12.5)
        );
        assert_eq!(
            sample(&t, r#"pgsluice_caller_backend_share{caller="reports"}"#),
            Some(0.5)
        );
        assert_eq!(
            sample(
                &t,
                r#"pgsluice_pool_connections{database="db",pool="db/u",state="active",user="u"}"#
            ),
            Some(3.0)
        );
        let pool = r#"{database="db",pool="db/u",user="u"}"#;
        let at = |name: &str| sample(&t, &format!("{name}{pool}"));
        assert_eq!(at("pgsluice_backend_connect_attempts_total"), Some(7.0));
        assert_eq!(at("pgsluice_pool_transactions_total"), Some(11.0));
        assert_eq!(at("pgsluice_pool_wait_seconds_total"), Some(1.5));
        assert_eq!(
            sample(
                &t,
                r#"pgsluice_pool_bytes_total{database="db",direction="sent",pool="db/u",user="u"}"#
            ),
            Some(4096.0)
        );
        assert_eq!(
            sample(&t, r#"pgsluice_cancels_total{outcome="sent"}"#),
            Some(2.0)
        );
        assert_eq!(
            sample(&t, r#"pgsluice_cancels_total{outcome="forwarded"}"#),
            Some(5.0)
        );
        assert_eq!(
            sample(&t, r#"pgsluice_cancels_total{outcome="address_limit"}"#),
            Some(4.0)
        );
        assert_eq!(
            sample(&t, r#"pgsluice_rule_warned_total{action="THROTTLE"}"#),
            Some(9.0)
        );
        assert_eq!(
            sample(&t, r#"pgsluice_rule_warned_total{action="REJECT"}"#),
            Some(0.0)
        );
        s.pools.clear();
        assert!(!m.render_with(&s).contains("db/u"));
    }
}
