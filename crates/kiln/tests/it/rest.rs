//! `kiln rest` end to end: a real `kiln rest` process, real HTTP, real sandboxes and files;
//! plans from the offline conventions planner or from a provider test server speaking the
//! OpenAI protocol.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiln_llm::fake::{FakeProvider, Step};
use serde_json::{Value, json};

/// Seed 000's plans and code contract (issue 16).
#[path = "rest_seed.rs"]
mod seed;

const KILN: &str = env!("CARGO_BIN_EXE_kiln");

struct Rest {
    child: Child,
    base: String,
    data: PathBuf,
    log: PathBuf,
}

impl Drop for Rest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Rest {
    fn start(data: &Path, args: &[&str], env: &[(&str, String)]) -> Rest {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = data.with_extension(format!("{port}.log"));
        let mut command = Command::new(KILN);
        command
            .args(["rest", "--listen", &format!("127.0.0.1:{port}")])
            .args(if args.contains(&"--workers") {
                &[][..]
            } else {
                &["--workers", "1"][..]
            })
            .args(args)
            .arg("--data-dir")
            .arg(data)
            .env_remove("KILN_LLM_MODEL")
            .env_remove("AUTH_TOKEN")
            .env("KILN_LLM_RETRY_DELAY_MS", "10")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        for (k, v) in env {
            command.env(k, v);
        }
        let child = command.spawn().unwrap();
        let base = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(60);
        while ureq::get(&format!("{base}/healthz")).call().is_err() {
            assert!(Instant::now() < deadline, "kiln rest did not come up");
            std::thread::sleep(Duration::from_millis(50));
        }
        Rest {
            child,
            base,
            data: data.to_path_buf(),
            log,
        }
    }

    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> Answer {
        let mut request =
            ureq::request(method, &format!("{}{path}", self.base)).timeout(Duration::from_secs(60));
        for (k, v) in headers {
            request = request.set(k, v);
        }
        let result = match body {
            Some(body) => request
                .set("content-type", "application/json")
                .send_string(body),
            None => request.call(),
        };
        let response = match result {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{method} {path}: {e}"),
        };
        let header = |name: &str| response.header(name).map(str::to_string);
        let (location, planner, cache, allow, retry_after, content_type) = (
            header("location"),
            header("x-kiln-planner"),
            header("x-kiln-plan-cache"),
            header("allow"),
            header("retry-after"),
            header("content-type"),
        );
        let status = response.status();
        let text = response.into_string().unwrap_or_default();
        Answer {
            status,
            json: serde_json::from_str(&text).unwrap_or(Value::Null),
            text,
            location,
            planner,
            cache,
            allow,
            retry_after,
            content_type,
        }
    }

    fn get(&self, path: &str) -> Answer {
        self.call("GET", path, None, &[])
    }

    fn send(&self, method: &str, path: &str, body: Value) -> Answer {
        self.call(method, path, Some(&body.to_string()), &[])
    }

    fn logs(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    fn plans(&self, extra: &[&str]) -> Value {
        let out = Command::new(KILN)
            .args(["rest", "plans", "--data-dir"])
            .arg(&self.data)
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    fn stop(self) {}
}

#[derive(Debug)]
struct Answer {
    status: u16,
    json: Value,
    text: String,
    location: Option<String>,
    planner: Option<String>,
    cache: Option<String>,
    allow: Option<String>,
    retry_after: Option<String>,
    content_type: Option<String>,
}

impl Answer {
    /// Asserts the documented error shape `{"error": {"code", "message", "request_id"}}`
    /// with this status and code.
    fn assert_error(&self, status: u16, code: &str) {
        assert_eq!(
            (self.status, self.json["error"]["code"].as_str()),
            (status, Some(code)),
            "{self:?}"
        );
        assert_eq!(
            self.content_type.as_deref(),
            Some("application/json"),
            "{self:?}"
        );
        let error = self.json["error"].as_object().unwrap();
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{self:?}"
        );
        assert!(
            error["request_id"].as_str().is_some_and(|m| !m.is_empty()),
            "{self:?}"
        );
    }

    fn retry_after_seconds(&self) -> u64 {
        self.retry_after
            .as_deref()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no Retry-After in {self:?}"))
    }
}

#[test]
fn rest_conventions_without_an_llm() {
    let dir = tempfile::tempdir().unwrap();
    let rest = Rest::start(&dir.path().join("data"), &["--planner", "conventions"], &[]);

    // POST → 201, Location, the object with its id.
    let a = rest.send(
        "POST",
        "/members/",
        json!({"name": "Hartmann", "city": "Bonn"}),
    );
    assert_eq!(a.status, 201, "{a:?}");
    assert_eq!(a.location.as_deref(), Some("/members/1"));
    assert_eq!(a.json, json!({"name": "Hartmann", "city": "Bonn", "id": 1}));
    assert_eq!(a.planner.as_deref(), Some("conventions (not an LLM)"));
    assert_eq!(a.cache.as_deref(), Some("stored"));
    let b = rest.send("POST", "/members", json!({"name": "Adams", "city": "Köln"}));
    assert_eq!((b.status, b.location.as_deref()), (201, Some("/members/2")));
    assert_eq!(
        b.cache.as_deref(),
        Some("hit"),
        "the create plan was cached"
    );
    let c = rest.send("POST", "/members/", json!({"id": "zed", "name": "Zed"}));
    assert_eq!(
        (c.status, c.location.as_deref()),
        (201, Some("/members/zed")),
        "a client's string id is kept"
    );
    let again = rest.send("POST", "/members/", json!({"id": "zed"}));
    assert_eq!(again.status, 409, "{again:?}");
    let next = rest.send("POST", "/members/", json!({"name": "Next"}));
    assert_eq!(next.json["id"], 3, "integer ids continue from the largest");

    // GET by id → 200 / 404; the second GET of the shape is a cache hit.
    let got = rest.get("/members/1");
    assert_eq!(
        (got.status, got.json["name"].as_str()),
        (200, Some("Hartmann"))
    );
    assert_eq!(got.cache.as_deref(), Some("stored"));
    let got = rest.get("/members/2");
    assert_eq!((got.status, got.cache.as_deref()), (200, Some("hit")));
    assert_eq!(got.planner.as_deref(), Some("conventions (not an LLM)"));
    let missing = rest.get("/members/99");
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json["error"]["code"], "NOT_FOUND");
    assert_eq!(rest.get("/members/zed").json["name"], "Zed");

    // PUT replaces, PATCH merges.
    let put = rest.send(
        "PUT",
        "/members/1",
        json!({"name": "Hartmann", "tier": "gold"}),
    );
    assert_eq!(
        put.json,
        json!({"name": "Hartmann", "tier": "gold", "id": 1})
    );
    let patch = rest.send(
        "PATCH",
        "/members/1",
        json!({"city": "Aachen", "tier": null}),
    );
    assert_eq!(
        patch.json,
        json!({"name": "Hartmann", "id": 1, "city": "Aachen"})
    );
    assert_eq!(rest.send("PUT", "/members/77", json!({"x": 1})).status, 404);

    // search, paging and sorting.
    let found = rest.get("/members/search?name=hartmann");
    assert_eq!(found.status, 200);
    assert_eq!(found.json.as_array().map(Vec::len), Some(1), "{found:?}");
    assert_eq!(found.json[0]["id"], 1);
    let part = rest.get("/members/search?city__contains=k%C3%B6");
    assert_eq!(part.json[0]["name"], "Adams", "{part:?}");
    for i in 0..25 {
        rest.send("POST", "/books/", json!({"title": format!("t{i:02}")}));
    }
    let page = rest.get("/books/?limit=10&offset=20&sort=title");
    assert_eq!(
        page.json["page"],
        json!({"limit": 10, "offset": 20, "total": 25})
    );
    let titles: Vec<&str> = page.json["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["title"].as_str().unwrap())
        .collect();
    assert_eq!(titles, ["t20", "t21", "t22", "t23", "t24"]);
    let desc = rest.get("/books/?limit=2&sort=-title");
    assert_eq!(desc.json["items"][0]["title"], "t24");
    assert_eq!(rest.get("/books/?limit=x").status, 400);

    // DELETE → 204, then 404.
    let deleted = rest.call("DELETE", "/members/2", None, &[]);
    assert_eq!((deleted.status, deleted.text.as_str()), (204, ""));
    assert_eq!(rest.get("/members/2").status, 404);
    assert_eq!(rest.call("DELETE", "/members/2", None, &[]).status, 404);

    // Malformed and wrong-shaped bodies → 400, and nothing is written.
    let before = std::fs::read(rest.data.join("tenants/public/members.json")).unwrap();
    let bad = rest.call("POST", "/members/", Some("{\"name\": "), &[]);
    assert_eq!(
        (bad.status, bad.json["error"]["code"].as_str()),
        (400, Some("MALFORMED_JSON"))
    );
    assert_eq!(rest.send("POST", "/members/", json!([1, 2])).status, 400);
    assert_eq!(rest.send("PATCH", "/members/1", json!("text")).status, 400);
    assert_eq!(
        std::fs::read(rest.data.join("tenants/public/members.json")).unwrap(),
        before
    );

    // OPTIONS, HEAD, unknown methods and shapes.
    let options = rest.call("OPTIONS", "/members/", None, &[]);
    assert_eq!(
        (options.status, options.allow.as_deref()),
        (204, Some("GET, HEAD, POST, OPTIONS"))
    );
    let head = rest.call("HEAD", "/members/1", None, &[]);
    assert_eq!((head.status, head.text.as_str()), (200, ""));
    assert_eq!(rest.call("POST", "/members/1", Some("{}"), &[]).status, 405);
    assert_eq!(rest.call("TRACE", "/members/1", None, &[]).status, 405);
    assert_eq!(rest.get("/a/b/c").status, 404);
    assert_eq!(
        rest.get("/").json["collections"],
        json!(["books", "members"])
    );

    // The plan cache: persisted, inspectable, clearable; the hit rate is reported.
    let plans = rest.plans(&[]);
    let public = plans
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tenant"] == "public")
        .unwrap()
        .clone();
    assert!(public["hits"].as_u64().unwrap() >= 20, "{public}");
    let patterns: Vec<&str> = public["plans"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pattern"].as_str().unwrap())
        .collect();
    for want in [
        "POST /members",
        "GET /members/{id}",
        "GET /members/search",
        "GET /books",
        "DELETE /members/{id}",
    ] {
        assert!(patterns.contains(&want), "{want} missing from {patterns:?}");
    }
    let health = rest.get("/healthz");
    assert!(
        health.json["plan_cache"]["hit_rate"].as_f64().unwrap() > 0.5,
        "{health:?}"
    );
    let cleared = rest.plans(&["--tenant", "public", "--clear"]);
    assert!(cleared[0]["cleared"].as_u64().unwrap() >= 5);
    assert_eq!(
        rest.get("/members/1").cache.as_deref(),
        Some("stored"),
        "cleared: planned again"
    );

    // The logs: one JSON line per request, planner labelled, cache outcome, no secrets.
    let logs = rest.logs();
    let line = logs.iter().find(|l| l["path"] == "/members/99").unwrap();
    assert_eq!(line["planner"], "conventions (not an LLM)");
    assert_eq!(line["cache"], "hit");
    assert_eq!(line["status"], 404);
    assert!(line["ms"].as_f64().is_some() && line["request_id"].is_string());
    assert!(logs.iter().any(|l| l["outcome"] == "MALFORMED_JSON"));
}

#[test]
fn tenants_are_apart_and_everything_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let rest = Rest::start(&data, &["--planner", "conventions"], &[]);
    let as_tenant = |t: &'static str| [("x-session-id", t)];
    for (tenant, name) in [("alice", "A1"), ("alice", "A2"), ("bob", "B1")] {
        let body = json!({"name": name}).to_string();
        let a = rest.call("POST", "/notes/", Some(&body), &as_tenant(tenant));
        assert_eq!(a.status, 201);
    }
    let alice = rest.call("GET", "/notes/", None, &as_tenant("alice"));
    assert_eq!(alice.json["page"]["total"], 2);
    let bob = rest.call("GET", "/notes/1", None, &as_tenant("bob"));
    assert_eq!(bob.json["name"], "B1");
    assert_eq!(
        rest.call("GET", "/notes/2", None, &as_tenant("bob")).status,
        404,
        "bob never sees alice's"
    );
    assert_eq!(
        rest.get("/notes/").json["page"]["total"],
        0,
        "nor does the public tenant"
    );
    let bad = rest.call("GET", "/notes/", None, &[("x-session-id", "../alice")]);
    assert_eq!(
        (bad.status, bad.json["error"]["code"].as_str()),
        (400, Some("INVALID_SESSION_ID"))
    );
    rest.stop();

    // A restart finds every tenant's data and plans.
    let rest = Rest::start(
        &data,
        &["--planner", "conventions", "--idle-timeout", "1"],
        &[],
    );
    let alice = rest.call("GET", "/notes/", None, &as_tenant("alice"));
    assert_eq!(alice.json["page"]["total"], 2, "{alice:?}");
    assert_eq!(
        alice.cache.as_deref(),
        Some("hit"),
        "the plan cache persisted"
    );
    let b = rest.call(
        "POST",
        "/notes/",
        Some("{\"name\": \"B2\"}"),
        &as_tenant("bob"),
    );
    assert_eq!(b.json["id"], 2);
    assert_eq!(rest.get("/healthz").json["tenant_sessions"], 2);

    // Idle tenants' sandboxes are closed; their data stays.
    std::thread::sleep(Duration::from_millis(3500));
    assert_eq!(rest.get("/healthz").json["tenant_sessions"], 0);
    let b = rest.call("GET", "/notes/2", None, &as_tenant("bob"));
    assert_eq!((b.status, b.json["name"].as_str()), (200, Some("B2")));
}

#[test]
fn fifty_concurrent_posts_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let rest = Rest::start(
        &dir.path().join("data"),
        &["--planner", "conventions", "--workers", "2"],
        &[],
    );
    let ids: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..50)
            .map(|i| {
                let rest = &rest;
                s.spawn(move || {
                    let a = rest.send("POST", "/orders/", json!({"n": i}));
                    assert_eq!(a.status, 201, "{a:?}");
                    a.json["id"].clone()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut ids: Vec<u64> = ids.iter().map(|v| v.as_u64().unwrap()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 50, "50 distinct ids");
    let all = rest.get("/orders/?limit=1000");
    assert_eq!(all.json["page"]["total"], 50);
    let mut ns: Vec<u64> = all.json["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["n"].as_u64().unwrap())
        .collect();
    ns.sort_unstable();
    assert_eq!(ns, (0..50).collect::<Vec<_>>(), "every write is there");
}

#[test]
fn attack_hostile_requests_get_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let rest = Rest::start(
        &dir.path().join("data"),
        &["--planner", "conventions", "--max-body", "64k"],
        &[("AUTH_TOKEN", "s3cret-token".into())],
    );
    let auth = [("authorization", "Bearer s3cret-token")];
    let none = rest.get("/members/");
    assert_eq!(
        (none.status, none.json["error"]["code"].as_str()),
        (401, Some("UNAUTHORIZED"))
    );
    let wrong = rest.call(
        "GET",
        "/members/",
        None,
        &[("authorization", "Bearer nope")],
    );
    assert_eq!(wrong.status, 401);
    assert_eq!(rest.get("/healthz").status, 200, "healthz needs no token");
    assert_eq!(
        rest.get("/openapi.json").json["paths"]["/{path}"]["get"]["operationId"],
        "rest_get"
    );
    assert!(rest.get("/docs").text.contains("swagger-ui"));
    assert!(rest.get("/redoc").text.contains("redoc"));

    let ok = rest.call("POST", "/members/", Some("{\"name\": \"x\"}"), &auth);
    assert_eq!(ok.status, 201);
    // Without X-Session-ID the tenant comes from the key.
    let tenants: Vec<String> = std::fs::read_dir(rest.data.join("tenants"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(tenants.len(), 1);
    assert!(
        tenants[0].starts_with("key-") && !tenants[0].contains("s3cret"),
        "{tenants:?}"
    );

    // Refused from the declared length, before the body is sent (`Expect: 100-continue`).
    {
        use std::io::{Read as _, Write as _};
        let address = rest.base.trim_start_matches("http://").to_string();
        let mut stream = std::net::TcpStream::connect(&address).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        write!(
            stream,
            "POST /members/ HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer s3cret-token\r\n\
             Content-Type: application/json\r\nContent-Length: 70000\r\nExpect: 100-continue\r\n\r\n"
        )
        .unwrap();
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"HTTP/1.1 413", "{}", String::from_utf8_lossy(&head));
    }
    // A body without a declared length (chunked) is cut off at the limit while it is read.
    let chunked = ureq::post(&format!("{}/members/", rest.base))
        .set("authorization", "Bearer s3cret-token")
        .set("content-type", "application/json")
        .send(std::io::Cursor::new(vec![b' '; 60_000]).chain(std::io::repeat(b' ').take(20_000)));
    match chunked {
        Err(ureq::Error::Status(413, _)) => {}
        // The server may close before reading it all; then no answer reaches the client.
        Err(ureq::Error::Transport(_)) => {}
        other => panic!("{other:?}"),
    }
    for path in [
        "/..%2F..%2Fetc/passwd",
        "/members/%00",
        "/members/%ff",
        "/members/a%2Fb",
    ] {
        let a = rest.call("GET", path, None, &auth);
        assert_eq!(
            (a.status, a.json["error"]["code"].as_str()),
            (400, Some("INVALID_PATH")),
            "{path}"
        );
    }
    // In token mode new tenants are not rate-limited by default: the token's holder (one
    // backend address) names the tenants of all its users.
    for n in 0..31 {
        let tenant = format!("user{n}");
        let a = rest.call(
            "GET",
            "/members/",
            None,
            &[auth[0], ("x-session-id", tenant.as_str())],
        );
        assert_eq!(a.status, 200, "{a:?}");
    }
    let odd = rest.call("GET", "/no%20such!/", None, &auth);
    assert_eq!(odd.status, 400, "{odd:?}");
    // Collections never leave the tenant's folder.
    let dotted = rest.call("POST", "/.hidden/", Some("{}"), &auth);
    assert_eq!(dotted.status, 400);
    assert!(
        !rest.logs().iter().any(|l| l.to_string().contains("s3cret")),
        "the token is never logged"
    );
}

#[test]
fn the_docs_explain_the_catch_all_in_a_browser() {
    let dir = tempfile::tempdir().unwrap();
    let rest = Rest::start(&dir.path().join("data"), &["--planner", "conventions"], &[]);
    let swagger = crate::common::rendered(&format!("{}/docs", rest.base)).unwrap();
    for needle in [
        "opblock",
        "/{path}",
        "Create (POST /members/",
        "no fixed endpoints",
    ] {
        assert!(
            swagger.contains(needle),
            "Swagger UI did not render {needle:?}:\n{}",
            &swagger[..swagger.len().min(2000)]
        );
    }
    let redoc = crate::common::rendered(&format!("{}/redoc", rest.base)).unwrap();
    for needle in [
        "Read, list or search",
        "X-Session-ID",
        "Delete (DELETE /members/1",
    ] {
        assert!(
            redoc.contains(needle),
            "ReDoc did not render {needle:?}:\n{}",
            &redoc[..redoc.len().min(2000)]
        );
    }
    // Issue 16: markdown took `<tenant>` and `<collection>` for HTML tags (`/data//.json`).
    for (page, dom) in [("Swagger UI", &swagger), ("ReDoc", &redoc)] {
        assert!(
            dom.contains("/data/&lt;tenant&gt;/&lt;collection&gt;.json")
                && !dom.contains("//.json"),
            "{page} does not show the data path as written"
        );
    }
}

// ------------------------------------------------------------------ the LLM planner

fn plan(action: &str, resource: &str, pattern: Option<&str>, code: &str) -> Step {
    Step::Text(
        json!({
            "action": action,
            "resource": resource,
            "id": null,
            "criteria": {},
            "payload": null,
            "response_hints": {},
            "cache": {"generic": pattern.is_some(), "pattern": pattern},
            "code": {"language": "python", "block": format!("```python\n{code}\n```")},
        })
        .to_string(),
    )
}

const CREATE: &str = r#"body = ctx["body"]
if not isinstance(body, dict):
    raise BadRequest("the body must be a JSON object")
col = store.collection("members")
new_id = col.insert(body)
REPLY = {"status": 201, "headers": {"Location": "/members/" + quote(str(new_id))}, "body": col.get(new_id)}"#;

const READ: &str = r#"item = store.collection("members").get(ctx["params"]["id"])
if item is None:
    raise NotFound("no such member")
REPLY = {"status": 200, "headers": {}, "body": item}"#;

#[tokio::test(flavor = "multi_thread")]
async fn the_llm_planner_plans_through_the_door_and_its_code_is_checked() {
    let audit = "store.collection(\"audit\").insert({\"ran\": True})\n";
    let fake = FakeProvider::start(vec![
        plan("create", "members", Some("POST /members"), CREATE),
        plan("read", "members", Some("GET /members/{id}"), READ),
        // What the code sees of the request: no credentials.
        plan("read", "echo", None, "REPLY = {'status': 200, 'headers': {'X-Seen': 'yes'}, 'body': {'headers': ctx['headers'], 'tenant': ctx['tenant'], 'query': ctx['query']}}"),
        // Unsafe plans: refused, nothing runs.
        plan("create", "audit", None, &format!("{audit}import os\nREPLY = {{'status': 200, 'body': os.listdir('/')}}")),
        plan("read", "audit", None, &format!("{audit}REPLY = {{'status': 200, 'body': open('/etc/passwd').read()}}")),
        plan("read", "audit", None, &format!("{audit}REPLY = {{'status': 200, 'body': str(().__class__.__base__.__subclasses__())}}")),
        plan("read", "audit", None, &format!("{audit}import socket\nsocket.create_connection(('127.0.0.1', 80))")),
        plan("read", "audit", None, &format!("{audit}REPLY = {{'status': 200, 'body': str(getattr(ctx, 'pop'))}}")),
        plan("read", "audit", None, &format!("{audit}try:\n    x = 1\nexcept:\n    pass\nREPLY = {{'status': 200}}")),
        // Allowed modules offer their public functions only, never the modules they use.
        plan("read", "modules", None, "import json\nREPLY = {'status': 200, 'body': str(json.codecs)}"),
        // Invalid answers.
        Step::Text("Sure! Here is the plan: {not json".into()),
        Step::Text(json!({"action": "read"}).to_string()),
        Step::Text(json!({"action": "read", "resource": "x", "id": null, "criteria": {}, "payload": null, "response_hints": {}, "code": {"language": "python", "block": "```python\nREPLY={}\n```\n```python\nREPLY={}\n```"}}).to_string()),
        // Runaway code: stopped at the deadline; the tenant's next request is served.
        plan("read", "spin", None, "while True:\n    pass"),
        // A result over the cap.
        plan("read", "huge", None, "REPLY = {'status': 200, 'headers': {}, 'body': 'x' * (3 << 20)}"),
        // A plan that raises, and one that forgets REPLY.
        plan("read", "boom", None, "x = {}\ny = x['missing']"),
        plan("read", "noreply", None, "x = 1"),
        // The provider fails: three attempts, then 502.
        Step::Status(500),
        Step::Status(500),
        Step::Status(500),
    ])
    .await
    .unwrap();
    let env = vec![
        (
            "KILN_LLM_MODEL",
            "openai-compatible:planner-test".to_string(),
        ),
        ("KILN_LLM_BASE_URL", fake.base_url.clone()),
        ("OPENAI_API_KEY", "sk-never-in-the-sandbox".to_string()),
    ];
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let rest = tokio::task::spawn_blocking({
        let data = data.clone();
        move || Rest::start(&data, &["--deadline", "2", "--max-result", "1m"], &env)
    })
    .await
    .unwrap();
    let rest = std::sync::Arc::new(rest);
    let r = rest.clone();
    tokio::task::spawn_blocking(move || {
        let rest = r;
        let created = rest.send("POST", "/members/", json!({"name": "Hartmann"}));
        assert_eq!(
            (created.status, created.location.as_deref()),
            (201, Some("/members/1")),
            "{created:?}"
        );
        let planner = created.planner.clone().unwrap();
        assert!(
            planner.starts_with("llm ") && planner.ends_with(":planner-test"),
            "{planner}"
        );
        let read = rest.get("/members/1");
        assert_eq!(
            (read.status, read.json["name"].as_str()),
            (200, Some("Hartmann"))
        );
        // Cached: answered without the planner.
        let again = rest.get("/members/1");
        assert_eq!((again.status, again.cache.as_deref()), (200, Some("hit")));
        assert_eq!(rest.get("/members/5").status, 404);
        let second = rest.send("POST", "/members/", json!({"name": "Adams"}));
        assert_eq!((second.status, second.cache.as_deref()), (201, Some("hit")));

        let echo = rest.call(
            "GET",
            "/echo/?q=1&q=2",
            None,
            &[
                ("authorization", "Bearer abc"),
                ("cookie", "a=b"),
                ("x-custom", "v"),
            ],
        );
        assert_eq!(echo.status, 200, "{echo:?}");
        let seen = &echo.json["headers"];
        assert!(
            seen.get("authorization").is_none() && seen.get("cookie").is_none(),
            "{seen}"
        );
        assert_eq!(seen["x-custom"], "v");
        assert_eq!(echo.json["query"], json!({"q": ["1", "2"]}));

        for what in [
            "os.listdir",
            "open(",
            "__class__",
            "import socket",
            "getattr",
            "bare except",
        ] {
            let a = rest.get("/audit/");
            assert_eq!(a.status, 502, "{what}: {a:?}");
            assert_eq!(a.json["error"]["code"], "PLAN_UNSAFE", "{what}: {a:?}");
            assert!(
                a.json["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("nothing ran"),
                "{a:?}"
            );
        }
        assert!(
            !rest.data.join("tenants/public/audit.json").exists(),
            "no unsafe plan ran at all"
        );
        let modules = rest.get("/modules/");
        assert_eq!(
            (modules.status, modules.json["error"]["code"].as_str()),
            (500, Some("CODE_FAILED"))
        );
        assert!(
            modules.json["error"]["message"]
                .as_str()
                .unwrap()
                .contains("codecs"),
            "{modules:?}"
        );

        for _ in 0..3 {
            let a = rest.get("/whatever/");
            assert_eq!(
                (a.status, a.json["error"]["code"].as_str()),
                (502, Some("PLAN_INVALID")),
                "{a:?}"
            );
        }
        let spin = rest.get("/spin/");
        assert_eq!(
            (spin.status, spin.json["error"]["code"].as_str()),
            (504, Some("DEADLINE_EXCEEDED")),
            "{spin:?}"
        );
        let huge = rest.get("/huge/");
        assert_eq!(
            (huge.status, huge.json["error"]["code"].as_str()),
            (502, Some("RESULT_TOO_LARGE")),
            "{huge:?}"
        );
        let boom = rest.get("/boom/");
        assert_eq!(
            (boom.status, boom.json["error"]["code"].as_str()),
            (500, Some("CODE_FAILED"))
        );
        assert!(
            boom.json["error"]["message"]
                .as_str()
                .unwrap()
                .contains("KeyError"),
            "{boom:?}"
        );
        let none = rest.get("/noreply/");
        assert_eq!(
            (none.status, none.json["error"]["code"].as_str()),
            (500, Some("NO_REPLY"))
        );
        let failed = rest.get("/members/search?name=x");
        assert_eq!(
            (failed.status, failed.json["error"]["code"].as_str()),
            (502, Some("LLM_FAILED")),
            "{failed:?}"
        );
        // After all that, the tenant's data is intact and cached plans still answer.
        assert_eq!(rest.get("/members/2").json["name"], "Adams");
        let line = rest
            .logs()
            .into_iter()
            .find(|l| l["path"] == "/members/1" && l["cache"] == "stored")
            .unwrap();
        assert_eq!(line["planner"].as_str(), Some(planner.as_str()));
        assert!(line["llm_tokens"]["input"].as_u64().unwrap() > 0, "{line}");
    })
    .await
    .unwrap();

    // What the provider was sent: the router prompt and the request; never the code's
    // results, and the key only as the provider's own credential (not in any body).
    let requests = fake.requests();
    assert_eq!(requests.len(), 20, "cache hits never reached the provider");
    let first = requests[0].to_string();
    assert!(
        first.contains("router and planner") && first.contains("/members/"),
        "{first}"
    );
    assert!(!first.contains("sk-never-in-the-sandbox"));
}

// ------------------------------------------------- anonymous load and error shapes (issue 13)

fn tenant_header(tenant: &str) -> [(&str, &str); 1] {
    [("x-session-id", tenant)]
}

/// Whether the tenant has a folder and a plan cache file on disk.
fn on_disk(rest: &Rest, tenant: &str) -> (bool, bool) {
    (
        rest.data.join("tenants").join(tenant).exists(),
        rest.data
            .join("plans")
            .join(format!("{tenant}.json"))
            .exists(),
    )
}

/// One raw HTTP/1.1 exchange: the response head and body (read to its `Content-Length`).
fn raw_exchange(base: &str, request: &str) -> (String, Vec<u8>) {
    use std::io::Write as _;
    let address = base.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    let (head, body_start) = loop {
        let read = stream.read(&mut buffer).unwrap();
        assert!(read > 0, "closed before a whole head");
        received.extend_from_slice(&buffer[..read]);
        if let Some(end) = received.windows(4).position(|w| w == b"\r\n\r\n") {
            break (
                String::from_utf8_lossy(&received[..end]).into_owned(),
                end + 4,
            );
        }
    };
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    let mut body = received[body_start..].to_vec();
    while body.len() < length {
        let read = stream.read(&mut buffer).unwrap();
        assert!(read > 0, "closed before the whole body");
        body.extend_from_slice(&buffer[..read]);
    }
    (head, body)
}

#[test]
fn issue_13_anonymous_tenants_past_the_cap_evict_the_least_recently_used() {
    let dir = tempfile::tempdir().unwrap();
    let rest = Rest::start(
        &dir.path().join("data"),
        &[
            "--planner",
            "conventions",
            "--max-sessions",
            "3",
            "--new-tenants-per-minute",
            "0",
        ],
        &[],
    );
    // Made-up tenants that only read: they store nothing.
    for n in 0..4 {
        let tenant = format!("reader{n}");
        rest.call("GET", "/things/1", None, &tenant_header(&tenant))
            .assert_error(404, "NOT_FOUND");
    }
    // reader0 was the least recently used when reader3 needed a session: closed, and it
    // left nothing on disk. reader3 is live (its folder is its sandbox's mount).
    assert_eq!(on_disk(&rest, "reader0"), (false, false));
    assert_eq!(on_disk(&rest, "reader3"), (true, true));

    for n in 0..6 {
        let tenant = format!("writer{n}");
        let created = rest.call(
            "POST",
            "/notes/",
            Some(&json!({"n": n}).to_string()),
            &tenant_header(&tenant),
        );
        assert_eq!(created.status, 201, "{created:?}");
    }
    for n in 0..4 {
        assert_eq!(
            on_disk(&rest, &format!("reader{n}")),
            (false, false),
            "reader{n}"
        );
    }
    let health = rest.get("/healthz");
    assert_eq!(health.status, 200);
    assert_eq!(
        (
            &health.json["tenant_sessions"],
            &health.json["max_tenant_sessions"],
            &health.json["evicted_sessions"],
        ),
        (&json!(3), &json!(3), &json!(7)),
        "10 sessions opened, 3 live: {health:?}"
    );

    // Every writer's data stayed; each read opens a session again, evicting another.
    for n in 0..6 {
        let tenant = format!("writer{n}");
        let read = rest.call("GET", "/notes/1", None, &tenant_header(&tenant));
        assert_eq!((read.status, &read.json["n"]), (200, &json!(n)), "{read:?}");
        assert_eq!(on_disk(&rest, &tenant), (true, true));
    }
    let health = rest.get("/healthz");
    assert_eq!(
        (
            &health.json["tenant_sessions"],
            &health.json["evicted_sessions"]
        ),
        (&json!(3), &json!(13)),
        "{health:?}"
    );
}

#[test]
fn issue_13_one_address_may_create_only_so_many_new_tenants_a_minute() {
    let dir = tempfile::tempdir().unwrap();
    let rest = Rest::start(
        &dir.path().join("data"),
        &[
            "--planner",
            "conventions",
            "--max-sessions",
            "2",
            "--new-tenants-per-minute",
            "3",
        ],
        &[],
    );
    for n in 0..3 {
        let tenant = format!("t{n}");
        let created = rest.call(
            "POST",
            "/notes/",
            Some(&json!({"by": n}).to_string()),
            &tenant_header(&tenant),
        );
        assert_eq!(created.status, 201, "{created:?}");
    }
    for method in ["POST", "GET"] {
        let refused = rest.call(method, "/notes/", Some("{}"), &tenant_header("t3"));
        refused.assert_error(429, "TOO_MANY_NEW_TENANTS");
        // Three a minute: the next one within 20 s.
        assert!(
            (1..=20).contains(&refused.retry_after_seconds()),
            "{refused:?}"
        );
    }
    assert_eq!(
        on_disk(&rest, "t3"),
        (false, false),
        "a refusal creates nothing"
    );

    // The address's tenants keep working, with a live session or not (t0's was closed to
    // make room: at most two).
    let read = rest.call("GET", "/notes/1", None, &tenant_header("t0"));
    assert_eq!(
        (read.status, &read.json["by"]),
        (200, &json!(0)),
        "{read:?}"
    );
    let more = rest.call("POST", "/notes/", Some("{\"by\": 1}"), &tenant_header("t1"));
    assert_eq!(
        (more.status, &more.json["id"]),
        (201, &json!(2)),
        "{more:?}"
    );
    assert_eq!(rest.get("/healthz").status, 200);
}

#[test]
fn issue_13_a_200_kb_body_is_served_the_first_time() {
    let dir = tempfile::tempdir().unwrap();
    let rest = Rest::start(&dir.path().join("data"), &["--planner", "conventions"], &[]);
    let lines: Vec<String> = (0..2000)
        .map(|i| format!("line {i:05} {}", "x".repeat(90)))
        .collect();
    let big = json!({"title": "big", "lines": lines});
    let text = big.to_string();
    assert!(text.len() > 200_000);

    let created = rest.call("POST", "/docs/", Some(&text), &[]);
    assert_eq!(
        (created.status, created.cache.as_deref()),
        (201, Some("stored")),
        "{:?}",
        created.json["error"]
    );
    assert_eq!(
        (&created.json["id"], &created.json["lines"]),
        (&json!(1), &big["lines"])
    );
    let read = rest.get("/docs/1");
    assert_eq!((read.status, &read.json["lines"]), (200, &big["lines"]));

    // PUT and PATCH of that size, each the first of its shape; PATCH near --max-body (1 MiB).
    let replaced = rest.call("PUT", "/docs/1", Some(&text), &[]);
    assert_eq!(
        (replaced.status, replaced.cache.as_deref()),
        (200, Some("stored")),
        "{:?}",
        replaced.json["error"]
    );
    let near_limit = json!({"blob": "y".repeat(1_000_000)}).to_string();
    assert!(near_limit.len() < 1 << 20);
    let patched = rest.call("PATCH", "/docs/1", Some(&near_limit), &[]);
    assert_eq!(patched.status, 200, "{:?}", patched.json["error"]);
    assert_eq!(patched.json["blob"].as_str().map(str::len), Some(1_000_000));
    assert_eq!(patched.json["lines"], big["lines"]);

    // The plan cache holds code, never a body.
    let plans = rest.plans(&["--code"]).to_string();
    assert!(
        plans.contains("PATCH /docs/{id}") && plans.len() < 20_000,
        "{} characters",
        plans.len()
    );
}

#[test]
fn issue_13_errors_kiln_rest_answers_itself_have_the_json_shape() {
    let dir = tempfile::tempdir().unwrap();
    let rest = Rest::start(
        &dir.path().join("data"),
        &["--planner", "conventions", "--max-body", "64k"],
        &[],
    );
    // 405 from the router on a fixed route, with its Allow header.
    for (method, path) in [("POST", "/healthz"), ("DELETE", "/openapi.json")] {
        let a = rest.call(method, path, None, &[]);
        a.assert_error(405, "METHOD_NOT_ALLOWED");
        assert!(
            a.allow.as_deref().is_some_and(|m| m.contains("GET")),
            "{a:?}"
        );
    }
    // 405 for a method the catch-all does not serve.
    let a = rest.call("TRACE", "/members/1", None, &[]);
    a.assert_error(405, "METHOD_NOT_ALLOWED");
    assert_eq!(
        a.allow.as_deref(),
        Some("GET, POST, PUT, PATCH, DELETE, OPTIONS, HEAD")
    );
    // 405 and 404 from the conventions planner (planned, then from the cached plan).
    for _ in 0..2 {
        let a = rest.call("POST", "/members/1", Some("{}"), &[]);
        a.assert_error(405, "METHOD_NOT_ALLOWED");
        assert_eq!(
            a.allow.as_deref(),
            Some("GET, HEAD, PUT, PATCH, DELETE, OPTIONS")
        );
        rest.get("/members/7").assert_error(404, "NOT_FOUND");
    }
    rest.get("/a/b/c").assert_error(404, "NOT_FOUND");
    // The caller's request id is the one in the body.
    let a = rest.call("POST", "/healthz", None, &[("x-request-id", "req-42")]);
    assert_eq!(a.json["error"]["request_id"], "req-42");

    // 413 from the declared length, before the body is sent.
    let (head, body) = raw_exchange(
        &rest.base,
        "POST /members/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: 70000\r\nExpect: 100-continue\r\n\r\n",
    );
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"]["code"], "BODY_TOO_LARGE", "{body}");
    assert!(body["error"]["request_id"].is_string(), "{body}");

    // 415: a body that is not JSON where the conventions need a JSON object.
    let typed = ureq::post(&format!("{}/members/", rest.base))
        .set("content-type", "text/plain")
        .send_string("name=Hartmann");
    let Err(ureq::Error::Status(415, response)) = typed else {
        panic!("{typed:?}")
    };
    let body: Value = serde_json::from_str(&response.into_string().unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "UNSUPPORTED_MEDIA_TYPE", "{body}");
    assert!(body["error"]["request_id"].is_string(), "{body}");
    assert!(
        !rest.data.join("tenants/public/members.json").exists(),
        "nothing was stored"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn issue_13_every_session_busy_is_503_and_the_llm_sees_a_large_body_cut_short() {
    let fake = FakeProvider::start(vec![
        // The first tenant's planning call never answers: its session stays busy.
        Step::Hang,
        plan("create", "members", Some("POST /members"), CREATE),
    ])
    .await
    .unwrap();
    let env = vec![
        (
            "KILN_LLM_MODEL",
            "openai-compatible:planner-test".to_string(),
        ),
        ("KILN_LLM_BASE_URL", fake.base_url.clone()),
        ("OPENAI_API_KEY", "sk-test".to_string()),
        ("KILN_LLM_TIMEOUT", "10".to_string()),
        ("KILN_LLM_RETRIES", "1".to_string()),
    ];
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let seen = fake.clone();
    tokio::task::spawn_blocking(move || {
        let rest = Rest::start(&data, &["--max-sessions", "1"], &env);
        let base = rest.base.clone();
        let holder = std::thread::spawn(move || {
            match ureq::get(&format!("{base}/members/"))
                .set("x-session-id", "holder")
                .timeout(Duration::from_secs(120))
                .call()
            {
                Ok(r) => r.status(),
                Err(ureq::Error::Status(status, _)) => status,
                Err(e) => panic!("{e}"),
            }
        });
        // Wait until the holder's request is with the model: it holds the only session.
        let deadline = Instant::now() + Duration::from_secs(60);
        while seen.requests().is_empty() {
            assert!(Instant::now() < deadline, "the holder never reached the model");
            std::thread::sleep(Duration::from_millis(20));
        }
        let big = json!({"name": "Big", "notes": (0..2000).map(|i| format!("note {i} {}", "z".repeat(90))).collect::<Vec<_>>()});
        let text = big.to_string();
        let refused = rest.call("POST", "/members/", Some(&text), &tenant_header("newcomer"));
        refused.assert_error(503, "TOO_MANY_SESSIONS");
        assert_eq!(refused.retry_after_seconds(), 1);
        assert_eq!(on_disk(&rest, "newcomer"), (false, false));
        let health = rest.get("/healthz");
        assert_eq!(
            (health.status, &health.json["tenant_sessions"]),
            (200, &json!(1))
        );

        // The holder's model call times out; then the newcomer is served, closing the idle
        // holder's session, which stored nothing and leaves nothing.
        assert_eq!(holder.join().unwrap(), 502);
        let created = rest.call("POST", "/members/", Some(&text), &tenant_header("newcomer"));
        assert_eq!(created.status, 201, "{:?}", created.json["error"]);
        assert_eq!(created.json["notes"], big["notes"]);
        assert_eq!(on_disk(&rest, "holder"), (false, false));
        assert_eq!(on_disk(&rest, "newcomer"), (true, true));
    })
    .await
    .unwrap();

    // The model was shown the 200 KB body cut short, with a marker saying so.
    let requests = fake.requests();
    assert_eq!(requests.len(), 2);
    let shown = requests[1].to_string();
    assert!(
        shown.len() < 20_000 && shown.contains("truncated"),
        "{} characters",
        shown.len()
    );
}

#[test]
fn kiln_rest_keeps_its_data_under_kiln_data_dir_when_given_no_folder() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(KILN)
        .args([
            "rest",
            "--planner",
            "conventions",
            "--workers",
            "1",
            "--listen",
        ])
        .arg(format!("127.0.0.1:{port}"))
        .env("KILN_DATA_DIR", dir.path())
        .env_remove("KILN_REST_DATA_DIR")
        .env_remove("KILN_LLM_MODEL")
        .env_remove("AUTH_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _child = Kill(child);
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while ureq::get(&format!("{base}/healthz")).call().is_err() {
        assert!(Instant::now() < deadline, "kiln rest did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    let created = ureq::post(&format!("{base}/members/"))
        .set("x-session-id", "datadir")
        .send_json(serde_json::json!({"name": "Hartmann"}))
        .unwrap();
    assert_eq!(created.status(), 201);
    assert!(
        dir.path().join("rest/tenants/datadir").is_dir(),
        "the tenant's data is not under $KILN_DATA_DIR/rest"
    );
}
