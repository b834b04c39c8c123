//! The per-client forwarding loop after login: the driver around [`SessionCore`], the
//! session's state without sockets (`super::machine`).
//!
//! The driver owns what waits or touches the world: the client socket and the borrowed
//! backend's (`Lease`), the one timer behind the core's deadlines, admission by the policy
//! (`admission`, with the unit it opens: `Unit`), checkouts and parking, and the statistics
//! sinks. Client → backend: the core's `requests` frames the client's bytes and hands whole
//! requests here; every statement (Query, Parse, Bind, FunctionCall) goes through one
//! pipeline (admit, route to a replica or not — `route` —, attach a backend, apply its
//! session effects: in line in [`Relay::statement_now`], the waits in `statement_wait`), and
//! is written through the core's outbox with the reply it is owed, its named statements
//! renamed to shared proxy names (`_pgsl_<hash>`, prepared lazily on whichever
//! backend runs them); in transaction mode a plain `LISTEN`/`UNLISTEN` is answered here
//! instead and the client's notifications are written between its statements (`listen`,
//! over `crate::notify`). Backend → client: the core's `replies` frames the backend's bytes,
//! streams DataRow and CopyData without buffering them whole, and decides what is forwarded,
//! swallowed or answered by us; what a reply means (a request ended, an error, a statement
//! gone stale, a replay due) comes back here ([`Relay::on_seen`]). Writes are batched: one
//! write per read on each side.
//!
//! Per-transaction cost is the point of this file (see docs/BENCHMARKS.md): the event loop
//! polls the two sockets directly, in turns, rather than through a `select!` of futures
//! rebuilt per message; its deadlines share one kept timer; shutdown is an atomic phase plus a
//! waker registered once, not a lock taken per message; a checkout or admission that is ready
//! at once skips the client watch. A simple-protocol transaction costs two reads and two
//! writes, like PgBouncer's.
//!
//! Two habits keep the per-message code in the session's one state machine. Small helpers
//! run per message (framing, the tracker step, the reply scan, the statistics) are
//! `#[inline(always)]`: left to the inliner, each stayed a call. And what usually finishes
//! at once is a plain function tried before any future is made: giving the backend back or
//! keeping it parked ([`Relay::settle`]), taking back the parked one ([`Relay::unpark_now`]),
//! an empty flush, an admission nothing can delay (`admission`'s `admit_now`), a write the
//! socket takes whole (one `poll_write` under a no-op waker, [`write_now`]), and the whole
//! of a backend read that needs nothing else ([`Relay::on_backend_now`]); requests are
//! dispatched in [`Relay::on_client_data`] itself. Together −14 to −15 % instructions per
//! simple select (docs/BENCHMARKS.md, "What was tried and what it gave"). The client side
//! was tried the same way (a Query admitted and sent without a future) and measured slower;
//! it stays async.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;
use tokio_util::io::poll_read_buf;

use crate::app::App;
use crate::cancel;
use crate::classify::Classified;
use crate::config::PoolMode;
use crate::lifecycle::Phase;
use crate::pool::{Pool, Pooled, reset};
use crate::protocol::PgError;
use crate::protocol::framing;
use crate::protocol::messages;
use crate::rehome::Rehome;
use crate::runtime::Runtime;

use super::state;
use super::tracker::{Expect, Kind, Mode};
use super::{End, Login, set_cancel_target};
use crate::protocol::params;
use admission::Admit;

mod admission;
mod lease;
mod listen;
mod route;
mod shared;
mod unit;
mod wake;

use super::machine::deadlines::{Deadline, Idle};
use super::machine::statements::{Server, Statements};
use super::machine::tally::micros;
use super::machine::{CoreLimits, SessionCore, effects, release, replies, requests};
use admission::Timeouts;
use lease::Lease;
use route::Routing;
use unit::Unit;
use wake::{Cancels, Wake};

pub struct Relay {
    app: Arc<App>,
    pool: Arc<Pool>,
    login: Login,
    cancel: Arc<cancel::Entry>,
    /// The session's state without sockets: the cores, the deadlines, the tally and what
    /// the proxy knows of the client's server session.
    core: SessionCore,
    /// The backstop's cancel on its way, and the client's cancels seen.
    cancels: Cancels,
    /// The event loop's timer, turns, client waker and clock.
    wake: Wake,
    /// Client address, for caller matching by CIDR (none over the Unix socket).
    peer_ip: Option<std::net::IpAddr>,
    /// The runtime snapshot of the current unit (loaded when its first statement is
    /// admitted): caller ids, limits, series and timeouts all come from it.
    rt: Arc<Runtime>,
    /// The backends held: attached, parked, a replica's.
    lease: Lease,
    /// The current unit as admission left it.
    unit: Unit,
    /// The channels this client listens on through the pool's listener and what is being
    /// written of its notifications (transaction mode, `listen`); `None` until its first
    /// `LISTEN` answered here. Boxed: most sessions never listen.
    notify: Option<Box<listen::Listening>>,
}

enum Event {
    Client(std::io::Result<usize>),
    Backend(std::io::Result<usize>),
    /// One of the session's deadlines passed.
    Deadline(Deadline),
    /// Graceful shutdown began: finish the current transaction, then leave.
    Shutdown,
    /// The shutdown grace period is over: cancel what runs and leave now.
    Force,
    /// An operator ended this session (`DELETE /v1/clients/{id}`).
    Terminate,
    /// The pool wants the parked backend back (someone waits, a pause, a tick).
    Revoked,
    /// The client let too many notifications pile up (`crate::notify::MAX_QUEUED`).
    NotifyOverflow,
}

/// Query, Parse, Bind and FunctionCall go through admission (and may wait for it); the other
/// requests the driver sees only need a backend.
fn admitted(tag: u8) -> bool {
    matches!(tag, b'Q' | b'P' | b'B' | b'F')
}

/// How long a session found between transactions at shutdown waits for its client's next
/// request before leaving with 57P01.
const DRAIN_IDLE_GRACE: Duration = Duration::from_millis(500);

impl Relay {
    pub fn new(
        app: Arc<App>,
        pool: Arc<Pool>,
        login: Login,
        cancel: Arc<cancel::Entry>,
        cbuf: BytesMut,
        peer: crate::addr::ClientAddr,
    ) -> Relay {
        let mode = pool.mode();
        let rt = app.runtime.load_full();
        let cfg = Arc::clone(&rt.config);
        let replica_possible = cfg
            .database_entry(&login.database)
            .is_some_and(|d| !d.replicas.is_empty());
        let classify_on = cfg.classify.enabled;
        let (max_message, max_statements, max_statement_bytes) = (
            cfg.limits.max_message_bytes,
            cfg.limits.max_client_statements,
            cfg.limits.max_client_statement_bytes,
        );
        drop(cfg);
        let reading_trusted = params::reading_trusted(&login.settings);
        let statements = Statements::new(
            mode == PoolMode::Transaction,
            app.statement_seed,
            max_statements,
        )
        .with_max_bytes(max_statement_bytes);
        Relay {
            app,
            pool,
            login,
            cancel,
            core: SessionCore::new(
                mode,
                cbuf,
                CoreLimits { max_message },
                statements,
                reading_trusted,
                classify_on,
            ),
            cancels: Cancels::default(),
            wake: Wake::default(),
            peer_ip: peer.ip(),
            rt,
            lease: Lease {
                replica_possible,
                ..Lease::default()
            },
            unit: Unit::default(),
            notify: None,
        }
    }

    /// A login let through the door: counted as coming until its first statement meets
    /// admission.
    pub fn came_through(&mut self, door: Option<crate::app::DoorPass>) {
        self.unit.door = door;
    }

    /// Borrows the relay rather than taking it: an `async fn` that takes its receiver by
    /// value keeps it twice in its future (the argument and the moved-in local), 1.2 KiB
    /// more per session. The caller drops it right after.
    pub async fn run<S: AsyncRead + AsyncWrite + Rehome + Unpin>(&mut self, client: &mut S) -> End {
        let end = self.run_loop(client).await;
        if matches!(end, End::Error(_)) {
            // The error that follows must not land inside a half-written notification.
            self.finish_notification(client).await;
        }
        self.finish(&end).await;
        end
    }

    async fn run_loop<S: AsyncRead + AsyncWrite + Rehome + Unpin>(
        &mut self,
        client: &mut S,
    ) -> End {
        if let Err(end) = self.on_client_data(client).await {
            return end;
        }
        self.arm_idle_timers();
        loop {
            let ev = std::future::poll_fn(|cx| self.poll_event(cx, client)).await;
            self.wake.moved_on();
            let r = match ev {
                Event::Client(Ok(0)) | Event::Client(Err(_)) => return End::ClientClosed,
                Event::Client(Ok(n)) => {
                    self.core.client_read(n);
                    self.on_client_data(client).await
                }
                Event::Backend(Ok(0)) | Event::Backend(Err(_)) => return self.backend_gone(),
                Event::Backend(Ok(n)) if self.core.deferred() => {
                    self.core.backend_read(n);
                    match self.on_backend_data(client).await {
                        Ok(()) if !self.lease.replica_held() => {
                            // The replica's read is done and its backend back: now the rest.
                            self.core.replica_read_done();
                            self.on_client_data(client).await
                        }
                        r => r,
                    }
                }
                Event::Backend(Ok(n)) => {
                    self.core.backend_read(n);
                    // Not through `on_backend_data`: no future unless something waits.
                    match self.on_backend_now(client) {
                        Ok(None) => Ok(()),
                        Ok(Some(rest)) => self.on_backend_rest(rest, client).await,
                        Err(end) => Err(end),
                    }
                }
                Event::Deadline(Deadline::Backstop) => {
                    self.on_backstop();
                    Ok(())
                }
                Event::Revoked => {
                    self.give_back_parked().await;
                    Ok(())
                }
                Event::Deadline(Deadline::Unanswered) => return self.backend_unresponsive(),
                Event::Shutdown => {
                    // Between transactions: give a request already on its way a moment. A
                    // client that just logged in (its first query already on the wire) is
                    // served rather than told 57P01, which is what makes a rolling restart
                    // lose no new connection.
                    self.core
                        .drain((Instant::now() + DRAIN_IDLE_GRACE).into_std());
                    Ok(())
                }
                Event::Deadline(Deadline::IdleGrace) => {
                    self.core.idle_grace_over();
                    self.maybe_release().await
                }
                Event::Deadline(Deadline::IdleTransaction) => {
                    return self.idle_transaction_over();
                }
                Event::Deadline(Deadline::IdleClient) => return self.client_idle_over(),
                Event::NotifyOverflow => return notify_overflow(),
                Event::Terminate => {
                    tracing::info!(
                        client = self.cancel.client.id,
                        "session terminated by an operator"
                    );
                    return End::Error(PgError::terminated_by_admin());
                }
                Event::Force => {
                    // Wait for the cancel to reach Postgres: the process is about to exit,
                    // and a spawned task could die with it, leaving an orphan query.
                    if let Some(t) = self.cancel_backend_query("shutdown grace period over") {
                        let _ = tokio::time::timeout(Duration::from_secs(1), t).await;
                    }
                    return End::Error(PgError::shutting_down());
                }
            };
            if let Err(end) = r {
                return end;
            }
            self.arm_idle_timers();
        }
    }

    /// Arms the idle-in-transaction deadline when the client owes the next move inside an
    /// open transaction (nothing in flight, nothing unsent) and its caller has a limit, and
    /// the idle-client deadline when it owes the next move outside one; disarms each
    /// otherwise. Each limit is looked up once per idle period.
    #[inline(always)]
    fn arm_idle_timers(&mut self) {
        use crate::clients::ClientState;
        let idle = self.core.idle(self.lease.attached());
        self.cancel.client.set_state(match idle {
            Idle::No => ClientState::Active,
            Idle::InTransaction => ClientState::IdleInTransaction,
            Idle::Between => ClientState::Idle,
        });
        // The session's snapshot, refreshed at each unit's admission: no shared load here.
        let (rt, caller) = (&self.rt, self.unit.caller);
        self.core.arm_idle(
            idle,
            || Instant::now().into_std(),
            || match rt.config.limits.client_idle_timeout_ms {
                0 => None,
                ms => Some(Duration::from_millis(ms)),
            },
            || rt.limits.idle_transaction_timeout(caller),
        );
    }

    /// The client sat idle inside its transaction past its caller's limit: end the session
    /// as Postgres' own `idle_in_transaction_session_timeout` does (FATAL 25P03); the cleanup
    /// rolls the transaction back and the backend goes back to the pool.
    fn idle_transaction_over(&mut self) -> End {
        let limit = self
            .rt
            .limits
            .idle_transaction_timeout(self.unit.caller)
            .unwrap_or_default();
        let caller = self.rt.callers.name(self.unit.caller);
        tracing::info!(caller = %caller, limit_ms = limit.as_millis(), "idle-in-transaction timeout");
        End::Error(
            PgError::fatal(
                "25P03",
                "pgsluice: terminating connection due to idle-in-transaction timeout",
            )
            .with_detail(format!(
                "limit: caller {caller} idle_transaction_timeout_ms={}",
                limit.as_millis()
            )),
        )
    }

    /// The client sat idle between transactions past `limits.client_idle_timeout_ms`: end
    /// the session as Postgres' own `idle_session_timeout` does (FATAL 57P05).
    fn client_idle_over(&mut self) -> End {
        let limit = self.rt.config.limits.client_idle_timeout_ms;
        tracing::info!(limit_ms = limit, "client idle timeout");
        End::Error(
            PgError::fatal(
                "57P05",
                "pgsluice: terminating connection due to idle-session timeout",
            )
            .with_detail(format!("limit: limits.client_idle_timeout_ms={limit}")),
        )
    }

    /// The next thing to act on. Client and backend reads come first, in turns so neither
    /// starves the other; then the timer; then the process phase, read from an atomic after
    /// registering this task's waker with the registry (which wakes every session when the
    /// phase changes), so no shutdown is missed and no lock is taken per message.
    ///
    /// A listening client's notifications are written first when it is between statements;
    /// while one is half written neither side is read (nothing else may reach the client).
    #[inline(always)]
    fn poll_event<S: AsyncRead + AsyncWrite + Rehome + Unpin>(
        &mut self,
        cx: &mut Context<'_>,
        client: &mut S,
    ) -> Poll<Event> {
        if self.notify.is_some()
            && let Poll::Ready(ev) = self.poll_notifications(cx, client)
        {
            return Poll::Ready(ev);
        }
        let reading = self.notify.as_ref().is_none_or(|l| l.nout.is_empty());
        let backend_first = self.wake.backend_turn();
        if reading
            && backend_first
            && let Poll::Ready(r) = self.poll_backend(cx)
        {
            return Poll::Ready(Event::Backend(r));
        }
        // Not while a replica runs a read: what follows it waits (`on_client_data`).
        if reading
            && !self.lease.replica_held()
            && let Poll::Ready(r) = self
                .wake
                .client
                .poll_read(cx, client, self.core.client_in())
        {
            return Poll::Ready(Event::Client(r));
        }
        if reading
            && !backend_first
            && let Poll::Ready(r) = self.poll_backend(cx)
        {
            return Poll::Ready(Event::Backend(r));
        }
        if let Poll::Ready(ev) = self.poll_timer(cx) {
            return Poll::Ready(ev);
        }
        if self.lease.parked.is_some()
            && let Some(t) = &self.lease.ticket
            && t.revoked(cx)
        {
            return Poll::Ready(Event::Revoked);
        }
        self.cancel.wake.register(cx.waker());
        if self.cancel.client.order() == crate::clients::Order::Terminate {
            return Poll::Ready(Event::Terminate);
        }
        match self.app.life.phase() {
            Phase::Draining | Phase::Forcing if !self.core.draining() => {
                Poll::Ready(Event::Shutdown)
            }
            Phase::Forcing => Poll::Ready(Event::Force),
            _ => Poll::Pending,
        }
    }

    /// The time of this wake-up: the clock is read at most once between two events (a
    /// statement's arrival, its checkout and its send are one instant; its reply, the
    /// release and the statistics another), and again after anything that waited.
    #[inline(always)]
    pub(super) fn now(&mut self) -> Instant {
        self.wake.now()
    }

    /// Reads from the borrowed backend; pending forever when there is none.
    #[inline(always)]
    fn poll_backend(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
        let Some(b) = &mut self.lease.backend else {
            return Poll::Pending;
        };
        let buf = self.core.backend_in();
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(16 * 1024);
        }
        poll_read_buf(Pin::new(&mut b.conn().stream), cx, buf)
    }

    /// Fires at the earliest of the session's deadlines (each handler clears or moves the
    /// deadline it served).
    #[inline(always)]
    fn poll_timer(&mut self, cx: &mut Context<'_>) -> Poll<Event> {
        let due = std::task::ready!(self.wake.poll_timer(cx, self.core.next_deadline()));
        Poll::Ready(Event::Deadline(self.core.deadline_due(due)))
    }

    // ---------------------------------------------------------------- client → backend

    async fn on_client_data<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        client: &mut S,
    ) -> Result<(), End> {
        loop {
            if self.lease.replica_held() && !self.core.sync_pending() {
                // What the client sent after a read routed to a replica waits for that read
                // to finish: it may write, and the replica's backend must not see it. (A
                // routed extended batch goes on up to its Sync, which has arrived.)
                self.core.defer_behind_replica();
                break;
            }
            let attached = self.lease.attached();
            let next = self.core.next_request(attached);
            match next {
                Ok(requests::Request::Read) => break,
                Ok(requests::Request::Frame { tag, len }) => {
                    // Handled where it arrived: the buffer is held here meanwhile, and given
                    // back without the frame on every path (an error ends the session anyway).
                    let held = self.core.hold_requests();
                    if self.core.mode() == PoolMode::Transaction
                        && may_listen_batch(tag, &held[..len], self.core.listen_statements())
                        && let Some(r) = self.on_listen_batch(&held).await
                    {
                        // A batch that only LISTENs, answered here whole.
                        let took = *r.as_ref().unwrap_or(&len);
                        self.core.give_back_requests(held, took);
                        r?;
                        continue;
                    }
                    let frame = &held[..len];
                    // Dispatched here, not through a frame of its own: one future less
                    // to build and poll per request.
                    let r = if !admitted(tag) {
                        if self.lease.attached() || self.unpark_now() {
                            self.on_attached_frame(tag, frame)
                        } else {
                            self.on_detached_frame(tag, frame, client).await
                        }
                    } else {
                        let body = &frame[framing::HEADER_LEN..];
                        self.core.retry_record(tag, frame);
                        let rest = &held[len..];
                        match tag {
                            b'Q' => self.on_query(frame, body, client).await,
                            b'P' => self.on_parse(frame, body, rest, client).await,
                            b'B' => self.on_bind(frame, body, rest, client).await,
                            _ => self.on_function_call(frame, client).await,
                        }
                    };
                    self.core.give_back_requests(held, len);
                    r?;
                }
                Ok(requests::Request::TooLarge { tag, total }) => {
                    let e = PgError::error(
                        "54000",
                        format!(
                            "pgsluice: message too large: a {} message of {} bytes exceeds \
                             limits.max_message_bytes ({} bytes)",
                            char::from(tag),
                            total,
                            self.core.max_message()
                        ),
                    )
                    .with_hint("send large data with COPY, or raise limits.max_message_bytes");
                    self.refuse_statement(tag, e)?;
                }
                Ok(requests::Request::Terminate) => return Err(End::Terminated),
                Ok(requests::Request::Violation(what)) => {
                    return Err(End::Error(PgError::protocol_violation(what)));
                }
                Err(e) => return Err(End::Error(PgError::protocol_violation(e.to_string()))),
            }
        }
        // The empty cases checked here, not in a future made for nothing; a write the
        // socket takes at once needs none either.
        if !self.core.backend_out_empty() && !self.write_backend_now()? {
            self.flush_backend().await?;
        }
        let mark = self.core.answer_synthetic();
        if let Some(lead) = &mut self.unit.lead {
            // A shared batch's answers the proxy gives itself (a Parse it did not send).
            lead.capture(self.core.client_since(mark));
        }
        if !self.core.to_client().is_empty() {
            self.flush_client(client).await?;
        }
        match self.settle()? {
            None => Ok(()),
            Some(slow) => self.settle_slow(slow).await,
        }
    }

    /// Sync, Execute, Describe or Close with no backend attached (nor parked to take back):
    /// one is borrowed first.
    async fn on_detached_frame<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        tag: u8,
        frame: &[u8],
        client: &mut S,
    ) -> Result<(), End> {
        if let Err(e) = self.ensure_backend(client).await {
            self.core.retry_record(tag, frame);
            return self.core.refuse(tag, e);
        }
        self.on_attached_frame(tag, frame)
    }

    /// Sync, Execute, Describe or Close with a backend attached: no admission, nothing to
    /// wait for, so no async frame (the event loop calls it directly when it can).
    #[inline(always)]
    fn on_attached_frame(&mut self, tag: u8, frame: &[u8]) -> Result<(), End> {
        self.core.retry_record(tag, frame);
        match tag {
            b'S' => {
                self.core
                    .send_ready(Expect::new(Kind::Sync, Mode::Forward), frame);
                self.restore_timeouts();
            }
            b'E' => {
                self.core
                    .send(Expect::new(Kind::Execute, Mode::Forward), frame);
            }
            b'D' | b'C' => {
                self.on_target(tag, frame, &frame[framing::HEADER_LEN..])?;
            }
            _ => {
                return Err(End::Error(PgError::protocol_violation(format!(
                    "invalid frontend message type {}",
                    char::from(tag)
                ))));
            }
        }
        Ok(())
    }

    /// The one pipeline every statement (Query, Parse, Bind, FunctionCall) goes through
    /// before it is written: admitted by the policy (or refused), routed (a Query may go to a
    /// replica), given a backend (its parked one back, else a checkout watching the client),
    /// and its session effects applied (pin, capture, cleanup marks, or refusal).
    ///
    /// This is the part that never waits, run first and in line (no future is made for the
    /// usual statement, admitted at once onto the backend it holds or has parked):
    /// [`Flow::Go`] with the timeouts to write it with, [`Flow::Refused`] when it was refused
    /// and answered in protocol order, or where it has to wait, which
    /// [`Relay::statement_wait`] finishes.
    #[inline(always)]
    fn statement_now(&mut self, step: &Step<'_>, class: &Arc<Classified>) -> Result<Flow, End> {
        let admitted = match step.admit {
            AdmitStep::Done(t) => Ok(t),
            // A batch that starts with a Parse is admitted there, with that statement; a
            // Parse inside a unit is judged at its Bind.
            AdmitStep::IfOpening if self.unit.is_open() || self.lease.attached() => {
                Ok(Timeouts::default())
            }
            AdmitStep::IfOpening | AdmitStep::Now => match self.admit_now(class) {
                Admit::Done(r) => self.opened(step, class, r),
                Admit::Wait(req) => return Ok(Flow::Admit(req)),
            },
        };
        match admitted {
            Ok(t) => self.route_and_attach(step, class, t),
            Err(e) => self.refuse_statement(step.tag, e).map(|()| Flow::Refused),
        }
    }

    /// The pipeline's waits: the policy's queue, a checkout. `Some(timeouts)`: write the
    /// statement with them; `None`: it was refused and answered.
    async fn statement_wait<S: AsyncRead + Unpin>(
        &mut self,
        mut flow: Flow,
        step: &Step<'_>,
        class: &Arc<Classified>,
        client: &mut S,
    ) -> Result<Option<Timeouts>, End> {
        loop {
            flow = match flow {
                Flow::Go(t) => return Ok(Some(t)),
                Flow::Refused => return Ok(None),
                Flow::Admit(req) => {
                    let r = self.admit_wait(class, req, client).await;
                    match self.opened(step, class, r) {
                        Ok(t) => self.route_and_attach(step, class, t)?,
                        Err(e) => return self.refuse_statement(step.tag, e).map(|()| None),
                    }
                }
                Flow::Attach(t) => {
                    if let Err(e) = self.ensure_backend(client).await {
                        return self.core.refuse(step.tag, e).map(|()| None);
                    }
                    self.apply_step_effects(step, class, t)?
                }
                Flow::Follow(follow) => {
                    let (joined, rule, t) = *follow;
                    if self.follow(joined, rule, class, step).await {
                        return Ok(None);
                    }
                    self.attach_step(step, class, t)?
                }
            }
        }
    }

    /// A Parse that opened its batch keeps what it was admitted with, for its Bind.
    #[inline(always)]
    fn opened(
        &mut self,
        step: &Step<'_>,
        class: &Classified,
        admitted: Result<Timeouts, PgError>,
    ) -> Result<Timeouts, PgError> {
        if step.admit == AdmitStep::IfOpening
            && let Ok(t) = admitted
        {
            self.unit.opened_by_parse = Some((class.fingerprint, t));
        }
        admitted
    }

    /// The pipeline after admission: the replica choice, then the backend if one is attached
    /// or parked (else [`Flow::Attach`]), then the effects.
    #[inline(always)]
    fn route_and_attach(
        &mut self,
        step: &Step<'_>,
        class: &Arc<Classified>,
        t: Timeouts,
    ) -> Result<Flow, End> {
        if self.lease.replica_possible
            && let Err(e) = self.choose_replica(class, step.route)
        {
            return self.refuse_statement(step.tag, e).map(|()| Flow::Refused);
        }
        if let Some(rule) = self.unit.rule_coalesce.take() {
            match self.join_shared(rule, class, step) {
                Some(j @ crate::coalesce::Joined::Follow(_)) => {
                    return Ok(Flow::Follow(Box::new((j, rule, t))));
                }
                Some(crate::coalesce::Joined::Lead(l)) => self.unit.lead = Some(l),
                None => {}
            }
        }
        self.attach_step(step, class, t)
    }

    /// A backend attached (its parked one back) and the effects applied, or
    /// [`Flow::Attach`] when one has to be checked out.
    #[inline(always)]
    fn attach_step(
        &mut self,
        step: &Step<'_>,
        class: &Classified,
        t: Timeouts,
    ) -> Result<Flow, End> {
        if !self.lease.attached() && !self.unpark_now() {
            return Ok(Flow::Attach(t));
        }
        self.apply_step_effects(step, class, t)
    }

    /// The pipeline's last step: the statement's session effects, with a backend attached.
    #[inline(always)]
    fn apply_step_effects(
        &mut self,
        step: &Step<'_>,
        class: &Classified,
        t: Timeouts,
    ) -> Result<Flow, End> {
        if let Effects::Apply(text) = step.effects
            && let Err(e) = self.apply_effects(class, text)
        {
            return self.refuse_statement(step.tag, e).map(|()| Flow::Refused);
        }
        Ok(Flow::Go(t))
    }

    async fn on_query<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        frame: &[u8],
        body: &[u8],
        client: &mut S,
    ) -> Result<(), End> {
        let sql = messages::query_body(body).ok_or_else(|| SessionCore::malformed("Query"))?;
        if self.core.mode() == PoolMode::Transaction
            && let Some(cmd) = crate::notify::sql::parse(sql)
            && let Some(answered) = self.on_listen(cmd).await
        {
            return answered;
        }
        let class = self.classify(sql);
        // Only SQL EXECUTE (an Unknown effect) and DEALLOCATE can name a statement, so
        // ordinary queries never pay for reading the name.
        if self.core.mode() == PoolMode::Transaction
            && self.core.has_statements()
            && class.effects.iter().any(|e| {
                matches!(
                    e,
                    crate::classify::SessionEffect::Unknown
                        | crate::classify::SessionEffect::Deallocate
                )
            })
            && let Some((verb, name)) = state::sql_prepared_target(sql)
            && self.core.knows_statement(name.as_slice())
        {
            // On the server it has another name (or none yet): never run something else.
            let e = state::protocol_name_in_sql(verb, &name);
            return self.refuse_statement(b'Q', e);
        }
        let step = Step {
            tag: b'Q',
            admit: AdmitStep::Now,
            route: Routing::Query,
            frame,
            effects: Effects::Apply(Some(sql)),
        };
        let timeouts = match self.statement_now(&step, &class)? {
            Flow::Go(t) => t,
            Flow::Refused => return Ok(()),
            wait => match self.statement_wait(wait, &step, &class, client).await? {
                Some(t) => t,
                None => return Ok(()),
            },
        };
        let prefix = self.inject_timeouts(timeouts, &class, true);
        let mut e = Expect::new(Kind::Query, Mode::Forward);
        match prefix {
            Some(p) => {
                // One injected statement: its RowDescription, DataRow and CommandComplete.
                e.skip_complete = 1;
                e.pos_shift = p.chars().count() as u32;
                self.core.send_ready_with(e, |buf| {
                    messages::raw(buf, b'Q', &[p.as_bytes(), sql, b"\0"])
                });
            }
            None => self.core.send_ready(e, frame),
        }
        self.restore_timeouts();
        self.track_statement(class, self.core.last_ready());
        Ok(())
    }

    /// A FunctionCall ('F'): a function by OID, run like a one-statement Query. Nothing in it
    /// can be read, so it is admitted as the `function_call` pattern, runs with its caller's
    /// budget and leaves the backend to be reset (`DISCARD ALL`) before the next client.
    async fn on_function_call<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        frame: &[u8],
        client: &mut S,
    ) -> Result<(), End> {
        let class = self.app.function_call.clone();
        let step = Step {
            tag: b'F',
            admit: AdmitStep::Now,
            route: Routing::No,
            frame,
            effects: Effects::Apply(None),
        };
        let timeouts = match self.statement_now(&step, &class)? {
            Flow::Go(t) => t,
            Flow::Refused => return Ok(()),
            wait => match self.statement_wait(wait, &step, &class, client).await? {
                Some(t) => t,
                None => return Ok(()),
            },
        };
        self.inject_timeouts(timeouts, &class, true);
        self.core
            .send_ready(Expect::new(Kind::FunctionCall, Mode::Forward), frame);
        self.restore_timeouts();
        self.track_statement(class, self.core.last_ready());
        Ok(())
    }

    async fn on_parse<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        frame: &[u8],
        body: &[u8],
        rest: &[u8],
        client: &mut S,
    ) -> Result<(), End> {
        let p = messages::Parse::read(body).ok_or_else(|| SessionCore::malformed("Parse"))?;
        // The name now means a statement a backend runs.
        self.core.forget_listen_statement(p.name);
        if let Some(e) = self.core.statement_over_limit(p.name, body.len()) {
            return self.refuse_statement(b'P', e);
        }
        let class = self.classify(p.query);
        // Its session effects are applied at its Bind, with the parameters' statement.
        let step = Step {
            tag: b'P',
            admit: AdmitStep::IfOpening,
            route: Routing::Batch {
                opened_by: Some(p.name),
                rest,
            },
            frame,
            effects: Effects::AtBind,
        };
        let go = match self.statement_now(&step, &class)? {
            Flow::Go(_) => true,
            Flow::Refused => false,
            wait => self
                .statement_wait(wait, &step, &class, client)
                .await?
                .is_some(),
        };
        if !go {
            return Ok(());
        }
        if class.own_transaction
            && let Some((fp, t)) = self.unit.opened_by_parse
            && fp == class.fingerprint
        {
            // Its budget must be set before the batch starts (see `inject_timeouts`).
            self.inject_timeouts(t, &class, false);
        }
        let srv = server(&mut self.lease.backend, &self.pool);
        self.core.parse(frame, body, p, class, srv);
        Ok(())
    }

    async fn on_bind<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        frame: &[u8],
        body: &[u8],
        rest: &[u8],
        client: &mut S,
    ) -> Result<(), End> {
        let bind = messages::Bind::read(body).ok_or_else(|| SessionCore::malformed("Bind"))?;
        let stmt = bind.statement;
        if stmt.is_empty() && !self.core.own_unnamed() {
            // Never parsed by this client: whatever unnamed statement the backend holds is
            // another client's.
            return self.refuse_statement(b'B', no_unnamed_statement());
        }
        let (known, hash) = self.core.statement_class(stmt);
        // A name the proxy never saw prepared (an SQL `PREPARE`, a guessed name): Postgres
        // may still know it, so it is admitted and judged like anything unreadable.
        let class = known.unwrap_or_else(|| self.app.unknown_statement.clone());
        let admit = match self.unit.opened_by_parse.take() {
            // Already admitted at the Parse that opened this batch.
            Some((fp, t)) if fp == class.fingerprint => AdmitStep::Done(t),
            _ => AdmitStep::Now,
        };
        // The text is only read for `set_config` names; other statements skip the lookup.
        let text = if class.proof.set_config
            || class
                .effects
                .contains(&crate::classify::SessionEffect::SetConfigSession)
        {
            self.core.statement_text(stmt)
        } else {
            None
        };
        let step = Step {
            tag: b'B',
            admit,
            route: Routing::Batch {
                opened_by: None,
                rest,
            },
            frame,
            effects: Effects::Apply(text.as_deref()),
        };
        let timeouts = match self.statement_now(&step, &class)? {
            Flow::Go(t) => t,
            Flow::Refused => return Ok(()),
            wait => match self.statement_wait(wait, &step, &class, client).await? {
                Some(t) => t,
                None => return Ok(()),
            },
        };
        self.inject_timeouts(timeouts, &class, false);
        self.track_statement(class, self.core.last_ready() + 1);
        if let Some(hash) = hash {
            self.core.retry_start(hash, frame);
        }
        let srv = server(&mut self.lease.backend, &self.pool);
        self.core.bind(frame, bind, srv);
        Ok(())
    }

    fn on_target(&mut self, tag: u8, frame: &[u8], body: &[u8]) -> Result<(), End> {
        let target =
            messages::Target::read(body).ok_or_else(|| SessionCore::malformed("Describe/Close"))?;
        if tag == b'D'
            && matches!(target, messages::Target::Statement(name) if name.is_empty())
            && !self.core.own_unnamed()
        {
            return self.refuse_statement(b'D', no_unnamed_statement());
        }
        let srv = server(&mut self.lease.backend, &self.pool);
        self.core.describe_or_close(tag, frame, target, srv);
        Ok(())
    }

    /// Fingerprint, kind and session effects of a statement text (cached by text).
    fn classify(&mut self, sql: &[u8]) -> Arc<Classified> {
        // A non-UTF-8 text (client encoding) is classified as its lossy copy; the bytes sent
        // stay the client's.
        self.core
            .classify(&self.app.classifier, sql)
            .unwrap_or_else(|| self.app.unclassified.clone())
    }

    /// Applies a statement's session-state effects: pin, capture, cleanup marks, or refusal.
    /// `sql` is the statement's text, where the proxy has it.
    fn apply_effects(&mut self, c: &Classified, sql: Option<&[u8]>) -> Result<(), PgError> {
        self.unit.hold_cursor |= c
            .effects
            .contains(&crate::classify::SessionEffect::DeclareWithHold);
        let cfg = &self.pool.cfg;
        let rules = effects::Rules {
            session_state: cfg.session_state,
            unproven: cfg.unproven,
        };
        let (pool, wake) = (&self.pool, &mut self.wake);
        let Some(v) = self.core.effects(c, sql, rules, |names| {
            pool.catalog.trusts(names, wake.now())
        })?
        else {
            return Ok(());
        };
        if v.catalog_changed {
            self.pool.catalog.invalidate();
        }
        let conn = self.lease.conn();
        if v.unproven {
            conn.unproven_fingerprint = c.fingerprint;
        }
        conn.dirty.merge(v.dirt);
        if v.forget_prepared {
            conn.prepared.clear();
        }
        if v.pinned_now {
            self.pool
                .stats
                .pinned_clients
                .fetch_add(1, Ordering::Relaxed);
            tracing::debug!(pool = %self.pool.name, statement = %c.normalized, "client pinned to its backend");
        }
        Ok(())
    }

    /// Refuses one statement. Inside a transaction block the refusal is raised *by Postgres*
    /// (an injected `DO … RAISE`), so the transaction aborts exactly as for any error there;
    /// otherwise it is answered by the proxy and nothing reaches the database.
    fn refuse_statement(&mut self, tag: u8, e: PgError) -> Result<(), End> {
        if !self.lease.attached() || (self.core.txn() == b'I' && !self.core.in_flight()) {
            return self.core.refuse(tag, e);
        }
        let sql = raise_sql(&e);
        if tag == b'Q' || tag == b'F' {
            self.core
                .send_ready_with(Expect::new(Kind::Query, Mode::Forward), |buf| {
                    messages::query(buf, &sql)
                });
        } else {
            let o = &mut self.core;
            o.send_with(Expect::new(Kind::Parse, Mode::Swallow), |buf| {
                messages::parse_named(buf, b"", sql.as_bytes(), b"\0\0")
            });
            o.send_with(Expect::new(Kind::Bind, Mode::Swallow), |buf| {
                messages::bind_renamed(buf, b"", b"", b"\0\0\0\0\0\0")
            });
            o.send_with(Expect::new(Kind::Execute, Mode::Swallow), |buf| {
                messages::raw(buf, b'E', &[b"\0", &0i32.to_be_bytes()])
            });
        }
        Ok(())
    }

    /// The backend parked with this client back, if its pool still lets it have it: `true`
    /// when one is attached now. Nothing here waits, so the common checkout (the client's
    /// own parked backend) makes no future; [`Relay::ensure_backend`] does the rest.
    #[inline(always)]
    fn unpark_now(&mut self) -> bool {
        if self.lease.attached() {
            return true;
        }
        // A read routed to a replica does not use it, but the pool may still want it.
        if self.lease.unit_pool.is_some() {
            return false;
        }
        let now = self.now();
        let Some(b) = self.lease.parked.as_mut() else {
            return false;
        };
        let ticket = self
            .lease
            .ticket
            .as_ref()
            .expect("a parked backend has its ticket");
        let (pool, conn) = b.parts();
        if !pool.unpark(ticket, conn, now) {
            return false;
        }
        // A checkout that waited for nothing, counted as one.
        self.rt
            .caller_metrics
            .checkout_wait(self.unit.caller, Duration::ZERO);
        self.lease.backend = self.lease.parked.take();
        self.core.lend_buffers();
        true
    }

    /// Borrows a backend if the client has none, watching the client while it waits.
    /// Callers try [`Relay::unpark_now`] first; a parked backend still here is no longer
    /// this client's to use, and goes back.
    async fn ensure_backend<S: AsyncRead + Unpin>(
        &mut self,
        client: &mut S,
    ) -> Result<(), PgError> {
        // Callers skip the call (an async frame built and polled) when one is attached.
        if self.lease.attached() {
            return Ok(());
        }
        if self.lease.parked.is_some() {
            self.give_back_parked().await;
        }
        let pool = self
            .lease
            .unit_pool
            .clone()
            .unwrap_or_else(|| self.pool.clone());
        // Each waiter has its own deadline: the pool's checkout timeout, or the caller's queue
        // timeout when that is shorter.
        let wait = Duration::from_millis(pool.cfg.checkout_timeout_ms)
            .min(self.rt.limits.queue_timeout(self.unit.caller));
        let priority = self.rt.limits.asker(self.unit.caller);
        // Taken at once: no clock reads for a wait that did not happen.
        let asked = self.now();
        let (res, waited) = match pool.try_checkout_now(priority, asked) {
            Some(b) => (Ok(b), Duration::ZERO),
            None => {
                let checkout = std::pin::pin!(pool.checkout_at(priority, asked, asked + wait));
                let why = "client disconnected while waiting";
                let res = self
                    .unless_client_leaves(checkout, client, why)
                    .await
                    .inspect_err(|_| self.lease.unit_pool = None)?;
                // A wait reads the clock afresh (`unless_client_leaves` cleared the tick).
                (res, self.now().saturating_duration_since(asked))
            }
        };
        if res.is_err() {
            // Whatever comes next chooses its pool afresh.
            self.lease.unit_pool = None;
        }
        pool.stats
            .wait_us
            .fetch_add(micros(waited), Ordering::Relaxed);
        self.rt
            .caller_metrics
            .checkout_wait(self.unit.caller, waited);
        let mut b = res.map_err(|e| {
            // A database that cannot be reached is a backend fault: it feeds the breaker.
            if matches!(e, crate::pool::CheckoutError::Connect(_)) {
                self.app.policy.record_backend_result(false);
            }
            let policy = &self.app.policy;
            let hint = match e.arrival_retry() {
                Some(place) => policy.place_hint_ms(&self.rt.limits, self.unit.caller, place),
                None => {
                    policy.retry_hint_ms_in(&self.rt.limits, self.unit.caller, pool.expected_wait())
                }
            };
            e.to_pg(&pool.name, hint)
        })?;
        // One list (logins with equal settings share the pool's, `Pool::greeting`): equal
        // without a look at the strings, which at hundreds of sessions are cold.
        if !Arc::ptr_eq(&b.conn().applied, &self.login.settings) {
            let wait = Duration::from_millis(pool.cfg.checkout_timeout_ms);
            b = self.apply_settings(b, wait).await?;
        }
        set_cancel_target(&self.cancel, Some(&mut b)).await;
        self.lease.backend = Some(b);
        self.core.lend_buffers();
        Ok(())
    }

    /// Makes `b`'s session settings the client's: resets and sets when they differ; the
    /// client's list either way, so the next compare with it is a pointer's. A change of who
    /// the client runs as is applied at once, within `wait`; refused, it discards `b`.
    async fn apply_settings(&mut self, mut b: Pooled, wait: Duration) -> Result<Pooled, PgError> {
        let conn = b.conn();
        if let Some(steps) = params::apply_steps(&conn.applied, &self.login.settings) {
            if steps.identity {
                // Who the client runs as must be certain before its statement goes (one
                // statement: refused, it changes nothing, and the backend is closed).
                if let Err(e) = reset::apply_identity(conn, &steps.statements, wait).await {
                    b.discard();
                    return Err(e);
                }
            } else {
                // Where a set may be refused, resets and sets are two messages, two
                // transactions: the previous client's settings are gone all the same. The
                // client then gets a warning and the backend is closed after it
                // (`injected_failed`).
                for sql in &steps.statements {
                    self.core.send_query(Mode::Swallow, sql);
                }
            }
        }
        conn.applied = Arc::clone(&self.login.settings);
        Ok(b)
    }

    // ---------------------------------------------------------------- backend → client

    /// What the backend sent is handled: [`Relay::on_backend_now`], then whatever of it
    /// has to wait.
    async fn on_backend_data<S: AsyncWrite + Unpin>(&mut self, client: &mut S) -> Result<(), End> {
        match self.on_backend_now(client)? {
            None => Ok(()),
            Some(rest) => self.on_backend_rest(rest, client).await,
        }
    }

    /// The backend's buffered messages handled without waiting: forwarded, acted on, written
    /// to the client if its socket takes them now, and the backend settled (the common case:
    /// a reply that fits the socket, no future made). `Some`: the part that has to wait.
    #[inline(always)]
    fn on_backend_now<S: AsyncWrite + Unpin>(
        &mut self,
        client: &mut S,
    ) -> Result<Option<BackendRest>, End> {
        loop {
            let mark = self.core.client_mark();
            let next = self.core.next_reply();
            if let Some(lead) = &mut self.unit.lead {
                // What a read others wait for sends its client is theirs too.
                lead.capture(self.core.client_since(mark));
            }
            match next {
                Ok(replies::Next::Read) => break,
                Ok(replies::Next::Flush) => {
                    if !self.write_client_now(client)? {
                        return Ok(Some(BackendRest::Flush));
                    }
                }
                Ok(replies::Next::Seen(seen)) => {
                    if self.on_seen(seen) {
                        // The swallowed batch is over: re-prepare and send it again.
                        return Ok(Some(BackendRest::Replay));
                    }
                }
                Err(e) => {
                    tracing::warn!(pool = %self.pool.name, error = %e, "protocol error from the server");
                    return Err(End::Error(PgError::backend_lost()));
                }
            }
        }
        if !self.core.in_flight() {
            // The statements the backstop was armed for are answered. Left armed, it would
            // cancel whatever the client runs next in the same transaction (and, if that one
            // were silent, give up its connection); a later statement arms its own.
            self.core.statements_answered();
        }
        if !self.core.to_client().is_empty() && !self.write_client_now(client)? {
            return Ok(Some(BackendRest::Tail));
        }
        Ok(self.settle()?.map(BackendRest::Settle))
    }

    /// [`Relay::on_backend_now`]'s waiting part, and the rest of the buffered messages after
    /// it.
    async fn on_backend_rest<S: AsyncWrite + Unpin>(
        &mut self,
        mut rest: BackendRest,
        client: &mut S,
    ) -> Result<(), End> {
        loop {
            match rest {
                BackendRest::Flush => self.flush_client(client).await?,
                BackendRest::Replay => {
                    self.core
                        .retry_replay(&mut server(&mut self.lease.backend, &self.pool));
                    self.flush_backend().await?;
                }
                BackendRest::Tail => {
                    self.flush_client(client).await?;
                    return self.maybe_release().await;
                }
                BackendRest::Settle(d) => return self.settle_slow(d).await,
            }
            match self.on_backend_now(client)? {
                None => return Ok(()),
                Some(r) => rest = r,
            }
        }
    }

    /// Writes the client's buffer if its socket takes it without waiting: `true` when all of
    /// it went; `false` leaves what did not go for [`Relay::flush_client`]. A failed write
    /// ends the session as `flush_client`'s does.
    #[inline(always)]
    fn write_client_now<S: AsyncWrite + Unpin>(&mut self, client: &mut S) -> Result<bool, End> {
        match write_now(client, self.core.to_client()) {
            Ok(n) => Ok(self.core.client_written(n)),
            Err(_) => {
                self.core.drop_client_out();
                Err(End::ClientClosed)
            }
        }
    }

    /// [`Relay::write_client_now`] for the backend: not while a backstop's cancel is on its
    /// way (it must reach the server first) nor without a backend ([`Relay::flush_backend`]
    /// handles both).
    #[inline(always)]
    fn write_backend_now(&mut self) -> Result<bool, End> {
        if self.cancels.backstop.is_some() {
            return Ok(false);
        }
        let Some(b) = self.lease.backend.as_mut() else {
            return Ok(false);
        };
        let Ok(bytes) = self.core.to_backend() else {
            return Err(self.outbox_broken());
        };
        match write_now(&mut b.conn().stream, bytes) {
            Ok(n) => Ok(self.core.backend_written(n)),
            Err(_) => {
                self.core.drop_backend_out();
                Err(self.backend_gone())
            }
        }
    }

    /// Acts on what a backend message meant (its bytes for the client are already written).
    /// Not async (it runs for every CommandComplete and ReadyForQuery): `true` when the batch
    /// kept for a replay is due, which the caller sends.
    #[inline(always)]
    fn on_seen(&mut self, seen: replies::Seen) -> bool {
        if let Some(hash) = seen.stale {
            server(&mut self.lease.backend, &self.pool).forget_stale(hash);
        }
        if seen.replay {
            return true;
        }
        if let Some(lead) = &mut self.unit.lead
            && lead.seen(seen.errored, seen.ready)
        {
            self.unit.lead = None;
        }
        self.core.note_fatal(seen.fatal);
        if seen.not_prepared {
            let hashes = self.core.take_not_prepared();
            let conn = self.lease.conn();
            for hash in hashes {
                conn.prepared.remove(hash);
            }
        }
        if seen.injected_failed {
            let msg = self.core.take_injected_failure();
            self.injected_failed(&msg);
        }
        if seen.errored {
            let code = seen.code();
            let asked = code == Some("57014") && self.client_cancelled();
            let fault = code.is_some_and(admission::is_backend_fault) && !asked;
            let failure = crate::observe::stats::Outcome::of_error(code, asked);
            self.core.request_failed(failure, fault);
        }
        if seen.captured {
            let captured: params::Shared = self.core.take_settings().into();
            self.lease.conn().applied = Arc::clone(&captured);
            self.core.settings_read(&captured);
            self.login.settings = captured;
            self.unit.session_caller = None;
        }
        if seen.ready {
            self.statements_done(seen.rows);
        }
        false
    }

    /// A query the proxy injected (settings re-apply or capture) failed: tell the client as
    /// a warning, and never reuse this backend, whose session state is now uncertain.
    fn injected_failed(&mut self, msg: &str) {
        let e = PgError::error(
            "01000",
            format!(
                "pgsluice: could not re-apply session settings on the server connection: {msg}"
            ),
        );
        self.core.answer(|b| e.encode_notice(b));
        self.lease.conn().dirty.unresettable = true;
    }

    async fn flush_client<S: AsyncWrite + Unpin>(&mut self, client: &mut S) -> Result<(), End> {
        if self.core.to_client().is_empty() {
            return Ok(());
        }
        let r = client.write_all(self.core.to_client()).await;
        self.core.drop_client_out();
        r.map_err(|_| End::ClientClosed)
    }

    async fn flush_backend(&mut self) -> Result<(), End> {
        if self.core.backend_out_empty() {
            return Ok(());
        }
        if let Some(h) = self.cancels.backstop.take() {
            // Its cancel must not reach the backend after our next request does.
            let _ = h.await;
        }
        let Some(b) = self.lease.backend.as_mut() else {
            self.core.drop_backend_out();
            return Ok(());
        };
        let Ok(bytes) = self.core.to_backend() else {
            return Err(self.outbox_broken());
        };
        let r = b.conn().stream.write_all(bytes).await;
        self.core.drop_backend_out();
        r.map_err(|_| self.backend_gone())
    }

    /// A request was queued with another message's bytes (a bug, caught before anything
    /// was written): the replies owed no longer match what the backend would answer, so
    /// the backend is closed and the session ends with an internal error.
    #[cold]
    fn outbox_broken(&mut self) -> End {
        tracing::error!(
            pool = %self.pool.name,
            "{}: closing the session and its server connection",
            crate::session::tracker::Broken
        );
        if let Some(b) = self.lease.backend.take() {
            b.discard();
        }
        self.core.drop_backend_out();
        self.end_unit();
        End::Error(PgError::fatal(
            "XX000",
            "pgsluice: internal error: a request was queued with another message's bytes; \
             the session ends and its server connection is closed",
        ))
    }

    /// In transaction mode, returns the backend once it is idle with nothing owed (after
    /// reading back its session settings if the client changed them).
    async fn maybe_release(&mut self) -> Result<(), End> {
        match self.settle()? {
            None => Ok(()),
            Some(slow) => self.settle_slow(slow).await,
        }
    }

    /// What [`Relay::maybe_release`] can do without waiting, which is all of it between two
    /// statements of a transaction and when the backend stays parked with this client (the
    /// common case: no future is made for it). `Some`: the part that may wait is left.
    #[inline(always)]
    fn settle(&mut self) -> Result<Option<release::Decision>, End> {
        match release::decide(self.core.quiet(self.lease.attached())) {
            release::Decision::Busy => Ok(None),
            release::Decision::EndUnit | release::Decision::Keep => {
                self.end_unit();
                self.leave_if_draining().map(|()| None)
            }
            d @ release::Decision::ReadBack => Ok(Some(d)),
            d @ release::Decision::Release => {
                self.end_unit();
                if self.park_backend() {
                    return self.leave_if_draining().map(|()| None);
                }
                Ok(Some(d))
            }
        }
    }

    /// The rest of [`Relay::settle`]'s `ReadBack` (send the read-back) or `Release` (the unit
    /// is over and not parked: the backend goes back to its pool).
    async fn settle_slow(&mut self, d: release::Decision) -> Result<(), End> {
        if d == release::Decision::ReadBack {
            let sql = state::capture_sql(&self.pool.login_user(), self.core.custom_gucs());
            self.core.read_back(&sql);
            return self.flush_backend().await;
        }
        set_cancel_target(&self.cancel, None).await;
        self.core.unnamed_left();
        if let Some(b) = self.lease.backend.take() {
            let now = self.now();
            // `None`: a task reads the WAL position after the client's write, then returns it.
            if let Some(b) = self.release_after_unit(b, now) {
                if b.release_has_work(now) {
                    // A reset, a session check or a catalog read: the client has its answer,
                    // and the backend returns to the pool when the work is done, off this
                    // client's path.
                    tokio::spawn(b.release_at(now));
                } else {
                    b.release_at(now).await;
                }
            }
        }
        self.core.return_buffers();
        self.lease.unit_pool = None;
        self.leave_if_draining()
    }

    /// Keeps the released backend with this client, parked, when its pool allows it
    /// ([`crate::pool::Pool::may_park`]) and it came from the client's own pool (not a
    /// replica's; a client that may read from replicas never parks, so its next read is free to
    /// go there). Its cancel target stays: a cancel meanwhile reaches an idle backend.
    ///
    /// A client's first transaction never parks: a login that runs one transaction and
    /// leaves (a reconnect storm, `pgbench -C`) hands its backend straight back, so the next
    /// login takes that one and the pool's work stays on few backends, as PgBouncer's does.
    /// Parked until its Terminate, each such backend would sit out the next logins, and they
    /// would spread over more Postgres processes.
    fn park_backend(&mut self) -> bool {
        let first_release = !std::mem::replace(&mut self.lease.released_before, true);
        if first_release
            || self.lease.unit_pool.is_some()
            || self.lease.replica_possible
            || self.core.draining()
        {
            return false;
        }
        let now = self.now();
        let Some(b) = self.lease.backend.as_mut() else {
            return false;
        };
        let (pool, conn) = b.parts();
        if !pool.may_park(conn, now) {
            return false;
        }
        let ticket = self.lease.ticket.get_or_insert_with(Default::default);
        pool.park(ticket, conn, now);
        self.lease.parked = self.lease.backend.take();
        true
    }

    /// Returns the parked backend to its pool (revoked, no longer usable, or the client
    /// leaves).
    async fn give_back_parked(&mut self) {
        let Some(b) = self.lease.parked.take() else {
            return;
        };
        self.core.unnamed_left();
        if let Some(t) = &self.lease.ticket {
            b.pool().leave_parking(t);
        }
        set_cancel_target(&self.cancel, None).await;
        b.release_parked(self.now());
        self.core.return_buffers();
    }

    /// During a graceful shutdown a client leaves as soon as it is between transactions.
    fn leave_if_draining(&self) -> Result<(), End> {
        if self.core.draining() {
            Err(End::Error(PgError::shutting_down()))
        } else {
            Ok(())
        }
    }

    /// Sends a CancelRequest for whatever runs on our backend (no-op when nothing does). It
    /// goes through the session's cancel entry, holding its target while it is delivered:
    /// the backend cannot be released to another client before the cancel has arrived, and
    /// if it was released (or lent again) before the cancel could start, none is sent.
    fn cancel_backend_query(&mut self, why: &'static str) -> Option<tokio::task::JoinHandle<()>> {
        if !self.core.in_flight() {
            return None;
        }
        let b = self.lease.backend.as_mut()?;
        let pid = b.conn().pid;
        tracing::warn!(pool = %self.pool.name, pid, why, "cancelling the server query");
        Some(self.cancel.cancel_current(pid))
    }

    /// A client CancelRequest reached this session's backend since the last 57014: that one
    /// was asked for, and says nothing about the server's health (the breaker must not open
    /// because users pressed cancel).
    fn client_cancelled(&mut self) -> bool {
        self.cancels.asked(self.cancel.requested())
    }

    /// The statement outran its timeout and the backstop: cancel it, and give the server
    /// `pool.cancel_grace_ms` to answer anything at all.
    fn on_backstop(&mut self) {
        self.core.statements_answered();
        if let Some(h) =
            self.cancel_backend_query("statement ran past its timeout and the proxy's backstop")
        {
            self.cancels.backstop = Some(h);
            // If the server sends nothing at all by then, it is unreachable and its
            // connection is given up.
            let grace = Duration::from_millis(self.pool.cfg.cancel_grace_ms);
            self.core.cancel_sent((Instant::now() + grace).into_std());
        }
    }

    /// Nothing came back after the statement timeout, the backstop and the cancel: the server
    /// is unreachable (a partition, a hung host). Its connection is closed, never pooled, and
    /// the client is told, instead of both waiting forever on a socket no one will answer.
    fn backend_unresponsive(&mut self) -> End {
        self.core.server_given_up();
        let grace_ms = self.pool.cfg.cancel_grace_ms;
        if let Some(mut b) = self.lease.backend.take() {
            let pid = b.conn().pid;
            tracing::warn!(pool = %self.pool.name, pid, grace_ms, "the server answered nothing after the statement timeout and a cancel; closing its connection");
            b.discard();
        }
        self.app.policy.record_backend_result(false);
        self.end_unit();
        End::Error(PgError::backend_unresponsive(grace_ms))
    }

    /// The backend closed or failed under us.
    fn backend_gone(&mut self) -> End {
        if let Some(b) = self.lease.backend.take() {
            b.discard();
        }
        if self.core.in_flight() {
            self.app.policy.record_backend_result(false);
        }
        self.end_unit();
        if self.core.backend_fatal() {
            // Postgres already told the client why (e.g. 57P01); just close.
            End::BackendLost
        } else {
            End::Error(PgError::backend_lost())
        }
    }

    // ---------------------------------------------------------------- end of session

    /// Gives the backend back (or closes it) after the client left.
    async fn finish(&mut self, end: &End) {
        self.flush_counters();
        if self.core.pinned() {
            self.pool
                .stats
                .pinned_clients
                .fetch_sub(1, Ordering::Relaxed);
        }
        self.give_back_parked().await;
        let Some(mut b) = self.lease.backend.take() else {
            return;
        };
        if matches!(end, End::BackendLost) {
            b.discard();
            return;
        }
        if self.core.left_unknown(self.unit.restore_after.is_some()) {
            b.conn().dirty.all = true;
        }
        let (skip, buffered) = self.core.take_rest();
        let cleanup = reset::Cleanup {
            pending_ready: self.core.ready_owed(),
            in_flight: self.core.in_flight(),
            copy_in: self.core.copy_in(),
            sync_pending: self.core.sync_pending(),
            txn: self.core.txn(),
            skip,
            buffered,
            session_mode: self.core.mode() == PoolMode::Session,
        };
        let cancel = self.cancel.clone();
        let _ = &self.app;
        tokio::spawn(async move {
            set_cancel_target(&cancel, None).await;
            cleanup.run(b).await;
        });
    }
}

/// The end of a client that let its notifications pile up past the mailbox's bound.
fn notify_overflow() -> End {
    tracing::info!("client dropped: it did not read its notifications");
    End::Error(
        PgError::fatal(
            "54000",
            "pgsluice: terminating connection: the client did not read its notifications",
        )
        .with_detail(format!(
            "limit: {} notifications or {} bytes waiting for one client",
            crate::notify::MAX_QUEUED,
            crate::notify::MAX_QUEUED_BYTES
        )),
    )
}

/// Postgres's own answer to a Bind or Describe of an unnamed statement that does not exist:
/// in transaction mode, one this client did not parse on the backend it holds.
fn no_unnamed_statement() -> PgError {
    PgError::error("26000", "unnamed prepared statement does not exist").with_hint(
        "pgsluice (transaction pooling): send Parse of the unnamed statement in the same \
         transaction or Sync block as its Bind, or use a named statement",
    )
}

/// The attached backend's statements. Callers run only after `ensure_backend` succeeded.
fn server<'a>(backend: &'a mut Option<Pooled>, pool: &'a Pool) -> Server<'a> {
    let conn = backend
        .as_mut()
        .expect("backend attached before statement handling")
        .conn();
    Server {
        prepared: &mut conn.prepared,
        stale: &mut conn.stale,
        pool: &pool.name,
    }
}

/// `DO` block raising `e` inside Postgres (used for refusals within a transaction block).
/// Every text in it is dollar-quoted (`params::literal`), and the block's own tag is one that
/// occurs in none of them, so no message, detail or hint can end either quote.
fn raise_sql(e: &PgError) -> String {
    let lit = params::literal;
    let mut body = format!(
        "BEGIN RAISE EXCEPTION USING ERRCODE = {}, MESSAGE = {}",
        lit(e.code),
        lit(&e.message)
    );
    if let Some(d) = &e.detail {
        body.push_str(&format!(", DETAIL = {}", lit(d)));
    }
    if let Some(h) = &e.hint {
        body.push_str(&format!(", HINT = {}", lit(h)));
    }
    body.push_str("; END");
    // The outer tag differs from every inner one: those are `$q…$`, this one `$pgsl…$`.
    let tag = params::dollar_tag(&body, "pgsl");
    format!("DO {tag}{body}{tag}")
}

/// What [`Relay::on_backend_now`] left for a future: the client's buffer to write before the
/// next message (`Flush`) or at the end (`Tail`, then settle), the replay to send, or
/// [`Relay::settle_slow`].
enum BackendRest {
    Flush,
    Replay,
    Tail,
    Settle(release::Decision),
}

/// One `poll_write` of `buf` that never waits (a no-op waker: the awaited write that follows a
/// `Pending` registers the task's own): the bytes written, 0 when the socket is full.
#[inline(always)]
fn write_now<S: AsyncWrite + Unpin>(stream: &mut S, buf: &[u8]) -> std::io::Result<usize> {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    match Pin::new(stream).poll_write(&mut cx, buf) {
        Poll::Ready(r) => r,
        Poll::Pending => Ok(0),
    }
}

/// Whether a batch that starts with this message may be one that only `LISTEN`s (a Parse
/// whose text may start with the verb, or a message naming such a statement the proxy
/// answered): cheap, before the batch is read.
#[inline(always)]
fn may_listen_batch(
    tag: u8,
    frame: &[u8],
    listening: &[(Box<[u8]>, crate::notify::sql::Command)],
) -> bool {
    match tag {
        b'P' => {
            // The text starts after the statement's name: only the name is scanned.
            let body = &frame[framing::HEADER_LEN..];
            memchr::memchr(0, body)
                .is_some_and(|end| crate::notify::sql::may_be_listen(&body[end + 1..]))
        }
        b'B' | b'D' | b'C' => !listening.is_empty(),
        _ => false,
    }
}

/// A statement on its way through the pipeline ([`Relay::statement_now`]).
struct Step<'a> {
    /// The request it came in (`Q`, `P`, `B`, `F`): how a refusal is answered.
    tag: u8,
    admit: AdmitStep,
    /// How it takes part in routing its unit to a replica.
    route: Routing<'a>,
    /// The whole message (what a COALESCE rule shares it by: a Query's text, or the batch a
    /// Parse or Bind opens).
    frame: &'a [u8],
    effects: Effects<'a>,
}

/// Where the pipeline stands.
enum Flow {
    /// Write the statement, with these timeouts.
    Go(Timeouts),
    /// Refused, and answered.
    Refused,
    /// The policy may make it wait.
    Admit(crate::policy::AdmitRequest),
    /// Admitted with these timeouts; a backend has to be checked out.
    Attach(Timeouts),
    /// Admitted with these timeouts; the same read runs for another client: wait for its
    /// result (a COALESCE rule). Boxed: every statement's `Flow` stays a few words.
    Follow(Box<Following>),
}

/// A follower of a shared read, its rule and the timeouts it runs with if it runs its own.
type Following = (
    crate::coalesce::Joined,
    crate::policy::rules::CoalesceRule,
    Timeouts,
);

/// How a statement is admitted.
#[derive(Clone, Copy, PartialEq, Eq)]
enum AdmitStep {
    /// By the policy, now (waiting in its queue if it must).
    Now,
    /// A Parse: only when it opens a batch (no unit, no backend yet).
    IfOpening,
    /// Already, at the Parse that opened its batch: with these timeouts.
    Done(Timeouts),
}

/// What happens to a statement's session effects.
#[derive(Clone, Copy)]
enum Effects<'a> {
    /// Applied now; the text is the statement's where the proxy has it (`set_config` names).
    Apply(Option<&'a [u8]>),
    /// A Parse: at its Bind.
    AtBind,
}
