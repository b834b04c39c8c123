//! The Redis side of a fleet: key names and the Lua scripts, each one round trip.
//!
//! Keys (all under `key_prefix`, default `pgsluice`):
//! * `P:members` — sorted set, member = instance id, score = the unix ms at which its
//!   heartbeat runs out (3 heartbeats); `P:members:info` — hash, instance id → JSON
//!   ([`Member`]). A heartbeat renews both and drops members whose time ran out. Both keys
//!   carry a TTL so a fleet that is gone leaves nothing behind.
//! * `P:rules` — hash, fingerprint hex → the rule's stored JSON (as in the rules file);
//!   `P:rules:version` — counter bumped by every change; `P:rules:epoch` — random id set when
//!   the rule set was first seeded, so a Redis that restarted empty (version counting from
//!   scratch) is noticed by instances that applied a higher version earlier.
//! * `P:rules:changed` — pub/sub channel, message = the new version.
//! * `P:peer_id:N` — which instance holds cancel-key id N (1..=255) when ids are claimed
//!   rather than configured; renewed by heartbeats, free again a while after its holder went.
//! * `P:bucket:KEY` — a shared GCRA bucket: the theoretical arrival time in µs of Redis'
//!   own clock (`TIME`), so instances' clock skew does not matter.
//!
//! The peer-id scripts build their key names from the prefix (they probe up to 255 keys); the
//! others touch only the keys they are given. All run on a single Redis (not Cluster: the keys
//! of one script are not in one hash slot).

use redis::aio::MultiplexedConnection;
use redis::{RedisResult, Script};
use serde::{Deserialize, Serialize};

/// One live instance, as it announces itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub id: String,
    /// Its cancel-key id (0: none, its keys are not routed).
    #[serde(default)]
    pub peer_id: u8,
    /// Where CancelRequests for its keys go.
    #[serde(default)]
    pub cancel_addr: Option<String>,
    pub started_unix_ms: u64,
}

/// Key names of one fleet.
#[derive(Debug, Clone)]
pub struct Keys {
    pub members: String,
    pub member_info: String,
    pub rules: String,
    pub version: String,
    pub epoch: String,
    pub channel: String,
    bucket_prefix: String,
}

impl Keys {
    pub fn new(prefix: &str) -> Self {
        Keys {
            members: format!("{prefix}:members"),
            member_info: format!("{prefix}:members:info"),
            rules: format!("{prefix}:rules"),
            version: format!("{prefix}:rules:version"),
            epoch: format!("{prefix}:rules:epoch"),
            channel: format!("{prefix}:rules:changed"),
            bucket_prefix: format!("{prefix}:bucket:"),
        }
    }

    pub fn bucket(&self, key: &str) -> String {
        format!("{}{key}", self.bucket_prefix)
    }
}

/// What a heartbeat learns: the live members and the rule set's (epoch, version).
#[derive(Debug, Clone)]
pub struct Heartbeat {
    pub members: Vec<Member>,
    pub epoch: Option<String>,
    pub version: u64,
    /// Another live instance announced itself under this instance's id since the last
    /// heartbeat (a configuration mistake: the two count as one member).
    pub same_id: Option<Member>,
}

/// A consistent copy of the fleet's rules.
#[derive(Debug, Clone)]
pub struct RuleSnapshot {
    pub epoch: Option<String>,
    pub version: u64,
    /// (fingerprint hex, stored JSON)
    pub entries: Vec<(String, String)>,
}

const HEARTBEAT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
local prev = redis.call('HGET', KEYS[2], ARGV[1])
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
local conflict = ''
if prev and prev ~= ARGV[2] and score and tonumber(score) > now then conflict = prev end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, id in ipairs(dead) do redis.call('HDEL', KEYS[2], id) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ttl * 10)
redis.call('PEXPIRE', KEYS[2], ttl * 10)
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
local infos = redis.call('HMGET', KEYS[2], unpack(ids))
local epoch = redis.call('GET', KEYS[3])
local version = redis.call('GET', KEYS[4])
return {epoch or '', version or '0', infos, conflict}
";

/// ARGV: key prefix, instance id, ttl ms. Returns the peer id (1..=255) this instance holds or
/// just took, 0 if all are taken.
const CLAIM: &str = r"
for i = 1, 255 do
  local k = ARGV[1] .. ':peer_id:' .. i
  if redis.call('GET', k) == ARGV[2] then
    redis.call('PEXPIRE', k, ARGV[3])
    return i
  end
end
for i = 1, 255 do
  if redis.call('SET', ARGV[1] .. ':peer_id:' .. i, ARGV[2], 'NX', 'PX', ARGV[3]) then
    return i
  end
end
return 0
";

/// ARGV: key prefix, peer id, instance id, ttl ms. Renews a claimed peer id; returns the
/// holder if another instance has it (empty string: renewed).
const RENEW: &str = r"
local k = ARGV[1] .. ':peer_id:' .. ARGV[2]
local v = redis.call('GET', k)
if v and v ~= ARGV[3] then return v end
redis.call('SET', k, ARGV[3], 'PX', ARGV[4])
return ''
";

const LEAVE: &str = r"
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
";

/// ARGV: new epoch, then pairs (fingerprint, json). Seeds only a fleet with no epoch yet.
const SEED: &str = r"
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('DEL', KEYS[1])
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('SET', KEYS[2], ARGV[1])
redis.call('SET', KEYS[3], 1)
redis.call('PUBLISH', KEYS[4], 1)
return 1
";

/// ARGV: fingerprint, json (empty: delete), channel, epoch to create if missing.
/// Returns {changed (0/1), version}.
const WRITE: &str = r"
if redis.call('EXISTS', KEYS[3]) == 0 then redis.call('SET', KEYS[3], ARGV[4]) end
local changed
if ARGV[2] == '' then
  changed = redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  changed = 1
end
local v
if changed == 1 then
  v = redis.call('INCR', KEYS[2])
  redis.call('PUBLISH', ARGV[3], v)
else
  v = tonumber(redis.call('GET', KEYS[2]) or '0')
end
return {changed, v}
";

/// ARGV: channel, then pairs (fingerprint, json): each is removed if it still holds that json.
/// Returns how many were removed.
const PRUNE: &str = r"
local n = 0
for i = 2, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    n = n + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
if n > 0 then
  local v = redis.call('INCR', KEYS[2])
  redis.call('PUBLISH', ARGV[1], v)
end
return n
";

const READ: &str = r"
local epoch = redis.call('GET', KEYS[2])
local version = redis.call('GET', KEYS[3])
return {epoch or '', version or '0', redis.call('HGETALL', KEYS[1])}
";

/// GCRA over Redis' clock. ARGV: interval µs, tolerance µs (burst · interval), tokens
/// wanted. Returns {granted, µs until one more token would be there (0 if granted)}.
const LEASE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local tol = tonumber(ARGV[2])
local want = tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local free = math.floor((now + tol - tat) / interval)
local n = math.min(want, free)
if n > 0 then
  tat = tat + n * interval
  redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1000)
  return {n, 0}
end
return {0, tat + interval - tol - now}
";

/// The scripts, hashed once.
pub struct Scripts {
    claim: Script,
    renew: Script,
    heartbeat: Script,
    leave: Script,
    seed: Script,
    write: Script,
    read: Script,
    prune: Script,
    lease: Script,
}

impl Default for Scripts {
    fn default() -> Self {
        Scripts {
            claim: Script::new(CLAIM),
            renew: Script::new(RENEW),
            heartbeat: Script::new(HEARTBEAT),
            leave: Script::new(LEAVE),
            seed: Script::new(SEED),
            write: Script::new(WRITE),
            read: Script::new(READ),
            prune: Script::new(PRUNE),
            lease: Script::new(LEASE),
        }
    }
}

fn version_of(s: &str) -> u64 {
    s.parse().unwrap_or(0)
}

fn epoch_of(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

impl Scripts {
    /// A peer id for `id`: the one it already holds, else a free one (0: none left).
    pub async fn claim_peer_id(
        &self,
        conn: &mut MultiplexedConnection,
        prefix: &str,
        id: &str,
        ttl_ms: u64,
    ) -> RedisResult<u8> {
        let n: i64 = self
            .claim
            .arg(prefix)
            .arg(id)
            .arg(ttl_ms)
            .invoke_async(conn)
            .await?;
        Ok(u8::try_from(n).unwrap_or(0))
    }

    /// Renews a claimed peer id; `Some(holder)` if another instance holds it now.
    pub async fn renew_peer_id(
        &self,
        conn: &mut MultiplexedConnection,
        prefix: &str,
        peer_id: u8,
        id: &str,
        ttl_ms: u64,
    ) -> RedisResult<Option<String>> {
        let holder: String = self
            .renew
            .arg(prefix)
            .arg(peer_id)
            .arg(id)
            .arg(ttl_ms)
            .invoke_async(conn)
            .await?;
        Ok((!holder.is_empty()).then_some(holder))
    }

    pub async fn heartbeat(
        &self,
        conn: &mut MultiplexedConnection,
        keys: &Keys,
        me: &Member,
        ttl_ms: u64,
    ) -> RedisResult<Heartbeat> {
        let info = serde_json::to_string(me).unwrap_or_default();
        let (epoch, version, infos, conflict): (String, String, Vec<Option<String>>, String) = self
            .heartbeat
            .key(&keys.members)
            .key(&keys.member_info)
            .key(&keys.epoch)
            .key(&keys.version)
            .arg(&me.id)
            .arg(info)
            .arg(ttl_ms)
            .invoke_async(conn)
            .await?;
        let mut members: Vec<Member> = infos
            .into_iter()
            .flatten()
            .filter_map(|j| serde_json::from_str(&j).ok())
            .collect();
        members.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(Heartbeat {
            members,
            epoch: epoch_of(epoch),
            version: version_of(&version),
            same_id: serde_json::from_str(&conflict).ok(),
        })
    }

    pub async fn leave(
        &self,
        conn: &mut MultiplexedConnection,
        keys: &Keys,
        id: &str,
    ) -> RedisResult<()> {
        let _: i64 = self
            .leave
            .key(&keys.members)
            .key(&keys.member_info)
            .arg(id)
            .invoke_async(conn)
            .await?;
        Ok(())
    }

    /// Seeds an empty fleet store with `rules`; false if it already had a rule set.
    pub async fn seed(
        &self,
        conn: &mut MultiplexedConnection,
        keys: &Keys,
        epoch: &str,
        rules: &[(String, String)],
    ) -> RedisResult<bool> {
        let mut inv = self.seed.key(&keys.rules);
        inv.key(&keys.epoch)
            .key(&keys.version)
            .key(&keys.channel)
            .arg(epoch);
        for (fp, json) in rules {
            inv.arg(fp).arg(json);
        }
        let seeded: i64 = inv.invoke_async(conn).await?;
        Ok(seeded == 1)
    }

    /// Stores (`Some(json)`) or deletes (`None`) one rule; returns whether anything changed
    /// and the version after it.
    pub async fn write(
        &self,
        conn: &mut MultiplexedConnection,
        keys: &Keys,
        fingerprint: &str,
        json: Option<&str>,
        new_epoch: &str,
    ) -> RedisResult<(bool, u64)> {
        let (changed, version): (i64, u64) = self
            .write
            .key(&keys.rules)
            .key(&keys.version)
            .key(&keys.epoch)
            .arg(fingerprint)
            .arg(json.unwrap_or(""))
            .arg(&keys.channel)
            .arg(new_epoch)
            .invoke_async(conn)
            .await?;
        Ok((changed == 1, version))
    }

    pub async fn read(
        &self,
        conn: &mut MultiplexedConnection,
        keys: &Keys,
    ) -> RedisResult<RuleSnapshot> {
        let (epoch, version, flat): (String, String, Vec<String>) = self
            .read
            .key(&keys.rules)
            .key(&keys.epoch)
            .key(&keys.version)
            .invoke_async(conn)
            .await?;
        let mut entries = Vec::with_capacity(flat.len() / 2);
        let mut it = flat.into_iter();
        while let (Some(fp), Some(json)) = (it.next(), it.next()) {
            entries.push((fp, json));
        }
        Ok(RuleSnapshot {
            epoch: epoch_of(epoch),
            version: version_of(&version),
            entries,
        })
    }

    /// Removes expired rules (each only if unchanged since it was read); how many went.
    pub async fn prune(
        &self,
        conn: &mut MultiplexedConnection,
        keys: &Keys,
        expired: &[(String, String)],
    ) -> RedisResult<u64> {
        let mut inv = self.prune.key(&keys.rules);
        inv.key(&keys.version).arg(&keys.channel);
        for (fp, json) in expired {
            inv.arg(fp).arg(json);
        }
        inv.invoke_async(conn).await
    }

    /// Up to `want` tokens from the shared bucket `key`; returns (granted, µs until the next).
    pub async fn lease(
        &self,
        conn: &mut MultiplexedConnection,
        key: &str,
        interval_us: u64,
        burst: u32,
        want: u32,
    ) -> RedisResult<(u32, u64)> {
        let tolerance = interval_us.saturating_mul(u64::from(burst));
        let (granted, wait): (u32, i64) = self
            .lease
            .key(key)
            .arg(interval_us)
            .arg(tolerance)
            .arg(want)
            .invoke_async(conn)
            .await?;
        Ok((granted, u64::try_from(wait).unwrap_or(0)))
    }
}
