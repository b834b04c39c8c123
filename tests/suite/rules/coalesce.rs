//! COALESCE rules against a real PostgreSQL through the spawned proxy:
//!
//! * many clients sending the same read at once get, each, the bytes Postgres sends a client
//!   that runs it alone (row description, rows, command tag), while Postgres runs it a
//!   handful of times (its own `seq_scan` count says so, not only the proxy's metrics);
//! * what must not be shared is not: clients with another `search_path` get their own
//!   schema's rows, a read inside a transaction block and a text that calls `now()` run for
//!   each client; a result over `max_result_bytes` and a read that fails are run by each
//!   client itself (each gets its own error).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::{W, admin};
use crate::support::env::Env;
use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{ADMIN_READ_TOKEN, Proxy};
use crate::support::wire::WireClient;
use crate::support::{direct_mode, note_skipped};

/// A read that takes a few tens of milliseconds: long enough for the others to arrive.
const FLAGS: &str = "SELECT name, value, (SELECT count(*) FROM generate_series(1, 300000)) AS n \
                     FROM flags ORDER BY name";

fn start() -> Option<Env> {
    if direct_mode() {
        note_skipped("the COALESCE tests (they need the proxy)");
        return None;
    }
    Some(Env::start(
        2,
        &format!("admin:\n  write_token: {W}\n"),
        |c: &Cluster| {
            c.psql_on(
                APP_DB,
                &format!(
                    "CREATE TABLE public.flags (name text, value text);
                     INSERT INTO public.flags VALUES ('beta', 'on'), ('dark', 'off');
                     CREATE SCHEMA a; CREATE SCHEMA b;
                     CREATE TABLE a.flags (name text, value text);
                     INSERT INTO a.flags VALUES ('from', 'a');
                     CREATE TABLE b.flags (name text, value text);
                     INSERT INTO b.flags VALUES ('from', 'b'), ('more', 'b');
                     GRANT USAGE ON SCHEMA a, b TO {APP_USER};
                     GRANT SELECT ON ALL TABLES IN SCHEMA public, a, b TO {APP_USER};
                     GRANT UPDATE ON public.flags TO {APP_USER};"
                ),
            );
        },
    ))
}

/// A COALESCE rule on `sql`'s pattern, with `extra` fields.
async fn coalesce(proxy: &Proxy, sql: &str, extra: serde_json::Value) {
    let mut body = json!({"sql": sql, "action": "COALESCE", "max_wait_ms": 10000});
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    let (status, v) = admin(
        proxy,
        "POST",
        "/v1/rules/fingerprint",
        Some(&body.to_string()),
    )
    .await;
    assert!(status == 200 || status == 201, "{v}");
}

/// A counter or gauge from `/metrics` (summed over its labels when `name` has none).
async fn metric(proxy: &Proxy, name: &str) -> f64 {
    let (status, text) = proxy
        .admin_request("GET", "/metrics", ADMIN_READ_TOKEN, None)
        .await;
    assert_eq!(status, 200, "{text}");
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `n` clients (with these startup settings) logged in first, then all sending `sql` at
/// once: each one's raw reply and ReadyForQuery status.
async fn all_at_once(
    addr: SocketAddr,
    n: usize,
    startup: &[(&str, &str)],
    sql: &str,
) -> Vec<(Vec<u8>, u8)> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(
            WireClient::connect_with(addr, APP_USER, APP_PASSWORD, APP_DB, startup)
                .await
                .expect("login"),
        );
    }
    let go = Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|mut c| {
            let go = Arc::clone(&go);
            let sql = sql.to_owned();
            tokio::spawn(async move {
                go.wait().await;
                c.query(&sql);
                c.send().await.expect("send");
                c.until_ready_raw().await.expect("reply")
            })
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.expect("client task"));
    }
    out
}

/// What Postgres sends a client that runs `sql` alone, straight to the server.
async fn alone(cluster: &Cluster, startup: &[(&str, &str)], sql: &str) -> Vec<u8> {
    let mut c = WireClient::connect_with(cluster.addr(), APP_USER, APP_PASSWORD, APP_DB, startup)
        .await
        .expect("direct login");
    c.query(sql);
    c.send().await.expect("send");
    let (bytes, status) = c.until_ready_raw().await.expect("reply");
    assert_eq!(status, b'I');
    bytes
}

/// Sequential scans of `schema.flags` so far, as Postgres counts them.
async fn scans(cluster: &Cluster, schema: &str) -> i64 {
    let c = cluster.superuser_client(APP_DB).await;
    c.batch_execute("SELECT pg_stat_clear_snapshot()")
        .await
        .expect("clear snapshot");
    let row = c
        .query_one(
            "SELECT seq_scan FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = 'flags'",
            &[&schema],
        )
        .await
        .expect("seq_scan");
    row.get::<_, i64>(0)
}

/// Scans of `schema.flags` since `before`, once Postgres has counted at least `at_least`
/// (backends report their statistics within a second or so of going idle).
async fn scans_since(cluster: &Cluster, schema: &str, before: i64, at_least: i64) -> i64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let n = scans(cluster, schema).await - before;
        if n >= at_least || tokio::time::Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_reads_at_once_run_a_handful_of_times_and_each_client_gets_postgres_bytes() {
    let Some(env) = start() else { return };
    let proxy = &env.proxy;
    let expected = alone(&env.cluster, &[], FLAGS).await;
    coalesce(proxy, FLAGS, json!({})).await;
    let before = scans(&env.cluster, "public").await;

    const N: usize = 150;
    let replies = all_at_once(proxy.addr(), N, &[], FLAGS).await;
    for (i, (bytes, status)) in replies.iter().enumerate() {
        assert_eq!(*status, b'I', "client {i}");
        assert!(
            *bytes == expected,
            "client {i} got other bytes than Postgres sends:\n{:?}\n{:?}",
            String::from_utf8_lossy(bytes),
            String::from_utf8_lossy(&expected)
        );
    }
    let led = metric(proxy, "pgsluice_coalesce_led_total").await;
    let shared = metric(proxy, "pgsluice_coalesce_shared_total").await;
    let fell_back = metric(proxy, "pgsluice_coalesce_fallbacks_total").await;
    assert!((1.0..=10.0).contains(&led), "runs: {led}");
    assert!(
        shared >= (N as f64) - led - fell_back && shared >= (N as f64) * 0.9,
        "shared {shared}, led {led}, fell back {fell_back}"
    );
    // Postgres's own count: one scan of `flags` per execution.
    let executed = scans_since(&env.cluster, "public", before, led as i64).await;
    assert!(
        executed as f64 <= led + fell_back && executed <= 10,
        "Postgres scanned flags {executed} times for {N} clients (led {led})"
    );

    // A client that wrote reads its write, even while a run that started before its write
    // is still in flight: it does not join that run.
    let slow = "SELECT name, value, (SELECT count(*) FROM generate_series(1, 5000000)) AS n \
                FROM flags ORDER BY name";
    coalesce(proxy, slow, json!({})).await;
    let mut early = WireClient::connect(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB)
        .await
        .expect("login");
    let mut writer = WireClient::connect(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB)
        .await
        .expect("login");
    early.query(slow);
    early.send().await.expect("send");
    tokio::time::sleep(Duration::from_millis(30)).await;
    writer
        .simple("UPDATE flags SET value = 'changed' WHERE name = 'beta'")
        .await
        .expect("write");
    let shared_before = metric(proxy, "pgsluice_coalesce_shared_total").await;
    writer.query(slow);
    writer.send().await.expect("send");
    let (mine, _) = writer.until_ready_raw().await.expect("the writer's read");
    let (old, _) = early.until_ready_raw().await.expect("the earlier read");
    assert!(
        String::from_utf8_lossy(&mine).contains("changed"),
        "the writer's read shows its write"
    );
    assert!(
        !String::from_utf8_lossy(&old).contains("changed"),
        "the run that started before the write did not see it"
    );
    assert_eq!(
        metric(proxy, "pgsluice_coalesce_shared_total").await,
        shared_before,
        "the writer did not join the older run"
    );
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_transactions_volatile_texts_large_results_and_errors_are_not_shared() {
    let Some(env) = start() else { return };
    let proxy = &env.proxy;
    coalesce(proxy, FLAGS, json!({})).await;

    // Two search_paths at once: each client gets its own schema's rows, and each group
    // still shares (the test would prove nothing otherwise).
    let (a, b) = tokio::join!(
        all_at_once(proxy.addr(), 30, &[("search_path", "a")], FLAGS),
        all_at_once(proxy.addr(), 30, &[("search_path", "b")], FLAGS),
    );
    let want_a = alone(&env.cluster, &[("search_path", "a")], FLAGS).await;
    let want_b = alone(&env.cluster, &[("search_path", "b")], FLAGS).await;
    assert_ne!(want_a, want_b);
    assert!(
        a.iter().all(|(r, _)| *r == want_a),
        "search_path a got b's rows"
    );
    assert!(
        b.iter().all(|(r, _)| *r == want_b),
        "search_path b got a's rows"
    );
    let shared = metric(proxy, "pgsluice_coalesce_shared_total").await;
    assert!(shared >= 30.0, "each group shares: {shared}");

    // Inside a transaction block: every client runs its own.
    let before = metric(proxy, "pgsluice_coalesce_shared_total").await;
    let led = metric(proxy, "pgsluice_coalesce_led_total").await;
    let in_txn = format!("BEGIN; {FLAGS}; COMMIT");
    let r = all_at_once(proxy.addr(), 20, &[], &in_txn).await;
    assert!(r.iter().all(|(_, s)| *s == b'I'));
    let mut c = WireClient::connect(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB)
        .await
        .expect("login");
    c.simple("BEGIN").await.expect("BEGIN");
    c.simple(FLAGS).await.expect("read in a transaction");
    c.simple("COMMIT").await.expect("COMMIT");
    assert_eq!(
        metric(proxy, "pgsluice_coalesce_shared_total").await,
        before
    );
    assert_eq!(metric(proxy, "pgsluice_coalesce_led_total").await, led);

    // A text that calls now(): the parse says no, whatever the rule says.
    let volatile = "SELECT now(), (SELECT count(*) FROM generate_series(1, 300000))";
    coalesce(proxy, volatile, json!({})).await;
    let r = all_at_once(proxy.addr(), 20, &[], volatile).await;
    let distinct: std::collections::HashSet<_> = r.iter().map(|(b, _)| b.clone()).collect();
    assert!(distinct.len() > 1, "each ran its own now()");
    assert_eq!(
        metric(proxy, "pgsluice_coalesce_shared_total").await,
        before
    );

    // Over max_result_bytes: run by each client, with the right rows.
    let big = "SELECT g, (SELECT count(*) FROM generate_series(1, 300000)) FROM generate_series(1, 2000) g";
    coalesce(proxy, big, json!({"max_result_bytes": 1000})).await;
    let want = alone(&env.cluster, &[], big).await;
    let r = all_at_once(proxy.addr(), 20, &[], big).await;
    assert!(r.iter().all(|(b, _)| *b == want));
    assert!(
        metric(
            proxy,
            "pgsluice_coalesce_fallbacks_total{reason=\"too_large\"}"
        )
        .await
            >= 1.0
    );

    // A read that fails: each client gets its own error from Postgres.
    let failing = "SELECT 1 / (SELECT count(*) - count(*) FROM generate_series(1, 300000))";
    coalesce(proxy, failing, json!({})).await;
    let want = alone_error(&env.cluster, failing).await;
    let r = all_at_once(proxy.addr(), 20, &[], failing).await;
    assert!(r.iter().all(|(b, s)| *b == want && *s == b'I'));
    assert!(metric(proxy, "pgsluice_coalesce_fallbacks_total{reason=\"error\"}").await >= 1.0);
    assert_eq!(
        metric(proxy, "pgsluice_coalesce_shared_total").await,
        before
    );
    proxy.assert_healthy().await;
}

/// [`alone`] for a read that fails (its ReadyForQuery status is `I` too).
async fn alone_error(cluster: &Cluster, sql: &str) -> Vec<u8> {
    let bytes = alone(cluster, &[], sql).await;
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.contains("C22012"), "{text}");
    bytes
}

/// A prepared read: shared by its text and its parameters.
const FLAGS_P: &str = "SELECT name, value, (SELECT count(*) FROM generate_series(1, 300000)) AS n \
                       FROM flags WHERE value <> $1 ORDER BY name";

/// `n` clients logged in, then each sending Parse (statement `name`), Bind with the parameter
/// `param(i)`, Describe, Execute, Sync at once: each one's raw reply.
async fn batches_at_once(
    addr: SocketAddr,
    n: usize,
    name: &str,
    param: fn(usize) -> &'static str,
) -> Vec<(usize, Vec<u8>)> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(
            WireClient::connect(addr, APP_USER, APP_PASSWORD, APP_DB)
                .await
                .expect("login"),
        );
    }
    let go = Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            let go = Arc::clone(&go);
            let name = name.to_owned();
            tokio::spawn(async move {
                go.wait().await;
                c.parse(&name, FLAGS_P)
                    .bind("", &name, &[Some(param(i))])
                    .describe_portal("")
                    .execute("", 0)
                    .sync();
                c.send().await.expect("send");
                let (bytes, status) = c.until_ready_raw().await.expect("reply");
                assert_eq!(status, b'I');
                // The statement is the client's from now on, whoever ran it.
                if !name.is_empty() {
                    c.bind("", &name, &[Some(param(i))]).execute("", 0).sync();
                    c.send().await.expect("send");
                    let again = c.until_ready_raw().await.expect("again").0;
                    assert!(
                        again.windows(4).any(|w| w == b"dark" || w == b"beta"),
                        "the named statement runs again: {}",
                        String::from_utf8_lossy(&again)
                    );
                }
                (i, bytes)
            })
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.expect("client task"));
    }
    out
}

/// The same batch straight to Postgres.
async fn batch_alone(cluster: &Cluster, name: &str, param: &str) -> Vec<u8> {
    let mut c = WireClient::connect(cluster.addr(), APP_USER, APP_PASSWORD, APP_DB)
        .await
        .expect("direct login");
    c.parse(name, FLAGS_P)
        .bind("", name, &[Some(param)])
        .describe_portal("")
        .execute("", 0)
        .sync();
    c.send().await.expect("send");
    c.until_ready_raw().await.expect("reply").0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_reads_are_shared_by_text_and_parameters() {
    let Some(env) = start() else { return };
    let proxy = &env.proxy;
    coalesce(proxy, FLAGS_P, json!({})).await;
    let param = |i: usize| if i.is_multiple_of(2) { "x" } else { "off" };
    for name in ["", "s1"] {
        let before = metric(proxy, "pgsluice_coalesce_shared_total").await;
        let want = [
            batch_alone(&env.cluster, name, "x").await,
            batch_alone(&env.cluster, name, "off").await,
        ];
        assert_ne!(want[0], want[1], "the parameter changes the rows");
        let got = batches_at_once(proxy.addr(), 60, name, param).await;
        for (i, bytes) in &got {
            assert!(
                *bytes == want[i % 2],
                "statement {name:?}, client {i}: {}\nwant {}",
                String::from_utf8_lossy(bytes),
                String::from_utf8_lossy(&want[i % 2])
            );
        }
        let shared = metric(proxy, "pgsluice_coalesce_shared_total").await - before;
        assert!(shared >= 30.0, "statement {name:?}: {shared} shared of 60");
    }

    // A driver's prepared statements (tokio-postgres: Parse and Describe first, then Bind,
    // Execute, Sync under names of its own): the rows each would get alone.
    let before = metric(proxy, "pgsluice_coalesce_shared_total").await;
    let mut clients = Vec::new();
    for _ in 0..60 {
        let c = proxy.client().await;
        let stmt = c.prepare(FLAGS_P).await.expect("prepare");
        clients.push((c, stmt));
    }
    let go = Arc::new(tokio::sync::Barrier::new(clients.len()));
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|(c, stmt)| {
            let go = Arc::clone(&go);
            tokio::spawn(async move {
                go.wait().await;
                let rows = c.query(&stmt, &[&"x"]).await.expect("query");
                rows.iter()
                    .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for t in tasks {
        let rows = t.await.expect("client task");
        assert_eq!(
            rows,
            vec![
                ("beta".to_owned(), "on".to_owned()),
                ("dark".to_owned(), "off".to_owned())
            ]
        );
    }
    let shared = metric(proxy, "pgsluice_coalesce_shared_total").await - before;
    assert!(shared >= 30.0, "tokio-postgres: {shared} shared of 60");
    proxy.assert_healthy().await;
}
