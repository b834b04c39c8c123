//! Rule vocabulary and validation: the JSON an SRE PUTs, checked into a [`RuleDef`].
//!
//! Owns the rule shape (REJECT, THROTTLE, CONCURRENCY, TIMEOUT, ROUTE, COALESCE and their
//! fields), parsing with
//! field-level errors, and the fingerprint text form. It holds no runtime state; the live rule
//! set, counters, expiry and persistence are in `rules`, which re-exports everything here.
//!
//! Shape decisions:
//! * Enumerated fields (`action`, `mode`, `action_on_exceed`) are strings validated by hand so
//!   every error names its field; they are accepted in any case and stored normalised.
//! * A field that means nothing for the action (e.g. `max_qps` on REJECT) is an error rather
//!   than silently ignored: during an incident a typo should fail loudly.
//! * TIMEOUT values may be 0, which Postgres reads as "no timeout" — a way to exempt one
//!   known-long report from a caller's default.
//! * `mode: warn` counts and reports what would have been refused and lets the statement run;
//!   it is meaningless for TIMEOUT and rejected there.
//! * `warn_first_ms` makes an enforcing rule act as `warn` for that long after it is created,
//!   then enforce by itself: a confirmation window in which its `warned` counter shows what it
//!   is about to refuse and an operator can still delete it. The switch time is the creation
//!   time plus the window, and the creation time is persisted, so a restart or a fleet member
//!   that learns the rule later switches at the same moment; nothing has to run to flip it.
//!   It needs `mode: enforce` and an action that refuses, and must end before the TTL.
//! * Free text (`error_message`, `note`, caller names) is bounded and NUL-free because it ends
//!   up in protocol messages; the caller list is bounded ([`MAX_RULE_CALLERS`]) because the hot
//!   path scans it. Every source of rules (API, rules file, a fleet's Redis) passes through
//!   [`RuleSpec::validate`], so the caps are the same everywhere.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Scope;
use super::bucket::{MAX_RATE, TokenBucket};

/// Largest rule body accepted by [`RuleSpec::from_json`].
pub const MAX_RULE_JSON_BYTES: usize = 64 * 1024;
/// Longest TTL: ten years keeps `Instant` arithmetic far from overflow.
pub const MAX_TTL_SECONDS: u64 = 10 * 365 * 86_400;
/// Postgres timeouts are int milliseconds.
pub const MAX_TIMEOUT_MS: u64 = i32::MAX as u64;
const MAX_TEXT_BYTES: usize = 1024;
/// Most caller names one rule may list: every statement a rule sees scans the list, and the
/// same cap holds for rules PUT over the API, read from a rules file or from a fleet's Redis.
pub const MAX_RULE_CALLERS: usize = 64;
const MAX_INFLIGHT: u32 = 1_000_000;
const MAX_BURST: u32 = 1_000_000;
/// COALESCE: the longest a client may wait for another's identical read (ms).
pub const MAX_COALESCE_WAIT_MS: u64 = 60_000;
/// COALESCE: the largest shared result (bytes); a larger one is not shared.
pub const MAX_COALESCE_RESULT_BYTES: u64 = 16 * 1024 * 1024;
/// COALESCE defaults.
pub const DEFAULT_COALESCE_WAIT_MS: u64 = 1_000;
pub const DEFAULT_COALESCE_RESULT_BYTES: u64 = 64 * 1024;

/// A rule as written by a user (the PUT body). All fields optional at this level so that
/// validation, not deserialisation, reports what is missing.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSpec {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_qps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action_on_exceed: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_inflight: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub statement_timeout_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lock_timeout_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_message: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub callers: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// `instance` (default) or `fleet`: a THROTTLE shared by every instance of a fleet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    /// `operator` (default; not listed) or `auto`: installed by the anomaly detector.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
    /// ROUTE: `replica` (the pattern's plain reads go to the database's replicas) or
    /// `primary` (they stay on the primary, whatever the caller's `route`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    /// Act as `warn` for this long after the rule is created, then enforce.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warn_first_ms: Option<u64>,
    /// COALESCE: how long a client waits for the identical read already running before it
    /// runs its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_wait_ms: Option<u64>,
    /// COALESCE: the largest result shared; a larger one is run by each client itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_result_bytes: Option<u64>,
}

/// A validation error naming the offending field (`body` for the document as a whole).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("{field}: {message}")]
pub struct RuleError {
    pub field: String,
    pub message: String,
}

impl RuleError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }

    /// The same error nested under a parent path (`rules[3].max_qps`).
    pub(super) fn within(self, parent: &str) -> Self {
        Self::new(format!("{parent}.{}", self.field), self.message)
    }
}

/// What a rule does, validated.
#[derive(Debug, Clone, PartialEq)]
pub enum RuleAction {
    Reject,
    Throttle {
        max_qps: f64,
        burst: u32,
        on_exceed: OnExceed,
    },
    Concurrency {
        max_inflight: u32,
    },
    Timeout {
        statement_timeout: Option<Duration>,
        lock_timeout: Option<Duration>,
    },
    /// Where the pattern's plain reads go (`true`: the replicas).
    Route {
        replica: bool,
    },
    /// Identical reads of the pattern share one execution (`crate::coalesce`).
    Coalesce {
        max_wait: Duration,
        max_result_bytes: usize,
    },
}

impl RuleAction {
    /// Upper-case action name, bounded set (safe as a metric label).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Reject => "REJECT",
            Self::Throttle { .. } => "THROTTLE",
            Self::Concurrency { .. } => "CONCURRENCY",
            Self::Timeout { .. } => "TIMEOUT",
            Self::Route { .. } => "ROUTE",
            Self::Coalesce { .. } => "COALESCE",
        }
    }

    /// An action that never refuses a statement (no warn mode, no error message).
    pub fn refuses_nothing(&self) -> bool {
        matches!(
            self,
            Self::Timeout { .. } | Self::Route { .. } | Self::Coalesce { .. }
        )
    }
}

/// THROTTLE behaviour once the bucket is empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnExceed {
    /// Refuse at once with `ERR_RATE_LIMITED`.
    Reject,
    /// Wait for a token up to the caller's queue timeout, then refuse.
    Queue,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleMode {
    Enforce,
    /// Count and report what would be refused, refuse nothing.
    Warn,
}

/// A validated rule definition (no runtime state).
#[derive(Debug, Clone, PartialEq)]
pub struct RuleDef {
    pub action: RuleAction,
    pub mode: RuleMode,
    /// Apply only to these caller names; `None` = everyone.
    pub callers: Option<Vec<String>>,
    pub error_message: Option<String>,
    pub ttl: Option<Duration>,
    pub note: Option<String>,
    pub scope: Scope,
    pub origin: Origin,
    /// Enforcing, but only once this long has passed since the rule was created (warn before).
    pub warn_first: Option<Duration>,
}

/// Who made a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Origin {
    #[default]
    Operator,
    /// The anomaly detector (`auto_rules`): it may replace or let expire only these.
    Auto,
}

impl RuleSpec {
    /// Parse a PUT body. Every error names a field: an unknown key, a wrongly typed value, or
    /// `body` when the document itself is not a JSON object.
    pub fn from_json(bytes: &[u8]) -> Result<Self, RuleError> {
        if bytes.len() > MAX_RULE_JSON_BYTES {
            return Err(RuleError::new(
                "body",
                format!(
                    "too large ({} bytes, limit {MAX_RULE_JSON_BYTES})",
                    bytes.len()
                ),
            ));
        }
        let value: serde_json::Value = serde_json::from_slice(bytes)
            .map_err(|e| RuleError::new("body", format!("invalid JSON: {e}")))?;
        Self::from_value(value)
    }

    /// As [`RuleSpec::from_json`], from an already parsed document.
    pub fn from_value(value: serde_json::Value) -> Result<Self, RuleError> {
        let Some(map) = value.as_object() else {
            return Err(RuleError::new("body", "must be a JSON object"));
        };
        match Self::deserialize(&value) {
            Ok(spec) => Ok(spec),
            Err(whole) => {
                // serde_json does not say which field failed; every field is optional, so
                // deserialising each key on its own finds the culprit.
                for (key, val) in map {
                    let single = serde_json::Map::from_iter([(key.clone(), val.clone())]);
                    if let Err(e) = serde_json::from_value::<Self>(single.into()) {
                        return Err(RuleError::new(key.clone(), strip_position(&e.to_string())));
                    }
                }
                Err(RuleError::new("body", strip_position(&whole.to_string())))
            }
        }
    }

    /// Check the spec and return the definition, or the first error found.
    pub fn validate(&self) -> Result<RuleDef, RuleError> {
        let action_name = self
            .action
            .as_deref()
            .ok_or_else(|| {
                RuleError::new(
                    "action",
                    "required (REJECT, THROTTLE, CONCURRENCY, TIMEOUT, ROUTE or COALESCE)",
                )
            })?
            .to_ascii_uppercase();
        self.check_fields_of(&action_name)?;
        let action = self.validate_action(&action_name)?;
        let scope = self.validate_scope(&action_name)?;
        let mode = self.validate_mode(&action)?;
        let ttl = match self.ttl_seconds {
            None => None,
            Some(s) if (1..=MAX_TTL_SECONDS).contains(&s) => Some(Duration::from_secs(s)),
            Some(_) => {
                return Err(RuleError::new(
                    "ttl_seconds",
                    format!("must be between 1 and {MAX_TTL_SECONDS}"),
                ));
            }
        };
        let warn_first = self.validate_warn_first(&action, mode, ttl)?;
        self.validate_texts()?;
        let origin = match self
            .origin
            .as_deref()
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            None | Some("operator") => Origin::Operator,
            Some("auto") => Origin::Auto,
            Some(other) => {
                return Err(RuleError::new(
                    "origin",
                    format!("unknown origin {other:?}; expected operator or auto"),
                ));
            }
        };
        Ok(RuleDef {
            action,
            mode,
            callers: self.callers.clone(),
            error_message: self.error_message.clone(),
            ttl,
            note: self.note.clone(),
            scope,
            origin,
            warn_first,
        })
    }

    /// A field that means nothing for the action is an error, not silently ignored.
    fn check_fields_of(&self, action_name: &str) -> Result<(), RuleError> {
        let only = |field: &str, present: bool, valid_for: &str| {
            if present {
                Err(RuleError::new(
                    field,
                    format!("only valid with action {valid_for}"),
                ))
            } else {
                Ok(())
            }
        };
        if action_name != "THROTTLE" {
            only("max_qps", self.max_qps.is_some(), "THROTTLE")?;
            only("burst", self.burst.is_some(), "THROTTLE")?;
            only(
                "action_on_exceed",
                self.action_on_exceed.is_some(),
                "THROTTLE",
            )?;
        }
        if action_name != "CONCURRENCY" {
            only("max_inflight", self.max_inflight.is_some(), "CONCURRENCY")?;
        }
        if action_name != "TIMEOUT" {
            only(
                "statement_timeout_ms",
                self.statement_timeout_ms.is_some(),
                "TIMEOUT",
            )?;
            only("lock_timeout_ms", self.lock_timeout_ms.is_some(), "TIMEOUT")?;
        }
        if action_name != "ROUTE" {
            only("route", self.route.is_some(), "ROUTE")?;
        }
        if action_name != "COALESCE" {
            only("max_wait_ms", self.max_wait_ms.is_some(), "COALESCE")?;
            only(
                "max_result_bytes",
                self.max_result_bytes.is_some(),
                "COALESCE",
            )?;
        }
        Ok(())
    }

    /// The action and the fields it needs.
    fn validate_action(&self, action_name: &str) -> Result<RuleAction, RuleError> {
        Ok(match action_name {
            "REJECT" => RuleAction::Reject,
            "THROTTLE" => self.validate_throttle()?,
            "CONCURRENCY" => {
                let max_inflight = self
                    .max_inflight
                    .ok_or_else(|| RuleError::new("max_inflight", "required for CONCURRENCY"))?;
                if !(1..=MAX_INFLIGHT).contains(&max_inflight) {
                    return Err(RuleError::new(
                        "max_inflight",
                        format!("must be between 1 and {MAX_INFLIGHT}"),
                    ));
                }
                RuleAction::Concurrency { max_inflight }
            }
            "TIMEOUT" => {
                if self.statement_timeout_ms.is_none() && self.lock_timeout_ms.is_none() {
                    return Err(RuleError::new(
                        "statement_timeout_ms",
                        "TIMEOUT needs statement_timeout_ms and/or lock_timeout_ms",
                    ));
                }
                RuleAction::Timeout {
                    statement_timeout: timeout_field(
                        "statement_timeout_ms",
                        self.statement_timeout_ms,
                    )?,
                    lock_timeout: timeout_field("lock_timeout_ms", self.lock_timeout_ms)?,
                }
            }
            "ROUTE" => match self
                .route
                .as_deref()
                .map(str::to_ascii_lowercase)
                .as_deref()
            {
                Some("replica") => RuleAction::Route { replica: true },
                Some("primary") => RuleAction::Route { replica: false },
                Some(other) => {
                    return Err(RuleError::new(
                        "route",
                        format!("unknown route {other:?}; expected replica or primary"),
                    ));
                }
                None => return Err(RuleError::new("route", "required for ROUTE")),
            },
            "COALESCE" => self.validate_coalesce()?,
            _ => {
                return Err(RuleError::new(
                    "action",
                    format!(
                        "unknown action {:?}; expected REJECT, THROTTLE, CONCURRENCY, TIMEOUT, ROUTE \
                         or COALESCE",
                        self.action.as_deref().unwrap_or_default()
                    ),
                ));
            }
        })
    }

    /// COALESCE: its wait and result bound, each within its range (defaults when absent).
    fn validate_coalesce(&self) -> Result<RuleAction, RuleError> {
        let wait = self.max_wait_ms.unwrap_or(DEFAULT_COALESCE_WAIT_MS);
        if !(1..=MAX_COALESCE_WAIT_MS).contains(&wait) {
            return Err(RuleError::new(
                "max_wait_ms",
                format!("must be between 1 and {MAX_COALESCE_WAIT_MS}"),
            ));
        }
        let bytes = self
            .max_result_bytes
            .unwrap_or(DEFAULT_COALESCE_RESULT_BYTES);
        if !(1..=MAX_COALESCE_RESULT_BYTES).contains(&bytes) {
            return Err(RuleError::new(
                "max_result_bytes",
                format!("must be between 1 and {MAX_COALESCE_RESULT_BYTES}"),
            ));
        }
        Ok(RuleAction::Coalesce {
            max_wait: Duration::from_millis(wait),
            max_result_bytes: usize::try_from(bytes).unwrap_or(usize::MAX),
        })
    }

    /// `scope`: instance, or fleet for a THROTTLE (a fleet-wide rate).
    fn validate_scope(&self, action_name: &str) -> Result<Scope, RuleError> {
        Ok(
            match self
                .scope
                .as_deref()
                .map(str::to_ascii_lowercase)
                .as_deref()
            {
                None | Some("instance") => Scope::Instance,
                Some("fleet") if action_name == "THROTTLE" => Scope::Fleet,
                Some("fleet") => {
                    return Err(RuleError::new(
                        "scope",
                        "fleet is only valid with action THROTTLE (a fleet-wide rate)",
                    ));
                }
                Some(other) => {
                    return Err(RuleError::new(
                        "scope",
                        format!("unknown scope {other:?}; expected instance or fleet"),
                    ));
                }
            },
        )
    }

    /// `mode`: enforce, or warn for an action that refuses something; and an
    /// `error_message` only where something is refused.
    fn validate_mode(&self, action: &RuleAction) -> Result<RuleMode, RuleError> {
        let mode = match self.mode.as_deref().map(str::to_ascii_lowercase).as_deref() {
            None | Some("enforce") => RuleMode::Enforce,
            Some("warn") => RuleMode::Warn,
            Some(other) => {
                return Err(RuleError::new(
                    "mode",
                    format!("unknown mode {other:?}; expected enforce or warn"),
                ));
            }
        };
        let refuses_nothing = action.refuses_nothing();
        if mode == RuleMode::Warn && refuses_nothing {
            return Err(RuleError::new(
                "mode",
                format!(
                    "warn has no meaning for {} (nothing is refused)",
                    action.name()
                ),
            ));
        }
        if refuses_nothing && self.error_message.is_some() {
            return Err(RuleError::new(
                "error_message",
                format!(
                    "{} refuses nothing, so it has no error_message",
                    action.name()
                ),
            ));
        }
        Ok(mode)
    }

    /// The free texts: the caller list (bounded, no empty name), `error_message`, `note`.
    fn validate_texts(&self) -> Result<(), RuleError> {
        if let Some(callers) = &self.callers {
            if callers.is_empty() {
                return Err(RuleError::new(
                    "callers",
                    "must not be empty (omit it to match every caller)",
                ));
            }
            if callers.len() > MAX_RULE_CALLERS {
                return Err(RuleError::new(
                    "callers",
                    format!(
                        "at most {MAX_RULE_CALLERS} callers ({} given)",
                        callers.len()
                    ),
                ));
            }
            for (i, c) in callers.iter().enumerate() {
                text_field(&format!("callers[{i}]"), c)?;
                if c.is_empty() {
                    return Err(RuleError::new(format!("callers[{i}]"), "must not be empty"));
                }
            }
        }
        if let Some(m) = &self.error_message {
            text_field("error_message", m)?;
        }
        if let Some(n) = &self.note {
            text_field("note", n)?;
        }
        Ok(())
    }

    /// `warn_first_ms`: a window before an enforcing, refusing rule enforces; 0 is none.
    fn validate_warn_first(
        &self,
        action: &RuleAction,
        mode: RuleMode,
        ttl: Option<Duration>,
    ) -> Result<Option<Duration>, RuleError> {
        const FIELD: &str = "warn_first_ms";
        let Some(ms) = self.warn_first_ms.filter(|ms| *ms > 0) else {
            return Ok(None);
        };
        if action.refuses_nothing() {
            return Err(RuleError::new(
                FIELD,
                format!(
                    "{} refuses nothing, so it has no warn window",
                    action.name()
                ),
            ));
        }
        if mode == RuleMode::Warn {
            return Err(RuleError::new(
                FIELD,
                "only valid with mode enforce (a warn rule never enforces)",
            ));
        }
        let window = Duration::from_millis(ms);
        if window > Duration::from_secs(MAX_TTL_SECONDS) {
            return Err(RuleError::new(
                FIELD,
                format!("must be at most {} (ten years)", MAX_TTL_SECONDS * 1000),
            ));
        }
        if let Some(ttl) = ttl
            && window >= ttl
        {
            return Err(RuleError::new(
                FIELD,
                format!(
                    "must be shorter than ttl_seconds ({} s): the rule would expire before it \
                     enforces",
                    ttl.as_secs()
                ),
            ));
        }
        Ok(Some(window))
    }

    fn validate_throttle(&self) -> Result<RuleAction, RuleError> {
        let max_qps = self
            .max_qps
            .ok_or_else(|| RuleError::new("max_qps", "required for THROTTLE"))?;
        if max_qps.is_nan() || max_qps.is_infinite() {
            return Err(RuleError::new("max_qps", "must be a finite number"));
        }
        if max_qps <= 0.0 {
            return Err(RuleError::new(
                "max_qps",
                "must be > 0 (use REJECT to block)",
            ));
        }
        if max_qps < crate::policy::bucket::MIN_RATE {
            return Err(RuleError::new(
                "max_qps",
                format!(
                    "must be >= {} (one statement per 1000 s; use REJECT to block)",
                    crate::policy::bucket::MIN_RATE
                ),
            ));
        }
        if max_qps > MAX_RATE {
            return Err(RuleError::new("max_qps", format!("must be <= {MAX_RATE}")));
        }
        let burst = self
            .burst
            .unwrap_or_else(|| TokenBucket::default_burst(max_qps));
        if !(1..=MAX_BURST).contains(&burst) {
            return Err(RuleError::new(
                "burst",
                format!("must be between 1 and {MAX_BURST}"),
            ));
        }
        let on_exceed = match self
            .action_on_exceed
            .as_deref()
            .map(str::to_ascii_uppercase)
            .as_deref()
        {
            None | Some("REJECT") => OnExceed::Reject,
            Some("QUEUE") => OnExceed::Queue,
            Some(other) => {
                return Err(RuleError::new(
                    "action_on_exceed",
                    format!("unknown value {other:?}; expected REJECT or QUEUE"),
                ));
            }
        };
        Ok(RuleAction::Throttle {
            max_qps,
            burst,
            on_exceed,
        })
    }
}

impl RuleDef {
    /// The spec in canonical form (upper-case action, defaults filled in) for listing and
    /// persistence.
    pub fn to_spec(&self) -> RuleSpec {
        let mut spec = RuleSpec {
            action: Some(self.action.name().to_owned()),
            mode: Some(match self.mode {
                RuleMode::Enforce => "enforce".to_owned(),
                RuleMode::Warn => "warn".to_owned(),
            }),
            callers: self.callers.clone(),
            error_message: self.error_message.clone(),
            ttl_seconds: self.ttl.map(|t| t.as_secs()),
            note: self.note.clone(),
            scope: (self.scope == Scope::Fleet).then(|| "fleet".to_owned()),
            origin: (self.origin == Origin::Auto).then(|| "auto".to_owned()),
            warn_first_ms: self.warn_first.map(duration_ms),
            ..RuleSpec::default()
        };
        match &self.action {
            RuleAction::Reject => {}
            RuleAction::Throttle {
                max_qps,
                burst,
                on_exceed,
            } => {
                spec.max_qps = Some(*max_qps);
                spec.burst = Some(*burst);
                spec.action_on_exceed = Some(
                    match on_exceed {
                        OnExceed::Reject => "REJECT",
                        OnExceed::Queue => "QUEUE",
                    }
                    .to_owned(),
                );
            }
            RuleAction::Concurrency { max_inflight } => spec.max_inflight = Some(*max_inflight),
            RuleAction::Timeout {
                statement_timeout,
                lock_timeout,
            } => {
                spec.statement_timeout_ms = statement_timeout.map(duration_ms);
                spec.lock_timeout_ms = lock_timeout.map(duration_ms);
            }
            RuleAction::Route { replica } => {
                spec.route = Some(if *replica { "replica" } else { "primary" }.to_owned());
            }
            RuleAction::Coalesce {
                max_wait,
                max_result_bytes,
            } => {
                spec.max_wait_ms = Some(duration_ms(*max_wait));
                spec.max_result_bytes = Some(*max_result_bytes as u64);
            }
        }
        spec
    }
}

fn timeout_field(field: &str, ms: Option<u64>) -> Result<Option<Duration>, RuleError> {
    match ms {
        None => Ok(None),
        Some(ms) if ms <= MAX_TIMEOUT_MS => Ok(Some(Duration::from_millis(ms))),
        Some(_) => Err(RuleError::new(
            field,
            format!("must be between 0 and {MAX_TIMEOUT_MS}"),
        )),
    }
}

/// Text that ends up in protocol messages: bounded, and no NUL (Postgres strings are
/// NUL-terminated, so one would truncate or corrupt the ErrorResponse).
fn text_field(field: &str, s: &str) -> Result<(), RuleError> {
    if s.len() > MAX_TEXT_BYTES {
        return Err(RuleError::new(
            field,
            format!("longer than {MAX_TEXT_BYTES} bytes"),
        ));
    }
    if s.contains('\0') {
        return Err(RuleError::new(field, "must not contain NUL characters"));
    }
    Ok(())
}

/// serde_json appends " at line 1 column 9" to messages; useless once the field is named.
fn strip_position(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_owned(),
        None => msg.to_owned(),
    }
}

pub use crate::classify::fingerprint_hex;

/// Parse a fingerprint from a URL or file: exactly 16 hex digits (either case).
pub fn parse_fingerprint(s: &str) -> Result<u64, RuleError> {
    crate::classify::parse_fingerprint_hex(s)
        .ok_or_else(|| RuleError::new("fingerprint", "must be 16 hex digits"))
}

pub(super) fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
