//! The `pgsluice` command line as a newcomer and an operator meet it:
//!
//! * the README's "Command line" section lists every subcommand, every flag and every
//!   environment variable clap knows (and nothing clap does not), read from `--help` of the
//!   built binary, so the README cannot drift from the code;
//! * `PGSLUICE_*` variables configure the proxy against a real cluster, with the precedence
//!   flags > environment > file;
//! * its logs carry no ANSI colour codes when stderr is not a terminal;
//! * `pgsluice top --watch` redraws until stopped;
//! * the admin commands find the proxy through its config file, admin URLs and a TLS front.
//!
//! The proxy runs as an operator starts it (`crate::support::spawned`). The runbook's failover
//! with the CLI is in `lifecycle`, the logs' content in `logging`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::spawned::{BIN, Spawned, client, get, get_as, spawn};

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
