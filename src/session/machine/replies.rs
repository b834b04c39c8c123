//! The backend → client half of the relay, without I/O: the backend's bytes go in, the
//! client's bytes and what the relay must act on come out.
//!
//! [`Replies`] frames what the backend sent, streams a DataRow or CopyData longer than what has
//! arrived straight through (never buffering a long row whole), and asks the [`Tracker`] what
//! each message is: forwarded, swallowed (a reply to something the proxy injected), or the
//! moment to answer a request the proxy answers itself. A batch kept for a replay
//! ([`Retry`]) hides its replies from the client. Everything the client gets is written to the
//! caller's buffer in order; everything else a message means — a request ended, rows counted,
//! an error's SQLSTATE, a statement no longer prepared, a settings row read back, a replay due
//! — comes back as a [`Seen`] for the driver (`Relay::on_backend_data`), which owns the
//! sockets, the pool and the statistics. No socket, no clock: the unit tests below drive it
//! with byte fixtures.

use bytes::BytesMut;

use crate::protocol::error::{field_of, shift_position, sqlstate_of};
use crate::protocol::framing::{self, Direction, FrameError};
use crate::protocol::messages;
use crate::protocol::tag::backend;
use crate::session::tracker::Tracker;
use crate::session::{spare, state};

use super::retry::{Filter, Retry};

/// Client bytes past which the driver is asked to flush before more is read: a long result
/// never piles up in memory.
pub(in crate::session) const FLUSH_AT: usize = 64 * 1024;

#[derive(Debug, Default)]
pub(in crate::session) struct Replies {
    /// Backend bytes not yet framed.
    buf: BytesMut,
    /// Body bytes of a DataRow/CopyData still to stream, and whether they go to the client.
    pass: usize,
    pass_fwd: bool,
    /// What a [`Seen`] announces and the driver takes (kept here so `Seen` stays `Copy`).
    rare: Rare,
    /// Rows of the CommandCompletes forwarded since the last forwarded ReadyForQuery: given
    /// with that ReadyForQuery's [`Seen`], so a CommandComplete needs no `Seen` of its own.
    rows: u64,
}

/// The payloads of rare replies, waiting to be taken.
#[derive(Debug, Default)]
struct Rare {
    /// Rows of the settings read-back so far, then (sorted) the finished read-back.
    rows: Vec<(String, String)>,
    settings: Vec<(String, String)>,
    not_prepared: Vec<u64>,
    injected_failure: String,
}

/// What one backend message means beyond the bytes written for the client. `Copy`, a few
/// words: the driver gets one per ReadyForQuery and per error; a rare reply's payload waits
/// in [`Replies`] until taken (`take_*`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(in crate::session) struct Seen {
    /// A ReadyForQuery went to the client: the request it ends is over…
    pub ready: bool,
    /// …and the CommandCompletes that went to the client since the previous one counted
    /// this many rows.
    pub rows: u64,
    /// An ErrorResponse went to the client…
    pub errored: bool,
    /// …with this SQLSTATE.
    pub code: Option<[u8; 5]>,
    /// The server sent a FATAL (or PANIC) error: it is about to close.
    pub fatal: bool,
    /// Postgres refused this cached proxy-named statement: its result type changed.
    pub stale: Option<u64>,
    /// Statements whose Parse failed or was skipped after an error are not prepared here
    /// ([`Replies::take_not_prepared`]).
    pub not_prepared: bool,
    /// The settings read-back ended ([`Replies::take_settings`]).
    pub captured: bool,
    /// A query the proxy injected failed ([`Replies::take_injected_failure`]).
    pub injected_failed: bool,
    /// The batch kept for a replay is over on the server: re-prepare and send it again.
    pub replay: bool,
}

impl Seen {
    /// The SQLSTATE of the forwarded error, as text.
    pub fn code(&self) -> Option<&str> {
        self.code.as_ref().and_then(|c| std::str::from_utf8(c).ok())
    }

    fn is_empty(&self) -> bool {
        *self == Seen::default()
    }
}

/// What the driver does next.
#[derive(Debug, PartialEq, Eq)]
pub(in crate::session) enum Next {
    /// Everything buffered is handled: read more from the backend.
    Read,
    /// The client's buffer is large: write it out, then call again.
    Flush,
    /// Act on this message, then call again.
    Seen(Seen),
}

impl Replies {
    /// Where the driver reads backend bytes into.
    pub fn buf_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }

    /// No backend byte is waiting to be handled, none of a message still to stream.
    pub fn quiet(&self) -> bool {
        self.pass == 0 && self.buf.is_empty()
    }

    /// Forgets an unfinished read-back (a new one starts).
    pub fn restart_capture(&mut self) {
        self.rare.rows.clear();
    }

    /// The statements a [`Seen::not_prepared`] announced.
    pub fn take_not_prepared(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.rare.not_prepared)
    }

    /// The server's settings, sorted, that a [`Seen::captured`] announced.
    pub fn take_settings(&mut self) -> Vec<(String, String)> {
        std::mem::take(&mut self.rare.settings)
    }

    /// The message of the failure a [`Seen::injected_failed`] announced.
    pub fn take_injected_failure(&mut self) -> String {
        std::mem::take(&mut self.rare.injected_failure)
    }

    /// For a cleanup that drains the connection after the client left: the bytes of a message
    /// still to skip and what is buffered.
    pub fn take_rest(&mut self) -> (usize, BytesMut) {
        (self.pass, std::mem::take(&mut self.buf))
    }

    /// Handles buffered backend messages until one needs the driver: the client's bytes go to
    /// `client`, the tracker and the retry are advanced. A malformed frame is an error (the
    /// connection cannot be trusted any more).
    #[inline(always)]
    pub fn next(
        &mut self,
        t: &mut Tracker,
        retry: &mut Option<Retry>,
        client: &mut BytesMut,
    ) -> Result<Next, FrameError> {
        // Handled bytes are dropped once, on the way out, not per message.
        let mut at = 0;
        let next = self.scan(&mut at, t, retry, client);
        spare::consume(&mut self.buf, at);
        next
    }

    /// [`Replies::next`] over `buf[*at..]`, moving `at` past what it handled.
    #[inline(always)]
    fn scan(
        &mut self,
        at: &mut usize,
        t: &mut Tracker,
        retry: &mut Option<Retry>,
        client: &mut BytesMut,
    ) -> Result<Next, FrameError> {
        loop {
            let rest = &self.buf[*at..];
            if self.pass > 0 {
                let take = self.pass.min(rest.len());
                if take == 0 {
                    return Ok(Next::Read);
                }
                if self.pass_fwd {
                    client.extend_from_slice(&rest[..take]);
                }
                *at += take;
                self.pass -= take;
                continue;
            }
            t.answer_synthetic(client);
            if client.len() >= FLUSH_AT {
                return Ok(Next::Flush);
            }
            let Some(h) = framing::header(rest, Direction::Backend)? else {
                return Ok(Next::Read);
            };
            if rest.len() < h.total {
                if matches!(h.tag, backend::DATA_ROW | backend::COPY_DATA) && !t.capturing() {
                    let step = t.on_backend(h.tag, None);
                    if step.forward {
                        client.extend_from_slice(rest);
                    }
                    self.pass = h.total - rest.len();
                    self.pass_fwd = step.forward;
                    *at += rest.len();
                }
                return Ok(Next::Read);
            }
            let seen = decide(
                &rest[..h.total],
                t,
                retry,
                &mut self.rare,
                &mut self.rows,
                client,
            );
            *at += h.total;
            if !seen.is_empty() {
                return Ok(Next::Seen(seen));
            }
        }
    }
}

/// One whole backend message: what the client gets (written to `client`) and what it means.
#[inline(always)]
fn decide(
    frame: &[u8],
    t: &mut Tracker,
    retry: &mut Option<Retry>,
    rare: &mut Rare,
    rows: &mut u64,
    client: &mut BytesMut,
) -> Seen {
    let tag = frame[0];
    let body = &frame[framing::HEADER_LEN..];
    let mut seen = Seen::default();
    if tag == backend::ERROR_RESPONSE && is_stale_plan(body) {
        // Before the tracker moves on: the statement is the head request's.
        seen.stale = t.head_target();
    }
    let filter = retry.as_mut().map(|r| r.filter(tag, body));
    if filter == Some(Filter::Forget) {
        *retry = None;
    }
    let step = t.on_backend(tag, body.first().copied());
    if filter == Some(Filter::Swallow) {
        if step.not_prepared {
            // The replay prepares its statements afresh.
            t.take_not_prepared();
        }
        seen.replay = tag == backend::READY_FOR_QUERY;
        return seen;
    }
    seen.fatal =
        tag == backend::ERROR_RESPONSE && matches!(field_of(body, b'S'), Some("FATAL" | "PANIC"));
    if step.not_prepared {
        seen.not_prepared = true;
        rare.not_prepared.append(&mut t.take_not_prepared());
    }
    if step.capture_row
        && let Some(kv) = state::capture_row(body)
    {
        rare.rows.push(kv);
    }
    if step.injected_error {
        seen.injected_failed = true;
        rare.injected_failure = field_of(body, b'M').unwrap_or("unknown error").to_owned();
    }
    if step.capture_done {
        seen.captured = true;
        rare.settings = std::mem::take(&mut rare.rows);
        rare.settings.sort();
    }
    if !step.forward {
        return seen;
    }
    match tag {
        backend::READY_FOR_QUERY => {
            seen.ready = true;
            seen.rows = std::mem::take(rows);
        }
        backend::COMMAND_COMPLETE => *rows = rows.saturating_add(rows_of(body)),
        backend::ERROR_RESPONSE => {
            seen.errored = true;
            seen.code = sqlstate_of(body).and_then(|c| c.as_bytes().try_into().ok());
        }
        _ => {}
    }
    if tag == backend::ERROR_RESPONSE && step.pos_shift > 0 {
        messages::raw(
            client,
            backend::ERROR_RESPONSE,
            &[&shift_position(body, step.pos_shift)],
        );
    } else {
        client.extend_from_slice(frame);
    }
    seen
}

/// Postgres' refusal of a cached statement whose result type changed.
fn is_stale_plan(body: &[u8]) -> bool {
    sqlstate_of(body) == Some("0A000")
        && field_of(body, b'M')
            .is_some_and(|m| m.contains("cached plan must not change result type"))
}

/// Rows reported by a CommandComplete tag (`SELECT 5`, `INSERT 0 3`, `UPDATE 2`); 0 for a
/// tag without a count (`CREATE TABLE`) or one that does not fit.
///
/// The digits are read from the end (a count is at most 19 of them), without a split.
#[inline(always)]
fn rows_of(body: &[u8]) -> u64 {
    let tag = body.strip_suffix(b"\0").unwrap_or(body);
    let digits = tag.iter().rev().take_while(|b| b.is_ascii_digit()).count();
    let start = tag.len() - digits;
    if digits == 0 || digits > 19 || (start > 0 && tag[start - 1] != b' ') {
        return 0;
    }
    tag[start..]
        .iter()
        .fold(0, |n, d| n * 10 + u64::from(d - b'0'))
}

#[cfg(test)]
#[test]
fn command_tags_give_their_row_counts() {
    for (tag, rows) in [
        (&b"SELECT 5\0"[..], 5),
        (b"INSERT 0 3\0", 3),
        (b"UPDATE 1234567\0", 1_234_567),
        (b"CREATE TABLE\0", 0),
        (b"SELECT\0", 0),
        (b"SELECT 99999999999999999999\0", 0),
        (b"SELECT 1234567890123456789\0", 1_234_567_890_123_456_789),
        (b"FETCH x1\0", 0),
        (b"42\0", 42),
        (b"MOVE 0\0", 0),
        (b"\0", 0),
        (b"", 0),
    ] {
        assert_eq!(rows_of(tag), rows, "{}", String::from_utf8_lossy(tag));
    }
}

#[cfg(test)]
#[path = "replies_tests.rs"]
mod tests;
