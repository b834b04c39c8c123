//! What a pool knows of its database's user code: the names a parse-proven statement may
//! still reach user code through (views, foreign tables, row-security tables whose policies
//! call user code, user functions and operators, domains with checks; for writes, tables with
//! user-code triggers, rules, defaults, checks or index expressions, or whose writes cascade
//! into or are routed to such a table), read from Postgres's own catalog.
//!
//! Owns [`Catalog`]: the last snapshot of those names, its age and generation, and the claim
//! on its refresh. The snapshot is read by [`CATALOG_SQL`] on a backend the pool is about to
//! reuse anyway (`Pooled::release_at`), at most one at a time, when it is older than
//! [`CATALOG_TTL`] or after a statement that may change the catalog invalidated it.
//!
//! Decisions:
//! - Fail closed: no snapshot, a stale one, or one taken while an invalidation happened
//!   trusts nothing; a name in it makes the statement unproven (verified or reset).
//! - Names are compared lowercased and without their schema: a false match only costs a
//!   verification.
//! - C and internal functions are not user code (only a superuser can create them); SQL,
//!   PL/pgSQL and other languages are. Views are always user code (their rules may call
//!   anything, through other views).
//! - A view or function created *outside* this proxy is seen within [`CATALOG_TTL`]; one
//!   created through it invalidates the snapshot at once.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use foldhash::HashSet;
use std::sync::Arc;
use tokio::time::Instant;

/// A snapshot older than this is read again before it is trusted.
pub const CATALOG_TTL: Duration = Duration::from_secs(10);

/// Reads the names of user code a proven statement could reach: relations whose reads may
/// run it, function, operator and domain names, and (prefixed `write `) tables whose writes
/// may run it. It runs on a backend a client just used, under that client's settings: every
/// name is schema-qualified.
pub const CATALOG_SQL: &str = "\
WITH RECURSIVE sys AS (SELECT pg_catalog.array_agg(oid) AS o FROM pg_catalog.pg_namespace \
 WHERE nspname OPERATOR(pg_catalog.=) ANY ('{pg_catalog,information_schema}'::pg_catalog.text[])), \
userfn AS (SELECT p.oid, p.proname FROM pg_catalog.pg_proc p, sys \
 WHERE p.prolang OPERATOR(pg_catalog.<>) ALL ('{12,13}'::pg_catalog.oid[]) \
 AND p.pronamespace OPERATOR(pg_catalog.<>) ALL (sys.o)), \
calls AS (SELECT d.classid, d.objid FROM pg_catalog.pg_depend d \
 WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass \
 AND d.refobjid OPERATOR(pg_catalog.=) ANY (SELECT oid FROM userfn)), \
hooked AS (\
 SELECT t.tgrelid AS rel FROM pg_catalog.pg_trigger t \
  WHERE t.tgfoid OPERATOR(pg_catalog.=) ANY (SELECT oid FROM userfn) \
 UNION SELECT r.ev_class FROM pg_catalog.pg_rewrite r \
  WHERE r.rulename OPERATOR(pg_catalog.<>) '_RETURN' \
 UNION SELECT a.adrelid FROM pg_catalog.pg_attrdef a, calls \
  WHERE calls.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_attrdef'::pg_catalog.regclass \
  AND calls.objid OPERATOR(pg_catalog.=) a.oid \
 UNION SELECT k.conrelid FROM pg_catalog.pg_constraint k, calls \
  WHERE calls.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_constraint'::pg_catalog.regclass \
  AND calls.objid OPERATOR(pg_catalog.=) k.oid AND k.conrelid OPERATOR(pg_catalog.<>) 0 \
 UNION SELECT i.indrelid FROM pg_catalog.pg_index i, calls \
  WHERE calls.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass \
  AND calls.objid OPERATOR(pg_catalog.=) i.indexrelid \
 UNION SELECT a.attrelid FROM pg_catalog.pg_attribute a \
  JOIN pg_catalog.pg_type t ON t.oid OPERATOR(pg_catalog.=) a.atttypid \
  WHERE t.typtype OPERATOR(pg_catalog.=) 'd' AND a.attnum OPERATOR(pg_catalog.>) 0 \
  AND EXISTS (SELECT FROM pg_catalog.pg_constraint k WHERE k.contypid OPERATOR(pg_catalog.=) t.oid) \
 UNION SELECT c.oid FROM pg_catalog.pg_class c \
  WHERE c.relkind OPERATOR(pg_catalog.=) ANY ('{v,f}'::pg_catalog.\"char\"[])), \
closure(rel) AS (SELECT rel FROM hooked \
 UNION SELECT x.up FROM closure, LATERAL (\
  SELECT h.inhparent AS up FROM pg_catalog.pg_inherits h \
   WHERE h.inhrelid OPERATOR(pg_catalog.=) closure.rel \
  UNION ALL SELECT f.confrelid FROM pg_catalog.pg_constraint f \
   WHERE f.conrelid OPERATOR(pg_catalog.=) closure.rel AND f.contype OPERATOR(pg_catalog.=) 'f' \
   AND (f.confupdtype OPERATOR(pg_catalog.<>) ALL ('{a,r}'::pg_catalog.\"char\"[]) \
    OR f.confdeltype OPERATOR(pg_catalog.<>) ALL ('{a,r}'::pg_catalog.\"char\"[]))) x) \
SELECT c.relname::pg_catalog.text FROM pg_catalog.pg_class c, sys \
 WHERE c.relnamespace OPERATOR(pg_catalog.<>) ALL (sys.o) \
 AND (c.relkind OPERATOR(pg_catalog.=) ANY ('{v,f}'::pg_catalog.\"char\"[]) \
  OR (c.relrowsecurity AND EXISTS (SELECT FROM pg_catalog.pg_policy pol \
   JOIN pg_catalog.pg_depend d ON d.objid OPERATOR(pg_catalog.=) pol.oid \
   AND d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_policy'::pg_catalog.regclass \
   WHERE pol.polrelid OPERATOR(pg_catalog.=) c.oid \
   AND ((d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass \
     AND d.refobjid OPERATOR(pg_catalog.<>) c.oid) \
    OR (d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass \
     AND d.refobjid OPERATOR(pg_catalog.=) ANY (SELECT oid FROM userfn)))))) \
UNION SELECT proname::pg_catalog.text FROM userfn \
UNION SELECT o.oprname::pg_catalog.text FROM pg_catalog.pg_operator o \
 WHERE o.oprcode::pg_catalog.oid OPERATOR(pg_catalog.=) ANY (SELECT oid FROM userfn) \
UNION SELECT t.typname::pg_catalog.text FROM pg_catalog.pg_type t, sys \
 WHERE t.typtype OPERATOR(pg_catalog.=) 'd' AND t.typnamespace OPERATOR(pg_catalog.<>) ALL (sys.o) \
 AND EXISTS (SELECT FROM pg_catalog.pg_constraint k WHERE k.contypid OPERATOR(pg_catalog.=) t.oid) \
UNION SELECT 'write ' OPERATOR(pg_catalog.||) c.relname::pg_catalog.text FROM pg_catalog.pg_class c \
 WHERE c.oid OPERATOR(pg_catalog.=) ANY (SELECT rel FROM closure)";

struct Snapshot {
    names: HashSet<Box<str>>,
    taken: Instant,
    generation: u64,
}

/// One pool's knowledge of its database's user code (see the module doc).
#[derive(Default)]
pub struct Catalog {
    snapshot: ArcSwapOption<Snapshot>,
    /// Bumped by every invalidation; a snapshot of an older generation trusts nothing.
    generation: AtomicU64,
    refreshing: AtomicBool,
}

/// A claim on the one refresh in flight ([`Catalog::claim`]).
#[derive(Debug)]
pub struct Claim {
    generation: u64,
}

impl Catalog {
    /// Whether a statement that depends on `names` (`classify::Proof::names`) reaches no user
    /// code, as far as a fresh snapshot tells. No names: nothing to ask.
    #[inline]
    pub fn trusts(&self, names: &[Box<str>], now: Instant) -> bool {
        if names.is_empty() {
            return true;
        }
        let guard = self.snapshot.load();
        let Some(s) = guard.as_ref() else {
            return false;
        };
        s.generation == self.generation.load(Ordering::Acquire)
            && now.saturating_duration_since(s.taken) < CATALOG_TTL
            && !names.iter().any(|n| s.names.contains(n))
    }

    /// Something may have changed the catalog: trust no snapshot taken before now.
    pub fn invalidate(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether [`Catalog::claim`] would succeed now (without taking the claim).
    pub fn claimable(&self, now: Instant) -> bool {
        !self.refreshing.load(Ordering::Acquire) && !self.fresh(now)
    }

    fn fresh(&self, now: Instant) -> bool {
        let generation = self.generation.load(Ordering::Acquire);
        self.snapshot.load().as_ref().is_some_and(|s| {
            s.generation == generation && now.saturating_duration_since(s.taken) < CATALOG_TTL
        })
    }

    /// The right to refresh, when the snapshot needs it and no refresh is in flight.
    pub fn claim(&self, now: Instant) -> Option<Claim> {
        let generation = self.generation.load(Ordering::Acquire);
        if self.fresh(now)
            || self
                .refreshing
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
        {
            return None;
        }
        Some(Claim { generation })
    }

    /// Ends a refresh: `names` (lowercased here) when it succeeded, `None` when it failed.
    /// A refresh that an invalidation overtook is dropped.
    pub fn finish(&self, claim: Claim, names: Option<Vec<String>>, taken: Instant) {
        if let Some(names) = names
            && self.generation.load(Ordering::Acquire) == claim.generation
        {
            let names = names
                .into_iter()
                .map(|n| n.to_lowercase().into_boxed_str())
                .collect();
            self.snapshot.store(Some(Arc::new(Snapshot {
                names,
                taken,
                generation: claim.generation,
            })));
        }
        self.refreshing.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(v: &[&str]) -> Vec<Box<str>> {
        v.iter().map(|s| Box::from(*s)).collect()
    }

    #[test]
    fn trusts_only_a_fresh_snapshot_without_the_names() {
        let c = Catalog::default();
        let t0 = Instant::now();
        assert!(c.trusts(&[], t0), "nothing to ask");
        assert!(!c.trusts(&n(&["t"]), t0), "no snapshot yet");
        let claim = c.claim(t0).expect("first claim");
        assert!(c.claim(t0).is_none(), "one refresh at a time");
        c.finish(
            claim,
            Some(vec!["Evil_View".into(), "set_tenant".into()]),
            t0,
        );
        assert!(c.trusts(&n(&["=", "t"]), t0));
        assert!(!c.trusts(&n(&["t", "evil_view"]), t0));
        assert!(!c.trusts(&n(&["set_tenant"]), t0));
        assert!(c.claim(t0).is_none(), "fresh");
        let later = t0 + CATALOG_TTL;
        assert!(!c.trusts(&n(&["t"]), later), "stale");
        assert!(c.claim(later).is_some());
    }

    #[test]
    fn an_invalidation_overtakes_a_refresh_in_flight() {
        let c = Catalog::default();
        let t0 = Instant::now();
        let claim = c.claim(t0).expect("claim");
        c.invalidate();
        c.finish(claim, Some(vec![]), t0);
        assert!(!c.trusts(&n(&["t"]), t0), "taken before the change");
        let claim = c.claim(t0).expect("claim again");
        c.finish(claim, Some(vec![]), t0);
        assert!(c.trusts(&n(&["t"]), t0));
        c.invalidate();
        assert!(!c.trusts(&n(&["t"]), t0));
        // A failed refresh releases the claim and keeps nothing.
        let claim = c.claim(t0).expect("claim");
        c.finish(claim, None, t0);
        assert!(!c.trusts(&n(&["t"]), t0));
        assert!(c.claim(t0).is_some());
    }
}
