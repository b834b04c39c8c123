//! Issue 15, item 7: DDL, DO, CALL, multi-statement strings ending in a utility statement and
//! FunctionCalls all run with the caller's statement and lock budgets; statements that cannot
//! run in a transaction block still work, and afterwards the client's own settings are what it
//! set.

use std::time::{Duration, Instant};

use crate::support::isolation::start;
use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER};
use crate::support::sql::{scalar, sqlstate};
use crate::support::wire::{Backend, STEP, WireClient, function_call};
use crate::support::{note_skipped, within};

/// Item 7: DDL, DO, CALL, multi-statement strings ending in a utility statement and
/// FunctionCalls all run with the caller's statement and lock budgets; statements that
/// cannot run in a transaction block still work, and afterwards the client's own settings
/// are what it set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_statement_kind_runs_with_its_budget() {
    let yaml = "global_defaults:\n  statement_timeout_ms: 600\n  lock_timeout_ms: 300\n";
    let env = start(2, yaml, |c| {
        c.psql_on(
            APP_DB,
            &format!(
                "CREATE TABLE t (a int); ALTER TABLE t OWNER TO {APP_USER}; \
                 CREATE PROCEDURE public.sleeper() LANGUAGE sql AS $$ SELECT pg_sleep(5) $$; \
                 GRANT EXECUTE ON PROCEDURE public.sleeper() TO {APP_USER};"
            ),
        );
    });
    let proxy = &env.proxy;
    if proxy.is_direct() {
        note_skipped("injected budgets (direct mode has none)");
        return;
    }
    let c = proxy.client().await;
    let timed_out = |what: &str, r: Result<(), tokio_postgres::Error>, t: Instant, code: &str| {
        let e = r.expect_err(what);
        assert_eq!(sqlstate(&e), code, "{what}: {e:?}");
        assert!(
            t.elapsed() < Duration::from_secs(4),
            "{what}: took {:?}",
            t.elapsed()
        );
    };
    for (sql, what) in [
        ("DO $$BEGIN PERFORM pg_sleep(5); END$$", "a DO block"),
        ("CALL sleeper()", "a procedure"),
        ("SELECT pg_sleep(5); NOTIFY x", "a string ending in NOTIFY"),
        (
            "LOCK TABLE t; SELECT pg_sleep(5)",
            "a string starting with LOCK",
        ),
    ] {
        let t = Instant::now();
        let r = within(STEP, what, c.batch_execute(sql)).await;
        timed_out(what, r, t, "57014");
    }

    // DDL behind a lock: lock_timeout, not a pile-up.
    let su = env.cluster.superuser_client(APP_DB).await;
    su.batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .expect("hold the lock");
    for (sql, what) in [
        ("ALTER TABLE t ADD COLUMN b int", "ALTER TABLE"),
        (
            "CREATE INDEX CONCURRENTLY t_a ON t (a)",
            "CREATE INDEX CONCURRENTLY",
        ),
        ("VACUUM t", "VACUUM"),
    ] {
        let t = Instant::now();
        let r = within(STEP, what, c.batch_execute(sql)).await;
        timed_out(what, r, t, "55P03");
    }
    su.batch_execute("COMMIT").await.expect("release the lock");
    let _ = c.batch_execute("DROP INDEX IF EXISTS t_a").await;

    // Statements that need a transaction of their own still run, in both protocols, and
    // leave the client's settings as they were.
    c.batch_execute("SET lock_timeout = '250ms'")
        .await
        .expect("the client's own lock_timeout");
    for sql in [
        "VACUUM t",
        "CREATE INDEX CONCURRENTLY t_a ON t (a)",
        "DROP INDEX CONCURRENTLY t_a",
    ] {
        within(STEP, sql, c.batch_execute(sql))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
    }
    within(STEP, "extended VACUUM", c.execute("VACUUM t", &[]))
        .await
        .expect("VACUUM over the extended protocol");
    assert_eq!(scalar(&c, "SHOW statement_timeout").await, "0");
    assert_eq!(scalar(&c, "SHOW lock_timeout").await, "250ms");

    // A FunctionCall: pg_sleep by OID.
    let mut w = WireClient::connect(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB)
        .await
        .expect("wire client");
    let oid: u32 = scalar(
        &c,
        "SELECT 'pg_catalog.pg_sleep(double precision)'::regprocedure::oid",
    )
    .await
    .parse()
    .expect("oid");
    let t = Instant::now();
    w.message(b'F', &function_call(oid, &["5"]));
    w.send().await.expect("send F");
    let replies = w.until_ready().await.expect("F reply");
    assert_eq!(
        replies.iter().find_map(Backend::error_code),
        Some("57014"),
        "{replies:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    assert_eq!(
        w.simple("SHOW statement_timeout").await.expect("SHOW"),
        [Some("0".into())]
    );
    proxy.assert_healthy().await;
}

/// Issue 56, item 6: a statement starting with `SHOW` in a multi-statement text, and a COMMIT
/// that materializes a WITH HOLD cursor after the client lifted its own timeout with
/// `SET LOCAL statement_timeout = 0`, both run under the caller's budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_first_and_a_commit_that_materializes_a_cursor_keep_the_budget() {
    let yaml = "global_defaults:\n  statement_timeout_ms: 600\n";
    let env = start(2, yaml, |_| {});
    let proxy = &env.proxy;
    if proxy.is_direct() {
        note_skipped("injected budgets (direct mode has none)");
        return;
    }
    let c = proxy.client().await;
    let t = Instant::now();
    let e = within(
        STEP,
        "SHOW first",
        c.batch_execute("SHOW work_mem; SELECT pg_sleep(6)"),
    )
    .await
    .expect_err("SHOW work_mem; SELECT pg_sleep(6) must time out");
    assert_eq!(sqlstate(&e), "57014", "{e:?}");
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "took {:?}",
        t.elapsed()
    );
    // A lone SHOW still reports the client's own setting, not the injected budget.
    assert_eq!(scalar(&c, "SHOW statement_timeout").await, "0");

    let c = proxy.client().await;
    within(
        STEP,
        "declare",
        c.batch_execute(
            "BEGIN; SET LOCAL statement_timeout = 0; \
             DECLARE held CURSOR WITH HOLD FOR SELECT pg_sleep(6)",
        ),
    )
    .await
    .expect("BEGIN .. DECLARE");
    let t = Instant::now();
    let r = within(STEP, "COMMIT", c.batch_execute("COMMIT")).await;
    let e = r.expect_err("the COMMIT that runs the cursor's query must be cancelled");
    assert_eq!(sqlstate(&e), "57014", "{e:?}");
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "took {:?}",
        t.elapsed()
    );
}
