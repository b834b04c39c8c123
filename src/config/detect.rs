//! `detector:` and `auto_rules:` — naming the culprit of an overload and, where allowed,
//! throttling it automatically (the detector itself is `observe::anomaly`; the rules it
//! installs go through the admin API's rule store).
//!
//! Both sections are read on every detector tick, so a reload applies within a tick.

use serde::Deserialize;

use super::Priority;

/// `detector:` — the anomaly detector's knobs (docs/OPERATIONS.md, "Culprit detection").
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DetectorConfig {
    /// Off: no detection, `/v1/anomalies` is empty, no automatic rules.
    pub enabled: bool,
    /// How often the statistics are read.
    pub tick_ms: u64,
    /// The span the current values are measured over.
    pub window_ms: u64,
    /// The span a fingerprint's share of all statement time is measured over.
    pub share_window_ms: u64,
    /// A rate or time this many times its baseline is a step.
    pub step_factor: f64,
    /// Below this many calls per second nothing is a rate step.
    pub min_qps: f64,
    /// Baselines below this rate count as this rate (a new pattern starts at zero).
    pub baseline_floor_qps: f64,
    /// Half-life of the baselines (exponentially weighted means).
    pub baseline_half_life_ms: u64,
    /// Learning time after start: nothing is flagged, what is seen is the baseline.
    pub warmup_ms: u64,
    /// An anomaly ends this long after its signal was last seen.
    pub clear_after_ms: u64,
    /// Ticks in a row a signal must hold before it is an anomaly.
    pub confirm_ticks: u32,
    /// A fingerprint's share of all statement time that, with a time step, flags it.
    pub time_share: f64,
    /// Time baselines below this (client ms per second) count as this.
    pub time_floor_ms_per_s: f64,
    /// Share of calls that failed (timeouts included) that is an error anomaly.
    pub error_share: f64,
    /// Share of a pattern's time spent in statements that ended in 55P03.
    pub lock_wait_share: f64,
    /// Calls in the window the share signals need.
    pub min_calls: u64,
}

impl Default for DetectorConfig {
    fn default() -> Self {
        DetectorConfig {
            enabled: true,
            tick_ms: 250,
            window_ms: 500,
            share_window_ms: 2_000,
            step_factor: 10.0,
            min_qps: 20.0,
            baseline_floor_qps: 5.0,
            baseline_half_life_ms: 60_000,
            warmup_ms: 10_000,
            clear_after_ms: 10_000,
            confirm_ticks: 2,
            time_share: 0.25,
            time_floor_ms_per_s: 50.0,
            error_share: 0.5,
            lock_wait_share: 0.5,
            min_calls: 5,
        }
    }
}

/// What the detector may do about an anomaly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AutoRulesMode {
    /// Report anomalies and their evidence only.
    Off,
    /// Also carry a rule body ready to PUT, and log it.
    #[default]
    Suggest,
    /// Install that rule in warn mode (NOTICE and counters, nothing refused).
    Warn,
    /// Install it enforcing, with a TTL.
    Enforce,
}

impl AutoRulesMode {
    pub fn name(self) -> &'static str {
        match self {
            AutoRulesMode::Off => "off",
            AutoRulesMode::Suggest => "suggest",
            AutoRulesMode::Warn => "warn",
            AutoRulesMode::Enforce => "enforce",
        }
    }
}

/// `auto_rules:` — rules the detector installs (marked `origin: auto`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AutoRulesConfig {
    pub mode: AutoRulesMode,
    /// Automatic rules live at once, at most.
    pub max_rules: usize,
    /// Each automatic rule expires after this long (the detector installs it again if the
    /// anomaly still holds then).
    pub ttl_seconds: u64,
    /// Callers of these priorities are never subject to an automatic rule.
    pub exempt_priorities: Vec<Priority>,
    /// A THROTTLE allows this many times the pattern's baseline rate (at least
    /// `detector.min_qps`); a CONCURRENCY this many times its baseline concurrency (at least 1).
    pub throttle_multiple: f64,
    /// With `mode: enforce`: a new automatic rule acts as `warn` for this long (a confirmation
    /// window: its `warned` counter shows what it would refuse, and an operator may delete
    /// it), then enforces by itself. 0: enforce at once. A rule put back after its TTL while
    /// the anomaly holds enforces at once.
    pub warn_first_ms: u64,
}

impl Default for AutoRulesConfig {
    fn default() -> Self {
        AutoRulesConfig {
            mode: AutoRulesMode::Suggest,
            max_rules: 5,
            ttl_seconds: 600,
            exempt_priorities: vec![Priority::Critical],
            throttle_multiple: 2.0,
            warn_first_ms: 0,
        }
    }
}

/// Longest automatic rule TTL: a day (an automatic rule is an incident measure).
pub const MAX_AUTO_TTL_SECONDS: u64 = 86_400;

/// The problems of both sections: (field, message) pairs, which `validate` places by line.
pub(super) fn problems(d: &DetectorConfig, a: &AutoRulesConfig) -> Vec<(String, String)> {
    let mut p = Found(Vec::new());
    if !(10..=10_000).contains(&d.tick_ms) {
        p.add("detector.tick_ms".into(), "must be between 10 and 10000");
    }
    if d.window_ms < d.tick_ms || d.window_ms > 60_000 {
        p.add(
            "detector.window_ms".into(),
            "must be at least detector.tick_ms and at most 60000",
        );
    }
    if d.share_window_ms < d.window_ms || d.share_window_ms > 60_000 {
        p.add(
            "detector.share_window_ms".into(),
            "must be at least detector.window_ms and at most 60000",
        );
    }
    if !(d.step_factor > 1.0 && d.step_factor <= 1000.0) {
        p.add(
            "detector.step_factor".into(),
            "must be above 1 and at most 1000",
        );
    }
    for (field, v) in [
        ("min_qps", d.min_qps),
        ("baseline_floor_qps", d.baseline_floor_qps),
        ("time_floor_ms_per_s", d.time_floor_ms_per_s),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            p.add(format!("detector.{field}"), "must be a number >= 0");
        }
    }
    if d.baseline_half_life_ms < d.tick_ms {
        p.add(
            "detector.baseline_half_life_ms".into(),
            "must be at least detector.tick_ms",
        );
    }
    if d.confirm_ticks == 0 || d.confirm_ticks > 100 {
        p.add("detector.confirm_ticks".into(), "must be between 1 and 100");
    }
    for (field, v) in [
        ("time_share", d.time_share),
        ("error_share", d.error_share),
        ("lock_wait_share", d.lock_wait_share),
    ] {
        if !(v > 0.0 && v <= 1.0) {
            p.add(format!("detector.{field}"), "must be above 0 and at most 1");
        }
    }
    if a.max_rules == 0 || a.max_rules > 100 {
        p.add("auto_rules.max_rules".into(), "must be between 1 and 100");
    }
    if a.ttl_seconds == 0 || a.ttl_seconds > MAX_AUTO_TTL_SECONDS {
        p.add(
            "auto_rules.ttl_seconds".into(),
            format!(
                "must be between 1 and {MAX_AUTO_TTL_SECONDS}: an automatic rule always expires"
            ),
        );
    }
    if !(a.throttle_multiple >= 1.0 && a.throttle_multiple <= 1000.0) {
        p.add(
            "auto_rules.throttle_multiple".into(),
            "must be between 1 and 1000",
        );
    }
    // Shorter than the TTL, or the rule would expire before it ever enforced.
    if a.warn_first_ms > 0 && a.warn_first_ms >= a.ttl_seconds.saturating_mul(1000) {
        p.add(
            "auto_rules.warn_first_ms".into(),
            format!(
                "must be shorter than auto_rules.ttl_seconds ({} s): the rule would expire \
                 before it enforced",
                a.ttl_seconds
            ),
        );
    }
    if !d.enabled && matches!(a.mode, AutoRulesMode::Warn | AutoRulesMode::Enforce) {
        p.add(
            "auto_rules.mode".into(),
            format!(
                "{} needs the detector: set detector.enabled: true or auto_rules.mode: off",
                a.mode.name()
            ),
        );
    }
    p.0
}

/// Collects (field, message) pairs.
struct Found(Vec<(String, String)>);

impl Found {
    fn add(&mut self, field: String, message: impl Into<String>) {
        self.0.push((field, message.into()));
    }
}

#[cfg(test)]
mod tests {
    use super::super::Config;
    use super::*;

    fn fields(yaml: &str) -> Vec<String> {
        match Config::from_yaml(yaml) {
            Ok(_) => Vec::new(),
            Err(errors) => errors.into_iter().map(|e| e.field).collect(),
        }
    }

    #[test]
    fn defaults_suggest_and_exempt_critical_callers() {
        let cfg = Config::from_yaml("").unwrap();
        assert!(cfg.detector.enabled);
        assert_eq!(cfg.auto_rules.mode, AutoRulesMode::Suggest);
        assert_eq!(cfg.auto_rules.exempt_priorities, [Priority::Critical]);
        assert_eq!(
            cfg.auto_rules.warn_first_ms, 0,
            "enforce at once by default"
        );
        let cfg = Config::from_yaml(
            "auto_rules: { mode: enforce, exempt_priorities: [critical, high], max_rules: 2 }\n\
             detector: { tick_ms: 100, window_ms: 300 }\n",
        )
        .unwrap();
        assert_eq!(cfg.auto_rules.mode, AutoRulesMode::Enforce);
        assert_eq!(cfg.auto_rules.max_rules, 2);
        assert_eq!(cfg.detector.window_ms, 300);
    }

    #[test]
    fn bad_values_name_their_field() {
        assert_eq!(fields("detector: { tick_ms: 5 }\n"), ["detector.tick_ms"]);
        assert_eq!(
            fields("detector: { tick_ms: 500, window_ms: 200 }\n"),
            ["detector.window_ms"]
        );
        assert_eq!(
            fields("detector: { step_factor: 1 }\n"),
            ["detector.step_factor"]
        );
        assert_eq!(
            fields("detector: { error_share: 1.5 }\n"),
            ["detector.error_share"]
        );
        assert_eq!(
            fields("auto_rules: { ttl_seconds: 0 }\n"),
            ["auto_rules.ttl_seconds"]
        );
        assert_eq!(
            fields("detector: { enabled: false }\nauto_rules: { mode: enforce }\n"),
            ["auto_rules.mode"]
        );
        assert_eq!(
            fields("auto_rules: { ttl_seconds: 60, warn_first_ms: 60000 }\n"),
            ["auto_rules.warn_first_ms"]
        );
        assert!(fields("auto_rules: { ttl_seconds: 60, warn_first_ms: 59999 }\n").is_empty());
        let unknown = Config::from_yaml("auto_rules: { mode: always }\n").unwrap_err();
        assert!(
            unknown[0].message.contains("unknown variant `always`"),
            "{:?}",
            unknown[0]
        );
        assert!(
            Config::from_yaml("detector: { step: 3 }\n").is_err(),
            "unknown keys are errors"
        );
    }
}
