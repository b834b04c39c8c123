//! Tests of the test harness itself (`crate::support`): the throwaway cluster, its cleanup, the
//! binary search and its install advice, and the raw wire client — all against PostgreSQL
//! directly, so a harness bug is told apart from a proxy bug.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, BinSearch, Cluster, SUPERUSER};
use crate::support::wire::WireClient;
use crate::support::within;

const STEP: Duration = Duration::from_secs(15);

#[test]
fn missing_server_binaries_fail_with_install_advice() {
    let empty = tempfile::tempdir().expect("temp dir");
    let search = BinSearch {
        pg_bin: None,
        path: Some(empty.path().as_os_str().to_owned()),
        use_pg_config: false,
        lib_root: empty.path().to_path_buf(),
    };
    let err = search
        .find()
        .expect_err("an empty search must not find PostgreSQL");
    assert!(
        err.contains("apt-get install"),
        "the error must say how to install PostgreSQL: {err}"
    );

    let wrong = BinSearch {
        pg_bin: Some(empty.path().as_os_str().to_owned()),
        ..search
    };
    let err = wrong
        .find()
        .expect_err("a PG_BIN without binaries is an error, not a hint");
    assert!(
        err.contains("PG_BIN="),
        "the error must name the bad PG_BIN: {err}"
    );
}

#[test]
fn installed_binaries_are_found() {
    let dir = BinSearch::from_env()
        .find()
        .expect("this machine has PostgreSQL installed");
    for bin in ["initdb", "postgres", "pg_ctl"] {
        assert!(dir.join(bin).is_file(), "{} lacks {bin}", dir.display());
    }
}

#[test]
fn cluster_has_the_standard_roles_and_is_removed_on_drop() {
    let cluster = Cluster::start();
    let roles = cluster.psql(
        "SELECT string_agg(rolname || ':' || rolcanlogin, ',' ORDER BY rolname) FROM pg_roles \
         WHERE rolname IN ('app', 'other', 'postgres')",
    );
    assert_eq!(roles.trim(), "app:true,other:false,postgres:true");
    let member = cluster.psql("SELECT pg_has_role('app', 'other', 'MEMBER')");
    assert_eq!(
        member.trim(),
        "t",
        "app must be a member of other (SET ROLE tests need it)"
    );
    let owner =
        cluster.psql("SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = 'appdb'");
    assert_eq!(owner.trim(), APP_USER);
    let auth = cluster.psql("SELECT DISTINCT auth_method FROM pg_hba_file_rules");
    assert_eq!(
        auth.trim(),
        "scram-sha-256",
        "every pg_hba line must require SCRAM"
    );

    let dir = PathBuf::from(cluster.psql("SHOW data_directory").trim());
    let pid = cluster.psql("SELECT pg_postmaster_start_time() IS NOT NULL");
    assert_eq!(pid.trim(), "t");
    assert!(
        dir.is_dir(),
        "data directory {} exists while running",
        dir.display()
    );
    let port = cluster.port();
    drop(cluster);
    assert!(
        !dir.exists(),
        "data directory {} must be removed on drop",
        dir.display()
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "nothing may listen on port {port} after the cluster is dropped"
    );
}

#[test]
fn no_postmaster_outlives_its_cluster() {
    let cluster = Cluster::start();
    let data_dir = cluster.psql("SHOW data_directory").trim().to_string();
    let running = || {
        Command::new("pgrep")
            .args(["-f", &data_dir])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    };
    assert!(
        running(),
        "pgrep finds the running postmaster by its data directory"
    );
    drop(cluster);
    let deadline = Instant::now() + Duration::from_secs(5);
    while running() {
        assert!(
            Instant::now() < deadline,
            "postmaster for {data_dir} still running after drop"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test]
async fn app_logs_in_with_scram_and_superuser_sees_it() {
    let cluster = Cluster::start();
    let (client, conn) = within(
        STEP,
        "app connection",
        tokio_postgres::connect(
            &cluster.connect_str(APP_USER, APP_PASSWORD, APP_DB),
            tokio_postgres::NoTls,
        ),
    )
    .await
    .expect("app logs in with password secret");
    tokio::spawn(conn);
    let row = within(
        STEP,
        "current_user",
        client.query_one("SELECT current_user::text, current_database()::text", &[]),
    )
    .await
    .expect("query as app");
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, String>(1)),
        (APP_USER.to_string(), APP_DB.to_string())
    );
    assert_eq!(cluster.backend_count(APP_DB, APP_USER).await, 1);

    let wrong = within(
        STEP,
        "wrong password",
        tokio_postgres::connect(
            &cluster.connect_str(APP_USER, "nope", APP_DB),
            tokio_postgres::NoTls,
        ),
    )
    .await;
    let err = wrong.err().expect("a wrong password is refused");
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::INVALID_PASSWORD)
    );

    assert_eq!(cluster.terminate_backends(APP_DB, APP_USER).await, 1);
    let deadline = Instant::now() + Duration::from_secs(5);
    while cluster.backend_count(APP_DB, APP_USER).await != 0 {
        assert!(Instant::now() < deadline, "terminated backend still listed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let err = within(
        STEP,
        "query on a terminated session",
        client.simple_query("SELECT 1"),
    )
    .await
    .expect_err("the terminated session fails");
    assert!(
        err.is_closed() || err.code().is_some(),
        "unexpected error kind: {err:?}"
    );
    let _ = SUPERUSER;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_fast_ends_sessions_and_comes_back_on_the_same_port() {
    let mut cluster = Cluster::start();
    let port = cluster.port();
    let client = cluster.superuser_client("postgres").await;
    tokio::task::block_in_place(|| cluster.restart_fast());
    assert_eq!(cluster.port(), port, "restart keeps the port");
    let err = within(STEP, "query after restart", client.simple_query("SELECT 1"))
        .await
        .expect_err("a session from before the restart is gone");
    assert!(
        err.is_closed() || err.code().is_some(),
        "unexpected error kind: {err:?}"
    );
    let fresh = cluster.superuser_client("postgres").await;
    within(
        STEP,
        "query on a fresh session",
        fresh.simple_query("SELECT 1"),
    )
    .await
    .expect("fresh session works");
}

#[tokio::test]
async fn wire_client_speaks_scram_and_the_extended_protocol() {
    let cluster = Cluster::start();
    let mut c = within(
        STEP,
        "wire connect",
        WireClient::connect(cluster.addr(), APP_USER, APP_PASSWORD, APP_DB),
    )
    .await
    .expect("wire client logs in");
    assert!(c.key.is_some(), "BackendKeyData received");
    assert_eq!(
        c.params.get("client_encoding").map(String::as_str),
        Some("UTF8")
    );
    assert_eq!(
        c.simple("SELECT 40 + 2").await.expect("simple query"),
        vec![Some("42".to_string())]
    );
    c.parse("s1", "SELECT $1::int * 2")
        .bind("", "s1", &[Some("21")])
        .execute("", 0)
        .sync();
    within(STEP, "send", c.send()).await.expect("send");
    let msgs = within(STEP, "extended reply", c.until_ready())
        .await
        .expect("reply");
    assert_eq!(
        crate::support::wire::first_column(&msgs),
        vec![Some("42".to_string())]
    );
    let err = WireClient::connect(cluster.addr(), APP_USER, "wrong", APP_DB)
        .await
        .err()
        .expect("wrong password refused");
    assert!(err.starts_with("28P01"), "{err}");
}
