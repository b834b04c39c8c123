//! Hostile-client tests of authentication and secrets (issue 15, "fail closed"), end to end
//! against a real PostgreSQL started by the harness:
//!
//! * `auth` — the SCRAM server-first message does not tell which users exist (per-name mock
//!   salts).

mod support;

#[path = "hostile/auth.rs"]
mod auth;
#[allow(dead_code)]
#[path = "hardening/raw.rs"]
mod raw;
