//! Shared pieces of the hostile tests: a config file next to a proxy, the session-state probe.

use crate::support::pg::Cluster;
use crate::support::proxy::Proxy;
use crate::support::sql::scalar;

pub use crate::support::env::Env;

/// Starts a cluster and a transaction-mode proxy with `pool` backends and config `yaml`,
/// running `prepare` on the cluster first.
pub fn start(pool: usize, yaml: &str, prepare: impl FnOnce(&Cluster)) -> Env {
    Env::start(pool, yaml, prepare)
}

/// Everything a previous client could have left on a session, as one line: search_path,
/// current_user, a custom setting, advisory locks held, channels listened to, statement and
/// lock timeout, standard_conforming_strings.
pub const STATE_SQL: &str = "SELECT current_setting('search_path') || '|' || current_user \
     || '|' || coalesce(current_setting('app.tenant_id', true), '') \
     || '|' || (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
                AND pid = pg_backend_pid()) \
     || '|' || (SELECT count(*) FROM pg_listening_channels()) \
     || '|' || current_setting('statement_timeout') || '|' || current_setting('lock_timeout') \
     || '|' || current_setting('standard_conforming_strings')";

/// What [`STATE_SQL`] shows on a fresh `app` session.
pub const CLEAN: &str = "\"$user\", public|app||0|0|0|0|on";

/// A fresh client's view of its session.
pub async fn fresh_state(proxy: &Proxy) -> String {
    let c = proxy.client().await;
    scalar(&c, STATE_SQL).await
}
