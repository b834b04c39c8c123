//! The proxy's log lines: logins, logouts and failed logins (`log.connections`) and refusals
//! (`log.refusals`), at most `log.max_lines_per_second` a second, the lines left out counted
//! (`suppressed=N`). The proxy runs as an operator starts it (`crate::support::spawned`).
//!
//! That logs into a pipe carry no ANSI colour codes is checked in `cli`.

use std::time::Duration;

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::spawned::{client, spawn};

/// Lines of `log` that contain every one of `words`.
fn lines_with(log: &str, words: &[&str]) -> Vec<String> {
    log.lines()
        .filter(|l| words.iter().all(|w| l.contains(w)))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logins_logouts_and_refusals_are_logged_within_a_budget() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("pgsluice.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nbackend:\n  url: postgres://{APP_USER}:{APP_PASSWORD}@{}/{APP_DB}\n\
             admin:\n  listen: 127.0.0.1:0\n  write_token: w\n\
             log:\n  connections: true\n  refusals: true\n  max_lines_per_second: 3\n",
            cluster.addr()
        ),
    )
    .expect("write config");
    let p = spawn(&[], &["--config", &config.display().to_string()]);
    let admin = p.admin.to_string();
    let (ok, out, err) = client(&["fingerprint", "SELECT 4242", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("fingerprint JSON");
    let hash = v["fingerprint"].as_str().expect("hash").to_owned();
    let (ok, _, err) = client(&[
        "rules", "put", &hash, "--action", "reject", "--admin", &admin, "--token", "w",
    ]);
    assert!(ok, "{err}");

    let url = format!(
        "host={} port={} user={APP_USER} password={APP_PASSWORD} dbname={APP_DB}",
        p.listen.ip(),
        p.listen.port()
    );
    let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("login");
    let conn = tokio::spawn(conn);
    // Ten refusals in a burst: three lines this second, the rest left out and counted.
    for _ in 0..10 {
        let e = c.simple_query("SELECT 4242").await.expect_err("blocked");
        assert_eq!(e.code().map(|c| c.code()), Some("53400"));
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let _ = c.simple_query("SELECT 4242").await.expect_err("blocked");
    drop(c);
    let _ = conn.await;
    // A wrong password is a failed login.
    let bad = url.replace(APP_PASSWORD, "wrong");
    assert!(
        tokio_postgres::connect(&bad, tokio_postgres::NoTls)
            .await
            .is_err()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;

    let log = p.stderr.lock().expect("stderr lock").clone();
    let refused = lines_with(&log, &["refused", "reason=\"query_blocked\"", &hash]);
    assert!(
        (4..=7).contains(&refused.len()),
        "3 lines a second of 11 refusals (two windows at most):\n{log}"
    );
    assert!(
        refused.iter().any(|l| l.contains("suppressed=7")),
        "the line after the burst counts the 7 left out:\n{}",
        refused.join("\n")
    );
    assert!(
        refused[0].contains("caller=\"default\"") && refused[0].contains("53400"),
        "{}",
        refused[0]
    );
    let logins = lines_with(&log, &["pgsluice::connections", "login", "user=app"]);
    assert!(!logins.is_empty(), "{log}");
    assert!(
        !lines_with(&log, &["pgsluice::connections", "logout", "duration_s="]).is_empty(),
        "{log}"
    );
    assert!(
        !lines_with(&log, &["pgsluice::connections", "login failed", "28P01"]).is_empty(),
        "{log}"
    );
}
