//! kiln rest's side of the shared error envelope ([`kiln_http::error`]): every error it
//! answers, its own and those the router answers on its own (a 405 on a fixed route, ...),
//! is `{"error": {"code", "message", "details", "request_id"}}` with a log line.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::{HeaderValue, Method, StatusCode, header};
use kiln_http::HttpError;
use kiln_http::error::{ReshapedError, RouterErrors};
use serde_json::json;

use crate::App;

/// What the catch-all serves (a 405 for any other method names them in `Allow`).
const ALLOWED_METHODS: &str = "GET, POST, PUT, PATCH, DELETE, OPTIONS, HEAD";

/// How the router's own errors are reshaped for kiln rest: its body limit, a request id on
/// every error (the caller's `X-Request-ID`, else a fresh one), and a log line each.
pub(crate) fn router_errors(app: &Arc<App>) -> RouterErrors {
    let ids = app.clone();
    RouterErrors::new(app.config.max_body_bytes)
        .with_request_ids(move || ids.new_request_id())
        .on_error(log_reshaped)
}

fn log_reshaped(error: &ReshapedError<'_>) {
    let line = json!({
        "ts": SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
        "target": "kiln::rest",
        "request_id": error.request_id,
        "method": error.method.as_str(),
        "path": error.path,
        "status": error.status.as_u16(),
        "ms": (error.elapsed.as_secs_f64() * 1000.0 * 1000.0).round() / 1000.0,
        "outcome": error.code,
    });
    eprintln!("{line}");
}

/// 405 for a method the catch-all does not serve, with `Allow`.
pub(crate) fn method_not_allowed(method: &Method) -> HttpError {
    HttpError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "METHOD_NOT_ALLOWED",
        format!("{method} is not served; use GET, POST, PUT, PATCH, DELETE, OPTIONS or HEAD"),
    )
    .with_header(header::ALLOW, HeaderValue::from_static(ALLOWED_METHODS))
}

/// 401 with the `WWW-Authenticate` challenge.
pub(crate) fn unauthorized(message: &str) -> HttpError {
    HttpError::new(StatusCode::UNAUTHORIZED, "UNAUTHORIZED", message).with_header(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"kiln rest\""),
    )
}
