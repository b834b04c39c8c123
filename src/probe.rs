//! The circuit breaker's health probe: a query the DBA provides (for example one returning
//! the database host's CPU %) run periodically on its own connection; its value feeds the
//! breaker, and a failing probe counts as a backend fault.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::AsyncWriteExt;

use crate::app::App;
use crate::pool::backend::{BackendConn, ConnectError, ConnectParams, read_message};
use crate::protocol::messages;

/// Runs until shutdown; idles while no `probe_sql` is configured (reload may add one).
pub async fn run(app: Arc<App>) {
    let mut conn: Option<BackendConn> = None;
    loop {
        let cfg = app.config.load_full();
        let b = &cfg.global_defaults.circuit_breaker;
        let interval = Duration::from_millis(b.probe_interval_ms.max(100));
        if let (Some(sql), Some(url)) = (b.probe_sql.clone(), cfg.backend_url()) {
            if conn.is_none() {
                let params = ConnectParams {
                    host: url.host,
                    port: url.port,
                    user: url.user,
                    password: url.password,
                    database: url.database,
                    connect_timeout: Duration::from_millis(cfg.backend.connect_timeout_ms),
                    tcp_user_timeout: cfg.backend.tcp_user_timeout(),
                    tls: app.tls.backend(),
                };
                match BackendConn::connect(&params, 1).await {
                    Ok(c) => conn = Some(c),
                    Err(e) => {
                        tracing::warn!(error = %e, "breaker probe cannot connect");
                        app.policy.record_backend_result(false);
                    }
                }
            }
            if let Some(c) = conn.as_mut() {
                match tokio::time::timeout(interval.max(Duration::from_secs(1)), scalar(c, &sql))
                    .await
                {
                    Ok(Ok(Some(v))) => app.policy.on_probe(v),
                    Ok(Ok(None)) => tracing::warn!("breaker probe returned no number"),
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "breaker probe failed");
                        app.policy.record_backend_result(false);
                        conn = None;
                    }
                    Err(_) => {
                        tracing::warn!("breaker probe timed out");
                        app.policy.record_backend_result(false);
                        conn = None;
                    }
                }
            }
        } else {
            conn = None;
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = app.shutdown.cancelled() => return,
        }
    }
}

/// Runs `sql` and returns the first column of the first row as a number.
async fn scalar(c: &mut BackendConn, sql: &str) -> Result<Option<f64>, ConnectError> {
    let mut out = BytesMut::new();
    messages::query(&mut out, sql);
    c.stream.write_all(&out).await?;
    let mut buf = BytesMut::new();
    let mut value = None;
    let mut error = None;
    loop {
        let (tag, body) = read_message(&mut c.stream, &mut buf).await?;
        match tag {
            b'D' if value.is_none() && body.len() >= 6 => {
                let n = i32::from_be_bytes([body[2], body[3], body[4], body[5]]);
                if n >= 0 && body.len() >= 6 + n as usize {
                    value = std::str::from_utf8(&body[6..6 + n as usize])
                        .ok()
                        .and_then(|s| s.trim().parse::<f64>().ok());
                }
            }
            b'E' => {
                error = Some(ConnectError::Protocol(
                    crate::protocol::error::field_of(&body, b'M')
                        .unwrap_or("probe query failed")
                        .to_string(),
                ));
            }
            b'Z' => break,
            _ => {}
        }
    }
    match error {
        Some(e) => Err(e),
        None => Ok(value),
    }
}
