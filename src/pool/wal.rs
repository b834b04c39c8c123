//! Read-your-writes on the pool's side: the primary's WAL position read on a backend after a
//! client's write ([`Pooled::release_after_wal_read`]) into the [`WalMark`] a session waits
//! on until a replica has replayed it (the values live in `protocol::lsn`).
//!
//! Why the *insert* position: after a commit returns, its commit record ends at or before
//! `pg_current_wal_insert_lsn()` read on any later occasion — also under `synchronous_commit
//! = off`, where the record may not be written yet (`pg_current_wal_lsn()`, the write position,
//! could then be behind it). The later the read, the higher the position (other clients'
//! writes): the mark is conservative, never too low. A standby's `pg_last_wal_replay_lsn()` is
//! the end of the last record it replayed, so `replay >= mark` means the client's commit is
//! visible there. One case errs the safe way: when the last record ends exactly at a WAL page
//! boundary, the insert position is already past the next page's header, beyond any record
//! end; the client's reads then stay on the primary until more WAL is replayed (on an idle
//! server, Postgres' own standby snapshot within 15 s).
//!
//! Owns no policy: which reads wait on a mark is the session's decision
//! (`session::machine::route`).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::Pooled;
pub use crate::protocol::lsn::{Lsn, WalMark};

/// The insert position of a primary; NULL on a server in recovery (nothing was written there).
const WAL_INSERT_LSN_SQL: &str = "SELECT CASE WHEN pg_catalog.pg_is_in_recovery() THEN NULL \
     ELSE pg_catalog.pg_current_wal_insert_lsn() END";

/// How long the position read may take before the connection is given up.
const WAL_READ_TIMEOUT: Duration = Duration::from_secs(2);

impl Pooled {
    /// Reads the server's WAL insert position into `mark`, then returns the connection to its
    /// pool ([`Pooled::release_at`]). Runs off the client's path (the client has its reply);
    /// a read that fails or times out leaves the mark failed and closes the connection, whose
    /// state is then unknown.
    pub async fn release_after_wal_read(mut self, mark: Arc<WalMark>) {
        let read =
            tokio::time::timeout(WAL_READ_TIMEOUT, self.conn().first_row(WAL_INSERT_LSN_SQL)).await;
        match read {
            Ok(Ok(row)) => {
                let lsn = row
                    .and_then(|r| r.into_iter().next().flatten())
                    .and_then(|t| Lsn::parse(&t));
                mark.set(lsn);
                self.release_at(Instant::now()).await;
            }
            _ => {
                tracing::warn!(pool = %self.pool().name, "could not read the WAL position after a write; the client's reads stay on the primary");
                mark.set(None);
                self.discard();
            }
        }
    }
}
