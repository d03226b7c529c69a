//! The HTTP face: `POST /execute`, `GET /healthz`, `POST /_framework/load_code` and the
//! JSON Schemas. Handlers check the transport (media types, size, JSON, fields), hand a
//! typed request to the [`Runner`], and map what comes back.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use crate::protocol::{HttpError, HttpErrorBody, parse_request};
use crate::runner::{InternalError, Runner};

/// A transport-level failure, answered with its HTTP status and [`HttpErrorBody`].
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    body: HttpErrorBody,
}

impl ApiError {
    fn new(status: StatusCode, code: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            body: HttpErrorBody {
                error: HttpError {
                    code: code.to_owned(),
                    message: message.into(),
                    field: None,
                },
                request_id: None,
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body)).into_response();
        response.extensions_mut().insert(Shaped);
        response
    }
}

/// Marks an error response the runner made itself: [`json_errors`] leaves it as it is.
#[derive(Debug, Clone, Copy)]
struct Shaped;

/// The router; `runner` serves `/execute`.
pub fn router(runner: Arc<Runner>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/execute", post(execute))
        .route("/_framework/load_code", post(load_code))
        .route("/schema/{name}", get(schema))
        .fallback(not_found)
        .layer(axum::middleware::from_fn(json_errors))
        .layer(axum::middleware::from_fn(echo_request_id))
        .with_state(runner)
}

/// Gives every error the router or an extractor answered on its own (405 with its `Allow`
/// header, a path it could not decode, ...) the error shape of every non-200 answer,
/// [`HttpErrorBody`], instead of an empty or plain-text body.
async fn json_errors(request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let response = next.run(request).await;
    let status = response.status();
    if status.as_u16() < 400 || response.extensions().get::<Shaped>().is_some() {
        return response;
    }
    let (code, message) = match status {
        StatusCode::METHOD_NOT_ALLOWED => (
            "METHOD_NOT_ALLOWED",
            format!("{method} is not served on {path}; the Allow header lists what is"),
        ),
        StatusCode::NOT_FOUND => ("NOT_FOUND", format!("no route {path}")),
        StatusCode::PAYLOAD_TOO_LARGE => (
            "BODY_TOO_LARGE",
            "the body is larger than the runner's limit".to_owned(),
        ),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => (
            "UNSUPPORTED_MEDIA_TYPE",
            "the body must be application/json".to_owned(),
        ),
        _ if status.is_server_error() => (
            "INTERNAL",
            status
                .canonical_reason()
                .unwrap_or("the request failed")
                .to_owned(),
        ),
        _ => (
            "INVALID_REQUEST",
            format!(
                "{} {path}: {}",
                method,
                status
                    .canonical_reason()
                    .unwrap_or("the request was refused")
            ),
        ),
    };
    let (parts, _) = response.into_parts();
    let mut shaped = ApiError::new(status, code, message).into_response();
    // Keep what the router said besides the body (Allow, ...).
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            shaped.headers_mut().insert(name.clone(), value.clone());
        }
    }
    shaped
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

async fn healthz(State(runner): State<Arc<Runner>>) -> Response {
    if runner.is_ready() {
        axum::Json(json!({"status": "ok"})).into_response()
    } else {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "NOT_READY",
            "the runner is starting or its shared volume cannot be read",
        )
        .into_response()
    }
}

/// Scripts are read from the shared volume on every request, so a reload has nothing to
/// do but confirm the volume is readable.
async fn load_code(State(runner): State<Arc<Runner>>) -> Response {
    match &runner.config.scripts {
        Some(dir) if std::fs::read_dir(dir).is_err() => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "NOT_READY",
            format!("the shared volume {} cannot be read", dir.display()),
        )
        .into_response(),
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

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "NOT_FOUND",
        "no such route; the runner serves POST /execute, GET /healthz, POST /_framework/load_code and GET /schema/{request,response,error,workflow,template}.json",
    )
}

/// `application/json`, `application/*+json`, with any parameters.
fn is_json_type(value: &str) -> bool {
    let essence = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
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

fn check_headers(headers: &HeaderMap, limit: usize) -> Result<(), ApiError> {
    match headers.get(header::CONTENT_TYPE).map(|v| v.to_str()) {
        Some(Ok(value)) if is_json_type(value) => {}
        given => {
            let given = match given {
                None => "none".to_owned(),
                Some(value) => format!("{:?}", value.unwrap_or("(not text)")),
            };
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UNSUPPORTED_MEDIA_TYPE",
                format!("the body must be application/json (Content-Type: {given})"),
            ));
        }
    }
    let accept: Vec<&str> = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    if !accept.is_empty() && !accept.iter().any(|a| accepts_json(a)) {
        return Err(ApiError::new(
            StatusCode::NOT_ACCEPTABLE,
            "NOT_ACCEPTABLE",
            format!(
                "the runner answers application/json only (Accept: {})",
                accept.join(", ")
            ),
        ));
    }
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(too_large(limit));
    }
    Ok(())
}

fn too_large(limit: usize) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "BODY_TOO_LARGE",
        format!("the body is larger than the limit of {limit} bytes"),
    )
}

async fn execute(State(runner): State<Arc<Runner>>, request: Request<Body>) -> Response {
    let (parts, body) = request.into_parts();
    let limit = runner.config.max_body_bytes;
    if let Err(error) = check_headers(&parts.headers, limit) {
        return error.into_response();
    }
    let Ok(bytes) = axum::body::to_bytes(body, limit).await else {
        return too_large(limit).into_response();
    };
    let value: Value = match serde_json::from_slice(&bytes) {
        Ok(value) => value,
        Err(error) => {
            return ApiError::new(
                StatusCode::BAD_REQUEST,
                "MALFORMED_JSON",
                format!("the body is not valid JSON: {error}"),
            )
            .into_response();
        }
    };
    let request_id = value
        .get("requestId")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let request = match parse_request(value) {
        Ok(request) => request,
        Err(error) => {
            let mut api = ApiError::new(StatusCode::BAD_REQUEST, "INVALID_FIELD", error.message);
            api.body.error.field = Some(error.field);
            api.body.request_id = request_id;
            return api.into_response();
        }
    };
    let timeout = runner.config.request_timeout;
    // A task of its own: a panic becomes a 500, and a caller that goes away does not cut
    // a sandbox or an MCP exchange off half-way.
    let task = tokio::spawn(async move { runner.execute(request).await });
    let joined = tokio::time::timeout(timeout, task).await;
    let mut response = match joined {
        Ok(Ok(Ok(answer))) => axum::Json(answer).into_response(),
        Ok(Ok(Err(error))) => internal(&error, request_id.clone()),
        Ok(Err(join)) => internal(&InternalError::Panic(join.to_string()), request_id.clone()),
        Err(_) => {
            let mut api = ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "REQUEST_TIMEOUT",
                format!("the request took longer than {} s", timeout.as_secs()),
            );
            api.body.request_id = request_id.clone();
            api.into_response()
        }
    };
    if let Some(id) = request_id.and_then(|id| HeaderValue::from_str(&id).ok()) {
        response.headers_mut().insert("x-request-id", id);
    }
    response
}

fn internal(error: &InternalError, request_id: Option<String>) -> Response {
    // A bare diagnostic for the operator: the framework's log may be what failed.
    tracing::error!(%error, request_id = request_id.as_deref().unwrap_or(""), "internal failure");
    let mut api = ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "INTERNAL",
        error.to_string(),
    );
    api.body.request_id = request_id;
    api.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RunnerConfig;
    use tower::ServiceExt;

    fn test_router(max_body_bytes: usize) -> Router {
        let config = RunnerConfig {
            max_body_bytes,
            ..RunnerConfig::default()
        };
        // The pool starts workers on first use only; these requests never get that far.
        let pool = kiln_executor::ExecutorPool::new(kiln_executor::PoolConfig {
            workers: 1,
            ..kiln_executor::PoolConfig::new("/nonexistent".into(), Vec::new())
        });
        router(Arc::new(Runner::new(config, pool).unwrap()))
    }

    async fn answer(router: Router, request: Request<Body>) -> (StatusCode, Value) {
        let response = router.oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    #[tokio::test]
    async fn a_streamed_body_over_the_limit_is_413() {
        let chunks = (0..64).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b' '; 1024])));
        let request = Request::post("/execute")
            .header("content-type", "application/json")
            .body(Body::from_stream(futures::stream::iter(chunks)))
            .unwrap();
        let (status, body) = answer(test_router(16 << 10), request).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(body["error"]["code"], "BODY_TOO_LARGE");
    }

    #[tokio::test]
    async fn healthz_is_503_until_warm() {
        let request = Request::get("/healthz").body(Body::empty()).unwrap();
        let (status, body) = answer(test_router(1024), request).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["error"]["code"], "NOT_READY");
    }

    #[tokio::test]
    async fn errors_the_router_answers_have_the_json_shape() {
        for (method, path, status, code) in [
            (
                "GET",
                "/execute",
                StatusCode::METHOD_NOT_ALLOWED,
                "METHOD_NOT_ALLOWED",
            ),
            (
                "POST",
                "/healthz",
                StatusCode::METHOD_NOT_ALLOWED,
                "METHOD_NOT_ALLOWED",
            ),
            (
                "DELETE",
                "/schema/request.json",
                StatusCode::METHOD_NOT_ALLOWED,
                "METHOD_NOT_ALLOWED",
            ),
            ("GET", "/nowhere", StatusCode::NOT_FOUND, "NOT_FOUND"),
            (
                "GET",
                "/schema/%FF",
                StatusCode::BAD_REQUEST,
                "INVALID_REQUEST",
            ),
        ] {
            let request = Request::builder()
                .method(method)
                .uri(path)
                .body(Body::empty())
                .unwrap();
            let response = test_router(1024).oneshot(request).await.unwrap();
            assert_eq!(response.status(), status, "{method} {path}");
            let allow = response.headers().get(header::ALLOW).cloned();
            assert_eq!(
                response.headers().get(header::CONTENT_TYPE).unwrap(),
                "application/json"
            );
            let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
                .await
                .unwrap();
            let body: Value = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(body["error"]["code"], code, "{method} {path}: {body}");
            assert!(
                body["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty())
            );
            if status == StatusCode::METHOD_NOT_ALLOWED {
                let allow = allow.unwrap();
                assert!(
                    allow.to_str().unwrap().contains(if path == "/execute" {
                        "POST"
                    } else {
                        "GET"
                    }),
                    "{allow:?}"
                );
            }
        }
    }

    #[test]
    fn media_types() {
        assert!(is_json_type("application/json"));
        assert!(is_json_type("Application/JSON; charset=utf-8"));
        assert!(is_json_type("application/vnd.uhlp+json"));
        assert!(!is_json_type("text/plain"));
        assert!(!is_json_type("application/jsonp"));
        assert!(accepts_json("*/*"));
        assert!(accepts_json("text/html, application/json;q=0.5"));
        assert!(accepts_json("application/*"));
        assert!(!accepts_json("text/html"));
        assert!(!accepts_json("application/json;q=0"));
    }
}
