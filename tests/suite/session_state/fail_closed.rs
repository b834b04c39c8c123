//! Issue 15 ("fail closed"), items 1–3: session state that must never reach the next client.
//! Pools of one backend make "the next client gets the same backend" certain, not likely.
//!
//! * Item 1: a disconnect before the proxy has read the settings back.
//! * Item 2: statements the classifier cannot prove harmless (quoted names, user functions,
//!   `DO`, FunctionCall, long texts) reset the backend.
//! * Item 3: hostile values under `standard_conforming_strings = off` cannot escape the
//!   proxy's literals.

use std::time::Duration;

use crate::support::isolation::{CLEAN, STATE_SQL, fresh_state, start, wire};
use crate::support::pg::{APP_DB, APP_USER, OTHER_ROLE};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::sql::scalar;
use crate::support::wire::{STEP, function_call};
use crate::support::{note_skipped, within};

/// Item 1: a client that changes its session and hangs up before the proxy has read the
/// settings back (its reply not even read) must not hand that session to the next client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_changed_just_before_a_disconnect_do_not_leak() {
    let cluster = crate::support::pg::Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(1));
    if proxy.is_direct() {
        note_skipped("backend sharing (direct mode has none)");
        return;
    }
    let sets = [
        format!("SET ROLE {OTHER_ROLE}"),
        "SET search_path = evil".to_string(),
        "SET app.tenant_id = 42".to_string(),
        format!("SET ROLE {OTHER_ROLE}; SET search_path = evil; SET app.tenant_id = 42"),
        "SELECT set_config('search_path', 'evil', false)".to_string(),
    ];
    for round in 0..4 {
        for sql in &sets {
            let mut a = wire(&proxy).await;
            // The change is made (and committed: a request of its own), then the client hangs
            // up while the request after it still runs: the proxy reads settings back only
            // once nothing is in flight, so it never gets to.
            a.query(sql).query("SELECT pg_sleep(0.2)");
            a.send().await.expect("send");
            tokio::time::sleep(Duration::from_millis(50 * (round + 1))).await;
            if round % 2 == 1 {
                a.terminate();
                let _ = a.send().await;
            }
            drop(a);
            assert_eq!(
                fresh_state(&proxy).await,
                CLEAN,
                "round {round}: the client after `{sql}` + hang-up saw its state"
            );
        }
    }
    proxy.assert_healthy().await;
}

/// Item 2: statements whose session effects the text does not show (or shows in a form a
/// lexical scan can miss) still leave the next client a clean session, and in track mode
/// the client that ran them keeps its own settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_the_classifier_cannot_prove_harmless_reset_the_backend() {
    let env = start(1, "pool: { session_state: track }\n", |c| {
        c.psql_on(
            APP_DB,
            &format!(
                "CREATE FUNCTION public.tenant(t text) RETURNS text LANGUAGE plpgsql AS $$ \
                 BEGIN PERFORM set_config('app.tenant_id', t, false); \
                 PERFORM set_config('search_path', 'evil', false); \
                 PERFORM pg_advisory_lock(4242); EXECUTE 'LISTEN leak'; RETURN t; END $$; \
                 CREATE PROCEDURE public.proc() LANGUAGE plpgsql AS $$ \
                 BEGIN PERFORM set_config('app.tenant_id', '7', false); END $$; \
                 GRANT EXECUTE ON FUNCTION public.tenant(text) TO {APP_USER}; \
                 GRANT EXECUTE ON PROCEDURE public.proc() TO {APP_USER};"
            ),
        );
    });
    let proxy = &env.proxy;
    if proxy.is_direct() {
        note_skipped("backend sharing (direct mode has none)");
        return;
    }
    let long_pad = "x".repeat(2 << 20);
    let cases: Vec<(String, &str)> = vec![
        // Custom settings are placeholders, which pg_settings does not list: read by name.
        ("SET app.tenant_id = 42".into(), "a custom setting"),
        (
            "SELECT set_config('app.tenant_id', '42', false)".into(),
            "a custom setting by set_config",
        ),
        (
            "SELECT \"set_config\"('search_path', 'evil', false)".into(),
            "a quoted set_config",
        ),
        (
            "SELECT set_config('search_path', 'evil', true AND false)".into(),
            "set_config with an expression for is_local",
        ),
        ("SELECT tenant('42')".into(), "a user function"),
        (
            "SELECT public.tenant('42')".into(),
            "a qualified user function",
        ),
        (
            "DO $$BEGIN PERFORM set_config('app.tenant_id', '42', false); END$$".into(),
            "a DO block",
        ),
        ("CALL proc()".into(), "a procedure"),
        (
            format!("SELECT 1 /* {long_pad} */; SELECT set_config('search_path', 'evil', false)"),
            "a text longer than the classifier reads",
        ),
    ];
    for (sql, what) in &cases {
        let a = proxy.client().await;
        within(STEP, what, a.batch_execute(sql))
            .await
            .unwrap_or_else(|e| panic!("{what}: {e:?}"));
        // While A stays connected, B borrows the one backend.
        assert_eq!(
            fresh_state(proxy).await,
            CLEAN,
            "the client after {what} saw its state"
        );
        if sql.starts_with("SET app.") || sql.starts_with("SELECT set_config('app.") {
            assert_eq!(
                scalar(&a, "SELECT current_setting('app.tenant_id')").await,
                "42",
                "{what}: the client lost its own setting"
            );
        }
        if sql.contains("search_path', 'evil', false") && !sql.contains("true AND") {
            // Track mode keeps the client's own settings (read back before the reset).
            assert_eq!(
                scalar(&a, "SELECT current_setting('search_path')").await,
                "evil",
                "{what}: the client lost its own setting"
            );
        }
    }

    // A FunctionCall message: set_config by OID, with no SQL text at all.
    let oid = scalar(
        &proxy.client().await,
        "SELECT 'pg_catalog.set_config(text,text,boolean)'::regprocedure::oid",
    )
    .await;
    let oid: u32 = oid.parse().expect("oid");
    let mut a = wire(proxy).await;
    a.message(b'F', &function_call(oid, &["search_path", "evil", "false"]));
    a.send().await.expect("send F");
    let replies = a.until_ready().await.expect("F reply");
    assert!(
        replies.iter().all(|m| m.error_code().is_none()),
        "{replies:?}"
    );
    assert_eq!(
        fresh_state(proxy).await,
        CLEAN,
        "the client after a FunctionCall saw its state"
    );
    proxy.assert_healthy().await;
}

/// Item 3: values a client controls are re-applied by the proxy on every backend it borrows;
/// with `standard_conforming_strings = off` a backslash in `'...'` escapes the quote, so a
/// proxy that builds `'...'` literals can be made to run the rest of a value as SQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_values_cannot_escape_the_proxys_literals() {
    let cluster = crate::support::pg::Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(1));
    if proxy.is_direct() {
        note_skipped("settings re-applied by a pooler (direct mode has none)");
        return;
    }
    // Two clients with conforming strings off take turns on the one backend, so the proxy
    // re-applies the second one's application_name while the backend has them off.
    let a = proxy.client().await;
    a.batch_execute("SET standard_conforming_strings = off")
        .await
        .expect("A: scs off");
    // The value closes a '...' literal under conforming strings off and appends a statement.
    let evil = r"x\', false); CREATE TABLE pwned (a int); --";
    let b = proxy.client().await;
    b.batch_execute(&format!(
        "SET application_name = '{}'",
        evil.replace('\'', "''")
    ))
    .await
    .expect("B: hostile application_name");
    b.batch_execute("SET standard_conforming_strings = off")
        .await
        .expect("B: scs off");
    for round in 0..6 {
        assert_eq!(
            scalar(&a, "SELECT current_setting('standard_conforming_strings')").await,
            "off",
            "round {round}: A"
        );
        assert_eq!(
            scalar(&b, "SELECT current_setting('application_name')").await,
            evil,
            "round {round}: B's value must arrive verbatim"
        );
    }
    let su = cluster.superuser_client(APP_DB).await;
    assert_eq!(
        scalar(
            &su,
            "SELECT coalesce(to_regclass('public.pwned')::text, 'none')"
        )
        .await,
        "none",
        "a value re-applied by the proxy ran as SQL"
    );
    drop((a, b));
    assert_eq!(fresh_state(&proxy).await, CLEAN);
    // The same value through the probe the proxy uses to read settings back.
    assert_eq!(
        scalar(&proxy.client().await, STATE_SQL).await,
        CLEAN,
        "after both left"
    );
    proxy.assert_healthy().await;
}

/// A role the client set is re-applied on every backend it borrows; when the client later
/// pins that backend and changes a setting there, the reset (`RESET ALL`, which leaves
/// `role` alone) must not leave the role to the next client. Found by the random sessions
/// (`SET SESSION ROLE`, then an advisory lock and a `set_config`, then a hang-up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_re_applied_on_a_borrowed_backend_does_not_outlive_the_client() {
    let env = start(1, "", |_| {});
    let proxy = &env.proxy;
    if proxy.is_direct() {
        note_skipped("backend sharing (direct mode has none)");
        return;
    }
    let cases = [
        // Tracked: read back; the next client's settings diff undoes the role.
        "SET statement_timeout = '1s'",
        // Pinned by the lock, which dirties the settings: `RESET ALL` when the client leaves.
        "SELECT pg_advisory_lock(11); SET lock_timeout = '5s'",
        "SET lock_timeout = '5s'; SELECT pg_advisory_lock(11)",
    ];
    for later in cases {
        for spelling in ["SET ROLE", "SET SESSION ROLE"] {
            let a = proxy.client().await;
            a.batch_execute(&format!("{spelling} {OTHER_ROLE}"))
                .await
                .expect("set role");
            assert_eq!(
                scalar(&a, "SELECT current_user").await,
                OTHER_ROLE,
                "`{spelling}`: the client lost its own role"
            );
            // The last thing the client does on the backend before it goes back.
            a.batch_execute(later).await.expect("later statement");
            drop(a);
            let state = within(
                Duration::from_secs(10),
                "the next client",
                fresh_state(proxy),
            )
            .await;
            assert_eq!(
                state, CLEAN,
                "`{spelling}` then `{later}`: the next client saw the role"
            );
        }
    }
    proxy.assert_healthy().await;
}

/// The proxy puts a client's own settings on each backend it borrows, in the same write as
/// the client's statement. When the server refuses one of them (here a superuser setting
/// whose `GRANT SET` was revoked after the client's login), the previous client's settings
/// must still be gone: the client gets the defaults and a warning, never its predecessor's
/// session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_client_setting_still_clears_the_previous_clients() {
    let env = start(1, "", |c| {
        c.psql(&format!(
            "GRANT SET ON PARAMETER log_statement TO {APP_USER};"
        ));
    });
    let proxy = &env.proxy;
    if proxy.is_direct() {
        note_skipped("backend sharing (direct mode has none)");
        return;
    }
    let mut with_setting = proxy.app_config();
    with_setting.options("-c log_statement=all");
    let (b, mut notices, _task) = proxy.client_with_messages(&with_setting).await;
    assert_eq!(
        scalar(&b, "SELECT current_setting('log_statement')").await,
        "all"
    );
    // A leaves its search_path on the one backend (tracked: read back, not reset).
    let a = proxy.client().await;
    a.batch_execute("SET search_path = evil")
        .await
        .expect("set");
    assert_eq!(
        scalar(&a, "SELECT current_setting('search_path')").await,
        "evil"
    );
    env.cluster.psql(&format!(
        "REVOKE SET ON PARAMETER log_statement FROM {APP_USER};"
    ));
    assert_eq!(
        scalar(
            &b,
            "SELECT current_setting('search_path') || '|' || current_setting('log_statement')"
        )
        .await,
        "\"$user\", public|none",
        "B ran on A's settings after its own setting was refused"
    );
    let warned = within(Duration::from_secs(5), "the warning", async {
        while let Some(m) = notices.recv().await {
            if let tokio_postgres::AsyncMessage::Notice(n) = m
                && n.message().contains("could not re-apply session settings")
            {
                return true;
            }
        }
        false
    })
    .await;
    assert!(warned, "B was not told its settings were not applied");
    // A keeps its own settings; the backend B used was closed, not pooled.
    assert_eq!(
        scalar(&a, "SELECT current_setting('search_path')").await,
        "evil"
    );
    proxy.assert_healthy().await;
}

/// A role the client runs as (here from its startup options) that the server no longer
/// lets the login user take: the client's statement must not run as the login user
/// instead. It is refused and the session ends, as a new login with that role would be;
/// the next client gets a clean backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_role_ends_the_session_instead_of_running_as_the_login_user() {
    let env = start(1, "", |c| {
        c.psql(&format!("CREATE ROLE guest; GRANT guest TO {APP_USER};"));
    });
    let proxy = &env.proxy;
    if proxy.is_direct() {
        note_skipped("backend sharing (direct mode has none)");
        return;
    }
    let mut with_role = proxy.app_config();
    with_role.options("-c role=guest");
    let b = proxy.client_with(&with_role).await.0;
    assert_eq!(scalar(&b, "SELECT current_user").await, "guest");
    // A takes the backend in between, so B's next statement needs its role applied again.
    let a = proxy.client().await;
    a.batch_execute("SET search_path = evil")
        .await
        .expect("set");
    env.cluster.psql(&format!("REVOKE guest FROM {APP_USER};"));
    let err = b
        .query_one("SELECT current_user::text", &[])
        .await
        .expect_err("B's statement ran without its role");
    let db = err.as_db_error().expect("a server error");
    assert_eq!(db.code().code(), "42501", "{db:?}");
    assert!(
        db.message()
            .contains("could not apply your session settings"),
        "{db:?}"
    );
    assert!(b.is_closed() || b.simple_query("SELECT 1").await.is_err());
    assert_eq!(fresh_state(proxy).await, CLEAN);
    assert_eq!(
        scalar(&a, "SELECT current_setting('search_path')").await,
        "evil"
    );
    proxy.assert_healthy().await;
}
