//! The Connect protocol's wire format (v1, JSON codec), as E2B's envd speaks it: the
//! envelopes of streaming calls (a flag byte, a u32 big-endian length, the message) and
//! proto3 JSON's `int64` (a string or a number) and `bytes` (base64). The faces map
//! [`EnvelopeError`] onto Connect's error codes; what is here only reads and writes bytes.

use bytes::{BufMut, Bytes, BytesMut};

/// The largest message: 16 MiB (stdin and file data travel in RPCs).
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Flag bit: the message is compressed.
pub const COMPRESSED: u8 = 1;
/// Flag bit: the envelope ends the stream.
pub const END_STREAM: u8 = 2;

/// One envelope of a body: its flags, its message and what follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Envelope<'a> {
    pub flags: u8,
    pub message: &'a [u8],
    pub rest: &'a [u8],
}

/// Why the bytes are not an envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvelopeError {
    /// Fewer bytes than the header, or than the length it declares.
    Truncated,
    /// A declared length over [`MAX_MESSAGE_BYTES`] (refused before anything is held).
    TooLarge(usize),
}

impl std::fmt::Display for EnvelopeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EnvelopeError::Truncated => f.write_str("a truncated envelope"),
            EnvelopeError::TooLarge(len) => write!(
                f,
                "a message of {len} bytes is larger than {MAX_MESSAGE_BYTES}"
            ),
        }
    }
}

/// The first envelope of `body`; `None` when it is empty.
pub fn split_envelope(body: &[u8]) -> Result<Option<Envelope<'_>>, EnvelopeError> {
    if body.is_empty() {
        return Ok(None);
    }
    let Some((header, rest)) = body.split_first_chunk::<5>() else {
        return Err(EnvelopeError::Truncated);
    };
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    if len > MAX_MESSAGE_BYTES {
        return Err(EnvelopeError::TooLarge(len));
    }
    if rest.len() < len {
        return Err(EnvelopeError::Truncated);
    }
    let (message, rest) = rest.split_at(len);
    Ok(Some(Envelope {
        flags: header[0],
        message,
        rest,
    }))
}

/// An envelope of `message` with `flags`. A message is at most [`MAX_MESSAGE_BYTES`]
/// when kiln writes it; a longer one would not fit the length and is cut to fit.
pub fn frame(flags: u8, message: &[u8]) -> Bytes {
    let message = &message[..message.len().min(u32::MAX as usize)];
    let mut out = BytesMut::with_capacity(5 + message.len());
    out.put_u8(flags);
    out.put_u32(message.len() as u32);
    out.put_slice(message);
    out.freeze()
}

/// Proto3 JSON's int64: a string or a number.
pub mod int64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&value.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            Text(String),
            Number(u64),
        }
        match Either::deserialize(d)? {
            Either::Number(n) => Ok(n),
            Either::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// Proto3 JSON's bytes: standard base64 (padding optional, URL-safe accepted).
pub mod b64 {
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(value))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        let trimmed = text.trim_end_matches('=');
        let config = base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent);
        let standard = base64::engine::GeneralPurpose::new(&base64::alphabet::STANDARD, config);
        let url = base64::engine::GeneralPurpose::new(&base64::alphabet::URL_SAFE, config);
        standard
            .decode(trimmed)
            .or_else(|_| url.decode(trimmed))
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_split_frame_and_refuse_what_does_not_fit() {
        let mut body = frame(0, br#"{"a":1}"#).to_vec();
        body.extend_from_slice(&frame(END_STREAM, b"{}"));
        let first = split_envelope(&body).unwrap().unwrap();
        assert_eq!((first.flags, first.message), (0, &br#"{"a":1}"#[..]));
        let end = split_envelope(first.rest).unwrap().unwrap();
        assert_eq!(
            (end.flags, end.message, end.rest),
            (END_STREAM, &b"{}"[..], &[][..])
        );
        assert_eq!(split_envelope(&[]), Ok(None));
        assert_eq!(split_envelope(&[0, 0, 0]), Err(EnvelopeError::Truncated));
        assert_eq!(
            split_envelope(&[0, 0, 0, 0, 9, 1]),
            Err(EnvelopeError::Truncated)
        );
        let huge = [0, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(
            split_envelope(&huge),
            Err(EnvelopeError::TooLarge(u32::MAX as usize))
        );
    }
}
