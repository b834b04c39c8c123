//! Observability: per-fingerprint statistics (the proxy's own pg_stat_statements) and
//! Prometheus metrics. Imports nothing else of ours.

pub mod metrics;
pub mod stats;
