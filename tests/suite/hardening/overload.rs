//! TESTS.md E: connect storm (half TLS), file-descriptor exhaustion, slow readers, cancel
//! storm with a hung cancel path, and `max_client_conn` held for a whole session.
//!
//! E2 lowers the descriptor limit of the proxy process alone (`ProxyOptions::nofile`, through
//! `prlimit`), so the harness and Postgres keep theirs; the proxy's CPU time is read from
//! `/proc/<pid>/stat`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::support::faults::{Fault, FaultProxy};
use crate::support::pg::Cluster;
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::raw::{
    Raw, admin_get, cert, client_tls, first_value, oracle, pools_at_rest, query, send_cancel,
    tls_via_request, write,
};
use crate::support::sql::{BackendSampler, eventually, scalar};
use crate::support::{direct_mode, note_skipped, within};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e1_connect_storm_half_tls() {
    const CLIENTS: usize = 600;
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let (c, k, root) = cert(&["localhost"], false);
    write(dir.path(), "cert.pem", &c);
    write(dir.path(), "key.pem", &k);
    let cfg = write(
        dir.path(),
        "c.yaml",
        &format!(
            "tls:\n  mode: allow\n  cert_file: {0}/cert.pem\n  key_file: {0}/key.pem\n\
             limits:\n  max_handshakes: 200\n  handshake_timeout_ms: 20000\n\
             pool:\n  checkout_timeout_ms: 20000\n",
            dir.path().display()
        ),
    );
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(20).config_file(cfg));
    let sampler = BackendSampler::start(&cluster).await;
    let tls = client_tls(&root, false);
    let (ok, refused) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let t = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let (addr, tls) = (proxy.addr(), tls.clone());
            let (ok, refused) = (ok.clone(), refused.clone());
            tokio::spawn(async move {
                let mut c = if i % 2 == 0 {
                    Raw::tcp(addr).await
                } else {
                    match tls_via_request(addr, tls).await {
                        Ok(c) => c,
                        // Above max_handshakes the refusal comes before any TLS.
                        Err(e) if e.contains("answered 'E'") => {
                            refused.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                        Err(e) => panic!("TLS connect {i}: {e}"),
                    }
                };
                match c.login(0, "app", "secret", &[]).await {
                    Ok(_) => {
                        let msgs = c.query("SELECT 1").await.expect("query after login");
                        assert_eq!(first_value(&msgs).as_deref(), Some("1"));
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        assert!(e.starts_with("53300"), "client {i}: {e}");
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        within(Duration::from_secs(60), "a storm client", task)
            .await
            .expect("storm client");
    }
    let (ok, refused) = (ok.load(Ordering::Relaxed), refused.load(Ordering::Relaxed));
    eprintln!(
        "connect storm: {ok} ok, {refused} refused (53300) in {:?}",
        t.elapsed()
    );
    assert_eq!(ok + refused, CLIENTS);
    assert!(ok >= CLIENTS / 4, "only {ok} of {CLIENTS} got through");
    let (max, _) = sampler.finish().await;
    assert!(max <= 20, "{max} backends for a pool of 20");
    oracle(&proxy).await;
}

/// CPU time (user + system) of process `pid` so far, from `/proc/<pid>/stat`.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("proxy /proc stat");
    // Fields after the parenthesised command name: state is the first, utime the 12th.
    let after = stat.rsplit_once(')').expect("stat format").1;
    let f: Vec<u64> = after
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|v| v.parse().expect("utime/stime"))
        .collect();
    let ticks = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|t| t.trim().parse::<u64>().ok())
        .unwrap_or(100);
    Duration::from_millis((f[0] + f[1]) * 1000 / ticks)
}

/// The test process's own soft RLIMIT_NOFILE, raised to the hard limit (with `prlimit` on our
/// own pid) when it is below `want`.
fn own_nofile(want: u64) -> u64 {
    let soft_hard = || {
        let limits = std::fs::read_to_string("/proc/self/limits").expect("/proc/self/limits");
        let line = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .expect("Max open files line")
            .to_string();
        let v: Vec<u64> = line
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        (v[0], v[1])
    };
    let (soft, hard) = soft_hard();
    if soft >= want || hard <= soft {
        return soft;
    }
    let _ = std::process::Command::new("prlimit")
        .arg("--pid")
        .arg(std::process::id().to_string())
        .arg(format!("--nofile={hard}:{hard}"))
        .status();
    soft_hard().0
}

fn count(text: &str, needle: &str) -> usize {
    text.lines().filter(|l| l.contains(needle)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2_fd_exhaustion_backs_off_and_recovers() {
    const NOFILE: u64 = 256;
    const FLOOD: usize = 1000;
    if direct_mode() {
        note_skipped("E2 limits the proxy's file descriptors");
        return;
    }
    // The flood's sockets are ours too, and other tests of this binary may run beside us.
    let mut flood_size = FLOOD;
    let own = own_nofile(FLOOD as u64 + 2048);
    if own < FLOOD as u64 + 2048 {
        flood_size = (own.saturating_sub(1024) as usize).max(2 * NOFILE as usize);
        eprintln!("E2: own RLIMIT_NOFILE is {own}: flooding with {flood_size} connections");
    }
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    // Flood connections never send a startup packet; they hold their descriptors until the
    // test closes them, not until a handshake timeout frees some in the middle.
    let cfg = write(
        dir.path(),
        "c.yaml",
        "limits:\n  handshake_timeout_ms: 120000\n",
    );
    let proxy = Proxy::start(
        &cluster,
        ProxyOptions::pool(2).config_file(cfg).nofile(NOFILE),
    );
    let pid = proxy.pid().expect("proxy pid");
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("proxy limits");
    assert!(
        limits
            .lines()
            .any(|l| l.starts_with("Max open files") && l.contains(&NOFILE.to_string())),
        "the proxy runs without the lowered limit:\n{limits}"
    );
    let client = proxy.client().await;
    assert_eq!(scalar(&client, "SELECT 1").await, "1");

    // More connections than the proxy has descriptors. It accepts until EMFILE; the kernel
    // completes another listen backlog's worth (128, as std and mio ask) and drops the SYNs of
    // the rest, whose connects then wait in vain: they give up after two SYN retries.
    let flood_start = Instant::now();
    let attempts = (0..flood_size).map(|_| {
        let addr = proxy.addr();
        async move {
            tokio::time::timeout(
                Duration::from_millis(3500),
                tokio::net::TcpStream::connect(addr),
            )
            .await
            .ok()
            .and_then(Result::ok)
        }
    });
    let flood: Vec<_> = futures_util::future::join_all(attempts)
        .await
        .into_iter()
        .flatten()
        .collect();
    eprintln!(
        "E2: {} of {flood_size} connects completed; the rest found the backlog full",
        flood.len()
    );
    assert!(
        flood.len() as u64 > NOFILE,
        "only {} connections for a proxy limited to {NOFILE} descriptors",
        flood.len()
    );
    eventually(
        Duration::from_secs(10),
        "accept fails with EMFILE",
        || async { count(&proxy.stderr_tail(), "accept failed") > 0 },
    )
    .await;
    let first = proxy.stderr_tail();
    assert!(
        first.contains("Too many open files"),
        "accept failed for another reason:\n{first}"
    );

    // While exhausted: the accept loop sleeps instead of spinning on the ready listener.
    let (cpu0, t0) = (cpu_time(pid), Instant::now());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (cpu, wall) = (cpu_time(pid) - cpu0, t0.elapsed());
    let share = cpu.as_secs_f64() / wall.as_secs_f64();
    let warnings = count(&proxy.stderr_tail(), "accept failed");
    let exhausted = flood_start.elapsed();
    eprintln!(
        "E2: proxy used {cpu:?} of CPU in {wall:?} ({share:.2} of a core); \
         {warnings} accept warnings in {exhausted:?}"
    );
    // Idle, it uses next to nothing; a spinning accept loop takes most of a core even when
    // the machine is busy.
    assert!(
        share < 0.25,
        "the proxy spins while out of descriptors: {share:.2} of a core"
    );
    // One warning per 5 s (src/server.rs), where a spinning loop logs thousands and a bare
    // backoff (5 ms doubling to a 1 s cap) one a second after its first eight.
    let allowed = 2 + (exhausted.as_secs() / 5) as usize;
    assert!(
        warnings <= allowed,
        "{warnings} accept warnings in {exhausted:?}: the logs are not rate-limited"
    );
    // Established sessions are unaffected: the pooled server connection needs no new fd.
    assert_eq!(scalar(&client, "SELECT 2").await, "2");

    // Descriptors free up: the service recovers within a few seconds.
    drop(flood);
    let t = Instant::now();
    eventually(
        Duration::from_secs(10),
        "a fresh client after the flood",
        || async {
            match proxy.try_client_with(&proxy.app_config()).await {
                Ok((c, _)) => c.simple_query("SELECT 1").await.is_ok(),
                Err(_) => false,
            }
        },
    )
    .await;
    let recovered = t.elapsed();
    eprintln!("E2: recovered {recovered:?} after the flood closed");
    assert!(
        recovered < Duration::from_secs(5),
        "recovery took {recovered:?}"
    );
    assert!(
        std::fs::metadata(format!("/proc/{pid}")).is_ok(),
        "the proxy exited"
    );
    drop(client);
    oracle(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e3_slow_readers_are_cut_off() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = write(
        dir.path(),
        "c.yaml",
        "limits:\n  client_write_timeout_ms: 1000\n",
    );
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(6).config_file(cfg));
    let mut zombies = Vec::new();
    for _ in 0..5 {
        let tcp = tokio::net::TcpStream::connect(proxy.addr())
            .await
            .expect("connect");
        socket2::SockRef::from(&tcp)
            .set_recv_buffer_size(4096)
            .expect("rcvbuf");
        let mut c = Raw::over(tcp);
        c.app_login().await;
        c.send(&query(
            "SELECT repeat('x', 1000000) FROM generate_series(1, 50)",
        ))
        .await
        .expect("50 MB query");
        zombies.push(c);
    }
    // Others are unaffected meanwhile.
    let other = proxy.client().await;
    for i in 0..5 {
        assert_eq!(scalar(&other, &format!("SELECT {i}")).await, i.to_string());
    }
    // The write timeout ends the zombies' sessions and frees their servers.
    let monitor = cluster.monitor().await;
    eventually(Duration::from_secs(15), "zombie queries gone", || async {
        monitor.active_queries_like("repeat('x'").await.is_empty()
    })
    .await;
    eventually(Duration::from_secs(10), "pools at rest", || {
        pools_at_rest(&proxy)
    })
    .await;
    drop(zombies);
    oracle(&proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e4_cancel_storm_and_hung_cancel_path() {
    let cluster = Cluster::start();
    let fault = FaultProxy::start(cluster.addr()).await;
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(3).backend_via(fault.addr()));
    let addr = proxy.addr();
    let mut a = Raw::tcp(addr).await;
    let login = a.login(0, "app", "secret", &[]).await.expect("login");
    let (pid, key) = crate::support::raw::key_data(&login);
    // 1 000 cancel requests, 50 in flight at a time, mostly bogus, a few valid for an idle
    // client; the admin API and other clients stay responsive.
    let t = Instant::now();
    let sent = Arc::new(AtomicUsize::new(0));
    let storm: Vec<_> = (0..50)
        .map(|w| {
            let (key, sent) = (key.clone(), sent.clone());
            tokio::spawn(async move {
                for i in 0..20 {
                    if (w + i) % 10 == 0 {
                        send_cancel(addr, pid, &key).await;
                    } else {
                        send_cancel(addr, w * 1000 + i, &[1, 2, 3, 4]).await;
                    }
                    sent.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let other = proxy.client().await;
    while sent.load(Ordering::Relaxed) < 500 {
        let t0 = Instant::now();
        admin_get(&proxy, "/v1/pools").await;
        assert_eq!(scalar(&other, "SELECT 1").await, "1");
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "proxy unresponsive in the storm"
        );
    }
    for s in storm {
        within(Duration::from_secs(60), "cancel storm", s)
            .await
            .expect("storm task");
    }
    eprintln!("1000 cancels in {:?}", t.elapsed());
    // `other` holds a backend in a transaction meanwhile, so the pool has two open: after the
    // hung cancel below, `a`'s session keeps its backend until that cancel gives up (a late
    // cancel must not reach the next borrower), and `other` must then find the second one
    // idle rather than need a new connection through the hung path.
    other.batch_execute("BEGIN").await.expect("BEGIN");
    assert_eq!(scalar(&other, "SELECT 2").await, "2");
    let msgs = a.query("SELECT 3").await.expect("idle client unaffected");
    assert_eq!(first_value(&msgs).as_deref(), Some("3"));
    other.batch_execute("COMMIT").await.expect("COMMIT");
    // A cancel path that accepts but never answers: the client's cancel times out without
    // blocking anyone else, and the query still finishes.
    fault.set(Fault::HangNew);
    a.send(&query("SELECT pg_sleep(1), 4"))
        .await
        .expect("sleep");
    tokio::time::sleep(Duration::from_millis(200)).await;
    send_cancel(addr, pid, &key).await;
    let msgs = a.until_ready().await.expect("the query finishes");
    assert!(msgs.iter().any(|m| m.0 == b'D' || m.0 == b'E'));
    assert_eq!(scalar(&other, "SELECT 5").await, "5");
    fault.set(Fault::Pass);
    drop((a, other));
    oracle(&proxy).await;
}

/// `limits.max_client_conn` counts a client for as long as it is connected, including after
/// a login thread handed its session to the session thread: the next client is told 53300
/// at once, and a freed place is reusable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e5_max_client_conn_counts_clients_for_their_whole_session() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = write(dir.path(), "c.yaml", "limits:\n  max_client_conn: 3\n");
    for threads in ["1", "2"] {
        let options = ProxyOptions::pool(2)
            .config_file(&cfg)
            .arg("--worker-threads")
            .arg(threads);
        let proxy = Proxy::start(&cluster, options);
        if proxy.is_direct() {
            return note_skipped("max_client_conn is the proxy's limit");
        }
        let config = proxy.app_config();
        let mut held = Vec::new();
        for i in 0..3 {
            let (client, task) = proxy
                .try_client_with(&config)
                .await
                .unwrap_or_else(|e| panic!("client {i} of 3 ({threads} threads): {e}"));
            client.simple_query("SELECT 1").await.expect("SELECT 1");
            held.push((client, task));
        }
        let e = match proxy.try_client_with(&config).await {
            Ok(_) => panic!("a 4th client was let in with max_client_conn 3 ({threads} threads)"),
            Err(e) => e,
        };
        let db = e.as_db_error().expect("a server error");
        assert_eq!(db.code().code(), "53300", "{db:?}");
        assert!(db.message().contains("too many clients"), "{db:?}");
        // Every held client still works, then one leaves and its place is reusable.
        for (client, _) in &held {
            client.simple_query("SELECT 2").await.expect("held client");
        }
        drop(held.pop());
        let deadline = Instant::now() + Duration::from_secs(5);
        let (client, _task) = loop {
            match proxy.try_client_with(&config).await {
                Ok(c) => break c,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("the freed place was not reusable ({threads} threads): {e}"),
            }
        };
        client
            .simple_query("SELECT 3")
            .await
            .expect("the freed place");
    }
}
