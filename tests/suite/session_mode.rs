//! Session mode (issue 22): a client keeps one backend for its whole session and the pool stays
//! bounded, and the mode is byte-transparent — a client sees of its own session exactly what a
//! direct connection shows, protocol-level names included.
//!
//! Real drivers in session mode are in `drivers`, COPY data sent ahead of the CopyInResponse in
//! `copy::early_data`, the reset before the next client in `session_state`.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future;

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::sql::{BackendSampler, assert_pool_bound, scalar};
use crate::support::wire::{Backend, STEP, WireClient};
use crate::support::within;

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
