//! Admission inside the relay: who is calling, what the policy says, which timeouts the
//! statement runs with, and the per-statement bookkeeping for statistics.
//!
//! A *unit* is the span during which the client holds a backend (one transaction in
//! transaction mode, one request batch in session mode). The first statement of a unit goes
//! through full admission (rules, caller rate and concurrency with its queue, breaker), whose
//! RAII permit is held until the unit ends — so a caller's concurrency is the number of
//! backends it holds (a client pinned to its backend keeps its last unit's permit between
//! units). Later statements of the unit are checked against the fingerprint rules.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::io::AsyncRead;
use tokio::time::Instant;

use crate::app;
use crate::classify::{Classified, StmtKind};
use crate::observe::stats::Outcome;
use crate::policy::{Admission, AdmitRequest, Refusal, StatementAdmission};
use crate::pool::{Pool, PoolStats, Pooled};
use crate::protocol::PgError;
use crate::protocol::messages;

use super::super::tracker::{Expect, Kind, Mode};
use super::super::unless_client_leaves;
use super::Relay;

/// The counters the session's traffic goes to now: those of the pool of the backend it holds
/// (a replica pool's, for a read routed there), else its own pool's. Statements and
/// transactions are counted at a ReadyForQuery, while the backend that sent it is held.
fn counted<'a>(backend: &'a Option<Pooled>, pool: &'a Arc<Pool>) -> &'a PoolStats {
    &backend.as_ref().map_or(pool, Pooled::pool).stats
}

/// Timeouts a statement must run with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Timeouts {
    pub statement: Option<Duration>,
    pub lock: Option<Duration>,
}

impl Timeouts {
    fn is_empty(&self) -> bool {
        self.statement.is_none() && self.lock.is_none()
    }
}

fn refusal_error(r: &Refusal) -> PgError {
    let e = PgError::error(r.sqlstate, r.message.clone()).with_detail(r.detail.clone());
    match r.hint() {
        Some(h) => e.with_hint(h),
        None => e,
    }
}

/// How far [`Relay::admit_now`] got.
pub(super) enum Admit {
    /// Decided: the timeouts to run with, or the refusal to send.
    Done(Result<Timeouts, PgError>),
    /// The policy may make it wait: [`Relay::admit_wait`] with this request.
    Wait(AdmitRequest),
}

/// An admission the policy granted: a new unit's, or a statement's inside one.
enum Decided {
    Unit(Admission),
    Statement(StatementAdmission),
}

/// SQLSTATEs that say the backend (not the client's SQL) is in trouble: they feed the breaker.
pub(super) fn is_backend_fault(code: &str) -> bool {
    code.starts_with("08")
        || code.starts_with("53")
        || code.starts_with("57P")
        || code.starts_with("58")
        || code.starts_with("XX")
        || code == "57014"
}

impl Relay {
    /// Resolves the caller of a statement: its comment tags first, then the session's
    /// application_name, user and address. A statement without tags has the session's
    /// caller, remembered until the runtime snapshot or the session's settings change.
    fn resolve_caller(&mut self, class: &Classified) -> u16 {
        let resolve = |tags| {
            self.rt.callers.resolve(
                tags,
                self.login.application_name(),
                &self.login.user,
                self.peer_ip,
            )
        };
        if class.tags.is_empty() {
            *self.unit.session_caller.get_or_insert_with(|| resolve(&[]))
        } else {
            resolve(&class.tags)
        }
    }

    /// Admits one statement (at Query, or at Bind/Parse for the extended protocol), as far as
    /// that needs no wait: [`Admit::Done`] with the timeouts it must run with or the refusal
    /// to send; [`Admit::Wait`] when the policy may queue it (a full caller, a rule, a rate),
    /// to finish with [`Relay::admit_wait`]. The usual statement makes no future here.
    #[inline(always)]
    pub(super) fn admit_now(&mut self, class: &Arc<Classified>) -> Admit {
        let arrived = self.now();
        self.core.statement_arrived(arrived.into_std());
        if self.unit.door.is_some() {
            // From here it is counted in the queues it joins, not as coming.
            self.unit.door = None;
        }
        if !self.unit.is_open() {
            // A new unit: it runs under the configuration in force now, all of it (caller
            // matching, limits, series, timeouts) from one snapshot, whatever a reload does
            // meanwhile.
            if let Some(current) = self.app.newer_runtime(&self.rt) {
                self.rt = current;
                self.unit.session_caller = None;
            }
        }
        let caller = self.resolve_caller(class);
        self.unit.last_caller = caller;
        self.cancel.client.set_statement(caller, class.fingerprint);
        let req = AdmitRequest {
            caller,
            fingerprint: class.fingerprint,
            now: arrived,
        };
        let policy = &self.app.policy;
        let decided = if !self.unit.is_open() {
            // A pinned client's next unit competes for a permit like any other.
            self.unit.pinned_hold = None;
            policy
                .admit_now(&self.rt.limits, &req)
                .map(|r| r.map(Decided::Unit))
        } else {
            policy
                .check_statement_now(&self.rt.limits, &req)
                .map(|r| r.map(Decided::Statement))
        };
        match decided {
            Some(d) => Admit::Done(self.admitted(class, caller, d)),
            None => Admit::Wait(req),
        }
    }

    /// The rest of an admission [`Relay::admit_now`] left waiting: the unit's queue (watching
    /// the client meanwhile), or a statement's rule or rate.
    pub(super) async fn admit_wait<S: AsyncRead + Unpin>(
        &mut self,
        class: &Arc<Classified>,
        req: AdmitRequest,
        client: &mut S,
    ) -> Result<Timeouts, PgError> {
        let rt = Arc::clone(&self.rt);
        let app = self.app.clone();
        let decided = if !self.unit.is_open() {
            let why = "client disconnected while queued";
            let admit = std::pin::pin!(app.policy.admit_in(&rt.limits, &req));
            self.unless_client_leaves(admit, client, why)
                .await?
                .map(Decided::Unit)
        } else {
            app.policy
                .check_statement_in(&rt.limits, &req)
                .await
                .map(Decided::Statement)
        };
        self.admitted(class, req.caller, decided)
    }

    /// What the policy decided, kept: the unit's admission (held until the backend goes
    /// back) or a statement's, its warnings sent, its timeouts worked out.
    fn admitted(
        &mut self,
        class: &Arc<Classified>,
        caller: u16,
        decided: Result<Decided, Refusal>,
    ) -> Result<Timeouts, PgError> {
        let (statement_override, lock_override, warnings) = match decided {
            Ok(Decided::Unit(mut a)) => {
                let w = std::mem::take(&mut a.warnings);
                let o = (a.statement_timeout_override, a.lock_timeout_override);
                self.unit.rule_route = a.route_replica;
                self.unit.rule_coalesce = a.coalesce;
                self.rt.caller_metrics.queue_wait(caller, a.queue_wait);
                if let Some(action) = a.rule_action {
                    self.app.metrics.rule_hit(action, false);
                }
                self.unit.caller = caller;
                self.unit.admission = Some(a);
                (o.0, o.1, w)
            }
            Ok(Decided::Statement(mut a)) => {
                let w = std::mem::take(&mut a.warnings);
                let o = (a.statement_timeout_override, a.lock_timeout_override);
                self.unit.rule_route = a.route_replica;
                self.unit.rule_coalesce = a.coalesce;
                if let Some(action) = a.rule_action {
                    self.app.metrics.rule_hit(action, false);
                }
                self.unit.stmt_admissions.push(a);
                (o.0, o.1, w)
            }
            Err(r) => return Err(self.refused(class, caller, &r)),
        };
        for w in warnings {
            self.core
                .answer(|b| PgError::error("01000", w).encode_notice(b));
        }
        let cfg = &self.rt.config;
        Ok(Timeouts {
            statement: statement_override
                .or_else(|| app::statement_timeout(cfg, caller, class.kind)),
            lock: lock_override.or_else(|| app::lock_timeout(cfg, caller)),
        })
    }

    fn refused(&self, class: &Arc<Classified>, caller: u16, r: &Refusal) -> PgError {
        self.rt.caller_metrics.refusal(caller, r.kind.reason());
        if let Some(action) = r.rule_action {
            self.app.metrics.rule_hit(action, true);
        }
        let names = &self.rt.callers;
        let cfg = &self.rt.config;
        if cfg.log.refusals
            && let Some(suppressed) = self.app.log_limits.refusals.admit(
                crate::observe::stats::unix_ms(),
                cfg.log.max_lines_per_second,
            )
        {
            tracing::info!(
                target: "pgsluice::refusals",
                client_ip = %self.peer_ip.map(|ip| ip.to_string()).unwrap_or_default(),
                caller = names.name(caller),
                reason = r.kind.reason(),
                sqlstate = r.sqlstate,
                fingerprint = %format_args!("{:016x}", class.fingerprint),
                retry_after_ms = r.retry_after_ms,
                detail = %r.detail,
                suppressed,
                "refused"
            );
        }
        self.app.fp_stats.record(
            class.fingerprint,
            &class.normalized,
            class.kind.as_str(),
            names.name_arc(caller),
            Duration::ZERO,
            Outcome::Refused(r.kind.reason()),
        );
        refusal_error(r)
    }

    /// Remembers a statement sent to the backend, to time it when its ReadyForQuery comes
    /// (attributed to the caller its admission resolved).
    #[inline(always)]
    pub(super) fn track_statement(&mut self, class: Arc<Classified>, ready_seq: u64) {
        self.note_write(&class);
        let start = self.now();
        self.core
            .track(class, self.unit.last_caller, start.into_std(), ready_seq);
    }

    /// A client ReadyForQuery arrived: records the statements it completes (caller metrics,
    /// the breaker, per-fingerprint statistics), the transaction it ends and the bytes
    /// relayed, in the counters of the pool whose backend sent it.
    pub(super) fn statements_done(&mut self, rows: u64) {
        let now = self.now();
        let (rt, app) = (&self.rt, &self.app);
        let ready = self.core.ready(now.into_std(), rows, |f| {
            rt.caller_metrics
                .query(f.caller, f.total, f.elapsed, f.succeeded);
            // Every statement that reached the backend tells the breaker how it went.
            app.policy.record_backend_result_at(f.backend_ok, now);
            app.fp_stats.record(
                f.class.fingerprint,
                &f.class.normalized,
                f.class.kind.as_str(),
                rt.callers.name_arc(f.caller),
                f.elapsed,
                f.outcome,
            );
        });
        let stats = counted(&self.lease.backend, &self.pool);
        if let Some(took) = ready.transaction {
            stats.transactions.fetch_add(1, Ordering::Relaxed);
            stats
                .transaction_us
                .fetch_add(super::micros(took), Ordering::Relaxed);
        }
        if ready.statements > 0 {
            stats.queries.fetch_add(ready.statements, Ordering::Relaxed);
            stats
                .query_us
                .fetch_add(ready.backend_us, Ordering::Relaxed);
        }
        self.flush_counters();
    }

    /// Waits for `fut` while watching the client ([`unless_client_leaves`]), and counts what
    /// the client sent meanwhile (a pipelining client's next messages, read ahead into the
    /// buffer) as received: the event loop only counts its own reads.
    pub(super) async fn unless_client_leaves<S, F>(
        &mut self,
        fut: std::pin::Pin<&mut F>,
        client: &mut S,
        why: &'static str,
    ) -> Result<F::Output, PgError>
    where
        S: AsyncRead + Unpin,
        F: std::future::Future,
    {
        let mut fut = fut;
        // Most complete at once: no client watch, no state change, the wake-up's clock.
        if let std::task::Poll::Ready(r) = futures_util::poll!(fut.as_mut()) {
            return Ok(r);
        }
        // It waits: whatever reads the clock next reads it afresh.
        self.wake.moved_on();
        let buf = self.core.client_in();
        let before = buf.len();
        let r = unless_client_leaves(fut, client, buf, &self.cancel, why).await;
        self.wake.moved_on();
        let read = self.core.client_in().len().saturating_sub(before);
        self.core.read_while_waiting(read);
        r
    }

    /// Adds the bytes the session relayed since the last call to its pool's counters.
    pub(super) fn flush_counters(&mut self) {
        let stats = counted(&self.lease.backend, &self.pool);
        let (bytes_in, bytes_out) = self.core.take_bytes();
        if bytes_in > 0 {
            stats.bytes_received.fetch_add(bytes_in, Ordering::Relaxed);
        }
        if bytes_out > 0 {
            stats.bytes_sent.fetch_add(bytes_out, Ordering::Relaxed);
        }
    }

    /// Arms the proxy's own deadline for a statement with a statement timeout: if Postgres
    /// has not stopped it a second after the timeout, the relay sends a real cancel.
    pub(super) fn arm_backstop(&mut self, t: Timeouts) {
        if let Some(d) = t.statement {
            // A fresh reading, not the wake-up's: a backend write that blocked since then
            // must not bring the backstop forward (only statements with a timeout get here).
            self.core
                .arm_backstop((Instant::now() + d + Duration::from_secs(1)).into_std());
        }
    }

    /// The unit is over (backend idle): give back the caller's permit and rule slots.
    pub(super) fn end_unit(&mut self) {
        if self.unit.is_open() {
            // Whatever it did is answered by now: a read shared with others must not have
            // started before this (`crate::coalesce`).
            self.unit.ended_at = Some(self.now());
        }
        self.core.unit_over();
        // A pinned client's backend stays with it: so does the caller's permit for it.
        self.unit.end(self.core.pinned());
    }

    /// Injects `timeouts` for the next statement so they apply inside its transaction.
    /// Every kind that runs a query gets them (DDL too: its `lock_timeout` is what keeps a
    /// migration from piling up behind a lock). Simple protocol, outside a transaction block:
    /// returns the prefix to put in front of the client's query text (they then share one
    /// implicit transaction). Inside a block: a separate swallowed `SET LOCAL`. Extended
    /// protocol: a swallowed `set_config(.., true)` through a proxy-named statement and
    /// portal, which leaves the client's unnamed statement and portal alone. Statements that
    /// need a transaction of their own get session-level budgets around them instead.
    pub(super) fn inject_timeouts(
        &mut self,
        t: Timeouts,
        class: &Classified,
        simple: bool,
    ) -> Option<String> {
        if class.kind == StmtKind::Transaction && self.unit.hold_cursor {
            // A COMMIT after a DECLARE ... WITH HOLD runs the cursor's query to materialize
            // it: user-visible work, so the proxy's deadline holds (nothing is injected: a
            // budget set now would not bind the COMMIT's own work).
            self.arm_backstop(t);
            return None;
        }
        if t.is_empty()
            // Transaction control and SET/RESET/LISTEN-like statements run no query of
            // their own; a SET after our SET LOCAL would also be confusing to read back.
            || matches!(class.kind, StmtKind::Transaction | StmtKind::Session)
            // SHOW reports settings: it must see the client's, not ours. Only a text that is
            // one SHOW: `SHOW x; SELECT pg_sleep(60)` runs under its budget like any other.
            || (class.normalized.get(..4).is_some_and(|w| w.eq_ignore_ascii_case("show"))
                && !class
                    .normalized
                    .trim_end()
                    .trim_end_matches(';')
                    .contains(';'))
            || self.core.txn() == b'E'
            // An empty query (or only a comment) must still answer EmptyQueryResponse.
            || class.normalized.trim().is_empty()
        {
            return None;
        }
        self.arm_backstop(t);
        if class.own_transaction && self.core.txn() == b'I' {
            // `VACUUM`, `CREATE INDEX CONCURRENTLY`, `CALL`, a FunctionCall: no SET LOCAL can
            // share their transaction. The budget is set for the session in a request of its
            // own before theirs and put back after it (`restore_timeouts`). That needs a gap
            // between requests: in the middle of an extended batch only the backstop holds.
            if self.core.sync_pending() || self.unit.restore_after.is_some() {
                return None;
            }
            self.core.send_query(Mode::Swallow, &session_timeout_sql(t));
            self.unit.restore_after = Some(restore_timeout_sql(t));
            return None;
        }
        let sql = timeout_sql(t);
        if simple {
            if self.core.txn() == b'I' {
                return Some(format!("{sql};"));
            }
            self.core.send_query(Mode::Swallow, &sql);
            return None;
        }
        let hash = xxhash_rust::xxh3::xxh3_64_with_seed(sql.as_bytes(), self.app.statement_seed);
        let name = crate::pool::prepared::server_name(hash);
        const PORTAL: &[u8] = b"_pgsl_timeouts";
        const NO_TYPES: &[u8] = b"\0\0";
        let srv = super::server(&mut self.lease.backend, &self.pool);
        self.core
            .ensure_prepared(srv, hash, sql.as_bytes(), NO_TYPES, Mode::Swallow);
        // No parameters, text results.
        let o = &mut self.core;
        o.send_with(Expect::new(Kind::Bind, Mode::Swallow), |buf| {
            messages::bind_renamed(buf, PORTAL, &name, b"\0\0\0\0\0\0")
        });
        o.send_with(Expect::new(Kind::Execute, Mode::Swallow), |buf| {
            messages::raw(buf, b'E', &[PORTAL, b"\0", &0i32.to_be_bytes()])
        });
        o.send_with(Expect::new(Kind::Close, Mode::Swallow), |buf| {
            messages::target(buf, b'C', b'P', PORTAL)
        });
        None
    }
}

impl Relay {
    /// After the request that `inject_timeouts` set session-level budgets for: put the
    /// client's settings back, in a request of its own.
    pub(super) fn restore_timeouts(&mut self) {
        if let Some(sql) = self.unit.restore_after.take() {
            self.core.send_query(Mode::Swallow, &sql);
        }
    }
}

/// The value to give setting `name` for a budget `d`: the client's own setting when that is
/// stricter (non-zero and shorter), else the budget — a caller's budget is a ceiling.
fn budget_expr(name: &str, d: Duration) -> String {
    let budget = format!("'{}ms'", d.as_millis());
    let current = format!("pg_catalog.current_setting('{name}')");
    format!(
        "CASE WHEN {current}::pg_catalog.interval OPERATOR(pg_catalog.>) '0'::pg_catalog.interval \
         AND {current}::pg_catalog.interval OPERATOR(pg_catalog.<) \
         {budget}::pg_catalog.interval THEN {current} ELSE {budget} END"
    )
}

fn budgets(t: Timeouts) -> impl Iterator<Item = (&'static str, Duration)> {
    [("statement_timeout", t.statement), ("lock_timeout", t.lock)]
        .into_iter()
        .filter_map(|(n, d)| d.map(|d| (n, d)))
}

/// Session-level budgets for a statement that runs in a transaction of its own. The
/// client's setting is remembered in `pgsluice.restore_<name>` first: its value when the
/// client (or its startup parameters) set it for the session, else empty, meaning "back to
/// the default" (`set_config(name, NULL, false)` resets).
fn session_timeout_sql(t: Timeouts) -> String {
    let parts: Vec<String> = budgets(t)
        .map(|(name, d)| {
            format!(
                "pg_catalog.set_config('pgsluice.restore_{name}', CASE WHEN (SELECT source \
                 FROM pg_catalog.pg_settings WHERE name OPERATOR(pg_catalog.=) '{name}') \
                 OPERATOR(pg_catalog.=) 'session' THEN pg_catalog.current_setting('{name}') \
                 ELSE '' END, false), pg_catalog.set_config('{name}', {}, false)",
                budget_expr(name, d)
            )
        })
        .collect();
    format!("SELECT {}", parts.join(", "))
}

/// Puts back what `session_timeout_sql` remembered, and forgets it.
fn restore_timeout_sql(t: Timeouts) -> String {
    let parts: Vec<String> = budgets(t)
        .map(|(name, _)| {
            format!(
                "pg_catalog.set_config('{name}', NULLIF(pg_catalog.current_setting(\
                 'pgsluice.restore_{name}'), ''), false), \
                 pg_catalog.set_config('pgsluice.restore_{name}', NULL, false)"
            )
        })
        .collect();
    format!("SELECT {}", parts.join(", "))
}

/// `SELECT set_config(..)` that makes each budget in `t` the statement's setting for this
/// transaction only — unless the client's own setting is stricter (non-zero and shorter), in
/// which case that stays: a caller's budget is a ceiling. Decided by Postgres from the live
/// setting, so it is right even while the proxy's copy of the client's settings is stale.
/// It runs in the client's session, under the client's `search_path`, so every function,
/// operator and type is schema-qualified: a client that puts its own schema first (with its
/// own `set_config` or `<`) cannot neutralize the budget (TESTS.md B7's lesson).
fn timeout_sql(t: Timeouts) -> String {
    let parts: Vec<String> = budgets(t)
        .map(|(name, d)| {
            format!(
                "pg_catalog.set_config('{name}', {}, true)",
                budget_expr(name, d)
            )
        })
        .collect();
    format!("SELECT {}", parts.join(", "))
}
