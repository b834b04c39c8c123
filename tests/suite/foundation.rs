//! End-to-end tests of the foundation (issue 2): a transparent pooling proxy that real
//! drivers — tokio-postgres, `psql`, `pgbench` — use by changing only their connection string.
//!
//! Every test starts its own PostgreSQL cluster and proxy (tests/support), so fault injection
//! in one test (terminating backends, restarting Postgres) cannot disturb another, and the
//! backend counts read from `pg_stat_activity` belong to that test alone.
//!
//! The tests use what transaction pooling promises without statement tracking (issue 3):
//! simple queries, the extended protocol with the unnamed statement (`query_typed`), and named
//! statements only inside explicit transactions (tokio-postgres' `copy_in`/`copy_out` prepare
//! one). Run with `PGSLUICE_TEST_DIRECT=1` to check the tests against PostgreSQL itself; the
//! few assertions only a pooler can satisfy are then skipped with a note.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, TryStreamExt, future};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::{AsyncMessage, NoTls, SimpleQueryMessage};

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::sql::{
    BackendSampler, STEP, assert_pool_bound, eventually, scalar, send_cancel, simple_values,
    sleep_running, sqlstate,
};
use crate::support::wire::{Backend, WireClient};
use crate::support::{note_skipped, pgbench, run_with_timeout_async, within};

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
async fn extended_protocol_with_parameters() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(4));
    let mut client = proxy.client().await;

    let rows = within(
        STEP,
        "query_typed with parameters",
        client.query_typed(
            "SELECT $1::int + 1, $2::text || '!', $3::text IS NULL, $4::float8 * 2",
            &[
                (&41i32, Type::INT4),
                (&"héllo", Type::TEXT),
                (&None::<String>, Type::TEXT),
                (&1.25f64, Type::FLOAT8),
            ],
        ),
    )
    .await
    .expect("query_typed");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].get::<_, i32>(0), 42);
    assert_eq!(rows[0].get::<_, String>(1), "héllo!");
    assert!(rows[0].get::<_, bool>(2));
    assert_eq!(rows[0].get::<_, f64>(3), 2.5);

    let rows = within(
        STEP,
        "a multi-row parameterised query",
        client.query_typed(
            "SELECT g FROM generate_series(1, $1::int) g",
            &[(&100i32, Type::INT4)],
        ),
    )
    .await
    .expect("generate_series");
    assert_eq!(rows.iter().map(|r| r.get::<_, i32>(0)).sum::<i32>(), 5050);

    // Named statements are fine inside an explicit transaction: it holds one backend.
    let tx = within(STEP, "BEGIN", client.transaction())
        .await
        .expect("begin");
    let statement = within(STEP, "prepare", tx.prepare("SELECT $1::int * $2::int"))
        .await
        .expect("prepare");
    for i in 0..20i32 {
        let row = within(
            STEP,
            "execute prepared",
            tx.query_one(&statement, &[&i, &3i32]),
        )
        .await
        .expect("execute");
        assert_eq!(row.get::<_, i32>(0), i * 3);
    }
    within(STEP, "COMMIT", tx.commit()).await.expect("commit");
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_queries_on_one_client() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let client = proxy.client().await;

    // tokio-postgres writes every request as soon as its future is polled, so joining them
    // puts 100 Parse/Bind/Describe/Execute/Sync groups in flight on one connection.
    let queries = (0..100i32).map(|i| {
        let client = &client;
        async move {
            let rows = client
                .query_typed("SELECT $1::int, pg_backend_pid()", &[(&i, Type::INT4)])
                .await
                .unwrap_or_else(|e| panic!("pipelined query {i}: {e:?}"));
            rows[0].get::<_, i32>(0)
        }
    });
    let results = within(STEP, "100 pipelined queries", future::join_all(queries)).await;
    assert_eq!(
        results,
        (0..100).collect::<Vec<_>>(),
        "each pipelined query gets its own answer, in order"
    );

    // Simple queries pipeline too.
    let simple = (0..20).map(|i| {
        let client = &client;
        async move {
            simple_values(
                &client
                    .simple_query(&format!("SELECT {i}"))
                    .await
                    .expect("pipelined simple"),
            )
        }
    });
    let results = within(
        STEP,
        "20 pipelined simple queries",
        future::join_all(simple),
    )
    .await;
    for (i, values) in results.iter().enumerate() {
        assert_eq!(values, &vec![Some(i.to_string())]);
    }
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_in_and_copy_out_round_trip_10k_rows() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(4));
    let mut client = proxy.client().await;
    within(
        STEP,
        "create table",
        client.batch_execute("CREATE TABLE copied (id int PRIMARY KEY, payload text)"),
    )
    .await
    .expect("create table");

    let mut expected = String::new();
    for i in 1..=10_000 {
        expected.push_str(&format!("{i}\trow {i} with some text \\\\ and a tab\\t!\n"));
    }

    let tx = within(STEP, "BEGIN", client.transaction())
        .await
        .expect("begin");
    let sink = within(
        STEP,
        "COPY FROM STDIN",
        tx.copy_in("COPY copied FROM STDIN"),
    )
    .await
    .expect("copy in");
    let mut sink = Box::pin(sink);
    // Several chunks, so the proxy sees many CopyData messages.
    for chunk in expected.as_bytes().chunks(7_000) {
        within(
            STEP,
            "CopyData",
            sink.send(bytes::Bytes::copy_from_slice(chunk)),
        )
        .await
        .expect("send CopyData");
    }
    let copied = within(STEP, "CopyDone", sink.as_mut().finish())
        .await
        .expect("finish COPY");
    assert_eq!(copied, 10_000);
    within(STEP, "COMMIT", tx.commit()).await.expect("commit");

    assert_eq!(
        scalar(&client, "SELECT count(*) FROM copied").await,
        "10000"
    );

    let tx = within(STEP, "BEGIN", client.transaction())
        .await
        .expect("begin");
    let stream = within(
        STEP,
        "COPY TO STDOUT",
        tx.copy_out("COPY (SELECT * FROM copied ORDER BY id) TO STDOUT"),
    )
    .await
    .expect("copy out");
    let chunks: Vec<bytes::Bytes> = within(STEP, "CopyData stream", stream.try_collect())
        .await
        .expect("copy out data");
    within(STEP, "COMMIT", tx.commit()).await.expect("commit");
    let out: Vec<u8> = chunks.concat();
    assert_eq!(
        out.len(),
        expected.len(),
        "COPY OUT returns exactly what COPY IN stored"
    );
    assert!(
        out == expected.as_bytes(),
        "COPY OUT bytes differ from COPY IN bytes"
    );

    // A failed COPY (bad data) leaves the client usable.
    let tx = within(STEP, "BEGIN", client.transaction())
        .await
        .expect("begin");
    let sink = within(
        STEP,
        "COPY FROM STDIN",
        tx.copy_in("COPY copied FROM STDIN"),
    )
    .await
    .expect("copy in");
    let mut sink = Box::pin(sink);
    within(
        STEP,
        "bad CopyData",
        sink.send(bytes::Bytes::from_static(b"not-a-number\tx\n")),
    )
    .await
    .expect("send");
    let err = within(STEP, "CopyDone of bad data", sink.as_mut().finish())
        .await
        .expect_err("bad data fails");
    assert_eq!(sqlstate(&err), SqlState::INVALID_TEXT_REPRESENTATION.code());
    drop(sink);
    within(STEP, "ROLLBACK", tx.rollback())
        .await
        .expect("rollback");
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM copied").await,
        "10000"
    );
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_protocol_replies_equal_direct_postgres() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    cluster.psql_on(
        APP_DB,
        "CREATE TABLE copy_direct (id int, t text); CREATE TABLE copy_proxy (id int, t text);
                             GRANT ALL ON copy_direct, copy_proxy TO app",
    );

    /// Sends what is buffered, then reads up to the next ReadyForQuery or, with
    /// `until_copy_in`, up to the CopyInResponse (or an error).
    async fn step(c: &mut WireClient, until_copy_in: bool) -> Vec<Backend> {
        within(STEP, "send", c.send()).await.expect("send");
        let mut replies = Vec::new();
        loop {
            let m = within(STEP, "a COPY reply", c.recv()).await.expect("recv");
            let done = match m {
                Backend::ReadyForQuery(_) => true,
                Backend::CopyInResponse | Backend::Error { .. } => until_copy_in,
                _ => false,
            };
            replies.push(m);
            if done {
                return replies;
            }
        }
    }

    // The same COPY conversations, once directly and once through the proxy.
    async fn script(addr: std::net::SocketAddr, table: &str) -> Vec<Vec<Backend>> {
        let mut c = within(
            STEP,
            "wire connect",
            WireClient::connect(addr, APP_USER, APP_PASSWORD, APP_DB),
        )
        .await
        .expect("wire connect");
        let copy_in = format!("COPY {table} FROM STDIN");
        let mut out = Vec::new();

        // 0. Exactly what tokio-postgres' copy_in does inside a transaction: a named statement
        //    prepared first, Bind/Execute/Sync sent before the CopyInResponse arrives (Postgres
        //    receives that Sync in copy-in mode and ignores it; only the Sync after CopyDone is
        //    answered), then Close of the statement, then COMMIT.
        let mut replies = Vec::new();
        c.query("BEGIN");
        replies.extend(step(&mut c, false).await);
        c.parse("copy_stmt", &copy_in)
            .describe_statement("copy_stmt")
            .sync();
        replies.extend(step(&mut c, false).await);
        c.bind("", "copy_stmt", &[]).execute("", 0).sync();
        replies.extend(step(&mut c, true).await);
        c.message(b'd', b"1\tone\n")
            .message(b'd', b"2\ttwo\n")
            .message(b'c', &[])
            .sync();
        replies.extend(step(&mut c, false).await);
        c.close_statement("copy_stmt").sync();
        replies.extend(step(&mut c, false).await);
        c.query("COMMIT");
        replies.extend(step(&mut c, false).await);
        out.push(replies);

        // 1. The same with the unnamed statement, outside a transaction.
        c.parse("", &copy_in)
            .bind("", "", &[])
            .execute("", 0)
            .sync();
        let mut replies = step(&mut c, true).await;
        c.message(b'd', b"3\tthree\n").message(b'c', &[]).sync();
        replies.extend(step(&mut c, false).await);
        out.push(replies);
        c.query(&format!("SELECT count(*) FROM {table}"));
        out.push(step(&mut c, false).await);

        // 2. Simple-protocol COPY IN aborted with CopyFail: 57014, and the session goes on.
        c.query(&copy_in);
        let mut replies = step(&mut c, true).await;
        c.message(b'd', b"4\tfour\n")
            .message(b'f', b"client gave up\0");
        replies.extend(step(&mut c, false).await);
        out.push(replies);

        // 3. Simple-protocol COPY OUT.
        c.query(&format!(
            "COPY (SELECT * FROM {table} ORDER BY id) TO STDOUT"
        ));
        out.push(step(&mut c, false).await);
        out
    }
    let direct = script(cluster.addr(), "copy_direct").await;
    assert_eq!(
        direct[1],
        vec![
            Backend::ParseComplete,
            Backend::BindComplete,
            Backend::CopyInResponse,
            Backend::CommandComplete("COPY 1".into()),
            Backend::ReadyForQuery(b'I'),
        ],
        "reference behaviour of Postgres for an early Sync during COPY IN"
    );
    assert_eq!(
        direct[3].iter().find_map(Backend::error_code),
        Some("57014"),
        "CopyFail gives 57014"
    );
    let through = script(proxy.addr(), "copy_proxy").await;
    let labels = [
        "tokio-postgres-style COPY IN in a transaction",
        "extended COPY IN with early Sync",
        "query after COPY IN",
        "COPY IN + CopyFail",
        "COPY OUT",
    ];
    for (i, label) in labels.iter().enumerate() {
        assert_eq!(
            through[i], direct[i],
            "{label}: the proxy's replies differ from Postgres'"
        );
    }
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_running_query() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let client = Arc::new(proxy.client().await);
    let token = client.cancel_token();

    let running = {
        let client = Arc::clone(&client);
        tokio::spawn(async move {
            let result = client.simple_query("SELECT pg_sleep(10)").await;
            (result, Instant::now())
        })
    };
    let monitor = cluster.monitor().await;
    eventually(STEP, "pg_sleep(10) to show up as active", || async {
        !monitor.active_queries_like("pg_sleep(10)").await.is_empty()
    })
    .await;
    let cancelled_at = Instant::now();
    within(STEP, "CancelRequest", token.cancel_query(NoTls))
        .await
        .expect("send cancel");
    let (result, ended_at) = within(
        Duration::from_secs(5),
        "the cancelled query to end",
        running,
    )
    .await
    .expect("task");
    let err = result.expect_err("a cancelled pg_sleep(10) must fail");
    assert_eq!(
        sqlstate(&err),
        SqlState::QUERY_CANCELED.code(),
        "cancel gives 57014: {err:?}"
    );
    let took = ended_at.duration_since(cancelled_at);
    assert!(
        took < Duration::from_secs(2),
        "the query ended {took:?} after the cancel"
    );

    // The client carries on.
    assert_eq!(
        scalar(&client, "SELECT 'after cancel'").await,
        "after cancel"
    );
    proxy.assert_healthy().await;
}

/// Unix-domain sockets on both sides (PgBouncer's `unix_socket_dir`, and a backend URL with
/// `host=DIR`): a client reaches the proxy at DIR/.s.PGSQL.PORT while TCP clients go on, the
/// proxy reaches Postgres through its socket (the server sees no client address), a cancel
/// travels both sockets, the client list says `unix`, and a graceful stop removes the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_sockets_on_both_sides() {
    if crate::support::direct_mode() {
        note_skipped("Unix-domain sockets (proxy options)");
        return;
    }
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("socket dir");
    let mut proxy = Proxy::start(
        &cluster,
        ProxyOptions::pool(2)
            .backend_over_socket()
            .arg("--unix-socket-dir")
            .arg(dir.path().to_str().expect("utf-8 dir")),
    );
    let port = proxy.addr().port();
    let file = dir.path().join(format!(".s.PGSQL.{port}"));
    assert!(file.exists(), "{} missing", file.display());

    let mut config = tokio_postgres::Config::new();
    config
        .host_path(dir.path())
        .port(port)
        .user(APP_USER)
        .password(APP_PASSWORD)
        .dbname(APP_DB);
    let (client, conn) = within(STEP, "login over the socket", config.connect(NoTls))
        .await
        .expect("login over the proxy's Unix socket");
    tokio::spawn(conn);
    let client = Arc::new(client);
    // Extended protocol; the server's end is its Unix socket (no client address).
    let row = client
        .query_one("SELECT inet_client_addr() IS NULL, $1::int + 1", &[&41i32])
        .await
        .expect("query over the sockets");
    assert!(
        row.get::<_, bool>(0),
        "the backend connection is not on the Unix socket"
    );
    assert_eq!(row.get::<_, i32>(1), 42);
    // A TCP client at the same time.
    let tcp = proxy.client().await;
    assert_eq!(scalar(&tcp, "SELECT 'tcp'").await, "tcp");

    let (status, body) = proxy
        .admin_request(
            "GET",
            "/v1/clients",
            crate::support::proxy::ADMIN_READ_TOKEN,
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let clients: serde_json::Value = serde_json::from_str(&body).expect("json");
    let addresses: Vec<&str> = clients["clients"]
        .as_array()
        .expect("clients")
        .iter()
        .filter_map(|c| c["address"].as_str())
        .collect();
    assert!(addresses.contains(&"unix"), "{body}");
    assert!(
        addresses.iter().any(|a| a.starts_with("127.0.0.1:")),
        "{body}"
    );

    // A cancel: client → proxy over its socket, proxy → Postgres over the server's.
    let monitor = cluster.monitor().await;
    let running = sleep_running(&client, &monitor).await;
    let started = Instant::now();
    send_cancel(&client).await;
    let err = within(Duration::from_secs(5), "the cancelled query", running)
        .await
        .expect("task")
        .expect_err("a cancelled pg_sleep(10) must fail");
    assert_eq!(sqlstate(&err), SqlState::QUERY_CANCELED.code(), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(scalar(&client, "SELECT 'after'").await, "after");

    drop((client, tcp));
    proxy.sigterm();
    assert!(
        proxy.wait_exit(Duration::from_secs(20)).is_some(),
        "the proxy did not stop"
    );
    assert!(!file.exists(), "the socket file outlived the proxy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_from_an_idle_client_never_hits_another_client() {
    let cluster = Cluster::start();
    // One backend: whatever backend the idle client last used is the one the busy client runs
    // on, so a cancel key mapped to "the last backend" would hit the wrong query.
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(1));
    let idle = proxy.client().await;
    assert_eq!(scalar(&idle, "SELECT 1").await, "1");
    let busy = Arc::new(proxy.client().await);

    let running = {
        let busy = Arc::clone(&busy);
        tokio::spawn(async move { busy.simple_query("SELECT pg_sleep(1.5), 'finished'").await })
    };
    let monitor = cluster.monitor().await;
    eventually(STEP, "the busy client's pg_sleep to be active", || async {
        !monitor
            .active_queries_like("pg_sleep(1.5)")
            .await
            .is_empty()
    })
    .await;
    for _ in 0..3 {
        send_cancel(&idle).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let result = within(STEP, "the busy client's query", running)
        .await
        .expect("task");
    let messages = result
        .unwrap_or_else(|e| panic!("an idle client's cancel hit another client's query: {e:?}"));
    assert_eq!(simple_values(&messages).len(), 1);

    // A cancel after the query finished is a no-op too (a stale key must not linger).
    within(
        STEP,
        "late CancelRequest",
        busy.cancel_token().cancel_query(NoTls),
    )
    .await
    .expect("send cancel");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let messages = within(
        STEP,
        "a query after a stale cancel",
        busy.simple_query("SELECT pg_sleep(0.3), 1"),
    )
    .await
    .unwrap_or_else(|e| panic!("a cancel sent while idle hit a later query: {e:?}"));
    assert_eq!(simple_values(&messages).len(), 1);
    assert_eq!(scalar(&idle, "SELECT 2").await, "2");
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
async fn syntax_error_inside_an_extended_pipeline() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let client = proxy.client().await;

    // Through the driver: the failing query fails alone, its neighbours succeed.
    let sqls = [
        "SELECT 1::int",
        "SELEC 2",
        "SELECT 3::int",
        "SELECT 4::int / 0",
        "SELECT 5::int",
    ];
    let futures = sqls.iter().map(|sql| client.query_typed(sql, &[]));
    let results = within(STEP, "a pipeline with errors", future::join_all(futures)).await;
    let summary: Vec<String> = results
        .iter()
        .map(|r| match r {
            Ok(rows) => rows[0].get::<_, i32>(0).to_string(),
            Err(e) => sqlstate(e),
        })
        .collect();
    assert_eq!(summary, vec!["1", "42601", "3", "22012", "5"]);

    // On the wire: an error skips to the Sync (exactly one ErrorResponse, one ReadyForQuery),
    // later Sync groups in the same write proceed. The proxy must answer exactly as Postgres.
    async fn script(addr: std::net::SocketAddr) -> Vec<Backend> {
        let mut c = within(
            STEP,
            "wire connect",
            WireClient::connect(addr, APP_USER, APP_PASSWORD, APP_DB),
        )
        .await
        .expect("wire connect");
        c.parse("", "SELECT 1")
            .bind("", "", &[])
            .execute("", 0)
            .sync();
        c.parse("", "SELEC 2").bind("", "", &[]).execute("", 0);
        c.parse("", "SELECT 3")
            .bind("", "", &[])
            .execute("", 0)
            .sync();
        c.parse("", "SELECT $1::int + 1")
            .bind("", "", &[Some("41")])
            .describe_portal("")
            .execute("", 0)
            .sync();
        within(STEP, "send pipeline", c.send()).await.expect("send");
        let mut out = Vec::new();
        for _ in 0..3 {
            out.extend(
                within(STEP, "pipeline replies", c.until_ready())
                    .await
                    .expect("replies"),
            );
        }
        c.terminate();
        let _ = c.send().await;
        out
    }
    let through = script(proxy.addr()).await;
    let expected = vec![
        Backend::ParseComplete,
        Backend::BindComplete,
        Backend::DataRow(vec![Some("1".into())]),
        Backend::CommandComplete("SELECT 1".into()),
        Backend::ReadyForQuery(b'I'),
        Backend::Error {
            code: "42601".into(),
            message: "syntax error at or near \"SELEC\"".into(),
        },
        Backend::ReadyForQuery(b'I'),
        Backend::ParseComplete,
        Backend::BindComplete,
        Backend::RowDescription(vec!["?column?".into()]),
        Backend::DataRow(vec![Some("42".into())]),
        Backend::CommandComplete("SELECT 1".into()),
        Backend::ReadyForQuery(b'I'),
    ];
    assert_eq!(
        through, expected,
        "replies to a pipeline with a syntax error"
    );
    let direct = script(cluster.addr()).await;
    assert_eq!(
        through, direct,
        "the proxy's replies must equal a direct connection's"
    );
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_clients_share_a_pool_of_ten() {
    let cluster = Cluster::start();
    // A work-stealing runtime of 2 threads: the other tests run the default, which is one
    // thread on machines with at most 2 CPUs (the CI machines), so this one covers sessions
    // and pools shared across threads.
    let options = ProxyOptions::pool(10).arg("--worker-threads").arg("2");
    let proxy = Arc::new(Proxy::start(&cluster, options));
    if !proxy.is_direct() {
        let threads = proxy_threads(&proxy);
        assert!(
            threads >= 3,
            "--worker-threads 2 should run a main thread and 2 workers, found {threads} threads"
        );
    }
    let sampler = BackendSampler::start(&cluster).await;

    let clients = (0..200i32).map(|i| {
        let proxy = Arc::clone(&proxy);
        tokio::spawn(async move {
            let mut client = proxy.client().await;
            let one = client
                .simple_query("SELECT 1")
                .await
                .map_err(|e| format!("client {i} SELECT 1: {e:?}"))?;
            if simple_values(&one) != vec![Some("1".to_string())] {
                return Err(format!("client {i}: SELECT 1 returned {one:?}"));
            }
            let rows = client
                .query_typed("SELECT $1::int * 2", &[(&i, Type::INT4)])
                .await
                .map_err(|e| format!("client {i} extended: {e:?}"))?;
            if rows[0].get::<_, i32>(0) != i * 2 {
                return Err(format!("client {i} got another client's answer"));
            }
            client
                .simple_query("SELECT pg_sleep(0.05)")
                .await
                .map_err(|e| format!("client {i} sleep: {e:?}"))?;
            let tx = client
                .transaction()
                .await
                .map_err(|e| format!("client {i} BEGIN: {e:?}"))?;
            let rows = tx
                .query_typed("SELECT $1::text", &[(&format!("client {i}"), Type::TEXT)])
                .await
                .map_err(|e| format!("client {i} in tx: {e:?}"))?;
            tx.commit()
                .await
                .map_err(|e| format!("client {i} COMMIT: {e:?}"))?;
            let text: String = rows[0].get(0);
            if text != format!("client {i}") {
                return Err(format!("client {i} got {text:?}"));
            }
            Ok::<(), String>(())
        })
    });
    let results = within(
        Duration::from_secs(120),
        "200 concurrent clients",
        future::join_all(clients),
    )
    .await;
    let failures: Vec<String> = results
        .into_iter()
        .filter_map(|r| match r {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(e) => Some(format!("client task panicked: {e:?}")),
        })
        .collect();
    let (max, samples) = sampler.finish().await;
    assert!(
        failures.is_empty(),
        "{} of 200 clients failed, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert_pool_bound(&proxy, max, samples);
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_session_thread_logs_clients_in_on_a_lower_priority_thread() {
    let cluster = Cluster::start();
    let options = ProxyOptions::pool(4).arg("--worker-threads").arg("1");
    let proxy = Arc::new(Proxy::start(&cluster, options));
    if proxy.is_direct() {
        return;
    }
    let pid = proxy.pid().expect("a proxy process");
    // The runtime starts its worker thread at once, but the thread names itself and lowers
    // its priority when it first runs: on a loaded machine that can come a moment later.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let threads = loop {
        let threads = thread_names_and_nice(pid);
        let named = threads
            .iter()
            .any(|(c, n)| c == "pgsluice-login" && *n == 10);
        if named || std::time::Instant::now() >= deadline {
            break threads;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let login: Vec<_> = threads
        .iter()
        .filter(|(c, _)| c == "pgsluice-login")
        .collect();
    assert_eq!(login.len(), 1, "one login thread expected: {threads:?}");
    assert_eq!(
        login[0].1, 10,
        "the login thread runs at nice 10: {threads:?}"
    );
    assert_eq!(
        threads.iter().filter(|(_, n)| *n == 0).count(),
        threads.len() - 1,
        "every other thread keeps the process priority: {threads:?}"
    );
    // Logged in there, served here: 40 clients connect at once and each sees its own answer.
    let clients = (0..40i32).map(|i| {
        let proxy = Arc::clone(&proxy);
        tokio::spawn(async move {
            let client = proxy.client().await;
            let rows = client
                .query_typed("SELECT $1::int + 1", &[(&i, Type::INT4)])
                .await
                .map_err(|e| format!("client {i}: {e:?}"))?;
            if rows[0].get::<_, i32>(0) != i + 1 {
                return Err(format!("client {i} got another answer"));
            }
            Ok::<(), String>(())
        })
    });
    for r in within(
        Duration::from_secs(60),
        "40 clients",
        future::join_all(clients),
    )
    .await
    {
        r.expect("client task").expect("client result");
    }
    proxy.assert_healthy().await;
}

/// (name, nice value) of every thread of process `pid`, from /proc; a thread that exits
/// while it is read is left out.
fn thread_names_and_nice(pid: u32) -> Vec<(String, i64)> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("/proc task list")
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
            let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
            // Field 19 is the nice value; fields count from after the parenthesised name.
            let after = &stat[stat.rfind(')')? + 2..];
            let nice = after.split(' ').nth(16)?.parse().ok()?;
            Some((comm.trim().to_owned(), nice))
        })
        .collect()
}

/// Threads of the proxy process, from /proc.
fn proxy_threads(proxy: &Proxy) -> usize {
    let pid = proxy.pid().expect("a proxy process");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("a Threads: line")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn application_name_follows_the_client_across_transactions() {
    let cluster = Cluster::start();
    let proxy = Arc::new(Proxy::start(&cluster, ProxyOptions::pool(2)));

    let mut foo_config = proxy.app_config();
    foo_config.application_name("foo");
    let (foo, _task) = proxy.client_with(&foo_config).await;

    // Other clients with other names keep the two backends busy and switch them around.
    let noise = (0..6).map(|i| {
        let proxy = Arc::clone(&proxy);
        tokio::spawn(async move {
            let mut config = proxy.app_config();
            config.application_name(format!("noise{i}"));
            let (client, _task) = proxy.client_with(&config).await;
            for _ in 0..20 {
                let name = scalar(&client, "SHOW application_name").await;
                assert_eq!(
                    name,
                    format!("noise{i}"),
                    "a noise client saw another client's application_name"
                );
            }
        })
    });
    let noise = tokio::spawn(future::join_all(noise));
    for round in 0..20 {
        assert_eq!(
            scalar(&foo, "SHOW application_name").await,
            "foo",
            "round {round}"
        );
        let rows = within(
            STEP,
            "SHOW in tx",
            foo.query_typed("SELECT current_setting('application_name')", &[]),
        )
        .await
        .expect("current_setting");
        assert_eq!(
            rows[0].get::<_, String>(0),
            "foo",
            "round {round} (extended)"
        );
    }
    for result in within(Duration::from_secs(60), "noise clients", noise)
        .await
        .expect("noise")
    {
        result.expect("noise client");
    }
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_parameters_apply_on_every_backend_and_parameter_status_matches_direct() {
    let cluster = Cluster::start();
    let proxy = Arc::new(Proxy::start(&cluster, ProxyOptions::pool(2)));
    let startup: &[(&str, &str)] = &[
        ("application_name", "startup-test"),
        ("DateStyle", "SQL, DMY"),
        ("TimeZone", "Asia/Tokyo"),
        ("IntervalStyle", "iso_8601"),
        ("search_path", "myschema, public"),
        ("extra_float_digits", "2"),
    ];

    let mut direct = within(
        STEP,
        "direct wire connect",
        WireClient::connect_with(cluster.addr(), APP_USER, APP_PASSWORD, APP_DB, startup),
    )
    .await
    .expect("direct connect");
    let mut through = within(
        STEP,
        "proxied wire connect",
        WireClient::connect_with(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB, startup),
    )
    .await
    .expect("proxied connect");
    let differences: Vec<String> = direct
        .params
        .iter()
        .filter(|(k, v)| through.params.get(*k) != Some(v))
        .map(|(k, v)| format!("{k}: direct {v:?}, proxy {:?}", through.params.get(k)))
        .chain(
            through
                .params
                .keys()
                .filter(|k| !direct.params.contains_key(*k))
                .map(|k| format!("{k}: only through the proxy")),
        )
        .collect();
    assert!(
        differences.is_empty(),
        "ParameterStatus through the proxy differs from direct: {differences:#?}"
    );

    // Noise clients with default settings share the two backends meanwhile.
    let stop = Arc::new(AtomicBool::new(false));
    let noise: Vec<_> = (0..4)
        .map(|_| {
            let (proxy, stop) = (Arc::clone(&proxy), Arc::clone(&stop));
            tokio::spawn(async move {
                let client = proxy.client().await;
                while !stop.load(Ordering::Relaxed) {
                    let tz = scalar(&client, "SHOW TimeZone").await;
                    assert_ne!(
                        tz, "Asia/Tokyo",
                        "a default client saw another client's startup TimeZone"
                    );
                    let sp = scalar(&client, "SHOW search_path").await;
                    assert_ne!(
                        sp, "myschema, public",
                        "a default client saw another client's search_path"
                    );
                }
            })
        })
        .collect();
    let show = "SELECT current_setting('application_name') || '|' || current_setting('DateStyle') || '|' || \
                current_setting('TimeZone') || '|' || current_setting('IntervalStyle') || '|' || \
                current_setting('search_path') || '|' || current_setting('extra_float_digits')";
    let want = direct.simple(show).await.expect("direct settings");
    for round in 0..30 {
        let got = within(STEP, "settings through the proxy", through.simple(show))
            .await
            .expect("settings");
        assert_eq!(
            got, want,
            "round {round}: startup parameters not in effect on this backend"
        );
    }
    stop.store(true, Ordering::Relaxed);
    for task in noise {
        within(STEP, "noise client", task)
            .await
            .expect("noise client");
    }
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
async fn client_gone_mid_query_leaves_no_orphan() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let monitor = cluster.monitor().await;

    let (client, connection_task) = proxy.client_with(&proxy.app_config()).await;
    let query = tokio::spawn(async move { client.simple_query("SELECT pg_sleep(30)").await });
    eventually(STEP, "pg_sleep(30) to be active", || async {
        !monitor.active_queries_like("pg_sleep(30)").await.is_empty()
    })
    .await;
    // Drop the socket without a Terminate message: the client process "died".
    connection_task.abort();
    query.abort();
    let _ = query.await;

    if proxy.is_direct() {
        note_skipped(
            "no pg_sleep(30) within 2 s after the client vanished (Postgres itself notices only when it next writes)",
        );
    } else {
        eventually(
            Duration::from_secs(2),
            "the vanished client's pg_sleep(30) to be cancelled",
            || async { monitor.active_queries_like("pg_sleep(30)").await.is_empty() },
        )
        .await;
        assert!(
            monitor.backend_count(APP_DB, APP_USER).await <= proxy.pool_size() as i64,
            "more backends than the pool size after a vanished client"
        );
    }
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_clients_survive_terminated_backends() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(4));
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(proxy.client().await);
    }
    let warmup = clients
        .iter()
        .map(|c| c.simple_query("SELECT pg_sleep(0.05)"));
    for r in within(STEP, "warm-up queries", future::join_all(warmup)).await {
        r.expect("warm-up");
    }
    let monitor = cluster.monitor().await;
    let killed = monitor.terminate_backends(APP_DB, APP_USER).await;
    assert!(killed >= 1, "there were backends to terminate");
    tokio::time::sleep(Duration::from_millis(300)).await;

    for (i, client) in clients.iter().enumerate() {
        let result = within(
            STEP,
            "the first query after the kill",
            client.simple_query("SELECT 'alive'"),
        )
        .await;
        if proxy.is_direct() {
            // Postgres closes the session itself; a proxy must hide that from idle clients.
            if i == 0 {
                note_skipped(
                    "idle clients' next query succeeds after their backends were terminated",
                );
            }
            let err = result.expect_err("direct: a terminated session is gone");
            assert!(
                err.is_closed() || err.code() == Some(&SqlState::ADMIN_SHUTDOWN),
                "direct: {err:?}"
            );
        } else {
            let messages = result.unwrap_or_else(|e| {
                panic!("idle client {i} lost its session when its pooled backend was terminated: {e:?}\n{}", proxy.stderr_tail())
            });
            assert_eq!(simple_values(&messages), vec![Some("alive".to_string())]);
        }
    }
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_terminated_mid_query_gives_an_error_not_a_hang() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let client = Arc::new(proxy.client().await);
    let monitor = cluster.monitor().await;
    let running = sleep_running(&client, &monitor).await;
    assert!(monitor.terminate_backends(APP_DB, APP_USER).await >= 1);
    let result = within(
        Duration::from_secs(5),
        "the interrupted query to end",
        running,
    )
    .await
    .expect("task");
    let err = result.expect_err("a query whose backend was terminated must fail");
    assert!(
        err.is_closed()
            || err.code() == Some(&SqlState::ADMIN_SHUTDOWN)
            || err.code() == Some(&SqlState::CONNECTION_FAILURE),
        "expected 57P01/08006 or a closed connection, got {err:?}"
    );
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_restart_fast_idle_clients_recover_and_running_ones_get_57p01() {
    let mut cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(4));
    let idle = proxy.client().await;
    assert_eq!(scalar(&idle, "SELECT 1").await, "1");
    let busy = Arc::new(proxy.client().await);
    let running = sleep_running(&busy, &cluster.monitor().await).await;
    tokio::task::block_in_place(|| cluster.restart_fast());

    let result = within(
        Duration::from_secs(5),
        "the query interrupted by the restart",
        running,
    )
    .await
    .expect("task");
    let err = result.expect_err("a query running during a fast shutdown fails");
    assert!(
        err.is_closed()
            || err.code() == Some(&SqlState::ADMIN_SHUTDOWN)
            || err.code() == Some(&SqlState::CONNECTION_FAILURE),
        "expected 57P01/08006 or a closed connection, got {err:?}"
    );

    let result = within(
        STEP,
        "the idle client's next query",
        idle.simple_query("SELECT 'back'"),
    )
    .await;
    if proxy.is_direct() {
        note_skipped("an idle client's next query after a Postgres restart succeeds");
        assert!(result.is_err(), "direct: the session died with the server");
    } else {
        let messages = result.unwrap_or_else(|e| {
            panic!(
                "idle client broken by a backend restart: {e:?}\n{}",
                proxy.stderr_tail()
            )
        });
        assert_eq!(simple_values(&messages), vec![Some("back".to_string())]);
    }
    proxy.assert_healthy().await;
}

#[tokio::test]
async fn wrong_password_and_unknown_user_are_indistinguishable() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));

    async fn attempt(proxy: &Proxy, user: &str, password: &str, db: &str) -> tokio_postgres::Error {
        match proxy
            .try_client_with(&proxy.config(user, password, db))
            .await
        {
            Ok(_) => panic!("login as {user}/{password} to {db} must fail"),
            Err(e) => e,
        }
    }
    let wrong = attempt(&proxy, APP_USER, "not-the-password", APP_DB).await;
    let unknown = attempt(&proxy, "nosuchuser", "whatever", APP_DB).await;
    for (what, err) in [("wrong password", &wrong), ("unknown user", &unknown)] {
        assert_eq!(
            err.code(),
            Some(&SqlState::INVALID_PASSWORD),
            "{what} gives 28P01: {err:?}"
        );
    }
    let text = |e: &tokio_postgres::Error, user: &str| {
        let db = e.as_db_error().expect("a server error");
        (
            db.severity().to_string(),
            db.message().replace(user, "<user>"),
        )
    };
    assert_eq!(
        text(&wrong, APP_USER),
        text(&unknown, "nosuchuser"),
        "wrong password and unknown user must look the same (apart from the echoed name)"
    );

    // The right password with an unknown database is reported after authentication.
    let err = attempt(&proxy, APP_USER, APP_PASSWORD, "nosuchdb").await;
    assert_eq!(
        err.code(),
        Some(&SqlState::INVALID_CATALOG_NAME),
        "unknown database gives 3D000: {err:?}"
    );
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_copy_round_trip() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let files = tempfile::tempdir().expect("temp dir");
    let csv = files.path().join("out.csv");

    let psql = |commands: &[String]| {
        let mut cmd = proxy.tool_command("psql", APP_USER, APP_PASSWORD, APP_DB);
        cmd.args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"]);
        for c in commands {
            cmd.arg("-c").arg(c);
        }
        cmd
    };
    let out = run_with_timeout_async(
        psql(&[
            "CREATE TABLE src AS SELECT g AS id, 'line ' || g || E' with \"quotes\", commas' AS t FROM generate_series(1, 5000) g".into(),
            format!("\\copy src TO '{}' CSV", csv.display()),
            "CREATE TABLE dst (LIKE src)".into(),
            format!("\\copy dst FROM '{}' CSV", csv.display()),
            "SELECT (SELECT count(*) FROM dst) || ' ' || \
             ((SELECT md5(string_agg(id || t, ',' ORDER BY id)) FROM src) = \
              (SELECT md5(string_agg(id || t, ',' ORDER BY id)) FROM dst))"
                .into(),
        ]),
        Duration::from_secs(60),
    )
    .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "psql failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.lines().last(),
        Some("5000 true"),
        "psql output:\n{stdout}"
    );
    assert_eq!(
        std::fs::read_to_string(&csv).expect("csv").lines().count(),
        5000
    );
    proxy.assert_healthy().await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbench_simple_and_extended_have_no_failures() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(10));

    pgbench::init(&proxy, 1).await;
    let check = cluster.psql_on(APP_DB, "SELECT count(*) FROM pgbench_accounts");
    assert_eq!(
        check.trim(),
        "100000",
        "pgbench -i -s 1 loads 100 000 accounts"
    );

    let sampler = BackendSampler::start(&cluster).await;
    let mut tps = HashMap::new();
    for mode in ["simple", "extended"] {
        let report = pgbench::run_ok(
            &proxy,
            &["-S", "-c", "16", "-j", "2", "-T", "5", "-M", mode, "-n"],
        )
        .await;
        tps.insert(mode, report.tps);
    }
    let (max, samples) = sampler.finish().await;
    eprintln!("pgbench -S -c 16 through the proxy: {tps:?}");
    assert_pool_bound(&proxy, max, samples);
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_holds_a_backend_per_client_and_bounds_the_pool() {
    let cluster = Cluster::start();
    let proxy = Arc::new(Proxy::start(&cluster, ProxyOptions::pool(3).session()));
    let sampler = BackendSampler::start(&cluster).await;
    let clients = (0..9).map(|i| {
        let proxy = Arc::clone(&proxy);
        tokio::spawn(async move {
            let client = proxy.client().await;
            // In session mode a session-level SET sticks for the whole session.
            client
                .batch_execute(&format!("SET application_name = 'session{i}'"))
                .await
                .expect("SET");
            let pid = scalar(&client, "SELECT pg_backend_pid()").await;
            for _ in 0..5 {
                assert_eq!(
                    scalar(&client, "SHOW application_name").await,
                    format!("session{i}")
                );
                assert_eq!(
                    scalar(&client, "SELECT pg_backend_pid()").await,
                    pid,
                    "session mode keeps one backend"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    });
    for r in within(
        Duration::from_secs(60),
        "9 session-mode clients over 3 backends",
        future::join_all(clients),
    )
    .await
    {
        r.expect("session client");
    }
    let (max, samples) = sampler.finish().await;
    assert_pool_bound(&proxy, max, samples);
    proxy.assert_healthy().await;
}
