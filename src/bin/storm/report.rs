//! What a run leaves behind: the tables on stdout, a `key value` summary file for scripts,
//! the CSV time series and the SVG chart (`chart.rs`).

use std::fmt::Write as _;
use std::path::Path;

use super::record::{CallerStats, Snapshot};
use super::scenarios::Extra;

fn ms(us: Option<u64>) -> String {
    us.map_or("-".into(), |v| format!("{:.2}", v as f64 / 1e3))
}

/// Statements per second over the caller's active period.
fn rate(c: &CallerStats) -> Option<f64> {
    let (from, to) = (c.first_seen?, c.last_ok?);
    let secs = to.saturating_duration_since(from).as_secs_f64();
    (secs > 0.0).then(|| c.ok as f64 / secs)
}

/// `billing calm` → `billing_calm`, for summary keys.
fn key(s: &str) -> String {
    let mut k: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    while k.contains("__") {
        k = k.replace("__", "_");
    }
    k.trim_matches('_').to_owned()
}

/// The human tables.
pub fn tables(title: &str, snap: &Snapshot, extra: &Extra) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "== {title} — {:.1} s", snap.elapsed.as_secs_f64());
    let _ = writeln!(
        o,
        "{:<22} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9}",
        "caller",
        "ok",
        "ok/s",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "max ms",
        "refused",
        "errors",
        "connects",
        "conn-fail"
    );
    for (name, c) in &snap.callers {
        let h = &c.latency;
        let _ = writeln!(
            o,
            "{:<22} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9}",
            name,
            c.ok,
            rate(c).map_or("-".into(), |r| format!("{r:.1}")),
            ms(h.quantile(0.50)),
            ms(h.quantile(0.95)),
            ms(h.quantile(0.99)),
            ms((h.count() > 0).then(|| h.max())),
            c.refused,
            c.errors,
            c.connects,
            c.connect_failures
        );
    }
    if snap
        .callers
        .values()
        .any(|c| c.connects + c.connect_failures > 0)
    {
        let _ = writeln!(
            o,
            "\nlogins (TCP connect to ReadyForQuery, successful ones)"
        );
        let _ = writeln!(
            o,
            "{:<22} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "caller", "logins", "failed", "p50 ms", "p99 ms", "max ms"
        );
        for (name, c) in snap
            .callers
            .iter()
            .filter(|(_, c)| c.connects + c.connect_failures > 0)
        {
            let h = &c.login;
            let _ = writeln!(
                o,
                "{:<22} {:>9} {:>9} {:>9} {:>9} {:>9}",
                name,
                c.connects,
                c.connect_failures,
                ms(h.quantile(0.50)),
                ms(h.quantile(0.99)),
                ms((h.count() > 0).then(|| h.max())),
            );
        }
    }
    if snap.reasons.is_empty() {
        let _ = writeln!(o, "\nno refusals, no errors");
    } else {
        let _ = writeln!(o, "\nrefusals and errors by SQLSTATE / reason");
        let _ = writeln!(o, "{:<22} {:<8} {:>9}  reason", "caller", "kind", "count");
        for ((caller, kind, reason), n) in &snap.reasons {
            let _ = writeln!(o, "{caller:<22} {kind:<8} {n:>9}  {reason}");
        }
    }
    let _ = writeln!(
        o,
        "\nmax backend connections seen: {} ({} samples)",
        snap.max_backends
            .map_or("not monitored (--monitor)".into(), |m| m.to_string()),
        snap.backend_samples
    );
    for (k, v) in extra {
        let _ = writeln!(o, "{k}: {v}");
    }
    o
}

/// `key value` lines: easy to read from a shell script with awk.
pub fn summary(scenario: &str, snap: &Snapshot, extra: &Extra) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "scenario {scenario}");
    let _ = writeln!(o, "elapsed_secs {:.2}", snap.elapsed.as_secs_f64());
    let _ = writeln!(
        o,
        "max_backends {}",
        snap.max_backends.map_or("-".into(), |m| m.to_string())
    );
    let (mut refused, mut errors) = (0, 0);
    for (name, c) in &snap.callers {
        let k = key(name);
        let h = &c.latency;
        refused += c.refused;
        errors += c.errors;
        let _ = writeln!(o, "caller.{k}.ok {}", c.ok);
        let _ = writeln!(
            o,
            "caller.{k}.ok_per_s {}",
            rate(c).map_or("-".into(), |r| format!("{r:.1}"))
        );
        for (q, label) in [(0.5, "p50"), (0.95, "p95"), (0.99, "p99")] {
            let _ = writeln!(o, "caller.{k}.{label}_ms {}", ms(h.quantile(q)));
        }
        let _ = writeln!(o, "caller.{k}.refused {}", c.refused);
        let _ = writeln!(o, "caller.{k}.errors {}", c.errors);
        let _ = writeln!(o, "caller.{k}.connect_failures {}", c.connect_failures);
        if c.connects > 0 {
            for (q, label) in [(0.5, "p50"), (0.99, "p99")] {
                let _ = writeln!(o, "caller.{k}.login_{label}_ms {}", ms(c.login.quantile(q)));
            }
        }
    }
    let _ = writeln!(o, "total.refused {refused}");
    let _ = writeln!(o, "total.errors {errors}");
    for ((caller, kind, reason), n) in &snap.reasons {
        let _ = writeln!(o, "reason.{}.{kind}.{} {n}", key(caller), key(reason));
    }
    for (k, v) in extra {
        let _ = writeln!(o, "{k} {v}");
    }
    o
}

/// One row per slot; rates are per second whatever the slot width.
pub fn csv(snap: &Snapshot) -> String {
    let per_s = 1.0 / snap.slot.as_secs_f64();
    let mut o = String::from(
        "t_s,arrivals_per_s,admitted_per_s,refused_per_s,errors_per_s,p50_ms,p99_ms,critical_p99_ms,backends,login_p99_ms,sessions_per_s,sessions_total\n",
    );
    let blank = |v: Option<u64>| v.map_or(String::new(), |us| format!("{:.3}", us as f64 / 1e3));
    let mut sessions = 0;
    for (i, s) in snap.slots.iter().enumerate() {
        sessions += s.sessions;
        let _ = writeln!(
            o,
            "{:.3},{:.1},{:.1},{:.1},{:.1},{},{},{},{},{},{:.1},{}",
            i as f64 * snap.slot.as_secs_f64(),
            s.arrivals as f64 * per_s,
            s.admitted as f64 * per_s,
            s.refused as f64 * per_s,
            s.errors as f64 * per_s,
            blank(s.latency.quantile(0.5)),
            blank(s.latency.quantile(0.99)),
            blank(s.critical.quantile(0.99)),
            s.backends.map_or(String::new(), |b| b.to_string()),
            blank(s.login.quantile(0.99)),
            s.sessions as f64 * per_s,
            sessions,
        );
    }
    o
}

pub fn write(path: &Path, what: &str, text: &str) -> Result<(), String> {
    std::fs::write(path, text)
        .map_err(|e| format!("cannot write the {what} to {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_shell_friendly() {
        assert_eq!(key("web (storm)"), "web_storm");
        assert_eq!(key("53300 ERR_QUEUE_TIMEOUT"), "53300_err_queue_timeout");
    }
}
