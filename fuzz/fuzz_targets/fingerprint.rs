//! The statement classifier (fingerprint, kind, effects, tags) on arbitrary text: no panic,
//! no stack overflow, the same text always gives the same fingerprint, and the shape cache
//! never hands one text another text's classification (a variant with other digits is
//! classified first, so texts that share its shape are answered from the cache).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pgsluice::classify::{Classifier, analyze};

fuzz_target!(|data: &[u8]| {
    let sql = String::from_utf8_lossy(data);
    let a = analyze(&sql, 64 * 1024);
    let b = analyze(&sql, 64 * 1024);
    assert_eq!(a.fingerprint, b.fingerprint);
    // The cheap scanner path (texts over the limit) must hold up too.
    let _ = analyze(&sql, 16);
    let variant: String = sql
        .chars()
        .map(|c| match c.to_digit(10) {
            Some(d) => char::from(b'0' + ((d + 7) % 10) as u8),
            None => c,
        })
        .collect();
    let cache = Classifier::new(16, 64 * 1024);
    let _ = cache.classify(&variant);
    assert_eq!(*cache.classify(&sql), a, "{sql:?} after {variant:?}");
});
