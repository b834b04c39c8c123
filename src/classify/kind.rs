//! Statement kind and session-state effects, read from the canonical token stream.
//!
//! Owns: `StmtKind` (selects timeout category) and `SessionEffect` (what the pooling layer must
//! track, restore, pin or refuse). Both come from the same token pass as the fingerprint; this
//! file only looks at the normalized tokens, never at raw text, and it must not recurse
//! (`EXPLAIN EXPLAIN ...` is a loop, nesting is counted).
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
//! - `set_config(name, value, is_local)` counts as session-level unless `is_local` is the bare
//!   word `true`: a parameter or expression there may be false, and the pooling layer must err
//!   on the side of noticing session state.
//! - Effects are deduplicated and capped at `MAX_EFFECTS`; a string that hits the cap has
//!   dirtied the session anyway, which is all the pooling layer needs to know.
//! - Effects hidden inside `DO $$ ... $$` bodies are not visible (the body is a literal).

use super::normalize::{Class, Normalizer};

/// Upper bound on effects reported for one statement string.
pub const MAX_EFFECTS: usize = 64;
/// `set_config` arguments further than this many tokens away are not inspected (assumed
/// session-level), and at most `MAX_CALL_SCAN_TOTAL` tokens are inspected per statement.
const MAX_CALL_SCAN: usize = 256;
const MAX_CALL_SCAN_TOTAL: usize = 4096;

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

/// Kind and effects of the whole normalized stream (all statements).
pub(crate) fn analyze(n: &Normalizer) -> (StmtKind, Vec<SessionEffect>) {
    let toks = n.toks();
    let mut kind: Option<StmtKind> = None;
    let mut effects = Vec::new();
    let mut start = 0;
    for i in 0..=toks.len() {
        let boundary = i == toks.len() || toks[i].class == Class::Semi;
        if !boundary {
            continue;
        }
        if i > start {
            let k = statement(
                &Stmt {
                    n,
                    lo: start,
                    hi: i,
                },
                &mut effects,
            );
            kind = Some(match kind {
                Some(prev) if prev.rank() >= k.rank() => prev,
                _ => k,
            });
        }
        start = i + 1;
    }
    (kind.unwrap_or(StmtKind::Other), effects)
}

/// One statement: tokens `lo..hi` of the normalizer.
struct Stmt<'a> {
    n: &'a Normalizer,
    lo: usize,
    hi: usize,
}

impl Stmt<'_> {
    fn word(&self, i: usize) -> Option<&str> {
        if i < self.hi { self.n.word(i) } else { None }
    }

    fn is(&self, i: usize, w: &str) -> bool {
        self.word(i) == Some(w)
    }

    fn class(&self, i: usize) -> Option<Class> {
        if i < self.hi { self.n.class(i) } else { None }
    }

    /// First word at nesting depth 0 (relative to `from`) that is in `words`.
    fn first_at_depth0(&self, from: usize, words: &[&str]) -> Option<(usize, &str)> {
        let mut depth = 0i64;
        for i in from..self.hi {
            match self.class(i) {
                Some(Class::LParen | Class::LBracket) => depth += 1,
                Some(Class::RParen | Class::RBracket) => depth -= 1,
                Some(Class::Word) if depth <= 0 => {
                    if let Some(w) = self.word(i).filter(|w| words.contains(w)) {
                        return Some((i, w));
                    }
                }
                _ => {}
            }
        }
        None
    }
}

fn add(effects: &mut Vec<SessionEffect>, e: SessionEffect) {
    if effects.len() < MAX_EFFECTS && !effects.contains(&e) {
        effects.push(e);
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
            let head_is_temp =
                (i + 1..(i + 6).min(s.hi)).any(|j| matches!(s.word(j), Some("temp" | "temporary")));
            let pg_temp =
                (i + 1..s.hi).any(|j| s.is(j, "pg_temp") && s.class(j + 1) == Some(Class::Period));
            if head_is_temp || pg_temp {
                add(fx, SessionEffect::CreateTemp);
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
                _ => guc_name(s, i + 1).map(|(name, _)| name),
            };
            add(fx, SessionEffect::Reset { name });
            StmtKind::Session
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
        if tok.class != Class::Word {
            continue;
        }
        let w = s.n.text(tok);
        let call = s.class(j + 1) == Some(Class::LParen);
        match w {
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
            "pg_advisory_lock"
            | "pg_advisory_lock_shared"
            | "pg_try_advisory_lock"
            | "pg_try_advisory_lock_shared"
                if call =>
            {
                add(fx, SessionEffect::AdvisoryLock);
            }
            "pg_advisory_unlock" | "pg_advisory_unlock_shared" | "pg_advisory_unlock_all"
                if call =>
            {
                add(fx, SessionEffect::AdvisoryUnlock);
            }
            "set_config"
                if call
                    && !fx.contains(&SessionEffect::SetConfigSession)
                    && set_config_is_session(s, j + 2, &mut budget) =>
            {
                add(fx, SessionEffect::SetConfigSession);
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

/// `name` or `a.b` (words or quoted identifiers joined by `.`) starting at `i`; returns the
/// name and the index after it.
fn guc_name(s: &Stmt<'_>, mut i: usize) -> Option<(String, usize)> {
    match (s.word(i), s.word(i + 1)) {
        (Some("time"), Some("zone")) => return Some(("timezone".to_owned(), i + 2)),
        (Some("session"), Some("authorization")) => {
            return Some(("session_authorization".to_owned(), i + 2));
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
        Some((name, i))
    }
}

fn set_effect(s: &Stmt<'_>, mut i: usize, fx: &mut Vec<SessionEffect>) {
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
            Some((name, _)) => name,
            None => return,
        },
    };
    add(fx, SessionEffect::Set { name, local });
}

/// Looks at the third argument of a call whose arguments start at `i`, spending at most
/// `budget` tokens across all calls of the statement.
fn set_config_is_session(s: &Stmt<'_>, i: usize, budget: &mut usize) -> bool {
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
                    return !s.is(j + 1, "true");
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
    use super::StmtKind as K;
    use super::*;
    use crate::classify::fingerprint::{DEFAULT_MAX_TEXT_BYTES, analyze};

    fn kind(sql: &str) -> (StmtKind, Vec<SessionEffect>) {
        let c = analyze(sql, DEFAULT_MAX_TEXT_BYTES);
        (c.kind, c.effects)
    }

    fn set(name: &str, local: bool) -> E {
        E::Set {
            name: name.to_owned(),
            local,
        }
    }

    fn reset(name: Option<&str>) -> E {
        E::Reset {
            name: name.map(str::to_owned),
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
            assert_eq!(kind(sql).1, want, "{sql:?}");
        }
        assert!(!set("x", true).is_session_level());
        assert!(set("x", false).is_session_level());
        assert!(E::AdvisoryLock.is_session_level());
    }

    #[test]
    fn effects_are_bounded() {
        let sql: String = (0..500).map(|i| format!("set g{i} = 1;")).collect();
        assert_eq!(kind(&sql).1.len(), MAX_EFFECTS);
    }
}
