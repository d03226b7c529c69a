//! Workspace-relative paths (`kiln_workspace::RelPath`), the first check every file API
//! path meets.
//!
//! Invariant: parsing never panics; a path that parses is relative, has no empty, `.` or
//! `..` part and no NUL, is within the length limits, and its parts join back to it.
#![no_main]

use kiln_workspace::RelPath;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(path) = RelPath::parse(text) {
        let s = path.as_str();
        assert!(!s.is_empty() && s.len() <= 4096);
        assert!(!s.starts_with('/') && !s.contains('\0'));
        let parts: Vec<&str> = path.parts().collect();
        for part in &parts {
            assert!(!part.is_empty() && *part != "." && *part != ".." && part.len() <= 255);
        }
        assert_eq!(parts.join("/"), s);
        if let Some((parent, last)) = path.split_last() {
            assert_eq!(parts.last().copied(), Some(last));
            if !parent.is_root() {
                assert_eq!(format!("{}/{last}", parent.as_str()), s);
            }
        }
    }
});
