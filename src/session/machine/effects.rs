//! What a statement does to the server session, decided without I/O: the cleanup its
//! backend needs before another client gets it, whether the client is pinned to it, whether
//! its settings are read back, whether the backend's prepared statements are gone. Where a
//! statement's proof cannot be trusted — the session's settings change how texts are read,
//! a `set_config` names a setting that does, a name it depends on is user code in the
//! database, a custom setting's name cannot be known — the worst is assumed (the check
//! against Postgres, or a full reset, per `pool.unproven`); and a client that leaves
//! before its session is known leaves it to a full reset. The relay applies the verdicts to
//! the backend and the pool.

use crate::classify::proof::READING_SETTINGS;
use crate::classify::{Classified, SessionEffect};
use crate::config::{PoolMode, SessionStateMode, UnprovenMode};
use crate::pool::Dirt;
use crate::protocol::PgError;
use crate::session::state;

use super::SessionCore;

/// The pool's settings the verdict follows (`pool.session_state`, `pool.unproven`).
#[derive(Debug, Clone, Copy)]
pub(in crate::session) struct Rules {
    pub session_state: SessionStateMode,
    pub unproven: UnprovenMode,
}

/// What the relay does to the backend and the pool for one statement.
#[derive(Debug, Default, PartialEq)]
pub(in crate::session) struct Verdict {
    /// Marks merged into the backend's cleanup before reuse.
    pub dirt: Dirt,
    /// The backend's prepared statements are gone (DEALLOCATE ALL, DISCARD ALL).
    pub forget_prepared: bool,
    /// The client was pinned to its backend by this statement (the pool counts it once).
    pub pinned_now: bool,
    /// The catalog may have changed: the pool's snapshot of user code is stale.
    pub catalog_changed: bool,
    /// The statement itself may have done what the parse cannot show: the backend is
    /// checked or reset for it, and the relay notes its fingerprint there (the check's
    /// report names it). Not set for a custom setting's unknown name alone.
    pub unproven: bool,
}

impl SessionCore {
    /// The verdict on statement `c` (its text `sql` where a `set_config` may need it), or
    /// `None` when it touches nothing; `Err` refuses it (`session_state: reject`).
    /// `catalog_trusts`: whether the pool's snapshot of the database's user code proves the
    /// names the statement depends on plain (asked only when it names any).
    pub(in crate::session) fn effects(
        &mut self,
        c: &Classified,
        sql: Option<&[u8]>,
        rules: Rules,
        catalog_trusts: impl FnOnce(&[Box<str>]) -> bool,
    ) -> Result<Option<Verdict>, PgError> {
        let transaction = self.mode == PoolMode::Transaction;
        let doubt = transaction && self.doubts(c, sql, catalog_trusts);
        if c.effects.is_empty() && !doubt {
            return Ok(None);
        }
        let mut a = state::assess(c, rules.session_state, rules.unproven);
        if !transaction {
            // Session mode: the client owns the backend; only our statement cache cares.
            a = state::Assessment {
                forget_prepared: a.forget_prepared,
                ..Default::default()
            };
        }
        if doubt {
            // Checked or reset as for `SessionEffect::Unknown` (`state::assess`), but not read
            // back for the client: what a trigger, a view or a default changes in the session
            // is not the client's to keep (reading settings back costs Postgres a render of
            // `pg_settings` per unit), and the check undoes it.
            a.dirt.merge(state::unproven_dirt(rules.unproven));
        }
        if let Some(e) = a.reject {
            return Err(e);
        }
        let catalog_changed = transaction && c.proof.catalog_change;
        a.dirt.catalog |= catalog_changed;
        let unproven = a.dirt.verify || a.dirt.all;
        let pinned_now = a.pin && self.pin();
        if a.capture && !self.note_custom_gucs(c, sql) {
            // A custom setting whose name we cannot tell would escape the read-back: what
            // the check finds (or a full reset) undoes it.
            a.dirt.merge(state::unproven_dirt(rules.unproven));
        }
        self.capture_after(a.capture);
        Ok(Some(Verdict {
            dirt: a.dirt,
            forget_prepared: a.forget_prepared,
            pinned_now,
            catalog_changed,
            unproven,
        }))
    }

    /// The client left before the proxy knew what its server session looks like: settings
    /// not yet read back, a read-back or re-apply unanswered, the client's budgets not yet put
    /// back (`restore_pending`), replies still owed. Then the backend gets `DISCARD ALL`
    /// before anyone else has it (fail closed).
    pub(in crate::session) fn left_unknown(&self, restore_pending: bool) -> bool {
        self.capture_needed || self.out.t.capturing() || restore_pending || !self.out.t.idle()
    }

    /// Whether a statement the parse proved (`classify::proof`) may still reach user code or
    /// be read otherwise than Postgres reads it: the session's settings change how texts are
    /// read (`reading_trusted`), a `set_config` names a setting that does, or a name it
    /// depends on is user code in the database (or the pool's snapshot of that is stale).
    #[inline(always)]
    fn doubts(
        &self,
        c: &Classified,
        sql: Option<&[u8]>,
        catalog_trusts: impl FnOnce(&[Box<str>]) -> bool,
    ) -> bool {
        if !c.proof.is_proven() {
            // Already `SessionEffect::Unknown`.
            return false;
        }
        if !self.reading_trusted {
            return true;
        }
        if c.proof.set_config {
            match sql.and_then(state::set_config_names) {
                Some(names) if !names.iter().any(|n| READING_SETTINGS.contains(&n.as_str())) => {}
                _ => return true,
            }
        }
        !c.proof.names.is_empty() && !catalog_trusts(&c.proof.names)
    }

    /// Notes the custom (dotted) settings a tracked statement may set, for the read-back;
    /// `false` when their names cannot all be known (then only a full reset is safe).
    fn note_custom_gucs(&mut self, c: &Classified, sql: Option<&[u8]>) -> bool {
        let mut names = Vec::new();
        for e in &c.effects {
            match e {
                SessionEffect::Set { name, local: false }
                | SessionEffect::Reset { name: Some(name) } => names.push(name.clone()),
                SessionEffect::SetConfigSession => {
                    let Some(found) = sql.and_then(state::set_config_names) else {
                        return false;
                    };
                    names.extend(found);
                }
                _ => {}
            }
        }
        self.remember_custom_gucs(names)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use bytes::BytesMut;

    use super::*;
    use crate::classify::Classifier;
    use crate::session::machine::statements::Statements;
    use crate::session::machine::{CoreLimits, MAX_CUSTOM_GUCS};

    fn session(mode: PoolMode, reading_trusted: bool) -> SessionCore {
        SessionCore::new(
            mode,
            BytesMut::new(),
            CoreLimits {
                max_message: 1 << 20,
            },
            Statements::new(mode == PoolMode::Transaction, 0, 100),
            reading_trusted,
            true,
        )
    }

    const TRACK: Rules = Rules {
        session_state: SessionStateMode::Track,
        unproven: UnprovenMode::Verify,
    };

    /// The verdict on `sql`, the catalog vouching for every name (`trusted`) or none.
    fn verdict(
        core: &mut SessionCore,
        sql: &str,
        rules: Rules,
        trusted: bool,
    ) -> Result<Option<Verdict>, PgError> {
        let c = Classifier::new(0, 1 << 16).classify(sql);
        core.effects(&c, Some(sql.as_bytes()), rules, |_| trusted)
    }

    fn checked() -> Dirt {
        Dirt {
            verify: true,
            ..Dirt::default()
        }
    }

    #[test]
    fn a_statement_that_touches_nothing_leaves_the_backend_clean() {
        let mut core = session(PoolMode::Transaction, true);
        let asked = Cell::new(false);
        let c = Classifier::new(0, 1 << 16).classify("SELECT 1");
        let v = core.effects(&c, None, TRACK, |_| {
            asked.set(true);
            false
        });
        assert_eq!(v.unwrap(), None);
        assert!(!asked.get(), "a statement naming nothing needs no catalog");
        assert!(!core.capture_needed());
    }

    #[test]
    fn a_session_setting_is_read_back_not_checked() {
        let mut core = session(PoolMode::Transaction, true);
        let v = verdict(&mut core, "SET work_mem = '64MB'", TRACK, true)
            .unwrap()
            .unwrap();
        // Tracked: read back and re-applied wherever the client goes, nothing to reset.
        assert!(!v.dirt.any() && !v.unproven, "{v:?}");
        assert!(core.capture_needed());
    }

    #[test]
    fn a_name_the_catalog_does_not_vouch_for_is_checked_against_postgres() {
        let sql = "SELECT * FROM accounts";
        let mut core = session(PoolMode::Transaction, true);
        assert_eq!(verdict(&mut core, sql, TRACK, true).unwrap(), None);
        let v = verdict(&mut core, sql, TRACK, false).unwrap().unwrap();
        assert_eq!((v.dirt, v.unproven), (checked(), true));
        // The check is not a read-back: what user code did is not the client's to keep.
        assert!(!core.capture_needed());
        let reset = Rules {
            unproven: UnprovenMode::Reset,
            ..TRACK
        };
        let v = verdict(&mut core, sql, reset, false).unwrap().unwrap();
        assert!(v.dirt.all && !v.dirt.verify && v.unproven);
    }

    #[test]
    fn settings_that_change_how_texts_read_doubt_every_proven_statement() {
        let mut core = session(PoolMode::Transaction, false);
        let v = verdict(&mut core, "SELECT 1", TRACK, true)
            .unwrap()
            .unwrap();
        assert_eq!((v.dirt, v.unproven), (checked(), true));
        // A settings read-back that finds them harmless again trusts texts again.
        core.settings_read(&crate::protocol::params::Shared::default());
        assert_eq!(verdict(&mut core, "SELECT 1", TRACK, true).unwrap(), None);
    }

    #[test]
    fn set_config_of_a_reading_setting_is_doubted_a_plain_one_read_back() {
        let mut core = session(PoolMode::Transaction, true);
        let sql = "SELECT set_config('search_path', 'evil', false)";
        let v = verdict(&mut core, sql, TRACK, true).unwrap().unwrap();
        assert!(v.dirt.verify && v.unproven);
        let sql = "SELECT set_config('app.tenant', '5', false)";
        let v = verdict(&mut core, sql, TRACK, true).unwrap().unwrap();
        assert!(!v.dirt.verify && !v.unproven, "{v:?}");
        assert_eq!(core.custom_gucs(), ["app.tenant"]);
    }

    #[test]
    fn custom_settings_past_the_limit_are_checked_without_blaming_the_statement() {
        let mut core = session(PoolMode::Transaction, true);
        for i in 0..MAX_CUSTOM_GUCS {
            let v = verdict(&mut core, &format!("SET app.k{i} = 1"), TRACK, true)
                .unwrap()
                .unwrap();
            assert!(!v.dirt.verify, "setting {i} is within the limit");
        }
        let v = verdict(&mut core, "SET app.one_more = 1", TRACK, true)
            .unwrap()
            .unwrap();
        assert_eq!((v.dirt, v.unproven), (checked(), false));
        assert_eq!(core.custom_gucs().len(), MAX_CUSTOM_GUCS);
    }

    #[test]
    fn an_untrackable_effect_pins_once_or_is_refused() {
        let mut core = session(PoolMode::Transaction, true);
        let v = verdict(&mut core, "LISTEN jobs", TRACK, true)
            .unwrap()
            .unwrap();
        assert!(v.pinned_now && v.dirt.listen);
        let v = verdict(&mut core, "LISTEN more", TRACK, true)
            .unwrap()
            .unwrap();
        assert!(!v.pinned_now, "the pool counts a pinned client once");
        assert!(core.pinned());

        let mut core = session(PoolMode::Transaction, true);
        let reject = Rules {
            session_state: SessionStateMode::Reject,
            ..TRACK
        };
        let e = verdict(&mut core, "LISTEN jobs", reject, true).unwrap_err();
        assert_eq!(e.code, "0A000");
        assert!(!core.pinned());
    }

    #[test]
    fn session_mode_keeps_only_the_statement_cache() {
        let mut core = session(PoolMode::Session, false);
        let v = verdict(&mut core, "SET work_mem = '1MB'", TRACK, false)
            .unwrap()
            .unwrap();
        assert_eq!(v, Verdict::default());
        let v = verdict(&mut core, "DEALLOCATE ALL", TRACK, false)
            .unwrap()
            .unwrap();
        assert!(v.forget_prepared && !v.dirt.any());
        // Untrusted reading and an unknown catalog doubt nothing: the client owns the backend.
        assert_eq!(
            verdict(&mut core, "SELECT * FROM accounts", TRACK, false).unwrap(),
            None
        );
        assert!(!core.capture_needed() && !core.pinned());
    }

    #[test]
    fn a_client_that_leaves_mid_way_leaves_a_session_nobody_knows() {
        let core = session(PoolMode::Transaction, true);
        assert!(
            !core.left_unknown(false),
            "between transactions, all read back"
        );
        assert!(core.left_unknown(true), "its budgets not yet put back");
        let mut core = session(PoolMode::Transaction, true);
        core.capture_after(true);
        assert!(core.left_unknown(false), "settings not yet read back");
        core.read_back("SELECT 1");
        // (Owed, so also caught by the replies-owed term.)
        assert!(core.left_unknown(false), "the read-back unanswered");
        let mut core = session(PoolMode::Transaction, true);
        core.send_query(crate::session::tracker::Mode::Forward, "SELECT 1");
        assert!(core.left_unknown(false), "a reply still owed");
    }

    #[test]
    fn a_catalog_change_marks_the_backend_and_the_snapshot() {
        let mut core = session(PoolMode::Transaction, true);
        let v = verdict(&mut core, "CREATE VIEW v AS SELECT 1", TRACK, true)
            .unwrap()
            .unwrap();
        assert!(v.catalog_changed && v.dirt.catalog, "{v:?}");
    }
}
