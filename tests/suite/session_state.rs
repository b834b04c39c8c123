//! No client ever observes another client's session state (issue 3): `SET` (with transaction
//! semantics), `SET ROLE` and `search_path`, `LISTEN`, session advisory locks, and the startup
//! parameters — application_name and the others apply on every backend a client borrows, and
//! its ParameterStatus matches direct Postgres. In transaction mode with small pools and many
//! clients, where backend sharing is the normal case, and in session mode before the next
//! client.
//!
//! * `fail_closed` — issue 15, items 1–3: whatever bytes an authenticated client sends and
//!   whenever it leaves, the next client of the pool sees a clean session.
//! * `sequences` — random sessions, each followed by the isolation oracle.
//! * `spellings` — issue 56: what a token scan was talked around by, a leftover unnamed
//!   statement, and two tenants under row-level security on one backend.
//!
//! With `PGSLUICE_TEST_DIRECT=1` the isolation assertions hold trivially (no sharing).

mod fail_closed;
mod sequences;
mod spellings;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::future;
use tokio_postgres::AsyncMessage;
use tokio_postgres::error::SqlState;

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster, OTHER_ROLE};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::sql::{
    BackendSampler, STEP, assert_pool_bound, eventually, join_all_ok, scalar, sqlstate,
};
use crate::support::wire::WireClient;
use crate::support::within;

// `sequences` starts its environment as `super::common::start`.
use crate::support::isolation as common;

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
    let differences = |through: &WireClient| -> Vec<String> {
        direct
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
            .collect()
    };
    let first = differences(&through);
    assert!(
        first.is_empty(),
        "ParameterStatus through the proxy differs from direct: {first:#?}"
    );
    // The second login with these settings is answered from what the first one learned
    // (without a backend, on the login thread): the same list.
    let again = within(
        STEP,
        "second proxied wire connect",
        WireClient::connect_with(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB, startup),
    )
    .await
    .expect("second proxied connect");
    let second = differences(&again);
    assert!(
        second.is_empty(),
        "ParameterStatus of a second login differs from direct: {second:#?}"
    );
    drop(again);
    // A login with other settings gets a list of its own, not the one remembered for these.
    let other: &[(&str, &str)] = &[("application_name", "other-app"), ("DateStyle", "German")];
    let mut lists = Vec::new();
    for (addr, what) in [(cluster.addr(), "direct"), (proxy.addr(), "proxied")] {
        let c = within(
            STEP,
            "a login with other settings",
            WireClient::connect_with(addr, APP_USER, APP_PASSWORD, APP_DB, other),
        )
        .await
        .unwrap_or_else(|e| panic!("{what} connect with other settings: {e:?}"));
        lists.push(c.params.clone());
    }
    assert_eq!(
        lists[1], lists[0],
        "ParameterStatus of a login with other settings (proxied, then direct)"
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

/// `search_path` and `current_user` of a fresh `app` session.
const DEFAULT_STATE: &str = "\"$user\", public|app";
/// One query that reveals the session state the isolation tests care about.
const STATE_SQL: &str = "SELECT current_setting('search_path') || '|' || current_user";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_search_path_and_set_role_never_reach_other_clients() {
    let cluster = Cluster::start();
    let proxy = Arc::new(Proxy::start(&cluster, ProxyOptions::pool(3)));
    let sampler = BackendSampler::start(&cluster).await;

    let a = proxy.client().await;
    assert_eq!(scalar(&a, STATE_SQL).await, DEFAULT_STATE);
    within(
        STEP,
        "A: SET search_path",
        a.batch_execute("SET search_path TO evil"),
    )
    .await
    .expect("SET search_path");
    within(
        STEP,
        "A: SET ROLE",
        a.batch_execute(&format!("SET ROLE {OTHER_ROLE}")),
    )
    .await
    .expect("SET ROLE");
    let a_state = format!("evil|{OTHER_ROLE}");

    let a_gone = Arc::new(AtomicBool::new(false));
    let observers: Vec<_> = (0..50)
        .map(|i| {
            let (proxy, a_gone) = (Arc::clone(&proxy), Arc::clone(&a_gone));
            tokio::spawn(async move {
                let client = proxy.client().await;
                let mut after = 0;
                // Observe while A is connected, then for 5 more rounds after A left.
                for round in 0.. {
                    let gone = a_gone.load(Ordering::Relaxed);
                    let state = scalar(&client, STATE_SQL).await;
                    assert_eq!(
                        state,
                        DEFAULT_STATE,
                        "observer {i} round {round} (A {}) saw another client's session state",
                        if gone { "gone" } else { "connected" }
                    );
                    if gone {
                        after += 1;
                        if after == 5 {
                            break;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        })
        .collect();

    for round in 0..40 {
        assert_eq!(
            scalar(&a, STATE_SQL).await,
            a_state,
            "A lost its own session state in round {round}"
        );
        if round % 4 == 0 {
            // Inside a multi-round-trip transaction too.
            within(STEP, "A: BEGIN", a.simple_query("BEGIN"))
                .await
                .expect("BEGIN");
            assert_eq!(
                scalar(&a, STATE_SQL).await,
                a_state,
                "A inside a transaction in round {round}"
            );
            within(STEP, "A: COMMIT", a.simple_query("COMMIT"))
                .await
                .expect("COMMIT");
        }
    }
    drop(a);
    a_gone.store(true, Ordering::Relaxed);
    join_all_ok("50 observers", Duration::from_secs(120), observers).await;

    let (max, samples) = sampler.finish().await;
    assert_pool_bound(&proxy, max, samples);
    // A fresh client after everything: still the defaults.
    let fresh = proxy.client().await;
    assert_eq!(scalar(&fresh, STATE_SQL).await, DEFAULT_STATE);
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_follows_transaction_semantics() {
    let cluster = Cluster::start();
    let proxy = Arc::new(Proxy::start(&cluster, ProxyOptions::pool(2)));
    let stop = Arc::new(AtomicBool::new(false));
    // Noise keeps both backends busy so A moves between them.
    let noise: Vec<_> = (0..6)
        .map(|i| {
            let (proxy, stop) = (Arc::clone(&proxy), Arc::clone(&stop));
            tokio::spawn(async move {
                let client = proxy.client().await;
                while !stop.load(Ordering::Relaxed) {
                    assert_eq!(
                        scalar(&client, STATE_SQL).await,
                        DEFAULT_STATE,
                        "noise client {i} saw A's state"
                    );
                }
            })
        })
        .collect();

    let a = proxy.client().await;
    let show = |expected: &'static str, why: &'static str| {
        let a = &a;
        async move {
            for round in 0..10 {
                assert_eq!(
                    scalar(a, "SHOW search_path").await,
                    expected,
                    "{why} (round {round})"
                );
            }
        }
    };
    within(STEP, "SET", a.batch_execute("SET search_path TO a1"))
        .await
        .expect("SET");
    show("a1", "a session SET persists").await;

    within(
        STEP,
        "rolled-back SET",
        a.batch_execute("BEGIN; SET search_path TO x; ROLLBACK"),
    )
    .await
    .expect("rollback");
    show(
        "a1",
        "a SET inside a rolled-back transaction must not persist",
    )
    .await;

    within(
        STEP,
        "SET LOCAL",
        a.batch_execute("BEGIN; SET LOCAL search_path TO local_only; COMMIT"),
    )
    .await
    .expect("local");
    show("a1", "SET LOCAL ends with its transaction").await;

    within(
        STEP,
        "committed SET",
        a.batch_execute("BEGIN; SET search_path TO y; COMMIT"),
    )
    .await
    .expect("commit");
    show("y", "a SET inside a committed transaction persists").await;

    // A failed transaction rolls its SETs back too.
    let err = within(
        STEP,
        "failed tx",
        a.batch_execute("BEGIN; SET search_path TO z; SELECT 1/0"),
    )
    .await
    .expect_err("1/0");
    assert_eq!(sqlstate(&err), SqlState::DIVISION_BY_ZERO.code());
    within(STEP, "ROLLBACK", a.batch_execute("ROLLBACK"))
        .await
        .expect("rollback");
    show(
        "y",
        "a SET inside a failed, rolled-back transaction must not persist",
    )
    .await;

    within(
        STEP,
        "set_config",
        a.simple_query("SELECT set_config('search_path', 'via_set_config', false)"),
    )
    .await
    .expect("set_config");
    show(
        "via_set_config",
        "set_config(..., false) is a session-level SET",
    )
    .await;

    within(STEP, "RESET", a.batch_execute("RESET search_path"))
        .await
        .expect("RESET");
    show("\"$user\", public", "RESET restores the default").await;

    stop.store(true, Ordering::Relaxed);
    join_all_ok("noise clients", Duration::from_secs(60), noise).await;
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_is_private_to_its_client_and_cleaned_up_after_it_leaves() {
    let cluster = Cluster::start();
    let proxy = Arc::new(Proxy::start(&cluster, ProxyOptions::pool(3)));

    let (listener, mut inbox, listener_task) =
        proxy.client_with_messages(&proxy.app_config()).await;
    within(
        STEP,
        "LISTEN",
        listener.batch_execute("LISTEN pgsluice_chan"),
    )
    .await
    .expect("LISTEN");

    // Bystanders run traffic on the shared backends and record any notification they get.
    let stop = Arc::new(AtomicBool::new(false));
    let bystanders: Vec<_> = (0..10)
        .map(|i| {
            let (proxy, stop) = (Arc::clone(&proxy), Arc::clone(&stop));
            tokio::spawn(async move {
                let (client, mut inbox, _task) =
                    proxy.client_with_messages(&proxy.app_config()).await;
                let mut received = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    scalar(&client, "SELECT 1").await;
                    while let Ok(m) = inbox.try_recv() {
                        if let AsyncMessage::Notification(n) = m {
                            received.push(format!(
                                "bystander {i} got {}: {}",
                                n.channel(),
                                n.payload()
                            ));
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                received
            })
        })
        .collect();

    let notifier = proxy.client().await;
    for n in 0..3 {
        within(
            STEP,
            "NOTIFY",
            notifier.batch_execute(&format!("NOTIFY pgsluice_chan, 'hello {n}'")),
        )
        .await
        .expect("NOTIFY");
        let payload = within(
            Duration::from_secs(5),
            "the listener's notification",
            async {
                loop {
                    match inbox.recv().await {
                        Some(AsyncMessage::Notification(n)) => break n.payload().to_string(),
                        Some(_) => {}
                        None => panic!("the listener's connection ended"),
                    }
                }
            },
        )
        .await;
        assert_eq!(payload, format!("hello {n}"));
        // Interleave listener traffic: it must stay subscribed across its own transactions.
        // Through the proxy the channel is held by the pool's listener connection, not by the
        // pooled backend the query runs on (docs/OPERATIONS.md, LISTEN/NOTIFY).
        assert_eq!(
            scalar(&listener, "SELECT count(*) FROM pg_listening_channels()").await,
            if proxy.is_direct() { "1" } else { "0" }
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The listener leaves; afterwards nobody is subscribed on any pooled backend.
    drop(listener);
    let _ = within(STEP, "the listener's connection to close", listener_task).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    within(
        STEP,
        "NOTIFY after the listener left",
        notifier.batch_execute("NOTIFY pgsluice_chan, 'orphan'"),
    )
    .await
    .expect("NOTIFY");
    let checkers: Vec<_> = (0..20)
        .map(|i| {
            let proxy = Arc::clone(&proxy);
            tokio::spawn(async move {
                let client = proxy.client().await;
                for round in 0..5 {
                    let channels =
                        scalar(&client, "SELECT count(*) FROM pg_listening_channels()").await;
                    assert_eq!(
                        channels, "0",
                        "checker {i} round {round}: a pooled backend still LISTENs"
                    );
                }
            })
        })
        .collect();
    join_all_ok(
        "20 pg_listening_channels checkers",
        Duration::from_secs(60),
        checkers,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::Relaxed);
    let received: Vec<String> = join_all_ok("bystanders", Duration::from_secs(60), bystanders)
        .await
        .concat();
    assert!(
        received.is_empty(),
        "notifications reached clients that never LISTENed: {received:?}"
    );
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_advisory_lock_is_released_when_its_client_leaves() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let holder = proxy.client().await;
    assert_eq!(
        scalar(&holder, "SELECT pg_try_advisory_lock(4242)").await,
        "t"
    );
    let other = proxy.client().await;
    for _ in 0..5 {
        assert_eq!(
            scalar(&other, "SELECT pg_try_advisory_lock(4242)").await,
            "f",
            "the lock belongs to the holder while it is connected"
        );
        // The holder still owns it across its own later transactions.
        assert_eq!(
            scalar(&holder, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 4242 AND pid = pg_backend_pid()")
                .await,
            "1",
            "the holder must keep its backend (and lock) while connected"
        );
    }
    drop(holder);
    eventually(
        Duration::from_secs(5),
        "the advisory lock to be released after its client left",
        || async { scalar(&other, "SELECT pg_try_advisory_lock(4242)").await == "t" },
    )
    .await;
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_resets_state_before_the_next_client() {
    let cluster = Cluster::start();
    // One backend in session mode: the next client gets exactly the backend A dirtied.
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(1).session());
    {
        let a = proxy.client().await;
        within(
            STEP,
            "A dirties its session",
            a.batch_execute(&format!(
                "SET search_path TO evil; SET ROLE {OTHER_ROLE}; LISTEN leftover; \
                 SELECT pg_advisory_lock(77); PREPARE leftover_stmt AS SELECT 1"
            )),
        )
        .await
        .expect("dirty the session");
        assert_eq!(scalar(&a, STATE_SQL).await, format!("evil|{OTHER_ROLE}"));
    }
    let b = within(STEP, "B connects after A left", proxy.client()).await;
    assert_eq!(
        scalar(&b, STATE_SQL).await,
        DEFAULT_STATE,
        "B inherited A's SET/SET ROLE"
    );
    assert_eq!(
        scalar(&b, "SELECT count(*) FROM pg_listening_channels()").await,
        "0",
        "B inherited A's LISTEN"
    );
    // A backend that was discarded rather than reset releases the lock when it exits, which
    // is asynchronous; give that a moment.
    eventually(
        Duration::from_secs(5),
        "A's advisory lock to be released after A left",
        || async { scalar(&b, "SELECT pg_try_advisory_lock(77)").await == "t" },
    )
    .await;
    assert_eq!(
        scalar(
            &b,
            "SELECT count(*) FROM pg_prepared_statements WHERE name = 'leftover_stmt'"
        )
        .await,
        "0",
        "B sees A's SQL-level PREPARE"
    );
    // Session mode with one backend: B must leave before the health check can connect.
    drop(b);
    proxy.assert_healthy().await;
}
