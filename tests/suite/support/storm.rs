//! A cluster with an `acct` table owned by the app user and a transaction-mode proxy, for the
//! storm and incident controls of issue 17 (`timeouts::idle`, `overload`, `admission::hints`,
//! `admin`); `None`, after saying so, in direct mode.

use super::env::Env;
use super::pg::{APP_DB, APP_USER, Cluster};
use super::{direct_mode, note_skipped};

pub fn start(pool: usize, yaml: &str) -> Option<Env> {
    if direct_mode() {
        note_skipped("storm controls (they need the proxy)");
        return None;
    }
    Some(Env::start(pool, yaml, |cluster| {
        cluster.psql_on(
            APP_DB,
            &format!(
                "CREATE TABLE acct (id int PRIMARY KEY, v int); INSERT INTO acct VALUES (1, 0); \
                 ALTER TABLE acct OWNER TO {APP_USER};"
            ),
        );
    }))
}

/// Backends of the proxy running `pg_sleep`, seen from the database.
pub async fn sleeping(cluster: &Cluster) -> usize {
    cluster
        .monitor()
        .await
        .active_queries_like("pg_sleep")
        .await
        .len()
}
