//! End-to-end tests of transaction pooling without surprises (issue 3): named prepared
//! statements work across pooled backends, and no client ever observes another client's
//! session state (`SET`, `SET ROLE`, `LISTEN`, advisory locks).
//!
//! Small pools and many clients make backend sharing the normal case. Each test starts its own
//! cluster and proxy (tests/support). With `PGSLUICE_TEST_DIRECT=1` the isolation assertions
//! hold trivially (no sharing); the one place where Postgres itself behaves differently from
//! the specified proxy behaviour (a cached plan after DDL) asserts Postgres' behaviour instead
//! and says so.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::future;
use tokio_postgres::AsyncMessage;
use tokio_postgres::error::SqlState;

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster, OTHER_ROLE};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::sql::{BackendSampler, STEP, assert_pool_bound, eventually, scalar, sqlstate};
use crate::support::wire::{Backend, WireClient, first_column};
use crate::support::{note_skipped, pgbench, within};

/// `search_path` and `current_user` of a fresh `app` session.
const DEFAULT_STATE: &str = "\"$user\", public|app";
/// One query that reveals the session state the isolation tests care about.
const STATE_SQL: &str = "SELECT current_setting('search_path') || '|' || current_user";

/// Joins spawned tasks, panicking with the first failure.
async fn join_all_ok<T>(
    what: &str,
    limit: Duration,
    tasks: Vec<tokio::task::JoinHandle<T>>,
) -> Vec<T> {
    within(limit, what, future::join_all(tasks))
        .await
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbench_prepared_32_clients_over_a_pool_of_4() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(4));
    pgbench::init(&proxy, 1).await;

    let sampler = BackendSampler::start(&cluster).await;
    let prepared = pgbench::run_ok(
        &proxy,
        &[
            "-S", "-M", "prepared", "-c", "32", "-j", "2", "-T", "5", "-n",
        ],
    )
    .await;
    // -C: a new connection per transaction, so every transaction re-prepares on some backend.
    let reconnecting = pgbench::run_ok(
        &proxy,
        &[
            "-S", "-M", "prepared", "-C", "-c", "32", "-j", "2", "-T", "4", "-n",
        ],
    )
    .await;
    let (max, samples) = sampler.finish().await;
    eprintln!(
        "pgbench -S -M prepared -c 32: {:.0} tps; with -C: {:.0} tps",
        prepared.tps, reconnecting.tps
    );
    assert_pool_bound(&proxy, max, samples);
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statement_reused_across_100_transactions_with_a_pool_of_2() {
    let cluster = Cluster::start();
    let proxy = Arc::new(Proxy::start(&cluster, ProxyOptions::pool(2)));
    let sampler = BackendSampler::start(&cluster).await;

    let clients: Vec<_> = (0..8i32)
        .map(|c| {
            let proxy = Arc::clone(&proxy);
            tokio::spawn(async move {
                let mut client = proxy.client().await;
                let statement = within(
                    STEP,
                    "prepare",
                    client.prepare("SELECT $1::int + $2::int, pg_backend_pid()"),
                )
                .await
                .unwrap_or_else(|e| panic!("client {c}: prepare: {e:?}"));
                let mut backends = HashSet::new();
                for i in 0..100i32 {
                    let row = if i % 2 == 0 {
                        let tx = within(STEP, "BEGIN", client.transaction())
                            .await
                            .expect("BEGIN");
                        let row =
                            within(STEP, "execute in tx", tx.query_one(&statement, &[&c, &i]))
                                .await
                                .unwrap_or_else(|e| panic!("client {c} transaction {i}: {e:?}"));
                        within(STEP, "COMMIT", tx.commit()).await.expect("COMMIT");
                        row
                    } else {
                        within(STEP, "execute", client.query_one(&statement, &[&c, &i]))
                            .await
                            .unwrap_or_else(|e| {
                                panic!("client {c} execution {i} (implicit transaction): {e:?}")
                            })
                    };
                    assert_eq!(
                        row.get::<_, i32>(0),
                        c + i,
                        "client {c} execution {i} got a wrong answer"
                    );
                    backends.insert(row.get::<_, i32>(1));
                }
                backends.len()
            })
        })
        .collect();
    let backends_per_client = join_all_ok(
        "8 clients x 100 executions",
        Duration::from_secs(120),
        clients,
    )
    .await;
    eprintln!("distinct backends each client's statement ran on: {backends_per_client:?}");

    // Deterministically move a client's prepared statement to the other backend: hold the
    // backend it last ran on inside another client's transaction, so the only free backend is
    // one where this client never executed it before.
    let mover = proxy.client().await;
    let statement = within(
        STEP,
        "prepare",
        mover.prepare("SELECT $1::int * 3, pg_backend_pid()"),
    )
    .await
    .expect("prepare");
    let run = |i: i32| {
        let (mover, statement) = (&mover, &statement);
        async move {
            let row = within(STEP, "execute", mover.query_one(statement, &[&i]))
                .await
                .unwrap_or_else(|e| {
                    panic!("execution {i} of a statement prepared on another backend: {e:?}")
                });
            assert_eq!(row.get::<_, i32>(0), i * 3, "execution {i}");
            row.get::<_, i32>(1)
        }
    };
    let mut last = run(0).await;
    for i in 1..=6 {
        let holder = hold_backend(&proxy, last).await;
        let now = run(i).await;
        within(STEP, "COMMIT", holder.batch_execute("COMMIT"))
            .await
            .expect("COMMIT");
        if proxy.is_direct() {
            if i == 1 {
                note_skipped("a client's statement runs on another pooled backend");
            }
        } else {
            assert_ne!(
                now, last,
                "execution {i} must have moved to the other backend"
            );
        }
        last = now;
    }
    drop(mover);

    let (max, samples) = sampler.finish().await;
    assert_pool_bound(&proxy, max, samples);
    proxy.assert_healthy().await;
}

/// Returns a client whose open transaction holds backend `pid` of a 2-backend pool, so the
/// next checkout by anyone else gets the other backend. Two clients each open a transaction
/// (taking both backends); the one not on `pid` commits. In direct mode there is no pool and
/// the first client is returned as is.
async fn hold_backend(proxy: &Proxy, pid: i32) -> tokio_postgres::Client {
    let open = || async {
        let client = proxy.client().await;
        within(STEP, "BEGIN", client.batch_execute("BEGIN"))
            .await
            .expect("BEGIN");
        let pid = scalar(&client, "SELECT pg_backend_pid()").await;
        (client, pid.parse::<i32>().expect("a pid"))
    };
    let (first, first_pid) = open().await;
    if proxy.is_direct() {
        return first;
    }
    let (second, second_pid) = open().await;
    let (keep, release) = match (first_pid == pid, second_pid == pid) {
        (true, _) => (first, second),
        (_, true) => (second, first),
        _ => panic!(
            "with a pool of 2, two open transactions ({first_pid}, {second_pid}) must include backend {pid}"
        ),
    };
    within(STEP, "COMMIT", release.batch_execute("COMMIT"))
        .await
        .expect("COMMIT");
    keep
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_use_the_same_statement_name_for_different_sql() {
    let cluster = Cluster::start();
    // One backend: both clients' "s1" would land on the same server session.
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(1));
    let connect = || WireClient::connect(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB);
    let mut a = within(STEP, "client A", connect()).await.expect("client A");
    let mut b = within(STEP, "client B", connect()).await.expect("client B");

    async fn run(c: &mut WireClient, msgs: impl FnOnce(&mut WireClient)) -> Vec<Backend> {
        msgs(c);
        within(STEP, "send", c.send()).await.expect("send");
        within(STEP, "replies", c.until_ready())
            .await
            .expect("replies")
    }
    fn no_error(who: &str, replies: &[Backend]) {
        if let Some(Backend::Error { code, message }) =
            replies.iter().find(|m| m.error_code().is_some())
        {
            panic!("{who}: {code}: {message} (replies {replies:?})");
        }
    }

    let r = run(&mut a, |c| {
        c.parse("s1", "SELECT 'a:' || $1::text").sync();
    })
    .await;
    no_error("A Parse s1", &r);
    let r = run(&mut b, |c| {
        c.parse("s1", "SELECT $1::int * 10").sync();
    })
    .await;
    no_error("B Parse s1 (same name, different SQL)", &r);

    for i in 0..25 {
        let arg = i.to_string();
        let r = run(&mut a, |c| {
            c.bind("", "s1", &[Some(&arg)]).execute("", 0).sync();
        })
        .await;
        no_error("A execute s1", &r);
        assert_eq!(
            first_column(&r),
            vec![Some(format!("a:{i}"))],
            "A must run its own s1"
        );
        let r = run(&mut b, |c| {
            c.bind("", "s1", &[Some(&arg)]).execute("", 0).sync();
        })
        .await;
        no_error("B execute s1", &r);
        assert_eq!(
            first_column(&r),
            vec![Some((i * 10).to_string())],
            "B must run its own s1"
        );
    }

    // Describe of a statement the current backend may not have prepared yet.
    let r = run(&mut a, |c| {
        c.describe_statement("s1").sync();
    })
    .await;
    no_error("A Describe s1", &r);
    assert!(
        r.iter()
            .any(|m| matches!(m, Backend::ParameterDescription(p) if p.len() == 1)),
        "{r:?}"
    );

    // B closes its s1 and runs SQL-level DEALLOCATE ALL: A's s1 is untouched.
    let r = run(&mut b, |c| {
        c.close_statement("s1").sync();
    })
    .await;
    no_error("B Close s1", &r);
    within(STEP, "B DEALLOCATE ALL", b.simple("DEALLOCATE ALL"))
        .await
        .expect("DEALLOCATE ALL");
    let r = run(&mut a, |c| {
        c.bind("", "s1", &[Some("after")]).execute("", 0).sync();
    })
    .await;
    no_error("A execute s1 after B's Close/DEALLOCATE ALL", &r);
    assert_eq!(first_column(&r), vec![Some("a:after".to_string())]);

    // B's s1 is gone for B only; B may now reuse the name for yet other SQL.
    let r = run(&mut b, |c| {
        c.bind("", "s1", &[Some("1")]).execute("", 0).sync();
    })
    .await;
    assert_eq!(
        r.iter().find_map(Backend::error_code),
        Some("26000"),
        "B closed s1, so executing it must fail with 26000: {r:?}"
    );
    let r = run(&mut b, |c| {
        c.parse("s1", "SELECT 'b:' || $1::text")
            .bind("", "s1", &[Some("new")])
            .execute("", 0)
            .sync();
    })
    .await;
    no_error("B re-Parse s1", &r);
    assert_eq!(first_column(&r), vec![Some("b:new".to_string())]);
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ddl_between_executions_of_a_prepared_select_star() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let client = proxy.client().await;
    let admin = proxy.client().await;
    within(
        STEP,
        "create table",
        admin.batch_execute("CREATE TABLE evolving (id int, name text); INSERT INTO evolving VALUES (1, 'one'), (2, 'two')"),
    )
    .await
    .expect("create table");

    let statement = within(
        STEP,
        "prepare SELECT *",
        client.prepare("SELECT * FROM evolving ORDER BY id"),
    )
    .await
    .expect("prepare");
    let rows = within(STEP, "first execution", client.query(&statement, &[]))
        .await
        .expect("first execution");
    assert_eq!(rows.len(), 2);

    within(
        STEP,
        "ALTER TABLE",
        admin.batch_execute("ALTER TABLE evolving ADD COLUMN extra int DEFAULT 5"),
    )
    .await
    .expect("alter table");

    // tokio-postgres executes with the description it got at prepare time: the proxy must
    // not hand it rows of another shape, so it sees the 0A000 exactly as from Postgres.
    let result = within(STEP, "execution after DDL", client.query(&statement, &[])).await;
    let err =
        result.expect_err("rows of a new shape must not reach a client that did not re-describe");
    assert_eq!(
        sqlstate(&err),
        SqlState::FEATURE_NOT_SUPPORTED.code(),
        "{err:?}"
    );

    let fresh = within(
        STEP,
        "re-prepare",
        client.prepare("SELECT * FROM evolving ORDER BY id"),
    )
    .await
    .expect("prepare");
    assert_eq!(
        fresh.columns().len(),
        3,
        "a statement prepared after the DDL sees the new column"
    );
    let rows = within(STEP, "fresh statement", client.query(&fresh, &[]))
        .await
        .expect("fresh statement");
    assert_eq!(rows[1].get::<_, i32>(2), 5);
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ddl_between_executions_is_retried_when_the_batch_describes() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(1));
    let admin = proxy.client().await;
    within(
        STEP,
        "create table",
        admin.batch_execute("CREATE TABLE shifting (id int); INSERT INTO shifting VALUES (1)"),
    )
    .await
    .expect("create table");
    let mut c = within(
        STEP,
        "wire client",
        WireClient::connect(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB),
    )
    .await
    .expect("connect");
    c.parse("s_star", "SELECT * FROM shifting").sync();
    within(STEP, "send", c.send()).await.expect("send");
    within(STEP, "parse", c.until_ready()).await.expect("parse");
    let run = |c: &mut WireClient| {
        c.bind("", "s_star", &[])
            .describe_portal("")
            .execute("", 0)
            .sync();
    };
    run(&mut c);
    within(STEP, "send", c.send()).await.expect("send");
    let first = within(STEP, "first run", c.until_ready())
        .await
        .expect("first");
    assert!(
        first.contains(&Backend::DataRow(vec![Some("1".into())])),
        "{first:?}"
    );

    within(
        STEP,
        "ALTER TABLE",
        admin.batch_execute("ALTER TABLE shifting ADD COLUMN extra int DEFAULT 5"),
    )
    .await
    .expect("alter");
    run(&mut c);
    within(STEP, "send", c.send()).await.expect("send");
    let second = within(STEP, "second run", c.until_ready())
        .await
        .expect("second");
    if proxy.is_direct() {
        note_skipped("the proxy re-prepares and replays a batch that re-describes");
        assert!(
            second.iter().any(|m| m.error_code() == Some("0A000")),
            "{second:?}"
        );
    } else {
        assert!(
            second.iter().all(|m| m.error_code().is_none()),
            "the 0A000 must be hidden and the batch replayed: {second:?}"
        );
        assert!(
            second.contains(&Backend::RowDescription(vec!["id".into(), "extra".into()])),
            "{second:?}"
        );
        assert!(
            second.contains(&Backend::DataRow(vec![Some("1".into()), Some("5".into())])),
            "{second:?}"
        );
    }
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_search_path_and_set_role_never_reach_other_clients() {
    let cluster = Cluster::start();
    let proxy = Arc::new(Proxy::start(&cluster, ProxyOptions::pool(3)));
    let sampler = BackendSampler::start(&cluster).await;

    let a = proxy.client().await;
    assert_eq!(scalar(&a, STATE_SQL).await, DEFAULT_STATE);
    within(
        STEP,
        "A: SET search_path",
        a.batch_execute("SET search_path TO evil"),
    )
    .await
    .expect("SET search_path");
    within(
        STEP,
        "A: SET ROLE",
        a.batch_execute(&format!("SET ROLE {OTHER_ROLE}")),
    )
    .await
    .expect("SET ROLE");
    let a_state = format!("evil|{OTHER_ROLE}");

    let a_gone = Arc::new(AtomicBool::new(false));
    let observers: Vec<_> = (0..50)
        .map(|i| {
            let (proxy, a_gone) = (Arc::clone(&proxy), Arc::clone(&a_gone));
            tokio::spawn(async move {
                let client = proxy.client().await;
                let mut after = 0;
                // Observe while A is connected, then for 5 more rounds after A left.
                for round in 0.. {
                    let gone = a_gone.load(Ordering::Relaxed);
                    let state = scalar(&client, STATE_SQL).await;
                    assert_eq!(
                        state,
                        DEFAULT_STATE,
                        "observer {i} round {round} (A {}) saw another client's session state",
                        if gone { "gone" } else { "connected" }
                    );
                    if gone {
                        after += 1;
                        if after == 5 {
                            break;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        })
        .collect();

    for round in 0..40 {
        assert_eq!(
            scalar(&a, STATE_SQL).await,
            a_state,
            "A lost its own session state in round {round}"
        );
        if round % 4 == 0 {
            // Inside a multi-round-trip transaction too.
            within(STEP, "A: BEGIN", a.simple_query("BEGIN"))
                .await
                .expect("BEGIN");
            assert_eq!(
                scalar(&a, STATE_SQL).await,
                a_state,
                "A inside a transaction in round {round}"
            );
            within(STEP, "A: COMMIT", a.simple_query("COMMIT"))
                .await
                .expect("COMMIT");
        }
    }
    drop(a);
    a_gone.store(true, Ordering::Relaxed);
    join_all_ok("50 observers", Duration::from_secs(120), observers).await;

    let (max, samples) = sampler.finish().await;
    assert_pool_bound(&proxy, max, samples);
    // A fresh client after everything: still the defaults.
    let fresh = proxy.client().await;
    assert_eq!(scalar(&fresh, STATE_SQL).await, DEFAULT_STATE);
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_follows_transaction_semantics() {
    let cluster = Cluster::start();
    let proxy = Arc::new(Proxy::start(&cluster, ProxyOptions::pool(2)));
    let stop = Arc::new(AtomicBool::new(false));
    // Noise keeps both backends busy so A moves between them.
    let noise: Vec<_> = (0..6)
        .map(|i| {
            let (proxy, stop) = (Arc::clone(&proxy), Arc::clone(&stop));
            tokio::spawn(async move {
                let client = proxy.client().await;
                while !stop.load(Ordering::Relaxed) {
                    assert_eq!(
                        scalar(&client, STATE_SQL).await,
                        DEFAULT_STATE,
                        "noise client {i} saw A's state"
                    );
                }
            })
        })
        .collect();

    let a = proxy.client().await;
    let show = |expected: &'static str, why: &'static str| {
        let a = &a;
        async move {
            for round in 0..10 {
                assert_eq!(
                    scalar(a, "SHOW search_path").await,
                    expected,
                    "{why} (round {round})"
                );
            }
        }
    };
    within(STEP, "SET", a.batch_execute("SET search_path TO a1"))
        .await
        .expect("SET");
    show("a1", "a session SET persists").await;

    within(
        STEP,
        "rolled-back SET",
        a.batch_execute("BEGIN; SET search_path TO x; ROLLBACK"),
    )
    .await
    .expect("rollback");
    show(
        "a1",
        "a SET inside a rolled-back transaction must not persist",
    )
    .await;

    within(
        STEP,
        "SET LOCAL",
        a.batch_execute("BEGIN; SET LOCAL search_path TO local_only; COMMIT"),
    )
    .await
    .expect("local");
    show("a1", "SET LOCAL ends with its transaction").await;

    within(
        STEP,
        "committed SET",
        a.batch_execute("BEGIN; SET search_path TO y; COMMIT"),
    )
    .await
    .expect("commit");
    show("y", "a SET inside a committed transaction persists").await;

    // A failed transaction rolls its SETs back too.
    let err = within(
        STEP,
        "failed tx",
        a.batch_execute("BEGIN; SET search_path TO z; SELECT 1/0"),
    )
    .await
    .expect_err("1/0");
    assert_eq!(sqlstate(&err), SqlState::DIVISION_BY_ZERO.code());
    within(STEP, "ROLLBACK", a.batch_execute("ROLLBACK"))
        .await
        .expect("rollback");
    show(
        "y",
        "a SET inside a failed, rolled-back transaction must not persist",
    )
    .await;

    within(
        STEP,
        "set_config",
        a.simple_query("SELECT set_config('search_path', 'via_set_config', false)"),
    )
    .await
    .expect("set_config");
    show(
        "via_set_config",
        "set_config(..., false) is a session-level SET",
    )
    .await;

    within(STEP, "RESET", a.batch_execute("RESET search_path"))
        .await
        .expect("RESET");
    show("\"$user\", public", "RESET restores the default").await;

    stop.store(true, Ordering::Relaxed);
    join_all_ok("noise clients", Duration::from_secs(60), noise).await;
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_is_private_to_its_client_and_cleaned_up_after_it_leaves() {
    let cluster = Cluster::start();
    let proxy = Arc::new(Proxy::start(&cluster, ProxyOptions::pool(3)));

    let (listener, mut inbox, listener_task) =
        proxy.client_with_messages(&proxy.app_config()).await;
    within(
        STEP,
        "LISTEN",
        listener.batch_execute("LISTEN pgsluice_chan"),
    )
    .await
    .expect("LISTEN");

    // Bystanders run traffic on the shared backends and record any notification they get.
    let stop = Arc::new(AtomicBool::new(false));
    let bystanders: Vec<_> = (0..10)
        .map(|i| {
            let (proxy, stop) = (Arc::clone(&proxy), Arc::clone(&stop));
            tokio::spawn(async move {
                let (client, mut inbox, _task) =
                    proxy.client_with_messages(&proxy.app_config()).await;
                let mut received = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    scalar(&client, "SELECT 1").await;
                    while let Ok(m) = inbox.try_recv() {
                        if let AsyncMessage::Notification(n) = m {
                            received.push(format!(
                                "bystander {i} got {}: {}",
                                n.channel(),
                                n.payload()
                            ));
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                received
            })
        })
        .collect();

    let notifier = proxy.client().await;
    for n in 0..3 {
        within(
            STEP,
            "NOTIFY",
            notifier.batch_execute(&format!("NOTIFY pgsluice_chan, 'hello {n}'")),
        )
        .await
        .expect("NOTIFY");
        let payload = within(
            Duration::from_secs(5),
            "the listener's notification",
            async {
                loop {
                    match inbox.recv().await {
                        Some(AsyncMessage::Notification(n)) => break n.payload().to_string(),
                        Some(_) => {}
                        None => panic!("the listener's connection ended"),
                    }
                }
            },
        )
        .await;
        assert_eq!(payload, format!("hello {n}"));
        // Interleave listener traffic: it must stay subscribed across its own transactions.
        assert_eq!(
            scalar(&listener, "SELECT count(*) FROM pg_listening_channels()").await,
            "1"
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The listener leaves; afterwards nobody is subscribed on any pooled backend.
    drop(listener);
    let _ = within(STEP, "the listener's connection to close", listener_task).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    within(
        STEP,
        "NOTIFY after the listener left",
        notifier.batch_execute("NOTIFY pgsluice_chan, 'orphan'"),
    )
    .await
    .expect("NOTIFY");
    let checkers: Vec<_> = (0..20)
        .map(|i| {
            let proxy = Arc::clone(&proxy);
            tokio::spawn(async move {
                let client = proxy.client().await;
                for round in 0..5 {
                    let channels =
                        scalar(&client, "SELECT count(*) FROM pg_listening_channels()").await;
                    assert_eq!(
                        channels, "0",
                        "checker {i} round {round}: a pooled backend still LISTENs"
                    );
                }
            })
        })
        .collect();
    join_all_ok(
        "20 pg_listening_channels checkers",
        Duration::from_secs(60),
        checkers,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::Relaxed);
    let received: Vec<String> = join_all_ok("bystanders", Duration::from_secs(60), bystanders)
        .await
        .concat();
    assert!(
        received.is_empty(),
        "notifications reached clients that never LISTENed: {received:?}"
    );
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_advisory_lock_is_released_when_its_client_leaves() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let holder = proxy.client().await;
    assert_eq!(
        scalar(&holder, "SELECT pg_try_advisory_lock(4242)").await,
        "t"
    );
    let other = proxy.client().await;
    for _ in 0..5 {
        assert_eq!(
            scalar(&other, "SELECT pg_try_advisory_lock(4242)").await,
            "f",
            "the lock belongs to the holder while it is connected"
        );
        // The holder still owns it across its own later transactions.
        assert_eq!(
            scalar(&holder, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 4242 AND pid = pg_backend_pid()")
                .await,
            "1",
            "the holder must keep its backend (and lock) while connected"
        );
    }
    drop(holder);
    eventually(
        Duration::from_secs(5),
        "the advisory lock to be released after its client left",
        || async { scalar(&other, "SELECT pg_try_advisory_lock(4242)").await == "t" },
    )
    .await;
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_resets_state_before_the_next_client() {
    let cluster = Cluster::start();
    // One backend in session mode: the next client gets exactly the backend A dirtied.
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(1).session());
    {
        let a = proxy.client().await;
        within(
            STEP,
            "A dirties its session",
            a.batch_execute(&format!(
                "SET search_path TO evil; SET ROLE {OTHER_ROLE}; LISTEN leftover; \
                 SELECT pg_advisory_lock(77); PREPARE leftover_stmt AS SELECT 1"
            )),
        )
        .await
        .expect("dirty the session");
        assert_eq!(scalar(&a, STATE_SQL).await, format!("evil|{OTHER_ROLE}"));
    }
    let b = within(STEP, "B connects after A left", proxy.client()).await;
    assert_eq!(
        scalar(&b, STATE_SQL).await,
        DEFAULT_STATE,
        "B inherited A's SET/SET ROLE"
    );
    assert_eq!(
        scalar(&b, "SELECT count(*) FROM pg_listening_channels()").await,
        "0",
        "B inherited A's LISTEN"
    );
    // A backend that was discarded rather than reset releases the lock when it exits, which
    // is asynchronous; give that a moment.
    eventually(
        Duration::from_secs(5),
        "A's advisory lock to be released after A left",
        || async { scalar(&b, "SELECT pg_try_advisory_lock(77)").await == "t" },
    )
    .await;
    assert_eq!(
        scalar(
            &b,
            "SELECT count(*) FROM pg_prepared_statements WHERE name = 'leftover_stmt'"
        )
        .await,
        "0",
        "B sees A's SQL-level PREPARE"
    );
    // Session mode with one backend: B must leave before the health check can connect.
    drop(b);
    proxy.assert_healthy().await;
}
