//! The part of `check-config` that talks to the database: with a backend URL it logs in as
//! that user once and compares the pool sizes with the server's `max_connections` and with the
//! `(cores × 2) + spindles` rule of thumb, and runs the circuit breaker's probe once, so that a
//! threshold whose probe cannot run is an error before the proxy is started with it.
//!
//! Owns the wording of that advice; it never changes the configuration. An unreachable
//! database is a note (the file may be checked on a build host), a failing probe an error.

use std::time::Duration;

use crate::config::Config;
use crate::pool::backend::{BackendConn, ConnectParams};
use crate::probe::{self, LoadEstimate, Probe};

/// What the database said about a configuration.
#[derive(Debug, Default)]
pub struct Findings {
    /// Advice and facts, printed as `note:` lines.
    pub notes: Vec<String>,
    /// Settings that cannot work against this database: `check-config` fails.
    pub errors: Vec<String>,
}

/// Logs in with `cfg`'s backend URL (none: nothing to check) and checks what it can.
pub async fn online(cfg: &Config) -> Findings {
    let mut f = Findings::default();
    let Some(url) = cfg.backend_url() else {
        if Probe::of(cfg).is_some() {
            f.notes.push(
                "no backend URL in the file (give --backend to check against the database): the \
                 breaker probe and max_connections were not checked"
                    .into(),
            );
        }
        return f;
    };
    let tls = match crate::tls::Tls::new(cfg) {
        Ok(t) => t.backend(),
        Err(e) => {
            f.errors.push(e.to_string());
            return f;
        }
    };
    let params = ConnectParams::from_url(
        &url,
        Duration::from_millis(cfg.backend.connect_timeout_ms),
        cfg.backend.tcp_user_timeout(),
        tls,
    );
    let mut conn = match BackendConn::connect(&params, 1).await {
        Ok(c) => c,
        Err(e) => {
            f.notes.push(format!(
                "the database at {}:{} could not be reached as {} ({e}): max_connections and \
                 the breaker probe were not checked",
                url.host, url.port, url.user
            ));
            return f;
        }
    };
    let max = setting(&mut conn, "max_connections").await;
    let reserved = setting(&mut conn, "superuser_reserved_connections")
        .await
        .unwrap_or(0.0);
    if let Some(max) = max {
        f.notes
            .extend(pool_advice(cfg, max as usize, reserved as usize, &url.host));
    }
    if let Some(p) = Probe::of(cfg) {
        let mut load = LoadEstimate::default();
        let what = match &p {
            Probe::Sql(_) => "global_defaults.circuit_breaker.probe_sql",
            Probe::Load => "the built-in database-load probe",
        };
        match tokio::time::timeout(
            Duration::from_secs(5),
            probe::read(&mut conn, &p, &mut load),
        )
        .await
        {
            Ok(Ok(Some(v))) => f.notes.push(format!("{what} runs: it reads {v:.1} now")),
            Ok(Ok(None)) => f.errors.push(format!(
                "{what} returned no number in its first column: the breaker could never read it"
            )),
            Ok(Err(e)) => f.errors.push(format!("{what} fails: {e}")),
            Err(_) => f.errors.push(format!("{what} did not answer within 5 s")),
        }
    }
    f
}

/// A numeric server setting (`None` if it cannot be read).
async fn setting(conn: &mut BackendConn, name: &str) -> Option<f64> {
    let sql = format!("SELECT setting FROM pg_settings WHERE name = '{name}'");
    probe::scalar(conn, &sql).await.ok().flatten()
}

/// Pool sizes against `max_connections` (less the superuser reserve) and the rule of thumb.
fn pool_advice(cfg: &Config, max: usize, reserved: usize, host: &str) -> Vec<String> {
    let usable = max.saturating_sub(reserved);
    let size = cfg.pool.size;
    let url = cfg.backend_url();
    // The pools known from the file: the backend URL's, each `pools:` entry, and one per
    // `auth.users` entry for the URL's database; more (database, user) pairs add more.
    let mut pairs: Vec<(String, String)> = Vec::new();
    if let Some(u) = &url {
        pairs.push((u.database.clone(), u.user.clone()));
    }
    for p in &cfg.pools {
        pairs.push((p.database.clone(), p.user.clone()));
    }
    if let Some(u) = &url {
        for user in &cfg.auth.users {
            pairs.push((u.database.clone(), user.name.clone()));
        }
    }
    pairs.sort();
    pairs.dedup();
    let total: usize = pairs.iter().map(|(d, u)| cfg.pool_for(d, u).size).sum();
    let mut out = vec![format!(
        "the database allows max_connections={max} ({usable} after \
         superuser_reserved_connections={reserved}); the {} pool(s) this file names hold up to \
         {total} (pool.size={size} each unless overridden), and every further (database, user) \
         pair clients log in with adds {size} more",
        pairs.len()
    )];
    if total > usable {
        out.push(format!(
            "the pools can ask for {total} connections but the database accepts {usable}: \
             lower pool.size or the pools[] sizes, or clients will see the server's 53300 \
             instead of waiting in the proxy"
        ));
    }
    let local = matches!(host, "127.0.0.1" | "localhost" | "::1");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let thumb = if local {
        format!(
            "this host has {cores} cores, so (cores × 2) + spindles ≈ {}",
            cores * 2 + 1
        )
    } else {
        "use the database host's cores".to_owned()
    };
    out.push(format!(
        "rule of thumb for connections doing work at once: (cores × 2) + spindles ({thumb}); \
         a pool much larger than that queues inside Postgres instead of in the proxy, where \
         priorities apply"
    ));
    out
}
