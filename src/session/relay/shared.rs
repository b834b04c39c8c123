//! A read under a COALESCE rule (`crate::coalesce`) in the relay: whether this statement may
//! share an execution, joining the run in flight (or starting one), and a follower's answer.
//!
//! Owns the session's half of the decision: a read that opens a unit outside a transaction,
//! with no session effect, nothing else in flight or unsent, no backend held, in transaction
//! mode, from a client not pinned, and a text the parse proves shareable — as a one-statement
//! simple Query, or as an extended batch of the one shape `coalesce::batch` reads (`[Parse]
//! Bind [Describe] Execute Sync`, all sent). The leader's recording happens where its
//! client's bytes are written (`Relay::on_backend_now`, and the answers the proxy gives
//! itself in `Relay::on_client_data`), its end at its first ReadyForQuery (`Relay::on_seen`).
//!
//! A follower's batch is answered here: the leader's bytes, then the rest of the batch is
//! dropped up to its Sync, which gets the ReadyForQuery; a Parse in it is kept as the client's
//! statement, prepared on a backend when a later Bind needs it.

use bytes::Bytes;

use crate::classify::{Classified, StmtKind};
use crate::coalesce::{Fallback, Joined, Key, batch};
use crate::policy::rules::CoalesceRule;
use crate::protocol::framing;
use crate::protocol::messages::{self, Parse};

use super::route::Routing;
use super::{Relay, Step};

impl Relay {
    /// Joins the run of this read (a follower), starts one (the unit leads it), or `None`
    /// when the statement may not be shared (or the run in flight started before the
    /// client's last unit ended: it may not show what that unit wrote).
    pub(super) fn join_shared(
        &mut self,
        rule: CoalesceRule,
        class: &Classified,
        step: &Step<'_>,
    ) -> Option<Joined> {
        let eligible = !self.lease.attached()
            && self.unit.lead.is_none()
            && self.core.between_units()
            && self.core.pooled()
            && class.kind == StmtKind::Read
            && class.effects.is_empty()
            && !class.oversized
            && !class.normalized.contains(';');
        if !eligible {
            return None;
        }
        let (text, key): (Bytes, Bytes) = match (step.tag, step.route) {
            (b'Q', _) => {
                let sql = messages::query_body(&step.frame[framing::HEADER_LEN..])?;
                let t = Bytes::copy_from_slice(sql);
                (t.clone(), t)
            }
            (b'P' | b'B', Routing::Batch { rest, .. }) => {
                let b = batch::read(step.frame, rest)?;
                let (text, types) = match &b.parse {
                    Some(p) => (
                        Bytes::copy_from_slice(p.query),
                        Bytes::copy_from_slice(p.types),
                    ),
                    None => self.core.statement_text_and_types(b.statement)?,
                };
                let key = b.key(&text, &types).into();
                (text, key)
            }
            _ => return None,
        };
        let sql = std::str::from_utf8(&text).ok()?;
        self.app.coalescer.shareable(class.fingerprint, sql).ok()?;
        let pool = self.lease.unit_pool.as_ref().unwrap_or(&self.pool);
        let key = Key {
            pool: std::sync::Arc::as_ptr(pool) as usize,
            settings: self.login.settings.clone(),
            text: key,
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
        class: &std::sync::Arc<Classified>,
        step: &Step<'_>,
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
                    self.core.answer(|b| b.extend_from_slice(&result));
                    self.answered_shared(class, step);
                    return true;
                }
                // The run ended without a result: the next one may be led from here.
                Err(Fallback::Gone) => match self.join_shared(rule, class, step) {
                    Some(j) => joined = j,
                    None => return false,
                },
                Err(_) => return false,
            }
        }
    }

    /// After the leader's bytes: a simple Query's ReadyForQuery; for a batch, its Parse kept
    /// as the client's statement and the rest dropped up to the Sync (answered there).
    fn answered_shared(&mut self, class: &std::sync::Arc<Classified>, step: &Step<'_>) {
        if step.tag == b'Q' {
            self.core.answer_ready();
            return;
        }
        let body = &step.frame[framing::HEADER_LEN..];
        if step.tag == b'P'
            && let Some(p) = Parse::read(body)
        {
            self.core
                .remember_statement(body, p, std::sync::Arc::clone(class));
        }
        self.core.skip_until_sync();
    }
}
