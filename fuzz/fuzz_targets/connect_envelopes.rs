//! What an E2B client sends the facade's Connect endpoints (envd's process and filesystem
//! services): a body of envelopes (`kiln_http::connect`), each a JSON message read into a
//! request shaped like envd's (proto3 JSON: `int64` as a string or a number, `bytes` as
//! base64), through kiln's object-only reader.
//!
//! Invariant: nothing panics; a declared length over 16 MiB is refused before anything is
//! held; envelopes split a body into its own bytes, in order, and each framed again is the
//! bytes it came from; a message read into the request writes back to JSON that reads as
//! the same request.
#![no_main]

use kiln_http::connect::{self, EnvelopeError, MAX_MESSAGE_BYTES};
use libfuzzer_sys::fuzz_target;
use serde::{Deserialize, Serialize};

#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Request {
    #[serde(default)]
    process: Option<Process>,
    #[serde(default, with = "connect::int64")]
    pid: u64,
    #[serde(default)]
    input: Option<Input>,
    #[serde(default)]
    tag: Option<String>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Process {
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    cwd: Option<String>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Input {
    #[serde(with = "connect::b64")]
    stdin: Vec<u8>,
}

fuzz_target!(|data: &[u8]| {
    let mut body = data;
    let mut consumed = 0;
    loop {
        match connect::split_envelope(body) {
            Ok(None) => {
                assert_eq!(consumed, data.len(), "a body split short of its end");
                break;
            }
            Ok(Some(envelope)) => {
                assert!(envelope.message.len() <= MAX_MESSAGE_BYTES);
                let length = 5 + envelope.message.len();
                let framed = connect::frame(envelope.flags, envelope.message);
                assert_eq!(&framed[..], &body[..length], "framed again, not the same bytes");
                assert_eq!(envelope.rest, &body[length..]);
                consumed += length;
                body = envelope.rest;
                if let Ok(request) = kiln_http::objects::from_slice::<Request>(envelope.message) {
                    let written = serde_json::to_vec(&request).expect("a request writes");
                    let again: Request = kiln_http::objects::from_slice(&written)
                        .expect("what a request writes reads back");
                    assert_eq!(again, request);
                }
            }
            Err(EnvelopeError::TooLarge(len)) => {
                assert!(len > MAX_MESSAGE_BYTES);
                break;
            }
            Err(EnvelopeError::Truncated) => {
                assert!(
                    body.len() < 5 || body.len() - 5 < u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize
                );
                break;
            }
        }
    }
});
