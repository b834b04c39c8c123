//! The load and storm tool behind `pgsluice-storm`, in the order a run uses it:
//!
//! ```text
//! login      log in as a driver does (application_name, SCRAM/md5/cleartext/trust)
//! client     connect / run a statement; failures → refused | error; the retry policy
//!            (naive, full-jitter backoff honouring retry_after_ms)
//! scenarios  run context, the worker loop, steady / noisy-neighbour / idle, progress line
//! reconnect  the reconnect storm (calm → N clients in 500 ms flushing writes → after)
//! incident   issue 17's incident (payment + analytics, then N clients each logging in
//!            anew for one transaction, retrying the whole session)
//! step       issue 18's pattern step (steady patterns, then one steps 30x; polls
//!            pgsluice's /v1/anomalies for the time to detection and false positives)
//! fair       the fair-share scenario (short lookups next to long reports, one priority)
//! coalesce   identical reads all at once (with and without a COALESCE rule)
//! monitor    backend connections from pg_stat_activity on a direct connection
//! record     counters, histograms (hist) and the 100 ms time series
//! report     tables on stdout, summary file, CSV; chart: the SVG
//! ```

pub mod chart;
pub mod client;
pub mod coalesce;
pub mod fair;
pub mod hist;
pub mod incident;
pub mod login;
pub mod monitor;
pub mod reconnect;
pub mod record;
pub mod report;
pub mod scenarios;
pub mod step;
