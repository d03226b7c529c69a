//! The published sandbox contract: `/api/sandbox` create, exec, get, delete, and the
//! workspace history (history, diff, rollback). Handlers parse, call the registry and the
//! executor, and map the result.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use kiln_core::Language;
use kiln_http::{HttpError, JsonObject as JsonBody};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::AppState;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::exec::{self, CommandProgram, RunSpec, check_files, exec_prefix};
use crate::history::{HistoryEntry, MAX_HISTORY};
use crate::sandbox::{SandboxSpec, SandboxView, new_id, rfc3339, workspace_path};
pub use kiln_runtime::sandbox::{MAX_LIFETIME_MS, MIN_LIFETIME_MS};
pub use kiln_runtime::sessions::SessionInfo;

type Shared = State<Arc<AppState>>;

/// Create a sandbox.
#[derive(Debug, Deserialize, ToSchema)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary, Serialize))]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"image": "python", "options": {"timeout": 600000, "memoryLimit": "512m"}}))]
pub struct CreateBody {
    /// A template (`python`, `javascript`; see `GET /api/v1/templates`) or an image name one
    /// honours (`@ai-sandbox/python`, `python:3.12-slim`, `node:18-alpine`). An image no
    /// installed template honours (`python:2.7`) is refused with `UNKNOWN_IMAGE`. May be
    /// left out when `options.template` names the template.
    #[serde(default)]
    pub image: Option<String>,
    #[serde(default)]
    pub options: CreateOptions,
}

/// Sandbox options.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary, Serialize))]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CreateOptions {
    /// Lifetime in milliseconds (default 30 minutes, at least 1 second, at most 24 hours).
    #[schema(example = 600000, minimum = 1000, maximum = 86400000)]
    pub timeout: Option<u64>,
    /// Memory cap for each execution, e.g. "512m" (default 512 MiB, at most 4 GiB).
    #[schema(example = "512m")]
    pub memory_limit: Option<String>,
    /// CPUs' worth of time: the box's CPU quota on Linux templates (as
    /// `resources.vcpus`); accepted and not enforced on WebAssembly ones (each execution
    /// runs on one core).
    #[schema(example = "0.5")]
    pub cpu_limit: Option<CpuLimit>,
    /// Seed 002's limits of the sandbox's box (Linux templates; `memory_mb` anywhere):
    /// what it leaves out is the template's.
    pub resources: Option<kiln_core::template::ResourceRequest>,
    /// `none` (the default: no network at all) or `allowlist` (Linux templates only: the
    /// host names on the server's allowlist, such as the package indexes, through its proxy).
    #[schema(example = "none")]
    pub network: Option<String>,
    /// The sandbox's own egress rules, as `/api/v1/sandboxes` takes them (`networkRules`).
    pub network_rules: Option<kiln_core::net::Egress>,
    /// A template by its id (`GET /api/v1/templates`), the same as `image`; both may be
    /// sent when they name the same template.
    #[schema(example = "python-data")]
    pub template: Option<String>,
}

/// A CPU share, as a number or text (`0.5`, `"0.5"`).
#[derive(Debug, Deserialize, ToSchema)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary, Serialize))]
#[serde(untagged)]
pub enum CpuLimit {
    Number(f64),
    Text(String),
}

impl CpuLimit {
    /// The share as a number; text that is not one is refused.
    fn value(&self) -> Result<f64, ApiError> {
        match self {
            CpuLimit::Number(n) => Ok(*n),
            CpuLimit::Text(text) => text.trim().parse().map_err(|_| {
                kiln_runtime::RuntimeError::InvalidOption {
                    message: format!("cpuLimit {text:?} is not a number of CPUs (e.g. 0.5)"),
                }
                .into()
            }),
        }
    }
}

/// A created sandbox.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Created {
    #[schema(example = "sb_3f2a9c1b7d4e5f60718293a4")]
    pub container_id: String,
    #[schema(example = "created")]
    pub status: String,
    /// The template the image resolved to, and what it runs (with package versions for
    /// Linux templates).
    #[schema(example = "python")]
    pub template: String,
    #[schema(example = "CPython 3.15 on WebAssembly")]
    pub template_description: String,
    /// The limits its box really got (Linux templates).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resources: Option<kiln_core::template::Resources>,
    #[schema(example = "2026-11-22T14:03:32.120Z")]
    pub created_at: String,
    #[schema(example = "2026-11-22T14:33:32.120Z")]
    pub expires_at: String,
}

/// Checks a create request and turns it into the spec of the sandbox to make: everything
/// `POST /api/sandbox` checks before it makes anything. (The fuzz target `api_requests`
/// calls it with requests built by `arbitrary`.)
pub fn sandbox_spec(
    catalogue: &kiln_core::template::Catalogue,
    body: &CreateBody,
) -> Result<SandboxSpec, ApiError> {
    let options = &body.options;
    if body.image.is_none() && options.template.is_none() {
        return Err(ApiError::bad_request(
            "INVALID_REQUEST",
            "name the sandbox's image (`image`) or its template (`options.template`)",
        ));
    }
    let image = SandboxSpec::named_image(
        catalogue,
        body.image.as_deref(),
        options.template.as_deref(),
        "python",
    )?;
    let spec = SandboxSpec::resolve(
        catalogue,
        &image,
        options.timeout,
        options.memory_limit.as_deref(),
    )?
    .with_network(catalogue, options.network.as_deref())?
    .with_egress(
        catalogue,
        crate::v1::network_rules(options.network.as_deref(), options.network_rules.clone())?,
    )?;
    let mut asked = options.resources;
    if let Some(cpu) = &options.cpu_limit
        && spec.resources.is_some()
    {
        let asked = asked.get_or_insert_with(Default::default);
        asked.vcpus = asked.vcpus.or(Some(cpu.value()?));
    }
    Ok(spec.with_resources(asked.as_ref(), options.memory_limit.is_some())?)
}

/// Create a sandbox with an empty, git-versioned workspace.
#[utoipa::path(post, path = "/api/sandbox", tag = "sandbox", request_body = CreateBody,
    responses(
        (status = 201, description = "Created", body = Created),
        (status = 400, description = "Unknown image or bad option", body = ErrorBody),
        (status = 401, description = "No or bad API key", body = ErrorBody),
    ))]
pub async fn create(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    body: Result<JsonBody<CreateBody>, HttpError>,
) -> Result<(StatusCode, Json<Created>), ApiError> {
    let JsonBody(body) = body?;
    let spec = sandbox_spec(state.runtime.catalogue(), &body)?;
    let sandbox = exec::create_sandbox(&state.runtime, &caller, spec).await?;
    Ok((
        StatusCode::CREATED,
        Json(Created {
            template_description: state
                .runtime
                .catalogue()
                .get(sandbox.template())
                .map(|t| t.description.clone())
                .unwrap_or_default(),
            template: sandbox.template().into(),
            resources: sandbox.resources,
            container_id: sandbox.id,
            status: "created".into(),
            created_at: rfc3339(sandbox.created_ms),
            expires_at: rfc3339(sandbox.expires_ms),
        }),
    ))
}

/// Run a command in a sandbox.
#[derive(Debug, Deserialize, ToSchema)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary, Serialize))]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"containerId": "sb_3f2a9c1b7d4e5f60718293a4", "files": {"main.py": "print(open('data/input.txt').read())", "data/input.txt": "hello"}, "command": ["python", "main.py"]}))]
pub struct ExecBody {
    pub container_id: String,
    /// Files to write into the workspace first (name → text). They stay between execs.
    #[serde(default)]
    pub files: BTreeMap<String, String>,
    /// `["python", FILE, ARG…]`, `["python", "-c", CODE]`, `["node", FILE, ARG…]` or
    /// `["node", "-e", CODE]`.
    pub command: Vec<String>,
    /// The workspace folder whose new and changed files come back in `files`; default
    /// `out` (`/workspace/out` in the sandbox).
    #[schema(example = "out")]
    pub output_dir: Option<String>,
}

/// What an exec produced.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExecReply {
    /// The execution id; also its id in the workspace history.
    #[schema(example = "python_run_3f2a9c1b7d4e5f60718293a4")]
    pub id: String,
    /// `success`, `error` or `timeout`.
    #[schema(example = "success")]
    pub status: String,
    /// Milliseconds.
    #[schema(example = 2)]
    pub duration: u64,
    #[schema(example = "hello\n")]
    pub stdout: String,
    #[schema(example = "")]
    pub stderr: String,
    #[schema(example = 0)]
    pub exit_code: i32,
    /// False when the code ran but the files it changed could not be recorded in the
    /// history (see `warnings`); the result above is still the run's own.
    pub history_recorded: bool,
    /// Things the client should know: the change was not recorded, or a file was left out
    /// of the history (too large, a fifo or device).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// Rich results (Python): matplotlib figures as `image/png` (base64), `display(...)`
    /// values. Absent when there are none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub results: Vec<kiln_core::RichResult>,
    /// Files the run added or changed under its output folder (`out/` unless the request
    /// names `outputDir`), base64, at most 32 files and 8 MiB (4 MiB each); a file over
    /// the bounds is listed with `omitted` instead of its bytes. Absent when there are none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<kiln_runtime::outputs::OutputFile>,
}

/// What a command asks to run.
pub enum Program {
    /// A workspace file, with its arguments (the runtime launches it as the backend needs).
    File(String, Vec<String>),
    Inline(String),
    /// An argv, run as given (Linux templates).
    Command(Vec<String>),
}

/// A command for a code template, read by the runtime's one parser of command lines. A bare
/// `-c CODE` / `-e CODE` runs as the code itself, which every backend runs; code with
/// arguments or a module runs through the launcher that gives it CPython's `sys.argv`.
pub fn parse_command(command: &[String], home: &str) -> Result<(Language, Program), ApiError> {
    let line = exec::parse_command_line(command).map_err(|e| {
        ApiError::bad_request(
            "UNSUPPORTED_COMMAND",
            format!("unsupported command {command:?}: {e}"),
        )
    })?;
    let program = match line.program {
        CommandProgram::File(file) => Program::File(file, line.args),
        CommandProgram::Inline(code) if line.args.is_empty() => Program::Inline(code),
        _ => Program::Inline(line.launcher_at(home)),
    };
    Ok((line.language, program))
}

/// Run a command in a sandbox's workspace. Files sent stay there; a change to the files is
/// recorded in the sandbox's history under the execution id.
#[utoipa::path(post, path = "/api/sandbox/exec", tag = "sandbox", request_body = ExecBody,
    responses(
        (status = 200, description = "The execution ran (see `status`)", body = ExecReply),
        (status = 400, description = "Bad command, file name or body", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox is running another execution, or was deleted meanwhile", body = ErrorBody),
        (status = 413, description = "Files too large", body = ErrorBody),
        (status = 503, description = "The executor died or is saturated; retry", body = ErrorBody),
    ))]
pub async fn exec(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    body: Result<JsonBody<ExecBody>, HttpError>,
) -> Result<Json<ExecReply>, ApiError> {
    let JsonBody(body) = body?;
    if !state
        .runtime
        .registry
        .workspaces
        .may_use_sandbox(&caller, &body.container_id)
    {
        return Err(kiln_runtime::RuntimeError::SandboxNotFound {
            id: body.container_id.clone(),
        }
        .into());
    }
    let view = state
        .runtime
        .registry
        .get(&caller.tenant, &body.container_id)?;
    let sandbox = &view.meta;
    // A Linux sandbox runs the command as given, in its live box.
    let live = state
        .runtime
        .catalogue()
        .get(sandbox.template())
        .is_some_and(|t| t.capabilities.commands);
    let (language, program) = if live {
        if body.command.is_empty() || body.command.iter().any(|a| a.contains('\0')) {
            return Err(ApiError::bad_request(
                "UNSUPPORTED_COMMAND",
                "a command is a non-empty array of strings without NUL bytes",
            ));
        }
        (sandbox.language, Program::Command(body.command.clone()))
    } else {
        let home = sandbox
            .workspace_at
            .as_deref()
            .unwrap_or(kiln_core::WORKSPACE_GUEST);
        parse_command(&body.command, home)?
    };
    if language != sandbox.language {
        return Err(ApiError::bad_request(
            "UNSUPPORTED_COMMAND",
            format!(
                "sandbox {} runs {} ({}); it cannot run {:?}",
                sandbox.id, sandbox.language, sandbox.image, body.command[0]
            ),
        ));
    }
    let files = check_files(body.files.iter().map(|(k, v)| (k, v.as_bytes())))?;
    let (code, code_file, args, command) = match program {
        Program::Inline(code) => (code, None, Vec::new(), None),
        Program::File(name, args) => (String::new(), Some(workspace_path(&name)?), args, None),
        Program::Command(argv) => (String::new(), None, Vec::new(), Some(argv)),
    };
    let spec = RunSpec {
        exec_id: new_id(exec_prefix(language)),
        language,
        code,
        stdin: Vec::new(),
        env: Vec::new(),
        timeout_ms: None,
        fuel: None,
        files,
        code_file,
        args,
        session: None,
        command,
        output_dir: body
            .output_dir
            .as_deref()
            .map(exec::output_dir)
            .transpose()?,
        summary: body.command.join(" "),
        begun: None,
    };
    let outcome = exec::run(&state.runtime, &caller, &body.container_id, spec, None).await?;
    Ok(Json(ExecReply {
        id: outcome.exec_id.clone(),
        status: outcome.status().into(),
        duration: outcome.result.duration_us / 1000,
        stdout: outcome.result.stdout_text(),
        stderr: outcome.stderr_with_reason(),
        exit_code: outcome.result.exit_code,
        history_recorded: outcome.history_recorded(),
        warnings: outcome.warnings(),
        results: outcome.result.results.clone(),
        files: outcome.outputs.clone(),
    }))
}

/// A sandbox's state.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxInfo {
    #[schema(example = "sb_3f2a9c1b7d4e5f60718293a4")]
    pub container_id: String,
    #[schema(example = "python")]
    pub image: String,
    /// The template the image resolved to (see `GET /api/v1/templates`).
    #[schema(example = "python")]
    pub template: String,
    /// What that template runs, with the versions of its main packages for Linux templates
    /// (`Debian 12 with CPython 3.11, pip and venv (python3 3.11.2-1+b1, …)`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "CPython 3.15 on WebAssembly")]
    pub template_description: Option<String>,
    /// `python`, `javascript`, `go` or `bash`.
    #[schema(example = "python")]
    pub language: String,
    /// `none` or `allowlist`.
    #[schema(example = "none")]
    pub network: String,
    /// Its own egress rules, where it has any (see the create body's `networkRules`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network_rules: Option<kiln_core::net::Egress>,
    /// The named volumes it mounts (by id).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<kiln_runtime::volumes::VolumeMount>,
    /// Its box's limits (Linux templates).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resources: Option<kiln_core::template::Resources>,
    /// `idle` or `running`.
    #[schema(example = "idle")]
    pub status: String,
    /// A Linux sandbox's box: `running`, `paused` (frozen, see `POST .../pause`),
    /// `hibernated` (its memory returned, its files kept) or `stopped` (none runs; the next
    /// command starts one). Absent for WebAssembly.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "running")]
    pub state: Option<String>,
    /// The execution running now, if any.
    pub current_execution: Option<String>,
    pub created_at: String,
    /// When it ends unless something extends it: a fixed life's end (`timeoutMs`), or,
    /// with no fixed life, `lifecycle.terminateAfterIdleMs` after the last request.
    pub expires_at: String,
    /// When and how it ends and what becomes of its box, where the create request or the
    /// server chose (see the create body's `lifecycle`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<kiln_runtime::lifecycle::Lifecycle>,
    /// Whether the end of its fixed life paused it (`lifecycle.onTimeout: "pause"`); renew
    /// it (`POST .../renew`) to give it a life again.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub timed_out: bool,
    /// Whether anyone may open its box's previews without a key or a link.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub public_previews: bool,
    pub resource_usage: ResourceUsage,
    /// Session ids, with whether each still holds live state.
    pub sessions: Vec<SessionInfo>,
}

/// What a sandbox has used.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceUsage {
    pub executions: u64,
    pub execution_time_ms: u64,
    pub memory_limit_bytes: u64,
}

impl SandboxInfo {
    /// With its template's description from `catalogue`.
    pub fn described(mut self, catalogue: &kiln_core::template::Catalogue) -> SandboxInfo {
        self.template_description = catalogue.get(&self.template).map(|t| t.description.clone());
        self
    }

    pub fn from_view(view: &SandboxView) -> SandboxInfo {
        let sandbox = &view.meta;
        SandboxInfo {
            container_id: sandbox.id.clone(),
            image: sandbox.image.clone(),
            template: sandbox.template().into(),
            template_description: None,
            language: sandbox.language.name().into(),
            network: match sandbox.network {
                kiln_core::Network::None => "none",
                kiln_core::Network::Allowlist => "allowlist",
            }
            .into(),
            network_rules: sandbox.egress.clone(),
            volume_mounts: sandbox.volume_mounts.clone(),
            resources: sandbox.resources,
            status: if view.running.is_some() {
                "running"
            } else {
                "idle"
            }
            .into(),
            state: None,
            current_execution: view.running.clone(),
            created_at: rfc3339(sandbox.created_ms),
            expires_at: rfc3339(sandbox.expires_ms),
            lifecycle: (sandbox.lifecycle != Default::default()).then(|| sandbox.lifecycle.clone()),
            timed_out: sandbox.timed_out,
            public_previews: sandbox.public_ports,
            resource_usage: ResourceUsage {
                executions: sandbox.executions,
                execution_time_ms: sandbox.cpu_time_ms,
                memory_limit_bytes: sandbox.memory_bytes,
            },
            sessions: sandbox
                .sessions
                .values()
                .map(|s| SessionInfo {
                    session_id: s.id.clone(),
                    language: s.language.name().into(),
                    status: if view.live_sessions.contains(&s.id) {
                        "ready"
                    } else {
                        "ended"
                    }
                    .into(),
                    turns: s.turns,
                    created_at: rfc3339(s.created_ms),
                })
                .collect(),
        }
    }
}

/// A sandbox's state, lifetime and resource use.
#[utoipa::path(get, path = "/api/sandbox/{id}", tag = "sandbox",
    params(("id" = String, Path, description = "The container id")),
    responses(
        (status = 200, description = "The sandbox", body = SandboxInfo),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn get(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<SandboxInfo>, ApiError> {
    let view = state.runtime.registry.get(&caller.tenant, &id)?;
    Ok(Json(
        SandboxInfo::from_view(&view).described(state.runtime.catalogue()),
    ))
}

/// A deleted sandbox.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Deleted {
    #[schema(example = "deleted")]
    pub status: String,
    #[schema(example = "sb_3f2a9c1b7d4e5f60718293a4")]
    pub container_id: String,
}

/// Delete a sandbox, its workspace and history. A running execution is cancelled.
#[utoipa::path(delete, path = "/api/sandbox/{id}", tag = "sandbox",
    params(("id" = String, Path, description = "The container id")),
    responses(
        (status = 200, description = "Deleted", body = Deleted),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn delete(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<Deleted>, ApiError> {
    state.runtime.delete_sandbox(&caller, &id).await?;
    Ok(Json(Deleted {
        status: "deleted".into(),
        container_id: id,
    }))
}

/// A page of a sandbox's history.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct HistoryReply {
    /// Newest first; the last page ends with the initial commit.
    pub history: Vec<HistoryEntry>,
    /// Pass as `cursor` for the next (older) page: the commit id of this page's last entry.
    /// Absent on the last page. There is no total: counting would walk the whole history.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "9fceb02d0ae598e95dc970b74767f19372d61af8")]
    pub next_cursor: Option<String>,
    /// `nextCursor` again, under the name this reply used to give it (kept for clients
    /// written against that).
    #[serde(rename = "next_cursor", skip_serializing_if = "Option::is_none")]
    #[schema(deprecated)]
    pub next_cursor_old: Option<String>,
}

/// A page of history.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct HistoryQuery {
    /// Most entries to return (1 to 1000, default 1000).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<usize>,
    /// Where the previous page ended (its `nextCursor`).
    pub cursor: Option<String>,
}

/// The workspace's history: every change, newest first, a page at a time (`limit`, at most
/// 1000; `cursor` from the previous page's `nextCursor`). A page costs what its entries
/// cost, however long the history: it starts at the cursor's commit and stops after `limit`.
#[utoipa::path(get, path = "/api/sandbox/{id}/history", tag = "history",
    params(("id" = String, Path, description = "The container id"), HistoryQuery),
    responses(
        (status = 200, description = "The history", body = HistoryReply),
        (status = 400, description = "Bad limit, or a cursor that is not a commit of this history (INVALID_CURSOR)", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn history(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    query: Result<Query<HistoryQuery>, QueryRejection>,
) -> Result<Json<HistoryReply>, ApiError> {
    let Query(query) =
        query.map_err(|e| ApiError::bad_request("INVALID_REQUEST", e.body_text()))?;
    let limit = query.limit.unwrap_or(MAX_HISTORY);
    let (history, next_cursor) =
        kiln_runtime::revisions::page(&state.runtime, &caller, &id, limit, query.cursor).await?;
    Ok(Json(HistoryReply {
        history,
        next_cursor_old: next_cursor.clone(),
        next_cursor,
    }))
}

/// Compare two points of the history.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"fromExecId": "initial", "toExecId": "python_run_3f2a9c1b7d4e5f60718293a4"}))]
pub struct DiffBody {
    /// A history id (`initial`, an execution id, ...).
    pub from_exec_id: String,
    /// A history id; default the newest.
    pub to_exec_id: Option<String>,
}

/// Unified diffs, one per changed file.
#[derive(Debug, Serialize, ToSchema)]
pub struct DiffReply {
    #[schema(example = json!({"out.txt": "diff --git a/out.txt b/out.txt\nnew file mode 100644\n--- /dev/null\n+++ b/out.txt\n@@ -0,0 +1 @@\n+42\n"}))]
    pub diff: BTreeMap<String, String>,
}

/// What changed in the workspace between two points of its history.
#[utoipa::path(post, path = "/api/sandbox/{id}/diff", tag = "history", request_body = DiffBody,
    params(("id" = String, Path, description = "The container id")),
    responses(
        (status = 200, description = "The diff", body = DiffReply),
        (status = 404, description = "No such sandbox or history id", body = ErrorBody),
    ))]
pub async fn diff(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    body: Result<JsonBody<DiffBody>, HttpError>,
) -> Result<Json<DiffReply>, ApiError> {
    let JsonBody(body) = body?;
    let diff = kiln_runtime::revisions::diff(
        &state.runtime,
        &caller,
        &id,
        body.from_exec_id,
        body.to_exec_id,
    )
    .await?;
    Ok(Json(DiffReply { diff }))
}

/// Restore the workspace.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"executionId": "python_run_3f2a9c1b7d4e5f60718293a4"}))]
pub struct RollbackBody {
    /// The history id whose state to restore (`initial` empties the workspace).
    pub execution_id: String,
}

/// A rollback, itself a history entry.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RollbackReply {
    #[schema(example = "rolled_back")]
    pub status: String,
    /// The rollback's own history id.
    #[schema(example = "rollback_3f2a9c1b7d4e5f60718293a4")]
    pub id: String,
    pub commit_id: String,
    pub restored_execution_id: String,
}

/// Restore the workspace to its state after an execution. The rollback is recorded as a new
/// history entry; the sandbox must be idle.
#[utoipa::path(post, path = "/api/sandbox/{id}/rollback", tag = "history", request_body = RollbackBody,
    params(("id" = String, Path, description = "The container id")),
    responses(
        (status = 200, description = "Restored", body = RollbackReply),
        (status = 404, description = "No such sandbox or history id", body = ErrorBody),
        (status = 409, description = "The sandbox is busy", body = ErrorBody),
    ))]
pub async fn rollback(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    body: Result<JsonBody<RollbackBody>, HttpError>,
) -> Result<Json<RollbackReply>, ApiError> {
    let JsonBody(body) = body?;
    let done =
        kiln_runtime::revisions::rollback(&state.runtime, &caller, &id, body.execution_id.clone())
            .await?;
    Ok(Json(RollbackReply {
        status: "rolled_back".into(),
        id: done.id,
        commit_id: done.commit_id.unwrap_or_default(),
        restored_execution_id: body.execution_id,
    }))
}

/// Health.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Health {
    #[schema(example = "ok")]
    pub status: String,
    /// Readiness only: whether the executor workers run confined (namespaces, read-only
    /// mounts, seccomp), and under which `KILN_WORKER_JAIL` policy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workers: Option<WorkerJail>,
    /// Readiness only: each isolation tier, whether this host can run it and whether this
    /// server does (`kiln doctor`'s findings, taken at start).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tiers: Vec<Tier>,
}

/// One isolation tier, as `kiln doctor` found it when the server started.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Tier {
    /// `webassembly`, `linux-runc`, `linux-gvisor`, `criu`, `kvm` or `microvm`.
    #[schema(example = "linux-runc")]
    pub name: String,
    /// Whether this host can run it: `ok`, `warn` (with a caveat) or `no`.
    #[schema(example = "ok")]
    pub status: String,
    /// Why, in words.
    pub detail: String,
    /// Whether this server runs sandboxes on it now.
    pub served: bool,
}

/// The executor workers' jail.
#[derive(Debug, Serialize, ToSchema)]
pub struct WorkerJail {
    pub confined: bool,
    /// `require`, `auto` or `off`.
    #[schema(example = "require")]
    pub jail: String,
}

/// Liveness: the server answers.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "Alive", body = Health)))]
pub async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        workers: None,
        tiers: Vec::new(),
    })
}

/// Readiness: workers are running and the data folder takes writes.
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "Ready", body = Health),
        (status = 503, description = "Not ready", body = ErrorBody),
    ))]
pub async fn readyz(State(state): Shared) -> Result<Json<Health>, ApiError> {
    let workers = state.runtime.executors.pools.start_all().is_ok();
    let writable = state.runtime.registry.writable();
    if !workers || !writable {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "NOT_READY",
            format!(
                "not ready: executor workers {}, data folder {}",
                if workers { "up" } else { "cannot start" },
                if writable { "writable" } else { "not writable" }
            ),
        ));
    }
    Ok(Json(Health {
        status: "ready".into(),
        workers: Some(WorkerJail {
            confined: state.worker_jail.confined,
            jail: state.worker_jail.policy.name().into(),
        }),
        tiers: state.tiers.clone(),
    }))
}

/// Prometheus metrics (text exposition format).
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Metrics", body = String, content_type = "text/plain")))]
pub async fn metrics(
    State(state): Shared,
) -> ([(axum::http::header::HeaderName, &'static str); 1], String) {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        {
            let mut text = state.runtime.metrics.render(
                state.runtime.registry.count(),
                &state.runtime.executors.pools.worker_loads(),
            );
            let pools: Vec<_> = state
                .runtime
                .executors
                .pools
                .process_hosts()
                .iter()
                .flat_map(|(_, host)| host.pools())
                .collect();
            kiln_core::pool::render_metrics(&pools, &mut text);
            let jail = state.worker_jail;
            text.push_str(&format!(
                "# HELP kiln_workers_confined Whether the executor workers run confined (1) or not (0), by KILN_WORKER_JAIL policy.\n# TYPE kiln_workers_confined gauge\nkiln_workers_confined{{jail=\"{}\"}} {}\n",
                jail.policy.name(),
                u8::from(jail.confined)
            ));
            text
        },
    )
}

pub async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "ROUTE_NOT_FOUND", "no such route")
}
