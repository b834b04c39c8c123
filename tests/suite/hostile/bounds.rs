//! Items 9–11 of issue 15: one client must not grow the process without bound.

use std::time::Duration;

use super::common::start;
use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER};
use crate::support::proxy::Proxy;
use crate::support::sql::{eventually, sqlstate};
use crate::support::wire::{Backend, WireClient};
use crate::support::{note_skipped, random_u64, within};

async fn wire(proxy: &Proxy) -> WireClient {
    WireClient::connect(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB)
        .await
        .expect("wire client")
}

async fn pool_count(proxy: &Proxy) -> usize {
    let (status, body) = proxy
        .admin_request(
            "GET",
            "/v1/pools",
            crate::support::proxy::ADMIN_READ_TOKEN,
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("pools JSON");
    v.as_array()
        .or_else(|| v.get("pools").and_then(|p| p.as_array()))
        .map_or(0, Vec::len)
}

/// Item 9: every database name a client asks for used to get a pool, kept forever. Now
/// pools are bounded by `limits.max_pools`, and pools without clients or connections go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_database_names_do_not_grow_the_pool_map() {
    let env = start(2, "limits: { max_pools: 8 }\n", |_| {});
    let proxy = &env.proxy;
    if proxy.is_direct() {
        note_skipped("pools (direct mode has none)");
        return;
    }
    let good = proxy.client().await;
    let names: Vec<String> = (0..400)
        .map(|_| format!("nodb_{:x}", random_u64()))
        .collect();
    // Four at a time: with the real pool, at most five are in use at once.
    for (i, chunk) in names.chunks(4).enumerate() {
        let attempts: Vec<_> = chunk
            .iter()
            .map(|db| {
                let cfg = proxy.config(APP_USER, APP_PASSWORD, db);
                tokio::spawn(async move { cfg.connect(tokio_postgres::NoTls).await.map(|_| ()) })
            })
            .collect();
        for a in attempts {
            let e = a
                .await
                .expect("task")
                .expect_err("a database that does not exist");
            // Never "too many pools": pools nobody uses make room.
            assert_eq!(sqlstate(&e), "3D000", "{e:?}");
        }
        assert!(
            pool_count(proxy).await <= 8,
            "chunk {i}: pools beyond limits.max_pools"
        );
    }
    // The client that was there all along still works, and idle pools are swept.
    assert_eq!(
        crate::support::sql::scalar(&good, "SELECT 1").await,
        "1",
        "the real pool"
    );
    eventually(Duration::from_secs(10), "unused pools removed", || async {
        pool_count(proxy).await <= 1
    })
    .await;
    proxy.assert_healthy().await;
}

/// Peak resident memory of a process (`VmHWM`), in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

/// Item 10: a Query larger than `limits.max_message_bytes` is refused with 54000 before it
/// is buffered (peak memory does not grow by its size), and the connection stays usable; in
/// a transaction the refusal aborts it, like any error there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_messages_are_refused_without_being_buffered() {
    let env = start(2, "limits: { max_message_bytes: 1048576 }\n", |_| {});
    let proxy = &env.proxy;
    let Some(pid) = proxy.pid() else {
        note_skipped("the proxy's memory (direct mode has none)");
        return;
    };
    let mut c = wire(proxy).await;
    assert_eq!(
        c.simple("SELECT 1").await.expect("warm up"),
        [Some("1".into())]
    );
    let before = peak_rss_kib(pid);
    let huge = format!("SELECT '{}'", "x".repeat(96 << 20));
    for round in 0..2 {
        let e = c.simple(&huge).await.expect_err("an oversized Query");
        assert!(
            e.starts_with("54000") && e.contains("max_message_bytes"),
            "round {round}: {e}"
        );
        assert_eq!(
            c.simple("SELECT 2").await.expect("after"),
            [Some("2".into())]
        );
    }
    let grown = peak_rss_kib(pid).saturating_sub(before);
    assert!(
        grown < 48 << 10,
        "peak RSS grew by {grown} KiB for two 96 MiB messages it should have dropped"
    );
    // Inside a transaction: the transaction is aborted, as by any error.
    c.simple("BEGIN").await.expect("BEGIN");
    let e = c
        .simple(&huge)
        .await
        .expect_err("oversized in a transaction");
    assert!(e.starts_with("54000"), "{e}");
    let e = c.simple("SELECT 3").await.expect_err("aborted transaction");
    assert!(e.starts_with("25P02"), "{e}");
    c.simple("ROLLBACK").await.expect("ROLLBACK");
    assert_eq!(
        c.simple("SELECT 4").await.expect("after"),
        [Some("4".into())]
    );
    proxy.assert_healthy().await;
}

/// Item 11: named prepared statements per session are capped (`limits.max_client_statements`):
/// one more is refused with 54000 and the session goes on; closing one makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statements_per_session_are_capped() {
    let env = start(2, "limits: { max_client_statements: 20 }\n", |_| {});
    let proxy = &env.proxy;
    if proxy.is_direct() {
        note_skipped("the proxy's cap (direct mode has none)");
        return;
    }
    let mut c = wire(proxy).await;
    for i in 0..20 {
        c.parse(&format!("s{i}"), &format!("SELECT {i}"));
    }
    c.sync();
    c.send().await.expect("send");
    let replies = c.until_ready().await.expect("20 Parses");
    assert!(
        replies.iter().all(|m| m.error_code().is_none()),
        "{replies:?}"
    );
    c.parse("s20", "SELECT 20").sync();
    c.send().await.expect("send");
    let replies = c.until_ready().await.expect("the 21st");
    let refused = replies.iter().find_map(|m| match m {
        Backend::Error { code, message } => Some(format!("{code}: {message}")),
        _ => None,
    });
    let refused = refused.expect("the 21st statement must be refused");
    assert!(
        refused.starts_with("54000") && refused.contains("max_client_statements"),
        "{refused}"
    );
    // The session goes on; closing one makes room for another.
    c.close_statement("s0")
        .parse("s20", "SELECT 20")
        .bind("", "s20", &[]);
    c.execute("", 0).sync();
    c.send().await.expect("send");
    let replies = within(
        Duration::from_secs(20),
        "after closing one",
        c.until_ready(),
    )
    .await
    .expect("replies");
    assert!(
        replies.iter().all(|m| m.error_code().is_none()),
        "{replies:?}"
    );
    assert!(
        replies.contains(&Backend::DataRow(vec![Some("20".into())])),
        "{replies:?}"
    );
    proxy.assert_healthy().await;
}
