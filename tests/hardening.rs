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
//!   backend, killed sessions, client gone mid-transaction; through `support::faults`.
//! * `partition` — D4: an established server connection partitioned mid-query.
//! * `overload` — E: connect storm (half TLS), file-descriptor exhaustion, slow readers,
//!   cancel storm.
//! * `lifecycle` — G: SIGTERM drain, second SIGTERM, SIGHUP reload (TLS files too).
//! * `peers` — G3: several instances: a cancel routed to the instance that owns the key, and a
//!   rolling restart on one SO_REUSEPORT port under load.
//!
//! A9/A10 (pipelines) are covered in tests/foundation.rs and tests/pooling_state.rs.

mod support;

#[path = "hardening/faults.rs"]
mod faults;
#[path = "hardening/isolation.rs"]
mod isolation;
#[path = "hardening/lifecycle.rs"]
mod lifecycle;
#[path = "hardening/overload.rs"]
mod overload;
#[path = "hardening/partition.rs"]
mod partition;
#[path = "hardening/peers.rs"]
mod peers;
#[path = "hardening/protocol.rs"]
mod protocol;
#[path = "hardening/raw.rs"]
mod raw;
#[path = "hardening/tls.rs"]
mod tls;
