//! Backends parked with their idle client: in transaction mode a client between
//! transactions may keep its clean backend while the pool has a slot free for anyone else and
//! nobody waits, which spares its next transaction a checkout and a release. The pool takes a
//! parked backend back (revokes it) as soon as a checkout has to wait, when it is paused or
//! told to reconnect, and at each maintenance tick; the client then returns it as usual.
//!
//! A session parks with a [`Ticket`] on the pool's [`Parking`] list. Revoking takes the
//! ticket off the list, marks it and wakes its session. A session that wants its backend
//! again takes its ticket off the list first: if the pool revoked it meanwhile, the ticket is
//! no longer there, and the session gives the backend back and checks out like anyone else.
//! So a backend is never both used by its client and promised to a waiter.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::Context;

use futures_util::task::AtomicWaker;
use parking_lot::Mutex;

/// One session's place on a pool's parking list (made once per session, reused).
#[derive(Default)]
pub struct Ticket {
    revoked: AtomicBool,
    waker: AtomicWaker,
}

impl Ticket {
    /// Whether the pool wants the backend back; registers `cx` to be woken when it does.
    pub fn revoked(&self, cx: &mut Context<'_>) -> bool {
        self.waker.register(cx.waker());
        self.revoked.load(Ordering::Acquire)
    }

    fn revoke(&self) {
        self.revoked.store(true, Ordering::Release);
        self.waker.wake();
    }
}

/// The sessions that hold one of a pool's backends while idle, oldest first.
#[derive(Default)]
pub struct Parking {
    list: Mutex<Vec<Arc<Ticket>>>,
    /// `list.len()`, read without the lock on the checkout's path.
    len: AtomicUsize,
}

impl Parking {
    pub fn park(&self, t: &Arc<Ticket>) {
        t.revoked.store(false, Ordering::Relaxed);
        let mut list = self.list.lock();
        list.push(Arc::clone(t));
        self.len.store(list.len(), Ordering::Release);
    }

    /// Takes `t` off the list: `true` when it was there (the backend is still the session's),
    /// `false` when the pool revoked it first.
    pub fn unpark(&self, t: &Arc<Ticket>) -> bool {
        let mut list = self.list.lock();
        let Some(i) = list.iter().position(|x| Arc::ptr_eq(x, t)) else {
            return false;
        };
        list.remove(i);
        self.len.store(list.len(), Ordering::Release);
        true
    }

    /// Asks the longest-parked session for its backend; whether there was one.
    pub fn revoke_one(&self) -> bool {
        if self.len.load(Ordering::Acquire) == 0 {
            return false;
        }
        let t = {
            let mut list = self.list.lock();
            if list.is_empty() {
                return false;
            }
            let t = list.remove(0);
            self.len.store(list.len(), Ordering::Release);
            t
        };
        t.revoke();
        true
    }

    /// Asks every parked session for its backend; how many there were.
    pub fn revoke_all(&self) -> usize {
        if self.len.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let all = {
            let mut list = self.list.lock();
            self.len.store(0, Ordering::Release);
            std::mem::take(&mut *list)
        };
        for t in &all {
            t.revoke();
        }
        all.len()
    }

    /// Sessions parked now.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::task::{Wake, Waker};

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn waker() -> (Arc<Count>, Waker) {
        let c = Arc::new(Count(AtomicUsize::new(0)));
        (c.clone(), Waker::from(c))
    }

    #[test]
    fn a_revoke_wakes_the_longest_parked_session_and_its_unpark_then_fails() {
        let p = Parking::default();
        let (a, b) = (Arc::new(Ticket::default()), Arc::new(Ticket::default()));
        let (wa, wka) = waker();
        let (wb, wkb) = waker();
        p.park(&a);
        p.park(&b);
        assert!(!a.revoked(&mut Context::from_waker(&wka)));
        assert!(!b.revoked(&mut Context::from_waker(&wkb)));
        assert_eq!(p.len(), 2);

        assert!(p.revoke_one());
        assert_eq!(wa.0.load(Ordering::SeqCst), 1, "the oldest is woken");
        assert_eq!(wb.0.load(Ordering::SeqCst), 0);
        assert!(a.revoked(&mut Context::from_waker(&wka)));
        assert!(!p.unpark(&a), "revoked: the backend goes back");
        assert!(p.unpark(&b), "still parked: the backend stays");
        assert!(p.is_empty());
        assert!(!p.revoke_one(), "nobody left to ask");

        // Parking again clears the mark.
        p.park(&a);
        assert!(!a.revoked(&mut Context::from_waker(&wka)));
    }

    #[test]
    fn revoke_all_empties_the_list_and_wakes_everyone() {
        let p = Parking::default();
        let tickets: Vec<_> = (0..3).map(|_| Arc::new(Ticket::default())).collect();
        let wakers: Vec<_> = (0..3).map(|_| waker()).collect();
        for (t, (_, w)) in tickets.iter().zip(&wakers) {
            p.park(t);
            assert!(!t.revoked(&mut Context::from_waker(w)));
        }
        assert_eq!(p.revoke_all(), 3);
        assert!(p.is_empty());
        for (t, (count, w)) in tickets.iter().zip(&wakers) {
            assert_eq!(count.0.load(Ordering::SeqCst), 1);
            assert!(t.revoked(&mut Context::from_waker(w)));
            assert!(!p.unpark(t));
        }
        assert_eq!(p.revoke_all(), 0);
    }
}
