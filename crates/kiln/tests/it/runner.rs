//! `kiln runner` as a core framework uses it: a real runner process on a free port, real
//! sandboxes, and a core-framework test server (real HTTP on 127.0.0.1) that implements the
//! MCP tools the runner calls and records every call.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use serde_json::{Value, json};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;
type TestResult = Res<()>;

const KILN: &str = env!("CARGO_BIN_EXE_kiln");

// ---------------------------------------------------------------------------------------
// The core-framework test server.

#[derive(Default)]
struct FrameworkState {
    /// Every call: (tool, params).
    calls: Mutex<Vec<(String, Value)>>,
    /// Definition files by path.
    files: Mutex<HashMap<String, String>>,
    /// Runtime values by key.
    values: Mutex<HashMap<String, Value>>,
    /// LLM answers: the first whose needle is in the prompt.
    answers: Mutex<Vec<(String, String)>>,
    /// Scripted failures by tool: (HTTP status, body).
    failures: Mutex<HashMap<String, (u16, String)>>,
}

struct Framework {
    endpoint: String,
    state: Arc<FrameworkState>,
}

async fn framework_tool(
    axum::extract::State(state): axum::extract::State<Arc<FrameworkState>>,
    axum::Json(body): axum::Json<Value>,
) -> (StatusCode, axum::Json<Value>) {
    let tool = body["tool"].as_str().unwrap_or_default().to_owned();
    let params = body["params"].clone();
    state
        .calls
        .lock()
        .unwrap()
        .push((tool.clone(), params.clone()));
    if let Some((status, text)) = state.failures.lock().unwrap().get(&tool).cloned() {
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        return (StatusCode::from_u16(status).unwrap(), axum::Json(body));
    }
    let ok = |result: Value| (StatusCode::OK, axum::Json(json!({"result": result})));
    match tool.as_str() {
        "core.state.getDefinitionFileContent" => {
            let path = params["path"].as_str().unwrap_or_default();
            match state.files.lock().unwrap().get(path) {
                Some(text) => ok(json!({"content": text})),
                None => (
                    StatusCode::NOT_FOUND,
                    axum::Json(
                        json!({"error": {"code": "NOT_FOUND", "message": format!("no file {path}")}}),
                    ),
                ),
            }
        }
        "core.llm.generate" => {
            let prompt = params["prompt"].as_str().unwrap_or_default();
            let text = state
                .answers
                .lock()
                .unwrap()
                .iter()
                .find(|(needle, _)| prompt.contains(needle.as_str()))
                .map_or_else(|| format!("echo: {prompt}"), |(_, answer)| answer.clone());
            ok(json!({"text": text, "usage": {"inputTokens": 11, "outputTokens": 7}}))
        }
        "core.state.setRuntimeValue" => {
            let key = params["key"].as_str().unwrap_or_default().to_owned();
            state
                .values
                .lock()
                .unwrap()
                .insert(key, params["value"].clone());
            ok(json!(true))
        }
        "core.state.getRuntimeValue" => {
            let key = params["key"].as_str().unwrap_or_default();
            ok(state
                .values
                .lock()
                .unwrap()
                .get(key)
                .cloned()
                .unwrap_or(Value::Null))
        }
        "core.framework.logFrameworkMessage" => ok(json!(true)),
        "custom.echo" => ok(json!({"echoed": params})),
        _ => (
            StatusCode::OK,
            axum::Json(json!({"error": {"code": "UNKNOWN_TOOL", "message": tool}})),
        ),
    }
}

impl Framework {
    fn start() -> Res<Framework> {
        let state = Arc::new(FrameworkState::default());
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let endpoint = format!("http://{}/mcp", listener.local_addr()?);
        let app = axum::Router::new()
            .route("/mcp", axum::routing::post(framework_tool))
            .with_state(state.clone());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                axum::serve(listener, app).await.expect("framework server");
            });
        });
        Ok(Framework { endpoint, state })
    }

    fn file(&self, path: &str, text: &str) {
        self.state
            .files
            .lock()
            .unwrap()
            .insert(path.to_owned(), text.to_owned());
    }

    fn answer(&self, needle: &str, text: &str) {
        self.state
            .answers
            .lock()
            .unwrap()
            .push((needle.to_owned(), text.to_owned()));
    }

    fn fail(&self, tool: &str, status: u16, body: &str) {
        self.state
            .failures
            .lock()
            .unwrap()
            .insert(tool.to_owned(), (status, body.to_owned()));
    }

    fn heal(&self) {
        self.state.failures.lock().unwrap().clear();
    }

    fn calls_to(&self, tool: &str) -> Vec<Value> {
        self.state
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(t, _)| t == tool)
            .map(|(_, params)| params.clone())
            .collect()
    }

    fn forget_calls(&self) {
        self.state.calls.lock().unwrap().clear();
    }
}

// ---------------------------------------------------------------------------------------
// The runner under test.

struct Runner {
    child: Child,
    base: String,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Runner {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Scripts every runner gets on its shared volume.
const SCRIPTS: &[(&str, &str)] = &[
    (
        "hello.py",
        r#"
import sys
def handler(data, context):
    print("a stray print that must not break the result")
    print("to stderr", file=sys.stderr)
    return {"status": 201, "headers": {"x-app": context.get("appId")},
            "body": {"echo": data.get("x"), "source": data["source"]}}

def generic(data, context):
    return {"x": data.get("x"), "component": context.get("componentId"),
            "task": context.get("taskDetails")}

def refuse(data, context):
    return {"error": {"code": "NOT_FOUND", "message": "no order %s" % data.get("x"),
                      "details": {"x": data.get("x")}}}

def binary(data, context):
    return {"status": 200, "body": "AAEC", "bodyEncoding": "base64"}
"#,
    ),
    (
        "tools/hello_js.js",
        r#"function handler(data, context) { console.log("noise"); return {js: data.x * 2, app: context.appId}; }"#,
    ),
    ("tools/helper.py", "def double(x):\n    return 2 * x\n"),
    (
        "tools/uses_helper.py",
        "from helper import double\ndef handler(data, context):\n    return {'doubled': double(data['x']), 'data': open('/app/tools/helper.py').read()[:10]}\n",
    ),
    (
        "tools/throws.js",
        "function handler(data, context) { throw new Error('js went wrong ' + data.x); }",
    ),
    (
        "broken.py",
        r#"
import sys
def handler(data, context):
    print("about to fail", file=sys.stderr)
    raise ValueError("boom %s" % data.get("x"))
def exits(data, context):
    sys.exit(4)
def quits_early(data, context):
    sys.stdout.write("no result here\n")
    sys.stdout.flush()
    raise SystemExit(0)
def not_json(data, context):
    return {1, 2, 3}
def writes(data, context):
    open("/app/planted.py", "w").write("def handler(d, c): return 'planted'")
    return "written"
def spins(data, context):
    while True:
        pass
"#,
    ),
    (
        "check.py",
        r#"
def handler(data, context):
    amount = data["amount"]
    if amount < 0:
        raise ValueError("negative amount")
    return {"amount": amount, "big": amount > 100, "fixed": data.get("fixed")}
def bump(data, context):
    return {"n": (data.get("n") or 0) + 1}
"#,
    ),
];

fn start_runner(workers: usize, extra: &[&str]) -> Res<Runner> {
    let dir = tempfile::tempdir()?;
    let scripts = dir.path().join("shared");
    for (name, text) in SCRIPTS {
        let path = scripts.join(name);
        std::fs::create_dir_all(path.parent().ok_or("no parent")?)?;
        std::fs::write(path, text)?;
    }
    std::fs::write(
        dir.path().join("secret.py"),
        "def handler(d, c): return 'leaked'",
    )?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let log = dir.path().join("runner.log");
    let child = Command::new(KILN)
        .arg("runner")
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--scripts")
        .arg(&scripts)
        .args(["--workers", &workers.to_string(), "--timeout", "5s"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    let runner = Runner {
        child,
        base: format!("http://127.0.0.1:{port}"),
        log,
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(response) = ureq::get(&format!("{}/healthz", runner.base)).call()
            && response.status() == 200
        {
            return Ok(runner);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "kiln runner did not become healthy: {}",
                std::fs::read_to_string(&runner.log)?
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

struct Reply {
    status: u16,
    request_id: Option<String>,
    allow: Option<String>,
    content_type: Option<String>,
    body: Value,
}

impl Runner {
    fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Res<Reply> {
        let mut request =
            ureq::request(method, &format!("{}{path}", self.base)).timeout(Duration::from_secs(60));
        for (name, value) in headers {
            request = request.set(name, value);
        }
        let response = match request.send_bytes(body) {
            Ok(response) => response,
            Err(ureq::Error::Status(_, response)) => response,
            Err(e) => return Err(e.into()),
        };
        let status = response.status();
        let request_id = response.header("x-request-id").map(str::to_owned);
        let allow = response.header("allow").map(str::to_owned);
        let content_type = response.header("content-type").map(str::to_owned);
        let mut bytes = Vec::new();
        response.into_reader().read_to_end(&mut bytes)?;
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Ok(Reply {
            status,
            request_id,
            allow,
            content_type,
            body,
        })
    }

    /// POSTs a request body to /execute as JSON; expects 200 and returns the answer.
    fn execute(&self, body: &Value) -> Res<Value> {
        let reply = self.send(
            "POST",
            "/execute",
            &[("content-type", "application/json")],
            body.to_string().as_bytes(),
        )?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        Ok(reply.body)
    }
}

/// A request with the given requestData and context fields.
fn request(id: &str, data: Value, endpoint: &str, context: Value) -> Value {
    let mut context_fields = json!({"mcp_endpoint": endpoint, "appId": "app-1"});
    if let (Some(fields), Value::Object(extra)) = (context_fields.as_object_mut(), context) {
        fields.extend(extra);
    }
    json!({"requestId": id, "requestData": data, "context": context_fields})
}

fn metric(answer: &Value, name: &str) -> Option<f64> {
    answer["metrics"]
        .as_array()?
        .iter()
        .find(|m| m["name"] == name)?["value"]
        .as_f64()
}

fn assert_error(answer: &Value, code: &str) {
    assert_eq!(answer["resultType"], "error", "{answer}");
    assert_eq!(answer["data"]["code"], code, "{answer}");
    assert!(
        !answer["data"]["message"]
            .as_str()
            .unwrap_or_default()
            .is_empty(),
        "{answer}"
    );
}

/// Waits until the framework has recorded a matching call (logs are sent after answering).
fn wait_for_call(
    framework: &Framework,
    tool: &str,
    matches: impl Fn(&Value) -> bool,
) -> Res<Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(call) = framework.calls_to(tool).into_iter().find(|c| matches(c)) {
            return Ok(call);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "no matching {tool} call; got {:?}",
                framework.calls_to(tool)
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------------------------------
// JIT mode.

#[test]
fn jit_results_follow_the_request_source() -> TestResult {
    let framework = Framework::start()?;
    let runner = start_runner(1, &[])?;
    let endpoint = &framework.endpoint;

    let ctx = json!({"componentId": "hello"});
    let answer = runner.execute(&request(
        "r-http",
        json!({"source": "http", "x": 5}),
        endpoint,
        ctx,
    ))?;
    assert_eq!(answer["requestId"], "r-http");
    assert_eq!(answer["resultType"], "httpResponse", "{answer}");
    assert_eq!(
        answer["data"],
        json!({"status": 201, "headers": {"x-app": "app-1", "content-type": "application/json"},
               "body": r#"{"echo":5,"source":"http"}"#, "bodyEncoding": "utf8"})
    );
    assert!(
        metric(&answer, "execution.duration").is_some_and(|ms| ms > 0.0),
        "{answer}"
    );
    assert!(
        metric(&answer, "sandbox.duration").is_some_and(|ms| ms > 0.0),
        "{answer}"
    );
    assert_eq!(metric(&answer, "mcp.calls"), Some(0.0));

    // Another source: the same script's answer is generic.
    let ctx = json!({"componentId": "ignored", "taskDetails": {"script": "hello.py", "function": "generic", "k": 1}});
    let answer = runner.execute(&request(
        "r-q",
        json!({"source": "queue", "x": [1, 2]}),
        endpoint,
        ctx,
    ))?;
    assert_eq!(answer["resultType"], "generic", "{answer}");
    assert_eq!(answer["data"]["x"], json!([1, 2]));
    assert_eq!(answer["data"]["component"], "ignored");
    assert_eq!(answer["data"]["task"]["k"], 1);

    // An application error the script chose.
    let ctx = json!({"componentId": "hello", "taskDetails": {"function": "refuse"}});
    let answer = runner.execute(&request(
        "r-e",
        json!({"source": "http", "x": 9}),
        endpoint,
        ctx,
    ))?;
    assert_error(&answer, "NOT_FOUND");
    assert_eq!(answer["data"]["details"], json!({"x": 9}));

    // Bytes.
    let ctx = json!({"componentId": "hello", "taskDetails": {"function": "binary"}});
    let answer = runner.execute(&request("r-b", json!({"source": "http"}), endpoint, ctx))?;
    assert_eq!(answer["data"]["bodyEncoding"], "base64", "{answer}");
    assert_eq!(answer["data"]["body"], "AAEC");

    // JavaScript, in a folder, found without its extension.
    let ctx = json!({"componentId": "tools/hello_js"});
    let answer = runner.execute(&request(
        "r-js",
        json!({"source": "internal", "x": 21}),
        endpoint,
        ctx,
    ))?;
    assert_eq!(answer["resultType"], "generic", "{answer}");
    assert_eq!(answer["data"], json!({"js": 42, "app": "app-1"}));

    // A Python script imports its neighbours and reads the (read-only) volume at /app.
    let ctx = json!({"componentId": "tools/uses_helper"});
    let answer = runner.execute(&request(
        "r-imp",
        json!({"source": "internal", "x": 4}),
        endpoint,
        ctx,
    ))?;
    assert_eq!(
        answer["data"],
        json!({"doubled": 8, "data": "def double"}),
        "{answer}"
    );

    // The request id header is echoed; without one, the body's requestId is sent back.
    let body = request(
        "r-h",
        json!({"source": "queue"}),
        endpoint,
        json!({"componentId": "hello"}),
    );
    let reply = runner.send(
        "POST",
        "/execute",
        &[
            ("content-type", "application/json"),
            ("x-request-id", "trace-77"),
            ("accept", "application/json"),
        ],
        body.to_string().as_bytes(),
    )?;
    assert_eq!(
        (reply.status, reply.request_id.as_deref()),
        (200, Some("trace-77"))
    );
    let reply = runner.send(
        "POST",
        "/execute",
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    )?;
    assert_eq!(reply.request_id.as_deref(), Some("r-h"));

    // Logs reach the framework's logging tool with the ids, not stdout.
    let log = wait_for_call(&framework, "core.framework.logFrameworkMessage", |c| {
        c["requestId"] == "r-js"
    })?;
    assert_eq!(log["appId"], "app-1");
    assert_eq!(log["componentId"], "tools/hello_js");
    assert_eq!(log["level"], "info");
    assert!(
        log["message"]
            .as_str()
            .unwrap_or_default()
            .contains("jit request succeeded"),
        "{log}"
    );
    let warn = wait_for_call(&framework, "core.framework.logFrameworkMessage", |c| {
        c["requestId"] == "r-e"
    })?;
    assert_eq!(warn["level"], "warn");
    Ok(())
}

#[test]
fn jit_failures_are_error_results_with_details() -> TestResult {
    let framework = Framework::start()?;
    let runner = start_runner(1, &[])?;
    let run = |component: &str, function: Option<&str>| {
        let mut details = json!({"timeoutMs": 400});
        if let Some(function) = function {
            details["function"] = json!(function);
        }
        let ctx = json!({"componentId": component, "taskDetails": details});
        runner.execute(&request(
            "r",
            json!({"source": "queue", "x": 3}),
            &framework.endpoint,
            ctx,
        ))
    };

    let answer = run("nowhere", None)?;
    assert_error(&answer, "SCRIPT_NOT_FOUND");
    assert_eq!(
        answer["data"]["details"]["tried"],
        json!(["nowhere.py", "nowhere.js"])
    );

    for hostile in [
        "../secret",
        "../secret.py",
        "/etc/passwd",
        "tools/../../secret",
        "hello.py\u{0}",
    ] {
        let answer = run(hostile, None)?;
        assert_error(&answer, "INVALID_SCRIPT_NAME");
    }

    assert_error(&run("hello", Some("missing"))?, "FUNCTION_NOT_FOUND");
    assert_error(&run("hello", Some("os.system"))?, "FUNCTION_NOT_FOUND");

    let answer = run("broken", None)?;
    assert_error(&answer, "SCRIPT_FAILED");
    let details = &answer["data"]["details"];
    assert_eq!(details["exitCode"], 1);
    let tail = details["stderrTail"].as_str().unwrap_or_default();
    assert!(
        tail.contains("about to fail") && tail.contains("ValueError: boom 3"),
        "{tail}"
    );

    let answer = run("broken", Some("exits"))?;
    assert_error(&answer, "SCRIPT_FAILED");
    assert_eq!(answer["data"]["details"]["exitCode"], 4);

    let answer = run("broken", Some("quits_early"))?;
    assert_error(&answer, "BAD_OUTPUT");
    assert!(
        answer["data"]["details"]["stdoutTail"]
            .as_str()
            .unwrap_or_default()
            .contains("no result here")
    );

    assert_error(&run("broken", Some("not_json"))?, "BAD_OUTPUT");

    // The shared volume is read-only to scripts.
    let answer = run("broken", Some("writes"))?;
    assert_error(&answer, "SCRIPT_FAILED");
    assert_error(&run("planted", None)?, "SCRIPT_NOT_FOUND");

    let answer = run("tools/throws", None)?;
    assert_error(&answer, "SCRIPT_FAILED");
    let tail = answer["data"]["details"]["stderrTail"]
        .as_str()
        .unwrap_or_default();
    assert!(tail.contains("js went wrong 3"), "{answer}");

    let started = Instant::now();
    let answer = run("broken", Some("spins"))?;
    assert_error(&answer, "TIMEOUT");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );

    // The runner is still fine.
    assert_eq!(run("hello", Some("generic"))?["resultType"], "generic");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Transport errors.

#[test]
fn transport_errors_use_http_statuses_and_name_the_field() -> TestResult {
    let runner = start_runner(1, &["--max-body", "1m"])?;
    let json_type = [("content-type", "application/json")];
    let valid = request(
        "r1",
        json!({"source": "http"}),
        "http://127.0.0.1:9/mcp",
        json!({"componentId": "hello"}),
    );

    let reply = runner.send("POST", "/execute", &json_type, b"{\"requestId\": ")?;
    assert_eq!(
        (reply.status, reply.body["error"]["code"].as_str()),
        (400, Some("MALFORMED_JSON"))
    );

    let fields = [
        "requestId",
        "requestData",
        "requestData.source",
        "context",
        "context.mcp_endpoint",
    ];
    for field in fields {
        let pointer = format!("/{}", field.replace('.', "/"));
        let (parent, leaf) = pointer.rsplit_once('/').ok_or("no slash")?;
        let mut missing = valid.clone();
        missing
            .pointer_mut(parent)
            .and_then(Value::as_object_mut)
            .ok_or("parent")?
            .remove(leaf);
        let reply = runner.send(
            "POST",
            "/execute",
            &json_type,
            missing.to_string().as_bytes(),
        )?;
        assert_eq!(reply.status, 400, "{field}: {}", reply.body);
        assert_eq!(reply.body["error"]["code"], "INVALID_FIELD");
        assert_eq!(reply.body["error"]["field"], field);
        assert_eq!(
            reply.body["error"]["message"],
            format!("{field} is missing")
        );

        let mut mistyped = valid.clone();
        *mistyped.pointer_mut(&pointer).ok_or("field")? = json!([1]);
        let reply = runner.send(
            "POST",
            "/execute",
            &json_type,
            mistyped.to_string().as_bytes(),
        )?;
        assert_eq!(reply.status, 400, "{field}: {}", reply.body);
        assert_eq!(reply.body["error"]["field"], field);
        assert!(
            reply.body["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains("not array")
        );
    }
    let mut mistyped = valid.clone();
    mistyped["context"]["taskDetails"] = json!({"timeoutMs": "soon"});
    let reply = runner.send(
        "POST",
        "/execute",
        &json_type,
        mistyped.to_string().as_bytes(),
    )?;
    assert_eq!(
        (reply.status, reply.body["error"]["field"].as_str()),
        (400, Some("context.taskDetails.timeoutMs"))
    );
    assert_eq!(reply.body["requestId"], "r1");

    let body = valid.to_string();
    let reply = runner.send(
        "POST",
        "/execute",
        &[("content-type", "text/plain")],
        body.as_bytes(),
    )?;
    assert_eq!(
        (reply.status, reply.body["error"]["code"].as_str()),
        (415, Some("UNSUPPORTED_MEDIA_TYPE"))
    );
    let reply = runner.send("POST", "/execute", &[], body.as_bytes())?;
    assert_eq!(reply.status, 415);
    let reply = runner.send(
        "POST",
        "/execute",
        &[
            ("content-type", "application/json"),
            ("accept", "text/html"),
        ],
        body.as_bytes(),
    )?;
    assert_eq!(
        (reply.status, reply.body["error"]["code"].as_str()),
        (406, Some("NOT_ACCEPTABLE"))
    );

    // A body over the limit is refused from its declared length, before it is read (a
    // client still sending it would see its connection closed, so none is sent here).
    let mut stream = std::net::TcpStream::connect(runner.base.trim_start_matches("http://"))?;
    std::io::Write::write_all(
        &mut stream,
        b"POST /execute HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 2097152\r\n\r\n",
    )?;
    let mut head = [0u8; 512];
    let read = stream.read(&mut head)?;
    let head = String::from_utf8_lossy(&head[..read]);
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(head.contains("BODY_TOO_LARGE"), "{head}");
    // Under the limit is fine.
    let mut big = valid.clone();
    big["requestData"]["blob"] = json!("x".repeat(900_000));
    let reply = runner.send("POST", "/execute", &json_type, big.to_string().as_bytes())?;
    assert_eq!(reply.status, 200, "{}", reply.body);

    let reply = runner.send("GET", "/nope", &[], b"")?;
    assert_eq!(reply.status, 404);
    let reply = runner.send("POST", "/_framework/load_code", &json_type, b"{}")?;
    assert_eq!(
        (reply.status, reply.body["status"].as_str()),
        (200, Some("ok"))
    );

    // The schemas served are the ones checked in.
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/runner");
    for name in [
        "request.json",
        "response.json",
        "error.json",
        "workflow.json",
        "template.json",
    ] {
        let reply = runner.send("GET", &format!("/schema/{name}"), &[], b"")?;
        assert_eq!(reply.status, 200, "{name}");
        let checked_in: Value = serde_json::from_str(&std::fs::read_to_string(docs.join(name))?)?;
        assert_eq!(reply.body, checked_in, "{name}");
    }
    // Still serving.
    let reply = runner.send("POST", "/execute", &json_type, body.as_bytes())?;
    assert_eq!(reply.status, 200);
    Ok(())
}

/// Errors the router answers itself (405 with Allow, 404, 413, 415) have the documented
/// shape `{"error": {"code", "message"}}` (issue 13), not an empty or plain-text body.
#[test]
fn issue_13_errors_the_router_answers_have_the_json_shape() -> TestResult {
    let runner = start_runner(1, &["--max-body", "64k"])?;
    let shaped = |reply: &Reply, status: u16, code: &str| {
        assert_eq!(
            (reply.status, reply.body["error"]["code"].as_str()),
            (status, Some(code)),
            "{}",
            reply.body
        );
        assert_eq!(reply.content_type.as_deref(), Some("application/json"));
        assert!(
            reply.body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{}",
            reply.body
        );
    };
    for (method, path, allowed) in [
        ("GET", "/execute", "POST"),
        ("PUT", "/execute", "POST"),
        ("POST", "/healthz", "GET"),
        ("GET", "/_framework/load_code", "POST"),
        ("DELETE", "/schema/request.json", "GET"),
    ] {
        let reply = runner.send(method, path, &[], b"")?;
        shaped(&reply, 405, "METHOD_NOT_ALLOWED");
        assert!(
            reply.allow.as_deref().is_some_and(|a| a.contains(allowed)),
            "{method} {path}: {:?}",
            reply.allow
        );
    }
    shaped(&runner.send("GET", "/nope", &[], b"")?, 404, "NOT_FOUND");
    shaped(
        &runner.send("GET", "/schema/nope.json", &[], b"")?,
        404,
        "NOT_FOUND",
    );
    let reply = runner.send("POST", "/execute", &[("content-type", "text/plain")], b"{}")?;
    shaped(&reply, 415, "UNSUPPORTED_MEDIA_TYPE");
    // 413 from the declared length, before the body is sent: the JSON shape too.
    let mut stream = std::net::TcpStream::connect(runner.base.trim_start_matches("http://"))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    std::io::Write::write_all(
        &mut stream,
        b"POST /execute HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n",
    )?;
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    while !received.ends_with(b"}") {
        let read = stream.read(&mut buffer)?;
        if read == 0 {
            break;
        }
        received.extend_from_slice(&buffer[..read]);
    }
    let text = String::from_utf8_lossy(&received);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("no head")?;
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    let body: Value = serde_json::from_str(body)?;
    assert_eq!(body["error"]["code"], "BODY_TOO_LARGE", "{body}");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// LLM template mode, and MCP failures.

const SUMMARY_TEMPLATE: &str = r#"
prompt: |
  Summarise order {{ requestData.order.id }} for {{ context.appId }}:
  {% for item in requestData.order.items %}- {{ item | upper }}
  {% endfor %}
system: You answer in JSON.
defaults:
  model: small-model
  temperature: 0.2
outputSchema:
  type: object
  required: [summary, count]
  properties:
    summary: {type: string}
    count: {type: integer}
"#;

#[test]
fn llm_mode_renders_generates_and_validates() -> TestResult {
    let framework = Framework::start()?;
    framework.file("templates/summary.yaml", SUMMARY_TEMPLATE);
    framework.file("templates/plain.txt", "Say hi to {{ requestData.name }}");
    framework.answer(
        "order 7",
        "```json\n{\"summary\": \"two things\", \"count\": 2}\n```",
    );
    framework.answer("order 8", "{\"summary\": \"missing count\"}");
    let runner = start_runner(1, &[])?;
    let order =
        |id: u32| json!({"source": "internal", "order": {"id": id, "items": ["tea", "cake"]}});
    let ctx = json!({"componentId": "summariser", "taskDetails": {"template": "templates/summary.yaml", "llm": {"model": "big-model"}}});

    let answer = runner.execute(&request(
        "r-llm",
        order(7),
        &framework.endpoint,
        ctx.clone(),
    ))?;
    assert_eq!(answer["resultType"], "generic", "{answer}");
    assert_eq!(answer["data"], json!({"summary": "two things", "count": 2}));
    assert_eq!(metric(&answer, "llm.tokens.input"), Some(11.0));
    assert_eq!(metric(&answer, "llm.tokens.output"), Some(7.0));
    assert_eq!(metric(&answer, "mcp.calls"), Some(2.0));

    let loads = framework.calls_to("core.state.getDefinitionFileContent");
    assert_eq!(loads.len(), 1);
    assert_eq!(loads[0]["path"], "templates/summary.yaml");
    assert_eq!(loads[0]["appId"], "app-1");
    let generate = framework.calls_to("core.llm.generate");
    assert_eq!(generate.len(), 1);
    let params = &generate[0];
    assert_eq!(params["model"], "big-model", "overrides win");
    assert_eq!(params["temperature"], 0.2, "defaults stay");
    assert_eq!(params["system"], "You answer in JSON.");
    assert_eq!(params["requestId"], "r-llm");
    assert_eq!(
        params["prompt"],
        "Summarise order 7 for app-1:\n- TEA\n- CAKE\n"
    );
    assert_eq!(
        params["outputSchema"]["required"],
        json!(["summary", "count"])
    );

    let answer = runner.execute(&request(
        "r-bad",
        order(8),
        &framework.endpoint,
        ctx.clone(),
    ))?;
    assert_error(&answer, "OUTPUT_SCHEMA_MISMATCH");
    assert!(
        answer["data"]["details"]["problems"]
            .as_str()
            .unwrap_or_default()
            .contains("count"),
        "{answer}"
    );

    let plain = json!({"taskDetails": {"mode": "llm", "template": "templates/plain.txt"}});
    let answer = runner.execute(&request(
        "r-plain",
        json!({"source": "queue", "name": "Ada"}),
        &framework.endpoint,
        plain,
    ))?;
    assert_eq!(
        answer["data"],
        json!({"text": "echo: Say hi to Ada"}),
        "{answer}"
    );

    let missing = json!({"taskDetails": {"template": "templates/none.yaml"}});
    let answer = runner.execute(&request(
        "r-missing",
        order(7),
        &framework.endpoint,
        missing,
    ))?;
    assert_error(&answer, "TEMPLATE_NOT_FOUND");

    framework.file(
        "templates/broken.yaml",
        "prompt: '{{ requestData.order.id + }}'",
    );
    let broken = json!({"taskDetails": {"template": "templates/broken.yaml"}});
    let answer = runner.execute(&request("r-broken", order(7), &framework.endpoint, broken))?;
    assert_error(&answer, "TEMPLATE_RENDER_FAILED");
    Ok(())
}

#[test]
fn mcp_failures_are_error_results_and_only_safe_calls_are_retried() -> TestResult {
    let framework = Framework::start()?;
    framework.file("t.txt", "hello {{ requestData.source }}");
    let runner = start_runner(1, &[])?;
    let ctx = json!({"taskDetails": {"template": "t.txt"}});
    let data = json!({"source": "queue"});

    // Nothing listens at the endpoint.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?;
    let down = format!("http://{}/mcp", closed.local_addr()?);
    drop(closed);
    let answer = runner.execute(&request("r-down", data.clone(), &down, ctx.clone()))?;
    assert_error(&answer, "MCP_UNAVAILABLE");
    assert_eq!(
        answer["data"]["details"]["tool"],
        "core.state.getDefinitionFileContent"
    );

    // A 500 is not retried (the framework may have done the work); a 503 on a read is.
    framework.fail(
        "core.state.getDefinitionFileContent",
        500,
        "internal trouble",
    );
    let answer = runner.execute(&request(
        "r-500",
        data.clone(),
        &framework.endpoint,
        ctx.clone(),
    ))?;
    assert_error(&answer, "MCP_HTTP_ERROR");
    assert_eq!(answer["data"]["details"]["status"], 500);
    assert_eq!(
        framework
            .calls_to("core.state.getDefinitionFileContent")
            .len(),
        1
    );
    framework.forget_calls();
    framework.fail("core.state.getDefinitionFileContent", 503, "busy");
    let answer = runner.execute(&request(
        "r-503",
        data.clone(),
        &framework.endpoint,
        ctx.clone(),
    ))?;
    assert_error(&answer, "MCP_HTTP_ERROR");
    assert_eq!(
        framework
            .calls_to("core.state.getDefinitionFileContent")
            .len(),
        3
    );

    // An error body.
    framework.fail(
        "core.state.getDefinitionFileContent",
        200,
        r#"{"error": {"code": "PERMISSION_DENIED", "message": "app-1 may not read t.txt"}}"#,
    );
    let answer = runner.execute(&request(
        "r-err",
        data.clone(),
        &framework.endpoint,
        ctx.clone(),
    ))?;
    assert_error(&answer, "MCP_TOOL_ERROR");
    assert_eq!(answer["data"]["details"]["toolCode"], "PERMISSION_DENIED");

    // A garbled answer.
    framework.fail(
        "core.state.getDefinitionFileContent",
        200,
        "\"not an object\"",
    );
    assert_error(
        &runner.execute(&request(
            "r-garbled",
            data.clone(),
            &framework.endpoint,
            ctx.clone(),
        ))?,
        "MCP_BAD_REPLY",
    );

    // The LLM is never called twice for one answer, even on a 503.
    framework.heal();
    framework.forget_calls();
    framework.fail("core.llm.generate", 503, "overloaded");
    let answer = runner.execute(&request(
        "r-llm503",
        data.clone(),
        &framework.endpoint,
        ctx.clone(),
    ))?;
    assert_error(&answer, "MCP_HTTP_ERROR");
    assert_eq!(framework.calls_to("core.llm.generate").len(), 1);

    framework.heal();
    let answer = runner.execute(&request("r-ok", data, &framework.endpoint, ctx))?;
    assert_eq!(answer["data"]["text"], "echo: hello queue", "{answer}");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Workflow mode.

const ORDER_FLOW: &str = r#"
id: order-flow
startAt: check
steps:
  check:
    type: jit
    script: check.py
    inputMapping:
      amount: requestData.amount
      fixed: 3
    transitions:
      conditions:
        - when: output.big
          next: review
      onSuccess: summarise
      onFailure: rejected
  review:
    type: mcp
    tool: custom.echo
    inputMapping:
      amount: steps.check.amount
      reason: "'large order'"
    next: summarise
  summarise:
    type: llm
    template: templates/summary.txt
    overrides: {model: wf-model}
    inputMapping:
      amount: steps.check.amount
    next: done
  rejected:
    type: control
    inputMapping:
      rejected: true
      why: error.message
    end: true
  done:
    type: control
    inputMapping:
      amount: steps.check.amount
      reviewed: steps.review is defined
      summary: steps.summarise.text
    end: true
"#;

const CYCLE: &str = r#"
startAt: a
maxSteps: 7
steps:
  a:
    type: jit
    script: check.py
    function: bump
    inputMapping:
      n: last.n
    next: b
  b:
    type: control
    transitions:
      conditions:
        - when: last.n > 1000
          next: out
      onSuccess: a
  out:
    type: control
    end: true
"#;

#[test]
fn workflows_branch_carry_state_and_stop_cycles() -> TestResult {
    let framework = Framework::start()?;
    framework.file("flows/order.yaml", ORDER_FLOW);
    framework.file("flows/cycle.yaml", CYCLE);
    framework.file(
        "templates/summary.txt",
        "Summarise an order of {{ input.amount }}",
    );
    framework.answer("order of 250", "a big order");
    framework.answer("order of 20", "a small order");
    let runner = start_runner(1, &[])?;
    let ctx = json!({"componentId": "orders", "taskDetails": {"workflow": "flows/order.yaml"}});
    let order = |amount: i64| json!({"source": "http", "amount": amount});

    // Big: check → review (mcp) → summarise (llm) → done.
    let answer = runner.execute(&request(
        "w-big",
        order(250),
        &framework.endpoint,
        ctx.clone(),
    ))?;
    assert_eq!(answer["resultType"], "generic", "{answer}");
    assert_eq!(
        answer["data"],
        json!({"amount": 250, "reviewed": true, "summary": "a big order"})
    );
    assert_eq!(metric(&answer, "workflow.steps"), Some(4.0));
    let echoed = framework.calls_to("custom.echo");
    assert_eq!(
        echoed,
        vec![json!({"amount": 250, "reason": "large order"})]
    );
    let generate = framework.calls_to("core.llm.generate");
    assert_eq!(generate.last().ok_or("no llm call")?["model"], "wf-model");

    // Small: the condition does not hold, review is skipped.
    let answer = runner.execute(&request(
        "w-small",
        order(20),
        &framework.endpoint,
        ctx.clone(),
    ))?;
    assert_eq!(
        answer["data"],
        json!({"amount": 20, "reviewed": false, "summary": "a small order"})
    );
    assert_eq!(metric(&answer, "workflow.steps"), Some(3.0));
    assert_eq!(framework.calls_to("custom.echo").len(), 1);

    // A failing step takes its failure transition.
    let answer = runner.execute(&request(
        "w-neg",
        order(-5),
        &framework.endpoint,
        ctx.clone(),
    ))?;
    assert_eq!(answer["resultType"], "generic", "{answer}");
    assert_eq!(answer["data"]["rejected"], true);
    assert!(
        answer["data"]["why"]
            .as_str()
            .unwrap_or_default()
            .contains("exit code 1"),
        "{answer}"
    );

    // Each step is logged with its name.
    let log = wait_for_call(&framework, "core.framework.logFrameworkMessage", |c| {
        c["requestId"] == "w-big" && c["step"] == "review"
    })?;
    assert_eq!(log["componentId"], "orders");

    // A cycle is stopped by the budget.
    let cycle = json!({"taskDetails": {"workflow": "flows/cycle.yaml"}});
    let answer = runner.execute(&request(
        "w-cycle",
        json!({"source": "internal"}),
        &framework.endpoint,
        cycle,
    ))?;
    assert_error(&answer, "STEP_BUDGET_EXCEEDED");
    assert_eq!(answer["data"]["details"]["maxSteps"], 7);
    assert_eq!(
        answer["data"]["details"]["trail"],
        json!(["a", "b", "a", "b", "a", "b", "a"])
    );

    // A missing and a broken definition.
    let missing = json!({"taskDetails": {"workflow": "flows/none.yaml"}});
    assert_error(
        &runner.execute(&request("w-m", order(1), &framework.endpoint, missing))?,
        "WORKFLOW_NOT_FOUND",
    );
    framework.file("flows/broken.yaml", "startAt: x\nsteps: {}\n");
    let broken = json!({"taskDetails": {"workflow": "flows/broken.yaml"}});
    assert_error(
        &runner.execute(&request("w-b", order(1), &framework.endpoint, broken))?,
        "WORKFLOW_INVALID",
    );
    Ok(())
}

#[test]
fn step_mode_reports_each_step_and_keeps_state_through_mcp() -> TestResult {
    let framework = Framework::start()?;
    framework.file("flows/order.yaml", ORDER_FLOW);
    framework.file(
        "templates/summary.txt",
        "Summarise an order of {{ input.amount }}",
    );
    let runner = start_runner(1, &[])?;
    let ctx = json!({"componentId": "orders", "workflowInfo": {
        "definition": "flows/order.yaml", "execution": "step", "instanceId": "inst-1"}});
    let data = json!({"source": "http", "amount": 20});

    let first = runner.execute(&request(
        "s1",
        data.clone(),
        &framework.endpoint,
        ctx.clone(),
    ))?;
    assert_eq!(first["resultType"], "workflowStep", "{first}");
    assert_eq!(
        first["data"],
        json!({"workflowId": "order-flow", "instanceId": "inst-1", "step": "check", "status": "succeeded",
               "output": {"amount": 20, "big": false, "fixed": 3}, "nextStep": "summarise", "stepsExecuted": 1})
    );
    let stored = framework.calls_to("core.state.setRuntimeValue");
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0]["key"], "workflow:order-flow:inst-1");
    assert_eq!(stored[0]["value"]["next"], "summarise");

    let second = runner.execute(&request(
        "s2",
        data.clone(),
        &framework.endpoint,
        ctx.clone(),
    ))?;
    assert_eq!(second["data"]["step"], "summarise", "{second}");
    assert_eq!(second["data"]["nextStep"], "done");
    assert_eq!(second["data"]["stepsExecuted"], 2);

    // The terminal step answers with the final result, read from the carried state.
    let last = runner.execute(&request("s3", data, &framework.endpoint, ctx))?;
    assert_eq!(last["resultType"], "generic", "{last}");
    assert_eq!(
        last["data"],
        json!({"amount": 20, "reviewed": false, "summary": "echo: Summarise an order of 20"})
    );
    assert_eq!(framework.calls_to("core.state.getRuntimeValue").len(), 3);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Load.

#[test]
fn a_hundred_concurrent_requests_are_all_answered_correctly() -> TestResult {
    let framework = Framework::start()?;
    let runner = Arc::new(start_runner(2, &[])?);
    let endpoint = framework.endpoint.clone();
    let threads: Vec<_> = (0..100)
        .map(|i| {
            let runner = runner.clone();
            let endpoint = endpoint.clone();
            std::thread::spawn(move || -> Res<(i64, Value)> {
                let (component, source) = if i % 4 == 0 {
                    ("tools/hello_js", "queue")
                } else {
                    ("hello", "http")
                };
                let ctx = json!({"componentId": component});
                let answer = runner.execute(&request(
                    &format!("c-{i}"),
                    json!({"source": source, "x": i}),
                    &endpoint,
                    ctx,
                ))?;
                Ok((i, answer))
            })
        })
        .collect();
    for thread in threads {
        let (i, answer) = thread.join().map_err(|_| "thread panicked")??;
        assert_eq!(answer["requestId"], format!("c-{i}"));
        if i % 4 == 0 {
            assert_eq!(answer["data"]["js"], i * 2, "{answer}");
        } else {
            assert_eq!(answer["resultType"], "httpResponse", "{answer}");
            let body: Value =
                serde_json::from_str(answer["data"]["body"].as_str().unwrap_or_default())?;
            assert_eq!(body["echo"], i);
        }
    }
    Ok(())
}
