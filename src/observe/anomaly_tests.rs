//! Unit tests of the detector on synthetic counter series.

use std::collections::BTreeMap;

use super::*;

const TICK: u64 = 250;

/// Cumulative counters per (fingerprint, caller), advanced tick by tick.
struct Sim {
    det: Detector,
    now: u64,
    start: u64,
    rows: BTreeMap<u64, (u64, BTreeMap<String, Counters>)>,
    events: Vec<(u64, Event)>,
    seed: u64,
}

impl Sim {
    fn new() -> Sim {
        let start = 1_700_000_000_000;
        Sim {
            det: Detector::new(crate::config::DetectorConfig::default()),
            now: start,
            start,
            rows: BTreeMap::new(),
            events: Vec::new(),
            seed: 0x9e37_79b9_7f4a_7c15,
        }
    }

    /// A pseudo-random number in [0, 1) (xorshift; no dependency, repeatable).
    fn rand(&mut self) -> f64 {
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        (self.seed >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Adds `calls` statements of `fp` by `caller` over this tick, each taking `ms`, a share
    /// `err` of them errors and a share `lock` ending in 55P03.
    fn add(&mut self, fp: u64, caller: &str, calls: u64, ms: f64, err: f64, lock: f64) {
        let now = self.now;
        let (_, by) = self
            .rows
            .entry(fp)
            .or_insert_with(|| (now, BTreeMap::new()));
        let c = by.entry(caller.to_owned()).or_default();
        let ns = (ms * 1e6) as u64;
        c.calls += calls;
        c.total_ns += calls * ns;
        c.errors += (calls as f64 * err).round() as u64;
        c.lock_wait_ns += ((calls as f64 * lock).round() as u64) * ns;
    }

    /// Poisson-ish arrivals: `qps` on average over a tick, ±50 % jitter.
    fn steady(&mut self, fp: u64, caller: &str, qps: f64, ms: f64) {
        let mean = qps * TICK as f64 / 1000.0;
        let n = (mean * (0.5 + self.rand())).round() as u64;
        self.add(fp, caller, n, ms, 0.0, 0.0);
    }

    fn tick(&mut self) {
        self.now += TICK;
        let snapshot = self.snapshot();
        for e in self.det.observe(self.now, snapshot) {
            self.events.push((self.now, e));
        }
    }

    fn snapshot(&self) -> CounterSnapshot {
        let mut out = CounterSnapshot::default();
        for (&fp, (first, by)) in &self.rows {
            let mut total = Counters::default();
            let mut by_caller = Vec::new();
            for (name, c) in by {
                total.add(c);
                let mut per_caller = *c;
                per_caller.lock_wait_ns = 0;
                by_caller.push((Arc::from(name.as_str()), per_caller));
            }
            out.fingerprints.push(FingerprintCounters {
                fingerprint: fp,
                first_ms: *first,
                normalized: Arc::from(format!("SELECT {fp}")),
                kind: "read",
                counters: total,
                by_caller,
            });
        }
        out
    }

    fn started(&self) -> Vec<(u64, &Anomaly)> {
        self.events
            .iter()
            .filter_map(|(t, e)| match e {
                Event::Started(a) => Some((*t, a)),
                Event::Cleared(_) => None,
            })
            .collect()
    }

    /// A steady background: three patterns from two callers.
    fn background(&mut self) {
        self.steady(1, "web", 40.0, 2.0);
        self.steady(2, "web", 15.0, 5.0);
        self.steady(3, "billing", 8.0, 1.0);
    }

    fn run(&mut self, secs: u64, mut f: impl FnMut(&mut Sim)) {
        for _ in 0..secs * 1000 / TICK {
            f(self);
            self.tick();
        }
    }
}

#[test]
fn ten_minutes_of_steady_jittery_traffic_raise_nothing() {
    let mut sim = Sim::new();
    sim.run(600, |s| {
        s.background();
        // A pattern that comes and goes (a cron job every 30 s, 1 s at 30 qps).
        let t = (s.now - s.start) / 1000;
        if t % 30 == 0 {
            s.add(9, "cron", 8, 3.0, 0.0, 0.0);
        }
    });
    assert!(
        sim.events.is_empty(),
        "false positives: {:?}",
        sim.events.first()
    );
    assert!(sim.det.tracked() <= 8, "{}", sim.det.tracked());
}

#[test]
fn a_pattern_stepping_30x_is_named_within_two_ticks_with_its_caller() {
    let mut sim = Sim::new();
    sim.run(60, Sim::background);
    let step_at = sim.now;
    sim.run(5, |s| {
        s.background();
        s.steady(2, "web", 15.0 * 30.0, 5.0);
    });
    let started = sim.started();
    let (t, a) = started
        .iter()
        .find(|(_, a)| a.subject == Subject::Fingerprint(2))
        .expect("the stepped fingerprint is flagged");
    assert!(
        *t - step_at <= 3 * TICK,
        "detected {} ms after the step",
        t - step_at
    );
    assert_eq!(a.signal, Signal::RateStep);
    let e = &a.evidence;
    assert!(
        (8.0..25.0).contains(&e.baseline),
        "baseline {} (steady 15 qps)",
        e.baseline
    );
    assert!(e.ratio >= 10.0 && e.current > 150.0, "{e:?}");
    assert_eq!(e.window_ms, 500);
    assert_eq!(a.top_callers[0].0, "web");
    assert_eq!(a.normalized.as_deref(), Some("SELECT 2"));
    // Its caller stepped too, and the caller's anomaly points at the pattern.
    let caller = started
        .iter()
        .find(|(_, a)| a.subject == Subject::Caller("web".into()));
    if let Some((_, c)) = caller {
        assert_eq!(c.top_fingerprint, Some(2));
    }
    // The steady ones were left alone.
    for (_, a) in &started {
        assert!(
            matches!(&a.subject, Subject::Fingerprint(2) | Subject::Caller(_)),
            "{a:?}"
        );
        if let Subject::Caller(name) = &a.subject {
            assert_eq!(&**name, "web");
        }
    }
}

#[test]
fn a_flood_does_not_become_its_own_baseline_and_clears_after_it_stops() {
    let mut sim = Sim::new();
    sim.run(30, Sim::background);
    sim.run(120, |s| {
        s.background();
        s.steady(1, "web", 40.0 * 20.0, 2.0);
    });
    let active = sim.det.active();
    let a = active
        .iter()
        .find(|a| a.subject == Subject::Fingerprint(1))
        .expect("still active after two minutes of flood");
    // Two minutes in, the baseline has moved a little (it learns 20x slower while the
    // anomaly holds), and the episode is held at half the starting factor.
    let e = &a.evidence;
    assert!((20.0..60.0).contains(&e.baseline), "{e:?}");
    assert!(e.baseline_qps < 150.0 && e.ratio >= 5.0, "{e:?}");
    let flood_end = sim.now;
    sim.run(30, Sim::background);
    let cleared: Vec<u64> = sim
        .events
        .iter()
        .filter_map(|(t, e)| match e {
            Event::Cleared(a) if a.subject == Subject::Fingerprint(1) => Some(*t),
            _ => None,
        })
        .collect();
    assert_eq!(cleared.len(), 1, "cleared once");
    let after = cleared[0] - flood_end;
    assert!(
        (10_000..=11_000).contains(&after),
        "cleared {after} ms after"
    );
    assert!(sim.det.active().is_empty());
}

#[test]
fn a_new_pattern_is_flagged_when_it_floods_but_not_when_it_trickles() {
    let mut sim = Sim::new();
    sim.run(20, Sim::background);
    sim.run(20, |s| {
        s.background();
        s.steady(7, "web", 8.0, 1.0);
    });
    assert!(sim.started().is_empty(), "{:?}", sim.started().first());
    sim.run(2, |s| {
        s.background();
        s.steady(7, "web", 8.0, 1.0);
        s.steady(8, "deploy", 300.0, 1.0);
    });
    let started = sim.started();
    assert!(
        started
            .iter()
            .any(|(_, a)| a.subject == Subject::Fingerprint(8)),
        "{started:?}"
    );
}

#[test]
fn one_burst_of_completions_after_a_stall_is_not_an_anomaly() {
    let mut sim = Sim::new();
    sim.run(60, Sim::background);
    // Two seconds of nothing finishing, then all of it in one tick.
    sim.run(2, |_| {});
    sim.add(1, "web", 80 + 40, 300.0, 0.0, 0.0);
    sim.tick();
    sim.run(10, Sim::background);
    assert!(sim.started().is_empty(), "{:?}", sim.started().first());
}

#[test]
fn a_slow_pattern_called_aggressively_shows_in_the_time_share() {
    let mut sim = Sim::new();
    sim.run(60, Sim::background);
    // Twice the rate, each call 20x slower: it takes most of the database time.
    sim.run(3, |s| {
        s.steady(1, "web", 40.0, 2.0);
        s.steady(2, "web", 30.0, 100.0);
        s.steady(3, "billing", 8.0, 1.0);
    });
    let started = sim.started();
    let (_, a) = started
        .iter()
        .find(|(_, a)| a.subject == Subject::Fingerprint(2))
        .expect("flagged");
    assert_eq!(a.signal, Signal::DbTimeShare);
    assert!(a.evidence.db_time_share > 0.5, "{:?}", a.evidence);
    assert!(a.evidence.baseline < 150.0 && a.evidence.current > 1500.0);
}

#[test]
fn everything_slowing_down_at_once_names_no_pattern() {
    let mut sim = Sim::new();
    sim.run(60, Sim::background);
    // The host is starved: every statement takes 20 times longer for three seconds.
    sim.run(3, |s| {
        s.steady(1, "web", 40.0, 40.0);
        s.steady(2, "web", 15.0, 100.0);
        s.steady(3, "billing", 8.0, 20.0);
    });
    sim.run(10, Sim::background);
    assert!(sim.started().is_empty(), "{:?}", sim.started().first());
}

#[test]
fn a_stall_that_drains_one_pattern_first_names_no_pattern() {
    let mut sim = Sim::new();
    sim.run(60, Sim::background);
    // Nothing completes for 750 ms; then the billing pattern's backlog completes over two
    // ticks, slowly, before the others'.
    sim.run(1, |_| {});
    sim.add(3, "billing", 8, 600.0, 0.0, 0.0);
    sim.tick();
    sim.add(3, "billing", 8, 450.0, 0.0, 0.0);
    sim.tick();
    sim.add(1, "web", 40, 400.0, 0.0, 0.0);
    sim.add(2, "web", 15, 400.0, 0.0, 0.0);
    sim.tick();
    sim.run(10, Sim::background);
    assert!(sim.started().is_empty(), "{:?}", sim.started().first());
}

#[test]
fn errors_and_lock_waits_have_signals_of_their_own() {
    let mut sim = Sim::new();
    sim.run(60, Sim::background);
    sim.run(3, |s| {
        s.background();
        s.add(1, "web", 30, 2.0, 0.9, 0.0);
        s.add(3, "billing", 10, 50.0, 0.8, 0.6);
    });
    let started = sim.started();
    let signal = |fp| {
        started
            .iter()
            .find(|(_, a)| a.subject == Subject::Fingerprint(fp))
            .map(|(_, a)| a.signal)
    };
    assert_eq!(signal(1), Some(Signal::ErrorShare));
    // Fingerprint 3 errs, waits for locks and takes most of the time; errors come first.
    assert_eq!(signal(3), Some(Signal::ErrorShare));

    let mut sim = Sim::new();
    sim.run(60, Sim::background);
    sim.run(3, |s| {
        s.background();
        s.add(3, "billing", 10, 50.0, 0.3, 0.9);
    });
    let started = sim.started();
    let (_, a) = started
        .iter()
        .find(|(_, a)| a.subject == Subject::Fingerprint(3))
        .expect("flagged");
    assert_eq!(a.signal, Signal::LockWaitShare);
}

#[test]
fn nothing_is_flagged_during_the_warm_up_and_a_reset_is_no_step() {
    let mut sim = Sim::new();
    sim.run(5, |s| {
        s.background();
        s.steady(5, "web", 500.0, 1.0);
    });
    assert!(sim.started().is_empty());
    sim.run(60, |s| {
        s.background();
        s.steady(5, "web", 500.0, 1.0);
    });
    assert!(
        sim.started().is_empty(),
        "a busy pattern from the start is its own baseline: {:?}",
        sim.started().first()
    );
    // The statistics are reset: counters go back to zero and grow again.
    sim.rows.clear();
    sim.run(30, |s| {
        s.background();
        s.steady(5, "web", 500.0, 1.0);
    });
    assert!(
        sim.started().is_empty(),
        "a reset is not a step: {:?}",
        sim.started().first()
    );
}
