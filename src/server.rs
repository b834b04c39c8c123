//! The accept loop: client slots (with a clear 53300 above `max_client_conn`), a cap on
//! handshakes in progress (53300 above `max_handshakes`, or above the client address's
//! `max_handshakes_per_address`, the DETAIL naming which), backoff and rate-limited warnings
//! when the process runs out of file descriptors, and the graceful stop on shutdown: the
//! listener closes at once, sessions finish their transactions for up to
//! `shutdown_timeout_ms`, then `force` cancels what still runs and the stragglers get a short
//! moment to tell their clients (57P01). Also binds the client listeners: TCP, with
//! SO_REUSEPORT when several instances share the port, and the Unix-domain socket in
//! `unix_socket_dir` (clients of both are served alike). With a login runtime, connections
//! beyond the first few logging in at once log in there, and their sessions come back to the
//! session runtime; during such a burst the listeners move there too ([`Accepting`]).

use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::BytesMut;
use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::addr::ClientAddr;
use crate::app::App;
use crate::protocol::PgError;
use crate::rehome::Movable;
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

/// The proxy's Unix-domain socket, `DIR/.s.PGSQL.PORT` (PgBouncer's `unix_socket_dir`), so
/// `psql -h DIR -p PORT` and drivers given a socket directory find it. The file is removed
/// when this is dropped (if it is still the one bound here).
pub struct UnixSocket {
    listener: UnixListener,
    file: SocketFile,
}

impl UnixSocket {
    pub fn path(&self) -> &Path {
        &self.file.path
    }
}

/// The socket file bound, removed when dropped if it is still that file.
struct SocketFile {
    path: PathBuf,
    /// Device and inode of the file bound here.
    id: (u64, u64),
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.id) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds `DIR/.s.PGSQL.PORT` with permissions `mode`. A socket file left by a process that
/// died is replaced; one a live server answers on, or a file that is not a socket, is an
/// error (nothing is deleted that might be someone else's).
pub fn bind_unix(dir: &Path, port: u16, mode: u32) -> std::io::Result<UnixSocket> {
    use std::io::{Error, ErrorKind};
    let path = crate::addr::socket_file(dir, port);
    if let Ok(meta) = std::fs::symlink_metadata(&path) {
        if !meta.file_type().is_socket() {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        match std::os::unix::net::UnixStream::connect(&path) {
            Ok(_) => {
                return Err(Error::new(
                    ErrorKind::AddrInUse,
                    format!("another server listens on {}", path.display()),
                ));
            }
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => std::fs::remove_file(&path)?,
            Err(e) => {
                return Err(Error::new(e.kind(), format!("{}: {e}", path.display())));
            }
        }
    }
    let listener = UnixListener::bind(&path)
        .map_err(|e| Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
    let meta = std::fs::symlink_metadata(&path)?;
    Ok(UnixSocket {
        listener,
        file: SocketFile {
            path,
            id: (meta.dev(), meta.ino()),
        },
    })
}

/// The accept queue length asked of the kernel (tokio's own default; capped by somaxconn).
const LISTEN_BACKLOG: i32 = 1024;

/// Where clients connect: the TCP listener, and the Unix-domain socket in `unix_socket_dir`
/// when one is configured.
pub struct Listeners {
    pub tcp: TcpListener,
    pub unix: Option<UnixSocket>,
    /// TCP keepalive idle time on accepted client sockets (`limits.client_tcp_keepalive_ms`,
    /// read at start); `None`: off.
    pub keepalive: Option<Duration>,
}

/// One accepted client connection.
enum Accepted {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl Listeners {
    /// The listeners registered with the current runtime's event loop instead of the one
    /// they were bound in (its thread is then the one woken by new connections).
    fn rehome(self) -> std::io::Result<Listeners> {
        let tcp = TcpListener::from_std(self.tcp.into_std()?)?;
        let unix = match self.unix {
            Some(u) => Some(UnixSocket {
                listener: UnixListener::from_std(u.listener.into_std()?)?,
                file: u.file,
            }),
            None => None,
        };
        Ok(Listeners {
            tcp,
            unix,
            keepalive: self.keepalive,
        })
    }

    async fn accept(&self) -> std::io::Result<(Accepted, ClientAddr)> {
        let unix = async {
            match &self.unix {
                Some(u) => u.listener.accept().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = self.tcp.accept() => r.map(|(s, a)| {
                let _ = s.set_nodelay(true);
                if let Some(idle) = self.keepalive {
                    // A client host that vanished (no FIN, no RST) is found by the kernel's
                    // probes, so its session and any backend it holds end.
                    let ka = socket2::TcpKeepalive::new()
                        .with_time(idle)
                        .with_interval(Duration::from_secs(10));
                    let _ = socket2::SockRef::from(&s).set_tcp_keepalive(&ka);
                }
                (Accepted::Tcp(s), ClientAddr::Tcp(a))
            }),
            r = unix => r.map(|(s, _)| (Accepted::Unix(s), ClientAddr::Unix)),
        }
    }
}

/// Accepts clients until shutdown, then waits for sessions up to `shutdown_timeout_ms`.
/// With `login` (a login runtime), a new connection logs in on the session thread while
/// fewer than [`INLINE_LOGINS`] do and client TLS is off, and otherwise on the login thread,
/// its session handed to the session thread once logged in (see [`session::Handover`]).
/// Accepting moves with a burst: while new connections are logging in on the login thread,
/// the listeners are there too (see [`Accepting`]). `Err`: the listeners could not move
/// (the sessions were drained as in a shutdown first).
pub async fn serve(
    app: Arc<App>,
    listeners: Listeners,
    login: Option<tokio::runtime::Handle>,
) -> std::io::Result<()> {
    let tasks = app.life.clients().clone();
    let mut failed = None;
    match login {
        None => {
            accept_loop(&app, &tasks, listeners, None).await;
        }
        Some(login) => {
            login.spawn(pacemaker());
            let sessions = tokio::runtime::Handle::current();
            let offload = Arc::new(Offload {
                handover: session::Handover::to(tasks.clone(), sessions.clone()),
                sessions,
                login,
            });
            let mut listeners = listeners;
            let mut on = Accepting::OnSessions;
            loop {
                let handle = match on {
                    Accepting::OnSessions => &offload.sessions,
                    Accepting::OnLogin => &offload.login,
                };
                let moved = {
                    let _there = handle.enter();
                    listeners.rehome()
                };
                listeners = match moved {
                    Ok(l) => l,
                    Err(e) => {
                        // No listener left: the sessions still finish as in a shutdown.
                        tracing::error!(error = %e, "cannot move the listeners; shutting down");
                        app.begin_shutdown();
                        failed = Some(e);
                        break;
                    }
                };
                let (app2, tasks2, o) = (Arc::clone(&app), tasks.clone(), Arc::clone(&offload));
                let phase = handle.spawn(async move {
                    accept_loop(&app2, &tasks2, listeners, Some((&o, on))).await
                });
                match phase.await {
                    Ok(Some(back)) => {
                        listeners = back;
                        on = on.other();
                        if on == Accepting::OnLogin {
                            app.stats.accept_moves.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    // Stopping (the listeners are closed), or the runtime is shutting down.
                    Ok(None) | Err(_) => break,
                }
            }
        }
    }
    let grace = Duration::from_millis(app.config().limits.shutdown_timeout_ms);
    app.life
        .drain(grace, FORCE_GRACE, || app.force_stop())
        .await;
    failed.map_or(Ok(()), Err)
}

/// Logins in progress on the session thread beyond which a new connection logs in on the
/// login thread. A login there costs no thread switch (the socket stays where it was
/// accepted), and a session waits behind at most this many logins' steps; a storm's
/// connections beyond it log in at the login thread's lower priority.
pub const INLINE_LOGINS: usize = 4;

/// A place to log in on the session thread: only while client TLS is off (a TLS handshake's
/// key exchange and signature cost from a tenth of a millisecond to a few of CPU: always the
/// login thread's), and while fewer than [`INLINE_LOGINS`] log in there.
fn inline_login(app: &Arc<App>) -> Option<session::InlineLogin> {
    if app.tls.client().acceptor.is_some() {
        return None;
    }
    session::InlineLogin::try_enter(app, INLINE_LOGINS)
}

/// The two runtimes a connection may log in on, and the way from the login runtime to the
/// session runtime for a session logged in there.
struct Offload {
    sessions: tokio::runtime::Handle,
    login: tokio::runtime::Handle,
    handover: session::Handover,
}

/// Where the listeners are: with the session thread's event loop while logins are few (a
/// connection that logs in there never changes thread: `pgbench -C` costs no hop), with
/// the login thread's during a burst — from the first connection sent to log in there
/// until none has been for [`BURST_CALM`] — so a reconnect storm's accepts wake the login
/// thread, at its lower priority, instead of the session thread (each accept of thousands
/// otherwise delays the statements of clients already served: a critical caller's p99 in
/// a storm of 1 500 logins was 10–23 ms with accepts on the session thread, 5–10 ms off it,
/// docs/BENCHMARKS.md). A move is two system calls per listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Accepting {
    OnSessions,
    OnLogin,
}

impl Accepting {
    fn other(self) -> Accepting {
        match self {
            Accepting::OnSessions => Accepting::OnLogin,
            Accepting::OnLogin => Accepting::OnSessions,
        }
    }
}

/// How long accepting stays on the login thread after the last connection sent to log in
/// there.
const BURST_CALM: Duration = Duration::from_secs(1);

/// Keeps a timer due within [`PACE`] on the login thread's timer wheel, for as long as the
/// runtime runs. Tokio wakes a parked runtime (a write to its eventfd, and one more turn of
/// its event loop) when a timer is set that is due before the runtime's next planned wake-up;
/// on a thread with no timer, that is the handshake deadline of every new connection. With
/// this one standing, a deadline further off than `PACE` is set without a wake-up: the login
/// thread wakes once per `PACE` instead of once more per login.
async fn pacemaker() {
    loop {
        tokio::time::sleep(PACE).await;
    }
}

const PACE: Duration = Duration::from_secs(1);

/// Accepts clients, each with a task of its own, until shutdown (`None`, the listeners
/// closed) or, with a login runtime, until accepting should move to the other runtime
/// (`Some`, the listeners to move: see [`Accepting`]).
async fn accept_loop(
    app: &Arc<App>,
    tasks: &TaskTracker,
    listeners: Listeners,
    offload: Option<(&Offload, Accepting)>,
) -> Option<Listeners> {
    let mut backoff = Duration::from_millis(5);
    let mut warnings = AcceptWarnings::default();
    // On the login thread: when to move back (a burst's last login there, plus the calm).
    let mut calm_at = Instant::now() + BURST_CALM;
    loop {
        let move_back = async {
            match offload {
                Some((_, Accepting::OnLogin)) => tokio::time::sleep_until(calm_at).await,
                _ => std::future::pending().await,
            }
        };
        let accepted = tokio::select! {
            r = listeners.accept() => r,
            _ = app.life.stopping() => break,
            _ = move_back => return Some(listeners),
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
        let to_login = match sock {
            Accepted::Tcp(s) => admit(app, tasks, offload, Movable::new(s), peer),
            Accepted::Unix(s) => admit(app, tasks, offload, Movable::new(s), peer),
        };
        match offload {
            Some((_, Accepting::OnSessions)) if to_login => return Some(listeners),
            Some((_, Accepting::OnLogin)) if to_login => calm_at = Instant::now() + BURST_CALM,
            _ => {}
        }
    }
    // The socket file goes with the listener: a client that finds none tries elsewhere.
    drop(listeners);
    None
}

/// Takes a client slot for a new connection (or refuses it above `max_client_conn`) and
/// starts its task, which waits for a handshake slot (bounded by the handshake timeout) and
/// runs the session: accepting never waits. The task runs on the session runtime when there
/// is no login runtime or it gets an [`inline_login`] place, else on the login runtime; its
/// socket moves there first if it was accepted on the other one. `true`: it went to the
/// login runtime.
fn admit<S>(
    app: &Arc<App>,
    tasks: &TaskTracker,
    offload: Option<(&Offload, Accepting)>,
    sock: S,
    peer: ClientAddr,
) -> bool
where
    S: AsyncRead + AsyncWrite + crate::rehome::Rehome + Unpin + Send + 'static,
{
    // Where the task runs (`None`: here), and the way to the session runtime after a
    // login on the login runtime.
    let (inline, to, handover) = match offload {
        None => (None, None, session::Handover::default()),
        Some((o, on)) => match inline_login(app) {
            Some(inline) => (
                Some(inline),
                (on == Accepting::OnLogin).then_some(&o.sessions),
                session::Handover::default(),
            ),
            None => {
                app.stats.offloaded_logins.fetch_add(1, Ordering::Relaxed);
                (
                    None,
                    (on == Accepting::OnSessions).then_some(&o.login),
                    o.handover.clone(),
                )
            }
        },
    };
    let to_login = offload.is_some() && inline.is_none();
    let max = app.config().limits.max_client_conn;
    let n = app.stats.clients.fetch_add(1, Ordering::Relaxed);
    let slot = ClientSlot(app.clone());
    app.stats.clients_total.fetch_add(1, Ordering::Relaxed);
    let app2 = app.clone();
    let timeout = Duration::from_millis(app.config().limits.handshake_timeout_ms);
    let deadline = tokio::time::Instant::now() + timeout;
    let moving = to.is_some();
    let task = async move {
        let mut sock = sock;
        // The socket joins the event loop of the thread it logs in on before anything is
        // read from it.
        if moving && let Err(e) = sock.rehome() {
            tracing::warn!(%peer, error = %e, "cannot move a new connection to another thread");
            return;
        }
        if n >= max {
            let e = PgError::too_many_clients(max, app2.policy.connection_hint_ms(None));
            return refuse(slot, sock, e).await;
        }
        match HandshakeSlot::acquire(&app2, peer.source_ip(), deadline).await {
            Ok(h) => session::run(app2, sock, peer, h.carrying(inline), handover, slot).await,
            Err(e) => refuse(slot, sock, e).await,
        }
    };
    // Boxed: the task cell then holds a pointer, and its changes of stage copy that instead
    // of the handshake's whole future (a login's largest copies).
    let task = Box::pin(task);
    drop(match to {
        Some(there) => tasks.spawn_on(task, there),
        None => tasks.spawn(task),
    });
    to_login
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

/// After `force`: how long sessions get to cancel their queries and send 57P01.
const FORCE_GRACE: Duration = Duration::from_secs(2);

/// Tells a client it cannot be served now, and closes. The client slot is held until then.
async fn refuse<S: AsyncWrite + Unpin>(slot: ClientSlot, mut sock: S, e: PgError) {
    let _slot = slot;
    let mut out = BytesMut::new();
    e.encode(&mut out);
    let _ = tokio::time::timeout(Duration::from_secs(1), sock.write_all(&out)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_unix_socket_replaces_a_stale_file_but_never_a_live_one_or_a_plain_file() {
        let dir = std::env::temp_dir().join(format!("pgsluice-unix-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = crate::addr::socket_file(&dir, 6432);
        // Left by a process that died: a socket file nobody listens on.
        drop(std::os::unix::net::UnixListener::bind(&path).expect("stale"));
        let live = bind_unix(&dir, 6432, 0o770).expect("replaces the stale file");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o770);
        let e = bind_unix(&dir, 6432, 0o777)
            .err()
            .expect("a live server's socket");
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse, "{e}");
        assert!(e.to_string().contains(".s.PGSQL.6432"), "{e}");
        drop(live);
        assert!(!path.exists(), "removed with the listener");
        std::fs::write(&path, b"not a socket").expect("file");
        let e = bind_unix(&dir, 6432, 0o777).err().expect("a plain file");
        assert!(e.to_string().contains("not a socket"), "{e}");
        assert!(path.exists(), "not deleted");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

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
