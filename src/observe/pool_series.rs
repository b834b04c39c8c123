//! The per-pool series of `/metrics`, set at scrape time from each pool's own counters:
//! connections by state, waiting clients, connects, timeouts, and what PgBouncer's `SHOW
//! STATS` users graph — transactions, statements, bytes each way, and the time spent in
//! transactions, statements and waiting for a backend.
//!
//! Every series is labelled `pool` (`database/user`), `database` and `user`; at most
//! [`MAX_POOL_SERIES`] pools get their own series, the rest are summed into `pool="other"`
//! (whose `database` and `user` are `other` too), so a client inventing database names cannot
//! grow the exposition.

use prometheus::core::Collector;
use prometheus::{CounterVec, IntCounterVec, IntGaugeVec, Opts, Registry};

/// Registers a collector (for `metrics` too). Names, help texts and label names are
/// constants of this file and `metrics`, so failure is a programming error caught by the unit
/// tests, never something input can reach.
pub(super) fn reg<C: Collector + Clone + 'static>(r: &Registry, c: prometheus::Result<C>) -> C {
    let c = c.expect("static metric definition is valid");
    r.register(Box::new(c.clone()))
        .expect("metric names are unique");
    c
}

/// Most pools with series of their own: pools are per (database, user), and a logged-in
/// client chooses the database name.
pub const MAX_POOL_SERIES: usize = 64;

const LABELS: [&str; 3] = ["pool", "database", "user"];

/// One pool at scrape time.
#[derive(Debug, Clone, Default)]
pub struct PoolSample {
    pub name: String,
    pub database: String,
    pub user: String,
    pub size: u64,
    pub active: u64,
    pub idle: u64,
    /// Kept by an idle client until someone needs it (idle on the server).
    pub parked: u64,
    pub waiting: u64,
    pub pinned: u64,
    /// Clients listening through the pool's listener connection.
    pub listening: u64,
    /// Channels the listener connection listens on.
    pub listen_channels: u64,
    pub connect_attempts: u64,
    pub connect_failures: u64,
    pub checkout_timeouts: u64,
    /// Checkouts refused at once: `max_waiting` clients were already waiting.
    pub waiting_refused: u64,
    /// Sessions checked against Postgres after a unit the parse could not prove harmless.
    pub session_checks: u64,
    /// Checks that found session state the proxy could not see (each also reset).
    pub session_check_differences: u64,
    /// Backends only critical callers may take.
    pub critical_reserve: u64,
    /// The adaptive concurrency limit (`None`: off).
    pub adaptive_limit: Option<u64>,
    /// Transactions completed (a statement outside an explicit transaction is one).
    pub transactions: u64,
    /// Statements completed on a backend.
    pub queries: u64,
    /// Bytes read from this pool's clients after login.
    pub bytes_received: u64,
    /// Bytes read from this pool's backends for its clients (PgBouncer's `total_sent`
    /// counts the same: server bytes, replies the pooler swallows included).
    pub bytes_sent: u64,
    /// Time inside transactions, first statement sent to the end (µs).
    pub transaction_us: u64,
    /// Time of statements on a backend, sent to completed (µs).
    pub query_us: u64,
    /// Time clients waited for a backend of this pool (µs).
    pub wait_us: u64,
}

pub(super) struct PoolSeries {
    connections: IntGaugeVec,
    max_connections: IntGaugeVec,
    waiting: IntGaugeVec,
    pinned: IntGaugeVec,
    listening: IntGaugeVec,
    listen_channels: IntGaugeVec,
    connect_attempts: IntCounterVec,
    connect_failures: IntCounterVec,
    checkout_timeouts: IntCounterVec,
    waiting_refused: IntCounterVec,
    session_checks: IntCounterVec,
    session_check_differences: IntCounterVec,
    critical_reserve: IntGaugeVec,
    adaptive_limit: IntGaugeVec,
    transactions: IntCounterVec,
    queries: IntCounterVec,
    bytes: IntCounterVec,
    transaction_seconds: CounterVec,
    query_seconds: CounterVec,
    wait_seconds: CounterVec,
}

fn labels(extra: &[&'static str]) -> Vec<&'static str> {
    LABELS.iter().chain(extra).copied().collect()
}

impl PoolSeries {
    pub(super) fn register(r: &Registry) -> Self {
        let gauge =
            |name: &str, help: &str| reg(r, IntGaugeVec::new(Opts::new(name, help), &LABELS));
        let counter =
            |name: &str, help: &str| reg(r, IntCounterVec::new(Opts::new(name, help), &LABELS));
        let seconds =
            |name: &str, help: &str| reg(r, CounterVec::new(Opts::new(name, help), &LABELS));
        PoolSeries {
            connections: reg(
                r,
                IntGaugeVec::new(
                    Opts::new(
                        "pgsluice_pool_connections",
                        "Backend connections by pool and state (active, idle, parked).",
                    ),
                    &labels(&["state"]),
                ),
            ),
            max_connections: gauge(
                "pgsluice_pool_max_connections",
                "Configured backend connections per pool (pool size).",
            ),
            waiting: gauge(
                "pgsluice_pool_waiting_clients",
                "Clients waiting for a backend connection.",
            ),
            pinned: gauge(
                "pgsluice_pool_pinned_clients",
                "Clients pinned to one backend connection (session state).",
            ),
            listening: gauge(
                "pgsluice_pool_listening_clients",
                "Clients listening for notifications through the pool's listener connection.",
            ),
            listen_channels: gauge(
                "pgsluice_pool_listen_channels",
                "Channels the pool's listener connection listens on.",
            ),
            connect_attempts: counter(
                "pgsluice_backend_connect_attempts_total",
                "Backend connection attempts.",
            ),
            connect_failures: counter(
                "pgsluice_backend_connect_failures_total",
                "Backend connection attempts that failed.",
            ),
            checkout_timeouts: counter(
                "pgsluice_pool_checkout_timeouts_total",
                "Clients that gave up waiting for a backend connection.",
            ),
            waiting_refused: counter(
                "pgsluice_pool_waiting_refused_total",
                "Checkouts refused at once because pool.max_waiting clients were already waiting.",
            ),
            session_checks: counter(
                "pgsluice_pool_session_checks_total",
                "Backend sessions checked against PostgreSQL after a unit the parse could not prove harmless.",
            ),
            session_check_differences: counter(
                "pgsluice_pool_session_check_differences_total",
                "Session checks that found state the proxy could not see in the statements' text (reset).",
            ),
            critical_reserve: gauge(
                "pgsluice_pool_critical_reserve",
                "Backends of the pool only critical callers may take (pool.critical_reserve).",
            ),
            adaptive_limit: gauge(
                "pgsluice_pool_adaptive_limit",
                "Backends the normal priority may hold now under the adaptive concurrency limit \
                 (pools with pool.adaptive on).",
            ),
            transactions: counter(
                "pgsluice_pool_transactions_total",
                "Transactions completed through the pool (a statement outside an explicit \
                 transaction counts as one).",
            ),
            queries: counter(
                "pgsluice_pool_queries_total",
                "Statements completed on the pool's backends.",
            ),
            bytes: reg(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "pgsluice_pool_bytes_total",
                        "Bytes relayed for the pool's clients: received from them, and read from the \
                         pool's backends for them (sent).",
                    ),
                    &labels(&["direction"]),
                ),
            ),
            transaction_seconds: seconds(
                "pgsluice_pool_transaction_seconds_total",
                "Time spent in transactions, from the first statement sent to the end.",
            ),
            query_seconds: seconds(
                "pgsluice_pool_query_seconds_total",
                "Time statements spent on the pool's backends, sent to completed.",
            ),
            wait_seconds: seconds(
                "pgsluice_pool_wait_seconds_total",
                "Time clients waited for a backend of the pool.",
            ),
        }
    }

    pub(super) fn set(&self, pools: &[PoolSample]) {
        // Dropping every labelled child first removes pools that are gone.
        self.connections.reset();
        self.max_connections.reset();
        self.waiting.reset();
        self.pinned.reset();
        self.listening.reset();
        self.listen_channels.reset();
        self.connect_attempts.reset();
        self.connect_failures.reset();
        self.checkout_timeouts.reset();
        self.waiting_refused.reset();
        self.session_checks.reset();
        self.session_check_differences.reset();
        self.critical_reserve.reset();
        self.adaptive_limit.reset();
        self.transactions.reset();
        self.queries.reset();
        self.bytes.reset();
        self.transaction_seconds.reset();
        self.query_seconds.reset();
        self.wait_seconds.reset();
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let secs = |us: u64| us as f64 / 1e6;
        for p in capped_pools(pools) {
            let l = [p.name.as_str(), p.database.as_str(), p.user.as_str()];
            let with = |extra: &'static str| -> [&str; 4] { [l[0], l[1], l[2], extra] };
            self.connections
                .with_label_values(&with("active"))
                .set(gauge(p.active));
            self.connections
                .with_label_values(&with("idle"))
                .set(gauge(p.idle));
            self.connections
                .with_label_values(&with("parked"))
                .set(gauge(p.parked));
            self.max_connections
                .with_label_values(&l)
                .set(gauge(p.size));
            self.waiting.with_label_values(&l).set(gauge(p.waiting));
            self.pinned.with_label_values(&l).set(gauge(p.pinned));
            self.listening.with_label_values(&l).set(gauge(p.listening));
            self.listen_channels
                .with_label_values(&l)
                .set(gauge(p.listen_channels));
            self.connect_attempts
                .with_label_values(&l)
                .inc_by(p.connect_attempts);
            self.connect_failures
                .with_label_values(&l)
                .inc_by(p.connect_failures);
            self.checkout_timeouts
                .with_label_values(&l)
                .inc_by(p.checkout_timeouts);
            self.waiting_refused
                .with_label_values(&l)
                .inc_by(p.waiting_refused);
            self.session_checks
                .with_label_values(&l)
                .inc_by(p.session_checks);
            self.session_check_differences
                .with_label_values(&l)
                .inc_by(p.session_check_differences);
            self.critical_reserve
                .with_label_values(&l)
                .set(gauge(p.critical_reserve));
            if let Some(a) = p.adaptive_limit {
                self.adaptive_limit.with_label_values(&l).set(gauge(a));
            }
            self.transactions
                .with_label_values(&l)
                .inc_by(p.transactions);
            self.queries.with_label_values(&l).inc_by(p.queries);
            self.bytes
                .with_label_values(&with("received"))
                .inc_by(p.bytes_received);
            self.bytes
                .with_label_values(&with("sent"))
                .inc_by(p.bytes_sent);
            self.transaction_seconds
                .with_label_values(&l)
                .inc_by(secs(p.transaction_us));
            self.query_seconds
                .with_label_values(&l)
                .inc_by(secs(p.query_us));
            self.wait_seconds
                .with_label_values(&l)
                .inc_by(secs(p.wait_us));
        }
    }
}

/// The first [`MAX_POOL_SERIES`]` - 1` pools by name, then one `other` summing the rest.
pub(super) fn capped_pools(pools: &[PoolSample]) -> Vec<PoolSample> {
    let mut sorted: Vec<&PoolSample> = pools.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    if sorted.len() <= MAX_POOL_SERIES {
        return sorted.into_iter().cloned().collect();
    }
    let (kept, rest) = sorted.split_at(MAX_POOL_SERIES - 1);
    let mut other = PoolSample {
        name: "other".to_owned(),
        database: "other".to_owned(),
        user: "other".to_owned(),
        ..PoolSample::default()
    };
    for p in rest {
        other.size += p.size;
        other.active += p.active;
        other.idle += p.idle;
        other.parked += p.parked;
        other.waiting += p.waiting;
        other.pinned += p.pinned;
        other.listening += p.listening;
        other.listen_channels += p.listen_channels;
        other.connect_attempts += p.connect_attempts;
        other.connect_failures += p.connect_failures;
        other.checkout_timeouts += p.checkout_timeouts;
        other.waiting_refused += p.waiting_refused;
        other.session_checks += p.session_checks;
        other.session_check_differences += p.session_check_differences;
        other.critical_reserve += p.critical_reserve;
        other.transactions += p.transactions;
        other.queries += p.queries;
        other.bytes_received += p.bytes_received;
        other.bytes_sent += p.bytes_sent;
        other.transaction_us += p.transaction_us;
        other.query_us += p.query_us;
        other.wait_us += p.wait_us;
    }
    kept.iter()
        .map(|p| (*p).clone())
        .chain(std::iter::once(other))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_beyond_the_cap_are_summed_into_other() {
        let pools: Vec<PoolSample> = (0..MAX_POOL_SERIES + 10)
            .map(|i| PoolSample {
                name: format!("db{i:03}/u"),
                waiting: 1,
                transactions: 2,
                ..PoolSample::default()
            })
            .collect();
        let capped = capped_pools(&pools);
        assert_eq!(capped.len(), MAX_POOL_SERIES);
        let other = capped.last().map(|p| {
            (
                p.name.as_str(),
                p.database.as_str(),
                p.waiting,
                p.transactions,
            )
        });
        assert_eq!(other, Some(("other", "other", 11, 22)));
    }
}
