//! Shared state of a running proxy: the config snapshot, credentials, pools, cancel keys and
//! counters. Sessions and the admin API read it; reload swaps the snapshot atomically.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::auth::Credentials;
use crate::cancel;
use crate::classify::{CallerMatcher, CallerRule, Classified, Classifier, StmtKind};
use crate::config::{self as cfgmod, Config, PeerConfig};
use crate::fleet::Fleet;
use crate::observe::metrics::Metrics;
use crate::observe::stats::FingerprintStats;
use crate::policy::breaker::BreakerSettings;
use crate::policy::rules::RuleSet;
use crate::policy::{CallerPolicy, Policy, Priority, RetryPolicy, Scope};
use crate::pool::{ConnectParams, Pool, Pools};
use crate::protocol::PgError;
use crate::runtime::Runtime;

pub struct App {
    /// Config, credentials and the caller tables of one configuration, swapped as one on
    /// reload (see [`Runtime`]).
    pub runtime: ArcSwap<Runtime>,
    /// The generation of the snapshot in `runtime`, written after each swap: a session asks
    /// whether its snapshot is still current with one load ([`App::newer_runtime`]).
    runtime_generation: AtomicU64,
    /// Serialises reloads: each builds its caller table on the one installed before it.
    reload_lock: parking_lot::Mutex<()>,
    pub pools: Pools,
    /// The pools the config names that keep `min_idle` connections open from the start
    /// ([`App::warm_pools`]); held here so the sweep of unused pools leaves them (and their
    /// connect backoff) alone.
    warm: parking_lot::Mutex<Vec<Arc<Pool>>>,
    pub cancels: Arc<cancel::Registry>,
    pub stats: AppStats,
    /// Admission control: caller limits, rate buckets, breaker, runtime fingerprint rules.
    pub policy: Policy,
    /// Statement fingerprints, kinds and session effects, cached by text.
    pub classifier: Classifier,
    /// What `classify.enabled: false` reports for every statement: nothing is known, so
    /// every statement is assumed to have touched the session (`DISCARD ALL` before reuse).
    pub unclassified: Arc<Classified>,
    /// A FunctionCall ('F') message: a function by OID, which may do anything to the session.
    pub function_call: Arc<Classified>,
    /// A Bind of a statement name the proxy does not know (an SQL-level `PREPARE`d name, or a
    /// guessed one): admitted like any statement, assumed to have touched the session.
    pub unknown_statement: Arc<Classified>,
    /// Seed of the hashes that name shared prepared statements (random per process, so
    /// collisions cannot be crafted; texts are compared on reuse as well).
    pub statement_seed: u64,
    /// Per-fingerprint statistics (top-K by total time, the rest aggregated).
    pub fp_stats: FingerprintStats,
    /// Prometheus metrics; per-caller handles follow the caller table across reloads.
    pub metrics: Metrics,
    /// Keys clients of verifier-only users proved (SCRAM pass-through), by user name; the
    /// proxy logs in to Postgres with them. Memory only, bounded.
    pub pass_keys: PassKeys,
    /// Answers of `auth.auth_query` by user name.
    pub auth_cache: crate::auth::cache::AuthCache,
    /// Databases an operator closed to new client connections (`POST
    /// /v1/databases/{db}/disable`); sessions already open are not touched.
    pub disabled: parking_lot::RwLock<std::collections::BTreeSet<String>>,
    /// Budgets of the optional connection and refusal log lines (`log.*`).
    pub log_limits: crate::observe::log_limit::LogLimits,
    /// What `POST /v1/reload` runs: main sets it to the same re-read as SIGHUP. Unset in
    /// tests and embedders, where the endpoint answers 503.
    pub reloader: OnceLock<Reloader>,
    /// What answers a client of an `admin.console` database: main sets it to the admin
    /// API's console (`admin::console`). Unset in embedders without the admin API, where such
    /// a login is refused.
    pub console: OnceLock<Arc<dyn Console>>,
    /// The process's phase, its stop signal and its client tasks ([`App::begin_shutdown`]).
    pub life: crate::lifecycle::Lifecycle,
    /// Client and backend TLS (certificates re-read on reload).
    pub tls: crate::tls::Tls,
    /// Fleet mode (a `fleet` section): membership, shared rules and limits through Redis.
    pub fleet: Option<Arc<Fleet>>,
    /// Identical reads sharing one execution (COALESCE rules).
    pub coalescer: Arc<crate::coalesce::Coalescer>,
}

/// A login let through [`App::door`], counted as coming until its session's first statement
/// meets admission (where it joins the queues the door counts), the session ends, or
/// [`crate::door::Coming`] stops counting it.
pub struct DoorPass(Arc<App>, u64);

impl Drop for DoorPass {
    fn drop(&mut self) {
        let now = tokio::time::Instant::now();
        self.0.stats.door_coming.arrived(self.1, now);
    }
}

/// Re-reads the configuration source and applies it with [`App::reload`]; `Err` lists the
/// problems (the running configuration stays).
pub type Reloader = Arc<dyn Fn() -> Result<(), Vec<String>> + Send + Sync>;

/// The admin console's commands, for a session of an `admin.console` database (the session
/// owns the socket and the protocol; this answers one simple Query at a time).
pub trait Console: Send + Sync {
    /// The messages that answer `sql` from `who` (rows or an error, and CommandComplete;
    /// never ReadyForQuery).
    fn answer<'a>(
        &'a self,
        who: &'a ConsoleClient,
        sql: &'a str,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = bytes::BytesMut> + Send + 'a>>;
}

/// The console's `server_version` and `SHOW VERSION`.
pub const CONSOLE_VERSION: &str = concat!("pgsluice ", env!("CARGO_PKG_VERSION"));

/// Who is asking the console.
#[derive(Debug, Clone)]
pub struct ConsoleClient {
    pub user: String,
    pub database: String,
    pub role: cfgmod::ConsoleRole,
}

#[derive(Default)]
pub struct AppStats {
    pub clients: AtomicUsize,
    pub clients_total: AtomicU64,
    pub handshakes: AtomicUsize,
    /// The process-wide cap on handshakes in progress (`limits.max_handshakes`), with the
    /// connections waiting for a place.
    pub handshake_gate: crate::per_address::Gate,
    /// Each source address's share of `handshakes` (`limits.max_handshakes_per_address`).
    pub handshakes_by_address: Arc<crate::per_address::PerAddress>,
    /// Handshakes finished (logged in or gone) since start, and how fast they finish: the
    /// retry hint of a refused handshake is the time the ones in progress need.
    pub handshakes_done: AtomicU64,
    pub handshake_drain: crate::policy::drain::DrainRate,
    /// Connections logging in on the session thread (see `server::admit`), waiting for a
    /// handshake slot included.
    pub inline_logins: AtomicUsize,
    /// Connections handed to the login thread to log in (or be refused), since start.
    pub offloaded_logins: AtomicU64,
    /// Times accepting moved to the login thread for a burst of logins (`server::Accepting`).
    pub accept_moves: AtomicU64,
    pub client_errors: AtomicU64,
    /// Logins let through the door ([`App::door`]) whose first statement has not reached
    /// admission yet.
    pub door_coming: crate::door::Coming,
    /// Logins that waited at the door, since start.
    pub logins_held: AtomicU64,
    /// Logins waiting at the door now.
    pub door_held: crate::door::Held,
}

impl AppStats {
    /// The expected wait for a handshake slot: the handshakes in progress at the rate they
    /// have been finishing (`None` until that rate is known).
    pub fn handshake_wait(&self) -> Option<Duration> {
        let done = self
            .handshakes_done
            .load(std::sync::atomic::Ordering::Relaxed);
        let now = self.handshakes.load(std::sync::atomic::Ordering::Relaxed) as u64;
        self.handshake_drain
            .expected_wait(done, now.saturating_sub(1), tokio::time::Instant::now())
    }
}

impl App {
    /// Graceful shutdown: stop accepting; sessions finish their transaction and leave.
    pub fn begin_shutdown(&self) {
        self.life.advance(crate::lifecycle::Phase::Draining);
        self.cancels.wake_all();
    }

    /// The shutdown grace period is over: sessions cancel what still runs and leave.
    pub fn force_stop(&self) {
        self.life.advance(crate::lifecycle::Phase::Forcing);
        self.cancels.wake_all();
    }

    /// The snapshot in force, if it is not `held`: one atomic load while `held` is current.
    /// A reload that has swapped but not yet published its generation is seen at the next
    /// call, as if it had come a moment later.
    pub fn newer_runtime(&self, held: &Runtime) -> Option<Arc<Runtime>> {
        if self.runtime_generation.load(Ordering::Acquire) == held.generation {
            return None;
        }
        let current = self.runtime.load_full();
        (current.generation != held.generation).then_some(current)
    }

    /// The configuration in force (one `Arc` clone; a session's hot path loads [`App::runtime`]
    /// once and reads all it needs from that).
    pub fn config(&self) -> Arc<Config> {
        Arc::clone(&self.runtime.load().config)
    }

    /// The credentials in force.
    pub fn creds(&self) -> Arc<Credentials> {
        Arc::clone(&self.runtime.load().creds)
    }

    /// Builds the app; `rules` are the runtime rules loaded from the rules file (if any).
    pub fn new(config: Config, rules: Arc<RuleSet>) -> Result<Arc<App>, String> {
        Self::with_fleet_peer_id(config, rules, false)
    }

    /// As [`App::new`]; `claimed_peer_id`: `config.peer_id` was claimed in the fleet's Redis
    /// (`fleet::claim_peer_id`) and is renewed there.
    pub fn with_fleet_peer_id(
        config: Config,
        rules: Arc<RuleSet>,
        claimed_peer_id: bool,
    ) -> Result<Arc<App>, String> {
        let creds = Credentials::from_config(&config);
        warn_exposed_auth(&config);
        let (callers, breaker) = policy_inputs(&config);
        let metrics = Metrics::with_longest_wait(&caller_names(&callers), longest_wait(&config));
        let policy = Policy::with_rules(callers, breaker, rules)
            .map_err(|e| format!("callers[{}].{}: {}", e.index, e.field, e.message))?;
        let limits = policy.table();
        let caller_metrics = metrics.callers().as_ref().clone();
        let cancels = Arc::new(cancel::Registry::new(peer_layout(&config)));
        let fleet = Fleet::from_config(&config, claimed_peer_id)?;
        let generation = crate::runtime::next_generation();
        if fleet.is_some() {
            metrics.enable_fleet();
        }
        let observer = metrics.clone();
        policy.set_transition_observer(Some(Arc::new(move |t| {
            observer.breaker_transition(t.to.as_str());
        })));
        Ok(Arc::new(App {
            metrics,
            log_limits: Default::default(),
            disabled: Default::default(),
            pass_keys: Default::default(),
            auth_cache: Default::default(),
            reloader: OnceLock::new(),
            console: OnceLock::new(),
            policy,
            classifier: Classifier::new(
                config.classify.cache_entries,
                config.classify.max_text_bytes,
            ),
            unclassified: opaque(0, ""),
            function_call: opaque(
                crate::classify::fingerprint("/* FunctionCall message */"),
                "FunctionCall message",
            ),
            unknown_statement: opaque(
                crate::classify::fingerprint("/* Bind of an unknown prepared statement */"),
                "Bind of an unknown prepared statement",
            ),
            statement_seed: rand::random::<u64>(),
            tls: crate::tls::Tls::new(&config).map_err(|e| e.to_string())?,
            fp_stats: FingerprintStats::new(config.classify.stats_capacity),
            runtime_generation: AtomicU64::new(generation),
            runtime: ArcSwap::from_pointee(Runtime {
                callers: caller_matcher(&config),
                endpoint: Arc::new(endpoint(&config)),
                config: Arc::new(config),
                creds: Arc::new(creds),
                limits,
                caller_metrics,
                generation,
            }),
            reload_lock: parking_lot::Mutex::new(()),
            pools: Pools::default(),
            warm: parking_lot::Mutex::new(Vec::new()),
            cancels,
            stats: AppStats::default(),
            life: crate::lifecycle::Lifecycle::new(),
            fleet,
            coalescer: Default::default(),
        }))
    }

    /// Swaps in a new configuration: credentials (a changed backend password also reaches the
    /// pools that exist, for their new connections), caller limits and breaker settings.
    /// Validation already happened; if the policy refuses it, nothing changes.
    pub fn reload(&self, mut config: Config) -> Result<(), String> {
        let _one_at_a_time = self.reload_lock.lock();
        if let Some(fleet) = &self.fleet
            && fleet.peer_id_claimed()
            && config.peer_id == 0
        {
            // The id claimed at start stays: keys handed out carry it.
            config.peer_id = self.config().peer_id;
        }
        if peer_layout(&config) != self.cancels.layout() {
            // Keys already handed out carry the old id; they must keep routing home.
            return Err("peer_id, and peers being set or empty, change only at restart".into());
        }
        if config.fleet != self.config().fleet {
            return Err("the fleet section changes only at restart".into());
        }
        let tls = crate::tls::Tls::prepare(&config).map_err(|e| e.to_string())?;
        warn_exposed_auth(&config);
        let (callers, breaker) = policy_inputs(&config);
        let names = caller_names(&callers);
        let limits = self
            .policy
            .rebuild(callers)
            .map_err(|e| format!("callers[{}].{}: {}", e.index, e.field, e.message))?;
        let caller_metrics = self.metrics.set_callers(&names);
        let creds = Arc::new(Credentials::from_config(&config));
        let default_endpoint = Arc::new(endpoint(&config));
        for pool in self.pools.all() {
            // Replica pools take their route at their next use (`replica_pool_for`); a
            // database the new map no longer has keeps its last route until it is unused.
            if pool.replica {
                continue;
            }
            let r = route(
                (&config, &default_endpoint),
                &creds,
                &self.pass_keys,
                &pool.database,
                &pool.user,
            );
            if let Ok(r) = r {
                // Under no snapshot yet: the first login under the new one checks it again.
                pool.set_route(&r, 0);
            }
        }
        for note in config.notes() {
            tracing::warn!("{note}");
        }
        // One swap: sessions see the old configuration or the new one, never a mix. The
        // generation follows the swap (under the reload lock, so in the same order).
        let generation = crate::runtime::next_generation();
        self.runtime.store(Arc::new(Runtime {
            callers: caller_matcher(&config),
            endpoint: default_endpoint,
            config: Arc::new(config),
            creds,
            limits: limits.clone(),
            caller_metrics,
            generation,
        }));
        self.runtime_generation.store(generation, Ordering::Release);
        // After the swap: the policy's own table (what the next reload builds on and fleet
        // shares apply to), the breaker and the pools' connection caps follow it.
        self.policy.install(limits, breaker);
        let config = self.config();
        self.pools.set_cap_limits(|name| {
            if let Some(db) = name.strip_prefix("database ") {
                config.pool_for(db, "\0").max_db_connections
            } else {
                config.pool.max_user_connections
            }
        });
        self.auth_cache.clear();
        self.tls.install(tls);
        Ok(())
    }

    /// An authenticated login waits at the door, before it is told it is in, while the pool
    /// of (`database`, `user`) or its caller's queue is crowded for it ([`Pool::crowded`],
    /// `CallerTable::crowded`), counting the logins let through ahead of it that have not
    /// reached admission yet ([`crate::door::Coming`]): its first statement would otherwise
    /// start a wait it is unlikely to finish in time, and a refusal after that wait costs the
    /// client a new login. Waiting after the exchange, the client's own work (a SCRAM proof)
    /// is done while it waits, and it is ready to send its first statement the moment it is
    /// let in; `on_hold` runs once, when the login starts to wait (the session gives back its
    /// handshake slot there).
    /// Logins wait in line, one line per pool and caller, and go through in the order they
    /// came ([`crate::door::Lines`]): only the head of a line looks, every 10 ms or so (a
    /// waiting login holds a timer or a wake-up, no lock). Critical callers never wait here,
    /// nor a login to a pool not yet made; nobody waits longer than half the handshake
    /// timeout (then the login goes on as usual). Off with `limits.hold_logins: false`. The
    /// caller is resolved from what a login carries (`application_name`, user, address;
    /// comment tags come with statements).
    pub async fn door(
        self: &Arc<Self>,
        database: &str,
        user: &str,
        application_name: Option<&str>,
        addr: Option<std::net::IpAddr>,
        on_hold: impl FnOnce(),
    ) -> Option<DoorPass> {
        let pool = self.pools.get(database, user)?;
        let rt = self.runtime.load_full();
        if !rt.config.limits.hold_logins {
            return None;
        }
        let caller = rt.callers.resolve(&[], application_name, user, addr);
        if rt.limits.priority(caller) as usize == 0 {
            return None;
        }
        let room = rt.limits.queue_timeout(caller);
        let until = tokio::time::Instant::now()
            + Duration::from_millis(rt.config.limits.handshake_timeout_ms) / 2;
        let coming = &self.stats.door_coming;
        // The guard that counts it as waiting, from its first pause (when `on_hold` is
        // spent) to its pass, and its place in line (dropped as it passes: the next looks).
        let mut _held = None;
        let mut place: Option<crate::door::Place<'_>> = None;
        let mut on_hold = Some(on_hold);
        loop {
            let now = tokio::time::Instant::now();
            // Only the first in line looks (a newcomer is first when nobody waits).
            let first = match &place {
                Some(p) => p.is_head(),
                None => !pool.door.occupied(caller),
            };
            let open = first && {
                let ahead = coming.count(now);
                !(pool.crowded(room, ahead) || rt.limits.crowded(caller, room, now, ahead))
            };
            if open || now >= until {
                return Some(DoorPass(Arc::clone(self), coming.pass(now)));
            }
            let place = place.get_or_insert_with(|| pool.door.join(caller));
            if let Some(f) = on_hold.take() {
                _held = Some(self.stats.door_held.enter());
                self.stats.logins_held.fetch_add(1, Ordering::Relaxed);
                f();
            }
            // First in line (as looked at above; a head that just left is found at the
            // next look): it polls, the others wait for their turn.
            if first {
                tokio::time::sleep(crate::door::poll()).await;
            } else {
                tokio::select! {
                    () = place.turn() => {}
                    () = tokio::time::sleep_until(until) => {}
                }
            }
        }
    }

    /// Where CancelRequests for other instances' keys go: the configured `peers` and, in a
    /// fleet, the live members that route cancels (configured peers win on the same id).
    pub fn cancel_peers(&self, config: &Config) -> Vec<PeerConfig> {
        let mut peers = config.peers.clone();
        if let Some(fleet) = &self.fleet {
            for m in fleet.cancel_peers() {
                if !peers.iter().any(|p| p.id == m.id) {
                    peers.push(m);
                }
            }
        }
        peers
    }

    /// The pool for a logged-in (database, user), created on first use; an existing one gets
    /// the current backend password for its new connections. A pool whose route was set
    /// under the runtime snapshot in force is taken as it is: the route is a function of
    /// that snapshot (and, for a user without a backend password, of the keys its clients
    /// proved, which is why such a route is never marked current).
    pub fn pool_for(&self, database: &str, user: &str) -> Result<Arc<Pool>, PgError> {
        if self.disabled.read().contains(database) {
            return Err(PgError::fatal(
                "57P03",
                format!(
                    "pgsluice: database \"{database}\" is not accepting new connections: \
                     disabled by an operator"
                ),
            )
            .with_detail(format!("POST /v1/databases/{database}/enable reopens it")));
        }
        let rt = self.runtime.load();
        if let Some(pool) = self.pools.get(database, user)
            && pool.routed_under(rt.generation)
        {
            return Ok(pool);
        }
        let cfg = &rt.config;
        let route = self.route_in(&rt, database, user)?;
        let max = cfg.limits.max_pools;
        let pool = self.pools.get_or_create(database, user, max, || {
            let pool_cfg = cfg.pool_for(database, user);
            let caps = self.pools.caps_for(database, user, &pool_cfg);
            let mut p = ConnectParams::blank(self.tls.backend());
            route.apply(&mut p);
            Pool::new(database, user, pool_cfg, p, caps)
        });
        let pool = pool.ok_or_else(|| {
            PgError::fatal(
                "53300",
                format!("pgsluice: too many pools: {max} (database, user) pools are in use"),
            )
            .with_detail(format!(
                "limits.max_pools is {max}; database \"{database}\""
            ))
            .with_hint("pools without clients and connections are removed; try again later")
        })?;
        // A reload between the reads above and a pool created concurrently could leave that
        // pool with the old address or password: a login under another snapshot re-aligns it
        // (a new pool already has this route, and only takes note of the snapshot).
        pool.set_route(&route, rt.generation);
        Ok(pool)
    }

    /// The route of (`database`, `user`) under the runtime snapshot `rt`.
    fn route_in(
        &self,
        rt: &Runtime,
        database: &str,
        user: &str,
    ) -> Result<crate::pool::Route, PgError> {
        route(
            (&rt.config, &rt.endpoint),
            &rt.creds,
            &self.pass_keys,
            database,
            user,
        )
    }

    /// The pool of `database`'s replicas for `user` (`databases[].replicas`), made with its
    /// lag probe on first use; `None` when the database has no replicas.
    pub fn replica_pool_for(&self, database: &str, user: &str) -> Option<Arc<Pool>> {
        let rt = self.runtime.load();
        let cfg = &rt.config;
        let entry = cfg.database_entry(database)?;
        let replicas = entry.replica_target()?;
        let primary = self.route_in(&rt, database, user).ok()?;
        let route = crate::pool::Route {
            endpoint: Arc::new(crate::pool::Endpoint {
                also: replicas.hosts.iter().skip(1).cloned().collect(),
                target: replicas.target,
                startup: primary.endpoint.startup.clone(),
                connect_timeout: replicas
                    .connect_timeout
                    .unwrap_or(primary.endpoint.connect_timeout),
                tcp_user_timeout: primary.endpoint.tcp_user_timeout,
                host: replicas.host,
                port: replicas.port,
            }),
            ..primary
        };
        let key = format!("{database}\0replica");
        let mut made = None;
        let pool = self
            .pools
            .get_or_create(&key, user, cfg.limits.max_pools, || {
                let mut p = ConnectParams::blank(self.tls.backend());
                route.apply(&mut p);
                let pool = Pool::with_role(
                    database,
                    user,
                    cfg.pool_for(database, user),
                    p,
                    Vec::new(),
                    true,
                );
                made = Some(Arc::clone(&pool));
                pool
            })?;
        if let Some(pool) = made {
            // Probed at once, then twice a second while the process runs; a replica that
            // cannot answer within 3 s is left out until it does.
            let weak = Arc::downgrade(&pool);
            let stop = self.life.stop_token();
            tokio::spawn(async move {
                loop {
                    let Some(p) = weak.upgrade() else { return };
                    p.probe_replica(Duration::from_secs(3)).await;
                    drop(p);
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                        _ = stop.cancelled() => return,
                    }
                }
            });
        } else {
            pool.set_route(&route, 0);
        }
        Some(pool)
    }

    /// Periodic pool upkeep (idle timeout, min idle) until shutdown; the first round runs at
    /// once, so `min_idle` connections open at start.
    pub async fn maintain(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.life.stopping() => return,
            }
            self.warm_pools();
            for p in self.pools.all() {
                p.maintain().await;
            }
            // After the upkeep (which may have closed a pool's last idle connection).
            self.pools.sweep();
        }
    }

    /// Creates the pools the config names whose `min_idle` is above 0 — each `pools[]`
    /// entry and the (database, user) of `backend.url` — so their connections are open
    /// before the first client arrives; other pools exist from their first login on. Runs
    /// every upkeep round, so a reload that names a new pool warms it too.
    fn warm_pools(&self) {
        let cfg = self.config();
        let mut named: Vec<(String, String)> = cfg
            .pools
            .iter()
            .map(|o| (o.database.clone(), o.user.clone()))
            .collect();
        if let Some(url) = cfg.backend_url() {
            named.push((url.database, url.user));
        }
        let mut warm = Vec::new();
        for (database, user) in named {
            if cfg.pool_for(&database, &user).min_idle == 0
                || warm
                    .iter()
                    .any(|p: &Arc<Pool>| p.database == database && p.user == user)
            {
                continue;
            }
            // Fails only with `limits.max_pools` pools in use: tried again next round.
            if let Ok(p) = self.pool_for(&database, &user) {
                warm.push(p);
            }
        }
        *self.warm.lock() = warm;
    }
}

/// Where and as whom the pool of a client's (database, user) connects: its `databases:`
/// entry when the map has one (else FATAL 3D000), else `backend.url`'s server with the
/// client's own database name, user and password.
/// The route of (`database`, `user`) under a configuration and its default endpoint.
fn route(
    (cfg, default): (&Config, &Arc<crate::pool::Endpoint>),
    creds: &Credentials,
    keys: &PassKeys,
    database: &str,
    user: &str,
) -> Result<crate::pool::Route, PgError> {
    // A user known by a verifier only logs in with the key its client proved.
    let key = |u: &str, password: &Option<String>| {
        if password.is_some() {
            None
        } else {
            keys.read().get(u).cloned()
        }
    };
    if cfg.databases.is_empty() {
        let password = backend_password(creds, user);
        return Ok(crate::pool::Route {
            endpoint: Arc::clone(default),
            user: user.to_owned(),
            database: database.to_owned(),
            client_key: key(user, &password),
            password,
        });
    }
    let entry = cfg.database_entry(database).ok_or_else(|| {
        PgError::fatal(
            "3D000",
            format!("pgsluice: database \"{database}\" is not in the proxy's databases map"),
        )
    })?;
    let url = entry.target().ok_or_else(|| {
        PgError::fatal("08006", "pgsluice: the databases map entry does not parse")
    })?;
    let connect_timeout = Duration::from_millis(cfg.backend.connect_timeout_ms);
    let (login, password) = if url.user.is_empty() {
        (user.to_owned(), backend_password(creds, user))
    } else {
        let password = url
            .password
            .clone()
            .or_else(|| backend_password(creds, &url.user));
        (url.user.clone(), password)
    };
    let server_db = match (url.database.is_empty(), entry.name.as_str()) {
        (false, _) => url.database.clone(),
        (true, "*") => database.to_owned(),
        (true, name) => name.to_owned(),
    };
    Ok(crate::pool::Route {
        endpoint: Arc::new(crate::pool::Endpoint {
            also: url.hosts.iter().skip(1).cloned().collect(),
            target: url.target,
            startup: url.startup(),
            connect_timeout: url.connect_timeout.unwrap_or(connect_timeout),
            tcp_user_timeout: cfg.backend.tcp_user_timeout(),
            host: url.host,
            port: url.port,
        }),
        client_key: key(&login, &password),
        user: login,
        database: server_db,
        password,
    })
}

/// Client keys of verifier-only users, by name (see [`App::pass_keys`]).
pub type PassKeys = parking_lot::RwLock<
    std::collections::HashMap<String, Arc<crate::auth::passthrough::ClientKey>>,
>;

/// Most users whose keys are kept.
pub const MAX_PASS_KEYS: usize = 10_000;

/// Where pools connect: `backend.url`'s host list and parameters (its connect timeout, when
/// it gives one, over `backend.connect_timeout_ms`), else `backend.host`/`port`.
pub(crate) fn endpoint(cfg: &Config) -> crate::pool::Endpoint {
    let connect_timeout = Duration::from_millis(cfg.backend.connect_timeout_ms);
    let tcp_user_timeout = cfg.backend.tcp_user_timeout();
    match cfg.backend_url() {
        Some(u) => crate::pool::Endpoint {
            also: u.hosts.iter().skip(1).cloned().collect(),
            target: u.target,
            startup: u.startup(),
            connect_timeout: u.connect_timeout.unwrap_or(connect_timeout),
            tcp_user_timeout,
            host: u.host,
            port: u.port,
        },
        None => crate::pool::Endpoint {
            host: cfg.backend.host.clone(),
            port: cfg.backend.port,
            also: Vec::new(),
            target: crate::config::TargetAttrs::Any,
            startup: Vec::new(),
            connect_timeout,
            tcp_user_timeout,
        },
    }
}

/// The longest queue or checkout wait the config allows: the wait histograms' buckets reach it.
fn longest_wait(config: &Config) -> Duration {
    let ms = config
        .callers
        .iter()
        .filter_map(|c| c.queue_timeout_ms)
        .chain([
            config.global_defaults.queue_timeout_ms,
            config.pool.checkout_timeout_ms,
        ])
        .max()
        .unwrap_or(0);
    Duration::from_millis(ms)
}

/// What the proxy logs in to Postgres with as `user`.
fn backend_password(creds: &Credentials, user: &str) -> Option<String> {
    creds.user(user).and_then(|u| u.backend_password.clone())
}

/// The cancel-key layout `config` asks for: the instance id only when peers are configured,
/// or in a fleet with a `peer_id`.
/// `backend.require_auth` may list `password` or `md5` on purpose (an old server, a trusted
/// network), and then the proxy answers them; without a verified server certificate whoever
/// answers on the server's address gets the password, or a hash it can replay, so say so at
/// start and on every reload.
fn warn_exposed_auth(config: &Config) {
    if config.backend.tls_verified() {
        return;
    }
    for m in config.backend.allowed_auth() {
        if m.exposes_password() {
            tracing::warn!(
                method = m.name(),
                tls = ?config.backend.tls,
                "backend.require_auth allows a method that sends the password (or a replayable \
                 hash of it) to a server whose certificate is not verified; use backend.tls \
                 verify-full to be sure who receives it"
            );
        }
    }
}

fn peer_layout(config: &Config) -> cancel::PeerLayout {
    let routed = !config.peers.is_empty() || (config.fleet.is_some() && config.peer_id != 0);
    cancel::PeerLayout::new(routed.then_some(config.peer_id))
}

fn caller_names(callers: &[CallerPolicy]) -> Vec<String> {
    callers.iter().map(|c| c.name.clone()).collect()
}

/// The caller table (config order, `default` last) and breaker settings for the policy.
pub fn policy_inputs(cfg: &Config) -> (Vec<CallerPolicy>, BreakerSettings) {
    let g = &cfg.global_defaults;
    let mut callers: Vec<CallerPolicy> = cfg
        .callers
        .iter()
        .map(|c| CallerPolicy {
            name: c.name.clone(),
            max_concurrency: c.max_concurrency.unwrap_or(g.max_concurrency),
            queue_depth: c.queue_depth.unwrap_or(g.queue_depth),
            queue_timeout: Duration::from_millis(c.queue_timeout_ms.unwrap_or(g.queue_timeout_ms)),
            priority: c.priority,
            max_qps: c.max_qps,
            burst: c.burst,
            scope: c.scope,
            idle_transaction_timeout: idle_timeout(
                c.idle_transaction_timeout_ms
                    .or(g.idle_transaction_timeout_ms),
            ),
            retry: retry_policy(
                c.retry_base_ms.unwrap_or(g.retry_base_ms),
                c.retry_cap_ms.unwrap_or(g.retry_cap_ms),
                c.retry_floor_ms.unwrap_or(g.retry_floor_ms),
            ),
            weight: c.weight.unwrap_or(1),
            db_time_share: c.db_time_share,
        })
        .collect();
    callers.push(CallerPolicy {
        name: "default".into(),
        max_concurrency: g.max_concurrency,
        queue_depth: g.queue_depth,
        queue_timeout: Duration::from_millis(g.queue_timeout_ms),
        priority: Priority::Normal,
        max_qps: None,
        burst: None,
        scope: Scope::Instance,
        retry: connection_retry(cfg),
        idle_transaction_timeout: idle_timeout(g.idle_transaction_timeout_ms),
        weight: 1,
        db_time_share: None,
    });
    let b = &g.circuit_breaker;
    let breaker = BreakerSettings {
        consecutive_errors: b.consecutive_errors,
        max_inflight_threshold: b.max_inflight_threshold,
        db_cpu_threshold_percent: b.db_cpu_threshold_percent,
        open: Duration::from_millis(b.open_ms),
        half_open_trials: b.half_open_trials,
        critical_reserve: b.critical_reserve.unwrap_or_else(|| {
            let critical: u32 = cfg
                .callers
                .iter()
                .filter(|c| c.priority == cfgmod::Priority::Critical)
                .filter_map(|c| c.max_concurrency)
                .fold(0, u32::saturating_add);
            critical.max(20)
        }),
    };
    (callers, breaker)
}

/// `Some` for a positive number of milliseconds (0 = off).
fn idle_timeout(ms: Option<u64>) -> Option<Duration> {
    ms.filter(|ms| *ms > 0).map(Duration::from_millis)
}

fn retry_policy(base_ms: u64, cap_ms: u64, floor_ms: u64) -> RetryPolicy {
    RetryPolicy {
        base: Duration::from_millis(base_ms),
        cap: Duration::from_millis(cap_ms),
        floor: Duration::from_millis(floor_ms),
    }
}

/// The retry hints of connection-level refusals (and the `default` caller's):
/// `global_defaults`' `retry_*_ms`.
pub fn connection_retry(cfg: &Config) -> RetryPolicy {
    let g = &cfg.global_defaults;
    retry_policy(g.retry_base_ms, g.retry_cap_ms, g.retry_floor_ms)
}

/// Caller matching rules from config (validated, so CIDRs parse).
pub fn caller_matcher(cfg: &Config) -> CallerMatcher {
    CallerMatcher::new(
        cfg.callers
            .iter()
            .map(|c| CallerRule {
                name: c.name.clone(),
                tags: c
                    .matcher
                    .tag
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                application_name: c.matcher.application_name.clone(),
                user: c.matcher.user.clone(),
                client_cidr: c
                    .matcher
                    .client_cidr
                    .as_deref()
                    .and_then(|s| s.parse().ok()),
            })
            .collect(),
    )
}

/// Statement timeout for a caller and statement kind (`None` = leave the server's setting).
pub fn statement_timeout(cfg: &Config, caller: u16, kind: StmtKind) -> Option<Duration> {
    let pick = |t: &cfgmod::KindTimeouts| match t {
        cfgmod::KindTimeouts::All(ms) => Some(*ms),
        cfgmod::KindTimeouts::PerKind(t) => match kind {
            StmtKind::Read | StmtKind::LockingRead => t.read,
            StmtKind::Write => t.write,
            StmtKind::Ddl => t.ddl,
            StmtKind::Transaction | StmtKind::Session | StmtKind::Other => t.other,
        },
    };
    cfg.callers
        .get(usize::from(caller))
        .and_then(|c| c.statement_timeout_ms.as_ref())
        .and_then(pick)
        .or_else(|| {
            cfg.global_defaults
                .statement_timeout_ms
                .as_ref()
                .and_then(pick)
        })
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis)
}

/// Lock timeout for a caller (`None` = leave the server's setting).
pub fn lock_timeout(cfg: &Config, caller: u16) -> Option<Duration> {
    cfg.callers
        .get(usize::from(caller))
        .and_then(|c| c.lock_timeout_ms)
        .or(cfg.global_defaults.lock_timeout_ms)
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis)
}

/// A classification for something the proxy cannot read: kind `Other`, effect `Unknown`.
fn opaque(fingerprint: u64, normalized: &str) -> Arc<Classified> {
    Arc::new(Classified {
        fingerprint,
        normalized: Arc::from(normalized),
        kind: StmtKind::Other,
        effects: vec![crate::classify::SessionEffect::Unknown],
        tags: Vec::new(),
        oversized: false,
        // A FunctionCall runs on its own; a Bind of an unknown name may be anything.
        own_transaction: true,
        proof: crate::classify::Proof::unproven("not readable"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The caller table and breaker the policy gets carry every caller and breaker key of the
    /// file: retry hints (own or inherited), the breaker's reserve and half-open trials, and
    /// the CIDR match.
    #[test]
    fn policy_inputs_carry_retry_breaker_and_match_keys() {
        let yaml = "global_defaults:\n  retry_base_ms: 100\n  retry_cap_ms: 8000\n  \
                    retry_floor_ms: 0\n  circuit_breaker:\n    critical_reserve: 7\n    \
                    half_open_trials: 3\n    max_inflight_threshold: 40\n\
                    callers:\n  - { name: sync, retry_floor_ms: 5000, retry_cap_ms: 15000, \
                    match: { client_cidr: 10.1.0.0/16 } }\n  - { name: web, \
                    match: { application_name: web } }\n";
        let cfg = Config::from_yaml(yaml).unwrap();
        let (callers, breaker) = policy_inputs(&cfg);
        let ms = |d: Duration| d.as_millis();
        let r = |i: usize| {
            let p = &callers[i].retry;
            (ms(p.base), ms(p.cap), ms(p.floor))
        };
        assert_eq!(
            r(0),
            (100, 15_000, 5_000),
            "own floor and cap, inherited base"
        );
        assert_eq!(r(1), (100, 8_000, 0), "all inherited");
        assert_eq!(r(2), (100, 8_000, 0), "the default caller");
        assert_eq!(
            (
                breaker.critical_reserve,
                breaker.half_open_trials,
                breaker.max_inflight_threshold
            ),
            (7, 3, Some(40))
        );
        // Unset, the breaker's reserve fits every critical caller's own concurrency.
        let auto = Config::from_yaml(
            "callers:\n  - { name: pay, priority: critical, max_concurrency: 50, \
             match: { user: pay } }\n  - { name: ops, priority: critical, max_concurrency: 5, \
             match: { user: ops } }\n",
        )
        .unwrap();
        assert_eq!(policy_inputs(&auto).1.critical_reserve, 55);
        assert_eq!(policy_inputs(&Config::default()).1.critical_reserve, 20);
        let m = caller_matcher(&cfg);
        let inside = "10.1.2.3".parse().ok();
        let outside = "10.2.0.1".parse().ok();
        assert_eq!(m.name(m.resolve(&[], None, "app", inside)), "sync");
        assert_eq!(m.name(m.resolve(&[], None, "app", outside)), "default");
    }

    /// `{ ddl, other }` and one number reach DDL and other statements; a caller's kinds left
    /// out fall back to `global_defaults`; a misspelt kind is a config error.
    #[test]
    fn statement_timeouts_per_kind_reach_ddl_and_other() {
        let yaml = "global_defaults:\n  statement_timeout_ms: { ddl: 30000, other: 5000 }\n\
                    callers:\n  - { name: api, statement_timeout_ms: { read: 800 }, \
                    match: { user: api } }\n  - { name: etl, statement_timeout_ms: 60000, \
                    match: { user: etl } }\n";
        let cfg = Config::from_yaml(yaml).unwrap();
        let ms = |caller, kind| statement_timeout(&cfg, caller, kind).map(|d| d.as_millis());
        assert_eq!(ms(0, StmtKind::Read), Some(800));
        assert_eq!(
            ms(0, StmtKind::LockingRead),
            Some(800),
            "a locking read is a read"
        );
        assert_eq!(
            ms(0, StmtKind::Ddl),
            Some(30_000),
            "falls back to global_defaults"
        );
        assert_eq!(ms(0, StmtKind::Other), Some(5_000));
        assert_eq!(
            ms(0, StmtKind::Session),
            Some(5_000),
            "other kinds are `other`"
        );
        assert_eq!(ms(0, StmtKind::Write), None, "no write budget anywhere");
        for kind in [
            StmtKind::Read,
            StmtKind::Write,
            StmtKind::Ddl,
            StmtKind::Other,
        ] {
            assert_eq!(ms(1, kind), Some(60_000), "{kind:?}");
        }
        assert_eq!(ms(2, StmtKind::Ddl), Some(30_000), "the default caller");
        let bad = "global_defaults:\n  statement_timeout_ms: { reads: 800 }\n";
        assert!(
            Config::from_yaml(bad).is_err(),
            "a misspelt kind is refused"
        );
    }

    /// A reload that reorders the callers: a session holding the snapshot from before still
    /// finds, for the id that snapshot's matcher gave it, that caller's limits, timeouts and
    /// series — never those of whoever has that index now — while the live state (slots
    /// taken) is the same one under either snapshot.
    #[tokio::test]
    async fn a_snapshot_taken_before_a_reload_stays_whole() {
        let caller = |name: &str, conc: u32, timeout: u64| {
            format!(
                "  - {{ name: {name}, max_concurrency: {conc}, queue_depth: 0, \
                 statement_timeout_ms: {timeout}, match: {{ application_name: {name} }} }}\n"
            )
        };
        let before = format!("callers:\n{}{}", caller("x", 1, 111), caller("y", 5, 222));
        let after = format!("callers:\n{}{}", caller("y", 5, 222), caller("x", 1, 111));
        let app = App::new(
            Config::from_yaml(&before).unwrap(),
            Arc::new(RuleSet::new()),
        )
        .unwrap();
        let old = app.runtime.load_full();
        app.reload(Config::from_yaml(&after).unwrap()).unwrap();
        let new = app.runtime.load_full();
        let x_old = old.callers.resolve(&[], Some("x"), "u", None);
        let x_new = new.callers.resolve(&[], Some("x"), "u", None);
        assert_eq!((x_old, x_new), (0, 1), "the reload moved x");
        for rt in [&old, &new] {
            let x = rt.callers.resolve(&[], Some("x"), "u", None);
            assert_eq!(rt.callers.name(x), "x");
            assert_eq!(
                statement_timeout(&rt.config, x, StmtKind::Read),
                Some(Duration::from_millis(111))
            );
        }
        // x's one slot, taken through the old snapshot, is taken under the new one too.
        let req = |caller| crate::policy::AdmitRequest {
            caller,
            fingerprint: 1,
            now: tokio::time::Instant::now(),
        };
        let held = app.policy.admit_in(&old.limits, &req(x_old)).await.unwrap();
        let refused = app.policy.admit_in(&new.limits, &req(x_new)).await;
        assert!(
            refused.is_err(),
            "x has max_concurrency 1 under both snapshots"
        );
        // y (index 0 now, 1 before) is not x: its slots are free under either snapshot.
        let y_old = old.callers.resolve(&[], Some("y"), "u", None);
        assert!(app.policy.admit_in(&old.limits, &req(y_old)).await.is_ok());
        assert!(app.policy.admit_in(&new.limits, &req(0)).await.is_ok());
        drop(held);
        assert!(app.policy.admit_in(&new.limits, &req(x_new)).await.is_ok());
    }

    /// A login takes an existing pool as it is while its route was set under the snapshot in
    /// force; under another snapshot (a reload, or a login that read the old one and set its
    /// route late) it computes the route again. A route without a password is never current.
    #[tokio::test]
    async fn a_pool_route_is_computed_again_only_under_another_snapshot() {
        let yaml = |user: &str| {
            format!(
                "databases:\n  - {{ name: d, url: \"postgres://{user}:pw@127.0.0.1:1/d\" }}\n  \
                 - {{ name: open, url: \"postgres://127.0.0.1:1/open\" }}\n"
            )
        };
        let app = App::new(
            Config::from_yaml(&yaml("first")).unwrap(),
            Arc::new(RuleSet::new()),
        )
        .unwrap();
        let old = app.runtime.load_full();
        assert!(
            app.newer_runtime(&old).is_none(),
            "the first snapshot is current"
        );
        let p = app.pool_for("d", "client").unwrap();
        assert_eq!(p.login_user(), "first");
        assert!(p.routed_under(old.generation));
        assert!(Arc::ptr_eq(&p, &app.pool_for("d", "client").unwrap()));

        app.reload(Config::from_yaml(&yaml("second")).unwrap())
            .unwrap();
        let new = app.runtime.load_full();
        assert_ne!(old.generation, new.generation);
        // A session holding the old snapshot is told of the new one; one holding it is not.
        let told = app
            .newer_runtime(&old)
            .expect("the old snapshot is not current");
        assert!(Arc::ptr_eq(&told, &new));
        assert!(app.newer_runtime(&new).is_none());
        assert_eq!(p.login_user(), "second", "the reload re-routes the pool");
        assert!(!p.routed_under(new.generation), "until a login under it");
        assert!(Arc::ptr_eq(&p, &app.pool_for("d", "client").unwrap()));
        assert!(p.routed_under(new.generation));

        // A login that read the old snapshot sets the old route after the reload: the next
        // login under the new one puts the new route back.
        p.set_route(&app.route_in(&old, "d", "client").unwrap(), old.generation);
        assert_eq!(p.login_user(), "first");
        assert!(!p.routed_under(new.generation));
        app.pool_for("d", "client").unwrap();
        assert_eq!(p.login_user(), "second");

        // The client's own user, without a password here: its route may depend on a key a
        // client proves, so it is computed at every login.
        let o = app.pool_for("open", "client").unwrap();
        assert_eq!(o.login_user(), "client");
        assert!(!o.routed_under(new.generation));
    }

    #[tokio::test]
    async fn reload_keeps_the_cancel_key_layout() {
        let yaml = "peer_id: 1\npeers:\n  - { id: 2, addr: \"10.0.0.2:6432\" }\n";
        let app = App::new(Config::from_yaml(yaml).unwrap(), Arc::new(RuleSet::new())).unwrap();
        assert_eq!(app.cancels.layout(), cancel::PeerLayout::new(Some(1)));
        // Peer addresses may change; the id and peers-or-not may not.
        let moved = "peer_id: 1\npeers:\n  - { id: 2, addr: \"10.0.0.3:6432\" }\n";
        app.reload(Config::from_yaml(moved).unwrap()).unwrap();
        assert_eq!(app.config().peers[0].addr, "10.0.0.3:6432");
        for bad in ["", "peer_id: 3\npeers:\n  - { id: 2, addr: \"a:1\" }\n"] {
            let err = app.reload(Config::from_yaml(bad).unwrap()).unwrap_err();
            assert!(err.contains("restart"), "{err}");
        }
        assert_eq!(app.config().peers[0].addr, "10.0.0.3:6432");
    }

    #[tokio::test]
    async fn a_claimed_fleet_peer_id_survives_reload_and_the_fleet_section_is_fixed() {
        let file = "fleet:\n  redis_url: \"redis://127.0.0.1:1\"\n  instance_id: a\n";
        let mut running = Config::from_yaml(file).unwrap();
        running.peer_id = 7; // as claimed at start
        let app = App::with_fleet_peer_id(running, Arc::new(RuleSet::new()), true).unwrap();
        assert_eq!(app.cancels.layout(), cancel::PeerLayout::new(Some(7)));
        app.reload(Config::from_yaml(file).unwrap()).unwrap();
        assert_eq!(app.config().peer_id, 7);
        let moved = file.replace("instance_id: a", "instance_id: b");
        let err = app.reload(Config::from_yaml(&moved).unwrap()).unwrap_err();
        assert!(err.contains("fleet"), "{err}");
    }
}
