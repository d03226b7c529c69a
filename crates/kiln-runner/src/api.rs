//! The HTTP face: `POST /execute`, `GET /healthz`, `POST /_framework/load_code` and the
//! JSON Schemas. Handlers check the transport (media types, size, JSON, fields), hand a
//! typed request to the [`Runner`], and map what comes back. Every non-200 answer is kiln's
//! error envelope ([`kiln_http::HttpError`]) with the members the protocol's
//! [`HttpErrorBody`](crate::protocol::HttpErrorBody) adds: `error.field` and `requestId`.

use std::sync::Arc;

use axum::Router;
use axum::extract::{FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kiln_http::error::{RouterErrors, reshape_errors};
use kiln_http::{HttpError, Json};
use serde_json::{Value, json};

use crate::protocol::parse_request;
use crate::runner::{InternalError, Runner};

/// The router; `runner` serves `/execute`.
pub fn router(runner: Arc<Runner>) -> Router {
    let errors = RouterErrors::new(runner.config.max_body_bytes);
    Router::new()
        .route("/healthz", get(healthz))
        .route("/execute", post(execute))
        .route("/_framework/load_code", post(load_code))
        .route("/schema/{name}", get(schema))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(errors, reshape_errors))
        .layer(axum::middleware::from_fn(echo_request_id))
        .with_state(runner)
}

/// `error` for the request `request_id` (when its body could be read): the envelope's
/// `error.request_id` and the protocol's top-level `requestId`.
fn for_request(error: HttpError, request_id: Option<&str>) -> HttpError {
    match request_id {
        Some(id) => error.with_request_id(id).with_sibling("requestId", id),
        None => error,
    }
}

/// Sends `X-Request-ID` back when the caller gave a usable one.
async fn echo_request_id(request: Request, next: Next) -> Response {
    let given = request
        .headers()
        .get("x-request-id")
        .filter(|v| v.len() <= 128 && v.to_str().is_ok())
        .cloned();
    let mut response = next.run(request).await;
    if let Some(id) = given {
        response.headers_mut().insert("x-request-id", id);
    }
    response
}

fn not_ready(message: String) -> HttpError {
    HttpError::new(StatusCode::SERVICE_UNAVAILABLE, "NOT_READY", message)
}

async fn healthz(State(runner): State<Arc<Runner>>) -> Response {
    if runner.is_ready() {
        axum::Json(json!({"status": "ok"})).into_response()
    } else {
        not_ready("the runner is starting or its shared volume cannot be read".to_owned())
            .into_response()
    }
}

/// Scripts are read from the shared volume on every request, so a reload has nothing to
/// do but confirm the volume is readable.
async fn load_code(State(runner): State<Arc<Runner>>) -> Response {
    match &runner.config.scripts {
        Some(dir) if std::fs::read_dir(dir).is_err() => {
            not_ready(format!("the shared volume {} cannot be read", dir.display()))
                .into_response()
        }
        _ => axum::Json(json!({
            "status": "ok",
            "mode": "interpreter",
            "message": "scripts are read from the shared volume on every request; nothing to reload",
        }))
        .into_response(),
    }
}

async fn schema(Path(name): Path<String>) -> Response {
    match crate::schemas().into_iter().find(|(file, _)| *file == name) {
        Some((_, schema)) => axum::Json(schema).into_response(),
        None => not_found().await.into_response(),
    }
}

async fn not_found() -> HttpError {
    HttpError::new(
        StatusCode::NOT_FOUND,
        "NOT_FOUND",
        "no such route; the runner serves POST /execute, GET /healthz, POST /_framework/load_code and GET /schema/{request,response,error,workflow,template}.json",
    )
}

/// Whether an `Accept` header admits a JSON answer (a range with `q=0` does not).
fn accepts_json(accept: &str) -> bool {
    accept.split(',').any(|range| {
        let mut parts = range.split(';');
        let media = parts.next().unwrap_or_default().trim().to_ascii_lowercase();
        let refused = parts.any(|p| {
            p.trim()
                .strip_prefix("q=")
                .and_then(|q| q.trim().parse::<f32>().ok())
                .is_some_and(|q| q <= 0.0)
        });
        !refused
            && matches!(
                media.as_str(),
                "*/*" | "application/*" | "application/json" | ""
            )
    })
}

/// The caller accepts a JSON answer (no `Accept`, or one that admits JSON); else 406
/// `NOT_ACCEPTABLE`, before the body is read.
struct AcceptsJson;

impl<S: Send + Sync> FromRequestParts<S> for AcceptsJson {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<AcceptsJson, HttpError> {
        let accept: Vec<&str> = parts
            .headers
            .get_all(header::ACCEPT)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        if accept.is_empty() || accept.iter().any(|a| accepts_json(a)) {
            return Ok(AcceptsJson);
        }
        Err(HttpError::new(
            StatusCode::NOT_ACCEPTABLE,
            "NOT_ACCEPTABLE",
            format!(
                "the runner answers application/json only (Accept: {})",
                accept.join(", ")
            ),
        ))
    }
}

/// `POST /execute`. The extractors answer 406, 415, 413 and 400 `MALFORMED_JSON`; the
/// fields are checked here (400 `INVALID_FIELD`, naming the field).
async fn execute(
    State(runner): State<Arc<Runner>>,
    _: AcceptsJson,
    Json(body): Json<Value>,
) -> Response {
    let request_id = body
        .get("requestId")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let request = match parse_request(body) {
        Ok(request) => request,
        Err(error) => {
            let refused = HttpError::new(StatusCode::BAD_REQUEST, "INVALID_FIELD", error.message)
                .with_details(json!({"field": error.field}))
                .with_member("field", error.field);
            return for_request(refused, request_id.as_deref()).into_response();
        }
    };
    let mut response = run(runner, request, request_id.as_deref()).await;
    if let Some(id) = request_id.and_then(|id| HeaderValue::from_str(&id).ok()) {
        response.headers_mut().insert("x-request-id", id);
    }
    response
}

/// Runs a checked request under the request timeout and answers its result.
async fn run(
    runner: Arc<Runner>,
    request: crate::protocol::ExecuteRequest,
    request_id: Option<&str>,
) -> Response {
    let timeout = runner.config.request_timeout;
    // A task of its own: a panic becomes a 500, and a caller that goes away does not cut
    // a sandbox or an MCP exchange off half-way.
    let task = tokio::spawn(async move { runner.execute(request).await });
    match tokio::time::timeout(timeout, task).await {
        Ok(Ok(Ok(answer))) => axum::Json(answer).into_response(),
        Ok(Ok(Err(error))) => internal(&error, request_id),
        Ok(Err(join)) => internal(&InternalError::Panic(join.to_string()), request_id),
        Err(_) => {
            let late = HttpError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "REQUEST_TIMEOUT",
                format!("the request took longer than {} s", timeout.as_secs()),
            );
            for_request(late, request_id).into_response()
        }
    }
}

fn internal(error: &InternalError, request_id: Option<&str>) -> Response {
    // A bare diagnostic for the operator: the framework's log may be what failed.
    tracing::error!(%error, request_id = request_id.unwrap_or(""), "internal failure");
    let failed = HttpError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "INTERNAL",
        error.to_string(),
    );
    for_request(failed, request_id).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_headers() {
        assert!(accepts_json("*/*"));
        assert!(accepts_json("text/html, application/json;q=0.5"));
        assert!(accepts_json("application/*"));
        assert!(!accepts_json("text/html"));
        assert!(!accepts_json("application/json;q=0"));
    }

    /// The bodies the runner answers are what the served schema (`HttpErrorBody`)
    /// describes: read into it and written back, nothing is lost.
    #[test]
    fn error_bodies_are_the_protocols_error_body() {
        let refused = HttpError::new(StatusCode::BAD_REQUEST, "INVALID_FIELD", "x is missing")
            .with_details(json!({"field": "x"}))
            .with_member("field", "x");
        for error in [
            for_request(refused.clone(), Some("r-1")),
            refused,
            not_ready("starting".to_owned()),
        ] {
            let body = error.body();
            let typed: crate::protocol::HttpErrorBody =
                serde_json::from_value(body.clone()).unwrap();
            assert_eq!(serde_json::to_value(typed).unwrap(), body);
        }
    }
}
