//! Admission control: may this statement run now, after a wait, or not at all (DESIGN §5).
//!
//! [`Policy::admit`] evaluates, in order, and the first refusal wins:
//! 1. fingerprint rules ([`rules`]): REJECT, THROTTLE (refuse, or wait for a token up to the
//!    caller's queue timeout), CONCURRENCY, TIMEOUT overrides; warn-mode rules only add a
//!    notice;
//! 2. caller limits: the caller's `max_qps` bucket ([`bucket`]), then its concurrency slots
//!    and FIFO queue ([`limiter`]);
//! 3. the circuit breaker ([`breaker`]).
//!
//! One deviation from a strictly sequential reading: if the caller has to queue for a slot
//! and the breaker would shed it anyway, it is refused with `ERR_CIRCUIT_OPEN` at once rather
//! than after waiting — "fail fast" while open is the point of the breaker. A caller whose
//! queue is full still gets `ERR_CALLER_LIMIT_EXCEEDED`, as the order says.
//!
//! The result is an [`Admission`] — an RAII bundle of the caller permit, the rule CONCURRENCY
//! slot and the breaker ticket, plus timeout overrides and warn-mode notices — or a
//! [`Refusal`] carrying SQLSTATE, message, DETAIL and a jittered retry hint ([`refusal`]).
//!
//! What this module must not do: touch sockets, import other pgsluice modules, or decide which
//! errors are backend faults. Callers arrive as `u16` ids (index into the configured list,
//! the last entry being the catch-all `default`; an unknown id is treated as that last entry so
//! that a reload shrinking the list cannot panic a session) and fingerprints as `u64`.
//!
//! A rate token (rule THROTTLE or caller `max_qps`) is spent when that check passes, even if a
//! later check refuses the statement: the buckets bound how fast statements *arrive* at each
//! gate, which keeps a refused flood from refilling its own budget.
//!
//! Fleet scope (issue 10): a caller or THROTTLE rule marked `scope: fleet` takes its rate
//! tokens from a bucket shared by every instance ([`lease`]; the fleet module fills the
//! leases), and a fleet-scoped caller's `max_concurrency` is split between the live members
//! ([`Policy::set_fleet_members`]). Without a fleet such limits act like local ones.
//!
//! Hot reload: [`Policy::rebuild`] makes the new caller table for the runtime snapshot and
//! [`Policy::install`] follows the snapshot's swap. Callers are matched
//! by name, so their in-flight permits, queues and counters carry over; new limits apply to new
//! acquisitions. A `max_qps` bucket is kept when its rate and burst are unchanged.

pub mod arrival;
pub mod breaker;
pub mod bucket;
pub mod drain;
pub mod lease;
pub mod limiter;
pub mod refusal;
pub mod rule_spec;
pub mod rules;
pub mod share;

#[cfg(test)]
mod admit_tests;
#[cfg(test)]
mod rules_tests;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::RwLock;
use serde::{Deserialize, Serialize, Serializer};
use tokio::time::Instant;

use self::breaker::{
    Breaker, BreakerRefusal, BreakerSettings, BreakerSnapshot, BreakerState, BreakerTicket,
    TransitionObserver,
};
use self::bucket::{MAX_RATE, TokenBucket};
use self::drain::DrainRate;
use self::lease::{FleetGate, Rate};
use self::limiter::{CallerPermit, LimitRefusal, Limiter, Limits};
use self::refusal::{Backoff, Reason};
use self::rules::{RuleAction, RuleCheck, RuleGuard, RuleSet, RuleViolation, fingerprint_hex};

pub use self::refusal::{Refusal, RefusalKind, RetryPolicy};

/// Caller priority. Derived order is serving order: `Critical < High < Normal < Low`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    Critical,
    High,
    #[default]
    Normal,
    Low,
}

impl Priority {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Critical => "critical",
            Self::High => "high",
            Self::Normal => "normal",
            Self::Low => "low",
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `"critical"` etc. was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown priority {0:?}; expected critical, high, normal or low")]
pub struct UnknownPriority(pub String);

impl FromStr for Priority {
    type Err = UnknownPriority;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "critical" => Ok(Self::Critical),
            "high" => Ok(Self::High),
            "normal" => Ok(Self::Normal),
            "low" => Ok(Self::Low),
            _ => Err(UnknownPriority(s.to_owned())),
        }
    }
}

/// Whether a limit is this instance's own or shared by a fleet of instances (issue 10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    #[default]
    Instance,
    /// Rates lease tokens from a bucket shared through Redis ([`lease`]); concurrency is
    /// split evenly between the live instances (`max_concurrency / live`, at least 1).
    Fleet,
}

/// One caller's limits, as the config module hands them over.
#[derive(Debug, Clone, PartialEq)]
pub struct CallerPolicy {
    pub name: String,
    pub max_concurrency: u32,
    /// Waiters once `max_concurrency` is reached; 0 refuses at once.
    pub queue_depth: u32,
    /// Longest wait for a slot (and for a THROTTLE-QUEUE token), counted from arrival.
    pub queue_timeout: Duration,
    pub priority: Priority,
    /// Token-bucket rate; `None` = unlimited.
    pub max_qps: Option<f64>,
    /// Bucket capacity; defaults to one second's worth of `max_qps`.
    pub burst: Option<u32>,
    /// `Fleet`: `max_qps` and `max_concurrency` hold for the whole fleet.
    pub scope: Scope,
    /// The retry hints its refusals carry.
    pub retry: RetryPolicy,
    /// Longest a client of this caller may sit idle inside a transaction; `None` = no limit.
    pub idle_transaction_timeout: Option<Duration>,
    /// Its claim on backend time among callers of its priority when `pool.fair_shares` is on.
    pub weight: u32,
    /// Most of a pool's backend time over the window it may hold ([`share`]).
    pub db_time_share: Option<f64>,
}

/// The caller table or breaker settings were unusable; nothing was applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("callers[{index}].{field}: {message}")]
pub struct PolicyError {
    pub index: usize,
    pub field: &'static str,
    pub message: String,
}

/// What `admit` needs to know about a statement. Plain data, built per statement.
#[derive(Debug, Clone, Copy)]
pub struct AdmitRequest {
    /// Index into the caller table.
    pub caller: u16,
    pub fingerprint: u64,
    /// Arrival time; queue deadlines count from here.
    pub now: Instant,
}

/// A statement may run. Hold this until the statement (in transaction mode: the backend) is
/// released; dropping it gives back the caller slot, the rule slot and the breaker ticket.
#[derive(Debug)]
pub struct Admission {
    /// The runtime rule that matched (metrics label), if any.
    pub rule_action: Option<&'static str>,
    pub caller: u16,
    /// From a TIMEOUT rule. `Some(ZERO)` means "no timeout" (Postgres reads 0 that way).
    pub statement_timeout_override: Option<Duration>,
    pub lock_timeout_override: Option<Duration>,
    /// From a ROUTE rule: where the statement's plain read goes (`Some(true)`: replicas).
    pub route_replica: Option<bool>,
    /// From a COALESCE rule: the read may share one execution with identical ones.
    pub coalesce: Option<rules::CoalesceRule>,
    /// Warn-mode rule notices for the session to send as NOTICE before running the statement.
    pub warnings: Vec<String>,
    /// Time spent waiting (THROTTLE-QUEUE token plus caller queue), for the queue-wait
    /// histogram.
    pub queue_wait: Duration,
    _permit: CallerPermit,
    _rule_guard: Option<RuleGuard>,
    ticket: BreakerTicket,
}

impl Admission {
    /// Only the caller's concurrency permit, the rest (a rule's slot, the breaker's
    /// in-flight count) given back: what a client that keeps its backend between units
    /// (pinned) holds while it idles.
    pub fn into_caller_permit(self) -> CallerPermit {
        self._permit
    }

    /// Admitted as a half-open trial of the breaker.
    pub fn is_breaker_trial(&self) -> bool {
        self.ticket.is_probe()
    }
}

/// A statement admitted by the rules inside an already admitted unit.
#[derive(Debug, Default)]
pub struct StatementAdmission {
    /// The runtime rule that matched (metrics label), if any.
    pub rule_action: Option<&'static str>,
    pub statement_timeout_override: Option<Duration>,
    pub lock_timeout_override: Option<Duration>,
    /// From a ROUTE rule (see [`Admission::route_replica`]).
    pub route_replica: Option<bool>,
    /// From a COALESCE rule (see [`Admission::coalesce`]).
    pub coalesce: Option<rules::CoalesceRule>,
    /// Warn-mode notices to send to the client.
    pub warnings: Vec<String>,
    _rule_guard: Option<RuleGuard>,
    _ticket: Option<BreakerTicket>,
}

/// Refusals of one caller, by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RefusalCounts {
    pub caller_limit: u64,
    pub queue_timeout: u64,
    pub rate_limited: u64,
    pub query_blocked: u64,
    pub circuit_open: u64,
    pub query_concurrency: u64,
}

/// One caller in `GET /v1/callers`.
#[derive(Debug, Clone, Serialize)]
pub struct CallerSnapshot {
    pub id: u16,
    pub name: String,
    pub priority: Priority,
    pub max_concurrency: u32,
    pub queue_depth: u32,
    pub queue_timeout_ms: u64,
    pub max_qps: Option<f64>,
    pub burst: Option<u32>,
    pub scope: Scope,
    /// This instance's share of `max_concurrency` (all of it unless `scope` is fleet).
    pub local_max_concurrency: u32,
    pub in_flight: u32,
    pub queued: u32,
    pub admitted: u64,
    pub refusals: RefusalCounts,
    /// What the arrival decisions of its queue did.
    pub arrival: arrival::ArrivalStats,
    /// Its claim on backend time among its priority's callers (`pool.fair_shares`).
    pub weight: u32,
    /// Most of a pool's backend time over the window it may hold (`None`: no limit).
    pub db_time_share: Option<f64>,
    /// Backend time its units held, in all pools (filled in from the pools).
    pub backend_seconds_total: f64,
    /// Its share of the backend time over the window, in the pool where it is largest.
    pub backend_share: f64,
}

/// The policy engine shared by all sessions.
pub struct Policy {
    /// The table installed last (for the admin API, fleet shares and callers that hold no
    /// snapshot of their own); sessions use the one in the runtime snapshot they loaded.
    callers: RwLock<CallerTable>,
    breaker: Breaker,
    rules: Arc<RuleSet>,
}

/// The callers' limits and live state, indexed by caller id (last = `default`). One value
/// per reload: a session takes it from the same snapshot as the matcher that gave it the
/// id, so an id never meets another configuration's table.
#[derive(Clone)]
pub struct CallerTable(Arc<[Arc<CallerState>]>);

impl std::fmt::Debug for CallerTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|c| &c.policy.name))
            .finish()
    }
}

impl CallerTable {
    /// `(id, state)` for a caller id, out-of-range ids mapping to the last (`default`) entry.
    fn caller(&self, id: u16) -> (u16, &Arc<CallerState>) {
        let last = self.0.len() - 1; // never empty: build_table refuses an empty list
        let index = usize::from(id).min(last);
        (u16::try_from(index).unwrap_or(u16::MAX), &self.0[index])
    }

    /// The longest wait of caller `id` for a slot (it also bounds its wait for a backend).
    pub fn queue_timeout(&self, id: u16) -> Duration {
        self.caller(id).1.policy.queue_timeout
    }

    /// A login of caller `id` should wait at the door: its queue is full, or the waiters
    /// queued now and the `coming` logins let in ahead of it, at the pace its slots come
    /// back, would keep it waiting more than half of `room`, or that pace is not known yet.
    pub fn crowded(&self, id: u16, room: Duration, now: Instant, coming: usize) -> bool {
        let c = self.caller(id).1;
        let (released, queued) = c.limiter.drain_counts();
        let coming = u32::try_from(coming).unwrap_or(u32::MAX);
        let limits = c.limiter.limits();
        if limits.queue_depth == 0
            || (queued == 0
                && c.limiter.in_flight().saturating_add(coming) < limits.max_concurrency)
        {
            // A caller without a queue never makes its clients wait (it refuses at once,
            // with a hint); otherwise it and those coming ahead of it would be admitted
            // without a wait.
            return false;
        }
        let waiting = queued.saturating_add(coming);
        if waiting >= limits.queue_depth {
            return true;
        }
        // Until the pace is known (as `Pool::crowded`), a queue counts as crowded — here
        // even before anyone queues: a caller's first wave of a storm would otherwise all
        // pass before its permits told how fast they come back (logins that never send
        // stop counting as coming within a second, and free permits let them in).
        c.stats
            .drain
            .expected_wait(released, u64::from(waiting), now)
            .is_none_or(|w| w > room / 2)
    }

    /// The longest a client of caller `id` may stay idle inside a transaction.
    pub fn idle_transaction_timeout(&self, id: u16) -> Option<Duration> {
        self.caller(id).1.policy.idle_transaction_timeout
    }

    /// Caller `id`'s priority (unknown ids are the default caller).
    pub fn priority(&self, id: u16) -> Priority {
        self.caller(id).1.policy.priority
    }

    /// Caller `id` asking a pool for a backend: its priority, weight and time share.
    pub fn asker(&self, id: u16) -> share::Asker {
        let (id, c) = self.caller(id);
        share::Asker {
            priority: c.policy.priority as usize,
            caller: Some(id),
            weight: c.policy.weight,
            share: c.policy.db_time_share,
        }
    }
}

/// Per-caller runtime state; rebuilt on reload around the same limiter and stats.
struct CallerState {
    policy: CallerPolicy,
    limiter: Limiter,
    bucket: Option<Arc<Rate>>,
    stats: Arc<CallerStats>,
}

struct CallerStats {
    admitted: AtomicU64,
    refusals: [AtomicU64; RefusalKind::ALL.len()],
    backoff: Backoff,
    /// How fast the caller's slots come back (for the retry hints of its queue).
    drain: DrainRate,
}

impl Policy {
    /// Build from the caller table (index = caller id, last = `default`) and breaker config,
    /// with an empty rule set.
    pub fn new(callers: Vec<CallerPolicy>, breaker: BreakerSettings) -> Result<Self, PolicyError> {
        Self::with_rules(callers, breaker, Arc::new(RuleSet::new()))
    }

    /// As [`Policy::new`], sharing a rule set (e.g. one loaded from the rules file).
    pub fn with_rules(
        callers: Vec<CallerPolicy>,
        breaker: BreakerSettings,
        rules: Arc<RuleSet>,
    ) -> Result<Self, PolicyError> {
        let now = Instant::now();
        let table = build_table(callers, &[], now, rules.gate())?;
        Ok(Self {
            callers: RwLock::new(CallerTable(table)),
            breaker: Breaker::new(breaker, now),
            rules,
        })
    }

    /// Hot reload, first half: the caller table for `callers`, validated whole (an error
    /// changes nothing). Callers that keep their name keep their live state (slots, queue,
    /// bucket, counters) from the table installed last. Nothing is installed: the table goes
    /// into the runtime snapshot sessions and readers load, and then to [`Policy::install`];
    /// the caller serialises reloads (each builds on the table installed before it).
    pub fn rebuild(&self, callers: Vec<CallerPolicy>) -> Result<CallerTable, PolicyError> {
        let old = self.table();
        Ok(CallerTable(build_table(
            callers,
            &old.0,
            Instant::now(),
            self.rules.gate(),
        )?))
    }

    /// Hot reload, second half, right after the runtime snapshot holding `table` was swapped
    /// in: the table the next rebuild starts from and fleet shares apply to, and the
    /// breaker's settings.
    pub fn install(&self, table: CallerTable, breaker: BreakerSettings) {
        *self.callers.write() = table;
        self.breaker.set_config(breaker);
    }

    /// The caller table installed last.
    pub fn table(&self) -> CallerTable {
        self.callers.read().clone()
    }

    /// The fleet learned a new number of live instances: fleet-scoped callers get their new
    /// share of `max_concurrency`, fleet buckets their new local share.
    pub fn set_fleet_members(&self, members: u32) {
        let gate = self.rules.gate();
        if gate.members() == members.max(1) {
            return;
        }
        gate.set_members(members);
        for c in self.callers.read().0.iter() {
            let limits = local_limits(&c.policy, gate.members());
            if c.limiter.limits() != limits {
                c.limiter.set_limits(limits);
            }
        }
    }

    /// Runtime fingerprint rules (for the admin API and persistence).
    pub fn rules(&self) -> &Arc<RuleSet> {
        &self.rules
    }

    /// Called on every breaker transition, outside any lock (logs, metrics).
    pub fn set_transition_observer(&self, observer: Option<TransitionObserver>) {
        self.breaker.set_observer(observer);
    }

    /// Caller id for a name in the current table.
    pub fn caller_id(&self, name: &str) -> Option<u16> {
        let table = self.callers.read();
        table
            .0
            .iter()
            .position(|c| c.policy.name == name)
            .and_then(|i| u16::try_from(i).ok())
    }

    /// Steps shared by [`Policy::admit`] and [`Policy::check_statement`]: (1) the fingerprint
    /// rules, which may wait for a THROTTLE-QUEUE token, and (2a) the caller's rate bucket.
    /// Returns the statement's admission so far, the time after any wait, and whether it waited.
    /// Its rare waits (a fleet lease, a QUEUE rule's delay) are boxed, and so is the
    /// caller's queue in [`Policy::admit_in`]: the futures stay small, and the session moves
    /// them on every statement.
    async fn rules_and_rate(
        &self,
        id: u16,
        caller: &CallerState,
        req: &AdmitRequest,
    ) -> Result<(StatementAdmission, Instant, bool), Refusal> {
        let policy = &caller.policy;
        let mut now = req.now;
        let mut waited = false;
        let mut admission = StatementAdmission::default();
        let mut check = self.rules.check(
            req.fingerprint,
            &policy.name,
            now,
            policy.queue_timeout,
            true,
        );
        if let RuleCheck::AwaitLease { bucket, until } = check {
            // A fleet THROTTLE whose lease ran dry: wait for a token (REJECT: briefly, while
            // the shared bucket may have one; QUEUE: up to the caller's queue timeout).
            Box::pin(bucket.wait_for_token(until)).await;
            now = Instant::now();
            waited = true;
            check = self.rules.check(
                req.fingerprint,
                &policy.name,
                now,
                policy.queue_timeout,
                false,
            );
        }
        match check {
            RuleCheck::NoRule | RuleCheck::AwaitLease { .. } => {}
            RuleCheck::Refuse { rule, violation } => {
                let reason = rule_reason(req.fingerprint, rule.def(), &violation);
                let mut r = self.refuse(id, caller, reason, req.fingerprint, now);
                r.rule_action = Some(rule.def().action.name());
                return Err(r);
            }
            RuleCheck::Admit(a) => {
                if let Some(v) = &a.would_refuse {
                    admission
                        .warnings
                        .push(rule_reason(req.fingerprint, a.rule.def(), v).warning());
                }
                admission.rule_action = Some(a.rule.def().action.name());
                admission.statement_timeout_override = a.statement_timeout;
                admission.lock_timeout_override = a.lock_timeout;
                admission.route_replica = a.route_replica;
                admission.coalesce = a.coalesce;
                admission._rule_guard = a.guard;
                if !a.wait.is_zero() {
                    Box::pin(tokio::time::sleep_until(now + a.wait)).await;
                    now = Instant::now();
                    waited = true;
                }
            }
        }
        if let Some(bucket) = &caller.bucket
            && let Err(wait) = bucket.take(now).await
        {
            let what = format!("caller {} is over max_qps={}", policy.name, bucket.rate());
            let detail = format!(
                "limit: caller {} max_qps={}, burst={}",
                policy.name,
                bucket.rate(),
                bucket.burst()
            );
            let reason = Reason::new(RefusalKind::RateLimited, what, detail, wait);
            return Err(self.refuse(id, caller, reason, req.fingerprint, now));
        }
        Ok((admission, now, waited))
    }

    /// Decide on one statement. May wait (THROTTLE-QUEUE token, caller queue) up to the
    /// caller's queue timeout; cancel-safe — dropping the future gives everything back.
    pub async fn admit(&self, req: &AdmitRequest) -> Result<Admission, Refusal> {
        self.admit_in(&self.table(), req).await
    }

    /// [`Policy::admit`] against `table`, the one of the snapshot `req.caller` was resolved in.
    pub async fn admit_in(
        &self,
        table: &CallerTable,
        req: &AdmitRequest,
    ) -> Result<Admission, Refusal> {
        let (id, caller) = table.caller(req.caller);
        let policy = &caller.policy;
        let deadline = req
            .now
            .checked_add(policy.queue_timeout)
            .unwrap_or_else(|| req.now + Duration::from_secs(86_400));
        // 1. Fingerprint rules, 2a. caller rate.
        let (stmt, mut now, mut waited) = self.rules_and_rate(id, caller, req).await?;

        // 2b. Caller concurrency, queueing if allowed.
        let permit = match caller.limiter.try_acquire() {
            Some(permit) => permit,
            None => {
                let limiter = &caller.limiter;
                if limiter.queued() < limiter.limits().queue_depth
                    && let Some(shed) = self.breaker.would_shed(policy.priority, now)
                {
                    let reason = self.circuit_reason(policy, &shed);
                    return Err(self.refuse(id, caller, reason, req.fingerprint, now));
                }
                let acquired = Box::pin(limiter.acquire(deadline)).await;
                now = Instant::now();
                waited = true;
                match acquired {
                    Ok(permit) => permit,
                    Err(refusal) => {
                        let reason = limit_reason(policy, &refusal);
                        return Err(self.refuse(id, caller, reason, req.fingerprint, now));
                    }
                }
            }
        };

        self.admitted((id, caller), req, permit, stmt, now, waited)
    }

    /// Steps (1) and (2a) have nothing to do for `caller`, so nothing in them can wait: no
    /// fingerprint rule is loaded (the first thing [`RuleSet::check`] looks at) and the
    /// caller has no `max_qps`.
    #[inline(always)]
    fn rules_and_rate_are_idle(&self, caller: &CallerState) -> bool {
        caller.bucket.is_none() && self.rules.is_empty()
    }

    /// [`Policy::admit_in`] when none of its steps can wait: no fingerprint rule is loaded,
    /// the caller has no `max_qps`, and a concurrency slot is free. `None` otherwise, with
    /// nothing taken: the caller then awaits [`Policy::admit_in`]. The usual statement is
    /// decided here, without a future made and polled for it.
    #[inline(always)]
    pub fn admit_now(
        &self,
        table: &CallerTable,
        req: &AdmitRequest,
    ) -> Option<Result<Admission, Refusal>> {
        let (id, caller) = table.caller(req.caller);
        if !self.rules_and_rate_are_idle(caller) {
            return None;
        }
        let permit = caller.limiter.try_acquire()?;
        let stmt = StatementAdmission::default();
        Some(self.admitted((id, caller), req, permit, stmt, req.now, false))
    }

    /// The last step of an admission, with a concurrency slot held: (3) the circuit breaker.
    #[inline(always)]
    fn admitted(
        &self,
        (id, caller): (u16, &CallerState),
        req: &AdmitRequest,
        permit: CallerPermit,
        stmt: StatementAdmission,
        now: Instant,
        waited: bool,
    ) -> Result<Admission, Refusal> {
        let policy = &caller.policy;
        // 3. Circuit breaker.
        let ticket = match self.breaker.allow(policy.priority, now) {
            Ok(ticket) => ticket,
            Err(shed) => {
                let reason = self.circuit_reason(policy, &shed);
                return Err(self.refuse(id, caller, reason, req.fingerprint, now));
            }
        };

        caller.stats.admitted.fetch_add(1, Ordering::Relaxed);
        Ok(Admission {
            caller: id,
            rule_action: stmt.rule_action,
            statement_timeout_override: stmt.statement_timeout_override,
            lock_timeout_override: stmt.lock_timeout_override,
            route_replica: stmt.route_replica,
            coalesce: stmt.coalesce,
            warnings: stmt.warnings,
            queue_wait: if waited {
                now.saturating_duration_since(req.now)
            } else {
                Duration::ZERO
            },
            _permit: permit,
            _rule_guard: stmt._rule_guard,
            ticket,
        })
    }

    /// Rules only, for a statement inside a unit that already holds an [`Admission`] (a
    /// transaction on a borrowed backend): the caller's concurrency is already counted.
    pub async fn check_statement(&self, req: &AdmitRequest) -> Result<StatementAdmission, Refusal> {
        self.check_statement_in(&self.table(), req).await
    }

    /// [`Policy::check_statement`] against `table` (see [`Policy::admit_in`]).
    pub async fn check_statement_in(
        &self,
        table: &CallerTable,
        req: &AdmitRequest,
    ) -> Result<StatementAdmission, Refusal> {
        let (id, caller) = table.caller(req.caller);
        // 1. Rules and 2a. the caller's rate: every statement takes a token, pipelined or
        //    not. (Concurrency is already counted: the unit holds its backend and its slot.)
        let (admission, now, _) = self.rules_and_rate(id, caller, req).await?;
        self.statement_checked((id, caller), req, admission, now)
    }

    /// [`Policy::check_statement_in`] when none of its steps can wait (no fingerprint rule
    /// loaded, no `max_qps` for the caller); `None` otherwise, with nothing taken.
    #[inline(always)]
    pub fn check_statement_now(
        &self,
        table: &CallerTable,
        req: &AdmitRequest,
    ) -> Option<Result<StatementAdmission, Refusal>> {
        let (id, caller) = table.caller(req.caller);
        if !self.rules_and_rate_are_idle(caller) {
            return None;
        }
        let admission = StatementAdmission::default();
        Some(self.statement_checked((id, caller), req, admission, req.now))
    }

    /// The last step of a statement's check: the circuit breaker.
    #[inline(always)]
    fn statement_checked(
        &self,
        (id, caller): (u16, &CallerState),
        req: &AdmitRequest,
        admission: StatementAdmission,
        now: Instant,
    ) -> Result<StatementAdmission, Refusal> {
        let policy = &caller.policy;
        // 3. Circuit breaker: an open breaker sheds the statement, but it takes no ticket of
        //    its own — the unit's admission holds the one that counts it in flight (a ticket
        //    per statement counted every open transaction twice, and its later statements
        //    used up the in-flight threshold and the critical reserve by themselves).
        if let Some(shed) = self.breaker.would_shed(policy.priority, now) {
            let reason = self.circuit_reason(policy, &shed);
            return Err(self.refuse(id, caller, reason, req.fingerprint, now));
        }
        caller.stats.admitted.fetch_add(1, Ordering::Relaxed);
        Ok(admission)
    }

    /// Outcome of a statement that reached the backend: `false` for backend faults only
    /// (errors, timeouts, lost connections), `true` otherwise.
    pub fn record_backend_result(&self, ok: bool) {
        self.record_backend_result_at(ok, Instant::now());
    }

    /// [`Policy::record_backend_result`] with the clock already read.
    pub fn record_backend_result_at(&self, ok: bool, now: Instant) {
        if ok {
            self.breaker.on_success(now);
        } else {
            self.breaker.on_failure(now);
        }
    }

    /// A health-probe reading (e.g. DB CPU %).
    pub fn on_probe(&self, value: f64) {
        self.breaker.on_probe(value, Instant::now());
    }

    /// Per-caller limits, load and refusals of the table installed last.
    pub fn callers(&self) -> Vec<CallerSnapshot> {
        self.callers_in(&self.table())
    }

    /// Per-caller limits, load and refusals of `table` (a runtime snapshot's).
    pub fn callers_in(&self, table: &CallerTable) -> Vec<CallerSnapshot> {
        table
            .0
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let p = &c.policy;
                let r = |k: RefusalKind| c.stats.refusals[k.index()].load(Ordering::Relaxed);
                CallerSnapshot {
                    id: u16::try_from(i).unwrap_or(u16::MAX),
                    name: p.name.clone(),
                    weight: p.weight,
                    db_time_share: p.db_time_share,
                    backend_seconds_total: 0.0,
                    backend_share: 0.0,
                    priority: p.priority,
                    max_concurrency: p.max_concurrency,
                    queue_depth: p.queue_depth,
                    queue_timeout_ms: u64::try_from(p.queue_timeout.as_millis())
                        .unwrap_or(u64::MAX),
                    max_qps: c.bucket.as_ref().map(|b| b.rate()),
                    burst: c.bucket.as_ref().map(|b| b.burst()),
                    scope: p.scope,
                    local_max_concurrency: c.limiter.limits().max_concurrency,
                    in_flight: c.limiter.in_flight(),
                    queued: c.limiter.queued(),
                    admitted: c.stats.admitted.load(Ordering::Relaxed),
                    arrival: c.limiter.arrival_stats(),
                    refusals: RefusalCounts {
                        caller_limit: r(RefusalKind::CallerLimitExceeded),
                        queue_timeout: r(RefusalKind::QueueTimeout),
                        rate_limited: r(RefusalKind::RateLimited),
                        query_blocked: r(RefusalKind::QueryBlocked),
                        circuit_open: r(RefusalKind::CircuitOpen),
                        query_concurrency: r(RefusalKind::QueryConcurrency),
                    },
                }
            })
            .collect()
    }

    /// Breaker state for `GET /v1/breaker` and metrics.
    pub fn breaker(&self) -> BreakerSnapshot {
        self.breaker.snapshot(Instant::now())
    }

    /// Current breaker state only (cheap enough for a gauge).
    pub fn breaker_state(&self) -> BreakerState {
        self.breaker.state(Instant::now())
    }

    /// A retry hint for a refusal outside admission (a pool checkout that timed out, a
    /// database that cannot be reached) for caller `id`: its retry policy and refusal streak,
    /// or — with the refusing queue's `expected` wait — spread around that wait.
    pub fn retry_hint_ms(&self, id: u16, expected: Option<Duration>) -> u64 {
        self.retry_hint_ms_in(&self.table(), id, expected)
    }

    /// [`Policy::retry_hint_ms`] against `table` (see [`Policy::admit_in`]).
    pub fn retry_hint_ms_in(
        &self,
        table: &CallerTable,
        id: u16,
        expected: Option<Duration>,
    ) -> u64 {
        let (_, caller) = table.caller(id);
        caller.stats.backoff.retry_after_ms(
            &caller.policy.retry,
            Duration::ZERO,
            expected,
            Instant::now(),
        )
    }

    /// The retry hint of a client refused with its `place` in a queue (when its turn would
    /// come, [`arrival`]): that place as is — the places of one queue's refused clients are
    /// spread one service apart already — but not below the caller's `retry_floor_ms`.
    pub fn place_hint_ms(&self, table: &CallerTable, id: u16, place: Duration) -> u64 {
        let (_, caller) = table.caller(id);
        let at = place.max(caller.policy.retry.floor);
        u64::try_from(at.as_millis()).unwrap_or(u64::MAX).max(1)
    }

    /// A retry hint for a connection refused before its caller is known (too many clients
    /// or handshakes, no backend at login): the `default` caller's policy and streak, or the
    /// refusing queue's `expected` wait.
    pub fn connection_hint_ms(&self, expected: Option<Duration>) -> u64 {
        self.retry_hint_ms(u16::MAX, expected)
    }

    fn refuse(
        &self,
        id: u16,
        caller: &CallerState,
        reason: Reason,
        fingerprint: u64,
        now: Instant,
    ) -> Refusal {
        caller.stats.refusals[reason.kind.index()].fetch_add(1, Ordering::Relaxed);
        let retry = if reason.kind.retryable() {
            // A full queue or a wait that ran out: say when a slot is expected to be free.
            let expected = match reason.kind {
                RefusalKind::CallerLimitExceeded | RefusalKind::QueueTimeout => {
                    let (released, queued) = caller.limiter.drain_counts();
                    caller
                        .stats
                        .drain
                        .expected_wait(released, u64::from(queued), now)
                }
                _ => None,
            };
            caller
                .stats
                .backoff
                .retry_after_ms(&caller.policy.retry, reason.floor, expected, now)
        } else {
            0
        };
        reason.into_refusal(retry, id, fingerprint)
    }

    fn circuit_reason(&self, policy: &CallerPolicy, shed: &BreakerRefusal) -> Reason {
        let config = self.breaker.config();
        let limit = match shed.reason {
            Some(breaker::TripReason::ConsecutiveErrors) => {
                format!("consecutive_errors={}", config.consecutive_errors)
            }
            Some(breaker::TripReason::Inflight) => format!(
                "max_inflight_threshold={}",
                config.max_inflight_threshold.unwrap_or(0)
            ),
            Some(breaker::TripReason::Probe) => format!(
                "db_cpu_threshold_percent={}",
                config.db_cpu_threshold_percent.unwrap_or(f64::NAN)
            ),
            Some(breaker::TripReason::TrialFailed) => "a half-open trial failed".to_owned(),
            None => "tripped".to_owned(),
        };
        if shed.reason == Some(breaker::TripReason::Inflight) && shed.state == BreakerState::Closed
        {
            let threshold = config.max_inflight_threshold.unwrap_or(0);
            let (what, detail) = if shed.reserve_full {
                (
                    format!(
                        "more than max_inflight_threshold={threshold} statements are in flight \
                         and the critical reserve above it is in use (caller {} has priority {})",
                        policy.name, policy.priority
                    ),
                    format!(
                        "limit: circuit_breaker max_inflight_threshold={threshold}, \
                         critical_reserve={}",
                        config.critical_reserve
                    ),
                )
            } else {
                (
                    format!(
                        "more than max_inflight_threshold={threshold} statements are in flight; \
                         only critical traffic is admitted until fewer are (caller {} has \
                         priority {})",
                        policy.name, policy.priority
                    ),
                    format!("limit: circuit_breaker max_inflight_threshold={threshold}"),
                )
            };
            return Reason::new(RefusalKind::CircuitOpen, what, detail, shed.retry_after);
        }
        let state = match shed.state {
            BreakerState::HalfOpen if !shed.reserve_full => {
                "half-open and its trial slots are busy"
            }
            BreakerState::HalfOpen => "half-open",
            _ => "open",
        };
        let (what, detail) = if shed.reserve_full {
            (
                format!(
                    "circuit breaker is {state} and the critical reserve is in use (caller {} \
                     has priority {})",
                    policy.name, policy.priority
                ),
                format!(
                    "limit: circuit_breaker critical_reserve={} ({limit}), open_ms={}",
                    config.critical_reserve,
                    config.open.as_millis()
                ),
            )
        } else {
            (
                format!(
                    "circuit breaker is {state}; only critical traffic is admitted (caller {} \
                     has priority {})",
                    policy.name, policy.priority
                ),
                format!(
                    "limit: circuit_breaker {limit}, open_ms={}",
                    config.open.as_millis()
                ),
            )
        };
        Reason::new(RefusalKind::CircuitOpen, what, detail, shed.retry_after)
    }
}

fn limit_reason(policy: &CallerPolicy, refusal: &LimitRefusal) -> Reason {
    let name = &policy.name;
    match refusal {
        LimitRefusal::LimitExceeded {
            limits,
            in_flight,
            queued,
            ..
        } => Reason::new(
            RefusalKind::CallerLimitExceeded,
            format!(
                "caller {name} is at max_concurrency={} and its queue is full",
                limits.max_concurrency
            ),
            format!(
                "limit: caller {name} max_concurrency={}, queue_depth={} (in flight {in_flight}, queued {queued})",
                limits.max_concurrency, limits.queue_depth
            ),
            Duration::ZERO,
        ),
        LimitRefusal::QueueTimeout { limits, waited, .. } => Reason::new(
            RefusalKind::QueueTimeout,
            format!(
                "caller {name} waited {} ms for one of its max_concurrency={} slots",
                waited.as_millis(),
                limits.max_concurrency
            ),
            format!(
                "limit: caller {name} queue_timeout_ms={}, max_concurrency={}",
                policy.queue_timeout.as_millis(),
                limits.max_concurrency
            ),
            Duration::ZERO,
        ),
    }
}

fn rule_reason(fp: u64, def: &rules::RuleDef, violation: &RuleViolation) -> Reason {
    let hex = fingerprint_hex(fp);
    let suffix = def
        .error_message
        .as_deref()
        .map(|m| format!(": {m}"))
        .unwrap_or_default();
    match (violation, &def.action) {
        (
            RuleViolation::RateLimited { retry_after },
            RuleAction::Throttle {
                max_qps,
                burst,
                on_exceed,
            },
        ) => Reason::new(
            RefusalKind::RateLimited,
            format!("fingerprint {hex} is throttled to max_qps={max_qps} by a rule{suffix}"),
            format!(
                "limit: rule on fingerprint {hex} max_qps={max_qps}, burst={burst}, action_on_exceed={}",
                match on_exceed {
                    rules::OnExceed::Reject => "REJECT",
                    rules::OnExceed::Queue => "QUEUE",
                }
            ),
            *retry_after,
        ),
        (RuleViolation::RateLimited { retry_after }, _) => Reason::new(
            RefusalKind::RateLimited,
            format!("fingerprint {hex} is throttled by a rule{suffix}"),
            format!("limit: rule on fingerprint {hex}"),
            *retry_after,
        ),
        (RuleViolation::Concurrency { max_inflight }, _) => Reason::new(
            RefusalKind::QueryConcurrency,
            format!("fingerprint {hex} is at max_inflight={max_inflight} set by a rule{suffix}"),
            format!("limit: rule on fingerprint {hex} max_inflight={max_inflight}"),
            Duration::ZERO,
        ),
        (RuleViolation::Blocked, _) => Reason::new(
            RefusalKind::QueryBlocked,
            format!("fingerprint {hex} is blocked by a rule{suffix}"),
            format!("limit: rule on fingerprint {hex} action=REJECT (not retryable)"),
            Duration::ZERO,
        ),
    }
}

/// What this instance enforces of a caller's limits: a fleet-scoped caller gets
/// `max_concurrency / members` (rounded down, at least 1) so the fleet's sum stays within the
/// limit; its queue is its own.
fn local_limits(policy: &CallerPolicy, members: u32) -> Limits {
    let max_concurrency = match policy.scope {
        Scope::Instance => policy.max_concurrency,
        Scope::Fleet => (policy.max_concurrency / members.max(1)).max(1),
    };
    Limits {
        max_concurrency,
        queue_depth: policy.queue_depth,
    }
}

/// Validate the caller list and build its runtime table, reusing the limiter, stats and (if
/// unchanged) bucket of same-named callers in `old`.
fn build_table(
    callers: Vec<CallerPolicy>,
    old: &[Arc<CallerState>],
    now: Instant,
    gate: &Arc<FleetGate>,
) -> Result<Arc<[Arc<CallerState>]>, PolicyError> {
    let err = |index, field, message: &str| PolicyError {
        index,
        field,
        message: message.to_owned(),
    };
    if callers.is_empty() {
        return Err(err(
            0,
            "name",
            "at least one caller (the default) is required",
        ));
    }
    if callers.len() > usize::from(u16::MAX) + 1 {
        return Err(err(callers.len() - 1, "name", "more than 65536 callers"));
    }
    let mut table = Vec::with_capacity(callers.len());
    for (i, policy) in callers.into_iter().enumerate() {
        if policy.name.is_empty() {
            return Err(err(i, "name", "must not be empty"));
        }
        if table
            .iter()
            .any(|c: &Arc<CallerState>| c.policy.name == policy.name)
        {
            return Err(err(i, "name", "duplicate caller name"));
        }
        if policy.max_concurrency == 0 {
            return Err(err(i, "max_concurrency", "must be >= 1"));
        }
        if let Some(q) = policy.max_qps
            && !(q.is_finite() && q > 0.0 && q <= MAX_RATE)
        {
            return Err(err(
                i,
                "max_qps",
                "must be a finite number > 0 and <= 1000000",
            ));
        }
        if policy.burst == Some(0) {
            return Err(err(i, "burst", "must be >= 1"));
        }
        let limits = local_limits(&policy, gate.members());
        let want_bucket = policy.max_qps.map(|q| {
            (
                q,
                policy
                    .burst
                    .unwrap_or_else(|| TokenBucket::default_burst(q)),
            )
        });
        let previous = old.iter().find(|c| c.policy.name == policy.name);
        let fleet = policy.scope == Scope::Fleet;
        let bucket = match (want_bucket, previous.and_then(|p| p.bucket.as_ref())) {
            (None, _) => None,
            (Some((q, b)), Some(existing))
                if existing.rate() == q
                    && existing.burst() == b
                    && existing.is_fleet() == fleet =>
            {
                Some(Arc::clone(existing))
            }
            (Some((q, b)), _) if fleet => Some(Arc::new(Rate::Fleet(gate.bucket(
                format!("caller:{}", policy.name),
                q,
                b,
            )))),
            (Some((q, b)), _) => Some(Arc::new(Rate::Local(TokenBucket::new(q, b, now)))),
        };
        let state = match previous {
            Some(p) => CallerState {
                limiter: p.limiter.clone(),
                stats: Arc::clone(&p.stats),
                bucket,
                policy,
            },
            None => CallerState {
                limiter: Limiter::new(limits),
                stats: Arc::new(CallerStats {
                    admitted: AtomicU64::new(0),
                    refusals: Default::default(),
                    backoff: Backoff::new(),
                    drain: DrainRate::new(),
                }),
                bucket,
                policy,
            },
        };
        table.push(Arc::new(state));
    }
    // Only now, with the whole table valid, touch the shared limiters.
    for c in &table {
        let limits = local_limits(&c.policy, gate.members());
        if c.limiter.limits() != limits {
            c.limiter.set_limits(limits);
        }
    }
    Ok(table.into())
}

/// Serialise a `Duration` as whole milliseconds (snapshots use `_ms` field names).
fn ser_ms<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
