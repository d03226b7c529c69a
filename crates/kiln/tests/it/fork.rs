//! Issue 18 through `kiln serve`: sandboxes of the `python-data` template start warm, and
//! sessions fork (`POST /api/v1/sandboxes/{id}/sessions/{sessionId}/fork`, MCP's
//! `fork_session`), over real HTTP, real worker processes and real CPython.

use std::time::Duration;

use serde_json::{Value, json};

use crate::common::serve::*;

/// What a turn prints before importing anything: whether pandas is in already.
const PANDAS_IN: &str = "import sys; print('pandas' in sys.modules)";

/// A server with room for a handful of sessions (forks count as sessions).
fn server(extra: &[&str]) -> Res<Server> {
    let mut args = vec!["--max-session-memory", "16GiB", "--max-sessions", "64"];
    args.extend_from_slice(extra);
    start(Options {
        extra: &args,
        ..Options::default()
    })
}

fn session(server: &Server, id: &str, language: &str) -> Res<String> {
    let (status, body) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/sessions"),
        Some(json!({ "language": language })),
    )?;
    assert_eq!(status, 201, "{body}");
    Ok(body["sessionId"]
        .as_str()
        .ok_or("no session id")?
        .to_owned())
}

/// Runs `code` as a turn of `session`; its stdout (the turn must succeed).
fn turn(server: &Server, id: &str, session: &str, code: &str) -> Res<String> {
    let (status, body) = server.exec(id, json!({ "code": code, "sessionId": session }))?;
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("success")),
        "{code}: {body}"
    );
    Ok(body["stdout"].as_str().unwrap_or_default().to_owned())
}

/// Forks `session`; the answer.
fn fork(server: &Server, id: &str, session: &str, body: Option<Value>) -> Res<(u16, Value)> {
    server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/sessions/{session}/fork"),
        body,
    )
}

/// The answer's sandbox and session ids.
fn forked(status: u16, body: &Value) -> Res<(String, String)> {
    assert_eq!(status, 201, "{body}");
    let sandbox = body["sandboxId"].as_str().ok_or("no sandboxId")?;
    let session = body["sessionId"].as_str().ok_or("no sessionId")?;
    Ok((sandbox.to_owned(), session.to_owned()))
}

#[test]
fn python_data_sandboxes_start_with_pandas_imported() -> TestResult {
    let server = server(&[])?;
    let (status, created) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"language": "python-data"})),
    )?;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["template"], "python-data", "{created}");
    let id = created["containerId"].as_str().ok_or("id")?.to_owned();
    // A one-shot and a session both start from the warm image: the request names the
    // template all the way down to the engine.
    let (status, ran) = server.exec(&id, json!({ "code": PANDAS_IN }))?;
    assert_eq!(
        (status, ran["stdout"].as_str()),
        (200, Some("True\n")),
        "{ran}"
    );
    let sid = session(&server, &id, "python")?;
    assert_eq!(turn(&server, &id, &sid, PANDAS_IN)?, "True\n");
    let frame = "import pandas as pd; print(pd.DataFrame({'a': [1, 2]}).a.sum())";
    assert_eq!(turn(&server, &id, &sid, frame)?, "3\n");
    // JavaScript in a python-data sandbox runs as in any WebAssembly sandbox.
    let (status, js) = server.exec(
        &id,
        json!({"code": "console.log(6 * 7)", "language": "javascript"}),
    )?;
    assert_eq!((status, js["stdout"].as_str()), (200, Some("42\n")), "{js}");
    // The python template starts cold, as before.
    let plain = server.new_sandbox("python")?;
    let (_, ran) = server.exec(&plain, json!({ "code": PANDAS_IN }))?;
    assert_eq!(ran["stdout"], "False\n", "{ran}");
    // Issue 39: a one-shot there that imports pandas starts from the image (scipy, which
    // pandas does not import, is in sys.modules already), seeing no name the image bound; a
    // session of the python template still starts fresh.
    let warm = "import sys\nimport pandas as pd\nprint(pd.Series([1, 2]).sum(), 'scipy' in sys.modules, 'numpy' in dir())";
    let (_, ran) = server.exec(&plain, json!({ "code": warm }))?;
    assert_eq!(ran["stdout"], "3 True False\n", "{ran}");
    let sid = session(&server, &plain, "python")?;
    assert_eq!(turn(&server, &plain, &sid, warm)?, "3 False False\n");
    // The published contract's image names reach it too.
    let (status, created) = server.call(
        "POST",
        "/api/sandbox",
        Some(json!({"image": "python-data"})),
    )?;
    assert_eq!(status, 201, "{created}");
    Ok(())
}

#[test]
fn a_fork_keeps_the_parents_variables_and_each_goes_its_own_way() -> TestResult {
    let server = server(&[])?;
    for template in ["python-data", "python"] {
        let id = server.new_sandbox(template)?;
        let parent = session(&server, &id, "python")?;
        turn(&server, &id, &parent, "import random, os\nx = 41")?;
        let (status, answer) = fork(&server, &id, &parent, None)?;
        let (sandbox, child) = forked(status, &answer)?;
        assert_eq!(
            sandbox, id,
            "{template}: the fork lives in the same sandbox"
        );
        assert_eq!(answer["forkedFrom"], parent.as_str());
        assert_eq!(
            turn(&server, &id, &child, "print(x + 1)")?,
            "42\n",
            "{template}"
        );
        // Variables and /tmp: each side's writes are its own.
        turn(
            &server,
            &id,
            &child,
            "x = 'child'\nopen('/tmp/c', 'w').write('c')",
        )?;
        turn(
            &server,
            &id,
            &parent,
            "y = 'parent'\nopen('/tmp/p', 'w').write('p')",
        )?;
        let look =
            "print(x, globals().get('y'), os.path.exists('/tmp/c'), os.path.exists('/tmp/p'))";
        assert_eq!(turn(&server, &id, &parent, look)?, "41 parent False True\n");
        assert_eq!(turn(&server, &id, &child, look)?, "child None True False\n");
        // Two forks draw different random numbers.
        let draw = |session: &str| turn(&server, &id, session, "print(random.random())");
        let (_, one) = forked_pair(fork(&server, &id, &parent, Some(json!({}))))?;
        let (_, two) = forked_pair(fork(
            &server,
            &id,
            &parent,
            Some(json!({"withWorkspace": false})),
        ))?;
        assert_ne!(draw(&one)?, draw(&two)?, "{template}");
        // The sandbox lists every session.
        let (_, list) = server.call("GET", &format!("/api/v1/sandboxes/{id}/sessions"), None)?;
        assert_eq!(list["sessions"].as_array().map(Vec::len), Some(4), "{list}");
    }
    Ok(())
}

fn forked_pair(answer: Res<(u16, Value)>) -> Res<(String, String)> {
    let (status, body) = answer?;
    forked(status, &body)
}

#[test]
fn a_fork_with_its_workspace_gets_a_sandbox_of_its_own() -> TestResult {
    let server = server(&[])?;
    let id = server.new_sandbox("python-data")?;
    let parent = session(&server, &id, "python")?;
    turn(
        &server,
        &id,
        &parent,
        "import os\nx = 41\nos.makedirs('data', exist_ok=True)\nopen('data/in.csv', 'w').write('a\\n1\\n')",
    )?;
    let (status, answer) = fork(&server, &id, &parent, Some(json!({"withWorkspace": true})))?;
    let (child_box, child) = forked(status, &answer)?;
    assert_ne!(child_box, id);
    let (status, info) = server.call("GET", &format!("/api/v1/sandboxes/{child_box}"), None)?;
    assert_eq!(
        (status, info["template"].as_str()),
        (200, Some("python-data")),
        "{info}"
    );
    // The fork sees the parent's variables and the parent's files as they were.
    let read = "print(x + 1, open('data/in.csv').read().split())";
    assert_eq!(turn(&server, &child_box, &child, read)?, "42 ['a', '1']\n");
    // Its history starts at the parent's head.
    let history = |sandbox: &str| -> Res<Vec<String>> {
        let (status, body) =
            server.call("GET", &format!("/api/v1/sandboxes/{sandbox}/history"), None)?;
        assert_eq!(status, 200, "{body}");
        Ok(body["history"]
            .as_array()
            .ok_or("no history")?
            .iter()
            .map(|e| e["commitId"].as_str().unwrap_or_default().to_owned())
            .collect())
    };
    assert_eq!(history(&child_box)?, history(&id)?);
    // From now on a file either writes stays its own.
    turn(
        &server,
        &child_box,
        &child,
        "open('child.txt', 'w').write('c')\nopen('data/in.csv', 'a').write('2\\n')",
    )?;
    turn(&server, &id, &parent, "open('parent.txt', 'w').write('p')")?;
    let files = |sandbox: &str| -> Res<Vec<String>> {
        let (status, body) =
            server.call("GET", &format!("/api/v1/sandboxes/{sandbox}/files"), None)?;
        assert_eq!(status, 200, "{body}");
        Ok(body["files"]
            .as_array()
            .ok_or("no files")?
            .iter()
            .map(|f| f["path"].as_str().unwrap_or_default().to_owned())
            .collect())
    };
    assert_eq!(files(&id)?, ["data", "data/in.csv", "parent.txt"]);
    assert_eq!(files(&child_box)?, ["child.txt", "data", "data/in.csv"]);
    assert_eq!(
        turn(
            &server,
            &id,
            &parent,
            "print(open('data/in.csv').read().split())"
        )?,
        "['a', '1']\n"
    );
    assert_eq!(history(&child_box)?.len(), history(&id)?.len());
    assert_ne!(history(&child_box)?[0], history(&id)?[0]);
    // Deleting the parent leaves the fork.
    let (status, _) = server.call("DELETE", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(status, 204);
    assert_eq!(turn(&server, &child_box, &child, "print(x)")?, "41\n");
    Ok(())
}

#[test]
fn fork_refusals_name_what_to_do() -> TestResult {
    let server = server(&[])?;
    let id = server.new_sandbox("python")?;
    let parent = session(&server, &id, "python")?;
    let code = |answer: &Value| {
        answer["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    let (status, answer) = fork(&server, "sb_000000000000000000000000", &parent, None)?;
    assert_eq!(
        (status, code(&answer)),
        (404, "SANDBOX_NOT_FOUND".into()),
        "{answer}"
    );
    let (status, answer) = fork(&server, &id, "ses_nope", None)?;
    assert_eq!(
        (status, code(&answer)),
        (404, "SESSION_NOT_FOUND".into()),
        "{answer}"
    );
    let malformed = send(
        "POST",
        &server.url(&format!("/api/v1/sandboxes/{id}/sessions/{parent}/fork")),
        None,
        Some(("application/json", b"{\"withWorkspace\": tru")),
    )?;
    check_no_host_path(malformed.status, &malformed.body);
    assert_eq!(
        (malformed.status, code(&malformed.json())),
        (400, "MALFORMED_JSON".into())
    );
    let (status, answer) = fork(&server, &id, &parent, Some(json!({"withWorkspace": 1})))?;
    assert_eq!(
        (status, code(&answer)),
        (400, "INVALID_REQUEST".into()),
        "{answer}"
    );

    // JavaScript sessions cannot fork, in a javascript sandbox or a python one.
    let js_box = server.new_sandbox("javascript")?;
    let js = session(&server, &js_box, "javascript")?;
    let (status, answer) = fork(&server, &js_box, &js, None)?;
    assert_eq!(
        (status, code(&answer)),
        (400, "UNSUPPORTED".into()),
        "{answer}"
    );
    let js = session(&server, &id, "javascript")?;
    let (status, answer) = fork(&server, &id, &js, Some(json!({"withWorkspace": true})))?;
    assert_eq!(
        (status, code(&answer)),
        (400, "UNSUPPORTED".into()),
        "{answer}"
    );
    assert_eq!(
        answer["error"]["message"],
        "javascript sessions of the python template cannot be forked; its python sessions can"
    );

    Ok(())
}

#[test]
fn a_fork_is_refused_while_a_turn_runs_and_after_the_session_ended() -> TestResult {
    let server = server(&[])?;
    let id = server.new_sandbox("python-data")?;
    let parent = session(&server, &id, "python")?;
    let code = |answer: &Value| {
        answer["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    // A turn running: refused, and the parent comes out of it whole.
    let busy_server = &server;
    let (id2, parent2) = (id.clone(), parent.clone());
    let running = std::thread::scope(|scope| -> Res<(u16, Value)> {
        let turn = scope.spawn(move || {
            busy_server.exec(
                &id2,
                json!({"code": "import time\nx = 1\ntime.sleep(1.5)\nx = 2", "sessionId": parent2}),
            )
        });
        std::thread::sleep(Duration::from_millis(500));
        let refused = fork(busy_server, &id, &parent, None)?;
        let ran = turn.join().map_err(|_| "the turn's thread panicked")??;
        assert_eq!(ran.1["status"], "success", "{}", ran.1);
        Ok(refused)
    })?;
    assert_eq!(
        (running.0, code(&running.1)),
        (409, "SANDBOX_BUSY".into()),
        "{}",
        running.1
    );
    let (status, answer) = fork(&server, &id, &parent, None)?;
    let (_, child) = forked(status, &answer)?;
    assert_eq!(turn(&server, &id, &child, "print(x)")?, "2\n");

    // A session whose turn timed out has ended, and so has forking it.
    let (_, ran) = server.exec(
        &id,
        json!({"code": "while True: pass", "sessionId": parent, "timeoutMs": 300}),
    )?;
    assert_eq!(ran["status"], "timeout", "{ran}");
    let (status, answer) = fork(&server, &id, &parent, None)?;
    assert_eq!(
        (status, code(&answer)),
        (409, "SESSION_ENDED".into()),
        "{answer}"
    );
    Ok(())
}

/// One MCP call over `/mcp` (streamable HTTP): the JSON-RPC answer of `body`.
fn mcp(server: &Server, session: Option<&str>, body: Value) -> Res<(Option<String>, Value)> {
    let mut request = ureq::post(&server.url("/mcp"))
        .timeout(Duration::from_secs(60))
        .set("accept", "application/json, text/event-stream");
    if let Some(session) = session {
        request = request.set("mcp-session-id", session);
    }
    let response = request.send_json(body)?;
    let id = response.header("mcp-session-id").map(str::to_owned);
    let text = response.into_string()?;
    // An SSE stream: the answer is the `data:` line that carries a JSON-RPC result.
    let answer = text
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .filter_map(|data| serde_json::from_str::<Value>(data.trim()).ok())
        .find(|message| message.get("result").is_some() || message.get("error").is_some())
        .unwrap_or(Value::Null);
    Ok((id, answer))
}

/// A tool's answer, as the JSON its text holds, and whether it is an error.
fn tool(server: &Server, session: &str, name: &str, arguments: Value) -> Res<(Value, bool)> {
    let (_, answer) = mcp(
        server,
        Some(session),
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": name, "arguments": arguments}}),
    )?;
    let result = &answer["result"];
    let text = result["content"][0]["text"]
        .as_str()
        .ok_or_else(|| format!("no text: {answer}"))?;
    Ok((
        serde_json::from_str(text)?,
        result["isError"].as_bool().unwrap_or(false),
    ))
}

fn mcp_session(server: &Server) -> Res<String> {
    let (id, answer) = mcp(
        server,
        None,
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-03-26", "capabilities": {},
            "clientInfo": {"name": "kiln-test", "version": "1"}}}),
    )?;
    assert!(answer["result"].is_object(), "{answer}");
    let id = id.ok_or("no Mcp-Session-Id")?;
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    ureq::post(&server.url("/mcp"))
        .set("accept", "application/json, text/event-stream")
        .set("mcp-session-id", &id)
        .send_json(initialized)?;
    Ok(id)
}

#[test]
fn mcp_forks_sessions_and_defaults_python_to_the_configured_template() -> TestResult {
    let server = server(&["--default-python-template", "python-data"])?;
    let mcp_id = mcp_session(&server)?;
    // run_python without a sandbox, and a session in a sandbox of its own: warm.
    let (ran, failed) = tool(&server, &mcp_id, "run_python", json!({"code": PANDAS_IN}))?;
    assert_eq!(
        (ran["stdout"].as_str(), failed),
        (Some("True\n"), false),
        "{ran}"
    );
    let (opened, _) = tool(&server, &mcp_id, "session_create", json!({}))?;
    let (sandbox, session) = (
        opened["sandbox_id"]
            .as_str()
            .ok_or("sandbox_id")?
            .to_owned(),
        opened["session_id"]
            .as_str()
            .ok_or("session_id")?
            .to_owned(),
    );
    let run = |session: &str, sandbox: &str, code: &str| -> Res<String> {
        let (ran, failed) = tool(
            &server,
            &mcp_id,
            "session_run",
            json!({"sandbox_id": sandbox, "session_id": session, "code": code}),
        )?;
        assert!(!failed, "{ran}");
        Ok(ran["stdout"].as_str().unwrap_or_default().to_owned())
    };
    assert_eq!(run(&session, &sandbox, PANDAS_IN)?, "True\n");
    run(&session, &sandbox, "x = 41")?;
    let (forked, failed) = tool(
        &server,
        &mcp_id,
        "fork_session",
        json!({"sandbox_id": sandbox, "session_id": session}),
    )?;
    assert!(!failed, "{forked}");
    assert_eq!(forked["sandbox_id"], sandbox.as_str(), "{forked}");
    assert_eq!(forked["forked_from"], session.as_str(), "{forked}");
    let child = forked["session_id"]
        .as_str()
        .ok_or("session_id")?
        .to_owned();
    assert_eq!(run(&child, &sandbox, "print(x + 1)")?, "42\n");
    let (forked, failed) = tool(
        &server,
        &mcp_id,
        "fork_session",
        json!({"sandbox_id": sandbox, "session_id": session, "with_workspace": true}),
    )?;
    assert!(!failed, "{forked}");
    let other = forked["sandbox_id"]
        .as_str()
        .ok_or("sandbox_id")?
        .to_owned();
    assert_ne!(other, sandbox);
    let child = forked["session_id"]
        .as_str()
        .ok_or("session_id")?
        .to_owned();
    assert_eq!(run(&child, &other, "print(x)")?, "41\n");
    let (refused, failed) = tool(
        &server,
        &mcp_id,
        "fork_session",
        json!({"sandbox_id": sandbox, "session_id": "ses_nope"}),
    )?;
    assert!(failed, "{refused}");
    assert_eq!(refused["error"]["code"], "SESSION_NOT_FOUND", "{refused}");
    // The REST default for {"language": "python"} is unchanged: the python template.
    let plain = server.new_sandbox("python")?;
    let (_, ran) = server.exec(&plain, json!({ "code": PANDAS_IN }))?;
    assert_eq!(ran["stdout"], "False\n", "{ran}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_agents_execute_code_starts_warm_when_configured() -> TestResult {
    use kiln_llm::fake::{FakeProvider, Step};
    let fake = FakeProvider::start(vec![
        Step::tool(
            "call_1",
            "execute_code",
            json!({"language": "python", "code": PANDAS_IN}),
        ),
        Step::Text("done".into()),
    ])
    .await?;
    let base_url = fake.base_url.clone();
    let (events, template) = tokio::task::spawn_blocking(move || -> Res<(Vec<Value>, Value)> {
        let env = [
            ("KILN_LLM_MODEL", "openai-compatible:fake"),
            ("KILN_LLM_BASE_URL", base_url.as_str()),
            ("KILN_DEFAULT_PYTHON_TEMPLATE", "python-data"),
        ];
        let server = start(Options {
            env: &env,
            ..Options::default()
        })?;
        let body = json!({"messages": [{"role": "user", "content": "is pandas in?"}]}).to_string();
        let reply = send(
            "POST",
            &server.url("/api/v1/chat"),
            None,
            Some(("application/json", body.as_bytes())),
        )?;
        assert_eq!(reply.status, 200);
        let events: Vec<Value> = String::from_utf8_lossy(&reply.body)
            .lines()
            .filter_map(|line| line.strip_prefix("data:"))
            .filter_map(|data| serde_json::from_str(data.trim()).ok())
            .collect();
        let sandbox = events
            .iter()
            .find_map(|e| e["sandbox_id"].as_str())
            .ok_or("no sandbox event")?
            .to_owned();
        let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{sandbox}"), None)?;
        Ok((events, info["template"].clone()))
    })
    .await??;
    assert_eq!(template, "python-data");
    let result = events
        .iter()
        .find_map(|e| e["result"].as_str())
        .ok_or("no tool result")?;
    assert!(result.contains("stdout:\nTrue\n"), "{result}");
    Ok(())
}

/// What a guest planted in its workspace (links out of it, a fifo, a hard link, a huge
/// sparse file) reaches a fork with its workspace as the history records it: links as
/// links, never followed; the fifo and the sparse file left out; the hard link a file of
/// its own. Nothing outside the two workspaces changes.
#[test]
fn attack_a_fork_with_its_workspace_copies_what_was_planted_safely() -> TestResult {
    use std::os::unix::fs::{MetadataExt, symlink};
    let server = server(&[])?;
    let id = server.new_sandbox("python")?;
    let parent = session(&server, &id, "python")?;
    turn(
        &server,
        &id,
        &parent,
        "open('one.txt', 'w').write('shared')",
    )?;
    let workspace = server.data.join("sandboxes").join(&id).join("workspace");
    let outside = server.data.join("outside.txt");
    std::fs::write(&outside, "secret")?;
    symlink(&outside, workspace.join("escape"))?;
    symlink(&server.data, workspace.join("data-dir"))?;
    std::fs::hard_link(workspace.join("one.txt"), workspace.join("two.txt"))?;
    // Over what the history records (64 MiB), within the workspace quota (2 GiB apparent).
    std::fs::File::create(workspace.join("sparse"))?.set_len(1 << 30)?;
    let fifo = std::ffi::CString::new(workspace.join("pipe").to_string_lossy().as_bytes())?;
    // SAFETY: mkfifo on a path string we own; no memory is shared.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);

    let (status, answer) = fork(&server, &id, &parent, Some(json!({"withWorkspace": true})))?;
    let (child_box, _) = forked(status, &answer)?;
    let copy = server
        .data
        .join("sandboxes")
        .join(&child_box)
        .join("workspace");
    assert_eq!(std::fs::read_link(copy.join("escape"))?, outside);
    assert_eq!(std::fs::read_link(copy.join("data-dir"))?, server.data);
    assert!(!copy.join("pipe").exists() && !copy.join("sparse").exists());
    let (one, two) = (
        std::fs::metadata(copy.join("one.txt"))?,
        std::fs::metadata(copy.join("two.txt"))?,
    );
    assert_ne!(one.ino(), two.ino(), "the hard link is a file of its own");
    assert_ne!(
        one.ino(),
        std::fs::metadata(workspace.join("one.txt"))?.ino()
    );
    std::fs::write(copy.join("two.txt"), "changed in the fork")?;
    assert_eq!(
        std::fs::read_to_string(workspace.join("one.txt"))?,
        "shared"
    );
    assert_eq!(std::fs::read_to_string(&outside)?, "secret");
    Ok(())
}
