//! Limits shared by several pools: `pool.max_db_connections` (one database, every user) and
//! `pool.max_user_connections` (one user, every database), so the sum of the pools can never
//! exhaust the server's `max_connections` however many (database, user) pairs clients bring.
//!
//! A pool takes a unit of each of its caps before it connects and gives it back when the
//! connection closes. When a cap is full, an idle connection of another pool sharing it is
//! closed to make room (PgBouncer does the same); otherwise the connect waits for a unit to be
//! given back, until the checkout's deadline. Waiting is per pool in priority order (the
//! pool's own slot queue decides who connects); across pools it is first come, first served.

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

    /// A member pool put a connection back in its idle list: a waiter may evict it now.
    pub fn idle_returned(&self) {
        if self.waiting.load(Ordering::Acquire) > 0 {
            self.freed.notify_waiters();
        }
    }

    /// Closes one idle connection of another member pool; whether it found one.
    fn evict_for(&self, asking: &Pool) -> bool {
        let members: Vec<Arc<Pool>> = self
            .members
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        members
            .iter()
            .filter(|p| !std::ptr::eq(Arc::as_ptr(p), asking))
            .any(|p| p.evict_one_idle())
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
    // Decremented however this ends, a dropped checkout included.
    struct Waiting<'a>(&'a AtomicUsize);
    impl Drop for Waiting<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::AcqRel);
        }
    }
    let _waiting = Waiting(&cap.waiting);
    loop {
        let freed = cap.freed.notified();
        tokio::pin!(freed);
        freed.as_mut().enable();
        if cap.try_take() {
            return Ok(());
        }
        if cap.evict_for(pool) {
            continue;
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
}
