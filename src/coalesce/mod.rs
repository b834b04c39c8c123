//! Identical reads sharing one execution (a `COALESCE` rule on their pattern).
//!
//! Owns the table of reads in flight. The first client to run a read becomes its *leader*: it
//! runs the read as usual and records what the client is sent for it (row description, data
//! rows, command tag — everything before the ReadyForQuery), up to the rule's
//! `max_result_bytes`. A client that arrives with the same read while it runs becomes a
//! *follower*: it borrows no backend and waits, up to the rule's `max_wait_ms`, for the
//! leader's bytes, which it is sent as they are, followed by its own ReadyForQuery.
//!
//! Same read means the same pool (database and server user, primary or replica), the same
//! session settings (all but `application_name`, which no shareable read can see) and the same
//! text byte for byte — for an extended batch, the bytes [`batch::Batch::key`] makes of its
//! text, parameter types, values and formats. Whether a text may be shared at all is decided
//! once per pattern by a real parse ([`pure::shareable`]); the session also requires a read
//! that opens a unit outside a transaction, with nothing else in flight
//! (`session::relay::shared`).
//!
//! A follower falls back to running the read itself, never gets someone else's error: when
//! the result is larger than the bound, when the leader's read failed (each client then gets
//! its own answer from Postgres), or when its wait runs out. When the leader goes away
//! before it finished (its client left, its statement was refused), the waiting followers
//! join again: one of them leads the next run.
//!
//! What a follower sees may predate its arrival by up to the leader's run time: the rule is
//! opt-in per pattern for reads that tolerate that (feature flags, configuration rows, a hot
//! profile page). It never predates the client's own previous unit: a run that started before
//! that ended is not joined (the client runs its read alone), so a client reads its own
//! writes and never goes back in time.

pub mod batch;
pub mod pure;

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::protocol::params::Shared;

/// Most patterns whose verdict is remembered (then the memory starts over).
const MAX_VERDICTS: usize = 10_000;

/// The bytes of one ReadyForQuery: `Z`, length 5, status.
const READY_LEN: usize = 6;

/// Which reads are the same.
#[derive(Debug, Clone)]
pub struct Key {
    /// The pool the read runs on (its address): database, server user, primary or replica.
    pub pool: usize,
    /// The client's session settings (`application_name` ignored).
    pub settings: Shared,
    /// The statement's text, byte for byte.
    pub text: Bytes,
}

fn keyed(s: &Shared) -> impl Iterator<Item = &(String, String)> {
    s.iter().filter(|(k, _)| k != "application_name")
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.pool == other.pool
            && self.text == other.text
            && (Arc::ptr_eq(&self.settings, &other.settings)
                || keyed(&self.settings).eq(keyed(&other.settings)))
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.pool.hash(h);
        self.text.hash(h);
        for kv in keyed(&self.settings) {
            kv.hash(h);
        }
    }
}

/// Where a shared run stands.
#[derive(Debug, Clone)]
enum State {
    Running,
    /// What the leader's client was sent before its ReadyForQuery.
    Done(Bytes),
    Failed(Fallback),
}

/// Why a follower runs the read itself (or joins again).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// The result was larger than `max_result_bytes`.
    TooLarge,
    /// The leader's read got an error: each client gets its own answer.
    Error,
    /// The follower's `max_wait_ms` ran out.
    Timeout,
    /// The leader went away before it finished: join again.
    Gone,
}

impl Fallback {
    pub const ALL: [Fallback; 4] = [
        Fallback::TooLarge,
        Fallback::Error,
        Fallback::Timeout,
        Fallback::Gone,
    ];

    /// Metric label.
    pub fn name(self) -> &'static str {
        match self {
            Fallback::TooLarge => "too_large",
            Fallback::Error => "error",
            Fallback::Timeout => "timeout",
            Fallback::Gone => "leader_gone",
        }
    }
}

/// Where a run publishes its end.
type Run = Arc<watch::Sender<State>>;

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct Counters {
    /// Reads run by a leader for others to share.
    pub led: AtomicU64,
    /// Reads answered from a leader's result: executions saved.
    pub shared: AtomicU64,
    /// Followers that ran the read themselves, by [`Fallback`].
    pub fallbacks: [AtomicU64; 4],
}

/// The table of shared reads in flight, and which patterns may be shared.
#[derive(Debug, Default)]
pub struct Coalescer {
    /// Runs in flight, with when each started.
    flights: Mutex<HashMap<Key, (Run, Instant)>>,
    verdicts: Mutex<HashMap<u64, Result<(), &'static str>>>,
    pub counters: Counters,
}

/// What joining gave.
pub enum Joined {
    /// Run the read and record its result ([`Lead::capture`], [`Lead::seen`]).
    Lead(Lead),
    /// Wait for the leader's result ([`Follower::wait`]).
    Follow(Follower),
}

impl Coalescer {
    /// Whether texts of this pattern may be shared ([`pure::shareable`]), decided once per
    /// fingerprint.
    pub fn shareable(&self, fingerprint: u64, text: &str) -> Result<(), &'static str> {
        if let Some(v) = self.verdicts.lock().get(&fingerprint) {
            return *v;
        }
        let v = pure::shareable(text);
        let mut m = self.verdicts.lock();
        if m.len() >= MAX_VERDICTS {
            m.clear();
        }
        m.insert(fingerprint, v);
        v
    }

    /// Joins the run of this read in flight, or starts one. `seen_until`: when the client's
    /// last unit ended — a run that started before then may not show what that unit did, so
    /// the client runs its own read (`None`: not shared).
    pub fn join(
        self: &Arc<Self>,
        key: Key,
        max_result_bytes: usize,
        seen_until: Option<Instant>,
    ) -> Option<Joined> {
        let mut flights = self.flights.lock();
        if let Some((tx, started)) = flights.get(&key) {
            if seen_until.is_some_and(|t| *started < t) {
                return None;
            }
            return Some(Joined::Follow(Follower {
                rx: tx.subscribe(),
                coalescer: Arc::clone(self),
            }));
        }
        let tx = Arc::new(watch::Sender::new(State::Running));
        flights.insert(key.clone(), (Arc::clone(&tx), Instant::now()));
        drop(flights);
        self.counters.led.fetch_add(1, Ordering::Relaxed);
        Some(Joined::Lead(Lead {
            coalescer: Arc::clone(self),
            key,
            tx,
            buf: BytesMut::new(),
            limit: max_result_bytes.saturating_add(READY_LEN),
            failed: None,
            ended: false,
        }))
    }

    /// Reads in flight now.
    pub fn in_flight(&self) -> usize {
        self.flights.lock().len()
    }

    fn end(&self, key: &Key, tx: &Run, state: State) {
        {
            let mut flights = self.flights.lock();
            if flights.get(key).is_some_and(|(t, _)| Arc::ptr_eq(t, tx)) {
                flights.remove(key);
            }
        }
        tx.send_replace(state);
    }

    fn fell_back(&self, why: Fallback) {
        self.counters.fallbacks[why as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// A leader's run: what its client is sent, recorded until its ReadyForQuery. Dropped before
/// it finished, the followers join again.
pub struct Lead {
    coalescer: Arc<Coalescer>,
    key: Key,
    tx: Run,
    buf: BytesMut,
    limit: usize,
    failed: Option<Fallback>,
    /// The run's end was published.
    ended: bool,
}

impl Lead {
    /// Bytes written for the client since the last call.
    #[inline]
    pub fn capture(&mut self, bytes: &[u8]) {
        if bytes.is_empty() || self.failed.is_some() {
            return;
        }
        if self.buf.len() + bytes.len() > self.limit {
            self.failed = Some(Fallback::TooLarge);
            self.buf = BytesMut::new();
            return;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// A backend message the relay acted on: an error fails the run; the first
    /// ReadyForQuery ends it. `true`: the run is over (drop the lead).
    pub fn seen(&mut self, errored: bool, ready: bool) -> bool {
        if errored && self.failed.is_none() {
            self.failed = Some(Fallback::Error);
        }
        if !ready {
            return false;
        }
        let state = match self.failed {
            Some(f) => State::Failed(f),
            None => {
                let len = self.buf.len();
                if len >= READY_LEN && self.buf[len - READY_LEN] == b'Z' {
                    self.buf.truncate(len - READY_LEN);
                    State::Done(std::mem::take(&mut self.buf).freeze())
                } else {
                    State::Failed(Fallback::Error)
                }
            }
        };
        self.ended = true;
        self.coalescer.end(&self.key, &self.tx, state);
        true
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        if !self.ended {
            self.coalescer
                .end(&self.key, &self.tx, State::Failed(Fallback::Gone));
        }
    }
}

/// A follower waiting for a leader's result.
pub struct Follower {
    rx: watch::Receiver<State>,
    coalescer: Arc<Coalescer>,
}

impl Follower {
    /// The leader's bytes (everything before its ReadyForQuery), or why not, within `max_wait`.
    pub async fn wait(mut self, max_wait: Duration) -> Result<Bytes, Fallback> {
        let r = tokio::time::timeout(max_wait, self.rx.wait_for(|s| !matches!(s, State::Running)))
            .await;
        let out = match r {
            Err(_) => Err(Fallback::Timeout),
            Ok(Err(_)) => Err(Fallback::Gone),
            Ok(Ok(s)) => match &*s {
                State::Done(b) => Ok(b.clone()),
                State::Failed(f) => Err(*f),
                State::Running => Err(Fallback::Gone),
            },
        };
        match &out {
            Ok(_) => {
                self.coalescer
                    .counters
                    .shared
                    .fetch_add(1, Ordering::Relaxed);
            }
            Err(f) => self.coalescer.fell_back(*f),
        }
        out
    }
}

#[cfg(test)]
mod tests;
