//! The accept loop: client slots (with a clear 53300 above `max_client_conn`), a cap on
//! handshakes in progress (53300 above `max_handshakes`, or above the client address's
//! `max_handshakes_per_address`, the DETAIL naming which), backoff and rate-limited warnings
//! when the process runs out of file descriptors, and the graceful stop on shutdown: the
//! listener closes at once, sessions finish their transactions for up to
//! `shutdown_timeout_ms`, then `force` cancels what still runs and the stragglers get a short
//! moment to tell their clients (57P01). Also binds the client listener, with SO_REUSEPORT
//! when several instances share the port. With a login runtime, accepted connections are
//! refused or logged in there (the accept itself stays here, with the sessions).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::BytesMut;
use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::app::App;
use crate::protocol::PgError;
use crate::session::{self, HandshakeSlot};

/// Counts a connected client for as long as it lives.
struct ClientSlot(Arc<App>);

impl Drop for ClientSlot {
    fn drop(&mut self) {
        self.0.stats.clients.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Accept errors come in floods (EMFILE until a descriptor frees up, then again at once): at
/// most one warning per [`ACCEPT_WARN_EVERY`], saying how many failures it stands for, whatever
/// the backoff was reset to by the accepts that succeeded in between.
#[derive(Default)]
struct AcceptWarnings {
    /// When the last warning went out.
    last: Option<Instant>,
    /// Failures since then, reported with the next warning.
    suppressed: u64,
}

const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(5);

impl AcceptWarnings {
    /// Notes one failure; true when it was logged.
    fn failed(&mut self, e: &std::io::Error, backoff: Duration) -> bool {
        let now = Instant::now();
        if self.last.is_some_and(|t| now < t + ACCEPT_WARN_EVERY) {
            self.suppressed += 1;
            return false;
        }
        tracing::warn!(
            error = %e,
            backoff_ms = backoff.as_millis() as u64,
            suppressed = self.suppressed,
            "accept failed"
        );
        self.last = Some(now);
        self.suppressed = 0;
        true
    }
}

/// Binds the client listener. With `reuseport`, SO_REUSEPORT and SO_REUSEADDR are set before
/// `bind`, so instances of the same user can listen on one address and the kernel spreads
/// new connections over them; a stopping instance closes its listener and the others carry on
/// (Linux moves its not-yet-accepted connections over only with `net.ipv4.tcp_migrate_req=1`).
/// Either way the accept queue is `LISTEN_BACKLOG` long (std's `bind` asks for 128, which drops
/// SYNs in a connect storm while the accept loop is backing off).
pub fn bind(addr: SocketAddr, reuseport: bool) -> std::io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    // As std does: a restarted proxy can bind while old connections sit in TIME_WAIT.
    socket.set_reuse_address(true)?;
    if reuseport {
        socket.set_reuse_port(true)?;
    }
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    socket.set_nonblocking(true)?;
    TcpListener::from_std(socket.into())
}

/// The accept queue length asked of the kernel (tokio's own default; capped by somaxconn).
const LISTEN_BACKLOG: i32 = 1024;

/// Accepts clients until shutdown, then waits for sessions up to `shutdown_timeout_ms`.
/// With `login`, new connections are refused or logged in on that runtime and their
/// sessions handed back to this one (see [`session::Handover`]).
pub async fn serve(app: Arc<App>, listener: TcpListener, login: Option<tokio::runtime::Handle>) {
    let tasks = TaskTracker::new();
    let handover = match &login {
        Some(_) => session::Handover::to(tasks.clone(), tokio::runtime::Handle::current()),
        None => session::Handover::default(),
    };

    let mut backoff = Duration::from_millis(5);
    let mut warnings = AcceptWarnings::default();
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
                warnings.failed(&e, backoff);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let _ = sock.set_nodelay(true);
        let max = app.config().limits.max_client_conn;
        let n = app.stats.clients.fetch_add(1, Ordering::Relaxed);
        let slot = ClientSlot(app.clone());
        app.stats.clients_total.fetch_add(1, Ordering::Relaxed);
        if n >= max {
            let e = PgError::too_many_clients(max, app.policy.connection_hint_ms(None));
            spawn(&tasks, login.as_ref(), refuse(slot, sock, e));
            continue;
        }
        let app2 = app.clone();
        let handover = handover.clone();
        // The wait for a handshake slot (bounded by the handshake timeout) runs in the
        // connection's own task: accepting never waits.
        let timeout = Duration::from_millis(app.config().limits.handshake_timeout_ms);
        let deadline = tokio::time::Instant::now() + timeout;
        spawn(&tasks, login.as_ref(), async move {
            match HandshakeSlot::acquire(&app2, peer.ip(), deadline).await {
                Ok(h) => session::run(app2, sock, peer, h, handover, slot).await,
                Err(e) => refuse(slot, sock, e).await,
            }
        });
    }
    drop(listener);
    tasks.close();
    let grace = Duration::from_millis(app.config().limits.shutdown_timeout_ms);
    if tokio::time::timeout(grace, tasks.wait()).await.is_err() {
        tracing::warn!(
            remaining = tasks.len(),
            "shutdown timeout reached; cancelling what still runs"
        );
        app.force_stop();
        if tokio::time::timeout(FORCE_GRACE, tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(remaining = tasks.len(), "closing remaining sessions");
        }
    }
}

/// Accepts CancelRequests passed on by peer instances on this instance's own `peer_listen`
/// address, until the process exits (a draining instance still owns its sessions' keys).
/// Anything but one well-formed CancelRequest is closed unanswered; at most
/// `PEER_CONNECTIONS` are handled at once and each gets `PEER_READ_TIMEOUT`.
pub async fn serve_peer_cancels(app: Arc<App>, listener: TcpListener) {
    let slots = Arc::new(tokio::sync::Semaphore::new(PEER_CONNECTIONS));
    loop {
        let mut sock = match listener.accept().await {
            Ok((sock, _)) => sock,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            continue; // dropped: closed at once
        };
        let app = app.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let read = tokio::time::timeout(PEER_READ_TIMEOUT, read_cancel(&mut sock)).await;
            if let Ok(Some((pid, secret))) = read {
                let peers = app.cancel_peers(&app.config());
                // Passed on by a peer, which charged the sender's address already.
                app.cancels.cancel(pid, &secret, &peers, None).await;
            }
        });
    }
}

const PEER_CONNECTIONS: usize = 64;
const PEER_READ_TIMEOUT: Duration = Duration::from_secs(2);

/// One CancelRequest (protocol 3.0 or 3.2 key lengths) from `sock`, or `None`.
async fn read_cancel(sock: &mut tokio::net::TcpStream) -> Option<(i32, Vec<u8>)> {
    use tokio::io::AsyncReadExt;
    let mut len = [0u8; 4];
    sock.read_exact(&mut len).await.ok()?;
    let len = crate::protocol::messages::startup_len(len).ok()?;
    let mut body = vec![0u8; len - 4];
    sock.read_exact(&mut body).await.ok()?;
    match crate::protocol::messages::parse_startup(&body) {
        Ok(crate::protocol::messages::StartupPacket::Cancel { pid, secret }) => Some((pid, secret)),
        _ => None,
    }
}

/// Runs a new connection's task on the login runtime when there is one, else here.
fn spawn<F>(tasks: &TaskTracker, login: Option<&tokio::runtime::Handle>, fut: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    match login {
        Some(h) => drop(tasks.spawn_on(fut, h)),
        None => drop(tasks.spawn(fut)),
    }
}

/// After `force`: how long sessions get to cancel their queries and send 57P01.
const FORCE_GRACE: Duration = Duration::from_secs(2);

/// Tells a client it cannot be served now, and closes. The client slot is held until then.
async fn refuse(slot: ClientSlot, mut sock: tokio::net::TcpStream, e: PgError) {
    let _slot = slot;
    let mut out = BytesMut::new();
    e.encode(&mut out);
    let _ = tokio::time::timeout(Duration::from_secs(1), sock.write_all(&out)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn accept_warnings_are_rate_limited() {
        let e = std::io::Error::from_raw_os_error(24);
        let mut w = AcceptWarnings::default();
        let backoff = Duration::from_millis(5);
        assert!(w.failed(&e, backoff), "the first failure is logged");
        for _ in 0..1000 {
            assert!(!w.failed(&e, backoff));
        }
        tokio::time::advance(ACCEPT_WARN_EVERY - Duration::from_millis(1)).await;
        assert!(!w.failed(&e, backoff));
        assert_eq!(w.suppressed, 1001);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(w.failed(&e, backoff), "one warning per interval");
        assert_eq!(w.suppressed, 0);
    }
}
