//! Backend slots of one pool: a counting semaphore whose waiters are served by priority
//! (critical → low), FIFO within a priority, each with its own deadline. The last `reserve`
//! free slots are the critical priority's alone: other priorities take a slot only while
//! more than `reserve` are free, so a storm of lower-priority work can never hold every
//! backend while critical work waits.
//!
//! A slot is handed to a waiter *as a permit value* through a oneshot channel, so a waiter that
//! times out or whose client disconnects at the exact moment of the hand-off drops the permit,
//! and the permit's `Drop` passes it on: no slot is ever lost and none is double-counted.
//!
//! Deadlines are kept by one sweeper task per pool while anyone waits, not by a timer per
//! waiter: at hundreds of clients per backend most checkouts wait, and registering and
//! removing a timer for each cost more than the rest of the wait. The sweeper sleeps until
//! the earliest deadline (woken sooner when a waiter with an earlier one arrives), drops the
//! senders of the waiters whose deadline has come — under the same lock as the hand-off, so
//! a waiter gets either its slot or its timeout — and ends when the queues are empty.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use super::park::Parking;

/// Number of priority classes (critical, high, normal, low).
pub const PRIORITIES: usize = 4;

pub struct Slots {
    inner: Mutex<Inner>,
    /// Slots held by idle clients that give them back when asked (a waiter asks).
    pub parking: Parking,
    /// Wakes the sweeper to look again (a waiter with an earlier deadline arrived).
    sweep: Notify,
}

/// One waiter: where its slot goes, and until when it waits.
struct Waiter {
    tx: oneshot::Sender<SlotPermit>,
    deadline: Instant,
}

struct Inner {
    available: usize,
    /// Free slots only priority 0 may take.
    reserve: usize,
    /// Slots each priority holds now.
    held: [usize; PRIORITIES],
    /// Most slots each priority may hold (the adaptive limit's shares; all by default).
    caps: [usize; PRIORITIES],
    waiters: [VecDeque<Waiter>; PRIORITIES],
    /// Each queue's deadlines never decrease from front to back (its waiters share one
    /// timeout, the usual case): the sweeper then only looks at its front. A waiter with an
    /// earlier deadline than the one before it clears this until the queue is empty.
    ordered: [bool; PRIORITIES],
    /// The sweeper's next wake-up while it runs (`None`: no sweeper).
    sweep_at: Option<Instant>,
    /// The sweeper task, to start another if its runtime went away under it.
    sweeper: Option<tokio::task::JoinHandle<()>>,
}

impl Inner {
    /// Entries in the wait queues (including waiters that left and are not yet popped).
    fn queued(&self) -> usize {
        self.waiters.iter().map(VecDeque::len).sum()
    }

    /// Whether priority `p` may take a free slot now: one is free beyond the reserve (for
    /// non-critical priorities) and `p` is below its cap.
    fn may_take(&self, p: usize) -> bool {
        let keep = if p == 0 { 0 } else { self.reserve };
        self.available > keep && self.held[p] < self.caps[p]
    }

    /// Takes a slot for the most urgent live waiter allowed one, if any.
    fn pop_eligible(&mut self) -> Option<(usize, oneshot::Sender<SlotPermit>)> {
        for p in 0..PRIORITIES {
            if !self.may_take(p) {
                continue;
            }
            while let Some(Waiter { tx, .. }) = self.waiters[p].pop_front() {
                if !tx.is_closed() {
                    self.available -= 1;
                    self.held[p] += 1;
                    return Some((p, tx));
                }
            }
        }
        None
    }
}

/// The right to hold one backend connection of the pool.
pub struct SlotPermit {
    slots: Arc<Slots>,
    priority: usize,
    armed: bool,
}

impl Drop for SlotPermit {
    fn drop(&mut self) {
        if self.armed {
            self.slots.release(self.priority);
        }
    }
}

/// Why no slot was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotError {
    /// The deadline passed first.
    Timeout,
    /// No slot free and `max_waiting` already waiting: refused at once (never priority 0).
    Full,
}

impl Slots {
    /// `capacity` slots, `reserve` of which (at most `capacity - 1`) only critical waiters
    /// may take.
    pub fn new(capacity: usize, reserve: usize) -> Arc<Slots> {
        Arc::new(Slots {
            inner: Mutex::new(Inner {
                available: capacity,
                reserve: reserve.min(capacity.saturating_sub(1)),
                held: [0; PRIORITIES],
                caps: [capacity; PRIORITIES],
                waiters: Default::default(),
                ordered: [true; PRIORITIES],
                sweep_at: None,
                sweeper: None,
            }),
            sweep: Notify::new(),
            parking: Parking::default(),
        })
    }

    /// Takes a slot, waiting in `priority`'s queue (0 = most urgent) until `deadline` —
    /// unless `max_waiting` clients already wait, when a non-critical one is refused at once
    /// (critical waiters are never turned away: the cap keeps the rest of a storm from
    /// piling up, critical traffic has its own limits).
    pub async fn acquire(
        self: &Arc<Self>,
        priority: usize,
        deadline: Instant,
        max_waiting: usize,
    ) -> Result<SlotPermit, SlotError> {
        self.acquire_at(priority, Instant::now(), deadline, max_waiting)
            .await
    }

    /// [`Slots::acquire`] asked at `now` (the caller's clock reading of this instant).
    pub async fn acquire_at(
        self: &Arc<Self>,
        priority: usize,
        now: Instant,
        deadline: Instant,
        max_waiting: usize,
    ) -> Result<SlotPermit, SlotError> {
        let priority = priority.min(PRIORITIES - 1);
        let rx = {
            let mut g = self.inner.lock();
            if let Some(p) = self.take_free(&mut g, priority) {
                return Ok(p);
            }
            if priority > 0 && g.queued() >= max_waiting {
                // Waiters that left are dropped from the queues lazily: count only live ones
                // before refusing (rare: only at the cap).
                for q in &mut g.waiters {
                    q.retain(|w| !w.tx.is_closed());
                }
                if g.queued() >= max_waiting {
                    return Err(SlotError::Full);
                }
            }
            if deadline <= now {
                return Err(SlotError::Timeout);
            }
            let (tx, rx) = oneshot::channel();
            match g.waiters[priority].back() {
                None => g.ordered[priority] = true,
                Some(last) if deadline < last.deadline => g.ordered[priority] = false,
                Some(_) => {}
            }
            g.waiters[priority].push_back(Waiter { tx, deadline });
            // A sweeper that ended without clearing `sweep_at` was cancelled with its runtime
            // (a pool used from another runtime, as in tests): start a new one here.
            let running = g.sweeper.as_ref().is_some_and(|h| !h.is_finished());
            match g.sweep_at {
                Some(at) if running => {
                    if deadline < at {
                        g.sweep_at = Some(deadline);
                        self.sweep.notify_one();
                    }
                }
                _ => {
                    g.sweep_at = Some(deadline);
                    g.sweeper = Some(tokio::spawn(sweep(Arc::clone(self))));
                }
            }
            rx
        };
        // A backend parked with an idle client comes back to serve this wait.
        self.parking.revoke_one();
        // The sender is dropped unanswered when the deadline comes (or the pool goes).
        rx.await.map_err(|_| SlotError::Timeout)
    }

    /// A slot comes back: straight to the most urgent waiter allowed it (one lock).
    fn release(self: &Arc<Self>, priority: usize) {
        let next = {
            let mut g = self.inner.lock();
            g.held[priority] = g.held[priority].saturating_sub(1);
            g.available += 1;
            g.pop_eligible()
        };
        if let Some((p, tx)) = next
            && !self.hand(p, tx)
        {
            self.grant();
        }
    }

    /// Hands free slots to the waiters allowed them, most urgent first.
    fn grant(self: &Arc<Self>) {
        loop {
            let Some((priority, tx)) = self.inner.lock().pop_eligible() else {
                return;
            };
            self.hand(priority, tx);
        }
    }

    /// Sends a slot taken for a waiter of `priority`; `false` (and the slot back) when the
    /// waiter left between the check and the send.
    fn hand(self: &Arc<Self>, priority: usize, tx: oneshot::Sender<SlotPermit>) -> bool {
        let permit = SlotPermit {
            slots: self.clone(),
            priority,
            armed: true,
        };
        match tx.send(permit) {
            Ok(()) => true,
            Err(mut p) => {
                p.armed = false;
                let mut g = self.inner.lock();
                g.held[priority] = g.held[priority].saturating_sub(1);
                g.available += 1;
                false
            }
        }
    }

    /// The adaptive limit's shares (most slots per priority); new room goes to waiters.
    /// A slot for `priority` if one is free now and nobody of equal or higher priority waits.
    pub fn try_acquire(self: &Arc<Self>, priority: usize) -> Option<SlotPermit> {
        let priority = priority.min(PRIORITIES - 1);
        let mut g = self.inner.lock();
        self.take_free(&mut g, priority)
    }

    fn take_free(self: &Arc<Self>, g: &mut Inner, priority: usize) -> Option<SlotPermit> {
        // Someone of equal or higher priority already waiting goes first.
        let ahead = g.waiters[..=priority]
            .iter()
            .any(|q| q.iter().any(|w| !w.tx.is_closed()));
        if ahead || !g.may_take(priority) {
            return None;
        }
        g.available -= 1;
        g.held[priority] += 1;
        Some(SlotPermit {
            slots: self.clone(),
            priority,
            armed: true,
        })
    }

    pub fn set_caps(self: &Arc<Self>, caps: [usize; PRIORITIES]) {
        {
            let mut g = self.inner.lock();
            if g.caps == caps {
                return;
            }
            g.caps = caps;
        }
        self.grant();
    }

    /// Nobody waits and a slot is free beyond the critical reserve: a backend may stay
    /// parked with its idle client ([`Parking`]) without keeping anyone from one.
    pub fn quiet(&self) -> bool {
        let g = self.inner.lock();
        g.available > g.reserve && g.queued() == 0
    }

    /// Clients currently waiting for a slot.
    pub fn waiting(&self) -> usize {
        let g = self.inner.lock();
        g.waiters
            .iter()
            .map(|q| q.iter().filter(|w| !w.tx.is_closed()).count())
            .sum()
    }

    pub fn available(&self) -> usize {
        self.inner.lock().available
    }

    /// Slots only critical waiters may take.
    pub fn reserve(&self) -> usize {
        self.inner.lock().reserve
    }

    /// Most slots each priority may hold now.
    pub fn caps(&self) -> [usize; PRIORITIES] {
        self.inner.lock().caps
    }
}

/// The pool's sweeper: times out the waiters whose deadline has come (dropping a sender
/// wakes its waiter with the timeout) and waits for the earliest deadline left, until no one
/// waits. (It holds the pool only while someone waits, at most until the last deadline.)
async fn sweep(s: Arc<Slots>) {
    loop {
        let at = {
            let mut guard = s.inner.lock();
            let g = &mut *guard;
            let now = Instant::now();
            let mut earliest: Option<Instant> = None;
            let mut keep = |d: Instant| earliest = Some(earliest.map_or(d, |e| e.min(d)));
            for (q, ordered) in g.waiters.iter_mut().zip(g.ordered.iter_mut()) {
                if *ordered {
                    // Deadlines in order: the expired are at the front, and the front's is
                    // the queue's earliest (waiters that left further back go when they
                    // reach it). One look per expiry, not a pass over the queue.
                    while q
                        .front()
                        .is_some_and(|w| w.tx.is_closed() || w.deadline <= now)
                    {
                        q.pop_front();
                    }
                    if let Some(w) = q.front() {
                        keep(w.deadline);
                    }
                } else {
                    q.retain(|w| {
                        let live = !w.tx.is_closed() && w.deadline > now;
                        if live {
                            keep(w.deadline);
                        }
                        live
                    });
                }
                if q.is_empty() {
                    *ordered = true;
                }
            }
            g.sweep_at = earliest;
            match earliest {
                Some(at) => at,
                None => return,
            }
        };
        tokio::select! {
            biased;
            () = s.sweep.notified() => {}
            () = tokio::time::sleep_until(at) => {}
        }
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
        let first = s.acquire(2, far, usize::MAX).await.unwrap();
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
                let p = s.acquire(prio, far, usize::MAX).await.unwrap();
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
        let a = s.acquire(3, soon, usize::MAX).await.expect("low 1");
        let b = s.acquire(2, soon, usize::MAX).await.expect("normal");
        assert!(
            s.acquire(3, soon, usize::MAX).await.is_err(),
            "the last slot is reserved"
        );
        let c = s
            .acquire(0, soon, usize::MAX)
            .await
            .expect("critical takes the reserve");
        // All taken; a low waiter queues, and a released slot goes to it only if the
        // reserve would still be free: release the critical one → the reserve is back, the
        // low waiter keeps waiting.
        let s2 = s.clone();
        let low = tokio::spawn(async move {
            s2.acquire(3, now + Duration::from_secs(5), usize::MAX)
                .await
        });
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

    /// Caps hold a priority back even with free slots; raising them hands the room to its
    /// waiters at once.
    #[tokio::test(start_paused = true)]
    async fn caps_hold_a_priority_back_and_raising_them_grants_its_waiters() {
        let s = Slots::new(4, 0);
        let far = Instant::now() + Duration::from_secs(5);
        s.set_caps([4, 4, 4, 1]);
        let low = s.acquire(3, far, usize::MAX).await.expect("low's one");
        let s2 = s.clone();
        let second = tokio::spawn(async move { s2.acquire(3, far, usize::MAX).await });
        tokio::task::yield_now().await;
        assert!(
            !second.is_finished(),
            "low is at its cap with three slots free"
        );
        let normal = s
            .acquire(2, far, usize::MAX)
            .await
            .expect("normal is not capped");
        let critical = s
            .acquire(0, far, usize::MAX)
            .await
            .expect("critical is not capped");
        s.set_caps([4, 4, 4, 2]);
        let got = second
            .await
            .expect("task")
            .expect("the raised cap lets it in");
        assert_eq!(s.available(), 0);
        drop((low, normal, critical, got));
        assert_eq!(s.available(), 4);
    }

    /// At `max_waiting` waiters a non-critical newcomer is refused at once, a critical one
    /// still queues; waiters that left do not count.
    #[tokio::test(start_paused = true)]
    async fn max_waiting_refuses_at_once_except_critical() {
        let s = Slots::new(1, 0);
        let far = Instant::now() + Duration::from_secs(10);
        let held = s.acquire(2, far, 1).await.expect("the slot");
        let s2 = s.clone();
        let waiter = tokio::spawn(async move { s2.acquire(2, far, 1).await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert_eq!(s.acquire(3, far, 1).await.err(), Some(SlotError::Full));
        let s3 = s.clone();
        let critical = tokio::spawn(async move { s3.acquire(0, far, 1).await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert_eq!(s.waiting(), 2, "critical queued past the cap");
        waiter.abort();
        let _ = waiter.await;
        // The aborted waiter's entry is still queued, but it is not counted.
        let s4 = s.clone();
        let next = tokio::spawn(async move { s4.acquire(2, far, 2).await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert!(
            !next.is_finished(),
            "it queues: only the critical one waits"
        );
        drop(held);
        assert_eq!(critical.await.expect("task"), Ok(()), "critical first");
        assert_eq!(next.await.expect("task"), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn deadline_and_dropped_waiters_never_leak() {
        let s = Slots::new(1, 0);
        let start = Instant::now();
        let held = s
            .acquire(2, start + Duration::from_secs(1), usize::MAX)
            .await
            .unwrap();
        let r = s
            .acquire(2, start + Duration::from_millis(200), usize::MAX)
            .await;
        assert!(r.is_err());
        assert_eq!(start.elapsed(), Duration::from_millis(200));
        // A waiter that is dropped mid-wait leaves the queue.
        let s2 = s.clone();
        let w = tokio::spawn(async move {
            s2.acquire(2, start + Duration::from_secs(60), usize::MAX)
                .await
        });
        tokio::task::yield_now().await;
        assert_eq!(s.waiting(), 1);
        w.abort();
        let _ = w.await;
        assert_eq!(s.waiting(), 0);
        drop(held);
        assert_eq!(s.available(), 1);
    }

    /// A slot held by a parked client is asked back when a checkout has to wait, and
    /// nobody may park while someone waits or only the critical reserve is free.
    #[tokio::test(start_paused = true)]
    async fn a_waiter_revokes_a_parked_slot_and_parking_needs_a_free_one() {
        use super::super::park::Ticket;
        use std::task::{Context, Waker};
        let (s, start, held) = one_slot_held().await;
        assert!(!s.quiet(), "no slot free beyond the reserve");
        let ticket = Arc::new(Ticket::default());
        s.parking.park(&ticket);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(!ticket.revoked(&mut cx));
        let w = waiter(&s, start, 60_000);
        tokio::task::yield_now().await;
        assert_eq!(s.waiting(), 1);
        assert!(
            ticket.revoked(&mut cx),
            "the waiter asked for the parked slot"
        );
        assert!(s.parking.is_empty());
        // The parked client gives it back, as a session does when revoked.
        drop(held);
        let (err, _) = w.await.unwrap();
        assert_eq!(err, None, "the waiter got the slot");

        let two = Slots::new(2, 1);
        let far = start + Duration::from_secs(60);
        assert!(two.quiet());
        let _p = two.acquire(2, far, usize::MAX).await.unwrap();
        assert!(!two.quiet(), "the one slot left is the critical reserve");
    }

    /// A pool of one slot, held (for a minute), and the time it was taken.
    async fn one_slot_held() -> (Arc<Slots>, Instant, SlotPermit) {
        let s = Slots::new(1, 0);
        let start = Instant::now();
        let held = s
            .acquire(2, start + Duration::from_secs(60), usize::MAX)
            .await
            .expect("the slot");
        (s, start, held)
    }

    /// A waiter for `s` with a deadline `ms` after `start`: its error, if any, and when.
    fn waiter(
        s: &Arc<Slots>,
        start: Instant,
        ms: u64,
    ) -> tokio::task::JoinHandle<(Option<SlotError>, Duration)> {
        let s = s.clone();
        tokio::spawn(async move {
            let r = s
                .acquire(2, start + Duration::from_millis(ms), usize::MAX)
                .await;
            (r.err(), start.elapsed())
        })
    }

    /// Each waiter times out at its own deadline, also one that arrives after a waiter with
    /// a later deadline (the sweeper is woken to look sooner); the sweeper ends with the last
    /// waiter and a later wait starts a new one.
    #[tokio::test(start_paused = true)]
    async fn each_waiter_times_out_at_its_own_deadline() {
        let (s, start, held) = one_slot_held().await;
        let wait = |ms: u64| waiter(&s, start, ms);
        let late = wait(5_000);
        tokio::task::yield_now().await;
        let early = wait(300);
        let (e, at) = early.await.expect("task");
        assert_eq!(e, Some(SlotError::Timeout));
        assert_eq!(
            at,
            Duration::from_millis(300),
            "the earlier deadline was kept"
        );
        let (e, at) = late.await.expect("task");
        assert_eq!(e, Some(SlotError::Timeout));
        assert_eq!(at, Duration::from_secs(5));
        tokio::task::yield_now().await;
        assert!(s.inner.lock().sweep_at.is_none(), "the sweeper ended");
        // A new wait after that is kept again, and a released slot still reaches a waiter.
        let again = wait(7_000);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(s.waiting(), 1);
        drop(held);
        let (e, _) = again.await.expect("task");
        assert_eq!(e, None, "the waiter got the released slot");
        assert_eq!(s.available(), 1);
    }

    /// A sweeper cancelled with its runtime is replaced: a waiter from another runtime still
    /// times out at its deadline.
    #[test]
    fn a_sweeper_lost_with_its_runtime_is_replaced() {
        let rt = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .expect("runtime")
        };
        let s = Slots::new(1, 0);
        let held = rt().block_on(async {
            let far = Instant::now() + Duration::from_secs(60);
            let held = s.acquire(2, far, usize::MAX).await.expect("the slot");
            let s2 = s.clone();
            tokio::spawn(async move { s2.acquire(2, far, usize::MAX).await.map(|_| ()) });
            tokio::time::sleep(Duration::from_millis(1)).await;
            assert!(s.inner.lock().sweep_at.is_some());
            held
        });
        // That runtime is gone, with its waiter and its sweeper.
        let r = rt().block_on(async {
            let start = Instant::now();
            let r = s
                .acquire(2, start + Duration::from_millis(250), usize::MAX)
                .await;
            (r.err(), start.elapsed())
        });
        assert_eq!(r, (Some(SlotError::Timeout), Duration::from_millis(250)));
        drop(held);
        assert_eq!(s.available(), 1);
    }

    /// Waiters with one timeout queue in deadline order: each still times out at its own
    /// deadline (the sweeper looks only at the front), one that left is skipped, and one
    /// served before its deadline is not timed out.
    #[tokio::test(start_paused = true)]
    async fn waiters_in_deadline_order_time_out_in_turn() {
        let (s, start, held) = one_slot_held().await;
        let wait = |ms: u64| waiter(&s, start, ms);
        let mut tasks = Vec::new();
        for ms in [100, 200, 300, 400] {
            tasks.push(wait(ms));
            tokio::task::yield_now().await;
        }
        let last = wait(10_000);
        tokio::task::yield_now().await;
        assert!(s.inner.lock().ordered[2], "one timeout: in deadline order");
        // The 300 ms waiter leaves early; the others time out at their own deadlines.
        tasks.remove(2).abort();
        for (t, ms) in tasks.into_iter().zip([100u64, 200, 400]) {
            let (e, at) = t.await.expect("task");
            assert_eq!(e, Some(SlotError::Timeout));
            assert_eq!(at, Duration::from_millis(ms));
        }
        // The last one is served, not timed out, when the slot comes back.
        drop(held);
        let (e, _) = last.await.expect("task");
        assert_eq!(e, None);
        assert_eq!(s.available(), 1);
    }
}
