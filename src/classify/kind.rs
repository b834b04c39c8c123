//! Statement kind and session-state effects, read from the canonical token stream.
//!
//! Owns: `StmtKind` (selects timeout category) and the statement walk that also collects
//! `SessionEffect`s (defined with their parsers in `effects.rs`). Both come from the same token
//! pass as the fingerprint; this file only looks at the normalized tokens, never at raw text,
//! and it must not recurse (`EXPLAIN EXPLAIN ...` is a loop, nesting is counted).
//!
//! Decisions:
//! - The kind is syntactic: `SELECT nextval(...)` or `CALL proc()` may write, but only what
//!   the text says is used. Unknown verbs (`DO`, `CALL`, `LOCK`, `NOTIFY`, `CHECKPOINT`) are
//!   `Other`.
//! - A multi-statement string gets the strongest kind present, ranked
//!   `Write > Ddl > Other > LockingRead > Read > Session > Transaction`: the rank orders by
//!   what the statement may do to the database (an unknown verb may write, so it outranks
//!   reads). `BEGIN; UPDATE ..; COMMIT` is `Write`. Effects of all statements are merged.
//! - `EXPLAIN` without `ANALYZE` is `Read` and has no effects (nothing runs); with `ANALYZE`
//!   it takes the explained statement's kind and effects.
//! - Function-call effects (`set_config`, advisory locks) are found anywhere in a statement
//!   (`calls.rs` judges every `name(`); what the text cannot show — a user function, a
//!   `DO $$ ... $$` body (a literal), `CALL`, `EXECUTE`, `CREATE EXTENSION` — is the
//!   `Unknown` effect, which the pooling layer treats as "assume the worst".

use super::calls::{self, Call};
pub use super::effects::SessionEffect;
use super::effects::{MAX_CALL_SCAN_TOTAL, add, guc_name, set_config_is_session, set_effect};
use super::normalize::{Class, Normalizer};
use super::stmt::Stmt;

/// What kind of statement a text is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StmtKind {
    Read,
    LockingRead,
    Write,
    Ddl,
    Transaction,
    Session,
    Other,
}

impl StmtKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            StmtKind::Read => "read",
            StmtKind::LockingRead => "locking_read",
            StmtKind::Write => "write",
            StmtKind::Ddl => "ddl",
            StmtKind::Transaction => "transaction",
            StmtKind::Session => "session",
            StmtKind::Other => "other",
        }
    }

    /// Rank used to pick the kind of a multi-statement string (higher wins).
    fn rank(self) -> u8 {
        match self {
            StmtKind::Transaction => 0,
            StmtKind::Session => 1,
            StmtKind::Read => 2,
            StmtKind::LockingRead => 3,
            StmtKind::Other => 4,
            StmtKind::Ddl => 5,
            StmtKind::Write => 6,
        }
    }
}

/// What the statement walk finds in a whole normalized stream (all statements).
pub(crate) struct Analysis {
    pub kind: StmtKind,
    pub effects: Vec<SessionEffect>,
    /// Some statement cannot run inside a transaction block (see [`own_transaction`]).
    pub own_transaction: bool,
}

/// Kind, effects and transaction needs of the whole normalized stream (all statements).
pub(crate) fn analyze(n: &Normalizer) -> Analysis {
    let toks = n.toks();
    let mut kind: Option<StmtKind> = None;
    let mut effects = Vec::new();
    let mut own = false;
    let mut start = 0;
    for i in 0..=toks.len() {
        let boundary = i == toks.len() || toks[i].class == Class::Semi;
        if !boundary {
            continue;
        }
        if i > start {
            let stmt = Stmt {
                n,
                lo: start,
                hi: i,
            };
            own = own || own_transaction(&stmt);
            let k = statement(&stmt, &mut effects);
            kind = Some(match kind {
                Some(prev) if prev.rank() >= k.rank() => prev,
                _ => k,
            });
        }
        start = i + 1;
    }
    Analysis {
        kind: kind.unwrap_or(StmtKind::Other),
        effects,
        own_transaction: own,
    }
}

/// Statements Postgres refuses inside a transaction block (`VACUUM`, `... CONCURRENTLY`,
/// `CREATE DATABASE`, `ALTER SYSTEM`, …) or that may end transactions themselves (`CALL` and
/// `DO` can COMMIT): budgets for them cannot be `SET LOCAL` in front, in one implicit
/// transaction. Errs toward `true` (the other injection is also correct, only costlier).
fn own_transaction(s: &Stmt<'_>) -> bool {
    let mut i = s.lo;
    while s.class(i) == Some(Class::LParen) {
        i += 1;
    }
    match s.word(i) {
        Some("vacuum" | "call" | "do" | "cluster") => true,
        Some("alter") => {
            s.is(i + 1, "system") || s.is(i + 1, "database") || s.is(i + 1, "subscription")
        }
        Some("create" | "drop" | "reindex") => {
            s.is(i + 1, "database")
                || s.is(i + 1, "tablespace")
                || s.is(i + 1, "subscription")
                || s.is(i + 1, "system")
                || (i..s.hi).any(|j| s.is(j, "concurrently"))
        }
        _ => false,
    }
}

fn statement(s: &Stmt<'_>, effects: &mut Vec<SessionEffect>) -> StmtKind {
    let mut i = s.lo;
    while s.class(i) == Some(Class::LParen) {
        i += 1;
    }
    // EXPLAIN [ANALYZE] [VERBOSE] [(options)] statement; looped, never recursive.
    let mut explained = false;
    let mut analyze = false;
    while s.is(i, "explain") {
        explained = true;
        i += 1;
        loop {
            match s.word(i) {
                Some("analyze" | "analyse") => analyze = true,
                Some("verbose") => {}
                _ => break,
            }
            i += 1;
        }
        if s.class(i) == Some(Class::LParen) {
            let mut depth = 0i64;
            while i < s.hi {
                match s.class(i) {
                    Some(Class::LParen) => depth += 1,
                    Some(Class::RParen) => depth -= 1,
                    _ => {}
                }
                if matches!(s.word(i), Some("analyze" | "analyse"))
                    && !matches!(s.word(i + 1), Some("false" | "off"))
                {
                    analyze = true;
                }
                i += 1;
                if depth == 0 {
                    break;
                }
            }
        }
    }
    let mut own = Vec::new();
    let f = facts(s, i, &mut own);
    let kind = body(&f, s, i, &mut own);
    if explained && !analyze {
        return StmtKind::Read;
    }
    for e in own {
        add(effects, e);
    }
    kind
}

const DDL_VERBS: &[&str] = &[
    "alter", "analyse", "analyze", "cluster", "comment", "create", "drop", "grant", "import",
    "refresh", "reassign", "reindex", "revoke", "security", "truncate", "vacuum",
];
const CREATE_MODIFIERS: &[&str] = &[
    "global",
    "local",
    "or",
    "replace",
    "temp",
    "temporary",
    "unlogged",
];
const TX_VERBS: &[&str] = &[
    "abort",
    "begin",
    "commit",
    "end",
    "release",
    "rollback",
    "savepoint",
    "start",
];

/// Kind of the statement starting at token `i`, pushing verb-level effects.
fn body(f: &Facts, s: &Stmt<'_>, i: usize, fx: &mut Vec<SessionEffect>) -> StmtKind {
    let Some(verb) = s.word(i) else {
        return StmtKind::Other;
    };
    match verb {
        "select" => select_kind(f, s, fx),
        "values" | "table" | "show" | "fetch" | "move" => StmtKind::Read,
        "with" => with_kind(f, s, i, fx),
        "insert" | "update" | "delete" | "merge" => StmtKind::Write,
        "copy" => match s.first_at_depth0(i + 1, &["from", "to"]) {
            Some((_, "from")) => StmtKind::Write,
            _ => StmtKind::Read,
        },
        "create" => {
            // Only the modifiers before the object type: `create table temp (..)` is a
            // table named "temp".
            let head_is_temp = (i + 1..s.hi)
                .map_while(|j| s.word(j).filter(|w| CREATE_MODIFIERS.contains(w)))
                .any(|w| matches!(w, "temp" | "temporary"));
            let pg_temp =
                (i + 1..s.hi).any(|j| s.is(j, "pg_temp") && s.class(j + 1) == Some(Class::Period));
            if head_is_temp || pg_temp {
                add(fx, SessionEffect::CreateTemp);
            }
            if s.is(i + 1, "extension") {
                add(fx, SessionEffect::Unknown);
            }
            StmtKind::Ddl
        }
        v if DDL_VERBS.contains(&v) => StmtKind::Ddl,
        v if TX_VERBS.contains(&v) => StmtKind::Transaction,
        "prepare" => {
            if s.is(i + 1, "transaction") {
                StmtKind::Transaction
            } else {
                add(fx, SessionEffect::Prepare);
                StmtKind::Session
            }
        }
        "set" => {
            set_effect(s, i + 1, fx);
            StmtKind::Session
        }
        "reset" => {
            let name = match s.word(i + 1) {
                Some("all") => None,
                _ => guc_name(s, i + 1),
            };
            add(fx, SessionEffect::Reset { name });
            StmtKind::Session
        }
        // Procedural code and stored procedures can do anything to the session; so can the
        // install script of an extension and a SQL-level EXECUTE.
        "do" | "call" | "execute" => {
            add(fx, SessionEffect::Unknown);
            StmtKind::Other
        }
        "listen" => session(fx, SessionEffect::Listen),
        "unlisten" => session(fx, SessionEffect::Unlisten),
        "load" => session(fx, SessionEffect::Load),
        "deallocate" => session(fx, SessionEffect::Deallocate),
        "close" => session(fx, SessionEffect::CloseCursor),
        "discard" => session(
            fx,
            SessionEffect::Discard {
                all: s.is(i + 1, "all"),
            },
        ),
        "declare" => {
            let for_at = (i..s.hi).find(|&j| s.is(j, "for")).unwrap_or(s.hi);
            if (i..for_at).any(|j| s.is(j, "with") && s.is(j + 1, "hold")) {
                add(fx, SessionEffect::DeclareWithHold);
            }
            StmtKind::Session
        }
        _ => StmtKind::Other,
    }
}

fn session(fx: &mut Vec<SessionEffect>, e: SessionEffect) -> StmtKind {
    add(fx, e);
    StmtKind::Session
}

/// What one pass over a statement's words finds.
#[derive(Default)]
struct Facts {
    /// First `into`.
    into: Option<usize>,
    /// `FOR UPDATE` / `FOR SHARE` / `FOR NO KEY UPDATE` / `FOR KEY SHARE`.
    locking: bool,
    /// `as [materialized] (insert|update|delete|merge` — a data-modifying CTE.
    modifying_cte: bool,
}

/// One pass over the words from `from`: the facts above plus function-call effects.
fn facts(s: &Stmt<'_>, from: usize, fx: &mut Vec<SessionEffect>) -> Facts {
    let mut f = Facts::default();
    let mut budget = MAX_CALL_SCAN_TOTAL;
    let toks = s.n.toks();
    let hi = s.hi.min(toks.len());
    for (j, tok) in toks.iter().enumerate().take(hi).skip(from) {
        if !matches!(tok.class, Class::Word | Class::Quoted) {
            continue;
        }
        let call = s.class(j + 1) == Some(Class::LParen);
        if call {
            match calls::classify(s, j) {
                Call::Not | Call::Harmless => {}
                Call::AdvisoryLock => add(fx, SessionEffect::AdvisoryLock),
                Call::AdvisoryUnlock => add(fx, SessionEffect::AdvisoryUnlock),
                Call::Unknown => add(fx, SessionEffect::Unknown),
                Call::SetConfig => {
                    if !fx.contains(&SessionEffect::SetConfigSession)
                        && set_config_is_session(s, j + 2, &mut budget)
                    {
                        add(fx, SessionEffect::SetConfigSession);
                    }
                }
            }
        }
        if tok.class != Class::Word {
            continue;
        }
        match s.n.text(tok) {
            "into" => {
                f.into.get_or_insert(j);
            }
            "for" => {
                f.locking |= match s.word(j + 1) {
                    Some("update" | "share") => true,
                    Some("no") => s.is(j + 2, "key") && s.is(j + 3, "update"),
                    Some("key") => s.is(j + 2, "share"),
                    _ => false,
                };
            }
            "as" | "materialized" if call => {
                f.modifying_cte |= matches!(
                    s.word(j + 2),
                    Some("insert" | "update" | "delete" | "merge")
                );
            }
            _ => {}
        }
    }
    f
}

fn select_kind(f: &Facts, s: &Stmt<'_>, fx: &mut Vec<SessionEffect>) -> StmtKind {
    if let Some(into) = f.into {
        if matches!(s.word(into + 1), Some("temp" | "temporary")) {
            add(fx, SessionEffect::CreateTemp);
        }
        StmtKind::Write
    } else if f.locking {
        StmtKind::LockingRead
    } else {
        StmtKind::Read
    }
}

fn with_kind(f: &Facts, s: &Stmt<'_>, i: usize, fx: &mut Vec<SessionEffect>) -> StmtKind {
    let main = s.first_at_depth0(
        i + 1,
        &[
            "select", "insert", "update", "delete", "merge", "values", "table",
        ],
    );
    let main_kind = match main {
        Some((_, "select")) => select_kind(f, s, fx),
        Some((_, "values" | "table")) => StmtKind::Read,
        Some(_) => StmtKind::Write,
        None => StmtKind::Other,
    };
    if f.modifying_cte {
        StmtKind::Write
    } else {
        main_kind
    }
}

#[cfg(test)]
mod tests {
    use super::StmtKind as K;
    use super::*;
    use crate::classify::fingerprint::{DEFAULT_MAX_TEXT_BYTES, analyze};

    fn kind(sql: &str) -> (StmtKind, Vec<SessionEffect>) {
        let c = analyze(sql, DEFAULT_MAX_TEXT_BYTES);
        (c.kind, c.effects)
    }

    #[test]
    fn statements_that_need_their_own_transaction() {
        for sql in [
            "vacuum t",
            "VACUUM (ANALYZE) t",
            "create index concurrently i on t (a)",
            "drop index concurrently i",
            "reindex table concurrently t",
            "create database x",
            "alter system set work_mem = '1MB'",
            "call p()",
            "do $$ begin commit; end $$",
            "select 1; vacuum",
        ] {
            assert!(
                analyze(sql, DEFAULT_MAX_TEXT_BYTES).own_transaction,
                "{sql}"
            );
        }
        for sql in [
            "select 1",
            "create index i on t (a)",
            "update t set concurrently = 1",
            "alter table t add column b int",
        ] {
            assert!(
                !analyze(sql, DEFAULT_MAX_TEXT_BYTES).own_transaction,
                "{sql}"
            );
        }
    }

    #[test]
    fn kinds() {
        let cases: &[(&str, StmtKind)] = &[
            ("select 1", K::Read),
            ("/*x:y*/ (select 1) union (select 2)", K::Read),
            ("values (1), (2)", K::Read),
            ("table t", K::Read),
            ("show search_path", K::Read),
            ("fetch 10 from c", K::Read),
            ("SELECT * FROM jobs WHERE id = 1 FOR UPDATE", K::LockingRead),
            (
                "select * from jobs for no key update of jobs nowait",
                K::LockingRead,
            ),
            ("select * from jobs for key share", K::LockingRead),
            ("select * from jobs for share skip locked", K::LockingRead),
            (
                "select * from a where id in (select id from b for update)",
                K::LockingRead,
            ),
            ("select substring(x for 2) from t", K::Read),
            (
                "WITH x AS (DELETE FROM t RETURNING *) SELECT * FROM x",
                K::Write,
            ),
            (
                "with x as materialized (update t set a = 1 returning *) select 1",
                K::Write,
            ),
            (
                "with x as not materialized (insert into t values (1) returning *) select 1",
                K::Write,
            ),
            ("with x as (select 1) select * from x", K::Read),
            (
                "with recursive r(n) as (select 1 union all select n + 1 from r) select * from r",
                K::Read,
            ),
            (
                "with x as (select 1) insert into t select * from x",
                K::Write,
            ),
            (
                "with x as (select 1) select * from x for update",
                K::LockingRead,
            ),
            ("select * into new_t from t", K::Write),
            ("insert into t values (1)", K::Write),
            ("update t set a = 1", K::Write),
            ("delete from t", K::Write),
            (
                "merge into t using s on t.id = s.id when matched then delete",
                K::Write,
            ),
            ("copy t (a, b) from stdin", K::Write),
            ("copy t to stdout", K::Read),
            (
                "copy (select * from t where a in (select 1 from x)) to stdout",
                K::Read,
            ),
            ("explain select 1", K::Read),
            ("explain delete from t", K::Read),
            ("explain analyze delete from t", K::Write),
            ("explain (analyze, buffers) update t set a = 1", K::Write),
            ("explain (analyze false) delete from t", K::Read),
            ("explain analyze select * from t for update", K::LockingRead),
            ("create table t (a int)", K::Ddl),
            ("create index concurrently i on t using gin (a)", K::Ddl),
            ("alter table t add column b int", K::Ddl),
            ("drop table t", K::Ddl),
            ("truncate t", K::Ddl),
            ("grant select on t to bob", K::Ddl),
            ("revoke all on t from bob", K::Ddl),
            ("comment on table t is 'x'", K::Ddl),
            ("vacuum (verbose, analyze) users", K::Ddl),
            ("analyze t", K::Ddl),
            ("reindex table t", K::Ddl),
            ("cluster t using i", K::Ddl),
            ("refresh materialized view v", K::Ddl),
            ("begin", K::Transaction),
            ("BEGIN ISOLATION LEVEL SERIALIZABLE", K::Transaction),
            ("start transaction read only", K::Transaction),
            ("commit", K::Transaction),
            ("end", K::Transaction),
            ("rollback to savepoint a", K::Transaction),
            ("savepoint a", K::Transaction),
            ("release savepoint a", K::Transaction),
            ("prepare transaction 'x'", K::Transaction),
            ("commit prepared 'x'", K::Transaction),
            ("abort", K::Transaction),
            ("set statement_timeout = 5", K::Session),
            ("reset all", K::Session),
            ("listen ch", K::Session),
            ("discard all", K::Session),
            ("prepare p(int) as select $1", K::Session),
            ("declare c cursor for select 1", K::Session),
            ("close c", K::Session),
            ("do $$ begin perform 1; end $$", K::Other),
            ("call p(1)", K::Other),
            ("lock table t in exclusive mode", K::Other),
            ("notify ch, 'x'", K::Other),
            ("checkpoint", K::Other),
            ("", K::Other),
            ("-- just a comment", K::Other),
            ("select 'unterminated", K::Read),
        ];
        for (sql, want) in cases {
            assert_eq!(kind(sql).0, *want, "{sql:?}");
        }
        assert_eq!(K::LockingRead.as_str(), "locking_read");
    }

    #[test]
    fn multi_statement_takes_the_strongest_kind() {
        let cases: &[(&str, StmtKind)] = &[
            ("begin; update t set a = 1; commit", K::Write),
            ("set x = 1; select 1", K::Read),
            ("select 1; create table t (a int)", K::Ddl),
            ("create table t (a int); insert into t values (1)", K::Write),
            ("begin; select 1 for update; commit", K::LockingRead),
            ("select 1; do $$ $$", K::Other),
            ("begin; set local a = 1; commit", K::Session),
        ];
        for (sql, want) in cases {
            assert_eq!(kind(sql).0, *want, "{sql:?}");
        }
    }
}
