//! Per-caller concurrency limiter with a bounded FIFO wait queue (DESIGN §5 step 2).
//!
//! Owns one caller's `max_concurrency` slots and its queue of up to `queue_depth` waiters.
//! `acquire` hands out a slot at once when one is free, queues (FIFO) until a slot frees or the
//! caller's deadline passes, or refuses at once when the queue is full. It does not know what
//! the slot is used for: in transaction mode the session holds the permit for as long as it
//! holds a backend, so "concurrency" is "backends this caller occupies".
//!
//! Why hand-rolled rather than `tokio::sync::Semaphore`: the queue depth must be bounded and
//! visible, and limits must shrink at runtime while permits are out (hot reload). Shrinking a
//! semaphore below its outstanding permits needs debt bookkeeping that is clearer written as
//! one small state machine under a mutex:
//!
//! * a released slot is handed *directly* to the oldest waiter (the in-flight count does not
//!   dip), so a newcomer can never overtake the queue;
//! * a waiter is a oneshot receiver plus a drop guard; if the waiting future is dropped
//!   (client gone, outer timeout) the guard removes it from the queue, or — if a slot was
//!   handed to it in the same instant — passes that slot on. No slot can leak.
//!
//! It counts the clients refused after waiting (wasted waits, [`ArrivalStats`]). Unlike a
//! pool's queue, a caller's queue is never shortened by an estimate of its wait: its
//! `queue_depth` is what the operator asked for, and an estimate of a queue whose pace falls
//! as refused clients log in again would refuse more, and so slow it further.
//!
//! The mutex is a `parking_lot` one held for a few instructions and never across `.await`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::arrival::ArrivalStats;

/// The limits a caller's limiter enforces. Changed at runtime with [`Limiter::set_limits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Limits {
    /// Slots (statements/backends) the caller may hold at once.
    pub max_concurrency: u32,
    /// Waiters allowed once all slots are taken; 0 refuses at once.
    pub queue_depth: u32,
}

/// Why `acquire` gave no permit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitRefusal {
    /// All slots taken and the queue full (or `queue_depth` 0).
    #[error("at max_concurrency={} and the queue (depth {}) is full", limits.max_concurrency, limits.queue_depth)]
    LimitExceeded {
        limits: Limits,
        in_flight: u32,
        queued: u32,
    },
    /// Queued, but no slot freed before the deadline.
    #[error("no slot within the deadline (waited {} ms)", waited.as_millis())]
    QueueTimeout { limits: Limits, waited: Duration },
}

/// A caller's limiter; clones share the same slots.
#[derive(Clone)]
pub struct Limiter {
    shared: Arc<Mutex<State>>,
}

struct State {
    limits: Limits,
    in_flight: u32,
    /// Slots given back since start (the drain rate's count).
    released: u64,
    waiters: VecDeque<Waiter>,
    /// Identifies waiters so a dropped one can find and remove itself.
    next_id: u64,
    /// Waiters whose deadline passed before a slot came (each a wasted wait).
    waited_out: u64,
}

struct Waiter {
    id: u64,
    grant: oneshot::Sender<()>,
}

impl State {
    /// A slot is being given back: pass it to the oldest live waiter if the (possibly lowered)
    /// limit still has room for it, otherwise really free it.
    fn release_one(&mut self) {
        self.released = self.released.wrapping_add(1);
        if self.in_flight <= self.limits.max_concurrency {
            while let Some(w) = self.waiters.pop_front() {
                if w.grant.send(()).is_ok() {
                    return;
                }
                // Receiver already gone (its guard has not run yet): try the next one.
            }
        }
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// After the limit was raised: give the new room to waiters, oldest first.
    fn grant_waiters(&mut self) {
        while self.in_flight < self.limits.max_concurrency {
            let Some(w) = self.waiters.pop_front() else {
                break;
            };
            if w.grant.send(()).is_ok() {
                self.in_flight += 1;
            }
        }
    }
}

/// An occupied slot. Dropping it returns the slot and wakes the next waiter.
pub struct CallerPermit {
    shared: Arc<Mutex<State>>,
}

impl Drop for CallerPermit {
    fn drop(&mut self) {
        self.shared.lock().release_one();
    }
}

impl std::fmt::Debug for CallerPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallerPermit")
    }
}

/// A queue position. Lives inside the `acquire` future so that dropping the future leaves
/// the queue (or forwards a slot granted in the meantime).
struct QueueSlot {
    shared: Arc<Mutex<State>>,
    id: u64,
    rx: oneshot::Receiver<()>,
    /// Set once the outcome is settled (permit taken, or removed from the queue).
    settled: bool,
}

impl QueueSlot {
    /// Under the lock: did a grant arrive? If not, leave the queue. Either way we are settled.
    fn settle(&mut self) -> bool {
        let mut st = self.shared.lock();
        self.settled = true;
        if self.rx.try_recv().is_ok() {
            return true;
        }
        let id = self.id;
        st.waiters.retain(|w| w.id != id);
        false
    }
}

impl Drop for QueueSlot {
    fn drop(&mut self) {
        if !self.settled && self.settle() {
            // A slot was handed to us but nobody will use it: pass it on.
            self.shared.lock().release_one();
        }
    }
}

impl Limiter {
    pub fn new(limits: Limits) -> Self {
        Self {
            shared: Arc::new(Mutex::new(State {
                limits,
                in_flight: 0,
                released: 0,
                waiters: VecDeque::new(),
                next_id: 0,
                waited_out: 0,
            })),
        }
    }

    /// Hot reload. A higher `max_concurrency` admits waiters at once; a lower one is reached
    /// as permits come back (permits already out are honoured). A lower `queue_depth` only
    /// affects new arrivals; those already queued keep their place.
    pub fn set_limits(&self, limits: Limits) {
        let mut st = self.shared.lock();
        st.limits = limits;
        st.grant_waiters();
    }

    pub fn limits(&self) -> Limits {
        self.shared.lock().limits
    }

    /// Slots currently held.
    pub fn in_flight(&self) -> u32 {
        self.shared.lock().in_flight
    }

    /// Waiters currently queued.
    pub fn queued(&self) -> u32 {
        u32::try_from(self.shared.lock().waiters.len()).unwrap_or(u32::MAX)
    }

    /// Slots given back since start, and the waiters now: what the drain rate is read from.
    pub fn drain_counts(&self) -> (u64, u32) {
        let st = self.shared.lock();
        (
            st.released,
            u32::try_from(st.waiters.len()).unwrap_or(u32::MAX),
        )
    }

    /// What its queue's refusals were: a caller's are never decided on arrival, so only
    /// the waits that ran out count.
    pub fn arrival_stats(&self) -> ArrivalStats {
        ArrivalStats {
            refused_after_wait: self.shared.lock().waited_out,
            ..ArrivalStats::default()
        }
    }

    /// A permit if a slot is free right now (and nobody is queued ahead), else `None`.
    pub fn try_acquire(&self) -> Option<CallerPermit> {
        let mut st = self.shared.lock();
        if st.waiters.is_empty() && st.in_flight < st.limits.max_concurrency {
            st.in_flight += 1;
            drop(st);
            return Some(self.permit());
        }
        None
    }

    /// A permit now, or after waiting in FIFO order until `deadline`.
    ///
    /// Cancel-safe: dropping the returned future at any point leaves the queue and never
    /// leaks a slot. The deadline fires at `deadline`, never later; a slot granted in the same
    /// instant is still taken rather than wasted.
    pub async fn acquire(&self, deadline: Instant) -> Result<CallerPermit, LimitRefusal> {
        let started = Instant::now();
        let mut slot = {
            let mut st = self.shared.lock();
            if st.waiters.is_empty() && st.in_flight < st.limits.max_concurrency {
                st.in_flight += 1;
                drop(st);
                return Ok(self.permit());
            }
            let queued = u32::try_from(st.waiters.len()).unwrap_or(u32::MAX);
            if queued >= st.limits.queue_depth {
                return Err(LimitRefusal::LimitExceeded {
                    limits: st.limits,
                    in_flight: st.in_flight,
                    queued,
                });
            }
            if deadline <= started {
                return Err(LimitRefusal::QueueTimeout {
                    limits: st.limits,
                    waited: Duration::ZERO,
                });
            }
            let (tx, rx) = oneshot::channel();
            let id = st.next_id;
            st.next_id = st.next_id.wrapping_add(1);
            st.waiters.push_back(Waiter { id, grant: tx });
            QueueSlot {
                shared: Arc::clone(&self.shared),
                id,
                rx,
                settled: false,
            }
        };
        let granted = match tokio::time::timeout_at(deadline, &mut slot.rx).await {
            Ok(Ok(())) => {
                slot.settled = true;
                true
            }
            // Deadline passed (or, impossibly, the sender vanished): settle under the lock,
            // which also catches a grant that raced with the timer.
            Ok(Err(_)) | Err(_) => slot.settle(),
        };
        if granted {
            Ok(self.permit())
        } else {
            let mut st = self.shared.lock();
            st.waited_out += 1;
            Err(LimitRefusal::QueueTimeout {
                limits: st.limits,
                waited: Instant::now().saturating_duration_since(started),
            })
        }
    }

    fn permit(&self) -> CallerPermit {
        CallerPermit {
            shared: Arc::clone(&self.shared),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(max_concurrency: u32, queue_depth: u32) -> Limiter {
        Limiter::new(Limits {
            max_concurrency,
            queue_depth,
        })
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    #[tokio::test(start_paused = true)]
    async fn under_limit_is_immediate_and_depth_zero_refuses() {
        let l = limiter(2, 0);
        let a = l.acquire(far()).await.unwrap();
        let _b = l.acquire(far()).await.unwrap();
        assert_eq!(l.in_flight(), 2);
        match l.acquire(far()).await {
            Err(LimitRefusal::LimitExceeded {
                in_flight, queued, ..
            }) => assert_eq!((in_flight, queued), (2, 0)),
            other => panic!("{other:?}"),
        }
        drop(a);
        assert_eq!(l.in_flight(), 1);
        assert!(l.try_acquire().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn queue_timeout_fires_at_the_deadline_not_later() {
        let l = limiter(1, 5);
        let _held = l.acquire(far()).await.unwrap();
        let start = Instant::now();
        let err = l
            .acquire(start + Duration::from_millis(200))
            .await
            .unwrap_err();
        assert_eq!(Instant::now() - start, Duration::from_millis(200));
        match err {
            LimitRefusal::QueueTimeout { waited, .. } => {
                assert_eq!(waited, Duration::from_millis(200))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(l.queued(), 0);
        // A deadline already passed refuses without queueing.
        assert!(matches!(
            l.acquire(Instant::now()).await,
            Err(LimitRefusal::QueueTimeout { .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn fifo_and_permit_drop_wakes_the_next() {
        let l = limiter(1, 10);
        let first = l.acquire(far()).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..5 {
            let (l, order) = (l.clone(), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                let p = l.acquire(far()).await.unwrap();
                order.lock().push(i);
                tokio::time::sleep(Duration::from_millis(10)).await;
                drop(p);
            }));
            // Let the task enqueue before spawning the next, so arrival order is fixed.
            tokio::task::yield_now().await;
        }
        assert_eq!(l.queued(), 5);
        // Nobody overtakes the queue while it is non-empty.
        assert!(l.try_acquire().is_none());
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock(), vec![0, 1, 2, 3, 4]);
        assert_eq!((l.in_flight(), l.queued()), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn dropped_waiter_leaves_the_queue_and_never_leaks() {
        let l = limiter(1, 2);
        let held = l.acquire(far()).await.unwrap();
        let waiter = {
            let l = l.clone();
            tokio::spawn(async move { l.acquire(far()).await.map(|_| ()) })
        };
        tokio::task::yield_now().await;
        assert_eq!(l.queued(), 1);
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(l.queued(), 0);
        drop(held);
        assert_eq!(l.in_flight(), 0);

        // The race: the slot is handed over, then the future is dropped before it runs.
        let held = l.acquire(far()).await.unwrap();
        let mut fut = Box::pin(l.acquire(far()));
        assert!(futures_poll(&mut fut).is_none());
        assert_eq!(l.queued(), 1);
        drop(held); // grant goes to the queued future...
        assert_eq!(l.in_flight(), 1);
        drop(fut); // ...which is abandoned: the slot must come back.
        assert_eq!((l.in_flight(), l.queued()), (0, 0));
        assert!(l.try_acquire().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn hot_reload_raises_and_lowers_limits() {
        let l = limiter(1, 5);
        let a = l.acquire(far()).await.unwrap();
        let w = {
            let l = l.clone();
            tokio::spawn(async move { l.acquire(far()).await })
        };
        tokio::task::yield_now().await;
        assert_eq!(l.queued(), 1);
        // Raising the limit admits the waiter at once.
        l.set_limits(Limits {
            max_concurrency: 2,
            queue_depth: 5,
        });
        let b = w.await.unwrap().unwrap();
        assert_eq!(l.in_flight(), 2);
        // Lowering it honours permits already out; new ones wait until below the new limit.
        l.set_limits(Limits {
            max_concurrency: 1,
            queue_depth: 0,
        });
        assert!(matches!(
            l.acquire(far()).await,
            Err(LimitRefusal::LimitExceeded { .. })
        ));
        drop(a);
        assert_eq!(l.in_flight(), 1);
        assert!(l.try_acquire().is_none());
        drop(b);
        assert!(l.try_acquire().is_some());
    }

    /// Real threads, real time: permits, timeouts and aborted waiters racing each other must
    /// never exceed the limit nor leave anything behind.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn stress_never_exceeds_and_never_leaks() {
        use std::sync::atomic::{AtomicU32, Ordering};
        let l = limiter(3, 8);
        let active = Arc::new(AtomicU32::new(0));
        let mut tasks = Vec::new();
        for i in 0..400u64 {
            let (l, active) = (l.clone(), Arc::clone(&active));
            let task = tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_micros(200 + (i % 7) * 300);
                /// Counts one holder out when dropped — also when the task is aborted while
                /// it holds its permit (dropped before the permit, declared after it).
                struct Holding(Arc<AtomicU32>);
                impl Drop for Holding {
                    fn drop(&mut self) {
                        self.0.fetch_sub(1, Ordering::SeqCst);
                    }
                }
                if let Ok(_p) = l.acquire(deadline).await {
                    let n = active.fetch_add(1, Ordering::SeqCst) + 1;
                    let _holding = Holding(Arc::clone(&active));
                    assert!(n <= 3, "{n} permits out");
                    tokio::time::sleep(Duration::from_micros(100 + (i % 5) * 50)).await;
                }
            });
            if i % 5 == 0 {
                task.abort();
            }
            tasks.push(task);
        }
        for t in tasks {
            if let Err(e) = t.await {
                assert!(e.is_cancelled(), "{e}");
            }
        }
        assert_eq!((l.in_flight(), l.queued()), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_runs_out_is_counted() {
        let l = limiter(1, 1);
        let _held = l.acquire(far()).await.unwrap();
        let soon = || Instant::now() + Duration::from_millis(50);
        // Queued, and its deadline passes: a wasted wait.
        assert!(matches!(
            l.acquire(soon()).await,
            Err(LimitRefusal::QueueTimeout { .. })
        ));
        assert_eq!(l.arrival_stats().refused_after_wait, 1);
        // A full queue refuses at once: not a wait.
        let queued = {
            let l = l.clone();
            tokio::spawn(async move { l.acquire(far()).await.map(|_| ()) })
        };
        tokio::task::yield_now().await;
        assert!(matches!(
            l.acquire(soon()).await,
            Err(LimitRefusal::LimitExceeded { .. })
        ));
        assert_eq!(l.arrival_stats().refused_after_wait, 1);
        queued.abort();
    }

    /// Poll a future once with a no-op waker.
    fn futures_poll<F: std::future::Future + Unpin>(fut: &mut F) -> Option<F::Output> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match std::pin::Pin::new(fut).poll(&mut cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        }
    }
}
