//! The `classify` settings take effect (issue 16, item 9), seen from outside the proxy:
//! `stats_capacity` bounds the fingerprints kept apart (the rest sum into `other`);
//! `max_text_bytes` sends longer texts to the byte scanner, which still fingerprints them the
//! same way for every literal; `enabled: false` reads no tags (a tag-only caller limits
//! nothing), keeps no fingerprints, and — since nothing about a statement is known — never lets
//! a client's session state reach the next client.
//!
//! With `PGSLUICE_TEST_DIRECT=1` these tests are skipped (they are about the proxy).

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::support::env::Env;
use crate::support::proxy::{ADMIN_READ_TOKEN, Proxy};
use crate::support::sql::{STEP, scalar};
use crate::support::{direct_mode, note_skipped, within};

fn start(pool: usize, yaml: &str) -> Option<Env> {
    if direct_mode() {
        note_skipped("classify settings (they need the proxy)");
        return None;
    }
    Some(Env::start(pool, yaml, |_| {}))
}

async fn fingerprints(proxy: &Proxy) -> Vec<Value> {
    let (status, body) = proxy
        .admin_request(
            "GET",
            "/v1/fingerprints?sort=calls&limit=1000",
            ADMIN_READ_TOKEN,
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    v["fingerprints"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_capacity_and_max_text_bytes_take_effect() {
    let Some(env) = start(2, "classify:\n  stats_capacity: 3\n  max_text_bytes: 64\n") else {
        return;
    };
    let c = env.proxy.client().await;
    // Six patterns, the first most often: three are kept apart, the rest are `other`.
    for (i, n) in [(1, 6), (2, 5), (3, 4), (4, 1), (5, 1), (6, 1)] {
        for _ in 0..n {
            let sql = format!("SELECT {i} AS c{i}");
            within(STEP, &sql, c.simple_query(&sql))
                .await
                .expect("query");
        }
    }
    let rows = fingerprints(&env.proxy).await;
    let named: Vec<&Value> = rows
        .iter()
        .filter(|r| r["fingerprint"] != "other")
        .collect();
    assert!(
        named.len() <= 3,
        "stats_capacity 3 keeps three apart: {rows:?}"
    );
    let total: u64 = rows.iter().filter_map(|r| r["calls"].as_u64()).sum();
    assert!(
        total >= 18,
        "every call is counted, in a row of its own or in other: {rows:?}"
    );
    // A text longer than max_text_bytes is read by the scanner and still fingerprinted as
    // one pattern whatever its literals.
    let long = |v: u32| {
        format!(
            "SELECT {v} AS a, '{}' AS padding_of_a_long_statement",
            "x".repeat(80)
        )
    };
    let a = long(1);
    let b = long(2);
    assert!(a.len() > 64);
    for sql in [&a, &b] {
        within(STEP, "long", c.simple_query(sql))
            .await
            .expect("long query");
    }
    let rows = fingerprints(&env.proxy).await;
    let long_rows: Vec<&Value> = rows
        .iter()
        .filter(|r| {
            r["normalized"]
                .as_str()
                .is_some_and(|n| n.contains("padding_of_a_long"))
        })
        .collect();
    assert_eq!(
        long_rows.len(),
        1,
        "one pattern for both long texts: {rows:?}"
    );
    assert_eq!(long_rows[0]["calls"], 2, "{rows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_classification_off_tags_fingerprints_and_session_state_are_not_trusted() {
    let yaml = "\
classify:
  enabled: false
callers:
  - { name: tagged, max_concurrency: 1, queue_depth: 0, match: { tag: { service: one } } }
";
    let Some(env) = start(1, yaml) else {
        return;
    };
    let proxy = &env.proxy;
    // The tag is not read: two tagged statements at once are not limited to one.
    let a = Arc::new(proxy.client().await);
    let b = proxy.client().await;
    let a2 = Arc::clone(&a);
    let slow = tokio::spawn(async move {
        within(
            STEP,
            "tagged sleep",
            a2.simple_query("/*service:one*/ SELECT pg_sleep(0.5)"),
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let r = within(STEP, "tagged", b.simple_query("/*service:one*/ SELECT 1")).await;
    assert!(r.is_ok(), "no tag, no caller limit: {r:?}");
    slow.await.expect("task").expect("the sleep");
    // No patterns: everything is one unclassified row (fingerprint 0, no text).
    let rows = fingerprints(proxy).await;
    assert!(
        rows.len() == 1
            && rows[0]["fingerprint"] == "0000000000000000"
            && rows[0]["normalized"] == "",
        "no fingerprints are kept: {rows:?}"
    );
    // A client's settings never reach the next one (one backend, shared).
    let setter = proxy.client().await;
    within(
        STEP,
        "SET",
        setter.batch_execute("SET search_path = evil; SET application_name = leaked"),
    )
    .await
    .expect("SET");
    drop(setter);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let next = proxy.client().await;
    assert_eq!(scalar(&next, "SHOW search_path").await, "\"$user\", public");
    proxy.assert_healthy().await;
}
