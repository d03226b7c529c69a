//! `POST /api/v1/chat`: the agent over HTTP, streamed as Server-Sent Events.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{Extension, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use kiln_http::{HttpError, JsonObject as JsonBody};
use kiln_llm::{ChatModel, GenaiModel, Message, ModelConfig};
use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::AppState;
use crate::agent::{self, AgentEvent, AgentInput};
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};

/// A chat request: the conversation so far (the caller keeps it), and options.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"messages": [{"role": "user", "content": "What is the 20th Fibonacci number? Compute it."}]}))]
pub struct ChatBody {
    /// `{"role": "system"|"user"|"assistant"|"tool", "content": "...", "tool_calls"?, "tool_call_id"?}`
    #[schema(value_type = Vec<Object>)]
    pub messages: Vec<Message>,
    /// `provider:model`, overriding `KILN_LLM_MODEL` (the provider's key still comes from the
    /// server's environment).
    pub model: Option<String>,
    /// A JSON schema the final answer must match (sent as `structured` in the final event).
    #[schema(value_type = Option<Object>)]
    pub output_schema: Option<Value>,
    /// Continue in this sandbox (its files and session state); a new one otherwise.
    pub sandbox: Option<String>,
    /// Work in this workspace (by id or name): its sandbox, and the tools `add_service`,
    /// `run_sql` and `enable_preview` besides the others.
    pub workspace: Option<String>,
}

/// The configured model, built once (`Err` says how to configure one).
pub fn configured_model(
    config: &Result<ModelConfig, kiln_llm::LlmError>,
) -> Result<Arc<dyn ChatModel>, String> {
    let config = config.as_ref().map_err(|e| e.to_string())?;
    GenaiModel::new(config)
        .map(|m| Arc::new(m) as Arc<dyn ChatModel>)
        .map_err(|e| e.to_string())
}

fn not_configured(message: &str) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "LLM_NOT_CONFIGURED",
        format!("chat needs a model: {message}"),
    )
}

/// Chat with a model that can run code: events `sandbox`, `text_delta`, `tool_call_start`,
/// `tool_call_arguments`, `stdout`, `stderr`, `tool_result`, `artifact`, then `final` (the
/// answer, the whole conversation, the sandbox id, token usage) or `error`.
#[utoipa::path(post, path = "/api/v1/chat", tag = "v1 chat", request_body = ChatBody,
    responses(
        (status = 200, description = "An event stream", content_type = "text/event-stream", body = crate::v1::SseEvent),
        (status = 400, description = "Bad request", body = ErrorBody),
        (status = 503, description = "No model configured", body = ErrorBody),
    ))]
pub async fn chat(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    body: Result<JsonBody<ChatBody>, HttpError>,
) -> Result<Sse<impl futures::Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let JsonBody(body) = body?;
    if body.messages.is_empty() {
        return Err(ApiError::bad_request(
            "INVALID_REQUEST",
            "messages is empty",
        ));
    }
    if let Some(schema) = &body.output_schema
        && !schema.is_object()
    {
        return Err(ApiError::bad_request(
            "INVALID_SCHEMA",
            "output_schema must be a JSON schema object",
        ));
    }
    if let Some(schema) = &body.output_schema
        && let Err(e) = jsonschema::validator_for(schema)
    {
        return Err(ApiError::bad_request(
            "INVALID_SCHEMA",
            format!("output_schema is not a valid JSON schema: {e}"),
        ));
    }
    let model: Arc<dyn ChatModel> = match &body.model {
        None => state.llm.clone().map_err(|m| not_configured(&m))?,
        Some(spec) => {
            let config = state.llm_env.with_model(spec).map_err(|e| {
                // The caller named a model kiln cannot use: their request is wrong.
                ApiError::bad_request("INVALID_MODEL", format!("model {spec:?}: {e}"))
            })?;
            Arc::new(
                GenaiModel::new(&config)
                    .map_err(|e| ApiError::bad_request("INVALID_MODEL", e.to_string()))?,
            )
        }
    };
    if let Some(sandbox) = &body.sandbox {
        if !state
            .runtime
            .registry
            .workspaces
            .may_use_sandbox(&caller, sandbox)
        {
            return Err(kiln_runtime::RuntimeError::SandboxNotFound {
                id: sandbox.clone(),
            }
            .into());
        }
        state.runtime.registry.get(&caller.tenant, sandbox)?;
    }
    let mut sandbox = body.sandbox;
    let workspace = match &body.workspace {
        None => None,
        Some(which) => {
            let ws = state.runtime.registry.workspaces.get_as(
                &caller,
                which,
                kiln_runtime::workspaces::Need::Write,
            )?;
            if sandbox.as_ref().is_some_and(|s| *s != ws.sandbox_id) {
                return Err(ApiError::bad_request(
                    "INVALID_REQUEST",
                    "a chat in a workspace runs in the workspace's sandbox: give `workspace` or `sandbox`, not two different ones",
                ));
            }
            sandbox = Some(ws.sandbox_id);
            Some(ws.id)
        }
    };
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<AgentEvent>();
    let input = AgentInput {
        messages: body.messages,
        output_schema: body.output_schema,
        sandbox,
        workspace,
        ..AgentInput::default()
    };
    let limits = state.agent_limits.clone();
    tokio::spawn(async move {
        if let Err(error) = agent::run(&state, &caller, model.as_ref(), input, &limits, &tx).await {
            let _ = tx.send(AgentEvent::Error {
                code: error.code().to_owned(),
                message: error.message().to_owned(),
            });
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        let event = rx.recv().await?;
        let data = serde_json::to_string(&event).unwrap_or_default();
        Some((Ok(Event::default().event(event.name()).data(data)), rx))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}
