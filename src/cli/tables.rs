//! What the CLI prints: the admin API's JSON turned into aligned tables (rules, top
//! fingerprints and their anomalies, pools, callers, the breaker). Pure functions of the
//! JSON, so each is tested without a proxy; a field the server does not send prints `-`.

use std::fmt::Write as _;

use serde_json::Value;

/// Left-aligned columns, two spaces apart.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::new();
        for (i, c) in cells.enumerate() {
            let _ = write!(l, "{c:<w$}  ", w = widths.get(i).copied().unwrap_or(0));
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for r in rows {
        line(&mut r.iter().map(String::as_str));
    }
    out
}

pub fn num(v: &Value, k: &str) -> String {
    match v.get(k) {
        Some(Value::Number(n)) => n.to_string(),
        _ => "-".to_owned(),
    }
}

fn ms(v: &Value, k: &str) -> String {
    v.get(k)
        .and_then(Value::as_f64)
        .map_or_else(|| "-".to_owned(), |f| format!("{f:.2}"))
}

/// A rate: one decimal.
fn rate(v: &Value, k: &str) -> String {
    v.get(k)
        .and_then(Value::as_f64)
        .map_or_else(|| "-".to_owned(), |f| format!("{f:.1}"))
}

pub fn text(v: &Value, k: &str) -> String {
    v.get(k).and_then(Value::as_str).unwrap_or("-").to_owned()
}

/// What the rule limits, in a few words.
fn rule_limit(r: &Value) -> String {
    match r.get("action").and_then(Value::as_str).unwrap_or_default() {
        "THROTTLE" => format!(
            "{}/s burst {} then {}",
            num(r, "max_qps"),
            num(r, "burst"),
            text(r, "action_on_exceed")
        ),
        "CONCURRENCY" => format!("{} in flight", num(r, "max_inflight")),
        "TIMEOUT" => format!(
            "statement {} ms, lock {} ms",
            num(r, "statement_timeout_ms"),
            num(r, "lock_timeout_ms")
        ),
        "ROUTE" => format!("to {}", text(r, "route")),
        "COALESCE" => format!(
            "wait {} ms, result {} bytes",
            num(r, "max_wait_ms"),
            num(r, "max_result_bytes")
        ),
        _ => "-".to_owned(),
    }
}

/// What a rule does now: its mode, or `warn` with the time left before it enforces.
fn rule_mode(r: &Value) -> String {
    match r.get("enforces_in_ms").and_then(Value::as_u64) {
        Some(ms) => format!("warn, enforces in {}s", ms.div_ceil(1000)),
        None => r
            .get("effective_mode")
            .and_then(Value::as_str)
            .map_or_else(|| text(r, "mode"), str::to_owned),
    }
}

/// `pgsluice rules preview`: the answer of `POST /v1/rules/preview` in a few lines, the
/// matched callers as a table, critical callers and warnings last so they are seen.
pub fn preview_text(v: &Value) -> String {
    let mut out = String::new();
    let rule = v.get("rule").cloned().unwrap_or(Value::Null);
    let _ = writeln!(
        out,
        "fingerprint  {}  {}",
        text(v, "fingerprint"),
        one_line(&text(v, "normalized"), 100)
    );
    let limit = rule_limit(&rule);
    let _ = writeln!(
        out,
        "rule         {}{} ({})",
        text(&rule, "action"),
        if limit == "-" {
            String::new()
        } else {
            format!(" {limit}")
        },
        if v.get("enforcing") == Some(&Value::Bool(true)) {
            "enforces at once"
        } else {
            "warns first"
        }
    );
    let basis = v.get("basis").cloned().unwrap_or(Value::Null);
    let window_s = basis
        .get("rate_window_ms")
        .and_then(Value::as_u64)
        .map_or_else(|| "-".to_owned(), |ms| (ms / 1000).to_string());
    let m = v.get("matched").cloned().unwrap_or(Value::Null);
    let _ = writeln!(
        out,
        "matched      {} calls/s, {} db ms/s, mean {} ms  (rates over the last {window_s} s)",
        rate(&m, "calls_per_s"),
        rate(&m, "db_ms_per_s"),
        ms(&m, "mean_ms"),
    );
    let e = v.get("effect").cloned().unwrap_or(Value::Null);
    let share = e
        .get("refused_share")
        .and_then(Value::as_f64)
        .map_or_else(|| "-".to_owned(), |s| format!("{:.0} %", s * 100.0));
    let _ = writeln!(
        out,
        "would refuse {}/s ({share}), delay {}/s",
        rate(&e, "refused_per_s"),
        rate(&e, "delayed_per_s"),
    );
    let _ = writeln!(out, "how          {}", text(&e, "method"));
    let rows: Vec<Vec<String>> = list(&m, "callers")
        .iter()
        .map(|c| {
            let mut name = text(c, "caller");
            if c.get("critical") == Some(&Value::Bool(true)) {
                name.push_str(" (critical)");
            }
            vec![
                name,
                rate(c, "calls_per_s"),
                rate(c, "db_ms_per_s"),
                rate(c, "refused_per_s"),
                rate(c, "delayed_per_s"),
            ]
        })
        .collect();
    if !rows.is_empty() {
        out.push('\n');
        out.push_str(&table(
            &["CALLER", "CALLS/S", "DB_MS/S", "REFUSED/S", "DELAYED/S"],
            &rows,
        ));
        if let Some(n) = m.get("callers_omitted").and_then(Value::as_u64)
            && n > 0
        {
            let _ = writeln!(out, "... and {n} more callers");
        }
    }
    let critical = list(v, "critical_callers");
    let warnings = list(v, "warnings");
    if !warnings.is_empty() {
        out.push('\n');
    }
    for w in &warnings {
        let w = w.as_str().unwrap_or_default();
        let loud = critical
            .iter()
            .any(|c| w.contains(&format!("critical caller {} ", text(c, "caller"))));
        let _ = writeln!(out, "{}: {w}", if loud { "WARNING" } else { "note" });
    }
    out
}

pub fn rules_table(v: &Value) -> String {
    let rules = v
        .get("rules")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if rules.is_empty() {
        return "no rules\n".to_owned();
    }
    let rows: Vec<Vec<String>> = rules
        .iter()
        .map(|r| {
            let callers = r.get("callers").and_then(Value::as_array).map_or_else(
                || "*".to_owned(),
                |c| {
                    c.iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join(",")
                },
            );
            let expires = r.get("expires_in_ms").and_then(Value::as_u64).map_or_else(
                || "never".to_owned(),
                |ms| format!("{}s", ms.div_ceil(1000)),
            );
            vec![
                text(r, "fingerprint"),
                text(r, "action"),
                rule_mode(r),
                rule_limit(r),
                callers,
                num(r, "hits"),
                num(r, "refusals"),
                num(r, "warned"),
                expires,
                text(r, "note"),
            ]
        })
        .collect();
    table(
        &[
            "FINGERPRINT",
            "ACTION",
            "MODE",
            "LIMIT",
            "CALLERS",
            "HITS",
            "REFUSED",
            "WARNED",
            "EXPIRES",
            "NOTE",
        ],
        &rows,
    )
}

/// Whitespace collapsed, cut to `max` characters.
pub fn one_line(s: &str, max: usize) -> String {
    let flat = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= max {
        return flat;
    }
    let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// What `/v1/anomalies` reports, one paragraph each, after the table: the subject, the
/// evidence, the rule in place or the one to PUT, and whether its row is in the table.
pub fn anomaly_lines(anomalies: Option<&Value>, top: &Value) -> String {
    let list = anomalies
        .and_then(|a| a.get("anomalies"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut out = String::new();
    let shown: Vec<String> = top
        .get("fingerprints")
        .and_then(Value::as_array)
        .map(|r| r.iter().map(|f| text(f, "fingerprint")).collect())
        .unwrap_or_default();
    for a in &list {
        let e = a.get("evidence").cloned().unwrap_or_default();
        let unit = text(&e, "unit");
        let fmt = |k: &str| {
            let v = e.get(k).and_then(Value::as_f64).unwrap_or(0.0);
            if unit == "share" {
                format!("{:.0}%", v * 100.0)
            } else {
                format!("{v:.1}")
            }
        };
        let who = match a.get("caller").and_then(Value::as_str) {
            Some(c) => format!("caller {c}"),
            None => {
                let fp = text(a, "fingerprint");
                let mark = if shown.contains(&fp) { " (above)" } else { "" };
                format!("fingerprint {fp}{mark}")
            }
        };
        let _ = writeln!(
            out,
            "ANOMALY {who}: {} {} {unit} against a baseline of {} ({:.1}x), for {} s",
            text(a, "signal"),
            fmt("current"),
            fmt("baseline"),
            e.get("ratio").and_then(Value::as_f64).unwrap_or(0.0),
            a.get("active_for_ms").and_then(Value::as_u64).unwrap_or(0) / 1000
        );
        if let Some(q) = a.get("normalized").and_then(Value::as_str) {
            let _ = writeln!(out, "  query: {}", one_line(q, 100));
        }
        if let Some(callers) = a.get("top_callers").and_then(Value::as_array)
            && !callers.is_empty()
        {
            let names: Vec<String> = callers
                .iter()
                .map(|c| format!("{} ({})", text(c, "caller"), num(c, "calls")))
                .collect();
            let _ = writeln!(out, "  callers in the window: {}", names.join(", "));
        }
        if let Some(r) = a.get("rule") {
            let _ = writeln!(
                out,
                "  rule in place: {} {} ({})",
                text(r, "action"),
                text(r, "mode"),
                text(r, "origin")
            );
        } else if let Some(s) = a.get("suggested_rule") {
            let body = s.get("body").map(Value::to_string).unwrap_or_default();
            let _ = writeln!(
                out,
                "  suggested: {} {} {body}",
                text(s, "method"),
                text(s, "path")
            );
        }
    }
    out
}

pub fn top_table(v: &Value) -> String {
    let rows = v
        .get("fingerprints")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if rows.is_empty() {
        return "no fingerprints recorded yet\n".to_owned();
    }
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|f| {
            vec![
                text(f, "fingerprint"),
                num(f, "calls"),
                rate(f, "qps"),
                num(f, "errors"),
                num(f, "lock_not_available"),
                ms(f, "lock_wait_ms"),
                num(f, "statement_timeouts"),
                num(f, "refusals"),
                ms(f, "total_ms"),
                ms(f, "mean_ms"),
                ms(f, "p99_ms"),
                one_line(&text(f, "normalized"), 80),
            ]
        })
        .collect();
    table(
        &[
            "FINGERPRINT",
            "CALLS",
            "QPS",
            "ERRORS",
            "55P03",
            "LOCK_MS",
            "TIMEOUTS",
            "REFUSED",
            "TOTAL_MS",
            "MEAN_MS",
            "P99_MS",
            "QUERY",
        ],
        &rows,
    )
}

/// `GET /v1/pools` as a table: the numbers `SHOW POOLS` users look at first.
pub fn pools_table(v: &Value) -> String {
    let pools = list(v, "pools");
    if pools.is_empty() {
        return "no pools yet (a pool opens with its first client)\n".to_owned();
    }
    let rows: Vec<Vec<String>> = pools
        .iter()
        .map(|p| {
            vec![
                text(p, "name"),
                text(p, "mode"),
                num(p, "size"),
                num(p, "active"),
                num(p, "idle"),
                num(p, "waiting"),
                num(p, "pinned"),
                num(p, "critical_reserve"),
                num(p, "adaptive_limit"),
                num(p, "connects"),
                num(p, "connect_failures"),
                num(p, "checkout_timeouts"),
                num(p, "waiting_refused"),
            ]
        })
        .collect();
    table(
        &[
            "POOL", "MODE", "SIZE", "ACTIVE", "IDLE", "WAITING", "PINNED", "RESERVE", "ADAPTIVE",
            "CONNECTS", "FAILED", "TIMEOUTS", "REFUSED",
        ],
        &rows,
    )
}

/// `GET /v1/callers` as a table: limits beside what each caller holds and was refused.
pub fn callers_table(v: &Value) -> String {
    let callers = list(v, "callers");
    if callers.is_empty() {
        return "no callers\n".to_owned();
    }
    let rows: Vec<Vec<String>> = callers
        .iter()
        .map(|c| {
            let refusals = c.get("refusals").and_then(Value::as_object);
            let refused: u64 = refusals.map_or(0, |r| r.values().filter_map(Value::as_u64).sum());
            let reasons = refusals.map_or_else(String::new, |r| {
                r.iter()
                    .filter(|(_, n)| n.as_u64().unwrap_or(0) > 0)
                    .map(|(k, n)| format!("{k}={n}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            });
            vec![
                text(c, "name"),
                text(c, "priority"),
                format!(
                    "{}/{}",
                    num(c, "in_flight"),
                    num(c, "local_max_concurrency")
                ),
                format!("{}/{}", num(c, "queued"), num(c, "queue_depth")),
                num(c, "queue_timeout_ms"),
                rate(c, "max_qps"),
                num(c, "admitted"),
                refused.to_string(),
                if reasons.is_empty() {
                    "-".to_owned()
                } else {
                    reasons
                },
            ]
        })
        .collect();
    table(
        &[
            "CALLER",
            "PRIORITY",
            "IN_FLIGHT",
            "QUEUED",
            "QUEUE_MS",
            "MAX_QPS",
            "ADMITTED",
            "REFUSED",
            "REASONS",
        ],
        &rows,
    )
}

/// `GET /v1/breaker` in a few lines: the state, why, for how long, and the counters.
pub fn breaker_text(v: &Value) -> String {
    let mut out = format!("state        {}", text(v, "state"));
    if let Some(r) = v.get("reason").and_then(Value::as_str) {
        let _ = write!(out, " ({r})");
    }
    let _ = write!(
        out,
        ", for {} s",
        v.get("since_ms").and_then(Value::as_u64).unwrap_or(0) / 1000
    );
    if let Some(ms) = v.get("open_remaining_ms").and_then(Value::as_u64) {
        let _ = write!(out, ", half-open in {} ms", ms);
    }
    out.push('\n');
    let trips = v.get("trips").cloned().unwrap_or_default();
    let _ = writeln!(
        out,
        "trips        consecutive_errors {}, probe {}, trial_failed {}",
        num(&trips, "consecutive_errors"),
        num(&trips, "probe"),
        num(&trips, "trial_failed")
    );
    let _ = writeln!(
        out,
        "now          in flight {}, consecutive errors {}, last probe {}",
        num(v, "in_flight"),
        num(v, "consecutive_errors"),
        rate(v, "last_probe_value")
    );
    let _ = writeln!(
        out,
        "since start  {} transitions, {} shed over the in-flight threshold",
        num(v, "transitions"),
        num(v, "inflight_sheds")
    );
    out
}

/// `GET /v1/clients` as a table.
pub fn clients_table(v: &Value) -> String {
    let clients = list(v, "clients");
    if clients.is_empty() {
        return "no clients\n".to_owned();
    }
    let rows: Vec<Vec<String>> = clients
        .iter()
        .map(|c| {
            vec![
                num(c, "id"),
                text(c, "user"),
                text(c, "database"),
                text(c, "address"),
                text(c, "caller"),
                text(c, "state"),
                secs(c, "state_for_ms"),
                num(c, "backend_pid"),
                text(c, "fingerprint"),
                secs(c, "connected_for_ms"),
            ]
        })
        .collect();
    table(
        &[
            "ID",
            "USER",
            "DATABASE",
            "ADDRESS",
            "CALLER",
            "STATE",
            "FOR_S",
            "BACKEND",
            "FINGERPRINT",
            "CONNECTED_S",
        ],
        &rows,
    )
}

/// `GET /v1/servers` as a table.
pub fn servers_table(v: &Value) -> String {
    let servers = list(v, "servers");
    if servers.is_empty() {
        return "no backend connections\n".to_owned();
    }
    let rows: Vec<Vec<String>> = servers
        .iter()
        .map(|s| {
            vec![
                text(s, "pool"),
                num(s, "pid"),
                text(s, "state"),
                num(s, "client"),
                secs(s, "age_ms"),
                secs(s, "idle_ms"),
            ]
        })
        .collect();
    table(
        &["POOL", "PID", "STATE", "CLIENT", "AGE_S", "IDLE_S"],
        &rows,
    )
}

/// Milliseconds shown as seconds with one decimal.
fn secs(v: &Value, k: &str) -> String {
    v.get(k)
        .and_then(Value::as_f64)
        .map_or_else(|| "-".to_owned(), |ms| format!("{:.1}", ms / 1000.0))
}

fn list(v: &Value, key: &str) -> Vec<Value> {
    v.get(key)
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_shows_rate_and_lock_evidence() {
        let v = serde_json::json!({"fingerprints": [{
            "fingerprint": "00000000000000ff", "calls": 12, "qps": 2.345, "errors": 3,
            "lock_not_available": 2, "lock_wait_ms": 401.5, "statement_timeouts": 1,
            "refusals": 0, "total_ms": 500.0, "mean_ms": 41.7, "p99_ms": 210.0,
            "normalized": "SELECT ? FROM t FOR UPDATE NOWAIT"
        }]});
        let t = top_table(&v);
        let mut lines = t.lines();
        let head: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        let col = |name: &str| row[head.iter().position(|h| *h == name).unwrap()];
        assert_eq!(col("QPS"), "2.3");
        assert_eq!(col("55P03"), "2");
        assert_eq!(col("LOCK_MS"), "401.50");
        assert_eq!(col("TIMEOUTS"), "1");
    }

    #[test]
    fn preview_shows_the_estimate_callers_and_critical_warnings() {
        let v = serde_json::json!({
            "fingerprint": "00000000000000ff", "normalized": "SELECT ? FROM t",
            "tracked": true, "enforcing": true,
            "rule": {"action": "THROTTLE", "max_qps": 50.0, "burst": 50,
                     "action_on_exceed": "REJECT", "mode": "enforce"},
            "basis": {"rate_window_ms": 10000},
            "matched": {"calls_per_s": 150.0, "mean_ms": 2.0, "db_ms_per_s": 300.0,
                "callers": [
                    {"caller": "web", "critical": false, "calls_per_s": 100.0,
                     "db_ms_per_s": 200.0, "refused_per_s": 66.66, "delayed_per_s": 0.0},
                    {"caller": "pay", "critical": true, "calls_per_s": 50.0,
                     "db_ms_per_s": 100.0, "refused_per_s": 33.33, "delayed_per_s": 0.0}],
                "callers_omitted": 2},
            "effect": {"refused_per_s": 100.0, "delayed_per_s": 0.0,
                       "refused_share": 0.6667, "method": "THROTTLE admits"},
            "critical_callers": [{"caller": "pay"}],
            "warnings": ["critical caller pay sends this pattern (50.0/s): x",
                         "few calls"]
        });
        let t = preview_text(&v);
        assert!(
            t.contains("would refuse 100.0/s (67 %), delay 0.0/s"),
            "{t}"
        );
        assert!(t.contains("rates over the last 10 s"), "{t}");
        assert!(t.contains("pay (critical)  50.0"), "{t}");
        assert!(t.contains("... and 2 more callers"), "{t}");
        assert!(t.contains("WARNING: critical caller pay"), "{t}");
        assert!(t.contains("note: few calls"), "{t}");
        let r = serde_json::json!({"mode": "enforce", "effective_mode": "warn",
            "enforces_in_ms": 1500});
        assert_eq!(rule_mode(&r), "warn, enforces in 2s");
        assert_eq!(rule_mode(&serde_json::json!({"mode": "warn"})), "warn");
    }

    #[test]
    fn tables_and_encoding() {
        let t = table(&["A", "BB"], &[vec!["xyz".into(), "1".into()]]);
        assert_eq!(t, "A    BB\nxyz  1\n");
        assert_eq!(one_line("select  1\n from t", 8), "select …");
    }

    #[test]
    fn pools_callers_and_breaker_read_the_api() {
        let p = serde_json::json!({"pools": [{"name": "appdb/app", "mode": "transaction",
            "size": 20, "active": 3, "idle": 2, "waiting": 1, "pinned": 0, "critical_reserve": 2,
            "adaptive_limit": null, "connects": 5, "connect_failures": 0,
            "checkout_timeouts": 4, "waiting_refused": 0}]});
        let t = pools_table(&p);
        assert!(t.starts_with("POOL"), "{t}");
        assert!(t.contains("appdb/app  transaction  20"), "{t}");
        assert_eq!(
            pools_table(&serde_json::json!({"pools": []}))
                .lines()
                .count(),
            1
        );
        let c = serde_json::json!({"callers": [{"name": "web", "priority": "normal",
            "in_flight": 4, "local_max_concurrency": 10, "queued": 1, "queue_depth": 50,
            "queue_timeout_ms": 200, "max_qps": null, "admitted": 99,
            "refusals": {"caller_limit": 2, "queue_timeout": 0, "rate_limited": 3}}]});
        let t = callers_table(&c);
        assert!(t.contains("web     normal    4/10       1/50"), "{t}");
        let row: Vec<&str> = t.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(row[7..], ["5", "caller_limit=2", "rate_limited=3"], "{t}");
        let b = serde_json::json!({"state": "open", "reason": "probe", "since_ms": 4500,
            "open_remaining_ms": 500, "trips": {"probe": 1}, "in_flight": 0,
            "transitions": 1});
        let t = breaker_text(&b);
        assert!(
            t.starts_with("state        open (probe), for 4 s, half-open in 500 ms\n"),
            "{t}"
        );
        assert!(t.contains("probe 1, trial_failed -"), "{t}");
    }
}
