//! The adaptive concurrency limit toward Postgres: how many backends of a pool the
//! non-critical priorities may hold, moved by the database's measured load (the breaker
//! probe's reading, `probe.rs`) — AIMD: while the load is above the target the limit falls by
//! a third per reading (down to a floor), while it is below half the target it climbs back by
//! a tenth of the pool per reading. Between the two it holds, so it does not oscillate.
//!
//! The limit is shared out by priority ([`AdaptiveLimit::caps`]): critical work may always
//! use the whole pool (less nothing: the reserve is its own), high keeps half of what the
//! others lose, normal gets the limit, and low is cut twice as fast — so as the database
//! saturates, the lowest priority is held back first, and everything recovers together when
//! the database does. Pure arithmetic; `slots.rs` enforces the caps.

use serde::Serialize;

use super::slots::PRIORITIES;

/// Settings of the control law.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AdaptiveConfig {
    /// Lowest limit (at least 1).
    pub floor: usize,
    /// Load (percent) above which the limit falls.
    pub target_percent: f64,
}

/// The current limit of one pool.
#[derive(Debug, Clone)]
pub struct AdaptiveLimit {
    limit: f64,
    max: usize,
    config: AdaptiveConfig,
}

impl AdaptiveLimit {
    /// Starts at the pool size (no limit until the database says otherwise).
    pub fn new(size: usize, config: AdaptiveConfig) -> Self {
        AdaptiveLimit {
            limit: size as f64,
            max: size.max(1),
            config,
        }
    }

    /// Backends the normal priority may hold now.
    pub fn limit(&self) -> usize {
        (self.limit.round() as usize).clamp(self.floor(), self.max)
    }

    fn floor(&self) -> usize {
        self.config.floor.clamp(1, self.max)
    }

    /// One load reading (percent, 0–100); returns the new limit.
    pub fn on_load(&mut self, load: f64) -> usize {
        let target = self.config.target_percent;
        if load > target {
            self.limit = (self.limit * (2.0 / 3.0)).max(self.floor() as f64);
        } else if load < target / 2.0 {
            let step = (self.max as f64 / 10.0).max(1.0);
            self.limit = (self.limit + step).min(self.max as f64);
        }
        self.limit()
    }

    /// Most backends each priority (critical, high, normal, low) may hold at this limit.
    pub fn caps(&self) -> [usize; PRIORITIES] {
        let max = self.max;
        let l = self.limit();
        let lost = max - l;
        [
            max,
            (l + lost / 2).min(max),
            l,
            (2 * l).saturating_sub(max).max(1),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(size: usize) -> AdaptiveLimit {
        AdaptiveLimit::new(
            size,
            AdaptiveConfig {
                floor: 2,
                target_percent: 50.0,
            },
        )
    }

    /// Overload: a third off per reading to the floor, low cut first; quiet: a tenth of the
    /// pool back per reading; in between: held.
    #[test]
    fn the_limit_falls_fast_under_load_and_climbs_back_slowly() {
        let mut a = limit(20);
        assert_eq!(
            a.caps(),
            [20, 20, 20, 20],
            "no limit while the database is fine"
        );
        assert_eq!(a.on_load(90.0), 13);
        assert_eq!(a.caps(), [20, 16, 13, 6], "low loses twice as fast");
        assert_eq!(a.on_load(90.0), 9);
        assert_eq!(a.caps(), [20, 14, 9, 1], "low keeps one backend");
        for _ in 0..10 {
            a.on_load(100.0);
        }
        assert_eq!(a.limit(), 2, "the floor");
        assert_eq!(a.on_load(40.0), 2, "between target/2 and target: held");
        assert_eq!(a.on_load(10.0), 4);
        assert_eq!(a.on_load(0.0), 6);
        for _ in 0..10 {
            a.on_load(0.0);
        }
        assert_eq!(a.limit(), 20, "back to the whole pool");
        // A pool of one never limits below one.
        let mut one = limit(1);
        assert_eq!(one.on_load(100.0), 1);
        assert_eq!(one.caps(), [1, 1, 1, 1]);
    }
}
