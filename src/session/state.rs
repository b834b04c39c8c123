//! Session state in transaction mode: what a statement's session-level effects mean for the
//! client and the backend it borrows.
//!
//! - Trackable (`SET`, `RESET`, `set_config(.., false)`, `DISCARD ALL`): after the transaction
//!   ends, the proxy reads the backend's session-level settings (`pg_settings.source =
//!   'session'`) and makes them the client's settings, re-applied on every backend it borrows.
//!   Reading them from Postgres gives its rollback semantics for free.
//! - Not trackable (LISTEN, session advisory locks, WITH HOLD cursors, temp tables, SQL
//!   PREPARE, LOAD): the client is pinned to its backend for the rest of its session and the
//!   backend is marked for the matching cleanup before reuse. A plain simple-protocol
//!   `LISTEN`/`UNLISTEN` never gets here in transaction mode: the relay answers it and the
//!   pool's listener connection holds the channel (`crate::notify`); what reaches `assess` is
//!   the rest (extended protocol, several statements, a pinned client, …).
//! - `session_state: pin` pins on any effect; `reject` refuses them with 0A000.
//! - What the classifier cannot prove harmless (`SessionEffect::Unknown`: whatever the parse
//!   does not prove — a user function, `DO`, `CALL`, a FunctionCall message, a text too long
//!   to read whole — and, decided by the relay, a statement naming what is user code in the
//!   database: a view, a table whose writes fire a trigger, …) is never refused — that would refuse every stored-function call — but
//!   before the next client the backend is checked against Postgres and reset
//!   (`pool.unproven: verify`, `pool::verify`) or gets `DISCARD ALL` (`reset`), in every
//!   mode; in track mode the client's settings are read back first.
//!
//! Pure decisions; the relay applies them.

use crate::classify::{Classified, SessionEffect};
use crate::config::{SessionStateMode, UnprovenMode};
use crate::pool::Dirt;
use crate::protocol::PgError;

/// Reads every session-level setting of a backend (the proxy's capture query). `role` and
/// `session_authorization` are hidden from `pg_settings`, so they are read explicitly;
/// `login_user` is the pool's user, whose own identity is not a setting. Custom settings
/// (`app.tenant_id`) that no loaded module defines are placeholders, which `pg_settings`
/// does not list either: `custom` names the ones the client set, read one by one (an empty
/// value is one reset to nothing). It runs under the client's `search_path`, so functions,
/// relations and operators are schema-qualified.
pub fn capture_sql(login_user: &str, custom: &[String]) -> String {
    let user = crate::protocol::params::literal(login_user);
    let mut extra = String::new();
    if !custom.is_empty() {
        let names: Vec<String> = custom
            .iter()
            .map(|n| crate::protocol::params::literal(n))
            .collect();
        extra = format!(
            " UNION ALL SELECT n, pg_catalog.current_setting(n, true) FROM \
             pg_catalog.unnest(ARRAY[{}]::pg_catalog.text[]) AS n \
             WHERE pg_catalog.current_setting(n, true) OPERATOR(pg_catalog.<>) '' \
             AND NOT EXISTS (SELECT FROM pg_catalog.pg_settings s \
             WHERE s.name OPERATOR(pg_catalog.=) n)",
            names.join(", ")
        );
    }
    format!(
        "SELECT name, pg_catalog.current_setting(name) FROM pg_catalog.pg_settings \
         WHERE {} \
         UNION ALL SELECT 'role', pg_catalog.current_setting('role') \
         WHERE pg_catalog.current_setting('role') OPERATOR(pg_catalog.<>) 'none' \
         UNION ALL SELECT 'session_authorization', session_user::pg_catalog.text \
         WHERE session_user::pg_catalog.text OPERATOR(pg_catalog.<>) {user}{extra}",
        crate::pool::verify::SESSION_SETTINGS
    )
}

/// The setting names of every `set_config` call in `sql`, as Postgres reads them (a real
/// parse: `classify::proof::set_config_names`); `None` when any is not a plain literal — a
/// parameter, an expression, an escape string, a concatenation — or the text is not UTF-8.
pub fn set_config_names(sql: &[u8]) -> Option<Vec<String>> {
    crate::classify::proof::set_config_names(std::str::from_utf8(sql).ok()?)
}

/// For an SQL `EXECUTE name …` or `DEALLOCATE [PREPARE] name`: the verb and the name as
/// Postgres looks it up (unquoted names folded to lower case, quoted ones verbatim).
/// Leading comments are skipped; anything else is `None`.
pub fn sql_prepared_target(sql: &[u8]) -> Option<(&'static str, Vec<u8>)> {
    let mut i = 0;
    let word = |i: &mut usize| -> Vec<u8> {
        let start = *i;
        while sql
            .get(*i)
            .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_' || *c == b'$' || *c >= 0x80)
        {
            *i += 1;
        }
        sql[start..*i].to_ascii_lowercase()
    };
    let skip = |i: &mut usize| loop {
        while sql.get(*i).is_some_and(u8::is_ascii_whitespace) {
            *i += 1;
        }
        if sql[*i..].starts_with(b"/*") {
            *i = find(&sql[*i..], b"*/").map_or(sql.len(), |e| *i + e + 2);
        } else if sql[*i..].starts_with(b"--") {
            *i = sql[*i..]
                .iter()
                .position(|&c| c == b'\n')
                .map_or(sql.len(), |e| *i + e + 1);
        } else {
            return;
        }
    };
    skip(&mut i);
    let verb = match word(&mut i).as_slice() {
        b"execute" => "EXECUTE",
        b"deallocate" => "DEALLOCATE",
        _ => return None,
    };
    skip(&mut i);
    if sql.get(i) == Some(&b'"') {
        let mut name = Vec::new();
        i += 1;
        loop {
            match sql.get(i) {
                Some(b'"') if sql.get(i + 1) == Some(&b'"') => {
                    name.push(b'"');
                    i += 2;
                }
                Some(b'"') => return Some((verb, name)),
                Some(&c) => {
                    name.push(c);
                    i += 1;
                }
                None => return None,
            }
        }
    }
    let mut name = word(&mut i);
    if verb == "DEALLOCATE" && name == b"prepare" {
        skip(&mut i);
        return sql_prepared_target(&[b"deallocate ", &sql[i..]].concat());
    }
    if name.is_empty() {
        return None;
    }
    name.shrink_to_fit();
    Some((verb, name))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Assessment {
    /// Refuse the statement (reject mode).
    pub reject: Option<PgError>,
    /// Pin the client to this backend for the rest of its session.
    pub pin: bool,
    /// Cleanup the backend will need before another client gets it.
    pub dirt: Dirt,
    /// Re-read the backend's settings when the transaction ends.
    pub capture: bool,
    /// Our protocol-level statements on this backend are gone (DEALLOCATE ALL, DISCARD ALL).
    pub forget_prepared: bool,
}

/// The cleanup an unproven unit needs under `unproven`.
pub fn unproven_dirt(unproven: UnprovenMode) -> Dirt {
    match unproven {
        UnprovenMode::Verify => Dirt {
            verify: true,
            ..Dirt::default()
        },
        UnprovenMode::Reset => Dirt {
            all: true,
            ..Dirt::default()
        },
    }
}

/// What to do about `c`'s effects under `mode` (transaction pooling), with `unproven` for
/// what the parse could not prove.
pub fn assess(c: &Classified, mode: SessionStateMode, unproven: UnprovenMode) -> Assessment {
    let mut a = Assessment::default();
    if c.effects.is_empty() {
        return a;
    }
    let mut untrackable = None;
    let mut trackable = None;
    let mut unknown = false;
    for e in &c.effects {
        match e {
            SessionEffect::Set { local: true, .. } => {}
            SessionEffect::Set { .. } => {
                a.dirt.gucs = true;
                a.capture = true;
                trackable.get_or_insert("SET");
            }
            SessionEffect::Reset { .. } | SessionEffect::SetConfigSession => {
                a.dirt.gucs = true;
                a.capture = true;
                trackable.get_or_insert("SET");
            }
            SessionEffect::Discard { all: true } => {
                a.capture = true;
                a.forget_prepared = true;
            }
            SessionEffect::Deallocate => {
                let t = c.normalized.to_ascii_lowercase();
                if t.contains("deallocate all") || t.contains("deallocate prepare all") {
                    a.forget_prepared = true;
                }
            }
            SessionEffect::Listen => {
                a.dirt.listen = true;
                untrackable.get_or_insert("LISTEN");
            }
            SessionEffect::AdvisoryLock => {
                a.dirt.advisory = true;
                untrackable.get_or_insert("session-level advisory lock");
            }
            SessionEffect::DeclareWithHold => {
                a.dirt.cursors = true;
                untrackable.get_or_insert("DECLARE ... WITH HOLD");
            }
            SessionEffect::CreateTemp => {
                a.dirt.temp = true;
                untrackable.get_or_insert("temporary object");
            }
            SessionEffect::Prepare => {
                a.dirt.sql_prepared = true;
                untrackable.get_or_insert("SQL PREPARE");
            }
            SessionEffect::Load => {
                a.dirt.unresettable = true;
                untrackable.get_or_insert("LOAD");
            }
            SessionEffect::Unknown => {
                // Whatever it did is found and undone before the next client (checked, or
                // DISCARD ALL); in track mode the client's own settings are read back first,
                // so it keeps them.
                a.dirt.merge(unproven_dirt(unproven));
                unknown = true;
            }
            SessionEffect::Unlisten
            | SessionEffect::AdvisoryUnlock
            | SessionEffect::CloseCursor
            | SessionEffect::Discard { all: false } => {}
        }
    }
    let what = untrackable.or(trackable);
    let tracked = matches!(mode, SessionStateMode::Track) && untrackable.is_none();
    match (mode, untrackable, what) {
        (SessionStateMode::Reject, _, Some(what)) => {
            a.reject = Some(session_state_error(what, &c.normalized));
        }
        (SessionStateMode::Pin, _, Some(_)) | (SessionStateMode::Track, Some(_), _) => {
            a.pin = true;
            a.capture = false;
        }
        _ => {}
    }
    if tracked {
        // Settings are captured and re-applied; no reset needed beyond the usual diff.
        a.dirt.gucs = false;
        a.capture |= unknown;
    }
    a
}

fn session_state_error(what: &str, stmt: &str) -> PgError {
    let mut shown: String = stmt.chars().take(200).collect();
    if shown.len() < stmt.len() {
        shown.push('…');
    }
    PgError::error(
        "0A000",
        format!("pgsluice: ERR_SESSION_STATE: {what} is not supported in transaction pooling mode"),
    )
    .with_detail(format!("statement: {shown}"))
    .with_hint("use a session-mode pool for this client, or set pool.session_state to track or pin")
}

/// The refusal of an SQL `EXECUTE`/`DEALLOCATE` naming a statement the client prepared with
/// the protocol: in transaction mode it lives on the servers under a shared proxy name.
pub fn protocol_name_in_sql(verb: &str, name: &[u8]) -> PgError {
    let name = String::from_utf8_lossy(name);
    PgError::error(
        "0A000",
        format!(
            "pgsluice: ERR_SESSION_STATE: SQL {verb} of \"{name}\", a statement prepared with \
             the extended protocol, is not supported in transaction pooling mode"
        ),
    )
    .with_hint(
        "run it with Bind/Execute and remove it with Close, or use a session-mode pool for this \
         client",
    )
}

/// Parses one DataRow of the capture query: (name, value).
pub fn capture_row(body: &[u8]) -> Option<(String, String)> {
    crate::pool::verify::row(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::Classifier;

    fn assess_sql(sql: &str, mode: SessionStateMode) -> Assessment {
        let c = Classifier::new(16, 64 * 1024).classify(sql);
        assess(&c, mode, UnprovenMode::Verify)
    }

    #[test]
    fn set_is_tracked_listen_pins_reject_refuses() {
        let a = assess_sql("SET search_path TO evil", SessionStateMode::Track);
        assert!(a.capture && !a.pin && a.reject.is_none());
        let a = assess_sql("SET LOCAL statement_timeout = 5", SessionStateMode::Track);
        assert_eq!(a, Assessment::default());
        let a = assess_sql("LISTEN jobs", SessionStateMode::Track);
        assert!(a.pin && a.dirt.listen && !a.capture);
        let a = assess_sql("select pg_advisory_lock(1)", SessionStateMode::Track);
        assert!(a.pin && a.dirt.advisory);
        let a = assess_sql("SET ROLE other", SessionStateMode::Pin);
        assert!(a.pin && a.dirt.gucs);
        let a = assess_sql("LISTEN jobs", SessionStateMode::Reject);
        let e = a.reject.unwrap();
        assert_eq!(e.code, "0A000");
        assert!(e.message.contains("ERR_SESSION_STATE") && e.message.contains("LISTEN"));
        let a = assess_sql("DEALLOCATE ALL", SessionStateMode::Track);
        assert!(a.forget_prepared);
        let a = assess_sql("SELECT 1", SessionStateMode::Reject);
        assert_eq!(a, Assessment::default());
    }

    #[test]
    fn set_config_names_are_read_or_refused() {
        let names = |s: &str| set_config_names(s.as_bytes());
        assert_eq!(
            names(
                "SELECT set_config('App.Tenant', $1, false), pg_catalog.set_config ( 'x.y', 'v', false)"
            ),
            Some(vec!["app.tenant".to_string(), "x.y".to_string()])
        );
        assert_eq!(
            names("SELECT \"set_config\"('a.b', 'c', false)"),
            Some(vec!["a.b".into()])
        );
        assert_eq!(names("SELECT set_config($1, $2, false)"), None);
        assert_eq!(names("SELECT set_config(lower('A.B'), 'c', false)"), None);
        assert_eq!(names("SELECT set_config(E'a\\x2eb', 'c', false)"), None);
        assert_eq!(names("SELECT 'no set_config here'"), Some(vec![]));
        assert_eq!(names("SELECT set_config('unterminated"), None);
    }

    #[test]
    fn sql_prepared_targets() {
        let t = |s: &str| {
            sql_prepared_target(s.as_bytes()).map(|(v, n)| (v, String::from_utf8(n).unwrap()))
        };
        assert_eq!(t("EXECUTE S1(1, 2)"), Some(("EXECUTE", "s1".into())));
        assert_eq!(
            t("  /*x*/ -- c\n execute \"S1\""),
            Some(("EXECUTE", "S1".into()))
        );
        assert_eq!(
            t("DEALLOCATE PREPARE s2"),
            Some(("DEALLOCATE", "s2".into()))
        );
        assert_eq!(
            t("deallocate \"a\"\"b\""),
            Some(("DEALLOCATE", "a\"b".into()))
        );
        assert_eq!(t("deallocate all"), Some(("DEALLOCATE", "all".into())));
        assert_eq!(t("SELECT 1"), None);
        assert_eq!(t("execute"), None);
    }

    #[test]
    fn capture_rows_parse() {
        let mut b = vec![0, 2];
        for s in ["search_path", "evil"] {
            b.extend_from_slice(&(s.len() as i32).to_be_bytes());
            b.extend_from_slice(s.as_bytes());
        }
        assert_eq!(capture_row(&b), Some(("search_path".into(), "evil".into())));
        assert_eq!(capture_row(&b[..5]), None);
        assert_eq!(capture_row(&[0, 1]), None);
    }
}
