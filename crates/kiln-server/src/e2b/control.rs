//! E2B's control plane: create (v1 and v2 routes), get, list, kill, set timeout, connect,
//! metrics and pause, over kiln's sandboxes. `X-API-KEY` is a kiln key; spelled
//! `e2b_<hex>` (as the SDKs of 2.25–2.45 insist) it is the kiln key `kiln_<hex>`.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use kiln_core::template::TemplateInfo;
use kiln_runtime::auth::{Auth, Caller};
use kiln_runtime::sandbox::{MAX_LIFETIME_MS, Sandbox, SandboxSpec, now_ms, rfc3339};
use kiln_runtime::{RuntimeError, exec};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{E2b, ENVD_VERSION, HOME, Route, e2b_id, error, kiln_id, message_of, status_of};
use crate::gate;

type Shared = State<Arc<E2b>>;

/// The control plane's routes.
pub fn router(e2b: Arc<E2b>) -> Router {
    let app = e2b.app.clone();
    Router::new()
        .route("/sandboxes", get(list).post(create))
        .route("/v2/sandboxes", get(list).post(create))
        .route("/sandboxes/{id}", get(info).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/resume", post(connect))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/sandboxes/{id}/pause", post(pause))
        .route(
            "/sandboxes/{id}/network",
            axum::routing::put(super::egress::update_network),
        )
        .route("/sandboxes/{id}/snapshots", post(super::snapshots::create))
        .route("/sandboxes/{id}/fork", post(super::snapshots::fork))
        .route("/snapshots", get(super::snapshots::list))
        .route(
            "/templates/{id}",
            axum::routing::delete(super::snapshots::delete),
        )
        .route(
            "/volumes",
            get(super::volumes::list).post(super::volumes::create),
        )
        .route(
            "/volumes/{volume}",
            get(super::volumes::info).delete(super::volumes::destroy),
        )
        .route(
            "/secrets",
            get(super::egress::list_secrets).post(super::egress::create_secret),
        )
        .route(
            "/secrets/{secret}",
            get(super::egress::get_secret)
                .post(super::egress::update_secret)
                .delete(super::egress::delete_secret),
        )
        .route("/health", get(|| async { (StatusCode::OK, "ok") }))
        .fallback(|request: Request| async move {
            error(
                StatusCode::NOT_FOUND,
                format!(
                    "kiln's E2B facade has no route {} {}",
                    request.method(),
                    request.uri().path()
                ),
            )
        })
        .route_layer(from_fn_with_state("control", super::label))
        .with_state(e2b.clone())
        .layer(from_fn_with_state(app, gate::rate_limit))
        .layer(from_fn_with_state(e2b, authenticate))
}

/// Checks `X-API-KEY` (or `Authorization: Bearer`) and puts its [`Caller`] on the request.
async fn authenticate(State(e2b): Shared, mut request: Request, next: Next) -> Response {
    if request.uri().path() == "/health" {
        return next.run(request).await;
    }
    let caller = match &e2b.app.auth {
        Auth::Off => Some(Caller::local()),
        Auth::Keys(store) => presented(&request).and_then(|key| {
            let key = match key.strip_prefix("e2b_") {
                Some(hex) => format!("kiln_{hex}"),
                None => key.to_owned(),
            };
            store.check(&key)
        }),
    };
    match caller {
        Some(caller) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
        None => error(
            StatusCode::UNAUTHORIZED,
            "Invalid API key: set E2B_API_KEY to a kiln key (kiln keys create), as kiln_<hex> or e2b_<hex>",
        ),
    }
}

fn presented(request: &Request) -> Option<&str> {
    let headers = request.headers();
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .or_else(|| {
            headers
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
        })
        .map(str::trim)
}

/// A runtime failure as E2B's control plane says it.
fn failed(e: RuntimeError) -> Response {
    error(
        status_of(&e, Route::Control),
        message_of(&e, Route::Control),
    )
}

/// A JSON body, or E2B's 400.
pub(super) fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, Response> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}" as &[u8]
    } else {
        body
    };
    kiln_http::objects::from_slice(body).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            format!("invalid request body: {e}"),
        )
    })
}

/// What `POST /sandboxes` and `POST /v2/sandboxes` take. Fields kiln does not use
/// (`autoPause`, `mcp`, `network`, …) are accepted and ignored.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    /// Seconds.
    timeout: Option<u64>,
    metadata: Option<BTreeMap<String, String>>,
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    /// `{"allowPublicTraffic": false}` makes the box's servers (`get_host`) need the
    /// sandbox's traffic token; E2B's default lets anyone reach them. `allowOut`,
    /// `denyOut` and `rules` are the sandbox's egress rules.
    network: Option<super::egress::NetworkOptions>,
    /// `lifecycle={"on_timeout": "pause"}`: the timeout pauses the sandbox, not kills it.
    auto_pause: Option<bool>,
    /// `lifecycle={"auto_resume": …}`: whether a request to a paused sandbox resumes it
    /// (kiln's default: yes).
    auto_resume: Option<AutoResume>,
    /// `volume_mounts={"/mnt/vol": volume}`: the tenant's named volumes, by name.
    volume_mounts: Option<Vec<E2bVolumeMount>>,
    /// Workload identity tokens: kiln mints none (refused when any is asked for).
    iam: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct E2bVolumeMount {
    name: String,
    path: String,
}

#[derive(Debug, Deserialize)]
struct AutoResume {
    enabled: bool,
}

/// The most metadata entries, and the longest key and value.
const MAX_METADATA: usize = 64;
const MAX_METADATA_KEY: usize = 256;
const MAX_METADATA_VALUE: usize = 4096;

/// The template an E2B template name means: `base` a live sandbox with processes (a Linux
/// template, python's first), `base-vm` the same as a microVM (`vm-python`),
/// `code-interpreter-v1` an ephemeral Python template (WebAssembly
/// Python with the scientific stack); any other name as kiln's catalogue resolves it
/// (`linux-node`, `node:18`, `python`, …).
pub fn template_for(e2b: &E2b, name: &str) -> Result<TemplateInfo, Response> {
    let catalogue = e2b.app.runtime.catalogue();
    let linux = |preferred: &str| {
        let all = catalogue.templates();
        all.iter()
            .find(|t| t.id == preferred)
            .or_else(|| all.iter().find(|t| t.capabilities.processes))
            .cloned()
    };
    let found = match name {
        "base" | "" => linux("linux-python").ok_or_else(|| {
            error(
                StatusCode::BAD_REQUEST,
                "the template \"base\" is a Linux sandbox, and this server runs none: start it with `kiln serve --linux` (after `kiln setup --template all`), or use \"code-interpreter-v1\" (WebAssembly Python)",
            )
        })?,
        "base-vm" => catalogue
            .templates()
            .iter()
            .find(|t| t.id == "vm-python")
            .cloned()
            .ok_or_else(|| {
                error(
                    StatusCode::BAD_REQUEST,
                    "the template \"base-vm\" is a Linux microVM, and this server runs none: start it with `kiln serve --linux --vm` (kiln doctor says whether this host can), or use \"base\" (a Linux box)",
                )
            })?,
        "code-interpreter-v1" | "code-interpreter" => catalogue
            .templates()
            .iter()
            .find(|t| !t.capabilities.processes && t.languages.contains(&kiln_core::Language::Python))
            .cloned()
            .ok_or_else(|| error(StatusCode::BAD_REQUEST, "this server has no Python template"))?,
        other => catalogue.resolve(other).cloned().map_err(|unknown| {
            error(StatusCode::NOT_FOUND, format!("template '{other}' not found: {unknown}"))
        })?,
    };
    Ok(found)
}

fn check_labels(what: &str, labels: &BTreeMap<String, String>) -> Result<(), Response> {
    let bad = labels.len() > MAX_METADATA
        || labels.iter().any(|(k, v)| {
            k.is_empty()
                || k.len() > MAX_METADATA_KEY
                || v.len() > MAX_METADATA_VALUE
                || k.contains('\0')
                || v.contains('\0')
        });
    if bad {
        return Err(error(
            StatusCode::BAD_REQUEST,
            format!(
                "{what}: at most {MAX_METADATA} entries, keys of 1..={MAX_METADATA_KEY} bytes, values of at most {MAX_METADATA_VALUE}, no NUL"
            ),
        ));
    }
    Ok(())
}

async fn create(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    body: bytes::Bytes,
) -> Response {
    let asked: NewSandbox = match parse(&body) {
        Ok(asked) => asked,
        Err(response) => return response,
    };
    match create_sandbox(&e2b, &caller, asked).await {
        Ok(sandbox) => (
            StatusCode::CREATED,
            axum::Json(sandbox_json(&e2b, &sandbox)),
        )
            .into_response(),
        Err(response) => response,
    }
}

async fn create_sandbox(
    e2b: &E2b,
    caller: &Caller,
    asked: NewSandbox,
) -> Result<Sandbox, Response> {
    if asked
        .iam
        .as_ref()
        .and_then(|iam| iam.get("tokens"))
        .and_then(Value::as_object)
        .is_some_and(|tokens| !tokens.is_empty())
    {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "iam: kiln mints no workload identity tokens; keep a credential as a secret (Secret.create) and put it in requests with a network rule's header (Secret.fill)",
        ));
    }
    let timeout_s = asked.timeout.unwrap_or(300);
    let lifetime_ms = lifetime(timeout_s)?;
    let metadata = asked.metadata.unwrap_or_default();
    check_labels("metadata", &metadata)?;
    // `Sandbox.create(snapshot_id)`: the snapshot's files, template and settings.
    if let Some(made) = super::snapshots::create_from(
        e2b,
        caller,
        &asked.template_id,
        lifetime_ms,
        metadata.clone(),
    )
    .await
    {
        return made;
    }
    let template = template_for(e2b, &asked.template_id)?;
    let env = asked.env_vars.unwrap_or_default();
    check_labels("metadata", &metadata)?;
    check_labels("envVars", &env)?;
    if let Some(name) = env.keys().find(|k| k.contains('=')) {
        return Err(error(
            StatusCode::BAD_REQUEST,
            format!("envVars: the name {name:?} holds '='"),
        ));
    }
    let rt = &e2b.app.runtime;
    let mut spec = SandboxSpec::of_template(
        &asked.template_id,
        &template,
        lifetime_ms,
        kiln_core::Limits::default()
            .memory_bytes
            .max(template.resources.map_or(0, |r| r.memory_mb << 20)),
    );
    // E2B's SDKs ask for the internet by default; a sandbox that can have a network gets
    // the operator's allowlist, and one that cannot has none to grant (it is not an error).
    // `allow_internet_access: false` is, as E2B defines it, a deny of all traffic (so a
    // later update can open some); egress rules need a template with a network.
    let options = asked.network.as_ref();
    let rules = options.is_some_and(super::egress::NetworkOptions::has_rules);
    if rules && !template.capabilities.network {
        return Err(error(
            StatusCode::BAD_REQUEST,
            format!(
                "network rules need a sandbox with a network: the template {} has none (use \"base\", a Linux sandbox)",
                asked.template_id
            ),
        ));
    }
    if template.capabilities.network && (asked.allow_internet_access.is_some() || rules) {
        let empty = super::egress::NetworkOptions::default();
        let egress = options
            .unwrap_or(&empty)
            .egress(asked.allow_internet_access)?;
        spec = spec
            .with_egress(rt.catalogue(), Some(egress))
            .map_err(failed)?;
    }
    spec.workspace_at = Some(HOME.to_owned());
    spec.metadata = metadata;
    spec.env = env;
    spec.access_token = Some(kiln_runtime::sandbox::random_hex(24));
    spec.public_ports = asked
        .network
        .as_ref()
        .and_then(|n| n.allow_public_traffic)
        .unwrap_or(true);
    let lifecycle = kiln_runtime::lifecycle::Lifecycle {
        on_timeout: asked
            .auto_pause
            .filter(|pause| *pause)
            .map(|_| kiln_runtime::lifecycle::OnTimeout::Pause),
        // Older SDKs send `autoResume` on every create; a sandbox that cannot pause has
        // nothing to resume, so it means nothing there.
        auto_resume: asked
            .auto_resume
            .filter(|_| template.capabilities.pause)
            .map(|a| a.enabled),
        ..Default::default()
    };
    if lifecycle != Default::default() {
        spec = spec
            .with_lifecycle(rt.catalogue(), Some(&lifecycle))
            .map_err(|e| error(StatusCode::BAD_REQUEST, e.to_string()))?;
    }
    let mounts: Vec<kiln_runtime::volumes::VolumeMount> = asked
        .volume_mounts
        .unwrap_or_default()
        .into_iter()
        .map(|m| kiln_runtime::volumes::VolumeMount {
            volume: m.name,
            path: m.path,
            read_only: false,
        })
        .collect();
    spec = spec
        .with_volumes(
            rt.catalogue(),
            &rt.registry.volumes,
            &caller.tenant,
            &mounts,
        )
        .map_err(failed)?;
    exec::create_sandbox(rt, caller, spec).await.map_err(failed)
}

/// A timeout in seconds as a lifetime, within kiln's bounds.
fn lifetime(timeout_s: u64) -> Result<u64, Response> {
    let ms = timeout_s.saturating_mul(1000).max(1000);
    if ms > MAX_LIFETIME_MS {
        return Err(error(
            StatusCode::BAD_REQUEST,
            format!(
                "timeout {timeout_s} s is longer than kiln's longest sandbox life, {} s",
                MAX_LIFETIME_MS / 1000
            ),
        ));
    }
    Ok(ms)
}

/// E2B's `Sandbox`: what create and connect answer.
pub(super) fn sandbox_json(e2b: &E2b, sandbox: &Sandbox) -> Value {
    json!({
        "templateID": sandbox.image,
        "sandboxID": e2b_id(&sandbox.id),
        "alias": sandbox.template(),
        "clientID": "kiln",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": sandbox.access_token,
        "trafficAccessToken": sandbox.access_token,
        "domain": e2b.config.domain,
    })
}

fn cpu_count(sandbox: &Sandbox) -> u64 {
    sandbox
        .resources
        .map_or(1, |r| (r.vcpus.ceil() as u64).max(1))
}

/// A sandbox's disk: its volume's size, or the tenant's workspace quota where it has none.
fn disk_mb(workspace_quota: u64, sandbox: &Sandbox) -> u64 {
    sandbox
        .resources
        .map_or(workspace_quota >> 20, |r| r.disk_mb)
}

/// E2B's `ListedSandbox` (and, with the token, `SandboxDetail`).
fn listed_json(
    e2b: &E2b,
    workspace_quota: u64,
    sandbox: &Sandbox,
    state: &str,
    detail: bool,
) -> Value {
    let mut value = json!({
        "templateID": sandbox.image,
        "alias": sandbox.template(),
        "sandboxID": e2b_id(&sandbox.id),
        "clientID": "kiln",
        "startedAt": rfc3339(sandbox.created_ms),
        "endAt": rfc3339(sandbox.expires_ms),
        "cpuCount": cpu_count(sandbox),
        "memoryMB": sandbox.memory_bytes >> 20,
        "diskSizeMB": disk_mb(workspace_quota, sandbox),
        "state": state,
        "envdVersion": ENVD_VERSION,
        "metadata": sandbox.metadata,
    });
    if detail {
        value["envdAccessToken"] = json!(sandbox.access_token);
        value["domain"] = json!(e2b.config.domain);
        value["allowInternetAccess"] = json!(super::egress::internet(sandbox));
        value["network"] = super::egress::network_json(sandbox);
        let volumes = &e2b.app.runtime.registry.volumes;
        value["volumeMounts"] = json!(
            sandbox
                .volume_mounts
                .iter()
                .map(|m| json!({
                    "name": volumes.find(&sandbox.tenant, &m.volume).map_or(m.volume.clone(), |v| v.name),
                    "path": m.path,
                }))
                .collect::<Vec<_>>()
        );
        value["lifecycle"] = json!({
            "onTimeout": if sandbox.lifecycle.pauses_on_timeout() { "pause" } else { "kill" },
            "autoResume": sandbox.lifecycle.auto_resume(),
        });
    }
    value
}

/// An E2B sandbox of the caller (others, and kiln's own sandboxes, are not found).
pub(super) fn find(e2b: &E2b, caller: &Caller, id: &str) -> Result<Sandbox, Response> {
    let view = e2b
        .app
        .runtime
        .registry
        .get(&caller.tenant, &kiln_id(id))
        .map_err(failed)?;
    if view.meta.access_token.is_none() {
        return Err(failed(RuntimeError::SandboxNotFound { id: id.to_owned() }));
    }
    Ok(view.meta)
}

async fn info(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Response {
    match find(&e2b, &caller, &id) {
        Ok(sandbox) => {
            let quota = e2b.app.runtime.quotas(&caller).workspace_bytes;
            let state = e2b_state(&e2b, &sandbox).await;
            axum::Json(listed_json(&e2b, quota, &sandbox, state, true)).into_response()
        }
        Err(response) => response,
    }
}

async fn kill(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Response {
    if let Err(response) = find(&e2b, &caller, &id) {
        return response;
    }
    match e2b.app.runtime.delete_sandbox(&caller, &kiln_id(&id)).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => failed(e),
    }
}

#[derive(Debug, Deserialize)]
struct Timeout {
    timeout: Option<u64>,
}

/// The `{"timeout": seconds}` of a body, as a lifetime in milliseconds, if it has one.
fn timeout_ms(body: &[u8]) -> Result<Option<u64>, Response> {
    let asked: Timeout = parse(body)?;
    asked.timeout.map(lifetime).transpose()
}

async fn set_timeout(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    body: bytes::Bytes,
) -> Response {
    let ms = match timeout_ms(&body) {
        Ok(Some(ms)) => ms,
        Ok(None) => return error(StatusCode::BAD_REQUEST, "timeout (seconds) is required"),
        Err(response) => return response,
    };
    if let Err(response) = find(&e2b, &caller, &id) {
        return response;
    }
    match e2b
        .app
        .runtime
        .registry
        .renew(&caller.tenant, &kiln_id(&id), ms)
    {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => failed(e),
    }
}

/// Connects to (resumes) a sandbox: its life is extended to `timeout` from now, never
/// shortened.
async fn connect(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    body: bytes::Bytes,
) -> Response {
    let asked = match timeout_ms(&body) {
        Ok(asked) => asked,
        Err(response) => return response,
    };
    let mut sandbox = match find(&e2b, &caller, &id) {
        Ok(sandbox) => sandbox,
        Err(response) => return response,
    };
    if let Some(ms) = asked
        && now_ms().saturating_add(ms) > sandbox.expires_ms
    {
        match e2b
            .app
            .runtime
            .registry
            .renew(&caller.tenant, &kiln_id(&id), ms)
        {
            Ok(renewed) => sandbox = renewed,
            Err(e) => return failed(e),
        }
    }
    // Connecting to a paused sandbox resumes it (E2B answers 201 then, 200 when it ran).
    if e2b_state(&e2b, &sandbox).await == "paused" {
        if let Err(e) =
            kiln_runtime::processes::set_paused(&e2b.app.runtime, &caller, &sandbox.id, false).await
        {
            return failed(e);
        }
        return (
            StatusCode::CREATED,
            axum::Json(sandbox_json(&e2b, &sandbox)),
        )
            .into_response();
    }
    axum::Json(sandbox_json(&e2b, &sandbox)).into_response()
}

/// E2B's state of a sandbox: `paused` while its box is frozen, else `running`.
async fn e2b_state(e2b: &E2b, sandbox: &Sandbox) -> &'static str {
    match kiln_runtime::processes::box_state(&e2b.app.runtime, sandbox).await {
        Some(kiln_core::process::BoxState::Paused) => "paused",
        _ => "running",
    }
}

/// `POST /sandboxes/{id}/pause`: a Linux sandbox's box is frozen (its processes, memory and
/// files kept); `connect` or any command resumes it. 409 when it is paused already, as
/// E2B answers.
async fn pause(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Response {
    let sandbox = match find(&e2b, &caller, &id) {
        Ok(sandbox) => sandbox,
        Err(response) => return response,
    };
    if !kiln_runtime::processes::runs_processes(&e2b.app.runtime, &sandbox) {
        return error(
            StatusCode::NOT_IMPLEMENTED,
            "kiln pauses Linux sandboxes only (a WebAssembly sandbox has no box to freeze yet): extend its life with set_timeout instead",
        );
    }
    if e2b_state(&e2b, &sandbox).await == "paused" {
        return error(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        );
    }
    match kiln_runtime::processes::set_paused(&e2b.app.runtime, &caller, &sandbox.id, true).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => failed(e),
    }
}

/// `GET /sandboxes/{id}/metrics`: one sample, now.
async fn metrics(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Response {
    let sandbox = match find(&e2b, &caller, &id) {
        Ok(sandbox) => sandbox,
        Err(response) => return response,
    };
    let usage = e2b.app.runtime.usage_of(&sandbox).await;
    let quota = e2b.app.runtime.quotas(&caller).workspace_bytes;
    let now = now_ms();
    let cpus = cpu_count(&sandbox);
    axum::Json(json!([{
        "timestamp": rfc3339(now),
        "timestampUnix": now / 1000,
        "cpuCount": cpus,
        "cpuUsedPct": usage.cpu_used_pct,
        "memUsed": usage.memory_bytes,
        "memTotal": sandbox.memory_bytes,
        "memCache": 0,
        "diskUsed": usage.disk_bytes,
        "diskTotal": disk_mb(quota, &sandbox) << 20,
    }]))
    .into_response()
}

/// `GET /v2/sandboxes` (and v1's `GET /sandboxes`): the caller's E2B sandboxes, filtered by
/// metadata, state, template and start, in order, a page at a time (`x-next-token`).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListQuery {
    metadata: Option<String>,
    state: Option<String>,
    order: Option<String>,
    started_after: Option<String>,
    template: Option<String>,
    next_token: Option<String>,
    limit: Option<usize>,
}

async fn list(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(query)) = query else {
        return error(StatusCode::BAD_REQUEST, "invalid query parameters");
    };
    let wanted: Vec<(String, String)> = match query.metadata.as_deref() {
        None | Some("") => Vec::new(),
        Some(text) => match serde_urlencoded::from_str(text) {
            Ok(pairs) => pairs,
            Err(e) => return error(StatusCode::BAD_REQUEST, format!("metadata: {e}")),
        },
    };
    let states: Option<Vec<String>> = query
        .state
        .as_deref()
        .map(|s| s.split(',').map(|s| s.trim().to_string()).collect());
    let after_ms = match query.started_after.as_deref().map(parse_rfc3339) {
        None => None,
        Some(Some(ms)) => Some(ms),
        Some(None) => {
            return error(
                StatusCode::BAD_REQUEST,
                "startedAfter is not an RFC 3339 time",
            );
        }
    };
    let limit = query.limit.unwrap_or(100).clamp(1, 1000);
    let (views, _) = e2b
        .app
        .runtime
        .registry
        .list(&caller.tenant, None, usize::MAX);
    let all: Vec<Sandbox> = views
        .into_iter()
        .map(|v| v.meta)
        .filter(|s| s.access_token.is_some())
        .filter(|s| wanted.iter().all(|(k, v)| s.metadata.get(k) == Some(v)))
        .filter(|s| after_ms.is_none_or(|after| s.created_ms > after))
        .filter(|s| {
            query
                .template
                .as_deref()
                .is_none_or(|t| s.image == t || s.template() == t)
        })
        .collect();
    let mut stated = Vec::with_capacity(all.len());
    for sandbox in all {
        let state = e2b_state(&e2b, &sandbox).await;
        if states
            .as_ref()
            .is_none_or(|wanted| wanted.iter().any(|w| w == state))
        {
            stated.push((sandbox, state));
        }
    }
    let mut all = stated;
    if query.order.as_deref() == Some("desc") {
        all.reverse();
    }
    let start = match query.next_token.as_deref() {
        None | Some("") => 0,
        Some(token) => match all.iter().position(|(s, _)| e2b_id(&s.id) == token) {
            Some(at) => at + 1,
            None => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "nextToken is not a token this server gave",
                );
            }
        },
    };
    let page: Vec<&(Sandbox, &str)> = all[start.min(all.len())..].iter().take(limit).collect();
    let more = start + page.len() < all.len();
    let quota = e2b.app.runtime.quotas(&caller).workspace_bytes;
    let body: Vec<Value> = page
        .iter()
        .map(|(s, state)| listed_json(&e2b, quota, s, state, false))
        .collect();
    let mut response = axum::Json(body).into_response();
    if more
        && let Some((last, _)) = page.last()
        && let Ok(value) = HeaderValue::from_str(e2b_id(&last.id))
    {
        response.headers_mut().insert("x-next-token", value);
    }
    response
}

/// Milliseconds since the epoch of an RFC 3339 time (`2026-11-25T10:00:00.5+01:00`).
pub fn parse_rfc3339(text: &str) -> Option<u64> {
    let text = text.trim();
    let (date, rest) = text.split_once(['T', 't', ' '])?;
    let mut date = date.split('-');
    let year: i64 = date.next()?.parse().ok()?;
    let month: i64 = date.next()?.parse().ok()?;
    let day: i64 = date.next()?.parse().ok()?;
    let (clock, offset_s) = if let Some(clock) = rest.strip_suffix(['Z', 'z']) {
        (clock, 0)
    } else if let Some(at) = rest.rfind(['+', '-']) {
        let (clock, zone) = rest.split_at(at);
        let sign = if zone.starts_with('-') { -1 } else { 1 };
        let (h, m) = zone[1..].split_once(':').unwrap_or((&zone[1..], "0"));
        (
            clock,
            sign * (h.parse::<i64>().ok()? * 3600 + m.parse::<i64>().ok()? * 60),
        )
    } else {
        (rest, 0)
    };
    let mut clock = clock.split(':');
    let hour: i64 = clock.next()?.parse().ok()?;
    let minute: i64 = clock.next()?.parse().ok()?;
    let seconds: f64 = clock.next().unwrap_or("0").parse().ok()?;
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hour * 3600 + minute * 60 - offset_s;
    let ms = secs as f64 * 1000.0 + seconds * 1000.0;
    (ms >= 0.0).then_some(ms as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_times_parse_with_any_offset() {
        let z = parse_rfc3339("2026-11-25T10:00:00Z").unwrap();
        assert_eq!(rfc3339(z), "2026-11-25T10:00:00.000Z");
        assert_eq!(parse_rfc3339("2026-11-25T11:00:00+01:00"), Some(z));
        assert_eq!(
            parse_rfc3339("2026-11-25T09:30:00.250-00:30"),
            Some(z + 250)
        );
        assert_eq!(parse_rfc3339("2026-11-25T10:00:00.123456"), Some(z + 123));
        for bad in ["", "yesterday", "2026-13-01T00:00:00Z", "2026-11-25"] {
            assert_eq!(parse_rfc3339(bad), None, "{bad:?}");
        }
    }
}
