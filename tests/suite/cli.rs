//! The `pgsluice` command line as a newcomer and an operator meet it:
//!
//! * the README's "Command line" section lists every subcommand, every flag and every
//!   environment variable clap knows (and nothing clap does not), read from `--help` of the
//!   built binary, so the README cannot drift from the code;
//! * `PGSLUICE_*` variables configure the proxy against a real cluster, with the precedence
//!   flags > environment > file;
//! * its logs carry no ANSI colour codes when stderr is not a terminal;
//! * `pgsluice top --watch` redraws until stopped.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};

const BIN: &str = env!("CARGO_BIN_EXE_pgsluice");

/// `pgsluice ARGS --help` with no PGSLUICE_* variable inherited (clap prints their values).
fn help(path: &[&str]) -> String {
    let mut cmd = Command::new(BIN);
    cmd.args(path).arg("--help");
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("PGSLUICE_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd.output().expect("run pgsluice --help");
    assert!(out.status.success(), "pgsluice {path:?} --help failed");
    String::from_utf8(out.stdout).expect("utf-8 help")
}

/// Subcommand names under "Commands:" (without `help`).
fn subcommands(help: &str) -> Vec<String> {
    let Some(rest) = help.split("\nCommands:\n").nth(1) else {
        return Vec::new();
    };
    rest.lines()
        .take_while(|l| l.starts_with("  "))
        .filter(|l| !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| *n != "help")
        .map(str::to_owned)
        .collect()
}

/// Long flags (`--x`) and environment variables (`[env: X=…]`) of one help text.
fn flags_and_env(help: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut flags = BTreeSet::new();
    let mut env = BTreeSet::new();
    for line in help.lines() {
        let t = line.trim_start();
        if t.starts_with('-') {
            for word in t.split([' ', ',', '=', '[', '<']) {
                if word.starts_with("--") && word.len() > 2 {
                    flags.insert(word.to_owned());
                }
            }
        }
        for part in line.split("[env: ").skip(1) {
            let name: String = part
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || *c == '_')
                .collect();
            env.insert(name);
        }
    }
    flags.remove("--help");
    flags.remove("--version");
    (flags, env)
}

/// Every command path (`[]`, `["rules"]`, `["rules", "put"]`, …) with its flags and variables.
fn clap_commands() -> BTreeMap<Vec<String>, (BTreeSet<String>, BTreeSet<String>)> {
    let mut out = BTreeMap::new();
    let mut todo = vec![Vec::<String>::new()];
    while let Some(path) = todo.pop() {
        let args: Vec<&str> = path.iter().map(String::as_str).collect();
        let text = help(&args);
        for sub in subcommands(&text) {
            let mut p = path.clone();
            p.push(sub);
            todo.push(p);
        }
        out.insert(path, flags_and_env(&text));
    }
    out
}

/// The first code block of the README's "## Command line" section.
fn readme_command_line() -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("read README.md");
    let section = readme
        .split("\n## Command line\n")
        .nth(1)
        .expect("README.md has a '## Command line' section");
    let section = section.split("\n## ").next().unwrap_or_default();
    section
        .split("```")
        .nth(1)
        .expect("a code block in the Command line section")
        .to_owned()
}

#[test]
fn readme_command_line_lists_every_subcommand_flag_and_variable() {
    let block = readme_command_line();
    // "pgsluice rules put HASH …" → the command path ["rules", "put"]: the words after
    // `pgsluice` up to the first argument or flag.
    let mut documented_paths = BTreeSet::new();
    for line in block.lines() {
        let Some(rest) = line.trim_start().strip_prefix("pgsluice") else {
            continue;
        };
        let path: Vec<String> = rest
            .split_whitespace()
            .take_while(|w| {
                w.chars().all(|c| c.is_ascii_lowercase() || c == '-') && !w.starts_with('-')
            })
            .map(str::to_owned)
            .collect();
        documented_paths.insert(path);
    }
    let words: BTreeSet<String> = block
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        .filter(|w| !w.is_empty())
        .map(str::to_owned)
        .collect();

    let commands = clap_commands();
    assert!(
        commands.len() >= 8,
        "expected the proxy, check-config, fingerprint, rules (list/get/put/delete) and top: {:?}",
        commands.keys().collect::<Vec<_>>()
    );
    let mut missing = Vec::new();
    let mut all_flags: BTreeSet<String> = ["--help", "--version"].map(String::from).into();
    for (path, (flags, env)) in &commands {
        // A command with subcommands of its own (`rules`) is documented through them.
        let has_children = commands
            .keys()
            .any(|p| p.len() > path.len() && p.starts_with(path));
        if !has_children && !documented_paths.contains(path) {
            missing.push(format!("command `pgsluice {}`", path.join(" ")));
        }
        for f in flags {
            all_flags.insert(f.clone());
            if !words.contains(f) {
                missing.push(format!("flag {f} of `pgsluice {}`", path.join(" ")));
            }
        }
        for e in env {
            if !words.contains(e) {
                missing.push(format!("variable {e} of `pgsluice {}`", path.join(" ")));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "README.md's Command line section lacks:\n  {}\n--- section ---\n{block}",
        missing.join("\n  ")
    );
    let unknown: Vec<&String> = words
        .iter()
        .filter(|w| w.starts_with("--") && !all_flags.contains(*w))
        .collect();
    assert!(
        unknown.is_empty(),
        "README.md's Command line section names flags clap does not know: {unknown:?}"
    );
    let unknown_paths: Vec<&Vec<String>> = documented_paths
        .iter()
        .filter(|p| !commands.contains_key(*p))
        .collect();
    assert!(
        unknown_paths.is_empty(),
        "README.md's Command line section names commands clap does not know: {unknown_paths:?}"
    );
}

/// A proxy process started by hand (the harness's `Proxy` always passes flags), killed on
/// drop.
struct Spawned {
    child: Child,
    admin: SocketAddr,
    listen: SocketAddr,
    /// Everything the proxy wrote to stderr (a pipe, not a terminal) so far.
    stderr: Arc<Mutex<String>>,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(envs: &[(&str, String)], args: &[&str]) -> Spawned {
    let mut cmd = Command::new(BIN);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("PGSLUICE_") {
            cmd.env_remove(k);
        }
    }
    cmd.args(args)
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .env("PGSLUICE_ADMIN_READ_TOKEN", "read")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn pgsluice");
    let stderr = Arc::new(Mutex::new(String::new()));
    let pipe = child.stderr.take().expect("stderr");
    let log = Arc::clone(&stderr);
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            eprintln!("[pgsluice] {line}");
            let mut log = log.lock().expect("stderr lock");
            log.push_str(&line);
            log.push('\n');
        }
    });
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let (mut admin, mut listen) = (None, None);
    let deadline = Instant::now() + Duration::from_secs(20);
    while listen.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .expect("pgsluice printed its addresses within 20 s");
        if let Some(a) = line.strip_prefix("pgsluice admin listening on ") {
            admin = a.parse().ok();
        } else if let Some(a) = line.strip_prefix("pgsluice listening on ") {
            listen = a.parse().ok();
        }
    }
    Spawned {
        child,
        admin: admin.expect("admin address"),
        listen: listen.expect("listen address"),
        stderr,
    }
}

/// GET with the read token: (status, body).
fn get(admin: SocketAddr, path: &str) -> (u16, String) {
    let (status, text) = get_as(admin, "127.0.0.1", path);
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    (status, body)
}

/// (mode, size) of the appdb/app pool, after a client used it.
async fn pool_of(p: &Spawned) -> (String, u64) {
    let url = format!(
        "host={} port={} user={APP_USER} password={APP_PASSWORD} dbname={APP_DB}",
        p.listen.ip(),
        p.listen.port()
    );
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("a client logs in through the proxy configured from the environment");
    let conn = tokio::spawn(conn);
    let row = client.query_one("SELECT 1", &[]).await.expect("SELECT 1");
    assert_eq!(row.get::<_, i32>(0), 1);
    drop(client);
    let _ = conn.await;
    let (status, body) = get(p.admin, "/v1/pools");
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("pools JSON");
    let pool = v["pools"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["name"] == "appdb/app"))
        .unwrap_or_else(|| panic!("no appdb/app pool in {body}"))
        .clone();
    (
        pool["mode"].as_str().unwrap_or_default().to_owned(),
        pool["size"].as_u64().unwrap_or_default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_configures_the_proxy_and_flags_win() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("pgsluice.yaml");
    // The file says transaction mode with 7 backends and listens on a fixed port.
    std::fs::write(
        &config,
        "listen: 127.0.0.1:1\npool:\n  mode: transaction\n  size: 7\n",
    )
    .expect("write config");
    let password = dir.path().join("password");
    std::fs::write(&password, format!("{APP_PASSWORD}\n")).expect("write password");
    let envs = [
        ("PGSLUICE_CONFIG", config.display().to_string()),
        ("PGSLUICE_LISTEN", "127.0.0.1:0".to_owned()),
        ("PGSLUICE_ADMIN_LISTEN", "127.0.0.1:0".to_owned()),
        (
            "PGSLUICE_BACKEND_URL",
            format!("postgres://{APP_USER}@{}/{APP_DB}", cluster.addr()),
        ),
        (
            "PGSLUICE_BACKEND_PASSWORD_FILE",
            password.display().to_string(),
        ),
        ("PGSLUICE_POOL_MODE", "session".to_owned()),
        ("PGSLUICE_POOL_SIZE", "3".to_owned()),
    ];

    // Environment over file: listen (the file's port 1 is not used), backend, password file,
    // pool mode and size.
    let p = spawn(&envs, &[]);
    assert_ne!(p.listen.port(), 1);
    assert_eq!(pool_of(&p).await, ("session".to_owned(), 3));
    // Logs into a pipe are plain text (no colour codes for journald, docker logs, files).
    let log = p.stderr.lock().expect("stderr lock").clone();
    assert!(log.contains("pgsluice listening"), "{log}");
    assert!(
        !log.contains('\x1b'),
        "ANSI escapes in logs to a pipe: {log:?}"
    );
    drop(p);

    // A flag over its variable.
    let p = spawn(&envs, &["--pool-size", "5", "--pool-mode", "transaction"]);
    assert_eq!(pool_of(&p).await, ("transaction".to_owned(), 5));

    // check-config logs in with the same variables (the systemd unit's ExecStartPre): the
    // URL from PGSLUICE_BACKEND_URL, the password from PGSLUICE_BACKEND_PASSWORD_FILE.
    let mut check = Command::new(BIN);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("PGSLUICE_") {
            check.env_remove(k);
        }
    }
    let out = check
        .args(["check-config", &config.display().to_string()])
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("run check-config");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("max_connections="),
        "check-config logged in with the environment's URL and password file: {text}"
    );

    // `top --watch` redraws until stopped (not a terminal: one table after another).
    let mut top = Command::new(BIN)
        .args(["top", "--admin", &p.admin.to_string(), "--token", "read"])
        .args(["--watch", "0.2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn pgsluice top --watch");
    std::thread::sleep(Duration::from_millis(1500));
    let _ = top.kill();
    let out = top.wait_with_output().expect("top output");
    let text = String::from_utf8_lossy(&out.stdout);
    let frames = text.matches("pgsluice top, every 0.2 s").count();
    assert!(frames >= 3, "expected several redraws in 1.5 s:\n{text}");
    assert!(text.contains("FINGERPRINT"), "{text}");
    assert!(
        !text.contains('\x1b'),
        "no escape codes into a pipe: {text:?}"
    );
}

/// `pgsluice ARGS` with no PGSLUICE_* variable inherited: (success, stdout, stderr).
fn client(args: &[&str]) -> (bool, String, String) {
    let mut cmd = Command::new(BIN);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("PGSLUICE_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd.args(args).output().expect("run the pgsluice client");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A GET naming `host` in its Host header, with the read token: (status, body).
fn get_as(admin: SocketAddr, host: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(admin).expect("connect to the admin API");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        s,
        "GET {path} HTTP/1.0\r\nHost: {host}\r\nAuthorization: Bearer read\r\n\r\n"
    )
    .expect("request");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("response");
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// A TLS terminator in front of `upstream` (what an operator's reverse proxy does), with a
/// self-signed certificate for `localhost`: its address and the certificate's PEM.
async fn tls_front(upstream: SocketAddr) -> (SocketAddr, String) {
    use tokio_rustls::rustls::{self, ServerConfig};
    let key = rcgen::KeyPair::generate().expect("key pair");
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .expect("cert params")
        .self_signed(&key)
        .expect("self-signed cert");
    let pem = cert.pem();
    let der = cert.der().clone();
    let key_der = rustls_pki_types::PrivateKeyDer::try_from(key.serialize_der()).expect("key");
    let cfg =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(vec![der], key_der)
            .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the TLS front");
    let addr = listener.local_addr().expect("front address");
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                if let Ok(mut up) = tokio::net::TcpStream::connect(upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
                }
            });
        }
    });
    (addr, pem)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_commands_find_the_proxy_through_its_config_file_urls_and_tls() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    // A port the OS just handed out, written into the file the CLI reads.
    let admin_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let config = dir.path().join("pgsluice.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nbackend:\n  url: postgres://{APP_USER}:{APP_PASSWORD}@{}/{APP_DB}\n\
             admin:\n  listen: 0.0.0.0:{admin_port}\n  write_token: from-the-file\n  \
             allowed_hosts: [admin.test]\n",
            cluster.addr()
        ),
    )
    .expect("write config");
    let cfg = config.display().to_string();
    let p = spawn(&[], &["--config", &cfg]);
    assert_eq!(p.admin.port(), admin_port);
    let _ = pool_of(&p).await;

    // Address (0.0.0.0 reached on loopback) and write token from the file.
    let (ok, out, err) = client(&["pools", "--config", &cfg]);
    assert!(ok, "{err}");
    assert!(out.starts_with("POOL "), "{out}");
    assert!(out.contains("appdb/app  transaction  20"), "{out}");
    let (ok, out, err) = client(&["callers", "-c", &cfg]);
    assert!(
        ok && out.starts_with("CALLER ") && out.contains("default"),
        "{out}{err}"
    );
    let (ok, out, err) = client(&["breaker", "-c", &cfg]);
    assert!(ok && out.starts_with("state        closed"), "{out}{err}");
    let (ok, out, err) = client(&["reload", "-c", &cfg]);
    assert!(ok && out == "configuration reloaded\n", "{out}{err}");
    // A flag wins over the file: the read token cannot reload.
    let (ok, _, err) = client(&["reload", "-c", &cfg, "--token", "read"]);
    assert!(!ok && err.contains("HTTP 403"), "{err}");
    // Value enums are checked before any request.
    let (ok, _, err) = client(&["top", "-c", &cfg, "--sort", "slowest"]);
    assert!(!ok && err.contains("possible values: total_time"), "{err}");

    // Host names: IP literals, localhost and admin.allowed_hosts; other names get 421
    // (DNS rebinding), the probes answer under any name.
    let local = SocketAddr::from(([127, 0, 0, 1], admin_port));
    assert_eq!(get_as(local, "127.0.0.1", "/v1/pools").0, 200);
    assert_eq!(get_as(local, "Admin.Test:9930", "/v1/pools").0, 200);
    let (status, text) = get_as(local, "attacker.example", "/v1/pools");
    assert_eq!(status, 421, "{text}");
    assert!(text.contains("admin.allowed_hosts"), "{text}");
    assert_eq!(get_as(local, "attacker.example", "/healthz").0, 200);

    // https through a TLS-terminating front, verified against the CA given.
    let (front, pem) = tls_front(local).await;
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, pem).expect("write CA");
    let url = format!("https://localhost:{}", front.port());
    let ca_path = ca.display().to_string();
    let out = tokio::task::spawn_blocking(move || {
        client(&[
            "pools",
            "--admin",
            &url,
            "--admin-ca",
            &ca_path,
            "--token",
            "read",
        ])
    })
    .await
    .expect("client");
    assert!(out.0 && out.1.contains("appdb/app"), "{}{}", out.1, out.2);
    let url = format!("https://localhost:{}", front.port());
    let out =
        tokio::task::spawn_blocking(move || client(&["pools", "--admin", &url, "--token", "read"]))
            .await
            .expect("client");
    assert!(
        !out.0 && out.2.contains("TLS handshake"),
        "an unknown CA is refused: {}",
        out.2
    );

    // Completion scripts know the subcommands.
    let (ok, out, _) = client(&["completions", "bash"]);
    assert!(
        ok && out.contains("_pgsluice") && out.contains("callers"),
        "{out}"
    );
}

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

/// The failover steps of the runbook, with the CLI: pause, point the config at the new
/// server, reload, reconnect, resume — a client in the middle sees a pause, not an error, and
/// its next transaction runs on the new server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_by_the_runbook_moves_clients_to_the_new_server_without_an_error() {
    let old = Cluster::start();
    let new = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let admin_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let config = dir.path().join("pgsluice.yaml");
    let write = |server: &Cluster| {
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:0\nbackend:\n  url: postgres://{APP_USER}:{APP_PASSWORD}@{}/{APP_DB}\n\
                 admin:\n  listen: 127.0.0.1:{admin_port}\n  write_token: w\n",
                server.addr()
            ),
        )
        .expect("write config");
    };
    write(&old);
    let cfg = config.display().to_string();
    let p = spawn(&[], &["--config", &cfg]);
    let url = format!(
        "host={} port={} user={APP_USER} password={APP_PASSWORD} dbname={APP_DB}",
        p.listen.ip(),
        p.listen.port()
    );
    let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("login");
    tokio::spawn(conn);
    let port = |rows: Vec<tokio_postgres::SimpleQueryMessage>| -> u16 {
        rows.iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            })
            .and_then(|p| p.parse().ok())
            .expect("a port")
    };
    let server_port = "SELECT current_setting('port')";
    assert_eq!(
        port(c.simple_query(server_port).await.expect("query")),
        old.addr().port()
    );

    let run = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            client(&args)
        })
    };
    let pool = format!("{APP_DB}/{APP_USER}");
    let (ok, out, err) = run(vec!["pause".into(), pool.clone(), "-c".into(), cfg.clone()])
        .await
        .expect("pause");
    assert!(
        ok && out.contains("paused; no transaction in flight"),
        "{out}{err}"
    );
    // A transaction started during the pause waits for the resume.
    let waiting = tokio::spawn({
        let url = url.clone();
        async move {
            let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
            tokio::spawn(conn);
            c.simple_query("SELECT current_setting('port')").await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "held while paused");

    write(&new);
    for step in ["reload", "reconnect", "resume"] {
        let mut args = vec![step.to_owned()];
        if step != "reload" {
            args.push(pool.clone());
        }
        args.extend(["-c".to_owned(), cfg.clone()]);
        let (ok, out, err) = run(args).await.expect(step);
        assert!(ok, "{step}: {out}{err}");
    }
    let rows = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("released by the resume")
        .expect("join")
        .expect("the held transaction ran, without an error");
    assert_eq!(port(rows), new.addr().port(), "it ran on the new server");
    assert_eq!(
        port(
            c.simple_query(server_port)
                .await
                .expect("the first client goes on")
        ),
        new.addr().port()
    );
    drop(old);
    assert_eq!(
        port(
            c.simple_query(server_port)
                .await
                .expect("after the old server is gone")
        ),
        new.addr().port()
    );
}

/// The value of the exposition line that starts with `series` (labels in the encoder's
/// alphabetical order).
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// What SHOW STATS users graph, per pool with database and user labels; backend time apart
/// from the waits; wait buckets that reach the configured timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_statistics_and_separate_wait_and_backend_times_reach_the_metrics() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("pgsluice.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nbackend:\n  url: postgres://{APP_USER}:{APP_PASSWORD}@{}/{APP_DB}\n\
             admin:\n  listen: 127.0.0.1:0\npool:\n  size: 1\n  checkout_timeout_ms: 5000\n",
            cluster.addr()
        ),
    )
    .expect("write config");
    let p = spawn(&[], &["--config", &config.display().to_string()]);
    let url = format!(
        "host={} port={} user={APP_USER} password={APP_PASSWORD} dbname={APP_DB}",
        p.listen.ip(),
        p.listen.port()
    );
    let connect = || async {
        let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("login");
        tokio::spawn(conn);
        c
    };
    let a = connect().await;
    // Kept open to the end: its Terminate would race the scrapes.
    let b = Arc::new(connect().await);
    // Every client message after login is a Query: the bytes received are their frames.
    let mut sent_by_clients = 0usize;
    let mut frame = |sql: &str| {
        sent_by_clients += 1 + 4 + sql.len() + 1;
        sql.to_owned()
    };
    for i in 0..10 {
        a.simple_query(&frame(&format!("SELECT {i}")))
            .await
            .expect("select");
    }
    // One explicit transaction of three statements, holding the only backend for 400 ms
    // while the other client waits for it; 100 ms into its wait, that client pipelines a
    // second query, read while it waits.
    a.batch_execute(&frame("BEGIN; SELECT 1"))
        .await
        .expect("begin");
    let (first, second) = (frame("SELECT 'waited'"), frame("SELECT 'pipelined'"));
    let b2 = Arc::clone(&b);
    let waiter = tokio::spawn(async move {
        let b = b2;
        let later = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            b.simple_query(&second).await
        };
        let (x, y) = tokio::join!(b.simple_query(&first), later);
        x.and(y)
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    a.batch_execute(&frame("SELECT pg_sleep(0.01); COMMIT"))
        .await
        .expect("commit");
    waiter.await.expect("join").expect("the waiting client ran");

    let (status, text) = get(p.admin, "/metrics");
    assert_eq!(status, 200);
    let pool = r#"{database="appdb",pool="appdb/app",user="app"}"#;
    let received = r#"pgsluice_pool_bytes_total{database="appdb",direction="received",pool="appdb/app",user="app"}"#;
    let sent = r#"pgsluice_pool_bytes_total{database="appdb",direction="sent",pool="appdb/app",user="app"}"#;
    assert_eq!(
        metric(&text, received),
        Some(sent_by_clients as f64),
        "every byte the clients sent, the pipelined query included\n{text}"
    );
    let at = |name: &str| metric(&text, &format!("{name}{pool}")).unwrap_or(-1.0);
    // Ten, one explicit, and the waiting client's two (pipelined on one backend, each
    // ended by its own ReadyForQuery).
    assert_eq!(at("pgsluice_pool_transactions_total"), 13.0, "{text}");
    // One per Query message (a multi-statement text is one), as PgBouncer counts them.
    assert_eq!(at("pgsluice_pool_queries_total"), 14.0, "{text}");
    assert!(
        at("pgsluice_pool_transaction_seconds_total") >= 0.4,
        "{text}"
    );
    assert!(at("pgsluice_pool_query_seconds_total") > 0.0, "{text}");
    assert!(at("pgsluice_pool_wait_seconds_total") >= 0.3, "{text}");
    for direction in ["received", "sent"] {
        let series = format!(
            r#"pgsluice_pool_bytes_total{{database="appdb",direction="{direction}",pool="appdb/app",user="app"}}"#
        );
        assert!(
            metric(&text, &series).is_some_and(|v| v > 100.0),
            "{series}\n{text}"
        );
    }
    let backend = metric(
        &text,
        r#"pgsluice_backend_duration_seconds_count{caller="default"}"#,
    );
    assert!(backend.is_some_and(|n| n >= 13.0), "{backend:?}");
    // The 400 ms wait: above the 0.25 s bucket, inside 0.5 s; buckets reach the 5 s timeout.
    let bucket = |le: &str| {
        metric(
            &text,
            &format!(r#"pgsluice_checkout_wait_seconds_bucket{{caller="default",le="{le}"}}"#),
        )
        .unwrap_or(-1.0)
    };
    let count = metric(
        &text,
        r#"pgsluice_checkout_wait_seconds_count{caller="default"}"#,
    )
    .unwrap_or(0.0);
    assert!(bucket("0.25") < count && bucket("0.5") >= 1.0, "{text}");
    assert_eq!(bucket("5"), count, "a bucket at the 5 s checkout timeout");
    // The client-observed time of the waiting statement includes its wait; its backend time
    // does not.
    let total_slow = count_above(&text, "pgsluice_query_duration_seconds", 0.25);
    let backend_slow = count_above(&text, "pgsluice_backend_duration_seconds", 0.25);
    assert!(total_slow > backend_slow, "{total_slow} vs {backend_slow}");

    // N transactions of the extended protocol (Bind/Execute/Sync of a prepared statement,
    // as most drivers send them) move every counter by at least N.
    const N: i32 = 20;
    let stmt = a.prepare("SELECT $1::int4").await.expect("prepare");
    let series = [
        format!("pgsluice_pool_transactions_total{pool}"),
        format!("pgsluice_pool_queries_total{pool}"),
        r#"pgsluice_backend_duration_seconds_count{caller="default"}"#.to_owned(),
        received.to_owned(),
        sent.to_owned(),
    ];
    let read = |text: &str| -> Vec<f64> {
        series
            .iter()
            .map(|s| metric(text, s).unwrap_or(-1.0))
            .collect()
    };
    let before = read(&get(p.admin, "/metrics").1);
    for i in 0..N {
        let row = a.query_one(&stmt, &[&i]).await.expect("execute");
        assert_eq!(row.get::<_, i32>(0), i);
    }
    let (status, text) = get(p.admin, "/metrics");
    assert_eq!(status, 200);
    let after = read(&text);
    for (i, s) in series.iter().enumerate() {
        let grew = after[i] - before[i];
        let least = if i < 3 { f64::from(N) } else { 1.0 };
        assert!(
            before[i] >= 0.0 && grew >= least,
            "{s}: {} -> {}\n{text}",
            before[i],
            after[i]
        );
    }
}

/// Observations of `histogram{caller="default"}` above `le` (count minus that bucket).
fn count_above(text: &str, histogram: &str, le: f64) -> f64 {
    let count = metric(text, &format!(r#"{histogram}_count{{caller="default"}}"#)).unwrap_or(0.0);
    let below = metric(
        text,
        &format!(r#"{histogram}_bucket{{caller="default",le="{le}"}}"#),
    )
    .unwrap_or(0.0);
    count - below
}

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
    let verifier = cluster
        .psql_on(
            "postgres",
            "SELECT rolpassword FROM pg_authid WHERE rolname = 'vuser'",
        )
        .trim()
        .to_owned();
    assert!(verifier.starts_with("SCRAM-SHA-256$"), "{verifier}");
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
