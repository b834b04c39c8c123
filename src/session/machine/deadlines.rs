//! The session's deadlines: the proxy's backstop for a running statement, the grace a
//! cancelled server has to answer anything, the moment a session found idle at shutdown is
//! given, and the idle-in-transaction and idle-client limits. Pure: instants in, which one is
//! due out; the driver keeps the one timer that sleeps until [`Deadlines::next`], and each
//! event clears or moves the deadline it served.

use std::time::Duration;

use std::time::Instant;

/// Which deadline passed (in the order they win when two fall on the same instant).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::session) enum Deadline {
    /// The server answered nothing, not even the cancel, within the grace period.
    Unanswered,
    /// The proxy's own deadline for a statement passed: cancel it on the server.
    Backstop,
    /// The moment after shutdown given to a client between transactions is over.
    IdleGrace,
    /// The client stayed idle inside a transaction past its caller's limit.
    IdleTransaction,
    /// The client stayed idle between transactions past `limits.client_idle_timeout_ms`.
    IdleClient,
}

/// Where the client stands when the session next waits for an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::session) enum Idle {
    /// Something is in flight or unsent: the client is not the one who owes a move.
    No,
    /// The client owes the next move inside an open transaction.
    InTransaction,
    /// The client owes the next move between transactions.
    Between,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(in crate::session) struct Deadlines {
    backstop: Option<Instant>,
    unanswered: Option<Instant>,
    idle_grace: Option<Instant>,
    idle_txn: Option<Instant>,
    idle_client: Option<Instant>,
}

impl Deadlines {
    /// The earliest deadline armed.
    #[inline(always)]
    pub(in crate::session) fn next(&self) -> Option<Instant> {
        [
            self.unanswered,
            self.backstop,
            self.idle_grace,
            self.idle_txn,
            self.idle_client,
        ]
        .into_iter()
        // A fold, not `flatten().min()`: this runs twice per transaction, and the iterator
        // adapters did not melt away.
        .fold(None, |m: Option<Instant>, d| match (m, d) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        })
    }

    /// Which deadline `at` (a value [`Deadlines::next`] returned) is.
    pub(in crate::session) fn due(&self, at: Instant) -> Deadline {
        if self.unanswered == Some(at) {
            Deadline::Unanswered
        } else if self.backstop == Some(at) {
            Deadline::Backstop
        } else if self.idle_grace == Some(at) {
            Deadline::IdleGrace
        } else if self.idle_txn == Some(at) {
            Deadline::IdleTransaction
        } else {
            Deadline::IdleClient
        }
    }

    /// Clears one deadline (the event that served it, or what made it moot).
    pub(in crate::session) fn clear(&mut self, d: Deadline) {
        *self.slot(d) = None;
    }

    fn slot(&mut self, d: Deadline) -> &mut Option<Instant> {
        match d {
            Deadline::Unanswered => &mut self.unanswered,
            Deadline::Backstop => &mut self.backstop,
            Deadline::IdleGrace => &mut self.idle_grace,
            Deadline::IdleTransaction => &mut self.idle_txn,
            Deadline::IdleClient => &mut self.idle_client,
        }
    }

    /// The client sent something: it is no longer idle.
    #[inline(always)]
    pub(in crate::session) fn client_spoke(&mut self) {
        self.idle_txn = None;
        self.idle_client = None;
    }

    /// The server sent something: whatever a cancel does, it will be answered.
    #[inline(always)]
    pub(in crate::session) fn server_spoke(&mut self) {
        self.unanswered = None;
    }

    /// The proxy's deadline for a statement: the later of the one armed and `at` (a
    /// statement of the same unit never brings an earlier one's forward).
    pub(in crate::session) fn arm_backstop(&mut self, at: Instant) {
        self.backstop = Some(self.backstop.map_or(at, |b| b.max(at)));
    }

    /// The statements the backstop was armed for are answered. Left armed, it would cancel
    /// whatever the client runs next in the same transaction.
    #[inline(always)]
    pub(in crate::session) fn answered(&mut self) {
        self.backstop = None;
    }

    /// The backstop fired and sent a cancel: the server has until `at` to answer anything.
    pub(in crate::session) fn cancel_sent(&mut self, at: Instant) {
        self.backstop = None;
        self.unanswered = Some(at);
    }

    /// The unit is over: nothing of its statements is owed any more.
    pub(in crate::session) fn unit_over(&mut self) {
        self.backstop = None;
        self.unanswered = None;
    }

    /// Shutdown found the session between transactions: it leaves at `at` unless the client
    /// starts something first.
    pub(in crate::session) fn drain_at(&mut self, at: Instant) {
        self.idle_grace = Some(at);
    }

    /// Arms the idle limit that applies to where the client stands, once per idle period
    /// (each limit is looked up only when its deadline is armed), and disarms the other.
    #[inline(always)]
    pub(in crate::session) fn arm_idle(
        &mut self,
        idle: Idle,
        now: impl FnOnce() -> Instant,
        client_limit: impl FnOnce() -> Option<Duration>,
        txn_limit: impl FnOnce() -> Option<Duration>,
    ) {
        match idle {
            Idle::No => {
                self.idle_client = None;
                self.idle_txn = None;
            }
            Idle::Between => {
                self.idle_txn = None;
                if self.idle_client.is_none()
                    && let Some(limit) = client_limit()
                {
                    self.idle_client = Some(now() + limit);
                }
            }
            Idle::InTransaction => {
                self.idle_client = None;
                if self.idle_txn.is_none()
                    && let Some(limit) = txn_limit()
                {
                    self.idle_txn = Some(now() + limit);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn nothing_armed_nothing_next() {
        assert_eq!(Deadlines::default().next(), None);
    }

    #[test]
    fn the_earliest_is_next_and_named() {
        let t0 = Instant::now();
        let mut d = Deadlines::default();
        d.arm_backstop(t0 + ms(300));
        d.drain_at(t0 + ms(100));
        d.arm_idle(Idle::Between, || t0, || Some(ms(200)), || None);
        assert_eq!(d.next(), Some(t0 + ms(100)));
        assert_eq!(d.due(t0 + ms(100)), Deadline::IdleGrace);
        d.clear(Deadline::IdleGrace);
        assert_eq!(d.due(d.next().unwrap()), Deadline::IdleClient);
        d.client_spoke();
        assert_eq!(d.due(d.next().unwrap()), Deadline::Backstop);
    }

    #[test]
    fn ties_go_to_the_unanswered_cancel_first() {
        let t0 = Instant::now();
        let mut d = Deadlines::default();
        d.arm_idle(Idle::InTransaction, || t0, || None, || Some(ms(50)));
        d.cancel_sent(t0 + ms(50));
        assert_eq!(d.due(t0 + ms(50)), Deadline::Unanswered);
    }

    #[test]
    fn a_backstop_only_moves_later() {
        let t0 = Instant::now();
        let mut d = Deadlines::default();
        d.arm_backstop(t0 + ms(500));
        d.arm_backstop(t0 + ms(200));
        assert_eq!(d.next(), Some(t0 + ms(500)));
        d.arm_backstop(t0 + ms(900));
        assert_eq!(d.next(), Some(t0 + ms(900)));
        d.answered();
        assert_eq!(d.next(), None);
    }

    #[test]
    fn a_fired_backstop_becomes_the_unanswered_grace_and_the_unit_clears_both() {
        let t0 = Instant::now();
        let mut d = Deadlines::default();
        d.arm_backstop(t0 + ms(100));
        d.cancel_sent(t0 + ms(150));
        assert_eq!(d.next(), Some(t0 + ms(150)));
        d.server_spoke();
        assert_eq!(d.next(), None);
        d.arm_backstop(t0 + ms(100));
        d.cancel_sent(t0 + ms(150));
        d.unit_over();
        assert_eq!(d.next(), None);
    }

    #[test]
    fn idle_limits_arm_once_per_idle_period_and_only_where_the_client_stands() {
        let t0 = Instant::now();
        let mut d = Deadlines::default();
        let mut looked_up = 0;
        for _ in 0..3 {
            d.arm_idle(
                Idle::InTransaction,
                || t0,
                || panic!("the client limit is not looked up inside a transaction"),
                || {
                    looked_up += 1;
                    Some(ms(10))
                },
            );
        }
        assert_eq!(looked_up, 1, "armed once per idle period");
        assert_eq!(d.due(d.next().unwrap()), Deadline::IdleTransaction);
        // Between transactions: the transaction limit goes, the client's comes.
        d.arm_idle(Idle::Between, || t0 + ms(5), || Some(ms(100)), || None);
        assert_eq!(d.next(), Some(t0 + ms(105)));
        assert_eq!(d.due(t0 + ms(105)), Deadline::IdleClient);
        // Busy: neither.
        d.arm_idle(Idle::No, || t0, || Some(ms(1)), || Some(ms(1)));
        assert_eq!(d.next(), None);
        // No limit configured: nothing armed.
        d.arm_idle(Idle::Between, || t0, || None, || None);
        assert_eq!(d.next(), None);
    }
}
