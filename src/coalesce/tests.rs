//! The table of shared reads without a database: who leads, who follows, what a follower
//! gets, and every way a run ends.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::{Coalescer, Fallback, Joined, Key, Lead};

fn key(text: &str, settings: &[(&str, &str)]) -> Key {
    Key {
        pool: 1,
        settings: settings
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<Vec<_>>()
            .into(),
        text: Bytes::copy_from_slice(text.as_bytes()),
    }
}

fn lead(c: &Arc<Coalescer>, k: Key, limit: usize) -> Lead {
    match c.join(k, limit, None) {
        Some(Joined::Lead(l)) => l,
        _ => panic!("expected to lead"),
    }
}

fn follow(c: &Arc<Coalescer>, k: Key) -> super::Follower {
    match c.join(k, 1024, None) {
        Some(Joined::Follow(f)) => f,
        _ => panic!("expected to follow"),
    }
}

const ROWS: &[u8] = b"T\0\0\0\x05xD\0\0\0\x05yC\0\0\0\x0dSELECT 1\0";
const READY: &[u8] = b"Z\0\0\0\x05I";

#[tokio::test]
async fn a_follower_gets_the_leaders_bytes_without_the_ready_for_query() {
    let c = Arc::new(Coalescer::default());
    let mut l = lead(&c, key("SELECT 1", &[]), 1024);
    let f = follow(&c, key("SELECT 1", &[]));
    l.capture(&ROWS[..7]);
    l.capture(&ROWS[7..]);
    assert!(!l.seen(false, false));
    l.capture(READY);
    assert!(l.seen(false, true));
    assert_eq!(c.in_flight(), 0, "a finished run leaves the table");
    assert_eq!(f.wait(Duration::from_secs(1)).await.unwrap(), ROWS);
    assert_eq!(
        c.counters.shared.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // The next identical read starts a run of its own.
    let _l2 = lead(&c, key("SELECT 1", &[]), 1024);
}

#[tokio::test]
async fn an_error_a_large_result_and_a_departed_leader_each_end_the_share() {
    let c = Arc::new(Coalescer::default());
    let mut l = lead(&c, key("SELECT 1", &[]), 1024);
    let f = follow(&c, key("SELECT 1", &[]));
    l.capture(b"E\0\0\0\x05x");
    l.seen(true, false);
    l.capture(READY);
    l.seen(false, true);
    assert_eq!(f.wait(Duration::from_secs(1)).await, Err(Fallback::Error));

    let mut l = lead(&c, key("SELECT 1", &[]), 10);
    let f = follow(&c, key("SELECT 1", &[]));
    l.capture(ROWS);
    l.capture(READY);
    l.seen(false, true);
    assert_eq!(
        f.wait(Duration::from_secs(1)).await,
        Err(Fallback::TooLarge)
    );

    let l = lead(&c, key("SELECT 1", &[]), 1024);
    let f = follow(&c, key("SELECT 1", &[]));
    drop(l);
    assert_eq!(f.wait(Duration::from_secs(1)).await, Err(Fallback::Gone));
    assert_eq!(c.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_follower_stops_waiting_at_its_bound() {
    let c = Arc::new(Coalescer::default());
    let _l = lead(&c, key("SELECT 1", &[]), 1024);
    let f = follow(&c, key("SELECT 1", &[]));
    let started = tokio::time::Instant::now();
    assert_eq!(
        f.wait(Duration::from_millis(250)).await,
        Err(Fallback::Timeout)
    );
    assert_eq!(started.elapsed(), Duration::from_millis(250));
}

#[test]
fn reads_are_the_same_only_with_the_same_pool_settings_and_text() {
    let c = Arc::new(Coalescer::default());
    let _l = lead(
        &c,
        key(
            "SELECT 1",
            &[("application_name", "a"), ("search_path", "x")],
        ),
        1,
    );
    // application_name does not count.
    let _f = follow(
        &c,
        key(
            "SELECT 1",
            &[("application_name", "b"), ("search_path", "x")],
        ),
    );
    let _f = follow(&c, key("SELECT 1", &[("search_path", "x")]));
    // Another search_path, another text, another pool: runs of their own.
    let _a = lead(&c, key("SELECT 1", &[("search_path", "y")]), 1);
    let _b = lead(&c, key("SELECT  1", &[("search_path", "x")]), 1);
    let mut other = key("SELECT 1", &[("search_path", "x")]);
    other.pool = 2;
    let _d = lead(&c, other, 1);
    assert_eq!(c.in_flight(), 4);
}

#[tokio::test(start_paused = true)]
async fn a_run_older_than_the_clients_last_unit_is_not_joined() {
    let c = Arc::new(Coalescer::default());
    let _l = lead(&c, key("SELECT 1", &[]), 1024);
    tokio::time::advance(Duration::from_millis(5)).await;
    let before = tokio::time::Instant::now() - Duration::from_millis(10);
    let after = tokio::time::Instant::now();
    // Its last unit ended before the run started: it may follow.
    assert!(matches!(
        c.join(key("SELECT 1", &[]), 1024, Some(before)),
        Some(Joined::Follow(_))
    ));
    // It ended after: the run may not show what it wrote.
    assert!(c.join(key("SELECT 1", &[]), 1024, Some(after)).is_none());
}

#[test]
fn a_patterns_verdict_is_remembered() {
    let c = Coalescer::default();
    assert_eq!(c.shareable(7, "SELECT 1"), Ok(()));
    // The fingerprint decides: the same pattern is not parsed again.
    assert_eq!(c.shareable(7, "SELECT now()"), Ok(()));
    assert!(c.shareable(8, "SELECT now()").is_err());
}
