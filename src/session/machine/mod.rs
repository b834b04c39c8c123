//! The session's state without sockets: [`SessionCore`] owns the I/O-free cores — client
//! framing ([`requests`]), reply framing and meaning ([`replies`]), the outbox of backend
//! writes with the replies they are owed, prepared-statement renaming ([`statements`]), the
//! replay after a result-type change ([`retry`]), the release decision ([`release`]), the
//! deadlines ([`deadlines`]), the statistics tally ([`tally`]) and which reads a replica may
//! serve ([`route`]) — and what the proxy knows of the client's server session (pinned,
//! settings to read back, how its texts are read, what its writes require of a replica).
//!
//! It imports protocol (prepared-statement names and WAL positions included), classify, the
//! statistics' outcome type and the tracker; never the app, a pool, tokio or a socket (times
//! are `std::time::Instant` values the driver hands in). The relay (`super::relay`) drives
//! it: it reads the sockets, waits for admission and checkouts, and hands bytes and outcomes
//! in. `oracle` checks the cores against a simulated Postgres (in the tests and under
//! cargo-fuzz).

use std::time::{Duration, Instant};

use bytes::BytesMut;

use crate::classify::Memo;
use crate::config::PoolMode;
use crate::protocol::PgError;
use crate::protocol::messages;

use super::End;
use super::tracker::{Expect, Outbox};

pub(super) mod deadlines;
pub(super) mod effects;
mod io;
#[cfg(any(test, fuzzing))]
pub mod oracle;
pub(super) mod release;
pub(super) mod replies;
pub(super) mod requests;
pub(super) mod retry;
pub(super) mod route;
pub(super) mod statements;
pub(super) mod tally;

use deadlines::{Deadline, Deadlines, Idle};
use statements::Statements;
use tally::Tally;

/// Prepared `LISTEN`/`UNLISTEN` statements a session keeps at most.
pub(super) const MAX_LISTEN_STATEMENTS: usize = 1_024;

/// Custom settings a session's read-back names at most.
pub(super) const MAX_CUSTOM_GUCS: usize = 64;

/// Limits the core enforces on what a client sends (`limits.*` at login).
pub(super) struct CoreLimits {
    pub max_message: usize,
}

pub(in crate::session) struct SessionCore {
    mode: PoolMode,
    /// Client → backend: framing, size limit, COPY streaming, skip-to-Sync.
    requests: requests::Requests,
    /// Backend → client: framing, streaming and what each reply means.
    replies: replies::Replies,
    /// Pending writes to the client.
    cout: BytesMut,
    /// Bytes for the backend and the replies they are owed, written together.
    out: Outbox,
    /// The client's prepared statements and their proxy names.
    statements: Statements,
    /// A batch kept for one replay after 0A000 "cached plan must not change result type".
    retry: Option<retry::Retry>,
    /// The backstop, unanswered-cancel, shutdown and idle deadlines.
    deadlines: Deadlines,
    /// Statements sent and the replies that complete them, errors, bytes.
    tally: Tally,
    /// The backend sent a FATAL error; it is about to close.
    backend_fatal: bool,
    /// Session state we cannot track keeps this client on its backend until it leaves.
    pinned: bool,
    /// Re-read the backend's session settings once the current transaction ends.
    capture_needed: bool,
    /// The client's settings leave texts read as Postgres reads them
    /// (`params::reading_trusted`); when not, no text of its is proven harmless.
    reading_trusted: bool,
    /// Custom (dotted) settings this client set: Postgres lists no placeholder setting in
    /// `pg_settings`, so the read-back asks for these by name.
    custom_gucs: Vec<String>,
    /// Graceful shutdown: leave at the next point between transactions.
    draining: bool,
    /// Client frames wait in `requests` while a replica runs the read before them.
    deferred: bool,
    /// Read-your-writes: whether the unit wrote, and what a replica must have replayed
    /// before the client's reads go there.
    reads: route::Reads,
    /// `classify.enabled` when the session started.
    classify_on: bool,
    /// The last statement's classification, for the next text of the same shape.
    memo: Memo,
    /// Prepared `LISTEN`/`UNLISTEN` statements the proxy answered itself (extended
    /// protocol, `notify::batch`): their names and what they do.
    listen_statements: Vec<(Box<[u8]>, crate::notify::sql::Command)>,
}

impl SessionCore {
    /// `cbuf`: what the client sent right behind its login, already read.
    pub(super) fn new(
        mode: PoolMode,
        cbuf: BytesMut,
        limits: CoreLimits,
        statements: Statements,
        reading_trusted: bool,
        classify_on: bool,
    ) -> SessionCore {
        let bytes_in = cbuf.len() as u64;
        SessionCore {
            mode,
            requests: requests::Requests::new(cbuf, limits.max_message),
            // Buffers grow on first use: an idle client costs little more than its socket.
            replies: replies::Replies::default(),
            cout: BytesMut::new(),
            out: Outbox::default(),
            statements,
            retry: None,
            deadlines: Deadlines::default(),
            tally: Tally::new(bytes_in),
            backend_fatal: false,
            pinned: false,
            capture_needed: false,
            reading_trusted,
            custom_gucs: Vec::new(),
            draining: false,
            deferred: false,
            reads: route::Reads::default(),
            classify_on,
            memo: Default::default(),
            listen_statements: Vec::new(),
        }
    }

    /// The client sent `n` bytes (now in `requests`): counted, and its idle deadline is off.
    #[inline(always)]
    pub(super) fn client_read(&mut self, n: usize) {
        self.tally.received(n as u64);
        self.deadlines.client_spoke();
    }

    /// The backend sent `n` bytes (now in `replies`): counted, and the server is alive —
    /// whatever a cancel does, it will be answered.
    #[inline(always)]
    pub(super) fn backend_read(&mut self, n: usize) {
        self.tally.sent(n as u64);
        self.deadlines.server_spoke();
    }

    /// Graceful shutdown began: the session leaves at its next point between transactions;
    /// found between them, it waits for a request already on its way until `grace_until`.
    pub(super) fn drain(&mut self, grace_until: std::time::Instant) {
        self.draining = true;
        self.deadlines.drain_at(grace_until);
    }

    pub(super) fn mode(&self) -> PoolMode {
        self.mode
    }

    /// Session state the proxy cannot track keeps this client on its backend until it
    /// leaves: `true` the first time (the pool counts pinned clients).
    pub(super) fn pin(&mut self) -> bool {
        !std::mem::replace(&mut self.pinned, true)
    }

    pub(super) fn pinned(&self) -> bool {
        self.pinned
    }

    /// Graceful shutdown began ([`SessionCore::drain`]).
    pub(super) fn draining(&self) -> bool {
        self.draining
    }

    /// A read was routed to a replica: what the client sent after it waits until the read is
    /// done (it may write, and the replica's backend must not see it).
    pub(super) fn defer_behind_replica(&mut self) {
        self.deferred = self.requests.has_buffered();
    }

    /// Client frames wait in `requests` behind a replica's read.
    pub(super) fn deferred(&self) -> bool {
        self.deferred
    }

    /// The replica's read is done: the frames behind it go on.
    pub(super) fn replica_read_done(&mut self) {
        self.deferred = false;
    }

    /// The backend sent a FATAL error (`fatal`): it is about to close, and Postgres has told
    /// the client why.
    pub(super) fn note_fatal(&mut self, fatal: bool) {
        self.backend_fatal |= fatal;
    }

    pub(super) fn backend_fatal(&self) -> bool {
        self.backend_fatal
    }

    /// The backend's settings were read back: whether they leave texts read as Postgres
    /// reads them (`params::reading_trusted`).
    pub(super) fn settings_read(&mut self, settings: &crate::protocol::params::Shared) {
        self.reading_trusted = crate::protocol::params::reading_trusted(settings);
    }

    /// A statement may have changed the session's settings (`needed`): read them back once
    /// its transaction ends.
    pub(super) fn capture_after(&mut self, needed: bool) {
        self.capture_needed |= needed;
    }

    #[cfg(test)]
    pub(super) fn capture_needed(&self) -> bool {
        self.capture_needed
    }

    /// Sends the read-back of the session's settings, `sql` (built for the custom settings
    /// of [`SessionCore::custom_gucs`]).
    pub(super) fn read_back(&mut self, sql: &str) {
        self.capture_needed = false;
        self.replies.restart_capture();
        self.out.query(super::tracker::Mode::Capture, sql);
    }

    /// Notes custom (dotted) settings a statement may set, for the read-back; `false` when
    /// more than [`MAX_CUSTOM_GUCS`] would be kept (then only a full reset is safe).
    pub(super) fn remember_custom_gucs(&mut self, names: Vec<String>) -> bool {
        for n in names.into_iter().filter(|n| n.contains('.')) {
            if !self.custom_gucs.contains(&n) {
                if self.custom_gucs.len() >= MAX_CUSTOM_GUCS {
                    return false;
                }
                self.custom_gucs.push(n);
            }
        }
        true
    }

    /// The custom settings this client set.
    pub(super) fn custom_gucs(&self) -> &[String] {
        &self.custom_gucs
    }

    /// A statement text's fingerprint, kind and session effects through `classifier` and
    /// the session's memo of its last shape; `None` when classification was off at login.
    #[inline(always)]
    pub(super) fn classify(
        &mut self,
        classifier: &crate::classify::Classifier,
        sql: &[u8],
    ) -> Option<std::sync::Arc<crate::classify::Classified>> {
        self.classify_on
            .then(|| classifier.classify_memo(sql, &mut self.memo))
    }

    /// Whether the rest of an extended batch holds only routable reads
    /// ([`route::batch_reads`]): each Parse's text classified as it will be when it is
    /// handled, each Bind's statement as the client prepared it.
    pub(super) fn batch_reads(
        &mut self,
        classifier: &crate::classify::Classifier,
        opened_by: Option<&[u8]>,
        rest: &[u8],
    ) -> bool {
        let (memo, statements, on) = (&mut self.memo, &self.statements, self.classify_on);
        route::batch_reads(opened_by, rest, |item| match item {
            route::Item::Parse(text) => {
                on && route::routable(&classifier.classify_memo(text, memo))
            }
            route::Item::Bind(name) => statements
                .class_and_hash(name)
                .0
                .is_some_and(|c| route::routable(&c)),
        })
    }

    /// A statement that `may_write` is on its way in a unit on the primary: in transaction
    /// mode the unit's end decides what the client's next reads require of a replica.
    #[inline(always)]
    pub(super) fn note_write(&mut self, may_write: bool) {
        if may_write && self.mode == PoolMode::Transaction {
            self.reads.wrote = true;
        }
    }

    /// The unit is over: whether it may have written (and it is forgotten).
    pub(super) fn take_wrote(&mut self) -> bool {
        std::mem::take(&mut self.reads.wrote)
    }

    /// Whether a replica that has replayed up to `replayed` may serve the client's next read
    /// at `now`, given what the client wrote ([`route::Fresh::allows`]).
    pub(super) fn replica_fresh_enough(
        &mut self,
        replayed: Option<crate::protocol::lsn::Lsn>,
        now: std::time::Instant,
    ) -> bool {
        self.reads.fresh.allows(replayed, now)
    }

    pub(super) fn require_fresh(&mut self, fresh: route::Fresh) {
        self.reads.fresh = fresh;
    }

    /// The next step over the backend's bytes in `replies`: replies forwarded to the client
    /// buffer, the tracker and a batch kept for replay advanced ([`replies::Replies::next`]).
    #[inline(always)]
    pub(super) fn next_reply(
        &mut self,
    ) -> Result<replies::Next, crate::protocol::framing::FrameError> {
        self.replies
            .next(&mut self.out.t, &mut self.retry, &mut self.cout)
    }

    /// The command of a prepared `LISTEN`/`UNLISTEN` statement the proxy answered itself.
    pub(super) fn listen_statement(&self, name: &[u8]) -> Option<crate::notify::sql::Command> {
        self.listen_statements
            .iter()
            .find(|(n, _)| **n == *name)
            .map(|(_, c)| c.clone())
    }

    pub(super) fn listen_statements(&self) -> &[(Box<[u8]>, crate::notify::sql::Command)] {
        &self.listen_statements
    }

    /// The proxy answered a Parse of `name` as `cmd` (the oldest is forgotten beyond
    /// [`MAX_LISTEN_STATEMENTS`]); the name no longer means a backend's statement.
    pub(super) fn keep_listen_statement(&mut self, name: &[u8], cmd: crate::notify::sql::Command) {
        self.statements.forget_statement(name);
        self.forget_listen_statement(name);
        if self.listen_statements.len() >= MAX_LISTEN_STATEMENTS {
            self.listen_statements.remove(0);
        }
        self.listen_statements.push((name.into(), cmd));
    }

    /// `name` was closed, or now means a statement a backend runs.
    pub(super) fn forget_listen_statement(&mut self, name: &[u8]) {
        if !self.listen_statements.is_empty() {
            self.listen_statements.retain(|(n, _)| **n != *name);
        }
    }

    // ---------------------------------------------------------------- deadlines

    /// The earliest deadline armed, if any.
    #[inline(always)]
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.next()
    }

    /// Which deadline the timer that fired at `at` was for.
    pub(super) fn deadline_due(&self, at: Instant) -> Deadline {
        self.deadlines.due(at)
    }

    /// The drain's grace for a client between transactions is spent.
    pub(super) fn idle_grace_over(&mut self) {
        self.deadlines.clear(Deadline::IdleGrace);
    }

    /// Arms the idle limit for where the client stands ([`Deadlines::arm_idle`]).
    #[inline(always)]
    pub(super) fn arm_idle(
        &mut self,
        idle: Idle,
        now: impl FnOnce() -> Instant,
        client_limit: impl FnOnce() -> Option<Duration>,
        txn_limit: impl FnOnce() -> Option<Duration>,
    ) {
        self.deadlines.arm_idle(idle, now, client_limit, txn_limit);
    }

    /// The proxy's own deadline for a statement with a timeout (the backstop), at `at`.
    pub(super) fn arm_backstop(&mut self, at: Instant) {
        self.deadlines.arm_backstop(at);
    }

    /// The statements the backstop was armed for are answered.
    #[inline(always)]
    pub(super) fn statements_answered(&mut self) {
        self.deadlines.answered();
    }

    /// The backstop fired and sent a cancel: the server has until `at` to answer anything.
    pub(super) fn cancel_sent(&mut self, at: Instant) {
        self.deadlines.cancel_sent(at);
    }

    /// The server was given up for its silence: nothing more is awaited from it.
    pub(super) fn server_given_up(&mut self) {
        self.deadlines.server_spoke();
    }

    /// The unit is over: nothing of its statements is owed any more.
    pub(super) fn unit_over(&mut self) {
        self.deadlines.unit_over();
    }

    // ---------------------------------------------------------------- statistics

    /// A statement arrived at `at` (its wait for admission counts from here).
    #[inline(always)]
    pub(super) fn statement_arrived(&mut self, at: Instant) {
        self.tally.arrived(at);
    }

    /// The client sent `n` bytes while its request waited (counted, not a new request).
    pub(super) fn read_while_waiting(&mut self, n: usize) {
        self.tally.received(n as u64);
    }

    /// The bytes relayed each way since the last call.
    pub(super) fn take_bytes(&mut self) -> (u64, u64) {
        self.tally.take_bytes()
    }

    /// The ReadyForQuery the last request sent will be answered with.
    #[inline(always)]
    pub(super) fn last_ready(&self) -> u64 {
        self.tally.last_ready()
    }

    /// A statement of `caller` sent at `start`, completed by ReadyForQuery number `ready_seq`.
    #[inline(always)]
    pub(super) fn track(
        &mut self,
        class: std::sync::Arc<crate::classify::Classified>,
        caller: u16,
        start: Instant,
        ready_seq: u64,
    ) {
        self.tally.track(class, caller, start, ready_seq);
    }

    /// The current request got an error, counted as `failure`; `fault`: the backend's.
    pub(super) fn request_failed(&mut self, failure: crate::observe::stats::Outcome, fault: bool) {
        self.tally.errored(failure, fault);
    }

    /// A ReadyForQuery reached the client at `now`: each statement it completes goes to
    /// `each` ([`Tally::ready`]), and the sum comes back.
    #[inline(always)]
    pub(super) fn ready(
        &mut self,
        now: Instant,
        rows: u64,
        each: impl FnMut(tally::Finished<'_>),
    ) -> tally::Ready {
        let idle = self.out.t.txn == b'I';
        self.tally.ready(now, rows, idle, each)
    }

    /// Where the client stands when the session next waits: owing the next move inside a
    /// transaction, between transactions, or not at all (something in flight or unsent).
    #[inline(always)]
    pub(super) fn idle(&self, attached: bool) -> Idle {
        let waiting_for_client = !self.out.t.in_flight() && self.out.is_empty();
        let in_txn = attached && self.out.t.txn != b'I';
        match (waiting_for_client, in_txn) {
            (false, _) => Idle::No,
            (true, true) => Idle::InTransaction,
            (true, false) => Idle::Between,
        }
    }

    /// Between units: the last reply said idle, nothing is in flight and nothing unsent —
    /// the next request starts a new unit (a transaction, or a statement outside one).
    #[inline(always)]
    pub(super) fn between_units(&self) -> bool {
        self.out.t.txn == b'I' && !self.out.t.in_flight() && self.out.is_empty()
    }

    /// The session's backend goes back to the pool between transactions: transaction mode,
    /// and nothing the proxy cannot track pins it.
    #[inline(always)]
    pub(super) fn pooled(&self) -> bool {
        self.mode == PoolMode::Transaction && !self.pinned
    }

    /// What the release decision reads ([`release::decide`]): `attached` a backend,
    /// `pooled` it goes back between transactions (transaction mode, not pinned).
    #[inline(always)]
    pub(super) fn quiet(&self, attached: bool) -> release::Quiet {
        release::Quiet {
            idle: self.out.t.idle(),
            replies_done: self.replies.quiet(),
            nothing_unsent: self.out.is_empty(),
            skipping: self.requests.skipping(),
            attached,
            pooled: self.pooled(),
            capture_needed: self.capture_needed,
        }
    }

    /// A ReadyForQuery-bearing request (Query, Sync, FunctionCall) the client sees answered.
    #[inline(always)]
    pub(super) fn send_ready(&mut self, e: Expect, frame: &[u8]) {
        self.send_ready_with(e, |buf| buf.extend_from_slice(frame));
    }

    /// [`SessionCore::send_ready`] for a request written in place.
    #[inline(always)]
    pub(super) fn send_ready_with(&mut self, e: Expect, write: impl FnOnce(&mut BytesMut)) {
        self.tally.ready_requested();
        self.out.send_with(e, write);
    }

    /// Answers a request the proxy could not serve with an ErrorResponse, keeping protocol
    /// order: a Query, FunctionCall or Sync gets its ReadyForQuery; anything else skips the
    /// client's messages up to its Sync. A FATAL error ends the session.
    pub(super) fn refuse(&mut self, tag: u8, e: PgError) -> Result<(), End> {
        if e.severity == crate::protocol::error::Severity::Fatal {
            return Err(End::Error(e));
        }
        e.encode(&mut self.cout);
        match tag {
            b'Q' | b'F' | b'S' => messages::ready_for_query(&mut self.cout, self.out.t.txn),
            _ => self.requests.skip_until_sync(),
        }
        Ok(())
    }

    /// Whether a Bind or Describe of the unnamed statement may go to the backend: in session
    /// mode always (the client owns it); in transaction mode only when this client parsed
    /// one (it is parsed again where the backend holds another's: `ensure_unnamed`).
    pub(super) fn own_unnamed(&self) -> bool {
        self.mode != PoolMode::Transaction || self.statements.has_unnamed()
    }

    /// A client message that cannot be read.
    pub(super) fn malformed(what: &str) -> End {
        End::Error(PgError::protocol_violation(format!(
            "malformed {what} message"
        )))
    }
}
