//! The listener connection of one pool: a server connection of its own (logged in like the
//! pool's, `application_name` `pgsluice listener`), outside `pool.size`, that `LISTEN`s to the
//! union of its clients' channels and fans each NotificationResponse out to their mailboxes.
//!
//! Owns: the connection's life — opened when the first channel is wanted, closed when none is,
//! reconnected with full-jitter exponential backoff (100 ms doubling to 5 s) when lost, and then
//! made to `LISTEN` the whole set again. It must not block a session: members only change the
//! registry and wake it.
//!
//! Losing the connection loses the notifications sent until it is back (Postgres queues them
//! for listening sessions only): every listening client is sent a NOTICE when the loss is seen
//! and another when listening resumes, so an application can re-read what it watches.

use std::collections::HashSet;
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{ListenSource, Shared, sql};
use crate::pool::backend::BackendConn;
use crate::protocol::PgError;
use crate::protocol::framing::{self, Direction};
use crate::protocol::tag::backend;

const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How often an idle listener checks that its pool still exists.
const POOL_CHECK: Duration = Duration::from_secs(30);
/// The `application_name` of listener connections (seen in `pg_stat_activity`).
pub const APPLICATION_NAME: &str = "pgsluice listener";

/// Why a connected listener stopped.
enum Stop {
    /// Nothing is wanted any more.
    Idle,
    /// The pool is gone (a reload removed it).
    PoolGone,
    /// The connection failed.
    Lost(String),
}

/// The listener task of a pool's hub: runs until the pool is dropped.
pub(super) async fn run(pool: Weak<dyn ListenSource>, shared: Arc<Shared>) {
    let mut failures = 0u32;
    let mut was_lost = false;
    loop {
        // Wait for something to listen to.
        loop {
            let notified = shared.changed.notified();
            if !shared.reg.lock().channels.is_empty() {
                break;
            }
            // Nothing wanted: everything asked for is trivially applied, and nobody is left
            // to tell that listening resumed.
            was_lost = false;
            let generation = shared.reg.lock().generation;
            shared.applied.send_replace(generation);
            if tokio::time::timeout(POOL_CHECK, notified).await.is_err() && pool.strong_count() == 0
            {
                return;
            }
        }
        let Some(p) = pool.upgrade() else { return };
        let mut params = (*p.connect_params()).clone();
        let name = p.name().to_owned();
        drop(p);
        params.startup.retain(|(k, _)| k != "application_name");
        params
            .startup
            .push(("application_name".into(), APPLICATION_NAME.into()));
        // The channel names the listener sends are UTF-8.
        params.startup.retain(|(k, _)| k != "client_encoding");
        params
            .startup
            .push(("client_encoding".into(), "UTF8".into()));
        match BackendConn::connect(&params, 0).await {
            Ok(conn) => {
                tracing::debug!(pool = %name, pid = conn.pid, "listener connected");
                let mut synced = false;
                match serve(conn, &shared, &pool, was_lost, &mut synced).await {
                    Stop::Idle => {
                        was_lost = false;
                        failures = 0;
                        continue;
                    }
                    Stop::PoolGone => return,
                    Stop::Lost(why) => {
                        tracing::warn!(pool = %name, error = %why, "listener connection lost; reconnecting");
                        if synced {
                            // It worked for a while: the next attempt starts from the bottom.
                            failures = 0;
                        }
                        if !was_lost {
                            announce(&shared, LOST);
                        }
                        was_lost = true;
                    }
                }
            }
            Err(e) => {
                tracing::warn!(pool = %name, error = %e, "listener could not connect");
            }
        }
        // Backoff after every failure, a lost connection included: a server that accepts and
        // then drops the listener must not see a reconnect loop.
        failures = failures.saturating_add(1);
        let cap = BACKOFF_FIRST
            .saturating_mul(1 << failures.min(6))
            .min(BACKOFF_MAX);
        tokio::time::sleep(cap.mul_f64(rand::random::<f64>())).await;
    }
}

const LOST: &str = "pgsluice: the connection that listens for notifications was lost; \
                    notifications sent until it is restored are lost";
const RESUMED: &str = "pgsluice: listening for notifications again; those sent while the \
                       connection was down were lost";

/// Sends every listening client a NOTICE (01000) saying `what`.
fn announce(shared: &Shared, what: &str) {
    let mut msg = BytesMut::new();
    PgError::error("01000", what).encode_notice(&mut msg);
    let msg = msg.freeze();
    for m in shared.reg.lock().all_mailboxes() {
        m.push(msg.clone());
    }
}

/// Keeps one connection's `LISTEN` set equal to the registry's and fans out what arrives.
/// `synced` is set once the set was first applied; `resumed` sends the NOTICE of a listener
/// back after a loss at that point.
async fn serve(
    mut conn: BackendConn,
    shared: &Shared,
    pool: &Weak<dyn ListenSource>,
    resumed: bool,
    synced: &mut bool,
) -> Stop {
    let mut active: HashSet<String> = HashSet::new();
    let mut buf = BytesMut::with_capacity(8 * 1024);
    loop {
        let notified = shared.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let (wanted, generation) = {
            let reg = shared.reg.lock();
            let wanted: HashSet<String> = reg.channels.keys().cloned().collect();
            (wanted, reg.generation)
        };
        if wanted.is_empty() {
            let _ = conn.stream.write_all(b"X\0\0\0\x04").await;
            shared.applied.send_replace(generation);
            return Stop::Idle;
        }
        let mut stmts = String::new();
        for ch in wanted.difference(&active) {
            stmts.push_str(&format!("LISTEN {};", sql::quote(ch)));
        }
        for ch in active.difference(&wanted) {
            stmts.push_str(&format!("UNLISTEN {};", sql::quote(ch)));
        }
        if !stmts.is_empty() {
            if let Err(why) = sync(&mut conn, &stmts, &mut buf, shared).await {
                return Stop::Lost(why);
            }
            active = wanted;
        }
        shared.applied.send_replace(generation);
        if !*synced {
            *synced = true;
            if resumed {
                announce(shared, RESUMED);
            }
        }
        // Wait for a change, a notification, or the pool check.
        loop {
            tokio::select! {
                _ = notified.as_mut() => break,
                r = conn.stream.read_buf(&mut buf) => match r {
                    Ok(0) => return Stop::Lost("server closed the connection".into()),
                    Err(e) => return Stop::Lost(e.to_string()),
                    Ok(_) => {
                        if let Err(why) = drain(&mut buf, shared, None) {
                            return Stop::Lost(why);
                        }
                    }
                },
                _ = tokio::time::sleep(POOL_CHECK) => {
                    if pool.strong_count() == 0 {
                        return Stop::PoolGone;
                    }
                }
            }
        }
    }
}

/// Sends `stmts` as one Query and reads to its ReadyForQuery, fanning out notifications that
/// arrive meanwhile.
async fn sync(
    conn: &mut BackendConn,
    stmts: &str,
    buf: &mut BytesMut,
    shared: &Shared,
) -> Result<(), String> {
    let mut out = BytesMut::new();
    crate::protocol::messages::query(&mut out, stmts);
    conn.stream
        .write_all(&out)
        .await
        .map_err(|e| e.to_string())?;
    let mut status = Ok(false);
    loop {
        let ready = drain(buf, shared, Some(&mut status))?;
        if ready {
            return status.map(|_| ());
        }
        match conn.stream.read_buf(buf).await {
            Ok(0) => return Err("server closed the connection".into()),
            Err(e) => return Err(e.to_string()),
            Ok(_) => {}
        }
    }
}

/// Handles every whole message in `buf`: notifications go to their channel's mailboxes; an
/// ErrorResponse is recorded in `status` (or fails the connection outside a request); `true`
/// when a ReadyForQuery was read (the rest stays in `buf`).
fn drain(
    buf: &mut BytesMut,
    shared: &Shared,
    mut status: Option<&mut Result<bool, String>>,
) -> Result<bool, String> {
    loop {
        let h = match framing::complete(buf, Direction::Backend) {
            Ok(Some(h)) => h,
            Ok(None) => return Ok(false),
            Err(e) => return Err(e.to_string()),
        };
        let frame: Bytes = buf.split_to(h.total).freeze();
        let body = &frame[framing::HEADER_LEN..];
        match h.tag {
            backend::NOTIFICATION => {
                if let Some(channel) = notification_channel(body) {
                    let boxes = shared.reg.lock().mailboxes(channel);
                    for m in boxes {
                        m.push(frame.clone());
                    }
                }
            }
            backend::ERROR_RESPONSE => {
                let why = format!(
                    "listener statement failed: {}",
                    crate::protocol::error::field_of(body, b'M').unwrap_or_default()
                );
                match status.as_deref_mut() {
                    Some(s) => *s = Err(why),
                    None => return Err(why),
                }
            }
            backend::READY_FOR_QUERY if status.is_some() => return Ok(true),
            _ => {}
        }
    }
}

/// The channel of a NotificationResponse body (pid, channel, payload).
fn notification_channel(body: &[u8]) -> Option<&str> {
    let rest = body.get(4..)?;
    let end = rest.iter().position(|&c| c == 0)?;
    std::str::from_utf8(&rest[..end]).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_channel_is_read_from_a_notification() {
        let mut body = 42i32.to_be_bytes().to_vec();
        body.extend_from_slice(b"Mixed Ch\0payload\0");
        assert_eq!(notification_channel(&body), Some("Mixed Ch"));
        assert_eq!(notification_channel(b"\0\0"), None);
        assert_eq!(notification_channel(b"\0\0\0\x01nonul"), None);
    }
}
