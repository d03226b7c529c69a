//! `kiln bench --only agent`: the agent's own cost, measured two ways.
//!
//! - `agent_tool_round_trip`: the agent runs in this process against a model that answers at
//!   once (no network), asking for `print(1)` N times; the time per tool round trip is
//!   everything but the model: the tool call, the session turn in a worker, the history check,
//!   the events.
//! - `chat_first_event_after_first_token`: a real `kiln serve` process talks to the provider
//!   test server (in this process, OpenAI protocol, streaming); the figure is the time from
//!   the provider sending its answer to the client reading the first `text_delta` event.

use std::io::{BufRead, BufReader};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use kiln_llm::fake::{FakeProvider, Step};
use kiln_llm::{ChatModel, LlmError, ModelEvent, ModelReply, ModelRequest, ToolCall};
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedSender;

use crate::bench::{micros, summary};
use crate::bench_child::{Spawned, spawn};

/// A model that asks for `print(1)` `calls` times, then answers; it takes no time.
struct Instant1 {
    calls: usize,
    made: AtomicUsize,
}

#[async_trait::async_trait]
impl ChatModel for Instant1 {
    fn name(&self) -> String {
        "bench:instant".into()
    }

    async fn complete(
        &self,
        _request: &ModelRequest,
        _events: Option<&UnboundedSender<ModelEvent>>,
    ) -> Result<ModelReply, LlmError> {
        let n = self.made.fetch_add(1, Ordering::Relaxed);
        if n < self.calls {
            Ok(ModelReply {
                tool_calls: vec![ToolCall {
                    id: format!("call_{n}"),
                    name: "execute_code".into(),
                    // Different code each time, so the repeat guard does not stop it.
                    arguments: json!({"language": "python", "code": format!("print({n})")}),
                }],
                ..ModelReply::default()
            })
        } else {
            Ok(ModelReply {
                text: "done".into(),
                ..ModelReply::default()
            })
        }
    }
}

fn serve_with_model(fake: &FakeProvider) -> anyhow::Result<Spawned> {
    let data = tempfile::tempdir()?;
    let data_path = data.path().to_path_buf();
    spawn("serve", data, "/readyz", |command| {
        command
            .args([
                "serve",
                "--no-auth",
                "--rate-limit",
                "0",
                "--log-format",
                "json",
            ])
            .arg("--data-dir")
            .arg(&data_path)
            .env("KILN_LLM_MODEL", "openai-compatible:fake")
            .env("KILN_LLM_BASE_URL", &fake.base_url);
    })
}

/// Runs the agent measurements `want` selects into `report`.
pub fn run(
    want: &dyn Fn(&str) -> bool,
    iterations: usize,
    report: &mut serde_json::Map<String, Value>,
) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if want("agent_tool_round_trip") {
        let samples = rt.block_on(tool_round_trips(iterations))?;
        report.insert("agent_tool_round_trip".into(), summary(samples));
    }
    if want("chat_first_event") {
        let samples = chat_first_events(&rt, iterations)?;
        report.insert(
            "chat_first_event_after_first_token".into(),
            summary(samples),
        );
    }
    Ok(())
}

/// The agent's own time per tool round trip (the model answers at once), in µs.
async fn tool_round_trips(iterations: usize) -> anyhow::Result<Vec<f64>> {
    let data = tempfile::tempdir()?;
    let pool = kiln_executor::ExecutorPool::new(kiln_executor::PoolConfig::current_exe()?);
    let backends = crate::backends::Backends::register(pool, None);
    let config = kiln_server::ServerConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        data_dir: data.path().to_path_buf(),
        auth: false,
        rate_limit: 0,
        request_timeout: Duration::from_secs(600),
        public_hosts: Vec::new(),
        preview_domain: None,
        workflow_templates: None,
        catalogue: backends.catalogue.clone(),
        llm: kiln_llm::LlmEnv::from_env(),
        routes: Vec::new(),
        max_exec_ms: kiln_runtime::exec::MAX_EXEC_MS,
        max_life_ms: None,
        e2b: None,
        tiers: Vec::new(),
        cluster: None,
        admission: Default::default(),
        worker_jail: Default::default(),
        // Overhead, not quotas, is measured: every run keeps a session.
        quotas: kiln_runtime::quota::Quotas {
            sessions: 10_000,
            session_memory_bytes: u64::MAX,
            ..kiln_runtime::quota::Quotas::default()
        },
    };
    backends.start(None)?;
    let state = Arc::new(kiln_server::AppState::open(&config, backends.pools)?);
    let caller = kiln_runtime::auth::Caller {
        tenant: "bench".into(),
        key_id: "bench".into(),
        quotas: Default::default(),
        network_widen: false,
        admin: false,
    };
    let calls = 10;
    let limits = kiln_server::agent::AgentLimits {
        max_tool_calls: calls + 1,
        max_turns: calls + 2,
        ..Default::default()
    };
    let mut samples = Vec::new();
    for round in 0..(iterations / calls).max(5) + 1 {
        let model = Instant1 {
            calls,
            made: AtomicUsize::new(0),
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let input = kiln_server::agent::AgentInput {
            messages: vec![kiln_llm::Message::user("bench")],
            output_schema: None,
            ..Default::default()
        };
        let started = Instant::now();
        kiln_server::agent::run(&state, &caller, &model, input, &limits, &tx)
            .await
            .map_err(|e| anyhow::anyhow!("agent: {}", e.message()))?;
        let elapsed = started.elapsed();
        drop(tx);
        let mut results = 0;
        while let Some(event) = rx.recv().await {
            if let kiln_server::agent::AgentEvent::ToolResult {
                is_error, result, ..
            } = event
            {
                anyhow::ensure!(!is_error, "a tool call failed: {result}");
                results += 1;
            }
        }
        anyhow::ensure!(results == calls, "{results} tool results");
        // The first run opens the session and creates the sandbox: warm-up.
        if round > 0 {
            samples.push(micros(elapsed) / calls as f64);
        }
    }
    Ok(samples)
}

/// From the provider's first token to the chat's first SSE event, in µs.
fn chat_first_events(rt: &tokio::runtime::Runtime, iterations: usize) -> anyhow::Result<Vec<f64>> {
    let fake = rt.block_on(FakeProvider::start(vec![]))?;
    fake.repeat(Step::Text("The answer is 42.".into()));
    let server = serve_with_model(&fake)?;
    let mut samples = Vec::new();
    for i in 0..(iterations / 10).max(20) + 3 {
        let response = ureq::post(&format!("{}/api/v1/chat", server.base))
            .send_json(json!({"messages": [{"role": "user", "content": "hi"}]}))
            .context("POST /api/v1/chat")?;
        let mut first = None;
        for line in BufReader::new(response.into_reader()).lines() {
            let line = line?;
            if first.is_none() && line.starts_with("event: text_delta") {
                first = Some(Instant::now());
            }
        }
        let first = first.context("no text_delta event")?;
        let sent = fake
            .last_answer_at()
            .context("the provider never answered")?;
        if i >= 3 {
            samples.push(micros(first.saturating_duration_since(sent)));
        }
    }
    Ok(samples)
}
