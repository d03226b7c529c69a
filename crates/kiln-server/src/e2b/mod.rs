//! The E2B facade: kiln speaking E2B's wire protocol on a port of its own, so code written
//! for E2B's official SDKs (PyPI `e2b`, `e2b-code-interpreter`; npm `e2b`,
//! `@e2b/code-interpreter`) runs against kiln with only environment variables changed
//! (`E2B_API_URL` and `E2B_SANDBOX_URL` pointing here, `E2B_API_KEY` a kiln key).
//!
//! One listener serves three planes; a request is routed by what the SDK sends:
//! - `E2b-Sandbox-Id` (or a `Host` of `{port}-{id}.{domain}`) names a sandbox: port 49999
//!   is the code interpreter ([`jupyter`]), any other port envd ([`envd`], [`process`]);
//! - anything else is the control plane ([`control`]), authenticated by `X-API-KEY`.
//!
//! Sandbox-plane requests prove themselves with the sandbox's own access token (issued at
//! create, always), or a signed URL for `/files`. A sandbox is a kiln sandbox of the key's
//! tenant, so quotas, metrics and the access log are kiln's own; its id is the kiln id
//! without `sb_`, and its workspace is `/home/user`.

// Helpers here answer `Result<_, Response>`: a refusal is the request's whole answer, built
// once on a cold path, so the size of its `Err` does not matter.
#![allow(clippy::result_large_err)]

pub mod connect;
pub mod control;
pub mod egress;
pub mod envd;
pub mod jupyter;
pub mod process;
pub mod snapshots;
pub mod volumes;
pub mod watch;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{from_fn, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use kiln_runtime::RuntimeError;
use kiln_runtime::auth::Caller;
use kiln_runtime::sandbox::Sandbox;
use serde_json::json;
use tower::ServiceExt;

use crate::{AppState, gate};

/// The envd version kiln advertises: the SDKs turn features on by it (0.5.7: stdin close,
/// octet-stream and gzip uploads; not yet file metadata, which needs 0.6.2).
pub const ENVD_VERSION: &str = "0.5.7";

/// Where an E2B sandbox's code sees its workspace, and relative paths start.
pub const HOME: &str = "/home/user";

/// The code interpreter's port; every other port is envd's.
pub const JUPYTER_PORT: u16 = 49999;
/// The port envd answers on (E2B's sandbox plane).
pub const ENVD_PORT: u16 = 49983;

/// The facade's settings.
#[derive(Debug, Clone, Default)]
pub struct E2bConfig {
    /// The domain for `{port}-{id}.{domain}` host names (E2B_DOMAIN mode), returned in
    /// the sandbox's `domain`; `None`: clients route by header (E2B_SANDBOX_URL).
    pub domain: Option<String>,
}

/// The facade's state.
pub struct E2b {
    pub app: Arc<AppState>,
    pub config: E2bConfig,
    /// Folder watchers (envd's CreateWatcher).
    pub watchers: watch::Watchers,
}

/// The three planes, for the dispatcher.
struct Planes {
    e2b: Arc<E2b>,
    domain: Option<String>,
    control: Router,
    envd: Router,
    jupyter: Router,
    /// A server in the sandbox's box, on another port (`get_host`).
    ports: Router,
    /// The volume content API (`/volumecontent/…`, with a volume's token).
    volumes: Router,
}

/// The sandbox a sandbox-plane request is for, and who owns it (set once its token
/// checked out).
#[derive(Debug, Clone)]
pub struct Target {
    /// E2B's id (kiln's without `sb_`).
    pub e2b_id: String,
    pub port: u16,
}

/// A checked sandbox-plane request's sandbox.
#[derive(Debug, Clone)]
pub struct SandboxCtx {
    pub caller: Caller,
    pub sandbox: Sandbox,
}

impl SandboxCtx {
    pub fn id(&self) -> &str {
        &self.sandbox.id
    }
}

/// kiln's sandbox id of an E2B id.
pub fn kiln_id(e2b_id: &str) -> String {
    format!("sb_{e2b_id}")
}

/// E2B's id of a kiln sandbox id.
pub fn e2b_id(kiln_id: &str) -> &str {
    kiln_id.strip_prefix("sb_").unwrap_or(kiln_id)
}

/// The facade's routes over `app`.
pub fn router(app: Arc<AppState>, config: E2bConfig) -> Router {
    let e2b = Arc::new(E2b {
        app: app.clone(),
        config: config.clone(),
        watchers: watch::Watchers::default(),
    });
    let planes = Arc::new(Planes {
        domain: config.domain,
        control: control::router(e2b.clone()),
        envd: envd::router(e2b.clone()),
        jupyter: jupyter::router(e2b.clone()),
        volumes: volumes::content_router(e2b.clone()),
        ports: ports_router(e2b.clone()),
        e2b,
    });
    Router::new()
        .fallback(dispatch)
        .with_state(planes)
        .layer(from_fn_with_state(app.clone(), gate::metrics))
        .layer(from_fn(gate::access_log))
        .layer(from_fn(gate::request_id))
}

/// Sends a request to the plane it is for.
async fn dispatch(State(planes): State<Arc<Planes>>, mut request: Request) -> Response {
    // Control-plane paths never overlap the sandbox planes'; some SDKs send the sandbox
    // headers on control-plane calls too (connect, in e2b 2.26).
    let path = request.uri().path();
    let control =
        path.starts_with("/sandboxes") || path.starts_with("/v2/") || path.starts_with("/v1/");
    if path.starts_with("/volumecontent/") {
        return match planes.volumes.clone().oneshot(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        };
    }
    let target = if control {
        None
    } else {
        target(request.headers(), planes.domain.as_deref())
            .or_else(|| signed_target(&planes.e2b, &request))
    };
    let plane = match &target {
        None => planes.control.clone(),
        Some(t) if t.port == JUPYTER_PORT => planes.jupyter.clone(),
        Some(t) if t.port == ENVD_PORT => planes.envd.clone(),
        // Any other port is a server the sandbox's box runs: `get_host(port)`.
        Some(_) => planes.ports.clone(),
    };
    if let Some(target) = target {
        request.extensions_mut().insert(target);
    }
    match plane.oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// Names the route a plane matched (`e2b envd /files`) for the access log and metrics, and
/// the key or sandbox that acted.
pub async fn label(
    State(plane): State<&'static str>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|p| format!("e2b {plane} {}", p.as_str()));
    let actor = request
        .extensions()
        .get::<Caller>()
        .map(|c| c.key_id.clone())
        .or_else(|| {
            request
                .extensions()
                .get::<SandboxCtx>()
                .map(|c| c.caller.key_id.clone())
        });
    let mut response = next.run(request).await;
    if let Some(route) = route {
        response.extensions_mut().insert(gate::RouteLabel(route));
    }
    if let Some(actor) = actor {
        response.extensions_mut().insert(gate::KeyId(actor));
    }
    response
}

/// The sandbox a request names: by `E2b-Sandbox-Id` (and `E2b-Sandbox-Port`), or by a
/// `Host` of `{port}-{id}.{domain}`.
fn target(headers: &HeaderMap, domain: Option<&str>) -> Option<Target> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(id) = header("e2b-sandbox-id") {
        let port = header("e2b-sandbox-port")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or(49983);
        return Some(Target {
            e2b_id: id.trim().to_owned(),
            port,
        });
    }
    let domain = domain?;
    let host = header("host")?;
    let host = host.split(':').next().unwrap_or(host);
    let label = host.strip_suffix(domain)?.strip_suffix('.')?;
    let (port, id) = label.split_once('-')?;
    Some(Target {
        e2b_id: id.to_owned(),
        port: port.parse().ok()?,
    })
}

/// The sandbox a signed file URL is for: a URL the SDK signs names no sandbox (it is meant
/// for a browser), but its signature holds the sandbox's token, which only one sandbox has.
fn signed_target(e2b: &E2b, request: &Request) -> Option<Target> {
    if request.uri().path() != "/files" {
        return None;
    }
    let query = request.uri().query()?;
    if !query.contains("signature=") {
        return None;
    }
    let method = request.method();
    let view = e2b.app.runtime.registry.find_live(|sandbox| {
        sandbox.access_token.is_some() && envd::signature_ok(sandbox, query, method)
    })?;
    Some(Target {
        e2b_id: e2b_id(&view.meta.id).to_owned(),
        port: 49983,
    })
}

/// Which of the facade's routes answers a runtime failure: each says some failures its own
/// way (see [`status_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The control plane ([`control`]).
    Control,
    /// envd's Connect services: filesystem and process ([`envd`], [`process`]).
    Rpc,
    /// envd's `/files` ([`envd`]).
    Files,
    /// The code interpreter ([`jupyter`]).
    Interpreter,
}

/// The facade's one mapping of runtime failures onto E2B's wire: the HTTP status `route`
/// answers `error` with. A Connect RPC answers the code of that status
/// ([`connect::code_for`]), and so the status that code has.
pub fn status_of(error: &RuntimeError, route: Route) -> StatusCode {
    use RuntimeError as E;
    use kiln_workspace::TreeError as T;
    // Where a route answers differently from the facade's table below, and why.
    match (route, error) {
        // A gone sandbox is 502 "not running" to the code interpreter's SDKs.
        (Route::Interpreter, E::SandboxNotFound { .. } | E::SandboxDeleted { .. }) => {
            return StatusCode::BAD_GATEWAY;
        }
        // envd's `/files` says a write that the key's quota refuses is 507, as a full disk:
        // the SDKs' `NotEnoughSpaceException`.
        (Route::Files, E::QuotaExceeded { .. }) => return StatusCode::INSUFFICIENT_STORAGE,
        // Connect has no "conflict" for a busy sandbox: it is `unavailable` there.
        (Route::Rpc, E::SandboxBusy { .. }) => return StatusCode::SERVICE_UNAVAILABLE,
        // The control plane and the code interpreter tell apart only a missing sandbox or
        // session, a busy sandbox, quotas, an overloaded server and kiln's own faults;
        // anything else they answer 400, as they always have.
        (Route::Control | Route::Interpreter, _)
            if !matches!(
                error,
                E::SandboxNotFound { .. }
                    | E::SandboxDeleted { .. }
                    | E::SessionNotFound { .. }
                    | E::SecretNotFound { .. }
                    | E::SecretExists { .. }
                    | E::VolumeNotFound { .. }
                    | E::SnapshotNotFound { .. }
                    | E::WorkspaceNotFound { .. }
                    | E::VolumeExists { .. }
                    | E::VolumeInUse { .. }
                    | E::SandboxBusy { .. }
                    | E::QuotaExceeded { .. }
                    | E::ExecutionQueueFull { .. }
                    | E::Saturated { .. }
                    | E::ExecutorLost { .. }
                    | E::Internal { .. }
            ) =>
        {
            return StatusCode::BAD_REQUEST;
        }
        _ => {}
    }
    match error {
        E::SandboxNotFound { .. }
        | E::SandboxDeleted { .. }
        | E::SessionNotFound { .. }
        | E::FolderNotFound { .. }
        | E::ProcessNotFound { .. }
        | E::SecretNotFound { .. }
        | E::VolumeNotFound { .. }
        | E::SnapshotNotFound { .. }
        | E::WorkspaceNotFound { .. }
        | E::Workspace(T::NotFound { .. }) => StatusCode::NOT_FOUND,
        E::SecretExists { .. } | E::VolumeExists { .. } | E::VolumeInUse { .. } => {
            StatusCode::CONFLICT
        }
        E::SandboxBusy { .. } | E::SandboxPaused { .. } | E::Cancelled | E::SessionEnded { .. } => {
            StatusCode::CONFLICT
        }
        E::PortNotAllowed { .. } => StatusCode::FORBIDDEN,
        E::QuotaExceeded { .. } | E::ExecutionQueueFull { .. } | E::TooManySessions { .. } => {
            StatusCode::TOO_MANY_REQUESTS
        }
        E::NoSpace { .. } | E::SandboxDiskFull { .. } | E::Workspace(T::NoSpace { .. }) => {
            StatusCode::INSUFFICIENT_STORAGE
        }
        E::Internal { .. } | E::Workspace(T::Io { .. }) => StatusCode::INTERNAL_SERVER_ERROR,
        E::ExecutorLost { .. } | E::Saturated { .. } | E::ProcessFailed { .. } => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        E::Unsupported { .. } => StatusCode::NOT_IMPLEMENTED,
        E::Workspace(_)
        | E::IsAFolder { .. }
        | E::ProgramUnreadable { .. }
        | E::FileTooLarge { .. }
        | E::TooManyFiles { .. }
        | E::FilesTooLarge { .. }
        | E::ExecutionNotFound { .. }
        | E::InvalidCursor { .. }
        | E::UnsupportedLanguage { .. }
        | E::InvalidOption { .. }
        | E::InvalidEnv { .. }
        | E::UnknownImage { .. }
        | E::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
    }
}

/// What the facade says of a runtime failure on `route`: the runtime's message without host
/// paths; the control plane names a missing sandbox by its E2B id, as E2B does.
pub fn message_of(error: &RuntimeError, route: Route) -> String {
    match (route, error) {
        (Route::Control, RuntimeError::SandboxNotFound { id }) => {
            format!("sandbox \"{}\" not found", e2b_id(id))
        }
        _ => kiln_runtime::sandbox::scrub_paths(&error.to_string()),
    }
}

/// E2B's error body: `{"code": status, "message": …}`.
pub fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        axum::Json(json!({"code": status.as_u16(), "message": message.into()})),
    )
        .into_response()
}

/// What every sandbox-plane route answers for a sandbox that is gone: 502 with "was not
/// found", which the SDKs turn into "sandbox not running".
pub fn not_running(e2b_id: &str) -> Response {
    error(
        StatusCode::BAD_GATEWAY,
        format!("The sandbox {e2b_id} was not found"),
    )
}

/// Compares secrets in time independent of where they differ.
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Checks a sandbox-plane request: the sandbox lives and the request carries its token
/// (in one of `headers`), or `signed` says it is a valid signed URL. Puts a
/// [`SandboxCtx`] on the request.
pub fn check_sandbox(
    e2b: &E2b,
    request: &mut Request,
    token_headers: &[&str],
    signed: impl Fn(&Sandbox) -> bool,
) -> Result<(), Response> {
    let Some(target) = request.extensions().get::<Target>().cloned() else {
        return Err(error(StatusCode::BAD_REQUEST, "no sandbox named"));
    };
    let Some(view) = e2b.app.runtime.registry.lookup(&kiln_id(&target.e2b_id)) else {
        return Err(not_running(&target.e2b_id));
    };
    let sandbox = view.meta;
    let Some(token) = sandbox.access_token.clone() else {
        // Not an E2B sandbox: kiln's own API reaches it, not this facade.
        return Err(not_running(&target.e2b_id));
    };
    let presented = token_headers
        .iter()
        .filter_map(|name| request.headers().get(*name))
        .any(|v| same_secret(v.as_bytes(), token.as_bytes()));
    if !presented && !signed(&sandbox) {
        return Err(error(
            StatusCode::UNAUTHORIZED,
            "this sandbox needs its access token (X-Access-Token) or a signed URL",
        ));
    }
    // The work is the key's that made the sandbox: its quotas and its rate limit.
    let Some(caller) = e2b.app.auth.acting_for(&sandbox) else {
        return Err(error(
            StatusCode::UNAUTHORIZED,
            "the API key that created this sandbox was revoked",
        ));
    };
    request.extensions_mut().insert(caller.clone());
    request
        .extensions_mut()
        .insert(SandboxCtx { caller, sandbox });
    Ok(())
}

/// Serves the facade on `listener` until shutdown.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Arc<AppState>,
    config: E2bConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = axum::serve::ListenerExt::tap_io(listener, |stream| {
        let _ = stream.set_nodelay(true);
    });
    axum::serve(listener, router(app, config))
        .with_graceful_shutdown(shutdown)
        .await
}

/// The routes of a server a sandbox's box runs, reached by E2B's host names
/// (`{port}-{id}.{domain}`, what `get_host(port)` answers): anyone where the sandbox allows
/// public traffic (E2B's default), else with its traffic token
/// (`e2b-traffic-access-token`); then as a kiln preview of that port.
fn ports_router(e2b: Arc<E2b>) -> Router {
    Router::new()
        .fallback(port_request)
        .with_state(e2b.clone())
        .layer(from_fn_with_state(e2b.app.clone(), gate::rate_limit))
        .layer(from_fn_with_state(e2b, port_gate))
}

async fn port_gate(
    State(e2b): State<Arc<E2b>>,
    mut request: Request,
    next: axum::middleware::Next,
) -> Response {
    let headers = ["e2b-traffic-access-token", "x-access-token"];
    if let Err(response) = check_sandbox(&e2b, &mut request, &headers, |s| s.public_ports) {
        return response;
    }
    next.run(request).await
}

async fn port_request(State(e2b): State<Arc<E2b>>, request: Request) -> Response {
    let (Some(ctx), Some(target)) = (
        request.extensions().get::<SandboxCtx>().cloned(),
        request.extensions().get::<Target>().cloned(),
    ) else {
        return error(StatusCode::BAD_REQUEST, "no sandbox named");
    };
    let rest = request.uri().path().trim_start_matches('/').to_owned();
    crate::preview::forward(&e2b.app, &ctx.sandbox, target.port, &rest, None, request).await
}

/// One page of a listing as E2B's control plane answers it: `limit` (default 100, at most
/// 1000) items from the offset `next_token` names, and `x-next-token` when more follow. The
/// paging is checked before `list` is called.
pub(crate) fn paged<T>(
    limit: Option<usize>,
    next_token: Option<&str>,
    list: impl FnOnce() -> Result<Vec<T>, Response>,
    item: impl Fn(&T) -> serde_json::Value,
) -> Response {
    let limit = limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return error(StatusCode::BAD_REQUEST, "limit must be 1..=1000");
    }
    let start = match next_token {
        None | Some("") => 0,
        Some(token) => match token
            .strip_prefix('o')
            .and_then(|n| n.parse::<usize>().ok())
        {
            Some(n) => n,
            None => {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!("{token:?} is not a nextToken"),
                );
            }
        },
    };
    let all = match list() {
        Ok(all) => all,
        Err(response) => return response,
    };
    let page: Vec<serde_json::Value> = all.iter().skip(start).take(limit).map(item).collect();
    let mut response = axum::Json(page).into_response();
    if start + limit < all.len()
        && let Ok(token) = axum::http::HeaderValue::from_str(&format!("o{}", start + limit))
    {
        response.headers_mut().insert("x-next-token", token);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_workspace::TreeError;

    fn quota() -> RuntimeError {
        RuntimeError::QuotaExceeded {
            quota: "sessions".into(),
            limit: 2,
            in_use: 2,
            asked: None,
            unit: "sessions".into(),
        }
    }

    /// The wire every route gave each failure before the facade mapped them in one place,
    /// pinned: (failure, control plane, Connect code, `/files`, code interpreter).
    #[test]
    fn each_route_answers_each_failure_as_it_did() {
        let message = || "m".to_owned();
        let path = || "a.txt".to_owned();
        let table: Vec<(RuntimeError, u16, &str, u16, u16)> = vec![
            (
                RuntimeError::SandboxNotFound { id: "sb_1".into() },
                404,
                "not_found",
                404,
                502,
            ),
            // These two never reach the control plane (it runs no code and opens no
            // session); it would now say 404 for them, not 400.
            (
                RuntimeError::SandboxDeleted { id: "sb_1".into() },
                404,
                "not_found",
                404,
                502,
            ),
            (
                RuntimeError::SessionNotFound {
                    id: "sb_1".into(),
                    session: "s".into(),
                },
                404,
                "not_found",
                404,
                404,
            ),
            (
                RuntimeError::SandboxBusy {
                    id: "sb_1".into(),
                    running: "x".into(),
                },
                409,
                "unavailable",
                409,
                409,
            ),
            (quota(), 429, "resource_exhausted", 507, 429),
            (
                RuntimeError::ExecutionQueueFull {
                    limit: 1,
                    running: 1,
                    queued: 0,
                    waited_ms: 0,
                },
                429,
                "resource_exhausted",
                429,
                429,
            ),
            (
                RuntimeError::TooManySessions { limit: 8 },
                400,
                "resource_exhausted",
                429,
                400,
            ),
            (
                RuntimeError::NoSpace { what: message() },
                400,
                "resource_exhausted",
                507,
                400,
            ),
            (
                RuntimeError::SandboxDiskFull { disk_mb: 1 },
                400,
                "resource_exhausted",
                507,
                400,
            ),
            // `/files` said 429 here before, unlike every other full disk.
            (
                RuntimeError::Workspace(TreeError::NoSpace { path: path() }),
                400,
                "resource_exhausted",
                507,
                400,
            ),
            (
                RuntimeError::Internal { message: message() },
                500,
                "internal",
                500,
                500,
            ),
            (
                RuntimeError::Workspace(TreeError::Io {
                    op: "read",
                    path: path(),
                    source: std::io::Error::other("x"),
                }),
                400,
                "internal",
                500,
                400,
            ),
            (
                RuntimeError::ExecutorLost { detail: message() },
                503,
                "unavailable",
                503,
                503,
            ),
            (
                RuntimeError::Saturated { message: message() },
                503,
                "unavailable",
                503,
                503,
            ),
            (
                RuntimeError::ProcessFailed { message: message() },
                400,
                "unavailable",
                503,
                400,
            ),
            (
                RuntimeError::Unsupported { message: message() },
                400,
                "unimplemented",
                501,
                400,
            ),
            (RuntimeError::Cancelled, 400, "aborted", 409, 400),
            (
                RuntimeError::FolderNotFound { path: path() },
                400,
                "not_found",
                404,
                400,
            ),
            (
                RuntimeError::Workspace(TreeError::NotFound { path: path() }),
                400,
                "not_found",
                404,
                400,
            ),
            (
                RuntimeError::IsAFolder { path: path() },
                400,
                "invalid_argument",
                400,
                400,
            ),
            (
                RuntimeError::InvalidOption { message: message() },
                400,
                "invalid_argument",
                400,
                400,
            ),
        ];
        for (error, control, rpc, files, interpreter) in table {
            let name = format!("{error:?}");
            let said = (
                status_of(&error, Route::Control).as_u16(),
                status_of(&error, Route::Files).as_u16(),
                status_of(&error, Route::Interpreter).as_u16(),
                connect::RpcError::from(error).code,
            );
            assert_eq!(said, (control, files, interpreter, rpc), "{name}");
        }
    }

    #[test]
    fn a_connect_code_keeps_its_status() {
        for code in [
            "invalid_argument",
            "not_found",
            "aborted",
            "permission_denied",
            "unauthenticated",
            "resource_exhausted",
            "unimplemented",
            "unavailable",
            "deadline_exceeded",
            "internal",
        ] {
            let status = connect::RpcError::new(code, "").status();
            assert_eq!(connect::code_for(status), code);
        }
    }

    #[test]
    fn the_control_plane_names_a_missing_sandbox_by_its_e2b_id() {
        let missing = RuntimeError::SandboxNotFound {
            id: "sb_abc".into(),
        };
        assert_eq!(
            message_of(&missing, Route::Control),
            "sandbox \"abc\" not found"
        );
        assert_eq!(
            message_of(&missing, Route::Interpreter),
            "no sandbox \"sb_abc\": it never existed, was deleted, or expired"
        );
    }
}
