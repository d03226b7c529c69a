//! What streamed output goes through on its way to a client: guest bytes become text without
//! splitting a character across two events ([`Utf8Carry`]), and each event becomes a
//! Server-Sent Event ([`sse`]) or a WebSocket text message ([`ws_text`]) of JSON.
//!
//! A guest writes any bytes, cut anywhere. Whatever the cuts, the text of the events, in
//! order, is exactly `String::from_utf8_lossy` of all the bytes: a character cut in two
//! arrives whole in the later event, and a sequence that can never be completed is one
//! U+FFFD, as if the bytes had come in one piece. (The `stream_frames` fuzz target holds
//! this.)

use axum::extract::ws::Message;
use axum::response::sse::Event;

/// Decodes chunks to text; an incomplete character at a chunk's end waits for the next.
#[derive(Debug, Default)]
pub struct Utf8Carry {
    /// The start of a character the last chunk cut (at most 3 bytes).
    pending: Vec<u8>,
}

impl Utf8Carry {
    /// The text of everything up to the last complete character; what follows it waits.
    pub fn push(&mut self, data: &[u8]) -> String {
        self.pending.extend_from_slice(data);
        let cut = complete_prefix(&self.pending);
        let rest = self.pending.split_off(cut);
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending = rest;
        text
    }

    /// What is still waiting, at the stream's end (a cut character is one U+FFFD).
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }

    /// How many bytes wait for the rest of their character.
    pub fn waiting(&self) -> usize {
        self.pending.len()
    }
}

/// A run's stdout and stderr, each decoded by its own [`Utf8Carry`].
#[derive(Debug, Default)]
pub struct OutputCarry {
    out: Utf8Carry,
    err: Utf8Carry,
}

impl OutputCarry {
    /// The text of a chunk of stdout (or stderr), as [`Utf8Carry::push`].
    pub fn push(&mut self, stderr: bool, data: &[u8]) -> String {
        if stderr { &mut self.err } else { &mut self.out }.push(data)
    }

    /// At the run's end: what each stream still held, `(stderr, text)`, when not empty.
    pub fn finish(&mut self) -> impl Iterator<Item = (bool, String)> {
        [(false, self.out.finish()), (true, self.err.finish())]
            .into_iter()
            .filter(|(_, text)| !text.is_empty())
    }
}

/// The length of the longest prefix that does not end inside a character that the next
/// bytes could still complete. Invalid bytes before that point stay in the prefix (they
/// decode to U+FFFD the same now as later).
fn complete_prefix(bytes: &[u8]) -> usize {
    let mut done = 0;
    loop {
        match std::str::from_utf8(&bytes[done..]) {
            Ok(_) => return bytes.len(),
            Err(e) => match e.error_len() {
                Some(bad) => done += e.valid_up_to() + bad,
                None => return done + e.valid_up_to(),
            },
        }
    }
}

/// A Server-Sent Event named `name` whose data is `data` as JSON. JSON text has no line
/// breaks of its own (they are escaped in strings), so the event is one `data:` line.
/// `name` is kiln's own word; one with a line break in it is dropped, not a panic.
pub fn sse(name: &str, data: &serde_json::Value) -> Event {
    let event = Event::default();
    let event = if name.contains(['\r', '\n']) {
        event
    } else {
        event.event(name)
    };
    event.data(data.to_string())
}

/// A WebSocket text message: `value` (an object) with `"type": kind` added.
pub fn ws_text(kind: &str, mut value: serde_json::Value) -> Message {
    if let Some(object) = value.as_object_mut() {
        object.insert("type".into(), serde_json::Value::String(kind.into()));
    }
    Message::Text(value.to_string().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn through(chunks: &[&[u8]]) -> String {
        let mut carry = Utf8Carry::default();
        let mut text: String = chunks.iter().map(|c| carry.push(c)).collect();
        assert!(carry.waiting() <= 3);
        text.push_str(&carry.finish());
        text
    }

    #[test]
    fn a_character_cut_in_two_arrives_whole() {
        assert_eq!(through(&[b"caf\xc3", b"\xa9!"]), "café!");
        assert_eq!(through(&[b"\xe2", b"\x82", b"\xac"]), "€");
    }

    #[test]
    fn an_invalid_byte_before_a_cut_character_does_not_break_it() {
        // Found writing the fuzz target `stream_frames`: an invalid byte anywhere in a
        // chunk made the whole chunk decode at once, so a character cut at its end became two
        // U+FFFD instead of arriving whole with the next chunk.
        let chunks: [&[u8]; 2] = [b"\xff\xc3", b"\xa9"];
        assert_eq!(through(&chunks), String::from_utf8_lossy(b"\xff\xc3\xa9"));
        assert_eq!(through(&chunks), "\u{fffd}é");
    }

    #[test]
    fn a_cut_character_at_the_end_is_not_lost() {
        // Before: the bytes waiting when the stream ended were dropped.
        assert_eq!(through(&[b"ok\xe2\x82"]), "ok\u{fffd}");
    }

    #[test]
    fn an_event_name_with_a_line_break_does_not_panic() {
        let _ = sse("a\nb", &serde_json::json!({"data": "x\ny"}));
    }
}
