//! Answers of `auth.auth_query` by user name (see `session::auth_query`): when each was
//! read and the verifier it gave (`None`: no such user), bounded, with separate lifetimes for
//! the two kinds of answer. Data only: the lookup itself lives with the sessions.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::Verifier;

/// Most names whose answers are kept.
pub const MAX_CACHED: usize = 10_000;

/// Answers by user name: when they were read, and the verifier (`None`: no such user).
#[derive(Default)]
pub struct AuthCache {
    map: Mutex<HashMap<String, (Instant, Option<Verifier>)>>,
}

impl AuthCache {
    /// A fresh answer for `user` (`ttl` for a verifier, `negative_ttl` for none).
    pub fn get(
        &self,
        user: &str,
        ttl: Duration,
        negative_ttl: Duration,
    ) -> Option<Option<Verifier>> {
        let map = self.map.lock();
        let (at, v) = map.get(user)?;
        let ttl = if v.is_some() { ttl } else { negative_ttl };
        (at.elapsed() < ttl).then(|| v.clone())
    }

    /// Keeps an answer; when full, stale ones make room, else it is not kept.
    pub fn put(&self, user: &str, v: Option<Verifier>, ttl: Duration) {
        let mut map = self.map.lock();
        if map.len() >= MAX_CACHED && !map.contains_key(user) {
            map.retain(|_, (at, _)| at.elapsed() < ttl);
            if map.len() >= MAX_CACHED {
                return;
            }
        }
        map.insert(user.to_owned(), (Instant::now(), v));
    }

    /// Forgets every answer (a reload may point the query elsewhere).
    pub fn clear(&self) {
        self.map.lock().clear();
    }
}
