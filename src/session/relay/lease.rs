//! The backends a session holds: the one attached now (its own pool's or, for a routed read,
//! a replica's), the one parked with it between transactions, and its place on the parking
//! list; whether its database has replicas and their pool.

use std::sync::Arc;

use crate::pool::park::Ticket;
use crate::pool::{BackendConn, Pool, Pooled};

#[derive(Default)]
pub(super) struct Lease {
    /// The backend attached now.
    pub backend: Option<Pooled>,
    /// Transaction mode: the backend kept while the client is idle between transactions
    /// and nobody waits for one ([`crate::pool::park`]). `backend` is `None` meanwhile, so
    /// the rest of the relay sees a client without one; the next statement's checkout takes
    /// this one back first, when the pool has not revoked it.
    pub parked: Option<Pooled>,
    /// This session's place on its pool's parking list (made when it first parks).
    pub ticket: Option<Arc<Ticket>>,
    /// A backend was released at least once: parking starts from the client's second
    /// transaction.
    pub released_before: bool,
    /// The database has replicas (`databases[].replicas`), read at login.
    pub replica_possible: bool,
    /// The pool of those replicas, made at the first read routed there.
    pub replica: Option<Arc<Pool>>,
    /// The pool the current unit borrows from when it is not the session's own (a replica).
    pub unit_pool: Option<Arc<Pool>>,
}

impl Lease {
    #[inline(always)]
    pub fn attached(&self) -> bool {
        self.backend.is_some()
    }

    /// A replica's backend is held for a routed read (until its ReadyForQuery releases it).
    #[inline(always)]
    pub fn replica_held(&self) -> bool {
        self.unit_pool.is_some() && self.backend.is_some()
    }

    /// The attached backend's connection. Callers run only after a backend was attached.
    #[inline(always)]
    pub fn conn(&mut self) -> &mut BackendConn {
        self.backend
            .as_mut()
            .expect("backend attached before statement handling")
            .conn()
    }
}
