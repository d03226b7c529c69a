//! `POST /api/v1/chat` end to end: a real `kiln serve` process, a real provider test server
//! (OpenAI and Anthropic protocols) scripted per test, real code in real sandboxes.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiln_llm::fake::{FakeProvider, Step};
use serde_json::{Value, json};

const KILN: &str = env!("CARGO_BIN_EXE_kiln");

struct Server {
    child: Child,
    base: String,
    _data: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kiln serve --no-auth` with the given model environment.
fn serve(env: &[(&str, String)]) -> Server {
    let data = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut command = Command::new(KILN);
    command
        .args([
            "serve",
            "--no-auth",
            "--workers",
            "2",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(data.path())
        .env_remove("KILN_LLM_MODEL")
        .env("KILN_LLM_RETRY_DELAY_MS", "10")
        .stdin(Stdio::null())
        .stderr(Stdio::null());
    for (k, v) in env {
        command.env(k, v);
    }
    let child = command.spawn().unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while ureq::get(&format!("{base}/healthz")).call().is_err() {
        assert!(Instant::now() < deadline, "kiln serve did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    Server {
        child,
        base,
        _data: data,
    }
}

fn openai(fake: &FakeProvider) -> Vec<(&'static str, String)> {
    vec![
        ("KILN_LLM_MODEL", "openai-compatible:fake".into()),
        ("KILN_LLM_BASE_URL", fake.base_url.clone()),
    ]
}

/// Posts a chat and reads every event: (name, data).
fn chat(server: &Server, body: Value) -> (u16, Vec<(String, Value)>) {
    let response = match ureq::post(&format!("{}/api/v1/chat", server.base))
        .timeout(Duration::from_secs(120))
        .send_json(body)
    {
        Ok(r) => r,
        Err(ureq::Error::Status(code, r)) => {
            let body: Value = r.into_json().unwrap_or(Value::Null);
            return (code, vec![("body".into(), body)]);
        }
        Err(e) => panic!("{e}"),
    };
    let mut events = Vec::new();
    let mut name = String::new();
    for line in BufReader::new(response.into_reader()).lines() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("event: ") {
            name = rest.to_owned();
        } else if let Some(rest) = line.strip_prefix("data: ") {
            events.push((
                std::mem::take(&mut name),
                serde_json::from_str(rest).unwrap(),
            ));
        }
    }
    (200, events)
}

fn last(events: &[(String, Value)]) -> &(String, Value) {
    events.last().expect("no events")
}

fn user(text: &str) -> Value {
    json!({"messages": [{"role": "user", "content": text}]})
}

#[tokio::test(flavor = "multi_thread")]
async fn the_model_runs_code_and_receives_the_result() {
    for provider in ["openai-compatible", "anthropic"] {
        let fake = FakeProvider::start(vec![
            Step::tool(
                "call_1",
                "execute_code",
                json!({"language": "python", "code": "print(6*7)"}),
            ),
            Step::Text("It is 42.".into()),
        ])
        .await
        .unwrap();
        let env = vec![
            ("KILN_LLM_MODEL", format!("{provider}:fake")),
            ("KILN_LLM_BASE_URL", fake.base_url.clone()),
            ("ANTHROPIC_API_KEY", "test".into()),
        ];
        let server = tokio::task::spawn_blocking(move || serve(&env))
            .await
            .unwrap();
        let (server, (status, events)) = tokio::task::spawn_blocking(move || {
            let reply = chat(&server, user("what is 6*7?"));
            (server, reply)
        })
        .await
        .unwrap();
        assert_eq!(status, 200);
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names.first(), Some(&"sandbox"), "{provider}: {names:?}");
        assert!(
            names.contains(&"tool_call_start") && names.contains(&"stdout"),
            "{provider}: {names:?}"
        );
        let result = events
            .iter()
            .find(|(n, _)| n == "tool_result")
            .expect("tool result");
        assert!(
            result.1["result"]
                .as_str()
                .unwrap()
                .contains("stdout:\n42\n"),
            "{result:?}"
        );
        let (name, done) = last(&events);
        assert_eq!(name, "final", "{provider}: {events:?}");
        assert_eq!(done["message"]["content"], "It is 42.");
        assert!(done["usage"]["input_tokens"].as_u64().unwrap() >= 11);
        // The model received 42 in the tool result, in its protocol.
        let second = fake.requests()[1].to_string();
        assert!(second.contains("42"), "{provider}: {second}");
        // The conversation comes back whole: user, assistant tool call, tool, assistant.
        let roles: Vec<&str> = done["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "assistant"]);
        drop(server);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn parallel_and_malformed_calls_timeouts_state_and_artifacts() {
    let fake = FakeProvider::start(vec![
        Step::Tools(vec![
            ("a".into(), "execute_code".into(), json!({"language": "python", "code": "x = 20"}).to_string()),
            ("b".into(), "execute_code".into(), "{not json".into()),
            ("c".into(), "no_such_tool".into(), "{}".into()),
        ]),
        Step::tool("d", "execute_code", json!({"language": "python", "code": "while True: pass", "timeout_seconds": 1})),
        Step::tool("e", "execute_code", json!({"language": "python", "code": "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.savefig('plot.png')\nprint('saved')"})),
        Step::tool("f", "execute_code", json!({"language": "python", "code": "print(x + 22 if 'x' in dir() else 'fresh session')"})),
        Step::tool("g", "execute_code", json!({"language": "python", "code": "print('y' * 100000)"})),
        Step::Text("done".into()),
    ])
    .await
    .unwrap();
    let env = openai(&fake);
    let server = tokio::task::spawn_blocking(move || serve(&env))
        .await
        .unwrap();
    let (status, events) = tokio::task::spawn_blocking(move || {
        let reply = chat(&server, user("go"));
        drop(server);
        reply
    })
    .await
    .unwrap();
    assert_eq!(status, 200);
    let results: Vec<&Value> = events
        .iter()
        .filter(|(n, _)| n == "tool_result")
        .map(|(_, v)| v)
        .collect();
    let by_id = |id: &str| {
        results
            .iter()
            .find(|r| r["id"] == id)
            .unwrap_or_else(|| panic!("no result for {id}: {results:?}"))
    };
    assert_eq!(by_id("a")["is_error"], false);
    assert_eq!(
        by_id("b")["is_error"],
        true,
        "malformed arguments are a tool error"
    );
    assert!(by_id("c")["result"].as_str().unwrap().contains("no tool"));
    assert!(
        by_id("d")["result"]
            .as_str()
            .unwrap()
            .contains("status: timeout"),
        "{:?}",
        by_id("d")
    );
    assert!(by_id("e")["result"].as_str().unwrap().contains("saved"));
    // Issue 16: the figure left open reaches the client as a `display` event of its call,
    // and the model reads that it was shown.
    let figure = events
        .iter()
        .find(|(n, v)| n == "display" && v["id"] == "e")
        .unwrap_or_else(|| panic!("no display event: {events:?}"));
    assert!(
        figure.1["result"]["data"]["image/png"]
            .as_str()
            .unwrap()
            .starts_with("iVBORw0KGgo")
    );
    assert!(
        by_id("e")["result"]
            .as_str()
            .unwrap()
            .contains("1 figure(s) shown to the user")
    );
    // The timed-out turn ended the session; the next call ran in a fresh one.
    assert!(
        by_id("f")["result"]
            .as_str()
            .unwrap()
            .contains("fresh session"),
        "{:?}",
        by_id("f")
    );
    let big = by_id("g");
    assert_eq!(big["truncated"], true);
    assert!(big["result"].as_str().unwrap().len() < 9_000);
    let artifact = events
        .iter()
        .find(|(n, _)| n == "artifact")
        .expect("the plot is an artifact");
    assert_eq!(artifact.1["path"], "plot.png");
    assert!(artifact.1["size"].as_u64().unwrap() > 1000);
    assert_eq!(last(&events).0, "final");
}

#[tokio::test(flavor = "multi_thread")]
async fn loops_provider_failures_and_bad_structured_answers_end_with_clear_errors() {
    // A model repeating one call forever.
    let fake = FakeProvider::start(vec![]).await.unwrap();
    fake.repeat(Step::tool(
        "same",
        "execute_code",
        json!({"language": "python", "code": "print(1)"}),
    ));
    let env = openai(&fake);
    let (_, events) = tokio::task::spawn_blocking(move || chat(&serve(&env), user("loop")))
        .await
        .unwrap();
    assert_eq!(last(&events).0, "error");
    assert_eq!(last(&events).1["code"], "AGENT_LOOP", "{events:?}");

    // 500s from the provider: retried, then a clear error.
    let fake = FakeProvider::start(vec![]).await.unwrap();
    fake.repeat(Step::Status(500));
    let env = openai(&fake);
    let (_, events) = tokio::task::spawn_blocking(move || chat(&serve(&env), user("hi")))
        .await
        .unwrap();
    assert_eq!(last(&events).1["code"], "LLM_FAILED", "{events:?}");
    assert_eq!(fake.requests().len(), 3, "three attempts");

    // A structured answer that is wrong once is retried with the validation error.
    let schema = json!({"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]});
    let fake = FakeProvider::start(vec![
        Step::Text("{\"answer\": \"forty-two\"}".into()),
        Step::Text("{\"answer\": 42}".into()),
    ])
    .await
    .unwrap();
    let env = openai(&fake);
    let body = json!({"messages": [{"role": "user", "content": "6*7?"}], "output_schema": schema});
    let (_, events) = tokio::task::spawn_blocking(move || chat(&serve(&env), body))
        .await
        .unwrap();
    assert_eq!(last(&events).0, "final", "{events:?}");
    assert_eq!(last(&events).1["structured"], json!({"answer": 42}));
    assert!(
        fake.requests()[1]
            .to_string()
            .contains("does not match the required JSON schema")
    );

    // Wrong twice: a clear error.
    let fake = FakeProvider::start(vec![]).await.unwrap();
    fake.repeat(Step::Text("not json at all".into()));
    let env = openai(&fake);
    let body = json!({"messages": [{"role": "user", "content": "6*7?"}], "output_schema": schema});
    let (_, events) = tokio::task::spawn_blocking(move || chat(&serve(&env), body))
        .await
        .unwrap();
    assert_eq!(
        last(&events).1["code"],
        "STRUCTURED_OUTPUT_INVALID",
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_model_chat_says_how_to_configure_one() {
    let (status, events) = tokio::task::spawn_blocking(|| {
        let server = serve(&[]);
        let reply = chat(&server, user("hi"));
        let bad = chat(&server, json!({"messages": []}));
        (reply, bad)
    })
    .await
    .map(|(reply, bad)| {
        assert_eq!(bad.0, 400);
        reply
    })
    .unwrap();
    assert_eq!(status, 503);
    let body = &events[0].1;
    assert_eq!(body["error"]["code"], "LLM_NOT_CONFIGURED");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("KILN_LLM_MODEL"),
        "{body}"
    );
}

/// With Linux templates and `--route python=linux-python`, the agent's `execute_code` runs
/// Python (with its session) and bash in a Linux box, Go in a Linux sandbox of its own, and
/// JavaScript where it still runs (WebAssembly); the extra sandboxes go with the run.
#[tokio::test(flavor = "multi_thread")]
async fn the_agent_runs_go_and_bash_and_routes_python_to_linux() {
    if std::env::var("KILN_SKIP_LINUX").is_ok_and(|v| v == "1") {
        eprintln!(
            "SKIPPED (KILN_SKIP_LINUX=1): chat::the_agent_runs_go_and_bash_and_routes_python_to_linux"
        );
        return;
    }
    let go = "package main\n\nimport \"fmt\"\n\nfunc main() { fmt.Println(\"hello from go\") }\n";
    let fake = FakeProvider::start(vec![
        Step::tool(
            "a",
            "execute_code",
            json!({"language": "python", "code": "import sys\nx = 5\nprint(sys.version_info[:2])"}),
        ),
        Step::tool(
            "b",
            "execute_code",
            json!({"language": "python", "code": "print(x * 2)"}),
        ),
        Step::tool(
            "c",
            "execute_code",
            json!({"language": "bash", "code": "echo $((6*7)) > b.txt; cat b.txt; id -un"}),
        ),
        Step::tool(
            "d",
            "execute_code",
            json!({"language": "go", "code": go, "timeout_seconds": 120}),
        ),
        Step::tool(
            "e",
            "execute_code",
            json!({"language": "javascript", "code": "console.log(1 + 1)"}),
        ),
        Step::Text("done".into()),
    ])
    .await
    .unwrap();
    let state = tempfile::tempdir().unwrap();
    let mut env = openai(&fake);
    env.push(("KILN_LINUX", "1".into()));
    env.push(("KILN_ROUTE", "python=linux-python".into()));
    env.push((
        "KILN_STATE_DIR",
        state.path().to_string_lossy().into_owned(),
    ));
    let server = tokio::task::spawn_blocking(move || serve(&env))
        .await
        .unwrap();
    let (server, (status, events)) = tokio::task::spawn_blocking(move || {
        let reply = chat(&server, user("run things"));
        (server, reply)
    })
    .await
    .unwrap();
    assert_eq!(status, 200);
    let results: Vec<String> = events
        .iter()
        .filter(|(n, _)| n == "tool_result")
        .map(|(_, v)| v["result"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(results.len(), 5, "{events:?}");
    assert!(
        results[0].contains("stdout:\n(3, 11)\n"),
        "python ran in Linux: {}",
        results[0]
    );
    assert!(
        results[1].contains("stdout:\n10\n"),
        "the session kept x: {}",
        results[1]
    );
    assert!(
        results[2].contains("stdout:\n42\nuser\n"),
        "bash: {}",
        results[2]
    );
    assert!(
        results[3].contains("stdout:\nhello from go\n"),
        "go: {}",
        results[3]
    );
    assert!(
        results[4].contains("stdout:\n2\n"),
        "javascript: {}",
        results[4]
    );
    let (name, done) = last(&events);
    assert_eq!(name, "final", "{events:?}");
    // The model was offered every language this server runs.
    let first = fake.requests()[0].to_string();
    for language in ["\"go\"", "\"bash\"", "\"python\"", "\"javascript\""] {
        assert!(first.contains(language), "{language} not offered: {first}");
    }
    // Only the run's own sandbox is left; the Go and JavaScript ones went with the run.
    let sandbox = done["sandbox_id"].as_str().unwrap().to_owned();
    let listed: Value = ureq::get(&format!("{}/api/v1/sandboxes", server.base))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    let ids: Vec<&str> = listed["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["containerId"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [sandbox.as_str()], "{listed}");
    let (_, info) = (
        (),
        ureq::get(&format!("{}/api/v1/sandboxes/{sandbox}", server.base))
            .call()
            .unwrap()
            .into_json::<Value>()
            .unwrap(),
    );
    assert_eq!(info["template"], "linux-python", "{info}");
    ureq::delete(&format!("{}/api/v1/sandboxes/{sandbox}", server.base))
        .call()
        .unwrap();
    // Stopped, not killed: kiln closes its boxes and unmounts what it mounted.
    let mut server = server;
    // SAFETY: kill sends a signal to the server's pid, which this test started.
    unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
    assert!(server.child.wait().unwrap().success());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&*state.path().to_string_lossy()),
        "{mounts}"
    );
    drop(server);
}

/// Issue 32: a session cell's final value is a result, not a line of stdout; the model still
/// reads it (and what the cell `display`ed) in the tool result.
#[tokio::test(flavor = "multi_thread")]
async fn issue32_the_model_reads_a_cells_final_value() {
    let fake = FakeProvider::start(vec![
        Step::tool(
            "v",
            "execute_code",
            json!({"language": "python", "code": "display('first')\nx = 6\nx * 7"}),
        ),
        Step::Text("It is 42.".into()),
    ])
    .await
    .unwrap();
    let env = openai(&fake);
    let server = tokio::task::spawn_blocking(move || serve(&env))
        .await
        .unwrap();
    let (status, events) = tokio::task::spawn_blocking(move || {
        let reply = chat(&server, user("what is 6*7?"));
        drop(server);
        reply
    })
    .await
    .unwrap();
    assert_eq!(status, 200);
    let (_, result) = events
        .iter()
        .find(|(n, _)| n == "tool_result")
        .expect("tool result");
    let text = result["result"].as_str().unwrap_or_default();
    assert!(
        text.contains("displayed:\n'first'\nvalue:\n42\n") && !text.contains("stdout:"),
        "{text}"
    );
}
