//! Item 14: toward Postgres the server picks the authentication method, and with
//! `backend.tls: prefer` the connection may be plaintext, so whoever answers could ask for the
//! password in cleartext or as an md5 hash. `backend.require_auth` (default: SCRAM-SHA-256
//! alone unless the server's certificate is verified) decides which methods the proxy answers.
//! Each test gives the app user a pg_hba line with a weaker method (the superuser keeps SCRAM,
//! for the harness) and restarts the cluster so the line is in force.

use std::time::Duration;

use tokio_postgres::error::DbError;

use crate::support::pg::{APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::sql::eventually;
use crate::support::{direct_mode, note_skipped, within};

/// A cluster whose pg_hba asks the app user for `method` over TCP, after `prepare` ran.
fn cluster_asking_app_for(method: &str, prepare: &str) -> Cluster {
    let mut cluster = Cluster::start();
    if !prepare.is_empty() {
        cluster.psql(prepare);
    }
    let hba = cluster.psql("SHOW hba_file");
    let hba = hba.trim();
    // Rewritten in place: the file keeps its owner (the server's user) and mode.
    std::fs::write(
        hba,
        format!(
            "local all all scram-sha-256\n\
             host all {APP_USER} 127.0.0.1/32 {method}\n\
             host all all 127.0.0.1/32 scram-sha-256\n"
        ),
    )
    .unwrap_or_else(|e| panic!("write {hba}: {e}"));
    cluster.restart_fast();
    let rules = cluster.psql(&format!(
        "SELECT auth_method FROM pg_hba_file_rules WHERE '{APP_USER}' = ANY(user_name)"
    ));
    assert_eq!(rules.trim(), method, "the app user's pg_hba line");
    cluster
}

/// A proxy in front of `cluster` with config `yaml`, and the directory holding the file.
fn proxy(cluster: &Cluster, yaml: &str) -> (Proxy, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pgsluice.yaml");
    std::fs::write(&path, yaml).expect("write the config");
    let proxy = Proxy::start(cluster, ProxyOptions::pool(2).config_file(&path));
    (proxy, dir)
}

/// What the app user's login and first query through `proxy` end with: the server error
/// the client sees, or `None` when `SELECT 1` worked.
async fn first_query(proxy: &Proxy) -> Option<DbError> {
    let (client, task) = match proxy.try_client_with(&proxy.app_config()).await {
        Ok(c) => c,
        Err(e) => return Some(e.as_db_error().cloned().unwrap_or_else(|| panic!("{e:?}"))),
    };
    let r = within(
        Duration::from_secs(15),
        "SELECT 1",
        client.simple_query("SELECT 1"),
    )
    .await;
    drop(client);
    task.abort();
    match r {
        Ok(_) => None,
        Err(e) => Some(e.as_db_error().cloned().unwrap_or_else(|| panic!("{e:?}"))),
    }
}

/// By default the connect fails naming the method and the setting; listed, it works (with a
/// warning in the log, the server not being verified).
async fn refused_by_default_then_allowed(cluster: &Cluster, method: &str, described: &str) {
    let (default, _d1) = proxy(cluster, "");
    let err = first_query(&default)
        .await
        .expect("the server's method is refused by default");
    assert_eq!(err.code().code(), "08006", "{err:?}");
    let msg = err.message();
    assert!(msg.contains(described), "{msg}");
    assert!(msg.contains("backend.require_auth"), "{msg}");
    assert!(msg.contains("allowed: scram-sha-256"), "{msg}");
    drop(default);

    let (allowed, _d2) = proxy(cluster, &format!("backend:\n  require_auth: [{method}]\n"));
    if let Some(err) = first_query(&allowed).await {
        panic!(
            "require_auth: [{method}] still refused: {err:?}\n{}",
            allowed.stderr_tail()
        );
    }
    eventually(Duration::from_secs(5), "the startup warning", || async {
        allowed
            .stderr_tail()
            .contains("backend.require_auth allows a method that sends the password")
    })
    .await;
    allowed.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn item14_cleartext_password_needs_require_auth() {
    if direct_mode() {
        note_skipped("backend.require_auth of pgsluice");
        return;
    }
    let cluster = cluster_asking_app_for("password", "");
    refused_by_default_then_allowed(&cluster, "password", "the password in cleartext").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn item14_md5_needs_require_auth() {
    if direct_mode() {
        note_skipped("backend.require_auth of pgsluice");
        return;
    }
    // pg_hba `md5` falls back to SCRAM for a SCRAM verifier: store an md5 one.
    let cluster = cluster_asking_app_for(
        "md5",
        &format!("SET password_encryption = md5; ALTER ROLE {APP_USER} PASSWORD '{APP_PASSWORD}'"),
    );
    refused_by_default_then_allowed(&cluster, "md5", "an md5 password").await;
}
