//! A session of an `admin.console` database: the logged-in client talks to the proxy's
//! admin console (`crate::app::Console`, set by the admin API) instead of to PostgreSQL.
//!
//! This file owns the console session's protocol: who may stay (a user of
//! `admin.console.admin_users` or `stats_users`, else FATAL 28000 after authentication, so
//! the refusal does not tell an unauthenticated client who the console users are), its
//! greeting, and a loop of simple Queries, each answered whole and followed by
//! ReadyForQuery. The extended protocol gets one 0A000 error per Sync block, as PgBouncer's
//! console only speaks simple Query. The session is registered like any client (so `SHOW
//! CLIENTS` lists it and an operator can end it) and ends when the drain begins. It never
//! borrows a backend or a pool.

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::handshake::Login;
use super::{Client, close, connection_line, send_error};
use crate::addr::ClientAddr;
use crate::app::{App, ConsoleClient};
use crate::clients::Order;
use crate::protocol::PgError;
use crate::protocol::framing::{self, Direction};
use crate::protocol::messages;
use crate::protocol::tag::{frontend, status};

/// What ends the loop.
enum Next {
    Read(std::io::Result<usize>),
    Terminated,
    Stopping,
}

/// Serves a console client from its login (`owed`: what its authentication earned it) to
/// its end.
pub(super) async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    app: Arc<App>,
    mut stream: Client<S>,
    mut buf: BytesMut,
    peer: ClientAddr,
    login: Login,
    mut out: BytesMut,
) {
    let cfg = app.config();
    let Some(role) = cfg.admin.console.role(&login.user) else {
        let e = PgError::fatal(
            "28000",
            format!(
                "pgsluice: user \"{}\" may not use the admin console (database \"{}\")",
                login.user, login.database
            ),
        )
        .with_hint(
            "console users are listed in admin.console.admin_users and admin.console.stats_users",
        );
        tracing::info!(%peer, user = %login.user, db = %login.database, "admin console login refused");
        send_error(&mut stream, out, &e).await;
        close(&mut stream).await;
        return;
    };
    let Some(console) = app.console.get().cloned() else {
        let e = PgError::fatal(
            "58000",
            "pgsluice: this process has no admin console (it runs without the admin API)",
        );
        send_error(&mut stream, out, &e).await;
        close(&mut stream).await;
        return;
    };
    let reg = super::register(&app, &login, peer, stream.is_tls());
    let app_name = login.application_name().unwrap_or("").to_owned();
    for (k, v) in [
        ("server_version", crate::app::CONSOLE_VERSION),
        ("server_encoding", "UTF8"),
        ("client_encoding", "UTF8"),
        ("DateStyle", "ISO"),
        ("TimeZone", "UTC"),
        ("integer_datetimes", "on"),
        ("standard_conforming_strings", "on"),
        ("application_name", app_name.as_str()),
    ] {
        messages::parameter_status(&mut out, k, v);
    }
    messages::backend_key_data(&mut out, reg.pid, reg.secret());
    messages::ready_for_query(&mut out, status::IDLE);
    if stream.write_all(&out).await.is_err() {
        return;
    }
    if connection_line(&app).is_some() {
        tracing::info!(target: "pgsluice::connections", %peer, user = %login.user, db = %login.database, ?role, "admin console login");
    }
    let who = ConsoleClient {
        user: login.user,
        database: login.database,
        role,
    };
    let entry = reg.entry.clone();
    // In an extended-protocol block that was refused: skip to its Sync.
    let mut skipping = false;
    loop {
        let mut answered = false;
        out.clear();
        loop {
            let header = match framing::complete(&buf, Direction::Frontend) {
                Ok(Some(h)) => h,
                Ok(None) => break,
                Err(e) => {
                    send_error(
                        &mut stream,
                        out,
                        &PgError::protocol_violation(e.to_string()),
                    )
                    .await;
                    close(&mut stream).await;
                    return;
                }
            };
            let frame = buf.split_to(header.total);
            let body = &frame[framing::HEADER_LEN..];
            match header.tag {
                frontend::QUERY => {
                    skipping = false;
                    match messages::query_body(body).map(std::str::from_utf8) {
                        Some(Ok(sql)) => out.extend_from_slice(&console.answer(&who, sql).await),
                        Some(Err(_)) => PgError::error(
                            "22021",
                            "pgsluice console: the query is not valid UTF-8",
                        )
                        .encode(&mut out),
                        None => {
                            send_error(
                                &mut stream,
                                out,
                                &PgError::protocol_violation("malformed Query message"),
                            )
                            .await;
                            close(&mut stream).await;
                            return;
                        }
                    }
                    messages::ready_for_query(&mut out, status::IDLE);
                    answered = true;
                }
                frontend::SYNC => {
                    skipping = false;
                    messages::ready_for_query(&mut out, status::IDLE);
                    answered = true;
                }
                frontend::TERMINATE => {
                    let _ = stream.write_all(&out).await;
                    close(&mut stream).await;
                    return;
                }
                frontend::FLUSH => {}
                _ if skipping => {}
                _ => {
                    skipping = true;
                    PgError::error(
                        "0A000",
                        "pgsluice console: the admin console speaks the simple query protocol \
                         only (as PgBouncer's does)",
                    )
                    .with_hint("send the command as a simple Query, e.g. psql -c 'SHOW POOLS'")
                    .encode(&mut out);
                    answered = true;
                }
            }
        }
        if answered && stream.write_all(&out).await.is_err() {
            return;
        }
        buf.reserve(4096);
        let next = {
            let read = stream.read_buf(&mut buf);
            tokio::pin!(read);
            std::future::poll_fn(|cx| {
                if let Poll::Ready(r) = read.as_mut().poll(cx) {
                    return Poll::Ready(Next::Read(r));
                }
                entry.wake.register(cx.waker());
                if entry.client.order() == Order::Terminate {
                    return Poll::Ready(Next::Terminated);
                }
                if app.life.is_stopping() {
                    return Poll::Ready(Next::Stopping);
                }
                Poll::Pending
            })
            .await
        };
        match next {
            Next::Read(Ok(0)) | Next::Read(Err(_)) => break,
            Next::Read(Ok(_)) => {
                // A Query bigger than the console has use for is refused, not buffered.
                if buf.len() > framing::SMALL_LIMIT * 10 {
                    let e = PgError::protocol_violation("console message too long");
                    send_error(&mut stream, BytesMut::new(), &e).await;
                    break;
                }
            }
            Next::Terminated => {
                send_error(
                    &mut stream,
                    BytesMut::new(),
                    &PgError::terminated_by_admin(),
                )
                .await;
                break;
            }
            Next::Stopping => {
                send_error(&mut stream, BytesMut::new(), &PgError::shutting_down()).await;
                break;
            }
        }
    }
    close(&mut stream).await;
    drop(reg);
}
