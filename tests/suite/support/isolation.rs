//! Shared pieces of the isolation tests of issue 15 (`session_state`, `limits`, `admission`,
//! `timeouts`): a cluster and a transaction-mode proxy with a config file, a wire client
//! through it, and the session-state probe. Some tests name these `common::…`; their modules
//! import this one as `common`.

use super::env::Env;
use super::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use super::proxy::Proxy;
use super::sql::scalar;
use super::wire::WireClient;

/// Starts a cluster and a transaction-mode proxy with `pool` backends and config `yaml`,
/// running `prepare` on the cluster first.
pub fn start(pool: usize, yaml: &str, prepare: impl FnOnce(&Cluster)) -> Env {
    Env::start(pool, yaml, prepare)
}

/// Everything a previous client could have left on a session, as one line: search_path,
/// current_user, a custom setting, advisory locks held, channels listened to, statement and
/// lock timeout, standard_conforming_strings, SQL-prepared statements (the proxy's own
/// protocol-level ones are not counted), WITH HOLD cursors, temporary relations.
pub const STATE_SQL: &str = "SELECT current_setting('search_path') || '|' || current_user \
     || '|' || coalesce(current_setting('app.tenant_id', true), '') \
     || '|' || (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
                AND pid = pg_backend_pid()) \
     || '|' || (SELECT count(*) FROM pg_listening_channels()) \
     || '|' || current_setting('statement_timeout') || '|' || current_setting('lock_timeout') \
     || '|' || current_setting('standard_conforming_strings') \
     || '|' || (SELECT count(*) FROM pg_prepared_statements WHERE from_sql) \
     || '|' || (SELECT count(*) FROM pg_cursors WHERE is_holdable) \
     || '|' || (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema())";

/// What [`STATE_SQL`] shows on a fresh `app` session.
pub const CLEAN: &str = "\"$user\", public|app||0|0|0|0|on|0|0|0";

/// A fresh client's view of its session.
pub async fn fresh_state(proxy: &Proxy) -> String {
    let c = proxy.client().await;
    scalar(&c, STATE_SQL).await
}

/// A raw wire client of the app user through `proxy`.
pub async fn wire(proxy: &Proxy) -> WireClient {
    WireClient::connect(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB)
        .await
        .expect("wire client")
}
