//! The tool-calling agent: a model (any [`ChatModel`]) gets `execute_code` (run in a kiln
//! sandbox; one session per language per sandbox, so state persists between calls) and the
//! workspace file tools. Tool results go back truncated to a stated budget; turn, tool-call
//! and repeat budgets end runaway loops; an optional final answer is validated against the
//! caller's JSON schema (one retry with the validation error, then a clear error).
//!
//! The conversation is the caller's: messages in, messages out. The sandbox is named in the
//! reply so the next request can continue in it.

use kiln_http::stream::OutputCarry;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use kiln_core::Language;
use kiln_core::backend::StreamKind;
use kiln_executor::Chunk;
use kiln_llm::{
    ChatModel, Message, ModelEvent, ModelRequest, RetryPolicy, Role, ToolCall, ToolSpec, Usage,
    complete_with_retries,
};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::mpsc::{self, UnboundedSender};

use crate::AppState;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::exec::{self, CodeExec};
use crate::sandbox::new_id;
use kiln_runtime::RuntimeError;
use kiln_runtime::{files, sessions};

/// Limits of one agent run.
#[derive(Debug, Clone)]
pub struct AgentLimits {
    /// Model calls in one run.
    pub max_turns: usize,
    /// Tool calls in one run.
    pub max_tool_calls: usize,
    /// The same call (name and arguments) at most this many times.
    pub max_repeats: usize,
    /// Characters of one tool result sent back to the model.
    pub tool_result_chars: usize,
    /// One model call's time limit.
    pub model_timeout: Duration,
    pub retry: RetryPolicy,
}

impl Default for AgentLimits {
    fn default() -> AgentLimits {
        AgentLimits {
            max_turns: 12,
            max_tool_calls: 24,
            max_repeats: 3,
            tool_result_chars: 8_000,
            model_timeout: Duration::from_secs(120),
            retry: RetryPolicy::default(),
        }
    }
}

/// What an agent run reports as it goes (sent to clients as Server-Sent Events).
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AgentEvent {
    Sandbox {
        sandbox_id: String,
    },
    TextDelta {
        text: String,
    },
    ToolCallStart {
        id: String,
        name: String,
    },
    ToolCallArguments {
        id: String,
        delta: String,
    },
    Stdout {
        id: String,
        data: String,
    },
    Stderr {
        id: String,
        data: String,
    },
    /// A rich result of tool call `id`: a figure, a displayed value, the cell's own value.
    Display {
        id: String,
        result: kiln_core::RichResult,
    },
    ToolResult {
        id: String,
        name: String,
        result: String,
        truncated: bool,
        is_error: bool,
    },
    Artifact {
        path: String,
        size: u64,
        download: String,
    },
    Final {
        message: Message,
        structured: Option<Value>,
        messages: Vec<Message>,
        sandbox_id: String,
        usage: Usage,
    },
    Error {
        code: String,
        message: String,
    },
}

impl AgentEvent {
    pub fn name(&self) -> &'static str {
        match self {
            AgentEvent::Sandbox { .. } => "sandbox",
            AgentEvent::TextDelta { .. } => "text_delta",
            AgentEvent::ToolCallStart { .. } => "tool_call_start",
            AgentEvent::ToolCallArguments { .. } => "tool_call_arguments",
            AgentEvent::Stdout { .. } => "stdout",
            AgentEvent::Stderr { .. } => "stderr",
            AgentEvent::Display { .. } => "display",
            AgentEvent::ToolResult { .. } => "tool_result",
            AgentEvent::Artifact { .. } => "artifact",
            AgentEvent::Final { .. } => "final",
            AgentEvent::Error { .. } => "error",
        }
    }
}

/// One agent run's input.
#[derive(Clone, Default)]
pub struct AgentInput {
    pub messages: Vec<Message>,
    pub output_schema: Option<Value>,
    /// Continue in this sandbox; a new one otherwise.
    pub sandbox: Option<String>,
    /// Work in this workspace (its sandbox is `sandbox`): the workspace tools are offered.
    pub workspace: Option<String>,
    /// Offer only these of the tools (a workflow role's); `None`: all of them.
    pub only_tools: Option<Vec<String>>,
    /// More tools, answered by the caller (a workflow's transitions); the run ends once
    /// [`TurnHook::done`] says so.
    pub hook: Option<Arc<dyn TurnHook>>,
}

impl std::fmt::Debug for AgentInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentInput")
            .field("messages", &self.messages.len())
            .field("sandbox", &self.sandbox)
            .field("workspace", &self.workspace)
            .field("only_tools", &self.only_tools)
            .finish()
    }
}

/// Tools a run's caller answers itself (a workflow's `submit_for_review`, …).
pub trait TurnHook: Send + Sync {
    /// The tools it adds.
    fn tools(&self) -> Vec<ToolSpec>;
    /// Answers a call of one of its tools (`None`: not one of them).
    fn call(&self, name: &str, arguments: &Value) -> Option<(String, bool)>;
    /// The run's work is done (a transition was made): the run ends after this turn's calls.
    fn done(&self) -> bool;
}

/// The tools of a run in a workspace (seed 002's): services, SQL and the preview.
pub fn workspace_tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "add_service".into(),
            description: "Add a service to the workspace (postgres, redis, mysql, nginx), started now and with the workspace from then on. Returns its host, port and connection string, reachable from code in the workspace.".into(),
            parameters: json!({"type": "object", "properties": {"service_type": {"type": "string", "enum": ["postgres", "redis", "mysql", "nginx"]}}, "required": ["service_type"]}),
        },
        ToolSpec {
            name: "run_sql".into(),
            description: "Run one SQL statement against the workspace's postgres or mysql. Returns columns and rows as JSON (at most 1000 rows); a statement the database refuses comes back as an error in its words.".into(),
            parameters: json!({"type": "object", "properties": {"query": {"type": "string"}, "service": {"type": "string", "enum": ["postgres", "mysql"]}}, "required": ["query"]}),
        },
        ToolSpec {
            name: "enable_preview".into(),
            description: "Enable the workspace's preview: static serves its files (or the folder root_path) with nginx, proxy shows what a server of the workspace answers on port. Returns a URL that works without a key for an hour.".into(),
            parameters: json!({"type": "object", "properties": {"preview_type": {"type": "string", "enum": ["static", "proxy"]}, "root_path": {"type": "string"}, "port": {"type": "integer", "minimum": 1, "maximum": 65535}}, "required": ["preview_type"]}),
        },
    ]
}

/// The languages `execute_code` offers on this server: those some template runs (go and
/// bash need Linux templates), each with what runs it.
pub fn languages(executors: &kiln_runtime::Executors) -> Vec<(Language, String)> {
    Language::ALL
        .iter()
        .filter_map(|&language| {
            let template = executors.preferred_template(language).ok()?;
            Some((language, template.description.clone()))
        })
        .collect()
}

/// The tools offered to the model, for the languages this server runs.
pub fn tools(executors: &kiln_runtime::Executors) -> Vec<ToolSpec> {
    let languages = languages(executors);
    let names: Vec<&str> = languages.iter().map(|(l, _)| l.name()).collect();
    let runs: Vec<String> = languages
        .iter()
        .map(|(l, description)| format!("{l}: {description}"))
        .collect();
    vec![
        ToolSpec {
            name: "execute_code".into(),
            description: format!(
                "Run code in a sandbox with no network. Languages — {}. Python and JavaScript keep their state between calls of one language where the sandbox has sessions: variables, imports; files in the working directory are kept. Files you write (plots, CSVs) are returned as artifacts. Print what you need to see.",
                runs.join("; ")
            ),
            parameters: json!({
                "type": "object",
                "properties": {
                    "language": {"type": "string", "enum": names},
                    "code": {"type": "string"},
                    "timeout_seconds": {"type": "number", "minimum": 1, "maximum": 300}
                },
                "required": ["language", "code"]
            }),
        },
        ToolSpec {
            name: "write_file".into(),
            description:
                "Write a text file into the sandbox's workspace (the code's working directory)."
                    .into(),
            parameters: json!({"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}),
        },
        ToolSpec {
            name: "read_file".into(),
            description: "Read a text file from the sandbox's workspace.".into(),
            parameters: json!({"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}),
        },
        ToolSpec {
            name: "list_files".into(),
            description: "List the files in the sandbox's workspace.".into(),
            parameters: json!({"type": "object", "properties": {"path": {"type": "string"}}}),
        },
    ]
}

/// Cuts `text` to `budget` characters, saying how much was left out.
pub fn truncate(text: &str, budget: usize) -> (String, bool) {
    let count = text.chars().count();
    if count <= budget {
        return (text.to_owned(), false);
    }
    let head: String = text.chars().take(budget).collect();
    (
        format!(
            "{head}\n[... {} more characters not shown; print less, or summarise]",
            count - budget
        ),
        true,
    )
}

struct Run<'a> {
    state: &'a Arc<AppState>,
    caller: &'a Caller,
    sandbox: String,
    /// The workspace the run works in, if any (its tools are offered).
    workspace: Option<String>,
    /// The tools offered, by name (the others are refused if called).
    offered: Vec<String>,
    hook: Option<Arc<dyn TurnHook>>,
    /// Sessions by language, each in the sandbox that runs its language.
    sessions: BTreeMap<&'static str, String>,
    /// Sandboxes of this run for languages the run's sandbox's template does not speak
    /// (`go` beside a Python sandbox): made on first use, deleted when the run ends.
    others: BTreeMap<&'static str, String>,
    events: &'a UnboundedSender<AgentEvent>,
}

fn tool_error(message: impl Into<String>) -> (String, bool) {
    (format!("error: {}", message.into()), true)
}

fn error_text(error: &RuntimeError) -> String {
    format!("{error} ({})", error.code())
}

impl Run<'_> {
    /// The sandbox that runs `language`: the run's own where its template speaks it, else
    /// one of the language's preferred template, made on first use.
    async fn sandbox_for(&mut self, language: Language) -> Result<String, RuntimeError> {
        let runtime = &self.state.runtime;
        let view = runtime.registry.get(&self.caller.tenant, &self.sandbox)?;
        let speaks = runtime
            .catalogue()
            .get(view.meta.template())
            .is_some_and(|t| t.languages.contains(&language));
        if speaks {
            return Ok(self.sandbox.clone());
        }
        if let Some(id) = self.others.get(language.name()) {
            return Ok(id.clone());
        }
        let made = exec::create_default_sandbox(runtime, self.caller, language).await?;
        self.others.insert(language.name(), made.id.clone());
        Ok(made.id)
    }

    /// Deletes the sandboxes made for other languages.
    async fn close_others(&mut self) {
        for (_, id) in std::mem::take(&mut self.others) {
            let _ = self.state.runtime.delete_sandbox(self.caller, &id).await;
        }
    }

    async fn session(&mut self, language: Language, sandbox: &str) -> Result<String, RuntimeError> {
        if let Some(id) = self.sessions.get(language.name()) {
            let (_, handle) =
                self.state
                    .runtime
                    .registry
                    .session(&self.caller.tenant, sandbox, id)?;
            if handle.is_some() {
                return Ok(id.clone());
            }
            // Its state ended (a timeout, a crash): start over in a fresh one.
            let _ = self
                .state
                .runtime
                .registry
                .remove_session(&self.caller.tenant, sandbox, id);
        }
        let info = sessions::open(
            &self.state.runtime,
            self.caller,
            sandbox,
            language,
            new_id("ses_"),
        )
        .await?;
        self.sessions
            .insert(language.name(), info.session_id.clone());
        Ok(info.session_id)
    }

    async fn execute_code(&mut self, call: &ToolCall) -> (String, bool) {
        let (code, language, timeout_ms) = match execute_args(&call.arguments) {
            Ok(args) => args,
            Err(message) => return tool_error(message),
        };
        let sandbox = match self.sandbox_for(language).await {
            Ok(sandbox) => sandbox,
            Err(e) => return tool_error(error_text(&e)),
        };
        // Over the tenant's session quota the code still runs, as a one-shot in the same
        // workspace; the model is told that variables are not kept. A template without
        // sessions for the language (Go, bash) runs each call as a one-shot.
        let (session, note) = match self.session(language, &sandbox).await {
            Ok(session) => (Some(session), None),
            Err(RuntimeError::Unsupported { .. }) => (None, None),
            Err(e @ RuntimeError::QuotaExceeded { .. }) => (
                None,
                Some(format!(
                    "note: ran as a one-shot (variables are not kept between calls; files are): {e}\n"
                )),
            ),
            Err(e) => return tool_error(error_text(&e)),
        };
        let code = CodeExec {
            code,
            language: Some(language),
            timeout_ms,
            session,
            ..CodeExec::default()
        };
        let spec = match exec::prepare(&self.state.runtime, self.caller, &sandbox, code) {
            Ok(spec) => spec,
            Err(e) => return tool_error(error_text(&e)),
        };
        let exec_id = spec.exec_id.clone();
        let (chunks_tx, relay) = relay_output(self.events.clone(), call.id.clone());
        let ran = exec::run(
            &self.state.runtime,
            self.caller,
            &sandbox,
            spec,
            Some(chunks_tx),
        )
        .await;
        let _ = relay.await;
        let outcome = match ran {
            Ok(outcome) => outcome,
            Err(e) => return tool_error(error_text(&e)),
        };
        if outcome.commit_id.is_some() && sandbox == self.sandbox {
            self.report_artifacts(&exec_id).await;
        }
        (describe(&outcome, note), outcome.status() != "success")
    }

    /// Files an execution wrote, reported as artifacts the client can download.
    async fn report_artifacts(&self, exec_id: &str) {
        let Ok(view) = self
            .state
            .runtime
            .registry
            .get(&self.caller.tenant, &self.sandbox)
        else {
            return;
        };
        let sandbox = view.meta;
        let exec_id = exec_id.to_owned();
        let changed = tokio::task::spawn_blocking(move || {
            let history = sandbox.history().ok()?;
            let tree = sandbox.tree().ok()?;
            let entry = history.entries(1).ok()?.pop()?;
            (entry.id == exec_id).then(|| {
                entry
                    .files
                    .into_iter()
                    .filter_map(|path| {
                        let meta = tree
                            .stat(&kiln_workspace::RelPath::parse(&path).ok()?)
                            .ok()??;
                        (meta.kind == kiln_workspace::Kind::File).then_some((path, meta.size))
                    })
                    .collect::<Vec<_>>()
            })
        })
        .await
        .ok()
        .flatten()
        .unwrap_or_default();
        for (path, size) in changed {
            let download = format!("/api/v1/sandboxes/{}/files/{path}", self.sandbox);
            let _ = self.events.send(AgentEvent::Artifact {
                path,
                size,
                download,
            });
        }
    }

    async fn file_tool(&mut self, call: &ToolCall) -> (String, bool) {
        let args = &call.arguments;
        let path = args.get("path").and_then(Value::as_str).map(str::to_owned);
        match call.name.as_str() {
            "write_file" => {
                let (Some(path), Some(content)) =
                    (path, args.get("content").and_then(Value::as_str))
                else {
                    return tool_error(
                        "write_file needs {\"path\": \"...\", \"content\": \"...\"}",
                    );
                };
                match files::write(
                    &self.state.runtime,
                    self.caller,
                    &self.sandbox,
                    path.clone(),
                    content.as_bytes().to_vec(),
                )
                .await
                {
                    Ok(change) => (
                        format!("wrote {} ({} bytes)", change.path, change.size),
                        false,
                    ),
                    Err(e) => tool_error(error_text(&e)),
                }
            }
            "read_file" => {
                let Some(path) = path else {
                    return tool_error("read_file needs {\"path\": \"...\"}");
                };
                match files::read(
                    &self.state.runtime,
                    self.caller,
                    &self.sandbox,
                    path,
                    1 << 20,
                )
                .await
                {
                    Ok(bytes) => (String::from_utf8_lossy(&bytes).into_owned(), false),
                    Err(e) => tool_error(error_text(&e)),
                }
            }
            _ => match files::list(&self.state.runtime, self.caller, &self.sandbox, path).await {
                Ok(list) => (
                    list.files
                        .iter()
                        .map(|f| format!("{} {} {}", f.kind, f.size, f.path))
                        .collect::<Vec<_>>()
                        .join("\n"),
                    false,
                ),
                Err(e) => tool_error(error_text(&e)),
            },
        }
    }

    /// `add_service`, `run_sql` and `enable_preview`, in the run's workspace.
    async fn workspace_tool(&mut self, call: &ToolCall) -> (String, bool) {
        let Some(workspace) = self.workspace.clone() else {
            return tool_error("this run has no workspace");
        };
        let text = |name: &str| call.arguments.get(name).and_then(Value::as_str);
        let rt = &self.state.runtime;
        let answered: Result<Value, String> = match call.name.as_str() {
            "add_service" => match text("service_type") {
                None => Err("add_service needs {\"service_type\": \"postgres\"}".into()),
                Some(name) => match kiln_runtime::workspaces::ServiceKind::parse(name) {
                    Err(e) => Err(error_text(&e)),
                    Ok(kind) => {
                        kiln_runtime::workspaces::add_service(rt, self.caller, &workspace, kind)
                            .await
                            .map(|s| json!(s))
                            .map_err(|e| error_text(&e))
                    }
                },
            },
            "run_sql" => match text("query") {
                None => Err("run_sql needs {\"query\": \"select ...\"}".into()),
                Some(query) => kiln_runtime::workspaces::run_sql(
                    rt,
                    self.caller,
                    &workspace,
                    text("service"),
                    query,
                    None,
                )
                .await
                .map(|rows| json!(rows))
                .map_err(|e| error_text(&e)),
            },
            _ => match text("preview_type") {
                None => Err("enable_preview needs {\"preview_type\": \"static\"}".into()),
                Some(kind) => {
                    let port = call
                        .arguments
                        .get("port")
                        .and_then(Value::as_u64)
                        .and_then(|p| u16::try_from(p).ok());
                    crate::workspaces::enable_preview(
                        self.state,
                        self.caller,
                        &workspace,
                        kind,
                        text("root_path"),
                        port,
                        3600,
                    )
                    .await
                    .map(|p| json!(p))
                    .map_err(|e| e.message().to_owned())
                }
            },
        };
        match answered {
            Ok(value) => (truncate(&value.to_string(), 20_000).0, false),
            Err(message) => tool_error(message),
        }
    }

    async fn call_tool(&mut self, call: &ToolCall) -> (String, bool) {
        if !call.arguments.is_object() {
            return tool_error(format!(
                "the arguments of {} must be a JSON object; got {}",
                call.name,
                truncate(&call.arguments.to_string(), 200).0
            ));
        }
        if !self.offered.contains(&call.name) {
            return tool_error(format!(
                "there is no tool {:?} here; the tools are {}",
                call.name,
                self.offered.join(", ")
            ));
        }
        if let Some(hook) = &self.hook
            && let Some(answer) = hook.call(&call.name, &call.arguments)
        {
            return answer;
        }
        match call.name.as_str() {
            "execute_code" => self.execute_code(call).await,
            "write_file" | "read_file" | "list_files" => self.file_tool(call).await,
            "add_service" | "run_sql" | "enable_preview" if self.workspace.is_some() => {
                self.workspace_tool(call).await
            }
            other => tool_error(format!(
                "there is no tool {other:?} here; the tools are {}",
                self.offered.join(", ")
            )),
        }
    }
}

/// `execute_code`'s arguments: code, language (default Python), timeout (default 30 s).
fn execute_args(args: &Value) -> Result<(String, Language, Option<u64>), &'static str> {
    let Some(code) = args.get("code").and_then(Value::as_str) else {
        return Err(
            "execute_code needs {\"language\": \"python\", \"code\": \"...\"}; `code` is missing or not a string",
        );
    };
    let language = match args
        .get("language")
        .and_then(Value::as_str)
        .map(Language::from_name)
    {
        None => Language::Python,
        Some(Some(language)) => language,
        Some(None) => {
            return Err("language must be one of python, javascript, go, bash (as the tool lists)");
        }
    };
    let timeout_ms = match args.get("timeout_seconds") {
        None | Some(Value::Null) => Some(30_000),
        Some(v) => match v.as_f64() {
            Some(s) if s > 0.0 && s <= 300.0 => Some((s * 1000.0).ceil() as u64),
            _ => return Err("timeout_seconds must be a number from 1 to 300"),
        },
    };
    Ok((code.to_owned(), language, timeout_ms))
}

/// Relays an execution's output to the client as `stdout`/`stderr` events of tool call `id`.
fn relay_output(
    events: UnboundedSender<AgentEvent>,
    id: String,
) -> (UnboundedSender<Chunk>, tokio::task::JoinHandle<()>) {
    let (chunks_tx, mut chunks_rx) = mpsc::unbounded_channel::<Chunk>();
    let relay = tokio::spawn(async move {
        let output = |stderr: bool, data: String| {
            let id = id.clone();
            if stderr {
                AgentEvent::Stderr { id, data }
            } else {
                AgentEvent::Stdout { id, data }
            }
        };
        // A character cut between two chunks arrives whole.
        let mut carry = OutputCarry::default();
        while let Some(chunk) = chunks_rx.recv().await {
            let stderr = match chunk.stream {
                StreamKind::Display => {
                    if let Ok(result) = serde_json::from_slice(&chunk.data) {
                        let _ = events.send(AgentEvent::Display {
                            id: id.clone(),
                            result,
                        });
                    }
                    continue;
                }
                kind => kind == StreamKind::Stderr,
            };
            let text = carry.push(stderr, &chunk.data);
            if !text.is_empty() {
                let _ = events.send(output(stderr, text));
            }
        }
        for (stderr, text) in carry.finish() {
            let _ = events.send(output(stderr, text));
        }
    });
    (chunks_tx, relay)
}

/// An execution's outcome as the model reads it.
fn describe(outcome: &exec::RunOutcome, note: Option<String>) -> String {
    let mut text = format!(
        "status: {}\nexit_code: {}\n{}",
        outcome.status(),
        outcome.result.exit_code,
        note.unwrap_or_default()
    );
    let stdout = outcome.result.stdout_text();
    let stderr = outcome.stderr_with_reason();
    if !stdout.is_empty() {
        text.push_str(&format!("stdout:\n{stdout}"));
    }
    if !stderr.is_empty() {
        text.push_str(&format!("stderr:\n{stderr}"));
    }
    // A Python cell's final value (and what it `display`ed) is a result, not output: the
    // model reads its text.
    for result in &outcome.result.results {
        if result.data.keys().any(|mime| mime.starts_with("image/")) {
            continue;
        }
        if let Some(shown) = result.data.get("text/plain") {
            let label = if result.main { "value" } else { "displayed" };
            text.push_str(&format!("{label}:\n{shown}\n"));
        }
    }
    // Images reach the user as `display` events; the model reads that they were shown.
    let images = outcome
        .result
        .results
        .iter()
        .filter(|r| r.data.keys().any(|mime| mime.starts_with("image/")))
        .count();
    if images > 0 {
        text.push_str(&format!("{images} figure(s) shown to the user\n"));
    }
    text
}

fn agent_error(code: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_GATEWAY, code, message)
}

/// Runs the agent to its final answer, reporting events as it goes. The final event (or an
/// error event) is always the last one sent.
pub async fn run(
    state: &Arc<AppState>,
    caller: &Caller,
    model: &dyn ChatModel,
    input: AgentInput,
    limits: &AgentLimits,
    events: &UnboundedSender<AgentEvent>,
) -> Result<(), ApiError> {
    let mut run = Run::open(state, caller, input.sandbox.clone(), events).await?;
    run.workspace = input.workspace.clone();
    run.hook = input.hook.clone();
    let result = converse(&mut run, model, input, limits, events).await;
    run.close_others().await;
    result
}

/// The model's turns and their tool calls, to the final answer.
async fn converse(
    run: &mut Run<'_>,
    model: &dyn ChatModel,
    input: AgentInput,
    limits: &AgentLimits,
    events: &UnboundedSender<AgentEvent>,
) -> Result<(), ApiError> {
    let mut tools = tools(&run.state.runtime.executors);
    if run.workspace.is_some() {
        tools.extend(workspace_tools());
    }
    if let Some(only) = &input.only_tools {
        tools.retain(|t| only.contains(&t.name));
    }
    if let Some(hook) = &run.hook {
        tools.extend(hook.tools());
    }
    run.offered = tools.iter().map(|t| t.name.clone()).collect();
    let mut messages = input.messages;
    if !messages.iter().any(|m| m.role == Role::System) {
        let names: Vec<&str> = languages(&run.state.runtime.executors)
            .iter()
            .map(|(l, _)| l.name())
            .collect();
        messages.insert(0, Message::system(format!("You can run code with the execute_code tool ({}; no network). Use it for anything you would otherwise compute in your head. Keep printed output short.", names.join(", "))));
    }
    let mut usage = Usage::default();
    let mut budget = Budget::new(limits);
    let mut schema_retry_used = false;
    for _turn in 0..limits.max_turns {
        let request = ModelRequest {
            messages: messages.clone(),
            tools: tools.clone(),
            output_schema: input.output_schema.clone(),
        };
        let reply = ask_model(model, &request, limits, events).await?;
        usage += reply.usage;
        if reply.tool_calls.is_empty() {
            let message = Message::assistant(reply.text.clone());
            messages.push(message.clone());
            let structured = match &input.output_schema {
                None => None,
                Some(schema) => match check_structured(schema, &reply.text) {
                    Ok(value) => Some(value),
                    Err(problem) if !schema_retry_used => {
                        schema_retry_used = true;
                        messages.push(Message::user(format!(
                            "Your answer does not match the required JSON schema: {problem}. Answer again with only a JSON value that matches the schema."
                        )));
                        continue;
                    }
                    Err(problem) => {
                        return Err(agent_error(
                            "STRUCTURED_OUTPUT_INVALID",
                            format!(
                                "the model's answer did not match the output schema twice: {problem}"
                            ),
                        ));
                    }
                },
            };
            let _ = events.send(AgentEvent::Final {
                message,
                structured,
                messages,
                sandbox_id: run.sandbox.clone(),
                usage,
            });
            return Ok(());
        }
        messages.push(Message {
            role: Role::Assistant,
            content: reply.text.clone(),
            tool_calls: reply.tool_calls.clone(),
            tool_call_id: None,
        });
        for call in &reply.tool_calls {
            budget.admit(call)?;
            messages.push(run.answer_call(call, limits, events).await);
        }
        if run.hook.as_ref().is_some_and(|h| h.done()) {
            let message = Message::assistant(reply.text.clone());
            let _ = events.send(AgentEvent::Final {
                message,
                structured: None,
                messages,
                sandbox_id: run.sandbox.clone(),
                usage,
            });
            return Ok(());
        }
    }
    Err(agent_error(
        "AGENT_BUDGET_EXCEEDED",
        format!("no final answer after {} model calls", limits.max_turns),
    ))
}

impl Run<'_> {
    /// Runs one tool call; its (truncated) result is told to the client and becomes the
    /// tool message for the model.
    async fn answer_call(
        &mut self,
        call: &ToolCall,
        limits: &AgentLimits,
        events: &UnboundedSender<AgentEvent>,
    ) -> Message {
        let (result, is_error) = self.call_tool(call).await;
        let (result, truncated) = truncate(&result, limits.tool_result_chars);
        let _ = events.send(AgentEvent::ToolResult {
            id: call.id.clone(),
            name: call.name.clone(),
            result: result.clone(),
            truncated,
            is_error,
        });
        Message::tool(call.id.clone(), result)
    }
}

impl<'a> Run<'a> {
    /// The run's sandbox (the given one, or a new Python one) and its live sessions, which a
    /// continued conversation reuses so its variables are kept.
    async fn open(
        state: &'a Arc<AppState>,
        caller: &'a Caller,
        sandbox: Option<String>,
        events: &'a UnboundedSender<AgentEvent>,
    ) -> Result<Run<'a>, ApiError> {
        let sandbox = match sandbox {
            Some(id) => {
                state.runtime.registry.get(&caller.tenant, &id)?;
                id
            }
            None => {
                exec::create_default_sandbox(&state.runtime, caller, Language::Python)
                    .await?
                    .id
            }
        };
        let _ = events.send(AgentEvent::Sandbox {
            sandbox_id: sandbox.clone(),
        });
        let mut sessions = BTreeMap::new();
        if let Ok(view) = state.runtime.registry.get(&caller.tenant, &sandbox) {
            for session in view.meta.sessions.values() {
                if view.live_sessions.contains(&session.id) {
                    sessions.insert(session.language.name(), session.id.clone());
                }
            }
        }
        Ok(Run {
            state,
            caller,
            sandbox,
            workspace: None,
            offered: Vec::new(),
            hook: None,
            sessions,
            others: BTreeMap::new(),
            events,
        })
    }
}

/// One model call with retries, its stream relayed as agent events.
async fn ask_model(
    model: &dyn ChatModel,
    request: &ModelRequest,
    limits: &AgentLimits,
    events: &UnboundedSender<AgentEvent>,
) -> Result<kiln_llm::ModelReply, ApiError> {
    let (model_tx, mut model_rx) = mpsc::unbounded_channel::<ModelEvent>();
    let forward = events.clone();
    let relay = tokio::spawn(async move {
        while let Some(event) = model_rx.recv().await {
            let event = match event {
                ModelEvent::FirstToken => continue,
                ModelEvent::TextDelta(text) => AgentEvent::TextDelta { text },
                ModelEvent::ToolCallStart { id, name } => AgentEvent::ToolCallStart { id, name },
                ModelEvent::ToolCallArguments { id, delta } => {
                    AgentEvent::ToolCallArguments { id, delta }
                }
            };
            let _ = forward.send(event);
        }
    });
    let reply = complete_with_retries(
        model,
        request,
        Some(&model_tx),
        limits.model_timeout,
        limits.retry,
    )
    .await;
    drop(model_tx);
    let _ = relay.await;
    reply.map_err(|e| match e {
        kiln_llm::LlmError::NotConfigured(m) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "LLM_NOT_CONFIGURED", m)
        }
        kiln_llm::LlmError::Timeout(_) => {
            ApiError::new(StatusCode::GATEWAY_TIMEOUT, "LLM_TIMEOUT", e.to_string())
        }
        kiln_llm::LlmError::RateLimited { .. } => agent_error("LLM_RATE_LIMITED", e.to_string()),
        other => agent_error("LLM_FAILED", other.to_string()),
    })
}

/// The tool calls one run may make: so many in all, and the same call so many times.
struct Budget<'a> {
    limits: &'a AgentLimits,
    calls: usize,
    seen: BTreeMap<String, usize>,
}

impl<'a> Budget<'a> {
    fn new(limits: &'a AgentLimits) -> Budget<'a> {
        Budget {
            limits,
            calls: 0,
            seen: BTreeMap::new(),
        }
    }

    fn admit(&mut self, call: &ToolCall) -> Result<(), ApiError> {
        self.calls += 1;
        if self.calls > self.limits.max_tool_calls {
            return Err(agent_error(
                "AGENT_BUDGET_EXCEEDED",
                format!(
                    "the model made more than {} tool calls in one request",
                    self.limits.max_tool_calls
                ),
            ));
        }
        let repeats = self
            .seen
            .entry(format!("{}:{}", call.name, call.arguments))
            .or_default();
        *repeats += 1;
        if *repeats > self.limits.max_repeats {
            return Err(agent_error(
                "AGENT_LOOP",
                format!(
                    "the model repeated the same {} call {} times; stopped",
                    call.name, *repeats
                ),
            ));
        }
        Ok(())
    }
}

pub use kiln_llm::check_structured;
