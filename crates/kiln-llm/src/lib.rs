//! LLM providers behind one small trait of ours, [`ChatModel`].
//!
//! kiln talks to models through `genai` (pinned to an exact version): it covers OpenAI,
//! Anthropic, Gemini, Ollama and any OpenAI-compatible server, streams tool-call chunks, and
//! lets one resolver point any provider at any URL. It is wrapped here so that the rest of
//! kiln depends on our types only (messages, tool calls, events) and a change of library
//! touches this crate alone. Retries with backoff, time limits and error classification live
//! here too, in one place.
//!
//! Configuration is by environment alone:
//!
//! | variable | meaning |
//! |---|---|
//! | `KILN_LLM_MODEL` | `openai:gpt-4o`, `anthropic:claude-sonnet-4-5`, `gemini:gemini-2.5-flash`, `ollama:llama3.2`, `openai-compatible:MODEL` |
//! | `KILN_LLM_BASE_URL` | the server's base URL (required for `openai-compatible`; optional for the others, e.g. a proxy) |
//! | `OPENAI_API_KEY`, `ANTHROPIC_API_KEY`, `GEMINI_API_KEY` | keys, read from the environment, never logged or returned |
//! | `KILN_LLM_API_KEY` | the key for `openai-compatible` (optional) |
//! | `KILN_LLM_TIMEOUT` | seconds one model call may take (default 120) |
//! | `KILN_LLM_RETRIES`, `KILN_LLM_RETRY_DELAY_MS` | attempts per call (default 3) and the first backoff (default 500 ms, doubling) |

#[cfg(feature = "fake-provider")]
pub mod fake;
mod genai_model;

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::mpsc::UnboundedSender;

pub use genai_model::GenaiModel;

/// Who said a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

/// A tool call the model asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as the model sent them (a JSON object when well formed).
    pub arguments: Value,
}

/// One message of a conversation (the caller keeps the conversation: messages in, out).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    #[serde(default)]
    pub content: String,
    /// For an assistant message: the tools it called.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For a tool message: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn system(content: impl Into<String>) -> Message {
        Message::text(Role::System, content)
    }

    pub fn user(content: impl Into<String>) -> Message {
        Message::text(Role::User, content)
    }

    pub fn assistant(content: impl Into<String>) -> Message {
        Message::text(Role::Assistant, content)
    }

    fn text(role: Role, content: impl Into<String>) -> Message {
        Message {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// A tool's answer to call `id`.
    pub fn tool(id: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: Role::Tool,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: Some(id.into()),
        }
    }
}

/// A tool offered to the model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON schema of the arguments.
    pub parameters: Value,
}

/// One call to the model.
#[derive(Debug, Clone, Default)]
pub struct ModelRequest {
    pub messages: Vec<Message>,
    pub tools: Vec<ToolSpec>,
    /// Ask for a final answer matching this JSON schema.
    pub output_schema: Option<Value>,
}

/// Tokens used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

impl std::ops::AddAssign for Usage {
    fn add_assign(&mut self, other: Usage) {
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
    }
}

/// What the model answered.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelReply {
    pub text: String,
    pub tool_calls: Vec<ToolCall>,
    pub usage: Usage,
}

/// What a streaming call reports while the model writes.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelEvent {
    /// The first byte of the answer arrived.
    FirstToken,
    TextDelta(String),
    ToolCallStart {
        id: String,
        name: String,
    },
    ToolCallArguments {
        id: String,
        delta: String,
    },
}

/// A model call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LlmError {
    #[error("no model is configured: {0}")]
    NotConfigured(String),
    #[error("the provider refused the key (HTTP {status}): check the API key variable")]
    Auth { status: u16 },
    #[error(
        "the provider is rate limiting (HTTP 429) and did not recover after {attempts} attempts"
    )]
    RateLimited { attempts: u32 },
    #[error("the provider failed (HTTP {status}) after {attempts} attempts: {message}")]
    Server {
        status: u16,
        attempts: u32,
        message: String,
    },
    #[error("the provider did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the provider answered something kiln could not use: {0}")]
    Protocol(String),
    #[error("could not reach the provider: {0}")]
    Network(String),
}

impl LlmError {
    /// Worth retrying: rate limits, server errors, timeouts, network failures.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            LlmError::RateLimited { .. }
                | LlmError::Server { .. }
                | LlmError::Timeout(_)
                | LlmError::Network(_)
        )
    }
}

/// A model that can chat with tools. Implementations: [`GenaiModel`] (every provider), and
/// test doubles.
#[async_trait::async_trait]
pub trait ChatModel: Send + Sync {
    /// `provider:model`, for logs and usage reports.
    fn name(&self) -> String;

    /// One call. With `events`, the answer is streamed and reported as it arrives.
    async fn complete(
        &self,
        request: &ModelRequest,
        events: Option<&UnboundedSender<ModelEvent>>,
    ) -> Result<ModelReply, LlmError>;
}

/// Which protocol a model speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    OpenAi,
    Anthropic,
    Gemini,
    Ollama,
    /// Any server speaking OpenAI's chat-completions protocol at `KILN_LLM_BASE_URL`.
    OpenAiCompatible,
}

impl Provider {
    fn parse(name: &str) -> Option<Provider> {
        Some(match name {
            "openai" => Provider::OpenAi,
            "anthropic" => Provider::Anthropic,
            "gemini" => Provider::Gemini,
            "ollama" => Provider::Ollama,
            "openai-compatible" | "openai_compatible" | "compatible" => Provider::OpenAiCompatible,
            _ => return None,
        })
    }

    /// The environment variable holding this provider's key.
    pub fn key_variable(self) -> Option<&'static str> {
        match self {
            Provider::OpenAi => Some("OPENAI_API_KEY"),
            Provider::Anthropic => Some("ANTHROPIC_API_KEY"),
            Provider::Gemini => Some("GEMINI_API_KEY"),
            Provider::Ollama => None,
            Provider::OpenAiCompatible => Some("KILN_LLM_API_KEY"),
        }
    }
}

/// How to reach a model.
#[derive(Clone)]
pub struct ModelConfig {
    pub provider: Provider,
    pub model: String,
    pub base_url: Option<String>,
    /// The key: a redacting type, so no `Debug` or log line can show it.
    pub api_key: Option<secrecy::SecretString>,
    pub timeout: Duration,
    pub retry: RetryPolicy,
}

impl std::fmt::Debug for ModelConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelConfig")
            .field("provider", &self.provider)
            .field("model", &self.model)
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// How often and how patiently to retry a failed call.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Attempts in all (1 = no retry).
    pub attempts: u32,
    /// Wait before the second attempt; doubles each time.
    pub base_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        RetryPolicy {
            attempts: 3,
            base_delay: Duration::from_millis(500),
        }
    }
}

/// What to tell someone who has no model configured.
pub const HOW_TO_CONFIGURE: &str = "set KILN_LLM_MODEL to provider:model (openai:gpt-4o, anthropic:claude-sonnet-4-5, gemini:gemini-2.5-flash, ollama:llama3.2, or openai-compatible:MODEL with KILN_LLM_BASE_URL=http://host:port/v1) and the provider's key variable (OPENAI_API_KEY, ANTHROPIC_API_KEY, GEMINI_API_KEY, KILN_LLM_API_KEY)";

/// The model settings of the environment (`KILN_LLM_*` and the providers' key variables),
/// read once by the binary and passed down. Every value is held as a secret: `Debug` shows
/// only which are set.
#[derive(Clone, Default)]
pub struct LlmEnv {
    vars: std::collections::BTreeMap<&'static str, secrecy::SecretString>,
}

impl LlmEnv {
    /// The variables it holds.
    pub const NAMES: [&'static str; 9] = [
        "KILN_LLM_MODEL",
        "KILN_LLM_BASE_URL",
        "KILN_LLM_TIMEOUT",
        "KILN_LLM_RETRIES",
        "KILN_LLM_RETRY_DELAY_MS",
        "KILN_LLM_API_KEY",
        "OPENAI_API_KEY",
        "ANTHROPIC_API_KEY",
        "GEMINI_API_KEY",
    ];

    /// Reads the variables now (empty ones count as unset).
    pub fn from_env() -> LlmEnv {
        LlmEnv::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the variables through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> LlmEnv {
        let vars = LlmEnv::NAMES
            .iter()
            .filter_map(|&name| {
                get(name)
                    .filter(|v| !v.is_empty())
                    .map(|v| (name, secrecy::SecretString::from(v)))
            })
            .collect();
        LlmEnv { vars }
    }

    fn get(&self, name: &str) -> Option<String> {
        self.vars
            .get(name)
            .map(|v| secrecy::ExposeSecret::expose_secret(v).to_owned())
    }

    /// The configured model (an error says what is missing and how to set it).
    pub fn model(&self) -> Result<ModelConfig, LlmError> {
        ModelConfig::from_lookup(|name| self.get(name))
    }

    /// Model `spec` (`provider:model`) with the rest of these settings (its key, base URL).
    pub fn with_model(&self, spec: &str) -> Result<ModelConfig, LlmError> {
        ModelConfig::from_lookup(|name| {
            if name == "KILN_LLM_MODEL" {
                Some(spec.to_owned())
            } else {
                self.get(name)
            }
        })
    }
}

impl std::fmt::Debug for LlmEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.vars.keys()).finish()
    }
}

impl ModelConfig {
    /// The configuration in `KILN_LLM_*` and the key variables; an error says what is
    /// missing and how to set it.
    pub fn from_env() -> Result<ModelConfig, LlmError> {
        LlmEnv::from_env().model()
    }

    /// Like [`ModelConfig::from_env`], reading variables through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<ModelConfig, LlmError> {
        let spec = get("KILN_LLM_MODEL")
            .ok_or_else(|| LlmError::NotConfigured(HOW_TO_CONFIGURE.into()))?;
        let (provider, model) = spec.split_once(':').ok_or_else(|| {
            LlmError::NotConfigured(format!(
                "KILN_LLM_MODEL={spec:?} has no provider; {HOW_TO_CONFIGURE}"
            ))
        })?;
        let provider = Provider::parse(provider.trim()).ok_or_else(|| {
            LlmError::NotConfigured(format!(
                "unknown provider {provider:?} in KILN_LLM_MODEL; {HOW_TO_CONFIGURE}"
            ))
        })?;
        let model = model.trim().to_owned();
        if model.is_empty() {
            return Err(LlmError::NotConfigured(format!(
                "KILN_LLM_MODEL={spec:?} names no model; {HOW_TO_CONFIGURE}"
            )));
        }
        let base_url = get("KILN_LLM_BASE_URL");
        if provider == Provider::OpenAiCompatible && base_url.is_none() {
            return Err(LlmError::NotConfigured(
                "openai-compatible needs KILN_LLM_BASE_URL (e.g. http://127.0.0.1:8000/v1)".into(),
            ));
        }
        let api_key = provider
            .key_variable()
            .and_then(&get)
            .map(secrecy::SecretString::from);
        if api_key.is_none()
            && matches!(
                provider,
                Provider::OpenAi | Provider::Anthropic | Provider::Gemini
            )
        {
            return Err(LlmError::NotConfigured(format!(
                "{} is not set (the key for {spec})",
                provider.key_variable().unwrap_or_default()
            )));
        }
        let timeout = get("KILN_LLM_TIMEOUT")
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .map_or(Duration::from_secs(120), Duration::from_secs_f64);
        let mut retry = RetryPolicy::default();
        if let Some(attempts) = get("KILN_LLM_RETRIES").and_then(|v| v.parse::<u32>().ok()) {
            retry.attempts = attempts.clamp(1, 10);
        }
        if let Some(ms) = get("KILN_LLM_RETRY_DELAY_MS").and_then(|v| v.parse::<u64>().ok()) {
            retry.base_delay = Duration::from_millis(ms.min(60_000));
        }
        Ok(ModelConfig {
            provider,
            model,
            base_url,
            api_key,
            timeout,
            retry,
        })
    }
}

/// Calls `model` with retries: rate limits, server errors, timeouts and network failures are
/// retried with exponential backoff (a provider's `Retry-After` is not visible through every
/// protocol, so the backoff is ours); each attempt is bounded by `timeout`. A streamed call is
/// retried only if nothing was streamed yet.
pub async fn complete_with_retries(
    model: &dyn ChatModel,
    request: &ModelRequest,
    events: Option<&UnboundedSender<ModelEvent>>,
    timeout: Duration,
    retry: RetryPolicy,
) -> Result<ModelReply, LlmError> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let result = match tokio::time::timeout(timeout, model.complete(request, events)).await {
            Ok(result) => result,
            Err(_) => Err(LlmError::Timeout(timeout)),
        };
        match result {
            Err(error) if error.retryable() && attempt < retry.attempts.max(1) => {
                let delay = retry.base_delay * 2u32.saturating_pow(attempt - 1);
                tracing::warn!(target: "kiln::llm", model = %model.name(), attempt, "model call failed, retrying in {delay:?}: {error}");
                tokio::time::sleep(delay).await;
            }
            Err(LlmError::RateLimited { .. }) => {
                return Err(LlmError::RateLimited { attempts: attempt });
            }
            Err(LlmError::Server {
                status, message, ..
            }) => {
                return Err(LlmError::Server {
                    status,
                    attempts: attempt,
                    message,
                });
            }
            other => return other,
        }
    }
}

/// Parses and validates a structured answer against `schema`: the answer is a JSON value,
/// possibly in a ```json fence; the error names the first problems (at most five).
pub fn check_structured(schema: &Value, text: &str) -> Result<Value, String> {
    let trimmed = text.trim();
    let body = trimmed
        .strip_prefix("```json")
        .or_else(|| trimmed.strip_prefix("```"))
        .and_then(|t| t.strip_suffix("```"))
        .unwrap_or(trimmed)
        .trim();
    let value: Value = serde_json::from_str(body).map_err(|e| format!("it is not JSON ({e})"))?;
    let validator = jsonschema::validator_for(schema)
        .map_err(|e| format!("the schema itself is invalid: {e}"))?;
    let problems: Vec<String> = validator
        .iter_errors(&value)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .take(5)
        .collect();
    if problems.is_empty() {
        Ok(value)
    } else {
        Err(problems.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_never_show_in_debug_output() {
        let config = config(&[
            ("KILN_LLM_MODEL", "openai:gpt-4o"),
            ("OPENAI_API_KEY", "sk-very-secret"),
        ])
        .unwrap();
        let shown = format!("{config:?}");
        assert!(!shown.contains("sk-very-secret"), "{shown}");
        assert!(shown.contains("REDACTED"), "{shown}");
    }

    fn config(vars: &[(&str, &str)]) -> Result<ModelConfig, LlmError> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        ModelConfig::from_lookup(|name| {
            vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        })
    }

    #[test]
    fn configuration_comes_from_the_environment_with_clear_errors() {
        let c = config(&[
            ("KILN_LLM_MODEL", "openai:gpt-4o"),
            ("OPENAI_API_KEY", "sk-secret"),
        ])
        .unwrap();
        assert_eq!((c.provider, c.model.as_str()), (Provider::OpenAi, "gpt-4o"));
        assert!(
            !format!("{c:?}").contains("sk-secret"),
            "Debug must hide the key"
        );
        let c = config(&[("KILN_LLM_MODEL", "ollama:llama3.2")]).unwrap();
        assert_eq!(c.provider, Provider::Ollama);
        let c = config(&[
            ("KILN_LLM_MODEL", "openai-compatible:qwen"),
            ("KILN_LLM_BASE_URL", "http://127.0.0.1:9/v1"),
        ])
        .unwrap();
        assert_eq!(c.base_url.as_deref(), Some("http://127.0.0.1:9/v1"));

        for (vars, needle) in [
            (vec![], "KILN_LLM_MODEL"),
            (vec![("KILN_LLM_MODEL", "gpt-4o")], "no provider"),
            (vec![("KILN_LLM_MODEL", "acme:x")], "unknown provider"),
            (vec![("KILN_LLM_MODEL", "openai:")], "names no model"),
            (
                vec![("KILN_LLM_MODEL", "anthropic:claude")],
                "ANTHROPIC_API_KEY",
            ),
            (
                vec![("KILN_LLM_MODEL", "openai-compatible:m")],
                "KILN_LLM_BASE_URL",
            ),
        ] {
            let error = config(&vars).unwrap_err().to_string();
            assert!(error.contains(needle), "{vars:?}: {error}");
        }
    }
}
