//! WAL positions for read-your-writes: the [`Lsn`] type and its text form, the primary's
//! position read on a backend after a client's write ([`Pooled::release_after_wal_read`]),
//! and the [`WalMark`] a session waits on until a replica has replayed that position.
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

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use super::Pooled;

/// A WAL position (`XLogRecPtr`): the text form is two hex numbers, `hi/lo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Lsn(pub u64);

impl Lsn {
    /// Past every real position: what a server that is not in recovery has "replayed".
    pub const MAX: Lsn = Lsn(u64::MAX);

    /// Reads Postgres' text form (`16/B374D848`); `None` for anything else.
    pub fn parse(text: &str) -> Option<Lsn> {
        let (hi, lo) = text.trim().split_once('/')?;
        let hex = |s: &str| {
            if s.is_empty() || s.len() > 8 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            u32::from_str_radix(s, 16).ok()
        };
        Some(Lsn(u64::from(hex(hi)?) << 32 | u64::from(hex(lo)?)))
    }
}

impl std::fmt::Display for Lsn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// The primary's WAL position after one of a client's writes, filled in by the task that reads
/// it ([`Pooled::release_after_wal_read`]): unset while that read runs, `None` when it failed.
#[derive(Debug, Default)]
pub struct WalMark(OnceLock<Option<Lsn>>);

impl WalMark {
    /// `Some(None)`: the read failed; `None`: it has not answered yet.
    pub fn get(&self) -> Option<Option<Lsn>> {
        self.0.get().copied()
    }

    /// A mark already known (tests, and callers that read the position themselves).
    pub fn known(lsn: Lsn) -> WalMark {
        let m = WalMark::default();
        let _ = m.0.set(Some(lsn));
        m
    }

    fn set(&self, lsn: Option<Lsn>) {
        let _ = self.0.set(lsn);
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsn_text_round_trips_and_orders_by_position() {
        let a = Lsn::parse("16/B374D848").expect("lsn");
        assert_eq!(a, Lsn(0x16_B374_D848));
        assert_eq!(a.to_string(), "16/B374D848");
        assert_eq!(Lsn::parse("0/0"), Some(Lsn(0)));
        assert_eq!(Lsn::parse(" 0/3000060\n"), Some(Lsn(0x300_0060)));
        // The high half outweighs any low half.
        assert!(Lsn::parse("1/0") > Lsn::parse("0/FFFFFFFF"));
        assert!(Lsn::parse("0/A") > Lsn::parse("0/9"));
        assert_eq!(Lsn::parse("FFFFFFFF/FFFFFFFF"), Some(Lsn::MAX));
    }

    #[test]
    fn lsn_parse_refuses_what_postgres_never_prints() {
        for bad in [
            "",
            "/",
            "1/",
            "/1",
            "16B374D848",
            "1/2/3",
            "g/0",
            "-1/0",
            "+1/0",
            "1 /0",
            "100000000/0",
            "0/100000000",
            "primary",
        ] {
            assert_eq!(Lsn::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_mark_is_pending_then_known_or_failed_once() {
        let m = WalMark::default();
        assert_eq!(m.get(), None);
        m.set(Some(Lsn(5)));
        m.set(Some(Lsn(9)));
        assert_eq!(m.get(), Some(Some(Lsn(5))));
        let f = WalMark::default();
        f.set(None);
        assert_eq!(f.get(), Some(None));
        assert_eq!(WalMark::known(Lsn(3)).get(), Some(Some(Lsn(3))));
    }
}
