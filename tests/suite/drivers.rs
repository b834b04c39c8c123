//! Real client drivers against the proxy in session mode (issue 22: session mode must be
//! byte-transparent).
//!
//! Each test runs one small program from `tests/drivers/` — pgx v4 (Go), ruby-pg, DBD::Pg
//! (Perl), SQLAlchemy on psycopg2 (Python) — first against PostgreSQL directly and then through
//! `pgsluice --pool-mode session`, and asserts that both print the same lines, which must also
//! be the expected ones. The programs do what these drivers really do on the wire: pgx
//! pipelines a batch and streams binary COPY data before the server's CopyInResponse; pgx,
//! ruby-pg and DBD::Pg prepare statements under names of their own choosing and expect
//! `pg_prepared_statements` and SQL `EXECUTE`/`DEALLOCATE` to see those names; SQLAlchemy
//! (simple protocol only) adds savepoints, a server-side cursor, SQL `PREPARE` and COPY.
//!
//! Every run is bounded by a timeout, so a hang fails the test (with the program's output so
//! far) instead of hanging the suite. The drivers come from Debian packages that `.ci/run`
//! installs (`golang-go`, `golang-github-jackc-pgx-v4-dev`, `ruby-pg`, `libdbd-pg-perl`,
//! `python3-sqlalchemy`, `python3-psycopg2`); when one is missing the test fails and says what
//! to install — it never skips. The Python script runs under Debian's own interpreter
//! ([`DEBIAN_PYTHON`]), the one those packages install into, whatever else is on `PATH`. The
//! Go program is built once per test run, in GOPATH mode against the packaged sources under
//! `/usr/share/gocode` (Debian ships them for exactly that; no module download is involved).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use crate::support::proxy::{Proxy, ProxyOptions};
use crate::support::run_with_timeout_async;

/// One driver run; the programs themselves finish in well under a second (the pgx program
/// gives up on its own after 20 s, naming the step).
const RUN_LIMIT: Duration = Duration::from_secs(30);
/// Building the pgx program compiles pgx and its dependencies when Go's build cache is cold.
const BUILD_LIMIT: Duration = Duration::from_secs(300);
/// Where Debian's golang-*-dev packages put their sources (a GOPATH entry).
const DEBIAN_GOPATH: &str = "/usr/share/gocode";
/// The interpreter Debian's python3-* packages belong to.
const DEBIAN_PYTHON: &str = "/usr/bin/python3";
/// How many times the pgx scenario runs through the proxy: the COPY hang it guards against
/// showed up in two runs out of three.
const PGX_PROXY_RUNS: usize = 5;

fn program(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/drivers")
        .join(name)
}

/// Fails the test, naming the Debian packages to install, unless `cmd` runs and succeeds.
fn require(mut cmd: Command, what: &str, packages: &str) {
    let shown = format!("{cmd:?}");
    let advice = format!(
        "install the Debian package(s) {packages} (apt-get install -y {packages}, as .ci/run \
         does); this test does not skip"
    );
    match cmd.output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!(
            "{what} is not usable: {shown} exited with {}: {}\n{advice}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            panic!("{what} not found ({shown}): {advice}")
        }
        Err(e) => panic!("cannot run {shown}: {e}"),
    }
}

/// Runs a driver program with a deadline and returns its stdout; a non-zero exit fails the
/// test with everything the program printed.
pub async fn run(what: &str, cmd: Command) -> (String, Duration) {
    let started = Instant::now();
    let out = run_with_timeout_async(cmd, RUN_LIMIT).await;
    let took = started.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}) after {took:?}\n--- stdout ---\n{stdout}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{what}: {took:?}");
    (stdout, took)
}

/// A new empty table `name (id int primary key, note text)` owned by the app user.
fn fresh_table(cluster: &Cluster, name: &str) {
    cluster.psql_on(
        APP_DB,
        &format!(
            "DROP TABLE IF EXISTS {name}; \
             CREATE TABLE {name} (id int PRIMARY KEY, note text NOT NULL); \
             ALTER TABLE {name} OWNER TO {APP_USER};"
        ),
    );
}

fn lines(text: &str) -> Vec<&str> {
    text.lines().collect()
}

/// Builds the pgx program `tests/drivers/{name}.go` into `dir` and returns the binary's path
/// (`routing::extended` builds one too).
pub fn build_pgx(dir: &Path, name: &str) -> PathBuf {
    let mut version = Command::new("go");
    version.arg("version");
    require(version, "the Go toolchain (go)", "golang-go");
    let pgx = Path::new(DEBIAN_GOPATH).join("src/github.com/jackc/pgx/v4");
    assert!(
        pgx.join("conn.go").is_file(),
        "pgx v4 sources not found at {}: install the Debian package \
         golang-github-jackc-pgx-v4-dev (apt-get install -y golang-github-jackc-pgx-v4-dev, as \
         .ci/run does); this test does not skip",
        pgx.display()
    );
    let bin = dir.join(name);
    let mut cmd = Command::new("go");
    cmd.arg("build")
        .arg("-o")
        .arg(&bin)
        .arg(program(&format!("{name}.go")))
        .current_dir(dir)
        // GOPATH mode: the packaged sources are the only ones used, and nothing is fetched.
        .env("GO111MODULE", "off")
        .env(
            "GOPATH",
            format!("{DEBIAN_GOPATH}:{}", dir.join("gopath").display()),
        )
        .env("GOFLAGS", "")
        .env("CGO_ENABLED", "0");
    if std::env::var_os("HOME").is_none() && std::env::var_os("XDG_CACHE_HOME").is_none() {
        cmd.env("GOCACHE", dir.join("gocache"));
    }
    let started = Instant::now();
    let out = crate::support::run_with_timeout(cmd, BUILD_LIMIT);
    assert!(
        out.status.success(),
        "go build of {name}.go failed ({}); pgx v4 and its dependencies come from the \
         Debian package golang-github-jackc-pgx-v4-dev:\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("go build {name}: {:?}", started.elapsed());
    bin
}

/// pgx v4: in a transaction a pipelined batch of 100 INSERTs, then `CopyFrom` (binary COPY) of
/// 1000 rows, commit; then `Prepare(ctx, "s1", …)`, which `pg_prepared_statements` and SQL
/// `EXECUTE s1(…)` (simple and extended protocol) must see. Five runs through the proxy.
/// Starts a cluster and a session-mode proxy, runs `program` (given a conninfo and a fresh
/// table's name) directly, checks it printed `expected`, then `proxy_runs` times through the
/// proxy, each of which must print the same. `name` names the runs and prefixes the tables.
async fn direct_then_proxy(
    name: &str,
    proxy_runs: usize,
    expected: &[&str],
    program: impl Fn(String, &str) -> Command,
) {
    let cluster = Cluster::start();
    let proxy = Proxy::start(&cluster, ProxyOptions::pool(2).session());
    let table = |suffix: &str| {
        let t = format!(
            "{}_{suffix}",
            name.replace(['-', ':', ' '], "_").to_lowercase()
        );
        fresh_table(&cluster, &t);
        t
    };
    let t = table("direct");
    let conninfo = cluster.connect_str(APP_USER, APP_PASSWORD, APP_DB);
    let (direct, _) = run(&format!("{name} directly"), program(conninfo, &t)).await;
    assert_eq!(lines(&direct), expected, "the reference (direct Postgres)");
    let mut took = Vec::new();
    for i in 1..=proxy_runs {
        let t = table(&format!("proxy_{i}"));
        let what = format!("{name} through the proxy, run {i} of {proxy_runs}");
        let conninfo = proxy.connect_str(APP_USER, APP_PASSWORD, APP_DB);
        let (out, d) = run(&what, program(conninfo, &t)).await;
        assert_eq!(lines(&out), lines(&direct), "{what}");
        took.push(d);
    }
    eprintln!("{name} through the proxy: {took:?}");
    proxy.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgx_batch_copy_and_prepared_names() {
    let build_dir = tempfile::tempdir().expect("temp dir for the Go build");
    let bin = tokio::task::spawn_blocking({
        let dir = build_dir.path().to_path_buf();
        move || build_pgx(&dir, "pgx_batch_copy")
    })
    .await
    .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    // 100 batch rows (ids 0..100) and 1000 copied rows (ids 100..1100).
    let expected = [
        "batch inserted 100",
        "copied 1000",
        "rows 1100 sum 604450",
        "s1(41) 42",
        "prepared lrupsc_1_0,lrupsc_1_1,lrupsc_1_2,s1",
        "simple EXECUTE s1(1) 2",
        "extended EXECUTE s1(2) 3",
        "s1 after deallocate 0",
    ];
    direct_then_proxy("pgx", PGX_PROXY_RUNS, &expected, |conninfo, table| {
        let mut cmd = Command::new(&bin);
        cmd.arg(conninfo).arg(table);
        cmd
    })
    .await;
}

/// ruby-pg: `prepare('s1', …)`, `exec_prepared`, `pg_prepared_statements`, SQL `EXECUTE` and
/// `DEALLOCATE s1`, after which the name is free for a statement of another result type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ruby_pg_prepare_and_sql_deallocate() {
    let mut check = Command::new("ruby");
    check.args(["-e", "require 'pg'"]);
    require(check, "Ruby with the pg extension", "ruby-pg");
    let expected = [
        "exec_prepared s1(41) 42",
        "prepared s1",
        "s1 from_sql f",
        "EXECUTE s1(1) 2",
        "exec_params EXECUTE s1(2) 3",
        "prepare s1 twice: 42P05",
        "DEALLOCATE s1: DEALLOCATE",
        "prepared after deallocate 0",
        "exec_prepared after deallocate: 26000",
        "re-prepared s1 again x",
        "after DEALLOCATE ALL 0",
    ];
    direct_then_proxy("ruby-pg", 2, &expected, |conninfo, _table| {
        let mut cmd = Command::new("ruby");
        cmd.arg(program("ruby_pg_prepare.rb")).arg(conninfo);
        cmd
    })
    .await;
}

/// DBD::Pg with `pg_server_prepare => 1`: an INSERT prepared on the server and executed five
/// times, visible in `pg_prepared_statements` under DBD::Pg's own name; a SELECT prepared at
/// once, run by the protocol and by SQL `EXECUTE` of that name; a `COPY … FROM STDIN` fed with
/// `pg_putcopydata`/`pg_putcopyend` inside a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dbd_pg_server_prepare_and_copy() {
    let mut check = Command::new("perl");
    check.args(["-MDBD::Pg", "-e", "1"]);
    require(check, "Perl with DBD::Pg", "libdbd-pg-perl");
    // Ids 1..=5 from the prepared INSERT, 100..600 from the COPY.
    let expected = [
        "inserted 5",
        "server-prepared inserts visible 1",
        "its name listed 1",
        "prepared now, listed 1",
        "doubled 2 4 6",
        "SQL EXECUTE of its name 42",
        "rows 505 sum 174765",
        "protocol statements after destroy 0",
    ];
    direct_then_proxy("DBD::Pg", 2, &expected, |conninfo, table| {
        let mut cmd = Command::new("perl");
        cmd.arg(program("dbd_pg_prepare_copy.pl"))
            .arg(conninfo)
            .arg(table);
        cmd
    })
    .await;
}

/// SQLAlchemy 1.4 on psycopg2: ORM inserts (executemany) in a transaction, a SAVEPOINT rolled
/// back, a server-side cursor streamed in batches, SQL `PREPARE`/`EXECUTE`/`DEALLOCATE` on a
/// pooled connection, and `COPY … FROM STDIN` through the raw DBAPI connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlalchemy_orm_session() {
    let mut check = Command::new(DEBIAN_PYTHON);
    check.args(["-c", "import sqlalchemy, psycopg2"]);
    require(
        check,
        "Debian's Python with SQLAlchemy and psycopg2",
        "python3-sqlalchemy python3-psycopg2",
    );
    // Ids 1..=50 from the ORM, 1000 kept past the savepoint, 2000..2300 from the COPY.
    let expected = [
        "after executemany rows 50 sum 1275",
        "after savepoint rollback rows 51 sum 2275",
        "server-side cursors while streaming 1",
        "streamed 51 first 1 last 1000",
        "EXECUTE plus_one(41) 42",
        "prepared [('plus_one', True)]",
        "copied 300",
        "at the end rows 351 sum 647125",
    ];
    direct_then_proxy("SQLAlchemy", 2, &expected, |conninfo, table| {
        let mut cmd = Command::new(DEBIAN_PYTHON);
        cmd.arg(program("sqlalchemy_orm.py"))
            .arg(conninfo)
            .arg(table);
        cmd
    })
    .await;
}
