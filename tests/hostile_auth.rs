//! Hostile-client tests of authentication and secrets (issue 15, "fail closed"), end to end
//! against a real PostgreSQL started by the harness:
//!
//! * `auth` — the SCRAM server-first message does not tell which users exist (per-name mock
//!   salts); the backend password can come from a file instead of the command line, and
//!   startup errors name where a password came from, never the password; a password changed
//!   on reload reaches the pools that already exist.

mod support;

#[path = "hostile/auth.rs"]
mod auth;
#[allow(dead_code)]
#[path = "hardening/raw.rs"]
mod raw;
