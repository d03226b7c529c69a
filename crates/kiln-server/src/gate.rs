//! What every request passes through: a request id, authentication, the per-key rate limit,
//! the request timeout, one JSON log line and the metrics. Logs carry the method, the route
//! pattern, the status, the latency, the key id and the request id; never headers, bodies,
//! query strings or keys.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::AppState;
use crate::auth::{Auth, Caller};
use crate::error::{ApiError, ErrorCode};

/// Paths anyone may read without a key.
const PUBLIC: &[&str] = &[
    "/healthz",
    "/readyz",
    "/metrics",
    "/openapi.json",
    "/docs",
    "/redoc",
];

/// The request id of a request (also sent back as `x-request-id`).
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

/// A token bucket per key: `rate` requests a second, bursts up to twice that.
#[derive(Debug)]
pub struct RateLimiter {
    rate: f64,
    buckets: Mutex<HashMap<String, (f64, Instant)>>,
}

impl RateLimiter {
    /// A limiter allowing `rate` requests a second per key; 0 means no limit.
    pub fn new(rate: u32) -> RateLimiter {
        RateLimiter {
            rate: f64::from(rate),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes a token for `key`; `Err(seconds to wait)` when there is none.
    pub fn take(&self, key: &str) -> Result<(), f64> {
        if self.rate <= 0.0 {
            return Ok(());
        }
        let burst = self.rate * 2.0;
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let (tokens, last) = buckets.entry(key.to_owned()).or_insert((burst, now));
        *tokens = (*tokens + now.duration_since(*last).as_secs_f64() * self.rate).min(burst);
        *last = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err((1.0 - *tokens) / self.rate)
        }
    }
}

/// The caller's `x-request-id` when it is a sane token (kiln-http's rule, shared by every
/// face), else a new one.
fn request_id_of(request: &Request) -> String {
    kiln_http::error::given_request_id(request.headers())
        .unwrap_or_else(|| crate::sandbox::new_id("req_"))
}

fn presented_key(request: &Request) -> Option<&str> {
    let headers = request.headers();
    if let Some(value) = headers.get("authorization").and_then(|v| v.to_str().ok()) {
        let value = value.trim();
        return value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .map(str::trim);
    }
    headers.get("x-api-key").and_then(|v| v.to_str().ok())
}

pub(crate) fn check_key(state: &AppState, request: &Request) -> Result<Caller, ApiError> {
    match &state.auth {
        Auth::Off => Ok(Caller::local()),
        Auth::Keys(store) => {
            let Some(key) = presented_key(request) else {
                return Err(ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "UNAUTHORIZED",
                    "this server needs an API key: send `Authorization: Bearer <key>` (create one with `kiln keys create`)",
                ));
            };
            store.check(key).ok_or_else(|| {
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "UNAUTHORIZED",
                    "the API key is not valid (unknown or revoked)",
                )
            })
        }
    }
}

fn declared_length(request: &Request) -> Option<u64> {
    request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// The key a response was made for, for the access log (`-` when none was checked).
#[derive(Debug, Clone)]
pub struct KeyId(pub String);

/// The route a response answered, where an inner router matched it (the E2B facade's
/// planes): it names the route in logs and metrics instead of `unmatched`.
#[derive(Debug, Clone)]
pub struct RouteLabel(pub String);

/// The route the response names, else the one the request matched.
fn answered_route(route: String, response: &Response) -> String {
    response
        .extensions()
        .get::<RouteLabel>()
        .map_or(route, |label| label.0.clone())
}

/// The route pattern a request matched (`unmatched` for none): metrics and logs name
/// patterns, never raw paths.
fn route_of(request: &Request) -> String {
    request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned())
}

// The layers, outermost first, as `router` stacks them: request_id, access_log, metrics,
// authenticate, rate_limit, body_limit, timeout. Each does one thing.

/// Gives the request its id (the client's `x-request-id` when it is a sane token, else a new
/// one) as a [`RequestId`] extension, and sends it back in `x-request-id`.
pub async fn request_id(mut request: Request, next: Next) -> Response {
    let id = request_id_of(&request);
    request.extensions_mut().insert(RequestId(id.clone()));
    let mut response = next.run(request).await;
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

/// One JSON log line per request: method, route pattern, status, latency, key id, request
/// id and error code; never headers, bodies, query strings or keys.
pub async fn access_log(request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let route = route_of(&request);
    let id = request
        .extensions()
        .get::<RequestId>()
        .map_or_else(String::new, |r| r.0.clone());
    let response = next.run(request).await;
    let route = answered_route(route, &response);
    let key = response
        .extensions()
        .get::<KeyId>()
        .map_or("-", |k| k.0.as_str());
    tracing::info!(
        target: "kiln::http",
        request_id = %id,
        method = %method,
        route = %route,
        status = response.status().as_u16(),
        ms = started.elapsed().as_secs_f64() * 1000.0,
        key = %key,
        error = response.extensions().get::<ErrorCode>().map_or("", |c| c.0),
        "request"
    );
    response
}

/// Counts the request (by method, route pattern and status), its latency and its error
/// code in the metrics.
pub async fn metrics(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let route = route_of(&request);
    let response = next.run(request).await;
    let route = answered_route(route, &response);
    let metrics = &state.runtime.metrics;
    metrics.request(
        method.as_str(),
        &route,
        response.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    if let Some(code) = response.extensions().get::<ErrorCode>() {
        metrics.error(code.0);
    }
    response
}

/// Checks the API key (every path but the public ones) and puts its [`Caller`] on the
/// request; 401 with `WWW-Authenticate: Bearer` otherwise.
pub async fn authenticate(
    State(state): State<Arc<AppState>>,
    mut request: Request,
    next: Next,
) -> Response {
    // A preview by host name is the box's server's whole site, answered here.
    if let Some(domain) = &state.preview_domain
        && let Some((id, port)) = crate::preview::host_target(request.headers(), domain)
    {
        return crate::preview::by_host(&state, request, &id, port).await;
    }
    let path = request.uri().path();
    if PUBLIC.contains(&path) || path.starts_with("/docs/") || path.starts_with("/redoc/") {
        return next.run(request).await;
    }
    if path.starts_with("/terminal/assets/") {
        return next.run(request).await;
    }
    // The console's page and files: public, like the API docs; it calls the API with the
    // key the person gives it.
    if path == "/console" || path.starts_with("/console/") {
        return next.run(request).await;
    }
    // A terminal's page: the owner's key or a link's token for this very terminal.
    if path.starts_with("/terminal/") {
        let Some(caller) = crate::terminals::page_caller(&state, &request) else {
            let id = crate::terminals::parse_path(path).map_or("?", |(id, _)| id);
            return crate::preview::not_found(id);
        };
        let key = KeyId(caller.key_id.clone());
        request.extensions_mut().insert(caller);
        let mut response = next.run(request).await;
        response.extensions_mut().insert(key);
        return response;
    }
    // A static site: the owner's key, or a link's token for a folder of this sandbox.
    if path.starts_with("/site/") {
        let Some((caller, scope)) = crate::site::caller(&state, &request) else {
            return crate::preview::not_found(crate::site::parse_path(path).unwrap_or("?"));
        };
        let key = KeyId(caller.key_id.clone());
        request.extensions_mut().insert(caller);
        if let Some(scope) = scope {
            request.extensions_mut().insert(scope);
        }
        let mut response = next.run(request).await;
        response.extensions_mut().insert(key);
        return response;
    }
    // A preview: the owner's key or a token for this sandbox and port; anything else is
    // told the sandbox does not exist.
    if path.starts_with("/preview/") {
        let Some(caller) = crate::preview::preview_caller(&state, &request) else {
            let id = crate::preview::parse_path(path).map_or("?", |(id, _, _)| id);
            return crate::preview::not_found(id);
        };
        let key = KeyId(caller.key_id.clone());
        request.extensions_mut().insert(caller);
        let mut response = next.run(request).await;
        response.extensions_mut().insert(key);
        return response;
    }
    match check_key(&state, &request) {
        Err(error) => {
            let mut response = error.into_response();
            response
                .headers_mut()
                .insert("www-authenticate", HeaderValue::from_static("Bearer"));
            response
        }
        Ok(caller) => {
            let key = KeyId(caller.key_id.clone());
            request.extensions_mut().insert(caller);
            let mut response = next.run(request).await;
            response.extensions_mut().insert(key);
            response
        }
    }
}

/// The per-key rate limit: 429 `RATE_LIMITED` with `Retry-After` when the key's bucket is
/// empty. Requests without a key (the public paths) are not limited.
pub async fn rate_limit(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let waited = request
        .extensions()
        .get::<Caller>()
        .map(|caller| state.limiter.take(&caller.key_id));
    let Some(Err(wait)) = waited else {
        return next.run(request).await;
    };
    // The refused request's body is read first (a little of it, briefly): answering before
    // it and closing would break a client still sending it (a broken pipe, not a 429).
    let _ = tokio::time::timeout(
        Duration::from_secs(2),
        axum::body::to_bytes(request.into_body(), 1 << 20),
    )
    .await;
    let seconds = wait.ceil().max(1.0) as u64;
    let mut response = ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "RATE_LIMITED",
        format!("too many requests for this key; retry in {seconds} s"),
    )
    .with_details(json!({ "retryAfterSeconds": seconds }))
    .into_response();
    if let Ok(value) = HeaderValue::from_str(&seconds.to_string()) {
        response.headers_mut().insert("retry-after", value);
    }
    response
}

/// Refuses a body declared larger than the limit before it is read, so the client (with
/// `Expect: 100-continue`, before it even sends it) learns at once and no bandwidth is spent.
pub async fn body_limit(request: Request, next: Next) -> Response {
    if declared_length(&request).is_some_and(|n| n > crate::MAX_BODY_BYTES as u64) {
        return ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "BODY_TOO_LARGE",
            format!(
                "the body is larger than the limit of {} MiB",
                crate::MAX_BODY_BYTES >> 20
            ),
        )
        .into_response();
    }
    next.run(request).await
}

/// Answers 408 `REQUEST_TIMEOUT` when the request takes longer than the server's limit.
pub async fn timeout(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    match tokio::time::timeout(state.request_timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "REQUEST_TIMEOUT",
            format!(
                "the request took longer than {} s",
                state.request_timeout.as_secs()
            ),
        )
        .into_response(),
    }
}

/// Default time a request may take before it is answered with 408: 10 minutes (an
/// execution may run 5).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

/// Gives every error the router or an extractor answered on its own (405 with its `Allow`
/// header, 413, 415, a WebSocket upgrade refused, ...) the one envelope, with kiln-http's
/// [`reshape_errors`](kiln_http::error::reshape_errors). Errors kiln made itself carry an
/// [`ErrorCode`] and pass untouched, as does everything under `/mcp` (JSON-RPC has its own
/// error shape).
pub async fn json_errors(
    State(errors): State<kiln_http::error::RouterErrors>,
    request: Request,
    next: Next,
) -> Response {
    // MCP has JSON-RPC's error shape; a preview answers what the box's server answers.
    if request.uri().path().starts_with("/mcp") || request.uri().path().starts_with("/preview/") {
        return next.run(request).await;
    }
    kiln_http::error::reshape_errors(State(errors), request, next).await
}

/// Who opened each MCP session on `/mcp` (its `Mcp-Session-Id`), so another tenant can neither
/// use nor close it: for them it does not exist (404, as for an unknown session).
#[derive(Debug, Default)]
pub struct McpSessionOwners {
    owners: std::sync::Mutex<HashMap<String, (String, Instant)>>,
}

/// Sessions remembered at most; past it, those older than a day are forgotten.
const MAX_MCP_SESSIONS: usize = 10_000;

impl McpSessionOwners {
    fn owner(&self, session: &str) -> Option<String> {
        let owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        owners.get(session).map(|(tenant, _)| tenant.clone())
    }

    fn insert(&self, session: String, tenant: String) {
        let mut owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        if owners.len() >= MAX_MCP_SESSIONS {
            owners.retain(|_, (_, at)| at.elapsed() < Duration::from_secs(24 * 3600));
        }
        owners.insert(session, (tenant, Instant::now()));
    }

    fn remove(&self, session: &str) {
        let mut owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        owners.remove(session);
    }
}

/// Binds MCP sessions to the tenant that opened them (runs after authentication).
pub async fn bind_mcp_sessions(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    if !request.uri().path().starts_with("/mcp") {
        return next.run(request).await;
    }
    let tenant = request
        .extensions()
        .get::<Caller>()
        .map(|c| c.tenant.clone())
        .unwrap_or_default();
    let session = request
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if let Some(session) = &session
        && let Some(owner) = state.mcp_sessions.owner(session)
        && owner != tenant
    {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "SESSION_NOT_FOUND",
            "no such MCP session",
        )
        .into_response();
    }
    let closing = request.method() == axum::http::Method::DELETE;
    let response = next.run(request).await;
    if let Some(opened) = response
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        && session.as_deref() != Some(opened)
    {
        state.mcp_sessions.insert(opened.to_owned(), tenant);
    }
    if closing
        && response.status().is_success()
        && let Some(session) = &session
    {
        state.mcp_sessions.remove(session);
    }
    response
}

/// The sandbox a path names: `/api/v1/sandboxes/{id}…`, `/api/sandbox/{id}…` (not
/// `/api/sandbox/exec`, whose sandbox is in its body), `/preview/{id}/…`, `/terminal/{id}/…`,
/// `/site/{id}…`.
pub fn sandbox_in_path(path: &str) -> Option<&str> {
    let rest = [
        "/api/v1/sandboxes/",
        "/api/sandbox/",
        "/preview/",
        "/terminal/",
        "/site/",
    ]
    .iter()
    .find_map(|prefix| path.strip_prefix(prefix))?;
    let id = rest.split('/').next().filter(|id| !id.is_empty())?;
    (id != "exec" || !path.starts_with("/api/sandbox/")).then_some(id)
}

/// A workspace's sandbox answers only its owner and its write collaborators (workspaces
/// are private within a tenant): to other keys of the tenant it does not exist, on every
/// route that names a sandbox in its path (the listing leaves it out; MCP and the seed
/// exec route check their arguments).
pub async fn workspace_guard(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(caller) = request.extensions().get::<Caller>()
        && let Some(id) = sandbox_in_path(request.uri().path())
        && !state
            .runtime
            .registry
            .workspaces
            .may_use_sandbox(caller, id)
    {
        return crate::preview::not_found(id);
    }
    next.run(request).await
}

#[cfg(test)]
mod workspace_paths {
    use super::sandbox_in_path;

    #[test]
    fn the_sandbox_a_path_names() {
        for (path, id) in [
            ("/api/v1/sandboxes/sb_1", Some("sb_1")),
            ("/api/v1/sandboxes/sb_1/files/a/b", Some("sb_1")),
            ("/api/sandbox/sb_2/history", Some("sb_2")),
            ("/api/sandbox/exec", None),
            ("/preview/sb_3/8080/", Some("sb_3")),
            ("/terminal/sb_4/t1/", Some("sb_4")),
            ("/site/sb_5", Some("sb_5")),
            ("/api/v1/sandboxes", None),
            ("/api/v1/sandboxes/", None),
            ("/api/v1/workspaces/ws_1", None),
        ] {
            assert_eq!(sandbox_in_path(path), id, "{path}");
        }
    }
}
