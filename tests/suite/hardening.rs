//! Hardening tests (issue 7): the cases of shared/TESTS.md sections A–E and G, end to end
//! against a real PostgreSQL started by the harness, each ending with the universal oracle
//! (process up, a fresh client can `SELECT 1`, pool counters back at rest).
//!
//! * `protocol` — A: malformed frames, startup bounds, auth order, SCRAM abuse, slowloris,
//!   COPY faults, pathological SQL.
//! * `tls` — B: TLS toward clients (SSLRequest, direct TLS with ALPN, require) and toward
//!   Postgres (prefer/require/verify-ca/verify-full, injected bytes), negotiation loops, the
//!   authentication matrix.
//! * `isolation` — C5–C7: cancel isolation, protocol 3.2 and grease, mid-stream disconnects.
//! * `faults` — D: backend restart, smart shutdown, unreachable (black hole, reset), slow
//!   backend, killed sessions, client gone mid-transaction; through `crate::support::faults`.
//! * `partition` — D4: an established server connection partitioned mid-query.
//! * `overload` — E: connect storm (half TLS), file-descriptor exhaustion, slow readers,
//!   cancel storm.
//! * `lifecycle` — G: SIGTERM drain, second SIGTERM, SIGHUP reload (TLS files too).
//! * `peers` — G3: several instances: a cancel routed to the instance that owns the key, and a
//!   rolling restart on one SO_REUSEPORT port under load.
//!
//! A9/A10 (pipelines) are covered in `foundation` and `pooling_state`.

mod faults;
mod isolation;
mod lifecycle;
mod overload;
mod partition;
mod peers;
mod protocol;
mod tls;
