//! Per-source-address shares of process-wide scarce things (handshakes in progress, cancels
//! in flight), so that one address cannot take them all: a slowloris from one host must not
//! block every login, nor a burst of forged cancels every cancel.
//!
//! A [`PerAddress`] counts what each address holds; an [`AddressGuard`] is one unit of it,
//! given back on drop. Entries are removed when their count reaches 0, so the map never holds
//! more addresses than there are live guards. The critical section is a few instructions under
//! a sync mutex, never across an `.await`.
//!
//! Addresses are compared by [`source_key`]: an IPv4 client seen through a dual-stack listener
//! (`::ffff:a.b.c.d`) counts as its IPv4 address, and IPv6 clients count by their /64 (one
//! host usually owns a whole /64, so counting single addresses would give it millions of
//! shares). This module counts; callers read the caps from the configuration.

use foldhash::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Why a wait for a unit ended without one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Already `max_waiting` waiting: refused at once.
    Full,
    /// The deadline passed first.
    TimedOut,
}

/// A counted resource with a wait: at most `cap` held, waiters served as units come back.
/// Waiters are woken one per returned unit (`Notify::notify_one`, whose stored permit covers
/// a unit returned between a waiter's check and its wait), and a newcomer never overtakes
/// a waiter.
#[derive(Default)]
pub struct Gate {
    state: Mutex<GateState>,
    notify: Notify,
}

#[derive(Default)]
struct GateState {
    held: usize,
    waiting: usize,
}

impl Gate {
    /// One unit if one is free and nobody waits.
    pub fn try_take(&self, cap: usize) -> bool {
        let mut st = self.state.lock();
        if st.held < cap && st.waiting == 0 {
            st.held += 1;
            true
        } else {
            false
        }
    }

    /// One unit, waiting until `deadline` behind at most `max_waiting - 1` others.
    pub async fn take(
        &self,
        cap: usize,
        max_waiting: usize,
        deadline: Instant,
    ) -> Result<(), Wait> {
        match self.enter(cap, max_waiting) {
            Entered::Took => Ok(()),
            Entered::Full => Err(Wait::Full),
            Entered::Waiting => self.wait(cap, deadline).await,
        }
    }

    /// The synchronous first step of [`Gate::take`]: a unit, a place in the wait, or no.
    fn enter(&self, cap: usize, max_waiting: usize) -> Entered {
        let mut st = self.state.lock();
        if st.held < cap && st.waiting == 0 {
            st.held += 1;
            Entered::Took
        } else if st.waiting >= max_waiting {
            Entered::Full
        } else {
            st.waiting += 1;
            Entered::Waiting
        }
    }

    /// The wait of one who [`Gate::enter`]ed it.
    async fn wait(&self, cap: usize, deadline: Instant) -> Result<(), Wait> {
        // Leaves the wait (and passes a wake-up on) even if this future is dropped.
        let mut waiter = Waiter {
            gate: self,
            done: false,
        };
        loop {
            let woke = tokio::time::timeout_at(deadline, self.notify.notified())
                .await
                .is_ok();
            let mut st = self.state.lock();
            if st.held < cap {
                st.held += 1;
                st.waiting -= 1;
                waiter.done = true;
                if st.waiting > 0 && st.held < cap {
                    self.notify.notify_one();
                }
                return Ok(());
            }
            if !woke {
                st.waiting -= 1;
                waiter.done = true;
                return Err(Wait::TimedOut);
            }
        }
    }

    /// Gives a unit back and wakes one waiter.
    pub fn give(&self) {
        let mut st = self.state.lock();
        st.held = st.held.saturating_sub(1);
        if st.waiting > 0 {
            self.notify.notify_one();
        }
    }

    /// Units held now.
    pub fn held(&self) -> usize {
        self.state.lock().held
    }

    fn idle(&self) -> bool {
        let st = self.state.lock();
        st.held == 0 && st.waiting == 0
    }
}

enum Entered {
    Took,
    Waiting,
    Full,
}

/// A waiter's place; leaving without a unit (a dropped future) takes it out of the count.
struct Waiter<'a> {
    gate: &'a Gate,
    done: bool,
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if !self.done {
            let mut st = self.gate.state.lock();
            st.waiting -= 1;
            // A wake-up meant for us may have been spent: pass one on.
            if st.waiting > 0 {
                self.gate.notify.notify_one();
            }
        }
    }
}

/// What each source address holds now.
#[derive(Default)]
pub struct PerAddress {
    held: Mutex<HashMap<IpAddr, Arc<Gate>>>,
}

impl PerAddress {
    /// One more unit for `ip`, or `None` when its [`source_key`] already holds `cap` (or has
    /// waiters).
    pub fn try_acquire(self: &Arc<Self>, ip: IpAddr, cap: usize) -> Option<AddressGuard> {
        let key = source_key(ip);
        let mut held = self.held.lock();
        let gate = Arc::clone(held.entry(key).or_default());
        if gate.try_take(cap) {
            return Some(self.guard(key, gate));
        }
        // Never leave an empty entry behind (cap 0 on a fresh address).
        if gate.idle() {
            held.remove(&key);
        }
        None
    }

    /// One more unit for `ip`, waiting until `deadline` for one of its `cap` while fewer
    /// than `max_waiting` connections of that address already wait.
    pub async fn acquire(
        self: &Arc<Self>,
        ip: IpAddr,
        cap: usize,
        max_waiting: usize,
        deadline: Instant,
    ) -> Result<AddressGuard, Wait> {
        let key = source_key(ip);
        // Entered under the map's lock, so the entry cannot be dropped as idle meanwhile.
        let (gate, entered) = {
            let mut held = self.held.lock();
            let gate = Arc::clone(held.entry(key).or_default());
            let entered = gate.enter(cap, max_waiting);
            if matches!(entered, Entered::Full) && gate.idle() {
                held.remove(&key);
            }
            (gate, entered)
        };
        let r = match entered {
            Entered::Took => Ok(()),
            Entered::Full => Err(Wait::Full),
            Entered::Waiting => gate.wait(cap, deadline).await,
        };
        match r {
            Ok(()) => Ok(self.guard(key, gate)),
            Err(e) => {
                self.forget_if_idle(key);
                Err(e)
            }
        }
    }

    fn guard(self: &Arc<Self>, key: IpAddr, gate: Arc<Gate>) -> AddressGuard {
        AddressGuard {
            owner: Arc::clone(self),
            key,
            gate,
        }
    }

    fn forget_if_idle(&self, key: IpAddr) {
        let mut held = self.held.lock();
        if held.get(&key).is_some_and(|g| g.idle()) {
            held.remove(&key);
        }
    }

    /// Units `ip`'s [`source_key`] holds now.
    pub fn held(&self, ip: IpAddr) -> usize {
        self.held
            .lock()
            .get(&source_key(ip))
            .map_or(0, |g| g.held())
    }

    /// Addresses holding (or waiting for) at least one unit.
    pub fn addresses(&self) -> usize {
        self.held.lock().len()
    }
}

/// One unit held by one source address; given back on drop.
pub struct AddressGuard {
    owner: Arc<PerAddress>,
    key: IpAddr,
    gate: Arc<Gate>,
}

impl Drop for AddressGuard {
    fn drop(&mut self) {
        self.gate.give();
        self.owner.forget_if_idle(self.key);
    }
}

/// The address `ip` is counted as: IPv4 as is (also when mapped into IPv6), IPv6 by its /64.
pub fn source_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(bits))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    #[test]
    fn each_address_gets_its_own_share() {
        let p = Arc::new(PerAddress::default());
        let a = ip("127.0.0.1");
        let held: Vec<_> = (0..4).map(|_| p.try_acquire(a, 4)).collect();
        assert!(held.iter().all(Option::is_some));
        assert!(p.try_acquire(a, 4).is_none(), "the fifth is over the share");
        assert_eq!(p.held(a), 4);
        // Another address is not affected.
        let b = p.try_acquire(ip("127.0.0.2"), 4);
        assert!(b.is_some());
        assert_eq!(p.addresses(), 2);
        // Giving one back makes room for exactly one.
        let mut held = held;
        held.pop();
        let again = p.try_acquire(a, 4);
        assert!(again.is_some());
        assert!(p.try_acquire(a, 4).is_none());
        drop(again);
        assert_eq!(p.held(a), 3);
    }

    /// Over its share an address waits (it does not take a unit), in turn, and is refused only
    /// beyond `max_waiting`; a waiter whose deadline passes leaves the count.
    #[tokio::test(start_paused = true)]
    async fn over_its_share_an_address_waits_for_its_turn() {
        let p = Arc::new(PerAddress::default());
        let a = ip("127.0.0.1");
        let far = Instant::now() + std::time::Duration::from_secs(10);
        let first = p.acquire(a, 1, 2, far).await.expect("the share");
        let (p1, p2) = (Arc::clone(&p), Arc::clone(&p));
        let w1 = tokio::spawn(async move { p1.acquire(a, 1, 2, far).await.map(|_| ()) });
        tokio::task::yield_now().await;
        let w2 = tokio::spawn(async move { p2.acquire(a, 1, 2, far).await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert_eq!(p.acquire(a, 1, 2, far).await.err(), Some(Wait::Full));
        assert_eq!(p.held(a), 1, "waiters hold nothing");
        drop(first);
        assert_eq!(w1.await.expect("task"), Ok(()));
        assert_eq!(w2.await.expect("task"), Ok(()));
        // A deadline: the waiter leaves, and the entry is gone once nothing is held.
        let held = p.acquire(a, 1, 2, far).await.expect("free again");
        let soon = Instant::now() + std::time::Duration::from_millis(100);
        assert_eq!(p.acquire(a, 1, 2, soon).await.err(), Some(Wait::TimedOut));
        drop(held);
        assert_eq!(p.addresses(), 0);
    }

    #[test]
    fn entries_are_removed_at_zero() {
        let p = Arc::new(PerAddress::default());
        for i in 0..=255u8 {
            let g = p.try_acquire(IpAddr::from([10, 0, 0, i]), 8);
            assert!(g.is_some());
        }
        assert_eq!(p.addresses(), 0, "every guard was dropped");
        assert!(p.try_acquire(ip("10.0.0.1"), 0).is_none());
        assert_eq!(p.addresses(), 0, "a refusal leaves no entry behind");
        let g = p.try_acquire(ip("10.0.0.1"), 1);
        assert_eq!(p.addresses(), 1);
        drop(g);
        assert_eq!(p.addresses(), 0);
        assert!(p.held.lock().is_empty());
    }

    #[test]
    fn mapped_ipv4_and_one_ipv6_slash_64_count_as_one_source() {
        let p = Arc::new(PerAddress::default());
        let _a = p.try_acquire(ip("192.0.2.7"), 1);
        assert!(p.try_acquire(ip("::ffff:192.0.2.7"), 1).is_none());
        let _b = p.try_acquire(ip("2001:db8:1:2::1"), 1);
        assert!(
            p.try_acquire(ip("2001:db8:1:2:ffff:ffff:ffff:ffff"), 1)
                .is_none()
        );
        assert!(p.try_acquire(ip("2001:db8:1:3::1"), 1).is_some());
        assert_eq!(source_key(ip("::1")), ip("::"));
    }

    #[test]
    fn guards_given_back_from_many_threads_leave_nothing() {
        let p = Arc::new(PerAddress::default());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let p = Arc::clone(&p);
                std::thread::spawn(move || {
                    for i in 0..1000u32 {
                        let a = IpAddr::from([10, 0, (i % 4) as u8, t]);
                        let g = p.try_acquire(a, 2);
                        assert!(g.is_some(), "one holder per address at a time");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        assert_eq!(p.addresses(), 0);
    }
}
