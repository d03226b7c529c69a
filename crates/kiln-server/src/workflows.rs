//! Workflows (issue 35, seed 002's "Multi-Agent Workflows"): a creator and a reviewer work on
//! one workspace in turns, `creation → review → revision → … → approved | rejected`.
//!
//! Each role is kiln's agent loop ([`crate::agent`]) with the role's own system prompt, tools
//! and model; the tools `submit_for_review`, `submit_review` and `get_review_feedback` (a
//! [`TurnHook`]) move the stage. A role that ends its turn without its transition is told to
//! make it, at most [`MAX_NUDGES`] times, then the workflow is rejected with that reason; a
//! review that does not approve after the template's rounds rejects it too. A role may be a
//! human instead (`roles.reviewer.human`): the workflow then waits for `POST …/submit` or
//! `POST …/review` from a key of the tenant.
//!
//! Every [`WorkflowEvent`] is kept in the workflow's record and also committed as a note (a
//! commit with no file changes) in the workspace's history, so the history reads as the
//! audit trail; a review's `modifiedFiles` are the history's diff over the reviewer's turn.
//!
//! Templates are YAML ([`WorkflowTemplate`]): seed 002's three are built in
//! (`static-website`, `fullstack-app`, `database-schema`), and an operator adds or replaces
//! them with a folder of `*.yaml` (`kiln serve --workflow-templates DIR`).
//!
//! ```text
//! workflows/<id>.json   its record: state, events, reviews, who started it
//! ```
//!
//! A workflow whose server stopped during an agent's turn starts that turn again when the
//! server starts (the conversation of the interrupted turn is not kept; files are).

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Extension, Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use kiln_llm::{ChatModel, GenaiModel, Message, ToolSpec};
use kiln_runtime::auth::Caller;
use kiln_runtime::quota::QuotaOverrides;
use kiln_runtime::sandbox::{new_id, now_ms, rfc3339};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::{Notify, broadcast, watch};
use utoipa::{IntoParams, ToSchema};

use crate::AppState;
use crate::agent::{self, AgentEvent, AgentInput, TurnHook};
use crate::error::{ApiError, ErrorBody};
use crate::v1::path_error;

/// Rounds of review a workflow may have, default and most.
pub const DEFAULT_ROUNDS: u32 = 3;
pub const MAX_ROUNDS: u32 = 10;
/// How often a role that ends its turn without its transition is told to make it.
pub const MAX_NUDGES: u32 = 2;
/// The longest task text.
pub const MAX_TASK_BYTES: usize = 32 << 10;
/// Workflows of one tenant running at once.
pub const MAX_RUNNING: usize = 8;
/// How long a workflow's preview link lives.
const PREVIEW_TTL_S: u64 = 24 * 3600;
/// The tools a role may be given (besides its transitions).
pub const ROLE_TOOLS: [&str; 7] = [
    "execute_code",
    "write_file",
    "read_file",
    "list_files",
    "add_service",
    "run_sql",
    "enable_preview",
];

const BUILT_IN: [(&str, &str); 3] = [
    (
        "static-website",
        include_str!("../workflows/static-website.yaml"),
    ),
    (
        "fullstack-app",
        include_str!("../workflows/fullstack-app.yaml"),
    ),
    (
        "database-schema",
        include_str!("../workflows/database-schema.yaml"),
    ),
];

// ---------------------------------------------------------------------------------------
// Templates

/// A workflow template (YAML, snake_case keys).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkflowTemplate {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// The files such work has (told to the creator).
    #[serde(default)]
    pub files: Vec<String>,
    /// Services the workspace gets (`postgres`, `redis`, `mysql`, `nginx`).
    #[serde(default)]
    pub services: Vec<String>,
    /// The preview kiln turns on when the work is submitted.
    #[serde(default)]
    pub preview: Option<WorkflowPreview>,
    /// What the reviewer judges by.
    #[serde(default)]
    pub review_criteria: Vec<String>,
    #[serde(default = "default_rounds")]
    pub max_rounds: u32,
    pub roles: TemplateRoles,
}

fn default_rounds() -> u32 {
    DEFAULT_ROUNDS
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkflowPreview {
    /// `static` (the workspace's files through its nginx) or `proxy` (its own server).
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateRoles {
    pub creator: TemplateRole,
    pub reviewer: TemplateRole,
}

/// One role of a template: an agent with its own prompt, tools and model.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateRole {
    /// Its system prompt (kiln adds the task, the criteria and how to hand over).
    pub prompt: String,
    /// Its tools, of [`ROLE_TOOLS`]; all of them when absent.
    #[serde(default)]
    pub tools: Option<Vec<String>>,
    /// `provider:model`; the server's model when absent.
    #[serde(default)]
    pub model: Option<String>,
}

impl WorkflowTemplate {
    /// Reads and checks a template: its name, rounds, services, tools and preview.
    pub fn parse(text: &str) -> Result<WorkflowTemplate, String> {
        let template: WorkflowTemplate =
            serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?;
        if !kiln_runtime::volumes::name_ok(&template.name) {
            return Err(format!(
                "{:?} is not a template name: 1..=64 of A-Z a-z 0-9 _ . -",
                template.name
            ));
        }
        if !(1..=MAX_ROUNDS).contains(&template.max_rounds) {
            return Err(format!("max_rounds must be 1..={MAX_ROUNDS}"));
        }
        for service in &template.services {
            kiln_runtime::workspaces::ServiceKind::parse(service).map_err(|e| e.to_string())?;
        }
        for (role, spec) in [
            ("creator", &template.roles.creator),
            ("reviewer", &template.roles.reviewer),
        ] {
            if spec.prompt.trim().is_empty() {
                return Err(format!("roles.{role}.prompt is empty"));
            }
            for tool in spec.tools.iter().flatten() {
                if !ROLE_TOOLS.contains(&tool.as_str()) {
                    return Err(format!(
                        "roles.{role}.tools: no tool {tool:?}; the tools are {}",
                        ROLE_TOOLS.join(", ")
                    ));
                }
            }
        }
        if let Some(preview) = &template.preview {
            match (preview.kind.as_str(), preview.port) {
                ("static", _) => {}
                ("proxy", Some(port)) if port > 0 => {}
                ("proxy", _) => return Err("a proxy preview needs its port".into()),
                (other, _) => {
                    return Err(format!("preview type {other:?}: static or proxy"));
                }
            }
        }
        Ok(template)
    }

    fn info(&self) -> WorkflowTemplateInfo {
        WorkflowTemplateInfo {
            name: self.name.clone(),
            description: self.description.clone(),
            files: self.files.clone(),
            services: self.services.clone(),
            preview: self.preview.clone(),
            review_criteria: self.review_criteria.clone(),
            max_rounds: self.max_rounds,
        }
    }
}

/// The workflow templates of a server: the built-in ones, then the operator's folder's.
#[derive(Debug, Clone)]
pub struct Templates {
    all: BTreeMap<String, WorkflowTemplate>,
}

impl Templates {
    /// The built-in templates and those of `folder` (`*.yaml`; one with a built-in's name
    /// replaces it). A template that does not parse is an error naming its file.
    pub fn load(folder: Option<&Path>) -> Result<Templates, String> {
        let mut all = BTreeMap::new();
        for (name, text) in BUILT_IN {
            let template = WorkflowTemplate::parse(text)
                .map_err(|e| format!("built-in workflow template {name}: {e}"))?;
            all.insert(template.name.clone(), template);
        }
        if let Some(folder) = folder {
            let entries = std::fs::read_dir(folder)
                .map_err(|e| format!("workflow templates folder {}: {e}", folder.display()))?;
            let mut paths: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
                .collect();
            paths.sort();
            for path in paths {
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| format!("workflow template {}: {e}", path.display()))?;
                let template = WorkflowTemplate::parse(&text)
                    .map_err(|e| format!("workflow template {}: {e}", path.display()))?;
                all.insert(template.name.clone(), template);
            }
        }
        Ok(Templates { all })
    }

    pub fn get(&self, name: &str) -> Option<&WorkflowTemplate> {
        self.all.get(name)
    }

    pub fn names(&self) -> Vec<String> {
        self.all.keys().cloned().collect()
    }
}

/// A workflow template as the API shows it.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkflowTemplateInfo {
    pub name: String,
    pub description: String,
    pub files: Vec<String>,
    pub services: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preview: Option<WorkflowPreview>,
    pub review_criteria: Vec<String>,
    pub max_rounds: u32,
}

// ---------------------------------------------------------------------------------------
// State

/// Seed 002's `WorkflowStage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum WorkflowStage {
    Creation,
    Review,
    Revision,
    Approved,
    Rejected,
}

impl WorkflowStage {
    pub fn finished(self) -> bool {
        matches!(self, WorkflowStage::Approved | WorkflowStage::Rejected)
    }

    /// The role whose turn it is.
    fn role(self) -> Option<WorkflowRole> {
        match self {
            WorkflowStage::Creation | WorkflowStage::Revision => Some(WorkflowRole::Creator),
            WorkflowStage::Review => Some(WorkflowRole::Reviewer),
            WorkflowStage::Approved | WorkflowStage::Rejected => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum WorkflowRole {
    Creator,
    Reviewer,
}

impl WorkflowRole {
    pub fn name(self) -> &'static str {
        match self {
            WorkflowRole::Creator => "creator",
            WorkflowRole::Reviewer => "reviewer",
        }
    }
}

/// Seed 002's `ReviewResult`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReviewResult {
    /// The round it ended (1, 2, …).
    pub round: u32,
    pub approved: bool,
    /// `A`, `B+`, `needs work`, …
    pub grade: Option<String>,
    pub feedback: String,
    pub suggestions: Vec<String>,
    /// The files the reviewer changed: the workspace history's diff over its turn.
    pub modified_files: Vec<String>,
    /// `agent` or `human:<key id>`.
    pub by: String,
}

/// One entry of a workflow's audit trail (seed 002's `WorkflowEvent`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkflowEvent {
    /// 1, 2, … in order.
    pub seq: u64,
    pub timestamp: String,
    /// `creator`, `reviewer`, `system` or `human:<key id>`.
    pub agent: String,
    /// `started`, `turn_started`, `nudged`, `waiting_for_human`, `submitted_for_review`,
    /// `preview_enabled`, `review_submitted`, `revision_requested`, `approved`, `rejected`,
    /// `cancelled`.
    pub action: String,
    #[schema(value_type = Object)]
    pub details: Value,
    /// The note in the workspace's history that records it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub commit_id: Option<String>,
}

/// Who plays a role.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkflowRoleSetting {
    /// A person, through `POST …/submit` or `…/review`.
    pub human: bool,
    /// `provider:model` of an agent role; `null`: the server's model.
    pub model: Option<String>,
}

/// A workflow (seed 002's `WorkflowState`, with its audit trail and reviews).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkflowState {
    /// `wf_…`.
    pub id: String,
    pub template: String,
    pub task: String,
    pub workspace_id: String,
    pub workspace: String,
    pub sandbox_id: String,
    pub stage: WorkflowStage,
    /// The role whose turn it is (`null` once finished).
    pub current_agent: Option<WorkflowRole>,
    /// Waiting for a person to act as the current role.
    pub waiting_for_human: bool,
    /// The round of review (1, 2, …).
    pub round: u32,
    pub max_rounds: u32,
    pub roles: BTreeMap<String, WorkflowRoleSetting>,
    pub reviews: Vec<ReviewResult>,
    /// The audit trail, oldest first.
    pub history: Vec<WorkflowEvent>,
    /// Why it was rejected (or cancelled).
    pub reason: Option<String>,
    /// A link to the workspace's preview, once the work was submitted (templates with one).
    pub preview_url: Option<String>,
    /// The key that started it.
    pub owner: String,
    pub created_at: String,
    pub updated_at: String,
    /// Where the current turn began in the workspace's history (for `modifiedFiles`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_base: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StoredCaller {
    tenant: String,
    key_id: String,
    #[serde(default)]
    quotas: QuotaOverrides,
    #[serde(default)]
    network_widen: bool,
}

impl StoredCaller {
    fn of(caller: &Caller) -> StoredCaller {
        StoredCaller {
            tenant: caller.tenant.clone(),
            key_id: caller.key_id.clone(),
            quotas: caller.quotas.clone(),
            network_widen: caller.network_widen,
        }
    }

    fn caller(&self) -> Caller {
        Caller {
            tenant: self.tenant.clone(),
            key_id: self.key_id.clone(),
            quotas: self.quotas.clone(),
            network_widen: self.network_widen,
            // A workflow's agents act for its tenant, never as an admin.
            admin: false,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Stored {
    #[serde(flatten)]
    state: WorkflowState,
    caller: StoredCaller,
}

/// What a live stream of a workflow carries.
#[derive(Debug, Clone)]
enum Live {
    Event(WorkflowEvent),
    /// An agent's activity (tokens, tool calls), not kept.
    Agent(Value),
}

struct Entry {
    stored: Stored,
    live: broadcast::Sender<Live>,
    /// Wakes a workflow that waits for a person.
    wake: Arc<Notify>,
    cancel: watch::Sender<bool>,
    /// Events are added one at a time (their seq and their note in the history agree).
    pen: Arc<tokio::sync::Mutex<()>>,
    driver: Option<tokio::task::JoinHandle<()>>,
}

/// The workflows of a server.
pub struct Workflows {
    root: PathBuf,
    all: Mutex<HashMap<String, Entry>>,
    pub templates: Templates,
}

impl std::fmt::Debug for Workflows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workflows")
            .field("root", &self.root)
            .finish()
    }
}

impl Workflows {
    pub fn open(data_dir: &Path, templates: Templates) -> Workflows {
        let root = data_dir.join("workflows");
        let mut all = HashMap::new();
        for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "json") {
                match kiln_runtime::store::read_json::<Stored>(&path) {
                    Ok(stored) => {
                        all.insert(stored.state.id.clone(), Entry::new(stored));
                    }
                    Err(e) => tracing::error!(
                        "workflow {}: unreadable record ({e}); left as it is",
                        path.display()
                    ),
                }
            }
        }
        Workflows {
            root,
            all: Mutex::new(all),
            templates,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.all.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn save(&self, stored: &Stored) -> Result<(), ApiError> {
        std::fs::create_dir_all(&self.root)
            .and_then(|()| {
                kiln_runtime::store::write_json(
                    &self.root.join(format!("{}.json", stored.state.id)),
                    stored,
                )
            })
            .map_err(|e| ApiError::internal(format!("recording the workflow: {e}")))
    }

    /// `tenant`'s workflow `id`.
    pub fn get(&self, tenant: &str, id: &str) -> Result<WorkflowState, ApiError> {
        self.lock()
            .get(id)
            .filter(|e| e.stored.caller.tenant == tenant)
            .map(|e| e.stored.state.clone())
            .ok_or_else(|| not_found(id))
    }

    /// `tenant`'s workflows, oldest first.
    pub fn list(&self, tenant: &str) -> Vec<WorkflowState> {
        let mut own: Vec<WorkflowState> = self
            .lock()
            .values()
            .filter(|e| e.stored.caller.tenant == tenant)
            .map(|e| e.stored.state.clone())
            .collect();
        own.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        own
    }

    fn update(
        &self,
        id: &str,
        change: impl FnOnce(&mut WorkflowState),
    ) -> Result<WorkflowState, ApiError> {
        let stored = {
            let mut all = self.lock();
            let entry = all.get_mut(id).ok_or_else(|| not_found(id))?;
            change(&mut entry.stored.state);
            entry.stored.state.updated_at = rfc3339(now_ms());
            entry.stored.clone()
        };
        self.save(&stored)?;
        Ok(stored.state)
    }

    fn caller_of(&self, id: &str) -> Option<Caller> {
        self.lock().get(id).map(|e| e.stored.caller.caller())
    }

    fn live(&self, id: &str) -> Option<broadcast::Sender<Live>> {
        self.lock().get(id).map(|e| e.live.clone())
    }

    fn wake(&self, id: &str) -> Option<Arc<Notify>> {
        self.lock().get(id).map(|e| e.wake.clone())
    }

    fn pen(&self, id: &str) -> Option<Arc<tokio::sync::Mutex<()>>> {
        self.lock().get(id).map(|e| e.pen.clone())
    }

    fn cancelled(&self, id: &str) -> Option<watch::Receiver<bool>> {
        self.lock().get(id).map(|e| e.cancel.subscribe())
    }

    /// Forgets workflows of a deleted workspace that have finished.
    fn running_in(&self, tenant: &str, workspace_id: &str) -> Option<String> {
        self.lock()
            .values()
            .find(|e| {
                e.stored.caller.tenant == tenant
                    && e.stored.state.workspace_id == workspace_id
                    && !e.stored.state.stage.finished()
            })
            .map(|e| e.stored.state.id.clone())
    }

    fn running_count(&self, tenant: &str) -> usize {
        self.lock()
            .values()
            .filter(|e| e.stored.caller.tenant == tenant && !e.stored.state.stage.finished())
            .count()
    }

    /// Workflows to drive after a restart: not finished.
    fn unfinished(&self) -> Vec<String> {
        self.lock()
            .values()
            .filter(|e| !e.stored.state.stage.finished())
            .map(|e| e.stored.state.id.clone())
            .collect()
    }
}

impl Entry {
    fn new(stored: Stored) -> Entry {
        Entry {
            stored,
            live: broadcast::channel(1024).0,
            wake: Arc::new(Notify::new()),
            cancel: watch::channel(false).0,
            pen: Arc::default(),
            driver: None,
        }
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "WORKFLOW_NOT_FOUND",
        format!("no workflow {id:?}"),
    )
}

/// Adds an event to workflow `id`'s trail: committed as a note in its workspace's history,
/// kept in its record, sent to its live streams.
async fn push_event(
    app: &Arc<AppState>,
    id: &str,
    agent: &str,
    action: &str,
    details: Value,
) -> Result<WorkflowEvent, ApiError> {
    let workflows = &app.workflows;
    let pen = workflows.pen(id).ok_or_else(|| not_found(id))?;
    let _pen = pen.lock().await;
    let caller = workflows.caller_of(id).ok_or_else(|| not_found(id))?;
    let state = workflows.get(&caller.tenant, id)?;
    let seq = state.history.last().map_or(1, |e| e.seq + 1);
    let mut summary = format!("workflow {id} #{seq}: {agent} {action}");
    if let Some(word) = summary_detail(action, &details) {
        summary.push_str(": ");
        summary.push_str(&word);
    }
    let commit_id = match kiln_runtime::revisions::note(
        &app.runtime,
        &caller,
        &state.sandbox_id,
        agent::truncate(&summary, 200).0.replace('\n', " "),
        format!("workflow_{id}_{seq}"),
    )
    .await
    {
        Ok(commit) => Some(commit),
        Err(e) => {
            tracing::warn!("workflow {id}: the history note of {action} failed: {e}");
            None
        }
    };
    let event = WorkflowEvent {
        seq,
        timestamp: rfc3339(now_ms()),
        agent: agent.to_owned(),
        action: action.to_owned(),
        details,
        commit_id,
    };
    workflows.update(id, |s| s.history.push(event.clone()))?;
    if let Some(live) = workflows.live(id) {
        let _ = live.send(Live::Event(event.clone()));
    }
    Ok(event)
}

/// A few words of an event for its history note.
fn summary_detail(action: &str, details: &Value) -> Option<String> {
    let text = |k: &str| details.get(k).and_then(Value::as_str).map(str::to_owned);
    match action {
        "review_submitted" => Some(format!(
            "{}{}",
            if details["approved"] == json!(true) {
                "approved"
            } else {
                "changes asked"
            },
            text("grade")
                .map(|g| format!(", grade {g}"))
                .unwrap_or_default()
        )),
        "rejected" | "cancelled" => text("reason"),
        "submitted_for_review" => text("notes").filter(|n| !n.is_empty()),
        "turn_started" | "waiting_for_human" => text("role"),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------
// Transitions

/// A transition a turn made.
#[derive(Debug, Clone)]
enum Transition {
    Submit {
        notes: String,
    },
    Review {
        approved: bool,
        grade: Option<String>,
        feedback: String,
        suggestions: Vec<String>,
    },
}

/// The workflow tools of one turn: they record the transition; the driver applies it.
struct Turn {
    role: WorkflowRole,
    latest_review: Option<ReviewResult>,
    made: Mutex<Option<Transition>>,
}

impl Turn {
    fn taken(&self) -> Option<Transition> {
        self.made.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

fn transition_tools(role: WorkflowRole) -> Vec<ToolSpec> {
    let feedback = ToolSpec {
        name: "get_review_feedback".into(),
        description: "The most recent review of this workflow: approved, grade, feedback, suggestions and the files the reviewer changed (null before the first review).".into(),
        parameters: json!({"type": "object", "properties": {}}),
    };
    match role {
        WorkflowRole::Creator => vec![
            ToolSpec {
                name: "submit_for_review".into(),
                description: "Submit the work in the workspace for review, with notes for the reviewer about what was done. Call it once the work is done; your turn ends with it.".into(),
                parameters: json!({"type": "object", "properties": {"notes": {"type": "string"}}}),
            },
            feedback,
        ],
        WorkflowRole::Reviewer => vec![
            ToolSpec {
                name: "submit_review".into(),
                description: "Submit your review: approved or not, a grade (A, B+, C, …), feedback for the creator and specific suggestions. Not approved sends the work back for revision. Your turn ends with it.".into(),
                parameters: json!({
                    "type": "object",
                    "properties": {
                        "approved": {"type": "boolean"},
                        "grade": {"type": "string"},
                        "feedback": {"type": "string"},
                        "suggestions": {"type": "array", "items": {"type": "string"}}
                    },
                    "required": ["approved"]
                }),
            },
            feedback,
        ],
    }
}

/// Reads `submit_review`'s arguments (a tool call's or a person's body).
fn review_of(arguments: &Value) -> Result<Transition, String> {
    let Some(approved) = arguments.get("approved").and_then(Value::as_bool) else {
        return Err("submit_review needs {\"approved\": true|false, \"grade\"?: \"A\", \"feedback\"?: \"...\", \"suggestions\"?: [\"...\"]}".into());
    };
    let grade = match arguments.get("grade") {
        None | Some(Value::Null) => None,
        Some(Value::String(g)) if g.chars().count() <= 32 => Some(g.clone()),
        Some(_) => return Err("grade is a short text (A, B+, needs work)".into()),
    };
    let feedback = match arguments.get("feedback") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(f)) => agent::truncate(f, 16_000).0,
        Some(_) => return Err("feedback is text".into()),
    };
    let suggestions = match arguments.get("suggestions") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) if items.len() <= 50 => {
            let mut out = Vec::new();
            for item in items {
                let Some(s) = item.as_str() else {
                    return Err("suggestions is a list of texts".into());
                };
                out.push(agent::truncate(s, 2_000).0);
            }
            out
        }
        Some(_) => return Err("suggestions is a list of at most 50 texts".into()),
    };
    Ok(Transition::Review {
        approved,
        grade,
        feedback,
        suggestions,
    })
}

fn notes_of(arguments: &Value) -> Result<Transition, String> {
    match arguments.get("notes") {
        None | Some(Value::Null) => Ok(Transition::Submit {
            notes: String::new(),
        }),
        Some(Value::String(n)) => Ok(Transition::Submit {
            notes: agent::truncate(n, 16_000).0,
        }),
        Some(_) => Err("notes is text".into()),
    }
}

impl TurnHook for Turn {
    fn tools(&self) -> Vec<ToolSpec> {
        transition_tools(self.role)
    }

    fn call(&self, name: &str, arguments: &Value) -> Option<(String, bool)> {
        let made = match (name, self.role) {
            ("get_review_feedback", _) => {
                return Some((
                    serde_json::to_string(&self.latest_review).unwrap_or_default(),
                    false,
                ));
            }
            ("submit_for_review", WorkflowRole::Creator) => notes_of(arguments),
            ("submit_review", WorkflowRole::Reviewer) => review_of(arguments),
            _ => return None,
        };
        let mut slot = self.made.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_some() {
            return Some(("error: already submitted in this turn".into(), true));
        }
        Some(match made {
            Ok(transition) => {
                let said = match &transition {
                    Transition::Submit { .. } => "submitted for review; your turn is over",
                    Transition::Review { approved: true, .. } => "review submitted: approved",
                    Transition::Review { .. } => {
                        "review submitted: the work goes back to the creator"
                    }
                };
                *slot = Some(transition);
                (said.into(), false)
            }
            Err(message) => (format!("error: {message}"), true),
        })
    }

    fn done(&self) -> bool {
        self.taken().is_some()
    }
}

/// Applies `transition` made by `by` (`creator`, `reviewer` or `human:<key>`) to workflow
/// `id`; when the next turn is a person's, the workflow waits for them from then on.
async fn apply(
    app: &Arc<AppState>,
    caller: &Caller,
    id: &str,
    by: &str,
    transition: Transition,
) -> Result<WorkflowState, ApiError> {
    apply_only(app, caller, id, by, transition).await?;
    await_human(app, caller, id).await?;
    app.workflows.get(&caller.tenant, id)
}

async fn apply_only(
    app: &Arc<AppState>,
    caller: &Caller,
    id: &str,
    by: &str,
    transition: Transition,
) -> Result<WorkflowState, ApiError> {
    let state = app.workflows.get(&caller.tenant, id)?;
    match transition {
        Transition::Submit { notes } => {
            let template = app.workflows.templates.get(&state.template).cloned();
            let mut preview_url = state.preview_url.clone();
            if let Some(preview) = template.and_then(|t| t.preview) {
                match crate::workspaces::enable_preview(
                    app,
                    caller,
                    &state.workspace_id,
                    &preview.kind,
                    preview.root_path.as_deref(),
                    preview.port,
                    PREVIEW_TTL_S,
                )
                .await
                {
                    Ok(answer) => {
                        preview_url = Some(answer.url.clone());
                        push_event(
                            app,
                            id,
                            "system",
                            "preview_enabled",
                            json!({"url": answer.url, "preview": answer.preview}),
                        )
                        .await?;
                    }
                    Err(e) => {
                        push_event(
                            app,
                            id,
                            "system",
                            "preview_failed",
                            json!({"error": e.message()}),
                        )
                        .await?;
                    }
                }
            }
            push_event(
                app,
                id,
                by,
                "submitted_for_review",
                json!({"notes": notes, "round": state.round, "previewUrl": preview_url}),
            )
            .await?;
            app.workflows.update(id, |s| {
                s.stage = WorkflowStage::Review;
                s.current_agent = Some(WorkflowRole::Reviewer);
                s.waiting_for_human = false;
                s.preview_url = preview_url;
                s.turn_base = None;
            })
        }
        Transition::Review {
            approved,
            grade,
            feedback,
            suggestions,
        } => {
            let modified_files = match &state.turn_base {
                Some(base) => {
                    let head =
                        kiln_runtime::revisions::head(&app.runtime, caller, &state.sandbox_id)
                            .await?;
                    kiln_runtime::revisions::changed(
                        &app.runtime,
                        caller,
                        &state.sandbox_id,
                        base.clone(),
                        head,
                    )
                    .await?
                }
                None => Vec::new(),
            };
            let review = ReviewResult {
                round: state.round,
                approved,
                grade: grade.clone(),
                feedback: feedback.clone(),
                suggestions,
                modified_files,
                by: if by.starts_with("human:") {
                    by.to_owned()
                } else {
                    "agent".into()
                },
            };
            push_event(app, id, by, "review_submitted", json!(review)).await?;
            let state = app.workflows.update(id, |s| {
                s.reviews.push(review.clone());
                s.waiting_for_human = false;
                s.turn_base = None;
            })?;
            if approved {
                push_event(
                    app,
                    id,
                    "system",
                    "approved",
                    json!({"grade": grade, "round": state.round}),
                )
                .await?;
                app.workflows.update(id, |s| {
                    s.stage = WorkflowStage::Approved;
                    s.current_agent = None;
                })
            } else if state.round >= state.max_rounds {
                let reason = format!(
                    "not approved after {} round{} of review; the last feedback: {}",
                    state.max_rounds,
                    if state.max_rounds == 1 { "" } else { "s" },
                    agent::truncate(&feedback, 500).0
                );
                reject(app, id, reason).await
            } else {
                push_event(
                    app,
                    id,
                    "system",
                    "revision_requested",
                    json!({"round": state.round + 1}),
                )
                .await?;
                app.workflows.update(id, |s| {
                    s.round += 1;
                    s.stage = WorkflowStage::Revision;
                    s.current_agent = Some(WorkflowRole::Creator);
                })
            }
        }
    }
}

/// When the role whose turn it is now is a person's: marks the workflow as waiting for them
/// (once), with where their turn begins in the history.
async fn await_human(app: &Arc<AppState>, caller: &Caller, id: &str) -> Result<(), ApiError> {
    let state = app.workflows.get(&caller.tenant, id)?;
    let Some(role) = state.stage.role() else {
        return Ok(());
    };
    if state.waiting_for_human || !state.roles.get(role.name()).is_some_and(|r| r.human) {
        return Ok(());
    }
    let base = kiln_runtime::revisions::head(&app.runtime, caller, &state.sandbox_id).await?;
    let mut first = false;
    app.workflows.update(id, |s| {
        if !s.waiting_for_human && s.stage == state.stage {
            first = true;
            s.waiting_for_human = true;
            s.turn_base = Some(base);
        }
    })?;
    if first {
        push_event(
            app,
            id,
            "system",
            "waiting_for_human",
            json!({"role": role.name(), "round": state.round}),
        )
        .await?;
    }
    Ok(())
}

async fn reject(app: &Arc<AppState>, id: &str, reason: String) -> Result<WorkflowState, ApiError> {
    push_event(app, id, "system", "rejected", json!({"reason": reason})).await?;
    app.workflows.update(id, |s| {
        s.stage = WorkflowStage::Rejected;
        s.current_agent = None;
        s.waiting_for_human = false;
        s.reason = Some(reason);
    })
}

// ---------------------------------------------------------------------------------------
// Driving

/// Starts driving workflow `id` in the background (its agents' turns, or waiting for people).
fn spawn_driver(app: &Arc<AppState>, id: &str) {
    let driven = app.clone();
    let key = id.to_owned();
    let handle = tokio::spawn(async move {
        let Some(mut cancelled) = driven.workflows.cancelled(&key) else {
            return;
        };
        tokio::select! {
            () = drive(&driven, &key) => {}
            _ = cancelled.wait_for(|c| *c) => {}
        }
    });
    if let Some(entry) = app.workflows.lock().get_mut(id) {
        entry.driver = Some(handle);
    }
}

/// Drives every unfinished workflow again (after a restart).
pub fn resume_all(app: &Arc<AppState>) {
    for id in app.workflows.unfinished() {
        tracing::info!("workflow {id}: resumed");
        spawn_driver(app, &id);
    }
}

async fn drive(app: &Arc<AppState>, id: &str) {
    loop {
        match step(app, id).await {
            Ok(true) => continue,
            Ok(false) => return,
            Err(e) => {
                let reason = format!("the workflow failed: {} ({})", e.message(), e.code());
                tracing::warn!("workflow {id}: {reason}");
                let _ = reject(app, id, reason).await;
                return;
            }
        }
    }
}

/// One turn; `false` when the workflow is finished.
async fn step(app: &Arc<AppState>, id: &str) -> Result<bool, ApiError> {
    let caller = app.workflows.caller_of(id).ok_or_else(|| not_found(id))?;
    let state = app.workflows.get(&caller.tenant, id)?;
    let Some(role) = state.stage.role() else {
        return Ok(false);
    };
    let setting = state
        .roles
        .get(role.name())
        .cloned()
        .unwrap_or(WorkflowRoleSetting {
            human: false,
            model: None,
        });
    if setting.human {
        let wake = app.workflows.wake(id).ok_or_else(|| not_found(id))?;
        let woken = wake.notified();
        await_human(app, &caller, id).await?;
        woken.await;
        return Ok(true);
    }
    agent_turn(app, &caller, &state, role, setting).await?;
    Ok(true)
}

/// The model a role runs on.
fn model_for(
    app: &AppState,
    setting: &WorkflowRoleSetting,
) -> Result<Arc<dyn ChatModel>, ApiError> {
    match &setting.model {
        None => app.llm.clone().map_err(|m| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "LLM_NOT_CONFIGURED",
                format!("a workflow's agents need a model: {m}"),
            )
        }),
        Some(spec) => {
            let config = app.llm_env.with_model(spec).map_err(|e| {
                ApiError::bad_request("INVALID_MODEL", format!("model {spec:?}: {e}"))
            })?;
            Ok(Arc::new(GenaiModel::new(&config).map_err(|e| {
                ApiError::bad_request("INVALID_MODEL", e.to_string())
            })?))
        }
    }
}

async fn agent_turn(
    app: &Arc<AppState>,
    caller: &Caller,
    state: &WorkflowState,
    role: WorkflowRole,
    setting: WorkflowRoleSetting,
) -> Result<(), ApiError> {
    let id = state.id.as_str();
    let template = app
        .workflows
        .templates
        .get(&state.template)
        .cloned()
        .ok_or_else(|| {
            ApiError::internal(format!(
                "the workflow's template {:?} is gone from this server",
                state.template
            ))
        })?;
    let model = model_for(app, &setting)?;
    let base = kiln_runtime::revisions::head(&app.runtime, caller, &state.sandbox_id).await?;
    app.workflows
        .update(id, |s| s.turn_base = Some(base.clone()))?;
    push_event(
        app,
        id,
        role.name(),
        "turn_started",
        json!({"role": role.name(), "round": state.round, "stage": state.stage}),
    )
    .await?;
    let spec = match role {
        WorkflowRole::Creator => &template.roles.creator,
        WorkflowRole::Reviewer => &template.roles.reviewer,
    };
    let workspace = app
        .runtime
        .registry
        .workspaces
        .get(&caller.tenant, &state.workspace_id)?;
    let mut messages = vec![
        Message::system(system_prompt(&template, spec, role, state, &workspace)),
        Message::user(opening(state, role)),
    ];
    let turn = Arc::new(Turn {
        role,
        latest_review: state.reviews.last().cloned(),
        made: Mutex::new(None),
    });
    let only_tools = Some(
        spec.tools
            .clone()
            .unwrap_or_else(|| ROLE_TOOLS.iter().map(|t| (*t).to_owned()).collect()),
    );
    for attempt in 0..=MAX_NUDGES {
        let input = AgentInput {
            messages: messages.clone(),
            sandbox: Some(state.sandbox_id.clone()),
            workspace: Some(state.workspace_id.clone()),
            only_tools: only_tools.clone(),
            hook: Some(turn.clone() as Arc<dyn TurnHook>),
            ..AgentInput::default()
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<AgentEvent>();
        let live = app.workflows.live(id);
        let role_name = role.name();
        let relay = tokio::spawn(async move {
            let mut last = None;
            while let Some(event) = rx.recv().await {
                if let Some(live) = &live {
                    let _ = live.send(Live::Agent(json!({"role": role_name, "event": event})));
                }
                if let AgentEvent::Final { messages, .. } = event {
                    last = Some(messages);
                }
            }
            last
        });
        let ran = agent::run(app, caller, model.as_ref(), input, &app.agent_limits, &tx).await;
        drop(tx);
        let conversation = relay.await.ok().flatten();
        if let Err(e) = ran {
            if let Some(transition) = turn.taken() {
                // It made its transition before failing: that stands.
                apply(app, caller, id, role.name(), transition).await?;
                return Ok(());
            }
            reject(
                app,
                id,
                format!(
                    "the {}'s turn failed: {} ({})",
                    role.name(),
                    e.message(),
                    e.code()
                ),
            )
            .await?;
            return Ok(());
        }
        if let Some(transition) = turn.taken() {
            apply(app, caller, id, role.name(), transition).await?;
            return Ok(());
        }
        let tool = match role {
            WorkflowRole::Creator => "submit_for_review",
            WorkflowRole::Reviewer => "submit_review",
        };
        if attempt == MAX_NUDGES {
            break;
        }
        push_event(
            app,
            id,
            "system",
            "nudged",
            json!({"role": role.name(), "attempt": attempt + 1, "tool": tool}),
        )
        .await?;
        messages = conversation.unwrap_or(messages);
        messages.push(Message::user(format!(
            "You ended your turn without calling {tool}. The workflow only moves on with it: finish the work if anything is left, then call {tool}."
        )));
    }
    let tool = match role {
        WorkflowRole::Creator => "submit_for_review",
        WorkflowRole::Reviewer => "submit_review",
    };
    reject(
        app,
        id,
        format!(
            "the {} ended its turn {} times without calling {tool}",
            role.name(),
            MAX_NUDGES + 1
        ),
    )
    .await?;
    Ok(())
}

fn system_prompt(
    template: &WorkflowTemplate,
    spec: &TemplateRole,
    role: WorkflowRole,
    state: &WorkflowState,
    workspace: &kiln_runtime::workspaces::WorkspaceInfo,
) -> String {
    let mut text = spec.prompt.trim().to_owned();
    text.push_str(&format!(
        "\n\nYou are the {} in a {} workflow (round {} of at most {}). You work in workspace {}: its files are the working directory of execute_code (/workspace), and write_file, read_file and list_files use paths relative to it.",
        role.name(),
        template.name,
        state.round,
        state.max_rounds,
        workspace.name
    ));
    if !workspace.services.is_empty() {
        let services: Vec<String> = workspace
            .services
            .iter()
            .map(|s| {
                format!(
                    "{} at {}:{} ({})",
                    s.kind.name(),
                    s.host,
                    s.port,
                    s.connection_string
                )
            })
            .collect();
        text.push_str(&format!(" Its services: {}.", services.join("; ")));
    }
    if !template.files.is_empty() {
        text.push_str(&format!(
            " Work like this usually has these files: {}.",
            template.files.join(", ")
        ));
    }
    if !template.review_criteria.is_empty() {
        text.push_str(&format!(
            " The review judges: {}.",
            template.review_criteria.join("; ")
        ));
    }
    if let Some(preview) = &template.preview {
        text.push_str(&match preview.kind.as_str() {
            "static" => " Once submitted, the workspace's files are served by its nginx at http://127.0.0.1:8080/ inside the workspace.".to_owned(),
            _ => format!(
                " Once submitted, the preview shows what the workspace's server answers on port {} (http://127.0.0.1:{}/ inside the workspace).",
                preview.port.unwrap_or(8000),
                preview.port.unwrap_or(8000)
            ),
        });
    }
    text.push_str(match role {
        WorkflowRole::Creator => " When the work is done, call submit_for_review with notes for the reviewer; in a revision, read the review with get_review_feedback first.",
        WorkflowRole::Reviewer => " When you have judged the work, call submit_review: approved true or false, a grade, feedback and specific suggestions.",
    });
    text
}

fn opening(state: &WorkflowState, role: WorkflowRole) -> String {
    match (role, state.stage) {
        (WorkflowRole::Creator, WorkflowStage::Revision) => {
            let mut text = format!(
                "The task: {}\n\nThe reviewer asked for changes (this is round {} of {}).",
                state.task, state.round, state.max_rounds
            );
            if let Some(review) = state.reviews.last() {
                text.push_str(&format!(
                    "\nGrade: {}\nFeedback: {}",
                    review.grade.as_deref().unwrap_or("none"),
                    review.feedback
                ));
                for s in &review.suggestions {
                    text.push_str(&format!("\n- {s}"));
                }
                if !review.modified_files.is_empty() {
                    text.push_str(&format!(
                        "\nThe reviewer changed: {}.",
                        review.modified_files.join(", ")
                    ));
                }
            }
            text.push_str("\nRevise the work, then call submit_for_review again.");
            text
        }
        (WorkflowRole::Creator, _) => format!("The task: {}", state.task),
        (WorkflowRole::Reviewer, _) => {
            let notes = state
                .history
                .iter()
                .rev()
                .find(|e| e.action == "submitted_for_review")
                .and_then(|e| e.details.get("notes").and_then(Value::as_str))
                .unwrap_or("");
            format!(
                "The task was: {}\n\nThe creator submitted the work for review (round {} of {}). Their notes: {}",
                state.task,
                state.round,
                state.max_rounds,
                if notes.is_empty() { "none" } else { notes }
            )
        }
    }
}

// ---------------------------------------------------------------------------------------
// Starting, acting, cancelling

/// Who plays a role, as a start request says.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct WorkflowRoleChoice {
    /// A person plays it (through `POST …/submit` or `…/review`).
    #[serde(default)]
    pub human: bool,
    /// `provider:model`, overriding the template's and the server's.
    pub model: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkflowRoleChoices {
    pub creator: Option<WorkflowRoleChoice>,
    pub reviewer: Option<WorkflowRoleChoice>,
}

/// A workflow to start.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NewWorkflow {
    /// A workflow template's name (`GET /api/v1/workflow-templates`).
    pub template: String,
    /// What to build (1..=32 KiB of text).
    pub task: String,
    /// Work in this workspace (id or name); a new one otherwise, named `wf-…`.
    pub workspace: Option<String>,
    /// Rounds of review before it is rejected (default the template's, 1..=10).
    pub max_rounds: Option<u32>,
    #[serde(default)]
    pub roles: WorkflowRoleChoices,
}

/// Workflow `id` when `caller` may do what `need` asks of its workspace (a workflow whose
/// workspace is gone: its starter's alone); else, as for one that is not there, 404.
pub fn get_for(
    app: &AppState,
    caller: &Caller,
    id: &str,
    need: kiln_runtime::workspaces::Need,
) -> Result<WorkflowState, ApiError> {
    let state = app.workflows.get(&caller.tenant, id)?;
    let allowed = match app
        .runtime
        .registry
        .workspaces
        .get(&caller.tenant, &state.workspace_id)
    {
        Ok(ws) => ws.allows(&caller.key_id, need),
        Err(_) => state.owner == caller.key_id,
    };
    if allowed {
        Ok(state)
    } else {
        Err(not_found(id))
    }
}

/// Starts a workflow of `caller`'s.
pub async fn start(
    app: &Arc<AppState>,
    caller: &Caller,
    new: NewWorkflow,
) -> Result<WorkflowState, ApiError> {
    let Some(template) = app.workflows.templates.get(&new.template).cloned() else {
        return Err(ApiError::bad_request(
            "UNKNOWN_TEMPLATE",
            format!(
                "no workflow template {:?}; there are {}",
                new.template,
                app.workflows.templates.names().join(", ")
            ),
        ));
    };
    if new.task.trim().is_empty() || new.task.len() > MAX_TASK_BYTES {
        return Err(ApiError::bad_request(
            "INVALID_REQUEST",
            format!("task is 1..={MAX_TASK_BYTES} bytes of text"),
        ));
    }
    let max_rounds = new.max_rounds.unwrap_or(template.max_rounds);
    if !(1..=MAX_ROUNDS).contains(&max_rounds) {
        return Err(ApiError::bad_request(
            "INVALID_REQUEST",
            format!("maxRounds must be 1..={MAX_ROUNDS}"),
        ));
    }
    let mut roles = BTreeMap::new();
    for (role, chosen, spec) in [
        (
            WorkflowRole::Creator,
            new.roles.creator.clone().unwrap_or_default(),
            &template.roles.creator,
        ),
        (
            WorkflowRole::Reviewer,
            new.roles.reviewer.clone().unwrap_or_default(),
            &template.roles.reviewer,
        ),
    ] {
        let setting = WorkflowRoleSetting {
            human: chosen.human,
            model: chosen.model.or_else(|| spec.model.clone()),
        };
        if !setting.human {
            // Refused now, not at the role's first turn.
            model_for(app, &setting)?;
        }
        roles.insert(role.name().to_owned(), setting);
    }
    if app.workflows.running_count(&caller.tenant) >= MAX_RUNNING {
        return Err(kiln_runtime::quota::exceeded(
            "running workflows",
            MAX_RUNNING as u64,
            MAX_RUNNING as u64,
            "workflows",
        )
        .into());
    }
    let id = new_id("wf_");
    let workspace = match &new.workspace {
        Some(which) => {
            let ws = app.runtime.registry.workspaces.get_as(
                caller,
                which,
                kiln_runtime::workspaces::Need::Write,
            )?;
            if let Some(other) = app.workflows.running_in(&caller.tenant, &ws.id) {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "WORKFLOW_RUNNING",
                    format!(
                        "workflow {other} is running in workspace {}; cancel it or wait for it to finish",
                        ws.name
                    ),
                ));
            }
            for service in &template.services {
                let kind = kiln_runtime::workspaces::ServiceKind::parse(service)?;
                if !ws.services.iter().any(|s| s.kind == kind) {
                    kiln_runtime::workspaces::add_service(&app.runtime, caller, &ws.id, kind)
                        .await?;
                }
            }
            app.runtime
                .registry
                .workspaces
                .get(&caller.tenant, &ws.id)?
        }
        None => {
            kiln_runtime::workspaces::create(
                &app.runtime,
                caller,
                kiln_runtime::workspaces::NewWorkspace {
                    name: format!("wf-{}", &id[3..15]),
                    template: None,
                    services: template.services.clone(),
                    public_preview: false,
                },
            )
            .await?
        }
    };
    let now = rfc3339(now_ms());
    let state = WorkflowState {
        id: id.clone(),
        template: template.name.clone(),
        task: new.task,
        workspace_id: workspace.id.clone(),
        workspace: workspace.name.clone(),
        sandbox_id: workspace.sandbox_id.clone(),
        stage: WorkflowStage::Creation,
        current_agent: Some(WorkflowRole::Creator),
        waiting_for_human: false,
        round: 1,
        max_rounds,
        roles,
        reviews: Vec::new(),
        history: Vec::new(),
        reason: None,
        preview_url: None,
        owner: caller.key_id.clone(),
        created_at: now.clone(),
        updated_at: now,
        turn_base: None,
    };
    let stored = Stored {
        state,
        caller: StoredCaller::of(caller),
    };
    app.workflows.save(&stored)?;
    app.workflows.lock().insert(id.clone(), Entry::new(stored));
    push_event(
        app,
        &id,
        "system",
        "started",
        json!({"template": template.name, "task": agent::truncate(&app.workflows.get(&caller.tenant, &id)?.task, 2000).0, "workspace": workspace.name, "maxRounds": max_rounds}),
    )
    .await?;
    await_human(app, caller, &id).await?;
    spawn_driver(app, &id);
    app.workflows.get(&caller.tenant, &id)
}

/// A person acts as the role whose turn it is: `submit` (the creator's) or `review` (the
/// reviewer's). Refused when that role is an agent's or it is not that role's turn.
pub async fn act(
    app: &Arc<AppState>,
    caller: &Caller,
    id: &str,
    role: WorkflowRole,
    arguments: &Value,
) -> Result<WorkflowState, ApiError> {
    let state = get_for(app, caller, id, kiln_runtime::workspaces::Need::Write)?;
    let plays_it = state.roles.get(role.name()).is_some_and(|r| r.human);
    if !plays_it {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "NOT_HUMAN_ROLE",
            format!(
                "the {} of workflow {id} is an agent; start a workflow with roles.{}.human to act as it",
                role.name(),
                role.name()
            ),
        ));
    }
    if state.stage.role() != Some(role) || !state.waiting_for_human {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "NOT_YOUR_TURN",
            format!(
                "workflow {id} is at stage {:?}{}: it is not the {}'s turn",
                state.stage,
                if state.waiting_for_human {
                    ""
                } else {
                    " (getting ready)"
                },
                role.name()
            ),
        ));
    }
    let transition = match role {
        WorkflowRole::Creator => notes_of(arguments),
        WorkflowRole::Reviewer => review_of(arguments),
    }
    .map_err(|m| ApiError::bad_request("INVALID_REQUEST", m))?;
    let by = format!("human:{}", caller.key_id);
    let state = apply(app, caller, id, &by, transition).await?;
    if let Some(wake) = app.workflows.wake(id) {
        wake.notify_one();
    }
    Ok(state)
}

/// Cancels workflow `id`: its agent's turn stops, the workflow is rejected with the reason.
pub async fn cancel(
    app: &Arc<AppState>,
    caller: &Caller,
    id: &str,
) -> Result<WorkflowState, ApiError> {
    let state = get_for(app, caller, id, kiln_runtime::workspaces::Need::Write)?;
    if state.stage.finished() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "WORKFLOW_FINISHED",
            format!("workflow {id} is {:?} already", state.stage),
        ));
    }
    let driver = {
        let mut all = app.workflows.lock();
        let entry = all.get_mut(id).ok_or_else(|| not_found(id))?;
        let _ = entry.cancel.send(true);
        entry.driver.take()
    };
    if let Some(driver) = driver {
        // The driver stops at its next await; an execution it started ends by its timeout.
        let _ = tokio::time::timeout(Duration::from_secs(30), driver).await;
    }
    let state = app.workflows.get(&caller.tenant, id)?;
    if state.stage.finished() {
        return Ok(state);
    }
    let reason = format!("cancelled by key {}", caller.key_id);
    push_event(
        app,
        id,
        &format!("human:{}", caller.key_id),
        "cancelled",
        json!({"reason": reason}),
    )
    .await?;
    app.workflows.update(id, |s| {
        s.stage = WorkflowStage::Rejected;
        s.current_agent = None;
        s.waiting_for_human = false;
        s.reason = Some(reason);
    })
}

// ---------------------------------------------------------------------------------------
// HTTP

type Shared = State<Arc<AppState>>;

fn body<T>(body: Result<kiln_http::JsonObject<T>, kiln_http::HttpError>) -> Result<T, ApiError> {
    body.map(|kiln_http::JsonObject(b)| b)
        .map_err(ApiError::from)
}

/// The workflow templates.
#[derive(Debug, Serialize, ToSchema)]
pub struct WorkflowTemplateList {
    pub templates: Vec<WorkflowTemplateInfo>,
}

/// List the workflow templates (built in, and the operator's).
#[utoipa::path(get, path = "/api/v1/workflow-templates", tag = "v1 workflows",
    responses((status = 200, description = "The templates", body = WorkflowTemplateList)))]
pub async fn templates(State(state): Shared) -> Json<WorkflowTemplateList> {
    Json(WorkflowTemplateList {
        templates: state
            .workflows
            .templates
            .all
            .values()
            .map(WorkflowTemplate::info)
            .collect(),
    })
}

/// Start a workflow from a template with a task: a new workspace (or the one named) with
/// the template's services, and the creator's first turn under way.
#[utoipa::path(post, path = "/api/v1/workflows", tag = "v1 workflows",
    request_body = NewWorkflow,
    responses(
        (status = 201, description = "Started", body = WorkflowState),
        (status = 400, description = "An unknown template or model, a bad task", body = ErrorBody),
        (status = 409, description = "A workflow runs in that workspace", body = ErrorBody),
        (status = 503, description = "No model configured for an agent role", body = ErrorBody),
    ))]
pub async fn create(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    new: Result<kiln_http::JsonObject<NewWorkflow>, kiln_http::HttpError>,
) -> Result<(StatusCode, Json<WorkflowState>), ApiError> {
    let new = body(new)?;
    Ok((
        StatusCode::CREATED,
        Json(start(&state, &caller, new).await?),
    ))
}

/// The tenant's workflows.
#[derive(Debug, Serialize, ToSchema)]
pub struct WorkflowList {
    pub workflows: Vec<WorkflowState>,
}

/// List the tenant's workflows, oldest first.
#[utoipa::path(get, path = "/api/v1/workflows", tag = "v1 workflows",
    responses((status = 200, description = "Its workflows", body = WorkflowList)))]
pub async fn list(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
) -> Json<WorkflowList> {
    let mut workflows = state.workflows.list(&caller.tenant);
    workflows
        .retain(|w| get_for(&state, &caller, &w.id, kiln_runtime::workspaces::Need::Read).is_ok());
    Json(WorkflowList { workflows })
}

/// A workflow's state: stage, whose turn, reviews and the audit trail.
#[utoipa::path(get, path = "/api/v1/workflows/{workflow}", tag = "v1 workflows",
    params(("workflow" = String, Path, description = "Its id (`wf_…`)")),
    responses(
        (status = 200, description = "The workflow", body = WorkflowState),
        (status = 404, description = "No such workflow", body = ErrorBody),
    ))]
pub async fn get(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<UrlPath<String>, PathRejection>,
) -> Result<Json<WorkflowState>, ApiError> {
    let UrlPath(id) = id.map_err(path_error)?;
    Ok(Json(get_for(
        &state,
        &caller,
        &id,
        kiln_runtime::workspaces::Need::Read,
    )?))
}

/// Cancel a workflow: its agent stops, and it is rejected with the reason.
#[utoipa::path(post, path = "/api/v1/workflows/{workflow}/cancel", tag = "v1 workflows",
    params(("workflow" = String, Path, description = "Its id")),
    responses(
        (status = 200, description = "Cancelled", body = WorkflowState),
        (status = 404, description = "No such workflow", body = ErrorBody),
        (status = 409, description = "It has finished", body = ErrorBody),
    ))]
pub async fn cancel_route(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<UrlPath<String>, PathRejection>,
) -> Result<Json<WorkflowState>, ApiError> {
    let UrlPath(id) = id.map_err(path_error)?;
    Ok(Json(cancel(&state, &caller, &id).await?))
}

/// A person's hand-over as the creator.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkflowSubmission {
    pub notes: Option<String>,
}

/// A person's review.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkflowReview {
    pub approved: bool,
    pub grade: Option<String>,
    pub feedback: Option<String>,
    pub suggestions: Option<Vec<String>>,
}

/// Act as the creator (a workflow started with `roles.creator.human`): submit for review.
#[utoipa::path(post, path = "/api/v1/workflows/{workflow}/submit", tag = "v1 workflows",
    params(("workflow" = String, Path, description = "Its id")),
    request_body = WorkflowSubmission,
    responses(
        (status = 200, description = "Submitted", body = WorkflowState),
        (status = 409, description = "The creator is an agent, or it is not its turn", body = ErrorBody),
    ))]
pub async fn submit(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<UrlPath<String>, PathRejection>,
    sent: Result<kiln_http::JsonObject<WorkflowSubmission>, kiln_http::HttpError>,
) -> Result<Json<WorkflowState>, ApiError> {
    let UrlPath(id) = id.map_err(path_error)?;
    let sent = body(sent)?;
    Ok(Json(
        act(
            &state,
            &caller,
            &id,
            WorkflowRole::Creator,
            &json!({"notes": sent.notes}),
        )
        .await?,
    ))
}

/// Act as the reviewer (a workflow started with `roles.reviewer.human`): approve, or send the
/// work back with feedback.
#[utoipa::path(post, path = "/api/v1/workflows/{workflow}/review", tag = "v1 workflows",
    params(("workflow" = String, Path, description = "Its id")),
    request_body = WorkflowReview,
    responses(
        (status = 200, description = "Reviewed", body = WorkflowState),
        (status = 400, description = "A bad review", body = ErrorBody),
        (status = 409, description = "The reviewer is an agent, or it is not its turn", body = ErrorBody),
    ))]
pub async fn review(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<UrlPath<String>, PathRejection>,
    sent: Result<kiln_http::JsonObject<WorkflowReview>, kiln_http::HttpError>,
) -> Result<Json<WorkflowState>, ApiError> {
    let UrlPath(id) = id.map_err(path_error)?;
    let sent = body(sent)?;
    Ok(Json(
        act(&state, &caller, &id, WorkflowRole::Reviewer, &json!(sent)).await?,
    ))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct WorkflowEventsQuery {
    /// Only events after this seq (a reconnecting client's last one).
    pub after: Option<u64>,
}

/// Stream a workflow's events (Server-Sent Events): `workflow` events (the audit trail, from
/// `after`, then as they happen) and `agent` events (an agent's tokens and tool calls, live
/// only); the stream ends after `approved`, `rejected` or `cancelled`.
#[utoipa::path(get, path = "/api/v1/workflows/{workflow}/events", tag = "v1 workflows",
    params(("workflow" = String, Path, description = "Its id"), WorkflowEventsQuery),
    responses(
        (status = 200, description = "An event stream", content_type = "text/event-stream", body = crate::v1::SseEvent),
        (status = 404, description = "No such workflow", body = ErrorBody),
    ))]
pub async fn events(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<UrlPath<String>, PathRejection>,
    query: Result<Query<WorkflowEventsQuery>, QueryRejection>,
) -> Result<Sse<impl futures::Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let UrlPath(id) = id.map_err(path_error)?;
    let Query(query) =
        query.map_err(|e| ApiError::bad_request("INVALID_REQUEST", e.body_text()))?;
    // Subscribe first, then read the trail: nothing falls between.
    let live = state.workflows.live(&id).ok_or_else(|| not_found(&id))?;
    let receiver = live.subscribe();
    let known = get_for(&state, &caller, &id, kiln_runtime::workspaces::Need::Read)?;
    let after = query.after.unwrap_or(0);
    let backlog: std::collections::VecDeque<WorkflowEvent> = known
        .history
        .into_iter()
        .filter(|e| e.seq > after)
        .collect();
    let finished = known.stage.finished();
    struct Feed {
        app: Arc<AppState>,
        tenant: String,
        id: String,
        backlog: std::collections::VecDeque<WorkflowEvent>,
        receiver: broadcast::Receiver<Live>,
        last: u64,
        finished: bool,
        done: bool,
    }
    let feed = Feed {
        app: state.clone(),
        tenant: caller.tenant.clone(),
        id,
        backlog,
        receiver,
        last: after,
        finished,
        done: false,
    };
    fn terminal(event: &WorkflowEvent) -> bool {
        matches!(event.action.as_str(), "approved" | "rejected" | "cancelled")
    }
    let stream = futures::stream::unfold(feed, |mut feed| async move {
        if feed.done {
            return None;
        }
        loop {
            if let Some(event) = feed.backlog.pop_front() {
                if event.seq <= feed.last {
                    continue;
                }
                feed.last = event.seq;
                feed.done = terminal(&event);
                let data = serde_json::to_string(&event).unwrap_or_default();
                return Some((Ok(Event::default().event("workflow").data(data)), feed));
            }
            if feed.finished {
                return None;
            }
            match feed.receiver.recv().await {
                Ok(Live::Event(event)) => feed.backlog.push_back(event),
                Ok(Live::Agent(value)) => {
                    let data = value.to_string();
                    return Some((Ok(Event::default().event("agent").data(data)), feed));
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    // Agent activity was dropped; the trail is read again from the record.
                    let state = feed.app.workflows.get(&feed.tenant, &feed.id).ok()?;
                    feed.backlog = state
                        .history
                        .into_iter()
                        .filter(|e| e.seq > feed.last)
                        .collect();
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_templates_parse() {
        let templates = Templates::load(None).unwrap();
        assert_eq!(
            templates.names(),
            ["database-schema", "fullstack-app", "static-website"]
        );
        let db = templates.get("database-schema").unwrap();
        assert_eq!(db.services, ["postgres"]);
        assert!(db.preview.is_none());
        let site = templates.get("static-website").unwrap();
        assert_eq!(site.preview.as_ref().unwrap().kind, "static");
    }

    #[test]
    fn bad_templates_are_refused_with_the_reason() {
        let ok = "name: t\nroles:\n  creator: {prompt: make}\n  reviewer: {prompt: judge}\n";
        assert!(WorkflowTemplate::parse(ok).is_ok());
        for (text, says) in [
            ("name: t\n", "roles"),
            (
                "name: 'a b'\nroles:\n  creator: {prompt: x}\n  reviewer: {prompt: y}\n",
                "not a template name",
            ),
            (
                "name: t\nservices: [oracle]\nroles:\n  creator: {prompt: x}\n  reviewer: {prompt: y}\n",
                "oracle",
            ),
            (
                "name: t\nroles:\n  creator: {prompt: x, tools: [rm_rf]}\n  reviewer: {prompt: y}\n",
                "no tool",
            ),
            (
                "name: t\nmax_rounds: 0\nroles:\n  creator: {prompt: x}\n  reviewer: {prompt: y}\n",
                "max_rounds",
            ),
            (
                "name: t\npreview: {type: proxy}\nroles:\n  creator: {prompt: x}\n  reviewer: {prompt: y}\n",
                "port",
            ),
            (
                "name: t\nsurprise: 1\nroles:\n  creator: {prompt: x}\n  reviewer: {prompt: y}\n",
                "surprise",
            ),
            (
                "name: t\nroles:\n  creator: {prompt: ' '}\n  reviewer: {prompt: y}\n",
                "empty",
            ),
        ] {
            let error = WorkflowTemplate::parse(text).unwrap_err();
            assert!(error.contains(says), "{text}: {error}");
        }
    }

    #[test]
    fn an_operator_folder_adds_and_replaces_templates() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("mine.yaml"),
            "name: mine\nroles:\n  creator: {prompt: make}\n  reviewer: {prompt: judge}\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("site.yaml"),
            "name: static-website\nmax_rounds: 1\nroles:\n  creator: {prompt: make}\n  reviewer: {prompt: judge}\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not a template").unwrap();
        let templates = Templates::load(Some(dir.path())).unwrap();
        assert!(templates.get("mine").is_some());
        assert_eq!(templates.get("static-website").unwrap().max_rounds, 1);
        std::fs::write(dir.path().join("bad.yaml"), "name: [").unwrap();
        let error = Templates::load(Some(dir.path())).unwrap_err();
        assert!(error.contains("bad.yaml"), "{error}");
    }

    #[test]
    fn a_turn_takes_one_transition_of_its_role() {
        let turn = Turn {
            role: WorkflowRole::Reviewer,
            latest_review: None,
            made: Mutex::new(None),
        };
        assert_eq!(
            turn.call("get_review_feedback", &json!({})),
            Some(("null".into(), false))
        );
        // The creator's tool is not the reviewer's.
        assert_eq!(turn.call("submit_for_review", &json!({})), None);
        let (said, error) = turn.call("submit_review", &json!({"grade": "A"})).unwrap();
        assert!(error && said.contains("approved"), "{said}");
        let (said, error) = turn
            .call(
                "submit_review",
                &json!({"approved": true, "suggestions": "x"}),
            )
            .unwrap();
        assert!(error && said.contains("suggestions"), "{said}");
        assert!(!turn.done());
        let (_, error) = turn
            .call(
                "submit_review",
                &json!({"approved": false, "grade": "B", "feedback": "add an index", "suggestions": ["index orders.customer_id"]}),
            )
            .unwrap();
        assert!(!error);
        assert!(turn.done());
        let (said, error) = turn
            .call("submit_review", &json!({"approved": true}))
            .unwrap();
        assert!(error && said.contains("already"), "{said}");
        match turn.taken() {
            Some(Transition::Review {
                approved: false,
                grade,
                suggestions,
                ..
            }) => {
                assert_eq!(grade.as_deref(), Some("B"));
                assert_eq!(suggestions, ["index orders.customer_id"]);
            }
            other => panic!("{other:?}"),
        }
    }
}
