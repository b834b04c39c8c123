//! Putting a server session back as the next client needs it, where the relay cannot do it
//! in line: a backend whose client vanished mid-work is drained, rolled back and only then
//! pooled ([`Cleanup`]), and a change of who the client runs as is applied and confirmed
//! before its statement goes ([`apply_identity`]). The resets between clients after an
//! ordinary release are the pool's own (`Pooled::release_at`, `verify`).

use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::protocol::{PgError, messages, params};

use super::{BackendConn, ConnectError, Pooled};

/// Returns a backend to a clean, idle state after its client vanished mid-work: cancel what
/// runs, end COPY, drain owed replies, roll back, and only then pool it (else close it).
pub struct Cleanup {
    /// ReadyForQuery messages the server still owes (a pending Sync's included).
    pub pending_ready: usize,
    /// A statement runs: cancel it first.
    pub in_flight: bool,
    /// The client was sending COPY data: end it with CopyFail.
    pub copy_in: bool,
    /// An extended batch was sent without its Sync: send one.
    pub sync_pending: bool,
    /// The transaction status last reported (`I`, `T`, `E`).
    pub txn: u8,
    /// Bytes of a half-streamed message still to skip, and what was read after them.
    pub skip: usize,
    pub buffered: BytesMut,
    /// Session mode: the session is the client's own, so `DISCARD ALL` too.
    pub session_mode: bool,
}

impl Cleanup {
    /// Drains `b` (within 5 s), then pools it; on any failure or timeout it is closed.
    pub async fn run(self, mut b: Pooled) {
        let ok = tokio::time::timeout(Duration::from_secs(5), self.drain(&mut b)).await;
        match ok {
            Ok(Ok(())) => b.release().await,
            _ => b.discard(),
        }
    }

    async fn drain(&self, b: &mut Pooled) -> Result<(), ()> {
        let conn = b.conn();
        if self.in_flight && !self.copy_in {
            let _ = crate::cancel::send(&conn.cancel_target()).await;
        }
        let mut out = BytesMut::new();
        if self.copy_in {
            messages::raw(&mut out, b'f', &[b"client disconnected\0"]);
        }
        if self.sync_pending {
            messages::sync(&mut out);
        }
        if !out.is_empty() {
            conn.stream.write_all(&out).await.map_err(|_| ())?;
        }
        // Skip the rest of a half-streamed message, then read whole messages.
        let mut buf = self.buffered.clone();
        let mut skip = self.skip;
        while skip > 0 {
            if buf.is_empty() && conn.stream.read_buf(&mut buf).await.map_err(|_| ())? == 0 {
                return Err(());
            }
            let n = skip.min(buf.len());
            let _ = buf.split_to(n);
            skip -= n;
        }
        let mut txn = self.txn;
        let mut owed = self.pending_ready;
        while owed > 0 {
            let (tag, body) = super::backend::read_message(&mut conn.stream, &mut buf)
                .await
                .map_err(|_| ())?;
            if tag == b'Z' {
                owed -= 1;
                txn = body.first().copied().unwrap_or(b'I');
            }
        }
        if txn != b'I' && !matches!(conn.simple("ROLLBACK").await, Ok(b'I')) {
            return Err(());
        }
        if self.session_mode {
            if !matches!(conn.simple("DISCARD ALL").await, Ok(b'I')) {
                return Err(());
            }
            conn.prepared.clear();
            conn.applied = Default::default();
        }
        Ok(())
    }
}

/// Runs a settings re-apply that changes the client's identity and waits for its answer.
/// Refused by the server (a role the login user may no longer take), the client's statement
/// does not run as someone else: the session ends, as a login with that setting would be
/// refused (each statement would otherwise cost a backend). A lost connection is an error
/// the client may retry.
pub async fn apply_identity(
    conn: &mut BackendConn,
    statements: &[String],
    wait: Duration,
) -> Result<(), PgError> {
    let run = async {
        for sql in statements {
            conn.simple(sql).await?;
        }
        Ok::<_, ConnectError>(())
    };
    const WHAT: &str = "pgsluice: could not apply your session settings on a server connection";
    let why = match tokio::time::timeout(wait, run).await {
        Ok(Ok(())) => return Ok(()),
        Ok(Err(ConnectError::Server { code, message, .. })) => {
            let hint = "the server refused the role or session authorization this session \
                        runs as; reconnect";
            return Err(PgError::error(
                params::setting_error_code(&code),
                format!("{WHAT}: {message}"),
            )
            .with_hint(hint)
            .into_fatal());
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("no answer within {} ms", wait.as_millis()),
    };
    Err(PgError::error("08006", format!("{WHAT}: {why}")))
}
