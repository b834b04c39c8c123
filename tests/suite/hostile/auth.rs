//! Authentication seen by a hostile client: what the SCRAM exchange reveals about which users
//! exist, and where the proxy takes its backend password from (and that a reload's new one
//! reaches the pools that already exist).

use std::time::Duration;

use bytes::{BufMut, BytesMut};
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::raw::{Raw, first_error, first_value, frame, startup};
use crate::support::sql::eventually;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_password_from_a_file_keeps_it_off_the_command_line() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = crate::support::raw::write(dir.path(), "pw", &format!("{APP_PASSWORD}\n"));
    let proxy = Proxy::start(
        &cluster,
        ProxyOptions::pool(2)
            .without_url_password()
            .arg("--backend-password-file")
            .arg(file.display().to_string()),
    );
    if proxy.is_direct() {
        eprintln!("direct mode: no proxy command line to check");
        return;
    }
    let pid = proxy.pid().expect("proxy pid");
    let argv = std::fs::read(format!("/proc/{pid}/cmdline")).expect("proxy cmdline");
    let argv = String::from_utf8_lossy(&argv);
    assert!(
        !argv.contains(APP_PASSWORD),
        "the password is on the command line: {argv:?}"
    );
    // The app logs in with the file's password, and the proxy logs in to Postgres with it.
    crate::support::raw::oracle(&proxy).await;
    let mut c = Raw::tcp(proxy.addr()).await;
    let err = c
        .login(0, APP_USER, "not-the-password", &[])
        .await
        .unwrap_err();
    assert!(err.starts_with("28P01"), "{err}");
}

/// Runs the proxy binary until it exits (it is expected to refuse to start); its stderr.
fn refused_start(args: &[&str]) -> String {
    let out = crate::support::run_with_timeout(
        {
            let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_pgsluice"));
            c.args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
                .args(args)
                .env_remove("PGSLUICE_BACKEND_PASSWORD")
                .env_remove("PGSLUICE_CONFIG");
            c
        },
        std::time::Duration::from_secs(20),
    );
    assert!(!out.status.success(), "pgsluice started with {args:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn startup_errors_name_the_password_source_never_the_password() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("no-such-file");
    let shown = missing.display().to_string();
    let err = refused_start(&[
        "--backend",
        "postgres://app@127.0.0.1:1/appdb",
        "--backend-password-file",
        &shown,
    ]);
    assert!(err.contains(&shown), "the error names the path: {err}");
    let err = refused_start(&["--backend", "postgres://app:hunter%zz2@127.0.0.1:1/appdb"]);
    assert!(err.contains("the password in backend.url"), "{err}");
    assert!(
        !err.contains("hunter"),
        "the error shows the password: {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_backend_password_reaches_existing_pools() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = crate::support::raw::write(dir.path(), "pw", &format!("{APP_PASSWORD}\n"));
    let proxy = Proxy::start(
        &cluster,
        ProxyOptions::pool(4)
            .without_url_password()
            .arg("--backend-password-file")
            .arg(file.display().to_string()),
    );
    if proxy.is_direct() {
        eprintln!("direct mode: no proxy to reload");
        return;
    }
    // This client holds the pool's only backend, so the next statement needs a new one.
    let mut holder = Raw::tcp(proxy.addr()).await;
    holder.app_login().await;
    let msgs = holder.query("BEGIN; SELECT 1").await.expect("begin");
    assert_eq!(first_error(&msgs), None, "{msgs:?}");

    cluster.psql("ALTER ROLE app PASSWORD 'rotated-pw'");
    crate::support::raw::write(dir.path(), "pw", "rotated-pw\n");
    crate::support::raw::signal(&proxy, "HUP");
    eventually(
        Duration::from_secs(10),
        "a login with the new password after SIGHUP",
        || async {
            let mut c = Raw::tcp(proxy.addr()).await;
            c.login(0, APP_USER, "rotated-pw", &[]).await.is_ok()
        },
    )
    .await;
    let mut c = Raw::tcp(proxy.addr()).await;
    c.login(0, APP_USER, "rotated-pw", &[])
        .await
        .expect("login with the new password");
    let msgs = c.query("SELECT 1").await.expect("query");
    assert_eq!(
        first_error(&msgs),
        None,
        "a new backend connection of the existing pool logs in with the new password: {msgs:?}\n{}",
        proxy.stderr_tail()
    );
    assert_eq!(first_value(&msgs).as_deref(), Some("1"));
    let msgs = holder.query("COMMIT").await.expect("commit");
    assert_eq!(first_error(&msgs), None, "{msgs:?}");
}
