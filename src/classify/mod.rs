//! classify: what a statement is and who sent it.
//!
//! Owns the per-statement analysis that policy and observability key on: the fingerprint
//! (`fingerprint.rs`, lexing via sqlparser's tokenizer or `scan.rs`, shaping in
//! `normalize.rs`), the statement kind (`kind.rs`), session effects (`effects.rs`), comment
//! tags (`tags.rs`) and caller resolution (`caller.rs`). It knows nothing of sockets, sessions,
//! config files or policy, and imports no other pgsluice module.
//!
//! `Classifier` caches one `Arc<Classified>` per distinct statement text:
//! - Two kinds of key share the cache: the exact text, and the text's shape (`shape.rs`: the
//!   text with the contents of plain literals blanked, starting with NUL so the two never
//!   meet). A text is looked up once: by its shape when it has literals to blank, else by
//!   itself (a text with a `$`, every extended-protocol Parse, skips the shape pass):
//!   `... WHERE id = 1` and `... WHERE id = 2` share one classification, and the simple
//!   protocol's literal-laden texts are tokenized once per shape, not once per call. A miss
//!   inserts that one key; a stream of new literals hits the shape and churns nothing.
//! - Keys are the text's bytes, looked up as `&[u8]` (the shape is built in a per-thread
//!   buffer): a hit needs no UTF-8 check. Only a miss reads the text as UTF-8 (a lossy copy
//!   when it is not: a non-UTF-8 client encoding), so the answer is a function of the bytes,
//!   as the key is. quick_cache
//!   hashes it once with its per-process randomly seeded hasher and compares the text on a
//!   hit, which is the "verify the text on hit" variant: no collision can ever return another
//!   text's classification (that matters: a crafted collision could hide a `SET ROLE` from the
//!   pooling layer), and crafted texts cannot pile into one shard. A hit costs one hash of the
//!   text, one comparison and an `Arc` clone.
//! - Entries are weighed `1 + (text + normalized) / 1 KiB`, so `max_entries` counts typical
//!   OLTP statements and large texts pay for their size; memory stays near
//!   `max_entries × 2 KiB` at worst.
//! - Texts over `max_text_bytes` are not cached (they would evict many small entries and are
//!   cheap enough to rescan within their bounded budget).
//! - No lock is held while tokenizing: get, compute, insert. Two threads missing on the same
//!   text both compute it; the second insert replaces the first with an equal value.
//!
//! Prepared statements: the session layer should keep the `Arc<Classified>` next to each named
//! statement, so `Bind`/`Execute` never touch the text again.

use std::sync::Arc;

use quick_cache::Weighter;
use quick_cache::sync::Cache;

pub mod caller;
mod calls;
pub mod effects;
pub mod fingerprint;
pub mod kind;
mod normalize;
pub mod proof;
mod scan;
mod shape;
mod stmt;
pub mod tags;

pub use caller::{CallerId, CallerMatcher, CallerRule, Cidr, CidrError, DEFAULT_CALLER_NAME};
pub use effects::SessionEffect;
pub use fingerprint::{
    DEFAULT_MAX_TEXT_BYTES, analyze, fingerprint, fingerprint_hex, parse_fingerprint_hex,
};
pub use kind::StmtKind;
pub use proof::Proof;
pub use tags::extract_tags;

/// Everything the proxy needs to know about one statement string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classified {
    /// xxh3-64 of the canonical text; show with `fingerprint_hex`.
    pub fingerprint: u64,
    /// Display text: literals as `?`, common keywords uppercased, at most ~4 KiB.
    pub normalized: Arc<str>,
    /// Strongest kind among the statements in the text.
    pub kind: StmtKind,
    /// Session-state effects of all statements (deduplicated, bounded).
    pub effects: Vec<SessionEffect>,
    /// Tags from leading/trailing comments (at most 16).
    pub tags: Vec<(String, String)>,
    /// The text exceeded `max_text_bytes`; it was read by the byte scanner, and beyond
    /// `16 × max_text_bytes` not at all. Treat kind and effects conservatively.
    pub oversized: bool,
    /// A statement in the text cannot run inside a transaction block (`VACUUM`, `CREATE
    /// INDEX CONCURRENTLY`, …) or may commit by itself (`CALL`, `DO`): timeouts for it are
    /// set for the session around it, not `SET LOCAL` in front of it.
    pub own_transaction: bool,
    /// What the parse proved (`proof.rs`): unproven texts also carry `SessionEffect::Unknown`;
    /// a proven one may still depend on names the pool checks against the database.
    pub proof: Proof,
}

impl Classified {
    /// Any effect that outlives the transaction.
    pub fn has_session_effects(&self) -> bool {
        self.effects.iter().any(SessionEffect::is_session_level)
    }
}

thread_local! {
    /// Reused buffer for shape keys: a lookup allocates nothing.
    static KEY: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[derive(Clone)]
struct EntryWeight;

impl Weighter<Box<[u8]>, Arc<Classified>> for EntryWeight {
    fn weight(&self, key: &Box<[u8]>, val: &Arc<Classified>) -> u64 {
        1 + (key.len() + val.normalized.len()) as u64 / 1024
    }
}

/// The longest cache key a [`Memo`] keeps: a session holds at most this much text for it.
const MEMO_MAX_KEY: usize = 1024;

/// One session's last classification and the cache key it was found under. A
/// classification is a function of its key alone (the cache shares one `Classified` between
/// all texts of a key), so a later text with an equal key gets the same answer.
#[derive(Default)]
pub struct Memo {
    key: Vec<u8>,
    class: Option<Arc<Classified>>,
}

impl Memo {
    fn hit(&self, key: &[u8]) -> Option<Arc<Classified>> {
        self.class.as_ref().filter(|_| self.key == key).cloned()
    }

    fn remember(&mut self, key: &[u8], class: &Arc<Classified>) {
        if key.len() > MEMO_MAX_KEY {
            self.class = None;
            if self.key.capacity() > MEMO_MAX_KEY {
                self.key = Vec::new();
            }
            return;
        }
        self.key.clear();
        self.key.extend_from_slice(key);
        self.class = Some(Arc::clone(class));
    }
}

/// Cached classification of statement texts. Cheap to share behind an `Arc`.
pub struct Classifier {
    cache: Option<Cache<Box<[u8]>, Arc<Classified>, EntryWeight>>,
    max_text_bytes: usize,
}

impl std::fmt::Debug for Classifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Classifier")
            .field("cached", &self.cache.as_ref().map_or(0, Cache::len))
            .field("max_text_bytes", &self.max_text_bytes)
            .finish()
    }
}

impl Classifier {
    /// `max_entries == 0` disables the cache. `max_text_bytes` is the tokenizer cap
    /// (`DEFAULT_MAX_TEXT_BYTES` is 64 KiB); it is clamped to 1 B ..= 64 MiB.
    pub fn new(max_entries: usize, max_text_bytes: usize) -> Self {
        let cache = (max_entries > 0)
            .then(|| Cache::with_weighter(max_entries, max_entries as u64, EntryWeight));
        Classifier {
            cache,
            max_text_bytes: max_text_bytes.clamp(1, 64 << 20),
        }
    }

    pub fn classify(&self, sql: &str) -> Arc<Classified> {
        self.lookup(sql.as_bytes(), None)
    }

    /// [`Classifier::classify`] of a text as the client sent it, for one session: a text
    /// with the same cache key as the one before it (a client running one statement in a
    /// loop, with new literals each time) is answered from `memo`, without the shared cache's
    /// hash, lock and probe. A text that is not UTF-8 (a client encoding such as LATIN1) is
    /// classified as its lossy UTF-8 copy.
    pub fn classify_memo(&self, sql: &[u8], memo: &mut Memo) -> Arc<Classified> {
        self.lookup(sql, Some(memo))
    }

    /// The analysis itself, on a miss: the text as UTF-8 (checked here, once).
    fn analyze(&self, sql: &[u8]) -> Classified {
        let text = String::from_utf8_lossy(sql);
        let utf8 = matches!(text, std::borrow::Cow::Borrowed(_));
        fingerprint::analyze_text(&text, utf8, self.max_text_bytes)
    }

    fn lookup(&self, sql: &[u8], memo: Option<&mut Memo>) -> Arc<Classified> {
        let Some(cache) = self
            .cache
            .as_ref()
            .filter(|_| sql.len() <= self.max_text_bytes)
        else {
            return Arc::new(self.analyze(sql));
        };
        // One lookup: by the shape key when the text has literals to blank (the pass is a
        // few instructions per byte, cheaper than a second lookup), else by the exact text.
        KEY.with_borrow_mut(|key| {
            let k = if shape::shape_key(sql, key) {
                key.as_slice()
            } else {
                sql
            };
            if let Some(m) = &memo
                && let Some(c) = m.hit(k)
            {
                return c;
            }
            let classified = match cache.get(k) {
                Some(hit) => hit,
                None => {
                    let classified = Arc::new(self.analyze(sql));
                    cache.insert(Box::from(k), Arc::clone(&classified));
                    classified
                }
            };
            if let Some(m) = memo {
                m.remember(k, &classified);
            }
            classified
        })
    }

    /// Number of cached texts.
    pub fn cached(&self) -> usize {
        self.cache.as_ref().map_or(0, Cache::len)
    }

    pub fn max_text_bytes(&self) -> usize {
        self.max_text_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_returns_same_arc_and_distinguishes_texts() {
        let c = Classifier::new(100, DEFAULT_MAX_TEXT_BYTES);
        let a = c.classify("select 1");
        let b = c.classify("select 1");
        assert!(Arc::ptr_eq(&a, &b));
        // A text with literals is cached by its shape only.
        assert_eq!(c.cached(), 1);
        // Same shape, other literal: answered by the shape, nothing inserted.
        let d = c.classify("select 2");
        assert!(Arc::ptr_eq(&a, &d));
        assert_eq!(c.cached(), 1);
        // Other shape: its own entry; no literal, so keyed by the text.
        let e = c.classify("select x from t");
        assert!(!Arc::ptr_eq(&a, &e));
        assert_eq!(c.cached(), 2);
        assert!(Arc::ptr_eq(&e, &c.classify("select x from t")));
        assert_eq!(c.cached(), 2);
        let set = c.classify("set role admin");
        assert!(set.has_session_effects());
        assert!(!a.has_session_effects());
    }

    #[test]
    fn memo_answers_a_repeated_shape_and_follows_a_new_one() {
        let c = Classifier::new(100, DEFAULT_MAX_TEXT_BYTES);
        let mut m = Memo::default();
        let a = c.classify_memo(b"select * from t where id = 1", &mut m);
        assert!(Arc::ptr_eq(&a, &c.classify("select * from t where id = 1")));
        // Same shape, other literal: the memo's answer, which is the cache's.
        let b = c.classify_memo(b"select * from t where id = 2", &mut m);
        assert!(Arc::ptr_eq(&a, &b));
        // Another text: its own class, and the memo moves to it.
        let w = c.classify_memo(b"update t set x = 1 where id = 2", &mut m);
        assert_eq!(w.kind, StmtKind::Write);
        assert!(!Arc::ptr_eq(&a, &w));
        let again = c.classify_memo(b"select * from t where id = 3", &mut m);
        assert_eq!(again.kind, StmtKind::Read);
        assert!(Arc::ptr_eq(&a, &again));
        // A key longer than the memo keeps is classified all the same, and not remembered.
        let long = format!("select {} from t", "x, ".repeat(MEMO_MAX_KEY) + "y");
        let l = c.classify_memo(long.as_bytes(), &mut m);
        assert!(Arc::ptr_eq(&l, &c.classify(&long)));
        assert!(m.class.is_none());
        assert!(m.key.capacity() <= MEMO_MAX_KEY);
        // Without a cache nothing is remembered either.
        let off = Classifier::new(0, 1024);
        let mut m = Memo::default();
        assert_eq!(
            off.classify_memo(b"delete from t", &mut m).kind,
            StmtKind::Write
        );
        assert!(m.class.is_none());
    }

    #[test]
    fn a_text_that_is_not_utf8_is_classified_as_its_lossy_copy() {
        let c = Classifier::new(100, DEFAULT_MAX_TEXT_BYTES);
        let mut m = Memo::default();
        // LATIN1 bytes: in a literal, in an identifier, in a tag.
        for (latin1, lossy) in [
            (
                &b"select * from t where s = 'caf\xe9'"[..],
                "select * from t where s = 'caf\u{fffd}'",
            ),
            (b"select caf\xe9 from t", "select caf\u{fffd} from t"),
            (
                b"/*service:caf\xe9*/ set role x",
                "/*service:caf\u{fffd}*/ set role x",
            ),
        ] {
            let got = c.classify_memo(latin1, &mut m);
            // Never proven: the lossy copy may read other than Postgres reads the bytes.
            assert_eq!(
                *got,
                fingerprint::analyze_text(lossy, false, DEFAULT_MAX_TEXT_BYTES),
                "{lossy}"
            );
            assert!(got.effects.contains(&SessionEffect::Unknown));
            // Again, now from the memo or the cache: the same answer.
            assert!(Arc::ptr_eq(&got, &c.classify_memo(latin1, &mut m)));
        }
        // A byte outside a literal is part of the key: another byte is another entry.
        let a = c.classify_memo(b"select caf\xe9 from t", &mut m);
        let b = c.classify_memo(b"select caf\xe8 from t", &mut m);
        assert!(!Arc::ptr_eq(&a, &b));
    }

    #[test]
    fn cache_is_bounded_and_oversized_not_cached() {
        let c = Classifier::new(50, 1024);
        for i in 0..1000 {
            c.classify(&format!("select {i} from t{i}"));
        }
        assert!(c.cached() <= 60, "{}", c.cached());
        let big = format!(
            "select * from t where id in ({})",
            vec!["1"; 2000].join(",")
        );
        let before = c.cached();
        let r = c.classify(&big);
        assert!(r.oversized);
        assert!(c.cached() <= before);
        let off = Classifier::new(0, 1024);
        assert_eq!(off.classify("select 1").kind, StmtKind::Read);
        assert_eq!(off.cached(), 0);
    }

    /// Texts that share a shape key must get exactly the classification they would get on
    /// their own: the cached answer for one literal variant is checked against a fresh
    /// analysis of another, over statements whose kind, effects and tags all matter.
    #[test]
    fn a_shared_shape_gives_each_text_its_own_classification() {
        let templates = [
            "SELECT abalance FROM pgbench_accounts WHERE aid = {n};",
            "/*service:billing*/ UPDATE t SET v = {s} WHERE id = {n}",
            "SELECT * FROM users WHERE id = {n} AND status = {s} /*application='x',route='%2Fa'*/",
            "SET search_path = {s}",
            "SET statement_timeout = {n}",
            "SELECT set_config({s}, {s}, false)",
            "SELECT set_config({s}, {s}, true)",
            "SELECT pg_advisory_lock({n})",
            "SELECT pg_advisory_xact_lock({n})",
            "INSERT INTO t VALUES ({n}, {s}), ({n}, {s})",
            "SELECT {n} -- trailing {n}\nFROM t",
            "SELECT \"c{n}\" FROM t WHERE x IN ({n}, {n}, {n}) LIMIT {n}",
            "BEGIN; SELECT {n}; COMMIT",
            "WITH d AS (DELETE FROM t WHERE id = {n} RETURNING *) SELECT * FROM d",
            "SELECT * FROM t WHERE a = {s} FOR UPDATE",
            "LISTEN c{n}",
            "CREATE TEMP TABLE x{n} AS SELECT {n}",
        ];
        let fill =
            |t: &str, n: &str, s: &str| t.replace("{n}", n).replace("{s}", s).replace("\\n", "\n");
        let c = Classifier::new(1000, DEFAULT_MAX_TEXT_BYTES);
        for t in templates {
            let first = fill(t, "1", "'a'");
            let cached_first = c.classify(&first);
            assert_eq!(
                *cached_first,
                analyze(&first, DEFAULT_MAX_TEXT_BYTES),
                "{first}"
            );
            for (n, s) in [("987654", "'it''s'"), ("0", "''"), ("42", "'--/*'")] {
                let other = fill(t, n, s);
                assert_eq!(
                    *c.classify(&other),
                    analyze(&other, DEFAULT_MAX_TEXT_BYTES),
                    "{other}"
                );
            }
        }
    }

    #[test]
    fn concurrent_use() {
        let c = Arc::new(Classifier::new(1000, DEFAULT_MAX_TEXT_BYTES));
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let c = Arc::clone(&c);
                std::thread::spawn(move || {
                    (0..500)
                        .map(|i| {
                            c.classify(&format!("select {} from x", i % 50 + t))
                                .fingerprint
                        })
                        .collect::<std::collections::HashSet<_>>()
                })
            })
            .collect();
        for h in handles {
            let fps = h.join().unwrap_or_default();
            assert_eq!(fps.len(), 1);
        }
    }
}
