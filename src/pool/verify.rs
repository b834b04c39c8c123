//! Asking Postgres whether a session is clean: the check a backend passes before another
//! client gets it, after a unit the parse could not prove harmless (`classify::proof`).
//!
//! Owns the check's SQL ([`check_sql`]) and the reading of its rows ([`judge`]). The check
//! is one simple-protocol request of several statements, sent when the backend is released
//! (`Pooled::release_at`): the client already has its answer, and the backend goes back to
//! the pool when the check does.
//!
//! What it reads, as Postgres reports it, and what it then does:
//! - settings whose source is the session, other than the ones the proxy applied for the
//!   client (on a statement's first check in the pool: [`check_sql`]); `role`, and
//!   `session_user` against the user the connection logged in as;
//! - listening channels, session advisory locks held, holdable cursors (the check's own
//!   portal is listed too, and is not one), SQL-level
//!   prepared statements, and objects in the session's temporary schema.
//! - Then, unconditionally: `RESET SESSION AUTHORIZATION`, `RESET ROLE`, `RESET ALL` (custom
//!   placeholder settings such as `app.tenant` are invisible to any catalog view, so they
//!   are reset rather than compared), `DISCARD SEQUENCES` (`currval`/`lastval`) and a
//!   `setseed` with a value from the proxy's own random source (a seed a client chose would
//!   make the next client's `random()` predictable; no reset undoes it); then the settings
//!   the proxy had applied for the client are set again (`Pooled::release_at`), so the
//!   backend still carries what the pool believes it does.
//! - Any row is a difference: it is counted and logged with the statement's fingerprint, and
//!   when it is more than settings (which the resets above already undid) the backend gets
//!   `DISCARD ALL` too. An error closes the backend.

/// The condition on `pg_settings` rows that the session set (`source` is `session`), other
/// than the transaction's own characteristics and the proxy's `pgsluice.*` bookkeeping:
/// shared by the check and the track mode's read-back (`session::state::capture_sql`).
pub const SESSION_SETTINGS: &str = "source OPERATOR(pg_catalog.=) 'session' \
     AND name OPERATOR(pg_catalog.<>) ALL ('{transaction_isolation, \
     transaction_read_only, transaction_deferrable}'::pg_catalog.text[]) \
     AND NOT name OPERATOR(pg_catalog.~~) 'pgsluice.%'";

/// The check (see the module doc): one statement of `(kind, value)` rows. Every name is
/// schema-qualified: it runs under whatever `search_path` the session was left with.
///
/// `settings`: compare the session's settings too. Reading `pg_settings` costs Postgres about
/// a millisecond (it renders every setting), several times the rest of the check; the resets
/// undo settings whether or not they are read, so the comparison only names what was changed
/// — done on a statement's first check in a pool ([`Seen`]). Without it the text depends on
/// the login user alone, and the pool prepares it once per connection (planning it costs
/// Postgres more than running it).
pub fn check_sql(login_user_literal: &str, settings: bool) -> String {
    let settings = if settings {
        format!(
            "SELECT 'setting' AS k, name AS v FROM pg_catalog.pg_settings \
             WHERE {SESSION_SETTINGS} UNION ALL "
        )
    } else {
        String::new()
    };
    format!(
        "SELECT k, v FROM ({settings}\
         SELECT 'role' AS k, pg_catalog.current_setting('role') AS v \
         WHERE pg_catalog.current_setting('role') OPERATOR(pg_catalog.<>) 'none' \
         UNION ALL SELECT 'session_authorization', session_user::pg_catalog.text \
         WHERE session_user::pg_catalog.text OPERATOR(pg_catalog.<>) {login_user_literal} \
         UNION ALL SELECT 'listen', c FROM pg_catalog.pg_listening_channels() AS c \
         UNION ALL SELECT 'advisory lock', l.objid::pg_catalog.text FROM pg_catalog.pg_locks l \
         WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory' \
         AND l.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid() \
         UNION ALL SELECT 'cursor', name FROM pg_catalog.pg_cursors WHERE is_holdable \
         UNION ALL SELECT 'prepared statement', name FROM pg_catalog.pg_prepared_statements \
         WHERE from_sql \
         UNION ALL SELECT 'temporary object', relname::pg_catalog.text FROM pg_catalog.pg_class \
         WHERE pg_catalog.pg_my_temp_schema() OPERATOR(pg_catalog.<>) 0 \
         AND relnamespace OPERATOR(pg_catalog.=) pg_catalog.pg_my_temp_schema()) AS d"
    )
}

/// The resets that follow every check (see the module doc), with a new random seed.
pub fn resets_sql(seed: f64) -> String {
    let seed = seed.clamp(-1.0, 1.0);
    format!(
        "RESET SESSION AUTHORIZATION;RESET ROLE;RESET ALL;DISCARD SEQUENCES;\
         SELECT pg_catalog.setseed({seed:.17})"
    )
}

/// The statements (fingerprints) whose first check in a pool has been done, bounded: forgotten
/// all at once when full, so each is compared in full again now and then.
#[derive(Default)]
pub struct Seen(parking_lot::Mutex<foldhash::HashSet<u64>>);

/// Fingerprints [`Seen`] keeps before it starts over.
const SEEN_MAX: usize = 4096;

impl Seen {
    /// Whether `fingerprint`'s check is its first (since the set last started over).
    pub fn first(&self, fingerprint: u64) -> bool {
        let mut set = self.0.lock();
        if set.len() >= SEEN_MAX {
            set.clear();
        }
        set.insert(fingerprint)
    }
}

/// The differences the check found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Found {
    /// `kind: name` of each difference, at most [`MAX_SHOWN`] kept for the log.
    pub shown: Vec<String>,
    pub count: usize,
    /// A difference beyond settings and identity: `DISCARD ALL` is due.
    pub beyond_settings: bool,
}

/// Differences kept for the log line.
pub const MAX_SHOWN: usize = 8;

impl Found {
    pub fn any(&self) -> bool {
        self.count > 0
    }
}

/// Reads the check's rows (`(kind, value)`), leaving out what the proxy itself applied for
/// the client (`applied`: its startup parameters and tracked settings, role included).
pub fn judge(rows: &[(String, String)], applied: &[(String, String)]) -> Found {
    let mut f = Found::default();
    for (kind, value) in rows {
        let expected = match kind.as_str() {
            "setting" => applied.iter().any(|(n, _)| n == value),
            "role" | "session_authorization" => {
                applied.iter().any(|(n, v)| n == kind && v == value)
            }
            _ => false,
        };
        if expected {
            continue;
        }
        f.count += 1;
        if !matches!(kind.as_str(), "setting" | "role" | "session_authorization") {
            f.beyond_settings = true;
        }
        if f.shown.len() < MAX_SHOWN {
            f.shown.push(format!("{kind}: {value}"));
        }
    }
    f
}

/// One DataRow of two text columns: `(kind, value)`; `None` for any other row (the
/// `setseed` call's).
pub fn row(body: &[u8]) -> Option<(String, String)> {
    let cols = i16::from_be_bytes([*body.first()?, *body.get(1)?]);
    if cols != 2 {
        return None;
    }
    let mut rest = &body[2..];
    let mut out = Vec::with_capacity(2);
    for _ in 0..2 {
        let n = i32::from_be_bytes(rest.get(..4)?.try_into().ok()?);
        rest = &rest[4..];
        let n = usize::try_from(n).ok()?;
        out.push(String::from_utf8_lossy(rest.get(..n)?).into_owned());
        rest = &rest[n..];
    }
    let value = out.pop()?;
    Some((out.pop()?, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(a: &str, b: &str) -> (String, String) {
        (a.to_owned(), b.to_owned())
    }

    #[test]
    fn what_the_proxy_applied_is_not_a_difference() {
        let applied = [kv("application_name", "web"), kv("role", "reader")];
        let f = judge(
            &[kv("setting", "application_name"), kv("role", "reader")],
            &applied,
        );
        assert!(!f.any(), "{f:?}");
        let f = judge(
            &[kv("setting", "search_path"), kv("role", "admin")],
            &applied,
        );
        assert_eq!(f.count, 2);
        assert!(!f.beyond_settings);
        let f = judge(&[kv("listen", "jobs"), kv("advisory lock", "7")], &applied);
        assert!(f.beyond_settings);
        assert_eq!(f.shown, ["listen: jobs", "advisory lock: 7"]);
    }

    #[test]
    fn rows_are_read_or_skipped() {
        let mut b = vec![0, 2];
        for s in ["listen", "jobs"] {
            b.extend_from_slice(&(s.len() as i32).to_be_bytes());
            b.extend_from_slice(s.as_bytes());
        }
        assert_eq!(row(&b), Some(kv("listen", "jobs")));
        assert_eq!(row(&b[..7]), None);
        assert_eq!(row(&[0, 1, 0, 0, 0, 0]), None);
        let sql = check_sql("$u$app$u$", true);
        assert!(
            sql.contains("<>) $u$app$u$") && sql.contains("pg_settings"),
            "{sql}"
        );
        assert!(!check_sql("$u$app$u$", false).contains("pg_settings"));
        assert!(resets_sql(7.0).ends_with("setseed(1.00000000000000000)"));
        let seen = Seen::default();
        assert!(seen.first(7) && !seen.first(7) && seen.first(8));
    }
}
