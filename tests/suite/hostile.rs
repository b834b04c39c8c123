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
//! * `auth` — the SCRAM server-first message does not tell which users exist (per-name mock
//!   salts); the backend password can come from a file instead of the command line, and
//!   startup errors name where a password came from, never the password; a password changed
//!   on reload reaches the pools that already exist.
//! * `sequences` — random sessions of whole messages and hang-ups, each followed by the
//!   isolation oracle (a fresh client on the same backend sees a clean session).

mod admission;
mod auth;
mod backend_auth;
mod bounds;
mod common;
mod peers;
mod sequences;
mod session;
