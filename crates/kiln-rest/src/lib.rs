//! `kiln rest`: a REST service with no endpoints declared. Every request (any method, any
//! path) is planned — by an LLM, or offline by the conventions planner — into Python code
//! that runs in the tenant's sandbox session over its JSON collections.
//!
//! The steps of one request:
//! 1. The host builds a context (method, path, segments, query, headers without credentials,
//!    body, client ip, tenant) and takes the tenant's session (one per tenant, one request at
//!    a time in it, so no write is ever lost to a race).
//! 2. A plan cached for the request's shape is reused; otherwise the driver in the session
//!    asks the planner. The LLM planner reaches the model only through the door, granted to
//!    the planning turn alone; the provider key stays in this process.
//! 3. The plan's code is checked (AST allowlist) and run with the door shut, and the REPLY it
//!    assigned becomes the HTTP response.

pub mod plans;
mod python;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use kiln_core::{ExecRequest, ExecResult, Language, Limits, Mount, Outcome};
use kiln_executor::{CallOptions, Door, ExecutorPool, PoolError, SessionHandle};
use kiln_llm::{ChatModel, Message, ModelRequest, RetryPolicy, Usage};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

pub use plans::{PlanCache, TenantPlans};

/// Who plans requests.
#[derive(Clone)]
pub enum Planner {
    /// Plain REST conventions, no LLM: deterministic and offline.
    Conventions,
    /// A model from the LLM layer, reached through the door.
    Llm {
        model: Arc<dyn ChatModel>,
        timeout: Duration,
        retry: RetryPolicy,
    },
}

impl Planner {
    /// How logs and the `X-Kiln-Planner` header name it.
    pub fn label(&self) -> String {
        match self {
            Planner::Conventions => CONVENTIONS_LABEL.to_string(),
            Planner::Llm { model, .. } => format!("llm {}", model.name()),
        }
    }
}

const CONVENTIONS_LABEL: &str = "conventions (not an LLM)";

/// How `kiln rest` runs.
#[derive(Clone)]
pub struct RestConfig {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    pub planner: Planner,
    /// Every request must carry `Authorization: Bearer <token>` when set.
    pub auth_token: Option<String>,
    /// How long a plan's code may run per request.
    pub deadline: Duration,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Largest response (as the driver reports it).
    pub max_result_bytes: u64,
    /// Memory cap of each tenant's sandbox.
    pub memory_bytes: u64,
    /// Reuse plans marked generic (on by default; off to watch the planner at work).
    pub plan_cache: bool,
    /// A tenant's session idle this long is closed (its data stays).
    pub idle_timeout: Duration,
}

impl RestConfig {
    pub fn new(listen: SocketAddr, data_dir: PathBuf, planner: Planner) -> RestConfig {
        RestConfig {
            listen,
            data_dir,
            planner,
            auth_token: None,
            deadline: Duration::from_secs(10),
            max_body_bytes: 1 << 20,
            max_result_bytes: 4 << 20,
            memory_bytes: 256 << 20,
            plan_cache: true,
            idle_timeout: Duration::from_secs(300),
        }
    }
}

/// A tenant's session (one request at a time holds it) and when it was last used.
#[derive(Default)]
struct TenantSlot {
    session: tokio::sync::Mutex<Option<SessionHandle>>,
    /// Milliseconds since the server started.
    last_used_ms: AtomicU64,
}

type Slot = Arc<TenantSlot>;

struct App {
    config: RestConfig,
    pool: Arc<ExecutorPool>,
    plans: PlanCache,
    tenants: Mutex<HashMap<String, Slot>>,
    next_request: AtomicU64,
    open_sessions: AtomicU32,
    started: Instant,
}

/// Serves until SIGTERM or Ctrl-C; running requests finish first.
pub async fn serve(config: RestConfig, pool: Arc<ExecutorPool>) -> std::io::Result<()> {
    std::fs::create_dir_all(config.data_dir.join("tenants"))?;
    let plans = PlanCache::new(config.data_dir.join("plans"))?;
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    let app = Arc::new(App {
        config,
        pool,
        plans,
        tenants: Mutex::default(),
        next_request: AtomicU64::new(1),
        open_sessions: AtomicU32::new(0),
        started: Instant::now(),
    });
    eprintln!(
        "kiln rest: listening on http://{} (planner: {}; auth: {}; data: {})",
        listener.local_addr()?,
        app.config.planner.label(),
        if app.config.auth_token.is_some() {
            "bearer token"
        } else {
            "off"
        },
        app.config.data_dir.display()
    );
    let flusher = app.clone();
    let flush_task = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let app = flusher.clone();
            let _ = tokio::task::spawn_blocking({
                let app = app.clone();
                move || app.plans.flush()
            })
            .await;
            app.close_idle().await;
        }
    });
    axum::serve(
        listener,
        router(app.clone()).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(kiln_server::shutdown_signal())
    .await?;
    flush_task.abort();
    app.plans.flush();
    Ok(())
}

fn router(app: Arc<App>) -> Router {
    use kiln_server::openapi as docs;
    Router::new()
        .route("/healthz", get(healthz))
        .route("/openapi.json", get(openapi))
        .route("/docs", get(docs::swagger_page))
        .route("/docs/swagger-ui-bundle.js", get(docs::swagger_js))
        .route("/docs/swagger-ui.css", get(docs::swagger_css))
        .route("/redoc", get(docs::redoc_page))
        .route("/redoc/redoc.standalone.js", get(docs::redoc_js))
        .fallback(handle)
        .with_state(app)
}

async fn healthz(State(app): State<Arc<App>>) -> Response {
    let (hits, misses) = app.plans.totals();
    let rate = if hits + misses == 0 {
        0.0
    } else {
        hits as f64 / (hits + misses) as f64
    };
    let workers = app.pool.worker_pids().len();
    let status = if workers > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": if workers > 0 { "ok" } else { "no executor workers" },
        "planner": app.config.planner.label(),
        "workers": workers,
        "tenant_sessions": app.open_sessions.load(Ordering::Relaxed),
        "plan_cache": {"hits": hits, "misses": misses, "hit_rate": rate},
    });
    (status, axum::Json(body)).into_response()
}

async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        openapi_spec().to_string(),
    )
        .into_response()
}

/// An error answered by kiln itself (not by a plan).
#[derive(Debug)]
struct RestError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl RestError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> RestError {
        RestError {
            status,
            code,
            message: message.into(),
        }
    }
}

/// What one request did, for its log line and diagnostic headers.
#[derive(Default)]
struct Trace {
    tenant: String,
    planner: String,
    cache: &'static str,
    outcome: String,
    usage: Option<Usage>,
    /// The plan pattern that answered (cached or stored).
    pattern: Option<String>,
}

const METHODS: [Method; 7] = [
    Method::GET,
    Method::POST,
    Method::PUT,
    Method::PATCH,
    Method::DELETE,
    Method::OPTIONS,
    Method::HEAD,
];

async fn handle(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: Request,
) -> Response {
    let started = Instant::now();
    let request_id = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            !v.is_empty()
                && v.len() <= 128
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
        })
        .map_or_else(
            || {
                format!(
                    "rest-{:x}-{}",
                    UNIX_EPOCH.elapsed().map_or(0, |d| d.as_secs()),
                    app.next_request.fetch_add(1, Ordering::Relaxed)
                )
            },
            str::to_string,
        );
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let mut trace = Trace {
        cache: "none",
        ..Trace::default()
    };
    let mut response = match one(&app, request, peer, &request_id, &mut trace).await {
        Ok(response) => {
            trace.outcome = "ok".into();
            response
        }
        Err(error) => {
            trace.outcome = error.code.to_string();
            error_response(&error, &request_id)
        }
    };
    if method == Method::HEAD {
        *response.body_mut() = Body::empty();
    }
    let headers = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        headers.insert("x-request-id", v);
    }
    if !trace.planner.is_empty()
        && let Ok(v) = HeaderValue::from_str(&trace.planner)
    {
        headers.insert("x-kiln-planner", v);
    }
    if trace.cache != "none" {
        headers.insert("x-kiln-plan-cache", HeaderValue::from_static(trace.cache));
    }
    let mut line = json!({
        "ts": SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
        "target": "kiln::rest",
        "request_id": request_id,
        "method": method.as_str(),
        "path": path,
        "status": response.status().as_u16(),
        "ms": (started.elapsed().as_secs_f64() * 1000.0 * 1000.0).round() / 1000.0,
        "tenant": trace.tenant,
        "planner": trace.planner,
        "cache": trace.cache,
        "outcome": trace.outcome,
    });
    if let Some(pattern) = &trace.pattern {
        line["pattern"] = json!(pattern);
    }
    if let Some(usage) = trace.usage {
        line["llm_tokens"] = json!({"input": usage.input_tokens, "output": usage.output_tokens});
    }
    eprintln!("{line}");
    response
}

fn error_response(error: &RestError, request_id: &str) -> Response {
    let body =
        json!({"error": {"code": error.code, "message": error.message, "request_id": request_id}});
    let mut response = (error.status, axum::Json(body)).into_response();
    if error.status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"kiln rest\""),
        );
    }
    response
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// Compares without stopping at the first difference.
fn same_secret(a: &str, b: &str) -> bool {
    let (a, b) = (Sha256::digest(a.as_bytes()), Sha256::digest(b.as_bytes()));
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

fn tenant_of(headers: &HeaderMap) -> Result<String, RestError> {
    if let Some(value) = headers.get("x-session-id") {
        let ok = value.to_str().ok().filter(|v| {
            !v.is_empty()
                && v.len() <= 64
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b))
        });
        return ok.map(str::to_string).ok_or_else(|| {
            RestError::new(
                StatusCode::BAD_REQUEST,
                "INVALID_SESSION_ID",
                "X-Session-ID must be 1 to 64 letters, digits, '_' or '-'",
            )
        });
    }
    if let Some(token) = bearer(headers) {
        return Ok(format!(
            "key-{}",
            &hex::encode(Sha256::digest(token.as_bytes()))[..16]
        ));
    }
    Ok("public".to_string())
}

/// Splits and decodes the path; refuses what no collection could be named by.
fn segments(path: &str) -> Result<Vec<String>, RestError> {
    let bad = |why: &str| RestError::new(StatusCode::BAD_REQUEST, "INVALID_PATH", why.to_string());
    if path.len() > 2048 {
        return Err(bad("the path is longer than 2048 bytes"));
    }
    let mut out = Vec::new();
    for raw in path.split('/').filter(|s| !s.is_empty()) {
        let decoded = percent_encoding::percent_decode_str(raw)
            .decode_utf8()
            .map_err(|_| bad("a path segment is not UTF-8 once decoded"))?;
        if decoded.contains(['\0', '/']) || decoded.chars().any(char::is_control) {
            return Err(bad(
                "a path segment holds a control character or an encoded '/'",
            ));
        }
        if decoded == "." || decoded == ".." {
            return Err(bad("'.' and '..' are not path segments here"));
        }
        out.push(decoded.into_owned());
    }
    if out.len() > 32 {
        return Err(bad("the path has more than 32 segments"));
    }
    Ok(out)
}

fn is_json_type(content_type: Option<&str>) -> bool {
    content_type.is_some_and(|ct| {
        let essence = ct
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        essence == "application/json" || essence.ends_with("+json")
    })
}

/// The context handed to the driver, as JSON text.
fn context(
    parts: &axum::http::request::Parts,
    body: &[u8],
    segments: &[String],
    peer: SocketAddr,
    tenant: &str,
    request_id: &str,
) -> Result<String, RestError> {
    let mut query: serde_json::Map<String, Value> = serde_json::Map::new();
    for (name, value) in form_urlencoded::parse(parts.uri.query().unwrap_or("").as_bytes()) {
        let values = query
            .entry(name.into_owned())
            .or_insert_with(|| Value::Array(Vec::new()));
        if let Value::Array(list) = values {
            list.push(Value::String(value.into_owned()));
        }
    }
    let mut headers: serde_json::Map<String, Value> = serde_json::Map::new();
    for (name, value) in &parts.headers {
        let name = name.as_str();
        if matches!(name, "authorization" | "cookie" | "proxy-authorization") {
            continue;
        }
        if let Ok(value) = value.to_str() {
            let entry = headers
                .entry(name.to_string())
                .or_insert_with(|| Value::String(String::new()));
            if let Value::String(text) = entry {
                if !text.is_empty() {
                    text.push_str(", ");
                }
                text.push_str(value);
            }
        }
    }
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let (json_body, body_text, body_base64) = if body.is_empty() {
        (Value::Null, Value::Null, Value::Null)
    } else if is_json_type(content_type) || content_type.is_none() {
        let parsed: Value = serde_json::from_slice(body).map_err(|e| {
            RestError::new(
                StatusCode::BAD_REQUEST,
                "MALFORMED_JSON",
                format!("the body is not valid JSON: {e}"),
            )
        })?;
        (parsed, Value::Null, Value::Null)
    } else {
        match std::str::from_utf8(body) {
            Ok(text) => (Value::Null, Value::String(text.to_string()), Value::Null),
            Err(_) => {
                use base64::Engine as _;
                let encoded = base64::engine::general_purpose::STANDARD.encode(body);
                (Value::Null, Value::Null, Value::String(encoded))
            }
        }
    };
    let ctx = json!({
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "segments": segments,
        "query": query,
        "headers": headers,
        "body": json_body,
        "body_text": body_text,
        "body_base64": body_base64,
        "client_ip": peer.ip().to_string(),
        "tenant": tenant,
        "request_id": request_id,
    });
    Ok(ctx.to_string())
}

async fn one(
    app: &Arc<App>,
    request: Request,
    peer: SocketAddr,
    request_id: &str,
    trace: &mut Trace,
) -> Result<Response, RestError> {
    let (parts, body) = request.into_parts();
    if !METHODS.contains(&parts.method) {
        return Err(RestError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "METHOD_NOT_ALLOWED",
            format!(
                "{} is not served; use GET, POST, PUT, PATCH, DELETE, OPTIONS or HEAD",
                parts.method
            ),
        ));
    }
    if let Some(token) = &app.config.auth_token {
        match bearer(&parts.headers) {
            Some(given) if same_secret(given, token) => {}
            Some(_) => {
                return Err(RestError::new(
                    StatusCode::UNAUTHORIZED,
                    "UNAUTHORIZED",
                    "the bearer token is not valid",
                ));
            }
            None => {
                return Err(RestError::new(
                    StatusCode::UNAUTHORIZED,
                    "UNAUTHORIZED",
                    "send Authorization: Bearer <token> (the token kiln rest was started with)",
                ));
            }
        }
    }
    let tenant = tenant_of(&parts.headers)?;
    trace.tenant.clone_from(&tenant);
    let segments = segments(parts.uri.path())?;
    let max = app.config.max_body_bytes;
    let too_large = || {
        RestError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "BODY_TOO_LARGE",
            format!("the body is larger than {max} bytes"),
        )
    };
    // Refused from its declared length before it is read; a body without one is cut off
    // at the limit while it is read.
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    let body = axum::body::to_bytes(body, max)
        .await
        .map_err(|_| too_large())?;
    let ctx = context(&parts, &body, &segments, peer, &tenant, request_id)?;
    let method = parts.method.as_str();

    let cached = if app.config.plan_cache {
        app.plans.lookup(&tenant, method, &segments)
    } else {
        None
    };
    let slot = app.slot(&tenant);
    let mut guard = slot.session.lock().await;
    app.touch(&slot);
    let session = app.session(&tenant, &mut guard).await?;
    let answer = match cached {
        Some(entry) => {
            trace.cache = "hit";
            trace.planner = entry.planner;
            trace.pattern = Some(entry.pattern.clone());
            let turn = python::execute(&ctx, &entry.code, Some(&entry.pattern));
            app.turn(&mut guard, &session, turn, None, app.config.deadline)
                .await?
        }
        None => {
            trace.cache = "miss";
            trace.planner = app.config.planner.label();
            let answer = match &app.config.planner {
                Planner::Conventions => {
                    app.turn(
                        &mut guard,
                        &session,
                        python::handle(&ctx),
                        None,
                        app.config.deadline,
                    )
                    .await?
                }
                Planner::Llm {
                    model,
                    timeout,
                    retry,
                } => {
                    let usage = Arc::new(Mutex::new(Usage::default()));
                    let door = llm_door(model.clone(), *timeout, *retry, usage.clone());
                    let planning = *timeout * retry.attempts.max(1)
                        + retry.base_delay * (1 << retry.attempts.min(8))
                        + app.config.deadline;
                    let planned = app
                        .turn(
                            &mut guard,
                            &session,
                            python::plan(&ctx),
                            Some(door),
                            planning,
                        )
                        .await;
                    trace.usage = Some(*usage.lock().unwrap_or_else(|e| e.into_inner()));
                    let planned = planned?;
                    if planned["ok"] != Value::Bool(true) {
                        planned
                    } else {
                        let code = planned["plan"]["code"].as_str().unwrap_or("").to_string();
                        let pattern = planned["plan"]["pattern"].as_str().map(str::to_string);
                        // The door is shut for this turn: the plan's code never reaches
                        // the model or anything else outside.
                        // (A planning turn that ended its session returned an error above.)
                        let turn = python::execute(&ctx, &code, pattern.as_deref());
                        let mut answer = app
                            .turn(&mut guard, &session, turn, None, app.config.deadline)
                            .await?;
                        answer["plan"] = planned["plan"].clone();
                        answer
                    }
                }
            };
            if app.config.plan_cache
                && answer["ok"] == Value::Bool(true)
                && let Some(pattern) = answer["plan"]["pattern"].as_str()
                && let Some(code) = answer["plan"]["code"].as_str()
            {
                // Kept only when the pattern really fits this request.
                if plans::Pattern::parse(pattern).is_some_and(|p| p.matches(method, &segments)) {
                    let planner = app.config.planner.label();
                    let stored = {
                        let app = app.clone();
                        let (tenant, pattern, code) =
                            (tenant.clone(), pattern.to_string(), code.to_string());
                        tokio::task::spawn_blocking(move || {
                            app.plans.insert(&tenant, &pattern, &code, &planner)
                        })
                        .await
                    };
                    if matches!(stored, Ok(Ok(()))) {
                        trace.cache = "stored";
                        trace.pattern = Some(pattern.to_string());
                    }
                }
            }
            answer
        }
    };
    app.touch(&slot);
    drop(guard);
    reply(&answer)
}

/// The HTTP response for the driver's answer.
fn reply(answer: &Value) -> Result<Response, RestError> {
    if answer["ok"] != Value::Bool(true) {
        let status = answer["status"]
            .as_u64()
            .and_then(|s| u16::try_from(s).ok())
            .and_then(|s| StatusCode::from_u16(s).ok())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let code = match answer["code"].as_str().unwrap_or("") {
            "PLAN_INVALID" => "PLAN_INVALID",
            "PLAN_UNSAFE" => "PLAN_UNSAFE",
            "LLM_FAILED" => "LLM_FAILED",
            "PLANNER_UNAVAILABLE" => "PLANNER_UNAVAILABLE",
            "POLICY_VIOLATION" => "POLICY_VIOLATION",
            "CODE_FAILED" => "CODE_FAILED",
            "NO_REPLY" => "NO_REPLY",
            "BAD_REPLY" => "BAD_REPLY",
            _ => "INTERNAL",
        };
        let message = answer["message"].as_str().unwrap_or("the request failed");
        return Err(RestError::new(status, code, message));
    }
    let r = &answer["reply"];
    let status = r["status"]
        .as_u64()
        .and_then(|s| u16::try_from(s).ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| {
            RestError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "BAD_REPLY",
                "the reply has no valid status",
            )
        })?;
    let mut builder = Response::builder().status(status);
    let mut has_type = false;
    if let Some(headers) = r["headers"].as_object() {
        for (name, value) in headers {
            if let (Ok(name), Some(Ok(value))) = (
                HeaderName::from_bytes(name.as_bytes()),
                value.as_str().map(HeaderValue::from_str),
            ) {
                has_type |= name == header::CONTENT_TYPE;
                builder = builder.header(name, value);
            }
        }
    }
    let body = match &r["body"] {
        Value::Null => Body::empty(),
        Value::String(text) => {
            if !has_type {
                builder = builder.header(header::CONTENT_TYPE, "text/plain; charset=utf-8");
            }
            Body::from(text.clone())
        }
        other => {
            if !has_type {
                builder = builder.header(header::CONTENT_TYPE, "application/json");
            }
            Body::from(other.to_string())
        }
    };
    builder.body(body).map_err(|e| {
        RestError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "BAD_REPLY",
            format!("the reply could not be sent: {e}"),
        )
    })
}

/// The door of a planning turn: `{"op": "llm.complete", "system", "user"}` → the model's
/// answer. The model and its key are this process's; the guest names neither. At most two
/// calls per turn.
fn llm_door(
    model: Arc<dyn ChatModel>,
    timeout: Duration,
    retry: RetryPolicy,
    usage: Arc<Mutex<Usage>>,
) -> Door {
    let calls = Arc::new(AtomicU32::new(0));
    Arc::new(move |frame: Vec<u8>| {
        let model = model.clone();
        let usage = usage.clone();
        let call = calls.fetch_add(1, Ordering::Relaxed);
        Box::pin(async move {
            let answer = |value: Value| Ok(value.to_string().into_bytes());
            if call >= 2 {
                return answer(json!({"ok": false, "error": "at most two LLM calls per plan"}));
            }
            let Ok(request) = serde_json::from_slice::<Value>(&frame) else {
                return answer(json!({"ok": false, "error": "the door frame is not JSON"}));
            };
            if request["op"] != "llm.complete" {
                return answer(
                    json!({"ok": false, "error": "the only capability granted is llm.complete"}),
                );
            }
            let (Some(system), Some(user)) = (request["system"].as_str(), request["user"].as_str())
            else {
                return answer(
                    json!({"ok": false, "error": "llm.complete needs system and user text"}),
                );
            };
            if system.len() + user.len() > 256 << 10 {
                return answer(json!({"ok": false, "error": "the prompt is larger than 256 KiB"}));
            }
            let request = ModelRequest {
                messages: vec![Message::system(system), Message::user(user)],
                tools: Vec::new(),
                output_schema: None,
            };
            match kiln_llm::complete_with_retries(model.as_ref(), &request, None, timeout, retry)
                .await
            {
                Ok(reply) => {
                    *usage.lock().unwrap_or_else(|e| e.into_inner()) += reply.usage;
                    answer(json!({
                        "ok": true,
                        "text": reply.text,
                        "usage": {"input_tokens": reply.usage.input_tokens, "output_tokens": reply.usage.output_tokens},
                    }))
                }
                Err(error) => answer(json!({"ok": false, "error": error.to_string()})),
            }
        })
    })
}

impl App {
    fn slot(&self, tenant: &str) -> Slot {
        self.tenants
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(tenant.to_string())
            .or_default()
            .clone()
    }

    fn touch(&self, slot: &TenantSlot) {
        let now = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        slot.last_used_ms.store(now, Ordering::Relaxed);
    }

    /// Closes the sessions of tenants idle longer than `idle_timeout` (their data stays on
    /// disk; the next request opens a fresh session).
    async fn close_idle(&self) {
        let now = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let idle_ms = u64::try_from(self.config.idle_timeout.as_millis()).unwrap_or(u64::MAX);
        let slots: Vec<(String, Slot)> = self
            .tenants
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(t, s)| (t.clone(), s.clone()))
            .collect();
        for (tenant, slot) in slots {
            if now.saturating_sub(slot.last_used_ms.load(Ordering::Relaxed)) < idle_ms {
                continue;
            }
            // A busy tenant is not idle; it is looked at again next time.
            if let Ok(mut guard) = slot.session.try_lock() {
                if guard.is_some() {
                    self.drop_session(&mut guard).await;
                }
                drop(guard);
                let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
                // Forget the slot unless a request took it meanwhile.
                if tenants
                    .get(&tenant)
                    .is_some_and(|s| Arc::strong_count(s) <= 2)
                {
                    tenants.remove(&tenant);
                }
            }
        }
    }

    fn limits(&self, timeout: Duration) -> Limits {
        Limits {
            timeout_ms: u64::try_from(timeout.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
            memory_bytes: self.config.memory_bytes,
            stdout_bytes: self.config.max_result_bytes + (64 << 10),
            stderr_bytes: 64 << 10,
            fs_write_bytes: 256 << 20,
            fs_create_count: 1_000,
        }
    }

    /// The tenant's live session, opened (with the driver loaded) when there is none.
    async fn session(
        &self,
        tenant: &str,
        guard: &mut Option<SessionHandle>,
    ) -> Result<SessionHandle, RestError> {
        if let Some(session) = guard {
            return Ok(*session);
        }
        let lost = |e: PoolError| {
            RestError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "SANDBOX_UNAVAILABLE",
                format!("the tenant's sandbox could not be started: {e}"),
            )
        };
        let dir = self.config.data_dir.join("tenants").join(tenant);
        std::fs::create_dir_all(&dir).map_err(|e| {
            RestError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "STORAGE",
                format!("the tenant's folder could not be made: {e}"),
            )
        })?;
        let guest_root = format!("/data/{tenant}");
        let mut request = ExecRequest::new(Language::Python, "");
        request.limits = self.limits(Duration::from_secs(30));
        request.mounts = vec![Mount {
            host: dir,
            guest: guest_root.clone(),
            writable: true,
        }];
        let session = self.pool.open_session(request).await.map_err(lost)?;
        let loaded = self
            .pool
            .run(
                &session,
                python::loader(&guest_root, tenant),
                self.limits(Duration::from_secs(30)),
            )
            .await
            .map_err(lost)?;
        if !loaded.success() {
            let _ = self.pool.close_session(&session).await;
            return Err(RestError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "SANDBOX_SETUP",
                format!(
                    "the driver could not be loaded: {}",
                    tail(&loaded.stderr_text(), 400)
                ),
            ));
        }
        self.open_sessions.fetch_add(1, Ordering::Relaxed);
        *guard = Some(session);
        Ok(session)
    }

    /// Runs one driver turn and returns its answer. A turn that ends its session (deadline,
    /// crash) closes it; the next request opens a fresh one.
    async fn turn(
        &self,
        guard: &mut Option<SessionHandle>,
        session: &SessionHandle,
        code: String,
        door: Option<Door>,
        timeout: Duration,
    ) -> Result<Value, RestError> {
        let options = CallOptions {
            door,
            ..CallOptions::default()
        };
        let result = self
            .pool
            .run_with(session, code, self.limits(timeout), options)
            .await;
        let result: ExecResult = match result {
            Ok(result) => result,
            Err(error) => {
                self.drop_session(guard).await;
                return Err(RestError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "SANDBOX_LOST",
                    format!("the tenant's sandbox was lost ({error}); retry the request"),
                ));
            }
        };
        let ended = matches!(result.outcome, Outcome::TimedOut | Outcome::Crashed { .. });
        if ended {
            self.drop_session(guard).await;
        }
        match &result.outcome {
            Outcome::TimedOut => {
                return Err(RestError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "DEADLINE_EXCEEDED",
                    format!(
                        "the request ran past its deadline of {} ms and was stopped",
                        timeout.as_millis()
                    ),
                ));
            }
            Outcome::MemoryLimit => {
                self.drop_session(guard).await;
                return Err(RestError::new(
                    StatusCode::INSUFFICIENT_STORAGE,
                    "MEMORY_LIMIT",
                    format!(
                        "the request needed more than the sandbox's {} MiB of memory",
                        self.config.memory_bytes >> 20
                    ),
                ));
            }
            Outcome::Crashed { trap } => {
                return Err(RestError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "SANDBOX_CRASHED",
                    format!("the sandbox crashed ({trap})"),
                ));
            }
            _ => {}
        }
        if result.stdout_truncated {
            return Err(RestError::new(
                StatusCode::BAD_GATEWAY,
                "RESULT_TOO_LARGE",
                format!(
                    "the response is larger than the cap of {} bytes",
                    self.config.max_result_bytes
                ),
            ));
        }
        python::answer(&result.stdout_text()).ok_or_else(|| {
            RestError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "INTERNAL",
                format!(
                    "the driver gave no answer (exit {}): {}",
                    result.exit_code,
                    tail(&result.stderr_text(), 400)
                ),
            )
        })
    }

    async fn drop_session(&self, guard: &mut Option<SessionHandle>) {
        if let Some(session) = guard.take() {
            self.open_sessions.fetch_sub(1, Ordering::Relaxed);
            let _ = self.pool.close_session(&session).await;
        }
    }
}

fn tail(text: &str, chars: usize) -> String {
    let text = text.trim_end();
    let count = text.chars().count();
    text.chars().skip(count.saturating_sub(chars)).collect()
}

/// The OpenAPI description: one catch-all operation per method, and the fixed routes.
pub fn openapi_spec() -> &'static Value {
    static SPEC: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    SPEC.get_or_init(|| {
        let error = json!({"$ref": "#/components/schemas/Error"});
        let operation = |method: &str, summary: &str, example: Value| {
            json!({
                "operationId": format!("rest_{method}"),
                "summary": summary,
                "description": "No endpoint is declared: the planner (an LLM, or the offline conventions planner) reads the request and writes Python code that answers it over the tenant's JSON collections. The headers X-Kiln-Planner and X-Kiln-Plan-Cache say who planned it and whether a cached plan answered.",
                "parameters": [
                    {"name": "path", "in": "path", "required": true, "schema": {"type": "string"}, "description": "Any path, e.g. members/ or members/1 or members/search", "example": "members/1"},
                    {"name": "X-Session-ID", "in": "header", "required": false, "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": "The tenant; without it, the tenant is derived from the bearer token (or is `public`)."}
                ],
                "responses": {
                    "default": {"description": "Whatever the plan answers, e.g. 201 with Location for a create, 200, 204, 404", "content": {"application/json": {"example": example}}},
                    "400": {"description": "Malformed JSON body, bad path or X-Session-ID", "content": {"application/json": {"schema": error}}},
                    "401": {"description": "AUTH_TOKEN is set and the bearer token is missing or wrong", "content": {"application/json": {"schema": error}}},
                    "413": {"description": "The body is too large", "content": {"application/json": {"schema": error}}},
                    "502": {"description": "The planner's answer was invalid (PLAN_INVALID), unsafe (PLAN_UNSAFE) or the LLM failed (LLM_FAILED), or the result was too large", "content": {"application/json": {"schema": error}}},
                    "504": {"description": "The code ran past the per-request deadline", "content": {"application/json": {"schema": error}}}
                }
            })
        };
        let body = json!({"required": false, "content": {"application/json": {"schema": {}, "example": {"name": "Hartmann", "city": "Bonn"}}}});
        let mut post = operation("post", "Create (POST /members/ → 201 + Location)", json!({"id": 1, "name": "Hartmann"}));
        post["requestBody"] = body.clone();
        let mut put = operation("put", "Replace (PUT /members/1)", json!({"id": 1, "name": "Hartmann"}));
        put["requestBody"] = body.clone();
        let mut patch = operation("patch", "Merge (PATCH /members/1)", json!({"id": 1, "name": "Hartmann", "city": "Köln"}));
        patch["requestBody"] = body;
        json!({
            "openapi": "3.1.0",
            "info": {
                "title": "kiln rest",
                "version": env!("CARGO_PKG_VERSION"),
                "description": "A REST service with no fixed endpoints. Every method on every path reaches one catch-all handler; a planner turns the request into a JSON plan with Python code, the code is checked against an allowlist and runs in the tenant's WebAssembly sandbox over its JSON collections (/data/<tenant>/<collection>.json).\n\nConventions (what the offline planner does, and what the LLM planner is asked to do):\n- POST /members/ → 201, Location: /members/{id}, the created object\n- GET /members/1 → 200 or 404; PUT replaces, PATCH merges, DELETE → 204\n- GET /members/search?name=hartmann → the matching list (field__contains for parts)\n- GET /members/?limit=10&offset=20&sort=name → {items, page: {limit, offset, total}}\n\nTenants: X-Session-ID, or derived from the bearer token. Fixed routes: /healthz, /docs, /redoc, /openapi.json."
            },
            "paths": {
                "/{path}": {
                    "get": operation("get", "Read, list or search (GET /members/1, /members/?limit=10, /members/search?name=x)", json!({"items": [{"id": 1, "name": "Hartmann"}], "page": {"limit": 10, "offset": 0, "total": 1}})),
                    "post": post,
                    "put": put,
                    "patch": patch,
                    "delete": operation("delete", "Delete (DELETE /members/1 → 204)", Value::Null),
                    "options": operation("options", "Allowed methods", Value::Null),
                    "head": operation("head", "As GET, without a body", Value::Null)
                },
                "/healthz": {"get": {"operationId": "healthz", "summary": "200 when requests can be served; planner and plan-cache hit rate", "responses": {"200": {"description": "Ready", "content": {"application/json": {"example": {"status": "ok", "planner": CONVENTIONS_LABEL, "plan_cache": {"hits": 9, "misses": 1, "hit_rate": 0.9}}}}}, "503": {"description": "No executor worker"}}}}
            },
            "components": {
                "schemas": {
                    "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "required": ["code", "message"], "properties": {"code": {"type": "string"}, "message": {"type": "string"}, "request_id": {"type": "string"}}}}}
                },
                "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "Only when kiln rest runs with AUTH_TOKEN"}}
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_split_and_refuse_hostile_segments() {
        assert_eq!(segments("/members/").unwrap(), vec!["members"]);
        assert_eq!(segments("/a%20b/1").unwrap(), vec!["a b", "1"]);
        assert_eq!(segments("/").unwrap(), Vec::<String>::new());
        for bad in ["/a/%2F", "/a/%00", "/%2e%2e/x", "/a/%ff", &"/a".repeat(40)] {
            assert!(segments(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn answers_are_read_from_the_last_marked_line() {
        let out = format!(
            "noise\n{}{{\"ok\": false}}\n{}{{\"ok\": true}}\n",
            python::MARK,
            python::MARK
        );
        assert_eq!(python::answer(&out).unwrap()["ok"], true);
        assert_eq!(python::answer("no mark"), None);
    }
}
