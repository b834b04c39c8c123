//! The startup-phase parser: length word, then StartupMessage / SSLRequest / GSSENCRequest /
//! CancelRequest bodies.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pgsluice::protocol::messages::{StartupPacket, parse_startup, startup_len};

fuzz_target!(|data: &[u8]| {
    if let Some(word) = data.get(..4)
        && let Ok(len) = startup_len([word[0], word[1], word[2], word[3]])
    {
        assert!((8..=10_000).contains(&len));
    }
    if let Ok(StartupPacket::Cancel { secret, .. }) = parse_startup(data) {
        assert!((4..=256).contains(&secret.len()));
    }
    if let Some(body) = data.get(4..) {
        let _ = parse_startup(body);
    }
});
