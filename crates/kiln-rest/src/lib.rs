//! `kiln rest`: a REST service with no endpoints declared. Every request (any method, any
//! path) is planned — by an LLM, or offline by the conventions planner — into Python code
//! that runs in the tenant's sandbox session over its JSON collections.
//!
//! The steps of one request:
//! 1. The host builds a context (method, path, segments, query, headers without credentials,
//!    body, client ip, tenant), admits the tenant (new tenants per client address per minute,
//!    a cap on live sessions with the least recently used idle one closed to make room) and
//!    takes the tenant's session (one per tenant, one request at a time in it, so no write is
//!    ever lost to a race).
//! 2. A plan cached for the request's shape is reused; otherwise the driver in the session
//!    asks the planner. The LLM planner reaches the model only through the door, granted to
//!    the planning turn alone; the provider key stays in this process.
//! 3. The plan's code is checked (AST allowlist) and run with the door shut, and the REPLY it
//!    assigned (or the value it returned) becomes the HTTP response. Plans and code in seed
//!    000's shape (`store` bound to the plan's resource, `ctx["body_json"]`, `safe_open`,
//!    `response_hints`) run as well as kiln's own; see docs/rest.md, "The code's contract".

mod errors;
mod new_tenants;
mod openapi;
pub mod plans;
pub mod python;
mod sessions;

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
use kiln_executor::{Door, ExecutorPool, SessionHandle};
use kiln_llm::{ChatModel, Message, ModelRequest, RetryPolicy, Usage};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use errors::{method_not_allowed, router_errors, unauthorized};
use kiln_http::HttpError;
use kiln_http::error::{answered, given_request_id, reshape_errors};
pub use new_tenants::{NewTenantLimiter, RetryAfter, address_key};
pub use openapi::openapi_spec;
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
    /// Every request must carry `Authorization: Bearer <token>` when set. A secret type:
    /// no `Debug` or log line shows it.
    pub auth_token: Option<secrecy::SecretString>,
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
    /// Live tenant sessions at most (default 64). A tenant that needs one past it takes the
    /// least recently used idle one; when all are busy it gets 503 `TOO_MANY_SESSIONS`.
    pub max_sessions: usize,
    /// Memory caps of all live tenant sessions together (`memory_bytes` each), when set:
    /// the session cap is then at most `sessions_memory_bytes / memory_bytes`.
    pub sessions_memory_bytes: Option<u64>,
    /// New tenants one client address may create per minute (default 30; 0: no limit).
    /// Past it the address gets 429 `TOO_MANY_NEW_TENANTS`; its tenants keep working.
    /// (`kiln rest` turns it off by default when `auth_token` is set.)
    pub new_tenants_per_minute: u32,
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
            max_sessions: 64,
            sessions_memory_bytes: None,
            new_tenants_per_minute: 30,
        }
    }

    /// Live tenant sessions at most: `max_sessions`, lowered to what
    /// `sessions_memory_bytes` holds (at least one).
    pub fn session_cap(&self) -> usize {
        let by_memory = self.sessions_memory_bytes.map_or(usize::MAX, |budget| {
            usize::try_from(budget / self.memory_bytes.max(1)).unwrap_or(usize::MAX)
        });
        self.max_sessions.min(by_memory).max(1)
    }
}

/// A tenant's slot in the runtime's table of live sessions (one request at a time holds it).
type Slot = Arc<kiln_runtime::live::Slot>;

struct App {
    config: RestConfig,
    pool: Arc<ExecutorPool>,
    plans: Arc<PlanCache>,
    /// The tenants' live sessions: a cap, least-recently-used eviction, the idle timeout.
    live: kiln_runtime::live::LiveSessions,
    new_tenants: NewTenantLimiter,
    next_request: AtomicU64,
}

/// Serves until SIGTERM or Ctrl-C; running requests finish first.
pub async fn serve(config: RestConfig, pool: Arc<ExecutorPool>) -> std::io::Result<()> {
    let listen = config.listen;
    let app = App::start(config, pool)?;
    let listener = tokio::net::TcpListener::bind(listen).await?;
    announce(&app, listener.local_addr()?);
    let housekeeping = tokio::spawn(housekeeping(app.clone()));
    axum::serve(
        listener,
        routes(app.clone()).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(kiln_http::shutdown_signal())
    .await?;
    housekeeping.abort();
    app.plans.flush();
    // The live sessions end with the process: what tenants that stored nothing left goes too.
    sessions::sweep(&app.config.data_dir);
    Ok(())
}

/// kiln rest's routes over `pool`, without a socket and without the housekeeping `serve`
/// adds (the plan cache written each second, idle sessions closed): for tests, which call
/// it with `tower::ServiceExt::oneshot`. The catch-all reads the client's address from the
/// request's `ConnectInfo<SocketAddr>` extension.
pub fn router(config: RestConfig, pool: Arc<ExecutorPool>) -> std::io::Result<Router> {
    Ok(routes(App::start(config, pool)?))
}

impl App {
    /// The state of a kiln rest: its folders made, its plan cache read, and what an earlier
    /// run left for tenants that stored nothing swept away.
    fn start(config: RestConfig, pool: Arc<ExecutorPool>) -> std::io::Result<Arc<App>> {
        std::fs::create_dir_all(config.data_dir.join("tenants"))?;
        let plans = Arc::new(PlanCache::new(config.data_dir.join("plans"))?);
        sessions::sweep(&config.data_dir);
        Ok(Arc::new(App {
            live: kiln_runtime::live::LiveSessions::new(config.session_cap()),
            new_tenants: NewTenantLimiter::new(config.new_tenants_per_minute),
            config,
            pool,
            plans,
            next_request: AtomicU64::new(1),
        }))
    }
}

fn announce(app: &App, address: SocketAddr) {
    eprintln!(
        "kiln rest: listening on http://{} (planner: {}; auth: {}; data: {}; tenant sessions: at most {}; new tenants per address: {})",
        address,
        app.config.planner.label(),
        if app.config.auth_token.is_some() {
            "bearer token"
        } else {
            "off (demo mode: any X-Session-ID is a tenant)"
        },
        app.config.data_dir.display(),
        app.live.max(),
        match app.config.new_tenants_per_minute {
            0 => "no limit".to_string(),
            n => format!("{n} a minute"),
        }
    );
}

/// Each second: the plan cache written, idle sessions closed, the new-tenant counts pruned.
async fn housekeeping(app: Arc<App>) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let _ = tokio::task::spawn_blocking({
            let app = app.clone();
            move || app.plans.flush()
        })
        .await;
        app.close_idle().await;
        app.new_tenants.prune(Instant::now());
    }
}

fn routes(app: Arc<App>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/openapi.json", get(openapi))
        .merge(kiln_http::docs::routes())
        .fallback(handle)
        .layer(axum::middleware::from_fn_with_state(
            router_errors(&app),
            reshape_errors,
        ))
        .with_state(app)
}

async fn healthz(State(app): State<Arc<App>>) -> Response {
    let (hits, misses) = app.plans.totals();
    let rate = if hits + misses == 0 {
        0.0
    } else {
        hits as f64 / (hits + misses) as f64
    };
    let workers = app.pool.worker_loads().len();
    let status = if workers > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": if workers > 0 { "ok" } else { "no executor workers" },
        "planner": app.config.planner.label(),
        "workers": workers,
        "tenant_sessions": app.live.open_count(),
        "max_tenant_sessions": app.live.max(),
        "evicted_sessions": app.live.evictions(),
        "plan_cache": {"hits": hits, "misses": misses, "hit_rate": rate},
    });
    answered((status, axum::Json(body)).into_response())
}

impl App {
    fn new_request_id(&self) -> String {
        format!(
            "rest-{:x}-{}",
            UNIX_EPOCH.elapsed().map_or(0, |d| d.as_secs()),
            self.next_request.fetch_add(1, Ordering::Relaxed)
        )
    }
}

async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        openapi_spec().to_string(),
    )
        .into_response()
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
    let request_id = given_request_id(request.headers()).unwrap_or_else(|| app.new_request_id());
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
            trace.outcome = error.code().to_string();
            error.with_request_id(request_id.as_str()).into_response()
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
    answered(response)
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

fn tenant_of(headers: &HeaderMap) -> Result<String, HttpError> {
    if let Some(value) = headers.get("x-session-id") {
        let ok = value.to_str().ok().filter(|v| {
            !v.is_empty()
                && v.len() <= 64
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b))
        });
        return ok.map(str::to_string).ok_or_else(|| {
            HttpError::new(
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

/// The query: each name with the list of its values.
fn query_of(parts: &axum::http::request::Parts) -> serde_json::Map<String, Value> {
    let mut query: serde_json::Map<String, Value> = serde_json::Map::new();
    for (name, value) in form_urlencoded::parse(parts.uri.query().unwrap_or("").as_bytes()) {
        let values = query
            .entry(name.into_owned())
            .or_insert_with(|| Value::Array(Vec::new()));
        if let Value::Array(list) = values {
            list.push(Value::String(value.into_owned()));
        }
    }
    query
}

/// The headers a plan's code may see: lower-case names, repeated ones joined with ", ",
/// never the credentials (authorization, cookies).
fn visible_headers(parts: &axum::http::request::Parts) -> serde_json::Map<String, Value> {
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
    headers
}

/// The context handed to the driver, as JSON text: the seed's keys (method, path,
/// segments, query, headers, body_raw, client.ip, session.id) and kiln's (client_ip, tenant,
/// request_id); the driver adds body, body_json, body_text and params.
fn context(
    parts: &axum::http::request::Parts,
    body: &[u8],
    segments: &[String],
    peer: SocketAddr,
    tenant: &str,
    request_id: &str,
) -> Result<String, HttpError> {
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let is_json =
        !body.is_empty() && content_type.is_none_or(kiln_http::json::is_json_content_type);
    if is_json {
        // Malformed JSON is a 400 before anything runs.
        serde_json::from_slice::<Value>(body).map_err(|e| HttpError::malformed_json(&e))?;
    }
    // Sent once, as text (base64 when it is not UTF-8); the driver parses a JSON body again
    // into ctx["body"] / ctx["body_json"], so a large body does not travel twice.
    let (body_raw, body_base64) = match std::str::from_utf8(body) {
        _ if body.is_empty() => (Value::Null, Value::Null),
        Ok(text) => (Value::String(text.to_string()), Value::Null),
        Err(_) => {
            use base64::Engine as _;
            let encoded = base64::engine::general_purpose::STANDARD.encode(body);
            (Value::Null, Value::String(encoded))
        }
    };
    let ctx = json!({
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "segments": segments,
        "query": query_of(parts),
        "headers": visible_headers(parts),
        "body_raw": body_raw,
        "body_base64": body_base64,
        "body_is_json": is_json,
        "client": {"ip": peer.ip().to_string()},
        "client_ip": peer.ip().to_string(),
        "session": {"id": tenant},
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
) -> Result<Response, HttpError> {
    let (parts, body) = request.into_parts();
    if !METHODS.contains(&parts.method) {
        return Err(method_not_allowed(&parts.method));
    }
    if let Some(token) = &app.config.auth_token {
        match bearer(&parts.headers) {
            Some(given) if same_secret(given, secrecy::ExposeSecret::expose_secret(token)) => {}
            Some(_) => return Err(unauthorized("the bearer token is not valid")),
            None => {
                return Err(unauthorized(
                    "send Authorization: Bearer <token> (the token kiln rest was started with)",
                ));
            }
        }
    }
    let tenant = tenant_of(&parts.headers)?;
    trace.tenant.clone_from(&tenant);
    let segments = plans::segments(parts.uri.path())?;
    // Refused from its declared length before it is read; a body without one is cut off
    // at the limit while it is read.
    let body = kiln_http::json::read_body(&parts.headers, body, app.config.max_body_bytes).await?;
    let ctx = context(&parts, &body, &segments, peer, &tenant, request_id)?;
    let method = parts.method.as_str();

    // In a task of its own: a client that goes away does not cut the session bookkeeping
    // (the count under the cap, an opened session, the cleanup) off half-way.
    let work = {
        let (app, tenant, method) = (app.clone(), tenant.clone(), method.to_string());
        let mut trace = std::mem::take(trace);
        tokio::spawn(async move {
            let answer = admitted(&app, &tenant, peer, &ctx, &method, &segments, &mut trace).await;
            (answer, trace)
        })
    };
    let (answer, done) = work.await.map_err(|e| {
        HttpError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "INTERNAL",
            format!("the request failed: {e}"),
        )
    })?;
    *trace = done;
    reply(&answer?)
}

/// Admits the tenant and answers in its session. Nothing of the tenant is created (slot,
/// session, folder, plan file) before admission.
async fn admitted(
    app: &Arc<App>,
    tenant: &str,
    peer: SocketAddr,
    ctx: &str,
    method: &str,
    segments: &[String],
    trace: &mut Trace,
) -> Result<Value, HttpError> {
    let slot = app.admit(tenant, peer.ip())?;
    let mut guard = slot.session.lock().await;
    app.live.touch(&slot);
    let answer = answer(app, tenant, &mut guard, ctx, method, segments, trace).await;
    app.live.touch(&slot);
    let ended = guard.is_none();
    if ended {
        // No session (refused, or a deadline ended it): nothing need stay for a tenant that
        // stored nothing, not even its slot.
        app.discard_if_empty(tenant).await;
    }
    drop(guard);
    if ended {
        app.live.forget_if_unused(tenant, &slot);
    }
    answer
}

/// The driver's answer to a request, in the tenant's session (opened when needed): from a
/// cached plan, or planned now.
async fn answer(
    app: &Arc<App>,
    tenant: &str,
    guard: &mut Option<SessionHandle>,
    ctx: &str,
    method: &str,
    segments: &[String],
    trace: &mut Trace,
) -> Result<Value, HttpError> {
    let session = app.session(tenant, guard).await?;
    // Looked up once the tenant is admitted: a refused request counts no miss and writes
    // no plan file.
    let cached = if app.config.plan_cache {
        app.plans.lookup(tenant, method, segments)
    } else {
        None
    };
    let mut turns = Turns {
        app,
        tenant,
        guard,
        session,
        ctx,
    };
    if let Some(entry) = cached {
        trace.cache = "hit";
        trace.planner = entry.planner;
        trace.pattern = Some(entry.pattern.clone());
        return turns
            .execute(&entry.code, Some(&entry.pattern), &entry.meta)
            .await;
    }
    trace.cache = "miss";
    trace.planner = app.config.planner.label();
    let answer = match &app.config.planner {
        Planner::Conventions => {
            turns
                .run(python::handle(ctx), None, app.config.deadline)
                .await?
        }
        Planner::Llm {
            model,
            timeout,
            retry,
        } => llm_answer(&mut turns, model, *timeout, *retry, trace).await?,
    };
    if app.config.plan_cache {
        store_plan(app, tenant, method, segments, &answer, trace).await;
    }
    Ok(answer)
}

/// What a request's driver turns need: the tenant's session (its slot locked by the
/// request) and the request's context.
struct Turns<'a> {
    app: &'a Arc<App>,
    tenant: &'a str,
    guard: &'a mut Option<SessionHandle>,
    session: SessionHandle,
    ctx: &'a str,
}

impl Turns<'_> {
    /// One driver turn, with `door` granted to it alone.
    async fn run(
        &mut self,
        code: String,
        door: Option<Door>,
        timeout: Duration,
    ) -> Result<Value, HttpError> {
        self.app
            .turn(self.tenant, self.guard, &self.session, code, door, timeout)
            .await
    }

    /// A plan's code, run with the door shut under the request's deadline.
    async fn execute(
        &mut self,
        code: &str,
        pattern: Option<&str>,
        meta: &Value,
    ) -> Result<Value, HttpError> {
        let turn = python::execute(self.ctx, code, pattern, meta);
        self.run(turn, None, self.app.config.deadline).await
    }
}

/// Plans with the model (reached through the door, granted to the planning turn alone),
/// then runs the plan's code; the answer carries the plan.
async fn llm_answer(
    turns: &mut Turns<'_>,
    model: &Arc<dyn ChatModel>,
    timeout: Duration,
    retry: RetryPolicy,
    trace: &mut Trace,
) -> Result<Value, HttpError> {
    let usage = Arc::new(Mutex::new(Usage::default()));
    let door = llm_door(model.clone(), timeout, retry, usage.clone());
    let planning = timeout * retry.attempts.max(1)
        + retry.base_delay * (1 << retry.attempts.min(8))
        + turns.app.config.deadline;
    let planning_turn = python::plan(turns.ctx);
    let planned = turns.run(planning_turn, Some(door), planning).await;
    trace.usage = Some(*usage.lock().unwrap_or_else(|e| e.into_inner()));
    let planned = planned?;
    if planned["ok"] != Value::Bool(true) {
        return Ok(planned);
    }
    let code = planned["plan"]["code"].as_str().unwrap_or("").to_string();
    let pattern = planned["plan"]["pattern"].as_str().map(str::to_string);
    // The door is shut for this turn: the plan's code never reaches the model or anything
    // else outside. (A planning turn that ended its session returned an error above.)
    let mut answer = turns
        .execute(&code, pattern.as_deref(), &planned["plan"]["meta"])
        .await?;
    answer["plan"] = planned["plan"].clone();
    Ok(answer)
}

/// Keeps the plan of a successful answer in the tenant's plan cache, when its pattern
/// really fits this request.
async fn store_plan(
    app: &Arc<App>,
    tenant: &str,
    method: &str,
    segments: &[String],
    answer: &Value,
    trace: &mut Trace,
) {
    let (Some(pattern), Some(code)) = (
        answer["plan"]["pattern"].as_str(),
        answer["plan"]["code"].as_str(),
    ) else {
        return;
    };
    if answer["ok"] != Value::Bool(true)
        || !plans::Pattern::parse(pattern).is_some_and(|p| p.matches(method, segments))
    {
        return;
    }
    let entry = plans::PlanEntry {
        pattern: pattern.to_string(),
        code: code.to_string(),
        planner: app.config.planner.label(),
        created: 0,
        hits: 0,
        meta: answer["plan"]["meta"].clone(),
    };
    let stored = {
        let (app, tenant) = (app.clone(), tenant.to_string());
        tokio::task::spawn_blocking(move || app.plans.insert(&tenant, entry)).await
    };
    if matches!(stored, Ok(Ok(()))) {
        trace.cache = "stored";
        trace.pattern = Some(pattern.to_string());
    }
}

/// The HTTP response for the driver's answer.
fn reply(answer: &Value) -> Result<Response, HttpError> {
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
        return Err(HttpError::new(status, code, message));
    }
    let r = &answer["reply"];
    let status = r["status"]
        .as_u64()
        .and_then(|s| u16::try_from(s).ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| {
            HttpError::new(
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
        HttpError::new(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_split_and_refuse_hostile_segments() {
        assert_eq!(plans::segments("/members/").unwrap(), vec!["members"]);
        assert_eq!(plans::segments("/a%20b/1").unwrap(), vec!["a b", "1"]);
        assert_eq!(plans::segments("/").unwrap(), Vec::<String>::new());
        for bad in ["/a/%2F", "/a/%00", "/%2e%2e/x", "/a/%ff", &"/a".repeat(40)] {
            assert!(plans::segments(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_session_cap_follows_the_memory_budget() {
        let mut config = RestConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            PathBuf::from("/nonexistent"),
            Planner::Conventions,
        );
        assert_eq!(config.session_cap(), 64);
        config.sessions_memory_bytes = Some(4 << 30);
        assert_eq!(config.session_cap(), 16, "4 GiB / 256 MiB");
        config.sessions_memory_bytes = Some(1);
        assert_eq!(config.session_cap(), 1, "never none");
        config.max_sessions = 8;
        config.sessions_memory_bytes = None;
        assert_eq!(config.session_cap(), 8);
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
