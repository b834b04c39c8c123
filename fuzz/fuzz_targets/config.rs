//! The YAML config parser and validator: errors, never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data)
        && let Err(errs) = pgsluice::config::Config::from_yaml(text)
    {
        assert!(!errs.is_empty());
        for e in errs {
            let _ = e.to_string();
        }
    }
});
