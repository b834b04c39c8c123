//! Runtime fingerprint rules (DESIGN §5 step 1, issue 6): the live set an SRE changes during
//! an incident.
//!
//! Owns the in-memory rule set keyed by fingerprint, each rule's runtime state (THROTTLE bucket,
//! CONCURRENCY in-flight count, hit/refusal/warn counters), TTL expiry, the hot-path
//! [`RuleSet::check`], and the persisted file format. The rule vocabulary and its validation
//! live in `rule_spec` and are re-exported here. It does not format client-visible errors (that
//! is `policy::refusal`, so all refusal text lives in one place), does not write files (the
//! admin layer does the atomic write+rename with the bytes from [`RuleSet::to_json_bytes`]) and
//! does not know which callers exist.
//!
//! * One rule per fingerprint; a PUT replaces the rule (and its counters and bucket).
//! * Expiry is kept as an `Instant` for the hot path and as absolute unix ms for persistence,
//!   so a rule with a TTL survives a restart with the time it had left. Expired rules are
//!   ignored at once and removed lazily (or by [`RuleSet::purge_expired`]).
//! * Hot path: one relaxed atomic load when there are no rules; otherwise a read lock for a
//!   hash lookup. Writers (admin API) take the write lock briefly.
//! * A rule with `warn_first_ms` keeps the moment it starts enforcing the same way as its
//!   expiry (creation time + window); before it, [`RuleSet::check`] treats it as `warn`.
//! * Statements that a rule in warn mode would have refused are also counted per action
//!   ([`RuleSet::warned_by_action`]), monotonic across rule replacements, for `/metrics`.

use foldhash::{HashMap, HashMapExt};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::Scope;
use super::bucket::TokenBucket;
use super::lease::{FleetGate, LEASE_WAIT, LeasedBucket, Rate};
use super::rule_spec::duration_ms;
pub use super::rule_spec::{
    MAX_RULE_CALLERS, MAX_RULE_JSON_BYTES, MAX_TIMEOUT_MS, MAX_TTL_SECONDS, OnExceed, Origin,
    RuleAction, RuleDef, RuleError, RuleMode, RuleSpec, fingerprint_hex, parse_fingerprint,
};

/// A live rule: definition plus its bucket, in-flight counter and hit counters.
#[derive(Debug)]
pub struct Rule {
    fingerprint: u64,
    def: RuleDef,
    created_unix_ms: u64,
    /// (hot-path deadline, the same moment as unix ms for persistence)
    expires: Option<(Instant, u64)>,
    /// `warn_first_ms`: when the rule starts enforcing (as `expires`); warn mode before.
    enforce_at: Option<(Instant, u64)>,
    bucket: Option<Rate>,
    in_flight: AtomicU32,
    hits: AtomicU64,
    refusals: AtomicU64,
    warned: AtomicU64,
}

impl Rule {
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    pub fn def(&self) -> &RuleDef {
        &self.def
    }

    /// Statements matched (admitted, refused or warned).
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Statements refused while enforcing.
    pub fn refusals(&self) -> u64 {
        self.refusals.load(Ordering::Relaxed)
    }

    /// Statements that would have been refused in warn mode.
    pub fn warned(&self) -> u64 {
        self.warned.load(Ordering::Relaxed)
    }

    pub fn is_expired(&self, now: Instant) -> bool {
        self.expires.is_some_and(|(at, _)| now >= at)
    }

    /// Whether the rule refuses at `now`: `mode: enforce`, past any `warn_first_ms` window.
    pub fn enforcing(&self, now: Instant) -> bool {
        self.def.mode == RuleMode::Enforce && self.enforce_at.is_none_or(|(at, _)| now >= at)
    }

    /// Listing entry for the admin API.
    pub fn info(&self, now: Instant) -> RuleInfo {
        RuleInfo {
            fingerprint: fingerprint_hex(self.fingerprint),
            spec: self.def.to_spec(),
            created_unix_ms: self.created_unix_ms,
            expires_unix_ms: self.expires.map(|(_, ms)| ms),
            expires_in_ms: self
                .expires
                .map(|(at, _)| duration_ms(at.saturating_duration_since(now))),
            effective_mode: if self.enforcing(now) {
                "enforce"
            } else {
                "warn"
            },
            enforce_at_unix_ms: self.enforce_at.map(|(_, ms)| ms),
            enforces_in_ms: self
                .enforce_at
                .filter(|(at, _)| now < *at)
                .map(|(at, _)| duration_ms(at.saturating_duration_since(now))),
            hits: self.hits(),
            refusals: self.refusals(),
            warned: self.warned(),
            in_flight: self.in_flight.load(Ordering::Relaxed),
        }
    }
}

/// A rule as listed by `GET /v1/rules`.
#[derive(Debug, Clone, Serialize)]
pub struct RuleInfo {
    pub fingerprint: String,
    #[serde(flatten)]
    pub spec: RuleSpec,
    pub created_unix_ms: u64,
    pub expires_unix_ms: Option<u64>,
    pub expires_in_ms: Option<u64>,
    /// What the rule does now: `warn` for a warn rule, and for an enforcing one still inside
    /// its `warn_first_ms` window; else `enforce`.
    pub effective_mode: &'static str,
    /// `warn_first_ms`: when the rule starts (or started) enforcing.
    pub enforce_at_unix_ms: Option<u64>,
    /// `warn_first_ms`: time left before it enforces (absent once it does).
    pub enforces_in_ms: Option<u64>,
    pub hits: u64,
    pub refusals: u64,
    pub warned: u64,
    pub in_flight: u32,
}

/// Holds one CONCURRENCY slot of a rule; dropping it frees the slot.
#[derive(Debug)]
pub struct RuleGuard {
    rule: Arc<Rule>,
}

impl Drop for RuleGuard {
    fn drop(&mut self) {
        self.rule.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How a rule would refuse (enforced, or reported in warn mode).
#[derive(Debug, Clone, PartialEq)]
pub enum RuleViolation {
    /// REJECT.
    Blocked,
    /// THROTTLE bucket empty (or, with QUEUE, no token within the queue timeout).
    RateLimited { retry_after: Duration },
    /// CONCURRENCY at its limit.
    Concurrency { max_inflight: u32 },
}

/// The rule lets the statement through.
#[derive(Debug)]
pub struct RuleAdmit {
    pub rule: Arc<Rule>,
    /// THROTTLE with QUEUE: sleep this long before proceeding (the token is reserved).
    pub wait: Duration,
    pub statement_timeout: Option<Duration>,
    pub lock_timeout: Option<Duration>,
    /// ROUTE: where the statement's plain read goes (`Some(true)`: the replicas).
    pub route_replica: Option<bool>,
    /// COALESCE: the statement's read may share one execution with identical ones.
    pub coalesce: Option<CoalesceRule>,
    /// Warn mode: what enforcing would have done.
    pub would_refuse: Option<RuleViolation>,
    /// CONCURRENCY slot, held for the statement's lifetime.
    pub guard: Option<RuleGuard>,
}

/// A COALESCE rule's bounds, for the session that runs a matching read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoalesceRule {
    /// How long a follower waits for the leader's result.
    pub max_wait: Duration,
    /// The largest result shared.
    pub max_result_bytes: usize,
}

/// Outcome of [`RuleSet::check`].
#[derive(Debug)]
pub enum RuleCheck {
    /// No live rule for this fingerprint and caller.
    NoRule,
    /// A fleet-wide THROTTLE whose lease is empty but may be refilled: wait for a token until
    /// `until` ([`LeasedBucket::wait_for_token`]) and check again with `may_wait` false.
    /// Nothing was counted.
    AwaitLease {
        bucket: Arc<LeasedBucket>,
        until: Instant,
    },
    Admit(RuleAdmit),
    Refuse {
        rule: Arc<Rule>,
        violation: RuleViolation,
    },
}

/// All rules, keyed by fingerprint.
#[derive(Debug, Default)]
pub struct RuleSet {
    rules: RwLock<HashMap<u64, Arc<Rule>>>,
    /// Mirror of `rules.len()` so the common no-rules case skips the lock entirely.
    count: AtomicUsize,
    /// Where `scope: fleet` THROTTLE rules get their tokens.
    gate: Arc<FleetGate>,
    /// Statements a rule in warn mode would have refused, by action ([`WARN_ACTIONS`] order).
    warned_by_action: [AtomicU64; WARN_ACTIONS.len()],
}

/// The actions that refuse, so may warn instead: the labels of [`RuleSet::warned_by_action`].
pub const WARN_ACTIONS: [&str; 3] = ["REJECT", "THROTTLE", "CONCURRENCY"];

/// Persisted file layout (version 1).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    version: u32,
    rules: Vec<StoredRule>,
}

/// One rule as persisted: in the rules file and, in a fleet, as a value in Redis.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredRule {
    pub fingerprint: String,
    pub created_unix_ms: u64,
    #[serde(default)]
    pub expires_unix_ms: Option<u64>,
    pub rule: RuleSpec,
}

/// What [`RuleSet::sync`] changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SyncOutcome {
    pub added: usize,
    pub replaced: usize,
    pub removed: usize,
    pub kept: usize,
}

impl SyncOutcome {
    pub fn changed(&self) -> bool {
        self.added + self.replaced + self.removed > 0
    }
}

impl RuleSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Statements that rules in warn mode (or inside their `warn_first_ms` window) would
    /// have refused since start, by action: monotonic, unlike a rule's own `warned`, which
    /// starts again when the rule is replaced.
    pub fn warned_by_action(&self) -> [(&'static str, u64); WARN_ACTIONS.len()] {
        std::array::from_fn(|i| {
            (
                WARN_ACTIONS[i],
                self.warned_by_action[i].load(Ordering::Relaxed),
            )
        })
    }

    /// The gate `scope: fleet` rules lease their tokens through.
    pub fn gate(&self) -> &Arc<FleetGate> {
        &self.gate
    }

    /// Validate and install (or replace) the rule for `fp`. TTL counts from now.
    pub fn put(&self, fp: u64, spec: RuleSpec) -> Result<Arc<Rule>, RuleError> {
        let def = spec.validate()?;
        let (now, unix_now) = (Instant::now(), unix_ms_now());
        let expires = def
            .ttl
            .map(|ttl| (now + ttl, unix_now.saturating_add(duration_ms(ttl))));
        let rule = Arc::new(build_rule(
            fp, def, unix_now, expires, now, unix_now, &self.gate,
        ));
        let mut map = self.rules.write();
        map.insert(fp, Arc::clone(&rule));
        self.count.store(map.len(), Ordering::Release);
        Ok(rule)
    }

    /// The live rule for `fp` (expired rules are invisible).
    pub fn get(&self, fp: u64) -> Option<Arc<Rule>> {
        let rule = self.rules.read().get(&fp).cloned()?;
        (!rule.is_expired(Instant::now())).then_some(rule)
    }

    /// Remove the rule for `fp`; false if there was none.
    pub fn delete(&self, fp: u64) -> bool {
        let mut map = self.rules.write();
        let removed = map.remove(&fp).is_some();
        self.count.store(map.len(), Ordering::Release);
        removed
    }

    /// Live rules, ordered by fingerprint.
    pub fn list(&self, now: Instant) -> Vec<RuleInfo> {
        let mut out: Vec<RuleInfo> = self
            .rules
            .read()
            .values()
            .filter(|r| !r.is_expired(now))
            .map(|r| r.info(now))
            .collect();
        out.sort_by(|a, b| a.fingerprint.cmp(&b.fingerprint));
        out
    }

    /// Number of stored rules (expired ones not yet purged included).
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drop expired rules; returns how many went.
    pub fn purge_expired(&self, now: Instant) -> usize {
        let mut map = self.rules.write();
        let before = map.len();
        map.retain(|_, r| !r.is_expired(now));
        self.count.store(map.len(), Ordering::Release);
        before - map.len()
    }

    /// The hot-path question: does a rule say anything about this statement?
    ///
    /// `max_queue_wait` is how long a THROTTLE rule with `action_on_exceed: QUEUE` may make
    /// the statement wait for a token (the caller's queue timeout). `may_wait`: a fleet-wide
    /// THROTTLE with an empty lease answers [`RuleCheck::AwaitLease`] instead of refusing.
    pub fn check(
        &self,
        fp: u64,
        caller: &str,
        now: Instant,
        max_queue_wait: Duration,
        may_wait: bool,
    ) -> RuleCheck {
        if self.count.load(Ordering::Relaxed) == 0 {
            return RuleCheck::NoRule;
        }
        let Some(rule) = self.rules.read().get(&fp).cloned() else {
            return RuleCheck::NoRule;
        };
        if rule.is_expired(now) {
            // Lazy removal, but never wait for the write lock on the hot path.
            if let Some(mut map) = self.rules.try_write() {
                if map.get(&fp).is_some_and(|r| Arc::ptr_eq(r, &rule)) {
                    map.remove(&fp);
                }
                self.count.store(map.len(), Ordering::Release);
            }
            return RuleCheck::NoRule;
        }
        if let Some(callers) = &rule.def.callers
            && !callers.iter().any(|c| c == caller)
        {
            return RuleCheck::NoRule;
        }
        let enforce = rule.enforcing(now);
        if may_wait
            && enforce
            && let RuleAction::Throttle { on_exceed, .. } = &rule.def.action
            && let Some(Rate::Fleet(b)) = &rule.bucket
            && b.leased(now) == 0
        {
            // REJECT: only the wait for a lease that may come; QUEUE: up to the queue timeout.
            let queue = *on_exceed == OnExceed::Queue && !max_queue_wait.is_zero();
            if queue && b.leasing() {
                return RuleCheck::AwaitLease {
                    bucket: Arc::clone(b),
                    until: now + max_queue_wait,
                };
            }
            if b.lease_may_come(now) {
                return RuleCheck::AwaitLease {
                    bucket: Arc::clone(b),
                    until: now + LEASE_WAIT,
                };
            }
        }
        rule.hits.fetch_add(1, Ordering::Relaxed);
        let mut admit = RuleAdmit {
            rule: Arc::clone(&rule),
            wait: Duration::ZERO,
            statement_timeout: None,
            lock_timeout: None,
            route_replica: None,
            coalesce: None,
            would_refuse: None,
            guard: None,
        };
        let violation = match &rule.def.action {
            RuleAction::Reject => Some(RuleViolation::Blocked),
            RuleAction::Throttle { on_exceed, .. } => {
                let bucket = rule.bucket.as_ref();
                let max_wait = match on_exceed {
                    OnExceed::Queue if enforce => max_queue_wait,
                    _ => Duration::ZERO,
                };
                match bucket.map(|b| b.reserve(now, max_wait)) {
                    Some(Err(retry_after)) => Some(RuleViolation::RateLimited { retry_after }),
                    Some(Ok(wait)) => {
                        admit.wait = wait;
                        None
                    }
                    None => None,
                }
            }
            RuleAction::Concurrency { max_inflight } => {
                let n = rule.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
                admit.guard = Some(RuleGuard {
                    rule: Arc::clone(&rule),
                });
                (n > *max_inflight).then_some(RuleViolation::Concurrency {
                    max_inflight: *max_inflight,
                })
            }
            RuleAction::Timeout {
                statement_timeout,
                lock_timeout,
            } => {
                admit.statement_timeout = *statement_timeout;
                admit.lock_timeout = *lock_timeout;
                None
            }
            RuleAction::Route { replica } => {
                admit.route_replica = Some(*replica);
                None
            }
            RuleAction::Coalesce {
                max_wait,
                max_result_bytes,
            } => {
                admit.coalesce = Some(CoalesceRule {
                    max_wait: *max_wait,
                    max_result_bytes: *max_result_bytes,
                });
                None
            }
        };
        match violation {
            Some(violation) if enforce => {
                rule.refusals.fetch_add(1, Ordering::Relaxed);
                // `admit` (and any CONCURRENCY guard in it) is dropped here.
                RuleCheck::Refuse { rule, violation }
            }
            Some(violation) => {
                rule.warned.fetch_add(1, Ordering::Relaxed);
                if let Some(i) = WARN_ACTIONS
                    .iter()
                    .position(|a| *a == rule.def.action.name())
                {
                    self.warned_by_action[i].fetch_add(1, Ordering::Relaxed);
                }
                admit.would_refuse = Some(violation);
                RuleCheck::Admit(admit)
            }
            None => RuleCheck::Admit(admit),
        }
    }

    /// The whole set as a JSON document for the rules file. Expiry is absolute unix ms, so a
    /// reload keeps the remaining TTL; counters are not persisted.
    pub fn to_json_bytes(&self) -> Result<Vec<u8>, RuleError> {
        let rules = self.stored();
        serde_json::to_vec_pretty(&RuleFile { version: 1, rules })
            .map_err(|e| RuleError::new("body", format!("cannot serialise rules: {e}")))
    }

    /// Live rules in their stored form, ordered by fingerprint.
    pub fn stored(&self) -> Vec<StoredRule> {
        let now = Instant::now();
        let mut rules: Vec<StoredRule> = self
            .rules
            .read()
            .values()
            .filter(|r| !r.is_expired(now))
            .map(|r| StoredRule {
                fingerprint: fingerprint_hex(r.fingerprint),
                created_unix_ms: r.created_unix_ms,
                expires_unix_ms: r.expires.map(|(_, ms)| ms),
                rule: r.def.to_spec(),
            })
            .collect();
        rules.sort_by(|a, b| a.fingerprint.cmp(&b.fingerprint));
        rules
    }

    /// A rule set from a rules file. Rules whose expiry has passed are skipped; any invalid
    /// entry fails the whole load (errors name it, e.g. `rules[2].max_qps`).
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Self, RuleError> {
        let set = Self::new();
        set.replace_from_json_bytes(bytes)?;
        Ok(set)
    }

    /// Replace every rule with the file's contents, all or nothing. Returns the rule count.
    pub fn replace_from_json_bytes(&self, bytes: &[u8]) -> Result<usize, RuleError> {
        let file: RuleFile = serde_json::from_slice(bytes)
            .map_err(|e| RuleError::new("body", format!("invalid rules file: {e}")))?;
        if file.version != 1 {
            return Err(RuleError::new(
                "version",
                format!("unsupported version {}", file.version),
            ));
        }
        let (now, unix_now) = (Instant::now(), unix_ms_now());
        let mut map = HashMap::with_capacity(file.rules.len());
        for (i, stored) in file.rules.iter().enumerate() {
            let loaded = self
                .load(stored, now, unix_now)
                .map_err(|e| e.within(&format!("rules[{i}]")))?;
            if let Some(rule) = loaded {
                map.insert(rule.fingerprint, Arc::new(rule));
            }
        }
        let n = map.len();
        *self.rules.write() = map;
        self.count.store(n, Ordering::Release);
        Ok(n)
    }

    /// A new rule for `fp` in its stored form, created now (validated; a TTL counts from
    /// now). A fleet writes this to Redis and every instance applies it with [`RuleSet::sync`].
    pub fn stage(fp: u64, spec: &RuleSpec) -> Result<StoredRule, RuleError> {
        let def = spec.validate()?;
        let unix_now = unix_ms_now();
        Ok(StoredRule {
            fingerprint: fingerprint_hex(fp),
            created_unix_ms: unix_now,
            expires_unix_ms: def.ttl.map(|t| unix_now.saturating_add(duration_ms(t))),
            rule: def.to_spec(),
        })
    }

    /// Make the set equal to `entries` (the fleet's rule set) under one write lock, so a
    /// statement sees the old set or the new one. A rule whose stored form is unchanged is
    /// kept as it is (bucket, counters, in-flight slots); a changed one is rebuilt. Entries
    /// that are expired are left out; entries that do not validate are skipped and returned.
    pub fn sync(&self, entries: &[StoredRule]) -> (SyncOutcome, Vec<RuleError>) {
        let (now, unix_now) = (Instant::now(), unix_ms_now());
        let mut out = SyncOutcome::default();
        let mut errors = Vec::new();
        let mut loaded = Vec::with_capacity(entries.len());
        for stored in entries {
            match self.load(stored, now, unix_now) {
                Ok(Some(rule)) => loaded.push(rule),
                Ok(None) => {}
                Err(e) => errors.push(e.within(&format!("rule {}", stored.fingerprint))),
            }
        }
        let mut map = self.rules.write();
        let mut next = HashMap::with_capacity(loaded.len());
        for rule in loaded {
            let fp = rule.fingerprint;
            match map.remove(&fp) {
                Some(old)
                    if old.created_unix_ms == rule.created_unix_ms
                        && old.expires.map(|e| e.1) == rule.expires.map(|e| e.1)
                        && old.def == rule.def =>
                {
                    out.kept += 1;
                    next.insert(fp, old);
                }
                Some(_) => {
                    out.replaced += 1;
                    next.insert(fp, Arc::new(rule));
                }
                None => {
                    out.added += 1;
                    next.insert(fp, Arc::new(rule));
                }
            }
        }
        out.removed = map.values().filter(|r| !r.is_expired(now)).count();
        *map = next;
        self.count.store(map.len(), Ordering::Release);
        (out, errors)
    }

    /// A stored rule made live; `None` if it has expired.
    fn load(
        &self,
        stored: &StoredRule,
        now: Instant,
        unix_now: u64,
    ) -> Result<Option<Rule>, RuleError> {
        let fp = parse_fingerprint(&stored.fingerprint)?;
        let def = stored.rule.validate().map_err(|e| e.within("rule"))?;
        let expires = match stored.expires_unix_ms {
            None => None,
            Some(ms) if ms <= unix_now => return Ok(None),
            // Clamped so a hand-edited far-future expiry cannot overflow `Instant`.
            Some(ms) => {
                let left =
                    Duration::from_millis(ms - unix_now).min(Duration::from_secs(MAX_TTL_SECONDS));
                Some((now + left, ms))
            }
        };
        Ok(Some(build_rule(
            fp,
            def,
            stored.created_unix_ms,
            expires,
            now,
            unix_now,
            &self.gate,
        )))
    }
}

fn build_rule(
    fp: u64,
    def: RuleDef,
    created_unix_ms: u64,
    expires: Option<(Instant, u64)>,
    now: Instant,
    unix_now: u64,
    gate: &Arc<FleetGate>,
) -> Rule {
    // The window counts from the creation time, which is persisted: a rule loaded later
    // (restart, fleet sync) switches at the same moment; one whose window passed enforces.
    let enforce_at = def.warn_first.map(|w| {
        let ms = created_unix_ms.saturating_add(duration_ms(w));
        let left = Duration::from_millis(ms.saturating_sub(unix_now))
            .min(Duration::from_secs(MAX_TTL_SECONDS));
        (now + left, ms)
    });
    let bucket = match &def.action {
        RuleAction::Throttle { max_qps, burst, .. } => Some(match def.scope {
            Scope::Instance => Rate::Local(TokenBucket::new(*max_qps, *burst, now)),
            // A replaced rule (new creation time) starts a new shared bucket.
            Scope::Fleet => Rate::Fleet(gate.bucket(
                format!("rule:{}:{created_unix_ms}", fingerprint_hex(fp)),
                *max_qps,
                *burst,
            )),
        }),
        _ => None,
    };
    Rule {
        fingerprint: fp,
        def,
        created_unix_ms,
        expires,
        enforce_at,
        bucket,
        in_flight: AtomicU32::new(0),
        hits: AtomicU64::new(0),
        refusals: AtomicU64::new(0),
        warned: AtomicU64::new(0),
    }
}

fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(duration_ms)
        .unwrap_or(0)
}
