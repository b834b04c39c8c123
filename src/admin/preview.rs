//! `POST /v1/rules/preview`: a rule's blast radius before it is enforced.
//!
//! Takes the body a `PUT /v1/rules/fingerprint/{hash}` takes, plus its target — either
//! `fingerprint` (16 hex digits, as in the PUT's path) or `sql` (as `POST
//! /v1/rules/fingerprint`: the proxy's classifier computes the fingerprint) — validates the
//! rule exactly as a PUT does (same field errors, 400 naming the field), and answers what the
//! rule would match and refuse *now*, from this instance's per-fingerprint statistics
//! (`observe::stats`). It changes nothing, so read access is enough (`auth`).
//!
//! What the numbers are (the answer carries the same words in `basis`):
//! - rates (`calls_per_s`) are the statistics' current rates: calls per second over the last
//!   [`RATE_WINDOW_MS`] (a sliding 10 s window; over the pattern's or caller's age when younger),
//!   the pattern's and each caller's own, refused calls included — the load the rule would see;
//! - durations (`mean_ms`) are means since the pattern was first tracked (`first_seen_unix_ms`),
//!   of the statements that were not refused (a refusal takes no database time); `db_ms_per_s`
//!   is rate × that mean: client-observed milliseconds per second, ≈ 1000 × the backends the
//!   pattern keeps busy;
//! - THROTTLE: refused/s = calls/s above `max_qps` (the bucket admits `max_qps` on average;
//!   `burst` only absorbs short spikes). With `action_on_exceed: QUEUE` the admitted ones wait
//!   (`delayed_per_s`) and the excess still ends refused at the caller's queue timeout while the
//!   rate stays above `max_qps`;
//! - REJECT: every matched call;
//! - CONCURRENCY: from Little's law, concurrency = rate × mean duration; above `max_inflight`
//!   the admitted rate is `max_inflight` / mean duration and the rest is refused. Arrivals
//!   come in bursts, so some refusals happen below the limit too: a lower bound;
//! - TIMEOUT: refuses nothing; the share of calls longer than `statement_timeout_ms` is bounded
//!   from below with the pattern's p50/p95/p99/max;
//! - ROUTE: refuses nothing.
//!
//! Per caller, a THROTTLE's or CONCURRENCY's refusals are split by the callers' shares of the
//! matched rate (they share one bucket, one limit). Callers whose priority is `critical` that
//! the rule would touch are listed apart in `critical_callers`, with a line in `warnings`.
//! Output is bounded: at most [`MAX_CALLERS`] callers, the rest counted in `callers_omitted`.
//!
//! The estimate itself ([`estimate`]) is a pure function of the validated rule, one statistics
//! row and the critical callers' names, so it is unit-tested without a proxy
//! (`preview_tests.rs`).

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde::Serialize;
use tokio::time::Instant;

use super::AdminState;
use super::error::{ApiError, JsonBody, NoQuery};
use super::rules::SQL_FIELD;
use crate::classify::caller::DEFAULT_CALLER_NAME;
use crate::config::Priority;
use crate::observe::stats::{FingerprintSnapshot, OTHER, RATE_WINDOW_MS};
use crate::policy::Scope;
use crate::policy::rules::{
    MAX_RULE_JSON_BYTES, OnExceed, RuleAction, RuleDef, RuleError, RuleInfo, RuleMode, RuleSpec,
    fingerprint_hex, parse_fingerprint,
};

/// Most callers listed in an answer (the busiest first).
pub const MAX_CALLERS: usize = 20;

/// The body fields that name the target (this one, or `sql` as for a PUT by statement);
/// the rest is the rule.
const FINGERPRINT_FIELD: &str = "fingerprint";

/// Below this many calls in the rate window, the answer says the estimate is rough.
const FEW_CALLS: f64 = 20.0;

/// One matched caller of the pattern.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CallerEffect {
    pub caller: String,
    pub critical: bool,
    /// This caller's current calls per second of the pattern.
    pub calls_per_s: f64,
    /// Its mean duration (statements not refused, since the pattern was first tracked).
    pub mean_ms: f64,
    /// `calls_per_s` × `mean_ms`: client ms per second (≈ 1000 × backends kept busy).
    pub db_ms_per_s: f64,
    /// Its share of the estimated refusals.
    pub refused_per_s: f64,
    /// Its share of the estimated delayed statements (THROTTLE with QUEUE).
    pub delayed_per_s: f64,
}

/// What the rule would do to the matched traffic, per second, at the current rates.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Effect {
    /// Statements it would refuse (in warn mode: count as `warned` and let run).
    pub refused_per_s: f64,
    /// Statements it would make wait before running (THROTTLE with QUEUE).
    pub delayed_per_s: f64,
    /// `refused_per_s` over the matched rate (0 when nothing matches).
    pub refused_share: f64,
    /// CONCURRENCY: rate × mean duration (Little's law), the in-flight count the limit meets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimated_concurrency: Option<f64>,
    /// TIMEOUT: at least this share of the calls ran longer than `statement_timeout_ms`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub over_timeout_share_at_least: Option<f64>,
    /// How the numbers were worked out, in a sentence.
    pub method: String,
}

/// [`estimate`]'s answer: the matched traffic and the rule's effect on it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    /// Matched calls per second (of the listed callers only, when the rule lists callers).
    pub calls_per_s: f64,
    pub db_ms_per_s: f64,
    pub mean_ms: f64,
    pub effect: Effect,
    /// Matched callers, busiest first, at most [`MAX_CALLERS`].
    pub callers: Vec<CallerEffect>,
    pub callers_omitted: usize,
    /// Critical callers the rule applies to: those with traffic of the pattern, and those it
    /// names that have none yet.
    pub critical_callers: Vec<CallerEffect>,
    pub warnings: Vec<String>,
}

/// The mean duration of the statements that were not refused (a refusal costs no database
/// time, and counting it would shrink the mean that CONCURRENCY's estimate rests on).
fn admitted_mean_ms(total_ms: f64, calls: u64, refusals: u64) -> f64 {
    let ran = calls.saturating_sub(refusals);
    if ran == 0 { 0.0 } else { total_ms / ran as f64 }
}

/// How much of the matched rate `lambda` the rule refuses and delays, and how it got there.
fn effect(def: &RuleDef, lambda: f64, mean_ms: f64, row: &FingerprintSnapshot) -> Effect {
    let mut e = Effect {
        refused_per_s: 0.0,
        delayed_per_s: 0.0,
        refused_share: 0.0,
        estimated_concurrency: None,
        over_timeout_share_at_least: None,
        method: String::new(),
    };
    match &def.action {
        RuleAction::Reject => {
            e.refused_per_s = lambda;
            e.method = "REJECT refuses every matched call".into();
        }
        RuleAction::Throttle {
            max_qps, on_exceed, ..
        } => {
            let excess = (lambda - max_qps).max(0.0);
            e.refused_per_s = excess;
            e.method = format!(
                "THROTTLE admits max_qps={max_qps} per second on average: the calls per second \
                 above it are refused (burst absorbs only short spikes)"
            );
            if *on_exceed == OnExceed::Queue && excess > 0.0 {
                e.delayed_per_s = lambda.min(*max_qps);
                e.method.push_str(
                    "; with QUEUE the admitted ones wait for a token, and while the rate stays \
                     above max_qps the excess is refused at the caller's queue timeout",
                );
            }
        }
        RuleAction::Concurrency { max_inflight } => {
            let seconds = mean_ms / 1000.0;
            let concurrency = lambda * seconds;
            e.estimated_concurrency = Some(concurrency);
            if concurrency > f64::from(*max_inflight) && seconds > 0.0 {
                e.refused_per_s = lambda - f64::from(*max_inflight) / seconds;
            }
            e.method = format!(
                "CONCURRENCY, by Little's law: concurrency = rate x mean duration = {concurrency:.2}; \
                 above max_inflight={max_inflight} the admitted rate is max_inflight / mean \
                 duration and the rest is refused. Arrivals are bursty, so some refusals \
                 happen below the limit too: a lower bound"
            );
        }
        RuleAction::Timeout {
            statement_timeout, ..
        } => {
            e.method = "TIMEOUT refuses nothing; it sets the pattern's timeouts".into();
            if let Some(t) = statement_timeout.filter(|t| !t.is_zero()) {
                let ms = t.as_secs_f64() * 1000.0;
                let share = [(row.p50_ms, 0.5), (row.p95_ms, 0.05), (row.p99_ms, 0.01)]
                    .into_iter()
                    .find(|(q, _)| ms < *q)
                    .map_or(0.0, |(_, s)| s);
                e.over_timeout_share_at_least = Some(share);
                e.method.push_str(&format!(
                    "; statement_timeout_ms={ms:.0} against p50={:.1} p95={:.1} p99={:.1} \
                     max={:.1} ms: at least {:.0} % of the calls ran longer{}",
                    row.p50_ms,
                    row.p95_ms,
                    row.p99_ms,
                    row.max_ms,
                    share * 100.0,
                    if share == 0.0 && ms < row.max_ms {
                        " (some did: max is above it)"
                    } else {
                        ""
                    }
                ));
            }
        }
        RuleAction::Route { replica } => {
            e.method = format!(
                "ROUTE refuses nothing; the pattern's plain reads go to the {}",
                if *replica { "replicas" } else { "primary" }
            );
        }
        RuleAction::Coalesce { max_wait, .. } => {
            e.method = format!(
                "COALESCE refuses nothing; identical plain reads arriving while one runs wait \
                 up to {} ms for its result instead of running",
                max_wait.as_millis()
            );
        }
    }
    e.refused_share = if lambda > 0.0 {
        (e.refused_per_s / lambda).min(1.0)
    } else {
        0.0
    };
    e
}

/// The rule's effect on the traffic of one statistics row (`None`: the pattern has no row).
/// `critical`: the names of the callers whose priority is `critical`.
pub fn estimate(def: &RuleDef, row: Option<&FingerprintSnapshot>, critical: &[String]) -> Estimate {
    let mut warnings = Vec::new();
    let empty;
    let row = match row {
        Some(r) => r,
        None => {
            empty = empty_row();
            &empty
        }
    };
    let listed = |name: &str| {
        def.callers
            .as_ref()
            .is_none_or(|l| l.iter().any(|c| c == name))
    };
    let mut matched: Vec<CallerEffect> = row
        .by_caller
        .iter()
        .filter(|(name, _)| listed(name))
        .map(|(name, c)| {
            let mean_ms = admitted_mean_ms(c.total_ms, c.calls, c.refusals);
            CallerEffect {
                caller: name.clone(),
                critical: critical.iter().any(|n| n == name),
                calls_per_s: c.qps,
                mean_ms,
                db_ms_per_s: c.qps * mean_ms,
                refused_per_s: 0.0,
                delayed_per_s: 0.0,
            }
        })
        .collect();
    let (lambda, mean_ms) = if def.callers.is_none() {
        (
            row.qps,
            admitted_mean_ms(row.total_ms, row.calls, row.refusals),
        )
    } else {
        let lambda: f64 = matched.iter().map(|c| c.calls_per_s).sum();
        let ms_per_s: f64 = matched.iter().map(|c| c.db_ms_per_s).sum();
        let mean = if lambda > 0.0 { ms_per_s / lambda } else { 0.0 };
        (lambda, mean)
    };
    let effect = effect(def, lambda, mean_ms, row);
    // One bucket, one limit: refusals and waits fall on the callers by their share of the rate.
    let caller_total: f64 = matched.iter().map(|c| c.calls_per_s).sum();
    for c in &mut matched {
        let share = if caller_total > 0.0 {
            c.calls_per_s / caller_total
        } else {
            0.0
        };
        c.refused_per_s = effect.refused_per_s * share;
        c.delayed_per_s = effect.delayed_per_s * share;
    }
    matched.sort_by(|a, b| {
        b.calls_per_s
            .total_cmp(&a.calls_per_s)
            .then_with(|| a.caller.cmp(&b.caller))
    });

    let mut critical_callers: Vec<CallerEffect> =
        matched.iter().filter(|c| c.critical).cloned().collect();
    // A critical caller the rule names is touched as soon as it sends the pattern.
    for name in def.callers.iter().flatten() {
        if critical.contains(name) && !critical_callers.iter().any(|c| &c.caller == name) {
            critical_callers.push(CallerEffect {
                caller: name.clone(),
                critical: true,
                calls_per_s: 0.0,
                mean_ms: 0.0,
                db_ms_per_s: 0.0,
                refused_per_s: 0.0,
                delayed_per_s: 0.0,
            });
        }
    }
    critical_callers.truncate(MAX_CALLERS);
    for c in &critical_callers {
        warnings.push(critical_warning(def, c));
    }
    if def.callers.is_some() && row.by_caller.contains_key(OTHER) {
        warnings.push(format!(
            "the pattern has more callers than the statistics keep apart; the calls of some \
             are summed under \"{OTHER}\", which a rule listing callers cannot be matched \
             against: the estimate may be low"
        ));
    }
    let callers_omitted = matched.len().saturating_sub(MAX_CALLERS);
    matched.truncate(MAX_CALLERS);
    Estimate {
        calls_per_s: lambda,
        db_ms_per_s: lambda * mean_ms,
        mean_ms,
        effect,
        callers: matched,
        callers_omitted,
        critical_callers,
        warnings,
    }
}

fn critical_warning(def: &RuleDef, c: &CallerEffect) -> String {
    let what = def.action.name();
    if c.calls_per_s == 0.0 {
        return format!(
            "critical caller {} is named by this {what} rule: it applies to it as soon as it \
             sends the pattern",
            c.caller
        );
    }
    match def.action {
        RuleAction::Timeout { .. } | RuleAction::Route { .. } => format!(
            "critical caller {} sends this pattern ({:.1}/s): this {what} rule applies to it",
            c.caller, c.calls_per_s
        ),
        _ => format!(
            "critical caller {} sends this pattern ({:.1}/s): this {what} rule would refuse \
             about {:.1}/s of it{}",
            c.caller,
            c.calls_per_s,
            c.refused_per_s,
            if c.delayed_per_s > 0.0 {
                format!(" and delay {:.1}/s", c.delayed_per_s)
            } else {
                String::new()
            }
        ),
    }
}

fn empty_row() -> FingerprintSnapshot {
    FingerprintSnapshot {
        fingerprint: String::new(),
        normalized: String::new(),
        kind: String::new(),
        calls: 0,
        qps: 0.0,
        errors: 0,
        lock_not_available: 0,
        lock_wait_ms: 0.0,
        statement_timeouts: 0,
        refusals: 0,
        refusals_by_reason: Default::default(),
        rows: 0,
        total_ms: 0.0,
        mean_ms: 0.0,
        min_ms: 0.0,
        max_ms: 0.0,
        p50_ms: 0.0,
        p95_ms: 0.0,
        p99_ms: 0.0,
        first_seen_unix_ms: 0,
        last_seen_unix_ms: 0,
        by_caller: Default::default(),
    }
}

/// Where the numbers come from.
#[derive(Serialize)]
struct Basis {
    /// Rates are calls per second over this sliding window (or the pattern's age, if younger).
    rate_window_ms: u64,
    /// Durations are means since this moment (the pattern's row was created).
    #[serde(skip_serializing_if = "Option::is_none")]
    durations_since_unix_ms: Option<u64>,
    /// Statements of the pattern counted since then.
    calls_counted: u64,
    /// The method, in words.
    note: &'static str,
}

const BASIS_NOTE: &str = "this instance's statistics: rates over the last rate_window_ms, \
     mean durations since durations_since_unix_ms; other fleet members are not counted";

/// The answer of `POST /v1/rules/preview`.
#[derive(Serialize)]
struct PreviewAnswer {
    fingerprint: String,
    /// The pattern's normal form (from the statistics, or from `sql`).
    #[serde(skip_serializing_if = "Option::is_none")]
    normalized: Option<String>,
    /// Whether this instance has a statistics row for the pattern (without one, everything
    /// is 0: nothing to go on).
    tracked: bool,
    /// The rule in canonical form (what a PUT would store).
    rule: RuleSpec,
    /// Whether the rule would refuse at once (`mode: enforce`, no `warn_first_ms`).
    enforcing: bool,
    basis: Basis,
    /// The matched traffic: rate, time and callers.
    matched: Matched,
    effect: Effect,
    critical_callers: Vec<CallerEffect>,
    warnings: Vec<String>,
    /// The live rule a PUT would replace.
    #[serde(skip_serializing_if = "Option::is_none")]
    replaces: Option<RuleInfo>,
}

#[derive(Serialize)]
struct Matched {
    calls_per_s: f64,
    mean_ms: f64,
    db_ms_per_s: f64,
    callers: Vec<CallerEffect>,
    callers_omitted: usize,
}

/// The target and the rule of a preview body.
fn parse_body(bytes: &[u8]) -> Result<(Target, RuleSpec), RuleError> {
    if bytes.len() > MAX_RULE_JSON_BYTES {
        // Same limit and wording as a PUT body.
        return RuleSpec::from_json(bytes).map(|s| (Target::Fingerprint(0), s));
    }
    let mut value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| RuleError::new("body", format!("invalid JSON: {e}")))?;
    let Some(map) = value.as_object_mut() else {
        return Err(RuleError::new("body", "must be a JSON object"));
    };
    let fp = map.remove(FINGERPRINT_FIELD);
    let sql = map.remove(SQL_FIELD);
    let target = match (fp, sql) {
        (Some(_), Some(_)) => {
            return Err(RuleError::new(
                FINGERPRINT_FIELD,
                "give fingerprint or sql, not both",
            ));
        }
        (Some(serde_json::Value::String(h)), None) => Target::Fingerprint(
            parse_fingerprint(&h).map_err(|e| RuleError::new(FINGERPRINT_FIELD, e.message))?,
        ),
        (Some(_), None) => {
            return Err(RuleError::new(
                FINGERPRINT_FIELD,
                "must be a string of 16 hex digits",
            ));
        }
        (None, Some(serde_json::Value::String(s))) => {
            if s.trim().is_empty() {
                return Err(RuleError::new(SQL_FIELD, "must not be empty"));
            }
            if s.contains('\0') {
                return Err(RuleError::new(SQL_FIELD, "must not contain NUL characters"));
            }
            Target::Sql(s)
        }
        (None, Some(_)) => return Err(RuleError::new(SQL_FIELD, "must be a string")),
        (None, None) => {
            return Err(RuleError::new(
                FINGERPRINT_FIELD,
                "required: the fingerprint (16 hex digits) the rule is for, or sql, a \
                 statement whose fingerprint it is for",
            ));
        }
    };
    Ok((target, RuleSpec::from_value(value)?))
}

#[derive(Debug)]
enum Target {
    Fingerprint(u64),
    Sql(String),
}

/// `POST /v1/rules/preview`: what the rule in the body would match and refuse now.
pub async fn preview(
    State(st): State<Arc<AdminState>>,
    _: NoQuery,
    JsonBody(body): JsonBody,
) -> Result<Json<impl Serialize>, ApiError> {
    let (target, spec) = parse_body(&body)?;
    let def = spec.validate()?;
    let cfg = st.app.config();
    let (fp, sql_normalized) = match target {
        Target::Fingerprint(fp) => (fp, None),
        Target::Sql(sql) => {
            let class = super::rules::classify_rule_sql(&st, &sql)?;
            (class.fingerprint, Some(class.normalized.to_string()))
        }
    };
    let row = st.app.fp_stats.get(fp);
    let critical: Vec<String> = cfg
        .callers
        .iter()
        .filter(|c| c.priority == Priority::Critical)
        .map(|c| c.name.clone())
        .collect();
    let est = estimate(&def, row.as_ref(), &critical);
    let mut warnings = Vec::new();
    if let Some(w) = super::rules::unseen_warning(&st, fp) {
        warnings.push(format!("nothing to go on: {w}"));
    }
    let window_s = RATE_WINDOW_MS as f64 / 1000.0;
    if let Some(r) = &row
        && r.qps * window_s < FEW_CALLS
    {
        warnings.push(format!(
            "few calls in the last {window_s} s ({:.0}): the estimate is rough",
            r.qps * window_s
        ));
    }
    for name in def.callers.iter().flatten() {
        let known = name == DEFAULT_CALLER_NAME || cfg.callers.iter().any(|c| &c.name == name);
        if !known {
            warnings.push(format!(
                "caller {name} is not a configured caller (nor {DEFAULT_CALLER_NAME}): no \
                 statement will carry that name"
            ));
        }
    }
    if def.scope == Scope::Fleet {
        warnings.push(
            "scope fleet: max_qps is shared by every instance, and only this instance's \
             traffic is counted here, so refusals will be at least this many"
                .to_owned(),
        );
    }
    let now = Instant::now();
    let enforcing = def.mode == RuleMode::Enforce && def.warn_first.is_none();
    if def.mode == RuleMode::Warn {
        warnings.push(
            "mode warn: nothing is refused; what would be is counted as `warned` and the \
             client gets a NOTICE"
                .to_owned(),
        );
    } else if let Some(w) = def.warn_first {
        warnings.push(format!(
            "warn_first_ms: for the first {} ms the rule only warns; then it refuses as \
             estimated",
            w.as_millis()
        ));
    }
    warnings.extend(est.warnings);
    let replaces = st.app.policy.rules().get(fp).map(|r| r.info(now));
    if let Some(r) = &replaces {
        warnings.push(format!(
            "a PUT would replace the live {} rule on this fingerprint (and start its counters \
             again)",
            r.spec.action.as_deref().unwrap_or("?")
        ));
    }
    Ok(Json(PreviewAnswer {
        fingerprint: fingerprint_hex(fp),
        normalized: row
            .as_ref()
            .map(|r| r.normalized.clone())
            .or(sql_normalized),
        tracked: row.is_some(),
        rule: def.to_spec(),
        enforcing,
        basis: Basis {
            rate_window_ms: RATE_WINDOW_MS,
            durations_since_unix_ms: row.as_ref().map(|r| r.first_seen_unix_ms),
            calls_counted: row.as_ref().map_or(0, |r| r.calls),
            note: BASIS_NOTE,
        },
        matched: Matched {
            calls_per_s: est.calls_per_s,
            mean_ms: est.mean_ms,
            db_ms_per_s: est.db_ms_per_s,
            callers: est.callers,
            callers_omitted: est.callers_omitted,
        },
        effect: est.effect,
        critical_callers: est.critical_callers,
        warnings,
        replaces,
    }))
}

#[cfg(test)]
#[path = "preview_tests.rs"]
mod tests;
