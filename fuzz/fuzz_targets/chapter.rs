//! The chapter loader and validator on arbitrary text: it may refuse a
//! chapter, never crash on one. Run with `scripts/fuzz.sh`.
#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use workbook::chapter::parse;
use workbook::Registry;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Registry::builtin)
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(e) = parse(Path::new("fuzzed.toml"), text, registry()) {
        // Every refusal says something.
        let message = e.to_string();
        assert!(!message.is_empty());
    }
});
