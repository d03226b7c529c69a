//! The `kiln runner` routes and their error shapes, without sockets or processes: the router
//! is called with `tower::ServiceExt::oneshot`, over a pool whose workers serve the fake
//! backend in this process (`kiln_executor::fake`), with MCP logging off. The fake backend
//! runs no Python, so a JIT script reaches its sandbox and fails there; the answers of
//! scripts, templates and workflows are covered by the process-level tests in
//! crates/kiln/tests.

use kiln_core::template::{BackendKind, Catalogue, TemplateInfo};
use kiln_runtime::{Executors, Pools};
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode, header};
use kiln_executor::ExecutorPool;
use kiln_runner::protocol::HttpErrorBody;
use kiln_runner::{Level, Runner, RunnerConfig};
use serde_json::{Value, json};
use tower::ServiceExt;

type TestResult = Result<(), Box<dyn std::error::Error>>;

struct Harness {
    router: Router,
    runner: Arc<Runner>,
    scripts: tempfile::TempDir,
}

/// A runner over one in-process fake worker, bodies up to 1024 bytes, scripts in a
/// temporary folder holding `hello.py`.
fn harness() -> Harness {
    let scripts = tempfile::tempdir().expect("a temporary folder");
    std::fs::write(
        scripts.path().join("hello.py"),
        "def handler(data, context):\n    return {'hello': data['source']}\n",
    )
    .expect("a script");
    let config = RunnerConfig {
        scripts: Some(scripts.path().to_path_buf()),
        max_body_bytes: 1024,
        log_level: Level::Off,
        ..RunnerConfig::default()
    };
    let pool = ExecutorPool::new(kiln_executor::fake::pool_config(1));
    let mut javascript = TemplateInfo::example_python();
    javascript.id = "javascript".into();
    javascript.languages = vec![kiln_core::Language::JavaScript];
    let executors = Executors::new(
        Pools::new(BackendKind::Wasm, pool),
        Catalogue::new(vec![TemplateInfo::example_python(), javascript]),
    );
    let runner = Arc::new(Runner::new(config, executors).expect("a runner"));
    let router = kiln_runner::api::router(runner.clone());
    Harness {
        router,
        runner,
        scripts,
    }
}

#[derive(Debug)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    json: Value,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// This status and exactly this body, which is the protocol's error body: read into
    /// `HttpErrorBody` and written back, nothing is lost.
    fn assert_error(&self, status: StatusCode, body: Value) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(self.header("content-type"), Some("application/json"));
        assert_eq!(self.json, body);
        let typed: HttpErrorBody =
            serde_json::from_value(self.json.clone()).expect("the protocol's error body");
        assert_eq!(serde_json::to_value(typed).expect("JSON"), self.json);
    }
}

/// The envelope without a request id: `{"error": {"code", "message", "details": {}}}`.
fn envelope(code: &str, message: &str) -> Value {
    json!({"error": {"code": code, "message": message, "details": {}}})
}

impl Harness {
    async fn call(&self, request: Request<Body>) -> Answer {
        let response = self
            .router
            .clone()
            .oneshot(request)
            .await
            .expect("the router answers");
        let (parts, body) = response.into_parts();
        let bytes = axum::body::to_bytes(body, 16 << 20).await.expect("a body");
        Answer {
            status: parts.status,
            headers: parts.headers,
            json: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        }
    }

    async fn send(&self, method: &str, path: &str) -> Answer {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .body(Body::empty())
            .expect("a request");
        self.call(request).await
    }

    async fn execute(&self, body: impl Into<Body>) -> Answer {
        let request = Request::post("/execute")
            .header(header::CONTENT_TYPE, "application/json")
            .body(body.into())
            .expect("a request");
        self.call(request).await
    }
}

fn valid(request_id: &str) -> Value {
    json!({
        "requestId": request_id,
        "requestData": {"source": "queue"},
        "context": {"mcp_endpoint": "http://127.0.0.1:9/mcp", "componentId": "hello"},
    })
}

#[tokio::test]
async fn healthz_is_503_until_warm_then_200() -> TestResult {
    let runner = harness();
    runner.send("GET", "/healthz").await.assert_error(
        StatusCode::SERVICE_UNAVAILABLE,
        envelope(
            "NOT_READY",
            "the runner is starting or its shared volume cannot be read",
        ),
    );
    runner.runner.warm_up().await?;
    let warm = runner.send("GET", "/healthz").await;
    assert_eq!(
        (warm.status, warm.json),
        (StatusCode::OK, json!({"status": "ok"}))
    );
    Ok(())
}

#[tokio::test]
async fn load_code_checks_the_shared_volume() -> TestResult {
    let runner = harness();
    let loaded = runner.send("POST", "/_framework/load_code").await;
    assert_eq!(loaded.status, StatusCode::OK);
    assert_eq!(loaded.json["mode"], "interpreter");
    let folder = runner.scripts.path().to_path_buf();
    std::fs::remove_dir_all(&folder)?;
    runner
        .send("POST", "/_framework/load_code")
        .await
        .assert_error(
            StatusCode::SERVICE_UNAVAILABLE,
            envelope(
                "NOT_READY",
                &format!("the shared volume {} cannot be read", folder.display()),
            ),
        );
    Ok(())
}

#[tokio::test]
async fn the_schemas_are_served_and_an_unknown_one_is_404() -> TestResult {
    let runner = harness();
    for (name, schema) in kiln_runner::schemas() {
        let served = runner.send("GET", &format!("/schema/{name}")).await;
        assert_eq!(
            (served.status, served.json),
            (StatusCode::OK, schema),
            "{name}"
        );
    }
    let not_found = envelope(
        "NOT_FOUND",
        "no such route; the runner serves POST /execute, GET /healthz, POST \
         /_framework/load_code and GET /schema/{request,response,error,workflow,template}.json",
    );
    for path in ["/schema/nope.json", "/nowhere"] {
        runner
            .send("GET", path)
            .await
            .assert_error(StatusCode::NOT_FOUND, not_found.clone());
    }
    runner.send("GET", "/schema/%FF").await.assert_error(
        StatusCode::BAD_REQUEST,
        envelope("INVALID_REQUEST", "GET /schema/%FF: Bad Request"),
    );
    Ok(())
}

#[tokio::test]
async fn a_route_with_another_method_is_405_with_allow() -> TestResult {
    let runner = harness();
    for (method, path, allow) in [
        ("GET", "/execute", "POST"),
        ("PUT", "/execute", "POST"),
        ("POST", "/healthz", "GET,HEAD"),
        ("GET", "/_framework/load_code", "POST"),
        ("DELETE", "/schema/request.json", "GET,HEAD"),
    ] {
        let answer = runner.send(method, path).await;
        answer.assert_error(
            StatusCode::METHOD_NOT_ALLOWED,
            envelope(
                "METHOD_NOT_ALLOWED",
                &format!("{method} is not served on {path}; the Allow header lists what is"),
            ),
        );
        assert_eq!(answer.header("allow"), Some(allow), "{method} {path}");
    }
    Ok(())
}

#[tokio::test]
async fn a_body_that_is_not_json_is_415_and_an_answer_that_cannot_be_is_406() -> TestResult {
    let runner = harness();
    let body = valid("r1").to_string();
    for (content_type, named) in [(Some("text/plain"), "\"text/plain\""), (None, "none")] {
        let mut request = Request::post("/execute");
        if let Some(content_type) = content_type {
            request = request.header(header::CONTENT_TYPE, content_type);
        }
        runner
            .call(request.body(Body::from(body.clone()))?)
            .await
            .assert_error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                envelope(
                    "UNSUPPORTED_MEDIA_TYPE",
                    &format!("the body must be application/json (Content-Type: {named})"),
                ),
            );
    }
    let html_only = Request::post("/execute")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::ACCEPT, "text/html")
        .body(Body::from(body))?;
    runner.call(html_only).await.assert_error(
        StatusCode::NOT_ACCEPTABLE,
        envelope(
            "NOT_ACCEPTABLE",
            "the runner answers application/json only (Accept: text/html)",
        ),
    );
    Ok(())
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_declared_or_streamed() -> TestResult {
    let runner = harness();
    let too_large = envelope("BODY_TOO_LARGE", "the body is larger than 1024 bytes");
    let declared = Request::post("/execute")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, "2048")
        .body(Body::from(vec![b' '; 2048]))?;
    runner
        .call(declared)
        .await
        .assert_error(StatusCode::PAYLOAD_TOO_LARGE, too_large.clone());
    let chunks = (0..64).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b' '; 64])));
    let streamed = Body::from_stream(futures::stream::iter(chunks));
    runner
        .execute(streamed)
        .await
        .assert_error(StatusCode::PAYLOAD_TOO_LARGE, too_large);
    Ok(())
}

#[tokio::test]
async fn malformed_json_is_400() -> TestResult {
    let runner = harness();
    runner.execute("{\"requestId\": ").await.assert_error(
        StatusCode::BAD_REQUEST,
        envelope(
            "MALFORMED_JSON",
            "the body is not valid JSON: EOF while parsing a value at line 1 column 14",
        ),
    );
    Ok(())
}

#[tokio::test]
async fn a_missing_or_mistyped_field_is_400_naming_it_with_the_request_id() -> TestResult {
    let runner = harness();
    let mut missing = valid("r1");
    missing["requestData"]
        .as_object_mut()
        .ok_or("an object")?
        .remove("source");
    runner.execute(missing.to_string()).await.assert_error(
        StatusCode::BAD_REQUEST,
        json!({
            "error": {
                "code": "INVALID_FIELD",
                "message": "requestData.source is missing",
                "details": {"field": "requestData.source"},
                "field": "requestData.source",
                "request_id": "r1",
            },
            "requestId": "r1",
        }),
    );
    let mut mistyped = valid("r2");
    mistyped["context"]["taskDetails"] = json!({"timeoutMs": "soon"});
    let answer = runner.execute(mistyped.to_string()).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        answer.json["error"]["field"],
        "context.taskDetails.timeoutMs"
    );
    assert_eq!(answer.json["requestId"], "r2");
    // Without a readable requestId there is none in the body.
    runner.execute("[1]").await.assert_error(
        StatusCode::BAD_REQUEST,
        json!({
            "error": {
                "code": "INVALID_FIELD",
                "message": "the body must be a JSON object, not array",
                "details": {"field": ""},
                "field": "",
            },
        }),
    );
    Ok(())
}

/// A JIT request runs its script in a sandbox of the pool; the fake backend cannot run the
/// Python wrapper, so the answer is the protocol's `resultType: error`, HTTP 200.
#[tokio::test]
async fn a_jit_request_runs_its_script_in_a_sandbox() -> TestResult {
    let runner = harness();
    let answer = runner.execute(valid("r-jit").to_string()).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    assert_eq!(answer.header("x-request-id"), Some("r-jit"));
    assert_eq!(answer.json["requestId"], "r-jit");
    assert_eq!(answer.json["resultType"], "error");
    assert_eq!(
        answer.json["data"],
        json!({
            "code": "SCRIPT_FAILED",
            "message": "hello failed with exit code 1",
            "details": {"script": "hello", "exitCode": 1,
                        "stderrTail": "unknown statement \"import\"\n"},
        })
    );
    let metrics: Vec<&str> = answer.json["metrics"]
        .as_array()
        .ok_or("metrics")?
        .iter()
        .filter_map(|m| m["name"].as_str())
        .collect();
    assert_eq!(
        metrics,
        ["execution.duration", "sandbox.duration", "mcp.calls"]
    );
    assert_eq!(answer.json["metrics"][2]["value"], 0.0, "no MCP call");

    let mut unknown = valid("r-none");
    unknown["context"]["componentId"] = json!("nope");
    let answer = runner.execute(unknown.to_string()).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(
        answer.json["data"]["code"], "SCRIPT_NOT_FOUND",
        "{answer:?}"
    );
    Ok(())
}

#[tokio::test]
async fn the_callers_request_id_is_echoed_on_errors_too() -> TestResult {
    let runner = harness();
    let request = Request::get("/nowhere")
        .header("x-request-id", "trace-7")
        .body(Body::empty())?;
    let answer = runner.call(request).await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    assert_eq!(answer.header("x-request-id"), Some("trace-7"));
    Ok(())
}
