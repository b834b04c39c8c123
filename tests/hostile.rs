//! Hostile-client tests (issue 15, "fail closed"): whatever bytes an authenticated client
//! sends and whenever it leaves, the next client of the pool sees a clean session, every
//! statement the proxy forwards passed admission and carries its budget, and memory stays
//! bounded. Each test names the item it covers; pools of one backend make "the next client
//! gets the same backend" certain, not likely.
//!
//! * `session` — state left behind: a disconnect before the read-back, statements the
//!   classifier cannot prove harmless (quoted names, user functions, `DO`, FunctionCall, long
//!   texts), hostile values under `standard_conforming_strings = off`.
//! * `admission` — FunctionCall and unknown Binds are admitted; every statement kind runs
//!   with its budget, and statements that need their own transaction still work.
//! * `bounds` — pools per random database name, oversized messages, prepared statements per
//!   session.
//! * `peers` — per-address shares of handshake and cancel slots (item 12).
//! * `backend_auth` — which authentication methods the proxy answers toward Postgres (item 14).
//! * `sequences` — random sessions of whole messages and hang-ups, each followed by the
//!   isolation oracle (a fresh client on the same backend sees a clean session).

mod support;

#[path = "hostile/admission.rs"]
mod admission;
#[path = "hostile/backend_auth.rs"]
mod backend_auth;
#[path = "hostile/bounds.rs"]
mod bounds;
#[path = "hostile/common.rs"]
mod common;
#[path = "hostile/peers.rs"]
mod peers;
#[path = "hostile/sequences.rs"]
mod sequences;
#[path = "hostile/session.rs"]
mod session;
