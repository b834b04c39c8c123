//! Transaction mode's `LISTEN` / `UNLISTEN` without a backend (`crate::notify`): the relay
//! answers the statements itself and writes the client's notifications between its
//! statements.
//!
//! Owns: when a `LISTEN`/`UNLISTEN` Query is answered here, and the delivery of the client's
//! mailbox. It must not write to the client while a request is unanswered: a notification
//! goes out only when the client is between transactions with nothing in flight, unsent or
//! half-read (as Postgres sends one only outside a transaction block), so it always follows
//! a ReadyForQuery, and nothing else is written to the client while one is half written.
//!
//! Decisions:
//! - Answered here: a simple Query that is exactly one `LISTEN`, `UNLISTEN` or `UNLISTEN *`
//!   (`notify::sql`), in transaction mode, from a client not pinned to its backend whose
//!   `client_encoding` is UTF-8 (or unset: the listener reads UTF-8), with no transaction
//!   open and nothing in flight. It answers CommandComplete and ReadyForQuery('I'), after
//!   the listener confirmed a new channel on Postgres.
//! - Inside a transaction block `LISTEN`/`UNLISTEN` is refused (0A000, raised by Postgres so
//!   the transaction aborts as for any error): Postgres would apply it at COMMIT, on a backend
//!   this client does not keep.
//! - The extended protocol: a batch that only prepares, describes, binds, executes or closes
//!   such statements (`notify::batch`), up to its Sync or a Flush, is answered here whole
//!   under the same conditions; the statements it prepared are kept
//!   (`SessionCore::listen_statements`) for the driver's later Bind of them.
//! - Behind a request still in flight (a pipeline), from a pinned client, and anything the
//!   readers do not take (several statements, a batch with other work) goes to the backend
//!   as before, which pins; an `UNLISTEN` there also leaves the proxy's channels.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncWrite, AsyncWriteExt};

use crate::notify::batch::{self, Step};
use crate::notify::sql::{Channel, Command};
use crate::notify::{Member, Taken};
use crate::protocol::PgError;
use crate::protocol::messages;

use super::{End, Event, Relay};

/// Notification bytes moved out of the mailbox per write.
const WRITE_CHUNK: usize = 64 * 1024;
/// Most channels one client may listen on through the proxy (each costs the proxy a registry
/// entry and the listener a `LISTEN`).
const MAX_CHANNELS: usize = 10_000;
/// The shortest a `LISTEN` waits for the listener to confirm its channel.
const MIN_CONFIRM_WAIT: Duration = Duration::from_secs(5);

/// A listening session: its channels, and the notifications taken from its mailbox and not
/// yet written whole to the client.
pub(super) struct Listening {
    member: Member,
    pub(super) nout: BytesMut,
}

impl Relay {
    /// A `LISTEN`/`UNLISTEN` read by `notify::sql`: `Some` when answered (or refused) here,
    /// `None` when it goes to the backend as any statement.
    pub(super) async fn on_listen(&mut self, cmd: Command) -> Option<Result<(), End>> {
        let here = !self.core.pinned() && utf8_client(&self.login.settings);
        if !here {
            if let (Some(l), Command::Unlisten(_) | Command::UnlistenAll) = (&mut self.notify, &cmd)
            {
                let m = &mut l.member;
                match &cmd {
                    Command::Unlisten(ch) => m.unlisten(&ch.name),
                    _ => m.unlisten_all(),
                }
            }
            return None;
        }
        let between = !self.lease.attached() || self.core.between_units();
        if !between {
            if self.core.txn() == b'I' {
                // Behind a request in flight, whose outcome (a BEGIN?) is not known yet.
                return None;
            }
            return Some(self.refuse_statement(b'Q', listen_in_transaction(&cmd)));
        }
        Some(self.answer_listen(cmd).await)
    }

    async fn answer_listen(&mut self, cmd: Command) -> Result<(), End> {
        match self.run_listen(cmd).await {
            Ok(()) => {
                self.core.answer(|b| messages::ready_for_query(b, b'I'));
                Ok(())
            }
            Err(e) => self.core.refuse(b'Q', e),
        }
    }

    /// Registers or drops the client's channels for `cmd` and writes its CommandComplete
    /// (after the NOTICE of a name cut to length); `Err`: the refusal to send instead.
    async fn run_listen(&mut self, cmd: Command) -> Result<(), PgError> {
        let tag: &[u8] = match &cmd {
            Command::Listen(_) => b"LISTEN\0",
            _ => b"UNLISTEN\0",
        };
        match cmd {
            Command::Listen(ch) => {
                if let Some(l) = &self.notify
                    && l.member.channel_count() >= MAX_CHANNELS
                    && !l.member.listens(&ch.name)
                {
                    return Err(too_many_channels());
                }
                let pool = std::sync::Arc::clone(&self.pool);
                let l = self.notify.get_or_insert_with(|| {
                    Box::new(Listening {
                        member: pool.notify.join(&pool),
                        nout: BytesMut::new(),
                    })
                });
                let m = &mut l.member;
                let generation = m.listen(&ch.name);
                let wait = pool.connect_params().connect_timeout.max(MIN_CONFIRM_WAIT);
                if !m.applied(generation, wait).await {
                    m.unlisten(&ch.name);
                    return Err(listener_down(&ch.name));
                }
                self.core.answer(|b| truncation_notice(&ch, b));
            }
            Command::Unlisten(ch) => {
                if let Some(l) = &mut self.notify {
                    l.member.unlisten(&ch.name);
                }
                self.core.answer(|b| truncation_notice(&ch, b));
            }
            Command::UnlistenAll => {
                if let Some(l) = &mut self.notify {
                    l.member.unlisten_all();
                }
            }
        }
        self.core.answer(|b| messages::raw(b, b'C', &[tag]));
        Ok(())
    }

    /// An extended-protocol batch that only `LISTEN`s or `UNLISTEN`s (`notify::batch`),
    /// answered here under the same conditions as a simple one (transaction mode, not pinned,
    /// a UTF-8 client, no backend held, nothing in flight): the bytes of `buf` it took, or
    /// `None` when it goes on as any batch. `buf` starts at the batch's first message.
    pub(super) async fn on_listen_batch(&mut self, buf: &[u8]) -> Option<Result<usize, End>> {
        let here = self.core.pooled()
            && !self.lease.attached()
            && self.core.between_units()
            && utf8_client(&self.login.settings);
        if !here {
            return None;
        }
        let core = &self.core;
        let batch = batch::read(buf, |name| core.listen_statement(name))?;
        Some(self.answer_listen_batch(batch).await)
    }

    async fn answer_listen_batch(&mut self, b: batch::Batch<'_>) -> Result<usize, End> {
        for step in b.steps {
            match step {
                Step::Parse { name, cmd } => {
                    // The name now means this statement, for the proxy and not a backend.
                    self.core.keep_listen_statement(name, cmd);
                    self.core.answer(messages::parse_complete);
                }
                Step::DescribeStatement => {
                    self.core
                        .answer(|b| messages::raw(b, b't', &[&0u16.to_be_bytes()]));
                    self.core.answer(|b| messages::raw(b, b'n', &[]));
                }
                Step::DescribePortal => self.core.answer(|b| messages::raw(b, b'n', &[])),
                Step::Bind => self.core.answer(|b| messages::raw(b, b'2', &[])),
                Step::Execute(cmd) => {
                    if let Err(e) = self.run_listen(cmd).await {
                        // As Postgres: the rest of the batch is skipped up to its Sync.
                        if e.severity == crate::protocol::error::Severity::Fatal {
                            return Err(End::Error(e));
                        }
                        self.core.answer(|b| e.encode(b));
                        if !b.sync {
                            // Its Sync has not come yet: what comes before it is dropped.
                            self.core.skip_until_sync();
                            return Ok(b.len);
                        }
                        break;
                    }
                }
                Step::Close { statement } => {
                    if let Some(name) = statement {
                        self.core.forget_listen_statement(name);
                    }
                    self.core.answer(messages::close_complete);
                }
            }
        }
        if b.sync {
            self.core.answer(|b| messages::ready_for_query(b, b'I'));
        }
        Ok(b.len)
    }

    /// Writes what the client's mailbox holds while the client is between statements;
    /// `Ready` only for what ends the session (an overflowed mailbox, a failed write).
    /// Nothing else is written to the client while `nout` holds a half-written message
    /// (the event loop reads neither side meanwhile).
    pub(super) fn poll_notifications<S: AsyncWrite + Unpin>(
        &mut self,
        cx: &mut Context<'_>,
        client: &mut S,
    ) -> Poll<Event> {
        let Some(l) = &mut self.notify else {
            return Poll::Pending;
        };
        l.member.mailbox.register(cx);
        let between = self.core.replies_idle()
            && self.core.backend_out_empty()
            && self.core.to_client().is_empty()
            && !self.core.skipping();
        loop {
            if l.nout.is_empty() {
                if !between {
                    return Poll::Pending;
                }
                match l.member.mailbox.take(&mut l.nout, WRITE_CHUNK) {
                    Taken::Overflowed => return Poll::Ready(Event::NotifyOverflow),
                    Taken::Bytes(0) => {
                        let _ = Pin::new(&mut *client).poll_flush(cx);
                        return Poll::Pending;
                    }
                    Taken::Bytes(_) => {}
                }
            }
            match Pin::new(&mut *client).poll_write(cx, &l.nout) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Event::Client(Ok(0))),
                Poll::Ready(Ok(n)) => l.nout.advance(n),
                Poll::Ready(Err(e)) => return Poll::Ready(Event::Client(Err(e))),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl Relay {
    /// Writes the rest of a half-written notification before the session's last error
    /// (bounded: a client that does not read is being dropped anyway).
    pub(super) async fn finish_notification<S: AsyncWrite + Unpin>(&mut self, client: &mut S) {
        if let Some(l) = &mut self.notify
            && !l.nout.is_empty()
        {
            let _ = tokio::time::timeout(Duration::from_secs(1), client.write_all(&l.nout)).await;
            l.nout.clear();
        }
    }
}

/// Whether the client reads UTF-8 (what the listener connection receives).
fn utf8_client(settings: &[(String, String)]) -> bool {
    settings
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("client_encoding"))
        .is_none_or(|(_, v)| {
            let v: String = v
                .chars()
                .filter(|c| c.is_ascii_alphanumeric())
                .collect::<String>()
                .to_ascii_lowercase();
            v == "utf8" || v == "unicode"
        })
}

/// The NOTICE Postgres sends for a name longer than `NAMEDATALEN - 1`.
fn truncation_notice(ch: &Channel, out: &mut bytes::BytesMut) {
    if let Some(from) = &ch.truncated_from {
        PgError::error(
            "42622",
            format!("identifier \"{from}\" will be truncated to \"{}\"", ch.name),
        )
        .encode_notice(out);
    }
}

fn listen_in_transaction(cmd: &Command) -> PgError {
    let verb = match cmd {
        Command::Listen(_) => "LISTEN",
        _ => "UNLISTEN",
    };
    PgError::error(
        "0A000",
        format!(
            "pgsluice: ERR_SESSION_STATE: {verb} inside a transaction block is not supported \
             in transaction pooling mode"
        ),
    )
    .with_detail(
        "the proxy listens for this client on a connection of its own and cannot apply it at \
         COMMIT",
    )
    .with_hint(format!(
        "run {verb} outside a transaction block (autocommit), or use a session-mode pool"
    ))
}

fn too_many_channels() -> PgError {
    PgError::error(
        "54000",
        format!("pgsluice: a client may listen on at most {MAX_CHANNELS} channels"),
    )
    .with_hint("UNLISTEN channels no longer needed")
}

fn listener_down(channel: &str) -> PgError {
    PgError::error(
        "08006",
        format!(
            "pgsluice: LISTEN \"{channel}\" could not be registered: the proxy's listener \
             connection to the database is not up"
        ),
    )
    .with_hint("retry once the database is reachable")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(k: &str, v: &str) -> (String, String) {
        (k.to_owned(), v.to_owned())
    }

    #[test]
    fn only_utf8_clients_share_the_listener() {
        assert!(utf8_client(&[]));
        assert!(utf8_client(&[kv("client_encoding", "UTF8")]));
        assert!(utf8_client(&[kv("client_encoding", "utf-8")]));
        assert!(utf8_client(&[kv("client_encoding", "Unicode")]));
        assert!(!utf8_client(&[kv("client_encoding", "LATIN1")]));
        assert!(!utf8_client(&[kv("client_encoding", "SQL_ASCII")]));
    }
}
