//! The current unit — the span during which the client holds a backend (one transaction in
//! transaction mode, one request batch in session mode) — as admission left it: the caller's
//! permit and the rule slots held until it ends, the caller it runs as, what its first Parse
//! already admitted, and what it asked of the server session (a WITH HOLD cursor, budgets to
//! put back, a shared read it leads). [`Unit::end`] is the one place that lets go of all of it.

use crate::coalesce::Lead;
use crate::policy::limiter::CallerPermit;
use crate::policy::rules::CoalesceRule;
use crate::policy::{Admission, StatementAdmission};

use super::admission::Timeouts;

#[derive(Default)]
pub(super) struct Unit {
    /// Admission of the unit (caller permit held while the backend is).
    pub admission: Option<Admission>,
    /// A pinned client's caller permit from its last unit, held between its units: the
    /// backend it keeps counts against its caller's `max_concurrency` while it idles (given
    /// up when its next unit is admitted, which takes a permit of its own).
    pub pinned_hold: Option<CallerPermit>,
    /// Rule admissions of later statements in the unit (CONCURRENCY slots).
    pub stmt_admissions: Vec<StatementAdmission>,
    /// The caller the unit was admitted as.
    pub caller: u16,
    /// A login let through the door is counted as coming until its first statement meets
    /// admission (`App::door`).
    pub door: Option<crate::app::DoorPass>,
    /// The caller of a statement without comment tags, resolved under the session's runtime
    /// snapshot and current settings (`application_name`); cleared when either changes.
    pub session_caller: Option<u16>,
    /// Caller of the statement admitted last (statistics attribution).
    pub last_caller: u16,
    /// The batch was admitted at its first Parse: (fingerprint, timeouts) for its Bind.
    pub opened_by_parse: Option<(u64, Timeouts)>,
    /// A ROUTE rule's word on the statement being admitted (`Some(true)`: replicas).
    pub rule_route: Option<bool>,
    /// A COALESCE rule's bounds for the statement being admitted.
    pub rule_coalesce: Option<CoalesceRule>,
    /// The unit runs a read others with the same read wait for: its result is recorded.
    pub lead: Option<Lead>,
    /// When the client's last unit ended: a shared read that started before then may not
    /// have seen what that unit did.
    pub ended_at: Option<tokio::time::Instant>,
    /// The unit declared a WITH HOLD cursor: its COMMIT runs the cursor's query (to
    /// materialize it), so it runs under the proxy's deadline like any statement.
    pub hold_cursor: bool,
    /// Session-level budgets were set around the current request (`inject_timeouts`): the
    /// statement that puts the client's settings back, sent after the request.
    pub restore_after: Option<String>,
}

impl Unit {
    /// Whether a unit is open (its first statement admitted).
    #[inline(always)]
    pub fn is_open(&self) -> bool {
        self.admission.is_some()
    }

    /// The unit is over (backend idle): the caller's permit and the rule slots go back —
    /// except that a `pinned` client keeps its backend, and so the permit for it.
    pub fn end(&mut self, pinned: bool) {
        self.opened_by_parse = None;
        if let Some(a) = self.admission.take()
            && pinned
        {
            self.pinned_hold = Some(a.into_caller_permit());
        }
        self.stmt_admissions.clear();
        self.hold_cursor = false;
        // A run not finished by now never will be: its followers join again.
        self.lead = None;
    }
}
