//! Limits shared by several pools: `pool.max_db_connections` (one database, every user) and
//! `pool.max_user_connections` (one user, every database), so the sum of the pools can never
//! exhaust the server's `max_connections` however many (database, user) pairs clients bring.
//!
//! A pool takes a unit of each of its caps before it connects and gives it back when the
//! connection closes. When a cap is full, an idle connection of another pool sharing it is
//! closed to make room (PgBouncer does the same); otherwise the connect waits for a unit to be
//! given back, until the checkout's deadline. Waiting is per pool in priority order (the
//! pool's own slot queue decides who connects); across pools the one with the fewest
//! connections open goes first: while a member pool with fewer waits, a pool takes no free
//! unit, and a connection coming back idle is closed instead when its pool holds two or more
//! connections more than such a waiter (so a pool whose clients never stop cannot keep the
//! whole cap while another pool's clients wait to their deadline).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::Pool;

/// One shared limit.
pub struct Cap {
    /// `database appdb` or `user app`, as errors and the admin API name it.
    pub name: String,
    /// 0: no limit (the cap only counts).
    limit: AtomicUsize,
    open: AtomicUsize,
    /// Connects waiting for a unit: a member pool with a connection back in its idle list
    /// wakes them (one atomic load per release when none wait), so they can evict it.
    waiting: AtomicUsize,
    freed: Notify,
    /// The pools that draw on it, for eviction of idle connections.
    members: Mutex<Vec<Weak<Pool>>>,
}

/// A cap at scrape time (`GET /v1/pools`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct CapSnapshot {
    pub name: String,
    pub limit: usize,
    pub open: usize,
}

impl Cap {
    pub fn new(name: String, limit: usize) -> Arc<Cap> {
        Arc::new(Cap {
            name,
            limit: AtomicUsize::new(limit),
            open: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            freed: Notify::new(),
            members: Mutex::new(Vec::new()),
        })
    }

    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// A reload's new limit; a higher one lets waiters in at once.
    pub fn set_limit(&self, limit: usize) {
        if self.limit.swap(limit, Ordering::Relaxed) != limit {
            self.freed.notify_waiters();
        }
    }

    pub fn join(&self, pool: &Arc<Pool>) {
        let mut m = self.members.lock();
        m.retain(|w| w.strong_count() > 0);
        m.push(Arc::downgrade(pool));
    }

    pub fn snapshot(&self) -> CapSnapshot {
        CapSnapshot {
            name: self.name.clone(),
            limit: self.limit(),
            open: self.open.load(Ordering::Relaxed),
        }
    }

    fn try_take(&self) -> bool {
        let limit = self.limit();
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (limit == 0 || n < limit).then_some(n + 1)
            })
            .is_ok()
    }

    /// Gives a unit back (a connection closed, or a connect failed).
    pub fn give(&self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
        self.freed.notify_waiters();
    }

    /// Whether `pool` may take a free unit: no other member pool waits with fewer
    /// connections open than it has.
    fn may_take(&self, pool: &Pool) -> bool {
        // No limit, or only this connect waits (it counts itself from before its first look).
        if self.limit() == 0 || self.waiting.load(Ordering::Acquire) <= 1 {
            return true;
        }
        let mine = pool.open.load(Ordering::Relaxed);
        !self.other_waiters(pool).any(|open| open < mine)
    }

    /// Whether `pool`, about to put a connection back idle, should close it instead: the cap
    /// is full and another member pool waits with two or more connections fewer (after the
    /// hand-over it still has no more than this pool).
    pub fn should_yield(&self, pool: &Pool) -> bool {
        let limit = self.limit();
        if limit == 0
            || self.waiting.load(Ordering::Acquire) == 0
            || self.open.load(Ordering::Acquire) < limit
        {
            return false;
        }
        let mine = pool.open.load(Ordering::Relaxed);
        self.other_waiters(pool).any(|open| open + 2 <= mine)
    }

    /// The member pools besides `pool` (taken out of the lock, which eviction must not hold).
    fn others(&self, pool: &Pool) -> Vec<Arc<Pool>> {
        self.members
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|p| !std::ptr::eq(Arc::as_ptr(p), pool))
            .collect()
    }

    /// The open connections of each other member pool with a connect waiting here.
    fn other_waiters(&self, pool: &Pool) -> impl Iterator<Item = usize> {
        self.others(pool)
            .into_iter()
            .filter(|p| p.cap_waiting.load(Ordering::Acquire) > 0)
            .map(|p| p.open.load(Ordering::Relaxed))
    }

    /// A member pool put a connection back in its idle list: a waiter may evict it now.
    pub fn idle_returned(&self) {
        if self.waiting.load(Ordering::Acquire) > 0 {
            self.freed.notify_waiters();
        }
    }

    /// Closes one idle connection of another member pool; whether it found one. When none
    /// is idle, asks for one parked with an idle client (`park`): its return to the idle list
    /// wakes this cap's waiters to look again.
    fn evict_for(&self, asking: &Pool) -> bool {
        let others = self.others(asking);
        if others.iter().any(|p| p.evict_one_idle()) {
            return true;
        }
        others.iter().any(|p| p.slots.parking.revoke_one());
        false
    }

    /// A connect waits here for a unit: no member pool's backend should stay parked.
    pub fn contended(&self) -> bool {
        self.waiting.load(Ordering::Acquire) > 0
    }
}

/// Which cap was full when the deadline came.
#[derive(Debug, Clone)]
pub struct CapFull {
    pub name: String,
    pub limit: usize,
}

/// Units taken of some caps, given back when dropped unless [`Units::keep`] hands them to a
/// connection (which gives them back when it closes): a connect abandoned half-way, or a
/// checkout dropped while it waits, leaks nothing.
pub struct Units<'a> {
    caps: &'a [Arc<Cap>],
    taken: usize,
}

impl Units<'_> {
    /// The connection opened: its close gives the units back ([`Pool`]'s `close`).
    pub fn keep(mut self) {
        self.taken = 0;
    }
}

impl Drop for Units<'_> {
    fn drop(&mut self) {
        for c in &self.caps[..self.taken] {
            c.give();
        }
    }
}

/// Takes a unit of every cap in `caps` for `pool`, evicting idle connections of other pools
/// or waiting as needed, until `deadline`.
pub async fn take_all<'a>(
    caps: &'a [Arc<Cap>],
    pool: &Pool,
    deadline: Instant,
) -> Result<Units<'a>, CapFull> {
    let mut units = Units { caps, taken: 0 };
    for cap in caps {
        take(cap, pool, deadline).await?;
        units.taken += 1;
    }
    Ok(units)
}

async fn take(cap: &Cap, pool: &Pool, deadline: Instant) -> Result<(), CapFull> {
    // Counted as waiting from before the first look, so a connection put back idle between
    // a look and the wait still wakes it.
    cap.waiting.fetch_add(1, Ordering::AcqRel);
    pool.cap_waiting.fetch_add(1, Ordering::AcqRel);
    // Decremented however this ends, a dropped checkout included; the waiters left look
    // again, since one of them may have held back only for this one (`may_take`).
    struct Waiting<'a>(&'a Cap, &'a Pool);
    impl Drop for Waiting<'_> {
        fn drop(&mut self) {
            self.1.cap_waiting.fetch_sub(1, Ordering::AcqRel);
            if self.0.waiting.fetch_sub(1, Ordering::AcqRel) > 1 {
                self.0.freed.notify_waiters();
            }
        }
    }
    let _waiting = Waiting(cap, pool);
    loop {
        let freed = cap.freed.notified();
        tokio::pin!(freed);
        freed.as_mut().enable();
        // Held back for a pool with fewer connections: no unit, and no eviction either (it
        // would free units for that pool only, closing idle connections nobody asked for).
        if cap.may_take(pool) {
            if cap.try_take() {
                return Ok(());
            }
            if cap.evict_for(pool) {
                continue;
            }
        }
        if tokio::time::timeout_at(deadline, freed).await.is_err() {
            return Err(CapFull {
                name: cap.name.clone(),
                limit: cap.limit(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;

    #[tokio::test]
    async fn a_full_cap_waits_for_a_unit_and_a_raised_limit_lets_in() {
        let cap = Cap::new("database d".into(), 1);
        assert!(cap.try_take());
        assert!(!cap.try_take());
        let cap2 = Arc::clone(&cap);
        let waiter = tokio::spawn(async move {
            let deadline = Instant::now() + std::time::Duration::from_secs(5);
            loop {
                let freed = cap2.freed.notified();
                tokio::pin!(freed);
                freed.as_mut().enable();
                if cap2.try_take() {
                    return true;
                }
                if tokio::time::timeout_at(deadline, freed).await.is_err() {
                    return false;
                }
            }
        });
        tokio::task::yield_now().await;
        cap.give();
        assert!(waiter.await.unwrap());
        assert_eq!(cap.snapshot().open, 1);
        cap.set_limit(2);
        assert!(cap.try_take());
        assert!(!cap.try_take());
        cap.set_limit(0);
        assert!(cap.try_take(), "0 is no limit");
    }

    fn pool(user: &str, cap: &Arc<Cap>) -> Arc<Pool> {
        Pool::new(
            "d",
            user,
            crate::config::PoolConfig::default(),
            super::super::ConnectParams::blank(crate::tls::BackendTlsHandle::disabled()),
            vec![Arc::clone(cap)],
        )
    }

    /// Holds `n` units for `p` as its open connections would.
    fn open(cap: &Cap, p: &Pool, n: usize) {
        for _ in 0..n {
            assert!(cap.try_take());
            p.open.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn close(cap: &Cap, p: &Pool) {
        p.open.fetch_sub(1, Ordering::Relaxed);
        cap.give();
    }

    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn the_pool_with_fewer_connections_gets_the_freed_unit_and_a_greedy_pool_yields() {
        let cap = Cap::new("database d".into(), 3);
        let (a, b) = (pool("a", &cap), pool("b", &cap));
        open(&cap, &a, 3);
        assert!(
            !cap.should_yield(&a),
            "nobody waits: a keeps its idle connection"
        );
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        let (c, pb) = (Arc::clone(&cap), Arc::clone(&b));
        let b_waits = tokio::spawn(async move { take(&c, &pb, deadline).await.is_ok() });
        let (c, pa) = (Arc::clone(&cap), Arc::clone(&a));
        let a_waits = tokio::spawn(async move { take(&c, &pa, deadline).await.is_ok() });
        settle().await;
        assert_eq!(cap.waiting.load(Ordering::Acquire), 2);
        // a holds all three while b waits with none: a's next idle connection is closed.
        assert!(cap.should_yield(&a));
        assert!(!cap.should_yield(&b));
        close(&cap, &a);
        settle().await;
        assert!(
            b_waits.is_finished(),
            "b, with no connection, took the unit"
        );
        assert!(b_waits.await.unwrap());
        b.open.fetch_add(1, Ordering::Relaxed);
        assert!(!a_waits.is_finished(), "a, with two, held back for b");
        // 2 against 1: no more yielding, and a gets the next unit now that b waits no more.
        assert!(!cap.should_yield(&a));
        close(&cap, &b);
        settle().await;
        assert!(a_waits.await.unwrap());
        assert_eq!(cap.snapshot().open, 3);
        assert_eq!(cap.waiting.load(Ordering::Acquire), 0);
        assert_eq!(a.cap_waiting.load(Ordering::Acquire), 0);
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_lets_the_one_it_held_back_take_a_free_unit() {
        let cap = Cap::new("database d".into(), 2);
        let (a, b) = (pool("a", &cap), pool("b", &cap));
        open(&cap, &a, 2);
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        // b's connect waits (polled once, then never again: a checkout about to be dropped).
        let mut b_waits = Box::pin(take(&cap, &b, deadline));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(b_waits.as_mut().poll(&mut cx).is_pending());
        let (c, pa) = (Arc::clone(&cap), Arc::clone(&a));
        let a_waits = tokio::spawn(async move { take(&c, &pa, deadline).await.is_ok() });
        settle().await;
        // a closes one (2 → 1, a unit free) but holds back for b, which waits with none...
        close(&cap, &a);
        settle().await;
        assert!(!a_waits.is_finished(), "a held back for b");
        // ...until b's checkout is dropped: its going away wakes a, which takes the unit.
        drop(b_waits);
        settle().await;
        assert!(a_waits.is_finished(), "a took the free unit at once");
        assert!(a_waits.await.unwrap());
        assert_eq!(cap.waiting.load(Ordering::Acquire), 0);
        assert_eq!(b.cap_waiting.load(Ordering::Acquire), 0);
    }
}
