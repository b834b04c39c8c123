//! The accept loop: client slots (with a clear 53300 above `max_client_conn`), a cap on
//! handshakes in progress, backoff when the process runs out of file descriptors, and the
//! graceful stop on shutdown.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;

use crate::app::App;
use crate::protocol::PgError;
use crate::session;

/// Counts a connected client for as long as it lives.
struct ClientSlot(Arc<App>);

impl Drop for ClientSlot {
    fn drop(&mut self) {
        self.0.stats.clients.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Accepts clients until shutdown, then waits for sessions up to `shutdown_timeout_ms`.
pub async fn serve(app: Arc<App>, listener: TcpListener) {
    let tasks = TaskTracker::new();
    let mut backoff = Duration::from_millis(5);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = app.shutdown.cancelled() => break,
        };
        let (sock, peer) = match accepted {
            Ok(x) => {
                backoff = Duration::from_millis(5);
                x
            }
            Err(e) => {
                // EMFILE/ENFILE and friends: wait instead of spinning on a ready listener.
                tracing::warn!(error = %e, backoff_ms = backoff.as_millis() as u64, "accept failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let _ = sock.set_nodelay(true);
        let max = app.config.load().limits.max_client_conn;
        let n = app.stats.clients.fetch_add(1, Ordering::Relaxed);
        let slot = ClientSlot(app.clone());
        app.stats.clients_total.fetch_add(1, Ordering::Relaxed);
        if n >= max {
            tasks.spawn(async move {
                let _slot = slot;
                let mut sock = sock;
                let mut out = BytesMut::new();
                PgError::too_many_clients(max).encode(&mut out);
                let _ = tokio::time::timeout(Duration::from_secs(1), sock.write_all(&out)).await;
            });
            continue;
        }
        let app2 = app.clone();
        tasks.spawn(async move {
            let _slot = slot;
            session::run(app2, sock, peer).await;
        });
    }
    drop(listener);
    tasks.close();
    let grace = Duration::from_millis(app.config.load().limits.shutdown_timeout_ms);
    if tokio::time::timeout(grace, tasks.wait()).await.is_err() {
        tracing::warn!(
            remaining = tasks.len(),
            "shutdown timeout reached; closing remaining sessions"
        );
    }
}
