//! The Connect protocol (v1) with the JSON codec, as E2B's envd speaks it: unary calls are a
//! JSON body answered with JSON (errors as `{"code": "not_found", "message": …}` with the
//! matching HTTP status); server-streaming calls send one enveloped message and get
//! enveloped messages back (flag byte, u32 big-endian length, JSON), ended by an end-stream
//! envelope (flag 2) carrying `{}` or the error.

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

/// The largest request message: 16 MiB (stdin and file data travel in RPCs).
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// A Connect error: a code from the protocol's list and a message.
#[derive(Debug, Clone)]
pub struct RpcError {
    pub code: &'static str,
    pub message: String,
}

impl RpcError {
    pub fn new(code: &'static str, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> RpcError {
        RpcError::new("invalid_argument", message)
    }

    pub fn not_found(message: impl Into<String>) -> RpcError {
        RpcError::new("not_found", message)
    }

    /// The HTTP status of a unary error with this code.
    pub fn status(&self) -> StatusCode {
        match self.code {
            "invalid_argument" | "out_of_range" | "failed_precondition" => StatusCode::BAD_REQUEST,
            "not_found" => StatusCode::NOT_FOUND,
            "already_exists" | "aborted" => StatusCode::CONFLICT,
            "permission_denied" => StatusCode::FORBIDDEN,
            "unauthenticated" => StatusCode::UNAUTHORIZED,
            "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
            "unimplemented" => StatusCode::NOT_IMPLEMENTED,
            "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
            "deadline_exceeded" => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn body(&self) -> serde_json::Value {
        json!({"code": self.code, "message": self.message})
    }

    /// The error as a unary response.
    pub fn unary(&self) -> Response {
        (self.status(), axum::Json(self.body())).into_response()
    }
}

impl From<kiln_runtime::RuntimeError> for RpcError {
    /// A runtime failure as an RPC answers it: the code of the facade's one status for it
    /// ([`super::status_of`]).
    fn from(error: kiln_runtime::RuntimeError) -> RpcError {
        let status = super::status_of(&error, super::Route::Rpc);
        RpcError::new(
            code_for(status),
            super::message_of(&error, super::Route::Rpc),
        )
    }
}

/// The Connect code of an HTTP status: the inverse of [`RpcError::status`], with 507 (a full
/// disk, which Connect has no code of) as `resource_exhausted`.
pub fn code_for(status: StatusCode) -> &'static str {
    match status {
        StatusCode::BAD_REQUEST => "invalid_argument",
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::CONFLICT => "aborted",
        StatusCode::FORBIDDEN => "permission_denied",
        StatusCode::UNAUTHORIZED => "unauthenticated",
        StatusCode::TOO_MANY_REQUESTS | StatusCode::INSUFFICIENT_STORAGE => "resource_exhausted",
        StatusCode::NOT_IMPLEMENTED => "unimplemented",
        StatusCode::SERVICE_UNAVAILABLE => "unavailable",
        StatusCode::GATEWAY_TIMEOUT => "deadline_exceeded",
        _ => "internal",
    }
}

/// A unary call's answer.
pub fn unary<T: Serialize>(result: Result<T, RpcError>) -> Response {
    match result {
        Ok(message) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            serde_json::to_vec(&message).unwrap_or_else(|_| b"{}".to_vec()),
        )
            .into_response(),
        Err(e) => e.unary(),
    }
}

/// Whether a request is a streaming call (`application/connect+json`).
pub fn is_streaming(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/connect+"))
}

/// Reads a request's message: the body itself (unary) or its first envelope (streaming).
pub fn decode<T: DeserializeOwned>(body: &[u8], streaming: bool) -> Result<T, RpcError> {
    let json = if streaming {
        let Some((flags, message, _)) = split_envelope(body)? else {
            return Err(RpcError::invalid("the request holds no message"));
        };
        if flags & 1 != 0 {
            return Err(RpcError::new(
                "unimplemented",
                "compressed messages are not supported; send them uncompressed",
            ));
        }
        message
    } else {
        body
    };
    let json = if json.is_empty() {
        b"{}" as &[u8]
    } else {
        json
    };
    message(json)
}

/// A message: a JSON object (serde would also take an array for a struct).
fn message<T: DeserializeOwned>(json: &[u8]) -> Result<T, RpcError> {
    if json.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(RpcError::invalid("a message is a JSON object"));
    }
    kiln_http::objects::from_slice(json)
        .map_err(|e| RpcError::invalid(format!("malformed message: {e}")))
}

/// Every message of a client stream's body.
pub fn decode_all<T: DeserializeOwned>(mut body: &[u8]) -> Result<Vec<T>, RpcError> {
    let mut all = Vec::new();
    while let Some((flags, message, rest)) = split_envelope(body)? {
        body = rest;
        if flags & 2 != 0 {
            break;
        }
        all.push(self::message(if message.is_empty() {
            b"{}"
        } else {
            message
        })?);
    }
    Ok(all)
}

/// The first envelope of `body`: its flags, its message and what follows; `None` if empty.
/// An envelope's flags, its message and what follows it.
type Envelope<'a> = (u8, &'a [u8], &'a [u8]);

fn split_envelope(body: &[u8]) -> Result<Option<Envelope<'_>>, RpcError> {
    if body.is_empty() {
        return Ok(None);
    }
    if body.len() < 5 {
        return Err(RpcError::invalid("a truncated envelope"));
    }
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    if len > MAX_MESSAGE_BYTES {
        return Err(RpcError::new(
            "resource_exhausted",
            format!("a message of {len} bytes is larger than {MAX_MESSAGE_BYTES}"),
        ));
    }
    let rest = &body[5..];
    if rest.len() < len {
        return Err(RpcError::invalid("a truncated envelope"));
    }
    Ok(Some((body[0], &rest[..len], &rest[len..])))
}

/// One enveloped message.
pub fn envelope<T: Serialize>(message: &T) -> Bytes {
    frame(
        0,
        &serde_json::to_vec(message).unwrap_or_else(|_| b"{}".to_vec()),
    )
}

/// The end of a stream: `{}`, or the error that ended it.
pub fn end_stream(error: Option<&RpcError>) -> Bytes {
    let body = match error {
        None => json!({}),
        Some(e) => json!({"error": e.body()}),
    };
    frame(2, body.to_string().as_bytes())
}

fn frame(flags: u8, json: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + json.len());
    out.put_u8(flags);
    out.put_u32(json.len() as u32);
    out.put_slice(json);
    out.freeze()
}

/// A streaming response of `frames` (enveloped messages, then an end-stream).
pub fn stream_response(frames: impl futures::Stream<Item = Bytes> + Send + 'static) -> Response {
    let body =
        axum::body::Body::from_stream(futures::StreamExt::map(frames, Ok::<_, std::io::Error>));
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/connect+json")],
        body,
    )
        .into_response()
}

/// A streaming call that failed before it began: just the end-stream with the error.
pub fn stream_error(error: RpcError) -> Response {
    stream_response(futures::stream::once(
        async move { end_stream(Some(&error)) },
    ))
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
