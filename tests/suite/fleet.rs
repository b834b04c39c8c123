//! Issue 10: several pgsluice instances over one Postgres, coordinated through a real Redis
//! that the harness starts (`redis-server` from PATH; `.ci/run` installs it).
//!
//! * a rule PUT on one instance is enforced by the others within 1 s, and a DELETE likewise;
//!   fleet-scoped callers split `max_concurrency` between the live members;
//! * a `scope: fleet` THROTTLE admits about its rate across three instances, where the same
//!   rule per instance admits about three times as much;
//! * a CancelRequest sent to one member cancels a query running through another (members
//!   without a configured `peer_id` claim one in Redis);
//! * Redis killed: every instance keeps enforcing its rules, writes are refused with 503;
//!   Redis back (empty, as without persistence): it is re-seeded and changes flow again;
//! * two instances configured with one `instance_id` are reported in the log;
//! * an automatic rule one instance's anomaly detector installs (`auto_rules.mode: enforce`)
//!   is enforced by the other, and the other does not install one of its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_postgres::NoTls;

use crate::support::pg::Cluster;
use crate::support::proxy::{ADMIN_READ_TOKEN, Proxy, ProxyOptions};
use crate::support::redis::Redis;
use crate::support::sql::{eventually, sqlstate};
use crate::support::{direct_mode, note_skipped, within};

const W: &str = "fleet-test-write-token";
const STEP: Duration = Duration::from_secs(10);

/// A fleet: Redis, a cluster and `n` instances (`i1`, `i2`, … with peer ids 1, 2, …).
/// Field order is drop order.
struct Fleet {
    proxies: Vec<Proxy>,
    redis: Redis,
    _cluster: Cluster,
    _dir: tempfile::TempDir,
}

/// Instance `i`'s config; `peer_id: i` unless `claim` (then it claims one in Redis).
fn yaml(redis: &Redis, i: usize, claim: bool, extra: &str) -> String {
    let peer_id = if claim {
        String::new()
    } else {
        format!("peer_id: {i}\n")
    };
    format!(
        "{peer_id}admin:\n  write_token: {W}\nfleet:\n  redis_url: \"{}\"\n  instance_id: i{i}\n  heartbeat_ms: 200\n{extra}",
        redis.url()
    )
}

fn start(n: usize, extra: &str) -> Option<Fleet> {
    start_with(n, false, extra)
}

fn start_with(n: usize, claim: bool, extra: &str) -> Option<Fleet> {
    if direct_mode() {
        note_skipped("fleet tests (they need the proxy)");
        return None;
    }
    let redis = Redis::start();
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("config dir");
    let proxies = (1..=n)
        .map(|i| {
            let path = dir.path().join(format!("i{i}.yaml"));
            std::fs::write(&path, yaml(&redis, i, claim, extra)).expect("write config");
            Proxy::start(&cluster, ProxyOptions::pool(4).config_file(path))
        })
        .collect();
    Some(Fleet {
        proxies,
        redis,
        _cluster: cluster,
        _dir: dir,
    })
}

impl Fleet {
    /// Waits until every instance sees `n` live members and Redis up.
    async fn settled(&self, n: usize) {
        for p in &self.proxies {
            eventually(STEP, "every member is seen", || async {
                let f = admin(p, "GET", "/v1/fleet", None).await.1;
                f["redis_up"] == json!(true) && f["members"].as_array().map(Vec::len) == Some(n)
            })
            .await;
        }
    }
}

/// One admin API request; (status, JSON body or Null). Mutations use the write token.
async fn admin(proxy: &Proxy, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let (status, text) = http(proxy, method, path, body).await;
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// The first caller's `local_max_concurrency` on an instance.
async fn share(p: &Proxy) -> Option<u64> {
    let v = admin(p, "GET", "/v1/callers", None).await.1;
    v["callers"][0]["local_max_concurrency"].as_u64()
}

/// A sample from an instance's /metrics (0 when absent).
async fn metric(proxy: &Proxy, series: &str) -> f64 {
    let text = http(proxy, "GET", "/metrics", None).await.1;
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The admin API with the read token for GET, the write token otherwise; (status, body).
async fn http(proxy: &Proxy, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
    let token = if method == "GET" { ADMIN_READ_TOKEN } else { W };
    let body = body.map(Value::to_string);
    proxy
        .admin_request(method, path, token, body.as_deref())
        .await
}

fn fingerprint(sql: &str) -> String {
    let classifier = pgsluice::classify::Classifier::new(100, 64 * 1024);
    format!("{:016x}", classifier.classify(sql).fingerprint)
}

/// Runs `sql` (simple protocol); `Ok` or the SQLSTATE.
async fn run(client: &tokio_postgres::Client, sql: &str) -> Result<(), String> {
    match within(STEP, sql, client.simple_query(sql)).await {
        Ok(_) => Ok(()),
        Err(e) => Err(sqlstate(&e)),
    }
}

/// Polls `sql` through `client` until it is refused (`want_refused`) or runs; the time taken.
async fn until(client: &tokio_postgres::Client, sql: &str, want_refused: bool) -> Duration {
    let t = Instant::now();
    loop {
        let r = run(client, sql).await;
        match (&r, want_refused) {
            (Err(code), true) if code == "53400" => return t.elapsed(),
            (Ok(()), false) => return t.elapsed(),
            (Err(code), _) if code != "53400" => panic!("{sql}: unexpected SQLSTATE {code}"),
            _ => {}
        }
        assert!(t.elapsed() < STEP, "{sql}: no change within {STEP:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn rule_path(fp: &str) -> String {
    format!("/v1/rules/fingerprint/{fp}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_put_on_one_instance_is_enforced_by_all_within_a_second() {
    let callers = "callers:\n  - name: app\n    match: { application_name: fleet-app }\n    max_concurrency: 6\n    max_qps: 1000\n    scope: fleet\n";
    let Some(f) = start(3, callers) else { return };
    f.settled(3).await;
    let (a, b, c) = (&f.proxies[0], &f.proxies[1], &f.proxies[2]);
    let sql = "SELECT count(*) FROM pg_class WHERE relname = 'fleet_probe'";
    let fp = fingerprint(sql);
    let client_b = b.client().await;
    let client_c = c.client().await;
    run(&client_b, sql).await.expect("runs before the rule");

    // PUT on A; B and C refuse within a second.
    let rule = json!({"action": "REJECT", "error_message": "blocked fleet-wide"});
    let t = Instant::now();
    let (status, body) = admin(a, "PUT", &rule_path(&fp), Some(&rule)).await;
    assert_eq!(status, 201, "{body}");
    let took_b = until(&client_b, sql, true).await;
    let took_c = until(&client_c, sql, true).await;
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "B {took_b:?}, C {took_c:?}"
    );
    let listed = admin(c, "GET", "/v1/rules", None).await.1;
    assert_eq!(listed["rules"][0]["fingerprint"], json!(fp), "{listed}");

    // DELETE on B; A and C run it again within a second.
    let client_a = a.client().await;
    assert_eq!(run(&client_a, sql).await, Err("53400".into()));
    let t = Instant::now();
    let (status, body) = admin(b, "DELETE", &rule_path(&fp), None).await;
    assert_eq!(status, 200, "{body}");
    until(&client_a, sql, false).await;
    until(&client_c, sql, false).await;
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    let (status, _) = admin(c, "DELETE", &rule_path(&fp), None).await;
    assert_eq!(status, 404, "deleted fleet-wide");

    // Bad input is refused with the field named, nowhere applied.
    let bad = json!({"action": "REJECT", "scope": "fleet"});
    let (status, body) = admin(a, "PUT", &rule_path(&fp), Some(&bad)).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["field"], json!("scope"), "{body}");
    assert_eq!(
        admin(b, "GET", "/v1/rules", None).await.1["rules"],
        json!([])
    );

    // A rule with a TTL ends everywhere at once and leaves Redis.
    let rule = json!({"action": "REJECT", "ttl_seconds": 1});
    let (status, body) = admin(a, "PUT", &rule_path(&fp), Some(&rule)).await;
    assert_eq!(status, 201, "{body}");
    until(&client_c, sql, true).await;
    until(&client_b, sql, false).await;
    eventually(STEP, "the expired rule leaves Redis", || async {
        !f.redis.command("HKEYS pgsluice:rules").contains(&fp)
    })
    .await;

    // A fleet-scoped caller's first statement after a quiet spell (its startup lease expired
    // long ago) waits for a lease instead of being refused.
    let mut config = a.app_config();
    config.application_name("fleet-app");
    let (app_client, _conn) = a.client_with(&config).await;
    let before = metric(a, "pgsluice_fleet_lease_requests_total").await;
    run(&app_client, "SELECT 1")
        .await
        .expect("first statement after idling");
    assert!(metric(a, "pgsluice_fleet_lease_requests_total").await > before);

    // A fleet-scoped caller's max_concurrency 6 is 2 per member; 3 once one member leaves.
    for p in &f.proxies {
        assert_eq!(share(p).await, Some(2));
    }
    c.sigterm();
    for p in [a, b] {
        eventually(STEP, "the share grows when a member leaves", || async {
            share(p).await == Some(3)
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_throttle_admits_its_rate_across_three_instances() {
    let Some(f) = start(3, "") else { return };
    f.settled(3).await;
    let sql = "SELECT count(*) FROM pg_class WHERE relname = 'fleet_rate'";
    let fp = fingerprint(sql);
    let window = Duration::from_secs(3);

    // (scope, instances the load goes through)
    let scenarios = [("fleet", 3), ("fleet", 1), ("instance", 3)];
    let mut admitted = Vec::new();
    for (scope, spread) in scenarios {
        let mut leased_before = 0.0;
        for p in &f.proxies {
            leased_before += metric(p, "pgsluice_fleet_lease_tokens_total").await;
        }
        let rule = json!({"action": "THROTTLE", "max_qps": 10, "burst": 10, "scope": scope});
        let (status, body) = admin(&f.proxies[0], "PUT", &rule_path(&fp), Some(&rule)).await;
        assert!(status == 201 || status == 200, "{body}");
        let created = body["created_unix_ms"].clone();
        for p in &f.proxies {
            eventually(STEP, "the new rule is everywhere", || async {
                admin(p, "GET", &rule_path(&fp), None).await.1["created_unix_ms"] == created
            })
            .await;
        }
        let ok = Arc::new(AtomicU64::new(0));
        let refused = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        let started = Instant::now();
        for p in &f.proxies[..spread] {
            for _ in 0..9 / spread {
                let client = p.client().await;
                let (ok, refused, stop) = (ok.clone(), refused.clone(), stop.clone());
                tasks.push(tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        match client.simple_query(sql).await {
                            Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                            Err(e) => {
                                assert_eq!(sqlstate(&e), "53400", "{e}");
                                refused.fetch_add(1, Ordering::Relaxed)
                            }
                        };
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }));
            }
        }
        tokio::time::sleep(window).await;
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            within(STEP, "load task ends", t).await.expect("load task");
        }
        // The bucket is at most full (burst 10) when the load starts; from then on 10/s.
        let ceiling = 10 + (10.0 * started.elapsed().as_secs_f64()).ceil() as u64;
        let (n, r) = (ok.load(Ordering::Relaxed), refused.load(Ordering::Relaxed));
        let mut leased = -leased_before;
        for p in &f.proxies {
            leased += metric(p, "pgsluice_fleet_lease_tokens_total").await;
        }
        eprintln!(
            "scope {scope} through {spread} instance(s): {n} admitted, {r} refused in {window:?}; {leased} tokens leased"
        );
        assert!(r > 0, "the load exceeds the rate");
        if scope == "fleet" {
            assert!(
                leased >= n as f64,
                "every admitted statement had a leased token"
            );
        }
        if scope == "fleet" {
            // Shared: burst + rate · elapsed (40 for exactly 3 s) at most, whether the load is
            // spread or goes through one instance (a static split would give that one a third).
            assert!(
                (28..=ceiling).contains(&n),
                "fleet-wide admitted {n}, ceiling {ceiling}"
            );
        }
        admitted.push(n);
    }
    // Per instance the same rule admits three times as much.
    assert!(
        admitted[2] >= admitted[0] * 2,
        "instance scope vs fleet scope: {admitted:?}"
    );

    // QUEUE: over the rate, statements wait for a fleet token (up to the caller's queue
    // timeout, 5 s by default) instead of being refused: 2/s with burst 1, four in a row
    // through two instances take about 1.5 s and all run.
    let rule = json!({"action": "THROTTLE", "max_qps": 2, "burst": 1,
                      "action_on_exceed": "QUEUE", "scope": "fleet"});
    let (status, body) = admin(&f.proxies[0], "PUT", &rule_path(&fp), Some(&rule)).await;
    assert_eq!(status, 200, "{body}");
    let created = body["created_unix_ms"].clone();
    for p in &f.proxies {
        eventually(STEP, "the QUEUE rule is everywhere", || async {
            admin(p, "GET", &rule_path(&fp), None).await.1["created_unix_ms"] == created
        })
        .await;
    }
    let clients = [f.proxies[1].client().await, f.proxies[2].client().await];
    let t = Instant::now();
    for i in 0..4 {
        run(&clients[i % 2], sql)
            .await
            .unwrap_or_else(|code| panic!("statement {i} refused ({code}) instead of queued"));
    }
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(1200) && took < Duration::from_secs(4),
        "{took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_sent_to_another_member_reaches_the_query() {
    // No peer_id configured: each member claims one in Redis.
    let Some(f) = start_with(3, true, "") else {
        return;
    };
    f.settled(3).await;
    let members = admin(&f.proxies[0], "GET", "/v1/fleet", None).await.1["members"].clone();
    let mut ids: Vec<u64> = members
        .as_array()
        .expect("members")
        .iter()
        .filter_map(|m| m["peer_id"].as_u64())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert!(
        ids.len() == 3 && !ids.contains(&0),
        "claimed peer ids: {members}"
    );
    let (a, b) = (&f.proxies[0], &f.proxies[1]);
    let client = a.client().await;
    let token = client.cancel_token();
    let sleeper = tokio::spawn(async move {
        let r = client.simple_query("SELECT pg_sleep(30)").await;
        (r.map(drop), client)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t = Instant::now();
    let stream = TcpStream::connect(b.addr()).await.expect("connect to B");
    token
        .cancel_query_raw(stream, NoTls)
        .await
        .expect("cancel request sent to B");
    let (r, client) = within(STEP, "the cancelled query ends", sleeper)
        .await
        .expect("sleeper task");
    let e = r.expect_err("cancelled");
    assert_eq!(sqlstate(&e), "57014", "{e}\n--- B ---\n{}", b.stderr_tail());
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // B counts the forward once the owner has closed the forwarded request.
    eventually(STEP, "B counts one forwarded cancel", || async {
        metric(b, "pgsluice_cancels_total{outcome=\"forwarded\"}").await == 1.0
    })
    .await;
    run(&client, "SELECT 1").await.expect("session goes on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_rules_stay_enforced_and_come_back_in_sync() {
    let Some(mut f) = start(3, "") else { return };
    f.settled(3).await;
    let blocked = "SELECT count(*) FROM pg_class WHERE relname = 'fleet_outage'";
    let later = "SELECT count(*) FROM pg_namespace WHERE nspname = 'fleet_later'";
    let (fp, fp_later) = (fingerprint(blocked), fingerprint(later));
    assert_ne!(fp, fp_later);
    let rule = json!({"action": "REJECT"});
    let (status, _) = admin(&f.proxies[0], "PUT", &rule_path(&fp), Some(&rule)).await;
    assert_eq!(status, 201);
    let mut clients = Vec::new();
    for p in &f.proxies {
        let c = p.client().await;
        until(&c, blocked, true).await;
        clients.push(c);
    }

    f.redis.kill();
    for p in &f.proxies {
        eventually(STEP, "Redis seen down", || async {
            metric(p, "pgsluice_fleet_redis_up").await == 0.0
        })
        .await;
    }
    for c in &clients {
        assert_eq!(run(c, blocked).await, Err("53400".into()), "rule kept");
        run(c, later).await.expect("other statements run");
    }
    let (status, body) = admin(&f.proxies[1], "PUT", &rule_path(&fp_later), Some(&rule)).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or("")
            .contains("nothing was applied"),
        "{body}"
    );
    run(&clients[1], later)
        .await
        .expect("nothing applied locally");

    // Back, empty: re-seeded from the instances' rules, and changes flow again.
    f.redis.restart();
    f.settled(3).await;
    assert!(
        f.redis.command("HKEYS pgsluice:rules").contains(&fp),
        "re-seeded"
    );
    let (status, body) = admin(&f.proxies[2], "PUT", &rule_path(&fp_later), Some(&rule)).await;
    assert_eq!(status, 201, "{body}");
    let (status, _) = admin(&f.proxies[1], "DELETE", &rule_path(&fp), None).await;
    assert_eq!(status, 200);
    for c in &clients {
        until(c, later, true).await;
        until(c, blocked, false).await;
    }
    let epochs: Vec<Value> = {
        let mut v = Vec::new();
        for p in &f.proxies {
            v.push(admin(p, "GET", "/v1/fleet", None).await.1["rules_epoch"].clone());
        }
        v
    };
    assert!(epochs.windows(2).all(|w| w[0] == w[1]), "{epochs:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_under_one_instance_id_are_reported() {
    if direct_mode() {
        note_skipped("fleet tests (they need the proxy)");
        return;
    }
    let redis = Redis::start();
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().expect("config dir");
    let path = dir.path().join("twin.yaml");
    let text = yaml(&redis, 1, true, "").replace("instance_id: i1", "instance_id: twin");
    std::fs::write(&path, text).expect("write config");
    let twins: Vec<Proxy> = (0..2)
        .map(|_| Proxy::start(&cluster, ProxyOptions::pool(2).config_file(&path)))
        .collect();
    eventually(STEP, "the duplicate id is logged", || async {
        twins.iter().any(|p| {
            p.stderr_tail()
                .contains("another live instance uses the same instance_id")
        })
    })
    .await;
    let members = admin(&twins[0], "GET", "/v1/fleet", None).await.1["members"].clone();
    assert_eq!(members.as_array().map(Vec::len), Some(1), "{members}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_automatic_rule_from_one_instance_is_enforced_by_the_fleet() {
    let extra = "detector: { tick_ms: 100, window_ms: 200, warmup_ms: 1500 }\n\
                 auto_rules: { mode: enforce, ttl_seconds: 60 }\n";
    let Some(fleet) = start(2, extra) else { return };
    fleet.settled(2).await;
    let (p1, p2) = (&fleet.proxies[0], &fleet.proxies[1]);
    let c1 = p1.client().await;
    let c2 = p2.client().await;
    let hot = "SELECT 41 + 1 AS hot";
    let fp = fingerprint(hot);
    // A baseline of a few per second on the first instance, past the warm-up.
    for _ in 0..20 {
        run(&c1, hot).await.expect("steady");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The step, on the first instance only: until its own rule refuses it.
    let stepped = Instant::now();
    let mut refused = false;
    while !refused && stepped.elapsed() < STEP {
        refused = run(&c1, hot).await.is_err();
    }
    assert!(refused, "the flood on i1 was never refused");
    let (status, rule) = admin(p1, "GET", &rule_path(&fp), None).await;
    assert_eq!(status, 200, "{rule}");
    assert_eq!(rule["origin"], "auto", "{rule}");
    // The second instance enforces the same rule without having seen the flood.
    eventually(STEP, "i2 has the automatic rule", || async {
        admin(p2, "GET", &rule_path(&fp), None).await.1["origin"] == json!("auto")
    })
    .await;
    until(&c2, hot, true).await;
    assert_eq!(
        metric(p2, r#"pgsluice_auto_rules_total{outcome="installed"}"#).await,
        0.0,
        "i2 installed nothing itself"
    );
    assert_eq!(
        metric(p1, r#"pgsluice_auto_rules_total{outcome="installed"}"#).await,
        1.0
    );
}
