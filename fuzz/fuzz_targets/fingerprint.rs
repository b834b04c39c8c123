//! The statement classifier (fingerprint, kind, effects, tags) on arbitrary text: no panic,
//! no stack overflow, and the same text always gives the same fingerprint.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let sql = String::from_utf8_lossy(data);
    let a = pgsluice::classify::analyze(&sql, 64 * 1024);
    let b = pgsluice::classify::analyze(&sql, 64 * 1024);
    assert_eq!(a.fingerprint, b.fingerprint);
    // The cheap scanner path (texts over the limit) must hold up too.
    let _ = pgsluice::classify::analyze(&sql, 16);
});
