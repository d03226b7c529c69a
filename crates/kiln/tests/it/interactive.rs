//! Issue 33, first part: a Linux sandbox's box through kiln's own API: its processes
//! (listed as the box sees them, signalled, a group at once), restart (every process ends,
//! files stay), pause and resume (the cgroup frozen: a forking process stays frozen, the
//! next command resumes it), and the refusals (kiln's agent, an unknown pid, a bad signal,
//! another tenant, a WebAssembly sandbox). Needs root, runc and the debian template.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::serve::*;

fn skip() -> bool {
    crate::common::skip_linux()
}

/// A new sandbox of a Linux `template` (`linux-debian`, `linux-python`).
fn new_box(server: &Server, template: &str) -> Res<String> {
    let (status, created) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({ "template": template })),
    )?;
    assert_eq!(status, 201, "{created}");
    Ok(created["containerId"].as_str().ok_or("no id")?.to_string())
}

fn sh(server: &Server, id: &str, script: &str) -> Res<Value> {
    let (status, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/exec"),
        Some(json!({"command": ["sh", "-c", script]})),
    )?;
    assert_eq!(status, 200, "{ran}");
    Ok(ran)
}

fn listed(server: &Server, id: &str) -> Res<Value> {
    let (status, list) = server.call("GET", &format!("/api/v1/sandboxes/{id}/processes"), None)?;
    assert_eq!(status, 200, "{list}");
    Ok(list)
}

/// The pids of the listed processes whose command line is `argv`.
fn pids_of(list: &Value, argv: &[&str]) -> Vec<u64> {
    list["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["argv"] == json!(argv))
        .filter_map(|p| p["pid"].as_u64())
        .collect()
}

fn read_file(server: &Server, id: &str, path: &str) -> Res<String> {
    let reply = send(
        "GET",
        &server.url(&format!("/api/v1/sandboxes/{id}/files/{path}")),
        server.key.as_deref(),
        None,
    )?;
    let text = String::from_utf8_lossy(&reply.body).into_owned();
    assert_eq!(reply.status, 200, "{text}");
    Ok(text)
}

#[test]
fn issue33_a_boxs_processes_are_listed_signalled_and_restarted() -> TestResult {
    if skip() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        auth: true,
        // No warm pool: this test counts the boxes (and volumes) its sandboxes make.
        extra: &["--linux", "--target-pool-size", "0"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let (status, created) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"template": "linux-debian"})),
    )?;
    assert_eq!(status, 201, "{created}");
    let id = created["containerId"].as_str().ok_or("no id")?.to_string();
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(
        info["state"], "stopped",
        "no box before the first command: {info}"
    );

    // Background processes an exec leaves behind survive it and are listed; one of them
    // leads a group of two.
    sh(&server, &id, "sleep 600 >/dev/null 2>&1 &")?;
    sh(
        &server,
        &id,
        "setsid sh -c 'sleep 601 & sleep 602 & wait' >/dev/null 2>&1 &",
    )?;
    // Background processes start after their exec answers: wait until all three run.
    let deadline = Instant::now() + Duration::from_secs(10);
    let list = loop {
        let list = listed(&server, &id)?;
        let running = ["600", "601", "602"]
            .iter()
            .all(|n| pids_of(&list, &["sleep", n]).len() == 1);
        if running {
            break list;
        }
        assert!(Instant::now() < deadline, "{list}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(list["state"], "running", "{list}");
    let agent = &list["processes"][0];
    assert_eq!(agent["pid"], 1, "{list}");
    assert_eq!(agent["agent"], true, "{list}");
    let sleeper = pids_of(&list, &["sleep", "600"]);
    assert_eq!(sleeper.len(), 1, "{list}");
    let sleeping = list["processes"]
        .as_array()
        .ok_or("no processes")?
        .iter()
        .find(|p| p["pid"].as_u64() == Some(sleeper[0]))
        .ok_or("gone")?;
    assert_eq!(
        sleeping["uid"], 1000,
        "the box's user, not the host's: {sleeping}"
    );
    assert!(sleeping["memoryBytes"].as_u64() > Some(0), "{sleeping}");
    assert!(
        sleeping["startedAt"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z'))
    );

    // A signal to one process.
    let signal = |pid: u64, body: Value| {
        server.call(
            "POST",
            &format!("/api/v1/sandboxes/{id}/processes/{pid}/signal"),
            Some(body),
        )
    };
    let (status, sent) = signal(sleeper[0], json!({"signal": "KILL"}))?;
    assert_eq!(
        (status, sent["signalled"].clone()),
        (200, json!(1)),
        "{sent}"
    );
    // A group at once: the two sleepers and their shell.
    let grouped = pids_of(&listed(&server, &id)?, &["sleep", "601"]);
    assert_eq!(grouped.len(), 1);
    let (status, sent) = signal(grouped[0], json!({"signal": 15, "group": true}))?;
    assert_eq!(
        (status, sent["signalled"].clone()),
        (200, json!(3)),
        "{sent}"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let list = listed(&server, &id)?;
        let left: Vec<u64> = ["600", "601", "602"]
            .iter()
            .flat_map(|n| pids_of(&list, &["sleep", n]))
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "still running: {list}");
        std::thread::sleep(Duration::from_millis(50));
    }

    // Refusals: the agent, a pid the box does not have, a bad signal, bad bodies.
    let (status, refused) = signal(1, json!({"signal": "KILL"}))?;
    assert_eq!(status, 400, "{refused}");
    assert!(refused.to_string().contains("agent"), "{refused}");
    let (status, refused) = signal(99_999, json!({}))?;
    assert_eq!(status, 404, "{refused}");
    for body in [
        json!({"signal": "NOPE"}),
        json!({"signal": 0}),
        json!({"signal": [9]}),
        json!({"sig": 9}),
    ] {
        let (status, refused) = signal(2, body.clone())?;
        assert_eq!(status, 400, "{body}: {refused}");
    }

    // Another tenant sees nothing of it.
    let other = create_key(&server.data, None)?;
    for (method, path) in [
        ("GET", format!("/api/v1/sandboxes/{id}/processes")),
        ("POST", format!("/api/v1/sandboxes/{id}/pause")),
        ("POST", format!("/api/v1/sandboxes/{id}/restart")),
    ] {
        let (status, _) = server.call_as(Some(&other), method, &path, None)?;
        assert_eq!(status, 404, "{method} {path}");
    }

    // Restart: a box a fork bomb filled gets its room back; files outside the workspace stay.
    sh(
        &server,
        &id,
        "echo kept > /var/tmp/kept; for i in 1 2 3 4 5; do sleep 700 & done",
    )?;
    let (status, restarted) =
        server.call("POST", &format!("/api/v1/sandboxes/{id}/restart"), None)?;
    assert_eq!(status, 200, "{restarted}");
    assert!(restarted["killed"].as_u64() >= Some(5), "{restarted}");
    let list = listed(&server, &id)?;
    assert_eq!(
        list["processes"].as_array().map(Vec::len),
        Some(1),
        "only the agent: {list}"
    );
    assert_eq!(sh(&server, &id, "cat /var/tmp/kept")?["stdout"], "kept\n");

    // A WebAssembly sandbox has no box.
    let (_, wasm) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"language": "python"})),
    )?;
    let wasm = wasm["containerId"].as_str().ok_or("no id")?;
    let (status, refused) =
        server.call("GET", &format!("/api/v1/sandboxes/{wasm}/processes"), None)?;
    assert_eq!(status, 400, "{refused}");
    Ok(())
}

#[test]
fn issue33_a_paused_box_is_frozen_even_while_forking_and_the_next_command_resumes_it() -> TestResult
{
    if skip() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        auth: true,
        // No warm pool: this test counts the boxes (and volumes) its sandboxes make.
        extra: &["--linux", "--target-pool-size", "0"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let id = new_box(&server, "linux-debian")?;
    // A counter in the workspace (read from the host, which needs nothing of the box), and
    // a process that forks without end.
    sh(
        &server,
        &id,
        "(i=0; while :; do i=$((i+1)); echo $i > count.txt; sleep 0.02; done) >/dev/null 2>&1 &
         (while :; do sleep 30 & sleep 0.01; done) >/dev/null 2>&1 &",
    )?;
    std::thread::sleep(Duration::from_millis(300));
    let (status, paused) = server.call("POST", &format!("/api/v1/sandboxes/{id}/pause"), None)?;
    assert_eq!(status, 200, "{paused}");
    assert_eq!(paused["state"], "paused", "{paused}");
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(info["state"], "paused", "{info}");

    // Frozen: the counter stops and the forker makes nothing more.
    let count = read_file(&server, &id, "count.txt")?;
    let tasks = listed(&server, &id)?["processes"].as_array().map(Vec::len);
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(
        read_file(&server, &id, "count.txt")?,
        count,
        "the counter moved while paused"
    );
    let list = listed(&server, &id)?;
    assert_eq!(list["state"], "paused");
    assert_eq!(list["processes"].as_array().map(Vec::len), tasks, "{list}");

    // A second pause is harmless; a command resumes the box and the counter goes on.
    let (status, again) = server.call("POST", &format!("/api/v1/sandboxes/{id}/pause"), None)?;
    assert_eq!(
        (status, again["state"].clone()),
        (200, json!("paused")),
        "{again}"
    );
    let ran = sh(&server, &id, "echo awake")?;
    assert_eq!(ran["stdout"], "awake\n", "{ran}");
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(info["state"], "running", "{info}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while read_file(&server, &id, "count.txt")? == count {
        assert!(
            Instant::now() < deadline,
            "the counter did not go on after resuming"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // Pause and resume by route; deleting a paused sandbox removes its box.
    let (_, paused) = server.call("POST", &format!("/api/v1/sandboxes/{id}/pause"), None)?;
    assert_eq!(paused["state"], "paused");
    let (status, resumed) = server.call("POST", &format!("/api/v1/sandboxes/{id}/resume"), None)?;
    assert_eq!(
        (status, resumed["state"].clone()),
        (200, json!("running")),
        "{resumed}"
    );
    server.call("POST", &format!("/api/v1/sandboxes/{id}/pause"), None)?;
    let (status, _) = server.call("DELETE", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(status, 204);
    let boxes = state.path();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let left = std::fs::read_dir(boxes)?
            .flatten()
            .filter_map(|e| std::fs::read_dir(e.path().join("boxes")).ok())
            .flat_map(|d| d.flatten())
            .count();
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a deleted paused sandbox's box is still there"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// A server for the box: `/echo` answers the path, query and headers it got as JSON,
/// `/ws` is a WebSocket echo (text frames, upper-cased back), anything else is a file.
const SERVER_PY: &str = r#"
import base64, hashlib, http.server, json, socketserver, struct, sys

class Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path.startswith("/echo"):
            body = json.dumps({"path": self.path, "headers": dict(self.headers)}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/ws":
            key = self.headers["Sec-WebSocket-Key"]
            accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", accept)
            self.end_headers()
            self.wfile.flush()
            while True:
                head = self.rfile.read(2)
                if len(head) < 2:
                    return
                opcode, length = head[0] & 15, head[1] & 127
                if length == 126:
                    length = struct.unpack(">H", self.rfile.read(2))[0]
                elif length == 127:
                    length = struct.unpack(">Q", self.rfile.read(8))[0]
                mask = self.rfile.read(4)
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(length)))
                if opcode == 8:
                    return
                reply = data.upper()
                self.wfile.write(bytes([0x81, len(reply)]) + reply)
                self.wfile.flush()
        else:
            super().do_GET()

socketserver.ThreadingTCPServer.allow_reuse_address = True
with socketserver.ThreadingTCPServer(("0.0.0.0", int(sys.argv[1])), Handler) as server:
    server.serve_forever()
"#;

#[test]
fn issue33_previews_reach_a_boxs_server_with_the_owners_key_or_a_token_and_nothing_else()
-> TestResult {
    if skip() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        auth: true,
        extra: &["--linux"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let id = new_box(&server, "linux-python")?;
    let (status, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/exec"),
        Some(json!({
            "command": ["sh", "-c", "head -c 20000000 /dev/urandom > big.bin; echo hello > index.html; python3 server.py 8000 >/dev/null 2>&1 &"],
            "files": {"server.py": SERVER_PY},
        })),
    )?;
    assert_eq!(status, 200, "{ran}");
    // The port shows once the server listens.
    let deadline = Instant::now() + Duration::from_secs(10);
    let ports = loop {
        let (status, ports) = server.call("GET", &format!("/api/v1/sandboxes/{id}/ports"), None)?;
        assert_eq!(status, 200, "{ports}");
        if ports["ports"].as_array().is_some_and(|p| !p.is_empty()) {
            break ports;
        }
        assert!(Instant::now() < deadline, "nothing listened: {ports}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let listed = &ports["ports"][0];
    assert_eq!(listed["port"], 8000, "{ports}");
    assert_eq!(listed["address"], "0.0.0.0", "{ports}");
    assert_eq!(listed["reachable"], true, "{ports}");
    assert_eq!(listed["name"], "python3", "{ports}");
    assert_eq!(listed["preview"], format!("/preview/{id}/8000/"), "{ports}");

    let get = |path: &str,
               key: Option<&str>,
               cookie: Option<&str>|
     -> Res<(u16, Vec<u8>, Option<String>)> {
        let mut request = ureq::get(&server.url(path));
        if let Some(key) = key {
            request = request.set("authorization", &format!("Bearer {key}"));
        }
        if let Some(cookie) = cookie {
            request = request.set("cookie", cookie);
        }
        let response = match request.call() {
            Ok(response) => response,
            Err(ureq::Error::Status(_, response)) => response,
            Err(e) => return Err(e.into()),
        };
        let status = response.status();
        let set_cookie = response.header("set-cookie").map(String::from);
        let mut body = Vec::new();
        std::io::Read::read_to_end(&mut response.into_reader(), &mut body)?;
        Ok((status, body, set_cookie))
    };
    let key = server.key.clone().ok_or("no key")?;
    // The owner's key: the box's own path, and none of kiln's credentials reach it.
    let (status, body, _) = get(&format!("/preview/{id}/8000/index.html"), Some(&key), None)?;
    assert_eq!((status, body.as_slice()), (200, b"hello\n".as_slice()));
    // Under kiln's origin a preview page runs sandboxed, in an opaque origin of its own.
    let policy = ureq::get(&server.url(&format!("/preview/{id}/8000/index.html")))
        .set("authorization", &format!("Bearer {key}"))
        .call()?
        .header("content-security-policy")
        .map(String::from)
        .unwrap_or_default();
    assert!(
        policy.starts_with("sandbox ") && !policy.contains("allow-same-origin"),
        "{policy}"
    );
    let (status, body, _) = get(&format!("/preview/{id}/8000/echo?a=1"), Some(&key), None)?;
    assert_eq!(status, 200);
    let echoed: Value = serde_json::from_slice(&body)?;
    assert_eq!(echoed["path"], "/echo?a=1", "{echoed}");
    let headers = echoed["headers"].to_string().to_ascii_lowercase();
    assert!(
        !headers.contains(&key.to_ascii_lowercase()),
        "the key reached the box: {echoed}"
    );
    assert!(!headers.contains("authorization"), "{echoed}");
    assert_eq!(echoed["headers"]["host"], "localhost:8000", "{echoed}");
    // A large file comes through whole.
    let (status, big, _) = get(&format!("/preview/{id}/8000/big.bin"), Some(&key), None)?;
    assert_eq!((status, big.len()), (200, 20_000_000));
    let through_files = send(
        "GET",
        &server.url(&format!("/api/v1/sandboxes/{id}/files/big.bin")),
        Some(&key),
        None,
    )?;
    assert!(
        through_files.body == big,
        "the preview changed the file's bytes"
    );

    // Nobody else: no key, another tenant's key, a token of another port or sandbox, a
    // forged or expired one: each is 404, as for an unknown sandbox.
    let other = create_key(&server.data, None)?;
    for (key, what) in [(None, "no key"), (Some(other.as_str()), "another tenant")] {
        let (status, body, _) = get(&format!("/preview/{id}/8000/index.html"), key, None)?;
        assert_eq!(status, 404, "{what}: {}", String::from_utf8_lossy(&body));
    }
    let link = |port: u16, ttl: u64| -> Res<Value> {
        let (status, link) = server.call(
            "POST",
            &format!("/api/v1/sandboxes/{id}/previews"),
            Some(json!({"port": port, "ttlSeconds": ttl})),
        )?;
        assert_eq!(status, 201, "{link}");
        Ok(link)
    };
    let made = link(8000, 600)?;
    let url = made["url"].as_str().ok_or("no url")?;
    let (status, body, cookie) = get(url, None, None)?;
    assert_eq!((status, body.as_slice()), (200, b"hello\n".as_slice()));
    let cookie = cookie.ok_or("no cookie")?;
    assert!(
        cookie.contains(&format!("Path=/preview/{id}/8000/")),
        "{cookie}"
    );
    assert!(cookie.contains("HttpOnly"), "{cookie}");
    let pair = cookie.split(';').next().unwrap_or_default().to_string();
    let (status, _, _) = get(&format!("/preview/{id}/8000/echo"), None, Some(&pair))?;
    assert_eq!(status, 200, "the cookie carries the page's own requests");
    let token = made["token"].as_str().ok_or("no token")?;
    let (status, _, _) = get(
        &format!("/preview/{id}/8001/?kiln_preview_token={token}"),
        None,
        None,
    )?;
    assert_eq!(status, 404, "a token for port 8000 opened 8001");
    let mut forged = token.to_string();
    forged.insert(3, 'x');
    let (status, _, _) = get(
        &format!("/preview/{id}/8000/?kiln_preview_token={forged}"),
        None,
        None,
    )?;
    assert_eq!(status, 404, "a forged token");
    let short = link(8000, 1)?;
    std::thread::sleep(Duration::from_millis(1100));
    let (status, _, _) = get(short["url"].as_str().ok_or("no url")?, None, None)?;
    assert_eq!(status, 404, "an expired token");
    for (port, ttl) in [(80, 60), (8000, 0), (8000, 10_000_000)] {
        let (status, refused) = server.call(
            "POST",
            &format!("/api/v1/sandboxes/{id}/previews"),
            Some(json!({"port": port, "ttlSeconds": ttl})),
        )?;
        assert_eq!(status, 400, "{port} {ttl}: {refused}");
    }
    let (status, _, _) = get(&format!("/preview/{id}/80/"), Some(&key), None)?;
    assert_eq!(status, 400, "a privileged port");
    let (status, body, _) = get(&format!("/preview/{id}/9999/"), Some(&key), None)?;
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));

    // WebSocket through the preview, and a paused box wakes for preview traffic.
    server.call("POST", &format!("/api/v1/sandboxes/{id}/pause"), None)?;
    let ws_url = server
        .url(&format!("/preview/{id}/8000/ws?kiln_preview_token={token}"))
        .replace("http://", "ws://");
    let (mut socket, _) = tungstenite::connect(ws_url.as_str())?;
    socket.send(tungstenite::Message::Text("hello box".into()))?;
    match socket.read()? {
        tungstenite::Message::Text(text) => assert_eq!(text.as_str(), "HELLO BOX"),
        other => panic!("the echo answered {other:?}"),
    }
    let _ = socket.close(None);
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(info["state"], "running", "{info}");
    Ok(())
}

type Socket = tungstenite::WebSocket<tungstenite::stream::MaybeTlsStream<std::net::TcpStream>>;

/// A WebSocket to a terminal, with the owner's key (or `key`).
fn attach(server: &Server, id: &str, tid: &str, query: &str, key: Option<&str>) -> Res<Socket> {
    use tungstenite::client::IntoClientRequest;
    let url = server
        .url(&format!("/api/v1/sandboxes/{id}/terminals/{tid}?{query}"))
        .replace("http://", "ws://");
    let mut request = url.into_client_request()?;
    let key = key
        .map(String::from)
        .or_else(|| server.key.clone())
        .ok_or("no key")?;
    request
        .headers_mut()
        .insert("authorization", format!("Bearer {key}").parse()?);
    let (socket, _) = tungstenite::connect(request)?;
    if let tungstenite::stream::MaybeTlsStream::Plain(stream) = socket.get_ref() {
        stream.set_read_timeout(Some(Duration::from_secs(15)))?;
    }
    Ok(socket)
}

/// The next control frame (output before it is added to `seen`).
fn control(socket: &mut Socket, seen: &mut Vec<u8>) -> Res<Value> {
    loop {
        match socket.read()? {
            tungstenite::Message::Text(text) => return Ok(serde_json::from_str(text.as_str())?),
            tungstenite::Message::Binary(data) => seen.extend_from_slice(&data),
            _ => {}
        }
    }
}

/// Reads output until it holds `needle` (controls are collected in `controls`).
fn until(
    socket: &mut Socket,
    seen: &mut Vec<u8>,
    needle: &str,
    controls: &mut Vec<Value>,
) -> Res<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !String::from_utf8_lossy(seen).contains(needle) {
        assert!(
            Instant::now() < deadline,
            "no {needle:?} in {:?}",
            String::from_utf8_lossy(seen)
        );
        match socket.read()? {
            tungstenite::Message::Binary(data) => seen.extend_from_slice(&data),
            tungstenite::Message::Text(text) => controls.push(serde_json::from_str(text.as_str())?),
            _ => {}
        }
    }
    Ok(())
}

fn keys(socket: &mut Socket, text: &str) -> Res<()> {
    socket.send(tungstenite::Message::Binary(
        text.as_bytes().to_vec().into(),
    ))?;
    Ok(())
}

fn say(socket: &mut Socket, value: Value) -> Res<()> {
    socket.send(tungstenite::Message::Text(value.to_string().into()))?;
    Ok(())
}

#[test]
fn issue33_terminals_detach_reattach_with_replay_viewers_takeover_and_a_bounded_ring() -> TestResult
{
    if skip() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        auth: true,
        extra: &["--linux"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let id = new_box(&server, "linux-debian")?;
    let (status, opened) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/terminals"),
        Some(json!({"cols": 100, "rows": 30})),
    )?;
    assert_eq!(status, 201, "{opened}");
    let tid = opened["terminalId"].as_str().ok_or("no id")?.to_string();
    assert_eq!(opened["page"], format!("/terminal/{id}/{tid}/"), "{opened}");

    // Attach, type, see the answer; resize and see the shell's view of it.
    let mut first = attach(&server, &id, &tid, "", None)?;
    let mut seen = Vec::new();
    let hello = control(&mut first, &mut seen)?;
    assert_eq!(
        (hello["type"].clone(), hello["writer"].clone()),
        (json!("attached"), json!(true)),
        "{hello}"
    );
    let mut controls = Vec::new();
    keys(&mut first, "echo kiln-$((6*7))\r")?;
    until(&mut first, &mut seen, "kiln-42", &mut controls)?;
    say(
        &mut first,
        json!({"type": "resize", "cols": 50, "rows": 10}),
    )?;
    keys(&mut first, "stty size\r")?;
    until(&mut first, &mut seen, "10 50", &mut controls)?;

    // A viewer watches but cannot type.
    let mut viewer = attach(&server, &id, &tid, "mode=read", None)?;
    let mut watched = Vec::new();
    let hello = control(&mut viewer, &mut watched)?;
    assert_eq!(hello["writer"], false, "{hello}");
    keys(&mut viewer, "echo from-the-viewer\r")?;
    // Something that keeps running while nobody is attached.
    keys(
        &mut first,
        "i=0; while :; do echo tick$i; i=$((i+1)); sleep 0.1; done\r",
    )?;
    until(&mut first, &mut seen, "tick3", &mut controls)?;
    until(&mut viewer, &mut watched, "tick3", &mut Vec::new())?;
    drop(first);
    drop(viewer);
    let (_, listed) = server.call("GET", &format!("/api/v1/sandboxes/{id}/terminals"), None)?;
    let before = listed["terminals"][0]["outputBytes"]
        .as_u64()
        .ok_or("no count")?;
    std::thread::sleep(Duration::from_millis(800));
    let (_, listed) = server.call("GET", &format!("/api/v1/sandboxes/{id}/terminals"), None)?;
    assert!(
        listed["terminals"][0]["outputBytes"].as_u64() > Some(before),
        "the loop stopped while detached: {listed}"
    );

    // Reattach from the start: the replay holds what came before, and the loop still runs.
    let mut again = attach(&server, &id, &tid, "offset=0", None)?;
    let mut replayed = Vec::new();
    let hello = control(&mut again, &mut replayed)?;
    assert_eq!(
        (hello["offset"].clone(), hello["lost"].clone()),
        (json!(0), json!(0)),
        "{hello}"
    );
    let end = hello["end"].as_u64().ok_or("no end")? as usize;
    while replayed.len() < end {
        if let tungstenite::Message::Binary(data) = again.read()? {
            replayed.extend_from_slice(&data);
        }
    }
    let text = String::from_utf8_lossy(&replayed).into_owned();
    assert!(text.contains("kiln-42") && text.contains("tick3"), "{text}");
    assert!(
        !text.contains("from-the-viewer"),
        "a viewer's keys reached the shell"
    );
    let last_tick = text.matches("tick").count();
    until(
        &mut again,
        &mut replayed,
        &format!("tick{}", last_tick + 2),
        &mut Vec::new(),
    )?;

    // Takeover: the writer is told it only watches now.
    let mut owner = attach(&server, &id, &tid, "takeover=true&offset=999999999", None)?;
    let hello = control(&mut owner, &mut Vec::new())?;
    assert_eq!(hello["writer"], true, "{hello}");
    let mut told = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut sink = Vec::new();
        let said = control(&mut again, &mut sink)?;
        if said["type"] == "writer" {
            assert_eq!(said["writer"], false, "{said}");
            break;
        }
        told.push(said);
        assert!(Instant::now() < deadline, "{told:?}");
    }
    // A signal stops the loop; a flood of output stays within the ring.
    say(&mut owner, json!({"type": "signal", "signal": "INT"}))?;
    let mut out = Vec::new();
    keys(
        &mut owner,
        "head -c 3000000 /dev/zero | tr '\\0' x; echo; echo flood-$((1+1))\r",
    )?;
    until(&mut owner, &mut out, "flood-2", &mut Vec::new())?;
    drop(owner);
    drop(again);
    let mut late = attach(&server, &id, &tid, "mode=read", None)?;
    let hello = control(&mut late, &mut Vec::new())?;
    assert!(hello["lost"].as_u64() > Some(0), "{hello}");
    let kept = hello["end"].as_u64().unwrap_or(0) - hello["offset"].as_u64().unwrap_or(0);
    assert!(kept <= 1 << 20, "the ring kept {kept} bytes");
    drop(late);

    // Refusals: bad controls, another tenant, an unknown terminal.
    let other = create_key(&server.data, None)?;
    let (status, _) = server.call_as(
        Some(&other),
        "GET",
        &format!("/api/v1/sandboxes/{id}/terminals"),
        None,
    )?;
    assert_eq!(status, 404);
    assert!(
        attach(&server, &id, &tid, "", Some(&other)).is_err(),
        "another tenant attached"
    );
    let (status, _) = server.call(
        "GET",
        &format!("/api/v1/sandboxes/{id}/terminals/t999"),
        None,
    )?;
    assert_eq!(status, 404);
    for body in [
        json!({"cols": 0}),
        json!({"rows": 5000}),
        json!({"shell": "zsh"}),
    ] {
        let (status, refused) = server.call(
            "POST",
            &format!("/api/v1/sandboxes/{id}/terminals"),
            Some(body.clone()),
        )?;
        assert_eq!(status, 400, "{body}: {refused}");
    }

    // The browser page, by a link's token (which opens only this terminal).
    let (status, link) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/terminals/{tid}/links"),
        Some(json!({})),
    )?;
    assert_eq!(status, 201, "{link}");
    let page = send(
        "GET",
        &server.url(link["url"].as_str().ok_or("no url")?),
        None,
        None,
    )?;
    assert_eq!(page.status, 200);
    assert!(String::from_utf8_lossy(&page.body).contains("/terminal/assets/xterm.js"));
    let token = link["url"]
        .as_str()
        .unwrap_or_default()
        .split("kiln_preview_token=")
        .nth(1)
        .unwrap_or_default();
    let elsewhere = send(
        "GET",
        &server.url(&format!("/terminal/{id}/t999/?kiln_preview_token={token}")),
        None,
        None,
    )?;
    assert_eq!(elsewhere.status, 404);
    let asset = send("GET", &server.url("/terminal/assets/xterm.js"), None, None)?;
    assert_eq!(asset.status, 200);
    // The page's socket, with the link's cookie: from kiln's own page only. A preview's page
    // (an opaque origin, `null`) or another site cannot drive the terminal with it.
    let socket = |origin: &str| -> Res<u16> {
        use tungstenite::client::IntoClientRequest;
        let url = server
            .url(&format!("/terminal/{id}/{tid}/ws"))
            .replace("http://", "ws://");
        let mut request = url.into_client_request()?;
        request
            .headers_mut()
            .insert("cookie", format!("kiln_preview={token}").parse()?);
        request.headers_mut().insert("origin", origin.parse()?);
        Ok(match tungstenite::connect(request) {
            Ok(_) => 101,
            Err(tungstenite::Error::Http(response)) => response.status().as_u16(),
            Err(e) => return Err(e.into()),
        })
    };
    assert_eq!(socket(&server.base)?, 101, "kiln's own page");
    assert_eq!(socket("null")?, 403, "a sandboxed preview's page");
    assert_eq!(socket("http://evil.example")?, 403, "another site");

    let (status, _) = server.call(
        "DELETE",
        &format!("/api/v1/sandboxes/{id}/terminals/{tid}"),
        None,
    )?;
    assert_eq!(status, 204);
    let (_, listed) = server.call("GET", &format!("/api/v1/sandboxes/{id}/terminals"), None)?;
    assert_eq!(listed["terminals"], json!([]), "{listed}");
    Ok(())
}

/// Headless Chromium driven over the DevTools protocol: open a page, evaluate JavaScript in
/// it, close it.
struct Browser {
    child: std::process::Child,
    port: u16,
    _profile: tempfile::TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Tab {
    id: String,
    socket: tungstenite::WebSocket<tungstenite::stream::MaybeTlsStream<std::net::TcpStream>>,
    next: u64,
}

impl Browser {
    fn start() -> Res<Browser> {
        use std::io::BufRead;
        let profile = tempfile::tempdir()?;
        let mut child = std::process::Command::new(crate::common::chromium()?)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--remote-debugging-port=0",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        let stderr = child.stderr.take().ok_or("no stderr")?;
        let mut lines = std::io::BufReader::new(stderr).lines();
        let port = loop {
            let line = lines.next().ok_or("chromium ended before it listened")??;
            if let Some(rest) = line.split("ws://127.0.0.1:").nth(1) {
                break rest.split('/').next().unwrap_or_default().parse()?;
            }
        };
        // Keep reading its stderr so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Ok(Browser {
            child,
            port,
            _profile: profile,
        })
    }

    fn open(&self, url: &str) -> Res<Tab> {
        let target: Value = ureq::put(&format!("http://127.0.0.1:{}/json/new?{url}", self.port))
            .call()?
            .into_json()?;
        let ws = target["webSocketDebuggerUrl"]
            .as_str()
            .ok_or("no debugger url")?;
        let (socket, _) = tungstenite::connect(ws)?;
        Ok(Tab {
            id: target["id"].as_str().unwrap_or_default().to_string(),
            socket,
            next: 1,
        })
    }

    fn close(&self, tab: Tab) -> Res<()> {
        drop(tab.socket);
        ureq::get(&format!(
            "http://127.0.0.1:{}/json/close/{}",
            self.port, tab.id
        ))
        .call()?;
        Ok(())
    }
}

impl Tab {
    /// The value of a JavaScript expression in the page.
    fn eval(&mut self, expression: &str) -> Res<Value> {
        let id = self.next;
        self.next += 1;
        self.socket.send(tungstenite::Message::Text(
            json!({"id": id, "method": "Runtime.evaluate",
                   "params": {"expression": expression, "returnByValue": true}})
            .to_string()
            .into(),
        ))?;
        loop {
            if let tungstenite::Message::Text(text) = self.socket.read()? {
                let reply: Value = serde_json::from_str(text.as_str())?;
                if reply["id"] == id {
                    return Ok(reply["result"]["result"]["value"].clone());
                }
            }
        }
    }

    /// Waits until `expression` is true in the page.
    fn wait(&mut self, expression: &str, what: &str) -> Res<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.eval(expression)? != json!(true) {
            assert!(
                Instant::now() < deadline,
                "the page never had {what}: {}",
                self.screen()?
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// The terminal's text, scrollback included.
    fn screen(&mut self) -> Res<String> {
        let text = self.eval(
            "(() => { if (!window.kiln) return ''; const b = kiln.term.buffer.active; let s = ''; \
             for (let i = 0; i < b.length; i++) s += b.getLine(i).translateToString(true) + '\\n'; return s; })()",
        )?;
        Ok(text.as_str().unwrap_or_default().to_string())
    }
}

#[test]
fn issue33_a_terminal_in_a_browser_survives_closing_its_tab() -> TestResult {
    if skip() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        auth: true,
        extra: &["--linux"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let id = new_box(&server, "linux-debian")?;
    let (_, opened) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/terminals"),
        Some(json!({})),
    )?;
    let tid = opened["terminalId"].as_str().ok_or("no id")?.to_string();
    let (_, link) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/terminals/{tid}/links"),
        Some(json!({"ttlSeconds": 600})),
    )?;
    let url = server.url(link["url"].as_str().ok_or("no url")?);

    let browser = Browser::start()?;
    let mut tab = browser.open(&url)?;
    tab.wait("!!(window.kiln && kiln.state.writer)", "the keyboard")?;
    // Typed as a user would (xterm's input is what a keystroke makes).
    tab.eval("kiln.term.input('echo browser-$((2*21))\\r')")?;
    tab.wait("(() => { const b = kiln.term.buffer.active; for (let i = 0; i < b.length; i++) if (b.getLine(i).translateToString(true).includes('browser-42')) return true; return false; })()", "the command's output")?;
    // Resized in the page: the shell sees the new size.
    tab.eval("kiln.term.resize(60, 15)")?;
    tab.eval("kiln.term.input('stty size\\r')")?;
    tab.wait("(() => { const b = kiln.term.buffer.active; for (let i = 0; i < b.length; i++) if (b.getLine(i).translateToString(true).trim() === '15 60') return true; return false; })()", "the new size")?;
    tab.eval("kiln.term.input('i=0; while :; do echo ping$i; i=$((i+1)); sleep 0.2; done\\r')")?;
    tab.wait("(() => { const b = kiln.term.buffer.active; for (let i = 0; i < b.length; i++) if (b.getLine(i).translateToString(true).startsWith('ping3')) return true; return false; })()", "the loop's output")?;
    browser.close(tab)?;
    std::thread::sleep(Duration::from_millis(1500));

    // A new tab: the scrollback is there, and the loop went on while no one looked.
    let mut tab = browser.open(&url)?;
    tab.wait("!!(window.kiln && kiln.state.open)", "a connection")?;
    tab.wait("(() => { const b = kiln.term.buffer.active; for (let i = 0; i < b.length; i++) if (b.getLine(i).translateToString(true).startsWith('ping12')) return true; return false; })()", "the loop's later output")?;
    let screen = tab.screen()?;
    assert!(screen.contains("browser-42"), "no scrollback: {screen}");
    let (_, listed) = server.call("GET", &format!("/api/v1/sandboxes/{id}/terminals"), None)?;
    assert_eq!(listed["terminals"][0]["exited"], false, "{listed}");
    Ok(())
}

/// Host processes whose command line is exactly `argv`, and whether each is frozen.
fn host_processes(argv: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            (String::from_utf8_lossy(&cmdline).replace('\0', " ").trim() == argv).then_some(pid)
        })
        .collect()
}

/// kill -9 of kiln while a box is paused: its frozen processes cannot end by themselves (the
/// agent that would kill them is frozen too), so they stay until the next kiln on the same
/// state folder, which thaws and removes the box: no orphan is left.
#[test]
fn issue33_a_paused_box_of_a_killed_kiln_is_thawed_and_removed_by_the_next_one() -> TestResult {
    if skip() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let mut server = start(Options {
        extra: &["--linux"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let id = new_box(&server, "linux-debian")?;
    sh(&server, &id, "sleep 86397.5 >/dev/null 2>&1 &")?;
    let (_, paused) = server.call("POST", &format!("/api/v1/sandboxes/{id}/pause"), None)?;
    assert_eq!(paused["state"], "paused");
    server.child.0.kill()?;
    server.child.0.wait()?;
    std::thread::sleep(Duration::from_millis(500));
    let frozen = host_processes("sleep 86397.5");
    assert_eq!(
        frozen.len(),
        1,
        "the frozen process should wait for the next kiln"
    );

    // The next kiln on the folder (here a `kiln exec`) thaws and removes what is left.
    let out = kiln()
        .args(["exec", "--template", "debian", "--", "true"])
        .env("KILN_STATE_DIR", state.path())
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while !host_processes("sleep 86397.5").is_empty() {
        assert!(
            Instant::now() < deadline,
            "an orphan of the paused box is left"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let boxes: Vec<_> = std::fs::read_dir(state.path())?
        .flatten()
        .filter_map(|p| std::fs::read_dir(p.path().join("boxes")).ok())
        .flat_map(|d| d.flatten())
        .collect();
    assert!(boxes.is_empty(), "{boxes:?}");
    Ok(())
}

/// An idle box is paused (by default) with everything in it, or stopped with
/// `--box-idle-action stop` (its files, in and out of the workspace, kept; its processes
/// gone); an open terminal is activity.
#[test]
fn issue33_an_idle_box_is_paused_with_everything_kept_or_stopped_when_told() -> TestResult {
    if skip() {
        return Ok(());
    }
    for action in ["pause", "stop"] {
        let state = tempfile::tempdir()?;
        let state_dir = state.path().to_str().ok_or("path")?;
        let server = start(Options {
            extra: &["--linux", "--box-idle", "2s", "--box-idle-action", action],
            env: &[("KILN_STATE_DIR", state_dir)],
            ..Options::default()
        })?;
        let make = || -> Res<String> {
            let (_, created) = server.call(
                "POST",
                "/api/v1/sandboxes",
                Some(json!({"template": "linux-debian"})),
            )?;
            Ok(created["containerId"].as_str().ok_or("no id")?.to_string())
        };
        let (idle, busy) = (make()?, make()?);
        sh(
            &server,
            &idle,
            "echo kept > /var/tmp/outside; sleep 600 >/dev/null 2>&1 &",
        )?;
        sh(&server, &busy, "true")?;
        let (status, _) = server.call(
            "POST",
            &format!("/api/v1/sandboxes/{busy}/terminals"),
            Some(json!({})),
        )?;
        assert_eq!(status, 201);
        let wanted = if action == "pause" {
            "paused"
        } else {
            "stopped"
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{idle}"), None)?;
            if info["state"] == wanted {
                break;
            }
            assert!(Instant::now() < deadline, "{action}: still {info}");
            std::thread::sleep(Duration::from_millis(200));
        }
        let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{busy}"), None)?;
        assert_eq!(
            info["state"], "running",
            "a box with a terminal idled: {info}"
        );
        // The next command resumes (or restarts) it.
        let ran = sh(
            &server,
            &idle,
            "cat /var/tmp/outside 2>/dev/null; pgrep -x sleep >/dev/null && echo sleeping; true",
        )?;
        let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{idle}"), None)?;
        assert_eq!(info["state"], "running", "{info}");
        // Files outside the workspace live on the sandbox's volume: a stopped box's
        // successor finds them too; only a paused box keeps its processes.
        if action == "pause" {
            assert_eq!(ran["stdout"], "kept\nsleeping\n", "{action}: {ran}");
        } else {
            assert_eq!(ran["stdout"], "kept\n", "{action}: {ran}");
        }
    }
    Ok(())
}

/// What a box writes outside its workspace lives on the sandbox's volume: a kiln restart (its
/// boxes gone) finds it again, and it counts against the sandbox's disk with the workspace.
#[test]
fn issue33_files_outside_the_workspace_outlive_a_kiln_restart_within_the_sandboxes_disk()
-> TestResult {
    if skip() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let data = tempfile::tempdir()?;
    let id = {
        let server = start(Options {
            data: Some(data.path()),
            extra: &["--linux"],
            env: &[("KILN_STATE_DIR", state_dir)],
            ..Options::default()
        })?;
        let (status, created) = server.call(
            "POST",
            "/api/v1/sandboxes",
            Some(json!({"template": "linux-debian", "resources": {"disk_mb": 48}})),
        )?;
        assert_eq!(status, 201, "{created}");
        let id = created["containerId"].as_str().ok_or("no id")?.to_string();
        let ran = sh(
            &server,
            &id,
            "echo kept > /var/tmp/outside && mkdir -p /home/user/.config && echo cfg > /home/user/.config/app && \
             head -c 50000000 /dev/zero > /var/tmp/big 2>/dev/null; echo \"big: $?\"; rm -f /var/tmp/big; \
             head -c 20000000 /dev/zero > in-workspace.bin && echo ok",
        )?;
        // One disk for both: 50 MB outside the workspace does not fit a 48 MiB sandbox.
        assert_eq!(ran["stdout"], "big: 1\nok\n", "{ran}");
        let mut server = server;
        // SAFETY: kill sends a signal to the server's pid, which this test started.
        unsafe { libc::kill(server.child.0.id() as i32, libc::SIGTERM) };
        assert!(server.child.0.wait()?.success());
        id
    };
    let server = start(Options {
        data: Some(data.path()),
        extra: &["--linux"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let ran = sh(
        &server,
        &id,
        "cat /var/tmp/outside /home/user/.config/app; stat -c %s in-workspace.bin; id -un",
    )?;
    assert_eq!(ran["stdout"], "kept\ncfg\n20000000\nuser\n", "{ran}");
    Ok(())
}

/// Hibernation without CRIU (`--criu none`) returns a box's memory and keeps its files; the
/// answer says its processes ended and why. An idle box is paused, then hibernated after
/// `--box-hibernate-after`.
#[test]
fn issue33_hibernation_returns_a_boxs_memory_keeps_its_files_and_says_what_became_of_its_processes()
-> TestResult {
    if skip() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        // No warm pool: this test counts the boxes (and volumes) its sandboxes make.
        extra: &["--linux", "--target-pool-size", "0", "--criu", "none"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let make = |server: &Server| -> Res<String> {
        let (_, created) = server.call(
            "POST",
            "/api/v1/sandboxes",
            Some(json!({"template": "linux-debian"})),
        )?;
        Ok(created["containerId"].as_str().ok_or("no id")?.to_string())
    };
    // By hand: a box with processes, and a file outside the workspace.
    let id = make(&server)?;
    sh(
        &server,
        &id,
        "echo kept > /var/tmp/outside; (head -c 67108864 /dev/zero | tail -c 1 >/dev/null; sleep 599.25) >/dev/null 2>&1 & sleep 599.25 >/dev/null 2>&1 &",
    )?;
    let boxes_before = std::fs::read_dir(state.path())?
        .flatten()
        .filter_map(|p| std::fs::read_dir(p.path().join("boxes")).ok())
        .flat_map(|d| d.flatten())
        .count();
    assert!(boxes_before >= 1);
    let (status, slept) =
        server.call("POST", &format!("/api/v1/sandboxes/{id}/hibernate"), None)?;
    assert_eq!(status, 200, "{slept}");
    assert_eq!(slept["state"], "hibernated", "{slept}");
    let why = slept["processes"].as_str().unwrap_or_default();
    assert!(
        why.contains("processes ended") && why.contains("CRIU"),
        "{slept}"
    );
    let list = listed(&server, &id)?;
    assert_eq!(
        (list["state"].clone(), list["processes"].clone()),
        (json!("hibernated"), json!([])),
        "{list}"
    );
    assert!(
        host_processes("sleep 599.25").is_empty(),
        "a hibernated box's process still runs"
    );
    // The box is gone (its cgroup, its memory with it); its folder follows at once (the
    // runtime's bookkeeping is done in the background).
    let boxes_now = || -> Res<usize> {
        Ok(std::fs::read_dir(state.path())?
            .flatten()
            .filter_map(|p| std::fs::read_dir(p.path().join("boxes")).ok())
            .flat_map(|d| d.flatten())
            .count())
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while boxes_now()? != boxes_before - 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        boxes_now()?,
        boxes_before - 1,
        "the hibernated box is still there"
    );
    // The next command brings a box back, from the files.
    let ran = sh(
        &server,
        &id,
        "cat /var/tmp/outside; pgrep -x sleep || echo no-sleep",
    )?;
    assert_eq!(ran["stdout"], "kept\nno-sleep\n", "{ran}");
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(info["state"], "running", "{info}");

    // By policy: idle → paused → hibernated.
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        extra: &["--linux", "--box-idle", "1s", "--box-hibernate-after", "1s"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let idle = make(&server)?;
    sh(&server, &idle, "true")?;
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{idle}"), None)?;
        let now = info["state"].as_str().unwrap_or_default().to_string();
        if seen.last() != Some(&now) {
            seen.push(now.clone());
        }
        if now == "hibernated" {
            break;
        }
        assert!(Instant::now() < deadline, "states: {seen:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(seen.contains(&"paused".to_string()), "states: {seen:?}");
    Ok(())
}

/// A plain HTTP/1.1 GET to `base` with its own `Host`: (status, head, body).
fn get_with_host(
    base: &str,
    host: &str,
    path: &str,
    extra: &[(&str, &str)],
) -> Res<(u16, String, Vec<u8>)> {
    use std::io::Write;
    let address = base.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(address)?;
    stream.set_read_timeout(Some(Duration::from_secs(15)))?;
    let mut head = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (name, value) in extra {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    let mut answer = Vec::new();
    std::io::Read::read_to_end(&mut stream, &mut answer)?;
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no head")?;
    let head = String::from_utf8_lossy(&answer[..split]).into_owned();
    let status = head.split(' ').nth(1).ok_or("no status")?.parse()?;
    let mut body = answer[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        // Dechunk.
        let mut plain = Vec::new();
        let mut rest = body.as_slice();
        while let Some(end) = rest.windows(2).position(|w| w == b"\r\n") {
            let size = usize::from_str_radix(String::from_utf8_lossy(&rest[..end]).trim(), 16)?;
            if size == 0 {
                break;
            }
            plain.extend_from_slice(&rest[end + 2..end + 2 + size]);
            rest = &rest[end + 2 + size + 2..];
        }
        body = plain;
    }
    Ok((status, head, body))
}

#[test]
fn issue33_previews_by_host_name_with_a_preview_domain() -> TestResult {
    if skip() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        auth: true,
        extra: &["--linux", "--preview-domain", "preview.test"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let id = new_box(&server, "linux-python")?;
    sh(
        &server,
        &id,
        "mkdir -p site/css && echo '<h1>home</h1>' > site/index.html && echo 'h1{}' > site/css/a.css && cd site && python3 -m http.server 8000 >/dev/null 2>&1 &",
    )?;
    let host = format!("8000-{}.preview.test", id.trim_start_matches("sb_"));
    let key = server.key.clone().ok_or("no key")?;
    let bearer = format!("Bearer {key}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _, body) =
            get_with_host(&server.base, &host, "/", &[("authorization", &bearer)])?;
        if status == 200 {
            assert!(String::from_utf8_lossy(&body).contains("<h1>home</h1>"));
            break;
        }
        assert!(Instant::now() < deadline, "{status}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The site's own absolute paths work at its root.
    let (status, _, body) = get_with_host(
        &server.base,
        &host,
        "/css/a.css",
        &[("authorization", &bearer)],
    )?;
    assert_eq!((status, body.as_slice()), (200, b"h1{}\n".as_slice()));
    let (_, ports) = server.call("GET", &format!("/api/v1/sandboxes/{id}/ports"), None)?;
    assert_eq!(ports["ports"][0]["host"], host, "{ports}");
    // No key: 404; another tenant: 404; a token: 200 and a cookie for this host.
    let (status, _, _) = get_with_host(&server.base, &host, "/", &[])?;
    assert_eq!(status, 404);
    let other = format!("Bearer {}", create_key(&server.data, None)?);
    let (status, _, _) = get_with_host(&server.base, &host, "/", &[("authorization", &other)])?;
    assert_eq!(status, 404);
    let (_, link) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/previews"),
        Some(json!({"port": 8000})),
    )?;
    let token = link["token"].as_str().ok_or("no token")?;
    let (status, head, _) = get_with_host(
        &server.base,
        &host,
        &format!("/?kiln_preview_token={token}"),
        &[],
    )?;
    assert_eq!(status, 200, "{head}");
    let cookie = head
        .lines()
        .find_map(|l| {
            l.strip_prefix("set-cookie: ")
                .or_else(|| l.strip_prefix("Set-Cookie: "))
        })
        .ok_or("no cookie")?;
    assert!(cookie.contains("Path=/;"), "{cookie}");
    let pair = cookie.split(';').next().unwrap_or_default();
    let (status, _, _) = get_with_host(&server.base, &host, "/css/a.css", &[("cookie", pair)])?;
    assert_eq!(status, 200);
    // The token opens this port only.
    let elsewhere = format!("8001-{}.preview.test", id.trim_start_matches("sb_"));
    let (status, _, _) = get_with_host(&server.base, &elsewhere, "/", &[("cookie", pair)])?;
    assert_eq!(status, 404);
    // The API itself is untouched on the server's own name.
    let (status, _) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(status, 200);
    Ok(())
}

/// Keystrokes in a terminal are use: a sandbox without a fixed life lives on while someone
/// types, with no other request, and ends its idle window after they stop.
#[test]
fn issue33_terminal_keystrokes_keep_a_sandbox_without_a_fixed_life_alive() -> TestResult {
    if skip() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        auth: true,
        extra: &["--linux"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let (status, created) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"template": "linux-debian", "lifecycle": {"terminateAfterIdleMs": 3000}})),
    )?;
    assert_eq!(status, 201, "{created}");
    let id = created["containerId"].as_str().ok_or("id")?.to_string();
    let (status, opened) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/terminals"),
        Some(json!({})),
    )?;
    assert_eq!(status, 201, "{opened}");
    let tid = opened["terminalId"].as_str().ok_or("tid")?.to_string();
    let mut socket = attach(&server, &id, &tid, "", None)?;
    let mut seen = Vec::new();
    control(&mut socket, &mut seen)?;
    let typing = Instant::now();
    let mut i = 0;
    while typing.elapsed() < Duration::from_millis(5500) {
        keys(&mut socket, &format!("echo tick{i}\n"))?;
        i += 1;
        std::thread::sleep(Duration::from_millis(300));
    }
    let (status, info) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(status, 200, "a sandbox in use ended: {info}");
    drop(socket);
    std::thread::sleep(Duration::from_millis(4500));
    let (status, _) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(status, 404, "an idle sandbox lived on");
    Ok(())
}

/// Hibernation with CRIU: a box's processes are checkpointed to disk (its memory goes back
/// to the host) and come back as they were: a server's in-memory count, a terminal's shell
/// variable (the keystroke wakes the box; the attached socket carries on), a Python
/// session's variables, on the next request of any kind, and after a kiln restart too. A
/// checkpoint that no longer restores falls back to the files, and says so.
#[test]
fn issue33_hibernation_checkpoints_processes_terminals_and_sessions_and_restores_them_even_after_a_restart()
-> TestResult {
    if skip() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let data = tempfile::tempdir()?;
    let env = [("KILN_STATE_DIR", state_dir)];
    let options = || Options {
        auth: true,
        data: Some(data.path()),
        extra: &["--linux"],
        env: &env,
        hosts: None,
    };
    let server = start(options())?;
    let id = new_box(&server, "linux-python")?;
    let (status, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/exec"),
        Some(json!({
            "command": ["sh", "-c", "echo kept > /var/tmp/outside; python3 counter.py 8000 >/dev/null 2>&1 &"],
            "files": {"counter.py": COUNTER_PY},
        })),
    )?;
    assert_eq!(status, 200, "{ran}");
    let count = |server: &Server| preview_body(server, &id, 8000);
    assert_eq!(count(&server)?, "1");
    assert_eq!(count(&server)?, "2");

    // A terminal with a shell variable, attached through the hibernation.
    let (status, opened) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/terminals"),
        Some(json!({"cols": 80, "rows": 24})),
    )?;
    assert_eq!(status, 201, "{opened}");
    let tid = opened["terminalId"].as_str().ok_or("no id")?.to_string();
    let mut socket = attach(&server, &id, &tid, "", None)?;
    let (mut seen, mut controls) = (Vec::new(), Vec::new());
    control(&mut socket, &mut seen)?;
    keys(&mut socket, "X=kiln-$((6*7)); echo set-$X\r")?;
    until(&mut socket, &mut seen, "set-kiln-42", &mut controls)?;
    // A Python session with a variable.
    let (status, opened) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/sessions"),
        Some(json!({"language": "python"})),
    )?;
    assert_eq!(status, 201, "{opened}");
    let session = opened["sessionId"]
        .as_str()
        .ok_or("no session")?
        .to_string();
    let turn = |server: &Server, code: &str| -> Res<String> {
        let (status, body) = server.exec(&id, json!({"code": code, "sessionId": session}))?;
        assert_eq!(
            (status, body["status"].as_str()),
            (200, Some("success")),
            "{body}"
        );
        Ok(body["stdout"].as_str().unwrap_or_default().to_string())
    };
    turn(&server, "v = 41")?;

    let (status, slept) =
        server.call("POST", &format!("/api/v1/sandboxes/{id}/hibernate"), None)?;
    assert_eq!(status, 200, "{slept}");
    assert_eq!(slept["state"], "hibernated", "{slept}");
    let said = slept["processes"].as_str().unwrap_or_default();
    assert!(said.contains("were checkpointed"), "{slept}");
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(info["state"], "hibernated", "{info}");
    assert!(
        host_processes("counter.py 8000").is_empty(),
        "a hibernated box's server still runs on the host"
    );
    let checkpoint = data.path().join(format!("sandboxes/{id}/checkpoint"));
    assert!(checkpoint.join("kiln.json").is_file(), "no checkpoint kept");
    // Every image belongs to the box's root on the host (100000 by default): the restored
    // processes open some themselves, and CRIU writes a few readable by root alone (a
    // restore failed 3 times in 20 on `timens-0.img` before).
    for image in std::fs::read_dir(checkpoint.join("images"))? {
        let image = image?;
        let owner = std::os::unix::fs::MetadataExt::uid(&image.metadata()?);
        assert_eq!(owner, 100_000, "{:?}", image.path());
    }

    // A keystroke wakes it: the shell still knows its variable.
    keys(&mut socket, "echo again-$X\r")?;
    until(&mut socket, &mut seen, "again-kiln-42", &mut controls)?;
    assert!(!checkpoint.exists(), "a checkpoint is used once");
    assert_eq!(turn(&server, "print(v + 1)")?, "42\n");
    assert_eq!(count(&server)?, "3");

    // Hibernated again, kiln is killed (-9), and on a new kiln preview traffic brings it
    // back.
    let (status, slept) =
        server.call("POST", &format!("/api/v1/sandboxes/{id}/hibernate"), None)?;
    assert_eq!(status, 200, "{slept}");
    drop(socket);
    let key = server.key.clone();
    let mut server = server;
    // SAFETY: kill sends a signal to the server's pid, which this test started.
    unsafe { libc::kill(server.child.0.id() as i32, libc::SIGKILL) };
    server.child.0.wait()?;
    let mut server = start(options())?;
    server.key = key;
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(info["state"], "hibernated", "{info}");
    assert_eq!(count(&server)?, "4");
    let (_, events) = server.call("GET", &format!("/api/v1/sandboxes/{id}/events"), None)?;
    assert!(
        events.to_string().contains("restored from its checkpoint"),
        "{events}"
    );

    // A checkpoint that no longer restores: the files are kept, the processes are not, and
    // the events say why.
    let (status, slept) =
        server.call("POST", &format!("/api/v1/sandboxes/{id}/hibernate"), None)?;
    assert_eq!(status, 200, "{slept}");
    for image in std::fs::read_dir(checkpoint.join("images"))? {
        let image = image?.path();
        if image.to_string_lossy().contains("pages-") {
            std::fs::remove_file(image)?;
        }
    }
    let ran = sh(
        &server,
        &id,
        "cat /var/tmp/outside; pgrep -f 'counter[.]py 8000' >/dev/null && echo still || echo gone",
    )?;
    assert_eq!(ran["stdout"], "kept\ngone\n", "{ran}");
    let (_, events) = server.call("GET", &format!("/api/v1/sandboxes/{id}/events"), None)?;
    assert!(
        events.to_string().contains("could not be restored"),
        "{events}"
    );
    assert!(!checkpoint.exists(), "a failed checkpoint is removed");
    Ok(())
}

/// Issue 34: a microVM sandbox (`vm-python`) is interactive as a box is: a terminal (its
/// size seen by the shell), a preview of a server in it, pause (its VMM frozen; its
/// processes, read through its frozen agent, answer at once and empty) and resume by the
/// next command, and hibernation (its workspace kept, its processes not: said).
#[test]
fn issue34_a_vm_sandbox_has_terminals_previews_pause_and_hibernation() -> TestResult {
    if skip() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        auth: true,
        extra: &["--linux", "--vm", "--target-pool-size", "0"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let id = new_box(&server, "vm-python")?;
    // The first command boots the VM (seconds under a software CPU).
    let ran = sh(&server, &id, "uname -r; echo hello > index.html")?;
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    assert_ne!(
        ran["stdout"].as_str().unwrap_or_default().lines().next(),
        Some(kernel.trim())
    );

    // A terminal.
    let (status, opened) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/terminals"),
        Some(json!({"cols": 100, "rows": 30})),
    )?;
    assert_eq!(status, 201, "{opened}");
    let tid = opened["terminalId"].as_str().ok_or("no id")?.to_string();
    let mut socket = attach(&server, &id, &tid, "", None)?;
    let (mut seen, mut controls) = (Vec::new(), Vec::new());
    let hello = control(&mut socket, &mut seen)?;
    assert_eq!(hello["type"], "attached", "{hello}");
    keys(&mut socket, "stty size; echo sum=$((6*7))\n")?;
    until(&mut socket, &mut seen, "sum=42", &mut controls)?;
    assert!(
        String::from_utf8_lossy(&seen).contains("30 100"),
        "{}",
        String::from_utf8_lossy(&seen)
    );
    drop(socket);

    // A preview of a server in the VM.
    let (status, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/exec"),
        Some(json!({
            "command": ["sh", "-c", "python3 server.py 8000 >/dev/null 2>&1 &"],
            "files": {"server.py": SERVER_PY},
        })),
    )?;
    assert_eq!(status, 200, "{ran}");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, ports) = server.call("GET", &format!("/api/v1/sandboxes/{id}/ports"), None)?;
        if ports["ports"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["port"] == 8000))
        {
            break;
        }
        assert!(Instant::now() < deadline, "nothing listened: {ports}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let key = server.key.clone().ok_or("no key")?;
    let preview = || -> Res<(u16, String)> {
        let reply = send(
            "GET",
            &server.url(&format!("/preview/{id}/8000/index.html")),
            Some(&key),
            None,
        )?;
        Ok((
            reply.status,
            String::from_utf8_lossy(&reply.body).into_owned(),
        ))
    };
    assert_eq!(preview()?, (200, "hello\n".to_string()));

    // Paused: its VMM frozen; what is read through its agent answers at once.
    let (status, paused) = server.call("POST", &format!("/api/v1/sandboxes/{id}/pause"), None)?;
    assert_eq!(
        (status, paused["state"].clone()),
        (200, json!("paused")),
        "{paused}"
    );
    let asked = Instant::now();
    let list = listed(&server, &id)?;
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "{:?}",
        asked.elapsed()
    );
    assert_eq!(list["state"], "paused", "{list}");
    let ran = sh(&server, &id, "echo awake")?;
    assert_eq!(ran["stdout"], "awake\n", "{ran}");
    assert_eq!(
        preview()?,
        (200, "hello\n".to_string()),
        "the server goes on after the resume"
    );

    // Hibernated: the workspace is kept, the VM's processes are not, and it says so.
    let (status, slept) =
        server.call("POST", &format!("/api/v1/sandboxes/{id}/hibernate"), None)?;
    assert_eq!(status, 200, "{slept}");
    assert!(slept.to_string().contains("microVM"), "{slept}");
    let ran = sh(
        &server,
        &id,
        "cat index.html; pgrep -x python3 || echo gone",
    )?;
    assert_eq!(ran["stdout"], "hello\ngone\n", "{ran}");

    // Its VMM killed under a running command: the command answers EXECUTOR_LOST, and the
    // next one gets a new VM.
    let running = {
        let (url, key) = (
            server.url(&format!("/api/v1/sandboxes/{id}/exec")),
            key.clone(),
        );
        std::thread::spawn(move || {
            send(
                "POST",
                &url,
                Some(&key),
                Some((
                    "application/json",
                    json!({"command": ["sleep", "60"]}).to_string().as_bytes(),
                )),
            )
            .map_err(|e| e.to_string())
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let vmms = loop {
        let found = crate::linux::vmms_of(state.path());
        // The command runs once the VM's `sleep` shows among its processes.
        let sleeping = listed(&server, &id)?.to_string().contains("\"sleep\"");
        if found.len() == 1 && sleeping {
            break found;
        }
        assert!(Instant::now() < deadline, "no running VM: {found:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    // SAFETY: kill sends a signal to a pid this test found (this server's one QEMU).
    unsafe { libc::kill(vmms[0], libc::SIGKILL) };
    let lost = running
        .join()
        .map_err(|_| "the request thread panicked")??;
    let said = String::from_utf8_lossy(&lost.body).into_owned();
    assert!(
        lost.status == 503 && said.contains("EXECUTOR_LOST") && said.contains("VM ended"),
        "{} {said}",
        lost.status
    );
    let ran = sh(&server, &id, "cat index.html")?;
    assert_eq!(ran["stdout"], "hello\n", "{ran}");
    Ok(())
}
