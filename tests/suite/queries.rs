//! Queries through the proxy as real clients see them (issue 2): simple queries of one and of
//! several statements, errors that reach the client — in a transaction and in the middle of a
//! multi-statement query too — after which it continues (`psql` as well), large results
//! streamed (200 000 rows, a 10 MB value), and notices.
//!
//! Run with `PGSLUICE_TEST_DIRECT=1` to check the tests against PostgreSQL itself.

use std::time::Duration;

use futures_util::TryStreamExt;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::{AsyncMessage, SimpleQueryMessage};

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::sql::{STEP, scalar, simple_values, sqlstate};
use crate::support::{run_with_timeout_async, within};

#[tokio::test]
async fn simple_query_single_and_multi_statement() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(4));
    let client = proxy.client().await;

    assert_eq!(scalar(&client, "SELECT 1").await, "1");

    let messages = within(
        STEP,
        "a multi-statement simple query",
        client.simple_query(
            "CREATE TABLE items (id int PRIMARY KEY, name text); \
             INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 5) g; \
             SELECT name FROM items ORDER BY id; \
             SELECT count(*) FROM items",
        ),
    )
    .await
    .expect("multi-statement query");
    let completions: Vec<u64> = messages
        .iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::CommandComplete(n) => Some(*n),
            _ => None,
        })
        .collect();
    assert_eq!(
        completions,
        vec![0, 5, 5, 1],
        "one CommandComplete per statement, in order"
    );
    let values = simple_values(&messages);
    assert_eq!(values.len(), 6, "5 names and one count: {values:?}");
    assert_eq!(values[0].as_deref(), Some("item 1"));
    assert_eq!(values[5].as_deref(), Some("5"));

    // An empty query and NULLs pass through.
    within(STEP, "an empty query", client.simple_query(""))
        .await
        .expect("empty query");
    let messages = within(STEP, "NULL value", client.simple_query("SELECT NULL::text"))
        .await
        .expect("NULL");
    assert_eq!(simple_values(&messages), vec![None]);
    proxy.assert_healthy().await;
}

#[tokio::test]
async fn errors_reach_the_client_and_it_continues() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let mut client = proxy.client().await;

    let err = within(STEP, "1/0", client.simple_query("SELECT 1/0"))
        .await
        .expect_err("1/0 fails");
    assert_eq!(sqlstate(&err), SqlState::DIVISION_BY_ZERO.code(), "{err:?}");
    assert_eq!(scalar(&client, "SELECT 42").await, "42");

    let err = within(
        STEP,
        "1/0 extended",
        client.query_typed("SELECT 1/$1::int", &[(&0i32, Type::INT4)]),
    )
    .await
    .expect_err("1/0 fails");
    assert_eq!(sqlstate(&err), SqlState::DIVISION_BY_ZERO.code(), "{err:?}");
    let rows = within(STEP, "after error", client.query_typed("SELECT 7", &[]))
        .await
        .expect("continue");
    assert_eq!(rows.len(), 1);

    // Inside a transaction: the error aborts it, later statements get 25P02 until ROLLBACK.
    let tx = within(STEP, "BEGIN", client.transaction())
        .await
        .expect("begin");
    let err = within(STEP, "1/0 in tx", tx.simple_query("SELECT 1/0"))
        .await
        .expect_err("fails");
    assert_eq!(sqlstate(&err), SqlState::DIVISION_BY_ZERO.code());
    let err = within(STEP, "statement in aborted tx", tx.simple_query("SELECT 1"))
        .await
        .expect_err("aborted");
    assert_eq!(sqlstate(&err), SqlState::IN_FAILED_SQL_TRANSACTION.code());
    within(STEP, "ROLLBACK", tx.rollback())
        .await
        .expect("rollback");
    assert_eq!(scalar(&client, "SELECT 'clean'").await, "clean");

    // A multi-statement simple query stops at the first error.
    let err = within(
        STEP,
        "multi with error",
        client.simple_query("SELECT 1; SELECT 1/0; SELECT 3"),
    )
    .await
    .expect_err("fails");
    assert_eq!(sqlstate(&err), SqlState::DIVISION_BY_ZERO.code());
    assert_eq!(scalar(&client, "SELECT 'still fine'").await, "still fine");
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_results_are_streamed() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let client = proxy.client().await;

    let stream = within(
        STEP,
        "200 000-row query",
        client.query_typed_raw(
            "SELECT g, md5(g::text) FROM generate_series(1, $1::int) g",
            [(200_000i32, Type::INT4)],
        ),
    )
    .await
    .expect("start 200k rows");
    let (count, sum) = within(
        Duration::from_secs(60),
        "200 000 rows",
        stream.try_fold((0u64, 0i64), |(n, s), row| async move {
            let md5: &str = row.get(1);
            assert_eq!(md5.len(), 32);
            Ok((n + 1, s + i64::from(row.get::<_, i32>(0))))
        }),
    )
    .await
    .expect("read 200k rows");
    assert_eq!((count, sum), (200_000, 200_000 * 200_001 / 2));

    let rows = within(
        Duration::from_secs(60),
        "a 10 MB value",
        client.query_typed("SELECT repeat('x', 10000000)", &[]),
    )
    .await
    .expect("10 MB value");
    let value: &str = rows[0].get(0);
    assert_eq!(value.len(), 10_000_000);
    assert!(value.bytes().all(|b| b == b'x'));
    proxy.assert_healthy().await;
}

#[tokio::test]
async fn notices_reach_the_client() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let (client, mut messages, _task) = proxy.client_with_messages(&proxy.app_config()).await;
    within(
        STEP,
        "RAISE NOTICE",
        client.batch_execute("DO $$ BEGIN RAISE NOTICE 'hello from plpgsql'; END $$"),
    )
    .await
    .expect("DO block");
    let notice = within(STEP, "the NoticeResponse", messages.recv())
        .await
        .expect("a message");
    match notice {
        AsyncMessage::Notice(n) => assert_eq!(n.message(), "hello from plpgsql"),
        other => panic!("expected a notice, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_session_continues_after_division_by_zero() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let files = tempfile::tempdir().expect("temp dir");
    let script = files.path().join("script.sql");
    std::fs::write(
        &script,
        "\\set VERBOSITY verbose\nSELECT 1/0;\nSELECT 42;\n",
    )
    .expect("write script");
    let mut cmd = proxy.tool_command("psql", APP_USER, APP_PASSWORD, APP_DB);
    cmd.args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=0", "-f"])
        .arg(&script);
    let out = run_with_timeout_async(cmd, Duration::from_secs(60)).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("22012"),
        "psql must print SQLSTATE 22012 for 1/0; stderr:\n{stderr}"
    );
    assert!(stderr.contains("division by zero"), "stderr:\n{stderr}");
    assert!(
        stdout.lines().any(|l| l.trim() == "42"),
        "the session continues and prints 42; stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    proxy.assert_healthy().await;
}
