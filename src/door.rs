//! The counts behind the login door (`App::door`): the logins waiting at it now ([`Held`])
//! and the logins it let through that have not reached admission yet ([`Coming`]), which the
//! door counts as standing in the queue they are about to join; and the pause of a waiting
//! login ([`poll`]).
//!
//! A login let through is counted as coming until its session's first statement meets
//! admission — or, at the latest, one to two [`COMING_WINDOW`]s after it passed: a client
//! that logs in and then sends nothing (a pool's idle connection, a driver warming up) is not
//! about to join any queue, and must not keep the door shut for others. Each pass is counted
//! in the window it passed in; the count is the current window's and the previous one's, and
//! a pass given back after its windows are over changes nothing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

/// How long a pass is counted at least (and at most twice that) unless its first statement
/// meets admission sooner.
pub const COMING_WINDOW: Duration = Duration::from_millis(500);

/// How many times a second the logins waiting at the door look, all together, at most (each
/// every 10 ms while few wait): thousands of held logins cost a bounded share of the session
/// thread, not one wake-up each every 10 ms.
pub const POLLS: usize = 25_000;

/// The pause of a login waiting at the door while `waiting` wait: 10 ms, longer when more
/// than [`POLLS`] / 100 wait, with up to half of it again as jitter (held logins do not look
/// in step).
pub fn poll(waiting: usize) -> Duration {
    let base = Duration::from_millis(10) * (waiting / (POLLS / 100)).max(1) as u32;
    base + base.mul_f64(rand::random_range(0.0..0.5))
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

    #[test]
    fn the_pause_grows_with_the_logins_waiting() {
        assert!(poll(1) >= Duration::from_millis(10) && poll(1) <= Duration::from_millis(15));
        let many = poll(POLLS);
        assert!(many >= Duration::from_secs(1) && many <= Duration::from_millis(1500));
    }
}
