//! Fair shares of a pool by backend time: who asks for a backend ([`Asker`]) and how much
//! backend time each caller has held lately ([`Shares`]), the two things a pool's checkout
//! queue needs to serve callers of one priority by time rather than by arrival.
//!
//! **Order: the least competing time per weight first.** A caller's *competing time* is the
//! backend time its units held while someone was waiting for a backend of the pool, as an
//! exponentially decayed sum with a [`HALF_LIFE`] of 10 s (a charge counts half after 10 s),
//! plus what its units holding a backend now have held so far while someone waited — so an
//! 800 ms unit weighs on its caller while it runs, not only once it ends. Among the waiters
//! of one priority the pool serves the caller with the least competing time per unit of its
//! `weight` ([`Shares::rank`]), FIFO within a caller. Two consequences, both on purpose:
//!
//! * time a caller held backends while nobody waited costs it nothing: a caller that had the
//!   pool to itself (or kept a backend parked while it was quiet) is level with a newcomer
//!   when others arrive, not in debt for the time nobody wanted;
//! * a caller that waits for nothing sees its competing time decay towards zero and no
//!   further: it banks no credit beyond the window. A closed-loop client that is between two
//!   statements when a backend frees keeps its small competing time for its next ask (a
//!   strict virtual clock would reset it at every such gap, and the short caller would lose
//!   its turn to the long one each time).
//!
//! **The window: backend time as a decayed sum.** For `db_time_share` and the statistics a
//! caller's *load* is all the backend time its units held, decayed alike, plus what its
//! running units have held so far. `db_time_share` caps it at a share of the pool's backend
//! time over the window: `share × pool size × τ`, τ = `HALF_LIFE / ln 2` ≈ 14.4 s (the
//! decayed integral of a backend held all along). A caller above it is not served while
//! above, even with backends free: its checkouts wait until its load has decayed under the
//! cap, and time out at their deadline as any other wait.
//!
//! Pure bookkeeping, kept under the pool's slot lock and fed by it with the clock readings
//! it already takes (and whether anyone waits, [`Shares::contended`]); no I/O, no timers.
//! Callers are `u16` ids of the configuration's caller list (a bounded set); a reload that
//! renumbers them blurs the attribution for one window.

use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

/// Half-life of the decayed backend time.
pub const HALF_LIFE: Duration = Duration::from_secs(10);

/// Most `weight` a caller may have (and least: 1).
pub const MAX_WEIGHT: u32 = 1_000;

/// Who asks a pool for a backend: the priority it queues at and, for clients, its caller
/// with the caller's `weight` and `db_time_share`. The pool's own checkouts (probes) have no
/// caller: they are charged to nobody and never wait behind a caller's share.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Asker {
    /// 0 = critical … 3 = low.
    pub priority: usize,
    pub caller: Option<u16>,
    /// Relative claim on backend time among the callers of one priority (1..=MAX_WEIGHT).
    pub weight: u32,
    /// Most of the pool's backend time over the window the caller may hold (0 < s ≤ 1).
    pub share: Option<f64>,
}

impl Asker {
    /// A checkout of the proxy's own, at `priority`.
    pub fn internal(priority: usize) -> Asker {
        Asker {
            priority,
            caller: None,
            weight: 1,
            share: None,
        }
    }
}

impl From<usize> for Asker {
    /// A bare priority: the proxy's own checkout ([`Asker::internal`]).
    fn from(priority: usize) -> Asker {
        Asker::internal(priority)
    }
}

/// One caller's backend time in a pool. Times are seconds; instants are seconds after the
/// table's epoch.
#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    /// Decayed backend time, and decayed competing time, as of `at`.
    decayed: f64,
    competing: f64,
    at: Option<Instant>,
    /// Units holding a backend now, the sum of their start times, and the sum of the times
    /// they started competing (their start, or the start of the contended spell if later):
    /// their time so far is `holding × now − started`.
    holding: u32,
    started: f64,
    competing_since: f64,
    /// Backend time charged since start, for the counters.
    total: f64,
    weight: u32,
    share: Option<f64>,
}

/// Backend time by caller in one pool.
#[derive(Debug)]
pub struct Shares {
    epoch: Instant,
    /// When the current contended spell (someone waiting) began; `None`: nobody waits.
    spell: Option<f64>,
    /// Indexed by caller id; grows to the highest id seen.
    callers: Vec<Usage>,
}

/// One caller's backend time in a pool, for `/v1/callers` and `/metrics`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ShareStats {
    pub caller: u16,
    /// The caller's name (filled in by whoever knows the caller table; empty here).
    pub name: String,
    /// Backend time its units held since start.
    pub backend_seconds_total: f64,
    /// Its load now: the decayed backend time plus what its units hold now.
    pub recent_backend_seconds: f64,
    /// That load as a share of the pool's backend time over the window (0..=1).
    pub share: f64,
    /// Of the load, the time held while others waited (what orders the fair queue).
    pub competing_backend_seconds: f64,
    /// Backends its units hold now.
    pub holding: u32,
}

/// τ: the decayed integral of one backend held all along, in seconds.
fn window_secs() -> f64 {
    HALF_LIFE.as_secs_f64() / std::f64::consts::LN_2
}

impl Shares {
    pub fn new(epoch: Instant) -> Shares {
        Shares {
            epoch,
            spell: None,
            callers: Vec::new(),
        }
    }

    fn secs(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.epoch).as_secs_f64()
    }

    fn usage(&mut self, caller: u16) -> &mut Usage {
        let i = usize::from(caller);
        if self.callers.len() <= i {
            self.callers.resize(i + 1, Usage::default());
        }
        &mut self.callers[i]
    }

    /// Remembers the asker's weight and share (each checkout brings the current ones).
    pub fn note(&mut self, a: &Asker) {
        if let Some(c) = a.caller {
            let u = self.usage(c);
            u.weight = a.weight.clamp(1, MAX_WEIGHT);
            u.share = a.share;
        }
    }

    /// Someone waits for a backend of the pool from `now` on (`true`), or nobody does any
    /// more: backend time counts as competing time only meanwhile.
    pub fn contended(&mut self, contended: bool, now: Instant) {
        let at = self.secs(now);
        match (self.spell, contended) {
            (None, true) => {
                self.spell = Some(at);
                for u in &mut self.callers {
                    u.competing_since = f64::from(u.holding) * at;
                }
            }
            (Some(_), false) => self.spell = None,
            _ => {}
        }
    }

    /// A unit of `caller` took a backend at `now`.
    pub fn start(&mut self, caller: u16, now: Instant) {
        let s = self.secs(now);
        let u = self.usage(caller);
        u.holding += 1;
        u.started += s;
        u.competing_since += s;
    }

    /// A unit of `caller` that took its backend at `since` gave it back at `now`: its time
    /// is charged to the caller, as competing time the part since the spell began.
    pub fn finish(&mut self, caller: u16, since: Instant, now: Instant) {
        let (s, end, spell) = (self.secs(since), self.secs(now), self.spell);
        let u = self.usage(caller);
        u.holding = u.holding.saturating_sub(1);
        let from = spell.map_or(s, |at| at.max(s));
        if u.holding == 0 {
            u.started = 0.0;
            u.competing_since = 0.0;
        } else {
            u.started -= s;
            u.competing_since -= from;
        }
        let held = (end - s).max(0.0);
        let competing = if spell.is_some() {
            (end - from).max(0.0)
        } else {
            0.0
        };
        u.decayed = decay(u.decayed, u.at, now) + held;
        u.competing = decay(u.competing, u.at, now) + competing;
        u.at = Some(now);
        u.total += held;
    }

    /// `caller`'s load at `now` in seconds: all its backend time, decayed, and its running
    /// units' ([module docs](self)).
    pub fn load(&self, caller: u16, now: Instant) -> f64 {
        let Some(u) = self.callers.get(usize::from(caller)) else {
            return 0.0;
        };
        let running = (f64::from(u.holding) * self.secs(now) - u.started).max(0.0);
        decay(u.decayed, u.at, now) + running
    }

    /// `caller`'s competing time at `now` in seconds ([module docs](self)).
    pub fn competing(&self, caller: u16, now: Instant) -> f64 {
        let Some(u) = self.callers.get(usize::from(caller)) else {
            return 0.0;
        };
        let running = match self.spell {
            Some(_) => (f64::from(u.holding) * self.secs(now) - u.competing_since).max(0.0),
            None => 0.0,
        };
        decay(u.competing, u.at, now) + running
    }

    /// The rank of `caller` among waiters: its competing time per unit of weight, or `None`
    /// while it is above its `db_time_share` of a pool of `capacity` (not to be served). The
    /// pool's own checkouts rank first.
    pub fn rank(&self, caller: Option<u16>, now: Instant, capacity: usize) -> Option<f64> {
        let Some(c) = caller else {
            return Some(f64::NEG_INFINITY);
        };
        let Some(u) = self.callers.get(usize::from(c)) else {
            return Some(0.0);
        };
        if let Some(share) = u.share
            && self.load(c, now) >= share * capacity as f64 * window_secs()
        {
            return None;
        }
        Some(self.competing(c, now) / f64::from(u.weight.max(1)))
    }

    /// How long until `caller`, above its share now, is under it again with nothing more
    /// held: `None` when it is not above, or holds a backend now (its release will look
    /// again; until then its load only grows).
    pub fn under_share_in(&self, caller: u16, now: Instant, capacity: usize) -> Option<Duration> {
        let u = self.callers.get(usize::from(caller))?;
        let cap = u.share? * capacity as f64 * window_secs();
        let load = decay(u.decayed, u.at, now);
        if u.holding > 0 || load < cap || cap <= 0.0 {
            return None;
        }
        let halves = (load / cap).log2();
        Some(Duration::from_secs_f64(halves * HALF_LIFE.as_secs_f64()) + Duration::from_millis(1))
    }

    /// Every caller that held a backend since start, for a pool of `capacity`.
    pub fn stats(&self, now: Instant, capacity: usize) -> Vec<ShareStats> {
        let pool = (capacity.max(1) as f64) * window_secs();
        self.callers
            .iter()
            .enumerate()
            .filter(|(_, u)| u.total > 0.0 || u.holding > 0)
            .map(|(i, u)| {
                let caller = u16::try_from(i).unwrap_or(u16::MAX);
                let recent = self.load(caller, now);
                ShareStats {
                    caller,
                    name: String::new(),
                    backend_seconds_total: u.total,
                    recent_backend_seconds: recent,
                    share: (recent / pool).min(1.0),
                    competing_backend_seconds: self.competing(caller, now),
                    holding: u.holding,
                }
            })
            .collect()
    }
}

/// `value` as of `at`, decayed to `now`.
fn decay(value: f64, at: Option<Instant>, now: Instant) -> f64 {
    match at {
        Some(at) if value > 0.0 => {
            let halves = now.saturating_duration_since(at).as_secs_f64() / HALF_LIFE.as_secs_f64();
            value * (-halves).exp2()
        }
        _ => value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asker(caller: u16, weight: u32, share: Option<f64>) -> Asker {
        Asker {
            priority: 2,
            caller: Some(caller),
            weight,
            share,
        }
    }

    #[test]
    fn load_counts_running_units_and_decays_by_half_each_half_life() {
        let t0 = Instant::now();
        let mut s = Shares::new(t0);
        s.start(1, t0);
        let mid = t0 + Duration::from_millis(500);
        assert!((s.load(1, mid) - 0.5).abs() < 1e-9, "a running unit weighs");
        let end = t0 + Duration::from_secs(1);
        s.finish(1, t0, end);
        assert!((s.load(1, end) - 1.0).abs() < 1e-9);
        assert!((s.load(1, end + HALF_LIFE) - 0.5).abs() < 1e-9, "halved");
        assert_eq!(s.load(7, end), 0.0, "a caller never seen has none");
        let st = s.stats(end, 2);
        assert_eq!(st.len(), 1);
        assert!((st[0].backend_seconds_total - 1.0).abs() < 1e-9);
    }

    /// Only time held while someone waited competes: a unit that began before the spell
    /// counts from its start, one that ended before it not at all.
    #[test]
    fn only_time_held_while_someone_waits_competes() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut s = Shares::new(t0);
        s.start(0, at(0));
        s.finish(0, at(0), at(1_000));
        assert_eq!(s.competing(0, at(1_000)), 0.0, "alone: free");
        assert!((s.load(0, at(1_000)) - 1.0).abs() < 1e-9, "but counted");
        s.start(0, at(1_000));
        s.start(0, at(1_500));
        s.contended(true, at(2_000));
        let c = s.competing(0, at(2_500));
        assert!((c - 1.0).abs() < 1e-9, "two units for 0.5 s each: {c}");
        s.finish(0, at(1_000), at(3_000));
        s.start(1, at(3_000));
        let c = s.competing(0, at(3_000));
        assert!((c - 2.0).abs() < 1e-9, "1 s charged, 1 s running: {c}");
        s.contended(false, at(3_000));
        s.finish(0, at(1_500), at(4_000));
        let c = s.competing(0, at(4_000));
        let decayed = 2f64.powf(-0.1);
        assert!(
            (c - decayed).abs() < 1e-9,
            "the spell ended: nothing more: {c}"
        );
        s.finish(1, at(3_000), at(4_000));
        assert_eq!(s.competing(1, at(4_000)), 0.0);
    }

    /// Two callers that always have a waiter — one with 100 ms units, one with 800 ms units —
    /// on a pool of 2, served by rank at every release for a simulated minute: each gets its
    /// weight's part of the backend time (equal weights: 50 % each within ±10 points; 3:1:
    /// 75 / 25), whatever its units' length.
    #[test]
    fn saturating_callers_get_their_weights_part_of_the_backend_time() {
        for (weights, want) in [([1, 1], 0.5), ([3, 1], 0.75)] {
            let t0 = Instant::now();
            let mut s = Shares::new(t0);
            let units = [Duration::from_millis(100), Duration::from_millis(800)];
            for (c, w) in weights.iter().enumerate() {
                s.note(&asker(c as u16, *w, None));
            }
            s.contended(true, t0);
            let mut held = [Duration::ZERO; 2];
            // The two backends: (caller, started, ends).
            let mut running: Vec<(u16, Instant, Instant)> = Vec::new();
            let mut now = t0;
            let end = t0 + Duration::from_secs(60);
            while now < end {
                while running.len() < 2 {
                    let pick = (0..2u16)
                        .min_by(|a, b| {
                            let ra = s.rank(Some(*a), now, 2).unwrap_or(f64::INFINITY);
                            let rb = s.rank(Some(*b), now, 2).unwrap_or(f64::INFINITY);
                            ra.total_cmp(&rb)
                        })
                        .expect("two callers");
                    s.start(pick, now);
                    running.push((pick, now, now + units[usize::from(pick)]));
                }
                running.sort_by_key(|r| r.2);
                let (c, started, ends) = running.remove(0);
                now = ends;
                s.finish(c, started, ends);
                held[usize::from(c)] += ends - started;
            }
            let total = (held[0] + held[1]).as_secs_f64();
            let first = held[0].as_secs_f64() / total;
            eprintln!("weights {weights:?}: short caller {first:.3}");
            assert!(
                (first - want).abs() <= 0.1,
                "weights {weights:?}: the short caller held {first:.3} of the time"
            );
        }
    }

    #[test]
    fn rank_divides_by_weight_and_a_caller_over_its_share_is_not_served() {
        let t0 = Instant::now();
        let mut s = Shares::new(t0);
        s.note(&asker(0, 3, None));
        s.note(&asker(1, 1, Some(0.1)));
        s.contended(true, t0);
        for c in [0, 1] {
            s.start(c, t0);
            s.finish(c, t0, t0 + Duration::from_secs(3));
        }
        let now = t0 + Duration::from_secs(3);
        let r0 = s.rank(Some(0), now, 2).expect("no share limit");
        assert!((r0 - 1.0).abs() < 1e-9, "3 s at weight 3: {r0}");
        // 10 % of 2 backends over τ ≈ 14.4 s is ≈ 2.9 s: 3 s is above it.
        assert_eq!(s.rank(Some(1), now, 2), None);
        // Decayed under it, it is served again, when it says.
        let wait = s.under_share_in(1, now, 2).expect("above its share");
        assert!(s.rank(Some(1), now + wait, 2).is_some());
        assert_eq!(
            s.rank(Some(1), now + wait - Duration::from_millis(2), 2),
            None
        );
        assert_eq!(s.under_share_in(0, now, 2), None, "no share");
        assert_eq!(s.rank(None, now, 2), Some(f64::NEG_INFINITY));
        assert_eq!(s.rank(Some(9), now, 2), Some(0.0), "a newcomer ranks first");
    }
}
