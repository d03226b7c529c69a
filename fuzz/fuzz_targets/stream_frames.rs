//! What a guest's output becomes on its way to a client (`kiln_http::stream`): its bytes,
//! cut anywhere, decoded by `Utf8Carry`, each piece sent as a Server-Sent Event (`sse`, as
//! `POST /api/v1/sandboxes/{id}/exec/stream` and the chat stream send them) and as a
//! WebSocket text message (`ws_text`, as the sandbox WebSocket sends them).
//!
//! The input: the first byte is the event name's length, then the name (kiln's names are
//! its own words, but the writer must not break on any), then the output as pieces, each a
//! length byte and that many bytes.
//!
//! Invariant: nothing panics; at most 3 bytes ever wait for the rest of a character; the
//! pieces' text, in order, is exactly `String::from_utf8_lossy` of all the output, whatever
//! the cuts; the SSE body, read by a strict SSE reader (lines end at CR LF, LF or CR), gives
//! back every event, in order, with its name (one with a line break is left out, never
//! written) and its JSON data; each WebSocket message is JSON with the text and the kind.
#![no_main]

use std::convert::Infallible;

use axum::extract::ws::Message;
use axum::response::IntoResponse;
use axum::response::sse::Sse;
use kiln_http::stream::{Utf8Carry, sse, ws_text};
use libfuzzer_sys::fuzz_target;
use serde_json::{Value, json};

/// The events of an SSE body, as a browser's EventSource reads them: (name, data).
fn read_sse(body: &[u8]) -> Vec<(Option<String>, String)> {
    let text = std::str::from_utf8(body).expect("an SSE body is UTF-8");
    let mut events = Vec::new();
    let (mut name, mut data): (Option<String>, Option<String>) = (None, None);
    let mut rest = text;
    while !rest.is_empty() {
        let end = rest.find(['\r', '\n']).expect("every SSE line ends");
        let line = &rest[..end];
        rest = if rest[end..].starts_with("\r\n") {
            &rest[end + 2..]
        } else {
            &rest[end + 1..]
        };
        if line.is_empty() {
            if let Some(data) = data.take() {
                events.push((name.take(), data));
            }
            name = None;
            continue;
        }
        if line.starts_with(':') {
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => name = Some(value.to_string()),
            "data" => match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => data = Some(value.to_string()),
            },
            other => panic!("kiln writes no SSE field {other:?}"),
        }
    }
    assert!(data.is_none(), "an SSE event is not ended by a blank line");
    events
}

fuzz_target!(|input: &[u8]| {
    let Some((&len, rest)) = input.split_first() else {
        return;
    };
    let len = (len as usize % 24).min(rest.len());
    let (name, mut rest) = rest.split_at(len);
    let name = String::from_utf8_lossy(name).into_owned();

    let mut carry = Utf8Carry::default();
    let mut all = Vec::new();
    let mut texts = Vec::new();
    while let Some((&len, tail)) = rest.split_first() {
        let len = (len as usize).min(tail.len());
        let (piece, tail) = tail.split_at(len);
        rest = tail;
        all.extend_from_slice(piece);
        texts.push(carry.push(piece));
        assert!(carry.waiting() <= 3, "{} bytes wait", carry.waiting());
    }
    texts.push(carry.finish());
    assert_eq!(carry.waiting(), 0);
    assert_eq!(texts.concat(), String::from_utf8_lossy(&all));

    let datas: Vec<Value> = texts.iter().map(|t| json!({ "data": t })).collect();
    let events: Vec<_> = datas
        .iter()
        .map(|d| Ok::<_, Infallible>(sse(&name, d)))
        .collect();
    let response = Sse::new(futures::stream::iter(events)).into_response();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let body = runtime
        .block_on(axum::body::to_bytes(response.into_body(), usize::MAX))
        .unwrap();
    let read = read_sse(&body);
    assert_eq!(read.len(), datas.len());
    let named = !name.contains(['\r', '\n']);
    for ((got_name, got_data), sent) in read.iter().zip(&datas) {
        assert_eq!(got_name.as_deref(), named.then_some(name.as_str()));
        let got: Value = serde_json::from_str(got_data).expect("an event's data is JSON");
        assert_eq!(&got, sent);
    }

    for (text, sent) in texts.iter().zip(&datas) {
        let Message::Text(message) = ws_text(&name, sent.clone()) else {
            panic!("a JSON message is a text message");
        };
        let got: Value = serde_json::from_str(message.as_str()).unwrap();
        assert_eq!(got["data"], Value::String(text.clone()));
        assert_eq!(got["type"], Value::String(name.clone()));
    }
});
