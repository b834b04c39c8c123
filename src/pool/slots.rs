//! Backend slots of one pool: a counting semaphore whose waiters are served by priority
//! (critical → low), FIFO within a priority, each with its own deadline. The last `reserve`
//! free slots are the critical priority's alone: other priorities take a slot only while
//! more than `reserve` are free, so a storm of lower-priority work can never hold every
//! backend while critical work waits. The reserve grows with what critical work uses: to one
//! more than the most slots it held at once in the last [`PEAK_WINDOW`] (up to a
//! [`YIELD_SHARE`]th of the pool), so a critical caller whose transactions overlap — more of
//! them as the database slows — still finds a slot free when lower priorities hold the rest,
//! instead of waiting for one of their transactions (a report's: seconds) to end.
//!
//! A slot is handed to a waiter through its *mailbox*: an entry of a slab kept under the same
//! lock as the counts and the queues. A release that finds a waiter marks its mailbox granted
//! and wakes it, in one lock; the waiter takes the slot when it runs. A waiter that times out
//! or whose client disconnects at the exact moment of the hand-off frees its mailbox on drop
//! and passes a slot granted meanwhile on: no slot is ever lost and none is double-counted.
//! Mailboxes are reused (a generation tells a queue entry whose waiter left from a live
//! one), so a wait allocates nothing: at 64 clients on 20 backends nearly every checkout
//! waits, and a channel per wait cost as much as the rest of it.
//!
//! A newcomer that finds no slot is decided at arrival ([`Arrival`], one per priority, fed
//! with the slots granted to that priority and those above it): it waits unless its case is
//! hopeless — more than twice its deadline even at the best pace shown — when it is refused
//! at once with a hint around its expected wait, not after it has waited. Critical waiters
//! always wait.
//!
//! While a high or normal waiter has queued in the last [`PRESSURE_HOLD`], the priorities
//! below it take at most a [`YIELD_SHARE`]th of the slots: work that holds a backend for
//! seconds (a report at low priority) cannot take back the backends a storm's short
//! transactions need each time the storm's queue empties for a moment.
//!
//! With fair shares on (`pool.fair_shares`), the waiters of one priority are not served
//! first come, first served: a free slot goes to the waiter whose caller has the least
//! *competing time* per unit of its weight — backend time held while someone waited,
//! decayed — FIFO within a caller, and a caller above its `db_time_share` is not served
//! while above ([`Shares`], whose docs give the measures; `Slots::publish` tells it when
//! the queues empty and fill). Priorities, the critical reserve, the yield shares and the
//! caps come first, as without.
//! The choice looks over the priority's queue (a scan per grant, not a pop): fine at the
//! hundreds of waiters a pool sees, and only when the option is on. Every permit of a
//! caller's checkout carries the caller and when it was granted, and charges the time to
//! the caller when it is dropped — on or off, so `/v1/callers` shows the shares before an
//! operator turns them on.
//!
//! Deadlines are kept by one sweeper task per pool while anyone waits, not by a timer per
//! waiter: at hundreds of clients per backend most checkouts wait, and registering and
//! removing a timer for each cost more than the rest of the wait. The sweeper sleeps until
//! the earliest deadline (woken sooner when a waiter with an earlier one arrives), times out
//! the waiters whose deadline has come — under the same lock as the hand-off, so a waiter
//! gets either its slot or its timeout — and ends when the queues are empty.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::park::Parking;
use crate::policy::arrival::{Arrival, ArrivalStats, Decision, Line, Placed};
use crate::policy::share::{Asker, ShareStats, Shares};

/// Number of priority classes (critical, high, normal, low).
pub const PRIORITIES: usize = 4;

/// How long a high or normal waiter keeps the priorities below it to their yield share.
pub const PRESSURE_HOLD: Duration = Duration::from_secs(10);

/// Under pressure, a lower priority holds at most `capacity / YIELD_SHARE` slots (at least 1).
pub const YIELD_SHARE: usize = 4;

/// How long the most slots critical work held at once keeps the reserve that large (it
/// counts for one to two windows).
pub const PEAK_WINDOW: Duration = Duration::from_secs(10);

/// With fair shares, how often the sweeper looks again while a waiter's caller is above its
/// share and holds a backend.
pub const SHARE_LOOK: Duration = Duration::from_millis(50);

pub struct Slots {
    inner: Mutex<Inner>,
    /// Slots held by idle clients that give them back when asked (a waiter asks).
    pub parking: Parking,
    /// Wakes the sweeper to look again (a waiter with an earlier deadline arrived).
    sweep: Notify,
    /// Entries in the wait queues as of the last change (stale ones included), read without
    /// the lock: while any is queued, a checkout skips its fast path ([`Slots::queue_empty`]).
    queued: AtomicUsize,
}

/// One queue entry: whose mailbox, for which of its waits, until when, for which caller.
struct Waiter {
    mailbox: usize,
    generation: u64,
    deadline: Instant,
    caller: Option<u16>,
}

/// Where one wait's outcome is left for its waiter.
#[derive(Default)]
struct Mailbox {
    /// Bumped each time the mailbox is freed: a queue entry of an earlier wait is stale.
    generation: u64,
    state: Mail,
    waker: Option<Waker>,
    /// The caller of its wait, and when a slot was granted to it (the permit's start).
    caller: Option<u16>,
    since: Option<Instant>,
}

#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum Mail {
    /// On the free list.
    #[default]
    Free,
    /// Its waiter is queued.
    Waiting,
    /// A slot of this priority was taken for its waiter (counted as held).
    Granted(usize),
    /// Its deadline came first.
    TimedOut,
}

/// The most of something seen at once in the current [`PEAK_WINDOW`] and the one before.
#[derive(Default)]
struct Peak {
    current: usize,
    previous: usize,
    since: Option<Instant>,
}

impl Peak {
    fn note(&mut self, n: usize, now: Instant) {
        match self.since {
            Some(t) if now.saturating_duration_since(t) < PEAK_WINDOW => {}
            Some(t) => {
                // The window before the new one counts if it was the one just ended.
                let ended_now = now.saturating_duration_since(t) < 2 * PEAK_WINDOW;
                self.previous = if ended_now { self.current } else { 0 };
                self.current = 0;
                self.since = Some(now);
            }
            None => self.since = Some(now),
        }
        self.current = self.current.max(n);
    }

    fn get(&self) -> usize {
        self.current.max(self.previous)
    }
}

struct Inner {
    capacity: usize,
    available: usize,
    /// Free slots only priority 0 may take (at least; see [`Inner::keep`]).
    reserve: usize,
    /// The most slots priority 0 held at once, this window and the last.
    critical_peak: Peak,
    /// The reserve grows with `critical_peak` (an operator's explicit reserve does not).
    reserve_grows: bool,
    /// Slots each priority holds now.
    held: [usize; PRIORITIES],
    /// Most slots each priority may hold (the adaptive limit's shares; all by default).
    caps: [usize; PRIORITIES],
    waiters: [VecDeque<Waiter>; PRIORITIES],
    /// Each queue's deadlines never decrease from front to back (its waiters share one
    /// timeout, the usual case): the sweeper then only looks at its front. A waiter with an
    /// earlier deadline than the one before it clears this until the queue is empty.
    ordered: [bool; PRIORITIES],
    /// The mailboxes, and the free ones among them.
    mailboxes: Vec<Mailbox>,
    free: Vec<usize>,
    /// The sweeper's next wake-up while it runs (`None`: no sweeper).
    sweep_at: Option<Instant>,
    /// The sweeper task, to start another if its runtime went away under it.
    sweeper: Option<tokio::task::JoinHandle<()>>,
    /// Waiters of each priority granted a slot since start.
    served: [u64; PRIORITIES],
    /// The arrival decision of each priority's newcomers.
    arrivals: [Arrival; PRIORITIES],
    /// When a waiter of each priority last queued, while that presses on those below.
    pressed: [Option<Instant>; PRIORITIES],
    /// Serve the waiters of a priority by their callers' backend time (`pool.fair_shares`).
    fair: bool,
    /// Backend time by caller (kept on or off).
    shares: Shares,
}

/// Wakers to call once the lock is released: one without allocating (a release grants at
/// most one slot), more when caps rise or deadlines pass.
#[derive(Default)]
struct Wakes {
    one: Option<Waker>,
    more: Vec<Waker>,
}

impl Wakes {
    fn push(&mut self, w: Option<Waker>) {
        let Some(w) = w else { return };
        match self.one {
            None => self.one = Some(w),
            Some(_) => self.more.push(w),
        }
    }

    fn wake(self) {
        self.one.into_iter().chain(self.more).for_each(Waker::wake);
    }
}

impl Inner {
    /// Free slots the priorities below critical leave alone: the configured reserve, or one
    /// more than critical work's recent peak when that is larger (at most a [`YIELD_SHARE`]th
    /// of the pool). No reserve (no critical caller, or a pool under four): none; a reserve
    /// the operator set ([`Slots::fix_reserve`]): exactly that.
    fn keep(&self) -> usize {
        if self.reserve == 0 || !self.reserve_grows {
            return self.reserve;
        }
        let grown = (self.critical_peak.get() + 1).min(self.capacity / YIELD_SHARE);
        self.reserve.max(grown)
    }

    /// Entries in the wait queues (including waiters that left and are not yet popped).
    fn queued(&self) -> usize {
        self.waiters.iter().map(VecDeque::len).sum()
    }

    /// The waiter of this entry still waits (it did not leave, time out or get a slot).
    fn live(&self, w: &Waiter) -> bool {
        g_live(&self.mailboxes, w)
    }

    /// Whether priority `p` may take a free slot now: one is free beyond the reserve (for
    /// non-critical priorities) and `p` is below its cap — its yield share while a more
    /// urgent (non-critical) priority is under pressure.
    fn may_take(&self, p: usize) -> bool {
        let keep = if p == 0 { 0 } else { self.keep() };
        let mut cap = self.caps[p];
        if p > 1 && self.pressed[1..p].iter().any(Option::is_some) {
            cap = cap.min((self.capacity / YIELD_SHARE).max(1));
        }
        self.available > keep && self.held[p] < cap
    }

    /// Where a newcomer of `p` that may wait `room` stands: behind the waiters of `p` and the
    /// priorities above it, served by the slots granted to them.
    fn line(&self, p: usize, caller: Option<u16>, room: Duration) -> Line {
        let mut ahead = self.waiters[..=p].iter().map(VecDeque::len).sum::<usize>();
        if self.fair {
            // Served by time, a newcomer stands behind its own caller's waiters and about
            // one turn of each other caller waiting at its priority, not the whole queue.
            let mut others: Vec<Option<u16>> = Vec::new();
            let mut own = 0;
            for w in &self.waiters[p] {
                if w.caller == caller {
                    own += 1;
                } else if !others.contains(&w.caller) {
                    others.push(w.caller);
                }
            }
            ahead = ahead - self.waiters[p].len() + own + others.len();
        }
        Line {
            served: self.served[..=p].iter().sum(),
            ahead: ahead as u64,
            room,
        }
    }

    /// Gives free slots to the most urgent live waiters allowed them; their wakers go to
    /// `wakes`.
    /// `now`: the caller's clock reading, if it has one; else the clock is read once, and
    /// only when a permit of a caller needs its start or the choice needs the callers' times.
    fn grant(&mut self, now: Option<Instant>, wakes: &mut Wakes) {
        let mut now = now;
        'next: for p in 0..PRIORITIES {
            while self.may_take(p) {
                let w = if self.fair {
                    let at = *now.get_or_insert_with(Instant::now);
                    let Some(i) = self.pick(p, at) else {
                        continue 'next;
                    };
                    self.waiters[p].remove(i)
                } else {
                    self.waiters[p].pop_front()
                };
                let Some(w) = w else {
                    continue 'next;
                };
                if !self.live(&w) {
                    continue;
                }
                self.available -= 1;
                self.held[p] += 1;
                self.served[p] += 1;
                if p == 0 {
                    let at = *now.get_or_insert_with(Instant::now);
                    self.critical_peak.note(self.held[0], at);
                }
                let since = w.caller.map(|c| {
                    let at = *now.get_or_insert_with(Instant::now);
                    self.shares.start(c, at);
                    at
                });
                let m = &mut self.mailboxes[w.mailbox];
                m.state = Mail::Granted(p);
                m.since = since;
                wakes.push(m.waker.take());
            }
        }
    }

    /// The waiter of priority `p` to serve next with fair shares: the first of the caller
    /// with the least rank among those not above their share (`None`: none may
    /// be served). Waiters that left are skipped (and popped from the front).
    fn pick(&mut self, p: usize, now: Instant) -> Option<usize> {
        while self.waiters[p].front().is_some_and(|w| !self.live(w)) {
            self.waiters[p].pop_front();
        }
        let mut best: Option<(f64, usize)> = None;
        for (i, w) in self.waiters[p].iter().enumerate() {
            if !self.live(w) {
                continue;
            }
            let Some(rank) = self.shares.rank(w.caller, now, self.capacity) else {
                continue;
            };
            if best.is_none_or(|(b, _)| rank < b) {
                best = Some((rank, i));
            }
        }
        best.map(|(_, i)| i)
    }

    /// With fair shares, when a waiter whose caller is above its share may be served again
    /// (the sweeper looks then): at once computed for a caller that holds nothing, a short
    /// look again ([`SHARE_LOOK`]) for one that holds a backend and may release it meanwhile
    /// (its release looks too, but only once).
    fn next_share_look(&self, now: Instant) -> Option<Instant> {
        if !self.fair {
            return None;
        }
        let mut next: Option<Instant> = None;
        for w in self.waiters.iter().flatten() {
            let Some(c) = w.caller else { continue };
            if !self.live(w) || self.shares.rank(Some(c), now, self.capacity).is_some() {
                continue;
            }
            let at = now
                + self
                    .shares
                    .under_share_in(c, now, self.capacity)
                    .unwrap_or(SHARE_LOOK);
            next = Some(next.map_or(at, |n| n.min(at)));
        }
        next
    }

    /// A mailbox for a new wait, from the free list or new.
    fn open_mailbox(&mut self) -> (usize, u64) {
        let i = self.free.pop().unwrap_or_else(|| {
            self.mailboxes.push(Mailbox::default());
            self.mailboxes.len() - 1
        });
        let m = &mut self.mailboxes[i];
        m.state = Mail::Waiting;
        m.since = None;
        (i, m.generation)
    }

    /// The wait of mailbox `i` is over: back to the free list; its queue entry, if still
    /// queued, is stale from now on.
    fn close_mailbox(&mut self, i: usize) {
        let m = &mut self.mailboxes[i];
        m.generation += 1;
        m.state = Mail::Free;
        m.waker = None;
        m.caller = None;
        m.since = None;
        self.free.push(i);
    }

    /// A slot of `priority` comes back: to the waiters allowed one. `held`: its caller, and
    /// when it took the slot and gave it back, to charge the time to the caller.
    fn put_back(
        &mut self,
        priority: usize,
        held: Option<(u16, Instant, Instant)>,
        wakes: &mut Wakes,
    ) {
        if let Some((caller, since, now)) = held {
            self.shares.finish(caller, since, now);
        }
        let now = held.map(|(_, _, now)| now);
        self.held[priority] = self.held[priority].saturating_sub(1);
        self.available += 1;
        self.grant(now, wakes);
    }
}

/// The right to hold one backend connection of the pool; a caller's charges its time to the
/// caller when dropped.
pub struct SlotPermit {
    slots: Arc<Slots>,
    priority: usize,
    /// The caller and when the slot was taken (`None`: a checkout of the proxy's own).
    held: Option<(u16, Instant)>,
    /// When the holder gave it back, if it had the clock read then ([`SlotPermit::end_at`]);
    /// otherwise the drop reads it.
    ended: Option<Instant>,
}

impl SlotPermit {
    /// The slot is given back at `now` (the holder's clock reading), when it drops: its
    /// caller is charged up to then, with no clock read of its own.
    pub fn end_at(&mut self, now: Instant) {
        self.ended = Some(now);
    }
}

impl Drop for SlotPermit {
    fn drop(&mut self) {
        self.slots.release(self.priority, self.held, self.ended);
    }
}

/// Why no slot was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotError {
    /// The deadline passed first.
    Timeout,
    /// No slot free and `max_waiting` already waiting: refused at once (never priority 0).
    Full,
    /// The expected wait does not fit the deadline: refused at once (never priority 0).
    WouldWait { place: Placed },
}

impl Slots {
    /// `capacity` slots, `reserve` of which (at most `capacity - 1`) only critical waiters
    /// may take.
    pub fn new(capacity: usize, reserve: usize) -> Arc<Slots> {
        Self::with_fair(capacity, reserve, false)
    }

    /// [`Slots::new`], serving the waiters of a priority by their callers' backend time
    /// when `fair`.
    pub fn with_fair(capacity: usize, reserve: usize, fair: bool) -> Arc<Slots> {
        Arc::new(Slots {
            inner: Mutex::new(Inner {
                capacity,
                available: capacity,
                reserve: reserve.min(capacity.saturating_sub(1)),
                critical_peak: Peak::default(),
                reserve_grows: true,
                held: [0; PRIORITIES],
                caps: [capacity; PRIORITIES],
                waiters: Default::default(),
                ordered: [true; PRIORITIES],
                mailboxes: Vec::new(),
                free: Vec::new(),
                sweep_at: None,
                sweeper: None,
                served: [0; PRIORITIES],
                arrivals: Default::default(),
                pressed: [None; PRIORITIES],
                fair,
                shares: Shares::new(Instant::now()),
            }),
            sweep: Notify::new(),
            parking: Parking::default(),
            queued: AtomicUsize::new(0),
        })
    }

    /// Records the queues' length after a change, under the lock, and tells the callers' backend
    /// time whether anyone waits now.
    fn publish(&self, g: &mut Inner) {
        let queued = g.queued();
        let before = self.queued.swap(queued, Ordering::Relaxed);
        if (before == 0) != (queued == 0) {
            g.shares.contended(queued > 0, Instant::now());
        }
    }

    /// Nobody was queued at the last change: a slot may be free for the taking. Without the
    /// lock, so a checkout that would find a queue (most at 64 clients on 20 backends) goes
    /// straight to waiting instead of taking the lock twice; a stale answer only sends a
    /// checkout the longer way, which decides under the lock.
    pub fn queue_empty(&self) -> bool {
        self.queued.load(Ordering::Relaxed) == 0
    }

    /// Takes a slot, waiting in `priority`'s queue (0 = most urgent) until `deadline` —
    /// unless `max_waiting` clients already wait, when a non-critical one is refused at once
    /// (critical waiters are never turned away: the cap keeps the rest of a storm from
    /// piling up, critical traffic has its own limits).
    pub async fn acquire(
        self: &Arc<Self>,
        asker: impl Into<Asker>,
        deadline: Instant,
        max_waiting: usize,
    ) -> Result<SlotPermit, SlotError> {
        self.acquire_at(asker.into(), Instant::now(), deadline, max_waiting)
            .await
    }

    /// [`Slots::acquire`] asked at `now` (the caller's clock reading of this instant).
    pub async fn acquire_at(
        self: &Arc<Self>,
        asker: Asker,
        now: Instant,
        deadline: Instant,
        max_waiting: usize,
    ) -> Result<SlotPermit, SlotError> {
        let priority = asker.priority.min(PRIORITIES - 1);
        let mut wakes = Wakes::default();
        let mailbox = {
            let mut guard = self.inner.lock();
            let g = &mut *guard;
            if let Some(p) = self.take_free(g, &asker, now) {
                return Ok(p);
            }
            if priority > 0 && g.queued() >= max_waiting {
                // Waiters that left are dropped from the queues lazily: count only live ones
                // before refusing (rare: only at the cap).
                let mut waiters = std::mem::take(&mut g.waiters);
                for q in &mut waiters {
                    q.retain(|w| g.live(w));
                }
                g.waiters = waiters;
                self.publish(g);
                if g.queued() >= max_waiting {
                    return Err(SlotError::Full);
                }
            }
            if deadline <= now {
                return Err(SlotError::Timeout);
            }
            if priority > 0 {
                // Found no slot: the priorities below yield, whether this one waits or not.
                if priority < PRIORITIES - 1 {
                    g.pressed[priority] = Some(now);
                }
                let line = g.line(priority, asker.caller, deadline - now);
                if let Decision::Refuse(place) = g.arrivals[priority].decide(line, now) {
                    return Err(SlotError::WouldWait { place });
                }
            }
            let (mailbox, generation) = g.open_mailbox();
            match g.waiters[priority].back() {
                None => g.ordered[priority] = true,
                Some(last) if deadline < last.deadline => g.ordered[priority] = false,
                Some(_) => {}
            }
            g.mailboxes[mailbox].caller = asker.caller;
            g.waiters[priority].push_back(Waiter {
                mailbox,
                generation,
                deadline,
                caller: asker.caller,
            });
            self.publish(g);
            if g.fair {
                // A free slot the waiters ahead may not take (their callers above their
                // shares) may be this one's.
                g.grant(Some(now), &mut wakes);
                self.publish(g);
            }
            // A sweeper that ended without clearing `sweep_at` was cancelled with its runtime
            // (a pool used from another runtime, as in tests): start a new one here.
            let running = g.sweeper.as_ref().is_some_and(|h| !h.is_finished());
            // With fair shares the sweeper also looks when a caller held back by its share
            // may be served again.
            let look = g
                .next_share_look(now)
                .map_or(deadline, |at| at.min(deadline));
            match g.sweep_at {
                Some(at) if running => {
                    if look < at {
                        g.sweep_at = Some(look);
                        self.sweep.notify_one();
                    }
                }
                _ => {
                    g.sweep_at = Some(look);
                    g.sweeper = Some(tokio::spawn(sweep(Arc::clone(self))));
                }
            }
            mailbox
        };
        wakes.wake();
        // A backend parked with an idle client comes back to serve this wait. The fence
        // pairs with the one in `park`: this wait sees a ticket parked concurrently, or that
        // park sees this wait queued.
        std::sync::atomic::fence(Ordering::SeqCst);
        self.parking.revoke_one();
        Wait {
            slots: self,
            mailbox: Some(mailbox),
        }
        .await
    }

    /// A slot comes back: straight to the most urgent waiter allowed it (one lock).
    fn release(
        self: &Arc<Self>,
        priority: usize,
        held: Option<(u16, Instant)>,
        ended: Option<Instant>,
    ) {
        let mut wakes = Wakes::default();
        let held = held.map(|(caller, since)| (caller, since, ended.unwrap_or_else(Instant::now)));
        {
            let mut g = self.inner.lock();
            g.put_back(priority, held, &mut wakes);
            self.publish(&mut g);
        }
        wakes.wake();
    }

    /// A `priority` waiter's deadline passed: counted as a wasted wait.
    pub fn waited_out(&self, priority: usize) {
        self.inner.lock().arrivals[priority.min(PRIORITIES - 1)].waited_out();
    }

    /// The periodic look (once a second): resolves the arrival decisions' hint checks, ends
    /// the pressure of priorities that have not queued for [`PRESSURE_HOLD`] and lets the
    /// critical reserve shrink back to critical work's recent peak.
    pub fn tick(self: &Arc<Self>, now: Instant) {
        let mut wakes = Wakes::default();
        {
            let mut g = self.inner.lock();
            for p in 0..PRIORITIES {
                let served = g.served[..=p].iter().sum();
                g.arrivals[p].tick(served, now);
            }
            // The reserve shrinks back once critical work's peak is two windows old.
            let kept = g.keep();
            let held = g.held[0];
            g.critical_peak.note(held, now);
            let mut relaxed = g.keep() < kept;
            for at in &mut g.pressed {
                if at.is_some_and(|t| now.saturating_duration_since(t) >= PRESSURE_HOLD) {
                    *at = None;
                    relaxed = true;
                }
            }
            // With fair shares, a caller held back by its share may have decayed under it.
            if relaxed || g.fair {
                g.grant(Some(now), &mut wakes);
                self.publish(&mut g);
            }
        }
        wakes.wake();
    }

    /// What the arrival decisions of all priorities did.
    pub fn arrival_stats(&self) -> ArrivalStats {
        let g = self.inner.lock();
        let mut s = ArrivalStats::default();
        for a in &g.arrivals {
            s.add(&a.stats());
        }
        s
    }

    /// A slot for `asker` if one is free now and nobody of equal or higher priority waits
    /// (asked at `now`).
    pub fn try_acquire(
        self: &Arc<Self>,
        asker: impl Into<Asker>,
        now: Instant,
    ) -> Option<SlotPermit> {
        let mut g = self.inner.lock();
        self.take_free(&mut g, &asker.into(), now)
    }

    fn take_free(
        self: &Arc<Self>,
        g: &mut Inner,
        asker: &Asker,
        now: Instant,
    ) -> Option<SlotPermit> {
        let priority = asker.priority.min(PRIORITIES - 1);
        g.shares.note(asker);
        // Someone of equal or higher priority already waiting goes first.
        let ahead = g.waiters[..=priority]
            .iter()
            .any(|q| q.iter().any(|w| g.live(w)));
        if ahead || !g.may_take(priority) {
            return None;
        }
        if g.fair && g.shares.rank(asker.caller, now, g.capacity).is_none() {
            return None;
        }
        g.available -= 1;
        g.held[priority] += 1;
        if priority == 0 {
            let held = g.held[0];
            g.critical_peak.note(held, now);
        }
        if let Some(c) = asker.caller {
            g.shares.start(c, now);
        }
        Some(SlotPermit {
            slots: self.clone(),
            priority,
            held: asker.caller.map(|c| (c, now)),
            ended: None,
        })
    }

    /// Backend time by caller, as of `now`.
    pub fn shares(&self, now: Instant) -> Vec<ShareStats> {
        let g = self.inner.lock();
        g.shares.stats(now, g.capacity)
    }

    /// Whether the waiters of a priority are served by their callers' backend time.
    pub fn fair(&self) -> bool {
        self.inner.lock().fair
    }

    /// The adaptive limit's shares (most slots per priority); new room goes to waiters.
    pub fn set_caps(self: &Arc<Self>, caps: [usize; PRIORITIES]) {
        let mut wakes = Wakes::default();
        {
            let mut g = self.inner.lock();
            if g.caps == caps {
                return;
            }
            g.caps = caps;
            g.grant(None, &mut wakes);
            self.publish(&mut g);
        }
        wakes.wake();
    }

    /// Parks `ticket`'s backend ([`Parking::park`]). A waiter that queued while the caller
    /// decided to park (after its [`Slots::quiet`]) may have looked for a ticket to revoke
    /// before this one was listed: it would then wait for a release or the next upkeep
    /// tick. So the queue is looked at once more after listing, and one parked backend is
    /// revoked if anyone is queued.
    pub fn park(&self, ticket: &Arc<super::park::Ticket>) {
        self.parking.park(ticket);
        std::sync::atomic::fence(Ordering::SeqCst);
        if !self.queue_empty() {
            self.parking.revoke_one();
        }
    }

    /// Nobody waits and a slot is free beyond the critical reserve: a backend may stay
    /// parked with its idle client ([`Parking`]) without keeping anyone from one.
    pub fn quiet(&self) -> bool {
        let g = self.inner.lock();
        g.available > g.keep() && g.queued() == 0
    }

    /// Nobody queues and `n` more non-critical clients would find a slot free at once.
    pub fn room_for(&self, n: usize) -> bool {
        let g = self.inner.lock();
        g.queued() == 0 && g.available > g.keep() + n
    }

    /// Clients queued at the last change, without the lock (waiters that left may still
    /// count until the queue is next looked at).
    pub fn queued_now(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Clients currently waiting for a slot.
    pub fn waiting(&self) -> usize {
        let g = self.inner.lock();
        g.waiters
            .iter()
            .map(|q| q.iter().filter(|w| g.live(w)).count())
            .sum()
    }

    pub fn available(&self) -> usize {
        self.inner.lock().available
    }

    /// The reserve stays as configured: it does not grow with critical work's peak (an
    /// operator set `pool.critical_reserve`).
    pub fn fix_reserve(&self) {
        self.inner.lock().reserve_grows = false;
    }

    /// Slots only critical waiters may take now (the configured reserve, grown to critical
    /// work's recent peak).
    pub fn reserve(&self) -> usize {
        self.inner.lock().keep()
    }

    /// Most slots each priority may hold now.
    pub fn caps(&self) -> [usize; PRIORITIES] {
        self.inner.lock().caps
    }
}

/// A queued waiter's side of its mailbox: ready with the slot granted to it or with its
/// timeout. Dropped before that (its client left, the runtime went away), it frees the
/// mailbox and passes a slot granted meanwhile on.
struct Wait<'a> {
    slots: &'a Arc<Slots>,
    /// `None` once the wait is over.
    mailbox: Option<usize>,
}

impl Future for Wait<'_> {
    type Output = Result<SlotPermit, SlotError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(i) = self.mailbox else {
            panic!("a slot wait polled after it ended");
        };
        let mut g = self.slots.inner.lock();
        let out = match g.mailboxes[i].state {
            Mail::Granted(priority) => {
                let m = &g.mailboxes[i];
                Ok(SlotPermit {
                    slots: self.slots.clone(),
                    priority,
                    held: m.caller.zip(m.since),
                    ended: None,
                })
            }
            Mail::TimedOut => Err(SlotError::Timeout),
            Mail::Free => unreachable!("only its own wait frees a mailbox"),
            Mail::Waiting => {
                let m = &mut g.mailboxes[i];
                match &mut m.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    w => *w = Some(cx.waker().clone()),
                }
                return Poll::Pending;
            }
        };
        g.close_mailbox(i);
        drop(g);
        self.mailbox = None;
        Poll::Ready(out)
    }
}

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        let Some(i) = self.mailbox else { return };
        let mut wakes = Wakes::default();
        {
            let mut g = self.slots.inner.lock();
            let m = &g.mailboxes[i];
            let (granted, held) = (m.state, m.caller.zip(m.since));
            g.close_mailbox(i);
            if let Mail::Granted(priority) = granted {
                // Granted but never used: charged the moment it was held for its waiter (a
                // clock reading also for the grants this passes the slot on to).
                let now = Instant::now();
                let held = held.map(|(c, since)| (c, since, now));
                g.put_back(priority, held, &mut wakes);
                self.slots.publish(&mut g);
            }
        }
        wakes.wake();
    }
}

/// The pool's sweeper: times out the waiters whose deadline has come (their mailboxes say
/// so, and they are woken) and waits for the earliest deadline left, until no one waits. (It
/// holds the pool only while someone waits, at most until the last deadline.)
async fn sweep(s: Arc<Slots>) {
    loop {
        let mut wakes = Wakes::default();
        let at = {
            let mut guard = s.inner.lock();
            let g = &mut *guard;
            let now = Instant::now();
            let mut earliest: Option<Instant> = None;
            let mut waiters = std::mem::take(&mut g.waiters);
            for (q, ordered) in waiters.iter_mut().zip(g.ordered.iter_mut()) {
                let mut expire = |w: &Waiter| {
                    if !g_live(&g.mailboxes, w) {
                        return true;
                    }
                    if w.deadline > now {
                        return false;
                    }
                    let m = &mut g.mailboxes[w.mailbox];
                    m.state = Mail::TimedOut;
                    wakes.push(m.waker.take());
                    true
                };
                if *ordered {
                    // Deadlines in order: the expired are at the front, and the front's is
                    // the queue's earliest (waiters that left further back go when they
                    // reach it). One look per expiry, not a pass over the queue.
                    while q.front().is_some_and(&mut expire) {
                        q.pop_front();
                    }
                    if let Some(w) = q.front() {
                        earliest = Some(earliest.map_or(w.deadline, |e| e.min(w.deadline)));
                    }
                } else {
                    q.retain(|w| !expire(w));
                    if let Some(d) = q.iter().map(|w| w.deadline).min() {
                        earliest = Some(earliest.map_or(d, |e| e.min(d)));
                    }
                }
                if q.is_empty() {
                    *ordered = true;
                }
            }
            g.waiters = waiters;
            if g.fair {
                // Callers above their shares may have decayed under them.
                g.grant(Some(now), &mut wakes);
                if let Some(at) = g.next_share_look(now) {
                    earliest = Some(earliest.map_or(at, |e| e.min(at)));
                }
            }
            s.publish(g);
            g.sweep_at = earliest;
            earliest
        };
        wakes.wake();
        let Some(at) = at else { return };
        tokio::select! {
            biased;
            () = s.sweep.notified() => {}
            () = tokio::time::sleep_until(at) => {}
        }
    }
}

/// [`Inner::live`] over the mailboxes alone (while the queues are taken out).
fn g_live(mailboxes: &[Mailbox], w: &Waiter) -> bool {
    let m = &mailboxes[w.mailbox];
    m.generation == w.generation && m.state == Mail::Waiting
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

    /// Critical work that held four slots at once leaves five free when lower priorities
    /// fill the pool (its peak + 1, capped at a quarter of 20), so its next transactions find
    /// one at once; two windows after its last peak the reserve is back to the configured 2.
    #[tokio::test(start_paused = true)]
    async fn the_reserve_grows_to_critical_work_s_recent_peak() {
        let s = Slots::new(20, 2);
        let fill = |s: &Arc<Slots>| {
            let mut lows = Vec::new();
            while let Some(p) = s.try_acquire(3, Instant::now()) {
                lows.push(p);
            }
            lows
        };
        assert_eq!(
            fill(&s).len(),
            18,
            "before any critical work: the configured reserve"
        );
        let s = Slots::new(20, 2);
        let critical: Vec<_> = (0..4)
            .map(|_| s.try_acquire(0, Instant::now()).expect("critical"))
            .collect();
        drop(critical);
        assert_eq!(s.reserve(), 5);
        let lows = fill(&s);
        assert_eq!(lows.len(), 15, "five left for critical work");
        let crit: Vec<_> = (0..5)
            .map(|_| s.try_acquire(0, Instant::now()).expect("critical at once"))
            .collect();
        assert!(
            s.try_acquire(0, Instant::now()).is_none(),
            "the pool is full"
        );
        drop(crit);
        // Five held at once: the reserve stays at its cap (five) through this window and
        // the next ...
        tokio::time::advance(Duration::from_secs(5)).await;
        s.tick(Instant::now());
        assert_eq!(s.reserve(), 5);
        tokio::time::advance(PEAK_WINDOW).await;
        s.tick(Instant::now());
        assert_eq!(s.reserve(), 5, "the last window's peak still counts");
        // ... and is back to the configured two once no window in sight saw it.
        tokio::time::advance(PEAK_WINDOW).await;
        s.tick(Instant::now());
        assert_eq!(s.reserve(), 2);
        let more = fill(&s);
        assert_eq!(more.len(), 3, "lows take the room the reserve gave back");
        drop((lows, more));

        // A reserve the operator set stays as set.
        let fixed = Slots::new(20, 2);
        fixed.fix_reserve();
        let critical: Vec<_> = (0..4)
            .map(|_| fixed.try_acquire(0, Instant::now()).expect("critical"))
            .collect();
        drop(critical);
        assert_eq!(fixed.reserve(), 2);
        assert_eq!(fill(&fixed).len(), 18);
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

    /// A slot granted to a waiter that is dropped before it runs (its client left at the
    /// moment of the hand-off) goes on to the next waiter; none is lost.
    #[tokio::test(start_paused = true)]
    async fn a_slot_granted_to_a_waiter_that_leaves_goes_to_the_next() {
        let s = Slots::new(1, 0);
        let far = Instant::now() + Duration::from_secs(60);
        let held = s.acquire(2, far, usize::MAX).await.unwrap();
        let mut first = Box::pin(s.acquire(2, far, usize::MAX));
        let mut second = Box::pin(s.acquire(2, far, usize::MAX));
        assert!(s.queue_empty(), "nobody queued yet");
        assert!(futures_util::poll!(first.as_mut()).is_pending());
        assert!(futures_util::poll!(second.as_mut()).is_pending());
        assert!(!s.queue_empty());
        drop(held);
        assert_eq!(s.available(), 0, "granted to the first waiter");
        drop(first);
        let permit = match futures_util::poll!(second.as_mut()) {
            Poll::Ready(r) => r.expect("the slot passed on"),
            Poll::Pending => panic!("the second waiter got nothing"),
        };
        assert_eq!((s.available(), s.waiting()), (0, 0));
        assert!(s.queue_empty(), "both queue entries are gone");
        drop(permit);
        assert_eq!(s.available(), 1);
    }

    /// A waiter that left leaves a stale queue entry behind; its mailbox, reused by a later
    /// (lower-priority) wait, is never granted through that entry.
    #[tokio::test(start_paused = true)]
    async fn a_reused_mailbox_serves_only_its_new_wait() {
        let s = Slots::new(1, 0);
        let far = Instant::now() + Duration::from_secs(60);
        let held = s.acquire(2, far, usize::MAX).await.unwrap();
        let mut left = Box::pin(s.acquire(2, far, usize::MAX));
        assert!(futures_util::poll!(left.as_mut()).is_pending());
        drop(left);
        // The low waiter takes the freed mailbox; the normal one queues behind the stale entry.
        let mut low = Box::pin(s.acquire(3, far, usize::MAX));
        let mut normal = Box::pin(s.acquire(2, far, usize::MAX));
        assert!(futures_util::poll!(low.as_mut()).is_pending());
        assert!(futures_util::poll!(normal.as_mut()).is_pending());
        assert_eq!(s.waiting(), 2);
        drop(held);
        let Poll::Ready(Ok(permit)) = futures_util::poll!(normal.as_mut()) else {
            panic!("the slot went past the normal waiter");
        };
        assert!(futures_util::poll!(low.as_mut()).is_pending());
        drop(permit);
        assert!(matches!(
            futures_util::poll!(low.as_mut()),
            Poll::Ready(Ok(_))
        ));
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

    /// A ticket parked after a waiter queued (the waiter found no ticket to revoke) is
    /// revoked at once: the waiter does not sit until the next upkeep tick.
    #[tokio::test(start_paused = true)]
    async fn a_backend_parked_while_someone_waits_is_revoked_at_once() {
        use super::super::park::Ticket;
        use std::task::{Context, Waker};
        let (s, start, _held) = one_slot_held().await;
        let _w = waiter(&s, start, 60_000);
        tokio::task::yield_now().await;
        assert_eq!(s.waiting(), 1);
        let ticket = Arc::new(Ticket::default());
        s.park(&ticket);
        assert!(ticket.revoked(&mut Context::from_waker(Waker::noop())));
        assert!(s.parking.is_empty());
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

    /// `workers` tasks that each take a normal slot, hold it for `hold`, give it back and
    /// come again: a queue served at `slots / hold` a second.
    fn busy_queue(
        s: &Arc<Slots>,
        workers: usize,
        hold: Duration,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        (0..workers)
            .map(|_| {
                let s = Arc::clone(s);
                tokio::spawn(async move {
                    loop {
                        let far = Instant::now() + Duration::from_secs(600);
                        let p = s.acquire(2, far, usize::MAX).await.expect("far deadline");
                        tokio::time::sleep(hold).await;
                        drop(p);
                    }
                })
            })
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_fits_queues_and_one_that_does_not_is_refused_on_arrival() {
        let s = Slots::new(2, 0);
        // 2 slots held 20 ms each: 100 grants a second, ~48 waiting.
        let workers = busy_queue(&s, 50, Duration::from_millis(20));
        tokio::time::sleep(Duration::from_secs(2)).await;

        // ~0.5 s of queue: 100 ms is not enough, refused at once with its place.
        let t = Instant::now();
        match s
            .acquire(2, t + Duration::from_millis(100), usize::MAX)
            .await
        {
            Err(SlotError::WouldWait { place }) => {
                let Placed { place, retry } = place;
                assert!(
                    place > Duration::from_millis(300) && place < Duration::from_millis(800),
                    "{place:?}"
                );
                assert!(retry >= place / 2 && retry <= place * 3 / 2, "{retry:?}");
            }
            other => panic!("{:?}", other.err()),
        }
        assert_eq!(Instant::now(), t, "refused without waiting");
        // 2 s is enough: it waits and gets its slot, never refused.
        let p = s
            .acquire(2, Instant::now() + Duration::from_secs(2), usize::MAX)
            .await
            .expect("a wait that fits is served");
        drop(p);
        // Critical work is never refused on arrival, however short its deadline.
        let t = Instant::now();
        let r = s
            .acquire(0, t + Duration::from_millis(100), usize::MAX)
            .await;
        assert!(
            !matches!(r, Err(SlotError::WouldWait { .. })),
            "critical waits"
        );
        drop(r);
        let stats = s.arrival_stats();
        assert_eq!(stats.refused_on_arrival, 1, "{stats:?}");
        for w in workers {
            w.abort();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn lower_priorities_yield_while_a_higher_one_queues() {
        let s = Slots::new(8, 0);
        let far = Instant::now() + Duration::from_secs(60);
        let mut low = Vec::new();
        for _ in 0..8 {
            low.push(s.acquire(3, far, usize::MAX).await.unwrap());
        }
        // A normal client finds none: it queues, and low priority is held to 8 / 4 = 2.
        let normal = {
            let s = Arc::clone(&s);
            tokio::spawn(async move { s.acquire(2, far, usize::MAX).await.map(|_| ()) })
        };
        tokio::task::yield_now().await;
        assert_eq!(s.waiting(), 1);
        drop(low.pop());
        normal.await.unwrap().unwrap();
        // Low gives back a slot: it stays free rather than going back to low (7 > 2).
        drop(low.pop());
        assert!(s.try_acquire(3, Instant::now()).is_none());
        assert_eq!(s.available(), 2);
        // Pressure ends PRESSURE_HOLD after the last normal waiter: low may take it again.
        s.tick(Instant::now() + PRESSURE_HOLD);
        assert!(s.try_acquire(3, Instant::now()).is_some());
    }

    /// Room for `n` more: nobody queues and more than the reserve and `n` are free.
    #[tokio::test(start_paused = true)]
    async fn room_for_counts_the_reserve_and_the_queue() {
        let s = Slots::new(4, 1);
        assert!(
            s.room_for(2) && !s.room_for(3),
            "4 free, 1 kept for critical work"
        );
        let held: Vec<_> = (0..3)
            .map(|_| s.try_acquire(2, Instant::now()).expect("normal"))
            .collect();
        assert!(!s.room_for(0), "only the reserve is free");
        drop(held);

        // Slots free, but a queue: a low waiter held to its yield share while a normal one
        // waited recently.
        let s = Slots::new(8, 0);
        let far = Instant::now() + Duration::from_secs(60);
        let mut low: Vec<_> = (0..8)
            .map(|_| s.try_acquire(3, Instant::now()).expect("low"))
            .collect();
        let normal = {
            let s = Arc::clone(&s);
            tokio::spawn(async move { s.acquire(2, far, usize::MAX).await.map(|_| ()) })
        };
        tokio::task::yield_now().await;
        drop(low.pop());
        normal.await.unwrap().unwrap();
        let capped = {
            let s = Arc::clone(&s);
            tokio::spawn(async move { s.acquire(3, far, usize::MAX).await.map(|_| ()) })
        };
        tokio::task::yield_now().await;
        drop(low.pop());
        drop(low.pop());
        assert_eq!((s.available(), s.waiting()), (3, 1));
        assert!(!s.room_for(0), "free slots, but someone queues");
        capped.abort();
    }
}

#[cfg(test)]
mod fair_tests;
