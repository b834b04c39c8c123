//! Per-backend cache of protocol-level prepared statements under proxy-chosen names.
//!
//! A statement is identified by the xxh3 hash of its (SQL, parameter types); its name on the
//! server is `_pgsl_<hash>`, so clients that prepare the same text share one server statement.
//! Bounded: the least recently used entry is evicted (the session closes it on the server).

use std::collections::HashMap;

/// Server-side name for a statement hash.
pub fn server_name(hash: u64) -> [u8; 22] {
    let mut out = *b"_pgsl_0000000000000000";
    let hex = b"0123456789abcdef";
    for i in 0..16 {
        out[6 + i] = hex[((hash >> (60 - 4 * i)) & 0xf) as usize];
    }
    out
}

pub struct PreparedCache {
    cap: usize,
    tick: u64,
    /// hash → last use
    map: HashMap<u64, u64>,
}

impl PreparedCache {
    pub fn new(cap: usize) -> Self {
        PreparedCache {
            cap: cap.max(1),
            tick: 0,
            map: HashMap::new(),
        }
    }

    /// True (and marks it used) when the statement exists on this connection.
    pub fn touch(&mut self, hash: u64) -> bool {
        self.tick += 1;
        match self.map.get_mut(&hash) {
            Some(t) => {
                *t = self.tick;
                true
            }
            None => false,
        }
    }

    /// Records a statement; returns the hash evicted to make room, if any.
    pub fn insert(&mut self, hash: u64) -> Option<u64> {
        self.tick += 1;
        let mut evicted = None;
        if !self.map.contains_key(&hash)
            && self.map.len() >= self.cap
            && let Some((&old, _)) = self.map.iter().min_by_key(|(_, t)| **t)
        {
            self.map.remove(&old);
            evicted = Some(old);
        }
        self.map.insert(hash, self.tick);
        evicted
    }

    pub fn remove(&mut self, hash: u64) {
        self.map.remove(&hash);
    }

    pub fn clear(&mut self) {
        self.map.clear();
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used() {
        let mut c = PreparedCache::new(2);
        assert_eq!(c.insert(1), None);
        assert_eq!(c.insert(2), None);
        assert!(c.touch(1));
        assert_eq!(c.insert(3), Some(2));
        assert!(c.touch(1) && c.touch(3) && !c.touch(2));
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn names_are_stable_hex() {
        assert_eq!(&server_name(0xabc), b"_pgsl_0000000000000abc");
    }
}
