//! The runtime behind `POST /execute`: chooses the mode, runs it, and turns what came of it
//! into a response with metrics. No HTTP here.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kiln_runtime::Executors;
use serde_json::{Map, Value, json};

use crate::mcp::{Level, Logger, McpClient, McpError};
use crate::protocol::{
    BodyEncoding, ErrorData, ExecuteRequest, HttpResponseData, Metric, Mode, ResultData,
    ResultType, WorkflowStepData,
};

/// How the runner runs: one documented struct (see docs/runner.md for the environment
/// variables that fill it).
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    /// Address to listen on. Default `0.0.0.0:8080` (`UHLP_SANDBOX_PORT` sets the port).
    pub listen: std::net::SocketAddr,
    /// The shared volume holding JIT scripts, mounted read-only at `/app` in the sandbox.
    /// Without it, JIT requests fail with `SCRIPT_NOT_FOUND`.
    pub scripts: Option<PathBuf>,
    /// Longest sandbox run in milliseconds (a request may ask for less). Default 10 000.
    pub timeout_ms: u64,
    /// Memory cap of a sandbox in bytes. Default 256 MiB.
    pub memory_bytes: u64,
    /// Largest request body in bytes; larger ones get 413. Default 10 MiB.
    pub max_body_bytes: usize,
    /// Deadline of one MCP call. Default 30 s.
    pub mcp_timeout: Duration,
    /// Deadline of one whole request; past it the answer is 504. Default 300 s.
    pub request_timeout: Duration,
    /// Steps a workflow may run per request (or per instance in step mode) unless its
    /// definition asks for fewer. Default 50.
    pub max_workflow_steps: u32,
    /// Lowest level sent to `core.framework.logFrameworkMessage`. Default info.
    pub log_level: Level,
}

impl Default for RunnerConfig {
    fn default() -> Self {
        RunnerConfig {
            listen: ([0, 0, 0, 0], 8080).into(),
            scripts: None,
            timeout_ms: 10_000,
            memory_bytes: 256 << 20,
            max_body_bytes: 10 << 20,
            mcp_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(300),
            max_workflow_steps: 50,
            log_level: Level::Info,
        }
    }
}

/// An expected application failure, answered as `resultType: error`.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub code: String,
    pub message: String,
    pub details: Value,
}

impl Failure {
    pub fn new(code: &str, message: impl Into<String>, details: Value) -> Failure {
        Failure {
            code: code.to_owned(),
            message: message.into(),
            details,
        }
    }
}

impl From<McpError> for Failure {
    fn from(error: McpError) -> Failure {
        Failure::new(error.code(), error.to_string(), error.details())
    }
}

/// Why a request could not be served at all (answered with HTTP 500).
#[derive(Debug, thiserror::Error)]
pub enum InternalError {
    /// The executors failed (not the script).
    #[error("the sandbox executor failed: {0}")]
    Executor(#[source] kiln_runtime::RuntimeError),
    /// The runner task panicked.
    #[error("the runner failed unexpectedly: {0}")]
    Panic(String),
}

/// What a step or mode produced, or how it failed.
#[derive(Debug)]
pub enum RunError {
    /// Answered as `resultType: error`.
    Failed(Failure),
    /// Answered with HTTP 500.
    Internal(InternalError),
}

impl From<Failure> for RunError {
    fn from(failure: Failure) -> RunError {
        RunError::Failed(failure)
    }
}

impl From<McpError> for RunError {
    fn from(error: McpError) -> RunError {
        RunError::Failed(error.into())
    }
}

/// What a mode produced.
#[derive(Debug)]
pub enum Produced {
    /// A final value, shaped by `requestData.source`.
    Value(Value),
    /// A workflow step's report (step mode).
    Step(WorkflowStepData),
}

/// The runner: the runtime's executors, the MCP client, the logger and the configuration.
#[derive(Debug)]
pub struct Runner {
    pub config: RunnerConfig,
    /// Scripts run as one-shots on the runtime's executors (routed by language to the
    /// preferred template's backend).
    pub executors: Executors,
    pub mcp: McpClient,
    pub logger: Logger,
    ready: AtomicBool,
}

/// One request in flight: who asks, and its counters.
#[derive(Debug)]
pub struct Call {
    pub request: ExecuteRequest,
    pub endpoint: Arc<str>,
    pub mcp_calls: AtomicU64,
    pub tokens_in: AtomicU64,
    pub tokens_out: AtomicU64,
    pub sandbox_us: AtomicU64,
    pub steps: AtomicU64,
}

impl Call {
    /// `context.taskDetails`, or an empty one.
    pub fn task_details(&self) -> crate::protocol::TaskDetails {
        self.request
            .context
            .task_details
            .clone()
            .unwrap_or_default()
    }

    /// `requestData` as JSON.
    pub fn request_data(&self) -> Value {
        serde_json::to_value(&self.request.request_data).unwrap_or(Value::Null)
    }

    /// `context` as JSON.
    pub fn context(&self) -> Value {
        serde_json::to_value(&self.request.context).unwrap_or(Value::Null)
    }

    /// The fields every MCP call and log line carries.
    pub fn ids(&self) -> Map<String, Value> {
        let context = &self.request.context;
        let mut ids = Map::new();
        ids.insert("appId".into(), json!(context.app_id));
        ids.insert("componentId".into(), json!(context.component_id));
        ids.insert("requestId".into(), json!(self.request.request_id));
        ids
    }
}

impl Runner {
    /// A runner over `executors`; needs a tokio runtime (the logger runs on it).
    pub fn new(config: RunnerConfig, executors: Executors) -> Result<Runner, reqwest::Error> {
        let mcp = McpClient::new(config.mcp_timeout)?;
        let logger = Logger::start(mcp.clone(), config.log_level);
        Ok(Runner {
            config,
            executors,
            mcp,
            logger,
            ready: AtomicBool::new(false),
        })
    }

    /// Whether the runner can serve requests: warmed up, and its shared volume readable.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
            && self
                .config
                .scripts
                .as_ref()
                .is_none_or(|dir| std::fs::read_dir(dir).is_ok())
    }

    /// Starts the workers and runs one sandbox of each language, so the first request is
    /// as fast as the others; then [`Runner::is_ready`] turns true.
    pub async fn warm_up(&self) -> Result<(), InternalError> {
        self.executors
            .pools
            .start_all()
            .map_err(|e| InternalError::Executor(e.into()))?;
        for language in kiln_core::Language::WASM {
            let request = kiln_core::ExecRequest::new(language, "");
            self.executors
                .run_once(request)
                .await
                .map_err(InternalError::Executor)?;
        }
        self.ready.store(true, Ordering::Release);
        Ok(())
    }

    /// Calls an MCP tool for `call`, counting it.
    pub async fn mcp(&self, call: &Call, tool: &str, params: Value) -> Result<Value, McpError> {
        call.mcp_calls.fetch_add(1, Ordering::Relaxed);
        self.log(call, Level::Debug, format!("calling {tool}"), None);
        self.mcp.call(&call.endpoint, tool, params).await
    }

    /// Sends a log line to the framework in the background.
    pub fn log(&self, call: &Call, level: Level, message: String, step: Option<&str>) {
        if !self.logger.enabled(level) {
            return;
        }
        let mut fields = call.ids();
        fields.insert("step".into(), json!(step));
        self.logger
            .log(&call.endpoint, level, message, Value::Object(fields));
    }

    /// Serves one request; `Err` only for failures of the runner itself.
    pub async fn execute(
        &self,
        request: ExecuteRequest,
    ) -> Result<crate::protocol::ExecuteResponse, InternalError> {
        let started = Instant::now();
        let call = Call {
            endpoint: Arc::from(request.context.mcp_endpoint.as_str()),
            request,
            mcp_calls: AtomicU64::new(0),
            tokens_in: AtomicU64::new(0),
            tokens_out: AtomicU64::new(0),
            sandbox_us: AtomicU64::new(0),
            steps: AtomicU64::new(0),
        };
        let mode = mode_of(&call.request);
        let produced = match mode {
            Mode::Jit => crate::jit::run_task(self, &call).await,
            Mode::Llm => crate::template::run_task(self, &call).await,
            Mode::Workflow => crate::workflow::run_task(self, &call).await,
        };
        let (result_type, data) = match produced {
            Ok(Produced::Value(value)) => shape(&call.request.request_data.source, value),
            Ok(Produced::Step(step)) => (ResultType::WorkflowStep, ResultData::WorkflowStep(step)),
            Err(RunError::Failed(failure)) => {
                let data = ErrorData {
                    code: failure.code,
                    message: failure.message,
                    details: failure.details,
                };
                (ResultType::Error, ResultData::Error(data))
            }
            Err(RunError::Internal(error)) => {
                self.log(&call, Level::Error, error.to_string(), None);
                return Err(error);
            }
        };
        let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
        let (level, outcome) = match &data {
            ResultData::Error(error) => (Level::Warn, format!("failed with {}", error.code)),
            _ => (Level::Info, "succeeded".to_owned()),
        };
        self.log(
            &call,
            level,
            format!(
                "{} request {outcome} in {elapsed_ms:.1} ms",
                mode_name(mode)
            ),
            None,
        );
        Ok(crate::protocol::ExecuteResponse {
            request_id: call.request.request_id.clone(),
            result_type,
            data,
            metrics: metrics(&call, mode, elapsed_ms),
        })
    }
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Jit => "jit",
        Mode::Llm => "llm",
        Mode::Workflow => "workflow",
    }
}

/// The mode of a request: `taskDetails.mode`, else a named workflow means workflow, a
/// named template llm, anything else jit.
pub fn mode_of(request: &ExecuteRequest) -> Mode {
    let details = request.context.task_details.clone().unwrap_or_default();
    let definition = request
        .context
        .workflow_info
        .as_ref()
        .and_then(|info| info.definition.as_ref());
    match details.mode {
        Some(mode) => mode,
        None if details.workflow.is_some() || definition.is_some() => Mode::Workflow,
        None if details.template.is_some() => Mode::Llm,
        None => Mode::Jit,
    }
}

fn metrics(call: &Call, mode: Mode, elapsed_ms: f64) -> Vec<Metric> {
    let count = |counter: &AtomicU64| counter.load(Ordering::Relaxed) as f64;
    let mut duration = Metric::new("execution.duration", "ms", round3(elapsed_ms));
    duration
        .attributes
        .insert("mode".into(), json!(mode_name(mode)));
    let mut list = vec![
        duration,
        Metric::new(
            "sandbox.duration",
            "ms",
            round3(count(&call.sandbox_us) / 1e3),
        ),
        Metric::new("mcp.calls", "1", count(&call.mcp_calls)),
    ];
    if mode != Mode::Jit {
        list.push(Metric::new(
            "llm.tokens.input",
            "{token}",
            count(&call.tokens_in),
        ));
        list.push(Metric::new(
            "llm.tokens.output",
            "{token}",
            count(&call.tokens_out),
        ));
    }
    if mode == Mode::Workflow {
        list.push(Metric::new("workflow.steps", "1", count(&call.steps)));
    }
    list
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Whether a source is an HTTP request to the application.
pub fn is_http_source(source: &str) -> bool {
    matches!(
        source.to_ascii_lowercase().as_str(),
        "http" | "httprequest" | "http_request" | "http-request"
    )
}

/// Turns a produced value into a result by the request's source:
///
/// - `{"error": {"code": "...", "message": "..."}}` (the only key) is an application error;
/// - for an HTTP source, an object with an integer `status` is an `httpResponse` (`headers`
///   default `{}`, a non-string `body` is sent as JSON, `bodyEncoding` default `utf8`);
/// - anything else is `generic`.
pub fn shape(source: &str, value: Value) -> (ResultType, ResultData) {
    if let Some(error) = as_app_error(&value) {
        return (ResultType::Error, ResultData::Error(error));
    }
    if is_http_source(source)
        && let Some(response) = as_http_response(&value)
    {
        return (ResultType::HttpResponse, ResultData::HttpResponse(response));
    }
    (ResultType::Generic, ResultData::Generic(value))
}

fn as_app_error(value: &Value) -> Option<ErrorData> {
    let fields = value.as_object().filter(|f| f.len() == 1)?;
    let error = fields.get("error")?.as_object()?;
    let code = error.get("code")?.as_str()?;
    Some(ErrorData {
        code: code.to_owned(),
        message: error
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        details: error.get("details").cloned().unwrap_or(Value::Null),
    })
}

fn as_http_response(value: &Value) -> Option<HttpResponseData> {
    let fields = value.as_object()?;
    let status = u16::try_from(fields.get("status")?.as_u64()?).ok()?;
    if !(100..=599).contains(&status) {
        return None;
    }
    let mut headers = match fields.get("headers") {
        Some(Value::Object(headers)) => headers.clone(),
        None | Some(Value::Null) => Map::new(),
        Some(_) => return None,
    };
    let encoding = match fields.get("bodyEncoding").and_then(Value::as_str) {
        Some("base64") => BodyEncoding::Base64,
        _ => BodyEncoding::Utf8,
    };
    let body = match fields.get("body") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(text)) => text.clone(),
        Some(other) => {
            if !headers
                .keys()
                .any(|k| k.eq_ignore_ascii_case("content-type"))
            {
                headers.insert("content-type".into(), json!("application/json"));
            }
            other.to_string()
        }
    };
    Some(HttpResponseData {
        status,
        headers,
        body,
        body_encoding: encoding,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_sources_shape_http_responses() {
        let (kind, data) = shape("http", json!({"status": 201, "body": {"id": 7}}));
        assert_eq!(kind, ResultType::HttpResponse);
        let ResultData::HttpResponse(response) = data else {
            panic!("not an http response");
        };
        assert_eq!(response.status, 201);
        assert_eq!(response.body, r#"{"id":7}"#);
        assert_eq!(response.headers["content-type"], "application/json");
        assert_eq!(response.body_encoding, BodyEncoding::Utf8);

        let (kind, _) = shape("queue", json!({"status": 201}));
        assert_eq!(kind, ResultType::Generic);
        let (kind, _) = shape("http", json!({"status": "ok"}));
        assert_eq!(kind, ResultType::Generic);
    }

    #[test]
    fn a_lone_error_object_is_an_application_error() {
        let (kind, data) = shape(
            "http",
            json!({"error": {"code": "NOT_FOUND", "message": "no order 7"}}),
        );
        assert_eq!(kind, ResultType::Error);
        let ResultData::Error(error) = data else {
            panic!("not an error");
        };
        assert_eq!(error.code, "NOT_FOUND");
        assert_eq!(error.message, "no order 7");
        let (kind, _) = shape("http", json!({"error": {"code": "X"}, "other": 1}));
        assert_eq!(kind, ResultType::Generic);
    }
}
