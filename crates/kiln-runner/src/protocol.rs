//! The wire format of `POST /execute`: the request a core framework sends, the response the
//! runner answers with, and the error body of transport failures. The JSON Schemas served at
//! `/schema/*.json` and checked in under `docs/runner/` are derived from these types.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// One call of `POST /execute`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(title = "UHLP runner request")]
pub struct ExecuteRequest {
    /// The caller's id for this request, echoed in the response. Required, a string.
    pub request_id: String,
    /// What triggered the request and its payload. Passed to the script unchanged.
    pub request_data: RequestData,
    /// Who is asking and what to run.
    pub context: RequestContext,
}

/// The payload of a request. Every field besides `source` is the caller's and passed on.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct RequestData {
    /// What triggered the request: `http` (an HTTP request to the application; the answer
    /// may become an `httpResponse`), `internal`, `queue`, `schedule`, `workflow`, or any
    /// other name (answered as `generic`). Required, a string.
    pub source: String,
    /// The rest of the payload (for `http`: `method`, `path`, `headers`, `query`, `body`…).
    #[serde(flatten)]
    pub fields: Map<String, Value>,
}

/// Who is asking and what to run.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RequestContext {
    /// The core framework's MCP tool endpoint (`http://` or `https://`): templates,
    /// workflows, runtime state, the LLM and logging are reached through it. Required.
    #[serde(rename = "mcp_endpoint")]
    pub mcp_endpoint: String,
    /// The application the request belongs to (logged, passed to MCP tools).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_id: Option<String>,
    /// The component to run; in JIT mode the script's name when `taskDetails.script` is
    /// absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub component_id: Option<String>,
    /// What to run and how.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_details: Option<TaskDetails>,
    /// The workflow this request belongs to, and how to drive it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workflow_info: Option<WorkflowInfo>,
    /// Anything else the framework sends; passed to the script unchanged.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The three ways the runner can serve a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Run a function of a script on the shared volume in a sandbox.
    Jit,
    /// Render a prompt template and ask the LLM through MCP.
    Llm,
    /// Drive a workflow of jit, llm, mcp and control steps.
    Workflow,
}

/// What to run. Without `mode`, the mode is inferred: a `workflow` (or
/// `workflowInfo.definition`) means workflow, a `template` means llm, anything else jit.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TaskDetails {
    /// `jit`, `llm` or `workflow`; inferred when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// JIT: the script, relative to the shared volume (`orders/create.py`, or `orders/create`
    /// to try `.py` then `.js`). Default: `context.componentId`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub script: Option<String>,
    /// JIT: the function to call with `(requestData, context)`. Default `handler`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<String>,
    /// JIT: the sandbox's deadline in milliseconds, at most the runner's `--timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// LLM: the prompt template's definition file, loaded with
    /// `core.state.getDefinitionFileContent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// LLM: parameters for `core.llm.generate` that override the template's `defaults`
    /// (`model`, `temperature`, `maxTokens`…).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llm: Option<Map<String, Value>>,
    /// Workflow: the workflow's definition file (YAML), loaded with
    /// `core.state.getDefinitionFileContent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workflow: Option<String>,
    /// Anything else; passed to the script unchanged.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// How to drive a workflow.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkflowInfo {
    /// The workflow's definition file when `taskDetails.workflow` is absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub definition: Option<String>,
    /// `full` (default): run from `startAt` to a terminal step in this request. `step`: run
    /// one step, keep the state with `core.state.setRuntimeValue`, answer `workflowStep`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution: Option<WorkflowExecution>,
    /// Step mode: the instance whose state to continue. Default: the request id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    /// Step mode: the step to run. Default: the stored next step, else `startAt`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_step: Option<String>,
    /// Anything else; passed to the script unchanged.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Whether a workflow request runs the whole workflow or one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WorkflowExecution {
    /// From `startAt` to a terminal step.
    Full,
    /// One step per request.
    Step,
}

/// The answer to `POST /execute` (HTTP 200).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(title = "UHLP runner response")]
pub struct ExecuteResponse {
    /// The request's `requestId`.
    pub request_id: String,
    /// How to read `data`.
    pub result_type: ResultType,
    /// The result: see `resultType`.
    pub data: ResultData,
    /// Measurements of this request.
    pub metrics: Vec<Metric>,
}

/// How to read a response's `data`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum ResultType {
    /// Any JSON value the script, the LLM or the workflow produced.
    Generic,
    /// An HTTP response for the application's caller (`source: http`).
    HttpResponse,
    /// An expected application failure: `data` is `{code, message, details}`.
    Error,
    /// A workflow step finished and the workflow goes on (step mode).
    WorkflowStep,
}

/// A response's `data`, by `resultType`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum ResultData {
    /// `httpResponse`.
    HttpResponse(HttpResponseData),
    /// `error`.
    Error(ErrorData),
    /// `workflowStep`.
    WorkflowStep(WorkflowStepData),
    /// `generic`: any JSON value.
    Generic(Value),
}

/// An HTTP response for the application's caller.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HttpResponseData {
    /// The HTTP status, 100..=599.
    pub status: u16,
    /// Response headers (names as the script gave them).
    pub headers: Map<String, Value>,
    /// The body: text, or base64 when `bodyEncoding` is `base64`.
    pub body: String,
    /// How `body` is encoded.
    pub body_encoding: BodyEncoding,
}

/// How an HTTP body is carried in JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BodyEncoding {
    /// UTF-8 text.
    Utf8,
    /// Bytes, base64 (standard alphabet, padded).
    Base64,
}

/// An expected application failure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorData {
    /// A stable code: `SCRIPT_NOT_FOUND`, `INVALID_SCRIPT_NAME`, `FUNCTION_NOT_FOUND`,
    /// `SCRIPT_FAILED`, `BAD_OUTPUT`, `TIMEOUT`, `MEMORY_LIMIT`, `SANDBOX_CRASHED`, `FUEL_EXHAUSTED`,
    /// `INVALID_TASK`, `TEMPLATE_NOT_FOUND`, `TEMPLATE_INVALID`, `TEMPLATE_RENDER_FAILED`,
    /// `LLM_BAD_REPLY`, `OUTPUT_SCHEMA_MISMATCH`, `WORKFLOW_NOT_FOUND`, `WORKFLOW_INVALID`,
    /// `WORKFLOW_STATE_INVALID`, `WORKFLOW_EXPRESSION_FAILED`, `STEP_BUDGET_EXCEEDED`, `MCP_UNAVAILABLE`, `MCP_HTTP_ERROR`, `MCP_TOOL_ERROR`,
    /// `MCP_BAD_REPLY`, or a script's own code.
    pub code: String,
    /// One line for people.
    pub message: String,
    /// Structured context (for script failures: `exitCode`, `stderrTail`).
    pub details: Value,
}

/// A workflow step's report in step mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkflowStepData {
    /// The workflow's `id` (or its definition file).
    pub workflow_id: String,
    /// The instance whose state was stored.
    pub instance_id: String,
    /// The step that ran.
    pub step: String,
    /// `succeeded`, or `failed` when the failure transition was taken.
    pub status: String,
    /// The step's output (its error for `failed`).
    pub output: Value,
    /// The step the next request runs.
    pub next_step: String,
    /// Steps run so far in this instance.
    pub steps_executed: u32,
}

/// One measurement, after OpenTelemetry's data model: a name, a unit (UCUM), a value and
/// attributes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Metric {
    /// `execution.duration`, `sandbox.duration`, `mcp.calls`, `llm.tokens.input`,
    /// `llm.tokens.output`, `workflow.steps`.
    pub name: String,
    /// `ms` for durations, `1` for counts, `{token}` for tokens.
    pub unit: String,
    /// The value.
    pub value: f64,
    /// Attributes such as `mode`.
    pub attributes: Map<String, Value>,
}

/// The body of every non-200 answer (400, 404, 405, 406, 413, 415, 500, 503, 504): kiln's
/// error envelope (`kiln_http::HttpError`, as `kiln serve` and `kiln rest` answer it) with
/// the protocol's `error.field` and `requestId`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(title = "UHLP runner transport error")]
pub struct HttpErrorBody {
    /// What went wrong.
    pub error: HttpError,
    /// The request's `requestId` when it could be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// What went wrong with a request as a whole.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct HttpError {
    /// `MALFORMED_JSON`, `INVALID_FIELD`, `UNSUPPORTED_MEDIA_TYPE`, `NOT_ACCEPTABLE`,
    /// `BODY_TOO_LARGE`, `NOT_FOUND`, `METHOD_NOT_ALLOWED`, `INVALID_REQUEST`, `NOT_READY`,
    /// `REQUEST_TIMEOUT`, `INTERNAL`.
    pub code: String,
    /// One line for people.
    pub message: String,
    /// For programs; often empty. For `INVALID_FIELD`: `{"field": ...}` as `field`.
    pub details: Map<String, Value>,
    /// For `INVALID_FIELD`: the field, as a dotted path (`requestData.source`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The request's `requestId` when it could be read (as the top-level `requestId`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

impl Metric {
    /// A measurement without attributes.
    pub fn new(name: &str, unit: &str, value: f64) -> Metric {
        Metric {
            name: name.to_owned(),
            unit: unit.to_owned(),
            value,
            attributes: Map::new(),
        }
    }
}

/// A request body that is JSON but not a valid request: which field, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// The field as a dotted path.
    pub field: String,
    /// One line for people.
    pub message: String,
}

fn field_error(field: &str, message: impl Into<String>) -> FieldError {
    FieldError {
        field: field.to_owned(),
        message: message.into(),
    }
}

/// The fields every request must carry, each with its JSON type; checked first so a 400
/// names the field.
const REQUIRED: &[(&str, &str)] = &[
    ("requestId", "string"),
    ("requestData", "object"),
    ("requestData.source", "string"),
    ("context", "object"),
    ("context.mcp_endpoint", "string"),
];

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Checks a parsed body and reads it into an [`ExecuteRequest`]. The error names the first
/// missing or mistyped field.
pub fn parse_request(body: Value) -> Result<ExecuteRequest, FieldError> {
    if !body.is_object() {
        return Err(field_error(
            "",
            format!("the body must be a JSON object, not {}", json_type(&body)),
        ));
    }
    for (path, wanted) in REQUIRED {
        let pointer = format!("/{}", path.replace('.', "/"));
        match body.pointer(&pointer) {
            None => return Err(field_error(path, format!("{path} is missing"))),
            Some(value) if json_type(value) != *wanted => {
                let article = if wanted.starts_with('o') { "an" } else { "a" };
                return Err(field_error(
                    path,
                    format!(
                        "{path} must be {article} {wanted}, not {}",
                        json_type(value)
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    let endpoint = body["context"]["mcp_endpoint"].as_str().unwrap_or_default();
    match reqwest::Url::parse(endpoint) {
        Ok(url) if matches!(url.scheme(), "http" | "https") && url.host().is_some() => {}
        _ => {
            return Err(field_error(
                "context.mcp_endpoint",
                format!("context.mcp_endpoint must be an http(s) URL, not {endpoint:?}"),
            ));
        }
    }
    serde_path_to_error::deserialize(body).map_err(|error| {
        let field = error.path().to_string();
        let message = format!("{field}: {}", error.inner());
        FieldError { field, message }
    })
}

/// The JSON Schema of a request.
pub fn request_schema() -> Value {
    schemars::schema_for!(ExecuteRequest).to_value()
}

/// The JSON Schema of a 200 response.
pub fn response_schema() -> Value {
    schemars::schema_for!(ExecuteResponse).to_value()
}

/// The JSON Schema of a non-200 answer.
pub fn error_schema() -> Value {
    schemars::schema_for!(HttpErrorBody).to_value()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn valid() -> Value {
        json!({
            "requestId": "r1",
            "requestData": {"source": "http", "body": {"a": 1}},
            "context": {"mcp_endpoint": "http://127.0.0.1:9/mcp", "appId": "app",
                        "taskDetails": {"function": "main", "custom": true}}
        })
    }

    #[test]
    fn a_valid_request_round_trips_its_extra_fields() {
        let request = parse_request(valid()).unwrap();
        assert_eq!(request.request_id, "r1");
        assert_eq!(request.request_data.fields["body"], json!({"a": 1}));
        let details = request.context.task_details.clone().unwrap();
        assert_eq!(details.function.as_deref(), Some("main"));
        assert_eq!(details.extra["custom"], json!(true));
        let back = serde_json::to_value(&request.request_data).unwrap();
        assert_eq!(back, json!({"source": "http", "body": {"a": 1}}));
    }

    #[test]
    fn each_required_field_is_named() {
        for (path, _) in REQUIRED {
            let mut body = valid();
            let (parent, leaf) = match path.rsplit_once('.') {
                Some((parent, leaf)) => (format!("/{parent}"), leaf),
                None => (String::new(), *path),
            };
            body.pointer_mut(&parent)
                .unwrap()
                .as_object_mut()
                .unwrap()
                .remove(leaf);
            let error = parse_request(body).unwrap_err();
            assert_eq!(error.field, *path);
            assert_eq!(error.message, format!("{path} is missing"));

            let mut body = valid();
            *body
                .pointer_mut(&format!("/{}", path.replace('.', "/")))
                .unwrap() = json!(7);
            let error = parse_request(body).unwrap_err();
            assert_eq!(error.field, *path);
            assert!(error.message.contains("not number"), "{}", error.message);
        }
    }

    #[test]
    fn optional_fields_are_named_when_mistyped() {
        let mut body = valid();
        body["context"]["taskDetails"]["function"] = json!(5);
        let error = parse_request(body).unwrap_err();
        assert_eq!(error.field, "context.taskDetails.function");
        let mut body = valid();
        body["context"]["mcp_endpoint"] = json!("file:///etc/passwd");
        assert_eq!(
            parse_request(body).unwrap_err().field,
            "context.mcp_endpoint"
        );
    }
}
