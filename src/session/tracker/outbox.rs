//! The only way to write to the backend: the bytes of each request and the reply it is owed,
//! pushed together.
//!
//! The tracker must list the backend's outstanding replies in the order the backend will
//! send them, which is the order their requests are written. Keeping the two apart (a byte
//! buffer here, an expectation there) left that order to each call site. [`Outbox`] owns
//! both: a request goes in with its [`Expect`] in one call ([`Outbox::send`],
//! [`Outbox::send_with`]), bytes that are no request of their own (CopyData, CopyDone,
//! CopyFail, Flush) with [`Outbox::pass`], and a request the proxy answers itself with
//! [`Outbox::answer_here`] (its place in the order is kept, nothing is written). The
//! tracker's own `push` is private to the tracker module, so nothing else can add an
//! expectation without its bytes.
//!
//! Each request's first byte is checked against the message its expectation is for, in
//! every build: a mismatch marks the outbox broken, and a broken outbox gives nothing to
//! write ([`Outbox::to_write`]) — the session ends and its backend is closed, since the
//! replies owed no longer match what the backend would answer (fail closed).

use bytes::BytesMut;

use super::{Expect, Kind, Mode, Tracker};
use crate::protocol::messages;
use crate::session::spare;

#[derive(Debug, Default)]
pub struct Outbox {
    buf: BytesMut,
    /// Replies owed, in order. Read and fed backend messages freely; written only through
    /// the outbox.
    pub t: Tracker,
    /// A request was queued with another message's bytes (or a synthetic reply was sent).
    broken: bool,
}

/// A request was queued with another message's bytes: a bug in the proxy, caught before
/// anything reached the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Broken;

impl std::fmt::Display for Broken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a request was queued with another message's bytes")
    }
}

impl Outbox {
    /// A request the backend answers: its expectation, then its bytes (one whole frame).
    pub fn send(&mut self, e: Expect, frame: &[u8]) {
        self.send_with(e, |buf| buf.extend_from_slice(frame));
    }

    /// [`Outbox::send`] for a request written in place (renamed, injected).
    pub fn send_with(&mut self, e: Expect, write: impl FnOnce(&mut BytesMut)) {
        let at = self.buf.len();
        write(&mut self.buf);
        if e.mode == Mode::Synthetic || self.buf.get(at).copied() != Some(frontend_tag(e)) {
            self.broken = true;
        }
        self.t.push(e);
    }

    /// A simple Query the proxy sends with `mode` (injected: `Swallow`; read: `Capture`).
    pub fn query(&mut self, mode: Mode, sql: &str) {
        self.send_with(Expect::new(Kind::Query, mode), |buf| {
            messages::query(buf, sql)
        });
    }

    /// Bytes that owe no reply of their own: CopyData, CopyDone and CopyFail (answered as
    /// the COPY's statement), Flush, or the rest of a frame already accounted for.
    pub fn pass(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// A request the proxy answers itself when its turn comes ([`Tracker::answer_synthetic`]).
    pub fn answer_here(&mut self, kind: Kind) {
        self.t.push(Expect::new(kind, Mode::Synthetic));
    }

    /// A backend is attached: a buffer from the session thread's spares if there is none.
    pub fn lend_buffer(&mut self) {
        spare::lend(&mut self.buf);
    }

    /// The backend went back: the buffer goes back to the spares when nothing is unsent.
    pub fn return_buffer(&mut self) {
        spare::give_back(&mut self.buf);
    }

    /// What is to be written to the backend, unless a request was queued with another
    /// message's bytes (then nothing may be: see the module doc).
    #[inline(always)]
    pub fn to_write(&self) -> Result<&[u8], Broken> {
        if self.broken {
            return Err(Broken);
        }
        Ok(&self.buf)
    }

    /// What is queued and not yet flushed, unchecked (tests and the oracle).
    #[cfg(any(test, fuzzing))]
    pub fn pending(&self) -> &[u8] {
        &self.buf
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// After a write of the first `n` pending bytes: `true` (and nothing pending) when that
    /// was all of them, else those dropped and `false`.
    pub fn written(&mut self, n: usize) -> bool {
        spare::consume(&mut self.buf, n)
    }

    /// Forgets the written bytes (flushed, or the backend is gone).
    pub fn clear(&mut self) {
        self.buf.clear();
    }
}

/// The frontend message type a request of this kind is sent as.
fn frontend_tag(e: Expect) -> u8 {
    match e.kind {
        Kind::Parse => b'P',
        Kind::Bind => b'B',
        Kind::DescribeStmt | Kind::DescribePortal => b'D',
        Kind::Execute => b'E',
        Kind::Close => b'C',
        Kind::Sync => b'S',
        Kind::Query => b'Q',
        Kind::FunctionCall => b'F',
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fwd(k: Kind) -> Expect {
        Expect::new(k, Mode::Forward)
    }

    fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut f = vec![tag];
        f.extend_from_slice(&(body.len() as i32 + 4).to_be_bytes());
        f.extend_from_slice(body);
        f
    }

    #[test]
    fn a_pipelined_batch_is_written_and_owed_in_the_same_order() {
        let mut o = Outbox::default();
        o.query(Mode::Swallow, "SET LOCAL statement_timeout = '1s'");
        o.send(fwd(Kind::Parse), &frame(b'P', b"\0SELECT 1\0\0\0"));
        o.send(fwd(Kind::Bind), &frame(b'B', b"\0\0\0\0\0\0\0\0"));
        o.send(fwd(Kind::Execute), &frame(b'E', b"\0\0\0\0\0"));
        o.pass(&frame(b'H', b""));
        o.send(fwd(Kind::Sync), &frame(b'S', b""));
        // The bytes, in order.
        let tags: Vec<u8> = {
            let mut v = Vec::new();
            let mut rest = o.pending();
            while !rest.is_empty() {
                v.push(rest[0]);
                let len = i32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
                rest = &rest[1 + len..];
            }
            v
        };
        assert_eq!(tags, b"QPBEHS");
        // The replies, in the same order: the injected query's are swallowed.
        for (tag, forward) in [(b'C', false), (b'Z', false), (b'1', true), (b'2', true)] {
            assert_eq!(o.t.on_backend(tag, Some(b'I')).forward, forward);
        }
        assert!(o.t.on_backend(b'D', None).forward);
        assert!(o.t.on_backend(b'C', None).forward);
        assert!(o.t.on_backend(b'Z', Some(b'I')).forward);
        assert!(o.t.idle());
    }

    #[test]
    fn a_request_answered_here_keeps_its_place_and_writes_nothing() {
        let mut o = Outbox::default();
        o.send(fwd(Kind::Bind), &frame(b'B', b"\0\0\0\0\0\0\0\0"));
        o.answer_here(Kind::Close);
        o.send(fwd(Kind::Sync), &frame(b'S', b""));
        assert_eq!(o.pending().len(), 13 + 5);
        let mut client = BytesMut::new();
        o.t.answer_synthetic(&mut client);
        assert!(client.is_empty(), "the Bind's reply comes first");
        o.t.on_backend(b'2', None);
        o.t.answer_synthetic(&mut client);
        assert_eq!(&client[..], b"3\0\0\0\x04");
        o.t.on_backend(b'Z', Some(b'I'));
        assert!(o.t.idle());
        o.clear();
        assert!(o.is_empty());
    }

    #[test]
    fn a_partly_written_batch_keeps_its_rest_in_order_and_what_it_is_owed() {
        let mut o = Outbox::default();
        o.send(fwd(Kind::Execute), &frame(b'E', b"\0\0\0\0\0"));
        o.send(fwd(Kind::Sync), &frame(b'S', b""));
        let all = o.pending().to_vec();
        assert!(!o.written(3));
        assert_eq!(o.pending(), &all[3..]);
        assert!(!o.written(0));
        assert_eq!(o.pending(), &all[3..]);
        assert!(o.written(all.len() - 3));
        assert!(o.is_empty());
        // The replies owed are the tracker's, whatever the writes did.
        assert!(o.t.on_backend(b'C', None).forward);
        assert!(o.t.on_backend(b'Z', Some(b'I')).forward);
        assert!(o.t.idle());
    }

    /// In every build: a request whose bytes are another message's, or a synthetic reply
    /// sent, leaves nothing to write, whatever is queued after it.
    #[test]
    fn an_expectation_with_the_wrong_bytes_leaves_nothing_to_write() {
        let mut o = Outbox::default();
        o.send(fwd(Kind::Sync), &frame(b'S', b""));
        assert_eq!(o.to_write(), Ok(&frame(b'S', b"")[..]));
        o.send(fwd(Kind::Bind), &frame(b'E', b"\0\0\0\0\0"));
        assert_eq!(o.to_write(), Err(Broken));
        o.send(fwd(Kind::Sync), &frame(b'S', b""));
        assert_eq!(o.to_write(), Err(Broken), "stays broken");

        let mut o = Outbox::default();
        o.send(
            Expect::new(Kind::Query, Mode::Synthetic),
            &frame(b'Q', b"\0"),
        );
        assert_eq!(o.to_write(), Err(Broken), "a synthetic reply sends nothing");
    }
}
