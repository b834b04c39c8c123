//! Which replies the backend still owes, in order, and what to do with each: forward it,
//! swallow it (a message the proxy injected), or answer it ourselves (a Parse or Close the
//! proxy did not need to send).
//!
//! This is what makes statement renaming, injected SETs and synthetic replies safe under
//! pipelining: every reply is matched to the request that caused it, Postgres' "skip until
//! Sync after an error" is mirrored, and the backend is known to be idle only when nothing is
//! owed. Pure bookkeeping, no I/O.

use std::collections::VecDeque;

use bytes::BytesMut;

use crate::protocol::messages;
use crate::protocol::tag::{backend, status};

mod outbox;
pub use outbox::{Broken, Outbox};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Parse,
    Bind,
    DescribeStmt,
    DescribePortal,
    Execute,
    Close,
    Sync,
    Query,
    FunctionCall,
}

impl Kind {
    /// Requests answered by ReadyForQuery.
    pub fn ends_with_ready(self) -> bool {
        matches!(self, Kind::Sync | Kind::Query | Kind::FunctionCall)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The client sent it; its replies go to the client.
    Forward,
    /// The proxy injected it; its replies are dropped (errors excepted, see `on_backend`).
    Swallow,
    /// Not sent to the backend; the proxy answers it when it reaches the head of the queue.
    Synthetic,
    /// The proxy's own query whose rows it reads (the session-settings capture).
    Capture,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expect {
    pub kind: Kind,
    pub mode: Mode,
    /// For a Parse of a proxy-named statement: its hash, forgotten again if the Parse fails.
    pub stmt: Option<u64>,
    /// For a Bind/Describe of a proxy-named statement: its hash (invalidated on 0A000).
    pub target: Option<u64>,
    /// For a Query we prefixed with the timeouts statement: its results to drop…
    pub skip_complete: u8,
    /// …and how many characters to take off error positions.
    pub pos_shift: u32,
}

impl Expect {
    pub fn new(kind: Kind, mode: Mode) -> Self {
        Expect {
            kind,
            mode,
            stmt: None,
            target: None,
            skip_complete: 0,
            pos_shift: 0,
        }
    }
}

/// The decision for one backend message: `Copy` and a few bytes, returned in registers once
/// per backend message (a rare list waits in the tracker: [`Tracker::take_not_prepared`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub forward: bool,
    /// Statements whose Parse failed (or was skipped after an error) are not prepared here
    /// ([`Tracker::take_not_prepared`]).
    pub not_prepared: bool,
    /// The message was a ReadyForQuery for a request the proxy injected.
    pub injected_done: bool,
    /// A DataRow of the capture query.
    pub capture_row: bool,
    /// The ReadyForQuery ending the capture query.
    pub capture_done: bool,
    /// An error of a query the proxy injected (reported to the client as a warning).
    pub injected_error: bool,
    /// Error positions in this ErrorResponse are off by this many characters.
    pub pos_shift: u32,
}

#[derive(Debug)]
pub struct Tracker {
    q: VecDeque<Expect>,
    /// Transaction status from the last ReadyForQuery.
    pub txn: u8,
    /// The backend is in COPY FROM STDIN and waits for the client's CopyData.
    pub copy_in: bool,
    /// Extended-protocol messages were sent since the last Sync.
    pub sync_pending: bool,
    /// What the last [`Step::not_prepared`] announced, until taken.
    not_prepared: Vec<u64>,
}

impl Default for Tracker {
    fn default() -> Self {
        Tracker {
            q: VecDeque::new(),
            txn: status::IDLE,
            copy_in: false,
            sync_pending: false,
            not_prepared: Vec::new(),
        }
    }
}

impl Tracker {
    /// Private to this module: requests are queued through [`Outbox`], with their bytes.
    fn push(&mut self, e: Expect) {
        match e.kind {
            Kind::Sync => self.sync_pending = false,
            Kind::Query | Kind::FunctionCall => {}
            _ => self.sync_pending = true,
        }
        self.q.push_back(e);
    }

    /// Nothing owed, no transaction, no COPY, no half-finished extended batch.
    pub fn idle(&self) -> bool {
        self.q.is_empty() && !self.sync_pending && self.txn == status::IDLE && !self.copy_in
    }

    /// Requests still waiting for replies.
    pub fn in_flight(&self) -> bool {
        !self.q.is_empty()
    }

    /// ReadyForQuery messages the backend still owes.
    pub fn pending_ready(&self) -> usize {
        self.q.iter().filter(|e| e.kind.ends_with_ready()).count()
    }

    /// Answers synthetic requests that reached the head of the queue. Called before every
    /// backend message: the check is inlined, the answering is not.
    #[inline]
    pub fn answer_synthetic(&mut self, out: &mut BytesMut) {
        if self.q.front().is_some_and(|e| e.mode == Mode::Synthetic) {
            self.answer_synthetic_head(out);
        }
    }

    fn answer_synthetic_head(&mut self, out: &mut BytesMut) {
        while let Some(e) = self.q.front() {
            if e.mode != Mode::Synthetic {
                break;
            }
            match e.kind {
                Kind::Parse => messages::parse_complete(out),
                Kind::Close => messages::close_complete(out),
                _ => {}
            }
            self.q.pop_front();
        }
    }

    /// The head request is the capture query (its rows are read whole, not streamed).
    pub fn capturing(&self) -> bool {
        self.q.front().is_some_and(|e| e.mode == Mode::Capture)
    }

    /// The proxy-named statement the oldest outstanding request uses, if any.
    pub fn head_target(&self) -> Option<u64> {
        self.q.front().and_then(|e| e.target)
    }

    /// The statements the last [`Step::not_prepared`] announced.
    pub fn take_not_prepared(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.not_prepared)
    }

    /// Accounts for one backend message of type `tag` (`first` = first body byte, for Z).
    #[inline(always)]
    pub fn on_backend(&mut self, tag: u8, first: Option<u8>) -> Step {
        // Only the head's kind, mode and injected results to drop are read per message (not
        // a copy of the whole entry): the rest is for errors, read where they are handled.
        let (head, head_mode, skipping) = match self.q.front() {
            Some(h) => (
                Some(h.kind),
                h.mode,
                h.kind == Kind::Query && h.skip_complete > 0,
            ),
            None => (None, Mode::Forward, false),
        };
        let hidden = matches!(head_mode, Mode::Swallow | Mode::Capture);
        let mut step = Step {
            forward: !hidden,
            ..Step::default()
        };
        match tag {
            backend::READY_FOR_QUERY => {
                self.txn = first.unwrap_or(status::IDLE);
                self.copy_in = false;
                // Pop through the request this answers (guards against a desync).
                while let Some(e) = self.q.pop_front() {
                    if e.kind.ends_with_ready() {
                        let hidden = matches!(e.mode, Mode::Swallow | Mode::Capture);
                        step.forward = !hidden;
                        step.injected_done = hidden;
                        step.capture_done = e.mode == Mode::Capture;
                        break;
                    }
                }
            }
            backend::ERROR_RESPONSE => {
                self.copy_in = false;
                match self.q.front() {
                    None => step.forward = true,
                    Some(h) if h.kind.ends_with_ready() => {
                        step.injected_error = hidden;
                        step.pos_shift = h.pos_shift;
                    }
                    Some(_) => {
                        // Errors of injected Parses reach the client: its Bind fails with them.
                        step.forward = true;
                        while let Some(e) = self.q.front() {
                            if e.kind == Kind::Sync {
                                break;
                            }
                            if let Some(h) = e.stmt {
                                step.not_prepared = true;
                                self.not_prepared.push(h);
                            }
                            self.q.pop_front();
                        }
                    }
                }
            }
            backend::PARSE_COMPLETE | backend::BIND_COMPLETE | backend::CLOSE_COMPLETE => {
                if matches!(head, Some(Kind::Parse | Kind::Bind | Kind::Close)) {
                    self.q.pop_front();
                }
            }
            // The head is a Query whose injected leading statement's result is still to be
            // dropped.
            backend::ROW_DESCRIPTION | backend::DATA_ROW if skipping => step.forward = false,
            backend::ROW_DESCRIPTION | backend::NO_DATA => {
                if matches!(head, Some(Kind::DescribeStmt | Kind::DescribePortal)) {
                    self.q.pop_front();
                }
            }
            backend::COMMAND_COMPLETE | backend::EMPTY_QUERY | backend::PORTAL_SUSPENDED => {
                if tag == backend::COMMAND_COMPLETE {
                    self.copy_in = false;
                    if skipping && let Some(h) = self.q.front_mut() {
                        h.skip_complete -= 1;
                        step.forward = false;
                    }
                }
                if head == Some(Kind::Execute) {
                    self.q.pop_front();
                }
            }
            backend::COPY_IN | backend::COPY_BOTH => {
                self.copy_in = true;
                // Postgres ignores Sync and Flush while in COPY FROM STDIN: Syncs the client
                // pipelined behind the Execute that started the copy get no ReadyForQuery.
                if head == Some(Kind::Execute) {
                    let mut i = 1;
                    while i < self.q.len() {
                        if self.q[i].kind == Kind::Sync && self.q[i].mode == Mode::Forward {
                            self.q.remove(i);
                        } else {
                            i += 1;
                        }
                    }
                }
            }
            backend::DATA_ROW => step.capture_row = head_mode == Mode::Capture,
            // Notifications belong to the client whatever it is waiting for.
            backend::NOTIFICATION => step.forward = true,
            _ => {}
        }
        step
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fwd(k: Kind) -> Expect {
        Expect::new(k, Mode::Forward)
    }

    #[test]
    fn extended_round_trip_ends_idle() {
        let mut t = Tracker::default();
        for k in [Kind::Parse, Kind::Bind, Kind::Execute, Kind::Sync] {
            t.push(fwd(k));
        }
        assert!(!t.idle());
        for tag in [b'1', b'2', b'D', b'C'] {
            assert!(t.on_backend(tag, None).forward);
        }
        assert!(t.on_backend(b'Z', Some(b'I')).forward);
        assert!(t.idle());
    }

    #[test]
    fn error_skips_to_sync_and_drops_synthetic_replies() {
        let mut t = Tracker::default();
        let mut p = fwd(Kind::Parse);
        p.stmt = Some(7);
        t.push(p);
        t.push(Expect::new(Kind::Parse, Mode::Synthetic));
        t.push(fwd(Kind::Bind));
        t.push(fwd(Kind::Sync));
        let s = t.on_backend(b'E', None);
        assert!(s.forward);
        assert!(s.not_prepared);
        assert_eq!(t.take_not_prepared(), vec![7]);
        let mut out = BytesMut::new();
        t.answer_synthetic(&mut out);
        assert!(out.is_empty());
        t.on_backend(b'Z', Some(b'I'));
        assert!(t.idle());
    }

    #[test]
    fn synthetic_answers_come_in_order() {
        let mut t = Tracker::default();
        t.push(fwd(Kind::Bind));
        t.push(Expect::new(Kind::Close, Mode::Synthetic));
        t.push(fwd(Kind::Sync));
        let mut out = BytesMut::new();
        t.answer_synthetic(&mut out);
        assert!(out.is_empty(), "the Bind reply comes first");
        t.on_backend(b'2', None);
        t.answer_synthetic(&mut out);
        assert_eq!(&out[..], b"3\0\0\0\x04");
    }

    #[test]
    fn injected_query_is_swallowed_but_errors_in_client_queries_are_not() {
        let mut t = Tracker::default();
        t.push(Expect::new(Kind::Query, Mode::Swallow));
        t.push(fwd(Kind::Query));
        assert!(!t.on_backend(b'S', None).forward);
        assert!(!t.on_backend(b'C', None).forward);
        let z = t.on_backend(b'Z', Some(b'I'));
        assert!(!z.forward && z.injected_done);
        assert!(t.on_backend(b'E', None).forward);
        assert!(t.on_backend(b'Z', Some(b'I')).forward);
        assert!(t.idle());
    }

    #[test]
    fn syncs_pipelined_into_copy_in_are_ignored() {
        let mut t = Tracker::default();
        for k in [Kind::Bind, Kind::Execute, Kind::Sync] {
            t.push(fwd(k));
        }
        t.on_backend(b'2', None);
        t.on_backend(b'G', None);
        t.push(fwd(Kind::Sync));
        t.on_backend(b'C', None);
        t.on_backend(b'Z', Some(b'I'));
        assert!(t.idle());
    }

    #[test]
    fn transaction_and_copy_keep_it_busy() {
        let mut t = Tracker::default();
        t.push(fwd(Kind::Query));
        t.on_backend(b'Z', Some(b'T'));
        assert!(!t.idle());
        t.push(fwd(Kind::Query));
        t.on_backend(b'G', None);
        assert!(t.copy_in);
        t.on_backend(b'C', None);
        t.on_backend(b'Z', Some(b'I'));
        assert!(t.idle());
    }
}
