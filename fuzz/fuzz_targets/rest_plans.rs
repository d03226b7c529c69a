//! What `kiln rest` reads from a request and from its plan cache before any plan runs
//! (`kiln_rest::plans`, `kiln_rest::python`). The first byte picks what the rest is:
//!
//! - 0: a request's path, split and percent-decoded into segments (`plans::segments`);
//! - 1: a plan's pattern (`METHOD /literal/{param}`, written by a planner, read back from
//!   the cache file), matched against requests made from it (`Pattern::parse`, `matches`);
//! - 2: a tenant's plan cache file as stored (`<data>/plans/<tenant>.json`);
//! - 3: text that becomes a Python string literal in a driver turn (`python::literal`: the
//!   request's context and the plan's code are written into Python source this way), and the
//!   driver's answer read from a turn's output (`python::answer`).
//!
//! Invariant: nothing panics. Segments are never empty, `.` or `..` and hold no `/`, NUL or
//! control character; encoded again they split back to themselves. A pattern that parses has
//! an upper-case method and literals without `/`, `{`, `}`, white space or control
//! characters, each a segment some request has; it matches the request made of
//! its own literals and of any unreserved values for its parameters, and no request of
//! another method or length; written out again it parses to itself. A cache file that reads
//! writes back to one that reads the same. A Python literal decodes, by Python's rules for
//! the escapes it may use, to exactly the text it was made from, and holds no line break
//! and no unescaped quote: request bytes can never end the literal and become code.
#![no_main]

use kiln_rest::plans::{Pattern, RESERVED_SEGMENTS, TenantPlans, segments};
use kiln_rest::python::{MARK, answer, literal};
use libfuzzer_sys::fuzz_target;
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};

/// What a path segment must have encoded to come back as one segment.
const SEGMENT: &AsciiSet = &CONTROLS.add(b'/').add(b'%').add(b' ').add(b'?').add(b'#');

/// A Python double-quoted string literal read by Python's rules, for the escapes a JSON
/// string uses; anything else (a raw line break, an unescaped quote, another escape, text
/// after the closing quote) is `None`.
fn python_string(source: &str) -> Option<String> {
    let inner = source.strip_prefix('"')?.strip_suffix('"')?;
    let mut out = String::new();
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' | '\n' | '\r' => return None,
            '\\' => match chars.next()? {
                '"' => out.push('"'),
                '\\' => out.push('\\'),
                '/' => out.push('/'),
                'b' => out.push('\u{8}'),
                'f' => out.push('\u{c}'),
                'n' => out.push('\n'),
                'r' => out.push('\r'),
                't' => out.push('\t'),
                'u' => {
                    let hex: String = chars.by_ref().take(4).collect();
                    let code = u32::from_str_radix(&hex, 16).ok()?;
                    // A surrogate would be a lone one in Python: JSON pairs are not
                    // Python's escapes. serde_json never writes one for valid text.
                    out.push(char::from_u32(code)?);
                }
                _ => return None,
            },
            c => out.push(c),
        }
    }
    Some(out)
}

fn check_segments(path: &str) {
    let Ok(parts) = segments(path) else { return };
    assert!(parts.len() <= 32);
    for part in &parts {
        assert!(!part.is_empty() && part != "." && part != "..", "{part:?}");
        assert!(!part.contains(['/', '\0']) && !part.chars().any(char::is_control));
    }
    let again: String = parts
        .iter()
        .map(|p| format!("/{}", utf8_percent_encode(p, SEGMENT)))
        .collect();
    if again.len() <= 2048 {
        assert_eq!(segments(&again).unwrap(), parts, "{again:?}");
    }
}

fn check_pattern(text: &str) {
    let Some(pattern) = Pattern::parse(text) else {
        return;
    };
    assert!(!pattern.method.is_empty());
    assert!(pattern.method.bytes().all(|b| b.is_ascii_uppercase()));
    for literal in pattern.segments.iter().flatten() {
        assert!(
            !literal.is_empty() && !literal.contains(['/', '{', '}']),
            "{literal:?}"
        );
        // Every literal is a segment some request has.
        let path = format!("/{}", utf8_percent_encode(literal, SEGMENT));
        assert_eq!(
            segments(&path).ok(),
            Some(vec![literal.clone()]),
            "{path:?}"
        );
    }
    let written = format!(
        "{} /{}",
        pattern.method,
        pattern
            .segments
            .iter()
            .map(|s| s.clone().unwrap_or_else(|| "{p}".into()))
            .collect::<Vec<_>>()
            .join("/")
    );
    if written.len() <= 512 + pattern.method.len() + 1 {
        assert_eq!(
            Pattern::parse(&written).as_ref(),
            Some(&pattern),
            "{written:?}"
        );
    }
    // Requests made of the pattern: each parameter an unreserved value, or a reserved one.
    let request = |param: &str| -> Vec<String> {
        pattern
            .segments
            .iter()
            .map(|s| s.clone().unwrap_or_else(|| param.to_string()))
            .collect()
    };
    assert!(pattern.matches(&pattern.method, &request("42")));
    let params = pattern.segments.iter().filter(|s| s.is_none()).count();
    for reserved in RESERVED_SEGMENTS {
        assert_eq!(
            pattern.matches(&pattern.method, &request(reserved)),
            params == 0
        );
    }
    assert!(!pattern.matches(&format!("{}X", pattern.method), &request("42")));
    let mut longer = request("42");
    longer.push("more".into());
    assert!(!pattern.matches(&pattern.method, &longer));
}

fn check_cache_file(bytes: &[u8]) {
    let Ok(plans) = serde_json::from_slice::<TenantPlans>(bytes) else {
        return;
    };
    let rate = plans.hit_rate();
    assert!((0.0..=1.0).contains(&rate), "{rate}");
    let written = serde_json::to_vec(&plans).unwrap();
    let again: TenantPlans = serde_json::from_slice(&written).unwrap();
    assert_eq!(serde_json::to_vec(&again).unwrap(), written);
    for entry in &again.entries {
        check_pattern(&entry.pattern);
    }
}

fn check_literal(text: &str) {
    let source = literal(text);
    assert_eq!(python_string(&source).as_deref(), Some(text), "{source:?}");
    // The driver's answer: the last line that starts with the mark, read as JSON.
    let stdout = format!("{text}\n{MARK}{source}\n");
    assert_eq!(
        answer(&stdout),
        Some(serde_json::Value::String(text.into()))
    );
    let _ = answer(text);
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 4 == 2 {
        return check_cache_file(rest);
    }
    let text = String::from_utf8_lossy(rest);
    match mode % 4 {
        0 => check_segments(&text),
        1 => check_pattern(&text),
        _ => check_literal(&text),
    }
});
