//! Fleet mode (issue 10): several pgsluice instances act as one, coordinated through Redis.
//!
//! Owns the instance's side of the fleet: membership (heartbeats), the shared rule set
//! (seed, write-through, sync), the lease filler for fleet-wide rate limits, the per-instance
//! share of fleet-wide concurrency, and the member list cancel routing reads. The Redis
//! scripts and key names live in [`store`]; the hot-path half of leasing in
//! `policy::lease`. Without a `fleet` section none of this runs and no Redis is needed.
//!
//! One task ([`run`]) holds a Redis connection and a pub/sub subscription and loops:
//! * every `heartbeat_ms`: renew this member (TTL 3 heartbeats), read the live set and the
//!   rule set's (epoch, version); a new member count rebalances fleet-scoped callers'
//!   `max_concurrency` share and the local fallback rates;
//! * on a `rules:changed` message, or when a heartbeat shows a version this instance has not
//!   applied: read the whole rule set in one script and apply it to the live rules in one
//!   step (`RuleSet::sync`; unchanged rules keep their counters and buckets). The admin API's
//!   purge loop then writes the rules file, which stays the cache for a start without Redis;
//! * when a fleet bucket runs low (or every [`FILL_TICK`]): lease tokens for it.
//!
//! Rules with a TTL expire by their absolute `expires_unix_ms`, so every instance drops them
//! at the same moment; the instance that next reads the set removes them from Redis (each
//! only if it is unchanged since it was read, so a re-PUT in between is not lost).
//!
//! Rule writes (`PUT`/`DELETE /v1/rules/...` on any instance) go to Redis first — a script
//! that stores the rule, bumps the version and publishes it — and then the writer syncs at
//! once, so its own answer already reflects the change. While Redis is unreachable writes are
//! refused with 503 and nothing is applied anywhere: a change applied on one instance only
//! would be undone by the next sync.
//!
//! Cancel routing: members announce their `peer_id` and cancel address in their heartbeat;
//! `App::cancel_peers` adds the live members to the configured `peers`. Without a configured
//! `peer_id`, one is claimed in Redis at start ([`claim_peer_id`]) and renewed by heartbeats.
//!
//! What Redis holds is input, not trusted state (anyone who can write to it could plant
//! anything): a member's cancel address is used only if it passes `config::check_dial_addr`
//! (otherwise that member's keys are not routed, logged once per bad address), and a stored
//! rule only if it is within the API's size cap ([`MAX_STORED_RULE_BYTES`]) and passes the
//! validation a PUT passes (`RuleSpec::validate`, including its caller-list cap).
//!
//! Degradation: when a Redis call fails or times out, the instance marks the store down
//! (logged once, `pgsluice_fleet_redis_up 0`), keeps enforcing the rules it last applied,
//! falls back to local shares of fleet limits (from the last member count it saw), and
//! reconnects with full-jitter backoff (100 ms doubling to 5 s). On reconnect an empty Redis
//! (restarted without persistence) is seeded from this instance's rules; otherwise this
//! instance adopts what Redis holds.

pub mod store;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use parking_lot::Mutex;
use redis::aio::MultiplexedConnection;
use serde::Serialize;
use tokio::time::Instant;

use self::store::{Keys, Member, RuleSnapshot, Scripts};
use crate::config::{Config, FleetConfig, PeerConfig, check_dial_addr};
use crate::policy::Policy;
use crate::policy::rules::{MAX_RULE_JSON_BYTES, RuleSet, StoredRule};

/// How often fleet buckets are topped up even if nobody woke the filler.
pub const FILL_TICK: Duration = Duration::from_millis(20);
/// A Redis call that takes longer counts as Redis being unreachable.
const CALL_TIMEOUT: Duration = Duration::from_secs(1);
const BACKOFF_BASE_MS: u64 = 100;
const BACKOFF_CAP_MS: u64 = 5_000;
/// Largest stored rule read from Redis: the API's body cap plus room for what the stored form
/// adds (fingerprint, time stamps, defaults filled in), so anything a PUT accepted fits.
pub const MAX_STORED_RULE_BYTES: usize = MAX_RULE_JSON_BYTES + 1024;

/// This instance's view of the fleet; shared by the fleet task, the admin API, metrics and
/// cancel routing.
pub struct Fleet {
    id: String,
    me: Member,
    /// The peer id was claimed in Redis at start (renewed by heartbeats), not configured.
    claimed_peer_id: bool,
    key_prefix: String,
    heartbeat: Duration,
    keys: Keys,
    client: redis::Client,
    scripts: Scripts,
    up: AtomicBool,
    /// The connection while the store is up (admin writes use it).
    conn: Mutex<Option<MultiplexedConnection>>,
    members: Mutex<Vec<Member>>,
    /// (epoch, version) of the rule set last applied.
    applied: Mutex<Option<(Option<String>, u64)>>,
    /// The earliest expiry (unix ms) among the rules last applied: a heartbeat after it
    /// re-reads the set to remove what expired from Redis.
    next_expiry: AtomicU64,
    /// Serialises rule syncs (the task's and admin writes').
    sync_lock: tokio::sync::Mutex<()>,
    pub counters: FleetCounters,
    /// When the duplicate-id error was last logged (unix ms), to log it once a minute.
    same_id_warned: AtomicU64,
    /// Heartbeats in a row that found another instance's entry under this id.
    same_id_streak: AtomicU32,
    /// (member id, address) of the cancel addresses refused at the last heartbeat, so each
    /// is logged once rather than every heartbeat.
    refused_addrs: Mutex<Vec<(String, String)>>,
}

#[derive(Default)]
pub struct FleetCounters {
    pub rule_syncs: AtomicU64,
    pub lease_requests: AtomicU64,
    pub lease_tokens: AtomicU64,
    pub redis_errors: AtomicU64,
}

/// Why a fleet write did not happen.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("the fleet store (Redis) is unreachable; nothing was applied")]
    Down,
    #[error("the fleet store (Redis) failed: {0}; nothing was applied")]
    Redis(String),
}

/// `GET /v1/fleet`.
#[derive(Debug, Clone, Serialize)]
pub struct FleetSnapshot {
    pub instance_id: String,
    pub redis_up: bool,
    pub members: Vec<Member>,
    pub rules_epoch: Option<String>,
    pub rules_version: u64,
    pub rule_syncs: u64,
    pub lease_requests: u64,
    pub lease_tokens: u64,
    pub leasing: bool,
}

impl Fleet {
    /// From the config (`None` without a `fleet` section). Does not connect. `claimed`: the
    /// config's `peer_id` came from [`claim_peer_id`].
    pub fn from_config(config: &Config, claimed: bool) -> Result<Option<Arc<Fleet>>, String> {
        let Some(f) = &config.fleet else {
            return Ok(None);
        };
        let client = redis::Client::open(f.redis_url.as_str())
            .map_err(|e| format!("fleet.redis_url: {e}"))?;
        let id = instance_id(f);
        let me = Member {
            id: id.clone(),
            peer_id: config.peer_id,
            cancel_addr: cancel_addr(config, f),
            started_unix_ms: unix_ms(),
        };
        Ok(Some(Arc::new(Fleet {
            id,
            me,
            claimed_peer_id: claimed,
            key_prefix: f.key_prefix.clone(),
            heartbeat: Duration::from_millis(f.heartbeat_ms),
            keys: Keys::new(&f.key_prefix),
            client,
            scripts: Scripts::default(),
            up: AtomicBool::new(false),
            conn: Mutex::new(None),
            members: Mutex::new(Vec::new()),
            applied: Mutex::new(None),
            next_expiry: AtomicU64::new(u64::MAX),
            sync_lock: tokio::sync::Mutex::new(()),
            counters: FleetCounters::default(),
            same_id_warned: AtomicU64::new(0),
            same_id_streak: AtomicU32::new(0),
            refused_addrs: Mutex::new(Vec::new()),
        })))
    }

    pub fn instance_id(&self) -> &str {
        &self.id
    }

    /// Whether this instance's peer id was claimed in Redis rather than configured.
    pub fn peer_id_claimed(&self) -> bool {
        self.claimed_peer_id
    }

    pub fn redis_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Live members as last seen (this instance included once it has heartbeated).
    pub fn members(&self) -> Vec<Member> {
        self.members.lock().clone()
    }

    /// Other members that route cancels: their peer id and cancel address.
    pub fn cancel_peers(&self) -> Vec<PeerConfig> {
        self.members
            .lock()
            .iter()
            .filter(|m| m.id != self.id && m.peer_id != 0)
            .filter_map(|m| {
                m.cancel_addr.clone().map(|addr| PeerConfig {
                    id: m.peer_id,
                    addr,
                })
            })
            .collect()
    }

    pub fn snapshot(&self, rules: &RuleSet) -> FleetSnapshot {
        let applied = self.applied.lock().clone();
        let (epoch, version) = applied.unwrap_or((None, 0));
        FleetSnapshot {
            instance_id: self.id.clone(),
            redis_up: self.redis_up(),
            members: self.members(),
            rules_epoch: epoch,
            rules_version: version,
            rule_syncs: self.counters.rule_syncs.load(Ordering::Relaxed),
            lease_requests: self.counters.lease_requests.load(Ordering::Relaxed),
            lease_tokens: self.counters.lease_tokens.load(Ordering::Relaxed),
            leasing: rules.gate().leasing(),
        }
    }

    /// Writes one rule (`Some`) or removes it (`None`) fleet-wide, then applies the fleet's
    /// rule set here. Returns whether the store changed (false: deleting a missing rule).
    pub async fn write_rule(
        &self,
        rules: &RuleSet,
        fingerprint: &str,
        rule: Option<&StoredRule>,
    ) -> Result<bool, FleetError> {
        let mut conn = self.conn.lock().clone().ok_or(FleetError::Down)?;
        let json = match rule {
            Some(r) => {
                Some(serde_json::to_string(r).map_err(|e| FleetError::Redis(e.to_string()))?)
            }
            None => None,
        };
        let epoch = new_epoch();
        let written =
            self.scripts
                .write(&mut conn, &self.keys, fingerprint, json.as_deref(), &epoch);
        let (changed, _) = timed(written)
            .await
            .map_err(|e| FleetError::Redis(e.to_string()))?;
        // The change is in the fleet; a failure to read it back here is healed by the next
        // heartbeat, so it is logged, not reported as a failed write.
        if let Err(e) = self.sync(&mut conn, rules).await {
            tracing::warn!(error = %e, "fleet: rule written, but reading the rule set back failed");
        }
        Ok(changed)
    }

    /// Reads the fleet's rules and applies them if they differ from what was applied.
    async fn sync(
        &self,
        conn: &mut MultiplexedConnection,
        rules: &RuleSet,
    ) -> redis::RedisResult<()> {
        let _one = self.sync_lock.lock().await;
        let snap = timed(self.scripts.read(conn, &self.keys)).await?;
        let expired = self.apply(snap, rules);
        if !expired.is_empty() {
            let n = timed(self.scripts.prune(conn, &self.keys, &expired)).await?;
            tracing::debug!(removed = n, "fleet: expired rules removed from Redis");
        }
        Ok(())
    }

    /// Applies a snapshot; returns the entries that have expired, for removal from Redis.
    fn apply(&self, snap: RuleSnapshot, rules: &RuleSet) -> Vec<(String, String)> {
        let stamp = (snap.epoch.clone(), snap.version);
        let now = unix_ms();
        if self.applied.lock().as_ref() == Some(&stamp)
            && now < self.next_expiry.load(Ordering::Relaxed)
        {
            return Vec::new();
        }
        let mut expired = Vec::new();
        let mut entries = Vec::with_capacity(snap.entries.len());
        for (fp, json) in &snap.entries {
            match parse_stored_rule(fp, json) {
                Ok(r) if r.expires_unix_ms.is_some_and(|ms| ms <= now) => {
                    expired.push((fp.clone(), json.clone()));
                }
                Ok(r) => entries.push(r),
                Err(e) => {
                    let shown: String = fp.chars().take(32).collect();
                    tracing::error!(fingerprint = %shown, error = %e, "fleet: stored rule skipped");
                }
            }
        }
        let next = entries.iter().filter_map(|r| r.expires_unix_ms).min();
        self.next_expiry
            .store(next.unwrap_or(u64::MAX), Ordering::Relaxed);
        let (outcome, errors) = rules.sync(&entries);
        for e in errors {
            tracing::error!(error = %e, "fleet: stored rule is invalid; skipped");
        }
        self.counters.rule_syncs.fetch_add(1, Ordering::Relaxed);
        if outcome.changed() {
            tracing::info!(
                version = snap.version,
                added = outcome.added,
                replaced = outcome.replaced,
                removed = outcome.removed,
                kept = outcome.kept,
                "fleet: rule set applied"
            );
        }
        *self.applied.lock() = Some(stamp);
        expired
    }

    /// One connected stretch: returns when Redis fails (or never, until cancelled).
    async fn session(&self, policy: &Policy) -> redis::RedisResult<()> {
        let rules = policy.rules();
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CALL_TIMEOUT))
            .set_response_timeout(Some(CALL_TIMEOUT));
        let mut conn = timed(
            self.client
                .get_multiplexed_async_connection_with_config(&config),
        )
        .await?;
        let mut pubsub = timed(self.client.get_async_pubsub()).await?;
        timed(pubsub.subscribe(&self.keys.channel)).await?;
        let mut messages = pubsub.into_on_message();

        // An empty store (first start, or Redis restarted without persistence) gets our rules.
        let ours = stored_pairs(rules);
        if timed(
            self.scripts
                .seed(&mut conn, &self.keys, &new_epoch(), &ours),
        )
        .await?
        {
            tracing::info!(
                rules = ours.len(),
                "fleet: seeded an empty Redis with this instance's rules"
            );
        }
        self.beat(&mut conn, policy).await?;
        *self.conn.lock() = Some(conn.clone());
        self.set_up(true, rules);

        let mut beat = tokio::time::interval(self.heartbeat);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        beat.reset();
        let mut fill = tokio::time::interval(FILL_TICK);
        fill.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let gate = Arc::clone(rules.gate());
        loop {
            tokio::select! {
                _ = beat.tick() => self.beat(&mut conn, policy).await?,
                msg = messages.next() => match msg {
                    Some(_) => self.sync(&mut conn, rules).await?,
                    None => return Err(redis::RedisError::from(std::io::Error::other(
                        "the rule-change subscription ended",
                    ))),
                },
                _ = gate.wanted() => self.fill(&mut conn, rules).await?,
                _ = fill.tick() => self.fill(&mut conn, rules).await?,
            }
        }
    }

    /// Heartbeat: renew membership, learn the live set, catch up on rules if behind.
    async fn beat(
        &self,
        conn: &mut MultiplexedConnection,
        policy: &Policy,
    ) -> redis::RedisResult<()> {
        let ttl = u64::try_from(self.heartbeat.as_millis() * 3).unwrap_or(u64::MAX);
        if self.claimed_peer_id {
            let renew = self.scripts.renew_peer_id(
                conn,
                &self.key_prefix,
                self.me.peer_id,
                &self.id,
                peer_id_ttl_ms(self.heartbeat),
            );
            if let Some(holder) = timed(renew).await? {
                // Only after a Redis outage longer than the claim's TTL. Cancels for this
                // instance's keys may then reach the other holder, which ignores them (the
                // secret does not match): lost, never misapplied.
                tracing::warn!(peer_id = self.me.peer_id, holder = %holder, "fleet: this instance's claimed peer id is held by another instance; restart to claim a new one");
            }
        }
        let hb = timed(self.scripts.heartbeat(conn, &self.keys, &self.me, ttl)).await?;
        // A predecessor that died without leaving shows up once (its entry is overwritten by
        // this heartbeat); a live twin shows up at every heartbeat.
        let streak = if hb.same_id.is_some() {
            self.same_id_streak.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            self.same_id_streak.store(0, Ordering::Relaxed);
            0
        };
        if let Some(other) = hb.same_id.as_ref().filter(|_| streak >= 2) {
            let now = unix_ms();
            let last = self.same_id_warned.swap(now, Ordering::Relaxed);
            if now.saturating_sub(last) >= 60_000 {
                tracing::error!(
                    instance = %self.id,
                    other_cancel_addr = ?other.cancel_addr,
                    other_started_unix_ms = other.started_unix_ms,
                    "fleet: another live instance uses the same instance_id; give each a unique fleet.instance_id (they count as one member)"
                );
            }
        }
        let n = u32::try_from(hb.members.len()).unwrap_or(u32::MAX).max(1);
        let before = self.members.lock().clone();
        if before
            .iter()
            .map(|m| &m.id)
            .ne(hb.members.iter().map(|m| &m.id))
        {
            let ids: Vec<&str> = hb.members.iter().map(|m| m.id.as_str()).collect();
            tracing::info!(members = ?ids, "fleet: membership changed");
        }
        let (members, refused) = checked_members(hb.members);
        {
            let mut last = self.refused_addrs.lock();
            for (id, addr) in refused.iter().filter(|r| !last.contains(r)) {
                let addr: String = addr.chars().take(80).collect();
                tracing::warn!(member = %id, cancel_addr = ?addr, "fleet: a member announced a cancel address that is not HOST:PORT; its cancel keys are not routed");
            }
            *last = refused;
        }
        *self.members.lock() = members;
        policy.set_fleet_members(n);
        let stamp = (hb.epoch, hb.version);
        let expired = unix_ms() >= self.next_expiry.load(Ordering::Relaxed);
        if expired || self.applied.lock().as_ref() != Some(&stamp) {
            self.sync(conn, policy.rules()).await?;
        }
        Ok(())
    }

    /// Leases tokens for every fleet bucket that wants some.
    async fn fill(
        &self,
        conn: &mut MultiplexedConnection,
        rules: &RuleSet,
    ) -> redis::RedisResult<()> {
        for bucket in rules.gate().buckets() {
            let Some(want) = bucket.wants(Instant::now()) else {
                continue;
            };
            if want == 0 {
                continue;
            }
            let interval_us = ((1e6 / bucket.rate()).round() as u64).max(1);
            let key = self.keys.bucket(bucket.key());
            let leased = self
                .scripts
                .lease(conn, &key, interval_us, bucket.burst(), want);
            let (granted, wait_us) = timed(leased).await?;
            self.counters.lease_requests.fetch_add(1, Ordering::Relaxed);
            self.counters
                .lease_tokens
                .fetch_add(u64::from(granted), Ordering::Relaxed);
            bucket.grant(granted, Duration::from_micros(wait_us), Instant::now());
        }
        Ok(())
    }

    fn set_up(&self, up: bool, rules: &RuleSet) {
        rules.gate().set_leasing(up);
        if !up {
            *self.conn.lock() = None;
        }
        if self.up.swap(up, Ordering::AcqRel) != up {
            if up {
                tracing::info!(instance = %self.id, "fleet: Redis reachable; rules and limits are shared");
            } else {
                tracing::warn!(
                    instance = %self.id,
                    "fleet: Redis unreachable; enforcing the last rules and local shares of fleet limits"
                );
            }
        }
    }

    /// Leave the member set (on shutdown) so the others rebalance at once.
    async fn leave(&self) {
        let conn = self.conn.lock().clone();
        if let Some(mut conn) = conn {
            let left = self.scripts.leave(&mut conn, &self.keys, &self.id);
            if let Err(e) = timed(left).await {
                tracing::debug!(error = %e, "fleet: leaving the member set failed");
            }
        }
    }
}

/// A rule entry as read from Redis: within [`MAX_STORED_RULE_BYTES`], parsed, stored under
/// its own fingerprint. (Its rule is validated like a PUT when applied, by `RuleSet::sync`.)
fn parse_stored_rule(fingerprint: &str, json: &str) -> Result<StoredRule, String> {
    if json.len() > MAX_STORED_RULE_BYTES {
        return Err(format!(
            "{} bytes, more than the {MAX_STORED_RULE_BYTES} a rule may have",
            json.len()
        ));
    }
    let r: StoredRule = serde_json::from_str(json).map_err(|e| format!("does not parse: {e}"))?;
    if r.fingerprint != fingerprint {
        return Err("names another fingerprint".into());
    }
    Ok(r)
}

/// Members as read from Redis, with cancel addresses that fail `check_dial_addr` removed
/// (those members' keys are not routed); also the refused (member id, address) pairs.
fn checked_members(members: Vec<Member>) -> (Vec<Member>, Vec<(String, String)>) {
    let mut refused = Vec::new();
    let members = members
        .into_iter()
        .map(|mut m| {
            if let Some(addr) = m.cancel_addr.take_if(|a| check_dial_addr(a).is_err()) {
                refused.push((m.id.clone(), addr));
            }
            m
        })
        .collect();
    (members, refused)
}

/// The fleet task: connects, runs `Fleet::session`, and on failure degrades and retries
/// with full-jitter backoff, until shutdown.
/// It takes what it uses: the fleet, the policy it feeds (rules, member count), this
/// instance's `peer_id` and the process's stop signal
/// ([`crate::lifecycle::Lifecycle::stop_token`]).
pub async fn run(
    fleet: Arc<Fleet>,
    policy: &Policy,
    peer_id: u8,
    shutdown: tokio_util::sync::CancellationToken,
) {
    if peer_id == 0 {
        tracing::info!(
            "fleet: no peer_id, so cancel keys of this instance are not routed by other members"
        );
    }
    let rules = policy.rules();
    let mut attempt = 0u32;
    loop {
        let started = Instant::now();
        let result = tokio::select! {
            r = fleet.session(policy) => r,
            _ = shutdown.cancelled() => {
                fleet.leave().await;
                return;
            }
        };
        if let Err(e) = result {
            fleet.counters.redis_errors.fetch_add(1, Ordering::Relaxed);
            if fleet.redis_up() {
                tracing::warn!(error = %e, "fleet: Redis call failed");
            } else {
                tracing::debug!(error = %e, "fleet: Redis still unreachable");
            }
        }
        fleet.set_up(false, rules);
        if started.elapsed() > Duration::from_secs(10) {
            attempt = 0;
        }
        let wait = crate::policy::refusal::full_jitter_ms(BACKOFF_BASE_MS, BACKOFF_CAP_MS, attempt);
        attempt = attempt.saturating_add(1);
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

/// A Redis call bounded by [`CALL_TIMEOUT`]; a timeout is an I/O error like a refusal.
async fn timed<T>(fut: impl Future<Output = redis::RedisResult<T>>) -> redis::RedisResult<T> {
    match tokio::time::timeout(CALL_TIMEOUT, fut).await {
        Ok(r) => r,
        Err(_) => Err(redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "Redis did not answer within 1 s",
        ))),
    }
}

/// This instance's rules as (fingerprint, stored JSON) pairs.
fn stored_pairs(rules: &RuleSet) -> Vec<(String, String)> {
    rules
        .stored()
        .into_iter()
        .filter_map(|r| {
            serde_json::to_string(&r)
                .ok()
                .map(|j| (r.fingerprint.clone(), j))
        })
        .collect()
}

/// How long a claimed peer id outlives its holder's last heartbeat.
fn peer_id_ttl_ms(heartbeat: Duration) -> u64 {
    u64::try_from((heartbeat * 30).max(Duration::from_secs(60)).as_millis()).unwrap_or(u64::MAX)
}

/// With a `fleet` and no `peer_id`: claims a free cancel-key id in Redis (before any key is
/// handed out), so cancels are routed between members without configuring ids. `None` if
/// Redis cannot be reached within `wait` or all 255 ids are taken (logged).
pub async fn claim_peer_id(config: &Config, wait: Duration) -> Option<u8> {
    let f = config.fleet.as_ref()?;
    if config.peer_id != 0 {
        return None;
    }
    let id = instance_id(f);
    let ttl = peer_id_ttl_ms(Duration::from_millis(f.heartbeat_ms));
    let claim = async {
        let client = redis::Client::open(f.redis_url.as_str())?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        Scripts::default()
            .claim_peer_id(&mut conn, &f.key_prefix, &id, ttl)
            .await
    };
    match tokio::time::timeout(wait, claim).await {
        Ok(Ok(0)) => {
            tracing::warn!(
                "fleet: all 255 peer ids are taken; this instance's cancel keys are not routed"
            );
            None
        }
        Ok(Ok(n)) => {
            tracing::info!(peer_id = n, instance = %id, "fleet: claimed a peer id for cancel routing");
            Some(n)
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "fleet: cannot claim a peer id; this instance's cancel keys are not routed (set peer_id to route them)");
            None
        }
        Err(_) => {
            tracing::warn!(
                "fleet: Redis did not answer; this instance's cancel keys are not routed (set peer_id to route them)"
            );
            None
        }
    }
}

/// What this instance announces as its cancel address; `None` (keys not routed) without a
/// peer id, or when the address it would fall back to cannot be dialled by others (a
/// wildcard `listen` such as `0.0.0.0:6432`: set `fleet.cancel_addr`).
fn cancel_addr(config: &Config, f: &FleetConfig) -> Option<String> {
    if config.peer_id == 0 {
        return None;
    }
    let addr = f
        .cancel_addr
        .clone()
        .or_else(|| config.peer_listen.map(|a| a.to_string()))
        .or_else(|| (!config.listen_reuseport).then(|| config.listen.to_string()))?;
    match check_dial_addr(&addr) {
        Ok(()) => Some(addr),
        Err(e) => {
            tracing::warn!(error = %e, "fleet: no usable cancel address to announce (set fleet.cancel_addr); other members will not route cancels here");
            None
        }
    }
}

fn instance_id(f: &FleetConfig) -> String {
    f.instance_id.clone().unwrap_or_else(default_instance_id)
}

fn default_instance_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "pgsluice".to_owned());
    format!("{host}-{}", std::process::id())
}

fn new_epoch() -> String {
    format!("{:016x}", rand::random::<u64>())
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet() -> Arc<Fleet> {
        let config = Config::from_yaml(
            "peer_id: 3\nfleet:\n  redis_url: \"redis://127.0.0.1:1\"\n  instance_id: me\n  cancel_addr: \"10.0.0.3:6433\"\n",
        )
        .unwrap();
        Fleet::from_config(&config, false).unwrap().unwrap()
    }

    fn member(id: &str, peer_id: u8, addr: Option<&str>) -> Member {
        Member {
            id: id.into(),
            peer_id,
            cancel_addr: addr.map(str::to_owned),
            started_unix_ms: 1,
        }
    }

    #[test]
    fn members_with_undiallable_cancel_addresses_are_not_routed() {
        let (members, refused) = checked_members(vec![
            member("a", 1, Some("10.0.0.1:6433")),
            member("b", 2, Some("proxy-b.internal:6433")),
            member("c", 4, Some("not an address")),
            member("d", 5, Some("0.0.0.0:6432")),
            member("e", 6, None),
        ]);
        assert_eq!(members.len(), 5, "members still count for fleet shares");
        let addrs: Vec<Option<&str>> = members.iter().map(|m| m.cancel_addr.as_deref()).collect();
        assert_eq!(
            addrs,
            [
                Some("10.0.0.1:6433"),
                Some("proxy-b.internal:6433"),
                None,
                None,
                None
            ]
        );
        assert_eq!(
            refused,
            [
                ("c".to_owned(), "not an address".to_owned()),
                ("d".to_owned(), "0.0.0.0:6432".to_owned())
            ]
        );
        let f = fleet();
        *f.members.lock() = members;
        let peers: Vec<(u8, String)> = f
            .cancel_peers()
            .into_iter()
            .map(|p| (p.id, p.addr))
            .collect();
        assert_eq!(
            peers,
            [
                (1, "10.0.0.1:6433".to_owned()),
                (2, "proxy-b.internal:6433".to_owned())
            ]
        );
    }

    #[test]
    fn rules_from_redis_pass_the_api_caps_and_validation() {
        let stored = |fp: &str, rule: &str| {
            format!(r#"{{"fingerprint":"{fp}","created_unix_ms":1,"rule":{rule}}}"#)
        };
        let ok = "00000000000000a1";
        let callers = (0..=crate::policy::rules::MAX_RULE_CALLERS)
            .map(|i| format!("\"c{i}\""))
            .collect::<Vec<_>>()
            .join(",");
        let padded = format!(
            r#"{{"fingerprint":"00000000000000a2","created_unix_ms":1,"rule":{{"action":"REJECT"}}{}}}"#,
            " ".repeat(MAX_STORED_RULE_BYTES)
        );
        let entries = vec![
            (ok.to_owned(), stored(ok, r#"{"action":"REJECT"}"#)),
            ("00000000000000a2".to_owned(), padded),
            (
                "00000000000000a3".to_owned(),
                stored(
                    "00000000000000a3",
                    &format!(r#"{{"action":"REJECT","callers":[{callers}]}}"#),
                ),
            ),
            (
                "00000000000000a4".to_owned(),
                stored("00000000000000a4", r#"{"action":"THROTTLE","max_qps":-1}"#),
            ),
            (
                "00000000000000a5".to_owned(),
                stored("00000000000000ff", r#"{"action":"REJECT"}"#),
            ),
            ("00000000000000a6".to_owned(), "{not json".to_owned()),
        ];
        assert!(parse_stored_rule("00000000000000a2", &entries[1].1).is_err());
        assert!(parse_stored_rule("00000000000000a5", &entries[4].1).is_err());
        let rules = RuleSet::new();
        let f = fleet();
        let expired = f.apply(
            RuleSnapshot {
                epoch: Some("e".into()),
                version: 1,
                entries,
            },
            &rules,
        );
        assert!(expired.is_empty());
        let live: Vec<String> = rules.stored().into_iter().map(|r| r.fingerprint).collect();
        assert_eq!(live, [ok], "only the valid rule is applied");
    }
}
