//! Calls to the core framework's MCP tools: `POST {mcp_endpoint}` with
//! `{"tool": NAME, "params": {...}}`, answered by `200 {"result": ...}` or an error body
//! `{"error": {"code", "message"}}`.
//!
//! Reads (`core.state.getDefinitionFileContent`, `core.state.getRuntimeValue`), the
//! idempotent `core.state.setRuntimeValue` and logging are retried up to
//! [`MAX_ATTEMPTS`] times on network errors and 502/503/504; everything else (the LLM, a
//! workflow's own tools) only when the connection could not be made, so nothing runs twice.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::sync::{Semaphore, mpsc};

/// Attempts per call, for calls that may be retried.
pub const MAX_ATTEMPTS: u32 = 3;

/// An MCP call that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum McpError {
    /// the endpoint could not be reached
    #[error("the MCP endpoint could not be reached for {tool}: {detail}")]
    Unavailable { tool: String, detail: String },
    /// the endpoint answered with an HTTP error status
    #[error("the MCP endpoint answered {tool} with HTTP {status}")]
    Http {
        tool: String,
        status: u16,
        body: String,
    },
    /// the tool answered with an error body
    #[error("the MCP tool {tool} failed: {code}: {message}")]
    Tool {
        tool: String,
        code: String,
        message: String,
    },
    /// the answer was not the JSON the protocol promises
    #[error("the MCP endpoint's answer to {tool} is not valid: {detail}")]
    BadReply { tool: String, detail: String },
}

impl McpError {
    /// The stable code of this failure in an error result.
    pub fn code(&self) -> &'static str {
        match self {
            McpError::Unavailable { .. } => "MCP_UNAVAILABLE",
            McpError::Http { .. } => "MCP_HTTP_ERROR",
            McpError::Tool { .. } => "MCP_TOOL_ERROR",
            McpError::BadReply { .. } => "MCP_BAD_REPLY",
        }
    }

    /// Structured details for an error result.
    pub fn details(&self) -> Value {
        match self {
            McpError::Unavailable { tool, detail } => json!({"tool": tool, "cause": detail}),
            McpError::Http { tool, status, body } => {
                json!({"tool": tool, "status": status, "body": tail(body, 500)})
            }
            McpError::Tool {
                tool,
                code,
                message,
            } => json!({"tool": tool, "toolCode": code, "toolMessage": message}),
            McpError::BadReply { tool, detail } => json!({"tool": tool, "cause": detail}),
        }
    }

    /// Whether the tool said the thing asked for does not exist (a `NOT_FOUND`-like code).
    pub fn is_not_found(&self) -> bool {
        matches!(self, McpError::Tool { code, .. } if code.to_ascii_uppercase().contains("NOT_FOUND"))
            || matches!(self, McpError::Http { status: 404, .. })
    }
}

/// The last `max` bytes of `text`, on a character boundary.
pub fn tail(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].to_owned()
}

/// Whether a failed attempt may be repeated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Reads and idempotent writes: network errors and 502/503/504 are retried.
    Safe,
    /// Everything else: only a connection that was never made is retried.
    ConnectOnly,
}

/// The retry class of a tool.
pub fn retry_for(tool: &str) -> Retry {
    match tool {
        "core.state.getDefinitionFileContent"
        | "core.state.getRuntimeValue"
        | "core.state.setRuntimeValue"
        | "core.framework.logFrameworkMessage" => Retry::Safe,
        _ => Retry::ConnectOnly,
    }
}

/// An HTTP client for MCP tool calls (shared; connections are kept alive).
#[derive(Debug, Clone)]
pub struct McpClient {
    http: reqwest::Client,
}

impl McpClient {
    /// A client whose calls time out after `timeout` (connecting after at most 2 s).
    pub fn new(timeout: Duration) -> Result<McpClient, reqwest::Error> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2).min(timeout))
            .timeout(timeout)
            .no_proxy()
            .build()?;
        Ok(McpClient { http })
    }

    /// Calls `tool` with `params` and returns its `result`.
    pub async fn call(&self, endpoint: &str, tool: &str, params: Value) -> Result<Value, McpError> {
        let retry = retry_for(tool);
        let body = json!({"tool": tool, "params": params});
        let mut attempt = 1;
        loop {
            match self.attempt(endpoint, tool, &body).await {
                Ok(value) => return Ok(value),
                Err((error, connect)) => {
                    let again = match retry {
                        Retry::Safe => matches!(
                            &error,
                            McpError::Unavailable { .. }
                                | McpError::Http {
                                    status: 502..=504,
                                    ..
                                }
                        ),
                        Retry::ConnectOnly => connect,
                    };
                    if !again || attempt >= MAX_ATTEMPTS {
                        return Err(error);
                    }
                    tokio::time::sleep(Duration::from_millis(25 << attempt)).await;
                    attempt += 1;
                }
            }
        }
    }

    /// One attempt; the flag says whether the failure was a connection never made.
    async fn attempt(
        &self,
        endpoint: &str,
        tool: &str,
        body: &Value,
    ) -> Result<Value, (McpError, bool)> {
        let unavailable = |e: reqwest::Error| {
            let connect = e.is_connect();
            let mut detail = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                detail = format!("{detail}: {cause}");
                source = cause.source();
            }
            let error = McpError::Unavailable {
                tool: tool.to_owned(),
                detail,
            };
            (error, connect)
        };
        let response = self
            .http
            .post(endpoint)
            .header("accept", "application/json")
            .json(body)
            .send()
            .await
            .map_err(unavailable)?;
        let status = response.status().as_u16();
        let text = response.text().await.map_err(unavailable)?;
        let bad = |detail: String| {
            let error = McpError::BadReply {
                tool: tool.to_owned(),
                detail,
            };
            (error, false)
        };
        let parsed: Option<Value> = serde_json::from_str(&text).ok();
        if let Some(error) = parsed
            .as_ref()
            .and_then(|v| v.get("error"))
            .filter(|e| !e.is_null())
        {
            let (code, message) = match error {
                Value::Object(fields) => (
                    fields.get("code").map_or("ERROR".to_owned(), plain),
                    fields.get("message").map_or(String::new(), plain),
                ),
                other => ("ERROR".to_owned(), plain(other)),
            };
            let error = McpError::Tool {
                tool: tool.to_owned(),
                code,
                message,
            };
            return Err((error, false));
        }
        if status != 200 {
            let error = McpError::Http {
                tool: tool.to_owned(),
                status,
                body: text,
            };
            return Err((error, false));
        }
        match parsed {
            Some(Value::Object(mut fields)) if fields.contains_key("result") => {
                Ok(fields.remove("result").unwrap_or(Value::Null))
            }
            Some(_) => Err(bad("the body has no \"result\"".to_owned())),
            None => Err(bad(format!("the body is not JSON: {:?}", tail(&text, 200)))),
        }
    }
}

/// A JSON value as plain text (strings without quotes).
fn plain(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

/// Log levels of `core.framework.logFrameworkMessage`, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
    /// Sends nothing.
    Off,
}

impl Level {
    /// Parses `debug`, `info`, `warn`, `error` or `off`.
    pub fn parse(text: &str) -> Option<Level> {
        match text.to_ascii_lowercase().as_str() {
            "debug" => Some(Level::Debug),
            "info" => Some(Level::Info),
            "warn" | "warning" => Some(Level::Warn),
            "error" => Some(Level::Error),
            "off" | "none" => Some(Level::Off),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Level::Debug => "debug",
            Level::Info => "info",
            Level::Warn => "warn",
            Level::Error => "error",
            Level::Off => "off",
        }
    }
}

/// One log message on its way to the framework.
#[derive(Debug)]
struct LogMessage {
    endpoint: Arc<str>,
    params: Value,
}

/// Sends log messages to `core.framework.logFrameworkMessage` in the background: a request
/// never waits for its logs, and a log that cannot be delivered is dropped (an endpoint
/// that refused a connection is skipped for [`DOWN_FOR`]).
#[derive(Debug, Clone)]
pub struct Logger {
    level: Level,
    queue: mpsc::Sender<LogMessage>,
}

/// How long an unreachable log endpoint is skipped.
pub const DOWN_FOR: Duration = Duration::from_secs(5);
/// Messages queued at most; more are dropped.
const QUEUE: usize = 4096;
/// Log deliveries in flight at most.
const IN_FLIGHT: usize = 16;

impl Logger {
    /// A logger sending messages at `level` and above with `client`. Needs a tokio runtime.
    pub fn start(client: McpClient, level: Level) -> Logger {
        let (queue, mut inbox) = mpsc::channel::<LogMessage>(QUEUE);
        tokio::spawn(async move {
            let down: Arc<Mutex<HashMap<Arc<str>, Instant>>> = Arc::default();
            let slots = Arc::new(Semaphore::new(IN_FLIGHT));
            while let Some(message) = inbox.recv().await {
                let skip = {
                    let down = down.lock().unwrap_or_else(|e| e.into_inner());
                    down.get(&message.endpoint)
                        .is_some_and(|since| since.elapsed() < DOWN_FOR)
                };
                if skip {
                    continue;
                }
                let Ok(permit) = slots.clone().acquire_owned().await else {
                    break;
                };
                let client = client.clone();
                let down = down.clone();
                tokio::spawn(async move {
                    let tool = "core.framework.logFrameworkMessage";
                    let sent = client.call(&message.endpoint, tool, message.params).await;
                    let mut down = down.lock().unwrap_or_else(|e| e.into_inner());
                    match sent {
                        Err(McpError::Unavailable { detail, .. }) => {
                            tracing::debug!(endpoint = %message.endpoint, %detail, "log delivery failed");
                            down.insert(message.endpoint, Instant::now());
                        }
                        Err(error) => tracing::debug!(%error, "log delivery refused"),
                        Ok(_) => {
                            down.remove(&message.endpoint);
                        }
                    }
                    drop(permit);
                });
            }
        });
        Logger { level, queue }
    }

    /// Whether messages at `level` are sent.
    pub fn enabled(&self, level: Level) -> bool {
        level != Level::Off && level >= self.level
    }

    /// Queues a message; `fields` carries `appId`, `componentId`, `requestId` and `step`.
    pub fn log(&self, endpoint: &Arc<str>, level: Level, message: String, mut fields: Value) {
        if !self.enabled(level) {
            return;
        }
        if let Value::Object(map) = &mut fields {
            map.insert("level".into(), json!(level.name()));
            map.insert("message".into(), json!(message));
            map.insert("source".into(), json!("kiln-runner"));
        }
        let _ = self.queue.try_send(LogMessage {
            endpoint: endpoint.clone(),
            params: fields,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_classes() {
        assert_eq!(retry_for("core.state.getRuntimeValue"), Retry::Safe);
        assert_eq!(retry_for("core.llm.generate"), Retry::ConnectOnly);
        assert_eq!(retry_for("custom.tool"), Retry::ConnectOnly);
    }

    #[test]
    fn tails_keep_characters_whole() {
        assert_eq!(tail("abcdef", 3), "def");
        assert_eq!(tail("ab", 3), "ab");
        assert_eq!(tail("aé", 1), "");
        assert_eq!(tail("aéb", 2), "b");
    }

    #[test]
    fn not_found_is_read_from_codes() {
        let error = McpError::Tool {
            tool: "t".into(),
            code: "not_found".into(),
            message: String::new(),
        };
        assert!(error.is_not_found());
        let error = McpError::Tool {
            tool: "t".into(),
            code: "DENIED".into(),
            message: String::new(),
        };
        assert!(!error.is_not_found());
    }
}
