//! Retry hints (issue 17): a refusal tells the client to come back after the expected wait of
//! the queue that refused, not after a window that doubles with every refusal.
//!
//! With `PGSLUICE_TEST_DIRECT=1` this test is skipped (it is about the proxy).

use std::time::{Duration, Instant};

use crate::support::proxy::client;
use crate::support::sql::{STEP, sqlstate};
use crate::support::storm::start;
use crate::support::within;

const DRAIN_YAML: &str = "\
callers:
  - name: sync
    max_concurrency: 1
    queue_depth: 0
    match: { application_name: sync }
";

/// N from a `retry_after_ms=N` HINT.
pub(super) fn hint_ms(e: &tokio_postgres::Error) -> u64 {
    let db = e.as_db_error().expect("an ErrorResponse");
    db.hint()
        .and_then(|h| h.strip_prefix("retry_after_ms="))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("a retry hint: {db:?}"))
}

/// A caller whose one slot is busy with 0.4 s statements drains about 2.5 statements a
/// second: once the proxy has seen that rate, its refusals say "come back in about 0.4 s"
/// (spread over half to one and a half of it) however long the streak of refusals — not a
/// window that doubles with every refusal up to 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_hint_the_expected_wait_of_the_queue_that_refused() {
    let Some(env) = start(4, DRAIN_YAML) else {
        return;
    };
    let proxy = &env.proxy;
    let busy = client(proxy, "sync").await;
    let worker = tokio::spawn(async move {
        for _ in 0..12 {
            let _ = busy.simple_query("SELECT pg_sleep(0.4)").await;
        }
    });
    let refused = client(proxy, "sync").await;
    let mut hints = Vec::new();
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        if let Err(e) = within(
            STEP,
            "a refused statement",
            refused.simple_query("SELECT 1"),
        )
        .await
        {
            assert_eq!(sqlstate(&e), "53300", "{e:?}");
            hints.push(hint_ms(&e));
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    worker.abort();
    assert!(hints.len() >= 10, "the slot stayed busy: {hints:?}");
    let last = &hints[hints.len() - 5..];
    assert!(
        last.iter().all(|h| (150..=1200).contains(h)),
        "hints follow the 0.4 s drain, not the streak: {hints:?}"
    );
    proxy.assert_healthy().await;
}
