//! Frontend framing: header-only decoding with per-type limits, frame after frame.
#![no_main]

#[path = "framing_common.rs"]
mod framing_common;

use libfuzzer_sys::fuzz_target;
use pgsluice::protocol::framing::Direction;

fuzz_target!(|data: &[u8]| framing_common::walk(data, Direction::Frontend));
