//! Observability: per-fingerprint statistics (the proxy's own pg_stat_statements), the
//! anomaly detector that reads them, Prometheus metrics, and the rate limits of the optional
//! connection and refusal log lines. Imports nothing else of ours.

pub mod anomaly;
pub mod arrival_series;
pub mod log_limit;
pub mod metrics;
pub mod pool_series;
pub mod stats;
