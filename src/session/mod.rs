//! One task per client: handshake, then a short loop that moves bytes between the client and
//! the backend it currently borrows.
//!
//! The loop waits on whichever side speaks next. Client frames are inspected (header, and the
//! bodies of Query/Parse/Bind/Describe/Close) and forwarded; backend frames are scanned for the
//! few types that carry protocol state and otherwise streamed through untouched. In
//! transaction mode the backend goes back to the pool at ReadyForQuery('I') with nothing
//! outstanding; in session mode it stays until the client leaves.
//!
//! This file owns the session's lifetime around that loop: the handshake under its timeout
//! and handshake slot, the client stream (TLS or not) wrapped in [`WriteTimeout`] so that a
//! client that stops reading ends its session instead of pinning a backend and our buffers,
//! and the final error and TLS close. With one session thread (`worker_threads: 1`), a client
//! logs in on that thread while only a few others do ([`InlineLogin`]) and client TLS is off.
//! Otherwise it logs in on the login thread and its session is then handed to the session
//! thread ([`Handover`]); the client socket moves with it from the login thread's event loop
//! to the session thread's ([`crate::rehome`]), so each thread is woken by its own sockets.
//! A client of an `admin.console` database leaves after authentication for `console.rs`,
//! where the proxy answers it itself, on the task that logged it in.

pub mod auth_query;
mod console;
mod handshake;
mod machine;
mod relay;
mod spare;
mod state;
mod tracker;

/// The relay core's isolation oracle, for the `relay_oracle` fuzz target.
#[cfg(fuzzing)]
pub use machine::oracle as relay_oracle;

use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::{Instant, Sleep};
use tokio_util::task::TaskTracker;

use crate::addr::ClientAddr;
use crate::app::App;
use crate::cancel;
use crate::per_address::AddressGuard;
use crate::pool::{Pool, Pooled, ServerParams};
use crate::protocol::PgError;
use crate::protocol::messages;
use crate::protocol::params;
use crate::protocol::tag::backend;
use crate::rehome::Rehome;
use crate::tls::ClientStream;

pub use handshake::Login;
use handshake::{Authenticated, Fail, Start};
use relay::Relay;

/// Why a session ended (for logs).
#[derive(Debug)]
pub enum End {
    ClientClosed,
    Terminated,
    Error(PgError),
    BackendLost,
}

/// One handshake in progress (counted in `stats.handshakes`, capped by
/// `limits.max_handshakes`, and in the client address's share, capped by
/// `limits.max_handshakes_per_address`); released when the client is logged in or gone.
pub struct HandshakeSlot {
    app: Arc<App>,
    _address: AddressGuard,
    _inline: Option<InlineLogin>,
}

/// A connection logging in on the session thread, counted in `stats.inline_logins` until its
/// handshake ends (it rides in its [`HandshakeSlot`]).
pub struct InlineLogin(Arc<App>);

impl InlineLogin {
    /// Counts one more login on the session thread, unless `max` are in progress there.
    pub fn try_enter(app: &Arc<App>, max: usize) -> Option<InlineLogin> {
        app.stats
            .inline_logins
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| InlineLogin(app.clone()))
    }
}

impl Drop for InlineLogin {
    fn drop(&mut self) {
        self.0.stats.inline_logins.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Connections of one address that may wait for its share, per unit of the share: beyond,
/// the address's new connections are refused at once (one host cannot queue up every client
/// slot either). With the default share of 512, a storm from one address has 512 logins at
/// work and 4 096 waiting (clients behind one NAT or load balancer arrive from one address),
/// while it takes eight addresses to hold every handshake slot.
pub const WAITING_PER_SHARE: usize = 8;

impl HandshakeSlot {
    /// Takes a slot for a client at `ip`, waiting until `deadline` for one: first the
    /// address's share (so an address over its share never takes or waits for a process-wide
    /// slot), then the process-wide cap. A waiting connection costs its socket and a task,
    /// not a handshake: the caps bound the work done at once, and a storm of clients queues
    /// instead of being refused into retries that cost a new login each. Refused at once only
    /// when the address already has `WAITING_PER_SHARE ×` its share waiting; when the
    /// deadline passes first, refused with the same error and a retry hint.
    pub async fn acquire(
        app: &Arc<App>,
        ip: IpAddr,
        deadline: Instant,
    ) -> Result<HandshakeSlot, PgError> {
        let limits = &app.config().limits;
        let (max, per_address) = (limits.max_handshakes, limits.max_handshakes_per_address);
        let refused = |limit: &'static str, n: usize| {
            PgError::too_many_handshakes(
                limit,
                n,
                app.policy.connection_hint_ms(app.stats.handshake_wait()),
            )
        };
        let address = app
            .stats
            .handshakes_by_address
            .acquire(
                ip,
                per_address,
                per_address.saturating_mul(WAITING_PER_SHARE),
                deadline,
            )
            .await
            .map_err(|_| refused("max_handshakes_per_address", per_address))?;
        app.stats
            .handshake_gate
            .take(max, usize::MAX, deadline)
            .await
            .map_err(|_| refused("max_handshakes", max))?;
        app.stats.handshakes.fetch_add(1, Ordering::AcqRel);
        Ok(HandshakeSlot {
            app: app.clone(),
            _address: address,
            _inline: None,
        })
    }

    /// Keeps `inline` counted for as long as this handshake lasts.
    pub fn carrying(mut self, inline: Option<InlineLogin>) -> HandshakeSlot {
        self._inline = inline;
        self
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        self.app.stats.handshake_gate.give();
        self.app.stats.handshakes.fetch_sub(1, Ordering::AcqRel);
        self.app
            .stats
            .handshakes_done
            .fetch_add(1, Ordering::Relaxed);
    }
}

/// Where a logged-in client's session goes: for a client that logged in on the login thread
/// (one session thread, see `worker_threads`), it is handed from the login runtime to the
/// sessions' runtime right after authentication; otherwise it stays on the task that logged
/// it in.
#[derive(Clone, Default)]
pub struct Handover(Option<(TaskTracker, tokio::runtime::Handle)>);

impl Handover {
    /// Sessions continue on `sessions` (tracked by `tasks`, so shutdown waits for them).
    pub fn to(tasks: TaskTracker, sessions: tokio::runtime::Handle) -> Handover {
        Handover(Some((tasks, sessions)))
    }
}

type Client<S> = ClientStream<WriteTimeout<S>>;

/// Runs a client connection to completion: startup and authentication here, the rest (the
/// session settings, which may borrow a backend, and the session itself) where `handover`
/// says (a login on the login thread is handed back to the session thread). `hold` (the
/// client's slot) is dropped when the connection ends, wherever that is.
pub async fn run<S, G>(
    app: Arc<App>,
    stream: S,
    peer: ClientAddr,
    slot: HandshakeSlot,
    handover: Handover,
    hold: G,
) where
    S: AsyncRead + AsyncWrite + Rehome + Unpin + Send + 'static,
    G: Send + 'static,
{
    let limits = app.config().limits.clone();
    let write_timeout = Duration::from_millis(limits.client_write_timeout_ms);
    let mut stream = ClientStream::Plain(WriteTimeout::new(stream, write_timeout));
    let mut buf = BytesMut::with_capacity(8 * 1024);
    let mut deadline = Instant::now() + Duration::from_millis(limits.handshake_timeout_ms);
    let started = tokio::time::timeout_at(
        deadline,
        handshake::startup(&app, &mut stream, &mut buf, peer.source_ip()),
    )
    .await;
    let Authenticated {
        mut login,
        mut owed,
    } = match started {
        Ok(Ok(Start::Login(auth))) => auth,
        Ok(Ok(Start::Cancelled)) => return,
        other => {
            let r = other.map(|r| r.map(|_| ()));
            return startup_failed(&app, &mut stream, peer, BytesMut::new(), r).await;
        }
    };
    if app.config().admin.console.serves(&login.database) {
        // The admin console: no pool, no backend; served on this task, holding the slot.
        drop(slot);
        let _hold = hold;
        return console::serve(app, stream, buf, peer, login, owed).await;
    }
    let mut slot = Some(slot);
    // A crowded pool: the authenticated login waits here, before it is told it is in
    // (`App::door`). Its exchange is over, so it waits without its handshake slot, and the
    // handshake deadline is moved on by the time the proxy held it.
    let held_from = Instant::now();
    let passing = app
        .door(
            &login.database,
            &login.user,
            login.application_name(),
            Some(peer.source_ip()),
            || slot = None,
        )
        .await;
    deadline += held_from.elapsed();
    let moving = handover.0.is_some();
    let mut greeted = None;
    if moving && let Some((pool, status)) = known_answer(&app, &mut login) {
        // The usual login: all the client is told is known here, so it is told from this
        // thread, and its first query is on its way while the session moves (the session
        // thread then starts with a read, not a write and then a read).
        slot = None;
        let earned = std::mem::take(&mut owed);
        match greet(&app, &mut stream, earned, &status, &login, peer).await {
            Some(reg) => greeted = Some((pool, reg)),
            None => return,
        }
    }
    // The session's future is several KiB. Handed to another thread it is boxed: a task
    // moves its future into the task cell and again on every change of stage (running,
    // finished), and a box is moved instead. Run here it is awaited in place, inside this
    // future's own box (`server::admit`): one allocation and copy of it per login, not two.
    let rest = async move {
        let _hold = hold;
        // The socket joins the session thread's event loop (it logged in on the login
        // thread's). If the kernel refuses the registration (out of memory), the client is
        // told when the socket is still there to tell it, and let go.
        if moving && let Err(e) = stream.rehome() {
            tracing::warn!(%peer, error = %e, "cannot move the connection to the session thread");
            let e = PgError::fatal("53000", format!("pgsluice: out of resources: {e}"));
            let r = Ok(Err(Fail::Report(e)));
            return startup_failed(&app, &mut stream, peer, owed, r).await;
        }
        let greeted = match greeted {
            Some(g) => Some(g),
            None => prepare(&app, &mut stream, peer, slot, &mut login, owed, deadline).await,
        };
        if let Some(greeted) = greeted {
            serve(app, stream, buf, peer, greeted, login, passing).await;
        }
    };
    match handover.0 {
        Some((tasks, sessions)) => drop(tasks.spawn_on(Box::pin(rest), &sessions)),
        None => rest.await,
    }
}

/// Tells the client why startup failed (when it is owed a reply; after `owed`, what its
/// authentication already earned it) and closes.
async fn startup_failed<S: AsyncRead + AsyncWrite + Unpin>(
    app: &App,
    stream: &mut Client<S>,
    peer: ClientAddr,
    owed: BytesMut,
    r: Result<Result<(), Fail>, tokio::time::error::Elapsed>,
) {
    let e = match r {
        Ok(Ok(())) => return,
        Ok(Err(Fail::Report(e))) => {
            if let Some(suppressed) = connection_line(app) {
                tracing::info!(target: "pgsluice::connections", %peer, sqlstate = e.code, error = %e.message, suppressed, "login failed");
            } else {
                tracing::debug!(%peer, error = %e, "startup failed");
            }
            e
        }
        Ok(Err(Fail::Silent(why))) => {
            tracing::debug!(%peer, why, "startup ended without a reply");
            return;
        }
        Err(_) => PgError::fatal("08P01", "pgsluice: startup or authentication timed out"),
    };
    send_error(stream, owed, &e).await;
    close(stream).await;
}

/// The pool and ParameterStatus list of an authenticated client when both are known without
/// I/O (the pool exists and has met the client's settings before); `None` sends the login
/// the long way ([`prepare`]), which also reports what is wrong.
fn known_answer(app: &App, login: &mut Login) -> Option<(Arc<Pool>, Bytes)> {
    let pool = app.pool_for(&login.database, &login.user).ok()?;
    let status = known_status(&pool, login)?;
    Some((pool, status))
}

/// An authenticated client's pool and settings (within the handshake deadline, possibly
/// borrowing a backend to learn how the server reports them), then its greeting. `None`
/// when the client was told why not, or is gone.
async fn prepare<S: AsyncRead + AsyncWrite + Unpin>(
    app: &App,
    stream: &mut Client<S>,
    peer: ClientAddr,
    slot: Option<HandshakeSlot>,
    login: &mut Login,
    owed: BytesMut,
    deadline: Instant,
) -> Option<(Arc<Pool>, cancel::Registration)> {
    let prepared = tokio::time::timeout_at(deadline, async {
        let pool = app.pool_for(&login.database, &login.user)?;
        let status = login_params(app, &pool, login).await?;
        Ok::<_, Fail>((pool, status))
    })
    .await;
    drop(slot);
    let (pool, status) = match prepared {
        Ok(Ok(x)) => x,
        other => {
            let r = other.map(|r| r.map(|_| ()));
            startup_failed(app, stream, peer, owed, r).await;
            return None;
        }
    };
    let reg = greet(app, stream, owed, &status, &*login, peer).await?;
    Some((pool, reg))
}

/// The client's entry in the cancel registry (its key, as long as its protocol version
/// allows: 32 bytes from 3.2, else 4) and in the client list.
fn register(app: &App, login: &Login, peer: ClientAddr, tls: bool) -> cancel::Registration {
    let meta = crate::clients::ClientMeta {
        user: login.user.clone(),
        database: login.database.clone(),
        addr: peer,
        tls,
    };
    app.cancels
        .register_client(if login.minor >= 2 { 32 } else { 4 }, Some(meta))
}

/// Registers the client's cancel key and writes what its login earned (`owed`), its
/// ParameterStatus list, the key and ReadyForQuery, in one write. `None` when the client is
/// gone.
async fn greet<S: AsyncRead + AsyncWrite + Unpin>(
    app: &App,
    stream: &mut Client<S>,
    mut out: BytesMut,
    status: &[u8],
    login: &Login,
    peer: ClientAddr,
) -> Option<cancel::Registration> {
    let reg = register(app, login, peer, stream.is_tls());
    out.reserve(status.len() + 64);
    out.extend_from_slice(status);
    messages::backend_key_data(&mut out, reg.pid, reg.secret());
    messages::ready_for_query(&mut out, crate::protocol::tag::status::IDLE);
    stream.write_all(&out).await.ok()?;
    Some(reg)
}

/// A greeted client's session, to its end; `door` (a login let through the door) is counted
/// as coming until its first statement meets admission.
async fn serve<S: AsyncRead + AsyncWrite + Rehome + Unpin>(
    app: Arc<App>,
    mut stream: Client<S>,
    buf: BytesMut,
    peer: ClientAddr,
    (pool, reg): (Arc<Pool>, cancel::Registration),
    login: Login,
    door: Option<crate::app::DoorPass>,
) {
    let tls = stream.is_tls();
    // Named from the client's record (the relay takes `login`): no copies of the names.
    let meta = reg.entry.client.meta.as_ref();
    let user = meta.map_or("", |m| m.user.as_str());
    let database = meta.map_or("", |m| m.database.as_str());
    if let Some(suppressed) = connection_line(&app) {
        tracing::info!(target: "pgsluice::connections", %peer, %user, db = %database, tls, suppressed, "login");
    } else {
        tracing::debug!(%peer, %user, db = %database, tls, "client logged in");
    }
    let since = Instant::now();
    let mut relay = Relay::new(app.clone(), pool, login, reg.entry.clone(), buf, peer);
    relay.came_through(door);
    let end = relay.run(&mut stream).await;
    drop(relay);
    if let End::Error(e) = &end {
        send_error(&mut stream, BytesMut::new(), e).await;
    }
    if let Some(suppressed) = connection_line(&app) {
        let secs = since.elapsed().as_secs_f64();
        tracing::info!(target: "pgsluice::connections", %peer, %user, db = %database, duration_s = format_args!("{secs:.3}"), end = ?end, suppressed, "logout");
    } else {
        tracing::debug!(%peer, end = ?end, "session ended");
    }
    close(&mut stream).await;
    drop(reg);
}

/// Ends the connection politely: TLS sends its close_notify (without waiting on a client
/// that is gone). A plain socket needs nothing before it is dropped: closing it sends the
/// same FIN a `shutdown` would, one system call fewer per connection.
async fn close<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut Client<S>) {
    if stream.is_tls() {
        let _ = tokio::time::timeout(Duration::from_millis(200), stream.shutdown()).await;
    }
}

/// A client stream whose writes fail with `TimedOut` once they have made no progress for
/// `limit`: a client that stops reading (a TCP zombie, or one that asked for 50 MB and walked
/// away) then ends its session through the normal error path, which cleans or discards the
/// backend, instead of holding it and our buffers forever. Reads are untouched.
pub struct WriteTimeout<S> {
    inner: S,
    limit: Duration,
    /// Running while a write is blocked; reset whenever a write makes progress.
    timer: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteTimeout<S> {
    pub fn new(inner: S, limit: Duration) -> Self {
        WriteTimeout {
            inner,
            limit,
            timer: None,
        }
    }

    /// `Pending` from the inner stream: start (or check) the no-progress timer.
    fn blocked<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let limit = self.limit;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "client stopped reading: write made no progress",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: Rehome> Rehome for WriteTimeout<S> {
    /// The no-progress timer belongs to the old runtime's timer wheel: a new one is started
    /// on this runtime by the next blocked write.
    fn rehome(&mut self) -> io::Result<()> {
        self.timer = None;
        self.inner.rehome()
    }

    fn may_read(&self) -> bool {
        self.inner.may_read()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteTimeout<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteTimeout<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write(cx, buf) {
            Poll::Pending => self.blocked(cx),
            ready => {
                self.timer = None;
                ready
            }
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.inner).poll_flush(cx) {
            Poll::Pending => self.blocked(cx),
            ready => {
                self.timer = None;
                ready
            }
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Writes `e` after `out` (what the client is owed before it), giving up after a second.
async fn send_error<S: AsyncWrite + Unpin>(stream: &mut S, mut out: BytesMut, e: &PgError) {
    e.encode(&mut out);
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(&out)).await;
}

/// Writes a new client's ParameterStatus list: the server's values in its order, a client
/// setting (as the server reports it) in place of the server's value of the same name, the
/// client's other settings after them.
fn write_status(server: &[(String, String)], own: &[(String, String)], out: &mut BytesMut) {
    for (k, v) in server {
        let v = own
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(k))
            .map_or(v, |(_, r)| r);
        messages::parameter_status(out, k, v);
    }
    for (k, v) in own {
        if !server.iter().any(|(n, _)| n.eq_ignore_ascii_case(k)) {
            messages::parameter_status(out, k, v);
        }
    }
}

/// The ParameterStatus list for a new client. Learns the server's spelling of the client's
/// settings once per value (one round trip on a pooled backend), then answers from the
/// pool's cache.
async fn login_params(app: &App, pool: &Arc<Pool>, login: &mut Login) -> Result<Bytes, PgError> {
    if let Some(status) = known_status(pool, login) {
        return Ok(status);
    }
    let deadline = Instant::now() + Duration::from_millis(pool.cfg.checkout_timeout_ms);
    let mut b = pool.checkout(2, deadline).await.map_err(|e| {
        let hint = match e.arrival_retry() {
            Some(place) => app
                .policy
                .place_hint_ms(&app.runtime.load().limits, u16::MAX, place),
            None => app.policy.connection_hint_ms(pool.expected_wait()),
        };
        e.to_pg(&pool.name, hint).into_fatal()
    })?;
    learn_settings(app, &mut b, pool, login).await?;
    b.release().await;
    let server = pool
        .server_params()
        .unwrap_or_else(|| Arc::from(Vec::new()));
    Ok(status_of(server, pool, login))
}

/// [`login_params`] without I/O: the list the pool remembers for these settings, or else
/// `None` unless the pool knows the server's values and how the server reports each of the
/// client's settings. A remembered list also gives the login the pool's copy of its settings
/// ([`Pool::greeting`]).
fn known_status(pool: &Pool, login: &mut Login) -> Option<Bytes> {
    if let Some((greeting, settings)) = pool.greeting(&login.settings) {
        login.settings = settings;
        return Some(greeting);
    }
    let server = pool.server_params()?;
    let all_known = login
        .settings
        .iter()
        .all(|(k, v)| pool.knows_canonical(k, v));
    all_known.then(|| status_of(server, pool, login))
}

/// The list from the server's values and the pool's record of how the server reports the
/// client's settings, encoded; remembered by the pool for the next login with the same
/// settings when the record had every one of them.
fn status_of(server: ServerParams, pool: &Pool, login: &Login) -> Bytes {
    let mut own: Vec<(String, String)> = Vec::new();
    let mut complete = true;
    for (k, v) in login.settings.iter() {
        let Some(reported) = pool.canonical(k, v) else {
            complete = false;
            continue;
        };
        // An empty string marks a setting the server does not report.
        if reported.is_empty() && k != "application_name" {
            continue;
        }
        // A name given twice: the last one counts, as it would in Postgres.
        match own.iter_mut().find(|(n, _)| n.eq_ignore_ascii_case(k)) {
            Some(slot) => slot.1 = reported,
            None => own.push((k.clone(), reported)),
        }
    }
    let mut out = BytesMut::new();
    write_status(&server, &own, &mut out);
    let greeting = out.freeze();
    if complete {
        pool.remember_greeting(&login.settings, greeting.clone());
    }
    greeting
}

/// Applies the client's settings on `b`, recording how the server reports each of them.
async fn learn_settings(
    app: &App,
    b: &mut Pooled,
    pool: &Pool,
    login: &Login,
) -> Result<(), PgError> {
    let conn = b.conn();
    let Some(sql) = params::apply_sql(&conn.applied, &login.settings) else {
        for (k, v) in login.settings.iter() {
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
    let mut reported: Vec<(String, String)> = Vec::new();
    let mut error = None;
    let run = conn.simple_query(&sql, |tag, body| match tag {
        backend::PARAMETER_STATUS => {
            let mut parts = body.split(|&c| c == 0);
            if let (Some(n), Some(v)) = (parts.next(), parts.next()) {
                reported.push((
                    String::from_utf8_lossy(n).into_owned(),
                    String::from_utf8_lossy(v).into_owned(),
                ));
            }
        }
        backend::ERROR_RESPONSE if error.is_none() => {
            let code = crate::protocol::error::sqlstate_of(body).unwrap_or("22023");
            let msg =
                crate::protocol::error::field_of(body, b'M').unwrap_or("invalid startup parameter");
            error = Some(PgError::fatal(
                params::setting_error_code(code),
                msg.to_string(),
            ));
        }
        _ => {}
    });
    if let Err(e) = run.await {
        // The server's error (the backend is fine: the failed SELECT left nothing behind; the
        // client is not), or the connection is lost.
        return Err(error.unwrap_or_else(|| {
            PgError::backend_unavailable(e, app.policy.connection_hint_ms(None)).into_fatal()
        }));
    }
    conn.applied = login.settings.clone();
    for (k, v) in login.settings.iter() {
        let r = reported
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(k))
            .map(|(_, r)| r.clone())
            .unwrap_or_default();
        pool.learn_canonical(k, v, &r);
    }
    Ok(())
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
    let t = b.map(|b| b.conn().cancel_target());
    entry.client.set_backend(t.as_ref().map(|t| t.pid));
    // Waits only while a cancel is being delivered (rare): no wait's future otherwise.
    if let Err(t) = entry.try_set(t) {
        entry.set(t).await;
    }
}

/// Awaits `fut` (a pool checkout, a caller queue) while watching the client, read into
/// `buf`: a client that hangs up meanwhile ends the wait with FATAL 08006 `why`, an
/// operator's order to terminate it ([`cancel::Entry::terminate`]) with FATAL 57P01. The
/// caller has polled `fut` once, with this task's waker, and found it pending (most such
/// futures complete at once, and then none of this runs): the first poll here does not poll
/// it again. The wait is shown as `waiting` in `GET /v1/clients`.
///
/// One hand-written poll, not a `select!` over three futures: at 64 clients on 20 backends
/// nearly every checkout waits, and this runs twice per transaction.
async fn unless_client_leaves<S, F>(
    mut fut: Pin<&mut F>,
    client: &mut S,
    buf: &mut BytesMut,
    entry: &cancel::Entry,
    why: &'static str,
) -> Result<F::Output, PgError>
where
    S: AsyncRead + Unpin,
    F: std::future::Future,
{
    use crate::clients::{ClientState, Order};
    /// Client bytes buffered during a wait past which the client is no longer read (it is
    /// still watched for a hang-up once the wait ends).
    const MAX_BUFFERED: usize = 1 << 20;
    // Pinned by the caller: a future passed by value is copied into each async frame it
    // passes through, and a checkout's or an admission's is large.
    entry.client.set_state(ClientState::Waiting);
    let mut polled = true;
    let r = std::future::poll_fn(|cx| {
        // The awaited future first (a slot handed over is taken even if the client's next
        // bytes arrived in the same instant).
        if !std::mem::take(&mut polled)
            && let Poll::Ready(r) = fut.as_mut().poll(cx)
        {
            return Poll::Ready(Ok(r));
        }
        // What the client sends meanwhile is kept; a hang-up ends the wait.
        while buf.len() < MAX_BUFFERED {
            match tokio_util::io::poll_read_buf(Pin::new(&mut *client), cx, buf) {
                Poll::Ready(Ok(0) | Err(_)) => {
                    return Poll::Ready(Err(PgError::fatal("08006", why)));
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Pending => break,
            }
        }
        entry.wake.register(cx.waker());
        match entry.client.order() {
            Order::Terminate => Poll::Ready(Err(PgError::terminated_by_admin())),
            Order::None => Poll::Pending,
        }
    })
    .await;
    entry.client.set_state(ClientState::Active);
    r
}

/// Whether a `log.connections` line may be written now: `Some(lines left out before it)`.
fn connection_line(app: &App) -> Option<u64> {
    let cfg = app.config();
    if !cfg.log.connections {
        return None;
    }
    app.log_limits.connections.admit(
        crate::observe::stats::unix_ms(),
        cfg.log.max_lines_per_second,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test(start_paused = true)]
    async fn write_timeout_fails_a_write_that_makes_no_progress() {
        let (a, mut b) = tokio::io::duplex(64);
        let mut w = WriteTimeout::new(a, Duration::from_secs(30));
        // Progress resets the timer: a slow reader that keeps reading is fine.
        let reader = tokio::spawn(async move {
            let mut sink = [0u8; 16];
            for _ in 0..8 {
                tokio::time::sleep(Duration::from_secs(20)).await;
                let _ = b.read(&mut sink).await;
            }
            b
        });
        w.write_all(&[0u8; 160])
            .await
            .expect("slow but steady reader");
        let _b = reader.await.expect("reader");
        // Nobody reads any more: the write fails after the limit, not before.
        let t = Instant::now();
        let e = w.write_all(&[0u8; 1024]).await.expect_err("stalled write");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t.elapsed() >= Duration::from_secs(30));
    }

    /// A login whose settings the pool has met takes the pool's list of them with the
    /// greeting: its checkouts then find a backend's applied settings equal by pointer.
    #[test]
    fn a_known_login_takes_the_pools_settings_list() {
        let pool = Pool::unconnected();
        let web = || -> params::Shared { Arc::from([("application_name".into(), "web".into())]) };
        let first = web();
        pool.remember_greeting(&first, Bytes::from_static(b"S..."));
        let mut login = Login {
            user: "u".into(),
            database: "d".into(),
            settings: web(),
            minor: 0,
        };
        assert!(!Arc::ptr_eq(&login.settings, &first));
        assert_eq!(
            known_status(&pool, &mut login).as_deref(),
            Some(&b"S..."[..])
        );
        assert!(Arc::ptr_eq(&login.settings, &first));
    }
}
