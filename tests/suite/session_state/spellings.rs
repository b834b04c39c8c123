//! Isolation by construction (issue 56): the spellings that talked a token scan around — a
//! quoted, qualified call taken for a CTE name, a setting name built with `||` or from
//! adjacent literals, a catalog view that writes settings, functions reached through a view,
//! attribute notation, a column default or a trigger, a leftover unnamed statement — and a
//! two-tenant row-level-security pool where tenant B must never see a row of tenant A.
//!
//! The functions are created by the superuser and only granted to `app`: a client needs no
//! CREATE privilege for any of this. Pools of one backend make "the next client gets the same
//! backend" certain.

use rand::{RngExt, SeedableRng};

use crate::support::isolation::{CLEAN, fresh_state, start, user_code, wire};
use crate::support::pg::{APP_DB, APP_USER, Cluster};
use crate::support::sql::scalar;
use crate::support::wire::{Backend, STEP};
use crate::support::{note_skipped, within};

/// The objects of [`user_code`].
fn setup(c: &Cluster) {
    user_code(c);
}

/// A cluster with [`user_code`] and a proxy of one backend configured by `yaml`; `None` (and
/// a note) when the suite runs straight at Postgres, where no backend is shared.
fn one_backend(yaml: &str) -> Option<crate::support::env::Env> {
    let env = start(1, yaml, setup);
    if env.proxy.is_direct() {
        note_skipped("backend sharing (direct mode has none)");
        return None;
    }
    Some(env)
}

/// Each of these leaves (or, without the proxy's check, would leave) `app.tenant_id = 'a'`
/// and more on the backend, without a visible `SET` or a literal setting name.
const ATTACKS: &[&str] = &[
    // A quoted, schema-qualified call with an alias, a column-definition list, in a CTE.
    r#"SELECT * FROM "public"."dirty"('a') AS t"#,
    r#"SELECT * FROM "public"."rec"('a') AS t(x text)"#,
    r#"WITH x AS (SELECT 1) SELECT "public"."dirty"('a') AS x"#,
    // Setting names built, not written.
    "SELECT set_config('app.' || 'tenant_id', 'a', false)",
    "SELECT set_config('app.'\n'tenant_id', 'a', false)",
    // A catalog view that writes settings.
    "UPDATE pg_settings SET setting = 'evil' WHERE name = 'search_path'",
    "UPDATE pg_settings SET setting = 'on' WHERE name = 'default_transaction_read_only'",
    "UPDATE pg_settings SET setting = '1' WHERE name = 'statement_timeout'",
    // Functions reached without a call in the text.
    "SELECT * FROM v_tenant",
    "SELECT t.dirt FROM things t",
    "INSERT INTO withdefault (id) VALUES (1)",
    "INSERT INTO trig VALUES (1)",
];

/// A new client that has run `sql` by the simple protocol (an error fails the test, `what`
/// naming the step).
async fn ran(
    proxy: &crate::support::proxy::Proxy,
    sql: &str,
    what: &str,
) -> tokio_postgres::Client {
    let a = proxy.client().await;
    within(STEP, sql, a.batch_execute(sql))
        .await
        .unwrap_or_else(|e| panic!("{what}{sql}: {e:?}"));
    a
}

/// What a client sees of tenant rows and of its session: clean, and no row of tenant `a`.
async fn assert_clean(proxy: &crate::support::proxy::Proxy, after: &str) {
    assert_eq!(
        fresh_state(proxy).await,
        CLEAN,
        "the client after `{after}` saw its state"
    );
    let b = proxy.client().await;
    assert_eq!(
        scalar(&b, "SELECT count(*) FROM accounts").await,
        "0",
        "the client after `{after}` read tenant rows it never chose"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spellings_a_token_scan_missed_leave_nothing_for_the_next_client() {
    let Some(env) = one_backend("pool: { session_state: track }\n") else {
        return;
    };
    let proxy = &env.proxy;
    for sql in ATTACKS {
        // The simple protocol, and the extended one (tokio-postgres prepares a statement).
        drop(ran(proxy, sql, "").await);
        assert_clean(proxy, sql).await;
        let a = proxy.client().await;
        within(STEP, sql, a.query(*sql, &[]))
            .await
            .unwrap_or_else(|e| panic!("{sql} (extended): {e:?}"));
        // A stays connected while B borrows the one backend.
        assert_clean(proxy, sql).await;
        drop(a);
    }
    // Under standard_conforming_strings = off no text is read as proven: a user function
    // called then is checked for too.
    let a = proxy.client().await;
    a.batch_execute("SET standard_conforming_strings = off")
        .await
        .expect("scs off");
    a.batch_execute(r#"SELECT "public"."dirty"('a') AS t"#)
        .await
        .expect("dirty under scs off");
    assert_clean(proxy, "a call under standard_conforming_strings = off").await;
    drop(a);

    let stats = proxy.app_pool().await;
    let checks = stats["session_checks"].as_u64().expect("session_checks");
    let found = stats["session_check_differences"]
        .as_u64()
        .expect("session_check_differences");
    // Each run through `public.dirty` (seven attacks) leaves a LISTEN and an advisory lock
    // that the check finds, at least in the extended runs, whose client stays connected (a
    // client that leaves before its settings are read back gets DISCARD ALL instead, unchecked).
    let through_dirty = ATTACKS
        .iter()
        .filter(|s| !s.contains("set_config") && !s.contains("pg_settings"))
        .count() as u64;
    assert_eq!(through_dirty, 7);
    assert!(
        checks >= through_dirty && found >= through_dirty,
        "checks {checks}, differences {found}: {stats}"
    );
    proxy.assert_healthy().await;
}

/// A client that seeds `random()` cannot make the next client's values predictable: after
/// `setseed` (or `SET seed`) the next client's first `random()` is not the seeded one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chosen_random_seed_does_not_reach_the_next_client() {
    let env = start(1, "pool: { session_state: track }\n", |_| {});
    let proxy = &env.proxy;
    if proxy.is_direct() {
        note_skipped("backend sharing (direct mode has none)");
        return;
    }
    let (direct, conn) = tokio_postgres::connect(
        &env.cluster
            .connect_str(APP_USER, crate::support::pg::APP_PASSWORD, APP_DB),
        tokio_postgres::NoTls,
    )
    .await
    .expect("direct");
    tokio::spawn(conn);
    direct
        .batch_execute("SELECT setseed(0.5)")
        .await
        .expect("seed");
    let seeded = scalar(&direct, "SELECT random()::text").await;
    for seed in [
        "SELECT setseed(0.5)",
        "SET seed = 0.5",
        "SET SESSION seed TO 0.5",
    ] {
        let a = proxy.client().await;
        a.batch_execute(seed).await.expect(seed);
        drop(a);
        let b = proxy.client().await;
        let got = scalar(&b, "SELECT random()::text").await;
        assert_ne!(
            got, seeded,
            "after `{seed}` the next client's random() was predictable"
        );
    }
}

/// `pool.unproven: reset` resets without asking; the next client is as clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_strict_mode_resets_what_it_cannot_prove() {
    let Some(env) = one_backend("pool: { session_state: track, unproven: reset }\n") else {
        return;
    };
    let proxy = &env.proxy;
    for sql in ATTACKS {
        let _a = ran(proxy, sql, "").await;
        assert_clean(proxy, sql).await;
    }
    let stats = proxy.app_pool().await;
    assert_eq!(stats["session_checks"], 0, "{stats}");
    proxy.assert_healthy().await;
}

/// A leaves an unnamed statement on the backend; B's Bind of the unnamed statement without a
/// Parse of its own gets Postgres's 26000, not A's SQL with B's parameters. A client whose own
/// unnamed statement was parsed on an earlier backend has it parsed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unnamed_statement_never_outlives_its_client() {
    let Some(env) = one_backend("pool: { session_state: track }\n") else {
        return;
    };
    let proxy = &env.proxy;
    let mut a = wire(proxy).await;
    a.parse(
        "",
        "SELECT secret FROM public.accounts WHERE tenant = $1 OR $1 = 'x'",
    )
    .sync();
    a.send().await.expect("A: parse");
    a.until_ready().await.expect("A: ready");
    drop(a);

    let mut b = wire(proxy).await;
    b.bind("", "", &[Some("x")]).execute("", 0).sync();
    b.send().await.expect("B: bind");
    let replies = b.until_ready().await.expect("B: ready");
    assert!(
        replies.iter().any(|m| m.error_code() == Some("26000")),
        "B ran A's statement: {replies:?}"
    );
    assert!(
        !replies.iter().any(|m| matches!(m, Backend::DataRow(_))),
        "{replies:?}"
    );

    // B's own unnamed statement, parsed in one Sync block and bound in another while a third
    // client used the backend in between: B's SQL runs, parsed again for it.
    b.parse("", "SELECT $1::text || '-b'").sync();
    b.send().await.expect("B: parse");
    b.until_ready().await.expect("B: parse ready");
    let c = proxy.client().await;
    scalar(&c, "SELECT 1").await;
    let mut other = wire(proxy).await;
    other.parse("", "SELECT 'other'").sync();
    other.send().await.expect("other: parse");
    other.until_ready().await.expect("other: ready");
    b.bind("", "", &[Some("x")]).execute("", 0).sync();
    b.send().await.expect("B: bind again");
    let replies = b.until_ready().await.expect("B: ready again");
    assert!(
        replies.contains(&Backend::DataRow(vec![Some("x-b".into())])),
        "{replies:?}"
    );
    drop(other);
    proxy.assert_healthy().await;
}

/// Two tenants on a pool of one backend: tenant A's sessions set `app.tenant_id` in every way
/// (tracked `SET`, `set_config`, user functions, views, triggers, `SET LOCAL`), tenant B's set
/// nothing or their own tenant inside a transaction. B never reads a row of A.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_on_one_backend_never_see_each_others_rows() {
    let Some(env) = one_backend("pool: { session_state: track }\n") else {
        return;
    };
    let proxy = &env.proxy;
    let a_ways: Vec<String> = ATTACKS
        .iter()
        .filter(|s| !s.contains("pg_settings"))
        .map(|s| s.to_string())
        .chain([
            "SET app.tenant_id = 'a'".to_string(),
            "SELECT set_config('app.tenant_id', 'a', false)".to_string(),
            "BEGIN; SET LOCAL app.tenant_id = 'a'; SELECT count(*) FROM accounts; COMMIT"
                .to_string(),
            "SELECT public.dirty('a')".to_string(),
        ])
        .collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(56);
    let sessions = 2000;
    let mut a_clients = Vec::new();
    for i in 0..sessions {
        if rng.random_bool(0.5) {
            // Tenant A: a new client, or one that stays (idle, its backend given back).
            let sql = &a_ways[rng.random_range(0..a_ways.len())];
            let a = ran(proxy, sql, &format!("session {i}: ")).await;
            if rng.random_bool(0.3) {
                a_clients.push(a);
            }
            if a_clients.len() > 8 {
                a_clients.remove(0);
            }
        } else {
            let b = proxy.client().await;
            let seen = if rng.random_bool(0.5) {
                scalar(
                    &b,
                    "SELECT coalesce(string_agg(secret, ','), '') FROM accounts",
                )
                .await
            } else {
                let rows = within(
                    STEP,
                    "B in a transaction",
                    b.simple_query(
                        "BEGIN; SET LOCAL app.tenant_id = 'b'; \
                         SELECT coalesce(string_agg(secret, ','), '') FROM accounts; COMMIT",
                    ),
                )
                .await
                .expect("B: transaction");
                rows.iter()
                    .find_map(|m| match m {
                        tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                        _ => None,
                    })
                    .unwrap_or_default()
            };
            assert!(
                !seen.contains("a-secret"),
                "session {i}: tenant B read tenant A's row ({seen})"
            );
        }
    }
    drop(a_clients);
    proxy.assert_healthy().await;
}

/// A client pinned to its backend (a session advisory lock) holds that backend between its
/// transactions, so it counts against its caller's `max_concurrency` then too: two lock
/// holders fill a caller of two, a third client of that caller is refused until one leaves.
/// (`LISTEN` no longer pins in transaction mode: the pool's listener connection holds it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_clients_count_against_their_callers_concurrency() {
    let yaml = "pool: { session_state: track }\n\
                global_defaults: { max_concurrency: 2, queue_depth: 0, queue_timeout_ms: 0 }\n";
    let env = start(4, yaml, |_| {});
    let proxy = &env.proxy;
    if proxy.is_direct() {
        note_skipped("caller limits (direct mode has none)");
        return;
    }
    let a = proxy.client().await;
    a.batch_execute("SELECT pg_advisory_lock(1)")
        .await
        .expect("A: lock");
    let b = proxy.client().await;
    b.batch_execute("SELECT pg_advisory_lock(2)")
        .await
        .expect("B: lock");
    // Idle lock holders, each on its own backend: the caller is full.
    let c = proxy.client().await;
    let e = c
        .batch_execute("SELECT 1")
        .await
        .expect_err("a third client of a caller of two, beside two pinned clients");
    assert_eq!(crate::support::sql::sqlstate(&e), "53300", "{e:?}");
    assert!(
        format!("{e:?}").contains("ERR_CALLER_LIMIT_EXCEEDED"),
        "{e:?}"
    );
    // A pinned client's own next statement is admitted (its permit is its own).
    assert_eq!(scalar(&a, "SELECT 2").await, "2");
    drop(a);
    crate::support::sql::eventually(STEP, "a place once a pinned client left", || async {
        c.batch_execute("SELECT 1").await.is_ok()
    })
    .await;
    drop(b);
    proxy.assert_healthy().await;
}

/// What the check reads is only what a fresh session would not have: an unproven statement (a
/// user function that changes nothing) of a client with startup settings of its own (put back
/// with the check) is checked and found clean, again and again — no difference counted,
/// nothing reset beyond the check. A write to a table without user code is proven and not
/// checked at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_unproven_unit_is_checked_and_found_clean() {
    let env = start(1, "pool: { session_state: track }\n", |c| {
        c.psql_on(
            APP_DB,
            &format!(
                "CREATE TABLE public.plain (id int); GRANT INSERT ON public.plain TO {APP_USER}; \
                 CREATE FUNCTION public.noop() RETURNS int LANGUAGE sql AS 'SELECT 1'; \
                 GRANT EXECUTE ON FUNCTION public.noop() TO {APP_USER};"
            ),
        );
    });
    let proxy = &env.proxy;
    if proxy.is_direct() {
        note_skipped("session checks (direct mode has none)");
        return;
    }
    // Two settings (client_encoding, work_mem), then four: the statement that puts them
    // back answers one row of as many columns, which the check must not read as its own.
    let mut config = proxy.app_config();
    config.options("-c work_mem=8MB");
    let (two, _task) = proxy.client_with(&config).await;
    config.application_name("writer");
    config.options("-c work_mem=8MB -c search_path=public");
    let (four, _task) = proxy.client_with(&config).await;
    for _ in 0..5 {
        for w in [&two, &four] {
            assert_eq!(scalar(w, "SELECT public.noop()").await, "1");
            assert_eq!(scalar(w, "SHOW work_mem").await, "8MB");
        }
        assert_eq!(scalar(&four, "SHOW application_name").await, "writer");
    }
    let stats = proxy.app_pool().await;
    let checks = stats["session_checks"].as_u64().expect("session_checks");
    assert!(checks >= 10, "every call checked: {stats}");
    assert_eq!(stats["session_check_differences"], 0, "{stats}");
    // Plain writes: proven once the pool has read its catalog (the first may come before).
    for i in 0..5 {
        two.batch_execute(&format!("INSERT INTO plain VALUES ({i})"))
            .await
            .expect("insert");
    }
    let after = proxy.app_pool().await["session_checks"]
        .as_u64()
        .expect("session_checks");
    assert!(
        after <= checks + 1,
        "plain writes checked: {checks} -> {after}"
    );
    assert_eq!(fresh_state(proxy).await, CLEAN);
}
