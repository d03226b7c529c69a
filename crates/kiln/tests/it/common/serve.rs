//! A `kiln serve` process for tests, and a small HTTP client. Every error body any test
//! receives is checked for the host path of any test server's data folder (issue 12: no
//! error message ever contains a host path).
#![allow(dead_code, reason = "each test binary uses a part")]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The data folders of every server started by this test binary.
static DATA_DIRS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Panics when an error body names a data folder (a host path).
pub fn check_no_host_path(status: u16, body: &[u8]) {
    if status < 400 {
        return;
    }
    let text = String::from_utf8_lossy(body);
    for dir in DATA_DIRS.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        assert!(
            !text.contains(dir.as_str()),
            "an error body names the server's data folder {dir}: {text}"
        );
    }
}

pub type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;
pub type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

pub const KILN: &str = env!("CARGO_BIN_EXE_kiln");

pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    /// Stopped as an operator would (SIGTERM: a server closes its boxes, thawing paused
    /// ones, which nothing would clean once the test's state folder is gone), killed if it
    /// has not ended in 10 s.
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            // SAFETY: kill sends a signal to the child's pid, which this test started and
            // has not reaped (try_wait said it still runs).
            unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while std::time::Instant::now() < deadline {
                if let Ok(Some(_)) = self.0.try_wait() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `kiln serve` on a free port, killed on drop.
pub struct Server {
    pub child: KillOnDrop,
    pub base: String,
    pub data: PathBuf,
    pub key: Option<String>,
    pub log: PathBuf,
    pub _dir: Option<tempfile::TempDir>,
}

#[derive(Default)]
pub struct Options<'a> {
    pub auth: bool,
    pub data: Option<&'a Path>,
    pub extra: &'a [&'a str],
    /// Environment variables for the server (and so its workers).
    pub env: &'a [(&'a str, &'a str)],
    /// An `/etc/hosts` for the server alone (it runs in a mount namespace of its own, with
    /// this file bound over the host's): names resolve where the test says.
    pub hosts: Option<&'a Path>,
}

pub fn kiln() -> Command {
    let mut command = Command::new(KILN);
    command.stdin(Stdio::null());
    command
}

pub fn create_key(data: &Path, tenant: Option<&str>) -> Res<String> {
    let mut command = kiln();
    command
        .args(["keys", "create", "--name", "test", "--data-dir"])
        .arg(data);
    if let Some(tenant) = tenant {
        command.args(["--tenant", tenant]);
    }
    let output = command.output()?;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?.trim().to_owned())
}

pub fn start(options: Options<'_>) -> Res<Server> {
    let (dir, data) = match options.data {
        Some(data) => (None, data.to_path_buf()),
        None => {
            let dir = tempfile::tempdir()?;
            let data = dir.path().join("data");
            (Some(dir), data)
        }
    };
    std::fs::create_dir_all(&data)?;
    for path in [data.clone(), data.canonicalize()?] {
        DATA_DIRS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(path.to_string_lossy().into_owned());
    }
    let key = if options.auth && !data.join("keys.json").exists() {
        Some(create_key(&data, None)?)
    } else {
        None
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let log = data.join(format!("serve-{port}.log"));
    let mut command = match options.hosts {
        None => kiln(),
        Some(hosts) => {
            let mut command = Command::new("unshare");
            command
                .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
                .arg("mount --bind \"$0\" /etc/hosts && exec \"$@\"")
                .arg(hosts)
                .arg(KILN)
                .stdin(Stdio::null());
            command
        }
    };
    command
        .args([
            "serve",
            "--workers",
            "2",
            "--log-format",
            "json",
            "--listen",
        ])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--data-dir")
        .arg(&data)
        .args(options.extra)
        .envs(options.env.iter().copied())
        .stderr(std::fs::File::create(&log)?);
    if !options.auth {
        command.arg("--no-auth");
    }
    let child = KillOnDrop(command.spawn()?);
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while ureq::get(&format!("{base}/healthz")).call().is_err() {
        if Instant::now() > deadline {
            return Err(format!(
                "kiln serve did not come up: {}",
                std::fs::read_to_string(&log)?
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(Server {
        child,
        base,
        data,
        key,
        log,
        _dir: dir,
    })
}

/// A response: status, headers we care about, body bytes.
pub struct Reply {
    pub status: u16,
    pub retry_after: Option<String>,
    pub request_id: Option<String>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

pub fn send(method: &str, url: &str, key: Option<&str>, body: Option<(&str, &[u8])>) -> Res<Reply> {
    let mut request = ureq::request(method, url).timeout(Duration::from_secs(120));
    if let Some(key) = key {
        request = request.set("authorization", &format!("Bearer {key}"));
    }
    let response = match body {
        Some((content_type, bytes)) => request.set("content-type", content_type).send_bytes(bytes),
        None => request.call(),
    };
    let response = match response {
        Ok(response) => response,
        Err(ureq::Error::Status(_, response)) => response,
        Err(e) => return Err(e.into()),
    };
    let status = response.status();
    let retry_after = response.header("retry-after").map(str::to_owned);
    let request_id = response.header("x-request-id").map(str::to_owned);
    let mut body = Vec::new();
    response.into_reader().read_to_end(&mut body)?;
    check_no_host_path(status, &body);
    Ok(Reply {
        status,
        retry_after,
        request_id,
        body,
    })
}

impl Server {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn call_as(
        &self,
        key: Option<&str>,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Res<(u16, Value)> {
        let text = body.map(|b| b.to_string());
        let reply = send(
            method,
            &self.url(path),
            key,
            text.as_deref().map(|t| ("application/json", t.as_bytes())),
        )?;
        Ok((reply.status, reply.json()))
    }

    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> Res<(u16, Value)> {
        self.call_as(self.key.as_deref(), method, path, body)
    }

    pub fn new_sandbox(&self, language: &str) -> Res<String> {
        let (status, body) = self.call(
            "POST",
            "/api/v1/sandboxes",
            Some(json!({"language": language})),
        )?;
        assert_eq!(status, 201, "{body}");
        Ok(body["containerId"].as_str().ok_or("no id")?.to_owned())
    }

    pub fn exec(&self, id: &str, body: Value) -> Res<(u16, Value)> {
        self.call("POST", &format!("/api/v1/sandboxes/{id}/exec"), Some(body))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// A Python HTTP server that counts the requests it answered, in memory: whether a box's
/// processes came back as they were (after a hibernation, in a snapshot's copies).
pub const COUNTER_PY: &str = r#"
import http.server, sys
count = 0
class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def do_GET(self):
        global count
        count += 1
        body = str(count).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("0.0.0.0", int(sys.argv[1])), Handler).serve_forever()
"#;

/// The body of `GET /preview/{id}/{port}/` once the box's server answers 200 (within 15 s).
pub fn preview_body(server: &Server, id: &str, port: u16) -> Res<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let reply = send(
            "GET",
            &server.url(&format!("/preview/{id}/{port}/")),
            server.key.as_deref(),
            None,
        )?;
        if reply.status == 200 {
            return Ok(String::from_utf8_lossy(&reply.body).into_owned());
        }
        if std::time::Instant::now() > deadline {
            return Err(format!(
                "{id}'s server on {port} never answered: {} {}",
                reply.status,
                String::from_utf8_lossy(&reply.body)
            )
            .into());
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}
