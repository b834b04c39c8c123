//! Running `pgbench` through the proxy and reading its summary.
//!
//! pgbench is a client, so it runs as the current OS user (root in CI is fine) and gets the
//! password through PGPASSWORD (see `Cluster::tool_command`).

use std::time::Duration;

use super::pg::{APP_DB, APP_PASSWORD, APP_USER};
use super::proxy::Proxy;
use super::run_with_timeout_async;

/// Loads the standard pgbench tables (`pgbench -i -s SCALE`) through the proxy.
pub async fn init(proxy: &Proxy, scale: u32) {
    let mut cmd = proxy.tool_command("pgbench", APP_USER, APP_PASSWORD, APP_DB);
    cmd.args(["-i", "-q", "-s", &scale.to_string()]);
    let out = run_with_timeout_async(cmd, Duration::from_secs(120)).await;
    assert!(
        out.status.success(),
        "pgbench -i -s {scale} through the proxy failed\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What a pgbench run reported.
#[derive(Debug)]
pub struct Report {
    pub processed: u64,
    pub failed: u64,
    pub tps: f64,
}

/// Parses pgbench's summary; panics with the whole output if a line is missing.
pub fn parse(stdout: &str, stderr: &str) -> Report {
    let field = |prefix: &str| {
        stdout
            .lines()
            .find_map(|l| l.trim().strip_prefix(prefix))
            .map(|rest| rest.split_whitespace().next().unwrap_or("").to_string())
            .unwrap_or_else(|| panic!("pgbench output lacks {prefix:?}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"))
    };
    let number = |prefix: &str| {
        let raw = field(prefix);
        // "processed: 1234/1234" when -t is used; plain number with -T.
        raw.split('/')
            .next()
            .unwrap_or("")
            .parse::<u64>()
            .unwrap_or_else(|e| panic!("{prefix} {raw:?}: {e}"))
    };
    Report {
        processed: number("number of transactions actually processed:"),
        failed: number("number of failed transactions:"),
        tps: field("tps =")
            .parse()
            .unwrap_or_else(|e| panic!("tps: {e}\n{stdout}")),
    }
}

/// Runs pgbench with `args` against the proxy and checks it succeeded with 0 failures.
pub async fn run_ok(proxy: &Proxy, args: &[&str]) -> Report {
    let mut cmd = proxy.tool_command("pgbench", APP_USER, APP_PASSWORD, APP_DB);
    cmd.args(args);
    let out = run_with_timeout_async(cmd, Duration::from_secs(120)).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "pgbench {args:?} failed ({})\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
        out.status
    );
    let report = parse(&stdout, &stderr);
    assert_eq!(
        report.failed, 0,
        "pgbench {args:?} had failed transactions\n{stdout}\n{stderr}"
    );
    assert!(
        report.processed > 0 && report.tps > 0.0,
        "pgbench {args:?} did no work: {report:?}"
    );
    assert!(
        !stderr.contains("aborted"),
        "pgbench {args:?}: a client aborted\n{stderr}"
    );
    report
}
