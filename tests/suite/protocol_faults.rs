//! Bad input from clients (TESTS.md A): malformed frames after authentication (A1, A2, A4),
//! startup packet bounds (A1, A3), authentication out of order and malformed SCRAM (A5, A6),
//! slowloris (A7: timed out, handshakes capped), every split point of a message giving the
//! same replies (A8), pathological SQL (A12). Each test ends with the universal oracle.
//!
//! COPY faults (A11) are in `copy`, oversized messages in `limits`.

use std::time::{Duration, Instant};

use crate::support::pg::{APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::raw::{
    Raw, field, first_error, first_value, frame, oracle, packet, query, startup, write,
};

/// Sends `bytes` on a logged-in connection and expects FATAL 08P01, then a close.
async fn after_auth_rejected(proxy: &Proxy, bytes: &[u8], what: &str) {
    let mut c = Raw::tcp(proxy.addr()).await;
    c.app_login().await;
    let _ = c.send(bytes).await;
    let t = Instant::now();
    let err = c.error().await;
    assert_eq!(
        err.as_ref().map(|e| e.0.as_str()),
        Some("08P01"),
        "{what}: expected 08P01, got {err:?}"
    );
    assert!(
        c.closes().await,
        "{what}: the proxy must close the connection"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "{what}: no prompt rejection"
    );
}

/// A startup-phase packet that must be refused with 08P01 (or a silent close).
async fn startup_rejected(proxy: &Proxy, bytes: &[u8], what: &str) {
    let mut c = Raw::tcp(proxy.addr()).await;
    let _ = c.send(bytes).await;
    let err = c.error().await;
    if let Some((code, msg)) = &err {
        assert_eq!(code, "08P01", "{what}: {msg}");
    }
    assert!(
        c.closes().await,
        "{what}: the proxy must close the connection"
    );
}

fn header(tag: u8, len: i32) -> Vec<u8> {
    let mut v = vec![tag];
    v.extend_from_slice(&len.to_be_bytes());
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a1_a2_a4_bad_frames_after_auth() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    // A1: lengths below 4.
    for len in [0, 3, -1, i32::MIN] {
        after_auth_rejected(&proxy, &header(b'Q', len), &format!("Query length {len}")).await;
    }
    // A2: huge claims, and a small type claiming more than its 10 000-byte limit.
    after_auth_rejected(&proxy, &header(b'Q', i32::MAX), "Query claiming 2 GiB").await;
    after_auth_rejected(&proxy, &header(b'P', 0x7FFF_FFF0), "Parse claiming 2 GiB").await;
    after_auth_rejected(&proxy, &header(b'S', 20_000), "Sync claiming 20 000").await;
    after_auth_rejected(&proxy, &header(b'E', 1 << 20), "Execute claiming 1 MiB").await;
    // A4: server-only and unknown types.
    for tag in [b'Z', b'T', 0u8] {
        after_auth_rejected(&proxy, &frame(tag, &[]), &format!("type {tag:#04x}")).await;
    }
    // A4: stray COPY messages outside COPY are ignored.
    let mut c = Raw::tcp(proxy.addr()).await;
    c.app_login().await;
    let mut stray = frame(b'd', b"1\n");
    stray.extend(frame(b'c', &[]));
    stray.extend(frame(b'f', b"nope\0"));
    stray.extend(query("SELECT 42"));
    c.send(&stray).await.expect("send");
    let msgs = c
        .until_ready()
        .await
        .expect("reply after stray COPY messages");
    assert_eq!(first_value(&msgs).as_deref(), Some("42"), "{msgs:?}");
    oracle(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a1_a3_startup_packet_bounds() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    for len in [0i32, 3, 4, 7, -1, i32::MIN, 10_001, i32::MAX] {
        startup_rejected(&proxy, &len.to_be_bytes(), &format!("startup length {len}")).await;
    }
    // Missing final NUL; odd pair count; a 64 KB database name.
    let mut body = 0x0003_0000u32.to_be_bytes().to_vec();
    body.extend_from_slice(b"user\0app\0database\0appdb\0");
    startup_rejected(&proxy, &packet(&body), "no terminator").await;
    let mut body = 0x0003_0000u32.to_be_bytes().to_vec();
    body.extend_from_slice(b"user\0app\0database\0\0junk");
    startup_rejected(&proxy, &packet(&body), "bytes after the terminator").await;
    let mut body = 0x0003_0000u32.to_be_bytes().to_vec();
    body.extend_from_slice(b"user\0app\0database\0");
    startup_rejected(&proxy, &packet(&body), "odd pair count").await;
    let big = "d".repeat(64 * 1024);
    startup_rejected(
        &proxy,
        &startup(0, &[("user", "app"), ("database", &big)]),
        "64 KB db",
    )
    .await;
    // The length word arrives, then the packet is cut short and the client leaves.
    let mut c = Raw::tcp(proxy.addr()).await;
    let _ = c.send(&100i32.to_be_bytes()).await;
    drop(c);
    // `options=-c=`: an error or a login, never a crash.
    let mut c = Raw::tcp(proxy.addr()).await;
    let r = c
        .login(0, APP_USER, APP_PASSWORD, &[("options", "-c=")])
        .await;
    if let Err(e) = &r {
        assert!(
            !e.starts_with("closed"),
            "options=-c= must get an error, not a bare close"
        );
    }
    oracle(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a5_a6_auth_order_and_malformed_scram() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let never_ok = |msgs: &[(u8, bytes::Bytes)]| {
        assert!(
            !msgs
                .iter()
                .any(|(t, b)| *t == b'R' && b.get(..4) == Some(&[0, 0, 0, 0][..])),
            "AuthenticationOk was sent"
        );
    };
    // PasswordMessage before StartupMessage.
    startup_rejected(&proxy, &frame(b'p', b"secret\0"), "password first").await;
    // Each case: startup, wait for AuthenticationSASL, then send `bytes`.
    let sasl_initial = |len: i32, data: &[u8]| {
        let mut b = b"SCRAM-SHA-256\0".to_vec();
        b.extend_from_slice(&len.to_be_bytes());
        b.extend_from_slice(data);
        frame(b'p', &b)
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("second StartupMessage", startup(0, &[("user", "postgres")])),
        (
            "SASLResponse without SASLInitialResponse",
            frame(b'p', b"c=biws,r=abc,p=xyz"),
        ),
        ("Query before auth", query("SELECT 1")),
        ("inner length 0xFFFFFFFF", sasl_initial(-1, b"n,,n=,r=abc")),
        ("inner length too long", sasl_initial(1000, b"n,,n=,r=abc")),
        (
            "10 MB client-first",
            sasl_initial(10 << 20, &vec![b'a'; 10 << 20]),
        ),
        (
            "unknown mechanism",
            frame(b'p', b"SCRAM-SHA-1\0\0\0\0\x01x"),
        ),
    ];
    for (what, bytes) in cases {
        let mut c = Raw::tcp(proxy.addr()).await;
        c.send(&startup(0, &[("user", APP_USER), ("database", "appdb")]))
            .await
            .expect("startup");
        let (tag, _) = c.recv().await.expect("auth request");
        assert_eq!(tag, b'R', "{what}");
        let _ = c.send(&bytes).await;
        let mut seen = Vec::new();
        let mut code = None;
        while let Ok(m) = c.recv().await {
            if m.0 == b'E' {
                code = Some(field(&m.1, b'C'));
            }
            seen.push(m);
        }
        never_ok(&seen);
        let code = code.unwrap_or_default();
        assert!(
            ["08P01", "28P01", "28000"].contains(&code.as_str()),
            "{what}: got {code:?}"
        );
    }
    // Client-final without r= or p=: a valid client-first, then garbage.
    for final_msg in [&b"c=biws,p=AAAA"[..], b"c=biws,r=x", b""] {
        let mut c = Raw::tcp(proxy.addr()).await;
        c.send(&startup(0, &[("user", APP_USER), ("database", "appdb")]))
            .await
            .expect("startup");
        c.recv().await.expect("auth request");
        c.send(&sasl_initial(11, b"n,,n=,r=abc"))
            .await
            .expect("first");
        let (tag, _) = c.recv().await.expect("server-first");
        assert_eq!(tag, b'R');
        c.send(&frame(b'p', final_msg)).await.expect("final");
        let err = c
            .error()
            .await
            .expect("an error for a malformed client-final");
        assert!(["08P01", "28P01"].contains(&err.0.as_str()), "{err:?}");
    }
    oracle(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a7_slowloris_is_timed_out_and_handshakes_are_capped() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = write(
        dir.path(),
        "c.yaml",
        "limits:\n  handshake_timeout_ms: 1500\n  max_handshakes: 3\n",
    );
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2).config_file(cfg));
    let mut slow = Vec::new();
    for _ in 0..3 {
        let mut c = Raw::tcp(proxy.addr()).await;
        c.send(&[0]).await.expect("first byte");
        slow.push(c);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Above the cap a real client waits for a slot — it is not refused into a retry that
    // costs a new login — and logs in once the slow ones are timed out: the cap bounds the
    // handshakes at work, never the clients.
    let mut c = Raw::tcp(proxy.addr()).await;
    let t = Instant::now();
    c.login(0, APP_USER, APP_PASSWORD, &[])
        .await
        .expect("the waiting client logs in once a slot frees");
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "it waited for the capped slots: {:?}",
        t.elapsed()
    );
    let msgs = c.query("SELECT 1").await.expect("query after login");
    assert_eq!(first_value(&msgs).as_deref(), Some("1"));
    drop(c);
    // The slow ones are closed at the handshake timeout, with 08P01.
    for mut c in slow {
        let _ = c.send(&[0, 0]).await;
        let err = c.error().await;
        assert_eq!(err.map(|e| e.0).as_deref(), Some("08P01"));
        assert!(c.closes().await);
    }
    // Truncated packet then silence: also closed by the timeout.
    let mut c = Raw::tcp(proxy.addr()).await;
    let mut partial = startup(0, &[("user", APP_USER)]);
    partial.truncate(10);
    c.send(&partial).await.expect("partial");
    let t = Instant::now();
    assert!(c.closes().await);
    assert!(t.elapsed() < Duration::from_secs(5));
    oracle(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a12_pathological_sql_through_the_proxy() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let mut c = Raw::tcp(proxy.addr()).await;
    c.app_login().await;
    // 100 000 nested parentheses: Postgres refuses (54001, or 42601 when its parser stack is
    // exhausted first); the proxy must not overflow its own stack on the way.
    let deep = format!("SELECT {}1{}", "(".repeat(100_000), ")".repeat(100_000));
    let msgs = c.query(&deep).await.expect("deep nesting answered");
    assert!(
        matches!(
            first_error(&msgs).as_deref(),
            Some("54001" | "42601") | None
        ),
        "{:?}",
        first_error(&msgs)
    );
    // A 1 MB IN list.
    let list: Vec<String> = (0..200_000).map(|i| i.to_string()).collect();
    let big = format!("SELECT 1 WHERE 77 IN ({})", list.join(","));
    assert!(big.len() > 1_000_000);
    let msgs = c.query(&big).await.expect("1 MB IN list");
    assert_eq!(
        first_value(&msgs).as_deref(),
        Some("1"),
        "{:?}",
        first_error(&msgs)
    );
    // 10 000 statements in one Query.
    let many = "SELECT 1;".repeat(10_000);
    let msgs = c.query(&many).await.expect("10k statements");
    assert_eq!(msgs.iter().filter(|m| m.0 == b'D').count(), 10_000);
    // Deep nesting in the extended protocol too.
    let mut b = frame(b'P', format!("\0{deep}\0\0\0").as_bytes());
    b.extend(frame(b'S', &[]));
    c.send(&b).await.expect("parse");
    c.until_ready().await.expect("deep Parse answered");
    oracle(&proxy).await;
}

/// The replies through two ReadyForQuery (one for the Sync, one for the Query).
async fn two_replies(c: &mut Raw) -> Vec<crate::support::raw::Msg> {
    let mut all = c.until_ready().await.expect("first ReadyForQuery");
    all.extend(c.until_ready().await.expect("second ReadyForQuery"));
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a8_every_split_point_gives_the_same_replies() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let mut c = Raw::tcp(proxy.addr()).await;
    c.app_login().await;
    let mut pipeline = frame(b'P', b"\0SELECT $1::int + 1\0\0\0");
    pipeline.extend(frame(b'B', b"\0\0\0\0\0\x01\0\0\0\x0241\0\0"));
    pipeline.extend(frame(b'E', b"\0\0\0\0\0"));
    pipeline.extend(frame(b'S', &[]));
    pipeline.extend(query("SELECT 'a;b', 2; SELECT 3"));
    c.send(&pipeline).await.expect("send");
    let expected = two_replies(&mut c).await;
    assert_eq!(first_value(&expected).as_deref(), Some("42"));
    for k in 1..pipeline.len() {
        c.send(&pipeline[..k]).await.expect("first part");
        tokio::time::sleep(Duration::from_millis(1)).await;
        c.send(&pipeline[k..]).await.expect("second part");
        let got = two_replies(&mut c).await;
        assert_eq!(got, expected, "split at byte {k}");
    }
    oracle(&proxy).await;
}
