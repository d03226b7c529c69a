//! `/api/v1`: the versioned API for apps and agents. Sandboxes (list with paging, create,
//! get, renew, delete), executions (plain, streamed as Server-Sent Events or over a
//! WebSocket, cancellable), stateful sessions, and binary-safe files.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Extension, Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use kiln_core::backend::StreamKind;
use kiln_executor::Chunk;
use kiln_http::{HttpError, JsonObject as JsonBody};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::mpsc;
use utoipa::{IntoParams, ToSchema};

use crate::AppState;
use crate::api::{self, SandboxInfo};
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::exec::{self, CodeExec, RunOutcome, RunSpec};
use kiln_runtime::files::{self, FileChange, FileList};
use kiln_runtime::sessions::{self, SessionInfo};

pub(crate) type Shared = State<Arc<AppState>>;

/// Most sandboxes one page lists.
pub const MAX_PAGE: usize = 500;
/// Largest file one upload may carry: 32 MiB (the body limit).
pub const MAX_FILE_BYTES: usize = crate::MAX_BODY_BYTES;

pub(crate) fn path_error(rejection: PathRejection) -> ApiError {
    ApiError::bad_request(
        "INVALID_PATH",
        format!("bad path in the URL: {}", rejection.body_text()),
    )
}

fn query_error(rejection: QueryRejection) -> ApiError {
    ApiError::bad_request("INVALID_QUERY", rejection.body_text())
}

// ---------------------------------------------------------------- sandboxes

/// Create a sandbox.
#[derive(Debug, Deserialize, ToSchema)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary, Serialize))]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"language": "python", "timeoutMs": 600000, "memoryLimit": "512m"}))]
pub struct NewSandbox {
    /// `python` or `javascript` (or an image name as in `/api/sandbox`). Default `python`.
    #[serde(alias = "image")]
    pub language: Option<String>,
    /// A template by its id (`GET /api/v1/templates`: `python-data`, `linux-python`, …):
    /// the same as `image`; both may be sent when they name the same template.
    #[schema(example = "python-data")]
    pub template: Option<String>,
    /// A fixed life in milliseconds (at least 1 second, at most 24 hours; renewable with
    /// `POST .../renew`). Without one the sandbox has no fixed end: it lives until
    /// `lifecycle.terminateAfterIdleMs` (default 7 days) pass with no request to it.
    #[schema(minimum = 1000, maximum = 86400000)]
    pub timeout_ms: Option<u64>,
    /// Memory cap per execution, e.g. "512m".
    pub memory_limit: Option<String>,
    /// `none` (default) or `allowlist` (Linux templates: the server's allowlisted host
    /// names, such as the package indexes, through its proxy).
    pub network: Option<String>,
    /// The sandbox's own egress rules (Linux templates; implies `network: "allowlist"`):
    /// `allowOut` and `denyOut` (host names, `*.domain`, addresses and ranges, each with an
    /// optional `:port`; `0.0.0.0/0` for all: a destination is reached when `allowOut`
    /// names it or `denyOut` does not), within the operator's allowlist unless the key may
    /// widen it; `rules` set headers on HTTP(S) requests to named hosts, with
    /// `${secrets.NAME}` filled by kiln's proxy from the tenant's secrets. Replace them
    /// later with `PUT /api/v1/sandboxes/{id}/network`.
    pub network_rules: Option<kiln_core::net::Egress>,
    /// Named volumes to mount (`POST /api/v1/volumes` makes them): `[{"volume": "datasets",
    /// "path": "/mnt/data", "readOnly": false}]`, at most 8. Linux boxes bind them,
    /// WebAssembly guests see them as folders.
    pub volume_mounts: Option<Vec<kiln_runtime::volumes::VolumeMount>>,
    /// Seed 002's limits of the sandbox's box (`vcpus`, `disk_mb`, `pids`: Linux templates;
    /// `memory_mb` anywhere, instead of `memoryLimit`): what it leaves out is the template's.
    pub resources: Option<kiln_core::template::ResourceRequest>,
    /// When it ends and what becomes of its box when idle (seed 002's `idle_timeout`,
    /// `max_duration`, `persistence`, `allowed_ports`; E2B's `onTimeout` and `autoResume`).
    pub lifecycle: Option<kiln_runtime::lifecycle::Lifecycle>,
    /// Let anyone who can reach kiln open the previews of its box's servers
    /// (`/preview/{id}/{port}/…`, and `{port}-{id}.DOMAIN`) without a key or a link, within
    /// `lifecycle.allowedPorts`; their requests count against the owner's rate limit.
    /// Default false. Linux templates.
    pub public_previews: Option<bool>,
    /// Start from a snapshot (`snap_…` or its name; `POST …/snapshots` takes them): its
    /// files, history, template, resources, network and volumes. Only `timeoutMs` may be
    /// given beside it.
    pub snapshot: Option<String>,
}

/// Create a sandbox.
#[utoipa::path(post, path = "/api/v1/sandboxes", tag = "v1 sandboxes", request_body = NewSandbox,
    responses(
        (status = 201, description = "Created", body = SandboxInfo),
        (status = 400, description = "Bad option", body = ErrorBody),
        (status = 401, description = "No or bad API key", body = ErrorBody),
    ))]
pub async fn create(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    body: Result<JsonBody<NewSandbox>, HttpError>,
) -> Result<(StatusCode, Json<SandboxInfo>), ApiError> {
    let JsonBody(body) = body?;
    if let Some(snapshot) = &body.snapshot {
        let others = body.language.is_some()
            || body.template.is_some()
            || body.memory_limit.is_some()
            || body.network.is_some()
            || body.network_rules.is_some()
            || body.volume_mounts.is_some()
            || body.resources.is_some()
            || body.lifecycle.is_some()
            || body.public_previews.is_some();
        if others {
            return Err(ApiError::bad_request(
                "INVALID_OPTION",
                "a sandbox made from a snapshot is the snapshot's: give only `snapshot` and `timeoutMs`",
            ));
        }
        let made = kiln_runtime::snapshots::create_from(
            &state.runtime,
            &caller,
            snapshot,
            kiln_runtime::snapshots::FromSnapshot {
                lifetime_ms: body.timeout_ms,
                ..Default::default()
            },
        )
        .await?;
        let view = state
            .runtime
            .registry
            .get(&caller.tenant, &made.sandbox.id)?;
        return Ok((
            StatusCode::CREATED,
            Json(SandboxInfo::from_view(&view).described(state.runtime.catalogue())),
        ));
    }
    let spec = sandbox_spec(
        state.runtime.catalogue(),
        &state.runtime.registry.volumes,
        &caller.tenant,
        body,
    )?;
    let id = exec::create_sandbox(&state.runtime, &caller, spec)
        .await?
        .id;
    let view = state.runtime.registry.get(&caller.tenant, &id)?;
    Ok((
        StatusCode::CREATED,
        Json(SandboxInfo::from_view(&view).described(state.runtime.catalogue())),
    ))
}

/// Checks a create request (one not made from a snapshot) and turns it into the spec of
/// the sandbox to make: everything `POST /api/v1/sandboxes` checks before it makes anything.
/// (The fuzz target `api_requests` calls it with requests built by `arbitrary`.)
pub fn sandbox_spec(
    catalogue: &kiln_core::template::Catalogue,
    volumes: &kiln_runtime::volumes::Volumes,
    tenant: &str,
    body: NewSandbox,
) -> Result<kiln_runtime::sandbox::SandboxSpec, ApiError> {
    let image = kiln_runtime::sandbox::SandboxSpec::named_image(
        catalogue,
        body.language.as_deref(),
        body.template.as_deref(),
        "python",
    )?;
    Ok(kiln_runtime::sandbox::SandboxSpec::resolve(
        catalogue,
        &image,
        body.timeout_ms,
        body.memory_limit.as_deref(),
    )?
    .with_network(catalogue, body.network.as_deref())?
    .with_egress(
        catalogue,
        network_rules(body.network.as_deref(), body.network_rules)?,
    )?
    .with_resources(body.resources.as_ref(), body.memory_limit.is_some())?
    .with_lifecycle(catalogue, body.lifecycle.as_ref())?
    .with_volumes(
        catalogue,
        volumes,
        tenant,
        body.volume_mounts.as_deref().unwrap_or_default(),
    )?
    .with_public_previews(catalogue, body.public_previews.unwrap_or(false))?)
}

/// Rules given with a network of `network` (`none` and rules contradict each other).
pub fn network_rules(
    network: Option<&str>,
    rules: Option<kiln_core::net::Egress>,
) -> Result<Option<kiln_core::net::Egress>, ApiError> {
    if network == Some("none") && rules.is_some() {
        return Err(ApiError::bad_request(
            "INVALID_OPTION",
            "networkRules need a network: leave out `network: \"none\"` (rules imply \"allowlist\")",
        ));
    }
    Ok(rules)
}

/// Replace a sandbox's egress rules (Linux sandboxes made with a network). The body
/// replaces the rules whole, as E2B's update does: `{}` leaves the operator's allowlist
/// alone in force. They apply at once: a connection already open that they refuse is closed.
#[utoipa::path(put, path = "/api/v1/sandboxes/{id}/network", tag = "v1 sandboxes",
    request_body = kiln_core::net::Egress,
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 200, description = "Replaced", body = SandboxInfo),
        (status = 400, description = "A bad rule, or a sandbox without a network", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn set_network(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    body: Result<JsonBody<kiln_core::net::Egress>, HttpError>,
) -> Result<Json<SandboxInfo>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let JsonBody(body) = body?;
    kiln_runtime::network::set_network(&state.runtime, &caller, &id, Some(body)).await?;
    let view = state.runtime.registry.get(&caller.tenant, &id)?;
    Ok(Json(
        SandboxInfo::from_view(&view).described(state.runtime.catalogue()),
    ))
}

/// Paging.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct Page {
    /// Most sandboxes to return (1..=500, default 50).
    #[param(minimum = 1, maximum = 500)]
    pub limit: Option<usize>,
    /// `nextCursor` from the previous page.
    pub cursor: Option<String>,
}

/// One page of sandboxes.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxPage {
    pub sandboxes: Vec<SandboxInfo>,
    /// Pass as `cursor` for the next page; absent on the last.
    pub next_cursor: Option<String>,
}

/// The caller's sandboxes, oldest first, a page at a time.
#[utoipa::path(get, path = "/api/v1/sandboxes", tag = "v1 sandboxes", params(Page),
    responses(
        (status = 200, description = "A page", body = SandboxPage),
        (status = 400, description = "Bad paging", body = ErrorBody),
    ))]
pub async fn list(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    page: Result<Query<Page>, QueryRejection>,
) -> Result<Json<SandboxPage>, ApiError> {
    let Query(page) = page.map_err(query_error)?;
    let limit = page.limit.unwrap_or(50);
    if limit == 0 || limit > MAX_PAGE {
        return Err(ApiError::bad_request(
            "INVALID_QUERY",
            format!("limit must be 1..={MAX_PAGE}"),
        ));
    }
    let (views, next) = state
        .runtime
        .registry
        .list(&caller.tenant, page.cursor.as_deref(), limit);
    let workspaces = &state.runtime.registry.workspaces;
    Ok(Json(SandboxPage {
        // A workspace's sandbox is listed to its owner and writers only.
        sandboxes: views
            .iter()
            .filter(|v| workspaces.may_use_sandbox(&caller, &v.meta.id))
            .map(SandboxInfo::from_view)
            .collect(),
        next_cursor: next,
    }))
}

/// A sandbox.
#[utoipa::path(get, path = "/api/v1/sandboxes/{id}", tag = "v1 sandboxes",
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 200, description = "The sandbox", body = SandboxInfo),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn get(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<SandboxInfo>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let view = state.runtime.registry.get(&caller.tenant, &id)?;
    let mut info = SandboxInfo::from_view(&view).described(state.runtime.catalogue());
    info.state = kiln_runtime::processes::box_state(&state.runtime, &view.meta)
        .await
        .map(crate::boxes::state_name);
    Ok(Json(info))
}

/// Delete a sandbox (a running execution is cancelled).
#[utoipa::path(delete, path = "/api/v1/sandboxes/{id}", tag = "v1 sandboxes",
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn delete(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
) -> Result<StatusCode, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    state.runtime.delete_sandbox(&caller, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Extend a sandbox's life.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"timeoutMs": 1800000}))]
pub struct Renew {
    /// The new lifetime, from now, in milliseconds (at least 1 second, at most 24 hours).
    #[schema(minimum = 1000, maximum = 86400000)]
    pub timeout_ms: u64,
}

/// Renew a sandbox's lifetime (TTL), counted from now.
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/renew", tag = "v1 sandboxes", request_body = Renew,
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 200, description = "Renewed", body = SandboxInfo),
        (status = 400, description = "Bad lifetime", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn renew(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    body: Result<JsonBody<Renew>, HttpError>,
) -> Result<Json<SandboxInfo>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let JsonBody(body) = body?;
    if !(api::MIN_LIFETIME_MS..=api::MAX_LIFETIME_MS).contains(&body.timeout_ms) {
        return Err(ApiError::bad_request(
            "INVALID_OPTION",
            format!(
                "timeoutMs must be {}..={}",
                api::MIN_LIFETIME_MS,
                api::MAX_LIFETIME_MS
            ),
        ));
    }
    state
        .runtime
        .registry
        .renew(&caller.tenant, &id, body.timeout_ms)?;
    Ok(Json(SandboxInfo::from_view(
        &state.runtime.registry.get(&caller.tenant, &id)?,
    )))
}

// ---------------------------------------------------------------- executions

/// Run code.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary, Serialize))]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"code": "import sys\nprint(sys.version)", "timeoutMs": 10000}))]
pub struct Execute {
    /// The program text (or give `command`).
    pub code: Option<String>,
    /// A command to run instead of code, as an argv (`["python3", "main.py"]`,
    /// `["bash", "-c", "ls"]`): Linux templates only.
    pub command: Option<Vec<String>>,
    /// `python` or `javascript`; default the sandbox's.
    pub language: Option<String>,
    /// Standard input, as text.
    #[serde(default)]
    pub stdin: String,
    /// Environment variables the code sees (nothing else of the host's).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Time limit in milliseconds (default and most: 5 minutes, or what is left of the
    /// sandbox's life).
    #[schema(minimum = 1, maximum = 300000)]
    pub timeout_ms: Option<u64>,
    /// An instruction budget in fuel units (about one per WebAssembly instruction), for a
    /// one-shot on a WebAssembly template: the run stops with outcome `fuel_exhausted` when
    /// it is spent, at the same point on every run of the same code. `timeoutMs` still
    /// holds (sleeping costs no fuel). The server's first request with a budget compiles the
    /// runtime with fuel counting (Python: about 90 s) unless `kiln setup --fuel` did.
    #[schema(minimum = 1, maximum = 1000000000000_u64, example = 2000000000_u64)]
    pub fuel: Option<u64>,
    /// Files to write into the workspace first (name → text).
    #[serde(default)]
    pub files: BTreeMap<String, String>,
    /// Run as a turn of this session (variables persist) instead of a fresh process.
    pub session_id: Option<String>,
    /// The workspace folder whose new and changed files come back in `files`; default
    /// `out` (`/workspace/out` in the sandbox).
    #[schema(example = "out")]
    pub output_dir: Option<String>,
}

/// What an execution produced.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Execution {
    #[schema(example = "python_run_3f2a9c1b7d4e5f60718293a4")]
    pub execution_id: String,
    /// `success`, `error` or `timeout`.
    #[schema(example = "success")]
    pub status: String,
    /// How it ended: `completed`, `output_truncated`, `timed_out`, `memory_limit`, `crashed`,
    /// `fuel_exhausted`.
    #[schema(example = "completed")]
    pub outcome: String,
    #[schema(example = 0)]
    pub exit_code: i32,
    #[schema(example = "3.15.0\n")]
    pub stdout: String,
    pub stderr: String,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    #[schema(example = 1.2)]
    pub duration_ms: f64,
    pub peak_memory_bytes: u64,
    /// The history commit recording the files it changed, if it changed any.
    pub commit_id: Option<String>,
    /// False when the code ran but the files it changed could not be recorded in the
    /// history (see `warnings`); the result above is still the run's own.
    pub history_recorded: bool,
    /// Things the client should know: the change was not recorded, or a file was left out
    /// of the history (too large, a fifo or device).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// Rich results in the order the code produced them (Python): a session cell's final
    /// value (`main`, with `text/plain` and `text/html` for a DataFrame), each `display(...)`,
    /// each matplotlib figure as `image/png` (base64). Absent when there are none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub results: Vec<kiln_core::RichResult>,
    /// Files the run added or changed under its output folder (`out/` unless the request
    /// names `outputDir`), base64, at most 32 files and 8 MiB (4 MiB each); a file over
    /// the bounds is listed with `omitted` instead of its bytes. Absent when there are none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<kiln_runtime::outputs::OutputFile>,
}

impl Execution {
    fn from_outcome(outcome: &RunOutcome) -> Execution {
        let kind = serde_json::to_value(&outcome.result.outcome)
            .ok()
            .and_then(|v| v.get("kind").and_then(|k| k.as_str()).map(str::to_owned))
            .unwrap_or_default();
        Execution {
            execution_id: outcome.exec_id.clone(),
            status: outcome.status().into(),
            outcome: kind,
            exit_code: outcome.result.exit_code,
            stdout: outcome.result.stdout_text(),
            stderr: outcome.stderr_with_reason(),
            stdout_truncated: outcome.result.stdout_truncated,
            stderr_truncated: outcome.result.stderr_truncated,
            duration_ms: outcome.result.duration_us as f64 / 1000.0,
            peak_memory_bytes: outcome.result.peak_memory_bytes,
            commit_id: outcome.commit_id.clone(),
            history_recorded: outcome.history_recorded(),
            warnings: outcome.warnings(),
            results: outcome.result.results.clone(),
            files: outcome.outputs.clone(),
        }
    }
}

impl Execute {
    /// The runtime's request for this body.
    pub fn into_code(self) -> Result<CodeExec, ApiError> {
        if self.code.is_none() && self.command.is_none() {
            return Err(ApiError::bad_request(
                "INVALID_REQUEST",
                "give `code` to run, or `command` (an argv, on Linux templates)",
            )
            .with_details(serde_json::json!({"field": "code"})));
        }
        Ok(CodeExec {
            language: self.language.as_deref().map(exec::language).transpose()?,
            code: self.code.unwrap_or_default(),
            command: self.command,
            output_dir: self.output_dir,
            stdin: self.stdin.into_bytes(),
            env: self.env,
            timeout_ms: self.timeout_ms,
            fuel: self.fuel,
            files: self
                .files
                .into_iter()
                .map(|(name, text)| (name, text.into_bytes()))
                .collect(),
            session: self.session_id,
        })
    }
}

/// Checks an execution request against its sandbox and turns it into a run.
pub fn spec(
    state: &AppState,
    caller: &Caller,
    id: &str,
    body: Execute,
) -> Result<RunSpec, ApiError> {
    exec::prepare(&state.runtime, caller, id, body.into_code()?).map_err(ApiError::named_in_body)
}

/// Run code in a sandbox and wait for the result.
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/exec", tag = "v1 executions", request_body = Execute,
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 200, description = "It ran (see `status`)", body = Execution),
        (status = 400, description = "Bad request", body = ErrorBody),
        (status = 404, description = "No such sandbox or session", body = ErrorBody),
        (status = 409, description = "Busy, cancelled, deleted meanwhile, or session ended", body = ErrorBody),
        (status = 503, description = "Executor lost or saturated; retry", body = ErrorBody),
    ))]
pub async fn execute(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    body: Result<JsonBody<Execute>, HttpError>,
) -> Result<Json<Execution>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let JsonBody(body) = body?;
    let spec = spec(&state, &caller, &id, body)?;
    let outcome = exec::run(&state.runtime, &caller, &id, spec, None).await?;
    Ok(Json(Execution::from_outcome(&outcome)))
}

/// One Server-Sent Event of a streamed execution.
#[derive(Debug, Serialize, ToSchema)]
pub struct SseEvent {
    /// `start`, `stdout`, `stderr`, `result` or `error`.
    #[schema(example = "stdout")]
    pub event: String,
    /// JSON text: `{"executionId"}` for start, `{"data": text}` for output, an Execution for
    /// result, an error body for error.
    #[schema(example = "{\"data\": \"hello\\n\"}")]
    pub data: String,
}

/// Events of a streamed execution, in order: `start`, any number of `stdout`/`stderr`, then
/// `result` (an [`Execution`]) or `error` (an error body).
enum StreamEvent {
    Start(String),
    Output {
        stderr: bool,
        text: String,
    },
    /// A rich result as the code produced it (the final `result` lists them all again).
    Display(kiln_core::RichResult),
    Result(Box<Execution>),
    Error(ApiError),
}

impl StreamEvent {
    fn name(&self) -> &'static str {
        match self {
            StreamEvent::Start(_) => "start",
            StreamEvent::Output { stderr: false, .. } => "stdout",
            StreamEvent::Output { stderr: true, .. } => "stderr",
            StreamEvent::Display(_) => "display",
            StreamEvent::Result(_) => "result",
            StreamEvent::Error(_) => "error",
        }
    }

    fn json(&self) -> serde_json::Value {
        match self {
            StreamEvent::Start(id) => json!({ "executionId": id }),
            StreamEvent::Output { text, .. } => json!({ "data": text }),
            StreamEvent::Display(result) => serde_json::to_value(result).unwrap_or_default(),
            StreamEvent::Result(execution) => serde_json::to_value(execution).unwrap_or_default(),
            StreamEvent::Error(error) => json!({
                "error": { "code": error.code(), "message": error.message(), "details": error.details() }
            }),
        }
    }
}

/// Starts an execution whose events arrive on the returned channel.
fn start_streaming(
    state: Arc<AppState>,
    caller: Caller,
    id: String,
    mut spec: RunSpec,
) -> mpsc::UnboundedReceiver<StreamEvent> {
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let (chunks_tx, mut chunks_rx) = mpsc::unbounded_channel::<Chunk>();
    // `start` goes out once the sandbox is busy with this run, so a cancel sent after it
    // always finds the run (a run refused before it began sends only its error).
    let (begun_tx, begun_rx) = tokio::sync::oneshot::channel();
    spec.begun = Some(begun_tx);
    let exec_id = spec.exec_id.clone();
    let forward = events_tx.clone();
    let relay = tokio::spawn(async move {
        if begun_rx.await.is_ok() {
            let _ = forward.send(StreamEvent::Start(exec_id));
        }
        let mut carry = kiln_http::stream::OutputCarry::default();
        while let Some(chunk) = chunks_rx.recv().await {
            let stderr = match chunk.stream {
                StreamKind::Display => {
                    if let Ok(result) = serde_json::from_slice(&chunk.data) {
                        let _ = forward.send(StreamEvent::Display(result));
                    }
                    continue;
                }
                kind => kind == StreamKind::Stderr,
            };
            let text = carry.push(stderr, &chunk.data);
            if !text.is_empty() {
                let _ = forward.send(StreamEvent::Output { stderr, text });
            }
        }
        // A character the output's last bytes began and never finished.
        for (stderr, text) in carry.finish() {
            let _ = forward.send(StreamEvent::Output { stderr, text });
        }
    });
    tokio::spawn(async move {
        let ran = exec::run(&state.runtime, &caller, &id, spec, Some(chunks_tx)).await;
        // Every chunk is relayed before the result.
        let _ = relay.await;
        let _ = events_tx.send(match ran {
            Ok(outcome) => StreamEvent::Result(Box::new(Execution::from_outcome(&outcome))),
            Err(error) => StreamEvent::Error(error.into()),
        });
    });
    events_rx
}

/// Run code and stream its output as Server-Sent Events: `start` (`{"executionId"}`),
/// `stdout` / `stderr` (`{"data": text}`) as the code writes, then `result` (an Execution)
/// or `error`. Disconnecting does not stop the run; cancel it explicitly.
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/exec/stream", tag = "v1 executions", request_body = Execute,
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 200, description = "An event stream", content_type = "text/event-stream", body = SseEvent),
        (status = 400, description = "Bad request", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn execute_stream(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    body: Result<JsonBody<Execute>, HttpError>,
) -> Result<Sse<impl futures::Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let JsonBody(body) = body?;
    let spec = spec(&state, &caller, &id, body)?;
    // Refuse a busy sandbox before the stream starts, with a proper status.
    if let Some(running) = state.runtime.registry.get(&caller.tenant, &id)?.running {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "SANDBOX_BUSY",
            format!("sandbox {id} is running {running}; retry when it finishes (or cancel it)"),
        ));
    }
    let events = start_streaming(state, caller, id, spec);
    let stream = futures::stream::unfold(events, |mut events| async move {
        let event = events.recv().await?;
        Some((
            Ok(kiln_http::stream::sse(event.name(), &event.json())),
            events,
        ))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

/// A WebSocket for interactive use: send `{"type": "exec", ...Execute fields}`, receive
/// `{"type": "start" | "stdout" | "stderr" | "result" | "error", ...}`; send
/// `{"type": "cancel"}` to stop the running execution.
#[utoipa::path(get, path = "/api/v1/sandboxes/{id}/ws", tag = "v1 executions",
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 101, description = "Switching to the WebSocket protocol"),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn websocket(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    upgrade: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    state.runtime.registry.get(&caller.tenant, &id)?;
    Ok(upgrade
        .max_message_size(crate::MAX_BODY_BYTES)
        .on_upgrade(move |socket| serve_socket(socket, state, caller, id)))
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
enum ClientMessage {
    Exec(Box<Execute>),
    Cancel,
}

async fn serve_socket(mut socket: WebSocket, state: Arc<AppState>, caller: Caller, id: String) {
    let mut events: Option<mpsc::UnboundedReceiver<StreamEvent>> = None;
    loop {
        tokio::select! {
            message = socket.recv() => {
                let Some(Ok(message)) = message else { break };
                let text = match message {
                    Message::Text(text) => text.to_string(),
                    Message::Close(_) => break,
                    _ => continue,
                };
                match kiln_http::objects::from_str::<ClientMessage>(&text) {
                    Ok(ClientMessage::Exec(body)) => {
                        if events.is_some() {
                            let error = ApiError::new(StatusCode::CONFLICT, "SANDBOX_BUSY", "an execution is already running on this socket");
                            let _ = socket.send(kiln_http::stream::ws_text("error", StreamEvent::Error(error).json())).await;
                            continue;
                        }
                        match spec(&state, &caller, &id, *body) {
                            Ok(spec) => events = Some(start_streaming(state.clone(), caller.clone(), id.clone(), spec)),
                            Err(error) => {
                                let _ = socket.send(kiln_http::stream::ws_text("error", StreamEvent::Error(error).json())).await;
                            }
                        }
                    }
                    Ok(ClientMessage::Cancel) => {
                        let _ = state.runtime.registry.cancel(&caller.tenant, &id, None);
                    }
                    Err(e) => {
                        let error = ApiError::bad_request("MALFORMED_MESSAGE", format!("send {{\"type\": \"exec\", \"code\": ...}} or {{\"type\": \"cancel\"}}: {e}"));
                        let _ = socket.send(kiln_http::stream::ws_text("error", StreamEvent::Error(error).json())).await;
                    }
                }
            }
            event = next_event(&mut events) => {
                let Some(event) = event else {
                    events = None;
                    continue;
                };
                let last = matches!(event, StreamEvent::Result(_) | StreamEvent::Error(_));
                if socket.send(kiln_http::stream::ws_text(event.name(), event.json())).await.is_err() {
                    break;
                }
                if last {
                    events = None;
                }
            }
        }
    }
}

async fn next_event(
    events: &mut Option<mpsc::UnboundedReceiver<StreamEvent>>,
) -> Option<StreamEvent> {
    match events {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// A cancellation.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Cancelled {
    pub execution_id: String,
    /// Whether a running execution was stopped (false: it had already ended).
    pub cancelled: bool,
}

/// Cancel a running execution. Its request ends with 409 `EXECUTION_CANCELLED` (a stream
/// with an `error` event); a cancelled session turn ends the session.
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/executions/{execution_id}/cancel", tag = "v1 executions",
    params(("id" = String, Path, description = "The sandbox id"), ("execution_id" = String, Path, description = "The execution id")),
    responses(
        (status = 200, description = "Done", body = Cancelled),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn cancel(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    ids: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<Cancelled>, ApiError> {
    let Path((id, execution_id)) = ids.map_err(path_error)?;
    let cancelled = state
        .runtime
        .registry
        .cancel(&caller.tenant, &id, Some(&execution_id))?;
    Ok(Json(Cancelled {
        execution_id,
        cancelled,
    }))
}

// ---------------------------------------------------------------- sessions

/// Open a session.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"language": "python"}))]
pub struct NewSession {
    /// `python` or `javascript`; default the sandbox's.
    pub language: Option<String>,
}

/// Open a stateful session (a code context): variables, imports and definitions persist
/// between executions that name it in `sessionId`.
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/sessions", tag = "v1 sessions", request_body = NewSession,
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 201, description = "Opened", body = SessionInfo),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn create_session(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    body: Result<JsonBody<NewSession>, HttpError>,
) -> Result<(StatusCode, Json<SessionInfo>), ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let JsonBody(body) = body?;
    let language = body.language.as_deref().map(exec::language).transpose()?;
    let info = sessions::create(&state.runtime, &caller, &id, language).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

/// A sandbox's sessions.
#[derive(Debug, Serialize, ToSchema)]
pub struct SessionList {
    pub sessions: Vec<SessionInfo>,
}

/// The sandbox's sessions and whether each holds live state.
#[utoipa::path(get, path = "/api/v1/sandboxes/{id}/sessions", tag = "v1 sessions",
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 200, description = "Sessions", body = SessionList),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn list_sessions(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<SessionList>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let view = state.runtime.registry.get(&caller.tenant, &id)?;
    Ok(Json(SessionList {
        sessions: SandboxInfo::from_view(&view).sessions,
    }))
}

/// Restart a session: its state is dropped and a fresh one takes its id.
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/sessions/{session_id}/restart", tag = "v1 sessions",
    params(("id" = String, Path, description = "The sandbox id"), ("session_id" = String, Path, description = "The session id")),
    responses(
        (status = 200, description = "Restarted", body = SessionInfo),
        (status = 404, description = "No such sandbox or session", body = ErrorBody),
        (status = 409, description = "The sandbox is busy", body = ErrorBody),
    ))]
pub async fn restart_session(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    ids: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<SessionInfo>, ApiError> {
    let Path((id, session)) = ids.map_err(path_error)?;
    let info = sessions::restart(&state.runtime, &caller, &id, &session).await?;
    Ok(Json(info))
}

/// Fork a session.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"withWorkspace": false}))]
pub struct ForkSession {
    /// `false` (default): the fork is a new session of this sandbox, sharing its workspace.
    /// `true`: it lives in a new sandbox (same template, same tenant) whose workspace files
    /// and history start as this sandbox's are now; from then on each has its own.
    #[serde(default)]
    pub with_workspace: bool,
}

/// Largest body a fork takes: a fork asks for one flag.
pub const MAX_FORK_BODY_BYTES: usize = 64 << 10;

/// Fork a session: a new session that starts with this one's variables, imports and
/// definitions (a copy-on-write copy of its memory) while this one goes on unchanged.
/// Neither sees what the other does from then on. The fork's `/tmp` starts empty, files
/// open in the parent are not open in it, and its random generators are reseeded. Python
/// sessions of the `python` and `python-data` templates fork (a template's
/// `capabilities.fork`); JavaScript sessions cannot. The body is optional. The sandbox is
/// busy while it forks: a fork asked while a turn runs there is refused with 409
/// `SANDBOX_BUSY`.
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/sessions/{session_id}/fork", tag = "v1 sessions",
    request_body(content = ForkSession, description = "Optional; `{}` or no body is `{\"withWorkspace\": false}`"),
    params(("id" = String, Path, description = "The sandbox id"), ("session_id" = String, Path, description = "The session id")),
    responses(
        (status = 201, description = "Forked: the new session, and the sandbox it lives in", body = sessions::ForkedSession),
        (status = 400, description = "A template (or a language) whose sessions cannot be forked (UNSUPPORTED), or a bad body", body = ErrorBody),
        (status = 404, description = "No such sandbox or session", body = ErrorBody),
        (status = 409, description = "The sandbox is busy (SANDBOX_BUSY), the session has ended (SESSION_ENDED), or the sandbox holds its most sessions (TOO_MANY_SESSIONS)", body = ErrorBody),
        (status = 413, description = "The body is larger than 64 KiB", body = ErrorBody),
    ))]
pub async fn fork_session(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    ids: Result<Path<(String, String)>, PathRejection>,
    headers: axum::http::HeaderMap,
    body: axum::body::Body,
) -> Result<(StatusCode, Json<sessions::ForkedSession>), ApiError> {
    let Path((id, session)) = ids.map_err(path_error)?;
    let body: ForkSession = optional_json(&headers, body, MAX_FORK_BODY_BYTES).await?;
    let forked =
        sessions::fork(&state.runtime, &caller, &id, &session, body.with_workspace).await?;
    Ok((StatusCode::CREATED, Json(forked)))
}

/// A JSON body that may be left out: none (or an empty one) is `T::default()`; any other is
/// read as [`JsonBody`] reads it (415, 413, 400 in the one envelope).
pub(crate) async fn optional_json<T: serde::de::DeserializeOwned + Default>(
    headers: &axum::http::HeaderMap,
    body: axum::body::Body,
    limit_bytes: usize,
) -> Result<T, HttpError> {
    let bytes = kiln_http::json::read_body(headers, body, limit_bytes).await?;
    if bytes.is_empty() {
        return Ok(T::default());
    }
    kiln_http::json::require_json(headers)?;
    kiln_http::json::from_json_object(&bytes)
}

/// Close a session and forget it.
#[utoipa::path(delete, path = "/api/v1/sandboxes/{id}/sessions/{session_id}", tag = "v1 sessions",
    params(("id" = String, Path, description = "The sandbox id"), ("session_id" = String, Path, description = "The session id")),
    responses(
        (status = 204, description = "Closed"),
        (status = 404, description = "No such sandbox or session", body = ErrorBody),
    ))]
pub async fn close_session(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    ids: Result<Path<(String, String)>, PathRejection>,
) -> Result<StatusCode, ApiError> {
    let Path((id, session)) = ids.map_err(path_error)?;
    sessions::close(&state.runtime, &caller, &id, &session).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ---------------------------------------------------------------- files

/// A listing query.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// A folder in the workspace; default the whole workspace.
    pub path: Option<String>,
}

/// List the workspace's files (recursive, at most 10 000 entries).
#[utoipa::path(get, path = "/api/v1/sandboxes/{id}/files", tag = "v1 files", params(("id" = String, Path, description = "The sandbox id"), ListQuery),
    responses(
        (status = 200, description = "The listing", body = FileList),
        (status = 400, description = "Bad path", body = ErrorBody),
        (status = 404, description = "No such sandbox or folder", body = ErrorBody),
    ))]
pub async fn list_files(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<FileList>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let Query(query) = query.map_err(query_error)?;
    Ok(Json(
        files::list(&state.runtime, &caller, &id, query.path).await?,
    ))
}

/// A file's bytes as a body stream, 64 KiB at a time.
pub(crate) fn file_chunks(
    file: impl tokio::io::AsyncRead + Unpin + Send + 'static,
) -> impl futures::Stream<Item = std::io::Result<Bytes>> + Send + 'static {
    futures::stream::try_unfold(file, |mut file| async move {
        let mut buf = vec![0u8; 64 * 1024];
        let n = tokio::io::AsyncReadExt::read(&mut file, &mut buf).await?;
        if n == 0 {
            return Ok::<_, std::io::Error>(None);
        }
        buf.truncate(n);
        Ok(Some((Bytes::from(buf), file)))
    })
}

/// Download a file, byte for byte (streamed from disk). Links, fifos and devices answer 400
/// `INVALID_PATH`; nothing follows a link.
#[utoipa::path(get, path = "/api/v1/sandboxes/{id}/files/{path}", tag = "v1 files",
    params(("id" = String, Path, description = "The sandbox id"), ("path" = String, Path, description = "The file's path in the workspace")),
    responses(
        (status = 200, description = "The file", content_type = "application/octet-stream", body = Vec<u8>),
        (status = 400, description = "Bad path, a link or a special file", body = ErrorBody),
        (status = 404, description = "No such sandbox or file", body = ErrorBody),
        (status = 409, description = "The path is a folder", body = ErrorBody),
    ))]
pub async fn read_file(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    ids: Result<Path<(String, String)>, PathRejection>,
) -> Result<Response, ApiError> {
    let Path((id, name)) = ids.map_err(path_error)?;
    let (file, size) = files::open(&state.runtime, &caller, &id, name).await?;
    // At most the size announced in Content-Length, whatever happens to the file meanwhile.
    let file = tokio::io::AsyncReadExt::take(tokio::fs::File::from_std(file), size);
    let chunks = file_chunks(file);
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
            (header::CONTENT_LENGTH, size.to_string()),
        ],
        axum::body::Body::from_stream(chunks),
    )
        .into_response())
}

/// Upload a file (the raw request body, any bytes, at most 32 MiB). Folders are made as
/// needed; the change is recorded in the history.
#[utoipa::path(put, path = "/api/v1/sandboxes/{id}/files/{path}", tag = "v1 files",
    params(("id" = String, Path, description = "The sandbox id"), ("path" = String, Path, description = "The file's path in the workspace")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses(
        (status = 201, description = "Written", body = FileChange),
        (status = 400, description = "Bad path", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox is busy, or the path is a folder", body = ErrorBody),
        (status = 413, description = "Too large", body = ErrorBody),
    ))]
pub async fn write_file(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    ids: Result<Path<(String, String)>, PathRejection>,
    body: Bytes,
) -> Result<(StatusCode, Json<FileChange>), ApiError> {
    let Path((id, name)) = ids.map_err(path_error)?;
    let change = files::write(&state.runtime, &caller, &id, name, body.to_vec()).await?;
    Ok((StatusCode::CREATED, Json(change)))
}

/// Delete a file or folder (recursively); the change is recorded in the history.
#[utoipa::path(delete, path = "/api/v1/sandboxes/{id}/files/{path}", tag = "v1 files",
    params(("id" = String, Path, description = "The sandbox id"), ("path" = String, Path, description = "The file's path in the workspace")),
    responses(
        (status = 200, description = "Deleted", body = FileChange),
        (status = 400, description = "Bad path", body = ErrorBody),
        (status = 404, description = "No such sandbox or file", body = ErrorBody),
    ))]
pub async fn delete_file(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    ids: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<FileChange>, ApiError> {
    let Path((id, name)) = ids.map_err(path_error)?;
    let change = files::delete(&state.runtime, &caller, &id, name).await?;
    Ok(Json(change))
}
