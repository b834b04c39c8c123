//! Backend slots of one pool: a counting semaphore whose waiters are served by priority
//! (critical → low), FIFO within a priority, each with its own deadline. The last `reserve`
//! free slots are the critical priority's alone: other priorities take a slot only while
//! more than `reserve` are free, so a storm of lower-priority work can never hold every
//! backend while critical work waits.
//!
//! A slot is handed to a waiter *as a permit value* through a oneshot channel, so a waiter that
//! times out or whose client disconnects at the exact moment of the hand-off drops the permit,
//! and the permit's `Drop` passes it on: no slot is ever lost and none is double-counted.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// Number of priority classes (critical, high, normal, low).
pub const PRIORITIES: usize = 4;

pub struct Slots {
    inner: Mutex<Inner>,
}

struct Inner {
    available: usize,
    /// Free slots only priority 0 may take.
    reserve: usize,
    waiters: [VecDeque<oneshot::Sender<SlotPermit>>; PRIORITIES],
}

impl Inner {
    /// The next live waiter that may have the slot being released: a critical one, or any
    /// other while the free slots (not counting this one) still cover the reserve.
    fn pop_waiter(&mut self) -> Option<oneshot::Sender<SlotPermit>> {
        let queues = if self.available >= self.reserve {
            &mut self.waiters[..]
        } else {
            &mut self.waiters[..1]
        };
        queues.iter_mut().find_map(|q| {
            while let Some(tx) = q.pop_front() {
                if !tx.is_closed() {
                    return Some(tx);
                }
            }
            None
        })
    }
}

/// The right to hold one backend connection of the pool.
pub struct SlotPermit {
    slots: Arc<Slots>,
    armed: bool,
}

impl Drop for SlotPermit {
    fn drop(&mut self) {
        if self.armed {
            self.slots.release();
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotTimeout;

impl Slots {
    /// `capacity` slots, `reserve` of which (at most `capacity - 1`) only critical waiters
    /// may take.
    pub fn new(capacity: usize, reserve: usize) -> Arc<Slots> {
        Arc::new(Slots {
            inner: Mutex::new(Inner {
                available: capacity,
                reserve: reserve.min(capacity.saturating_sub(1)),
                waiters: Default::default(),
            }),
        })
    }

    /// Takes a slot, waiting in `priority`'s queue (0 = most urgent) until `deadline`.
    pub async fn acquire(
        self: &Arc<Self>,
        priority: usize,
        deadline: Instant,
    ) -> Result<SlotPermit, SlotTimeout> {
        let rx = {
            let mut g = self.inner.lock();
            // Someone of equal or higher priority already waiting goes first.
            let ahead = g.waiters[..=priority.min(PRIORITIES - 1)]
                .iter()
                .any(|q| q.iter().any(|tx| !tx.is_closed()));
            let free = if priority == 0 { 0 } else { g.reserve };
            if g.available > free && !ahead {
                g.available -= 1;
                return Ok(SlotPermit {
                    slots: self.clone(),
                    armed: true,
                });
            }
            let (tx, rx) = oneshot::channel();
            g.waiters[priority.min(PRIORITIES - 1)].push_back(tx);
            rx
        };
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(SlotTimeout),
        }
    }

    fn release(self: &Arc<Self>) {
        loop {
            let tx = {
                let mut g = self.inner.lock();
                match g.pop_waiter() {
                    Some(tx) => tx,
                    None => {
                        g.available += 1;
                        return;
                    }
                }
            };
            let permit = SlotPermit {
                slots: self.clone(),
                armed: true,
            };
            match tx.send(permit) {
                Ok(()) => return,
                // The waiter left between our check and the send: try the next one.
                Err(mut p) => p.armed = false,
            }
        }
    }

    /// Clients currently waiting for a slot.
    pub fn waiting(&self) -> usize {
        let g = self.inner.lock();
        g.waiters
            .iter()
            .map(|q| q.iter().filter(|tx| !tx.is_closed()).count())
            .sum()
    }

    pub fn available(&self) -> usize {
        self.inner.lock().available
    }

    /// Slots only critical waiters may take.
    pub fn reserve(&self) -> usize {
        self.inner.lock().reserve
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn serves_by_priority_then_fifo() {
        let s = Slots::new(1, 0);
        let far = Instant::now() + Duration::from_secs(10);
        let first = s.acquire(2, far).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, prio) in [
            ("low", 3),
            ("normal-a", 2),
            ("critical", 0),
            ("normal-b", 2),
        ] {
            let s = s.clone();
            let order = order.clone();
            tasks.push(tokio::spawn(async move {
                let p = s.acquire(prio, far).await.unwrap();
                order.lock().push(name);
                tokio::time::sleep(Duration::from_millis(1)).await;
                drop(p);
            }));
            tokio::task::yield_now().await;
        }
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock(), ["critical", "normal-a", "normal-b", "low"]);
        assert_eq!(s.available(), 1);
    }

    /// With 3 slots and a reserve of 1, lower priorities get 2; the third goes to a critical
    /// waiter, and a released slot goes to a low waiter only while the reserve stays free.
    #[tokio::test(start_paused = true)]
    async fn the_reserve_is_for_critical_waiters_only() {
        let s = Slots::new(3, 1);
        let now = Instant::now();
        let soon = now + Duration::from_millis(100);
        let a = s.acquire(3, soon).await.expect("low 1");
        let b = s.acquire(2, soon).await.expect("normal");
        assert!(
            s.acquire(3, soon).await.is_err(),
            "the last slot is reserved"
        );
        let c = s
            .acquire(0, soon)
            .await
            .expect("critical takes the reserve");
        // All taken; a low waiter queues, and a released slot goes to it only if the
        // reserve would still be free: release the critical one → the reserve is back, the
        // low waiter keeps waiting.
        let s2 = s.clone();
        let low = tokio::spawn(async move { s2.acquire(3, now + Duration::from_secs(5)).await });
        tokio::task::yield_now().await;
        drop(c);
        tokio::task::yield_now().await;
        assert!(!low.is_finished(), "the freed slot is the reserve");
        assert_eq!(s.available(), 1);
        // A low slot comes back: now two are free, so the waiter gets one.
        drop(a);
        let got = low.await.expect("task").expect("the low waiter runs");
        assert_eq!(s.available(), 1, "the reserve stays free");
        drop((b, got));
        assert_eq!(s.available(), 3);
        assert_eq!(
            Slots::new(1, 5).reserve(),
            0,
            "a pool of one has no reserve"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn deadline_and_dropped_waiters_never_leak() {
        let s = Slots::new(1, 0);
        let start = Instant::now();
        let held = s.acquire(2, start + Duration::from_secs(1)).await.unwrap();
        let r = s.acquire(2, start + Duration::from_millis(200)).await;
        assert!(r.is_err());
        assert_eq!(start.elapsed(), Duration::from_millis(200));
        // A waiter that is dropped mid-wait leaves the queue.
        let s2 = s.clone();
        let w = tokio::spawn(async move { s2.acquire(2, start + Duration::from_secs(60)).await });
        tokio::task::yield_now().await;
        assert_eq!(s.waiting(), 1);
        w.abort();
        let _ = w.await;
        assert_eq!(s.waiting(), 0);
        drop(held);
        assert_eq!(s.available(), 1);
    }
}
