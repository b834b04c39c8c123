//! When a client's backend may go back to the pool: the relay's fail-closed rule, as a
//! function of what the relay knows, without I/O.
//!
//! A backend is lent to the next client only when nothing of this client's work can reach
//! it: no reply owed, no byte of the backend's still unread, nothing unsent, no extended
//! batch half-dropped after a refusal, no transaction or COPY open — and, when the client
//! changed session settings, only after they were read back (so the next client's start
//! puts them right). In session mode, or once session state the proxy cannot track pinned
//! the client, the backend stays with it until it leaves.

/// What the relay knows after handling a read.
#[derive(Debug, Clone, Copy, Default)]
pub(in crate::session) struct Quiet {
    /// The tracker owes nothing and the backend is idle outside a transaction and COPY.
    pub idle: bool,
    /// Every byte the backend sent was handled (none of a message still to stream).
    pub replies_done: bool,
    /// Nothing waits to be written to the backend.
    pub nothing_unsent: bool,
    /// Client messages are being dropped until the Sync of a refused batch.
    pub skipping: bool,
    /// A backend is attached.
    pub attached: bool,
    /// Transaction pooling (not session mode) and the client is not pinned.
    pub pooled: bool,
    /// The client changed session settings the proxy must read back first.
    pub capture_needed: bool,
}

/// What to do with the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::session) enum Decision {
    /// Work is under way: nothing.
    Busy,
    /// Between transactions without a backend: the unit of work is over.
    EndUnit,
    /// Read the session settings back first (the backend stays).
    ReadBack,
    /// The unit is over; the backend stays with this client (session mode, pinned).
    Keep,
    /// The unit is over; the backend goes back to the pool.
    Release,
}

pub(in crate::session) fn decide(q: Quiet) -> Decision {
    if !(q.idle && q.replies_done && q.nothing_unsent && !q.skipping) {
        return Decision::Busy;
    }
    if !q.attached {
        return Decision::EndUnit;
    }
    match (q.pooled, q.capture_needed) {
        (true, true) => Decision::ReadBack,
        (true, false) => Decision::Release,
        (false, _) => Decision::Keep,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quiet() -> Quiet {
        Quiet {
            idle: true,
            replies_done: true,
            nothing_unsent: true,
            skipping: false,
            attached: true,
            pooled: true,
            capture_needed: false,
        }
    }

    #[test]
    fn an_idle_backend_with_nothing_owed_goes_back() {
        assert_eq!(decide(quiet()), Decision::Release);
    }

    #[test]
    fn any_unfinished_work_keeps_it_busy() {
        let cases = [
            Quiet {
                idle: false, // reply owed, transaction or COPY open
                ..quiet()
            },
            Quiet {
                replies_done: false, // half a row still to stream
                ..quiet()
            },
            Quiet {
                nothing_unsent: false,
                ..quiet()
            },
            Quiet {
                skipping: true, // a refused batch's Sync not yet seen
                ..quiet()
            },
        ];
        for q in cases {
            assert_eq!(decide(q), Decision::Busy, "{q:?}");
            assert_eq!(decide(Quiet { pooled: false, ..q }), Decision::Busy);
        }
    }

    #[test]
    fn changed_settings_are_read_back_before_the_backend_goes() {
        let q = Quiet {
            capture_needed: true,
            ..quiet()
        };
        assert_eq!(decide(q), Decision::ReadBack);
    }

    #[test]
    fn session_mode_and_pinned_clients_keep_their_backend() {
        for capture_needed in [false, true] {
            let q = Quiet {
                pooled: false,
                capture_needed,
                ..quiet()
            };
            assert_eq!(decide(q), Decision::Keep);
        }
    }

    #[test]
    fn without_a_backend_the_unit_just_ends() {
        let q = Quiet {
            attached: false,
            capture_needed: true,
            ..quiet()
        };
        assert_eq!(decide(q), Decision::EndUnit);
    }
}
