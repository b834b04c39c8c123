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

use bytes::{Buf, BytesMut};

use crate::protocol::error::{field_of, shift_position, sqlstate_of};
use crate::protocol::framing::{self, Direction, FrameError};
use crate::protocol::messages;
use crate::session::state;
use crate::session::tracker::Tracker;

use super::retry::{Filter, Retry};

/// Client bytes past which the driver is asked to flush before more is read: a long result
/// never piles up in memory.
pub(super) const FLUSH_AT: usize = 64 * 1024;

#[derive(Debug, Default)]
pub(super) struct Replies {
    /// Backend bytes not yet framed.
    buf: BytesMut,
    /// Body bytes of a DataRow/CopyData still to stream, and whether they go to the client.
    pass: usize,
    pass_fwd: bool,
    /// Rows of the settings read-back so far.
    captured: Vec<(String, String)>,
}

/// What one backend message means beyond the bytes written for the client.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Seen {
    /// A ReadyForQuery went to the client: the request it ends is over.
    pub ready: bool,
    /// A CommandComplete went to the client, with this many rows.
    pub rows: Option<u64>,
    /// An ErrorResponse went to the client…
    pub errored: bool,
    /// …with this SQLSTATE.
    pub code: Option<[u8; 5]>,
    /// The server sent a FATAL (or PANIC) error: it is about to close.
    pub fatal: bool,
    /// Postgres refused this cached proxy-named statement: its result type changed.
    pub stale: Option<u64>,
    /// Statements whose Parse failed or was skipped after an error: not prepared here.
    pub not_prepared: Vec<u64>,
    /// The settings read-back ended: the server's settings, sorted.
    pub captured: Option<Vec<(String, String)>>,
    /// A query the proxy injected failed, with this message.
    pub injected_failed: Option<String>,
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
pub(super) enum Next {
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
        self.captured.clear();
    }

    /// For a cleanup that drains the connection after the client left: the bytes of a message
    /// still to skip and what is buffered.
    pub fn take_rest(&mut self) -> (usize, BytesMut) {
        (self.pass, std::mem::take(&mut self.buf))
    }

    /// Handles buffered backend messages until one needs the driver: the client's bytes go to
    /// `client`, the tracker and the retry are advanced. A malformed frame is an error (the
    /// connection cannot be trusted any more).
    pub fn next(
        &mut self,
        t: &mut Tracker,
        retry: &mut Option<Retry>,
        client: &mut BytesMut,
    ) -> Result<Next, FrameError> {
        loop {
            if self.pass > 0 {
                let take = self.pass.min(self.buf.len());
                if take == 0 {
                    return Ok(Next::Read);
                }
                if self.pass_fwd {
                    client.extend_from_slice(&self.buf[..take]);
                }
                self.buf.advance(take);
                self.pass -= take;
                continue;
            }
            t.answer_synthetic(client);
            if client.len() >= FLUSH_AT {
                return Ok(Next::Flush);
            }
            let Some(h) = framing::header(&self.buf, Direction::Backend)? else {
                return Ok(Next::Read);
            };
            if self.buf.len() < h.total {
                if matches!(h.tag, b'D' | b'd') && !t.capturing() {
                    let step = t.on_backend(h.tag, None);
                    if step.forward {
                        client.extend_from_slice(&self.buf);
                    }
                    self.pass = h.total - self.buf.len();
                    self.pass_fwd = step.forward;
                    self.buf.clear();
                }
                return Ok(Next::Read);
            }
            let seen = decide(&self.buf[..h.total], t, retry, &mut self.captured, client);
            self.buf.advance(h.total);
            if !seen.is_empty() {
                return Ok(Next::Seen(seen));
            }
        }
    }
}

/// One whole backend message: what the client gets (written to `client`) and what it means.
fn decide(
    frame: &[u8],
    t: &mut Tracker,
    retry: &mut Option<Retry>,
    captured: &mut Vec<(String, String)>,
    client: &mut BytesMut,
) -> Seen {
    let tag = frame[0];
    let body = &frame[framing::HEADER_LEN..];
    let mut seen = Seen::default();
    if tag == b'E' && is_stale_plan(body) {
        // Before the tracker moves on: the statement is the head request's.
        seen.stale = t.head_target();
    }
    let filter = retry.as_mut().map(|r| r.filter(tag, body));
    if filter == Some(Filter::Forget) {
        *retry = None;
    }
    let step = t.on_backend(tag, body.first().copied());
    if filter == Some(Filter::Swallow) {
        seen.replay = tag == b'Z';
        return seen;
    }
    seen.fatal = tag == b'E' && matches!(field_of(body, b'S'), Some("FATAL" | "PANIC"));
    seen.not_prepared = step.not_prepared;
    if step.capture_row
        && let Some(kv) = state::capture_row(body)
    {
        captured.push(kv);
    }
    if step.injected_error {
        seen.injected_failed = Some(field_of(body, b'M').unwrap_or("unknown error").to_owned());
    }
    if step.capture_done {
        let mut rows = std::mem::take(captured);
        rows.sort();
        seen.captured = Some(rows);
    }
    if !step.forward {
        return seen;
    }
    match tag {
        b'Z' => seen.ready = true,
        b'C' => seen.rows = Some(rows_of(body)),
        b'E' => {
            seen.errored = true;
            seen.code = sqlstate_of(body).and_then(|c| c.as_bytes().try_into().ok());
        }
        _ => {}
    }
    if tag == b'E' && step.pos_shift > 0 {
        messages::raw(client, b'E', &[&shift_position(body, step.pos_shift)]);
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

/// Rows reported by a CommandComplete tag (`SELECT 5`, `INSERT 0 3`, `UPDATE 2`).
fn rows_of(body: &[u8]) -> u64 {
    let tag = body.strip_suffix(b"\0").unwrap_or(body);
    tag.rsplit(|&b| b == b' ')
        .next()
        .and_then(|n| std::str::from_utf8(n).ok())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
#[path = "replies_tests.rs"]
mod tests;
