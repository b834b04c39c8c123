//! Observability: per-fingerprint statistics (the proxy's own pg_stat_statements), the
//! anomaly detector that reads them, and Prometheus metrics. Imports nothing else of ours.

pub mod anomaly;
pub mod metrics;
pub mod stats;
