//! The counts and lines behind the login door (`App::door`): the logins waiting at it now
//! ([`Held`]), the logins it let through that have not reached admission yet ([`Coming`]),
//! which the door counts as standing in the queue they are about to join, and the order in
//! which waiting logins go through ([`Lines`]).
//!
//! The logins waiting for one (pool, caller) stand in one line and go through first come,
//! first served: only the line's head looks whether the door is open (every [`poll`]); when
//! it goes through, the next is woken and looks at once, so the door lets through as many as
//! it has room for in one chain of wake-ups, in the order they came. (Had every waiting
//! login looked on its own, the order would be a lottery: at thousands waiting, some lost it
//! again and again until their longest wait, and a storm ended with its unlucky few.)
//!
//! A login let through is counted as coming until its session's first statement meets
//! admission — or, at the latest, one to two [`COMING_WINDOW`]s after it passed: a client
//! that logs in and then sends nothing (a pool's idle connection, a driver warming up) is not
//! about to join any queue, and must not keep the door shut for others. Each pass is counted
//! in the window it passed in; the count is the current window's and the previous one's, and
//! a pass given back after its windows are over changes nothing.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

/// How long a pass is counted at least (and at most twice that) unless its first statement
/// meets admission sooner.
pub const COMING_WINDOW: Duration = Duration::from_millis(500);

/// How often the head of a line looks whether the door is open.
pub const POLL: Duration = Duration::from_millis(10);

/// The lines of logins waiting at one pool's door, one per caller (callers' queues differ,
/// so one caller's crowded queue never holds another's logins).
#[derive(Debug, Default)]
pub struct Lines {
    inner: Mutex<LinesInner>,
}

#[derive(Debug, Default)]
struct LinesInner {
    next: u64,
    lines: HashMap<u16, VecDeque<(u64, Arc<Notify>)>>,
}

impl Lines {
    /// Someone of `caller` waits in line: a newcomer stands behind them.
    pub fn occupied(&self, caller: u16) -> bool {
        self.inner.lock().lines.contains_key(&caller)
    }

    /// Takes a place at the back of `caller`'s line; it is left when the place is dropped.
    pub fn join(&self, caller: u16) -> Place<'_> {
        let notify = Arc::new(Notify::new());
        let mut g = self.inner.lock();
        let ticket = g.next;
        g.next += 1;
        g.lines
            .entry(caller)
            .or_default()
            .push_back((ticket, Arc::clone(&notify)));
        Place {
            lines: self,
            caller,
            ticket,
            notify,
        }
    }
}

/// A login's place in its line.
#[derive(Debug)]
pub struct Place<'a> {
    lines: &'a Lines,
    caller: u16,
    ticket: u64,
    notify: Arc<Notify>,
}

impl Place<'_> {
    /// First in its line: the one that looks whether the door is open.
    pub fn is_head(&self) -> bool {
        let g = self.lines.inner.lock();
        g.lines
            .get(&self.caller)
            .and_then(VecDeque::front)
            .is_some_and(|(t, _)| *t == self.ticket)
    }

    /// Waits until this place is the head of its line.
    pub async fn turn(&self) {
        // A head that leaves wakes its successor with `notify_one`, which keeps the wake-up
        // for a place not waiting yet: none is lost between the look and the wait.
        while !self.is_head() {
            self.notify.notified().await;
        }
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut g = self.lines.inner.lock();
        let Some(line) = g.lines.get_mut(&self.caller) else {
            return;
        };
        let Some(i) = line.iter().position(|(t, _)| *t == self.ticket) else {
            return;
        };
        line.remove(i);
        match line.front() {
            None => {
                g.lines.remove(&self.caller);
            }
            Some((_, next)) if i == 0 => next.notify_one(),
            Some(_) => {}
        }
    }
}

/// The pause of a line's head between looks: [`POLL`], with up to half of it again as
/// jitter (the heads of many lines do not look in step).
pub fn poll() -> Duration {
    POLL + POLL.mul_f64(rand::random_range(0.0..0.5))
}

/// Logins let through the door and not yet at admission, by the window they passed in.
#[derive(Debug)]
pub struct Coming {
    start: Instant,
    windows: Mutex<Windows>,
}

#[derive(Debug, Default)]
struct Windows {
    /// The current window's number since `start`.
    at: u64,
    /// Passes counted in window `at` (index `at % 2`) and `at - 1` (the other).
    counts: [usize; 2],
}

impl Windows {
    /// Moves on to window `now`, forgetting the windows that ended before the previous one.
    fn advance(&mut self, now: u64) {
        if now == self.at {
            return;
        }
        if now == self.at + 1 {
            self.counts[(now % 2) as usize] = 0;
        } else {
            self.counts = [0, 0];
        }
        self.at = now;
    }
}

impl Default for Coming {
    fn default() -> Self {
        Coming {
            start: Instant::now(),
            windows: Mutex::default(),
        }
    }
}

impl Coming {
    fn window(&self, now: Instant) -> u64 {
        (now.saturating_duration_since(self.start).as_millis() / COMING_WINDOW.as_millis()) as u64
    }

    /// Logins counted as coming at `now`.
    pub fn count(&self, now: Instant) -> usize {
        let mut w = self.windows.lock();
        w.advance(self.window(now));
        w.counts[0] + w.counts[1]
    }

    /// Counts one more login let through at `now`; the returned window number gives it back.
    pub fn pass(&self, now: Instant) -> u64 {
        let at = self.window(now);
        let mut w = self.windows.lock();
        w.advance(at);
        w.counts[(at % 2) as usize] += 1;
        at
    }

    /// The login let through in window `passed` reached admission (or left) at `now`.
    pub fn arrived(&self, passed: u64, now: Instant) {
        let mut w = self.windows.lock();
        w.advance(self.window(now));
        if passed + 1 >= w.at {
            let n = &mut w.counts[(passed % 2) as usize];
            *n = n.saturating_sub(1);
        }
    }
}

/// Logins waiting at the door now; one is counted while its [`HeldLogin`] lives.
#[derive(Debug, Default)]
pub struct Held(AtomicUsize);

impl Held {
    pub fn enter(&self) -> HeldLogin<'_> {
        self.0.fetch_add(1, Ordering::Relaxed);
        HeldLogin(&self.0)
    }

    pub fn now(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// One login waiting at the door.
pub struct HeldLogin<'a>(&'a AtomicUsize);

impl Drop for HeldLogin<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pass counts until it arrives; one that never arrives stops counting within two
    /// windows; arriving late changes nothing.
    #[tokio::test(start_paused = true)]
    async fn a_pass_counts_until_its_login_arrives_or_two_windows_pass() {
        let c = Coming::default();
        let now = Instant::now;
        let a = c.pass(now());
        let idle = c.pass(now());
        assert_eq!(c.count(now()), 2);
        c.arrived(a, now());
        assert_eq!(c.count(now()), 1, "arrived: no longer coming");
        tokio::time::advance(COMING_WINDOW).await;
        let b = c.pass(now());
        assert_eq!(
            c.count(now()),
            2,
            "the idle one still counts in the next window"
        );
        tokio::time::advance(COMING_WINDOW).await;
        assert_eq!(
            c.count(now()),
            1,
            "the idle one is forgotten; the newer one counts"
        );
        c.arrived(idle, now());
        assert_eq!(
            c.count(now()),
            1,
            "a late arrival takes nothing from newer passes"
        );
        c.arrived(b, now());
        assert_eq!(c.count(now()), 0);
        tokio::time::advance(COMING_WINDOW * 5).await;
        assert_eq!(c.count(now()), 0);
    }

    /// Places go through in the order they were taken: only the head may look, a head that
    /// leaves wakes the next, a place that leaves from the middle changes no one's turn, and
    /// another caller's line is its own.
    #[tokio::test(start_paused = true)]
    async fn a_line_serves_its_places_in_order() {
        let lines = Lines::default();
        assert!(!lines.occupied(1));
        let a = lines.join(1);
        let b = lines.join(1);
        let c = lines.join(1);
        let other = lines.join(2);
        assert!(lines.occupied(1));
        assert!(a.is_head() && !b.is_head() && !c.is_head());
        assert!(other.is_head(), "another caller's line is its own");
        let waited = tokio::time::timeout(Duration::from_millis(50), c.turn()).await;
        assert!(waited.is_err(), "not the head: waits");
        drop(b);
        assert!(
            a.is_head() && !c.is_head(),
            "leaving the middle changes no turn"
        );
        let start = Instant::now();
        let (done, ()) = tokio::join!(
            async {
                let woken = tokio::time::timeout(Duration::from_secs(1), c.turn()).await;
                assert!(woken.is_ok(), "the next is woken when the head leaves");
                Instant::now()
            },
            async {
                tokio::time::sleep(Duration::from_millis(30)).await;
                drop(a);
            }
        );
        assert!(c.is_head(), "woken when the head went through");
        assert_eq!(done - start, Duration::from_millis(30), "at once");
        drop(c);
        assert!(!lines.occupied(1), "an empty line is forgotten");
        assert!(lines.occupied(2));
        drop(other);
        assert!(lines.inner.lock().lines.is_empty());
    }

    #[test]
    fn the_head_looks_every_poll_with_some_jitter() {
        for _ in 0..100 {
            let p = poll();
            assert!(p >= POLL && p <= POLL.mul_f64(1.5));
        }
    }
}
