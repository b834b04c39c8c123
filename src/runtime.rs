//! The runtime snapshot: everything a reload replaces, as one value behind one `ArcSwap`
//! ([`crate::app::App::runtime`]), swapped once per reload.
//!
//! A caller id is an index into tables built from one configuration: the matcher that hands
//! it out, the policy's limits and live state, the per-caller metric series, and the
//! per-caller timeouts and routes of the config itself. Swapped one after another, a session
//! that resolved its caller between two swaps could be admitted under another caller's
//! limits or counted in another caller's series. A session loads one `Runtime` and takes
//! all four from it, so a reload is seen whole or not at all.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::auth::Credentials;
use crate::classify::CallerMatcher;
use crate::config::Config;
use crate::observe::metrics::CallerMetrics;
use crate::policy::CallerTable;

pub struct Runtime {
    pub config: Arc<Config>,
    pub creds: Arc<Credentials>,
    /// Who is calling: config callers in order, `default` last.
    pub callers: CallerMatcher,
    /// The callers' limits and live state, by the matcher's ids.
    pub limits: CallerTable,
    /// The callers' metric series, by the matcher's ids.
    pub caller_metrics: CallerMetrics,
    /// Where pools connect without a `databases` entry (`backend.url`, else host and port),
    /// parsed once per configuration rather than at every login.
    pub endpoint: Arc<crate::pool::Endpoint>,
    /// Which snapshot this is, unique for the process's life ([`next_generation`]): a pool
    /// remembers the one its route was last set under, so a login under the same snapshot
    /// need not compute the route again ([`crate::pool::Pool::routed_under`]).
    pub generation: u64,
}

/// A new snapshot's generation: 1, 2, … (0 stands for none).
pub fn next_generation() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
