//! One task per client: handshake, then a short loop that moves bytes between the client and
//! the backend it currently borrows.
//!
//! The loop waits on whichever side speaks next. Client frames are inspected (header, and the
//! bodies of Query/Parse/Bind/Describe/Close) and forwarded; backend frames are scanned for the
//! few types that carry protocol state and otherwise streamed through untouched. In
//! transaction mode the backend goes back to the pool at ReadyForQuery('I') with nothing
//! outstanding; in session mode it stays until the client leaves.

mod handshake;
pub mod params;
mod relay;
mod state;
mod tracker;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;

use crate::app::App;
use crate::cancel;
use crate::config::PoolMode;
use crate::pool::{Pool, Pooled};
use crate::protocol::PgError;
use crate::protocol::messages;

pub use handshake::Login;
use handshake::Start;
use relay::Relay;

/// Why a session ended (for logs).
#[derive(Debug)]
pub enum End {
    ClientClosed,
    Terminated,
    Error(PgError),
    BackendLost,
}

/// Runs a client connection to completion.
pub async fn run<S>(app: Arc<App>, mut stream: S, peer: SocketAddr)
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let mut buf = BytesMut::with_capacity(8 * 1024);
    let timeout = Duration::from_millis(app.config.load().limits.handshake_timeout_ms);
    let started = tokio::time::timeout(timeout, async {
        let start = handshake::startup(&app, &mut stream, &mut buf).await?;
        match start {
            Start::Cancelled => Ok(None),
            Start::Login(login) => {
                let pool = app.pool_for(&login.database, &login.user)?;
                let status = login_params(&pool, &login).await?;
                Ok(Some((login, pool, status)))
            }
        }
    })
    .await;
    let (login, pool, status) = match started {
        Ok(Ok(Some(x))) => x,
        Ok(Ok(None)) => return,
        Ok(Err(e)) => {
            tracing::debug!(%peer, error = %e, "startup failed");
            send_error(&mut stream, &e).await;
            return;
        }
        Err(_) => {
            let e = PgError::fatal("08P01", "pgsluice: startup or authentication timed out");
            send_error(&mut stream, &e).await;
            return;
        }
    };
    let reg = app.cancels.register(if login.minor >= 2 { 32 } else { 4 });
    let mut out = BytesMut::with_capacity(1024);
    for (k, v) in &status {
        messages::parameter_status(&mut out, k, v);
    }
    messages::backend_key_data(&mut out, reg.pid, &reg.secret);
    messages::ready_for_query(&mut out, b'I');
    if stream.write_all(&out).await.is_err() {
        return;
    }
    tracing::debug!(%peer, user = %login.user, db = %login.database, "client logged in");
    let relay = Relay::new(app.clone(), pool, login, reg.entry.clone(), buf, peer);
    let end = relay.run(&mut stream).await;
    match &end {
        End::Error(e) => {
            send_error(&mut stream, e).await;
            tracing::debug!(%peer, error = %e, "session ended with an error");
        }
        other => tracing::debug!(%peer, end = ?other, "session ended"),
    }
    drop(reg);
}

async fn send_error<S: AsyncWrite + Unpin>(stream: &mut S, e: &PgError) {
    let mut out = BytesMut::new();
    e.encode(&mut out);
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(&out)).await;
}

/// The ParameterStatus list for a new client: the server's values, with the client's own
/// startup settings as the server reports them. Learns the server's spelling once per value
/// (one round trip on a pooled backend), then answers from the pool's cache.
async fn login_params(pool: &Arc<Pool>, login: &Login) -> Result<Vec<(String, String)>, PgError> {
    let mut known = pool.server_params();
    let all_known = known.is_some()
        && login
            .settings
            .iter()
            .all(|(k, v)| pool.canonical(k, v).is_some());
    if !all_known {
        let deadline = Instant::now() + Duration::from_millis(pool.cfg.checkout_timeout_ms);
        let mut b = pool
            .checkout(2, deadline)
            .await
            .map_err(|e| e.to_pg(&pool.name).into_fatal())?;
        learn_settings(&mut b, pool, login).await?;
        b.release().await;
        known = pool.server_params();
    }
    let mut status = known.unwrap_or_default();
    for (k, v) in &login.settings {
        let Some(reported) = pool.canonical(k, v) else {
            continue;
        };
        // An empty string marks a setting the server does not report.
        if reported.is_empty() && k != "application_name" {
            continue;
        }
        match status.iter_mut().find(|(n, _)| n.eq_ignore_ascii_case(k)) {
            Some(slot) => slot.1 = reported,
            None => status.push((k.clone(), reported)),
        }
    }
    Ok(status)
}

/// Applies the client's settings on `b`, recording how the server reports each of them.
async fn learn_settings(b: &mut Pooled, pool: &Pool, login: &Login) -> Result<(), PgError> {
    let conn = b.conn();
    let Some(sql) = params::apply_sql(&conn.applied, &login.settings) else {
        for (k, v) in &login.settings {
            let reported = conn
                .server_params
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(k))
                .map(|(_, r)| r.clone())
                .unwrap_or_default();
            pool.learn_canonical(k, v, &reported);
        }
        return Ok(());
    };
    let mut out = BytesMut::new();
    messages::query(&mut out, &sql);
    let io = |e: std::io::Error| PgError::backend_unavailable(e, 100).into_fatal();
    conn.stream.write_all(&out).await.map_err(io)?;
    let mut buf = BytesMut::new();
    let mut reported: Vec<(String, String)> = Vec::new();
    let mut error = None;
    loop {
        let (tag, body) = crate::pool::backend::read_message(&mut conn.stream, &mut buf)
            .await
            .map_err(|e| PgError::backend_unavailable(e, 100).into_fatal())?;
        match tag {
            b'S' => {
                let mut parts = body.split(|&c| c == 0);
                if let (Some(n), Some(v)) = (parts.next(), parts.next()) {
                    reported.push((
                        String::from_utf8_lossy(n).into_owned(),
                        String::from_utf8_lossy(v).into_owned(),
                    ));
                }
            }
            b'E' => {
                let code = crate::protocol::error::sqlstate_of(&body).unwrap_or("22023");
                let msg = crate::protocol::error::field_of(&body, b'M')
                    .unwrap_or("invalid startup parameter");
                error = Some(PgError::fatal(static_code(code), msg.to_string()));
            }
            b'Z' => break,
            _ => {}
        }
    }
    if let Some(e) = error {
        // The backend is fine (the failed SELECT left nothing behind); the client is not.
        return Err(e);
    }
    conn.applied = login.settings.clone();
    for (k, v) in &login.settings {
        let r = reported
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(k))
            .map(|(_, r)| r.clone())
            .unwrap_or_default();
        pool.learn_canonical(k, v, &r);
    }
    Ok(())
}

/// SQLSTATEs we pass through from a failed startup setting.
fn static_code(code: &str) -> &'static str {
    match code {
        "42704" => "42704",
        "22023" => "22023",
        "42501" => "42501",
        "3F000" => "3F000",
        _ => "22023",
    }
}

impl PgError {
    /// The same error, but ending the connection.
    pub fn into_fatal(mut self) -> Self {
        self.severity = crate::protocol::error::Severity::Fatal;
        self
    }
}

/// Sets (or clears) where this client's cancel requests go.
async fn set_cancel_target(entry: &cancel::Entry, b: Option<&mut Pooled>) {
    let t = b.map(|b| {
        let c = b.conn();
        cancel::Target {
            addr: c.addr,
            pid: c.pid,
            secret: c.secret.clone(),
        }
    });
    entry.set(t).await;
}

/// Reads from the client while it waits for something else, so a client that hangs up is
/// noticed at once. Returns false when the client is gone.
async fn client_alive<S: AsyncRead + Unpin>(client: &mut S, buf: &mut BytesMut) -> bool {
    const MAX_BUFFERED: usize = 1 << 20;
    if buf.len() >= MAX_BUFFERED {
        std::future::pending::<()>().await;
    }
    !matches!(client.read_buf(buf).await, Ok(0) | Err(_))
}

fn pool_mode(pool: &Pool) -> PoolMode {
    pool.mode()
}
