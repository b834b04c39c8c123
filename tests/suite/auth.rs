//! Client authentication: what a failed login reveals — a wrong password and an unknown user
//! are indistinguishable (also in their timing), a database's existence is not told before
//! authentication, the SCRAM server-first message does not tell which users exist (per-name
//! mock salts), an expired password on the server is a refusal too — and where users come from:
//! a SCRAM verifier copied from Postgres (the proxy logs in to Postgres by pass-through), a
//! password from a file or an environment variable, `auth_query`.
//!
//! * `backend` — authentication toward Postgres: where the backend password comes from, and
//!   which methods the proxy answers (`backend.require_auth`, issue 15, item 14).
//!
//! Malformed SCRAM messages and authentication out of order are in `protocol_faults`, TLS in
//! `tls`.

mod backend;

use std::time::{Duration, Instant};

use bytes::{BufMut, BytesMut};
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
use tokio_postgres::error::SqlState;

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::raw::{Raw, frame, oracle, startup};
use crate::support::spawned::{Spawned, spawn};
use crate::support::sql::{eventually, scalar, sqlstate};

#[tokio::test]
async fn wrong_password_and_unknown_user_are_indistinguishable() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));

    async fn attempt(proxy: &Proxy, user: &str, password: &str, db: &str) -> tokio_postgres::Error {
        match proxy
            .try_client_with(&proxy.config(user, password, db))
            .await
        {
            Ok(_) => panic!("login as {user}/{password} to {db} must fail"),
            Err(e) => e,
        }
    }
    let wrong = attempt(&proxy, APP_USER, "not-the-password", APP_DB).await;
    let unknown = attempt(&proxy, "nosuchuser", "whatever", APP_DB).await;
    for (what, err) in [("wrong password", &wrong), ("unknown user", &unknown)] {
        assert_eq!(
            err.code(),
            Some(&SqlState::INVALID_PASSWORD),
            "{what} gives 28P01: {err:?}"
        );
    }
    let text = |e: &tokio_postgres::Error, user: &str| {
        let db = e.as_db_error().expect("a server error");
        (
            db.severity().to_string(),
            db.message().replace(user, "<user>"),
        )
    };
    assert_eq!(
        text(&wrong, APP_USER),
        text(&unknown, "nosuchuser"),
        "wrong password and unknown user must look the same (apart from the echoed name)"
    );

    // The right password with an unknown database is reported after authentication.
    let err = attempt(&proxy, APP_USER, APP_PASSWORD, "nosuchdb").await;
    assert_eq!(
        err.code(),
        Some(&SqlState::INVALID_CATALOG_NAME),
        "unknown database gives 3D000: {err:?}"
    );
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b6_auth_matrix_does_not_enumerate() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let attempt = |user: &'static str, password: &'static str, db: &'static str| {
        let cfg = proxy.config(user, password, db);
        let proxy = &proxy;
        async move {
            let t = Instant::now();
            let r = proxy.try_client_with(&cfg).await;
            (
                r.err().map(|e| {
                    (
                        sqlstate(&e),
                        e.as_db_error().map(|d| d.message().to_string()),
                    )
                }),
                t.elapsed(),
            )
        }
    };
    let (unknown, _) = attempt("nosuchuser", "secret", APP_DB).await;
    let (wrong, _) = attempt(APP_USER, "wrong", APP_DB).await;
    let (empty, _) = attempt(APP_USER, "", APP_DB).await;
    let (wrong_db_bad_pw, _) = attempt(APP_USER, "wrong", "nosuchdb").await;
    let (wrong_db, _) = attempt(APP_USER, APP_PASSWORD, "nosuchdb").await;
    let unknown = unknown.expect("unknown user refused");
    let wrong = wrong.expect("wrong password refused");
    assert_eq!(unknown.0, "28P01");
    assert_eq!(
        unknown.1.as_deref().map(|m| m.replace("nosuchuser", "U")),
        wrong.1.as_deref().map(|m| m.replace(APP_USER, "U"))
    );
    assert!(empty.map(|e| e.0).is_some_and(|c| c.starts_with("28")));
    assert_eq!(
        wrong_db_bad_pw.expect("refused").0,
        "28P01",
        "db existence leaked before auth"
    );
    assert_eq!(wrong_db.expect("refused").0, "3D000");
    // Timing: unknown user and wrong password take about as long (medians, interleaved, so
    // that a busy machine does not decide).
    let (mut tu, mut tw) = (Vec::new(), Vec::new());
    for _ in 0..9 {
        tu.push(attempt("nosuchuser", "secret", APP_DB).await.1);
        tw.push(attempt(APP_USER, "wrong", APP_DB).await.1);
    }
    tu.sort();
    tw.sort();
    let ratio = tu[4].as_secs_f64() / tw[4].as_secs_f64();
    assert!(
        (0.25..4.0).contains(&ratio),
        "unknown {tu:?} vs wrong {tw:?}"
    );
    // An expired VALID UNTIL on the server is a refusal too.
    cluster.psql("ALTER ROLE app VALID UNTIL '2000-01-01'");
    let fresh = Proxy::start(&cluster, ProxyOptions::pool(1));
    let e = match fresh.try_client_with(&fresh.app_config()).await {
        Ok(_) => panic!("an expired password must be refused"),
        Err(e) => e,
    };
    assert!(sqlstate(&e).starts_with("28"), "{e:?}");
    cluster.psql("ALTER ROLE app VALID UNTIL 'infinity'");
    eventually(Duration::from_secs(10), "pool recovers", || async {
        fresh.try_client_with(&fresh.app_config()).await.is_ok()
    })
    .await;
    oracle(&fresh).await;
    let c = proxy.client().await;
    assert_eq!(scalar(&c, "SELECT 1").await, "1");
}

/// Starts a SCRAM login as `user` and stops after the server-first message; returns its
/// salt (base64, as sent) and iteration count. The connection is dropped unfinished.
async fn server_first(proxy: &Proxy, user: &str) -> (String, u32) {
    let mut c = Raw::tcp(proxy.addr()).await;
    c.send(&startup(0, &[("user", user), ("database", APP_DB)]))
        .await
        .expect("startup");
    let (tag, body) = c.recv().await.expect("auth request");
    assert_eq!(tag, b'R', "expected an authentication request for {user}");
    assert_eq!(&body[..4], &10i32.to_be_bytes(), "SASL for {user}");
    let scram = ScramSha256::new(b"wrong password", ChannelBinding::unsupported());
    let mut b = BytesMut::new();
    b.put_slice(b"SCRAM-SHA-256\0");
    b.put_i32(scram.message().len() as i32);
    b.put_slice(scram.message());
    c.send(&frame(b'p', &b)).await.expect("SASLInitialResponse");
    let (tag, body) = c.recv().await.expect("SASLContinue");
    assert_eq!(tag, b'R', "expected SASLContinue for {user}");
    assert_eq!(&body[..4], &11i32.to_be_bytes(), "SASLContinue for {user}");
    let text = std::str::from_utf8(&body[4..]).expect("server-first is text");
    // r=NONCE,s=SALT,i=ITER
    let mut salt = None;
    let mut iter = None;
    for part in text.split(',') {
        if let Some(s) = part.strip_prefix("s=") {
            salt = Some(s.to_owned());
        } else if let Some(i) = part.strip_prefix("i=") {
            iter = i.parse().ok();
        }
    }
    (
        salt.unwrap_or_else(|| panic!("no salt in {text:?}")),
        iter.unwrap_or_else(|| panic!("no iteration count in {text:?}")),
    )
}

fn salt_len(b64: &str) -> usize {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap_or_else(|e| panic!("salt {b64:?} is not base64: {e}"))
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_salt_does_not_reveal_unknown_users() {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2));
    let (ghost, ghost_iter) = server_first(&proxy, "ghost_a").await;
    let (ghost_again, _) = server_first(&proxy, "ghost_a").await;
    let (other, other_iter) = server_first(&proxy, "ghost_b").await;
    let (known, known_iter) = server_first(&proxy, APP_USER).await;
    let (known_again, _) = server_first(&proxy, APP_USER).await;
    assert_eq!(ghost, ghost_again, "an unknown user's salt is stable");
    assert_ne!(ghost, other, "two unknown users get different salts");
    assert_eq!(known, known_again, "a known user's salt is stable");
    assert_ne!(ghost, known);
    assert_eq!(salt_len(&ghost), salt_len(&known), "same salt length");
    assert_eq!(salt_len(&other), salt_len(&known));
    assert_eq!(ghost_iter, known_iter, "same iteration count");
    assert_eq!(other_iter, known_iter);
    crate::support::raw::oracle(&proxy).await;
}

/// Users known by a SCRAM verifier copied from Postgres (no password in the config): the
/// client proves itself against it and the proxy logs in to Postgres with the key it proved
/// (pass-through), on as many backend connections as it needs. Passwords also come from a
/// file or an environment variable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_known_by_its_scram_verifier_logs_in_through_pass_through() {
    let cluster = Cluster::start();
    cluster.psql_on(
        APP_DB,
        "CREATE ROLE vuser LOGIN PASSWORD 'v-pw'; CREATE ROLE fuser LOGIN PASSWORD 'f-pw'; \
         CREATE ROLE euser LOGIN PASSWORD 'e-pw'; \
         GRANT CONNECT ON DATABASE appdb TO vuser, fuser, euser",
    );
    let verifier = cluster.scram_verifier("vuser");
    let dir = tempfile::tempdir().expect("tempdir");
    let pwfile = dir.path().join("fuser.pw");
    std::fs::write(&pwfile, "f-pw\n").expect("password file");
    let config = dir.path().join("pgsluice.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nadmin:\n  listen: 127.0.0.1:0\n\
             backend:\n  host: 127.0.0.1\n  port: {}\npool:\n  size: 2\n\
             auth:\n  users:\n    - {{ name: vuser, password: \"{verifier}\" }}\n    \
             - {{ name: fuser, password_file: \"{}\" }}\n    \
             - {{ name: euser, password_env: PGSLUICE_TEST_EUSER_PASSWORD }}\n",
            cluster.addr().port(),
            pwfile.display()
        ),
    )
    .expect("write config");
    let p = spawn(
        &[("PGSLUICE_TEST_EUSER_PASSWORD", "e-pw".to_owned())],
        &["--config", &config.display().to_string()],
    );
    let connect = |user: &'static str, password: &'static str| login(&p, user, password, APP_DB);
    // Four clients, two backends: transactions take turns on connections the proxy opened
    // with the proved key.
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let c = connect("vuser", "v-pw").await.expect("vuser logs in");
        tasks.push(tokio::spawn(async move {
            for _ in 0..5 {
                let row = c
                    .query_one("SELECT current_user::text, pg_sleep(0.01)::text", &[])
                    .await?;
                assert_eq!(row.get::<_, String>(0), "vuser");
            }
            Ok::<_, tokio_postgres::Error>(())
        }));
    }
    for t in tasks {
        t.await
            .expect("join")
            .expect("every statement runs as vuser");
    }
    let e = connect("vuser", "wrong")
        .await
        .map(|_| ())
        .expect_err("wrong password");
    assert_eq!(e.code().map(|c| c.code()), Some("28P01"), "{e:?}");
    for (user, pw) in [("fuser", "f-pw"), ("euser", "e-pw")] {
        let c = connect(user, pw).await.expect("login");
        let row = c
            .query_one("SELECT current_user::text", &[])
            .await
            .expect("query");
        assert_eq!(row.get::<_, String>(0), user);
    }
    let log = p.stderr.lock().expect("log").clone();
    assert!(
        !log.contains("v-pw") && !log.contains(&verifier),
        "secrets in the log"
    );
}

/// auth_query: a user that exists only in Postgres logs in through the proxy; its verifier is
/// read through a dedicated user and a SECURITY DEFINER function (as PgBouncer's docs set
/// it up), the proxy logs in as it by pass-through; wrong passwords and unknown names get
/// the same 28P01.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_query_logs_in_a_user_that_exists_only_in_postgres() {
    let cluster = Cluster::start();
    cluster.psql_on(
        "postgres",
        "CREATE ROLE pgsluice_auth LOGIN PASSWORD 'auth-pw'; \
         CREATE ROLE only_in_pg LOGIN PASSWORD 'pg-pw'",
    );
    cluster.psql_on(
        "postgres",
        "CREATE FUNCTION public.user_lookup(i_username text, OUT uname name, OUT phash text) \
         RETURNS record AS $$ SELECT usename, passwd FROM pg_catalog.pg_shadow \
         WHERE usename = i_username $$ LANGUAGE sql SECURITY DEFINER",
    );
    cluster.psql_on(
        "postgres",
        "REVOKE ALL ON FUNCTION public.user_lookup(text) FROM public; \
         GRANT EXECUTE ON FUNCTION public.user_lookup(text) TO pgsluice_auth",
    );
    cluster.psql_on(APP_DB, "GRANT CONNECT ON DATABASE appdb TO only_in_pg");
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("pgsluice.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nadmin:\n  listen: 127.0.0.1:0\n\
             backend:\n  host: 127.0.0.1\n  port: {}\npool:\n  size: 2\n\
             auth:\n  auth_query:\n    user: pgsluice_auth\n    \
             password_env: PGSLUICE_TEST_AUTH_PASSWORD\n    \
             query: \"SELECT uname, phash FROM public.user_lookup($1)\"\n",
            cluster.addr().port()
        ),
    )
    .expect("write config");
    let p = spawn(
        &[("PGSLUICE_TEST_AUTH_PASSWORD", "auth-pw".to_owned())],
        &["--config", &config.display().to_string()],
    );
    let connect = |user: &'static str, password: &'static str| login(&p, user, password, APP_DB);
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let c = connect("only_in_pg", "pg-pw")
            .await
            .expect("only_in_pg logs in");
        tasks.push(tokio::spawn(async move {
            for _ in 0..4 {
                let row = c.query_one("SELECT current_user::text", &[]).await?;
                assert_eq!(row.get::<_, String>(0), "only_in_pg");
            }
            Ok::<_, tokio_postgres::Error>(())
        }));
    }
    for t in tasks {
        t.await
            .expect("join")
            .expect("statements run as only_in_pg");
    }
    for (user, pw) in [("only_in_pg", "wrong"), ("nobody", "pg-pw")] {
        let e = connect(user, pw).await.map(|_| ()).expect_err("refused");
        assert_eq!(e.code().map(|c| c.code()), Some("28P01"), "{user}: {e:?}");
    }
}

/// A client of the spawned proxy, logged in as `user` to `db`.
async fn login(
    p: &Spawned,
    user: &str,
    password: &str,
    db: &str,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let url = format!(
        "host={} port={} user={user} password={password} dbname={db}",
        p.listen.ip(),
        p.listen.port()
    );
    let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    Ok(c)
}
