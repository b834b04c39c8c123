//! Session-state effects: the changes to a backend's session that the pooling layer must
//! track, restore, pin for or refuse (DESIGN §3), and the small parsers that read them
//! (`SET`/`RESET` names, `set_config`'s `is_local`).
//!
//! Owns: `SessionEffect` and its parsing helpers, called from the statement walk in `kind.rs`.
//! It must not decide what to do about an effect (that is the session layer) and reads only
//! normalized tokens, within fixed budgets.
//!
//! Decisions:
//! - GUC names are ASCII-lowercased, quoted or not (Postgres compares them case-insensitively).
//! - `SET LOCAL`, `SET TRANSACTION`, `SET CONSTRAINTS` are reported with `local: true`;
//!   `set_config(.., .., true)` is not reported at all.
//! - `set_config(name, value, is_local)` counts as session-level unless `is_local` is the bare
//!   word `true`: a parameter or expression there may be false, and the pooling layer must err
//!   on the side of noticing session state. The same holds when the argument is too far away
//!   to inspect within the budget.
//! - Effects are deduplicated and capped at `MAX_EFFECTS`; the last slot is kept for
//!   `Unknown`, so a string with more effects than are kept reads as "assume the worst".
//! - `Unknown` is reported for whatever the text cannot prove harmless (see its doc): the
//!   classifier's answer is "no effect" only when every call in the statement is a built-in
//!   function known not to touch session state.

use super::normalize::Class;
use super::stmt::Stmt;

/// Upper bound on effects reported for one statement string.
pub const MAX_EFFECTS: usize = 64;
/// `set_config` arguments further than this many tokens away are not inspected (assumed
/// session-level), and at most `MAX_CALL_SCAN_TOTAL` tokens are inspected per statement.
const MAX_CALL_SCAN: usize = 256;
pub(super) const MAX_CALL_SCAN_TOTAL: usize = 4096;

/// A change to backend session state that outlives the transaction (or, with `local: true`,
/// one that does not, reported so callers can see and ignore it).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SessionEffect {
    /// `SET [SESSION|LOCAL] name ...`; `name` is the lowercased GUC name (`timezone`, `role`,
    /// `session_authorization`, `search_path` for `SET SCHEMA`, `client_encoding` for
    /// `SET NAMES`). `SET TRANSACTION` / `SET CONSTRAINTS` are `local`.
    Set {
        name: String,
        local: bool,
    },
    /// `RESET name`; `None` is `RESET ALL`.
    Reset {
        name: Option<String>,
    },
    /// `set_config(.., .., false)` (or a non-literal `is_local`).
    SetConfigSession,
    Listen,
    Unlisten,
    /// Session-level `pg_advisory_lock*` / `pg_try_advisory_lock*` (not `_xact_`).
    AdvisoryLock,
    AdvisoryUnlock,
    DeclareWithHold,
    /// Temporary table, view or sequence (`TEMP`, `pg_temp.`, `SELECT INTO TEMP`).
    CreateTemp,
    /// SQL-level `PREPARE name AS ...`.
    Prepare,
    Deallocate,
    Load,
    /// The statement may change session state in ways the text does not show: a call of a
    /// function not known to be harmless (user functions can `set_config`, take advisory
    /// locks, `LISTEN` …), `DO`, `CALL`, `EXECUTE`, `CREATE EXTENSION`, a text cut off before
    /// its end, or more effects than are kept. The pooling layer must assume the worst.
    Unknown,
    Discard {
        all: bool,
    },
    CloseCursor,
}

impl SessionEffect {
    /// True for effects that survive the transaction (everything but `SET LOCAL` and
    /// friends).
    pub fn is_session_level(&self) -> bool {
        !matches!(self, SessionEffect::Set { local: true, .. })
    }
}

pub(super) fn add(effects: &mut Vec<SessionEffect>, e: SessionEffect) {
    if effects.contains(&e) {
        return;
    }
    if effects.len() + 1 < MAX_EFFECTS {
        effects.push(e);
    } else if !effects.contains(&SessionEffect::Unknown) {
        // The last slot says "there was more": a dropped effect must not go unnoticed.
        effects.push(SessionEffect::Unknown);
    }
}

/// The GUC named at `i`: `name` or `a.b` (words or quoted identifiers joined by `.`), or the
/// two-word forms `time zone` and `session authorization`.
pub(super) fn guc_name(s: &Stmt<'_>, mut i: usize) -> Option<String> {
    match (s.word(i), s.word(i + 1)) {
        (Some("time"), Some("zone")) => return Some("timezone".to_owned()),
        (Some("session"), Some("authorization")) => {
            return Some("session_authorization".to_owned());
        }
        _ => {}
    }
    let mut name = String::new();
    loop {
        match s.class(i) {
            Some(Class::Word) => name.push_str(s.word(i).unwrap_or("")),
            Some(Class::Quoted) => {
                let t = s.n.toks().get(i).map(|t| s.n.text(t)).unwrap_or("");
                name.push_str(t.get(1..t.len().saturating_sub(1)).unwrap_or(""));
            }
            _ => break,
        }
        i += 1;
        if s.class(i) == Some(Class::Period) {
            name.push('.');
            i += 1;
        } else {
            break;
        }
    }
    if name.is_empty() {
        None
    } else {
        // GUC names are case-insensitive in Postgres, quoted or not.
        name.make_ascii_lowercase();
        Some(name)
    }
}

pub(super) fn set_effect(s: &Stmt<'_>, mut i: usize, fx: &mut Vec<SessionEffect>) {
    let mut local = false;
    match s.word(i) {
        Some("local") => {
            local = true;
            i += 1;
        }
        Some("session") if !s.is(i + 1, "authorization") => i += 1,
        _ => {}
    }
    let name = match s.word(i) {
        Some("schema") => "search_path".to_owned(),
        Some("names") => "client_encoding".to_owned(),
        Some("role") => "role".to_owned(),
        Some("transaction") => {
            local = true;
            "transaction".to_owned()
        }
        Some("constraints") => {
            local = true;
            "constraints".to_owned()
        }
        Some("characteristics") => "session_characteristics".to_owned(),
        _ => match guc_name(s, i) {
            Some(name) => name,
            None => return,
        },
    };
    add(fx, SessionEffect::Set { name, local });
}

/// Looks at the third argument of a call whose arguments start at `i`, spending at most
/// `budget` tokens across all calls of the statement.
pub(super) fn set_config_is_session(s: &Stmt<'_>, i: usize, budget: &mut usize) -> bool {
    let mut depth = 0i64;
    let mut commas = 0;
    let end = (i + MAX_CALL_SCAN).min(s.hi);
    for j in i..end {
        if *budget == 0 {
            break;
        }
        *budget -= 1;
        match s.class(j) {
            Some(Class::LParen | Class::LBracket) => depth += 1,
            Some(Class::RParen | Class::RBracket) => {
                if depth == 0 {
                    return false; // fewer than three arguments: not a session set
                }
                depth -= 1;
            }
            Some(Class::Comma) if depth == 0 => {
                commas += 1;
                if commas == 2 {
                    // Only a bare `true` that is the whole argument is provably local
                    // (`true AND false`, `true = $1` are expressions).
                    return !(s.is(j + 1, "true") && s.class(j + 2) == Some(Class::RParen));
                }
            }
            _ => {}
        }
    }
    // Too far to tell: assume the worst.
    true
}

#[cfg(test)]
mod tests {
    use super::SessionEffect as E;
    use super::*;
    use crate::classify::fingerprint::{DEFAULT_MAX_TEXT_BYTES, analyze};

    /// The token walk's effects (the parse may add `Unknown` on top: `proof.rs`).
    fn effects(sql: &str) -> Vec<SessionEffect> {
        if sql.len() > DEFAULT_MAX_TEXT_BYTES {
            return analyze(sql, DEFAULT_MAX_TEXT_BYTES).effects;
        }
        crate::classify::fingerprint::token_walk(sql).effects
    }

    fn reset(name: Option<&str>) -> E {
        E::Reset {
            name: name.map(str::to_owned),
        }
    }

    fn set(name: &str, local: bool) -> E {
        E::Set {
            name: name.to_owned(),
            local,
        }
    }

    #[test]
    fn session_effects() {
        let cases: Vec<(&str, Vec<E>)> = vec![
            ("SET search_path = a, b", vec![set("search_path", false)]),
            (
                "set search_path to default",
                vec![set("search_path", false)],
            ),
            (
                "SET LOCAL statement_timeout = 5",
                vec![set("statement_timeout", true)],
            ),
            (
                "set session statement_timeout to 5",
                vec![set("statement_timeout", false)],
            ),
            ("set role admin", vec![set("role", false)]),
            ("set local role admin", vec![set("role", true)]),
            ("set session role admin", vec![set("role", false)]),
            (
                "set session authorization 'bob'",
                vec![set("session_authorization", false)],
            ),
            ("SET TIME ZONE 'UTC'", vec![set("timezone", false)]),
            ("set schema 'app'", vec![set("search_path", false)]),
            ("set names 'utf8'", vec![set("client_encoding", false)]),
            (
                "set transaction isolation level serializable",
                vec![set("transaction", true)],
            ),
            (
                "set constraints all deferred",
                vec![set("constraints", true)],
            ),
            (
                "set session characteristics as transaction read only",
                vec![set("session_characteristics", false)],
            ),
            ("set myapp.user_id = 5", vec![set("myapp.user_id", false)]),
            (
                "SET \"MyApp\".\"Tenant\" = 1",
                vec![set("myapp.tenant", false)],
            ),
            ("SET DateStyle TO ISO", vec![set("datestyle", false)]),
            ("reset all", vec![reset(None)]),
            ("reset search_path", vec![reset(Some("search_path"))]),
            ("reset role", vec![reset(Some("role"))]),
            (
                "reset session authorization",
                vec![reset(Some("session_authorization"))],
            ),
            ("reset time zone", vec![reset(Some("timezone"))]),
            (
                "select set_config('search_path', 'x', false)",
                vec![E::SetConfigSession],
            ),
            (
                "select pg_catalog.set_config('a', 'b', false), 1",
                vec![E::SetConfigSession],
            ),
            ("select set_config($1, $2, $3)", vec![E::SetConfigSession]),
            ("select set_config('a', 'b', true)", vec![]),
            ("select set_config('a', lower('B'), true)", vec![]),
            ("select pg_advisory_lock(1)", vec![E::AdvisoryLock]),
            (
                "select pg_try_advisory_lock_shared(1, 2)",
                vec![E::AdvisoryLock],
            ),
            ("select pg_advisory_xact_lock(1)", vec![]),
            ("select pg_try_advisory_xact_lock(1)", vec![]),
            (
                "select pg_advisory_unlock(1), pg_advisory_unlock_all()",
                vec![E::AdvisoryUnlock],
            ),
            ("listen ch", vec![E::Listen]),
            ("unlisten *", vec![E::Unlisten]),
            ("discard all", vec![E::Discard { all: true }]),
            ("discard plans", vec![E::Discard { all: false }]),
            ("load 'auto_explain'", vec![E::Load]),
            ("prepare p(int) as select $1", vec![E::Prepare]),
            ("prepare transaction 'x'", vec![]),
            ("deallocate prepare p", vec![E::Deallocate]),
            ("deallocate all", vec![E::Deallocate]),
            (
                "declare c cursor with hold for select 1",
                vec![E::DeclareWithHold],
            ),
            (
                "declare c no scroll cursor without hold for select 1",
                vec![],
            ),
            (
                "declare c cursor for with x as (select 1) select * from x",
                vec![],
            ),
            ("close c", vec![E::CloseCursor]),
            ("create temp table x (a int)", vec![E::CreateTemp]),
            ("CREATE TEMPORARY VIEW v AS SELECT 1", vec![E::CreateTemp]),
            (
                "create or replace temp view v as select 1",
                vec![E::CreateTemp],
            ),
            (
                "create global temporary table x (a int)",
                vec![E::CreateTemp],
            ),
            ("create temp sequence s", vec![E::CreateTemp]),
            ("create table pg_temp.x (a int)", vec![E::CreateTemp]),
            ("create table x (a int)", vec![]),
            ("create table temp (a int)", vec![]),
            ("create unlogged table t (a int)", vec![]),
            ("select * into temp tt from t", vec![E::CreateTemp]),
            ("explain select pg_advisory_lock(1)", vec![]),
            (
                "explain analyze select pg_advisory_lock(1)",
                vec![E::AdvisoryLock],
            ),
            ("select 'set role x', '$$pg_advisory_lock(1)$$'", vec![]),
            (
                "set a = 1; set local b = 2; select pg_advisory_lock(1); set a = 3",
                vec![set("a", false), set("b", true), E::AdvisoryLock],
            ),
        ];
        for (sql, want) in cases {
            assert_eq!(effects(sql), want, "{sql:?}");
        }
        assert!(!set("x", true).is_session_level());
        assert!(set("x", false).is_session_level());
        assert!(E::AdvisoryLock.is_session_level());
    }

    #[test]
    fn effects_are_bounded() {
        let sql: String = (0..500).map(|i| format!("set g{i} = 1;")).collect();
        assert_eq!(effects(&sql).len(), MAX_EFFECTS);
        // What does not fit is not forgotten: the last slot says "assume the worst".
        let mut sql: String = (0..100).map(|i| format!("set local g{i} = 1;")).collect();
        sql.push_str("set role evil");
        let fx = effects(&sql);
        assert_eq!(fx.len(), MAX_EFFECTS);
        assert!(fx.contains(&E::Unknown), "{fx:?}");
    }

    /// What the text cannot prove harmless is `Unknown`; everyday SQL is not.
    #[test]
    fn unprovable_effects_fail_closed() {
        let cases: Vec<(&str, Vec<E>)> = vec![
            (
                "SELECT \"set_config\"('search_path', 'evil', false)",
                vec![E::SetConfigSession],
            ),
            ("select \"pg_advisory_lock\"(1)", vec![E::AdvisoryLock]),
            (
                "select set_config('a', 'b', true AND false)",
                vec![E::SetConfigSession],
            ),
            (
                "select set_config('a', 'b', true = $1)",
                vec![E::SetConfigSession],
            ),
            (
                "select set_config('a', 'b', (true))",
                vec![E::SetConfigSession],
            ),
            ("select my_func(1)", vec![E::Unknown]),
            ("select public.lower('x')", vec![E::Unknown]),
            ("select \"Lower\"('x')", vec![E::Unknown]),
            ("select pg_catalog.lower('x')", vec![]),
            ("select setseed(0.5)", vec![E::Unknown]),
            ("select * from generate_series(1, 3) g", vec![]),
            ("select * from t where x in (1, 2, f(3))", vec![E::Unknown]),
            (
                "do $$ begin perform set_config('a', 'b', false); end $$",
                vec![E::Unknown],
            ),
            ("call p(1)", vec![E::Unknown]),
            ("execute p(1)", vec![E::Unknown]),
            ("create extension hstore", vec![E::Unknown]),
            (
                "select count(*), coalesce(a, 1), lower(b), now() from t \
                 where id in (1, 2) and exists (select 1) and c = any($1)",
                vec![],
            ),
            (
                "insert into t (a, b) values (1, 2) on conflict (a) \
                 do update set (a, b) = (excluded.a, 2) returning (a)",
                vec![],
            ),
            ("insert into s.t (a) select 1", vec![]),
            (
                "with w(a) as (select 1), v (b) as materialized (select 2) \
                 select * from w, v",
                vec![],
            ),
            (
                "select x::numeric(10, 2), cast(y as varchar(10)) from t as u(x, y)",
                vec![],
            ),
            (
                "select row_number() over (partition by a order by b) \
                 filter (where c) from t",
                vec![],
            ),
            ("copy t (a, b) from stdin", vec![]),
            ("select pg_advisory_xact_lock(1)", vec![]),
        ];
        for (sql, want) in cases {
            assert_eq!(effects(sql), want, "{sql:?}");
        }
        // A text longer than the scan window: the unread rest may do anything.
        let long = format!("select 1 /* {} */; set role evil", "x".repeat(2 << 20));
        assert!(effects(&long).contains(&E::Unknown));
    }
}
