//! A provider test server: a real HTTP server on 127.0.0.1 speaking OpenAI's chat-completions
//! and Anthropic's messages protocols (streaming and not, with tool calls), answering from a
//! script the test writes. Only for tests (feature `fake-provider`): it stands in for a paid
//! service, nothing else.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

/// One scripted answer.
#[derive(Debug, Clone)]
pub enum Step {
    /// Plain text.
    Text(String),
    /// Tool calls (id, name, arguments as raw JSON text, possibly malformed).
    Tools(Vec<(String, String, String)>),
    /// An HTTP error status.
    Status(u16),
    /// Never answer.
    Hang,
}

impl Step {
    /// One tool call with well-formed arguments.
    pub fn tool(id: &str, name: &str, arguments: Value) -> Step {
        Step::Tools(vec![(id.into(), name.into(), arguments.to_string())])
    }
}

#[derive(Default)]
struct Inner {
    script: VecDeque<Step>,
    requests: Vec<Value>,
    /// Answer every request without a scripted step with this one.
    repeat: Option<Step>,
    /// When the last answer was sent.
    answered: Option<std::time::Instant>,
}

/// The running server.
#[derive(Clone)]
pub struct FakeProvider {
    inner: Arc<Mutex<Inner>>,
    /// `http://127.0.0.1:PORT/v1`
    pub base_url: String,
    /// Delay before each streamed chunk.
    pub chunk_delay: Duration,
}

impl std::fmt::Debug for FakeProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeProvider")
            .field("base_url", &self.base_url)
            .finish()
    }
}

impl FakeProvider {
    /// Starts a server answering `script` in order.
    pub async fn start(script: Vec<Step>) -> std::io::Result<FakeProvider> {
        let inner = Arc::new(Mutex::new(Inner {
            script: script.into(),
            ..Inner::default()
        }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base_url = format!("http://{}/v1", listener.local_addr()?);
        let app = Router::new()
            .route("/v1/chat/completions", post(openai))
            .route("/v1/messages", post(anthropic))
            .with_state(inner.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(FakeProvider {
            inner,
            base_url,
            chunk_delay: Duration::ZERO,
        })
    }

    /// Answers every request past the script with `step`.
    pub fn repeat(&self, step: Step) {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).repeat = Some(step);
    }

    /// When the last answer left the server (for latency measurements).
    pub fn last_answer_at(&self) -> Option<std::time::Instant> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .answered
    }

    /// Every request body received so far.
    pub fn requests(&self) -> Vec<Value> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .requests
            .clone()
    }
}

fn next(inner: &Mutex<Inner>, body: Value) -> Step {
    let mut inner = inner.lock().unwrap_or_else(|e| e.into_inner());
    inner.requests.push(body);
    inner.answered = Some(std::time::Instant::now());
    match inner.script.pop_front() {
        Some(step) => step,
        None => inner
            .repeat
            .clone()
            .unwrap_or_else(|| Step::Text("(the script is over)".into())),
    }
}

fn sse(events: Vec<String>) -> Response {
    let body = events.concat();
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from(body))
        .unwrap_or_default()
}

async fn openai(State(inner): State<Arc<Mutex<Inner>>>, body: axum::body::Bytes) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let stream = body["stream"].as_bool().unwrap_or(false);
    let step = next(&inner, body);
    let usage = json!({"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18});
    match step {
        Step::Status(code) => error(code),
        Step::Hang => hang().await,
        Step::Text(text) if !stream => axum::Json(json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "fake",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": usage,
        }))
        .into_response(),
        Step::Tools(calls) if !stream => axum::Json(json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "fake",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls":
                calls.iter().map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})).collect::<Vec<_>>()
            }, "finish_reason": "tool_calls"}],
            "usage": usage,
        }))
        .into_response(),
        Step::Text(text) => {
            let chunk = |delta: Value, finish: Value| {
                format!(
                    "data: {}\n\n",
                    json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
                )
            };
            let mut events = vec![chunk(json!({"role": "assistant", "content": ""}), Value::Null)];
            for piece in split(&text) {
                events.push(chunk(json!({"content": piece}), Value::Null));
            }
            events.push(chunk(json!({}), json!("stop")));
            events.push(format!(
                "data: {}\n\n",
                json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "fake", "choices": [], "usage": usage})
            ));
            events.push("data: [DONE]\n\n".into());
            sse(events)
        }
        Step::Tools(calls) => {
            let chunk = |delta: Value, finish: Value| {
                format!(
                    "data: {}\n\n",
                    json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
                )
            };
            let mut events = vec![chunk(json!({"role": "assistant", "content": null}), Value::Null)];
            for (index, (id, name, args)) in calls.iter().enumerate() {
                events.push(chunk(
                    json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
                    Value::Null,
                ));
                for piece in split(args) {
                    events.push(chunk(
                        json!({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}),
                        Value::Null,
                    ));
                }
            }
            events.push(chunk(json!({}), json!("tool_calls")));
            events.push(format!(
                "data: {}\n\n",
                json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "fake", "choices": [], "usage": usage})
            ));
            events.push("data: [DONE]\n\n".into());
            sse(events)
        }
    }
}

async fn anthropic(State(inner): State<Arc<Mutex<Inner>>>, body: axum::body::Bytes) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let stream = body["stream"].as_bool().unwrap_or(false);
    let step = next(&inner, body);
    let blocks: Vec<Value> = match &step {
        Step::Text(text) => vec![json!({"type": "text", "text": text})],
        Step::Tools(calls) => calls
            .iter()
            .map(|(id, name, args)| {
                json!({"type": "tool_use", "id": id, "name": name,
                    "input": serde_json::from_str::<Value>(args).unwrap_or(json!({}))})
            })
            .collect(),
        Step::Status(code) => return error(*code),
        Step::Hang => return hang().await,
    };
    let stop = if matches!(step, Step::Tools(_)) {
        "tool_use"
    } else {
        "end_turn"
    };
    if !stream {
        return axum::Json(json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "fake",
            "content": blocks, "stop_reason": stop, "stop_sequence": null,
            "usage": {"input_tokens": 11, "output_tokens": 7},
        }))
        .into_response();
    }
    let event = |name: &str, data: Value| format!("event: {name}\ndata: {data}\n\n");
    let mut events = vec![event(
        "message_start",
        json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
            "content": [], "model": "fake", "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 11, "output_tokens": 1}}}),
    )];
    match &step {
        Step::Text(text) => {
            events.push(event("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
            for piece in split(text) {
                events.push(event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}})));
            }
            events.push(event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": 0}),
            ));
        }
        Step::Tools(calls) => {
            for (index, (id, name, args)) in calls.iter().enumerate() {
                events.push(event("content_block_start", json!({"type": "content_block_start", "index": index, "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}})));
                for piece in split(args) {
                    events.push(event("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": piece}})));
                }
                events.push(event(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": index}),
                ));
            }
        }
        _ => {}
    }
    events.push(event("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": 7}})));
    events.push(event("message_stop", json!({"type": "message_stop"})));
    sse(events)
}

/// Splits text in three pieces (on character boundaries), as a model streams it.
fn split(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let third = chars.len().div_ceil(3).max(1);
    chars.chunks(third).map(|c| c.iter().collect()).collect()
}

fn error(code: u16) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        axum::Json(json!({"error": {"message": format!("scripted {code}"), "type": "scripted"}})),
    )
        .into_response()
}

async fn hang() -> Response {
    tokio::time::sleep(Duration::from_secs(3600)).await;
    error(504)
}
