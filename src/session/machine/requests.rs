//! The client → backend framing of the relay, without I/O: the client's bytes go in, whole
//! requests come out for the driver to admit and route; what needs no decision is handled here.
//!
//! [`Requests`] frames what the client sent, refuses a Query/Parse/Bind/FunctionCall larger
//! than `limits.max_message_bytes` before buffering it (its bytes are dropped as they arrive),
//! streams a CopyData longer than what has arrived straight to the backend, passes COPY and
//! Flush messages through when a backend is attached, and after a refused request in an
//! extended batch drops everything up to the Sync, answering that with ReadyForQuery — what
//! Postgres does after an error. Whatever needs the policy, the pool or the statement names
//! (Query, Parse, Bind, Describe, Close, Execute, Sync, FunctionCall) comes back as a
//! [`Request::Frame`] for the driver (`Relay::on_client_data`).

use bytes::{Buf, BytesMut};

use crate::protocol::framing::{self, Direction, FrameError};
use crate::protocol::messages;
use crate::protocol::tag::frontend;
use crate::session::tracker::Outbox;

/// The largest stand-in buffer kept between holds.
const SPARE_MAX: usize = 64 * 1024;

#[derive(Debug)]
pub(in crate::session) struct Requests {
    /// Client bytes not yet framed.
    buf: BytesMut,
    /// What stands in for `buf` while it is held ([`Requests::hold`]), kept between holds so a
    /// checkout wait's read of the client does not allocate a buffer each time.
    spare: BytesMut,
    /// Body bytes of a client CopyData still to stream through.
    pass: usize,
    /// Bytes of an oversized client message still to read and drop.
    drop: usize,
    /// After a refusal in an extended batch: drop client messages until Sync, like Postgres.
    skipping: bool,
    /// `limits.max_message_bytes` at session start.
    max_message: usize,
}

/// What the driver does next.
#[derive(Debug, PartialEq, Eq)]
pub(in crate::session) enum Request {
    /// Everything buffered is handled: read more from the client.
    Read,
    /// A request to admit, rename or route: the first `len` bytes of the buffer, left there
    /// for the driver to handle in place ([`Requests::hold`], [`Requests::give_back`]).
    Frame { tag: u8, len: usize },
    /// A Query/Parse/Bind/FunctionCall over the size limit (being dropped): refuse it.
    TooLarge { tag: u8, total: usize },
    /// The client said goodbye (Terminate).
    Terminate,
    /// A message no client may send here.
    Violation(&'static str),
}

impl Requests {
    /// `buf`: what the client sent right behind its login.
    pub fn new(buf: BytesMut, max_message: usize) -> Requests {
        Requests {
            buf,
            spare: BytesMut::new(),
            pass: 0,
            drop: 0,
            skipping: false,
            max_message,
        }
    }

    /// Where the driver reads client bytes into.
    pub fn buf_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }

    /// The buffer with a [`Request::Frame`] at its head, taken out so the frame can be read in
    /// place while the driver handles it (no copy, no cut). Bytes the client sends meanwhile
    /// (read while a checkout or an admission waits) land in a stand-in buffer here.
    #[inline(always)]
    pub fn hold(&mut self) -> BytesMut {
        let stand_in = std::mem::take(&mut self.spare);
        std::mem::replace(&mut self.buf, stand_in)
    }

    /// Puts back what [`Requests::hold`] took, without its first `used` bytes (the frame,
    /// handled), followed by whatever arrived while it was held. The stand-in is kept for the
    /// next hold unless a burst made it large.
    #[inline(always)]
    pub fn give_back(&mut self, mut held: BytesMut, used: usize) {
        held.advance(used);
        let mut stand_in = std::mem::replace(&mut self.buf, held);
        if !stand_in.is_empty() {
            self.buf.extend_from_slice(&stand_in);
            stand_in.clear();
        }
        if stand_in.capacity() <= SPARE_MAX {
            self.spare = stand_in;
        }
    }

    /// `limits.max_message_bytes` at session start.
    pub fn max_message(&self) -> usize {
        self.max_message
    }

    /// Client bytes wait to be framed.
    pub fn has_buffered(&self) -> bool {
        !self.buf.is_empty()
    }

    /// A request of an extended batch was refused: drop the rest of the batch.
    pub fn skip_until_sync(&mut self) {
        self.skipping = true;
    }

    /// Dropping a refused batch until its Sync.
    pub fn skipping(&self) -> bool {
        self.skipping
    }

    /// Handles buffered client messages until one needs the driver. `attached`: a backend is
    /// attached (COPY and Flush messages go to it, else nowhere); `txn`: the transaction
    /// status a ReadyForQuery written here reports. A malformed frame is an error.
    #[inline(always)]
    pub fn next(
        &mut self,
        attached: bool,
        txn: u8,
        out: &mut Outbox,
        client: &mut BytesMut,
    ) -> Result<Request, FrameError> {
        loop {
            if self.pass > 0 {
                let take = self.pass.min(self.buf.len());
                if take == 0 {
                    return Ok(Request::Read);
                }
                out.pass(&self.buf[..take]);
                self.buf.advance(take);
                self.pass -= take;
                continue;
            }
            if self.drop > 0 {
                let take = self.drop.min(self.buf.len());
                if take == 0 {
                    return Ok(Request::Read);
                }
                self.buf.advance(take);
                self.drop -= take;
                continue;
            }
            let Some(h) = framing::header(&self.buf, Direction::Frontend)? else {
                return Ok(Request::Read);
            };
            if h.total > self.max_message
                && matches!(
                    h.tag,
                    frontend::QUERY | frontend::PARSE | frontend::BIND | frontend::FUNCTION_CALL
                )
            {
                // Refused before it is buffered: its bytes are dropped as they arrive.
                self.drop = h.total;
                if self.skipping {
                    continue;
                }
                return Ok(Request::TooLarge {
                    tag: h.tag,
                    total: h.total,
                });
            }
            if self.buf.len() < h.total {
                // Stream big CopyData through instead of buffering it whole (see below on
                // why the backend need not have entered COPY yet).
                if h.tag == frontend::COPY_DATA && attached && !self.skipping {
                    out.pass(&self.buf);
                    self.pass = h.total - self.buf.len();
                    self.buf.clear();
                }
                return Ok(Request::Read);
            }
            if self.skipping {
                match h.tag {
                    frontend::SYNC => {
                        self.skipping = false;
                        messages::ready_for_query(client, txn);
                    }
                    frontend::TERMINATE => {
                        self.buf.advance(h.total);
                        return Ok(Request::Terminate);
                    }
                    _ => {}
                }
                self.buf.advance(h.total);
                continue;
            }
            match h.tag {
                frontend::TERMINATE => {
                    self.buf.advance(h.total);
                    return Ok(Request::Terminate);
                }
                frontend::PASSWORD => {
                    self.buf.advance(h.total);
                    return Ok(Request::Violation(
                        "unexpected password message after authentication",
                    ));
                }
                // COPY messages are forwarded whenever a backend is attached, COPY or not: a
                // client may send its CopyData right behind `COPY … FROM STDIN`, before the
                // server's CopyInResponse has come back (pgx does), and the server reads them in
                // order. Outside COPY, Postgres ignores them itself; with no backend we do.
                // Flush: no reply of its own.
                frontend::COPY_DATA
                | frontend::COPY_DONE
                | frontend::COPY_FAIL
                | frontend::FLUSH => {
                    if attached {
                        out.pass(&self.buf[..h.total]);
                    }
                    self.buf.advance(h.total);
                }
                tag => return Ok(Request::Frame { tag, len: h.total }),
            }
        }
    }
}

#[cfg(test)]
#[path = "requests_tests.rs"]
mod tests;
