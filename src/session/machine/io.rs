//! The driver's handles on the core's bytes: the buffers its sockets read into and write
//! from, the proxy's own answers to the client and requests to the backend, and where the
//! replies owed stand. The driver never reaches the cores behind them (`requests`,
//! `replies`, the client buffer, the outbox, `statements`); it calls these.

use bytes::BytesMut;

use super::SessionCore;
use super::requests::Request;
use super::statements::Server;
use crate::protocol::PgError;
use crate::protocol::framing::FrameError;
use crate::protocol::messages::{self, Bind, Parse, Target};
use crate::session::spare;
use crate::session::tracker::{Broken, Expect, Mode};

impl SessionCore {
    // ------------------------------------------------------------ client → core

    /// Where the client socket's bytes are read into.
    #[inline(always)]
    pub(in crate::session) fn client_in(&mut self) -> &mut BytesMut {
        self.requests.buf_mut()
    }

    /// The next client request framed ([`super::requests::Requests::next`]): COPY data and
    /// Flush pass to the outbox on the way, answers the proxy gives itself to the client.
    #[inline(always)]
    pub(in crate::session) fn next_request(
        &mut self,
        attached: bool,
    ) -> Result<Request, FrameError> {
        let txn = self.out.t.txn;
        self.requests
            .next(attached, txn, &mut self.out, &mut self.cout)
    }

    /// The client's buffered bytes, lent while the request at their front is handled.
    #[inline(always)]
    pub(in crate::session) fn hold_requests(&mut self) -> BytesMut {
        self.requests.hold()
    }

    /// The lent bytes back, without the `used` bytes of the request handled.
    #[inline(always)]
    pub(in crate::session) fn give_back_requests(&mut self, held: BytesMut, used: usize) {
        self.requests.give_back(held, used);
    }

    /// `limits.max_message_bytes`.
    pub(in crate::session) fn max_message(&self) -> usize {
        self.requests.max_message()
    }

    /// The client's messages up to its next Sync are skipped (an error in an extended batch).
    pub(in crate::session) fn skip_until_sync(&mut self) {
        self.requests.skip_until_sync();
    }

    pub(in crate::session) fn skipping(&self) -> bool {
        self.requests.skipping()
    }

    // ------------------------------------------------------------ backend → core

    /// Where the backend socket's bytes are read into.
    #[inline(always)]
    pub(in crate::session) fn backend_in(&mut self) -> &mut BytesMut {
        self.replies.buf_mut()
    }

    /// The statements the backend said it does not have (26000), by hash.
    pub(in crate::session) fn take_not_prepared(&mut self) -> Vec<u64> {
        self.replies.take_not_prepared()
    }

    /// The message of the error an injected statement got.
    pub(in crate::session) fn take_injected_failure(&mut self) -> String {
        self.replies.take_injected_failure()
    }

    /// The settings the read-back returned.
    pub(in crate::session) fn take_settings(&mut self) -> Vec<(String, String)> {
        self.replies.take_settings()
    }

    /// What is left of the backend's bytes when the client leaves: the bytes of the message
    /// cut short still to skip, and what is buffered.
    pub(in crate::session) fn take_rest(&mut self) -> (usize, BytesMut) {
        self.replies.take_rest()
    }

    // ------------------------------------------------------------ core → client

    /// How much is waiting for the client: a mark for [`SessionCore::client_since`].
    #[inline(always)]
    pub(in crate::session) fn client_mark(&self) -> usize {
        self.cout.len()
    }

    /// What was added for the client since `mark`.
    #[inline(always)]
    pub(in crate::session) fn client_since(&self, mark: usize) -> &[u8] {
        &self.cout[mark..]
    }

    /// The bytes waiting for the client socket.
    #[inline(always)]
    pub(in crate::session) fn to_client(&self) -> &[u8] {
        &self.cout
    }

    /// The client socket took `n` of them: whether all are written.
    #[inline(always)]
    pub(in crate::session) fn client_written(&mut self, n: usize) -> bool {
        spare::consume(&mut self.cout, n)
    }

    /// The client is gone: what was waiting for it is dropped.
    pub(in crate::session) fn drop_client_out(&mut self) {
        self.cout.clear();
    }

    /// The proxy answers the client itself: `write` adds whole messages.
    #[inline(always)]
    pub(in crate::session) fn answer(&mut self, write: impl FnOnce(&mut BytesMut)) {
        write(&mut self.cout);
    }

    /// A ReadyForQuery with the transaction status the client last saw.
    pub(in crate::session) fn answer_ready(&mut self) {
        messages::ready_for_query(&mut self.cout, self.out.t.txn);
    }

    /// The replies the proxy owes for requests it answered itself, once nothing before them
    /// is owed; returns the mark they start at ([`SessionCore::client_since`]).
    #[inline(always)]
    pub(in crate::session) fn answer_synthetic(&mut self) -> usize {
        let mark = self.cout.len();
        self.out.t.answer_synthetic(&mut self.cout);
        mark
    }

    // ------------------------------------------------------------ core → backend

    /// The bytes waiting for the backend; `Err` when a request was queued with another
    /// message's bytes (nothing may be written then).
    #[inline(always)]
    pub(in crate::session) fn to_backend(&self) -> Result<&[u8], Broken> {
        self.out.to_write()
    }

    /// The backend socket took `n` of them: whether all are written.
    #[inline(always)]
    pub(in crate::session) fn backend_written(&mut self, n: usize) -> bool {
        self.out.written(n)
    }

    /// The backend is gone: what was waiting for it is dropped.
    pub(in crate::session) fn drop_backend_out(&mut self) {
        self.out.clear();
    }

    /// Nothing waits to be written to the backend.
    #[inline(always)]
    pub(in crate::session) fn backend_out_empty(&self) -> bool {
        self.out.is_empty()
    }

    /// A query the proxy sends itself, its reply handled as `mode` says.
    pub(in crate::session) fn send_query(&mut self, mode: Mode, sql: &str) {
        self.out.query(mode, sql);
    }

    /// A client request passed on as it came (`frame`), with the reply it is owed.
    #[inline(always)]
    pub(in crate::session) fn send(&mut self, e: Expect, frame: &[u8]) {
        self.out.send(e, frame);
    }

    /// A request the proxy writes itself, with the reply it is owed.
    pub(in crate::session) fn send_with(&mut self, e: Expect, write: impl FnOnce(&mut BytesMut)) {
        self.out.send_with(e, write);
    }

    /// A backend is attached: the reply, client-bound and backend-bound buffers come from
    /// the thread's spares when the session has none.
    pub(in crate::session) fn lend_buffers(&mut self) {
        spare::lend(self.replies.buf_mut());
        spare::lend(&mut self.cout);
        self.out.lend_buffer();
    }

    /// The backend went back to its pool: the empty buffers go back to the spares, for the
    /// next session that attaches one (kept while a backend is parked with the client).
    pub(in crate::session) fn return_buffers(&mut self) {
        spare::give_back(self.replies.buf_mut());
        spare::give_back(&mut self.cout);
        self.out.return_buffer();
    }

    // ------------------------------------------------------------ the replies owed

    /// The transaction status of the last ReadyForQuery (`I`, `T` or `E`).
    #[inline(always)]
    pub(in crate::session) fn txn(&self) -> u8 {
        self.out.t.txn
    }

    /// Requests of an extended batch were sent and its Sync is still to come.
    #[inline(always)]
    pub(in crate::session) fn sync_pending(&self) -> bool {
        self.out.t.sync_pending
    }

    /// Replies are owed by the backend.
    #[inline(always)]
    pub(in crate::session) fn in_flight(&self) -> bool {
        self.out.t.in_flight()
    }

    /// Nothing is owed, no COPY and no Sync to come.
    pub(in crate::session) fn replies_idle(&self) -> bool {
        self.out.t.idle()
    }

    /// The client is streaming COPY data to the backend.
    pub(in crate::session) fn copy_in(&self) -> bool {
        self.out.t.copy_in
    }

    /// ReadyForQuery messages still owed, a pending Sync counted as one.
    pub(in crate::session) fn ready_owed(&self) -> usize {
        self.out.t.pending_ready() + usize::from(self.out.t.sync_pending)
    }

    // ------------------------------------------------------------ prepared statements

    /// The client has prepared statements the proxy renamed.
    pub(in crate::session) fn has_statements(&self) -> bool {
        !self.statements.is_empty()
    }

    /// The client prepared a statement named `name`.
    pub(in crate::session) fn knows_statement(&self, name: &[u8]) -> bool {
        self.statements.knows(name)
    }

    /// The error a Parse of `name` with a body of `len` bytes gets from the per-client
    /// statement limits, if it is over one of them.
    pub(in crate::session) fn statement_over_limit(
        &self,
        name: &[u8],
        len: usize,
    ) -> Option<PgError> {
        self.statements.over_limit(name, len)
    }

    /// The classification and the hash of the client's statement `name`, if it is known.
    pub(in crate::session) fn statement_class(
        &self,
        name: &[u8],
    ) -> (
        Option<std::sync::Arc<crate::classify::Classified>>,
        Option<u64>,
    ) {
        self.statements.class_and_hash(name)
    }

    pub(in crate::session) fn statement_text(&self, name: &[u8]) -> Option<bytes::Bytes> {
        self.statements.text_of(name)
    }

    pub(in crate::session) fn statement_text_and_types(
        &self,
        name: &[u8],
    ) -> Option<(bytes::Bytes, bytes::Bytes)> {
        self.statements.text_and_types(name)
    }

    /// The client's Parse (`frame`), remembered and sent under its server name to `srv`.
    pub(in crate::session) fn parse(
        &mut self,
        frame: &[u8],
        body: &[u8],
        p: Parse<'_>,
        class: std::sync::Arc<crate::classify::Classified>,
        srv: Server<'_>,
    ) {
        self.statements
            .parse(frame, body, p, class, srv, &mut self.out);
    }

    /// A Parse of a batch another session's run answered (a shared read): kept as the
    /// client's statement, as if a backend had parsed it; its hash back.
    pub(in crate::session) fn remember_statement(
        &mut self,
        body: &[u8],
        p: Parse<'_>,
        class: std::sync::Arc<crate::classify::Classified>,
    ) -> u64 {
        self.statements.remember(body, p, class)
    }

    /// The client's Bind of `b.statement` (`frame`), sent renamed to `srv` — after a Parse
    /// of the client's unnamed statement where the backend may hold another's.
    pub(in crate::session) fn bind(&mut self, frame: &[u8], b: Bind<'_>, srv: Server<'_>) {
        self.statements.ensure_unnamed(b.statement, &mut self.out);
        self.statements.bind(frame, b, srv, &mut self.out);
    }

    /// The client's Describe or Close (`tag`) of `target`, renamed for `srv`.
    pub(in crate::session) fn describe_or_close(
        &mut self,
        tag: u8,
        frame: &[u8],
        target: Target<'_>,
        srv: Server<'_>,
    ) {
        if tag == b'D'
            && let Target::Statement(name) = target
        {
            self.statements.ensure_unnamed(name, &mut self.out);
        }
        self.statements
            .describe_or_close(tag, frame, target, srv, &mut self.out);
    }

    /// A statement of the proxy's own prepared on `srv` unless it holds it already.
    pub(in crate::session) fn ensure_prepared(
        &mut self,
        mut srv: Server<'_>,
        hash: u64,
        query: &[u8],
        types: &[u8],
        mode: Mode,
    ) {
        srv.ensure(&mut self.out, hash, query, types, mode);
    }

    /// The backend went back to its pool: the client's unnamed statement is not on the next.
    pub(in crate::session) fn unnamed_left(&mut self) {
        self.statements.unnamed_left();
    }
}
