//! Fingerprinting: one token pass over a statement string that yields the fingerprint, the
//! display text, the statement kind, session effects and comment tags.
//!
//! Owns: choosing the lexer (sqlparser's `Tokenizer` up to the size cap, the byte scanner for
//! what it rejects and for oversized texts), feeding the shared `Normalizer`, hashing, and the
//! hex form. It must not cache (that is `Classifier`), must not use the full SQL parser
//! (slower, fails on real Postgres syntax, drops comments), and must stay bounded in time and
//! stack on hostile input.
//!
//! Size policy:
//! - `len <= max_text_bytes` (default 64 KiB): sqlparser's tokenizer; on a tokenizer error
//!   (unterminated quote, dollar quote or comment) the byte scanner.
//! - larger: `oversized = true`, the byte scanner over the first
//!   `max_text_bytes * SCAN_FACTOR` bytes (1 MiB by default). Canonical forms agree between
//!   the two lexers for ordinary SQL, so a 20 000-element `IN` list has the same fingerprint as
//!   a 3-element one. If the text is longer still, the rest is never looked at: the fingerprint
//!   then covers the scanned prefix (with an open `IN` list collapsed and a marker so it never
//!   equals a complete statement's), and kind, effects and tags come from that prefix only —
//!   callers should treat `oversized` statements conservatively.
//!
//! The hash is xxh3-64 (unseeded, so stable across processes and releases of this file as
//! long as the canonical form is unchanged) of the canonical text; see `normalize.rs` for the
//! canonical form. The display text is capped at `DISPLAY_MAX_BYTES`.

use std::fmt::Write as _;
use std::sync::Arc;

use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::tokenizer::{Token, Tokenizer, Whitespace};
use xxhash_rust::xxh3::xxh3_64;

use super::Classified;
use super::effects::SessionEffect;
use super::kind::{self, StmtKind};
use super::normalize::{Class, Normalizer};
use super::proof;
use super::scan;
use super::tags::parse_tag_comment;

/// Default cap for the tokenizer path.
pub const DEFAULT_MAX_TEXT_BYTES: usize = 64 * 1024;
/// Oversized texts are scanned up to `max_text_bytes * SCAN_FACTOR` bytes.
pub const SCAN_FACTOR: usize = 16;
/// The display text (`normalized`) is cut after this many bytes, ending in `…`.
pub const DISPLAY_MAX_BYTES: usize = 4096;
/// Appended to the canonical text of a prefix-only fingerprint. NUL never occurs in a
/// Postgres query string, so no complete statement can produce it.
const TRUNCATED_MARKER: &str = "\0truncated";

/// 16 lowercase hex digits.
pub fn fingerprint_hex(fingerprint: u64) -> String {
    format!("{fingerprint:016x}")
}

/// Parses the 16-hex-digit form back (for admin API paths).
pub fn parse_fingerprint_hex(s: &str) -> Option<u64> {
    if s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
        u64::from_str_radix(s, 16).ok()
    } else {
        None
    }
}

/// Fingerprint with the default size cap.
pub fn fingerprint(sql: &str) -> u64 {
    analyze(sql, DEFAULT_MAX_TEXT_BYTES).fingerprint
}

/// The full, uncached analysis of one statement string.
pub fn analyze(sql: &str, max_text_bytes: usize) -> Classified {
    analyze_text(sql, true, max_text_bytes)
}

/// The token walk alone, without the parse's proof: what the tests of the walk compare.
#[cfg(test)]
pub(crate) fn token_walk(sql: &str) -> Classified {
    let mut n = Normalizer::new();
    if tokenize_into(sql, &mut n).is_err() {
        n = Normalizer::new();
        scan::scan(sql, &mut n);
    }
    finish(n, false, false)
}

/// [`analyze`] of a text that may be a lossy UTF-8 copy of the client's bytes (`utf8`
/// false): such a text is never proven (`proof.rs`).
pub fn analyze_text(sql: &str, utf8: bool, max_text_bytes: usize) -> Classified {
    let mut n = Normalizer::new();
    if sql.len() <= max_text_bytes {
        if tokenize_into(sql, &mut n).is_err() {
            n = Normalizer::new();
            scan::scan(sql, &mut n);
        }
        let mut c = finish(n, false, false);
        let mut proof = proof::prove(sql, utf8);
        if proof.unproven == Some(proof::DOES_NOT_PARSE) {
            // sqlparser does not know all of Postgres' syntax (`FOR NO KEY UPDATE`): the
            // token walk's kind says whether the text may change the catalog, so a query it
            // merely fails to parse does not keep the pool's snapshot stale.
            proof.catalog_change = !matches!(
                c.kind,
                StmtKind::Read
                    | StmtKind::LockingRead
                    | StmtKind::Write
                    | StmtKind::Transaction
                    | StmtKind::Session
            );
        }
        if !proof.is_proven() && !c.effects.contains(&SessionEffect::Unknown) {
            // What the parse cannot prove harmless may do anything (the token walk's effects
            // stay: they are what the session tracks or pins for).
            c.effects.push(SessionEffect::Unknown);
        }
        c.proof = proof;
        return c;
    }
    let limit = max_text_bytes.saturating_mul(SCAN_FACTOR).max(1);
    let cut = sql.floor_char_boundary(limit);
    scan::scan(&sql[..cut], &mut n);
    let mut c = finish(n, true, cut < sql.len());
    if !c.effects.contains(&SessionEffect::Unknown) {
        c.effects.push(SessionEffect::Unknown);
    }
    // Too long to parse: the token walk's kind says whether it may change the catalog.
    c.proof.catalog_change = matches!(c.kind, StmtKind::Ddl | StmtKind::Other);
    c
}

/// Feeds sqlparser's tokens into `n`.
fn tokenize_into(
    sql: &str,
    n: &mut Normalizer,
) -> Result<(), sqlparser::tokenizer::TokenizerError> {
    let tokens = Tokenizer::new(&PostgreSqlDialect {}, sql)
        .with_unescape(false)
        .tokenize_with_location()?;
    let mut op = String::new();
    for t in tokens {
        match t.token {
            Token::EOF => {}
            Token::Word(w) => match w.quote_style {
                Some(q) => n.push_quoted(&w.value, q),
                None => n.push_word(&w.value),
            },
            Token::Number(..)
            | Token::SingleQuotedString(_)
            | Token::DoubleQuotedString(_)
            | Token::TripleSingleQuotedString(_)
            | Token::TripleDoubleQuotedString(_)
            | Token::DollarQuotedString(_)
            | Token::SingleQuotedByteStringLiteral(_)
            | Token::DoubleQuotedByteStringLiteral(_)
            | Token::TripleSingleQuotedByteStringLiteral(_)
            | Token::TripleDoubleQuotedByteStringLiteral(_)
            | Token::SingleQuotedRawStringLiteral(_)
            | Token::DoubleQuotedRawStringLiteral(_)
            | Token::TripleSingleQuotedRawStringLiteral(_)
            | Token::TripleDoubleQuotedRawStringLiteral(_)
            | Token::NationalStringLiteral(_)
            | Token::QuoteDelimitedStringLiteral(_)
            | Token::NationalQuoteDelimitedStringLiteral(_)
            | Token::EscapedStringLiteral(_)
            | Token::UnicodeStringLiteral(_)
            | Token::HexStringLiteral(_)
            | Token::Placeholder(_)
            | Token::CopyData { .. } => n.push_param(),
            Token::Whitespace(Whitespace::MultiLineComment(body)) => n.push_comment(&body),
            Token::Whitespace(_) => {}
            Token::Comma => n.push_punct(Class::Comma),
            Token::LParen => n.push_punct(Class::LParen),
            Token::RParen => n.push_punct(Class::RParen),
            Token::LBracket => n.push_punct(Class::LBracket),
            Token::RBracket => n.push_punct(Class::RBracket),
            Token::Period => n.push_punct(Class::Period),
            Token::DoubleColon => n.push_punct(Class::DoubleColon),
            Token::SemiColon => n.push_punct(Class::Semi),
            other => {
                op.clear();
                // Writing to a String cannot fail.
                let _ = write!(op, "{other}");
                n.push_op(&op);
            }
        }
    }
    Ok(())
}

fn finish(mut n: Normalizer, oversized: bool, truncated: bool) -> Classified {
    n.finish();
    let kind::Analysis {
        kind,
        mut effects,
        own_transaction,
    } = kind::analyze(&n);
    if truncated && !effects.contains(&SessionEffect::Unknown) {
        // The part never read may do anything.
        effects.push(SessionEffect::Unknown);
    }
    let mut tags = Vec::new();
    for body in n.tag_comments() {
        parse_tag_comment(body, &mut tags);
    }
    let mut canonical = String::new();
    n.render(&mut canonical, false, usize::MAX);
    if truncated {
        canonical.push_str(TRUNCATED_MARKER);
    }
    let fingerprint = xxh3_64(canonical.as_bytes());
    let mut display = String::with_capacity(canonical.len().min(DISPLAY_MAX_BYTES + 8));
    let cut_short = n.render(&mut display, true, DISPLAY_MAX_BYTES);
    if cut_short || display.len() > DISPLAY_MAX_BYTES || truncated {
        let at = display.floor_char_boundary(DISPLAY_MAX_BYTES);
        display.truncate(at);
        display.push_str(" …");
    }
    Classified {
        fingerprint,
        normalized: Arc::from(display),
        kind,
        effects,
        tags,
        oversized,
        own_transaction,
        proof: proof::Proof::unproven("not parsed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::StmtKind;
    use std::time::{Duration, Instant};

    fn fp(sql: &str) -> u64 {
        fingerprint(sql)
    }

    fn norm(sql: &str) -> String {
        analyze(sql, DEFAULT_MAX_TEXT_BYTES).normalized.to_string()
    }

    /// Canonical text through the byte scanner only.
    fn scanned(sql: &str) -> Classified {
        let mut n = Normalizer::new();
        scan::scan(sql, &mut n);
        finish(n, false, false)
    }

    #[test]
    fn display_example() {
        let a = "SELECT * FROM users WHERE id = 1204 AND status = 'active'";
        let b = "select *  from users where id=7 and status='x' /*service:a*/";
        assert_eq!(fp(a), fp(b));
        assert_eq!(norm(a), "SELECT * FROM users WHERE id = ? AND status = ?");
        assert_eq!(norm(b), norm(a));
        assert_eq!(fingerprint_hex(fp(a)).len(), 16);
        assert_eq!(parse_fingerprint_hex(&fingerprint_hex(fp(a))), Some(fp(a)));
        assert_eq!(fingerprint_hex(0xab), "00000000000000ab");
        assert_eq!(parse_fingerprint_hex("xyz"), None);
    }

    #[test]
    fn equivalent_texts_share_a_fingerprint() {
        let groups: &[&[&str]] = &[
            &[
                "SELECT * FROM users WHERE id = 1",
                "select * from users where id = $1",
                "SELECT\n\t*\nFROM   users\nWHERE id=99;",
                "/* leading */ select * from USERS where ID = 'x' -- trailing",
                "select * from users where id = -5",
                "select * from users where id = 1.5e3",
                "select * from users where id = E'it''s'",
                "select * from users where id = $$dollar$$",
                "select * from users where id = $tag$ x $tag$",
                "select * from users where id = B'0101'",
                "select * from users where id = X'ff'",
                "select * from users where id = U&'d\\0061t'",
                "select * from users where id = N'x'",
            ],
            &[
                "select * from t where id in (1)",
                "select * from t where id in (1, 2, 3)",
                "select * from t where id in ($1,$2,$3,$4)",
                "SELECT * FROM t WHERE id IN ('a','b')",
                "select * from t where id in (-1, 2)",
            ],
            &[
                "select * from t where (a, b) in ((1, 2))",
                "select * from t where (a, b) in ((1, 2), (3, 4), ($1, $2))",
            ],
            &[
                "select * from t where id not in (1,2)",
                "select * from t where id not in (7)",
            ],
            &[
                "insert into t (a, b) values (1, 2)",
                "insert into t (a, b) values (1, 2), (3, 4), ($1, $2)",
                "INSERT INTO t(a,b) VALUES (1,'x'),(2,'y');",
            ],
            &[
                "select * from t where id = any(array[1,2,3])",
                "select * from t where id = any(ARRAY[4])",
            ],
            &[
                "select \"Users\".id from \"Users\"",
                "SELECT \"Users\".ID FROM \"Users\"",
            ],
            &[
                "select 1; select 2",
                "SELECT 1 ; SELECT 'x';",
                ";select 3;;select 4;",
            ],
            &[
                "select count(*) from t",
                "select count (*) from t",
                "SELECT COUNT( * ) FROM t",
            ],
            &["select a<>b from t", "select a != b from t"],
        ];
        for group in groups {
            let first = fp(group[0]);
            for sql in group.iter() {
                assert_eq!(
                    fp(sql),
                    first,
                    "{sql:?} vs {:?}: {:?} vs {:?}",
                    group[0],
                    norm(sql),
                    norm(group[0])
                );
            }
        }
        // Every group is distinct from every other.
        let firsts: std::collections::HashSet<u64> = groups.iter().map(|g| fp(g[0])).collect();
        assert_eq!(firsts.len(), groups.len());
    }

    #[test]
    fn different_shapes_differ() {
        let pairs = [
            (
                "select * from users where id = 1",
                "select * from accounts where id = 1",
            ),
            (
                "select * from users where id = 1",
                "select * from users where uid = 1",
            ),
            (
                "select * from users where id = 1",
                "select * from users where id > 1",
            ),
            (
                "select * from users where id = 1",
                "select id from users where id = 1",
            ),
            ("select * from \"Users\"", "select * from users"),
            (
                "select * from t where a = 1 and b = 2",
                "select * from t where a = 1 or b = 2",
            ),
            (
                "select * from t where id in (1,2)",
                "select * from t where id in (select 1)",
            ),
            ("insert into t values (1,2)", "insert into t values (1,2,3)"),
            ("select a - 1 from t", "select a + 1 from t"),
            (
                "select * from t where active = true",
                "select * from t where active = false",
            ),
            ("select 1", "select 1; select 1"),
            (
                "select x from t order by x",
                "select x from t order by x desc",
            ),
        ];
        for (a, b) in pairs {
            assert_ne!(fp(a), fp(b), "{a:?} == {b:?} ({:?})", norm(a));
        }
    }

    #[test]
    fn display_texts() {
        let cases = [
            (
                "select * from t where id in (1,2,3)",
                "SELECT * FROM t WHERE id IN (?)",
            ),
            (
                "insert into t(a,b) values (1,2),(3,4) returning id",
                "INSERT INTO t(a, b) VALUES (?, ?) RETURNING id",
            ),
            (
                "select count(*), max(x::int) from s.t where x -> 'k' = $1",
                "SELECT count(*), max(x::int) FROM s.t WHERE x -> ? = ?",
            ),
            (
                "select * from t where (a,b) in ((1,2),(3,4))",
                "SELECT * FROM t WHERE (a, b) IN ((?, ?))",
            ),
            (
                "update t set a = -1, b = a - 2 where c = any(array[1,2])",
                "UPDATE t SET a = ?, b = a - ? WHERE c = ANY (ARRAY[?])",
            ),
            ("select 1;", "SELECT ?"),
            ("", ""),
            ("/* only a comment */", ""),
        ];
        for (sql, want) in cases {
            assert_eq!(norm(sql), want, "{sql:?}");
        }
    }

    #[test]
    fn scanner_agrees_with_tokenizer() {
        let corpus = [
            "SELECT * FROM users WHERE id = 1204 AND status = 'active'",
            "select u.id, u.name from users u join orders o on o.user_id = u.id where o.total >= 10.5 order by u.id desc limit 10 offset 20",
            "insert into t (a, b, c) values (1, 'x', now()), (2, 'y', now()) on conflict (a) do update set b = excluded.b returning id",
            "update accounts set balance = balance - $1 where id = $2 and balance >= $1",
            "delete from sessions where expires_at < now() - interval '1 day'",
            "select * from jobs where state = 'queued' order by id for update skip locked limit 1",
            "select data->>'name', data #> '{a,b}', tags @> array['x'] from docs where id = any($1::int[])",
            "with recursive r(n) as (select 1 union all select n + 1 from r where n < 10) select sum(n) from r",
            "select \"Mixed\".\"Col\" from \"Mixed\" where \"Col\" ~* '^a' and x !~ 'b' and y <> 3",
            "set search_path to app, public; select set_config('x', 'y', false)",
            "select e'a\\'b', $q$body$q$, -1.5, +2, 1e-3 from t where a between -1 and 2",
            "copy t (a, b) from stdin with (format csv)",
            "select a::text || b from t where c is not null and d not like 'x%' /*service:web*/",
        ];
        for sql in corpus {
            let via_tokenizer = token_walk(sql);
            let via_scanner = scanned(sql);
            assert_eq!(via_tokenizer, via_scanner, "{sql:?}");
        }
    }

    /// A read sqlparser cannot parse is unproven (checked after its unit) but does not make
    /// the pool's catalog snapshot stale; a `DO` block does.
    #[test]
    fn an_unparsed_read_is_unproven_without_changing_the_catalog() {
        let c = analyze(
            "SELECT * FROM jobs WHERE id = 1 FOR NO KEY UPDATE OF jobs NOWAIT",
            DEFAULT_MAX_TEXT_BYTES,
        );
        assert!(!c.proof.is_proven() && c.effects.contains(&SessionEffect::Unknown));
        assert!(!c.proof.catalog_change, "{:?}", c.proof);
        let d = analyze("DO $$ BEGIN END $$", DEFAULT_MAX_TEXT_BYTES);
        assert!(d.proof.catalog_change, "{:?}", d.proof);
    }

    #[test]
    fn unparseable_sql_still_fingerprints() {
        for sql in [
            "select 'unterminated",
            "select $$ unterminated dollar",
            "select 1 /* unterminated comment",
            "select \"unterminated ident",
            "select e'\\",
            "\u{0}\u{1}}{][)(",
            "ＳＥＬＥＣＴ ｘ",
        ] {
            let c = analyze(sql, DEFAULT_MAX_TEXT_BYTES);
            assert!(!c.oversized);
            assert_eq!(fingerprint_hex(c.fingerprint).len(), 16);
        }
        // Unterminated literals normalize like terminated ones.
        assert_eq!(fp("select 'unterminated"), fp("select 'x'"));
        assert_eq!(norm("select 'oops"), "SELECT ?");
        assert_eq!(norm("select 1 /* never closed"), "SELECT ?");
    }

    fn timed(label: &str, sql: &str) -> Classified {
        let t = Instant::now();
        let c = analyze(sql, DEFAULT_MAX_TEXT_BYTES);
        let took = t.elapsed();
        eprintln!("{label}: {} bytes in {took:?}", sql.len());
        assert!(took < Duration::from_secs(2), "{label} took {took:?}");
        c
    }

    #[test]
    fn hostile_inputs_are_bounded() {
        let nested = format!("select {}1{}", "(".repeat(100_000), ")".repeat(100_000));
        let c = timed("100k nested parens", &nested);
        assert!(c.oversized);
        assert_eq!(c.kind, StmtKind::Read);

        let ids: Vec<String> = (0..150_000).map(|i| i.to_string()).collect();
        let in_list = format!("select * from t where id in ({})", ids.join(", "));
        assert!(in_list.len() > 1_000_000);
        let c = timed("1 MB IN list", &in_list);
        assert!(c.oversized);
        assert!(c.normalized.len() <= DISPLAY_MAX_BYTES + 4);

        let many = "select * from t where id = 1;".repeat(10_000);
        let c = timed("10k statements", &many);
        assert_eq!(c.kind, StmtKind::Read);
        assert!(
            c.normalized.len() <= DISPLAY_MAX_BYTES + 4,
            "{}",
            c.normalized.len()
        );

        let comments = "/*/*/*".repeat(50_000);
        timed("nested comment openers", &comments);
        let quotes = "'".repeat(200_000);
        timed("quotes", &quotes);
        let explains = "explain ".repeat(20_000) + "delete from t";
        let c = timed("explain chain", &explains);
        assert_eq!(c.kind, StmtKind::Read);
        let calls = "select set_config(".repeat(10_000);
        timed("open calls", &calls);
        let big_under_cap = format!(
            "select * from t where id in ({})",
            vec!["1"; 30_000].join(",")
        );
        assert!(big_under_cap.len() < DEFAULT_MAX_TEXT_BYTES);
        timed("60 KB under the cap", &big_under_cap);
    }

    #[test]
    fn in_list_keeps_fingerprint_across_the_cap() {
        let small = "select * from t where id in (1, 2, 3)";
        let big = format!(
            "select * from t where id in ({})",
            vec!["42"; 40_000].join(", ")
        );
        assert!(big.len() > DEFAULT_MAX_TEXT_BYTES);
        let c = analyze(&big, DEFAULT_MAX_TEXT_BYTES);
        assert!(c.oversized);
        assert_eq!(c.fingerprint, fp(small));
        // Past the scan limit: a prefix fingerprint, stable wherever the cut falls, and never
        // equal to a complete statement's.
        let a = analyze(&big, 1024);
        let huge = format!(
            "select * from t where id in ({})",
            vec!["7"; 90_000].join(", ")
        );
        let b = analyze(&huge, 1024);
        assert!(a.oversized && b.oversized);
        assert_eq!(a.fingerprint, b.fingerprint);
        assert_ne!(a.fingerprint, fp(small));
        assert!(a.normalized.ends_with('…'));
    }

    /// Deterministic mini-fuzz: SQL-ish fragments and raw characters in random order never
    /// panic, through both lexers, and the same text always gives the same answer.
    #[test]
    fn random_inputs_never_panic() {
        const PIECES: &[&str] = &[
            "select",
            "SET",
            "in",
            "values",
            "array",
            "explain",
            "with",
            "as",
            "for",
            "update",
            "set_config",
            "pg_advisory_lock",
            "(",
            ")",
            "[",
            "]",
            ",",
            ";",
            ".",
            "::",
            "'",
            "\"",
            "$",
            "$$",
            "$1",
            "$a$",
            "e'",
            "u&'",
            "/*",
            "*/",
            "--",
            "\n",
            " ",
            "-",
            "+",
            "=",
            "<>",
            "1",
            "1.5e3",
            ".5",
            "é",
            "→",
            "\\",
            "?",
            "::int",
            "x",
            "true",
            "false",
            "/*service:a*/",
            "into",
            "temp",
            "@>",
            "#",
            "\u{0}",
        ];
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..3000 {
            let len = (next() % 24) as usize;
            let sql: String = (0..len)
                .map(|_| PIECES[(next() % PIECES.len() as u64) as usize])
                .collect();
            let a = analyze(&sql, DEFAULT_MAX_TEXT_BYTES);
            let b = analyze(&sql, sql.len().saturating_sub(1).max(1));
            let c = analyze(&sql, 3);
            assert_eq!(a, analyze(&sql, DEFAULT_MAX_TEXT_BYTES), "{sql:?}");
            assert!(a.normalized.len() <= DISPLAY_MAX_BYTES + 4);
            let _ = (b, c);
        }
    }

    #[test]
    fn tags_from_leading_and_trailing_comments() {
        let c = analyze(
            "/*service:billing*/ select 1 /* mid:x */ + 2 /*application='web',route='%2Fcheckout'*/;",
            DEFAULT_MAX_TEXT_BYTES,
        );
        let want: Vec<(String, String)> = [
            ("service", "billing"),
            ("application", "web"),
            ("route", "/checkout"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(c.tags, want);
        let sql = "/*service:billing*/ select 1 /* mid:x */ + 2 /*application='web',route='%2Fcheckout'*/;";
        assert_eq!(crate::classify::extract_tags(sql), want);
        assert!(analyze("select '/*service:a*/'", 100).tags.is_empty());
        assert!(
            analyze("select 1 /* not: tags here */", 100)
                .tags
                .is_empty()
        );
    }
}
