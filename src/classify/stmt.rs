//! One statement of a normalized text: tokens `lo..hi` of the normalizer, and the small
//! lookups every statement reader needs (`kind`, `effects` and `calls` read through it).

use super::normalize::{Class, Normalizer};

/// One statement: tokens `lo..hi` of the normalizer.
pub(super) struct Stmt<'a> {
    pub(super) n: &'a Normalizer,
    pub(super) lo: usize,
    pub(super) hi: usize,
}

impl Stmt<'_> {
    pub(super) fn word(&self, i: usize) -> Option<&str> {
        if i < self.hi { self.n.word(i) } else { None }
    }

    pub(super) fn is(&self, i: usize, w: &str) -> bool {
        self.word(i) == Some(w)
    }

    pub(super) fn class(&self, i: usize) -> Option<Class> {
        if i < self.hi { self.n.class(i) } else { None }
    }

    /// First word at nesting depth 0 (relative to `from`) that is in `words`.
    pub(super) fn first_at_depth0(&self, from: usize, words: &[&str]) -> Option<(usize, &str)> {
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
