//! The one error envelope of kiln's HTTP faces, and the middleware that gives the router's
//! own error answers (an unknown route, a 405 with its `Allow`, ...) the same shape:
//!
//! ```json
//! {"error": {"code": "BODY_TOO_LARGE", "message": "the body is larger than 1048576 bytes",
//!            "details": {}, "request_id": "rest-66a1-7"}}
//! ```
//!
//! `code` is stable and upper snake case, `message` is one line for people, `details` is
//! always an object (for programs; often empty), and `request_id` is there when the face
//! knows one. A face whose protocol fixes more members (the runner's `field` and top-level
//! `requestId`) adds them with [`HttpError::with_member`] and [`HttpError::with_sibling`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value};

/// An error a face answers itself: a status, a stable code, a message, details, and the
/// request id when known. Boxed, so a `Result<_, HttpError>` stays one pointer wide.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpError(Box<Fields>);

#[derive(Debug, Clone, PartialEq)]
struct Fields {
    status: StatusCode,
    code: &'static str,
    message: String,
    details: Map<String, Value>,
    request_id: Option<String>,
    /// Further members of the `error` object (a protocol's own, such as `field`).
    members: Map<String, Value>,
    /// Members beside `error` at the top of the body (a protocol's own, such as `requestId`).
    siblings: Map<String, Value>,
    headers: HeaderMap,
}

impl HttpError {
    /// An error with empty details and no request id.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> HttpError {
        HttpError(Box::new(Fields {
            status,
            code,
            message: message.into(),
            details: Map::new(),
            request_id: None,
            members: Map::new(),
            siblings: Map::new(),
            headers: HeaderMap::new(),
        }))
    }

    /// 413 `BODY_TOO_LARGE`: the body is over `limit_bytes`.
    pub fn body_too_large(limit_bytes: usize) -> HttpError {
        HttpError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "BODY_TOO_LARGE",
            format!("the body is larger than {limit_bytes} bytes"),
        )
    }

    /// 400 `MALFORMED_JSON`: the body is not JSON.
    pub fn malformed_json(error: &serde_json::Error) -> HttpError {
        HttpError::new(
            StatusCode::BAD_REQUEST,
            "MALFORMED_JSON",
            format!("the body is not valid JSON: {error}"),
        )
    }

    /// Details for programs. An object is kept as it is; `null` is `{}`; any other value is
    /// `{"value": ...}`, so `details` is always an object.
    pub fn with_details(mut self, details: Value) -> HttpError {
        self.0.details = match details {
            Value::Object(map) => map,
            Value::Null => Map::new(),
            other => Map::from_iter([("value".to_owned(), other)]),
        };
        self
    }

    /// The request this error answers (written as `error.request_id`).
    pub fn with_request_id(mut self, request_id: impl Into<String>) -> HttpError {
        self.0.request_id = Some(request_id.into());
        self
    }

    /// A further member of the `error` object, for a protocol that fixes one (the runner's
    /// `field`). The envelope's own members (`code`, `message`, `details`, `request_id`)
    /// win over a member of the same name.
    pub fn with_member(mut self, name: &str, value: impl Into<Value>) -> HttpError {
        self.0.members.insert(name.to_owned(), value.into());
        self
    }

    /// A member beside `error` at the top of the body, for a protocol that fixes one (the
    /// runner's `requestId`). `error` itself cannot be replaced.
    pub fn with_sibling(mut self, name: &str, value: impl Into<Value>) -> HttpError {
        self.0.siblings.insert(name.to_owned(), value.into());
        self
    }

    /// A header sent with the error (`Allow`, `WWW-Authenticate`, ...).
    pub fn with_header(mut self, name: HeaderName, value: HeaderValue) -> HttpError {
        self.0.headers.insert(name, value);
        self
    }

    /// A `Retry-After` of `seconds` (at least 1).
    pub fn retry_after(self, seconds: u64) -> HttpError {
        self.with_header(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)))
    }

    pub fn status(&self) -> StatusCode {
        self.0.status
    }

    pub fn code(&self) -> &'static str {
        self.0.code
    }

    pub fn message(&self) -> &str {
        &self.0.message
    }

    pub fn details(&self) -> &Map<String, Value> {
        &self.0.details
    }

    pub fn request_id(&self) -> Option<&str> {
        self.0.request_id.as_deref()
    }

    /// The JSON body: `{"error": {"code", "message", "details", "request_id"?, ...}, ...}`.
    pub fn body(&self) -> Value {
        let mut error = self.0.members.clone();
        error.insert("code".to_owned(), Value::from(self.0.code));
        error.insert("message".to_owned(), Value::from(self.0.message.as_str()));
        error.insert("details".to_owned(), Value::Object(self.0.details.clone()));
        match &self.0.request_id {
            Some(id) => error.insert("request_id".to_owned(), Value::from(id.as_str())),
            None => error.remove("request_id"),
        };
        let mut body = self.0.siblings.clone();
        body.insert("error".to_owned(), Value::Object(error));
        Value::Object(body)
    }
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.0.status.as_u16(),
            self.0.code,
            self.0.message
        )
    }
}

impl std::error::Error for HttpError {}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let body = self.body();
        let Fields {
            status,
            code,
            headers,
            ..
        } = *self.0;
        let mut response = (status, axum::Json(body)).into_response();
        response.headers_mut().extend(headers);
        response.extensions_mut().insert(ErrorCode(code));
        response
    }
}

/// The code of an error response a face made itself ([`HttpError`] inserts it), for logs
/// and metrics. [`reshape_errors`] leaves such a response as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorCode(pub &'static str);

/// Marks a response a face made itself that is not an [`HttpError`] (a plan's own 404, a
/// 503 health answer): [`reshape_errors`] leaves it as it is.
#[derive(Debug, Clone, Copy)]
pub struct Answered;

/// `response`, marked [`Answered`].
pub fn answered(mut response: Response) -> Response {
    response.extensions_mut().insert(Answered);
    response
}

/// The largest request body of a face, put in each request's extensions by
/// [`reshape_errors`]; the [`Json`](crate::Json) extractor and the 413 message read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyLimit(pub usize);

/// The caller's `X-Request-ID` when it is usable: 1 to 128 of `[A-Za-z0-9-_.:]`.
pub fn given_request_id(headers: &HeaderMap) -> Option<String> {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            !v.is_empty()
                && v.len() <= 128
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
        })
        .map(str::to_owned)
}

/// One error [`reshape_errors`] gave the envelope, for a face's log line.
#[derive(Debug)]
pub struct ReshapedError<'a> {
    pub method: &'a Method,
    pub path: &'a str,
    pub status: StatusCode,
    pub code: &'static str,
    pub request_id: Option<&'a str>,
    pub elapsed: Duration,
}

type NewRequestId = Arc<dyn Fn() -> String + Send + Sync>;
type OnError = Arc<dyn Fn(&ReshapedError<'_>) + Send + Sync>;

/// What differs between faces in [`reshape_errors`]: the body limit (for requests'
/// [`BodyLimit`] and the 413 message), whether errors carry a request id, and a log hook.
#[derive(Clone)]
pub struct RouterErrors {
    max_body_bytes: usize,
    new_request_id: Option<NewRequestId>,
    on_error: Option<OnError>,
}

impl std::fmt::Debug for RouterErrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterErrors")
            .field("max_body_bytes", &self.max_body_bytes)
            .field("request_ids", &self.new_request_id.is_some())
            .field("on_error", &self.on_error.is_some())
            .finish()
    }
}

impl RouterErrors {
    /// Errors without a request id and without a log hook, for a face whose bodies are at
    /// most `max_body_bytes`.
    pub fn new(max_body_bytes: usize) -> RouterErrors {
        RouterErrors {
            max_body_bytes,
            new_request_id: None,
            on_error: None,
        }
    }

    /// Reshaped errors carry a request id, sent back in `X-Request-ID` too: the caller's
    /// ([`given_request_id`]), else a fresh one from `new_request_id`.
    pub fn with_request_ids(
        mut self,
        new_request_id: impl Fn() -> String + Send + Sync + 'static,
    ) -> RouterErrors {
        self.new_request_id = Some(Arc::new(new_request_id));
        self
    }

    /// Calls `on_error` for each error reshaped (a face's log line).
    pub fn on_error(
        mut self,
        on_error: impl Fn(&ReshapedError<'_>) + Send + Sync + 'static,
    ) -> RouterErrors {
        self.on_error = Some(Arc::new(on_error));
        self
    }

    pub fn max_body_bytes(&self) -> usize {
        self.max_body_bytes
    }

    /// The envelope's code and message for an error status the router answered itself.
    fn code_and_message(
        &self,
        status: StatusCode,
        method: &Method,
        path: &str,
    ) -> (&'static str, String) {
        let reason = status
            .canonical_reason()
            .unwrap_or("the request was refused");
        match status {
            StatusCode::METHOD_NOT_ALLOWED => (
                "METHOD_NOT_ALLOWED",
                format!("{method} is not served on {path}; the Allow header lists what is"),
            ),
            StatusCode::NOT_FOUND => ("NOT_FOUND", format!("no route {path}")),
            StatusCode::PAYLOAD_TOO_LARGE => (
                "BODY_TOO_LARGE",
                format!("the body is larger than {} bytes", self.max_body_bytes),
            ),
            StatusCode::UNSUPPORTED_MEDIA_TYPE => (
                "UNSUPPORTED_MEDIA_TYPE",
                "this content type is not accepted here; send application/json".to_owned(),
            ),
            _ if status.is_server_error() => ("INTERNAL", reason.to_owned()),
            _ => ("INVALID_REQUEST", format!("{method} {path}: {reason}")),
        }
    }
}

/// Middleware (`axum::middleware::from_fn_with_state(errors, reshape_errors)`) that gives
/// every error status the router or an axum extractor answered on its own (404, 405 with
/// its `Allow`, 413, 415, any other 4xx or 5xx) the envelope, keeping its headers. A
/// response marked [`ErrorCode`] or [`Answered`] is left as it is. It also puts the face's
/// [`BodyLimit`] in each request's extensions.
pub async fn reshape_errors(
    State(errors): State<RouterErrors>,
    mut request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let given_id = errors
        .new_request_id
        .as_ref()
        .and_then(|_| given_request_id(request.headers()));
    request
        .extensions_mut()
        .insert(BodyLimit(errors.max_body_bytes));
    let response = next.run(request).await;
    let status = response.status();
    let marked = response.extensions().get::<ErrorCode>().is_some()
        || response.extensions().get::<Answered>().is_some();
    if status.as_u16() < 400 || marked {
        return response;
    }
    let request_id = given_id.or_else(|| errors.new_request_id.as_ref().map(|new| new()));
    let (code, message) = errors.code_and_message(status, &method, &path);
    let mut error = HttpError::new(status, code, message);
    if let Some(id) = &request_id {
        error = error.with_request_id(id.as_str());
    }
    let shaped = with_router_headers(error.into_response(), response, request_id.as_deref());
    let shaped = if method == Method::HEAD {
        shaped.map(|_| Body::empty())
    } else {
        shaped
    };
    if let Some(on_error) = &errors.on_error {
        on_error(&ReshapedError {
            method: &method,
            path: &path,
            status,
            code,
            request_id: request_id.as_deref(),
            elapsed: started.elapsed(),
        });
    }
    shaped
}

/// `shaped` with what the router said besides the body (`Allow`, ...) and the request id.
fn with_router_headers(
    mut shaped: Response,
    original: Response,
    request_id: Option<&str>,
) -> Response {
    let (parts, _) = original.into_parts();
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            shaped.headers_mut().insert(name.clone(), value.clone());
        }
    }
    if let Some(value) = request_id.and_then(|id| HeaderValue::from_str(id).ok()) {
        shaped.headers_mut().insert("x-request-id", value);
    }
    shaped
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};

    use axum::Router;
    use axum::routing::{get, post};
    use serde_json::json;
    use tower::ServiceExt;

    use super::*;

    async fn call(router: Router, request: Request) -> (StatusCode, HeaderMap, Value) {
        let response = router.oneshot(request).await.unwrap();
        let (parts, body) = response.into_parts();
        let bytes = axum::body::to_bytes(body, 1 << 20).await.unwrap();
        let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (parts.status, parts.headers, json)
    }

    fn request(method: &str, path: &str) -> Request {
        Request::builder()
            .method(method)
            .uri(path)
            .body(Body::empty())
            .unwrap()
    }

    fn routes(errors: RouterErrors) -> Router {
        async fn teapot() -> Response {
            (StatusCode::IM_A_TEAPOT, "short and stout").into_response()
        }
        async fn refused() -> HttpError {
            HttpError::new(StatusCode::CONFLICT, "BUSY", "busy").with_details(json!({"id": 7}))
        }
        async fn plan_404() -> Response {
            answered((StatusCode::NOT_FOUND, "a plan's own 404").into_response())
        }
        async fn limit(request: Request) -> String {
            format!("{:?}", request.extensions().get::<BodyLimit>())
        }
        Router::new()
            .route("/things", get(|| async { "ok" }))
            .route("/teapot", get(teapot))
            .route("/refused", get(refused))
            .route("/plan", get(plan_404))
            .route("/limit", post(limit))
            .layer(axum::middleware::from_fn_with_state(errors, reshape_errors))
    }

    #[test]
    fn the_envelope_has_the_one_shape() {
        let plain = HttpError::new(StatusCode::NOT_FOUND, "NOT_FOUND", "no route /x");
        assert_eq!(
            plain.body(),
            json!({"error": {"code": "NOT_FOUND", "message": "no route /x", "details": {}}})
        );
        let full = HttpError::new(StatusCode::BAD_REQUEST, "INVALID_FIELD", "x is missing")
            .with_details(json!({"field": "x"}))
            .with_request_id("r-1")
            .with_member("field", "x")
            .with_member("code", "NOT_THIS_ONE")
            .with_sibling("requestId", "r-1")
            .with_sibling("error", "not this either");
        assert_eq!(
            full.body(),
            json!({
                "error": {"code": "INVALID_FIELD", "message": "x is missing",
                          "details": {"field": "x"}, "request_id": "r-1", "field": "x"},
                "requestId": "r-1"
            })
        );
        for (given, kept) in [
            (Value::Null, json!({})),
            (json!(3), json!({"value": 3})),
            (json!({"a": 1}), json!({"a": 1})),
        ] {
            let error = HttpError::new(StatusCode::CONFLICT, "X", "x").with_details(given);
            assert_eq!(error.body()["error"]["details"], kept);
        }
    }

    #[tokio::test]
    async fn an_error_answers_its_status_headers_and_code() {
        let error = HttpError::new(StatusCode::TOO_MANY_REQUESTS, "SLOW_DOWN", "later")
            .retry_after(0)
            .with_header(header::ALLOW, HeaderValue::from_static("GET"));
        let response = error.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        assert_eq!(response.headers()[header::ALLOW], "GET");
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
        assert_eq!(
            response.extensions().get::<ErrorCode>(),
            Some(&ErrorCode("SLOW_DOWN"))
        );
    }

    #[tokio::test]
    async fn the_routers_own_errors_get_the_envelope() {
        let router = routes(RouterErrors::new(1024));
        let (status, headers, body) = call(router.clone(), request("DELETE", "/things")).await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(headers[header::ALLOW], "GET,HEAD");
        assert_eq!(headers[header::CONTENT_TYPE], "application/json");
        assert_eq!(
            body,
            json!({"error": {"code": "METHOD_NOT_ALLOWED", "details": {},
                   "message": "DELETE is not served on /things; the Allow header lists what is"}})
        );
        let (status, headers, body) = call(router.clone(), request("GET", "/nowhere")).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(headers.get("x-request-id").is_none());
        assert_eq!(
            body,
            json!({"error": {"code": "NOT_FOUND", "message": "no route /nowhere", "details": {}}})
        );
        let (status, _, body) = call(router.clone(), request("GET", "/teapot")).await;
        assert_eq!(status, StatusCode::IM_A_TEAPOT);
        assert_eq!(
            body["error"],
            json!({"code": "INVALID_REQUEST", "message": "GET /teapot: I'm a teapot", "details": {}})
        );
        // HEAD keeps the status and headers, without a body.
        let response = router.oneshot(request("HEAD", "/nowhere")).await.unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        let bytes = axum::body::to_bytes(response.into_body(), 1024)
            .await
            .unwrap();
        assert!(bytes.is_empty());
    }

    #[tokio::test]
    async fn answers_the_face_made_itself_are_left_alone() {
        let router = routes(RouterErrors::new(1024).with_request_ids(|| "fresh".into()));
        let (status, _, body) = call(router.clone(), request("GET", "/refused")).await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert_eq!(
            body,
            json!({"error": {"code": "BUSY", "message": "busy", "details": {"id": 7}}})
        );
        let response = router.oneshot(request("GET", "/plan")).await.unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        let bytes = axum::body::to_bytes(response.into_body(), 1024)
            .await
            .unwrap();
        assert_eq!(&bytes[..], b"a plan's own 404");
    }

    #[tokio::test]
    async fn request_ids_are_the_callers_or_fresh_and_errors_are_reported() {
        let counter = Arc::new(AtomicU64::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let errors = RouterErrors::new(1024)
            .with_request_ids({
                let counter = counter.clone();
                move || format!("id-{}", counter.fetch_add(1, Ordering::Relaxed))
            })
            .on_error({
                let seen = seen.clone();
                move |e: &ReshapedError<'_>| {
                    let line = (e.method.to_string(), e.path.to_owned(), e.status, e.code);
                    seen.lock()
                        .unwrap()
                        .push((line, e.request_id.map(str::to_owned)));
                }
            });
        let router = routes(errors);
        let (_, headers, body) = call(router.clone(), request("GET", "/things")).await;
        assert_eq!(body, Value::Null, "a success is not touched");
        assert!(headers.get("x-request-id").is_none());
        assert_eq!(
            counter.load(Ordering::Relaxed),
            0,
            "no id made for a success"
        );

        let (_, headers, body) = call(router.clone(), request("GET", "/nowhere")).await;
        assert_eq!(body["error"]["request_id"], "id-0");
        assert_eq!(headers["x-request-id"], "id-0");

        let given = Request::get("/nowhere")
            .header("x-request-id", "req-42")
            .body(Body::empty())
            .unwrap();
        let (_, headers, body) = call(router.clone(), given).await;
        assert_eq!(body["error"]["request_id"], "req-42");
        assert_eq!(headers["x-request-id"], "req-42");

        let unusable = Request::get("/nowhere")
            .header("x-request-id", "has space")
            .body(Body::empty())
            .unwrap();
        let (_, _, body) = call(router, unusable).await;
        assert_eq!(body["error"]["request_id"], "id-1");

        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 3);
        assert_eq!(
            seen[0],
            (
                (
                    "GET".to_owned(),
                    "/nowhere".to_owned(),
                    StatusCode::NOT_FOUND,
                    "NOT_FOUND"
                ),
                Some("id-0".to_owned())
            )
        );
    }

    #[tokio::test]
    async fn requests_carry_the_body_limit() {
        let router = routes(RouterErrors::new(4096));
        let request = Request::post("/limit").body(Body::empty()).unwrap();
        let response = router.oneshot(request).await.unwrap();
        let bytes = axum::body::to_bytes(response.into_body(), 1024)
            .await
            .unwrap();
        assert_eq!(&bytes[..], b"Some(BodyLimit(4096))");
    }

    #[test]
    fn only_usable_request_ids_are_taken() {
        let mut headers = HeaderMap::new();
        assert_eq!(given_request_id(&headers), None);
        for (given, taken) in [
            ("abc-1_2.3:4", Some("abc-1_2.3:4")),
            ("", None),
            ("a b", None),
            ("ü", None),
        ] {
            let value = HeaderValue::from_bytes(given.as_bytes()).unwrap();
            headers.insert("x-request-id", value);
            assert_eq!(given_request_id(&headers).as_deref(), taken, "{given:?}");
        }
        headers.insert(
            "x-request-id",
            HeaderValue::from_str(&"a".repeat(129)).unwrap(),
        );
        assert_eq!(given_request_id(&headers), None);
    }
}
