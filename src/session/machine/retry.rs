//! Transparent re-prepare after DDL: Postgres answers a cached statement whose result type
//! changed with 0A000 "cached plan must not change result type". When that happens to a batch
//! that started with the Bind of a named statement outside a transaction block (so nothing
//! ran and nothing is aborted), the proxy hides the error, re-prepares the statement and
//! replays the batch once — but only when the batch itself carries a Describe, so the client
//! learns the new row shape along with the rows. A driver relying on a description from an
//! earlier round trip (tokio-postgres, pgx) gets the 0A000 as Postgres sends it, because rows
//! of a shape it did not ask for would be worse than the error.

use crate::protocol::error::{field_of, sqlstate_of};
use crate::protocol::framing;
use crate::protocol::messages;
use crate::protocol::tag::{backend, frontend, status, target};

use super::super::tracker::{Expect, Kind, Mode};
use super::SessionCore;
use super::statements::Server;

/// Most bytes of a batch we keep for a replay.
const MAX_RETRY_BYTES: usize = 64 * 1024;

/// A batch recorded for one possible replay.
#[derive(Default)]
pub(in crate::session) struct Retry {
    /// Client frames from the Bind through the Sync, one after another as they were sent.
    frames: Vec<u8>,
    /// Recording until the Sync.
    recording: bool,
    /// The error arrived: swallow replies until the batch's ReadyForQuery, then replay.
    armed: bool,
    /// Rows or other results already reached the client: no replay.
    spoiled: bool,
    /// The statement to re-prepare.
    hash: u64,
}

/// What the recorded batch makes of one backend message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::session) enum Filter {
    /// Not for the client: the batch will be replayed.
    Swallow,
    /// Goes to the client as usual; the batch stays replayable.
    Pass,
    /// Goes to the client; the batch is over (its ReadyForQuery) and is forgotten.
    Forget,
}

impl Retry {
    /// Looks at a backend message of the recorded batch.
    pub(in crate::session) fn filter(&mut self, tag: u8, body: &[u8]) -> Filter {
        if self.armed {
            return Filter::Swallow;
        }
        match tag {
            backend::ERROR_RESPONSE
                if !self.spoiled
                    && !self.recording
                    && self
                        .frames()
                        .any(|f| f.first() == Some(&frontend::DESCRIBE))
                    && sqlstate_of(body) == Some("0A000")
                    && field_of(body, b'M')
                        .is_some_and(|m| m.contains("cached plan must not change result type")) =>
            {
                self.armed = true;
                Filter::Swallow
            }
            backend::PARSE_COMPLETE
            | backend::BIND_COMPLETE
            | backend::CLOSE_COMPLETE
            | backend::NOTICE_RESPONSE
            | backend::PARAMETER_STATUS => Filter::Pass,
            backend::READY_FOR_QUERY => Filter::Forget,
            _ => {
                self.spoiled = true;
                Filter::Pass
            }
        }
    }

    /// The recorded frames, each whole (tag, length, body).
    fn frames(&self) -> impl Iterator<Item = &[u8]> {
        let mut rest = &self.frames[..];
        std::iter::from_fn(move || {
            let len = framing::header(rest, framing::Direction::Frontend)
                .ok()
                .flatten()?
                .total;
            let (f, tail) = rest.split_at_checked(len)?;
            rest = tail;
            Some(f)
        })
    }

    /// A batch recorded whole (Bind through Sync) for statement `hash`, as `retry_start` and
    /// `retry_record` leave it.
    #[cfg(test)]
    pub(in crate::session) fn recorded(hash: u64, frames: Vec<Vec<u8>>) -> Self {
        Retry {
            frames: frames.concat(),
            hash,
            ..Retry::default()
        }
    }
}

impl SessionCore {
    /// A Bind of a named statement opening a fresh batch: start recording.
    pub(in crate::session) fn retry_start(&mut self, hash: u64, frame: &[u8]) {
        if self.out.t.txn != status::IDLE || self.out.t.in_flight() {
            self.retry = None;
            return;
        }
        // Bind, Describe, Execute, Sync: one allocation for the usual batch.
        let mut frames = Vec::with_capacity(frame.len() + 64);
        frames.extend_from_slice(frame);
        self.retry = Some(Retry {
            frames,
            recording: true,
            hash,
            ..Retry::default()
        });
    }

    /// Records a client frame of the batch (only Describe/Execute/Flush/Sync qualify).
    pub(in crate::session) fn retry_record(&mut self, tag: u8, frame: &[u8]) {
        let Some(r) = self.retry.as_mut() else { return };
        if !r.recording {
            return;
        }
        let replayable = matches!(
            tag,
            frontend::DESCRIBE | frontend::EXECUTE | frontend::FLUSH | frontend::SYNC
        );
        if !replayable || r.frames.len() + frame.len() > MAX_RETRY_BYTES {
            self.retry = None;
            return;
        }
        r.frames.extend_from_slice(frame);
        if tag == frontend::SYNC {
            r.recording = false;
        }
    }

    /// The swallowed batch is over: re-prepare the statement on the backend whose
    /// statements `srv` holds, and send the batch again.
    pub(in crate::session) fn retry_replay(&mut self, srv: &mut Server<'_>) {
        let Some(r) = self.retry.take() else { return };
        tracing::debug!(statement = %format_args!("{:016x}", r.hash), "re-preparing after a result type change");
        // The stale plan's reply already forgot the statement; make sure, then re-prepare below.
        srv.forget_stale(r.hash);
        for f in r.frames() {
            let tag = f[0];
            let body = &f[framing::HEADER_LEN..];
            match tag {
                frontend::BIND => {
                    let Some(messages::Bind {
                        portal,
                        statement: stmt,
                        tail,
                    }) = messages::Bind::read(body)
                    else {
                        continue;
                    };
                    let server = self
                        .statements
                        .ensure(stmt, srv, &mut self.out)
                        .map(|(_, name)| name);
                    let e = Expect::new(Kind::Bind, Mode::Forward);
                    match server {
                        Some(s) => self
                            .out
                            .send_with(e, |buf| messages::bind_renamed(buf, portal, &s, tail)),
                        None => self.out.send(e, f),
                    }
                }
                frontend::DESCRIBE => {
                    let Some(target) = messages::Target::read(body) else {
                        continue;
                    };
                    if let messages::Target::Statement(name) = target {
                        let server = self
                            .statements
                            .ensure(name, srv, &mut self.out)
                            .map(|(_, name)| name);
                        let e = Expect::new(Kind::DescribeStmt, Mode::Forward);
                        match server {
                            Some(s) => self.out.send_with(e, |buf| {
                                messages::target(buf, frontend::DESCRIBE, target::STATEMENT, &s)
                            }),
                            None => self.out.send(e, f),
                        }
                    } else {
                        self.out
                            .send(Expect::new(Kind::DescribePortal, Mode::Forward), f);
                    }
                }
                frontend::EXECUTE => {
                    self.out.send(Expect::new(Kind::Execute, Mode::Forward), f);
                }
                frontend::SYNC => {
                    // The original Sync's ReadyForQuery was swallowed: same count.
                    self.out.send(Expect::new(Kind::Sync, Mode::Forward), f);
                }
                // Flush: no reply of its own.
                _ => self.out.pass(f),
            }
        }
    }
}
