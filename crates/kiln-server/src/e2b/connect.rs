//! The Connect protocol (v1) with the JSON codec, as E2B's envd speaks it: unary calls are a
//! JSON body answered with JSON (errors as `{"code": "not_found", "message": …}` with the
//! matching HTTP status); server-streaming calls send one enveloped message and get
//! enveloped messages back (flag byte, u32 big-endian length, JSON), ended by an end-stream
//! envelope (flag 2) carrying `{}` or the error.

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kiln_http::connect::frame;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

pub use kiln_http::connect::{MAX_MESSAGE_BYTES, b64, int64};

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
        let Some(kiln_http::connect::Envelope { flags, message, .. }) = split_envelope(body)?
        else {
            return Err(RpcError::invalid("the request holds no message"));
        };
        if flags & kiln_http::connect::COMPRESSED != 0 {
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
    while let Some(kiln_http::connect::Envelope {
        flags,
        message,
        rest,
    }) = split_envelope(body)?
    {
        body = rest;
        if flags & kiln_http::connect::END_STREAM != 0 {
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

fn split_envelope(body: &[u8]) -> Result<Option<kiln_http::connect::Envelope<'_>>, RpcError> {
    use kiln_http::connect::EnvelopeError;
    match kiln_http::connect::split_envelope(body) {
        Ok(found) => Ok(found),
        Err(e @ EnvelopeError::TooLarge(_)) => {
            Err(RpcError::new("resource_exhausted", e.to_string()))
        }
        Err(e) => Err(RpcError::invalid(e.to_string())),
    }
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
    frame(kiln_http::connect::END_STREAM, body.to_string().as_bytes())
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
