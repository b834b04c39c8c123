//! What the session counts, pure: the statements sent and the client ReadyForQuery each
//! waits for, how the current request went (an error, how it is counted, a backend fault),
//! when the transaction started, and the bytes relayed since they were last counted. At each
//! ReadyForQuery it says which statements it completed, how long each took and whether a
//! transaction ended; the driver records that in the metrics, the statistics and the breaker.

use std::sync::Arc;
use std::time::Duration;

use std::time::Instant;

use crate::classify::Classified;
use crate::observe::stats::Outcome;

/// Most statements remembered while they wait for their ReadyForQuery (a pipelining client
/// beyond it still runs; its later statements go uncounted).
const MAX_PENDING: usize = 4096;

/// A statement waiting for its completion.
struct StmtRecord {
    class: Arc<Classified>,
    caller: u16,
    /// Arrived from the client (before admission and checkout).
    arrived: Instant,
    /// Sent to the backend.
    start: Instant,
    /// Completed by the client ReadyForQuery with this sequence number.
    ready_seq: u64,
}

/// One statement a ReadyForQuery completed.
pub(in crate::session) struct Finished<'a> {
    pub class: &'a Arc<Classified>,
    pub caller: u16,
    /// From its arrival at the proxy to its completion.
    pub total: Duration,
    /// From its send to the backend to its completion.
    pub elapsed: Duration,
    /// Its request got no error.
    pub succeeded: bool,
    /// Its request hit no backend fault (what the breaker hears).
    pub backend_ok: bool,
    pub outcome: Outcome,
}

/// What a ReadyForQuery completed, in sum.
#[derive(Debug, Default, PartialEq, Eq)]
pub(in crate::session) struct Ready {
    pub statements: u64,
    /// Their time on the backend, in microseconds.
    pub backend_us: u64,
    /// The transaction it ended, and how long it took (from its first statement's send).
    pub transaction: Option<Duration>,
}

pub(in crate::session) struct Tally {
    pending: Vec<StmtRecord>,
    /// Client ReadyForQuery-bearing requests sent / replies seen.
    ready_sent: u64,
    ready_seen: u64,
    /// The current request got an ErrorResponse (its rows come with its ReadyForQuery).
    errored: bool,
    /// How the current request's error is counted in the per-fingerprint statistics.
    failure: Outcome,
    /// The current request hit a backend fault (connection error, timeout).
    fault: bool,
    /// When the current transaction's first statement was sent.
    txn_start: Option<Instant>,
    /// When the statement being admitted arrived (its client-observed time starts there).
    arrived: Option<Instant>,
    /// Bytes read from the client and from the server since [`Tally::take_bytes`].
    bytes_in: u64,
    bytes_out: u64,
}

impl Tally {
    /// `bytes_in`: what the client sent right behind its login, already read.
    pub(in crate::session) fn new(bytes_in: u64) -> Tally {
        Tally {
            pending: Vec::new(),
            ready_sent: 0,
            ready_seen: 0,
            errored: false,
            failure: Outcome::Error,
            fault: false,
            txn_start: None,
            arrived: None,
            bytes_in,
            bytes_out: 0,
        }
    }

    #[inline(always)]
    pub(in crate::session) fn received(&mut self, n: u64) {
        self.bytes_in += n;
    }

    #[inline(always)]
    pub(in crate::session) fn sent(&mut self, n: u64) {
        self.bytes_out += n;
    }

    /// The bytes in and out since the last call.
    #[inline(always)]
    pub(in crate::session) fn take_bytes(&mut self) -> (u64, u64) {
        (
            std::mem::take(&mut self.bytes_in),
            std::mem::take(&mut self.bytes_out),
        )
    }

    /// The statement being admitted arrived now.
    #[inline(always)]
    pub(in crate::session) fn arrived(&mut self, at: Instant) {
        self.arrived = Some(at);
    }

    /// A ReadyForQuery-bearing request (Query, Sync, FunctionCall) goes to the backend.
    #[inline(always)]
    pub(in crate::session) fn ready_requested(&mut self) {
        self.ready_sent += 1;
    }

    /// The sequence number of the ReadyForQuery the last request sent will bring (a
    /// Query's own); `+ 1` for a statement whose Sync is still to come.
    #[inline(always)]
    pub(in crate::session) fn last_ready(&self) -> u64 {
        self.ready_sent
    }

    /// A statement sent at `start`, completed by ReadyForQuery number `ready_seq`.
    #[inline(always)]
    pub(in crate::session) fn track(
        &mut self,
        class: Arc<Classified>,
        caller: u16,
        start: Instant,
        ready_seq: u64,
    ) {
        if self.pending.len() < MAX_PENDING {
            self.pending.push(StmtRecord {
                caller,
                class,
                arrived: self.arrived.take().unwrap_or(start),
                start,
                ready_seq,
            });
        }
    }

    /// The current request got an error, counted as `failure`; `fault`: the backend's.
    pub(in crate::session) fn errored(&mut self, failure: Outcome, fault: bool) {
        self.errored = true;
        self.fault |= fault;
        self.failure = failure;
    }

    /// A client ReadyForQuery arrived at `now`, leaving the session `idle` (outside a
    /// transaction block) or not: each statement it completes goes to `each` — the last of
    /// them with the `rows` its CommandCompletes counted — and the sum comes back.
    #[inline(always)]
    pub(in crate::session) fn ready(
        &mut self,
        now: Instant,
        rows: u64,
        idle: bool,
        mut each: impl FnMut(Finished<'_>),
    ) -> Ready {
        self.ready_seen += 1;
        let seen = self.ready_seen;
        let done = self
            .pending
            .iter()
            .take_while(|r| r.ready_seq <= seen)
            .count();
        let mut ready = Ready::default();
        if done == 0 {
            ready.transaction = self.transaction_done(None, now, idle);
            self.request_over();
            return ready;
        }
        // One subtraction per distinct instant: a statement sent as it arrived, alone in its
        // transaction (the common case), has one duration for all three figures.
        let first = self.pending[0].start;
        let first_elapsed = now.saturating_duration_since(first);
        ready.transaction = self.transaction_done(Some((first, first_elapsed)), now, idle);
        let (errored, failure, fault) = (self.errored, self.failure, self.fault);
        for (i, r) in self.pending.drain(..done).enumerate() {
            let elapsed = if r.start == first {
                first_elapsed
            } else {
                now.saturating_duration_since(r.start)
            };
            ready.backend_us = ready.backend_us.saturating_add(micros(elapsed));
            let total = if r.arrived == r.start {
                elapsed
            } else {
                now.saturating_duration_since(r.arrived)
            };
            let outcome = if errored {
                failure
            } else {
                Outcome::Ok {
                    rows: if i + 1 == done { rows } else { 0 },
                }
            };
            each(Finished {
                class: &r.class,
                caller: r.caller,
                total,
                elapsed,
                succeeded: !errored,
                backend_ok: !fault,
                outcome,
            });
        }
        ready.statements = done as u64;
        self.request_over();
        ready
    }

    fn request_over(&mut self) {
        self.errored = false;
        self.failure = Outcome::Error;
        self.fault = false;
    }

    /// At a ReadyForQuery whose statements were sent from `first_sent` on (`None`: it
    /// completes none): the transaction it ends, if it says idle. A transaction starts with
    /// the first statement a ReadyForQuery completes, not the first one sent: a pipelining
    /// client's later statements, sent before this reply, belong to the next. `first_sent`
    /// comes with the time since it, to spare the subtraction when the transaction started
    /// there.
    #[inline(always)]
    fn transaction_done(
        &mut self,
        first_sent: Option<(Instant, Duration)>,
        now: Instant,
        idle: bool,
    ) -> Option<Duration> {
        if self.txn_start.is_none() {
            self.txn_start = first_sent.map(|(at, _)| at);
        }
        if !idle {
            return None;
        }
        let started = self.txn_start.take()?;
        Some(match first_sent {
            Some((at, since)) if at == started => since,
            _ => now.saturating_duration_since(started),
        })
    }
}

/// Whole microseconds of `d` (saturating).
pub(in crate::session) fn micros(d: Duration) -> u64 {
    d.as_secs()
        .saturating_mul(1_000_000)
        .saturating_add(u64::from(d.subsec_micros()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class() -> Arc<Classified> {
        Arc::new(crate::classify::fingerprint::analyze("SELECT 1", 1 << 20))
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// (caller, total, elapsed, outcome, backend_ok) of one finished statement.
    type Seen = (u16, Duration, Duration, Outcome, bool);

    /// Runs `ready` and collects what it says of each statement.
    fn ready(t: &mut Tally, now: Instant, rows: u64, idle: bool) -> (Ready, Vec<Seen>) {
        let mut seen = Vec::new();
        let r = t.ready(now, rows, idle, |f| {
            seen.push((f.caller, f.total, f.elapsed, f.outcome, f.backend_ok))
        });
        (r, seen)
    }

    #[test]
    fn a_query_alone_is_one_statement_and_one_transaction() {
        let t0 = Instant::now();
        let mut t = Tally::new(0);
        t.arrived(t0);
        t.ready_requested();
        t.track(class(), 3, t0 + ms(2), t.last_ready());
        let (r, seen) = ready(&mut t, t0 + ms(7), 5, true);
        assert_eq!(
            r,
            Ready {
                statements: 1,
                backend_us: 5_000,
                transaction: Some(ms(5)),
            }
        );
        // Client-observed time counts from the arrival (admission and checkout included).
        assert_eq!(seen, vec![(3, ms(7), ms(5), Outcome::Ok { rows: 5 }, true)]);
    }

    #[test]
    fn an_extended_batch_is_completed_by_its_sync_and_rows_go_to_the_last_statement() {
        let t0 = Instant::now();
        let mut t = Tally::new(0);
        // Two Binds before the Sync: both wait for the next ReadyForQuery.
        t.track(class(), 1, t0, t.last_ready() + 1);
        t.track(class(), 2, t0 + ms(1), t.last_ready() + 1);
        t.ready_requested();
        let (r, seen) = ready(&mut t, t0 + ms(4), 9, true);
        assert_eq!(r.statements, 2);
        assert_eq!(r.backend_us, 4_000 + 3_000);
        assert_eq!(r.transaction, Some(ms(4)));
        assert_eq!(seen[0].3, Outcome::Ok { rows: 0 });
        assert_eq!(seen[1].3, Outcome::Ok { rows: 9 });
    }

    #[test]
    fn a_transaction_spans_ready_for_queries_until_one_says_idle() {
        let t0 = Instant::now();
        let mut t = Tally::new(0);
        for (i, idle) in [(0, false), (1, false), (2, true)] {
            t.ready_requested();
            t.track(class(), 0, t0 + ms(10 * i), t.last_ready());
            let (r, _) = ready(&mut t, t0 + ms(10 * i + 3), 0, idle);
            assert_eq!(r.statements, 1);
            assert_eq!(r.transaction, idle.then(|| ms(23)), "step {i}");
        }
    }

    #[test]
    fn pipelined_statements_belong_to_the_ready_for_query_that_completes_them() {
        let t0 = Instant::now();
        let mut t = Tally::new(0);
        t.ready_requested();
        t.track(class(), 0, t0, t.last_ready());
        t.ready_requested();
        t.track(class(), 0, t0 + ms(1), t.last_ready());
        let (r1, _) = ready(&mut t, t0 + ms(5), 0, true);
        assert_eq!(r1.statements, 1);
        assert_eq!(r1.transaction, Some(ms(5)));
        // The second transaction started with its own statement, not the first's.
        let (r2, _) = ready(&mut t, t0 + ms(9), 0, true);
        assert_eq!(r2.statements, 1);
        assert_eq!(r2.transaction, Some(ms(8)));
    }

    #[test]
    fn an_error_counts_every_statement_of_its_request_and_then_clears() {
        let t0 = Instant::now();
        let mut t = Tally::new(0);
        t.ready_requested();
        t.track(class(), 0, t0, t.last_ready());
        t.errored(Outcome::StatementTimeout, true);
        let (_, seen) = ready(&mut t, t0 + ms(1), 4, true);
        assert_eq!(seen[0].3, Outcome::StatementTimeout);
        assert!(!seen[0].4, "a backend fault reaches the breaker");
        t.ready_requested();
        t.track(class(), 0, t0, t.last_ready());
        let (_, seen) = ready(&mut t, t0 + ms(2), 1, true);
        assert_eq!(seen[0].3, Outcome::Ok { rows: 1 });
        assert!(seen[0].4);
    }

    #[test]
    fn a_ready_for_query_without_statements_still_ends_the_transaction() {
        let t0 = Instant::now();
        let mut t = Tally::new(0);
        t.ready_requested();
        t.track(class(), 0, t0, t.last_ready());
        assert_eq!(ready(&mut t, t0 + ms(1), 0, false).0.transaction, None);
        // A Sync after a refused statement: nothing completed, the block closes.
        let (r, seen) = ready(&mut t, t0 + ms(6), 0, true);
        assert!(seen.is_empty());
        assert_eq!(r.statements, 0);
        assert_eq!(r.transaction, Some(ms(6)));
    }

    #[test]
    fn pending_statements_are_bounded() {
        let t0 = Instant::now();
        let mut t = Tally::new(0);
        for _ in 0..MAX_PENDING + 10 {
            t.track(class(), 0, t0, 1);
        }
        t.ready_requested();
        assert_eq!(ready(&mut t, t0, 0, true).0.statements, MAX_PENDING as u64);
    }

    #[test]
    fn bytes_are_taken_once() {
        let mut t = Tally::new(10);
        t.received(5);
        t.sent(7);
        assert_eq!(t.take_bytes(), (15, 7));
        assert_eq!(t.take_bytes(), (0, 0));
    }
}
