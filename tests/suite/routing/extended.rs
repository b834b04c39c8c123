//! Replica routing in the extended protocol and read-your-writes, against a real primary and
//! its streaming hot standby:
//!
//! * prepared statements (tokio-postgres: a named Parse and Describe, then Bind/Execute/Sync)
//!   of a `route: replica` caller run on the standby, the same named statement on both
//!   servers as each batch goes where it may; writes and a batch that mixes a write with a
//!   read run on the primary, and so does a write pipelined behind a routed read;
//! * read-your-writes: with replay paused on the standby (so it is stale, but within
//!   `max_replica_lag_ms: 0`, which never skips it for lag) a client that writes and reads
//!   its row back at once always finds it, read on the primary, while a client that wrote
//!   nothing still reads from the standby; once replay resumes, the writer's reads go back to
//!   the standby. A caller with `read_your_writes_ms` stays on the primary for that window
//!   after its write, then reads from the (still stale) standby;
//! * the same through pgx v4 (`tests/drivers/pgx_replica_reads.go`): its cached and explicitly
//!   prepared statements on the standby, a write read back at once, a `pgx.Batch` of a read
//!   and an INSERT on the primary.

use std::time::{Duration, Instant};

use tokio_postgres::Client;

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::spawned::{Spawned, get, metric, spawn};
use crate::support::wire::{Backend, WireClient, first_column};

/// `true` on a hot standby: a built-in the classifier knows touches nothing, so routable.
const ON_STANDBY: &str = "SELECT current_setting('transaction_read_only') = 'on'";

/// A primary with a `notes` table the app user owns, its standby, and a proxy whose callers
/// `analytics` (`route: replica`, with a statement timeout the proxy injects wherever its
/// statements run), `web` (`route: replica`), `windowed` (`route: replica`,
/// `read_your_writes_ms: 1500`) are told apart by application_name.
struct Setup {
    primary: Cluster,
    replica: Cluster,
    proxy: Spawned,
    _dir: tempfile::TempDir,
}

impl Setup {
    fn start() -> Setup {
        let primary = Cluster::start();
        primary.psql_on(
            APP_DB,
            &format!(
                "CREATE TABLE notes (id int PRIMARY KEY, v text NOT NULL); \
                 ALTER TABLE notes OWNER TO {APP_USER}"
            ),
        );
        let replica = Cluster::replica_of(&primary);
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("pgsluice.yaml");
        let caller = |name: &str, extra: &str| {
            format!(
                "  - name: {name}\n    match: {{ application_name: {name} }}\n    \
                 route: replica\n{extra}"
            )
        };
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:0\nadmin:\n  listen: 127.0.0.1:0\n  write_token: w\n\
                 auth:\n  users:\n    - {{ name: {APP_USER}, password: {APP_PASSWORD} }}\n\
                 databases:\n  - name: {APP_DB}\n    url: \"postgres://{}/{APP_DB}\"\n    \
                 replicas: [\"postgres://{}/{APP_DB}\"]\n    max_replica_lag_ms: 0\n\
                 callers:\n{}{}{}",
                primary.addr(),
                replica.addr(),
                caller("analytics", "    statement_timeout_ms: 5000\n"),
                caller("web", ""),
                caller("windowed", "    read_your_writes_ms: 1500\n"),
            ),
        )
        .expect("write config");
        let proxy = spawn(&[], &["--config", &config.display().to_string()]);
        Setup {
            primary,
            replica,
            proxy,
            _dir: dir,
        }
    }

    fn url(&self, app: &str) -> String {
        format!(
            "host={} port={} user={APP_USER} password={APP_PASSWORD} dbname={APP_DB} \
             application_name={app}",
            self.proxy.listen.ip(),
            self.proxy.listen.port()
        )
    }

    async fn connect(&self, app: &str) -> Client {
        let (c, conn) = tokio_postgres::connect(&self.url(app), tokio_postgres::NoTls)
            .await
            .expect("login");
        tokio::spawn(conn);
        c
    }

    /// `pgsluice_replica_reads_total` of `caller` for `decision`.
    fn replica_reads(&self, caller: &str, decision: &str) -> f64 {
        let (_, text) = get(self.proxy.admin, "/metrics");
        metric(
            &text,
            &format!("pgsluice_replica_reads_total{{caller=\"{caller}\",decision=\"{decision}\"}}"),
        )
        .unwrap_or(-1.0)
    }
}

/// Whether `c`'s extended-protocol read (a prepared statement) ran on the standby.
async fn extended_on_standby(c: &Client) -> bool {
    c.query_one(ON_STANDBY, &[])
        .await
        .expect("extended read")
        .get(0)
}

/// Waits (at most 15 s) until `c`'s extended read runs on the standby: the replica pool is
/// made and probed at the first routed read, and until then reads go to the primary.
async fn until_extended_on_standby(c: &Client) {
    let t = Instant::now();
    while !extended_on_standby(c).await {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "never routed to the replica"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_reads_run_on_the_standby_and_writes_on_the_primary() {
    let s = Setup::start();
    let analytics = s.connect("analytics").await;
    until_extended_on_standby(&analytics).await;
    // The caller's statement timeout is injected on the standby too (a swallowed
    // `set_config(.., true)` in front of the batch).
    let t = Instant::now();
    loop {
        let row = analytics
            .query_one(
                "SELECT current_setting('transaction_read_only') = 'on', \
                 current_setting('statement_timeout')",
                &[],
            )
            .await
            .expect("read with a budget");
        if row.get::<_, bool>(0) {
            assert_eq!(row.get::<_, String>(1), "5s");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "never on the standby"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // One named statement, prepared once (Parse + Describe, itself a read batch) and executed
    // many times, on the standby; then, right after the client's writes, on the primary
    // (read-your-writes), and on the standby again once it has replayed them — one statement
    // on backends of both servers, every run answering right.
    let read = analytics
        .prepare("SELECT current_setting('transaction_read_only') = 'on', $1::int + 1")
        .await
        .expect("prepare the read");
    let insert = analytics
        .prepare(
            "INSERT INTO notes (id, v) VALUES ($1, 'x') \
             RETURNING current_setting('transaction_read_only')",
        )
        .await
        .expect("prepare the write");
    let mut on_standby = 0;
    for i in 0..20i32 {
        let row = analytics
            .query_one(&read, &[&i])
            .await
            .expect("prepared read");
        assert_eq!(row.get::<_, i32>(1), i + 1);
        on_standby += usize::from(row.get::<_, bool>(0));
    }
    // (Most: on a loaded machine a probe can time out and send a read to the primary.)
    assert!(on_standby >= 15, "{on_standby} of 20 on the standby");
    for i in 0..5i32 {
        let row = analytics
            .query_one(&insert, &[&i])
            .await
            .expect("the prepared write runs on the primary");
        assert_eq!(row.get::<_, String>(0), "off");
        let row = analytics
            .query_one(&read, &[&i])
            .await
            .expect("prepared read");
        assert_eq!(row.get::<_, i32>(1), i + 1);
    }
    let t = Instant::now();
    loop {
        let row = analytics
            .query_one(&read, &[&7i32])
            .await
            .expect("prepared read");
        assert_eq!(row.get::<_, i32>(1), 8);
        if row.get::<_, bool>(0) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "the prepared read never went back to the standby"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A write pipelined behind a routed read (two batches in flight): it waits for the read
    // and runs on the primary.
    until_extended_on_standby(&analytics).await;
    for i in 100..105i32 {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&i];
        let (r, w) = tokio::join!(
            analytics.query_one(&read, &params),
            analytics.query_one(&insert, &params)
        );
        assert_eq!(r.expect("pipelined read").get::<_, i32>(1), i + 1);
        assert_eq!(w.expect("pipelined write").get::<_, String>(0), "off");
    }

    // One batch (one Sync) with a read and then a write: all of it on the primary, read
    // included, whether its Parse opens it or a Bind of a statement prepared before.
    let mut wire = WireClient::connect_with(
        s.proxy.listen,
        APP_USER,
        APP_PASSWORD,
        APP_DB,
        &[("application_name", "analytics")],
    )
    .await
    .expect("wire login");
    let t = Instant::now();
    loop {
        // A read alone in its batch goes to the standby (once the probe has caught up).
        wire.parse("", ON_STANDBY)
            .bind("", "", &[])
            .execute("", 0)
            .sync();
        wire.send().await.expect("send");
        let rows = first_column(&wire.until_ready().await.expect("read batch"));
        if rows == [Some("t".to_owned())] {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "never on the standby"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wire.parse("r", ON_STANDBY)
        .bind("", "r", &[])
        .execute("", 0)
        .parse("", "INSERT INTO notes (id, v) VALUES (200, 'mixed')")
        .bind("", "", &[])
        .execute("", 0)
        .sync();
    wire.send().await.expect("send");
    let msgs = wire.until_ready().await.expect("mixed batch");
    assert!(msgs.iter().all(|m| m.error_code().is_none()), "{msgs:?}");
    assert_eq!(first_column(&msgs), [Some("f".to_owned())], "{msgs:?}");
    assert!(msgs.contains(&Backend::CommandComplete("INSERT 0 1".into())));
    // Bind of the read prepared in the last batch, then a write, in one batch.
    until_standby_wire(&mut wire).await;
    wire.bind("", "r", &[])
        .execute("", 0)
        .parse("", "INSERT INTO notes (id, v) VALUES (201, 'mixed')")
        .bind("", "", &[])
        .execute("", 0)
        .sync();
    wire.send().await.expect("send");
    let msgs = wire.until_ready().await.expect("mixed batch");
    assert_eq!(first_column(&msgs), [Some("f".to_owned())], "{msgs:?}");
    // The statement `r` itself, alone in its batch, is a read for the standby again.
    until_standby_wire(&mut wire).await;
    // A read batch whose Sync comes later (the client sent Bind and Execute, then waited):
    // not known to be reads only when it opened, so the primary.
    wire.bind("", "r", &[]).execute("", 0);
    wire.send().await.expect("send");
    tokio::time::sleep(Duration::from_millis(50)).await;
    wire.sync();
    wire.send().await.expect("send");
    let msgs = wire.until_ready().await.expect("late sync");
    assert_eq!(first_column(&msgs), [Some("f".to_owned())], "{msgs:?}");
    // Extended reads inside an explicit transaction: the primary.
    until_extended_on_standby(&analytics).await;
    let mut analytics = analytics;
    let txn = analytics.transaction().await.expect("begin");
    let row = txn
        .query_one(&read, &[&1i32])
        .await
        .expect("read in a transaction");
    assert!(!row.get::<_, bool>(0));
    txn.commit().await.expect("commit");

    assert!(s.replica_reads("analytics", "replica") >= 15.0);
    assert!(s.replica_reads("analytics", "read_your_writes") >= 1.0);
    let (status, body) = get(s.proxy.admin, "/v1/pools");
    assert_eq!(status, 200);
    assert!(body.contains("\"replica_replay_lsn\":\""), "{body}");
}

/// Waits until the wire client's Bind of statement `r` (a read it prepared) runs on the
/// standby.
async fn until_standby_wire(wire: &mut WireClient) {
    let t = Instant::now();
    loop {
        wire.bind("", "r", &[]).execute("", 0).sync();
        wire.send().await.expect("send");
        let msgs = wire.until_ready().await.expect("bind of r");
        if first_column(&msgs) == [Some("t".to_owned())] {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "never on the standby: {msgs:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reads_its_own_writes_while_the_standby_lags() {
    let s = Setup::start();
    let web = s.connect("web").await;
    let analytics = s.connect("analytics").await;
    until_extended_on_standby(&web).await;
    until_extended_on_standby(&analytics).await;

    // The standby stops replaying: it is stale, but never skipped for lag here
    // (`max_replica_lag_ms: 0`).
    s.replica
        .psql_on("postgres", "SELECT pg_wal_replay_pause()");
    let insert = web
        .prepare("INSERT INTO notes (id, v) VALUES ($1, $2)")
        .await
        .expect("prepare insert");
    let select = web
        .prepare(
            "SELECT v, current_setting('transaction_read_only') = 'on' FROM notes WHERE id = $1",
        )
        .await
        .expect("prepare select");
    for i in 0..20i32 {
        let v = format!("row {i}");
        web.execute(&insert, &[&i, &v]).await.expect("insert");
        // Read back at once: without read-your-writes this read would go to the paused
        // standby and find nothing.
        let rows = web.query(&select, &[&i]).await.expect("read back");
        assert_eq!(rows.len(), 1, "row {i} not found right after its insert");
        assert_eq!(rows[0].get::<_, String>(0), v);
        assert!(!rows[0].get::<_, bool>(1), "read back on the standby");
    }
    // A client that wrote nothing still reads from the stale standby (where the rows are not).
    let rows = analytics
        .query("SELECT v FROM notes WHERE id = $1", &[&0i32])
        .await
        .expect("other client's read");
    assert!(rows.is_empty(), "the paused standby has the row: {rows:?}");
    assert!(extended_on_standby(&analytics).await);
    assert!(s.replica_reads("web", "read_your_writes") >= 20.0);

    // A caller with a window: on the primary right after its write, on the (still stale)
    // standby once the window has passed.
    let windowed = s.connect("windowed").await;
    until_extended_on_standby(&windowed).await;
    let w_insert = windowed
        .prepare("INSERT INTO notes (id, v) VALUES ($1, $2)")
        .await
        .expect("prepare insert");
    let w_select = windowed
        .prepare(
            "SELECT v, current_setting('transaction_read_only') = 'on' FROM notes WHERE id = $1",
        )
        .await
        .expect("prepare select");
    windowed
        .execute(&w_insert, &[&1000i32, &"windowed"])
        .await
        .expect("windowed insert");
    let rows = windowed.query(&w_select, &[&1000i32]).await.expect("read");
    assert_eq!(rows.len(), 1);
    assert!(!rows[0].get::<_, bool>(1));
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert!(extended_on_standby(&windowed).await);

    // Replay resumed: the writer's reads go back to the standby, which has its rows.
    s.replica
        .psql_on("postgres", "SELECT pg_wal_replay_resume()");
    let t = Instant::now();
    loop {
        let rows = web.query(&select, &[&19i32]).await.expect("read");
        assert_eq!(rows.len(), 1);
        if rows[0].get::<_, bool>(1) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "the writer's reads never went back to the caught-up standby"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// pgx v4 (Debian's packaged sources, built as `drivers` builds its programs) through the
/// proxy as a `route: replica` caller: its statement cache and an explicitly prepared
/// statement on the standby, its own write read back at once, a batch with an INSERT on the
/// primary and a batch of reads on the standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgx_prepared_reads_run_on_the_standby() {
    let build_dir = tempfile::tempdir().expect("temp dir for the Go build");
    let bin = tokio::task::spawn_blocking({
        let dir = build_dir.path().to_path_buf();
        move || crate::drivers::build_pgx(&dir, "pgx_replica_reads")
    })
    .await
    .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    let s = Setup::start();
    s.primary.psql_on(
        APP_DB,
        &format!(
            "CREATE TABLE pgx_notes (id int PRIMARY KEY, note text NOT NULL); \
             ALTER TABLE pgx_notes OWNER TO {APP_USER}"
        ),
    );
    let mut cmd = std::process::Command::new(&bin);
    cmd.arg(format!("{} sslmode=disable", s.url("analytics")))
        .arg("pgx_notes");
    let (out, _) = crate::drivers::run("pgx through the replica-routing proxy", cmd).await;
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "cached statement on the standby",
            "prepared q answered 20 of 20 right, mostly on the standby true",
            "read back \"written\" on the standby false",
            "batch of a read and an insert: read on the standby false, inserted 1",
            "batch of reads on the standby, both rows there",
        ]
    );
    assert!(s.replica_reads("analytics", "read_your_writes") >= 1.0);
}
