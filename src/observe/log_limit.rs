//! Rate limits for the log lines an operator turns on during an incident (`log.connections`,
//! `log.refusals`): at most N lines a second of each kind, and the next line that is written
//! says how many were left out, so a flood of logins or refusals can be watched without the
//! log becoming the next thing to fall over.
//!
//! One fixed one-second window per kind, two atomics and no lock: concurrent callers may
//! overshoot the budget by a line or two at a window edge, which is harmless.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The budget of one kind of line.
#[derive(Debug, Default)]
pub struct LineLimiter {
    /// `window second << 32 | lines written in it`.
    state: AtomicU64,
    /// Lines left out since the last one written.
    suppressed: AtomicU64,
}

impl LineLimiter {
    /// Whether a line may be written now (`now_ms`: any monotonic or wall clock in ms) under
    /// `per_second`; `Some(n)` = yes, after `n` left out since the last one written.
    pub fn admit(&self, now_ms: u64, per_second: u32) -> Option<u64> {
        let second = (now_ms / 1000) & 0xffff_ffff;
        let mut cur = self.state.load(Relaxed);
        loop {
            let (win, used) = (cur >> 32, cur & 0xffff_ffff);
            let next_used = if win == second { used + 1 } else { 1 };
            if next_used > u64::from(per_second) {
                self.suppressed.fetch_add(1, Relaxed);
                return None;
            }
            match self
                .state
                .compare_exchange_weak(cur, second << 32 | next_used, Relaxed, Relaxed)
            {
                Ok(_) => return Some(self.suppressed.swap(0, Relaxed)),
                Err(seen) => cur = seen,
            }
        }
    }
}

/// The limiters of the proxy's optional log lines.
#[derive(Debug, Default)]
pub struct LogLimits {
    /// Logins, failed logins and logouts (`log.connections`).
    pub connections: LineLimiter,
    /// Refused statements (`log.refusals`).
    pub refusals: LineLimiter,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_per_second_and_a_count_of_what_was_left_out() {
        let l = LineLimiter::default();
        assert_eq!(l.admit(5_000, 2), Some(0));
        assert_eq!(l.admit(5_100, 2), Some(0));
        assert_eq!(l.admit(5_200, 2), None);
        assert_eq!(l.admit(5_999, 2), None);
        // The next second: written, with the two left out.
        assert_eq!(l.admit(6_000, 2), Some(2));
        assert_eq!(l.admit(6_001, 2), Some(0));
        assert_eq!(l.admit(6_002, 2), None);
        assert_eq!(l.admit(9_000, 2), Some(1));
        let off = LineLimiter::default();
        assert_eq!(off.admit(1_000, 0), None);
    }
}
