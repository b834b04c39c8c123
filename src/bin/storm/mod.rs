//! The load and storm tool behind `pgsluice-storm`, in the order a run uses it:
//!
//! ```text
//! client     log in / run a statement with pgsluice's own client; failures → refused | error;
//!            the retry policy (naive, full-jitter backoff honouring retry_after_ms)
//! scenarios  run context, the worker loop, steady / noisy-neighbour / idle, progress line
//! reconnect  the reconnect storm (calm → N clients in 500 ms flushing writes → after)
//! monitor    backend connections from pg_stat_activity on a direct connection
//! record     counters, histograms (hist) and the 100 ms time series
//! report     tables on stdout, summary file, CSV; chart: the SVG
//! ```

pub mod chart;
pub mod client;
pub mod hist;
pub mod monitor;
pub mod reconnect;
pub mod record;
pub mod report;
pub mod scenarios;
