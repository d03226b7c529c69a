//! Errors kiln rest answers itself, and the middleware that gives the router's own answers
//! (a 405 on a fixed route, ...) the same JSON shape.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::App;

/// Marks a response kiln rest made itself (a plan's reply, a [`RestError`], health): the
/// error middleware leaves it as it is.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Answered;

pub(crate) fn answered(mut response: Response) -> Response {
    response.extensions_mut().insert(Answered);
    response
}

/// Gives every error the router answered on its own (405 with its `Allow` header on a fixed
/// route, and any other status it may produce) the documented JSON shape
/// `{"error": {"code", "message", "request_id"}}`, and a log line.
pub(crate) async fn json_errors(
    State(app): State<Arc<App>>,
    request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let given_id = request_id_of(request.headers());
    let response = next.run(request).await;
    let status = response.status();
    if status.as_u16() < 400 || response.extensions().get::<Answered>().is_some() {
        return response;
    }
    let request_id = given_id.unwrap_or_else(|| app.new_request_id());
    let (code, message) = match status {
        StatusCode::METHOD_NOT_ALLOWED => (
            "METHOD_NOT_ALLOWED",
            format!("{method} is not served on {path}; the Allow header lists what is"),
        ),
        StatusCode::NOT_FOUND => ("NOT_FOUND", format!("no route {path}")),
        StatusCode::PAYLOAD_TOO_LARGE => (
            "BODY_TOO_LARGE",
            format!(
                "the body is larger than {} bytes",
                app.config.max_body_bytes
            ),
        ),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => (
            "UNSUPPORTED_MEDIA_TYPE",
            "this content type is not accepted here".to_string(),
        ),
        _ if status.is_server_error() => (
            "INTERNAL",
            status
                .canonical_reason()
                .unwrap_or("the request failed")
                .to_string(),
        ),
        _ => (
            "INVALID_REQUEST",
            status
                .canonical_reason()
                .unwrap_or("the request was refused")
                .to_string(),
        ),
    };
    let (parts, _) = response.into_parts();
    let mut shaped = error_response(&RestError::new(status, code, message), &request_id);
    // Keep what the router said besides the body (Allow, ...).
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            shaped.headers_mut().insert(name.clone(), value.clone());
        }
    }
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        shaped.headers_mut().insert("x-request-id", v);
    }
    if method == Method::HEAD {
        *shaped.body_mut() = Body::empty();
    }
    let line = json!({
        "ts": SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
        "target": "kiln::rest",
        "request_id": request_id,
        "method": method.as_str(),
        "path": path,
        "status": status.as_u16(),
        "ms": (started.elapsed().as_secs_f64() * 1000.0 * 1000.0).round() / 1000.0,
        "outcome": code,
    });
    eprintln!("{line}");
    shaped
}

/// The caller's `X-Request-ID` when it is usable (1 to 128 of `[A-Za-z0-9-_.:]`).
pub(crate) fn request_id_of(headers: &HeaderMap) -> Option<String> {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            !v.is_empty()
                && v.len() <= 128
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
        })
        .map(str::to_string)
}

/// An error answered by kiln itself (not by a plan).
#[derive(Debug)]
pub(crate) struct RestError {
    pub(crate) status: StatusCode,
    pub(crate) code: &'static str,
    pub(crate) message: String,
    /// Seconds for a `Retry-After` header.
    retry_after: Option<u64>,
}

impl RestError {
    pub(crate) fn new(
        status: StatusCode,
        code: &'static str,
        message: impl Into<String>,
    ) -> RestError {
        RestError {
            status,
            code,
            message: message.into(),
            retry_after: None,
        }
    }

    pub(crate) fn retry_after(mut self, seconds: u64) -> RestError {
        self.retry_after = Some(seconds.max(1));
        self
    }
}

/// What the catch-all serves (a 405 for any other method names them in `Allow`).
const ALLOWED_METHODS: &str = "GET, POST, PUT, PATCH, DELETE, OPTIONS, HEAD";

pub(crate) fn error_response(error: &RestError, request_id: &str) -> Response {
    let body =
        json!({"error": {"code": error.code, "message": error.message, "request_id": request_id}});
    let mut response = (error.status, axum::Json(body)).into_response();
    let headers = response.headers_mut();
    if error.status == StatusCode::UNAUTHORIZED {
        headers.insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"kiln rest\""),
        );
    }
    if error.code == "METHOD_NOT_ALLOWED" {
        headers.insert(header::ALLOW, HeaderValue::from_static(ALLOWED_METHODS));
    }
    if let Some(seconds) = error.retry_after {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}
