//! COPY through the proxy: COPY IN and COPY OUT round trips (10 000 rows with tokio-postgres,
//! and `psql`'s `\copy`), replies equal to direct PostgreSQL's, and COPY faults (TESTS.md A11):
//! a CopyFail, and a client reset in the middle of COPY IN, leave no row and a clean backend.
//!
//! * `early_data` — CopyData sent before the server's CopyInResponse (what pgx's `CopyFrom`
//!   does) reaches the server, in both pool modes.
//!
//! Drivers' own COPY paths are in `drivers`.

mod early_data;

use std::time::Duration;

use futures_util::{SinkExt, TryStreamExt};
use tokio_postgres::error::SqlState;

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::raw::{Raw, field, first_value, frame, oracle, query};
use crate::support::sql::{STEP, eventually, scalar, sqlstate};
use crate::support::wire::{Backend, WireClient};
use crate::support::{run_with_timeout_async, within};

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
async fn a11_copy_fail_and_reset_mid_copy() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(1));
    let mut c = Raw::tcp(proxy.addr()).await;
    c.app_login().await;
    c.query("CREATE TABLE copied (a int)")
        .await
        .expect("create");
    // CopyFail: 57014 "COPY from stdin failed", the session goes on.
    c.send(&query("COPY copied FROM STDIN"))
        .await
        .expect("copy");
    assert_eq!(c.recv().await.expect("CopyInResponse").0, b'G');
    let mut b = frame(b'd', b"1\n2\n");
    b.extend(frame(b'f', b"client gave up\0"));
    c.send(&b).await.expect("copy fail");
    let msgs = c.until_ready().await.expect("after CopyFail");
    let (_, body) = msgs.iter().find(|m| m.0 == b'E').expect("ErrorResponse");
    assert_eq!(field(body, b'C'), "57014");
    assert!(
        field(body, b'M').contains("COPY from stdin failed"),
        "{msgs:?}"
    );
    let msgs = c.query("SELECT count(*) FROM copied").await.expect("count");
    assert_eq!(first_value(&msgs).as_deref(), Some("0"));
    // RST in the middle of COPY IN, three times; the single backend must come back clean.
    for _ in 0..3 {
        let tcp = tokio::net::TcpStream::connect(proxy.addr())
            .await
            .expect("connect");
        socket2::SockRef::from(&tcp)
            .set_linger(Some(Duration::ZERO))
            .expect("linger");
        let mut r = Raw::over(tcp);
        r.app_login().await;
        r.send(&query("COPY copied FROM STDIN"))
            .await
            .expect("copy");
        assert_eq!(r.recv().await.expect("G").0, b'G');
        r.send(&frame(b'd', b"7\n8\n")).await.expect("data");
        drop(r);
    }
    let monitor = cluster.monitor().await;
    eventually(Duration::from_secs(10), "no COPY left running", || async {
        monitor.active_queries_like("COPY copied").await.is_empty()
    })
    .await;
    let msgs = c.query("SELECT count(*) FROM copied").await.expect("count");
    assert_eq!(
        first_value(&msgs).as_deref(),
        Some("0"),
        "no row of an aborted COPY"
    );
    oracle(&proxy).await;
}
