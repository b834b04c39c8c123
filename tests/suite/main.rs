//! The end-to-end suite: one test binary, a module per feature, against real PostgreSQL
//! clusters the harness starts (`support`). Run one feature with
//! `scripts/test --test suite FEATURE::` (e.g. `session_state::`, `cancel::`).
//!
//! * Connecting and querying: `connections`, `auth`, `tls`, `queries`, `extended_protocol`,
//!   `copy`, `cancel`.
//! * Pooling: `pooling`, `session_mode`, `session_state`, `routing`, `notify` (LISTEN/NOTIFY
//!   in transaction mode).
//! * Traffic policy: `admission`, `timeouts`, `breaker`, `limits`, `overload`, `classify`,
//!   `rules`, `seeds`, `fleet`.
//! * Faults: `protocol_faults`, `backend_faults`, `disconnects`.
//! * Operating the proxy: `lifecycle`, `admin`, `console`, `cli`, `logging`.
//! * Real drivers: `drivers`; the harness itself: `harness`.

mod support;

mod admin;
mod admission;
mod auth;
mod backend_faults;
mod breaker;
mod cancel;
mod classify;
mod cli;
mod connections;
mod console;
mod copy;
mod disconnects;
mod drivers;
mod extended_protocol;
mod fleet;
mod harness;
mod lifecycle;
mod limits;
mod logging;
mod notify;
mod overload;
mod pooling;
mod protocol_faults;
mod queries;
mod routing;
mod rules;
mod seeds;
mod session_mode;
mod session_state;
mod timeouts;
mod tls;
