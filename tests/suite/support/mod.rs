//! Shared harness for pgsluice's integration tests.
//!
//! * [`pg`] starts a throwaway PostgreSQL cluster from the installed server binaries (as the
//!   `postgres` OS user when the tests run as root) and offers direct, superuser-side helpers:
//!   `psql`, backend counts from `pg_stat_activity`, terminating backends, fast restart.
//! * [`proxy`] spawns the `pgsluice` binary in front of such a cluster (or, with
//!   `PGSLUICE_TEST_DIRECT=1`, hands out the cluster's own address so the tests can be validated
//!   against PostgreSQL itself) and connects real clients to it.
//! * [`sql`] and [`pgbench`] are client-side helpers: result reading, SQLSTATEs, polling,
//!   backend-count sampling, running pgbench and parsing its summary.
//! * [`wire`] is a deliberately small raw protocol client, for the cases where a driver hides
//!   what a test must control (statement names, exact message sequences); [`raw`] a byte-level
//!   one that can send anything (malformed packets, TLS), with the universal oracle;
//!   [`pg_tls`] a TLS connector for tokio-postgres that reports the channel binding.
//! * [`env`], [`policy`], [`storm`] and [`isolation`] start a cluster and a proxy with a config
//!   file the way the tests of a feature family need it (the traffic policy of issue 5, the
//!   storm controls of issue 17, the isolation tests of issue 15 with their session-state
//!   probe); [`spawned`] starts the proxy by hand, as an operator does, and runs the CLI;
//!   [`admin_api`] drives the admin API in process; [`faults`] and [`redis`] stand in for a
//!   faulty network and for the fleet's Redis.
//!
//! Every external process the harness starts is paired with a [`Watchdog`], so that even a test
//! binary killed with SIGKILL leaves no postmaster, proxy or data directory behind.

pub mod admin_api;
pub mod env;
pub mod faults;
pub mod isolation;
pub mod pg;
pub mod pg_tls;
pub mod pgbench;
pub mod policy;
pub mod proxy;
pub mod raw;
pub mod redis;
pub mod spawned;
pub mod sql;
pub mod storm;
pub mod wire;

use std::ffi::OsStr;
use std::future::Future;
use std::io::{Read, Write};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Awaits `fut`, panicking with `what` if it takes longer than `limit`.
///
/// Every await in the tests that depends on the proxy or the backend goes through this, so that
/// a bug shows up as a failed assertion naming the step instead of a hung test binary.
pub async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(value) => value,
        Err(_) => panic!("timed out after {limit:?} waiting for {what}"),
    }
}

/// Runs a command to completion with a deadline; on timeout the child is killed and the call
/// panics with whatever the child printed so far.
pub fn run_with_timeout(mut cmd: Command, limit: Duration) -> Output {
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot spawn {shown}: {e}"));
    let stdout = drain(child.stdout.take().expect("piped stdout"));
    let stderr = drain(child.stderr.take().expect("piped stderr"));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = stdout.join().expect("stdout reader");
    let stderr = stderr.join().expect("stderr reader");
    match status {
        Some(status) => Output {
            status,
            stdout,
            stderr,
        },
        None => panic!(
            "{shown} did not finish within {limit:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        ),
    }
}

/// Async counterpart of [`run_with_timeout`]: runs the (blocking) wait on the blocking pool so
/// that the test's other tasks — samplers, concurrent clients — keep running meanwhile.
pub async fn run_with_timeout_async(cmd: Command, limit: Duration) -> Output {
    tokio::task::spawn_blocking(move || run_with_timeout(cmd, limit))
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

fn drain(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = pipe.read_to_end(&mut buf);
        buf
    })
}

/// A small shell process that performs a cleanup script when this test process dies.
///
/// The watchdog blocks reading its stdin, whose write end only this process holds (std opens
/// pipes close-on-exec). When the test binary exits — normally, by panic, or by SIGKILL — the
/// pipe reaches EOF and the script runs. A clean [`Drop`] sends `done` first, which tells the
/// script that the owner already cleaned up and it must not touch anything (the pid it knows
/// may already belong to someone else).
pub struct Watchdog {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Watchdog {
    /// `script` runs under `sh -c` after an unclean exit, with `args` as `$ARG1`, `$ARG2`, ….
    /// The arguments travel in the environment rather than argv so that the watchdogs never
    /// match `pgrep -f pgsluice-test`, which is how leftover postmasters are looked for.
    pub fn spawn(script: &str, args: &[&OsStr], run_as: Option<(u32, u32)>) -> Watchdog {
        let full = format!(
            "read -r line || true; if [ \"$line\" != done ]; then {script}; fi >/dev/null 2>&1"
        );
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(full);
        for (i, arg) in args.iter().enumerate() {
            cmd.env(format!("ARG{}", i + 1), arg);
        }
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .current_dir("/");
        if let Some((uid, gid)) = run_as {
            use std::os::unix::process::CommandExt;
            cmd.uid(uid).gid(gid);
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot spawn the cleanup watchdog (sh): {e}"));
        let stdin = child.stdin.take();
        Watchdog { child, stdin }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.write_all(b"done\n");
        }
        let _ = self.child.wait();
    }
}

/// A pseudo-random number without a crate: std's `RandomState` is seeded from the OS per
/// instance, which is plenty for picking ports and names.
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    h.finish()
}

/// Whether the suite runs against PostgreSQL directly (`PGSLUICE_TEST_DIRECT=1`) rather than
/// through the proxy. Assertions about pooling itself are skipped in that mode, loudly.
pub fn direct_mode() -> bool {
    std::env::var_os("PGSLUICE_TEST_DIRECT").is_some_and(|v| v != "0" && !v.is_empty())
}

/// Prints (to the captured test output) that a proxy-only assertion was skipped.
pub fn note_skipped(what: &str) {
    eprintln!("PGSLUICE_TEST_DIRECT: skipping proxy-only assertion: {what}");
}
