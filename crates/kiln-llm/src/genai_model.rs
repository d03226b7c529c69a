//! [`ChatModel`] over the `genai` crate.

use futures::StreamExt;
use genai::adapter::AdapterKind;
use genai::chat::{
    ChatMessage, ChatOptions, ChatRequest, ChatStreamEvent, JsonSpec, Tool, ToolResponse,
};
use genai::resolver::{AuthData, Endpoint};
use genai::{Client, ModelIden, ServiceTarget, WebConfig};
use tokio::sync::mpsc::UnboundedSender;

use crate::{
    ChatModel, LlmError, ModelConfig, ModelEvent, ModelReply, ModelRequest, Provider, Role,
    ToolCall, Usage,
};

/// A model reached through `genai`.
pub struct GenaiModel {
    client: Client,
    iden: ModelIden,
    name: String,
}

impl std::fmt::Debug for GenaiModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenaiModel")
            .field("name", &self.name)
            .finish()
    }
}

fn adapter(provider: Provider) -> AdapterKind {
    match provider {
        Provider::OpenAi | Provider::OpenAiCompatible => AdapterKind::OpenAI,
        Provider::Anthropic => AdapterKind::Anthropic,
        Provider::Gemini => AdapterKind::Gemini,
        Provider::Ollama => AdapterKind::Ollama,
    }
}

impl GenaiModel {
    /// A model as configured.
    pub fn new(config: &ModelConfig) -> Result<GenaiModel, LlmError> {
        let kind = adapter(config.provider);
        let iden = ModelIden::new(kind, config.model.clone());
        let base_url = config.base_url.clone().map(|mut url| {
            if !url.ends_with('/') {
                url.push('/');
            }
            url
        });
        let key = config.api_key.clone();
        let target_model = iden.clone();
        let client = Client::builder()
            .with_web_config(WebConfig::default().with_timeout(config.timeout))
            .with_service_target_resolver_fn(move |mut target: ServiceTarget| {
                if let Some(url) = &base_url {
                    target.endpoint = Endpoint::from_owned(url.clone());
                }
                if let Some(key) = &key {
                    target.auth = AuthData::from_single(secrecy::ExposeSecret::expose_secret(key));
                } else if matches!(target_model.adapter_kind, AdapterKind::OpenAI) {
                    // An OpenAI-compatible server without keys still gets a header.
                    target.auth = AuthData::from_single("none");
                }
                target.model = target_model.clone();
                Ok(target)
            })
            .build()
            .map_err(|e| LlmError::NotConfigured(format!("could not build the client: {e}")))?;
        Ok(GenaiModel {
            client,
            iden,
            name: format!("{:?}:{}", config.provider, config.model).to_lowercase(),
        })
    }
}

fn to_genai(request: &ModelRequest) -> ChatRequest {
    let system: Vec<&str> = request
        .messages
        .iter()
        .filter(|m| m.role == Role::System)
        .map(|m| m.content.as_str())
        .collect();
    let mut messages = Vec::new();
    for message in &request.messages {
        match message.role {
            Role::System => {}
            Role::User => messages.push(ChatMessage::user(message.content.clone())),
            Role::Assistant if message.tool_calls.is_empty() => {
                messages.push(ChatMessage::assistant(message.content.clone()));
            }
            Role::Assistant => {
                let calls: Vec<genai::chat::ToolCall> = message
                    .tool_calls
                    .iter()
                    .map(|c| genai::chat::ToolCall {
                        call_id: c.id.clone(),
                        fn_name: c.name.clone(),
                        fn_arguments: c.arguments.clone(),
                        thought_signatures: None,
                    })
                    .collect();
                messages.push(ChatMessage::from(calls));
            }
            Role::Tool => messages.push(ChatMessage::from(ToolResponse::new(
                message.tool_call_id.clone().unwrap_or_default(),
                message.content.clone(),
            ))),
        }
    }
    let mut chat = ChatRequest::new(messages);
    if !system.is_empty() {
        chat = chat.with_system(system.join("\n\n"));
    }
    if !request.tools.is_empty() {
        chat = chat.with_tools(request.tools.iter().map(|t| {
            Tool::new(t.name.clone())
                .with_description(t.description.clone())
                .with_schema(t.parameters.clone())
        }));
    }
    chat
}

fn options(request: &ModelRequest) -> ChatOptions {
    let mut options = ChatOptions::default()
        .with_capture_usage(true)
        .with_capture_content(true)
        .with_capture_tool_calls(true);
    if let Some(schema) = &request.output_schema {
        options = options.with_response_format(JsonSpec::new("answer", schema.clone()));
    }
    options
}

fn from_genai_call(call: genai::chat::ToolCall) -> ToolCall {
    ToolCall {
        id: call.call_id,
        name: call.fn_name,
        arguments: call.fn_arguments,
    }
}

fn usage(usage: &genai::chat::Usage) -> Usage {
    Usage {
        input_tokens: usage.prompt_tokens.unwrap_or(0).max(0) as u64,
        output_tokens: usage.completion_tokens.unwrap_or(0).max(0) as u64,
    }
}

/// Sorts a `genai` failure into what kiln does about it.
fn classify(error: genai::Error) -> LlmError {
    use genai::Error as E;
    let status = match &error {
        E::HttpError { status, .. } => Some(status.as_u16()),
        E::WebModelCall { webc_error, .. } | E::WebAdapterCall { webc_error, .. } => {
            match webc_error {
                genai::webc::Error::ResponseFailedStatus { status, .. } => Some(status.as_u16()),
                genai::webc::Error::Reqwest(e) if e.is_timeout() => {
                    return LlmError::Timeout(std::time::Duration::ZERO);
                }
                genai::webc::Error::Reqwest(e) => return LlmError::Network(e.to_string()),
                _ => None,
            }
        }
        E::WebStream { cause, .. } => return LlmError::Network(cause.clone()),
        _ => None,
    };
    let message: String = error.to_string().chars().take(500).collect();
    match status {
        Some(401 | 403) => LlmError::Auth {
            status: status.unwrap_or(401),
        },
        Some(429) => LlmError::RateLimited { attempts: 1 },
        Some(status) if status >= 500 => LlmError::Server {
            status,
            attempts: 1,
            message,
        },
        Some(status) => LlmError::Protocol(format!("HTTP {status}: {message}")),
        None => LlmError::Protocol(message),
    }
}

#[async_trait::async_trait]
impl ChatModel for GenaiModel {
    fn name(&self) -> String {
        self.name.clone()
    }

    async fn complete(
        &self,
        request: &ModelRequest,
        events: Option<&UnboundedSender<ModelEvent>>,
    ) -> Result<ModelReply, LlmError> {
        let chat = to_genai(request);
        let options = options(request);
        let Some(events) = events else {
            let response = self
                .client
                .exec_chat(self.iden.clone(), chat, Some(&options))
                .await
                .map_err(classify)?;
            let text = response.texts().join("");
            let usage = usage(&response.usage);
            return Ok(ModelReply {
                text,
                tool_calls: response
                    .into_tool_calls()
                    .into_iter()
                    .map(from_genai_call)
                    .collect(),
                usage,
            });
        };
        let response = self
            .client
            .exec_chat_stream(self.iden.clone(), chat, Some(&options))
            .await
            .map_err(classify)?;
        let mut stream = response.stream;
        let mut reply = ModelReply::default();
        let mut first = true;
        let mut started: Vec<String> = Vec::new();
        while let Some(event) = stream.next().await {
            let event = event.map_err(classify)?;
            if first && !matches!(event, ChatStreamEvent::Start | ChatStreamEvent::Heartbeat) {
                first = false;
                let _ = events.send(ModelEvent::FirstToken);
            }
            match event {
                ChatStreamEvent::Chunk(chunk) => {
                    reply.text.push_str(&chunk.content);
                    let _ = events.send(ModelEvent::TextDelta(chunk.content));
                }
                ChatStreamEvent::ToolCallChunk(chunk) => {
                    let call = chunk.tool_call;
                    if !started.contains(&call.call_id) {
                        started.push(call.call_id.clone());
                        let _ = events.send(ModelEvent::ToolCallStart {
                            id: call.call_id.clone(),
                            name: call.fn_name.clone(),
                        });
                    }
                    let delta = match &call.fn_arguments {
                        serde_json::Value::String(text) => text.clone(),
                        other => other.to_string(),
                    };
                    let _ = events.send(ModelEvent::ToolCallArguments {
                        id: call.call_id,
                        delta,
                    });
                }
                ChatStreamEvent::End(end) => {
                    if let Some(u) = &end.captured_usage {
                        reply.usage = usage(u);
                    }
                    if let Some(content) = end.captured_content {
                        reply.tool_calls = content
                            .into_tool_calls()
                            .into_iter()
                            .map(from_genai_call)
                            .collect();
                    }
                }
                _ => {}
            }
        }
        Ok(reply)
    }
}
