//! Fleet-scoped rate limits on the hot path (issue 10): tokens leased in small batches from a
//! bucket shared by every instance, so that a statement never waits on the shared store.
//!
//! Owns [`FleetGate`] (how many instances are live, whether leases can be had at all, and the
//! registry of leased buckets the lease filler walks) and [`LeasedBucket`] (one rate limit
//! marked `scope: fleet`: a count of leased tokens with an expiry, plus the local fallback).
//! It does not talk to Redis: the fleet module reads [`LeasedBucket::wants`], asks the shared
//! GCRA bucket for that many tokens and hands back what it got with [`LeasedBucket::grant`].
//!
//! Accuracy. The shared bucket admits at most `rate·t + burst` tokens over any window `t`,
//! fleet-wide; a token leased to an instance is either used within [`LEASE_TTL`] or lost, so
//! leasing can only make the fleet admit *fewer* statements than the limit, never more. The
//! loss is bounded by what the instances hold: about [`LEASE_HORIZON`] of each instance's
//! share of the rate (at least one token each).
//!
//! Degradation. While leases cannot be had (the store is down or not yet reached) every
//! fleet bucket enforces a local share, `rate / live instances` with `burst / live instances`
//! (at least 1), from the last membership the instance knew. Without a fleet at all the gate
//! stays in that mode with one member, i.e. a `scope: fleet` limit is an ordinary local one.
//!
//! A statement that finds the lease empty while the shared bucket is not known to be empty
//! (typically the first one after a quiet spell, when idle leases have run out) waits up to
//! [`LEASE_WAIT`] for the filler's next grant instead of being refused; once the shared bucket
//! said "empty until T", statements are refused at once until T. So the hot path waits on
//! Redis at most once per lease, never per statement.
//!
//! A leased token cannot be reserved ahead as the local bucket's tokens can, so a THROTTLE
//! rule with `action_on_exceed: QUEUE` and `scope: fleet` waits differently: the statement
//! sleeps until the shared bucket has a token due, then for the grant, up to the caller's queue
//! timeout ([`LeasedBucket::wait_for_token`]), and competes with the other waiters of its
//! instance for what arrives.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::bucket::{TokenBucket, nanos};

/// How long leased tokens stay usable.
pub const LEASE_TTL: Duration = Duration::from_secs(1);
/// A lease aims at this much of the instance's share of the rate.
pub const LEASE_HORIZON: Duration = Duration::from_millis(100);
/// A bucket not asked for a token this long gets no new leases (its old ones run out).
pub const IDLE_AFTER: Duration = Duration::from_secs(2);
/// How long a new bucket is topped up before any statement asked for it.
const FIRST_LEASE_WINDOW: Duration = Duration::from_millis(100);
/// Longest wait for a lease when this instance holds no token but the shared bucket may have
/// some (the first statement after a quiet spell): about one Redis round trip is typical.
pub const LEASE_WAIT: Duration = Duration::from_millis(25);

/// Shared by the policy (hot path) and the fleet task (filler).
#[derive(Debug)]
pub struct FleetGate {
    members: AtomicU32,
    leasing: AtomicBool,
    /// Woken when a leased bucket runs low or empty.
    wake: Notify,
    buckets: Mutex<Vec<Weak<LeasedBucket>>>,
    base: Instant,
}

impl Default for FleetGate {
    fn default() -> Self {
        Self {
            members: AtomicU32::new(1),
            leasing: AtomicBool::new(false),
            wake: Notify::new(),
            buckets: Mutex::new(Vec::new()),
            base: Instant::now(),
        }
    }
}

impl FleetGate {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Live instances, at least 1.
    pub fn members(&self) -> u32 {
        self.members.load(Ordering::Relaxed).max(1)
    }

    pub fn set_members(&self, n: u32) {
        self.members.store(n.max(1), Ordering::Relaxed);
    }

    /// Whether fleet buckets take leased tokens (true) or their local share (false).
    pub fn leasing(&self) -> bool {
        self.leasing.load(Ordering::Acquire)
    }

    /// Switch between leases and local shares. Leases held so far stay valid until they
    /// expire only while leasing; switching off drops them so the share applies at once.
    pub fn set_leasing(&self, on: bool) {
        if !on {
            for b in self.buckets() {
                b.tokens.store(0, Ordering::Release);
            }
        }
        self.leasing.store(on, Ordering::Release);
    }

    /// Resolves when some bucket asked for tokens (or at once if one asked since last time).
    pub async fn wanted(&self) {
        self.wake.notified().await;
    }

    /// A new fleet bucket, registered with the filler. `key` names the shared bucket: the
    /// same key on every instance means one limit for all of them.
    pub fn bucket(self: &Arc<Self>, key: String, rate: f64, burst: u32) -> Arc<LeasedBucket> {
        let local = TokenBucket::new(rate, burst, Instant::now());
        let (rate, burst) = (local.rate(), local.burst());
        let members = self.members();
        let b = Arc::new(LeasedBucket {
            key,
            rate,
            burst,
            gate: Arc::clone(self),
            tokens: AtomicU32::new(0),
            lease_until_ns: AtomicU64::new(0),
            // A new bucket counts as wanted for a moment, so its first lease is fetched
            // before the first statement asks (and one unused lease is all it costs).
            wanted_until_ns: AtomicU64::new(
                self.now_ns(Instant::now())
                    .saturating_add(nanos(FIRST_LEASE_WINDOW)),
            ),
            next_try_ns: AtomicU64::new(0),
            local: Mutex::new((members, Arc::new(share(rate, burst, members)))),
            granted: Notify::new(),
        });
        let mut list = self.buckets.lock();
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(&b));
        drop(list);
        self.wake.notify_one();
        b
    }

    /// Live fleet buckets (dropped ones are pruned).
    pub fn buckets(&self) -> Vec<Arc<LeasedBucket>> {
        let mut list = self.buckets.lock();
        list.retain(|w| w.strong_count() > 0);
        list.iter().filter_map(Weak::upgrade).collect()
    }

    fn now_ns(&self, now: Instant) -> u64 {
        nanos(now.saturating_duration_since(self.base))
    }
}

/// A local bucket for `members` instances' worth of a fleet limit.
fn share(rate: f64, burst: u32, members: u32) -> TokenBucket {
    let m = members.max(1);
    TokenBucket::new(rate / f64::from(m), (burst / m).max(1), Instant::now())
}

/// One fleet-scoped limit on this instance.
#[derive(Debug)]
pub struct LeasedBucket {
    key: String,
    rate: f64,
    burst: u32,
    gate: Arc<FleetGate>,
    /// Leased tokens left (valid until `lease_until_ns`).
    tokens: AtomicU32,
    lease_until_ns: AtomicU64,
    /// The filler tops the lease up until then: [`IDLE_AFTER`] past the last statement.
    wanted_until_ns: AtomicU64,
    /// The shared bucket said "empty until then": the filler does not ask before.
    next_try_ns: AtomicU64,
    /// The local share and the member count it was built for.
    local: Mutex<(u32, Arc<TokenBucket>)>,
    /// Woken by every grant (also an empty one).
    granted: Notify,
}

impl LeasedBucket {
    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn rate(&self) -> f64 {
        self.rate
    }

    pub fn burst(&self) -> u32 {
        self.burst
    }

    /// Take one token now or say how long until one may be there.
    pub fn try_take(&self, now: Instant) -> Result<(), Duration> {
        if !self.gate.leasing() {
            return self.local().try_take(now);
        }
        let now_ns = self.gate.now_ns(now);
        // Renewed when half of it is used up: a load, not a shared write, per statement.
        let until = now_ns.saturating_add(nanos(IDLE_AFTER));
        if until.saturating_sub(self.wanted_until_ns.load(Ordering::Relaxed))
            > nanos(IDLE_AFTER) / 2
        {
            self.wanted_until_ns.store(until, Ordering::Relaxed);
        }
        if now_ns < self.lease_until_ns.load(Ordering::Acquire) {
            let taken = self
                .tokens
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| t.checked_sub(1));
            if let Ok(before) = taken {
                if before <= self.low_water() {
                    self.gate.wake.notify_one();
                }
                return Ok(());
            }
        }
        self.gate.wake.notify_one();
        Err(self.retry_hint())
    }

    /// As [`TokenBucket::reserve`] for the local share; a leased token is taken now or not at
    /// all (see the module doc).
    pub fn reserve(&self, now: Instant, max_wait: Duration) -> Result<Duration, Duration> {
        if !self.gate.leasing() {
            return self.local().reserve(now, max_wait);
        }
        self.try_take(now).map(|()| Duration::ZERO)
    }

    /// For the filler: how many tokens to ask the shared bucket for now, if any.
    pub fn wants(&self, now: Instant) -> Option<u32> {
        let now_ns = self.gate.now_ns(now);
        if now_ns < self.next_try_ns.load(Ordering::Relaxed) {
            return None;
        }
        if now_ns > self.wanted_until_ns.load(Ordering::Relaxed) {
            return None;
        }
        let have = if now_ns < self.lease_until_ns.load(Ordering::Acquire) {
            self.tokens.load(Ordering::Acquire)
        } else {
            0
        };
        let target = self.target();
        (have <= self.low_water()).then(|| target - have.min(target))
    }

    /// For the filler: the shared bucket granted `n` tokens (0: empty for `retry`).
    pub fn grant(&self, n: u32, retry: Duration, now: Instant) {
        let now_ns = self.gate.now_ns(now);
        if n == 0 {
            let next = now_ns.saturating_add(nanos(retry));
            self.next_try_ns.store(next, Ordering::Relaxed);
        } else {
            let valid = now_ns < self.lease_until_ns.load(Ordering::Acquire);
            if valid {
                self.tokens.fetch_add(n, Ordering::AcqRel);
            } else {
                self.tokens.store(n, Ordering::Release);
            }
            self.lease_until_ns
                .store(now_ns.saturating_add(nanos(LEASE_TTL)), Ordering::Release);
        }
        self.granted.notify_waiters();
    }

    /// Whether fleet buckets lease from the shared store now (false: local shares).
    pub fn leasing(&self) -> bool {
        self.gate.leasing()
    }

    /// Whether waiting for the filler may bring a token: leases are on and the shared bucket
    /// is not known to be empty.
    pub fn lease_may_come(&self, now: Instant) -> bool {
        self.gate.leasing() && self.gate.now_ns(now) >= self.next_try_ns.load(Ordering::Relaxed)
    }

    /// Waits (at most [`LEASE_WAIT`]) for the filler's next grant; returns at once if a token
    /// is already there.
    pub async fn wait_lease(&self, now: Instant) {
        self.wait_grant(now, LEASE_WAIT).await;
    }

    /// THROTTLE `QUEUE` with a fleet bucket: waits until a token is leased here or `deadline`
    /// passes. While the shared bucket is known empty it sleeps until a token is due there,
    /// then waits for the filler's grant; statements waiting on one instance compete for what
    /// it leases (no order across instances). Does not take the token.
    pub async fn wait_for_token(&self, deadline: Instant) {
        loop {
            let now = Instant::now();
            if self.leased(now) > 0 || now >= deadline || !self.gate.leasing() {
                return;
            }
            let due =
                self.gate.base + Duration::from_nanos(self.next_try_ns.load(Ordering::Relaxed));
            if due > now {
                tokio::time::sleep_until(due.min(deadline)).await;
                continue;
            }
            self.wait_grant(now, (deadline - now).min(LEASE_WAIT)).await;
        }
    }

    /// Marks demand, wakes the filler and waits up to `limit` for its next grant.
    async fn wait_grant(&self, now: Instant, limit: Duration) {
        let granted = self.granted.notified();
        tokio::pin!(granted);
        granted.as_mut().enable();
        if self.leased(now) > 0 {
            return;
        }
        self.wanted_until_ns.store(
            self.gate.now_ns(now).saturating_add(nanos(IDLE_AFTER)),
            Ordering::Relaxed,
        );
        self.gate.wake.notify_one();
        let _ = tokio::time::timeout(limit, granted).await;
    }

    /// Leased tokens usable now.
    pub fn leased(&self, now: Instant) -> u32 {
        if self.gate.now_ns(now) < self.lease_until_ns.load(Ordering::Acquire) {
            self.tokens.load(Ordering::Acquire)
        } else {
            0
        }
    }

    /// Tokens one lease aims at: [`LEASE_HORIZON`] of this instance's share, 1..=burst.
    pub fn target(&self) -> u32 {
        let share = self.rate * LEASE_HORIZON.as_secs_f64() / f64::from(self.gate.members());
        (share.ceil() as u32).clamp(1, self.burst.max(1))
    }

    fn low_water(&self) -> u32 {
        self.target() / 2
    }

    /// Roughly when this instance's share yields its next token.
    fn retry_hint(&self) -> Duration {
        let secs = f64::from(self.gate.members()) / self.rate;
        Duration::from_secs_f64(secs.clamp(0.001, 60.0))
    }

    fn local(&self) -> Arc<TokenBucket> {
        let members = self.gate.members();
        let mut local = self.local.lock();
        if local.0 != members {
            *local = (members, Arc::new(share(self.rate, self.burst, members)));
        }
        Arc::clone(&local.1)
    }
}

/// A rate limit as the policy applies it: local, or shared by the fleet.
#[derive(Debug)]
pub enum Rate {
    Local(TokenBucket),
    Fleet(Arc<LeasedBucket>),
}

impl Rate {
    pub fn try_take(&self, now: Instant) -> Result<(), Duration> {
        match self {
            Self::Local(b) => b.try_take(now),
            Self::Fleet(b) => b.try_take(now),
        }
    }

    /// As [`Rate::try_take`], but an empty lease that may be refilled is waited for (at most
    /// [`LEASE_WAIT`]) instead of refused.
    pub async fn take(&self, now: Instant) -> Result<(), Duration> {
        match self {
            Self::Local(b) => b.try_take(now),
            Self::Fleet(b) => match b.try_take(now) {
                Err(_) if b.lease_may_come(now) => {
                    Box::pin(b.wait_lease(now)).await;
                    b.try_take(Instant::now())
                }
                r => r,
            },
        }
    }

    pub fn reserve(&self, now: Instant, max_wait: Duration) -> Result<Duration, Duration> {
        match self {
            Self::Local(b) => b.reserve(now, max_wait),
            Self::Fleet(b) => b.reserve(now, max_wait),
        }
    }

    pub fn rate(&self) -> f64 {
        match self {
            Self::Local(b) => b.rate(),
            Self::Fleet(b) => b.rate(),
        }
    }

    pub fn burst(&self) -> u32 {
        match self {
            Self::Local(b) => b.burst(),
            Self::Fleet(b) => b.burst(),
        }
    }

    pub fn is_fleet(&self) -> bool {
        matches!(self, Self::Fleet(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn without_leasing_a_fleet_bucket_enforces_its_local_share() {
        let gate = FleetGate::new();
        gate.set_members(4);
        let b = gate.bucket("k".into(), 40.0, 40);
        let now = Instant::now();
        let ok = (0..100).filter(|_| b.try_take(now).is_ok()).count();
        assert_eq!(ok, 10, "burst 40 over 4 members");
        gate.set_members(1);
        let ok = (0..100).filter(|_| b.try_take(now).is_ok()).count();
        assert_eq!(ok, 40, "a new share for one member");
    }

    #[tokio::test(start_paused = true)]
    async fn leased_tokens_are_spent_then_expire_and_empty_asks_the_filler() {
        let gate = FleetGate::new();
        gate.set_members(2);
        gate.set_leasing(true);
        let b = gate.bucket("k".into(), 100.0, 100);
        let now = Instant::now();
        // 100/s · 100 ms / 2 members = 5 tokens per lease.
        assert_eq!(b.target(), 5);
        assert_eq!(b.wants(now), Some(5));
        assert!(b.try_take(now).is_err(), "nothing leased yet");
        b.grant(5, Duration::ZERO, now);
        assert_eq!(b.wants(now), None, "full lease");
        for _ in 0..5 {
            b.try_take(now).unwrap();
        }
        let hint = b.try_take(now).unwrap_err();
        assert_eq!(hint, Duration::from_millis(20));
        assert_eq!(b.wants(now), Some(5));
        b.grant(3, Duration::ZERO, now);
        tokio::time::advance(LEASE_TTL).await;
        assert!(b.try_take(Instant::now()).is_err(), "lease expired");
        assert_eq!(b.leased(Instant::now()), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn an_empty_shared_bucket_holds_the_filler_back_and_idle_buckets_get_nothing() {
        let gate = FleetGate::new();
        gate.set_leasing(true);
        let b = gate.bucket("k".into(), 10.0, 10);
        let now = Instant::now();
        b.grant(0, Duration::from_millis(80), now);
        assert_eq!(b.wants(now), None);
        tokio::time::advance(Duration::from_millis(80)).await;
        assert_eq!(b.wants(Instant::now()), Some(1));
        tokio::time::advance(IDLE_AFTER + Duration::from_millis(1)).await;
        assert_eq!(b.wants(Instant::now()), None, "nobody asked for 2 s");
        let _ = b.try_take(Instant::now());
        assert_eq!(b.wants(Instant::now()), Some(1));
        // Switching leases off drops what is held and falls back to the share.
        b.grant(1, Duration::ZERO, Instant::now());
        gate.set_leasing(false);
        assert_eq!(b.leased(Instant::now()), 0);
        assert!(
            b.try_take(Instant::now()).is_ok(),
            "local share has a burst"
        );
    }

    #[tokio::test]
    async fn an_empty_lease_is_waited_for_once_unless_the_shared_bucket_is_empty() {
        let gate = FleetGate::new();
        gate.set_leasing(true);
        let b = gate.bucket("k".into(), 10.0, 10);
        let rate = Rate::Fleet(Arc::clone(&b));
        // A filler that grants one token shortly after being woken.
        let filler = {
            let (gate, b) = (Arc::clone(&gate), Arc::clone(&b));
            tokio::spawn(async move {
                gate.wanted().await;
                tokio::time::sleep(Duration::from_millis(2)).await;
                b.grant(1, Duration::ZERO, Instant::now());
            })
        };
        let t = std::time::Instant::now();
        rate.take(Instant::now()).await.expect("the grant arrives");
        assert!(t.elapsed() < LEASE_WAIT, "{:?}", t.elapsed());
        filler.await.unwrap();
        // The shared bucket said empty for 80 ms: refused at once, no wait.
        b.grant(0, Duration::from_millis(80), Instant::now());
        let t = std::time::Instant::now();
        assert!(rate.take(Instant::now()).await.is_err());
        assert!(t.elapsed() < Duration::from_millis(5), "{:?}", t.elapsed());
        // Nobody grants: the wait is bounded.
        tokio::time::sleep(Duration::from_millis(80)).await;
        let t = std::time::Instant::now();
        assert!(rate.take(Instant::now()).await.is_err());
        let waited = t.elapsed();
        assert!(
            waited >= LEASE_WAIT && waited < LEASE_WAIT * 4,
            "{waited:?}"
        );
    }

    #[tokio::test]
    async fn queueing_sleeps_while_the_shared_bucket_is_empty_then_takes_the_grant() {
        let gate = FleetGate::new();
        gate.set_leasing(true);
        let b = gate.bucket("k".into(), 10.0, 1);
        b.grant(0, Duration::from_millis(60), Instant::now());
        let filler = {
            let (gate, b) = (Arc::clone(&gate), Arc::clone(&b));
            tokio::spawn(async move {
                loop {
                    gate.wanted().await;
                    if b.wants(Instant::now()).is_some() {
                        b.grant(1, Duration::ZERO, Instant::now());
                        return;
                    }
                }
            })
        };
        let t = std::time::Instant::now();
        b.wait_for_token(Instant::now() + Duration::from_millis(500))
            .await;
        let waited = t.elapsed();
        assert_eq!(b.leased(Instant::now()), 1);
        assert!(
            waited >= Duration::from_millis(55) && waited < Duration::from_millis(300),
            "{waited:?}"
        );
        filler.await.unwrap();
        // Empty for 10 s: the deadline ends the wait, with nothing leased.
        b.try_take(Instant::now()).unwrap();
        b.grant(0, Duration::from_secs(10), Instant::now());
        let t = std::time::Instant::now();
        b.wait_for_token(Instant::now() + Duration::from_millis(50))
            .await;
        assert!(
            t.elapsed() < Duration::from_millis(250),
            "{:?}",
            t.elapsed()
        );
        assert_eq!(b.leased(Instant::now()), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn dropped_buckets_leave_the_registry() {
        let gate = FleetGate::new();
        let a = gate.bucket("a".into(), 1.0, 1);
        let b = gate.bucket("b".into(), 1.0, 1);
        assert_eq!(gate.buckets().len(), 2);
        drop(a);
        let left = gate.buckets();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].key(), b.key());
    }
}
