//! Where a client's reads may run, without I/O: which statements a replica can serve
//! ([`routable`]), whether a whole extended-protocol batch consists of them
//! ([`batch_reads`]), which statements may have written ([`may_write`]), and
//! read-your-writes — what a replica must have replayed before this client's reads go
//! there ([`Fresh`]).
//!
//! A batch is judged whole, at its first message that needs a backend, from the bytes the
//! client has already sent: every Parse in it must be a routable read, every Bind must name a
//! statement that is one, nothing else may be in it but Describe, Execute, Close and Flush,
//! and its Sync must be there. Anything else — a write, a statement the proxy cannot read, a
//! Query or FunctionCall, a batch whose Sync has not arrived — keeps the batch on the primary:
//! the messages of one batch share one implicit transaction and one error path, and are
//! never split between two servers.
//!
//! Never touches a socket, a pool or the clock: the relay hands in what it knows
//! (`session::relay::route`).

use std::sync::Arc;

use std::time::Instant;

use crate::classify::{Classified, StmtKind};
use crate::protocol::framing::{self, Direction};
use crate::protocol::lsn::{Lsn, WalMark};
use crate::protocol::messages::{Bind, Parse};
use crate::protocol::tag::frontend;

/// The most messages a batch routed to a replica may have (its Sync included); a longer one
/// runs on the primary rather than being read through twice.
pub const MAX_BATCH_MESSAGES: usize = 256;

/// Built-ins the classifier counts as harmless to the session that still need the primary:
/// they write (a sequence), take a transaction id, or take a lock that must exclude other
/// clients of the primary.
const PRIMARY_ONLY_CALLS: [&str; 8] = [
    "nextval",
    "setval",
    "txid_current",
    "pg_current_xact_id",
    "pg_advisory_xact_lock",
    "pg_advisory_xact_lock_shared",
    "pg_try_advisory_xact_lock",
    "pg_try_advisory_xact_lock_shared",
];

/// A statement a replica can serve the same as the primary: a plain read (no locking clause,
/// only built-ins the classifier knows touch nothing, none of [`PRIMARY_ONLY_CALLS`]),
/// without session effects, read whole and alone (a text of several statements — `BEGIN;
/// SELECT …; COMMIT` — is a transaction of its own, and its kind is that of its strongest
/// statement, which says nothing of what the others need; the normalized form keeps no
/// literal, comment or trailing `;`, so a `;` left separates statements). Without effects the
/// text is proven (`classify::proof`), so its names list every function it calls.
pub fn routable(c: &Classified) -> bool {
    c.kind == StmtKind::Read
        && c.effects.is_empty()
        && !c.oversized
        && !c.normalized.contains(';')
        && !c.proof.names.iter().any(|n| {
            let n = n.strip_prefix("pg_catalog.").unwrap_or(n);
            PRIMARY_ONLY_CALLS.contains(&n)
        })
}

/// Whether a statement may have changed data, so that a read after it has to see it: anything
/// but a [`routable`] read and plain transaction control (`BEGIN`, `COMMIT`, `SAVEPOINT`, …;
/// `PREPARE TRANSACTION` and `COMMIT PREPARED` excepted, the second commits another
/// transaction's writes).
pub fn may_write(c: &Classified) -> bool {
    if routable(c) {
        return false;
    }
    let control = c.kind == StmtKind::Transaction
        && c.effects.is_empty()
        && !c.oversized
        && !c.normalized.contains(';')
        && !c.normalized.to_ascii_lowercase().contains("prepare");
    !control
}

/// A statement named in a batch, for the caller to judge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Item<'a> {
    /// A Parse's query text.
    Parse(&'a [u8]),
    /// A Bind of a statement prepared before the batch (this name).
    Bind(&'a [u8]),
}

/// Whether the rest of a batch, `rest` (the client's bytes after its first message, which
/// the caller judged), up to and including its Sync, holds only routable reads: `judge` says
/// whether each Parse's text is one, and each Bind's statement when it was prepared before
/// this batch. `opened_by`: the name the first message parsed, if it was a Parse (a Bind of it
/// is covered by that judgement, as a Bind of any name parsed in the batch is by its
/// Parse's). `false` for anything else, for a batch whose Sync has not arrived, and for one
/// of more than [`MAX_BATCH_MESSAGES`] messages.
pub fn batch_reads<'a>(
    opened_by: Option<&'a [u8]>,
    rest: &'a [u8],
    mut judge: impl FnMut(Item<'a>) -> bool,
) -> bool {
    let mut parsed: Vec<&'a [u8]> = opened_by.into_iter().collect();
    let mut at = 0;
    for _ in 1..MAX_BATCH_MESSAGES {
        let buf = &rest[at..];
        let Ok(Some(h)) = framing::complete(buf, Direction::Frontend) else {
            return false;
        };
        let body = &buf[framing::HEADER_LEN..h.total];
        at += h.total;
        let ok = match h.tag {
            frontend::SYNC => return true,
            frontend::PARSE => Parse::read(body).is_some_and(|p| {
                parsed.push(p.name);
                judge(Item::Parse(p.query))
            }),
            frontend::BIND => Bind::read(body)
                .is_some_and(|b| parsed.contains(&b.statement) || judge(Item::Bind(b.statement))),
            frontend::DESCRIBE | frontend::EXECUTE | frontend::CLOSE | frontend::FLUSH => true,
            _ => false,
        };
        if !ok {
            return false;
        }
    }
    false
}

/// The client's reads and writes as routing sees them.
#[derive(Debug, Default)]
pub struct Reads {
    /// What a replica must have replayed before the client's next read may run there.
    pub fresh: Fresh,
    /// The current unit runs on the primary and sent a statement that [`may_write`].
    pub wrote: bool,
}

/// Read-your-writes: what a replica must have done before this client's next read may run
/// there.
#[derive(Debug, Default)]
pub enum Fresh {
    /// Nothing: the client wrote nothing the replicas have not replayed (as far as it asked).
    #[default]
    Any,
    /// Replayed the primary's WAL position after the client's last write (filled in once the
    /// read of it answers; until then, and if it failed, no replica qualifies).
    Replayed(Arc<WalMark>),
    /// Nothing before then: the caller's fixed window after its last write.
    After(Instant),
}

impl Fresh {
    /// Whether a replica that has replayed up to `replayed` (`None`: not known) may serve
    /// the client's read at `now`. Once one may, the requirement is dropped (positions only
    /// grow).
    pub fn allows(&mut self, replayed: Option<Lsn>, now: Instant) -> bool {
        let ok = match self {
            Fresh::Any => return true,
            Fresh::After(t) => now >= *t,
            Fresh::Replayed(mark) => match (mark.get(), replayed) {
                (Some(Some(written)), Some(replayed)) => replayed >= written,
                _ => false,
            },
        };
        if ok {
            *self = Fresh::Any;
        }
        ok
    }
}

#[cfg(test)]
#[path = "route_tests.rs"]
mod tests;
