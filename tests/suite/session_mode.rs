//! Session mode must be byte-transparent (issue 22), and COPY data sent ahead of the server's
//! CopyInResponse must reach it in both pool modes.
//!
//! The COPY case is what pgx's `CopyFrom` does: it writes `COPY … FROM STDIN` and starts
//! streaming CopyData at once, without waiting for the CopyInResponse. A proxy that forwards
//! CopyData only once it has seen the server enter COPY drops the first frames, and then
//! the server waits for data in `ClientRead` while the client waits for the proxy.

use std::time::Duration;

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::wire::{Backend, WireClient};
use crate::support::within;

const STEP: Duration = Duration::from_secs(20);

/// CopyData frames of a binary COPY of one int4 column with `rows` rows (header, tuples,
/// trailer), one frame per row like a streaming driver.
fn binary_copy(rows: std::ops::Range<i32>) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    let mut header = b"PGCOPY\n\xff\r\n\0".to_vec();
    header.extend_from_slice(&0i32.to_be_bytes());
    header.extend_from_slice(&0i32.to_be_bytes());
    frames.push(header);
    for v in rows {
        let mut t = Vec::new();
        t.extend_from_slice(&1i16.to_be_bytes());
        t.extend_from_slice(&4i32.to_be_bytes());
        t.extend_from_slice(&v.to_be_bytes());
        frames.push(t);
    }
    frames.push((-1i16).to_be_bytes().to_vec());
    frames
}

/// One session: a transaction, a pipelined batch of 100 INSERTs, then COPY … FROM STDIN
/// (simple or extended protocol, text or binary) with its data and CopyDone written at once,
/// then COMMIT. `split` cuts the COPY write in two at that byte.
async fn copy_session(proxy: &Proxy, extended: bool, binary: bool, split: Option<usize>) -> usize {
    let mut c = WireClient::connect(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB)
        .await
        .expect("connect");
    c.simple("BEGIN").await.expect("BEGIN");
    for i in 0..100 {
        c.parse("", "INSERT INTO copied VALUES ($1)")
            .bind("", "", &[Some(&(-i - 1).to_string())])
            .execute("", 0);
    }
    c.sync();
    c.send().await.expect("send the batch");
    let sql = if binary {
        "COPY copied (v) FROM STDIN (FORMAT binary)"
    } else {
        "COPY copied (v) FROM STDIN"
    };
    if extended {
        c.parse("", sql).bind("", "", &[]).execute("", 0);
    } else {
        c.query(sql);
    }
    let frames: Vec<Vec<u8>> = if binary {
        binary_copy(0..20)
    } else {
        (0..20).map(|v| format!("{v}\n").into_bytes()).collect()
    };
    for f in &frames {
        c.message(b'd', f);
    }
    c.message(b'c', b"");
    if extended {
        c.sync();
    }
    let len = c.pending();
    match split {
        Some(at) => {
            c.send_split(at).await.expect("send the COPY in two writes");
        }
        None => c.send().await.expect("send the COPY"),
    }
    let what = format!("COPY (extended {extended}, binary {binary}, split {split:?})");
    // The batch's ReadyForQuery, then the COPY's.
    for step in ["the INSERT batch", "the COPY"] {
        let replies = within(STEP, &format!("{what}: {step}"), c.until_ready())
            .await
            .unwrap_or_else(|e| panic!("{what}: {step}: {e}"));
        assert!(
            replies.iter().all(|m| m.error_code().is_none()),
            "{what}: {step}: {replies:?}"
        );
        if step == "the COPY" {
            assert!(
                replies.contains(&Backend::CommandComplete("COPY 20".into())),
                "{what}: {replies:?}"
            );
        }
    }
    c.simple("COMMIT").await.expect("COMMIT");
    len
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_data_sent_before_copy_in_response_reaches_the_server() {
    let cluster = Cluster::start();
    cluster.psql_on(
        APP_DB,
        &format!("CREATE TABLE copied (v int); ALTER TABLE copied OWNER TO {APP_USER};"),
    );
    let mut sessions = 0;
    for session in [false, true] {
        let options = if session {
            ProxyOptions::pool(2).session()
        } else {
            ProxyOptions::pool(2)
        };
        let proxy = Proxy::start(&cluster, options);
        let mut len = 0;
        for extended in [false, true] {
            for binary in [false, true] {
                len = copy_session(&proxy, extended, binary, None).await;
            }
        }
        // The extended binary COPY cut in two writes at every byte (the proxy sees every
        // partial frame there is).
        for at in 1..len {
            copy_session(&proxy, true, true, Some(at)).await;
        }
        sessions += 4 + len - 1;
        proxy.assert_healthy().await;
    }
    let su = cluster.superuser_client(APP_DB).await;
    let rows = su
        .query_one("SELECT count(*) FROM copied WHERE v >= 0", &[])
        .await
        .expect("count");
    let n: i64 = rows.get(0);
    assert_eq!(n, sessions as i64 * 20, "20 rows from each COPY");
}

/// Everything a client can see of its own session, run over one connection at `addr`;
/// returns the observations in order, so a direct connection and the proxy can be compared.
async fn observe_session(addr: std::net::SocketAddr) -> Vec<String> {
    let mut c = WireClient::connect(addr, APP_USER, APP_PASSWORD, APP_DB)
        .await
        .expect("connect");
    let mut seen = Vec::new();
    let q = async |c: &mut WireClient, sql: &str| -> String {
        match within(STEP, sql, c.simple(sql)).await {
            Ok(rows) => rows
                .into_iter()
                .map(|v| v.unwrap_or_else(|| "NULL".into()))
                .collect::<Vec<_>>()
                .join(","),
            Err(e) => format!("error {}", &e[..5.min(e.len())]),
        }
    };
    // A statement prepared with the protocol keeps its name.
    c.parse("s1", "SELECT $1::int + 1").sync();
    c.send().await.expect("send Parse");
    let replies = c.until_ready().await.expect("Parse");
    assert!(
        replies.iter().all(|m| m.error_code().is_none()),
        "{replies:?}"
    );
    let pid = q(&mut c, "SELECT pg_backend_pid()").await;
    seen.push(
        q(
            &mut c,
            "SELECT name FROM pg_prepared_statements ORDER BY name",
        )
        .await,
    );
    seen.push(q(&mut c, "EXECUTE s1(41)").await);
    c.bind("", "s1", &[Some("1")]).execute("", 0).sync();
    c.send().await.expect("send Bind");
    let replies = c.until_ready().await.expect("Bind");
    seen.push(format!(
        "{:?}",
        crate::support::wire::first_column(&replies)
    ));
    seen.push(q(&mut c, "DEALLOCATE s1").await);
    seen.push(q(&mut c, "SELECT count(*) FROM pg_prepared_statements").await);
    // Settings, temp tables, advisory locks and LISTEN stay with the session.
    q(&mut c, "SET work_mem = '7MB'").await;
    q(
        &mut c,
        "CREATE TEMP TABLE tt (a int); INSERT INTO tt VALUES (1)",
    )
    .await;
    q(&mut c, "SELECT pg_advisory_lock(5)").await;
    q(&mut c, "LISTEN ch").await;
    for _ in 0..3 {
        q(&mut c, "BEGIN; SELECT 1; COMMIT").await;
    }
    seen.push(q(&mut c, "SHOW work_mem").await);
    seen.push(q(&mut c, "SELECT count(*) FROM tt").await);
    seen.push(
        q(
            &mut c,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
        )
        .await,
    );
    c.query("NOTIFY ch, 'hi'");
    c.send().await.expect("send NOTIFY");
    let replies = c.until_ready().await.expect("NOTIFY");
    seen.push(format!(
        "notified: {}",
        replies
            .iter()
            .any(|m| matches!(m, Backend::Notification { payload, .. } if payload == "hi"))
    ));
    // COPY out.
    c.query("COPY (SELECT 7) TO STDOUT");
    c.send().await.expect("send COPY");
    let replies = c.until_ready().await.expect("COPY out");
    seen.push(format!(
        "copy out: {}",
        replies.contains(&Backend::CopyData(b"7\n".to_vec()))
    ));
    // COPY in every format, both directions.
    for format in ["text", "csv", "binary"] {
        c.query(&format!(
            "COPY (SELECT g, 'x' || g FROM generate_series(1, 3) g) TO STDOUT (FORMAT {format})"
        ));
        c.send().await.expect("send COPY out");
        let replies = c.until_ready().await.expect("COPY out");
        let data: Vec<u8> = replies
            .iter()
            .filter_map(|m| match m {
                Backend::CopyData(d) => Some(d.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        seen.push(format!(
            "copy out {format}: {} bytes {:?}",
            data.len(),
            &data[..data.len().min(12)]
        ));
        // And the same bytes back in.
        q(&mut c, "CREATE TEMP TABLE back (a int, b text)").await;
        c.query(&format!("COPY back FROM STDIN (FORMAT {format})"));
        c.message(b'd', &data).message(b'c', b"");
        c.send().await.expect("send COPY in");
        let replies = c.until_ready().await.expect("COPY in");
        seen.push(format!(
            "copy in {format}: {:?}",
            replies
                .iter()
                .find(|m| matches!(m, Backend::CommandComplete(_) | Backend::Error { .. }))
        ));
        seen.push(
            q(
                &mut c,
                "SELECT string_agg(a || b, ',' ORDER BY a) FROM back",
            )
            .await,
        );
        q(&mut c, "DROP TABLE back").await;
    }
    // A cancel with the key this connection was given stops its query.
    let (key_pid, key) = c.key.clone().expect("BackendKeyData");
    c.query("SELECT pg_sleep(5)");
    c.send().await.expect("send sleep");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut cancel = 80_877_102u32.to_be_bytes().to_vec();
    cancel.extend_from_slice(&key_pid.to_be_bytes());
    cancel.extend_from_slice(&key);
    let mut packet = ((cancel.len() + 4) as u32).to_be_bytes().to_vec();
    packet.extend_from_slice(&cancel);
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("cancel connect");
    tokio::io::AsyncWriteExt::write_all(&mut s, &packet)
        .await
        .expect("send the cancel");
    let replies = within(STEP, "the cancelled sleep", c.until_ready())
        .await
        .expect("sleep reply");
    seen.push(format!(
        "cancelled: {:?}",
        replies.iter().find_map(Backend::error_code)
    ));
    // The same backend all along.
    seen.push(format!(
        "same backend: {}",
        q(&mut c, "SELECT pg_backend_pid()").await == pid
    ));
    seen
}

/// Session mode is byte-transparent for what a client sees of its own session: the same
/// observations directly and through the proxy, protocol-level names included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_shows_what_a_direct_connection_shows() {
    let cluster = Cluster::start();
    let direct = observe_session(cluster.addr()).await;
    assert_eq!(
        direct,
        [
            "s1",
            "42",
            "[Some(\"2\")]",
            "",
            "0",
            "7MB",
            "1",
            "1",
            "notified: true",
            "copy out: true",
            "copy out text: 15 bytes [49, 9, 120, 49, 10, 50, 9, 120, 50, 10, 51, 9]",
            "copy in text: Some(CommandComplete(\"COPY 3\"))",
            "1x1,2x2,3x3",
            "copy out csv: 15 bytes [49, 44, 120, 49, 10, 50, 44, 120, 50, 10, 51, 44]",
            "copy in csv: Some(CommandComplete(\"COPY 3\"))",
            "1x1,2x2,3x3",
            "copy out binary: 69 bytes [80, 71, 67, 79, 80, 89, 10, 255, 13, 10, 0, 0]",
            "copy in binary: Some(CommandComplete(\"COPY 3\"))",
            "1x1,2x2,3x3",
            "cancelled: Some(\"57014\")",
            "same backend: true"
        ],
        "the reference (direct Postgres)"
    );
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2).session());
    if proxy.is_direct() {
        return;
    }
    assert_eq!(
        observe_session(proxy.addr()).await,
        direct,
        "through the proxy"
    );
    proxy.assert_healthy().await;
}

/// Transaction mode renames protocol-level statements for sharing: SQL EXECUTE/DEALLOCATE of
/// such a name is refused with a clear 0A000, never run against something else; the protocol
/// path keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_mode_refuses_sql_execute_of_protocol_names() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    if proxy.is_direct() {
        return;
    }
    let mut c = WireClient::connect(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB)
        .await
        .expect("connect");
    c.parse("s1", "SELECT $1::int + 1").sync();
    c.send().await.expect("send Parse");
    c.until_ready().await.expect("Parse");
    for sql in ["EXECUTE s1(1)", "/* x */ DEALLOCATE PREPARE \"s1\""] {
        let e = c.simple(sql).await.expect_err(sql);
        assert!(
            e.starts_with("0A000") && e.contains("extended protocol"),
            "{sql}: {e}"
        );
    }
    // Inside a transaction, the refusal aborts it like any error.
    c.simple("BEGIN").await.expect("BEGIN");
    assert!(c.simple("EXECUTE s1(1)").await.is_err());
    let e = c.simple("SELECT 1").await.expect_err("aborted");
    assert!(e.starts_with("25P02"), "{e}");
    c.simple("ROLLBACK").await.expect("ROLLBACK");
    c.bind("", "s1", &[Some("41")]).execute("", 0).sync();
    c.send().await.expect("send Bind");
    let replies = c.until_ready().await.expect("Bind");
    assert_eq!(
        crate::support::wire::first_column(&replies),
        [Some("42".into())]
    );
    // A name the client never prepared goes to Postgres, which says it does not exist.
    let e = c.simple("EXECUTE nope").await.expect_err("unknown name");
    assert!(e.starts_with("26000"), "{e}");
    proxy.assert_healthy().await;
}
