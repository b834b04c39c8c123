//! LISTEN/NOTIFY in transaction mode (PgBouncer #655, PgCat #303): listening clients hold no
//! backend. The pool's one listener connection (`application_name` `pgsluice listener`) holds
//! the union of their channels and the proxy writes each notification to every client on its
//! channel — with the notifying backend's pid and the payload — between the client's
//! statements. Session mode is unchanged (its clients own their backend).
//!
//! Raw protocol clients (`support::raw`) are used where the order of messages on the wire is
//! the point; psycopg2 and asyncpg (Debian's `python3-psycopg2` and `python3-asyncpg`, under
//! Debian's own interpreter) are the real-driver checks, asyncpg with 200 listening clients on
//! a pool of 5.

use std::process::Command;
use std::time::Duration;

use tokio::net::TcpSocket;
use tokio_postgres::{Client, NoTls};

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster, Monitor};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::raw::{Msg, Raw, field};
use crate::support::sql::{STEP, eventually};
use crate::support::{run_with_timeout_async, within};

const LISTENER_APP: &str = "pgsluice listener";
/// The interpreter Debian's python3-* packages (the drivers) belong to, whatever else is on
/// `PATH`.
const DEBIAN_PYTHON: &str = "/usr/bin/python3";

async fn raw_client(proxy: &Proxy) -> Raw {
    let mut r = Raw::tcp(proxy.addr()).await;
    r.app_login().await;
    r
}

/// Runs `sql` (a LISTEN or UNLISTEN) and asserts Postgres' answer: its CommandComplete and
/// ReadyForQuery('I').
async fn run_listen(r: &mut Raw, sql: &str) {
    let msgs = r.query(sql).await.expect(sql);
    let tags: Vec<u8> = msgs.iter().map(|m| m.0).collect();
    assert_eq!(tags, b"CZ", "{sql}: {msgs:?}");
    let verb = if sql.to_ascii_lowercase().contains("unlisten") {
        "UNLISTEN"
    } else {
        "LISTEN"
    };
    assert_eq!(&msgs[0].1[..], format!("{verb}\0").as_bytes(), "{sql}");
    assert_eq!(&msgs[1].1[..], b"I", "{sql}");
}

/// A NotificationResponse: (pid, channel, payload).
fn notification(m: &Msg) -> (i32, String, String) {
    assert_eq!(m.0, b'A', "expected a NotificationResponse, got {m:?}");
    let pid = i32::from_be_bytes([m.1[0], m.1[1], m.1[2], m.1[3]]);
    let mut parts = m.1[4..].split(|&c| c == 0);
    let channel = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    let payload = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    (pid, channel, payload)
}

async fn next_notification(r: &mut Raw, what: &str) -> (i32, String, String) {
    let m = within(STEP, what, r.recv()).await.expect(what);
    notification(&m)
}

/// Asserts nothing arrives within `d`.
async fn quiet(r: &mut Raw, d: Duration, what: &str) {
    if let Ok(m) = tokio::time::timeout(d, r.recv()).await {
        panic!("{what}: unexpected {m:?}");
    }
}

async fn direct(cluster: &Cluster) -> Client {
    let (client, conn) = within(
        STEP,
        "direct app connection",
        tokio_postgres::connect(&cluster.connect_str(APP_USER, APP_PASSWORD, APP_DB), NoTls),
    )
    .await
    .expect("direct connect");
    tokio::spawn(conn);
    client
}

/// Sends a notification in one statement and returns the pid of the backend that sent it.
async fn notify(client: &Client, channel: &str, payload: &str) -> i32 {
    let row = within(
        STEP,
        "pg_notify",
        client.query_one(
            "SELECT pg_backend_pid(), pg_notify($1, $2)::text",
            &[&channel, &payload],
        ),
    )
    .await
    .expect("pg_notify");
    row.get(0)
}

async fn listeners(monitor: &Monitor) -> Vec<String> {
    let rows = monitor
        .client()
        .query(
            "SELECT coalesce(query, '') FROM pg_stat_activity WHERE application_name = $1",
            &[&LISTENER_APP],
        )
        .await
        .expect("pg_stat_activity");
    rows.iter().map(|r| r.get(0)).collect()
}

fn start(pool: usize) -> (Cluster, Proxy) {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(pool));
    assert!(
        !proxy.is_direct(),
        "these tests are about the proxy's own listener connection"
    );
    (cluster, proxy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_idle_listeners_share_one_connection_and_unlisten_stops_delivery() {
    let (cluster, proxy) = start(2);
    let monitor = cluster.monitor().await;
    let mut clients = Vec::new();
    for _ in 0..20 {
        let mut r = raw_client(&proxy).await;
        run_listen(&mut r, "LISTEN jobs").await;
        clients.push(r);
    }
    // 20 listening clients: the pool (at most 2) and one listener connection.
    let before = monitor.backend_count(APP_DB, APP_USER).await;
    assert!(before <= 3, "{before} backends for 20 listening clients");
    assert_eq!(
        listeners(&monitor).await.len(),
        1,
        "one listener connection"
    );
    let pool = proxy.app_pool().await;
    assert_eq!(pool["listening"], 20, "{pool}");
    assert_eq!(pool["listen_channels"], 1, "{pool}");

    let outside = direct(&cluster).await;
    let pid = notify(&outside, "jobs", "from a direct connection").await;
    for (i, r) in clients.iter_mut().enumerate() {
        let n = next_notification(r, "the direct NOTIFY").await;
        assert_eq!(
            n,
            (
                pid,
                "jobs".to_owned(),
                "from a direct connection".to_owned()
            ),
            "client {i}"
        );
    }

    let notifier = proxy.client().await;
    let pid = notify(&notifier, "jobs", "from a proxy client").await;
    for (i, r) in clients.iter_mut().enumerate() {
        let n = next_notification(r, "the proxied NOTIFY").await;
        assert_eq!(
            n,
            (pid, "jobs".to_owned(), "from a proxy client".to_owned()),
            "client {i}"
        );
    }
    let after = monitor.backend_count(APP_DB, APP_USER).await;
    assert!(
        after <= 4,
        "{after} backends: the pool (2), the listener and the direct notifier at most"
    );

    // Half of them UNLISTEN (by name, or all); only the other half hears the next one.
    for (i, r) in clients.iter_mut().take(10).enumerate() {
        let sql = if i % 2 == 0 {
            "UNLISTEN jobs"
        } else {
            "UNLISTEN *"
        };
        run_listen(r, sql).await;
    }
    assert_eq!(proxy.app_pool().await["listening"], 10);
    notify(&outside, "jobs", "after unlisten").await;
    for r in clients.iter_mut().skip(10) {
        let n = next_notification(r, "the NOTIFY after half unlistened").await;
        assert_eq!(n.2, "after unlisten");
    }
    for r in clients.iter_mut().take(10) {
        quiet(r, Duration::from_millis(300), "an unlistened client").await;
        let msgs = r.query("SELECT 1").await.expect("SELECT 1");
        assert!(msgs.iter().all(|m| m.0 != b'A'), "{msgs:?}");
    }
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channels_keep_their_own_subscribers_and_leaving_unlistens() {
    let (cluster, proxy) = start(2);
    let monitor = cluster.monitor().await;
    let outside = direct(&cluster).await;
    let mut a = raw_client(&proxy).await;
    let mut b = raw_client(&proxy).await;
    run_listen(&mut a, "LISTEN alpha").await;
    run_listen(&mut b, "LISTEN beta").await;

    notify(&outside, "alpha", "for a").await;
    notify(&outside, "beta", "for b").await;
    assert_eq!(next_notification(&mut a, "alpha").await.2, "for a");
    assert_eq!(next_notification(&mut b, "beta").await.2, "for b");
    quiet(&mut a, Duration::from_millis(300), "a after beta").await;
    quiet(&mut b, Duration::from_millis(300), "b after alpha").await;

    // A multiplexed client's own backend listens to nothing (documented).
    let mut c = raw_client(&proxy).await;
    run_listen(&mut c, "LISTEN alpha").await;
    let msgs = c
        .query("SELECT count(*) FROM pg_listening_channels()")
        .await
        .expect("pg_listening_channels");
    assert_eq!(
        crate::support::raw::first_value(&msgs).as_deref(),
        Some("0")
    );

    // A leaves, C stays on alpha: still listened. C leaves too: the listener UNLISTENs it.
    drop(a);
    notify(&outside, "alpha", "for c").await;
    assert_eq!(next_notification(&mut c, "alpha for c").await.2, "for c");
    drop(c);
    eventually(STEP, "the listener to UNLISTEN alpha", || async {
        listeners(&monitor).await == vec!["UNLISTEN \"alpha\";".to_owned()]
    })
    .await;
    notify(&outside, "beta", "still for b").await;
    assert_eq!(
        next_notification(&mut b, "beta again").await.2,
        "still for b"
    );

    // A client's own NOTIFY (through the proxy, on a pooled backend) comes back to it too.
    let msgs = b
        .query("SELECT pg_backend_pid(), pg_notify('beta', 'to myself')")
        .await
        .expect("own NOTIFY");
    let own_pid: i32 = crate::support::raw::first_value(&msgs)
        .expect("pid")
        .parse()
        .expect("pid");
    let n = next_notification(&mut b, "its own notification").await;
    assert_eq!((n.0, n.2.as_str()), (own_pid, "to myself"));

    // The last channel goes: the listener connection closes.
    run_listen(&mut b, "UNLISTEN *").await;
    eventually(STEP, "the listener connection to close", || async {
        listeners(&monitor).await.is_empty()
    })
    .await;
    notify(&outside, "beta", "nobody").await;
    quiet(&mut b, Duration::from_millis(300), "b after UNLISTEN *").await;
    // And LISTEN works again from scratch.
    run_listen(&mut b, "LISTEN beta").await;
    notify(&outside, "beta", "again").await;
    assert_eq!(
        next_notification(&mut b, "beta after relisten").await.2,
        "again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_follow_ready_for_query_and_wait_for_the_transaction() {
    let (cluster, proxy) = start(2);
    let outside = direct(&cluster).await;
    let mut r = raw_client(&proxy).await;
    run_listen(&mut r, "LISTEN mid").await;

    // Sent while the client's statement runs: delivered after its ReadyForQuery.
    r.send(&crate::support::raw::query("SELECT pg_sleep(1)"))
        .await
        .expect("send");
    tokio::time::sleep(Duration::from_millis(300)).await;
    notify(&outside, "mid", "during the statement").await;
    let mut tags = Vec::new();
    loop {
        let m = within(STEP, "reply or notification", r.recv())
            .await
            .expect("recv");
        tags.push(m.0);
        if m.0 == b'A' {
            assert_eq!(notification(&m).2, "during the statement");
            break;
        }
    }
    assert_eq!(tags, b"TDCZA", "the notification must follow ReadyForQuery");

    // Inside a transaction block: held until the transaction ends, as Postgres does.
    let begin = r.query("BEGIN").await.expect("BEGIN");
    assert_eq!(&begin.last().expect("Z").1[..], b"T");
    notify(&outside, "mid", "during the transaction").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let msgs = r
        .query("SELECT 1")
        .await
        .expect("SELECT 1 in the transaction");
    assert!(msgs.iter().all(|m| m.0 != b'A'), "{msgs:?}");
    quiet(&mut r, Duration::from_millis(300), "inside the transaction").await;
    // LISTEN inside a transaction block is refused, and aborts it like any error.
    let msgs = r
        .query("LISTEN other")
        .await
        .expect("LISTEN in a transaction");
    let err = msgs.iter().find(|m| m.0 == b'E').expect("an error");
    assert_eq!(field(&err.1, b'C'), "0A000");
    assert_eq!(&msgs.last().expect("Z").1[..], b"E");
    let msgs = r.query("ROLLBACK").await.expect("ROLLBACK");
    assert_eq!(&msgs.last().expect("Z").1[..], b"I");
    let n = next_notification(&mut r, "the notification after the transaction").await;
    assert_eq!(n.2, "during the transaction");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quoted_and_mixed_case_channels_match_postgres() {
    let (cluster, proxy) = start(2);
    let outside = direct(&cluster).await;
    let mut r = raw_client(&proxy).await;
    run_listen(&mut r, "LISTEN \"Mixed Case\"").await;
    run_listen(&mut r, "/* tagged */ listen Folded_Name;").await;
    run_listen(&mut r, "LISTEN \"with \"\"quote\"\"\"").await;

    // Unquoted names fold to lower case; quoted ones keep theirs.
    outside
        .batch_execute("NOTIFY mixed_case, 'wrong'; NOTIFY \"Folded_Name\", 'wrong'")
        .await
        .expect("NOTIFY other spellings");
    outside
        .batch_execute(
            "NOTIFY \"Mixed Case\", 'one'; NOTIFY FOLDED_NAME, 'two'; \
             NOTIFY \"with \"\"quote\"\"\", 'three'",
        )
        .await
        .expect("NOTIFY");
    let mut got = Vec::new();
    for _ in 0..3 {
        let n = next_notification(&mut r, "a notification").await;
        got.push((n.1, n.2));
    }
    got.sort();
    assert_eq!(
        got,
        vec![
            ("Mixed Case".to_owned(), "one".to_owned()),
            ("folded_name".to_owned(), "two".to_owned()),
            ("with \"quote\"".to_owned(), "three".to_owned()),
        ]
    );
    quiet(&mut r, Duration::from_millis(300), "other spellings").await;
    // A name longer than 63 bytes is cut, with Postgres' NOTICE.
    let long = "n".repeat(70);
    let msgs = r
        .query(&format!("LISTEN {long}"))
        .await
        .expect("long LISTEN");
    let notice = msgs.iter().find(|m| m.0 == b'N').expect("a NOTICE");
    assert_eq!(field(&notice.1, b'C'), "42622");
    notify(&outside, &"n".repeat(63), "cut").await;
    assert_eq!(
        next_notification(&mut r, "truncated").await.1,
        "n".repeat(63)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_is_dropped_alone() {
    let (cluster, proxy) = start(2);
    let outside = direct(&cluster).await;
    // The zombie: a small receive buffer, and it stops reading after its LISTEN.
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("rcvbuf");
    let stream = within(STEP, "connect", socket.connect(proxy.addr()))
        .await
        .expect("connect");
    let mut zombie = Raw::over(stream);
    zombie.app_login().await;
    run_listen(&mut zombie, "LISTEN flood").await;
    let mut healthy = raw_client(&proxy).await;
    run_listen(&mut healthy, "LISTEN flood").await;

    // 20 000 notifications of 1 KB (about 20 MB, more than socket buffers and the 1 MiB a
    // client may have waiting), in batches of 500 that a reading client keeps up with.
    const BATCH: usize = 500;
    const COUNT: usize = 40 * BATCH;
    for start in (1..=COUNT).step_by(BATCH) {
        within(
            STEP,
            "a batch of notifications",
            outside.batch_execute(&format!(
                "SELECT pg_notify('flood', i || repeat('x', 1000)) \
                 FROM generate_series({start}, {}) i",
                start + BATCH - 1
            )),
        )
        .await
        .expect("flood");
        for i in start..start + BATCH {
            let n = next_notification(&mut healthy, "the healthy client's notifications").await;
            assert!(
                n.2.starts_with(&format!("{i}x")),
                "notification {i}: {}",
                &n.2[..10]
            );
        }
    }
    // Now the zombie reads: what was in the socket buffers, then the FATAL and the close.
    let mut seen = 0usize;
    let end = loop {
        match within(STEP, "the zombie's stream", zombie.recv()).await {
            Ok((b'A', _)) => seen += 1,
            Ok((b'E', body)) => break Some((field(&body, b'S'), field(&body, b'C'))),
            Ok(other) => panic!("unexpected {other:?}"),
            Err(_) => break None,
        }
    };
    assert!(
        seen < COUNT,
        "the zombie got everything ({seen}): nothing was bounded"
    );
    assert_eq!(end, Some(("FATAL".to_owned(), "54000".to_owned())));
    assert!(
        zombie.closes().await,
        "the zombie's connection must be closed"
    );
    // The others are unharmed.
    let msgs = healthy.query("SELECT 1").await.expect("healthy SELECT 1");
    assert_eq!(
        crate::support::raw::first_value(&msgs).as_deref(),
        Some("1")
    );
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_listener_reconnects_relistens_and_says_so() {
    let (cluster, proxy) = start(2);
    let monitor = cluster.monitor().await;
    let outside = direct(&cluster).await;
    let mut r = raw_client(&proxy).await;
    run_listen(&mut r, "LISTEN survive").await;
    let killed: i64 = monitor
        .client()
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = $1",
            &[&LISTENER_APP],
        )
        .await
        .expect("terminate the listener")
        .get(0);
    assert_eq!(killed, 1);
    let m = within(STEP, "the loss notice", r.recv())
        .await
        .expect("notice");
    assert_eq!(m.0, b'N', "{m:?}");
    assert!(field(&m.1, b'M').contains("lost"), "{m:?}");
    let m = within(STEP, "the resumed notice", r.recv())
        .await
        .expect("notice");
    assert_eq!(m.0, b'N', "{m:?}");
    assert!(field(&m.1, b'M').contains("again"), "{m:?}");
    notify(&outside, "survive", "after the reconnect").await;
    let n = next_notification(&mut r, "after the reconnect").await;
    assert_eq!(n.2, "after the reconnect");
}

/// The client's LISTEN ran on its own backend (it shows in `pg_listening_channels()` there),
/// and no listener connection was opened for it.
async fn listens_on_its_own_backend(r: &mut Raw, monitor: &Monitor) {
    let msgs = r
        .query("SELECT count(*) FROM pg_listening_channels()")
        .await
        .expect("pg_listening_channels");
    assert_eq!(
        crate::support::raw::first_value(&msgs).as_deref(),
        Some("1")
    );
    assert!(
        listeners(monitor).await.is_empty(),
        "no listener connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_listens_on_the_clients_own_backend() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2).session());
    let monitor = cluster.monitor().await;
    let mut r = raw_client(&proxy).await;
    run_listen(&mut r, "LISTEN own").await;
    listens_on_its_own_backend(&mut r, &monitor).await;
    let outside = direct(&cluster).await;
    notify(&outside, "own", "direct").await;
    assert_eq!(next_notification(&mut r, "session mode").await.2, "direct");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psycopg2_receives_notifications_through_the_proxy() {
    let (_cluster, proxy) = start(2);
    let mut cmd = Command::new(DEBIAN_PYTHON);
    cmd.arg(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/drivers/notify_psycopg2.py"),
    )
    .arg(proxy.connect_str(APP_USER, APP_PASSWORD, APP_DB));
    let out = run_with_timeout_async(cmd, Duration::from_secs(30)).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "psycopg2 (Debian's python3-psycopg2; apt-get install -y python3-psycopg2) failed: \
         {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines,
        [
            "listening",
            "Psy Channel first pid-matches",
            "plain second pid-matches",
            "after unlisten 0",
        ],
        "{stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_reach_a_client_over_tls() {
    use crate::support::raw::{cert, client_tls, tls_via_request, write};
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let (c, k, root) = cert(&["localhost", "127.0.0.1"], false);
    write(dir.path(), "cert.pem", &c);
    write(dir.path(), "key.pem", &k);
    let cfg = write(
        dir.path(),
        "c.yaml",
        &format!(
            "tls:\n  mode: require\n  cert_file: {0}/cert.pem\n  key_file: {0}/key.pem\n",
            dir.path().display()
        ),
    );
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2).config_file(cfg));
    let mut r = tls_via_request(proxy.addr(), client_tls(&root, false))
        .await
        .expect("TLS");
    r.app_login().await;
    run_listen(&mut r, "LISTEN secure").await;
    let outside = direct(&cluster).await;
    for i in 0..50 {
        notify(&outside, "secure", &format!("over tls {i}")).await;
    }
    for i in 0..50 {
        let n = next_notification(&mut r, "a notification over TLS").await;
        assert_eq!(n.2, format!("over tls {i}"));
    }
}

/// The listener reads UTF-8: a client with another `client_encoding` listens on its own
/// backend, as before (pinned), and still gets its notifications.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latin1_client_listens_on_its_own_backend() {
    let (cluster, proxy) = start(2);
    let monitor = cluster.monitor().await;
    let mut r = Raw::tcp(proxy.addr()).await;
    r.login(0, APP_USER, APP_PASSWORD, &[("client_encoding", "LATIN1")])
        .await
        .expect("login");
    run_listen(&mut r, "LISTEN latin").await;
    listens_on_its_own_backend(&mut r, &monitor).await;
    let outside = direct(&cluster).await;
    let pid = notify(&outside, "latin", "caf\u{e9}").await;
    let n = next_notification(&mut r, "on its own backend").await;
    assert_eq!(n.0, pid);
    assert_eq!(n.1, "latin");
}

/// asyncpg (Debian's `python3-asyncpg`): 200 connections `add_listener` on a pool of 5
/// (`tests/drivers/notify_asyncpg.py` says what it checks). While they listen, Postgres sees
/// the pool and the listener connection, no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asyncpg_two_hundred_listeners_on_a_pool_of_five() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicI64, Ordering};
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

    const CLIENTS: usize = 200;
    const POOL: usize = 5;
    // The pool and the listener connection: the script's notifier goes through the proxy too.
    const MAX_BACKENDS: i64 = POOL as i64 + 1;
    let (cluster, proxy) = start(POOL);
    let monitor = cluster.monitor().await;

    let mut check = Command::new(DEBIAN_PYTHON);
    check.args(["-c", "import asyncpg"]);
    let usable = check.output().is_ok_and(|o| o.status.success());
    assert!(
        usable,
        "{DEBIAN_PYTHON} cannot import asyncpg: install Debian's python3-asyncpg \
         (apt-get install -y python3-asyncpg, as scripts/test does); this test does not skip"
    );

    let mut child = tokio::process::Command::new(DEBIAN_PYTHON)
        .arg(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/drivers/notify_asyncpg.py"),
        )
        .arg(proxy.connect_str(APP_USER, APP_PASSWORD, APP_DB))
        .arg(CLIENTS.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run the asyncpg script");
    let mut stdin = child.stdin.take().expect("stdin");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut stderr = child.stderr.take().expect("stderr");
    let stderr = tokio::spawn(async move {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s).await;
        s
    });

    // The most server connections of the app user seen at any time during the run.
    // Stopped before the cluster, also when the test fails.
    struct AbortOnDrop(tokio::task::JoinHandle<()>);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let most = Arc::new(AtomicI64::new(0));
    let sampler = {
        let monitor = cluster.monitor().await;
        let most = most.clone();
        AbortOnDrop(tokio::spawn(async move {
            loop {
                let n = monitor.backend_count(APP_DB, APP_USER).await;
                most.fetch_max(n, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }))
    };

    let first = within(
        Duration::from_secs(60),
        "the asyncpg clients to listen",
        lines.next_line(),
    )
    .await
    .expect("read stdout");
    let listening = format!("listening {CLIENTS}");
    if first.as_deref() != Some(listening.as_str()) {
        let _ = child.start_kill();
        panic!(
            "asyncpg script: {first:?} instead of {listening:?}\n{}",
            stderr.await.unwrap_or_default()
        );
    }
    let backends = monitor.backend_count(APP_DB, APP_USER).await;
    let pool = proxy.app_pool().await;
    eprintln!("{CLIENTS} asyncpg listeners: {backends} server connections of {APP_USER}");
    assert_eq!(pool["listening"], CLIENTS, "{pool}");
    assert_eq!(pool["listen_channels"], 5, "{pool}");
    assert!(
        backends <= MAX_BACKENDS,
        "{backends} server connections for {CLIENTS} listening clients on a pool of {POOL}"
    );
    assert_eq!(
        listeners(&monitor).await.len(),
        1,
        "one listener connection"
    );
    stdin.write_all(b"go\n").await.expect("write go");
    drop(stdin);

    let mut out = vec![first.unwrap_or_default()];
    while let Some(line) = within(
        Duration::from_secs(60),
        "the asyncpg script's output",
        lines.next_line(),
    )
    .await
    .expect("read stdout")
    {
        out.push(line);
    }
    let status = within(STEP, "the asyncpg script to exit", child.wait())
        .await
        .expect("wait");
    let stderr = stderr.await.unwrap_or_default();
    let stdout = out.join("\n");
    assert!(
        status.success(),
        "asyncpg script: {status}\n{stdout}\n{stderr}"
    );
    // Round 1: 200 clients on one channel and 40 on a second, 3 notifications each; round 2:
    // 50 have unlistened one channel.
    let expected = [
        "listening 200",
        "round 1 notifications 720",
        "queries 1 done",
        "unlistened 50",
        "round 2 notifications 570",
        "queries 2 done",
    ];
    assert_eq!(out[..out.len() - 1], expected, "{stdout}\n{stderr}");
    assert!(out[out.len() - 1].starts_with("ok in "), "{stdout}");

    drop(sampler);
    let most = most.load(Ordering::Relaxed);
    eprintln!("at most {most} server connections of {APP_USER} during the run");
    assert!(
        most <= MAX_BACKENDS,
        "{most} server connections at some point during the run (pool {POOL} + listener)"
    );
    proxy.assert_healthy().await;
}
