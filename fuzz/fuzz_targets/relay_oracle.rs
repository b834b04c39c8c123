//! The relay core's isolation oracle on arbitrary choices: each input describes pipelines
//! of client requests mixed with what the proxy injects and answers itself, run through the
//! outbox and the tracker against a simulated Postgres; the client must see exactly what a
//! direct session would show it.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    pgsluice::session::relay_oracle::check(data);
});
