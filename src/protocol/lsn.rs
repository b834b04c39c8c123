//! WAL positions: the [`Lsn`] type and its text form, and the [`WalMark`] a session waits on
//! until a replica has replayed the position a client's write reached. Values only: reading
//! the position from a server is the pool's (`pool::wal`), deciding which reads wait on a mark
//! the session's (`session::machine::route`).

use std::sync::OnceLock;

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
/// it (`pool::Pooled::release_after_wal_read`): unset while that read runs, `None` when it failed.
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

    /// Fills the mark in once; later calls change nothing.
    pub fn set(&self, lsn: Option<Lsn>) {
        let _ = self.0.set(lsn);
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
