//! COPY data sent ahead of the server's CopyInResponse must reach it in both pool modes
//! (issue 22).
//!
//! This is what pgx's `CopyFrom` does: it writes `COPY … FROM STDIN` and starts streaming
//! CopyData at once, without waiting for the CopyInResponse. A proxy that forwards CopyData
//! only once it has seen the server enter COPY drops the first frames, and then the server
//! waits for data in `ClientRead` while the client waits for the proxy.

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::wire::{Backend, STEP, WireClient};
use crate::support::within;

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
