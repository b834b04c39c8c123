//! Replica routing inside the relay: where the next unit runs when the client may read from
//! its database's replicas, and what the client's writes require of them (read-your-writes).
//!
//! A unit goes to the replicas only when it opens outside a transaction with a routable read
//! — a simple-protocol Query, or an extended-protocol batch judged whole at its first message
//! (`machine::route::batch_reads`) — of a `route: replica` caller or a ROUTE rule, and a
//! replica is up, within `max_replica_lag_ms`, and fresh enough for this client. Fresh
//! enough: after a unit on the primary that may have written ends, the primary's WAL position
//! is read on that unit's backend before it goes back to its pool (the client already has its
//! reply), and the client's reads stay on the primary until a replica's probe shows that
//! position replayed — or, for a caller with `read_your_writes_ms`, for that long instead.
//! Until the position is known, or if reading it failed, no replica is fresh enough.
//!
//! The pure parts (what is routable, which batches, which statements write, the freshness
//! test) are in `machine::route`; this module applies them to the lease, the pool and the
//! metrics.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::classify::Classified;
use crate::config::{ReadRoute, ReplicaFallback};
use crate::pool::Pooled;
use crate::pool::wal::WalMark;
use crate::protocol::PgError;

use super::super::machine::route::{self, Fresh};
use super::Relay;

/// Where `pgsluice_replica_reads_total` counts a read (`REPLICA_READ_DECISIONS` order).
const TO_REPLICA: usize = 0;
const KEPT_FOR_WRITES: usize = 1;
const NO_REPLICA: usize = 2;

/// How a statement takes part in the routing of its unit.
#[derive(Clone, Copy)]
pub(super) enum Routing<'a> {
    /// Never routed (a FunctionCall).
    No,
    /// A simple-protocol Query: the whole unit when it opens one.
    Query,
    /// A Parse (`opened_by`: its statement name) or Bind that may open an extended batch;
    /// `rest`: what the client sent after it, where the batch's other messages and its Sync
    /// must already be.
    Batch {
        opened_by: Option<&'a [u8]>,
        rest: &'a [u8],
    },
}

impl Relay {
    /// Before a statement borrows a backend: a routable read of a caller that reads from
    /// replicas (or of a pattern a ROUTE rule sends there), opening a unit outside a
    /// transaction, goes to the database's replicas when one is reachable, within
    /// `max_replica_lag_ms` and fresh enough for this client; otherwise to the primary, or
    /// refused (`replica_fallback: refuse`, when no replica qualifies; a read kept on the
    /// primary for read-your-writes is never refused). Anything that may write or touch the
    /// session stays on the primary, and so does a batch with anything of the kind in it.
    pub(super) fn choose_replica(
        &mut self,
        class: &Classified,
        routing: Routing<'_>,
    ) -> Result<(), PgError> {
        let rule_route = self.unit.rule_route.take();
        if matches!(routing, Routing::No) || self.lease.attached() {
            // Inside a unit: it runs where it started.
            return Ok(());
        }
        self.lease.unit_pool = None;
        let eligible = self.core.between_units() && self.core.pooled() && route::routable(class);
        if !eligible {
            return Ok(());
        }
        let cfg = Arc::clone(&self.rt.config);
        let caller = self.unit.last_caller;
        // A ROUTE rule on the pattern wins over the caller's `route`.
        let wants = rule_route.unwrap_or_else(|| {
            cfg.callers
                .get(usize::from(caller))
                .is_some_and(|c| c.route == ReadRoute::Replica)
        });
        let Some(entry) = cfg.database_entry(&self.login.database).filter(|_| wants) else {
            return Ok(());
        };
        if let Routing::Batch { opened_by, rest } = routing
            && !self.batch_reads(opened_by, rest)
        {
            return Ok(());
        }
        if self.lease.replica.is_none() {
            self.lease.replica = self
                .app
                .replica_pool_for(&self.login.database, &self.login.user);
        }
        let now = self.now();
        let metrics = &self.rt.caller_metrics;
        match &self.lease.replica {
            Some(r) if r.replica_usable(entry.max_replica_lag_ms) => {
                if self
                    .core
                    .replica_fresh_enough(r.replica_replay_lsn(), now.into_std())
                {
                    self.lease.unit_pool = Some(Arc::clone(r));
                    metrics.replica_read(caller, TO_REPLICA);
                } else {
                    metrics.replica_read(caller, KEPT_FOR_WRITES);
                }
                Ok(())
            }
            _ if entry.replica_fallback == ReplicaFallback::Refuse => Err(PgError::error(
                "53400",
                format!(
                    "pgsluice: ERR_NO_REPLICA: no replica of database \"{}\" is reachable \
                     with a replay lag within {} ms",
                    self.login.database, entry.max_replica_lag_ms
                ),
            )
            .with_detail("limit: databases[].replica_fallback=refuse")
            .with_hint(format!(
                "retry_after_ms={}",
                self.app
                    .policy
                    .retry_hint_ms_in(&self.rt.limits, caller, None)
            ))),
            _ => {
                metrics.replica_read(caller, NO_REPLICA);
                Ok(())
            }
        }
    }

    /// Whether the rest of an extended batch holds only routable reads (`batch_reads`), each
    /// Parse's text classified as it will be when it is handled, each Bind's statement as the
    /// client prepared it.
    fn batch_reads(&mut self, opened_by: Option<&[u8]>, rest: &[u8]) -> bool {
        self.core.batch_reads(&self.app.classifier, opened_by, rest)
    }

    /// A statement is on its way to the backend: one that may write, in a unit on the
    /// primary of a client that may read from replicas, makes the unit's end read the WAL
    /// position ([`Relay::release_after_unit`]).
    #[inline(always)]
    pub(super) fn note_write(&mut self, class: &Classified) {
        self.core.note_write(
            self.lease.replica_possible
                && self.lease.unit_pool.is_none()
                && route::may_write(class),
        );
    }

    /// The unit is over and its backend leaves the client: after a unit that may have
    /// written, what the client's reads require of a replica from now on — the WAL position
    /// read on `b` before it goes back to its pool (then `None`: that task has it), or the
    /// caller's window. `Some(b)`: release it as usual.
    pub(super) fn release_after_unit(&mut self, b: Pooled, now: Instant) -> Option<Pooled> {
        if !self.core.take_wrote() {
            return Some(b);
        }
        let window = self
            .rt
            .config
            .callers
            .get(usize::from(self.unit.last_caller))
            .and_then(|c| c.read_your_writes_ms);
        let fresh = match window {
            Some(0) => Fresh::Any,
            Some(ms) => Fresh::After((now + Duration::from_millis(ms)).into_std()),
            None => {
                let mark = Arc::new(WalMark::default());
                tokio::spawn(b.release_after_wal_read(Arc::clone(&mark)));
                self.core.require_fresh(Fresh::Replayed(mark));
                return None;
            }
        };
        self.core.require_fresh(fresh);
        Some(b)
    }
}
