//! TESTS.md B: TLS toward clients (SSLRequest, direct TLS with ALPN, `require`: B1, B3–B5) and
//! toward Postgres (prefer, require, verify-ca and verify-full never fall back to plaintext;
//! bytes injected before the handshake and a man in the middle answering 'N': B2). With
//! client TLS on, every login runs on the login thread.
//!
//! SCRAM-SHA-256-PLUS (channel binding `tls-server-end-point`) over TLS: what is offered, what
//! is refused as Postgres refuses it, and logins with tokio-postgres and psql
//! (`channel_binding=require`), a user known by its verifier (pass-through) included.
//!
//! The authentication matrix (B6) is in `auth`, a malicious backend (B8) in `backend_faults`, a
//! connect storm half over TLS in `overload`, a reload of the TLS files in `lifecycle`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use postgres_protocol::authentication::sasl::ChannelBinding;
use rustls_pki_types::CertificateDer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_postgres::config::{ChannelBinding as Binding, SslMode};

use crate::support::note_skipped;
use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster, server_identity};
use crate::support::pg_tls::MakeRustls;
use crate::support::proxy::{ADMIN_READ_TOKEN, Proxy, ProxyOptions};
use crate::support::raw::{
    Raw, cert, client_tls, first_value, gss_request, oracle, pools_at_rest, query, sasl_login,
    ssl_request, startup, tls_direct, tls_via_request, write,
};
use crate::support::run_with_timeout_async;
use crate::support::spawned::metric;
use crate::support::sql::sqlstate;

/// A proxy with client TLS in `mode`, its certificate for localhost/127.0.0.1, and the DER
/// certificate clients must trust.
struct TlsProxy {
    proxy: Proxy,
    root: CertificateDer<'static>,
    dir: tempfile::TempDir,
}

fn tls_yaml(dir: &Path, mode: &str, extra: &str) -> PathBuf {
    write(
        dir,
        "c.yaml",
        &format!(
            "tls:\n  mode: {mode}\n  cert_file: {0}/cert.pem\n  key_file: {0}/key.pem\n{extra}",
            dir.display()
        ),
    )
}

fn tls_proxy(cluster: &Cluster, mode: &str) -> TlsProxy {
    let dir = tempfile::tempdir().expect("tempdir");
    let (c, k, root) = cert(&["localhost", "127.0.0.1"], false);
    write(dir.path(), "cert.pem", &c);
    write(dir.path(), "key.pem", &k);
    let cfg = tls_yaml(dir.path(), mode, "");
    let proxy = Proxy::start(cluster, ProxyOptions::pool(3).config_file(cfg));
    TlsProxy { proxy, root, dir }
}

fn psql(addr: SocketAddr, sslmode: &str, sql: &str) -> std::process::Command {
    let mut cmd = Cluster::tool_command("psql", addr, APP_USER, APP_PASSWORD, APP_DB);
    cmd.env("PGSSLMODE", sslmode)
        .args(["-X", "-q", "-A", "-t", "-c", sql]);
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b1_b3_b4_b5_client_tls_negotiation() {
    let cluster = Cluster::start();
    let t = tls_proxy(&cluster, "allow");
    let addr = t.proxy.addr();
    // B1: a StartupMessage and a Query pipelined behind the SSLRequest.
    let mut c = Raw::tcp(addr).await;
    let mut b = ssl_request();
    b.extend(startup(0, &[("user", APP_USER), ("database", APP_DB)]));
    b.extend(query("DROP TABLE IF EXISTS never"));
    c.send(&b).await.expect("send");
    let (tag, body) = c.recv().await.expect("an ErrorResponse, not 'S'");
    assert_eq!(tag, b'E');
    assert_eq!(crate::support::raw::field(&body, b'C'), "08P01");
    assert!(crate::support::raw::field(&body, b'M').contains("unencrypted data after SSL request"));
    assert!(c.closes().await);

    // B4: TLS through SSLRequest, then SCRAM and a query inside TLS.
    let mut c = tls_via_request(addr, client_tls(&t.root, false))
        .await
        .expect("TLS");
    c.app_login().await;
    let msgs = c.query("SELECT 7").await.expect("query over TLS");
    assert_eq!(first_value(&msgs).as_deref(), Some("7"));
    // B3: an SSLRequest inside TLS is closed without a reply.
    c.send(&ssl_request()).await.ok();
    // B4: direct TLS with ALPN works; without ALPN it is refused.
    let mut c = tls_direct(addr, client_tls(&t.root, true))
        .await
        .expect("direct TLS");
    c.app_login().await;
    assert_eq!(
        first_value(&c.query("SELECT 8").await.expect("q")).as_deref(),
        Some("8")
    );
    match tls_direct(addr, client_tls(&t.root, false)).await {
        Err(_) => {}
        Ok(mut c) => {
            let r = c.login(0, APP_USER, APP_PASSWORD, &[]).await;
            assert!(r.is_err(), "direct TLS without ALPN must not log in");
        }
    }
    // B4: GSSENCRequest gets 'N' and the session continues (then SSL is still possible).
    let mut c = Raw::tcp(addr).await;
    c.send(&gss_request()).await.expect("gss");
    assert_eq!(c.byte().await.expect("answer"), b'N');
    c.app_login().await;
    assert_eq!(
        first_value(&c.query("SELECT 9").await.expect("q")).as_deref(),
        Some("9")
    );
    // B3: SSL→S is allowed after GSS→N; GSS twice is closed without a second answer.
    let mut c = Raw::tcp(addr).await;
    c.send(&gss_request()).await.expect("gss");
    assert_eq!(c.byte().await.expect("answer"), b'N');
    c.send(&gss_request()).await.expect("gss again");
    assert!(
        c.closes().await,
        "second GSSENCRequest must close the connection"
    );
    assert!(c.rbuf.is_empty(), "no second answer");
    // psql (libpq 15) with sslmode=require.
    let out = run_with_timeout_async(
        psql(
            addr,
            "require",
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        ),
        Duration::from_secs(30),
    )
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    oracle(&t.proxy).await;

    // B5: require refuses a plaintext StartupMessage before authentication.
    std::fs::write(t.dir.path().join("c.yaml"), "").ok();
    let req = tls_proxy(&cluster, "require");
    let mut c = Raw::tcp(req.proxy.addr()).await;
    c.send(&startup(0, &[("user", APP_USER), ("database", APP_DB)]))
        .await
        .expect("send");
    let (tag, body) = c.recv().await.expect("error");
    assert_eq!(tag, b'E', "no authentication request may come first");
    assert_eq!(crate::support::raw::field(&body, b'C'), "28000");
    let out = run_with_timeout_async(
        psql(req.proxy.addr(), "disable", "SELECT 1"),
        Duration::from_secs(30),
    )
    .await;
    assert!(!out.status.success());
    let out = run_with_timeout_async(
        psql(req.proxy.addr(), "require", "SELECT 1"),
        Duration::from_secs(30),
    )
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut c = tls_via_request(req.proxy.addr(), client_tls(&req.root, false))
        .await
        .expect("TLS");
    c.app_login().await;
    // B3 with TLS disabled: SSL→N, GSS→N, SSL again → closed without a third reply.
    let plain = Proxy::start(&cluster, ProxyOptions::pool(1));
    let mut c = Raw::tcp(plain.addr()).await;
    c.send(&ssl_request()).await.expect("ssl");
    assert_eq!(c.byte().await.expect("N"), b'N');
    c.send(&gss_request()).await.expect("gss");
    assert_eq!(c.byte().await.expect("N"), b'N');
    c.send(&ssl_request()).await.expect("ssl again");
    assert!(c.closes().await);
    assert!(c.rbuf.is_empty(), "no third reply");
    // B1 on a proxy without TLS, too.
    let mut c = Raw::tcp(plain.addr()).await;
    let mut b = ssl_request();
    b.extend(startup(0, &[("user", APP_USER)]));
    c.send(&b).await.expect("send");
    assert_eq!(c.error().await.map(|e| e.0).as_deref(), Some("08P01"));
    // Direct TLS to a proxy without TLS: closed.
    assert!(
        tls_direct(plain.addr(), client_tls(&req.root, true))
            .await
            .is_err()
    );
    oracle(&plain).await;
}

/// SCRAM-SHA-256-PLUS over TLS. The proxy offers it first (SCRAM-SHA-256 alone without TLS),
/// binds to SHA-256 of its own certificate (ECDSA P-256), and refuses what Postgres refuses: a
/// binding to anything else or a wrong password (28P01), PLUS without binding data or without
/// TLS, binding data under SCRAM-SHA-256 (08P01), and `y` where PLUS was offered (28000, a
/// downgrade). Real clients: tokio-postgres and psql with `channel_binding=require` (and
/// `disable`), and a user known only by its verifier, whose key the proxy recovers from the
/// bound exchange to log in to Postgres (pass-through). Without TLS, libpq's `require` fails
/// with its own error, and tokio-postgres's too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_sha_256_plus_binds_logins_to_the_proxy_certificate() {
    let cluster = Cluster::start();
    cluster.psql_on(
        APP_DB,
        "CREATE ROLE vuser LOGIN PASSWORD 'v-pw'; GRANT CONNECT ON DATABASE appdb TO vuser",
    );
    let verifier = cluster.scram_verifier("vuser");
    let dir = tempfile::tempdir().expect("tempdir");
    let (c, k, root) = cert(&["localhost", "127.0.0.1"], false);
    write(dir.path(), "cert.pem", &c);
    write(dir.path(), "key.pem", &k);
    let users = format!("auth:\n  users:\n    - {{ name: vuser, password: \"{verifier}\" }}\n");
    let cfg = tls_yaml(dir.path(), "allow", &users);
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2).config_file(cfg));
    if proxy.is_direct() {
        note_skipped("the cluster has no TLS: channel binding is the proxy's");
        return;
    }
    let addr = proxy.addr();

    // The protocol, case by case.
    let plus = "SCRAM-SHA-256-PLUS";
    let scram = "SCRAM-SHA-256";
    let hash = ring::digest::digest(&ring::digest::SHA256, root.as_ref())
        .as_ref()
        .to_vec();
    let bound = || ChannelBinding::tls_server_end_point(hash.clone());
    let cases = [
        (
            "bound to the certificate",
            plus,
            bound(),
            APP_PASSWORD,
            "ok",
        ),
        ("wrong password", plus, bound(), "wrong", "28P01"),
        (
            "bound to another hash",
            plus,
            ChannelBinding::tls_server_end_point(vec![0; 32]),
            APP_PASSWORD,
            "28P01",
        ),
        (
            "PLUS without binding data",
            plus,
            ChannelBinding::unsupported(),
            APP_PASSWORD,
            "08P01",
        ),
        (
            "binding data under SCRAM-SHA-256",
            scram,
            bound(),
            APP_PASSWORD,
            "08P01",
        ),
        (
            "y where PLUS was offered",
            scram,
            ChannelBinding::unrequested(),
            APP_PASSWORD,
            "28000",
        ),
        (
            "n",
            scram,
            ChannelBinding::unsupported(),
            APP_PASSWORD,
            "ok",
        ),
    ];
    for (what, mechanism, binding, password, want) in cases {
        let c = tls_via_request(addr, client_tls(&root, false))
            .await
            .expect("TLS");
        let (offered, got) = sasl_login(c, mechanism, binding, password).await;
        assert_eq!(offered, [plus, scram], "TLS, {what}");
        assert!(got.starts_with(want), "TLS, {what}: {got}");
    }
    let plain_cases = [
        (
            "PLUS",
            plus,
            bound(),
            "08P01: client selected an invalid SASL",
        ),
        ("y", scram, ChannelBinding::unrequested(), "ok"),
    ];
    for (what, mechanism, binding, want) in plain_cases {
        let (offered, got) =
            sasl_login(Raw::tcp(addr).await, mechanism, binding, APP_PASSWORD).await;
        assert_eq!(offered, [scram], "plaintext, {what}");
        assert!(got.starts_with(want), "plaintext, {what}: {got}");
    }

    // tokio-postgres, with a connector that reports the binding.
    let connect = |user: &str, password: &str, binding: Binding| {
        let mut config = proxy.config(user, password, APP_DB);
        config.ssl_mode(SslMode::Require).channel_binding(binding);
        let tls = MakeRustls(client_tls(&root, false));
        async move {
            let (client, connection) = config.connect(tls).await?;
            tokio::spawn(connection);
            let row = client.query_one("SELECT current_user::text", &[]).await?;
            Ok::<_, tokio_postgres::Error>(row.get::<_, String>(0))
        }
    };
    for (user, password) in [(APP_USER, APP_PASSWORD), ("vuser", "v-pw")] {
        for binding in [Binding::Require, Binding::Disable] {
            let who = connect(user, password, binding)
                .await
                .unwrap_or_else(|e| panic!("{user}, {binding:?}: {e:?}"));
            assert_eq!(who, user, "{binding:?}");
        }
    }
    let e = connect(APP_USER, "wrong", Binding::Require)
        .await
        .expect_err("a wrong password");
    assert_eq!(e.code().map(|c| c.code()), Some("28P01"), "{e:?}");
    // Without TLS, tokio-postgres's `require` has nothing to bind to.
    let mut config = proxy.app_config();
    config.channel_binding(Binding::Require);
    assert!(proxy.try_client_with(&config).await.is_err());

    // psql (libpq 15).
    let run = |sslmode: &str, binding: &str, password: &str| {
        let mut cmd = psql(addr, sslmode, "SELECT current_user");
        cmd.env("PGCHANNELBINDING", binding)
            .env("PGPASSWORD", password);
        run_with_timeout_async(cmd, Duration::from_secs(30))
    };
    for binding in ["require", "disable"] {
        let out = run("require", binding, APP_PASSWORD).await;
        assert!(
            out.status.success(),
            "psql, channel_binding={binding}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), APP_USER);
    }
    let out = run("require", "require", "wrong").await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("password authentication failed"),
        "{stderr}"
    );
    let out = run("disable", "require", APP_PASSWORD).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("channel binding required, but SSL not in use"),
        "{stderr}"
    );
    oracle(&proxy).await;
}

/// Turns SSL on in `cluster` with this certificate and key (reload; new connections use it).
fn enable_backend_ssl(cluster: &Cluster, cert_pem: &str, key_pem: &str, tag: &str) {
    let data = cluster.socket_dir().join("data");
    let (crt, key) = (
        data.join(format!("{tag}.crt")),
        data.join(format!("{tag}.key")),
    );
    std::fs::write(&crt, cert_pem).expect("cert");
    std::fs::write(&key, key_pem).expect("key");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    if let Some((uid, gid)) = server_identity() {
        std::os::unix::fs::chown(&crt, Some(uid), Some(gid)).expect("chown");
        std::os::unix::fs::chown(&key, Some(uid), Some(gid)).expect("chown");
    }
    cluster.psql(&format!(
        "ALTER SYSTEM SET ssl_cert_file = '{}'",
        crt.display()
    ));
    cluster.psql(&format!(
        "ALTER SYSTEM SET ssl_key_file = '{}'",
        key.display()
    ));
    cluster.psql("ALTER SYSTEM SET ssl = on");
    cluster.psql("SELECT pg_reload_conf()");
    std::thread::sleep(Duration::from_millis(300));
}

fn backend_yaml(dir: &Path, mode: &str, root: Option<&Path>) -> PathBuf {
    let root = root
        .map(|r| format!("  root_cert_file: {}\n", r.display()))
        .unwrap_or_default();
    write(
        dir,
        &format!("{mode}.yaml"),
        &format!("backend:\n  tls: {mode}\n  connect_timeout_ms: 3000\n{root}"),
    )
}

/// With client TLS on, every login runs on the login thread (one session thread), plain ones
/// too: a TLS handshake's key exchange and signature never take the CPU of the thread that
/// serves the sessions (`pgsluice_client_logins_offloaded_total`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_client_tls_on_every_login_runs_on_the_login_thread() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let (c, k, root) = cert(&["localhost", "127.0.0.1"], false);
    write(dir.path(), "cert.pem", &c);
    write(dir.path(), "key.pem", &k);
    let cfg = tls_yaml(dir.path(), "allow", "");
    let options = ProxyOptions::pool(2)
        .config_file(cfg)
        .arg("--worker-threads")
        .arg("1");
    let proxy = Proxy::start(&cluster, options);
    if proxy.is_direct() {
        return;
    }
    let addr = proxy.addr();
    let mut tls = tls_via_request(addr, client_tls(&root, false))
        .await
        .expect("TLS");
    tls.app_login().await;
    let msgs = tls.query("SELECT 1").await.expect("query over TLS");
    assert_eq!(first_value(&msgs).as_deref(), Some("1"));
    let mut plain = Raw::tcp(addr).await;
    plain.app_login().await;
    let msgs = plain.query("SELECT 2").await.expect("plain query");
    assert_eq!(first_value(&msgs).as_deref(), Some("2"));
    let (status, text) = proxy
        .admin_request("GET", "/metrics", ADMIN_READ_TOKEN, None)
        .await;
    assert_eq!(status, 200, "{text}");
    let value = |series: &str| metric(&text, series).unwrap_or(-1.0);
    assert_eq!(
        value("pgsluice_client_connections_accepted_total"),
        2.0,
        "{text}"
    );
    assert_eq!(
        value("pgsluice_client_logins_offloaded_total"),
        2.0,
        "with client TLS on, a login ran on the session thread"
    );
}

/// Connects through `proxy` and returns the SQLSTATE of the failure, or "ok" with the backend's
/// `ssl` flag.
async fn try_select(proxy: &Proxy) -> String {
    match proxy.try_client_with(&proxy.app_config()).await {
        Err(e) => sqlstate(&e),
        Ok((client, _task)) => match client
            .simple_query("SELECT ssl::text FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .await
        {
            Ok(m) => format!(
                "ok ssl={}",
                crate::support::sql::simple_values(&m)[0]
                    .clone()
                    .unwrap_or_default()
            ),
            Err(e) => sqlstate(&e),
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b5_backend_tls_modes_never_fall_back() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    // Without SSL on the server: prefer falls back, require/verify-full fail closed.
    let prefer = Proxy::start(
        &cluster,
        ProxyOptions::pool(1).config_file(backend_yaml(dir.path(), "prefer", None)),
    );
    assert_eq!(try_select(&prefer).await, "ok ssl=false");
    let require = Proxy::start(
        &cluster,
        ProxyOptions::pool(1).config_file(backend_yaml(dir.path(), "require", None)),
    );
    let r = try_select(&require).await;
    assert!(
        r.starts_with("08"),
        "require against a plaintext server: {r}"
    );

    // A server certificate for localhost/127.0.0.1.
    let (c, k, _) = cert(&["localhost", "127.0.0.1"], false);
    let root = write(dir.path(), "root.pem", &c);
    enable_backend_ssl(&cluster, &c, &k, "good");
    for mode in ["require", "verify-ca", "verify-full"] {
        let p = Proxy::start(
            &cluster,
            ProxyOptions::pool(1).config_file(backend_yaml(dir.path(), mode, Some(&root))),
        );
        assert_eq!(try_select(&p).await, "ok ssl=true", "{mode}");
        oracle(&p).await;
    }
    assert_eq!(
        try_select(&prefer).await,
        "ok ssl=false",
        "prefer's pooled connection stays"
    );
    let prefer2 = Proxy::start(
        &cluster,
        ProxyOptions::pool(1).config_file(backend_yaml(dir.path(), "prefer", None)),
    );
    assert_eq!(try_select(&prefer2).await, "ok ssl=true");

    // Wrong name: verify-full refuses, verify-ca accepts.
    let (c, k, _) = cert(&["wronghost"], false);
    let wrong_root = write(dir.path(), "wrong.pem", &c);
    enable_backend_ssl(&cluster, &c, &k, "wrong");
    let full = Proxy::start(
        &cluster,
        ProxyOptions::pool(1).config_file(backend_yaml(
            dir.path(),
            "verify-full",
            Some(&wrong_root),
        )),
    );
    let r = try_select(&full).await;
    assert!(r.starts_with("08"), "verify-full with a wrong name: {r}");
    let ca = Proxy::start(
        &cluster,
        ProxyOptions::pool(1).config_file(backend_yaml(dir.path(), "verify-ca", Some(&wrong_root))),
    );
    assert_eq!(try_select(&ca).await, "ok ssl=true");
    // An untrusted root fails verify-ca too.
    let ca_bad = Proxy::start(
        &cluster,
        ProxyOptions::pool(1).config_file(backend_yaml(dir.path(), "verify-ca", Some(&root))),
    );
    assert!(try_select(&ca_bad).await.starts_with("08"));
    // Expired certificate under verify-full.
    let (c, k, _) = cert(&["localhost", "127.0.0.1"], true);
    let expired_root = write(dir.path(), "expired.pem", &c);
    enable_backend_ssl(&cluster, &c, &k, "expired");
    let exp = Proxy::start(
        &cluster,
        ProxyOptions::pool(1).config_file(backend_yaml(
            dir.path(),
            "verify-full",
            Some(&expired_root),
        )),
    );
    assert!(try_select(&exp).await.starts_with("08"));
    assert!(pools_at_rest(&exp).await);
    oracle(&prefer).await;
}

/// A fake server that answers the SSLRequest with `reply` and then waits.
async fn fake_backend(reply: Vec<u8>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let reply = reply.clone();
            tokio::spawn(async move {
                let mut req = [0u8; 8];
                if s.read_exact(&mut req).await.is_ok() {
                    let _ = s.write_all(&reply).await;
                    tokio::time::sleep(Duration::from_secs(10)).await;
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b2_backend_prehandshake_injection_and_mitm_n() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut err_frame = b"E".to_vec();
    let text = format!("SFATAL\0C28000\0Minjected-{}\0\0", "x".repeat(5000));
    err_frame.extend_from_slice(&(text.len() as i32 + 4).to_be_bytes());
    err_frame.extend_from_slice(text.as_bytes());
    let mut s_plus = b"S".to_vec();
    s_plus.extend(query("SELECT 'injected'"));
    let cases = [
        ("S plus bytes", s_plus, "prefer"),
        ("E plus long error", err_frame, "prefer"),
        ("MITM N", b"N".to_vec(), "require"),
    ];
    for (what, reply, mode) in cases {
        let fake = fake_backend(reply).await;
        let cfg = backend_yaml(dir.path(), mode, None);
        let proxy = Proxy::start(
            &cluster,
            ProxyOptions::pool(1).config_file(cfg).backend_via(fake),
        );
        let t = Instant::now();
        let err = proxy
            .try_client_with(&proxy.app_config())
            .await
            .err()
            .unwrap_or_else(|| panic!("{what}: login must fail"));
        let text = format!("{err:?}");
        assert!(sqlstate(&err).starts_with("08"), "{what}: {text}");
        assert!(
            !text.contains("injected"),
            "{what}: injected bytes reached the client: {text}"
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{what}: slow failure");
        assert!(pools_at_rest(&proxy).await);
    }
}
