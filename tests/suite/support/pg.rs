//! Throwaway PostgreSQL clusters started from the installed server binaries.
//!
//! A cluster lives in `<tmp>/pgsluice-test-XXXX/` (`data/`, the unix socket, `postgres.log`)
//! and listens on 127.0.0.1 at a random port below 32768, so it never competes with the
//! kernel's ephemeral ports. PostgreSQL refuses to run as root and CI runs as root, so in that
//! case every server-side binary runs as the `postgres` OS user through
//! `CommandExt::{uid, gid}` (no sudo needed); as a normal user it runs as that user.
//!
//! `initdb` runs once per test binary into a template (roles and database included) that each
//! cluster copies, which makes a fresh cluster cost about a third of a second. Every test gets
//! its own cluster, so fault tests (terminate, restart) cannot disturb their neighbours and the
//! backend counts a test reads belong to it alone.
//!
//! Users created in every cluster: the superuser `postgres` ([`SUPERUSER_PASSWORD`]), `app`
//! with password `secret` owning database `appdb`, and role `other` granted to `app` (for
//! `SET ROLE` tests). Authentication is SCRAM-SHA-256 everywhere.

use std::ffi::OsString;
use std::fs;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tokio_postgres::{Client, NoTls};

use super::{Watchdog, random_u64, run_with_timeout, within};

pub const SUPERUSER: &str = "postgres";
pub const SUPERUSER_PASSWORD: &str = "pgsluice-test-superuser";
pub const APP_USER: &str = "app";
pub const APP_PASSWORD: &str = "secret";
pub const APP_DB: &str = "appdb";
pub const OTHER_ROLE: &str = "other";

/// Prefix of every temp dir; `pgrep -f pgsluice-test` finds leftover postmasters by it.
pub const DIR_PREFIX: &str = "pgsluice-test-";

const INSTALL_HINT: &str = "PostgreSQL server binaries (initdb, postgres, pg_ctl) are required \
     for pgsluice's integration tests and were not found via $PG_BIN, PATH, `pg_config --bindir` \
     or /usr/lib/postgresql/*/bin. Install them, e.g. `apt-get install -y postgresql \
     postgresql-contrib` on Debian/Ubuntu, or point PG_BIN at the directory holding initdb.";

/// Where to look for the server binaries; [`BinSearch::from_env`] is the real search, tests of
/// the harness build one by hand.
pub struct BinSearch {
    pub pg_bin: Option<OsString>,
    pub path: Option<OsString>,
    pub use_pg_config: bool,
    pub lib_root: PathBuf,
}

impl BinSearch {
    pub fn from_env() -> BinSearch {
        BinSearch {
            pg_bin: std::env::var_os("PG_BIN"),
            path: std::env::var_os("PATH"),
            use_pg_config: true,
            lib_root: PathBuf::from("/usr/lib/postgresql"),
        }
    }

    /// The directory holding `initdb`, `postgres` and `pg_ctl`, or an error that says how to
    /// install them. An explicit `$PG_BIN` that is wrong is an error, not a reason to guess.
    pub fn find(&self) -> Result<PathBuf, String> {
        let complete = |dir: &Path| {
            ["initdb", "postgres", "pg_ctl"]
                .iter()
                .all(|b| dir.join(b).is_file())
        };
        if let Some(dir) = &self.pg_bin {
            let dir = PathBuf::from(dir);
            return if complete(&dir) {
                Ok(dir)
            } else {
                Err(format!(
                    "PG_BIN={} does not contain initdb, postgres and pg_ctl. {INSTALL_HINT}",
                    dir.display()
                ))
            };
        }
        if let Some(path) = &self.path {
            for entry in std::env::split_paths(path) {
                let initdb = entry.join("initdb");
                if initdb.is_file() {
                    // Debian puts symlinks in /usr/local/bin or wrappers in /usr/bin; the real
                    // binaries sit next to the resolved initdb.
                    if let Some(dir) = fs::canonicalize(&initdb)
                        .ok()
                        .and_then(|p| p.parent().map(Path::to_path_buf))
                        && complete(&dir)
                    {
                        return Ok(dir);
                    }
                    if complete(&entry) {
                        return Ok(entry);
                    }
                }
            }
        }
        if self.use_pg_config
            && let Ok(out) = Command::new("pg_config").arg("--bindir").output()
            && out.status.success()
        {
            let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            if complete(&dir) {
                return Ok(dir);
            }
        }
        if let Ok(entries) = fs::read_dir(&self.lib_root) {
            let mut versions: Vec<(u32, PathBuf)> = entries
                .filter_map(Result::ok)
                .filter_map(|e| {
                    let version = e.file_name().to_str()?.parse::<u32>().ok()?;
                    Some((version, e.path().join("bin")))
                })
                .filter(|(_, dir)| complete(dir))
                .collect();
            versions.sort();
            if let Some((_, dir)) = versions.pop() {
                return Ok(dir);
            }
        }
        Err(INSTALL_HINT.to_string())
    }
}

/// The server binaries' directory, found once per test binary; panics with install advice.
pub fn bindir() -> &'static Path {
    static BINDIR: OnceLock<PathBuf> = OnceLock::new();
    BINDIR.get_or_init(|| {
        BinSearch::from_env()
            .find()
            .unwrap_or_else(|e| panic!("{e}"))
    })
}

/// A client tool (`psql`, `pgbench`, …): the one beside the server binaries when present, so
/// client and server versions match, else whatever PATH has.
pub fn tool(name: &str) -> PathBuf {
    let beside = bindir().join(name);
    if beside.is_file() {
        beside
    } else {
        PathBuf::from(name)
    }
}

/// The uid/gid PostgreSQL must run as: `None` when not root (run as ourselves).
pub fn server_identity() -> Option<(u32, u32)> {
    static IDS: OnceLock<Option<(u32, u32)>> = OnceLock::new();
    *IDS.get_or_init(|| {
        use std::os::unix::fs::MetadataExt;
        // Our own uid without libc: the owner of a file we just created.
        let probe = tempfile::NamedTempFile::new().expect("create a probe file in the temp dir");
        let uid = probe.as_file().metadata().expect("stat probe file").uid();
        if uid != 0 {
            return None;
        }
        let passwd = fs::read_to_string("/etc/passwd").expect("read /etc/passwd");
        let ids = passwd.lines().find_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 4 || f[0] != "postgres" {
                return None;
            }
            Some((f[2].parse().ok()?, f[3].parse().ok()?))
        });
        Some(ids.unwrap_or_else(|| {
            panic!(
                "running as root, and PostgreSQL refuses to run as root, but there is no `postgres` \
                 OS user to run it as; create one (`useradd --system --user-group postgres`) or \
                 install the postgresql package, which creates it"
            )
        }))
    })
}

/// A command for a server-side binary, dropped to the server identity when we are root.
fn server_command(bin: &str) -> Command {
    let mut cmd = Command::new(bindir().join(bin));
    if let Some((uid, gid)) = server_identity() {
        cmd.uid(uid).gid(gid);
    }
    cmd.env_remove("PGDATA").current_dir("/");
    cmd
}

fn chown_to_server(path: &Path) {
    if let Some((uid, gid)) = server_identity() {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .unwrap_or_else(|e| panic!("chown {} to the postgres user: {e}", path.display()));
    }
}

fn new_dir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix(DIR_PREFIX)
        .tempdir()
        .expect("create temp dir");
    chown_to_server(dir.path());
    dir
}

fn must_succeed(cmd: Command, limit: Duration, what: &str) -> String {
    let out = run_with_timeout(cmd, limit);
    if !out.status.success() {
        panic!(
            "{what} failed ({})\n--- stdout ---\n{}\n--- stderr ---\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The initialised, stopped data directory every cluster copies.
struct Template {
    dir: tempfile::TempDir,
    _watchdog: Watchdog,
}

fn template() -> &'static Path {
    static TEMPLATE: OnceLock<Template> = OnceLock::new();
    let t = TEMPLATE.get_or_init(|| {
        let dir = new_dir();
        // Statics are never dropped: the watchdog removes the template when the binary exits.
        let watchdog = Watchdog::spawn(
            "rm -rf \"$ARG1\"",
            &[dir.path().as_os_str()],
            server_identity(),
        );
        let pwfile = dir.path().join("pwfile");
        fs::write(&pwfile, format!("{SUPERUSER_PASSWORD}\n")).expect("write pwfile");
        chown_to_server(&pwfile);
        let data = dir.path().join("data");
        let mut initdb = server_command("initdb");
        initdb
            .arg("-D")
            .arg(&data)
            .args([
                "-U",
                SUPERUSER,
                "--auth=scram-sha-256",
                "-E",
                "UTF8",
                "--locale=C",
                "-N",
            ])
            .arg(format!("--pwfile={}", pwfile.display()));
        must_succeed(initdb, Duration::from_secs(60), "initdb");
        let mut cluster = Cluster::start_in(dir);
        cluster.psql(&format!(
            "CREATE ROLE {APP_USER} LOGIN PASSWORD '{APP_PASSWORD}';
             CREATE ROLE {OTHER_ROLE};
             GRANT {OTHER_ROLE} TO {APP_USER};"
        ));
        // CREATE DATABASE cannot share psql -c's implicit transaction.
        cluster.psql(&format!("CREATE DATABASE {APP_DB} OWNER {APP_USER}"));
        cluster.stop();
        let dir = cluster.dir.take().expect("template dir");
        Template {
            dir,
            _watchdog: watchdog,
        }
    });
    t.dir.path()
}

/// One running PostgreSQL cluster; stopped (fast shutdown) and deleted on drop.
pub struct Cluster {
    dir: Option<tempfile::TempDir>,
    port: u16,
    postmaster: Option<Child>,
    watchdog: Option<Watchdog>,
}

impl Cluster {
    /// A fresh cluster with the standard roles and database, ready for connections.
    pub fn start() -> Cluster {
        let template = template();
        let dir = new_dir();
        // `cp` is not a server binary, but it must run as the server user so the copy keeps
        // the ownership and 0700 mode PostgreSQL insists on.
        let mut cp = Command::new("cp");
        if let Some((uid, gid)) = server_identity() {
            cp.uid(uid).gid(gid);
        }
        cp.arg("-a")
            .arg(template.join("data"))
            .arg(dir.path().join("data"));
        must_succeed(
            cp,
            Duration::from_secs(60),
            "copying the template data directory",
        );
        Cluster::start_in(dir)
    }

    /// A physical streaming replica of `primary` (`pg_basebackup -R`), running as a hot
    /// standby on its own port; same roles, databases and data.
    pub fn replica_of(primary: &Cluster) -> Cluster {
        let dir = new_dir();
        let mut backup = server_command("pg_basebackup");
        backup
            .env("PGPASSWORD", SUPERUSER_PASSWORD)
            .args(["-h", "127.0.0.1", "-p", &primary.port.to_string()])
            .args(["-U", SUPERUSER, "-X", "stream", "-R", "-c", "fast", "-D"])
            .arg(dir.path().join("data"));
        must_succeed(backup, Duration::from_secs(120), "pg_basebackup");
        Cluster::start_in(dir)
    }

    fn start_in(dir: tempfile::TempDir) -> Cluster {
        let data = dir.path().join("data");
        let watchdog = Watchdog::spawn(
            &format!(
                "if [ -f \"$ARG1/postmaster.pid\" ]; then \"{}\" stop -D \"$ARG1\" -m immediate -w; fi; rm -rf \"$ARG2\"",
                bindir().join("pg_ctl").display()
            ),
            &[data.as_os_str(), dir.path().as_os_str()],
            server_identity(),
        );
        let mut cluster = Cluster {
            dir: Some(dir),
            port: 0,
            postmaster: None,
            watchdog: Some(watchdog),
        };
        let mut last_error = String::new();
        for _ in 0..8 {
            let port = free_port();
            match cluster.spawn_postmaster(port) {
                Ok(()) => return cluster,
                Err(e) => last_error = e,
            }
        }
        panic!("PostgreSQL did not start: {last_error}");
    }

    fn spawn_postmaster(&mut self, port: u16) -> Result<(), String> {
        let dir = self.path().to_path_buf();
        let data = dir.join("data");
        let log_path = dir.join("postgres.log");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .expect("open postgres.log");
        let mut cmd = server_command("postgres");
        cmd.arg("-D")
            .arg(&data)
            .arg("-p")
            .arg(port.to_string())
            .arg("-k")
            .arg(&dir)
            .args(["-c", "listen_addresses=127.0.0.1"])
            .args([
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
            ])
            .args(["-c", "max_connections=300", "-c", "shared_buffers=32MB"])
            .args([
                "-c",
                "log_min_messages=warning",
                "-c",
                "log_connections=off",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log fd"))
            .stderr(log);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot spawn postgres: {e}"))?;
        let pidfile = data.join("postmaster.pid");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait().expect("try_wait postgres") {
                return Err(format!(
                    "postgres exited with {status} on port {port}:\n{}",
                    self.log_tail(40)
                ));
            }
            // Line 8 of postmaster.pid is the postmaster's status; "ready" means it accepts
            // connections (the same thing pg_isready would tell us, without a process per poll).
            if fs::read_to_string(&pidfile)
                .ok()
                // ("standby": a hot standby that accepts read-only connections.)
                .and_then(|s| {
                    s.lines()
                        .nth(7)
                        .map(|l| matches!(l.trim(), "ready" | "standby"))
                })
                .unwrap_or(false)
            {
                self.port = port;
                self.postmaster = Some(child);
                return Ok(());
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "postgres not ready after 30 s:\n{}",
                    self.log_tail(40)
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn path(&self) -> &Path {
        self.dir.as_ref().expect("cluster dir").path()
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The directory holding the unix socket (`.s.PGSQL.<port>`).
    pub fn socket_dir(&self) -> &Path {
        self.path()
    }

    /// The last `lines` lines of the server log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = fs::read_to_string(self.path().join("postgres.log")).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// A libpq-style connection string for this cluster.
    pub fn connect_str(&self, user: &str, password: &str, db: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={user} password={password} dbname={db} connect_timeout=10",
            self.port
        )
    }

    /// A client tool (`psql`, `pgbench`) aimed at `addr` through libpq environment variables.
    /// Client tools run as the current OS user: they authenticate by password over TCP.
    pub fn tool_command(
        bin: &str,
        addr: SocketAddr,
        user: &str,
        password: &str,
        db: &str,
    ) -> Command {
        let mut cmd = Command::new(tool(bin));
        for var in [
            "PGSERVICE",
            "PGSERVICEFILE",
            "PGPASSFILE",
            "PGOPTIONS",
            "PGSSLMODE",
            "PGAPPNAME",
        ] {
            cmd.env_remove(var);
        }
        cmd.env("PGHOST", addr.ip().to_string())
            .env("PGPORT", addr.port().to_string())
            .env("PGUSER", user)
            .env("PGPASSWORD", password)
            .env("PGDATABASE", db)
            .env("PGCONNECT_TIMEOUT", "10")
            .env("PGSSLMODE", "disable");
        cmd
    }

    /// Runs `sql` with psql as the superuser on database `postgres`; returns unaligned,
    /// tuples-only stdout and panics (with psql's stderr) on any error. Like `psql -c`, several
    /// statements in `sql` run as one transaction.
    pub fn psql(&self, sql: &str) -> String {
        self.psql_on(MAINTENANCE_DB, sql)
    }

    /// Like [`Cluster::psql`], on database `db`.
    pub fn psql_on(&self, db: &str, sql: &str) -> String {
        let mut cmd = Self::tool_command("psql", self.addr(), SUPERUSER, SUPERUSER_PASSWORD, db);
        cmd.args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql]);
        must_succeed(cmd, Duration::from_secs(60), &format!("psql -c {sql:?}"))
    }

    /// The SCRAM-SHA-256 verifier Postgres keeps for `role` (`pg_authid.rolpassword`).
    pub fn scram_verifier(&self, role: &str) -> String {
        let verifier = self
            .psql_on(
                "postgres",
                &format!("SELECT rolpassword FROM pg_authid WHERE rolname = '{role}'"),
            )
            .trim()
            .to_owned();
        assert!(verifier.starts_with("SCRAM-SHA-256$"), "{verifier}");
        verifier
    }

    /// A superuser connection straight to the cluster (never through the proxy).
    pub async fn superuser_client(&self, db: &str) -> Client {
        let (client, conn) = within(
            Duration::from_secs(15),
            "a direct superuser connection",
            tokio_postgres::connect(&self.connect_str(SUPERUSER, SUPERUSER_PASSWORD, db), NoTls),
        )
        .await
        .unwrap_or_else(|e| panic!("direct superuser connection failed: {e:?}"));
        tokio::spawn(conn);
        client
    }

    /// A monitoring handle: one superuser connection reused for many samples.
    pub async fn monitor(&self) -> Monitor {
        Monitor {
            client: self.superuser_client(MAINTENANCE_DB).await,
        }
    }

    /// Client backends connected to `db` as `user` right now.
    pub async fn backend_count(&self, db: &str, user: &str) -> i64 {
        self.monitor().await.backend_count(db, user).await
    }

    /// `pg_terminate_backend` on every backend of `db`/`user`; returns how many were signalled.
    pub async fn terminate_backends(&self, db: &str, user: &str) -> i64 {
        self.monitor().await.terminate_backends(db, user).await
    }

    /// Fast shutdown (SIGINT) and start again on the same port, as `pg_ctl restart -m fast`
    /// would: every session is terminated with 57P01.
    pub fn restart_fast(&mut self) {
        self.stop();
        let port = self.port;
        self.spawn_postmaster(port)
            .unwrap_or_else(|e| panic!("restart on port {port} failed: {e}"));
    }

    /// Fast shutdown; waits for the postmaster to exit (escalating to immediate, then SIGKILL).
    pub fn stop(&mut self) {
        let Some(mut child) = self.postmaster.take() else {
            return;
        };
        for (signal, grace) in [("-INT", 15), ("-QUIT", 5)] {
            let _ = Command::new("kill")
                .arg(signal)
                .arg(child.id().to_string())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            let deadline = Instant::now() + Duration::from_secs(grace);
            while Instant::now() < deadline {
                if child.try_wait().ok().flatten().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// The database `psql()` and the monitor connect to.
const MAINTENANCE_DB: &str = "postgres";

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() && self.postmaster.is_some() {
            eprintln!(
                "--- tail of postgres.log (port {}) ---\n{}",
                self.port,
                self.log_tail(60)
            );
        }
        self.stop();
        drop(self.watchdog.take());
    }
}

/// A random free port in 20000..32000 (below the usual ephemeral range 32768–60999, so that
/// outgoing connections never take it between our probe and the server's bind).
fn free_port() -> u16 {
    loop {
        let port = 20000 + (random_u64() % 12000) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Superuser queries against `pg_stat_activity` and friends, on one reused connection.
pub struct Monitor {
    client: Client,
}

impl Monitor {
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Client backends of `db`/`user` (the monitor's own connection is a superuser one on
    /// `postgres`, so it is never counted).
    pub async fn backend_count(&self, db: &str, user: &str) -> i64 {
        let row = within(
            Duration::from_secs(10),
            "pg_stat_activity backend count",
            self.client.query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = $1 AND usename = $2 AND backend_type = 'client backend' \
                 AND pid <> pg_backend_pid()",
                &[&db, &user],
            ),
        )
        .await
        .expect("count backends");
        row.get(0)
    }

    /// Backends of any user whose current query contains `needle` and that are not idle.
    pub async fn active_queries_like(&self, needle: &str) -> Vec<(i32, String, String)> {
        let rows = within(
            Duration::from_secs(10),
            "pg_stat_activity active queries",
            self.client.query(
                "SELECT pid, state, query FROM pg_stat_activity \
                 WHERE state <> 'idle' AND strpos(query, $1) > 0 AND pid <> pg_backend_pid()",
                &[&needle],
            ),
        )
        .await
        .expect("list active queries");
        rows.iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect()
    }

    /// `pg_terminate_backend` every backend of `db`/`user`; returns how many were signalled.
    pub async fn terminate_backends(&self, db: &str, user: &str) -> i64 {
        let row = within(
            Duration::from_secs(10),
            "pg_terminate_backend",
            self.client.query_one(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE datname = $1 AND usename = $2 AND backend_type = 'client backend' \
                 AND pid <> pg_backend_pid()",
                &[&db, &user],
            ),
        )
        .await
        .expect("terminate backends");
        row.get(0)
    }
}
