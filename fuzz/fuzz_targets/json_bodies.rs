//! Request bodies as every face reads them (`kiln_http::json::from_json` and
//! `from_json_object`: `/api/v1`, the seed routes, workspaces, workflows, keys, the E2B
//! facade), into a body shaped like kiln's request types: nested optional structs that deny
//! unknown fields, lists of them, a tuple, enums of each serde shape, maps, and kiln-core's
//! own `networkRules` and `resources`.
//!
//! Invariant: reading never panics; a refusal is `MALFORMED_JSON` (never for well-formed JSON)
//! or `INVALID_REQUEST` (never for bytes that are not JSON); what kiln accepts, serde alone reads the same
//! (kiln's object-only reading never changes the meaning of a body); kiln refuses more than
//! serde only where the body has an array (a struct filled by position); `from_json_object`
//! accepts only a body that is an object.
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Body {
    language: Option<String>,
    #[serde(alias = "ms")]
    timeout_ms: Option<u64>,
    limits: Option<Limits>,
    mounts: Option<Vec<Mount>>,
    pair: Option<(u32, String)>,
    shape: Option<Shape>,
    event: Option<Event>,
    metadata: Option<BTreeMap<String, String>>,
    network_rules: Option<kiln_core::net::Egress>,
    resources: Option<kiln_core::template::ResourceRequest>,
    #[serde(default)]
    public: bool,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Limits {
    sandboxes: Option<u64>,
    cpu_weight: Option<u32>,
    ratio: Option<f64>,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Mount {
    volume: String,
    path: String,
    #[serde(default)]
    read_only: bool,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Shape {
    Plain,
    Wrapped(u32),
    Pair(u8, u8),
    Box { w: u32, h: Option<u32> },
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Event {
    Resize { cols: u16, rows: u16 },
    Close,
}

fuzz_target!(|data: &[u8]| {
    let ours = kiln_http::json::from_json::<Body>(data);
    let serde_alone = serde_json::from_slice::<Body>(data);
    // Well-formed JSON: a value (strings checked) parses; a skim (strings unchecked) does.
    let is_json = serde_json::from_slice::<serde_json::Value>(data).is_ok();
    let skims = serde_json::from_slice::<serde::de::IgnoredAny>(data).is_ok();
    match &ours {
        Ok(body) => {
            let alone = serde_alone.as_ref().expect("kiln accepted what serde refuses");
            assert_eq!(body, alone, "kiln read a body differently from serde");
        }
        Err(refused) => {
            match refused.code() {
                "MALFORMED_JSON" => assert!(!is_json, "JSON said malformed: {}", refused.message()),
                "INVALID_REQUEST" => assert!(skims, "not JSON said invalid: {}", refused.message()),
                other => panic!("refused with {other}: {}", refused.message()),
            }
            if serde_alone.is_ok() {
                assert!(data.contains(&b'['), "kiln refused more than serde with no array");
            }
        }
    }
    let object = kiln_http::json::from_json_object::<Body>(data);
    if object.is_ok() {
        let first = data.iter().find(|b| !b.is_ascii_whitespace());
        assert_eq!(first, Some(&b'{'), "a body that is not an object was accepted");
        assert!(ours.is_ok());
    }
});
