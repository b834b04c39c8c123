//! A read under a COALESCE rule (`crate::coalesce`) in the relay: whether this statement may
//! share an execution, joining the run in flight (or starting one), and a follower's answer.
//!
//! Owns the session's half of the decision: a one-statement simple-protocol read outside a
//! transaction, with no session effect, nothing else in flight or unsent, no backend held, in
//! transaction mode, from a client not pinned — and a text the parse proves shareable. The
//! leader's recording happens where its replies are written (`Relay::on_backend_now`), its
//! end at its first ReadyForQuery (`Relay::on_seen`).

use bytes::Bytes;

use crate::classify::{Classified, StmtKind};
use crate::coalesce::{Fallback, Joined, Key};
use crate::config::PoolMode;
use crate::policy::rules::CoalesceRule;
use crate::protocol::messages;

use super::Relay;

impl Relay {
    /// Joins the run of this read (a follower), starts one (the unit leads it), or `None`
    /// when the statement may not be shared (or the run in flight started before the
    /// client's last unit ended: it may not show what that unit wrote).
    pub(super) fn join_shared(
        &mut self,
        rule: CoalesceRule,
        class: &Classified,
        text: &[u8],
    ) -> Option<Joined> {
        let eligible = !self.lease.attached()
            && self.unit.lead.is_none()
            && self.core.out.t.txn == b'I'
            && !self.core.out.t.in_flight()
            && self.core.out.is_empty()
            && !self.core.pinned
            && self.core.mode == PoolMode::Transaction
            && class.kind == StmtKind::Read
            && class.effects.is_empty()
            && !class.oversized
            && !class.normalized.contains(';');
        if !eligible {
            return None;
        }
        let sql = std::str::from_utf8(text).ok()?;
        self.app.coalescer.shareable(class.fingerprint, sql).ok()?;
        let pool = self.lease.unit_pool.as_ref().unwrap_or(&self.pool);
        let key = Key {
            pool: std::sync::Arc::as_ptr(pool) as usize,
            settings: self.login.settings.clone(),
            text: Bytes::copy_from_slice(text),
        };
        self.app
            .coalescer
            .join(key, rule.max_result_bytes, self.unit.ended_at)
    }

    /// A follower's wait: `true` when the client was answered from the leader's result;
    /// `false` when it runs the read itself (or, after joining again, leads the next run).
    pub(super) async fn follow(
        &mut self,
        mut joined: Joined,
        rule: CoalesceRule,
        class: &Classified,
        text: &[u8],
    ) -> bool {
        loop {
            let follower = match joined {
                Joined::Follow(f) => f,
                Joined::Lead(l) => {
                    self.unit.lead = Some(l);
                    return false;
                }
            };
            match follower.wait(rule.max_wait).await {
                Ok(result) => {
                    self.core.cout.extend_from_slice(&result);
                    messages::ready_for_query(&mut self.core.cout, self.core.out.t.txn);
                    return true;
                }
                // The run ended without a result: the next one may be led from here.
                Err(Fallback::Gone) => match self.join_shared(rule, class, text) {
                    Some(j) => joined = j,
                    None => return false,
                },
                Err(_) => return false,
            }
        }
    }
}
