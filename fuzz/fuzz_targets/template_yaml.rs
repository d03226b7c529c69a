//! Template definitions (YAML), as an operator's templates folder holds them.
//!
//! Invariant: parsing any text never panics; a definition that parses and passes its
//! checks serializes back to YAML that parses to the same definition (round trip).
#![no_main]

use kiln_native::template::Definition;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Definitions are read bounded (64 KiB): longer inputs are not what kiln parses.
    if data.len() > 64 << 10 {
        return;
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(definition) = Definition::parse(text, "fuzz") {
        let again = serde_yaml_ng::to_string(&definition).expect("a definition serializes");
        let back = Definition::parse(&again, "fuzz").expect("and parses back");
        assert_eq!(back, definition);
    }
});
