//! Timeouts. The statement and lock timeouts the proxy injects for a caller (issue 5), against
//! a real PostgreSQL: they cancel through the simple and the extended protocol and inside
//! transactions, a client's own stricter settings are kept and `SHOW` reports the client's own
//! values, a hostile `search_path` cannot neutralize them, the injection leaves error positions
//! and replies as direct Postgres gives them, and the proxy's backstop ends with its statement.
//!
//! Every test starts its own cluster and proxy with a YAML config (`crate::support::policy`);
//! with `PGSLUICE_TEST_DIRECT=1` they are skipped.
//!
//! * `budgets` — every statement kind runs with its caller's budget (issue 15, item 7).
//! * `idle` — clients idle inside a transaction (`idle_transaction_timeout_ms`) or between
//!   transactions (`limits.client_idle_timeout_ms`) are ended (issue 17).
//!
//! A slow backend under `global_defaults` timeouts (D5) is in `backend_faults`, slowloris (A7)
//! in `protocol_faults`, slow readers in `overload`.

mod budgets;
mod idle;

use std::time::{Duration, Instant};

use tokio_postgres::error::ErrorPosition;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::policy::{Timed, connect, db_error, exec, start, timed};
use crate::support::sql::{STEP, scalar, sqlstate};
use crate::support::within;

/// A client connected straight to PostgreSQL as `app` (the reference behaviour).
async fn direct_client(cluster: &Cluster) -> Client {
    let (client, conn) = within(
        STEP,
        "a direct connection as app",
        tokio_postgres::connect(&cluster.connect_str(APP_USER, APP_PASSWORD, APP_DB), NoTls),
    )
    .await
    .expect("direct connection as app");
    tokio::spawn(conn);
    client
}

/// The error position (1-based, in characters) of a server error.
fn position(e: &tokio_postgres::Error) -> Option<u32> {
    match db_error(e).position() {
        Some(ErrorPosition::Original(p)) => Some(*p),
        Some(ErrorPosition::Internal { position, .. }) => Some(*position),
        None => None,
    }
}

const TIMEOUT_CONFIG: &str = r#"
callers:
  - name: reporting
    match: { application_name: reporting }
    statement_timeout_ms: { read: 800, write: 5000 }
    lock_timeout_ms: 200
"#;

/// `SELECT pg_sleep(2)` through the extended protocol (unnamed statement, typed parameter).
async fn timed_typed_sleep(client: &Client) -> Timed {
    let start = Instant::now();
    let r = within(
        STEP,
        "query_typed pg_sleep",
        client.query_typed("SELECT pg_sleep($1)", &[(&2.0f64, Type::FLOAT8)]),
    )
    .await;
    Timed {
        elapsed: start.elapsed(),
        result: r.map(|_| Vec::new()),
    }
}

fn assert_statement_timeout(t: &Timed, what: &str) {
    let e = t.err(what);
    assert_eq!(sqlstate(e), "57014", "{what}: {e:?}");
    assert!(
        db_error(e).message().contains("statement timeout"),
        "{what}: cancelled by Postgres' statement_timeout, not the backstop: {e:?}"
    );
    assert!(
        t.elapsed >= Duration::from_millis(750) && t.elapsed < Duration::from_millis(1800),
        "{what}: cancelled after {:?}, expected about 800 ms",
        t.elapsed
    );
}

/// TESTS.md B7's lesson for the SQL the proxy runs inside a client's session: a client whose
/// `search_path` puts its own schema first, holding its own `set_config` and
/// `current_setting`, cannot neutralize the injected statement timeout — from the startup
/// packet's `options`, from a tracked `SET`, simple and extended protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_search_path_cannot_neutralize_the_injected_timeout() {
    let Some(env) = start(4, TIMEOUT_CONFIG) else {
        return;
    };
    let setup = connect(&env.proxy, None).await;
    exec(&setup, "CREATE SCHEMA evil").await;
    exec(
        &setup,
        "CREATE FUNCTION evil.set_config(text, text, boolean) RETURNS text \
         LANGUAGE sql AS $$ SELECT 'neutralized'::text $$",
    )
    .await;
    exec(
        &setup,
        "CREATE FUNCTION evil.current_setting(text) RETURNS text \
         LANGUAGE sql AS $$ SELECT '1h'::text $$",
    )
    .await;
    // The trap works: unqualified calls under this search_path reach the schema's functions.
    exec(&setup, "SET search_path = evil, pg_catalog").await;
    assert_eq!(
        scalar(
            &setup,
            "SELECT set_config('statement_timeout', '1ms', true)"
        )
        .await,
        "neutralized"
    );
    drop(setup);

    let mut cfg = env.proxy.app_config();
    cfg.application_name("reporting")
        .options("-c search_path=evil,pg_catalog");
    let from_startup = env.proxy.client_with(&cfg).await.0;
    assert_eq!(
        scalar(&from_startup, "SHOW search_path")
            .await
            .replace(' ', ""),
        "evil,pg_catalog"
    );
    let t = timed(&from_startup, "SELECT pg_sleep(2)").await;
    assert_statement_timeout(&t, "search_path from the startup packet");

    let from_set = connect(&env.proxy, Some("reporting")).await;
    exec(&from_set, "SET search_path = evil, pg_catalog").await;
    let t = timed(&from_set, "SELECT pg_sleep(2)").await;
    assert_statement_timeout(&t, "search_path from a tracked SET");
    let t = timed_typed_sleep(&from_set).await;
    assert_statement_timeout(&t, "search_path from a tracked SET, extended protocol");
}

/// statement_timeout 800 ms (read) cancels `pg_sleep(2)` with 57014 through the simple
/// protocol, the extended protocol (unnamed and prepared) and inside BEGIN … COMMIT, while a
/// write of the same caller gets its own 5 s budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statement_timeout_cancels_simple_extended_and_in_transaction() {
    let Some(env) = start(4, TIMEOUT_CONFIG) else {
        return;
    };
    let client = connect(&env.proxy, Some("reporting")).await;

    let t = timed(&client, "SELECT pg_sleep(2)").await;
    assert_statement_timeout(&t, "simple protocol");

    let t = timed_typed_sleep(&client).await;
    assert_statement_timeout(&t, "extended protocol (unnamed statement)");

    let statement = within(STEP, "prepare", client.prepare("SELECT pg_sleep(2)"))
        .await
        .expect("prepare");
    let start = Instant::now();
    let r = within(
        STEP,
        "execute prepared pg_sleep",
        client.query(&statement, &[]),
    )
    .await;
    assert_statement_timeout(
        &Timed {
            elapsed: start.elapsed(),
            result: r.map(|_| Vec::new()),
        },
        "extended protocol (prepared statement)",
    );

    // Inside an explicit transaction: the timeout is injected before the statement.
    exec(&client, "BEGIN").await;
    assert_eq!(scalar(&client, "SELECT 1").await, "1");
    let t = timed(&client, "SELECT pg_sleep(2)").await;
    assert_statement_timeout(&t, "inside BEGIN");
    let t = timed(&client, "SELECT 1").await;
    assert_eq!(
        sqlstate(t.err("after the timeout in a transaction")),
        "25P02"
    );
    exec(&client, "COMMIT").await;

    // Extended protocol inside a transaction.
    exec(&client, "BEGIN").await;
    let t = timed_typed_sleep(&client).await;
    assert_statement_timeout(&t, "extended protocol inside BEGIN");
    exec(&client, "ROLLBACK").await;

    // A write has the caller's write budget (5 s), so a 1.2 s write completes.
    exec(&client, "CREATE TABLE sink (v int)").await;
    let t = timed(&client, "INSERT INTO sink SELECT 1 FROM pg_sleep(1.2)").await;
    assert!(
        t.is_ok(),
        "a write within its 5 s budget: {:?}",
        t.result.err()
    );
    assert!(t.elapsed >= Duration::from_millis(1150));
    assert_eq!(scalar(&client, "SELECT count(*) FROM sink").await, "1");
    env.proxy.assert_healthy().await;
}

/// The proxy's backstop belongs to the statements it was armed for. A budgeted `SELECT 1`
/// arms it for 3 s + 1 s; the transaction then idles, and a `DO` block (kind `other`, which
/// arms nothing) runs across that deadline, well within the 3 s statement_timeout the
/// transaction-scoped injection gave it: it must not be cancelled by the stale backstop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backstop_ends_with_its_statement() {
    const CONFIG: &str = r#"
callers:
  - name: reporting
    match: { application_name: reporting }
    statement_timeout_ms: 3000
"#;
    let Some(env) = start(4, CONFIG) else {
        return;
    };
    let client = connect(&env.proxy, Some("reporting")).await;
    exec(&client, "BEGIN").await;
    assert_eq!(scalar(&client, "SELECT 1").await, "1");
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let t = timed(&client, "DO $$ BEGIN PERFORM pg_sleep(1); END $$").await;
    assert!(
        t.is_ok(),
        "a statement was cancelled by an earlier one's backstop: {:?}",
        t.result.err()
    );
    exec(&client, "COMMIT").await;
    env.proxy.assert_healthy().await;
}

/// `SHOW` is never given a budget (it must report the session's own settings), so it shows
/// what the client's `SET`s left in place.
async fn own_settings(client: &Client) -> String {
    format!(
        "st={} lt={}",
        scalar(client, "SHOW statement_timeout").await,
        scalar(client, "SHOW lock_timeout").await
    )
}

/// lock_timeout 200 ms gives 55P03 on a row lock held by another client; the client's own
/// `SET lock_timeout` / `SET statement_timeout` survive the injected `SET LOCAL`s, while every
/// statement (a `DO` block too) keeps the caller's limits where they are stricter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_timeout_and_the_clients_own_settings() {
    let Some(env) = start(4, TIMEOUT_CONFIG) else {
        return;
    };
    let client = connect(&env.proxy, Some("reporting")).await;
    exec(
        &client,
        "CREATE TABLE locked (id int PRIMARY KEY, v int); INSERT INTO locked VALUES (1, 0)",
    )
    .await;
    let reference = own_settings(&direct_client(&env.cluster).await).await;
    assert_eq!(
        own_settings(&client).await,
        reference,
        "no settings of our own yet"
    );

    let holder = direct_client(&env.cluster).await;
    exec(
        &holder,
        "BEGIN; SELECT * FROM locked WHERE id = 1 FOR UPDATE",
    )
    .await;

    for sql in [
        "UPDATE locked SET v = v + 1 WHERE id = 1",
        "SELECT * FROM locked WHERE id = 1 FOR UPDATE",
    ] {
        let t = timed(&client, sql).await;
        let e = t.err(sql);
        assert_eq!(sqlstate(e), "55P03", "{sql}: {e:?}");
        assert!(
            t.elapsed >= Duration::from_millis(180) && t.elapsed < Duration::from_millis(750),
            "{sql}: lock_timeout after {:?}, expected about 200 ms",
            t.elapsed
        );
    }
    assert_eq!(
        own_settings(&client).await,
        reference,
        "the next statement runs with the session's settings, not the injected ones"
    );

    exec(&client, "SET statement_timeout = '5s'").await;
    exec(&client, "SET lock_timeout = '400ms'").await;
    assert_eq!(own_settings(&client).await, "st=5s lt=400ms");
    let t = timed(&client, "UPDATE locked SET v = v + 1 WHERE id = 1").await;
    assert_eq!(
        sqlstate(t.err("UPDATE under the caller's lock budget")),
        "55P03"
    );
    assert!(
        t.elapsed < Duration::from_millis(350),
        "the caller's 200 ms lock budget applied: {:?}",
        t.elapsed
    );
    let t = timed(&client, "SELECT pg_sleep(2)").await;
    assert_statement_timeout(
        &t,
        "read after the client's own SET statement_timeout = '5s'",
    );
    assert_eq!(
        own_settings(&client).await,
        "st=5s lt=400ms",
        "the client's SETs survived"
    );

    // A DO block has no statement budget here (kind `other`), but the lock budget holds for
    // every kind: 200 ms, not the client's own 400 ms.
    let t = timed(
        &client,
        "DO $$ BEGIN PERFORM 1 FROM locked WHERE id = 1 FOR UPDATE; END $$",
    )
    .await;
    assert_eq!(
        sqlstate(t.err("DO under the caller's lock budget")),
        "55P03"
    );
    assert!(
        t.elapsed >= Duration::from_millis(180) && t.elapsed < Duration::from_millis(350),
        "the caller's lock_timeout = 200ms applied: {:?}",
        t.elapsed
    );
    assert_eq!(
        own_settings(&client).await,
        "st=5s lt=400ms",
        "the client's SETs survived the DO block's budget"
    );

    exec(&holder, "ROLLBACK").await;
    let t = timed(&client, "UPDATE locked SET v = v + 1 WHERE id = 1").await;
    assert!(t.is_ok(), "no lock held any more: {:?}", t.result.err());
    assert_eq!(scalar(&client, "SELECT v FROM locked").await, "1");
}

/// `SHOW` reports the session's settings as direct Postgres would: the client's own values
/// (or the server defaults), never the caller budget injected for the statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_reports_the_clients_own_settings() {
    let Some(env) = start(4, TIMEOUT_CONFIG) else {
        return;
    };
    let client = connect(&env.proxy, Some("reporting")).await;
    let direct = direct_client(&env.cluster).await;
    let t = timed(&client, "SELECT pg_sleep(2)").await;
    assert_statement_timeout(&t, "budgeted read");
    for name in ["statement_timeout", "lock_timeout"] {
        let sql = format!("SHOW {name}");
        assert_eq!(
            scalar(&client, &sql).await,
            scalar(&direct, &sql).await,
            "{sql} after a timeout shows the session's value, not the injected budget"
        );
    }
    exec(&client, "SET statement_timeout = '5s'").await;
    assert_eq!(scalar(&client, "SELECT 1").await, "1");
    assert_eq!(scalar(&client, "SHOW statement_timeout").await, "5s");
}

/// A client's own, stricter `SET statement_timeout` must not be loosened by the caller's
/// budget injected with `SET LOCAL` (the budget is a ceiling, not a replacement).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stricter_client_statement_timeout_is_kept() {
    let Some(env) = start(4, TIMEOUT_CONFIG) else {
        return;
    };
    let client = connect(&env.proxy, Some("reporting")).await;
    exec(&client, "SET statement_timeout = '150ms'").await;
    let t = timed(&client, "SELECT pg_sleep(0.6)").await;
    match &t.result {
        Ok(_) => panic!(
            "the client's statement_timeout = 150ms was replaced by the caller's 800 ms: \
             pg_sleep(0.6) completed after {:?} (direct Postgres cancels it at 150 ms)",
            t.elapsed
        ),
        Err(e) => assert_eq!(sqlstate(e), "57014"),
    }
    assert!(t.elapsed < Duration::from_millis(500), "{:?}", t.elapsed);
}

/// The injected `SET LOCAL` prefix is invisible: error positions match direct Postgres (also
/// with multibyte text and multi-statement queries) and replies have the same shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injection_keeps_error_positions_and_replies_identical() {
    let Some(env) = start(4, TIMEOUT_CONFIG) else {
        return;
    };
    let proxied = connect(&env.proxy, Some("reporting")).await;
    let direct = direct_client(&env.cluster).await;
    exec(&direct, "CREATE TABLE sink (v int)").await;

    for sql in [
        "SELECT nonexistent_column",
        "SELECT 'äöü€', nonexistent_column",
        "SELECT 1; SELECT nonexistent_column",
        "\n  SELECT\n    1 + nonexistent_column",
        "INSERT INTO sink VALUES (nonexistent_column)",
    ] {
        let want = timed(&direct, sql).await;
        let got = timed(&proxied, sql).await;
        let (want, got) = (want.err(sql), got.err(sql));
        assert_eq!(sqlstate(got), sqlstate(want), "{sql}");
        assert_eq!(position(got), position(want), "error position of {sql:?}");
        assert!(position(got).is_some(), "{sql:?} has a position");
    }

    // Extended protocol and inside a transaction.
    let sql = "SELECT 'ü', nonexistent_column";
    let want = within(STEP, sql, direct.query_typed(sql, &[]))
        .await
        .expect_err(sql);
    let got = within(STEP, sql, proxied.query_typed(sql, &[]))
        .await
        .expect_err(sql);
    assert_eq!(position(&got), position(&want), "extended: {sql}");
    exec(&proxied, "BEGIN").await;
    exec(&direct, "BEGIN").await;
    assert_eq!(scalar(&proxied, "SELECT 1").await, "1");
    let want = timed(&direct, "SELECT nonexistent_column").await;
    let got = timed(&proxied, "SELECT nonexistent_column").await;
    assert_eq!(
        position(got.err("in txn")),
        position(want.err("in txn")),
        "inside BEGIN"
    );
    exec(&proxied, "ROLLBACK").await;
    exec(&direct, "ROLLBACK").await;

    // Same replies, none of the injected SET's.
    fn shape(msgs: &[SimpleQueryMessage]) -> Vec<String> {
        msgs.iter()
            .map(|m| match m {
                SimpleQueryMessage::Row(r) => format!("row {:?}", r.get(0)),
                SimpleQueryMessage::CommandComplete(n) => format!("complete {n}"),
                SimpleQueryMessage::RowDescription(d) => format!("desc {}", d.len()),
                _ => "other".into(),
            })
            .collect()
    }
    for sql in [
        "SELECT 1",
        "SELECT 1; SELECT 2, 3",
        "INSERT INTO sink VALUES (1), (2)",
        "UPDATE sink SET v = v + 1; SELECT count(*) FROM sink",
    ] {
        let want = within(STEP, sql, direct.simple_query(sql))
            .await
            .expect(sql);
        let got = within(STEP, sql, proxied.simple_query(sql))
            .await
            .expect(sql);
        assert_eq!(shape(&got), shape(&want), "replies to {sql:?}");
    }
}
