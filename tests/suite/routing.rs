//! Where a client's statements go, with proxies started by hand (`crate::support::spawned`):
//!
//! * `backend.url` as libpq reads it: hosts tried in order (a refused one skipped), a server
//!   that does not qualify for `target_session_attrs` skipped, application_name sent, and a
//!   parameter the proxy would not act on refused by name;
//! * the `databases:` map: the name a client asks for to a server, a database name there and
//!   optionally the user it logs in as; `*` catches the rest; a reload applies a changed map;
//! * replica routing: a `route: replica` caller's reads outside a transaction run on the
//!   streaming replica unless its replay lags past `max_replica_lag_ms`; the extended
//!   protocol and read-your-writes are in `extended`.

mod extended;

use std::time::{Duration, Instant};

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::spawned::{client, get, metric, spawn};

/// The port of the server `c`'s statements run on.
async fn port(c: &tokio_postgres::Client) -> i32 {
    let row = c
        .query_one("SELECT current_setting('port')::int", &[])
        .await
        .expect("port");
    row.get::<_, i32>(0)
}

/// backend.url as libpq reads it: hosts tried in order (a refused one skipped), a server
/// that does not qualify for target_session_attrs skipped, application_name sent, and a
/// parameter the proxy would not act on refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_url_tries_its_hosts_in_order_and_skips_a_read_only_server() {
    let a = Cluster::start();
    let b = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("pgsluice.yaml");
    let url = format!(
        "postgres://{APP_USER}:{APP_PASSWORD}@127.0.0.1:1,{},{}/{APP_DB}\
         ?target_session_attrs=read-write&connect_timeout=2&application_name=via-url",
        a.addr(),
        b.addr()
    );
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nbackend:\n  url: \"{url}\"\nadmin:\n  listen: 127.0.0.1:0\n  \
             write_token: w\n"
        ),
    )
    .expect("write config");
    let cfg = config.display().to_string();
    let p = spawn(&[], &["--config", &cfg]);
    let conn_url = format!(
        "host={} port={} user={APP_USER} password={APP_PASSWORD} dbname={APP_DB}",
        p.listen.ip(),
        p.listen.port()
    );
    let (c, conn) = tokio_postgres::connect(&conn_url, tokio_postgres::NoTls)
        .await
        .expect("login");
    tokio::spawn(conn);
    assert_eq!(
        port(&c).await,
        i32::from(a.addr().port()),
        "127.0.0.1:1 refused: the next host"
    );
    let named = a.psql_on(
        APP_DB,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'via-url'",
    );
    assert!(
        named.trim() != "0",
        "the URL's application_name reached the server: {named}"
    );

    // The first server turns read-only: once the pool replaces its connections, the
    // read-write target skips it for the next host.
    // (Two calls: ALTER SYSTEM cannot run inside the implicit transaction of one.)
    a.psql_on(
        "postgres",
        "ALTER SYSTEM SET default_transaction_read_only = on",
    );
    a.psql_on("postgres", "SELECT pg_reload_conf()");
    let (ok, out, err) = tokio::task::spawn_blocking({
        let admin = p.admin.to_string();
        move || {
            client(&[
                "reconnect",
                &format!("{APP_DB}/{APP_USER}"),
                "--admin",
                &admin,
                "--token",
                "w",
            ])
        }
    })
    .await
    .expect("reconnect");
    assert!(ok, "{out}{err}");
    assert_eq!(
        port(&c).await,
        i32::from(b.addr().port()),
        "the read-only server was skipped"
    );

    // A parameter the proxy would not act on is refused by name, not dropped.
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        format!(
            "backend:\n  url: \"postgres://{APP_USER}@{}/{APP_DB}?keepalives=0\"\n",
            a.addr()
        ),
    )
    .expect("write bad config");
    let (ok, out, err) = client(&["check-config", &bad.display().to_string()]);
    assert!(!ok, "{out}");
    assert!(
        err.contains("backend.url") && err.contains("\"keepalives\" is not supported"),
        "{err}"
    );
}

/// `databases:` maps the name a client asks for to a server, a database name there and
/// optionally the user it logs in as; `*` catches the rest; without `*`, other names are
/// refused with 3D000. A reload applies a changed map.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_databases_map_routes_by_database_name() {
    let a = Cluster::start();
    let b = Cluster::start();
    b.psql_on(
        APP_DB,
        "CREATE ROLE reporter LOGIN PASSWORD 'rpw'; GRANT CONNECT ON DATABASE appdb TO reporter",
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("pgsluice.yaml");
    let write = |catch_all: bool| {
        let star = if catch_all {
            format!("  - {{ name: \"*\", url: \"postgres://{}\" }}\n", a.addr())
        } else {
            String::new()
        };
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:0\nadmin:\n  listen: 127.0.0.1:0\n  write_token: w\n\
                 auth:\n  users:\n    - {{ name: {APP_USER}, password: {APP_PASSWORD} }}\n\
                 databases:\n\
                 \x20 - {{ name: logical, url: \"postgres://{}/{APP_DB}\", pool_size: 3 }}\n\
                 \x20 - {{ name: elsewhere, url: \"postgres://reporter:rpw@{}/{APP_DB}\" }}\n\
                 {star}",
                a.addr(),
                b.addr()
            ),
        )
        .expect("write config");
    };
    write(true);
    let p = spawn(&[], &["--config", &config.display().to_string()]);
    let connect = |db: &str| {
        let url = format!(
            "host={} port={} user={APP_USER} password={APP_PASSWORD} dbname={db}",
            p.listen.ip(),
            p.listen.port()
        );
        async move {
            let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
            tokio::spawn(conn);
            Ok::<_, tokio_postgres::Error>(c)
        }
    };
    let where_ = |c: tokio_postgres::Client| async move {
        let row = c
            .query_one(
                "SELECT current_database()::text, current_setting('port')::int, current_user::text",
                &[],
            )
            .await
            .expect("where");
        (
            row.get::<_, String>(0),
            row.get::<_, i32>(1),
            row.get::<_, String>(2),
        )
    };
    let pa = i32::from(a.addr().port());
    let pb = i32::from(b.addr().port());
    let logical = connect("logical").await.expect("logical");
    assert_eq!(
        where_(logical).await,
        (APP_DB.to_owned(), pa, APP_USER.to_owned())
    );
    // The entry's user for every client of it; session settings still follow the client.
    let elsewhere = connect("elsewhere").await.expect("elsewhere");
    elsewhere
        .batch_execute("SET application_name = 'mine'")
        .await
        .expect("SET");
    for _ in 0..3 {
        let n = elsewhere
            .query_one("SELECT current_setting('application_name')", &[])
            .await
            .expect("setting");
        assert_eq!(n.get::<_, String>(0), "mine");
    }
    assert_eq!(
        where_(elsewhere).await,
        (APP_DB.to_owned(), pb, "reporter".to_owned())
    );
    let by_star = connect(APP_DB).await.expect("the * entry");
    assert_eq!(
        where_(by_star).await,
        (APP_DB.to_owned(), pa, APP_USER.to_owned())
    );
    let (status, body) = get(p.admin, "/v1/pools");
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&body).expect("pools");
    let size = v["pools"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "logical/app"))
        .map(|p| p["size"].clone());
    assert_eq!(
        size,
        Some(serde_json::json!(3)),
        "the entry's pool_size: {body}"
    );

    // Without the * entry (after a reload) other names are refused.
    write(false);
    let (ok, out, err) = tokio::task::spawn_blocking({
        let admin = p.admin.to_string();
        move || client(&["reload", "--admin", &admin, "--token", "w"])
    })
    .await
    .expect("reload");
    assert!(ok, "{out}{err}");
    let e = connect(APP_DB)
        .await
        .map(|_| ())
        .expect_err("not in the map");
    assert_eq!(e.code().map(|c| c.code()), Some("3D000"), "{e:?}");
    assert!(connect("logical").await.is_ok());
}

/// `t` on a hot standby (a built-in the classifier knows touches nothing, so the read is
/// routable; `pg_is_in_recovery()` is not on its list and would stay on the primary).
const READ_ONLY: &str = "SELECT current_setting('transaction_read_only') = 'on'";

/// Waits (at most 15 s) until `c`'s routed read runs on the standby.
async fn until_standby(c: &tokio_postgres::Client) {
    let t = Instant::now();
    loop {
        let rows = c.simple_query(READ_ONLY).await.expect("read");
        if rows.iter().any(
            |m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("t")),
        ) {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "never routed to the replica"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Replica routing: a `route: replica` caller's reads outside a transaction run on the
/// database's streaming replica, its writes and transactions on the primary, other callers'
/// reads on the primary; a replica whose replay lags past `max_replica_lag_ms` is skipped
/// until it catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_caller_reads_from_the_standby_and_writes_to_the_primary() {
    let primary = Cluster::start();
    primary.psql_on(
        APP_DB,
        &format!("CREATE TABLE notes (id serial PRIMARY KEY, v text); ALTER TABLE notes OWNER TO {APP_USER}"),
    );
    let replica = Cluster::replica_of(&primary);
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("pgsluice.yaml");
    let write = |fallback: &str| {
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:0\nadmin:\n  listen: 127.0.0.1:0\n  write_token: w\n\
                 auth:\n  users:\n    - {{ name: {APP_USER}, password: {APP_PASSWORD} }}\n\
                 databases:\n  - name: {APP_DB}\n    url: \"postgres://{}/{APP_DB}\"\n    \
                 replicas: [\"postgres://{}/{APP_DB}\"]\n    max_replica_lag_ms: 1000\n    \
                 replica_fallback: {fallback}\n\
                 callers:\n  - name: analytics\n    match: {{ application_name: analytics }}\n    \
                 route: replica\n",
                primary.addr(),
                replica.addr()
            ),
        )
        .expect("write config");
    };
    write("primary");
    let p = spawn(&[], &["--config", &config.display().to_string()]);
    let connect = |app: &str| {
        let url = format!(
            "host={} port={} user={APP_USER} password={APP_PASSWORD} dbname={APP_DB} \
             application_name={app}",
            p.listen.ip(),
            p.listen.port()
        );
        async move {
            let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .expect("login");
            tokio::spawn(conn);
            c
        }
    };
    async fn standby(c: &tokio_postgres::Client, sql: &str) -> bool {
        let rows = c.simple_query(sql).await.expect("query");
        rows.iter().any(
            |m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("t")),
        )
    }
    let analytics = connect("analytics").await;
    let web = connect("web").await;
    // The replica pool is made and probed at the first routed read; until the probe has
    // answered, reads fall back to the primary.
    until_standby(&analytics).await;
    // Writes and explicit transactions of the same caller: the primary.
    let rows = analytics
        .simple_query(
            "INSERT INTO notes (v) VALUES ('from analytics') RETURNING pg_is_in_recovery()",
        )
        .await
        .expect("the write runs on the primary");
    assert!(
        rows.iter().any(
            |m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("f"))
        )
    );
    // The replica usable again (it has replayed the insert): a text of several statements
    // is still not a read to route, whatever its strongest statement is.
    until_standby(&analytics).await;
    assert!(
        !standby(
            &analytics,
            "BEGIN; SELECT current_setting('transaction_read_only') = 'on'; COMMIT"
        )
        .await
    );
    // (Eventually: on a loaded machine a probe can time out and send a read to the primary.)
    until_standby(&analytics).await;
    // A write pipelined behind a routed read waits for that read and runs on the primary
    // (the replica's backend never sees it).
    for _ in 0..5 {
        let (read, write) = tokio::join!(
            analytics.simple_query(READ_ONLY),
            analytics.simple_query(
                "INSERT INTO notes (v) VALUES ('pipelined') \
                 RETURNING current_setting('transaction_read_only')"
            )
        );
        read.expect("the pipelined read");
        let rows = write.expect("the pipelined write runs on the primary");
        assert!(rows.iter().any(|m| matches!(m,
            tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("off"))));
    }
    // Another caller's reads: the primary.
    assert!(!standby(&web, READ_ONLY).await);
    // A ROUTE rule sends one pattern's reads to the replicas whoever the caller is.
    let (ok, out, err) = client(&["fingerprint", READ_ONLY, "--json"]);
    assert!(ok, "{err}");
    let hash = serde_json::from_str::<serde_json::Value>(&out).expect("json")["fingerprint"]
        .as_str()
        .expect("hash")
        .to_owned();
    let admin = p.admin.to_string();
    let (ok, out, err) = tokio::task::spawn_blocking(move || {
        client(&[
            "rules", "put", &hash, "--action", "route", "--route", "replica", "--admin", &admin,
            "--token", "w",
        ])
    })
    .await
    .expect("rules put");
    assert!(ok, "{out}{err}");
    until_standby(&web).await;
    assert!(
        !standby(
            &web,
            "SELECT current_setting('transaction_read_only') = 'on' AND true"
        )
        .await
    );
    let (status, body) = get(p.admin, "/v1/pools");
    assert_eq!(status, 200);
    assert!(
        body.contains("appdb/app@replica") && body.contains("\"replica_healthy\":true"),
        "{body}"
    );
    // The routed reads are counted in the replica pool's series (same database and user,
    // its own pool name), not the primary's.
    let (_, text) = get(p.admin, "/metrics");
    let replica_pool = |name: &str| {
        let labels = r#"database="appdb",pool="appdb/app@replica",user="app""#;
        metric(&text, &format!("{name}{{{labels}}}")).unwrap_or(-1.0)
    };
    assert!(replica_pool("pgsluice_pool_queries_total") >= 2.0, "{text}");
    assert!(
        replica_pool("pgsluice_pool_transactions_total") >= 2.0,
        "{text}"
    );
    let bytes = metric(
        &text,
        r#"pgsluice_pool_bytes_total{database="appdb",direction="received",pool="appdb/app@replica",user="app"}"#,
    );
    assert!(bytes.is_some_and(|b| b > 0.0), "{text}");

    // Replay paused on the standby and a write on the primary: the lag passes 1 s and reads
    // go to the primary; replay resumed, they come back.
    replica.psql_on("postgres", "SELECT pg_wal_replay_pause()");
    primary.psql_on(APP_DB, "INSERT INTO notes (v) VALUES ('while paused')");
    let t = Instant::now();
    while standby(&analytics, READ_ONLY).await {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "a lagging replica kept its reads"
        );
        primary.psql_on(APP_DB, "INSERT INTO notes (v) VALUES ('more')");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    replica.psql_on("postgres", "SELECT pg_wal_replay_resume()");
    let t = Instant::now();
    while !standby(&analytics, READ_ONLY).await {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "never back on the caught-up replica"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rows = analytics
        .simple_query("SELECT count(*) FROM notes")
        .await
        .expect("count on the replica");
    assert!(rows.iter().any(|m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0).is_some_and(|n| n != "0"))));

    // With replica_fallback: refuse, a lagging replica's reads are refused with 53400 (and a
    // retry hint) instead of running on the primary; writes still go to the primary.
    write("refuse");
    let admin = p.admin.to_string();
    let (ok, out, err) =
        tokio::task::spawn_blocking(move || client(&["reload", "--admin", &admin, "--token", "w"]))
            .await
            .expect("reload");
    assert!(ok, "{out}{err}");
    replica.psql_on("postgres", "SELECT pg_wal_replay_pause()");
    let t = Instant::now();
    let refused = loop {
        primary.psql_on(APP_DB, "INSERT INTO notes (v) VALUES ('again')");
        match analytics.simple_query(READ_ONLY).await {
            Err(e) => break e,
            Ok(_) => assert!(t.elapsed() < Duration::from_secs(15), "never refused"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        refused.code().map(|c| c.code()),
        Some("53400"),
        "{refused:?}"
    );
    assert!(
        format!("{refused:?}").contains("ERR_NO_REPLICA"),
        "{refused:?}"
    );
    analytics
        .simple_query("INSERT INTO notes (v) VALUES ('still writes')")
        .await
        .expect("writes are not routed");
    replica.psql_on("postgres", "SELECT pg_wal_replay_resume()");
}
