//! The MCP server (official `rmcp` crate): kiln's sandboxes as tools for any MCP client.
//! Served over stdio by `kiln mcp` and over streamable HTTP at `/mcp` by `kiln serve` (where
//! the bearer key's tenant applies, as on every route). Needs no LLM.
//!
//! Tools: `run_python`, `run_javascript` (a fresh sandbox, or a sandbox's workspace),
//! `sandbox_create`, `session_create` / `session_run` / `session_close` (state persists between
//! runs), `fork_session` (a copy of a session's state), `write_file`, `read_file`,
//! `list_files`; for a Linux sandbox's box, `sandbox_processes` (with its ports),
//! `sandbox_signal`, `sandbox_restart`, `sandbox_pause` and `sandbox_resume`. Input schemas are derived from the Rust types below.

use std::sync::Arc;

use kiln_core::{ExecRequest, Language, Limits};
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, ServerCapabilities, ServerConfig};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, schemars, tool, tool_handler, tool_router};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::auth::Caller;
use crate::exec::{self, CodeExec};
use crate::sandbox::new_id;
use kiln_runtime::Runtime;
use kiln_runtime::{RuntimeError, files, sessions};

/// Most seconds a tool's code may run.
pub const MAX_TIMEOUT_SECONDS: f64 = 300.0;

/// Run code.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct RunCode {
    /// The program.
    pub code: String,
    /// Time limit in seconds (default 30, at most 300).
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
    /// Standard input, as text.
    #[serde(default)]
    pub stdin: Option<String>,
    /// Run in this sandbox's workspace (files persist; changes are recorded in its history).
    /// Without it the code runs in a fresh, empty sandbox that is gone afterwards.
    #[serde(default)]
    pub sandbox_id: Option<String>,
}

/// Create a sandbox.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SandboxCreate {
    /// `python` (default) or `javascript`.
    #[serde(default)]
    pub language: Option<String>,
    /// A template by its id (`linux-python`, `linux-node`, …) instead of the language's.
    #[serde(default)]
    pub template: Option<String>,
    /// Egress rules of its own (Linux templates; gives it a network through kiln's proxy):
    /// `{"allowOut": [...], "denyOut": [...], "rules": {host: [{"transform": {"headers":
    /// {...}}}]}}`, as `networkRules` in /api/v1/sandboxes.
    #[serde(default)]
    pub network_rules: Option<Value>,
    /// Named volumes to mount: `[{"volume": "datasets", "path": "/mnt/data", "readOnly":
    /// false}]` (volume_create makes them).
    #[serde(default)]
    pub volume_mounts: Option<Value>,
    /// Start from a snapshot (sandbox_snapshot takes them): its files, template and settings
    /// (the other fields are then left out).
    #[serde(default)]
    pub snapshot: Option<String>,
}

/// Snapshot a sandbox.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SnapshotOf {
    pub sandbox_id: String,
    /// A name for it.
    #[serde(default)]
    pub name: Option<String>,
    /// Take its box's running processes too (default: where kiln can, saying why not where
    /// it cannot); false: its files alone; true: fail where the processes cannot be taken.
    #[serde(default)]
    pub processes: Option<bool>,
}

/// Fork a sandbox.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ForkOf {
    pub sandbox_id: String,
    /// How many copies, 1..=20 (default 1).
    #[serde(default)]
    pub count: Option<u32>,
    /// Carry its running processes into the copies (as sandbox_snapshot's `processes`).
    #[serde(default)]
    pub processes: Option<bool>,
}

/// Make a workspace.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct WorkspaceCreate {
    /// 1..=64 of `A-Z a-z 0-9 _ . -`, unique among the tenant's workspaces.
    pub name: String,
    /// Services to start with it: postgres, redis, mysql, nginx.
    #[serde(default)]
    pub services: Vec<String>,
    /// A Linux template (default linux-services).
    #[serde(default)]
    pub template: Option<String>,
}

/// Name a workspace.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct WorkspaceOf {
    /// Its name or id.
    pub workspace: String,
}

/// Start a workflow.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct WorkflowStart {
    /// A workflow template: static-website, fullstack-app, database-schema, or the operator's.
    pub template: String,
    /// What to build.
    pub task: String,
    /// Work in this workspace (name or id); a new one otherwise.
    #[serde(default)]
    pub workspace: Option<String>,
    /// Rounds of review before it is rejected (1..=10; default the template's).
    #[serde(default)]
    pub max_rounds: Option<u32>,
    /// A person plays the creator (hand over with workflow_submit_for_review).
    #[serde(default)]
    pub human_creator: bool,
    /// A person plays the reviewer (review with workflow_submit_review).
    #[serde(default)]
    pub human_reviewer: bool,
}

/// Share a workspace.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct WorkspaceShare {
    /// The workspace's name or id (one of the caller's own).
    pub workspace: String,
    /// Another key of the tenant (`key_…`).
    pub key_id: String,
    /// read, write, or none (no longer shared with it).
    pub access: String,
}

/// A workflow, by id.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct WorkflowOf {
    /// Its id (`wf_…`).
    pub workflow_id: String,
}

/// A person's hand-over as a workflow's creator.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct WorkflowSubmit {
    pub workflow_id: String,
    /// Notes for the reviewer.
    #[serde(default)]
    pub notes: Option<String>,
}

/// A person's review as a workflow's reviewer.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct WorkflowReview {
    pub workflow_id: String,
    pub approved: bool,
    #[serde(default)]
    pub grade: Option<String>,
    #[serde(default)]
    pub feedback: Option<String>,
    #[serde(default)]
    pub suggestions: Option<Vec<String>>,
}

/// Add a service to a workspace.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ServiceAdd {
    /// The workspace's name or id.
    pub workspace: String,
    /// postgres, redis, mysql or nginx.
    pub service_type: String,
}

/// A workspace's preview.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct PreviewEnable {
    /// The workspace's name or id.
    pub workspace: String,
    /// static (its files, served by nginx) or proxy (its own server on `port`).
    pub preview_type: String,
    /// static: the folder of the workspace to serve (default all of it).
    #[serde(default)]
    pub root_path: Option<String>,
    /// proxy: the port its server listens on.
    #[serde(default)]
    pub port: Option<u16>,
}

/// One SQL statement for a workspace's database.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SqlRun {
    /// The workspace's name or id.
    pub workspace: String,
    pub query: String,
    /// postgres or mysql (default: the workspace's first of them).
    #[serde(default)]
    pub service: Option<String>,
    /// Milliseconds, 1..=60000 (default 10000).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

/// Make a named volume.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct VolumeCreate {
    /// 1..=64 of `A-Z a-z 0-9 _ . -`.
    pub name: String,
    /// Its size in MiB, 16 to 65536 (default 1024).
    #[serde(default)]
    pub size_mb: Option<u64>,
}

/// Name a volume.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct VolumeOf {
    /// Its name or id.
    pub volume: String,
}

/// Replace a sandbox's egress rules.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SetNetwork {
    pub sandbox_id: String,
    /// The new rules, replacing the old whole: `{"allowOut": [...], "denyOut": [...],
    /// "rules": {...}}`; `{}` leaves the operator's allowlist alone in force.
    pub network_rules: Value,
}

/// Store or replace a secret.
#[derive(Deserialize, schemars::JsonSchema)]
pub struct SecretSet {
    /// 1..=128 of `A-Z a-z 0-9 _ . -`: what `${secrets.NAME}` names in a rule's header.
    pub name: String,
    /// Stored sealed; never returned.
    pub value: String,
}

impl std::fmt::Debug for SecretSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretSet")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Name a secret.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SecretOf {
    /// Its name or id.
    pub name: String,
}

/// No arguments.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct Nothing {}

/// Network rules given as JSON, checked.
fn egress_of(value: Value) -> Result<kiln_core::net::Egress, RuntimeError> {
    kiln_http::objects::from_value(value).map_err(|e| RuntimeError::InvalidOption {
        message: format!("network_rules: {e}"),
    })
}

/// Open a session.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SessionCreate {
    /// `python` (default) or `javascript`.
    #[serde(default)]
    pub language: Option<String>,
    /// The sandbox to open it in; a new one when absent.
    #[serde(default)]
    pub sandbox_id: Option<String>,
}

/// Run code in a session.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SessionRun {
    pub sandbox_id: String,
    pub session_id: String,
    /// The code; variables, imports and definitions persist between runs.
    pub code: String,
    /// Time limit in seconds (default 30, at most 300). A run that times out ends the session.
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
}

/// Fork a session.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ForkSession {
    pub sandbox_id: String,
    pub session_id: String,
    /// Fork into a new sandbox whose files and history start as this sandbox's are now, so
    /// that the fork's file changes stay its own. Default false: the fork is another session
    /// of the same sandbox, sharing its files.
    #[serde(default)]
    pub with_workspace: Option<bool>,
}

/// Close a session.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SessionClose {
    pub sandbox_id: String,
    pub session_id: String,
}

/// Write a file.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct WriteFile {
    pub sandbox_id: String,
    /// Path in the workspace, e.g. `data/input.csv`.
    pub path: String,
    /// The text to write.
    pub content: String,
}

/// Read a file.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ReadFile {
    pub sandbox_id: String,
    pub path: String,
}

/// A Linux sandbox's box.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct BoxOf {
    pub sandbox_id: String,
}

/// A signal for a process of a Linux sandbox's box.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SignalProcess {
    pub sandbox_id: String,
    /// The process's pid inside the box (from sandbox_processes).
    pub pid: u32,
    /// A name (TERM, KILL, INT, HUP, QUIT, USR1, USR2, STOP, CONT, WINCH) or a number 1–64;
    /// default TERM.
    #[serde(default)]
    pub signal: Option<Value>,
    /// Signal the process's whole group. Default false.
    #[serde(default)]
    pub group: Option<bool>,
}

/// List files.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ListFiles {
    pub sandbox_id: String,
    /// A folder; default the whole workspace.
    #[serde(default)]
    pub path: Option<String>,
}

/// The MCP server over one kiln.
#[derive(Clone)]
pub struct KilnMcp {
    runtime: Arc<Runtime>,
    /// The HTTP server it is part of (`/mcp` on `kiln serve`): terminals and links live
    /// there. `None` over stdio.
    app: Option<Arc<crate::AppState>>,
}

/// Open a terminal.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct OpenTerminal {
    pub sandbox_id: String,
    /// A command line typed into the terminal's shell once it starts (`npm run dev`,
    /// `python3 -m http.server 8000`); the shell stays when it ends.
    #[serde(default)]
    pub command: Option<String>,
    /// How long to wait for output before answering, in milliseconds (default 1000, at
    /// most 10000).
    #[serde(default)]
    pub wait_ms: Option<u64>,
}

/// A link to a preview of a port of a Linux sandbox's box.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct PreviewOf {
    pub sandbox_id: String,
    /// The port a server in the box listens on (sandbox_processes lists them).
    pub port: u16,
    /// How long the link works, in seconds (default 3600, at most 7 days).
    #[serde(default)]
    pub ttl_seconds: Option<u64>,
}

impl std::fmt::Debug for KilnMcp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KilnMcp")
    }
}

fn language(name: Option<&str>) -> Result<Language, RuntimeError> {
    name.map_or(Ok(Language::Python), exec::language)
}

fn timeout_ms(seconds: Option<f64>) -> Result<Option<u64>, RuntimeError> {
    match seconds {
        None => Ok(None),
        Some(s) if s > 0.0 && s <= MAX_TIMEOUT_SECONDS => Ok(Some((s * 1000.0).ceil() as u64)),
        Some(s) => Err(RuntimeError::InvalidOption {
            message: format!(
                "timeout_seconds must be more than 0 and at most {MAX_TIMEOUT_SECONDS}, got {s}"
            ),
        }),
    }
}

/// A tool answer: JSON text, flagged as an error when the code did not succeed.
/// A refusal of the HTTP faces' kind, as a tool error.
fn api_refused(error: &crate::error::ApiError) -> CallToolResult {
    answer(
        json!({ "error": { "code": error.code(), "message": error.message() } }),
        true,
    )
}

fn answer(value: Value, failed: bool) -> CallToolResult {
    let text = serde_json::to_string_pretty(&value).unwrap_or_default();
    if failed {
        CallToolResult::error(vec![ContentBlock::text(text)])
    } else {
        CallToolResult::success(vec![ContentBlock::text(text)])
    }
}

/// MIME types a model reads as an image.
const IMAGE_TYPES: &[&str] = &["image/png", "image/jpeg"];

/// An execution's answer: its JSON (`value`, with the rich results' text forms under
/// `results`), then each image result (a matplotlib figure) as MCP image content.
fn answer_with_results(
    mut value: Value,
    results: &[kiln_core::RichResult],
    failed: bool,
) -> CallToolResult {
    if !results.is_empty() {
        let texts: Vec<Value> = results
            .iter()
            .map(|result| {
                let forms: serde_json::Map<String, Value> = result
                    .data
                    .iter()
                    .filter(|(mime, _)| !IMAGE_TYPES.contains(&mime.as_str()))
                    .map(|(mime, form)| (mime.clone(), Value::String(form.clone())))
                    .collect();
                json!({ "main": result.main, "data": forms })
            })
            .collect();
        value["results"] = Value::Array(texts);
    }
    let mut answer = answer(value, failed);
    for result in results {
        for (mime, data) in &result.data {
            if IMAGE_TYPES.contains(&mime.as_str()) {
                answer
                    .content
                    .push(ContentBlock::image(data.clone(), mime.clone()));
            }
        }
    }
    answer
}

/// A kiln error as a tool error the model can read and act on (MCP's one mapping of
/// [`RuntimeError`]).
fn refused(error: RuntimeError) -> CallToolResult {
    answer(
        json!({ "error": { "code": error.code(), "message": error.to_string(), "details": error.details() } }),
        true,
    )
}

fn reply<T>(
    result: Result<T, RuntimeError>,
    ok: impl FnOnce(T) -> CallToolResult,
) -> CallToolResult {
    match result {
        Ok(value) => ok(value),
        Err(error) => refused(error),
    }
}

/// A file's bytes as MCP content: text when they are UTF-8, else a blob resource with the
/// MIME type its name suggests.
fn file_content(uri: String, bytes: Vec<u8>) -> ContentBlock {
    use base64::Engine as _;
    match String::from_utf8(bytes) {
        Ok(text) => ContentBlock::text(text),
        Err(error) => {
            let bytes = error.into_bytes();
            let mime = match uri
                .rsplit('.')
                .next()
                .map(str::to_ascii_lowercase)
                .as_deref()
            {
                Some("png") => "image/png",
                Some("jpg" | "jpeg") => "image/jpeg",
                Some("gif") => "image/gif",
                Some("pdf") => "application/pdf",
                Some("zip") => "application/zip",
                Some("gz") => "application/gzip",
                _ => "application/octet-stream",
            };
            ContentBlock::resource(rmcp::model::ResourceContents::BlobResourceContents {
                uri,
                mime_type: Some(mime.into()),
                blob: base64::engine::general_purpose::STANDARD.encode(&bytes),
                meta: None,
            })
        }
    }
}

#[tool_router]
impl KilnMcp {
    /// A server over `runtime`.
    pub fn new(runtime: Arc<Runtime>) -> KilnMcp {
        KilnMcp { runtime, app: None }
    }

    /// The HTTP server this MCP is part of, for what lives there (`what`: terminals,
    /// previews); over stdio, the refusal that says so.
    fn served(&self, what: &str) -> Result<&Arc<crate::AppState>, RuntimeError> {
        self.app.as_ref().ok_or_else(|| RuntimeError::Unsupported {
            message: format!(
                "{what} live on `kiln serve` (MCP at /mcp); `kiln mcp` over stdio has none"
            ),
        })
    }

    /// Who is calling: the bearer key's tenant over HTTP, the local tenant over stdio.
    fn caller(&self, context: &RequestContext<RoleServer>) -> Result<Caller, ErrorData> {
        match context.extensions.get::<axum::http::request::Parts>() {
            Some(parts) => parts.extensions.get::<Caller>().cloned().ok_or_else(|| {
                ErrorData::invalid_request("no authenticated caller on this request", None)
            }),
            None => Ok(Caller::local()),
        }
    }

    async fn run_code(
        &self,
        caller: &Caller,
        language: Language,
        input: RunCode,
    ) -> CallToolResult {
        let timeout = match timeout_ms(input.timeout_seconds) {
            Ok(t) => t,
            Err(e) => return refused(e),
        };
        match input.sandbox_id {
            None => {
                // A fresh sandbox with no workspace: the fastest path, nothing kept.
                let mut request = ExecRequest::new(language, input.code);
                request.stdin = input.stdin.unwrap_or_default().into_bytes();
                request.limits = Limits {
                    timeout_ms: timeout.unwrap_or(Limits::default().timeout_ms),
                    ..Limits::default()
                };
                let limits = request.limits.clone();
                match self.runtime.executors.run_once(request).await {
                    Ok(result) => {
                        let mut stderr = result.stderr_text();
                        if let Some(reason) = result.outcome.reason(&limits) {
                            stderr.push_str(&format!("kiln: {reason}\n"));
                        }
                        self.runtime.metrics.execution(language, &result);
                        answer_with_results(
                            json!({
                                "status": if result.success() { "success" } else if matches!(result.outcome, kiln_core::Outcome::TimedOut) { "timeout" } else { "error" },
                                "exit_code": result.exit_code,
                                "stdout": result.stdout_text(),
                                "stderr": stderr,
                                "duration_ms": result.duration_us as f64 / 1000.0,
                            }),
                            &result.results,
                            !result.success(),
                        )
                    }
                    Err(error) => refused(error),
                }
            }
            Some(id) => {
                let code = CodeExec {
                    code: input.code,
                    language: Some(language),
                    stdin: input.stdin.unwrap_or_default().into_bytes(),
                    timeout_ms: timeout,
                    ..CodeExec::default()
                };
                self.execute(caller, &id, code).await
            }
        }
    }

    async fn execute(&self, caller: &Caller, id: &str, code: CodeExec) -> CallToolResult {
        let spec = match exec::prepare(&self.runtime, caller, id, code) {
            Ok(spec) => spec,
            Err(e) => return refused(e),
        };
        reply(
            exec::run(&self.runtime, caller, id, spec, None).await,
            |outcome| {
                answer_with_results(
                    json!({
                        "status": outcome.status(),
                        "execution_id": outcome.exec_id,
                        "exit_code": outcome.result.exit_code,
                        "stdout": outcome.result.stdout_text(),
                        "stderr": outcome.stderr_with_reason(),
                        "duration_ms": outcome.result.duration_us as f64 / 1000.0,
                        "commit_id": outcome.commit_id,
                        "history_recorded": outcome.history_recorded(),
                        "warnings": outcome.warnings(),
                        "files": outcome.outputs.iter().map(|f| json!({"path": f.path, "size": f.size})).collect::<Vec<_>>(),
                    }),
                    &outcome.result.results,
                    outcome.status() != "success",
                )
            },
        )
    }

    async fn set_paused(
        &self,
        context: RequestContext<RoleServer>,
        id: String,
        paused: bool,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let changed =
            kiln_runtime::processes::set_paused(&self.runtime, &caller, &id, paused).await;
        Ok(reply(changed, |(state, took)| {
            answer(
                json!({ "sandbox_id": id, "state": state, "took_ms": took.as_secs_f64() * 1000.0 }),
                false,
            )
        }))
    }

    async fn new_sandbox(
        &self,
        caller: &Caller,
        language: Language,
    ) -> Result<String, RuntimeError> {
        exec::create_default_sandbox(&self.runtime, caller, language)
            .await
            .map(|sandbox| sandbox.id)
    }

    /// A sandbox of a template or with network rules.
    async fn new_sandbox_of(
        &self,
        caller: &Caller,
        input: SandboxCreate,
    ) -> Result<String, RuntimeError> {
        let catalogue = self.runtime.catalogue();
        let image = kiln_runtime::sandbox::SandboxSpec::named_image(
            catalogue,
            input.language.as_deref(),
            input.template.as_deref(),
            "python",
        )?;
        let rules = input.network_rules.map(egress_of).transpose()?;
        let mounts: Vec<kiln_runtime::volumes::VolumeMount> = match input.volume_mounts {
            Some(value) => {
                kiln_http::objects::from_value(value).map_err(|e| RuntimeError::InvalidOption {
                    message: format!("volume_mounts: {e}"),
                })?
            }
            None => Vec::new(),
        };
        let spec = kiln_runtime::sandbox::SandboxSpec::resolve(catalogue, &image, None, None)?
            .with_egress(catalogue, rules)?
            .with_volumes(
                catalogue,
                &self.runtime.registry.volumes,
                &caller.tenant,
                &mounts,
            )?;
        exec::create_sandbox(&self.runtime, caller, spec)
            .await
            .map(|sandbox| sandbox.id)
    }

    #[tool(
        description = "Run Python 3.15 code (numpy, pandas, scipy, scikit-learn, matplotlib available) in a WebAssembly sandbox with no network. Returns stdout, stderr and exit code. Pass sandbox_id to run in a sandbox's persistent workspace."
    )]
    async fn run_python(
        &self,
        Parameters(input): Parameters<RunCode>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        Ok(self.run_code(&caller, Language::Python, input).await)
    }

    #[tool(
        description = "Run JavaScript (QuickJS, ES2023, no Node.js APIs; print with console.log) in a WebAssembly sandbox with no network. Pass sandbox_id to run in a sandbox's persistent workspace."
    )]
    async fn run_javascript(
        &self,
        Parameters(input): Parameters<RunCode>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        Ok(self.run_code(&caller, Language::JavaScript, input).await)
    }

    #[tool(
        description = "Run Go code (a main package, run with `go run`; Go 1.19 and its standard library) in a jailed Linux box with no network. Needs kiln's Linux templates (kiln serve --linux); refused otherwise. Pass sandbox_id to run in a Linux sandbox's persistent workspace."
    )]
    async fn run_go(
        &self,
        Parameters(input): Parameters<RunCode>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        Ok(self.run_code(&caller, Language::Go, input).await)
    }

    #[tool(
        description = "Run a bash script (coreutils, git, curl; python3 where the template has it) in a jailed Linux box with no network. Needs kiln's Linux templates (kiln serve --linux); refused otherwise. Pass sandbox_id to run in a Linux sandbox's persistent workspace."
    )]
    async fn run_bash(
        &self,
        Parameters(input): Parameters<RunCode>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        Ok(self.run_code(&caller, Language::Bash, input).await)
    }

    #[tool(
        description = "Create a sandbox with a persistent, git-versioned workspace (lives 30 minutes). Returns its sandbox_id for the other tools."
    )]
    async fn sandbox_create(
        &self,
        Parameters(input): Parameters<SandboxCreate>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        if let Some(snapshot) = &input.snapshot {
            let made = kiln_runtime::snapshots::create_from(
                &self.runtime,
                &caller,
                snapshot,
                Default::default(),
            )
            .await;
            return Ok(reply(made, |made| {
                answer(
                    json!({
                        "sandbox_id": made.sandbox.id,
                        "copy": made.copy,
                        "restored_processes": made.restored,
                        "processes": made.processes,
                    }),
                    false,
                )
            }));
        }
        let created = if input.template.is_none()
            && input.network_rules.is_none()
            && input.volume_mounts.is_none()
        {
            match language(input.language.as_deref()) {
                Ok(language) => self.new_sandbox(&caller, language).await,
                Err(e) => Err(e),
            }
        } else {
            self.new_sandbox_of(&caller, input).await
        };
        Ok(reply(created, |id| {
            answer(json!({ "sandbox_id": id }), false)
        }))
    }

    #[tool(
        description = "Open a stateful session: variables, imports and definitions persist between session_run calls. Creates a sandbox when sandbox_id is absent. Returns sandbox_id and session_id."
    )]
    async fn session_create(
        &self,
        Parameters(input): Parameters<SessionCreate>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let opened = async {
            let language = language(input.language.as_deref())?;
            let id = match input.sandbox_id {
                Some(id) => id,
                None => self.new_sandbox(&caller, language).await?,
            };
            let info =
                sessions::open(&self.runtime, &caller, &id, language, new_id("ses_")).await?;
            Ok::<_, RuntimeError>((id, info))
        }
        .await;
        Ok(reply(opened, |(id, info)| {
            answer(
                json!({ "sandbox_id": id, "session_id": info.session_id, "language": info.language }),
                false,
            )
        }))
    }

    #[tool(
        description = "Run code in an open session (state persists). Returns stdout, stderr and exit code."
    )]
    async fn session_run(
        &self,
        Parameters(input): Parameters<SessionRun>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let timeout = match timeout_ms(input.timeout_seconds) {
            Ok(t) => t,
            Err(e) => return Ok(refused(e)),
        };
        let session = match self.runtime.registry.session(
            &caller.tenant,
            &input.sandbox_id,
            &input.session_id,
        ) {
            Ok((meta, _)) => meta,
            Err(e) => return Ok(refused(e)),
        };
        let code = CodeExec {
            code: input.code,
            language: Some(session.language),
            timeout_ms: timeout,
            session: Some(input.session_id),
            ..CodeExec::default()
        };
        Ok(self.execute(&caller, &input.sandbox_id, code).await)
    }

    #[tool(
        description = "Fork a Python session: a new session that starts with its variables, imports and definitions (copied in milliseconds, copy-on-write), to try something without disturbing the original. Its /tmp starts empty and open files are not carried over. With with_workspace the fork gets a sandbox of its own whose files start as the original's. Returns sandbox_id and session_id of the fork."
    )]
    async fn fork_session(
        &self,
        Parameters(input): Parameters<ForkSession>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let forked = sessions::fork(
            &self.runtime,
            &caller,
            &input.sandbox_id,
            &input.session_id,
            input.with_workspace.unwrap_or(false),
        )
        .await;
        Ok(reply(forked, |forked| {
            answer(
                json!({
                    "sandbox_id": forked.sandbox_id,
                    "session_id": forked.session.session_id,
                    "forked_from": forked.forked_from,
                    "language": forked.session.language,
                }),
                false,
            )
        }))
    }

    #[tool(description = "Close a session and free its state.")]
    async fn session_close(
        &self,
        Parameters(input): Parameters<SessionClose>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let closed =
            sessions::close(&self.runtime, &caller, &input.sandbox_id, &input.session_id).await;
        Ok(reply(closed, |()| {
            answer(json!({ "closed": input.session_id }), false)
        }))
    }

    #[tool(
        description = "Write a text file into a sandbox's workspace (folders are made as needed)."
    )]
    async fn write_file(
        &self,
        Parameters(input): Parameters<WriteFile>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let written = files::write(
            &self.runtime,
            &caller,
            &input.sandbox_id,
            input.path,
            input.content.into_bytes(),
        )
        .await;
        Ok(reply(written, |change| {
            answer(json!({ "path": change.path, "size": change.size }), false)
        }))
    }

    #[tool(
        description = "Read a file from a sandbox's workspace: UTF-8 text as text, anything else (images, archives) as a base64 blob resource."
    )]
    async fn read_file(
        &self,
        Parameters(input): Parameters<ReadFile>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let input_path = input.path.trim_start_matches('/').to_owned();
        // A tool result goes into a model's context: a few MiB at most.
        let read = files::read(
            &self.runtime,
            &caller,
            &input.sandbox_id,
            input.path,
            4 << 20,
        )
        .await;
        let uri = format!("kiln://sandboxes/{}/files/{}", input.sandbox_id, input_path);
        Ok(reply(read, |bytes| {
            CallToolResult::success(vec![file_content(uri, bytes)])
        }))
    }

    #[tool(
        description = "A Linux sandbox's box: its state (running, paused or stopped), its processes (pid, parent, user, command line, CPU, memory) and the TCP ports they listen on, each with its preview path on the kiln server. Background processes started with run_bash (`cmd &`) keep running and show here."
    )]
    async fn sandbox_processes(
        &self,
        Parameters(input): Parameters<BoxOf>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let id = input.sandbox_id;
        let seen = async {
            let (state, found) =
                kiln_runtime::processes::box_processes(&self.runtime, &caller, &id).await?;
            let (_, ports) =
                kiln_runtime::processes::box_ports(&self.runtime, &caller, &id).await?;
            Ok::<_, RuntimeError>((state, found, ports))
        }
        .await;
        Ok(reply(seen, |(state, found, ports)| {
            answer(
                json!({
                    "sandbox_id": id,
                    "state": state,
                    "processes": found.iter().map(|p| json!({
                        "pid": p.pid, "ppid": p.ppid, "uid": p.uid, "argv": p.argv,
                        "state": p.state, "cpu_ms": p.cpu_ms, "memory_bytes": p.memory_bytes,
                        "agent": p.agent,
                    })).collect::<Vec<_>>(),
                    "ports": ports.iter().map(|p| json!({
                        "port": p.port, "address": p.address, "reachable": p.reachable,
                        "pid": p.pid, "name": p.name,
                        "preview": format!("/preview/{id}/{}/", p.port),
                    })).collect::<Vec<_>>(),
                }),
                false,
            )
        }))
    }

    #[tool(
        description = "Send a signal to a process of a Linux sandbox's box (or to its whole process group): TERM by default, KILL to end it at once."
    )]
    async fn sandbox_signal(
        &self,
        Parameters(input): Parameters<SignalProcess>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let signal = match crate::boxes::signal_number(input.signal.as_ref()) {
            Ok(signal) => signal,
            Err(message) => return Ok(refused(RuntimeError::InvalidRequest { message })),
        };
        let sent = kiln_runtime::processes::signal_box_process(
            &self.runtime,
            &caller,
            &input.sandbox_id,
            input.pid,
            signal,
            input.group.unwrap_or(false),
        )
        .await;
        Ok(reply(sent, |sent| {
            answer(json!({ "signalled": sent }), false)
        }))
    }

    #[tool(
        description = "Restart a Linux sandbox's box: every process ends (servers, background jobs, a fork bomb); its files, in the workspace and outside it, stay."
    )]
    async fn sandbox_restart(
        &self,
        Parameters(input): Parameters<BoxOf>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let killed =
            kiln_runtime::processes::restart_box(&self.runtime, &caller, &input.sandbox_id).await;
        Ok(reply(killed, |killed| {
            answer(json!({ "killed": killed }), false)
        }))
    }

    #[tool(
        description = "Replace a Linux sandbox's egress rules (it must have been made with a network): allowOut/denyOut lists (host names, *.domain, addresses, ranges, optional :port; 0.0.0.0/0 for all; allowOut wins) within the operator's allowlist, and rules that set headers on requests to named hosts, with ${secrets.NAME} filled by kiln's proxy (the secret never enters the sandbox)."
    )]
    async fn sandbox_set_network(
        &self,
        Parameters(input): Parameters<SetNetwork>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let set = match egress_of(input.network_rules) {
            Ok(egress) => {
                kiln_runtime::network::set_network(
                    &self.runtime,
                    &caller,
                    &input.sandbox_id,
                    Some(egress),
                )
                .await
            }
            Err(e) => Err(e),
        };
        Ok(reply(set, |sandbox| {
            answer(
                json!({ "sandbox_id": sandbox.id, "network_rules": sandbox.egress.unwrap_or_default() }),
                false,
            )
        }))
    }

    #[tool(
        description = "Store a secret for the tenant (or replace the value of one of that name). Sandboxes' network rules put it into requests to the hosts they name as ${secrets.NAME}; the value never enters a sandbox and is never returned."
    )]
    async fn secret_set(
        &self,
        Parameters(input): Parameters<SecretSet>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let secrets = self.runtime.secrets.clone();
        let stored = tokio::task::spawn_blocking(move || {
            match secrets.update(&caller.tenant, &input.name, &input.value, None) {
                Err(RuntimeError::SecretNotFound { .. }) => secrets.create(
                    &caller.tenant,
                    &input.name,
                    &input.value,
                    Default::default(),
                ),
                other => other,
            }
        })
        .await
        .unwrap_or_else(|e| Err(RuntimeError::internal(e.to_string())));
        Ok(reply(stored, |info| answer(json!(info), false)))
    }

    #[tool(
        description = "Snapshot a Linux sandbox: its files (workspace and what its box wrote outside it), history and, where kiln can (CRIU), its running processes, with its box paused meanwhile. Start sandboxes from it with sandbox_create's snapshot: their processes go on from the snapshot's."
    )]
    async fn sandbox_snapshot(
        &self,
        Parameters(input): Parameters<SnapshotOf>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let taken = kiln_runtime::snapshots::snapshot(
            &self.runtime,
            &caller,
            &input.sandbox_id,
            input.name,
            input.processes,
        )
        .await;
        Ok(reply(taken, |info| answer(json!(info), false)))
    }

    #[tool(
        description = "Fork a Linux sandbox into count copies (1..=20) that start from it as it is now (its files and, where kiln can, its running processes) and diverge: parallel attempts at one task. Returns each fork's sandbox_id."
    )]
    async fn sandbox_fork(
        &self,
        Parameters(input): Parameters<ForkOf>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let forks = kiln_runtime::snapshots::fork(
            &self.runtime,
            &caller,
            &input.sandbox_id,
            input.count.unwrap_or(1),
            Default::default(),
            input.processes,
        )
        .await;
        Ok(reply(forks, |forks| {
            let list: Vec<Value> = forks
                .into_iter()
                .map(|fork| match fork {
                    Ok(made) => json!({
                        "sandbox_id": made.sandbox.id,
                        "copy": made.copy,
                        "restored_processes": made.restored,
                        "processes": made.processes,
                    }),
                    Err(e) => json!({ "error": { "code": e.code(), "message": e.to_string() } }),
                })
                .collect();
            answer(json!({ "forks": list }), false)
        }))
    }

    #[tool(
        description = "Make a workspace: a long-lived Linux sandbox with services (postgres, redis, mysql, nginx) started in it. Returns its id, its sandbox_id (for run_bash, write_file, read_file, list_files) and each service's host, port and connection string."
    )]
    async fn workspace_create(
        &self,
        Parameters(input): Parameters<WorkspaceCreate>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let made = kiln_runtime::workspaces::create(
            &self.runtime,
            &caller,
            kiln_runtime::workspaces::NewWorkspace {
                name: input.name,
                template: input.template,
                services: input.services,
                public_preview: false,
            },
        )
        .await;
        Ok(reply(made, |ws| answer(json!(ws), false)))
    }

    #[tool(description = "List the tenant's workspaces, with their services and state.")]
    async fn workspace_list(
        &self,
        Parameters(_input): Parameters<Nothing>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let all = self.runtime.registry.workspaces.list_for(&caller);
        Ok(answer(json!({ "workspaces": all }), false))
    }

    #[tool(
        description = "Start a workspace: its box and every service of it (the data they kept is there)."
    )]
    async fn workspace_start(
        &self,
        Parameters(input): Parameters<WorkspaceOf>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let started =
            kiln_runtime::workspaces::start(&self.runtime, &caller, &input.workspace).await;
        Ok(reply(started, |ws| answer(json!(ws), false)))
    }

    #[tool(
        description = "Stop a workspace: its services shut down cleanly and its box sleeps; files, history and service data are kept."
    )]
    async fn workspace_stop(
        &self,
        Parameters(input): Parameters<WorkspaceOf>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let stopped =
            kiln_runtime::workspaces::stop(&self.runtime, &caller, &input.workspace).await;
        Ok(reply(stopped, |ws| answer(json!(ws), false)))
    }

    #[tool(description = "Delete a workspace with its files, history and service data.")]
    async fn workspace_delete(
        &self,
        Parameters(input): Parameters<WorkspaceOf>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let deleted =
            kiln_runtime::workspaces::delete(&self.runtime, &caller, &input.workspace).await;
        Ok(reply(deleted, |()| {
            answer(json!({ "deleted": true }), false)
        }))
    }

    #[tool(
        description = "Add a service to a workspace (postgres, redis, mysql, nginx), started now and with the workspace from then on. Returns its host, port and connection string (reachable from inside the workspace)."
    )]
    async fn add_service(
        &self,
        Parameters(input): Parameters<ServiceAdd>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let added = match kiln_runtime::workspaces::ServiceKind::parse(&input.service_type) {
            Ok(kind) => {
                kiln_runtime::workspaces::add_service(
                    &self.runtime,
                    &caller,
                    &input.workspace,
                    kind,
                )
                .await
            }
            Err(e) => Err(e),
        };
        Ok(reply(added, |service| answer(json!(service), false)))
    }

    #[tool(
        description = "Enable a workspace's preview: static serves its files (or a folder of them) with nginx, proxy shows what its own server answers on a port. Returns a signed URL, relative to this server, that works without a key for an hour."
    )]
    async fn enable_preview(
        &self,
        Parameters(input): Parameters<PreviewEnable>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let app = match self.served("previews") {
            Ok(app) => app,
            Err(unserved) => return Ok(refused(unserved)),
        };
        Ok(
            match crate::workspaces::enable_preview(
                app,
                &caller,
                &input.workspace,
                &input.preview_type,
                input.root_path.as_deref(),
                input.port,
                3600,
            )
            .await
            {
                Ok(preview) => answer(json!(preview), false),
                Err(e) => api_refused(&e),
            },
        )
    }

    #[tool(
        description = "Run one SQL statement against a workspace's postgres or mysql. Returns columns and rows as JSON (at most 1000 rows), bounded in time; a statement the database refuses is an error in its words."
    )]
    async fn run_sql(
        &self,
        Parameters(input): Parameters<SqlRun>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let ran = kiln_runtime::workspaces::run_sql(
            &self.runtime,
            &caller,
            &input.workspace,
            input.service.as_deref(),
            &input.query,
            input.timeout_ms,
        )
        .await;
        Ok(reply(ran, |rows| answer(json!(rows), false)))
    }

    #[tool(
        description = "Share a workspace of yours with another key of your tenant: read (see it, its files, history and workflows; read-only SQL), write (work in it and its sandbox as you do, but not delete or share it), or none. Nobody else of the tenant sees it."
    )]
    async fn workspace_share(
        &self,
        Parameters(input): Parameters<WorkspaceShare>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let app = match self.served("sharing") {
            Ok(app) => app,
            Err(unserved) => return Ok(refused(unserved)),
        };
        let access = match input.access.as_str() {
            "read" => Some(kiln_runtime::workspaces::Access::Read),
            "write" => Some(kiln_runtime::workspaces::Access::Write),
            "none" => None,
            other => {
                return Ok(refused(RuntimeError::InvalidOption {
                    message: format!("access {other:?}: read, write or none"),
                }));
            }
        };
        let ws = match self.runtime.registry.workspaces.get_as(
            &caller,
            &input.workspace,
            kiln_runtime::workspaces::Need::Own,
        ) {
            Ok(ws) => ws,
            Err(e) => return Ok(refused(e)),
        };
        let mut list: Vec<_> = ws
            .collaborators
            .into_iter()
            .filter(|c| c.key_id != input.key_id)
            .collect();
        if let Some(access) = access {
            list.push(kiln_runtime::workspaces::Collaborator {
                key_id: input.key_id,
                access,
            });
        }
        Ok(
            match crate::workspaces::share(app, &caller, &input.workspace, list) {
                Ok(ws) => answer(json!(ws), false),
                Err(e) => api_refused(&e),
            },
        )
    }

    #[tool(
        description = "List the workflow templates (static-website, fullstack-app, database-schema, and the operator's): their files, services, preview and review criteria."
    )]
    async fn workflow_templates(
        &self,
        Parameters(_input): Parameters<Nothing>,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let app = match self.served("workflows") {
            Ok(app) => app,
            Err(unserved) => return Ok(refused(unserved)),
        };
        let names = app.workflows.templates.names();
        Ok(answer(json!({ "templates": names }), false))
    }

    #[tool(
        description = "Start a multi-agent workflow: a creator agent builds the task in a workspace, a reviewer agent reviews it, and they go round (creation, review, revision) until it is approved or rejected. Returns its state; follow it with workflow_get."
    )]
    async fn workflow_start(
        &self,
        Parameters(input): Parameters<WorkflowStart>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let app = match self.served("workflows") {
            Ok(app) => app,
            Err(unserved) => return Ok(refused(unserved)),
        };
        let human = |yes: bool| {
            Some(crate::workflows::WorkflowRoleChoice {
                human: yes,
                model: None,
            })
        };
        let started = crate::workflows::start(
            app,
            &caller,
            crate::workflows::NewWorkflow {
                template: input.template,
                task: input.task,
                workspace: input.workspace,
                max_rounds: input.max_rounds,
                roles: crate::workflows::WorkflowRoleChoices {
                    creator: human(input.human_creator),
                    reviewer: human(input.human_reviewer),
                },
            },
        )
        .await;
        Ok(match started {
            Ok(state) => answer(json!(state), false),
            Err(e) => api_refused(&e),
        })
    }

    #[tool(
        description = "A workflow's state: its stage (creation, review, revision, approved, rejected), whose turn it is, its reviews, its preview URL and its audit trail."
    )]
    async fn workflow_get(
        &self,
        Parameters(input): Parameters<WorkflowOf>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let app = match self.served("workflows") {
            Ok(app) => app,
            Err(unserved) => return Ok(refused(unserved)),
        };
        Ok(
            match crate::workflows::get_for(
                app,
                &caller,
                &input.workflow_id,
                kiln_runtime::workspaces::Need::Read,
            ) {
                Ok(state) => answer(json!(state), false),
                Err(e) => api_refused(&e),
            },
        )
    }

    #[tool(description = "Cancel a running workflow: its agent stops and it is rejected.")]
    async fn workflow_cancel(
        &self,
        Parameters(input): Parameters<WorkflowOf>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let app = match self.served("workflows") {
            Ok(app) => app,
            Err(unserved) => return Ok(refused(unserved)),
        };
        Ok(
            match crate::workflows::cancel(app, &caller, &input.workflow_id).await {
                Ok(state) => answer(json!(state), false),
                Err(e) => api_refused(&e),
            },
        )
    }

    #[tool(
        description = "Act as a workflow's creator (one started with human_creator): submit the work for review, with notes."
    )]
    async fn workflow_submit_for_review(
        &self,
        Parameters(input): Parameters<WorkflowSubmit>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let app = match self.served("workflows") {
            Ok(app) => app,
            Err(unserved) => return Ok(refused(unserved)),
        };
        Ok(
            match crate::workflows::act(
                app,
                &caller,
                &input.workflow_id,
                crate::workflows::WorkflowRole::Creator,
                &json!({ "notes": input.notes }),
            )
            .await
            {
                Ok(state) => answer(json!(state), false),
                Err(e) => api_refused(&e),
            },
        )
    }

    #[tool(
        description = "Act as a workflow's reviewer (one started with human_reviewer): approve it with a grade, or send it back with feedback and suggestions."
    )]
    async fn workflow_submit_review(
        &self,
        Parameters(input): Parameters<WorkflowReview>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let app = match self.served("workflows") {
            Ok(app) => app,
            Err(unserved) => return Ok(refused(unserved)),
        };
        let review = json!({
            "approved": input.approved,
            "grade": input.grade,
            "feedback": input.feedback,
            "suggestions": input.suggestions,
        });
        Ok(
            match crate::workflows::act(
                app,
                &caller,
                &input.workflow_id,
                crate::workflows::WorkflowRole::Reviewer,
                &review,
            )
            .await
            {
                Ok(state) => answer(json!(state), false),
                Err(e) => api_refused(&e),
            },
        )
    }

    #[tool(
        description = "Make a named volume: storage that outlives sandboxes and is shared between them (mount it with sandbox_create's volume_mounts)."
    )]
    async fn volume_create(
        &self,
        Parameters(input): Parameters<VolumeCreate>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let made = crate::volumes::make(
            &self.runtime,
            &caller,
            input.name,
            input.size_mb.map(|mb| mb.saturating_mul(1 << 20)),
            Default::default(),
        )
        .await;
        Ok(reply(made, |volume| answer(json!(volume), false)))
    }

    #[tool(description = "List the tenant's named volumes, with the bytes each uses.")]
    async fn volume_list(
        &self,
        Parameters(_input): Parameters<Nothing>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let volumes = &self.runtime.registry.volumes;
        let list: Vec<Value> = volumes
            .list(&caller.tenant)
            .into_iter()
            .map(|v| {
                let used = volumes.used(&v.id);
                let mut value = json!(v);
                value["usedBytes"] = json!(used);
                value
            })
            .collect();
        Ok(answer(json!({ "volumes": list }), false))
    }

    #[tool(
        description = "Delete a named volume and its files (refused while a live sandbox mounts it)."
    )]
    async fn volume_delete(
        &self,
        Parameters(input): Parameters<VolumeOf>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let runtime = self.runtime.clone();
        let (tenant, which) = (caller.tenant.clone(), input.volume.clone());
        let deleted = tokio::task::spawn_blocking(move || {
            runtime
                .registry
                .volumes
                .delete(&tenant, &which, |id| runtime.registry.volume_users(id))
        })
        .await
        .unwrap_or_else(|e| Err(RuntimeError::internal(e.to_string())));
        let deleted = match deleted {
            Ok(true) => Ok(input.volume),
            Ok(false) => Err(RuntimeError::VolumeNotFound {
                volume: input.volume,
            }),
            Err(e) => Err(e),
        };
        Ok(reply(deleted, |name| {
            answer(json!({ "deleted": name }), false)
        }))
    }

    #[tool(description = "List the tenant's secrets: names, ids, versions (never values).")]
    async fn secret_list(
        &self,
        Parameters(_input): Parameters<Nothing>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        Ok(reply(self.runtime.secrets.list(&caller.tenant), |list| {
            answer(json!({ "secrets": list }), false)
        }))
    }

    #[tool(description = "Delete one of the tenant's secrets by name or id.")]
    async fn secret_delete(
        &self,
        Parameters(input): Parameters<SecretOf>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let deleted = match self.runtime.secrets.delete(&caller.tenant, &input.name) {
            Ok(true) => Ok(input.name),
            Ok(false) => Err(RuntimeError::SecretNotFound { name: input.name }),
            Err(e) => Err(e),
        };
        Ok(reply(deleted, |name| {
            answer(json!({ "deleted": name }), false)
        }))
    }

    #[tool(
        description = "Pause a Linux sandbox's box: its processes are frozen with their memory, files and connections, using no CPU, until sandbox_resume or the next command."
    )]
    async fn sandbox_pause(
        &self,
        Parameters(input): Parameters<BoxOf>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.set_paused(context, input.sandbox_id, true).await
    }

    #[tool(
        description = "Hibernate a Linux sandbox's box: its memory goes back to the host and its files stay (in the workspace and outside it); its processes end. The next command starts a box from its files."
    )]
    async fn sandbox_hibernate(
        &self,
        Parameters(input): Parameters<BoxOf>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let id = input.sandbox_id;
        let done = kiln_runtime::processes::hibernate(&self.runtime, &caller, &id).await;
        Ok(reply(done, |(state, why, took)| {
            answer(
                json!({ "sandbox_id": id, "state": state, "processes": why, "took_ms": took.as_secs_f64() * 1000.0 }),
                false,
            )
        }))
    }

    #[tool(
        description = "Open a terminal in a Linux sandbox's box, optionally typing a command into its shell (a dev server, a REPL). The shell keeps running when nobody watches. Answers the terminal's id, its output so far, and a signed link to its browser page (xterm.js on the kiln server) that a person can open to watch and type."
    )]
    async fn sandbox_terminal(
        &self,
        Parameters(input): Parameters<OpenTerminal>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let app = match self.served("terminals") {
            Ok(app) => app,
            Err(unserved) => return Ok(refused(unserved)),
        };
        let wait = std::time::Duration::from_millis(input.wait_ms.unwrap_or(1000).min(10_000));
        let opened = async {
            let terminal = crate::terminals::open(
                app,
                &caller,
                &input.sandbox_id,
                crate::terminals::NewTerminal::default(),
            )
            .await?;
            if let Some(command) = &input.command {
                terminal
                    .type_in(format!("{command}\n").into_bytes())
                    .await?;
            }
            tokio::time::sleep(wait).await;
            let link = crate::terminals::page_link(
                app,
                &caller,
                &input.sandbox_id,
                &terminal.info().terminal_id,
                3600,
            )?;
            Ok::<_, crate::error::ApiError>((terminal, link))
        }
        .await;
        Ok(match opened {
            Ok((terminal, link)) => {
                let info = terminal.info();
                answer(
                    json!({
                        "sandbox_id": input.sandbox_id,
                        "terminal_id": info.terminal_id,
                        "output": String::from_utf8_lossy(&terminal.tail(16 << 10)),
                        "exited": info.exited,
                        "page": link.url,
                        "page_expires_at": link.expires_at,
                        "attach": info.attach,
                    }),
                    false,
                )
            }
            Err(e) => api_refused(&e),
        })
    }

    #[tool(
        description = "A signed link to a preview of a server in a Linux sandbox's box (HTTP and WebSocket, on the kiln server): a person can open it without an API key until it expires."
    )]
    async fn sandbox_preview_link(
        &self,
        Parameters(input): Parameters<PreviewOf>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let app = match self.served("previews") {
            Ok(app) => app,
            Err(unserved) => return Ok(refused(unserved)),
        };
        Ok(
            match crate::preview::link(
                app,
                &caller,
                &input.sandbox_id,
                input.port,
                input.ttl_seconds.unwrap_or(3600),
            ) {
                Ok(link) => answer(
                    json!({ "sandbox_id": input.sandbox_id, "port": link.port, "url": link.url, "expires_at": link.expires_at }),
                    false,
                ),
                Err(e) => api_refused(&e),
            },
        )
    }

    #[tool(description = "Resume a paused Linux sandbox's box.")]
    async fn sandbox_resume(
        &self,
        Parameters(input): Parameters<BoxOf>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.set_paused(context, input.sandbox_id, false).await
    }

    #[tool(description = "List the files in a sandbox's workspace (recursive).")]
    async fn list_files(
        &self,
        Parameters(input): Parameters<ListFiles>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let caller = self.caller(&context)?;
        let listed = files::list(&self.runtime, &caller, &input.sandbox_id, input.path).await;
        Ok(reply(listed, |list| {
            answer(serde_json::to_value(&list).unwrap_or_default(), false)
        }))
    }
}

#[tool_handler]
impl ServerHandler for KilnMcp {
    async fn call_tool(
        &self,
        request: rmcp::model::CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::CallToolResponse, ErrorData> {
        // A workspace's sandbox answers its owner and its writers only, as on the HTTP
        // routes: to other keys of the tenant it does not exist.
        if let Some(id) = request
            .arguments
            .as_ref()
            .and_then(|a| a.get("sandbox_id"))
            .and_then(Value::as_str)
        {
            let caller = self.caller(&context)?;
            if !self
                .runtime
                .registry
                .workspaces
                .may_use_sandbox(&caller, id)
            {
                return Ok(refused(RuntimeError::SandboxNotFound { id: id.to_owned() }).into());
            }
        }
        let tcc = rmcp::handler::server::tool::ToolCallContext::new(self, request, context);
        Self::tool_router().call(tcc).await
    }

    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build()).with_instructions(
            "kiln runs code in WebAssembly sandboxes with no network: run_python / run_javascript for one-off code; sandbox_create plus the file tools for a persistent workspace; session_create / session_run for state that persists between runs; fork_session to branch a Python session's state.",
        )
    }
}

/// The streamable-HTTP service for `/mcp` on `kiln serve`.
pub fn http_service(
    app: Arc<crate::AppState>,
    allowed_hosts: Vec<String>,
) -> rmcp::transport::streamable_http_server::StreamableHttpService<
    KilnMcp,
    rmcp::transport::streamable_http_server::session::local::LocalSessionManager,
> {
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
    };
    let mut config = StreamableHttpServerConfig::default();
    config.allowed_hosts = allowed_hosts;
    StreamableHttpService::new(
        move || {
            Ok(KilnMcp {
                runtime: app.runtime.clone(),
                app: Some(app.clone()),
            })
        },
        Arc::new(LocalSessionManager::default()),
        config,
    )
}

/// Serves MCP over stdin/stdout until the client closes them.
pub async fn serve_stdio(runtime: Arc<Runtime>) -> std::io::Result<()> {
    use rmcp::ServiceExt;
    let service = KilnMcp::new(runtime)
        .serve(rmcp::transport::stdio())
        .await
        .map_err(std::io::Error::other)?;
    service.waiting().await.map_err(std::io::Error::other)?;
    Ok(())
}
