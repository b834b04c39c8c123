//! Backend pools, one per (database, user): checkout with priority waiters and a deadline,
//! return or discard through an RAII guard, health checks before reuse, connection lifetime
//! with jitter, and a cap on concurrent connection attempts with full-jitter backoff while the
//! database is failing — so the proxy never causes a reconnect storm of its own.
//!
//! Operators can pause a pool (new checkouts wait for a resume, up to a hold limit, while
//! transactions in flight finish) and have every backend replaced after its current use
//! ([`Pool::reconnect`], e.g. after a failover or a password rotation).
//!
//! Knows nothing of clients: sessions hand it who asks (a priority, and the caller with its
//! weight and time share, [`Asker`]) and a deadline, and get a [`Pooled`].
//! As whom it connects is fixed when it is created; where, and with which password, a reload
//! may change for the connections opened after it ([`Pool::set_route`]).

pub mod adaptive;
pub mod backend;
pub mod caps;
pub mod catalog;
pub mod park;
pub use crate::protocol::prepared;
pub mod reset;
pub mod slots;
pub mod verify;
pub mod wal;

use foldhash::{HashMap, HashMapExt};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use bytes::BytesMut;

use crate::config::{PoolConfig, PoolMode};
use crate::protocol::PgError;
use crate::protocol::messages;

pub use backend::{BackendConn, ConnectError, ConnectParams, Dirt, Endpoint};

/// Where and as whom a pool's new connections log in (its `databases:` entry, or
/// `backend.url`'s server with the client's own names).
#[derive(Debug, Clone)]
pub struct Route {
    /// Shared: the default endpoint is parsed once per configuration (`Runtime::endpoint`).
    pub endpoint: Arc<Endpoint>,
    /// The user the server sees (a `databases:` entry may name one for all clients).
    pub user: String,
    /// The database name on the server.
    pub database: String,
    pub password: Option<String>,
    /// Without a password: the key a client of `user` proved (SCRAM pass-through).
    pub client_key: Option<Arc<crate::auth::passthrough::ClientKey>>,
}

impl Route {
    pub fn apply(&self, p: &mut ConnectParams) {
        p.set_endpoint(Endpoint::clone(&self.endpoint));
        p.user = self.user.clone();
        p.database = self.database.clone();
        p.password = self.password.clone();
        p.client_key = self.client_key.clone();
    }
}
use crate::policy::arrival::Placed;
pub use crate::policy::share::{Asker, ShareStats};
use slots::{SlotError, SlotPermit, Slots};

/// A server's ParameterStatus values, shared by the logins of a pool.
pub type ServerParams = Arc<[(String, String)]>;

/// Distinct startup-settings lists a pool remembers the greeting of.
pub const GREETINGS: usize = 1_000;

/// How long after its backoff window a failed connect still says "unreachable".
pub const UNREACHABLE_FOR: Duration = Duration::from_secs(10);

/// Why a checkout failed; each maps to the error the client sees.
#[derive(Debug)]
pub enum CheckoutError {
    /// No slot became free before the deadline.
    Timeout { waited: Duration, limit: Duration },
    /// The expected wait (`place`) did not fit the deadline (`limit`): refused on arrival.
    WouldWait { place: Placed, limit: Duration },
    /// Connecting failed (or we are backing off after failures).
    Connect(Arc<ConnectError>),
    /// No slot free and `max_waiting` clients already waiting: refused at once.
    Full { max_waiting: usize },
    /// The pool stayed paused for the whole hold limit of its pause.
    Paused { held: Duration },
    /// A limit shared with other pools (`max_db_connections`, `max_user_connections`) stayed
    /// full until the deadline.
    Capped(caps::CapFull),
}

/// Counters read by the admin API and metrics.
#[derive(Default)]
pub struct PoolStats {
    pub connects: AtomicU64,
    pub connect_failures: AtomicU64,
    pub discards: AtomicU64,
    pub resets: AtomicU64,
    /// Sessions checked against Postgres after a unit the parse could not prove harmless.
    pub verifications: AtomicU64,
    /// Checks that found session state the proxy did not know of (each also reset).
    pub verify_differences: AtomicU64,
    pub checkouts: AtomicU64,
    /// Checkouts by non-critical callers: the pace at which a queue of non-critical work is
    /// served (critical work mostly takes the reserve, which no one else may use).
    pub shared_checkouts: AtomicU64,
    pub checkout_timeouts: AtomicU64,
    /// Checkouts refused at once because `max_waiting` clients were already waiting.
    pub waiting_refused: AtomicU64,
    pub pinned_clients: AtomicUsize,
    /// What clients did through the pool (SHOW STATS): counted by their sessions, a few
    /// relaxed adds per transaction.
    pub transactions: AtomicU64,
    pub queries: AtomicU64,
    pub bytes_received: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub transaction_us: AtomicU64,
    pub query_us: AtomicU64,
    /// Time clients waited for a backend (checkouts that had to wait).
    pub wait_us: AtomicU64,
}

struct Backoff {
    failures: u32,
    /// Until this instant new attempts fail fast with the last error.
    until: Option<Instant>,
    last_error: Option<Arc<ConnectError>>,
}

pub struct Pool {
    pub name: String,
    pub database: String,
    pub user: String,
    pub cfg: PoolConfig,
    /// Where and as whom new connections log in. Behind a lock so that a reload can hand a
    /// changed backend password to a pool that already exists ([`Pool::set_route`]).
    connect: Mutex<Arc<ConnectParams>>,
    /// The runtime snapshot `connect`'s route was last set under (0: none, or a route that
    /// also depends on a client's proved key); written under the `connect` lock with it.
    route_generation: AtomicU64,
    slots: Arc<Slots>,
    /// Boxed: a connection moves between the idle list, the checkout and the client's guard
    /// on every transaction, and a box moves as one pointer instead of a few hundred bytes.
    #[allow(clippy::vec_box)]
    idle: Mutex<Vec<Box<BackendConn>>>,
    /// Open connections (idle + checked out).
    open: AtomicUsize,
    attempts: Semaphore,
    backoff: Mutex<Backoff>,
    /// ParameterStatus of the first successful login; sent to clients at their login.
    server_params: Mutex<Option<ServerParams>>,
    /// (parameter, value as the client sent it) → value as the server reports it.
    canonical: Mutex<HashMap<String, HashMap<String, String>>>,
    /// A client's startup settings → the ParameterStatus messages it is greeted with, encoded
    /// (built from `server_params` and `canonical`; at most [`GREETINGS`] lists).
    greetings: Mutex<HashMap<crate::protocol::params::Shared, bytes::Bytes>>,
    pub stats: PoolStats,
    /// What this pool knows of its database's user code (`catalog.rs`).
    pub catalog: catalog::Catalog,
    /// Statements whose session check has read the settings once (`verify.rs`).
    pub checked: verify::Seen,
    /// How fast non-critical checkouts are served (the retry hints of its waiters, the door).
    drain: crate::policy::drain::DrainRate,
    /// The adaptive concurrency limit, when `adaptive` is on.
    adaptive: Option<Mutex<adaptive::AdaptiveLimit>>,
    /// Set while paused: the fast path of every checkout reads only this.
    paused: AtomicBool,
    /// `Some(hold)` while paused: how long a checkout may wait for the resume.
    pause: tokio::sync::watch::Sender<Option<Duration>>,
    /// Connections created at or before `epoch` + this many ns are replaced when next
    /// released or found idle ([`Pool::reconnect`]); 0 = none.
    replace_before_ns: AtomicU64,
    epoch: Instant,
    /// Limits shared with other pools; a unit of each is held per open connection.
    caps: Vec<Arc<caps::Cap>>,
    /// Connects of this pool waiting at one of its caps (counted once per cap).
    cap_waiting: AtomicUsize,
    /// Checkouts waiting to open a connection (for a connect attempt or a cap unit): a
    /// connection put back idle wakes them through `returned`, since one of them can use it.
    connect_waiting: AtomicUsize,
    returned: tokio::sync::Notify,
    /// A pool of a database's replicas (`databases[].replicas`): probed for replay lag.
    pub replica: bool,
    /// Replicas: the last probe succeeded.
    replica_healthy: AtomicBool,
    /// Replicas: replay lag at the last probe (ms).
    replica_lag_ms: AtomicU64,
    /// Replicas: the WAL position replayed at the last good probe (`u64::MAX`: not in
    /// recovery; 0: not known), what read-your-writes compares a client's mark with.
    replica_replay_lsn: AtomicU64,
    /// Transaction mode's multiplexed LISTEN: who listens on what, and the listener
    /// connection that holds their union (`crate::notify`).
    pub notify: crate::notify::Hub,
    /// The logins waiting at the door for this pool, in line by caller (`App::door`).
    pub door: crate::door::Lines,
}

/// The replay lag of a standby in ms: 0 when it has replayed all it received, the age of
/// its last replayed commit when it has not, a day when it has WAL to replay but no commit
/// replayed since it started (unknown counts as lagging), `-1` on a server that is not in
/// recovery (a promoted replica is as current as it gets); and the WAL position it has
/// replayed (NULL when not in recovery).
const REPLICA_LAG_SQL: &str = "SELECT CASE WHEN NOT pg_catalog.pg_is_in_recovery() THEN -1 \
     WHEN pg_catalog.pg_last_wal_receive_lsn() IS NOT DISTINCT FROM \
     pg_catalog.pg_last_wal_replay_lsn() THEN 0 \
     ELSE COALESCE((EXTRACT(EPOCH FROM pg_catalog.now() - \
     pg_catalog.pg_last_xact_replay_timestamp()) * 1000)::bigint, 86400000) END, \
     CASE WHEN pg_catalog.pg_is_in_recovery() THEN pg_catalog.pg_last_wal_replay_lsn() END";

/// One backend connection in `GET /v1/servers` (the idle ones; those in use are listed
/// through their clients).
#[derive(Debug, Clone, serde::Serialize)]
pub struct IdleServer {
    pub pid: i32,
    pub age_ms: u64,
    pub idle_ms: u64,
}

impl Pool {
    pub fn new(
        database: &str,
        user: &str,
        cfg: PoolConfig,
        connect: ConnectParams,
        caps: Vec<Arc<caps::Cap>>,
    ) -> Arc<Pool> {
        Pool::with_role(database, user, cfg, connect, caps, false)
    }

    /// As [`Pool::new`]; `replica`: a pool of the database's replicas (named `db/user@replica`).
    pub fn with_role(
        database: &str,
        user: &str,
        cfg: PoolConfig,
        connect: ConnectParams,
        caps: Vec<Arc<caps::Cap>>,
        replica: bool,
    ) -> Arc<Pool> {
        let adaptive = (cfg.adaptive == Some(true)).then(|| {
            Mutex::new(adaptive::AdaptiveLimit::new(
                cfg.size,
                adaptive::AdaptiveConfig {
                    floor: cfg.adaptive_floor,
                    target_percent: cfg.adaptive_target_percent,
                },
            ))
        });
        let pool = Arc::new(Pool {
            caps,
            cap_waiting: AtomicUsize::new(0),
            connect_waiting: AtomicUsize::new(0),
            returned: tokio::sync::Notify::new(),
            replica,
            replica_healthy: AtomicBool::new(false),
            replica_lag_ms: AtomicU64::new(0),
            replica_replay_lsn: AtomicU64::new(0),
            notify: crate::notify::Hub::default(),
            door: crate::door::Lines::default(),
            name: if replica {
                format!("{database}/{user}@replica")
            } else {
                format!("{database}/{user}")
            },
            database: database.to_string(),
            user: user.to_string(),
            slots: {
                let slots =
                    Slots::with_fair(cfg.size, cfg.critical_reserve.unwrap_or(0), cfg.fair_shares);
                if cfg.critical_reserve_fixed {
                    slots.fix_reserve();
                }
                slots
            },
            attempts: Semaphore::new(cfg.max_connect_attempts),
            cfg,
            connect: Mutex::new(Arc::new(connect)),
            route_generation: AtomicU64::new(0),
            idle: Mutex::new(Vec::new()),
            open: AtomicUsize::new(0),
            backoff: Mutex::new(Backoff {
                failures: 0,
                until: None,
                last_error: None,
            }),
            server_params: Mutex::new(None),
            canonical: Mutex::new(HashMap::new()),
            greetings: Mutex::new(HashMap::new()),
            stats: PoolStats::default(),
            catalog: catalog::Catalog::default(),
            checked: verify::Seen::default(),
            drain: crate::policy::drain::DrainRate::new(),
            adaptive,
            paused: AtomicBool::new(false),
            pause: tokio::sync::watch::Sender::new(None),
            replace_before_ns: AtomicU64::new(0),
            epoch: Instant::now(),
        });
        for c in &pool.caps {
            c.join(&pool);
        }
        pool
    }

    /// Closes the oldest idle connection (room for another pool under a shared cap); whether
    /// there was one.
    pub fn evict_one_idle(&self) -> bool {
        let conn = {
            let mut idle = self.idle.lock();
            if idle.is_empty() {
                return false;
            }
            idle.remove(0)
        };
        self.close(conn);
        true
    }

    /// Pauses the pool: checkouts from now on wait for [`Pool::resume`], each at most `hold`
    /// (then refused with a retry hint); connections in use are not touched, so transactions
    /// in flight finish. See [`Pool::in_use`] for when they have.
    pub fn pause(&self, hold: Duration) {
        self.pause.send_replace(Some(hold));
        self.paused.store(true, Ordering::SeqCst);
        self.slots.parking.revoke_all();
        tracing::warn!(pool = %self.name, hold_ms = hold.as_millis(), "pool paused by an operator");
    }

    /// Ends a pause; the waiting checkouts go on, each with its whole checkout window again.
    pub fn resume(&self) -> bool {
        let was = self.paused.swap(false, Ordering::SeqCst);
        self.pause.send_replace(None);
        if was {
            tracing::warn!(pool = %self.name, "pool resumed by an operator");
        }
        was
    }

    /// Replicas: reads may go here now — the last probe reached a server whose replay lag is
    /// within `max_lag_ms` (0: any lag).
    pub fn replica_usable(&self, max_lag_ms: u64) -> bool {
        self.replica_healthy.load(Ordering::Relaxed)
            && (max_lag_ms == 0 || self.replica_lag_ms.load(Ordering::Relaxed) <= max_lag_ms)
    }

    /// Replicas: the WAL position the server had replayed at the last good probe
    /// ([`wal::Lsn::MAX`] when it is not in recovery); `None` when not known.
    pub fn replica_replay_lsn(&self) -> Option<wal::Lsn> {
        match self.replica_replay_lsn.load(Ordering::Relaxed) {
            0 => None,
            n => Some(wal::Lsn(n)),
        }
    }

    /// Replicas: measures the replay lag and position on one of the pool's connections (a
    /// low-priority checkout, so clients come first); unhealthy when that fails within
    /// `within`.
    pub async fn probe_replica(self: &Arc<Self>, within: Duration) {
        let probe = async {
            let mut b = self.checkout(3, Instant::now() + within).await.ok()?;
            let row = b.conn().first_row(REPLICA_LAG_SQL).await.ok()??;
            b.release().await;
            let mut cols = row.into_iter();
            let lag = cols.next().flatten()?.parse::<i64>().ok()?;
            let replayed = match cols.next().flatten() {
                Some(text) => wal::Lsn::parse(&text).map_or(0, |l| l.0),
                None if lag < 0 => u64::MAX,
                None => 0,
            };
            Some((lag, replayed))
        };
        match tokio::time::timeout(within, probe).await.ok().flatten() {
            Some((lag, replayed)) => {
                self.replica_replay_lsn.store(replayed, Ordering::Relaxed);
                self.replica_lag_ms
                    .store(u64::try_from(lag).unwrap_or(0), Ordering::Relaxed);
                if !self.replica_healthy.swap(true, Ordering::Relaxed) {
                    tracing::info!(pool = %self.name, lag_ms = lag.max(0), "replica reachable");
                }
            }
            None => {
                if self.replica_healthy.swap(false, Ordering::Relaxed) {
                    tracing::warn!(pool = %self.name, "replica probe failed; reads go elsewhere");
                }
            }
        }
    }

    /// Where and as whom this pool's connections log in now (the listener connection of
    /// `notify` logs in the same way).
    pub fn connect_params(&self) -> Arc<ConnectParams> {
        Arc::clone(&self.connect.lock())
    }

    /// The user the server sees for this pool's connections.
    pub fn login_user(&self) -> String {
        self.connect.lock().user.clone()
    }

    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    /// Connections checked out now.
    pub fn in_use(&self) -> usize {
        self.open
            .load(Ordering::Relaxed)
            .saturating_sub(self.idle.lock().len())
    }

    /// Replaces every connection open now: the idle ones are closed at once, those in use
    /// when their client releases them. Returns (closed now, to be replaced on release).
    pub fn reconnect(&self) -> (usize, usize) {
        let ns = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.replace_before_ns.store(ns.max(1), Ordering::SeqCst);
        self.slots.parking.revoke_all();
        let idle: Vec<Box<BackendConn>> = std::mem::take(&mut *self.idle.lock());
        let closed = idle.len();
        for c in idle {
            self.close(c);
        }
        let in_use = self.in_use();
        tracing::warn!(pool = %self.name, closed, in_use, "pool reconnect ordered by an operator");
        (closed, in_use)
    }

    /// Whether [`Pool::reconnect`] condemned this connection.
    fn replaced(&self, conn: &BackendConn) -> bool {
        let before = self.replace_before_ns.load(Ordering::Relaxed);
        before != 0
            && u64::try_from(
                conn.created
                    .saturating_duration_since(self.epoch)
                    .as_nanos(),
            )
            .unwrap_or(u64::MAX)
                <= before
    }

    /// The idle connections, for `GET /v1/servers`.
    pub fn idle_servers(&self) -> Vec<IdleServer> {
        let now = Instant::now();
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        self.idle
            .lock()
            .iter()
            .map(|c| IdleServer {
                pid: c.pid,
                age_ms: ms(now.saturating_duration_since(c.created)),
                idle_ms: ms(now.saturating_duration_since(c.idle_since)),
            })
            .collect()
    }

    /// While paused: waits for the resume, at most the pause's hold.
    async fn wait_resumed(&self) -> Result<(), CheckoutError> {
        let mut rx = self.pause.subscribe();
        let Some(hold) = *rx.borrow_and_update() else {
            return Ok(());
        };
        match tokio::time::timeout(hold, rx.wait_for(Option::is_none)).await {
            Ok(_) => Ok(()),
            Err(_) => Err(CheckoutError::Paused { held: hold }),
        }
    }

    /// Where and with which password new backend connections log in, when a reload changed
    /// them (those already open stay as they are: Postgres does not re-check a session's
    /// password; [`Pool::reconnect`] replaces them). A change also ends a failure backoff,
    /// which may be the old address's or password's doing.
    ///
    /// `generation` is the runtime snapshot `route` was computed under (0 for none): while
    /// it is the one in force, [`Pool::routed_under`] says the route is current. A route
    /// without a password also depends on the key a client proved, which changes without a
    /// new snapshot; it is never marked current.
    pub fn set_route(&self, route: &Route, generation: u64) {
        let endpoint = &route.endpoint;
        let generation = if route.password.is_some() {
            generation
        } else {
            0
        };
        {
            let mut connect = self.connect.lock();
            // Under the lock, with the route: the last writer's route and generation match.
            self.route_generation.store(generation, Ordering::Release);
            let same_key = match (&connect.client_key, &route.client_key) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            };
            if connect.password == route.password
                && connect.has_endpoint(endpoint)
                && connect.user == route.user
                && connect.database == route.database
                && same_key
            {
                return;
            }
            let was = connect.endpoint();
            if (&was.host, was.port, &was.also) != (&endpoint.host, endpoint.port, &endpoint.also) {
                tracing::warn!(pool = %self.name, from = %format_args!("{}:{}", was.host, was.port), to = %format_args!("{}:{}", endpoint.host, endpoint.port), "backend address changed; new connections go there");
            }
            let mut next = ConnectParams::clone(&connect);
            route.apply(&mut next);
            *connect = Arc::new(next);
        }
        let mut b = self.backoff.lock();
        b.failures = 0;
        b.until = None;
        b.last_error = None;
        tracing::info!(pool = %self.name, "backend settings changed; new connections use them");
    }

    /// The pool's route was set under runtime snapshot `generation` ([`Pool::set_route`]).
    pub fn routed_under(&self, generation: u64) -> bool {
        generation != 0 && self.route_generation.load(Ordering::Acquire) == generation
    }

    /// The error of the last connection attempt while it failed, none has succeeded since
    /// and it is recent (its backoff window plus [`UNREACHABLE_FOR`]), else `None`. Recent
    /// only: a readiness check that stayed failed after the last attempt would keep away
    /// the very clients whose next attempt could find the database back.
    pub fn unreachable(&self) -> Option<String> {
        let b = self.backoff.lock();
        let recent = b
            .until
            .is_some_and(|until| Instant::now() < until + UNREACHABLE_FOR);
        if b.failures == 0 || !recent {
            return None;
        }
        b.last_error.as_ref().map(|e| e.to_string())
    }

    /// A database-load reading (percent): moves the adaptive limit, if this pool has one,
    /// and hands any new room to waiters.
    pub fn on_load(&self, load: f64) {
        let Some(a) = &self.adaptive else { return };
        let caps = {
            let mut a = a.lock();
            a.on_load(load);
            a.caps()
        };
        self.slots.set_caps(caps);
    }

    /// A login whose client may wait `room` for a backend should wait at the door: the
    /// clients queued now and the `coming` logins let in ahead of it, at the rate
    /// non-critical checkouts are served (critical work's are mostly the reserve's, which
    /// no one else may take), would keep it waiting more than half of that, or that rate is not known
    /// yet, or the queue is full (`pool.max_waiting`: its checkout would be refused at once).
    pub fn crowded(&self, room: Duration, coming: usize) -> bool {
        let queued = self.slots.queued_now();
        let waiting = (queued + coming) as u64;
        if waiting == 0 || self.slots.room_for(coming) {
            return false;
        }
        if queued + coming >= self.cfg.max_waiting {
            return true;
        }
        let room = room.min(Duration::from_millis(self.cfg.checkout_timeout_ms));
        match self.wait_behind(waiting) {
            // Clients queue and the pace is not known yet (a fifth of a second after the
            // first look): crowded, or a storm's first logins would all pass before anyone
            // could tell how long they would wait.
            None => queued > 0,
            // Nobody queues: only logins let through that have not asked for a backend yet
            // (a benchmark connecting all its clients before it starts sends nothing), so a
            // pace of nothing is no evidence of a wait.
            Some(w) if queued == 0 && w >= crate::policy::drain::MAX_WAIT => false,
            Some(w) => w > room / 2,
        }
    }

    /// The expected wait for a backend of this pool: the clients waiting, at the rate
    /// checkouts have been served (`None` until that rate is known).
    pub fn expected_wait(&self) -> Option<Duration> {
        self.wait_behind(self.slots.waiting() as u64)
    }

    /// The wait of a newcomer behind `waiting` clients, at the pace non-critical checkouts
    /// are served.
    fn wait_behind(&self, waiting: u64) -> Option<Duration> {
        let served = self.stats.shared_checkouts.load(Ordering::Relaxed);
        self.drain.expected_wait(served, waiting, Instant::now())
    }

    #[inline(always)]
    fn count_checkout(&self, priority: usize) {
        self.stats.checkouts.fetch_add(1, Ordering::Relaxed);
        if priority > 0 {
            self.stats.shared_checkouts.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn mode(&self) -> PoolMode {
        self.cfg.mode
    }

    /// The checkout that waits for nothing: the pool is not paused, nobody is queued for a
    /// slot (read without the lock), a slot is free at once for `priority`, and the most
    /// recently idle connection is usable without a health check. `None`: [`Pool::checkout`]
    /// does the rest (the session's hot path takes this first, so the large checkout future
    /// is built only when it must wait or connect).
    /// `now` is the caller's clock reading (a session reads it once per wake-up).
    pub fn try_checkout_now(
        self: &Arc<Self>,
        asker: impl Into<Asker>,
        now: Instant,
    ) -> Option<Pooled> {
        if self.paused.load(Ordering::SeqCst) || !self.slots.queue_empty() {
            return None;
        }
        let asker = asker.into();
        let permit = self.slots.try_acquire(asker, now)?;
        let conn = {
            let mut idle = self.idle.lock();
            let conn = idle.last()?;
            let fresh = now.saturating_duration_since(conn.idle_since)
                < Duration::from_millis(self.cfg.health_check_after_ms);
            if !fresh || self.spent(conn, now) {
                return None;
            }
            idle.pop()?
        };
        self.count_checkout(asker.priority);
        Some(self.guard(conn, permit))
    }

    /// Whether `conn`, idle and clean after its client's transaction, may stay parked with
    /// that client ([`park`]): the pool is not paused, no connect waits at a cap it shares,
    /// the connection carries no session state to reset and is not due to be replaced, a
    /// slot is free for anyone else with nobody waiting, and an idle connection is there for
    /// the next client that takes it (it need not open one while this one sits parked).
    pub fn may_park(&self, conn: &BackendConn, now: Instant) -> bool {
        !self.paused.load(Ordering::Relaxed)
            && !self.caps.iter().any(|c| c.contended())
            && !conn.dirty.any()
            && conn.expires > now
            && !self.replaced(conn)
            && self.slots.quiet()
            && !self.idle.lock().is_empty()
    }

    /// Parks `conn` with its client under `ticket` (see [`Pool::may_park`]).
    pub fn park(&self, ticket: &Arc<park::Ticket>, conn: &mut BackendConn, now: Instant) {
        conn.idle_since = now;
        self.slots.park(ticket);
    }

    /// The parked client wants its backend again: `true` when it may use it — the pool did
    /// not revoke it, is not paused, and would lend it now as [`Pool::try_checkout_now`]
    /// lends an idle one. `false`: the client gives it back and checks out.
    pub fn unpark(&self, ticket: &Arc<park::Ticket>, conn: &BackendConn, now: Instant) -> bool {
        let kept = self.slots.parking.unpark(ticket)
            && !self.paused.load(Ordering::SeqCst)
            && now.saturating_duration_since(conn.idle_since)
                < Duration::from_millis(self.cfg.health_check_after_ms)
            && !self.spent(conn, now);
        if kept {
            self.stats.checkouts.fetch_add(1, Ordering::Relaxed);
        }
        kept
    }

    /// Takes `ticket` off the parking list, if it is still there (its client left).
    pub fn leave_parking(&self, ticket: &Arc<park::Ticket>) {
        self.slots.parking.unpark(ticket);
    }

    /// Borrows a connection: waits by `priority` (0 = critical … 3 = low) until `deadline`.
    pub async fn checkout(
        self: &Arc<Self>,
        asker: impl Into<Asker>,
        deadline: Instant,
    ) -> Result<Pooled, CheckoutError> {
        self.checkout_at(asker, Instant::now(), deadline).await
    }

    /// [`Pool::checkout`] asked at `now` (the caller's clock reading of this instant).
    pub async fn checkout_at(
        self: &Arc<Self>,
        asker: impl Into<Asker>,
        now: Instant,
        deadline: Instant,
    ) -> Result<Pooled, CheckoutError> {
        let asker = asker.into();
        let mut started = now;
        let mut deadline = deadline;
        if self.paused.load(Ordering::SeqCst) {
            let window = deadline.saturating_duration_since(started);
            self.wait_resumed().await?;
            started = Instant::now();
            deadline = started + window;
        }
        let max_waiting = self.cfg.max_waiting;
        let permit = self
            .slots
            .acquire_at(asker, started, deadline, max_waiting)
            .await
            .map_err(|e| match e {
                SlotError::Full => {
                    self.stats.waiting_refused.fetch_add(1, Ordering::Relaxed);
                    CheckoutError::Full { max_waiting }
                }
                SlotError::WouldWait { place } => CheckoutError::WouldWait {
                    place,
                    limit: deadline.saturating_duration_since(started),
                },
                SlotError::Timeout => {
                    self.stats.checkout_timeouts.fetch_add(1, Ordering::Relaxed);
                    self.slots.waited_out(asker.priority);
                    CheckoutError::Timeout {
                        waited: started.elapsed(),
                        limit: deadline.saturating_duration_since(started),
                    }
                }
            })?;
        self.count_checkout(asker.priority);
        loop {
            while let Some(mut conn) = self.pop_idle() {
                let now = Instant::now();
                if self.spent(&conn, now) {
                    self.close(conn);
                    continue;
                }
                let idle_for = now.saturating_duration_since(conn.idle_since);
                if idle_for >= Duration::from_millis(self.cfg.health_check_after_ms) {
                    let ok = matches!(
                        tokio::time::timeout(Duration::from_secs(2), conn.simple(";")).await,
                        Ok(Ok(b'I'))
                    );
                    if !ok {
                        self.close(conn);
                        continue;
                    }
                }
                return Ok(self.guard(conn, permit));
            }
            // Rather than open one, have a parked one back (for this checkout if the connect
            // waits, else for the next).
            self.slots.parking.revoke_one();
            // `None`: a connection came back idle while this one waited to open one. Boxed:
            // the connect's future is large, and inline it made every checkout future (moved
            // into the session's wait on each checkout) as large.
            if let Some(conn) = Box::pin(self.open_conn(deadline, true)).await? {
                return Ok(self.guard(conn, permit));
            }
        }
    }

    /// An idle connection not to lend again: past its lifetime, to be replaced
    /// ([`Pool::reconnect`]), or with bytes from the server that nobody asked for.
    fn spent(&self, conn: &BackendConn, now: Instant) -> bool {
        conn.expires <= now || self.replaced(conn) || conn.has_pending_input()
    }

    fn pop_idle(&self) -> Option<Box<BackendConn>> {
        self.idle.lock().pop()
    }

    fn guard(self: &Arc<Self>, conn: Box<BackendConn>, permit: SlotPermit) -> Pooled {
        Pooled {
            conn: Some(conn),
            pool: self.clone(),
            permit,
        }
    }

    /// The last connect error while the failure backoff lasts.
    fn backing_off(&self) -> Option<Arc<ConnectError>> {
        let b = self.backoff.lock();
        match (b.until, &b.last_error) {
            (Some(until), Some(e)) if Instant::now() < until => Some(e.clone()),
            _ => None,
        }
    }

    /// Opens a new connection, respecting the attempt cap, the shared caps and the failure
    /// backoff. `for_checkout`: `None` when a connection of this pool is idle or comes back
    /// idle while it waits (the checkout takes that one instead of waiting on for a unit it
    /// may never get); the `min_idle` upkeep opens one whatever is idle.
    async fn open_conn(
        &self,
        deadline: Instant,
        for_checkout: bool,
    ) -> Result<Option<Box<BackendConn>>, CheckoutError> {
        if let Some(e) = self.backing_off() {
            return Err(CheckoutError::Connect(e));
        }
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        self.connect_waiting.fetch_add(1, Ordering::AcqRel);
        let waiting = Waiting(&self.connect_waiting);
        let returned = self.returned.notified();
        tokio::pin!(returned);
        returned.as_mut().enable();
        if for_checkout && !self.idle.lock().is_empty() {
            return Ok(None);
        }
        let _attempt = tokio::select! {
            biased;
            _ = returned.as_mut(), if for_checkout => return Ok(None),
            p = tokio::time::timeout_at(deadline, self.attempts.acquire()) => match p {
                Ok(Ok(p)) => p,
                _ => {
                    return Err(CheckoutError::Timeout {
                        waited: Duration::ZERO,
                        limit: Duration::ZERO,
                    });
                }
            },
        };
        // Those queued behind the attempts that just failed back off too, instead of each
        // trying in turn.
        if let Some(e) = self.backing_off() {
            return Err(CheckoutError::Connect(e));
        }
        let units = tokio::select! {
            biased;
            _ = returned.as_mut(), if for_checkout => return Ok(None),
            u = caps::take_all(&self.caps, self, deadline) => u.map_err(CheckoutError::Capped)?,
        };
        drop(waiting);
        self.stats.connects.fetch_add(1, Ordering::Relaxed);
        let params = Arc::clone(&self.connect.lock());
        match BackendConn::connect(&params, self.cfg.prepared_cache_size).await {
            Ok(mut conn) => {
                units.keep();
                conn.prepared = prepared::PreparedCache::new(
                    self.cfg.prepared_cache_size,
                    self.cfg.prepared_cache_bytes,
                );
                let life = Duration::from_millis(self.cfg.max_lifetime_ms);
                let jitter = life.mul_f64(rand::random::<f64>() * 0.1);
                conn.expires = conn.created + life - jitter;
                self.open.fetch_add(1, Ordering::Relaxed);
                {
                    let mut sp = self.server_params.lock();
                    if sp.is_none() {
                        *sp = Some(conn.server_params.as_slice().into());
                    }
                }
                let mut b = self.backoff.lock();
                b.failures = 0;
                b.until = None;
                b.last_error = None;
                Ok(Some(Box::new(conn)))
            }
            Err(e) => {
                drop(units);
                self.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
                let e = Arc::new(e);
                let mut b = self.backoff.lock();
                b.failures = b.failures.saturating_add(1);
                // The first failure's window is the base, then it doubles up to the cap.
                let wait = crate::policy::refusal::full_jitter_ms(
                    self.cfg.connect_backoff_base_ms,
                    self.cfg.connect_backoff_cap_ms,
                    b.failures - 1,
                );
                b.until = Some(Instant::now() + Duration::from_millis(wait));
                b.last_error = Some(e.clone());
                tracing::warn!(pool = %self.name, error = %e, failures = b.failures, "backend connect failed");
                Err(CheckoutError::Connect(e))
            }
        }
    }

    fn close(&self, conn: Box<BackendConn>) {
        self.stats.discards.fetch_add(1, Ordering::Relaxed);
        self.open.fetch_sub(1, Ordering::Relaxed);
        drop(conn);
        for c in &self.caps {
            c.give();
        }
    }

    /// Puts a clean connection back (LIFO, so a hot few stay warm and the rest age out).
    /// `since`: when it went idle (now, or when its client parked it).
    fn put_idle(&self, mut conn: Box<BackendConn>, now: Instant, since: Instant) {
        if conn.expires <= now || self.replaced(&conn) {
            self.close(conn);
            return;
        }
        // Another pool sharing a full cap waits with far fewer connections: the unit is
        // worth more there than this idle connection here.
        if self.caps.iter().any(|c| c.should_yield(self)) {
            self.close(conn);
            return;
        }
        conn.idle_since = since;
        {
            // In idle order, most recent last (LIFO lends it first): a parked connection
            // comes back with the time its client parked it, perhaps before others'.
            let mut idle = self.idle.lock();
            let at = idle
                .iter()
                .rposition(|c| c.idle_since <= since)
                .map_or(0, |i| i + 1);
            idle.insert(at, conn);
        }
        if self.connect_waiting.load(Ordering::Acquire) > 0 {
            self.returned.notify_waiters();
        }
        for c in &self.caps {
            c.idle_returned();
        }
    }

    /// ParameterStatus values from the server, once any connection has logged in.
    /// The ParameterStatus values of the pool's first connection (shared, not copied).
    pub fn server_params(&self) -> Option<ServerParams> {
        self.server_params.lock().clone()
    }

    /// How the server reports setting `name` once set to `value` (learned at a login).
    pub fn canonical(&self, name: &str, value: &str) -> Option<String> {
        self.canonical.lock().get(name)?.get(value).cloned()
    }

    /// Whether `canonical` knows (`name`, `value`), without copying the answer.
    pub fn knows_canonical(&self, name: &str, value: &str) -> bool {
        self.canonical
            .lock()
            .get(name)
            .is_some_and(|m| m.contains_key(value))
    }

    pub fn learn_canonical(&self, name: &str, value: &str, reported: &str) {
        let mut c = self.canonical.lock();
        if c.values().map(HashMap::len).sum::<usize>() < 10_000 {
            let old = c
                .entry(name.to_owned())
                .or_default()
                .insert(value.to_owned(), reported.to_owned());
            if old.is_some_and(|o| o != reported) {
                // The server reports it otherwise now: no greeting built from the old answer.
                self.greetings.lock().clear();
            }
        }
    }

    /// A pool with default settings that never connects, for unit tests of what it
    /// remembers.
    #[cfg(test)]
    pub(crate) fn unconnected() -> Arc<Pool> {
        Pool::new(
            "d",
            "u",
            PoolConfig::default(),
            ConnectParams::blank(crate::tls::BackendTlsHandle::disabled()),
            Vec::new(),
        )
    }

    /// The ParameterStatus messages remembered for a client with these startup settings,
    /// with the pool's own list equal to them (the one the greeting is kept under). A session
    /// that takes that list in place of its own finds a backend's settings equal to its own by
    /// pointer ([`crate::pool::BackendConn::applied`]), without reading the strings of either,
    /// which at hundreds of sessions have long left the cache.
    pub fn greeting(
        &self,
        settings: &[(String, String)],
    ) -> Option<(bytes::Bytes, crate::protocol::params::Shared)> {
        self.greetings
            .lock()
            .get_key_value(settings)
            .map(|(k, v)| (v.clone(), Arc::clone(k)))
    }

    /// Remembers the ParameterStatus messages of a client with these startup settings (not
    /// beyond [`GREETINGS`] lists: then each such login builds its own).
    pub fn remember_greeting(
        &self,
        settings: &crate::protocol::params::Shared,
        greeting: bytes::Bytes,
    ) {
        let mut g = self.greetings.lock();
        if g.len() < GREETINGS {
            g.insert(Arc::clone(settings), greeting);
        }
    }

    /// Closes idle connections past their lifetime, and those idle longer than
    /// `idle_timeout_ms` while more than `min_idle` are idle; then opens connections until
    /// `min_idle` are idle. Called every second by the app.
    pub async fn maintain(self: &Arc<Self>) {
        // Parked backends come back once a tick: idle ones then age out and are checked as
        // every idle connection is.
        self.slots.parking.revoke_all();
        self.slots.tick(Instant::now());
        let idle_timeout = Duration::from_millis(self.cfg.idle_timeout_ms);
        let now = Instant::now();
        let stale: Vec<Box<BackendConn>> = {
            let mut idle = self.idle.lock();
            let keep = self.cfg.min_idle;
            let mut stale = Vec::new();
            let mut i = 0;
            while i < idle.len() {
                let c = &idle[i];
                // An expired connection goes even at `min_idle` (the refill below replaces it
                // with a fresh one); one merely idle for long only above `min_idle`.
                let expired = c.expires <= now;
                let unneeded = idle.len() > keep
                    && now.saturating_duration_since(c.idle_since) >= idle_timeout;
                if expired || unneeded {
                    stale.push(idle.remove(i));
                } else {
                    i += 1;
                }
            }
            stale
        };
        for c in stale {
            self.close(c);
        }
        self.fill_min_idle().await;
    }

    /// Opens connections, one at a time, until `min_idle` are idle. Each is opened under a
    /// low-priority slot taken only if one is free within 100 ms (clients come first), and
    /// only while fewer than `size` are open; the first failure ends the round (the connect
    /// backoff then applies to the next one). The connection goes to the idle list itself:
    /// it is fresh, with no session state to reset.
    async fn fill_min_idle(self: &Arc<Self>) {
        let missing = self.cfg.min_idle.saturating_sub(self.idle.lock().len());
        let connect_timeout = self.connect.lock().connect_timeout;
        for _ in 0..missing {
            if self.idle.lock().len() >= self.cfg.min_idle {
                return;
            }
            let deadline = Instant::now() + Duration::from_millis(100);
            let Ok(permit) = self.slots.acquire(3, deadline, usize::MAX).await else {
                return;
            };
            if self.open.load(Ordering::Relaxed) >= self.cfg.size {
                return;
            }
            let Ok(Some(conn)) = self
                .open_conn(Instant::now() + connect_timeout, false)
                .await
            else {
                return;
            };
            let now = Instant::now();
            self.put_idle(conn, now, now);
            // After the connection is idle, so a client woken by this slot finds it.
            drop(permit);
        }
    }

    pub fn snapshot(&self) -> PoolSnapshot {
        let idle = self.idle.lock().len();
        let parked = self.slots.parking.len();
        let open = self.open.load(Ordering::Relaxed);
        PoolSnapshot {
            name: self.name.clone(),
            mode: match self.cfg.mode {
                PoolMode::Transaction => "transaction",
                PoolMode::Session => "session",
            },
            size: self.cfg.size,
            open,
            idle,
            active: open.saturating_sub(idle + parked),
            parked,
            waiting: self.slots.waiting(),
            pinned: self.stats.pinned_clients.load(Ordering::Relaxed),
            listening: self.notify.counts().0,
            listen_channels: self.notify.counts().1,
            connects: self.stats.connects.load(Ordering::Relaxed),
            connect_failures: self.stats.connect_failures.load(Ordering::Relaxed),
            checkout_timeouts: self.stats.checkout_timeouts.load(Ordering::Relaxed),
            critical_reserve: self.slots.reserve(),
            adaptive_limit: self.adaptive.as_ref().map(|a| a.lock().limit()),
            priority_caps: self.slots.caps(),
            max_waiting: self.cfg.max_waiting,
            waiting_refused: self.stats.waiting_refused.load(Ordering::Relaxed),
            arrival: self.slots.arrival_stats(),
            session_checks: self.stats.verifications.load(Ordering::Relaxed),
            session_check_differences: self.stats.verify_differences.load(Ordering::Relaxed),
            paused: self.is_paused(),
            replica: self.replica,
            replica_lag_ms: self
                .replica
                .then(|| self.replica_lag_ms.load(Ordering::Relaxed)),
            replica_healthy: self
                .replica
                .then(|| self.replica_healthy.load(Ordering::Relaxed)),
            replica_replay_lsn: self
                .replica_replay_lsn()
                .filter(|l| self.replica && *l != wal::Lsn::MAX)
                .map(|l| l.to_string()),
            database: self.database.clone(),
            user: self.user.clone(),
            checkouts: self.stats.checkouts.load(Ordering::Relaxed),
            transactions: self.stats.transactions.load(Ordering::Relaxed),
            queries: self.stats.queries.load(Ordering::Relaxed),
            bytes_received: self.stats.bytes_received.load(Ordering::Relaxed),
            bytes_sent: self.stats.bytes_sent.load(Ordering::Relaxed),
            transaction_us: self.stats.transaction_us.load(Ordering::Relaxed),
            query_us: self.stats.query_us.load(Ordering::Relaxed),
            wait_us: self.stats.wait_us.load(Ordering::Relaxed),
            fair_shares: self.slots.fair(),
            caller_time: self.slots.shares(Instant::now()),
        }
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct PoolSnapshot {
    pub name: String,
    /// Waiters of one priority are served by their callers' backend time.
    pub fair_shares: bool,
    /// Backend time by caller (every caller whose units held one of its backends).
    pub caller_time: Vec<ShareStats>,
    pub mode: &'static str,
    pub size: usize,
    pub open: usize,
    pub idle: usize,
    pub active: usize,
    /// Backends kept by an idle client while nobody waits (idle on the server; given back
    /// when a checkout has to wait).
    pub parked: usize,
    pub waiting: usize,
    pub pinned: usize,
    /// Clients listening through the pool's listener connection (transaction mode).
    pub listening: usize,
    /// Channels the listener connection listens on.
    pub listen_channels: usize,
    pub connects: u64,
    pub connect_failures: u64,
    pub checkout_timeouts: u64,
    /// Backends only critical callers may take.
    pub critical_reserve: usize,
    /// The adaptive limit now (`None`: off).
    pub adaptive_limit: Option<usize>,
    /// Most backends each priority (critical, high, normal, low) may hold now.
    pub priority_caps: [usize; slots::PRIORITIES],
    pub max_waiting: usize,
    pub waiting_refused: u64,
    /// What the arrival decisions of its queues did: refused on arrival, after a wait, and
    /// how close the retry hints were.
    pub arrival: crate::policy::arrival::ArrivalStats,
    /// Sessions checked against Postgres after an unproven unit (`verify.rs`).
    pub session_checks: u64,
    /// Checks that found state the proxy could not see (each also reset).
    pub session_check_differences: u64,
    /// Paused by an operator (`POST /v1/pools/{db}/{user}/pause`).
    pub paused: bool,
    /// A pool of the database's replicas, with its last probe.
    pub replica: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_lag_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_healthy: Option<bool>,
    /// The WAL position the replica had replayed at its last good probe (`16/B374D848`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_replay_lsn: Option<String>,
    pub database: String,
    pub user: String,
    /// Backends handed to clients (PgBouncer's `server_assignment_count`).
    pub checkouts: u64,
    pub transactions: u64,
    pub queries: u64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub transaction_us: u64,
    pub query_us: u64,
    pub wait_us: u64,
}

impl CheckoutError {
    /// When a client refused on arrival should come back (its retry hint as is). Other
    /// refusals are hinted from the pool's drain rate ([`Pool::expected_wait`]).
    pub fn arrival_retry(&self) -> Option<Duration> {
        match self {
            CheckoutError::WouldWait { place, .. } => Some(place.retry),
            _ => None,
        }
    }

    /// The error the client sees; `retry_after_ms` is its hint (the caller's retry policy).
    pub fn to_pg(&self, pool: &str, retry_after_ms: u64) -> PgError {
        match self {
            CheckoutError::WouldWait { place, limit } => PgError::checkout_would_wait(
                pool,
                place.place.as_millis(),
                limit.as_micros().div_ceil(1000),
                retry_after_ms,
            ),
            CheckoutError::Timeout { waited, limit } => PgError::checkout_timeout(
                pool,
                waited.as_millis(),
                // The deadline was taken a moment before the wait started: round up.
                limit.as_micros().div_ceil(1000),
                retry_after_ms,
            ),
            CheckoutError::Connect(e) => match &**e {
                ConnectError::Server { code, message, .. } => {
                    // Server refusals (e.g. 3D000 unknown database) keep their SQLSTATE.
                    let code: &'static str = match code.as_str() {
                        "3D000" => "3D000",
                        "28P01" => "28P01",
                        "28000" => "28000",
                        "53300" => "53300",
                        "57P03" => "57P03",
                        _ => "08006",
                    };
                    let e = PgError::error(code, message.clone());
                    // Too many connections or a server starting: retrying later can help.
                    match code {
                        "53300" | "57P03" | "08006" => {
                            e.with_hint(format!("retry_after_ms={retry_after_ms}"))
                        }
                        _ => e,
                    }
                }
                other => PgError::backend_unavailable(other, retry_after_ms),
            },
            CheckoutError::Full { max_waiting } => PgError::error(
                "53300",
                format!(
                    "pgsluice: ERR_QUEUE_FULL: no backend connection of pool {pool} is free and \
                     {max_waiting} clients are already waiting for one"
                ),
            )
            .with_detail(format!("limit: pool {pool} max_waiting={max_waiting}"))
            .with_hint(format!("retry_after_ms={retry_after_ms}")),
            CheckoutError::Capped(full) => PgError::error(
                "53300",
                format!(
                    "pgsluice: ERR_QUEUE_TIMEOUT: pool {pool} could not open a backend \
                     connection: {} has its {} connections open",
                    full.name, full.limit
                ),
            )
            .with_detail(format!(
                "limit: {} max connections={}",
                full.name, full.limit
            ))
            .with_hint(format!("retry_after_ms={retry_after_ms}")),
            CheckoutError::Paused { held } => PgError::error(
                "53300",
                format!(
                    "pgsluice: ERR_POOL_PAUSED: pool {pool} is paused by an operator and was not \
                     resumed within {} ms",
                    held.as_millis()
                ),
            )
            .with_detail(format!("pool {pool} paused (POST /v1/pools/…/resume)"))
            .with_hint(format!("retry_after_ms={retry_after_ms}")),
        }
    }
}

/// A borrowed connection. Dropping it without [`Pooled::release`] closes the connection:
/// anything that ends a session early can never hand a half-used connection to someone else.
pub struct Pooled {
    conn: Option<Box<BackendConn>>,
    pool: Arc<Pool>,
    permit: SlotPermit,
}

impl Pooled {
    pub fn conn(&mut self) -> &mut BackendConn {
        self.parts().1
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The pool and the connection at once (no reference count taken to hold the pool).
    pub fn parts(&mut self) -> (&Pool, &mut BackendConn) {
        // Only `release`/`discard` take the connection, and they consume `self`.
        let conn = self
            .conn
            .as_mut()
            .expect("pooled connection present until release");
        (&self.pool, conn)
    }

    /// Returns a connection that is idle (ReadyForQuery 'I', nothing outstanding) to the pool,
    /// resetting whatever session state the client left on it first.
    pub async fn release(self) {
        self.release_at(Instant::now()).await;
    }

    /// [`Pooled::release`] with the caller's clock reading `now`, the idle stamp when no
    /// reset runs (after a reset the clock is read again).
    pub async fn release_at(mut self, mut now: Instant) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        if conn.dirty.any() {
            if !self.clean(&mut conn).await {
                self.pool.close(conn);
                return;
            }
            now = Instant::now();
        }
        if let Some(claim) = self.pool.catalog.claim(now) {
            let mut out = BytesMut::new();
            messages::query(&mut out, catalog::CATALOG_SQL);
            let names = rows(&mut conn, &out, 1, one_text).await;
            let ok = names.is_some();
            self.pool.catalog.finish(claim, names, now);
            if !ok {
                self.pool.close(conn);
                return;
            }
            now = Instant::now();
        }
        self.pool.put_idle(conn, now, now);
        self.permit.end_at(now);
    }

    /// Whether [`Pooled::release_at`] has a query to run (a reset, a check, a catalog
    /// refresh), so the caller may let it finish off its own path.
    pub fn release_has_work(&self, now: Instant) -> bool {
        self.conn.as_ref().is_some_and(|c| c.dirty.any()) || self.pool.catalog.claimable(now)
    }

    /// Counts and logs a session check that found state the text did not show (`found`), or
    /// that failed (`None`: the connection is then closed), naming the statement's
    /// fingerprint.
    fn report(&self, conn: &BackendConn, found: Option<&verify::Found>) {
        self.pool
            .stats
            .verify_differences
            .fetch_add(1, Ordering::Relaxed);
        let fingerprint = crate::classify::fingerprint_hex(conn.unproven_fingerprint);
        match found {
            None => tracing::warn!(
                pool = %self.pool.name,
                %fingerprint,
                "the session check failed; the server connection is closed"
            ),
            Some(f) => tracing::warn!(
                pool = %self.pool.name,
                %fingerprint,
                found = %f.shown.join(", "),
                differences = f.count,
                "a statement left session state the proxy could not see in its text; reset"
            ),
        }
    }

    /// Undoes what the client left on `conn` (`conn.dirty`): the targeted resets, `DISCARD
    /// ALL`, or the check against Postgres (`verify.rs`). `false`: close it instead.
    async fn clean(&self, conn: &mut BackendConn) -> bool {
        let dirt = conn.dirty;
        if dirt.catalog {
            // After the unit's commit: a snapshot read meanwhile may predate it.
            self.pool.catalog.invalidate();
        }
        let Some(sql) = dirt.reset_sql() else {
            return false;
        };
        if !sql.is_empty() {
            self.pool.stats.resets.fetch_add(1, Ordering::Relaxed);
            if !run(conn, &sql).await {
                return false;
            }
        }
        if dirt.sql_prepared || dirt.all {
            conn.prepared.clear();
            conn.stale.clear();
        }
        if dirt.gucs || dirt.all {
            // RESET ALL also undid the client startup parameters (before the check below,
            // which puts back only what the backend still carries).
            conn.applied = Default::default();
        }
        let seed = || rand::random_range(-1.0..=1.0f64);
        if dirt.all {
            // DISCARD ALL leaves random()'s seed as the client may have chosen it.
            if !run(conn, &format!("SELECT pg_catalog.setseed({:.17})", seed())).await {
                return false;
            }
        } else if dirt.verify {
            self.pool
                .stats
                .verifications
                .fetch_add(1, Ordering::Relaxed);
            let login = crate::protocol::params::literal(&self.pool.login_user());
            let settings = self.pool.checked.first(conn.unproven_fingerprint);
            let mut resets = verify::resets_sql(seed());
            // RESET ALL also undid the client startup parameters the proxy applied: put them
            // back in the same request, so the backend still carries `conn.applied`.
            if let Some(again) = crate::protocol::params::apply_sql(&[], &conn.applied) {
                resets.push(';');
                resets.push_str(&again);
            }
            let check = verify::check_sql(&login, settings);
            let mut out = BytesMut::new();
            let readies = if settings {
                messages::query(&mut out, &format!("{check};{resets}"));
                1
            } else {
                prepared_check(conn, &check, &mut out);
                messages::query(&mut out, &resets);
                2
            };
            let Some(rows) = rows(conn, &out, readies, verify::row).await else {
                self.report(conn, None);
                return false;
            };
            let found = verify::judge(&rows, &conn.applied);
            if found.any() {
                self.report(conn, Some(&found));
                if found.beyond_settings && !run(conn, "DISCARD ALL").await {
                    return false;
                }
            }
            if found.beyond_settings {
                conn.prepared.clear();
                conn.stale.clear();
                conn.applied = Default::default();
            }
        }
        conn.dirty = Dirt::default();
        true
    }

    /// Returns a parked connection ([`Pool::park`]; clean, as parking requires): idle since
    /// its client parked it, so its idle timeout and health check count from then.
    pub fn release_parked(mut self, now: Instant) {
        if let Some(conn) = self.conn.take() {
            let since = conn.idle_since;
            self.pool.put_idle(conn, now, since);
        }
        self.permit.end_at(now);
    }

    /// Closes the connection instead of reusing it.
    pub fn discard(mut self) {
        if let Some(c) = self.conn.take() {
            self.pool.close(c);
        }
    }
}

/// How long a reset, a check or a catalog read may take before the connection is closed.
const RESET_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs `sql` on `conn`; `true` when it ended idle without an error.
async fn run(conn: &mut BackendConn, sql: &str) -> bool {
    matches!(
        tokio::time::timeout(RESET_TIMEOUT, conn.simple(sql)).await,
        Ok(Ok(b'I'))
    )
}

/// The DataRows of the first statement of the request `out` (ending in `readies`
/// ReadyForQuery messages) read by `parse` (rows it does not read, and the rows of later
/// statements, are skipped); `None` when it failed, or did not end idle within
/// [`RESET_TIMEOUT`].
async fn rows<T>(
    conn: &mut BackendConn,
    out: &[u8],
    readies: usize,
    parse: fn(&[u8]) -> Option<T>,
) -> Option<Vec<T>> {
    let mut rows = Vec::new();
    let mut first = true;
    let read = tokio::time::timeout(
        RESET_TIMEOUT,
        conn.request(out, readies, |tag, body| match tag {
            b'D' if first => {
                if let Some(r) = parse(body) {
                    rows.push(r);
                }
            }
            b'C' => first = false,
            _ => {}
        }),
    )
    .await;
    matches!(read, Ok(Ok(b'I'))).then_some(rows)
}

/// Frames the check `sql` (no parameters) as Bind, Execute and Sync of a statement prepared
/// on `conn` once (a Parse first when its cache lacks it, after closing what that evicts).
fn prepared_check(conn: &mut BackendConn, sql: &str, out: &mut BytesMut) {
    const NO_TYPES: &[u8] = b"\0\0";
    let hash = xxhash_rust::xxh3::xxh3_64_with_seed(sql.as_bytes(), CHECK_SEED);
    let name = prepared::server_name(hash);
    let lookup = conn.prepared.touch(hash, sql.as_bytes(), NO_TYPES);
    if lookup == prepared::Lookup::Collision {
        // Another text under this name: closed before this one is prepared.
        messages::target(out, b'C', b'S', &name);
    }
    if lookup != prepared::Lookup::Hit {
        for old in conn.prepared.insert(hash, sql.as_bytes(), NO_TYPES) {
            messages::target(out, b'C', b'S', &prepared::server_name(old));
        }
        messages::parse_named(out, &name, sql.as_bytes(), NO_TYPES);
    }
    // No parameters, text results.
    messages::bind_renamed(out, b"", &name, b"\0\0\0\0\0\0");
    messages::raw(out, b'E', &[b"\0", &0i32.to_be_bytes()]);
    messages::raw(out, b'S', &[]);
}

/// Seeds the hash that names the check's prepared statement (apart from the clients', which
/// are seeded per process).
const CHECK_SEED: u64 = 0x05e5_510c_4ec4;

/// The one text column of a DataRow (NULL and other shapes: `None`).
fn one_text(body: &[u8]) -> Option<String> {
    if body.get(..2)? != [0, 1] {
        return None;
    }
    let n = usize::try_from(i32::from_be_bytes(body.get(2..6)?.try_into().ok()?)).ok()?;
    Some(String::from_utf8_lossy(body.get(6..6 + n)?).into_owned())
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(c) = self.conn.take() {
            self.pool.close(c);
        }
    }
}

/// All pools, created on first use of a (database, user) and bounded: the names come from
/// clients (any database name a client asks for), so a pool nobody uses and that holds no
/// connection is dropped (by [`Pools::sweep`] and whenever the map is full), and beyond
/// `max` pools a new one is refused.
#[derive(Default)]
pub struct Pools {
    map: Mutex<HashMap<(String, String), Arc<Pool>>>,
    /// Shared limits by name (`database X`, `user Y`), made with the first pool that needs
    /// them and dropped with the last.
    caps: Mutex<HashMap<String, Arc<caps::Cap>>>,
}

/// A (database, user) key of [`Pools`], owned in the map and borrowed in a lookup: a login
/// finds its pool without making two strings for the key.
trait PoolKey {
    fn parts(&self) -> (&str, &str);
}

impl PoolKey for (String, String) {
    fn parts(&self) -> (&str, &str) {
        (&self.0, &self.1)
    }
}

impl PoolKey for (&str, &str) {
    fn parts(&self) -> (&str, &str) {
        (self.0, self.1)
    }
}

impl<'a> std::borrow::Borrow<dyn PoolKey + 'a> for (String, String) {
    fn borrow(&self) -> &(dyn PoolKey + 'a) {
        self
    }
}

/// As the owned tuple hashes: field by field.
impl std::hash::Hash for dyn PoolKey + '_ {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.parts().hash(h);
    }
}

impl PartialEq for dyn PoolKey + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for dyn PoolKey + '_ {}

/// No session holds the pool (the map's is the only reference) and it has no connection.
fn unused(p: &Arc<Pool>) -> bool {
    Arc::strong_count(p) == 1 && p.open.load(Ordering::Relaxed) == 0 && !p.is_paused()
}

impl Pools {
    /// The pool of (database, user), made with `make` if there is none; `None` when `max`
    /// pools exist and none of them is unused.
    pub fn get_or_create(
        &self,
        database: &str,
        user: &str,
        max: usize,
        make: impl FnOnce() -> Arc<Pool>,
    ) -> Option<Arc<Pool>> {
        let mut m = self.map.lock();
        if let Some(p) = m.get(&(database, user) as &dyn PoolKey) {
            return Some(p.clone());
        }
        if m.len() >= max {
            m.retain(|_, p| !unused(p));
            if m.len() >= max {
                return None;
            }
        }
        let p = make();
        m.insert((database.to_string(), user.to_string()), p.clone());
        Some(p)
    }

    /// The pool of (database, user), if a client created it.
    pub fn get(&self, database: &str, user: &str) -> Option<Arc<Pool>> {
        self.map
            .lock()
            .get(&(database, user) as &dyn PoolKey)
            .cloned()
    }

    /// Drops unused pools (and caps no pool uses); returns how many pools.
    pub fn sweep(&self) -> usize {
        let swept = {
            let mut m = self.map.lock();
            let before = m.len();
            m.retain(|_, p| !unused(p));
            before - m.len()
        };
        // A cap is held by its pools (and their connections, through them): one only the
        // map holds is unused.
        self.caps.lock().retain(|_, c| Arc::strong_count(c) > 1);
        swept
    }

    /// The caps of a new (database, user) pool: `max_db_connections` of `database` and
    /// `max_user_connections` of `user` (a limit of 0 counts without limiting).
    pub fn caps_for(&self, database: &str, user: &str, cfg: &PoolConfig) -> Vec<Arc<caps::Cap>> {
        let mut m = self.caps.lock();
        let mut get = |name: String, limit: usize| {
            Arc::clone(
                m.entry(name.clone())
                    .or_insert_with(|| caps::Cap::new(name, limit)),
            )
        };
        vec![
            get(format!("database {database}"), cfg.max_db_connections),
            get(format!("user {user}"), cfg.max_user_connections),
        ]
    }

    /// A reload's limits, applied to every cap by its name (`database X`, `user Y`).
    pub fn set_cap_limits(&self, limit_of: impl Fn(&str) -> usize) {
        for (name, c) in self.caps.lock().iter() {
            c.set_limit(limit_of(name));
        }
    }

    /// The caps in use, by name.
    pub fn cap_snapshots(&self) -> Vec<caps::CapSnapshot> {
        let mut v: Vec<caps::CapSnapshot> =
            self.caps.lock().values().map(|c| c.snapshot()).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.lock().is_empty()
    }

    pub fn all(&self) -> Vec<Arc<Pool>> {
        self.map.lock().values().cloned().collect()
    }
}

impl crate::notify::ListenSource for Pool {
    fn connect_params(&self) -> Arc<ConnectParams> {
        Pool::connect_params(self)
    }

    fn name(&self) -> &str {
        &self.name
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn settings(name: &str, value: &str) -> crate::protocol::params::Shared {
        Arc::from([(name.to_owned(), value.to_owned())])
    }

    /// A greeting is remembered per startup-settings list, kept while the server reports the
    /// settings as before, forgotten when it reports one otherwise, and not remembered beyond
    /// `GREETINGS` lists.
    #[test]
    fn greetings_are_remembered_per_settings_and_forgotten_when_a_report_changes() {
        let p = Pool::unconnected();
        let iso = settings("DateStyle", "iso");
        assert!(p.greeting(&iso).is_none());
        p.learn_canonical("DateStyle", "iso", "ISO, MDY");
        p.remember_greeting(&iso, Bytes::from_static(b"S..."));
        assert_eq!(p.greeting(&iso).unwrap().0, Bytes::from_static(b"S..."));
        assert!(p.greeting(&[]).is_none(), "another list has no greeting");
        p.learn_canonical("DateStyle", "iso", "ISO, MDY");
        assert!(p.greeting(&iso).is_some(), "the same answer keeps it");
        p.learn_canonical("DateStyle", "iso", "ISO, DMY");
        assert!(
            p.greeting(&iso).is_none(),
            "a greeting built from an answer the server no longer gives"
        );
        for i in 0..GREETINGS + 5 {
            p.remember_greeting(&settings("application_name", &i.to_string()), Bytes::new());
        }
        assert_eq!(p.greetings.lock().len(), GREETINGS);
    }

    /// A login whose settings the pool has met gets the pool's list with the greeting (so a
    /// backend's applied list is found equal by pointer); the list it was remembered under is
    /// the first login's own.
    #[test]
    fn a_greeting_comes_with_the_remembered_list() {
        let p = Pool::unconnected();
        let first = settings("application_name", "web");
        p.remember_greeting(&first, Bytes::from_static(b"S..."));
        // An equal list from another login: the remembered one.
        let second = settings("application_name", "web");
        assert!(!Arc::ptr_eq(&second, &first));
        let (greeting, list) = p.greeting(&second).expect("remembered");
        assert_eq!(&greeting[..], b"S...");
        assert!(Arc::ptr_eq(&list, &first));
        // A different list has none.
        assert!(p.greeting(&settings("application_name", "batch")).is_none());
    }

    /// The door reads the pace of non-critical checkouts: a critical caller served at 400 a
    /// second from its reserve says nothing of when a queue of normal work moves; a normal
    /// pace that fits lets logins in; a queue at `pool.max_waiting` holds them whatever the
    /// pace.
    #[tokio::test(start_paused = true)]
    async fn the_door_reads_the_pace_of_non_critical_checkouts() {
        let p = Pool::unconnected();
        let room = Duration::from_secs(2);
        let held: Vec<_> = std::iter::from_fn(|| p.slots.try_acquire(1, Instant::now()))
            .take(100)
            .collect();
        assert!(!held.is_empty() && p.slots.try_acquire(1, Instant::now()).is_none());
        let far = Instant::now() + Duration::from_secs(60);
        let waiters: Vec<_> = (0..5)
            .map(|_| {
                let s = Arc::clone(&p.slots);
                tokio::spawn(async move { s.acquire(1, far, 1000).await.map(drop) })
            })
            .collect();
        tokio::task::yield_now().await;
        assert_eq!(p.slots.queued_now(), 5);
        assert!(p.crowded(room, 0), "the pace is not known yet");

        tokio::time::advance(Duration::from_secs(1)).await;
        for _ in 0..400 {
            p.count_checkout(0);
        }
        assert!(
            p.crowded(room, 0),
            "only critical checkouts: the normal queue did not move"
        );

        tokio::time::advance(Duration::from_secs(1)).await;
        for _ in 0..100 {
            p.count_checkout(2);
        }
        assert_eq!(p.stats.checkouts.load(Ordering::Relaxed), 500);
        assert!(!p.crowded(room, 0), "six at 100 a second: 60 ms");
        let full = p.cfg.max_waiting - 5;
        assert!(p.crowded(room, full), "the queue would be full");
        drop(held);
        for w in waiters {
            w.abort();
        }
    }
}
