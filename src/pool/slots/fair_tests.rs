//! Paused-time tests of the fair queue ([`super::Slots`] with `fair`): callers of one
//! priority share the pool by backend time (per weight), not by arrival; a caller's
//! `db_time_share` caps it; without the option the queue stays first come, first served.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::Slots;
use crate::policy::share::Asker;

/// What the workers of one caller saw: backend time held (after the warm-up) and each wait.
#[derive(Default)]
struct Seen {
    held: Duration,
    waits: Vec<Duration>,
}

fn asker(caller: u16, weight: u32, share: Option<f64>) -> Asker {
    Asker {
        priority: 2,
        caller: Some(caller),
        weight,
        share,
    }
}

/// `workers` tasks of `who` that each take a slot, hold it `hold`, give it back and come
/// again at once. Holds and waits that start after `from` are recorded in `seen`.
fn workers(
    s: &Arc<Slots>,
    who: Asker,
    workers: usize,
    hold: Duration,
    from: Instant,
    seen: &Arc<Mutex<Seen>>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..workers)
        .map(|_| {
            let (s, seen) = (Arc::clone(s), Arc::clone(seen));
            tokio::spawn(async move {
                loop {
                    let asked = Instant::now();
                    let far = asked + Duration::from_secs(600);
                    let p = s.acquire(who, far, usize::MAX).await.expect("far deadline");
                    let got = Instant::now();
                    tokio::time::sleep(hold).await;
                    drop(p);
                    if asked >= from {
                        let mut seen = seen.lock();
                        seen.waits.push(got - asked);
                        seen.held += hold;
                    }
                }
            })
        })
        .collect()
}

/// The `q`th quantile of `waits`.
fn quantile(waits: &mut [Duration], q: f64) -> Duration {
    waits.sort_unstable();
    let i = ((waits.len() as f64 * q) as usize).min(waits.len() - 1);
    waits[i]
}

/// Runs a report caller (6 workers, 800 ms units) and a lookup caller (2 workers, 2 ms
/// units) on a pool of 2 for a minute after a 20 s warm-up: the lookups' share of the
/// backend time held, and their waits.
async fn reports_and_lookups(fair: bool) -> (f64, Vec<Duration>) {
    let s = Slots::with_fair(2, 0, fair);
    let from = Instant::now() + Duration::from_secs(20);
    let (report, lookup) = (Arc::default(), Arc::default());
    let mut tasks = workers(
        &s,
        asker(0, 1, None),
        6,
        Duration::from_millis(800),
        from,
        &report,
    );
    tasks.extend(workers(
        &s,
        asker(1, 1, None),
        2,
        Duration::from_millis(2),
        from,
        &lookup,
    ));
    tokio::time::sleep(Duration::from_secs(80)).await;
    tasks.iter().for_each(|t| t.abort());
    let (r, l): (Duration, Duration) = (report.lock().held, lookup.lock().held);
    let share = l.as_secs_f64() / (r + l).as_secs_f64();
    let waits = std::mem::take(&mut lookup.lock().waits);
    (share, waits)
}

/// With fair shares the lookups get about half the backend time and most of their waits
/// are short; first come, first served, the reports hold the pool and the lookups queue
/// behind them.
#[tokio::test(start_paused = true)]
async fn short_units_get_their_share_and_short_waits_with_fair_shares() {
    let (share, mut waits) = reports_and_lookups(true).await;
    let (p50, p99) = (quantile(&mut waits, 0.5), quantile(&mut waits, 0.99));
    eprintln!(
        "fair: lookup share {share:.3}, waits p50 {p50:?} p99 {p99:?}, {} units",
        waits.len()
    );
    assert!((0.4..=0.6).contains(&share), "lookup share {share}");
    assert!(p50 <= Duration::from_millis(5), "p50 {p50:?}");
    assert!(p99 <= Duration::from_millis(100), "p99 {p99:?}");

    let (share, mut waits) = reports_and_lookups(false).await;
    let (p50, p99) = (quantile(&mut waits, 0.5), quantile(&mut waits, 0.99));
    eprintln!(
        "fifo: lookup share {share:.3}, waits p50 {p50:?} p99 {p99:?}, {} units",
        waits.len()
    );
    assert!(share < 0.05, "lookup share {share}");
    assert!(p50 >= Duration::from_millis(1000), "p50 {p50:?}");
}

/// Weights 3 : 1 between two callers of equal units give them 3/4 and 1/4 of the time.
#[tokio::test(start_paused = true)]
async fn weights_divide_the_time() {
    let s = Slots::with_fair(2, 0, true);
    let from = Instant::now() + Duration::from_secs(20);
    let (heavy, light) = (Arc::default(), Arc::default());
    let hold = Duration::from_millis(100);
    let mut tasks = workers(&s, asker(0, 3, None), 4, hold, from, &heavy);
    tasks.extend(workers(&s, asker(1, 1, None), 4, hold, from, &light));
    tokio::time::sleep(Duration::from_secs(80)).await;
    tasks.iter().for_each(|t| t.abort());
    let (h, l) = (heavy.lock().held, light.lock().held);
    let share = h.as_secs_f64() / (h + l).as_secs_f64();
    eprintln!("weight 3: share {share:.3}");
    assert!(
        (0.7..=0.8).contains(&share),
        "weight 3 caller's share {share}"
    );
}

/// A caller with `db_time_share: 0.25` alone on a pool of 2 holds about half a backend on
/// average, with a backend free; a caller without a limit is served at once meanwhile.
#[tokio::test(start_paused = true)]
async fn a_time_share_caps_a_caller_even_with_backends_free() {
    let s = Slots::with_fair(2, 0, true);
    let from = Instant::now() + Duration::from_secs(60);
    let capped = Arc::default();
    let tasks = workers(
        &s,
        asker(0, 1, Some(0.25)),
        4,
        Duration::from_millis(100),
        from,
        &capped,
    );
    tokio::time::sleep(Duration::from_secs(120)).await;
    let held = capped.lock().held.as_secs_f64();
    let share = held / (2.0 * 60.0);
    eprintln!("capped share {share:.3}");
    assert!(
        (0.2..=0.3).contains(&share),
        "capped caller's share {share}"
    );
    // Another caller finds a backend without waiting.
    let t = Instant::now();
    let p = s
        .acquire(asker(1, 1, None), t + Duration::from_secs(1), usize::MAX)
        .await
        .expect("served");
    assert!(
        t.elapsed() <= Duration::from_millis(100),
        "{:?}",
        t.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(10)).await;
    drop(p);
    tasks.iter().for_each(|t| t.abort());
    // Both callers' time shows in the stats; a checkout of the proxy's own is not charged.
    let own = s
        .acquire(2, Instant::now() + Duration::from_secs(1), usize::MAX)
        .await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    drop(own);
    let stats = s.shares(Instant::now());
    assert_eq!(stats.len(), 2, "{stats:?}");
    assert!(stats[0].share > 0.15 && stats[0].share < 0.35, "{stats:?}");
    assert!(
        (stats[1].backend_seconds_total - 0.01).abs() < 1e-6,
        "{stats:?}"
    );
}

/// Without fair shares, waiters of two callers are served in arrival order; with them,
/// the caller that held less while others waited goes first, FIFO among its own waiters.
#[tokio::test(start_paused = true)]
async fn the_least_loaded_caller_goes_first_fifo_within_it() {
    for fair in [false, true] {
        let s = Slots::with_fair(1, 0, fair);
        let far = Instant::now() + Duration::from_secs(60);
        // Caller 0 holds a backend for a second while the others wait; caller 1 never did.
        let p = s.acquire(asker(0, 1, None), far, usize::MAX).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, caller) in [("a1", 0), ("b1", 1), ("a2", 0), ("b2", 1)] {
            let (s, order) = (s.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let p = s
                    .acquire(asker(caller, 1, None), far, usize::MAX)
                    .await
                    .unwrap();
                order.lock().push(name);
                tokio::time::sleep(Duration::from_millis(10)).await;
                drop(p);
            }));
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(p);
        for t in tasks {
            t.await.unwrap();
        }
        let want = if fair {
            ["b1", "b2", "a1", "a2"]
        } else {
            ["a1", "b1", "a2", "b2"]
        };
        assert_eq!(*order.lock(), want, "fair: {fair}");
    }
}

/// A caller that had the pool to itself is not in debt for it: lookups that kept both
/// backends busy for 20 s with nobody else asking still win the next backend once reports
/// arrive, from the first second on.
#[tokio::test(start_paused = true)]
async fn time_nobody_else_wanted_is_not_held_against_a_caller() {
    let s = Slots::with_fair(2, 0, true);
    let start = Instant::now();
    let lookup = Arc::default();
    let mut tasks = workers(
        &s,
        asker(1, 1, None),
        2,
        Duration::from_millis(2),
        start,
        &lookup,
    );
    tokio::time::sleep(Duration::from_secs(20)).await;
    let alone = lookup.lock().held;
    assert!(
        alone > Duration::from_secs(39),
        "the lookups used the pool: {alone:?}"
    );
    let from = Instant::now();
    let report = Arc::default();
    lookup.lock().waits.clear();
    tasks.extend(workers(
        &s,
        asker(0, 1, None),
        6,
        Duration::from_millis(800),
        from,
        &report,
    ));
    tokio::time::sleep(Duration::from_secs(5)).await;
    tasks.iter().for_each(|t| t.abort());
    let mut waits = std::mem::take(&mut lookup.lock().waits);
    let p99 = quantile(&mut waits, 0.99);
    eprintln!(
        "after 20 s alone: lookup waits p99 {p99:?}, {} units",
        waits.len()
    );
    assert!(p99 <= Duration::from_millis(100), "p99 {p99:?}");
}
