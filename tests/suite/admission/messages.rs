//! Issue 15, item 6: everything that can run SQL is admitted — a FunctionCall message and a
//! Bind of a name the proxy never saw prepared go through the fingerprint rules like any
//! statement.

use crate::support::isolation::start;
use crate::support::note_skipped;
use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER};
use crate::support::wire::{Backend, WireClient, function_call};

fn fp(text: &str) -> String {
    format!("{:016x}", pgsluice::classify::fingerprint(text))
}

/// Item 6: a FunctionCall message and a Bind of a name the proxy never saw prepared go
/// through the fingerprint rules like any statement (here: blocked by a REJECT rule).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn function_calls_and_unknown_binds_pass_admission() {
    let dir = tempfile::tempdir().expect("rules dir");
    let rules = dir.path().join("rules.json");
    std::fs::write(
        &rules,
        format!(
            r#"{{"version": 1, "rules": [
  {{"fingerprint": "{}", "created_unix_ms": 0, "rule": {{"action": "REJECT"}}}},
  {{"fingerprint": "{}", "created_unix_ms": 0, "rule": {{"action": "REJECT"}}}}
]}}"#,
            fp("/* FunctionCall message */"),
            fp("/* Bind of an unknown prepared statement */")
        ),
    )
    .expect("write rules");
    let env = start(
        2,
        &format!("admin:\n  rules_file: {}\n", rules.display()),
        |_| {},
    );
    if env.proxy.is_direct() {
        note_skipped("admission (direct mode has none)");
        return;
    }
    let mut c = WireClient::connect(env.proxy.addr(), APP_USER, APP_PASSWORD, APP_DB)
        .await
        .expect("wire client");
    let oid: u32 = c
        .simple("SELECT 'pg_catalog.pg_backend_pid()'::regprocedure::oid")
        .await
        .expect("oid")[0]
        .as_deref()
        .and_then(|s| s.parse().ok())
        .expect("numeric oid");
    c.message(b'F', &function_call(oid, &[]));
    c.send().await.expect("send F");
    let replies = c.until_ready().await.expect("F reply");
    let err = replies.iter().find_map(|m| match m {
        Backend::Error { code, message } => Some((code.clone(), message.clone())),
        _ => None,
    });
    let (code, message) = err.expect("the FunctionCall must be refused by its rule");
    assert_eq!(code, "53400");
    assert!(message.contains("ERR_QUERY_BLOCKED"), "{message}");

    // An SQL-level PREPARE (pins this client to its backend), then a protocol Bind of it.
    c.simple("PREPARE s AS SELECT 42").await.expect("PREPARE");
    c.bind("", "s", &[]).execute("", 0).sync();
    c.send().await.expect("send Bind");
    let replies = c.until_ready().await.expect("Bind reply");
    assert_eq!(
        replies.iter().find_map(Backend::error_code),
        Some("53400"),
        "a Bind of an unknown name must be admitted (and here refused): {replies:?}"
    );
    // Ordinary statements are untouched by those rules.
    assert_eq!(
        c.simple("SELECT 7").await.expect("SELECT"),
        [Some("7".into())]
    );
    env.proxy.assert_healthy().await;
}
