//! `GET /v1/anomalies` and the detector's tick: what the detector (`observe::anomaly`) names,
//! the rule that would stop it, and — where `auto_rules.mode` allows — that rule installed.
//!
//! [`detect_loop`] reads the statistics' counters every `detector.tick_ms` (the config is read
//! each tick, so a reload applies at once), logs and counts anomalies as they start and end,
//! and in `warn`/`enforce` mode installs the suggested rule through the same store as `PUT
//! /v1/rules/...` (rules file and fleet included), marked `origin: auto`, with a TTL.
//!
//! With `auto_rules.warn_first_ms` (mode `enforce`), a newly installed rule carries that
//! `warn_first_ms`: it acts as `warn` for the window and then enforces by itself (the switch
//! is the rule's own, `policy::rules`, so it survives a restart and holds in a fleet); deleting
//! it in the window is the operator's veto, remembered for the episode like any deletion. A
//! rule put back after its TTL in the same episode was confirmed already and enforces at once.
//!
//! What an automatic rule never does:
//! - apply to an exempt priority: it lists the callers it applies to (every configured caller
//!   and `default` whose priority is not in `auto_rules.exempt_priorities`; no list when none
//!   is exempt), and when every caller is exempt nothing is installed;
//! - replace a rule it did not install (an operator's, or another fleet member's);
//! - come back within the same episode after an operator deleted it (a rule that merely
//!   expired while the anomaly holds is installed again);
//! - exceed `auto_rules.max_rules` live automatic rules.
//!
//! Automatic rules are made for fingerprint anomalies; a caller anomaly carries a suggested
//! rule for its busiest fingerprint limited to that caller, for an operator to PUT.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use serde::Serialize;
use tokio::time::Instant;

use super::AdminState;
use super::error::NoQuery;
use crate::config::{AutoRulesConfig, AutoRulesMode, Config, DetectorConfig, Priority};
use crate::observe::anomaly::{Anomaly, Detector, Event, Signal, Subject};
use crate::observe::stats::unix_ms;
use crate::policy::rules::{Origin, RuleSpec, fingerprint_hex};

/// The detector and what it did about automatic rules.
pub struct Board {
    detector: Detector,
    /// Automatic rules this instance installed, by fingerprint: when their TTL ends.
    installed: HashMap<u64, Instant>,
    /// Fingerprints whose automatic rule an operator deleted: left alone until the episode ends.
    suppressed: HashSet<u64>,
    /// (fingerprint, outcome) already counted in this episode, so a refusal to act is counted
    /// once per episode rather than once per tick.
    noted: HashSet<(u64, &'static str)>,
}

impl Board {
    pub fn new(cfg: &DetectorConfig) -> Board {
        Board {
            detector: Detector::new(cfg.clone()),
            installed: HashMap::new(),
            suppressed: HashSet::new(),
            noted: HashSet::new(),
        }
    }
}

/// The callers an automatic rule may apply to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleCallers {
    /// Nobody is exempt: the rule lists no callers.
    Everyone,
    Only(Vec<String>),
    /// Every caller is exempt (or more callers than a rule may list are not): no rule.
    Nobody,
}

impl RuleCallers {
    fn list(self) -> Option<Option<Vec<String>>> {
        match self {
            RuleCallers::Everyone => Some(None),
            RuleCallers::Only(names) => Some(Some(names)),
            RuleCallers::Nobody => None,
        }
    }
}

/// Which callers an automatic rule may apply to under `auto_rules.exempt_priorities`.
pub fn non_exempt_callers(cfg: &Config) -> RuleCallers {
    let exempt = &cfg.auto_rules.exempt_priorities;
    let mut all = 0;
    let mut names: Vec<String> = Vec::new();
    let configured = cfg.callers.iter().map(|c| (c.name.as_str(), c.priority));
    let default = std::iter::once((
        crate::classify::caller::DEFAULT_CALLER_NAME,
        Priority::Normal,
    ));
    for (name, priority) in configured.chain(default) {
        all += 1;
        if !exempt.contains(&priority) && !names.iter().any(|n| n == name) {
            names.push(name.to_owned());
        }
    }
    if names.is_empty() {
        RuleCallers::Nobody
    } else if names.len() == all {
        RuleCallers::Everyone
    } else if names.len() > crate::policy::rules::MAX_RULE_CALLERS {
        // A rule cannot list them all; better no automatic rule than one that reaches an
        // exempt caller.
        RuleCallers::Nobody
    } else {
        RuleCallers::Only(names)
    }
}

/// The rule that would stop `a`, for fingerprint `fp`, as a PUT body.
/// - a rate step: THROTTLE to `throttle_multiple` × the baseline rate (at least
///   `detector.min_qps`), REJECT beyond it (a refusal carries a retry hint);
/// - a time, error or lock-wait anomaly: CONCURRENCY of `throttle_multiple` × the baseline
///   concurrency (client ms per second / 1000), at least 1.
pub fn suggest(
    a: &Anomaly,
    auto: &AutoRulesConfig,
    det: &DetectorConfig,
    callers: Option<Vec<String>>,
    mode: &str,
) -> RuleSpec {
    let e = &a.evidence;
    let m = auto.throttle_multiple;
    let what = match &a.subject {
        Subject::Fingerprint(_) => "this query pattern".to_owned(),
        Subject::Caller(name) => format!("caller {name}"),
    };
    let mut spec = RuleSpec {
        mode: Some(mode.to_owned()),
        callers,
        ttl_seconds: Some(auto.ttl_seconds),
        origin: Some("auto".to_owned()),
        ..RuleSpec::default()
    };
    match a.signal {
        Signal::RateStep => {
            let qps = (m * e.baseline_qps).max(det.min_qps).max(0.1);
            let qps = (qps * 10.0).round() / 10.0;
            spec.action = Some("THROTTLE".to_owned());
            spec.max_qps = Some(qps);
            spec.burst = Some((qps.ceil() as u32).max(1));
            spec.action_on_exceed = Some("REJECT".to_owned());
            spec.error_message = Some(format!(
                "automatic rule: {what} stepped to {:.0}/s ({:.0}x its baseline of {:.1}/s); \
                 it is held to {qps}/s",
                e.qps, e.ratio, e.baseline_qps
            ));
        }
        Signal::DbTimeShare | Signal::ErrorShare | Signal::LockWaitShare => {
            let inflight = (m * e.baseline_db_ms_per_s / 1000.0).ceil().max(1.0) as u32;
            spec.action = Some("CONCURRENCY".to_owned());
            spec.max_inflight = Some(inflight);
            spec.error_message = Some(format!(
                "automatic rule: {what} shows {} ({:.2} now against {:.2}); at most \
                 {inflight} of it run at once",
                a.signal.name(),
                e.current,
                e.baseline
            ));
        }
    }
    spec.note = Some(format!(
        "auto: {} {:.1} {} against a baseline of {:.1}, since unix ms {}",
        a.signal.name(),
        e.current,
        e.unit,
        e.baseline,
        a.since_unix_ms
    ));
    spec
}

/// The fingerprint a rule for `a` is keyed on, and the callers it is limited to.
fn target(a: &Anomaly, cfg: &Config) -> Option<(u64, Option<Vec<String>>)> {
    match &a.subject {
        Subject::Fingerprint(fp) => Some((*fp, non_exempt_callers(cfg).list()?)),
        Subject::Caller(name) => {
            let exempt = &cfg.auto_rules.exempt_priorities;
            let priority = cfg
                .callers
                .iter()
                .find(|c| *c.name == **name)
                .map_or(Priority::Normal, |c| c.priority);
            if exempt.contains(&priority) {
                return None;
            }
            Some((a.top_fingerprint?, Some(vec![name.to_string()])))
        }
    }
}

#[derive(Serialize)]
struct SuggestedRule {
    method: &'static str,
    path: String,
    body: RuleSpec,
}

#[derive(Serialize)]
struct LiveRule {
    origin: &'static str,
    action: &'static str,
    /// What it does now (`warn` inside a `warn_first_ms` window).
    mode: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    enforces_in_ms: Option<u64>,
    expires_in_ms: Option<u64>,
}

#[derive(Serialize)]
struct AnomalyView {
    subject: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    fingerprint: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    caller: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    normalized: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
    signal: &'static str,
    since_unix_ms: u64,
    active_for_ms: u64,
    last_signal_unix_ms: u64,
    evidence: crate::observe::anomaly::Evidence,
    top_callers: Vec<CallerCalls>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_fingerprint: Option<String>,
    /// The rule that would stop it (absent with `auto_rules.mode: off`, or when every
    /// caller it could apply to is exempt).
    #[serde(skip_serializing_if = "Option::is_none")]
    suggested_rule: Option<SuggestedRule>,
    /// The live rule on its fingerprint, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    rule: Option<LiveRule>,
}

#[derive(Serialize)]
struct CallerCalls {
    caller: String,
    calls: u64,
}

#[derive(Serialize)]
pub(super) struct AnomalyList {
    enabled: bool,
    auto_rules_mode: &'static str,
    anomalies: Vec<AnomalyView>,
}

fn view(st: &AdminState, a: &Anomaly, cfg: &Config, now_ms: u64) -> AnomalyView {
    let (fingerprint, caller) = match &a.subject {
        Subject::Fingerprint(fp) => (Some(*fp), None),
        Subject::Caller(name) => (None, Some(name.to_string())),
    };
    let suggested_rule = (cfg.auto_rules.mode != AutoRulesMode::Off)
        .then(|| target(a, cfg))
        .flatten()
        .map(|(fp, callers)| SuggestedRule {
            method: "PUT",
            path: format!("/v1/rules/fingerprint/{}", fingerprint_hex(fp)),
            body: suggest(a, &cfg.auto_rules, &cfg.detector, callers, "enforce"),
        });
    let rule_fp = fingerprint.or(a.top_fingerprint);
    let rule = rule_fp
        .and_then(|fp| st.app.policy.rules().get(fp))
        .map(|r| {
            let info = r.info(Instant::now());
            let def = r.def();
            LiveRule {
                origin: match def.origin {
                    Origin::Auto => "auto",
                    Origin::Operator => "operator",
                },
                action: def.action.name(),
                mode: info.effective_mode,
                enforces_in_ms: info.enforces_in_ms,
                expires_in_ms: info.expires_in_ms,
            }
        });
    AnomalyView {
        subject: subject_name(&a.subject),
        fingerprint: fingerprint.map(fingerprint_hex),
        caller,
        normalized: a.normalized.as_deref().map(str::to_owned),
        kind: a.kind,
        signal: a.signal.name(),
        since_unix_ms: a.since_unix_ms,
        active_for_ms: now_ms.saturating_sub(a.since_unix_ms),
        last_signal_unix_ms: a.last_signal_unix_ms,
        evidence: a.evidence.clone(),
        top_callers: a
            .top_callers
            .iter()
            .map(|(caller, calls)| CallerCalls {
                caller: caller.clone(),
                calls: *calls,
            })
            .collect(),
        top_fingerprint: a.top_fingerprint.map(fingerprint_hex),
        suggested_rule,
        rule,
    }
}

fn subject_name(s: &Subject) -> &'static str {
    match s {
        Subject::Fingerprint(_) => "fingerprint",
        Subject::Caller(_) => "caller",
    }
}

/// `GET /v1/anomalies`: the current anomalies, oldest first, with evidence and the rule
/// that would stop each.
pub async fn list(State(st): State<Arc<AdminState>>, _: NoQuery) -> Json<impl Serialize> {
    Json(anomaly_list(&st))
}

/// What `GET /v1/anomalies` and the console's `SHOW ANOMALIES` show.
pub(super) fn anomaly_list(st: &AdminState) -> AnomalyList {
    let cfg = st.app.config();
    let active = st.anomalies.lock().detector.active();
    let now_ms = unix_ms();
    let anomalies = if cfg.detector.enabled {
        active.iter().map(|a| view(st, a, &cfg, now_ms)).collect()
    } else {
        Vec::new()
    };
    AnomalyList {
        enabled: cfg.detector.enabled,
        auto_rules_mode: cfg.auto_rules.mode.name(),
        anomalies,
    }
}

/// Every `detector.tick_ms` until shutdown: feeds the detector, reports what started and
/// ended, and applies `auto_rules`.
pub async fn detect_loop(st: Arc<AdminState>) {
    loop {
        let cfg = st.app.config();
        let pause = if cfg.detector.enabled {
            cfg.detector.tick_ms
        } else {
            1000
        };
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(pause)) => {}
            _ = st.app.life.stopping() => return,
        }
        if !cfg.detector.enabled {
            let mut board = st.anomalies.lock();
            if board.detector.tracked() > 0 {
                *board = Board::new(&cfg.detector);
                st.app.metrics.set_anomalies_active(0);
            }
            continue;
        }
        // Off the session threads: a full statistics table takes most of a millisecond.
        let work = {
            let (st, wanted) = (Arc::clone(&st), cfg.detector.clone());
            tokio::task::spawn_blocking(move || tick(&st, wanted))
        };
        let Ok((events, active)) = work.await else {
            continue;
        };
        st.app.metrics.set_anomalies_active(active.len());
        for e in &events {
            report(&st, e, &cfg);
        }
        if matches!(
            cfg.auto_rules.mode,
            AutoRulesMode::Warn | AutoRulesMode::Enforce
        ) {
            for a in &active {
                if let Subject::Fingerprint(fp) = a.subject {
                    apply(&st, a, fp, &cfg).await;
                }
            }
        }
    }
}

/// One detector tick over the statistics' counters: what started or ended, and what is active.
fn tick(st: &AdminState, wanted: DetectorConfig) -> (Vec<Event>, Vec<Anomaly>) {
    let snapshot = st.app.fp_stats.counters();
    let mut board = st.anomalies.lock();
    if *board.detector.settings() != wanted {
        board.detector.set_settings(wanted);
    }
    let events = board.detector.observe(unix_ms(), snapshot);
    for e in &events {
        if let Event::Cleared(a) = e
            && let Subject::Fingerprint(fp) = a.subject
        {
            board.suppressed.remove(&fp);
            board.noted.retain(|(f, _)| *f != fp);
        }
    }
    (events, board.detector.active())
}

fn report(st: &AdminState, e: &Event, cfg: &Config) {
    match e {
        Event::Started(a) => {
            st.app
                .metrics
                .anomaly_started(subject_name(&a.subject), a.signal.name());
            let ev = &a.evidence;
            let suggestion = (cfg.auto_rules.mode != AutoRulesMode::Off)
                .then(|| target(a, cfg))
                .flatten()
                .map(|(fp, callers)| {
                    let body = suggest(a, &cfg.auto_rules, &cfg.detector, callers, "enforce");
                    format!(
                        "PUT /v1/rules/fingerprint/{} {}",
                        fingerprint_hex(fp),
                        serde_json::to_string(&body).unwrap_or_default()
                    )
                });
            tracing::warn!(
                subject = subject_name(&a.subject),
                fingerprint = a.subject_fingerprint().map(fingerprint_hex),
                caller = a.subject_caller(),
                signal = a.signal.name(),
                baseline = ev.baseline,
                current = ev.current,
                unit = ev.unit,
                ratio = ev.ratio,
                window_ms = ev.window_ms,
                db_time_share = ev.db_time_share,
                normalized = a.normalized.as_deref(),
                suggested_rule = suggestion.as_deref(),
                "anomaly detected"
            );
        }
        Event::Cleared(a) => {
            tracing::info!(
                subject = subject_name(&a.subject),
                fingerprint = a.subject_fingerprint().map(fingerprint_hex),
                caller = a.subject_caller(),
                signal = a.signal.name(),
                lasted_ms = a.last_signal_unix_ms.saturating_sub(a.since_unix_ms),
                peak_ratio = a.evidence.peak_ratio,
                "anomaly ended"
            );
        }
    }
}

/// Counts `outcome` for `fp` once per episode.
fn note_once(st: &AdminState, fp: u64, outcome: &'static str) -> bool {
    let first = st.anomalies.lock().noted.insert((fp, outcome));
    if first {
        st.app.metrics.auto_rule(outcome);
    }
    first
}

/// Installs (or re-installs after expiry) the automatic rule for fingerprint anomaly `a`.
async fn apply(st: &AdminState, a: &Anomaly, fp: u64, cfg: &Config) {
    let live = st.app.policy.rules();
    if st.anomalies.lock().suppressed.contains(&fp) {
        return;
    }
    let now = Instant::now();
    let ours = st.anomalies.lock().installed.get(&fp).copied();
    if let Some(rule) = live.get(fp) {
        if rule.def().origin == Origin::Operator && note_once(st, fp, "operator_rule") {
            tracing::info!(fingerprint = %fingerprint_hex(fp), "anomaly: an operator's rule is in place; no automatic rule");
        }
        return;
    }
    let renewing = match ours {
        // Our rule is gone before its TTL: an operator deleted it.
        Some(expires) if now + Duration::from_millis(500) < expires => {
            st.anomalies.lock().suppressed.insert(fp);
            st.app.metrics.auto_rule("deleted_by_operator");
            tracing::info!(fingerprint = %fingerprint_hex(fp), "anomaly: the automatic rule was deleted by an operator; not put back while this anomaly lasts");
            return;
        }
        Some(_) => true,
        None => false,
    };
    let auto_live = live
        .list(now)
        .iter()
        .filter(|r| r.spec.origin.as_deref() == Some("auto"))
        .count();
    if auto_live >= cfg.auto_rules.max_rules {
        if note_once(st, fp, "at_max_rules") {
            tracing::warn!(fingerprint = %fingerprint_hex(fp), max_rules = cfg.auto_rules.max_rules, "anomaly: auto_rules.max_rules automatic rules are live; none installed");
        }
        return;
    }
    let callers = match non_exempt_callers(cfg).list() {
        Some(c) => c,
        None => {
            if note_once(st, fp, "only_exempt_callers") {
                tracing::warn!(fingerprint = %fingerprint_hex(fp), "anomaly: every caller is exempt (auto_rules.exempt_priorities); no automatic rule");
            }
            return;
        }
    };
    let mode = cfg.auto_rules.mode.name();
    let mut spec = suggest(a, &cfg.auto_rules, &cfg.detector, callers, mode);
    if cfg.auto_rules.mode == AutoRulesMode::Enforce
        && cfg.auto_rules.warn_first_ms > 0
        && !renewing
    {
        spec.warn_first_ms = Some(cfg.auto_rules.warn_first_ms);
    }
    let body = serde_json::to_string(&spec).unwrap_or_default();
    match super::rules::store(st, fp, spec, None).await {
        Ok(_) => {
            let expires = now + Duration::from_secs(cfg.auto_rules.ttl_seconds);
            st.anomalies.lock().installed.insert(fp, expires);
            st.app
                .metrics
                .auto_rule(if renewing { "renewed" } else { "installed" });
            tracing::warn!(
                fingerprint = %fingerprint_hex(fp),
                mode,
                rule = %body,
                renewed = renewing,
                "anomaly: automatic rule installed"
            );
        }
        Err(e) => {
            st.app.metrics.auto_rule("failed");
            tracing::error!(fingerprint = %fingerprint_hex(fp), error = ?e, "anomaly: automatic rule not installed");
        }
    }
    // Forget rules of ours that are long gone, so the map stays as small as the live set.
    st.anomalies
        .lock()
        .installed
        .retain(|f, exp| *f == fp || *exp + Duration::from_secs(60) > now);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::anomaly::Evidence;

    fn anomaly(signal: Signal, baseline_qps: f64, ms_per_s: f64) -> Anomaly {
        Anomaly {
            subject: Subject::Fingerprint(0xabc),
            normalized: None,
            kind: Some("read"),
            signal,
            since_unix_ms: 1,
            last_signal_unix_ms: 2,
            evidence: Evidence {
                baseline: baseline_qps,
                current: baseline_qps * 30.0,
                ratio: 30.0,
                peak_ratio: 30.0,
                unit: "calls_per_second",
                window_ms: 500,
                calls_in_window: 300,
                qps: baseline_qps * 30.0,
                baseline_qps,
                db_ms_per_s: ms_per_s * 30.0,
                baseline_db_ms_per_s: ms_per_s,
                db_time_share: 0.9,
                error_share: 0.0,
                lock_wait_share: 0.0,
            },
            top_callers: vec![("web".into(), 300)],
            top_fingerprint: None,
        }
    }

    #[test]
    fn suggested_rules_are_valid_and_scaled_from_the_baseline() {
        let cfg = Config::default();
        let spec = suggest(
            &anomaly(Signal::RateStep, 20.0, 40.0),
            &cfg.auto_rules,
            &cfg.detector,
            None,
            "enforce",
        );
        let def = spec.validate().expect("a valid rule");
        assert_eq!(def.origin, Origin::Auto);
        assert_eq!(spec.max_qps, Some(40.0), "twice the baseline");
        assert_eq!(spec.ttl_seconds, Some(600));
        // A tiny baseline is held to min_qps, not to nothing.
        let spec = suggest(
            &anomaly(Signal::RateStep, 0.5, 1.0),
            &cfg.auto_rules,
            &cfg.detector,
            Some(vec!["web".into()]),
            "warn",
        );
        assert_eq!(spec.max_qps, Some(20.0));
        assert_eq!(spec.mode.as_deref(), Some("warn"));
        spec.validate().expect("valid");
        let spec = suggest(
            &anomaly(Signal::DbTimeShare, 20.0, 2500.0),
            &cfg.auto_rules,
            &cfg.detector,
            None,
            "enforce",
        );
        assert_eq!(spec.action.as_deref(), Some("CONCURRENCY"));
        assert_eq!(spec.max_inflight, Some(5), "2 x 2.5 backends");
        spec.validate().expect("valid");
    }

    #[test]
    fn exempt_priorities_are_left_out_of_the_callers() {
        let yaml = "callers:\n  - { name: pay, priority: critical }\n  - { name: web }\n  \
                    - { name: etl, priority: low }\n";
        let cfg = Config::from_yaml(yaml).unwrap();
        assert_eq!(
            non_exempt_callers(&cfg),
            RuleCallers::Only(vec!["web".into(), "etl".into(), "default".into()])
        );
        let yaml = format!("{yaml}auto_rules:\n  exempt_priorities: []\n");
        assert_eq!(
            non_exempt_callers(&Config::from_yaml(&yaml).unwrap()),
            RuleCallers::Everyone
        );
        let yaml = "callers:\n  - { name: pay, priority: critical }\nauto_rules:\n  \
                    exempt_priorities: [critical, normal]\n";
        assert_eq!(
            non_exempt_callers(&Config::from_yaml(yaml).unwrap()),
            RuleCallers::Nobody
        );
    }
}
