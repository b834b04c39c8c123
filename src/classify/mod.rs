//! classify: what a statement is and who sent it.
//!
//! Owns the per-statement analysis that policy and observability key on: the fingerprint
//! (`fingerprint.rs`, lexing via sqlparser's tokenizer or `scan.rs`, shaping in
//! `normalize.rs`), the statement kind (`kind.rs`), session effects (`effects.rs`), comment
//! tags (`tags.rs`) and caller resolution (`caller.rs`). It knows nothing of sockets, sessions,
//! config files or policy, and imports no other pgsluice module.
//!
//! `Classifier` caches one `Arc<Classified>` per distinct statement text:
//! - The cache key is the exact text itself (`Box<str>`), looked up with `&str`. quick_cache
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
pub mod effects;
pub mod fingerprint;
pub mod kind;
mod normalize;
mod scan;
pub mod tags;

pub use caller::{CallerId, CallerMatcher, CallerRule, Cidr, CidrError, DEFAULT_CALLER_NAME};
pub use effects::SessionEffect;
pub use fingerprint::{
    DEFAULT_MAX_TEXT_BYTES, analyze, fingerprint, fingerprint_hex, parse_fingerprint_hex,
};
pub use kind::StmtKind;
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
}

impl Classified {
    /// Any effect that outlives the transaction.
    pub fn has_session_effects(&self) -> bool {
        self.effects.iter().any(SessionEffect::is_session_level)
    }
}

#[derive(Clone)]
struct EntryWeight;

impl Weighter<Box<str>, Arc<Classified>> for EntryWeight {
    fn weight(&self, key: &Box<str>, val: &Arc<Classified>) -> u64 {
        1 + (key.len() + val.normalized.len()) as u64 / 1024
    }
}

/// Cached classification of statement texts. Cheap to share behind an `Arc`.
pub struct Classifier {
    cache: Option<Cache<Box<str>, Arc<Classified>, EntryWeight>>,
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
        let cacheable = sql.len() <= self.max_text_bytes;
        if let (Some(cache), true) = (&self.cache, cacheable)
            && let Some(hit) = cache.get(sql)
        {
            return hit;
        }
        let classified = Arc::new(analyze(sql, self.max_text_bytes));
        if let (Some(cache), true) = (&self.cache, cacheable) {
            cache.insert(Box::from(sql), Arc::clone(&classified));
        }
        classified
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
        let d = c.classify("select 2");
        assert!(!Arc::ptr_eq(&a, &d));
        assert_eq!(a.fingerprint, d.fingerprint);
        assert_eq!(c.cached(), 2);
        let set = c.classify("set role admin");
        assert!(set.has_session_effects());
        assert!(!a.has_session_effects());
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
