//! Per-backend cache of protocol-level prepared statements under proxy-chosen names.
//!
//! A statement is identified by the xxh3 hash of its (SQL, parameter types), seeded per
//! process; its name on the server is `_pgsl_<hash>`, so clients that prepare the same text
//! share one server statement. The hash only names the statement: each entry keeps its text,
//! and a lookup whose text differs is a collision, never a hit (the session closes the other
//! statement and prepares its own), so no client can run another text under a shared name.
//! Bounded in count and in bytes of text (`pool.prepared_cache_size`,
//! `pool.prepared_cache_bytes`): the least recently used entries are evicted (the session
//! closes them on the server, which frees their plans there too). A statement larger than the
//! byte budget on its own is kept alone until the next one.

use foldhash::{HashMap, HashMapExt};

/// Server-side name for a statement hash.
pub fn server_name(hash: u64) -> [u8; 22] {
    let mut out = *b"_pgsl_0000000000000000";
    // 8 bytes into 16 characters: the lengths always match.
    let _ = hex::encode_to_slice(hash.to_be_bytes(), &mut out[6..]);
    out
}

/// A statement prepared on this connection: its last use and its text.
struct Entry {
    tick: u64,
    /// SQL, a NUL, then the parameter-type bytes of the Parse.
    text: Box<[u8]>,
}

impl Entry {
    fn is(&self, query: &[u8], types: &[u8]) -> bool {
        self.text.len() == query.len() + 1 + types.len()
            && self.text[..query.len()] == *query
            && self.text[query.len()] == 0
            && self.text[query.len() + 1..] == *types
    }
}

/// What the cache knows of a statement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Prepared here with this text.
    Hit,
    /// Not prepared here.
    Miss,
    /// Another text is prepared under this name: close it before preparing this one.
    Collision,
}

pub struct PreparedCache {
    cap: usize,
    max_bytes: usize,
    /// Bytes of text held (SQL and parameter types of every entry).
    bytes: usize,
    tick: u64,
    map: HashMap<u64, Entry>,
}

impl PreparedCache {
    /// At most `cap` statements and `max_bytes` of their text.
    pub fn new(cap: usize, max_bytes: usize) -> Self {
        PreparedCache {
            cap: cap.max(1),
            max_bytes: max_bytes.max(1),
            bytes: 0,
            tick: 0,
            map: HashMap::new(),
        }
    }

    /// Bytes of statement text held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether statement `hash` with this text exists here (a hit marks it used). A
    /// collision forgets the other statement: the caller must close it on the server.
    pub fn touch(&mut self, hash: u64, query: &[u8], types: &[u8]) -> Lookup {
        self.tick += 1;
        match self.map.get_mut(&hash) {
            Some(e) if e.is(query, types) => {
                e.tick = self.tick;
                Lookup::Hit
            }
            Some(_) => {
                self.remove(hash);
                Lookup::Collision
            }
            None => Lookup::Miss,
        }
    }

    /// Records a statement; returns the hashes evicted to make room (least recently used
    /// first), which the caller closes on the server.
    pub fn insert(&mut self, hash: u64, query: &[u8], types: &[u8]) -> Vec<u64> {
        self.tick += 1;
        self.remove(hash);
        let size = query.len() + 1 + types.len();
        let mut evicted = Vec::new();
        while !self.map.is_empty()
            && (self.map.len() >= self.cap || self.bytes + size > self.max_bytes)
            && let Some((&old, _)) = self.map.iter().min_by_key(|(_, e)| e.tick)
        {
            self.remove(old);
            evicted.push(old);
        }
        let mut text = Vec::with_capacity(size);
        text.extend_from_slice(query);
        text.push(0);
        text.extend_from_slice(types);
        self.bytes += size;
        self.map.insert(
            hash,
            Entry {
                tick: self.tick,
                text: text.into_boxed_slice(),
            },
        );
        evicted
    }

    pub fn remove(&mut self, hash: u64) {
        if let Some(e) = self.map.remove(&hash) {
            self.bytes -= e.text.len();
        }
    }

    pub fn clear(&mut self) {
        self.map.clear();
        self.bytes = 0;
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
        let mut c = PreparedCache::new(2, 1 << 20);
        let q = |h: u64| format!("select {h}");
        assert!(c.insert(1, q(1).as_bytes(), b"").is_empty());
        assert!(c.insert(2, q(2).as_bytes(), b"").is_empty());
        assert_eq!(c.touch(1, q(1).as_bytes(), b""), Lookup::Hit);
        assert_eq!(c.insert(3, q(3).as_bytes(), b""), vec![2]);
        assert_eq!(c.touch(1, q(1).as_bytes(), b""), Lookup::Hit);
        assert_eq!(c.touch(3, q(3).as_bytes(), b""), Lookup::Hit);
        assert_eq!(c.touch(2, q(2).as_bytes(), b""), Lookup::Miss);
        assert_eq!(c.len(), 2);
    }

    /// Two texts under one hash (a collision, crafted or not) never share a statement.
    #[test]
    fn a_hash_collision_is_never_a_hit() {
        let mut c = PreparedCache::new(8, 1 << 20);
        c.insert(7, b"select 1", b"\0\0");
        assert_eq!(c.touch(7, b"select 1", b"\0\0"), Lookup::Hit);
        assert_eq!(c.touch(7, b"set role admin", b"\0\0"), Lookup::Collision);
        // The other statement is forgotten: the caller closes and re-prepares.
        assert_eq!(c.touch(7, b"select 1", b"\0\0"), Lookup::Miss);
        c.insert(7, b"select 1", b"\0\0");
        // Same SQL with other parameter types is another statement too.
        assert_eq!(
            c.touch(7, b"select 1", b"\0\x01\0\0\0\x17"),
            Lookup::Collision
        );
        // A text that is a prefix of the stored one is not it.
        c.insert(9, b"select 12", b"");
        assert_eq!(c.touch(9, b"select 1", b"2"), Lookup::Collision);
    }

    /// Texts count in bytes: large statements evict older ones before the count is reached,
    /// and one larger than the whole budget is kept alone.
    #[test]
    fn the_byte_budget_evicts_least_recently_used() {
        let mut c = PreparedCache::new(100, 1000);
        let big = vec![b'x'; 400];
        assert!(c.insert(1, &big, b"").is_empty());
        assert!(c.insert(2, &big, b"").is_empty());
        assert_eq!(c.bytes(), 802);
        assert_eq!(c.insert(3, &big, b""), vec![1]);
        assert_eq!(c.bytes(), 802);
        let huge = vec![b'y'; 5000];
        let mut gone = c.insert(4, &huge, b"");
        gone.sort_unstable();
        assert_eq!(gone, vec![2, 3]);
        assert_eq!((c.len(), c.bytes()), (1, 5001));
        assert_eq!(c.insert(5, b"select 1", b""), vec![4]);
        // Re-inserting a hash replaces its bytes, never counts them twice.
        c.insert(5, b"select 1", b"");
        assert_eq!(c.bytes(), 9);
        c.remove(5);
        assert_eq!((c.len(), c.bytes()), (0, 0));
    }

    #[test]
    fn names_are_stable_hex() {
        assert_eq!(&server_name(0xabc), b"_pgsl_0000000000000abc");
    }
}
