//! Idle clients (issue 17), against a real PostgreSQL: a client idle inside its transaction
//! past its caller's `idle_transaction_timeout_ms` is disconnected with FATAL 25P03, its
//! transaction rolled back and its backend returned (a critical caller without the limit keeps
//! its transaction); `limits.client_idle_timeout_ms` ends a client idle between transactions
//! with FATAL 57P05 (never one that works or sits inside a transaction).
//!
//! With `PGSLUICE_TEST_DIRECT=1` these tests are skipped (they are about the proxy).

use std::time::{Duration, Instant};

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER};
use crate::support::proxy::client;
use crate::support::sql::{STEP, scalar};
use crate::support::storm::start;
use crate::support::wire::{Backend, WireClient};
use crate::support::within;

const IDLE_YAML: &str = "\
global_defaults:
  idle_transaction_timeout_ms: 400
callers:
  - name: payment
    priority: critical
    idle_transaction_timeout_ms: 0
    match: { application_name: payment }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_idle_in_its_transaction_is_ended_and_its_backend_returned() {
    let Some(env) = start(1, IDLE_YAML) else {
        return;
    };
    let proxy = &env.proxy;
    // A default-caller client takes a row lock inside a transaction and goes quiet.
    let mut idle = WireClient::connect(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB)
        .await
        .expect("wire client");
    idle.simple("BEGIN").await.expect("BEGIN");
    idle.simple("UPDATE acct SET v = 42 WHERE id = 1")
        .await
        .expect("UPDATE");
    let quiet = Instant::now();
    let fatal = within(
        Duration::from_secs(10),
        "the idle-in-transaction FATAL",
        idle.recv(),
    )
    .await
    .expect("an ErrorResponse before the connection closes");
    let waited = quiet.elapsed();
    assert_eq!(fatal.error_code(), Some("25P03"), "{fatal:?}");
    assert!(
        waited >= Duration::from_millis(350) && waited < Duration::from_secs(4),
        "ended after its 400 ms, not before and not much later: {waited:?}"
    );
    if let Backend::Error { message, .. } = &fatal {
        assert!(message.contains("idle-in-transaction timeout"), "{message}");
    }
    assert!(
        idle.recv().await.is_err(),
        "the connection is closed after the FATAL"
    );

    // The only backend came back, rolled back: the lock is free and the update is gone.
    let other = client(proxy, "web").await;
    let t = Instant::now();
    let v = within(
        STEP,
        "the row the idle client locked",
        other.simple_query("UPDATE acct SET v = v + 1 WHERE id = 1 RETURNING v"),
    )
    .await
    .expect("the row is free again");
    let v = crate::support::sql::simple_values(&v);
    assert_eq!(
        v,
        vec![Some("1".to_owned())],
        "the idle client's update was rolled back"
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());

    // A critical caller with the limit turned off keeps its transaction open across a pause.
    let payment = client(proxy, "payment").await;
    within(STEP, "BEGIN", payment.batch_execute("BEGIN; SELECT 1"))
        .await
        .expect("BEGIN");
    tokio::time::sleep(Duration::from_millis(900)).await;
    within(
        STEP,
        "COMMIT",
        payment.batch_execute("UPDATE acct SET v = 7; COMMIT"),
    )
    .await
    .expect("the critical transaction survives the pause");
    assert_eq!(scalar(&other, "SELECT v FROM acct").await, "7");
    proxy.assert_healthy().await;
}

const CLIENT_IDLE_YAML: &str = "\
limits:
  client_idle_timeout_ms: 400
";

/// Waits for the 57P05 FATAL of `limits.client_idle_timeout_ms` and the close after it;
/// returns how long the client had been quiet.
async fn ended_for_idling(c: &mut WireClient, quiet: Instant) -> Duration {
    let fatal = within(Duration::from_secs(10), "the idle-session FATAL", c.recv())
        .await
        .expect("an ErrorResponse before the connection closes");
    let waited = quiet.elapsed();
    assert_eq!(fatal.error_code(), Some("57P05"), "{fatal:?}");
    if let Backend::Error { message, .. } = &fatal {
        assert!(message.contains("idle-session timeout"), "{message}");
    }
    assert!(
        c.recv().await.is_err(),
        "the connection is closed after the FATAL"
    );
    waited
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_idle_between_transactions_is_ended_but_not_one_that_works_or_is_in_a_transaction()
{
    let Some(env) = start(1, CLIENT_IDLE_YAML) else {
        return;
    };
    let proxy = &env.proxy;
    let connect = || WireClient::connect(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB);

    // Logged in and never said a word.
    let mut silent = connect().await.expect("wire client");
    let waited = ended_for_idling(&mut silent, Instant::now()).await;
    assert!(
        waited >= Duration::from_millis(350) && waited < Duration::from_secs(4),
        "ended after its 400 ms, not before and not much later: {waited:?}"
    );

    // Ran a statement, then went quiet: the clock starts at the answer.
    let mut quiet = connect().await.expect("wire client");
    quiet.simple("SELECT 1").await.expect("SELECT 1");
    let waited = ended_for_idling(&mut quiet, Instant::now()).await;
    assert!(waited >= Duration::from_millis(350), "{waited:?}");

    // A client that keeps working is never idle for 400 ms.
    let mut busy = connect().await.expect("wire client");
    for _ in 0..6 {
        busy.simple("SELECT 1")
            .await
            .expect("a working client stays");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Inside a transaction the idle-in-transaction limit applies (off here), not this one.
    let mut in_txn = connect().await.expect("wire client");
    in_txn.simple("BEGIN").await.expect("BEGIN");
    in_txn
        .simple("UPDATE acct SET v = 3 WHERE id = 1")
        .await
        .expect("UPDATE");
    tokio::time::sleep(Duration::from_millis(900)).await;
    in_txn
        .simple("COMMIT")
        .await
        .expect("the transaction survives a pause longer than the idle-client limit");
    // ... and once it is over, the client-idle clock runs again.
    let waited = ended_for_idling(&mut in_txn, Instant::now()).await;
    assert!(waited >= Duration::from_millis(350), "{waited:?}");
    drop(busy);
    proxy.assert_healthy().await;
}
