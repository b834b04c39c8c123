//! pgsluice's own console tables, `SHOW CALLERS`, `FINGERPRINTS`, `RULES` and `ANOMALIES`:
//! the JSON rows of `/v1/callers`, `/v1/fingerprints`, `/v1/rules` and `/v1/anomalies`, read
//! column by column ([`Table::from_json`]), so the console and the API always say the same.
//! The columns are the fields an operator scans; nested values (refusals by reason, callers,
//! suggested rules) are JSON text.

use tokio::time::Instant;

use super::table::{Table, Type};
use crate::admin::{AdminState, anomalies, read};
use crate::observe::stats::SortKey;

use Type::{Int8 as I8, Numeric as N, Text as T};

/// Serialises `v` and takes the array at `field` (the HTTP answer's list).
fn json_rows(v: impl serde::Serialize, field: &str) -> Vec<serde_json::Value> {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::Object(mut m)) => match m.remove(field) {
            Some(serde_json::Value::Array(a)) => a,
            _ => Vec::new(),
        },
        Ok(serde_json::Value::Array(a)) => a,
        _ => Vec::new(),
    }
}

/// `SHOW CALLERS` (`GET /v1/callers`).
pub fn callers(st: &AdminState) -> Table {
    let rows = json_rows(
        st.app.policy.callers_in(&st.app.runtime.load().limits),
        "callers",
    );
    Table::from_json(
        &[
            ("name", T),
            ("priority", T),
            ("max_concurrency", I8),
            ("queue_depth", I8),
            ("queue_timeout_ms", I8),
            ("max_qps", N),
            ("scope", T),
            ("in_flight", I8),
            ("queued", I8),
            ("admitted", I8),
            ("refusals", T),
        ],
        &rows,
    )
}

/// `SHOW FINGERPRINTS` (`GET /v1/fingerprints`: the top 50 by total time).
pub fn fingerprints(st: &AdminState) -> Table {
    let top = st
        .app
        .fp_stats
        .top(SortKey::TotalTime, read::DEFAULT_LIMIT, None);
    let rows = json_rows(top, "");
    Table::from_json(
        &[
            ("fingerprint", T),
            ("kind", T),
            ("calls", I8),
            ("qps", N),
            ("errors", I8),
            ("refusals", I8),
            ("rows", I8),
            ("total_ms", N),
            ("mean_ms", N),
            ("p50_ms", N),
            ("p95_ms", N),
            ("p99_ms", N),
            ("normalized", T),
        ],
        &rows,
    )
}

/// `SHOW RULES` (`GET /v1/rules`).
pub fn rules(st: &AdminState) -> Table {
    let rows = json_rows(st.app.policy.rules().list(Instant::now()), "");
    Table::from_json(
        &[
            ("fingerprint", T),
            ("action", T),
            ("mode", T),
            ("max_qps", N),
            ("burst", I8),
            ("action_on_exceed", T),
            ("max_inflight", I8),
            ("statement_timeout_ms", I8),
            ("lock_timeout_ms", I8),
            ("route", T),
            ("max_wait_ms", I8),
            ("max_result_bytes", I8),
            ("callers", T),
            ("origin", T),
            ("expires_in_ms", I8),
            ("hits", I8),
            ("refusals", I8),
            ("warned", I8),
            ("in_flight", I8),
            ("error_message", T),
            ("note", T),
        ],
        &rows,
    )
}

/// `SHOW ANOMALIES` (`GET /v1/anomalies`).
pub fn anomalies(st: &AdminState) -> Table {
    let rows = json_rows(anomalies::anomaly_list(st), "anomalies");
    Table::from_json(
        &[
            ("subject", T),
            ("fingerprint", T),
            ("caller", T),
            ("signal", T),
            ("since_unix_ms", I8),
            ("active_for_ms", I8),
            ("kind", T),
            ("normalized", T),
            ("top_callers", T),
            ("suggested_rule", T),
            ("rule", T),
        ],
        &rows,
    )
}
