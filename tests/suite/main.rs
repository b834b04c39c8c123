//! The end-to-end suite: one test binary, a module per feature, against real PostgreSQL
//! clusters the harness starts (`support`). Run one feature with
//! `scripts/test --test suite FEATURE::` (e.g. `hostile::`, `storm_controls::`).

mod support;

mod admin;
mod classify_settings;
mod cli;
mod drivers;
mod fleet;
mod foundation;
mod hardening;
mod harness;
mod hostile;
mod min_idle;
mod policy;
mod pool_settings;
mod pooling_state;
mod rules_feedback;
mod seeds;
mod session_mode;
mod storm_controls;
